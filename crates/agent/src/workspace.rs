//! A job's workspace from its pipeline's upload: download the gzip'ed tar from the coordinator
//! (with this agent's credential), keep it in a small cache under `<data-dir>/uploads/` (named
//! by its sha256, checked before every use), and unpack it into the workspace. A download
//! cut off or answered 5xx (a coordinator failover) is made again from its start, at the
//! coordinator leading then, within the bound of [`crate::transfer_retry`].
//!
//! Unpacking guarantees that, whatever the order of the entries, nothing is written outside the
//! workspace and no link is left in it that leads outside. It refuses, and fails the job on
//! (naming the entry and why): absolute paths and `..` components; an entry whose way passes
//! through a symlink (nothing is ever written through a link); an entry that would replace a
//! symlink, or a directory with something else (or the other way round); symlinks whose target
//! is absolute or climbs out from where the link is, and — checked once all entries are down,
//! because a later entry can change where an earlier link leads — any symlink whose target,
//! walked through the links it meets, leads outside; hard links to anything but a plain file
//! already unpacked and reached without links (never to a symlink: the new name would read
//! the link's relative target from another directory); device files and FIFOs. Ownership,
//! set-id bits and extended attributes from the archive are not kept; the permission bits are.

use crate::transfer_retry::{retry, Failure};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

/// How many uploads the cache keeps (least recently used go first).
const CACHE_KEEP: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("upload {id}: not a valid upload id")]
    BadId { id: String },
    #[error("upload {id}: download failed: {reason}")]
    Download { id: String, reason: String },
    #[error("upload {id}: the download's sha256 is {actual}, not its id")]
    Checksum { id: String, actual: String },
    #[error("upload {id}: cache {path}: {source}")]
    Cache { id: String, path: PathBuf, source: std::io::Error },
    #[error("upload {id}: refused entry {entry:?}: {reason}")]
    Refused { id: String, entry: String, reason: String },
    #[error("upload {id}: unpacking failed: {reason}")]
    Unpack { id: String, reason: String },
    /// The coordinator stored it once and has garbage-collected it since (410): waiting or
    /// trying again cannot help. `message` is the coordinator's, and names the upload.
    #[error("{message} (410 Gone)")]
    Gone { id: String, message: String },
}

/// Where uploads come from: the coordinator, as this agent.
pub struct UploadSource {
    pub http: reqwest::Client,
    /// The coordinator the agent talks to now: after a failover, the new leader.
    pub server: crate::follow::Current,
    pub agent_id: String,
    pub credential: String,
    pub cache_dir: PathBuf,
    /// How a transfer cut off (a failover) is tried again.
    pub retry: crate::transfer_retry::Policy,
}

impl std::fmt::Debug for UploadSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UploadSource").field("server", &self.server).field("agent_id", &self.agent_id).finish()
    }
}

fn valid_id(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(hex::encode(h.finalize()))
}

impl UploadSource {
    /// A client for the coordinator leading now, at the address where it proved (just now)
    /// the coordinators' identity key, and its base URL; an address that cannot prove it is a
    /// failure worth trying again (the agent may reconnect to one that can).
    pub async fn endpoint(&self) -> Result<(reqwest::Client, String), crate::transfer_retry::Failure> {
        self.server
            .proven(|b| b.connect_timeout(Duration::from_secs(30)).read_timeout(Duration::from_secs(120)))
            .await
            .map_err(crate::transfer_retry::Failure::Transport)
    }

