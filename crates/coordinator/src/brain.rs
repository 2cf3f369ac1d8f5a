//! The scheduler: the one task that owns live coordinator state and makes every decision.
//!
//! Handlers (REST, agent channel) validate their input and send a [`Command`]; the brain
//! applies it, writes the outcome to the store, and only then acknowledges the caller or
//! pushes to an agent. Periodic work (queue timeouts, lost agents) is a timer that sends
//! [`Command::Tick`] into the same queue, so there is never a second writer.
//!
//! Dispatch is event-driven: every command that can free or add capacity or work runs a
//! scheduling pass at once; nothing waits for the tick.
//!
//! Group commit: the brain handles every command already waiting (up to
//! `COMMANDS_PER_PASS`) and then runs one placement pass. Agents' starts and plain results
//! in that run are stored in one transaction (`Brain::flush_events`) and answered, so
//! acknowledged, only after it commits; a placement pass stores all its assignments in one
//! transaction (`Brain::commit_placements`) and sends none before it commits, and the
//! reasons of the jobs it could not place in another. One fsync per batch, not per job: that
//! write, one at a time, was what bounded placement (BENCHMARKS.md, "The coordinator under
//! load").

use crate::hub::Hub;
use crate::origin::{Origin, RunnerOrigin};
use gpuci_core::condition::Decision;
use gpuci_core::job::{should_retry, JobState, Outcome};
use gpuci_core::pipeline::Pipeline;
use gpuci_core::placement::{self, Deadline, GpuSlot, GpuSlotState, HostView, Needs};
use gpuci_core::secret_scope::SecretScope;
use gpuci_protocol::agent::{
    Assignment, CoordinatorMessage, Forgotten, GpuHealth, Hello, JobFinished, RESOURCES_TAG, UNSANDBOXED_TAG,
};
use gpuci_protocol::api::{AgentSummary, GpuView};
use gpuci_protocol::{JobId, PipelineId};
use gpuci_store::{
    AgentUpdate, JobChange, JobRecord, JobUpdate, NewAssignment, NewJob, NewPipeline, PipelineRecord, Quarantine,
    Store, StoreError,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// Timers of the coordinator. Tests shorten them.
#[derive(Clone, Debug)]
pub struct Timing {
    /// How often agents send a heartbeat.
    pub heartbeat_interval: Duration,
    /// An agent silent (or disconnected) this long is lost; its jobs end `lost`.
    pub lost_after: Duration,
    /// Period of the reaper timer (queue timeouts, lost agents).
    pub tick: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            heartbeat_interval: Duration::from_secs(5),
            lost_after: Duration::from_secs(30),
            tick: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BrainError {
    #[error("job {0} not found")]
    JobNotFound(JobId),
    #[error("pipeline {0} not found")]
    PipelineNotFound(PipelineId),
    #[error("job {job} is already {state}")]
    AlreadyFinished { job: JobId, state: JobState },
    #[error("GPU {0} is not quarantined")]
    NotQuarantined(String),
    #[error("agent refused: {0}")]
    AgentRefused(String),
    /// The request does not fit the job's state (a retry of a running job).
    #[error("{0}")]
    Conflict(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the coordinator is shutting down")]
    ShuttingDown,
}

/// Registers just-in-time Actions runners with GitHub. Called when a runner job has been
/// placed and its GPUs leased; the answer comes back as [`Command::RunnerRegistered`], so the
/// scheduler never waits on GitHub.
#[async_trait::async_trait]
pub trait RunnerRegistrar: Send + Sync + 'static {
    async fn register(&self, job: JobId, agent_id: &str, origin: &RunnerOrigin) -> Result<RunnerGrant, String>;
    /// A registration whose job was cancelled or requeued meanwhile: remove the runner.
    async fn discard(&self, grant: RunnerGrant);
}

/// A registered runner: its name and its JIT config (a credential: given to the job as a secret).
#[derive(Clone)]
pub struct RunnerGrant {
    pub runner_name: String,
    pub jit_config: String,
}

/// A pipeline to create.
pub struct Submission {
    pub file_name: String,
    pub source: String,
    pub pipeline: Pipeline,
    pub extra_env: BTreeMap<String, String>,
    /// The id of an upload the caller checked exists.
    pub workspace_upload: Option<String>,
    pub repository: Option<String>,
    /// An [`Origin`](crate::origin::Origin) as JSON.
    pub origin: Option<String>,
    /// What the build is, for steps' `if:` (unknown facts: `None`).
    pub build: gpuci_core::condition::BuildFacts,
}

/// What to do with an agent's jobs when it connects: [`reconcile`]'s answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Ours and held by the agent: its events (start, output, result) will follow.
    pub keep: Vec<JobId>,
    /// Held by the agent but not (or no longer) ours: it is told why and stops them.
    pub forget: Vec<JobId>,
    /// Assigned to it, never received: back to the queue.
    pub requeue: Vec<JobId>,
    /// Running on it by our record (or assigned, when its journal is incomplete), unknown to
    /// it: ended `lost`.
    pub lost: Vec<JobId>,
}

/// Settle an agent's jobs on connect. `ours`: the active jobs assigned to it, with their
/// state; `holds`: the jobs it holds (its journal: received and not yet acknowledged as
/// finished). The agent journals an assignment before starting it, so a job it does not hold
/// never started there and may be handed out again; one we had recorded as running, it must
/// have lost (its data dir was replaced). When the agent says its journal may lack records
/// (`journal_incomplete`), a job it does not hold may have started there all the same: lost
/// too, never handed out again as if it had not run.
pub fn reconcile(ours: &[(JobId, JobState)], holds: &[JobId], journal_incomplete: bool) -> Reconciled {
    let held: BTreeSet<JobId> = holds.iter().copied().collect();
    let mine: BTreeSet<JobId> = ours.iter().map(|(id, _)| *id).collect();
    let mut r = Reconciled { forget: held.difference(&mine).copied().collect(), ..Default::default() };
    for (id, state) in ours {
        match (held.contains(id), state) {
            (true, _) => r.keep.push(*id),
            (false, JobState::Assigned) if !journal_incomplete => r.requeue.push(*id),
            (false, _) => r.lost.push(*id),
        }
    }
    r
}

/// How a stored job reason begins while a cancel is under way: the persisted record of a
/// cancel that was accepted and sent, until the job ends.
const CANCELLING: &str = "cancelling: ";

/// Commands handled between two placement passes at most ([`Brain::run`]).
const COMMANDS_PER_PASS: usize = 1024;

/// Why an event from a connection the agent has since replaced is not applied (the agent
/// sends it again on its current one).
const STALE: &str = "from an earlier connection of this agent";

/// The secret environment variable that carries a runner job's JIT config.
/// The variable the Actions runner reads its `--jitconfig` from when the argument is absent
/// (the runner's `ACTIONS_RUNNER_INPUT_<NAME>` convention; it clears the variable once read).
/// Never the argument: a command line is readable by every local user.
pub const JIT_CONFIG_ENV: &str = "ACTIONS_RUNNER_INPUT_JITCONFIG";

pub type Reply<T> = oneshot::Sender<Result<T, BrainError>>;

/// Send the scheduler a command made with a reply channel and wait for the answer.
pub async fn ask<T>(tx: &mpsc::Sender<Command>, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, BrainError> {
    let (reply, rx) = oneshot::channel();
    tx.send(make(reply)).await.map_err(|_| BrainError::ShuttingDown)?;
    rx.await.map_err(|_| BrainError::ShuttingDown)?
}

/// A connection's outbound queue. Unbounded: the brain must never block on a slow agent; a
/// dead connection is noticed by its reader and reported as `AgentDisconnected`.
pub type AgentTx = mpsc::UnboundedSender<CoordinatorMessage>;

pub enum Command {
    Submit {
        sub: Box<Submission>,
        reply: Reply<(PipelineRecord, Vec<JobRecord>)>,
    },
    /// The answer to a runner registration started when an Actions runner job was placed.
    RunnerRegistered {
        job: JobId,
        /// Which placement asked: a requeued and re-placed job registers again.
        placement: u64,
        result: Result<RunnerGrant, String>,
    },
    Cancel {
        job: JobId,
        reason: String,
        reply: Reply<JobRecord>,
    },
    /// Run a finished job again, as a new attempt of its step (by hand, from the dashboard).
    Retry {
        job: JobId,
        by: String,
        reply: Reply<JobRecord>,
    },
    /// "Retry failed" on a pipeline: a new attempt of each job `gpuci_core::rerun` names.
    RetryFailed {
        pipeline: PipelineId,
        by: String,
        reply: Reply<Vec<JobRecord>>,
    },
    /// "Cancel all": every unfinished job of a pipeline; answers the jobs it cancelled (or
    /// is cancelling).
    CancelPipeline {
        pipeline: PipelineId,
        reason: String,
        reply: Reply<Vec<JobRecord>>,
    },
    AgentConnected {
        agent_id: String,
        conn: u64,
        hello: Box<Hello>,
        tx: AgentTx,
        reply: Reply<()>,
    },
    /// A job's result. Answered once committed (or known to be already); an error means the
    /// agent must send it again later.
    AgentFinished {
        agent_id: String,
        conn: u64,
        finished: JobFinished,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// A job's process started, without the protections in `unenforced`. Answered like
    /// `AgentFinished`.
    AgentStarted {
        agent_id: String,
        conn: u64,
        job: JobId,
        started_at_ms: i64,
        unenforced: Vec<gpuci_protocol::agent::Unenforced>,
        reply: oneshot::Sender<Result<(), String>>,
    },
    AgentGpus {
        agent_id: String,
        conn: u64,
        gpus: Vec<gpuci_core::gpu::GpuInfo>,
        health: BTreeMap<String, GpuHealth>,
    },
    AgentSeen {
        agent_id: String,
        conn: u64,
    },
    AgentPaused {
        agent_id: String,
        conn: u64,
        reason: Option<String>,
    },
    /// The agent's machine is being taken back (a spot interruption notice).
    AgentInterrupted {
        agent_id: String,
        conn: u64,
        reason: String,
    },
    AgentDisconnected {
        agent_id: String,
        conn: u64,
    },
    ReleaseGpu {
        uuid: String,
        reply: Reply<()>,
    },
    Agents {
        reply: Reply<Vec<AgentSummary>>,
    },
    /// What the fleets' reconcile loop needs to decide: machines' agents and the jobs that
    /// no connected agent can take now.
    FleetView {
        reply: Reply<FleetView>,
    },
    /// Why each job the fleets could serve still waits (the autoscaler's words), added to the
    /// job's reason while it stays queued for want of an agent.
    FleetNotes {
        notes: BTreeMap<JobId, String>,
        /// Repository budgets reached today: their jobs are placed on no fleet machine.
        reached: Vec<gpuci_core::fleet::RepoBudget>,
    },
    /// Fleet machines about to be deleted or stopped for idleness: each of these agents that
    /// runs no job takes none from now on; the answer names them (only they may go). Checked
    /// and marked in one step here, so no job lands on a machine between the check and the
    /// delete.
    Withdraw {
        agents: Vec<String>,
        reason: String,
        reply: Reply<Vec<String>>,
    },
    /// A withdrawn agent whose machine stays after all (its delete failed): it takes jobs again.
    Restore {
        agent: String,
    },
    /// The provider says this agent's machine has ended (a Slurm allocation cancelled or past
    /// its time limit, a pod evicted or its node gone) while the agent was given jobs: each is
    /// queued again, once, as for a machine taken back. For the agent that had no chance to
    /// say so itself (killed at once, its node lost).
    MachineEnded {
        agent: String,
        reason: String,
    },
    /// Steps a running job adds to its own pipeline (`crate::dynamic_steps`); its token was
    /// checked by the caller.
    AddSteps {
        job: JobId,
        file_name: String,
        source: String,
        reply: oneshot::Sender<Result<Vec<JobRecord>, crate::dynamic_steps::AddError>>,
    },
    Tick,
}

/// The queued next attempt of `job` (a retry, or a run after its machine was taken back).
fn next_attempt(job: &JobRecord, reason: String, now: i64) -> NewJob {
    NewJob {
        pipeline_id: job.pipeline_id,
        step: job.step.clone(),
        env: job.env.clone(),
        state: JobState::Queued,
        reason,
        attempt: job.attempt + 1,
        retry_of: Some(job.id),
        created_at_ms: now,
    }
}

/// A job on a machine taken back is queued again until this attempt; then it ends `lost`.
pub const MAX_INTERRUPTED_ATTEMPTS: u32 = 5;

/// Connected agents that run on fleet machines, and queued jobs no connected agent can take.
#[derive(Clone, Debug, Default)]
pub struct FleetView {
    pub agents: Vec<FleetAgent>,
    pub waiting: Vec<WaitingJob>,
    /// Machines (their `gpuci.machine` tags) whose agents are known but not connected now, and
    /// whether each is lost (gone past `lost_after`) or may still come back (a coordinator
    /// restart, a network blip).
    pub absent: Vec<(String, bool)>,
    /// Every machine an agent ever registered from (its `gpuci.machine` tag) → that agent,
    /// connected or not: registrations are durable (the agents table), so a machine that ended
    /// between two reconcile passes is still known to have booted. With when that agent was
    /// last heard from (unix ms): a registration from before a machine's latest (re)start is
    /// not this boot's (a stopped machine started again keeps its agent's identity).
    pub registered: BTreeMap<String, (String, i64)>,
}

#[derive(Clone, Debug)]
pub struct FleetAgent {
    pub agent_id: String,
    /// Its `gpuci.machine` tag.
    pub machine: String,
    /// Jobs assigned to it or running on it.
    pub running: u32,
    /// GPUs leased to those jobs.
    pub gpus_busy: u32,
    /// Its machine is being taken back (the notice, in words).
    pub interrupted: Option<String>,
    /// When a job first started on it.
    pub first_job_at_ms: Option<i64>,
}

#[derive(Clone, Debug)]
pub struct WaitingJob {
    pub id: JobId,
    pub pipeline_id: PipelineId,
    /// When it became ready to place (ms).
    pub since_ms: i64,
    pub tags: BTreeMap<String, String>,
    pub gpu: gpuci_core::gpu::GpuRequirements,
    pub container: bool,
    pub timeout: Option<gpuci_core::duration::Duration>,
}

/// What of a host's remaining time a job is given beyond its timeout: to be killed at the
/// timeout and have its result reported before the host ends.
pub const REPORT_ALLOWANCE_MS: u64 = 60_000;

/// How long a job with `timeout` may hold a host from `now_ms` (placement's view).
pub fn job_deadline(timeout: Option<gpuci_core::duration::Duration>, now_ms: i64) -> Option<Deadline> {
    timeout
        .map(|t| Deadline { now_ms, runs_for_ms: (t.as_std().as_millis() as u64).saturating_add(REPORT_ALLOWANCE_MS) })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    Connected,
    Disconnected,
    Lost,
}

struct AgentState {
    id: String,
    name: String,
    hostname: String,
    tags: BTreeMap<String, String>,
    slots: u32,
    gpus: Vec<gpuci_core::gpu::GpuInfo>,
    health: BTreeMap<String, GpuHealth>,
    gpu_backend: String,
    isolation: String,
    /// Why it takes no jobs at all, in its words (it then offers no slots).
    refuses: Option<String>,
    container_runtime: Option<String>,
    link: Link,
    /// Current connection: its id and outbound queue.
    conn: Option<(u64, AgentTx)>,
    /// Last message received, or when it went away.
    last_seen: Instant,
    last_seen_ms: i64,
    reason: String,
    /// Why the agent takes no new jobs now (its disk is nearly full): no slot of it is free.
    paused: Option<String>,
    /// Its machine is being taken back (a spot interruption notice): it takes no job again.
    interrupted: Option<String>,
    /// Its machine is being deleted or stopped by its fleet ([`Command::Withdraw`]).
    withdrawn: Option<String>,
    /// When a job first started on it in this connection's life (boot stages of fleet machines).
    first_job_at_ms: Option<i64>,
    /// When its machine ends by itself (a Slurm allocation's end).
    ends_at_ms: Option<i64>,
}

/// A job placed by a pass, waiting for the pass's one commit ([`Brain::commit_placements`]).
struct Placed {
    job: JobRecord,
    agent_id: String,
    gpus: Vec<String>,
    secrets: BTreeMap<String, String>,
    workspace_upload: Option<String>,
    cache: gpuci_core::cache::CacheScope,
    origin: Option<Origin>,
    trusted: bool,
    repository: Option<String>,
    log_from: u64,
}

/// Records why `j` waits unless that is already what it says.
fn note_reason(reasons: &mut Vec<(JobRecord, String)>, j: &JobRecord, why: String) {
    if j.reason != why {
        reasons.push((j.clone(), why));
    }
}

/// Agents' events (starts, plain results) handled and not yet stored: stored together in
/// one transaction ([`Brain::flush_events`]), and answered (so acknowledged to the agent,
/// which sends an event again until it is) only after that commit.
#[derive(Default)]
struct EventBatch {
    updates: Vec<JobUpdate>,
    /// What each update does in memory once stored.
    after: Vec<AfterCommit>,
    /// Each event's answer: what its update says, or `None` (nothing to store).
    answers: Vec<(EventReply, Option<usize>)>,
    /// The update of each job in the batch.
    index: HashMap<JobId, usize>,
}

/// Where an agent's event is answered (the channel acknowledges it on `Ok`).
type EventReply = oneshot::Sender<Result<(), String>>;

enum AfterCommit {
    Started { started_at_ms: i64 },
    Finished { quarantine: Vec<Quarantine> },
}

pub struct Brain {
    store: Arc<dyn Store>,
    /// Opens the sealed secret values the store hands back.
    secrets_key: Arc<gpuci_store::SecretsKey>,
    /// Opens secrets encrypted in pipeline files (`gpuci secret encrypt`).
    repo_keys: Option<Arc<std::sync::RwLock<gpuci_repo_secrets::KeyRing>>>,
    hub: Arc<Hub>,
    /// Counters of jobs ended and start latencies (`/metrics`).
    metrics: Arc<crate::metrics::Metrics>,
    timing: Timing,
    agents: BTreeMap<String, AgentState>,
    /// Every job not in a terminal state.
    active: BTreeMap<JobId, JobRecord>,
    /// Latest attempt of each step: (pipeline, key) → (job, state, soft failed).
    steps: HashMap<(PipelineId, String), (JobId, JobState, bool)>,
    quarantine: BTreeMap<String, Quarantine>,
    /// Reasons of cancels sent to agents and not yet confirmed.
    cancelling: HashMap<JobId, String>,
    /// When each queued job became ready to place (dependencies done, its concurrency group
    /// free). The queue timeout counts from here: waiting for a dependency is not waiting
    /// for capacity. In memory only: after a restart the clock starts again.
    ready_since: HashMap<JobId, i64>,
    /// Registers Actions runners (when GitHub is configured) and the queue its answers come back on.
    registrar: Option<(Arc<dyn RunnerRegistrar>, mpsc::Sender<Command>)>,
    /// Placed runner jobs whose registration is in flight: their assignments, not yet sent.
    registering: HashMap<JobId, (u64, Assignment)>,
    placements: u64,
    /// An agent's link (disconnected, lost) that the store could not take when it changed:
    /// written again on each reap until it is, so the stored state never says `connected`
    /// of an agent that is gone.
    unsaved_links: BTreeMap<String, AgentUpdate>,
    /// The last reap: a reap much later than its tick means the coordinator did not run in
    /// between (see [`heard_after_stall`]).
    last_tick: Option<Instant>,
    /// Something changed that may let a job be placed (or need a new reason): a placement
    /// pass runs once the commands already waiting are handled ([`Brain::run`]), not once per
    /// command — with thousands of agents, a pass per heartbeat-sized event queued the
    /// heartbeats themselves behind passes until every agent counted as lost (load test,
    /// issue 29).
    schedule_due: bool,
    /// Agents' events waiting for one commit together ([`Brain::flush_events`]).
    events: EventBatch,
    /// Jobs of lost agents whose log already says output may be missing, while their end
    /// waits to be stored ([`Brain::end_jobs_of_lost`]).
    noted_lost: BTreeSet<JobId>,
    /// The store took no writes when an agent was to be declared lost: until it does again
    /// ([`Brain::store_hears_again`]) no agent is.
    store_deaf: bool,
    /// Queued jobs the last scheduling pass found no agent for (not blocked by a dependency
    /// or a concurrency group): what fleets may create machines for.
    unplaceable: BTreeSet<JobId>,
    /// [`Brain::with_fleet_wake`].
    fleet_wake: Option<Arc<tokio::sync::Notify>>,
    /// The fleets' word on jobs in `unplaceable` ([`Command::FleetNotes`]).
    fleet_notes: BTreeMap<JobId, String>,
    /// Repository budgets reached today ([`Command::FleetNotes`]): their jobs are held off
    /// fleet machines.
    budgets_reached: Vec<gpuci_core::fleet::RepoBudget>,
    /// Pipelines' repositories (printed identities, `github.com/acme/x`), read once, while
    /// budgets are reached.
    repository_of: HashMap<PipelineId, Option<String>>,
    /// The configured GitHub host: a bare `owner/name` is a repository there.
    github_host: String,
    /// `[[concurrency.shared]]` groups of the server config.
    shared_groups: Vec<gpuci_core::concurrency::SharedGroup>,
    /// Repository and trust class of each pipeline with unfinished jobs: the scope of their
    /// concurrency groups ([`Brain::group_of`]).
    group_scopes: HashMap<PipelineId, (Option<gpuci_core::repo::RepoId>, gpuci_core::concurrency::TrustClass)>,
}

/// The `gpuci.fleet` tag value placement sees on agents no fleet made.
const NOT_A_FLEET_MACHINE: &str = "(none)";

/// When an agent counts as last heard after the coordinator did not run for `stall` (SIGSTOP,
/// a paused VM, a blocked disk): moved forward by the time it was not running, less the one
/// tick it would have waited anyway, never past `now`. A coordinator that did not run heard
/// nobody, however faithfully its agents sent heartbeats; counting that time declared every
/// healthy agent lost the moment it ran again (outsider attack: a 15 s stall with
/// `lost_after` 10 s ended every running job `lost`). Moving, not resetting: silence adds up
/// across stalls, so a coordinator that stalls again and again still finds a dead agent lost
/// after `lost_after` of its own running time (resetting gave it a fresh `lost_after` at
/// every stall, and its jobs stayed `running` for ever).
pub fn heard_after_stall(last_seen: Instant, stall: Duration, tick: Duration, now: Instant) -> Instant {
    last_seen.checked_add(stall.saturating_sub(tick)).map_or(now, |t| t.min(now))
}

/// Whether the reaper's timer came this late: the coordinator was not running in between.
/// A tick that is late by less than a second (a slow store write, a loaded host) is not a
/// stall; heartbeats keep coming through those.
pub fn stalled(previous_tick: Instant, now: Instant, tick: Duration) -> bool {
    now.saturating_duration_since(previous_tick) > 2 * tick + Duration::from_secs(1)
}

impl Brain {
    /// Load live state from the store. Agents start disconnected; they have `lost_after` from
    /// now to come back before their jobs are declared lost.
    pub async fn load(
        store: Arc<dyn Store>,
        hub: Arc<Hub>,
        timing: Timing,
        secrets_key: Arc<gpuci_store::SecretsKey>,
    ) -> Result<Brain, StoreError> {
        let mut brain = Brain {
            store,
            secrets_key,
            repo_keys: None,
            hub,
            metrics: Arc::new(crate::metrics::Metrics::new()),
            timing,
            agents: BTreeMap::new(),
            active: BTreeMap::new(),
            steps: HashMap::new(),
            quarantine: BTreeMap::new(),
            cancelling: HashMap::new(),
            ready_since: HashMap::new(),
            registrar: None,
            unsaved_links: BTreeMap::new(),
            registering: HashMap::new(),
            placements: 0,
            last_tick: None,
            schedule_due: false,
            events: EventBatch::default(),
            noted_lost: BTreeSet::new(),
            store_deaf: false,
            unplaceable: BTreeSet::new(),
            fleet_wake: None,
            fleet_notes: BTreeMap::new(),
            budgets_reached: Vec::new(),
            repository_of: HashMap::new(),
            github_host: gpuci_core::repo::DEFAULT_GITHUB_HOST.to_string(),
            shared_groups: Vec::new(),
            group_scopes: HashMap::new(),
        };
        let now = Instant::now();
        for a in brain.store.list_agents().await? {
            let hello: Option<Hello> = a.hello_json.as_deref().and_then(|h| serde_json::from_str(h).ok());
            let lost = a.state == "lost";
            brain.agents.insert(
                a.id.clone(),
                AgentState {
                    id: a.id.clone(),
                    name: a.name.clone(),
                    hostname: hello.as_ref().map(|h| h.hostname.clone()).unwrap_or_default(),
                    tags: hello.as_ref().map(|h| h.tags.clone()).unwrap_or_default(),
                    slots: hello.as_ref().map_or(0, |h| h.slots),
                    gpus: hello.as_ref().map(|h| h.gpus.clone()).unwrap_or_default(),
                    health: BTreeMap::new(),
                    gpu_backend: hello.as_ref().map(|h| h.gpu_backend.clone()).unwrap_or_default(),
                    isolation: hello.as_ref().map(|h| h.isolation.clone()).unwrap_or_default(),
                    refuses: hello.as_ref().and_then(|h| h.refuses.clone()),
                    container_runtime: hello.as_ref().and_then(|h| h.container_runtime.clone()),
                    link: if lost { Link::Lost } else { Link::Disconnected },
                    conn: None,
                    last_seen: now,
                    last_seen_ms: a.last_seen_ms.unwrap_or(0),
                    reason: if lost {
                        a.reason.clone()
                    } else {
                        "waiting for the agent to reconnect after a coordinator restart".into()
                    },
                    paused: None,
                    interrupted: None,
                    withdrawn: None,
                    first_job_at_ms: None,
                    ends_at_ms: hello.as_ref().and_then(|h| h.ends_at_ms),
                },
            );
        }
        for q in brain.store.quarantined().await? {
            brain.quarantine.insert(q.gpu_uuid.clone(), q);
        }
        let active = brain.store.active_jobs().await?;
        let pipelines: BTreeSet<PipelineId> = active.iter().map(|j| j.pipeline_id).collect();
        for p in pipelines {
            for j in brain.store.pipeline_jobs(p).await? {
                brain.note_step(&j);
            }
        }
        for j in active {
            // A cancel accepted before a restart: its stored reason is the record of it (written
            // before the cancel was acknowledged). Without this the restarted coordinator
            // neither sent it again nor judged the result as cancelled, and the job ran to
            // `succeeded` (outsider attack).
            if let Some(reason) = j.reason.strip_prefix(CANCELLING) {
                brain.cancelling.insert(j.id, reason.to_string());
            }
            brain.active.insert(j.id, j);
        }
        Ok(brain)
    }

    /// Open secrets encrypted in pipeline files with `ring`.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Wake the fleets' reconcile loop when a job newly finds no agent to take it: a machine
    /// is asked for at once, not at the loop's next tick.
    pub fn with_fleet_wake(mut self, wake: Arc<tokio::sync::Notify>) -> Self {
        self.fleet_wake = Some(wake);
        self
    }

    pub fn with_repo_keys(mut self, ring: Arc<std::sync::RwLock<gpuci_repo_secrets::KeyRing>>) -> Self {
        self.repo_keys = Some(ring);
        self
    }

    /// Register Actions runners through `registrar`; `tx` is the queue [`Brain::run`] reads.
    /// The configured GitHub host (a bare `owner/name` is a repository there) and the
    /// concurrency groups the server config shares between repositories.
    pub fn with_repositories(
        mut self,
        github_host: String,
        shared_groups: Vec<gpuci_core::concurrency::SharedGroup>,
    ) -> Self {
        self.github_host = github_host;
        self.shared_groups = shared_groups;
        self
    }

    pub fn with_registrar(mut self, registrar: Arc<dyn RunnerRegistrar>, tx: mpsc::Sender<Command>) -> Self {
        self.registrar = Some((registrar, tx));
        self
    }

    /// Run until `shutdown`; then return, leaving durable state as it is.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Command>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.timing.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.place_now().await;
        loop {
            let cmd = tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => Command::Tick,
                c = rx.recv() => match c { Some(c) => c, None => break },
            };
            self.handle(cmd).await;
            // Everything already waiting first (heartbeats, results), in arrival order, at
            // most a bounded batch so a flood cannot hold placement off for ever; then one
            // placement pass for all of it.
            for _ in 0..COMMANDS_PER_PASS {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd).await,
                    Err(_) => break,
                }
            }
            self.flush_events().await;
            if std::mem::take(&mut self.schedule_due) {
                self.place_now().await;
            }
        }
        tracing::debug!("scheduler stopped");
    }

    async fn handle(&mut self, cmd: Command) {
        // Agents' events wait for one commit together, but never past a command that could
        // read or change what they change: commands apply in arrival order.
        if !matches!(cmd, Command::AgentStarted { .. } | Command::AgentFinished { .. } | Command::AgentSeen { .. }) {
            self.flush_events().await;
        }
        match cmd {
            Command::Submit { sub, reply } => {
                let r = self.submit(*sub).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::RunnerRegistered { job, placement, result } => {
                self.runner_registered(job, placement, result).await;
                self.schedule().await;
            }
            Command::Cancel { job, reason, reply } => {
                let r = self.cancel(job, reason).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::Retry { job, by, reply } => {
                let r = self.retry(job, &by).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::RetryFailed { pipeline, by, reply } => {
                let r = self.retry_failed(pipeline, &by).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::CancelPipeline { pipeline, reason, reply } => {
                let r = self.cancel_pipeline(pipeline, reason).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::AgentConnected { agent_id, conn, hello, tx, reply } => {
                let r = self.agent_connected(&agent_id, conn, *hello, tx).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::AgentStarted { agent_id, conn, job, started_at_ms, unenforced, reply } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    if let Some(a) = self.agents.get_mut(&agent_id) {
                        a.first_job_at_ms.get_or_insert(started_at_ms);
                    }
                    // Stored and answered with the other events of this run of commands.
                    self.batch_start(&agent_id, job, started_at_ms, unenforced, reply);
                } else {
                    let _ = reply.send(Err(STALE.into()));
                }
            }
            Command::AgentFinished { agent_id, conn, finished, reply } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    // A plain result joins the batch; any other (a retry, a requeue, a start
                    // that went missing) is applied alone, after the batch before it.
                    if let Some((finished, reply)) = self.batch_finish(&agent_id, finished, reply) {
                        self.flush_events().await;
                        let r = self.job_finished(&agent_id, finished).await;
                        let _ = reply.send(r);
                    }
                } else {
                    let _ = reply.send(Err(STALE.into()));
                }
                self.schedule().await;
            }
            Command::AgentGpus { agent_id, conn, gpus, health } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    self.apply_gpus(&agent_id, gpus, health).await;
                    self.schedule().await;
                }
            }
            Command::AgentSeen { agent_id, conn } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                }
            }
            Command::AgentPaused { agent_id, conn, reason } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    if let Some(a) = self.agents.get_mut(&agent_id) {
                        match &reason {
                            Some(why) => tracing::warn!(agent = %a.name, why, "agent takes no new jobs"),
                            None => tracing::info!(agent = %a.name, "agent takes new jobs again"),
                        }
                        a.paused = reason;
                    }
                    self.schedule().await;
                }
            }
            Command::AgentInterrupted { agent_id, conn, reason } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    self.agent_interrupted(&agent_id, reason).await;
                    self.schedule().await;
                }
            }
            Command::AgentDisconnected { agent_id, conn } => {
                if self.is_current(&agent_id, conn) {
                    self.agent_disconnected(&agent_id, "connection closed", false).await;
                }
            }
            Command::ReleaseGpu { uuid, reply } => {
                let r = self.release_gpu(&uuid).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::Agents { reply } => {
                let _ = reply.send(Ok(self.agent_summaries()));
            }
            Command::FleetView { reply } => {
                let _ = reply.send(Ok(self.fleet_view()));
            }
            Command::Withdraw { agents, reason, reply } => {
                let mut gone = Vec::new();
                for id in agents {
                    let busy =
                        self.active.values().any(|j| j.agent_id.as_deref() == Some(&id) && j.state != JobState::Queued);
                    match self.agents.get_mut(&id) {
                        Some(_) if busy => {}
                        Some(a) => {
                            a.withdrawn = Some(reason.clone());
                            gone.push(id);
                        }
                        // Not known here (never connected, or forgotten): nothing can land on it.
                        None => gone.push(id),
                    }
                }
                let _ = reply.send(Ok(gone));
            }
            Command::Restore { agent } => {
                if let Some(a) = self.agents.get_mut(&agent) {
                    a.withdrawn = None;
                }
                self.schedule().await;
            }
            Command::MachineEnded { agent, reason } => {
                let holds = self.active.values().any(|j| {
                    j.agent_id.as_deref() == Some(agent.as_str())
                        && matches!(j.state, JobState::Assigned | JobState::Running)
                });
                if holds && self.agents.contains_key(&agent) {
                    self.agent_interrupted(&agent, reason).await;
                    self.schedule().await;
                }
            }
            Command::FleetNotes { notes, reached } => {
                let changed = notes != self.fleet_notes || reached != self.budgets_reached;
                self.fleet_notes = notes;
                if reached.is_empty() {
                    self.repository_of.clear();
                }
                self.budgets_reached = reached;
                if changed {
                    self.schedule().await;
                }
            }
            Command::AddSteps { job, file_name, source, reply } => {
                // Only while the job runs: its end (however it ends) ends its token.
                let r = match self.active.get(&job) {
                    Some(j)
                        if matches!(j.state, JobState::Assigned | JobState::Running)
                            && !self.cancelling.contains_key(&job) =>
                    {
                        let j = j.clone();
                        crate::dynamic_steps::add(self.store.as_ref(), &j, &file_name, &source).await
                    }
                    _ => Err(crate::dynamic_steps::AddError::NotRunning(job)),
                };
                if let Ok(jobs) = &r {
                    for j in jobs {
                        self.publish(j);
                    }
                    tracing::info!(job, added = jobs.len(), file = %file_name, "steps added by a running job");
                    self.schedule().await;
                }
                let _ = reply.send(r);
            }
            Command::Tick => {
                self.reap().await;
            }
        }
    }

    fn is_current(&self, agent_id: &str, conn: u64) -> bool {
        self.agents.get(agent_id).and_then(|a| a.conn.as_ref()).is_some_and(|(c, _)| *c == conn)
    }

    fn touch(&mut self, agent_id: &str) {
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.last_seen = Instant::now();
            a.last_seen_ms = now_ms();
        }
    }

    fn note_step(&mut self, j: &JobRecord) {
        let key = (j.pipeline_id, j.step.key.clone());
        match self.steps.get(&key) {
            Some((id, _, _)) if *id > j.id => {}
            _ => {
                let soft = gpuci_core::progress::is_soft_failure(&j.step.soft_fail, j.state, j.exit_code);
                self.steps.insert(key, (j.id, j.state, soft));
            }
        }
    }

    fn publish(&mut self, j: &JobRecord) {
        self.note_step(j);
        if j.state.is_terminal() {
            self.active.remove(&j.id);
        } else {
            self.active.insert(j.id, j.clone());
        }
        let agent_name = j.agent_id.as_ref().and_then(|id| self.agents.get(id)).map(|a| a.name.clone());
        self.hub.job_changed(crate::convert::job_summary(j, agent_name));
    }

    fn send(&self, agent_id: &str, msg: CoordinatorMessage) -> bool {
        match self.agents.get(agent_id).and_then(|a| a.conn.as_ref()) {
            Some((_, tx)) => tx.send(msg).is_ok(),
            None => false,
        }
    }

    async fn submit(&mut self, sub: Submission) -> Result<(PipelineRecord, Vec<JobRecord>), BrainError> {
        let Submission { file_name, source, pipeline, extra_env, workspace_upload, repository, origin, build } = sub;
        let now = now_ms();
        // Conditions are decided now, once: the facts are the submission's and do not change.
        let mut pipeline_env = extra_env.clone();
        pipeline_env.extend(pipeline.env.clone());
        let decisions = gpuci_core::condition::plan(&pipeline.steps, &build, &pipeline_env);
        let jobs = pipeline
            .steps
            .iter()
            .zip(decisions)
            .map(|(step, decision)| {
                let mut env = pipeline_env.clone();
                env.extend(step.env.clone());
                let mut step = step.clone();
                let (state, reason) = match decision {
                    Decision::Run { note: None } => (JobState::Queued, "queued".to_string()),
                    Decision::Run { note: Some(note) } => (JobState::Queued, format!("queued: {note}")),
                    Decision::Skip(why) => {
                        step.skipped_by_condition = true;
                        (JobState::Skipped, why)
                    }
                };
                NewJob { pipeline_id: 0, step, env, state, reason, attempt: 1, retry_of: None, created_at_ms: now }
            })
            .collect();
        let (p, jobs) = self
            .store
            .create_pipeline(
                NewPipeline { file_name, source, workspace_upload, repository, origin, created_at_ms: now },
                jobs,
            )
            .await?;
        self.group_scopes.insert(p.id, self.group_scope(p.repository.as_deref(), p.origin.as_deref()));
        // What the builds list shows (branch, commit, subject, author, trigger). Display
        // only: a pipeline whose facts cannot be stored runs all the same, listed without them.
        match serde_json::to_string(&gpuci_core::builds::for_list(&build)) {
            Ok(json) => {
                if let Err(e) = self.store.put_pipeline_build(p.id, &json).await {
                    tracing::warn!(pipeline = p.id, error = %e, "could not store the build facts for the builds list");
                }
            }
            Err(e) => tracing::warn!(pipeline = p.id, error = %e, "build facts not serializable"),
        }
        for j in &jobs {
            self.publish(j);
        }
        // A newer job of a concurrency group with cancel_in_progress cancels the older ones
        // of the same group: same name, repository and trust class, unless shared
        // (`gpuci_core::concurrency`).
        self.note_group_scopes().await;
        for j in &jobs {
            let Some(key) =
                self.group_of(j).filter(|_| j.step.concurrency.as_ref().is_some_and(|c| c.cancel_in_progress))
            else {
                continue;
            };
            let older: Vec<JobId> = self
                .active
                .values()
                .filter(|o| o.pipeline_id != p.id && self.group_of(o).as_ref() == Some(&key))
                .map(|o| o.id)
                .collect();
            for o in older {
                let why = format!("cancelled by job {} (pipeline {}) in concurrency group {key}", j.id, p.id);
                if let Err(e) = self.cancel(o, why).await {
                    tracing::warn!(job = o, error = %e, "could not cancel job of concurrency group");
                }
            }
        }
        tracing::info!(pipeline = p.id, jobs = jobs.len(), file = %p.file_name, "pipeline submitted");
        Ok((p, jobs))
    }

    async fn cancel(&mut self, id: JobId, reason: String) -> Result<JobRecord, BrainError> {
        let Some(job) = self.active.get(&id).cloned() else {
            return match self.store.get_job(id).await? {
                Some(j) => Err(BrainError::AlreadyFinished { job: id, state: j.state }),
                None => Err(BrainError::JobNotFound(id)),
            };
        };
        match job.state {
            JobState::Queued => {
                let j = self.finish(&job, JobState::Cancelled, reason, None, None, Vec::new()).await?;
                Ok(j)
            }
            _ if self.registering.remove(&id).is_some() => {
                // Never sent to the agent: nothing runs yet. The runner GitHub may have
                // registered meanwhile is removed by the GitHub integration when the job ends.
                let j = self.finish(&job, JobState::Cancelled, reason, None, None, Vec::new()).await?;
                Ok(j)
            }
            _ => {
                let agent = job.agent_id.clone().unwrap_or_default();
                let connected = self.agents.get(&agent).is_some_and(|a| a.conn.is_some());
                if connected {
                    // Stored first: a cancel the caller is told failed (503) is not sent.
                    self.store.set_reason(id, &format!("{CANCELLING}{reason}")).await?;
                }
                if connected && self.send(&agent, CoordinatorMessage::Cancel { job_id: id, reason: reason.clone() }) {
                    // The agent kills the process tree and reports; the job ends then.
                    self.cancelling.insert(id, reason.clone());
                    let mut j = job.clone();
                    j.reason = format!("{CANCELLING}{reason}");
                    self.publish(&j);
                    Ok(j)
                } else {
                    // The agent is away; it is told to kill the job when it returns.
                    let j = self.finish(&job, JobState::Cancelled, reason, None, None, Vec::new()).await?;
                    Ok(j)
                }
            }
        }
    }

    /// A new attempt of a finished job's step. Once per job (the newest attempt is the one to
    /// retry); not for Actions runner jobs, whose runner belongs to one GitHub job.
    async fn retry(&mut self, id: JobId, by: &str) -> Result<JobRecord, BrainError> {
        let job = self.store.get_job(id).await?.ok_or(BrainError::JobNotFound(id))?;
        if !job.state.is_terminal() {
            return Err(BrainError::Conflict(format!("job {id} is {}; only a finished job can be retried", job.state)));
        }
        if let Some(newer) =
            self.store.pipeline_jobs(job.pipeline_id).await?.iter().find(|j| j.step.key == job.step.key && j.id > id)
        {
            return Err(BrainError::Conflict(format!("job {id} was already retried as job {}", newer.id)));
        }
        let pipeline = self.store.get_pipeline(job.pipeline_id).await?;
        if matches!(Origin::parse(pipeline.as_ref().and_then(|p| p.origin.as_deref())), Some(Origin::ActionsRunner(_)))
        {
            return Err(BrainError::Conflict(format!(
                "job {id} ran a GitHub Actions runner; re-run the workflow job on GitHub instead"
            )));
        }
        let next = next_attempt(&job, format!("retry of job {id} ({}), asked by {by}", job.state), now_ms());
        let rec = self.store.insert_job(next).await?;
        tracing::info!(job = rec.id, retry_of = id, by, "job retried by hand");
        self.publish(&rec);
        Ok(rec)
    }

    /// A new attempt of each job of the pipeline that `gpuci_core::rerun::retry_failed`
    /// names. All are stored before the scheduler runs (one command), so no new dependent is
    /// gated on its dependency's old, failed attempt.
    async fn retry_failed(&mut self, pipeline: PipelineId, by: &str) -> Result<Vec<JobRecord>, BrainError> {
        let p = self.store.get_pipeline(pipeline).await?.ok_or(BrainError::PipelineNotFound(pipeline))?;
        if matches!(Origin::parse(p.origin.as_deref()), Some(Origin::ActionsRunner(_))) {
            return Err(BrainError::Conflict(format!(
                "pipeline {pipeline} ran a GitHub Actions runner; re-run the workflow on GitHub instead"
            )));
        }
        let jobs = self.store.pipeline_jobs(pipeline).await?;
        let plan = gpuci_core::rerun::retry_failed(jobs.iter().map(|j| gpuci_core::rerun::PipelineJob {
            job_id: j.id,
            step_key: &j.step.key,
            depends_on: &j.step.depends_on,
            state: j.state,
            soft_failed: gpuci_core::progress::is_soft_failure(&j.step.soft_fail, j.state, j.exit_code),
            skipped_by_condition: gpuci_core::progress::is_skipped_by_condition(&j.step, j.state),
        }));
        if plan.is_empty() {
            return Err(BrainError::Conflict(format!("pipeline {pipeline} has no failed job to retry")));
        }
        let now = now_ms();
        let mut out = Vec::new();
        for (id, why) in plan {
            let Some(job) = jobs.iter().find(|j| j.id == id) else { continue };
            let why = match why {
                gpuci_core::rerun::Why::Failed => format!("retry of job {id} ({})", job.state),
                gpuci_core::rerun::Why::DependsOn(dep) => format!("retry of job {id}: `{dep}` runs again"),
            };
            let rec = self.store.insert_job(next_attempt(job, format!("{why}, asked by {by}"), now)).await?;
            self.publish(&rec);
            out.push(rec);
        }
        tracing::info!(pipeline, jobs = out.len(), by, "failed jobs of the pipeline retried by hand");
        Ok(out)
    }

    async fn cancel_pipeline(&mut self, pipeline: PipelineId, reason: String) -> Result<Vec<JobRecord>, BrainError> {
        if self.store.get_pipeline(pipeline).await?.is_none() {
            return Err(BrainError::PipelineNotFound(pipeline));
        }
        let ids: Vec<JobId> =
            self.active.values().filter(|j| j.pipeline_id == pipeline).map(|j| j.id).collect::<Vec<_>>();
        let mut out = Vec::new();
        for id in ids {
            match self.cancel(id, reason.clone()).await {
                Ok(j) => out.push(j),
                // Ended meanwhile: nothing to cancel.
                Err(BrainError::AlreadyFinished { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// End a job, release its GPUs, quarantine failed ones, and queue a retry if the policy says so.
    async fn finish(
        &mut self,
        job: &JobRecord,
        state: JobState,
        reason: String,
        exit_code: Option<i32>,
        telemetry: Option<gpuci_protocol::agent::JobTelemetry>,
        quarantine: Vec<Quarantine>,
    ) -> Result<JobRecord, BrainError> {
        let now = now_ms();
        // A job that never left the queue (queue timeout) did not fail; retrying it would
        // only wait again.
        let retry = job.state != JobState::Queued && should_retry(&job.step, state, job.attempt);
        let reason = if retry {
            format!("{reason}; retrying (attempt {} of {})", job.attempt + 1, job.step.retry.count + 1)
        } else {
            reason
        };
        let expect = [JobState::Queued, JobState::Assigned, JobState::Running];
        let change = JobChange {
            state: Some(state),
            reason: Some(reason),
            finished_at_ms: Some(now),
            exit_code,
            telemetry,
            release_leases: true,
            quarantine: quarantine.clone(),
            ..Default::default()
        };
        // The end and its retry are one commit: were the retry a second write, a failure
        // between the two would leave a job ended without the retry its policy promised.
        // Nothing below (memory, watchers, the log) changes until it is stored.
        let (rec, next) = if retry {
            let next = next_attempt(job, format!("retry of job {} ({state})", job.id), now);
            let (rec, next) = self.store.update_job_and_insert(job.id, &expect, change, next).await?;
            (rec, Some(next))
        } else {
            (self.store.update_job(job.id, &expect, change).await?, None)
        };
        self.finished(&rec, next.as_ref(), quarantine);
        Ok(rec)
    }

    /// A job's end stored (with its retry, if any): memory, watchers and metrics follow.
    fn finished(&mut self, rec: &JobRecord, next: Option<&JobRecord>, quarantine: Vec<Quarantine>) {
        self.ready_since.remove(&rec.id);
        for q in quarantine {
            tracing::warn!(gpu = %q.gpu_uuid, agent = %q.agent_id, reason = %q.reason, "GPU quarantined");
            self.quarantine.insert(q.gpu_uuid.clone(), q);
        }
        self.cancelling.remove(&rec.id);
        self.metrics.job_finished(rec.state, &rec.reason);
        self.publish(rec);
        tracing::info!(job = rec.id, state = %rec.state, reason = %rec.reason, "job finished");
        if let Some(next) = next {
            self.publish(next);
        }
    }

    async fn agent_connected(
        &mut self,
        agent_id: &str,
        conn: u64,
        hello: Hello,
        tx: AgentTx,
    ) -> Result<(), BrainError> {
        if hello.protocol != gpuci_protocol::PROTOCOL_VERSION {
            let why = format!(
                "agent speaks protocol {}, coordinator speaks {}",
                hello.protocol,
                gpuci_protocol::PROTOCOL_VERSION
            );
            let _ = tx.send(CoordinatorMessage::Refused { reason: why.clone() });
            return Err(BrainError::AgentRefused(why));
        }
        let now = now_ms();
        let hello_json = serde_json::to_string(&hello).ok();
        let was_lost = self.agents.get(agent_id).is_some_and(|a| a.link == Link::Lost);
        let name = self.agents.get(agent_id).map_or_else(|| hello.name.clone(), |a| a.name.clone());
        // Stored first: an agent we could not record as connected is not taken as connected.
        self.store
            .update_agent(
                agent_id,
                AgentUpdate {
                    state: Some("connected".into()),
                    reason: Some(String::new()),
                    last_seen_ms: Some(now),
                    hello_json,
                },
            )
            .await?;
        let entry = AgentState {
            id: agent_id.to_string(),
            name,
            hostname: hello.hostname.clone(),
            tags: hello.tags.clone(),
            slots: hello.slots,
            gpus: hello.gpus.clone(),
            health: BTreeMap::new(),
            gpu_backend: hello.gpu_backend.clone(),
            isolation: hello.isolation.clone(),
            refuses: hello.refuses.clone(),
            container_runtime: hello.container_runtime.clone(),
            link: Link::Connected,
            conn: Some((conn, tx.clone())),
            last_seen: Instant::now(),
            last_seen_ms: now,
            reason: String::new(),
            paused: hello.paused.clone(),
            interrupted: None,
            withdrawn: None,
            first_job_at_ms: None,
            ends_at_ms: hello.ends_at_ms,
        };
        self.agents.insert(agent_id.to_string(), entry);

        // Settle what the agent holds against what we recorded (`reconcile`, pure). The
        // welcome, the first message on the connection, names what it holds that we ended.
        let ours: Vec<(JobId, JobState)> =
            self.active.values().filter(|j| j.agent_id.as_deref() == Some(agent_id)).map(|j| (j.id, j.state)).collect();
        let holds: Vec<JobId> = hello.running.clone();
        let plan = reconcile(&ours, &holds, hello.journal_incomplete.is_some());
        // Applied before the welcome: an agent that was welcomed after saying its journal was
        // incomplete forgets that it was, so what it changes must be committed by then.
        for id in plan.requeue {
            // Never received (the agent journals an assignment before starting it), so it never
            // ran: safe to hand out again.
            let rec = self
                .store
                .update_job(
                    id,
                    &[JobState::Assigned],
                    JobChange {
                        state: Some(JobState::Queued),
                        reason: Some(format!("requeued: agent {} reconnected without having received it", hello.name)),
                        clear_assignment: true,
                        ..Default::default()
                    },
                )
                .await?;
            self.publish(&rec);
        }
        for id in plan.lost {
            let Some(j) = self.active.get(&id).cloned() else { continue };
            let why = match &hello.journal_incomplete {
                Some(gap) => format!(
                    "agent {} came back saying {gap}; it may have received and started this job, so it is not \
                     handed out again as never received; the job's outcome and any output not yet received are unknown",
                    hello.name
                ),
                None => format!(
                    "agent {} came back without any record of this job (its data dir was lost or replaced); \
                     the job's outcome and any output not yet received are unknown",
                    hello.name
                ),
            };
            self.note_in_log(&j, format!("output may be missing from here on: {why}")).await;
            self.finish(&j, JobState::Lost, why, None, None, Vec::new()).await?;
        }
        let mut forget = Vec::new();
        for id in &plan.forget {
            let reason = self.ended_reason(*id, was_lost).await;
            tracing::info!(agent = agent_id, job = id, reason = %reason, "told agent what happened to its job");
            forget.push(Forgotten { job_id: *id, reason });
        }
        self.send(
            agent_id,
            CoordinatorMessage::Welcome {
                agent_id: agent_id.to_string(),
                heartbeat_interval_ms: self.timing.heartbeat_interval.as_millis() as u64,
                forget: forget.clone(),
            },
        );
        for f in forget {
            self.send(agent_id, CoordinatorMessage::Cancel { job_id: f.job_id, reason: f.reason });
        }
        for id in plan.keep {
            if let Some(reason) = self.cancelling.get(&id).cloned() {
                self.send(agent_id, CoordinatorMessage::Cancel { job_id: id, reason });
            }
        }
        tracing::info!(agent = agent_id, name = %hello.name, slots = hello.slots, gpus = hello.gpus.len(), "agent connected");
        if let Some(reason) = &hello.interrupted {
            self.agent_interrupted(agent_id, reason.clone()).await;
        }
        Ok(())
    }

    async fn ended_reason(&self, id: JobId, was_lost: bool) -> String {
        match self.store.get_job(id).await {
            Ok(Some(j)) => format!("job {id} already ended {}: {}", j.state, j.reason),
            _ if was_lost => format!("job {id} was declared lost while this agent was away"),
            _ => format!("job {id} is unknown to the coordinator"),
        }
    }

    /// Record a start, with what the agent did not enforce for the job (kept with the job for
    /// `gpuci jobs show`, the API and the job page). Idempotent: a start already recorded, or
    /// of a job that has ended or is not this agent's, changes nothing.
    /// The stored change a job's start makes, or `None` when it changes nothing (the job is
    /// not this agent's, or not waiting to start).
    fn start_change(
        &self,
        agent_id: &str,
        id: JobId,
        started_at_ms: i64,
        unenforced: Vec<gpuci_protocol::agent::Unenforced>,
    ) -> Option<JobChange> {
        let j = self.active.get(&id)?;
        if j.agent_id.as_deref() != Some(agent_id) || j.state != JobState::Assigned {
            return None;
        }
        let reason = match self.cancelling.get(&id) {
            // The stored record of an accepted cancel stays until the job ends.
            Some(r) => format!("{CANCELLING}{r}"),
            None => format!("running on {}", self.agents.get(agent_id).map_or(agent_id, |a| a.name.as_str())),
        };
        Some(JobChange {
            state: Some(JobState::Running),
            reason: Some(reason),
            started_at_ms: Some(started_at_ms),
            unenforced: Some(unenforced),
            ..Default::default()
        })
    }

    /// A start stored: counted and published.
    fn started(&mut self, rec: &JobRecord, started_at_ms: i64) {
        let queue = rec.step.agents.get("queue").map_or("default", String::as_str);
        let waited = (started_at_ms - rec.created_at_ms).max(0) as f64 / 1000.0;
        self.metrics.start_latency.with_label_values(&[queue]).observe(waited);
        self.publish(rec);
    }

    async fn job_started(
        &mut self,
        agent_id: &str,
        id: JobId,
        started_at_ms: i64,
        unenforced: Vec<gpuci_protocol::agent::Unenforced>,
    ) -> Result<(), String> {
        let Some(change) = self.start_change(agent_id, id, started_at_ms, unenforced) else { return Ok(()) };
        match self.store.update_job(id, &[JobState::Assigned], change).await {
            Ok(rec) => {
                self.started(&rec, started_at_ms);
                Ok(())
            }
            Err(e) if self.ended_in_store(id, &e).await => Ok(()),
            Err(e) => {
                tracing::error!(job = id, error = %e, "could not record job start; the agent will send it again");
                Err(format!("recording the start of job {id}: {e}"))
            }
        }
    }

    /// Adds a start to the batch ([`Brain::flush_events`]).
    fn batch_start(
        &mut self,
        agent_id: &str,
        job: JobId,
        started_at_ms: i64,
        unenforced: Vec<gpuci_protocol::agent::Unenforced>,
        reply: EventReply,
    ) {
        // A start sent again (a resend) while the job has an update in the batch answers as
        // that update does.
        let item = match self.events.index.get(&job) {
            Some(i) => Some(*i),
            None => self.start_change(agent_id, job, started_at_ms, unenforced).map(|change| {
                self.push_update(
                    JobUpdate { job, expect: vec![JobState::Assigned], change },
                    AfterCommit::Started { started_at_ms },
                )
            }),
        };
        self.events.answers.push((reply, item));
    }

    /// Adds a plain result (a running job of this agent's ends, no retry, nothing to note in
    /// its log) to the batch, or hands it back to be applied alone ([`Brain::job_finished`]).
    fn batch_finish(&mut self, agent_id: &str, f: JobFinished, reply: EventReply) -> Option<(JobFinished, EventReply)> {
        let Some(job) = self.active.get(&f.job_id) else {
            // Already ended (cancelled while the agent was away, or sent twice): nothing to store.
            self.events.answers.push((reply, None));
            return None;
        };
        let (state, reason) = f.outcome.verdict_after_cancel(self.cancelling.get(&f.job_id).map(String::as_str));
        let plain = job.agent_id.as_deref() == Some(agent_id)
            && job.state == JobState::Running
            && !self.events.index.contains_key(&f.job_id)
            && !matches!(f.outcome, Outcome::Lost { .. })
            && !should_retry(&job.step, state, job.attempt);
        if !plain {
            return Some((f, reply));
        }
        let now = now_ms();
        let quarantine: Vec<Quarantine> = f
            .gpu_health
            .iter()
            .filter_map(|(uuid, h)| match h {
                GpuHealth::Unhealthy { reason } => Some(Quarantine {
                    gpu_uuid: uuid.clone(),
                    agent_id: agent_id.to_string(),
                    reason: format!("job {}: {reason}", f.job_id),
                    since_ms: now,
                }),
                GpuHealth::Healthy => None,
            })
            .collect();
        let exit_code = match f.outcome {
            Outcome::Exited { code } => Some(code),
            _ => None,
        };
        // As `finish` stores it.
        let change = JobChange {
            state: Some(state),
            reason: Some(reason),
            finished_at_ms: Some(now),
            exit_code,
            telemetry: f.telemetry,
            release_leases: true,
            quarantine: quarantine.clone(),
            ..Default::default()
        };
        let expect = vec![JobState::Queued, JobState::Assigned, JobState::Running];
        let item = self.push_update(JobUpdate { job: f.job_id, expect, change }, AfterCommit::Finished { quarantine });
        self.events.answers.push((reply, Some(item)));
        None
    }

    fn push_update(&mut self, update: JobUpdate, after: AfterCommit) -> usize {
        let b = &mut self.events;
        b.index.insert(update.job, b.updates.len());
        b.updates.push(update);
        b.after.push(after);
        b.updates.len() - 1
    }

    /// Group commit of agents' events: every start and plain result handled since the last
    /// flush is stored in one transaction, and each is answered (so acknowledged to its
    /// agent) only after that commit. A failed commit answers each with the error: nothing is
    /// acknowledged, and the agents send their events again.
    async fn flush_events(&mut self) {
        if self.events.answers.is_empty() {
            return;
        }
        let EventBatch { updates, after, answers, .. } = std::mem::take(&mut self.events);
        let outcome: Vec<Result<(), String>> = if updates.is_empty() {
            Vec::new()
        } else {
            match self.store.update_jobs(&updates).await {
                Err(e) => {
                    tracing::error!(events = updates.len(), error = %e, "could not record agents' events; they will send them again");
                    updates.iter().map(|u| Err(format!("recording an event of job {}: {e}", u.job))).collect()
                }
                Ok(results) => {
                    let mut outcome = Vec::with_capacity(results.len());
                    for ((u, r), after) in updates.iter().zip(results).zip(after) {
                        outcome.push(match r {
                            Ok(rec) => {
                                match after {
                                    AfterCommit::Started { started_at_ms } => self.started(&rec, started_at_ms),
                                    AfterCommit::Finished { quarantine } => self.finished(&rec, None, quarantine),
                                }
                                Ok(())
                            }
                            Err(e) if self.ended_in_store(u.job, &e).await => Ok(()),
                            Err(e) => {
                                tracing::error!(job = u.job, error = %e, "could not record an agent's event; it will send it again");
                                Err(format!("recording an event of job {}: {e}", u.job))
                            }
                        });
                    }
                    outcome
                }
            }
        };
        for (reply, item) in answers {
            let _ = reply.send(item.map_or(Ok(()), |i| outcome[i].clone()));
        }
    }

    /// Record a result. Idempotent: a result for a job already ended (cancelled while the
    /// agent was away, or sent twice) or not this agent's changes nothing.
    async fn job_finished(&mut self, agent_id: &str, f: JobFinished) -> Result<(), String> {
        let id = f.job_id;
        let Some(mut job) = self.active.get(&id).cloned() else { return Ok(()) };
        if job.agent_id.as_deref() != Some(agent_id) {
            tracing::warn!(job = id, agent = agent_id, "result from an agent the job is not assigned to; ignored");
            return Ok(());
        }
        // Every job that ran has its start time, even when the start event went missing.
        if job.state == JobState::Assigned {
            if let Some(at) = f.started_at_us {
                // The start event (and with it what was not enforced) went missing: only an
                // agent that died while starting the job sends none.
                self.job_started(agent_id, id, at / 1000, Vec::new()).await?;
                job = self.active.get(&id).cloned().unwrap_or(job);
            }
        }
        let (state, reason) = f.outcome.verdict_after_cancel(self.cancelling.get(&id).map(String::as_str));
        let exit_code = match f.outcome {
            Outcome::Exited { code } => Some(code),
            _ => None,
        };
        let now = now_ms();
        let quarantine: Vec<Quarantine> = f
            .gpu_health
            .iter()
            .filter_map(|(uuid, h)| match h {
                GpuHealth::Unhealthy { reason } => Some(Quarantine {
                    gpu_uuid: uuid.clone(),
                    agent_id: agent_id.to_string(),
                    reason: format!("job {id}: {reason}"),
                    since_ms: now,
                }),
                GpuHealth::Healthy => None,
            })
            .collect();
        // The job never started because a leased GPU failed its pre-job check: that is the
        // GPU's fault, not the job's. Quarantine the GPU and put the job back in the queue.
        if job.state == JobState::Assigned && matches!(f.outcome, Outcome::StartFailed { .. }) && !quarantine.is_empty()
        {
            let gpus: Vec<String> = quarantine.iter().map(|q: &Quarantine| q.gpu_uuid.clone()).collect();
            let why = format!("requeued: GPU {} failed its health check and was quarantined", gpus.join(", "));
            let change = JobChange {
                state: Some(JobState::Queued),
                reason: Some(why),
                clear_assignment: true,
                quarantine: quarantine.clone(),
                ..Default::default()
            };
            return match self.store.update_job(id, &[JobState::Assigned], change).await {
                Ok(rec) => {
                    for q in quarantine {
                        tracing::warn!(gpu = %q.gpu_uuid, reason = %q.reason, "GPU quarantined");
                        self.quarantine.insert(q.gpu_uuid.clone(), q);
                    }
                    self.publish(&rec);
                    Ok(())
                }
                Err(e) => {
                    tracing::error!(job = id, error = %e, "could not requeue job; the agent will send its result again");
                    Err(format!("requeueing job {id}: {e}"))
                }
            };
        }
        if let Outcome::Lost { reason } = &f.outcome {
            // The log says where its output may stop short, not just the job's reason.
            self.note_in_log(&job, format!("output may be missing from here on: {reason}")).await;
        }
        match self.finish(&job, state, reason, exit_code, f.telemetry, quarantine).await {
            Ok(_) => Ok(()),
            Err(BrainError::Store(e)) if self.ended_in_store(id, &e).await => Ok(()),
            Err(e) => {
                tracing::error!(job = id, error = %e, "could not record job result; the agent will send it again");
                Err(format!("recording the result of job {id}: {e}"))
            }
        }
    }

    /// Whether `e` says the stored job has already ended (an operator's or another process's
    /// write this coordinator did not make): then the stored end stands, memory follows it,
    /// and the agent's event is acknowledged. Sending it again could never succeed: refusing
    /// it kept the agent reconnecting for ever, its later events stuck behind it (outsider
    /// attack).
    async fn ended_in_store(&mut self, id: JobId, e: &StoreError) -> bool {
        let StoreError::Conflict { found, .. } = e else { return false };
        if !found.is_terminal() {
            return false;
        }
        match self.store.get_job(id).await {
            Ok(Some(stored)) => {
                tracing::warn!(job = id, state = %stored.state, reason = %stored.reason, "the job had already ended in the store; its agent's event is not applied");
                self.publish(&stored);
                true
            }
            _ => false,
        }
    }

    /// Append a gpuci line to a job's log (after whatever is stored).
    async fn note_in_log(&self, job: &JobRecord, text: String) {
        let line = gpuci_protocol::agent::LogChunk {
            ts_us: now_ms() * 1000,
            stream: gpuci_protocol::agent::Stream::System,
            text,
        };
        match self.store.append_logs(job.id, None, &[line]).await {
            Ok(stored) => {
                for l in stored {
                    self.hub.log(job.id, job.pipeline_id, l);
                }
            }
            Err(e) => tracing::warn!(job = job.id, error = %e, "could not add a line to the job's log"),
        }
    }

    async fn apply_gpus(
        &mut self,
        agent_id: &str,
        gpus: Vec<gpuci_core::gpu::GpuInfo>,
        health: BTreeMap<String, GpuHealth>,
    ) {
        let now = now_ms();
        for (uuid, h) in &health {
            if let GpuHealth::Unhealthy { reason } = h {
                if !self.quarantine.contains_key(uuid) {
                    let q = Quarantine {
                        gpu_uuid: uuid.clone(),
                        agent_id: agent_id.to_string(),
                        reason: reason.clone(),
                        since_ms: now,
                    };
                    match self.store.quarantine_gpu(&q).await {
                        Ok(()) => {
                            tracing::warn!(gpu = %uuid, reason = %reason, "GPU quarantined by its agent's health check");
                            self.quarantine.insert(uuid.clone(), q);
                        }
                        Err(e) => tracing::error!(gpu = %uuid, error = %e, "could not quarantine GPU"),
                    }
                }
            }
        }
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.gpus = gpus;
            a.health = health;
        }
    }

    async fn release_gpu(&mut self, uuid: &str) -> Result<(), BrainError> {
        if !self.store.release_quarantine(uuid).await? {
            return Err(BrainError::NotQuarantined(uuid.to_string()));
        }
        self.quarantine.remove(uuid);
        tracing::info!(gpu = uuid, "GPU released from quarantine by hand");
        // Its agent takes the GPU's current error counters as the new baseline; otherwise the
        // error that quarantined it would quarantine it again at the next check.
        let owner = self.agents.values().find(|a| a.gpus.iter().any(|g| g.uuid == uuid)).map(|a| a.id.clone());
        if let Some(owner) = owner {
            if let Some(a) = self.agents.get_mut(&owner) {
                a.health.remove(uuid);
            }
            self.send(&owner, CoordinatorMessage::GpuReleased { uuid: uuid.to_string() });
        }
        Ok(())
    }

    /// The agent's connection is gone (`silent`: we dropped it for missed heartbeats, so we
    /// last heard from it at `last_seen`, not now). `lost_after` counts from the last time
    /// we heard from it.
    async fn agent_disconnected(&mut self, agent_id: &str, why: &str, silent: bool) {
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.conn = None;
            a.link = Link::Disconnected;
            if !silent {
                a.last_seen = Instant::now();
            }
            a.reason = format!("disconnected: {why}");
        }
        tracing::info!(agent = agent_id, why, "agent disconnected");
        let update =
            AgentUpdate { state: Some("disconnected".into()), reason: Some(why.to_string()), ..Default::default() };
        self.record_link(agent_id, update).await;
    }

    /// Store an agent's new link; if the store cannot take it now, keep it for the next reap
    /// (a newer link replaces an older one; a reconnect, stored first, clears it).
    async fn record_link(&mut self, agent_id: &str, update: AgentUpdate) {
        if let Err(e) = self.store.update_agent(agent_id, update.clone()).await {
            tracing::error!(agent = agent_id, error = %e, state = ?update.state, "could not record the agent's state; trying again");
            self.unsaved_links.insert(agent_id.to_string(), update);
        } else {
            self.unsaved_links.remove(agent_id);
        }
    }

    /// Whether the store takes writes again after it did not ([`Brain::store_deaf`]): one
    /// small write, an agent's reason as it is. When it does, every agent gets `lost_after`
    /// from now to be heard, as after a restart: while the store took no writes, no agent
    /// could be (outsider attack: a database down or a disk full for longer than `lost_after`
    /// ended healthy agents' finished jobs `lost` the moment it came back, and retried them).
    async fn store_hears_again(&mut self) -> bool {
        let probe = self.agents.values().find(|a| a.link != Link::Connected).map(|a| (a.id.clone(), a.reason.clone()));
        if let Some((id, reason)) = probe {
            let update = AgentUpdate { reason: Some(reason), ..Default::default() };
            if self.store.update_agent(&id, update).await.is_err() {
                return false;
            }
        }
        self.store_deaf = false;
        let now = Instant::now();
        for a in self.agents.values_mut() {
            a.last_seen = a.last_seen.max(now);
        }
        tracing::info!("the store takes writes again; every agent has lost_after from now to be heard");
        true
    }

    /// Timer work: queue timeouts, silent agents, lost agents.
    async fn reap(&mut self) {
        let now = Instant::now();
        let now_wall = now_ms();
        if let Some(previous) = self.last_tick.replace(now) {
            if stalled(previous, now, self.timing.tick) {
                let stall = now.saturating_duration_since(previous);
                tracing::warn!(
                    stalled_for = ?stall,
                    "the coordinator did not run for a while (stopped, paused or blocked); that time does not count against its agents' lost_after"
                );
                for a in self.agents.values_mut() {
                    a.last_seen = heard_after_stall(a.last_seen, stall, self.timing.tick, now);
                }
            }
        }
        for (id, update) in std::mem::take(&mut self.unsaved_links) {
            // Only what is still true: a reconnect meanwhile stored its own state.
            if self.agents.get(&id).is_some_and(|a| a.link != Link::Connected) {
                self.record_link(&id, update).await;
            }
        }
        if self.store_deaf && !self.store_hears_again().await {
            // Still no writes: nobody's silence counts (queue timeouts wait too: they are writes).
            return;
        }
        // Silent but connected → drop the connection; away too long → lost.
        let ids: Vec<String> = self.agents.keys().cloned().collect();
        let mut lost_any = false;
        for id in ids {
            let (link, age) = {
                let a = &self.agents[&id];
                (a.link, now.saturating_duration_since(a.last_seen))
            };
            if link == Link::Connected && age > self.timing.lost_after {
                // Silent for `lost_after`: that is lost, now, not after another `lost_after`.
                self.agent_disconnected(&id, "missed heartbeats", true).await;
            }
            let a = &self.agents[&id];
            if a.link == Link::Disconnected && now.saturating_duration_since(a.last_seen) > self.timing.lost_after {
                self.agent_lost(&id).await;
                lost_any = true;
            } else if a.link == Link::Lost && self.active.values().any(|j| j.agent_id.as_deref() == Some(id.as_str())) {
                let (name, secs) = (a.name.clone(), (now_wall - a.last_seen_ms).max(0) / 1000);
                self.end_jobs_of_lost(&id, &name, secs).await;
                lost_any = true;
            }
        }
        // Queue timeouts.
        let expired: Vec<JobRecord> = self
            .active
            .values()
            .filter(|j| j.state == JobState::Queued)
            .filter(|j| {
                self.ready_since
                    .get(&j.id)
                    .is_some_and(|t| now_wall - t > j.step.effective_queue_timeout().as_millis() as i64)
            })
            .cloned()
            .collect();
        for j in &expired {
            let why = format!("still queued after queue_timeout {}: {}", j.step.effective_queue_timeout(), j.reason);
            if let Err(e) = self.finish(j, JobState::TimedOut, why, None, None, Vec::new()).await {
                tracing::error!(job = j.id, error = %e, "could not time out job");
            }
        }
        if lost_any || !expired.is_empty() {
            self.schedule().await;
        }
    }

    async fn agent_lost(&mut self, agent_id: &str) {
        let (name, secs) = {
            let a = &self.agents[agent_id];
            (a.name.clone(), (now_ms() - a.last_seen_ms).max(0) / 1000)
        };
        let update = AgentUpdate {
            state: Some("lost".into()),
            reason: Some(format!("no heartbeat for {secs}s")),
            ..Default::default()
        };
        if let Err(e) = self.store.update_agent(agent_id, update).await {
            // The store takes no writes, so the coordinator cannot hear its agents either:
            // their events cannot be stored and their connections are closed to have them sent
            // again. Their silence is not theirs (see `store_deaf`).
            if !self.store_deaf {
                tracing::warn!(error = %e, "the store takes no writes: no agent is declared lost until it does, and then each gets lost_after to be heard");
            }
            self.store_deaf = true;
            return;
        }
        self.unsaved_links.remove(agent_id);
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.link = Link::Lost;
            a.reason = format!("lost: no heartbeat for {secs}s");
        }
        tracing::warn!(agent = agent_id, name = %name, "agent lost");
        self.end_jobs_of_lost(agent_id, &name, secs).await;
    }

    /// End the jobs of a lost agent. Called when it is declared lost and, for any it still
    /// has (the store could not take the end then: a full disk, the database away), again on
    /// every reap until they are ended: a job of a dead agent never stays `running`
    /// (outsider attack: one failed write left it so until the coordinator restarted).
    async fn end_jobs_of_lost(&mut self, agent_id: &str, name: &str, secs: i64) {
        let jobs: Vec<JobRecord> =
            self.active.values().filter(|j| j.agent_id.as_deref() == Some(agent_id)).cloned().collect();
        for j in jobs {
            let why = match self.cancelling.get(&j.id) {
                Some(r) => r.clone(),
                None => format!(
                    "agent {name} stopped sending heartbeats (last seen {secs}s ago); the job's outcome is unknown"
                ),
            };
            let state = if self.cancelling.contains_key(&j.id) { JobState::Cancelled } else { JobState::Lost };
            if state == JobState::Lost && self.noted_lost.insert(j.id) {
                self.note_in_log(&j, format!("output may be missing from here on: {why}")).await;
            }
            match self.finish(&j, state, why, None, None, Vec::new()).await {
                Ok(_) => {
                    self.noted_lost.remove(&j.id);
                }
                Err(BrainError::Store(e)) if self.ended_in_store(j.id, &e).await => {
                    self.noted_lost.remove(&j.id);
                }
                Err(e) => tracing::error!(job = j.id, error = %e, "could not end a job of a lost agent; trying again"),
            }
        }
    }

    /// Host views of connected agents, with GPU lease and quarantine state.
    fn hosts(&self) -> (Vec<HostView>, Vec<String>) {
        let leased: HashMap<&str, JobId> =
            self.active.values().flat_map(|j| j.gpus.iter().map(move |g| (g.as_str(), j.id))).collect();
        let mut ids = Vec::new();
        let mut hosts = Vec::new();
        for a in self.agents.values().filter(|a| a.link == Link::Connected) {
            let busy = self
                .active
                .values()
                .filter(|j| j.agent_id.as_deref() == Some(&a.id) && j.state != JobState::Queued)
                .count() as u32;
            let gpus = a
                .gpus
                .iter()
                .map(|g| {
                    let state = if let Some(q) = self.quarantine.get(&g.uuid) {
                        GpuSlotState::Quarantined { reason: q.reason.clone() }
                    } else if let Some(GpuHealth::Unhealthy { reason }) = a.health.get(&g.uuid) {
                        GpuSlotState::Quarantined { reason: reason.clone() }
                    } else if let Some(j) = leased.get(g.uuid.as_str()) {
                        GpuSlotState::Leased { job_id: j.to_string() }
                    } else {
                        GpuSlotState::Free
                    };
                    GpuSlot { info: g.clone(), state }
                })
                .collect();
            let mut tags = a.tags.clone();
            // Agents no fleet made, so that a job held off fleet machines can ask for one.
            tags.entry(gpuci_providers::TAG_FLEET.to_string()).or_insert_with(|| NOT_A_FLEET_MACHINE.to_string());
            hosts.push(HostView {
                agent_id: a.id.clone(),
                name: a.name.clone(),
                tags,
                free_slots: if a.paused.is_some() || a.interrupted.is_some() || a.withdrawn.is_some() {
                    0
                } else {
                    a.slots.saturating_sub(busy)
                },
                total_slots: a.slots,
                container_runtime: a.container_runtime.is_some(),
                gpus,
                ends_at_ms: a.ends_at_ms,
                // No slot at all is never "busy": placement names the agent and why. An agent
                // older than the `refuses` field is described by its isolation line.
                refuses: (a.slots == 0)
                    .then(|| a.refuses.clone().unwrap_or_else(|| format!("it offers no job slots ({})", a.isolation))),
            });
            ids.push(a.id.clone());
        }
        (hosts, ids)
    }

    /// Why a queued job cannot start yet, if something other than capacity holds it back:
    /// `Ok` while it waits, `Err` when it can never run.
    fn blocked(&self, j: &JobRecord) -> Option<Result<String, String>> {
        use gpuci_core::progress::{gate, Attempt, Gate};
        let latest = |dep: &str| {
            self.steps.get(&(j.pipeline_id, dep.to_string())).map(|(id, state, soft)| Attempt {
                step_key: "",
                job_id: *id,
                state: *state,
                soft_failed: *soft,
                // The gate skips after any skipped dependency; only the pipeline's state tells.
                skipped_by_condition: false,
            })
        };
        match gate(&j.step, latest) {
            Gate::Ready => {}
            Gate::Wait(why) => return Some(Ok(why)),
            Gate::Skip(why) => return Some(Err(why)),
        }
        if let Some(key) = self.group_of(j) {
            if let Some(other) = self
                .active
                .values()
                .find(|o| o.id != j.id && o.state != JobState::Queued && self.group_of(o).as_ref() == Some(&key))
            {
                return Some(Ok(format!("waiting for job {} in concurrency group {key}", other.id)));
            }
            if let Some(other) = self
                .active
                .values()
                .find(|o| o.id < j.id && o.state == JobState::Queued && self.group_of(o).as_ref() == Some(&key))
            {
                return Some(Ok(format!("waiting behind job {} in concurrency group {key}", other.id)));
            }
        }
        None
    }

    /// The concurrency group `j` is in, scoped (`gpuci_core::concurrency::group_key`). A
    /// pipeline whose scope could not be read counts as untrusted and of no repository: it
    /// never joins or cancels a trusted group.
    fn group_of(&self, j: &JobRecord) -> Option<gpuci_core::concurrency::GroupKey> {
        use gpuci_core::concurrency::{group_key, TrustClass};
        let c = j.step.concurrency.as_ref()?;
        let (repo, trust) = match self.group_scopes.get(&j.pipeline_id) {
            Some((r, t)) => (r.as_ref(), *t),
            None => (None, TrustClass::Untrusted),
        };
        Some(group_key(&c.group, repo, trust, &self.shared_groups))
    }

    fn group_scope(
        &self,
        repository: Option<&str>,
        origin: Option<&str>,
    ) -> (Option<gpuci_core::repo::RepoId>, gpuci_core::concurrency::TrustClass) {
        (
            crate::repos::of_pipeline(repository, origin, &self.github_host),
            gpuci_core::concurrency::TrustClass::of(Origin::cache_origin(origin).as_ref()),
        )
    }

    /// Reads the scope of every pipeline with unfinished jobs that has none yet (after a
    /// restart), and forgets those of pipelines that have finished.
    async fn note_group_scopes(&mut self) {
        let live: BTreeSet<PipelineId> = self.active.values().map(|j| j.pipeline_id).collect();
        self.group_scopes.retain(|p, _| live.contains(p));
        for p in live {
            if self.group_scopes.contains_key(&p) {
                continue;
            }
            match self.store.get_pipeline(p).await {
                Ok(Some(rec)) => {
                    let scope = self.group_scope(rec.repository.as_deref(), rec.origin.as_deref());
                    self.group_scopes.insert(p, scope);
                }
                Ok(None) => {}
                Err(e) => tracing::error!(pipeline = p, error = %e, "could not read the pipeline's repository"),
            }
        }
    }

    /// One scheduling pass: skip what can never run, place what fits, explain the rest.
    /// Asks for a placement pass: it runs once the commands already waiting are handled.
    async fn schedule(&mut self) {
        self.schedule_due = true;
    }

    /// A placement pass: every queued job placed where it fits, or told why it waits.
    async fn place_now(&mut self) {
        self.note_group_scopes().await;
        // Skips cascade through depends_on; repeat until nothing changes.
        loop {
            let skips: Vec<(JobRecord, String)> = self
                .active
                .values()
                .filter(|j| j.state == JobState::Queued)
                .filter_map(|j| match self.blocked(j) {
                    Some(Err(why)) => Some((j.clone(), why)),
                    _ => None,
                })
                .collect();
            if skips.is_empty() {
                break;
            }
            for (j, why) in skips {
                if let Err(e) = self.finish(&j, JobState::Skipped, why, None, None, Vec::new()).await {
                    tracing::error!(job = j.id, error = %e, "could not skip job");
                }
            }
        }
        let (hosts, ids) = self.hosts();
        // The indexed cluster answers each job without scanning every host; it is rebuilt per
        // pass from live state, so it can never drift from it.
        let mut cluster = placement::Cluster::new(hosts);
        let queued: Vec<JobRecord> = self.active.values().filter(|j| j.state == JobState::Queued).cloned().collect();
        let mut placed_groups: BTreeSet<gpuci_core::concurrency::GroupKey> = BTreeSet::new();
        let mut unplaceable = BTreeSet::new();
        // Why each job waits, written in one transaction at the end of the pass.
        let mut reasons: Vec<(JobRecord, String)> = Vec::new();
        // This pass's assignments, stored in one transaction before any is sent.
        let mut placed: Vec<Placed> = Vec::new();
        // The job tokens of this pass (`crate::dynamic_steps`), stored together.
        let mut job_tokens: Vec<(JobId, String)> = Vec::new();
        // Pipelines read this pass (a pipeline's steps are placed one after another).
        let mut pipelines: HashMap<PipelineId, PipelineRecord> = HashMap::new();
        for j in queued {
            let why = match self.blocked(&j) {
                Some(Ok(why)) | Some(Err(why)) => Some(why),
                None => None,
            };
            let why = match (why, self.group_of(&j)) {
                (None, Some(key)) if placed_groups.contains(&key) => {
                    Some(format!("waiting for another job in concurrency group {key}"))
                }
                (w, _) => w,
            };
            if let Some(why) = why {
                self.ready_since.remove(&j.id);
                note_reason(&mut reasons, &j, why);
                continue;
            }
            self.ready_since.entry(j.id).or_insert_with(now_ms);
            // Each secret the step names must exist in a scope that covers the job (the
            // narrowest wins: `core::secret_scope`); otherwise the job could only fail later,
            // on a GPU, after waiting its turn. Refusals end the job with the reason.
            let (secrets, given) = if j.step.secrets.is_empty() && j.step.encrypted_secrets.is_empty() {
                (BTreeMap::new(), Vec::new())
            } else {
                let pipeline = match self.store.get_pipeline(j.pipeline_id).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::error!(job = j.id, error = %e, "could not read the job's pipeline");
                        continue;
                    }
                };
                let stored = match self.store.secret_names().await {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::error!(job = j.id, error = %e, "could not read secrets");
                        continue;
                    }
                };
                let mut source = secret_source(pipeline.as_ref(), &self.github_host);
                source.environment = j.step.environment.clone();
                let mut given: Vec<(String, SecretScope)> = Vec::new();
                let mut refused: Option<String> = None;
                // Values encrypted in the pipeline file open here, where the key lives, and
                // only for the repository, ref and name they were encrypted for.
                let mut from_file: BTreeMap<String, String> = BTreeMap::new();
                for (name, text) in &j.step.encrypted_secrets {
                    let opened = match &self.repo_keys {
                        None => Err("this coordinator keeps no key for encrypted secrets".to_string()),
                        Some(ring) => {
                            let ring = ring.read().unwrap_or_else(|e| e.into_inner());
                            ring.decrypt(text).map_err(|e| e.to_string())
                        }
                    };
                    let checked = opened
                        .map_err(|why| format!("encrypted secret `{name}`: {why}"))
                        .and_then(|sealed| Ok((sealed.scope(), sealed.check(name, &source)?.to_string())));
                    match checked {
                        Ok((scope, value)) => {
                            from_file.insert(name.clone(), value);
                            given.push((name.clone(), scope));
                        }
                        Err(why) => {
                            refused = Some(why);
                            break;
                        }
                    }
                }
                for name in &j.step.secrets {
                    let scopes: Vec<SecretScope> = stored
                        .iter()
                        .filter_map(|(row, _)| SecretScope::parse_storage_name(row))
                        .filter(|(n, _)| n == name)
                        .map(|(_, scope)| scope)
                        .collect();
                    if refused.is_some() {
                        break;
                    }
                    match gpuci_core::secret_scope::choose(name, &scopes, &source) {
                        Ok(scope) => given.push((name.clone(), scope.clone())),
                        Err(r) => {
                            refused = Some(r.to_string());
                            break;
                        }
                    }
                }
                if let Some(why) = refused {
                    if let Err(e) = self.finish(&j, JobState::Failed, why, None, None, Vec::new()).await {
                        tracing::error!(job = j.id, error = %e, "could not fail job");
                    }
                    continue;
                }
                let stored_given: Vec<(String, SecretScope)> =
                    given.iter().filter(|(n, _)| !from_file.contains_key(n)).cloned().collect();
                let rows: Vec<String> = stored_given.iter().map(|(n, scope)| scope.storage_name(n)).collect();
                let sealed = match self.store.secret_values(&rows).await {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::error!(job = j.id, error = %e, "could not read secrets");
                        continue;
                    }
                };
                let mut opened = Ok(from_file);
                let mut unopenable: Option<String> = None;
                for ((name, scope), row) in stored_given.iter().zip(&rows) {
                    // Deleted since the names were read: the next pass decides again.
                    let Some(text) = sealed.get(row) else {
                        opened = Err(format!("waiting: secret `{name}` changed while the job was placed"));
                        break;
                    };
                    match self.secrets_key.open(row, text) {
                        Ok(v) => {
                            if let Ok(m) = &mut opened {
                                m.insert(name.clone(), v);
                            }
                        }
                        // Start-up checked every row's key; a row written since by a
                        // coordinator with another key, or altered, lands here. Waiting
                        // mends nothing (issue 27: the job sat until its queue timeout):
                        // the job fails now, naming the secret (never its value) and the fix.
                        Err(e) => {
                            unopenable = Some(format!(
                                "secret `{name}` (scope: {scope}) does not open with this coordinator's secrets key: {e}; \
                                 set it again (`gpuci secret set {name}` in that scope) or start the coordinator \
                                 with the key file it was sealed with (--secrets-key-file)"
                            ));
                            break;
                        }
                    }
                }
                if let Some(why) = unopenable {
                    tracing::warn!(job = j.id, reason = %why, "job failed: a secret does not open");
                    if let Err(e) = self.finish(&j, JobState::Failed, why, None, None, Vec::new()).await {
                        tracing::error!(job = j.id, error = %e, "could not fail job");
                    }
                    continue;
                }
                match opened {
                    Ok(v) => (v, given),
                    Err(why) => {
                        note_reason(&mut reasons, &j, why);
                        continue;
                    }
                }
            };
            // `sandbox: none` runs only where the agent allows it.
            let unsandboxed = j.step.sandbox == gpuci_core::pipeline::SandboxMode::None;
            // Limits a step asks for run only where they hold, or where the operator allowed
            // them unenforced (the job's log then says so): never silently without them.
            let r = &j.step.resources;
            let limited = r.memory.is_some() || r.cpu_millis.is_some() || r.pids.is_some();
            let held = self.budget_held(&j).await;
            let tags = if unsandboxed || held || limited {
                let mut t = j.step.agents.clone();
                if unsandboxed {
                    t.insert(UNSANDBOXED_TAG.to_string(), "allowed".to_string());
                }
                if limited {
                    t.insert(RESOURCES_TAG.to_string(), "taken".to_string());
                }
                if held {
                    t.insert(gpuci_providers::TAG_FLEET.to_string(), NOT_A_FLEET_MACHINE.to_string());
                }
                std::borrow::Cow::Owned(t)
            } else {
                std::borrow::Cow::Borrowed(&j.step.agents)
            };
            let needs = Needs {
                tags: &tags,
                gpu: &j.step.gpu,
                container: j.step.image.is_some(),
                deadline: job_deadline(j.step.timeout, now_ms()),
            };
            // Applied to this pass's view at once; if the commit below fails the GPUs only
            // look taken until the next pass.
            match cluster.place_and_apply(&j.id.to_string(), &needs) {
                Ok(p) => {
                    let agent_id = ids[p.host].clone();
                    tracing::debug!(job = j.id, agent = %agent_id, free_slots = cluster.hosts()[p.host].free_slots, "placed");
                    let pipeline = match pipelines.get(&j.pipeline_id) {
                        Some(p) => Ok(Some(p.clone())),
                        None => self.store.get_pipeline(j.pipeline_id).await.inspect(|p| {
                            if let Some(p) = p {
                                pipelines.insert(p.id, p.clone());
                            }
                        }),
                    };
                    let (workspace_upload, cache, origin, trusted, repository) = match pipeline {
                        Ok(Some(p)) => {
                            let origin = Origin::parse(p.origin.as_deref());
                            // Caches by repository and trust class: what may be restored and
                            // where the job saves is the core's rule (`cache::scope`).
                            // Keyed by the repository's identity with its host: two spellings
                            // of one remote share a cache, two hosts never do, and a remote
                            // that names no repository unambiguously gets none.
                            let repository = crate::repos::name_of_pipeline(
                                p.repository.as_deref(),
                                p.origin.as_deref(),
                                &self.github_host,
                            );
                            let cache = match (&repository, Origin::cache_origin(p.origin.as_deref())) {
                                (Some(repository), Some(o)) if !j.step.cache.is_empty() => {
                                    gpuci_core::cache::scope(repository, &o)
                                }
                                _ => gpuci_core::cache::CacheScope::none(),
                            };
                            let trusted = gpuci_core::trust::may_run_unsandboxed(
                                Origin::cache_origin(p.origin.as_deref()).as_ref(),
                            );
                            // The agent's tenant (who may share a host with a job outside the
                            // sandbox): the identity, else the remote as given, never merged
                            // with pipelines that name no repository.
                            let tenant = repository.or(p.repository);
                            (p.workspace_upload, cache, origin, trusted, tenant)
                        }
                        Ok(None) => (None, gpuci_core::cache::CacheScope::none(), None, false, None),
                        Err(e) => {
                            tracing::error!(job = j.id, error = %e, "could not read the job's pipeline");
                            continue;
                        }
                    };

                    // The audit record of which secrets (names and scopes, never values) this
                    // run is given, in the job's log, before the agent's lines.
                    if !given.is_empty() {
                        let list: Vec<String> = given
                            .iter()
                            .map(|(n, scope)| match j.step.encrypted_secrets.contains_key(n) {
                                true => format!("{n} (encrypted in the pipeline for {scope})"),
                                false => format!("{n} (scope: {scope})"),
                            })
                            .collect();
                        self.note_in_log(&j, format!("secrets given to this run: {}", list.join(", "))).await;
                    }
                    // A requeued job keeps its log; this run's lines are numbered after it.
                    let log_from = match self.store.log_extent(j.id).await {
                        Ok((_, last)) => last as u64 + 1,
                        Err(e) => {
                            tracing::error!(job = j.id, error = %e, "could not read the job's log");
                            continue;
                        }
                    };
                    // Its job token (`crate::dynamic_steps`), stored as a hash before the
                    // assignments are, and given as a secret: the job's log masks it.
                    let mut secrets = secrets;
                    if !matches!(origin, Some(Origin::ActionsRunner(_))) {
                        let (token, row) = crate::dynamic_steps::new_token(j.id);
                        secrets.insert(crate::dynamic_steps::JOB_TOKEN_ENV.to_string(), token);
                        job_tokens.push(row);
                    }
                    if let Some(key) = self.group_of(&j) {
                        placed_groups.insert(key);
                    }
                    placed.push(Placed {
                        agent_id,
                        gpus: p.gpus,
                        job: j,
                        secrets,
                        workspace_upload,
                        cache,
                        origin,
                        trusted,
                        repository,
                        log_from,
                    });
                }
                Err(u) => {
                    let mut reason = if unsandboxed && u.reason.contains(UNSANDBOXED_TAG) {
                        "needs an agent that allows `sandbox: none`; every matching agent refuses it (start one with --allow-unsandboxed)"
                            .to_string()
                    } else if limited && u.reason.contains(RESOURCES_TAG) {
                        "sets resources: (memory, cpus or pids), and no matching agent can enforce them (an agent needs \
                         job cgroups of its own: a systemd unit with Delegate=yes for one that is not root, a delegated \
                         cgroup in a container, where only the container's own limits apply otherwise; or start it with \
                         --allow-unenforced-limits to run such steps with their limits unenforced, said in their logs)"
                            .to_string()
                    } else {
                        u.reason
                    };
                    // An agent that takes no jobs (no working sandbox, no disk quota) is named
                    // with its reason by placement itself (`HostView::refuses`), never "busy".
                    if let Some(note) = self.fleet_notes.get(&j.id).cloned() {
                        // A held job's placement reason names the stand-in tag; the budget is
                        // the reason.
                        reason = if self.budget_held(&j).await { note } else { format!("{reason}; {note}") };
                    }
                    unplaceable.insert(j.id);
                    note_reason(&mut reasons, &j, reason);
                }
            }
        }
        if let Err(e) = crate::dynamic_steps::store_tokens(self.store.as_ref(), &job_tokens).await {
            // They run without `gpuci pipeline upload` rather than with a token that opens nothing.
            tracing::error!(jobs = job_tokens.len(), error = %e, "could not store the job tokens of a placement pass");
            for p in &mut placed {
                p.secrets.remove(crate::dynamic_steps::JOB_TOKEN_ENV);
            }
        }
        self.commit_placements(placed, &mut reasons).await;
        if !reasons.is_empty() {
            let rows: Vec<(JobId, String)> = reasons.iter().map(|(j, why)| (j.id, why.clone())).collect();
            match self.store.set_reasons(&rows).await {
                Ok(()) => {
                    for (mut rec, why) in reasons {
                        rec.reason = why;
                        self.publish(&rec);
                    }
                }
                Err(e) => tracing::error!(jobs = rows.len(), error = %e, "could not record why jobs wait"),
            }
        }
        if let Some(wake) = &self.fleet_wake {
            if unplaceable.iter().any(|j| !self.unplaceable.contains(j)) {
                wake.notify_one();
            }
        }
        self.unplaceable = unplaceable;
    }

    /// Group commit of a placement pass: every assignment is stored in one transaction, and
    /// only after it commits is any sent (an assignment is never sent before it is durable).
    /// If the commit fails, nothing is sent, the jobs stay queued (saying why) and the next
    /// pass places them again.
    async fn commit_placements(&mut self, placed: Vec<Placed>, reasons: &mut Vec<(JobRecord, String)>) {
        if placed.is_empty() {
            return;
        }
        let batch: Vec<NewAssignment> = placed
            .iter()
            .map(|p| NewAssignment { job: p.job.id, agent_id: p.agent_id.clone(), gpus: p.gpus.clone() })
            .collect();
        let results = match self.store.assign_jobs(&batch, now_ms()).await {
            Ok(results) => results,
            Err(e) => {
                tracing::error!(jobs = batch.len(), error = %e, "could not store a placement pass's assignments; none sent");
                for p in placed {
                    let name = self.agents.get(&p.agent_id).map_or(p.agent_id.as_str(), |a| a.name.as_str());
                    let why = format!(
                        "waiting: placed on {name}, but the assignment could not be stored ({}); placing again",
                        e.reason()
                    );
                    note_reason(reasons, &p.job, why);
                }
                // Not before the next command or tick: a store that stays down is not hammered.
                self.schedule_due = true;
                return;
            }
        };
        for (placed, result) in placed.into_iter().zip(results) {
            let Placed {
                agent_id, secrets, workspace_upload, cache, origin, trusted, repository, log_from, job, ..
            } = placed;
            let rec = match result {
                Ok(rec) => rec,
                Err(e) => {
                    tracing::error!(job = job.id, error = %e, "could not assign job");
                    continue;
                }
            };
            self.publish(&rec);
            let mut env = rec.env.clone();
            env.insert("GPUCI".into(), "true".into());
            env.insert("GPUCI_JOB_ID".into(), rec.id.to_string());
            env.insert("GPUCI_PIPELINE_ID".into(), rec.pipeline_id.to_string());
            env.insert("GPUCI_STEP_KEY".into(), rec.step.key.clone());
            env.insert("GPUCI_ATTEMPT".into(), rec.attempt.to_string());
            let runner = match origin {
                Some(Origin::ActionsRunner(r)) => Some(r),
                _ => None,
            };
            let assignment = Assignment {
                job_id: rec.id,
                pipeline_id: rec.pipeline_id,
                name: rec.step.display_name().to_string(),
                step: rec.step.clone(),
                env,
                gpus: rec.gpus.clone(),
                secrets: gpuci_protocol::agent::SecretValues(secrets),
                workspace_upload: workspace_upload.clone(),
                cache,
                runner_dir: runner.as_ref().map(|r| r.install_dir.clone()),
                trusted,
                repository,
                log_from,
            };
            match (runner, &self.registrar) {
                (None, _) => {
                    // If the send fails the connection is gone; the reconnect (or
                    // the lost-agent reaper) settles the job.
                    self.send(&agent_id, CoordinatorMessage::Assign(Box::new(assignment)));
                }
                (Some(r), Some((registrar, tx))) => {
                    // The GPUs are leased; register the runner without holding up
                    // the scheduler, and send the assignment when GitHub answers.
                    self.placements += 1;
                    let placement = self.placements;
                    self.registering.insert(rec.id, (placement, assignment));
                    let (registrar, tx, job, agent) = (registrar.clone(), tx.clone(), rec.id, agent_id.clone());
                    tokio::spawn(async move {
                        let result = registrar.register(job, &agent, &r).await;
                        let _ = tx.send(Command::RunnerRegistered { job, placement, result }).await;
                    });
                }
                (Some(_), None) => {
                    let why = "an Actions runner job, but GitHub is not configured on this coordinator".to_string();
                    if let Err(e) = self.finish(&rec, JobState::Failed, why, None, None, Vec::new()).await {
                        tracing::error!(job = rec.id, error = %e, "could not fail job");
                    }
                }
            }
        }
    }

    /// Whether `job`'s repository is past its budget today (then it runs on no fleet machine).
    async fn budget_held(&mut self, job: &JobRecord) -> bool {
        if self.budgets_reached.is_empty() {
            return false;
        }
        let repository = match self.repository_of.get(&job.pipeline_id) {
            Some(r) => r.clone(),
            None => {
                let r = match self.store.get_pipeline(job.pipeline_id).await {
                    Ok(p) => p.and_then(|p| {
                        crate::repos::name_of_pipeline(p.repository.as_deref(), p.origin.as_deref(), &self.github_host)
                    }),
                    // Unknown for now: held, as a budget must not lift for want of a read.
                    Err(_) => return true,
                };
                self.repository_of.insert(job.pipeline_id, r.clone());
                r
            }
        };
        repository.is_some_and(|r| self.budgets_reached.iter().any(|b| b.covers(&r)))
    }

    async fn runner_registered(&mut self, id: JobId, placement: u64, result: Result<RunnerGrant, String>) {
        let current = self.registering.get(&id).is_some_and(|(p, _)| *p == placement);
        let job = self.active.get(&id).filter(|j| j.state == JobState::Assigned).cloned();
        let (Some(job), true) = (job, current) else {
            // Cancelled, or requeued (and perhaps placed again) meanwhile: this runner is not needed.
            if let (Ok(grant), Some((registrar, _))) = (result, &self.registrar) {
                let registrar = registrar.clone();
                tokio::spawn(async move { registrar.discard(grant).await });
            }
            return;
        };
        let Some((_, mut assignment)) = self.registering.remove(&id) else { return };
        match result {
            Ok(grant) => {
                tracing::info!(job = id, runner = %grant.runner_name, "runner registered");
                assignment.secrets.0.insert(JIT_CONFIG_ENV.to_string(), grant.jit_config);
                assignment.env.insert("GPUCI_RUNNER_NAME".into(), grant.runner_name);
                let agent = job.agent_id.clone().unwrap_or_default();
                self.send(&agent, CoordinatorMessage::Assign(Box::new(assignment)));
            }
            Err(e) => {
                let why = format!("could not register an Actions runner with GitHub: {e}");
                if let Err(e) = self.finish(&job, JobState::Failed, why, None, None, Vec::new()).await {
                    tracing::error!(job = id, error = %e, "could not fail job");
                }
            }
        }
    }

    /// The agent's machine is being taken back: it takes no new job, and each job it runs is
    /// ended `lost` and queued again as its next attempt in the same commit, whatever the
    /// step's retry policy (the job did nothing wrong). Once: a notice repeated after a
    /// reconnect finds those jobs ended already. The agent is told to stop the old runs.
    async fn agent_interrupted(&mut self, agent_id: &str, reason: String) {
        let Some(a) = self.agents.get_mut(agent_id) else { return };
        let first = a.interrupted.is_none();
        a.interrupted = Some(reason.clone());
        let name = a.name.clone();
        if first {
            tracing::warn!(agent = %name, %reason, "the agent's machine is being taken back");
        }
        let jobs: Vec<JobRecord> = self
            .active
            .values()
            .filter(|j| j.agent_id.as_deref() == Some(agent_id))
            .filter(|j| matches!(j.state, JobState::Assigned | JobState::Running))
            .cloned()
            .collect();
        for job in jobs {
            let now = now_ms();
            let why = format!("lost: machine {name} is being taken back ({reason})");
            // A job taken back again and again (a spot market in a storm, a notice that comes
            // and goes) stops being queued again at some point, saying so.
            if job.attempt >= MAX_INTERRUPTED_ATTEMPTS {
                let why = format!("{why}; not queued again: this was attempt {}", job.attempt);
                if let Err(e) = self.finish(&job, JobState::Lost, why.clone(), None, None, Vec::new()).await {
                    tracing::error!(job = job.id, error = %e, "could not end a job of an interrupted machine");
                }
                self.send(agent_id, CoordinatorMessage::Cancel { job_id: job.id, reason: why });
                continue;
            }
            self.note_in_log(&job, format!("{why}; this run is stopped and the job queued again")).await;
            let change = JobChange {
                state: Some(JobState::Lost),
                reason: Some(format!("{why}; queued again as attempt {}", job.attempt + 1)),
                finished_at_ms: Some(now),
                release_leases: true,
                ..Default::default()
            };
            let next =
                next_attempt(&job, format!("queued again: job {} was on a machine being taken back", job.id), now);
            match self.store.update_job_and_insert(job.id, &[JobState::Assigned, JobState::Running], change, next).await
            {
                Ok((rec, next)) => {
                    self.ready_since.remove(&rec.id);
                    self.cancelling.remove(&rec.id);
                    self.registering.remove(&rec.id);
                    self.publish(&rec);
                    self.publish(&next);
                    self.send(agent_id, CoordinatorMessage::Cancel { job_id: rec.id, reason: why.clone() });
                    tracing::info!(job = rec.id, next = next.id, "job on an interrupted machine queued again");
                }
                Err(e) => {
                    tracing::error!(job = job.id, error = %e, "could not queue again a job of an interrupted machine")
                }
            }
        }
    }

    fn fleet_view(&self) -> FleetView {
        let agents = self
            .agents
            .values()
            .filter(|a| a.link == Link::Connected)
            .filter_map(|a| {
                let machine = a.tags.get(gpuci_providers::TAG_MACHINE)?.clone();
                let jobs: Vec<&JobRecord> = self
                    .active
                    .values()
                    .filter(|j| j.agent_id.as_deref() == Some(&a.id) && j.state != JobState::Queued)
                    .collect();
                let gpus_busy = jobs.iter().map(|j| j.gpus.len() as u32).sum();
                Some(FleetAgent {
                    agent_id: a.id.clone(),
                    machine,
                    running: jobs.len() as u32,
                    gpus_busy,
                    interrupted: a.interrupted.clone(),
                    first_job_at_ms: a.first_job_at_ms,
                })
            })
            .collect();
        let waiting = self
            .unplaceable
            .iter()
            .filter_map(|id| self.active.get(id))
            .filter(|j| j.state == JobState::Queued)
            .map(|j| WaitingJob {
                id: j.id,
                pipeline_id: j.pipeline_id,
                since_ms: self.ready_since.get(&j.id).copied().unwrap_or(j.created_at_ms),
                tags: j.step.agents.clone(),
                gpu: j.step.gpu.clone(),
                container: j.step.image.is_some(),
                timeout: j.step.timeout,
            })
            .collect();
        let absent = self
            .agents
            .values()
            .filter(|a| a.link != Link::Connected)
            .filter_map(|a| Some((a.tags.get(gpuci_providers::TAG_MACHINE)?.clone(), a.link == Link::Lost)))
            .collect();
        let registered = self
            .agents
            .values()
            .filter_map(|a| Some((a.tags.get(gpuci_providers::TAG_MACHINE)?.clone(), (a.id.clone(), a.last_seen_ms))))
            .collect();
        FleetView { agents, waiting, absent, registered }
    }

    fn agent_summaries(&self) -> Vec<AgentSummary> {
        self.agents
            .values()
            .map(|a| {
                let running: Vec<JobId> =
                    self.active.values().filter(|j| j.agent_id.as_deref() == Some(&a.id)).map(|j| j.id).collect();
                let gpus = a
                    .gpus
                    .iter()
                    .map(|g| {
                        let lease = self.active.values().find(|j| j.gpus.contains(&g.uuid));
                        let q = self.quarantine.get(&g.uuid);
                        GpuView {
                            info: g.clone(),
                            state: if q.is_some() {
                                "quarantined"
                            } else if lease.is_some() {
                                "leased"
                            } else {
                                "free"
                            }
                            .into(),
                            job_id: lease.map(|j| j.id),
                            reason: q.map(|q| q.reason.clone()),
                            health: a.health.get(&g.uuid).cloned(),
                        }
                    })
                    .collect();
                AgentSummary {
                    id: a.id.clone(),
                    name: a.name.clone(),
                    hostname: a.hostname.clone(),
                    state: match a.link {
                        Link::Connected => "connected",
                        Link::Disconnected => "disconnected",
                        Link::Lost => "lost",
                    }
                    .into(),
                    reason: match (a.interrupted.as_ref().or(a.withdrawn.as_ref()).or(a.paused.as_ref()), a.link) {
                        (Some(why), Link::Connected) => format!("takes no new jobs: {why}"),
                        _ => a.reason.clone(),
                    },
                    tags: a.tags.clone(),
                    slots: a.slots,
                    running,
                    gpu_backend: a.gpu_backend.clone(),
                    isolation: a.isolation.clone(),
                    container_runtime: a.container_runtime.clone(),
                    gpus,
                    last_seen_ms: Some(a.last_seen_ms).filter(|t| *t > 0),
                }
            })
            .collect()
    }
}

