//! Rows as typed values.

use gpuci_core::job::JobState;
use gpuci_core::pipeline::Step;
use gpuci_protocol::agent::{JobTelemetry, Unenforced};
use gpuci_protocol::{JobId, PipelineId};
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
pub struct NewPipeline {
    pub file_name: String,
    pub source: String,
    /// The id (sha256) of the workspace upload every job starts from, if any.
    pub workspace_upload: Option<String>,
    /// The repository the pipeline came from, if known (cache key).
    pub repository: Option<String>,
    /// Where the pipeline came from (a GitHub event, an Actions runner job), as the
    /// coordinator's JSON; `None` for pipelines submitted directly.
    pub origin: Option<String>,
    pub created_at_ms: i64,
}

#[derive(Clone, Debug)]
pub struct PipelineRecord {
    pub id: PipelineId,
    pub file_name: String,
    pub source: String,
    /// The id (sha256) of the workspace upload every job starts from, if any.
    pub workspace_upload: Option<String>,
    /// The repository the pipeline came from, if known (cache key).
    pub repository: Option<String>,
    /// Where the pipeline came from (a GitHub event, an Actions runner job), as the
    /// coordinator's JSON; `None` for pipelines submitted directly.
    pub origin: Option<String>,
    pub created_at_ms: i64,
}

#[derive(Clone, Debug)]
pub struct NewJob {
    /// Ignored by `create_pipeline`, which sets it.
    pub pipeline_id: PipelineId,
    pub step: Step,
    pub env: BTreeMap<String, String>,
    pub state: JobState,
    pub reason: String,
    pub attempt: u32,
    pub retry_of: Option<JobId>,
    pub created_at_ms: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct JobRecord {
    pub id: JobId,
    pub pipeline_id: PipelineId,
    pub step: Step,
    pub env: BTreeMap<String, String>,
    pub state: JobState,
    pub reason: String,
    pub attempt: u32,
    pub retry_of: Option<JobId>,
    pub agent_id: Option<String>,
    pub gpus: Vec<String>,
    pub created_at_ms: i64,
    pub assigned_at_ms: Option<i64>,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub exit_code: Option<i32>,
    pub telemetry: Option<JobTelemetry>,
    /// The protections its agent did not enforce for it, as the agent said at its start
    /// (empty: all were, or it has not started on its current placement).
    pub unenforced: Vec<Unenforced>,
}

/// One assignment of a placement pass ([`Store::assign_jobs`](crate::Store::assign_jobs)):
/// queued → assigned to `agent_id`, leasing `gpus`.
#[derive(Clone, Debug, PartialEq)]
pub struct NewAssignment {
    pub job: JobId,
    pub agent_id: String,
    /// The agent's name, as the assigned job's reason gives it (an id means nothing to a
    /// person reading why a job is not running yet).
    pub agent_name: String,
    pub gpus: Vec<String>,
    /// The sha256 (lowercase hex) of the job token this run is given (dynamic steps,
    /// `job_tokens`), stored with the assignment in its transaction, replacing an earlier one
    /// of the job: stored exactly when the assignment is. `None`: the run gets no token.
    pub token_sha256: Option<String>,
}

/// What a job assigned to the agent named `agent` says instead of why it waited.
pub fn assigned_reason(agent: &str) -> String {
    format!("assigned to agent {agent}")
}

impl NewAssignment {
    /// What an assigned job's record says instead of why it waited.
    pub fn reason(&self) -> String {
        assigned_reason(&self.agent_name)
    }