    pub fn new(
        server: crate::follow::Current,
        agent_id: &str,
        credential: &str,
        cache_dir: PathBuf,
    ) -> reqwest::Result<Self> {
        // No overall timeout: an upload may be large. A stalled connection still ends.
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(30))
            .read_timeout(Duration::from_secs(120))
            .build()?;
        Ok(UploadSource {
            http,
            server,
            agent_id: agent_id.to_string(),
            credential: credential.to_string(),
            cache_dir,
            retry: Default::default(),
        })
    }

    /// The cached archive of upload `id`, downloaded if it is not cached (or the cached copy
    /// does not match its id).
    pub async fn fetch(&self, id: &str) -> Result<PathBuf, WorkspaceError> {
        if !valid_id(id) {
            return Err(WorkspaceError::BadId { id: id.to_string() });
        }
        let cache = |path: &Path, source| WorkspaceError::Cache { id: id.into(), path: path.to_path_buf(), source };
        std::fs::create_dir_all(&self.cache_dir).map_err(|e| cache(&self.cache_dir, e))?;
        let path = self.cache_dir.join(format!("{id}.tar.gz"));
        if path.is_file() {
            let p = path.clone();
            let sum = tokio::task::spawn_blocking(move || sha256_file(&p)).await.ok().and_then(Result::ok);
            if sum.as_deref() == Some(id) {
                // Mark it recently used.
                if let Ok(f) = std::fs::File::options().append(true).open(&path) {
                    let _ = f.set_modified(std::time::SystemTime::now());
                }
                return Ok(path);
            }
            tracing::warn!(upload = id, "cached upload does not match its id; downloading again");
            let _ = std::fs::remove_file(&path);
        }
        let tmp = self.cache_dir.join(format!(".download-{id}-{}", rand::random::<u64>()));
        // A try cut off or answered 5xx (a failover) is made again, at the coordinator leading
        // then and from the start of the file; a final answer ends the tries as it is.
        let on_retry = |e: &Failure, wait: Duration| {
            tracing::warn!(upload = id, error = %e, wait_ms = wait.as_millis() as u64, "upload download cut off; trying again");
        };
        let result = match retry(&self.retry, || self.download_once(id, &path, &tmp), on_retry).await {
            Ok(done) => done,
            Err(gave_up) => Err(WorkspaceError::Download { id: id.into(), reason: gave_up.to_string() }),
        };
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result?;
        self.prune(id);
        Ok(path)
    }

    /// One try of downloading upload `id` into `tmp` (made anew) and renaming it to `path`.
    /// `Err`: the try failed and may be made again (or not: [`Failure::is_transient`]);
    /// `Ok(Err)`: a final answer (gone, a checksum that does not match, the cache's disk).
    async fn download_once(&self, id: &str, path: &Path, tmp: &Path) -> Result<Result<(), WorkspaceError>, Failure> {
        let cache = |path: &Path, source| WorkspaceError::Cache { id: id.into(), path: path.to_path_buf(), source };
        // The coordinator leading now (after a failover, the new one).
        let (http, base) = self.endpoint().await?;
        let url = format!("{base}/api/v1/uploads/{id}");
        let resp = http
            .get(&url)
            .bearer_auth(&self.credential)
            .header("x-gpuci-agent-id", &self.agent_id)
            .send()
            .await
            .map_err(|e| Failure::Transport(format!("GET {url}: {e}")))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            // The coordinator's errors are `{"error": "..."}`: say the sentence, not the JSON.
            let message = serde_json::from_str::<gpuci_protocol::api::ErrorBody>(&body)
                .map(|b| b.error)
                .unwrap_or_else(|_| body.trim().to_string());
            if status == reqwest::StatusCode::GONE {
                let message = if message.contains(id) { message } else { format!("upload {id} is gone: {message}") };
                return Ok(Err(WorkspaceError::Gone { id: id.into(), message }));
            }
            let failure =
                Failure::Status { status: status.as_u16(), message: format!("GET {url}: {status}: {message}") };
            if failure.is_transient() {
                return Err(failure);
            }
            return Ok(Err(WorkspaceError::Download { id: id.into(), reason: failure.to_string() }));
        }
        let expected = resp.content_length();
        // Each try writes the file from its start.
        let _ = std::fs::remove_file(tmp);
        let opened = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(tmp)
        };
        let mut file = match opened {
            Ok(f) => f,
            Err(e) => return Ok(Err(cache(tmp, e))),
        };
        let mut hasher = Sha256::new();
        let mut got: u64 = 0;
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| Failure::Transport(format!("reading {url}: cut off after {got} bytes: {e}")))?;
            got += chunk.len() as u64;
            hasher.update(&chunk);
            if let Err(e) = file.write_all(&chunk) {
                return Ok(Err(cache(tmp, e)));
            }
        }
        if expected.is_some_and(|n| got < n) {
            return Err(Failure::Transport(format!("reading {url}: cut off after {got} bytes")));
        }
        // Not synced: a copy torn by a crash is found out on its next use (its hash is
        // checked against its id then) and fetched again. On the path to a job's start.
        let actual = hex::encode(hasher.finalize());
        if actual != id {
            return Ok(Err(WorkspaceError::Checksum { id: id.into(), actual }));
        }
        Ok(std::fs::rename(tmp, path).map_err(|e| cache(path, e)))
    }

    /// Keep the [`CACHE_KEEP`] most recently used uploads (and always `keep`).
    fn prune(&self, keep: &str) {
        let Ok(dir) = std::fs::read_dir(&self.cache_dir) else { return };
        let mut cached: Vec<(std::time::SystemTime, PathBuf)> = dir
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(|n| n.ends_with(".tar.gz") && !n.starts_with(keep)))
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        cached.sort_by_key(|c| std::cmp::Reverse(c.0));
        for (_, path) in cached.into_iter().skip(CACHE_KEEP.saturating_sub(1)) {
            tracing::debug!(path = %path.display(), "removing an old cached upload");
            let _ = std::fs::remove_file(path);
        }
    }
}

