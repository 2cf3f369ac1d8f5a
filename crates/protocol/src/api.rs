//! Bodies of the REST API (`/api/v1/...`). The coordinator serves an OpenAPI document
//! generated from these types at `/api/v1/openapi.json`.

use crate::agent::{GpuHealth, JobTelemetry, Stream, Unenforced};
use crate::{JobId, PipelineId};
use gpuci_core::gpu::GpuInfo;
use gpuci_core::job::JobState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `POST /api/v1/pipelines`: a pipeline file's text; the coordinator validates it again.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitPipeline {
    /// Name shown in errors, e.g. `.gpuci.yml`.
    pub file_name: String,
    /// The YAML text.
    pub source: String,
    /// Extra environment for every step (lowest precedence).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The id of an upload (`POST /api/v1/uploads`) every job's workspace starts from.
    #[serde(default)]
    pub workspace_upload: Option<String>,
    /// A small workspace sent with the pipeline instead of uploaded first: a gzip'ed tar in
    /// base64, at most [`MAX_INLINE_WORKSPACE_BYTES`] decoded. Stored as an upload is (the
    /// same content, the same id); not with `workspace_upload`.
    #[serde(default)]
    pub workspace_archive: Option<String>,
    /// Where the pipeline comes from (a git remote URL or a work tree path); steps' `cache:`
    /// paths are kept per repository.
    #[serde(default)]
    pub repository: Option<String>,
    /// What the build is (branch, tag, event, commit, changed paths), for steps' `if:`
    /// conditions. Absent: every fact unknown, and a condition that needs one runs its step.
    /// `gpuci submit` fills it from the work tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<gpuci_core::condition::BuildFacts>,
    /// The client's key for this submission ([`SUBMISSION_KEY_CHARS`], 16 to 128 of them; a
    /// random UUID does): the pipeline is made once per key. The same request sent again with
    /// it (its answer lost: a failover, a dropped connection) is answered with the pipeline the
    /// first made; another request with a key used before is refused (409). `gpuci submit`
    /// makes one per command and sends it again until it has an answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submission: Option<String>,
}

/// What a [`SubmitPipeline::submission`] key may be made of.
pub const SUBMISSION_KEY_CHARS: &str = "ASCII letters, digits, '-' and '_'";

/// The largest workspace a `SubmitPipeline` may carry itself (`workspace_archive`, decoded);
/// a larger one is uploaded first (`POST /api/v1/uploads`). Saves a round trip and a request on
/// the path a user waits on for the small work trees most pipelines have.
pub const MAX_INLINE_WORKSPACE_BYTES: usize = 512 << 10;

/// A validation error with its position in the submitted file.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PipelineErrorBody {
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub field: String,
    pub message: String,
}

/// Every non-2xx answer.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pipeline_errors: Vec<PipelineErrorBody>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobSummary {
    pub id: JobId,
    pub pipeline_id: PipelineId,
    pub step_key: String,
    pub name: String,
    pub state: JobState,
    /// A failure its step's `soft_fail` covers: the job is `failed` (or `timed_out`) but
    /// does not fail its pipeline, and its dependents run (Buildkite's "soft failed").
    #[serde(default)]
    pub soft_failed: bool,
    /// Skipped because its step's `if:` (or a dependency's) was false for the build: neither
    /// success nor failure.
    #[serde(default)]
    pub skipped_by_condition: bool,
    /// Why the job is in its state: why it waits, why it failed, who cancelled it.
    pub reason: String,
    pub attempt: u32,
    pub agent_id: Option<String>,
    pub agent_name: Option<String>,
    /// Leased GPU UUIDs.
    pub gpus: Vec<String>,
    pub created_at_ms: i64,
    /// When it was placed on an agent (its latest placement).
    #[serde(default)]
    pub assigned_at_ms: Option<i64>,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub exit_code: Option<i32>,
    pub telemetry: Option<JobTelemetry>,
    /// What the job cost, when it ran on a machine of a fleet: its share of the machine's
    /// GPUs × the machine's price, per second of its run.
    #[serde(default)]
    pub cost: Option<JobCost>,
    /// The protections its agent did not enforce for it (its operator opted out, or an agent
    /// that is not root could not): empty when all were, or before it started. Each key with
    /// a sentence saying why and naming the flag; the job's log says the same.
    #[serde(default)]
    pub unenforced: Vec<Unenforced>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobCost {
    pub usd: f64,
    pub machine: String,
    pub fleet: String,
    /// The machine's price, USD per hour.
    pub price_per_hour: f64,
    /// Its part of the machine's overhead so far (boot, idle, GPUs no job leased), split over
    /// the jobs that ran on the machine by GPU-time; `usd` + this is what the job cost. Given
    /// for one job (`GET /api/v1/jobs/{id}`, its page, its GitHub check), not in lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overhead_usd: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PipelineSummary {
    pub id: PipelineId,
    pub file_name: String,
    pub created_at_ms: i64,
    /// `running` while any job is not finished, else the worst outcome.
    pub state: String,
    pub jobs: Vec<JobSummary>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CancelRequest {
    #[serde(default)]
    pub reason: Option<String>,
}

/// One stored log line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LogLine {
    pub seq: i64,
    pub ts_us: i64,
    pub stream: Stream,
    pub text: String,
}

