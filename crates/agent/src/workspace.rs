//! A job's workspace from its pipeline's upload: download the gzip'ed tar from the coordinator
//! (with this agent's credential), keep it in a small cache under `<data-dir>/uploads/` (named
//! by its sha256, checked before every use), and unpack it into the workspace.
//!
//! Unpacking refuses, and fails the job on, any entry that could write or point outside the
//! workspace: absolute paths and `..` components, symlinks whose target leaves the workspace
//! (checked as written, and again on the link as created, so a chain of links cannot escape
//! either), hard links to anything but a file already unpacked, and device files or FIFOs.
//! Ownership, set-id bits and extended attributes from the archive are not kept; the
//! executable bit is.

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
}

/// Where uploads come from: the coordinator, as this agent.
pub struct UploadSource {
    pub http: reqwest::Client,
    pub server: String,
    pub agent_id: String,
    pub credential: String,
    pub cache_dir: PathBuf,
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
    pub fn new(server: &str, agent_id: &str, credential: &str, cache_dir: PathBuf) -> reqwest::Result<Self> {
        // No overall timeout: an upload may be large. A stalled connection still ends.
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(30))
            .read_timeout(Duration::from_secs(120))
            .build()?;
        Ok(UploadSource {
            http,
            server: server.trim_end_matches('/').to_string(),
            agent_id: agent_id.to_string(),
            credential: credential.to_string(),
            cache_dir,
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
        let download = |reason: String| WorkspaceError::Download { id: id.into(), reason };
        let url = format!("{}/api/v1/uploads/{id}", self.server);
        let resp = self
            .http
            .get(&url)
            .bearer_auth(&self.credential)
            .header("x-gpuci-agent-id", &self.agent_id)
            .send()
            .await
            .map_err(|e| download(format!("GET {url}: {e}")))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            return Err(download(format!("GET {url}: {status}: {}", body.trim())));
        }
        let tmp = self.cache_dir.join(format!(".download-{id}-{}", rand::random::<u64>()));
        let result = async {
            let mut file = std::fs::File::create(&tmp).map_err(|e| cache(&tmp, e))?;
            let mut hasher = Sha256::new();
            let mut stream = resp.bytes_stream();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| download(format!("reading {url}: {e}")))?;
                hasher.update(&chunk);
                file.write_all(&chunk).map_err(|e| cache(&tmp, e))?;
            }
            file.sync_all().map_err(|e| cache(&tmp, e))?;
            let actual = hex::encode(hasher.finalize());
            if actual != id {
                return Err(WorkspaceError::Checksum { id: id.into(), actual });
            }
            std::fs::rename(&tmp, &path).map_err(|e| cache(&path, e))
        }
        .await;
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result?;
        self.prune(id);
        Ok(path)
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

/// Unpack the gzip'ed tar `archive` of upload `id` into the existing, empty directory `dest`.
/// Returns how many files (not directories or links) it wrote.
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

pub fn unpack(id: &str, archive: &Path, dest: &Path) -> Result<usize, WorkspaceError> {
    unpack_limited(id, archive, dest, UnpackLimits::default())
}

/// [`unpack`], refusing an archive whose entries add up to more than `limits`; the check is
/// made from each header before its data is written.
pub fn unpack_limited(id: &str, archive: &Path, dest: &Path, limits: UnpackLimits) -> Result<usize, WorkspaceError> {
    let unpack_err = |reason: String| WorkspaceError::Unpack { id: id.into(), reason };
    let refused = |entry: &Path, reason: &str| WorkspaceError::Refused {
        id: id.into(),
        entry: entry.display().to_string(),
        reason: reason.into(),
    };
    let root = std::fs::canonicalize(dest).map_err(|e| unpack_err(format!("workspace {}: {e}", dest.display())))?;
    let file = std::fs::File::open(archive).map_err(|e| unpack_err(format!("{}: {e}", archive.display())))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(std::io::BufReader::new(file)));
    tar.set_preserve_permissions(false);
    tar.set_preserve_ownerships(false);
    tar.set_unpack_xattrs(false);
    tar.set_overwrite(true);
    let mut files = 0;
    let (mut bytes, mut entries) = (0u64, 0u64);
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
        let path = entry.path().map_err(|e| unpack_err(format!("an entry's path: {e}")))?.into_owned();
        use tar::EntryType as T;
        let kind = entry.header().entry_type();
        if matches!(kind, T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink) {
            continue;
        }
        if path.components().all(|c| c == Component::CurDir) {
            continue; // `./`: the workspace itself
        }
        if !plain_relative(&path) {
            return Err(refused(&path, "the path is absolute or contains `..`"));
        }
        match kind {
            T::Regular | T::Continuous | T::Directory => {}
            T::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(|e| unpack_err(format!("{}: link target: {e}", path.display())))?
                    .ok_or_else(|| refused(&path, "a symlink without a target"))?
                    .into_owned();
                let parent = path.parent().unwrap_or(Path::new(""));
                if target.is_absolute() || normalize(&parent.join(&target)).is_none() {
                    return Err(refused(
                        &path,
                        &format!("the symlink points outside the workspace ({})", target.display()),
                    ));
                }
            }
            T::Link => {
                let target = entry
                    .link_name()
                    .map_err(|e| unpack_err(format!("{}: link target: {e}", path.display())))?
                    .ok_or_else(|| refused(&path, "a hard link without a target"))?
                    .into_owned();
                if !plain_relative(&target) {
                    return Err(refused(
                        &path,
                        &format!("the hard link points outside the workspace ({})", target.display()),
                    ));
                }
                // Only to a file this archive already wrote, reached without leaving the workspace.
                let real = std::fs::canonicalize(root.join(&target)).ok();
                let inside_file = real.as_ref().is_some_and(|r| r.starts_with(&root) && r.is_file());
                if !inside_file {
                    return Err(refused(
                        &path,
                        &format!("the hard link's target {} is not a file in the workspace", target.display()),
                    ));
                }
            }
            other => {
                return Err(refused(&path, &format!("{other:?} entries (devices, FIFOs, ...) are not allowed")));
            }
        }
        // `unpack_in` refuses to write through a directory that resolves outside `root`.
        let written = entry.unpack_in(&root).map_err(|e| unpack_err(format!("{}: {e}", path.display())))?;
        if !written {
            return Err(refused(&path, "it would be written outside the workspace"));
        }
        if kind == T::Symlink {
            // The link as created (its directory may itself be reached through links).
            let link = root.join(&path);
            let escapes = match std::fs::canonicalize(&link) {
                Ok(real) => !real.starts_with(&root),
                // Dangling: allowed only while what it names could not leave the workspace later.
                Err(_) => std::fs::read_link(&link)
                    .map_or(true, |t| t.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))),
            };
            if escapes {
                let _ = std::fs::remove_file(&link);
                return Err(refused(&path, "the symlink points outside the workspace"));
            }
        }
        if matches!(kind, T::Regular | T::Continuous | T::Link) {
            files += 1;
        }
    }
    Ok(files)
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
