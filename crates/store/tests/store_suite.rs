//! The store test suite. Every backend runs the same checks: SQLite (a file in a temp dir,
//! WAL, as in production, plus the in-memory variant) and Postgres (a real throwaway server,
//! see `common/pg.rs`; skipped with a message where Postgres is not installed, unless CI=true).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "common/pg.rs"]
mod pg;

use gpuci_core::job::JobState;
use gpuci_core::pipeline::Step;
use gpuci_protocol::agent::{LogChunk, Stream};
use gpuci_protocol::JobId;
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
        runner_exits: 0,
        last_runner_exit: None,
        check_failures: 0,
        retry_at_ms: None,
    };
    assert!(s.insert_github_job(&job).await.unwrap());
    let mut twice = job.clone();
    twice.name = "other".into();
    assert!(!s.insert_github_job(&twice).await.unwrap());
    assert_eq!(s.get_github_job(77).await.unwrap().unwrap(), job);
    // The backoff state survives a restart: it is in the record.
    job.runner_exits = 3;
    job.last_runner_exit = Some("exit 0, 'Must not run interactively with sudo'".into());
    job.check_failures = 2;
    job.retry_at_ms = Some(12_345);
    s.put_github_job(&job).await.unwrap();
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

#[tokio::test]
async fn postgres_store_passes_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("suite").await).await.unwrap();
    suite(&s).await;
}

#[tokio::test]
async fn postgres_store_passes_github_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("github").await).await.unwrap();
    github_suite(&s).await;
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

/// Secret values at rest: rows written in plain text before sealing existed are sealed once,
/// keeping their update times; sealed rows are left alone; what the store hands back (the
/// stored column) holds no value, and opens only with the key and under its own name.
async fn sealing_suite(s: &dyn Store) {
    s.set_secret("OLD_PLAIN", "plain-value-from-before", 7).await.unwrap();
    let (key, _) = SecretsKey::generate();
    s.set_secret("NEW_SEALED", &key.seal("NEW_SEALED", "sealed-value"), 8).await.unwrap();
    let before = SecretsAtRest::survey(s).await.unwrap();
    assert_eq!(before.plaintext, vec!["OLD_PLAIN".to_string()]);
    assert_eq!(before.sealed, BTreeMap::from([(key.id().to_string(), vec!["NEW_SEALED".to_string()])]));

    assert_eq!(seal_plaintext_secrets(s, &key).await.unwrap(), vec!["OLD_PLAIN".to_string()]);
    assert_eq!(seal_plaintext_secrets(s, &key).await.unwrap(), Vec::<String>::new(), "sealing twice is a no-op");
    let after = SecretsAtRest::survey(s).await.unwrap();
    assert!(after.plaintext.is_empty(), "{after:?}");
    assert_eq!(s.secret_names().await.unwrap(), vec![("NEW_SEALED".into(), 8), ("OLD_PLAIN".into(), 7)]);

    let stored = s.secret_values(&["OLD_PLAIN".into(), "NEW_SEALED".into()]).await.unwrap();
    for (name, value) in [("OLD_PLAIN", "plain-value-from-before"), ("NEW_SEALED", "sealed-value")] {
        assert!(!stored[name].contains(value), "{name} is stored readable: {}", stored[name]);
        assert_eq!(key.open(name, &stored[name]).unwrap(), value);
    }
    // A row's value copied into another row does not open there.
    s.set_secret("OLD_PLAIN", &stored["NEW_SEALED"], 9).await.unwrap();
    let swapped = s.secret_values(&["OLD_PLAIN".into()]).await.unwrap();
    assert!(matches!(key.open("OLD_PLAIN", &swapped["OLD_PLAIN"]), Err(SealError::Tampered { .. })));
}

#[tokio::test]
async fn sqlite_store_passes_sealing_suite() {
    sealing_suite(&SqliteStore::in_memory().await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_sealing_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("sealing").await).await.unwrap();
    sealing_suite(&s).await;
}

/// Regression (issue 9): a plain-text secret sealed in place must not survive in the SQLite
/// file's free pages or WAL, and the files are private to their owner from the start.
#[tokio::test]
async fn sqlite_file_keeps_no_plaintext_after_sealing_and_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    let s = SqliteStore::open(&path).await.unwrap();
    s.set_secret("HF_TOKEN", "hf-plaintext-marker-91f3", 1).await.unwrap();
    let (key, _) = SecretsKey::generate();
    seal_plaintext_secrets(&s, &key).await.unwrap();
    for suffix in ["", "-wal", "-shm"] {
        let f = dir.path().join(format!("gpuci.db{suffix}"));
        let Ok(bytes) = std::fs::read(&f) else { continue };
        assert!(
            !bytes.windows(b"hf-plaintext-marker-91f3".len()).any(|w| w == b"hf-plaintext-marker-91f3"),
            "{} still holds the plain-text value",
            f.display()
        );
        let mode = std::fs::metadata(&f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}: mode {mode:o}", f.display());
    }
}

