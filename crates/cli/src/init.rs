//! A small init for the agent when it is its container's first process (PID 1): it reaps the
//! orphans jobs leave and forwards the container's signals. It must not do anything else: it
//! runs before logging and the runtime, in the one thread there is.

/// The agent as a container's first process (a pod's `command`): PID 1 of its PID namespace,
/// which inherits every orphan of its jobs' sandboxes (bubblewrap's outer process, once its
/// job is gone) and must reap them, or their zombies pile up and count against the next job's
/// process limit (outsider finding). This process stays PID 1 as a small init: it forks the
/// agent, forwards it the signals a container gets (SIGTERM from the kubelet), reaps every
/// child, and exits as the agent exits. `None` in the child, which goes on as the agent;
/// `Some(code)` in the init, when the agent has ended.
#[allow(unsafe_code)]
pub fn init_for_the_agent() -> Option<std::process::ExitCode> {
    use nix::sys::signal::{kill, SigSet, SigmaskHow, Signal};
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    use nix::unistd::{fork, ForkResult, Pid};
    let forwarded =
        [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGQUIT, Signal::SIGUSR1, Signal::SIGUSR2];
    let mut set = SigSet::empty();
    for s in forwarded {
        set.add(s);
    }
    set.add(Signal::SIGCHLD);
    // Blocked before the fork, so none is lost between fork and the wait below.
    if let Err(e) = nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None) {
        eprintln!("warning: running as PID 1 without a reaper ({e}): orphaned job processes stay zombies");
        return None;
    }
    // SAFETY: no other thread exists yet (first thing in `main`, before logging or the
    // runtime); the child only restores its signal mask before going on as the agent.
    match unsafe { fork() } {
        Err(e) => {
            let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_UNBLOCK, Some(&set), None);
            eprintln!("warning: running as PID 1 without a reaper ({e}): orphaned job processes stay zombies");
            None
        }
        Ok(ForkResult::Child) => {
            let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_UNBLOCK, Some(&set), None);
            None
        }
        Ok(ForkResult::Parent { child }) => loop {
            let Ok(sig) = set.wait() else { continue };
            if sig != Signal::SIGCHLD {
                let _ = kill(child, sig);
                continue;
            }
            // Reap everything that has ended: the agent, and orphans handed to PID 1.
            loop {
                match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::Exited(pid, code)) if pid == child => {
                        return Some(std::process::ExitCode::from(code as u8));
                    }
                    Ok(WaitStatus::Signaled(pid, s, _)) if pid == child => {
                        return Some(std::process::ExitCode::from(128u8.wrapping_add(s as u8)));
                    }
                    Ok(WaitStatus::StillAlive) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        },
    }
}
