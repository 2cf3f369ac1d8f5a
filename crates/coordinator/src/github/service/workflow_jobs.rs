//! `workflow_job` webhooks: a queued job for a pool becomes a record and, while the pool has
//! room, an Actions runner job in gpuci's queue; `in_progress` links the runner that took it
//! and `completed` closes it. Pull requests from forks are checked here before a runner is
//! queued. What to retry and when is [`backoff`](super::super::backoff)'s decision, not this
//! module's.
//!
//! Deliveries can arrive out of order (GitHub does not promise an order, and one a standby
//! queued is acted on after those sent to the leader directly): an `in_progress` or
//! `completed` for a job of a pool gpuci has no record of leaves a tombstone in the store
//! (kept as long as delivery ids, across a takeover), and a later `queued` for that job is
//! ignored — else its record would wait in `queued`, holding a runner, until the queue timeout.

use super::{unix_ms, Queued, Service};
use crate::brain;
use crate::brain::{BrainError, Command};
use crate::github::backoff;
use crate::github::backoff::Exits;
use crate::github::config::{match_pool, ForkPolicy, NoPool, Pool};
use crate::origin::{Origin, RunnerOrigin};
use gpuci_core::pipeline::{Pipeline, Step};
use gpuci_github::{Repo, WorkflowJobAction, WorkflowJobEvent};
use gpuci_protocol::JobId;
use gpuci_store::GithubJobRecord;
use std::collections::BTreeMap;
use std::collections::HashMap;

/// Why the fork check could not answer.
#[derive(Debug, thiserror::Error)]
enum ForkCheckError {
    #[error("bad repository name {0:?}")]
    BadRepository(String),
    #[error(transparent)]
    Github(#[from] gpuci_github::ApiError),
    #[error("run {0} not found")]
    RunNotFound(u64),
}

impl Service {
    pub(super) async fn workflow_job(&mut self, w: WorkflowJobEvent) {
        match w.action {
            WorkflowJobAction::Queued => {
                let q = Queued {
                    id: w.job_id,
                    run_id: w.run_id,
                    name: w.job_name.clone().unwrap_or_default(),
                    labels: w.labels.clone(),
                    repository: w.repository.full_name.clone(),
                    head_sha: w.head_sha.clone(),
                };
                self.queued(q, "webhook").await;
            }
            WorkflowJobAction::InProgress => self.in_progress(&w).await,
            WorkflowJobAction::Completed => self.completed(&w).await,
            WorkflowJobAction::Waiting | WorkflowJobAction::Other => {}
        }
    }

    pub(super) async fn queued(&mut self, q: Queued, source: &str) {
        let pool = match match_pool(&self.cfg.pools, &q.repository, &q.labels) {
            Ok(p) => p.clone(),
            Err(NoPool::Labels) => {
                tracing::debug!(job = q.id, labels = ?q.labels, "workflow job: no pool serves its labels; ignored");
                return;
            }
            Err(NoPool::Repository(pools)) => {
                tracing::info!(job = q.id, repository = %q.repository, %pools,
                    "workflow job: pools serve its labels but not its repository; ignored");
                return;
            }
        };
        match self.store.get_github_job(q.id as i64).await {
            Ok(Some(_)) => return,
            Ok(None) => {}
            Err(e) => return tracing::error!(error = %e, "could not read workflow job records"),
        }
        match self.store.github_tombstone(q.id as i64).await {
            Ok(None) => {}
            Ok(Some(action)) => {
                return tracing::info!(job = q.id, repository = %q.repository, source, said = %action,
                    "workflow job: GitHub said it was {action} before this queued delivery arrived; no runner queued")
            }
            Err(e) => return tracing::error!(error = %e, "could not read workflow job tombstones"),
        }
        let now = brain::now_ms();
        let mut record = GithubJobRecord {
            id: q.id as i64,
            repository: q.repository.clone(),
            run_id: q.run_id as i64,
            name: q.name.clone(),
            labels: q.labels.clone(),
            pool: pool.name.clone(),
            state: "queued".into(),
            runner_job_id: None,
            runner_name: None,
            reason: "waiting for a runner".into(),
            queued_at_ms: now,
            updated_at_ms: now,
            runner_exits: 0,
            last_runner_exit: None,
            check_failures: 0,
            retry_at_ms: None,
        };
        if pool.forks == ForkPolicy::Deny {
            // A failed check keeps the job: recorded, no runner until a later check passes.
            self.apply_fork_check(&mut record, &pool, q.head_sha.clone()).await;
        }
        match self.store.insert_github_job(&record).await {
            Ok(true) => {
                tracing::info!(job = q.id, pool = %pool.name, repository = %q.repository, source, "workflow job queued for a runner")
            }
            Ok(false) => return,
            Err(e) => return tracing::error!(error = %e, "could not record workflow job"),
        }
        self.fill_pool(&pool).await;
    }

