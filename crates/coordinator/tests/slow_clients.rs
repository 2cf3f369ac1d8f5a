//! A client cannot hold the leader's connections by never finishing a request: a request head
//! that never ends, a connection that sends nothing, and a body that stops half way are each
//! closed or answered (`serve.rs`), and the API keeps answering meanwhile.
//!
//! Before, the leader served with no timer at all: each such connection stayed open (with its
//! file descriptor) for as long as the client kept it, so enough of them left the coordinator
//! unable to accept an agent.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Comfortably past the server's 30 s deadlines; what is asserted is that the connection
/// ends, not how fast.
const ENDS_WITHIN: Duration = Duration::from_secs(90);

/// Reads until the server closes the connection (or resets it); what it said on the way.
async fn until_closed(mut s: TcpStream) -> Result<String, String> {
    let mut got = Vec::new();
    let read = tokio::time::timeout(ENDS_WITHIN, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let text = String::from_utf8_lossy(&got).into_owned();
    match read {
        Ok(()) => Ok(text),
        Err(_) => Err(format!("still open after {ENDS_WITHIN:?}; it said {text:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_finish_a_request_are_closed_and_the_api_still_answers() {
    let dir = std::env::temp_dir().join(format!("gpuci-slow-clients-{}", uuid::Uuid::new_v4()));
    let config = gpuci_coordinator::Config::new("127.0.0.1:0".parse().unwrap(), dir.clone());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = gpuci_coordinator::start(config, shutdown.clone()).await.unwrap();
    let addr = running.addr;
    let token = running.api_token.expose().to_string();

    // Sends nothing at all.
    let silent = TcpStream::connect(addr).await.unwrap();
    // Half a request head, then nothing.
    let mut half_head = TcpStream::connect(addr).await.unwrap();
    half_head.write_all(b"GET /api/v1/jobs HTTP/1.1\r\nHost: gpuci\r\n").await.unwrap();
    // A whole head of an authenticated submit that promises 1,000 bytes of body and sends 10.
    let mut half_body = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /api/v1/pipelines HTTP/1.1\r\nHost: gpuci\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"file_nam"
    );
    half_body.write_all(head.as_bytes()).await.unwrap();

    // Meanwhile the API answers others.
    // As gpuci's clients do: an idle connection is not kept past the server's idle close.
    let http = reqwest::Client::builder().pool_idle_timeout(gpuci_protocol::CLIENT_POOL_IDLE).build().unwrap();
    let listed = http.get(format!("{}/api/v1/jobs", running.url)).bearer_auth(&token).send().await.unwrap();
    assert!(listed.status().is_success(), "{}", listed.status());

    let (silent, half_head, half_body) =
        tokio::join!(until_closed(silent), until_closed(half_head), until_closed(half_body));
    assert_eq!(silent, Ok(String::new()), "a connection that sent nothing");
    let half_head = half_head.expect("a connection with half a request head");
    assert!(!half_head.contains("200 OK"), "{half_head}");
    // The stalled body fails the request (its answer, if the connection could carry one, is
    // a client error), and the connection ends.
    let half_body = half_body.expect("a request whose body stopped");
    assert!(half_body.is_empty() || half_body.starts_with("HTTP/1.1 4"), "{half_body}");

    // And after all that, the API still answers.
    let listed = http.get(format!("{}/api/v1/jobs", running.url)).bearer_auth(&token).send().await.unwrap();
    assert!(listed.status().is_success(), "{}", listed.status());
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), running.task).await;
    let _ = std::fs::remove_dir_all(&dir);
}
