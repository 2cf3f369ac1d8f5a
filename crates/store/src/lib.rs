//! gpuci-store: everything gpuci must not forget — pipelines, jobs, logs, agents, GPU leases
//! and quarantines — behind the [`Store`] trait.
//!
//! Two backends implement it: [`SqliteStore`] (WAL, `synchronous=FULL`), the embedded default,
//! and [`PostgresStore`] (`synchronous_commit=on`, row locks and constraints instead of a single
//! writer) for when several coordinators share the load. The same test suite runs against both,
//! Postgres as a real throwaway server. Migrations live in files under `migrations/sqlite/` and
//! `migrations/postgres/`; the two schemas must end up the same.
//!
//! Rules: a write returns only once it is durable, so callers may acknowledge or push after
//! it. State transitions are compare-and-set on the expected current state, so a stale writer
//! cannot move a job backwards. This crate makes no decisions: it stores what the coordinator
//! decided.
//!
//! Secret values are stored sealed (ChaCha20-Poly1305, see `sealing.rs`) under a key the
//! database never holds; the coordinator keeps the key, seals and opens.

mod postgres;
mod records;
mod rows;
mod sealing;
mod sqlite;

pub use postgres::{redact_url, PostgresStore};
pub use records::*;
pub use sealing::{seal_plaintext_secrets, sealed_with, SealError, SecretsAtRest, SecretsKey, KEY_LEN};
pub use sqlite::SqliteStore;

