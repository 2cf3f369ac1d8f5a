//! Webhook replay protection and ordering records (`github_payloads`, `github_job_tombstones`,
//! migrations sqlite 0024 / postgres 0023; docs/github.md).
//!
//! GitHub signs a delivery's body, not its `X-GitHub-Delivery` or `X-GitHub-Event` header, so
//! the delivery id alone cannot tell a replayed body from a new delivery. A body that starts
//! work is recorded by its SHA-256 in the same transaction as its delivery id: a new id with a
//! body seen before is a [`DeliverySeen::Replay`] and nothing is recorded; GitHub's own
//! redelivery reuses the id and stays a [`DeliverySeen::Redelivery`]. Tombstones remember
//! workflow jobs that started or ended before gpuci knew them. All three tables (deliveries
//! included) are pruned by age ([`Store::prune_github_records`](crate::Store)). The SQL of both
//! backends lives here; their `Store` impls only call it. The store decides nothing: what
//! counts as work and how long to remember is the coordinator's.

use crate::Result;

/// What recording a webhook delivery found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeliverySeen {
    /// New: recorded (and queued, on the queueing path).
    New,
    /// This delivery id was recorded before (GitHub's "Redeliver" reuses it).
    Redelivery,
    /// A new delivery id whose body was recorded before, under `delivery` (`event`): nothing
    /// recorded.
    Replay { delivery: String, event: String },
}

/// A delivery to record: its id, event name and, for a body that starts work, the body's
/// SHA-256 (hex) to refuse a replay of it by.
#[derive(Clone, Copy, Debug)]
pub struct NewDelivery<'a> {
    pub delivery: &'a str,
    pub event: &'a str,
    pub body_sha256: Option<&'a str>,
    /// Its `X-Hub-Signature-256`, kept with a queued body: the leader checks it again before
    /// acting on the body (a row anything else wrote into the inbox is dropped).
    pub signature: Option<&'a str>,
    pub now_ms: i64,
}

/// Rows pruned, per table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub deliveries: u64,
    pub payloads: u64,
    pub tombstones: u64,
}

/// Rows deleted per statement, so a first prune of a long history does not hold the writer.
const PRUNE_BATCH: i64 = 5_000;

pub(crate) mod sqlite {
    use super::*;
    use sqlx::{Row, SqlitePool};

    async fn record_in(tx: &mut sqlx::SqliteConnection, d: &NewDelivery<'_>) -> Result<DeliverySeen> {
        let done = sqlx::query(
            "INSERT INTO github_deliveries (delivery, event, received_at_ms) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
        )
        .bind(d.delivery)
        .bind(d.event)
        .bind(d.now_ms)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(DeliverySeen::Redelivery);
        }
        let Some(sha) = d.body_sha256 else { return Ok(DeliverySeen::New) };
        let done = sqlx::query(
            "INSERT INTO github_payloads (body_sha256, delivery, event, received_at_ms) VALUES (?, ?, ?, ?) \
             ON CONFLICT DO NOTHING",
        )
        .bind(sha)
        .bind(d.delivery)
        .bind(d.event)
        .bind(d.now_ms)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 1 {
            return Ok(DeliverySeen::New);
        }
        let first = sqlx::query("SELECT delivery, event FROM github_payloads WHERE body_sha256 = ?")
            .bind(sha)
            .fetch_one(&mut *tx)
            .await?;
        Ok(DeliverySeen::Replay { delivery: first.get("delivery"), event: first.get("event") })
    }

    /// Records `d` (delivery and payload) in one transaction; on anything but `New` nothing.
    pub async fn record(pool: &SqlitePool, d: &NewDelivery<'_>) -> Result<DeliverySeen> {
        let mut tx = pool.begin().await?;
        let seen = record_in(&mut tx, d).await?;
        if seen == DeliverySeen::New {
            tx.commit().await?;
        }
        Ok(seen)
    }

    /// As [`record`], and keeps `body` in the inbox for the leader, in the same transaction.
    pub async fn queue(pool: &SqlitePool, d: &NewDelivery<'_>, body: &[u8]) -> Result<DeliverySeen> {
        let mut tx = pool.begin().await?;
        let seen = record_in(&mut tx, d).await?;
        if seen != DeliverySeen::New {
            return Ok(seen);
        }
        sqlx::query(
            "INSERT INTO github_inbox (delivery, event, body, received_at_ms, signature) VALUES (?, ?, ?, ?, ?)",
        )
        .bind(d.delivery)
        .bind(d.event)
        .bind(body)
        .bind(d.now_ms)
        .bind(d.signature)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(seen)
    }

    async fn prune_table(pool: &SqlitePool, table: &str, column: &str, before_ms: i64) -> Result<u64> {
        let sql = format!(
            "DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} WHERE {column} < ? LIMIT {PRUNE_BATCH})"
        );
        let mut total = 0;
        loop {
            let n = sqlx::query(&sql).bind(before_ms).execute(pool).await?.rows_affected();
            total += n;
            if n < PRUNE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    pub async fn prune(pool: &SqlitePool, before_ms: i64) -> Result<Pruned> {
        Ok(Pruned {
            deliveries: prune_table(pool, "github_deliveries", "received_at_ms", before_ms).await?,
            payloads: prune_table(pool, "github_payloads", "received_at_ms", before_ms).await?,
            tombstones: prune_table(pool, "github_job_tombstones", "at_ms", before_ms).await?,
        })
    }

    pub async fn put_tombstone(pool: &SqlitePool, job_id: i64, action: &str, now_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO github_job_tombstones (job_id, action, at_ms) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
        )
        .bind(job_id)
        .bind(action)
        .bind(now_ms)
        .execute(pool)
        .await?;
        Ok(())
    }

    pub async fn tombstone(pool: &SqlitePool, job_id: i64) -> Result<Option<String>> {
        Ok(sqlx::query_scalar("SELECT action FROM github_job_tombstones WHERE job_id = ?")
            .bind(job_id)
            .fetch_optional(pool)
            .await?)
    }
}

