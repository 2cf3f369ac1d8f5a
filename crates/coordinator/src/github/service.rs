//! The GitHub service task: the one owner of the GitHub side's decisions and records.
//!
//! - `workflow_job.queued` for a pool's labels and repository → a workflow job record and, while
//!   the pool has room, an Actions runner job in gpuci's queue (the scheduler places it and the
//!   [`Registrar`](super::Registrar) registers the runner);
//! - `in_progress` links the runner that took the job (it may be another one of ours than the
//!   one queued for it: records swap runners so each keeps one); `completed` closes it;
//! - a record still queued past its pool's `queue_timeout` has its run cancelled on GitHub,
//!   with the reason kept; a runner that took no job within `idle_timeout` is removed and its
//!   GPUs freed; a runner that ends without a job is deregistered;
//! - a runner that exits without taking its job is replaced after a growing pause, and a
//!   failed question to GitHub keeps the job and asks again later ([`backoff`](super::backoff)
//!   decides both; the state is in the record, so a restart does not reset it);
//! - while GitHub's rate limit holds the client back, no runner job is queued and nothing is
//!   retried before the end GitHub named; waiting records say `GitHub rate limit until HH:MM:SS
//!   UTC` (the client refuses early calls itself; this keeps GPUs and reasons honest);
//! - reconciliation asks GitHub for queued jobs of the known repositories at start-up and
//!   every `reconcile_interval`, so a webhook missed while gpuci was down is not lost;
//! - `push` and `pull_request` run the commit's `.gpuci.yml`; pull requests from forks or
//!   outsiders wait for a maintainer's approval label, which covers one head SHA.

use super::backoff::{self, Exits, Next, RunnerEnd};
use super::config::{match_pool, ForkPolicy, GithubConfig, NoPool, Pool};
use super::report::{Item, PipelineReport, Reporter};
use super::{Inbound, InboundTx};
use crate::brain::{self, BrainError, Command};
use crate::hub::{Event as HubEvent, Hub};
use crate::origin::{GithubOrigin, Origin, RunnerOrigin};
use crate::uploads::Uploads;
use gpuci_core::job::JobState;
use gpuci_core::pipeline::{Pipeline, Step};
use gpuci_github::{
    AuthorAssociation, Client, Event, PullRequestAction, PullRequestEvent, PushEvent, Repo, Secret, WorkflowJobAction,
    WorkflowJobEvent,
};
use gpuci_protocol::api::JobSummary;
use gpuci_protocol::{JobId, PipelineId};
use gpuci_store::{ApprovalRecord, GithubJobRecord, PipelineRecord, Store};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What the webhook handler and the GitHub API endpoints need.
#[derive(Clone)]
pub struct Handle {
    pub webhook_secret: Secret,
    pub(crate) inbound: InboundTx,
    /// For its rate-limit figures.
    pub(crate) client: Arc<Client>,
}

/// The largest repository tarball gpuci downloads for a pipeline.
const MAX_TARBALL_BYTES: u64 = 512 << 20;
/// The most bytes a repository may unpack to.
const MAX_UNPACKED_BYTES: u64 = 4 << 30;

pub struct Deps {
    pub store: Arc<dyn Store>,
    pub brain: mpsc::Sender<Command>,
    pub hub: Arc<Hub>,
    pub uploads: Uploads,
    /// Links in reports: the configured public URL, else the listen address.
    pub public_url: String,
    /// How often timeouts are checked.
    pub tick: Duration,
}

