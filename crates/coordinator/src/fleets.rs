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

use crate::brain::{ask, Command, FleetView};
use gpuci_core::fleet::ending::{classify_end, EndedMachine, MachineEnd};
use gpuci_core::fleet::{
    decide, fits, offer_unavailable_after_error, Action, AutoscaleInput, Backoffs, Capacity, FleetHistory, FleetSpec,
    Machine, MachineState, QueuedJob, SkipCause, UnavailableOffer, UnixSecs,
};
use gpuci_core::placement::Needs;
pub use gpuci_protocol::api::{FleetStatus, MachineStatus};
use gpuci_providers::{
    AgentLaunch, CreateRequest, Provider, ProviderMachine, ProviderState, TAG_COORDINATOR, TAG_FLEET, TAG_MACHINE,
};
use gpuci_store::{MachineRecord, Store};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Provider errors kept per fleet for `gpuci fleets`.
const RECENT_ERRORS: usize = 10;
/// A machine asked for but not yet listed by its provider counts as requested this long.
const LIST_GRACE_MS: i64 = 120_000;

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

/// A provider whose every call is counted by fleet, provider, call and result.
struct Counted {
    inner: Box<dyn gpuci_providers::Provider>,
    fleet: String,
    provider: String,
    metrics: Arc<crate::metrics::Metrics>,
}

impl Counted {
    fn note<T>(&self, call: &str, r: gpuci_providers::ProviderResult<T>) -> gpuci_providers::ProviderResult<T> {
        self.metrics.provider_call(&self.fleet, &self.provider, call, r.is_ok());
        r
    }
}

#[async_trait::async_trait]
impl gpuci_providers::Provider for Counted {
    fn can_stop(&self) -> bool {
        self.inner.can_stop()
    }
    async fn create(&self, req: &gpuci_providers::CreateRequest) -> gpuci_providers::ProviderResult<ProviderMachine> {
        let r = self.inner.create(req).await;
        self.note("create", r)
    }
    async fn list(&self) -> gpuci_providers::ProviderResult<Vec<ProviderMachine>> {
        let r = self.inner.list().await;
        self.note("list", r)
    }
    async fn delete(&self, machine: &str) -> gpuci_providers::ProviderResult<()> {
        let r = self.inner.delete(machine).await;
        self.note("delete", r)
    }
    async fn stop(&self, machine: &str) -> gpuci_providers::ProviderResult<ProviderMachine> {
        let r = self.inner.stop(machine).await;
        self.note("stop", r)
    }
    async fn start(&self, machine: &str) -> gpuci_providers::ProviderResult<ProviderMachine> {
        let r = self.inner.start(machine).await;
        self.note("start", r)
    }
}

/// A stored machine, in `state`, as the fleets listing shows it.
fn machine_status(r: &MachineRecord, state: &str) -> MachineStatus {
    MachineStatus {
        id: r.id.clone(),
        state: state.to_string(),
        provider_id: r.provider_id.clone(),
        instance_type: r.instance_type.clone(),
        zone: r.zone.clone(),
        capacity: r.capacity.clone(),
        agent_id: r.agent_id.clone(),
        requested_at_ms: r.requested_at_ms,
        running_at_ms: r.running_at_ms,
        connected_at_ms: r.connected_at_ms,
        first_job_at_ms: r.first_job_at_ms,
        note: None,
    }
}

/// A stored machine's capacity type (`spot` or `on-demand`).
fn capacity_of(r: &MachineRecord) -> Capacity {
    if r.capacity == "spot" {
        Capacity::Spot
    } else {
        Capacity::OnDemand
    }
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
}

/// How long one pass waits for the fleets' lists; a slower provider sits the pass out (its
/// list goes on, bounded by the provider's own timeout).
const LIST_WAIT: Duration = Duration::from_secs(3);

