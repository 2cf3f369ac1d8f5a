//! The builds list's queries (issue 30) on every backend: a page of pipelines newest first
//! below a cursor, the jobs of several pipelines at once, and the build facts recorded per
//! pipeline. SQLite (file and memory) and a real throwaway Postgres (`common/pg.rs`;
//! skipped with a message where Postgres is not installed, unless CI=true).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "common/pg.rs"]
#[allow(dead_code)] // shared with the store suite, which uses all of it
mod pg;

use gpuci_core::job::JobState;
use gpuci_core::pipeline::Step;
use gpuci_store::*;
use std::collections::BTreeMap;

async fn builds_suite(s: &dyn Store) {
    let mut ids = Vec::new();
    for i in 0..5 {
        let jobs = (0..=i)
            .map(|k| NewJob {
                pipeline_id: 0,
                step: Step::new(format!("s{k}"), "true"),
                env: BTreeMap::new(),
                state: JobState::Queued,
                reason: "queued".into(),
                attempt: 1,
                retry_of: None,
                created_at_ms: 10 + i,
            })
            .collect();
        let p = NewPipeline {
            file_name: format!("p{i}.yml"),
            source: String::new(),
            workspace_upload: None,
            repository: None,
            origin: None,
            created_at_ms: 10 + i,
        };
        ids.push(s.create_pipeline(p, jobs).await.unwrap().0.id);
    }
    // Newest first, a page at a time below a cursor.
    let page: Vec<i64> = s.pipelines_before(None, 2).await.unwrap().iter().map(|p| p.id).collect();
    assert_eq!(page, [ids[4], ids[3]]);
    let page: Vec<i64> = s.pipelines_before(Some(ids[3]), 2).await.unwrap().iter().map(|p| p.id).collect();
    assert_eq!(page, [ids[2], ids[1]]);
    assert!(s.pipelines_before(Some(ids[0]), 2).await.unwrap().is_empty());
    // The jobs of several pipelines, every one of them, oldest first; none of the others.
    let jobs = s.jobs_of_pipelines(&[ids[1], ids[3]]).await.unwrap();
    assert_eq!(jobs.len(), 2 + 4);
    assert!(jobs.iter().all(|j| j.pipeline_id == ids[1] || j.pipeline_id == ids[3]));
    assert!(jobs.windows(2).all(|w| w[0].id < w[1].id));
    assert!(s.jobs_of_pipelines(&[]).await.unwrap().is_empty());
    // Build facts: stored, replaced, and absent for a pipeline without them.
    s.put_pipeline_build(ids[2], r#"{"branch":"main"}"#).await.unwrap();
    s.put_pipeline_build(ids[2], r#"{"branch":"dev","subject":"Fix 'quotes' and ; semicolons"}"#).await.unwrap();
    let facts = s.pipeline_builds(&[ids[1], ids[2]]).await.unwrap();
    assert_eq!(facts.len(), 1);
    assert_eq!(facts[&ids[2]], r#"{"branch":"dev","subject":"Fix 'quotes' and ; semicolons"}"#);
    assert!(s.pipeline_builds(&[]).await.unwrap().is_empty());
}

#[tokio::test]
async fn sqlite_file_store_lists_builds() {
    let dir = tempfile::tempdir().unwrap();
    builds_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn sqlite_memory_store_lists_builds() {
    builds_suite(&SqliteStore::in_memory().await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_lists_builds() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("builds").await).await.unwrap();
    builds_suite(&s).await;
}
