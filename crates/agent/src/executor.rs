//! Running one job: GPU pre-check, sandbox, output lines, timeout and cancel, telemetry,
//! post-job GPU check, cleanup. The result is a [`JobFinished`] the agent keeps until the
//! coordinator acknowledges it.

use crate::logmask::JobMask;
use gpuci_core::job::Outcome;
use gpuci_core::mask::Masker;
use gpuci_gpu::{GpuBackend, HealthBaseline, HealthPolicy};
use gpuci_protocol::agent::{Assignment, GpuHealth, JobFinished, JobTelemetry, LogChunk, Stream, Unenforced};
use gpuci_protocol::JobId;
use gpuci_sandbox::{Isolation, Sandbox, SandboxSpec};
use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

pub fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

/// What a job task reports to the agent loop, in order, on one channel (so a job's last lines
/// always come before its result).
///
/// The channel has no length limit, yet the job's output in it is bounded: each line of job
/// output holds `held`, its size in the job's in-flight budget ([`JOB_IN_FLIGHT_BYTES`]), until
/// the agent loop has put it into its (byte-bounded) outbox. A job that writes
/// faster than the agent forwards waits on its own pipe. gpuci's own lines and the job's start
/// and result hold nothing: they are few, and must never be lost or wait behind job output.
#[derive(Debug)]
pub enum JobEvent {
    /// The job's process started; `unenforced`: what the agent did not enforce for it.
    Started {
        job_id: JobId,
        pid: u32,
        at_us: i64,
        unenforced: Vec<Unenforced>,
    },
    Log {
        job_id: JobId,
        chunk: LogChunk,
        held: Option<OwnedSemaphorePermit>,
    },
    Finished(JobFinished),
}

/// Bytes of one job's output on their way from its pipes to the coordinator (queued for the
/// agent loop, or in the batch it is sending). Counted as text plus [`LINE_OVERHEAD`], so a
/// flood of empty lines is bounded as well as a few long ones.
pub const JOB_IN_FLIGHT_BYTES: usize = 1024 * 1024;
/// What one queued line costs beyond its text (the event, the string's allocation).
pub const LINE_OVERHEAD: usize = 64;
/// The longest line forwarded; a longer run without a newline continues as the next line.
const LINE_CUT: usize = 64 * 1024;
/// The most of a cut line held back for the next piece, so no secret straddles the cut
/// (see `Masker::cut`).
const MAX_CARRY: usize = 16 * 1024;

/// Default of the agent's per-job log cap (`--max-log-bytes`).
pub const DEFAULT_MAX_LOG_BYTES: u64 = 100 * 1024 * 1024;

/// Which isolation jobs get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsolationPolicy {
    /// Bubblewrap when installed, else none (logged on every job).
    Auto,
    /// Bubblewrap, or the job fails to start.
    Bubblewrap,
    /// No isolation for any job (explicit opt-out).
    None,
}

/// The network of `network: default` steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobNetwork {
    /// The slot's own network namespace, egress through pasta (root agents).
    Slot,
    /// The host's network (`--job-network host`: an explicit choice of the operator).
    Host,
    /// No network at all.
    None,
}

/// Per-slot limits for steps that set none (`--job-memory`, `--job-pids`, `--job-cpus`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotDefaults {
    pub memory: Option<gpuci_core::quantity::Bytes>,
    pub pids: Option<u32>,
    pub cpu_millis: Option<u32>,
}

/// Shared by all job tasks of an agent; read-only.
pub struct JobContext {
    /// Makes sandbox names (cgroups, markers) unique per agent: two agents on one host, or
    /// agents of two coordinators, both have a job 1.
    pub sandbox_prefix: String,
    pub work_root: PathBuf,
    /// Hidden from every job: the agent's data dir (credential) and the workspaces root.
    pub hide_paths: Vec<PathBuf>,
    pub gpus: Arc<dyn GpuBackend>,
    /// The latest inventory; the agent loop replaces it when it changes.
    pub inventory: std::sync::RwLock<Vec<gpuci_core::gpu::GpuInfo>>,
    pub isolation: IsolationPolicy,
    /// Whether jobs may run outside the sandbox at all (`--allow-unsandboxed`): steps with
    /// `sandbox: none`, and every job when bubblewrap cannot work here. Never for an
    /// untrusted origin (`Assignment::trusted`).
    pub allow_unsandboxed: bool,
    /// Whether trusted jobs may reach cloud metadata services (`--allow-metadata-trusted`).
    pub allow_metadata_trusted: bool,
    /// Why this agent cannot enforce memory, CPU and process limits (no job cgroups for an
    /// agent that is not root); `None`: it does. Said in every job's log.
    pub limits_problem: Option<String>,
    /// `--allow-unenforced-limits`.
    pub allow_unenforced_limits: bool,
    /// Why jobs get no disk of their slot's own (`--job-disk none`, an agent that is not
    /// root); `None`: each slot has one. Said in every job's log (`crate::unenforced`).
    pub disk_quota_problem: Option<String>,
    pub bubblewrap: bool,
    /// A root agent's job slots (uid and network each); `None`: the agent is not root and
    /// jobs run as its own uid inside a user namespace.
    pub slots: Option<Arc<crate::slots::Slots>>,
    /// What `network: default` steps get.
    pub default_network: JobNetwork,
    /// Limits for steps that give none, and the size of each scratch tmpfs.
    pub defaults: SlotDefaults,
    /// Where jobs have no cgroup and the container's own process limit binds the agent and its
    /// job together: the most processes a job may have (`RLIMIT_NPROC`), leaving the agent room
    /// to run. A job that asks for more gets this.
    pub pids_cap: Option<u32>,
    /// A container engine that answered `info`; only then does the agent advertise it.
    pub container_runtime: Option<gpuci_sandbox::ContainerRuntime>,
    pub health: HealthPolicy,
    /// Per GPU: its idle memory and error counters when the agent started (or when an
    /// operator last released it). "No new Xid since the last check" compares with this, and
    /// memory must return to this idle level after a job.
    pub baselines: std::sync::Mutex<std::collections::HashMap<String, HealthBaseline>>,
    pub telemetry_period: Duration,
    /// Where workspace uploads come from (and are cached); `None`: a job with an upload fails.
    pub uploads: Option<crate::workspace::UploadSource>,
    /// The steps' `cache:` trees, by scope (`<data-dir>/cache/`).
    pub caches: Arc<crate::cache::CacheStore>,
    /// Per-job cap on stored output (bytes of text, a newline counted as one); past it the
    /// output is read and discarded.
    pub max_log_bytes: u64,
    /// Running jobs' GPU samples on their way to the coordinator.
    pub live: crate::series::LiveBuffer,
    /// Which repositories' jobs are on the host: one outside the sandbox shares it with no
    /// other repository (`tenancy.rs`).
    pub tenancy: Arc<crate::tenancy::Tenancy>,
}

impl JobContext {}

/// Where a job's lines go: gpuci's own lines at once, the job's output through its log cap
/// and its in-flight budget.
#[derive(Clone)]
struct Emitter {
    job_id: JobId,
    tx: mpsc::UnboundedSender<JobEvent>,
    /// The job's secrets and the values it registered (`::add-mask::`).
    mask: Arc<JobMask>,
    /// The job's in-flight budget ([`JOB_IN_FLIGHT_BYTES`]).
    budget: Arc<Semaphore>,
    cap: Arc<std::sync::Mutex<LogCap>>,
}

/// How much of the job's output was kept, against its cap.
#[derive(Debug, Default)]
struct LogCap {
    limit: u64,
    bytes: u64,
    lines: u64,
    cut: bool,
}

