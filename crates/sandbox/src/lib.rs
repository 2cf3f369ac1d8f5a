//! gpuci-sandbox: starts one CI job's process isolated, with limits, and kills its whole tree.
//!
//! This is the small privileged piece of the agent (it usually runs as root): namespaces through
//! bubblewrap, cgroups, device nodes. It must stay small and auditable. It does not fetch code,
//! stream logs, talk to the coordinator or decide policy (which isolation a pool allows, what a
//! job's limits are): the agent does, and hands a [`SandboxSpec`] in.
//!
//! # Isolation
//!
//! [`Isolation::Bubblewrap`] (the default) runs `bwrap` with this mount plan, in this order:
//!
//! | # | inside the sandbox | how |
//! |---|--------------------|-----|
//! | 1 | `/usr`, `/opt` and, when they are real directories, `/bin /sbin /lib /lib32 /lib64 /libx32` | `--ro-bind` (when a merged-/usr host has them as symlinks: `--symlink` to the same target) |
//! | 2 | an allow-list of `/etc` entries: passwd, group, hosts, resolv.conf, nsswitch.conf, ld.so.cache, ssl/, ca-certificates/, pki/, localtime, os-release, alternatives/, OpenCL/, vulkan/, nvidia/, ssh client config, ... (`plan::ETC_ALLOW`) | the allow-listed *files* are copies in one prepared read-only view directory (`/run/gpuci-sandbox/etc.<pid>.<gen>`, rebuilt when a source's stat changes; see `etcview.rs` for where and why it is safe) bound onto `/etc` with one `--ro-bind`; the allow-listed *directories* are `--ro-bind`ed live on top of it. Without a view (agent not root, `/run` not writable, a hide path inside `/etc`): `--ro-bind` each entry that exists. Never `/etc` as a whole: `shadow`, ssh host keys, `/etc/gpuci` |
//! | 3 | `/sys/devices/system/{cpu,node}`; with a GPU leased also `/sys/bus/pci`, `/sys/devices/pci*`, `/sys/module/nvidia` | `--ro-bind` (NVML, CUDA and CPU-topology code read these; the rest of sysfs is absent) |
//! | 4 | `/proc` (of the new PID namespace), a minimal `/dev` (null, zero, full, random, urandom, tty, pts), `/dev/shm`, `/tmp`, `/var/tmp` | `--proc`, `--dev`, `--tmpfs` (fresh and empty per job; tmpfs pages count against the job's memory limit) |
//! | 5 | each `hide_paths` entry that lies *inside* a bound directory (e.g. `/opt/gpuci/data`) | `--tmpfs` over a directory, `--ro-bind /dev/null` over a file; a hide path that *covers* a source in 1–3 drops that source |
//! | 6 | the workspace, read-write, at the same path; it is the working directory | `--bind`, after 5 so a hidden ancestor (`/var/lib/gpuci`) does not hide it |
//! | 7 | hide paths inside the workspace | as 5 |
//! | 8 | the leased GPU nodes, and the common nvidia nodes (`nvidiactl`, `nvidia-uvm`, ...) only when a GPU is leased, at `/dev/<basename>` | `--dev-bind` each |
//!
//! Nothing else of the host exists inside: not `/`, `/home`, `/root`, `/run` (sockets of
//! docker, systemd, the agent), `/var` (the agent's data dir, other jobs' workspaces), `/srv`,
//! `/mnt`, `/media`. The root itself is a tmpfs bwrap builds.
//!
//! Besides the mounts: `--unshare-pid` (the job's pid 1 is bwrap's init; when the job's main
//! process exits every process in the namespace dies, setsid'd daemons included),
//! `--unshare-ipc --unshare-uts --unshare-cgroup-try`, `--unshare-net` when `network` is false
//! (only a down loopback), `--hostname gpuci`, `--die-with-parent`, `--new-session` (no TIOCSTI
//! onto a terminal), `--cap-drop ALL` (bwrap started by root keeps every capability otherwise;
//! bwrap also sets `no_new_privs`), `--clearenv` and one `--setenv` per variable.
//!
//! All of those arguments reach bwrap through `--args <memfd>`, not its command line: the job's
//! environment carries secrets, and `/proc/<pid>/cmdline` is world-readable. bwrap's own
//! environment is empty, so nothing in the job's environment (`LD_PRELOAD`, ...) can act on the
//! privileged bwrap process.
//!
//! Jobs run as the uid the agent hands in ([`JobUser`]): under a root agent, an unprivileged
//! uid of the job's slot; under an unprivileged agent, the agent's own uid in a user namespace
//! (docs/sandbox.md).
//!
//! [`Isolation::None`] is the explicit opt-out (the agent logs it; a pool can forbid it): the
//! job runs on the host's file system, but still with only its own environment, in its own
//! session and process group, and in cgroups.
//!
//! # Limits and tree kill
//!
//! When cgroups are writable ([`CgroupUse::Auto`] or [`CgroupUse::Required`]), each job gets
//! `<agent's cgroup>/gpuci/<job_id>` in the v1 hierarchies it needs (memory, pids, freezer always;
//! cpu only with a CPU limit; devices only when there are host GPU nodes to deny) or once on v2. The child enters them itself between fork and exec (it writes "0"
//! into pre-opened `cgroup.procs` files, see `child.rs`), so no process of the job ever runs
//! outside them. Limits: memory (`memory.limit_in_bytes` + `memory.memsw.limit_in_bytes` / v2
//! `memory.max` + `memory.swap.max = 0`), pids (`pids.max`), CPU (CFS quota over a 100 ms
//! period). On v1 the devices controller also denies every host `/dev/nvidiaN` that is not
//! leased, which holds even for `Isolation::None`.
//!
//! Start-up cost on v1: the first write into a `cgroup.procs` file takes the kernel's
//! `cgroup_threadgroup_rwsem` for writing, which waits for an RCU grace period (12–16 ms measured
//! on a 2-core VM, HZ=250) unless a migration happened within the last grace period or the host
//! enabled `favordynmods` on a cgroup mount (`mount -o remount,favordynmods` on the cgroup2 mount,
//! also the hybrid `unified` one; kernel ≥ 6.1). That is a host-wide trade-off (slightly slower
//! fork/exit) for the administrator to make, so this crate does not flip it; see BENCHMARKS.md.
//! Instead [`WarmStart`] pays it ahead of time: a slot's next job's first process, already in
//! its cgroups, network namespace and uid, waiting for [`Sandbox::spawn_warm`] (see `warm.rs`).
//!
//! [`Sandbox::kill_tree`] kills without racing forks: v2 `cgroup.kill`; v1 freeze (freezer),
//! SIGKILL every pid, thaw. Without cgroups it kills the process group and every process whose
//! environment carries `GPUCI_SANDBOX_ID=<id>` (see `procscan.rs` for what that misses).
//!
//! # Disk
//!
//! [`SlotDisk`] gives a job slot a disk of its own (a loop-mounted ext4 image of the slot's
//! size): the workspace lives there, so a job cannot fill the host's disk (see `quota.rs`).
//!
//! # Traps
//!
//! - `--die-with-parent` is a parent-death signal tied to the *thread* that spawned bwrap. Call
//!   [`Sandbox::spawn`] from a long-lived thread (a tokio worker is fine, `spawn_blocking` is not:
//!   its threads exit when idle, and the job would be killed with them).
//! - [`Sandbox::spawn`] needs a tokio runtime (it returns tokio pipes).

