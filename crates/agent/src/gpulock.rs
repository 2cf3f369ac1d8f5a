//! One agent per GPU on a host: the agent holds an exclusive lock per GPU it serves (by UUID)
//! for as long as it runs, so a second agent given the same GPU (two local fleets, a share
//! named twice, an agent started by hand next to a fleet's) refuses to start instead of
//! leasing it to a second job. Simulated and fake GPUs are not locked (their UUIDs are the
//! agent's own).

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Where the locks live: `/run/gpuci/gpus` for root; `$XDG_RUNTIME_DIR/gpuci/gpus` (or
/// `/tmp/gpuci-<uid>/gpus`) for another user, whose agents can then only see each other.
pub fn default_dir() -> PathBuf {
    let uid = nix::unistd::geteuid();
    if uid.is_root() {
        return PathBuf::from("/run/gpuci/gpus");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("gpuci/gpus"),
        _ => PathBuf::from(format!("/tmp/gpuci-{uid}/gpus")),
    }
}

/// Locks held; released when dropped (or when the process ends, however it ends).
#[derive(Debug)]
pub struct GpuLocks(#[allow(dead_code)] Vec<nix::fcntl::Flock<std::fs::File>>);

/// Lock each of `uuids` in `dir`, or say which GPU another agent serves.
pub fn claim(dir: &Path, uuids: &[String], agent: &str) -> Result<GpuLocks, String> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create the GPU lock dir {}: {e}", dir.display()))?;
    // Someone else's dir (a user who made /tmp/gpuci-<uid> first) could swap or hold the
    // locks: refused, loudly.
    for d in [dir.parent(), Some(dir)].into_iter().flatten() {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(d).map_err(|e| format!("cannot inspect {}: {e}", d.display()))?;
        let me = nix::unistd::geteuid().as_raw();
        let shared_root = d == Path::new("/run") || d == Path::new("/tmp");
        if !shared_root && (!m.is_dir() || m.uid() != me || m.mode() & 0o022 != 0) {
            return Err(format!(
                "the GPU lock dir {} must be a directory of uid {me} that no one else can write (it is uid {}, mode {:o})",
                d.display(),
                m.uid(),
                m.mode() & 0o7777
            ));
        }
    }
    let mut held = Vec::with_capacity(uuids.len());
    for uuid in uuids {
        let name: String = uuid.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let path = dir.join(format!("{name}.lock"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc_nofollow())
            .open(&path)
            .map_err(|e| format!("cannot open the GPU lock {}: {e}", path.display()))?;
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(mut lock) => {
                use std::io::{Seek, Write};
                let _ = lock.set_len(0);
                let _ = lock.seek(std::io::SeekFrom::Start(0));
                let _ = writeln!(lock, "{} {agent}", std::process::id());
                held.push(lock);
            }
            Err((file, nix::errno::Errno::EWOULDBLOCK)) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                drop(file);
                return Err(format!(
                    "GPU {uuid} is served by another gpuci agent on this host ({}; lock {}): give each agent its own GPUs (--gpus)",
                    match holder.trim().split_once(' ') {
                        Some((pid, name)) => format!("agent {name}, pid {pid}"),
                        None => "unknown agent".to_string(),
                    },
                    path.display()
                ));
            }
            Err((_, e)) => return Err(format!("cannot lock {}: {e}", path.display())),
        }
    }
    Ok(GpuLocks(held))
}

fn libc_nofollow() -> i32 {
    nix::fcntl::OFlag::O_NOFOLLOW.bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_served_by_one_agent_is_refused_to_another_until_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        let gpus = ["GPU-aaaa".to_string(), "GPU-bbbb".to_string()];
        let first = claim(dir.path(), &gpus[..1], "ws-1").unwrap();
        let e = claim(dir.path(), &gpus, "ws-2").unwrap_err();
        assert!(e.contains("GPU GPU-aaaa is served by another gpuci agent on this host (agent ws-1, pid "), "{e}");
        let other = claim(dir.path(), &gpus[1..], "ws-2").unwrap();
        drop(first);
        claim(dir.path(), &gpus[..1], "ws-3").unwrap();
        drop(other);
    }

    #[test]
    fn a_lock_dir_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let locks = dir.path().join("gpus");
        std::fs::create_dir(&locks).unwrap();
        std::fs::set_permissions(&locks, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = claim(&locks, &["GPU-aaaa".to_string()], "ws-1").unwrap_err();
        assert!(e.contains("that no one else can write") && e.contains("mode 777"), "{e}");
    }
}
