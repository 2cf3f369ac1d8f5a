//! Transfers cut off by a coordinator failover, against a loopback server that misbehaves
//! the way a dying leader or a standby does: a connection dropped mid-body, a 503.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use crate::follow::Current;
use crate::transfer_retry::{outcome_after_uploads, LostArtifact, Policy};
use crate::workspace::UploadSource;
use gpuci_core::artifacts::ArtifactSpec;
use gpuci_core::job::{JobState, Outcome};
use gpuci_protocol::api::{ArtifactInfo, ArtifactInputs};
use sha2::{Digest, Sha256};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the server does with one request.
#[derive(Clone, Debug)]
enum Reply {
    /// Reads the whole body, keeps it (a PUT), answers `status` with `body`.
    Answer(u16, Vec<u8>),
    /// Reads this many bytes of the request body, then drops the connection (the leader died).
    CutRequest(usize),
    /// Reads this many bytes of the request body, then holds the connection open without
    /// reading or answering (a frozen leader: SIGSTOP, a VM paused).
    Freeze(usize),
    /// Answers 200 with a Content-Length of `body`, sends `sent` bytes of it, drops the connection.
    CutResponse { body: Vec<u8>, sent: usize },
}

/// One request the server saw: method, target (path and query), and, for a request read
/// whole and answered 2xx, its body.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    target: String,
    stored: Option<Vec<u8>>,
}

type Script = dyn Fn(&str, &str, usize) -> Reply + Send + Sync;

struct Server {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    /// Starts a server on 127.0.0.1:0 that answers each request by `script(method, target, n)`,
    /// `n` counting earlier requests with the same method and target.
    async fn start(script: impl Fn(&str, &str, usize) -> Reply + Send + Sync + 'static) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let script: Arc<Script> = Arc::new(script);
        let s = seen.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, script.clone(), s.clone()));
            }
        });
        Server { url, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn count(&self, method: &str) -> usize {
        self.seen().iter().filter(|s| s.method == method).count()
    }

    /// The PUTs stored (answered 2xx): target, size and sha256 of the body.
    fn stored(&self) -> Vec<(String, usize, String)> {
        self.seen()
            .into_iter()
            .filter_map(|s| Some((s.target, s.stored.as_ref()?.len(), sha256(s.stored.as_ref()?))))
            .collect()
    }
}

async fn serve(mut conn: TcpStream, script: Arc<Script>, seen: Arc<Mutex<Vec<Seen>>>) {
    let mut buf = Vec::new();
    let head_end = loop {
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut words = head.split_whitespace();
    let (method, target) = (words.next().unwrap().to_string(), words.next().unwrap().to_string());
    let length: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
        .unwrap_or(0);
    let n = seen.lock().unwrap().iter().filter(|s| s.method == method && s.target == target).count();
    let reply = script(&method, &target, n);
    let mut body = buf[head_end..].to_vec();
    let want = match reply {
        Reply::CutRequest(at) | Reply::Freeze(at) => at.min(length),
        _ => length,
    };
    while body.len() < want {
        let mut chunk = vec![0u8; 64 << 10];
        let n = conn.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    let mut record = Seen { method, target, stored: None };
    match reply {
        Reply::Freeze(_) => {
            seen.lock().unwrap().push(record);
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        Reply::CutRequest(_) => {
            seen.lock().unwrap().push(record);
            // Unread bytes in the socket: the kernel answers with a reset, as for a killed leader.
            drop(conn);
        }
        Reply::Answer(status, answer) => {
            if (200..300).contains(&status) {
                record.stored = Some(body);
            }
            seen.lock().unwrap().push(record);
            let head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                answer.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(&answer).await;
            let _ = conn.shutdown().await;
        }
        Reply::CutResponse { body: answer, sent } => {
            seen.lock().unwrap().push(record);
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                answer.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(&answer[..sent]).await;
            let _ = conn.flush().await;
            drop(conn);
        }
    }
}

fn error(message: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "error": message })).unwrap()
}

fn stored_answer(path: &str, data: &[u8]) -> Vec<u8> {
    serde_json::to_vec(&ArtifactInfo {
        job_id: 7,
        path: path.into(),
        size: data.len() as u64,
        sha256: sha256(data),
        created_at_ms: 0,
        note: None,
    })
    .unwrap()
}

