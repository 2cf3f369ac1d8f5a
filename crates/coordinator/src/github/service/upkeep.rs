//! The service's periodic work: the tick (queue and idle timeouts, retries whose pause is
//! over, rate-limit warnings), reconciliation with GitHub's list of queued jobs, so a
//! webhook missed while gpuci was down is not lost, and pruning the deliveries' records.
//! Each runs on the service's own task.

use super::{fmt_duration, Queued, Service, GITHUB_RECORDS_KEPT, PRUNE_EVERY};
use crate::brain;
use crate::github::backoff;
use crate::github::backoff::Exits;
use crate::github::config::ForkPolicy;
use gpuci_core::job::JobState;
use gpuci_github::{Repo, WorkflowJobAction, WorkflowJobEvent};
use gpuci_protocol::JobId;

impl Service {
    pub(super) async fn tick(&mut self) {
        let now = brain::now_ms();
        // Queue timeouts.
        let active = self.store.github_jobs(true, 100_000).await.unwrap_or_default();
        let mut due_pools: Vec<String> = Vec::new();
        for mut r in active.into_iter().filter(|r| r.state == "queued") {
            let Some(pool) = self.pool(&r.pool).cloned() else { continue };
            if now - r.queued_at_ms >= pool.queue_timeout.as_millis() as i64 {
                let job_reason = match r.runner_job_id {
                    Some(job) => Some(match self.store.get_job(job).await {
                        Ok(Some(j)) => j.reason,
                        _ => "its runner job is gone".into(),
                    }),
                    None => None,
                };
                let exits = Exits { count: r.runner_exits, last: r.last_runner_exit.clone() };
                let policy = backoff::Policy::new(pool.runner_backoff);
                let why = backoff::stuck_why(&policy, &exits, job_reason.as_deref(), &r.reason);
                self.cancel_stuck(r, why).await;
                continue;
            }
            let due = r.retry_at_ms.is_some_and(|at| at <= now);
            if r.check_failures > 0 && pool.forks == ForkPolicy::Allow {
                // The pool was changed to allow forks since: nothing to ask.
                r.check_failures = 0;
                r.retry_at_ms = None;
                r.reason = "waiting for a runner".into();
                let _ = self.store.put_github_job(&r).await;
                due_pools.push(pool.name.clone());
            } else if due && r.check_failures > 0 {
                // The fork check failed before: ask again, for the run's commit when GitHub says
                // which (it narrows the listing to that run's).
                let head_sha = match Repo::parse(&r.repository) {
                    Some(repo) => self.client.get_job(&repo, r.id as u64).await.map(|j| j.head_sha).unwrap_or_default(),
                    None => String::new(),
                };
                self.apply_fork_check(&mut r, &pool, head_sha).await;
                let _ = self.store.put_github_job(&r).await;
                if r.check_failures == 0 && r.state == "queued" {
                    due_pools.push(pool.name.clone());
                }
            } else if due && r.runner_job_id.is_none() {
                due_pools.push(pool.name.clone());
            }
        }
        if !self.filled_once {
            self.filled_once = true;
            due_pools.extend(self.cfg.pools.iter().map(|p| p.name.clone()));
        }
        due_pools.sort();
        due_pools.dedup();
        for name in due_pools {
            if let Some(pool) = self.pool(&name).cloned() {
                self.fill_pool(&pool).await;
            }
        }
        self.warn_rate_limits();
        // Runners that took no job.
        let runners = self.store.runners(true).await.unwrap_or_default();
        for mut runner in runners.into_iter().filter(|r| r.state == "registered" && r.github_job_id.is_none()) {
            let Some(pool) = self.pool(&runner.pool) else { continue };
            let idle = pool.idle_timeout;
            let Ok(Some(job)) = self.store.get_job(runner.job_id).await else { continue };
            let Some(started) = job.started_at_ms.filter(|_| job.state == JobState::Running) else { continue };
            if now - started < idle.as_millis() as i64 {
                continue;
            }
            let why = format!("the runner took no job within {} (idle_timeout); removed", fmt_duration(idle));
            tracing::info!(runner = %runner.name, job = runner.job_id, "{why}");
            // Cancel first: the runner exits on its own once it sees itself removed, and that
            // exit must read as this cancel, not as a failure.
            self.cancel_job(runner.job_id, why).await;
            self.deregister(&runner).await;
            runner.state = "removed".into();
            runner.updated_at_ms = now;
            let _ = self.store.put_runner(&runner).await;
            self.recheck_served(runner.job_id).await;
        }
    }

    /// Forgets delivery ids, hashes of bodies acted on and workflow job tombstones older than
    /// [`GITHUB_RECORDS_KEPT`], at most every [`PRUNE_EVERY`] (the first time at start).
    pub(super) async fn prune_records(&mut self) {
        if self.pruned_at.is_some_and(|at| at.elapsed() < PRUNE_EVERY) {
            return;
        }
        self.pruned_at = Some(std::time::Instant::now());
        let before = brain::now_ms() - GITHUB_RECORDS_KEPT.as_millis() as i64;
        match self.store.prune_github_records(before).await {
            Ok(p) if p == Default::default() => {}
            Ok(p) => tracing::info!(
                deliveries = p.deliveries,
                payloads = p.payloads,
                tombstones = p.tombstones,
                "pruned GitHub delivery records older than 7 days"
            ),
            // The next prune tries again; nothing depends on it but the table's size.
            Err(e) => tracing::warn!(error = %e, "could not prune GitHub delivery records"),
        }
    }

