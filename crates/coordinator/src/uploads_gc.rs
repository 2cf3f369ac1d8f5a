//! Upload garbage collection for the uploads' blob store ([`crate::blobs`]: the local
//! `<data-dir>/uploads`, or a shared bucket) and the temporary files in the local directory:
//! a timer task that, every [`DEFAULT_INTERVAL`] (and at start), gathers facts, asks
//! `gpuci_core::uploads::decide` which uploads go, and deletes them. It decides nothing itself.
//!
//! A pass holds the uploads gate's write side ([`Uploads::exclusive`]) from reading the
//! directory through the last delete, so no store, touch or pipeline commit of an upload
//! ([`crate::uploads::UploadPin`]) falls between the facts and the delete (module docs of
//! [`crate::uploads`]). The directory walk and the deletes run on the blocking pool, never on
//! the async threads; the scheduler does not wait for any of it (only new uploads and
//! submissions naming one wait for a pass, which takes a listing, one indexed query and the
//! deletes).
//!
//! The gate is in this process: one coordinator owns a data dir (the SQLite default, or
//! Postgres with one coordinator). With a store shared by several coordinators the decision
//! is the same function over the store's listing (an object's last write is its
//! `modified_ms`), and another coordinator's new upload is kept by the freshness rules
//! (module docs of [`crate::blobs`]).

use crate::blobs::{list_dir, BlobError, Listed};
use crate::metrics::Metrics;
use crate::uploads::{blob_name, valid_id, Uploads};
use gpuci_core::uploads::{decide, Deletion, Plan, Policy, StoredUpload, TempFile};
use gpuci_store::Store;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long an upload no unfinished job needs is kept after its last use (`[uploads] retention`):
/// a week covers a weekend plus the time to notice a failed nightly run and retry it by hand
/// (a retry downloads the same upload), while a busy coordinator's disk holds only a week of
/// distinct sources (content addressing stores each once).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 86_400);

/// How often a pass runs: a pass is a directory listing and one indexed query, so this is
/// cheap; it bounds how long uploads may sit over `[uploads] max_total` (ten minutes of
/// new uploads at most) and past their retention.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(600);

/// The collector's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GcConfig {
    pub retention: Duration,
    /// The most all uploads together may hold; `None`: no cap.
    pub max_total: Option<u64>,
    pub interval: Duration,
    /// An upload no pipeline names yet is kept this long after its last write, whatever the
    /// retention and the cap (rule 5 of `gpuci_core::uploads`; [`crate::blobs::SHARED_GRACE`]).
    pub unnamed_grace: Duration,
}

impl Default for GcConfig {
    fn default() -> Self {
        GcConfig {
            retention: DEFAULT_RETENTION,
            max_total: None,
            interval: DEFAULT_INTERVAL,
            unnamed_grace: crate::blobs::SHARED_GRACE,
        }
    }
}

