//! One running job: spawn, wait, kill the tree, clean up.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuci_core::quantity::Bytes;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, ChildStderr, ChildStdout, Command};

use crate::cgroup::{self, JobCgroup};
use crate::child::{self, ChildSetup};
use crate::etcview::{self, EtcView};
use crate::plan::{self, HostFs, Kind, RealFs};
use crate::procscan::{self, MARKER};
use crate::{find_program, validate_job_id, CgroupUse, Isolation, SandboxError, SandboxSpec};

/// How long cleanup waits for the job's processes to be gone after SIGKILL.
const CLEANUP_DEADLINE: Duration = Duration::from_secs(10);

/// How a job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit code of the main process. Under bubblewrap a job killed by signal N shows as 128+N.
    pub code: Option<i32>,
    /// Signal that killed the main process (bwrap itself, under bubblewrap).
    pub signal: Option<i32>,
    /// The kernel OOM killer killed a process of the job (the cgroup's `oom_kill` counter).
    pub oom_killed: bool,
    /// A fork failed because of the pids limit.
    pub pids_limit_hit: bool,
    /// Peak memory of the job's cgroup, where the kernel reports it.
    pub memory_peak: Option<Bytes>,
    /// The memory limit that applied, for messages.
    pub memory_limit: Option<Bytes>,
}

impl ExitInfo {
    pub fn success(&self) -> bool {
        self.code == Some(0) && !self.oom_killed
    }
}

impl fmt::Display for ExitInfo {
    /// The human reason: "out of memory (limit 8 GiB)", "exit code 2", "killed by signal 9".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.oom_killed {
            return match self.memory_limit {
                Some(l) => write!(f, "out of memory (limit {l})"),
                None => write!(f, "out of memory"),
            };
        }
        match (self.code, self.signal) {
            (Some(c), _) => write!(f, "exit code {c}")?,
            (None, Some(s)) => write!(f, "killed by signal {s}")?,
            (None, None) => write!(f, "ended")?,
        }
        if self.pids_limit_hit {
            write!(f, " (process limit reached)")?;
        }
        Ok(())
    }
}

/// One running job. Call [`Sandbox::cleanup`] when done; dropping it only kills best-effort.
#[derive(Debug)]
pub struct Sandbox {
    job_id: String,
    child: Child,
    pid: u32,
    cgroup: Option<JobCgroup>,
    /// The job's private GPU device nodes (see [`private_devices`]); removed at cleanup.
    private_dev: Option<std::path::PathBuf>,
    /// The `/etc` view generation bwrap binds: kept (not removed) until the job is gone.
    #[allow(dead_code)]
    etc_view: Option<Arc<EtcView>>,
    /// Whether `GPUCI_SANDBOX_ID` finds the job's processes: without a cgroup, or for a job
    /// that runs as root and so could leave its cgroup (an `image:` step's engine client).
    /// Otherwise the cgroup is the truth, and the variable, which any job can set on its own
    /// processes, is not trusted: another job claiming this one's id held up its clean-up and
    /// lost it its cgroup (outsider finding). Even then only processes of the job's uid count.
    by_marker: bool,
    /// No cgroup, and a uid of the job's own: at cleanup every process of that uid is the job's
    /// and goes, wherever it hid (a process that dropped its marker, left bubblewrap's PID
    /// namespace alive by stopping its init under ptrace, or double-forked into a new session).
    by_uid: bool,
    /// The uid the job's processes run as (the job user's, else the agent's).
    uid: u32,
    exit: Option<ExitInfo>,
    cleaned: bool,
}

impl Sandbox {
    /// Starts the job. stdin is `/dev/null`; stdout and stderr are pipes.
    pub fn spawn(spec: &SandboxSpec) -> Result<(Sandbox, ChildStdout, ChildStderr), SandboxError> {
        Self::spawn_warm(spec, None)
    }

    /// Starts the job from `warm` when it fits the job: in its ready sandbox when that is exactly
    /// the job's, else from its waiting shell (same user, network namespace and cgroup use;
    /// bubblewrap); else cold, discarding `warm` first. Same result every way.
    pub fn spawn_warm(
        spec: &SandboxSpec,
        warm: Option<crate::WarmStart>,
    ) -> Result<(Sandbox, ChildStdout, ChildStderr), SandboxError> {
        let mut warm = warm;
        let started = Self::spawn_from(spec, &mut warm);
        // Not used (the spec was refused before it came to the warm start): ended properly.
        if let Some(w) = warm {
            tokio::spawn(w.discard());
        }
        started
    }

