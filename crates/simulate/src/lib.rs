//! gpuci-simulate: replay a job trace against fleets on a simulated clock and say what each
//! policy pays and how long jobs wait — `gpuci simulate`.
//!
//! The `gpuci` policy is the coordinator's own autoscaler, [`gpuci_core::fleet::decide`],
//! driven by an event-driven simulation ([`engine`]); three baselines run beside it: always-on
//! machines for the trace's peak (at most each fleet's `max`), scale-from-demand with a fixed
//! 5-minute idle timeout, and the best fixed idle timeout in hindsight (a sweep over
//! [`IDLE_GRID_S`], per fleet). Figures are set against a floor computed from the trace alone
//! ([`bounds`]): the zero-wait lower bound, the boots any policy must pay, and the packing waste
//! of the fleet's machine size. Stopped machines bill their disk, and creates and starts meet
//! capacity outages and spot machines interruptions at documented rates per offer
//! ([`profile`]).
//!
//! What must not live here: I/O (the caller reads the config and the trace and prints the
//! report), clocks, threads, an async runtime, and any rule of the autoscaler (those live in
//! the core, so the simulation measures the code that runs). Randomness is a seeded
//! generator of our own ([`rng`]): one seed, one result.

pub mod bounds;
pub mod engine;
pub mod gen;
pub mod history;
mod pipelines;
pub mod profile;
pub mod rng;
pub mod trace;

pub use engine::{Mode, Policy};
pub use profile::{Dist, OfferProfile, OfferSim, SimProfile};
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

/// The idle timeouts (seconds) the best-fixed-idle baseline tries: from deleting a machine the
/// moment it is idle to keeping it an hour.
pub const IDLE_GRID_S: [u64; 11] = [0, 30, 60, 120, 180, 300, 600, 900, 1200, 1800, 3600];

/// The idle timeouts (seconds) before a stop that best-fixed-stop tries, each with every
/// stopped timeout of [`STOPPED_GRID_S`].
pub const STOP_IDLE_GRID_S: [u64; 6] = [0, 30, 60, 120, 300, 600];

/// The stopped timeouts (seconds) before a delete that best-fixed-stop tries: from a quarter
/// of an hour to a day.
pub const STOPPED_GRID_S: [u64; 7] = [900, 1800, 3600, 7200, 14_400, 28_800, 86_400];

