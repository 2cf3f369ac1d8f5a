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

crate::rows::row_mappers!(PgRow);

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// A pool of connections to one Postgres database.
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// How the pool connects: [`fence`](Self::fence) opens a new pool with the same options.
    options: PgConnectOptions,
}

impl PostgresStore {
    /// Connect to `url` (`postgres://user:password@host:port/database`) and run pending
    /// migrations. Migrations take Postgres's advisory lock, so coordinators starting together
    /// apply them once.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, false, i64::MAX).await
    }

    /// As [`connect_existing`](Self::connect_existing), as a coordinator whose newest
    /// migration is `newest` would: the rolling-upgrade tests' stand-in for the previous version.
    pub async fn connect_as_of(url: &str, newest: i64) -> Result<Self> {
        Self::connect_with(url, true, newest).await
    }

    /// As [`connect`](Self::connect), but refuses ([`StoreError::NotGpuci`], before anything
    /// is written) a database without gpuci's tables: for a coordinator whose data dir shows
    /// it ran before, an empty database means the wrong one, not a first start.
    pub async fn connect_existing(url: &str) -> Result<Self> {
        Self::connect_with(url, true, i64::MAX).await
    }

    async fn connect_with(url: &str, existing: bool, newest: i64) -> Result<Self> {
        let options =
            PgConnectOptions::from_str(url)?.application_name("gpuci").options([("synchronous_commit", "on")]);
        let pool = Self::pool(options.clone()).await?;
        if existing {
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT table_name::text FROM information_schema.tables \
                 WHERE table_schema = current_schema() ORDER BY table_name",
            )
            .fetch_all(&pool)
            .await?;
            if !tables.iter().any(|t| t == "jobs") {
                return Err(StoreError::NotGpuci(tables));
            }
        }
        // Under Postgres's advisory lock, as sqlx takes it for the migrations themselves, so a
        // coordinator of the next version migrating at the same moment is seen whole or not at all.
        let m = crate::compat::migrator(&MIGRATOR, newest);
        let mut lock = pool.acquire().await?;
        sqlx::query("SELECT pg_advisory_lock(7460656)").execute(&mut *lock).await?;
        let checked = async {
            let applied: Option<i64> = sqlx::query_scalar(
                "SELECT MAX(version) FROM _sqlx_migrations WHERE to_regclass('_sqlx_migrations') IS NOT NULL",
            )
            .fetch_one(&mut *lock)
            .await
            .ok()
            .flatten();
            let oldest: Option<i64> = if applied.is_some() {
                sqlx::query_scalar(
                    "SELECT oldest_reader FROM schema_compat WHERE id = 1 AND to_regclass('schema_compat') IS NOT NULL",
                )
                .fetch_optional(&mut *lock)
                .await
                .ok()
                .flatten()
            } else {
                None
            };
            crate::compat::decide(applied, crate::compat::newest(&m), oldest).map_err(StoreError::TooOld)
        }
        .await;
        let _ = sqlx::query("SELECT pg_advisory_unlock(7460656)").execute(&mut *lock).await;
        drop(lock);
        checked?;
        m.run(&pool).await?;
        Ok(Self { pool, options })
    }

    async fn pool(options: PgConnectOptions) -> Result<PgPool> {
        Ok(PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?)
    }

    /// This store with every write fenced by `epoch`, the one [`claim_sole_use`] returned: its
    /// connections carry the epoch, and the database refuses each of their writes once another
    /// coordinator has claimed the database since ([`StoreError::is_fenced`]; the trigger in
    /// `migrations/postgres/0013_fencing.sql`). The unfenced pool is closed.
    ///
    /// [`claim_sole_use`]: Self::claim_sole_use
    ///
    /// The fenced sessions are also ended by the server when they sit inside a transaction
    /// for [`IDLE_IN_TRANSACTION`] (the coordinator frozen or cut off mid-write): the rows they
    /// hold, the claim's among them, would otherwise keep a standby from taking over for as
    /// long as the freeze lasts (outsider attack: for ever under SIGSTOP, two hours of TCP
    /// keepalive when cut off). The transaction is rolled back; nothing half-written stays.
    pub async fn fence(self, epoch: i64) -> Result<Self> {
        let options = self.options.clone().options([
            ("gpuci.epoch", epoch.to_string()),
            ("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION.as_millis().to_string()),
        ]);
        let pool = Self::pool(options.clone()).await?;
        self.pool.close().await;
        Ok(Self { pool, options })
    }

    /// Claim this database for one coordinator, as `holder` (its host and data dir) in
    /// `process` (this run). The store is safe under concurrent writers, but a coordinator
    /// keeps its agents' links in memory, and two on one database each declared the other's
    /// agents lost; until coordinators share agents, there is one per database. A claim is a
    /// row renewed every few seconds ([`renew_sole_use`](Self::renew_sole_use)); it passes to
    /// another holder only once it is older than `lease`, and at once to the same holder (the
    /// same coordinator restarted: its data dir lock shows the old run is gone). A row, not
    /// an advisory lock: that lived on one connection, and a Postgres restart or a dropped
    /// connection gave it up silently while the coordinator ran on (outsider attack).
    /// `Err(SoleUseHeld)`: another holds it.
    pub async fn claim_sole_use(
        &self,
        holder: &str,
        process: &str,
        lease: Duration,
    ) -> Result<std::result::Result<Claim, SoleUseHeld>> {
        self.claim(holder, process, lease, false).await
    }

    /// As [`claim_sole_use`](Self::claim_sole_use) for a standby: only a lapsed claim passes,
    /// even one of the same holder (a copy of the leader's data dir on another machine, a
    /// restored backup, a cloned VM: the data dir lock cannot tell a live leader there).
    pub async fn claim_as_standby(
        &self,
        holder: &str,
        process: &str,
        lease: Duration,
    ) -> Result<std::result::Result<Claim, SoleUseHeld>> {
        self.claim(holder, process, lease, true).await
    }

    async fn claim(
        &self,
        holder: &str,
        process: &str,
        lease: Duration,
        standby: bool,
    ) -> Result<std::result::Result<Claim, SoleUseHeld>> {
        // The claim waits for writes under way (they hold its row in share mode), but not for
        // ever: a leader frozen inside a transaction holds it until its session is ended
        // (`idle_in_transaction_session_timeout`, see `fence`); meanwhile this fails as
        // transient and the caller asks again. Its age is judged by the clock when the row is
        // finally updated (`clock_timestamp()`), not when this statement began to wait.
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET LOCAL lock_timeout = '1s'").execute(&mut *tx).await?;
        let claimed: Option<i64> = sqlx::query_scalar(
            "INSERT INTO coordinator_lease (id, holder, process, renewed_at, epoch) \
             VALUES (1, $1, $2, clock_timestamp(), 1) \
             ON CONFLICT (id) DO UPDATE SET holder = EXCLUDED.holder, process = EXCLUDED.process, \
                renewed_at = clock_timestamp(), epoch = coordinator_lease.epoch + 1 \
             WHERE (coordinator_lease.holder = EXCLUDED.holder AND NOT $4) \
                OR coordinator_lease.renewed_at < clock_timestamp() - make_interval(secs => $3) \
             RETURNING epoch",
        )
        .bind(holder)
        .bind(process)
        .bind(lease.as_secs_f64())
        .bind(standby)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        if let Some(epoch) = claimed {
            return Ok(Ok(Claim { epoch }));
        }
        let row = sqlx::query(
            "SELECT holder, process, EXTRACT(EPOCH FROM clock_timestamp() - renewed_at)::float8 AS age \
             FROM coordinator_lease WHERE id = 1",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Err(SoleUseHeld {
            holder: row.try_get("holder")?,
            process: row.try_get("process")?,
            renewed_secs_ago: row.try_get::<f64, _>("age")?.max(0.0),
        }))
    }

    /// Renew this process's claim. `false`: it is no longer this process's (it lapsed and
    /// another took it): the coordinator must stop.
    pub async fn renew_sole_use(&self, holder: &str, process: &str) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE coordinator_lease SET renewed_at = clock_timestamp() WHERE id = 1 AND holder = $1 AND process = $2",
        )
        .bind(holder)
        .bind(process)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
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

