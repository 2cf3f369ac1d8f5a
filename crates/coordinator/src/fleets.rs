//! The fleets' reconcile loop: every pass it asks each fleet's provider what exists, joins that
//! with the agents connected from those machines and the jobs no agent can take, asks the
//! autoscaler (`gpuci_core::fleet::decide`, pure) what to do, and does it through the provider.
//! It records each machine's boot stages and billed time in the store, and keeps a status per
//! fleet for `GET /api/v1/fleets` (machines by state, what the autoscaler wants and why, recent
//! provider errors, spend today).
//!
//! Reconcile, never remember: what exists is what the provider lists, tagged with this
//! coordinator's id; a machine still booting after a coordinator crash is adopted, a machine
//! the store knows but the provider no longer lists has ended. Creates name gpuci's machine id,
//! which the provider makes idempotent. The only state kept in memory is what is safe to lose:
//! offers that answered "no capacity" lately, idle-since times (restart: idle from now), recent
//! errors.
//!
//! What must not live here: decisions (how many machines, which, when: `decide` makes them),
//! provider protocol details (`gpuci_providers`), or the registration token in any log line.
//!
//! Layout: this file holds the loop's types and [`start`]; `reconcile` runs the loop as a
//! task, `pass` is one reconcile pass, `worker` carries a fleet's actions out through its
//! provider, `provider` picks and wraps providers, `launch` builds the agent's command line,
//! `cost` reads the cost report's inputs.

use crate::brain::Command;
use gpuci_core::fleet::{Backoffs, Capacity, FleetHistory, FleetSpec, UnavailableOffer, UnixSecs};
pub use gpuci_protocol::api::{FleetStatus, MachineStatus};
use gpuci_providers::{Provider, ProviderMachine};
use gpuci_store::{MachineRecord, Store};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

mod cost;
mod launch;
mod pass;
mod provider;
mod reconcile;
mod remember;
#[cfg(test)]
mod tests;
mod worker;

pub use cost::cost_inputs;
pub use launch::{agent_args, DEFAULT_LEAVE_AFTER};
pub use provider::provider_for;
use provider::Counted;

/// Provider errors kept per fleet for `gpuci fleets`.
const RECENT_ERRORS: usize = 10;

/// How long a woken reconcile loop waits before its pass, so that jobs submitted together
/// are decided together.
const WAKE_GAP: Duration = Duration::from_millis(100);

/// What the loop needs besides the fleets.
pub struct Deps {
    pub store: Arc<dyn Store>,
    pub brain: mpsc::Sender<Command>,
    pub coordinator_id: String,
    /// The URL agents on new machines connect to, unless a fleet's settings say `server`.
    pub server_url: String,
    pub registration_token: String,
    /// The installation's identity key (public): agents on new machines pin it from the start.
    pub coordinator_key: String,
    pub interval: Duration,
    /// The coordinator's data dir (a `local` fleet keeps its machines under it).
    pub data_dir: std::path::PathBuf,
    /// `[[budget]]`s of repositories.
    pub budgets: Vec<gpuci_core::fleet::RepoBudget>,
    /// The configured GitHub host (a bare `owner/name` is a repository there).
    pub github_host: String,
    /// Every provider call is counted here (`gpuci_provider_calls_total`).
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Notified when a job newly waits for a machine: a pass runs then, not at the next tick.
    pub wake: Arc<tokio::sync::Notify>,
}

pub type Statuses = Arc<RwLock<Vec<FleetStatus>>>;

struct FleetRun {
    spec: FleetSpec,
    provider: Option<Arc<dyn Provider>>,
    unavailable_reason: Option<String>,
    errors: VecDeque<(u64, String)>,
    /// The fleet's actions of an earlier pass, still being carried out: a slow or hanging
    /// provider holds up its own fleet only.
    worker: Option<tokio::task::JoinHandle<Vec<Effect>>>,
    /// Its provider's `list`, in flight.
    listing: Option<tokio::task::JoinHandle<gpuci_providers::ProviderResult<Vec<ProviderMachine>>>>,
}

/// What carrying out a fleet's actions changes in the loop's memory.
enum Effect {
    Error(String),
    /// An offer refused or failed: skipped for as long as its back-off says.
    Unavailable(UnavailableOffer),
    /// The provider took a create or a start of this offer: its back-off starts again.
    Took {
        fleet: String,
        offer: usize,
        capacity: Capacity,
    },
    /// The machine is no longer idle (deleted, stopped).
    Gone(String),
}

/// What a fleet's actions are carried out with, off the loop's task.
struct Worker {
    brain: mpsc::Sender<Command>,
    spec: FleetSpec,
    provider: Arc<dyn Provider>,
    store: Arc<dyn Store>,
    coordinator_id: String,
    server_url: String,
    registration_token: String,
    coordinator_key: String,
}

/// How long one pass waits for the fleets' lists; a slower provider sits the pass out (its
/// list goes on, bounded by the provider's own timeout).
const LIST_WAIT: Duration = Duration::from_secs(3);

