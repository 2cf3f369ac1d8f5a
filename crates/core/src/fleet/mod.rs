//! Fleets: classes of machines that a provider creates and deletes on demand, and the
//! autoscaler's rules for them, as plain data and pure decisions.
//!
//! - [`FleetSpec`] is one `[[fleet]]` entry of the server config, validated ([`parse_fleets`]).
//! - [`decide`] is the autoscaler: (fleets, queued jobs, observed machines, clock, spend,
//!   unavailable offers, spot interruptions) → actions, a summary per fleet and a waiting
//!   reason per queued job. The coordinator's reconcile loop applies the actions at the
//!   provider; `gpuci simulate` applies them to simulated machines on a simulated clock. Both
//!   drive this one function, so the simulation measures the policy that runs in production.
//! - [`fit::no_fleet_serves`] says, per fleet, why a job can never run on any of them (it then
//!   waits for nothing and is told so from zero); [`ending::classify_end`] books a machine
//!   that ended at its provider by its agent's registration: boot failure or taken back.
//!
//! What must not live here: I/O of any kind (no provider calls, no files, no clock reads, no
//! environment), an async runtime, logging. Time is handed in as unix seconds (`u64`)
//! everywhere in this module; time zones come from the tz database compiled into the binary
//! (jiff's bundled copy), so a warm schedule means the same on a machine without
//! `/usr/share/zoneinfo`.

mod autoscale;
pub mod backoff;
pub mod budget;
mod config;
pub mod cost;
pub mod ending;
pub mod fanout;
pub mod fit;
pub mod idle;
pub mod profile;
mod schedule;
pub mod strays;
pub mod unavailable;

pub use autoscale::{
    breaker_open_until, decide, fits, Action, AutoscaleInput, Decision, FleetSummary, Machine, MachineState, QueuedJob,
};
pub use backoff::Backoffs;
pub use budget::{parse_budgets, RepoBudget};
pub use config::{parse_fleets, FleetConfigError};
pub use fanout::{PipelineStep, StepDurations, StepState, UpcomingJob};
pub use idle::{FleetHistory, Hold, OutageSeen};
pub use profile::ArrivalProfile;
pub use schedule::{Days, WarmSchedule};
pub use unavailable::{
    no_offer_reason, offer_unavailable_after_error, SkipCause, UnavailableOffer, CAPACITY_ERROR_BACKOFF_S,
};
pub(crate) use {budget::describe as describe_path, config::line_col};

use crate::gpu::ComputeCapability;
use crate::quantity::Bytes;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;

/// Unix time in seconds.
pub type UnixSecs = u64;