    /// `job`, queued, as [`Store::assign_jobs`](crate::Store::assign_jobs) stores it when
    /// this assignment is accepted at `now_ms`: the backends write exactly these fields, so
    /// the scheduler builds its copy of an assigned job with this instead of reading the
    /// batch's records back (a parse of each job's step, 4,000 a pass at full load).
    pub fn applied_to(&self, job: &JobRecord, now_ms: i64) -> JobRecord {
        JobRecord {
            state: JobState::Assigned,
            reason: self.reason(),
            agent_id: Some(self.agent_id.clone()),
            gpus: self.gpus.clone(),
            assigned_at_ms: Some(now_ms),
            ..job.clone()
        }
    }
}

/// A job's stored state changes of a batch ([`Store::update_jobs`](crate::Store::update_jobs)):
/// [`Store::update_job`](crate::Store::update_job)'s arguments.
#[derive(Clone, Debug)]
pub struct JobUpdate {
    pub job: JobId,
    pub expect: Vec<JobState>,
    pub change: JobChange,
}

/// A state change. Fields left `None` keep their value.
#[derive(Clone, Debug, Default)]
pub struct JobChange {
    pub state: Option<JobState>,
    pub reason: Option<String>,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub exit_code: Option<i32>,
    pub telemetry: Option<JobTelemetry>,
    /// What its agent did not enforce for it (with the start).
    pub unenforced: Option<Vec<Unenforced>>,
    /// Back to queued: forget the agent and GPUs (and what that agent did not enforce).
    pub clear_assignment: bool,
    /// Release every GPU lease this job holds.
    pub release_leases: bool,
    /// GPUs that failed their post-job check.
    pub quarantine: Vec<Quarantine>,
}

impl JobChange {
    /// `job` as [`Store::update_jobs`](crate::Store::update_jobs) stores it once this change
    /// is accepted: the backends write exactly these fields (a field left `None` keeps its
    /// value; a cleared assignment forgets the agent, its GPUs and what it did not enforce).
    /// The scheduler builds its copy with this instead of reading the batch's records back.
    pub fn applied_to(&self, job: &JobRecord) -> JobRecord {
        let mut rec = JobRecord {
            state: self.state.unwrap_or(job.state),
            reason: self.reason.clone().unwrap_or_else(|| job.reason.clone()),
            started_at_ms: self.started_at_ms.or(job.started_at_ms),
            finished_at_ms: self.finished_at_ms.or(job.finished_at_ms),
            exit_code: self.exit_code.or(job.exit_code),
            telemetry: self.telemetry.clone().or_else(|| job.telemetry.clone()),
            unenforced: self.unenforced.clone().unwrap_or_else(|| job.unenforced.clone()),
            ..job.clone()
        };
        if self.clear_assignment {
            rec.agent_id = None;
            rec.gpus = Vec::new();
            rec.assigned_at_ms = None;
            rec.unenforced = Vec::new();
        }
        rec
    }
}

#[derive(Clone, Debug, Default)]
pub struct JobFilter {
    pub states: Vec<JobState>,
    pub pipeline: Option<PipelineId>,
    pub limit: Option<u32>,
    /// Only jobs older than this one (the next page of a newest-first listing).
    pub before: Option<JobId>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct AgentRecord {
    pub id: String,
    pub name: String,
    /// SHA-256 of the credential, hex. The credential itself is never stored.
    pub credential_hash: String,
    pub registered_at_ms: i64,
    pub last_seen_ms: Option<i64>,
    pub state: String,
    pub reason: String,
    pub hello_json: Option<String>,
}

#[derive(Clone, Debug, Default)]
pub struct AgentUpdate {
    pub state: Option<String>,
    pub reason: Option<String>,
    pub last_seen_ms: Option<i64>,
    pub hello_json: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub gpu_uuid: String,
    pub agent_id: String,
    pub job_id: JobId,
    pub since_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quarantine {
    pub gpu_uuid: String,
    pub agent_id: String,
    pub reason: String,
    pub since_ms: i64,
}

/// A webhook delivery a coordinator accepted and left for the leader to act on
/// ([`Store::queue_delivery`](crate::Store::queue_delivery)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueuedDelivery {
    pub delivery: String,
    pub event: String,
    pub body: Vec<u8>,
    pub received_at_ms: i64,
    /// The `X-Hub-Signature-256` it was received with (`None`: queued by an older
    /// coordinator, or not by a coordinator at all).
    pub signature: Option<String>,
}

/// A GitHub workflow job that matched a runner pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GithubJobRecord {
    /// GitHub's workflow job id.
    pub id: i64,
    /// `owner/name`.
    pub repository: String,
    pub run_id: i64,
    pub name: String,
    pub labels: Vec<String>,
    pub pool: String,
    /// `queued`, `in_progress`, `completed`, or `cancelled` (by gpuci, with the reason).
    pub state: String,
    /// The runner job gpuci queued for it.
    pub runner_job_id: Option<JobId>,
    /// The runner that actually ran it (from `in_progress`).
    pub runner_name: Option<String>,
    pub reason: String,
    pub queued_at_ms: i64,
    pub updated_at_ms: i64,
    /// Runners in a row that exited without taking this job; the backoff counts them.
    pub runner_exits: u32,
    /// How the last of them ended, e.g. `exit 0, 'Must not run interactively with sudo'`.
    pub last_runner_exit: Option<String>,
    /// Failed attempts to ask GitHub about this job (whether its run comes from a fork). Above
    /// 0 the check is still owed, and no runner is started until it passes.
    pub check_failures: u32,
    /// No runner (or check) is started for this job before this time.
    pub retry_at_ms: Option<i64>,
}

/// A just-in-time runner: one per runner job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerRecord {
    pub name: String,
    /// The gpuci job that runs it.
    pub job_id: JobId,
    pub pool: String,
    pub repository: String,
    /// Set when registered at the organisation level.
    pub org: Option<String>,
    /// GitHub's runner id, once registered.
    pub runner_id: Option<i64>,
    /// The workflow job it took, once GitHub says so.
    pub github_job_id: Option<i64>,
    /// `queued` (waiting for GPUs), `registered`, `busy`, `done`, `removed`.
    pub state: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// A maintainer's approval of one pull request head SHA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApprovalRecord {
    pub repository: String,
    pub pr: i64,
    pub head_sha: String,
    pub approved_by: String,
    pub approved_at_ms: i64,
}

