//! The SQLite backend: one file in the data dir, WAL journal, `synchronous=FULL` so a commit
//! has reached the disk before the call returns. A write that fails (a full disk, an I/O
//! error) returns the error and costs the writer connection: it is replaced before the next
//! write, so no later write can return Ok without being committed (see `fit_for_next_write`).

use crate::rows::*;
use crate::*;
use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{Row, Sqlite, SqlitePool};
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

// One module per area holds that area's SQL, and the `Store` impl below forwards to it. What
// stays in this file: opening the store, jobs, pipelines, agents, leases and quarantine.
mod assign;
mod audit;
mod github;
mod logs;
mod machines;
mod schedules;
mod secrets;
use assign::{assign_in, update_job_in};
use audit::insert_audit;

crate::rows::row_mappers!(SqliteRow);

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// Runs the migrations up to `newest` that are not applied yet, after checking that a schema
/// newer than them is one this coordinator still runs on ([`crate::compat`]).
async fn migrate(pool: &SqlitePool, newest: i64) -> Result<()> {
    let m = crate::compat::migrator(&MIGRATOR, newest);
    // Errors here mean "no such table" on a new or pre-compat database.
    let applied: Option<i64> =
        sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(pool).await.ok().flatten();
    let oldest: Option<i64> = sqlx::query_scalar("SELECT oldest_reader FROM schema_compat WHERE id = 1")
        .fetch_optional(pool)
        .await
        .ok()
        .flatten();
    crate::compat::decide(applied, crate::compat::newest(&m), oldest).map_err(StoreError::TooOld)?;
    m.run(pool).await?;
    Ok(())
}

/// Writes go through one connection, reads through a small pool. SQLite allows one writer
/// at a time; a second connection that upgrades a read transaction to a write one fails with
/// SQLITE_BUSY at once (the busy timeout does not apply to that deadlock), so in-process
/// writers queue on the single writer connection instead.
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    read: SqlitePool,
    /// In memory only: a connection that does nothing but keep the database alive. An
    /// in-memory database lasts as long as its last connection, and the pool replaces its
    /// connections (one found broken after an abandoned request; sqlx's idle and lifetime
    /// limits): without this, a replaced connection meant a new, empty database.
    _anchor: Option<std::sync::Arc<std::sync::Mutex<sqlx::SqliteConnection>>>,
}

