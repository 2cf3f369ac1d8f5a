//! The agent's store of steps' `cache:` trees, under `<data-dir>/cache/`.
//!
//! Which caches a job restores and where its own goes is decided by the coordinator
//! (`gpuci_core::cache::scope`, by the pipeline's origin); this module only carries it out:
//!
//! - **Restore**: each cached path comes from the first key of the scope that has it. From
//!   the job's own save key it is *moved* (cheap, and two jobs of one scope at once never
//!   share half-written files: the second starts without it); from any other key (a base
//!   branch's cache read by a pull request) it is *copied*, so the reader cannot change it.
//! - **Save**: only to the save key; a read-only scope saves nothing. The tree is moved out
//!   of the workspace into a staging directory no job can reach, then cleaned before it
//!   becomes the cache: set-uid/set-gid/sticky bits are stripped, files with other hard
//!   links are replaced by a copy (so a chmod never touches a file outside the tree), symlinks
//!   that lead outside the cached path are dropped, and anything that is not a regular file,
//!   directory or symlink (devices, FIFOs, sockets) makes that path not saved at all.
//! - **Limits**: a job's cache over [`CacheLimits::entry`] bytes or
//!   [`CacheLimits::entry_files`] entries is not saved (the job's log says so). Room on the
//!   agent is shared by the rules of `gpuci_core::cache::plan_save` ([`CacheQuota`], by
//!   default split from [`CacheLimits::total`]): a quota per repository and trust class, a
//!   share for all untrusted caches, and the total, where an untrusted save never removes a
//!   trusted cache. Before a save lands, the store lists its caches and removes what the plan
//!   says, or refuses the save (the job's log says why). A job of an untrusted origin
//!   (`Assignment::trusted`) never writes a trusted key, whatever its scope says. Sizes count
//!   what the agent's disk would spend: a file its apparent length (sparse files are copied
//!   whole), and every entry at least one 4 KiB block. Nothing walks a tree by recursion
//!   (`crate::fstree::walk`): a job decides how deep it is.
//!
//! The agent is often root and the trees were made by hostile jobs: nothing here follows a
//! link a job made. Paths are checked with `symlink_metadata` ([`plain_path`]), files are
//! opened with `O_NOFOLLOW`, links are read, never resolved by the kernel. Cache directories
//! are named `<t|u>-<repository hash>-<key hash>`: the trust class and repository a quota
//! needs, and no repository or branch name as a path. (Caches named the older way, by the
//! key's hash alone, cannot be charged to a repository and are removed when the agent
//! starts: they are caches, the next job builds them again.)

use gpuci_core::cache::{plan_save, CacheKey, CacheQuota, CacheScope, SaveRequest, StoredCache, Trust};
use gpuci_core::quantity::Bytes;
use sha2::{Digest, Sha256};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// Size limits of the store (agent settings, `gpuci agent --cache-max-entry-size` and
/// `--cache-max-total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLimits {
    /// What one job may save (all its `cache:` paths together). Default 10 GiB.
    pub entry: Bytes,
    /// All caches together (split by [`CacheQuota::for_total`] unless the agent is given a
    /// quota). Default 50 GiB.
    pub total: Bytes,
    /// Files, directories and links one job may save. Default 1,000,000.
    pub entry_files: u64,
}

impl Default for CacheLimits {
    fn default() -> Self {
        CacheLimits { entry: Bytes(10 * Bytes::GIB), total: Bytes(50 * Bytes::GIB), entry_files: 1_000_000 }
    }
}

/// The cache directory of one agent. Operations hold one lock: a save, its eviction and a
/// restore never interleave.
#[derive(Debug)]
pub struct CacheStore {
    root: PathBuf,
    limits: CacheLimits,
    quota: CacheQuota,
    lock: std::sync::Mutex<()>,
}

/// Hex digits of the repository's and of the key's sha256 in a cache directory's name.
const REPO_LEN: usize = 16;
const KEY_LEN: usize = 32;

impl CacheStore {
    /// The store at `root`. What a crash left half-done (staging directories) and caches
    /// named as older versions named them (per repository only, not per trust class: they
    /// must never be restored) are removed.
    pub fn open(root: PathBuf, limits: CacheLimits) -> Self {
        Self::open_with_quota(root, limits, CacheQuota::for_total(limits.total))
    }

    /// [`CacheStore::open`] with room shared by `quota` (its total is the store's).
    pub fn open_with_quota(root: PathBuf, limits: CacheLimits, quota: CacheQuota) -> Self {
        if let Ok(dir) = std::fs::read_dir(&root) {
            for e in dir.flatten() {
                let name = e.file_name();
                if entry_name(&name.to_string_lossy()).is_none() {
                    tracing::info!(path = %e.path().display(), "removing a leftover or old-format cache directory");
                    let _ = remove_any(&e.path());
                }
            }
        }
        CacheStore { root, limits, quota, lock: std::sync::Mutex::new(()) }
    }

