//! Group commit: a placement pass's assignments (with their job tokens), a batch of agents'
//! events and a pass's reasons each in one transaction, and what that saves (a benchmark run
//! by hand).

use crate::{new_job, pg};
use gpuci_core::job::JobState;
use gpuci_protocol::JobId;
use gpuci_store::*;

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
        agent_name: "host-1".into(),
        gpus: gpus.iter().map(|g| g.to_string()).collect(),
        token_sha256: None,
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
    let before = [s.get_job(id[0]).await.unwrap().unwrap(), s.get_job(id[3]).await.unwrap().unwrap()];
    let out = s.assign_jobs(&batch, 7).await.unwrap();
    assert_eq!(out.len(), batch.len());
    out[0].as_ref().unwrap();
    // What is stored is what the scheduler builds from its own copy (no record is read back).
    let a = s.get_job(id[0]).await.unwrap().unwrap();
    assert_eq!(
        (a.state, a.gpus.clone(), a.agent_id.as_deref(), a.assigned_at_ms, a.reason.as_str()),
        (
            JobState::Assigned,
            vec!["GPU-0".into(), "GPU-1".into()],
            Some("agent-1"),
            Some(7),
            "assigned to agent host-1"
        )
    );
    assert_eq!(a, batch[0].applied_to(&before[0], 7));
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
    out[4].as_ref().unwrap();
    assert_eq!(s.get_job(id[3]).await.unwrap().unwrap(), batch[4].applied_to(&before[1], 7));
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
    let again = [assign(id[1], &["GPU-8"]), assign(id[1], &["GPU-9"])];
    let queued = s.get_job(id[1]).await.unwrap().unwrap();
    let out = s.assign_jobs(&again, 8).await.unwrap();
    out[0].as_ref().unwrap();
    assert_eq!(s.get_job(id[1]).await.unwrap().unwrap(), again[0].applied_to(&queued, 8));
    assert!(matches!(&out[1], Err(StoreError::Conflict { found: JobState::Assigned, .. })), "{:?}", out[1]);
    s.update_job(
        id[1],
        &[JobState::Assigned],
        JobChange { state: Some(JobState::Queued), clear_assignment: true, ..Default::default() },
    )
    .await
    .unwrap();
    let out = s.update_jobs(&[start(id[0]), start(id[1]), start(id[3])]).await.unwrap();
    out[0].as_ref().unwrap();
    assert_eq!(s.get_job(id[0]).await.unwrap().unwrap().state, JobState::Running);
    assert!(matches!(&out[1], Err(StoreError::Conflict { found: JobState::Queued, .. })), "{:?}", out[1]);
    out[2].as_ref().unwrap();
    assert_eq!(s.get_job(id[3]).await.unwrap().unwrap().started_at_ms, Some(9));
    assert_eq!(s.get_job(id[1]).await.unwrap().unwrap().state, JobState::Queued);

    // Reasons of a pass.
    s.set_reasons(&[(id[1], "waiting for GPUs".into()), (id[2], "waiting for agent-3".into())]).await.unwrap();
    assert_eq!(s.get_job(id[1]).await.unwrap().unwrap().reason, "waiting for GPUs");
    assert_eq!(s.get_job(id[2]).await.unwrap().unwrap().reason, "waiting for agent-3");
    s.set_reasons(&[]).await.unwrap();
    // Not over a job no longer queued: its reason says what became of it.
    let running = s.get_job(id[0]).await.unwrap().unwrap().reason;
    s.set_reasons(&[(id[0], "waiting for GPUs".into())]).await.unwrap();
    assert_eq!(s.get_job(id[0]).await.unwrap().unwrap().reason, running);

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
    group_commit_suite(&s, refuse_assignments_pg(&url)).await;
}

/// Installs a trigger that refuses any assignment (a batch the database refuses).
async fn refuse_assignments_pg(url: &str) {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url).await.unwrap();
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
                    agent_name: "agent".into(),
                    gpus: vec![format!("GPU-{tag}{i}")],
                    token_sha256: None,
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

