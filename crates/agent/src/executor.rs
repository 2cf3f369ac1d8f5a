//! Running one job: GPU pre-check, sandbox, output lines, timeout and cancel, telemetry,
//! post-job GPU check, cleanup. The result is a [`JobFinished`] the agent keeps until the
//! coordinator acknowledges it.

use gpuci_core::job::Outcome;
use gpuci_core::mask::Masker;
use gpuci_gpu::{GpuBackend, HealthBaseline, HealthPolicy};
use gpuci_protocol::agent::{Assignment, GpuHealth, JobFinished, JobTelemetry, LogChunk, Stream};
use gpuci_protocol::JobId;
use gpuci_sandbox::{Isolation, Sandbox, SandboxSpec};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

/// What a job task reports to the agent loop, in order.
#[derive(Debug)]
pub enum JobEvent {
    Started { job_id: JobId, pid: u32, at_us: i64 },
    Log { job_id: JobId, chunk: LogChunk },
    Finished(JobFinished),
}

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
    pub allow_unsandboxed: bool,
    pub bubblewrap: bool,
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
}

impl JobContext {
    pub fn isolation_name(&self) -> &'static str {
        match (self.isolation, self.bubblewrap) {
            (IsolationPolicy::None, _) => "none",
            (_, true) => "bubblewrap",
            (IsolationPolicy::Bubblewrap, false) => "bubblewrap (missing)",
            (IsolationPolicy::Auto, false) => "none",
        }
    }
}

struct Emitter {
    job_id: JobId,
    tx: mpsc::UnboundedSender<JobEvent>,
    mask: Arc<Masker>,
}

