//! Durable before acknowledged (issue 10, items 3 and 7), with real processes: a coordinator
//! whose disk fills answers 503 with the reason, shows and acknowledges only what it stored,
//! loses nothing it acknowledged across a restart, and recovers by itself when space returns;
//! a data dir whose database is missing, empty or damaged is refused with one clear message.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;
#[path = "common/disk.rs"]
mod disk;
// The store suite's throwaway Postgres server (a real one: initdb, pg_ctl).
#[path = "../../store/tests/common/pg.rs"]
#[allow(dead_code)] // the store suite uses more of it than this test
mod pg;

use common::*;
use disk::SmallDisk;
use gpuci_core::job::JobState;
use gpuci_protocol::api::{JobSummary, SubmitPipeline};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

/// POST a pipeline; the status and the body as JSON.
fn try_submit(api: &Api, token: &str, yaml: &str) -> (u16, serde_json::Value) {
    let r = api
        .raw()
        .post(format!("{}/api/v1/pipelines", api.url))
        .bearer_auth(token)
        .json(&SubmitPipeline {
            submission: None,
            build: None,
            file_name: "test.yml".into(),
            source: yaml.into(),
            env: Default::default(),
            workspace_upload: None,
            workspace_archive: None,
            repository: None,
        })
        .send()
        .unwrap();
    (r.status().as_u16(), r.json().unwrap_or_default())
}

fn try_cancel(api: &Api, token: &str, id: i64) -> (u16, serde_json::Value) {
    let r = api.raw().post(format!("{}/api/v1/jobs/{id}/cancel", api.url)).bearer_auth(token).send().unwrap();
    (r.status().as_u16(), r.json().unwrap_or_default())
}

fn assert_full_disk_answer(what: &str, (status, body): &(u16, serde_json::Value)) {
    let error = body["error"].as_str().unwrap_or_default();
    assert_eq!(*status, 503, "{what}: {body}");
    assert!(
        error.contains("could not store this: database or disk is full") && error.ends_with("try again later"),
        "{what}: {error}"
    );
}

/// Every job with its state and reason, oldest first: what `gpuci jobs` shows.
fn all_jobs(api: &Api) -> Vec<(i64, JobState, String)> {
    let mut jobs: Vec<JobSummary> = api.get("/api/v1/jobs?limit=10000");
    jobs.sort_by_key(|j| j.id);
    jobs.into_iter().map(|j| (j.id, j.state, j.reason)).collect()
}