/// Job tokens ride with their assignments (issue 29): a placement pass stores each placed
/// job's token hash in its one transaction, so a refused assignment (no longer queued, a GPU
/// leased, a batch the database refuses) stores no token and leaves an earlier one of the job
/// as it was. (Before, the pass stored its tokens in a commit of their own first, and a
/// refused assignment's token stayed.) Ended jobs' rows go with the next pass that has tokens.
async fn tokens_with_assignments_suite(s: &dyn Store, fail_assignments: impl std::future::Future<Output = ()>) {
    let pipeline = NewPipeline {
        origin: None,
        file_name: "t.yml".into(),
        source: "steps: []".into(),
        workspace_upload: None,
        repository: None,
        created_at_ms: 1,
    };
    let keys = ["a", "b", "c", "d", "e"];
    let (_, jobs) = s.create_pipeline(pipeline, keys.iter().map(|k| new_job(k)).collect()).await.unwrap();
    let id: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    let assign = |job: JobId, gpu: &str, token: Option<&str>| NewAssignment {
        job,
        agent_id: "agent-1".into(),
        agent_name: "agent-1".into(),
        gpus: vec![gpu.to_string()],
        token_sha256: token.map(str::to_string),
    };
    let token = |job: JobId| async move { s.job_token(job).await.unwrap().map(|t| (t.token_sha256, t.created_at_ms)) };

    let out = s
        .assign_jobs(
            &[assign(id[0], "GPU-0", Some("t-a1")), assign(id[1], "GPU-1", Some("t-b1")), assign(id[2], "GPU-2", None)],
            5,
        )
        .await
        .unwrap();
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    assert_eq!(token(id[0]).await, Some(("t-a1".to_string(), 5)));
    assert_eq!(token(id[1]).await, Some(("t-b1".to_string(), 5)));
    assert_eq!(token(id[2]).await, None, "an assignment without a token stores none");

    // Refused items: job a again (no longer queued), job d on a GPU job b holds, a job that
    // does not exist. None stores a token, and job a's token is the one its run holds.
    let out = s
        .assign_jobs(
            &[
                assign(id[0], "GPU-9", Some("t-a2")),
                assign(id[3], "GPU-1", Some("t-d1")),
                assign(999_999, "GPU-8", Some("t-x")),
                assign(id[4], "GPU-4", Some("t-e1")),
            ],
            6,
        )
        .await
        .unwrap();
    assert!(matches!(&out[0], Err(StoreError::Conflict { .. })), "{:?}", out[0]);
    assert!(matches!(&out[1], Err(StoreError::GpuLeased { .. })), "{:?}", out[1]);
    assert!(matches!(&out[2], Err(StoreError::JobNotFound(_))), "{:?}", out[2]);
    assert!(out[3].is_ok(), "{:?}", out[3]);
    assert_eq!(
        token(id[0]).await,
        Some(("t-a1".to_string(), 5)),
        "a refused assignment replaced a running job's token"
    );
    assert_eq!(token(id[3]).await, None, "a refused assignment stored a token");
    assert_eq!(token(999_999).await, None);
    assert_eq!(token(id[4]).await, Some(("t-e1".to_string(), 6)));

    // Job a ends; the next pass with tokens sweeps its row. Job b, still running, keeps its.
    s.update_job(
        id[0],
        &[JobState::Assigned],
        JobChange { state: Some(JobState::Cancelled), release_leases: true, ..Default::default() },
    )
    .await
    .unwrap();
    let out = s.assign_jobs(&[assign(id[3], "GPU-3", Some("t-d2"))], 7).await.unwrap();
    assert!(out[0].is_ok(), "{:?}", out[0]);
    assert_eq!(token(id[0]).await, None, "an ended job's token row outlived the next pass");
    assert_eq!(token(id[1]).await, Some(("t-b1".to_string(), 5)));
    assert_eq!(token(id[3]).await, Some(("t-d2".to_string(), 7)));

    // A batch the database refuses stores no token.
    s.update_job(
        id[3],
        &[JobState::Assigned],
        JobChange { state: Some(JobState::Queued), clear_assignment: true, ..Default::default() },
    )
    .await
    .unwrap();
    s.delete_job_token(id[3]).await.unwrap();
    fail_assignments.await;
    let err = s.assign_jobs(&[assign(id[3], "GPU-3", Some("t-d3")), assign(id[2], "GPU-5", Some("t-c1"))], 8).await;
    assert!(err.is_err(), "{err:?}");
    assert_eq!(token(id[3]).await, None, "a refused batch stored a token");
    assert_eq!(token(id[1]).await, Some(("t-b1".to_string(), 5)));
}

#[tokio::test]
async fn sqlite_store_stores_job_tokens_with_their_assignments() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    let s = SqliteStore::open(&path).await.unwrap();
    let fail = async {
        let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&path);
        let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts).await.unwrap();
        sqlx::query(REFUSE_ASSIGNMENTS_SQLITE).execute(&mut conn).await.unwrap();
    };
    tokens_with_assignments_suite(&s, fail).await;
}

