//! Postgres backend: job log lines, appended in order and read back by sequence number.
//! The `Store` impl in `postgres.rs` forwards to these methods; they hold this area's SQL and nothing else.

use super::*;

impl PostgresStore {
    pub(super) async fn append_logs(
        &self,
        job: JobId,
        first_seq: Option<i64>,
        lines: &[LogChunk],
    ) -> Result<Vec<LogLine>> {
        if lines.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.pool.begin().await?;
        // Sequence numbers are MAX(seq) + 1..: two appends to the same job must not read the
        // same MAX. Locking the job's row serialises them (per job; other jobs' logs don't
        // wait). With no such job nothing is locked and the insert below fails on the foreign
        // key, as in SQLite.
        let state: Option<String> = sqlx::query("SELECT state FROM jobs WHERE id = $1 FOR UPDATE")
            .bind(job)
            .fetch_optional(&mut *tx)
            .await?
            .map(|r| r.get(0));
        if first_seq.is_some()
            && state.as_deref().and_then(|s| s.parse::<JobState>().ok()).is_some_and(JobState::is_terminal)
        {
            // See the trait: an ended job's log takes no more of its agent's lines.
            return Ok(Vec::new());
        }
        let last: i64 = sqlx::query("SELECT COALESCE(MAX(seq), 0) FROM job_logs WHERE job_id = $1")
            .bind(job)
            .fetch_one(&mut *tx)
            .await?
            .get(0);
        // Numbered by the writer: lines stored before (a resend) are skipped. Else after the last.
        let first = first_seq.unwrap_or(last + 1);
        let skip = usize::try_from((last + 1 - first).max(0)).unwrap_or(usize::MAX).min(lines.len());
        let (first, lines) = (first + skip as i64, &lines[skip..]);
        let mut out = Vec::with_capacity(lines.len());
        // Multi-row insert in batches keeps a burst of output to one round trip per 100 lines.
        for (b, chunk) in lines.chunks(100).enumerate() {
            let mut qb = sqlx::QueryBuilder::new("INSERT INTO job_logs (job_id, seq, ts_us, stream, text) ");
            qb.push_values(chunk.iter().enumerate(), |mut row, (i, l)| {
                let seq = first + (b * 100 + i) as i64;
                row.push_bind(job)
                    .push_bind(seq)
                    .push_bind(l.ts_us)
                    .push_bind(stream_str(l.stream))
                    .push_bind(l.text.clone());
                out.push(LogLine { seq, ts_us: l.ts_us, stream: l.stream, text: l.text.clone() });
            });
            qb.build().execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(out)
    }

    pub(super) async fn read_logs(&self, job: JobId, after_seq: i64, limit: u32) -> Result<Vec<LogLine>> {
        let rows = sqlx::query(
            "SELECT seq, ts_us, stream, text FROM job_logs WHERE job_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(job)
        .bind(after_seq)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| LogLine {
                seq: r.get("seq"),
                ts_us: r.get("ts_us"),
                stream: stream_parse(r.get("stream")),
                text: r.get("text"),
            })
            .collect())
    }

    pub(super) async fn last_log_lines(&self, jobs: &[JobId]) -> Result<std::collections::HashMap<JobId, i64>> {
        let rows = sqlx::query(
            "SELECT job_id, MAX(seq)::BIGINT FROM job_logs WHERE job_id = ANY($1::bigint[]) GROUP BY job_id",
        )
        .bind(jobs)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| (r.get::<i64, _>(0), r.get::<i64, _>(1))).collect())
    }

    pub(super) async fn log_extent(&self, job: JobId) -> Result<(u64, i64)> {
        let row = sqlx::query("SELECT COALESCE(SUM(octet_length(text) + $2), 0)::BIGINT, COALESCE(MAX(seq), 0)::BIGINT FROM job_logs WHERE job_id = $1")
            .bind(job)
            .bind(gpuci_protocol::agent::LOG_LINE_COST as i64)
            .fetch_one(&self.pool)
            .await?;
        let (bytes, last): (i64, i64) = (row.get(0), row.get(1));
        Ok((bytes.max(0) as u64, last))
    }
}