/// `42 s`, `3m05s`, `2h10m`: short, for reasons.
fn secs(s: u64) -> String {
    match s {
        0..=119 => format!("{s} s"),
        120..=7199 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// Which provider creates a fleet's machines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    Aws,
    Exec,
    Local,
    Slurm,
    Kubernetes,
}

impl ProviderKind {
    pub const ALL: [ProviderKind; 5] =
        [ProviderKind::Aws, ProviderKind::Exec, ProviderKind::Local, ProviderKind::Slurm, ProviderKind::Kubernetes];

    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Aws => "aws",
            ProviderKind::Exec => "exec",
            ProviderKind::Local => "local",
            ProviderKind::Slurm => "slurm",
            ProviderKind::Kubernetes => "kubernetes",
        }
    }

    pub fn parse(s: &str) -> Option<ProviderKind> {
        ProviderKind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Whether the provider can pause a machine and start it again (a stopped EC2 instance, an
    /// exec provider that says so, a local agent). A Slurm allocation or a pod cannot be
    /// paused: it ends, and a new one is a new machine.
    pub fn can_stop(self) -> bool {
        matches!(self, ProviderKind::Aws | ProviderKind::Exec | ProviderKind::Local)
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Spot (cheap, can be taken back by the cloud at any moment) or on-demand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Capacity {
    Spot,
    OnDemand,
}

impl Capacity {
    pub fn as_str(self) -> &'static str {
        match self {
            Capacity::Spot => "spot",
            Capacity::OnDemand => "on-demand",
        }
    }
}

impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which capacity types a fleet may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapacityPolicy {
    Spot,
    #[default]
    OnDemand,
    /// Spot first; on-demand when no spot offer is available or the spot breaker is open.
    SpotThenOnDemand,
}

impl CapacityPolicy {
    /// The capacity types to try, in order, when the spot breaker is `breaker_open`.
    /// A `spot`-only fleet asks for nothing while its breaker is open: the person chose never
    /// to pay on-demand prices, so it waits for the breaker to close.
    pub fn order(self, breaker_open: bool) -> &'static [Capacity] {
        match (self, breaker_open) {
            (CapacityPolicy::Spot, false) => &[Capacity::Spot],
            (CapacityPolicy::Spot, true) => &[],
            (CapacityPolicy::OnDemand, _) | (CapacityPolicy::SpotThenOnDemand, true) => &[Capacity::OnDemand],
            (CapacityPolicy::SpotThenOnDemand, false) => &[Capacity::Spot, Capacity::OnDemand],
        }
    }
}

/// What happens to a machine idle past its fleet's `idle_timeout`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IdleAction {
    #[default]
    Delete,
    /// Pause it (its disk stays, GPU billing stops); it is started again before a new machine
    /// is created. Needs a provider that can stop machines ([`ProviderKind::can_stop`]).
    Stop,
}

/// The machine a fleet creates, as its agent will register: what placement is checked against
/// before the machine exists.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MachineSpec {
    /// The GPU model as NVML names it, e.g. `NVIDIA A100-SXM4-80GB`.
    pub gpu_model: String,
    pub gpus: u32,
    pub gpu_memory: Bytes,
    /// Unknown when not given: a job that asks for one is assumed to fit (the agent's real
    /// inventory decides at placement).
    pub compute_capability: Option<ComputeCapability>,
    pub cpus: u32,
    pub memory: Bytes,
    /// Tags the machine's agent registers with.
    pub tags: BTreeMap<String, String>,
    /// Whether the image has a container runtime (jobs with an `image` need one).
    pub container_runtime: bool,
    /// How long a machine lives at most (a Slurm allocation's time limit): a job whose
    /// timeout does not fit in it is not demand for this fleet. `None`: no limit.
    pub time_limit_s: Option<u64>,
}

/// One way to get a machine: an instance type in a zone at a price.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Offer {
    pub instance_type: String,
    /// Zone or region, as the provider names it; empty when the provider has none.
    pub zone: String,
    /// On-demand price, USD per hour.
    pub price_per_hour: f64,
    /// Spot price, USD per hour; the on-demand price when not given.
    pub spot_price_per_hour: Option<f64>,
}

impl Offer {
    pub fn price(&self, capacity: Capacity) -> f64 {
        match capacity {
            Capacity::Spot => self.spot_price_per_hour.unwrap_or(self.price_per_hour),
            Capacity::OnDemand => self.price_per_hour,
        }
    }

    /// `g4dn.xlarge in us-east-1a`, for reasons.
    pub fn label(&self) -> String {
        if self.zone.is_empty() {
            self.instance_type.clone()
        } else {
            format!("{} in {}", self.instance_type, self.zone)
        }
    }
}

/// Spot circuit breaker: after `interruptions` spot interruptions within `window_s`, the fleet
/// uses on-demand only for `on_demand_for_s` (a spot market that takes machines back twice in
/// a quarter of an hour will do it again, and every interruption reruns a job from scratch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SpotBreaker {
    pub interruptions: u32,
    pub window_s: u64,
    pub on_demand_for_s: u64,
}

impl Default for SpotBreaker {
    fn default() -> Self {
        SpotBreaker { interruptions: 2, window_s: 15 * 60, on_demand_for_s: 30 * 60 }
    }
}

