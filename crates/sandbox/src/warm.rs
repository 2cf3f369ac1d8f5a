//! Jobs started ahead of time: for an idle slot, a process that already sits in a fresh cgroup,
//! in the slot's network namespace, as the slot's uid, and waits for the slot's next job.
//!
//! Why: on cgroup v1 (and v2 without `favordynmods`) the first write into a `cgroup.procs` file
//! after an idle moment waits for an RCU grace period, 12–16 ms on a 2-core VM: the largest
//! single piece of a job's start (BENCHMARKS.md). A warm start pays it while the slot is idle.
//!
//! What waits is `/bin/sh -s` reading its commands from a pipe, forked by the spawner thread (`spawner.rs`)
//! through the same pre-exec steps as a cold start (`child.rs`: own session, into the cgroups,
//! into the network namespace, every privilege dropped). It is in every respect the job's
//! first process, minus the job. When the job comes, the agent writes the job's limits into
//! the cgroup, bwrap's arguments (the job's environment included) into a memfd the process
//! already holds, and then one command into the pipe (the shell's stdin):
//! `{ exec bwrap --args FD -- ARGV... </dev/null; }`, every word single-quoted. The shell parses the
//! whole block before it runs any of it, so a command cut short (the agent failed half way)
//! is a syntax error, never a shorter argv; then it execs bwrap and the job starts as a cold
//! start would, minus the fork, the cgroup migration and the privilege drop.
//!
//! What it must never do:
//! - exist next to a job of its uid: the agent prepares one only for an idle slot and the
//!   slot's next job takes it (and runs it, or discards it before running anything);
//! - run anything the agent did not write: the pipe's write end and the memfds' agent copies
//!   never leave the agent (O_CLOEXEC), and the process has no environment;
//! - outlive the agent: when the agent dies the pipe's write end closes, the shell reads an
//!   empty script and exits, and the agent's start-up sweep removes the cgroup.

use std::fs::File;
use std::io::{Seek, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::process::{Child, ChildStderr, ChildStdout, Command};

use crate::cgroup::{self, JobCgroup};
use crate::child::{self, ChildSetup};
use crate::{find_program, validate_job_id, CgroupUse, Isolation, JobUser, Network, SandboxError, SandboxSpec};

/// The waiting program. Always the host's: nothing of a job exists yet when it starts.
const STUB: &str = "/bin/sh";
/// How long the agent waits for the waiting shell to take its command.
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
}

/// A process waiting for its job. Hand it to [`crate::Sandbox::spawn_warm`], or [`WarmStart::discard`] it.
#[derive(Debug)]
pub struct WarmStart {
    name: String,
    user: JobUser,
    /// (st_dev, st_ino) of the network namespace it joined.
    netns: Option<(u64, u64)>,
    child: Child,
    stdout: ChildStdout,
    stderr: ChildStderr,
    /// The write end of the pipe the shell reads its command from (its stdin).
    control: OwnedFd,
    args: File,
    passwd: File,
    group: File,
    seccomp: Vec<File>,
    cgroup: Option<JobCgroup>,
    bwrap: PathBuf,
}

/// What a warm start becomes: the parts [`crate::Sandbox`] is made of.
pub(crate) struct Started {
    pub(crate) child: Child,
    pub(crate) stdout: ChildStdout,
    pub(crate) stderr: ChildStderr,
    pub(crate) cgroup: Option<JobCgroup>,
    pub(crate) etc_view: Option<Arc<crate::etcview::EtcView>>,
}

impl WarmStart {
    /// Starts the waiting process (on the spawner thread: it must outlive the caller). Needs a
    /// root agent, a job user and bubblewrap. Blocks nothing of the caller's runtime.
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