impl Emitter {
    fn system(&self, text: impl Into<String>) {
        self.line(Stream::System, text.into());
    }
    fn line(&self, stream: Stream, text: String) {
        let text = self.mask.mask(&text);
        let _ = self.tx.send(JobEvent::Log { job_id: self.job_id, chunk: LogChunk { ts_us: now_us(), stream, text } });
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
    let mask = Arc::new(Masker::new(a.secrets.0.values().map(String::as_str)));
    let out = Emitter { job_id, tx: tx.clone(), mask };
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
    let _ =
        tx.send(JobEvent::Finished(JobFinished { job_id, outcome, finished_at_us: now_us(), telemetry, gpu_health }));
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
    let workspace = ctx.work_root.join(format!("job-{}", a.job_id));
    let _ = std::fs::remove_dir_all(&workspace);
    if let Err(e) = std::fs::create_dir_all(&workspace) {
        return fail(format!("creating workspace {}: {e}", workspace.display()));
    }
    if let Some(id) = &a.workspace_upload {
        if let Err(error) = fill_workspace(id, ctx, out, &workspace).await {
            out.system(format!("workspace: {error}"));
            let _ = std::fs::remove_dir_all(&workspace);
            return fail(format!("workspace: {error}"));
        }
    }
    restore_cache(a, ctx, &workspace, out).await;
    let result = execute_in(a, ctx, out, cancel, &workspace).await;
    save_cache(a, ctx, &workspace, out).await;
    if let Err(e) = std::fs::remove_dir_all(&workspace) {
        tracing::warn!(job = a.job_id, error = %e, "could not remove workspace");
    }
    result
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
    let (store, scope, paths) = (ctx.caches.clone(), a.cache.clone(), a.step.cache.clone());
    let ws = workspace.to_path_buf();
    let lines = tokio::task::spawn_blocking(move || store.save(&scope, &paths, &ws))
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
    let (id2, ws) = (id.to_string(), workspace.to_path_buf());
    let files = tokio::task::spawn_blocking(move || crate::workspace::unpack(&id2, &archive, &ws))
        .await
        .map_err(|e| crate::workspace::WorkspaceError::Unpack { id: id.to_string(), reason: e.to_string() })??;
    out.system(format!("workspace: {files} files from upload {short}"));
    Ok(())
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
) -> (Outcome, Option<JobTelemetry>) {
    let step = &a.step;
    let isolation = match (step.sandbox, ctx.isolation, ctx.bubblewrap) {
        (gpuci_core::pipeline::SandboxMode::None, _, _) if !ctx.allow_unsandboxed => {
            return (
                Outcome::StartFailed { error: "this agent forbids `sandbox: none` (--forbid-unsandboxed)".into() },
                None,
            );
        }
        (gpuci_core::pipeline::SandboxMode::None, _, _) => {
            out.system("sandbox disabled by the step (sandbox: none): the job runs on the host file system");
            Isolation::None
        }
        (_, IsolationPolicy::None, _) => {
            out.system("this agent runs jobs without isolation (--isolation none)");
            Isolation::None
        }
        (_, _, true) => Isolation::Bubblewrap,
        (_, IsolationPolicy::Bubblewrap, false) => {
            return (
                Outcome::StartFailed { error: "bubblewrap is required by this agent but not installed".into() },
                None,
            )
        }
        (_, IsolationPolicy::Auto, false) => {
            out.system("bubblewrap not installed: the job runs without isolation");
            Isolation::None
        }
    };
    let script = step.command.join("\n");
    let mut spec = SandboxSpec::new(
        format!("{}-job-{}", ctx.sandbox_prefix, a.job_id),
        workspace,
        vec!["bash".into(), "-eo".into(), "pipefail".into(), "-c".into(), script],
    );
    spec.env = job_env(a, workspace);
    spec.isolation = isolation;
    spec.network = step.network != gpuci_core::pipeline::NetworkMode::None;
    spec.resources = step.resources.clone();
    spec.hide_paths = ctx.hide_paths.clone();
    if let Some(dir) = &a.runner_dir {
        // The runner writes beside its files; give it a writable view of the install, not the install.
        let runner = if isolation == Isolation::Bubblewrap {
            let dest = workspace.join("runner");
            if let Err(e) = std::fs::create_dir_all(&dest) {
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
    let mut container: Option<(gpuci_sandbox::ContainerRuntime, String, PathBuf)> = None;
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
        let argv = match gpuci_sandbox::container::run_argv(&rt, image, &spec, &env_file) {
            Ok(a) => a,
            Err(e) => return (Outcome::StartFailed { error: e.to_string() }, None),
        };
        out.system(format!("running in container image {image} ({:?})", rt.engine));
        let name = gpuci_sandbox::container::container_name(&spec.job_id);
        spec.argv = argv;
        spec.isolation = Isolation::None;
        spec.env = BTreeMap::from([
            ("PATH".to_string(), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string()),
            ("HOME".to_string(), workspace.display().to_string()),
        ]);
        spec.gpu_devices.clear();
        spec.gpu_common_devices.clear();
        spec.resources = Default::default();
        container = Some((rt, name, env_file));
    }
    let (mut sandbox, stdout, stderr) = match Sandbox::spawn(&spec) {
        Ok(s) => s,
        Err(e) => return (Outcome::StartFailed { error: e.to_string() }, None),
    };
    let _ = out.tx.send(JobEvent::Started { job_id: a.job_id, pid: sandbox.pid(), at_us: now_us() });

    let readers = tokio::spawn(pump(out.job_id, out.tx.clone(), out.mask.clone(), stdout, stderr));
    let telemetry_cancel = CancellationToken::new();
    let telemetry = (!a.gpus.is_empty()).then(|| {
        tokio::spawn(gpuci_gpu::sample_loop(
            ctx.gpus.clone(),
            a.gpus.clone(),
            ctx.telemetry_period,
            telemetry_cancel.clone(),
            |_, _, _| {},
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
    if let Some((rt, name, env_file)) = &container {
        // Killing the engine's client does not stop the container; remove it by name.
        let _ = tokio::process::Command::new(&rt.path).args(["rm", "-f", name.as_str()]).output().await;
        let _ = std::fs::remove_file(env_file);
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
    job_id: JobId,
    tx: mpsc::UnboundedSender<JobEvent>,
    mask: Arc<Masker>,
    stdout: impl AsyncRead + Unpin + Send + 'static,
    stderr: impl AsyncRead + Unpin + Send + 'static,
) {
    let a = tokio::spawn(lines(job_id, tx.clone(), mask.clone(), Stream::Stdout, stdout));
    let b = tokio::spawn(lines(job_id, tx, mask, Stream::Stderr, stderr));
    let _ = a.await;
    let _ = b.await;
}

/// Forward output line by line, secrets masked. A line is complete before it is masked, so a
/// secret written in several pieces is still caught. Lines are capped at 64 KiB so one
/// runaway line cannot blow up memory; invalid UTF-8 is replaced, not dropped.
async fn lines(
    job_id: JobId,
    tx: mpsc::UnboundedSender<JobEvent>,
    mask: Arc<Masker>,
    stream: Stream,
    r: impl AsyncRead + Unpin,
) {
    let mut reader = BufReader::new(r);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        // At most 64 KiB per line: a longer run without a newline continues as the next line.
        match (&mut reader).take(64 * 1024).read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                while buf.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    buf.pop();
                }
                let text = mask.mask(&String::from_utf8_lossy(&buf));
                if tx.send(JobEvent::Log { job_id, chunk: LogChunk { ts_us: now_us(), stream, text } }).is_err() {
                    return;
                }
            }
        }
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