impl Emitter {
    fn new(job_id: JobId, tx: mpsc::UnboundedSender<JobEvent>, mask: Arc<JobMask>, max_log_bytes: u64) -> Emitter {
        Emitter {
            job_id,
            tx,
            mask,
            budget: Arc::new(Semaphore::new(JOB_IN_FLIGHT_BYTES)),
            cap: Arc::new(std::sync::Mutex::new(LogCap { limit: max_log_bytes, ..Default::default() })),
        }
    }

    fn system(&self, text: impl Into<String>) {
        let text = self.mask.get().mask(&text.into());
        let chunk = LogChunk { ts_us: now_us(), stream: Stream::System, text };
        let _ = self.tx.send(JobEvent::Log { job_id: self.job_id, chunk, held: None });
    }

    fn is_cut(&self) -> bool {
        self.cap.lock().unwrap_or_else(|e| e.into_inner()).cut
    }

    /// One line of the job's output, already masked. Waits while the job's in-flight budget is
    /// spent (backpressure on the job's pipe). False: stop forwarding (cut, or agent gone).
    async fn output(&self, stream: Stream, text: String) -> bool {
        let size = gpuci_protocol::agent::log_line_cost(&text);
        let notice = {
            let mut cap = self.cap.lock().unwrap_or_else(|e| e.into_inner());
            if cap.cut {
                return false;
            }
            if cap.bytes + size > cap.limit {
                cap.cut = true;
                Some(format!(
                    "log cut: the job's output reached this agent's limit of {} bytes per job (--max-log-bytes; \
                     a line counts its text and {} bytes for storing it) after {} bytes in {} lines; the rest of \
                     its output is read and discarded while the job runs",
                    cap.limit,
                    gpuci_protocol::agent::LOG_LINE_COST,
                    cap.bytes,
                    cap.lines
                ))
            } else {
                cap.bytes += size;
                cap.lines += 1;
                None
            }
        };
        if let Some(notice) = notice {
            self.system(notice);
            return false;
        }
        let weight = (text.len() + LINE_OVERHEAD).min(JOB_IN_FLIGHT_BYTES) as u32;
        let Ok(held) = self.budget.clone().acquire_many_owned(weight).await else { return false };
        let chunk = LogChunk { ts_us: now_us(), stream, text };
        self.tx.send(JobEvent::Log { job_id: self.job_id, chunk, held: Some(held) }).is_ok()
    }
}

/// Run one job to its end. Never panics; every failure becomes an [`Outcome`].
pub async fn run_job(
    a: Assignment,
    ctx: Arc<JobContext>,
    tx: mpsc::UnboundedSender<JobEvent>,
    cancel: CancellationToken,
) {
    let job_id = a.job_id;
    let mask = Arc::new(JobMask::new(Masker::new(a.secrets.0.values().map(String::as_str))));
    let out = Emitter::new(job_id, tx.clone(), mask, ctx.max_log_bytes);
    let mut gpu_health: BTreeMap<String, GpuHealth> = BTreeMap::new();
    let (outcome, telemetry) = execute(&a, &ctx, &out, &cancel, &mut gpu_health).await;
    // Post-job check of every leased GPU: leftovers killed, memory back to baseline.
    for uuid in &a.gpus {
        if gpu_health.contains_key(uuid) {
            continue;
        }
        let h = post_check(&ctx, uuid, &out).await;
        gpu_health.insert(uuid.clone(), h);
    }
    // The start time is filled in by the agent loop, which saw the start.
    let _ = tx.send(JobEvent::Finished(JobFinished {
        job_id,
        outcome,
        finished_at_us: now_us(),
        started_at_us: None,
        lines: None,
        telemetry,
        gpu_health,
    }));
}

/// The GPU's baseline, captured now if the agent has none yet.
pub fn baseline(ctx: &JobContext, uuid: &str) -> HealthBaseline {
    let mut map = ctx.baselines.lock().unwrap_or_else(|e| e.into_inner());
    map.entry(uuid.to_string())
        .or_insert_with(|| {
            HealthBaseline::capture(ctx.gpus.as_ref(), uuid)
                .unwrap_or_else(|_| HealthBaseline::from_counters(&Default::default()))
        })
        .clone()
}

