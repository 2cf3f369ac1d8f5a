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

mod artifacts;
mod assign_batch;
pub mod compat;
mod coordinator_identity;
mod coordinator_state;
mod github_replay;
mod job_tokens;
mod postgres;
mod records;
mod rows;
mod sealing;
mod sqlite;
mod submissions;
mod update_batch;

pub use artifacts::{ArtifactRecord, TestReportRecord};
pub use coordinator_identity::StoredIdentity;
pub use github_replay::{DeliverySeen, NewDelivery, Pruned};
pub use job_tokens::JobTokenRecord;
pub use postgres::{redact_url, Claim, DbTls, DbTlsVerdict, PostgresStore, SoleUseHeld, IDLE_IN_TRANSACTION};
pub use records::*;
pub use sealing::{seal_plaintext_secrets, sealed_with, SealError, SecretsAtRest, SecretsKey, KEY_LEN};
pub use sqlite::SqliteStore;
pub use submissions::{Created, Submission};

use async_trait::async_trait;
use gpuci_core::job::JobState;
use gpuci_protocol::agent::LogChunk;
use gpuci_protocol::api::LogLine;
use gpuci_protocol::{JobId, PipelineId};

/// Database errors print the database's own words once: a `StoreError` never exposes the
/// `sqlx` error as its source, because `sqlx`'s own `Display` already includes its inner
/// error, and a chain printer (`{:#}`) would repeat the same sentence at every layer.
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
    #[error("database: {}", describe(.0))]
    Db(sqlx::Error),
    #[error("migration: {0}")]
    Migrate(sqlx::migrate::MigrateError),
    /// [`SqliteStore::open_existing`](crate::SqliteStore::open_existing) found a database
    /// without gpuci's tables.
    #[error("it holds no gpuci tables ({})", if .0.is_empty() { "it has no tables at all".to_string() } else { format!("its tables: {}", .0.join(", ")) })]
    NotGpuci(Vec<String>),
    /// The database was migrated by a newer gpuci past what this one can run on.
    #[error("{0}")]
    TooOld(compat::TooOld),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::Db(e)
    }
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        match e {
            // A database error while migrating is a database error (a full disk, a damaged
            // file), and is classified like one.
            sqlx::migrate::MigrateError::Execute(e) => StoreError::Db(e),
            e => StoreError::Migrate(e),
        }
    }
}

/// Which database answered and its code for the failure: SQLite's extended result code, or
/// Postgres's SQLSTATE.
enum DbCode<'a> {
    Sqlite(i32),
    Postgres(&'a str),
}

fn db_code(e: &sqlx::Error) -> Option<(DbCode<'_>, &str)> {
    let d = e.as_database_error()?;
    if let Some(pg) = d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        return Some((DbCode::Postgres(pg.code()), pg.message()));
    }
    let code = d.code()?.parse().ok()?;
    Some((DbCode::Sqlite(code), d.message()))
}

/// The SQLSTATE of a write refused by fencing (`migrations/postgres/0013_fencing.sql`).
const FENCED: &str = "GF001";

// SQLite primary result codes (the low byte of an extended one).
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_NOMEM: i32 = 7;
const SQLITE_READONLY: i32 = 8;
const SQLITE_IOERR: i32 = 10;
const SQLITE_CORRUPT: i32 = 11;
const SQLITE_FULL: i32 = 13;
const SQLITE_CANTOPEN: i32 = 14;
const SQLITE_NOTADB: i32 = 26;

fn describe(e: &sqlx::Error) -> String {
    match db_code(e) {
        Some((DbCode::Sqlite(code), msg)) => format!("{msg} (SQLite code {code})"),
        Some((DbCode::Postgres(code), msg)) => format!("{msg} (SQLSTATE {code})"),
        None => e.to_string(),
    }
}

