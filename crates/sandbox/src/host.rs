//! Host state the agent process itself must get right before any job starts: descriptors it
//! inherited, and the shared directory under `/run` that job users pass through.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// Marks every descriptor this process inherited (3 and up) close-on-exec, so none reaches a
/// job, bwrap or pasta. Whoever started the agent may have left descriptors open (a shell's
/// `exec 7>>/root/log`, a supervisor's pipe); Rust opens its own with `O_CLOEXEC`, so after
/// this nothing open in the agent crosses an `exec`. Call first thing in `main`, before any
/// other thread exists. Returns how many descriptors were inheritable.
pub fn seal_inherited_fds() -> io::Result<usize> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    // Collect first: the directory handle is itself one of the entries.
    let fds: Vec<i32> = fs::read_dir("/proc/self/fd")?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    let mut sealed = 0;
    for fd in fds {
        // The listing's own descriptor is closed by now: EBADF.
        let Ok(flags) = fcntl(fd, FcntlArg::F_GETFD) else { continue };
        let flags = FdFlag::from_bits_truncate(flags);
        if !flags.contains(FdFlag::FD_CLOEXEC) {
            fcntl(fd, FcntlArg::F_SETFD(flags | FdFlag::FD_CLOEXEC)).map_err(io::Error::from)?;
            sealed += 1;
        }
    }
    Ok(sealed)
}

/// Makes `dir` (e.g. `/run/gpuci-sandbox`) exist as a root-owned directory that everyone may
/// pass through (0755) but only its owner writes: job users reach the `/etc` view below it,
/// while what must stay private (uid lock files) lives in subdirectories of its own mode.
/// A directory left 0700 by an older agent is repaired; one owned by someone else, writable
/// by others, or a symlink is refused.
pub fn ensure_run_dir(dir: &Path) -> io::Result<()> {
    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let m = fs::symlink_metadata(dir)?;
    // `/proc/self` belongs to this process's effective uid.
    let me = fs::metadata("/proc/self")?.uid();
    if !m.is_dir() || m.uid() != me || m.mode() & 0o022 != 0 {
        return Err(io::Error::other(format!(
            "{} is not a directory owned by us and writable only by us",
            dir.display()
        )));
    }
    if m.mode() & 0o7777 != 0o755 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_run_dir_left_private_is_made_passable_again() {
        let t = tempfile::tempdir().expect("tempdir");
        let run = t.path().join("run");
        fs::create_dir(&run).expect("mkdir");
        fs::set_permissions(&run, fs::Permissions::from_mode(0o700)).expect("chmod");
        ensure_run_dir(&run).expect("ensure");
        assert_eq!(fs::metadata(&run).expect("stat").mode() & 0o7777, 0o755);
        let fresh = t.path().join("fresh");
        ensure_run_dir(&fresh).expect("ensure");
        assert_eq!(fs::metadata(&fresh).expect("stat").mode() & 0o7777, 0o755);
    }

    #[test]
    fn a_run_dir_others_can_write_is_refused() {
        let t = tempfile::tempdir().expect("tempdir");
        let run = t.path().join("run");
        fs::create_dir(&run).expect("mkdir");
        fs::set_permissions(&run, fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(ensure_run_dir(&run).is_err());
    }

    #[test]
    fn inherited_descriptors_no_longer_cross_exec() {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag};
        let f = tempfile::tempfile().expect("tempfile");
        let fd = f.as_raw_fd();
        fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty())).expect("clear cloexec");
        assert!(seal_inherited_fds().expect("seal") >= 1);
        let flags = FdFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFD).expect("getfd"));
        assert!(flags.contains(FdFlag::FD_CLOEXEC));
    }
}

/// A memfd for data bwrap reads (its arguments, seccomp programs, passwd/group), which
/// [`seal`] can make immutable once written.
pub(crate) fn sealable_memfd(name: &std::ffi::CStr) -> io::Result<fs::File> {
    use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
    let fd = memfd_create(name, MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING)?;
    Ok(fs::File::from(fd))
}

/// Seals a written memfd against every change: whoever else holds or reopens it (the job's
/// uid can, through `/proc/<pid>/fd` of a process of that uid) cannot rewrite what bwrap reads.
pub(crate) fn seal(f: &fs::File) -> io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use std::os::fd::AsRawFd;
    let all = SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL;
    fcntl(f.as_raw_fd(), FcntlArg::F_ADD_SEALS(all))?;
    Ok(())
}

#[cfg(test)]
mod seal_tests {
    use super::*;
    use std::io::{Seek, Write};

    #[test]
    fn a_sealed_memfd_keeps_its_bytes() {
        let mut f = sealable_memfd(c"gpuci-test").expect("memfd");
        f.write_all(b"--ro-bind\0/usr\0/usr\0").expect("write");
        seal(&f).expect("seal");
        f.rewind().expect("rewind");
        assert!(f.write_all(b"--bind\0/\0/\0").is_err(), "a sealed memfd took a write");
        assert!(f.set_len(0).is_err(), "a sealed memfd was truncated");
        // Reopened through /proc, as another process of the uid could: still read-only.
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&f));
        let mut again = fs::OpenOptions::new().write(true).open(&path).expect("reopen");
        assert!(again.write_all(b"x").is_err(), "a reopened sealed memfd took a write");
        assert_eq!(fs::read(&path).expect("read"), b"--ro-bind\0/usr\0/usr\0");
    }
}
