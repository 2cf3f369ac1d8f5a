//! The store test suite. Every backend runs the same checks; today that is SQLite (a file in
//! a temp dir, WAL, as in production, plus the in-memory variant).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::job::JobState;
use gpuci_core::pipeline::Step;
use gpuci_protocol::agent::{LogChunk, Stream};
use gpuci_store::*;
use std::collections::BTreeMap;

fn new_job(key: &str) -> NewJob {
    NewJob {
        pipeline_id: 0,
        step: Step::new(key, "echo hi"),
        env: BTreeMap::from([("A".into(), "1".into())]),
        state: JobState::Queued,
        reason: "waiting".into(),
        attempt: 1,
        retry_of: None,
        created_at_ms: 1000,
    }
}

async fn suite(s: &dyn Store) {
    // Pipelines and jobs are created together.
    let (p, jobs) = s
        .create_pipeline(
            NewPipeline {
                origin: None,
                file_name: "x.yml".into(),
                source: "steps: []".into(),
                workspace_upload: None,
                repository: None,
                created_at_ms: 1,
            },
            vec![new_job("a"), new_job("b")],
        )
        .await
        .unwrap();
    assert_eq!(jobs.len(), 2);
    assert!(jobs.iter().all(|j| j.pipeline_id == p.id && j.state == JobState::Queued));
    assert_eq!(jobs[0].step.key, "a");
    assert_eq!(jobs[0].env["A"], "1");
    let (a, b) = (jobs[0].id, jobs[1].id);
    assert_eq!(s.get_pipeline(p.id).await.unwrap().unwrap().workspace_upload, None);

    // A pipeline keeps the workspace upload it was submitted with.
    let upload = "ab".repeat(32);
    let (with_upload, _) = s
        .create_pipeline(
            NewPipeline {
                origin: None,
                file_name: "u.yml".into(),
                source: "steps: []".into(),
                workspace_upload: Some(upload.clone()),
                repository: Some("git@example.invalid:org/a.git".into()),
                created_at_ms: 1,
            },
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(with_upload.workspace_upload.as_deref(), Some(upload.as_str()));
    let again = s.get_pipeline(with_upload.id).await.unwrap().unwrap();
    assert_eq!(again.repository.as_deref(), Some("git@example.invalid:org/a.git"));
    let read = s.get_pipeline(with_upload.id).await.unwrap().unwrap();
    assert_eq!(read.workspace_upload.as_deref(), Some(upload.as_str()));

    // Assignment takes leases atomically; a leased GPU cannot be leased again.
    let ja = s.assign_job(a, "agent-1", &["GPU-1".into(), "GPU-2".into()], 5).await.unwrap();
    assert_eq!(ja.state, JobState::Assigned);
    assert_eq!(ja.gpus, vec!["GPU-1", "GPU-2"]);
    let err = s.assign_job(b, "agent-1", &["GPU-2".into()], 6).await.unwrap_err();
    assert!(matches!(err, StoreError::GpuLeased { ref gpu, holder } if gpu == "GPU-2" && holder == a), "{err}");
    // ...and the failed assignment left nothing behind.
    assert_eq!(s.get_job(b).await.unwrap().unwrap().state, JobState::Queued);
    assert_eq!(s.leases().await.unwrap().len(), 2);

    // Compare-and-set on state.
    let err = s
        .update_job(a, &[JobState::Queued], JobChange { state: Some(JobState::Running), ..Default::default() })
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict { found: JobState::Assigned, .. }));
    let r = s
        .update_job(
            a,
            &[JobState::Assigned],
            JobChange { state: Some(JobState::Running), started_at_ms: Some(7), ..Default::default() },
        )
        .await
        .unwrap();
    assert_eq!((r.state, r.started_at_ms), (JobState::Running, Some(7)));

    // Finishing releases leases and quarantines in one step.
    let r = s
        .update_job(
            a,
            &[JobState::Running],
            JobChange {
                state: Some(JobState::Failed),
                reason: Some("exited with code 1".into()),
                exit_code: Some(1),
                finished_at_ms: Some(9),
                release_leases: true,
                quarantine: vec![Quarantine {
                    gpu_uuid: "GPU-2".into(),
                    agent_id: "agent-1".into(),
                    reason: "memory held".into(),
                    since_ms: 9,
                }],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(1));
    assert!(s.leases().await.unwrap().is_empty());
    let q = s.quarantined().await.unwrap();
    assert_eq!(q.len(), 1);
    assert_eq!(q[0].reason, "memory held");
    assert!(s.release_quarantine("GPU-2").await.unwrap());
    assert!(!s.release_quarantine("GPU-2").await.unwrap());

    // Requeue clears the assignment.
    s.assign_job(b, "agent-1", &["GPU-3".into()], 10).await.unwrap();
    let r = s
        .update_job(
            b,
            &[JobState::Assigned],
            JobChange { state: Some(JobState::Queued), clear_assignment: true, ..Default::default() },
        )
        .await
        .unwrap();
    assert_eq!((r.agent_id.clone(), r.gpus.len()), (None, 0));
    assert!(s.leases().await.unwrap().is_empty());

    let active = s.active_jobs().await.unwrap();
    assert_eq!(active.iter().map(|j| j.id).collect::<Vec<_>>(), vec![b]);
    let failed = s.list_jobs(&JobFilter { states: vec![JobState::Failed], ..Default::default() }).await.unwrap();
    assert_eq!(failed.len(), 1);

    // Logs get consecutive sequence numbers across appends.
    let chunk = |t: &str| LogChunk { ts_us: 1, stream: Stream::Stdout, text: t.into() };
    let first = s.append_logs(a, &(0..150).map(|i| chunk(&format!("l{i}"))).collect::<Vec<_>>()).await.unwrap();
    assert_eq!(first.last().unwrap().seq, 150);
    s.append_logs(a, &[chunk("tail")]).await.unwrap();
    let tail = s.read_logs(a, 149, 10).await.unwrap();
    assert_eq!(tail.iter().map(|l| l.text.as_str()).collect::<Vec<_>>(), vec!["l149", "tail"]);

    // Agents.
    let rec = AgentRecord {
        id: "agent-1".into(),
        name: "box".into(),
        credential_hash: "ab".into(),
        registered_at_ms: 1,
        last_seen_ms: None,
        state: "disconnected".into(),
        reason: String::new(),
        hello_json: None,
    };
    s.insert_agent(&rec).await.unwrap();
    s.update_agent(
        "agent-1",
        AgentUpdate { state: Some("connected".into()), last_seen_ms: Some(3), ..Default::default() },
    )
    .await
    .unwrap();
    let got = s.get_agent("agent-1").await.unwrap().unwrap();
    assert_eq!((got.state.as_str(), got.last_seen_ms), ("connected", Some(3)));
    assert!(matches!(s.update_agent("nope", AgentUpdate::default()).await, Err(StoreError::AgentNotFound(_))));

    // Secrets: names are listed, values only fetched by name.
    s.set_secret("HF_TOKEN", "v1", 1).await.unwrap();
    s.set_secret("HF_TOKEN", "v2", 2).await.unwrap();
    assert_eq!(s.secret_names().await.unwrap(), vec![("HF_TOKEN".to_string(), 2)]);
    let v = s.secret_values(&["HF_TOKEN".into(), "MISSING".into()]).await.unwrap();
    assert_eq!(v.len(), 1);
    assert_eq!(v["HF_TOKEN"], "v2");
    assert!(s.delete_secret("HF_TOKEN").await.unwrap());
    assert!(!s.delete_secret("HF_TOKEN").await.unwrap());
}

