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
pub(super) async fn update_job_in(
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