    /// Until when GitHub's rate limit holds the client back (Unix ms), while it does.
    pub(super) fn held_until_ms(&self) -> Option<i64> {
        self.client.held_until().map(unix_ms)
    }

    async fn run_is_from_fork(
        &self,
        repository: &str,
        run_id: u64,
        head_sha: Option<&str>,
    ) -> Result<bool, ForkCheckError> {
        let repo = Repo::parse(repository).ok_or_else(|| ForkCheckError::BadRepository(repository.to_owned()))?;
        let runs = self.client.list_runs(&repo, None, head_sha).await?;
        let run = runs.iter().find(|r| r.id == run_id).ok_or(ForkCheckError::RunNotFound(run_id))?;
        Ok(run.head_repository_full_name.as_deref().is_none_or(|h| !h.eq_ignore_ascii_case(repository)))
    }

    /// Asks whether `r`'s run comes from a fork and sets the record from the answer: refused, or
    /// free to get a runner, or (the question failed) kept with the error and a time to ask
    /// again. `head_sha` narrows the listing when known (a record does not keep it).
    pub(super) async fn apply_fork_check(&self, r: &mut GithubJobRecord, pool: &Pool, head_sha: String) {
        let head_sha = (!head_sha.is_empty()).then_some(head_sha);
        let now = brain::now_ms();
        match self.run_is_from_fork(&r.repository, r.run_id as u64, head_sha.as_deref()).await {
            Ok(false) => {
                if r.check_failures > 0 {
                    r.reason = "waiting for a runner".into();
                }
                r.check_failures = 0;
                r.retry_at_ms = None;
            }
            Ok(true) => {
                r.state = "refused".into();
                r.reason =
                    format!("pool {} does not run jobs of workflow runs from forks (forks = \"deny\")", pool.name);
                r.check_failures = 0;
                r.retry_at_ms = None;
                tracing::info!(job = r.id, repository = %r.repository, "workflow job from a fork refused");
            }
            Err(e) => {
                r.check_failures = r.check_failures.saturating_add(1);
                let policy = backoff::Policy::new(pool.runner_backoff);
                let held = match &e {
                    ForkCheckError::Github(e) => e.retry_not_before().map(unix_ms),
                    _ => None,
                };
                let held = held.max(self.held_until_ms());
                let error = e.to_string();
                let (at, reason) = backoff::check_failed(&policy, r.check_failures, &error, held, now, rand::random());
                r.retry_at_ms = Some(at);
                r.reason = reason;
                tracing::warn!(job = r.id, error = %e, tries = r.check_failures,
                    "could not tell whether the run comes from a fork; the job is kept and asked about again");
            }
        }
        r.updated_at_ms = now;
    }