impl StoreError {
    /// Whether retrying the same call may succeed (locks, I/O hiccups, Postgres serialization
    /// failures and deadlocks).
    pub fn is_transient(&self) -> bool {
        let StoreError::Db(e) = self else { return false };
        if matches!(e, sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) {
            return true;
        }
        match db_code(e) {
            Some((DbCode::Sqlite(code), _)) => matches!(code & 0xff, SQLITE_BUSY | SQLITE_LOCKED),
            // 40001 serialization_failure, 40P01 deadlock_detected, 55P03 lock_not_available.
            Some((DbCode::Postgres(code), _)) => matches!(code, "40001" | "40P01" | "55P03"),
            None => false,
        }
    }

    /// Whether the database could not do this now through no fault of the request: a full
    /// disk, an I/O error, no memory, a read-only or unreachable database, a server shutting
    /// down, a lock not given up in time. Nothing was stored; the caller answers "try again
    /// later" (HTTP 503) and may retry. A damaged database ([`StoreError::is_damaged`]) is
    /// not one: waiting does not mend it.
    pub fn is_unavailable(&self) -> bool {
        let StoreError::Db(e) = self else { return false };
        match e {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => return true,
            _ => {}
        }
        match db_code(e) {
            Some((DbCode::Sqlite(code), _)) => matches!(
                code & 0xff,
                SQLITE_BUSY
                    | SQLITE_LOCKED
                    | SQLITE_NOMEM
                    | SQLITE_READONLY
                    | SQLITE_IOERR
                    | SQLITE_FULL
                    | SQLITE_CANTOPEN
            ),
            // Classes 08 connection exception, 53 insufficient resources (53100 disk_full),
            // 57P0x the server shutting down or starting, 58 system error (58030 io_error);
            // 25006 a read-only (standby) server; serialization failures and deadlocks.
            Some((DbCode::Postgres(code), _)) => {
                code.starts_with("08")
                    || code.starts_with("53")
                    || code.starts_with("57P")
                    || code.starts_with("58")
                    || matches!(code, "25006" | "40001" | "40P01" | "55P03")
            }
            None => false,
        }
    }

    /// Whether the database refused a write because this coordinator no longer leads it:
    /// another claimed it since this store was [fenced](crate::PostgresStore::fence). Nothing
    /// was written; retrying cannot help, and the coordinator must stop.
    pub fn is_fenced(&self) -> bool {
        matches!(self, StoreError::Db(e) if matches!(db_code(e), Some((DbCode::Postgres(FENCED), _))))
    }

    /// Whether the stored data cannot be read as a gpuci database: a damaged file, a file
    /// that is not a database, rows that do not decode.
    pub fn is_damaged(&self) -> bool {
        match self {
            StoreError::Corrupt(_) => true,
            StoreError::Db(e) => {
                matches!(db_code(e), Some((DbCode::Sqlite(code), _)) if matches!(code & 0xff, SQLITE_CORRUPT | SQLITE_NOTADB))
                    // Postgres: XX001 data_corrupted, XX002 index_corrupted.
                    || matches!(db_code(e), Some((DbCode::Postgres("XX001" | "XX002"), _)))
            }
            _ => false,
        }
    }

