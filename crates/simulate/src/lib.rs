//! gpuci-simulate: replay a job trace against fleets on a simulated clock and say what each
//! policy pays and how long jobs wait — `gpuci simulate`.
//!
//! The `gpuci` policy is the coordinator's own autoscaler, [`gpuci_core::fleet::decide`],
//! driven by an event-driven simulation ([`engine`]); two baselines run beside it: always-on
//! machines for the trace's peak, and scale-from-demand with a fixed 5-minute idle timeout.
//! Figures are set against a lower bound computed from the trace alone ([`bounds`]).
//!
//! What must not live here: I/O (the caller reads the config and the trace and prints the
//! report), clocks, threads, an async runtime, and any rule of the autoscaler (those live in
//! the core, so the simulation measures the code that runs). Randomness is a seeded
//! generator of our own ([`rng`]): one seed, one result.

pub mod bounds;
pub mod engine;
pub mod gen;
pub mod profile;
pub mod rng;
pub mod trace;

pub use engine::Policy;
pub use profile::{Dist, SimProfile};
pub use trace::{parse_trace, TraceJob};

use gpuci_core::fleet::{parse_fleets, FleetSpec, UnixSecs};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;

/// Monday 2024-01-01 00:00 UTC: the trace's second 0, so warm schedules and budget days
/// fall where a person expects.
pub const DEFAULT_EPOCH: UnixSecs = 1_704_067_200;

/// How the simulated world behaves, besides the fleets.
#[derive(Clone, Debug, PartialEq)]
pub struct SimSettings {
    pub seed: u64,
    /// Unix time of the trace's second 0.
    pub epoch: UnixSecs,
    /// For fleets without a `[fleet.simulate]` table.
    pub default_profile: SimProfile,
    /// By fleet name.
    pub profiles: BTreeMap<String, SimProfile>,
}

impl Default for SimSettings {
    fn default() -> Self {
        SimSettings { seed: 1, epoch: DEFAULT_EPOCH, default_profile: SimProfile::default(), profiles: BTreeMap::new() }
    }
}

impl SimSettings {
    pub fn profile(&self, fleet: &str) -> &SimProfile {
        self.profiles.get(fleet).unwrap_or(&self.default_profile)
    }
}

/// The figures of one fleet (or of all, `fleet = "total"`) under one policy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Figures {
    pub fleet: String,
    pub jobs: u32,
    pub cancelled: u32,
    /// Job runs started again after a spot interruption.
    pub reruns: u32,
    /// GPU-hours billed: machine GPUs × billed time.
    pub paid_gpu_hours: f64,
    pub cost_usd: f64,
    /// GPU-hours jobs actually ran in this simulation (cancelled and interrupted runs up to
    /// their end).
    pub ran_gpu_hours: f64,
    /// See [`bounds`]: the trace's work with zero wait and cancellations applied.
    pub lower_bound_gpu_hours: f64,
    /// See [`bounds`]: boots and idle gaps a clairvoyant autoscaler still pays.
    pub unavoidable_gpu_hours: f64,
    /// `paid / lower bound`.
    pub ratio: f64,
    /// The goal: `1.10 × lower bound + unavoidable`.
    pub target_gpu_hours: f64,
    pub cost_goal_met: bool,
    pub wait_p50_s: u64,
    pub wait_p95_s: u64,
    pub wait_p99_s: u64,
    /// The fleet's mean boot time; the wait goal is p95 ≤ this.
    pub boot_s: f64,
    pub wait_goal_met: bool,
    pub machines_launched: u32,
    /// Machines whose agent connected after a create or a start.
    pub boots: u32,
    /// Stopped machines started again.
    pub starts: u32,
    pub boot_failures: u32,
    pub interruptions: u32,
    pub capacity_errors: u32,
}

/// One policy over the whole trace.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyRun {
    pub policy: Policy,
    pub total: Figures,
    pub fleets: Vec<Figures>,
    /// Seconds from the trace's start to the end of its last job.
    pub horizon_s: u64,
}

/// What `gpuci simulate` prints (`--json`: this, serialized).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub seed: u64,
    pub jobs: usize,
    /// Jobs whose pool names no fleet (or asks more GPUs than its machines have).
    pub unserved_jobs: usize,
    pub runs: Vec<PolicyRun>,
}

/// Run one policy.
pub fn simulate(fleets: &[FleetSpec], sim: &SimSettings, trace: &[TraceJob], policy: Policy) -> Report {
    simulate_all(fleets, sim, trace, &[policy])
}

