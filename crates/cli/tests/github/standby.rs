//! Webhooks to a standby coordinator (issue 29): any coordinator of a Postgres database accepts
//! GitHub's deliveries. A standby checks them as the leader does and queues them in the
//! database; the leader acts on them. GitHub does not send a failed delivery again by itself,
//! so one sent while the leader is gone must be kept, and acted on once a coordinator leads.

use super::*;
use std::path::Path;

// The store suite's throwaway Postgres server (a real one: initdb, pg_ctl).
#[path = "../../../store/tests/common/pg.rs"]
#[allow(dead_code)] // the store suite uses more of it than these tests
mod pg;

fn free_address() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// A standby's data dir: the leader's tokens and secrets key (docs/ha.md).
fn standby_dir(leader: &Path, dir: PathBuf) -> PathBuf {
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["api-token", "registration-token", "read-token", "secrets.key"] {
        std::fs::copy(leader.join(f), dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    dir
}

/// Waits until `address` answers `/healthz` (a standby listens before it leads).
fn wait_listening(address: &str) {
    let deadline = std::time::Instant::now() + T;
    while std::time::Instant::now() < deadline {
        let up = std::net::TcpStream::connect(address).is_ok_and(|mut s| {
            use std::io::{Read, Write};
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s
                .write_all(format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n").as_bytes());
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out.starts_with("HTTP/1.1 200")
        });
        if up {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("nothing answered /healthz at {address}");
}

fn wait_github_jobs(api: &Api, ids: &[u64], what: &str) -> Vec<Value> {
    let deadline = std::time::Instant::now() + T;
    loop {
        let jobs: Vec<Value> = api.get("/api/v1/github/jobs");
        if ids.iter().all(|id| jobs.iter().any(|j| j["id"] == json!(id))) {
            return jobs;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: {jobs:#?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A workflow job's webhook sent to the standby is acted on by the leader (its record, one
/// runner job), a redelivery to either is known as one; with the leader killed, a delivery to
/// the standby is still accepted, and acted on when the standby leads. Each job once.
#[test]
fn a_standby_accepts_webhooks_for_the_leader_and_keeps_one_sent_during_a_failover() {
    let Some(pg) = pg::PgServer::start() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let url = rt.block_on(pg.create_database("gpuci_gh_standby"));
    let gh = rt.block_on(TestGitHub::start(Options {
        webhook_secret: SECRET.into(),
        app_id: APP_ID,
        app_public_key_pem: Some(std::fs::read_to_string(fixture("test-app-key.pub.pem")).unwrap()),
        ..Options::default()
    }));
    gh.add_repo(REPO, 31);
    let dir = tempdir();
    let config = write_config(dir.path(), &gh, "", "1h", None, &dir.path().join("actions-runner"));
    let args: Vec<String> =
        ["--database", &url, "--heartbeat", "200ms", "--lost-after", "30s", "--config", &config.display().to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let mut leader = Server::start_on(&dir.path().join("a"), "127.0.0.1:0", args.clone());
    let standby_address = free_address();
    let standby_data = standby_dir(&leader.data_dir, dir.path().join("b"));
    let standby = {
        let (address, mut args) = (standby_address.clone(), args.clone());
        args.push("--standby".into());
        std::thread::spawn(move || Server::start_on(&standby_data, &address, args))
    };
    wait_listening(&standby_address);
    gh.set_webhook_url(&format!("http://{standby_address}/api/v1/github/webhook"));

    // Signed and checked by the standby as by the leader.
    let (code, text) = rt.block_on(gh.send_raw("workflow_job", br#"{"action":"queued"}"#, None, "d-unsigned"));
    assert_eq!(code, 401, "an unsigned delivery to a standby: {text}");

    let first = rt.block_on(gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "true", true));
    assert_eq!(first.status, 202, "the standby accepts the delivery");
    let api = leader.api();
    wait_github_jobs(&api, &[first.job_id], "the leader acts on a delivery the standby queued");
    assert_eq!(rt.block_on(gh.redeliver(&first.delivery)), 200, "a redelivery to the standby is known");
    gh.set_webhook_url(&format!("{}/api/v1/github/webhook", leader.url));
    assert_eq!(rt.block_on(gh.redeliver(&first.delivery)), 200, "and to the leader");

    // The leader dies; deliveries arrive before the standby leads: a workflow job (which
    // reconciliation would find again anyway) and a push (which nothing else would recover).
    let sha = "4444444444444444444444444444444444444444";
    gh.set_tree(REPO, sha, &[(".gpuci.yml", "steps:\n  - key: from-push\n    command: \"true\"\n")]);
    gh.set_webhook_url(&format!("http://{standby_address}/api/v1/github/webhook"));
    leader.kill9();
    let second = rt.block_on(gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "true", true));
    assert_eq!(second.status, 202, "accepted with no leader");
    assert_eq!(rt.block_on(gh.push(REPO, "main", sha)), 202, "a push accepted with no leader");
    assert!(!standby.is_finished(), "the standby took over within the leader's lease: the test shows nothing");
    let standby = standby.join().expect("the standby took over");
    let api = standby.api();
    let jobs = wait_github_jobs(&api, &[first.job_id, second.job_id], "the new leader acts on the queued delivery");
    assert_eq!(jobs.len(), 2, "each workflow job recorded once: {jobs:#?}");
    let deadline = std::time::Instant::now() + T;
    let all = loop {
        let all: Vec<gpuci_protocol::api::JobSummary> = api.get("/api/v1/jobs");
        // The runner jobs follow their records: wait for all three.
        if (all.iter().any(|j| j.step_key == "from-push") && all.len() >= 3) || std::time::Instant::now() > deadline {
            break all;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(all.iter().filter(|j| j.step_key == "from-push").count(), 1, "the push's pipeline, once: {all:#?}");
    assert_eq!(all.len(), 3, "one runner job per workflow job and the push's job: {all:#?}");
}

/// The webhook defences hold on a standby too (docs/github.md, "Webhook limits and replays"):
/// an unsigned body is refused before it is read; a signed body the leader acted on, sent to
/// the standby under a fresh delivery id, is not queued (and one the standby queued is not
/// acted on again through the leader); and a `workflow_job` the leader heard had completed
/// gets no runner when its `queued` delivery, queued by the standby, is taken after.
#[test]
fn a_standby_refuses_unread_bodies_and_replays_and_its_late_queued_delivery_gets_no_runner() {
    use super::webhooks::{push_body, response_head, start_post_to, workflow_job};
    let Some(pg) = pg::PgServer::start() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let url = rt.block_on(pg.create_database("gpuci_gh_standby_attacks"));
    let gh = rt.block_on(TestGitHub::start(Options {
        webhook_secret: SECRET.into(),
        app_id: APP_ID,
        app_public_key_pem: Some(std::fs::read_to_string(fixture("test-app-key.pub.pem")).unwrap()),
        ..Options::default()
    }));
    gh.add_repo(REPO, 31);
    let (first, second) = ("7777777777777777777777777777777777777777", "8888888888888888888888888888888888888888");
    gh.set_tree(REPO, first, &[(".gpuci.yml", "steps:\n  - key: first\n    command: \"true\"\n")]);
    gh.set_tree(REPO, second, &[(".gpuci.yml", "steps:\n  - key: second\n    command: \"true\"\n")]);
    let dir = tempdir();
    let config = write_config(dir.path(), &gh, "forks = \"allow\"", "1h", None, &dir.path().join("actions-runner"));
    let args: Vec<String> =
        ["--database", &url, "--heartbeat", "200ms", "--lost-after", "30s", "--config", &config.display().to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let mut leader = Server::start_on(&dir.path().join("a"), "127.0.0.1:0", args.clone());
    let standby_address = free_address();
    let standby_data = standby_dir(&leader.data_dir, dir.path().join("b"));
    let standby = {
        let (address, mut args) = (standby_address.clone(), args.clone());
        args.push("--standby".into());
        std::thread::spawn(move || Server::start_on(&standby_data, &address, args))
    };
    wait_listening(&standby_address);
    let to_leader = format!("{}/api/v1/github/webhook", leader.url);
    let to_standby = format!("http://{standby_address}/api/v1/github/webhook");

    let headers = [("X-GitHub-Event", "push"), ("X-GitHub-Delivery", "s-big")];
    let mut s = start_post_to(&standby_address, &headers, 20 << 20, &[b' '; 64 << 10]);
    let head = response_head(&mut s);
    assert!(head.starts_with("HTTP/1.1 401"), "an unsigned 20 MB body, answered before it was sent: {head:?}");

    let send = |body: &[u8], delivery: &str| {
        let signature = gpuci_github_testserver::sign_webhook(SECRET, body);
        rt.block_on(gh.send_raw("push", body, Some(&signature), delivery))
    };
    let (one, two) = (push_body(first), push_body(second));
    gh.set_webhook_url(&to_leader);
    assert_eq!(send(&one, "s-1").0, 202, "the leader acts on the first push");
    gh.set_webhook_url(&to_standby);
    let (code, text) = send(&one, "s-2");
    assert_eq!(code, 200, "its body replayed to the standby: {text}");
    assert_eq!(send(&two, "s-3").0, 202, "the standby queues the second push");
    gh.set_webhook_url(&to_leader);
    let (code, text) = send(&two, "s-4");
    assert_eq!(code, 200, "its body replayed to the leader: {text}");

    // The leader hears a job completed; the standby then queues its (late) `queued` delivery,
    // and a live job after it: taken in order, so once the live job has a record the late
    // one was seen.
    let late = 900301;
    let (code, text) = rt.block_on(gh.send_event("workflow_job", workflow_job("completed", late)));
    assert_eq!(code, 202, "{text}");
    gh.set_webhook_url(&to_standby);
    let (code, text) = rt.block_on(gh.send_event("workflow_job", workflow_job("queued", late)));
    assert_eq!(code, 202, "queued by the standby: {text}");
    let live = rt.block_on(gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "true", true));
    assert_eq!(live.status, 202);
    let api = leader.api();
    let records = wait_github_jobs(&api, &[live.job_id], "the leader takes the standby's deliveries");
    assert!(!records.iter().any(|r| r["id"] == json!(late)), "no record for the ended job: {records:#?}");

    let deadline = std::time::Instant::now() + T;
    let jobs = loop {
        let jobs: Vec<gpuci_protocol::api::JobSummary> = api.get("/api/v1/jobs");
        if jobs.iter().any(|j| j.step_key == "second") || std::time::Instant::now() > deadline {
            break jobs;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    for key in ["first", "second"] {
        assert_eq!(jobs.iter().filter(|j| j.step_key == key).count(), 1, "push {key}'s pipeline once: {jobs:#?}");
    }
    assert_eq!(jobs.len(), 3, "the two pushes' jobs and the live workflow job's runner: {jobs:#?}");
    // The standby is only a `Server` (stopped when dropped) once it leads.
    leader.kill9();
    drop(standby.join().expect("the standby took over"));
}