mod cgroup;
mod child;
mod diagnose;
mod error;
mod etcview;
mod host;
mod metadata;
mod netns;
mod plan;
mod procscan;
mod quota;
mod reaper;
mod sandbox;
pub mod seccomp;
mod spawner;
mod warm;

pub mod container;

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

pub use cgroup::probe as probe_cgroups;
pub use cgroup::{own_limits, OwnLimits};
pub use diagnose::{diagnose, Diagnosis};
pub use error::SandboxError;
pub use gpuci_core::pipeline::Resources;
pub use host::{ensure_run_dir, seal_inherited_fds};
pub use metadata::{MetadataError, DENIED as METADATA_DENIED};
pub use netns::{NetworkError, SlotNetwork};
pub use procscan::MARKER as JOB_ID_ENV;
pub use quota::SlotDisk;
pub use reaper::ContainerReaper;
pub use sandbox::PRIVATE_DEV_ROOT;
pub use sandbox::{ExitInfo, Sandbox};
pub use seccomp::SeccompError;
pub use warm::{ReadySpec, WarmSpec, WarmStart};

/// The directory under `/run` the sandbox keeps host-wide state in (the `/etc` view; the
/// agent's uid locks). See [`ensure_run_dir`].
pub const RUN_DIR: &str = etcview::RUN_DIR;

/// Which cgroup version the host offers for job limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupKind {
    V2,
    V1,
    None,
}

