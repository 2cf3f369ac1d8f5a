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

/// The I/O error is part of the message and deliberately not a `source`: a chain printer
/// (`{:#}`) would print it twice.
#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("data dir {path}: {error}")]
    Dir { path: PathBuf, error: std::io::Error },
    #[error("{path}: setting mode {mode:o}: {error}")]
    Mode { path: PathBuf, mode: u32, error: std::io::Error },
    #[error(
        "database {path} is {what}, but this data dir was used before (found {found}); starting would \
         create a new, empty database: pipelines, jobs, registered agents and secrets would be gone \
         and agents would be refused{wal}. Restore {path} from a backup, or pass --new-database to \
         start over with an empty database on purpose (also on a first start in a data dir where you \
         wrote the token files yourself)"
    )]
    DatabaseGone { path: PathBuf, what: &'static str, found: String, wal: String },
    #[error(
        "--new-database: {path} already holds a database ({bytes} bytes) and is never replaced; \
         leave the flag out to use it, or move the file away first"
    )]
    DatabaseExists { path: PathBuf, bytes: u64 },
    #[error(
        "another coordinator ({holder}) uses the data dir {path}: two would each take the other's agents \
         for gone ones and end their jobs `lost`; each coordinator needs a data dir of its own"
    )]
    InUse { path: PathBuf, holder: String },
}

/// Locks the data dir itself for this coordinator's life (`flock` on the directory, released
/// when the process ends, however it ends; a lock file could be deleted under a running
/// coordinator) and writes this pid to `<dir>/lock` for the next one to name; or says which
/// process holds it.
pub fn lock(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, DataDirError> {
    let io = |error| DataDirError::Dir { path: dir.to_path_buf(), error };
    let handle = std::fs::File::open(dir).map_err(io)?;
    let pid_file = dir.join("lock");
    // Retried for up to 3 s: a coordinator killed while a child of it was between `fork` and
    // `exec` leaves that child holding the lock for some milliseconds.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    let mut handle = handle;
    let locked = loop {
        match nix::fcntl::Flock::lock(handle, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Err((back, nix::errno::Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                handle = back;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            other => break other,
        }
    };
    match locked {
        Ok(held) => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&pid_file)
                .and_then(|mut f| writeln!(f, "{}", std::process::id()))
                .map_err(io)?;
            Ok(held)
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            let pid = std::fs::read_to_string(&pid_file).unwrap_or_default();
            Err(DataDirError::InUse {
                path: dir.to_path_buf(),
                holder: format!("pid {}", if pid.trim().is_empty() { "unknown" } else { pid.trim() }),
            })
        }
        Err((_, e)) => Err(io(e.into())),
    }
}

/// Files in the data dir that hold credentials or secret values.
pub const PRIVATE_FILES: &[&str] =
    &["api-token", "registration-token", "secrets.key", "gpuci.db", "gpuci.db-wal", "gpuci.db-shm", DATABASE_MADE];

/// Written into the data dir once the coordinator has made its database, wherever that lies:
/// from then on a missing, empty or foreign database is refused (see [`check_database`]),
/// whatever else the dir holds.
pub const DATABASE_MADE: &str = "database-made";

/// Directories in the data dir: private like the files.
pub const PRIVATE_DIRS: &[&str] = &["uploads"];

/// Create the data dir (0700, or 0711 when `traversable`) or tighten it and the private files
/// and directories in it.
pub fn prepare(dir: &Path, traversable: bool) -> Result<(), DataDirError> {
    let mode = if traversable { 0o711 } else { 0o700 };
    let set = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(|error| DataDirError::Mode {
            path: p.to_path_buf(),
            mode,
            error,
        })
    };
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(|error| DataDirError::Dir { path: dir.to_path_buf(), error })?;
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
            std::fs::create_dir_all(&p).map_err(|error| DataDirError::Dir { path: p.clone(), error })?;
            set(&p, 0o700)?;
        }
        restrict(&p)?;
    }
    for f in PRIVATE_FILES {
        restrict(&dir.join(f))?;
    }
    Ok(())
}

/// Files a coordinator writes into its data dir (the marker of its database, the tokens, the
/// secrets key, SQLite's own `-wal` and `-shm` left by a crash): finding one shows the dir was
/// used before. Written in this order at a first start: the database and its marker, then
/// the tokens, so a first start cut short leaves no sign without a database.
const SIGNS_OF_USE: &[&str] =
    &[DATABASE_MADE, "api-token", "registration-token", "secrets.key", "gpuci.db-wal", "gpuci.db-shm"];

/// What in `dir` shows it was used before (empty: a new data dir).
pub fn signs_of_use(dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = SIGNS_OF_USE.iter().filter(|f| dir.join(f).exists()).map(|f| f.to_string()).collect();
    let uploads = std::fs::read_dir(dir.join("uploads")).map(|d| d.count()).unwrap_or(0);
    if uploads > 0 {
        found.push(format!("{uploads} upload(s)"));
    }
    found
}

