//! Job tokens (`job_tokens` table, migrations sqlite 0015 / postgres 0014): the sha256 of the
//! token a running job uses to add steps to its own pipeline (`gpuci pipeline upload`), and
//! how many uploads it has made. The token itself is never stored. The SQL of both backends
//! lives here (but adding the uploaded jobs, which shares the job insert of each backend);
//! their `Store` impls only call it.
//!
//! A placed job's token is written by its assignment (`NewAssignment::token_sha256`), in the
//! placement pass's one transaction: a refused assignment stores no token, and a pass costs
//! one commit, not one for its tokens and one for its assignments. A job's row is deleted in
//! the transaction that ends the job (one statement per batch of ends:
//! [`sqlite::delete_ended_in`]); rows left by an older version are swept when tokens are
//! stored outside a pass ([`sqlite::sweep_ended`]).

use crate::Result;
use gpuci_protocol::JobId;
use sqlx::Row;

/// A job's token for adding steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobTokenRecord {
    pub job_id: JobId,
    /// Lowercase hex sha256 of the token.
    pub token_sha256: String,
    /// Uploads the job has made with it.
    pub uploads: u32,
    pub created_at_ms: i64,
}

/// Rows of jobs that have ended: their tokens open nothing (each use checks the job runs),
/// so they are only clutter. One primary-key look-up per token row (the table holds the tokens
/// of running jobs and of those ended since the last pass), never a scan of `jobs`.
const ENDED: &str = "DELETE FROM job_tokens WHERE (SELECT state FROM jobs WHERE jobs.id = job_tokens.job_id) \
                     NOT IN ('queued', 'assigned', 'running')";

fn from_row<R: Row>(r: &R) -> Result<JobTokenRecord>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'a> i64: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> i32: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> String: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    Ok(JobTokenRecord {
        job_id: r.try_get("job_id")?,
        token_sha256: r.try_get("token_sha256")?,
        uploads: u32::try_from(r.try_get::<i32, _>("uploads")?).unwrap_or(0),
        created_at_ms: r.try_get("created_at_ms")?,
    })
}

pub(crate) mod sqlite {
    use super::*;
    use sqlx::SqlitePool;

    pub async fn put(pool: &SqlitePool, tokens: &[(JobId, String)], now_ms: i64) -> Result<()> {
        let mut tx = pool.begin().await?;
        sweep_ended(&mut tx).await?;
        for (job, sha256) in tokens {
            put_in(&mut tx, *job, sha256, now_ms).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Deletes the rows of `jobs`, which the caller's transaction ended: one statement for a
    /// batch (an ended job's token opens nothing).
    pub async fn delete_ended_in(conn: &mut sqlx::SqliteConnection, jobs: &[JobId]) -> Result<()> {
        if !jobs.is_empty() {
            sqlx::query("DELETE FROM job_tokens WHERE job_id IN (SELECT value FROM json_each(?))")
                .bind(serde_json::json!(jobs).to_string())
                .execute(conn)
                .await?;
        }
        Ok(())
    }

    /// Deletes the rows of ended jobs, inside the caller's transaction.
    pub async fn sweep_ended(conn: &mut sqlx::SqliteConnection) -> Result<()> {
        sqlx::query(ENDED).execute(conn).await?;
        Ok(())
    }

    /// Stores `job`'s token hash inside the caller's transaction (replacing an earlier one of
    /// the job, its upload count kept).
    pub async fn put_in(conn: &mut sqlx::SqliteConnection, job: JobId, sha256: &str, now_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO job_tokens (job_id, token_sha256, uploads, created_at_ms) VALUES (?, ?, 0, ?) \
             ON CONFLICT (job_id) DO UPDATE SET token_sha256 = excluded.token_sha256, created_at_ms = excluded.created_at_ms",
        )
        .bind(job)
        .bind(sha256)
        .bind(now_ms)
        .execute(conn)
        .await?;
        Ok(())
    }

    pub async fn get(pool: &SqlitePool, job: JobId) -> Result<Option<JobTokenRecord>> {
        let row = sqlx::query("SELECT job_id, token_sha256, uploads, created_at_ms FROM job_tokens WHERE job_id = ?")
            .bind(job)
            .fetch_optional(pool)
            .await?;
        row.map(|r| from_row(&r)).transpose()
    }

    pub async fn delete(pool: &SqlitePool, job: JobId) -> Result<()> {
        sqlx::query("DELETE FROM job_tokens WHERE job_id = ?").bind(job).execute(pool).await?;
        Ok(())
    }

    pub async fn count_failed(pool: &SqlitePool, job: JobId) -> Result<()> {
        sqlx::query("UPDATE job_tokens SET uploads = uploads + 1 WHERE job_id = ?").bind(job).execute(pool).await?;
        Ok(())
    }

    /// One more upload of `job`, unless it has made `max` already; whether it was counted.
    pub async fn count_upload(conn: &mut sqlx::SqliteConnection, job: JobId, max: u32) -> Result<bool> {
        let r = sqlx::query("UPDATE job_tokens SET uploads = uploads + 1 WHERE job_id = ? AND uploads < ?")
            .bind(job)
            .bind(i64::from(max))
            .execute(conn)
            .await?;
        Ok(r.rows_affected() == 1)
    }
}

pub(crate) mod postgres {
    use super::*;
    use sqlx::PgPool;

