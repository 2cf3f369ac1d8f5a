//! The core suite: pipelines, jobs and their states, logs, agents and assignments; data that
//! survives a reopen or a Postgres crash, and correct results under concurrent writers.

use crate::{new_job, pg};
use gpuci_core::job::JobState;
use gpuci_protocol::agent::{LogChunk, Stream};
use gpuci_store::*;

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

    // A submission key creates its pipeline once: sent again, it answers the first pipeline
    // and creates nothing; reused for another request, it says so and creates nothing.
    let once = Submission { key: format!("k-{}", crate::rand_suffix()), digest: "d1".into() };
    let submitted = || NewPipeline {
        origin: None,
        file_name: "once.yml".into(),
        source: "steps: []".into(),
        workspace_upload: None,
        repository: None,
        created_at_ms: 2,
    };
    let made = match s.create_pipeline_once(submitted(), vec![], &once).await.unwrap() {
        Created::New(p, jobs) => {
            assert!(jobs.is_empty());
            p.id
        }
        other => panic!("{other:?}"),
    };
    match s.create_pipeline_once(submitted(), vec![], &once).await.unwrap() {
        Created::Before { pipeline, same } => assert!(pipeline == made && same),
        other => panic!("created again: {other:?}"),
    }
    let reused = Submission { digest: "d2".into(), ..once.clone() };
    match s.create_pipeline_once(submitted(), vec![], &reused).await.unwrap() {
        Created::Before { pipeline, same } => assert!(pipeline == made && !same),
        other => panic!("created again: {other:?}"),
    }
    assert_eq!(s.get_pipeline(made + 1).await.unwrap().map(|p| p.file_name), None, "no second pipeline");

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
    // The next page of a newest-first listing: only jobs older than the one given.
    let all = s.list_jobs(&JobFilter::default()).await.unwrap();
    let older = s.list_jobs(&JobFilter { before: Some(all[0].id), ..Default::default() }).await.unwrap();
    assert_eq!(older.iter().map(|j| j.id).collect::<Vec<_>>(), all[1..].iter().map(|j| j.id).collect::<Vec<_>>());
    // Where pipelines came from, by id; ids the store does not have are left out.
    let origins = s.pipeline_origins(&[p.id, with_upload.id, 999_999]).await.unwrap();
    assert_eq!(origins.len(), 2);
    assert_eq!(origins[&p.id], (None, None));
    assert_eq!(origins[&with_upload.id].0.as_deref(), Some("git@example.invalid:org/a.git"));

    // Logs get consecutive sequence numbers across appends.
    let chunk = |t: &str| LogChunk { ts_us: 1, stream: Stream::Stdout, text: t.into() };
    let first = s.append_logs(a, None, &(0..150).map(|i| chunk(&format!("l{i}"))).collect::<Vec<_>>()).await.unwrap();
    assert_eq!(first.last().unwrap().seq, 150);
    s.append_logs(a, None, &[chunk("tail")]).await.unwrap();
    let tail = s.read_logs(a, 149, 10).await.unwrap();
    assert_eq!(tail.iter().map(|l| l.text.as_str()).collect::<Vec<_>>(), vec!["l149", "tail"]);

    // Lines numbered by their writer (the agent) are stored once however often they are sent.
    let lines = |from: usize, to: usize| (from..=to).map(|i| chunk(&format!("b{i}"))).collect::<Vec<_>>();
    assert_eq!(s.append_logs(b, Some(1), &lines(1, 3)).await.unwrap().len(), 3);
    let again = s.append_logs(b, Some(2), &lines(2, 5)).await.unwrap();
    assert_eq!(again.iter().map(|l| l.seq).collect::<Vec<_>>(), vec![4, 5], "a resend adds only what is new");
    assert!(s.append_logs(b, Some(1), &lines(1, 5)).await.unwrap().is_empty());
    // A numbered gap stays a gap (the writer says why in a line of its own).
    s.append_logs(b, Some(9), &lines(9, 9)).await.unwrap();
    let all = s.read_logs(b, 0, 100).await.unwrap();
    assert_eq!(all.iter().map(|l| l.seq).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5, 9]);
    assert_eq!(all.iter().map(|l| l.text.as_str()).collect::<Vec<_>>(), vec!["b1", "b2", "b3", "b4", "b5", "b9"]);
    // Once the job has ended (taken from an agent cut off, say), its log is the
    // coordinator's: the agent's late lines are not stored, and its own line stays its own.
    let lost = s
        .update_job(b, &[JobState::Queued], JobChange { state: Some(JobState::Lost), ..Default::default() })
        .await
        .unwrap();
    assert_eq!(lost.state, JobState::Lost);
    let note = s.append_logs(b, None, &[chunk("gpuci: lost")]).await.unwrap();
    assert_eq!(note.iter().map(|l| l.seq).collect::<Vec<_>>(), vec![10]);
    assert!(s.append_logs(b, Some(10), &lines(10, 12)).await.unwrap().is_empty(), "late agent lines are dropped");
    let all = s.read_logs(b, 0, 100).await.unwrap();
    assert_eq!(all.last().map(|l| (l.seq, l.text.as_str())), Some((10, "gpuci: lost")));
    // Each job's last line number, read for many jobs at once; jobs without a log are left out.
    let mut many: Vec<i64> = (1_000_000..1_002_500).collect();
    many.extend([a, b]);
    let last = s.last_log_lines(&many).await.unwrap();
    assert_eq!(last.len(), 2, "{last:?}");
    assert_eq!((last[&a], last[&b]), (151, 10));
    assert!(s.last_log_lines(&[]).await.unwrap().is_empty());

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

