//! Postgres backend: secrets (values sealed by the caller before they reach the store) and their audited writes.
//! The `Store` impl in `postgres.rs` forwards to these methods; they hold this area's SQL and nothing else.

use super::*;

impl PostgresStore {
    pub(super) async fn set_secret(&self, name: &str, value: &str, now_ms: i64) -> Result<()> {
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

    pub(super) async fn delete_secret(&self, name: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM secrets WHERE name = $1").bind(name).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    pub(super) async fn secret_names(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query(r#"SELECT name, updated_at_ms FROM secrets ORDER BY name COLLATE "C""#)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    pub(super) async fn secret_values(&self, names: &[String]) -> Result<std::collections::BTreeMap<String, String>> {
        let rows = sqlx::query("SELECT name, value FROM secrets WHERE name = ANY($1)")
            .bind(names)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    pub(super) async fn set_secret_audited(
        &self,
        name: &str,
        value: &str,
        now_ms: i64,
        audit: &NewAudit,
    ) -> Result<()> {
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

    pub(super) async fn delete_secret_audited(&self, name: &str, audit: &NewAudit) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query("DELETE FROM secrets WHERE name = $1").bind(name).execute(&mut *tx).await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(true)
    }
}