impl GcConfig {
    fn policy(&self) -> Policy {
        Policy {
            retention_ms: i64::try_from(self.retention.as_millis()).unwrap_or(i64::MAX),
            max_total: self.max_total,
            unnamed_grace_ms: i64::try_from(self.unnamed_grace.as_millis()).unwrap_or(i64::MAX),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("listing the uploads in {location}: {source}")]
    Scan { location: String, source: BlobError },
    #[error("asking the store which pipelines name {count} upload(s): {source}")]
    Store { count: usize, source: gpuci_store::StoreError },
    #[error("the uploads directory task: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// The uploads deleted, with why.
    pub deleted: Vec<Deletion>,
    pub freed_bytes: u64,
    /// Temporary files of interrupted uploads deleted.
    pub temps_deleted: usize,
    /// Uploads left, and their bytes.
    pub kept: u64,
    pub kept_bytes: u64,
    /// With a size cap: by how much the uploads that may not go keep it exceeded.
    pub over_cap_bytes: u64,
}

/// Run passes every `config.interval` until `shutdown`.
pub async fn run(
    store: Arc<dyn Store>,
    uploads: Uploads,
    metrics: Arc<Metrics>,
    config: GcConfig,
    shutdown: CancellationToken,
) {
    // (A zero interval would panic; a pass every 100 ms is already more than anyone needs.)
    let mut every = tokio::time::interval(config.interval.max(Duration::from_millis(100)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        match pass(store.as_ref(), &uploads, config).await {
            Ok(r) => {
                for d in &r.deleted {
                    metrics.upload_collected(d.why, d.bytes);
                }
                if !r.deleted.is_empty() || r.temps_deleted > 0 {
                    tracing::info!(
                        deleted = r.deleted.len(),
                        freed_bytes = r.freed_bytes,
                        temporary_files = r.temps_deleted,
                        kept = r.kept,
                        kept_bytes = r.kept_bytes,
                        "uploads collected"
                    );
                }
                if r.over_cap_bytes > 0 {
                    tracing::warn!(
                        over_by_bytes = r.over_cap_bytes,
                        kept_bytes = r.kept_bytes,
                        "uploads exceed [uploads] max_total; what is left is needed by pipelines that may still run, or was used in the last minutes"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "upload garbage collection failed; trying again at the next pass"),
        }
    }
}

/// One pass: under the gate's write side, gather, decide, delete.
pub async fn pass(store: &dyn Store, uploads: &Uploads, config: GcConfig) -> Result<PassReport, GcError> {
    let _exclusive = uploads.exclusive().await;
    let dir = uploads.dir().to_path_buf();
    let blobs = uploads.blobs().clone();
    let scan_error = |source| GcError::Scan { location: blobs.location(), source };
    let listed = blobs.list().await.map_err(scan_error)?;
    // The temporary files are local whatever the store (with the local one, among its files).
    let local = if blobs.shared() {
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || list_dir(&dir)).await?.map_err(scan_error)?
    } else {
        listed.clone()
    };
    let (stored, temps) = classify(listed, local);
    let ids: Vec<String> = stored.iter().map(|u| u.id.clone()).collect();
    let uses = if ids.is_empty() {
        Vec::new()
    } else {
        store.upload_uses(&ids).await.map_err(|source| GcError::Store { count: ids.len(), source })?
    };
    let plan = decide(now_ms(), config.policy(), &stored, &uses, &temps);
    let Plan { delete, delete_temp, kept, kept_bytes, over_cap_bytes, .. } = plan;
    let mut deleted = Vec::with_capacity(delete.len());
    for d in delete {
        let ok = match blobs.delete(&blob_name(&d.id)).await {
            Ok(()) => {
                tracing::debug!(upload = %d.id, bytes = d.bytes, why = d.why.as_str(), "upload deleted");
                true
            }
            Err(e) => {
                tracing::warn!(upload = %d.id, error = %e, "could not delete an upload");
                false
            }
        };
        deleted.push((d, ok));
    }
    let temps_deleted = {
        let dir = dir.clone();
        let any_deleted = deleted.iter().any(|(_, ok)| *ok);
        tokio::task::spawn_blocking(move || remove_temps(&dir, &delete_temp, any_deleted)).await?
    };
    // Those that could not be deleted are still there.
    let failed_bytes: u64 = deleted.iter().filter(|(_, ok)| !ok).map(|(d, _)| d.bytes).sum();
    let failed = deleted.iter().filter(|(_, ok)| !ok).count() as u64;
    let deleted: Vec<Deletion> = deleted.into_iter().filter(|(_, ok)| *ok).map(|(d, _)| d).collect();
    let report = PassReport {
        freed_bytes: deleted.iter().map(|d| d.bytes).sum(),
        deleted,
        temps_deleted,
        kept: kept + failed,
        kept_bytes: kept_bytes + failed_bytes,
        over_cap_bytes,
    };
    uploads.set_stored(report.kept, report.kept_bytes);
    Ok(report)
}

fn now_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

/// The uploads (`<sha256>.tar.gz`) among `listed` and the temporary files (`.tmp-*`) among
/// `local`; nothing else there is ours and nothing else is looked at.
fn classify(listed: Vec<Listed>, local: Vec<Listed>) -> (Vec<StoredUpload>, Vec<TempFile>) {
    let uploads = listed
        .into_iter()
        .filter_map(|l| {
            let id = l.name.strip_suffix(".tar.gz").filter(|id| valid_id(id))?.to_string();
            Some(StoredUpload { id, bytes: l.bytes, modified_ms: l.modified_ms })
        })
        .collect();
    let temps = local
        .into_iter()
        .filter(|l| l.name.starts_with(".tmp-"))
        .map(|l| TempFile { name: l.name, bytes: l.bytes, modified_ms: l.modified_ms })
        .collect();
    (uploads, temps)
}

/// Delete the temporary files the plan names; how many went (already gone counts). The
/// deletes (and, with the local store, the uploads deleted before) are durable before the
/// pass reports them.
fn remove_temps(dir: &Path, temps: &[String], any_deleted: bool) -> usize {
    let gone = |p: &Path| match std::fs::remove_file(p) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => {
            tracing::warn!(path = %p.display(), error = %e, "could not delete a temporary upload file");
            false
        }
    };
    let temps_deleted = temps.iter().filter(|t| gone(&dir.join(t))).count();
    if any_deleted || temps_deleted > 0 {
        let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
    }
    temps_deleted
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use gpuci_core::job::JobState;
    use gpuci_core::pipeline::Step;
    use gpuci_store::{JobChange, NewJob, NewPipeline, SqliteStore};
    use std::path::PathBuf;

    const DAY: Duration = Duration::from_secs(86_400);

    /// A fresh directory, removed at the end (the crate has no tempfile dependency).
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> TempDir {
            let p = std::env::temp_dir().join(format!("gpuci-uploads-gc-{}", uuid::Uuid::new_v4()));
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn config() -> GcConfig {
        GcConfig { retention: 7 * DAY, ..GcConfig::default() }
    }

    fn age(path: &Path, by: Duration) {
        let f = std::fs::File::options().write(true).open(path).unwrap();
        f.set_modified(std::time::SystemTime::now() - by).unwrap();
    }

    async fn store_upload(u: &Uploads, bytes: &[u8]) -> String {
        let pin = u.pin().await;
        u.put(&pin, bytes.to_vec()).await.unwrap()
    }

    async fn pipeline_naming(store: &dyn Store, upload: &str, queued: bool) -> i64 {
        let job = NewJob {
            pipeline_id: 0,
            step: Step::new("a", "true"),
            env: Default::default(),
            state: JobState::Queued,
            reason: "queued".into(),
            attempt: 1,
            retry_of: None,
            created_at_ms: 1,
        };
        let p = NewPipeline {
            file_name: "x.yml".into(),
            source: "steps: []".into(),
            workspace_upload: Some(upload.to_string()),
            repository: None,
            origin: None,
            created_at_ms: 1,
        };
        let (p, jobs) = store.create_pipeline(p, vec![job]).await.unwrap();
        if !queued {
            let end = JobChange { state: Some(JobState::Succeeded), finished_at_ms: Some(2), ..Default::default() };
            store.update_job(jobs[0].id, &[JobState::Queued], end).await.unwrap();
        }
        p.id
    }

    #[tokio::test]
    async fn a_pass_deletes_old_unneeded_uploads_and_stale_temporary_files_only() {
        let dir = TempDir::new();
        let store = SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap();
        let u = Uploads::new(dir.path().join("uploads"));
        let finished = store_upload(&u, b"\x1f\x8bfinished").await;
        let queued = store_upload(&u, b"\x1f\x8bqueued").await;
        let recent = store_upload(&u, b"\x1f\x8brecent").await;
        pipeline_naming(&store, &finished, false).await;
        pipeline_naming(&store, &queued, true).await;
        for id in [&finished, &queued] {
            age(&u.path(id).unwrap(), 30 * DAY);
        }
        let (stale, live, other) = (u.dir().join(".tmp-stale"), u.dir().join(".tmp-live"), u.dir().join("notes.txt"));
        for p in [&stale, &live, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        age(&stale, Duration::from_secs(2 * 3600));
        age(&other, 30 * DAY);

        let r = pass(&store, &u, config()).await.unwrap();
        assert_eq!(r.deleted.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), [finished.as_str()]);
        assert_eq!((r.freed_bytes, r.temps_deleted, r.kept), (10, 1, 2));
        assert!(!u.exists(&finished) && u.exists(&queued) && u.exists(&recent));
        assert!(!stale.exists() && live.exists() && other.exists());
        assert_eq!(u.stored(), (2, r.kept_bytes));
        // Nothing more goes at the next pass.
        assert_eq!(pass(&store, &u, config()).await.unwrap().deleted, []);
    }

    /// Regression (crash safety of content addressing): the bytes of an upload the collector
    /// is about to delete are posted again and named by a new pipeline while the pass waits
    /// for the gate. The new use is not lost: the pass decides on facts gathered after it.
    #[tokio::test]
    async fn an_upload_used_again_while_a_pass_waits_is_kept() {
        let dir = TempDir::new();
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap());
        let u = Uploads::new(dir.path().join("uploads"));
        let bytes = b"\x1f\x8bsame content".to_vec();
        let id = store_upload(&u, &bytes).await;
        pipeline_naming(store.as_ref(), &id, false).await;
        age(&u.path(&id).unwrap(), 30 * DAY);

        // A use begins (the pin), then the pass starts and must wait for it.
        let pin = u.pin().await;
        let running = {
            let (store, u) = (store.clone(), u.clone());
            tokio::spawn(async move { pass(store.as_ref(), &u, config()).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!running.is_finished(), "a pass ran while an upload was pinned");
        // The same bytes again (touching the file), and a pipeline naming them, queued.
        assert_eq!(u.put(&pin, bytes.clone()).await.unwrap(), id);
        pipeline_naming(store.as_ref(), &id, true).await;
        drop(pin);
        let r = running.await.unwrap().unwrap();
        assert_eq!(r.deleted, []);
        assert!(u.exists(&id));

        // The other order: the pass deletes first, then the bytes come again: stored anew.
        let dir2 = TempDir::new();
        let store2 = SqliteStore::open(&dir2.path().join("gpuci.db")).await.unwrap();
        let u2 = Uploads::new(dir2.path().join("uploads"));
        let id2 = store_upload(&u2, &bytes).await;
        age(&u2.path(&id2).unwrap(), 30 * DAY);
        assert_eq!(pass(&store2, &u2, config()).await.unwrap().deleted.len(), 1);
        assert!(!u2.exists(&id2));
        assert_eq!(store_upload(&u2, &bytes).await, id2);
        assert!(u2.exists(&id2));
        assert_eq!(u2.stored(), (1, bytes.len() as u64));
    }

    /// Regression (outsider attack): an upload no pipeline named yet went at the next pass
    /// under a short retention or the cap, before the pipeline naming it came. Kept for the
    /// hour's grace from its last write; an older unnamed one goes.
    #[tokio::test]
    async fn a_fresh_unnamed_upload_survives_a_pass_and_an_old_one_goes() {
        let dir = TempDir::new();
        let store = SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap();
        let u = Uploads::new(dir.path().join("uploads"));
        let fresh = store_upload(&u, b"\x1f\x8bjust posted").await;
        let old = store_upload(&u, b"\x1f\x8bposted long ago").await;
        age(&u.path(&fresh).unwrap(), Duration::from_secs(10 * 60));
        age(&u.path(&old).unwrap(), Duration::from_secs(2 * 3600));
        let strict = GcConfig { retention: Duration::from_secs(1), max_total: Some(0), ..GcConfig::default() };
        let r = pass(&store, &u, strict).await.unwrap();
        assert_eq!(r.deleted.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), [old.as_str()]);
        assert!(u.exists(&fresh) && !u.exists(&old));
    }

    #[tokio::test]
    async fn the_size_cap_deletes_the_least_recently_used_first() {
        let dir = TempDir::new();
        let store = SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap();
        let u = Uploads::new(dir.path().join("uploads"));
        let old = store_upload(&u, &[0x1f, 0x8b, 1, 1, 1, 1, 1, 1, 1, 1]).await;
        let newer = store_upload(&u, &[0x1f, 0x8b, 2, 2, 2, 2, 2, 2, 2, 2]).await;
        age(&u.path(&old).unwrap(), 3 * DAY);
        age(&u.path(&newer).unwrap(), 2 * DAY);
        let capped = GcConfig { max_total: Some(15), ..config() };
        let r = pass(&store, &u, capped).await.unwrap();
        assert_eq!(
            r.deleted.iter().map(|d| (d.id.as_str(), d.why)).collect::<Vec<_>>(),
            [(old.as_str(), gpuci_core::uploads::Why::MaxTotal)]
        );
        assert!(u.exists(&newer) && !u.exists(&old));
    }
}