use async_trait::async_trait;
use gpuci_core::job::JobState;
use gpuci_protocol::agent::LogChunk;
use gpuci_protocol::api::LogLine;
use gpuci_protocol::{JobId, PipelineId};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("job {job}: expected state {expected}, found {found}")]
    Conflict { job: JobId, expected: String, found: JobState },
    #[error("job {0} not found")]
    JobNotFound(JobId),
    #[error("GPU {gpu} is already leased to job {holder}")]
    GpuLeased { gpu: String, holder: JobId },
    #[error("agent {0} not found")]
    AgentNotFound(String),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl StoreError {
    /// Whether retrying the same call may succeed (locks, I/O hiccups, Postgres serialization
    /// failures and deadlocks).
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Db(e) => {
                matches!(e, sqlx::Error::PoolTimedOut | sqlx::Error::Io(_))
                    || e.as_database_error().is_some_and(|d| {
                        // SQLSTATE 40001 serialization_failure, 40P01 deadlock_detected.
                        matches!(d.code().as_deref(), Some("40001" | "40P01"))
                            || d.message().contains("locked")
                            || d.message().contains("busy")
                    })
            }
            _ => false,
        }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Create a pipeline and all its jobs (queued) in one transaction.
    async fn create_pipeline(&self, p: NewPipeline, jobs: Vec<NewJob>) -> Result<(PipelineRecord, Vec<JobRecord>)>;
    /// Add one job to an existing pipeline (a retry).
    async fn insert_job(&self, job: NewJob) -> Result<JobRecord>;
    /// queued → assigned, taking the GPU leases in the same transaction.
    async fn assign_job(&self, id: JobId, agent_id: &str, gpus: &[String], now_ms: i64) -> Result<JobRecord>;
    /// Move a job to another state if it is currently in one of `expect`; optionally release
    /// its GPU leases and quarantine GPUs, all in one transaction.
    async fn update_job(&self, id: JobId, expect: &[JobState], change: JobChange) -> Result<JobRecord>;
    /// Change a job's reason without changing its state (why a queued job waits).
    async fn set_reason(&self, id: JobId, reason: &str) -> Result<()>;
    async fn get_job(&self, id: JobId) -> Result<Option<JobRecord>>;
    async fn list_jobs(&self, filter: &JobFilter) -> Result<Vec<JobRecord>>;
    /// Every job not in a terminal state, oldest first.
    async fn active_jobs(&self) -> Result<Vec<JobRecord>>;
    async fn pipeline_jobs(&self, pipeline: PipelineId) -> Result<Vec<JobRecord>>;
    async fn get_pipeline(&self, id: PipelineId) -> Result<Option<PipelineRecord>>;
    async fn list_pipelines(&self, limit: u32) -> Result<Vec<PipelineRecord>>;

    /// Store lines of a job's log. `first_seq`: the writer numbered them (the agent: line
    /// `first_seq + i`), and any already stored (seq not above the highest stored) is skipped,
    /// so a resend stores nothing twice; a number past the highest + 1 leaves a gap, which
    /// the writer explains with a line of its own. `None`: numbered after the highest stored.
    /// Returns the lines stored.
    async fn append_logs(&self, job: JobId, first_seq: Option<i64>, lines: &[LogChunk]) -> Result<Vec<LogLine>>;
    async fn read_logs(&self, job: JobId, after_seq: i64, limit: u32) -> Result<Vec<LogLine>>;
    /// A job's stored log: its size (bytes of text plus one per line, its newline) and its
    /// highest line number (0: none).
    async fn log_extent(&self, job: JobId) -> Result<(u64, i64)>;

    async fn insert_agent(&self, agent: &AgentRecord) -> Result<()>;
    async fn get_agent(&self, id: &str) -> Result<Option<AgentRecord>>;
    async fn list_agents(&self) -> Result<Vec<AgentRecord>>;
    async fn update_agent(&self, id: &str, update: AgentUpdate) -> Result<()>;

    async fn leases(&self) -> Result<Vec<Lease>>;
    async fn quarantined(&self) -> Result<Vec<Quarantine>>;
    async fn quarantine_gpu(&self, q: &Quarantine) -> Result<()>;
    /// Return a quarantined GPU to service. False if it was not quarantined.
    async fn release_quarantine(&self, gpu_uuid: &str) -> Result<bool>;

    /// Secret values are stored as given: the coordinator hands in sealed text (see
    /// [`SecretsKey::seal`]) and opens what [`Store::secret_values`] returns.
    async fn set_secret(&self, name: &str, value: &str, now_ms: i64) -> Result<()>;
    /// False if there was no such secret.
    async fn delete_secret(&self, name: &str) -> Result<bool>;
    /// Names and update times; never values.
    async fn secret_names(&self) -> Result<Vec<(String, i64)>>;
    /// Rewrite storage so content that was replaced or deleted leaves no copy in the
    /// database's files (after plain-text secrets were sealed).
    async fn purge_freed_space(&self) -> Result<()>;
    /// Stored values (sealed text) of the named secrets that exist.
    async fn secret_values(&self, names: &[String]) -> Result<std::collections::BTreeMap<String, String>>;

    // GitHub integration.
    /// Remember a webhook delivery; false when it was already recorded (a redelivery).
    async fn record_delivery(&self, delivery: &str, event: &str, now_ms: i64) -> Result<bool>;
    /// Insert a workflow job record unless one with its id exists; false when it did.
    async fn insert_github_job(&self, job: &GithubJobRecord) -> Result<bool>;
    async fn put_github_job(&self, job: &GithubJobRecord) -> Result<()>;
    async fn get_github_job(&self, id: i64) -> Result<Option<GithubJobRecord>>;
    /// Newest first; only `queued` and `in_progress` ones when `active_only`.
    async fn github_jobs(&self, active_only: bool, limit: u32) -> Result<Vec<GithubJobRecord>>;
    async fn put_runner(&self, runner: &RunnerRecord) -> Result<()>;
    async fn get_runner(&self, name: &str) -> Result<Option<RunnerRecord>>;
    /// Runners not yet `done` or `removed` when `active_only`.
    async fn runners(&self, active_only: bool) -> Result<Vec<RunnerRecord>>;
    async fn put_approval(&self, approval: &ApprovalRecord) -> Result<()>;
    async fn get_approval(&self, repository: &str, pr: i64, head_sha: &str) -> Result<Option<ApprovalRecord>>;
    async fn set_check_run(&self, job: JobId, check_run_id: i64) -> Result<()>;
    async fn get_check_run(&self, job: JobId) -> Result<Option<i64>>;
}
