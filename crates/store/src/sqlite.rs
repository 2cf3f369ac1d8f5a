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
        Ok(Self { pool, read })
    }

    /// A private in-memory database (tests, `gpuci run`).
    pub async fn in_memory() -> Result<Self> {
        let opts = SqliteConnectOptions::from_str("sqlite::memory:")?.foreign_keys(true);
        // One connection: every connection to :memory: is a different database.
        let pool = SqlitePoolOptions::new().max_connections(1).connect_with(opts).await?;
        migrate(&pool, i64::MAX).await?;
        Ok(Self { read: pool.clone(), pool })
    }

    async fn job_in<'e, E: sqlx::SqliteExecutor<'e>>(exec: E, id: JobId) -> Result<Option<JobRecord>> {
        let row =
            sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?")).bind(id).fetch_optional(exec).await?;
        row.map(|r| job_from_row(&r)).transpose()
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

fn bind_github_job<'q>(
    q: sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
    j: &'q GithubJobRecord,
) -> Result<sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments<'q>>> {
    let labels = serde_json::to_string(&j.labels).map_err(|e| corrupt("github_jobs.labels", e))?;
    Ok(q.bind(j.id)
        .bind(&j.repository)
        .bind(j.run_id)
        .bind(&j.name)
        .bind(labels)
        .bind(&j.pool)
        .bind(&j.state)
        .bind(j.runner_job_id)
        .bind(&j.runner_name)
        .bind(&j.reason)
        .bind(j.queued_at_ms)
        .bind(j.updated_at_ms)
        .bind(i64::from(j.runner_exits))
        .bind(&j.last_runner_exit)
        .bind(i64::from(j.check_failures))
        .bind(j.retry_at_ms))
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

/// The writes of [`Store::assign_job`], inside the caller's transaction. Every check comes
/// before the first write, so a refusal has written nothing.
async fn assign_in(
    conn: &mut sqlx::SqliteConnection,
    id: JobId,
    agent_id: &str,
    gpus: &[String],
    now_ms: i64,
) -> Result<JobRecord> {
    let cur = SqliteStore::job_in(&mut *conn, id).await?.ok_or(StoreError::JobNotFound(id))?;
    if cur.state != JobState::Queued {
        return Err(StoreError::Conflict { job: id, expected: "queued".into(), found: cur.state });
    }
    for g in gpus {
        let holder: Option<i64> = sqlx::query("SELECT job_id FROM gpu_leases WHERE gpu_uuid = ?")
            .bind(g)
            .fetch_optional(&mut *conn)
            .await?
            .map(|r| r.get(0));
        if let Some(holder) = holder {
            return Err(StoreError::GpuLeased { gpu: g.clone(), holder });
        }
    }
    for g in gpus {
        sqlx::query("INSERT INTO gpu_leases (gpu_uuid, agent_id, job_id, since_ms) VALUES (?, ?, ?, ?)")
            .bind(g)
            .bind(agent_id)
            .bind(id)
            .bind(now_ms)
            .execute(&mut *conn)
            .await?;
    }
    let gpus_json = serde_json::to_string(gpus).map_err(|e| corrupt("gpus", e))?;
    sqlx::query(
        "UPDATE jobs SET state = 'assigned', reason = ?, agent_id = ?, gpus_json = ?, assigned_at_ms = ? WHERE id = ?",
    )
    .bind(format!("assigned to agent {agent_id}"))
    .bind(agent_id)
    .bind(gpus_json)
    .bind(now_ms)
    .bind(id)
    .execute(&mut *conn)
    .await?;
    SqliteStore::job_in(&mut *conn, id).await?.ok_or(StoreError::JobNotFound(id))
}