fn sha256(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// 300 KiB that are not all the same byte: a body cut anywhere is told from the whole.
fn payload() -> Vec<u8> {
    (0..300u32 << 10).map(|i| (i % 251) as u8).collect()
}

fn source(url: &str, cache: &std::path::Path) -> UploadSource {
    UploadSource::new(Current::new(url), "agent-1", "credential", cache.to_path_buf()).unwrap()
}

/// The rules of `Policy::DEFAULT` in milliseconds, for a server that never recovers.
const SHORT: Policy = Policy {
    first: Duration::from_millis(2),
    max: Duration::from_millis(10),
    total: Duration::from_millis(300),
    stall: Duration::from_millis(300),
};

/// The job's log, as lines.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn sink(&self) -> impl Fn(String) + Send + Sync {
        let l = self.0.clone();
        move |line| l.lock().unwrap().push(line)
    }
    fn text(&self) -> String {
        self.0.lock().unwrap().join("\n")
    }
}

fn spec(paths: &[&str]) -> ArtifactSpec {
    ArtifactSpec { paths: paths.iter().map(|p| p.to_string()).collect(), when: Default::default() }
}

const PUT_TARGET: &str = "/api/v1/jobs/7/artifact-upload?path=dist%2Fout.bin";

/// A workspace with `dist/out.bin` = [`payload`].
fn workspace() -> tempfile::TempDir {
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir(ws.path().join("dist")).unwrap();
    std::fs::write(ws.path().join("dist/out.bin"), payload()).unwrap();
    ws
}

/// Issue: an artifact upload cut off by a failover (the leader killed mid-body) was lost,
/// and the job stayed green. Now it is sent again, whole, and stored once.
#[tokio::test]
async fn an_upload_cut_off_mid_body_is_sent_again_and_stored_once() {
    let data = payload();
    let answer = stored_answer("dist/out.bin", &data);
    let server = Server::start(
        move |_, _, n| if n == 0 { Reply::CutRequest(100 << 10) } else { Reply::Answer(201, answer.clone()) },
    )
    .await;
    let (ws, cache) = (workspace(), tempfile::tempdir().unwrap());
    let src = source(&server.url, cache.path());
    let log = Log::default();
    let sink = log.sink();
    let lost = crate::artifacts_http::upload(
        7,
        "artifacts",
        &spec(&["dist/*.bin"]),
        1 << 30,
        Some(&src),
        ws.path(),
        true,
        &sink,
    )
    .await;
    assert_eq!(
        server.stored(),
        vec![(PUT_TARGET.to_string(), data.len(), sha256(&data))],
        "stored once, whole; log:\n{}",
        log.text()
    );
    assert_eq!(lost, vec![], "nothing lost: the step stays green");
    assert!(log.text().contains("uploaded 1 file(s)"), "{}", log.text());
}

/// A standby answers 503 until it leads: the upload waits for it.
#[tokio::test]
async fn an_upload_answered_503_by_a_standby_is_sent_again() {
    let data = payload();
    let answer = stored_answer("dist/out.bin", &data);
    let server = Server::start(move |_, _, n| match n {
        0 | 1 => Reply::Answer(503, error("this coordinator is a standby")),
        _ => Reply::Answer(201, answer.clone()),
    })
    .await;
    let (ws, cache) = (workspace(), tempfile::tempdir().unwrap());
    let src = source(&server.url, cache.path());
    let log = Log::default();
    let sink = log.sink();
    crate::artifacts_http::upload(7, "artifacts", &spec(&["dist/*.bin"]), 1 << 30, Some(&src), ws.path(), true, &sink)
        .await;
    assert_eq!(server.stored(), vec![(PUT_TARGET.to_string(), data.len(), sha256(&data))], "log:\n{}", log.text());
    assert_eq!(server.count("PUT"), 3);
}

/// A cap (413) is the coordinator's final word: not sent again, and the job is not failed
/// for it (today's behaviour).
#[tokio::test]
async fn an_upload_over_a_cap_is_not_sent_again() {
    let server = Server::start(|_, _, _| Reply::Answer(413, error("artifact dist/out.bin: over the job's cap"))).await;
    let (ws, cache) = (workspace(), tempfile::tempdir().unwrap());
    let src = source(&server.url, cache.path());
    let log = Log::default();
    let sink = log.sink();
    let lost = crate::artifacts_http::upload(
        7,
        "artifacts",
        &spec(&["dist/*.bin"]),
        1 << 30,
        Some(&src),
        ws.path(),
        true,
        &sink,
    )
    .await;
    assert_eq!(server.count("PUT"), 1, "log:\n{}", log.text());
    assert_eq!(lost, vec![], "a cap does not fail the step");
    assert!(log.text().contains("over the job's cap"), "{}", log.text());
}