/// The loop's memory that may be lost: rebuilt from the provider and the store after a restart.
struct Loop {
    deps: Deps,
    fleets: Vec<FleetRun>,
    unavailable: Vec<UnavailableOffer>,
    /// Each offer's errors in a row: how long its next skip is (`gpuci_core::fleet::backoff`:
    /// capacity errors from 15 s, doubling, reset by a create or start the provider took).
    /// Kept in the store with `unavailable` after each pass that changed them and as soon as a
    /// worker's refusals are taken in (not a pass later: a coordinator killed in between asked
    /// the refusing offer again at once), taken back when the loop starts ([`remember`]).
    backoffs: Backoffs,
    /// Notified when a fleet's worker has finished: its effects are taken in and kept then.
    worker_done: Arc<tokio::sync::Notify>,
    /// The back-off as last kept (JSON), so a pass that changed nothing writes nothing.
    kept_backoffs: String,
    idle_since: HashMap<String, UnixSecs>,
    /// When each stopped machine was first seen stopped: its stopped hold counts from here
    /// (after a restart of the coordinator, from then: a stopped machine is kept longer, never
    /// deleted sooner).
    stopped_since: HashMap<String, UnixSecs>,
    /// What the idle rules remember per fleet (`gpuci_core::fleet::idle`): arrivals are the
    /// active GPU jobs first seen by a pass (waiting, placed or running), each on the first
    /// fleet it fits, at when it was queued (a job that starts and ends between two passes is
    /// not seen); ends are those jobs seen no longer active (`in_demand`), for the idle
    /// spells; boot and start times are the rule's defaults. Rebuilt within a day after a restart,
    /// except the capacity outages met (creates and starts refused for want of capacity, until
    /// one is taken: `reconcile`), which are kept in the store with the back-off ([`remember`]).
    history: BTreeMap<String, FleetHistory>,
    /// Arrival profiles, step run times and upcoming fan-out, learned from the store.
    inputs: crate::fleet_inputs::FleetInputs,
    /// Jobs counted as arrivals of a fleet (`history`) that are still active: when one is no
    /// longer, its end is counted (the idle spells, `gpuci_core::fleet::idle`).
    in_demand: HashMap<i64, String>,
    /// What each machine's provider said of it in the last listing (shown with it).
    provider_notes: HashMap<String, String>,
    interruptions: BTreeMap<String, Vec<UnixSecs>>,
    /// Machines whose interruption was counted.
    interrupted_seen: std::collections::HashSet<String>,
    /// Fleets no longer configured whose machines were warned of.
    warned_orphans: std::collections::HashSet<String>,
    /// When this loop started (unix seconds): boot clocks count from here at the earliest.
    started_s: UnixSecs,
    statuses: Statuses,
}

/// A stored machine's capacity type (`spot` or `on-demand`).
fn capacity_of(r: &MachineRecord) -> Capacity {
    if r.capacity == "spot" {
        Capacity::Spot
    } else {
        Capacity::OnDemand
    }
}

pub fn start(fleets: Vec<FleetSpec>, deps: Deps, shutdown: CancellationToken) -> Statuses {
    let statuses: Statuses = Arc::new(RwLock::new(Vec::new()));
    if fleets.is_empty() {
        return statuses;
    }
    let runs: Vec<FleetRun> = fleets
        .into_iter()
        .map(|spec| match provider_for(&spec, &deps.coordinator_id, &deps.registration_token, &deps.data_dir) {
            Ok(p) => FleetRun {
                provider: Some(Arc::new(Counted {
                    inner: p,
                    fleet: spec.name.clone(),
                    provider: spec.provider.to_string(),
                    metrics: deps.metrics.clone(),
                })),
                spec,
                unavailable_reason: None,
                errors: VecDeque::new(),
                worker: None,
                listing: None,
            },
            Err(e) => {
                tracing::error!(fleet = %spec.name, error = %e, "fleet cannot create machines");
                FleetRun {
                    spec,
                    provider: None,
                    unavailable_reason: Some(e),
                    errors: VecDeque::new(),
                    worker: None,
                    listing: None,
                }
            }
        })
        .collect();
    // Every fleet shows from the start, before the first pass has listed anything.
    if let Ok(mut st) = statuses.write() {
        *st = runs
            .iter()
            .map(|r: &FleetRun| FleetStatus {
                name: r.spec.name.clone(),
                provider: r.spec.provider.to_string(),
                max: r.spec.max,
                min_idle: r.spec.min_idle,
                why: "not reconciled yet".into(),
                daily_budget_usd: r.spec.daily_budget,
                unavailable: r.unavailable_reason.clone(),
                ..FleetStatus::default()
            })
            .collect();
    }
    let l = Loop {
        deps,
        fleets: runs,
        unavailable: Vec::new(),
        backoffs: Backoffs::default(),
        kept_backoffs: String::new(),
        worker_done: Arc::new(tokio::sync::Notify::new()),
        idle_since: HashMap::new(),
        stopped_since: HashMap::new(),
        history: BTreeMap::new(),
        inputs: crate::fleet_inputs::FleetInputs::default(),
        in_demand: HashMap::new(),
        provider_notes: HashMap::new(),
        interruptions: BTreeMap::new(),
        interrupted_seen: std::collections::HashSet::new(),
        warned_orphans: std::collections::HashSet::new(),
        started_s: now_s(),
        statuses: statuses.clone(),
    };
    tokio::spawn(l.run(shutdown));
    statuses
}

fn now_s() -> UnixSecs {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
