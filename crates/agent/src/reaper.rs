//! The agent's reaper: one small process per agent that ends what the agent leaves behind
//! when it dies, however it dies.
//!
//! Every job is tied to the agent by parent-death signals (`gpuci_sandbox`, bwrap's
//! `--die-with-parent`), but that chain has a gap the agent cannot close: bubblewrap arms
//! the signal of the sandbox's pid 1 only once that process has set the sandbox up, so an
//! agent killed while a job's sandbox is still starting (a few milliseconds, far more on a
//! loaded host) left the sandbox's init and the job running for good, re-parented to the
//! host's init (seen in CI: `bwrap` and `sleep` of a slot's uid 10 s after a SIGKILL). A job
//! outside bubblewrap (`--isolation none`, a `setsid` daemon) has no such chain at all.
//!
//! So the agent starts this process (the `gpuci` binary, `agent-reaper`) right after its
//! start-up sweep: it reads a pipe whose only write end the agent holds and, when that pipe
//! ends (the kernel closes a dead process's descriptors whatever killed it; a clean stop
//! closes it too), does what the agent's next start would have done, now: it kills every
//! cgroup and marked process of the agent's sandbox prefix (`gpuci_sandbox::sweep`) and every
//! process of the agent's job and network uids (`gpuci_sandbox::end_processes_of`), then exits.
//!
//! It holds the agent's uid locks (inherited descriptors of the same open files): no other
//! agent leases those uids, and so none starts a job as them, until the reaper has ended
//! everything that ran as them. It runs as the agent, in its own process group, with an empty
//! environment, no argument but the prefix and the uids, and ignores SIGTERM, SIGINT and
//! SIGHUP, so a signal to the agent's group or unit does not take it before the agent has
//! ended. Jobs run as other uids and cannot signal it.
//!
//! What it must not do: hold anything of a job (it never reads or writes a workspace, a
//! secret or a log), or outlive its sweep.
//!
//! Not covered: a SIGKILL of the reaper together with the agent (`systemctl kill -s KILL` of
//! the unit, the last step of a stop that timed out). Then what is left waits for the agent's
//! next start-up sweep, as before; the agent says so in its log if the reaper cannot start.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, ChildStdin, Command};
use tokio_util::sync::CancellationToken;

/// The hidden subcommand of the `gpuci` binary that runs [`main`].
pub const SUBCOMMAND: &str = "agent-reaper";

/// How long the reaper keeps killing processes of the agent's uids before it gives up.
const WITHIN: Duration = Duration::from_secs(10);

/// What the reaper sweeps when the agent is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Charge {
    /// The agent's sandbox prefix: its cgroups and marked processes.
    pub prefix: String,
    /// The agent's job and network uids (empty for an agent that is not root).
    pub uids: Vec<u32>,
}

impl Charge {
    /// The reaper's command-line arguments after the subcommand.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec!["--prefix".to_string(), self.prefix.clone()];
        if !self.uids.is_empty() {
            a.push("--uids".into());
            a.push(self.uids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
        }
        a
    }

    /// Parses what [`Charge::args`] wrote. The prefix must be what an agent makes (letters and
    /// digits then `-`): an empty or odd one would sweep other agents' cgroups.
    pub fn parse(args: &[String]) -> Result<Charge, String> {
        let (mut prefix, mut uids) = (None, Vec::new());
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let value = it.next().ok_or_else(|| format!("{a}: a value is missing"))?;
            match a.as_str() {
                "--prefix" => prefix = Some(value.clone()),
                "--uids" => {
                    uids = value
                        .split(',')
                        .map(|u| u.parse::<u32>().map_err(|e| format!("--uids {value}: {e}")))
                        .collect::<Result<_, _>>()?
                }
                other => return Err(format!("unknown argument {other}")),
            }
        }
        let prefix = prefix.ok_or("--prefix is missing")?;
        let body = prefix.strip_suffix('-').unwrap_or("");
        if body.is_empty() || !body.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(format!("--prefix {prefix:?}: expected letters and digits ending in '-'"));
        }
        if uids.contains(&0) {
            return Err("--uids: never uid 0".into());
        }
        Ok(Charge { prefix, uids })
    }
}