    pub async fn put(pool: &PgPool, tokens: &[(JobId, String)], now_ms: i64) -> Result<()> {
        let mut tx = pool.begin().await?;
        sweep_ended(&mut tx).await?;
        // One row per job (the last given), as one statement may not upsert a row twice.
        let last: std::collections::BTreeMap<JobId, &str> = tokens.iter().map(|(j, h)| (*j, h.as_str())).collect();
        let (jobs, hashes): (Vec<JobId>, Vec<&str>) = last.into_iter().unzip();
        put_all_in(&mut tx, &jobs, &hashes, now_ms).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Deletes the rows of ended jobs, inside the caller's transaction.
    /// Deletes the rows of `jobs`, which the caller's transaction ended: one statement for a
    /// batch (an ended job's token opens nothing).
    pub async fn delete_ended_in(conn: &mut sqlx::PgConnection, jobs: &[JobId]) -> Result<()> {
        if !jobs.is_empty() {
            sqlx::query("DELETE FROM job_tokens WHERE job_id = ANY($1)").bind(jobs).execute(conn).await?;
        }
        Ok(())
    }

    pub async fn sweep_ended(conn: &mut sqlx::PgConnection) -> Result<()> {
        sqlx::query(ENDED).execute(conn).await?;
        Ok(())
    }

    /// Stores each `jobs[i]`'s token hash `hashes[i]` inside the caller's transaction, in one
    /// statement whatever their number (replacing an earlier one of a job, its upload count kept).
    pub async fn put_all_in(conn: &mut sqlx::PgConnection, jobs: &[JobId], hashes: &[&str], now_ms: i64) -> Result<()> {
        if jobs.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO job_tokens (job_id, token_sha256, uploads, created_at_ms) \
             SELECT j, h, 0, $3 FROM UNNEST($1::bigint[], $2::text[]) AS t(j, h) \
             ON CONFLICT (job_id) DO UPDATE SET token_sha256 = EXCLUDED.token_sha256, created_at_ms = EXCLUDED.created_at_ms",
        )
        .bind(jobs)
        .bind(hashes)
        .bind(now_ms)
        .execute(conn)
        .await?;
        Ok(())
    }

    pub async fn get(pool: &PgPool, job: JobId) -> Result<Option<JobTokenRecord>> {
        let row = sqlx::query("SELECT job_id, token_sha256, uploads, created_at_ms FROM job_tokens WHERE job_id = $1")
            .bind(job)
            .fetch_optional(pool)
            .await?;
        row.map(|r| from_row(&r)).transpose()
    }

    pub async fn delete(pool: &PgPool, job: JobId) -> Result<()> {
        sqlx::query("DELETE FROM job_tokens WHERE job_id = $1").bind(job).execute(pool).await?;
        Ok(())
    }

    pub async fn count_failed(pool: &PgPool, job: JobId) -> Result<()> {
        sqlx::query("UPDATE job_tokens SET uploads = uploads + 1 WHERE job_id = $1").bind(job).execute(pool).await?;
        Ok(())
    }

    pub async fn count_upload(conn: &mut sqlx::PgConnection, job: JobId, max: u32) -> Result<bool> {
        let r = sqlx::query("UPDATE job_tokens SET uploads = uploads + 1 WHERE job_id = $1 AND uploads < $2")
            .bind(job)
            .bind(i32::try_from(max).unwrap_or(i32::MAX))
            .execute(conn)
            .await?;
        Ok(r.rows_affected() == 1)
    }
}