    /// Host pid of the waiting process.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Why `spec` cannot start from this warm start, if it cannot.
    pub(crate) fn misfit(&self, spec: &SandboxSpec) -> Option<&'static str> {
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
            _ => None,
        }
    }

    /// Hands the job to the waiting process. On an error before the shell took its command the
    /// warm start comes back, to be discarded; the job can then still start cold.
    pub(crate) fn start(
        mut self,
        spec: &SandboxSpec,
        env: &std::collections::BTreeMap<String, String>,
    ) -> Result<Started, Box<(SandboxError, WarmStart)>> {
        let id = spec.job_id.clone();
        let fd_err = |source| SandboxError::ArgsFd { job_id: id.clone(), source };
        match self.child.try_wait() {
            Ok(None) => {}
            _ => {
                let e = SandboxError::Spawn {
                    job_id: id.clone(),
                    program: STUB.to_string(),
                    source: std::io::Error::other("the waiting process has ended"),
                };
                return Err(Box::new((e, self)));
            }
        }
        if let Some(cg) = &mut self.cgroup {
            let deny = crate::sandbox::non_leased_gpu_nodes(&spec.gpu_devices, &crate::plan::RealFs);
            if let Err(e) = cg.apply(&spec.resources, &deny) {
                return Err(Box::new((e, self)));
            }
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
        let WarmStart { child, stdout, stderr, cgroup, control, .. } = self;
        // The shell reads to the end of its block; closing tells it there is nothing after.
        drop(control);
        Ok(Started { child, stdout, stderr, cgroup, etc_view })
    }

    /// Ends the waiting process and removes its cgroup.
    pub async fn discard(mut self) {
        let _ = self.child.start_kill();
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
    // Another agent's start-up sweep removes empty warm-start cgroups, which this one is for a
    // moment between its mkdir and the child's write into it: then the write fails with
    // ENODEV or ENOENT, and a fresh cgroup is made.
    let mut attempts = 0;
    loop {
        attempts += 1;
        let cgroup = match spec.cgroups {
            CgroupUse::Disabled => None,
            use_ => match cgroup::layout().filter(|l| l.writable()) {
                Some(layout) => Some(JobCgroup::create_unlimited(layout, id)?),
                None if use_ == CgroupUse::Required => {
                    return Err(SandboxError::CgroupUnavailable {
                        job_id: id.to_string(),
                        reason: "no writable cgroup v1 or v2 hierarchy with memory/pids controllers".to_string(),
                    })
                }
                None => None,
            },
        };
        match spawn_stub(&spec, bwrap.clone(), cgroup) {
            Ok(w) => return Ok(w),
            Err(failed) => {
                let (e, cgroup) = *failed;
                if let Some(cg) = cgroup {
                    let _ = cg.remove();
                }
                let vanished = matches!(&e, SandboxError::Spawn { source, .. }
                    if matches!(source.raw_os_error(), Some(libc::ENODEV) | Some(libc::ENOENT)));
                if !(vanished && attempts < 3) {
                    return Err(e);
                }
            }
        }
    }
}

fn spawn_stub(
    spec: &WarmSpec,
    bwrap: PathBuf,
    cgroup: Option<JobCgroup>,
) -> Result<WarmStart, Box<(SandboxError, Option<JobCgroup>)>> {
    let id = spec.name.clone();
    let fd_err = |source: std::io::Error| SandboxError::ArgsFd { job_id: id.clone(), source };
    macro_rules! tri {
        ($e:expr) => {
            match $e {
                Ok(v) => v,
                Err(e) => return Err(Box::new((e, cgroup))),
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
    let args = tri!(memfd(c"gpuci-bwrap-args").map_err(fd_err));
    let passwd = tri!(memfd(c"gpuci-bwrap-data").map_err(fd_err));
    let group = tri!(memfd(c"gpuci-bwrap-data").map_err(fd_err));
    let seccomp = tri!(crate::seccomp::memfds().map_err(fd_err));
    let (read, control) = tri!(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| fd_err(e.into())));
    let netns = spec.network.as_ref().map(|fd| fd.as_raw_fd());
    let netns_id = match &spec.network {
        Some(fd) => match ns_id(fd) {
            Some(n) => Some(n),
            None => return Err(Box::new((fd_err(std::io::Error::other("cannot stat the network namespace")), cgroup))),
        },
        None => None,
    };
    let mut inherit = vec![args.as_raw_fd(), passwd.as_raw_fd(), group.as_raw_fd()];
    inherit.extend(seccomp.iter().map(|f| f.as_raw_fd()));
    let mut cmd = Command::new(STUB);
    // Commands from stdin: a pipe only the agent writes. (Not `. /proc/self/fd/N`: the pipe
    // belongs to root, and reopening it through /proc as the job user is refused.)
    cmd.arg("-s")
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::from(read))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A warm start dropped without `discard` (a panic, a dropped future) takes the shell
        // with it; its cgroup is left for the next start-up sweep.
        .kill_on_drop(true);
    child::install(
        &mut cmd,
        ChildSetup {
            cgroup_procs: procs.iter().map(|f| f.as_raw_fd()).collect(),
            inherit,
            netns,
            user: Some((spec.user.uid, spec.user.gid)),
        },
    );
    let mut child = tri!(cmd.spawn().map_err(|source| SandboxError::Spawn {
        job_id: id.clone(),
        program: STUB.to_string(),
        source
    }));
    let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
        unreachable!("stdout and stderr were set to piped")
    };
    tracing::debug!(name = %id, pid = child.id(), "warm start ready");
    Ok(WarmStart {
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
        cgroup,
        bwrap,
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

/// `{ exec 'BWRAP' --args N -- 'ARG'... </dev/null; }` and a newline: one compound
/// command, which the shell only runs once it has read all of it. The job's stdin is
/// `/dev/null`, as in a cold start, not the pipe.
pub(crate) fn command_line(bwrap: &std::path::Path, args_fd: i32, argv: &[String]) -> Vec<u8> {
    let mut s = b"{ exec ".to_vec();
    quote(&mut s, bwrap.as_os_str().as_bytes());
    s.extend_from_slice(format!(" --args {args_fd} --").as_bytes());
    for a in argv {
        s.push(b' ');
        quote(&mut s, a.as_bytes());
    }
    s.extend_from_slice(b" </dev/null");
    s.extend_from_slice(b"; }\n");
    s
}

/// Single quotes keep every byte literal; a quote itself is closed, escaped and reopened.
fn quote(out: &mut Vec<u8>, word: &[u8]) {
    out.push(b'\'');
    for &b in word {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
}

/// Writes the whole command without blocking the caller for long: the shell is waiting on
/// the other end, so anything longer than [`HANDOVER`] means it is gone or stuck.
fn hand_over(control: &OwnedFd, command: &[u8]) -> std::io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    fcntl(control.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
    let deadline = std::time::Instant::now() + HANDOVER;
    let mut rest = command;
    while !rest.is_empty() {
        match nix::unistd::write(control.as_fd(), rest) {
            Ok(n) => rest = &rest[n..],
            Err(nix::errno::Errno::EAGAIN) => {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the waiting process took no command",
                    ));
                }
                let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
                let mut fds = [PollFd::new(control.as_fd(), PollFlags::POLLOUT)];
                poll(&mut fds, PollTimeout::from(ms))?;
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_keeps_every_word_whole() {
        let argv = vec!["bash".to_string(), "-c".to_string(), "echo 'it''s' \"$HOME\" `id` ; }\nrm -rf /".to_string()];
        let line = command_line(std::path::Path::new("/usr/bin/bwrap"), 7, &argv);
        let text = String::from_utf8(line.clone()).expect("utf-8");
        assert!(text.starts_with("{ exec '/usr/bin/bwrap' --args 7 -- 'bash' '-c' "), "{text}");
        assert!(text.ends_with(" </dev/null; }\n"), "{text}");
        // What the shell makes of it: each word exactly as given.
        let probe = String::from_utf8(line)
            .unwrap()
            .replace("exec '/usr/bin/bwrap' --args 7 --", "printf '%s\\0'")
            .replace(" </dev/null", "");
        let out = std::process::Command::new("/bin/sh").arg("-c").arg(&probe).output().expect("sh");
        let words: Vec<&[u8]> = out.stdout.split(|b| *b == 0).filter(|w| !w.is_empty()).collect();
        assert_eq!(words, argv.iter().map(|a| a.as_bytes()).collect::<Vec<_>>());
    }

    #[test]
    fn a_command_cut_short_runs_nothing() {
        let argv = vec!["sh".to_string(), "-c".to_string(), "touch \"$0\"".to_string()];
        let dir = tempfile::tempdir().expect("tempdir");
        let marker = dir.path().join("ran");
        let mut argv2 = argv.clone();
        argv2.push(marker.display().to_string());
        let line = command_line(std::path::Path::new("/usr/bin/env"), 0, &argv2);
        let line = String::from_utf8(line).unwrap().replace(" --args 0 --", "");
        // Every cut but the whole line must run nothing.
        for cut in 1..line.len() - 1 {
            let part = &line.as_bytes()[..cut];
            let _ = std::process::Command::new("/bin/sh")
                .arg("-c")
                .arg(std::ffi::OsStr::from_bytes(part))
                .stderr(Stdio::null())
                .status();
            assert!(!marker.exists(), "a command cut at {cut} ran: {:?}", String::from_utf8_lossy(part));
        }
        std::process::Command::new("/bin/sh").arg("-c").arg(&line).status().expect("sh");
        assert!(marker.exists(), "the whole command should run");
    }
}
