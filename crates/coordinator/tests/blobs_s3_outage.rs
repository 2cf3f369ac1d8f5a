//! The coordinator's HTTP answers when its S3 bucket (`[blobs] backend = "s3"`) goes silent
//! or away after start. Regression (outsider attack): with S3 hung, an artifact upload was
//! held for minutes and the artifact dropped while the job went green. Now every store and
//! read of a blob is bounded (`gpuci_aws::s3`), and the coordinator answers **503** with
//! "the artifact store is unavailable: <S3's words>" — which the agent sends again — and
//! records nothing for an artifact whose blob did not land.
//!
//! A real coordinator (in process, on 127.0.0.1:0) against moto's S3 server through a proxy
//! of this test that passes, goes silent (accepts and never answers), or closes its port.
//! The job and its agent are written straight to the coordinator's database: only the
//! artifact endpoints are under test. No elapsed time is asserted; a generous guard only
//! turns a hang into a failure.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "../../aws/tests/common/moto.rs"]
mod moto;

use gpuci_core::job::JobState;
use gpuci_core::pipeline::Step;
use gpuci_store::{AgentRecord, NewJob, NewPipeline, SqliteStore, Store};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Turns a hang into a failure; far above the bounds the coordinator sets itself.
const HANG_GUARD: Duration = Duration::from_secs(90);

const PASS: u8 = 0;
const SILENT: u8 = 1;
const CLOSED: u8 = 2;

/// A TCP proxy to `target` whose mode the test switches: pass bytes both ways, hold every
/// connection without a byte (old ones too), or close its port (refused from then on).
struct Proxy {
    url: String,
    mode: Arc<AtomicU8>,
}

impl Proxy {
    fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let mode = Arc::new(AtomicU8::new(PASS));
        let (target, m) = (target.to_string(), mode.clone());
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while m.load(Ordering::SeqCst) != CLOSED {
                match listener.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        if m.load(Ordering::SeqCst) == SILENT {
                            held.push(client);
                            continue;
                        }
                        let upstream = TcpStream::connect(&target).unwrap();
                        pipe(client.try_clone().unwrap(), upstream.try_clone().unwrap(), m.clone());
                        pipe(upstream, client, m.clone());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
            // The listener is dropped here: its port refuses connections now.
        });
        Proxy { url, mode }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
        // The accept loop sees CLOSED within its next poll.
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Copies `from` to `to` while the proxy passes; silent, it keeps both open and sends
/// nothing more; closed, it drops both.
fn pipe(mut from: TcpStream, mut to: TcpStream, mode: Arc<AtomicU8>) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            match mode.load(Ordering::SeqCst) {
                PASS => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                SILENT => continue,
                _ => break,
            }
        }
        if mode.load(Ordering::SeqCst) == SILENT {
            // Held open, silent, until the test ends.
            std::thread::sleep(Duration::from_secs(600));
        }
        let _ = to.shutdown(std::net::Shutdown::Both);
    });
}

/// A raw, unsigned S3 request to moto: the test's own hand on the bucket.
fn s3(m: &moto::Moto, method: &str, path: &str) -> String {
    let addr = m.url.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: AWS4-HMAC-SHA256 Credential=test/20260101/{}/s3/aws4_request, SignedHeaders=host, Signature=0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        moto::REGION
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn make_bucket(m: &moto::Moto, name: &str) {
    let out = s3(m, "PUT", &format!("/{name}"));
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
}

/// One HTTP/1.1 request to the coordinator; (status, body). Off the async threads: the
/// coordinator runs in this test's runtime.
async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    let what = format!("{method} {path}");
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(HANG_GUARD)).unwrap();
        s.write_all(&bytes).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap_or_else(|e| panic!("{what}: no answer ({e})"));
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{what}: {text}"));
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body)
    })
    .await
    .unwrap()
}