/// A machine id a provider may hand back: a short printable token (it goes into tags, file
/// names, commands and terminals).
fn valid_machine_id(id: &str) -> bool {
    (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// The loop's memory that may be lost: rebuilt from the provider and the store after a restart.
struct Loop {
    deps: Deps,
    fleets: Vec<FleetRun>,
    unavailable: Vec<UnavailableOffer>,
    /// Each offer's errors in a row: how long its next skip is (`gpuci_core::fleet::backoff`:
    /// capacity errors from 15 s, doubling, reset by a create or start the provider took).
    /// Lost on a restart: every offer then starts again from its first skip.
    backoffs: Backoffs,
    idle_since: HashMap<String, UnixSecs>,
    /// When each stopped machine was first seen stopped: its stopped hold counts from here
    /// (after a restart of the coordinator, from then: a stopped machine is kept longer, never
    /// deleted sooner).
    stopped_since: HashMap<String, UnixSecs>,
    /// What the idle rules remember per fleet (`gpuci_core::fleet::idle`): arrivals are the
    /// waiting jobs first seen, each on the first fleet it fits (a job placed on an idle
    /// machine between two passes is not seen: the rule then errs toward letting machines go);
    /// boot and start times are the rule's defaults. Rebuilt within a day after a restart.
    history: BTreeMap<String, FleetHistory>,
    /// Arrival profiles, step run times and upcoming fan-out, learned from the store.
    inputs: crate::fleet_inputs::FleetInputs,
    seen_waiting: HashMap<i64, UnixSecs>,
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

/// Start the loop; `None` when there are no fleets. Providers that cannot be made are shown as
/// unavailable on their fleet (and logged), never silently skipped.
/// The provider of `fleet`: `aws` and `kubernetes` from their own crates (their SDKs are large
/// and stay out of the providers crate), the others from `gpuci_providers`. An error a person can act on when the
/// fleet's settings cannot work.
pub fn provider_for(
    fleet: &FleetSpec,
    coordinator: &str,
    registration_token: &str,
    data_dir: &std::path::Path,
) -> Result<Box<dyn gpuci_providers::Provider>, String> {
    match fleet.provider {
        gpuci_core::fleet::ProviderKind::Aws => {
            Ok(Box::new(gpuci_aws::AwsProvider::from_settings(fleet, coordinator)?))
        }
        gpuci_core::fleet::ProviderKind::Kubernetes => {
            Ok(Box::new(gpuci_kube::KubeProvider::from_settings(fleet, coordinator)?))
        }
        _ => gpuci_providers::for_fleet(fleet, coordinator, registration_token, data_dir),
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
        idle_since: HashMap::new(),
        stopped_since: HashMap::new(),
        history: BTreeMap::new(),
        inputs: crate::fleet_inputs::FleetInputs::default(),
        seen_waiting: HashMap::new(),
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

impl Loop {
    /// Interruptions of the last two hours, from the store: the spot breaker survives a restart.
    async fn recall_interruptions(&mut self) {
        let since_ms = (now_s().saturating_sub(2 * 3600) * 1000) as i64;
        let Ok(all) = self.deps.store.machines(false).await else { return };
        for m in all {
            let Some(t) = m.interrupted_at_ms.filter(|t| *t >= since_ms) else { continue };
            self.interrupted_seen.insert(m.id.clone());
            self.interruptions.entry(m.fleet.clone()).or_default().push((t / 1000) as u64);
        }
    }

    async fn run(mut self, shutdown: CancellationToken) {
        self.recall_interruptions().await;
        tracing::info!(fleets = self.fleets.len(), coordinator = %self.deps.coordinator_id, "fleets reconcile loop on");
        loop {
            self.pass().await;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.deps.interval) => {}
                _ = self.deps.wake.notified() => {
                    // A burst of submissions is one pass, not one each.
                    tokio::time::sleep(WAKE_GAP.min(self.deps.interval)).await;
                }
            }
        }
    }

    fn error(&mut self, fleet: usize, what: String) {
        // Provider text: one line, escaped, so it cannot forge log lines.
        tracing::warn!(fleet = %self.fleets[fleet].spec.name, "{}", gpuci_core::text::escape(&what));
        let errors = &mut self.fleets[fleet].errors;
        errors.push_front((now_s(), what));
        errors.truncate(RECENT_ERRORS);
    }

    /// One reconcile pass over every fleet.
    async fn pass(&mut self) {
        self.collect_workers().await;
        let now = now_s();
        let now_ms = now as i64 * 1000;
        self.unavailable.retain(|u| u.until > now);
        self.backoffs.forget(now);
        let records = match self.deps.store.machines(true).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "fleets: cannot read machines this pass");
                return;
            }
        };
        let mut records: BTreeMap<String, MachineRecord> = records.into_iter().map(|r| (r.id.clone(), r)).collect();

        // What exists, per fleet; a fleet whose list fails sits this pass out (deciding on a
        // partial view could create duplicates or delete what runs).
        let mut listed: BTreeMap<String, ProviderMachine> = BTreeMap::new();
        let mut ok_fleets = vec![false; self.fleets.len()];
        let mut adopt: Vec<MachineRecord> = Vec::new();
        let mut list_errors = Vec::new();
        // Every fleet's list at once, each its own task: a pass waits a short while for them,
        // and a fleet whose provider has not answered by then sits this pass out while its list
        // goes on (one slow or hanging provider holds up no other fleet).
        for run in self.fleets.iter_mut() {
            if let (None, Some(p)) = (&run.listing, &run.provider) {
                let p = p.clone();
                run.listing = Some(tokio::spawn(async move { p.list().await }));
            }
        }
        let deadline = tokio::time::Instant::now() + LIST_WAIT;
        let mut lists = Vec::with_capacity(self.fleets.len());
        for run in self.fleets.iter_mut() {
            let Some(handle) = run.listing.as_mut() else {
                lists.push(None);
                continue;
            };
            match tokio::time::timeout_at(deadline, handle).await {
                Ok(result) => {
                    run.listing = None;
                    lists.push(Some(result.unwrap_or_else(|e| {
                        Err(gpuci_providers::ProviderError::new(gpuci_providers::ErrorKind::Transient, e.to_string()))
                    })));
                }
                Err(_) => {
                    let slow = format!("its provider has not answered `list` for {LIST_WAIT:?}; nothing decided for this fleet this pass");
                    tracing::debug!(fleet = %run.spec.name, "{slow}");
                    lists.push(None);
                }
            }
        }
        for (i, (run, list)) in self.fleets.iter().zip(lists).enumerate() {
            let Some(list) = list else { continue };
            match list {
                Ok(ms) => {
                    ok_fleets[i] = true;
                    let fleet = &run.spec;
                    let mut seen = std::collections::HashSet::new();
                    for m in ms {
                        // Ids go into tags, paths and terminals: a provider's odd ones are
                        // refused, and shown (escaped) on the fleet.
                        if !valid_machine_id(&m.machine) {
                            let shown: String = m.machine.chars().take(80).collect();
                            list_errors.push((
                                i,
                                format!("the provider listed a machine id that is not a short token of letters, digits, . _ -: {shown:?}; ignored"),
                            ));
                            continue;
                        }
                        if !seen.insert(m.machine.clone()) {
                            list_errors.push((
                                i,
                                format!("the provider listed machine {} twice; the first entry counts", m.machine),
                            ));
                            continue;
                        }
                        // Listed by this fleet's provider: one of its machines, unless the
                        // store says it belongs to another fleet (a provider that lists too much).
                        if records.get(&m.machine).is_some_and(|r| r.fleet != fleet.name) {
                            continue;
                        }
                        if !records.contains_key(&m.machine) && m.state != ProviderState::Terminated {
                            tracing::info!(fleet = %fleet.name, machine = %m.machine, "adopting a machine this coordinator's store did not know");
                            adopt.push(adopted(fleet, &m, now_ms));
                        }
                        listed.insert(m.machine.clone(), m);
                    }
                }
                Err(e) => list_errors
                    .push((i, format!("listing machines failed: {e}; nothing decided for this fleet this pass"))),
            }
        }
        for (i, what) in list_errors {
            self.error(i, what);
        }
        // Recorded at once, whatever the join below changes: billing refers to the row.
        for rec in adopt {
            if let Err(e) = self.deps.store.put_machine(&rec).await {
                tracing::warn!(machine = %rec.id, error = %e, "fleets: cannot record an adopted machine");
            }
            records.insert(rec.id.clone(), rec);
        }
        // The scheduler's view is taken after the lists: an agent that registered before its
        // machine was listed as ended is then known to have registered (`ending`).
        let view: FleetView = match ask(&self.deps.brain, |reply| Command::FleetView { reply }).await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "fleets: no view of the scheduler this pass");
                return;
            }
        };
        let agents: HashMap<&str, &crate::brain::FleetAgent> =
            view.agents.iter().map(|a| (a.machine.as_str(), a)).collect();

        // Join what the store knows with what is listed: end what is gone, note boot stages.
        let mut machines: Vec<Machine> = Vec::new();
        let mut writes: Vec<MachineRecord> = Vec::new();
        let mut drain_done: Vec<String> = Vec::new();
        let mut lost_machines: Vec<String> = Vec::new();
        let mut ended_agents: Vec<(String, String)> = Vec::new();
        let absent: HashMap<&str, bool> = view.absent.iter().map(|(m, lost)| (m.as_str(), *lost)).collect();
        let mut notes: Vec<(usize, String)> = Vec::new();
        let mut bill_open: Vec<(String, i64)> = Vec::new();
        let mut bill_close: Vec<(String, i64)> = Vec::new();
        for rec in records.values_mut() {
            let Some(fi) = self.fleets.iter().position(|f| f.spec.name == rec.fleet) else { continue };
            if !ok_fleets[fi] {
                continue;
            }
            let fleet = &self.fleets[fi].spec;
            let before = rec.clone();
            let pm = listed.get(&rec.id);
            let gone = match pm {
                // A new machine may not be listed yet (a cloud's listing lags its creates);
                // one that was listed running and whose agent connected is gone when it is
                // no longer listed (a pod deleted with its node).
                // An agent still connected is never ended for want of a listing (a stale
                // watch, a pod relabelled by someone else): its machine is plainly there.
                None if agents.contains_key(rec.id.as_str()) => false,
                None => {
                    now_ms - rec.requested_at_ms > LIST_GRACE_MS
                        || (rec.running_at_ms.is_some() && rec.connected_at_ms.is_some())
                }
                Some(pm) => pm.state == ProviderState::Terminated,
            };
            if gone {
                let busy = agents.get(rec.id.as_str()).is_some_and(|a| a.running > 0);
                // Judged by the agent's registration, never by what the last pass saw: an
                // allocation cancelled a second after its agent registered is taken back, not
                // a boot failure (`gpuci_core::fleet::ending`).
                let registered = this_boots_agent(&view, rec).or_else(|| rec.agent_id.clone());
                let end = classify_end(&EndedMachine {
                    seen_ending: pm.is_some(),
                    registered_agent: registered.as_deref(),
                    retired_by_fleet: rec.state == "ended" || rec.state == "stopped",
                });
                let died_booting = end == MachineEnd::BootFailure;
                // Ended before its agent ever registered (an agent that exits at start, an
                // instance that fails its boot): a boot failure, so its offer is skipped for a
                // while instead of made again at once, in a loop.
                if died_booting {
                    let offer =
                        fleet.offers.iter().position(|o| o.instance_type == rec.instance_type && o.zone == rec.zone);
                    // The provider's words for how it ended (an image the kubelet cannot pull,
                    // a Slurm job's reason) are what the fleet and its waiting jobs say.
                    let what = match pm.and_then(|p| p.note.as_deref()) {
                        Some(n) => format!(
                            "machine {} ended before its agent connected: {}",
                            rec.id,
                            gpuci_core::text::escape(n)
                        ),
                        None => format!(
                            "machine {} ended before its agent connected (see the provider's log of it)",
                            rec.id
                        ),
                    };
                    if let Some(o) = offer {
                        let u = offer_unavailable_after_error(&fleet.name, o, capacity_of(rec), now)
                            .because(SkipCause::BootFailed, what.clone());
                        let skip = self.backoffs.error(u, now);
                        self.unavailable.push(skip);
                    }
                    notes.push((
                        fi,
                        format!(
                            "{what}; {} skipped for a while",
                            fleet.offers.get(offer.unwrap_or(0)).map_or_else(String::new, |o| o.label())
                        ),
                    ));
                }
                // Its agent may have had no chance to say so (killed at once, its node lost):
                // jobs it was given go back to the queue, once, as for a machine taken back.
                if let MachineEnd::TakenBack { agent } = &end {
                    tracing::info!(fleet = %fleet.name, machine = %rec.id, agent = %agent, "machine ended after its agent registered: taken back, its jobs queued again");
                    rec.agent_id.get_or_insert_with(|| agent.clone());
                    rec.connected_at_ms.get_or_insert(now_ms);
                    let reason = pm.and_then(|p| p.note.clone()).unwrap_or_else(|| "gone at the provider".into());
                    ended_agents.push((agent.clone(), format!("machine {} ended: {reason}", rec.id)));
                }
                rec.state = "ended".into();
                rec.ended_at_ms = Some(now_ms);
                rec.reason.get_or_insert_with(|| {
                    if busy && !died_booting { "gone at the provider while running jobs" } else { end.reason() }.into()
                });
                if let Some(note) = pm.and_then(|p| p.note.clone()) {
                    rec.reason = Some(note);
                }
                bill_close.push((rec.id.clone(), now_ms));
                self.idle_since.remove(&rec.id);
                writes.push(rec.clone());
                continue;
            }
            let agent = agents.get(rec.id.as_str());
            if let Some(pm) = pm {
                rec.provider_id = Some(pm.provider_id.clone());
                if matches!(pm.state, ProviderState::Running) && rec.running_at_ms.is_none() {
                    rec.running_at_ms = Some(now_ms);
                }
            }
            if let Some(a) = agent {
                rec.agent_id = Some(a.agent_id.clone());
                rec.connected_at_ms.get_or_insert(now_ms);
                if let Some(t) = a.first_job_at_ms.filter(|t| *t >= rec.requested_at_ms) {
                    rec.first_job_at_ms.get_or_insert(t);
                } else if a.running > 0 {
                    rec.first_job_at_ms.get_or_insert(now_ms);
                }
            }
            let state = match (pm.map(|p| p.state), agent) {
                (None, _) => MachineState::Requested,
                (Some(ProviderState::Stopped), _) => MachineState::Stopped,
                (Some(ProviderState::Stopping), _) => MachineState::Stopping,
                (Some(_), Some(a)) if a.interrupted.is_some() => MachineState::Draining,
                (Some(_), Some(a)) if a.running > 0 => MachineState::Busy,
                (Some(_), Some(_)) => MachineState::Idle,
                // Its agent connected once and is away now (this coordinator restarted, a
                // network blip): held, neither booting nor idle, until it comes back; once the
                // scheduler counts it lost (its jobs ended so), the machine is of no use.
                (Some(_), None) if rec.connected_at_ms.is_some() => {
                    if absent.get(rec.id.as_str()) == Some(&true) {
                        lost_machines.push(rec.id.clone());
                    }
                    MachineState::Draining
                }
                (Some(_), None) => MachineState::Booting,
            };
            if let (MachineState::Draining, Some(a)) = (state, agent) {
                // Counted once per machine, for the fleet's spot breaker; deleted once its
                // jobs are back in the queue (the provider takes it anyway).
                if self.interrupted_seen.insert(rec.id.clone()) {
                    self.interruptions.entry(rec.fleet.clone()).or_default().push(now);
                    let why = a.interrupted.clone().unwrap_or_default();
                    notes.push((fi, format!("machine {}: {why}; its jobs were queued again", rec.id)));
                    rec.reason = Some(why);
                    // In the store: the breaker counts it after a restart too.
                    rec.interrupted_at_ms.get_or_insert(now_ms);
                }
                if a.running == 0 {
                    drain_done.push(rec.id.clone());
                }
            }
            rec.state = match state {
                MachineState::Requested => "requested",
                MachineState::Booting => "booting",
                MachineState::Draining => "draining",
                MachineState::Idle | MachineState::Busy => "ready",
                MachineState::Stopping => "stopping",
                MachineState::Stopped => "stopped",
            }
            .into();
            if state != MachineState::Stopped {
                self.stopped_since.remove(&rec.id);
            }
            let since = match state {
                MachineState::Idle => *self.idle_since.entry(rec.id.clone()).or_insert(now),
                MachineState::Stopped => {
                    self.idle_since.remove(&rec.id);
                    *self.stopped_since.entry(rec.id.clone()).or_insert(now)
                }
                // The boot clock counts from this coordinator's start at the earliest: an agent
                // cannot connect to a coordinator that is not running.
                MachineState::Requested | MachineState::Booting => {
                    self.idle_since.remove(&rec.id);
                    ((rec.requested_at_ms / 1000) as u64).max(self.started_s)
                }
                _ => {
                    self.idle_since.remove(&rec.id);
                    (rec.requested_at_ms / 1000) as u64
                }
            };
            let offer = fleet
                .offers
                .iter()
                .position(|o| o.instance_type == rec.instance_type && o.zone == rec.zone)
                .unwrap_or(0);
            let capacity = capacity_of(rec);
            if matches!(state, MachineState::Booting | MachineState::Idle | MachineState::Busy) {
                bill_open.push((rec.id.clone(), pm.and_then(|p| p.launched_at).map_or(now_ms, |t| t as i64 * 1000)));
            }
            machines.push(Machine {
                id: rec.id.clone(),
                fleet: rec.fleet.clone(),
                offer,
                capacity,
                state,
                created_at: (rec.requested_at_ms / 1000) as u64,
                since,
                gpus_busy: agent.map_or(0, |a| a.gpus_busy),
                jobs: Vec::new(),
                note: pm.and_then(|p| p.note.clone()),
            });
            match pm.and_then(|p| p.note.clone()) {
                Some(n) => {
                    self.provider_notes.insert(rec.id.clone(), gpuci_core::text::escape(&n).to_string());
                }
                None => {
                    self.provider_notes.remove(&rec.id);
                }
            }
            if *rec != before {
                writes.push(rec.clone());
            }
        }
        for (fi, what) in notes {
            self.error(fi, what);
        }
        for (agent, reason) in ended_agents {
            let _ = self.deps.brain.send(Command::MachineEnded { agent, reason }).await;
        }
        for w in &writes {
            if let Err(e) = self.deps.store.put_machine(w).await {
                tracing::warn!(machine = %w.id, error = %e, "fleets: cannot record a machine");
            }
        }
        for (m, t) in bill_close {
            let _ = self.deps.store.close_billing(&m, t).await;
        }
        for (m, t) in bill_open {
            let _ = self.deps.store.open_billing(&m, t).await;
        }

        // Demand: waiting jobs, with the fleets whose machines they fit.
        // Only fleets whose machines were listed: deciding for one seen as empty would create
        // what may already exist.
        let specs: Vec<FleetSpec> = self
            .fleets
            .iter()
            .zip(&ok_fleets)
            .filter(|(f, ok)| f.provider.is_some() && **ok)
            .map(|(f, _)| f.spec.clone())
            .collect();
        let mut repos: HashMap<i64, Option<String>> = HashMap::new();
        let mut queued: Vec<QueuedJob> = Vec::new();
        for w in &view.waiting {
            let needs = Needs {
                tags: &w.tags,
                gpu: &w.gpu,
                container: w.container,
                deadline: crate::brain::job_deadline(w.timeout, now_ms),
            };
            let fleets: Vec<String> = specs.iter().filter(|s| fits(s, &needs)).map(|s| s.name.clone()).collect();
            if fleets.is_empty() {
                continue;
            }
            // Repositories matter to budgets only.
            let repository = if self.deps.budgets.is_empty() {
                None
            } else {
                if let std::collections::hash_map::Entry::Vacant(e) = repos.entry(w.pipeline_id) {
                    let p = self.deps.store.get_pipeline(w.pipeline_id).await;
                    e.insert(p.ok().flatten().and_then(|p| {
                        crate::repos::name_of_pipeline(
                            p.repository.as_deref(),
                            p.origin.as_deref(),
                            &self.deps.github_host,
                        )
                    }));
                }
                repos.get(&w.pipeline_id).cloned().flatten()
            };
            // First seen waiting: an arrival for the fleet it would make demand for.
            if let std::collections::hash_map::Entry::Vacant(e) = self.seen_waiting.entry(w.id) {
                let at = ((w.since_ms / 1000) as u64).min(now);
                e.insert(now);
                let h = self.history.entry(fleets[0].clone()).or_default();
                let k = h.arrivals.partition_point(|&t| t <= at);
                h.arrivals.insert(k, at);
                h.trim(now, gpuci_core::fleet::idle::STOPPED_WINDOW_S);
            }
            queued.push(QueuedJob {
                id: w.id.to_string(),
                queued_since: (w.since_ms / 1000) as u64,
                gpus: w.gpu.count,
                fleets,
                repository,
                // Filled in below from its step's recent runs (for budgets).
                expected_run_s: None,
            });
        }
        let spend = self.spend_today(now).await;
        let repo_spend = self.repo_spend_today(now).await;
        self.inputs.refresh(self.deps.store.as_ref(), &specs, now).await;
        for s in &specs {
            self.history.entry(s.name.clone()).or_default().profile = self.inputs.profile(&s.name);
        }
        let active = self.deps.store.active_jobs().await.unwrap_or_default();
        let upcoming = self.inputs.upcoming(&active, &specs, now);
        // Each waiting job's expected run, from its step's recent runs: a fleet or repository
        // under a budget counts it before a machine is made for it.
        let steps: HashMap<String, &str> = active.iter().map(|j| (j.id.to_string(), j.step.key.as_str())).collect();
        for q in &mut queued {
            q.expected_run_s = steps.get(&q.id).and_then(|key| self.inputs.expected_run_s(key));
        }
        let decision = decide(&AutoscaleInput {
            now,
            fleets: &specs,
            queued: &queued,
            machines: &machines,
            spend_today: &spend,
            budgets: &self.deps.budgets,
            repo_spend_today: &repo_spend,
            unavailable: &self.unavailable,
            interruptions: &self.interruptions,
            history: &self.history,
            upcoming: &upcoming,
        });
        // Jobs seen waiting are remembered for a day (a job waits longer only when stuck).
        self.seen_waiting.retain(|_, seen| now.saturating_sub(*seen) < gpuci_core::fleet::idle::STOPPED_WINDOW_S);
        // A job waiting on a fleet whose provider is in trouble (its list did not come back
        // this pass, or it failed within the last minute) is told so, not only the fleet.
        let trouble: BTreeMap<&str, String> = self
            .fleets
            .iter()
            .zip(&ok_fleets)
            .filter_map(|(run, ok)| {
                // An error that skipped an offer is said already, in the provider's words, by
                // the autoscaler's reason for as long as the skip lasts (`no_offer_reason`):
                // not a second time here.
                let said = |e: &str| {
                    self.unavailable.iter().any(|u| {
                        u.fleet == run.spec.name && u.until > now && !u.message.is_empty() && e.contains(&u.message)
                    })
                };
                let recent = run
                    .errors
                    .front()
                    .filter(|(t, e)| now.saturating_sub(*t) <= 60 && !said(e))
                    .map(|(_, e)| e.clone());
                let why = match (ok, recent, &run.unavailable_reason) {
                    (_, _, Some(u)) => u.clone(),
                    (false, _, None) => "its provider did not answer this pass".to_string(),
                    (true, Some(e), None) => e,
                    (true, None, None) => return None,
                };
                Some((run.spec.name.as_str(), why))
            })
            .collect();
        let mut notes: BTreeMap<i64, String> =
            decision.waiting.iter().filter_map(|(id, why)| Some((id.parse().ok()?, why.clone()))).collect();
        // A job no configured fleet can ever serve waits for nothing: it is told so from zero,
        // naming each fleet and why (`gpuci_core::fleet::fit`), and each fleet's summary names
        // it, instead of "no agent is connected" beside "enough machines".
        let configured: Vec<FleetSpec> = self.fleets.iter().map(|f| f.spec.clone()).collect();
        let mut unservable: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for w in &view.waiting {
            let needs = Needs {
                tags: &w.tags,
                gpu: &w.gpu,
                container: w.container,
                deadline: crate::brain::job_deadline(w.timeout, now_ms),
            };
            let Some(why) = gpuci_core::fleet::fit::no_fleet_serves(&configured, &needs) else { continue };
            notes.insert(w.id, why);
            for f in &configured {
                if let Some(here) = gpuci_core::fleet::fit::why_not(f, &needs) {
                    unservable.entry(f.name.clone()).or_default().push((w.id.to_string(), here));
                }
            }
        }
        for w in &view.waiting {
            let needs = Needs {
                tags: &w.tags,
                gpu: &w.gpu,
                container: w.container,
                deadline: crate::brain::job_deadline(w.timeout, now_ms),
            };
            let id = w.id;
            for run in self.fleets.iter().filter(|r| fits(&r.spec, &needs)) {
                let f = &run.spec.name;
                if let Some(why) = trouble.get(f.as_str()) {
                    let shown: String = why.chars().take(300).collect();
                    let note = notes.entry(id).or_default();
                    if !note.is_empty() {
                        note.push_str("; ");
                    }
                    note.push_str(&format!("fleet {f}: {shown}"));
                }
            }
        }
        let reached = gpuci_core::fleet::budget::all_reached(&self.deps.budgets, &repo_spend);
        let _ = self.deps.brain.send(Command::FleetNotes { notes, reached }).await;
        let mut actions = decision.actions.clone();
        for machine in drain_done {
            let reason = "its machine is being taken back and its jobs are queued again".to_string();
            actions.push(Action::Delete { machine, reason });
        }
        for machine in lost_machines {
            let reason = "its agent is lost (silent past lost_after); the machine is of no use".to_string();
            actions.push(Action::Delete { machine, reason });
        }
        self.dispatch(actions, &records, now_ms).await;
        // The breaker looks back `window_s` and holds for `on_demand_for_s`: older times go.
        let keep_from = now.saturating_sub(2 * 3600);
        for times in self.interruptions.values_mut() {
            times.retain(|t| *t >= keep_from);
        }
        let summaries: Vec<gpuci_core::fleet::FleetSummary> = decision
            .fleets
            .iter()
            .map(|s| match unservable.get(&s.fleet) {
                Some(unfit) => gpuci_core::fleet::FleetSummary {
                    why: gpuci_core::fleet::fit::with_unservable(&s.why, unfit),
                    ..s.clone()
                },
                None => s.clone(),
            })
            .collect();
        self.publish(&summaries, &spend).await;
    }

    /// USD spent today per repository (its jobs' shares, as the cost report counts them);
    /// empty when no repository has a budget (nothing would read it).
    async fn repo_spend_today(&self, now: UnixSecs) -> BTreeMap<String, f64> {
        let mut spend = BTreeMap::new();
        if self.deps.budgets.is_empty() {
            return spend;
        }
        let midnight_ms = (now - now % 86_400) as i64 * 1000;
        match cost_inputs(self.deps.store.as_ref(), midnight_ms, &self.deps.github_host).await {
            Ok((machines, stretches, runs)) => {
                let r = gpuci_core::fleet::cost::report(&machines, &stretches, &runs, midnight_ms, now as i64 * 1000);
                for row in r.rows {
                    if let Some(repo) = row.repository.filter(|r| r != gpuci_core::fleet::cost::NO_REPOSITORY) {
                        *spend.entry(repo).or_insert(0.0) += row.usd;
                    }
                }
            }
            // Not knowing what was spent must not lift a budget: every budget counts as
            // reached until the store answers again.
            Err(e) => {
                tracing::warn!(error = %e, "fleets: cannot sum today's spend per repository; holding back jobs of repositories with a budget");
                for b in &self.deps.budgets {
                    spend.insert(b.repository.sample().to_string(), f64::INFINITY);
                }
            }
        }
        spend
    }

    async fn spend_today(&self, now: UnixSecs) -> BTreeMap<String, f64> {
        let midnight_ms = (now - now % 86_400) as i64 * 1000;
        let now_ms = now as i64 * 1000;
        let mut spend = BTreeMap::new();
        let (Ok(stretches), Ok(all)) =
            (self.deps.store.billing_since(midnight_ms).await, self.deps.store.machines(false).await)
        else {
            return spend;
        };
        let by_id: HashMap<&str, &MachineRecord> = all.iter().map(|m| (m.id.as_str(), m)).collect();
        for s in stretches {
            let Some(m) = by_id.get(s.machine_id.as_str()) else { continue };
            let from = s.from_ms.max(midnight_ms);
            let to = s.to_ms.unwrap_or(now_ms).min(now_ms);
            if to > from {
                *spend.entry(m.fleet.clone()).or_insert(0.0) += (to - from) as f64 / 3_600_000.0 * m.price_per_hour;
            }
        }
        spend
    }

    /// Take in what finished workers changed.
    async fn collect_workers(&mut self) {
        for fi in 0..self.fleets.len() {
            let done = self.fleets[fi].worker.as_ref().is_some_and(|w| w.is_finished());
            if !done {
                continue;
            }
            let Some(worker) = self.fleets[fi].worker.take() else { continue };
            let effects = match worker.await {
                Ok(e) => e,
                Err(e) => vec![Effect::Error(format!("carrying out the autoscaler's actions failed: {e}"))],
            };
            for effect in effects {
                match effect {
                    Effect::Error(what) => self.error(fi, what),
                    Effect::Unavailable(u) => {
                        let skip = self.backoffs.error(u, now_s());
                        self.unavailable.push(skip);
                    }
                    Effect::Took { fleet, offer, capacity } => self.backoffs.success(&fleet, offer, capacity),
                    Effect::Gone(machine) => {
                        self.idle_since.remove(&machine);
                    }
                }
            }
        }
    }

    /// Hand each fleet its actions, carried out off this task; a fleet still busy with the
    /// last pass's gets none now (the next pass decides again from what is then listed).
    async fn dispatch(&mut self, actions: Vec<Action>, records: &BTreeMap<String, MachineRecord>, now_ms: i64) {
        // A machine to delete or stop whose agent is connected: the scheduler first stops
        // placing jobs on it, and only a machine still running nothing goes (a job placed since
        // this pass's view keeps its machine).
        let agent_of = |m: &str| records.get(m).and_then(|r| r.agent_id.clone());
        let to_withdraw: Vec<String> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Delete { machine, .. } | Action::Stop { machine, .. } => agent_of(machine),
                _ => None,
            })
            .collect();
        let withdrawn: std::collections::HashSet<String> = if to_withdraw.is_empty() {
            Default::default()
        } else {
            let reason = "its machine is being deleted or stopped by its fleet".to_string();
            match ask(&self.deps.brain, |reply| Command::Withdraw { agents: to_withdraw, reason, reply }).await {
                Ok(ids) => ids.into_iter().collect(),
                Err(e) => {
                    tracing::warn!(error = %e, "fleets: the scheduler did not answer; nothing deleted or stopped this pass");
                    Default::default()
                }
            }
        };
        let actions: Vec<Action> = actions
            .into_iter()
            .filter(|a| match a {
                Action::Delete { machine, .. } | Action::Stop { machine, .. } => {
                    agent_of(machine).is_none_or(|agent| withdrawn.contains(&agent))
                }
                _ => true,
            })
            .collect();
        let mut by_fleet: BTreeMap<usize, Vec<Action>> = BTreeMap::new();
        for a in actions {
            let fleet = match &a {
                Action::Create { fleet, .. } => Some(fleet.as_str()),
                Action::Delete { machine, .. }
                | Action::BootFailed { machine, .. }
                | Action::Stop { machine, .. }
                | Action::Start { machine, .. } => records.get(machine).map(|r| r.fleet.as_str()),
            };
            if let Some(fi) = fleet.and_then(|f| self.fleets.iter().position(|r| r.spec.name == f)) {
                by_fleet.entry(fi).or_default().push(a);
            }
        }
        for (fi, actions) in by_fleet {
            let run = &mut self.fleets[fi];
            let Some(provider) = run.provider.clone() else { continue };
            if run.worker.is_some() {
                tracing::debug!(fleet = %run.spec.name, "its provider is still busy with the last pass's actions");
                continue;
            }
            let worker = Worker {
                brain: self.deps.brain.clone(),
                spec: run.spec.clone(),
                provider,
                store: self.deps.store.clone(),
                coordinator_id: self.deps.coordinator_id.clone(),
                server_url: self.deps.server_url.clone(),
                registration_token: self.deps.registration_token.clone(),
            };
            let records: BTreeMap<String, MachineRecord> =
                records.iter().filter(|(_, r)| r.fleet == run.spec.name).map(|(k, v)| (k.clone(), v.clone())).collect();
            run.worker = Some(tokio::spawn(async move {
                let mut effects = Vec::new();
                for a in &actions {
                    worker.apply(a, &records, now_ms, &mut effects).await;
                }
                effects
            }));
        }
    }

    async fn publish(&mut self, summaries: &[gpuci_core::fleet::FleetSummary], spend: &BTreeMap<String, f64>) {
        let records = self.deps.store.machines(true).await.unwrap_or_default();
        let mut out = Vec::new();
        for run in &self.fleets {
            let s = summaries.iter().find(|s| s.fleet == run.spec.name);
            let machines: Vec<MachineStatus> = records
                .iter()
                .filter(|r| r.fleet == run.spec.name)
                .map(|r| {
                    let state = match (r.state.as_str(), self.idle_since.contains_key(&r.id)) {
                        ("ready", true) => "idle",
                        ("ready", false) => "busy",
                        (s, _) => s,
                    };
                    MachineStatus { note: self.provider_notes.get(&r.id).cloned(), ..machine_status(r, state) }
                })
                .collect();
            let count = machines.iter().filter(|m| m.state != "stopped").count() as u32;
            out.push(FleetStatus {
                name: run.spec.name.clone(),
                provider: run.spec.provider.to_string(),
                machines,
                // After this pass's actions (the summary counts before them).
                count,
                wanted: s.map_or(0, |s| s.wanted),
                max: run.spec.max,
                min_idle: run.spec.min_idle,
                // The decision, then how long idle and stopped machines are kept and why.
                why: s.map_or_else(String::new, |s| {
                    std::iter::once(s.why.as_str())
                        .chain(s.rules.iter().map(String::as_str))
                        .collect::<Vec<_>>()
                        .join("; ")
                }),
                spend_today_usd: spend.get(&run.spec.name).copied().unwrap_or(0.0),
                daily_budget_usd: run.spec.daily_budget,
                budget_reached: s.is_some_and(|s| s.budget_reached),
                breaker_open_until: s.and_then(|s| s.breaker_open_until),
                recent_errors: run.errors.iter().cloned().collect(),
                unavailable: run.unavailable_reason.clone(),
            });
        }
        // Machines of fleets no longer in the config: nothing manages them now. Said loudly,
        // and shown, so they are not left billing unseen.
        let mut orphans: BTreeMap<&str, Vec<&MachineRecord>> = BTreeMap::new();
        for r in records.iter().filter(|r| !self.fleets.iter().any(|f| f.spec.name == r.fleet)) {
            orphans.entry(r.fleet.as_str()).or_default().push(r);
        }
        for (fleet, machines) in orphans {
            let ids: Vec<&str> = machines.iter().map(|m| m.id.as_str()).collect();
            let what = format!(
                "fleet {fleet} is no longer in the config, but its machines {} still exist as far as gpuci knows: \
                 nothing deletes them now; put the fleet back (they are then managed again) or delete them at the provider",
                ids.join(", ")
            );
            if self.warned_orphans.insert(fleet.to_string()) {
                tracing::warn!("{what}");
            }
            out.push(FleetStatus {
                name: fleet.to_string(),
                provider: "?".into(),
                count: machines.len() as u32,
                unavailable: Some(what),
                machines: machines.iter().map(|r| machine_status(r, "orphaned")).collect(),
                ..FleetStatus::default()
            });
        }
        if let Ok(mut st) = self.statuses.write() {
            *st = out;
        }
    }
}

