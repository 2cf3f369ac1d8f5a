//! The end of an Actions runner job: a runner that exits without taking its job is replaced
//! (after the pause `backoff` decides) or deregistered, and a record stuck in the queue past
//! its pool's `queue_timeout` has its run cancelled on GitHub with the reason kept.

use super::{fmt_duration, Service};
use crate::brain;
use crate::github::backoff;
use crate::github::backoff::{Exits, Next, RunnerEnd};
use crate::origin::RunnerOrigin;
use gpuci_core::job::JobState;
use gpuci_github::Repo;
use gpuci_protocol::api::JobSummary;
use gpuci_protocol::JobId;
use gpuci_store::GithubJobRecord;
use std::time::Duration;

impl Service {
    pub(super) async fn runner_of_job(&self, job: JobId) -> Option<gpuci_store::RunnerRecord> {
        self.store.runners(false).await.ok()?.into_iter().rev().find(|r| r.job_id == job)
    }

    /// A runner job ended: deregister a runner that took no job, free the record it served,
    /// and let the pool queue the next.
    pub(super) async fn runner_job_ended(&mut self, j: &JobSummary, origin: &RunnerOrigin) {
        let now = brain::now_ms();
        let runner = self.runner_of_job(j.id).await;
        let took_job = runner.as_ref().is_some_and(|r| r.github_job_id.is_some());
        if let Some(mut runner) = runner.filter(|r| r.state != "done" && r.state != "removed") {
            if runner.github_job_id.is_none() {
                self.deregister(&runner).await;
                runner.state = "removed".into();
            } else {
                runner.state = "done".into();
            }
            runner.updated_at_ms = now;
            let _ = self.store.put_runner(&runner).await;
        }
        let active = self.store.github_jobs(true, 100_000).await.unwrap_or_default();
        for mut r in active.into_iter().filter(|r| r.runner_job_id == Some(j.id)) {
            if r.state == "queued" && j.state == JobState::TimedOut && j.started_at_ms.is_none() {
                // The runner never got GPUs: the job is stuck.
                let why = j.reason.clone();
                self.cancel_stuck(r, why).await;
                continue;
            }
            r.runner_job_id = None;
            if r.state == "queued" {
                let end = RunnerEnd {
                    job: j.id,
                    state: j.state,
                    reason: j.reason.clone(),
                    exit_code: j.exit_code,
                    started: j.started_at_ms.is_some(),
                    last_line: self.last_output_line(j.id).await,
                    took_job,
                };
                let policy = self
                    .pool(&origin.pool)
                    .map_or(backoff::Policy::new(Duration::from_secs(10)), |p| backoff::Policy::new(p.runner_backoff));
                let prior = Exits { count: r.runner_exits, last: r.last_runner_exit.clone() };
                let held = self.held_until_ms();
                match backoff::after_runner(&policy, &prior, &end, held, now, rand::random()) {
                    Next::Now { reason } => r.reason = reason,
                    Next::Wait { exits, retry_at_ms, reason } if exits == prior => {
                        tracing::info!(job = r.id, runner_job = j.id, %reason, "the next runner waits for GitHub's rate limit");
                        r.retry_at_ms = Some(retry_at_ms);
                        r.reason = reason;
                    }
                    Next::Wait { exits, retry_at_ms, reason } => {
                        tracing::warn!(
                            job = r.id,
                            runner_job = j.id,
                            exits = exits.count,
                            last = exits.last.as_deref().unwrap_or_default(),
                            "the runner exited without taking the job; the next one waits"
                        );
                        r.runner_exits = exits.count;
                        r.last_runner_exit = exits.last;
                        r.retry_at_ms = Some(retry_at_ms);
                        r.reason = reason;
                    }
                }
            }
            r.updated_at_ms = now;
            let _ = self.store.put_github_job(&r).await;
        }
        if let Some(pool) = self.pool(&origin.pool).cloned() {
            self.fill_pool(&pool).await;
        }
    }

    /// The last line a runner job wrote: its last stderr line, else its last stdout line
    /// (gpuci's own lines are not the runner's). Read forwards in pages: a runner that exits
    /// without a job writes little, and a long log is read only this far.
    pub(super) async fn last_output_line(&self, job: JobId) -> Option<String> {
        use gpuci_protocol::agent::Stream;
        const PAGE: u32 = 1000;
        let (mut after, mut stderr, mut stdout) = (0, None, None);
        for _ in 0..20 {
            let lines = self.store.read_logs(job, after, PAGE).await.ok()?;
            for l in lines.iter().filter(|l| !l.text.trim().is_empty()) {
                match l.stream {
                    Stream::Stderr => stderr = Some(l.text.clone()),
                    Stream::Stdout => stdout = Some(l.text.clone()),
                    Stream::System => {}
                }
            }
            match lines.last() {
                Some(last) if lines.len() == PAGE as usize => after = last.seq,
                _ => break,
            }
        }
        stderr.or(stdout)
    }

    pub(super) async fn deregister(&self, runner: &gpuci_store::RunnerRecord) {
        let Some(id) = runner.runner_id else { return };
        let result = match &runner.org {
            Some(org) => self.client.delete_org_runner(org, id as u64).await,
            None => match Repo::parse(&runner.repository) {
                Some(repo) => self.client.delete_runner(&repo, id as u64).await,
                None => return,
            },
        };
        match result {
            Ok(()) => tracing::info!(runner = %runner.name, "runner that took no job removed from GitHub"),
            Err(e) => tracing::warn!(runner = %runner.name, error = %e, "could not remove runner from GitHub"),
        }
    }

    /// Cancel a workflow run whose job waited past its pool's queue timeout, keeping why.
    pub(super) async fn cancel_stuck(&mut self, mut r: GithubJobRecord, why: String) {
        let Some(repo) = Repo::parse(&r.repository) else { return };
        if let Some(until) = self.held_until_ms() {
            // Asked again at every tick; the client would refuse it anyway. Quietly, until then.
            return tracing::debug!(job = r.id, until, "cancelling a stuck run waits for GitHub's rate limit");
        }
        let waited = fmt_duration(Duration::from_millis((brain::now_ms() - r.queued_at_ms).max(0) as u64));
        let reason = format!("cancelled by gpuci: no GPU runner after {waited}: {why}");
        match self.client.cancel_run(&repo, r.run_id as u64).await {
            Ok(()) => {
                tracing::warn!(job = r.id, run = r.run_id, repository = %r.repository, %reason, "stuck workflow run cancelled");
            }
            Err(e) if e.is_transient() => {
                return tracing::warn!(job = r.id, error = %e, "could not cancel stuck workflow run; retrying");
            }
            Err(e) => {
                tracing::error!(job = r.id, error = %e, "could not cancel stuck workflow run");
                r.state = "stuck".into();
                r.reason = format!("still queued after {waited} ({why}); cancelling the run failed: {e}");
                r.updated_at_ms = brain::now_ms();
                let _ = self.store.put_github_job(&r).await;
                return;
            }
        }
        let runner_job = r.runner_job_id.take();
        r.state = "cancelled".into();
        r.reason = reason.clone();
        r.updated_at_ms = brain::now_ms();
        let _ = self.store.put_github_job(&r).await;
        if let Some(job) = runner_job {
            self.cancel_job(job, reason).await;
        }
    }
}
