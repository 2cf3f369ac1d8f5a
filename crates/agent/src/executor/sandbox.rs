//! What a job's sandbox is made of, decided from the agent's settings, the slot and the step:
//! which isolation it gets (never a silent fallback to none), its user, network, limits,
//! environment, steps socket and the engine client's directory. Nothing here starts the job
//! or reads its output.

use super::*;

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
pub(super) fn workspace_root<'a>(ctx: &'a JobContext, slot: Option<&'a crate::slots::SlotGuard>) -> &'a Path {
    slot.and_then(|s| s.disk()).map_or(ctx.work_root.as_path(), |d| d.path())
}

/// The sandbox of a step with `network` and `resources` (its own, before defaults) in `workspace`, as far as the agent's
/// settings and the slot decide it: user, network, limits (the agent's defaults where the step
/// gives none), scratch sizes, hidden paths. `out` hears what the job should know.
pub(super) fn job_sandbox(
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
pub(super) struct TakenWarm(pub(super) Option<gpuci_sandbox::WarmStart>);

impl Drop for TakenWarm {
    fn drop(&mut self) {
        if let Some(w) = self.0.take() {
            tokio::spawn(w.discard());
        }
    }
}

/// The job's steps socket, its address put in `env`; `None` (said in the log) when it has
/// no token or the socket cannot be made.
pub(super) fn steps_socket(
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

pub(super) fn job_env(a: &Assignment, workspace: &std::path::Path) -> BTreeMap<String, String> {
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
pub(super) fn engine_dir(ctx: &JobContext, trusted: bool) -> Result<PathBuf, String> {
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
