//! Schedules: the task that fires `[[schedule]]`s, and their API.
//!
//! One task owns the schedules. Each pass it asks the pure rule
//! ([`gpuci_core::schedule::due`]) whether a schedule fires now, given the occurrence last
//! fired and when the schedule was last looked at (both in the store: a pass records it, for
//! disabled schedules too, so only downtime is ever caught up); then it sleeps until the
//! earliest next occurrence (at most a minute), or until a manual run is asked for.
//!
//! Exactly once: a fire is recorded in the store *before* its pipeline is fetched and
//! submitted, under a key (schedule, cause, occurrence) the database keeps unique, so neither a
//! restart nor a second pass fires an occurrence twice. A fire cut short by a stop (recorded,
//! never submitted) is marked as such at the next start and not retried: retrying could run
//! it twice when the stop came after the pipeline was committed. Catch-up after downtime is
//! at most one run (the latest missed occurrence; `gpuci_core::schedule`).
//!
//! Fetching the source is an effect done off the task: `git clone --depth 1` of the
//! schedule's repository and branch into the data dir, the pipeline file read from the
//! commit (`git show`, so a symlink is never followed), and the tree archived
//! (`git archive`) as the pipeline's workspace upload. A schedule whose source cannot be
//! fetched records a failed fire with the reason; the others go on.

use crate::brain::Command;
use gpuci_core::condition::{BuildEvent, BuildFacts};
use gpuci_core::schedule::{due, next_after};
use gpuci_core::schedule_config::ScheduleSpec;
use gpuci_protocol::PipelineId;
use gpuci_store::{ScheduleFireRecord, Store};
use jiff::Timestamp;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// The most a pipeline file may weigh.
const MAX_PIPELINE_BYTES: u64 = 1 << 20;
/// How long one git command may take.
const GIT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a pass may sleep at most: a wall clock set forward is noticed within this.
const MAX_SLEEP: Duration = Duration::from_secs(60);
/// The error of a fire a stop cut short.
pub const INTERRUPTED: &str =
    "the coordinator stopped while this fire was being submitted; not retried, so that it cannot run twice";

/// What the API needs: the schedules as configured, and the task's queue.
#[derive(Clone)]
pub struct Handle {
    pub specs: Arc<Vec<ScheduleSpec>>,
    tx: mpsc::Sender<RunNow>,
}

impl Handle {
    /// Fires schedule `name` now and answers its recorded fire once it is submitted (or
    /// failed: why, in the `Err`); `None` when the task has stopped (shutting down).
    pub async fn run_now(&self, name: String) -> Option<Result<ScheduleFireRecord, String>> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(RunNow { name, reply }).await.ok()?;
        rx.await.ok()
    }
}

/// `gpuci schedules run NAME`: fire now, answer the fire once it is submitted (or failed).
struct RunNow {
    name: String,
    reply: oneshot::Sender<Result<ScheduleFireRecord, String>>,
}

/// What firing needs.
#[derive(Clone)]
pub struct Deps {
    pub store: Arc<dyn Store>,
    pub brain: mpsc::Sender<Command>,
    pub uploads: crate::uploads::Uploads,
    /// Checkouts are made here (`<data-dir>/schedules`), one directory per fire, removed after.
    pub work_dir: PathBuf,
}

/// Start the schedules' task. Before it returns, every schedule is armed (a new one from
/// now: runs due before are never owed; a known one from when it was last looked at) and
/// fires a stop cut short are marked, so that what the coordinator owes is settled before it
/// serves.
pub async fn start(
    specs: Vec<ScheduleSpec>,
    deps: Deps,
    shutdown: CancellationToken,
) -> Result<Handle, gpuci_store::StoreError> {
    let specs = Arc::new(specs);
    let (tx, rx) = mpsc::channel(64);
    let n = deps.store.interrupt_schedule_fires(INTERRUPTED).await?;
    if n > 0 {
        tracing::warn!(fires = n, "schedule fires cut short by the last stop were not submitted");
    }
    let now = Timestamp::now().as_millisecond();
    // The last pass before this start: a schedule that was known but not configured then
    // (removed, and now back) owes nothing from before it either.
    let last_pass = deps.store.schedules_last_checked().await?.unwrap_or(now);
    let mut checked = BTreeMap::new();
    for s in specs.iter() {
        let own = deps.store.arm_schedule(&s.name, now).await?;
        checked.insert(s.name.clone(), own.max(last_pass.min(now)));
    }
    if !specs.is_empty() {
        tracing::info!(schedules = specs.len(), "schedules on");
    }
    tokio::spawn(run(specs.clone(), deps, rx, checked, shutdown));
    Ok(Handle { specs, tx })
}