#[tokio::test]
async fn postgres_store_stores_job_tokens_with_their_assignments() {
    let Some(server) = pg::PgServer::start() else { return };
    let url = server.create_database("tokens_with_assignments").await;
    let s = PostgresStore::connect(&url).await.unwrap();
    tokens_with_assignments_suite(&s, refuse_assignments_pg(&url)).await;
}

/// A batch of agents' events (`update_jobs`) writes exactly what the same changes written one
/// at a time (`update_job`) write, whatever the backend does to write them together (SQLite's
/// is set-based): every field of a change, `None` fields left as they were, leases released,
/// assignments cleared, GPUs quarantined, job tokens of ended jobs deleted, refused items
/// leaving nothing, and a job changed twice in one batch.
async fn batch_writes_what_one_at_a_time_writes(batched: &dyn Store, single: &dyn Store) {
    use gpuci_protocol::agent::{JobTelemetry, Protection, Unenforced};
    let mut ids = Vec::new();
    for s in [batched, single] {
        let pipeline = NewPipeline {
            origin: None,
            file_name: "e.yml".into(),
            source: "steps: []".into(),
            workspace_upload: None,
            repository: None,
            created_at_ms: 1,
        };
        let keys = ["start", "end", "requeue", "twice", "refused", "reason", "lost"];
        let (_, jobs) = s.create_pipeline(pipeline, keys.iter().map(|k| new_job(k)).collect()).await.unwrap();
        let id: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
        let batch: Vec<NewAssignment> = id
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 5)
            .map(|(i, j)| NewAssignment {
                job: *j,
                agent_id: "agent-1".into(),
                agent_name: "agent-1".into(),
                gpus: vec![format!("GPU-{i}")],
                token_sha256: Some(format!("{i:064}")),
            })
            .collect();
        assert!(s.assign_jobs(&batch, 5).await.unwrap().iter().all(|r| r.is_ok()));
        let running = |job| JobUpdate {
            job,
            expect: vec![JobState::Assigned],
            change: JobChange { state: Some(JobState::Running), started_at_ms: Some(6), ..Default::default() },
        };
        assert!(s.update_jobs(&[running(id[1]), running(id[6])]).await.unwrap().iter().all(|r| r.is_ok()));
        ids.push(id);
    }
    assert_eq!(ids[0], ids[1], "both stores numbered the jobs alike");
    let id = &ids[0];
    let telemetry = JobTelemetry {
        peak_memory_bytes: 7 << 30,
        mean_utilization_pct: 81.5,
        gpu_seconds: 12.25,
        samples: 3,
        series: Vec::new(),
    };
    let quarantine =
        Quarantine { gpu_uuid: "GPU-1".into(), agent_id: "agent-1".into(), reason: "job: XID 79".into(), since_ms: 9 };
    let batch = vec![
        // A start with what its agent did not enforce.
        JobUpdate {
            job: id[0],
            expect: vec![JobState::Assigned],
            change: JobChange {
                state: Some(JobState::Running),
                started_at_ms: Some(7),
                unenforced: Some(vec![Unenforced { key: Protection::Limits, detail: "no cgroup".into() }]),
                ..Default::default()
            },
        },
        // A plain end: exit code, telemetry, leases released, a GPU quarantined.
        JobUpdate {
            job: id[1],
            expect: vec![JobState::Queued, JobState::Assigned, JobState::Running],
            change: JobChange {
                state: Some(JobState::Failed),
                reason: Some("exited with 3".into()),
                finished_at_ms: Some(8),
                exit_code: Some(3),
                telemetry: Some(telemetry),
                release_leases: true,
                quarantine: vec![quarantine],
                ..Default::default()
            },
        },
        // Back to the queue: the assignment and its leases forgotten.
        JobUpdate {
            job: id[2],
            expect: vec![JobState::Assigned],
            change: JobChange {
                state: Some(JobState::Queued),
                reason: Some("its GPU failed a check".into()),
                clear_assignment: true,
                ..Default::default()
            },
        },
        // Refused: it is not running.
        JobUpdate {
            job: id[4],
            expect: vec![JobState::Running],
            change: JobChange { state: Some(JobState::Succeeded), release_leases: true, ..Default::default() },
        },
        // Only a reason, from any state.
        JobUpdate {
            job: id[5],
            expect: vec![],
            change: JobChange { reason: Some("noted".into()), ..Default::default() },
        },
        // Ends as lost, leases released, no exit code.
        JobUpdate {
            job: id[6],
            expect: vec![JobState::Running],
            change: JobChange {
                state: Some(JobState::Lost),
                reason: Some("agent gone".into()),
                finished_at_ms: Some(9),
                release_leases: true,
                ..Default::default()
            },
        },
        JobUpdate {
            job: 999_999,
            expect: vec![],
            change: JobChange { reason: Some("none".into()), ..Default::default() },
        },
    ];
    let twice = vec![
        JobUpdate {
            job: id[3],
            expect: vec![JobState::Assigned],
            change: JobChange { state: Some(JobState::Running), started_at_ms: Some(10), ..Default::default() },
        },
        JobUpdate {
            job: id[3],
            expect: vec![JobState::Running],
            change: JobChange {
                state: Some(JobState::Succeeded),
                finished_at_ms: Some(11),
                exit_code: Some(0),
                release_leases: true,
                ..Default::default()
            },
        },
        // A second start of the same job: refused, as the first took it.
        JobUpdate {
            job: id[3],
            expect: vec![JobState::Assigned],
            change: JobChange { state: Some(JobState::Running), started_at_ms: Some(12), ..Default::default() },
        },
    ];
    // Only reasons, on jobs whose every other field is set: each keeps its values.
    let noted = |job| JobUpdate {
        job,
        expect: vec![],
        change: JobChange { reason: Some("later".into()), ..Default::default() },
    };
    let after = vec![noted(id[1]), noted(id[3]), noted(id[0])];
    let mut answers = Vec::new();
    for b in [&batch, &twice, &after] {
        // What the scheduler holds of each job before the batch: an accepted change's record
        // is built from it (`JobChange::applied_to`), not read back.
        let mut held = std::collections::HashMap::new();
        for u in b.iter() {
            if let Some(j) = batched.get_job(u.job).await.unwrap() {
                held.insert(u.job, j);
            }
        }
        let together = batched.update_jobs(b).await.unwrap();
        let mut alone = Vec::new();
        for u in b.iter() {
            alone.push(single.update_job(u.job, &u.expect, u.change.clone()).await);
        }
        answers.push((b, held, together, alone));
    }
    for (b, mut held, together, alone) in answers {
        assert_eq!(together.len(), alone.len());
        for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
            match (t, a) {
                (Ok(()), Ok(a)) => {
                    let built = b[i].change.applied_to(&held[&b[i].job]);
                    assert_eq!(&built, a, "change {i}");
                    held.insert(b[i].job, built);
                }
                (Err(t), Err(a)) => assert_eq!(format!("{t}"), format!("{a}"), "change {i}"),
                _ => panic!("change {i}: batched {t:?}, alone {a:?}"),
            }
        }
    }
    assert!(batched.update_jobs(&[]).await.unwrap().is_empty());
    for j in id {
        assert_eq!(batched.get_job(*j).await.unwrap(), single.get_job(*j).await.unwrap(), "job {j}");
    }
    let leases = |mut l: Vec<Lease>| {
        l.sort_by(|a, b| a.gpu_uuid.cmp(&b.gpu_uuid));
        l.into_iter().map(|l| (l.gpu_uuid, l.job_id)).collect::<Vec<_>>()
    };
    let (b, s) = (leases(batched.leases().await.unwrap()), leases(single.leases().await.unwrap()));
    assert_eq!(b, s);
    assert_eq!(b.iter().map(|(g, _)| g.as_str()).collect::<Vec<_>>(), ["GPU-0", "GPU-4"], "leases left");
    assert_eq!(batched.quarantined().await.unwrap(), single.quarantined().await.unwrap());
    assert_eq!(batched.quarantined().await.unwrap().len(), 1);
    for j in id {
        let (b, s) = (batched.job_token(*j).await.unwrap(), single.job_token(*j).await.unwrap());
        assert_eq!(b.map(|t| t.token_sha256), s.map(|t| t.token_sha256), "job {j}'s token");
    }
    assert!(batched.job_token(id[1]).await.unwrap().is_none(), "an ended job's token is deleted with its end");
}

#[tokio::test]
async fn sqlite_update_jobs_writes_what_one_at_a_time_writes() {
    let dir = tempfile::tempdir().unwrap();
    let batched = SqliteStore::open(&dir.path().join("batched.db")).await.unwrap();
    let single = SqliteStore::open(&dir.path().join("single.db")).await.unwrap();
    batch_writes_what_one_at_a_time_writes(&batched, &single).await;
}

#[tokio::test]
async fn postgres_update_jobs_writes_what_one_at_a_time_writes() {
    let Some(server) = pg::PgServer::start() else { return };
    let batched = PostgresStore::connect(&server.create_database("batched_updates").await).await.unwrap();
    let single = PostgresStore::connect(&server.create_database("single_updates").await).await.unwrap();
    batch_writes_what_one_at_a_time_writes(&batched, &single).await;
}
