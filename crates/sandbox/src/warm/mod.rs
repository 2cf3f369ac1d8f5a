//! Jobs started ahead of time: for an idle slot, processes that already sit in a fresh cgroup,
//! in the slot's network namespace, as the slot's uid, and wait for the slot's next job.
//!
//! Why: on cgroup v1 (and v2 without `favordynmods`) the first write into a `cgroup.procs` file
//! after an idle moment waits for an RCU grace period, 12–16 ms on a 2-core VM, and bubblewrap's
//! own set-up (namespaces, ~20 mounts, the seccomp filter) takes another 5 ms or so: together
//! most of a job's start (BENCHMARKS.md). A warm start pays both while the slot is idle.
//!
//! A [`WarmStart`] holds up to two waiting processes, each in a cgroup of its own, forked by the
//! spawner thread (`spawner.rs`) through the same pre-exec steps as a cold start (`child.rs`:
//! own session, into the cgroups, into the network namespace, every privilege dropped):
//!
//! - **the waiting shell**: `/bin/sh -s` on the host side, reading its commands from a pipe.
//!   It fits any bubblewrap job of the slot's user and network. When the job comes, the agent
//!   writes the job's limits into the cgroup, bwrap's arguments (the job's environment included)
//!   into a memfd the process already holds, and then one command into the pipe:
//!   `{ exec bwrap --args FD -- ARGV... </dev/null; }`, every word single-quoted. The job starts
//!   as a cold start would, minus the fork, the cgroup migration and the privilege drop.
//! - **the ready sandbox** (when [`WarmSpec::ready`] describes the slot's usual job: no GPU, the
//!   default limits, the slot's network): bubblewrap itself, already started with exactly the
//!   arguments a cold start of such a job would get, less the environment, running `/bin/sh -s`
//!   *inside* the sandbox on the same kind of pipe. Its workspace is made for it, empty, and the
//!   agent fills that workspace for the job. When the job comes and its bwrap arguments (without
//!   the environment) and passwd/group files are byte for byte the ones the sandbox was started
//!   with, the agent writes the limits into its cgroup and one command into the pipe:
//!   `{ export NAME='value'...; exec /usr/bin/env -u PWD... -- ARGV... </dev/null; }`. The
//!   values travel through the pipe and the shell's own memory, never through an argument
//!   vector: `/proc/PID/cmdline` is readable by every local user (and what `ps`, auditd and
//!   monitoring agents record), while `/proc/PID/environ` is the process owner's alone. (An
//!   earlier `env -i -- 'NAME=value'...` put every secret of the job on `env`'s command line
//!   until it exec'd the job; another local user read them, an outsider found.) `export` only
//!   takes names a shell has no use of its own for: a name that is not a plain identifier, or
//!   one a shell treats specially (dash's `OPTIND` must be a number, bash's `UID` is
//!   read-only, `PWD`, `IFS`, ... see [`shell_safe_name`]) makes the ready sandbox a misfit, and
//!   such a job starts from the waiting shell, whose environment goes through bwrap's `--args`
//!   memfd like a cold start's. `env -u` then drops what the shell itself adds (`PWD`, bash's
//!   `SHLVL`, busybox's default `PATH`) unless the job set it, and `env` looks the command up
//!   on the job's `PATH` as bwrap's `execvp` does. Anything else (a GPU, another memory limit,
//!   a hidden path added, a changed `/etc`) uses the waiting shell instead.
//!
//! The job takes one; the other is killed before the job's command is written. The shell parses
//! a whole `{ ...; }` block before it runs any of it, so a command cut short (the agent failed
//! half way) is a syntax error, never a shorter argv or a partial environment.
//!
//! What it must never do:
//! - exist next to a job of its uid: the agent prepares one only for an idle slot (nothing of the
//!   uid may run, checked) and the slot's next job takes it (and runs it, or discards it before
//!   running anything);
//! - run anything the agent did not write: the pipes' write ends and the memfds' agent copies
//!   never leave the agent (O_CLOEXEC), and the processes have no environment;
//! - hold anything of a job before the job comes: the ready sandbox's workspace is empty and its
//!   environment is empty until the hand-over;
//! - outlive the agent: when the agent dies the pipes' write ends close, each shell reads an
//!   empty script and exits (bwrap's `--die-with-parent` and the parent-death signal take the
//!   rest), and the agent's start-up sweep removes the cgroups.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::{Seek, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::process::{Child, ChildStderr, ChildStdout, Command};