/// One `[[fleet]]` of the server config, validated.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FleetSpec {
    pub name: String,
    pub provider: ProviderKind,
    /// The `[fleet.settings]` table, passed to the provider as it is (the provider crate
    /// checks it); empty when not given.
    #[serde(skip)]
    pub settings: toml::Table,
    pub machine: MachineSpec,
    /// Tried in order.
    pub offers: Vec<Offer>,
    pub capacity: CapacityPolicy,
    /// Idle machines kept ready (outside warm schedules).
    pub min_idle: u32,
    /// The most machines that may exist at once, stopped ones not counted (see [`decide`]).
    pub max: u32,
    /// Idle this long → stop or delete. `None` (the default): from cost, per pass
    /// ([`idle::idle_hold`]: rent or buy from the fleet's recent arrivals).
    pub idle_timeout_s: Option<u64>,
    pub boot_timeout_s: u64,
    /// Default: `stop` where the provider can stop and the fleet is on-demand only (aws,
    /// local, an exec program that says `stop = true`), else `delete`.
    pub idle_action: IdleAction,
    /// Stopped this long → delete. `None` (the default): from cost ([`idle::stopped_hold`]).
    pub stopped_timeout_s: Option<u64>,
    /// What a stopped machine bills per hour (its disk), USD; the default is
    /// [`idle::DEFAULT_STOPPED_PRICE_PER_HOUR`] on aws and exec, 0 on local.
    pub stopped_price_per_hour: f64,
    pub warm: Vec<WarmSchedule>,
    /// USD per UTC day; no creates or starts once spend today reaches it.
    pub daily_budget: Option<f64>,
    pub spot_breaker: SpotBreaker,
    /// The `[fleet.simulate]` table for `gpuci simulate` (boot time, interruption rate …),
    /// checked by the simulator; the coordinator ignores it.
    #[serde(skip)]
    pub simulate: Option<toml::Table>,
}

impl FleetSpec {
    /// The warm pool size at `now`: the largest `min_idle` of the fleet and its active
    /// schedules.
    pub fn min_idle_at(&self, now: UnixSecs) -> u32 {
        self.warm.iter().filter(|w| w.active_at(now)).map(|w| w.min_idle).fold(self.min_idle, u32::max)
    }
}

#[cfg(test)]
mod tests;

/// A job's cost on a fleet machine: its share of the machine's GPUs (its GPUs over the
/// machine's) × the machine's price, per second it ran. A job with no GPU on a GPU machine
/// costs nothing here: the machine's time is the fleet's overhead then, as boot and idle are.
pub fn job_cost(ran_ms: i64, job_gpus: u32, machine_gpus: u32, price_per_hour: f64) -> f64 {
    if machine_gpus == 0 || ran_ms <= 0 {
        return 0.0;
    }
    let share = f64::from(job_gpus.min(machine_gpus)) / f64::from(machine_gpus);
    ran_ms as f64 / 3_600_000.0 * price_per_hour * share
}

#[cfg(test)]
mod cost_tests {
    use super::job_cost;

    #[test]
    fn a_job_pays_its_share_of_the_machine_per_second() {
        // 2 of 8 GPUs for 30 minutes of a $40/h machine: a quarter of $20.
        assert!((job_cost(1_800_000, 2, 8, 40.0) - 5.0).abs() < 1e-9);
        assert!((job_cost(3_600_000, 1, 1, 0.526) - 0.526).abs() < 1e-12);
        assert_eq!(job_cost(1_000, 0, 4, 10.0), 0.0);
        assert_eq!(job_cost(-5, 1, 1, 10.0), 0.0);
        assert_eq!(job_cost(1_000, 1, 0, 10.0), 0.0);
        // Never more than the whole machine.
        assert!((job_cost(3_600_000, 9, 8, 8.0) - 8.0).abs() < 1e-9);
    }
}
