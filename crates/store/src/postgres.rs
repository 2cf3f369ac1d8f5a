//! The Postgres backend, for when several coordinators share one database. Same schema (in
//! `migrations/postgres/`), same JSON columns and same semantics as [`SqliteStore`].
//!
//! Durability: every connection sets `synchronous_commit = on`, so a commit has reached the
//! server's WAL on disk before a call returns, whatever the server's default.
//!
//! Concurrency: SQLite gets atomic read-modify-write from its single writer connection. Here
//! many connections (and many coordinators) write at once under READ COMMITTED, so every
//! read-modify-write either locks the row it decides on (`SELECT ... FOR UPDATE` on the job)
//! or lets a constraint decide (the primary key of `gpu_leases`). Each such place says which.
//!
//! [`SqliteStore`]: crate::SqliteStore

use crate::rows::*;
use crate::*;
use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{Postgres, Row};
use std::str::FromStr;
use std::time::Duration;

// One module per area holds that area's SQL, and the `Store` impl below forwards to it. What
// stays in this file: jobs, pipelines, agents, leases and quarantine.
mod assign;
mod audit;
mod connect;
mod github;
mod logs;
mod machines;
mod schedules;
mod secrets;
mod tls;
use assign::{assign_in, assign_set_based, update_job_in};
use audit::insert_audit;
pub use connect::{redact_url, Claim, SoleUseHeld, IDLE_IN_TRANSACTION};
pub use tls::{DbTls, DbTlsVerdict};

crate::rows::row_mappers!(PgRow);

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// A pool of connections to one Postgres database.
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// How the pool connects: [`fence`](Self::fence) opens a new pool with the same options.
    options: PgConnectOptions,
    /// How the first connection was protected, for the coordinator's start-up line.
    tls: DbTls,
}

