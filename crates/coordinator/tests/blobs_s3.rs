//! Artifacts and uploads in an S3 bucket (`[blobs] backend = "s3"`), against moto's S3
//! server: the collector deletes the blobs no row names and nothing else, spares young ones
//! (another coordinator's upload in flight), and the store answers as the local one does.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "../../aws/tests/common/moto.rs"]
mod moto;

use gpuci_aws::s3::{Bucket, S3Settings};
use gpuci_coordinator::artifacts::Artifacts;
use gpuci_coordinator::artifacts_gc::{pass, ArtifactsConfig};
use gpuci_coordinator::blobs::{BlobStore, S3Blobs};
use gpuci_store::{ArtifactRecord, SqliteStore, Store};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

fn make_bucket(m: &moto::Moto, name: &str) -> Bucket {
    let addr = m.url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let req = format!(
        "PUT /{name} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: AWS4-HMAC-SHA256 Credential=test/20260101/{}/s3/aws4_request, SignedHeaders=host, Signature=0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        moto::REGION
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let settings = S3Settings {
        bucket: name.into(),
        prefix: "gpuci".into(),
        endpoint: Some(m.url.clone()),
        region: moto::REGION.into(),
        path_style: true,
        profile: None,
        credentials_file: None,
    };
    Bucket::with_credentials(settings, gpuci_aws::AwsCredentials::new("test", "test", None, None, "test"))
}

fn sha(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[tokio::test]
async fn the_collector_deletes_only_unnamed_blobs_past_the_grace_period() {
    let Some(m) = moto::start("artifacts gc on s3") else { return };
    let dir = std::env::temp_dir().join(format!("gpuci-blobs-s3-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = SqliteStore::open(&dir.join("gpuci.db")).await.unwrap();
    let blobs: Arc<dyn BlobStore> = Arc::new(S3Blobs::new(make_bucket(&m, "gpuci-gc"), "artifacts"));
    let artifacts = Artifacts::with_store(dir.join("artifacts"), Default::default(), blobs.clone());
    let (named, orphan) = (b"named by a row".to_vec(), b"named by nothing".to_vec());
    for bytes in [&named, &orphan] {
        let staged = dir.join("staged");
        std::fs::write(&staged, bytes).unwrap();
        assert!(blobs.store(&sha(bytes), &staged, bytes.len() as u64).await.unwrap(), "new");
    }
    let now = gpuci_coordinator::brain::now_ms();
    let row = ArtifactRecord {
        job_id: 1,
        path: "out.bin".into(),
        size: named.len() as u64,
        sha256: sha(&named),
        repository: None,
        untrusted: false,
        created_at_ms: now,
    };
    store.put_artifact(&row).await.unwrap();

    // Just written: the orphan may be another coordinator's upload whose row is on its way.
    let report = pass(&store, &artifacts, ArtifactsConfig::default(), now).await.unwrap();
    assert_eq!(report.blobs, 0);
    assert!(blobs.exists(&sha(&orphan)).await.unwrap());

    // Past the grace period, the orphan goes and the named blob stays.
    let quick = ArtifactsConfig { shared_grace: Duration::ZERO, ..ArtifactsConfig::default() };
    let later = now + 1_000;
    let report = pass(&store, &artifacts, quick, later).await.unwrap();
    assert_eq!((report.rows, report.blobs, report.freed_bytes), (0, 1, orphan.len() as u64));
    let left: Vec<String> = blobs.list().await.unwrap().into_iter().map(|l| l.name).collect();
    assert_eq!(left, [sha(&named)]);
    // The kept one still reads back whole.
    let mut b = artifacts.open(&sha(&named)).await.unwrap().unwrap();
    let mut got = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut b.body, &mut got).await.unwrap();
    assert_eq!(got, named);
    assert!(artifacts.open(&sha(&orphan)).await.unwrap().is_none(), "a missing blob is None, not an error");
    // Nothing was left in the local staging directory.
    assert!(std::fs::read_dir(dir.join("artifacts")).map(|d| d.count()).unwrap_or(0) == 0);

    // The row past retention: the row goes, then its blob.
    let much_later = later + 31 * 86_400_000;
    let report = pass(&store, &artifacts, quick, much_later).await.unwrap();
    assert_eq!((report.rows, report.blobs), (1, 1));
    assert!(blobs.list().await.unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Uploads in a bucket follow the same rules as in the data dir: past the retention, an
/// upload only finished pipelines (or none) name goes; one a queued job needs stays.
#[tokio::test]
async fn the_upload_collector_keeps_what_a_queued_job_needs_and_deletes_the_rest() {
    use gpuci_coordinator::uploads::Uploads;
    use gpuci_coordinator::uploads_gc::{pass, GcConfig};
    use gpuci_core::job::JobState;
    use gpuci_core::pipeline::Step;
    use gpuci_store::{JobChange, NewJob, NewPipeline};

    let Some(m) = moto::start("uploads gc on s3") else { return };
    let dir = std::env::temp_dir().join(format!("gpuci-uploads-s3-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = SqliteStore::open(&dir.join("gpuci.db")).await.unwrap();
    let blobs: Arc<dyn BlobStore> = Arc::new(S3Blobs::new(make_bucket(&m, "gpuci-uploads"), "uploads"));
    let uploads = Uploads::with_store(dir.join("uploads"), blobs.clone());
    let mut ids = Vec::new();
    for bytes in [&b"\x1f\x8bfinished"[..], b"\x1f\x8bqueued", b"\x1f\x8bnamed by nothing"] {
        let pin = uploads.pin().await;
        ids.push(uploads.put(&pin, bytes.to_vec()).await.unwrap());
    }
    let (finished, queued, orphan) = (&ids[0], &ids[1], &ids[2]);
    for (upload, still_queued) in [(finished, false), (queued, true)] {
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
            workspace_upload: Some(upload.clone()),
            repository: None,
            origin: None,
            created_at_ms: 1,
        };
        let (_, jobs) = store.create_pipeline(p, vec![job]).await.unwrap();
        if !still_queued {
            let end = JobChange { state: Some(JobState::Succeeded), finished_at_ms: Some(2), ..Default::default() };
            store.update_job(jobs[0].id, &[JobState::Queued], end).await.unwrap();
        }
    }
    for id in &ids {
        assert!(uploads.contains(id).await.unwrap());
    }
    // Every upload is older than a retention of 1 ms by the time the pass looks.
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Regression (outsider attack): the upload no pipeline names yet was just written (its
    // LastModified), so the hour's grace keeps it; the named, finished one goes.
    let config = GcConfig { retention: Duration::from_millis(1), ..GcConfig::default() };
    let r = pass(&store, &uploads, config).await.unwrap();
    assert_eq!(r.deleted.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), [finished.as_str()]);
    assert!(uploads.contains(orphan).await.unwrap());
    // Past the grace (shortened here), the unnamed one goes too.
    let config = GcConfig { retention: Duration::from_millis(1), unnamed_grace: Duration::ZERO, ..GcConfig::default() };
    let r = pass(&store, &uploads, config).await.unwrap();
    assert_eq!(r.deleted.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), [orphan.as_str()]);
    assert!(uploads.contains(queued).await.unwrap());
    assert!(!uploads.contains(finished).await.unwrap() && !uploads.contains(orphan).await.unwrap());
    assert_eq!(blobs.list().await.unwrap().len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}