/// Record that this data dir's database exists ([`DATABASE_MADE`]); once.
pub fn mark_database_made(dir: &Path, db: &str) -> std::io::Result<()> {
    let path = dir.join(DATABASE_MADE);
    if path.exists() {
        return Ok(());
    }
    let text = format!(
        "gpuci made its database ({db}) for this data dir; it refuses to start without it (see gpuci server \
         --help, --new-database)\n"
    );
    create_private(&path, text.as_bytes())?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Refuse to open a SQLite database `db` that is missing or empty (0 bytes) in a data dir
/// that was used before, unless the operator asked for a new one (`new_database`). SQLite
/// would quietly make a new, empty database of it (and throw away a `-wal` beside an empty
/// file): every job and agent gone, and agents retrying forever with a credential nobody
/// knows. A new database is never made over one that holds data.
///
/// Returns whether the database must already be gpuci's (a used data dir, no
/// `--new-database`): the caller then opens it with
/// [`open_existing`](gpuci_store::SqliteStore::open_existing), which refuses a file without
/// gpuci's tables.
pub fn check_database(dir: &Path, db: &Path, new_database: bool) -> Result<bool, DataDirError> {
    let size = match std::fs::metadata(db) {
        Ok(m) => Some(m.len()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => return Err(DataDirError::Dir { path: db.to_path_buf(), error }),
    };
    match (size, new_database) {
        (Some(bytes), true) if bytes > 0 => Err(DataDirError::DatabaseExists { path: db.to_path_buf(), bytes }),
        (Some(bytes), false) if bytes > 0 => Ok(!signs_of_use(dir).is_empty()),
        (_, true) => {
            tracing::warn!(path = %db.display(), "starting a new, empty database (--new-database)");
            Ok(false)
        }
        (size, false) => {
            let found = signs_of_use(dir);
            if found.is_empty() {
                // A new data dir: its database is made now.
                return Ok(false);
            }
            let mut wal = db.as_os_str().to_owned();
            wal.push("-wal");
            let wal = match std::fs::metadata(&wal) {
                Ok(m) if m.len() > 0 => format!(
                    "; {} ({} bytes) lies beside it and may hold the latest changes: keep a copy",
                    Path::new(&wal).display(),
                    m.len()
                ),
                _ => String::new(),
            };
            Err(DataDirError::DatabaseGone {
                path: db.to_path_buf(),
                what: if size.is_some() { "empty (0 bytes)" } else { "missing" },
                found: found.join(", "),
                wal,
            })
        }
    }
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
        Err(error) => return Err(DataDirError::Dir { path: path.to_path_buf(), error }),
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
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(now)).map_err(|error| DataDirError::Mode {
            path: path.to_path_buf(),
            mode: now,
            error,
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

    #[test]
    fn a_used_data_dir_without_its_database_is_refused_unless_a_new_one_is_asked_for() {
        let root = tempdir();
        let dir = root.join("data");
        let db = dir.join("gpuci.db");
        prepare(&dir, false).unwrap_or_else(|e| panic!("{e}"));
        // New: nothing shows it was used, so the database is made, and need not be gpuci's yet.
        assert!(!check_database(&dir, &db, false).unwrap_or_else(|e| panic!("{e}")));
        // Any one sign of use is enough: the marker (whatever else is elsewhere: a secrets
        // key kept outside the data dir), or a token alone, or a 0-byte file beside one.
        for sign in [DATABASE_MADE, "registration-token", "api-token", "secrets.key"] {
            std::fs::write(dir.join(sign), "t").unwrap_or_else(|e| panic!("{e}"));
            let missing = check_database(&dir, &db, false).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(missing.contains("is missing") && missing.contains(&format!("(found {sign})")), "{missing}");
            assert!(missing.contains("--new-database"), "{missing}");
            std::fs::write(&db, "").unwrap_or_else(|e| panic!("{e}"));
            let empty = check_database(&dir, &db, false).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(empty.contains("is empty (0 bytes)"), "{empty}");
            std::fs::remove_file(&db).unwrap_or_else(|e| panic!("{e}"));
            std::fs::remove_file(dir.join(sign)).unwrap_or_else(|e| panic!("{e}"));
        }
        std::fs::write(dir.join("secrets.key"), "k").unwrap_or_else(|e| panic!("{e}"));

        std::fs::write(&db, "").unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(dir.join("gpuci.db-wal"), "w").unwrap_or_else(|e| panic!("{e}"));
        let empty = check_database(&dir, &db, false).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(empty.contains("is empty (0 bytes)") && empty.contains("gpuci.db-wal (1 bytes)"), "{empty}");

        assert!(!check_database(&dir, &db, true).unwrap_or_else(|e| panic!("{e}")));
        std::fs::write(&db, "data").unwrap_or_else(|e| panic!("{e}"));
        assert!(check_database(&dir, &db, false).unwrap_or_else(|e| panic!("{e}")), "it must be gpuci's");
        let kept = check_database(&dir, &db, true).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(kept.contains("already holds a database (4 bytes)"), "{kept}");
        let _ = std::fs::remove_dir_all(root);
    }
}