/// The GitHub integration's records: deliveries deduplicate, job records insert once, runners,
/// approvals per SHA and check run ids round-trip.
async fn github_suite(s: &dyn Store) {
    assert!(s.record_delivery("d-1", "workflow_job", 1).await.unwrap());
    assert!(!s.record_delivery("d-1", "workflow_job", 2).await.unwrap(), "a redelivery is not new");
    assert!(s.record_delivery("d-2", "ping", 3).await.unwrap());

    let mut job = GithubJobRecord {
        id: 77,
        repository: "octo/gpu".into(),
        run_id: 5,
        name: "test".into(),
        labels: vec!["self-hosted".into(), "gpu".into()],
        pool: "h100".into(),
        state: "queued".into(),
        runner_job_id: None,
        runner_name: None,
        reason: "queued".into(),
        queued_at_ms: 10,
        updated_at_ms: 10,
    };
    assert!(s.insert_github_job(&job).await.unwrap());
    let mut twice = job.clone();
    twice.name = "other".into();
    assert!(!s.insert_github_job(&twice).await.unwrap());
    assert_eq!(s.get_github_job(77).await.unwrap().unwrap(), job);
    job.state = "completed".into();
    job.runner_name = Some("gpuci-1".into());
    s.put_github_job(&job).await.unwrap();
    assert_eq!(s.get_github_job(77).await.unwrap().unwrap().runner_name.as_deref(), Some("gpuci-1"));
    assert!(s.github_jobs(true, 10).await.unwrap().is_empty());
    assert_eq!(s.github_jobs(false, 10).await.unwrap().len(), 1);
    assert!(s.get_github_job(78).await.unwrap().is_none());

    let mut runner = RunnerRecord {
        name: "gpuci-1".into(),
        job_id: 3,
        pool: "h100".into(),
        repository: "octo/gpu".into(),
        org: None,
        runner_id: None,
        github_job_id: None,
        state: "queued".into(),
        created_at_ms: 1,
        updated_at_ms: 1,
    };
    s.put_runner(&runner).await.unwrap();
    assert_eq!(s.runners(true).await.unwrap(), vec![runner.clone()]);
    runner.state = "done".into();
    runner.runner_id = Some(9);
    s.put_runner(&runner).await.unwrap();
    assert!(s.runners(true).await.unwrap().is_empty());
    assert_eq!(s.get_runner("gpuci-1").await.unwrap().unwrap().runner_id, Some(9));

    let approval = ApprovalRecord {
        repository: "octo/gpu".into(),
        pr: 4,
        head_sha: "abc".into(),
        approved_by: "maintainer".into(),
        approved_at_ms: 5,
    };
    s.put_approval(&approval).await.unwrap();
    assert_eq!(s.get_approval("octo/gpu", 4, "abc").await.unwrap(), Some(approval));
    assert_eq!(s.get_approval("octo/gpu", 4, "def").await.unwrap(), None, "an approval is for one SHA");

    assert_eq!(s.get_check_run(3).await.unwrap(), None);
    s.set_check_run(3, 1234).await.unwrap();
    assert_eq!(s.get_check_run(3).await.unwrap(), Some(1234));
}

#[tokio::test]
async fn sqlite_file_store_passes_github_suite() {
    let dir = tempfile::tempdir().unwrap();
    github_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn sqlite_file_store_passes_suite() {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap();
    suite(&s).await;
}

#[tokio::test]
async fn sqlite_memory_store_passes_suite() {
    suite(&SqliteStore::in_memory().await.unwrap()).await;
}

#[tokio::test]
async fn data_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    let id = {
        let s = SqliteStore::open(&path).await.unwrap();
        let (_, jobs) = s
            .create_pipeline(
                NewPipeline {
                    origin: None,
                    file_name: "x".into(),
                    source: String::new(),
                    workspace_upload: None,
                    repository: Some("repo".into()),
                    created_at_ms: 1,
                },
                vec![new_job("a")],
            )
            .await
            .unwrap();
        jobs[0].id
    };
    let s = SqliteStore::open(&path).await.unwrap();
    assert_eq!(s.get_job(id).await.unwrap().unwrap().step.key, "a");
}
