//! The only `unsafe` in this crate: what the forked child does between `fork` and `exec`.
//!
//! Kept in one small module so it can be audited on its own. The closure may only make
//! async-signal-safe calls (the parent may be multi-threaded, so after `fork` the child holds a
//! copy of locks other threads held): `setsid(2)`, `write(2)`, `fcntl(2)`, `setns(2)`,
//! `setgroups(2)`, `setresgid(2)`, `setresuid(2)`, `prctl(2)` and `getppid(2)`, on file
//! descriptors the parent opened beforehand. No allocation, no locking, no formatting.
//!
//! Every child gets a parent-death signal: nothing it starts outlives the agent. That ties it
//! to the *thread* that forked it, so forks that outlive their caller go through the
//! long-lived spawner thread (`spawner.rs`).
//!
//! Order matters, and is the privilege model in miniature: everything that needs root
//! (entering the job's cgroups, joining the slot's network namespace) happens first; then the
//! child drops every group, its gid and its uid — real, effective and saved, so there is no way
//! back — and only then execs bwrap, which runs as the job's unprivileged uid.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::RawFd;

/// What the child does before it execs.
pub(crate) struct ChildSetup {
    /// `cgroup.procs` files, opened (O_CLOEXEC) by the parent. The child writes "0" (= "me") into
    /// each, so it is inside the job's cgroups before the job's first instruction runs: nothing
    /// it forks can be outside them.
    pub cgroup_procs: Vec<RawFd>,
    /// Descriptors the exec'd program must inherit (the bwrap `--args` memfd). They are O_CLOEXEC
    /// in the parent so concurrently spawned children never see them; only this child clears it.
    pub inherit: Vec<RawFd>,
    /// A network namespace to join (the slot's), as root, before dropping privileges.
    pub netns: Option<RawFd>,
    /// The unprivileged (uid, gid) the job runs as; `None`: the agent's own.
    pub user: Option<(u32, u32)>,
    /// Without a cgroup of its own (a container that gives none, see `cgroup::own_limits`): the
    /// job's process limit as `RLIMIT_NPROC` (counted per uid, and the job has a uid of its
    /// own; it cannot raise a hard limit), and an `oom_score_adj` of 1000 so that the kernel's
    /// OOM killer takes the job before the agent when the container's memory runs out. (Only an
    /// agent with `CAP_SYS_RESOURCE` in the initial user namespace makes that a floor the job
    /// cannot lower; in a user-namespaced pod the job may lower it to the pod's level.)
    pub without_cgroup: Option<WithoutCgroup>,
}

/// What stands in for a job cgroup where there is none.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WithoutCgroup {
    pub nproc: Option<u64>,
}

pub(crate) fn install(cmd: &mut tokio::process::Command, setup: ChildSetup) {
    let ChildSetup { cgroup_procs, inherit, netns, user, without_cgroup } = setup;
    let parent = parent_pid();
    // SAFETY: the closure runs in the forked child before exec. It only calls setsid, write,
    // fcntl(F_SETFD), setns, open, close, setrlimit, setgroups, setresgid and setresuid — plain system calls, safe after
    // fork (POSIX.1-2008 §2.4.3 lists the first three; the others take no locks in libc) — on
    // descriptors that the parent keeps open until `spawn` returns. It does not allocate (the
    // Vecs were built in the parent and are only iterated) and `io::Error::last_os_error` just
    // reads errno.
    unsafe {
        cmd.pre_exec(move || {
            // Own session and process group: the job never shares the agent's terminal or
            // process group, and the group can be signalled as a whole.
            if libc::setsid() == -1 {
                return Err(io::Error::last_os_error());
            }
            for &fd in &cgroup_procs {
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                if n != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            for &fd in &inherit {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(fd) = netns {
                if libc::setns(fd, libc::CLONE_NEWNET) == -1 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(w) = without_cgroup {
                // Raising one's OOM score needs no privilege; the job cannot lower it again.
                let fd = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd == -1 || libc::write(fd, b"1000".as_ptr().cast(), 4) != 4 {
                    return Err(io::Error::last_os_error());
                }
                libc::close(fd);
                if let Some(n) = w.nproc {
                    let lim = libc::rlimit { rlim_cur: n, rlim_max: n };
                    if libc::setrlimit(libc::RLIMIT_NPROC, &lim) == -1 {
                        return Err(io::Error::last_os_error());
                    }
                }
            }
            if let Some((uid, gid)) = user {
                // Groups first (needs CAP_SETGID), then gid, then uid (after which nothing
                // privileged is possible any more). Each must succeed: a half-dropped child
                // must never exec the job.
                if libc::setgroups(0, std::ptr::null()) == -1
                    || libc::setresgid(gid, gid, gid) == -1
                    || libc::setresuid(uid, uid, uid) == -1
                {
                    return Err(io::Error::last_os_error());
                }
            }
            die_with_parent(parent, libc::SIGKILL)
        });
    }
}

/// The agent's pid, taken before the fork for [`die_with_parent`].
fn parent_pid() -> libc::pid_t {
    std::process::id() as libc::pid_t
}

/// `signal` when the thread that forked us ends (the agent dies, however). Set after the
/// credential changes, which clear it, and kept across exec (bwrap and sh are not set-id). A
/// parent that died between fork and here is caught by the `getppid` check: bwrap sets the
/// same signal itself, but only once it runs, and an agent killed before that left the job
/// running for ever (seen in the crash tests).
///
/// # Safety
/// Only async-signal-safe calls (prctl, getppid); for use between fork and exec.
unsafe fn die_with_parent(parent: libc::pid_t, signal: libc::c_int) -> io::Result<()> {
    if libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) == -1 {
        return Err(io::Error::last_os_error());
    }
    if libc::getppid() != parent {
        return Err(io::Error::other("the agent died while this job was being started"));
    }
    Ok(())
}

/// Pre-exec for a slot network's holder: become `uid`/`gid`, then create a user and a network
/// namespace and map root inside to `uid`/`gid` outside. The map lines are built by the caller
/// (no formatting after fork); the proc paths are static.
pub(crate) fn install_namespace_holder(
    cmd: &mut std::process::Command,
    uid: u32,
    gid: u32,
    uid_map: Vec<u8>,
    gid_map: Vec<u8>,
) {
    use std::os::unix::process::CommandExt;
    let parent = parent_pid();
    // SAFETY: runs in the forked child before exec; only setgroups, setresgid, setresuid,
    // prctl, unshare, open, write, close and getppid, all plain system calls on memory
    // prepared by the parent.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(0, std::ptr::null()) == -1
                || libc::setresgid(gid, gid, gid) == -1
                || libc::setresuid(uid, uid, uid) == -1
                // A uid change makes the process non-dumpable, and its /proc/self files then
                // belong to root: the maps below could not be written. It is this uid's own
                // process from here on, so it may be dumpable again.
                || libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) == -1
                || libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) == -1
            {
                return Err(io::Error::last_os_error());
            }
            for (path, data) in [
                (c"/proc/self/setgroups", &b"deny"[..]),
                (c"/proc/self/uid_map", &uid_map[..]),
                (c"/proc/self/gid_map", &gid_map[..]),
            ] {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd == -1 {
                    return Err(io::Error::last_os_error());
                }
                let n = libc::write(fd, data.as_ptr().cast(), data.len());
                libc::close(fd);
                if n != data.len() as isize {
                    return Err(io::Error::last_os_error());
                }
            }
            // SIGTERM, which the holder traps to take pasta along (`netns::HOLDER`): a killed
            // agent left both running until an agent on the same uids came.
            die_with_parent(parent, libc::SIGTERM)
        });
    }
}
