//! Bytes that change or vanish between the coordinator and its S3 bucket (`[blobs] backend =
//! "s3"`). Regressions (outsider attack, through a proxy in front of S3):
//!
//! - a `PutObject` body with a byte flipped on the way was stored as good: the producing job
//!   went green and its consumers failed "does not match its sha256". Now every body carries
//!   its `Content-MD5`, S3 refuses a body that does not match it, and the upload answers 503
//!   with nothing recorded;
//! - an S3 that answered 200 to a put without storing lost the artifact silently: the row
//!   named a missing blob (downloads 410). Now a put is checked (the object there, at its
//!   size): 503, nothing recorded;
//! - bytes changed on the S3 side were served with 200 and their full length. Now a download
//!   that does not hash to its name is cut off short of its `Content-Length`.
//!
//! A real coordinator (in process, on 127.0.0.1:0) against moto's S3 server through an HTTP
//! proxy of this test that flips a byte of a put's body, answers a `PutObject` with 200
//! without passing it on, or flips a byte of a `GetObject`'s answer. moto does not verify
//! `Content-MD5`; the proxy does, as S3 does (400 `BadDigest`), on every request it passes,
//! so a wrong digest from the coordinator fails the passing uploads too. The job and its agent
//! are written straight to the coordinator's database: only the blob endpoints are under test.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "../../aws/tests/common/moto.rs"]
mod moto;

use gpuci_core::job::JobState;
use gpuci_core::pipeline::Step;
use gpuci_store::{AgentRecord, NewJob, NewPipeline, SqliteStore, Store};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Turns a hang into a failure; far above the bounds the coordinator sets itself.
const HANG_GUARD: Duration = Duration::from_secs(90);

const PASS: u8 = 0;
/// Flip the first byte of every `PutObject` and `UploadPart` body.
const CORRUPT_PUT: u8 = 1;
/// Answer every `PutObject` with 200 and an ETag, and store nothing.
const LIE_PUT: u8 = 2;
/// Flip the first byte of every object `GetObject` answers with.
const CORRUPT_GET: u8 = 3;

/// An HTTP proxy to moto that misbehaves as its mode says, one request per connection.
struct Proxy {
    url: String,
    mode: Arc<AtomicU8>,
}

impl Proxy {
    fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let mode = Arc::new(AtomicU8::new(PASS));
        let (target, m) = (target.to_string(), mode.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let (target, m) = (target.clone(), m.clone());
                std::thread::spawn(move || serve(client, &target, m.load(Ordering::SeqCst)));
            }
        });
        Proxy { url, mode }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
    }
}

fn header_of<'a>(head: &'a [String], name: &str) -> Option<&'a str> {
    head.iter().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// A request's head lines (the request line first) and its body.
fn read_request(client: &mut BufReader<TcpStream>) -> Option<(Vec<String>, Vec<u8>)> {
    let mut head = Vec::new();
    loop {
        let mut line = String::new();
        if client.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let line = line.trim_end().to_string();
        if line.is_empty() {
            break;
        }
        head.push(line);
    }
    assert!(header_of(&head, "transfer-encoding").is_none(), "the proxy reads Content-Length bodies only: {head:?}");
    if header_of(&head, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue")) {
        client.get_mut().write_all(b"HTTP/1.1 100 Continue\r\n\r\n").ok()?;
    }
    let length: usize = header_of(&head, "content-length").map_or(0, |v| v.parse().unwrap());
    let mut body = vec![0; length];
    client.read_exact(&mut body).ok()?;
    Some((head, body))
}