/// One line of `GET /api/v1/jobs/{id}/logs` (NDJSON): a log line, or the end of the log.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LogEvent {
    Line(LogLine),
    End { state: JobState, reason: String },
}

/// One line of `GET /api/v1/pipelines/{id}/watch` (NDJSON): a job changed.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
// A wire type: its size in memory is not worth boxing a variant for.
#[allow(clippy::large_enum_variant)]
pub enum WatchEvent {
    Job(JobSummary),
    Log { job_id: JobId, line: LogLine },
    Done { state: String },
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GpuView {
    pub info: GpuInfo,
    /// `free`, `leased`, `quarantined`.
    pub state: String,
    pub job_id: Option<JobId>,
    pub reason: Option<String>,
    pub health: Option<GpuHealth>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AgentSummary {
    pub id: String,
    pub name: String,
    pub hostname: String,
    /// `connected`, `disconnected`, `lost`.
    pub state: String,
    pub reason: String,
    pub tags: BTreeMap<String, String>,
    pub slots: u32,
    pub running: Vec<JobId>,
    pub gpu_backend: String,
    pub isolation: String,
    pub container_runtime: Option<String>,
    pub gpus: Vec<GpuView>,
    pub last_seen_ms: Option<i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ServerInfo {
    pub version: String,
    pub protocol: u32,
}

/// `POST /api/v1/uploads`: the stored upload, named by the sha256 of its bytes.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UploadInfo {
    /// The sha256 of the gzip'ed tar, in lowercase hex.
    pub id: String,
    pub bytes: u64,
}

/// One stored artifact of a job (`GET /api/v1/jobs/{id}/artifacts`; what an upload answers).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ArtifactInfo {
    /// The job that uploaded it.
    pub job_id: JobId,
    /// Relative to the job's workspace.
    pub path: String,
    pub size: u64,
    /// The sha256 of its bytes, in lowercase hex.
    pub sha256: String,
    pub created_at_ms: i64,
    /// For an upload that is one of the step's `test_reports:`: what the coordinator read
    /// (`4 tests: 3 passed, 1 failed, …`) or why it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// `GET /api/v1/jobs/{id}/test-report`: the job's JUnit reports read together.
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobTestReport {
    /// Counts over every report that could be read, and their failed tests.
    pub summary: gpuci_core::test_report::TestReport,
    /// Each report file, with why it could not be read.
    pub files: Vec<TestReportFile>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TestReportFile {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `GET /api/v1/jobs/{id}/artifact-inputs` (agents only): the artifacts a job gets in its
/// workspace before its command runs, from the steps it names in `artifacts_from:`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ArtifactInputs {
    pub files: Vec<ArtifactInfo>,
    /// What the agent should say in the job's log (a step named that has not uploaded any).
    #[serde(default)]
    pub notes: Vec<String>,
}

/// `GET /api/v1/fleets`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetStatus {
    pub name: String,
    pub provider: String,
    /// Machines by state (`requested`, `booting`, `idle`, `busy`, `stopping`, `stopped`, `draining`).
    pub machines: Vec<MachineStatus>,
    /// Machines counting toward `max`, and what the autoscaler wants.
    pub count: u32,
    pub wanted: u32,
    pub max: u32,
    pub min_idle: u32,
    /// The autoscaler's reason, in words.
    pub why: String,
    pub spend_today_usd: f64,
    pub daily_budget_usd: Option<f64>,
    pub budget_reached: bool,
    /// Unix seconds until which spot is not asked for.
    pub breaker_open_until: Option<u64>,
    /// Newest first: `(unix seconds, what happened)`.
    pub recent_errors: Vec<(u64, String)>,
    /// The fleet cannot run (its provider is missing or misconfigured).
    pub unavailable: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MachineStatus {
    pub id: String,
    pub state: String,
    pub provider_id: Option<String>,
    pub instance_type: String,
    pub zone: String,
    pub capacity: String,
    pub agent_id: Option<String>,
    /// Boot stages, milliseconds since the epoch.
    pub requested_at_ms: i64,
    pub running_at_ms: Option<i64>,
    pub connected_at_ms: Option<i64>,
    pub first_job_at_ms: Option<i64>,
    /// What its provider last said of it: why it waits (a Slurm job's pending reason, a pod
    /// the scheduler cannot place), or how it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// One entry of the audit log (`GET /api/v1/audit`, `gpuci audit --json`): who did what to
/// which object, when, and how it ended. Never a secret value or a token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditEntry {
    /// Increases with each entry, in commit order.
    pub id: i64,
    /// When, UTC (RFC 3339, milliseconds).
    pub at: String,
    pub at_ms: i64,
    /// The kind of credential that acted: `admin-token`, `api-token` (a named token),
    /// `dashboard` (signed in with the admin token), `github` (a GitHub user's action).
    pub actor_kind: String,
    /// Its name: `admin`, the named token's name, the GitHub login.
    pub actor: String,
    /// `sha256:` and 12 hex digits of the token's hash: which token, without the token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
    /// `secret.set`, `secret.rm`, `secrets-key.rotate`, `token.create`, `token.revoke`,
    /// `approval.grant`, `job.cancel`, `job.retry`, `gpu.release`, `schedule.run`.
    pub action: String,
    /// What it acted on: a secret's name and scope, a job, a token's name, a GPU.
    pub object: String,
    /// `ok`, or why not (`not found`, `failed: ...`).
    pub outcome: String,
}

/// A named API token, as listed (never its value).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenInfo {
    pub name: String,
    /// `sha256:` and 12 hex digits of the token's hash, as the audit log names it.
    pub credential: String,
    pub created_at_ms: i64,
    pub created_by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at_ms: Option<i64>,
}

/// `POST /api/v1/tokens`.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateToken {
    /// Letters, digits, `-`, `_` and `.`, 1 to 64 characters; never used before.
    pub name: String,
}

/// The answer to `POST /api/v1/tokens`: the only time the token's value is shown.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreatedToken {
    pub name: String,
    pub token: String,
    pub credential: String,
}