#[test]
fn a_full_disk_is_answered_503_and_nothing_acknowledged_is_lost() {
    // Declared first, dropped last: the coordinator is gone before the disk is unmounted.
    let Some(disk) = SmallDisk::mount("8m") else { return };
    let dir = tempdir();
    let mut server = Server::start(&disk.path().join("server"), "120s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);

    let before = api.submit("steps:\n  - key: a\n    command: echo before\n");
    api.wait_job(before.jobs[0].id, "succeeded", T, |j| j.state == JobState::Succeeded);
    // Waits for a tag no agent has: stays queued, to be cancelled.
    let waiting = api.submit("steps:\n  - key: w\n    agents: {queue: nowhere}\n    command: echo never\n");
    let running = api.submit("steps:\n  - key: r\n    command: sleep 2\n");
    let run_id = running.jobs[0].id;
    api.wait_job(run_id, "running", T, |j| j.state == JobState::Running);

    let filler = disk.fill();
    assert_full_disk_answer("submit on a full disk", &try_submit(&api, &server.token, "steps:\n  - command: echo x\n"));
    assert_full_disk_answer("cancel on a full disk", &try_cancel(&api, &server.token, waiting.jobs[0].id));
    // The job ends meanwhile, but its end cannot be stored: nobody is told it ended.
    std::thread::sleep(Duration::from_secs(5));
    assert_full_disk_answer("a second submit", &try_submit(&api, &server.token, "steps:\n  - command: echo y\n"));
    let shown = all_jobs(&api);
    assert_eq!(
        shown.iter().map(|(id, state, _)| (*id, *state)).collect::<Vec<_>>(),
        [(before.jobs[0].id, JobState::Succeeded), (waiting.jobs[0].id, JobState::Queued), (run_id, JobState::Running)],
        "while the disk is full only stored states show: {shown:#?}"
    );

    // Space returns: no restart; the agent's result is stored when it sends it again.
    disk.free(&filler);
    let ended = api.wait_job(run_id, "succeeded", T, |j| j.state.is_terminal());
    assert_eq!(ended.state, JobState::Succeeded, "{ended:?}");
    let after = api.submit("steps:\n  - key: a\n    command: echo after\n");
    api.wait_job(after.jobs[0].id, "succeeded", T, |j| j.state == JobState::Succeeded);
    let cancelled = api.cancel(waiting.jobs[0].id);
    assert_eq!(cancelled.state, JobState::Cancelled);

    // Everything acknowledged survives a kill -9.
    let acknowledged = all_jobs(&api);
    assert_eq!(acknowledged.len(), 4, "{acknowledged:#?}");
    server.restart_hard();
    let api = server.api();
    assert_eq!(all_jobs(&api), acknowledged);
}

/// Regression: an agent whose disk was full took every job and failed it ("could not journal
/// the assignment"). It now takes none while its disk is under `--min-free-disk`, says why,
/// and takes them again once space returns; a job submitted meanwhile waits, then runs.
#[test]
fn an_agent_with_a_full_disk_takes_no_jobs_until_space_returns() {
    let Some(disk) = SmallDisk::mount("64m") else { return };
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "120s");
    // No slot disks: a 64 MiB data dir cannot hold them (the agent would rightly refuse jobs).
    let args = ["--isolation", isolation(), "--min-free-disk", "16MiB", "--job-disk", "none"];
    let _agent = Agent::start(&server, &disk.path().join("agent"), "a1", &args);
    let api = server.api();
    api.wait_agents(1, T);
    let first = api.submit("steps:\n  - key: a\n    command: echo room\n");
    api.wait_job(first.jobs[0].id, "succeeded", T, |j| j.state == JobState::Succeeded);

    let filler = disk.fill();
    let t0 = Instant::now();
    while !api.agents()[0].reason.contains("takes no new jobs") {
        assert!(t0.elapsed() < T, "the agent never said its disk is full: {:?}", api.agents()[0]);
        std::thread::sleep(Duration::from_millis(100));
    }
    let why = api.agents()[0].reason.clone();
    assert!(why.contains("--min-free-disk") && why.contains("free"), "{why}");
    let waiting = api.submit("steps:\n  - key: b\n    command: echo later\n");
    std::thread::sleep(Duration::from_secs(3));
    let job = api.pipeline(waiting.id).jobs[0].clone();
    assert_eq!(job.state, JobState::Queued, "a job went to an agent with a full disk: {job:?}");

    disk.free(&filler);
    let done = api.wait_job(job.id, "succeeded", T, |j| j.state.is_terminal());
    assert_eq!(done.state, JobState::Succeeded, "{done:?}");
    assert!(!api.agents()[0].reason.contains("takes no new jobs"), "{:?}", api.agents()[0]);
}