/// One coordinator per Postgres database: a claim another holds is refused with who holds it;
/// the same holder (a restarted coordinator) takes it back at once, and the run it replaced
/// can no longer renew; a claim left unrenewed past its lease passes to another holder.
#[tokio::test]
async fn postgres_sole_use_claims_pass_only_when_lapsed_or_to_the_same_holder() {
    let Some(server) = pg::PgServer::start() else { return };
    let url = server.create_database("sole").await;
    let (a, b) = (PostgresStore::connect(&url).await.unwrap(), PostgresStore::connect(&url).await.unwrap());
    let lease = std::time::Duration::from_secs(15);
    a.claim_sole_use("host:/a", "run 1", lease).await.unwrap().expect("first claim");
    let held = b.claim_sole_use("host:/b", "run 1", lease).await.unwrap().expect_err("held by a");
    assert_eq!((held.holder.as_str(), held.process.as_str()), ("host:/a", "run 1"));
    assert!(held.renewed_secs_ago < 15.0, "{held:?}");
    assert!(a.renew_sole_use("host:/a", "run 1").await.unwrap());
    // /a restarted: its new run takes the claim; the old run's renewals fail.
    a.claim_sole_use("host:/a", "run 2", lease).await.unwrap().expect("same holder");
    assert!(!a.renew_sole_use("host:/a", "run 1").await.unwrap());
    // Lapsed: /b may take it, and /a's run 2 learns it lost it.
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
    sqlx::query("UPDATE coordinator_lease SET renewed_at = now() - interval '1 minute'")
        .execute(&mut conn)
        .await
        .unwrap();
    b.claim_sole_use("host:/b", "run 1", lease).await.unwrap().expect("lapsed claim passes");
    assert!(!a.renew_sole_use("host:/a", "run 2").await.unwrap());
}

/// Fencing (issue 29): a coordinator that lost its claim (paused, cut off, slow to notice)
/// can write nothing once another claimed the database: the database itself refuses, and says
/// why. Each claim raises the epoch; a takeover waits for a write already under way, which is
/// then ordered before it. Every table but the claim's own is fenced, so a table added later
/// without the trigger fails here.
#[tokio::test]
async fn postgres_a_former_leaders_writes_are_refused_by_the_database_after_a_takeover() {
    let Some(server) = pg::PgServer::start() else { return };
    let url = server.create_database("fenced").await;
    let lease = std::time::Duration::from_secs(15);
    let a = PostgresStore::connect(&url).await.unwrap();
    let b = PostgresStore::connect(&url).await.unwrap();
    let first = a.claim_sole_use("host:/a", "run 1", lease).await.unwrap().expect("first claim");
    let a = a.fence(first.epoch).await.unwrap();
    let agent = |id: &str| AgentRecord {
        id: id.into(),
        name: id.into(),
        credential_hash: "ab".into(),
        registered_at_ms: 1,
        last_seen_ms: None,
        state: "disconnected".into(),
        reason: String::new(),
        hello_json: None,
    };
    a.insert_agent(&agent("written-while-leading")).await.expect("the leader writes");
    let pipeline = NewPipeline {
        origin: None,
        file_name: "x.yml".into(),
        source: "steps: []".into(),
        workspace_upload: None,
        repository: None,
        created_at_ms: 1,
    };
    let (_, jobs) = a.create_pipeline(pipeline, vec![new_job("a")]).await.expect("the leader writes");
    // Lapsed and taken over by b.
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
    sqlx::query("UPDATE coordinator_lease SET renewed_at = now() - interval '1 minute'")
        .execute(&mut conn)
        .await
        .unwrap();
    let second = b.claim_sole_use("host:/b", "run 1", lease).await.unwrap().expect("lapsed claim passes");
    assert!(second.epoch > first.epoch, "{first:?} then {second:?}");
    let b = b.fence(second.epoch).await.unwrap();
    let refused = a.insert_agent(&agent("written-after-the-takeover")).await.expect_err("a former leader wrote");
    assert!(refused.is_fenced(), "{refused}");
    assert!(!refused.is_transient() && !refused.is_unavailable(), "{refused}");
    assert!(refused.to_string().contains("no longer leads"), "{refused}");
    let refused = a.update_job(jobs[0].id, &[JobState::Queued], JobChange::default()).await.expect_err("an update");
    assert!(refused.is_fenced(), "{refused}");
    // A placement pass's group commit is refused as a whole, and nothing of it is stored.
    let batch = [NewAssignment { job: jobs[0].id, agent_id: "agent-1".into(), gpus: vec!["GPU-F".into()] }];
    let refused = a.assign_jobs(&batch, 5).await.expect_err("a fenced placement pass");
    assert!(refused.is_fenced(), "{refused}");
    assert_eq!(b.get_job(jobs[0].id).await.unwrap().unwrap().state, JobState::Queued);
    assert!(b.leases().await.unwrap().is_empty());
    let starts = [JobUpdate { job: jobs[0].id, expect: vec![JobState::Queued], change: JobChange::default() }];
    assert!(a.update_jobs(&starts).await.expect_err("fenced events").is_fenced());
    assert!(a.set_reasons(&[(jobs[0].id, "x".into())]).await.expect_err("fenced reasons").is_fenced());
    b.insert_agent(&agent("the-new-leader")).await.expect("the new leader writes");
    let names: Vec<String> = b.list_agents().await.unwrap().into_iter().map(|a| a.id).collect();
    assert_eq!(names, ["the-new-leader", "written-while-leading"]);
    // A write under way when the takeover comes is ordered before it: the takeover waits.
    let third_holder = PostgresStore::connect(&url).await.unwrap();
    let mut tx = <sqlx::PgConnection as sqlx::Connection>::connect_with(
        &<sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url)
            .unwrap()
            .options([("gpuci.epoch", second.epoch.to_string())]),
    )
    .await
    .unwrap();
    sqlx::query("UPDATE coordinator_lease SET renewed_at = now() - interval '1 minute'")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut tx).await.unwrap();
    sqlx::query("DELETE FROM agents WHERE id = 'the-new-leader'").execute(&mut tx).await.unwrap();
    let takeover = tokio::spawn(async move { third_holder.claim_sole_use("host:/c", "run 1", lease).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!takeover.is_finished(), "the takeover did not wait for the write under way");
    sqlx::query("COMMIT").execute(&mut tx).await.unwrap();
    takeover.await.unwrap().unwrap().expect("taken over once the write committed");
    let names: Vec<String> = b.list_agents().await.unwrap().into_iter().map(|a| a.id).collect();
    assert_eq!(names, ["written-while-leading"], "the write under way was kept");
    // Every table but the claim's is fenced.
    let unfenced: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables t WHERE table_schema = current_schema() \
         AND table_type = 'BASE TABLE' AND table_name NOT IN ('coordinator_lease', '_sqlx_migrations') \
         AND NOT EXISTS (SELECT 1 FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid \
                         WHERE c.relname = t.table_name AND g.tgname = 'gpuci_fence') ORDER BY 1",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(unfenced.is_empty(), "tables without the fencing trigger: {unfenced:?}");
}

