//! Rolling upgrades (issue 29 item 3) on both backends: a coordinator keeps running on a
//! database that a coordinator of the next version has migrated additively, and is refused,
//! with the versions in words, once a migration it cannot live with has run. The next
//! version is acted out by what its migrations leave: a new table, its row in
//! `_sqlx_migrations`, and for a breaking one `schema_compat.oldest_reader` raised. SQLite (a
//! file, as in production) and a real throwaway Postgres (`common/pg.rs`; skipped with a
//! message where Postgres is not installed, unless CI=true).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "common/pg.rs"]
#[allow(dead_code)] // shared with the store suite, which uses all of it
mod pg;

use gpuci_core::job::JobState;
use gpuci_core::pipeline::Step;
use gpuci_store::*;
use std::collections::BTreeMap;

/// The store still does its work: a pipeline written and read back.
async fn works(s: &dyn Store) {
    let job = NewJob {
        pipeline_id: 0,
        step: Step::new("build", "true"),
        env: BTreeMap::new(),
        state: JobState::Queued,
        reason: "queued".into(),
        attempt: 1,
        retry_of: None,
        created_at_ms: 1,
    };
    let p = NewPipeline {
        file_name: "p.yml".into(),
        source: String::new(),
        workspace_upload: None,
        repository: None,
        origin: None,
        created_at_ms: 1,
    };
    let (p, jobs) = s.create_pipeline(p, vec![job]).await.unwrap();
    assert_eq!(s.pipeline_jobs(p.id).await.unwrap()[0].id, jobs[0].id);
}

fn too_old(e: StoreError) -> gpuci_store::compat::TooOld {
    match e {
        StoreError::TooOld(t) => t,
        other => panic!("expected a too-old refusal, got: {other}"),
    }
}

#[tokio::test]
async fn sqlite_a_coordinator_runs_on_the_next_versions_additive_schema_and_is_refused_after_a_breaking_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    drop(SqliteStore::open(&path).await.unwrap());
    // The next version's migration 9000: a table of its own, recorded as sqlx records it.
    let next = |sql: &'static str| {
        let path = path.clone();
        async move {
            use sqlx::Connection;
            let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display())).await.unwrap();
            sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
        }
    };
    next(
        "CREATE TABLE next_version_things (id INTEGER PRIMARY KEY, what TEXT NOT NULL DEFAULT '');
         INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (9000, 'next version', 1, X'00', 0);",
    )
    .await;
    // Without the compat check sqlx refuses any database with a migration it does not know.
    let s = SqliteStore::open_existing(&path).await.expect("one version behind, additive: runs");
    works(&s).await;
    drop(s);
    // A breaking migration of the version after: this coordinator is too old now.
    next(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (9001, 'breaking', 1, X'00', 0);
         UPDATE schema_compat SET oldest_reader = 9001;",
    )
    .await;
    let e = too_old(SqliteStore::open_existing(&path).await.err().expect("refused"));
    assert_eq!((e.database, e.needs), (9001, 9001));
    assert!(e.to_string().contains("upgrade this coordinator"), "{e}");
}

#[tokio::test]
async fn sqlite_a_coordinator_from_before_the_newest_migration_runs_on_it() {
    // The previous version in the tree: everything but the newest migration. Our newest is the
    // compat table itself or an additive one after it; either way the one before it runs,
    // unless the newest is the compat table (a version from before rolling upgrades, which
    // sqlx alone would have refused too).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    drop(SqliteStore::open(&path).await.unwrap());
    let newest: i64 = {
        use sqlx::Connection;
        let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display())).await.unwrap();
        sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(&mut c).await.unwrap()
    };
    match SqliteStore::open_as_of(&path, newest - 1).await {
        Ok(s) => works(&s).await,
        Err(e) => {
            let e = too_old(e);
            assert_eq!(e.needs, 19, "only a version without the compat table is refused: {e}");
        }
    }
}

#[tokio::test]
async fn postgres_a_coordinator_runs_on_the_next_versions_additive_schema_and_is_refused_after_a_breaking_one() {
    let Some(server) = pg::PgServer::start() else { return };
    let url = server.create_database("upgrade").await;
    drop(PostgresStore::connect(&url).await.unwrap());
    let next = |sql: &'static str| {
        let url = url.clone();
        async move {
            use sqlx::Connection;
            let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
            sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
        }
    };
    next(
        "CREATE TABLE next_version_things (id BIGSERIAL PRIMARY KEY, what TEXT NOT NULL DEFAULT '');
         INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (9000, 'next version', true, '\\x00'::bytea, 0);",
    )
    .await;
    let s = PostgresStore::connect_existing(&url).await.expect("one version behind, additive: runs");
    works(&s).await;
    drop(s);
    next(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (9001, 'breaking', true, '\\x00'::bytea, 0);
         UPDATE schema_compat SET oldest_reader = 9001;",
    )
    .await;
    let e = too_old(PostgresStore::connect_existing(&url).await.err().expect("refused"));
    assert_eq!((e.database, e.needs), (9001, 9001));
}
