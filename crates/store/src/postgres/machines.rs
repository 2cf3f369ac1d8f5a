//! Postgres backend: cloud machines the fleet owns and their billing intervals (open while a machine is billed).
//! The `Store` impl in `postgres.rs` forwards to these methods; they hold this area's SQL and nothing else.

use super::*;

impl PostgresStore {
    pub(super) async fn put_machine(&self, m: &MachineRecord) -> Result<()> {
        let sql = format!("INSERT INTO machines ({MACHINE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18) ON CONFLICT (id) DO UPDATE SET fleet = EXCLUDED.fleet, provider_id = EXCLUDED.provider_id, instance_type = EXCLUDED.instance_type, zone = EXCLUDED.zone, capacity = EXCLUDED.capacity, price_per_hour = EXCLUDED.price_per_hour, gpus = EXCLUDED.gpus, state = EXCLUDED.state, reason = EXCLUDED.reason, agent_id = EXCLUDED.agent_id, requested_at_ms = EXCLUDED.requested_at_ms, running_at_ms = EXCLUDED.running_at_ms, connected_at_ms = EXCLUDED.connected_at_ms, first_job_at_ms = EXCLUDED.first_job_at_ms, ended_at_ms = EXCLUDED.ended_at_ms, boot_failed = EXCLUDED.boot_failed, interrupted_at_ms = EXCLUDED.interrupted_at_ms");
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
        let sql =
            format!(r#"SELECT {MACHINE_COLUMNS} FROM machines {filter} ORDER BY requested_at_ms, id COLLATE "C""#);
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(machine_from_row).collect())
    }

    pub(super) async fn open_billing(&self, machine: &str, from_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO machine_billing (machine_id, from_ms, to_ms) SELECT $1, $2, NULL \
             WHERE NOT EXISTS (SELECT 1 FROM machine_billing WHERE machine_id = $3 AND to_ms IS NULL) \
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
            "UPDATE machine_billing SET to_ms = CASE WHEN $1 < from_ms THEN from_ms ELSE $2 END \
             WHERE machine_id = $3 AND to_ms IS NULL",
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
            "SELECT machine_id, from_ms, to_ms FROM machine_billing WHERE to_ms IS NULL OR to_ms >= $1 \
             ORDER BY from_ms, machine_id",
        )
        .bind(since_ms)
        .fetch_all(&self.pool)
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