/// A leader frozen (SIGSTOP, a paused VM, cut off) in the middle of a write holds the claim's
/// row in share mode: a standby's takeover waited for as long as the freeze lasted (outsider
/// attack). The leader's sessions are ended by the server after `IDLE_IN_TRANSACTION` inside
/// a transaction, the standby's claim fails fast meanwhile (transient) and succeeds once the
/// row is free; its age is judged when it is taken. A standby never takes a live claim, even
/// of its own holder (a copied data dir).
#[tokio::test]
async fn postgres_a_leader_frozen_inside_a_write_cannot_hold_off_a_takeover() {
    let Some(server) = pg::PgServer::start() else { return };
    let url = server.create_database("frozen").await;
    let lease = std::time::Duration::from_secs(2);
    let leader = PostgresStore::connect(&url).await.unwrap();
    let standby = PostgresStore::connect(&url).await.unwrap();
    let first = leader.claim_sole_use("host:/a", "run 1", lease).await.unwrap().expect("first claim");
    let held = standby.claim_as_standby("host:/a", "run 2", lease).await.unwrap();
    assert!(held.is_err(), "a standby took a live claim of its own holder: {held:?}");
    // The leader's session as `fence` opens it, frozen inside a write.
    let options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url).unwrap().options([
        ("gpuci.epoch", first.epoch.to_string()),
        ("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION.as_millis().to_string()),
    ]);
    let mut frozen = <sqlx::PgConnection as sqlx::Connection>::connect_with(&options).await.unwrap();
    sqlx::query("BEGIN").execute(&mut frozen).await.unwrap();
    sqlx::query("DELETE FROM agents").execute(&mut frozen).await.unwrap();
    let t0 = std::time::Instant::now();
    let claim = loop {
        match standby.claim_as_standby("host:/b", "run 1", lease).await {
            Ok(Ok(claim)) => break claim,
            Ok(Err(_)) => {}
            Err(e) => assert!(e.is_transient() || e.is_unavailable(), "{e}"),
        }
        assert!(t0.elapsed() < IDLE_IN_TRANSACTION * 4, "no takeover while the leader is frozen in a write");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert!(claim.epoch > first.epoch);
    assert!(t0.elapsed() >= lease, "taken before the claim lapsed");
    let after = sqlx::query("COMMIT").execute(&mut frozen).await;
    assert!(after.is_err(), "the frozen leader's write committed after the takeover");
}

/// Machines of fleets and their billing stretches: upsert by id, active ones listed, one open
/// stretch at a time, closed never before it opened.
async fn machines_suite(s: &dyn Store) {
    let m = MachineRecord {
        id: "m-1".into(),
        fleet: "t4".into(),
        provider_id: None,
        instance_type: "g4dn.xlarge".into(),
        zone: "us-east-1a".into(),
        capacity: "spot".into(),
        price_per_hour: 0.526,
        gpus: 1,
        state: "requested".into(),
        reason: None,
        agent_id: None,
        requested_at_ms: 1_000,
        running_at_ms: None,
        connected_at_ms: None,
        first_job_at_ms: None,
        ended_at_ms: None,
        boot_failed: false,
        interrupted_at_ms: None,
    };
    s.put_machine(&m).await.unwrap();
    let booted = MachineRecord {
        interrupted_at_ms: Some(2_500),
        provider_id: Some("i-0abc".into()),
        state: "ready".into(),
        running_at_ms: Some(2_000),
        connected_at_ms: Some(3_000),
        ..m.clone()
    };
    s.put_machine(&booted).await.unwrap();
    s.put_machine(&MachineRecord { id: "m-2".into(), requested_at_ms: 1_500, ..m.clone() }).await.unwrap();
    assert_eq!(
        s.machines(true).await.unwrap(),
        vec![booted.clone(), MachineRecord { id: "m-2".into(), requested_at_ms: 1_500, ..m.clone() }]
    );

    s.open_billing("m-1", 2_000).await.unwrap();
    s.open_billing("m-1", 2_500).await.unwrap(); // already open: no second stretch
    s.close_billing("m-1", 10_000).await.unwrap();
    s.open_billing("m-1", 20_000).await.unwrap(); // started again
    s.open_billing("m-2", 5_000).await.unwrap();
    s.close_billing("m-2", 4_000).await.unwrap(); // a clock that stepped back: an empty stretch
    let all = s.billing_since(0).await.unwrap();
    assert_eq!(
        all,
        vec![
            BillingInterval { machine_id: "m-1".into(), from_ms: 2_000, to_ms: Some(10_000) },
            BillingInterval { machine_id: "m-2".into(), from_ms: 5_000, to_ms: Some(5_000) },
            BillingInterval { machine_id: "m-1".into(), from_ms: 20_000, to_ms: None },
        ]
    );
    let recent = s.billing_since(15_000).await.unwrap();
    assert_eq!(recent, vec![BillingInterval { machine_id: "m-1".into(), from_ms: 20_000, to_ms: None }]);

    s.put_machine(&MachineRecord { state: "ended".into(), ended_at_ms: Some(30_000), ..booted.clone() }).await.unwrap();
    let active: Vec<String> = s.machines(true).await.unwrap().into_iter().map(|m| m.id).collect();
    assert_eq!(active, ["m-2"]);
    assert_eq!(s.machines(false).await.unwrap().len(), 2);
}

#[tokio::test]
async fn sqlite_store_passes_machines_suite() {
    let dir = tempfile::tempdir().unwrap();
    machines_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_machines_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("machines").await).await.unwrap();
    machines_suite(&s).await;
}