/// The figures of one fleet (or of all, `fleet = "total"`) under one policy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Figures {
    pub fleet: String,
    pub jobs: u32,
    pub cancelled: u32,
    /// Job runs started again after a spot interruption.
    pub reruns: u32,
    /// Jobs that never ended: the policy got them no machine before the run gave up
    /// ([`engine::GIVE_UP_AFTER_S`] after the trace's end). Their waits so far are in the
    /// percentiles.
    pub unfinished_jobs: u32,
    /// GPU-hours billed: machine GPUs × billed time (running machines; a stopped machine's
    /// disk is in `stopped_disk_gpu_hours`).
    pub paid_gpu_hours: f64,
    /// Stopped machines' disks, in GPU-hours at the fleet's price per GPU-hour (its first
    /// offer, on-demand).
    pub stopped_disk_gpu_hours: f64,
    /// `paid + stopped disk`: what the cost goal and the ratios judge.
    pub charged_gpu_hours: f64,
    /// Machines' instance prices (running time only).
    pub cost_usd: f64,
    /// Disks, running and stopped.
    pub disk_usd: f64,
    /// The part of `disk_usd` while stopped.
    pub stopped_disk_usd: f64,
    /// `cost + disk`.
    pub total_usd: f64,
    pub stopped_machine_hours: f64,
    /// GPU-hours jobs actually ran in this simulation (cancelled and interrupted runs up to
    /// their end).
    pub ran_gpu_hours: f64,
    /// See [`bounds`]: the trace's work with zero wait and cancellations applied.
    pub lower_bound_gpu_hours: f64,
    /// See [`bounds`]: boots and idle gaps a clairvoyant autoscaler still pays.
    pub unavoidable_gpu_hours: f64,
    /// See [`bounds`]: GPUs of whole machines that no job fills, with zero wait.
    pub packing_waste_gpu_hours: f64,
    /// `lower bound + unavoidable + packing waste`.
    pub floor_gpu_hours: f64,
    /// `charged / lower bound`.
    pub ratio: f64,
    /// `charged / floor`.
    pub floor_ratio: f64,
    /// The goal: `1.10 × floor`.
    pub target_gpu_hours: f64,
    pub cost_goal_met: bool,
    pub wait_p50_s: u64,
    pub wait_p95_s: u64,
    pub wait_p99_s: u64,
    /// p95 of the waits less the time every machine the fleet's `max` allows was busy with
    /// other jobs: the wait the policy is answerable for. Reported beside the goal, which is
    /// judged on `wait_p95_s` (the wait users see).
    pub wait_p95_own_s: u64,
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
    /// Creates refused for want of capacity.
    pub capacity_errors: u32,
    /// Starts of stopped machines refused for want of capacity.
    pub start_capacity_errors: u32,
    /// best-fixed-idle and best-fixed-stop only: the idle timeout this fleet's figures come
    /// from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// best-fixed-stop only: the stopped timeout this fleet's figures come from (absent where
    /// the fleet cannot stop).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_timeout_s: Option<u64>,
    /// Other policies, per fleet, when the sweep ran: the cheapest swept fixed idle timeout
    /// whose p95 wait is no worse than this policy's. A policy beats the tuned baseline only
    /// where it costs less than this. Absent: no swept timeout waits this little (or no sweep).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fixed_idle_at_same_wait: Option<SweptMatch>,
    /// The same against the best-fixed-stop sweep: the cheapest swept pair of timeouts (stop,
    /// then delete) whose p95 wait is no worse than this policy's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fixed_stop_at_same_wait: Option<SweptMatch>,
}

/// A point of a sweep that a policy is held against.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweptMatch {
    pub idle_timeout_s: u64,
    /// best-fixed-stop's points: the stopped timeout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_timeout_s: Option<u64>,
    pub total_usd: f64,
    pub wait_p95_s: u64,
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

/// One idle timeout of the best-fixed-idle sweep, or one pair of timeouts of best-fixed-stop's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepPoint {
    pub idle_timeout_s: u64,
    /// best-fixed-stop: stopped this long → delete (on fleets that can stop).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_timeout_s: Option<u64>,
    pub fleets: Vec<SweepFleet>,
}

/// One fleet at one idle timeout of the sweep.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepFleet {
    pub fleet: String,
    pub charged_gpu_hours: f64,
    /// `charged / floor`, as [`Figures::floor_ratio`].
    pub floor_ratio: f64,
    pub cost_goal_met: bool,
    pub total_usd: f64,
    pub wait_p95_s: u64,
    pub wait_goal_met: bool,
    /// The timeout (or pair) the policy took for this fleet.
    pub chosen: bool,
}

/// What `gpuci simulate` prints (`--json`: this, serialized).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub seed: u64,
    pub jobs: usize,
    /// Jobs whose pool names no fleet (or asks more GPUs than its machines have).
    pub unserved_jobs: usize,
    pub runs: Vec<PolicyRun>,
    /// The best-fixed-idle sweep, every timeout (empty when that policy did not run).
    pub sweep: Vec<SweepPoint>,
    /// The best-fixed-stop sweep, every pair of timeouts (empty when that policy did not run).
    pub stop_sweep: Vec<SweepPoint>,
}

/// Run one policy.
pub fn simulate(fleets: &[FleetSpec], sim: &SimSettings, trace: &[TraceJob], policy: Policy) -> Report {
    simulate_all(fleets, sim, trace, &[policy])
}

/// Run several policies over the same trace, side by side (best-fixed-idle over
/// [`IDLE_GRID_S`], best-fixed-stop over [`STOP_IDLE_GRID_S`] × [`STOPPED_GRID_S`]).
pub fn simulate_all(fleets: &[FleetSpec], sim: &SimSettings, trace: &[TraceJob], policies: &[Policy]) -> Report {
    simulate_with_grid(fleets, sim, trace, policies, &IDLE_GRID_S)
}

