//! Workspace uploads: the files a job's workspace starts from (over HTTP:
//! [`crate::api::uploads`]). A client (`gpuci submit`) posts
//! a gzip'ed tar; it is stored content-addressed as `<sha256>.tar.gz` in the blob store
//! ([`crate::blobs`]: `<data-dir>/uploads/` by default, or a shared S3 bucket), written to a
//! temporary file while hashed, synced, then stored: a reader never sees half a file, and the
//! same content is stored once. A pipeline names it by id (`SubmitPipeline::workspace_upload`)
//! and each agent downloads it with its own credential before running a job.
//!
//! The coordinator does not look inside the archive; agents unpack it, refusing entries that
//! would land outside the workspace.
//!
//! Uploads are garbage-collected ([`crate::uploads_gc`]; the rules in `gpuci_core::uploads`).
//! Content addressing makes that racy by nature: the bytes a collector is about to delete may
//! be posted again, or named by a new pipeline, at that moment. So every use that makes an
//! upload wanted (storing or touching its file, and checking it exists through committing
//! the pipeline that names it) holds an [`UploadPin`], and the collector gathers its facts,
//! decides and deletes holding the gate's other side: a use comes wholly before a pass
//! (which then sees it) or wholly after (which then stores the file anew or is refused).
//! A download of a collected upload that a pipeline names answers 410 Gone.
//!
//! With a shared store (S3) the gate is this process's only: another coordinator's collector
//! is kept off a new upload by its fresh last write (an upload is written again each time
//! it is posted, and the size cap spares uploads used in the last `FRESH_MS`; module docs of
//! [`crate::blobs`]). A posted upload is written to the shared store before the pin is
//! taken, never under it; an archive the coordinator makes itself ([`Uploads::put`]) is
//! written under its caller's pin (it must exist before the pipeline naming it commits).

use crate::blobs::{BlobError, BlobStore, LocalBlobs};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The largest upload accepted.
pub const MAX_UPLOAD_BYTES: u64 = 512 << 20;

/// Where uploads live: a blob store, and `<data-dir>/uploads` (the store itself by default;
/// with a shared store, where uploads are staged on their way to it).
#[derive(Clone, Debug)]
pub struct Uploads {
    pub(crate) dir: PathBuf,
    pub(crate) blobs: Arc<dyn BlobStore>,
    /// Read side: a use in progress ([`UploadPin`]); write side: a collector pass.
    pub(crate) gate: Arc<tokio::sync::RwLock<()>>,
    /// How many uploads are stored and their bytes: as the collector's last pass counted
    /// them, plus those stored since (for `/metrics`).
    count: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
}

/// Held while an upload is being made wanted: from before its file is stored or touched, or
/// checked to exist, until the pipeline that names it is committed (or the request gives up).
/// While any pin is held, no collector pass runs. Hold it briefly: never over a download
/// or a network call, since a waiting pass holds back new pins.
#[must_use]
pub struct UploadPin(#[allow(dead_code)] tokio::sync::OwnedRwLockReadGuard<()>);

impl Uploads {
    /// Uploads in the local directory `dir`.
    pub fn new(dir: PathBuf) -> Self {
        let blobs = Arc::new(LocalBlobs::new(dir.clone()));
        Self::with_store(dir, blobs)
    }

    /// Uploads in `blobs`, staged in `dir`.
    pub fn with_store(dir: PathBuf, blobs: Arc<dyn BlobStore>) -> Self {
        Uploads { dir, blobs, gate: Arc::default(), count: Arc::default(), bytes: Arc::default() }
    }

    /// The local directory: the uploads themselves with the local store, else their staging.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blobs(&self) -> &Arc<dyn BlobStore> {
        &self.blobs
    }

    /// A pin: no collector pass runs until it is dropped.
    pub async fn pin(&self) -> UploadPin {
        UploadPin(self.gate.clone().read_owned().await)
    }

    /// The collector's side of the gate: no pin is held while it lives.
    pub(crate) async fn exclusive(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.gate.clone().write_owned().await
    }

    /// Stored uploads and their bytes (the collector's last count, plus uploads since).
    pub fn stored(&self) -> (u64, u64) {
        (self.count.load(Ordering::Relaxed), self.bytes.load(Ordering::Relaxed))
    }

    /// Set by the collector, under its side of the gate.
    pub(crate) fn set_stored(&self, count: u64, bytes: u64) {
        self.count.store(count, Ordering::Relaxed);
        self.bytes.store(bytes, Ordering::Relaxed);
    }

    pub(crate) fn note_stored(&self, bytes: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The local file of upload `id` (with the local store); `None` when `id` is not a
    /// sha256 in lowercase hex.
    pub fn path(&self, id: &str) -> Option<PathBuf> {
        valid_id(id).then(|| self.dir.join(blob_name(id)))
    }

    /// Whether upload `id` is in the local directory (the local store's test helper; a
    /// request asks [`Uploads::contains`]).
    pub fn exists(&self, id: &str) -> bool {
        self.path(id).is_some_and(|p| p.is_file())
    }

    /// Whether upload `id` is stored, in whichever store.
    pub async fn contains(&self, id: &str) -> Result<bool, BlobError> {
        if !valid_id(id) {
            return Ok(false);
        }
        self.blobs.exists(&blob_name(id)).await
    }

    /// Store an archive the coordinator made itself (a repository at a commit); returns its id.
    /// The caller holds `_pin` until the pipeline naming it is committed.
    pub async fn put(&self, _pin: &UploadPin, bytes: Vec<u8>) -> std::io::Result<String> {
        let dir = self.dir.clone();
        let len = bytes.len() as u64;
        let tmp = dir.join(format!(".tmp-{}", uuid::Uuid::new_v4()));
        let guard = TempFile(tmp.clone());
        let id = {
            let tmp = tmp.clone();
            tokio::task::spawn_blocking(move || {
                use std::io::Write;
                std::fs::create_dir_all(&dir)?;
                let id = hex::encode(Sha256::digest(&bytes));
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(&bytes)?;
                f.sync_all()?;
                Ok::<_, std::io::Error>(id)
            })
            .await
            .map_err(std::io::Error::other)??
        };
        let new = self.blobs.store(&blob_name(&id), &tmp, len).await.map_err(std::io::Error::other)?;
        drop(guard);
        if new {
            self.note_stored(len);
        }
        Ok(id)
    }
}

/// The blob an upload is stored as.
pub fn blob_name(id: &str) -> String {
    format!("{id}.tar.gz")
}

/// A sha256 in lowercase hex: 64 characters of `0-9a-f`.
pub fn valid_id(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A temporary file, removed when dropped unless it was renamed away first.
pub(crate) struct TempFile(pub(crate) PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
