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

// The job's output, its sandbox and its workspace each have a module; this one runs the job.
mod output;
mod sandbox;
mod workspace;
use output::{pump, Emitter};
use sandbox::{decide_isolation, engine_dir, job_env, job_sandbox, steps_socket, workspace_root, TakenWarm};
pub(crate) use sandbox::{resources_tag, warm_spec};
use workspace::{fill_workspace, remove_workspace, restore_cache, save_cache};

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
    /// Which job holds each GPU, from its pre-job check to its post-job check (`gpuhold.rs`).
    pub gpu_holds: Arc<crate::gpuhold::GpuHolds>,
}

impl JobContext {}

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
    // Its GPUs, once the job that held them before on this agent has ended (its post-job
    // check kills whatever runs on them); held until this job's own post-job check is done.
    let claim = crate::gpuhold::GpuClaim { job_id, gpus: a.gpus.clone() };
    let waiting = |by: &crate::gpuhold::GpuClaim| {
        let gpus = crate::gpuhold::shared(&claim, by).join(", ");
        tracing::warn!(job = job_id, former = by.job_id, gpus = %gpus, "waiting for the GPUs' former job to end");
        out.system(format!(
            "waiting for job {}, which held GPU {gpus} before this job, to end on this host",
            by.job_id
        ));
    };
    let Some(held) = ctx.gpu_holds.enter(claim.clone(), &cancel, waiting).await else {
        let _ = tx.send(JobEvent::Finished(JobFinished {
            job_id,
            outcome: Outcome::Cancelled { reason: "cancelled before it started".into() },
            finished_at_us: now_us(),
            started_at_us: None,
            lines: None,
            telemetry: None,
            gpu_health,
        }));
        return;
    };
    let (outcome, telemetry) = execute(&a, &ctx, &out, &cancel, &mut gpu_health).await;
    // Post-job check of every leased GPU: leftovers killed, memory back to baseline.
    for uuid in &a.gpus {
        if gpu_health.contains_key(uuid) {
            continue;
        }
        let h = post_check(&ctx, uuid, &out).await;
        gpu_health.insert(uuid.clone(), h);
    }
    // Checked and cleared: the GPUs' next job may start (before the result is sent, so the
    // job the coordinator places on them next never waits for this one).
    let finished_at_us = now_us();
    drop(held);
    // The start time is filled in by the agent loop, which saw the start.
    let _ = tx.send(JobEvent::Finished(JobFinished {
        job_id,
        outcome,
        finished_at_us,
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
    let mut container: Option<(
        gpuci_sandbox::ContainerRuntime,
        String,
        PathBuf,
        PathBuf,
        gpuci_sandbox::ContainerReaper,
    )> = None;
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
        // The engine's client dies with the agent, but conmon and the container do not: the
        // reaper removes the container should the agent go (however) before it has.
        let reaper = match gpuci_sandbox::ContainerReaper::start(&rt, &spec.job_id, &name) {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_file(&env_file);
                let _ = std::fs::remove_file(&profile);
                let error = format!("{e}: refusing to run a container that could outlive the agent");
                return (Outcome::StartFailed { error }, None);
            }
        };
        container = Some((rt, name, env_file, profile, reaper));
    }
    let (mut sandbox, stdout, stderr) = match Sandbox::spawn_warm(&spec, warm.0.take()) {
        Ok(s) => s,
        Err(e) => {
            if let Some((_, _, env_file, profile, reaper)) = container {
                let _ = std::fs::remove_file(env_file);
                let _ = std::fs::remove_file(profile);
                // No client, no container; a reaper left armed would only remove nothing.
                let _ = reaper.disarm().await;
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
    let end = first_end(sandbox.wait(), sleep, cancel.cancelled()).await;
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
    if let Some((rt, name, env_file, profile, reaper)) = container {
        // Killing the engine's client does not stop the container; remove it by name.
        let argv = gpuci_sandbox::container::remove_argv(&rt, &name);
        let _ = tokio::process::Command::new(&argv[0]).args(&argv[1..]).output().await;
        let _ = std::fs::remove_file(env_file);
        let _ = std::fs::remove_file(profile);
        if let Err(e) = reaper.disarm().await {
            out.system(format!("{e}: the container was not guarded against the agent's death"));
        }
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

/// How a job's run ended, as the executor first saw it.
enum End {
    Exited(Result<gpuci_sandbox::ExitInfo, gpuci_sandbox::SandboxError>),
    TimedOut,
    Cancelled,
}

/// The first of the job's exit, its timeout and a cancel; an exit that is already there
/// wins over both. When the agent did not run for a while (stopped, swapped out, a loaded
/// host), the job can have exited within its timeout and the timer be due as well on
/// waking: a random pick between the two recorded such a job as timed out, its process
/// tree "killed", its exit code lost (outsider attack).
async fn first_end<T>(
    exited: impl std::future::Future<Output = Result<gpuci_sandbox::ExitInfo, gpuci_sandbox::SandboxError>>,
    timeout: impl std::future::Future<Output = T>,
    cancelled: impl std::future::Future<Output = ()>,
) -> End {
    tokio::select! {
        biased;
        r = exited => End::Exited(r),
        _ = timeout => End::TimedOut,
        _ = cancelled => End::Cancelled,
    }
}

fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    f.write_all(text.as_bytes())
}

#[cfg(test)]
mod output_tests;

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

    #[tokio::test]
    async fn an_exit_that_is_there_wins_over_a_timeout_and_a_cancel_due_at_once() {
        use super::{first_end, End};
        for _ in 0..64 {
            let info = gpuci_sandbox::ExitInfo {
                code: Some(2),
                signal: None,
                oom_killed: false,
                pids_limit_hit: false,
                memory_peak: None,
                memory_limit: None,
            };
            let exited = std::future::ready(Ok(info));
            let end = first_end(exited, std::future::ready(()), std::future::ready(())).await;
            assert!(matches!(end, End::Exited(Ok(_))), "a job that exited was recorded as timed out or cancelled");
        }
        let end = first_end(std::future::pending(), std::future::ready(()), std::future::pending()).await;
        assert!(matches!(end, End::TimedOut));
    }

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
