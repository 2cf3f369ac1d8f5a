//! The way a running job reaches `gpuci pipeline upload`'s endpoint: a unix socket the agent
//! serves in the job's workspace for as long as the job's process runs, forwarding each
//! request to the coordinator's `POST /api/v1/jobs/{id}/steps` for *this* job.
//!
//! Why a socket the agent serves, not the coordinator's address: a job in the slot network
//! cannot reach the host's loopback (where a coordinator often listens), a `network: none`
//! job reaches nothing, and a job should need no route to the coordinator at all. A unix
//! socket in a directory bound into the sandbox crosses network namespaces (only abstract
//! sockets belong to one), so it works with every network mode.
//!
//! What the agent forwards, and nothing else: the body (a JSON [`UploadSteps`], at most
//! [`MAX_REQUEST`] bytes) and the job's `Authorization` header, to the one endpoint of the
//! socket's own job, whatever path the request names. The credential is the job's token
//! (`GPUCI_JOB_TOKEN`), never the agent's: the coordinator decides, and the agent lends the
//! job no authority of its own. One connection at a time, each bounded in size and time.
//! The socket belongs to the job's user, in its 0700 workspace: another job's user cannot reach it.
//!
//! [`UploadSteps`]: gpuci_protocol::api::UploadSteps

use crate::workspace::UploadSource;
use gpuci_protocol::JobId;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

/// The variable naming where the job's requests go (`unix:` and the socket's path).
pub const API_URL_ENV: &str = "GPUCI_API_URL";
/// The socket's name in the workspace.
pub const SOCKET_NAME: &str = ".gpuci-agent.sock";
/// Largest request read: the coordinator's cap on a file (256 KiB), JSON-escaped, and headers.
pub const MAX_REQUEST: usize = 2 << 20;
/// How long one request may take to arrive, and the coordinator to answer.
const REQUEST_TIME: Duration = Duration::from_secs(60);
/// Longest unix socket path (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The socket of one job; dropping it stops serving and removes the socket.
pub struct StepsProxy {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for StepsProxy {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl StepsProxy {
    /// Serve job `job`'s socket at `workspace/.gpuci-agent.sock`, owned by `owner` (the job's
    /// user; `None`: the agent's own). The value for [`API_URL_ENV`] comes back with it.
    pub fn start(
        job: JobId,
        workspace: &Path,
        owner: Option<gpuci_sandbox::JobUser>,
        source: UploadSource,
    ) -> Result<(StepsProxy, String), String> {
        let path = workspace.join(SOCKET_NAME);
        if path.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(format!("the socket path {} is longer than a unix socket path may be", path.display()));
        }
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(|e| format!("binding {}: {e}", path.display()))?;
        // Given to the job's user with `lchown`, which never follows a link; no chmod by path,
        // which would (a process of the job's uid could swap the socket for a link to a host
        // file between the bind and the chmod: an outsider's finding). The workspace is 0700
        // and the job's: nobody but the job and root reaches the socket, whatever its mode.
        let owned = match owner {
            Some(u) => std::os::unix::fs::lchown(&path, Some(u.uid), Some(u.gid)),
            None => Ok(()),
        };
        if let Err(e) = owned {
            let _ = std::fs::remove_file(&path);
            return Err(format!("giving {} to the job's user: {e}", path.display()));
        }
        let task = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else { return };
                // One at a time: a job gains nothing from more, and cannot make the agent
                // hold many requests in memory.
                let _ = tokio::time::timeout(REQUEST_TIME, serve(job, conn, &source)).await;
            }
        });
        let url = format!("unix:{}", path.display());
        Ok((StepsProxy { path, task }, url))
    }
}

/// A request as read: its `Authorization` header and its body.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub authorization: Option<String>,
    pub body: Vec<u8>,
}

/// Read an HTTP/1.1 request with a `Content-Length` body from `bytes` so far; `Ok(None)`:
/// more is needed.
pub(crate) fn parse_request(bytes: &[u8]) -> Result<Option<Request>, String> {
    let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if bytes.len() > 64 << 10 { Err("request headers too long".into()) } else { Ok(None) };
    };
    let head = std::str::from_utf8(&bytes[..end]).map_err(|_| "request headers are not UTF-8".to_string())?;
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    if !request_line.starts_with("POST ") {
        return Err("only POST is served here".into());
    }
    let mut length = None;
    let mut authorization = None;
    for l in lines {
        let Some((name, value)) = l.split_once(':') else { continue };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>().map_err(|_| "bad Content-Length".to_string())?);
        } else if name.eq_ignore_ascii_case("authorization") {
            authorization = Some(value.to_string());
        }
    }
    let length = length.ok_or("a Content-Length is needed")?;
    if length > MAX_REQUEST {
        return Err(format!("the request is larger than {MAX_REQUEST} bytes"));
    }
    let body = &bytes[end + 4..];
    if body.len() < length {
        return Ok(None);
    }
    Ok(Some(Request { authorization, body: body[..length].to_vec() }))
}

fn response(status: u16, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        if status < 300 { "OK" } else { "Error" },
        body.len()
    )
    .into_bytes()
}

fn error_body(message: &str) -> String {
    serde_json::json!({ "error": message }).to_string()
}

async fn serve(job: JobId, mut conn: UnixStream, source: &UploadSource) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 << 10];
    let req = loop {
        match parse_request(&buf) {
            Ok(Some(r)) => break r,
            Ok(None) => {}
            Err(e) => {
                let _ = conn.write_all(&response(400, &error_body(&e))).await;
                return;
            }
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if buf.len() > MAX_REQUEST + (64 << 10) {
            let _ = conn.write_all(&response(413, &error_body("the request is too large"))).await;
            return;
        }
    };
    // Only to the coordinator that proves the key now: the request carries the job's token.
    let (http, base) = match source.endpoint().await {
        Ok(e) => e,
        Err(e) => {
            let answer = response(502, &error_body(&format!("the agent has no coordinator to send this to now: {e}")));
            let _ = conn.write_all(&answer).await;
            let _ = conn.shutdown().await;
            return;
        }
    };
    let url = format!("{base}/api/v1/jobs/{job}/steps");
    let mut post = http
        .post(&url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header("x-gpuci-agent-id", &source.agent_id)
        .body(req.body);
    if let Some(a) = req.authorization {
        post = post.header(reqwest::header::AUTHORIZATION, a);
    }
    let answer = match post.send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let body = resp.text().await.unwrap_or_default();
            response(status, &body)
        }
        Err(e) => response(502, &error_body(&format!("the agent could not reach the coordinator: {e}"))),
    };
    let _ = conn.write_all(&answer).await;
    let _ = conn.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_read_once_its_body_is_whole() {
        let full = b"POST /x HTTP/1.1\r\nAuthorization: Bearer t\r\ncontent-length: 4\r\n\r\nbody";
        for cut in 0..full.len() {
            assert_eq!(parse_request(&full[..cut]).unwrap(), None, "{cut}");
        }
        let r = parse_request(full).unwrap().unwrap();
        assert_eq!((r.authorization.as_deref(), r.body.as_slice()), (Some("Bearer t"), &b"body"[..]));
    }

    #[test]
    fn what_is_not_a_bounded_post_is_refused() {
        assert!(parse_request(b"GET / HTTP/1.1\r\n\r\n").is_err());
        assert!(parse_request(b"POST / HTTP/1.1\r\n\r\n").is_err(), "no length");
        let big = format!("POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n", MAX_REQUEST + 1);
        assert!(parse_request(big.as_bytes()).is_err());
        assert!(parse_request(&vec![b'a'; 70 << 10]).is_err(), "endless headers");
    }
}