    /// What went wrong in the database's own words (`database or disk is full`), without
    /// codes: for a person, after what the caller was doing.
    pub fn reason(&self) -> String {
        match self {
            StoreError::Db(e) => match db_code(e) {
                Some((_, msg)) => msg.to_string(),
                None => e.to_string(),
            },
            e => e.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

impl StoreError {
    /// Whether this error refuses one item of a batch ([`Store::assign_jobs`],
    /// [`Store::update_jobs`]) rather than the whole transaction: the item's own state
    /// was not what it needed, and the database itself is fine.
    fn refuses_only_the_item(&self) -> bool {
        matches!(self, StoreError::Conflict { .. } | StoreError::GpuLeased { .. } | StoreError::JobNotFound(_))
    }
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Create a pipeline and all its jobs (queued) in one transaction.
    async fn create_pipeline(&self, p: NewPipeline, jobs: Vec<NewJob>) -> Result<(PipelineRecord, Vec<JobRecord>)>;
    /// [`Store::create_pipeline`], once per `once.key`: a key recorded before (with the
    /// pipeline, in the same transaction) creates nothing and answers the pipeline it made.
    async fn create_pipeline_once(&self, p: NewPipeline, jobs: Vec<NewJob>, once: &Submission) -> Result<Created>;
    /// Add one job to an existing pipeline (a retry).
    async fn insert_job(&self, job: NewJob) -> Result<JobRecord>;
    /// queued → assigned, taking the GPU leases in the same transaction.
    async fn assign_job(&self, id: JobId, agent_id: &str, gpus: &[String], now_ms: i64) -> Result<JobRecord>;
    /// Group commit of a placement pass: [`Store::assign_job`] for each of `batch`, all in ONE
    /// transaction (one fsync for the pass, not one per job). `Err`: nothing was stored (the
    /// database failed, or this store was fenced); the caller sends no assignment and the jobs
    /// stay queued. `Ok`: one answer per assignment, in order: `Ok(())`, the job's record now
    /// [`NewAssignment::applied_to`] the queued one (no record is read back), or why that
    /// one was refused ([`StoreError::Conflict`]: no longer queued; [`StoreError::GpuLeased`];
    /// [`StoreError::JobNotFound`]), which stored nothing of it and did not hold back the others.
    /// An assignment's `token_sha256` is stored with it (as [`Store::put_job_tokens`] would),
    /// so exactly when it is; a batch with tokens also deletes ended jobs' token rows.
    async fn assign_jobs(&self, batch: &[NewAssignment], now_ms: i64) -> Result<Vec<Result<()>>>;
    /// Group commit of agents' events: [`Store::update_job`] for each of `batch` in ONE
    /// transaction, with the same all-or-nothing and per-item answers as
    /// [`Store::assign_jobs`] (a [`StoreError::Conflict`] or [`StoreError::JobNotFound`]
    /// refuses only its own change). An accepted change's job is now
    /// [`JobChange::applied_to`] its record before (no record is read back).
    async fn update_jobs(&self, batch: &[JobUpdate]) -> Result<Vec<Result<()>>>;
    /// [`Store::set_reason`] for many queued jobs in one transaction (why each waits,
    /// written once per placement pass rather than once per job). A job no longer queued
    /// keeps its reason: a reason decided before its assignment or end never overwrites it.
    async fn set_reasons(&self, reasons: &[(JobId, String)]) -> Result<()>;
    /// Move a job to another state if it is currently in one of `expect`; optionally release
    /// its GPU leases and quarantine GPUs, all in one transaction.
    async fn update_job(&self, id: JobId, expect: &[JobState], change: JobChange) -> Result<JobRecord>;
    /// [`Store::update_job`] and, in the same transaction, insert `then` (a job's retry): a
    /// job never ends without the retry its policy asked for, even when the second write fails.
    async fn update_job_and_insert(
        &self,
        id: JobId,
        expect: &[JobState],
        change: JobChange,
        then: NewJob,
    ) -> Result<(JobRecord, JobRecord)>;
    /// Change a job's reason without changing its state (why a queued job waits).
    async fn set_reason(&self, id: JobId, reason: &str) -> Result<()>;
    async fn get_job(&self, id: JobId) -> Result<Option<JobRecord>>;
    async fn list_jobs(&self, filter: &JobFilter) -> Result<Vec<JobRecord>>;
    /// Jobs that started and were still running at or after `since_ms` (for cost reports).
    async fn jobs_ran_since(&self, since_ms: i64) -> Result<Vec<JobRecord>>;
    /// Every job not in a terminal state, oldest first.
    async fn active_jobs(&self) -> Result<Vec<JobRecord>>;
    async fn pipeline_jobs(&self, pipeline: PipelineId) -> Result<Vec<JobRecord>>;
    async fn get_pipeline(&self, id: PipelineId) -> Result<Option<PipelineRecord>>;
    async fn list_pipelines(&self, limit: u32) -> Result<Vec<PipelineRecord>>;
    /// The pipelines that name any of these workspace uploads, each with how many of its jobs
    /// may still run (queued, assigned, running) and its last activity (its creation, a job's
    /// creation or end): what upload garbage collection decides on
    /// (`gpuci_core::uploads::decide`). Ids no pipeline names are left out.
    async fn upload_uses(&self, uploads: &[String]) -> Result<Vec<gpuci_core::uploads::PipelineUse>>;
    /// Where each of these pipelines came from: `(repository, origin JSON)` by id (unknown
    /// ids are left out).
    async fn pipeline_origins(
        &self,
        ids: &[PipelineId],
    ) -> Result<std::collections::HashMap<PipelineId, (Option<String>, Option<String>)>>;
    /// Pipelines newest first, those with an id below `before` when given: a page of the
    /// builds list.
    async fn pipelines_before(&self, before: Option<PipelineId>, limit: u32) -> Result<Vec<PipelineRecord>>;
    /// Every job (every attempt) of these pipelines, by id.
    async fn jobs_of_pipelines(&self, ids: &[PipelineId]) -> Result<Vec<JobRecord>>;
    /// Record what a pipeline builds (JSON of `BuildFacts`, as the builds list shows it);
    /// a second call replaces the first.
    async fn put_pipeline_build(&self, pipeline: PipelineId, facts: &str) -> Result<()>;
    /// What these pipelines build, by id (those without a record are left out).
    async fn pipeline_builds(&self, ids: &[PipelineId]) -> Result<std::collections::HashMap<PipelineId, String>>;

    /// Store lines of a job's log. `first_seq`: the writer numbered them (the agent: line
    /// `first_seq + i`), and any already stored (seq not above the highest stored) is skipped,
    /// so a resend stores nothing twice; a number past the highest + 1 leaves a gap, which
    /// the writer explains with a line of its own. `None`: numbered after the highest stored.
    /// Numbered lines of a job that has ended are not stored: the agent sends a job's lines
    /// before its result, so these come from an agent the job was taken from (declared lost
    /// while cut off); the coordinator has ended its log with a line of its own, numbered
    /// after the last stored, and later lines would be misread as resends of it.
    /// Returns the lines stored.
    async fn append_logs(&self, job: JobId, first_seq: Option<i64>, lines: &[LogChunk]) -> Result<Vec<LogLine>>;
    async fn read_logs(&self, job: JobId, after_seq: i64, limit: u32) -> Result<Vec<LogLine>>;
    /// A job's stored log: what it counts against the job's log cap (its text plus
    /// [`LOG_LINE_COST`](gpuci_protocol::agent::LOG_LINE_COST) per line) and its highest line
    /// number (0: none).
    async fn log_extent(&self, job: JobId) -> Result<(u64, i64)>;
    /// The highest line number of each job's stored log (jobs with none are left out): where
    /// a placed job's next run numbers its lines from, read for a whole placement pass at once.
    async fn last_log_lines(&self, jobs: &[JobId]) -> Result<std::collections::HashMap<JobId, i64>>;

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
    /// [`Store::set_secret`] and its audit entry, in one transaction: a value is never
    /// replaced without the record of who replaced it.
    async fn set_secret_audited(&self, name: &str, value: &str, now_ms: i64, audit: &NewAudit) -> Result<()>;
    /// [`Store::delete_secret`] and, when a row was deleted, its audit entry, in one
    /// transaction. False (and no entry) if there was no such secret.
    async fn delete_secret_audited(&self, name: &str, audit: &NewAudit) -> Result<bool>;

    // The audit log.
    /// Append an entry of its own (an action whose change is not in this database, or did not
    /// happen); returns it as stored.
    async fn append_audit(&self, entry: &NewAudit) -> Result<AuditRecord>;
    /// Entries that pass the filter, newest first.
    async fn audit_log(&self, filter: &AuditFilter) -> Result<Vec<AuditRecord>>;

    // Named API tokens.
    /// Store a new token and its audit entry in one transaction; false (and no entry) when
    /// the name was ever used.
    async fn create_api_token(&self, token: &ApiTokenRecord, audit: &NewAudit) -> Result<bool>;
    /// Revoke a live token and record it in one transaction; false (and no entry) when no
    /// live token has that name.
    async fn revoke_api_token(&self, name: &str, now_ms: i64, audit: &NewAudit) -> Result<bool>;
    /// Every token, revoked ones included, by name.
    async fn api_tokens(&self) -> Result<Vec<ApiTokenRecord>>;
    /// The live (not revoked) token with this hash.
    async fn live_api_token(&self, hash: &str) -> Result<Option<ApiTokenRecord>>;

    // GitHub integration.
    /// Remember a webhook delivery; false when it was already recorded (a redelivery).
    async fn record_delivery(&self, delivery: &str, event: &str, now_ms: i64) -> Result<bool>;
    /// Record a webhook delivery (as [`Store::record_delivery`]) and keep its body for the
    /// leader to act on, in one transaction; false when it was already recorded.
    async fn queue_delivery(&self, delivery: &str, event: &str, body: &[u8], now_ms: i64) -> Result<bool>;
    /// Take (delete and answer) up to `limit` queued deliveries, oldest first.
    async fn take_queued_deliveries(&self, limit: u32) -> Result<Vec<QueuedDelivery>>;
    /// Remember a webhook delivery and, with `body_sha256`, its body (`github_replay.rs`): a
    /// new delivery id with a body recorded before is a replay, and nothing is recorded.
    async fn record_delivery_once(&self, d: &NewDelivery<'_>) -> Result<DeliverySeen>;
    /// As [`Store::record_delivery_once`], and keep `body` for the leader (as
    /// [`Store::queue_delivery`]) in the same transaction when it is new.
    async fn queue_delivery_once(&self, d: &NewDelivery<'_>, body: &[u8]) -> Result<DeliverySeen>;
    /// Forget deliveries, recorded bodies and workflow job tombstones older than `before_ms`.
    async fn prune_github_records(&self, before_ms: i64) -> Result<Pruned>;
    /// Remember that GitHub said workflow job `job_id` was `action` (`in_progress`,
    /// `completed`) before gpuci knew it; the first word is kept.
    async fn put_github_tombstone(&self, job_id: i64, action: &str, now_ms: i64) -> Result<()>;
    /// What GitHub said of workflow job `job_id` before gpuci knew it, if anything.
    async fn github_tombstone(&self, job_id: i64) -> Result<Option<String>>;
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
    /// Store an approval and, in the same transaction, its audit entry (actor: the GitHub
    /// login that approved): every approval that can give a job secrets is on the record.
    async fn put_approval(&self, approval: &ApprovalRecord) -> Result<()>;
    async fn get_approval(&self, repository: &str, pr: i64, head_sha: &str) -> Result<Option<ApprovalRecord>>;
    async fn set_check_run(&self, job: JobId, check_run_id: i64) -> Result<()>;
    async fn get_check_run(&self, job: JobId) -> Result<Option<i64>>;

    // Schedules.
    /// When a coordinator last looked at the schedule, recording `now_ms` when it is new.
    async fn arm_schedule(&self, name: &str, now_ms: i64) -> Result<i64>;
    /// Record that the schedule was looked at `now_ms` (fired or not, enabled or not).
    async fn schedule_checked(&self, name: &str, now_ms: i64) -> Result<()>;
    /// When any schedule was last looked at: the last pass of the coordinator that ran before.
    async fn schedules_last_checked(&self) -> Result<Option<i64>>;
    /// Record a fire (its `id`, `pipeline_id` and `error` are ignored) before submitting it;
    /// `None` when this occurrence was recorded already (it must not fire again).
    async fn record_schedule_fire(&self, fire: &ScheduleFireRecord) -> Result<Option<i64>>;
    /// Set what became of a fire: its pipeline, or why there is none.
    async fn finish_schedule_fire(&self, id: i64, pipeline: Option<PipelineId>, error: Option<&str>) -> Result<()>;
    /// Fires cut short by a stop (neither pipeline nor error) get `error`; how many.
    async fn interrupt_schedule_fires(&self, error: &str) -> Result<u64>;
    /// The occurrence of the latest `cron` fire of the schedule.
    async fn last_cron_fire(&self, name: &str) -> Result<Option<i64>>;
    /// The schedule's fires (every schedule's when `None`), newest first.
    async fn schedule_fires(&self, name: Option<&str>, limit: u32) -> Result<Vec<ScheduleFireRecord>>;

    // Fleets.
    /// Insert or replace a machine's row.
    async fn put_machine(&self, machine: &MachineRecord) -> Result<()>;
    /// Machines not yet `ended` when `active_only`, else all; oldest first.
    async fn machines(&self, active_only: bool) -> Result<Vec<MachineRecord>>;
    /// Start billing `machine` at `from_ms`, unless a stretch is open already.
    async fn open_billing(&self, machine: &str, from_ms: i64) -> Result<()>;
    /// End the open billing stretch of `machine` at `to_ms`, if there is one.
    async fn close_billing(&self, machine: &str, to_ms: i64) -> Result<()>;
    /// Billing stretches that were open at or after `since_ms`.
    async fn billing_since(&self, since_ms: i64) -> Result<Vec<BillingInterval>>;

    // Artifacts (`artifacts.rs`).
    /// Record an artifact; one of the same job and path is replaced.
    async fn put_artifact(&self, a: &ArtifactRecord) -> Result<()>;
    /// A job's artifacts, by path.
    async fn job_artifacts(&self, job: JobId) -> Result<Vec<ArtifactRecord>>;
    /// Every artifact, oldest first (for retention).
    async fn all_artifacts(&self) -> Result<Vec<ArtifactRecord>>;
    /// Bytes of all artifacts of `repository` (`None`: of jobs with no repository) uploaded by
    /// its untrusted jobs (`untrusted`), or by its trusted ones.
    async fn repository_artifact_bytes(&self, repository: Option<&str>, untrusted: bool) -> Result<u64>;
    /// Forget these artifacts (job, path), in one transaction.
    async fn delete_artifacts(&self, keys: &[(JobId, String)]) -> Result<()>;
    /// Record the reading of a test report; one of the same job and path is replaced.
    async fn put_test_report(&self, r: &TestReportRecord) -> Result<()>;
    /// A job's test reports, by path.
    async fn job_test_reports(&self, job: JobId) -> Result<Vec<TestReportRecord>>;

    // Dynamic steps (`gpuci pipeline upload`).
    /// Store the sha256 of each job's token for adding steps (`(job, sha256)`; replacing an
    /// earlier one of the job, its upload count kept), in one commit; rows of jobs that have
    /// ended are deleted in the same commit. A placement pass stores its tokens with its
    /// assignments instead ([`NewAssignment::token_sha256`]).
    async fn put_job_tokens(&self, tokens: &[(JobId, String)], now_ms: i64) -> Result<()>;
    /// The job's token row, if it has one.
    async fn job_token(&self, job: JobId) -> Result<Option<JobTokenRecord>>;
    /// Forget the job's token (the job ended).
    async fn delete_job_token(&self, job: JobId) -> Result<()>;
    /// Count an upload of `job` that added nothing (a bad file): refused uploads use up the
    /// job's uploads too, so a flood of them ends at the cap.
    async fn count_failed_upload(&self, job: JobId) -> Result<()>;

    // The installation's identity key.
    /// The stored identity; when there is none yet, `new` is stored first (the first
    /// coordinator of a database makes it; a concurrent one reads the winner's).
    async fn coordinator_identity(&self, new: &StoredIdentity, now_ms: i64) -> Result<StoredIdentity>;
    /// The stored identity, if a coordinator has made it; never writes (a standby's read).
    async fn stored_identity(&self) -> Result<Option<StoredIdentity>>;

    // What the coordinator's loops keep across restarts and takeovers.
    /// The document kept under `name`, if any.
    async fn coordinator_state(&self, name: &str) -> Result<Option<String>>;
    /// Keep `json` under `name`, replacing what was kept.
    async fn put_coordinator_state(&self, name: &str, json: &str, now_ms: i64) -> Result<()>;
    /// One upload of job `by`: `jobs` added (to the pipelines they name) and the job's upload
    /// count raised, in one commit. `None`, and nothing added, when the job has no token row
    /// or has made `max_uploads` already.
    async fn add_uploaded_jobs(&self, by: JobId, jobs: Vec<NewJob>, max_uploads: u32)
        -> Result<Option<Vec<JobRecord>>>;
}