use crate::cgroup::{self, JobCgroup};
use crate::child::{self, ChildSetup};
use crate::etcview::EtcView;
use crate::{find_program, validate_job_id, CgroupUse, Isolation, JobUser, Network, SandboxError, SandboxSpec};

/// The waiting program. Always the host's: nothing of a job exists yet when it starts.
const STUB: &str = "/bin/sh";
/// How long the agent waits for a waiting shell to take its command.
const HANDOVER: Duration = Duration::from_secs(2);

/// What a warm start is made for: one slot's identity.
#[derive(Clone, Debug)]
pub struct WarmSpec {
    /// Names its cgroup (`[A-Za-z0-9._-]`); should start with the agent's sweep prefix so a
    /// crashed agent's leftovers are found.
    pub name: String,
    pub user: JobUser,
    /// The slot's network namespace; `None`: the agent's own (then only jobs with no network,
    /// or the host's, fit).
    pub network: Option<Arc<OwnedFd>>,
    pub cgroups: CgroupUse,
    /// Where it gets no cgroup (a container that gives none): the process limit of the job it
    /// waits for, set now as `RLIMIT_NPROC` (it cannot be set later); only a job with exactly
    /// that limit fits it. The agent gives its default job limit.
    pub nproc: Option<u64>,
    /// Also start the sandbox itself for a job laid out like this one (see the module header).
    pub ready: Option<ReadySpec>,
}

/// The job a ready sandbox is started for.
#[derive(Clone, Debug)]
pub struct ReadySpec {
    /// Names its cgroup, as [`WarmSpec::name`] does; must differ from it.
    pub name: String,
    /// The job's sandbox as it will be, less its `argv` and `env` (ignored here). Its
    /// `workspace` must not exist yet: it is made, empty, owned by the job user, and from then
    /// on belongs to the caller ([`WarmStart::take_workspace`]); a warm start discarded before
    /// that removes it again. `user`, `network` and `cgroups` must be the warm start's.
    pub sandbox: SandboxSpec,
}

/// Processes waiting for the slot's next job. Hand it to [`crate::Sandbox::spawn_warm`], or
/// [`WarmStart::discard`] it.
#[derive(Debug)]
pub struct WarmStart {
    shell: Waiter,
    ready: Option<Ready>,
}

/// One waiting process.
#[derive(Debug)]
struct Waiter {
    name: String,
    user: JobUser,
    /// (st_dev, st_ino) of the network namespace it joined.
    netns: Option<(u64, u64)>,
    child: Child,
    stdout: ChildStdout,
    stderr: ChildStderr,
    /// The write end of the pipe the shell reads its command from (its stdin).
    control: OwnedFd,
    /// bwrap's inputs: filled at hand-over for the waiting shell, before the fork for a ready
    /// sandbox (which has read them by the time its shell waits).
    args: File,
    passwd: File,
    group: File,
    seccomp: Vec<File>,
    cgroup: Option<JobCgroup>,
    /// Without a cgroup: the `RLIMIT_NPROC` it was started with.
    nproc: Option<u64>,
    bwrap: PathBuf,
}

/// A started sandbox waiting for its job's command, and what it was started with.
#[derive(Debug)]
struct Ready {
    waiter: Waiter,
    /// bwrap's arguments, without any environment.
    args: Vec<OsString>,
    passwd: String,
    group: String,
    fds: crate::plan::FdArgs,
    /// `env`, the host's, which the sandbox shows at the same path (under `/usr`).
    env_program: PathBuf,
    etc_view: Option<Arc<EtcView>>,
    /// Its workspace while nobody has taken it: removed (if still empty) on discard.
    workspace: Option<PathBuf>,
}

