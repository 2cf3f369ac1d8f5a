//! Artifacts and test reports: one row per job and path, listed, summed and deleted.

use crate::pg;
use gpuci_store::*;

/// Artifacts: one row per job and path (a second upload of a path replaces it), listed by
/// path, summed per repository (`None` its own class), and deleted by key.
async fn artifacts_suite(s: &dyn Store) {
    let art = |job, path: &str, size, repo: Option<&str>, at| ArtifactRecord {
        job_id: job,
        path: path.into(),
        size,
        sha256: format!("{size:064x}"),
        repository: repo.map(str::to_string),
        untrusted: false,
        created_at_ms: at,
    };
    s.put_artifact(&art(1, "dist/b.whl", 10, Some("github.com/o/r"), 100)).await.unwrap();
    s.put_artifact(&art(1, "dist/a.whl", 20, Some("github.com/o/r"), 200)).await.unwrap();
    s.put_artifact(&art(2, "log.txt", 5, None, 50)).await.unwrap();
    s.put_artifact(&art(3, "x", 7, Some("github.com/o/other"), 60)).await.unwrap();
    // Replaced, not added: the size counts once.
    s.put_artifact(&art(1, "dist/b.whl", 11, Some("github.com/o/r"), 300)).await.unwrap();
    let got = s.job_artifacts(1).await.unwrap();
    assert_eq!(
        got,
        [art(1, "dist/a.whl", 20, Some("github.com/o/r"), 200), art(1, "dist/b.whl", 11, Some("github.com/o/r"), 300)]
    );
    assert_eq!(s.repository_artifact_bytes(Some("github.com/o/r"), false).await.unwrap(), 31);
    assert_eq!(s.repository_artifact_bytes(None, false).await.unwrap(), 5);
    assert_eq!(s.repository_artifact_bytes(Some("github.com/none"), false).await.unwrap(), 0);
    // A fork's artifacts are summed apart from the trusted jobs'.
    s.put_artifact(&ArtifactRecord { untrusted: true, ..art(4, "fork.bin", 100, Some("github.com/o/r"), 400) })
        .await
        .unwrap();
    assert_eq!(s.repository_artifact_bytes(Some("github.com/o/r"), false).await.unwrap(), 31);
    assert_eq!(s.repository_artifact_bytes(Some("github.com/o/r"), true).await.unwrap(), 100);
    assert!(s.job_artifacts(4).await.unwrap()[0].untrusted);
    s.delete_artifacts(&[(4, "fork.bin".into())]).await.unwrap();
    let all: Vec<_> = s.all_artifacts().await.unwrap().into_iter().map(|a| (a.job_id, a.path)).collect();
    assert_eq!(all, [(2, "log.txt".into()), (3, "x".into()), (1, "dist/a.whl".into()), (1, "dist/b.whl".into())]);
    s.delete_artifacts(&[(1, "dist/a.whl".into()), (2, "log.txt".into()), (9, "none".into())]).await.unwrap();
    assert_eq!(s.job_artifacts(1).await.unwrap().len(), 1);
    assert!(s.job_artifacts(2).await.unwrap().is_empty());
    assert_eq!(s.repository_artifact_bytes(Some("github.com/o/r"), false).await.unwrap(), 11);
}

#[tokio::test]
async fn sqlite_store_passes_artifacts_suite() {
    let dir = tempfile::tempdir().unwrap();
    artifacts_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_artifacts_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("artifacts").await).await.unwrap();
    artifacts_suite(&s).await;
}

/// Test reports: one reading per job and path, replaced by a second; deleted with the
/// artifact of the same job and path.
async fn test_reports_suite(s: &dyn Store) {
    let r = |path: &str, json: Option<&str>, error: Option<&str>| TestReportRecord {
        job_id: 5,
        path: path.into(),
        report_json: json.map(str::to_string),
        error: error.map(str::to_string),
    };
    s.put_test_report(&r("b.xml", Some("{}"), None)).await.unwrap();
    s.put_test_report(&r("a.xml", None, Some("not well-formed"))).await.unwrap();
    s.put_test_report(&r("b.xml", Some("{\"tests\":1}"), None)).await.unwrap();
    assert_eq!(
        s.job_test_reports(5).await.unwrap(),
        [r("a.xml", None, Some("not well-formed")), r("b.xml", Some("{\"tests\":1}"), None)]
    );
    s.delete_artifacts(&[(5, "a.xml".into())]).await.unwrap();
    assert_eq!(s.job_test_reports(5).await.unwrap(), [r("b.xml", Some("{\"tests\":1}"), None)]);
    assert!(s.job_test_reports(6).await.unwrap().is_empty());
}

#[tokio::test]
async fn sqlite_store_passes_test_reports_suite() {
    let dir = tempfile::tempdir().unwrap();
    test_reports_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_test_reports_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("test_reports").await).await.unwrap();
    test_reports_suite(&s).await;
}