/// `gpuci server` on `data_dir` with `args`, expected to refuse to start: its exit code and
/// what it wrote to stderr.
fn refused(data_dir: &Path, args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > T {
            let _ = child.kill();
            panic!("gpuci server {args:?} started on {}; expected a refusal", data_dir.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A data dir a coordinator has used, with the server gone and its database's `-wal` and
/// `-shm` removed.
fn used_data_dir(dir: &Path) -> std::path::PathBuf {
    let data = dir.join("server");
    let mut server = Server::start(&data, "30s");
    assert!(server.api().agents().is_empty());
    server.kill9();
    for f in ["gpuci.db-wal", "gpuci.db-shm"] {
        let _ = std::fs::remove_file(data.join(f));
    }
    data
}

/// Regression (issue 10, item 7): an empty `gpuci.db` started as a new, empty database.
#[test]
fn a_used_data_dir_whose_database_is_empty_or_missing_is_refused() {
    let dir = tempdir();
    let data = used_data_dir(dir.path());
    let db = data.join("gpuci.db");
    let token = std::fs::read_to_string(data.join("registration-token")).unwrap();

    std::fs::write(&db, "").unwrap();
    let (code, err) = refused(&data, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("database {} is empty (0 bytes)", db.display())), "{err}");
    assert!(err.contains("this data dir was used before (found database-made,"), "{err}");
    assert!(err.contains("Restore") && err.contains("--new-database"), "{err}");
    assert_eq!(std::fs::metadata(&db).unwrap().len(), 0, "the file was left as it was");

    std::fs::remove_file(&db).unwrap();
    let (code, err) = refused(&data, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("database {} is missing", db.display())), "{err}");
    assert!(!db.exists(), "no new database was made");

    // Asked for: a new database, the same tokens; a second time it is refused, as the new
    // database holds data now.
    let mut server = Server::start_on(&data, "127.0.0.1:0", vec!["--new-database".into()]);
    assert!(server.api().agents().is_empty());
    server.kill9();
    assert_eq!(std::fs::read_to_string(data.join("registration-token")).unwrap(), token);
    let (code, err) = refused(&data, &["--new-database"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--new-database") && err.contains("already holds a database"), "{err}");
}

/// Regression: a missing database was still accepted when nothing the check looked for lay in
/// the data dir (the secrets key kept elsewhere, tokens only), and a SQLite file without
/// gpuci's tables in a used data dir was quietly made a new, empty database.
#[test]
fn a_used_data_dir_is_recognised_whatever_it_holds_and_a_foreign_database_is_refused() {
    let dir = tempdir();
    let data = dir.path().join("server");
    let key = dir.path().join("elsewhere.key");
    let key_arg = vec!["--secrets-key-file".to_string(), key.display().to_string()];
    let mut server = Server::start_on(&data, "127.0.0.1:0", key_arg.clone());
    assert!(server.api().agents().is_empty());
    server.kill9();
    assert!(key.exists() && !data.join("secrets.key").exists());
    let db = data.join("gpuci.db");
    for f in ["gpuci.db", "gpuci.db-wal", "gpuci.db-shm"] {
        let _ = std::fs::remove_file(data.join(f));
    }
    let args: Vec<&str> = key_arg.iter().map(String::as_str).collect();
    let (code, err) = refused(&data, &args);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("is missing") && err.contains("database-made"), "{err}");
    assert!(!db.exists(), "no new database was made");

    // An empty SQLite database (a valid file, no tables), and another program's.
    for tables in [&[][..], &["CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)"][..]] {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            use sqlx::Connection;
            let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&db).create_if_missing(true);
            let mut c = sqlx::SqliteConnection::connect_with(&opts).await.unwrap();
            sqlx::query("PRAGMA user_version = 7").execute(&mut c).await.unwrap();
            for t in tables {
                sqlx::query(t).execute(&mut c).await.unwrap();
            }
            c.close().await.unwrap();
        });
        let before = std::fs::read(&db).unwrap();
        assert!(!before.is_empty());
        let (code, err) = refused(&data, &args);
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains("holds no gpuci tables") && err.contains("--new-database"), "{err}");
        assert_eq!(err.matches("holds no gpuci tables").count(), 1, "said once: {err}");
        assert!(std::fs::read(&db).unwrap() == before, "the file was changed");
        std::fs::remove_file(&db).unwrap();
    }

    // Only a token left (a data dir from before the marker): refused too.
    std::fs::remove_file(data.join("database-made")).unwrap();
    std::fs::remove_file(data.join("api-token")).unwrap();
    let (code, err) = refused(&data, &args);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("(found registration-token)"), "{err}");
}

