//! Several coordinators on one Postgres database (issue 29): one leads, by a claim in the
//! database; a standby (`gpuci server --standby`) takes over when the leader is killed or stops
//! renewing its claim, and a former leader writes nothing after the takeover (the database
//! refuses it: crates/store/migrations/postgres/0013_fencing.sql). Real processes, a real
//! Postgres server.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;
// The store suite's throwaway Postgres server (a real one: initdb, pg_ctl).
#[path = "../../store/tests/common/pg.rs"]
#[allow(dead_code)] // the store suite uses more of it than these tests
mod pg;

use common::*;
use gpuci_core::job::JobState;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

/// What a standby's data dir holds of the leader's (docs/ha.md): the tokens agents and users
/// hold, and the key secrets are sealed with.
const SHARED: [&str; 4] = ["api-token", "registration-token", "read-token", "secrets.key"];

fn free_address() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// A data dir for a standby of the coordinator whose data dir is `leader`.
fn standby_dir(leader: &Path, dir: PathBuf) -> PathBuf {
    std::fs::create_dir_all(&dir).unwrap();
    for f in SHARED {
        std::fs::copy(leader.join(f), dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    dir
}

/// `gpuci server --standby`, started now; the thread returns once it serves (it prints its
/// address only when it leads).
fn start_standby(data_dir: PathBuf, listen: String, mut args: Vec<String>) -> std::thread::JoinHandle<Server> {
    args.push("--standby".into());
    std::thread::spawn(move || Server::start_on(&data_dir, &listen, args))
}

fn database(name: &str) -> Option<(pg::PgServer, String)> {
    let pg = pg::PgServer::start()?;
    let url = tokio::runtime::Runtime::new().unwrap().block_on(pg.create_database(name));
    Some((pg, url))
}

/// The leader killed with SIGKILL while two jobs run and two wait: the standby, on the same
/// address (in production a load balancer or a DNS name in front of both), leads within
/// seconds; the agent reconnects, the running jobs finish on it and are settled once, the
/// queued ones start; nothing runs twice, nothing is lost. Prints the time from the kill to
/// the standby serving (BENCHMARKS.md quotes it).
#[test]
fn a_standby_takes_over_from_a_killed_leader_and_every_job_runs_exactly_once() {
    let Some((_pg, url)) = database("gpuci_failover") else { return };
    let dir = tempdir();
    let listen = free_address();
    let args: Vec<String> =
        ["--database", &url, "--heartbeat", "200ms", "--lost-after", "30s"].iter().map(|s| s.to_string()).collect();
    let mut leader = Server::start_on(&dir.path().join("a"), &listen, args.clone());
    let standby = start_standby(standby_dir(&leader.data_dir, dir.path().join("b")), listen.clone(), args);
    let _agent = Agent::start(&leader, &dir.path().join("agent"), "ha-agent", &["--slots", "2"]);
    let api = leader.api();
    api.wait_agents(1, T);
    let mut yaml = String::from("steps:\n");
    for k in 0..4 {
        yaml.push_str(&format!(
            "  - key: s{k}\n    command: echo start {k} attempt $GPUCI_ATTEMPT; sleep 3; echo done {k}\n"
        ));
    }
    let p = api.submit(&yaml);
    for j in &p.jobs[..2] {
        api.wait_job(j.id, "running", T, |j| j.state == JobState::Running);
    }
    assert!(!standby.is_finished(), "the standby served while the leader led");
    let t0 = Instant::now();
    leader.kill9();
    let standby = standby.join().expect("the standby took over");
    let took = t0.elapsed();
    eprintln!("BENCH failover: leader killed (SIGKILL) -> standby serving: {:.2} s", took.as_secs_f64());
    let api = standby.api();
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    assert_eq!(done.jobs.len(), 4, "a job was queued again: {done:#?}");
    for j in &done.jobs {
        assert_eq!(j.attempt, 1, "{j:#?}");
        let log = api.log_text(j.id);
        assert_eq!(log.matches("start ").count(), 1, "job {} ran {}: {log}", j.id, log.matches("start ").count());
        assert!(log.contains("done "), "job {}: {log}", j.id);
        assert_eq!(log.lines().filter(|l| l.contains("done ")).count(), 1, "a line doubled: {log}");
    }
}

/// A standby serves the API and the dashboard by passing them on to the leader it proved
/// (`crates/coordinator/src/proxy.rs`): a pipeline submitted, followed and read through the
/// standby's address runs on the leader once; `/readyz` there still says it does not lead; a
/// wrong token is refused by the leader as on its own address.
#[test]
fn a_standby_passes_the_api_and_the_dashboard_on_to_the_leader() {
    let Some((_pg, url)) = database("gpuci_standby_proxy") else { return };
    let dir = tempdir();
    let args: Vec<String> =
        ["--database", &url, "--heartbeat", "200ms", "--lost-after", "30s"].iter().map(|s| s.to_string()).collect();
    let leader = Server::start_on(&dir.path().join("a"), &free_address(), args.clone());
    let standby_address = free_address();
    let standby = start_standby(standby_dir(&leader.data_dir, dir.path().join("b")), standby_address.clone(), args);
    let _agent = Agent::start(&leader, &dir.path().join("agent"), "ha-agent", &["--slots", "1"]);
    leader.api().wait_agents(1, T);
    let via = Api::new(&format!("http://{standby_address}"), &leader.token);
    let http = reqwest::blocking::Client::new();
    // The standby listens before it leads: wait for its /healthz.
    let deadline = Instant::now() + T;
    while http.get(format!("{}/healthz", via.url)).send().map(|r| r.status().as_u16()).unwrap_or(0) != 200 {
        assert!(Instant::now() < deadline, "the standby never listened");
        std::thread::sleep(Duration::from_millis(100));
    }
    let ready = http.get(format!("{}/readyz", via.url)).send().unwrap();
    assert_eq!(ready.status().as_u16(), 503, "a standby does not say it leads");

    let p = via.submit("steps:\n  - key: one\n    command: echo through the standby\n");
    let done = via.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    let log = via.log_text(done.jobs[0].id);
    assert_eq!(log.matches("through the standby").count(), 1, "{log}");
    let on_leader = leader.api().wait_pipeline(p.id, T);
    assert_eq!(on_leader.jobs.len(), 1, "the leader ran it, once: {on_leader:#?}");

    let wrong = http.get(format!("{}/api/v1/jobs", via.url)).bearer_auth("not-the-token").send().unwrap();
    assert_eq!(wrong.status().as_u16(), 401, "the leader judges the token");
    let page = http.get(format!("{}/ui/login", via.url)).send().unwrap();
    assert!(page.status().is_success(), "the dashboard's sign-in page: {}", page.status());
    assert!(page.text().unwrap().contains("<html"), "an HTML page");
    // A dashboard form sent from a page the standby served (its Origin is the standby's):
    // the leader checks it against the Host the browser used, which the standby passes on.
    let browser = reqwest::blocking::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let signed_in =
        browser.post(format!("{}/ui/login", via.url)).form(&[("token", leader.token.trim())]).send().unwrap();
    assert_eq!(signed_in.status().as_u16(), 303);
    let cookie = signed_in.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
    let long = via.submit("steps:\n  - key: long\n    command: sleep 120\n");
    let id = long.jobs[0].id;
    via.wait_job(id, "running", T, |j| j.state == JobState::Running);
    let page =
        browser.get(format!("{}/ui/jobs/{id}", via.url)).header("cookie", &cookie).send().unwrap().text().unwrap();
    let csrf = page.split("name=\"csrf\" value=\"").nth(1).and_then(|s| s.split('"').next()).expect("a form token");
    let cancelled = browser
        .post(format!("{}/ui/jobs/{id}/cancel", via.url))
        .header("cookie", &cookie)
        .header("origin", &via.url)
        .form(&[("csrf", csrf)])
        .send()
        .unwrap();
    assert_eq!(cancelled.status().as_u16(), 303, "{}", cancelled.text().unwrap_or_default());
    assert_eq!(via.wait_job(id, "cancelled", T, |j| j.state.is_terminal()).state, JobState::Cancelled);
    // The standby's thread returns once it leads: end the leader so it does, and both stop.
    drop(leader);
    drop(standby.join().expect("the standby took over"));
}

/// A leader paused (SIGSTOP) past its claim's lease: the standby takes over, and the former
/// leader, resumed, learns it no longer leads and stops by itself; the new leader keeps serving.
#[test]
fn a_paused_leader_loses_its_claim_and_stops_when_resumed() {
    let Some((_pg, url)) = database("gpuci_paused") else { return };
    let dir = tempdir();
    let args: Vec<String> = ["--database", &url, "--heartbeat", "200ms"].iter().map(|s| s.to_string()).collect();
    let mut leader = Server::start_on(&dir.path().join("a"), &free_address(), args.clone());
    let p = leader.api().submit("steps:\n  - key: before\n    command: echo queued before the pause\n");
    // Its own address: the paused leader still holds its port.
    let standby = start_standby(standby_dir(&leader.data_dir, dir.path().join("b")), free_address(), args);
    let pid = leader.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let t0 = Instant::now();
    let standby = standby.join().expect("the standby took over");
    eprintln!("BENCH failover: leader paused (SIGSTOP) -> standby serving: {:.2} s", t0.elapsed().as_secs_f64());
    // Asked while it is frozen, answered the moment it resumes: before its renewal task has
    // run. It answered `/readyz` 200 then, and a submit 500 (outsider attack); neither may
    // say it leads, and a refused write is a 503 to send again, not a failure.
    let asked = |method: reqwest::Method, path: &str| {
        let (url, token) = (format!("{}{path}", leader.url), leader.token.clone());
        std::thread::spawn(move || {
            let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
            let req = http.request(method, url).bearer_auth(token);
            let req = req
                .json(&serde_json::json!({"file_name": "x.yml", "source": "steps:\n  - key: x\n    command: echo\n"}));
            req.send().map(|r| r.status().as_u16())
        })
    };
    let ready = asked(reqwest::Method::GET, "/readyz");
    let submit = asked(reqwest::Method::POST, "/api/v1/pipelines");
    std::thread::sleep(Duration::from_millis(300));
    assert!(std::process::Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());
    match ready.join().unwrap() {
        Ok(status) => assert_eq!(status, 503, "a resumed former leader's /readyz"),
        Err(e) => eprintln!("the resumed former leader closed /readyz: {e}"),
    }
    match submit.join().unwrap() {
        Ok(status) => assert_eq!(status, 503, "a resumed former leader's answer to a submit"),
        Err(e) => eprintln!("the resumed former leader closed the submit: {e}"),
    }
    let t1 = Instant::now();
    let status = loop {
        if let Some(s) = leader.child.try_wait().unwrap() {
            break s;
        }
        assert!(t1.elapsed() < T, "the former leader runs on after it lost its claim");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success(), "{status}");
    // What was queued before is the new leader's, and it still takes work.
    let api = standby.api();
    assert_eq!(api.job(p.jobs[0].id).state, JobState::Queued);
    let after = api.submit("steps:\n  - key: after\n    command: echo after\n");
    assert_eq!(api.job(after.jobs[0].id).state, JobState::Queued);
}

/// `/readyz` of a Postgres leader answers from its claim, renewed every second, not from a
/// query: behind a slow database link the query took 2.47 s, past the clients' 2 s probe, and
/// the CLI found no coordinator that leads (outsider attack). Here the table it read is held
/// by another session's lock: the leader still says at once that it is ready.
#[test]
fn readyz_answers_from_the_claim_while_a_table_it_once_queried_is_locked() {
    let Some((_pg, url)) = database("gpuci_readyz") else { return };
    let dir = tempdir();
    let args: Vec<String> = ["--database", &url, "--heartbeat", "200ms"].iter().map(|s| s.to_string()).collect();
    let leader = Server::start_on(&dir.path().join("a"), &free_address(), args);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut locker = rt.block_on(async {
        use sqlx::Connection;
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut c).await.unwrap();
        sqlx::query("LOCK TABLE pipelines IN ACCESS EXCLUSIVE MODE").execute(&mut c).await.unwrap();
        c
    });
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
    // Past a renewal or two with the lock held.
    std::thread::sleep(Duration::from_millis(2500));
    let r = http.get(format!("{}/readyz", leader.url)).send();
    let answer = r.as_ref().map(|r| r.status().as_u16()).map_err(|e| e.to_string());
    rt.block_on(async { sqlx::query("ROLLBACK").execute(&mut locker).await.unwrap() });
    assert_eq!(answer, Ok(200), "the leader must say within the 2 s probe that it leads");
}
