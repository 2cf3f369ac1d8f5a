//! SQLite backend: GitHub App state: webhook deliveries seen, GitHub Actions jobs and the runners made for them,
//! approvals of untrusted pull requests, and the check run of each job.
//! The `Store` impl in `sqlite.rs` forwards to these methods; they hold this area's SQL and nothing else.

use super::*;

fn bind_github_job<'q>(
    q: sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
    j: &'q GithubJobRecord,
) -> Result<sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments<'q>>> {
    let labels = serde_json::to_string(&j.labels).map_err(|e| corrupt("github_jobs.labels", e))?;
    Ok(q.bind(j.id)
        .bind(&j.repository)
        .bind(j.run_id)
        .bind(&j.name)
        .bind(labels)
        .bind(&j.pool)
        .bind(&j.state)
        .bind(j.runner_job_id)
        .bind(&j.runner_name)
        .bind(&j.reason)
        .bind(j.queued_at_ms)
        .bind(j.updated_at_ms)
        .bind(i64::from(j.runner_exits))
        .bind(&j.last_runner_exit)
        .bind(i64::from(j.check_failures))
        .bind(j.retry_at_ms))
}

impl SqliteStore {
    pub(super) async fn record_delivery(&self, delivery: &str, event: &str, now_ms: i64) -> Result<bool> {
        let done = sqlx::query(
            "INSERT INTO github_deliveries (delivery, event, received_at_ms) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
        )
        .bind(delivery)
        .bind(event)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    pub(super) async fn queue_delivery(&self, delivery: &str, event: &str, body: &[u8], now_ms: i64) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query(
            "INSERT INTO github_deliveries (delivery, event, received_at_ms) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
        )
        .bind(delivery)
        .bind(event)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() != 1 {
            return Ok(false);
        }
        sqlx::query("INSERT INTO github_inbox (delivery, event, body, received_at_ms) VALUES (?, ?, ?, ?)")
            .bind(delivery)
            .bind(event)
            .bind(body)
            .bind(now_ms)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(super) async fn take_queued_deliveries(&self, limit: u32) -> Result<Vec<QueuedDelivery>> {
        let rows = sqlx::query(
            "DELETE FROM github_inbox WHERE delivery IN \
             (SELECT delivery FROM github_inbox ORDER BY received_at_ms, delivery LIMIT ?) \
             RETURNING delivery, event, body, received_at_ms, signature",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut out: Vec<QueuedDelivery> = rows
            .into_iter()
            .map(|r| QueuedDelivery {
                delivery: r.get("delivery"),
                event: r.get("event"),
                body: r.get("body"),
                received_at_ms: r.get("received_at_ms"),
                signature: r.get("signature"),
            })
            .collect();
        out.sort_by(|a, b| (a.received_at_ms, &a.delivery).cmp(&(b.received_at_ms, &b.delivery)));
        Ok(out)
    }

    pub(super) async fn insert_github_job(&self, job: &GithubJobRecord) -> Result<bool> {
        let sql = format!(
            "INSERT INTO github_jobs ({GITHUB_JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        );
        let done = bind_github_job(sqlx::query(&sql), job)?.execute(&self.pool).await?;
        Ok(done.rows_affected() == 1)
    }

    pub(super) async fn put_github_job(&self, job: &GithubJobRecord) -> Result<()> {
        let sql = format!(
            "INSERT OR REPLACE INTO github_jobs ({GITHUB_JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        );
        bind_github_job(sqlx::query(&sql), job)?.execute(&self.pool).await?;
        Ok(())
    }

    pub(super) async fn get_github_job(&self, id: i64) -> Result<Option<GithubJobRecord>> {
        let sql = format!("SELECT {GITHUB_JOB_COLUMNS} FROM github_jobs WHERE id = ?");
        let row = sqlx::query(&sql).bind(id).fetch_optional(&self.read).await?;
        row.as_ref().map(github_job_from_row).transpose()
    }

    pub(super) async fn github_jobs(&self, active_only: bool, limit: u32) -> Result<Vec<GithubJobRecord>> {
        let filter = if active_only { "WHERE state IN ('queued', 'in_progress')" } else { "" };
        let sql = format!(
            "SELECT {GITHUB_JOB_COLUMNS} FROM github_jobs {filter} ORDER BY queued_at_ms DESC, id DESC LIMIT ?"
        );
        let rows = sqlx::query(&sql).bind(i64::from(limit)).fetch_all(&self.read).await?;
        rows.iter().map(github_job_from_row).collect()
    }

    pub(super) async fn put_runner(&self, r: &RunnerRecord) -> Result<()> {
        let sql =
            format!("INSERT OR REPLACE INTO github_runners ({RUNNER_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");
        sqlx::query(&sql)
            .bind(&r.name)
            .bind(r.job_id)
            .bind(&r.pool)
            .bind(&r.repository)
            .bind(&r.org)
            .bind(r.runner_id)
            .bind(r.github_job_id)
            .bind(&r.state)
            .bind(r.created_at_ms)
            .bind(r.updated_at_ms)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub(super) async fn get_runner(&self, name: &str) -> Result<Option<RunnerRecord>> {
        let sql = format!("SELECT {RUNNER_COLUMNS} FROM github_runners WHERE name = ?");
        let row = sqlx::query(&sql).bind(name).fetch_optional(&self.read).await?;
        Ok(row.as_ref().map(runner_from_row))
    }

    pub(super) async fn runners(&self, active_only: bool) -> Result<Vec<RunnerRecord>> {
        let filter = if active_only { "WHERE state NOT IN ('done', 'removed')" } else { "" };
        let sql = format!("SELECT {RUNNER_COLUMNS} FROM github_runners {filter} ORDER BY created_at_ms, name");
        let rows = sqlx::query(&sql).fetch_all(&self.read).await?;
        Ok(rows.iter().map(runner_from_row).collect())
    }

    pub(super) async fn put_approval(&self, a: &ApprovalRecord) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT OR REPLACE INTO github_approvals (repository, pr, head_sha, approved_by, approved_at_ms) VALUES (?, ?, ?, ?, ?)",
        )
        .bind(&a.repository)
        .bind(a.pr)
        .bind(&a.head_sha)
        .bind(&a.approved_by)
        .bind(a.approved_at_ms)
        .execute(&mut *tx)
        .await?;
        insert_audit(&mut tx, &approval_audit(a)).await?;
        tx.commit().await?;
        Ok(())
    }

    pub(super) async fn get_approval(
        &self,
        repository: &str,
        pr: i64,
        head_sha: &str,
    ) -> Result<Option<ApprovalRecord>> {
        let row = sqlx::query(
            "SELECT repository, pr, head_sha, approved_by, approved_at_ms FROM github_approvals \
             WHERE repository = ? AND pr = ? AND head_sha = ?",
        )
        .bind(repository)
        .bind(pr)
        .bind(head_sha)
        .fetch_optional(&self.read)
        .await?;
        Ok(row.map(|r| ApprovalRecord {
            repository: r.get(0),
            pr: r.get(1),
            head_sha: r.get(2),
            approved_by: r.get(3),
            approved_at_ms: r.get(4),
        }))
    }

    pub(super) async fn set_check_run(&self, job: JobId, check_run_id: i64) -> Result<()> {
        sqlx::query("INSERT OR REPLACE INTO github_checks (job_id, check_run_id) VALUES (?, ?)")
            .bind(job)
            .bind(check_run_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub(super) async fn get_check_run(&self, job: JobId) -> Result<Option<i64>> {
        let row = sqlx::query("SELECT check_run_id FROM github_checks WHERE job_id = ?")
            .bind(job)
            .fetch_optional(&self.read)
            .await?;
        Ok(row.map(|r| r.get(0)))
    }
}