/// Start the service and its reporter; returns what the webhook endpoint needs.
pub fn start(cfg: Arc<GithubConfig>, client: Arc<Client>, deps: Deps, shutdown: CancellationToken) -> Handle {
    let (tx, rx) = mpsc::channel(4096);
    let (report_tx, report_rx) = mpsc::unbounded_channel();
    let reporter = Reporter {
        client: client.clone(),
        store: deps.store.clone(),
        mode: cfg.report,
        public_url: cfg.public_url.clone().unwrap_or_else(|| deps.public_url.clone()),
    };
    tokio::spawn(reporter.run(report_rx, shutdown.clone()));
    let handle = Handle { webhook_secret: cfg.webhook_secret.clone(), inbound: tx, client: client.clone() };
    let events = deps.hub.subscribe();
    let service = Service {
        cfg,
        client,
        store: deps.store,
        brain: deps.brain,
        uploads: deps.uploads,
        tick: deps.tick,
        report: report_tx,
        origins: HashMap::new(),
        reported: HashMap::new(),
        rate_warned: HashMap::new(),
    };
    tokio::spawn(service.run(rx, events, shutdown));
    handle
}

struct Service {
    cfg: Arc<GithubConfig>,
    client: Arc<Client>,
    store: Arc<dyn Store>,
    brain: mpsc::Sender<Command>,
    uploads: Uploads,
    tick: Duration,
    report: mpsc::UnboundedSender<Item>,
    /// Pipeline → where it came from (`None`: not from GitHub). Filled as jobs are seen.
    origins: HashMap<PipelineId, Option<Origin>>,
    /// The last state reported per job, so GitHub hears of changes only.
    reported: HashMap<JobId, JobState>,
    /// (credential, resource) → the reset of the rate-limit window already warned about.
    rate_warned: HashMap<(String, String), i64>,
}

/// A queued workflow job, from a webhook or from reconciliation.
struct Queued {
    id: u64,
    run_id: u64,
    name: String,
    labels: Vec<String>,
    repository: String,
    head_sha: String,
}

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

