//! SQLite backend: secrets (values sealed by the caller before they reach the store) and their audited writes.
//! The `Store` impl in `sqlite.rs` forwards to these methods; they hold this area's SQL and nothing else.

use super::*;

impl SqliteStore {
    pub(super) async fn set_secret(&self, name: &str, value: &str, now_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO secrets (name, value, updated_at_ms) VALUES (?, ?, ?) \
             ON CONFLICT(name) DO UPDATE SET value = excluded.value, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(name)
        .bind(value)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub(super) async fn delete_secret(&self, name: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM secrets WHERE name = ?").bind(name).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    pub(super) async fn secret_names(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query("SELECT name, updated_at_ms FROM secrets ORDER BY name").fetch_all(&self.read).await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    pub(super) async fn secret_values(&self, names: &[String]) -> Result<std::collections::BTreeMap<String, String>> {
        let mut out = std::collections::BTreeMap::new();
        for n in names {
            let row =
                sqlx::query("SELECT value FROM secrets WHERE name = ?").bind(n).fetch_optional(&self.read).await?;
            if let Some(r) = row {
                out.insert(n.clone(), r.get(0));
            }
        }
        Ok(out)
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
            "INSERT INTO secrets (name, value, updated_at_ms) VALUES (?, ?, ?) \
             ON CONFLICT(name) DO UPDATE SET value = excluded.value, updated_at_ms = excluded.updated_at_ms",
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
        let done = sqlx::query("DELETE FROM secrets WHERE name = ?").bind(name).execute(&mut *tx).await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(true)
    }
}
