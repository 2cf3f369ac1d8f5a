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
//! acknowledged, only after it commits; a placement pass stores all its assignments, with
//! their job tokens' hashes, in one transaction (`Brain::commit_placements`) and sends none
//! before it commits, and the reasons of the jobs it could not place in another. One fsync
//! per batch, not per job: that write, one at a time, was what bounded placement
//! (BENCHMARKS.md, "The coordinator under load").
//!
//! The parts, each an `impl Brain` block over the state defined here:
//! - `mod.rs`: the commands ([`Command`]), the [`Brain`] and its state, loading it from the store;
//! - `dispatch.rs`: the command loop ([`Brain::run`]) and routing each command;
//! - `pipelines.rs`: submit, cancel and retry from the API;
//! - `results.rs`: agents' starts and results, their group commit, ending a job;
//! - `agents.rs`: connecting ([`reconcile`]), links, GPUs, the reaper, machines taken back;
//! - `groups.rs`: dependencies and concurrency groups that hold a queued job back;
//! - `scheduling.rs`: the placement pass and its one commit, runner registrations;
//! - `secrets.rs`: a queued job's secrets in the pass (vetted once per stored names, opened to
//!   place) and which scopes a job's origin may read;
//! - `budgets.rs`: whether a job's repository is past its budget (held off fleet machines);
//! - `queries.rs`: read-only views for the API and the fleets ([`FleetView`]);
//! - `tests.rs`: tests of the pure helpers and of what survives a restart.

use crate::hub::Hub;
use crate::origin::{Origin, RunnerOrigin};
use gpuci_core::condition::Decision;
use gpuci_core::job::{JobState, Outcome};
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

mod agents;
mod budgets;
mod dispatch;
pub mod dynamic_steps;
mod groups;
#[cfg(test)]
mod loop_tests;
mod pipelines;
mod queries;
mod queue;
mod results;
mod scheduling;
mod secrets;
#[cfg(test)]
pub(crate) mod tests;

pub use agents::{heard_after_stall, reconcile, stalled, Reconciled};
pub use queries::{FleetAgent, FleetView, WaitingJob};

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
    /// The client's key for this submission: the pipeline is made once per key
    /// (`Store::create_pipeline_once`); sent again, the first one is answered.
    pub once: Option<gpuci_store::Submission>,
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
    /// Steps a running job adds to its own pipeline (`crate::brain::dynamic_steps`); its token was
    /// checked by the caller.
    AddSteps {
        job: JobId,
        file_name: String,
        source: String,
        reply: oneshot::Sender<Result<Vec<JobRecord>, crate::brain::dynamic_steps::AddError>>,
    },
    Tick,
}

/// The queued next attempt of `job` (a retry, or a run after its machine was taken back), as
/// the store takes it. Whether there is one, and its `reason`, is decided in gpuci-core
/// (`requeue::on_end`, `requeue::on_interrupted`); this only builds the record.
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

/// A job on a machine taken back is queued again until this attempt; then it ends `lost`
/// (the rule is gpuci-core's, `requeue::on_interrupted`).
pub use gpuci_core::requeue::MAX_INTERRUPTED_ATTEMPTS;

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
    /// The sha256 of the job token in `secrets` (`crate::brain::dynamic_steps`), stored with the
    /// assignment.
    token_sha256: Option<String>,
}

