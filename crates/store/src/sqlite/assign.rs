//! SQLite backend: the writes that assign a job to GPUs and move it between states, each inside
//! the caller's transaction (the `Store` impl in `sqlite.rs` owns the transaction and its commit).

use super::*;

/// The writes of [`Store::assign_job`], inside the caller's transaction. Every check comes
/// before the first write, so a refusal has written nothing.
pub(super) async fn assign_in(
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
    .bind(crate::records::assigned_reason(agent_id))
    .bind(agent_id)
    .bind(gpus_json)
    .bind(now_ms)
    .bind(id)
    .execute(&mut *conn)
    .await?;
    SqliteStore::job_in(&mut *conn, id).await?.ok_or(StoreError::JobNotFound(id))
}

/// The change of [`Store::update_job`], inside the caller's transaction.
pub(super) async fn update_job_in(
    tx: &mut sqlx::SqliteConnection,
    id: JobId,
    expect: &[JobState],
    c: JobChange,
) -> Result<JobRecord> {
    // Refused (if at all) before the first write: the caller's batch takes no savepoint.
    let state: String = sqlx::query_scalar("SELECT state FROM jobs WHERE id = ?")
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(StoreError::JobNotFound(id))?;
    let state: JobState = state.parse().map_err(|e| corrupt("state", e))?;
    if !expect.is_empty() && !expect.contains(&state) {
        let expected = expect.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("|");
        return Err(StoreError::Conflict { job: id, expected, found: state });
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

/// The stored states of `ids` (absent: no such job), in one statement.
async fn states_of(
    conn: &mut sqlx::SqliteConnection,
    ids: &[JobId],
) -> Result<std::collections::HashMap<JobId, JobState>> {
    let mut state = std::collections::HashMap::with_capacity(ids.len());
    for r in sqlx::query("SELECT id, state FROM jobs WHERE id IN (SELECT value FROM json_each(?))")
        .bind(serde_json::json!(ids).to_string())
        .fetch_all(&mut *conn)
        .await?
    {
        let text: String = r.get(1);
        state.insert(r.get(0), text.parse().map_err(|e| corrupt("state", e))?);
    }
    Ok(state)
}

/// [`Store::assign_jobs`] inside the caller's transaction in a handful of statements whatever
/// the batch's size: read the batch's jobs' states and its GPUs' leases, decide each
/// assignment in order as [`assign_in`] would (`crate::assign_batch`), then write the accepted
/// ones set-based (lists passed as JSON arrays, read back by `json_each`). One statement per
/// job and GPU made the single writer's thread trade thousands of wake-ups a pass with the
/// brain's (BENCHMARKS.md, "The placement pass with a long queue"). Nothing can lease a GPU
/// between the read and the write: SQLite has one writer, and this transaction is it.
pub(super) async fn assign_set_based(
    conn: &mut sqlx::SqliteConnection,
    batch: &[NewAssignment],
    now_ms: i64,
) -> Result<Vec<Result<()>>> {
    use std::collections::HashMap;
    let json = |v: &serde_json::Value| v.to_string();
    let ids: Vec<JobId> = batch.iter().map(|a| a.job).collect();
    let state = states_of(&mut *conn, &ids).await?;
    let all_gpus: Vec<&str> = batch.iter().flat_map(|a| a.gpus.iter().map(String::as_str)).collect();
    let held: HashMap<String, JobId> =
        sqlx::query("SELECT gpu_uuid, job_id FROM gpu_leases WHERE gpu_uuid IN (SELECT value FROM json_each(?))")
            .bind(json(&serde_json::json!(all_gpus)))
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
    let decided = crate::assign_batch::decide(batch, state, held);
    let accepted = &decided.accepted;
    if accepted.is_empty() {
        return Ok(crate::assign_batch::answer(decided));
    }
    let leases: Vec<serde_json::Value> =
        accepted.iter().flat_map(|a| a.gpus.iter().map(|g| serde_json::json!([g, a.agent_id, a.job]))).collect();
    if !leases.is_empty() {
        sqlx::query(
            "INSERT INTO gpu_leases (gpu_uuid, agent_id, job_id, since_ms) \
             SELECT value ->> 0, value ->> 1, value ->> 2, ? FROM json_each(?)",
        )
        .bind(now_ms)
        .bind(json(&serde_json::Value::Array(leases)))
        .execute(&mut *conn)
        .await?;
    }
    let mut jobs = Vec::with_capacity(accepted.len());
    for a in accepted {
        let gpus_json = serde_json::to_string(&a.gpus).map_err(|e| corrupt("gpus", e))?;
        jobs.push(serde_json::json!([a.job, a.reason(), a.agent_id, gpus_json]));
    }
    sqlx::query(
        "UPDATE jobs SET state = 'assigned', reason = u.reason, agent_id = u.agent, gpus_json = u.gpus, \
         assigned_at_ms = ? \
         FROM (SELECT value ->> 0 AS id, value ->> 1 AS reason, value ->> 2 AS agent, value ->> 3 AS gpus \
               FROM json_each(?)) AS u \
         WHERE jobs.id = u.id",
    )
    .bind(now_ms)
    .bind(json(&serde_json::Value::Array(jobs)))
    .execute(&mut *conn)
    .await?;
    // The job tokens of the accepted ones (each job at most once: a second assignment of a
    // job in the batch was refused above).
    let tokens: Vec<serde_json::Value> =
        accepted.iter().filter_map(|a| a.token_sha256.as_deref().map(|h| serde_json::json!([a.job, h]))).collect();
    if !tokens.is_empty() {
        // `WHERE true`: SQLite's grammar needs it between a SELECT and ON CONFLICT.
        sqlx::query(
            "INSERT INTO job_tokens (job_id, token_sha256, uploads, created_at_ms) \
             SELECT value ->> 0, value ->> 1, 0, ? FROM json_each(?) WHERE true \
             ON CONFLICT (job_id) DO UPDATE SET token_sha256 = excluded.token_sha256, created_at_ms = excluded.created_at_ms",
        )
        .bind(now_ms)
        .bind(json(&serde_json::Value::Array(tokens)))
        .execute(&mut *conn)
        .await?;
    }
    Ok(crate::assign_batch::answer(decided))
}

/// [`Store::update_jobs`] inside the caller's transaction in a handful of statements whatever
/// the batch's size (agents' starts and ends, group-committed by the brain): read the batch's
/// jobs' states, decide each change in order as [`update_job_in`] would
/// (`crate::update_batch`), write the accepted ones set-based, read their records back in one
/// statement. Three statements per job before: at thousands of starts a second, each a
/// hand-over to the writer's thread (BENCHMARKS.md, "The coordinator under load"). `None`: a
/// job is changed twice in the batch; the caller writes it change by change.
pub(super) async fn update_set_based(
    conn: &mut sqlx::SqliteConnection,
    batch: &[JobUpdate],
) -> Result<Option<Vec<Result<()>>>> {
    if !crate::update_batch::each_job_once(batch) {
        return Ok(None);
    }
    let ids: Vec<JobId> = batch.iter().map(|u| u.job).collect();
    let state = states_of(&mut *conn, &ids).await?;
    let decided = crate::update_batch::decide(batch, state);
    let accepted = &decided.accepted;
    if accepted.is_empty() {
        return Ok(Some(crate::update_batch::answer(decided)));
    }
    let mut rows = Vec::with_capacity(accepted.len());
    for u in accepted {
        let c = &u.change;
        let telemetry =
            c.telemetry.as_ref().map(serde_json::to_string).transpose().map_err(|e| corrupt("telemetry", e))?;
        let unenforced =
            c.unenforced.as_ref().map(serde_json::to_string).transpose().map_err(|e| corrupt("unenforced", e))?;
        rows.push(serde_json::json!([
            u.job,
            c.state.map(JobState::as_str),
            c.reason,
            c.started_at_ms,
            c.finished_at_ms,
            c.exit_code,
            telemetry,
            unenforced,
        ]));
    }
    // A JSON null reads as SQL NULL: a field the change leaves `None` keeps its value.
    sqlx::query(
        "UPDATE jobs SET state = COALESCE(u.state, jobs.state), reason = COALESCE(u.reason, jobs.reason), \
         started_at_ms = COALESCE(u.started, jobs.started_at_ms), finished_at_ms = COALESCE(u.finished, jobs.finished_at_ms), \
         exit_code = COALESCE(u.exit_code, jobs.exit_code), telemetry_json = COALESCE(u.telemetry, jobs.telemetry_json), \
         unenforced_json = COALESCE(u.unenforced, jobs.unenforced_json) \
         FROM (SELECT value ->> 0 AS id, value ->> 1 AS state, value ->> 2 AS reason, value ->> 3 AS started, \
                      value ->> 4 AS finished, value ->> 5 AS exit_code, value ->> 6 AS telemetry, value ->> 7 AS unenforced \
               FROM json_each(?)) AS u \
         WHERE jobs.id = u.id",
    )
    .bind(serde_json::Value::Array(rows).to_string())
    .execute(&mut *conn)
    .await?;
    let cleared = decided.cleared();
    if !cleared.is_empty() {
        sqlx::query(
            "UPDATE jobs SET agent_id = NULL, gpus_json = '[]', assigned_at_ms = NULL, unenforced_json = NULL \
             WHERE id IN (SELECT value FROM json_each(?))",
        )
        .bind(serde_json::json!(cleared).to_string())
        .execute(&mut *conn)
        .await?;
    }
    let released = decided.released();
    if !released.is_empty() {
        sqlx::query("DELETE FROM gpu_leases WHERE job_id IN (SELECT value FROM json_each(?))")
            .bind(serde_json::json!(released).to_string())
            .execute(&mut *conn)
            .await?;
    }
    for q in accepted.iter().flat_map(|u| &u.change.quarantine) {
        upsert_quarantine(&mut *conn, q).await?;
    }
    Ok(Some(crate::update_batch::answer(decided)))
}
