//! A disk of its own for each job slot, so a job cannot fill the host's disk: a sparse image
//! file of the slot's size, formatted ext4 (no journal: its contents live for one job) and
//! loop-mounted `nosuid,nodev,noatime,discard` on the slot's work directory (`discard`: what
//! a job frees goes back to the host, the image stays sparse). A job's workspace, and
//! the caches restored into it, live there; past the size its writes fail with "No space
//! left on device" and the host disk never sees them.
//!
//! Made once per slot when the agent starts (formatting takes tens of milliseconds: the image
//! is sparse and inode tables are initialised lazily), wiped between jobs like any workspace,
//! unmounted when the agent stops. Needs root and loop devices; where either is missing,
//! [`SlotDisk::create`] says why and the agent decides (it refuses jobs unless told to run
//! without a quota).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One slot's disk, mounted while this lives.
#[derive(Debug)]
pub struct SlotDisk {
    image: PathBuf,
    mount: PathBuf,
    size: u64,
}

impl SlotDisk {
    /// Make a fresh disk of `size` bytes in `image` and mount it on `mount` (created 0711:
    /// job users pass through to their workspace, never list). Whatever an earlier run left
    /// there (a mount, an image) is replaced.
    pub fn create(image: &Path, mount: &Path, size: u64) -> Result<SlotDisk, String> {
        use std::os::unix::fs::OpenOptionsExt;
        if is_mountpoint(mount) {
            unmount(mount);
        }
        std::fs::create_dir_all(mount).map_err(|e| format!("creating {}: {e}", mount.display()))?;
        if let Some(dir) = image.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        let _ = std::fs::remove_file(image);
        // 0600: the image holds the slot's workspaces; `debugfs` reads them from any copy.
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(image)
            .map_err(|e| format!("creating {}: {e}", image.display()))?;
        file.set_len(size).map_err(|e| format!("sizing {} to {size} bytes: {e}", image.display()))?;
        drop(file);
        // 1% reserved for root, which the job (never root) cannot use: the agent's clean-up
        // needs room when a job filled the disk to the last block (emptying a directory moves
        // its entries up, and the directory they go to may need a block; an outsider's full
        // disk left a workspace nobody could remove and a slot that failed every later job).
        // Only directories are moved up (files are unlinked where they are), each entry about
        // 32 bytes, each directory an inode: at most 0.2% of the disk (one inode per 16 KiB),
        // 0.8% on disks under 512 MiB (mke2fs's "small" profile: one per 4 KiB).
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "1", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard"])
            .arg(image))?;
        run(Command::new("mount")
            .args(["-t", "ext4", "-o", "loop,nosuid,nodev,noatime,discard"])
            .arg(image)
            .arg(mount))?;
        let disk = SlotDisk { image: image.to_path_buf(), mount: mount.to_path_buf(), size };
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(mount, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| format!("setting mode 0711 on {}: {e}", mount.display()))?;
        let _ = std::fs::remove_dir(mount.join("lost+found"));
        Ok(disk)
    }

    /// Where jobs of this slot put their workspace.
    pub fn path(&self) -> &Path {
        &self.mount
    }

    /// Its size, bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether a job has filled it: less than 1 MiB (or 0.1% of it) left, or nearly no inode
    /// (a job making millions of empty files fills a disk too).
    pub fn is_full(&self) -> bool {
        match nix::sys::statvfs::statvfs(&self.mount) {
            Ok(st) => {
                let free = st.blocks_available().saturating_mul(st.fragment_size());
                free < (1 << 20).max(self.size / 1000) || st.files_available() < (st.files() / 1000).max(16)
            }
            Err(_) => false,
        }
    }
}

impl Drop for SlotDisk {
    fn drop(&mut self) {
        unmount(&self.mount);
        let _ = std::fs::remove_file(&self.image);
    }
}

/// Whether `path` is the root of a mount (its device differs from its parent's).
fn is_mountpoint(path: &Path) -> bool {
    let (Ok(me), Some(Ok(parent))) = (std::fs::metadata(path), path.parent().map(std::fs::metadata)) else {
        return false;
    };
    me.dev() != parent.dev()
}

/// Detach the mount even if something still has it open (its loop device goes with it).
fn unmount(path: &Path) {
    if let Err(e) = run(Command::new("umount").arg("-l").arg(path)) {
        tracing::warn!(path = %path.display(), error = %e, "could not unmount a slot disk");
    }
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let what = format!("{:?}", cmd.get_program());
    let out = cmd.output().map_err(|e| format!("running {what}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_disk_holds_its_size_and_no_more_and_is_gone_when_dropped() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: these tests run as root");
            eprintln!("SKIP: mounting needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (image, mount) = (dir.path().join("slot-0.img"), dir.path().join("slot-0"));
        let disk = SlotDisk::create(&image, &mount, 32 << 20).unwrap_or_else(|e| panic!("{e}"));
        assert!(is_mountpoint(&mount));
        assert!(!disk.is_full());
        // Write past it: the write fails, the host sees only the image's allocated blocks.
        let big = vec![7u8; 1 << 20];
        let mut f = std::fs::File::create(mount.join("fill")).unwrap_or_else(|e| panic!("{e}"));
        let mut written = 0u64;
        let err = loop {
            match std::io::Write::write_all(&mut f, &big) {
                Ok(()) => written += big.len() as u64,
                Err(e) => break e,
            }
            assert!(written <= 64 << 20, "wrote {written} bytes into a 32 MiB disk");
        };
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        drop(f);
        assert!(disk.is_full());
        // Made again (an agent restarted): empty, mounted once.
        drop(disk);
        assert!(!is_mountpoint(&mount) && !image.exists());
        let again = SlotDisk::create(&image, &mount, 32 << 20).unwrap_or_else(|e| panic!("{e}"));
        assert!(!mount.join("fill").exists() && !again.is_full());
    }
}