impl SqliteStore {
    /// Open (creating if needed) the database file and run pending migrations.
    ///
    /// A new file is created here with mode 0600 before SQLite opens it: SQLite creates the
    /// `-wal` and `-shm` files with the main file's mode, so all three stay private whatever
    /// the umask. `secure_delete` zeroes what a write frees, so a replaced value (a secret
    /// sealed after being stored in plain text) leaves no copy in free pages.
    pub async fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, false, i64::MAX).await
    }

    /// As [`open_existing`](Self::open_existing), as a coordinator whose newest migration is
    /// `newest` would: the rolling-upgrade tests' stand-in for the previous version.
    pub async fn open_as_of(path: &Path, newest: i64) -> Result<Self> {
        Self::open_with(path, true, newest).await
    }

    /// Open a database that must already be gpuci's: like [`open`](Self::open), but a file
    /// without gpuci's tables (an empty SQLite database, another program's) is refused with
    /// [`StoreError::NotGpuci`] before anything is written to it, instead of being made into
    /// a new, empty gpuci database.
    pub async fn open_existing(path: &Path) -> Result<Self> {
        Self::open_with(path, true, i64::MAX).await
    }

    async fn open_with(path: &Path, existing: bool, newest: i64) -> Result<Self> {
        if existing {
            // Looked at through a plain connection first: the one below would already switch
            // the file to WAL mode, a write.
            use sqlx::Connection;
            let mut probe = sqlx::SqliteConnection::connect_with(
                &SqliteConnectOptions::new().filename(path).create_if_missing(false),
            )
            .await?;
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name",
            )
            .fetch_all(&mut probe)
            .await?;
            probe.close().await?;
            if !tables.iter().any(|t| t == "jobs") {
                return Err(StoreError::NotGpuci(tables));
            }
        }
        create_private(path).map_err(|e| StoreError::Db(sqlx::Error::Io(e)))?;
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .pragma("secure_delete", "ON")
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .after_release(|conn, _| fit_for_next_write(conn))
            .connect_with(opts.clone())
            .await?;
        migrate(&pool, newest).await?;
        let read = SqlitePoolOptions::new().max_connections(4).connect_with(opts.read_only(true)).await?;
        Ok(Self { pool, read, _anchor: None })
    }

    /// A private in-memory database (tests, `gpuci run`), alive as long as the store.
    pub async fn in_memory() -> Result<Self> {
        use sqlx::ConnectOptions;
        // sqlx names each `:memory:` database (shared cache), so connections made from these
        // options reach the same one while any of them is open.
        let opts = SqliteConnectOptions::from_str("sqlite::memory:")?.foreign_keys(true);
        let anchor = opts.connect().await?;
        // One connection for reads and writes: SQLite's shared cache locks whole tables, and
        // a second connection would meet SQLITE_LOCKED where a file database waits.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(opts)
            .await?;
        migrate(&pool, i64::MAX).await?;
        Ok(Self { read: pool.clone(), pool, _anchor: Some(std::sync::Arc::new(std::sync::Mutex::new(anchor))) })
    }

    /// A pipeline and its jobs, in `tx`.
    async fn create_in(
        tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
        p: NewPipeline,
        jobs: Vec<NewJob>,
    ) -> Result<(PipelineRecord, Vec<JobRecord>)> {
        let pid: i64 =
            sqlx::query(
                "INSERT INTO pipelines (file_name, source, workspace_upload, repository, origin, created_at_ms) VALUES (?, ?, ?, ?, ?, ?) RETURNING id",
            )
                .bind(&p.file_name)
                .bind(&p.source)
                .bind(&p.workspace_upload)
                .bind(&p.repository)
                .bind(&p.origin)
                .bind(p.created_at_ms)
                .fetch_one(&mut **tx)
                .await?
                .get(0);
        let mut ids = Vec::with_capacity(jobs.len());
        for j in &jobs {
            ids.push(insert_job_in(tx, pid, j).await?);
        }
        let mut records = Vec::with_capacity(ids.len());
        for id in ids {
            records.push(Self::job_in(&mut **tx, id).await?.ok_or(StoreError::JobNotFound(id))?);
        }
        Ok((
            PipelineRecord {
                id: pid,
                file_name: p.file_name,
                source: p.source,
                workspace_upload: p.workspace_upload,
                repository: p.repository,
                origin: p.origin,
                created_at_ms: p.created_at_ms,
            },
            records,
        ))
    }

    async fn job_in<'e, E: sqlx::SqliteExecutor<'e>>(exec: E, id: JobId) -> Result<Option<JobRecord>> {
        let row =
            sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?")).bind(id).fetch_optional(exec).await?;
        row.map(|r| job_from_row(&r)).transpose()
    }

    /// [`Store::update_jobs`]'s changes one at a time (a batch that changes a job twice).
    async fn update_one_by_one(tx: &mut sqlx::SqliteConnection, batch: &[JobUpdate]) -> Result<Vec<Result<()>>> {
        let mut out = Vec::with_capacity(batch.len());
        for u in batch {
            // No savepoint per item: `update_job_in` refuses an item before its first write,
            // and any other error ends the whole batch (the transaction is dropped).
            match update_job_in(&mut *tx, u.job, &u.expect, u.change.clone()).await {
                Err(e) if e.refuses_only_the_item() => out.push(Err(e)),
                r => {
                    r?;
                    out.push(Ok(()))
                }
            }
        }
        Ok(out)
    }
}

/// Whether the writer connection, back from a write, may take the next one; if not, the pool
/// closes it (SQLite rolls back whatever it still holds) and opens a fresh one for the next
/// write.
///
/// This is what keeps "a write returns only once it is durable" true after a failed commit.
/// When a COMMIT fails with SQLITE_FULL or SQLITE_IOERR, SQLite rolls the whole transaction
/// back, but sqlx (0.8) still counts it as open: its ROLLBACK then fails, the count stays
/// at 1, and its next `begin()` issues `SAVEPOINT` instead of `BEGIN`. The first such
/// savepoint whose `RELEASE` fails leaves SQLite inside a transaction for good, and from then
/// on every `commit()` only releases a nested savepoint: it returns Ok, the caller
/// acknowledges, and nothing reaches the file (readers never see it; a restart loses it).
/// Measured on a full tmpfs: after the disk filled and space returned, "pipeline submitted"
/// and "job finished" were logged while the API still showed neither.
fn fit_for_next_write(
    conn: &mut sqlx::SqliteConnection,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = sqlx::Result<bool>> + Send + '_>> {
    use sqlx::{Connection, Executor};
    Box::pin(async move {
        // sqlx's count, then SQLite's own view (BEGIN fails inside a transaction).
        let clean = !conn.is_in_transaction()
            && match conn.execute("BEGIN").await {
                Ok(_) => conn.execute("ROLLBACK").await.is_ok(),
                Err(_) => false,
            };
        if !clean {
            tracing::warn!(
                "a database connection came back inside an unfinished transaction (a write failed: a full \
                 disk or an I/O error; or a request was abandoned mid-way, as when its client went away); \
                 the connection is replaced so no later write is left uncommitted"
            );
        }
        Ok(clean)
    })
}

