//! Artifact garbage collection (`[artifacts] retention`, `max_total`): a timer task that,
//! every `interval` (and at start), reads every artifact row, asks
//! `gpuci_core::artifacts::collect` which go, deletes those rows, and then deletes every blob
//! in the artifacts' blob store that no row names any more (and temporary files of uploads
//! that stopped an hour ago, in `<data-dir>/artifacts`). It decides nothing itself.
//!
//! A pass holds the artifacts gate's write side ([`Artifacts::exclusive`]) throughout; an
//! upload holds the read side from renaming its blob into place until its row is committed,
//! so a blob is never collected between the two. A shared store (S3, several coordinators)
//! is written by other processes the gate cannot hold back: so a blob no row names goes only
//! once its last write (mtime, or S3's `LastModified`) is older than `shared_grace`, an hour
//! (module docs of [`crate::blobs`]); the local store follows the same rule.

use crate::artifacts::Artifacts;
use crate::parsed::Parsed;
use gpuci_core::quantity::Bytes;
use gpuci_store::Store;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long artifacts are kept: 30 days, GitHub Actions' default for its artifacts.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(30 * 86_400);
/// How often a pass runs.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(600);
/// A temporary file not written for this long belongs to no live upload.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// The artifact settings of the server config (`[artifacts]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArtifactsConfig {
    pub limits: gpuci_core::artifacts::Limits,
    pub retention: Duration,
    /// The most all artifacts together may hold; `None`: no cap beyond the per-repository one.
    pub max_total: Option<u64>,
    pub interval: Duration,
    /// How old a blob no row names must be to go ([`crate::blobs::SHARED_GRACE`]; tests
    /// shorten it).
    pub shared_grace: Duration,
}

impl Default for ArtifactsConfig {
    fn default() -> Self {
        ArtifactsConfig {
            limits: Default::default(),
            retention: DEFAULT_RETENTION,
            max_total: None,
            interval: DEFAULT_INTERVAL,
            shared_grace: crate::blobs::SHARED_GRACE,
        }
    }
}

/// `[artifacts]` in the server config file; every key optional, unknown keys refused.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArtifactsFile {
    /// Artifacts older than this are deleted. Default 30d.
    pub retention: Option<Parsed<gpuci_core::duration::Duration>>,
    /// The most all artifacts together may hold; over it the oldest go first. Default: no cap.
    pub max_total: Option<Parsed<Bytes>>,
    /// Largest single artifact. Default 1GiB.
    pub max_file: Option<Parsed<Bytes>>,
    /// Most one job's artifacts may hold. Default 5GiB.
    pub max_job: Option<Parsed<Bytes>>,
    /// Most one repository's artifacts may hold. Default 50GiB.
    pub max_repository: Option<Parsed<Bytes>>,
    /// Most artifacts one job may store. Default 10000.
    pub max_files_per_job: Option<u64>,
}

impl ArtifactsFile {
    pub fn apply(&self, c: &mut ArtifactsConfig) {
        if let Some(r) = &self.retention {
            // Zero would delete every artifact as it arrives: at least a minute.
            c.retention = r.0.as_std().max(Duration::from_secs(60));
        }
        if let Some(m) = &self.max_total {
            c.max_total = Some(m.0 .0);
        }
        let l = &mut c.limits;
        for (field, into) in [
            (&self.max_file, &mut l.max_file),
            (&self.max_job, &mut l.max_job),
            (&self.max_repository, &mut l.max_repository),
        ] {
            if let Some(v) = field {
                *into = v.0 .0;
            }
        }
        if let Some(n) = self.max_files_per_job {
            l.max_files_per_job = n;
        }
    }
}

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Rows deleted.
    pub rows: usize,
    /// Blobs deleted, and their bytes.
    pub blobs: usize,
    pub freed_bytes: u64,
}