    /// Logs once per window when a credential has used nine tenths of its GitHub rate limit.
    pub(super) fn warn_rate_limits(&mut self) {
        for l in self.client.rate_limits() {
            if l.limit == 0 || l.remaining.saturating_mul(10) >= l.limit {
                continue;
            }
            let key = (l.credential.clone(), l.resource.clone());
            if self.rate_warned.get(&key) == Some(&l.reset) {
                continue;
            }
            self.rate_warned.insert(key, l.reset);
            tracing::warn!(credential = %l.credential, resource = %l.resource, remaining = l.remaining,
                limit = l.limit, reset = l.reset, "GitHub rate limit nearly used up");
        }
    }

    /// After a runner idled out: is the workflow job it was queued for still queued on GitHub?
    /// If not (taken by another runner, re-run, deleted), settle its record so no new runner is
    /// started for it; if so, a new runner is tried until the queue timeout.
    pub(super) async fn recheck_served(&mut self, runner_job: JobId) {
        let active = self.store.github_jobs(true, 100_000).await.unwrap_or_default();
        let Some(mut r) = active.into_iter().find(|r| r.runner_job_id == Some(runner_job)) else { return };
        let Some(repo) = Repo::parse(&r.repository) else { return };
        let (state, reason) = match self.client.get_job(&repo, r.id as u64).await {
            Ok(j) if j.status == "queued" => return,
            Ok(j) => (
                if j.status == "completed" { "completed" } else { "in_progress" },
                format!("GitHub says {} (runner {})", j.status, j.runner_name.as_deref().unwrap_or("?")),
            ),
            Err(gpuci_github::ApiError::Status { status, .. }) if status.as_u16() == 404 => {
                ("gone", "GitHub no longer knows this workflow job".to_string())
            }
            Err(e) => return tracing::warn!(job = r.id, error = %e, "could not re-check workflow job"),
        };
        r.state = state.into();
        r.reason = reason;
        r.runner_job_id = None;
        r.updated_at_ms = brain::now_ms();
        let _ = self.store.put_github_job(&r).await;
    }

    /// Ask GitHub for queued jobs of the known repositories; record those no webhook told of,
    /// and settle records whose end no webhook reported.
    pub(super) async fn reconcile(&mut self) {
        if let Some(until) = self.held_until_ms() {
            // Every call would be refused before it is sent; the next interval asks again.
            return tracing::info!(reason = %backoff::rate_limit_reason(until), "reconcile skipped");
        }
        let mut repos: Vec<String> = self.cfg.repositories.clone();
        for p in &self.cfg.pools {
            repos.extend(p.repositories.iter().filter(|r| !r.ends_with("/*")).cloned());
        }
        repos.sort_by_key(|r| r.to_ascii_lowercase());
        repos.dedup_by(|a, b| a.eq_ignore_ascii_case(b));
        for name in repos {
            let Some(repo) = Repo::parse(&name) else { continue };
            for status in ["queued", "in_progress"] {
                let runs = match self.client.list_runs(&repo, Some(status), None).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(repository = %name, error = %e, "reconcile: could not list workflow runs");
                        continue;
                    }
                };
                for run in runs {
                    let jobs = match self.client.list_run_jobs(&repo, run.id).await {
                        Ok(j) => j,
                        Err(e) => {
                            tracing::warn!(repository = %name, run = run.id, error = %e, "reconcile: could not list jobs");
                            continue;
                        }
                    };
                    for j in jobs.into_iter().filter(|j| j.status == "queued") {
                        let q = Queued {
                            id: j.id,
                            run_id: j.run_id,
                            name: j.name,
                            labels: j.labels,
                            repository: name.clone(),
                            head_sha: j.head_sha,
                        };
                        self.queued(q, "reconcile").await;
                    }
                }
            }
        }
        // Records GitHub has moved on from without telling us.
        let active = self.store.github_jobs(true, 100_000).await.unwrap_or_default();
        for r in active {
            let Some(repo) = Repo::parse(&r.repository) else { continue };
            let Ok(j) = self.client.get_job(&repo, r.id as u64).await else { continue };
            let as_event = |action| WorkflowJobEvent {
                action,
                job_id: j.id,
                run_id: j.run_id,
                job_name: Some(j.name.clone()),
                labels: j.labels.clone(),
                runner_id: None,
                runner_name: j.runner_name.clone(),
                head_sha: j.head_sha.clone(),
                conclusion: j.conclusion.clone(),
                repository: gpuci_github::Repository {
                    full_name: r.repository.clone(),
                    owner: repo.owner.clone(),
                    name: repo.name.clone(),
                },
                installation_id: None,
            };
            match j.status.as_str() {
                "completed" => self.completed(&as_event(WorkflowJobAction::Completed)).await,
                "in_progress" if r.state == "queued" => {
                    self.in_progress(&as_event(WorkflowJobAction::InProgress)).await
                }
                _ => {}
            }
        }
    }

    /// After missing job events: settle runner jobs that ended unseen.
    pub(super) async fn resync(&mut self) {
        let active = self.store.github_jobs(true, 100_000).await.unwrap_or_default();
        for r in active {
            let Some(job) = r.runner_job_id else { continue };
            if let Ok(Some(j)) = self.store.get_job(job).await {
                if j.state.is_terminal() {
                    let summary = crate::convert::job_summary(&j, None);
                    self.job_changed(&summary).await;
                }
            }
        }
    }
}
