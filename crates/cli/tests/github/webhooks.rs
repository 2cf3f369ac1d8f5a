//! The webhook endpoint under attack (docs/github.md, "Webhook limits and replays"): anyone can post
//! to it, and GitHub signs only a delivery's body.
//!
//! - a request that cannot be a signed delivery (no or a malformed signature, no event or
//!   delivery header) is refused before its body is read; bodies read at a time are bounded
//!   (503 with `Retry-After` over it) and one that stalls is cut off (408);
//! - a signed body that starts work, sent again under a fresh delivery id (or another event
//!   name), is not acted on again; GitHub's own redelivery (same id) is still known as one;
//! - a `workflow_job` that GitHub says completed before its `queued` delivery arrives gets no
//!   runner;
//! - a delivery written into the standbys' inbox without GitHub's signature (by whoever can
//!   write the database) is not acted on by the leader.
//!
//! Each runs a real `gpuci server` against the test GitHub, without an agent: what is asserted
//! is what the coordinator answered and recorded, not what ran.

use super::*;
use std::io::{Read, Write};
use std::net::TcpStream;

/// A coordinator for `gh` (the one pool, `forks = "allow"`: no fork check to ask GitHub) with
/// `limits` added to `[github]`.
fn server(gh: &TestGitHub, dir: &tempfile::TempDir, limits: &str) -> Server {
    let config = write_config(dir.path(), gh, "forks = \"allow\"", "1h", None, &dir.path().join("actions-runner"));
    let text = std::fs::read_to_string(&config).unwrap();
    // Keys of `[github]` go before its first `[[github.pool]]`.
    let text = text.replacen("\n[[github.pool]]", &format!("{limits}\n\n[[github.pool]]"), 1);
    std::fs::write(&config, text).unwrap();
    let args = ["--heartbeat", "200ms", "--lost-after", "30s", "--config", &config.display().to_string()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let server = Server::start_on(&dir.path().join("server"), "127.0.0.1:0", args);
    gh.set_webhook_url(&format!("{}/api/v1/github/webhook", server.url));
    server
}

fn test_github(rt: &tokio::runtime::Runtime) -> TestGitHub {
    let gh = rt.block_on(TestGitHub::start(Options {
        webhook_secret: SECRET.into(),
        app_id: APP_ID,
        app_public_key_pem: Some(std::fs::read_to_string(fixture("test-app-key.pub.pem")).unwrap()),
        ..Options::default()
    }));
    gh.add_repo(REPO, 31);
    gh
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Opens a webhook POST announcing `length` bytes, with `headers`, and sends `first` of them.
fn start_post(server: &Server, headers: &[(&str, &str)], length: usize, first: &[u8]) -> TcpStream {
    start_post_to(server.url.trim_start_matches("http://"), headers, length, first)
}

/// As [`start_post`], to the coordinator at `address` (`host:port`).
pub(crate) fn start_post_to(address: &str, headers: &[(&str, &str)], length: usize, first: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(address).unwrap();
    // Bounds every wait below: a server that never answers fails the test, it does not hang it.
    s.set_read_timeout(Some(T)).unwrap();
    s.set_write_timeout(Some(T)).unwrap();
    let mut head = format!(
        "POST /api/v1/github/webhook HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(first).unwrap();
    s
}

/// The response's status line and headers, as the server sent them so far; "" when it closed
/// or said nothing within `T`.
pub(crate) fn response_head(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// GitHub's cap on a webhook body, and the coordinator's.
const MAX_BODY: usize = 25 << 20;

/// Sends the rest of a body, 1 MiB at a time; whether all of it went.
fn send_rest(s: &mut TcpStream, mut left: usize) -> bool {
    let chunk = vec![b' '; 1 << 20];
    while left > 0 {
        let n = left.min(chunk.len());
        if s.write_all(&chunk[..n]).is_err() {
            return false;
        }
        left -= n;
    }
    s.flush().is_ok()
}

#[test]
fn webhook_bodies_that_cannot_be_signed_deliveries_are_refused_unread_and_stalled_ones_cut_off() {
    let rt = runtime();
    let gh = test_github(&rt);
    let dir = tempdir();
    let server = server(&gh, &dir, "webhook_max_bodies = 2\nwebhook_read_timeout = \"4s\"");
    let big = 20 << 20;
    let first = vec![b' '; 64 << 10];
    let delivery = [("X-GitHub-Event", "push"), ("X-GitHub-Delivery", "d-big")];

    // Thirty parallel 20 MB bodies without a signature (the attack took a coordinator from
    // 52 MB to 830 MB): each answered 401 after the first 64 KiB, the rest never taken.
    let mut unsigned: Vec<TcpStream> = (0..30).map(|_| start_post(&server, &delivery, big, &first)).collect();
    for (i, s) in unsigned.iter_mut().enumerate() {
        let head = response_head(s);
        assert!(head.starts_with("HTTP/1.1 401"), "unsigned body {i}: answered before it was sent: {head:?}");
    }
    assert!(!send_rest(&mut unsigned[0], big - first.len()), "the server took the rest of a refused body");
    let forged_form = [("X-Hub-Signature-256", "sha256=zz"), delivery[0], delivery[1]];
    let head = response_head(&mut start_post(&server, &forged_form, big, &first));
    assert!(head.starts_with("HTTP/1.1 401"), "a malformed signature: {head:?}");
    let well_formed = format!("sha256={}", "0".repeat(64));
    let no_event = [("X-Hub-Signature-256", well_formed.as_str()), ("X-GitHub-Delivery", "d-x")];
    let head = response_head(&mut start_post(&server, &no_event, big, &first));
    assert!(head.starts_with("HTTP/1.1 400"), "no X-GitHub-Event: {head:?}");

    // Senders with made-up (well-formed) signatures that announce a body and send nothing
    // hold no room: a real delivery still gets in (when room was counted per body, eight
    // such connections kept every real delivery out: outsider finding).
    let signed_form = [("X-Hub-Signature-256", well_formed.as_str()), delivery[0], delivery[1]];
    let idle: Vec<TcpStream> = (0..12).map(|_| start_post(&server, &signed_form, 1000, b"")).collect();
    let (code, text) = rt.block_on(gh.send_event("star", json!({"action": "created"})));
    assert_eq!(code, 202, "a real delivery beside 12 silent ones: {text}");
    drop(idle);

    // Bodies that could be signed take room as they arrive, two bodies' worth (25 MB each)
    // here: two that send almost all of theirs and stall hold it, a third is told to come back
    // later, and the stalled ones are cut off.
    let most = MAX_BODY - 1;
    let mut stalled: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = start_post(&server, &signed_form, MAX_BODY, b"{");
            assert!(send_rest(&mut s, most - 1), "the server took a body that could be signed");
            s
        })
        .collect();
    let body = br#"{"zen":"third"}"#;
    let deadline = std::time::Instant::now() + T;
    let busy = loop {
        let head = response_head(&mut start_post(&server, &signed_form, body.len(), body));
        if head.starts_with("HTTP/1.1 503") || std::time::Instant::now() > deadline {
            break head;
        }
        // The stalled two may not have been admitted yet: the third's forged signature is 401.
        assert!(head.starts_with("HTTP/1.1 401"), "{head:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(busy.starts_with("HTTP/1.1 503"), "a third body while two are read: {busy:?}");
    assert!(busy.to_ascii_lowercase().contains("\r\nretry-after: "), "{busy:?}");
    for (i, s) in stalled.iter_mut().enumerate() {
        let head = response_head(s);
        assert!(head.starts_with("HTTP/1.1 408"), "stalled body {i}: {head:?}");
    }
    // The room is free again: a real delivery is taken.
    let (code, text) = rt.block_on(gh.send_event("star", json!({"action": "created"})));
    assert_eq!(code, 202, "{text}");
}

/// A push body as GitHub signs it, for `sha` on `main`.
pub(crate) fn push_body(sha: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "ref": "refs/heads/main",
        "before": "0000000000000000000000000000000000000000",
        "after": sha,
        "created": true,
        "deleted": false,
        "repository": {"id": 1, "name": "gpu", "full_name": REPO, "owner": {"login": "octo"}, "default_branch": "main"},
        "pusher": {"name": "octo"},
        "sender": {"login": "octo"},
        "installation": {"id": 31},
        "head_commit": {"id": sha, "message": "a commit", "author": {"name": "Octo", "username": "octo"}}
    }))
    .unwrap()
}

#[test]
fn a_signed_push_body_replayed_under_a_fresh_delivery_id_runs_its_pipeline_once() {
    let rt = runtime();
    let gh = test_github(&rt);
    let (first, second) = ("5555555555555555555555555555555555555555", "6666666666666666666666666666666666666666");
    gh.set_tree(REPO, first, &[(".gpuci.yml", "steps:\n  - key: first\n    command: \"true\"\n")]);
    gh.set_tree(REPO, second, &[(".gpuci.yml", "steps:\n  - key: second\n    command: \"true\"\n")]);
    let dir = tempdir();
    let server = server(&gh, &dir, "");
    let body = push_body(first);
    let signature = gpuci_github_testserver::sign_webhook(SECRET, &body);
    let send = |event: &str, delivery: &str| rt.block_on(gh.send_raw(event, &body, Some(&signature), delivery));

    let (code, text) = send("push", "p-1");
    assert_eq!(code, 202, "the push: {text}");
    let (code, text) = send("push", "p-2");
    assert_eq!(code, 200, "the same signed body under a fresh delivery id: {text}");
    assert!(text.contains("duplicate") && text.contains("p-1"), "{text}");
    let (code, text) = send("pull_request", "p-3");
    assert_eq!(code, 400, "the body under another event name is not that event: {text}");
    let (code, text) = send("push", "p-1");
    assert_eq!(code, 200, "GitHub's redelivery (the same id) is known as one: {text}");

    // Deliveries are acted on in order: once the next push's pipeline is there, the replays
    // have been seen.
    assert_eq!(rt.block_on(gh.push(REPO, "main", second)), 202);
    let api = server.api();
    let deadline = std::time::Instant::now() + T;
    let jobs = loop {
        let jobs: Vec<gpuci_protocol::api::JobSummary> = api.get("/api/v1/jobs");
        if jobs.iter().any(|j| j.step_key == "second") || std::time::Instant::now() > deadline {
            break jobs;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(jobs.iter().filter(|j| j.step_key == "second").count(), 1, "{jobs:#?}");
    assert_eq!(jobs.iter().filter(|j| j.step_key == "first").count(), 1, "the first push's pipeline, once: {jobs:#?}");
}

/// A `workflow_job` delivery for job `id` of the pool's labels.
pub(crate) fn workflow_job(action: &str, id: u64) -> Value {
    let done = action == "completed";
    json!({
        "action": action,
        "workflow_job": {
            "id": id, "run_id": id + 1000, "name": "late", "status": action,
            "conclusion": if done { json!("cancelled") } else { Value::Null },
            "labels": ["self-hosted", "gpu"], "runner_id": null, "runner_name": null,
            "runner_group_id": null, "runner_group_name": null,
            "head_sha": "0123456789abcdef0123456789abcdef01234567", "workflow_name": "ci", "head_branch": "main"
        },
        "repository": {"id": 1, "name": "gpu", "full_name": REPO, "owner": {"login": "octo"}, "private": false},
        "sender": {"login": "octo"},
        "installation": {"id": 31}
    })
}

#[test]
fn a_workflow_job_that_ended_before_its_queued_delivery_arrived_gets_no_runner() {
    let rt = runtime();
    let gh = test_github(&rt);
    let dir = tempdir();
    let server = server(&gh, &dir, "");
    // GitHub does not promise order (and a delivery a standby queued is acted on later): the
    // job was cancelled, or started on another runner, before gpuci heard it was queued.
    for (id, ended) in [(900201, "completed"), (900202, "in_progress")] {
        let (code, text) = rt.block_on(gh.send_event("workflow_job", workflow_job(ended, id)));
        assert_eq!(code, 202, "{text}");
        let (code, text) = rt.block_on(gh.send_event("workflow_job", workflow_job("queued", id)));
        assert_eq!(code, 202, "{text}");
    }
    // Acted on in order: once a later job has its record, the late ones were seen.
    let later = rt.block_on(gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "true", true));
    assert_eq!(later.status, 202);
    let api = server.api();
    let deadline = std::time::Instant::now() + T;
    let records = loop {
        let records: Vec<Value> = api.get("/api/v1/github/jobs");
        if records.iter().any(|r| r["id"] == json!(later.job_id)) || std::time::Instant::now() > deadline {
            break records;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let ids: Vec<&Value> = records.iter().map(|r| &r["id"]).collect();
    assert_eq!(ids, vec![&json!(later.job_id)], "only the live job has a record: {records:#?}");
    // The live job's runner job follows its record.
    let jobs = loop {
        let jobs: Vec<gpuci_protocol::api::JobSummary> = api.get("/api/v1/jobs");
        if !jobs.is_empty() || std::time::Instant::now() > deadline {
            break jobs;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(jobs.len(), 1, "one runner job, for the live workflow job: {jobs:#?}");
}

/// Regression (outsider attack, third round): a database writer inserted a made-up
/// `workflow_job` delivery into `github_inbox` (the queue standbys fill for the leader) and the
/// leader acted on it: a runner job for a workflow job GitHub never sent. The leader checks a
/// queued body's signature again; a row without one, or with one the webhook secret did not
/// make, is dropped.
#[test]
fn a_delivery_written_into_the_inbox_without_githubs_signature_is_not_acted_on() {
    let rt = runtime();
    let gh = test_github(&rt);
    let dir = tempdir();
    let server = server(&gh, &dir, "");
    let db = dir.path().join("server").join("gpuci.db");
    let zeros = format!("sha256={}", "0".repeat(64));
    let forged = [(900301u64, None), (900302, Some(zeros.as_str()))];
    rt.block_on(async {
        let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&db).busy_timeout(Duration::from_secs(10));
        let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts).await.expect("database");
        for (id, signature) in forged {
            sqlx::query(
                "INSERT INTO github_inbox (delivery, event, body, received_at_ms, signature) VALUES (?, 'workflow_job', ?, 1, ?)",
            )
            .bind(format!("forged-{id}"))
            .bind(workflow_job("queued", id).to_string().into_bytes())
            .bind(signature)
            .execute(&mut conn)
            .await
            .expect("forged row");
        }
    });
    let live = rt.block_on(gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "true", true));
    assert_eq!(live.status, 202);
    let api = server.api();
    let inbox_empty = || {
        rt.block_on(async {
            let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&db).busy_timeout(Duration::from_secs(10));
            let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts).await.expect("database");
            let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM github_inbox").fetch_one(&mut conn).await.unwrap();
            n == 0
        })
    };
    wait_until("the leader to take the inbox", T, inbox_empty);
    let deadline = std::time::Instant::now() + T;
    let records = loop {
        let records: Vec<Value> = api.get("/api/v1/github/jobs");
        if records.iter().any(|r| r["id"] == json!(live.job_id)) || std::time::Instant::now() > deadline {
            break records;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let ids: Vec<&Value> = records.iter().map(|r| &r["id"]).collect();
    assert_eq!(ids, vec![&json!(live.job_id)], "only the job GitHub sent has a record: {records:#?}");
}