/// Run several policies over the same trace, side by side.
pub fn simulate_all(fleets: &[FleetSpec], sim: &SimSettings, trace: &[TraceJob], policies: &[Policy]) -> Report {
    let cancels = bounds::cancel_times(trace);
    let bound: Vec<bounds::Bound> = fleets
        .iter()
        .map(|f| {
            let runs: Vec<(u64, u64, u32)> = trace
                .iter()
                .zip(&cancels)
                .filter(|(j, _)| j.pool == f.name && j.gpus <= f.machine.gpus)
                .map(|(j, c)| (j.submit_s, bounds::ideal_run(j, *c), j.gpus))
                .collect();
            bounds::fleet_bound(&runs, f.machine.gpus, sim.profile(&f.name).boot.mean())
        })
        .collect();
    let peaks: Vec<u32> = bound.iter().map(|b| b.peak_machines).collect();
    let profiles: Vec<SimProfile> = fleets.iter().map(|f| sim.profile(&f.name).clone()).collect();
    let mut runs = Vec::new();
    let mut unserved = 0;
    for &policy in policies {
        let engine = engine::Engine::new(fleets, profiles.clone(), trace, policy, sim.seed, sim.epoch);
        let out = engine.run(&peaks);
        unserved = out.unserved;
        let per_fleet: Vec<Figures> = fleets
            .iter()
            .zip(&out.tallies)
            .zip(&bound)
            .zip(&profiles)
            .map(|(((f, t), b), p)| {
                figures(&f.name, std::slice::from_ref(t), std::slice::from_ref(b), &[p.boot.mean()])
            })
            .collect();
        let boots: Vec<f64> = profiles.iter().map(|p| p.boot.mean()).collect();
        let mut total = figures("total", &out.tallies, &bound, &boots);
        total.wait_goal_met = per_fleet.iter().all(|f| f.wait_goal_met);
        runs.push(PolicyRun { policy, total, fleets: per_fleet, horizon_s: out.horizon_s });
    }
    Report { seed: sim.seed, jobs: trace.len(), unserved_jobs: unserved, runs }
}

fn figures(name: &str, tallies: &[engine::Tally], bounds: &[bounds::Bound], boot_means: &[f64]) -> Figures {
    let sum = |f: &dyn Fn(&engine::Tally) -> u32| tallies.iter().map(f).sum::<u32>();
    let hours = |s: f64| s / 3600.0;
    let paid = hours(tallies.iter().map(|t| t.paid_gpu_s).sum());
    let lower = hours(bounds.iter().map(|b| b.lower_bound_gpu_s).sum());
    let unavoidable = hours(bounds.iter().map(|b| b.unavoidable_gpu_s).sum());
    let mut waits: Vec<u64> = tallies.iter().flat_map(|t| t.waits.iter().copied()).collect();
    waits.sort_unstable();
    let boot_s = boot_means.iter().copied().fold(0.0, f64::max);
    let target = 1.10 * lower + unavoidable;
    let p95 = percentile(&waits, 95.0);
    Figures {
        fleet: name.to_string(),
        jobs: sum(&|t| t.jobs),
        cancelled: sum(&|t| t.cancelled),
        reruns: sum(&|t| t.reruns),
        paid_gpu_hours: paid,
        cost_usd: tallies.iter().map(|t| t.cost_usd).sum(),
        ran_gpu_hours: hours(tallies.iter().map(|t| t.ran_gpu_s).sum()),
        lower_bound_gpu_hours: lower,
        unavoidable_gpu_hours: unavoidable,
        ratio: if lower > 0.0 { paid / lower } else { 0.0 },
        target_gpu_hours: target,
        cost_goal_met: paid <= target + 1e-9,
        wait_p50_s: percentile(&waits, 50.0),
        wait_p95_s: p95,
        wait_p99_s: percentile(&waits, 99.0),
        boot_s,
        wait_goal_met: p95 as f64 <= boot_s,
        machines_launched: sum(&|t| t.launched),
        boots: sum(&|t| t.boots),
        starts: sum(&|t| t.starts),
        boot_failures: sum(&|t| t.boot_failures),
        interruptions: sum(&|t| t.interruptions),
        capacity_errors: sum(&|t| t.capacity_errors),
    }
}