/// The change of [`Store::update_job`], inside the caller's transaction.
async fn update_job_in(
    tx: &mut sqlx::SqliteConnection,
    id: JobId,
    expect: &[JobState],
    c: JobChange,
) -> Result<JobRecord> {
    let cur = SqliteStore::job_in(&mut *tx, id).await?.ok_or(StoreError::JobNotFound(id))?;
    if !expect.is_empty() && !expect.contains(&cur.state) {
        let expected = expect.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("|");
        return Err(StoreError::Conflict { job: id, expected, found: cur.state });
    }
    let telemetry = c.telemetry.as_ref().map(serde_json::to_string).transpose().map_err(|e| corrupt("telemetry", e))?;
    let unenforced =
        c.unenforced.as_ref().map(serde_json::to_string).transpose().map_err(|e| corrupt("unenforced", e))?;
    sqlx::query(
        "UPDATE jobs SET state = COALESCE(?, state), reason = COALESCE(?, reason), \
         started_at_ms = COALESCE(?, started_at_ms), finished_at_ms = COALESCE(?, finished_at_ms), \
         exit_code = COALESCE(?, exit_code), telemetry_json = COALESCE(?, telemetry_json), \
         unenforced_json = COALESCE(?, unenforced_json) WHERE id = ?",
    )
    .bind(c.state.map(JobState::as_str))
    .bind(c.reason)
    .bind(c.started_at_ms)
    .bind(c.finished_at_ms)
    .bind(c.exit_code)
    .bind(telemetry)
    .bind(unenforced)
    .bind(id)
    .execute(&mut *tx)
    .await?;
    if c.clear_assignment {
        sqlx::query(
            "UPDATE jobs SET agent_id = NULL, gpus_json = '[]', assigned_at_ms = NULL, unenforced_json = NULL WHERE id = ?",
        )
            .bind(id)
            .execute(&mut *tx)
            .await?;
    }
    if c.release_leases || c.clear_assignment {
        sqlx::query("DELETE FROM gpu_leases WHERE job_id = ?").bind(id).execute(&mut *tx).await?;
    }
    for q in &c.quarantine {
        upsert_quarantine(&mut *tx, q).await?;
    }
    SqliteStore::job_in(&mut *tx, id).await?.ok_or(StoreError::JobNotFound(id))
}

