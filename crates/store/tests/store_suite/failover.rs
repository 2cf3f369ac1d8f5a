//! One coordinator per Postgres database: sole-use claims, fencing of a former leader's
//! writes, a frozen leader that cannot hold off a takeover, and what fencing costs (a benchmark
//! run by hand).

use crate::{new_job, pg, rand_suffix};
use gpuci_core::job::JobState;
use gpuci_protocol::agent::{LogChunk, Stream};
use gpuci_store::*;

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
    let batch = [NewAssignment {
        job: jobs[0].id,
        agent_id: "agent-1".into(),
        agent_name: "agent-1".into(),
        gpus: vec!["GPU-F".into()],
        token_sha256: Some("f00d".into()),
    }];
    let refused = a.assign_jobs(&batch, 5).await.expect_err("a fenced placement pass");
    assert!(refused.is_fenced(), "{refused}");
    assert_eq!(b.get_job(jobs[0].id).await.unwrap().unwrap().state, JobState::Queued);
    assert!(b.leases().await.unwrap().is_empty());
    assert_eq!(b.job_token(jobs[0].id).await.unwrap(), None, "a fenced pass stored a job token");
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