/// Create `path` empty with mode 0600 unless it exists (set explicitly: the umask only ever
/// removes bits, and a umask of 0277 would leave a file SQLite cannot write).
fn create_private(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
        Ok(f) => f.set_permissions(std::fs::Permissions::from_mode(0o600)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

async fn insert_job_in(conn: &mut sqlx::SqliteConnection, pipeline_id: PipelineId, j: &NewJob) -> Result<JobId> {
    let step_json = serde_json::to_string(&j.step).map_err(|e| corrupt("step", e))?;
    let env_json = serde_json::to_string(&j.env).map_err(|e| corrupt("env", e))?;
    let id: i64 = sqlx::query(
        "INSERT INTO jobs (pipeline_id, step_key, name, step_json, env_json, state, reason, attempt, retry_of, created_at_ms) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
    )
    .bind(pipeline_id)
    .bind(&j.step.key)
    .bind(j.step.display_name())
    .bind(step_json)
    .bind(env_json)
    .bind(j.state.as_str())
    .bind(&j.reason)
    .bind(i64::from(j.attempt))
    .bind(j.retry_of)
    .bind(j.created_at_ms)
    .fetch_one(&mut *conn)
    .await?
    .get(0);
    Ok(id)
}

/// Quarantine a GPU, or refresh the reason of one already quarantined.
async fn upsert_quarantine<'e, E: sqlx::SqliteExecutor<'e>>(exec: E, q: &Quarantine) -> Result<()> {
    sqlx::query(
        "INSERT INTO gpu_quarantine (gpu_uuid, agent_id, reason, since_ms) VALUES (?, ?, ?, ?) \
         ON CONFLICT(gpu_uuid) DO UPDATE SET reason = excluded.reason, since_ms = excluded.since_ms",
    )
    .bind(&q.gpu_uuid)
    .bind(&q.agent_id)
    .bind(&q.reason)
    .bind(q.since_ms)
    .execute(exec)
    .await?;
    Ok(())
}

#[async_trait]
impl Store for SqliteStore {
    async fn create_pipeline(&self, p: NewPipeline, jobs: Vec<NewJob>) -> Result<(PipelineRecord, Vec<JobRecord>)> {
        let mut tx = self.pool.begin().await?;
        let made = Self::create_in(&mut tx, p, jobs).await?;
        tx.commit().await?;
        Ok(made)
    }

    async fn create_pipeline_once(&self, p: NewPipeline, jobs: Vec<NewJob>, once: &Submission) -> Result<Created> {
        let mut tx = self.pool.begin().await?;
        if let Some(before) = crate::submissions::sqlite::seen(&mut tx, once).await? {
            tx.rollback().await?;
            return Ok(before);
        }
        let now_ms = p.created_at_ms;
        let (pipeline, jobs) = Self::create_in(&mut tx, p, jobs).await?;
        crate::submissions::sqlite::record(&mut tx, once, pipeline.id, now_ms).await?;
        tx.commit().await?;
        Ok(Created::New(pipeline, jobs))
    }

    async fn insert_job(&self, job: NewJob) -> Result<JobRecord> {
        let mut tx = self.pool.begin().await?;
        let id = insert_job_in(&mut tx, job.pipeline_id, &job).await?;
        let rec = Self::job_in(&mut *tx, id).await?.ok_or(StoreError::JobNotFound(id))?;
        tx.commit().await?;
        Ok(rec)
    }

    async fn assign_job(&self, id: JobId, agent_id: &str, gpus: &[String], now_ms: i64) -> Result<JobRecord> {
        let mut tx = self.pool.begin().await?;
        let rec = assign_in(&mut tx, id, agent_id, gpus, now_ms).await?;
        tx.commit().await?;
        Ok(rec)
    }

    async fn assign_jobs(&self, batch: &[NewAssignment], now_ms: i64) -> Result<Vec<Result<()>>> {
        let mut tx = self.pool.begin().await?;
        let out = assign::assign_set_based(&mut tx, batch, now_ms).await?;
        tx.commit().await?;
        Ok(out)
    }

    async fn update_jobs(&self, batch: &[JobUpdate]) -> Result<Vec<Result<()>>> {
        let mut tx = self.pool.begin().await?;
        let out = match assign::update_set_based(&mut tx, batch).await? {
            Some(out) => out,
            None => Self::update_one_by_one(&mut tx, batch).await?,
        };
        let ended = crate::update_batch::ended(batch, &out);
        crate::job_tokens::sqlite::delete_ended_in(&mut tx, &ended).await?;
        tx.commit().await?;
        Ok(out)
    }

    async fn set_reasons(&self, reasons: &[(JobId, String)]) -> Result<()> {
        if reasons.is_empty() {
            return Ok(());
        }
        // One statement for the lot: a pass may change the reasons of thousands of jobs.
        let rows: Vec<serde_json::Value> = reasons.iter().map(|(id, why)| serde_json::json!([id, why])).collect();
        sqlx::query(
            "UPDATE jobs SET reason = u.reason \
             FROM (SELECT value ->> 0 AS id, value ->> 1 AS reason FROM json_each(?)) AS u \
             WHERE jobs.id = u.id AND jobs.state = 'queued'",
        )
        .bind(serde_json::Value::Array(rows).to_string())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn update_job(&self, id: JobId, expect: &[JobState], c: JobChange) -> Result<JobRecord> {
        let mut tx = self.pool.begin().await?;
        let rec = update_job_in(&mut tx, id, expect, c).await?;
        if rec.state.is_terminal() {
            crate::job_tokens::sqlite::delete_ended_in(&mut tx, &[rec.id]).await?;
        }
        tx.commit().await?;
        Ok(rec)
    }

    async fn update_job_and_insert(
        &self,
        id: JobId,
        expect: &[JobState],
        c: JobChange,
        then: NewJob,
    ) -> Result<(JobRecord, JobRecord)> {
        let mut tx = self.pool.begin().await?;
        let rec = update_job_in(&mut tx, id, expect, c).await?;
        if rec.state.is_terminal() {
            crate::job_tokens::sqlite::delete_ended_in(&mut tx, &[rec.id]).await?;
        }
        let next = insert_job_in(&mut tx, then.pipeline_id, &then).await?;
        let next = Self::job_in(&mut *tx, next).await?.ok_or(StoreError::JobNotFound(next))?;
        tx.commit().await?;
        Ok((rec, next))
    }

    async fn set_reason(&self, id: JobId, reason: &str) -> Result<()> {
        sqlx::query("UPDATE jobs SET reason = ? WHERE id = ?").bind(reason).bind(id).execute(&self.pool).await?;
        Ok(())
    }

    async fn get_job(&self, id: JobId) -> Result<Option<JobRecord>> {
        Self::job_in(&self.read, id).await
    }

    async fn list_jobs(&self, f: &JobFilter) -> Result<Vec<JobRecord>> {
        let mut sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE 1=1");
        if !f.states.is_empty() {
            let list: Vec<String> = f.states.iter().map(|s| format!("'{}'", s.as_str())).collect();
            sql.push_str(&format!(" AND state IN ({})", list.join(",")));
        }
        if f.pipeline.is_some() {
            sql.push_str(" AND pipeline_id = ?");
        }
        if f.before.is_some() {
            sql.push_str(" AND id < ?");
        }
        sql.push_str(" ORDER BY id DESC LIMIT ?");
        let mut q = sqlx::query(&sql);
        if let Some(p) = f.pipeline {
            q = q.bind(p);
        }
        if let Some(b) = f.before {
            q = q.bind(b);
        }
        let rows = q.bind(i64::from(f.limit.unwrap_or(100))).fetch_all(&self.read).await?;
        rows.iter().map(job_from_row).collect()
    }

    async fn jobs_ran_since(&self, since_ms: i64) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE started_at_ms IS NOT NULL \
             AND (finished_at_ms IS NULL OR finished_at_ms >= ?) ORDER BY id"
        ))
        .bind(since_ms)
        .fetch_all(&self.read)
        .await?;
        rows.iter().map(job_from_row).collect()
    }

    async fn active_jobs(&self) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE state IN ('queued', 'assigned', 'running') ORDER BY id"
        ))
        .fetch_all(&self.read)
        .await?;
        rows.iter().map(job_from_row).collect()
    }

    async fn pipeline_jobs(&self, pipeline: PipelineId) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE pipeline_id = ? ORDER BY id"))
            .bind(pipeline)
            .fetch_all(&self.read)
            .await?;
        rows.iter().map(job_from_row).collect()
    }

    async fn get_pipeline(&self, id: PipelineId) -> Result<Option<PipelineRecord>> {
        let row = sqlx::query(&format!("SELECT {PIPELINE_COLUMNS} FROM pipelines WHERE id = ?"))
            .bind(id)
            .fetch_optional(&self.read)
            .await?;
        Ok(row.as_ref().map(pipeline_from_row))
    }

    async fn pipeline_origins(
        &self,
        ids: &[PipelineId],
    ) -> Result<std::collections::HashMap<PipelineId, (Option<String>, Option<String>)>> {
        let mut out = std::collections::HashMap::new();
        for chunk in ids.chunks(500) {
            let marks = vec!["?"; chunk.len()].join(",");
            let sql = format!("SELECT id, repository, origin FROM pipelines WHERE id IN ({marks})");
            let mut q = sqlx::query(&sql);
            for id in chunk {
                q = q.bind(*id);
            }
            for row in q.fetch_all(&self.read).await? {
                out.insert(row.try_get::<i64, _>("id")?, (row.try_get("repository")?, row.try_get("origin")?));
            }
        }
        Ok(out)
    }

    async fn upload_uses(&self, uploads: &[String]) -> Result<Vec<gpuci_core::uploads::PipelineUse>> {
        let mut out = Vec::new();
        for chunk in uploads.chunks(500) {
            let marks = vec!["?"; chunk.len()].join(",");
            // Uses the partial index on pipelines(workspace_upload) and jobs(pipeline_id).
            let sql = format!(
                "SELECT p.workspace_upload AS upload, p.id AS pipeline_id, \
                   (SELECT COUNT(*) FROM jobs j WHERE j.pipeline_id = p.id \
                      AND j.state IN ('queued', 'assigned', 'running')) AS unfinished, \
                   MAX(p.created_at_ms, COALESCE((SELECT MAX(MAX(j.created_at_ms, COALESCE(j.finished_at_ms, 0))) \
                      FROM jobs j WHERE j.pipeline_id = p.id), 0)) AS last_active_ms \
                 FROM pipelines p WHERE p.workspace_upload IN ({marks}) ORDER BY p.id"
            );
            let mut q = sqlx::query(&sql);
            for id in chunk {
                q = q.bind(id);
            }
            for row in q.fetch_all(&self.read).await? {
                out.push(upload_use_from_row(&row)?);
            }
        }
        Ok(out)
    }

    async fn pipelines_before(&self, before: Option<PipelineId>, limit: u32) -> Result<Vec<PipelineRecord>> {
        let rows =
            sqlx::query(&format!("SELECT {PIPELINE_COLUMNS} FROM pipelines WHERE id < ? ORDER BY id DESC LIMIT ?"))
                .bind(before.unwrap_or(i64::MAX))
                .bind(i64::from(limit))
                .fetch_all(&self.read)
                .await?;
        Ok(rows.iter().map(pipeline_from_row).collect())
    }

    async fn jobs_of_pipelines(&self, ids: &[PipelineId]) -> Result<Vec<JobRecord>> {
        let mut out = Vec::new();
        for chunk in ids.chunks(500) {
            let marks = vec!["?"; chunk.len()].join(",");
            let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE pipeline_id IN ({marks}) ORDER BY id");
            let mut q = sqlx::query(&sql);
            for id in chunk {
                q = q.bind(id);
            }
            for r in q.fetch_all(&self.read).await? {
                out.push(job_from_row(&r)?);
            }
        }
        out.sort_by_key(|j| j.id);
        Ok(out)
    }

    async fn put_pipeline_build(&self, pipeline: PipelineId, facts: &str) -> Result<()> {
        sqlx::query("INSERT OR REPLACE INTO pipeline_builds (pipeline_id, facts) VALUES (?, ?)")
            .bind(pipeline)
            .bind(facts)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn pipeline_builds(&self, ids: &[PipelineId]) -> Result<std::collections::HashMap<PipelineId, String>> {
        let mut out = std::collections::HashMap::new();
        for chunk in ids.chunks(500) {
            let marks = vec!["?"; chunk.len()].join(",");
            let sql = format!("SELECT pipeline_id, facts FROM pipeline_builds WHERE pipeline_id IN ({marks})");
            let mut q = sqlx::query(&sql);
            for id in chunk {
                q = q.bind(id);
            }
            for r in q.fetch_all(&self.read).await? {
                out.insert(r.try_get::<i64, _>("pipeline_id")?, r.try_get("facts")?);
            }
        }
        Ok(out)
    }

    async fn list_pipelines(&self, limit: u32) -> Result<Vec<PipelineRecord>> {
        let rows = sqlx::query(&format!("SELECT {PIPELINE_COLUMNS} FROM pipelines ORDER BY id DESC LIMIT ?"))
            .bind(i64::from(limit))
            .fetch_all(&self.read)
            .await?;
        Ok(rows.iter().map(pipeline_from_row).collect())
    }

    async fn append_logs(&self, job: JobId, first_seq: Option<i64>, lines: &[LogChunk]) -> Result<Vec<LogLine>> {
        SqliteStore::append_logs(self, job, first_seq, lines).await
    }

    async fn read_logs(&self, job: JobId, after_seq: i64, limit: u32) -> Result<Vec<LogLine>> {
        SqliteStore::read_logs(self, job, after_seq, limit).await
    }

    async fn log_extent(&self, job: JobId) -> Result<(u64, i64)> {
        SqliteStore::log_extent(self, job).await
    }

    async fn last_log_lines(&self, jobs: &[JobId]) -> Result<std::collections::HashMap<JobId, i64>> {
        SqliteStore::last_log_lines(self, jobs).await
    }

    async fn insert_agent(&self, a: &AgentRecord) -> Result<()> {
        sqlx::query(
            "INSERT INTO agents (id, name, credential_hash, registered_at_ms, last_seen_ms, state, reason, hello_json) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&a.id)
        .bind(&a.name)
        .bind(&a.credential_hash)
        .bind(a.registered_at_ms)
        .bind(a.last_seen_ms)
        .bind(&a.state)
        .bind(&a.reason)
        .bind(&a.hello_json)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn get_agent(&self, id: &str) -> Result<Option<AgentRecord>> {
        let row = sqlx::query("SELECT * FROM agents WHERE id = ?").bind(id).fetch_optional(&self.read).await?;
        Ok(row.as_ref().map(agent_from_row))
    }

    async fn list_agents(&self) -> Result<Vec<AgentRecord>> {
        let rows = sqlx::query("SELECT * FROM agents ORDER BY name, id").fetch_all(&self.read).await?;
        Ok(rows.iter().map(agent_from_row).collect())
    }

    async fn update_agent(&self, id: &str, u: AgentUpdate) -> Result<()> {
        let done = sqlx::query(
            "UPDATE agents SET state = COALESCE(?, state), reason = COALESCE(?, reason), \
             last_seen_ms = COALESCE(?, last_seen_ms), hello_json = COALESCE(?, hello_json) WHERE id = ?",
        )
        .bind(u.state)
        .bind(u.reason)
        .bind(u.last_seen_ms)
        .bind(u.hello_json)
        .bind(id)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::AgentNotFound(id.to_string()));
        }
        Ok(())
    }

    async fn leases(&self) -> Result<Vec<Lease>> {
        let rows = sqlx::query("SELECT gpu_uuid, agent_id, job_id, since_ms FROM gpu_leases ORDER BY gpu_uuid")
            .fetch_all(&self.read)
            .await?;
        Ok(rows
            .iter()
            .map(|r| Lease { gpu_uuid: r.get(0), agent_id: r.get(1), job_id: r.get(2), since_ms: r.get(3) })
            .collect())
    }

    async fn quarantined(&self) -> Result<Vec<Quarantine>> {
        let rows = sqlx::query("SELECT gpu_uuid, agent_id, reason, since_ms FROM gpu_quarantine ORDER BY gpu_uuid")
            .fetch_all(&self.read)
            .await?;
        Ok(rows
            .iter()
            .map(|r| Quarantine { gpu_uuid: r.get(0), agent_id: r.get(1), reason: r.get(2), since_ms: r.get(3) })
            .collect())
    }

    async fn quarantine_gpu(&self, q: &Quarantine) -> Result<()> {
        upsert_quarantine(&self.pool, q).await
    }

    async fn release_quarantine(&self, gpu_uuid: &str) -> Result<bool> {
        let done =
            sqlx::query("DELETE FROM gpu_quarantine WHERE gpu_uuid = ?").bind(gpu_uuid).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    async fn set_secret(&self, name: &str, value: &str, now_ms: i64) -> Result<()> {
        SqliteStore::set_secret(self, name, value, now_ms).await
    }

    async fn delete_secret(&self, name: &str) -> Result<bool> {
        SqliteStore::delete_secret(self, name).await
    }

    async fn secret_names(&self) -> Result<Vec<(String, i64)>> {
        SqliteStore::secret_names(self).await
    }

    async fn purge_freed_space(&self) -> Result<()> {
        // VACUUM rewrites the file without free pages; the checkpoint then empties the WAL,
        // which still holds the pages as they were before.
        sqlx::query("VACUUM").execute(&self.pool).await?;
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)").execute(&self.pool).await?;
        Ok(())
    }

    async fn record_delivery(&self, delivery: &str, event: &str, now_ms: i64) -> Result<bool> {
        SqliteStore::record_delivery(self, delivery, event, now_ms).await
    }

    async fn queue_delivery(&self, delivery: &str, event: &str, body: &[u8], now_ms: i64) -> Result<bool> {
        SqliteStore::queue_delivery(self, delivery, event, body, now_ms).await
    }

    async fn take_queued_deliveries(&self, limit: u32) -> Result<Vec<QueuedDelivery>> {
        SqliteStore::take_queued_deliveries(self, limit).await
    }

    async fn record_delivery_once(&self, d: &NewDelivery<'_>) -> Result<DeliverySeen> {
        crate::github_replay::sqlite::record(&self.pool, d).await
    }

    async fn queue_delivery_once(&self, d: &NewDelivery<'_>, body: &[u8]) -> Result<DeliverySeen> {
        crate::github_replay::sqlite::queue(&self.pool, d, body).await
    }

    async fn prune_github_records(&self, before_ms: i64) -> Result<Pruned> {
        crate::github_replay::sqlite::prune(&self.pool, before_ms).await
    }

    async fn put_github_tombstone(&self, job_id: i64, action: &str, now_ms: i64) -> Result<()> {
        crate::github_replay::sqlite::put_tombstone(&self.pool, job_id, action, now_ms).await
    }

    async fn github_tombstone(&self, job_id: i64) -> Result<Option<String>> {
        crate::github_replay::sqlite::tombstone(&self.read, job_id).await
    }

    async fn insert_github_job(&self, job: &GithubJobRecord) -> Result<bool> {
        SqliteStore::insert_github_job(self, job).await
    }

    async fn put_github_job(&self, job: &GithubJobRecord) -> Result<()> {
        SqliteStore::put_github_job(self, job).await
    }

    async fn get_github_job(&self, id: i64) -> Result<Option<GithubJobRecord>> {
        SqliteStore::get_github_job(self, id).await
    }

    async fn github_jobs(&self, active_only: bool, limit: u32) -> Result<Vec<GithubJobRecord>> {
        SqliteStore::github_jobs(self, active_only, limit).await
    }

    async fn put_runner(&self, r: &RunnerRecord) -> Result<()> {
        SqliteStore::put_runner(self, r).await
    }

    async fn get_runner(&self, name: &str) -> Result<Option<RunnerRecord>> {
        SqliteStore::get_runner(self, name).await
    }

    async fn runners(&self, active_only: bool) -> Result<Vec<RunnerRecord>> {
        SqliteStore::runners(self, active_only).await
    }

    async fn put_approval(&self, a: &ApprovalRecord) -> Result<()> {
        SqliteStore::put_approval(self, a).await
    }

    async fn get_approval(&self, repository: &str, pr: i64, head_sha: &str) -> Result<Option<ApprovalRecord>> {
        SqliteStore::get_approval(self, repository, pr, head_sha).await
    }

    async fn set_check_run(&self, job: JobId, check_run_id: i64) -> Result<()> {
        SqliteStore::set_check_run(self, job, check_run_id).await
    }

    async fn get_check_run(&self, job: JobId) -> Result<Option<i64>> {
        SqliteStore::get_check_run(self, job).await
    }

    async fn put_machine(&self, m: &MachineRecord) -> Result<()> {
        SqliteStore::put_machine(self, m).await
    }

    async fn arm_schedule(&self, name: &str, now_ms: i64) -> Result<i64> {
        SqliteStore::arm_schedule(self, name, now_ms).await
    }

    async fn schedule_checked(&self, name: &str, now_ms: i64) -> Result<()> {
        SqliteStore::schedule_checked(self, name, now_ms).await
    }

    async fn schedules_last_checked(&self) -> Result<Option<i64>> {
        SqliteStore::schedules_last_checked(self).await
    }

    async fn record_schedule_fire(&self, f: &ScheduleFireRecord) -> Result<Option<i64>> {
        SqliteStore::record_schedule_fire(self, f).await
    }

    async fn finish_schedule_fire(&self, id: i64, pipeline: Option<PipelineId>, error: Option<&str>) -> Result<()> {
        SqliteStore::finish_schedule_fire(self, id, pipeline, error).await
    }

    async fn interrupt_schedule_fires(&self, error: &str) -> Result<u64> {
        SqliteStore::interrupt_schedule_fires(self, error).await
    }

    async fn last_cron_fire(&self, name: &str) -> Result<Option<i64>> {
        SqliteStore::last_cron_fire(self, name).await
    }

    async fn schedule_fires(&self, name: Option<&str>, limit: u32) -> Result<Vec<ScheduleFireRecord>> {
        SqliteStore::schedule_fires(self, name, limit).await
    }

    async fn machines(&self, active_only: bool) -> Result<Vec<MachineRecord>> {
        SqliteStore::machines(self, active_only).await
    }

    async fn open_billing(&self, machine: &str, from_ms: i64) -> Result<()> {
        SqliteStore::open_billing(self, machine, from_ms).await
    }

    async fn close_billing(&self, machine: &str, to_ms: i64) -> Result<()> {
        SqliteStore::close_billing(self, machine, to_ms).await
    }

    async fn billing_since(&self, since_ms: i64) -> Result<Vec<BillingInterval>> {
        SqliteStore::billing_since(self, since_ms).await
    }

    async fn put_artifact(&self, a: &ArtifactRecord) -> Result<()> {
        crate::artifacts::sqlite::put(&self.pool, a).await
    }

    async fn job_artifacts(&self, job: JobId) -> Result<Vec<ArtifactRecord>> {
        crate::artifacts::sqlite::of_job(&self.read, job).await
    }

    async fn all_artifacts(&self) -> Result<Vec<ArtifactRecord>> {
        crate::artifacts::sqlite::all(&self.read).await
    }

    async fn repository_artifact_bytes(&self, repository: Option<&str>, untrusted: bool) -> Result<u64> {
        crate::artifacts::sqlite::repository_bytes(&self.read, repository, untrusted).await
    }

    async fn delete_artifacts(&self, keys: &[(JobId, String)]) -> Result<()> {
        crate::artifacts::sqlite::delete(&self.pool, keys).await
    }

    async fn put_test_report(&self, r: &TestReportRecord) -> Result<()> {
        crate::artifacts::sqlite_reports::put(&self.pool, r).await
    }

    async fn job_test_reports(&self, job: JobId) -> Result<Vec<TestReportRecord>> {
        crate::artifacts::sqlite_reports::of_job(&self.read, job).await
    }

    async fn put_job_tokens(&self, tokens: &[(JobId, String)], now_ms: i64) -> Result<()> {
        crate::job_tokens::sqlite::put(&self.pool, tokens, now_ms).await
    }

    async fn job_token(&self, job: JobId) -> Result<Option<crate::JobTokenRecord>> {
        crate::job_tokens::sqlite::get(&self.pool, job).await
    }

    async fn delete_job_token(&self, job: JobId) -> Result<()> {
        crate::job_tokens::sqlite::delete(&self.pool, job).await
    }

    async fn coordinator_identity(&self, new: &crate::StoredIdentity, now_ms: i64) -> Result<crate::StoredIdentity> {
        crate::coordinator_identity::sqlite::get_or_put(&self.pool, new, now_ms).await
    }

    async fn stored_identity(&self) -> Result<Option<crate::StoredIdentity>> {
        crate::coordinator_identity::sqlite::get(&self.pool).await
    }

    async fn coordinator_state(&self, name: &str) -> Result<Option<String>> {
        crate::coordinator_state::sqlite::get(&self.pool, name).await
    }

    async fn put_coordinator_state(&self, name: &str, json: &str, now_ms: i64) -> Result<()> {
        crate::coordinator_state::sqlite::put(&self.pool, name, json, now_ms).await
    }

    async fn count_failed_upload(&self, job: JobId) -> Result<()> {
        crate::job_tokens::sqlite::count_failed(&self.pool, job).await
    }

    async fn add_uploaded_jobs(
        &self,
        by: JobId,
        jobs: Vec<NewJob>,
        max_uploads: u32,
    ) -> Result<Option<Vec<JobRecord>>> {
        let mut tx = self.pool.begin().await?;
        if !crate::job_tokens::sqlite::count_upload(&mut tx, by, max_uploads).await? {
            return Ok(None);
        }
        let mut ids = Vec::with_capacity(jobs.len());
        for j in &jobs {
            ids.push(insert_job_in(&mut tx, j.pipeline_id, j).await?);
        }
        let mut records = Vec::with_capacity(ids.len());
        for id in ids {
            records.push(Self::job_in(&mut *tx, id).await?.ok_or(StoreError::JobNotFound(id))?);
        }
        tx.commit().await?;
        Ok(Some(records))
    }

    async fn secret_values(&self, names: &[String]) -> Result<std::collections::BTreeMap<String, String>> {
        SqliteStore::secret_values(self, names).await
    }

    async fn set_secret_audited(&self, name: &str, value: &str, now_ms: i64, audit: &NewAudit) -> Result<()> {
        SqliteStore::set_secret_audited(self, name, value, now_ms, audit).await
    }

    async fn delete_secret_audited(&self, name: &str, audit: &NewAudit) -> Result<bool> {
        SqliteStore::delete_secret_audited(self, name, audit).await
    }

    async fn append_audit(&self, entry: &NewAudit) -> Result<AuditRecord> {
        SqliteStore::append_audit(self, entry).await
    }

    async fn audit_log(&self, f: &AuditFilter) -> Result<Vec<AuditRecord>> {
        SqliteStore::audit_log(self, f).await
    }

    async fn create_api_token(&self, t: &ApiTokenRecord, audit: &NewAudit) -> Result<bool> {
        SqliteStore::create_api_token(self, t, audit).await
    }

    async fn revoke_api_token(&self, name: &str, now_ms: i64, audit: &NewAudit) -> Result<bool> {
        SqliteStore::revoke_api_token(self, name, now_ms, audit).await
    }

    async fn api_tokens(&self) -> Result<Vec<ApiTokenRecord>> {
        SqliteStore::api_tokens(self).await
    }

    async fn live_api_token(&self, hash: &str) -> Result<Option<ApiTokenRecord>> {
        SqliteStore::live_api_token(self, hash).await
    }
}

fn upload_use_from_row(r: &SqliteRow) -> Result<gpuci_core::uploads::PipelineUse> {
    Ok(gpuci_core::uploads::PipelineUse {
        upload: r.try_get("upload")?,
        pipeline_id: r.try_get("pipeline_id")?,
        unfinished_jobs: u64::try_from(r.try_get::<i64, _>("unfinished")?).unwrap_or(0),
        last_active_ms: r.try_get("last_active_ms")?,
    })
}

#[cfg(test)]
mod tests;