/// A machine a fleet's provider created (or was asked to), as the coordinator records it for
/// boot stages and cost. What exists is always asked of the provider; this row is what gpuci
/// knows about the machine's life.
#[derive(Clone, Debug, PartialEq)]
pub struct MachineRecord {
    /// gpuci's id, the `gpuci.machine` tag.
    pub id: String,
    pub fleet: String,
    pub provider_id: Option<String>,
    pub instance_type: String,
    pub zone: String,
    /// `spot` or `on-demand`.
    pub capacity: String,
    /// USD per hour while billed.
    pub price_per_hour: f64,
    /// GPUs the machine has (a job's share of its price is its GPUs over these).
    pub gpus: u32,
    /// `requested`, `booting`, `ready`, `stopping`, `stopped`, `ended`.
    pub state: String,
    /// Why it ended, or the last provider error about it.
    pub reason: Option<String>,
    /// The agent that registered from it.
    pub agent_id: Option<String>,
    /// Boot stages: asked of the provider, running at the provider, agent connected, first job.
    pub requested_at_ms: i64,
    pub running_at_ms: Option<i64>,
    pub connected_at_ms: Option<i64>,
    pub first_job_at_ms: Option<i64>,
    pub ended_at_ms: Option<i64>,
    /// Deleted because its agent never connected within the fleet's boot timeout.
    pub boot_failed: bool,
    /// When its provider's interruption notice was seen (spot): the fleet's breaker counts these,
    /// across coordinator restarts.
    pub interrupted_at_ms: Option<i64>,
}

/// A stretch of time a machine was billed for: from launch (or start) to delete (or stop);
/// `to_ms` is `None` while it lasts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BillingInterval {
    pub machine_id: String,
    pub from_ms: i64,
    pub to_ms: Option<i64>,
}