#[tokio::test]
async fn postgres_store_passes_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("suite").await).await.unwrap();
    suite(&s).await;
}

/// A committed write survives the server stopping as a crash would, and migrations run again
/// on reconnect without harm.
#[tokio::test]
async fn postgres_data_survives_crash_and_reconnect() {
    let Some(server) = pg::PgServer::start() else { return };
    let url = server.create_database("durable").await;
    let id = {
        let s = PostgresStore::connect(&url).await.unwrap();
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
        s.append_logs(jobs[0].id, None, &[LogChunk { ts_us: 1, stream: Stream::Stderr, text: "kept".into() }])
            .await
            .unwrap();
        jobs[0].id
    };
    server.crash_and_restart();
    let s = PostgresStore::connect(&url).await.unwrap();
    assert_eq!(s.get_job(id).await.unwrap().unwrap().step.key, "a");
    let logs = s.read_logs(id, 0, 10).await.unwrap();
    assert_eq!((logs[0].text.as_str(), logs[0].stream), ("kept", Stream::Stderr));
}

/// Concurrent writers, as several coordinators would be: log appends to one job get distinct,
/// consecutive sequence numbers, and of many assignments racing for one GPU exactly one wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_store_is_correct_under_concurrent_writers() {
    let Some(server) = pg::PgServer::start() else { return };
    let url = server.create_database("concurrent").await;
    // Two stores, two pools: two coordinators.
    let stores = [PostgresStore::connect(&url).await.unwrap(), PostgresStore::connect(&url).await.unwrap()];
    let (_, jobs) = stores[0]
        .create_pipeline(
            NewPipeline {
                origin: None,
                file_name: "x".into(),
                source: String::new(),
                workspace_upload: None,
                repository: None,
                created_at_ms: 1,
            },
            (0..8).map(|i| new_job(&format!("j{i}"))).collect(),
        )
        .await
        .unwrap();
    let log_job = jobs[0].id;
    let mut tasks = Vec::new();
    for t in 0..8 {
        let s = stores[t % 2].clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let lines: Vec<LogChunk> =
                    (0..3).map(|_| LogChunk { ts_us: 1, stream: Stream::Stdout, text: format!("t{t}") }).collect();
                s.append_logs(log_job, None, &lines).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let logs = stores[1].read_logs(log_job, 0, 1000).await.unwrap();
    assert_eq!(logs.iter().map(|l| l.seq).collect::<Vec<_>>(), (1..=120).collect::<Vec<_>>());

    let mut tasks = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        let (s, id) = (stores[i % 2].clone(), j.id);
        tasks.push(tokio::spawn(async move { s.assign_job(id, "agent-1", &["GPU-X".into()], 5).await }));
    }
    let mut won = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(r) => won.push(r.id),
            Err(StoreError::GpuLeased { gpu, .. }) => assert_eq!(gpu, "GPU-X"),
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert_eq!(won.len(), 1, "exactly one job gets the GPU");
    let leases = stores[0].leases().await.unwrap();
    assert_eq!((leases.len(), leases[0].job_id), (1, won[0]));

    // Overlapping GPU sets asked for in opposite orders: still one winner, and no deadlock
    // (which would surface as a database error).
    let mut tasks = Vec::new();
    for (i, j) in jobs.iter().filter(|j| j.id != won[0]).enumerate() {
        let (s, id) = (stores[i % 2].clone(), j.id);
        let gpus: Vec<String> =
            if i % 2 == 0 { vec!["GPU-A".into(), "GPU-B".into()] } else { vec!["GPU-B".into(), "GPU-A".into()] };
        tasks.push(tokio::spawn(async move { s.assign_job(id, "agent-1", &gpus, 6).await }));
    }
    let mut winners = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(r) => winners += r.gpus.len(),
            Err(StoreError::GpuLeased { .. }) => {}
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert_eq!((winners, stores[1].leases().await.unwrap().len()), (2, 3));
}