    /// Queue runner jobs for the pool's oldest waiting records while it has room.
    pub(super) async fn fill_pool(&mut self, pool: &Pool) {
        let records = match self.store.github_jobs(true, 100_000).await {
            Ok(r) => r,
            Err(e) => return tracing::error!(error = %e, "could not read workflow job records"),
        };
        let mine: Vec<GithubJobRecord> = records.into_iter().filter(|r| r.pool == pool.name).collect();
        let mut live = mine.iter().filter(|r| r.runner_job_id.is_some()).count() as u32;
        let now = brain::now_ms();
        // Not those whose check is owed or whose backoff is not over: they keep their reason.
        let mut waiting: Vec<GithubJobRecord> = mine
            .into_iter()
            .filter(|r| r.state == "queued" && r.runner_job_id.is_none())
            .filter(|r| r.check_failures == 0 && r.retry_at_ms.is_none_or(|at| at <= now))
            .collect();
        waiting.sort_by_key(|r| (r.queued_at_ms, r.id));
        let policy = backoff::Policy::new(pool.runner_backoff);
        if let Some(until) = self.held_until_ms() {
            // A runner job now would hold GPUs while its registration is refused: none until
            // GitHub's time, when the tick finds these records due.
            for mut r in waiting {
                let exits = Exits { count: r.runner_exits, last: r.last_runner_exit.clone() };
                let mut why = format!("{}; waiting to register a runner", backoff::rate_limit_reason(until));
                if let Some(s) = backoff::summary(&policy, &exits) {
                    why = format!("{why}; {s}");
                }
                if r.reason != why || r.retry_at_ms != Some(until) {
                    r.reason = why;
                    r.retry_at_ms = Some(until);
                    r.updated_at_ms = brain::now_ms();
                    let _ = self.store.put_github_job(&r).await;
                }
            }
            return;
        }
        for mut r in waiting {
            if live >= pool.max_runners {
                let mut why =
                    format!("waiting: pool {} runs at most {} runners at a time", pool.name, pool.max_runners);
                let exits = Exits { count: r.runner_exits, last: r.last_runner_exit.clone() };
                if let Some(s) = backoff::summary(&policy, &exits) {
                    why = format!("{why}; {s}");
                }
                // A pause that is over waits for room like the rest: the next runner to end
                // fills the pool, so the tick need not keep trying.
                if r.reason != why || r.retry_at_ms.is_some() {
                    r.reason = why;
                    r.retry_at_ms = None;
                    r.updated_at_ms = brain::now_ms();
                    let _ = self.store.put_github_job(&r).await;
                }
                continue;
            }
            let queued = match self.unrecorded_runner(r.id).await {
                Some(job) => {
                    tracing::info!(workflow_job = r.id, job, "a runner job queued before a restart or takeover, not recorded on its workflow job: taken instead of queuing another");
                    Ok(job)
                }
                None => self.submit_runner(&r, pool).await,
            };
            match queued {
                Ok(job) => {
                    live += 1;
                    r.runner_job_id = Some(job);
                    r.retry_at_ms = None;
                    let exits = Exits { count: r.runner_exits, last: r.last_runner_exit.clone() };
                    r.reason = backoff::queued_reason(&policy, job, &exits);
                    r.updated_at_ms = brain::now_ms();
                    if let Err(e) = self.store.put_github_job(&r).await {
                        tracing::error!(error = %e, "could not record the runner job");
                    }
                }
                Err(e) => tracing::error!(job = r.id, error = %e, "could not queue a runner job"),
            }
        }
    }

    /// A live runner job queued for workflow job `id` that no record names (its coordinator
    /// died between queuing it and recording it), if there is one.
    async fn unrecorded_runner(&mut self, id: i64) -> Option<JobId> {
        if self.unrecorded.is_none() {
            let mut found = HashMap::new();
            let named: std::collections::HashSet<JobId> = match self.store.github_jobs(true, 100_000).await {
                Ok(records) => records.iter().filter_map(|r| r.runner_job_id).collect(),
                Err(e) => {
                    tracing::error!(error = %e, "could not read workflow job records");
                    return None;
                }
            };
            let active = match self.store.active_jobs().await {
                Ok(a) => a,
                Err(e) => {
                    tracing::error!(error = %e, "could not read the active jobs");
                    return None;
                }
            };
            for j in active.iter().filter(|j| j.step.key == "runner" && !named.contains(&j.id)) {
                if let Some(Origin::ActionsRunner(o)) = self.origin(j.pipeline_id).await {
                    found.entry(o.github_job_id).or_insert(j.id);
                }
            }
            self.unrecorded = Some(found);
        }
        self.unrecorded.as_mut().and_then(|u| u.remove(&id))
    }