/// What a warm start becomes: the parts [`crate::Sandbox`] is made of.
pub(crate) struct Started {
    pub(crate) child: Child,
    pub(crate) stdout: ChildStdout,
    pub(crate) stderr: ChildStderr,
    pub(crate) cgroup: Option<JobCgroup>,
    pub(crate) etc_view: Option<Arc<EtcView>>,
}

impl WarmStart {
    /// Starts the waiting processes (on the spawner thread: they must outlive the caller).
    /// Needs a root agent, a job user and bubblewrap. Blocks nothing of the caller's runtime.
    /// A ready sandbox that cannot be made is left out, with a warning: the shell still fits.
    pub async fn prepare(spec: WarmSpec) -> Result<WarmStart, SandboxError> {
        let name = spec.name.clone();
        crate::spawner::run(move || prepare_now(spec)).await.unwrap_or_else(|| {
            Err(SandboxError::Spawn {
                job_id: name,
                program: STUB.to_string(),
                source: std::io::Error::other("the spawner thread is not available"),
            })
        })
    }

    /// Host pid of the waiting shell.
    pub fn pid(&self) -> Option<u32> {
        self.shell.child.id()
    }

    /// Host pid of the ready sandbox (its bwrap), when there is one.
    pub fn ready_pid(&self) -> Option<u32> {
        self.ready.as_ref().and_then(|r| r.waiter.child.id())
    }

    /// The ready sandbox's workspace, now the caller's: the job that takes this warm start must
    /// use it as its workspace to start in the ready sandbox, and removes it when done. `None`:
    /// there is no ready sandbox, or the workspace was taken already.
    pub fn take_workspace(&mut self) -> Option<PathBuf> {
        self.ready.as_mut().and_then(|r| r.workspace.take())
    }

    /// Hands the job to the ready sandbox when it is exactly the job's, else to the waiting
    /// shell when that fits; `None`: neither did (the job starts cold). Whatever the job does
    /// not use is killed before the job's command is written, and removed in the background.
    pub(crate) fn start(self, spec: &SandboxSpec, env: &BTreeMap<String, String>) -> Option<Started> {
        let WarmStart { shell, ready } = self;
        let id = spec.job_id.as_str();
        if let Some(ready) = ready {
            match ready.misfit(spec, env) {
                None => {
                    // Nothing of the job's may reach the pipe while another process of its uid
                    // waits: the shell is killed first (and so, should the hand-over fail, the
                    // job starts cold).
                    shell.discard_soon();
                    return match ready.start(spec, env) {
                        Ok(started) => {
                            tracing::debug!(job_id = id, "job started in a ready sandbox");
                            Some(started)
                        }
                        Err(failed) => {
                            let (e, ready) = *failed;
                            tracing::warn!(job_id = id, error = %e, "the ready sandbox failed; starting the job cold");
                            ready.discard_soon();
                            None
                        }
                    };
                }
                Some(why) => {
                    tracing::debug!(job_id = id, why, "the ready sandbox does not fit this job");
                    ready.discard_soon();
                }
            }
        }
        if let Some(why) = shell.misfit(spec) {
            tracing::debug!(job_id = id, why, "the warm start does not fit this job; starting it cold");
            shell.discard_soon();
            return None;
        }
        match shell.start(spec, env) {
            Ok(started) => {
                tracing::debug!(job_id = id, "job started from a warm start");
                Some(started)
            }
            Err(failed) => {
                let (e, shell) = *failed;
                tracing::warn!(job_id = id, error = %e, "the warm start failed; starting the job cold");
                shell.discard_soon();
                None
            }
        }
    }

    /// Ends the waiting processes and removes their cgroups, and the ready sandbox's workspace
    /// unless it was taken.
    pub async fn discard(self) {
        if let Some(ready) = self.ready {
            ready.discard().await;
        }
        self.shell.discard().await;
    }
}