    fn dir(&self, key: &CacheKey) -> PathBuf {
        let hash = hex::encode(Sha256::digest(key.identity().as_bytes()));
        let class = match key.trust {
            Trust::Trusted => 't',
            Trust::Untrusted => 'u',
        };
        self.root.join(format!("{class}-{}-{}", &repository_hash(key)[..REPO_LEN], &hash[..KEY_LEN]))
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bring `paths` (relative to the workspace) from the scope's caches into `workspace`.
    /// Returns lines for the job's log.
    pub fn restore(&self, scope: &CacheScope, paths: &[String], workspace: &Path) -> Vec<String> {
        let _held = self.locked();
        let mut log = Vec::new();
        for rel in paths {
            let Some(to) = plain_path(workspace, rel) else {
                log.push(format!("cache: not restoring {rel}: a symlink is on its path in the workspace"));
                continue;
            };
            if let Ok(m) = std::fs::symlink_metadata(&to) {
                // An empty directory from the upload is fine to replace; anything else is the job's own.
                if !(m.is_dir() && std::fs::remove_dir(&to).is_ok()) {
                    log.push(format!("cache: not restoring {rel}: the workspace already has it"));
                    continue;
                }
            }
            let found = scope.restore.iter().find_map(|key| {
                let from = plain_path(&self.dir(key), rel)?;
                std::fs::symlink_metadata(&from).ok().map(|_| (key, from))
            });
            let Some((key, from)) = found else {
                log.push(format!("cache: {rel} is empty (first run, or another job has it)"));
                continue;
            };
            if let Some(parent) = to.parent() {
                // Every existing directory on the way was checked by `plain_path`, and
                // nothing else writes the workspace before the job starts.
                let _ = std::fs::create_dir_all(parent);
            }
            let own = scope.save.as_ref() == Some(key);
            let result = if own { move_tree(&from, &to) } else { copy_tree(&from, &to) };
            touch(&self.dir(key));
            match result {
                Ok(()) if own => log.push(format!("cache: restored {rel} from {key}")),
                Ok(()) => log.push(format!("cache: restored {rel} from {key}, read-only: this job saves elsewhere")),
                Err(e) => {
                    let _ = remove_any(&to);
                    log.push(format!("cache: could not restore {rel} from {key}: {e}"));
                }
            }
        }
        log
    }

    /// Keep `paths` of `workspace` under the scope's save key, for a job whose origin is
    /// trusted or not (`job_trusted`, from its assignment). Returns lines for the job's log.
    pub fn save(&self, scope: &CacheScope, job_trusted: bool, paths: &[String], workspace: &Path) -> Vec<String> {
        let mut log = Vec::new();
        let Some(key) = &scope.save else {
            if !scope.restore.is_empty() {
                log.push("cache: not saved: jobs of this pipeline only read caches".to_string());
            }
            return log;
        };
        let request = |bytes: u64| SaveRequest {
            id: self.dir(key),
            repository: repository_hash(key)[..REPO_LEN].to_string(),
            trust: key.trust,
            job_trusted,
            bytes,
        };
        let _held = self.locked();
        let staging = self.root.join(format!(".staging-{:016x}", rand::random::<u64>()));
        if let Err(e) = std::fs::create_dir_all(&staging) {
            log.push(format!("cache: could not save: {}: {e}", staging.display()));
            return log;
        }
        let mut staged: Vec<(&String, PathBuf)> = Vec::new();
        // Measured where the job left it, before anything is copied: a job's sparse file costs
        // nothing on its slot's disk but its whole length once copied to the agent's disk, so
        // the apparent size is what counts, and a cache over the limit is never copied at all.
        let planned = paths
            .iter()
            .filter_map(|rel| plain_path(workspace, rel))
            .try_fold(Size::default(), |sum, from| measure(&from).map(|s| sum.plus(s)));
        // Refused by its size alone, before anything is moved (the quota with nothing stored).
        let refused = match planned {
            Ok(size) => size
                .over(&self.limits)
                .or_else(|| plan_save::<PathBuf>(&[], &request(size.bytes), &self.quota).err().map(|e| e.to_string())),
            Err(e) => Some(format!("could not measure it: {e}")),
        };
        if let Some(why) = refused {
            log.push(format!("cache: not saved: {why}"));
            let _ = std::fs::remove_dir(&staging);
            return log;
        }
        let mut total = Size::default();
        for (i, rel) in paths.iter().enumerate() {
            let Some(from) = plain_path(workspace, rel) else {
                log.push(format!("cache: not saving {rel}: a symlink is on its path"));
                continue;
            };
            if std::fs::symlink_metadata(&from).is_err() {
                continue;
            }
            let tree = staging.join(i.to_string());
            if let Err(e) = move_tree(&from, &tree) {
                let _ = remove_any(&tree);
                log.push(format!("cache: could not save {rel}: {e}"));
                continue;
            }
            let mut clean = Cleaned::default();
            match clean.walk(&tree) {
                Ok(()) => {
                    for link in &clean.dropped {
                        log.push(format!(
                            "cache: {rel}: dropped the symlink {} (it leads outside {rel})",
                            link.display()
                        ));
                    }
                    total = total.plus(clean.size);
                    staged.push((rel, tree));
                }
                Err(why) => log.push(format!("cache: not saving {rel}: {why}")),
            }
        }
        if let Some(why) = total.over(&self.limits) {
            // It grew between the measure and the move (the job is gone; a process it left cannot be).
            log.push(format!("cache: not saved: {why}"));
            staged.clear();
        }
        let dir = self.dir(key);
        if !staged.is_empty() {
            // What the cache will hold: what it keeps of its old copy, and the new trees.
            let old = measure(&dir).map_or(0, |s| s.bytes);
            let replaced: u64 =
                staged.iter().filter_map(|(rel, _)| measure(&plain_path(&dir, rel)?).ok()).map(|s| s.bytes).sum();
            let bytes = old.saturating_sub(replaced).max(Size::BLOCK).saturating_add(total.bytes);
            match plan_save(&self.stored(), &request(bytes), &self.quota) {
                Ok(evict) => {
                    for path in evict {
                        tracing::info!(path = %path.display(), cache = %key, "removing a cache to make room for another");
                        let _ = remove_any(&path);
                    }
                }
                Err(why) => {
                    log.push(format!("cache: not saved: {why}"));
                    staged.clear();
                }
            }
        }
        for (i, (rel, tree)) in staged.iter().enumerate() {
            let _ = std::fs::create_dir_all(&dir);
            let Some(to) = plain_path(&dir, rel) else {
                log.push(format!("cache: not saving {rel}: another cached path holds a symlink on its way"));
                continue;
            };
            if std::fs::symlink_metadata(&to).is_ok() {
                let _ = std::fs::rename(&to, staging.join(format!("old-{i}")));
            }
            if let Some(parent) = to.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            match std::fs::rename(tree, &to) {
                Ok(()) => log.push(format!("cache: saved {rel} to {key}")),
                Err(e) => log.push(format!("cache: could not save {rel}: {e}")),
            }
        }
        let _ = remove_any(&staging);
        if dir.exists() {
            touch(&dir);
        }
        log
    }

    /// Every cache in the store, as the quota sees it: its class and repository (from its
    /// name), its size, and when it was last used (its directory's modification time, set on
    /// every restore and save).
    fn stored(&self) -> Vec<StoredCache<PathBuf>> {
        let Ok(dir) = std::fs::read_dir(&self.root) else { return Vec::new() };
        dir.flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                let (trust, repository) = entry_name(&name)?;
                let m = std::fs::symlink_metadata(e.path()).ok()?;
                // A cache that cannot be measured is charged as over every limit: nothing fits
                // beside it, so the next save that may remove it (by its class) does.
                let bytes = measure(&e.path()).map_or(u64::MAX, |s| s.bytes);
                let last_used = m.modified().unwrap_or(std::time::UNIX_EPOCH);
                Some(StoredCache { id: e.path(), repository: repository.to_string(), trust, bytes, last_used })
            })
            .collect()
    }
}