/// The reaper's body: waits for the agent's pipe (standard input) to end, sweeps, exits.
/// Returns the exit code.
pub fn main(args: &[String]) -> u8 {
    use std::io::Write;
    let charge = match Charge::parse(args) {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "gpuci agent-reaper: {e}");
            return 2;
        }
    };
    ignore_stop_signals();
    // Nothing is ever written; the read returns when the agent's end closes.
    let mut stdin = std::io::stdin().lock();
    let mut buf = [0u8; 64];
    loop {
        match stdin.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
    let swept = gpuci_sandbox::sweep(&charge.prefix, &charge.uids);
    let ended = if charge.uids.is_empty() { Ok(0) } else { gpuci_sandbox::end_processes_of(&charge.uids, WITHIN) };
    // The agent's stderr may be gone (a terminal closed): a failed write is not an error here.
    let mut err = std::io::stderr();
    let killed = swept.processes_killed + ended.as_ref().map_or(0, |n| *n);
    if killed > 0 {
        let _ = writeln!(err, "gpuci agent-reaper: the agent ended; killed {killed} processes it left running");
    }
    match ended {
        Ok(_) => 0,
        Err(left) => {
            let _ = writeln!(err, "gpuci agent-reaper: processes of the agent's job uids could not be ended: {left:?}");
            1
        }
    }
}

#[allow(unsafe_code)]
fn ignore_stop_signals() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        // SAFETY: SIG_IGN runs no code of ours.
        let _ = unsafe { signal(s, SigHandler::SigIgn) };
    }
}

/// A running reaper; dropping it (or the agent dying) makes it sweep and exit.
#[derive(Debug)]
struct Running {
    child: Child,
    _pipe: ChildStdin,
}

/// Starts the reaper: `program` is the `gpuci` binary, `locks` the uid lock descriptors it
/// inherits.
fn start(program: &Path, charge: &Charge, locks: &[OwnedFd]) -> std::io::Result<Running> {
    let mut cmd = Command::new(program);
    cmd.arg(SUBCOMMAND)
        .args(charge.args())
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .process_group(0)
        .kill_on_drop(false);
    let locks: Vec<RawFd> = locks.iter().map(AsRawFd::as_raw_fd).collect();
    // SAFETY: runs in the forked child before exec: fcntl and signal, plain system calls, on
    // descriptors the caller owns (open until `spawn` returns); the Vec was built before the fork.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &locks {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Ignored from the start (a disposition of SIG_IGN survives exec): a stop of the
            // agent's group right now must not take the reaper before it runs `main`.
            for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
                libc::signal(s, libc::SIG_IGN);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let pipe = child.stdin.take().ok_or_else(|| std::io::Error::other("no pipe to the reaper"))?;
    Ok(Running { child, _pipe: pipe })
}

/// Starts the agent's reaper for its sandbox `prefix` and uid `lease`; it sweeps when the
/// returned guard drops, or when the agent dies.
pub(crate) fn guard(
    program: Option<std::path::PathBuf>,
    prefix: &str,
    lease: Option<&crate::slots::UidLease>,
) -> tokio_util::sync::DropGuard {
    let charge = Charge { prefix: prefix.to_string(), uids: lease.map(|l| l.uids().to_vec()).unwrap_or_default() };
    // Copies the task owns: the agent may drop its lease (an early return) before the task
    // starts the reaper, and a number of a closed descriptor is no lock (or another file's).
    let locks = lease.map(|l| l.lock_fds()).transpose();
    let stop = CancellationToken::new();
    tokio::spawn(keep(program, charge, locks.map(Option::unwrap_or_default), stop.clone()));
    stop.drop_guard()
}

