//! The coordinator's files are private: the data dir is 0700 and the tokens, the secrets key
//! and the SQLite files in it are 0600, set explicitly so the umask does not matter. A data
//! dir or file found looser (made by an older gpuci, or by hand) is tightened at start with a
//! warning that says what changed. Config files holding credentials (the `[github]` section's
//! App key, webhook secret, token) are the operator's: they are warned about, not changed.
//!
//! Permissions are the second line. A job runs on the same host, possibly as root (which
//! ignores modes), so the local agent also hides every path here from jobs
//! ([`Config::private_paths`](crate::Config::private_paths)).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("data dir {path}: {source}")]
    Dir { path: PathBuf, source: std::io::Error },
    #[error("{path}: setting mode {mode:o}: {source}")]
    Mode { path: PathBuf, mode: u32, source: std::io::Error },
}

/// Files in the data dir that hold credentials or secret values.
pub const PRIVATE_FILES: &[&str] =
    &["api-token", "registration-token", "secrets.key", "gpuci.db", "gpuci.db-wal", "gpuci.db-shm"];

/// Directories in the data dir: private like the files.
pub const PRIVATE_DIRS: &[&str] = &["uploads"];

/// Create the data dir (0700, or 0711 when `traversable`) or tighten it and the private files
/// and directories in it.
pub fn prepare(dir: &Path, traversable: bool) -> Result<(), DataDirError> {
    let mode = if traversable { 0o711 } else { 0o700 };
    let set = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(|source| DataDirError::Mode {
            path: p.to_path_buf(),
            mode,
            source,
        })
    };
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(|source| DataDirError::Dir { path: dir.to_path_buf(), source })?;
        // New: private from the start, no news to report.
        set(dir, mode)?;
    }
    let was = mode_of(dir);
    let now = (was & !0o077) | (mode & 0o011);
    if now != was {
        set(dir, now)?;
        if was & 0o066 != 0 {
            tracing::warn!(path = %dir.display(), was = %format!("{was:04o}"), now = %format!("{now:04o}"),
                "tightened permissions: this holds credentials and was open to other users");
        } else {
            tracing::info!(path = %dir.display(), was = %format!("{was:04o}"), now = %format!("{now:04o}"),
                "data dir mode set (0711 when job users must pass through to workspaces below it)");
        }
    }
    for d in PRIVATE_DIRS {
        let p = dir.join(d);
        if !p.exists() {
            std::fs::create_dir_all(&p).map_err(|source| DataDirError::Dir { path: p.clone(), source })?;
            set(&p, 0o700)?;
        }
        restrict(&p)?;
    }
    for f in PRIVATE_FILES {
        restrict(&dir.join(f))?;
    }
    Ok(())
}

fn mode_of(p: &Path) -> u32 {
    std::fs::metadata(p).map(|m| m.permissions().mode() & 0o7777).unwrap_or(0)
}

/// Remove the group and other bits of `path` if it exists (0644 → 0600, 0755 → 0700), with a
/// warning when that changed something.
pub fn restrict(path: &Path) -> Result<(), DataDirError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(DataDirError::Dir { path: path.to_path_buf(), source }),
    };
    if meta.file_type().is_symlink() {
        // The mode of a link means nothing; its target is tightened where it lives.
        return match std::fs::canonicalize(path) {
            Ok(target) => restrict(&target),
            Err(_) => Ok(()),
        };
    }
    let was = meta.permissions().mode() & 0o7777;
    let now = was & !0o077;
    if now != was {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(now)).map_err(|source| DataDirError::Mode {
            path: path.to_path_buf(),
            mode: now,
            source,
        })?;
        tracing::warn!(path = %path.display(), was = %format!("{was:04o}"), now = %format!("{now:04o}"),
            "tightened permissions: this holds credentials and was open to other users");
    }
    Ok(())
}

/// The group/other read or write bits of `path` when any are set (None when private or
/// absent; search-only `x`, 0711, lets others pass through, not list or read).
pub fn exposed(path: &Path) -> Option<u32> {
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o066;
    (mode != 0).then_some(mode)
}

/// Warn when a file the operator owns that holds credentials is readable by others.
pub fn warn_if_exposed(path: &Path, what: &str) {
    if let Some(bits) = exposed(path) {
        tracing::warn!(path = %path.display(), mode = %format!("{bits:04o}"),
            "{what} holds credentials but is open to group or other users; chmod 600 it");
    }
}

/// Write a new file readable by its owner only, atomically, failing if it exists.
pub fn create_private(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(contents)?;
    f.sync_all()?;
    drop(f);
    // hard_link + remove, not rename: a file someone else created meanwhile is not replaced.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpuci-datadir-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{e}"));
        d
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).map(|m| m.permissions().mode() & 0o777).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn loose_data_dirs_and_files_are_tightened_and_others_left_alone() {
        let root = tempdir();
        let dir = root.join("data");
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap_or_else(|e| panic!("{e}"));
        for f in ["api-token", "gpuci.db", "gpuci.db-wal", "unrelated"] {
            std::fs::write(dir.join(f), "x").unwrap_or_else(|e| panic!("{e}"));
            std::fs::set_permissions(dir.join(f), std::fs::Permissions::from_mode(0o644))
                .unwrap_or_else(|e| panic!("{e}"));
        }
        prepare(&dir, false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mode(&dir), 0o700);
        for f in ["api-token", "gpuci.db", "gpuci.db-wal"] {
            assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
        }
        assert_eq!(mode(&dir.join("unrelated")), 0o644);
        assert_eq!(exposed(&dir.join("unrelated")), Some(0o044));
        assert_eq!(exposed(&dir), None);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn new_data_dirs_are_private_whatever_the_umask() {
        let root = tempdir();
        let dir = root.join("a/b");
        prepare(&dir, false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("uploads")), 0o700);
        // A local agent's workspaces below: job users pass through, never list.
        prepare(&dir, true).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mode(&dir), 0o711);
        assert_eq!(exposed(&dir), None);
        create_private(&dir.join("secrets.key"), b"k").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mode(&dir.join("secrets.key")), 0o600);
        assert!(create_private(&dir.join("secrets.key"), b"other").is_err(), "an existing file is never replaced");
        assert_eq!(std::fs::read(dir.join("secrets.key")).unwrap_or_default(), b"k");
        let _ = std::fs::remove_dir_all(root);
    }
}
