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
//!
//! Layout: this file holds the service's state, its task loop and job events; the handling
//! of `workflow_job` webhooks is in `workflow_jobs`, a runner job's end in `runners`, the tick
//! and reconciliation in `upkeep`, pipelines from pushes and pull requests in `pipelines`.

use super::config::{GithubConfig, Pool};
use super::report::{Item, Reporter};
use super::{Inbound, InboundTx};
use crate::brain::{self, BrainError, Command};
use crate::hub::{Event as HubEvent, Hub};
use crate::origin::Origin;
use crate::uploads::Uploads;
use gpuci_core::job::JobState;
use gpuci_github::{Client, Event, Repo, Secret};
use gpuci_protocol::api::JobSummary;
use gpuci_protocol::{JobId, PipelineId};
use gpuci_store::{PipelineRecord, Store};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

mod pipelines;
mod runners;
mod upkeep;
mod workflow_jobs;

/// What the webhook handler and the GitHub API endpoints need.
#[derive(Clone)]
pub struct Handle {
    pub webhook_secret: Secret,
    pub(crate) inbound: InboundTx,
    /// For its rate-limit figures.
    pub(crate) client: Arc<Client>,
    /// The gate webhook bodies pass before they are read (`github::intake`).
    pub(crate) intake: crate::github::intake::Intake,
}

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

/// How often the leader takes the webhook deliveries standbys queued, and how many at a time.
const INBOX_EVERY: Duration = Duration::from_secs(1);
const INBOX_BATCH: u32 = 100;
/// How long delivery ids, the hashes of bodies acted on and workflow job tombstones are kept
/// (docs/github.md): longer than GitHub lets anyone redeliver (3 days), so a redelivery is
/// always known as one.
pub const GITHUB_RECORDS_KEPT: Duration = Duration::from_secs(7 * 24 * 3600);
/// How often they are pruned, on the inbox's tick.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

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
    let handle = Handle {
        webhook_secret: cfg.webhook_secret.clone(),
        inbound: tx,
        client: client.clone(),
        intake: crate::github::intake::Intake::new(cfg.webhook_limits),
    };
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
        unrecorded: None,
        filled_once: false,
        reported: HashMap::new(),
        rate_warned: HashMap::new(),
        pruned_at: None,
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
    /// Runner jobs still queued or running, by the workflow job they were queued for, read
    /// once when this coordinator starts to lead (`None` until then): one queued by a
    /// coordinator that died before recording it on its workflow job is taken, not queued twice.
    unrecorded: Option<HashMap<i64, JobId>>,
    /// Whether every pool was filled since this coordinator started to lead: a workflow job
    /// recorded without its runner job (a coordinator killed in between) waits for nothing
    /// else to look at it.
    filled_once: bool,
    /// The last state reported per job, so GitHub hears of changes only.
    reported: HashMap<JobId, JobState>,
    /// (credential, resource) → the reset of the rate-limit window already warned about.
    rate_warned: HashMap<(String, String), i64>,
    /// When the deliveries' records were last pruned (`upkeep::prune_records`).
    pruned_at: Option<std::time::Instant>,
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
        let mut inbox = tokio::time::interval(INBOX_EVERY);
        inbox.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
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
                _ = inbox.tick() => {
                    self.take_inbox().await;
                    self.prune_records().await;
                }
            }
        }
    }

    /// Acts on the deliveries standbys accepted and queued (`crate::standby`), oldest first.
    /// Taken (deleted) before they are acted on, as a delivery this coordinator received is
    /// acted on once it is recorded: a crash between the two loses it, and reconciliation
    /// finds a missed workflow job again.
    async fn take_inbox(&mut self) {
        loop {
            let taken = match self.store.take_queued_deliveries(INBOX_BATCH).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(error = %e, "could not take the webhook deliveries standbys queued; trying again");
                    return;
                }
            };
            let full = taken.len() == INBOX_BATCH as usize;
            for d in taken {
                // Checked again: the standby checked it, but the inbox is a table, and a row
                // anything else wrote there (whoever can write the database) is not a delivery
                // from GitHub (outsider finding). Rows queued by an older coordinator kept no
                // signature and are dropped too; GitHub's "Redeliver" sends them again.
                let secret = self.cfg.webhook_secret.expose().as_bytes();
                if let Err(e) = gpuci_github::verify_signature(secret, &d.body, d.signature.as_deref()) {
                    tracing::error!(delivery = %d.delivery, event = %d.event, error = %e,
                        "a queued webhook delivery's signature does not hold (it was not queued by a coordinator that \
                         checked it, or by one older than this one, which kept none); dropped, not acted on");
                    continue;
                }
                match gpuci_github::parse_event(&d.event, &d.delivery, &d.body) {
                    Ok(e) => {
                        tracing::info!(delivery = %d.delivery, event = %d.event, "acting on a webhook delivery a standby accepted");
                        self.event(e).await;
                    }
                    Err(e) => {
                        tracing::warn!(delivery = %d.delivery, error = %e, "a queued webhook delivery does not parse; dropped")
                    }
                }
            }
            if !full {
                return;
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
}