/// Nearest rank: the smallest value with at least `p` % of the values at or below it.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Options of `gpuci simulate`.
#[derive(Clone, Debug, PartialEq)]
pub struct CliOptions {
    pub seed: u64,
    /// Empty: all three.
    pub policies: Vec<Policy>,
    pub epoch: UnixSecs,
}

impl Default for CliOptions {
    fn default() -> Self {
        CliOptions { seed: 1, policies: Vec::new(), epoch: DEFAULT_EPOCH }
    }
}

/// Everything `gpuci simulate CONFIG TRACE` does between reading the files and printing:
/// parse the fleets and their `[fleet.simulate]` tables, parse the trace, check every pool
/// names a fleet, run the policies. Errors are one line that names the file and place.
pub fn run_cli(
    config_text: &str,
    config_name: &str,
    trace_text: &str,
    trace_name: &str,
    opts: &CliOptions,
) -> Result<Report, String> {
    let fleets = parse_fleets(config_name, config_text).map_err(|e| e.to_string())?;
    if fleets.is_empty() {
        return Err(format!("{config_name}: no [[fleet]] to simulate"));
    }
    let profiles = profile::parse_profiles(config_name, config_text)?;
    let trace = parse_trace(trace_name, trace_text).map_err(|e| e.to_string())?;
    let names: Vec<&str> = fleets.iter().map(|f| f.name.as_str()).collect();
    if let Some(j) = trace.iter().find(|j| !names.contains(&j.pool.as_str())) {
        return Err(format!(
            "{trace_name}: job {}: pool: no fleet named {:?} in {config_name} (fleets: {})",
            j.id,
            j.pool,
            names.join(", ")
        ));
    }
    if let Some(j) = trace.iter().find(|j| fleets.iter().any(|f| f.name == j.pool && f.machine.gpus < j.gpus)) {
        return Err(format!("{trace_name}: job {}: gpus: {} is more than a {} machine has", j.id, j.gpus, j.pool));
    }
    let sim = SimSettings { seed: opts.seed, epoch: opts.epoch, profiles, ..SimSettings::default() };
    let policies = if opts.policies.is_empty() { Policy::ALL.to_vec() } else { opts.policies.clone() };
    Ok(simulate_all(&fleets, &sim, &trace, &policies))
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} jobs, seed {} (simulated machines and clock)", self.jobs, self.seed)?;
        if self.unserved_jobs > 0 {
            writeln!(f, "{} jobs name no fleet and were not simulated", self.unserved_jobs)?;
        }
        for run in &self.runs {
            writeln!(f)?;
            writeln!(f, "policy {} (last job ended after {:.1} h)", run.policy, run.horizon_s as f64 / 3600.0)?;
            writeln!(
                f,
                "  {:<10} {:>9} {:>9} {:>8} {:>6} {:>9} {:>6} {:>6} {:>6} {:>6} {:>8} {:>6} {:>6}",
                "fleet",
                "paid GPUh",
                "bound",
                "+boots",
                "ratio",
                "cost $",
                "p50 s",
                "p95 s",
                "p99 s",
                "boot s",
                "launched",
                "interr",
                "goals"
            )?;
            for fig in run.fleets.iter().chain(std::iter::once(&run.total)) {
                let goals = format!(
                    "{}{}",
                    if fig.cost_goal_met { "$" } else { "-" },
                    if fig.wait_goal_met { "w" } else { "-" }
                );
                writeln!(
                    f,
                    "  {:<10} {:>9.1} {:>9.1} {:>8.1} {:>6.3} {:>9.2} {:>6} {:>6} {:>6} {:>6.0} {:>8} {:>6} {:>6}",
                    fig.fleet,
                    fig.paid_gpu_hours,
                    fig.lower_bound_gpu_hours,
                    fig.unavoidable_gpu_hours,
                    fig.ratio,
                    fig.cost_usd,
                    fig.wait_p50_s,
                    fig.wait_p95_s,
                    fig.wait_p99_s,
                    fig.boot_s,
                    fig.machines_launched,
                    fig.interruptions,
                    goals
                )?;
            }
        }
        writeln!(f)?;
        writeln!(f, "bound: GPU-hours of the jobs with zero wait (cancellations applied); +boots: what a")?;
        writeln!(
            f,
            "clairvoyant autoscaler still pays for boots and short idle gaps. Goals: $ = paid <= 1.10 x bound"
        )?;
        write!(f, "+ boots; w = p95 wait <= the mean boot time (total: every fleet's).")
    }
}