    pub(super) async fn submit_runner(&mut self, r: &GithubJobRecord, pool: &Pool) -> Result<JobId, BrainError> {
        let mut step = Step::new("runner", r#"exec "$GPUCI_RUNNER_DIR/run.sh""#);
        step.label = Some(format!("actions runner: {} / {}", r.repository, r.name));
        step.agents = pool.agents.clone();
        step.gpu = pool.gpu.clone();
        step.timeout = Some(pool.job_timeout);
        // Longer than the pool's: the service cancels the GitHub run first, with the reason.
        step.queue_timeout =
            Some(gpuci_core::duration::Duration::from_millis(pool.queue_timeout.as_millis() as u64 * 2 + 60_000));
        let origin = Origin::ActionsRunner(RunnerOrigin {
            pool: pool.name.clone(),
            repository: r.repository.clone(),
            org: pool.org.clone(),
            labels: pool.runner_labels(),
            runner_group_id: pool.runner_group_id,
            install_dir: pool.install_dir.clone(),
            github_job_id: r.id,
        });
        let source = format!(
            "# Actions runner for {} workflow job {} ({}), pool {}\n# labels: {}\n",
            r.repository,
            r.id,
            r.name,
            pool.name,
            pool.runner_labels().join(", ")
        );
        let env = BTreeMap::from([("GITHUB_REPOSITORY".to_string(), r.repository.clone())]);
        let (p, jobs) = self
            .ask(|reply| Command::Submit {
                sub: Box::new(crate::brain::Submission {
                    file_name: format!("github:{}#job-{}", r.repository, r.id),
                    source,
                    pipeline: Pipeline { env: BTreeMap::new(), steps: vec![step] },
                    extra_env: env,
                    workspace_upload: None,
                    repository: Some(r.repository.clone()),
                    origin: Some(origin.to_json()),
                    build: Default::default(),
                    once: None,
                }),
                reply,
            })
            .await?;
        self.origins.insert(p.id, Some(origin));
        jobs.first().map(|j| j.id).ok_or(BrainError::ShuttingDown)
    }

    pub(super) async fn in_progress(&mut self, w: &WorkflowJobEvent) {
        let now = brain::now_ms();
        let runner = match &w.runner_name {
            Some(n) => self.store.get_runner(n).await.ok().flatten(),
            None => None,
        };
        let record = self.store.get_github_job(w.job_id as i64).await.ok().flatten();
        if let Some(mut runner) = runner.clone() {
            runner.github_job_id = Some(w.job_id as i64);
            runner.state = "busy".into();
            runner.updated_at_ms = now;
            let _ = self.store.put_runner(&runner).await;
            // The runner queued for another record took this job: swap, so each record keeps
            // the runner that will serve it.
            if let Ok(active) = self.store.github_jobs(true, 100_000).await {
                if let Some(mut other) =
                    active.into_iter().find(|r| r.runner_job_id == Some(runner.job_id) && r.id != w.job_id as i64)
                {
                    other.runner_job_id = record.as_ref().and_then(|r| r.runner_job_id);
                    other.updated_at_ms = now;
                    let _ = self.store.put_github_job(&other).await;
                }
            }
        }
        let Some(mut r) = record else {
            return self.tombstone_unknown(w, "in_progress").await;
        };
        if r.state == "queued" || r.state == "in_progress" {
            r.state = "in_progress".into();
            r.runner_name = w.runner_name.clone();
            if let Some(runner) = &runner {
                r.runner_job_id = Some(runner.job_id);
                r.reason = format!("running on gpuci runner {} (job {})", runner.name, runner.job_id);
            } else {
                r.reason = format!("running on runner {}", w.runner_name.as_deref().unwrap_or("?"));
            }
            r.updated_at_ms = now;
            let _ = self.store.put_github_job(&r).await;
        }
    }

    pub(super) async fn completed(&mut self, w: &WorkflowJobEvent) {
        let now = brain::now_ms();
        if let Some(name) = &w.runner_name {
            if let Ok(Some(mut runner)) = self.store.get_runner(name).await {
                runner.state = "done".into();
                runner.github_job_id.get_or_insert(w.job_id as i64);
                runner.updated_at_ms = now;
                let _ = self.store.put_runner(&runner).await;
            }
        }
        let mut r = match self.store.get_github_job(w.job_id as i64).await {
            Ok(Some(r)) => r,
            Ok(None) => return self.tombstone_unknown(w, "completed").await,
            Err(e) => return tracing::error!(error = %e, "could not read workflow job records"),
        };
        if r.state == "completed" || r.state == "cancelled" {
            return;
        }
        let conclusion = w.conclusion.clone().unwrap_or_else(|| "unknown".into());
        let never_ran = r.state == "queued";
        r.state = "completed".into();
        r.reason = format!("completed: {conclusion}");
        r.updated_at_ms = now;
        let runner_job = r.runner_job_id;
        let _ = self.store.put_github_job(&r).await;
        // Cancelled (or finished elsewhere) before our runner took it: that runner is not needed.
        if let (true, Some(job)) = (never_ran, runner_job) {
            let taken = self.runner_of_job(job).await.is_some_and(|x| x.github_job_id.is_some());
            if !taken {
                self.cancel_job(job, format!("workflow job {} ended ({conclusion}) before a runner took it", w.job_id))
                    .await;
            }
        }
    }

    /// GitHub says a job gpuci has no record of started or ended: if it is one of a pool's
    /// (else it is none of gpuci's business), remember that, so a `queued` delivery for it
    /// that arrives later queues no runner.
    async fn tombstone_unknown(&self, w: &WorkflowJobEvent, action: &str) {
        if match_pool(&self.cfg.pools, &w.repository.full_name, &w.labels).is_err() {
            return;
        }
        tracing::info!(job = w.job_id, repository = %w.repository.full_name, action,
            "workflow job unknown to gpuci is {action}; a queued delivery for it arriving later will be ignored");
        if let Err(e) = self.store.put_github_tombstone(w.job_id as i64, action, brain::now_ms()).await {
            tracing::warn!(job = w.job_id, error = %e, "could not remember a workflow job that ended before it was queued");
        }
    }
}