/// Records why `j` waits unless that is already what it says.
fn note_reason(reasons: &mut Vec<(JobId, String)>, j: &JobRecord, why: String) {
    if j.reason != why {
        reasons.push((j.id, why));
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
    /// The active jobs each agent was given, by id ([`Brain::jobs_on`]): kept with `active`
    /// (only [`Brain::publish`] and [`Brain::load`] change either), so that an agent's jobs are
    /// a look-up. Walking every active job per agent made a reconnect storm of 10,000 agents
    /// with 40,000 running jobs take 37 s, two thirds of it comparing agent ids
    /// (BENCHMARKS.md, "The coordinator under load").
    on_agent: HashMap<String, BTreeSet<JobId>>,
    /// How many active jobs each pipeline has, kept with `active` as `on_agent` is: the
    /// pipelines a pass needs the concurrency scopes of, without walking every active job.
    live_pipelines: BTreeMap<PipelineId, usize>,
    /// Latest attempt of each step: (pipeline, key) → (job, state, soft failed).
    steps: HashMap<(PipelineId, String), (JobId, JobState, bool)>,
    quarantine: BTreeMap<String, Quarantine>,
    /// Reasons of cancels sent to agents and not yet confirmed.
    cancelling: HashMap<JobId, String>,
    /// Cancels of running jobs whose store write failed: perhaps after it committed (its
    /// answer lost), so the reaper reads each job again ([`Brain::settle_cancels`]).
    cancels_in_doubt: BTreeMap<JobId, String>,
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
    /// The queued jobs as a pass takes them, and the active jobs in concurrency groups: kept
    /// with `active` as `on_agent` is (`brain/queue.rs`).
    queue: queue::Queue,
    /// Queued jobs the last scheduling pass found no agent for (not blocked by a dependency
    /// or a concurrency group): what fleets may create machines for.
    unplaceable: queue::Waiting,
    /// When a pass last gave waiting jobs their reasons' changed counts (`scheduling.rs`).
    counts_refreshed_ms: i64,
    /// Why queued jobs wait, decided and not yet written: written at most
    /// `reasons_per_write` a time, oldest job first ([`Brain::tell_waiting`]), so that telling
    /// a long queue never holds a placement back longer than one such write.
    untold: BTreeMap<JobId, String>,
    /// [`scheduling::REASONS_PER_WRITE`] (a test makes it small).
    reasons_per_write: usize,
    /// [`Brain::with_fleet_wake`].
    fleet_wake: Option<Arc<tokio::sync::Notify>>,
    /// The fleets' word on jobs in `unplaceable` ([`Command::FleetNotes`]).
    fleet_notes: BTreeMap<JobId, String>,
    /// After a takeover: until when, and how long, agents may be silent before they are lost
    /// ([`Brain::with_takeover_from`]).
    takeover_grace: Option<(Instant, Duration)>,
    /// Queued jobs whose secrets were vetted, with the stored names' fingerprint they were
    /// vetted under and what they are given (`brain/secrets.rs`).
    secrets_vetted: HashMap<JobId, (u64, Vec<(String, SecretScope)>)>,
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
            on_agent: HashMap::new(),
            live_pipelines: BTreeMap::new(),
            steps: HashMap::new(),
            quarantine: BTreeMap::new(),
            cancelling: HashMap::new(),
            cancels_in_doubt: BTreeMap::new(),
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
            queue: queue::Queue::default(),
            unplaceable: queue::Waiting::default(),
            counts_refreshed_ms: 0,
            untold: BTreeMap::new(),
            reasons_per_write: scheduling::REASONS_PER_WRITE,
            fleet_wake: None,
            fleet_notes: BTreeMap::new(),
            takeover_grace: None,
            secrets_vetted: HashMap::new(),
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
            if let Some(agent) = &j.agent_id {
                brain.on_agent.entry(agent.clone()).or_default().insert(j.id);
            }
            *brain.live_pipelines.entry(j.pipeline_id).or_default() += 1;
            brain.queue.note(&j);
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
    /// This coordinator took over from a leader whose agents were told `heartbeat`: until
    /// they have had time to leave it (frozen, their connections still open) and reach this
    /// one, none is called lost, whatever this coordinator's own `lost_after`
    /// (`gpuci_protocol::least_lost_after_for_takeover`). The start-up check judges only this
    /// coordinator's own heartbeat; agents follow the former leader's (outsider attack: a
    /// standby with a 1 s heartbeat and a 16 s `lost_after` under a leader with 5 s ended a
    /// running job `lost`).
    pub fn with_takeover_from(mut self, heartbeat: Duration) -> Self {
        let least = gpuci_protocol::least_lost_after_for_takeover(heartbeat);
        if least > self.timing.lost_after {
            tracing::info!(
                former_heartbeat = ?heartbeat,
                lost_after = ?least,
                "agents of the former leader get this long to reach this coordinator before any is called lost"
            );
            self.takeover_grace = Some((Instant::now() + least, least));
        }
        self
    }

    /// How long an agent may be silent now before it is lost.
    fn lost_after_now(&self, now: Instant) -> Duration {
        match self.takeover_grace {
            Some((until, least)) if now < until => self.timing.lost_after.max(least),
            _ => self.timing.lost_after,
        }
    }

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
        self.queue.note(j);
        let old = if j.state.is_terminal() { self.active.remove(&j.id) } else { self.active.insert(j.id, j.clone()) };
        match (&old, j.state.is_terminal()) {
            (None, false) => *self.live_pipelines.entry(j.pipeline_id).or_default() += 1,
            (Some(_), true) => {
                if let Some(n) = self.live_pipelines.get_mut(&j.pipeline_id) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.live_pipelines.remove(&j.pipeline_id);
                    }
                }
            }
            _ => {}
        }
        let was_on = old.and_then(|old| old.agent_id);
        let now_on = j.agent_id.as_ref().filter(|_| !j.state.is_terminal());
        if was_on.as_ref() != now_on {
            if let Some(agent) = &was_on {
                if let Some(ids) = self.on_agent.get_mut(agent) {
                    ids.remove(&j.id);
                    if ids.is_empty() {
                        self.on_agent.remove(agent);
                    }
                }
            }
            if let Some(agent) = now_on {
                self.on_agent.entry(agent.clone()).or_default().insert(j.id);
            }
        }
        let agent_name = j.agent_id.as_ref().and_then(|id| self.agents.get(id)).map(|a| a.name.clone());
        self.hub.job_changed(crate::convert::job_summary(j, agent_name));
    }

    /// Waiting jobs' new reasons, stored: each record changed where it is (a pass may tell
    /// 100,000 jobs; cloning each record to publish it was most of such a pass) and watchers told.
    fn told(&mut self, reasons: Vec<(JobId, String)>) {
        for (id, why) in reasons {
            let Some(j) = self.active.get_mut(&id) else { continue };
            self.queue.told(id, &why);
            j.reason = why;
            let agent_name = j.agent_id.as_ref().and_then(|a| self.agents.get(a)).map(|a| a.name.clone());
            self.hub.job_changed(crate::convert::job_summary(j, agent_name));
        }
    }

    /// The active jobs given to `agent_id`, by id.
    fn jobs_on<'a>(&'a self, agent_id: &str) -> impl Iterator<Item = &'a JobRecord> + 'a {
        self.on_agent.get(agent_id).into_iter().flatten().filter_map(|id| self.active.get(id))
    }

    fn send(&self, agent_id: &str, msg: CoordinatorMessage) -> bool {
        match self.agents.get(agent_id).and_then(|a| a.conn.as_ref()) {
            Some((_, tx)) => tx.send(msg).is_ok(),
            None => false,
        }
    }
}