/// An installed bubblewrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BubblewrapInfo {
    pub path: PathBuf,
    /// As `bwrap --version` prints it, e.g. "0.8.0".
    pub version: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContainerEngine {
    Podman,
    Docker,
}

impl ContainerEngine {
    /// Arguments for `info` that succeed only when the engine itself answers (not just its
    /// client) and print its version. The two engines name the field differently: podman has
    /// no `.ServerVersion`, and its `info` fails on that template.
    pub fn info_args(self) -> [&'static str; 3] {
        match self {
            ContainerEngine::Podman => ["info", "--format", "{{.Version.Version}}"],
            ContainerEngine::Docker => ["info", "--format", "{{.ServerVersion}}"],
        }
    }
}

/// A container engine found on PATH.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerRuntime {
    pub engine: ContainerEngine,
    pub path: PathBuf,
}

/// What this host can do. Cheap: a few stats and one `bwrap --version`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    pub bubblewrap: Option<BubblewrapInfo>,
    pub cgroup: CgroupKind,
    /// Whether this process can create job cgroups (root, or a delegated subtree).
    pub cgroup_writable: bool,
    pub container_runtime: Option<ContainerRuntime>,
    /// Whether unprivileged user namespaces are enabled (bwrap runs as the job's uid in one).
    pub user_namespaces: bool,
    /// `pasta`, for the slots' networks ([`SlotNetwork`]).
    pub pasta: Option<PathBuf>,
}

/// Detects what the host offers. Called once at agent start and by `gpuci doctor`.
pub fn detect() -> Capabilities {
    let bubblewrap = find_program("bwrap").map(|path| {
        let version = Command::new(&path)
            .arg("--version")
            .env_clear()
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().trim_start_matches("bubblewrap").trim().to_string())
            .unwrap_or_default();
        BubblewrapInfo { path, version }
    });
    let layout = cgroup::layout();
    let container_runtime = find_program("podman")
        .map(|path| ContainerRuntime { engine: ContainerEngine::Podman, path })
        .or_else(|| find_program("docker").map(|path| ContainerRuntime { engine: ContainerEngine::Docker, path }));
    let read_num = |p: &str| fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    let user_namespaces = read_num("/proc/sys/user/max_user_namespaces").unwrap_or(0) > 0
        && read_num("/proc/sys/kernel/unprivileged_userns_clone").unwrap_or(1) != 0;
    Capabilities {
        bubblewrap,
        cgroup: layout.map(|l| l.kind()).unwrap_or(CgroupKind::None),
        cgroup_writable: layout.is_some_and(|l| l.writable()),
        container_runtime,
        user_namespaces,
        pasta: find_program("pasta"),
    }
}

/// Looks a program up on the agent's PATH, then in the usual system directories.
pub(crate) fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin", "/bin", "/usr/local/bin", "/usr/sbin"].iter().map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    fs::metadata(p).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// What [`sweep`] found and removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    pub processes_killed: usize,
    pub cgroups_removed: usize,
    /// Empty warm-start cgroups of agents that are gone (any agent's, not only this one's).
    pub stale_warm_removed: usize,
}