/// The coordinator's message: one line, S3's words in it, no `Debug` of the SDK's types.
fn assert_unavailable(what: &str, status: u16, body: &str, store: &str) {
    assert_eq!(status, 503, "{what}: {body}");
    let message = serde_json::from_str::<serde_json::Value>(body).unwrap_or_else(|_| panic!("{what}: {body}"))["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: {body}"))
        .to_string();
    assert!(message.starts_with(&format!("the {store} store is unavailable: ")), "{what}: {message}");
    assert!(!message.contains('\n'), "{what}: {message}");
    for debug in ["DispatchFailure {", "ConnectorError {", "Some(", "source:"] {
        assert!(!message.contains(debug), "{what}: a Debug dump: {message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_or_gone_bucket_answers_503_with_the_cause_and_records_nothing() {
    let Some(m) = moto::start("artifact uploads with S3 down") else { return };
    make_bucket(&m, "gpuci-outage");
    let proxy = Proxy::start(m.url.trim_start_matches("http://"));
    // The standard AWS chain, pinned to the environment (no shared files, no instance metadata).
    for (k, v) in [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
        ("AWS_CONFIG_FILE", "/dev/null"),
        ("AWS_SHARED_CREDENTIALS_FILE", "/dev/null"),
    ] {
        std::env::set_var(k, v);
    }
    let dir = std::env::temp_dir().join(format!("gpuci-blobs-outage-{}", uuid::Uuid::new_v4()));
    let mut config = gpuci_coordinator::Config::new("127.0.0.1:0".parse().unwrap(), dir.clone());
    config.blobs = gpuci_coordinator::blobs::BlobsConfig::S3(gpuci_aws::s3::S3Settings {
        bucket: "gpuci-outage".into(),
        prefix: "ci".into(),
        endpoint: Some(proxy.url.clone()),
        region: moto::REGION.into(),
        path_style: true,
        profile: None,
        credentials_file: None,
    });
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = gpuci_coordinator::start(config, shutdown.clone()).await.unwrap();
    let addr = running.addr;

    // An agent and the job it holds, straight into the coordinator's database.
    let db = SqliteStore::open(&dir.join("gpuci.db")).await.unwrap();
    let credential = "agent-credential-for-the-test";
    db.insert_agent(&AgentRecord {
        id: "agent-1".into(),
        name: "agent-1".into(),
        credential_hash: gpuci_coordinator::auth::hash(credential),
        registered_at_ms: 1,
        last_seen_ms: None,
        state: "online".into(),
        reason: String::new(),
        hello_json: None,
    })
    .await
    .unwrap();
    let job = NewJob {
        pipeline_id: 0,
        step: Step::new("build", "true"),
        env: Default::default(),
        state: JobState::Queued,
        reason: "queued".into(),
        attempt: 1,
        retry_of: None,
        created_at_ms: gpuci_coordinator::brain::now_ms(),
    };
    let p = NewPipeline {
        file_name: "ci.yml".into(),
        source: "steps: []".into(),
        workspace_upload: None,
        repository: None,
        origin: None,
        created_at_ms: gpuci_coordinator::brain::now_ms(),
    };
    let (_, jobs) = db.create_pipeline(p, vec![job]).await.unwrap();
    let id = jobs[0].id;
    db.assign_job(id, "agent-1", &[], gpuci_coordinator::brain::now_ms()).await.unwrap();
    let bearer = format!("Bearer {credential}");
    let agent = [("authorization", bearer.as_str()), ("x-gpuci-agent-id", "agent-1")];
    let token = format!("Bearer {}", running.api_token.expose());
    let api = [("authorization", token.as_str())];
    let put = |path: &'static str, body: &'static [u8]| async move {
        http(addr, "PUT", &format!("/api/v1/jobs/{id}/artifact-upload?path={path}"), &agent, body).await
    };
    let recorded = || async { db.job_artifacts(id).await.unwrap().into_iter().map(|a| a.path).collect::<Vec<_>>() };

    // S3 up: stored, recorded, read back.
    let (status, body) = put("a.txt", b"stored while S3 is up").await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = http(addr, "GET", &format!("/api/v1/jobs/{id}/artifact?path=a.txt"), &api, b"").await;
    assert_eq!((status, body.as_str()), (200, "stored while S3 is up"));
    // Recorded, but its object deleted behind gpuci's back: 410 with that reason (regression:
    // it said "deleted (retention)", which deletes the row first and answers 404).
    let (status, body) = put("gone.txt", b"deleted in the bucket by hand").await;
    assert_eq!(status, 201, "{body}");
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"deleted in the bucket by hand"));
    let deleted = s3(&m, "DELETE", &format!("/gpuci-outage/ci/artifacts/{sha}"));
    assert!(deleted.starts_with("HTTP/1.1 204"), "{deleted}");
    let (status, body) = http(addr, "GET", &format!("/api/v1/jobs/{id}/artifact?path=gone.txt"), &api, b"").await;
    assert_eq!(status, 410, "{body}");
    assert!(body.contains("removed outside gpuci's retention") && !body.contains("(retention)"), "{body}");

    // S3 silent: every S3 call times out; the upload is refused with 503, nothing recorded.
    proxy.set(SILENT);
    let gz = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let upload_headers = [("authorization", token.as_str()), ("content-type", "application/gzip")];
    let download = format!("/api/v1/jobs/{id}/artifact?path=a.txt");
    let ((status, body), (get_status, get_body), (post_status, post_body)) = tokio::join!(
        put("b.txt", b"sent while S3 is silent"),
        http(addr, "GET", &download, &api, b""),
        http(addr, "POST", "/api/v1/uploads", &upload_headers, &gz),
    );
    assert_unavailable("artifact upload, S3 silent", status, &body, "artifact");
    assert!(body.contains("timed out") && body.contains(&proxy.url), "{body}");
    assert_eq!(recorded().await, ["a.txt", "gone.txt"], "an artifact whose blob never landed is recorded");
    assert_unavailable("artifact download, S3 silent", get_status, &get_body, "artifact");
    assert_unavailable("workspace upload, S3 silent", post_status, &post_body, "workspace upload");

    // S3's port closed: refused connections, the same answer with that cause.
    proxy.set(CLOSED);
    let (status, body) = put("c.txt", b"sent while S3 is gone").await;
    assert_unavailable("artifact upload, S3 gone", status, &body, "artifact");
    assert!(body.contains(&proxy.url), "{body}");
    assert_eq!(recorded().await, ["a.txt", "gone.txt"], "an artifact whose blob never landed is recorded");
    let (status, body) = http(addr, "GET", &format!("/api/v1/jobs/{id}/artifact?path=a.txt"), &api, b"").await;
    assert_unavailable("artifact download, S3 gone", status, &body, "artifact");

    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), running.task).await;
    let _ = std::fs::remove_dir_all(&dir);
}
