//! A small disk of a test's own (a tmpfs), to fill under a coordinator's data dir.
//!
//! Mounting needs root. Under CI (`CI=true`) a test that cannot mount fails rather than skips:
//! the behaviour it checks (what a full disk does) is otherwise never tested. Elsewhere the
//! test is skipped with a note.

use std::io::Write;
use std::path::{Path, PathBuf};

pub struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// Mount a tmpfs of `size` (`8m`), or `None` (with a note) where that is not allowed and
    /// this is not CI.
    pub fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::Builder::new().prefix("gpuci-small-disk-").tempdir().expect("tempdir");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
            .arg(dir.path())
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallDisk { dir }),
            other => {
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                    Err(e) => e.to_string(),
                };
                assert!(
                    std::env::var("CI").as_deref() != Ok("true"),
                    "CI=true but a tmpfs cannot be mounted ({why}); these tests run as root"
                );
                eprintln!("note: skipped: cannot mount a small tmpfs ({why}); run as root to fill a disk");
                None
            }
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Write a file until the disk is full; remove it ([`SmallDisk::free`]) to give the
    /// space back.
    pub fn fill(&self) -> PathBuf {
        let path = self.path().join("filler");
        let mut f = std::fs::File::create(&path).expect("create filler");
        for chunk in [64 * 1024, 512, 1] {
            let buf = vec![0u8; chunk];
            while f.write_all(&buf).is_ok() {}
        }
        let _ = f.sync_all();
        path
    }

    pub fn free(&self, filler: &Path) {
        std::fs::remove_file(filler).expect("remove filler");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // Lazy: a process that still has a file open there does not keep the mount.
        let _ = std::process::Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}