/// How long a leader's session may sit inside a transaction before the server ends it
/// ([`PostgresStore::fence`]): a takeover waits at most this long for a frozen leader.
pub const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

/// A claim made ([`PostgresStore::claim_sole_use`]): `epoch` counts the claims ever made on
/// the database, this one included; [`PostgresStore::fence`] makes the store's writes carry it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Claim {
    pub epoch: i64,
}

/// Who holds the database ([`PostgresStore::claim_sole_use`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SoleUseHeld {
    pub holder: String,
    pub process: String,
    pub renewed_secs_ago: f64,
}

/// `url` with its password replaced by `***`, for logs and error messages.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else { return url.to_string() };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else { return url.to_string() };
    let Some(colon) = authority[..at].find(':') else { return url.to_string() };
    format!("{}{}:***{}", &url[..scheme_end], &authority[..colon], &rest[at..])
}

fn bind_github_job<'q>(
    q: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    j: &'q GithubJobRecord,
) -> Result<sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>> {
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

async fn lease_holder(conn: &mut sqlx::PgConnection, gpu: &str) -> Result<Option<JobId>> {
    let row = sqlx::query("SELECT job_id FROM gpu_leases WHERE gpu_uuid = $1").bind(gpu).fetch_optional(conn).await?;
    Ok(row.map(|r| r.get(0)))
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

/// The writes of [`Store::assign_job`], inside the caller's transaction. A refusal may
/// follow leases already taken: the caller rolls back (the transaction, or a savepoint).
async fn assign_in(
    conn: &mut sqlx::PgConnection,
    id: JobId,
    agent_id: &str,
    gpus: &[String],
    now_ms: i64,
) -> Result<JobRecord> {
    // The job row lock makes queued → assigned a compare-and-set: a second assignment of
    // the same job waits here and then finds it no longer queued.
    let cur = PostgresStore::job_for_update(&mut *conn, id).await?;
    if cur.state != JobState::Queued {
        return Err(StoreError::Conflict { job: id, expected: "queued".into(), found: cur.state });
    }
    // Leases already held: the same error, naming the same GPU, as SQLite.
    for g in gpus {
        if let Some(holder) = lease_holder(&mut *conn, g).await? {
            return Err(StoreError::GpuLeased { gpu: g.clone(), holder });
        }
    }
    // Take them in sorted order, so two assignments racing for overlapping GPUs wait on
    // each other instead of deadlocking.
    let mut sorted: Vec<&String> = gpus.iter().collect();
    sorted.sort();
    for g in sorted {
        // The primary key on gpu_uuid decides who gets a GPU, not the look-up above: an
        // insert racing another transaction's uncommitted lease of the same GPU waits for
        // it, then does nothing if that one committed. Returning early leaves the leases already
        // taken to the caller's rollback.
        loop {
            let inserted = sqlx::query(
                "INSERT INTO gpu_leases (gpu_uuid, agent_id, job_id, since_ms) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (gpu_uuid) DO NOTHING",
            )
            .bind(g)
            .bind(agent_id)
            .bind(id)
            .bind(now_ms)
            .execute(&mut *conn)
            .await?
            .rows_affected();
            if inserted == 1 {
                break;
            }
            if let Some(holder) = lease_holder(&mut *conn, g).await? {
                return Err(StoreError::GpuLeased { gpu: g.clone(), holder });
            }
            // Released between the insert and the look-up: try again.
        }
    }
    let gpus_json = serde_json::to_string(gpus).map_err(|e| corrupt("gpus", e))?;
    sqlx::query(
        "UPDATE jobs SET state = 'assigned', reason = $1, agent_id = $2, gpus_json = $3, assigned_at_ms = $4 \
         WHERE id = $5",
    )
    .bind(format!("assigned to agent {agent_id}"))
    .bind(agent_id)
    .bind(gpus_json)
    .bind(now_ms)
    .bind(id)
    .execute(&mut *conn)
    .await?;
    PostgresStore::job_in(&mut *conn, id).await?.ok_or(StoreError::JobNotFound(id))
}

/// [`Store::assign_jobs`] in a handful of statements whatever the batch's size (one round
/// trip per job and GPU made a pass of 1,000 cost thousands): lock the batch's jobs, read the
/// leases of its GPUs, decide each assignment in order as [`assign_in`] would, then write the
/// accepted ones set-based. `None` (nothing written) when another transaction leased one of
/// the GPUs between the read and the write: the caller goes job by job.
async fn assign_set_based(
    pool: &PgPool,
    batch: &[NewAssignment],
    now_ms: i64,
) -> Result<Option<Vec<Result<JobRecord>>>> {
    use std::collections::HashMap;
    let mut tx = pool.begin().await?;
    if batch.iter().any(|a| a.token_sha256.is_some()) {
        crate::job_tokens::postgres::sweep_ended(&mut tx).await?;
    }
    let ids: Vec<JobId> = batch.iter().map(|a| a.job).collect();
    // Locked in id order: two batches over the same jobs wait, never deadlock.
    let rows = sqlx::query("SELECT id, state FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE")
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
    let mut state: HashMap<JobId, JobState> = HashMap::with_capacity(rows.len());
    for r in &rows {
        let text: String = r.get(1);
        let s: JobState = text.parse().map_err(|e| corrupt("state", e))?;
        state.insert(r.get(0), s);
    }
    let all_gpus: Vec<&str> = batch.iter().flat_map(|a| a.gpus.iter().map(String::as_str)).collect();
    let mut held: HashMap<String, JobId> =
        sqlx::query("SELECT gpu_uuid, job_id FROM gpu_leases WHERE gpu_uuid = ANY($1)")
            .bind(&all_gpus)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
    // Each answer: the index of its accepted assignment, or why it was refused.
    let mut decided: Vec<std::result::Result<usize, StoreError>> = Vec::with_capacity(batch.len());
    let mut accepted: Vec<&NewAssignment> = Vec::new();
    for a in batch {
        let refused = match state.get(&a.job) {
            None => Some(StoreError::JobNotFound(a.job)),
            Some(s) if *s != JobState::Queued => {
                Some(StoreError::Conflict { job: a.job, expected: "queued".into(), found: *s })
            }
            Some(_) => {
                a.gpus.iter().find_map(|g| held.get(g).map(|h| StoreError::GpuLeased { gpu: g.clone(), holder: *h }))
            }
        };
        match refused {
            Some(e) => decided.push(Err(e)),
            None => {
                for g in &a.gpus {
                    held.insert(g.clone(), a.job);
                }
                state.insert(a.job, JobState::Assigned);
                decided.push(Ok(accepted.len()));
                accepted.push(a);
            }
        }
    }
    if !accepted.is_empty() {
        let (mut gpu, mut agent, mut job) = (Vec::new(), Vec::new(), Vec::new());
        for a in &accepted {
            for g in &a.gpus {
                gpu.push(g.as_str());
                agent.push(a.agent_id.as_str());
                job.push(a.job);
            }
        }
        let leased = sqlx::query(
            "INSERT INTO gpu_leases (gpu_uuid, agent_id, job_id, since_ms) \
             SELECT g, a, j, $4 FROM UNNEST($1::text[], $2::text[], $3::bigint[]) AS l(g, a, j) \
             ON CONFLICT (gpu_uuid) DO NOTHING",
        )
        .bind(&gpu)
        .bind(&agent)
        .bind(&job)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if leased != gpu.len() as u64 {
            tx.rollback().await?;
            return Ok(None);
        }
        let mut ids = Vec::with_capacity(accepted.len());
        let (mut reasons, mut agents, mut gpus_json) = (Vec::new(), Vec::new(), Vec::new());
        for a in &accepted {
            ids.push(a.job);
            reasons.push(format!("assigned to agent {}", a.agent_id));
            agents.push(a.agent_id.as_str());
            gpus_json.push(serde_json::to_string(&a.gpus).map_err(|e| corrupt("gpus", e))?);
        }
        sqlx::query(
            "UPDATE jobs SET state = 'assigned', reason = u.reason, agent_id = u.agent, gpus_json = u.gpus, \
             assigned_at_ms = $5 FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[]) AS u(id, reason, agent, gpus) \
             WHERE jobs.id = u.id",
        )
        .bind(&ids)
        .bind(&reasons)
        .bind(&agents)
        .bind(&gpus_json)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        // The job tokens of the accepted ones (each job at most once: a second assignment of
        // a job in the batch was refused above).
        let (tokened, hashes): (Vec<JobId>, Vec<&str>) =
            accepted.iter().filter_map(|a| a.token_sha256.as_deref().map(|h| (a.job, h))).unzip();
        crate::job_tokens::postgres::put_all_in(&mut tx, &tokened, &hashes, now_ms).await?;
    }
    let ids: Vec<JobId> = accepted.iter().map(|a| a.job).collect();
    let mut records: HashMap<JobId, JobRecord> = HashMap::with_capacity(ids.len());
    if !ids.is_empty() {
        for r in sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ANY($1)"))
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await?
        {
            let rec = job_from_row(&r)?;
            records.insert(rec.id, rec);
        }
    }
    tx.commit().await?;
    let out = decided
        .into_iter()
        .map(|d| match d {
            Ok(i) => records.remove(&accepted[i].job).ok_or(StoreError::JobNotFound(accepted[i].job)),
            Err(e) => Err(e),
        })
        .collect();
    Ok(Some(out))
}

/// The change of [`Store::update_job`], inside the caller's transaction.
async fn update_job_in(tx: &mut sqlx::PgConnection, id: JobId, expect: &[JobState], c: JobChange) -> Result<JobRecord> {
    // Locked until commit: the state checked is the state replaced (compare-and-set).
    let cur = PostgresStore::job_for_update(&mut *tx, id).await?;
    if !expect.is_empty() && !expect.contains(&cur.state) {
        let expected = expect.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("|");
        return Err(StoreError::Conflict { job: id, expected, found: cur.state });
    }
    let telemetry = c.telemetry.as_ref().map(serde_json::to_string).transpose().map_err(|e| corrupt("telemetry", e))?;
    let unenforced =
        c.unenforced.as_ref().map(serde_json::to_string).transpose().map_err(|e| corrupt("unenforced", e))?;
    sqlx::query(
        "UPDATE jobs SET state = COALESCE($1, state), reason = COALESCE($2, reason), \
         started_at_ms = COALESCE($3, started_at_ms), finished_at_ms = COALESCE($4, finished_at_ms), \
         exit_code = COALESCE($5, exit_code), telemetry_json = COALESCE($6, telemetry_json), \
         unenforced_json = COALESCE($7, unenforced_json) WHERE id = $8",
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
            "UPDATE jobs SET agent_id = NULL, gpus_json = '[]', assigned_at_ms = NULL, unenforced_json = NULL WHERE id = $1",
        )
            .bind(id)
            .execute(&mut *tx)
            .await?;
    }
    if c.release_leases || c.clear_assignment {
        sqlx::query("DELETE FROM gpu_leases WHERE job_id = $1").bind(id).execute(&mut *tx).await?;
    }
    for q in &c.quarantine {
        upsert_quarantine(&mut *tx, q).await?;
    }
    PostgresStore::job_in(&mut *tx, id).await?.ok_or(StoreError::JobNotFound(id))
}

#[async_trait]
impl Store for PostgresStore {
    async fn create_pipeline(&self, p: NewPipeline, jobs: Vec<NewJob>) -> Result<(PipelineRecord, Vec<JobRecord>)> {
        let mut tx = self.pool.begin().await?;
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
                Ok(rec) => match &a.token_sha256 {
                    Some(h) => crate::job_tokens::postgres::put_all_in(&mut tx, &[a.job], &[h.as_str()], now_ms)
                        .await
                        .map(|()| rec),
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
        if reasons.is_empty() {
            return Ok(());
        }
        let (ids, texts): (Vec<JobId>, Vec<&str>) = reasons.iter().map(|(id, r)| (*id, r.as_str())).unzip();
        sqlx::query("UPDATE jobs SET reason = r.reason FROM UNNEST($1::bigint[], $2::text[]) AS r(id, reason) WHERE jobs.id = r.id")
            .bind(ids)
            .bind(texts)
            .execute(&self.pool)
            .await?;
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
        if lines.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.pool.begin().await?;
        // Sequence numbers are MAX(seq) + 1..: two appends to the same job must not read the
        // same MAX. Locking the job's row serialises them (per job; other jobs' logs don't
        // wait). With no such job nothing is locked and the insert below fails on the foreign
        // key, as in SQLite.
        let state: Option<String> = sqlx::query("SELECT state FROM jobs WHERE id = $1 FOR UPDATE")
            .bind(job)
            .fetch_optional(&mut *tx)
            .await?
            .map(|r| r.get(0));
        if first_seq.is_some()
            && state.as_deref().and_then(|s| s.parse::<JobState>().ok()).is_some_and(JobState::is_terminal)
        {
            // See the trait: an ended job's log takes no more of its agent's lines.
            return Ok(Vec::new());
        }
        let last: i64 = sqlx::query("SELECT COALESCE(MAX(seq), 0) FROM job_logs WHERE job_id = $1")
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
            "SELECT seq, ts_us, stream, text FROM job_logs WHERE job_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(job)
        .bind(after_seq)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
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
        let row = sqlx::query("SELECT COALESCE(SUM(octet_length(text) + $2), 0)::BIGINT, COALESCE(MAX(seq), 0)::BIGINT FROM job_logs WHERE job_id = $1")
            .bind(job)
            .bind(gpuci_protocol::agent::LOG_LINE_COST as i64)
            .fetch_one(&self.pool)
            .await?;
        let (bytes, last): (i64, i64) = (row.get(0), row.get(1));
        Ok((bytes.max(0) as u64, last))
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
        sqlx::query(
            "INSERT INTO secrets (name, value, updated_at_ms) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value, updated_at_ms = EXCLUDED.updated_at_ms",
        )
        .bind(name)
        .bind(value)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn delete_secret(&self, name: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM secrets WHERE name = $1").bind(name).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    async fn secret_names(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query(r#"SELECT name, updated_at_ms FROM secrets ORDER BY name COLLATE "C""#)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    async fn purge_freed_space(&self) -> Result<()> {
        // Rewrites the table, so replaced row versions are gone from its files. Postgres' own
        // WAL segments and base backups keep them until they are recycled.
        sqlx::query("VACUUM FULL secrets").execute(&self.pool).await?;
        Ok(())
    }

    async fn secret_values(&self, names: &[String]) -> Result<std::collections::BTreeMap<String, String>> {
        let rows = sqlx::query("SELECT name, value FROM secrets WHERE name = ANY($1)")
            .bind(names)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    async fn set_secret_audited(&self, name: &str, value: &str, now_ms: i64, audit: &NewAudit) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO secrets (name, value, updated_at_ms) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value, updated_at_ms = EXCLUDED.updated_at_ms",
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
        let done = sqlx::query("DELETE FROM secrets WHERE name = $1").bind(name).execute(&mut *tx).await?;
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
             WHERE ($1::BIGINT IS NULL OR at_ms >= $1) \
             AND ($2::TEXT IS NULL OR action = $2 OR action LIKE $3 ESCAPE '\\') \
             AND ($4::TEXT IS NULL OR actor = $4) ORDER BY id DESC LIMIT $5",
        )
        .bind(f.since_ms)
        .bind(&f.action)
        .bind(f.action_prefix())
        .bind(&f.actor)
        .bind(f.limit())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(audit_from_row).collect())
    }

    async fn create_api_token(&self, t: &ApiTokenRecord, audit: &NewAudit) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query(
            "INSERT INTO api_tokens (name, hash, created_at_ms, created_by, revoked_at_ms) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
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
        let done = sqlx::query("UPDATE api_tokens SET revoked_at_ms = $1 WHERE name = $2 AND revoked_at_ms IS NULL")
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
        let rows = sqlx::query(
            r#"SELECT name, hash, created_at_ms, created_by, revoked_at_ms FROM api_tokens ORDER BY name COLLATE "C""#,
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(token_from_row).collect())
    }

    async fn live_api_token(&self, hash: &str) -> Result<Option<ApiTokenRecord>> {
        let row = sqlx::query(
            "SELECT name, hash, created_at_ms, created_by, revoked_at_ms FROM api_tokens \
             WHERE hash = $1 AND revoked_at_ms IS NULL",
        )
        .bind(hash)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(token_from_row))
    }

    async fn record_delivery(&self, delivery: &str, event: &str, now_ms: i64) -> Result<bool> {
        let done = sqlx::query(
            "INSERT INTO github_deliveries (delivery, event, received_at_ms) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
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
            "INSERT INTO github_jobs ({GITHUB_JOB_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) \
             ON CONFLICT DO NOTHING"
        );
        let done = bind_github_job(sqlx::query(&sql), job)?.execute(&self.pool).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn put_github_job(&self, job: &GithubJobRecord) -> Result<()> {
        // SQLite's INSERT OR REPLACE: the primary key is the only unique constraint here.
        let sql = format!(
            "INSERT INTO github_jobs ({GITHUB_JOB_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) \
             ON CONFLICT (id) DO UPDATE SET repository = EXCLUDED.repository, run_id = EXCLUDED.run_id, \
             name = EXCLUDED.name, labels = EXCLUDED.labels, pool = EXCLUDED.pool, state = EXCLUDED.state, \
             runner_job_id = EXCLUDED.runner_job_id, runner_name = EXCLUDED.runner_name, reason = EXCLUDED.reason, \
             queued_at_ms = EXCLUDED.queued_at_ms, updated_at_ms = EXCLUDED.updated_at_ms, \
             runner_exits = EXCLUDED.runner_exits, last_runner_exit = EXCLUDED.last_runner_exit, \
             check_failures = EXCLUDED.check_failures, retry_at_ms = EXCLUDED.retry_at_ms"
        );
        bind_github_job(sqlx::query(&sql), job)?.execute(&self.pool).await?;
        Ok(())
    }

    async fn get_github_job(&self, id: i64) -> Result<Option<GithubJobRecord>> {
        let sql = format!("SELECT {GITHUB_JOB_COLUMNS} FROM github_jobs WHERE id = $1");
        let row = sqlx::query(&sql).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(github_job_from_row).transpose()
    }

    async fn github_jobs(&self, active_only: bool, limit: u32) -> Result<Vec<GithubJobRecord>> {
        let filter = if active_only { "WHERE state IN ('queued', 'in_progress')" } else { "" };
        let sql = format!(
            "SELECT {GITHUB_JOB_COLUMNS} FROM github_jobs {filter} ORDER BY queued_at_ms DESC, id DESC LIMIT $1"
        );
        let rows = sqlx::query(&sql).bind(i64::from(limit)).fetch_all(&self.pool).await?;
        rows.iter().map(github_job_from_row).collect()
    }

    async fn put_runner(&self, r: &RunnerRecord) -> Result<()> {
        // SQLite's INSERT OR REPLACE removes every row the new one conflicts with, on the name
        // or on the unique job_id. Same here: drop a row holding this job under another name,
        // then upsert by name, in one transaction.
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM github_runners WHERE job_id = $1 AND name <> $2")
            .bind(r.job_id)
            .bind(&r.name)
            .execute(&mut *tx)
            .await?;
        let sql = format!(
            "INSERT INTO github_runners ({RUNNER_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
             ON CONFLICT (name) DO UPDATE SET job_id = EXCLUDED.job_id, pool = EXCLUDED.pool, \
             repository = EXCLUDED.repository, org = EXCLUDED.org, runner_id = EXCLUDED.runner_id, \
             github_job_id = EXCLUDED.github_job_id, state = EXCLUDED.state, \
             created_at_ms = EXCLUDED.created_at_ms, updated_at_ms = EXCLUDED.updated_at_ms"
        );
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
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn get_runner(&self, name: &str) -> Result<Option<RunnerRecord>> {
        let sql = format!("SELECT {RUNNER_COLUMNS} FROM github_runners WHERE name = $1");
        let row = sqlx::query(&sql).bind(name).fetch_optional(&self.pool).await?;
        Ok(row.as_ref().map(runner_from_row))
    }

    async fn runners(&self, active_only: bool) -> Result<Vec<RunnerRecord>> {
        let filter = if active_only { "WHERE state NOT IN ('done', 'removed')" } else { "" };
        let sql =
            format!(r#"SELECT {RUNNER_COLUMNS} FROM github_runners {filter} ORDER BY created_at_ms, name COLLATE "C""#);
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(runner_from_row).collect())
    }

    async fn put_approval(&self, a: &ApprovalRecord) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO github_approvals (repository, pr, head_sha, approved_by, approved_at_ms) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (repository, pr, head_sha) DO UPDATE SET \
             approved_by = EXCLUDED.approved_by, approved_at_ms = EXCLUDED.approved_at_ms",
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
             WHERE repository = $1 AND pr = $2 AND head_sha = $3",
        )
        .bind(repository)
        .bind(pr)
        .bind(head_sha)
        .fetch_optional(&self.pool)
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
        sqlx::query(
            "INSERT INTO github_checks (job_id, check_run_id) VALUES ($1, $2) \
             ON CONFLICT (job_id) DO UPDATE SET check_run_id = EXCLUDED.check_run_id",
        )
        .bind(job)
        .bind(check_run_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn get_check_run(&self, job: JobId) -> Result<Option<i64>> {
        let row = sqlx::query("SELECT check_run_id FROM github_checks WHERE job_id = $1")
            .bind(job)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.get(0)))
    }

    async fn put_machine(&self, m: &MachineRecord) -> Result<()> {
        let sql = format!("INSERT INTO machines ({MACHINE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18) ON CONFLICT (id) DO UPDATE SET fleet = EXCLUDED.fleet, provider_id = EXCLUDED.provider_id, instance_type = EXCLUDED.instance_type, zone = EXCLUDED.zone, capacity = EXCLUDED.capacity, price_per_hour = EXCLUDED.price_per_hour, gpus = EXCLUDED.gpus, state = EXCLUDED.state, reason = EXCLUDED.reason, agent_id = EXCLUDED.agent_id, requested_at_ms = EXCLUDED.requested_at_ms, running_at_ms = EXCLUDED.running_at_ms, connected_at_ms = EXCLUDED.connected_at_ms, first_job_at_ms = EXCLUDED.first_job_at_ms, ended_at_ms = EXCLUDED.ended_at_ms, boot_failed = EXCLUDED.boot_failed, interrupted_at_ms = EXCLUDED.interrupted_at_ms");
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
        sqlx::query("INSERT INTO schedule_state (name, checked_at_ms) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(name)
            .bind(now_ms)
            .execute(&self.pool)
            .await?;
        let row = sqlx::query("SELECT checked_at_ms FROM schedule_state WHERE name = $1")
            .bind(name)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.get("checked_at_ms"))
    }

    async fn schedule_checked(&self, name: &str, now_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO schedule_state (name, checked_at_ms) VALUES ($1, $2) \
             ON CONFLICT (name) DO UPDATE SET checked_at_ms = excluded.checked_at_ms",
        )
        .bind(name)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn schedules_last_checked(&self) -> Result<Option<i64>> {
        let row = sqlx::query("SELECT MAX(checked_at_ms) AS last FROM schedule_state").fetch_one(&self.pool).await?;
        Ok(row.get("last"))
    }

    async fn record_schedule_fire(&self, f: &ScheduleFireRecord) -> Result<Option<i64>> {
        let row = sqlx::query(
            "INSERT INTO schedule_fires (schedule, cause, scheduled_at_ms, fired_at_ms, skipped_from_ms) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING RETURNING id",
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
        sqlx::query("UPDATE schedule_fires SET pipeline_id = $1, error = $2 WHERE id = $3")
            .bind(pipeline)
            .bind(error)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn interrupt_schedule_fires(&self, error: &str) -> Result<u64> {
        let done = sqlx::query("UPDATE schedule_fires SET error = $1 WHERE pipeline_id IS NULL AND error IS NULL")
            .bind(error)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn last_cron_fire(&self, name: &str) -> Result<Option<i64>> {
        let row = sqlx::query(
            "SELECT MAX(scheduled_at_ms) AS last FROM schedule_fires WHERE schedule = $1 AND cause = 'cron'",
        )
        .bind(name)
        .fetch_one(&self.pool)
        .await?;
        Ok(row.get("last"))
    }

    async fn schedule_fires(&self, name: Option<&str>, limit: u32) -> Result<Vec<ScheduleFireRecord>> {
        let rows = sqlx::query(
            "SELECT id, schedule, cause, scheduled_at_ms, fired_at_ms, skipped_from_ms, pipeline_id, error \
             FROM schedule_fires WHERE ($1 IS NULL OR schedule = $2) ORDER BY id DESC LIMIT $3",
        )
        .bind(name)
        .bind(name)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r: &PgRow| ScheduleFireRecord {
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
        let sql =
            format!(r#"SELECT {MACHINE_COLUMNS} FROM machines {filter} ORDER BY requested_at_ms, id COLLATE "C""#);
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(machine_from_row).collect())
    }

    async fn open_billing(&self, machine: &str, from_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO machine_billing (machine_id, from_ms, to_ms) SELECT $1, $2, NULL \
             WHERE NOT EXISTS (SELECT 1 FROM machine_billing WHERE machine_id = $3 AND to_ms IS NULL) \
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
            "UPDATE machine_billing SET to_ms = CASE WHEN $1 < from_ms THEN from_ms ELSE $2 END \
             WHERE machine_id = $3 AND to_ms IS NULL",
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
            "SELECT machine_id, from_ms, to_ms FROM machine_billing WHERE to_ms IS NULL OR to_ms >= $1 \
             ORDER BY from_ms, machine_id",
        )
        .bind(since_ms)
        .fetch_all(&self.pool)
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

/// Append an audit entry inside the caller's transaction; returns its id.
async fn insert_audit(conn: &mut sqlx::PgConnection, a: &NewAudit) -> Result<i64> {
    let row = sqlx::query(
        "INSERT INTO audit_log (at_ms, actor_kind, actor, credential, action, object, outcome) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
    )
    .bind(a.at_ms)
    .bind(&a.actor_kind)
    .bind(&a.actor)
    .bind(&a.credential)
    .bind(&a.action)
    .bind(&a.object)
    .bind(&a.outcome)
    .fetch_one(conn)
    .await?;
    Ok(row.get(0))
}

fn upload_use_from_row(r: &PgRow) -> Result<gpuci_core::uploads::PipelineUse> {
    Ok(gpuci_core::uploads::PipelineUse {
        upload: r.try_get("upload")?,
        pipeline_id: r.try_get("pipeline_id")?,
        unfinished_jobs: u64::try_from(r.try_get::<i64, _>("unfinished")?).unwrap_or(0),
        last_active_ms: r.try_get("last_active_ms")?,
    })
}

fn audit_from_row(r: &PgRow) -> AuditRecord {
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

fn token_from_row(r: &PgRow) -> ApiTokenRecord {
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
    use super::redact_url;

    #[test]
    fn redact_url_hides_only_the_password() {
        assert_eq!(redact_url("postgres://gpuci:s3cr%40t@db:5432/gpuci"), "postgres://gpuci:***@db:5432/gpuci");
        assert_eq!(redact_url("postgres://gpuci@db/gpuci"), "postgres://gpuci@db/gpuci");
        assert_eq!(redact_url("postgres://db/gpuci?user=a"), "postgres://db/gpuci?user=a");
        assert_eq!(redact_url("not a url"), "not a url");
    }
}