impl Worker {
    async fn apply(
        &self,
        action: &Action,
        records: &BTreeMap<String, MachineRecord>,
        now_ms: i64,
        out: &mut Vec<Effect>,
    ) {
        let p = &self.provider;
        match action {
            Action::Create { offer, capacity, reason, .. } => self.create(*offer, *capacity, reason, now_ms, out).await,
            Action::Delete { machine, reason } | Action::BootFailed { machine, reason } => {
                let boot_failed = matches!(action, Action::BootFailed { .. });
                let Some(rec) = records.get(machine) else { return };
                tracing::info!(fleet = %rec.fleet, machine = %machine, "deleting: {reason}");
                match p.delete(machine).await {
                    Ok(()) => {
                        let ended = MachineRecord {
                            state: "ended".into(),
                            reason: Some(reason.clone()),
                            ended_at_ms: Some(now_ms),
                            boot_failed,
                            ..rec.clone()
                        };
                        let _ = self.store.put_machine(&ended).await;
                        let _ = self.store.close_billing(machine, now_ms).await;
                        out.push(Effect::Gone(machine.clone()));
                        if boot_failed {
                            // A machine of this offer that never came up: the next one would
                            // likely not either (a broken image, a wrong network). Skip the
                            // offer for a while instead of paying for boots in a loop.
                            if let Some(o) = self.offer_of(rec) {
                                let capacity = capacity_of(rec);
                                out.push(Effect::Unavailable(
                                    offer_unavailable_after_error(&rec.fleet, o, capacity, now_ms as u64 / 1000)
                                        .because(SkipCause::BootFailed, format!("machine {machine}: {reason}")),
                                ));
                            }
                            out.push(Effect::Error(format!(
                                "machine {machine}: {reason}; deleted, and its offer ({} in {}) skipped for a while",
                                rec.instance_type, rec.zone
                            )));
                        }
                    }
                    Err(e) => {
                        self.restore(rec).await;
                        out.push(Effect::Error(format!("deleting machine {machine}: {e}")));
                    }
                }
            }
            Action::Stop { machine, reason } => {
                let Some(rec) = records.get(machine) else { return };
                tracing::info!(fleet = %rec.fleet, machine = %machine, "stopping: {reason}");
                match p.stop(machine).await {
                    Ok(_) => {
                        let stopped =
                            MachineRecord { state: "stopped".into(), reason: Some(reason.clone()), ..rec.clone() };
                        let _ = self.store.put_machine(&stopped).await;
                        let _ = self.store.close_billing(machine, now_ms).await;
                        out.push(Effect::Gone(machine.clone()));
                    }
                    Err(e) => {
                        self.restore(rec).await;
                        out.push(Effect::Error(format!("stopping machine {machine}: {e}")));
                    }
                }
            }
            Action::Start { machine, reason } => {
                let Some(rec) = records.get(machine) else { return };
                tracing::info!(fleet = %rec.fleet, machine = %machine, "starting: {reason}");
                match p.start(machine).await {
                    Ok(pm) => {
                        if let Some(o) = self.offer_of(rec) {
                            out.push(Effect::Took { fleet: rec.fleet.clone(), offer: o, capacity: capacity_of(rec) });
                        }
                        let started = MachineRecord {
                            state: "booting".into(),
                            reason: Some(reason.clone()),
                            // Boot stages count again from this start.
                            requested_at_ms: now_ms,
                            running_at_ms: None,
                            connected_at_ms: None,
                            first_job_at_ms: None,
                            agent_id: None,
                            ..rec.clone()
                        };
                        let _ = self.store.put_machine(&started).await;
                        let from = pm.launched_at.map_or(now_ms, |t| (t as i64 * 1000).max(now_ms));
                        let _ = self.store.open_billing(machine, from).await;
                    }
                    Err(e) => {
                        // A stopped machine is pinned to its offer: a start refused for want of
                        // capacity skips the offer as a failed create does, so the autoscaler
                        // creates on another offer instead of starting this one every pass.
                        if e.is_capacity() {
                            if let Some(o) = self.offer_of(rec) {
                                let cause = match e.kind {
                                    gpuci_providers::ErrorKind::Refused => SkipCause::Refused,
                                    _ => SkipCause::Capacity,
                                };
                                out.push(Effect::Unavailable(
                                    offer_unavailable_after_error(
                                        &rec.fleet,
                                        o,
                                        capacity_of(rec),
                                        now_ms as u64 / 1000,
                                    )
                                    .because(cause, format!("starting machine {machine}: {}", e.message)),
                                ));
                            }
                        }
                        out.push(Effect::Error(format!("starting machine {machine}: {e}")));
                    }
                }
            }
        }
    }