/// Kill and remove what an earlier run of the same agent left behind: every job cgroup whose
/// name starts with `prefix` (its processes killed without racing forks, then removed) and
/// every process whose sandbox id starts with `prefix`. An agent killed with SIGKILL cleans up
/// nothing itself; bwrap's `--die-with-parent` usually takes its jobs along, but not a job
/// whose sandbox was still being set up, nor jobs run without bubblewrap. Call it at start-up,
/// before running anything, with the agent's own prefix so other agents' jobs are untouched,
/// and the uids its jobs run as (marked processes of other uids are not its own).
pub fn sweep(prefix: &str, job_uids: &[u32]) -> SweepReport {
    let mut report = SweepReport::default();
    if prefix.is_empty() {
        return report;
    }
    if let Some(layout) = cgroup::layout() {
        // Any agent's empty warm-start cgroups: an agent killed and never started again left
        // them (its waiting processes died with it). A live agent's always hold their process,
        // except for a moment while one is made; removing it then only makes that slot's next
        // job start cold. Job cgroups of other agents are never touched.
        for cg in cgroup::JobCgroup::leftovers(layout, "") {
            if is_warm_name(cg.name()) && cg.pids().is_empty() && cg.remove().is_ok() {
                report.stale_warm_removed += 1;
            }
        }
        for cg in cgroup::JobCgroup::leftovers(layout, prefix) {
            report.processes_killed += cg.pids().len();
            let _ = cg.kill_all();
            for _ in 0..50 {
                if cg.remove().is_ok() {
                    report.cgroups_removed += 1;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
    for pid in procscan::pids_with_marker_prefix(prefix, job_uids) {
        if nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).is_ok() {
            report.processes_killed += 1;
        }
    }
    report
}

/// Ends every process running as one of `uids` — uids an agent has just leased, so whatever
/// runs as them was left by an agent that is gone (a job or warm start that outlived a
/// SIGKILL, a slot network's holder). A job must be the only process of its uid: a leftover
/// could signal or trace the next job of that uid and read its secrets. SIGKILLs until none
/// is left or `within` passes; returns how many were killed, or the ones still running
/// (pid, uid) when some could not be ended (not permitted, or stuck in the kernel).
pub fn end_processes_of(uids: &[u32], within: std::time::Duration) -> Result<usize, Vec<(i32, u32)>> {
    let uids: Vec<u32> = uids.iter().copied().filter(|&u| u != 0).collect();
    let deadline = std::time::Instant::now() + within;
    let mut killed = std::collections::HashSet::new();
    loop {
        let left = procscan::pids_of_uids(&uids);
        if left.is_empty() {
            return Ok(killed.len());
        }
        if std::time::Instant::now() >= deadline {
            return Err(left);
        }
        for &(pid, _) in &left {
            if nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).is_ok() {
                killed.insert(pid);
            }
            // A frozen process takes its SIGKILL only when thawed: an agent killed between
            // freezing a cgroup to end it and thawing it leaves its processes frozen for good
            // (seen: a warm start's `sleep` frozen for 43 minutes, which held a later agent's
            // uids until its start gave up).
            thaw_cgroup_of(pid);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Thaws the freezer cgroup `pid` is in (cgroup v1 `freezer.state`, v2 `cgroup.freeze`), if
/// it is frozen. Only for processes of a dead agent's job uids ([`end_processes_of`]).
fn thaw_cgroup_of(pid: i32) {
    let Ok(cgroups) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else { return };
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let path = path.trim_start_matches('/');
        if path.split('/').any(|c| c == "..") {
            continue;
        }
        if controllers.split(',').any(|c| c == "freezer") {
            let state = std::path::Path::new("/sys/fs/cgroup/freezer").join(path).join("freezer.state");
            if std::fs::read_to_string(&state).is_ok_and(|s| s.trim() != "THAWED") {
                let _ = std::fs::write(&state, "THAWED");
            }
        } else if controllers.is_empty() {
            let freeze = std::path::Path::new("/sys/fs/cgroup").join(path).join("cgroup.freeze");
            if std::fs::read_to_string(&freeze).is_ok_and(|s| s.trim() == "1") {
                let _ = std::fs::write(&freeze, "0");
            }
        }
    }
}

/// Whether a cgroup name is an agent's warm start: `<agent prefix>-warm-<slot>-<n>`, the
/// prefix 1 to 12 letters and digits (`gpuci-agent` names them so; nothing else matches).
pub fn is_warm_name(name: &str) -> bool {
    let Some((prefix, rest)) = name.split_once("-warm-") else { return false };
    let Some((slot, n)) = rest.split_once('-') else { return false };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (1..=12).contains(&prefix.len()) && prefix.bytes().all(|b| b.is_ascii_alphanumeric()) && digits(slot) && digits(n)
}

/// How the job is isolated from the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Isolation {
    /// Namespaces and the mount plan above, through bubblewrap.
    #[default]
    Bubblewrap,
    /// Explicit opt-out (`sandbox: none`): host file system, still own env, session and cgroups.
    None,
}

/// The job's network.
#[derive(Clone, Debug, Default)]
pub enum Network {
    /// Its own network namespace with only a loopback: nothing reachable, not even the host.
    #[default]
    None,
    /// Join this network namespace (a slot's, see [`SlotNetwork`]) before dropping privileges.
    /// It is owned by a user namespace the job is not in, so the job holds no capability in it.
    Namespace(Arc<OwnedFd>),
    /// The host's network namespace: host loopback services, abstract sockets, everything.
    Host,
}

/// An unprivileged host uid and gid for a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobUser {
    pub uid: u32,
    pub gid: u32,
}

/// Whether to put the job in cgroups.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CgroupUse {
    /// Use them when writable; otherwise run without limits (logged when limits were asked for).
    #[default]
    Auto,
    /// Fail to start when they are not usable (a pool that promises limits).
    Required,
    /// Do not use them (the agent's cgroups are managed by someone else).
    Disabled,
}

/// Everything needed to start one job.
#[derive(Clone, Debug)]
pub struct SandboxSpec {
    /// Names the cgroups and is set as `GPUCI_SANDBOX_ID` in the job's environment. `[A-Za-z0-9._-]`.
    pub job_id: String,
    /// Created by the agent; writable; the job's working directory, at the same path inside.
    pub workspace: PathBuf,
    /// e.g. `["bash", "-eo", "pipefail", "-c", script]`; looked up on the job's `PATH`.
    pub argv: Vec<String>,
    /// The job's entire environment: nothing is inherited from the agent.
    pub env: BTreeMap<String, String>,
    pub isolation: Isolation,
    pub network: Network,
    /// The unprivileged uid/gid the job runs as (the agent must be root to switch to it).
    /// `None`: the agent's own uid — only for an agent that is not root itself.
    pub user: Option<JobUser>,
    /// Size of each of the job's scratch tmpfs mounts (`/tmp`, `/var/tmp`, `/dev/shm`); `None`:
    /// the kernel's default, half the host's memory. Their pages count against the memory limit.
    pub scratch_size: Option<u64>,
    /// The leased `/dev/nvidiaN` nodes: the only GPU nodes visible, at `/dev/<basename>`.
    pub gpu_devices: Vec<PathBuf>,
    /// `/dev/nvidiactl`, `/dev/nvidia-uvm`, ... where present; visible only with a GPU leased.
    pub gpu_common_devices: Vec<PathBuf>,
    /// Must not be visible at all (the agent's data dir, the workspaces root).
    pub hide_paths: Vec<PathBuf>,
    pub resources: Resources,
    pub cgroups: CgroupUse,
    /// Host directories (an Actions runner install) shown read-only inside the workspace.
    pub tool_views: Vec<ToolView>,
}

/// The top-level entries of `source` bound read-only into `dest`, a directory inside the
/// workspace that stays writable: a tool can write beside its files (the Actions runner's
/// `_diag` and `_work`) and the host's copy is never changed. Bubblewrap only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolView {
    pub source: PathBuf,
    pub dest: PathBuf,
}