impl Ready {
    /// Why this sandbox is not exactly the one a cold start of `spec` would make, if it is not.
    fn misfit(&self, spec: &SandboxSpec, env: &BTreeMap<String, String>) -> Option<&'static str> {
        if let Some(why) = self.waiter.misfit(spec) {
            return Some(why);
        }
        if !env.keys().all(|k| shell_safe_name(k)) {
            return Some("the job's environment has a name a shell would not export as given");
        }
        if self.workspace.is_some() {
            return Some("the job does not use the ready sandbox's workspace");
        }
        // `env` takes a first word with `=` for one more variable.
        if spec.argv.first().is_none_or(|a| a.contains('=')) {
            return Some("the job's command name contains `=`");
        }
        let view = crate::etcview::current();
        let view_dir = view.as_deref().map(|v| v.dir.as_path());
        let plan = view.as_deref().map(|v| crate::plan::EtcPlan { dir: &v.dir, binds: &v.binds });
        let Ok(args) = crate::plan::bwrap_args(spec, &BTreeMap::new(), &crate::plan::RealFs, plan, &self.fds) else {
            return Some("the job's mount plan cannot be made");
        };
        if args != self.args {
            return Some("the job's sandbox differs from the ready one");
        }
        let Some(user) = spec.user else { return Some("the job has no job user") };
        match crate::sandbox::account_files(user, &spec.workspace, view_dir) {
            (Some(p), Some(g)) if p == self.passwd && g == self.group => None,
            _ => Some("the job's passwd or group differs from the ready sandbox's"),
        }
    }

    fn start(
        mut self,
        spec: &SandboxSpec,
        env: &BTreeMap<String, String>,
    ) -> Result<Started, Box<(SandboxError, Ready)>> {
        let id = spec.job_id.clone();
        if let Err(e) = self.waiter.alive_with_limits(spec) {
            return Err(Box::new((e, self)));
        }
        let command = ready_command(&self.env_program, env, &spec.argv);
        if let Err(source) = hand_over(&self.waiter.control, &command) {
            let e = SandboxError::Spawn { job_id: id, program: STUB.to_string(), source };
            return Err(Box::new((e, self)));
        }
        let Ready { waiter, etc_view, .. } = self;
        let Waiter { child, stdout, stderr, cgroup, control, .. } = waiter;
        drop(control);
        Ok(Started { child, stdout, stderr, cgroup, etc_view })
    }

    fn discard_soon(mut self) {
        let _ = self.waiter.child_kill();
        tokio::spawn(self.discard());
    }

    async fn discard(self) {
        let Ready { waiter, workspace, .. } = self;
        waiter.discard().await;
        // Never recursive: only the empty directory this warm start made.
        if let Some(ws) = workspace {
            if let Err(e) = std::fs::remove_dir(&ws) {
                tracing::warn!(workspace = %ws.display(), error = %e, "could not remove a ready sandbox's workspace");
            }
        }
    }
}

