//! Dynamic steps' job tokens: stored as a hash, uploads counted against the cap.

use crate::{new_job, pg};
use gpuci_core::job::JobState;
use gpuci_store::*;

/// Dynamic steps: a job's token is stored as a hash, one row per job; each upload is counted
/// in the commit that adds its jobs, and past the cap nothing is added; a new token resets the
/// count; an ended job's row goes with its end.
async fn job_tokens_suite(s: &dyn Store) {
    let np = NewPipeline {
        origin: None,
        file_name: "x".into(),
        source: String::new(),
        workspace_upload: None,
        repository: None,
        created_at_ms: 1,
    };
    let (p, jobs) = s.create_pipeline(np, vec![new_job("a"), new_job("b")]).await.unwrap();
    let (a, b) = (jobs[0].id, jobs[1].id);
    assert_eq!(s.job_token(a).await.unwrap(), None);
    // Without a token row nothing can be added.
    let added = s.add_uploaded_jobs(a, vec![NewJob { pipeline_id: p.id, ..new_job("x") }], 2).await.unwrap();
    assert!(added.is_none());
    assert_eq!(s.pipeline_jobs(p.id).await.unwrap().len(), 2);

    s.put_job_tokens(&[(a, "aa11".into())], 5).await.unwrap();
    let t = s.job_token(a).await.unwrap().unwrap();
    assert_eq!((t.job_id, t.token_sha256.as_str(), t.uploads, t.created_at_ms), (a, "aa11", 0, 5));
    for (i, key) in ["x", "y"].iter().enumerate() {
        let added = s
            .add_uploaded_jobs(a, vec![NewJob { pipeline_id: p.id, ..new_job(key) }], 2)
            .await
            .unwrap()
            .expect("under the cap");
        assert_eq!(added.len(), 1);
        assert_eq!((added[0].pipeline_id, added[0].step.key.as_str()), (p.id, *key));
        assert_eq!(s.job_token(a).await.unwrap().unwrap().uploads, i as u32 + 1);
    }
    let over = s.add_uploaded_jobs(a, vec![NewJob { pipeline_id: p.id, ..new_job("z") }], 2).await.unwrap();
    assert!(over.is_none(), "a third upload over a cap of 2");
    assert_eq!(s.pipeline_jobs(p.id).await.unwrap().len(), 4, "nothing added past the cap");

    // A new token for the job (placed again after a requeue) replaces the old hash and keeps
    // its count: a requeue is no way to a fresh set of uploads (outsider finding).
    s.put_job_tokens(&[(a, "bb22".into())], 6).await.unwrap();
    let t = s.job_token(a).await.unwrap().unwrap();
    assert_eq!((t.token_sha256.as_str(), t.uploads), ("bb22", 2));

    // Job a ends: its row goes with the end, in its transaction.
    s.update_job(a, &[JobState::Queued], JobChange { state: Some(JobState::Cancelled), ..Default::default() })
        .await
        .unwrap();
    assert_eq!(s.job_token(a).await.unwrap(), None);
    s.put_job_tokens(&[(b, "cc33".into())], 7).await.unwrap();
    assert!(s.job_token(b).await.unwrap().is_some());
    s.delete_job_token(b).await.unwrap();
    assert_eq!(s.job_token(b).await.unwrap(), None);
}

#[tokio::test]
async fn sqlite_store_passes_job_tokens_suite() {
    let dir = tempfile::tempdir().unwrap();
    job_tokens_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_job_tokens_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("job_tokens").await).await.unwrap();
    job_tokens_suite(&s).await;
}