async fn post_check(ctx: &JobContext, uuid: &str, out: &Emitter) -> GpuHealth {
    let backend = ctx.gpus.as_ref();
    if let Ok(procs) = gpuci_gpu::leftover_processes(backend, uuid) {
        let me = std::process::id();
        for p in procs {
            // pid 0/1, our own, or one that does not fit a pid_t would signal far more than
            // a leftover process (a process group, init, the agent): never.
            let Ok(pid) = i32::try_from(p.pid) else { continue };
            if pid <= 1 || p.pid == me {
                continue;
            }
            out.system(format!("killing process {pid} left on GPU {uuid}"));
            // A pid that already exited fails harmlessly.
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
    let base = baseline(ctx, uuid);
    let r = gpuci_gpu::post_job_check(backend, uuid, &base, &ctx.health, &CancellationToken::new()).await;
    match r.reason() {
        None => GpuHealth::Healthy,
        Some(reason) => {
            out.system(format!("GPU {uuid} failed its post-job check: {reason}"));
            GpuHealth::Unhealthy { reason: format!("post-job check: {reason}") }
        }
    }
}

async fn execute(
    a: &Assignment,
    ctx: &JobContext,
    out: &Emitter,
    cancel: &CancellationToken,
    gpu_health: &mut BTreeMap<String, GpuHealth>,
) -> (Outcome, Option<JobTelemetry>) {
    let fail = |error: String| (Outcome::StartFailed { error }, None);
    // Each step of the start at debug level (`GPUCI_LOG=debug`): it is on the path a user waits on.
    let t0 = std::time::Instant::now();
    let step = |what: &str| tracing::debug!(job = a.job_id, ms = t0.elapsed().as_secs_f64() * 1000.0, "start: {what}");
    // Pre-job check: each leased GPU must answer and be idle and clean.
    for uuid in &a.gpus {
        let base = baseline(ctx, uuid);
        let r = gpuci_gpu::pre_job_check(ctx.gpus.as_ref(), uuid, &base, &ctx.health);
        if let Some(reason) = r.reason() {
            out.system(format!("GPU {uuid} failed its pre-job check: {reason}"));
            gpu_health.insert(uuid.clone(), GpuHealth::Unhealthy { reason: format!("pre-job check: {reason}") });
            return fail(format!("GPU {uuid} failed its pre-job check: {reason}"));
        }
    }
    // The slot's uid and network, held until the workspace is gone.
    let slot = match &ctx.slots {
        Some(slots) => match slots.take() {
            Some(s) => Some(s),
            None => return fail("every job slot of this agent is busy".into()),
        },
        None => None,
    };
    // Taken first, whatever the step turns out to be: it must not wait beside this job.
    let mut warm = TakenWarm(match &slot {
        Some(s) => s.take_warm().await,
        None => None,
    });
    // The ready sandbox's workspace, made empty for this job and bound into that sandbox (the
    // job starts there when its sandbox turns out to be exactly that one); else a new one, on
    // the slot's own disk where it has one (its size is the job's disk quota).
    let workspace = match warm.0.as_mut().and_then(|w| w.take_workspace()) {
        Some(ws) => ws,
        None => {
            let ws = workspace_root(ctx, slot.as_ref()).join(format!("job-{}", a.job_id));
            let _ = remove_workspace(&ws).await;
            if let Err(e) = std::fs::DirBuilder::new().mode(0o700).create(&ws) {
                return fail(format!("creating workspace {}: {e}", ws.display()));
            }
            ws
        }
    };
    step("workspace made");
    if let Some(id) = &a.workspace_upload {
        if let Err(error) = fill_workspace(id, ctx, out, &workspace).await {
            out.system(format!("workspace: {error}"));
            let _ = remove_workspace(&workspace).await;
            return fail(format!("workspace: {error}"));
        }
    }
    step("workspace filled");
    restore_cache(a, ctx, &workspace, out).await;
    step("caches restored");
    if !a.step.artifacts_from.is_empty() {
        let log = |l: String| out.system(l);
        if let Err(error) = crate::artifacts_http::fetch_inputs(a.job_id, ctx.uploads.as_ref(), &workspace, &log).await
        {
            out.system(format!("artifacts: {error}"));
            let _ = remove_workspace(&workspace).await;
            return fail(format!("artifacts: {error}"));
        }
        step("artifacts placed");
    }
    if let Some(slot) = &slot {
        // Everything in the workspace is the job's: the upload, the restored caches.
        let (ws, user) = (workspace.clone(), slot.user());
        let given = tokio::task::spawn_blocking(move || crate::fstree::give_to(&ws, user)).await;
        if let Err(e) = given.map_err(|e| std::io::Error::other(e.to_string())).and_then(|r| r) {
            let _ = remove_workspace(&workspace).await;
            return fail(format!("giving workspace {} to the job user: {e}", workspace.display()));
        }
    }
    step("workspace given to the job user");
    let mut result = execute_in(a, ctx, out, cancel, &workspace, slot.as_ref(), warm).await;
    if let Some(disk) = slot.as_ref().and_then(|s| s.disk()) {
        let code = match &result.0 {
            Outcome::Exited { code } if *code != 0 => Some(*code),
            Outcome::Signalled { signal } => Some(-signal),
            _ => None,
        };
        if let (Some(code), true) = (code, disk.is_full()) {
            let limit = gpuci_core::quantity::Bytes(disk.size());
            out.system(format!("disk quota exceeded: the workspace reached its limit of {limit} (--job-disk)"));
            result.0 = Outcome::DiskQuotaExceeded { limit, code };
        }
    }
    // The step's files, before anything else touches the workspace.
    let succeeded = matches!(result.0, Outcome::Exited { code: 0 });
    let log = |l: String| out.system(l);
    // The coordinator has the final word on every cap; these keep the agent from sending
    // what no default coordinator would take.
    let (uploads, max_file) = (ctx.uploads.as_ref(), gpuci_core::artifacts::Limits::default().max_file);
    let spec = &a.step.artifacts;
    let mut lost =
        crate::artifacts_http::upload(a.job_id, "artifacts", spec, max_file, uploads, &workspace, succeeded, &log)
            .await;
    // Test reports whatever the outcome: a failing step's report is the one people read.
    let reports = gpuci_core::artifacts::ArtifactSpec { paths: a.step.test_reports.clone(), when: Default::default() };
    let max_report = gpuci_core::test_report::MAX_REPORT_BYTES;
    lost.extend(
        crate::artifacts_http::upload(a.job_id, "test reports", &reports, max_report, uploads, &workspace, true, &log)
            .await,
    );
    // Green means the artifacts are there: one the coordinator could not store fails the step.
    result.0 = crate::transfer_retry::outcome_after_uploads(result.0, &lost);
    save_cache(a, ctx, &workspace, out).await;
    if let Err(e) = remove_workspace(&workspace).await {
        tracing::warn!(job = a.job_id, error = %e, "could not remove workspace");
    }
    // The slot's job is gone: its next job's first process can wait for it already.
    if let Some((slot, spec)) = slot.as_ref().and_then(|s| Some((s, warm_spec(ctx, s)?))) {
        slot.prepare_warm(spec);
    }
    result
}

/// What a warm start for `slot` looks like (see `gpuci_sandbox::WarmStart`); `None` where jobs
/// are not started in bubblewrap, so none would fit.
pub(crate) fn warm_spec(ctx: &JobContext, slot: &crate::slots::SlotGuard) -> Option<gpuci_sandbox::WarmSpec> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    if !ctx.bubblewrap || ctx.isolation == crate::IsolationPolicy::None {
        return None;
    }
    // Under the agent's prefix, so the start-up sweep finds what a killed agent left.
    let name = |n: u64| format!("{}-warm-{}-{n}", ctx.sandbox_prefix, slot.index());
    let n = N.fetch_add(2, Ordering::Relaxed);
    // The sandbox of the slot's usual job (no GPU, the default limits and network), started
    // ahead of it; the job's own argv and environment come at hand-over.
    let workspace = workspace_root(ctx, Some(slot)).join(format!("ws-{}", n / 2));
    let default = (gpuci_core::pipeline::NetworkMode::default(), &gpuci_sandbox::Resources::default());
    let ready = job_sandbox(ctx, Some(slot), "ready".into(), &workspace, Vec::new(), default, None);
    Some(gpuci_sandbox::WarmSpec {
        name: name(n),
        user: slot.user(),
        network: match ctx.default_network {
            JobNetwork::Slot => Some(slot.network()?.namespace()),
            JobNetwork::Host | JobNetwork::None => None,
        },
        cgroups: gpuci_sandbox::CgroupUse::Auto,
        // Where there is no cgroup: the usual job's process limit, set as it waits.
        nproc: ready.resources.pids.map(u64::from),
        ready: Some(gpuci_sandbox::ReadySpec { name: name(n + 1), sandbox: ready }),
    })
}

/// Where the slot's workspaces go: its own disk where it has one (its size is the job's disk
/// quota), else the agent's work root.
fn workspace_root<'a>(ctx: &'a JobContext, slot: Option<&'a crate::slots::SlotGuard>) -> &'a Path {
    slot.and_then(|s| s.disk()).map_or(ctx.work_root.as_path(), |d| d.path())
}

/// The sandbox of a step with `network` and `resources` (its own, before defaults) in `workspace`, as far as the agent's
/// settings and the slot decide it: user, network, limits (the agent's defaults where the step
/// gives none), scratch sizes, hidden paths. `out` hears what the job should know.
fn job_sandbox(
    ctx: &JobContext,
    slot: Option<&crate::slots::SlotGuard>,
    id: String,
    workspace: &Path,
    argv: Vec<String>,
    (network, resources): (gpuci_core::pipeline::NetworkMode, &gpuci_sandbox::Resources),
    out: Option<&Emitter>,
) -> SandboxSpec {
    let mut spec = SandboxSpec::new(id, workspace, argv);
    spec.user = slot.map(|s| s.user());
    spec.network = match (network, ctx.default_network, slot.and_then(|s| s.network())) {
        (gpuci_core::pipeline::NetworkMode::None, _, _) | (_, JobNetwork::None, _) => gpuci_sandbox::Network::None,
        (_, JobNetwork::Host, _) => gpuci_sandbox::Network::Host,
        (_, JobNetwork::Slot, Some(net)) => gpuci_sandbox::Network::Namespace(net.namespace()),
        (_, JobNetwork::Slot, None) => {
            // Not root, or the slot networks could not be made: no silent host network.
            if let Some(out) = out {
                out.system("network: this agent has no network namespace with egress for jobs (see gpuci doctor); the job has no network");
            }
            gpuci_sandbox::Network::None
        }
    };
    spec.resources = resources.clone();
    let r = &mut spec.resources;
    r.memory = r.memory.or(ctx.defaults.memory);
    r.pids = r.pids.or(ctx.defaults.pids).map(|p| ctx.pids_cap.map_or(p, |cap| p.min(cap)));
    r.cpu_millis = r.cpu_millis.or(ctx.defaults.cpu_millis);
    // Scratch tmpfs pages count against the memory limit; no single one may be larger.
    spec.scratch_size = spec.resources.memory.map(|m| m.0);
    spec.hide_paths = ctx.hide_paths.clone();
    spec
}

/// A warm start taken from its slot, discarded unless the job's sandbox used it.
struct TakenWarm(Option<gpuci_sandbox::WarmStart>);

impl Drop for TakenWarm {
    fn drop(&mut self) {
        if let Some(w) = self.0.take() {
            tokio::spawn(w.discard());
        }
    }
}

/// Removes a workspace off the async threads: a job decides how many files it leaves, and
/// two jobs' million-file workspaces removed on the runtime's workers stalled the agent's
/// heartbeat for most of a minute (outsider attack), so the coordinator declared it lost.
async fn remove_workspace(workspace: &Path) -> std::io::Result<()> {
    let ws = workspace.to_path_buf();
    tokio::task::spawn_blocking(move || crate::fstree::remove_tree(&ws))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
}

/// Bring the step's cached paths into the new workspace from the caches its scope may read
/// (`crate::cache` carries out what the coordinator decided). Off the async threads: a
/// restore from another scope copies the tree.
async fn restore_cache(a: &Assignment, ctx: &JobContext, workspace: &std::path::Path, out: &Emitter) {
    if a.step.cache.is_empty() || a.cache.is_none() {
        return;
    }
    let (store, scope, paths) = (ctx.caches.clone(), a.cache.clone(), a.step.cache.clone());
    let ws = workspace.to_path_buf();
    let lines = tokio::task::spawn_blocking(move || store.restore(&scope, &paths, &ws))
        .await
        .unwrap_or_else(|e| vec![format!("cache: restore failed: {e}")]);
    for line in lines {
        out.system(line);
    }
}

/// Keep the job's cached paths under its scope's save key (none: the job only reads).
async fn save_cache(a: &Assignment, ctx: &JobContext, workspace: &std::path::Path, out: &Emitter) {
    if a.step.cache.is_empty() || a.cache.is_none() {
        return;
    }
    let (store, scope, paths, trusted) = (ctx.caches.clone(), a.cache.clone(), a.step.cache.clone(), a.trusted);
    let ws = workspace.to_path_buf();
    let lines = tokio::task::spawn_blocking(move || store.save(&scope, trusted, &paths, &ws))
        .await
        .unwrap_or_else(|e| vec![format!("cache: save failed: {e}")]);
    for line in lines {
        out.system(line);
    }
}

/// Unpack upload `id` (downloaded, or from the cache) into the new, empty workspace.
async fn fill_workspace(
    id: &str,
    ctx: &JobContext,
    out: &Emitter,
    workspace: &std::path::Path,
) -> Result<(), crate::workspace::WorkspaceError> {
    let short = id.get(..12).unwrap_or(id);
    let Some(source) = &ctx.uploads else {
        return Err(crate::workspace::WorkspaceError::Download {
            id: id.to_string(),
            reason: "this agent has no coordinator to download uploads from".into(),
        });
    };
    let archive = source.fetch(id).await?;
    tracing::debug!(upload = short, "start: upload fetched");
    let (id2, ws) = (id.to_string(), workspace.to_path_buf());
    let files = tokio::task::spawn_blocking(move || crate::workspace::unpack(&id2, &archive, &ws))
        .await
        .map_err(|e| crate::workspace::WorkspaceError::Unpack { id: id.to_string(), reason: e.to_string() })??;
    out.system(format!("workspace: {files} files from upload {short}"));
    Ok(())
}

/// The job's steps socket, its address put in `env`; `None` (said in the log) when it has
/// no token or the socket cannot be made.
fn steps_socket(
    a: &Assignment,
    ctx: &JobContext,
    workspace: &std::path::Path,
    slot: Option<&crate::slots::SlotGuard>,
    out: &Emitter,
    env: &mut BTreeMap<String, String>,
) -> Option<crate::steps_proxy::StepsProxy> {
    if !a.secrets.0.contains_key("GPUCI_JOB_TOKEN") {
        return None;
    }
    let source = ctx.uploads.as_ref()?;
    let source = crate::workspace::UploadSource {
        http: source.http.clone(),
        server: source.server.clone(),
        agent_id: source.agent_id.clone(),
        credential: String::new(),
        cache_dir: source.cache_dir.clone(),
        retry: source.retry,
    };
    match crate::steps_proxy::StepsProxy::start(a.job_id, workspace, slot.map(|s| s.user()), source) {
        Ok((proxy, url)) => {
            env.insert(crate::steps_proxy::API_URL_ENV.into(), url);
            Some(proxy)
        }
        Err(e) => {
            out.system(format!("gpuci pipeline upload: not available to this job ({e})"));
            None
        }
    }
}

fn job_env(a: &Assignment, workspace: &std::path::Path) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("PATH".into(), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    env.insert("HOME".into(), workspace.display().to_string());
    env.insert("LANG".into(), "C.UTF-8".into());
    env.insert("TMPDIR".into(), "/tmp".into());
    env.extend(a.env.clone());
    env.extend(a.secrets.0.clone());
    env.insert("GPUCI_WORKSPACE".into(), workspace.display().to_string());
    // The job sees exactly its leased GPUs, by UUID. An empty list hides every GPU from CUDA.
    let uuids = a.gpus.join(",");
    env.insert("CUDA_VISIBLE_DEVICES".into(), uuids.clone());
    env.insert("NVIDIA_VISIBLE_DEVICES".into(), if a.gpus.is_empty() { "void".into() } else { uuids.clone() });
    env.insert("GPUCI_GPUS".into(), uuids);
    env
}

async fn execute_in(
    a: &Assignment,
    ctx: &JobContext,
    out: &Emitter,
    cancel: &CancellationToken,
    workspace: &std::path::Path,
    slot: Option<&crate::slots::SlotGuard>,
    mut warm: TakenWarm,
) -> (Outcome, Option<JobTelemetry>) {
    let step = &a.step;
    let (isolation, unsandboxed_note) =
        match decide_isolation(step.sandbox, ctx.isolation, ctx.bubblewrap, ctx.allow_unsandboxed, a.trusted) {
            Ok((isolation, note)) => {
                if let Some(note) = &note {
                    out.system(note.clone());
                }
                (isolation, note)
            }
            Err(error) => return (Outcome::StartFailed { error }, None),
        };
    // Held until the job's last process is gone (the end of this function).
    let tenant = crate::tenancy::Tenant {
        job_id: a.job_id,
        owner: a.repository.clone().unwrap_or_default(),
        unsandboxed: isolation == Isolation::None,
    };
    let waiting = |by: &crate::tenancy::Tenant| {
        out.system(if tenant.unsandboxed {
            format!("waiting for job {} of another repository to end: this job runs outside the sandbox, and shares its host with no other repository", by.job_id)
        } else {
            format!("waiting for job {}, which runs outside the sandbox for another repository, to end", by.job_id)
        });
    };
    let Some(_seat) = ctx.tenancy.enter(tenant.clone(), cancel, waiting).await else {
        return (Outcome::Cancelled { reason: "cancelled".into() }, None);
    };
    let mut metadata_opened = false;
    if ctx.allow_metadata_trusted && a.trusted && step.network != gpuci_core::pipeline::NetworkMode::None {
        if let Some(slot) = slot.filter(|s| s.network().is_some()) {
            match slot.allow_metadata() {
                // Said with what else is not enforced, below.
                Ok(()) => metadata_opened = true,
                Err(e) => out.system(format!("cloud metadata: stays unreachable ({e})")),
            }
        }
    }
    let script = step.command.join("\n");
    let argv = vec!["bash".into(), "-eo".into(), "pipefail".into(), "-c".into(), script];
    let id = format!("{}-job-{}", ctx.sandbox_prefix, a.job_id);
    // Outside the sandbox a job without the slot's network is on the host's: not "no
    // network", as `job_sandbox` would say (the list below says what it is).
    let said = (isolation == Isolation::Bubblewrap || step.image.is_some()).then_some(out);
    let mut spec = job_sandbox(ctx, slot, id, workspace, argv, (step.network, &step.resources), said);
    let unenforced = crate::unenforced::unenforced(
        &crate::unenforced::AgentFacts {
            limits_problem: ctx.limits_problem.clone(),
            allow_unenforced_limits: ctx.allow_unenforced_limits,
            disk_quota_problem: ctx.disk_quota_problem.clone(),
        },
        step,
        &crate::unenforced::JobFacts {
            unsandboxed: unsandboxed_note.as_deref(),
            network: match spec.network {
                gpuci_sandbox::Network::None => crate::unenforced::JobNet::None,
                gpuci_sandbox::Network::Namespace(_) => crate::unenforced::JobNet::Own,
                gpuci_sandbox::Network::Host => crate::unenforced::JobNet::Host,
            },
            slot_disk: slot.and_then(|s| s.disk()).is_some(),
            metadata_opened,
        },
    );
    // Every item in the job's log, as `gpuci jobs show` lists it; the sandbox's was said with
    // the decision, before the job waited for its host.
    for u in unenforced.iter().filter(|u| u.key != gpuci_protocol::agent::Protection::Sandbox) {
        out.system(format!("{}: {}", u.key, u.detail));
    }
    spec.env = job_env(a, workspace);
    spec.isolation = isolation;
    // `gpuci pipeline upload` from inside the job: a socket of its own, served while its
    // process runs (`steps_proxy`). Only for a job the coordinator gave a token.
    let _steps = steps_socket(a, ctx, workspace, slot, out, &mut spec.env);
    if let Some(dir) = &a.runner_dir {
        // The runner writes beside its files; give it a writable view of the install, not the install.
        let runner = if isolation == Isolation::Bubblewrap {
            let dest = workspace.join("runner");
            let made = std::fs::create_dir_all(&dest)
                .and_then(|()| slot.map_or(Ok(()), |s| crate::fstree::give_to(&dest, s.user())));
            if let Err(e) = made {
                return (Outcome::StartFailed { error: format!("creating {}: {e}", dest.display()) }, None);
            }
            spec.tool_views.push(gpuci_sandbox::ToolView { source: dir.into(), dest: dest.clone() });
            dest
        } else {
            PathBuf::from(dir)
        };
        spec.env.insert("GPUCI_RUNNER_DIR".into(), runner.display().to_string());
    }
    {
        let inventory = ctx.inventory.read().unwrap_or_else(|e| e.into_inner());
        for uuid in &a.gpus {
            if let Some(g) = inventory.iter().find(|g| &g.uuid == uuid) {
                let node = PathBuf::from(&g.device_node);
                if node.exists() {
                    spec.gpu_devices.push(node);
                }
            }
        }
    }
    if !spec.gpu_devices.is_empty() {
        for common in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"] {
            if std::path::Path::new(common).exists() {
                spec.gpu_common_devices.push(common.into());
            }
        }
    }
    // `image:` steps run in the container engine, which then owns namespaces and limits;
    // the engine's client runs in a plain sandbox so its process tree is still ours to kill.
    let mut container: Option<(gpuci_sandbox::ContainerRuntime, String, PathBuf, PathBuf)> = None;
    if let Some(image) = &step.image {
        let Some(rt) = ctx.container_runtime.clone() else {
            return (
                Outcome::StartFailed {
                    error: "the step names an image but this agent has no container runtime".into(),
                },
                None,
            );
        };
        // Images without bash (busybox, alpine) run the script with `sh -e` instead.
        spec.argv = gpuci_sandbox::container::shell_argv(&step.command.join("\n"));
        let env_file = ctx.work_root.join(format!(".env-{}", spec.job_id));
        let written = gpuci_sandbox::container::env_file_contents(&spec).map_err(|e| e.to_string()).and_then(|text| {
            write_private(&env_file, &text).map_err(|e| format!("writing {}: {e}", env_file.display()))
        });
        if let Err(error) = written {
            return (Outcome::StartFailed { error }, None);
        }
        // The job's seccomp filter, as the engine takes it (read at create; removed with the env file).
        let profile = ctx.work_root.join(format!(".seccomp-{}.json", spec.job_id));
        let written = gpuci_sandbox::seccomp::oci_profile()
            .map_err(|e| e.to_string())
            .and_then(|text| write_private(&profile, &text).map_err(|e| format!("writing {}: {e}", profile.display())));
        if let Err(error) = written {
            let _ = std::fs::remove_file(&env_file);
            return (Outcome::StartFailed { error }, None);
        }
        let argv = match gpuci_sandbox::container::run_argv(&rt, image, &spec, &env_file, &profile, a.trusted) {
            Ok(a) => a,
            Err(e) => {
                let _ = std::fs::remove_file(&env_file);
                let _ = std::fs::remove_file(&profile);
                return (Outcome::StartFailed { error: e.to_string() }, None);
            }
        };
        out.system(format!("running in container image {image} ({:?})", rt.engine));
        let name = gpuci_sandbox::container::container_name(&spec.job_id);
        spec.argv = argv;
        spec.isolation = Isolation::None;
        // The engine's client runs as the agent (root), outside any sandbox: nothing of the
        // job's may steer it. Its working directory and files are the agent's own, never the
        // workspace: with HOME and the working directory there, podman ran a "credential
        // helper" the job had put in its workspace, as root (outsider attack), and read the
        // job's `registries.conf`. A job from an untrusted origin pulls with no registry login
        // at all (an empty auth file), never the host's.
        let engine_dir = match engine_dir(ctx, a.trusted) {
            Ok(d) => d,
            Err(error) => {
                let _ = std::fs::remove_file(&env_file);
                let _ = std::fs::remove_file(&profile);
                return (Outcome::StartFailed { error }, None);
            }
        };
        let home = std::env::var_os("HOME").map_or_else(|| engine_dir.clone(), PathBuf::from);
        spec.env = BTreeMap::from([
            ("PATH".to_string(), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string()),
            ("HOME".to_string(), home.display().to_string()),
        ]);
        if !a.trusted {
            spec.env.insert("REGISTRY_AUTH_FILE".into(), engine_dir.join("no-auth.json").display().to_string());
            spec.env.insert("DOCKER_CONFIG".into(), engine_dir.join("no-docker-config").display().to_string());
        }
        spec.workspace = engine_dir;
        spec.gpu_devices.clear();
        spec.gpu_common_devices.clear();
        // The client reads what the image brings (its whole `/etc/passwd` for `--user`) into
        // its own memory, as root: bounded by the job's limit and some room of its own, never
        // the host's (outsider attack: 2.3 × a crafted file's size). The container itself is
        // limited by the engine (`--memory`), in a cgroup of its own.
        let client_memory = spec.resources.memory.map(|m| gpuci_core::quantity::Bytes(m.0.saturating_add(512 << 20)));
        spec.resources = gpuci_sandbox::Resources { memory: client_memory, ..Default::default() };
        // The engine's client is gpuci's own process (rootful podman needs root); the job's
        // process in the container runs as the job user (`--user`, from the spec above).
        spec.user = None;
        spec.network = gpuci_sandbox::Network::Host;
        spec.scratch_size = None;
        container = Some((rt, name, env_file, profile));
    }
    let (mut sandbox, stdout, stderr) = match Sandbox::spawn_warm(&spec, warm.0.take()) {
        Ok(s) => s,
        Err(e) => {
            if let Some((_, _, env_file, profile)) = &container {
                let _ = std::fs::remove_file(env_file);
                let _ = std::fs::remove_file(profile);
            }
            return (Outcome::StartFailed { error: e.to_string() }, None);
        }
    };
    let _ = out.tx.send(JobEvent::Started { job_id: a.job_id, pid: sandbox.pid(), at_us: now_us(), unenforced });

    let readers = tokio::spawn(pump(out.clone(), stdout, stderr));
    let telemetry_cancel = CancellationToken::new();
    let series = Arc::new(std::sync::Mutex::new(crate::series::Series::default()));
    let telemetry = (!a.gpus.is_empty()).then(|| {
        let (series, live, job_id) = (series.clone(), ctx.live.clone(), a.job_id);
        tokio::spawn(gpuci_gpu::sample_loop(
            ctx.gpus.clone(),
            a.gpus.clone(),
            ctx.telemetry_period,
            telemetry_cancel.clone(),
            move |at, uuid, s| {
                series.lock().unwrap_or_else(|e| e.into_inner()).record(at, s);
                live.push(crate::series::live(job_id, at, uuid, s));
            },
        ))
    });

    let timeout = step.timeout.map(|d| d.as_std());
    let sleep = async {
        match timeout {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    enum End {
        Exited(Result<gpuci_sandbox::ExitInfo, gpuci_sandbox::SandboxError>),
        TimedOut,
        Cancelled,
    }
    let end = tokio::select! {
        r = sandbox.wait() => End::Exited(r),
        _ = sleep => End::TimedOut,
        _ = cancel.cancelled() => End::Cancelled,
    };
    let outcome = match end {
        End::Exited(Ok(info)) if info.oom_killed => Outcome::OutOfMemory { limit: info.memory_limit },
        End::Exited(Ok(info)) => match (info.code, info.signal) {
            (Some(code), _) => Outcome::Exited { code },
            (None, Some(signal)) => Outcome::Signalled { signal },
            (None, None) => Outcome::Exited { code: -1 },
        },
        End::Exited(Err(e)) => Outcome::StartFailed { error: e.to_string() },
        End::TimedOut => {
            let ms = timeout.map_or(0, |d| d.as_millis() as u64);
            out.system(format!(
                "timeout of {} reached: killing the job's process tree",
                gpuci_core::Duration::from_millis(ms)
            ));
            let _ = sandbox.kill_tree();
            let _ = sandbox.wait().await;
            Outcome::TimedOut { after_ms: ms }
        }
        End::Cancelled => {
            out.system("cancelled: killing the job's process tree");
            let _ = sandbox.kill_tree();
            let _ = sandbox.wait().await;
            Outcome::Cancelled { reason: "cancelled".into() }
        }
    };
    if let Some((rt, name, env_file, profile)) = &container {
        // Killing the engine's client does not stop the container; remove it by name.
        let _ = tokio::process::Command::new(&rt.path).args(["rm", "-f", "-v", name.as_str()]).output().await;
        let _ = std::fs::remove_file(env_file);
        let _ = std::fs::remove_file(profile);
    }
    // Whatever the job left behind (daemons, setsid'd children) dies here.
    if let Err(e) = sandbox.cleanup().await {
        out.system(format!("cleanup: {e}"));
    }
    // Output may still be buffered in the pipes after the tree is gone; collect it.
    let _ = tokio::time::timeout(Duration::from_secs(5), readers).await;
    telemetry_cancel.cancel();
    let telemetry = match telemetry {
        Some(t) => t.await.ok().map(|s| JobTelemetry {
            peak_memory_bytes: s.peak_memory.0,
            mean_utilization_pct: s.mean_utilization_pct.unwrap_or(0.0),
            gpu_seconds: s.gpu_seconds,
            samples: s.samples,
            series: std::mem::take(&mut *series.lock().unwrap_or_else(|e| e.into_inner())).finish(),
        }),
        None => None,
    };
    (outcome, telemetry)
}

fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    f.write_all(text.as_bytes())
}

async fn pump(
    out: Emitter,
    stdout: impl AsyncRead + Unpin + Send + 'static,
    stderr: impl AsyncRead + Unpin + Send + 'static,
) {
    let a = tokio::spawn(lines(out.clone(), Stream::Stdout, stdout));
    let b = tokio::spawn(lines(out, Stream::Stderr, stderr));
    let _ = a.await;
    let _ = b.await;
}

/// Forward output line by line, secrets masked, never faster than the agent sends it on. A
/// line is complete before it is masked, so a secret written in several pieces is still caught.
/// Lines are cut at [`LINE_CUT`] so one runaway line cannot blow up memory; the cut keeps back
/// a tail for the next piece so a secret across it is still masked. Invalid UTF-8 is replaced,
/// not dropped. Past the log cap the pipe is still drained, so the job never blocks on it.
/// An `::add-mask::` line on standard output registers its value (see `crate::logmask`)
/// before the line is masked, so it shows as `::add-mask::***`; a refused one is not shown at
/// all, only why (never the value), and neither is one longer than the cut.
async fn lines(out: Emitter, stream: Stream, r: impl AsyncRead + Unpin) {
    let mut reader = BufReader::new(r);
    let mut line: Vec<u8> = Vec::new();
    // Inside an `::add-mask::` line too long to take: its rest is read and never shown.
    let mut skipping = false;
    loop {
        if out.is_cut() {
            return discard(reader).await;
        }
        let room = LINE_CUT.saturating_sub(line.len()).max(1) as u64;
        let text = match (&mut reader).take(room).read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) if line.is_empty() => return,
            Ok(_) | Err(_) if skipping => {
                skipping = line.last() != Some(&b'\n');
                line.clear();
                continue;
            }
            Ok(0) | Err(_) => {
                if let Some(text) = complete_line(&out, stream, &line) {
                    out.output(stream, text).await;
                }
                return;
            }
            Ok(_) if line.last() == Some(&b'\n') => {
                while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    line.pop();
                }
                let text = complete_line(&out, stream, &line);
                line.clear();
                match text {
                    Some(text) => text,
                    None => continue,
                }
            }
            Ok(_) if line.len() >= LINE_CUT => {
                let whole = complete_utf8(&line);
                let piece = String::from_utf8_lossy(&line[..whole]);
                if stream == Stream::Stdout && gpuci_core::mask::add_mask_command(&piece).is_some() {
                    out.system(gpuci_core::mask::RegisterError::TooLong { len: line.len() }.to_string());
                    skipping = true;
                    line.clear();
                    continue;
                }
                let (now, carry) = out.mask.get().cut(&piece, MAX_CARRY);
                line.drain(..whole);
                line.splice(0..0, carry.into_bytes());
                if now.is_empty() {
                    continue;
                }
                now
            }
            // End of input without a newline; the next read says so.
            Ok(_) => continue,
        };
        if !out.output(stream, text).await {
            if out.is_cut() {
                return discard(reader).await;
            }
            return;
        }
    }
}