    /// The machine stays after all: its agent takes jobs again.
    async fn restore(&self, rec: &MachineRecord) {
        if let Some(agent) = rec.agent_id.clone() {
            let _ = self.brain.send(Command::Restore { agent }).await;
        }
    }

    fn offer_of(&self, rec: &MachineRecord) -> Option<usize> {
        self.spec.offers.iter().position(|o| o.instance_type == rec.instance_type && o.zone == rec.zone)
    }

    async fn create(&self, offer_at: usize, capacity: Capacity, reason: &str, now_ms: i64, out: &mut Vec<Effect>) {
        let fleet = &self.spec;
        let Some(offer) = fleet.offers.get(offer_at).cloned() else { return };
        let id = format!("m-{}", &uuid::Uuid::now_v7().simple().to_string()[..16]);
        let rec = MachineRecord {
            id: id.clone(),
            fleet: fleet.name.clone(),
            provider_id: None,
            instance_type: offer.instance_type.clone(),
            zone: offer.zone.clone(),
            capacity: capacity.as_str().into(),
            price_per_hour: offer.price(capacity),
            gpus: fleet.machine.gpus,
            state: "requested".into(),
            reason: Some(reason.to_string()),
            agent_id: None,
            requested_at_ms: now_ms,
            running_at_ms: None,
            connected_at_ms: None,
            first_job_at_ms: None,
            ended_at_ms: None,
            boot_failed: false,
            interrupted_at_ms: None,
        };
        // Recorded before it is asked for: a crash in between leaves a row the next pass ends
        // (never listed) or joins with what the provider made (listed, by its tag).
        if let Err(e) = self.store.put_machine(&rec).await {
            out.push(Effect::Error(format!("cannot record a new machine: {e}")));
            return;
        }
        let mut tags = fleet.machine.tags.clone();
        tags.insert(TAG_COORDINATOR.into(), self.coordinator_id.clone());
        tags.insert(TAG_FLEET.into(), fleet.name.clone());
        tags.insert(TAG_MACHINE.into(), id.clone());
        let setting = |k: &str| fleet.settings.get(k);
        let agent = AgentLaunch {
            server: setting("server").and_then(|v| v.as_str()).unwrap_or(&self.server_url).to_string(),
            // Its own token, spent by its agent's registration: never the coordinator's, which
            // a job on the machine could read back (EC2 user data, a provider's files).
            registration_token: crate::auth::machine_token(
                &crate::auth::Secret::new(self.registration_token.clone()),
                &id,
            ),
            tags,
            name: format!("{}-{id}", fleet.name),
            program: match setting("agent_program").and_then(|v| v.as_str()) {
                Some(p) => p.to_string(),
                // A local machine runs the agent of this very build.
                None if fleet.provider == gpuci_core::fleet::ProviderKind::Local => local_agent_program(),
                None => "gpuci".to_string(),
            },
            extra_args: agent_args(&fleet.settings),
        };
        tracing::info!(fleet = %fleet.name, machine = %id, offer = %offer.label(), %capacity, "creating: {reason}");
        let req = CreateRequest { machine: id.clone(), offer: offer.clone(), capacity, agent };
        let answer = self.provider.create(&req).await.and_then(|pm| {
            if pm.machine == id {
                Ok(pm)
            } else {
                let shown: String = pm.machine.chars().take(80).collect();
                Err(gpuci_providers::ProviderError::new(
                    gpuci_providers::ErrorKind::Invalid,
                    format!("the provider answered a create of {id} with machine {shown:?}"),
                ))
            }
        });
        match answer {
            Ok(pm) => {
                out.push(Effect::Took { fleet: fleet.name.clone(), offer: offer_at, capacity });
                let made = MachineRecord {
                    provider_id: Some(pm.provider_id.clone()),
                    state: "booting".into(),
                    running_at_ms: (pm.state == ProviderState::Running).then_some(now_ms),
                    ..rec
                };
                let _ = self.store.put_machine(&made).await;
                let from = pm.launched_at.map_or(now_ms, |t| t as i64 * 1000);
                let _ = self.store.open_billing(&id, from).await;
            }
            Err(e) => {
                let capacity_error = e.is_capacity();
                if capacity_error {
                    // Which it was decides what the fleet says: "a capacity error" of a
                    // cluster's refusal sends people looking for capacity.
                    let cause = match e.kind {
                        gpuci_providers::ErrorKind::Refused => SkipCause::Refused,
                        _ => SkipCause::Capacity,
                    };
                    out.push(Effect::Unavailable(
                        offer_unavailable_after_error(&fleet.name, offer_at, capacity, now_ms as u64 / 1000)
                            .because(cause, e.message.clone()),
                    ));
                }
                let what = format!(
                    "{} for {} ({capacity}){}",
                    e.message,
                    offer.label(),
                    if capacity_error { "; trying the next offer" } else { "" }
                );
                out.push(Effect::Error(what.clone()));
                let ended =
                    MachineRecord { state: "ended".into(), reason: Some(what), ended_at_ms: Some(now_ms), ..rec };
                let _ = self.store.put_machine(&ended).await;
            }
        }
    }
}