pub async fn run(store: Arc<dyn Store>, artifacts: Artifacts, config: ArtifactsConfig, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(config.interval.max(Duration::from_millis(100)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        match pass(store.as_ref(), &artifacts, config, crate::brain::now_ms()).await {
            Ok(r) if r.rows > 0 || r.blobs > 0 => {
                tracing::info!(rows = r.rows, blobs = r.blobs, freed_bytes = r.freed_bytes, "artifacts collected")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "artifact garbage collection failed; trying again at the next pass"),
        }
    }
}

/// One pass at `now_ms`: rows by the retention rules, then unnamed blobs.
pub async fn pass(
    store: &dyn Store,
    artifacts: &Artifacts,
    config: ArtifactsConfig,
    now_ms: i64,
) -> anyhow::Result<PassReport> {
    let _exclusive = artifacts.exclusive().await;
    let rows = store.all_artifacts().await?;
    let stored: Vec<gpuci_core::artifacts::Stored> = rows
        .iter()
        .map(|a| gpuci_core::artifacts::Stored {
            job: a.job_id,
            path: a.path.clone(),
            bytes: a.size,
            created_ms: a.created_at_ms,
        })
        .collect();
    let retention_ms = i64::try_from(config.retention.as_millis()).unwrap_or(i64::MAX);
    let gone = gpuci_core::artifacts::collect(&stored, now_ms, retention_ms, config.max_total);
    let keys: Vec<(i64, String)> = gone.iter().map(|&i| (rows[i].job_id, rows[i].path.clone())).collect();
    if !keys.is_empty() {
        store.delete_artifacts(&keys).await?;
    }
    let gone: HashSet<usize> = gone.into_iter().collect();
    let named: HashSet<String> =
        rows.iter().enumerate().filter(|(i, _)| !gone.contains(i)).map(|(_, a)| a.sha256.clone()).collect();
    let store = artifacts.blobs();
    // A blob written since this moment may be an upload whose row is not committed yet: with
    // a shared store, another coordinator's, which this gate does not hold back. The local
    // store gets the same rule (its uploads are under the gate; the hour costs only space).
    let young_after = now_ms.saturating_sub(i64::try_from(config.shared_grace.as_millis()).unwrap_or(i64::MAX));
    let (mut blobs, mut freed_bytes) = (0, 0);
    for b in store.list().await? {
        if !crate::uploads::valid_id(&b.name) || named.contains(&b.name) || b.modified_ms > young_after {
            continue;
        }
        match store.delete(&b.name).await {
            Ok(()) => {
                blobs += 1;
                freed_bytes += b.bytes;
            }
            Err(e) => tracing::warn!(error = %e, blob = %b.name, "could not delete an artifact blob"),
        }
    }
    let dir = artifacts.dir().to_path_buf();
    tokio::task::spawn_blocking(move || remove_stale_temps(&dir)).await??;
    Ok(PassReport { rows: keys.len(), blobs, freed_bytes })
}

/// Deletes the temporary files of uploads that stopped [`STALE_TEMP`] ago.
fn remove_stale_temps(dir: &std::path::Path) -> Result<(), crate::blobs::BlobError> {
    for f in crate::blobs::list_dir(dir)? {
        let age = crate::brain::now_ms().saturating_sub(f.modified_ms);
        if f.name.starts_with(".tmp-") && age > i64::try_from(STALE_TEMP.as_millis()).unwrap_or(i64::MAX) {
            let _ = std::fs::remove_file(dir.join(&f.name));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use gpuci_store::{ArtifactRecord, SqliteStore};

    const DAY_MS: i64 = 86_400_000;

    #[tokio::test]
    async fn a_pass_deletes_expired_rows_then_blobs_no_row_names() {
        let dir = std::env::temp_dir().join(format!("gpuci-artifacts-gc-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(dir.join("artifacts")).unwrap();
        let store = SqliteStore::open(&dir.join("gpuci.db")).await.unwrap();
        let artifacts = Artifacts::new(dir.join("artifacts"), Default::default());
        let (old, shared, fresh, orphan) = ("a".repeat(64), "b".repeat(64), "c".repeat(64), "d".repeat(64));
        for (sha, bytes) in [(&old, 10), (&shared, 20), (&fresh, 30), (&orphan, 40)] {
            std::fs::write(artifacts.dir().join(sha), vec![0u8; bytes]).unwrap();
        }
        let row = |job, path: &str, sha: &str, size, created_at_ms| ArtifactRecord {
            job_id: job,
            path: path.into(),
            size,
            sha256: sha.into(),
            repository: None,
            untrusted: false,
            created_at_ms,
        };
        // Every blob was written over the grace period before `now`.
        let now = crate::brain::now_ms() + 2 * 3_600_000;
        // Job 1 is 40 days old; job 2 is a day old and shares one blob with it.
        store.put_artifact(&row(1, "old.bin", &old, 10, now - 40 * DAY_MS)).await.unwrap();
        store.put_artifact(&row(1, "shared.bin", &shared, 20, now - 40 * DAY_MS)).await.unwrap();
        store.put_artifact(&row(2, "shared.bin", &shared, 20, now - DAY_MS)).await.unwrap();
        store.put_artifact(&row(2, "fresh.bin", &fresh, 30, now - DAY_MS)).await.unwrap();
        let report = pass(&store, &artifacts, ArtifactsConfig::default(), now).await.unwrap();
        assert_eq!(report, PassReport { rows: 2, blobs: 2, freed_bytes: 50 }, "old.bin's blob and the orphan");
        assert!(store.job_artifacts(1).await.unwrap().is_empty());
        assert_eq!(store.job_artifacts(2).await.unwrap().len(), 2);
        assert!(artifacts.dir().join(&shared).exists(), "still named by job 2");
        assert!(!artifacts.dir().join(&old).exists() && !artifacts.dir().join(&orphan).exists());
        // A total cap of 25 bytes: the older of job 2's two goes.
        let capped = ArtifactsConfig { max_total: Some(25), ..ArtifactsConfig::default() };
        let report = pass(&store, &artifacts, capped, now).await.unwrap();
        assert_eq!(report.rows, 1);
        let left: Vec<String> = store.job_artifacts(2).await.unwrap().into_iter().map(|a| a.path).collect();
        assert_eq!(left.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Regression (outsider attack): with the local store a blob no row named went at the
    /// next pass whatever its age; the documented hour's grace holds on every store.
    #[tokio::test]
    async fn a_fresh_unnamed_blob_survives_a_pass_and_an_old_one_goes() {
        let dir = std::env::temp_dir().join(format!("gpuci-artifacts-gc-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(dir.join("artifacts")).unwrap();
        let store = SqliteStore::open(&dir.join("gpuci.db")).await.unwrap();
        let artifacts = Artifacts::new(dir.join("artifacts"), Default::default());
        let (fresh, old) = ("e".repeat(64), "f".repeat(64));
        for sha in [&fresh, &old] {
            std::fs::write(artifacts.dir().join(sha), b"bytes").unwrap();
        }
        let two_hours_ago = std::time::SystemTime::now() - Duration::from_secs(2 * 3600);
        std::fs::File::options()
            .write(true)
            .open(artifacts.dir().join(&old))
            .unwrap()
            .set_modified(two_hours_ago)
            .unwrap();
        let report = pass(&store, &artifacts, ArtifactsConfig::default(), crate::brain::now_ms()).await.unwrap();
        assert_eq!((report.blobs, report.freed_bytes), (1, 5));
        assert!(artifacts.dir().join(&fresh).exists() && !artifacts.dir().join(&old).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
