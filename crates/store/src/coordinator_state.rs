//! Named JSON documents the coordinator's loops keep across restarts and takeovers
//! (`coordinator_state` table, migrations sqlite 0022 / postgres 0021): the fleets' offer
//! back-off today. The store moves text; what it means is the coordinator's. The SQL of both
//! backends lives here; their `Store` impls only call it.

use crate::Result;

pub(crate) mod sqlite {
    use super::*;
    use sqlx::SqlitePool;

    pub async fn get(pool: &SqlitePool, name: &str) -> Result<Option<String>> {
        Ok(sqlx::query_scalar("SELECT json FROM coordinator_state WHERE name = ?")
            .bind(name)
            .fetch_optional(pool)
            .await?)
    }

    pub async fn put(pool: &SqlitePool, name: &str, json: &str, now_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO coordinator_state (name, json, updated_at_ms) VALUES (?, ?, ?) \
             ON CONFLICT (name) DO UPDATE SET json = excluded.json, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(name)
        .bind(json)
        .bind(now_ms)
        .execute(pool)
        .await?;
        Ok(())
    }
}

pub(crate) mod postgres {
    use super::*;
    use sqlx::PgPool;

    pub async fn get(pool: &PgPool, name: &str) -> Result<Option<String>> {
        Ok(sqlx::query_scalar("SELECT json FROM coordinator_state WHERE name = $1")
            .bind(name)
            .fetch_optional(pool)
            .await?)
    }

    pub async fn put(pool: &PgPool, name: &str, json: &str, now_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO coordinator_state (name, json, updated_at_ms) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO UPDATE SET json = EXCLUDED.json, updated_at_ms = EXCLUDED.updated_at_ms",
        )
        .bind(name)
        .bind(json)
        .bind(now_ms)
        .execute(pool)
        .await?;
        Ok(())
    }
}