/// Every pair of best-fixed-stop's default grid: (idle timeout, stopped timeout).
pub fn stop_grid() -> Vec<(u64, u64)> {
    STOP_IDLE_GRID_S.iter().flat_map(|&i| STOPPED_GRID_S.iter().map(move |&s| (i, s))).collect()
}

/// [`simulate_all`] with the idle timeouts best-fixed-idle sweeps.
pub fn simulate_with_grid(
    fleets: &[FleetSpec],
    sim: &SimSettings,
    trace: &[TraceJob],
    policies: &[Policy],
    idle_grid_s: &[u64],
) -> Report {
    let cancels = bounds::cancel_times(trace);
    let ideal = bounds::ideal_runs(trace, &cancels);
    let profiles: Vec<SimProfile> = fleets.iter().map(|f| sim.profile(&f.name).clone()).collect();
    let bound: Vec<bounds::Bound> = fleets
        .iter()
        .zip(&profiles)
        .map(|(f, p)| {
            let runs: Vec<(u64, u64, u32)> = trace
                .iter()
                .zip(&ideal)
                .filter(|(j, _)| j.pool == f.name && j.gpus > 0 && j.gpus <= f.machine.gpus)
                .map(|(j, &(start, run))| (start, run, j.gpus))
                .collect();
            bounds::fleet_bound(&runs, f.machine.gpus, &machine_costs(f, p))
        })
        .collect();
    let peaks: Vec<u32> = bound.iter().map(|b| b.peak_machines).collect();
    let boots: Vec<f64> = profiles.iter().map(|p| p.boot.mean()).collect();
    let run = |mode: Mode| engine::Engine::new(fleets, profiles.clone(), trace, mode, sim.seed, sim.epoch).run(&peaks);
    let mut runs = Vec::new();
    let (mut sweep, mut stop_sweep) = (Vec::new(), Vec::new());
    let mut unserved = 0;
    for &policy in policies {
        let mode = match policy {
            Policy::Gpuci => Mode::Decide,
            Policy::AlwaysOn => Mode::AlwaysOn,
            Policy::FixedIdle5m => Mode::FixedIdle(300),
            Policy::BestFixedIdle | Policy::BestFixedStop => {
                let knobs: Vec<(u64, Option<u64>)> = if policy == Policy::BestFixedIdle {
                    let mut grid = idle_grid_s.to_vec();
                    grid.sort_unstable();
                    grid.dedup();
                    if grid.is_empty() {
                        grid.push(300);
                    }
                    grid.into_iter().map(|t| (t, None)).collect()
                } else {
                    stop_grid().into_iter().map(|(i, s)| (i, Some(s))).collect()
                };
                let (best, points, unserved_here) = best_fixed(policy, fleets, &bound, &boots, &knobs, &run);
                unserved = unserved_here;
                runs.push(best);
                if policy == Policy::BestFixedIdle {
                    sweep = points;
                } else {
                    stop_sweep = points;
                }
                continue;
            }
        };
        let out = run(mode);
        unserved = out.unserved;
        let per_fleet: Vec<Figures> = fleets
            .iter()
            .zip(&out.tallies)
            .zip(&bound)
            .zip(&boots)
            .map(|(((f, t), b), boot)| figures(&f.name, std::slice::from_ref(t), std::slice::from_ref(b), &[*boot]))
            .collect();
        let mut total = figures("total", &out.tallies, &bound, &boots);
        total.wait_goal_met = per_fleet.iter().all(|f| f.wait_goal_met);
        runs.push(PolicyRun { policy, total, fleets: per_fleet, horizon_s: out.horizon_s });
    }
    for run in runs.iter_mut() {
        for (f, fig) in run.fleets.iter_mut().enumerate() {
            if run.policy != Policy::BestFixedIdle {
                fig.fixed_idle_at_same_wait = at_same_wait(&sweep, f, fig.wait_p95_s);
            }
            if run.policy != Policy::BestFixedStop {
                fig.fixed_stop_at_same_wait = at_same_wait(&stop_sweep, f, fig.wait_p95_s);
            }
        }
    }
    Report { seed: sim.seed, jobs: trace.len(), unserved_jobs: unserved, runs, sweep, stop_sweep }
}