/// `head` without its `Connection` lines, with `Connection: close`, and the blank line.
fn closing(head: &[&str]) -> String {
    let mut out = String::new();
    for l in head.iter().filter(|l| !l.is_empty() && !l.to_ascii_lowercase().starts_with("connection:")) {
        out.push_str(l);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    out
}

fn serve(client: TcpStream, target: &str, mode: u8) {
    let mut client = BufReader::new(client);
    let Some((head, mut body)) = read_request(&mut client) else { return };
    let mut words = head[0].split(' ');
    let (method, path) = (words.next().unwrap_or_default().to_string(), words.next().unwrap_or_default().to_string());
    let object = path.contains("/artifacts/") || path.contains("/uploads/");
    let answer = |status: &str, extra: &str, text: &str| {
        format!("HTTP/1.1 {status}\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{text}", text.len())
            .into_bytes()
    };
    let md5 = |b: &[u8]| {
        use base64::Engine;
        use md5::Digest;
        base64::engine::general_purpose::STANDARD.encode(md5::Md5::digest(b))
    };
    if method == "PUT" && object && mode == CORRUPT_PUT && !body.is_empty() {
        body[0] ^= 0xff;
    }
    let out = if method == "PUT" && object && mode == LIE_PUT && !path.contains("partNumber=") {
        answer("200 OK", "ETag: \"d41d8cd98f00b204e9800998ecf8427e\"\r\n", "")
    } else if header_of(&head, "content-md5").is_some_and(|sent| sent != md5(&body)) {
        // What S3 does with a body that does not match its Content-MD5 (moto does not).
        answer(
            "400 Bad Request",
            "Content-Type: application/xml\r\n",
            "<Error><Code>BadDigest</Code><Message>The Content-MD5 you specified did not match what we \
             received.</Message></Error>",
        )
    } else {
        let mut up = TcpStream::connect(target).unwrap();
        let lines: Vec<&str> = head.iter().map(String::as_str).collect();
        up.write_all(closing(&lines).as_bytes()).unwrap();
        up.write_all(&body).unwrap();
        let mut response = Vec::new();
        let _ = up.read_to_end(&mut response);
        let split = response.windows(4).position(|w| w == b"\r\n\r\n").map_or(response.len(), |p| p + 4);
        let (rhead, rbody) = response.split_at(split);
        let mut rbody = rbody.to_vec();
        let text = String::from_utf8_lossy(rhead).into_owned();
        if method == "GET" && object && mode == CORRUPT_GET && text.starts_with("HTTP/1.1 200") && !rbody.is_empty() {
            rbody[0] ^= 0xff;
        }
        let mut out = closing(&text.split("\r\n").collect::<Vec<_>>()).into_bytes();
        out.extend_from_slice(&rbody);
        out
    };
    let _ = client.get_mut().write_all(&out);
}

/// A raw, unsigned S3 request to moto, the test's own look at the bucket: its status line.
fn s3(m: &moto::Moto, method: &str, path: &str) -> String {
    let addr = m.url.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: AWS4-HMAC-SHA256 Credential=test/20260101/{}/s3/aws4_request, SignedHeaders=host, Signature=0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        moto::REGION
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    String::from_utf8_lossy(&out).lines().next().unwrap_or_default().to_string()
}

/// One HTTP/1.1 request to the coordinator: (status, Content-Length, the body bytes that
/// came before the connection closed); status 0 when it closed before a whole head. Off the async threads: the coordinator runs in this
/// test's runtime.
async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Option<usize>, Vec<u8>) {
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
        // Whatever came before the close (or a reset): a cut-off body is the point.
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    panic!("{what}: no answer within {HANG_GUARD:?}")
                }
                Err(_) => break,
            }
        }
        // The connection closed before a whole head: status 0 (a download cut off before its
        // first chunk sends nothing at all).
        let Some(split) = out.windows(4).position(|w| w == b"\r\n\r\n") else { return (0, None, out) };
        let head = String::from_utf8_lossy(&out[..split]).into_owned();
        let status = head.get(9..12).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{what}: {head}"));
        let length = head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length").then(|| v.trim().parse().unwrap())
        });
        (status, length, out[split + 4..].to_vec())
    })
    .await
    .unwrap()
}

const AGENT: [(&str, &str); 2] =
    [("authorization", "Bearer agent-credential-for-the-test"), ("x-gpuci-agent-id", "agent-1")];