#[async_trait]
impl Store for SqliteStore {
    async fn create_pipeline(&self, p: NewPipeline, jobs: Vec<NewJob>) -> Result<(PipelineRecord, Vec<JobRecord>)> {
        let mut tx = self.pool.begin().await?;
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
                .fetch_one(&mut *tx)
                .await?
                .get(0);
        let mut ids = Vec::with_capacity(jobs.len());
        for j in &jobs {
            ids.push(insert_job_in(&mut tx, pid, j).await?);
        }
        let mut records = Vec::with_capacity(ids.len());
        for id in ids {
            records.push(Self::job_in(&mut *tx, id).await?.ok_or(StoreError::JobNotFound(id))?);
        }
        tx.commit().await?;
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

    async fn assign_jobs(&self, batch: &[NewAssignment], now_ms: i64) -> Result<Vec<Result<JobRecord>>> {
        let mut tx = self.pool.begin().await?;
        if batch.iter().any(|a| a.token_sha256.is_some()) {
            crate::job_tokens::sqlite::sweep_ended(&mut tx).await?;
        }
        let mut out = Vec::with_capacity(batch.len());
        for a in batch {
            // A savepoint per item: a refused one leaves nothing behind and the others stand.
            sqlx::query("SAVEPOINT item").execute(&mut *tx).await?;
            let assigned = match assign_in(&mut tx, a.job, &a.agent_id, &a.gpus, now_ms).await {
                Ok(rec) => match &a.token_sha256 {
                    Some(sha256) => {
                        crate::job_tokens::sqlite::put_in(&mut tx, a.job, sha256, now_ms).await.map(|()| rec)
                    }
                    None => Ok(rec),
                },
                Err(e) => Err(e),
            };
            match assigned {
                Err(e) if e.refuses_only_the_item() => {
                    sqlx::query("ROLLBACK TO SAVEPOINT item").execute(&mut *tx).await?;
                    out.push(Err(e));
                }
                r => out.push(Ok(r?)),
            }
            sqlx::query("RELEASE SAVEPOINT item").execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn update_jobs(&self, batch: &[JobUpdate]) -> Result<Vec<Result<JobRecord>>> {
        let mut tx = self.pool.begin().await?;
        let mut out = Vec::with_capacity(batch.len());
        for u in batch {
            sqlx::query("SAVEPOINT item").execute(&mut *tx).await?;
            match update_job_in(&mut tx, u.job, &u.expect, u.change.clone()).await {
                Err(e) if e.refuses_only_the_item() => {
                    sqlx::query("ROLLBACK TO SAVEPOINT item").execute(&mut *tx).await?;
                    out.push(Err(e));
                }
                r => out.push(Ok(r?)),
            }
            sqlx::query("RELEASE SAVEPOINT item").execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn set_reasons(&self, reasons: &[(JobId, String)]) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        for (id, reason) in reasons {
            sqlx::query("UPDATE jobs SET reason = ? WHERE id = ?").bind(reason).bind(id).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn update_job(&self, id: JobId, expect: &[JobState], c: JobChange) -> Result<JobRecord> {
        let mut tx = self.pool.begin().await?;
        let rec = update_job_in(&mut tx, id, expect, c).await?;
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
        if lines.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.pool.begin().await?;
        if first_seq.is_some() {
            let state: Option<String> = sqlx::query("SELECT state FROM jobs WHERE id = ?")
                .bind(job)
                .fetch_optional(&mut *tx)
                .await?
                .map(|r| r.get(0));
            if state.as_deref().and_then(|s| s.parse::<JobState>().ok()).is_some_and(JobState::is_terminal) {
                // See the trait: an ended job's log takes no more of its agent's lines. Ended
                // here, not left to the drop: a connection handed back inside a transaction is
                // taken for one a failed write left behind, and replaced with a warning.
                tx.rollback().await?;
                return Ok(Vec::new());
            }
        }
        let last: i64 = sqlx::query("SELECT COALESCE(MAX(seq), 0) FROM job_logs WHERE job_id = ?")
            .bind(job)
            .fetch_one(&mut *tx)
            .await?
            .get(0);
        // Numbered by the writer: lines stored before (a resend) are skipped. Else after the last.
        let first = first_seq.unwrap_or(last + 1);
        let skip = usize::try_from((last + 1 - first).max(0)).unwrap_or(usize::MAX).min(lines.len());
        let (first, lines) = (first + skip as i64, &lines[skip..]);
        let mut out = Vec::with_capacity(lines.len());
        // Multi-row insert in batches keeps a burst of output to one round trip per 100 lines.
        for (b, chunk) in lines.chunks(100).enumerate() {
            let mut qb = sqlx::QueryBuilder::new("INSERT INTO job_logs (job_id, seq, ts_us, stream, text) ");
            qb.push_values(chunk.iter().enumerate(), |mut row, (i, l)| {
                let seq = first + (b * 100 + i) as i64;
                row.push_bind(job)
                    .push_bind(seq)
                    .push_bind(l.ts_us)
                    .push_bind(stream_str(l.stream))
                    .push_bind(l.text.clone());
                out.push(LogLine { seq, ts_us: l.ts_us, stream: l.stream, text: l.text.clone() });
            });
            qb.build().execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn read_logs(&self, job: JobId, after_seq: i64, limit: u32) -> Result<Vec<LogLine>> {
        let rows = sqlx::query(
            "SELECT seq, ts_us, stream, text FROM job_logs WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
        )
        .bind(job)
        .bind(after_seq)
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .map(|r| LogLine {
                seq: r.get("seq"),
                ts_us: r.get("ts_us"),
                stream: stream_parse(r.get("stream")),
                text: r.get("text"),
            })
            .collect())
    }

    async fn log_extent(&self, job: JobId) -> Result<(u64, i64)> {
        let row = sqlx::query("SELECT COALESCE(SUM(LENGTH(CAST(text AS BLOB)) + ?), 0), COALESCE(MAX(seq), 0) FROM job_logs WHERE job_id = ?")
            .bind(gpuci_protocol::agent::LOG_LINE_COST as i64)
            .bind(job)
            .fetch_one(&self.read)
            .await?;
        let (bytes, last): (i64, i64) = (row.get(0), row.get(1));
        Ok((bytes.max(0) as u64, last))
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
        sqlx::query(
            "INSERT INTO secrets (name, value, updated_at_ms) VALUES (?, ?, ?) \
             ON CONFLICT(name) DO UPDATE SET value = excluded.value, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(name)
        .bind(value)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn delete_secret(&self, name: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM secrets WHERE name = ?").bind(name).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    async fn secret_names(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query("SELECT name, updated_at_ms FROM secrets ORDER BY name").fetch_all(&self.read).await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    async fn purge_freed_space(&self) -> Result<()> {
        // VACUUM rewrites the file without free pages; the checkpoint then empties the WAL,
        // which still holds the pages as they were before.
        sqlx::query("VACUUM").execute(&self.pool).await?;
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)").execute(&self.pool).await?;
        Ok(())
    }

    async fn record_delivery(&self, delivery: &str, event: &str, now_ms: i64) -> Result<bool> {
        let done = sqlx::query(
            "INSERT INTO github_deliveries (delivery, event, received_at_ms) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
        )
        .bind(delivery)
        .bind(event)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn insert_github_job(&self, job: &GithubJobRecord) -> Result<bool> {
        let sql = format!(
            "INSERT INTO github_jobs ({GITHUB_JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        );
        let done = bind_github_job(sqlx::query(&sql), job)?.execute(&self.pool).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn put_github_job(&self, job: &GithubJobRecord) -> Result<()> {
        let sql = format!(
            "INSERT OR REPLACE INTO github_jobs ({GITHUB_JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        );
        bind_github_job(sqlx::query(&sql), job)?.execute(&self.pool).await?;
        Ok(())
    }

    async fn get_github_job(&self, id: i64) -> Result<Option<GithubJobRecord>> {
        let sql = format!("SELECT {GITHUB_JOB_COLUMNS} FROM github_jobs WHERE id = ?");
        let row = sqlx::query(&sql).bind(id).fetch_optional(&self.read).await?;
        row.as_ref().map(github_job_from_row).transpose()
    }

    async fn github_jobs(&self, active_only: bool, limit: u32) -> Result<Vec<GithubJobRecord>> {
        let filter = if active_only { "WHERE state IN ('queued', 'in_progress')" } else { "" };
        let sql = format!(
            "SELECT {GITHUB_JOB_COLUMNS} FROM github_jobs {filter} ORDER BY queued_at_ms DESC, id DESC LIMIT ?"
        );
        let rows = sqlx::query(&sql).bind(i64::from(limit)).fetch_all(&self.read).await?;
        rows.iter().map(github_job_from_row).collect()
    }

    async fn put_runner(&self, r: &RunnerRecord) -> Result<()> {
        let sql =
            format!("INSERT OR REPLACE INTO github_runners ({RUNNER_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");
        sqlx::query(&sql)
            .bind(&r.name)
            .bind(r.job_id)
            .bind(&r.pool)
            .bind(&r.repository)
            .bind(&r.org)
            .bind(r.runner_id)
            .bind(r.github_job_id)
            .bind(&r.state)
            .bind(r.created_at_ms)
            .bind(r.updated_at_ms)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn get_runner(&self, name: &str) -> Result<Option<RunnerRecord>> {
        let sql = format!("SELECT {RUNNER_COLUMNS} FROM github_runners WHERE name = ?");
        let row = sqlx::query(&sql).bind(name).fetch_optional(&self.read).await?;
        Ok(row.as_ref().map(runner_from_row))
    }

    async fn runners(&self, active_only: bool) -> Result<Vec<RunnerRecord>> {
        let filter = if active_only { "WHERE state NOT IN ('done', 'removed')" } else { "" };
        let sql = format!("SELECT {RUNNER_COLUMNS} FROM github_runners {filter} ORDER BY created_at_ms, name");
        let rows = sqlx::query(&sql).fetch_all(&self.read).await?;
        Ok(rows.iter().map(runner_from_row).collect())
    }

    async fn put_approval(&self, a: &ApprovalRecord) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT OR REPLACE INTO github_approvals (repository, pr, head_sha, approved_by, approved_at_ms) VALUES (?, ?, ?, ?, ?)",
        )
        .bind(&a.repository)
        .bind(a.pr)
        .bind(&a.head_sha)
        .bind(&a.approved_by)
        .bind(a.approved_at_ms)
        .execute(&mut *tx)
        .await?;
        insert_audit(&mut tx, &approval_audit(a)).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn get_approval(&self, repository: &str, pr: i64, head_sha: &str) -> Result<Option<ApprovalRecord>> {
        let row = sqlx::query(
            "SELECT repository, pr, head_sha, approved_by, approved_at_ms FROM github_approvals \
             WHERE repository = ? AND pr = ? AND head_sha = ?",
        )
        .bind(repository)
        .bind(pr)
        .bind(head_sha)
        .fetch_optional(&self.read)
        .await?;
        Ok(row.map(|r| ApprovalRecord {
            repository: r.get(0),
            pr: r.get(1),
            head_sha: r.get(2),
            approved_by: r.get(3),
            approved_at_ms: r.get(4),
        }))
    }

    async fn set_check_run(&self, job: JobId, check_run_id: i64) -> Result<()> {
        sqlx::query("INSERT OR REPLACE INTO github_checks (job_id, check_run_id) VALUES (?, ?)")
            .bind(job)
            .bind(check_run_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn get_check_run(&self, job: JobId) -> Result<Option<i64>> {
        let row = sqlx::query("SELECT check_run_id FROM github_checks WHERE job_id = ?")
            .bind(job)
            .fetch_optional(&self.read)
            .await?;
        Ok(row.map(|r| r.get(0)))
    }

    async fn put_machine(&self, m: &MachineRecord) -> Result<()> {
        let sql = format!("INSERT OR REPLACE INTO machines ({MACHINE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");
        sqlx::query(&sql)
            .bind(&m.id)
            .bind(&m.fleet)
            .bind(&m.provider_id)
            .bind(&m.instance_type)
            .bind(&m.zone)
            .bind(&m.capacity)
            .bind(m.price_per_hour)
            .bind(i64::from(m.gpus))
            .bind(&m.state)
            .bind(&m.reason)
            .bind(&m.agent_id)
            .bind(m.requested_at_ms)
            .bind(m.running_at_ms)
            .bind(m.connected_at_ms)
            .bind(m.first_job_at_ms)
            .bind(m.ended_at_ms)
            .bind(i64::from(m.boot_failed))
            .bind(m.interrupted_at_ms)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn arm_schedule(&self, name: &str, now_ms: i64) -> Result<i64> {
        sqlx::query("INSERT INTO schedule_state (name, checked_at_ms) VALUES (?, ?) ON CONFLICT DO NOTHING")
            .bind(name)
            .bind(now_ms)
            .execute(&self.pool)
            .await?;
        let row = sqlx::query("SELECT checked_at_ms FROM schedule_state WHERE name = ?")
            .bind(name)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.get("checked_at_ms"))
    }

    async fn schedule_checked(&self, name: &str, now_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO schedule_state (name, checked_at_ms) VALUES (?, ?) \
             ON CONFLICT (name) DO UPDATE SET checked_at_ms = excluded.checked_at_ms",
        )
        .bind(name)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn schedules_last_checked(&self) -> Result<Option<i64>> {
        let row = sqlx::query("SELECT MAX(checked_at_ms) AS last FROM schedule_state").fetch_one(&self.read).await?;
        Ok(row.get("last"))
    }

    async fn record_schedule_fire(&self, f: &ScheduleFireRecord) -> Result<Option<i64>> {
        let row = sqlx::query(
            "INSERT INTO schedule_fires (schedule, cause, scheduled_at_ms, fired_at_ms, skipped_from_ms) \
             VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING id",
        )
        .bind(&f.schedule)
        .bind(&f.cause)
        .bind(f.scheduled_at_ms)
        .bind(f.fired_at_ms)
        .bind(f.skipped_from_ms)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| r.get("id")))
    }

    async fn finish_schedule_fire(&self, id: i64, pipeline: Option<PipelineId>, error: Option<&str>) -> Result<()> {
        sqlx::query("UPDATE schedule_fires SET pipeline_id = ?, error = ? WHERE id = ?")
            .bind(pipeline)
            .bind(error)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn interrupt_schedule_fires(&self, error: &str) -> Result<u64> {
        let done = sqlx::query("UPDATE schedule_fires SET error = ? WHERE pipeline_id IS NULL AND error IS NULL")
            .bind(error)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn last_cron_fire(&self, name: &str) -> Result<Option<i64>> {
        let row = sqlx::query(
            "SELECT MAX(scheduled_at_ms) AS last FROM schedule_fires WHERE schedule = ? AND cause = 'cron'",
        )
        .bind(name)
        .fetch_one(&self.read)
        .await?;
        Ok(row.get("last"))
    }

    async fn schedule_fires(&self, name: Option<&str>, limit: u32) -> Result<Vec<ScheduleFireRecord>> {
        let rows = sqlx::query(
            "SELECT id, schedule, cause, scheduled_at_ms, fired_at_ms, skipped_from_ms, pipeline_id, error \
             FROM schedule_fires WHERE (? IS NULL OR schedule = ?) ORDER BY id DESC LIMIT ?",
        )
        .bind(name)
        .bind(name)
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .map(|r: &SqliteRow| ScheduleFireRecord {
                id: r.get("id"),
                schedule: r.get("schedule"),
                cause: r.get("cause"),
                scheduled_at_ms: r.get("scheduled_at_ms"),
                fired_at_ms: r.get("fired_at_ms"),
                skipped_from_ms: r.get("skipped_from_ms"),
                pipeline_id: r.get("pipeline_id"),
                error: r.get("error"),
            })
            .collect())
    }

    async fn machines(&self, active_only: bool) -> Result<Vec<MachineRecord>> {
        let filter = if active_only { "WHERE ended_at_ms IS NULL" } else { "" };
        let sql = format!(r#"SELECT {MACHINE_COLUMNS} FROM machines {filter} ORDER BY requested_at_ms, id"#);
        let rows = sqlx::query(&sql).fetch_all(&self.read).await?;
        Ok(rows.iter().map(machine_from_row).collect())
    }

    async fn open_billing(&self, machine: &str, from_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO machine_billing (machine_id, from_ms, to_ms) SELECT ?, ?, NULL \
             WHERE NOT EXISTS (SELECT 1 FROM machine_billing WHERE machine_id = ? AND to_ms IS NULL) \
             ON CONFLICT DO NOTHING",
        )
        .bind(machine)
        .bind(from_ms)
        .bind(machine)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn close_billing(&self, machine: &str, to_ms: i64) -> Result<()> {
        // Never before the stretch began (a clock that stepped back).
        sqlx::query(
            "UPDATE machine_billing SET to_ms = CASE WHEN ? < from_ms THEN from_ms ELSE ? END \
             WHERE machine_id = ? AND to_ms IS NULL",
        )
        .bind(to_ms)
        .bind(to_ms)
        .bind(machine)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn billing_since(&self, since_ms: i64) -> Result<Vec<BillingInterval>> {
        let rows = sqlx::query(
            "SELECT machine_id, from_ms, to_ms FROM machine_billing WHERE to_ms IS NULL OR to_ms >= ? \
             ORDER BY from_ms, machine_id",
        )
        .bind(since_ms)
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .map(|r| BillingInterval {
                machine_id: r.get("machine_id"),
                from_ms: r.get("from_ms"),
                to_ms: r.get("to_ms"),
            })
            .collect())
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
        let mut out = std::collections::BTreeMap::new();
        for n in names {
            let row =
                sqlx::query("SELECT value FROM secrets WHERE name = ?").bind(n).fetch_optional(&self.read).await?;
            if let Some(r) = row {
                out.insert(n.clone(), r.get(0));
            }
        }
        Ok(out)
    }

    async fn set_secret_audited(&self, name: &str, value: &str, now_ms: i64, audit: &NewAudit) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO secrets (name, value, updated_at_ms) VALUES (?, ?, ?) \
             ON CONFLICT(name) DO UPDATE SET value = excluded.value, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(name)
        .bind(value)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn delete_secret_audited(&self, name: &str, audit: &NewAudit) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query("DELETE FROM secrets WHERE name = ?").bind(name).execute(&mut *tx).await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn append_audit(&self, entry: &NewAudit) -> Result<AuditRecord> {
        let mut tx = self.pool.begin().await?;
        let id = insert_audit(&mut tx, entry).await?;
        tx.commit().await?;
        Ok(AuditRecord { id, entry: entry.clone() })
    }

    async fn audit_log(&self, f: &AuditFilter) -> Result<Vec<AuditRecord>> {
        let rows = sqlx::query(
            "SELECT id, at_ms, actor_kind, actor, credential, action, object, outcome FROM audit_log \
             WHERE (? IS NULL OR at_ms >= ?) AND (? IS NULL OR action = ? OR action LIKE ? ESCAPE '\\') \
             AND (? IS NULL OR actor = ?) ORDER BY id DESC LIMIT ?",
        )
        .bind(f.since_ms)
        .bind(f.since_ms)
        .bind(&f.action)
        .bind(&f.action)
        .bind(f.action_prefix())
        .bind(&f.actor)
        .bind(&f.actor)
        .bind(f.limit())
        .fetch_all(&self.read)
        .await?;
        Ok(rows.iter().map(audit_from_row).collect())
    }

    async fn create_api_token(&self, t: &ApiTokenRecord, audit: &NewAudit) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query(
            "INSERT INTO api_tokens (name, hash, created_at_ms, created_by, revoked_at_ms) VALUES (?, ?, ?, ?, ?) \
             ON CONFLICT DO NOTHING",
        )
        .bind(&t.name)
        .bind(&t.hash)
        .bind(t.created_at_ms)
        .bind(&t.created_by)
        .bind(t.revoked_at_ms)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn revoke_api_token(&self, name: &str, now_ms: i64, audit: &NewAudit) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query("UPDATE api_tokens SET revoked_at_ms = ? WHERE name = ? AND revoked_at_ms IS NULL")
            .bind(now_ms)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn api_tokens(&self) -> Result<Vec<ApiTokenRecord>> {
        let rows =
            sqlx::query("SELECT name, hash, created_at_ms, created_by, revoked_at_ms FROM api_tokens ORDER BY name")
                .fetch_all(&self.read)
                .await?;
        Ok(rows.iter().map(token_from_row).collect())
    }

    async fn live_api_token(&self, hash: &str) -> Result<Option<ApiTokenRecord>> {
        let row = sqlx::query(
            "SELECT name, hash, created_at_ms, created_by, revoked_at_ms FROM api_tokens \
             WHERE hash = ? AND revoked_at_ms IS NULL",
        )
        .bind(hash)
        .fetch_optional(&self.read)
        .await?;
        Ok(row.as_ref().map(token_from_row))
    }
}

/// Append an audit entry inside the caller's transaction; returns its id.
async fn insert_audit(conn: &mut sqlx::SqliteConnection, a: &NewAudit) -> Result<i64> {
    let done = sqlx::query(
        "INSERT INTO audit_log (at_ms, actor_kind, actor, credential, action, object, outcome) \
         VALUES (?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(a.at_ms)
    .bind(&a.actor_kind)
    .bind(&a.actor)
    .bind(&a.credential)
    .bind(&a.action)
    .bind(&a.object)
    .bind(&a.outcome)
    .execute(conn)
    .await?;
    Ok(done.last_insert_rowid())
}

fn upload_use_from_row(r: &SqliteRow) -> Result<gpuci_core::uploads::PipelineUse> {
    Ok(gpuci_core::uploads::PipelineUse {
        upload: r.try_get("upload")?,
        pipeline_id: r.try_get("pipeline_id")?,
        unfinished_jobs: u64::try_from(r.try_get::<i64, _>("unfinished")?).unwrap_or(0),
        last_active_ms: r.try_get("last_active_ms")?,
    })
}

fn audit_from_row(r: &SqliteRow) -> AuditRecord {
    AuditRecord {
        id: r.get(0),
        entry: NewAudit {
            at_ms: r.get(1),
            actor_kind: r.get(2),
            actor: r.get(3),
            credential: r.get(4),
            action: r.get(5),
            object: r.get(6),
            outcome: r.get(7),
        },
    }
}

fn token_from_row(r: &SqliteRow) -> ApiTokenRecord {
    ApiTokenRecord {
        name: r.get(0),
        hash: r.get(1),
        created_at_ms: r.get(2),
        created_by: r.get(3),
        revoked_at_ms: r.get(4),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;
    use gpuci_core::pipeline::Step;
    use std::io::Write;
    use std::path::PathBuf;

    /// A small tmpfs of its own, so a test can fill the disk under the database. Mounting
    /// needs root: under CI (`CI=true`) a test that cannot mount fails; elsewhere it is
    /// skipped with a note.
    struct SmallDisk {
        dir: tempfile::TempDir,
    }

    impl SmallDisk {
        fn mount(size: &str) -> Option<SmallDisk> {
            let dir = tempfile::Builder::new().prefix("gpuci-small-disk-").tempdir().unwrap();
            let out = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
                .arg(dir.path())
                .output();
            match out {
                Ok(o) if o.status.success() => Some(SmallDisk { dir }),
                other => {
                    let why = match other {
                        Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                        Err(e) => e.to_string(),
                    };
                    assert!(
                        std::env::var("CI").as_deref() != Ok("true"),
                        "CI=true but a tmpfs cannot be mounted ({why}); these tests run as root"
                    );
                    eprintln!("note: skipped: cannot mount a small tmpfs ({why}); run as root to fill a disk");
                    None
                }
            }
        }

        fn path(&self) -> &Path {
            self.dir.path()
        }

        /// Write a file until the disk is full; returns it (remove it to free the space).
        fn fill(&self) -> PathBuf {
            let path = self.path().join("filler");
            let mut f = std::fs::File::create(&path).unwrap();
            for chunk in [64 * 1024, 512, 1] {
                let buf = vec![0u8; chunk];
                while f.write_all(&buf).is_ok() {}
            }
            let _ = f.sync_all();
            path
        }
    }

    impl Drop for SmallDisk {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(self.dir.path()).status();
        }
    }

    fn pipeline(name: &str) -> NewPipeline {
        NewPipeline {
            file_name: name.into(),
            source: "steps: []".into(),
            workspace_upload: None,
            repository: None,
            origin: None,
            created_at_ms: 1,
        }
    }

    fn job(key: &str) -> NewJob {
        NewJob {
            pipeline_id: 0,
            step: Step::new(key, "true"),
            env: Default::default(),
            state: JobState::Queued,
            reason: "queued".into(),
            attempt: 1,
            retry_of: None,
            created_at_ms: 1,
        }
    }

    /// Regression (issue 10, item 3): after a commit failed on a full disk, sqlx kept counting
    /// the transaction SQLite had rolled back, and every later "commit" returned Ok without
    /// reaching the file, also once space was back.
    #[tokio::test]
    async fn after_a_full_disk_every_write_that_returns_ok_is_durable() {
        let Some(disk) = SmallDisk::mount("2m") else { return };
        let path = disk.path().join("gpuci.db");
        let s = SqliteStore::open(&path).await.unwrap();
        let (before, _) = s.create_pipeline(pipeline("before.yml"), vec![job("a")]).await.unwrap();

        let filler = disk.fill();
        for i in 0..3 {
            let e = s.create_pipeline(pipeline("full.yml"), vec![job("a")]).await.unwrap_err();
            assert!(e.is_unavailable(), "attempt {i}: {e}");
            assert_eq!(e.reason(), "database or disk is full", "attempt {i}");
            assert!(e.to_string().contains("(SQLite code 13)"), "{e}");
        }
        std::fs::remove_file(filler).unwrap();

        // Space is back: the same store writes again, and what it says it stored is there.
        let (after, jobs) = s.create_pipeline(pipeline("after.yml"), vec![job("a")]).await.unwrap();
        assert!(
            s.get_pipeline(after.id).await.unwrap().is_some(),
            "pipeline {} was acknowledged but is not stored",
            after.id
        );
        let done = JobChange {
            state: Some(JobState::Succeeded),
            reason: Some("exited with code 0".into()),
            finished_at_ms: Some(2),
            ..Default::default()
        };
        s.update_job(jobs[0].id, &[JobState::Queued], done).await.unwrap();
        assert_eq!(s.get_job(jobs[0].id).await.unwrap().unwrap().state, JobState::Succeeded);
        drop(s);

        let s = SqliteStore::open(&path).await.unwrap();
        let names: Vec<String> = s.list_pipelines(10).await.unwrap().into_iter().map(|p| p.file_name).collect();
        assert_eq!(names, ["after.yml", "before.yml"]);
        assert!(s.get_pipeline(before.id).await.unwrap().is_some());
        assert_eq!(s.get_job(jobs[0].id).await.unwrap().unwrap().state, JobState::Succeeded);
    }

    /// A job's end and its retry are one write: when it fails, neither is stored.
    #[tokio::test]
    async fn a_job_ends_with_its_retry_or_not_at_all() {
        let Some(disk) = SmallDisk::mount("2m") else { return };
        let s = SqliteStore::open(&disk.path().join("gpuci.db")).await.unwrap();
        let (_, jobs) = s.create_pipeline(pipeline("p.yml"), vec![job("a")]).await.unwrap();
        let failed =
            || JobChange { state: Some(JobState::Failed), reason: Some("exit 1".into()), ..Default::default() };
        let retry = NewJob { pipeline_id: jobs[0].pipeline_id, attempt: 2, retry_of: Some(jobs[0].id), ..job("a") };

        let filler = disk.fill();
        let e = s.update_job_and_insert(jobs[0].id, &[JobState::Queued], failed(), retry.clone()).await.unwrap_err();
        assert!(e.is_unavailable(), "{e}");
        std::fs::remove_file(filler).unwrap();
        let all = s.pipeline_jobs(jobs[0].pipeline_id).await.unwrap();
        assert_eq!((all.len(), all[0].state), (1, JobState::Queued), "{all:?}");

        let (ended, next) = s.update_job_and_insert(jobs[0].id, &[JobState::Queued], failed(), retry).await.unwrap();
        assert_eq!((ended.state, next.state, next.retry_of), (JobState::Failed, JobState::Queued, Some(ended.id)));
        assert_eq!(s.pipeline_jobs(jobs[0].pipeline_id).await.unwrap().len(), 2);
    }

    /// A file that is not a database says so once, and is recognised as damaged.
    #[tokio::test]
    async fn a_damaged_file_is_refused_and_said_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpuci.db");
        std::fs::write(&path, vec![0x5a; 8192]).unwrap();
        let Err(e) = SqliteStore::open(&path).await else { panic!("a damaged file opened") };
        assert!(e.is_damaged() && !e.is_unavailable(), "{e}");
        let text = e.to_string();
        assert_eq!(text.matches("file is not a database").count(), 1, "{text}");
        assert!(std::error::Error::source(&e).is_none(), "the chain would repeat it: {text}");
    }
}
