//! Wall time of `gpuci simulate` on the two-week synthetic trace (about 170,000 jobs, three
//! fleets, every policy and the best-fixed-idle sweep), and the figures of the sample week if it
//! is found, and of a held-out trace nothing was tuned on (`gen::generate(seed + 6, 14, 3000)`:
//! two sparse weeks, diurnal, with bursts of fix-up pushes, on the sample week's fleets). Each
//! trace also runs the gpuci policy with the fleets' idle settings removed (the defaults:
//! idle and stopped times from cost, stop where the provider can, `min_idle = 0`) beside the
//! settings of `traces/*.toml`, so the default policy is judged with no tuning.
//!
//! Run: `cargo run --release -p gpuci-simulate --example bench [SEED] [sample-only] [defaults-only]`
//! (`defaults-only`: only the gpuci policy with the default idle settings, on every trace). The trace is generated
//! in memory (`gen::two_weeks`), so nothing big is committed; everything is deterministic for a
//! seed, only the timings vary. `GPUCI_TRACE_OUT=path` also writes the generated trace as CSV.

use gpuci_simulate::{gen, run_cli, trace, CliOptions, Policy};
use std::time::Instant;

const FLEETS: &str = include_str!("../../../traces/two-weeks-fleets.toml");
const SAMPLE_FLEETS: &str = include_str!("../../../traces/sample-fleets.toml");
/// `defaults-only`: skip the runs of the fleets as configured (every policy and the sweep).
static DEFAULTS_ONLY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn defaults_only() -> bool {
    DEFAULTS_ONLY.load(std::sync::atomic::Ordering::Relaxed)
}

fn main() {
    let seed = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let opts = CliOptions { seed, ..CliOptions::default() };
    let flags: Vec<String> = std::env::args().skip(2).collect();
    DEFAULTS_ONLY.store(flags.iter().any(|f| f == "defaults-only"), std::sync::atomic::Ordering::Relaxed);
    if !flags.iter().any(|f| f == "sample-only") {
        two_weeks(seed, &opts);
    }
    sample_week(&opts);
    held_out(seed, &opts);
    held_out_issue28(seed, &opts);
}

/// Made after issue 28's learned rules (warm from history, fan-out, stopped machines by their
/// place in line) were written, and never tuned on: two sparser weeks (`gen::generate(seed +
/// 27, 14, 2000)`), and the same GPU jobs with a build each push's jobs wait on
/// (`gen::pipelines`), on the sample week's fleets.
fn held_out_issue28(seed: u64, opts: &CliOptions) {
    let fleets = sample_fleets();
    for (name, jobs) in [
        (format!("held-out 2 (gen::generate({}, 14, 2000))", seed + 27), gen::generate(seed + 27, 14, 2_000)),
        (
            format!("held-out 2 with builds (gen::pipelines({}, 14, 2000))", seed + 27),
            gen::pipelines(seed + 27, 14, 2_000),
        ),
    ] {
        let csv = trace::to_csv(&jobs);
        if !defaults_only() {
            match run_cli(&fleets, "traces/sample-fleets.toml", &csv, &name, opts) {
                Ok(report) => println!("\n{name}: {} jobs\n{report}", jobs.len()),
                Err(e) => eprintln!("{e}"),
            }
        }
        default_policy(&fleets, &csv, &name, opts);
    }
}

/// A trace no setting was tuned on: two weeks, about 3,000 jobs (sparse: a fifth of the
/// two-week trace's rate at peak … a few an hour at night), diurnal, with the generator's
/// bursts of fix-up pushes, on the sample week's fleets.
fn held_out(seed: u64, opts: &CliOptions) {
    let jobs = gen::generate(seed + 6, 14, 3_000);
    let csv = trace::to_csv(&jobs);
    let fleets = sample_fleets();
    let name = format!("held-out (gen::generate({}, 14, 3000))", seed + 6);
    if !defaults_only() {
        match run_cli(&fleets, "traces/sample-fleets.toml", &csv, &name, opts) {
            Ok(report) => println!("\n{name}: {} jobs\n{report}", jobs.len()),
            Err(e) => eprintln!("{e}"),
        }
    }
    default_policy(&fleets, &csv, &name, opts);
}

fn two_weeks(seed: u64, opts: &CliOptions) {
    let started = Instant::now();
    let jobs = gen::two_weeks(seed);
    let csv = trace::to_csv(&jobs);
    let generated = started.elapsed();
    if let Ok(path) = std::env::var("GPUCI_TRACE_OUT") {
        if let Err(e) = std::fs::write(&path, &csv) {
            eprintln!("cannot write {path}: {e}");
        }
    }
    let started = Instant::now();
    // GPUCI_FLEETS=path tries another fleet config (for tuning) without a rebuild.
    let fleets = std::env::var("GPUCI_FLEETS").ok().and_then(|p| std::fs::read_to_string(p).ok());
    let fleets = fleets.as_deref().unwrap_or(FLEETS);
    if defaults_only() {
        default_policy(fleets, &csv, "two-weeks.csv", opts);
        return;
    }
    match run_cli(fleets, "two-weeks-fleets.toml", &csv, "two-weeks.csv", opts) {
        Ok(report) => {
            let took = started.elapsed();
            println!("{report}");
            println!();
            println!(
                "two weeks: {} jobs generated in {:.2} s; parsed and simulated (4 policies, {} runs) in {:.2} s",
                jobs.len(),
                generated.as_secs_f64(),
                3 + report.sweep.len(),
                took.as_secs_f64()
            );
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
    default_policy(fleets, &csv, "two-weeks.csv", opts);
}

/// The gpuci policy on the same fleets with their idle settings removed: what a user who
/// follows the docs gets, no tuning to the trace.
fn default_policy(fleets: &str, trace: &str, trace_name: &str, opts: &CliOptions) {
    let untuned: String = fleets
        .lines()
        .filter(|l| !["idle_timeout", "idle_action", "min_idle"].iter().any(|k| l.trim_start().starts_with(k)))
        .map(|l| format!("{l}\n"))
        .collect();
    let opts = CliOptions { policies: vec![Policy::Gpuci], ..opts.clone() };
    match run_cli(&untuned, "(fleets, default idle settings)", trace, trace_name, &opts) {
        Ok(report) => println!("\n{trace_name}, gpuci with default idle settings (from cost, stop where the provider can, min_idle 0):\n{report}"),
        Err(e) => eprintln!("{e}"),
    }
}

fn sample_week(opts: &CliOptions) {
    let sample = "../shared/traces/sample_week.csv";
    match std::fs::read_to_string(sample) {
        // GPUCI_SAMPLE_FLEETS=path tries another fleet config (for tuning) without a rebuild.
        Ok(text) => {
            let fleets = sample_fleets();
            if !defaults_only() {
                match run_cli(&fleets, "traces/sample-fleets.toml", &text, sample, opts) {
                    Ok(report) => println!("\nsample week ({sample}):\n{report}"),
                    Err(e) => eprintln!("{e}"),
                }
            }
            default_policy(&fleets, &text, sample, opts);
        }
        Err(_) => eprintln!("{sample} not found (run from the repository root next to ../shared): skipped"),
    }
}

fn sample_fleets() -> String {
    match std::env::var("GPUCI_SAMPLE_FLEETS") {
        Ok(path) => std::fs::read_to_string(&path).unwrap_or_else(|e| {
            eprintln!("cannot read {path}: {e}; using traces/sample-fleets.toml");
            SAMPLE_FLEETS.to_string()
        }),
        Err(_) => SAMPLE_FLEETS.to_string(),
    }
}