/// A coordinator on S3 behind the proxy, an agent and the job it holds.
struct Setup {
    m: moto::Moto,
    bucket: &'static str,
    proxy: Proxy,
    dir: std::path::PathBuf,
    db: SqliteStore,
    addr: std::net::SocketAddr,
    job: i64,
    token: String,
    shutdown: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

async fn setup(test: &str, bucket: &'static str) -> Option<Setup> {
    let m = moto::start(test)?;
    let made = s3(&m, "PUT", &format!("/{bucket}"));
    assert!(made.starts_with("HTTP/1.1 200"), "{made}");
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
    let dir = std::env::temp_dir().join(format!("gpuci-blobs-integrity-{}", uuid::Uuid::new_v4()));
    let mut config = gpuci_coordinator::Config::new("127.0.0.1:0".parse().unwrap(), dir.clone());
    config.blobs = gpuci_coordinator::blobs::BlobsConfig::S3(gpuci_aws::s3::S3Settings {
        bucket: bucket.into(),
        prefix: "ci".into(),
        endpoint: Some(proxy.url.clone()),
        region: moto::REGION.into(),
        path_style: true,
        profile: None,
        credentials_file: None,
    });
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = gpuci_coordinator::start(config, shutdown.clone()).await.unwrap();
    let db = SqliteStore::open(&dir.join("gpuci.db")).await.unwrap();
    db.insert_agent(&AgentRecord {
        id: "agent-1".into(),
        name: "agent-1".into(),
        credential_hash: gpuci_coordinator::auth::hash("agent-credential-for-the-test"),
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
    let job = jobs[0].id;
    db.assign_job(job, "agent-1", &[], gpuci_coordinator::brain::now_ms()).await.unwrap();
    let token = format!("Bearer {}", running.api_token.expose());
    Some(Setup { m, bucket, proxy, dir, db, addr: running.addr, job, token, shutdown, task: running.task })
}

impl Setup {
    async fn put(&self, path: &str, body: &[u8]) -> (u16, String) {
        let url = format!("/api/v1/jobs/{}/artifact-upload?path={path}", self.job);
        let (status, _, body) = http(self.addr, "PUT", &url, &AGENT, body).await;
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    async fn post_upload(&self, gz: &[u8]) -> (u16, String) {
        let headers = [("authorization", self.token.as_str()), ("content-type", "application/gzip")];
        let (status, _, body) = http(self.addr, "POST", "/api/v1/uploads", &headers, gz).await;
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    async fn get(&self, path: &str) -> (u16, Option<usize>, Vec<u8>) {
        http(self.addr, "GET", path, &[("authorization", self.token.as_str())], b"").await
    }

    async fn recorded(&self) -> Vec<String> {
        self.db.job_artifacts(self.job).await.unwrap().into_iter().map(|a| a.path).collect()
    }

    /// moto's status line for the object `namespace/name` (the test's own look).
    fn in_bucket(&self, namespace: &str, name: &str) -> String {
        s3(&self.m, "HEAD", &format!("/{}/ci/{namespace}/{name}", self.bucket))
    }

    async fn end(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn sha(b: &[u8]) -> String {
    hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b))
}

/// An empty gzip stream and `n` bytes after it (the coordinator checks the magic only):
/// distinct bytes per `n`.
fn gz(n: usize) -> Vec<u8> {
    let mut b = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    b.extend((0..n).map(|i| i as u8));
    b
}

/// 9 MiB of every byte value: a multipart upload of two parts.
fn big(seed: u8) -> Vec<u8> {
    (0..(9usize << 20)).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_corrupted_or_dropped_on_the_way_to_s3_are_refused_with_503_and_never_recorded() {
    let Some(s) = setup("artifact uploads to a corrupting S3", "gpuci-integrity-put").await else { return };

    // Passing: stored and recorded, in one part and in two (the proxy checks every
    // Content-MD5 it is sent, so a wrong one would be refused here).
    let (status, body) = s.put("a.txt", b"stored while S3 is fine").await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = s.put("big.bin", &big(0)).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = s.post_upload(&gz(1)).await;
    assert_eq!(status, 201, "{body}");

    // A byte flipped on the way: S3 refuses the body, the coordinator answers 503 (the agent
    // sends it again) and records nothing; the corrupt bytes are stored under no name.
    s.proxy.set(CORRUPT_PUT);
    let flipped = b"flipped on the way to S3";
    let (status, body) = s.put("b.txt", flipped).await;
    assert_eq!(status, 503, "a corrupted body was stored as good: {body}");
    assert!(body.contains("the artifact store is unavailable") && body.contains("BadDigest"), "{body}");
    let (status, body) = s.put("c.bin", &big(1)).await;
    assert_eq!(status, 503, "a corrupted part was stored as good: {body}");
    assert_eq!(s.recorded().await, ["a.txt", "big.bin"], "a row for a blob whose bytes were corrupted");
    assert!(s.in_bucket("artifacts", &sha(flipped)).contains(" 404"), "the corrupt bytes were stored");
    assert!(s.in_bucket("artifacts", &sha(&big(1))).contains(" 404"), "the corrupt bytes were stored");
    let (status, body) = s.post_upload(&gz(2)).await;
    assert_eq!(status, 503, "a corrupted workspace upload was stored as good: {body}");
    assert!(s.in_bucket("uploads", &format!("{}.tar.gz", sha(&gz(2)))).contains(" 404"));

    // An S3 that answers 200 and stores nothing: the write is checked, 503, nothing recorded
    // (regression: the row named a missing blob and downloads answered 410).
    s.proxy.set(LIE_PUT);
    let (status, body) = s.put("d.txt", b"answered 200, never stored").await;
    assert_eq!(status, 503, "an artifact S3 never stored was recorded: {body}");
    assert!(body.contains("not there"), "{body}");
    assert_eq!(s.recorded().await, ["a.txt", "big.bin"], "a row for a blob S3 never stored");
    let (status, body) = s.post_upload(&gz(3)).await;
    assert_eq!(status, 503, "a workspace upload S3 never stored was answered as stored: {body}");

    // S3 fine again: the agent's retry lands, whole.
    s.proxy.set(PASS);
    let (status, body) = s.put("b.txt", flipped).await;
    assert_eq!(status, 201, "{body}");
    let (status, _, got) = s.get(&format!("/api/v1/jobs/{}/artifact?path=b.txt", s.job)).await;
    assert_eq!((status, got.as_slice()), (200, &flipped[..]));
    s.end().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_changed_in_s3_are_never_served_as_a_whole_200() {
    let Some(s) = setup("artifact downloads from a corrupting S3", "gpuci-integrity-get").await else { return };
    let text = b"stored whole, read back changed";
    let (status, body) = s.put("a.txt", text).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = s.put("big.bin", &big(2)).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = s.post_upload(&gz(4)).await;
    assert_eq!(status, 201, "{body}");
    let upload = format!("/api/v1/uploads/{}", sha(&gz(4)));
    let artifact = |p: &str| format!("/api/v1/jobs/{}/artifact?path={p}", s.job);
    // Read back whole while S3 is fine.
    assert_eq!(s.get(&artifact("a.txt")).await, (200, Some(text.len()), text.to_vec()));
    let (status, _, got) = s.get(&artifact("big.bin")).await;
    assert_eq!((status, sha(&got)), (200, sha(&big(2))));
    assert_eq!(s.get(&upload).await, (200, Some(gz(4).len()), gz(4)));

    // S3 answers with a byte flipped: the response is cut short of its Content-Length (the
    // client sees a broken transfer), never the whole of the wrong bytes. An object of one
    // chunk is cut before anything goes out: the connection closes with no answer at all.
    s.proxy.set(CORRUPT_GET);
    for (what, path, whole) in [
        ("small artifact", artifact("a.txt"), text.len()),
        ("large artifact", artifact("big.bin"), 9 << 20),
        ("workspace upload", upload.clone(), gz(4).len()),
    ] {
        let (status, length, got) = s.get(&path).await;
        match status {
            0 => assert!(got.is_empty(), "{what}: {got:?}"),
            _ => {
                assert_eq!((status, length), (200, Some(whole)), "{what}");
                assert!(got.len() < whole, "{what}: changed bytes served whole ({} of {whole})", got.len());
            }
        }
    }
    // The 9 MiB artifact streams: its first chunks go out before the end is hashed.
    let (status, _, got) = s.get(&artifact("big.bin")).await;
    assert_eq!(status, 200, "a large download is cut in its body, after its head");
    assert!(!got.is_empty() && got.len() < 9 << 20, "{} bytes", got.len());
    s.end().await;
}
