//! Upload garbage collection's view: which pipelines name an upload and when each was last
//! active.

use crate::{new_job, pg};
use gpuci_core::job::JobState;
use gpuci_store::*;

/// Upload garbage collection's view (issue 29, shared uploads): which pipelines name an upload,
/// how many of their jobs may still run, and when each was last active.
async fn upload_uses_suite(s: &dyn Store) {
    let (a, b, never) = ("a1".repeat(32), "b2".repeat(32), "c3".repeat(32));
    let pipeline = |upload: &str, at: i64| NewPipeline {
        origin: None,
        file_name: "x.yml".into(),
        source: "steps: []".into(),
        workspace_upload: Some(upload.to_string()),
        repository: None,
        created_at_ms: at,
    };
    let job = |key: &str, at: i64| NewJob { created_at_ms: at, ..new_job(key) };
    // `a`: one pipeline finished (its last job ended at 50), one still queued.
    let (done, jobs) = s.create_pipeline(pipeline(&a, 10), vec![job("x", 10), job("y", 10)]).await.unwrap();
    for (j, end) in [(jobs[0].id, 30), (jobs[1].id, 50)] {
        let change = JobChange { state: Some(JobState::Cancelled), finished_at_ms: Some(end), ..Default::default() };
        s.update_job(j, &[JobState::Queued], change).await.unwrap();
    }
    let (queued, _) = s.create_pipeline(pipeline(&a, 20), vec![job("z", 20)]).await.unwrap();
    // `b`: a pipeline whose job was retried (the retry created at 70, still queued).
    let (retried, jobs) = s.create_pipeline(pipeline(&b, 40), vec![job("r", 40)]).await.unwrap();
    let end = JobChange { state: Some(JobState::Failed), finished_at_ms: Some(60), ..Default::default() };
    let retry = NewJob { pipeline_id: retried.id, attempt: 2, retry_of: Some(jobs[0].id), ..job("r", 70) };
    s.update_job_and_insert(jobs[0].id, &[JobState::Queued], end, retry).await.unwrap();
    // A pipeline without an upload is nobody's use.
    s.create_pipeline(NewPipeline { workspace_upload: None, ..pipeline(&a, 80) }, vec![job("n", 80)]).await.unwrap();

    let mut uses = s.upload_uses(&[a.clone(), b.clone(), never.clone()]).await.unwrap();
    uses.sort_by_key(|u| u.pipeline_id);
    let got: Vec<_> =
        uses.iter().map(|u| (u.upload.as_str(), u.pipeline_id, u.unfinished_jobs, u.last_active_ms)).collect();
    assert_eq!(got, [(a.as_str(), done.id, 0, 50), (a.as_str(), queued.id, 1, 20), (b.as_str(), retried.id, 1, 70)]);
    assert!(s.upload_uses(&[never]).await.unwrap().is_empty());
    assert!(s.upload_uses(&[]).await.unwrap().is_empty());
}

#[tokio::test]
async fn sqlite_store_passes_upload_uses_suite() {
    let dir = tempfile::tempdir().unwrap();
    upload_uses_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_upload_uses_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("upload_uses").await).await.unwrap();
    upload_uses_suite(&s).await;
}