/// The cheapest point of a sweep whose p95 wait for fleet `f` is at most `p95`.
fn at_same_wait(sweep: &[SweepPoint], f: usize, p95: u64) -> Option<SweptMatch> {
    sweep
        .iter()
        .filter_map(|p| p.fleets.get(f).map(|g| (p, g)))
        .filter(|(_, g)| g.wait_p95_s <= p95)
        .min_by(|a, b| a.1.total_usd.total_cmp(&b.1.total_usd))
        .map(|(p, g)| SweptMatch {
            idle_timeout_s: p.idle_timeout_s,
            stopped_timeout_s: p.stopped_timeout_s,
            total_usd: g.total_usd,
            wait_p95_s: g.wait_p95_s,
        })
}

/// What a boot and a stop-and-start cost on a fleet's machines, for the floor.
fn machine_costs(f: &FleetSpec, p: &SimProfile) -> bounds::MachineCosts {
    let restart = f.provider.can_stop().then(|| {
        let price = f.offers.first().map_or(0.0, |o| o.price_per_hour);
        let disk = if f.offers.is_empty() { 0.0 } else { p.offer(f, 0).disk_usd_per_hour };
        bounds::Restart {
            stop_start_s: p.stop.mean() + p.start.mean(),
            disk_share: if price > 0.0 { disk / price } else { 0.0 },
        }
    });
    bounds::MachineCosts { boot_s: p.boot.mean(), restart }
}

/// Run every setting of the grid (an idle timeout to delete after, or with a stopped timeout,
/// a pair: stop, then delete); per fleet take the cheapest (total USD) that meets the wait
/// goal, else the one with the lowest p95 wait (then the cheapest). Fleets do not share
/// machines, jobs or random streams, so one fleet's choice does not change another's figures.
fn best_fixed(
    policy: Policy,
    fleets: &[FleetSpec],
    bound: &[bounds::Bound],
    boots: &[f64],
    grid: &[(u64, Option<u64>)],
    run: &dyn Fn(Mode) -> engine::Outcome,
) -> (PolicyRun, Vec<SweepPoint>, usize) {
    let outs: Vec<engine::Outcome> = grid
        .iter()
        .map(|&(idle_s, stopped)| {
            run(match stopped {
                None => Mode::FixedIdle(idle_s),
                Some(stopped_s) => Mode::FixedStop { idle_s, stopped_s },
            })
        })
        .collect();
    let per: Vec<Vec<Figures>> = outs
        .iter()
        .map(|out| {
            (0..fleets.len())
                .map(|f| {
                    figures(
                        &fleets[f].name,
                        std::slice::from_ref(&out.tallies[f]),
                        std::slice::from_ref(&bound[f]),
                        &[boots[f]],
                    )
                })
                .collect()
        })
        .collect();
    let chosen: Vec<usize> = (0..fleets.len())
        .map(|f| {
            let meets: Vec<usize> = (0..grid.len()).filter(|&i| per[i][f].wait_goal_met).collect();
            if meets.is_empty() {
                (0..grid.len())
                    .min_by(|&a, &b| {
                        let (x, y) = (&per[a][f], &per[b][f]);
                        x.wait_p95_s.cmp(&y.wait_p95_s).then(x.total_usd.total_cmp(&y.total_usd))
                    })
                    .unwrap_or(0)
            } else {
                meets.into_iter().min_by(|&a, &b| per[a][f].total_usd.total_cmp(&per[b][f].total_usd)).unwrap_or(0)
            }
        })
        .collect();
    let points = grid
        .iter()
        .enumerate()
        .map(|(i, &(t, stopped))| SweepPoint {
            idle_timeout_s: t,
            stopped_timeout_s: stopped,
            fleets: per[i]
                .iter()
                .enumerate()
                .map(|(f, fig)| SweepFleet {
                    fleet: fig.fleet.clone(),
                    charged_gpu_hours: fig.charged_gpu_hours,
                    floor_ratio: fig.floor_ratio,
                    cost_goal_met: fig.cost_goal_met,
                    total_usd: fig.total_usd,
                    wait_p95_s: fig.wait_p95_s,
                    wait_goal_met: fig.wait_goal_met,
                    chosen: chosen[f] == i,
                })
                .collect(),
        })
        .collect();
    let fleet_figures: Vec<Figures> = chosen
        .iter()
        .enumerate()
        .map(|(f, &i)| Figures {
            idle_timeout_s: Some(grid[i].0),
            stopped_timeout_s: grid[i].1.filter(|_| engine::can_stop(&fleets[f])),
            ..per[i][f].clone()
        })
        .collect();
    let tallies: Vec<engine::Tally> = chosen.iter().enumerate().map(|(f, &i)| outs[i].tallies[f].clone()).collect();
    let mut total = figures("total", &tallies, bound, boots);
    total.wait_goal_met = fleet_figures.iter().all(|f| f.wait_goal_met);
    let horizon_s = chosen.iter().map(|&i| outs[i].horizon_s).max().unwrap_or(0);
    let unserved = outs.first().map_or(0, |o| o.unserved);
    (PolicyRun { policy, total, fleets: fleet_figures, horizon_s }, points, unserved)
}

