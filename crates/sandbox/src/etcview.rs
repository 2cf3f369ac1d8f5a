//! The read-only `/etc` view: the allow-listed `/etc` *files* copied once into one directory that
//! bwrap binds onto `/etc` with a single `--ro-bind`, instead of one bind per entry.
//!
//! Why: every bind costs bwrap a mount, a remount and a read of `/proc/self/mountinfo` (which
//! grows with each mount): 19 `/etc` binds were ~3.5 ms of a ~9.5 ms bwrap start on the 2-core
//! test VM. The view plus the few allow-listed *directories* (bound live on top, see below) cost
//! ~0.6 ms.
//!
//! What is in it: for each `plan::ETC_ALLOW` entry that is, after following symlinks, a regular
//! file, a copy of its content with the source's mode bits (without set-id bits) and owner. That
//! is exactly what the per-entry bind showed (bwrap binds the symlink's target, so the job saw a
//! file). Allow-listed entries that are directories (`ssl/`, `alternatives/`, ...) or anything
//! else are *not* copied: the view only holds an empty mount point for them and the plan binds
//! them read-only on top, live, as before. Nothing outside `ETC_ALLOW` is ever copied.
//!
//! Freshness: on every spawn the sources are `stat`ed (following symlinks; ~30 stats, ~0.05 ms)
//! and compared with what the current view was built from (device, inode, size, mtime, ctime,
//! mode, owner). Any difference (an edited `resolv.conf`, a replaced `passwd`, a `hosts` that
//! appeared) builds a new view generation before the job starts; jobs still running keep the
//! generation they were started with, and its directory is removed when the last of them is done.
//!
//! Where: `/run/gpuci-sandbox/etc.<agent pid>.<generation>`. `/run` is root-only writable, is not
//! visible in any sandbox (the mount plan never binds it), is not under the agent's data dir or
//! the workspaces (which are bound read-write into jobs, or hidden paths), and is cleared at boot.
//! Directories of agent processes that died are removed when the next agent process builds its
//! first view. Inside the sandbox the view is a read-only, `nosuid,nodev` bind and the job holds
//! no capabilities, so it can neither write it nor remount it. A job under `Isolation::None` (the
//! explicit opt-out) runs as the agent's uid on the host and could write it, but such a job can
//! already write the host's `/etc` and `/usr` that every later job sees: the view adds no reach.
//!
//! When the view cannot be built (agent not root, `/run` not writable, a copy failing) the plan
//! falls back to one bind per entry, with a debug log.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};

use crate::plan::ETC_ALLOW;

/// Parent of every view directory.
pub(crate) const RUN_DIR: &str = "/run/gpuci-sandbox";

/// One built generation. Its directory is removed when the last holder drops it.
#[derive(Debug)]
pub(crate) struct EtcView {
    /// Bound onto `/etc`.
    pub(crate) dir: PathBuf,
    /// Allow-listed entries that are not regular files (directories, mostly): the plan binds
    /// each (`/etc/...`) on top of the view; the view holds a mount point for each.
    pub(crate) binds: Vec<PathBuf>,
    fingerprint: Vec<Stamp>,
}

impl Drop for EtcView {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// What identifies one source's content, as far as `stat` can tell.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    mode: u32,
    uid: u32,
    gid: u32,
}

fn stamp(p: &Path) -> Option<Stamp> {
    let m = fs::metadata(p).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
        mode: m.mode(),
        uid: m.uid(),
        gid: m.gid(),
    })
}

/// One stamp slot per `ETC_ALLOW` entry (a missing entry is a zeroed stamp).
fn fingerprint() -> Vec<Stamp> {
    let missing = Stamp { dev: 0, ino: 0, size: 0, mtime: (0, 0), ctime: (0, 0), mode: 0, uid: 0, gid: 0 };
    ETC_ALLOW.iter().map(|e| stamp(&Path::new("/etc").join(e)).unwrap_or_else(|| missing.clone())).collect()
}

static CURRENT: Mutex<Option<Arc<EtcView>>> = Mutex::new(None);
static GENERATION: AtomicU64 = AtomicU64::new(0);
static SWEEP: Once = Once::new();