/// What the cost report is computed from, since `from_ms`: fleet machines, their billed
/// stretches, and the jobs that ran on them with their repositories (printed identities with
/// their host, `github.com/acme/x`; a bare `owner/name` is on `github_host`).
pub async fn cost_inputs(
    store: &dyn Store,
    from_ms: i64,
    github_host: &str,
) -> gpuci_store::Result<(
    Vec<gpuci_core::fleet::cost::BilledMachine>,
    Vec<gpuci_core::fleet::cost::Stretch>,
    Vec<gpuci_core::fleet::cost::Run>,
)> {
    use gpuci_core::fleet::cost::{BilledMachine, Run, Stretch};
    let machines = store.machines(false).await?;
    let stretches = store.billing_since(from_ms).await?;
    let by_agent: HashMap<&str, &str> =
        machines.iter().filter_map(|m| Some((m.agent_id.as_deref()?, m.id.as_str()))).collect();
    let mut runs = Vec::new();
    // No fleet machine ever: no job ran on one (and the jobs need not be read).
    let ran = if by_agent.is_empty() { Vec::new() } else { store.jobs_ran_since(from_ms).await? };
    let on_machines: Vec<(&gpuci_store::JobRecord, &str, i64)> =
        ran.iter().filter_map(|j| Some((j, *by_agent.get(j.agent_id.as_deref()?)?, j.started_at_ms?))).collect();
    let pipelines: Vec<i64> = on_machines
        .iter()
        .map(|(j, _, _)| j.pipeline_id)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let repos = store.pipeline_origins(&pipelines).await?;
    for (j, machine, started) in on_machines {
        runs.push(Run {
            machine: machine.to_string(),
            repository: repos
                .get(&j.pipeline_id)
                .and_then(|(r, o)| crate::repos::name_of_pipeline(r.as_deref(), o.as_deref(), github_host)),
            gpus: j.gpus.len() as u32,
            from_ms: started,
            to_ms: j.finished_at_ms,
        });
    }
    let machines: Vec<BilledMachine> = machines
        .iter()
        .map(|m| BilledMachine {
            id: m.id.clone(),
            fleet: m.fleet.clone(),
            gpus: m.gpus,
            price_per_hour: m.price_per_hour,
        })
        .collect();
    let stretches: Vec<Stretch> =
        stretches.into_iter().map(|s| Stretch { machine: s.machine_id, from_ms: s.from_ms, to_ms: s.to_ms }).collect();
    Ok((machines, stretches, runs))
}