fn figures(name: &str, tallies: &[engine::Tally], bounds: &[bounds::Bound], boot_means: &[f64]) -> Figures {
    let sum = |f: &dyn Fn(&engine::Tally) -> u32| tallies.iter().map(f).sum::<u32>();
    let sumf = |f: &dyn Fn(&engine::Tally) -> f64| tallies.iter().map(f).sum::<f64>();
    let hours = |s: f64| s / 3600.0;
    let paid = hours(sumf(&|t| t.paid_gpu_s));
    let stopped_disk = hours(sumf(&|t| t.stopped_disk_gpu_s));
    let charged = paid + stopped_disk;
    let lower = hours(bounds.iter().map(|b| b.lower_bound_gpu_s).sum());
    let unavoidable = hours(bounds.iter().map(|b| b.unavoidable_gpu_s).sum());
    let packing = hours(bounds.iter().map(|b| b.packing_gpu_s).sum());
    let floor = lower + unavoidable + packing;
    let mut waits: Vec<u64> = tallies.iter().flat_map(|t| t.waits.iter().copied()).collect();
    waits.sort_unstable();
    let boot_s = boot_means.iter().copied().fold(0.0, f64::max);
    let target = 1.10 * floor;
    let p95 = percentile(&waits, 95.0);
    let mut own: Vec<u64> = tallies.iter().flat_map(|t| t.waits_own.iter().copied()).collect();
    own.sort_unstable();
    let (cost, disk) = (sumf(&|t| t.cost_usd), sumf(&|t| t.disk_usd));
    Figures {
        fleet: name.to_string(),
        jobs: sum(&|t| t.jobs),
        cancelled: sum(&|t| t.cancelled),
        reruns: sum(&|t| t.reruns),
        unfinished_jobs: sum(&|t| t.unfinished),
        paid_gpu_hours: paid,
        stopped_disk_gpu_hours: stopped_disk,
        charged_gpu_hours: charged,
        cost_usd: cost,
        disk_usd: disk,
        stopped_disk_usd: sumf(&|t| t.stopped_disk_usd),
        total_usd: cost + disk,
        stopped_machine_hours: hours(sumf(&|t| t.stopped_s)),
        ran_gpu_hours: hours(sumf(&|t| t.ran_gpu_s)),
        lower_bound_gpu_hours: lower,
        unavoidable_gpu_hours: unavoidable,
        packing_waste_gpu_hours: packing,
        floor_gpu_hours: floor,
        ratio: if lower > 0.0 { charged / lower } else { 0.0 },
        floor_ratio: if floor > 0.0 { charged / floor } else { 0.0 },
        target_gpu_hours: target,
        cost_goal_met: charged <= target + 1e-9,
        wait_p50_s: percentile(&waits, 50.0),
        wait_p95_s: p95,
        wait_p99_s: percentile(&waits, 99.0),
        wait_p95_own_s: percentile(&own, 95.0),
        boot_s,
        wait_goal_met: p95 as f64 <= boot_s,
        machines_launched: sum(&|t| t.launched),
        boots: sum(&|t| t.boots),
        starts: sum(&|t| t.starts),
        boot_failures: sum(&|t| t.boot_failures),
        interruptions: sum(&|t| t.interruptions),
        capacity_errors: sum(&|t| t.capacity_errors),
        start_capacity_errors: sum(&|t| t.start_capacity_errors),
        idle_timeout_s: None,
        stopped_timeout_s: None,
        fixed_idle_at_same_wait: None,
        fixed_stop_at_same_wait: None,
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
    /// Empty: all of [`Policy::ALL`].
    pub policies: Vec<Policy>,
    pub epoch: UnixSecs,
    /// The idle timeouts best-fixed-idle sweeps, seconds.
    pub idle_grid_s: Vec<u64>,
}

impl Default for CliOptions {
    fn default() -> Self {
        CliOptions { seed: 1, policies: Vec::new(), epoch: DEFAULT_EPOCH, idle_grid_s: IDLE_GRID_S.to_vec() }
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
    let mut fleets = parse_fleets(config_name, config_text).map_err(|e| e.to_string())?;
    if fleets.is_empty() {
        return Err(format!("{config_name}: no [[fleet]] to simulate"));
    }
    let profiles = profile::parse_profiles(config_name, config_text)?;
    profile::check_offers(config_name, &fleets, &profiles)?;
    // The policy prices a stopped machine at the fleet's `stopped_price_per_hour`; where the
    // config leaves it to the default, it is told the disk the simulated world bills (its
    // first offer's), as an operator who knows the bill would set it. A price the config
    // names is kept: what the policy believes is then the operator's.
    let named = named_stopped_prices(config_text);
    for (f, spec) in fleets.iter_mut().enumerate() {
        if !named.get(f).copied().unwrap_or(false) && !spec.offers.is_empty() {
            let p = profiles.get(&spec.name).cloned().unwrap_or_default();
            spec.stopped_price_per_hour = p.offer(spec, 0).disk_usd_per_hour;
        }
    }
    let trace = parse_trace(trace_name, trace_text).map_err(|e| e.to_string())?;
    let names: Vec<&str> = fleets.iter().map(|f| f.name.as_str()).collect();
    // A job with no GPU runs off the fleets: its pool names none.
    if let Some(j) = trace.iter().find(|j| j.gpus > 0 && !names.contains(&j.pool.as_str())) {
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
    Ok(simulate_with_grid(&fleets, &sim, &trace, &policies, &opts.idle_grid_s))
}

/// Per `[[fleet]]` in order: whether it names `stopped_price_per_hour`.
fn named_stopped_prices(config_text: &str) -> Vec<bool> {
    let table: toml::Table = config_text.parse().unwrap_or_default();
    table
        .get("fleet")
        .and_then(toml::Value::as_array)
        .map(|a| a.iter().map(|f| f.get("stopped_price_per_hour").is_some()).collect())
        .unwrap_or_default()
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `0s`, `30s`, `2m`, `1h`, `90s`: an idle timeout, short.
fn short_secs(s: u64) -> String {
    match s {
        0 => "0s".into(),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

impl Report {
    /// best-fixed-stop's sweep, one table per fleet: a row per idle timeout (then stop), a
    /// column per stopped timeout (then delete); each cell `× floor / p95 s` and the goals met.
    fn fmt_stop_sweep(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(first) = self.stop_sweep.first() else { return Ok(()) };
        let mut stopped: Vec<u64> = self.stop_sweep.iter().filter_map(|p| p.stopped_timeout_s).collect();
        stopped.sort_unstable();
        stopped.dedup();
        let mut idle: Vec<u64> = self.stop_sweep.iter().map(|p| p.idle_timeout_s).collect();
        idle.sort_unstable();
        idle.dedup();
        writeln!(f)?;
        writeln!(
            f,
            "best-fixed-stop sweep (stop after idle, delete after stopped, no warm pool): x floor / p95 wait s, \
             $ w = goals met; * = taken"
        )?;
        for (i, g) in first.fleets.iter().enumerate() {
            write!(f, "  {:<10}", format!("{} idle", g.fleet))?;
            for s in &stopped {
                write!(f, " {:>13}", format!("stopped {}", short_secs(*s)))?;
            }
            writeln!(f)?;
            for t in &idle {
                write!(f, "  {:<10}", short_secs(*t))?;
                for s in &stopped {
                    let cell = self
                        .stop_sweep
                        .iter()
                        .find(|p| p.idle_timeout_s == *t && p.stopped_timeout_s == Some(*s))
                        .and_then(|p| p.fleets.get(i))
                        .map_or_else(String::new, |c| {
                            format!(
                                "{:.3}/{}{}{}{}",
                                c.floor_ratio,
                                c.wait_p95_s,
                                if c.cost_goal_met { "$" } else { " " },
                                if c.wait_goal_met { "w" } else { " " },
                                if c.chosen { "*" } else { " " }
                            )
                        });
                    write!(f, " {cell:>13}")?;
                }
                writeln!(f)?;
            }
        }
        Ok(())
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
            if run.total.unfinished_jobs > 0 {
                writeln!(f, "policy {}: {} jobs never ran to their end", run.policy, run.total.unfinished_jobs)?;
            }
            let timeouts: Vec<String> = run
                .fleets
                .iter()
                .filter_map(|g| {
                    g.idle_timeout_s.map(|t| match g.stopped_timeout_s {
                        Some(s) => format!("{} {} + stopped {}", g.fleet, short_secs(t), short_secs(s)),
                        None => format!("{} {}", g.fleet, short_secs(t)),
                    })
                })
                .collect();
            let chosen =
                if timeouts.is_empty() { String::new() } else { format!("idle timeout {}; ", timeouts.join(", ")) };
            writeln!(f, "policy {} ({chosen}last job ended after {:.1} h)", run.policy, run.horizon_s as f64 / 3600.0)?;
            writeln!(
                f,
                "  {:<10} {:>9} {:>6} {:>9} {:>7} {:>8} {:>6} {:>10} {:>7} {:>5} {:>5} {:>5} {:>5} {:>5} {:>8} {:>6} {:>9} {:>6} {:>5}",
                "fleet",
                "paid GPUh",
                "+disk",
                "bound",
                "+boots",
                "+packing",
                "xfloor",
                "total $",
                "disk $",
                "p50 s",
                "p95 s",
                "p99 s",
                "p95-m",
                "boot",
                "launched",
                "starts",
                "caperr c/s",
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
                    "  {:<10} {:>9.1} {:>6.1} {:>9.1} {:>7.1} {:>8.1} {:>6.3} {:>10.2} {:>7.2} {:>5} {:>5} {:>5} {:>5} {:>5.0} {:>8} {:>6} {:>9} {:>6} {:>5}",
                    fig.fleet,
                    fig.paid_gpu_hours,
                    fig.stopped_disk_gpu_hours,
                    fig.lower_bound_gpu_hours,
                    fig.unavoidable_gpu_hours,
                    fig.packing_waste_gpu_hours,
                    fig.floor_ratio,
                    fig.total_usd,
                    fig.disk_usd,
                    fig.wait_p50_s,
                    fig.wait_p95_s,
                    fig.wait_p99_s,
                    fig.wait_p95_own_s,
                    fig.boot_s,
                    fig.machines_launched,
                    fig.starts,
                    format!("{}/{}", fig.capacity_errors, fig.start_capacity_errors),
                    fig.interruptions,
                    goals
                )?;
            }
        }
        if let Some(first) = self.sweep.first() {
            writeln!(f)?;
            writeln!(f, "best-fixed-idle sweep (delete after idle, no warm pool): total $ / p95 wait s; * = taken")?;
            write!(f, "  {:<6}", "idle")?;
            for g in &first.fleets {
                write!(f, " {:>20}", g.fleet)?;
            }
            writeln!(f)?;
            for p in &self.sweep {
                write!(f, "  {:<6}", short_secs(p.idle_timeout_s))?;
                for g in &p.fleets {
                    let cell = format!(
                        "{:.2} / {}{}{}",
                        g.total_usd,
                        g.wait_p95_s,
                        if g.wait_goal_met { "w" } else { " " },
                        if g.chosen { "*" } else { " " }
                    );
                    write!(f, " {cell:>20}")?;
                }
                writeln!(f)?;
            }
        }
        self.fmt_stop_sweep(f)?;
        for (swept, name, of) in [
            (Policy::BestFixedIdle, "the best-fixed-idle sweep", "fixed timeout"),
            (Policy::BestFixedStop, "the best-fixed-stop sweep", "fixed pair of timeouts"),
        ] {
            let matched: Vec<(&PolicyRun, &Figures, Option<&SweptMatch>)> = self
                .runs
                .iter()
                .filter(|r| r.policy != swept)
                .flat_map(|r| {
                    r.fleets.iter().map(move |g| {
                        let m = if swept == Policy::BestFixedIdle {
                            &g.fixed_idle_at_same_wait
                        } else {
                            &g.fixed_stop_at_same_wait
                        };
                        (r, g, m.as_ref())
                    })
                })
                .collect();
            let points = if swept == Policy::BestFixedIdle { &self.sweep } else { &self.stop_sweep };
            if points.is_empty() || matched.is_empty() {
                continue;
            }
            writeln!(f)?;
            writeln!(f, "against {name} at equal or better p95 wait (the cheapest {of} that waits no longer):")?;
            writeln!(
                f,
                "  {:<15} {:<10} {:>10} {:>5}   {:>9} {:>10} {:>5}  policy costs",
                "policy", "fleet", "total $", "p95 s", "fixed", "total $", "p95 s"
            )?;
            for (r, g, m) in matched {
                match m {
                    Some(m) => writeln!(
                        f,
                        "  {:<15} {:<10} {:>10.2} {:>5}   {:>9} {:>10.2} {:>5}  {:+.1} %",
                        r.policy.as_str(),
                        g.fleet,
                        g.total_usd,
                        g.wait_p95_s,
                        match m.stopped_timeout_s {
                            Some(s) => format!("{}+{}", short_secs(m.idle_timeout_s), short_secs(s)),
                            None => short_secs(m.idle_timeout_s),
                        },
                        m.total_usd,
                        m.wait_p95_s,
                        if m.total_usd > 0.0 { (g.total_usd / m.total_usd - 1.0) * 100.0 } else { 0.0 }
                    )?,
                    None => writeln!(
                        f,
                        "  {:<15} {:<10} {:>10.2} {:>5}   no swept setting waits this little",
                        r.policy.as_str(),
                        g.fleet,
                        g.total_usd,
                        g.wait_p95_s
                    )?,
                }
            }
        }
        writeln!(f)?;
        writeln!(
            f,
            "bound: GPU-hours of the jobs with zero wait (cancellations applied); +boots: boots and idle gaps"
        )?;
        writeln!(f, "a clairvoyant autoscaler still pays; +packing: GPUs of whole machines no job fills; floor = the")?;
        writeln!(
            f,
            "three. +disk: stopped machines' disks in GPU-hours at the fleet's price; xfloor = (paid + disk) /"
        )?;
        writeln!(f, "floor. total $ = machines + disks. caperr: creates / starts refused for want of capacity.")?;
        writeln!(
            f,
            "p95-m: p95 of the waits less the time every machine the fleet's max allows was busy (the config's"
        )?;
        writeln!(f, "share, which always-on within max pays too); the wait goal is judged on p95 s, not on it.")?;
        write!(f, "Goals: $ = paid + disk <= 1.10 x floor; w = p95 wait <= the mean boot time (total: every fleet's).")
    }
}