pub(crate) mod postgres {
    use super::*;
    use sqlx::{PgPool, Row};

    async fn record_in(tx: &mut sqlx::PgConnection, d: &NewDelivery<'_>) -> Result<DeliverySeen> {
        let done = sqlx::query(
            "INSERT INTO github_deliveries (delivery, event, received_at_ms) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
        )
        .bind(d.delivery)
        .bind(d.event)
        .bind(d.now_ms)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(DeliverySeen::Redelivery);
        }
        let Some(sha) = d.body_sha256 else { return Ok(DeliverySeen::New) };
        // A concurrent insert of the same body waits for the other transaction and then does
        // nothing: one of two simultaneous replays is new, never both.
        let done = sqlx::query(
            "INSERT INTO github_payloads (body_sha256, delivery, event, received_at_ms) VALUES ($1, $2, $3, $4) \
             ON CONFLICT DO NOTHING",
        )
        .bind(sha)
        .bind(d.delivery)
        .bind(d.event)
        .bind(d.now_ms)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 1 {
            return Ok(DeliverySeen::New);
        }
        let first = sqlx::query("SELECT delivery, event FROM github_payloads WHERE body_sha256 = $1")
            .bind(sha)
            .fetch_one(&mut *tx)
            .await?;
        Ok(DeliverySeen::Replay { delivery: first.get("delivery"), event: first.get("event") })
    }

    pub async fn record(pool: &PgPool, d: &NewDelivery<'_>) -> Result<DeliverySeen> {
        let mut tx = pool.begin().await?;
        let seen = record_in(&mut tx, d).await?;
        if seen == DeliverySeen::New {
            tx.commit().await?;
        }
        Ok(seen)
    }

    pub async fn queue(pool: &PgPool, d: &NewDelivery<'_>, body: &[u8]) -> Result<DeliverySeen> {
        let mut tx = pool.begin().await?;
        let seen = record_in(&mut tx, d).await?;
        if seen != DeliverySeen::New {
            return Ok(seen);
        }
        sqlx::query(
            "INSERT INTO github_inbox (delivery, event, body, received_at_ms, signature) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(d.delivery)
        .bind(d.event)
        .bind(body)
        .bind(d.now_ms)
        .bind(d.signature)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(seen)
    }

    async fn prune_table(pool: &PgPool, table: &str, key: &str, column: &str, before_ms: i64) -> Result<u64> {
        let sql = format!(
            "DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} WHERE {column} < $1 LIMIT {PRUNE_BATCH})"
        );
        let mut total = 0;
        loop {
            let n = sqlx::query(&sql).bind(before_ms).execute(pool).await?.rows_affected();
            total += n;
            if n < PRUNE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    pub async fn prune(pool: &PgPool, before_ms: i64) -> Result<Pruned> {
        Ok(Pruned {
            deliveries: prune_table(pool, "github_deliveries", "delivery", "received_at_ms", before_ms).await?,
            payloads: prune_table(pool, "github_payloads", "body_sha256", "received_at_ms", before_ms).await?,
            tombstones: prune_table(pool, "github_job_tombstones", "job_id", "at_ms", before_ms).await?,
        })
    }

    pub async fn put_tombstone(pool: &PgPool, job_id: i64, action: &str, now_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO github_job_tombstones (job_id, action, at_ms) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
        )
        .bind(job_id)
        .bind(action)
        .bind(now_ms)
        .execute(pool)
        .await?;
        Ok(())
    }

    pub async fn tombstone(pool: &PgPool, job_id: i64) -> Result<Option<String>> {
        Ok(sqlx::query_scalar("SELECT action FROM github_job_tombstones WHERE job_id = $1")
            .bind(job_id)
            .fetch_optional(pool)
            .await?)
    }
}
