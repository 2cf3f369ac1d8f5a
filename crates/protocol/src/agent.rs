//! Messages on the agent channel (a WebSocket carrying one JSON object per text frame).
//!
//! The coordinator pushes work the moment it decides it; nothing on this channel is polled.
//!
//! Delivery (docs/architecture.md, "The agent protocol"): every job event the agent sends is
//! numbered (`Event { n }`) and kept until the coordinator's `Acked { upto }` covers it, which
//! the coordinator sends only after the event's effect is committed. After a reconnect the
//! agent sends every unacknowledged event again, in order; the coordinator applies each
//! idempotently (a start is a compare-and-set, a result ends an active job once, a log line is
//! stored only if its per-job `seq` is new). So each event takes effect exactly once.

use crate::JobId;
use gpuci_core::gpu::GpuInfo;
use gpuci_core::job::Outcome;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Tag every agent advertises, `allowed` or `forbidden`: whether it runs `sandbox: none` steps.
pub const UNSANDBOXED_TAG: &str = "gpuci.unsandboxed";

/// Tag every agent advertises, `taken` or `refused`: whether it runs steps that set
/// `resources:` (memory, cpus, pids). `taken` where it enforces them (job cgroups), or where
/// its operator allowed them unenforced (`--allow-unenforced-limits`, said in each such job's
/// log); `refused` otherwise, so such a step waits, with the reason, rather than run without
/// the limits it asked for.
pub const RESOURCES_TAG: &str = "gpuci.resources";

/// What one log line counts against a job's log cap besides its text: about what storing it
/// takes (its row in the database: job, number, time, stream, index), so that a job printing
/// tiny lines cannot store many times its cap.
pub const LOG_LINE_COST: u64 = 40;

/// What a log line of `text` counts against a job's log cap.
pub fn log_line_cost(text: &str) -> u64 {
    text.len() as u64 + LOG_LINE_COST
}

/// Body of `POST /api/v1/agents/register` (authorised by the registration token).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RegisterRequest {
    pub name: String,
}

/// The agent's own credential; shown once, stored by the agent (mode 0600).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RegisterResponse {
    pub agent_id: String,
    pub credential: String,
}

/// A GPU's health as the agent last checked it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum GpuHealth {
    Healthy,
    Unhealthy { reason: String },
}

/// What the agent is and has. Sent first on every connection.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u32,
    pub agent_version: String,
    pub name: String,
    pub hostname: String,
    pub slots: u32,
    pub tags: BTreeMap<String, String>,
    pub gpus: Vec<GpuInfo>,
    /// Where the GPU facts came from: `nvml`, `nvidia-smi`, `simulated`, `none: <why>`.
    pub gpu_backend: String,
    /// Which job isolation this agent applies: `bubblewrap`, `none`.
    pub isolation: String,
    pub container_runtime: Option<String>,
    /// Every job this agent holds: assigned to it and recorded in its journal, whose result
    /// the coordinator has not acknowledged yet (running, finished, or died with an earlier
    /// run of the agent). A job assigned to the agent and not in this list was never
    /// received: the agent journals an assignment before it starts anything — unless
    /// `journal_incomplete` says the journal may lack records.
    pub running: Vec<JobId>,
    /// Why the agent's journal may lack records (a torn end after a crash, or an operator's
    /// reset of a damaged journal). Then a job assigned to the agent and not in `running`
    /// may have been received and started: it is lost, not handed out again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal_incomplete: Option<String>,
    /// Why the agent takes no new jobs now, though it has slots (its disk is nearly full);
    /// `None`: it takes them. Changes during a connection come as [`AgentMessage::Paused`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<String>,
    /// The machine is being taken back (a spot interruption notice), in the provider's words;
    /// later notices come as [`AgentMessage::Interrupted`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<String>,
    /// When the agent's machine ends by itself (unix ms): the end of its Slurm allocation.
    /// The coordinator gives it no job whose timeout reaches past that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends_at_ms: Option<i64>,
    /// Why the agent takes no jobs at all (it then says `slots: 0`): it cannot give them what
    /// it promises (no working sandbox, no disk quota), with the fix. Every job that waits for
    /// it is told this, never that it is busy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refuses: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentMessage {
    /// The machine is being taken back (a cloud's spot interruption notice): the agent takes no
    /// new job; the coordinator puts the jobs it runs back in the queue, once.
    Interrupted {
        reason: String,
    },
    Hello(Box<Hello>),
    Heartbeat,
    /// A job event, numbered by the agent (`n` increases by one per event within one run of
    /// the agent). Re-sent after a reconnect until an `Acked` covers it.
    Event {
        n: u64,
        event: JobEvent,
    },
    /// The agent stops taking new jobs, saying why (`Some`: its disk is nearly full), or
    /// takes them again (`None`). Jobs it runs go on either way.
    Paused {
        reason: Option<String>,
    },
    /// Running jobs' GPU samples since the last such message (dashboards, `/metrics`).
    Telemetry {
        samples: Vec<LiveSample>,
    },
    /// The agent's GPU inventory or health changed.
    Gpus {
        gpus: Vec<GpuInfo>,
        health: BTreeMap<String, GpuHealth>,
    },
}