fn audit(at_ms: i64, actor: &str, action: &str, object: &str) -> NewAudit {
    NewAudit {
        at_ms,
        actor_kind: "api-token".into(),
        actor: actor.into(),
        credential: Some("sha256:0123456789ab".into()),
        action: action.into(),
        object: object.into(),
        outcome: "ok".into(),
    }
}

/// The audit log (issue 27): secret changes, token changes and approvals are written with
/// their entry in one transaction; entries list newest first and filter by time, action (and
/// the actions under it) and actor.
async fn audit_suite(s: &dyn Store) {
    assert!(s.audit_log(&AuditFilter::default()).await.unwrap().is_empty());

    s.set_secret_audited("HF_TOKEN", "sealed-1", 10, &audit(10, "ci-bot", "secret.set", "HF_TOKEN (every pipeline)"))
        .await
        .unwrap();
    assert_eq!(s.secret_names().await.unwrap(), vec![("HF_TOKEN".to_string(), 10)]);
    // A delete of nothing deletes nothing and records nothing here (the caller records the
    // refusal if it wants one).
    assert!(!s.delete_secret_audited("NOPE", &audit(11, "ci-bot", "secret.rm", "NOPE")).await.unwrap());
    assert!(s.delete_secret_audited("HF_TOKEN", &audit(12, "admin", "secret.rm", "HF_TOKEN")).await.unwrap());
    assert!(s.secret_names().await.unwrap().is_empty());

    let own = s.append_audit(&audit(13, "admin", "secrets-key.rotate", "key k1")).await.unwrap();
    assert_eq!(own.entry.action, "secrets-key.rotate");

    // Tokens: by hash while live; a name is never used twice, revoked or not.
    let tok = ApiTokenRecord {
        name: "ci-bot".into(),
        hash: "ab".repeat(32),
        created_at_ms: 14,
        created_by: "admin".into(),
        revoked_at_ms: None,
    };
    assert!(s.create_api_token(&tok, &audit(14, "admin", "token.create", "token ci-bot")).await.unwrap());
    assert!(!s.create_api_token(&tok, &audit(14, "admin", "token.create", "token ci-bot")).await.unwrap());
    assert_eq!(s.live_api_token(&tok.hash).await.unwrap(), Some(tok.clone()));
    assert!(s.revoke_api_token("ci-bot", 15, &audit(15, "admin", "token.revoke", "token ci-bot")).await.unwrap());
    assert!(!s.revoke_api_token("ci-bot", 16, &audit(16, "admin", "token.revoke", "token ci-bot")).await.unwrap());
    assert_eq!(s.live_api_token(&tok.hash).await.unwrap(), None, "a revoked token opens nothing");
    let again = ApiTokenRecord { hash: "cd".repeat(32), ..tok.clone() };
    assert!(!s.create_api_token(&again, &audit(17, "admin", "token.create", "token ci-bot")).await.unwrap());
    assert_eq!(s.api_tokens().await.unwrap(), vec![ApiTokenRecord { revoked_at_ms: Some(15), ..tok }]);

    // An approval is on the record with the GitHub login that gave it.
    s.put_approval(&ApprovalRecord {
        repository: "octo/gpu".into(),
        pr: 7,
        head_sha: "abc".into(),
        approved_by: "maintainer-1".into(),
        approved_at_ms: 18,
    })
    .await
    .unwrap();

    let all = s.audit_log(&AuditFilter::default()).await.unwrap();
    let seen: Vec<(&str, &str)> = all.iter().map(|r| (r.entry.action.as_str(), r.entry.actor.as_str())).collect();
    assert_eq!(
        seen,
        [
            ("approval.grant", "maintainer-1"),
            ("token.revoke", "admin"),
            ("token.create", "admin"),
            ("secrets-key.rotate", "admin"),
            ("secret.rm", "admin"),
            ("secret.set", "ci-bot"),
        ],
        "newest first, only what happened"
    );
    assert!(all.windows(2).all(|w| w[0].id > w[1].id));
    assert_eq!(all[5].entry, audit(10, "ci-bot", "secret.set", "HF_TOKEN (every pipeline)"));
    assert_eq!(all[0].entry.actor_kind, "github");
    assert!(all[0].entry.object.contains("octo/gpu#7") && all[0].entry.object.contains("abc"), "{:?}", all[0]);

    let actions = |f: AuditFilter| async move {
        s.audit_log(&f).await.unwrap().into_iter().map(|r| r.entry.action).collect::<Vec<_>>()
    };
    assert_eq!(
        actions(AuditFilter { action: Some("secret".into()), ..Default::default() }).await,
        ["secret.rm", "secret.set"]
    );
    assert_eq!(actions(AuditFilter { action: Some("secret.rm".into()), ..Default::default() }).await, ["secret.rm"]);
    // `secret` is a whole segment: `secrets-key.rotate` is not under it, nor `%` a wildcard.
    assert_eq!(actions(AuditFilter { action: Some("secre".into()), ..Default::default() }).await, Vec::<String>::new());
    assert_eq!(actions(AuditFilter { action: Some("%".into()), ..Default::default() }).await, Vec::<String>::new());
    assert_eq!(actions(AuditFilter { actor: Some("ci-bot".into()), ..Default::default() }).await, ["secret.set"]);
    assert_eq!(
        actions(AuditFilter { since_ms: Some(15), ..Default::default() }).await,
        ["approval.grant", "token.revoke"]
    );
    assert_eq!(actions(AuditFilter { limit: Some(1), ..Default::default() }).await, ["approval.grant"]);
}