/// Unix milliseconds of a wall-clock time.
fn unix_ms(at: std::time::SystemTime) -> i64 {
    at.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn fmt_duration(d: Duration) -> String {
    gpuci_core::duration::Duration::from_millis(d.as_millis() as u64).to_string()
}

impl Service {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Inbound>,
        mut events: tokio::sync::broadcast::Receiver<HubEvent>,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(self.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first reconcile runs at once: webhooks missed while gpuci was down.
        let mut reconcile = tokio::time::interval(self.cfg.reconcile_interval);
        reconcile.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                m = rx.recv() => match m {
                    Some(Inbound::Event(e)) => self.event(e).await,
                    None => break,
                },
                e = events.recv() => match e {
                    Ok(HubEvent::Job(j)) => self.job_changed(&j).await,
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "GitHub service lagged behind job events; re-reading runner jobs");
                        self.resync().await;
                    }
                    Err(_) => break,
                },
                _ = tick.tick() => self.tick().await,
                _ = reconcile.tick() => self.reconcile().await,
            }
        }
    }

    async fn event(&mut self, e: Event) {
        match e {
            Event::WorkflowJob(w) => self.workflow_job(w).await,
            Event::PullRequest(p) => self.pull_request(p).await,
            Event::Push(p) => self.push(p).await,
            Event::Ping | Event::Ignored { .. } => {}
        }
    }

    // ---- the scheduler ----

    async fn ask<T>(&self, make: impl FnOnce(brain::Reply<T>) -> Command) -> Result<T, BrainError> {
        brain::ask(&self.brain, make).await
    }

    async fn cancel_job(&self, job: JobId, reason: String) {
        match self.ask(|reply| Command::Cancel { job, reason, reply }).await {
            Ok(_) | Err(BrainError::AlreadyFinished { .. }) => {}
            Err(e) => tracing::warn!(job, error = %e, "could not cancel job"),
        }
    }

    fn pool(&self, name: &str) -> Option<&Pool> {
        self.cfg.pools.iter().find(|p| p.name == name)
    }

    // ---- workflow jobs and runners ----

    async fn workflow_job(&mut self, w: WorkflowJobEvent) {
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

    async fn queued(&mut self, q: Queued, source: &str) {
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
    fn held_until_ms(&self) -> Option<i64> {
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
    async fn apply_fork_check(&self, r: &mut GithubJobRecord, pool: &Pool, head_sha: String) {
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
    async fn fill_pool(&mut self, pool: &Pool) {
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
            match self.submit_runner(&r, pool).await {
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

    async fn submit_runner(&mut self, r: &GithubJobRecord, pool: &Pool) -> Result<JobId, BrainError> {
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
                }),
                reply,
            })
            .await?;
        self.origins.insert(p.id, Some(origin));
        jobs.first().map(|j| j.id).ok_or(BrainError::ShuttingDown)
    }

    async fn in_progress(&mut self, w: &WorkflowJobEvent) {
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
        if let Some(mut r) = record {
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
    }

    async fn completed(&mut self, w: &WorkflowJobEvent) {
        let now = brain::now_ms();
        if let Some(name) = &w.runner_name {
            if let Ok(Some(mut runner)) = self.store.get_runner(name).await {
                runner.state = "done".into();
                runner.github_job_id.get_or_insert(w.job_id as i64);
                runner.updated_at_ms = now;
                let _ = self.store.put_runner(&runner).await;
            }
        }
        let Ok(Some(mut r)) = self.store.get_github_job(w.job_id as i64).await else { return };
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

    async fn runner_of_job(&self, job: JobId) -> Option<gpuci_store::RunnerRecord> {
        self.store.runners(false).await.ok()?.into_iter().rev().find(|r| r.job_id == job)
    }

    /// A runner job ended: deregister a runner that took no job, free the record it served,
    /// and let the pool queue the next.
    async fn runner_job_ended(&mut self, j: &JobSummary, origin: &RunnerOrigin) {
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
    async fn last_output_line(&self, job: JobId) -> Option<String> {
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

    async fn deregister(&self, runner: &gpuci_store::RunnerRecord) {
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
    async fn cancel_stuck(&mut self, mut r: GithubJobRecord, why: String) {
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

    async fn tick(&mut self) {
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

    /// Logs once per window when a credential has used nine tenths of its GitHub rate limit.
    fn warn_rate_limits(&mut self) {
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
    async fn recheck_served(&mut self, runner_job: JobId) {
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
    async fn reconcile(&mut self) {
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
    async fn resync(&mut self) {
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

    // ---- job events ----

    async fn origin(&mut self, pipeline: PipelineId) -> Option<Origin> {
        if let Some(o) = self.origins.get(&pipeline) {
            return o.clone();
        }
        // A cache, not a record: bounded so a long-lived coordinator does not grow it forever.
        if self.origins.len() > 100_000 {
            self.origins.clear();
        }
        let o = match self.store.get_pipeline(pipeline).await {
            Ok(Some(PipelineRecord { origin, .. })) => Origin::parse(origin.as_deref()),
            _ => None,
        };
        self.origins.insert(pipeline, o.clone());
        o
    }

    async fn job_changed(&mut self, j: &JobSummary) {
        let Some(origin) = self.origin(j.pipeline_id).await else { return };
        if self.reported.get(&j.id) == Some(&j.state) {
            return;
        }
        self.reported.insert(j.id, j.state);
        match origin {
            Origin::ActionsRunner(r) if j.state.is_terminal() => {
                self.reported.remove(&j.id);
                self.runner_job_ended(j, &r).await;
            }
            Origin::ActionsRunner(_) => {}
            Origin::Github(g) => {
                let Some(repo) = Repo::parse(&g.repository) else { return };
                let _ = self.report.send(Item::Job {
                    repo,
                    sha: g.sha.clone(),
                    job: j.id,
                    name: j.name.clone(),
                    key: j.step_key.clone(),
                    state: j.state,
                    soft: j.soft_failed,
                    reason: j.reason.clone(),
                });
                if j.state.is_terminal() {
                    self.reported.remove(&j.id);
                }
            }
        }
    }

    // ---- gpuci pipelines from pushes and pull requests ----

    fn runs_pipelines(&self, repository: &str) -> bool {
        self.cfg.repositories.iter().any(|r| r.eq_ignore_ascii_case(repository))
    }

    async fn push(&mut self, p: PushEvent) {
        if p.deleted || !self.runs_pipelines(&p.repository.full_name) {
            return;
        }
        let origin = GithubOrigin {
            repository: p.repository.full_name.clone(),
            sha: p.after.clone(),
            event: "push".into(),
            pr: None,
            secrets: true,
            git_ref: Some(p.git_ref.clone()),
            head_branch: None,
            base_branch: None,
            default_branch: p.default_branch.clone(),
            trusted: true,
            approved_by: None,
            subject: p.subject.clone(),
            author: p.author.clone(),
        };
        self.run_pipeline(origin, Some(p.git_ref.clone())).await;
    }

    async fn pull_request(&mut self, p: PullRequestEvent) {
        let repository = p.base_repository.full_name.clone();
        if !self.runs_pipelines(&repository) {
            return;
        }
        let Some(repo) = Repo::parse(&repository) else { return };
        let trusted = !p.from_fork
            && matches!(
                p.author_association,
                AuthorAssociation::Owner | AuthorAssociation::Member | AuthorAssociation::Collaborator
            );
        let origin = GithubOrigin {
            repository: repository.clone(),
            sha: p.head_sha.clone(),
            event: "pull_request".into(),
            pr: Some(p.number),
            // Code from a fork never sees secrets, approved or not.
            secrets: !p.from_fork,
            git_ref: None,
            head_branch: p.head_ref.clone(),
            base_branch: p.base_ref.clone(),
            default_branch: p.default_branch.clone(),
            // Nor do its caches reach a trusted job: approval lets it run, not write for others.
            trusted,
            approved_by: None,
            subject: p.title.clone(),
            author: p.author.clone(),
        };
        let label = self.cfg.approval_label.clone();
        match p.action {
            PullRequestAction::Opened | PullRequestAction::Synchronize | PullRequestAction::Reopened => {
                if trusted {
                    return self.run_pipeline(origin, None).await;
                }
                match self.store.get_approval(&repository, p.number as i64, &p.head_sha).await {
                    Ok(Some(a)) => {
                        let origin = GithubOrigin { approved_by: Some(a.approved_by), ..origin };
                        self.run_pipeline(origin, None).await
                    }
                    Ok(None) => {
                        tracing::info!(repository = %repository, pr = p.number, sha = %p.head_sha, "pull request waits for approval");
                        let _ = self.report.send(Item::Pipeline {
                            repo,
                            sha: p.head_sha.clone(),
                            state: PipelineReport::WaitingForApproval,
                            title: format!(
                                "waiting for approval: a maintainer adds the `{label}` label to run commit {}",
                                short(&p.head_sha)
                            ),
                            summary: format!(
                                "This pull request comes from a fork or an outside contributor. gpuci runs it on GPUs only after a maintainer with write access adds the `{label}` label. The approval covers commit {} only: a new push needs a new approval.",
                                p.head_sha
                            ),
                        });
                    }
                    Err(e) => tracing::error!(error = %e, "could not read approvals"),
                }
            }
            PullRequestAction::Labeled if p.label.as_deref() == Some(label.as_str()) => {
                if trusted {
                    return;
                }
                let sender = p.sender.clone().unwrap_or_default();
                let allowed = match self.client.collaborator_permission(&repo, &sender).await {
                    Ok(perm) => perm.can_write(),
                    Err(e) => {
                        tracing::warn!(error = %e, %sender, "could not check the labeller's permission");
                        false
                    }
                };
                if !allowed {
                    tracing::warn!(repository = %repository, pr = p.number, %sender, "approval label added by someone without write access: ignored");
                    return;
                }
                let already =
                    matches!(self.store.get_approval(&repository, p.number as i64, &p.head_sha).await, Ok(Some(_)));
                let approval = ApprovalRecord {
                    repository: repository.clone(),
                    pr: p.number as i64,
                    head_sha: p.head_sha.clone(),
                    approved_by: sender.clone(),
                    approved_at_ms: brain::now_ms(),
                };
                if let Err(e) = self.store.put_approval(&approval).await {
                    return tracing::error!(error = %e, "could not record approval");
                }
                // The label is spent: the next push must be approved again.
                if let Err(e) = self.client.remove_label(&repo, p.number, &label).await {
                    tracing::warn!(error = %e, "could not remove the approval label");
                }
                if !already {
                    tracing::info!(repository = %repository, pr = p.number, sha = %p.head_sha, %sender, "pull request approved");
                    let _ = self.report.send(Item::Pipeline {
                        repo: repo.clone(),
                        sha: p.head_sha.clone(),
                        state: PipelineReport::Approved,
                        title: format!("approved by {sender} for commit {}", short(&p.head_sha)),
                        summary: format!("{sender} added the `{label}` label. The jobs report as `gpuci / <step>`."),
                    });
                    let origin = GithubOrigin { approved_by: Some(sender.clone()), ..origin };
                    self.run_pipeline(origin, None).await;
                }
            }
            _ => {}
        }
    }

    async fn run_pipeline(&mut self, origin: GithubOrigin, git_ref: Option<String>) {
        let Some(repo) = Repo::parse(&origin.repository) else { return };
        let file = self.cfg.pipeline_file.clone();
        let fail = |title: String, summary: String| Item::Pipeline {
            repo: repo.clone(),
            sha: origin.sha.clone(),
            state: PipelineReport::Failed,
            title,
            summary,
        };
        let bytes = match self.client.file_contents(&repo, &file, &origin.sha).await {
            Ok(Some(b)) => b,
            Ok(None) => {
                return tracing::debug!(repository = %origin.repository, sha = %origin.sha, "no {file}; nothing to run")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read {file}");
                let _ = self.report.send(fail(format!("gpuci could not read {file}"), e.to_string()));
                return;
            }
        };
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let mut pipeline = match gpuci_core::pipeline::parse(&file, &text) {
            Ok(p) => p,
            Err(errors) => {
                let summary = errors.to_string();
                let first = summary.lines().next().unwrap_or_default().to_string();
                let _ = self.report.send(fail(format!("{file} is invalid: {first}"), format!("```\n{summary}\n```")));
                return;
            }
        };
        let tgz = match self.client.tarball(&repo, &origin.sha, MAX_TARBALL_BYTES).await {
            Ok(t) => match tokio::task::spawn_blocking(move || strip_top_dir(&t)).await {
                Ok(r) => r,
                Err(e) => Err(e.to_string()),
            },
            Err(e) => Err(e.to_string()),
        };
        // Taken after the download (a pin holds upload garbage collection back) and held
        // until the pipeline naming the upload is committed (`crate::uploads`).
        let pin = self.uploads.pin().await;
        let upload = match tgz {
            Ok(tgz) => self.uploads.put(&pin, tgz).await.map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        let upload = match upload {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(error = %e, "could not fetch the repository");
                let _ = self
                    .report
                    .send(fail(format!("gpuci could not fetch {}@{}", origin.repository, short(&origin.sha)), e));
                return;
            }
        };
        if let Some(pr) = origin.pr {
            supersede_per_pull_request(&mut pipeline, &origin.repository, pr);
        }
        let mut env = BTreeMap::from([
            ("GITHUB_REPOSITORY".to_string(), origin.repository.clone()),
            ("GITHUB_SHA".to_string(), origin.sha.clone()),
            ("GITHUB_EVENT_NAME".to_string(), origin.event.clone()),
        ]);
        if let Some(r) = git_ref {
            env.insert("GITHUB_REF".into(), r);
        }
        if let Some(pr) = origin.pr {
            env.insert("GITHUB_PR_NUMBER".into(), pr.to_string());
        }
        let build = Origin::Github(origin.clone()).build_facts();
        let json = Origin::Github(origin.clone()).to_json();
        let result = self
            .ask(|reply| Command::Submit {
                sub: Box::new(crate::brain::Submission {
                    file_name: format!("{}@{}:{file}", origin.repository, short(&origin.sha)),
                    source: text,
                    pipeline,
                    extra_env: env,
                    workspace_upload: Some(upload),
                    repository: Some(format!("github.com/{}", origin.repository.to_ascii_lowercase())),
                    origin: Some(json),
                    build,
                }),
                reply,
            })
            .await;
        drop(pin);
        match result {
            Ok((p, jobs)) => {
                tracing::info!(pipeline = p.id, repository = %origin.repository, sha = %origin.sha, event = %origin.event, "pipeline started from GitHub");
                self.origins.insert(p.id, Some(Origin::Github(origin)));
                for j in jobs {
                    let summary = crate::convert::job_summary(&j, None);
                    self.job_changed(&summary).await;
                }
            }
            Err(e) => {
                let _ = self.report.send(fail("gpuci could not start the pipeline".into(), e.to_string()));
            }
        }
    }
}

/// A new run of a pull request cancels the unfinished jobs of its previous run, step by step
/// (a concurrency group per pull request and step, newest wins), unless a step names its own
/// concurrency group.
fn supersede_per_pull_request(pipeline: &mut Pipeline, repository: &str, pr: u64) {
    for step in pipeline.steps.iter_mut().filter(|s| s.concurrency.is_none()) {
        step.concurrency = Some(gpuci_core::pipeline::Concurrency {
            group: format!("github:{}#{pr}/{}", repository.to_ascii_lowercase(), step.key),
            cancel_in_progress: true,
        });
    }
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(7)]
}

/// GitHub's tarball has one top-level directory (`owner-repo-sha/`); a workspace is the
/// repository's root. Re-pack without it, refusing archives that unpack past the limit.
fn strip_top_dir(tgz: &[u8]) -> Result<Vec<u8>, String> {
    use flate2::read::GzDecoder;
    use flate2::write::GzEncoder;
    let mut input = tar::Archive::new(GzDecoder::new(tgz));
    let mut out = tar::Builder::new(GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    let mut total: u64 = 0;
    let strip = |p: &std::path::Path| -> Option<std::path::PathBuf> {
        let rest: std::path::PathBuf = p.components().skip(1).collect();
        (!rest.as_os_str().is_empty()).then_some(rest)
    };
    for entry in input.entries().map_err(|e| format!("reading the tarball: {e}"))? {
        let mut entry = entry.map_err(|e| format!("reading the tarball: {e}"))?;
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions() || kind.is_pax_local_extensions() || kind.is_gnu_longname() {
            continue;
        }
        let path = entry.path().map_err(|e| format!("tarball entry: {e}"))?.into_owned();
        let Some(rel) = strip(&path) else { continue };
        total += entry.size();
        if total > MAX_UNPACKED_BYTES {
            return Err(format!("the repository unpacks to more than {} GiB", MAX_UNPACKED_BYTES >> 30));
        }
        let mut header = entry.header().clone();
        if kind.is_hard_link() {
            let target = entry.link_name().ok().flatten().and_then(|t| strip(&t));
            let Some(target) = target else { continue };
            out.append_link(&mut header, &rel, &target).map_err(|e| e.to_string())?;
        } else if kind.is_symlink() {
            let Some(target) = entry.link_name().ok().flatten().map(|t| t.into_owned()) else { continue };
            out.append_link(&mut header, &rel, &target).map_err(|e| e.to_string())?;
        } else {
            out.append_data(&mut header, &rel, &mut entry).map_err(|e| e.to_string())?;
        }
    }
    let gz = out.into_inner().map_err(|e| e.to_string())?;
    gz.finish().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tarball_top_directory_is_stripped() {
        let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        for (path, data) in
            [("octo-gpu-abc1234/.gpuci.yml", "steps: []\n"), ("octo-gpu-abc1234/src/a.py", "print(1)\n")]
        {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, path, data.as_bytes()).unwrap();
        }
        let tgz = b.into_inner().unwrap().finish().unwrap();
        let out = strip_top_dir(&tgz).unwrap();
        let mut a = tar::Archive::new(flate2::read::GzDecoder::new(&out[..]));
        let names: Vec<String> =
            a.entries().unwrap().map(|e| e.unwrap().path().unwrap().display().to_string()).collect();
        assert_eq!(names, vec![".gpuci.yml", "src/a.py"]);
    }
}