impl PostgresStore {
    /// A pipeline and its jobs, in `tx`.
    async fn create_in(
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        p: NewPipeline,
        jobs: Vec<NewJob>,
    ) -> Result<(PipelineRecord, Vec<JobRecord>)> {
        let pid: i64 = sqlx::query(
            "INSERT INTO pipelines (file_name, source, workspace_upload, repository, origin, created_at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
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

    async fn job_in<'e, E: sqlx::PgExecutor<'e>>(exec: E, id: JobId) -> Result<Option<JobRecord>> {
        let row =
            sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1")).bind(id).fetch_optional(exec).await?;
        row.map(|r| job_from_row(&r)).transpose()
    }

    /// The job, with its row locked until the transaction ends: concurrent transitions of the
    /// same job (from this or another coordinator) queue here, so the state compared below is
    /// the state the update replaces.
    async fn job_for_update(conn: &mut sqlx::PgConnection, id: JobId) -> Result<JobRecord> {
        let row = sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1 FOR UPDATE"))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
        row.map(|r| job_from_row(&r)).transpose()?.ok_or(StoreError::JobNotFound(id))
    }
}

async fn insert_job_in(conn: &mut sqlx::PgConnection, pipeline_id: PipelineId, j: &NewJob) -> Result<JobId> {
    let step_json = serde_json::to_string(&j.step).map_err(|e| corrupt("step", e))?;
    let env_json = serde_json::to_string(&j.env).map_err(|e| corrupt("env", e))?;
    let id: i64 = sqlx::query(
        "INSERT INTO jobs (pipeline_id, step_key, name, step_json, env_json, state, reason, attempt, retry_of, created_at_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) RETURNING id",
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

/// Quarantine a GPU, or refresh the reason of one already quarantined. A single statement:
/// `ON CONFLICT` makes it atomic against a concurrent quarantine of the same GPU.
async fn upsert_quarantine<'e, E: sqlx::PgExecutor<'e>>(exec: E, q: &Quarantine) -> Result<()> {
    sqlx::query(
        "INSERT INTO gpu_quarantine (gpu_uuid, agent_id, reason, since_ms) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (gpu_uuid) DO UPDATE SET reason = EXCLUDED.reason, since_ms = EXCLUDED.since_ms",
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
impl Store for PostgresStore {
    async fn create_pipeline(&self, p: NewPipeline, jobs: Vec<NewJob>) -> Result<(PipelineRecord, Vec<JobRecord>)> {
        let mut tx = self.pool.begin().await?;
        let made = Self::create_in(&mut tx, p, jobs).await?;
        tx.commit().await?;
        Ok(made)
    }

    async fn create_pipeline_once(&self, p: NewPipeline, jobs: Vec<NewJob>, once: &Submission) -> Result<Created> {
        let mut tx = self.pool.begin().await?;
        if let Some(before) = crate::submissions::postgres::seen(&mut tx, once).await? {
            tx.rollback().await?;
            return Ok(before);
        }
        let now_ms = p.created_at_ms;
        let (pipeline, jobs) = Self::create_in(&mut tx, p, jobs).await?;
        crate::submissions::postgres::record(&mut tx, once, pipeline.id, now_ms).await?;
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
        // The pool's connections carry the fencing epoch: a former leader's batch is refused
        // by the database as a whole (`StoreError::is_fenced`).
        if let Some(out) = assign_set_based(&self.pool, batch, now_ms).await? {
            return Ok(out);
        }
        // A lease raced in by another transaction: job by job, each under a savepoint, so a
        // refused one leaves nothing behind and the others stand.
        let mut tx = self.pool.begin().await?;
        if batch.iter().any(|a| a.token_sha256.is_some()) {
            crate::job_tokens::postgres::sweep_ended(&mut tx).await?;
        }
        let mut out = Vec::with_capacity(batch.len());
        for a in batch {
            sqlx::query("SAVEPOINT item").execute(&mut *tx).await?;
            let assigned = match assign_in(&mut tx, a.job, &a.agent_id, &a.gpus, now_ms).await {
                Ok(_) => match &a.token_sha256 {
                    Some(h) => crate::job_tokens::postgres::put_all_in(&mut tx, &[a.job], &[h.as_str()], now_ms).await,
                    None => Ok(()),
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

    async fn update_jobs(&self, batch: &[JobUpdate]) -> Result<Vec<Result<()>>> {
        let mut tx = self.pool.begin().await?;
        if let Some(out) = assign::update_set_based(&mut tx, batch).await? {
            let ended = crate::update_batch::ended(batch, &out);
            crate::job_tokens::postgres::delete_ended_in(&mut tx, &ended).await?;
            tx.commit().await?;
            return Ok(out);
        }
        let mut out = Vec::with_capacity(batch.len());
        for u in batch {
            sqlx::query("SAVEPOINT item").execute(&mut *tx).await?;
            match update_job_in(&mut tx, u.job, &u.expect, u.change.clone()).await {
                Err(e) if e.refuses_only_the_item() => {
                    sqlx::query("ROLLBACK TO SAVEPOINT item").execute(&mut *tx).await?;
                    out.push(Err(e));
                }
                r => {
                    r?;
                    out.push(Ok(()))
                }
            }
            sqlx::query("RELEASE SAVEPOINT item").execute(&mut *tx).await?;
        }
        let ended = crate::update_batch::ended(batch, &out);
        crate::job_tokens::postgres::delete_ended_in(&mut tx, &ended).await?;
        tx.commit().await?;
        Ok(out)
    }

    async fn set_reasons(&self, reasons: &[(JobId, String)]) -> Result<()> {
        if reasons.is_empty() {
            return Ok(());
        }
        let (ids, texts): (Vec<JobId>, Vec<&str>) = reasons.iter().map(|(id, r)| (*id, r.as_str())).unzip();
        sqlx::query(
            "UPDATE jobs SET reason = r.reason FROM UNNEST($1::bigint[], $2::text[]) AS r(id, reason) \
             WHERE jobs.id = r.id AND jobs.state = 'queued'",
        )
        .bind(ids)
        .bind(texts)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn update_job(&self, id: JobId, expect: &[JobState], c: JobChange) -> Result<JobRecord> {
        let mut tx = self.pool.begin().await?;
        let rec = update_job_in(&mut tx, id, expect, c).await?;
        if rec.state.is_terminal() {
            crate::job_tokens::postgres::delete_ended_in(&mut tx, &[rec.id]).await?;
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
            crate::job_tokens::postgres::delete_ended_in(&mut tx, &[rec.id]).await?;
        }
        let next = insert_job_in(&mut tx, then.pipeline_id, &then).await?;
        let next = Self::job_in(&mut *tx, next).await?.ok_or(StoreError::JobNotFound(next))?;
        tx.commit().await?;
        Ok((rec, next))
    }

    async fn set_reason(&self, id: JobId, reason: &str) -> Result<()> {
        sqlx::query("UPDATE jobs SET reason = $1 WHERE id = $2").bind(reason).bind(id).execute(&self.pool).await?;
        Ok(())
    }

    async fn get_job(&self, id: JobId) -> Result<Option<JobRecord>> {
        Self::job_in(&self.pool, id).await
    }

    async fn list_jobs(&self, f: &JobFilter) -> Result<Vec<JobRecord>> {
        let states: Vec<&str> = f.states.iter().map(|s| s.as_str()).collect();
        let rows = sqlx::query(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs \
             WHERE (cardinality($1::TEXT[]) = 0 OR state = ANY($1)) AND ($2::BIGINT IS NULL OR pipeline_id = $2) \
             AND ($4::BIGINT IS NULL OR id < $4) ORDER BY id DESC LIMIT $3"
        ))
        .bind(states)
        .bind(f.pipeline)
        .bind(i64::from(f.limit.unwrap_or(100)))
        .bind(f.before)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(job_from_row).collect()
    }

    async fn jobs_ran_since(&self, since_ms: i64) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE started_at_ms IS NOT NULL \
             AND (finished_at_ms IS NULL OR finished_at_ms >= $1) ORDER BY id"
        ))
        .bind(since_ms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(job_from_row).collect()
    }

    async fn active_jobs(&self) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE state IN ('queued', 'assigned', 'running') ORDER BY id"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(job_from_row).collect()
    }

    async fn pipeline_jobs(&self, pipeline: PipelineId) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE pipeline_id = $1 ORDER BY id"))
            .bind(pipeline)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(job_from_row).collect()
    }

    async fn get_pipeline(&self, id: PipelineId) -> Result<Option<PipelineRecord>> {
        let row = sqlx::query(&format!("SELECT {PIPELINE_COLUMNS} FROM pipelines WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(pipeline_from_row))
    }

    async fn pipeline_origins(
        &self,
        ids: &[PipelineId],
    ) -> Result<std::collections::HashMap<PipelineId, (Option<String>, Option<String>)>> {
        let rows = sqlx::query("SELECT id, repository, origin FROM pipelines WHERE id = ANY($1)")
            .bind(ids.to_vec())
            .fetch_all(&self.pool)
            .await?;
        let mut out = std::collections::HashMap::new();
        for row in rows {
            out.insert(row.try_get::<i64, _>("id")?, (row.try_get("repository")?, row.try_get("origin")?));
        }
        Ok(out)
    }

    async fn upload_uses(&self, uploads: &[String]) -> Result<Vec<gpuci_core::uploads::PipelineUse>> {
        let rows = sqlx::query(
            "SELECT p.workspace_upload AS upload, p.id AS pipeline_id, \
               (SELECT COUNT(*) FROM jobs j WHERE j.pipeline_id = p.id \
                  AND j.state IN ('queued', 'assigned', 'running')) AS unfinished, \
               GREATEST(p.created_at_ms, COALESCE((SELECT MAX(GREATEST(j.created_at_ms, COALESCE(j.finished_at_ms, 0))) \
                  FROM jobs j WHERE j.pipeline_id = p.id), 0)) AS last_active_ms \
             FROM pipelines p WHERE p.workspace_upload = ANY($1) ORDER BY p.id",
        )
        .bind(uploads.to_vec())
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(upload_use_from_row).collect()
    }

    async fn pipelines_before(&self, before: Option<PipelineId>, limit: u32) -> Result<Vec<PipelineRecord>> {
        let rows =
            sqlx::query(&format!("SELECT {PIPELINE_COLUMNS} FROM pipelines WHERE id < $1 ORDER BY id DESC LIMIT $2"))
                .bind(before.unwrap_or(i64::MAX))
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?;
        Ok(rows.iter().map(pipeline_from_row).collect())
    }

    async fn jobs_of_pipelines(&self, ids: &[PipelineId]) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE pipeline_id = ANY($1) ORDER BY id"))
            .bind(ids.to_vec())
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(job_from_row).collect()
    }

    async fn put_pipeline_build(&self, pipeline: PipelineId, facts: &str) -> Result<()> {
        sqlx::query(
            "INSERT INTO pipeline_builds (pipeline_id, facts) VALUES ($1, $2) \
             ON CONFLICT (pipeline_id) DO UPDATE SET facts = EXCLUDED.facts",
        )
        .bind(pipeline)
        .bind(facts)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn pipeline_builds(&self, ids: &[PipelineId]) -> Result<std::collections::HashMap<PipelineId, String>> {
        let rows = sqlx::query("SELECT pipeline_id, facts FROM pipeline_builds WHERE pipeline_id = ANY($1)")
            .bind(ids.to_vec())
            .fetch_all(&self.pool)
            .await?;
        let mut out = std::collections::HashMap::new();
        for row in rows {
            out.insert(row.try_get::<i64, _>("pipeline_id")?, row.try_get("facts")?);
        }
        Ok(out)
    }

    async fn list_pipelines(&self, limit: u32) -> Result<Vec<PipelineRecord>> {
        let rows = sqlx::query(&format!("SELECT {PIPELINE_COLUMNS} FROM pipelines ORDER BY id DESC LIMIT $1"))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(pipeline_from_row).collect())
    }

    async fn append_logs(&self, job: JobId, first_seq: Option<i64>, lines: &[LogChunk]) -> Result<Vec<LogLine>> {
        PostgresStore::append_logs(self, job, first_seq, lines).await
    }

    async fn read_logs(&self, job: JobId, after_seq: i64, limit: u32) -> Result<Vec<LogLine>> {
        PostgresStore::read_logs(self, job, after_seq, limit).await
    }

    async fn log_extent(&self, job: JobId) -> Result<(u64, i64)> {
        PostgresStore::log_extent(self, job).await
    }

    async fn last_log_lines(&self, jobs: &[JobId]) -> Result<std::collections::HashMap<JobId, i64>> {
        PostgresStore::last_log_lines(self, jobs).await
    }

    async fn insert_agent(&self, a: &AgentRecord) -> Result<()> {
        sqlx::query(
            "INSERT INTO agents (id, name, credential_hash, registered_at_ms, last_seen_ms, state, reason, hello_json) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
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
        let row = sqlx::query("SELECT * FROM agents WHERE id = $1").bind(id).fetch_optional(&self.pool).await?;
        Ok(row.as_ref().map(agent_from_row))
    }

    async fn list_agents(&self) -> Result<Vec<AgentRecord>> {
        // COLLATE "C": byte order, as SQLite's default BINARY collation sorts.
        let rows = sqlx::query(r#"SELECT * FROM agents ORDER BY name COLLATE "C", id COLLATE "C""#)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(agent_from_row).collect())
    }

    async fn update_agent(&self, id: &str, u: AgentUpdate) -> Result<()> {
        let done = sqlx::query(
            "UPDATE agents SET state = COALESCE($1, state), reason = COALESCE($2, reason), \
             last_seen_ms = COALESCE($3, last_seen_ms), hello_json = COALESCE($4, hello_json) WHERE id = $5",
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
        let rows =
            sqlx::query(r#"SELECT gpu_uuid, agent_id, job_id, since_ms FROM gpu_leases ORDER BY gpu_uuid COLLATE "C""#)
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .iter()
            .map(|r| Lease { gpu_uuid: r.get(0), agent_id: r.get(1), job_id: r.get(2), since_ms: r.get(3) })
            .collect())
    }

    async fn quarantined(&self) -> Result<Vec<Quarantine>> {
        let rows = sqlx::query(
            r#"SELECT gpu_uuid, agent_id, reason, since_ms FROM gpu_quarantine ORDER BY gpu_uuid COLLATE "C""#,
        )
        .fetch_all(&self.pool)
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
            sqlx::query("DELETE FROM gpu_quarantine WHERE gpu_uuid = $1").bind(gpu_uuid).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    async fn set_secret(&self, name: &str, value: &str, now_ms: i64) -> Result<()> {
        PostgresStore::set_secret(self, name, value, now_ms).await
    }

    async fn delete_secret(&self, name: &str) -> Result<bool> {
        PostgresStore::delete_secret(self, name).await
    }

    async fn secret_names(&self) -> Result<Vec<(String, i64)>> {
        PostgresStore::secret_names(self).await
    }

    async fn purge_freed_space(&self) -> Result<()> {
        // Rewrites the table, so replaced row versions are gone from its files. Postgres' own
        // WAL segments and base backups keep them until they are recycled.
        sqlx::query("VACUUM FULL secrets").execute(&self.pool).await?;
        Ok(())
    }

    async fn secret_values(&self, names: &[String]) -> Result<std::collections::BTreeMap<String, String>> {
        PostgresStore::secret_values(self, names).await
    }

    async fn set_secret_audited(&self, name: &str, value: &str, now_ms: i64, audit: &NewAudit) -> Result<()> {
        PostgresStore::set_secret_audited(self, name, value, now_ms, audit).await
    }

    async fn delete_secret_audited(&self, name: &str, audit: &NewAudit) -> Result<bool> {
        PostgresStore::delete_secret_audited(self, name, audit).await
    }

    async fn append_audit(&self, entry: &NewAudit) -> Result<AuditRecord> {
        PostgresStore::append_audit(self, entry).await
    }

    async fn audit_log(&self, f: &AuditFilter) -> Result<Vec<AuditRecord>> {
        PostgresStore::audit_log(self, f).await
    }

    async fn create_api_token(&self, t: &ApiTokenRecord, audit: &NewAudit) -> Result<bool> {
        PostgresStore::create_api_token(self, t, audit).await
    }

    async fn revoke_api_token(&self, name: &str, now_ms: i64, audit: &NewAudit) -> Result<bool> {
        PostgresStore::revoke_api_token(self, name, now_ms, audit).await
    }

    async fn api_tokens(&self) -> Result<Vec<ApiTokenRecord>> {
        PostgresStore::api_tokens(self).await
    }

    async fn live_api_token(&self, hash: &str) -> Result<Option<ApiTokenRecord>> {
        PostgresStore::live_api_token(self, hash).await
    }

    async fn record_delivery(&self, delivery: &str, event: &str, now_ms: i64) -> Result<bool> {
        PostgresStore::record_delivery(self, delivery, event, now_ms).await
    }

    async fn queue_delivery(&self, delivery: &str, event: &str, body: &[u8], now_ms: i64) -> Result<bool> {
        PostgresStore::queue_delivery(self, delivery, event, body, now_ms).await
    }

    async fn take_queued_deliveries(&self, limit: u32) -> Result<Vec<QueuedDelivery>> {
        PostgresStore::take_queued_deliveries(self, limit).await
    }

    async fn record_delivery_once(&self, d: &NewDelivery<'_>) -> Result<DeliverySeen> {
        crate::github_replay::postgres::record(&self.pool, d).await
    }

    async fn queue_delivery_once(&self, d: &NewDelivery<'_>, body: &[u8]) -> Result<DeliverySeen> {
        crate::github_replay::postgres::queue(&self.pool, d, body).await
    }

    async fn prune_github_records(&self, before_ms: i64) -> Result<Pruned> {
        crate::github_replay::postgres::prune(&self.pool, before_ms).await
    }

    async fn put_github_tombstone(&self, job_id: i64, action: &str, now_ms: i64) -> Result<()> {
        crate::github_replay::postgres::put_tombstone(&self.pool, job_id, action, now_ms).await
    }

    async fn github_tombstone(&self, job_id: i64) -> Result<Option<String>> {
        crate::github_replay::postgres::tombstone(&self.pool, job_id).await
    }

    async fn insert_github_job(&self, job: &GithubJobRecord) -> Result<bool> {
        PostgresStore::insert_github_job(self, job).await
    }

    async fn put_github_job(&self, job: &GithubJobRecord) -> Result<()> {
        PostgresStore::put_github_job(self, job).await
    }

    async fn get_github_job(&self, id: i64) -> Result<Option<GithubJobRecord>> {
        PostgresStore::get_github_job(self, id).await
    }

    async fn github_jobs(&self, active_only: bool, limit: u32) -> Result<Vec<GithubJobRecord>> {
        PostgresStore::github_jobs(self, active_only, limit).await
    }

    async fn put_runner(&self, r: &RunnerRecord) -> Result<()> {
        PostgresStore::put_runner(self, r).await
    }

    async fn get_runner(&self, name: &str) -> Result<Option<RunnerRecord>> {
        PostgresStore::get_runner(self, name).await
    }

    async fn runners(&self, active_only: bool) -> Result<Vec<RunnerRecord>> {
        PostgresStore::runners(self, active_only).await
    }

    async fn put_approval(&self, a: &ApprovalRecord) -> Result<()> {
        PostgresStore::put_approval(self, a).await
    }

    async fn get_approval(&self, repository: &str, pr: i64, head_sha: &str) -> Result<Option<ApprovalRecord>> {
        PostgresStore::get_approval(self, repository, pr, head_sha).await
    }

    async fn set_check_run(&self, job: JobId, check_run_id: i64) -> Result<()> {
        PostgresStore::set_check_run(self, job, check_run_id).await
    }

    async fn get_check_run(&self, job: JobId) -> Result<Option<i64>> {
        PostgresStore::get_check_run(self, job).await
    }

    async fn put_machine(&self, m: &MachineRecord) -> Result<()> {
        PostgresStore::put_machine(self, m).await
    }

    async fn arm_schedule(&self, name: &str, now_ms: i64) -> Result<i64> {
        PostgresStore::arm_schedule(self, name, now_ms).await
    }

    async fn schedule_checked(&self, name: &str, now_ms: i64) -> Result<()> {
        PostgresStore::schedule_checked(self, name, now_ms).await
    }

    async fn schedules_last_checked(&self) -> Result<Option<i64>> {
        PostgresStore::schedules_last_checked(self).await
    }

    async fn record_schedule_fire(&self, f: &ScheduleFireRecord) -> Result<Option<i64>> {
        PostgresStore::record_schedule_fire(self, f).await
    }

    async fn finish_schedule_fire(&self, id: i64, pipeline: Option<PipelineId>, error: Option<&str>) -> Result<()> {
        PostgresStore::finish_schedule_fire(self, id, pipeline, error).await
    }

    async fn interrupt_schedule_fires(&self, error: &str) -> Result<u64> {
        PostgresStore::interrupt_schedule_fires(self, error).await
    }

    async fn last_cron_fire(&self, name: &str) -> Result<Option<i64>> {
        PostgresStore::last_cron_fire(self, name).await
    }

    async fn schedule_fires(&self, name: Option<&str>, limit: u32) -> Result<Vec<ScheduleFireRecord>> {
        PostgresStore::schedule_fires(self, name, limit).await
    }

    async fn machines(&self, active_only: bool) -> Result<Vec<MachineRecord>> {
        PostgresStore::machines(self, active_only).await
    }

    async fn open_billing(&self, machine: &str, from_ms: i64) -> Result<()> {
        PostgresStore::open_billing(self, machine, from_ms).await
    }

    async fn close_billing(&self, machine: &str, to_ms: i64) -> Result<()> {
        PostgresStore::close_billing(self, machine, to_ms).await
    }

    async fn billing_since(&self, since_ms: i64) -> Result<Vec<BillingInterval>> {
        PostgresStore::billing_since(self, since_ms).await
    }

    async fn put_artifact(&self, a: &ArtifactRecord) -> Result<()> {
        crate::artifacts::postgres::put(&self.pool, a).await
    }

    async fn job_artifacts(&self, job: JobId) -> Result<Vec<ArtifactRecord>> {
        crate::artifacts::postgres::of_job(&self.pool, job).await
    }

    async fn all_artifacts(&self) -> Result<Vec<ArtifactRecord>> {
        crate::artifacts::postgres::all(&self.pool).await
    }

    async fn repository_artifact_bytes(&self, repository: Option<&str>, untrusted: bool) -> Result<u64> {
        crate::artifacts::postgres::repository_bytes(&self.pool, repository, untrusted).await
    }

    async fn delete_artifacts(&self, keys: &[(JobId, String)]) -> Result<()> {
        crate::artifacts::postgres::delete(&self.pool, keys).await
    }

    async fn put_test_report(&self, r: &TestReportRecord) -> Result<()> {
        crate::artifacts::postgres_reports::put(&self.pool, r).await
    }

    async fn job_test_reports(&self, job: JobId) -> Result<Vec<TestReportRecord>> {
        crate::artifacts::postgres_reports::of_job(&self.pool, job).await
    }

    async fn put_job_tokens(&self, tokens: &[(JobId, String)], now_ms: i64) -> Result<()> {
        crate::job_tokens::postgres::put(&self.pool, tokens, now_ms).await
    }

    async fn job_token(&self, job: JobId) -> Result<Option<crate::JobTokenRecord>> {
        crate::job_tokens::postgres::get(&self.pool, job).await
    }

    async fn delete_job_token(&self, job: JobId) -> Result<()> {
        crate::job_tokens::postgres::delete(&self.pool, job).await
    }

    async fn coordinator_identity(&self, new: &crate::StoredIdentity, now_ms: i64) -> Result<crate::StoredIdentity> {
        crate::coordinator_identity::postgres::get_or_put(&self.pool, new, now_ms).await
    }

    async fn stored_identity(&self) -> Result<Option<crate::StoredIdentity>> {
        crate::coordinator_identity::postgres::get(&self.pool).await
    }

    async fn coordinator_state(&self, name: &str) -> Result<Option<String>> {
        crate::coordinator_state::postgres::get(&self.pool, name).await
    }

    async fn put_coordinator_state(&self, name: &str, json: &str, now_ms: i64) -> Result<()> {
        crate::coordinator_state::postgres::put(&self.pool, name, json, now_ms).await
    }

    async fn count_failed_upload(&self, job: JobId) -> Result<()> {
        crate::job_tokens::postgres::count_failed(&self.pool, job).await
    }

    async fn add_uploaded_jobs(
        &self,
        by: JobId,
        jobs: Vec<NewJob>,
        max_uploads: u32,
    ) -> Result<Option<Vec<JobRecord>>> {
        let mut tx = self.pool.begin().await?;
        if !crate::job_tokens::postgres::count_upload(&mut tx, by, max_uploads).await? {
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
}

fn upload_use_from_row(r: &PgRow) -> Result<gpuci_core::uploads::PipelineUse> {
    Ok(gpuci_core::uploads::PipelineUse {
        upload: r.try_get("upload")?,
        pipeline_id: r.try_get("pipeline_id")?,
        unfinished_jobs: u64::try_from(r.try_get::<i64, _>("unfinished")?).unwrap_or(0),
        last_active_ms: r.try_get("last_active_ms")?,
    })
}