#[tokio::test]
async fn sqlite_store_passes_audit_suite() {
    let dir = tempfile::tempdir().unwrap();
    audit_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_audit_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("audit").await).await.unwrap();
    audit_suite(&s).await;
}

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

/// Schedules: a fire is recorded once per occurrence (the exactly-once guard across
/// restarts), armed once, and fires cut short by a stop are marked.
async fn schedules_suite(s: &dyn Store) {
    assert_eq!(s.schedules_last_checked().await.unwrap(), None);
    assert_eq!(s.arm_schedule("nightly", 1_000).await.unwrap(), 1_000);
    assert_eq!(s.arm_schedule("nightly", 9_000).await.unwrap(), 1_000, "armed once");
    s.schedule_checked("nightly", 5_000).await.unwrap();
    assert_eq!(s.arm_schedule("nightly", 9_000).await.unwrap(), 5_000, "last looked at");
    s.schedule_checked("new", 6_000).await.unwrap();
    assert_eq!(s.arm_schedule("new", 9_000).await.unwrap(), 6_000);
    assert_eq!(s.schedules_last_checked().await.unwrap(), Some(6_000));
    let fire = |cause: &str, at: i64| ScheduleFireRecord {
        id: 0,
        schedule: "nightly".into(),
        cause: cause.into(),
        scheduled_at_ms: at,
        fired_at_ms: at + 5,
        skipped_from_ms: None,
        pipeline_id: None,
        error: None,
    };
    assert_eq!(s.last_cron_fire("nightly").await.unwrap(), None);
    let a = s.record_schedule_fire(&fire("cron", 60_000)).await.unwrap().expect("first");
    assert_eq!(s.record_schedule_fire(&fire("cron", 60_000)).await.unwrap(), None, "an occurrence fires once");
    let b = s.record_schedule_fire(&fire("manual", 60_000)).await.unwrap().expect("a manual run is its own");
    let c = s.record_schedule_fire(&fire("cron", 120_000)).await.unwrap().expect("the next occurrence");
    assert_eq!(s.last_cron_fire("nightly").await.unwrap(), Some(120_000));
    s.finish_schedule_fire(a, Some(7), None).await.unwrap();
    s.finish_schedule_fire(b, None, Some("git: no such repository")).await.unwrap();
    assert_eq!(s.interrupt_schedule_fires("stopped").await.unwrap(), 1);
    let all = s.schedule_fires(Some("nightly"), 10).await.unwrap();
    assert_eq!(all.iter().map(|f| f.id).collect::<Vec<_>>(), [c, b, a], "newest first");
    assert_eq!((all[2].pipeline_id, all[2].error.as_deref()), (Some(7), None));
    assert_eq!(all[1].error.as_deref(), Some("git: no such repository"));
    assert_eq!(all[0].error.as_deref(), Some("stopped"));
    assert_eq!(all[0].fired_at_ms, 120_005);
    assert!(s.schedule_fires(Some("other"), 10).await.unwrap().is_empty());
    assert_eq!(s.schedule_fires(None, 2).await.unwrap().len(), 2);
}