/// The hash of a key's repository that names its caches (the same for every key of it).
fn repository_hash(key: &CacheKey) -> String {
    hex::encode(Sha256::digest(key.repository.as_bytes()))
}

/// The trust class and repository hash of a cache directory's name; `None`: not a cache.
fn entry_name(name: &str) -> Option<(Trust, &str)> {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let mut parts = name.splitn(3, '-');
    let trust = match parts.next()? {
        "t" => Trust::Trusted,
        "u" => Trust::Untrusted,
        _ => return None,
    };
    let (repository, key) = (parts.next()?, parts.next()?);
    (hex(repository, REPO_LEN) && hex(key, KEY_LEN)).then_some((trust, repository))
}

/// Whether `rel` inside `root` is reached without following a symlink anywhere on the way. A
/// job owns its workspace and could point `.cache` at `/etc`; the agent (often root) must
/// never move what such a link points to.
pub(crate) fn plain_path(root: &Path, rel: &str) -> Option<PathBuf> {
    let mut p = root.to_path_buf();
    for part in Path::new(rel).components() {
        match part {
            Component::Normal(c) => p.push(c),
            _ => return None,
        }
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
            return None;
        }
    }
    Some(p)
}

/// What cleaning a staged tree found.
#[derive(Default)]
struct Cleaned {
    size: Size,
    /// Symlinks removed because they lead outside the tree (relative to the tree).
    dropped: Vec<PathBuf>,
}

impl Cleaned {
    /// Clean `tree` and what is below it (no recursion: a job decides how deep it is); `Err`
    /// names what cannot be cached.
    fn walk(&mut self, tree: &Path) -> Result<(), String> {
        crate::fstree::walk(tree, |rel, m| {
            let p = tree.join(rel);
            let err = |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", shown(rel)));
            self.size.add(m);
            let t = m.file_type();
            if t.is_symlink() {
                if crate::workspace::link_stays_inside(tree, rel).is_err() {
                    std::fs::remove_file(&p).map_err(err)?;
                    self.dropped.push(rel.to_path_buf());
                }
            } else if t.is_dir() {
                chmod_plain(&p, m.mode() & 0o777, true).map_err(err)?;
            } else if t.is_file() {
                if m.nlink() > 1 {
                    // Another name for this file may live outside the tree: never chmod it, keep a copy.
                    let copy = p.with_file_name(format!(".gpuci-copy-{:016x}", rand::random::<u64>()));
                    copy_file(&p, &copy, m.mode() & 0o777).and_then(|()| std::fs::rename(&copy, &p)).map_err(err)?;
                } else {
                    chmod_plain(&p, m.mode() & 0o777, false).map_err(err)?;
                }
            } else {
                return Err(std::io::Error::other(format!(
                    "{} is a device, FIFO or socket; a cache keeps only files, directories and symlinks",
                    shown(rel)
                )));
            }
            Ok(())
        })
        .map_err(|e| e.to_string())
    }
}

fn shown(rel: &Path) -> String {
    if rel.as_os_str().is_empty() {
        ".".to_string()
    } else {
        rel.display().to_string()
    }
}