async fn run(
    specs: Arc<Vec<ScheduleSpec>>,
    deps: Deps,
    mut rx: mpsc::Receiver<RunNow>,
    mut checked: BTreeMap<String, i64>,
    shutdown: CancellationToken,
) {
    loop {
        let wake = pass(&specs, &deps, &mut checked).await;
        let sleep = wake.unwrap_or(MAX_SLEEP).clamp(Duration::from_millis(20), MAX_SLEEP);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            req = rx.recv() => {
                let Some(req) = req else { return };
                run_now(&specs, &deps, req).await;
            }
            _ = tokio::time::sleep(sleep) => {}
        }
    }
}

/// One pass over the schedules: fire those due; answer how long until the next occurrence
/// (`None`: none known, or the store failed and the pass is to be tried again soon).
/// `checked`: when each schedule was last looked at (by this run, or the last one before
/// it started): after downtime, only occurrences since then are owed, and a schedule that was
/// disabled owes nothing from then (it is looked at, and not fired, in every pass).
async fn pass(specs: &[ScheduleSpec], deps: &Deps, checked: &mut BTreeMap<String, i64>) -> Option<Duration> {
    let now = Timestamp::now();
    let mut wake: Option<Timestamp> = None;
    let mut failed = false;
    for spec in specs.iter() {
        let checked_at = checked.get(&spec.name).copied().unwrap_or(now.as_millisecond());
        if spec.enabled {
            match fire_if_due(spec, deps, now, checked_at).await {
                Ok(next) => {
                    if let Some(n) = next {
                        wake = Some(wake.map_or(n, |w| w.min(n)));
                    }
                }
                Err(e) => {
                    tracing::warn!(schedule = %spec.name, error = %e, "schedules: cannot use the database; retrying");
                    failed = true;
                    continue;
                }
            }
        } else if let Some(n) = next_after(&spec.cron, &spec.tz, now) {
            // Looked at after each occurrence it does not fire for, so that enabling it
            // later owes none of them.
            wake = Some(wake.map_or(n, |w| w.min(n)));
        }
        match deps.store.schedule_checked(&spec.name, now.as_millisecond()).await {
            Ok(()) => {
                checked.insert(spec.name.clone(), now.as_millisecond());
            }
            Err(e) => {
                tracing::warn!(schedule = %spec.name, error = %e, "schedules: cannot use the database; retrying");
                failed = true;
            }
        }
    }
    if failed {
        return Some(Duration::from_secs(5));
    }
    let wake = wake?;
    let ms = wake.as_millisecond() - Timestamp::now().as_millisecond();
    Some(Duration::from_millis(ms.max(0) as u64))
}

/// Apply [`due`] to one schedule: record and start its fire when one is due. Answers its
/// next occurrence.
async fn fire_if_due(
    spec: &ScheduleSpec,
    deps: &Deps,
    now: Timestamp,
    checked_at: i64,
) -> Result<Option<Timestamp>, gpuci_store::StoreError> {
    let last = deps.store.last_cron_fire(&spec.name).await?;
    let since = Timestamp::from_millisecond(last.unwrap_or(checked_at).max(checked_at)).unwrap_or(now);
    let d = due(&spec.cron, &spec.tz, now, since);
    if let Some(at) = d.fire {
        let fire = ScheduleFireRecord {
            id: 0,
            schedule: spec.name.clone(),
            cause: "cron".into(),
            scheduled_at_ms: at.as_millisecond(),
            fired_at_ms: now.as_millisecond(),
            skipped_from_ms: d.skipped_from.map(|t| t.as_millisecond()),
            pipeline_id: None,
            error: None,
        };
        if let Some(from) = d.skipped_from {
            tracing::warn!(schedule = %spec.name, missed_from = %from, firing = %at,
                "schedule missed runs while the coordinator was down: only the latest runs");
        }
        // Recorded before anything is fetched or submitted: this is the exactly-once guard.
        if let Some(id) = deps.store.record_schedule_fire(&fire).await? {
            tracing::info!(schedule = %spec.name, occurrence = %at, "schedule fires");
            let (deps, spec) = (deps.clone(), spec.clone());
            tokio::spawn(async move {
                let _ = fire_and_record(&deps, &spec, id, at).await;
            });
        }
    }
    Ok(d.next)
}