impl Waiter {
    /// Why `spec` cannot start from this process, if it cannot.
    fn misfit(&self, spec: &SandboxSpec) -> Option<&'static str> {
        if spec.isolation != Isolation::Bubblewrap {
            return Some("the job runs without bubblewrap");
        }
        if spec.user != Some(self.user) {
            return Some("the job runs as another user");
        }
        match (&spec.network, self.netns) {
            (Network::None, _) | (Network::Host, None) => {}
            (Network::Namespace(fd), Some(ns)) if ns_id(fd) == Some(ns) => {}
            _ => return Some("the job uses another network namespace"),
        }
        match (spec.cgroups, &self.cgroup) {
            (CgroupUse::Disabled, Some(_)) => Some("the job runs without cgroups"),
            (CgroupUse::Required, None) => Some("the job needs cgroups"),
            // Without a cgroup the process limit is an rlimit, set before the first exec.
            (_, None) if spec.resources.pids.map(u64::from) != self.nproc => {
                Some("the job's process limit is not the one this process was started with")
            }
            _ => None,
        }
    }

    /// Still waiting, with the job's limits written into its cgroup.
    fn alive_with_limits(&mut self, spec: &SandboxSpec) -> Result<(), SandboxError> {
        match self.child.try_wait() {
            Ok(None) => {}
            _ => {
                return Err(SandboxError::Spawn {
                    job_id: spec.job_id.clone(),
                    program: STUB.to_string(),
                    source: std::io::Error::other("the waiting process has ended"),
                })
            }
        }
        if let Some(cg) = &mut self.cgroup {
            let deny = crate::sandbox::non_leased_gpu_nodes(&spec.gpu_devices, &crate::plan::RealFs);
            cg.apply(&spec.resources, &deny)?;
        }
        Ok(())
    }

    /// Hands the job to the waiting shell. On an error before the shell took its command the
    /// waiter comes back, to be discarded; the job can then still start cold.
    fn start(
        mut self,
        spec: &SandboxSpec,
        env: &BTreeMap<String, String>,
    ) -> Result<Started, Box<(SandboxError, Waiter)>> {
        let id = spec.job_id.clone();
        let fd_err = |source| SandboxError::ArgsFd { job_id: id.clone(), source };
        if let Err(e) = self.alive_with_limits(spec) {
            return Err(Box::new((e, self)));
        }
        let etc_view = crate::etcview::current();
        let view = etc_view.as_deref().map(|v| crate::plan::EtcPlan { dir: &v.dir, binds: &v.binds });
        let mut fds =
            crate::plan::FdArgs { seccomp: self.seccomp.iter().map(|f| f.as_raw_fd()).collect(), ..Default::default() };
        let view_dir = etc_view.as_deref().map(|v| v.dir.as_path());
        let (passwd, group) = crate::sandbox::account_files(self.user, &spec.workspace, view_dir);
        // Both memfds are the job's passwd and group, or the job starts cold: one left unread
        // would stay open in the job (the shell cannot close descriptors above 9).
        let (Some(passwd), Some(group)) = (passwd, group) else {
            let e = fd_err(std::io::Error::other("the host's passwd or group already names the job's ids"));
            return Err(Box::new((e, self)));
        };
        let filled = fill(&mut self.passwd, passwd.as_bytes()).and_then(|()| fill(&mut self.group, group.as_bytes()));
        if let Err(e) = filled {
            return Err(Box::new((fd_err(e), self)));
        }
        fds.passwd = Some(self.passwd.as_raw_fd());
        fds.group = Some(self.group.as_raw_fd());
        let args = match crate::plan::bwrap_args(spec, env, &crate::plan::RealFs, view, &fds) {
            Ok(a) => a,
            Err(e) => return Err(Box::new((e, self))),
        };
        if let Err(e) = fill(&mut self.args, &crate::plan::nul_joined(&args)) {
            return Err(Box::new((fd_err(e), self)));
        }
        let command = command_line(&self.bwrap, self.args.as_raw_fd(), &spec.argv);
        if let Err(source) = hand_over(&self.control, &command) {
            let e = SandboxError::Spawn { job_id: id, program: STUB.to_string(), source };
            return Err(Box::new((e, self)));
        }
        let Waiter { child, stdout, stderr, cgroup, control, .. } = self;
        // The shell reads to the end of its block; closing tells it there is nothing after.
        drop(control);
        Ok(Started { child, stdout, stderr, cgroup, etc_view })
    }

    /// SIGKILL to the process and, with a cgroup, to everything in it (a ready sandbox's init
    /// and shell die with their bwrap only when the parent-death signal comes round).
    fn child_kill(&mut self) -> std::io::Result<()> {
        if let Some(cg) = &self.cgroup {
            let _ = cg.kill_all();
        }
        self.child.start_kill()
    }

    /// Killed now (nothing of the job may wait beside it), removed in the background.
    fn discard_soon(mut self) {
        let _ = self.child_kill();
        tokio::spawn(self.discard());
    }

    /// Ends the waiting process and removes its cgroup.
    async fn discard(mut self) {
        let _ = self.child_kill();
        let _ = self.child.wait().await;
        if let Some(cg) = &self.cgroup {
            for _ in 0..200 {
                if cg.remove().is_ok() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tracing::warn!(name = %self.name, "could not remove a warm start's cgroup; the next start-up sweep will");
        }
    }
}