/// `path` with `.` dropped and `..` applied, or `None` if it is absolute or climbs above its start.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// An entry's own path: relative, only plain names.
fn plain_relative(path: &Path) -> bool {
    path.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        && path.components().any(|c| matches!(c, Component::Normal(_)))
}

/// How much one upload may unpack to: a small gzip stream can expand without bound (a "zip
/// bomb"), and the workspace shares the agent's disk.
#[derive(Clone, Copy, Debug)]
pub struct UnpackLimits {
    pub bytes: u64,
    pub entries: u64,
}

impl Default for UnpackLimits {
    fn default() -> Self {
        UnpackLimits { bytes: 16 << 30, entries: 2_000_000 }
    }
}

/// Unpack the gzip'ed tar `archive` of upload `id` into the existing, empty directory `dest`.
/// Returns how many files (not directories or links) it wrote.
pub fn unpack(id: &str, archive: &Path, dest: &Path) -> Result<usize, WorkspaceError> {
    unpack_limited(id, archive, dest, UnpackLimits::default())
}

/// [`unpack`], refusing an archive whose entries add up to more than `limits`; the check is
/// made from each header before its data is written.
///
/// The archive is written by this function alone, entry by entry, never through a link:
/// every directory on an entry's path is checked with `symlink_metadata` (made if missing),
/// and files are created with `O_NOFOLLOW | O_EXCL`. Nothing else writes the workspace until
/// the job starts, so a check holds until the write it guards. Links are judged twice: each
/// symlink's target as written (relative, not climbing out of the workspace from where the
/// link is), and every symlink again once the whole archive is down, by walking its target
/// through the links it meets — only then are all links known, in whatever order they came.
pub fn unpack_limited(id: &str, archive: &Path, dest: &Path, limits: UnpackLimits) -> Result<usize, WorkspaceError> {
    let unpack_err = |reason: String| WorkspaceError::Unpack { id: id.into(), reason };
    let refused = |entry: &Path, reason: String| WorkspaceError::Refused {
        id: id.into(),
        entry: entry.display().to_string(),
        reason,
    };
    let root = std::fs::canonicalize(dest).map_err(|e| unpack_err(format!("workspace {}: {e}", dest.display())))?;
    let file = std::fs::File::open(archive).map_err(|e| unpack_err(format!("{}: {e}", archive.display())))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(std::io::BufReader::new(file)));
    let mut files = 0;
    let (mut bytes, mut entries) = (0u64, 0u64);
    // Symlinks made, in order: checked once more at the end.
    let mut links: Vec<PathBuf> = Vec::new();
    let written = (|| -> Result<(), WorkspaceError> {
        for entry in tar.entries().map_err(|e| unpack_err(e.to_string()))? {
            let mut entry = entry.map_err(|e| unpack_err(e.to_string()))?;
            bytes = bytes.saturating_add(entry.size());
            entries += 1;
            if bytes > limits.bytes || entries > limits.entries {
                return Err(unpack_err(format!(
                    "the upload unpacks to more than {} MiB or {} entries; refused",
                    limits.bytes >> 20,
                    limits.entries
                )));
            }
            let raw = entry.path().map_err(|e| unpack_err(format!("an entry's path: {e}")))?.into_owned();
            use tar::EntryType as T;
            let kind = entry.header().entry_type();
            if matches!(kind, T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink) {
                continue;
            }
            if raw.components().all(|c| c == Component::CurDir) {
                continue; // `./`: the workspace itself
            }
            if !plain_relative(&raw) {
                return Err(refused(&raw, "the path is absolute or contains `..`".into()));
            }
            // Only plain names from here on: `a/./b/` is `a/b`.
            let path: PathBuf = raw.components().filter(|c| matches!(c, Component::Normal(_))).collect();
            let io = |e: std::io::Error| unpack_err(format!("{}: {e}", path.display()));
            let target = match kind {
                T::Symlink | T::Link => Some(
                    entry
                        .link_name()
                        .map_err(|e| unpack_err(format!("{}: link target: {e}", path.display())))?
                        .ok_or_else(|| refused(&path, "a link without a target".into()))?
                        .into_owned(),
                ),
                _ => None,
            };
            match kind {
                T::Regular | T::Continuous | T::Directory | T::Symlink | T::Link => {}
                other => {
                    return Err(refused(&path, format!("{other:?} entries (devices, FIFOs, ...) are not allowed")))
                }
            }
            make_parents(&root, &path).map_err(|why| refused(&path, why))?;
            let full = root.join(&path);
            let existing = std::fs::symlink_metadata(&full).ok().map(|m| m.file_type());
            let replaced = |what: &str| {
                let had = match existing {
                    Some(t) if t.is_symlink() => "a symlink",
                    Some(t) if t.is_dir() => "a directory",
                    _ => "a file",
                };
                refused(&path, format!("it would replace {had} of the same name with {what}"))
            };
            let mode = entry.header().mode().unwrap_or(0o644) & 0o777;
            match kind {
                T::Directory => match existing {
                    None => {
                        use std::os::unix::fs::DirBuilderExt;
                        std::fs::DirBuilder::new().mode(mode | 0o700).create(&full).map_err(io)?;
                    }
                    Some(t) if t.is_dir() => {}
                    Some(_) => return Err(replaced("a directory")),
                },
                T::Regular | T::Continuous => {
                    match existing {
                        None => {}
                        // A later copy of the same file wins, as with tar(1).
                        Some(t) if t.is_file() => std::fs::remove_file(&full).map_err(io)?,
                        Some(_) => return Err(replaced("a file")),
                    }
                    let mut out = create_new(&full, mode).map_err(io)?;
                    // The archive's bits exactly (not narrowed by the agent's umask), set-id never.
                    out.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode)).map_err(io)?;
                    std::io::copy(&mut entry, &mut out).map_err(io)?;
                    if let Ok(mtime) = entry.header().mtime() {
                        let _ = out.set_modified(std::time::UNIX_EPOCH + Duration::from_secs(mtime));
                    }
                    files += 1;
                }
                T::Symlink => {
                    let target = target.unwrap_or_default();
                    let parent = path.parent().unwrap_or(Path::new(""));
                    if target.as_os_str().is_empty()
                        || target.is_absolute()
                        || normalize(&parent.join(&target)).is_none()
                    {
                        return Err(refused(
                            &path,
                            format!("the symlink points outside the workspace ({})", target.display()),
                        ));
                    }
                    if existing.is_some() {
                        return Err(replaced("a symlink"));
                    }
                    std::os::unix::fs::symlink(&target, &full).map_err(io)?;
                    links.push(path.clone());
                }
                _ => {
                    // A hard link: to a regular file this archive already wrote, reached by plain
                    // directories. Never to a symlink: the copy would read its relative target
                    // from another directory.
                    let target = target.unwrap_or_default();
                    if !plain_relative(&target) {
                        return Err(refused(
                            &path,
                            format!("the hard link points outside the workspace ({})", target.display()),
                        ));
                    }
                    let to = plain_dirs(&root, &target)
                        .filter(|t| std::fs::symlink_metadata(t).is_ok_and(|m| m.file_type().is_file()))
                        .ok_or_else(|| {
                            refused(
                                &path,
                                format!(
                                    "the hard link's target {} is not a file in the workspace reached without links",
                                    target.display()
                                ),
                            )
                        })?;
                    match existing {
                        None => {}
                        Some(t) if t.is_file() => std::fs::remove_file(&full).map_err(io)?,
                        Some(_) => return Err(replaced("a hard link")),
                    }
                    std::fs::hard_link(&to, &full).map_err(io)?;
                    files += 1;
                }
            }
        }
        Ok(())
    })();
    // Also when an entry was refused half-way: the links made so far may lead out together.
    // All are judged first, then those leading out are removed, so none is left behind.
    let escaping: Vec<(&PathBuf, String)> =
        links.iter().filter_map(|l| link_stays_inside(&root, l).err().map(|why| (l, why))).collect();
    for (link, _) in &escaping {
        let _ = std::fs::remove_file(root.join(link));
    }
    written?;
    match escaping.into_iter().next() {
        Some((link, why)) => Err(refused(link, why)),
        None => Ok(files),
    }
}