async fn run_now(specs: &[ScheduleSpec], deps: &Deps, req: RunNow) {
    let Some(spec) = specs.iter().find(|s| s.name == req.name) else {
        let _ = req.reply.send(Err(format!("no schedule {:?}", req.name)));
        return;
    };
    let now = Timestamp::now();
    let fire = ScheduleFireRecord {
        id: 0,
        schedule: spec.name.clone(),
        cause: "manual".into(),
        scheduled_at_ms: now.as_millisecond(),
        fired_at_ms: now.as_millisecond(),
        skipped_from_ms: None,
        pipeline_id: None,
        error: None,
    };
    let id = match deps.store.record_schedule_fire(&fire).await {
        Ok(Some(id)) => id,
        Ok(None) => {
            let _ = req.reply.send(Err("a manual run of this schedule was recorded this very millisecond".into()));
            return;
        }
        Err(e) => {
            let _ = req.reply.send(Err(format!("recording the fire: {e}")));
            return;
        }
    };
    let (deps, spec) = (deps.clone(), spec.clone());
    tokio::spawn(async move {
        let outcome = fire_and_record(&deps, &spec, id, now).await;
        let (pipeline_id, error) = match outcome {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        };
        let _ = req.reply.send(Ok(ScheduleFireRecord { id, pipeline_id, error, ..fire }));
    });
}

/// Fetch, submit and record what came of a recorded fire.
async fn fire_and_record(deps: &Deps, spec: &ScheduleSpec, id: i64, at: Timestamp) -> Result<PipelineId, String> {
    let outcome = fetch_and_submit(deps, spec, at).await;
    let (pipeline, error) = match &outcome {
        Ok(p) => (Some(*p), None),
        Err(e) => {
            tracing::warn!(schedule = %spec.name, error = %e, "schedule fire failed");
            (None, Some(e.as_str()))
        }
    };
    if let Err(e) = deps.store.finish_schedule_fire(id, pipeline, error).await {
        tracing::error!(schedule = %spec.name, fire = id, error = %e, "could not record what came of a schedule fire");
    }
    outcome
}

/// A checkout directory, removed when dropped.
struct Checkout(PathBuf);