fn prepare_now(spec: WarmSpec) -> Result<WarmStart, SandboxError> {
    let id = spec.name.as_str();
    validate_job_id(id)?;
    let invalid = |reason: &str| SandboxError::InvalidSpec { job_id: id.to_string(), reason: reason.to_string() };
    if !nix::unistd::geteuid().is_root() {
        return Err(invalid("a warm start needs a root agent"));
    }
    if spec.user.uid == 0 || spec.user.gid == 0 {
        return Err(invalid("the job user must not be root"));
    }
    // The invariant that makes a waiting process safe: nothing else runs as its uid (a job
    // that outlived its cleanup could trace it, and read the next job's secrets from it).
    let others = crate::procscan::pids_of_uid(spec.user.uid);
    if !others.is_empty() {
        return Err(invalid(&format!("processes of uid {} are still running: {others:?}", spec.user.uid)));
    }
    let bwrap = find_program("bwrap").ok_or_else(|| SandboxError::BubblewrapMissing { job_id: id.to_string() })?;
    let shell = spawn_waiter(&spec, &spec.name, &bwrap, None)?;
    let ready = match &spec.ready {
        None => None,
        Some(r) => match prepare_ready(&spec, r, &bwrap) {
            Ok(ready) => Some(ready),
            Err(e) => {
                tracing::warn!(name = %r.name, error = %e, "could not start a ready sandbox; the slot's next job starts from the waiting shell");
                None
            }
        },
    };
    Ok(WarmStart { shell, ready })
}

/// The ready sandbox: its workspace made, bwrap's inputs written, bwrap started on `/bin/sh -s`.
fn prepare_ready(spec: &WarmSpec, ready: &ReadySpec, bwrap: &Path) -> Result<Ready, SandboxError> {
    let sb = &ready.sandbox;
    validate_job_id(&ready.name)?;
    let invalid = |reason: &str| SandboxError::InvalidSpec { job_id: ready.name.clone(), reason: reason.to_string() };
    if ready.name == spec.name {
        return Err(invalid("the ready sandbox needs a name of its own"));
    }
    if sb.isolation != Isolation::Bubblewrap || sb.user != Some(spec.user) || sb.cgroups != spec.cgroups {
        return Err(invalid("the ready sandbox's user, isolation and cgroups must be the warm start's"));
    }
    let same_network = match (&sb.network, &spec.network) {
        (Network::Namespace(a), Some(b)) => ns_id(a).is_some() && ns_id(a) == ns_id(b),
        (Network::None, _) | (Network::Host, None) => true,
        _ => false,
    };
    if !same_network {
        return Err(invalid("the ready sandbox's network must be the warm start's"));
    }
    if !sb.gpu_devices.is_empty() {
        return Err(invalid("a ready sandbox has no GPU (its nodes are the lease's)"));
    }
    let env_program = find_program("env")
        .filter(|p| crate::plan::SYSTEM_DIRS.iter().any(|d| p.starts_with(d)))
        .ok_or_else(|| invalid("no `env` program under the system directories the sandbox shows"))?;
    let ws = &sb.workspace;
    let ws_err = |reason: String| SandboxError::Workspace { job_id: ready.name.clone(), path: ws.clone(), reason };
    if !ws.is_absolute() {
        return Err(ws_err("not an absolute path".into()));
    }
    // Made here, so nothing but the agent has ever written it.
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
        .create(ws)
        .and_then(|()| std::os::unix::fs::chown(ws, Some(spec.user.uid), Some(spec.user.gid)))
        .map_err(|e| ws_err(format!("making the ready sandbox's workspace: {e}")))?;
    let made = (|| {
        let etc_view = crate::etcview::current();
        let view_dir = etc_view.as_deref().map(|v| v.dir.as_path());
        let (Some(passwd), Some(group)) = crate::sandbox::account_files(spec.user, ws, view_dir) else {
            return Err(invalid("the host's passwd or group already names the job's ids"));
        };
        let fd_err = |source| SandboxError::ArgsFd { job_id: ready.name.clone(), source };
        let mut memfds = Memfds::new().map_err(fd_err)?;
        fill(&mut memfds.passwd, passwd.as_bytes()).map_err(fd_err)?;
        fill(&mut memfds.group, group.as_bytes()).map_err(fd_err)?;
        let fds = crate::plan::FdArgs {
            seccomp: memfds.seccomp.iter().map(|f| f.as_raw_fd()).collect(),
            passwd: Some(memfds.passwd.as_raw_fd()),
            group: Some(memfds.group.as_raw_fd()),
        };
        let view = etc_view.as_deref().map(|v| crate::plan::EtcPlan { dir: &v.dir, binds: &v.binds });
        let args = crate::plan::bwrap_args(sb, &BTreeMap::new(), &crate::plan::RealFs, view, &fds)?;
        fill(&mut memfds.args, &crate::plan::nul_joined(&args)).map_err(fd_err)?;
        let waiter = spawn_waiter(spec, &ready.name, bwrap, Some(memfds))?;
        Ok(Ready { waiter, args, passwd, group, fds, env_program, etc_view, workspace: Some(ws.clone()) })
    })();
    if made.is_err() {
        let _ = std::fs::remove_dir(ws);
    }
    made
}