/// The agent that registered from `rec` during its latest boot, if one did: heard from since
/// the machine was (re)requested. A stopped machine started again keeps its agent's identity,
/// and that agent's registration from before the stop is not this boot's (else the restarted
/// machine read as one whose agent had come and gone, and a new machine was made).
fn this_boots_agent(view: &FleetView, rec: &MachineRecord) -> Option<String> {
    view.registered
        .get(&rec.id)
        .filter(|(_, last_seen_ms)| *last_seen_ms >= rec.requested_at_ms)
        .map(|(agent, _)| agent.clone())
}

/// This build's executable, for a local fleet's agents. One replaced since this process
/// started (an upgrade) reads `… (deleted)`: the new one at that path is meant.
fn local_agent_program() -> String {
    match std::env::current_exe() {
        Ok(p) => {
            let p = p.display().to_string();
            p.strip_suffix(" (deleted)").map(String::from).unwrap_or(p)
        }
        Err(_) => "gpuci".into(),
    }
}

/// Default of a fleet's `leave_after_unreachable`: an agent on a machine gpuci made gives the
/// machine up when the coordinator has been gone this long (`gpuci agent
/// --leave-after-unreachable`), so a dead coordinator does not leave GPUs billing.
pub const DEFAULT_LEAVE_AFTER: &str = "10m";

