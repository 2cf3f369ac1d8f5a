//! Postgres backend: the writes that assign a job to GPUs and move it between states, each inside
//! the caller's transaction (the `Store` impl in `postgres.rs` owns the transaction and its commit).

use super::*;

async fn lease_holder(conn: &mut sqlx::PgConnection, gpu: &str) -> Result<Option<JobId>> {
    let row = sqlx::query("SELECT job_id FROM gpu_leases WHERE gpu_uuid = $1").bind(gpu).fetch_optional(conn).await?;
    Ok(row.map(|r| r.get(0)))
}

/// The writes of [`Store::assign_job`], inside the caller's transaction. A refusal may
/// follow leases already taken: the caller rolls back (the transaction, or a savepoint).
pub(super) async fn assign_in(
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
    .bind(crate::records::assigned_reason(agent_id))
    .bind(agent_id)
    .bind(gpus_json)
    .bind(now_ms)
    .bind(id)
    .execute(&mut *conn)
    .await?;
    PostgresStore::job_in(&mut *conn, id).await?.ok_or(StoreError::JobNotFound(id))
}

/// The stored states of `ids` (absent: no such job), their rows locked until the caller's
/// transaction ends. Locked in id order: two batches over the same jobs wait, never deadlock.
async fn locked_states_of(
    conn: &mut sqlx::PgConnection,
    ids: &[JobId],
) -> Result<std::collections::HashMap<JobId, JobState>> {
    let mut state = std::collections::HashMap::with_capacity(ids.len());
    for r in sqlx::query("SELECT id, state FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE")
        .bind(ids)
        .fetch_all(&mut *conn)
        .await?
    {
        let text: String = r.get(1);
        state.insert(r.get(0), text.parse().map_err(|e| corrupt("state", e))?);
    }
    Ok(state)
}

/// [`Store::assign_jobs`] in a handful of statements whatever the batch's size (one round
/// trip per job and GPU made a pass of 1,000 cost thousands): lock the batch's jobs, read the
/// leases of its GPUs, decide each assignment in order as [`assign_in`] would, then write the
/// accepted ones set-based. `None` (nothing written) when another transaction leased one of
/// the GPUs between the read and the write: the caller goes job by job.
pub(super) async fn assign_set_based(
    pool: &PgPool,
    batch: &[NewAssignment],
    now_ms: i64,
) -> Result<Option<Vec<Result<()>>>> {
    use std::collections::HashMap;
    let mut tx = pool.begin().await?;
    let ids: Vec<JobId> = batch.iter().map(|a| a.job).collect();
    let state = locked_states_of(&mut tx, &ids).await?;
    let all_gpus: Vec<&str> = batch.iter().flat_map(|a| a.gpus.iter().map(String::as_str)).collect();
    let held: HashMap<String, JobId> = sqlx::query("SELECT gpu_uuid, job_id FROM gpu_leases WHERE gpu_uuid = ANY($1)")
        .bind(&all_gpus)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let decided = crate::assign_batch::decide(batch, state, held);
    let accepted = &decided.accepted;
    if !accepted.is_empty() {
        let (mut gpu, mut agent, mut job) = (Vec::new(), Vec::new(), Vec::new());
        for a in accepted {
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
        for a in accepted {
            ids.push(a.job);
            reasons.push(a.reason());
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
    tx.commit().await?;
    Ok(Some(crate::assign_batch::answer(decided)))
}

/// The change of [`Store::update_job`], inside the caller's transaction.
pub(super) async fn update_job_in(
    tx: &mut sqlx::PgConnection,
    id: JobId,
    expect: &[JobState],
    c: JobChange,
) -> Result<JobRecord> {
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

/// [`Store::update_jobs`] inside the caller's transaction in a handful of statements whatever
/// the batch's size: lock the batch's jobs (in id order: two batches over the same jobs wait,
/// never deadlock), decide each change in order as [`update_job_in`] would
/// (`crate::update_batch`), write the accepted ones set-based, read their records back in one
/// statement. Each item took a savepoint, a locked read, its writes and a read back before:
/// six round trips a start. `None`: a job is changed twice in the batch; the caller writes it
/// change by change.
pub(super) async fn update_set_based(
    conn: &mut sqlx::PgConnection,
    batch: &[JobUpdate],
) -> Result<Option<Vec<Result<()>>>> {
    if !crate::update_batch::each_job_once(batch) {
        return Ok(None);
    }
    let ids: Vec<JobId> = batch.iter().map(|u| u.job).collect();
    let state = locked_states_of(&mut *conn, &ids).await?;
    let decided = crate::update_batch::decide(batch, state);
    let accepted = &decided.accepted;
    if accepted.is_empty() {
        return Ok(Some(crate::update_batch::answer(decided)));
    }
    let n = accepted.len();
    let (mut id, mut states, mut reasons) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut started, mut finished, mut exit) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut telemetry, mut unenforced) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for u in accepted {
        let c = &u.change;
        id.push(u.job);
        states.push(c.state.map(JobState::as_str));
        reasons.push(c.reason.as_deref());
        started.push(c.started_at_ms);
        finished.push(c.finished_at_ms);
        exit.push(c.exit_code);
        telemetry
            .push(c.telemetry.as_ref().map(serde_json::to_string).transpose().map_err(|e| corrupt("telemetry", e))?);
        unenforced
            .push(c.unenforced.as_ref().map(serde_json::to_string).transpose().map_err(|e| corrupt("unenforced", e))?);
    }
    sqlx::query(
        "UPDATE jobs SET state = COALESCE(u.state, jobs.state), reason = COALESCE(u.reason, jobs.reason), \
         started_at_ms = COALESCE(u.started, jobs.started_at_ms), finished_at_ms = COALESCE(u.finished, jobs.finished_at_ms), \
         exit_code = COALESCE(u.exit_code, jobs.exit_code), telemetry_json = COALESCE(u.telemetry, jobs.telemetry_json), \
         unenforced_json = COALESCE(u.unenforced, jobs.unenforced_json) \
         FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::integer[], $7::text[], $8::text[]) \
              AS u(id, state, reason, started, finished, exit_code, telemetry, unenforced) \
         WHERE jobs.id = u.id",
    )
    .bind(&id)
    .bind(&states)
    .bind(&reasons)
    .bind(&started)
    .bind(&finished)
    .bind(&exit)
    .bind(&telemetry)
    .bind(&unenforced)
    .execute(&mut *conn)
    .await?;
    let cleared = decided.cleared();
    if !cleared.is_empty() {
        sqlx::query(
            "UPDATE jobs SET agent_id = NULL, gpus_json = '[]', assigned_at_ms = NULL, unenforced_json = NULL \
             WHERE id = ANY($1)",
        )
        .bind(&cleared)
        .execute(&mut *conn)
        .await?;
    }
    let released = decided.released();
    if !released.is_empty() {
        sqlx::query("DELETE FROM gpu_leases WHERE job_id = ANY($1)").bind(&released).execute(&mut *conn).await?;
    }
    for q in accepted.iter().flat_map(|u| &u.change.quarantine) {
        upsert_quarantine(&mut *conn, q).await?;
    }
    Ok(Some(crate::update_batch::answer(decided)))
}