/// bwrap's input memfds: its arguments, passwd, group, the seccomp programs.
struct Memfds {
    args: File,
    passwd: File,
    group: File,
    seccomp: Vec<File>,
}

impl Memfds {
    fn new() -> std::io::Result<Memfds> {
        Ok(Memfds {
            args: memfd(c"gpuci-bwrap-args")?,
            passwd: memfd(c"gpuci-bwrap-data")?,
            group: memfd(c"gpuci-bwrap-data")?,
            seccomp: crate::seccomp::memfds()?,
        })
    }
}

/// Forks a waiting process named `name` into a fresh cgroup: the shell (`sandbox: None`), or
/// bwrap with its filled `sandbox` inputs running `/bin/sh -s` inside. Another agent's
/// start-up sweep removes empty warm-start cgroups, which this one is for a moment between its
/// mkdir and the child's write into it: then the parent's open or the child's write fails with
/// ENODEV or ENOENT, and a fresh cgroup is made.
fn spawn_waiter(spec: &WarmSpec, name: &str, bwrap: &Path, sandbox: Option<Memfds>) -> Result<Waiter, SandboxError> {
    let mut memfds = sandbox;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let cgroup = match spec.cgroups {
            CgroupUse::Disabled => None,
            use_ => match cgroup::layout().filter(|l| l.writable()) {
                Some(layout) => Some(JobCgroup::create_unlimited(layout, name)?),
                None if use_ == CgroupUse::Required => {
                    return Err(SandboxError::CgroupUnavailable {
                        job_id: name.to_string(),
                        reason: "no writable cgroup v1 or v2 hierarchy with memory/pids controllers".to_string(),
                    })
                }
                None => None,
            },
        };
        match spawn_stub(spec, name, bwrap, cgroup, memfds.take()) {
            Ok(w) => return Ok(w),
            Err(failed) => {
                let (e, cgroup, back) = *failed;
                memfds = back;
                if let Some(cg) = cgroup {
                    let _ = cg.remove();
                }
                // Gone before the child's write (spawn fails) or before the parent opened its
                // `cgroup.procs` (seen in CI when another agent started at that moment).
                let vanished = matches!(&e, SandboxError::Spawn { source, .. } | SandboxError::Cgroup { source, .. }
                    if matches!(source.raw_os_error(), Some(libc::ENODEV) | Some(libc::ENOENT)));
                if !(vanished && attempts < 3) {
                    return Err(e);
                }
            }
        }
    }
}

type StubFailure = Box<(SandboxError, Option<JobCgroup>, Option<Memfds>)>;