/// What a tree costs the agent's disk. Every entry counts at least one block, as it does on
/// a disk: 200,000 empty files are not free (they take inodes and time to copy).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Size {
    bytes: u64,
    entries: u64,
}

impl Size {
    const BLOCK: u64 = 4096;

    /// Adds one entry. A regular file counts by its apparent length (a job's sparse file
    /// costs nothing on its slot's disk but its whole length once copied).
    fn add(&mut self, m: &std::fs::Metadata) {
        let len = if m.is_file() { m.len() } else { 0 };
        let blocks = len.div_ceil(Self::BLOCK).max(1);
        self.bytes = self.bytes.saturating_add(blocks.saturating_mul(Self::BLOCK));
        self.entries += 1;
    }

    fn plus(self, o: Size) -> Size {
        Size { bytes: self.bytes.saturating_add(o.bytes), entries: self.entries.saturating_add(o.entries) }
    }

    /// Why this is more than one job may save, if it is.
    fn over(&self, limits: &CacheLimits) -> Option<String> {
        if self.bytes > limits.entry.0 {
            Some(format!(
                "{} is over this agent's limit of {} per cache (--cache-max-entry-size)",
                Bytes(self.bytes),
                limits.entry
            ))
        } else if self.entries > limits.entry_files {
            Some(format!(
                "{} files, directories and links are over this agent's limit of {} per cache (--cache-max-entry-files)",
                self.entries, limits.entry_files
            ))
        } else {
            None
        }
    }
}

/// Set `mode` on the file or directory at `p` without following a link there.
fn chmod_plain(p: &Path, mode: u32, dir: bool) -> std::io::Result<()> {
    let mut flags = nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC | nix::libc::O_NONBLOCK;
    if dir {
        flags |= nix::libc::O_DIRECTORY;
    }
    let f = std::fs::OpenOptions::new().read(true).custom_flags(flags).open(p)?;
    let m = f.metadata()?;
    if m.is_dir() != dir || !(m.is_dir() || m.is_file()) {
        return Err(std::io::Error::other("changed while it was cleaned"));
    }
    f.set_permissions(std::fs::Permissions::from_mode(mode))
}

/// A new file `to` with `from`'s content; `from` is not followed if it is a link.
fn copy_file(from: &Path, to: &Path, mode: u32) -> std::io::Result<()> {
    let nofollow = nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC;
    let mut src = std::fs::OpenOptions::new().read(true).custom_flags(nofollow | nix::libc::O_NONBLOCK).open(from)?;
    if !src.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut dst =
        std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).custom_flags(nofollow).open(to)?;
    std::io::copy(&mut src, &mut dst)?;
    Ok(())
}

/// Move a tree: a rename, or where `from` and `to` lie on different filesystems (a job's
/// workspace is on its slot's own disk), a copy, then the original removed. A copy refuses
/// what a rename would have carried and the cleaning refuses anyway (FIFOs, sockets,
/// devices), so both ways end alike.
fn move_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    match std::fs::rename(from, to) {
        Err(e) if e.raw_os_error() == Some(nix::libc::EXDEV) => {
            if let Some(special) = first_special(from)? {
                return Err(std::io::Error::other(format!(
                    "{} is not a regular file, directory or symlink",
                    shown(&special)
                )));
            }
            copy_tree(from, to)?;
            remove_any(from)
        }
        other => other,
    }
}

/// The first entry below `p` (links not followed) that is not a regular file, directory or
/// symlink.
fn first_special(p: &Path) -> std::io::Result<Option<PathBuf>> {
    let mut found = None;
    crate::fstree::walk(p, |rel, m| {
        let t = m.file_type();
        if found.is_none() && !(t.is_dir() || t.is_file() || t.is_symlink()) {
            found = Some(rel.to_path_buf());
        }
        Ok(())
    })?;
    Ok(found)
}

/// Copy the tree at `from` to the new path `to`: directories and files are made anew (no
/// set-id bits), symlinks copied as links (their targets as text, never followed).
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    crate::fstree::walk(from, |rel, m| {
        let (src, dst) = (from.join(rel), to.join(rel));
        let t = m.file_type();
        if t.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src)?, &dst)
        } else if t.is_dir() {
            std::fs::DirBuilder::new().mode(m.mode() & 0o777 | 0o700).create(&dst)
        } else if t.is_file() {
            copy_file(&src, &dst, m.mode() & 0o777)
        } else {
            Ok(()) // never saved; nothing to copy
        }
    })
}

/// What the tree at `p` costs (nothing if it is missing); links are not followed.
fn measure(p: &Path) -> std::io::Result<Size> {
    if std::fs::symlink_metadata(p).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        return Ok(Size::default());
    }
    let mut size = Size::default();
    crate::fstree::walk(p, |_, m| {
        size.add(m);
        Ok(())
    })?;
    Ok(size)
}

/// Mark a cache as used now (the least recently used go first).
fn touch(dir: &Path) {
    if let Ok(f) =
        std::fs::OpenOptions::new().read(true).custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW).open(dir)
    {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
}