#[tokio::test]
async fn sqlite_store_passes_schedules_suite() {
    let dir = tempfile::tempdir().unwrap();
    schedules_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_schedules_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("schedules").await).await.unwrap();
    schedules_suite(&s).await;
}

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

/// What fencing costs a write (run by hand: `cargo test -p gpuci-store --test store_suite
/// --release -- --ignored --nocapture bench_fencing`): jobs created and moved through their
/// states and log lines appended, by 8 writers at once, unfenced and fenced. BENCHMARKS.md,
/// "Failover", quotes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a benchmark, run by hand"]
async fn bench_fencing_overhead() {
    let Some(server) = pg::PgServer::start() else { return };
    for fenced in [false, true, false, true] {
        let url = server.create_database(&format!("bench{}", rand_suffix())).await;
        let mut s = PostgresStore::connect(&url).await.unwrap();
        if fenced {
            let claim = s.claim_sole_use("host:/a", "run 1", std::time::Duration::from_secs(60)).await.unwrap();
            s = s.fence(claim.unwrap().epoch).await.unwrap();
        }
        let s = std::sync::Arc::new(s);
        let t0 = std::time::Instant::now();
        let writers: Vec<_> = (0..8)
            .map(|w| {
                let s = s.clone();
                tokio::spawn(async move {
                    let mut writes = 0u32;
                    for i in 0..50 {
                        let pipeline = NewPipeline {
                            origin: None,
                            file_name: "x.yml".into(),
                            source: "steps: []".into(),
                            workspace_upload: None,
                            repository: None,
                            created_at_ms: 1,
                        };
                        let (_, jobs) = s.create_pipeline(pipeline, vec![new_job(&format!("w{w}i{i}"))]).await.unwrap();
                        let id = jobs[0].id;
                        s.assign_job(id, "agent", &[], 2).await.unwrap();
                        let line = LogChunk { ts_us: 1, stream: Stream::Stdout, text: "x".into() };
                        s.append_logs(id, None, &[line]).await.unwrap();
                        s.update_job(
                            id,
                            &[JobState::Assigned],
                            JobChange { state: Some(JobState::Running), ..Default::default() },
                        )
                        .await
                        .unwrap();
                        writes += 4;
                    }
                    writes
                })
            })
            .collect();
        let mut writes = 0;
        for w in writers {
            writes += w.await.unwrap();
        }
        let secs = t0.elapsed().as_secs_f64();
        eprintln!(
            "BENCH fencing={fenced}: {writes} writes by 8 writers in {secs:.2} s = {:.0} writes/s",
            f64::from(writes) / secs
        );
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos() as u64)
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

/// Dynamic steps: a job's token is stored as a hash, one row per job; each upload is counted
/// in the commit that adds its jobs, and past the cap nothing is added; a new token resets the
/// count; rows of ended jobs go when the next token is stored.
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

    // Job a ends; storing b's token clears a's row.
    s.update_job(a, &[JobState::Queued], JobChange { state: Some(JobState::Cancelled), ..Default::default() })
        .await
        .unwrap();
    s.put_job_tokens(&[(b, "cc33".into())], 7).await.unwrap();
    assert_eq!(s.job_token(a).await.unwrap(), None);
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

/// Group commit (issue 29): a placement pass's assignments, a batch of agents' events and a
/// pass's reasons are each one transaction. An item whose own state refuses it is answered
/// with its error and stores nothing; the others stand. A batch the database refuses stores
/// nothing at all.
async fn group_commit_suite(s: &dyn Store, fail_assignments: impl std::future::Future<Output = ()>) {
    let pipeline = NewPipeline {
        origin: None,
        file_name: "g.yml".into(),
        source: "steps: []".into(),
        workspace_upload: None,
        repository: None,
        created_at_ms: 1,
    };
    let keys = ["a", "b", "c", "d", "e"];
    let (_, jobs) = s.create_pipeline(pipeline, keys.iter().map(|k| new_job(k)).collect()).await.unwrap();
    let id: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    let assign = |job: JobId, gpus: &[&str]| NewAssignment {
        job,
        agent_id: "agent-1".into(),
        gpus: gpus.iter().map(|g| g.to_string()).collect(),
    };
    s.assign_job(id[4], "agent-2", &["GPU-4".into()], 1).await.unwrap();
    let batch = [
        assign(id[0], &["GPU-0", "GPU-1"]),
        // Wants a GPU an earlier item of the same batch took, then one leased before.
        assign(id[1], &["GPU-2", "GPU-1"]),
        assign(id[2], &["GPU-3", "GPU-4"]),
        // No longer queued.
        assign(id[4], &["GPU-5"]),
        assign(id[3], &[]),
        assign(999_999, &["GPU-6"]),
    ];
    let out = s.assign_jobs(&batch, 7).await.unwrap();
    assert_eq!(out.len(), batch.len());
    let a = out[0].as_ref().unwrap();
    assert_eq!(
        (a.state, a.gpus.clone(), a.agent_id.as_deref()),
        (JobState::Assigned, vec!["GPU-0".into(), "GPU-1".into()], Some("agent-1"))
    );
    assert!(
        matches!(&out[1], Err(StoreError::GpuLeased { gpu, holder }) if gpu == "GPU-1" && *holder == id[0]),
        "{:?}",
        out[1]
    );
    assert!(
        matches!(&out[2], Err(StoreError::GpuLeased { gpu, holder }) if gpu == "GPU-4" && *holder == id[4]),
        "{:?}",
        out[2]
    );
    assert!(matches!(&out[3], Err(StoreError::Conflict { found: JobState::Assigned, .. })), "{:?}", out[3]);
    assert_eq!(out[4].as_ref().unwrap().state, JobState::Assigned);
    assert!(matches!(&out[5], Err(StoreError::JobNotFound(999_999))), "{:?}", out[5]);
    // The refused ones left nothing behind: no lease of GPU-2 or GPU-3, still queued.
    let mut leased: Vec<(String, JobId)> =
        s.leases().await.unwrap().into_iter().map(|l| (l.gpu_uuid, l.job_id)).collect();
    leased.sort();
    assert_eq!(leased, [("GPU-0".into(), id[0]), ("GPU-1".into(), id[0]), ("GPU-4".into(), id[4])]);
    for j in [id[1], id[2]] {
        let j = s.get_job(j).await.unwrap().unwrap();
        assert_eq!((j.state, j.agent_id, j.gpus.len()), (JobState::Queued, None, 0));
    }

    // Starts: compare-and-set per item, one transaction.
    let start = |job: JobId| JobUpdate {
        job,
        expect: vec![JobState::Assigned],
        change: JobChange { state: Some(JobState::Running), started_at_ms: Some(9), ..Default::default() },
    };
    // The same job twice in one batch: the second finds it assigned.
    let out = s.assign_jobs(&[assign(id[1], &["GPU-8"]), assign(id[1], &["GPU-9"])], 8).await.unwrap();
    assert_eq!(out[0].as_ref().unwrap().gpus, vec!["GPU-8".to_string()]);
    assert!(matches!(&out[1], Err(StoreError::Conflict { found: JobState::Assigned, .. })), "{:?}", out[1]);
    s.update_job(
        id[1],
        &[JobState::Assigned],
        JobChange { state: Some(JobState::Queued), clear_assignment: true, ..Default::default() },
    )
    .await
    .unwrap();
    let out = s.update_jobs(&[start(id[0]), start(id[1]), start(id[3])]).await.unwrap();
    assert_eq!(out[0].as_ref().unwrap().state, JobState::Running);
    assert!(matches!(&out[1], Err(StoreError::Conflict { found: JobState::Queued, .. })), "{:?}", out[1]);
    assert_eq!(out[2].as_ref().unwrap().started_at_ms, Some(9));
    assert_eq!(s.get_job(id[1]).await.unwrap().unwrap().state, JobState::Queued);

    // Reasons of a pass.
    s.set_reasons(&[(id[1], "waiting for GPUs".into()), (id[2], "waiting for agent-3".into())]).await.unwrap();
    assert_eq!(s.get_job(id[1]).await.unwrap().unwrap().reason, "waiting for GPUs");
    assert_eq!(s.get_job(id[2]).await.unwrap().unwrap().reason, "waiting for agent-3");
    s.set_reasons(&[]).await.unwrap();

    // A batch the database refuses (here a trigger refuses any assignment) stores nothing.
    fail_assignments.await;
    let err = s.assign_jobs(&[assign(id[1], &["GPU-7"]), assign(id[2], &["GPU-8"])], 11).await.unwrap_err();
    assert!(!matches!(err, StoreError::Conflict { .. } | StoreError::GpuLeased { .. }), "{err}");
    for j in [id[1], id[2]] {
        assert_eq!(s.get_job(j).await.unwrap().unwrap().state, JobState::Queued);
    }
    assert_eq!(s.leases().await.unwrap().len(), 3, "the refused batch leased GPUs");
}

const REFUSE_ASSIGNMENTS_SQLITE: &str = "CREATE TRIGGER refuse_assignments BEFORE UPDATE OF state ON jobs \
     WHEN NEW.state = 'assigned' BEGIN SELECT RAISE(ABORT, 'injected: assignments refused'); END";

#[tokio::test]
async fn sqlite_store_passes_group_commit_suite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    let s = SqliteStore::open(&path).await.unwrap();
    let fail = async {
        let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&path);
        let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts).await.unwrap();
        sqlx::query(REFUSE_ASSIGNMENTS_SQLITE).execute(&mut conn).await.unwrap();
    };
    group_commit_suite(&s, fail).await;
}