fn spawn_stub(
    spec: &WarmSpec,
    name: &str,
    bwrap: &Path,
    cgroup: Option<JobCgroup>,
    sandbox: Option<Memfds>,
) -> Result<Waiter, StubFailure> {
    let id = name.to_string();
    let fd_err = |source: std::io::Error| SandboxError::ArgsFd { job_id: id.clone(), source };
    let in_sandbox = sandbox.is_some();
    // Given back on failure, so a retry reuses the filled memfds.
    let mut sandbox = sandbox;
    macro_rules! tri {
        ($e:expr) => {
            match $e {
                Ok(v) => v,
                Err(e) => return Err(Box::new((e, cgroup, sandbox))),
            }
        };
    }
    let procs: Vec<File> = tri!(cgroup
        .iter()
        .flat_map(|c| c.procs_files())
        .map(|p| {
            std::fs::OpenOptions::new().write(true).open(&p).map_err(|source| SandboxError::Cgroup {
                job_id: id.clone(),
                op: "open".to_string(),
                path: p.clone(),
                source,
            })
        })
        .collect::<Result<Vec<_>, _>>());
    let memfds = match sandbox.take() {
        Some(m) => m,
        None => tri!(Memfds::new().map_err(fd_err)),
    };
    let (read, control) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(p) => p,
        Err(e) => return Err(Box::new((fd_err(e.into()), cgroup, in_sandbox.then_some(memfds)))),
    };
    let netns = spec.network.as_ref().map(|fd| fd.as_raw_fd());
    let netns_id = match &spec.network {
        Some(fd) => match ns_id(fd) {
            Some(n) => Some(n),
            None => {
                let e = fd_err(std::io::Error::other("cannot stat the network namespace"));
                return Err(Box::new((e, cgroup, in_sandbox.then_some(memfds))));
            }
        },
        None => None,
    };
    let mut inherit = vec![memfds.args.as_raw_fd(), memfds.passwd.as_raw_fd(), memfds.group.as_raw_fd()];
    inherit.extend(memfds.seccomp.iter().map(|f| f.as_raw_fd()));
    let mut cmd = if in_sandbox {
        // bwrap reads its inputs now; the shell inside waits on the same kind of pipe.
        let mut cmd = Command::new(bwrap);
        cmd.arg("--args").arg(memfds.args.as_raw_fd().to_string()).args(["--", STUB, "-s"]);
        cmd
    } else {
        let mut cmd = Command::new(STUB);
        cmd.arg("-s");
        cmd
    };
    // Commands from stdin: a pipe only the agent writes. (Not `. /proc/self/fd/N`: the pipe
    // belongs to root, and reopening it through /proc as the job user is refused.)
    cmd.env_clear()
        .current_dir("/")
        .stdin(Stdio::from(read))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A warm start dropped without `discard` (a panic, a dropped future) takes the process
        // with it; its cgroup is left for the next start-up sweep.
        .kill_on_drop(true);
    child::install(
        &mut cmd,
        ChildSetup {
            cgroup_procs: procs.iter().map(|f| f.as_raw_fd()).collect(),
            inherit,
            netns,
            user: Some((spec.user.uid, spec.user.gid)),
            // Without a cgroup the process limit is set now, for the job it waits for: a job
            // with another starts cold (`misfit`).
            without_cgroup: cgroup.is_none().then_some(crate::child::WithoutCgroup { nproc: spec.nproc }),
        },
    );
    let program = if in_sandbox { bwrap.display().to_string() } else { STUB.to_string() };
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(source) => {
            let e = SandboxError::Spawn { job_id: id.clone(), program, source };
            return Err(Box::new((e, cgroup, in_sandbox.then_some(memfds))));
        }
    };
    let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
        unreachable!("stdout and stderr were set to piped")
    };
    tracing::debug!(name = %id, pid = child.id(), in_sandbox, "warm start ready");
    let Memfds { args, passwd, group, seccomp } = memfds;
    Ok(Waiter {
        name: id,
        user: spec.user,
        netns: netns_id,
        child,
        stdout,
        stderr,
        control,
        args,
        passwd,
        group,
        seccomp,
        nproc: if cgroup.is_none() { spec.nproc } else { None },
        cgroup,
        bwrap: bwrap.to_path_buf(),
    })
}

fn memfd(name: &std::ffi::CStr) -> std::io::Result<File> {
    crate::host::sealable_memfd(name)
}

/// Writes a memfd's contents, rewinds and seals it. The offset is shared with the waiting
/// process (one open file description), so bwrap reads from the start; the seal keeps anyone
/// else who could reach the file from changing it before bwrap has read it.
fn fill(f: &mut File, data: &[u8]) -> std::io::Result<()> {
    f.set_len(0)?;
    f.rewind()?;
    f.write_all(data)?;
    f.rewind()?;
    crate::host::seal(f)
}

fn ns_id(fd: &OwnedFd) -> Option<(u64, u64)> {
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).ok()?;
    Some((st.st_dev as u64, st.st_ino as u64))
}

mod script;
pub(crate) use script::shell_safe_name;
use script::{command_line, hand_over, ready_command};