fn inputs_listing(data: &[u8]) -> Vec<u8> {
    let info = ArtifactInfo {
        job_id: 3,
        path: "dist/in.bin".into(),
        size: data.len() as u64,
        sha256: sha256(data),
        created_at_ms: 0,
        note: None,
    };
    serde_json::to_vec(&ArtifactInputs { files: vec![info], notes: vec![] }).unwrap()
}

/// Issue: an `artifacts_from:` download cut off by a failover failed the job; at the new
/// leader it would have worked. Now the file is fetched again from its start and checked.
#[tokio::test]
async fn an_input_download_cut_off_mid_body_is_fetched_again_and_checked() {
    let data = payload();
    let (listing, blob) = (inputs_listing(&data), data.clone());
    let server = Server::start(move |_, target, n| match (target.ends_with("/artifact-inputs"), n) {
        (true, 0) => Reply::Answer(503, error("this coordinator is a standby")),
        (true, _) => Reply::Answer(200, listing.clone()),
        (false, 0) => Reply::CutResponse { body: blob.clone(), sent: 120 << 10 },
        (false, _) => Reply::Answer(200, blob.clone()),
    })
    .await;
    let (ws, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let src = source(&server.url, cache.path());
    let log = Log::default();
    let sink = log.sink();
    let r = crate::artifacts_http::fetch_inputs(7, Some(&src), ws.path(), &sink).await;
    assert_eq!(r, Ok(()), "the job starts; log:\n{}", log.text());
    assert_eq!(std::fs::read(ws.path().join("dist/in.bin")).unwrap(), data, "the whole file, once");
    assert_eq!(server.count("GET"), 4);
}

/// The workspace upload (`gpuci run`'s tarball) too: cut off once, fetched again, checked.
#[tokio::test]
async fn a_workspace_download_cut_off_mid_body_is_fetched_again() {
    let data = payload();
    let id = sha256(&data);
    let blob = data.clone();
    let server = Server::start(move |_, _, n| match n {
        0 => Reply::CutResponse { body: blob.clone(), sent: 50 << 10 },
        1 => Reply::Answer(502, error("bad gateway")),
        _ => Reply::Answer(200, blob.clone()),
    })
    .await;
    let cache = tempfile::tempdir().unwrap();
    let src = source(&server.url, cache.path());
    let path = src.fetch(&id).await.unwrap();
    assert_eq!(std::fs::read(path).unwrap(), data);
    assert_eq!(server.count("GET"), 3);
    let left: Vec<_> = std::fs::read_dir(cache.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 1, "no partial download left behind: {left:?}");
}

/// A coordinator that stays unreachable or failing past the bound: the artifact is lost, the
/// job's log says which and why, and a step that succeeded fails.
#[tokio::test]
async fn an_upload_that_keeps_failing_is_lost_and_fails_the_step() {
    let server = Server::start(|_, _, n| {
        if n % 2 == 0 {
            Reply::CutRequest(10 << 10)
        } else {
            Reply::Answer(503, error("this coordinator is a standby"))
        }
    })
    .await;
    let (ws, cache) = (workspace(), tempfile::tempdir().unwrap());
    std::fs::write(ws.path().join("dist/two.bin"), b"second").unwrap();
    let mut src = source(&server.url, cache.path());
    src.retry = SHORT;
    let log = Log::default();
    let sink = log.sink();
    let lost = crate::artifacts_http::upload(
        7,
        "artifacts",
        &spec(&["dist/*.bin"]),
        1 << 30,
        Some(&src),
        ws.path(),
        true,
        &sink,
    )
    .await;
    assert!(server.stored().is_empty());
    assert!(server.count("PUT") > 2, "tried again before giving up: {}", server.count("PUT"));
    let mut tried: Vec<String> = server.seen().into_iter().map(|s| s.target).collect();
    tried.dedup();
    assert_eq!(tried.len(), 1, "after one file is lost the others are not sent (each would wait as long): {tried:?}");
    assert_eq!(lost.len(), 1, "log:\n{}", log.text());
    let first = &lost[0].path;
    let text = log.text();
    assert!(text.contains(&format!("{first:?} was NOT stored")) && text.contains("the step fails"), "{text}");
    assert!(text.contains("1 NOT stored") && text.contains("stopped"), "{text}");
    let (state, reason) = outcome_after_uploads(Outcome::Exited { code: 0 }, &lost).verdict();
    assert_eq!(state, JobState::Failed);
    assert!(reason.contains(first.as_str()) && reason.contains("not stored"), "{reason}");
}

/// A file refused for itself (a symlink) keeps today's behaviour: logged, the step not failed.
#[tokio::test]
async fn a_file_refused_by_the_collection_rules_does_not_fail_the_step() {
    let server = Server::start(|_, _, _| Reply::Answer(503, error("unused"))).await;
    let (ws, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    std::os::unix::fs::symlink("/etc/passwd", ws.path().join("out.bin")).unwrap();
    let src = source(&server.url, cache.path());
    let log = Log::default();
    let sink = log.sink();
    let lost: Vec<LostArtifact> =
        crate::artifacts_http::upload(7, "artifacts", &spec(&["*.bin"]), 1 << 30, Some(&src), ws.path(), true, &sink)
            .await;
    assert_eq!(lost, vec![]);
    assert_eq!(server.count("PUT"), 0);
    assert!(log.text().contains("refused"), "{}", log.text());
}

/// An input download that keeps failing fails the job's start, naming the artifact; a 410
/// (deleted) is not tried again.
#[tokio::test]
async fn an_input_download_that_keeps_failing_or_is_gone_fails_the_start() {
    let data = payload();
    let listing = inputs_listing(&data);
    let blob = data.clone();
    let server = Server::start(move |_, target, _| {
        if target.ends_with("/artifact-inputs") {
            Reply::Answer(200, listing.clone())
        } else {
            Reply::CutResponse { body: blob.clone(), sent: 1000 }
        }
    })
    .await;
    let (ws, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut src = source(&server.url, cache.path());
    src.retry = SHORT;
    let log = Log::default();
    let sink = log.sink();
    let e = crate::artifacts_http::fetch_inputs(7, Some(&src), ws.path(), &sink).await.unwrap_err();
    assert!(e.contains("\"dist/in.bin\"") && e.contains("cut off"), "{e}");
    assert!(server.count("GET") > 3, "tried again: {}", server.count("GET"));

    let listing = inputs_listing(&data);
    let server = Server::start(move |_, target, _| {
        if target.ends_with("/artifact-inputs") {
            Reply::Answer(200, listing.clone())
        } else {
            Reply::Answer(410, error("artifact was deleted"))
        }
    })
    .await;
    let ws = tempfile::tempdir().unwrap();
    let src = source(&server.url, cache.path());
    let e = crate::artifacts_http::fetch_inputs(7, Some(&src), ws.path(), &sink).await.unwrap_err();
    assert!(e.contains("410"), "{e}");
    assert_eq!(server.count("GET"), 2, "the listing and one try of the file");
}

/// The workspace upload's 410 (collected) is final and keeps its own error.
#[tokio::test]
async fn a_workspace_upload_that_is_gone_is_not_tried_again() {
    let server = Server::start(|_, _, _| Reply::Answer(410, error("upload was collected"))).await;
    let cache = tempfile::tempdir().unwrap();
    let src = source(&server.url, cache.path());
    let id = sha256(b"x");
    let e = src.fetch(&id).await.unwrap_err();
    assert!(matches!(e, crate::workspace::WorkspaceError::Gone { .. }), "{e:?}");
    assert_eq!(server.count("GET"), 1);
}

/// A frozen leader keeps the connection open and reads nothing (TCP keeps probing its zero
/// window). The body's lack of progress ends the try, and the next one is stored.
#[tokio::test]
async fn an_upload_to_a_frozen_coordinator_is_cut_and_sent_again() {
    // Larger than the loopback socket buffers, so the body cannot all be sent while frozen.
    let data: Vec<u8> = (0..48u32 << 20).map(|i| (i % 253) as u8).collect();
    let answer = stored_answer("big.bin", &data);
    let server = Server::start(move |_, _, n| match n {
        0 => Reply::Freeze(1 << 20),
        _ => Reply::Answer(201, answer.clone()),
    })
    .await;
    let (ws, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    std::fs::write(ws.path().join("big.bin"), &data).unwrap();
    let mut src = source(&server.url, cache.path());
    src.retry = Policy { stall: Duration::from_millis(500), total: Duration::from_secs(60), ..SHORT };
    let log = Log::default();
    let sink = log.sink();
    let lost =
        crate::artifacts_http::upload(7, "artifacts", &spec(&["big.bin"]), 1 << 30, Some(&src), ws.path(), true, &sink)
            .await;
    assert_eq!(lost, vec![], "log:\n{}", log.text());
    let target = "/api/v1/jobs/7/artifact-upload?path=big.bin".to_string();
    assert_eq!(server.stored(), vec![(target, data.len(), sha256(&data))]);
    assert_eq!(server.count("PUT"), 2);
    assert!(log.text().contains("no progress"), "{}", log.text());
}
