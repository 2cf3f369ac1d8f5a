//! The only `unsafe` in this crate: what the forked child does between `fork` and `exec`.
//!
//! Kept in one small module so it can be audited on its own. The closure may only make
//! async-signal-safe calls (the parent may be multi-threaded, so after `fork` the child holds a
//! copy of locks other threads held): `setsid(2)`, `write(2)` and `fcntl(2)` on file descriptors
//! the parent opened beforehand. No allocation, no locking, no formatting.

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
}

pub(crate) fn install(cmd: &mut tokio::process::Command, setup: ChildSetup) {
    let ChildSetup { cgroup_procs, inherit } = setup;
    // SAFETY: the closure runs in the forked child before exec. It only calls setsid, write and
    // fcntl(F_SETFD), which are async-signal-safe (POSIX.1-2008 §2.4.3), on descriptors that
    // the parent keeps open until `spawn` returns. It does not allocate (the Vecs were built in
    // the parent and are only iterated) and `io::Error::last_os_error` just reads errno.
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
            Ok(())
        });
    }
}