/// What happened to a job, in the order it happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobEvent {
    Started {
        job_id: JobId,
        pid: u32,
        started_at_us: i64,
        /// The protections the agent did not enforce for this job (empty: all of them). Absent
        /// from an agent older than this field: read as empty.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        unenforced: Vec<Unenforced>,
    },
    /// Consecutive lines of the job's log: the first is line `first_seq` (from 1), the next
    /// `first_seq + 1`, and so on. A gap before `first_seq` is explained by a gpuci line in
    /// it (the agent dropped lines while the coordinator was unreachable).
    Log {
        job_id: JobId,
        first_seq: u64,
        lines: Vec<LogChunk>,
    },
    Finished(JobFinished),
}

impl JobEvent {
    pub fn job_id(&self) -> JobId {
        match self {
            JobEvent::Started { job_id, .. } | JobEvent::Log { job_id, .. } => *job_id,
            JobEvent::Finished(f) => f.job_id,
        }
    }
}

/// A protection an agent did not enforce for one job, because its operator opted out of it
/// (`--allow-unenforced-limits`, `--allow-unsandboxed`, `--job-disk none`, `--job-network host`,
/// `--allow-metadata-trusted`) or because an agent that is not root cannot give it. The agent
/// decides the list when the job starts (`gpuci_agent::unenforced`), says each item in the
/// job's log, and sends the list with the start; `gpuci jobs show`, the API and the job page
/// show it ("no silent loss of protection").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Unenforced {
    /// Which protection.
    pub key: Protection,
    /// What the job went without and why, in one sentence naming the operator's flag.
    pub detail: String,
}

/// The protections a job can go without (the stable `key` of [`Unenforced`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Protection {
    /// Memory, CPU and process limits (the step's `resources:` or the agent's defaults).
    Limits,
    /// The bubblewrap sandbox: the job ran on the host's file system.
    Sandbox,
    /// A disk of the job's slot's own: the job shares the agent's disk.
    DiskQuota,
    /// A network namespace of the job's own: the job is on the host's network.
    NetworkIsolation,
    /// Cloud metadata endpoints refused: the job could reach them.
    Metadata,
    /// A key this build does not know (sent by a newer agent); the detail says what it is.
    #[serde(other)]
    Other,
}

impl Protection {
    /// The key as the wire, the store and `gpuci jobs show` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protection::Limits => "limits",
            Protection::Sandbox => "sandbox",
            Protection::DiskQuota => "disk_quota",
            Protection::NetworkIsolation => "network_isolation",
            Protection::Metadata => "metadata",
            Protection::Other => "other",
        }
    }
}

impl std::fmt::Display for Protection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
    /// Lines written by gpuci itself about the job (sandbox, GPU checks).
    System,
}

/// One line of output with the time it was read (µs since the epoch).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogChunk {
    pub ts_us: i64,
    pub stream: Stream,
    pub text: String,
}

/// GPU use over a job's life.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobTelemetry {
    pub peak_memory_bytes: u64,
    pub mean_utilization_pct: f64,
    pub gpu_seconds: f64,
    pub samples: u64,
    /// Utilisation and memory over the job's run, at most [`MAX_SERIES_POINTS`] points
    /// (samples averaged into equal spans of time), for charts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub series: Vec<TelemetryPoint>,
}

/// The most points a job's telemetry series keeps.
pub const MAX_SERIES_POINTS: usize = 240;

/// One point of a job's GPU use: all its GPUs together.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TelemetryPoint {
    /// Seconds since the job's process started.
    pub t_s: f64,
    /// Mean utilisation of the job's GPUs, percent.
    pub utilization_pct: f64,
    /// Memory used on the job's GPUs together.
    pub memory_bytes: u64,
    /// Power drawn by the job's GPUs together, where the driver says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_watts: Option<f64>,
}

/// One GPU's sample while a job runs, sent live (not journaled: a lost one is a gap).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LiveSample {
    pub job_id: JobId,
    pub gpu_uuid: String,
    /// Seconds since the job's process started.
    pub t_s: f64,
    pub utilization_pct: Option<u32>,
    pub memory_bytes: u64,
    pub power_watts: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobFinished {
    pub job_id: JobId,
    pub outcome: Outcome,
    pub finished_at_us: i64,
    /// When its process started, if it did: a result also records the start it followed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_us: Option<i64>,
    /// The number of the job's last log line the agent numbered. Lines the coordinator does not have
    /// by the time it gets the result were lost with the agent (it died before sending them),
    /// and the log says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lines: Option<u64>,
    #[serde(default)]
    pub telemetry: Option<JobTelemetry>,
    /// Post-job GPU check per leased GPU.
    #[serde(default)]
    pub gpu_health: BTreeMap<String, GpuHealth>,
}

/// What the coordinator decided about a job the agent asked about.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Forgotten {
    pub job_id: JobId,
    pub reason: String,
}

