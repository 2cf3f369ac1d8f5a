//! Artifacts: where they are stored. Agents upload a job's files when its step ends and download the
//! files a job names in `artifacts_from:` before its command runs; people list and download
//! them. The rules (paths, caps, retention) are `gpuci_core::artifacts`'; this applies them.
//!
//! Storage: content-addressed as `<sha256>` in the blob store ([`crate::blobs`]:
//! `<data-dir>/artifacts/` by default, or a shared S3 bucket), streamed to a temporary file
//! in `<data-dir>/artifacts` while hashed, then stored (renamed into place, or uploaded): a
//! reader never sees half a file, and the same bytes are stored once; one store row per job
//! and path ([`gpuci_store::ArtifactRecord`]). Garbage collection ([`crate::artifacts_gc`])
//! deletes rows past retention and then every blob no row names, holding the gate's write
//! side; an upload holds its read side from the rename until its row is committed, so a blob
//! is never collected between the two. With a shared store the upload to it happens before
//! the gate and the caps' lock (never a network call under either), and a collector on any
//! coordinator spares unnamed blobs younger than a grace period instead.
//!
//! Who may do what, over HTTP: [`crate::api::artifacts`].

use crate::blobs::{Blob, BlobError, BlobStore, LocalBlobs};
use gpuci_core::artifacts::Limits;
use gpuci_protocol::api::ArtifactInfo;
use gpuci_store::ArtifactRecord;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where artifacts live and the caps they obey.
#[derive(Clone, Debug)]
pub struct Artifacts {
    /// The local directory: the blobs themselves with the local store, else their staging.
    pub(crate) dir: PathBuf,
    pub(crate) blobs: Arc<dyn BlobStore>,
    pub limits: Limits,
    /// Read side: an upload between its rename and its row; write side: a collector pass.
    pub(crate) gate: Arc<tokio::sync::RwLock<()>>,
    /// Held from an upload's final cap check through its row: the caps are exact.
    pub(crate) admit: Arc<tokio::sync::Mutex<()>>,
}

impl Artifacts {
    /// Artifacts in the local directory `dir`.
    pub fn new(dir: PathBuf, limits: Limits) -> Self {
        let blobs = Arc::new(LocalBlobs::new(dir.clone()));
        Self::with_store(dir, limits, blobs)
    }

    /// Artifacts in `blobs`, staged in `dir`.
    pub fn with_store(dir: PathBuf, limits: Limits, blobs: Arc<dyn BlobStore>) -> Self {
        Artifacts {
            dir,
            blobs,
            limits,
            gate: Arc::new(tokio::sync::RwLock::new(())),
            admit: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blobs(&self) -> &Arc<dyn BlobStore> {
        &self.blobs
    }

    /// The local file of blob `sha256` (with the local store), when the name is one.
    pub fn blob(&self, sha256: &str) -> Option<PathBuf> {
        crate::uploads::valid_id(sha256).then(|| self.dir.join(sha256))
    }

    /// The bytes of blob `sha256`, streamed; `None` when it is not stored (or not a name).
    pub async fn open(&self, sha256: &str) -> Result<Option<Blob>, BlobError> {
        if !crate::uploads::valid_id(sha256) {
            return Ok(None);
        }
        self.blobs.open(sha256).await
    }

    pub(crate) async fn exclusive(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.gate.clone().write_owned().await
    }
}

pub(crate) fn info(a: &ArtifactRecord) -> ArtifactInfo {
    ArtifactInfo {
        job_id: a.job_id,
        path: a.path.clone(),
        size: a.size,
        sha256: a.sha256.clone(),
        created_at_ms: a.created_at_ms,
        note: None,
    }
}