/// One entry of the audit log, as the coordinator hands it in: who did what to which object,
/// and how it ended. Never a secret value or a token: `object` names a secret by name and
/// scope, `credential` is a fingerprint of the token (see the coordinator's `audit` module).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewAudit {
    pub at_ms: i64,
    /// Which kind of credential acted: `admin-token`, `api-token`, `dashboard`, `github`,
    /// `coordinator`.
    pub actor_kind: String,
    /// Its name: `admin`, a named token's name, a GitHub login.
    pub actor: String,
    /// A stable fingerprint of the credential (`sha256:` and 12 hex digits of its hash), when
    /// one was presented: tells a rotated admin token from the one before.
    pub credential: Option<String>,
    /// `secret.set`, `secret.rm`, `token.create`, ... (dotted: a filter on `secret` finds
    /// every `secret.*`).
    pub action: String,
    /// What it acted on: `HF_TOKEN (repository acme/x)`, `job 42`, `token ci-bot`.
    pub object: String,
    /// `ok`, or what stopped it (`not found`, `failed: ...`).
    pub outcome: String,
}

/// A stored audit entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRecord {
    /// Increases with each entry: the order they were committed in.
    pub id: i64,
    pub entry: NewAudit,
}

/// Which audit entries to list: newest first.
#[derive(Clone, Debug, Default)]
pub struct AuditFilter {
    /// Entries at or after this time.
    pub since_ms: Option<i64>,
    /// This action, or every action under it (`secret` matches `secret.set` and `secret.rm`).
    pub action: Option<String>,
    /// Entries of this actor (a token's name, a GitHub login), exactly.
    pub actor: Option<String>,
    /// At most this many (default 1000).
    pub limit: Option<u32>,
}

impl AuditFilter {
    pub(crate) fn limit(&self) -> i64 {
        i64::from(self.limit.unwrap_or(1000).clamp(1, 100_000))
    }
    /// The `LIKE` pattern for actions under `action` (`_` and `%` in it taken literally).
    pub(crate) fn action_prefix(&self) -> Option<String> {
        let a = self.action.as_ref()?;
        let escaped: String =
            a.chars().flat_map(|c| if matches!(c, '%' | '_' | '\\') { vec!['\\', c] } else { vec![c] }).collect();
        Some(format!("{escaped}.%"))
    }
}

/// A named API token: stored as the SHA-256 of its value, never the value. Names are never
/// reused, revoked ones included, so a name in the audit log always means one token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiTokenRecord {
    pub name: String,
    /// Hex SHA-256 of the token.
    pub hash: String,
    pub created_at_ms: i64,
    /// Who created it (the actor's name).
    pub created_by: String,
    pub revoked_at_ms: Option<i64>,
}

/// The audit entry of an approval ([`Store::put_approval`](crate::Store::put_approval) writes
/// it with the approval): the GitHub login that approved, and what it approved.
pub fn approval_audit(a: &ApprovalRecord) -> NewAudit {
    NewAudit {
        at_ms: a.approved_at_ms,
        actor_kind: "github".into(),
        actor: a.approved_by.clone(),
        credential: None,
        action: "approval.grant".into(),
        object: format!("pull request {}#{} at {}", a.repository, a.pr, a.head_sha),
        outcome: "ok".into(),
    }
}

/// One fire of a schedule, recorded before its pipeline is submitted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleFireRecord {
    pub id: i64,
    pub schedule: String,
    /// `cron` (the schedule came due) or `manual` (`gpuci schedules run`).
    pub cause: String,
    /// The occurrence it is for (a manual fire: when it was asked for).
    pub scheduled_at_ms: i64,
    pub fired_at_ms: i64,
    /// A catch-up after downtime: the first of the occurrences passed over (none ran).
    pub skipped_from_ms: Option<i64>,
    /// The pipeline submitted; `None` while firing, or when it failed (`error`).
    pub pipeline_id: Option<PipelineId>,
    /// Why no pipeline was submitted (the source could not be fetched, the file is invalid).
    pub error: Option<String>,
}