/// The `gpuci agent` arguments a fleet's machines get besides server, name and tags: the
/// settings' `agent_args`, then `--leave-after-unreachable` (the setting
/// `leave_after_unreachable`, [`DEFAULT_LEAVE_AFTER`] unless given, `"off"` for none) and
/// `--on-leave` (the setting `on_leave`, e.g. `"shutdown -h now"`), unless `agent_args` names
/// them already.
pub fn agent_args(settings: &toml::Table) -> Vec<String> {
    let mut args: Vec<String> = settings
        .get("agent_args")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|w| w.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let given = |flag: &str, args: &[String]| args.iter().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
    if !given("--leave-after-unreachable", &args) {
        match settings.get("leave_after_unreachable").and_then(|v| v.as_str()) {
            Some("off") => {}
            Some(d) => args.extend(["--leave-after-unreachable".to_string(), d.to_string()]),
            None => args.extend(["--leave-after-unreachable".to_string(), DEFAULT_LEAVE_AFTER.to_string()]),
        }
    }
    if let (Some(cmd), false) = (settings.get("on_leave").and_then(|v| v.as_str()), given("--on-leave", &args)) {
        if args.iter().any(|a| a.starts_with("--leave-after-unreachable")) {
            args.extend(["--on-leave".to_string(), cmd.to_string()]);
        }
    }
    args
}