    fn spawn_from(
        spec: &SandboxSpec,
        warm: &mut Option<crate::WarmStart>,
    ) -> Result<(Sandbox, ChildStdout, ChildStderr), SandboxError> {
        let id = spec.job_id.as_str();
        validate_job_id(id)?;
        let invalid = |reason: &str| SandboxError::InvalidSpec { job_id: id.to_string(), reason: reason.to_string() };
        if spec.argv.is_empty() {
            return Err(invalid("argv is empty"));
        }
        // No command line or environment can hold a NUL; what one would become on the way
        // (bwrap's NUL-separated arguments, a shell's input) is never what the job meant.
        let has_nul = |s: &str| s.contains('\0');
        if spec.argv.iter().any(|a| has_nul(a)) || spec.env.iter().any(|(k, v)| has_nul(k) || has_nul(v)) {
            return Err(invalid("the job's command or environment contains a NUL byte"));
        }
        if spec.env.keys().any(|k| k.is_empty() || k.contains('=')) {
            return Err(invalid("an environment variable's name is empty or contains `=`"));
        }
        let ws_err = |reason: &str| SandboxError::Workspace {
            job_id: id.to_string(),
            path: spec.workspace.clone(),
            reason: reason.to_string(),
        };
        if !spec.workspace.is_absolute() {
            return Err(ws_err("not an absolute path"));
        }
        if !spec.workspace.is_dir() {
            return Err(ws_err("not a directory"));
        }

        let mut env: BTreeMap<String, String> = spec.env.clone();
        env.insert(MARKER.to_string(), id.to_string());
        let root = nix::unistd::geteuid().is_root();
        if root && spec.user.is_none() && spec.isolation == Isolation::Bubblewrap {
            // The privilege model: the agent may be root, the job never is.
            return Err(invalid(
                "the agent runs as root but no unprivileged job user was given; jobs never run as root",
            ));
        }
        if spec.user.is_some_and(|u| u.uid == 0 || u.gid == 0) {
            return Err(invalid("the job user must not be root"));
        }
        if spec.user.is_some() && !root {
            return Err(invalid("switching to a job user needs a root agent"));
        }
        if let crate::Network::Namespace(_) = spec.network {
            if !root {
                return Err(invalid("joining a slot's network namespace needs a root agent"));
            }
        }

        let bwrap = match spec.isolation {
            Isolation::Bubblewrap => {
                Some(find_program("bwrap").ok_or_else(|| SandboxError::BubblewrapMissing { job_id: id.to_string() })?)
            }
            Isolation::None => None,
        };
        // Leased GPU nodes become private nodes owned by the job user (see `private_devices`).
        let mut owned_spec;
        let mut private_dev = None;
        let spec = match spec.user {
            Some(user) if !spec.gpu_devices.is_empty() => {
                let (dir, leased, common) = private_devices(spec, user)?;
                owned_spec = spec.clone();
                owned_spec.gpu_devices = leased;
                owned_spec.gpu_common_devices = common;
                private_dev = Some(dir);
                &owned_spec
            }
            _ => spec,
        };
        let remove_private = |dir: &Option<std::path::PathBuf>| {
            if let Some(d) = dir {
                let _ = fs::remove_dir_all(d);
            }
        };
        if let Some(started) = warm.take().and_then(|w| w.start(spec, &env)) {
            let crate::warm::Started { child, stdout, stderr, cgroup, etc_view } = started;
            return Ok((Sandbox::running(spec, child, cgroup, private_dev, etc_view), stdout, stderr));
        }
        let cgroup = match create_cgroup(spec) {
            Ok(c) => c,
            Err(e) => {
                remove_private(&private_dev);
                return Err(e);
            }
        };

        let result = (|| {
            // Opened here, O_CLOEXEC; the child writes itself into them before exec.
            let procs: Vec<File> = cgroup
                .iter()
                .flat_map(|c| c.procs_files())
                .map(|p| {
                    OpenOptions::new().write(true).open(&p).map_err(|source| SandboxError::Cgroup {
                        job_id: id.to_string(),
                        op: "open".to_string(),
                        path: p.clone(),
                        source,
                    })
                })
                .collect::<Result<_, _>>()?;
            // Descriptors bwrap reads: its arguments, the seccomp programs, passwd/group.
            let mut inherit: Vec<File> = Vec::new();
            let mut etc_view = None;
            let mut cmd = match &bwrap {
                Some(bwrap) => {
                    etc_view = etcview::current();
                    let view = etc_view.as_deref().map(|v| plan::EtcPlan { dir: &v.dir, binds: &v.binds });
                    let memfd_err = |source| SandboxError::ArgsFd { job_id: id.to_string(), source };
                    let mut fds = plan::FdArgs::default();
                    for f in crate::seccomp::memfds().map_err(memfd_err)? {
                        fds.seccomp.push(f.as_raw_fd());
                        inherit.push(f);
                    }
                    if let Some(user) = spec.user {
                        let view_dir = etc_view.as_deref().map(|v| v.dir.as_path());
                        let (passwd, group) = account_files(user, &spec.workspace, view_dir);
                        for (text, slot) in [(passwd, &mut fds.passwd), (group, &mut fds.group)] {
                            if let Some(text) = text {
                                let f = data_memfd(text.as_bytes()).map_err(memfd_err)?;
                                *slot = Some(f.as_raw_fd());
                                inherit.push(f);
                            }
                        }
                    }
                    let args = plan::bwrap_args(spec, &env, &RealFs, view, &fds)?;
                    let fd = args_memfd(id, &args)?;
                    let mut cmd = Command::new(bwrap);
                    cmd.arg("--args").arg(fd.as_raw_fd().to_string()).arg("--").args(&spec.argv);
                    // bwrap gets no environment at all: nothing of the job's acts on it.
                    cmd.env_clear();
                    inherit.push(fd);
                    cmd
                }
                None => {
                    let mut cmd = Command::new(&spec.argv[0]);
                    cmd.args(&spec.argv[1..]).env_clear().envs(&env).current_dir(&spec.workspace);
                    cmd
                }
            };
            cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
            child::install(
                &mut cmd,
                ChildSetup {
                    cgroup_procs: procs.iter().map(|f| f.as_raw_fd()).collect(),
                    inherit: inherit.iter().map(|f| f.as_raw_fd()).collect(),
                    netns: match &spec.network {
                        crate::Network::Namespace(fd) => Some(fd.as_raw_fd()),
                        _ => None,
                    },
                    user: spec.user.map(|u| (u.uid, u.gid)),
                    without_cgroup: cgroup.is_none().then_some(crate::child::WithoutCgroup {
                        // Counted per uid: only a job with a uid of its own gets one.
                        nproc: spec.user.and(spec.resources.pids).map(u64::from),
                    }),
                },
            );
            let program = bwrap.as_ref().map(|b| b.display().to_string()).unwrap_or_else(|| spec.argv[0].clone());
            let child =
                cmd.spawn().map_err(|source| SandboxError::Spawn { job_id: id.to_string(), program, source })?;
            // `procs` and `inherit` close here: the child has its own copies.
            Ok((child, etc_view))
        })();
        let (mut child, etc_view) = match result {
            Ok(c) => c,
            Err(e) => {
                if let Some(cg) = &cgroup {
                    let _ = cg.remove();
                }
                remove_private(&private_dev);
                return Err(e);
            }
        };
        let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
            unreachable!("stdout and stderr were set to piped")
        };
        let sandbox = Sandbox::running(spec, child, cgroup, private_dev, etc_view);
        tracing::debug!(job_id = id, pid = sandbox.pid, isolation = ?spec.isolation, cgroup = sandbox.cgroup.is_some(), "job started");
        Ok((sandbox, stdout, stderr))
    }

    /// The job of `spec`, started (cold, or from a warm start) as `child`.
    fn running(
        spec: &SandboxSpec,
        child: Child,
        cgroup: Option<JobCgroup>,
        private_dev: Option<std::path::PathBuf>,
        etc_view: Option<Arc<EtcView>>,
    ) -> Sandbox {
        let uid = spec.user.map_or_else(|| nix::unistd::geteuid().as_raw(), |u| u.uid);
        Sandbox {
            job_id: spec.job_id.clone(),
            pid: child.id().unwrap_or(0),
            child,
            by_marker: cgroup.is_none() || uid == 0,
            by_uid: cgroup.is_none() && spec.user.is_some(),
            uid,
            cgroup,
            private_dev,
            etc_view,
            exit: None,
            cleaned: false,
        }
    }

    /// Host pid of the job's main process (bwrap, under bubblewrap).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// Whether the job runs in its own cgroup (limits enforced, race-free tree kill).
    pub fn has_cgroup(&self) -> bool {
        self.cgroup.is_some()
    }

    /// Host pids of every live process of the job.
    pub fn pids(&self) -> Vec<i32> {
        match &self.cgroup {
            Some(cg) => cg.pids(),
            None => procscan::pids_with_marker(&self.job_id, self.uid),
        }
    }

    /// Waits for the main process to exit. Cancel-safe; later calls return the same result.
    /// Processes the job left behind may still run: see [`Sandbox::cleanup`].
    pub async fn wait(&mut self) -> Result<ExitInfo, SandboxError> {
        if let Some(e) = &self.exit {
            return Ok(e.clone());
        }
        let status = self.child.wait().await.map_err(|source| SandboxError::Wait {
            job_id: self.job_id.clone(),
            pid: self.pid,
            source,
        })?;
        let info = self.exit_info(status);
        self.exit = Some(info.clone());
        Ok(info)
    }

    fn exit_info(&self, status: ExitStatus) -> ExitInfo {
        let sigkill = status.signal() == Some(libc::SIGKILL) || status.code() == Some(128 + libc::SIGKILL);
        let cg = self.cgroup.as_ref();
        ExitInfo {
            code: status.code(),
            signal: status.signal(),
            oom_killed: cg.is_some_and(|c| c.oom_killed(sigkill)),
            pids_limit_hit: cg.is_some_and(|c| c.pids_limit_hit()),
            memory_peak: cg.and_then(|c| c.memory_peak()).map(Bytes),
            memory_limit: cg.and_then(|c| c.memory_limit()).map(Bytes),
        }
    }

    /// SIGKILLs every process of the job, daemonised and setsid'd ones included. Idempotent.
    pub fn kill_tree(&mut self) -> Result<(), SandboxError> {
        if let Some(cg) = &self.cgroup {
            cg.kill_all()?;
        }
        // The process group and the main process, only while it is unreaped: after that its pid
        // (and so the group id) could belong to someone else.
        if let Ok(None) = self.child.try_wait() {
            let pid = self.pid as i32;
            let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        if self.by_marker {
            kill_marked(&self.job_id, self.uid)?;
        }
        Ok(())
    }

    /// Makes sure no process of the job is left anywhere on the host, then removes its cgroup.
    /// Call after [`Sandbox::wait`] (or to end a job early: it kills first).
    pub async fn cleanup(mut self) -> Result<(), SandboxError> {
        self.cleaned = true;
        self.kill_tree()?;
        let _ = self.child.wait().await;
        let start = Instant::now();
        loop {
            // With a cgroup the marker scan runs only for a root job under `Isolation::None`,
            // which could have moved itself out (see `by_marker`).
            let mut left = self.cgroup.as_ref().map(|c| c.pids()).unwrap_or_default();
            if self.by_marker {
                left.extend(procscan::pids_with_marker(&self.job_id, self.uid));
            }
            if self.by_uid {
                left.extend(procscan::pids_of_uid(self.uid));
                left.sort_unstable();
                left.dedup();
            }
            if left.is_empty() {
                break;
            }
            if start.elapsed() > CLEANUP_DEADLINE {
                return Err(SandboxError::Leftover {
                    job_id: self.job_id.clone(),
                    pids: left,
                    waited: start.elapsed(),
                });
            }
            if let Some(cg) = &self.cgroup {
                cg.kill_all()?;
            }
            if self.by_marker {
                kill_marked(&self.job_id, self.uid)?;
            }
            if self.by_uid {
                for pid in procscan::pids_of_uid(self.uid) {
                    match kill(Pid::from_raw(pid), Signal::SIGKILL) {
                        Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                        Err(source) => return Err(SandboxError::Kill { job_id: self.job_id.clone(), pid, source }),
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if let Some(dir) = self.private_dev.take() {
            let _ = fs::remove_dir_all(dir);
        }
        if let Some(cg) = &self.cgroup {
            // A just-killed task can keep the cgroup busy for a moment after it left the procs list.
            let mut tries = 0;
            loop {
                match cg.remove() {
                    Ok(()) => break,
                    Err(e) if tries < 200 => {
                        tries += 1;
                        tracing::trace!(error = %e, "cgroup not removable yet");
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if !self.cleaned {
            tracing::warn!(job_id = %self.job_id, "sandbox dropped without cleanup; killing its processes");
            let _ = self.kill_tree();
        }
    }
}

fn kill_marked(job_id: &str, uid: u32) -> Result<(), SandboxError> {
    for pid in procscan::pids_with_marker(job_id, uid) {
        match kill(Pid::from_raw(pid), Signal::SIGKILL) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(source) => return Err(SandboxError::Kill { job_id: job_id.to_string(), pid, source }),
        }
    }
    Ok(())
}

fn create_cgroup(spec: &SandboxSpec) -> Result<Option<JobCgroup>, SandboxError> {
    let id = &spec.job_id;
    if spec.cgroups == CgroupUse::Disabled {
        return Ok(None);
    }
    let usable = cgroup::layout().filter(|l| l.writable());
    let Some(layout) = usable else {
        if spec.cgroups == CgroupUse::Required {
            return Err(SandboxError::CgroupUnavailable {
                job_id: id.clone(),
                reason: "no writable cgroup v1 or v2 hierarchy with memory/pids controllers".to_string(),
            });
        }
        let r = &spec.resources;
        if r.memory.is_some() || r.pids.is_some() || r.cpu_millis.is_some() {
            tracing::warn!(job_id = %id, "cgroups are not usable: memory, pids and cpu limits are NOT enforced");
        }
        return Ok(None);
    };
    let deny = non_leased_gpu_nodes(&spec.gpu_devices, &RealFs);
    JobCgroup::create(layout, id, &spec.resources, &deny).map(Some)
}

/// (major, minor) of every host `/dev/nvidiaN` that is not leased: the devices cgroup denies them.
pub(crate) fn non_leased_gpu_nodes(leased: &[std::path::PathBuf], host: &dyn HostFs) -> Vec<(u64, u64)> {
    let leased: Vec<Kind> = leased.iter().map(|p| host.kind_follow(p)).collect();
    let Ok(rd) = fs::read_dir("/dev") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name();
        let n = name.as_bytes();
        if n.len() > 6 && n.starts_with(b"nvidia") && n[6..].iter().all(u8::is_ascii_digit) {
            if let k @ Kind::CharDev(major, minor) = host.kind_follow(&Path::new("/dev").join(&name)) {
                if !leased.contains(&k) {
                    out.push((major, minor));
                }
            }
        }
    }
    out
}

/// bwrap's arguments in a sealed-off memfd (NUL-separated), read by `--args FD`.
fn args_memfd(job_id: &str, args: &[std::ffi::OsString]) -> Result<File, SandboxError> {
    let err = |source| SandboxError::ArgsFd { job_id: job_id.to_string(), source };
    let mut f = crate::host::sealable_memfd(c"gpuci-bwrap-args").map_err(err)?;
    f.write_all(&plan::nul_joined(args)).map_err(err)?;
    f.rewind().map_err(err)?;
    crate::host::seal(&f).map_err(err)?;
    Ok(f)
}

/// Where jobs' private device nodes are made: on devtmpfs, the filesystem made for device
/// nodes. Not beside the workspace: a job's disk is mounted `nodev` (and the workspaces'
/// filesystem often is), and a node there cannot be opened — CUDA then finds no GPU.
pub const PRIVATE_DEV_ROOT: &str = "/dev/gpuci";

/// The job's own copies of its GPU device nodes: same device numbers, owner the job user, mode
/// 0600, in `/dev/gpuci/<job id>/` (0700, the job user's). So the GPU is
/// accessible to that uid for the lease only, whatever the host node's mode (0666 on most
/// NVIDIA hosts, 0660 root:video on some), and no host node's owner or mode is ever changed.
/// The devices cgroup still denies every GPU that is not leased.
fn private_devices(
    spec: &SandboxSpec,
    user: crate::JobUser,
) -> Result<(std::path::PathBuf, Vec<std::path::PathBuf>, Vec<std::path::PathBuf>), SandboxError> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    use std::os::unix::fs::{chown, DirBuilderExt};
    let id = &spec.job_id;
    let root = Path::new(PRIVATE_DEV_ROOT);
    let dir = root.join(id);
    let dev_err =
        |path: &Path, reason: String| SandboxError::Device { job_id: id.clone(), path: path.to_path_buf(), reason };
    fs::DirBuilder::new().mode(0o711).recursive(true).create(root).map_err(|e| dev_err(root, format!("mkdir: {e}")))?;
    match nix::sys::statvfs::statvfs(root) {
        Ok(v) if v.flags().contains(nix::sys::statvfs::FsFlags::ST_NODEV) => {
            return Err(dev_err(root, "is on a filesystem mounted nodev: device nodes there cannot be opened".into()))
        }
        Ok(_) => {}
        Err(e) => return Err(dev_err(root, format!("statvfs: {e}"))),
    }
    let _ = fs::remove_dir_all(&dir);
    fs::DirBuilder::new().mode(0o700).create(&dir).map_err(|e| dev_err(&dir, format!("mkdir: {e}")))?;
    chown(&dir, Some(user.uid), Some(user.gid)).map_err(|e| dev_err(&dir, format!("chown: {e}")))?;
    let copy = |nodes: &[std::path::PathBuf], required: bool| -> Result<Vec<std::path::PathBuf>, SandboxError> {
        let mut out = Vec::new();
        for node in nodes {
            let (major, minor) = match RealFs.kind_follow(node) {
                Kind::CharDev(major, minor) => (major, minor),
                Kind::Missing if !required => continue,
                _ => return Err(dev_err(node, "not a character device".into())),
            };
            let name = node.file_name().ok_or_else(|| dev_err(node, "no file name".into()))?;
            let private = dir.join(name);
            mknod(&private, SFlag::S_IFCHR, Mode::from_bits_truncate(0o600), makedev(major, minor))
                .map_err(|e| dev_err(&private, format!("mknod: {e}")))?;
            chown(&private, Some(user.uid), Some(user.gid)).map_err(|e| dev_err(&private, format!("chown: {e}")))?;
            out.push(private);
        }
        Ok(out)
    };
    let result = copy(&spec.gpu_devices, true).and_then(|l| Ok((l, copy(&spec.gpu_common_devices, false)?)));
    match result {
        Ok((leased, common)) => Ok((dir, leased, common)),
        Err(e) => {
            let _ = fs::remove_dir_all(&dir);
            Err(e)
        }
    }
}

/// `/etc/passwd` and `/etc/group` as the job sees them: the host's (or the view's) plus an
/// entry `gpuci-job` for the job's uid/gid when the host has none, home = the workspace.
pub(crate) fn account_files(
    user: crate::JobUser,
    workspace: &Path,
    view: Option<&Path>,
) -> (Option<String>, Option<String>) {
    let read = |name: &str| {
        view.and_then(|v| fs::read_to_string(v.join(name)).ok())
            .or_else(|| fs::read_to_string(Path::new("/etc").join(name)).ok())
    };
    let has_id = |text: &str, id: u32| text.lines().any(|l| l.split(':').nth(2) == Some(id.to_string().as_str()));
    let passwd = read("passwd").filter(|t| !has_id(t, user.uid)).map(|mut t| {
        if !t.is_empty() && !t.ends_with('\n') {
            t.push('\n');
        }
        t.push_str(&format!("gpuci-job:x:{}:{}:gpuci job:{}:/bin/sh\n", user.uid, user.gid, workspace.display()));
        t
    });
    let group = read("group").filter(|t| !has_id(t, user.gid)).map(|mut t| {
        if !t.is_empty() && !t.ends_with('\n') {
            t.push('\n');
        }
        t.push_str(&format!("gpuci-job:x:{}:\n", user.gid));
        t
    });
    (passwd, group)
}

fn data_memfd(data: &[u8]) -> std::io::Result<File> {
    let mut f = crate::host::sealable_memfd(c"gpuci-bwrap-data")?;
    f.write_all(data)?;
    f.rewind()?;
    crate::host::seal(&f)?;
    Ok(f)
}