/// Make the directories above `rel` inside `root`, refusing to pass through anything but a
/// directory: an earlier entry may have put a symlink there.
fn make_parents(root: &Path, rel: &Path) -> Result<(), String> {
    let mut p = root.to_path_buf();
    let Some(parent) = rel.parent() else { return Ok(()) };
    for c in parent.components() {
        p.push(c);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                let shown = p.strip_prefix(root).unwrap_or(&p).display().to_string();
                return Err(format!("`{shown}` on its path is a symlink; nothing is written through a link"));
            }
            Ok(_) => {
                let shown = p.strip_prefix(root).unwrap_or(&p).display().to_string();
                return Err(format!("`{shown}` on its path is not a directory"));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                use std::os::unix::fs::DirBuilderExt;
                std::fs::DirBuilder::new().mode(0o755).create(&p).map_err(|e| format!("making its directory: {e}"))?;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

/// `root/rel` if every directory above it exists and is a directory, not a link.
fn plain_dirs(root: &Path, rel: &Path) -> Option<PathBuf> {
    let mut p = root.to_path_buf();
    for c in rel.parent()?.components() {
        match c {
            Component::Normal(n) => p.push(n),
            Component::CurDir => continue,
            _ => return None,
        }
        if !std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
            return None;
        }
    }
    Some(p.join(rel.file_name()?))
}

/// A new file, never through a link and never an existing one.
fn create_new(path: &Path, mode: u32) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(path)
}