#[tokio::test]
async fn postgres_store_passes_group_commit_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let url = server.create_database("group_commit").await;
    let s = PostgresStore::connect(&url).await.unwrap();
    let fail = async {
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
        sqlx::query(
            "CREATE FUNCTION refuse_assignments() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'injected: assignments refused'; END $$",
        )
        .execute(&mut conn)
        .await
        .unwrap();
        sqlx::query(
            "CREATE TRIGGER refuse_assignments BEFORE UPDATE OF state ON jobs FOR EACH ROW \
             WHEN (NEW.state = 'assigned') EXECUTE FUNCTION refuse_assignments()",
        )
        .execute(&mut conn)
        .await
        .unwrap();
    };
    group_commit_suite(&s, fail).await;
}

/// What group commit saves (run by hand: `cargo test -p gpuci-store --test store_suite --
/// --ignored --nocapture bench_group_commit`): 4,000 queued jobs assigned one transaction
/// each (as the scheduler did) and in transactions of 1,000 (a placement pass), then started
/// the same two ways, on a SQLite file (WAL, `synchronous=FULL`) and on Postgres. BENCHMARKS.md,
/// "The coordinator under load", quotes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark, run by hand"]
async fn bench_group_commit() {
    const JOBS: usize = 4_000;
    const BATCH: usize = 1_000;
    async fn run(name: &str, s: &dyn Store) {
        for batched in [false, true] {
            let pipeline = NewPipeline {
                origin: None,
                file_name: "x.yml".into(),
                source: "steps: []".into(),
                workspace_upload: None,
                repository: None,
                created_at_ms: 1,
            };
            let (_, jobs) =
                s.create_pipeline(pipeline, (0..JOBS).map(|i| new_job(&format!("s{i}"))).collect()).await.unwrap();
            let tag = if batched { "b" } else { "o" };
            let assignments: Vec<NewAssignment> = jobs
                .iter()
                .enumerate()
                .map(|(i, j)| NewAssignment {
                    job: j.id,
                    agent_id: "agent".into(),
                    gpus: vec![format!("GPU-{tag}{i}")],
                })
                .collect();
            let t0 = std::time::Instant::now();
            if batched {
                for chunk in assignments.chunks(BATCH) {
                    assert!(s.assign_jobs(chunk, 2).await.unwrap().iter().all(|r| r.is_ok()));
                }
            } else {
                for a in &assignments {
                    s.assign_job(a.job, &a.agent_id, &a.gpus, 2).await.unwrap();
                }
            }
            let assign_s = t0.elapsed().as_secs_f64();
            let starts: Vec<JobUpdate> = jobs
                .iter()
                .map(|j| JobUpdate {
                    job: j.id,
                    expect: vec![JobState::Assigned],
                    change: JobChange { state: Some(JobState::Running), started_at_ms: Some(3), ..Default::default() },
                })
                .collect();
            let t0 = std::time::Instant::now();
            if batched {
                for chunk in starts.chunks(BATCH) {
                    assert!(s.update_jobs(chunk).await.unwrap().iter().all(|r| r.is_ok()));
                }
            } else {
                for u in &starts {
                    s.update_job(u.job, &u.expect, u.change.clone()).await.unwrap();
                }
            }
            let start_s = t0.elapsed().as_secs_f64();
            let how = if batched { format!("batches of {BATCH}") } else { "one by one".to_string() };
            eprintln!(
                "BENCH {name}, {how}: {:.0} assignments/s, {:.0} starts/s",
                JOBS as f64 / assign_s,
                JOBS as f64 / start_s
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    run("SQLite file", &SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
    if let Some(server) = pg::PgServer::start() {
        let s = PostgresStore::connect(&server.create_database("bench_group_commit").await).await.unwrap();
        run("Postgres", &s).await;
    }
}