impl SandboxSpec {
    /// A spec with the defaults: bubblewrap, no network, no GPU, no limits, cgroups when usable.
    pub fn new(job_id: impl Into<String>, workspace: impl Into<PathBuf>, argv: Vec<String>) -> Self {
        Self {
            job_id: job_id.into(),
            workspace: workspace.into(),
            argv,
            env: BTreeMap::new(),
            isolation: Isolation::Bubblewrap,
            network: Network::None,
            user: None,
            scratch_size: None,
            gpu_devices: Vec::new(),
            gpu_common_devices: Vec::new(),
            hide_paths: Vec::new(),
            resources: Resources::default(),
            cgroups: CgroupUse::Auto,
            tool_views: Vec::new(),
        }
    }
}

pub(crate) fn validate_job_id(id: &str) -> Result<(), SandboxError> {
    let bad = |reason| Err(SandboxError::InvalidJobId { job_id: id.to_string(), reason });
    if id.is_empty() || id.len() > 128 {
        return bad("must be 1 to 128 characters");
    }
    if id == "." || id == ".." {
        return bad("must not be . or ..");
    }
    if !id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return bad("only ASCII letters, digits, '.', '_' and '-' are allowed (it names a cgroup)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_that_could_escape_the_cgroup_dir_are_rejected() {
        for bad in ["", ".", "..", "../x", "a/b", "a b", "a\nb"] {
            assert!(validate_job_id(bad).is_err(), "{bad:?}");
        }
        validate_job_id("job-42_a.b").expect("valid id");
    }

    #[test]
    fn only_agents_warm_start_names_are_swept() {
        assert!(is_warm_name("0d5708d5e9cf-warm-0-400"));
        for not in [
            "test-warm-same-w-28860-7-warm",
            "abc-warm-x-1",
            // `gpuci bench sandbox`'s own warm starts.
            "bench-w28860-7",
            "0d5708d5e9cf-job-3",
            "a-warm-1",
            "toolongprefix1-warm-0-1",
        ] {
            assert!(!is_warm_name(not), "{not}");
        }
    }

    #[test]
    fn detect_does_not_panic() {
        let caps = detect();
        eprintln!("{caps:?}");
    }
}
