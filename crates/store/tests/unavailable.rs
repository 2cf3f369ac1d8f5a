//! A database that cannot take a write now is told apart from a request that is wrong
//! (`StoreError::is_unavailable`: the coordinator answers 503), for Postgres as for SQLite
//! (SQLite's full disk is tested in `src/sqlite.rs`, on a tmpfs of its own).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[allow(dead_code)] // the suite's helper; this file needs only some of it
#[path = "common/pg.rs"]
mod pg;

use gpuci_core::job::JobState;
use gpuci_core::pipeline::Step;
use gpuci_store::*;

fn pipeline() -> NewPipeline {
    NewPipeline {
        file_name: "p.yml".into(),
        source: "steps: []".into(),
        workspace_upload: None,
        repository: None,
        origin: None,
        created_at_ms: 1,
    }
}

fn job() -> NewJob {
    NewJob {
        pipeline_id: 0,
        step: Step::new("a", "true"),
        env: Default::default(),
        state: JobState::Queued,
        reason: "queued".into(),
        attempt: 1,
        retry_of: None,
        created_at_ms: 1,
    }
}

#[test]
fn errors_of_the_connection_are_unavailable_and_others_are_not() {
    let io = StoreError::Db(sqlx::Error::Io(std::io::Error::other("connection reset")));
    assert!(io.is_unavailable() && io.is_transient());
    assert!(StoreError::Db(sqlx::Error::PoolTimedOut).is_unavailable());
    assert!(!StoreError::Db(sqlx::Error::RowNotFound).is_unavailable());
    assert!(!StoreError::JobNotFound(1).is_unavailable());
    assert!(!StoreError::Corrupt("x".into()).is_unavailable());
}

/// A Postgres that takes no writes (a standby, or read-only for maintenance) answers
/// SQLSTATE 25006: unavailable, with its reason; a job's end and its retry are one
/// transaction there too.
#[tokio::test]
async fn a_postgres_that_takes_no_writes_is_unavailable_and_stores_nothing() {
    let Some(server) = pg::PgServer::start() else { return };
    let url = server.create_database("readonly").await;
    let s = PostgresStore::connect(&url).await.unwrap();
    let (_, jobs) = s.create_pipeline(pipeline(), vec![job()]).await.unwrap();
    let id = jobs[0].id;

    let read_only = |on: bool| {
        // From another database: a session of the read-only one cannot turn it back.
        let admin_url = format!("{}/postgres", url.rsplit_once('/').unwrap().0);
        async move {
            use sqlx::Connection;
            let mut admin = sqlx::PgConnection::connect(&admin_url).await.unwrap();
            let sql = format!("ALTER DATABASE readonly SET default_transaction_read_only = {on}");
            sqlx::query(&sql).execute(&mut admin).await.unwrap();
            // The setting holds for new sessions: end the store's.
            sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'readonly' AND pid <> pg_backend_pid()")
                .execute(&mut admin)
                .await
                .unwrap();
        }
    };
    read_only(true).await;
    let failed = || JobChange { state: Some(JobState::Failed), reason: Some("exit 1".into()), ..Default::default() };
    let retry = NewJob { pipeline_id: jobs[0].pipeline_id, attempt: 2, retry_of: Some(id), ..job() };
    // The first call may meet a connection the server has just ended: also unavailable.
    for _ in 0..3 {
        let e = s.update_job_and_insert(id, &[JobState::Queued], failed(), retry.clone()).await.unwrap_err();
        assert!(e.is_unavailable(), "{e}");
    }
    let e = s.create_pipeline(pipeline(), vec![job()]).await.unwrap_err();
    assert!(e.is_unavailable() && e.to_string().contains("SQLSTATE 25006"), "{e}");
    assert_eq!(e.reason(), "cannot execute INSERT in a read-only transaction");

    read_only(false).await;
    let all = s.pipeline_jobs(jobs[0].pipeline_id).await.unwrap();
    assert_eq!((all.len(), all[0].state), (1, JobState::Queued), "nothing was stored: {all:?}");
    let (ended, next) = s.update_job_and_insert(id, &[JobState::Queued], failed(), retry).await.unwrap();
    assert_eq!((ended.state, next.retry_of), (JobState::Failed, Some(id)));
    // A request that is wrong is not the database being away.
    let e = s.update_job(id, &[JobState::Queued], failed()).await.unwrap_err();
    assert!(!e.is_unavailable(), "{e}");
}
