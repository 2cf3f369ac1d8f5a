//! SQLite backend: cloud machines the fleet owns and their billing intervals (open while a machine is billed).
//! The `Store` impl in `sqlite.rs` forwards to these methods; they hold this area's SQL and nothing else.

use super::*;

impl SqliteStore {
    pub(super) async fn put_machine(&self, m: &MachineRecord) -> Result<()> {
        let sql = format!("INSERT OR REPLACE INTO machines ({MACHINE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");
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

    pub(super) async fn machines(&self, active_only: bool) -> Result<Vec<MachineRecord>> {
        let filter = if active_only { "WHERE ended_at_ms IS NULL" } else { "" };
        let sql = format!(r#"SELECT {MACHINE_COLUMNS} FROM machines {filter} ORDER BY requested_at_ms, id"#);
        let rows = sqlx::query(&sql).fetch_all(&self.read).await?;
        Ok(rows.iter().map(machine_from_row).collect())
    }

    pub(super) async fn open_billing(&self, machine: &str, from_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO machine_billing (machine_id, from_ms, to_ms) SELECT ?, ?, NULL \
             WHERE NOT EXISTS (SELECT 1 FROM machine_billing WHERE machine_id = ? AND to_ms IS NULL) \
             ON CONFLICT DO NOTHING",
        )
        .bind(machine)
        .bind(from_ms)
        .bind(machine)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub(super) async fn close_billing(&self, machine: &str, to_ms: i64) -> Result<()> {
        // Never before the stretch began (a clock that stepped back).
        sqlx::query(
            "UPDATE machine_billing SET to_ms = CASE WHEN ? < from_ms THEN from_ms ELSE ? END \
             WHERE machine_id = ? AND to_ms IS NULL",
        )
        .bind(to_ms)
        .bind(to_ms)
        .bind(machine)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub(super) async fn billing_since(&self, since_ms: i64) -> Result<Vec<BillingInterval>> {
        let rows = sqlx::query(
            "SELECT machine_id, from_ms, to_ms FROM machine_billing WHERE to_ms IS NULL OR to_ms >= ? \
             ORDER BY from_ms, machine_id",
        )
        .bind(since_ms)
        .fetch_all(&self.read)
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
}