/// Whether the symlink `link` (relative to `root`) leads somewhere inside `root` when
/// followed, worked out without following anything: its target is walked component by
/// component with `symlink_metadata`, reading each link it meets the way the kernel would.
/// A target that dangles is judged by its text from the first missing component on. Shared
/// by uploads and the cache (a cached tree is the `root` there).
pub(crate) fn link_stays_inside(root: &Path, link: &Path) -> Result<(), String> {
    /// As Linux's limit on links followed in one lookup.
    const MAX_HOPS: u32 = 40;
    let start = std::fs::read_link(root.join(link)).map_err(|e| format!("reading the link: {e}"))?;
    let shown = start.display().to_string();
    let mut at: Vec<std::ffi::OsString> = match link.parent() {
        Some(p) => p.components().map(|c| c.as_os_str().to_os_string()).collect(),
        None => Vec::new(),
    };
    let mut pending: std::collections::VecDeque<PathBuf> =
        start.components().map(|c| PathBuf::from(c.as_os_str())).collect();
    let (mut hops, mut dangling) = (0, false);
    while let Some(c) = pending.pop_front() {
        match c.components().next() {
            None | Some(Component::CurDir) => {}
            Some(Component::RootDir | Component::Prefix(_)) => {
                return Err(format!("the symlink's target {shown} leads to an absolute path"));
            }
            Some(Component::ParentDir) => {
                if at.pop().is_none() {
                    return Err(format!("the symlink's target {shown} leads outside the workspace"));
                }
            }
            Some(Component::Normal(name)) => {
                let here: PathBuf = root.join(at.iter().collect::<PathBuf>()).join(name);
                at.push(name.to_os_string());
                if dangling {
                    continue;
                }
                match std::fs::symlink_metadata(&here) {
                    Ok(m) if m.file_type().is_symlink() => {
                        hops += 1;
                        if hops > MAX_HOPS {
                            return Err(format!("the symlink's target {shown} is a loop of links"));
                        }
                        at.pop();
                        let next = std::fs::read_link(&here).map_err(|e| format!("reading a link on its way: {e}"))?;
                        for c in next.components().rev() {
                            pending.push_front(PathBuf::from(c.as_os_str()));
                        }
                    }
                    Ok(m) if m.is_dir() => {}
                    // A file or a missing name: nothing below it exists now.
                    _ => dangling = true,
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(build: impl FnOnce(&mut tar::Builder<flate2::write::GzEncoder<Vec<u8>>>)) -> tempfile_free::Dir {
        let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        build(&mut b);
        let bytes = b.into_inner().and_then(|gz| gz.finish()).expect("archive");
        let dir = tempfile_free::Dir::new();
        std::fs::write(dir.0.join("a.tar.gz"), bytes).expect("write");
        std::fs::create_dir(dir.0.join("ws")).expect("ws");
        dir
    }

    fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(mode);
        h
    }

    fn raw_path(h: &mut tar::Header, name: &str) {
        // Bypasses the builder's own checks, as a hostile archive would.
        let gnu = h.as_gnu_mut().expect("gnu");
        gnu.name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_cksum();
    }

    fn run(dir: &tempfile_free::Dir) -> Result<usize, WorkspaceError> {
        unpack("x", &dir.0.join("a.tar.gz"), &dir.0.join("ws"))
    }

    #[test]
    fn an_archive_larger_than_the_limits_is_refused_before_it_is_written() {
        let dir = archive(|b| {
            for i in 0..3 {
                let data = vec![b'x'; 1000];
                let mut h = header(tar::EntryType::Regular, data.len() as u64, 0o644);
                b.append_data(&mut h, format!("f{i}"), &data[..]).unwrap();
            }
        });
        let ws = dir.0.join("ws");
        let limits = UnpackLimits { bytes: 2500, entries: 100 };
        let e = unpack_limited("x", &dir.0.join("a.tar.gz"), &ws, limits).unwrap_err();
        assert!(e.to_string().contains("unpacks to more than"), "{e}");
        assert!(!ws.join("f2").exists(), "the entry over the limit was not written");
        let limits = UnpackLimits { bytes: 1 << 20, entries: 2 };
        assert!(unpack_limited("x", &dir.0.join("a.tar.gz"), &ws, limits).is_err(), "too many entries");
        assert_eq!(run(&dir).unwrap(), 3, "within the default limits");
    }

    #[test]
    fn files_directories_modes_and_inner_links_unpack() {
        let dir = archive(|b| {
            let mut h = header(tar::EntryType::Regular, 3, 0o755);
            b.append_data(&mut h, "script.sh", &b"hi\n"[..]).unwrap();
            let mut h = header(tar::EntryType::Regular, 2, 0o644);
            b.append_data(&mut h, "data/in.txt", &b"ok"[..]).unwrap();
            let mut h = header(tar::EntryType::Symlink, 0, 0o777);
            b.append_link(&mut h, "data/link", "in.txt").unwrap();
            let mut h = header(tar::EntryType::Symlink, 0, 0o777);
            b.append_link(&mut h, "up", "data/../script.sh").unwrap();
        });
        assert_eq!(run(&dir).expect("unpack"), 2);
        let ws = dir.0.join("ws");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(ws.join("script.sh")).unwrap().permissions().mode() & 0o111, 0o111);
        assert_eq!(std::fs::read_to_string(ws.join("data/link")).unwrap(), "ok");
        assert_eq!(std::fs::read_to_string(ws.join("up")).unwrap(), "hi\n");
    }

    /// Adds one crafted entry to an archive.
    type AddEntry = Box<dyn Fn(&mut tar::Builder<flate2::write::GzEncoder<Vec<u8>>>)>;

    #[test]
    fn escapes_are_refused() {
        let cases: Vec<(&str, AddEntry)> = vec![
            (
                "dotdot",
                Box::new(|b| {
                    let mut h = header(tar::EntryType::Regular, 1, 0o644);
                    raw_path(&mut h, "../escape");
                    b.append(&h, &b"x"[..]).unwrap();
                }),
            ),
            (
                "absolute symlink",
                Box::new(|b| {
                    let mut h = header(tar::EntryType::Symlink, 0, 0o777);
                    b.append_link(&mut h, "etc", "/etc").unwrap();
                }),
            ),
            (
                "relative symlink",
                Box::new(|b| {
                    let mut h = header(tar::EntryType::Symlink, 0, 0o777);
                    b.append_link(&mut h, "d/up", "../../x").unwrap();
                }),
            ),
            (
                "chained symlinks",
                Box::new(|b| {
                    let mut h = header(tar::EntryType::Symlink, 0, 0o777);
                    b.append_link(&mut h, "here", ".").unwrap();
                    let mut h = header(tar::EntryType::Symlink, 0, 0o777);
                    b.append_link(&mut h, "here/out", "..").unwrap();
                }),
            ),
            (
                "hard link out",
                Box::new(|b| {
                    let mut h = header(tar::EntryType::Link, 0, 0o644);
                    h.set_path("pw").unwrap();
                    h.set_link_name_literal("../../../../etc/passwd").unwrap();
                    h.set_cksum();
                    b.append(&h, &b""[..]).unwrap();
                }),
            ),
            (
                "device",
                Box::new(|b| {
                    let mut h = header(tar::EntryType::Char, 0, 0o644);
                    b.append_data(&mut h, "null", &b""[..]).unwrap();
                }),
            ),
        ];
        for (what, build) in cases {
            let dir = archive(|b| build(b));
            let r = run(&dir);
            assert!(matches!(r, Err(WorkspaceError::Refused { .. })), "{what}: {r:?}");
            assert!(!dir.0.join("escape").exists() && !dir.0.join("out").exists(), "{what}");
        }
    }

    /// Every symlink under `ws` resolves inside it (or dangles); nothing was made next to it.
    fn assert_contained(dir: &tempfile_free::Dir, what: &str) {
        if let Some(problem) = escape(dir) {
            panic!("{what}: {problem}");
        }
    }

    /// What leads or lies outside the workspace, if anything.
    fn escape(dir: &tempfile_free::Dir) -> Option<String> {
        let ws = dir.0.join("ws");
        let root = std::fs::canonicalize(&ws).unwrap();
        fn walk(p: &Path, root: &Path) -> Option<String> {
            for e in std::fs::read_dir(p).unwrap() {
                let e = e.unwrap();
                let m = std::fs::symlink_metadata(e.path()).unwrap();
                if m.file_type().is_symlink() {
                    match std::fs::canonicalize(e.path()) {
                        Ok(real) if !real.starts_with(root) => {
                            return Some(format!("{} resolves to {}", e.path().display(), real.display()))
                        }
                        _ => {}
                    }
                } else if m.is_dir() {
                    if let Some(p) = walk(&e.path(), root) {
                        return Some(p);
                    }
                }
            }
            None
        }
        let mut beside: Vec<_> = std::fs::read_dir(&dir.0).unwrap().map(|e| e.unwrap().file_name()).collect();
        beside.sort();
        if beside != ["a.tar.gz", "ws"] {
            return Some(format!("written next to the workspace: {beside:?}"));
        }
        walk(&ws, &root)
    }

    fn symlink(b: &mut tar::Builder<flate2::write::GzEncoder<Vec<u8>>>, path: &str, target: &str) {
        let mut h = header(tar::EntryType::Symlink, 0, 0o777);
        b.append_link(&mut h, path, target).unwrap();
    }

    fn file(b: &mut tar::Builder<flate2::write::GzEncoder<Vec<u8>>>, path: &str, data: &str) {
        let mut h = header(tar::EntryType::Regular, data.len() as u64, 0o644);
        b.append_data(&mut h, path, data.as_bytes()).unwrap();
    }

    fn hard_link(b: &mut tar::Builder<flate2::write::GzEncoder<Vec<u8>>>, path: &str, target: &str) {
        let mut h = header(tar::EntryType::Link, 0, 0o644);
        h.set_path(path).unwrap();
        h.set_link_name_literal(target).unwrap();
        h.set_cksum();
        b.append(&h, &b""[..]).unwrap();
    }

    fn dir_entry(b: &mut tar::Builder<flate2::write::GzEncoder<Vec<u8>>>, path: &str) {
        let mut h = header(tar::EntryType::Directory, 0, 0o755);
        b.append_data(&mut h, path, &b""[..]).unwrap();
    }

    /// Issue 9, upload relink chains: entries that are harmless one by one but, in this order,
    /// leave a link in the workspace that leads out of it (or write through one).
    #[test]
    fn relink_chains_are_refused_whatever_the_order_of_entries() {
        let cases: Vec<(&str, &str, AddEntry)> = vec![
            (
                "a symlink re-pointed further out after a link through it was checked",
                "b",
                Box::new(|b| {
                    dir_entry(b, "c");
                    symlink(b, "b", "c");
                    symlink(b, "x", "b/..");
                    symlink(b, "b", ".");
                }),
            ),
            (
                "a link through a symlink made later",
                "x",
                Box::new(|b| {
                    symlink(b, "x", "b/..");
                    symlink(b, "b", ".");
                }),
            ),
            (
                "a hard link to a symlink (its relative target read from another directory)",
                "h",
                Box::new(|b| {
                    file(b, "f", "data");
                    dir_entry(b, "d");
                    symlink(b, "d/l", "../f");
                    hard_link(b, "h", "d/l");
                }),
            ),
            (
                "a hard link through a symlinked directory",
                "h",
                Box::new(|b| {
                    dir_entry(b, "d");
                    file(b, "d/f", "data");
                    symlink(b, "s", "d");
                    hard_link(b, "h", "s/f");
                }),
            ),
            (
                "a file written through a symlink to a directory",
                "s/new",
                Box::new(|b| {
                    dir_entry(b, "d");
                    symlink(b, "s", "d");
                    file(b, "s/new", "x");
                }),
            ),
            (
                "a file replacing a symlink",
                "s",
                Box::new(|b| {
                    file(b, "f", "x");
                    symlink(b, "s", "f");
                    file(b, "s", "y");
                }),
            ),
            (
                "a directory replacing a symlink",
                "s",
                Box::new(|b| {
                    dir_entry(b, "d");
                    symlink(b, "s", "d");
                    dir_entry(b, "s");
                }),
            ),
            (
                "a symlink replacing a directory",
                "d",
                Box::new(|b| {
                    dir_entry(b, "d");
                    symlink(b, "d", ".");
                }),
            ),
            (
                "a symlink loop",
                "a",
                Box::new(|b| {
                    symlink(b, "a", "b");
                    symlink(b, "b", "a/x");
                }),
            ),
        ];
        let mut wrong = Vec::new();
        for (what, entry, build) in cases {
            let dir = archive(|b| build(b));
            match run(&dir) {
                Err(WorkspaceError::Refused { entry: e, .. }) if e == entry => {}
                other => wrong.push(format!("{what}: expected entry {entry:?} refused, got {other:?}")),
            }
            if let Some(problem) = escape(&dir) {
                wrong.push(format!("{what}: {problem}"));
            }
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
    }

    #[test]
    fn duplicate_files_and_directories_replace_their_own_kind() {
        let dir = archive(|b| {
            dir_entry(b, "d");
            file(b, "d/f", "old");
            dir_entry(b, "d");
            file(b, "d/f", "new");
            symlink(b, "d/up", "../d/./f");
            hard_link(b, "d/h", "d/f");
        });
        assert_eq!(run(&dir).expect("unpack"), 3);
        let ws = dir.0.join("ws");
        assert_eq!(std::fs::read_to_string(ws.join("d/f")).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(ws.join("d/up")).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(ws.join("d/h")).unwrap(), "new");
        assert_contained(&dir, "plain archive");
    }

    #[test]
    fn set_uid_bits_are_not_unpacked() {
        let dir = archive(|b| {
            let mut h = header(tar::EntryType::Regular, 2, 0o6755);
            b.append_data(&mut h, "suid", &b"x\n"[..]).unwrap();
        });
        run(&dir).expect("unpack");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.0.join("ws/suid")).unwrap().permissions().mode();
        assert_eq!(mode & 0o7000, 0, "{mode:o}");
    }

    /// A temporary directory without the tempfile crate (not a dependency of this crate).
    mod tempfile_free {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                let p = std::env::temp_dir().join(format!("gpuci-ws-test-{}", rand::random::<u64>()));
                std::fs::create_dir_all(&p).expect("tempdir");
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }
}
