//! A real EC2-API server for tests: `moto_server` (PyPI `moto`) on 127.0.0.1, and a small
//! proxy in front of it that answers chosen `RunInstances` calls with EC2's own error
//! responses (capacity, quota, throttling), as EC2 sends them. Shared by the aws crate's tests
//! and the system tests (`#[path]`), so the two never drift apart.
//!
//! moto is found as `GPUCI_MOTO_SERVER`, on `PATH`, or in the virtualenv `./scripts/test` makes
//! (`/var/tmp/gpuci-moto/bin/moto_server`). Without it a test skips, saying so, except with
//! `CI=true`, where it fails.

#![allow(dead_code)]
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const REGION: &str = "us-east-1";

/// A running moto_server; killed on drop.
pub struct Moto {
    child: Child,
    pub url: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn find() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GPUCI_MOTO_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("moto_server"))
        .chain([PathBuf::from("/var/tmp/gpuci-moto/bin/moto_server")])
        .find(|p| p.is_file())
}

/// A fresh moto_server, or `None` (with a message) where moto is not installed and CI is not set.
pub fn start(test: &str) -> Option<Moto> {
    let Some(program) = find() else {
        let msg = format!("{test}: needs moto_server (pip install 'moto[server]'; ./scripts/test installs it)");
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("{msg} (CI=true: tests must not be skipped)");
        }
        eprintln!("SKIP {msg}");
        return None;
    };
    // A port of our own: bind, note, release, then moto binds it (retried on a clash).
    for _ in 0..5 {
        let port = TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let mut child = Command::new(&program)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            if get_ok(port, "/moto-api/") {
                return Some(Moto { child, url });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("{test}: moto_server did not start");
}

fn get_ok(port: u16, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.") && &head[9..12] == b"200"
}

/// One canned EC2 error: `RunInstances` requests whose form body contains every one of
/// `when` get `status` with `code`.
#[derive(Clone, Debug)]
pub struct Fault {
    pub when: Vec<String>,
    pub status: u16,
    pub code: String,
}

impl Fault {
    pub fn capacity(when: &[&str]) -> Fault {
        Fault {
            when: when.iter().map(|s| s.to_string()).collect(),
            status: 500,
            code: "InsufficientInstanceCapacity".into(),
        }
    }
}

/// The proxy: forwards every request to moto, except `RunInstances` calls a [`Fault`]
/// matches. Counts what it saw. Stops when dropped (its thread ends with the process; the
/// listener is closed by then).
pub struct FaultProxy {
    pub url: String,
    pub faults: Arc<Mutex<Vec<Fault>>>,
    /// Form bodies of the `RunInstances` calls seen, faulted or not.
    pub run_instances: Arc<Mutex<Vec<String>>>,
}

impl FaultProxy {
    pub fn start(moto: &Moto, faults: Vec<Fault>) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let upstream = moto.url.trim_start_matches("http://").to_string();
        let faults = Arc::new(Mutex::new(faults));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (f, s) = (faults.clone(), seen.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (f, s, up) = (f.clone(), s.clone(), upstream.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &up, &f, &s);
                });
            }
        });
        FaultProxy { url, faults, run_instances: seen }
    }

    pub fn run_instances_calls(&self) -> usize {
        self.run_instances.lock().unwrap().len()
    }
}

/// One request per connection (answered with `Connection: close`), read whole.
fn serve(
    mut conn: TcpStream,
    upstream: &str,
    faults: &Mutex<Vec<Fault>>,
    seen: &Mutex<Vec<String>>,
) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = conn.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 1 << 20 {
            return Ok(());
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let length: usize = head
        .lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("content-length")))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = conn.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = String::from_utf8_lossy(&buf[head_end..]).to_string();
    if body.contains("Action=RunInstances") {
        seen.lock().unwrap().push(body.clone());
        let fault = faults.lock().unwrap().iter().find(|f| f.when.iter().all(|w| body.contains(w.as_str()))).cloned();
        if let Some(f) = fault {
            let xml = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Response><Errors><Error><Code>{}</Code><Message>injected by the test proxy</Message></Error></Errors><RequestID>fault-1</RequestID></Response>",
                f.code
            );
            let reason = match f.status {
                400 => "Bad Request",
                503 => "Service Unavailable",
                _ => "Internal Server Error",
            };
            conn.write_all(
                format!(
                    "HTTP/1.1 {} {reason}\r\nContent-Type: text/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{xml}",
                    f.status,
                    xml.len()
                )
                .as_bytes(),
            )?;
            return Ok(());
        }
    }
    // Forwarded as it came, but one request per connection.
    let mut up = TcpStream::connect(upstream)?;
    let head =
        head.lines().filter(|l| !l.to_ascii_lowercase().starts_with("connection:")).collect::<Vec<_>>().join("\r\n");
    let head = format!("{}\r\nConnection: close\r\n\r\n", head.trim_end());
    up.write_all(head.as_bytes())?;
    up.write_all(&buf[head_end..])?;
    let mut answer = Vec::new();
    up.read_to_end(&mut answer)?;
    conn.write_all(&answer)?;
    Ok(())
}

/// `aws ec2` calls for checks the provider does not make itself, through moto's own query API
/// (form-encoded, unsigned: moto does not check signatures but needs the scope in a header).
pub fn query(moto: &Moto, params: &[(&str, &str)]) -> String {
    query_service(moto, "ec2", "2016-11-15", params)
}

/// [`query`] for another service of the same server (`iam`, version `2010-05-08`).
pub fn query_service(moto: &Moto, service: &str, version: &str, params: &[(&str, &str)]) -> String {
    let body: String = params
        .iter()
        .chain([("Version", version)].iter())
        .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
        .collect::<Vec<_>>()
        .join("&");
    let addr = moto.url.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).expect("moto");
    let req = format!(
        "POST / HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/x-www-form-urlencoded\r\nAuthorization: AWS4-HMAC-SHA256 Credential=test/20260101/{REGION}/{service}/aws4_request, SignedHeaders=host, Signature=0\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The text of the first `<tag>…</tag>` in `xml`.
pub fn xml_text<'a>(xml: &'a str, tag: &str) -> Option<&'a str> {
    let open = format!("<{tag}>");
    let start = xml.find(&open)? + open.len();
    let end = xml[start..].find(&format!("</{tag}>"))? + start;
    Some(&xml[start..end])
}