/// Remove a file, link or tree (links are not followed; any depth).
fn remove_any(p: &Path) -> std::io::Result<()> {
    crate::fstree::remove_tree(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_core::cache::{scope, CacheOrigin};

    /// A temporary directory without the tempfile crate (not a dependency of this crate).
    struct Dir(PathBuf);
    impl Dir {
        fn new() -> Self {
            let p = std::env::temp_dir().join(format!("gpuci-cache-test-{:016x}", rand::random::<u64>()));
            std::fs::create_dir_all(&p).expect("tempdir");
            Dir(p)
        }
        /// A fresh, empty workspace.
        fn workspace(&self, name: &str) -> PathBuf {
            let w = self.0.join(name);
            std::fs::create_dir_all(&w).unwrap();
            w
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = crate::fstree::remove_tree(&self.0);
        }
    }

    const REPO: &str = "github.com/octo/gpu";

    fn store(d: &Dir, limits: CacheLimits) -> CacheStore {
        CacheStore::open(d.0.join("cache"), limits)
    }

    fn push(branch: &str) -> CacheScope {
        scope(
            REPO,
            &CacheOrigin::Push { git_ref: Some(format!("refs/heads/{branch}")), default_branch: Some("main".into()) },
        )
    }

    fn fork_pr(number: u64) -> CacheScope {
        scope(
            REPO,
            &CacheOrigin::PullRequest {
                number,
                base_branch: Some("main".into()),
                default_branch: Some("main".into()),
                trusted: false,
            },
        )
    }

    fn write(path: &Path, text: &str, mode: u32) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn paths() -> Vec<String> {
        vec!["cache".to_string()]
    }

    #[test]
    fn a_fork_pull_request_reads_main_by_copy_and_its_writes_never_reach_main() {
        let d = Dir::new();
        let s = store(&d, CacheLimits::default());
        let ws = d.workspace("push-1");
        write(&ws.join("cache/base.txt"), "from main", 0o644);
        s.save_as_origin(&push("main"), &paths(), &ws);

        let ws = d.workspace("pr-1");
        let log = s.restore(&fork_pr(7), &paths(), &ws);
        assert!(log.iter().any(|l| l.contains("read-only")), "{log:?}");
        assert_eq!(std::fs::read_to_string(ws.join("cache/base.txt")).unwrap(), "from main");
        write(&ws.join("cache/evil.sh"), "echo pwned", 0o755);
        std::fs::write(ws.join("cache/base.txt"), "changed by the fork").unwrap();
        let log = s.save_as_origin(&fork_pr(7), &paths(), &ws);
        assert!(log.iter().any(|l| l.contains("saved cache to pull/7 (untrusted)")), "{log:?}");

        let ws = d.workspace("push-2");
        s.restore(&push("main"), &paths(), &ws);
        assert_eq!(std::fs::read_to_string(ws.join("cache/base.txt")).unwrap(), "from main");
        assert!(!ws.join("cache/evil.sh").exists(), "the fork's file reached a push");

        let ws = d.workspace("pr-2");
        s.restore(&fork_pr(7), &paths(), &ws);
        assert!(ws.join("cache/evil.sh").exists(), "the pull request keeps its own cache");
        let ws = d.workspace("other-pr");
        s.restore(&fork_pr(8), &paths(), &ws);
        assert!(!ws.join("cache/evil.sh").exists(), "another pull request never sees it");
    }

    #[test]
    fn a_read_only_scope_saves_nothing() {
        let d = Dir::new();
        let s = store(&d, CacheLimits::default());
        let ws = d.workspace("w");
        write(&ws.join("cache/x"), "x", 0o644);
        let read_only = scope(REPO, &CacheOrigin::Push { git_ref: None, default_branch: Some("main".into()) });
        let log = s.save(&read_only, true, &paths(), &ws);
        assert!(log.iter().any(|l| l.contains("only read")), "{log:?}");
        assert!(ws.join("cache/x").exists(), "left where it was");
    }

    #[test]
    fn saving_strips_set_id_bits() {
        let d = Dir::new();
        let s = store(&d, CacheLimits::default());
        let ws = d.workspace("w1");
        write(&ws.join("cache/evil.sh"), "#!/bin/sh\n", 0o6755);
        std::fs::create_dir_all(ws.join("cache/dir")).unwrap();
        std::fs::set_permissions(ws.join("cache/dir"), std::fs::Permissions::from_mode(0o3777)).unwrap();
        s.save_as_origin(&push("main"), &paths(), &ws);
        // On the host disk, in the store, not only once restored.
        let stored = s.dir(push("main").save.as_ref().unwrap());
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode();
        assert_eq!(mode(&stored.join("cache/evil.sh")) & 0o7777, 0o755);
        assert_eq!(mode(&stored.join("cache/dir")) & 0o7000, 0);
        let ws = d.workspace("w2");
        s.restore(&push("main"), &paths(), &ws);
        assert_eq!(mode(&ws.join("cache/evil.sh")) & 0o7777, 0o755);
    }

    #[test]
    fn a_hard_linked_file_is_copied_so_its_other_name_is_untouched() {
        let d = Dir::new();
        let s = store(&d, CacheLimits::default());
        let outside = d.0.join("host-binary");
        write(&outside, "host", 0o4755);
        let ws = d.workspace("w");
        std::fs::create_dir_all(ws.join("cache")).unwrap();
        std::fs::hard_link(&outside, ws.join("cache/link")).unwrap();
        s.save_as_origin(&push("main"), &paths(), &ws);
        assert_eq!(std::fs::metadata(&outside).unwrap().mode() & 0o7777, 0o4755, "the host's file kept its mode");
        let stored = s.dir(push("main").save.as_ref().unwrap()).join("cache/link");
        let m = std::fs::metadata(&stored).unwrap();
        assert_eq!((m.nlink(), m.mode() & 0o7000), (1, 0));
        assert_eq!(std::fs::read_to_string(stored).unwrap(), "host");
    }

    #[test]
    fn symlinks_leading_out_of_the_cached_tree_are_dropped() {
        let d = Dir::new();
        let s = store(&d, CacheLimits::default());
        let ws = d.workspace("w");
        write(&ws.join("cache/f"), "f", 0o644);
        write(&ws.join("secret"), "beside the cache", 0o644);
        let link = |target: &str, name: &str| std::os::unix::fs::symlink(target, ws.join("cache").join(name)).unwrap();
        link("f", "inside");
        link("/etc/shadow", "absolute");
        link("../secret", "up");
        link(".", "here");
        link("here/..", "chain");
        let log = s.save_as_origin(&push("main"), &paths(), &ws);
        let ws = d.workspace("w2");
        s.restore(&push("main"), &paths(), &ws);
        let present = |n: &str| std::fs::symlink_metadata(ws.join("cache").join(n)).is_ok();
        assert!(present("inside") && present("here"), "{log:?}");
        for dropped in ["absolute", "up", "chain"] {
            assert!(!present(dropped), "{dropped}: {log:?}");
            assert!(log.iter().any(|l| l.contains(&format!("dropped the symlink {dropped} "))), "{log:?}");
        }
    }

    #[test]
    fn devices_fifos_and_sockets_are_not_cached() {
        let d = Dir::new();
        let s = store(&d, CacheLimits::default());
        let ws = d.workspace("w");
        write(&ws.join("cache/ok"), "ok", 0o644);
        nix::unistd::mkfifo(&ws.join("cache/pipe"), nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        let log = s.save_as_origin(&push("main"), &paths(), &ws);
        assert!(log.iter().any(|l| l.contains("not saving cache: pipe is a device, FIFO or socket")), "{log:?}");
        let ws = d.workspace("w2");
        s.restore(&push("main"), &paths(), &ws);
        assert!(!ws.join("cache").exists());
    }

    /// Regression (outsider attack): a sparse file of 3 GiB took no room on the job's slot disk
    /// and 3 GiB on the agent's disk when the cache was copied there, before its size was
    /// checked; 11 GiB peaked at 14 GB on the host before "over the limit". A cache over the
    /// limit is now refused where it lies: nothing of it is moved or copied.
    #[test]
    fn a_sparse_cache_over_the_limit_is_refused_before_it_is_copied() {
        let d = Dir::new();
        let s = store(&d, CacheLimits { entry: Bytes(1 << 20), total: Bytes(1 << 30), ..CacheLimits::default() });
        let ws = d.workspace("w");
        write(&ws.join("cache/small"), "ok", 0o644);
        let f = std::fs::File::create(ws.join("cache/sparse")).unwrap();
        f.set_len(64 << 20).unwrap();
        drop(f);
        let log = s.save_as_origin(&push("main"), &paths(), &ws);
        assert!(log.iter().any(|l| l.contains("not saved") && l.contains("64 MiB")), "{log:?}");
        assert!(ws.join("cache/sparse").exists() && ws.join("cache/small").exists(), "the refused cache was moved");
        let left: Vec<_> =
            std::fs::read_dir(d.0.join("cache")).into_iter().flatten().flatten().map(|e| e.file_name()).collect();
        assert!(!left.iter().any(|n| n.to_string_lossy().starts_with(".staging")), "{left:?}");
    }

    #[test]
    fn a_cache_over_the_entry_limit_is_not_saved_and_the_log_says_so() {
        let d = Dir::new();
        let s = store(&d, CacheLimits { entry: Bytes(1000), total: Bytes(1 << 30), ..CacheLimits::default() });
        let ws = d.workspace("w");
        write(&ws.join("cache/big"), &"x".repeat(1001), 0o644);
        let log = s.save_as_origin(&push("main"), &paths(), &ws);
        assert!(
            log.iter().any(|l| l.contains("over this agent's limit") && l.contains("--cache-max-entry-size")),
            "{log:?}"
        );
        let ws = d.workspace("w2");
        let log = s.restore(&push("main"), &paths(), &ws);
        assert!(log.iter().any(|l| l.contains("is empty")), "{log:?}");
    }

    #[test]
    fn the_least_recently_used_caches_go_first_past_the_total_limit() {
        let d = Dir::new();
        // Each cache costs three blocks (its directory, `cache/`, `data`): 12 KiB; three are over.
        let limits = CacheLimits { entry: Bytes(1 << 20), total: Bytes(30_000), ..CacheLimits::default() };
        let quota = CacheQuota { total: limits.total, per_repository: limits.total, untrusted: Bytes(6_000) };
        let s = CacheStore::open_with_quota(d.0.join("cache"), limits, quota);
        let save = |branch: &str| {
            let ws = d.workspace(&format!("ws-{branch}"));
            write(&ws.join("cache/data"), &"x".repeat(1000), 0o644);
            s.save_as_origin(&push(branch), &paths(), &ws);
        };
        let age = |branch: &str, secs: u64| {
            let dir = s.dir(push(branch).save.as_ref().unwrap());
            let f = std::fs::File::open(dir).unwrap();
            f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(secs)).unwrap();
        };
        save("a");
        age("a", 300);
        save("b");
        age("b", 200);
        save("c");
        let exists = |branch: &str| s.dir(push(branch).save.as_ref().unwrap()).exists();
        assert!(!exists("a"), "3 × 12 KiB is over 30,000 bytes: the oldest goes");
        assert!(exists("b") && exists("c"));
        age("c", 300);
        age("b", 100); // b used after c
        save("d");
        assert!(!exists("c"), "the least recently used goes, not the first made");
        assert!(exists("b") && exists("d"));
    }

    /// Regression (outsider attack): 200,000 empty files were cached, each costing the agent an
    /// inode and a copy, because only bytes were counted.
    #[test]
    fn many_empty_files_count_against_the_limits() {
        let d = Dir::new();
        let limits = CacheLimits { entry: Bytes(1 << 30), total: Bytes(1 << 30), entry_files: 100 };
        let s = store(&d, limits);
        let ws = d.workspace("w");
        for i in 0..150 {
            write(&ws.join(format!("cache/e{i}")), "", 0o644);
        }
        let log = s.save_as_origin(&push("main"), &paths(), &ws);
        assert!(log.iter().any(|l| l.contains("not saved") && l.contains("--cache-max-entry-files")), "{log:?}");
        assert!(!s.dir(push("main").save.as_ref().unwrap()).exists());
        // By size too: 150 empty files are 150 blocks, over a 64 KiB limit.
        let s = store(&d, CacheLimits { entry: Bytes(64 << 10), ..limits });
        let log = s.save_as_origin(&push("main"), &paths(), &ws);
        assert!(log.iter().any(|l| l.contains("not saved") && l.contains("--cache-max-entry-size")), "{log:?}");
    }

    /// Regression (outsider attack): 800 nested directories in a cached path overflowed the
    /// agent's stack (the walks that measure, clean and copy a cache recursed per level) and
    /// took every job on the host with it. Saved and restored (moved and copied) on a thread
    /// with a small stack, a deep cache comes back whole.
    #[test]
    fn a_deep_cache_is_saved_and_restored_without_recursion() {
        let d = Dir::new();
        let s = std::sync::Arc::new(store(&d, CacheLimits::default()));
        let ws = d.workspace("w");
        let mut deep = PathBuf::from("cache");
        for _ in 0..1000 {
            deep.push("d");
        }
        write(&ws.join(&deep).join("f"), "deep", 0o644);
        let run = |f: Box<dyn FnOnce() -> Vec<String> + Send>| {
            std::thread::Builder::new().stack_size(128 * 1024).spawn(f).unwrap().join().expect("no stack overflow")
        };
        let (s1, w1) = (s.clone(), ws.clone());
        let log = run(Box::new(move || s1.save_as_origin(&push("main"), &paths(), &w1)));
        assert!(log.iter().any(|l| l.contains("saved cache")), "{log:?}");
        // A pull request reads main's cache by copy.
        let ws2 = d.workspace("w2");
        let (s2, w2) = (s.clone(), ws2.clone());
        let log = run(Box::new(move || s2.restore(&fork_pr(3), &paths(), &w2)));
        assert!(log.iter().any(|l| l.contains("restored cache")), "{log:?}");
        assert_eq!(std::fs::read_to_string(ws2.join(&deep).join("f")).unwrap(), "deep");
        crate::fstree::remove_tree(&ws2).unwrap();
        crate::fstree::remove_tree(&ws).unwrap();
    }

    impl CacheStore {
        /// A save by a job whose origin is of the save key's class (as the coordinator sends it).
        fn save_as_origin(&self, scope: &CacheScope, paths: &[String], workspace: &Path) -> Vec<String> {
            let trusted = scope.save.as_ref().is_none_or(|k| k.trust == Trust::Trusted);
            self.save(scope, trusted, paths, workspace)
        }
    }

    /// A workspace with one cached file of `len` bytes: the cache costs three blocks (its
    /// directory, `cache/`, the file) for up to 4 KiB.
    fn cached(d: &Dir, name: &str, len: usize) -> PathBuf {
        let ws = d.workspace(name);
        write(&ws.join("cache/data"), &"x".repeat(len), 0o644);
        ws
    }

    /// Regression (issue 27): every pull request from a fork saved up to 10 GiB under its own
    /// key, and the least recently used caches of the whole agent — the default branch's
    /// included — were evicted to make room.
    #[test]
    fn an_untrusted_job_saving_caches_cannot_push_out_a_trusted_entry() {
        let d = Dir::new();
        // 100 KiB in all: 20 KiB for untrusted caches, 40 KiB per repository and class.
        let s = store(&d, CacheLimits { entry: Bytes(1 << 20), total: Bytes(100 << 10), ..CacheLimits::default() });
        s.save_as_origin(&push("main"), &paths(), &cached(&d, "main", 1000));
        let main = s.dir(push("main").save.as_ref().unwrap());
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::open(&main).unwrap().set_modified(old).unwrap();
        for pr in 1..=12 {
            let log = s.save_as_origin(&fork_pr(pr), &paths(), &cached(&d, &format!("pr-{pr}"), 1000));
            assert!(log.iter().any(|l| l.contains("saved cache")), "{log:?}");
        }
        assert!(main.exists(), "a fork's cache pushed out the default branch's");
        let untrusted: u64 = s.stored().iter().filter(|c| c.trust == Trust::Untrusted).map(|c| c.bytes).sum();
        assert!(untrusted <= 20 << 10, "untrusted caches hold {untrusted} bytes");
        assert!(s.dir(fork_pr(12).save.as_ref().unwrap()).exists(), "the newest fork cache is kept");
        assert!(!s.dir(fork_pr(1).save.as_ref().unwrap()).exists(), "the oldest fork cache made room");
        let ws = d.workspace("push-after");
        let log = s.restore(&push("main"), &paths(), &ws);
        assert!(log.iter().any(|l| l.contains("restored cache from refs/heads/main")), "{log:?}");
    }

    /// Regression (issue 27): untrusted caches could fill the agent; now where only trusted
    /// caches are left, an untrusted save is refused instead of pushing one out.
    #[test]
    fn an_untrusted_save_that_does_not_fit_beside_trusted_caches_is_refused() {
        let d = Dir::new();
        let quota = CacheQuota { total: Bytes(40 << 10), per_repository: Bytes(40 << 10), untrusted: Bytes(40 << 10) };
        let s = CacheStore::open_with_quota(d.0.join("cache"), CacheLimits::default(), quota);
        for branch in ["a", "b", "c"] {
            s.save_as_origin(&push(branch), &paths(), &cached(&d, branch, 1000));
        }
        let log = s.save_as_origin(&fork_pr(1), &paths(), &cached(&d, "pr", 1000));
        assert!(log.iter().any(|l| l.contains("not saved") && l.contains("never push them out")), "{log:?}");
        for branch in ["a", "b", "c"] {
            assert!(s.dir(push(branch).save.as_ref().unwrap()).exists(), "{branch}");
        }
        assert!(!s.dir(fork_pr(1).save.as_ref().unwrap()).exists());
    }

    #[test]
    fn a_repository_over_its_cache_quota_loses_its_own_oldest_caches_of_its_class() {
        let d = Dir::new();
        let quota = CacheQuota { total: Bytes(1 << 30), per_repository: Bytes(30 << 10), untrusted: Bytes(1 << 30) };
        let s = CacheStore::open_with_quota(d.0.join("cache"), CacheLimits::default(), quota);
        let other = scope("github.com/octo/other", &CacheOrigin::Direct);
        s.save_as_origin(&other, &paths(), &cached(&d, "other", 1000));
        s.save_as_origin(&fork_pr(5), &paths(), &cached(&d, "fork", 1000));
        let age = |scope: &CacheScope, secs: u64| {
            let f = std::fs::File::open(s.dir(scope.save.as_ref().unwrap())).unwrap();
            f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(secs)).unwrap();
        };
        age(&other, 900);
        age(&fork_pr(5), 900);
        s.save_as_origin(&push("a"), &paths(), &cached(&d, "a", 1000));
        age(&push("a"), 300);
        s.save_as_origin(&push("b"), &paths(), &cached(&d, "b", 1000));
        // 3 × 12 KiB of this repository's trusted caches is over 30 KiB: its oldest goes.
        let log = s.save_as_origin(&push("c"), &paths(), &cached(&d, "c", 1000));
        assert!(log.iter().any(|l| l.contains("saved cache")), "{log:?}");
        let exists = |scope: &CacheScope| s.dir(scope.save.as_ref().unwrap()).exists();
        assert!(!exists(&push("a")), "the repository's oldest trusted cache goes");
        assert!(exists(&push("b")) && exists(&push("c")));
        assert!(exists(&other), "another repository's cache, older still, stays");
        assert!(exists(&fork_pr(5)), "the repository's untrusted cache, older still, stays");
    }

    #[test]
    fn a_save_over_the_repository_quota_is_refused_and_the_log_says_so() {
        let d = Dir::new();
        let quota = CacheQuota { total: Bytes(1 << 30), per_repository: Bytes(10 << 10), untrusted: Bytes(1 << 30) };
        let s = CacheStore::open_with_quota(d.0.join("cache"), CacheLimits::default(), quota);
        let ws = cached(&d, "w", 5000);
        let log = s.save_as_origin(&push("main"), &paths(), &ws);
        assert!(
            log.iter()
                .any(|l| l.contains("not saved") && l.contains("quota of 10240 B for one repository's trusted caches")),
            "{log:?}"
        );
        assert!(ws.join("cache/data").exists(), "refused before anything was moved");
        assert!(!s.dir(push("main").save.as_ref().unwrap()).exists());
    }

    /// Defence in depth: a scope that names a trusted key for a job of an untrusted origin (a
    /// stale or hostile coordinator message) saves nothing.
    #[test]
    fn a_job_of_an_untrusted_origin_never_writes_a_trusted_cache() {
        let d = Dir::new();
        let s = store(&d, CacheLimits::default());
        let log = s.save(&push("main"), false, &paths(), &cached(&d, "w", 10));
        assert!(log.iter().any(|l| l.contains("untrusted origin never writes a trusted cache")), "{log:?}");
        assert!(!s.dir(push("main").save.as_ref().unwrap()).exists());
    }

    #[test]
    fn leftovers_and_old_per_repository_caches_are_removed_on_open() {
        let d = Dir::new();
        let root = d.0.join("cache");
        write(&root.join("0123456789abcdef/cache/evil.sh"), "old format", 0o4755);
        // Named by the key's hash alone (before caches were charged to a repository).
        write(&root.join("0123456789abcdef0123456789abcdef/cache/x"), "no class, no repository", 0o644);
        write(&root.join(".staging-1/0/x"), "crash", 0o644);
        let s = store(&d, CacheLimits::default());
        assert_eq!(std::fs::read_dir(&s.root).unwrap().count(), 0);
    }
}
