//! Pipelines created once per client submission key (`submissions`, migrations sqlite 0026 /
//! postgres 0025; docs/ha.md): a request sent again after its answer was lost (a failover, a
//! dropped connection) gets the pipeline the first one made. The key is recorded in the same
//! transaction as the pipeline, so a pipeline exists exactly when its key does. The SQL of
//! both backends lives here; their `Store` impls only call it. The store decides nothing:
//! what a key may look like and how the request is digested is the coordinator's.

use crate::{PipelineId, Result};

/// A client's key for one submission, and the digest of what it asked for.
#[derive(Clone, Debug)]
pub struct Submission {
    pub key: String,
    pub digest: String,
}

/// What [`Store::create_pipeline_once`](crate::Store::create_pipeline_once) did.
#[derive(Clone, Debug)]
pub enum Created {
    /// Made now.
    New(crate::PipelineRecord, Vec<crate::JobRecord>),
    /// The key was recorded before, with pipeline `pipeline`; `same`: for the same request
    /// (its digest), else another request reused the key.
    Before { pipeline: PipelineId, same: bool },
}

/// Keys are kept this long: a retry comes within minutes.
pub const KEEP_MS: i64 = 7 * 24 * 3600 * 1000;

pub(crate) mod sqlite {
    use super::*;
    use sqlx::Row;

    pub(crate) async fn seen(tx: &mut sqlx::SqliteConnection, s: &Submission) -> Result<Option<Created>> {
        let row = sqlx::query("SELECT pipeline_id, digest FROM submissions WHERE key = ?")
            .bind(&s.key)
            .fetch_optional(&mut *tx)
            .await?;
        Ok(row.map(|r| Created::Before { pipeline: r.get(0), same: r.get::<String, _>(1) == s.digest }))
    }

    pub(crate) async fn record(
        tx: &mut sqlx::SqliteConnection,
        s: &Submission,
        pipeline: PipelineId,
        now_ms: i64,
    ) -> Result<()> {
        sqlx::query("DELETE FROM submissions WHERE created_at_ms < ?").bind(now_ms - KEEP_MS).execute(&mut *tx).await?;
        sqlx::query("INSERT INTO submissions (key, digest, pipeline_id, created_at_ms) VALUES (?, ?, ?, ?)")
            .bind(&s.key)
            .bind(&s.digest)
            .bind(pipeline)
            .bind(now_ms)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

pub(crate) mod postgres {
    use super::*;
    use sqlx::Row;

    pub(crate) async fn seen(tx: &mut sqlx::PgConnection, s: &Submission) -> Result<Option<Created>> {
        let row = sqlx::query("SELECT pipeline_id, digest FROM submissions WHERE key = $1")
            .bind(&s.key)
            .fetch_optional(&mut *tx)
            .await?;
        Ok(row.map(|r| Created::Before { pipeline: r.get(0), same: r.get::<String, _>(1) == s.digest }))
    }

    pub(crate) async fn record(
        tx: &mut sqlx::PgConnection,
        s: &Submission,
        pipeline: PipelineId,
        now_ms: i64,
    ) -> Result<()> {
        sqlx::query("DELETE FROM submissions WHERE created_at_ms < $1")
            .bind(now_ms - KEEP_MS)
            .execute(&mut *tx)
            .await?;
        sqlx::query("INSERT INTO submissions (key, digest, pipeline_id, created_at_ms) VALUES ($1, $2, $3, $4)")
            .bind(&s.key)
            .bind(&s.digest)
            .bind(pipeline)
            .bind(now_ms)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}