impl Drop for Checkout {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn fetch_and_submit(deps: &Deps, spec: &ScheduleSpec, at: Timestamp) -> Result<PipelineId, String> {
    std::fs::create_dir_all(&deps.work_dir).map_err(|e| format!("creating {}: {e}", deps.work_dir.display()))?;
    let checkout = Checkout(deps.work_dir.join(uuid::Uuid::new_v4().to_string()));
    let src = checkout.0.join("src");
    let mut clone: Vec<&str> = vec!["clone", "--quiet", "--depth", "1", "--single-branch", "--no-tags"];
    if let Some(b) = &spec.branch {
        clone.extend(["--branch", b]);
    }
    let src_arg = src.to_string_lossy().to_string();
    clone.extend(["--", spec.repository.as_str(), src_arg.as_str()]);
    let what = match &spec.branch {
        Some(b) => format!("fetching {} branch {b}", spec.repository),
        None => format!("fetching {}", spec.repository),
    };
    git(&checkout.0, &clone, u64::MAX).await.map_err(|e| format!("{what}: {e}"))?;
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).trim().to_string();
    let commit = text(git(&src, &["rev-parse", "HEAD"], 1024).await.map_err(|e| format!("{what}: {e}"))?);
    let branch = match &spec.branch {
        Some(b) => b.clone(),
        None => {
            text(git(&src, &["rev-parse", "--abbrev-ref", "HEAD"], 1024).await.map_err(|e| format!("{what}: {e}"))?)
        }
    };
    let short = commit.get(..12).unwrap_or(&commit).to_string();
    let object = format!("HEAD:{}", spec.pipeline);
    // Its size first: a huge file is refused without being read.
    let size = text(
        git(&src, &["cat-file", "-s", &object], 64)
            .await
            .map_err(|e| format!("reading {} at {branch} ({short}): {e}", spec.pipeline))?,
    );
    if size.parse::<u64>().map_or(true, |n| n > MAX_PIPELINE_BYTES) {
        return Err(format!(
            "{} at {branch} ({short}) is {size} bytes, over the {MAX_PIPELINE_BYTES} a pipeline file may have",
            spec.pipeline
        ));
    }
    let source = git(&src, &["show", &object], MAX_PIPELINE_BYTES)
        .await
        .map_err(|e| format!("reading {} at {branch} ({short}): {e}", spec.pipeline))?;
    let source = String::from_utf8(source).map_err(|_| format!("{} at {short} is not UTF-8 text", spec.pipeline))?;
    let pipeline = gpuci_core::pipeline::parse(&spec.pipeline, &source).map_err(|errs| {
        let mut s = format!("{} at {branch} ({short}) is not a valid pipeline:", spec.pipeline);
        for e in errs.0.iter().take(5) {
            s.push_str(&format!(" {}:{}:{}: {}: {};", e.file, e.line, e.column, e.field, e.message));
        }
        s
    })?;
    let archive = checkout.0.join("workspace.tar.gz");
    let archive_arg = archive.to_string_lossy().to_string();
    git(&src, &["archive", "--format=tar.gz", "-o", &archive_arg, "HEAD"], 1024)
        .await
        .map_err(|e| format!("archiving {branch} ({short}): {e}"))?;
    let size = std::fs::metadata(&archive).map(|m| m.len()).unwrap_or(0);
    if size > crate::uploads::MAX_UPLOAD_BYTES {
        return Err(format!(
            "the repository at {short} archives to {size} bytes, over the {} bytes a workspace may have",
            crate::uploads::MAX_UPLOAD_BYTES
        ));
    }
    let bytes = tokio::fs::read(&archive).await.map_err(|e| format!("reading the archive: {e}"))?;
    let pin = deps.uploads.pin().await;
    let upload = deps.uploads.put(&pin, bytes).await.map_err(|e| format!("storing the workspace: {e}"))?;
    let mut env = spec.env.clone();
    env.insert("GPUCI_SCHEDULE".into(), spec.name.clone());
    env.insert("GPUCI_SCHEDULED_AT".into(), at.to_string());
    let sub = crate::brain::Submission {
        file_name: spec.pipeline.clone(),
        source,
        pipeline,
        extra_env: env,
        workspace_upload: Some(upload),
        repository: Some(spec.repository.clone()),
        origin: None,
        build: BuildFacts {
            branch: Some(branch),
            tag: None,
            event: Some(BuildEvent::Schedule),
            commit: Some(commit),
            changed: None,
            subject: None,
            author: None,
        },
        once: None,
    };
    let (p, _) = crate::brain::ask(&deps.brain, |reply| Command::Submit { sub: Box::new(sub), reply })
        .await
        .map_err(|e| format!("submitting: {e}"))?;
    drop(pin);
    Ok(p.id)
}

/// Run git in `dir`, never prompting (a repository that needs credentials fails at once
/// instead of hanging); stdout, at most `max` bytes. The error is git's last line of stderr.
/// The coordinator user's git config and ssh keys apply: that is how a private repository
/// is reached.
async fn git(dir: &Path, args: &[&str], max: u64) -> Result<Vec<u8>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut cmd = tokio::process::Command::new("git");
    cmd.args(args)
        .current_dir(dir)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_ASKPASS", "true")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(GIT_TIMEOUT, cmd.output()).await {
        Err(_) => return Err(format!("git {} took longer than {}s", args[0], GIT_TIMEOUT.as_secs())),
        Ok(Err(e)) => return Err(format!("running git: {e}")),
        Ok(Ok(o)) => o,
    };
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let line = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
        let line: String = line.chars().filter(|c| !c.is_control()).take(500).collect();
        return Err(if line.is_empty() { format!("git {} failed ({})", args[0], out.status) } else { line });
    }
    if out.stdout.len() as u64 > max {
        return Err(format!("more than {max} bytes"));
    }
    Ok(out.stdout)
}
