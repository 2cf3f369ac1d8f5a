//! SQLite backend: scheduled pipelines: when each schedule was armed and last checked, and the record of each fire.
//! The `Store` impl in `sqlite.rs` forwards to these methods; they hold this area's SQL and nothing else.

use super::*;

impl SqliteStore {
    pub(super) async fn arm_schedule(&self, name: &str, now_ms: i64) -> Result<i64> {
        sqlx::query("INSERT INTO schedule_state (name, checked_at_ms) VALUES (?, ?) ON CONFLICT DO NOTHING")
            .bind(name)
            .bind(now_ms)
            .execute(&self.pool)
            .await?;
        let row = sqlx::query("SELECT checked_at_ms FROM schedule_state WHERE name = ?")
            .bind(name)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.get("checked_at_ms"))
    }

    pub(super) async fn schedule_checked(&self, name: &str, now_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO schedule_state (name, checked_at_ms) VALUES (?, ?) \
             ON CONFLICT (name) DO UPDATE SET checked_at_ms = excluded.checked_at_ms",
        )
        .bind(name)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub(super) async fn schedules_last_checked(&self) -> Result<Option<i64>> {
        let row = sqlx::query("SELECT MAX(checked_at_ms) AS last FROM schedule_state").fetch_one(&self.read).await?;
        Ok(row.get("last"))
    }

    pub(super) async fn record_schedule_fire(&self, f: &ScheduleFireRecord) -> Result<Option<i64>> {
        let row = sqlx::query(
            "INSERT INTO schedule_fires (schedule, cause, scheduled_at_ms, fired_at_ms, skipped_from_ms) \
             VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING id",
        )
        .bind(&f.schedule)
        .bind(&f.cause)
        .bind(f.scheduled_at_ms)
        .bind(f.fired_at_ms)
        .bind(f.skipped_from_ms)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| r.get("id")))
    }

    pub(super) async fn finish_schedule_fire(
        &self,
        id: i64,
        pipeline: Option<PipelineId>,
        error: Option<&str>,
    ) -> Result<()> {
        sqlx::query("UPDATE schedule_fires SET pipeline_id = ?, error = ? WHERE id = ?")
            .bind(pipeline)
            .bind(error)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub(super) async fn interrupt_schedule_fires(&self, error: &str) -> Result<u64> {
        let done = sqlx::query("UPDATE schedule_fires SET error = ? WHERE pipeline_id IS NULL AND error IS NULL")
            .bind(error)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    pub(super) async fn last_cron_fire(&self, name: &str) -> Result<Option<i64>> {
        let row = sqlx::query(
            "SELECT MAX(scheduled_at_ms) AS last FROM schedule_fires WHERE schedule = ? AND cause = 'cron'",
        )
        .bind(name)
        .fetch_one(&self.read)
        .await?;
        Ok(row.get("last"))
    }

    pub(super) async fn schedule_fires(&self, name: Option<&str>, limit: u32) -> Result<Vec<ScheduleFireRecord>> {
        let rows = sqlx::query(
            "SELECT id, schedule, cause, scheduled_at_ms, fired_at_ms, skipped_from_ms, pipeline_id, error \
             FROM schedule_fires WHERE (? IS NULL OR schedule = ?) ORDER BY id DESC LIMIT ?",
        )
        .bind(name)
        .bind(name)
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .map(|r: &SqliteRow| ScheduleFireRecord {
                id: r.get("id"),
                schedule: r.get("schedule"),
                cause: r.get("cause"),
                scheduled_at_ms: r.get("scheduled_at_ms"),
                fired_at_ms: r.get("fired_at_ms"),
                skipped_from_ms: r.get("skipped_from_ms"),
                pipeline_id: r.get("pipeline_id"),
                error: r.get("error"),
            })
            .collect())
    }
}