/// Where a job came from, for choosing its secrets' scopes.
fn secret_source(
    pipeline: Option<&gpuci_store::PipelineRecord>,
    github_host: &str,
) -> gpuci_core::secret_scope::JobSource {
    use gpuci_core::secret_scope::JobSource;
    let origin = pipeline.and_then(|p| Origin::parse(p.origin.as_deref()));
    match origin {
        Some(Origin::Github(g)) => {
            let (git_ref, description) = match (g.event.as_str(), g.pr) {
                ("pull_request", Some(n)) if !g.secrets => {
                    let d = match &g.approved_by {
                        Some(by) => {
                            format!("an approved pull request from a fork ({} #{n}, approved by {by})", g.repository)
                        }
                        None => format!("a pull request from a fork ({} #{n})", g.repository),
                    };
                    (Some(format!("refs/pull/{n}/merge")), d)
                }
                ("pull_request", Some(n)) => {
                    (Some(format!("refs/pull/{n}/merge")), format!("pull request {} #{n}", g.repository))
                }
                _ => {
                    let r = g.git_ref.clone();
                    let d = format!("a push to {} {}", g.repository, r.as_deref().unwrap_or("(ref unknown)"));
                    (r, d)
                }
            };
            JobSource {
                // Approval policy: a fork's pull request that ran on a maintainer's approval
                // may get values set for approved forks, and nothing else.
                approved_fork: !g.secrets && g.approved_by.is_some(),
                repository: Some(g.repository),
                git_ref,
                environment: None,
                may_have_secrets: g.secrets,
                description,
            }
        }
        Some(Origin::ActionsRunner(r)) => JobSource {
            description: format!("an Actions runner job for {}", r.repository),
            repository: Some(r.repository),
            git_ref: None,
            environment: None,
            may_have_secrets: true,
            approved_fork: false,
        },
        // An origin that is stored but cannot be read (a newer coordinator's, a damaged row)
        // is not "submitted through the API": whoever it was, it gets no secret.
        None if pipeline.is_some_and(|p| p.origin.is_some()) => JobSource {
            repository: None,
            git_ref: None,
            environment: None,
            may_have_secrets: false,
            approved_fork: false,
            description: "a pipeline whose recorded origin cannot be read (no secrets)".to_string(),
        },
        None => {
            // `gpuci submit` reports its work tree's origin URL (or path); scopes name
            // repositories as `owner/name` on the GitHub host, `host/path` elsewhere.
            let repository = pipeline
                .and_then(|p| p.repository.as_deref())
                .and_then(|r| gpuci_core::secret_scope::repository_of_remote(r, github_host));
            let description = match &repository {
                Some(r) => format!("a pipeline submitted through the API from a work tree of {r}"),
                None => "a pipeline submitted through the API (no repository)".to_string(),
            };
            JobSource {
                repository,
                git_ref: None,
                environment: None,
                may_have_secrets: true,
                approved_fork: false,
                description,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a stored origin that does not parse fell into the "submitted through the
    /// API" branch, which may have every secret.
    #[test]
    fn a_pipeline_whose_origin_cannot_be_read_gets_no_secret() {
        let p = gpuci_store::PipelineRecord {
            id: 1,
            file_name: "x.yml".into(),
            source: String::new(),
            workspace_upload: None,
            repository: Some("https://github.com/acme/x.git".into()),
            origin: Some("{\"kind\": \"from-the-future\"".into()),
            created_at_ms: 0,
        };
        let s = secret_source(Some(&p), "github.com");
        assert!(!s.may_have_secrets, "{s:?}");
        let api = gpuci_store::PipelineRecord { origin: None, ..p };
        assert!(secret_source(Some(&api), "github.com").may_have_secrets);
    }

    /// Regression (outsider attack): a cancel accepted (stored, acknowledged, sent) was only
    /// remembered in memory; after a restart the coordinator neither sent it again nor judged
    /// the job's result as cancelled, and the job ran to `succeeded`. The stored reason is the
    /// record of it, and a restarted coordinator picks it up.
    #[tokio::test]
    async fn a_cancel_accepted_before_a_restart_is_still_under_way_after_it() {
        let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
        let job = |state| gpuci_store::NewJob {
            pipeline_id: 0,
            step: gpuci_core::pipeline::Step::new("a", "sleep 60"),
            env: BTreeMap::new(),
            state,
            reason: "waiting".into(),
            attempt: 1,
            retry_of: None,
            created_at_ms: 1,
        };
        let pipeline = gpuci_store::NewPipeline {
            file_name: "x.yml".into(),
            source: String::new(),
            workspace_upload: None,
            repository: None,
            origin: None,
            created_at_ms: 1,
        };
        let (_, jobs) =
            store.create_pipeline(pipeline, vec![job(JobState::Queued), job(JobState::Queued)]).await.unwrap();
        store.set_reason(jobs[0].id, &format!("{CANCELLING}cancelled by user")).await.unwrap();
        let (key, _) = gpuci_store::SecretsKey::generate();
        let brain = Brain::load(store, Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
        assert_eq!(brain.cancelling.get(&jobs[0].id).map(String::as_str), Some("cancelled by user"));
        assert!(!brain.cancelling.contains_key(&jobs[1].id));
    }

    #[test]
    fn silence_is_counted_only_while_the_coordinator_ran() {
        let t0 = Instant::now();
        let s = |secs| Duration::from_secs(secs);
        let tick = Duration::from_millis(200);
        // Heard at t0; the coordinator ran 5 s, then stalled 15 s: 5.2 s of silence counted.
        let heard = heard_after_stall(t0, s(15), tick, t0 + s(20));
        assert_eq!((t0 + s(20)).duration_since(heard), s(5) + tick);
        // Heard during the stall's last moments (a message read on waking): never in the future.
        assert_eq!(heard_after_stall(t0 + s(19), s(15), tick, t0 + s(20)), t0 + s(20));
        assert!(!stalled(t0, t0 + Duration::from_millis(900), tick), "a late tick is not a stall");
        assert!(stalled(t0, t0 + s(15), tick));
    }

    /// Regression (outsider attack): a coordinator stalled for 8 s every 9 s gave its agents a
    /// fresh `lost_after` at each stall, so a dead agent was never declared lost and its jobs
    /// stayed `running`. Silence adds up across stalls.
    #[test]
    fn a_dead_agent_is_lost_after_lost_after_of_running_time_however_often_the_coordinator_stalls() {
        let t0 = Instant::now();
        let (tick, lost_after) = (Duration::from_millis(200), Duration::from_secs(10));
        let mut last_seen = t0; // the agent died here
        let mut now = t0;
        let mut ran = Duration::ZERO;
        let lost_at = loop {
            // 1 s of running (ticks), then an 8 s stall.
            now += Duration::from_secs(1);
            ran += Duration::from_secs(1);
            if now.saturating_duration_since(last_seen) > lost_after {
                break ran;
            }
            let stall = Duration::from_secs(8);
            now += stall;
            last_seen = heard_after_stall(last_seen, stall, tick, now);
            assert!(ran < Duration::from_secs(60), "never declared lost");
        };
        assert!(lost_at <= lost_after + Duration::from_secs(2), "lost after {lost_at:?} of running time");
    }

    #[test]
    fn an_agent_settles_its_jobs_by_what_its_journal_holds() {
        let ours = [(1, JobState::Assigned), (2, JobState::Running), (3, JobState::Assigned), (4, JobState::Running)];
        let holds = [3, 4, 9];
        let plan = reconcile(&ours, &holds, false);
        assert_eq!(plan, Reconciled { keep: vec![3, 4], forget: vec![9], requeue: vec![1], lost: vec![2] });
        // An incomplete journal may have dropped job 1's arrival: it may have run, so it is
        // lost, never handed out again.
        let plan = reconcile(&ours, &holds, true);
        assert_eq!(plan, Reconciled { keep: vec![3, 4], forget: vec![9], requeue: vec![], lost: vec![1, 2] });
    }
}