/// A machine the provider lists under this coordinator's tag that the store does not know
/// (created just before a crash): recorded from what the provider says.
fn adopted(fleet: &FleetSpec, pm: &ProviderMachine, now_ms: i64) -> MachineRecord {
    let offer = fleet.offers.iter().find(|o| o.instance_type == pm.instance_type && o.zone == pm.zone);
    MachineRecord {
        id: pm.machine.clone(),
        fleet: fleet.name.clone(),
        provider_id: Some(pm.provider_id.clone()),
        instance_type: pm.instance_type.clone(),
        zone: pm.zone.clone(),
        capacity: pm.capacity.as_str().into(),
        price_per_hour: offer.map_or(0.0, |o| o.price(pm.capacity)),
        gpus: fleet.machine.gpus,
        state: "booting".into(),
        reason: Some("adopted: listed by the provider, unknown to this coordinator's store".into()),
        agent_id: None,
        requested_at_ms: pm.launched_at.map_or(now_ms, |t| t as i64 * 1000),
        running_at_ms: None,
        connected_at_ms: None,
        first_job_at_ms: None,
        ended_at_ms: None,
        boot_failed: false,
        interrupted_at_ms: None,
    }
}

#[cfg(test)]
mod tests {
    use super::agent_args;

    fn table(text: &str) -> toml::Table {
        toml::from_str(text).expect("toml")
    }

    #[test]
    fn machines_leave_by_default_when_the_coordinator_is_gone() {
        assert_eq!(agent_args(&table("")), ["--leave-after-unreachable", "10m"]);
        assert_eq!(
            agent_args(&table(
                "agent_args = [\"--slots\", \"2\"]\nleave_after_unreachable = \"30m\"\non_leave = \"shutdown -h now\""
            )),
            ["--slots", "2", "--leave-after-unreachable", "30m", "--on-leave", "shutdown -h now"]
        );
        assert_eq!(
            agent_args(&table("leave_after_unreachable = \"off\"\non_leave = \"poweroff\"")),
            Vec::<String>::new()
        );
        // Given in agent_args already: not twice.
        assert_eq!(
            agent_args(&table("agent_args = [\"--leave-after-unreachable\", \"1m\"]")),
            ["--leave-after-unreachable", "1m"]
        );
    }
}
