//! Wall time of `gpuci simulate` on the two-week synthetic trace (about 170,000 jobs, three
//! fleets, all three policies), and the figures of the sample week if it is found.
//!
//! Run: `cargo run --release -p gpuci-simulate --example bench [SEED] [sample-only]`. The trace is generated
//! in memory (`gen::two_weeks`), so nothing big is committed; everything is deterministic for a
//! seed, only the timings vary. `GPUCI_TRACE_OUT=path` also writes the generated trace as CSV.

use gpuci_simulate::{gen, run_cli, trace, CliOptions};
use std::time::Instant;

const FLEETS: &str = include_str!("../../../traces/two-weeks-fleets.toml");
const SAMPLE_FLEETS: &str = include_str!("../../../traces/sample-fleets.toml");

fn main() {
    let seed = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let opts = CliOptions { seed, ..CliOptions::default() };
    if std::env::args().nth(2).as_deref() != Some("sample-only") {
        two_weeks(seed, &opts);
    }
    sample_week(&opts);
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
    match run_cli(fleets.as_deref().unwrap_or(FLEETS), "two-weeks-fleets.toml", &csv, "two-weeks.csv", opts) {
        Ok(report) => {
            let took = started.elapsed();
            println!("{report}");
            println!();
            println!(
                "two weeks: {} jobs generated in {:.2} s; parsed and simulated (3 policies) in {:.2} s",
                jobs.len(),
                generated.as_secs_f64(),
                took.as_secs_f64()
            );
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}

fn sample_week(opts: &CliOptions) {
    let sample = "../shared/traces/sample_week.csv";
    match std::fs::read_to_string(sample) {
        // GPUCI_SAMPLE_FLEETS=path tries another fleet config (for tuning) without a rebuild.
        Ok(text) => match run_cli(&sample_fleets(), "traces/sample-fleets.toml", &text, sample, opts) {
            Ok(report) => println!("\nsample week ({sample}):\n{report}"),
            Err(e) => eprintln!("{e}"),
        },
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