/// A schedule (`[[schedule]]` in the server config), as `GET /api/v1/schedules` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScheduleSummary {
    pub name: String,
    /// The cron expression as configured.
    pub cron: String,
    /// The IANA time zone the expression is read in.
    pub timezone: String,
    /// Where the pipeline is fetched from: a local path or a git URL.
    pub repository: String,
    /// `None`: the repository's default branch.
    pub branch: Option<String>,
    /// The pipeline file's path in the repository.
    pub pipeline: String,
    pub enabled: bool,
    /// When it fires next (ms since the epoch); `None` when disabled or never again.
    pub next_run_ms: Option<i64>,
    /// The same instant in the schedule's time zone, RFC 3339 with the offset.
    pub next_run_local: Option<String>,
    /// Its latest fires, newest first (at most 10).
    pub fires: Vec<ScheduleFire>,
}

/// One fire of a schedule.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScheduleFire {
    pub id: i64,
    /// `cron` or `manual`.
    pub cause: String,
    /// The occurrence it is for (a manual fire: when it was asked for).
    pub scheduled_at_ms: i64,
    pub fired_at_ms: i64,
    /// A catch-up after downtime: the first of the occurrences passed over (they did not run).
    pub skipped_from_ms: Option<i64>,
    /// The pipeline it submitted.
    pub pipeline_id: Option<PipelineId>,
    /// That pipeline's state now (`running`, `succeeded`, `failed`, ...).
    pub pipeline_state: Option<String>,
    /// Why it submitted no pipeline; `None` with no pipeline: still firing.
    pub error: Option<String>,
}

/// `POST /api/v1/jobs/{id}/steps` (`gpuci pipeline upload`, from inside job `id`, with its
/// `GPUCI_JOB_TOKEN`): steps to add to the job's own pipeline, as a pipeline file.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadSteps {
    /// Name shown in errors, e.g. `.gpuci/generated.yml`.
    pub file_name: String,
    /// The YAML text.
    pub source: String,
}

/// The answer to [`UploadSteps`]: the jobs added, in file order (a matrix step: each job).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StepsAdded {
    pub pipeline_id: PipelineId,
    pub jobs: Vec<JobSummary>,
}