/// A whole line of output (newline removed), masked; an `::add-mask::` line on standard
/// output registers its value first. `None`: nothing of the line is shown (a refused
/// registration: its log says why instead).
fn complete_line(out: &Emitter, stream: Stream, line: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(line);
    if stream == Stream::Stdout {
        if let Some(Err(refused)) = out.mask.command(&text) {
            out.system(refused.to_string());
            return None;
        }
    }
    Some(out.mask.get().mask(&text))
}

/// Read to the end and throw it away: past the cap the job must not block on a full pipe.
async fn discard(mut r: impl AsyncRead + Unpin) {
    let mut buf = vec![0u8; 64 * 1024];
    while matches!(r.read(&mut buf).await, Ok(n) if n > 0) {}
}

/// How much of `bytes` is whole UTF-8 characters: a character split by a cut waits for the
/// next piece instead of becoming two replacement characters.
fn complete_utf8(bytes: &[u8]) -> usize {
    let n = bytes.len();
    for back in 1..=3.min(n) {
        let b = bytes[n - back];
        if b & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back for its lead byte
        }
        let width = match b {
            0xF0..=0xF7 => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
        return if width > back { n - back } else { n };
    }
    n
}

#[cfg(test)]
mod output_tests {
    //! The job's pipes to the agent loop: bounded, capped, masked across cuts.
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn emitter(secrets: &[&str], max_log_bytes: u64) -> (Emitter, mpsc::UnboundedReceiver<JobEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Emitter::new(1, tx, Arc::new(JobMask::new(Masker::new(secrets.iter().copied()))), max_log_bytes), rx)
    }

    /// Everything queued now: (stream, text) per line.
    fn queued(rx: &mut mpsc::UnboundedReceiver<JobEvent>) -> Vec<(Stream, String)> {
        let mut out = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            if let JobEvent::Log { chunk, .. } = ev {
                out.push((chunk.stream, chunk.text));
            }
        }
        out
    }

    /// A job that writes `total` bytes into a pipe; returns how far it got.
    fn job_writing(total: usize, line: &'static [u8]) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<usize>) {
        let (pipe, mut job) = tokio::io::duplex(64 * 1024);
        let writer = tokio::spawn(async move {
            let mut written = 0;
            while written < total {
                if job.write_all(line).await.is_err() {
                    break;
                }
                written += line.len();
            }
            written
        });
        (pipe, writer)
    }

    async fn settle() {
        for _ in 0..10_000 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_job_writing_faster_than_the_agent_forwards_waits_on_its_pipe() {
        // No log cap here (4 M lines would pass it): this is about the pipe, not the cap.
        let (out, mut rx) = emitter(&[], u64::MAX);
        let (pipe, writer) = job_writing(4_000_000 * 2, b"x\n");
        let reader = tokio::spawn(lines(out.clone(), Stream::Stdout, pipe));
        // Nobody forwards: the queue fills to the job's budget and the job stops on its pipe.
        settle().await;
        let lines_queued = rx.len();
        assert!(!writer.is_finished(), "the job wrote everything although nothing was forwarded");
        assert!(
            lines_queued * (1 + LINE_OVERHEAD) <= JOB_IN_FLIGHT_BYTES,
            "{lines_queued} lines queued: more than the in-flight budget of {JOB_IN_FLIGHT_BYTES} bytes"
        );
        // Forwarding (and so giving back the budget) lets the job go on to its end.
        let mut received = 0;
        while let Some(ev) = rx.recv().await {
            if let JobEvent::Log { .. } = ev {
                received += 1;
            }
            assert!(rx.len() * (1 + LINE_OVERHEAD) <= JOB_IN_FLIGHT_BYTES);
            if received == 4_000_000 {
                break;
            }
        }
        assert_eq!(writer.await.unwrap(), 8_000_000);
        reader.await.unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn output_past_the_cap_is_drained_and_the_log_ends_with_one_notice() {
        let (out, mut rx) = emitter(&[], 10_000);
        let (pipe, writer) = job_writing(1_000_000, b"0123456789abcdefghi\n");
        let reader = tokio::spawn(lines(out.clone(), Stream::Stdout, pipe));
        let mut log = Vec::new();
        while !reader.is_finished() {
            log.extend(queued(&mut rx));
            tokio::task::yield_now().await;
        }
        log.extend(queued(&mut rx));
        assert_eq!(writer.await.unwrap(), 1_000_000, "the job must be able to write all its output");
        let cost = gpuci_protocol::agent::log_line_cost;
        let job_bytes: u64 = log.iter().filter(|(s, _)| *s == Stream::Stdout).map(|(_, t)| cost(t)).sum();
        assert!(job_bytes <= 10_000, "{job_bytes} bytes kept past the cap");
        // Lines of 19 characters count 59 each: 169 fit.
        assert_eq!(job_bytes, 169 * 59, "lines up to the cap are kept");
        let (stream, notice) = log.last().unwrap();
        assert_eq!(*stream, Stream::System);
        assert!(
            notice.starts_with("log cut:") && notice.contains("10000 bytes") && notice.contains("169 lines"),
            "{notice}"
        );
        assert_eq!(log.iter().filter(|(s, _)| *s == Stream::System).count(), 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_secret_across_the_line_cut_is_masked() {
        for shift in 0..12 {
            let (out, mut rx) = emitter(&["S3CRET-value"], DEFAULT_MAX_LOG_BYTES);
            let (pipe, mut job) = tokio::io::duplex(256 * 1024);
            let reader = tokio::spawn(lines(out, Stream::Stdout, pipe));
            let mut text = "x".repeat(LINE_CUT - shift).into_bytes();
            text.extend_from_slice(b"S3CRET-value and \xc3\xa9\xe2\x82\xac more\n");
            job.write_all(&text).await.unwrap();
            drop(job);
            reader.await.unwrap();
            let log: String = queued(&mut rx).into_iter().map(|(_, t)| t).collect();
            assert!(!log.contains("S3CRET-value"), "secret leaked with the cut {shift} bytes before it");
            assert!(log.contains("*** and é€ more"), "{}", &log[log.len() - 40..]);
            assert!(!log.contains('\u{fffd}'), "a character was split by the cut");
        }
    }

    /// What a real shell job's standard output becomes in its log, with `secrets`.
    async fn shell_log(secrets: &[&str], script: &str) -> Vec<(Stream, String)> {
        let (out, mut rx) = emitter(secrets, DEFAULT_MAX_LOG_BYTES);
        let mut child = tokio::process::Command::new("bash")
            .args(["-c", script])
            .env("SECRET", secrets.first().copied().unwrap_or_default())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        lines(out, Stream::Stdout, child.stdout.take().unwrap()).await;
        assert!(child.wait().await.unwrap().success());
        queued(&mut rx)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_job_printing_the_base64_or_hex_of_a_secret_shows_stars() {
        let log = shell_log(
            &["hf_Sup3rS3cretValue42"],
            r#"echo -n "$SECRET" | base64
               echo "$SECRET" | base64
               printf 'user:%s' "$SECRET" | base64
               printf 'ab%s' "$SECRET" | base64 | tr '+/' '-_' | tr -d '='
               echo -n "$SECRET" | xxd -p -c 64
               printf 'https://x/?t=%s' "$(echo -n "$SECRET" | xxd -p -c 64 | sed 's/../%&/g')""#,
        )
        .await;
        let text: Vec<&str> = log.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(text[..2], ["***", "***"], "{text:?}");
        assert!(text[2].starts_with("dXNlcj") && text[2].ends_with("***"), "{text:?}");
        assert!(text[3].starts_with("YW") && text[3].ends_with("***"), "{text:?}");
        assert_eq!(text[4..], ["***", "https://x/?t=***"], "{text:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_value_registered_with_add_mask_is_masked_from_then_on_and_short_ones_are_refused() {
        let log = shell_log(
            &["hf_Sup3rS3cretValue42"],
            r#"derived=$(echo -n "$SECRET" | rev)
               echo "before: $derived"
               echo "::add-mask::$derived"
               echo "after: $derived"
               echo -n "$derived" | base64
               echo "::add-mask::abc"
               echo "short abc"
               echo "$SECRET-$derived""#,
        )
        .await;
        let derived: String = "hf_Sup3rS3cretValue42".chars().rev().collect();
        assert_eq!(log[0].1, format!("before: {derived}"), "what came before stays as it was");
        let rest: Vec<(Stream, &str)> = log[1..].iter().map(|(s, t)| (*s, t.as_str())).collect();
        assert_eq!(
            rest,
            [
                (Stream::Stdout, "::add-mask::***"),
                (Stream::Stdout, "after: ***"),
                (Stream::Stdout, "***"),
                (
                    Stream::System,
                    "add-mask: a value of 3 characters is too short to be a secret (at least 4); not masked"
                ),
                (Stream::Stdout, "short abc"),
                (Stream::Stdout, "***-***"),
            ]
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_add_mask_line_longer_than_the_cut_is_not_shown() {
        let (out, mut rx) = emitter(&[], DEFAULT_MAX_LOG_BYTES);
        let (pipe, mut job) = tokio::io::duplex(256 * 1024);
        let reader = tokio::spawn(lines(out, Stream::Stdout, pipe));
        let mut text = b"::add-mask::".to_vec();
        text.extend(std::iter::repeat_n(b'v', 3 * LINE_CUT));
        text.extend_from_slice(b"\nnext line\n");
        job.write_all(&text).await.unwrap();
        drop(job);
        reader.await.unwrap();
        let log = queued(&mut rx);
        assert_eq!(log.len(), 2, "{:?}", log.iter().map(|(s, t)| (s, &t[..t.len().min(40)])).collect::<Vec<_>>());
        assert!(log[0].0 == Stream::System && log[0].1.contains("longer than"), "{:?}", log[0]);
        assert_eq!(log[1], (Stream::Stdout, "next line".to_string()));
    }

    #[test]
    fn whole_utf8_characters() {
        assert_eq!(complete_utf8(b"abc"), 3);
        assert_eq!(complete_utf8("é".as_bytes()), 2);
        assert_eq!(complete_utf8(&"€".as_bytes()[..2]), 0);
        assert_eq!(complete_utf8(&b"ab\xf0\x9f\x98"[..]), 2);
        assert_eq!(complete_utf8(b"ab\xff"), 3);
    }
}

#[cfg(test)]
mod isolation_tests {
    use super::*;
    use gpuci_core::pipeline::SandboxMode;

    #[test]
    fn nothing_runs_unsandboxed_without_the_agents_consent_and_a_trusted_origin() {
        // Default steps with a working bubblewrap: always sandboxed.
        assert_eq!(
            decide_isolation(SandboxMode::Default, IsolationPolicy::Auto, true, false, false).unwrap().0,
            Isolation::Bubblewrap
        );
        // No bubblewrap: refused unless allowed, and then only for trusted origins.
        assert!(decide_isolation(SandboxMode::Default, IsolationPolicy::Auto, false, false, true).is_err());
        assert!(decide_isolation(SandboxMode::Default, IsolationPolicy::Auto, false, true, false).is_err());
        let (iso, note) = decide_isolation(SandboxMode::Default, IsolationPolicy::Auto, false, true, true).unwrap();
        assert_eq!(iso, Isolation::None);
        assert!(note.unwrap().contains("WITHOUT the sandbox"));
        // sandbox: none, with bubblewrap present: same rules.
        assert!(decide_isolation(SandboxMode::None, IsolationPolicy::Auto, true, false, true).is_err());
        let e = decide_isolation(SandboxMode::None, IsolationPolicy::Auto, true, true, false).unwrap_err();
        assert!(e.contains("never run outside the sandbox"), "{e}");
        assert_eq!(
            decide_isolation(SandboxMode::None, IsolationPolicy::Auto, true, true, true).unwrap().0,
            Isolation::None
        );
        // --isolation none is the same opt-out, agent-wide.
        assert!(decide_isolation(SandboxMode::Default, IsolationPolicy::None, true, true, false).is_err());
    }
}

#[cfg(test)]
mod tests {
    use crate::cache::plain_path;

    #[test]
    fn cache_paths_through_a_symlink_are_refused() {
        let root = std::env::temp_dir().join(format!("gpuci-plain-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("real/data")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("evil")).unwrap();
        assert_eq!(plain_path(&root, "real/data"), Some(root.join("real/data")));
        assert_eq!(plain_path(&root, "evil/ssl"), None, "a path through a symlink must not be moved");
        assert_eq!(plain_path(&root, "../x"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}

/// The agent's [`gpuci_protocol::agent::RESOURCES_TAG`]: `taken` where it enforces `resources:`
/// or its operator allowed them unenforced, `refused` otherwise.
pub(crate) fn resources_tag(limits_problem: Option<&str>, allow_unenforced: bool) -> &'static str {
    match (limits_problem, allow_unenforced) {
        (None, _) | (Some(_), true) => "taken",
        (Some(_), false) => "refused",
    }
}

/// Which isolation a job gets, and a note for its log; `Err`: it must not start, and why.
/// The rules (issue 9's "no silent fallback"):
/// - outside the sandbox only on an agent started with `--allow-unsandboxed`, and only for a
///   trusted origin (`gpuci_core::trust`): never a fork's or an outsider's pull request, never
///   an Actions runner job;
/// - a step that opts out (`sandbox: none`) and an agent without a working bubblewrap are the
///   two ways to get there, and both are said in the job's log.
pub(crate) fn decide_isolation(
    step: gpuci_core::pipeline::SandboxMode,
    policy: IsolationPolicy,
    bubblewrap: bool,
    allow_unsandboxed: bool,
    trusted: bool,
) -> Result<(Isolation, Option<String>), String> {
    use gpuci_core::pipeline::SandboxMode;
    let unsandboxed = |why: &str| -> Result<(Isolation, Option<String>), String> {
        if !allow_unsandboxed {
            return Err(format!("{why}, and this agent runs nothing outside the sandbox (start it with --allow-unsandboxed to allow that for trusted pipelines)"));
        }
        if !trusted {
            return Err(format!("{why}; jobs from pull requests of forks or outside contributors, and Actions runner jobs, never run outside the sandbox"));
        }
        Ok((Isolation::None, Some(format!("{why}: the job runs WITHOUT the sandbox, on the host file system"))))
    };
    match (step, policy, bubblewrap) {
        (SandboxMode::None, _, _) => unsandboxed("the step opts out of the sandbox (sandbox: none)"),
        (_, IsolationPolicy::None, _) => unsandboxed("this agent runs jobs without isolation (--isolation none)"),
        (_, _, true) => Ok((Isolation::Bubblewrap, None)),
        (_, _, false) => unsandboxed("bubblewrap is not installed or cannot work on this host"),
    }
}

/// The engine client's own directory, `<workspaces root>/.engine` (0700, the agent's): its
/// working directory, with an empty registry auth file and docker config for jobs from
/// untrusted origins. Made afresh when anything in it is not as it should be.
fn engine_dir(ctx: &JobContext, trusted: bool) -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let dir = ctx.work_root.join(".engine");
    let made = |e: std::io::Error| format!("preparing {}: {e}", dir.display());
    let me = nix::unistd::geteuid().as_raw();
    let ok = std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir() && m.uid() == me && m.mode() & 0o077 == 0);
    if !ok {
        let _ = crate::fstree::remove_tree(&dir);
        std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(made)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(made)?;
    }
    if !trusted {
        let auth = dir.join("no-auth.json");
        if std::fs::read(&auth).ok().as_deref() != Some(b"{}") {
            std::fs::write(&auth, "{}").map_err(made)?;
        }
        let docker = dir.join("no-docker-config");
        if !docker.is_dir() {
            std::fs::DirBuilder::new().mode(0o700).create(&docker).map_err(made)?;
        }
    }
    Ok(dir)
}