/// Everything the agent needs to run a job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Assignment {
    pub job_id: JobId,
    pub pipeline_id: i64,
    pub name: String,
    pub step: gpuci_core::pipeline::Step,
    /// Environment after merging pipeline env, step env and gpuci's own variables.
    pub env: BTreeMap<String, String>,
    /// Leased GPU UUIDs; nothing else is visible to the job.
    pub gpus: Vec<String>,
    /// Values of the step's `secrets:`, given to the job as environment variables and masked
    /// in its output.
    #[serde(default)]
    pub secrets: SecretValues,
    /// The id (sha256 hex) of the upload (`GET /api/v1/uploads/{id}`, a gzip'ed tar) the job's
    /// workspace starts from; none: an empty workspace.
    #[serde(default)]
    pub workspace_upload: Option<String>,
    /// Which caches of the step's `cache:` paths the job starts from and where it saves its
    /// own, decided by the pipeline's origin (`gpuci_core::cache::scope`); empty: no cache.
    /// (An older coordinator's `cache_key`, one trusted cache per repository, is ignored:
    /// such a job runs without a cache rather than share one across trust classes.)
    #[serde(default, skip_serializing_if = "gpuci_core::cache::CacheScope::is_none")]
    pub cache: gpuci_core::cache::CacheScope,
    /// Actions runner jobs: the runner's install directory on the agent's host. The job sees
    /// it at `$GPUCI_RUNNER_DIR` (`<workspace>/runner`): its files read-only, the directory
    /// writable for the runner's `_diag` and `_work`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_dir: Option<String>,
    /// The job's origin may run outside the sandbox (`gpuci_core::trust`): only then does an
    /// agent started with `--allow-unsandboxed` run it so. Absent (an older coordinator):
    /// not trusted.
    #[serde(default)]
    pub trusted: bool,
    /// Whose code this is: the pipeline's repository, as the coordinator names it. The agent
    /// runs a job outside the sandbox only while no job of another repository is on the host,
    /// and no job of another repository beside one that runs outside it. Absent: a pipeline
    /// without a repository (all such are one tenant, the token holders'), or an older
    /// coordinator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    /// Number of the job's first log line from this run. Above 1 when its log already has
    /// lines (a job requeued after a failed GPU check keeps its id and its log): new lines are
    /// numbered after them, so none is taken for a resend of an earlier one.
    #[serde(default = "first_line")]
    pub log_from: u64,
}

fn first_line() -> u64 {
    1
}

/// Secret values by name. Debug output shows names only.
#[derive(Clone, Default, Serialize, Deserialize)]
pub struct SecretValues(pub BTreeMap<String, String>);

impl std::fmt::Debug for SecretValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys().map(|k| format!("{k}=***"))).finish()
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CoordinatorMessage {
    Welcome {
        agent_id: String,
        heartbeat_interval_ms: u64,
        /// Jobs the agent reported that the coordinator has already ended, and why.
        forget: Vec<Forgotten>,
    },
    Assign(Box<Assignment>),
    Cancel {
        job_id: JobId,
        reason: String,
    },
    /// Every event numbered up to `upto` on this connection's agent run has taken effect
    /// and is committed; the agent may drop them.
    Acked {
        upto: u64,
    },
    /// The connection is refused; the agent should not retry without a change.
    Refused {
        reason: String,
    },
    /// An operator returned this GPU to service: take its current counters as the baseline.
    GpuReleased {
        uuid: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Old and new agents and coordinators interoperate: a start without the list reads as
    /// "nothing unenforced", an empty list is not sent, and a key this build does not know
    /// still reads (as `other`, its sentence kept) instead of failing the whole event.
    #[test]
    fn a_start_reads_with_and_without_the_unenforced_list() {
        let old = r#"{"kind":"started","job_id":3,"pid":9,"started_at_us":5}"#;
        let JobEvent::Started { unenforced, .. } = serde_json::from_str(old).unwrap() else { panic!("not a start") };
        assert!(unenforced.is_empty());
        let none = JobEvent::Started { job_id: 3, pid: 9, started_at_us: 5, unenforced: vec![] };
        assert_eq!(serde_json::to_string(&none).unwrap(), old);

        let new = r#"{"kind":"started","job_id":3,"pid":9,"started_at_us":5,"unenforced":[
            {"key":"disk_quota","detail":"no disk quota"},{"key":"tpm","detail":"no TPM"}]}"#;
        let JobEvent::Started { unenforced, .. } = serde_json::from_str(new).unwrap() else { panic!("not a start") };
        assert_eq!(
            unenforced,
            vec![
                Unenforced { key: Protection::DiskQuota, detail: "no disk quota".into() },
                Unenforced { key: Protection::Other, detail: "no TPM".into() },
            ]
        );
        let keys = [
            Protection::Limits,
            Protection::Sandbox,
            Protection::DiskQuota,
            Protection::NetworkIsolation,
            Protection::Metadata,
            Protection::Other,
        ];
        for k in keys {
            assert_eq!(serde_json::to_value(k).unwrap(), serde_json::Value::from(k.as_str()));
        }
    }
}