/// Keeps a reaper running for the agent's life: starts it, starts it again if it ends while
/// the agent runs (loudly), and lets it sweep when `shutdown` is cancelled. Without a
/// `program` (an agent inside another binary) or when it cannot start, the agent says that a
/// killed agent's jobs wait for its next start.
async fn keep(
    program: Option<std::path::PathBuf>,
    charge: Charge,
    locks: std::io::Result<Vec<OwnedFd>>,
    shutdown: CancellationToken,
) {
    let Some(program) = program else {
        tracing::warn!(
            "no reaper (the agent runs inside another program): if this agent is killed, what its jobs left running is ended only by its next start"
        );
        return;
    };
    let locks = match locks {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(
                error = %e,
                "cannot start the agent's reaper (its uid locks cannot be copied): if this agent is killed, what its jobs left running is ended only by its next start"
            );
            return;
        }
    };
    loop {
        let mut running = match start(&program, &charge, &locks) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(
                    program = %program.display(), error = %e,
                    "cannot start the agent's reaper: if this agent is killed, what its jobs left running is ended only by its next start"
                );
                return;
            }
        };
        tracing::debug!(pid = running.child.id(), "reaper started");
        tokio::select! {
            () = shutdown.cancelled() => return,
            status = running.child.wait() => {
                tracing::error!(?status, "the agent's reaper ended while the agent runs; starting another");
                if tokio::time::timeout(Duration::from_secs(5), shutdown.cancelled()).await.is_ok() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn the_charge_round_trips_through_its_arguments() {
        let c = Charge { prefix: "ab12cd34ef56-".into(), uids: vec![1_500_000_000, 1_500_000_001] };
        assert_eq!(Charge::parse(&c.args()), Ok(c));
        let bare = Charge { prefix: "x1-".into(), uids: vec![] };
        assert_eq!(Charge::parse(&bare.args()), Ok(bare));
    }

    /// The agent may drop its uid lease (an early return at start) before the reaper's task
    /// runs: the reaper still starts, holding the locks. It used to get the numbers of closed
    /// descriptors and fail with EBADF (or hand on whatever file reused a number).
    #[tokio::test]
    async fn the_reaper_holds_the_uid_locks_even_when_the_lease_is_dropped_before_it_starts() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var("CI").is_err(), "CI=true: this test needs root (uid locks live in /run)");
            eprintln!("SKIP: uid locks live in /run (root)");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("fds");
        // Stands in for `gpuci agent-reaper`: says which files it was handed, then waits.
        let program = dir.path().join("reaper");
        std::fs::write(
            &program,
            format!(
                "#!/bin/sh\nfor f in /proc/$$/fd/*; do readlink \"$f\"; done > {out}.tmp\nmv {out}.tmp {out}\nexec cat > /dev/null\n",
                out = out.display()
            ),
        )
        .expect("write the program");
        std::fs::set_permissions(&program, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        let start = 3_000_000_000 + (std::process::id() % 10_000) * 1_024 + 5 * 128;
        let lease = crate::slots::lease(Some((start, start + 3)), 2).expect("a free uid range");
        let uids = lease.uids().to_vec();
        let guard = guard(Some(program), "ab12cd34ef56-", Some(&lease));
        drop(lease);
        let t0 = std::time::Instant::now();
        while !out.exists() && t0.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let fds = std::fs::read_to_string(&out).expect("the reaper never started");
        for uid in uids {
            assert!(
                fds.lines().any(|l| l.ends_with(&format!("/{uid}.lock"))),
                "uid {uid}'s lock not handed on:\n{fds}"
            );
        }
        drop(guard);
    }

    #[test]
    fn a_prefix_that_would_sweep_other_agents_is_refused() {
        for bad in ["", "-", "abc", "a/b-", "a b-", "*-"] {
            assert!(Charge::parse(&s(&["--prefix", bad])).is_err(), "{bad:?}");
        }
        assert!(Charge::parse(&s(&["--prefix", "ab-", "--uids", "0"])).is_err());
        assert!(Charge::parse(&s(&["--prefix", "ab-", "--uids", "1,x"])).is_err());
        assert!(Charge::parse(&s(&["--prefix"])).is_err());
        assert!(Charge::parse(&s(&["--other", "1"])).is_err());
    }
}