/// `gpuci up` takes `--new-database` like `gpuci server`.
#[test]
fn gpuci_up_refuses_a_used_data_dir_without_its_database_unless_told() {
    let dir = tempdir();
    let data = used_data_dir(dir.path());
    std::fs::remove_file(data.join("gpuci.db")).unwrap();
    let pipeline = dir.path().join("p.yml");
    std::fs::write(&pipeline, "steps:\n  - key: a\n    command: \"true\"\n").unwrap();
    let up = |extra: &[&str]| {
        Command::new(BIN)
            .args(["up", "--listen", "127.0.0.1:0", "--slots", "1", "--isolation", isolation()])
            .args(["--no-upload", "--exit-when-done", "--data-dir"])
            .arg(&data)
            .arg(&pipeline)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .unwrap()
    };
    let out = up(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("is missing") && err.contains("--new-database"), "{err}");
    let out = up(&["--new-database"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(data.join("gpuci.db").metadata().unwrap().len() > 0, "{err}");
}

/// Regression (issue 10, item 7): a damaged database was refused with its reason printed
/// three times.
#[test]
fn a_damaged_database_is_refused_with_its_reason_said_once() {
    let dir = tempdir();
    let data = used_data_dir(dir.path());
    std::fs::write(data.join("gpuci.db"), vec![0x5a; 16 * 1024]).unwrap();
    let (code, err) = refused(&data, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(err.matches("file is not a database").count(), 1, "{err}");
    assert!(err.contains("the file is damaged") && err.contains("restore it from a backup"), "{err}");
}

/// Regression (outsider attack): a used data dir pointed at an empty Postgres database started
/// a new, empty gpuci there without a word (SQLite refuses the same), and agents registered
/// again as new ones. Now refused unless `--new-database`, as with SQLite.
#[test]
fn a_used_data_dir_pointed_at_an_empty_postgres_database_is_refused() {
    let Some(pg) = pg::PgServer::start() else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let first = rt.block_on(pg.create_database("gpuci_first"));
    let empty = rt.block_on(pg.create_database("gpuci_empty"));
    let dir = tempdir();
    let data = dir.path().join("server");
    let mut server = Server::start_on(
        &data,
        "127.0.0.1:0",
        vec!["--database".into(), first.clone(), "--lost-after".into(), "30s".into()],
    );
    assert!(server.api().agents().is_empty());
    server.kill9();
    let (code, err) = refused(&data, &["--database", &empty]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("holds no gpuci tables") && err.contains("--new-database"), "{err}");
    // The database it was made with still opens; and a new one when asked for.
    let mut again = Server::start_on(&data, "127.0.0.1:0", vec!["--database".into(), first]);
    again.kill9();
    let mut fresh = Server::start_on(&data, "127.0.0.1:0", vec!["--database".into(), empty, "--new-database".into()]);
    fresh.kill9();
}

/// Regression (outsider attacks): a second coordinator started on the first one's database
/// (its own data dir) ran, took the first one's agents for gone ones and ended their jobs
/// `lost`; and once the claim was made an advisory lock, a Postgres restart dropped it
/// silently and a second one ran again. Without `--standby` the second
/// is refused, after a Postgres restart too, and the first, killed and restarted, takes its
/// database back at once.
#[test]
fn a_second_coordinator_on_the_same_postgres_database_is_refused() {
    let Some(pg) = pg::PgServer::start() else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = rt.block_on(pg.create_database("gpuci_shared"));
    let dir = tempdir();
    let args = vec!["--database".into(), url.clone(), "--lost-after".into(), "30s".into()];
    let mut first = Server::start_on(&dir.path().join("first"), "127.0.0.1:0", args.clone());
    let (code, err) = refused(&dir.path().join("second"), &["--database", &url]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("another gpuci coordinator leads it") && err.contains("first"), "{err}");
    pg.crash_and_restart();
    let (code, err) = refused(&dir.path().join("second"), &["--database", &url]);
    assert_eq!(code, Some(1), "after a Postgres restart: {err}");
    assert!(err.contains("another gpuci coordinator leads it"), "{err}");
    assert!(first.api().agents().is_empty(), "the first coordinator still answers");
    first.kill9();
    let mut again = Server::start_on(&dir.path().join("first"), "127.0.0.1:0", args);
    again.kill9();
}

/// Two coordinators on one data dir (one database file) are refused the same way.
#[test]
fn a_second_coordinator_on_the_same_data_dir_is_refused() {
    let dir = tempdir();
    let data = dir.path().join("server");
    let mut first = Server::start(&data, "30s");
    let (code, err) = refused(&data, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("another coordinator (pid") && err.contains("uses the data dir"), "{err}");
    assert!(first.api().agents().is_empty(), "the first coordinator still answers");
    first.kill9();
}

/// Regression (outsider attack): an agent died with a job running while the coordinator's
/// disk was full. The agent was declared lost, ending its job could not be stored, and nothing
/// tried again: the job showed `running` until the coordinator was restarted. The end is
/// stored once the disk has room.
#[test]
fn a_lost_agents_job_is_ended_once_the_store_takes_writes_again() {
    let Some(disk) = SmallDisk::mount("64m") else { return };
    let dir = tempdir();
    let server = Server::start(&disk.path().join("server"), "3s");
    let mut agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: long\n    command: sleep 300\n");
    let id = p.jobs[0].id;
    api.wait_job(id, "running", T, |j| j.state == JobState::Running);
    let filler = disk.fill();
    agent.kill9();
    // Past lost_after with the store taking no writes: nobody is declared lost meanwhile (the
    // coordinator could not have heard anyone), and the job ends once writes come back.
    std::thread::sleep(Duration::from_secs(6));
    disk.free(&filler);
    let j = api.wait_job(id, "ended", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Lost, "{j:?}");
    assert!(j.reason.contains("stopped sending heartbeats"), "{}", j.reason);
}

/// Regression (outsider attack): the store took no writes (database down, disk full) for
/// longer than `lost_after` while a healthy agent's job finished. The agent's events could not
/// be stored, so it counted as silent; the moment writes came back it was declared lost and its
/// finished job ended `lost` (and was retried), though its journaled result said `succeeded`.
/// While the store takes no writes nobody's silence counts; afterwards every agent gets
/// `lost_after` to be heard.
#[test]
fn a_healthy_agents_job_that_finished_while_the_store_was_full_keeps_its_result() {
    let Some(disk) = SmallDisk::mount("64m") else { return };
    let dir = tempdir();
    let server = Server::start(&disk.path().join("server"), "3s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: short\n    command: sleep 2; echo done\n    retry: {count: 2, on: [lost]}\n");
    let id = p.jobs[0].id;
    api.wait_job(id, "running", T, |j| j.state == JobState::Running);
    let filler = disk.fill();
    std::thread::sleep(Duration::from_secs(8)); // the job ends meanwhile; lost_after is 3 s
    disk.free(&filler);
    let j = api.wait_job(id, "ended", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Succeeded, "{j:?}");
    let all = api.pipeline(p.id).jobs;
    assert_eq!(all.len(), 1, "a retry ran: {all:#?}");
}