/// The current view, rebuilt first when a source changed. `None`: use per-entry binds.
pub(crate) fn current() -> Option<Arc<EtcView>> {
    let fp = fingerprint();
    let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(v) = cur.as_ref() {
        if v.fingerprint == fp {
            return Some(Arc::clone(v));
        }
    }
    SWEEP.call_once(sweep_dead);
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
    let dir = Path::new(RUN_DIR).join(format!("etc.{}.{generation}", std::process::id()));
    match build(&dir, &fp) {
        Ok(binds) => {
            let view = Arc::new(EtcView { dir, binds, fingerprint: fp });
            // The generation this replaces is removed once the jobs holding it are done.
            *cur = Some(Arc::clone(&view));
            Some(view)
        }
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "cannot build the /etc view; binding /etc entries one by one");
            let _ = fs::remove_dir_all(&dir);
            *cur = None;
            None
        }
    }
}

fn build(dir: &Path, fp: &[Stamp]) -> io::Result<Vec<PathBuf>> {
    crate::host::ensure_run_dir(Path::new(RUN_DIR))?;
    let _ = fs::remove_dir_all(dir);
    fs::create_dir(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
    let mut binds = Vec::new();
    for (e, st) in ETC_ALLOW.iter().zip(fp) {
        if st.ino == 0 && st.dev == 0 {
            continue;
        }
        let src = Path::new("/etc").join(e);
        let dst = dir.join(e);
        if let Some(parent) = dst.parent() {
            // `ssh/` for `ssh/ssh_config`.
            fs::create_dir_all(parent)?;
        }
        let m = fs::metadata(&src)?;
        if m.is_file() {
            copy_file(&src, &dst, &m)?;
        } else {
            // A mount point for the bind the plan puts on top.
            if m.is_dir() {
                fs::create_dir(&dst)?;
            } else {
                File::create(&dst)?;
            }
            binds.push(src);
        }
    }
    Ok(binds)
}

fn copy_file(src: &Path, dst: &Path, m: &fs::Metadata) -> io::Result<()> {
    let mut from = File::open(src)?;
    let mut to = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(dst)?;
    io::copy(&mut from, &mut to)?;
    std::os::unix::fs::fchown(&to, Some(m.uid()), Some(m.gid()))?;
    // Mode last (chown clears set-id bits anyway; they are dropped here too).
    to.set_permissions(fs::Permissions::from_mode(m.mode() & 0o777))?;
    Ok(())
}

/// Removes the view directories of agent processes that are gone.
fn sweep_dead() {
    let Ok(rd) = fs::read_dir(RUN_DIR) else { return };
    let me = std::process::id();
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("etc.")).and_then(|n| n.split('.').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else { continue };
        if pid as u32 == me {
            continue;
        }
        let gone =
            matches!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None), Err(nix::errno::Errno::ESRCH));
        if gone {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_has_one_slot_per_entry() {
        assert_eq!(fingerprint().len(), ETC_ALLOW.len());
    }

    /// Only meaningful as root (the view is not built otherwise); then it must hold copies of
    /// allow-listed files only, and the same view is reused while nothing changed.
    #[test]
    fn view_holds_only_allow_listed_entries_and_is_reused() {
        let Some(v) = current() else {
            eprintln!("skipped: no /etc view here (not root?)");
            return;
        };
        let again = current().expect("view");
        assert!(Arc::ptr_eq(&v, &again), "unchanged sources must reuse the view");
        let mut stack = vec![v.dir.clone()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).expect("read view").flatten() {
                let rel = e.path().strip_prefix(&v.dir).expect("inside").to_path_buf();
                let ok = ETC_ALLOW.iter().any(|a| Path::new(a) == rel || Path::new(a).starts_with(&rel));
                assert!(ok, "{} is not allow-listed", rel.display());
                if e.file_type().expect("type").is_dir() && !v.binds.contains(&Path::new("/etc").join(&rel)) {
                    stack.push(e.path());
                }
            }
        }
        assert!(!v.dir.join("shadow").exists());
    }
}
