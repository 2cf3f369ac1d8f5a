//! What an agent did not enforce for a job: kept with the job's start, read back in every
//! listing, forgotten on a requeue.

use crate::{new_job, pg};
use gpuci_core::job::JobState;
use gpuci_store::*;

/// Issue 26 (no silent loss of protection): what an agent did not enforce for a job is kept
/// with the job's start and read back in every listing, a later change that says nothing of it
/// keeps it, a start on a fully enforcing agent records an empty list, and a requeue forgets
/// the list along with the agent it was about.
async fn unenforced_suite(s: &dyn Store) {
    use gpuci_protocol::agent::{Protection, Unenforced};
    let (_, jobs) = s
        .create_pipeline(
            NewPipeline {
                origin: None,
                file_name: "x.yml".into(),
                source: "steps: []".into(),
                workspace_upload: None,
                repository: None,
                created_at_ms: 1,
            },
            vec![new_job("lenient"), new_job("strict"), new_job("requeued")],
        )
        .await
        .unwrap();
    let (lenient, strict, requeued) = (jobs[0].id, jobs[1].id, jobs[2].id);
    assert!(jobs.iter().all(|j| j.unenforced.is_empty()), "nothing is said before a start");
    let said = vec![
        Unenforced {
            key: Protection::Limits,
            detail: "memory, CPU and process limits are not enforced: no job cgroups (--allow-unenforced-limits)"
                .into(),
        },
        Unenforced { key: Protection::DiskQuota, detail: "no disk quota: \"quoted\" and ünïcode".into() },
    ];
    for (id, list) in [(lenient, said.clone()), (strict, vec![]), (requeued, said.clone())] {
        s.assign_job(id, "agent-1", &[], 2).await.unwrap();
        let started = JobChange {
            state: Some(JobState::Running),
            started_at_ms: Some(3),
            unenforced: Some(list.clone()),
            ..Default::default()
        };
        assert_eq!(s.update_job(id, &[JobState::Assigned], started).await.unwrap().unenforced, list);
    }
    assert_eq!(s.get_job(lenient).await.unwrap().unwrap().unenforced, said);
    assert_eq!(s.get_job(strict).await.unwrap().unwrap().unenforced, vec![]);
    let listed = s.list_jobs(&JobFilter::default()).await.unwrap();
    assert_eq!(listed.iter().find(|j| j.id == lenient).unwrap().unenforced, said);
    let active = s.active_jobs().await.unwrap();
    assert_eq!(active.iter().find(|j| j.id == lenient).unwrap().unenforced, said);

    // The result says nothing of it: the list stays.
    let done = JobChange { state: Some(JobState::Succeeded), finished_at_ms: Some(4), ..Default::default() };
    assert_eq!(s.update_job(lenient, &[JobState::Running], done).await.unwrap().unenforced, said);

    // Back to the queue: the agent it was about is forgotten, and so is the list.
    let requeue = JobChange { state: Some(JobState::Queued), clear_assignment: true, ..Default::default() };
    assert_eq!(s.update_job(requeued, &[JobState::Running], requeue).await.unwrap().unenforced, vec![]);
    assert_eq!(s.get_job(requeued).await.unwrap().unwrap().unenforced, vec![]);
}

#[tokio::test]
async fn sqlite_store_keeps_what_an_agent_did_not_enforce() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    unenforced_suite(&SqliteStore::open(&path).await.unwrap()).await;
    // And after the database is opened again.
    let s = SqliteStore::open(&path).await.unwrap();
    let jobs = s.list_jobs(&JobFilter::default()).await.unwrap();
    let lenient = jobs.iter().find(|j| j.step.key == "lenient").unwrap();
    assert_eq!(lenient.unenforced.iter().map(|u| u.key.as_str()).collect::<Vec<_>>(), ["limits", "disk_quota"]);
}

#[tokio::test]
async fn postgres_store_keeps_what_an_agent_did_not_enforce() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("unenforced").await).await.unwrap();
    unenforced_suite(&s).await;
}
