//! A client cannot hold the leader's connections by never finishing a request: a request head
//! that never ends, a connection that sends nothing, and a body that stops half way are each
//! closed or answered (`serve.rs`), and the API keeps answering meanwhile.
//!
//! Before, the leader served with no timer at all: each such connection stayed open (with its
//! file descriptor) for as long as the client kept it, so enough of them left the coordinator
//! unable to accept an agent.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

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

/// A coordinator on its defaults in a data dir of its own.
async fn coordinator() -> (std::path::PathBuf, tokio_util::sync::CancellationToken, gpuci_coordinator::Running) {
    coordinator_with(None).await
}

/// A coordinator with `--max-connections-per-address` `per_address`.
async fn coordinator_with(
    per_address: Option<usize>,
) -> (std::path::PathBuf, tokio_util::sync::CancellationToken, gpuci_coordinator::Running) {
    let dir = std::env::temp_dir().join(format!("gpuci-slow-clients-{}", uuid::Uuid::new_v4()));
    let mut config = gpuci_coordinator::Config::new("127.0.0.1:0".parse().unwrap(), dir.clone());
    config.max_connections_per_address = per_address;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = gpuci_coordinator::start(config, shutdown.clone()).await.unwrap();
    (dir, shutdown, running)
}

/// An agent registered with the coordinator's registration token.
async fn register(running: &gpuci_coordinator::Running, name: &str) -> gpuci_protocol::agent::RegisterResponse {
    reqwest::Client::new()
        .post(format!("{}/api/v1/agents/register", running.url))
        .bearer_auth(running.registration_token.expose())
        .json(&serde_json::json!({ "name": name }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The request head that opens `agent`'s channel (a WebSocket upgrade).
fn channel_request(agent: &gpuci_protocol::agent::RegisterResponse) -> String {
    format!(
        "GET /api/v1/agents/connect HTTP/1.1\r\nHost: gpuci\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         x-gpuci-agent-id: {}\r\nAuthorization: Bearer {}\r\n\r\n",
        agent.agent_id, agent.credential
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_finish_a_request_are_closed_and_the_api_still_answers() {
    let (dir, shutdown, running) = coordinator().await;
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

/// Regression (outsider attack): a body trickled a byte every few seconds never paused 30 s,
/// so it kept its connection for as long as the client liked; 420 of them to the
/// unauthenticated registration endpoint left a leader limited to 400 open files answering
/// nothing for 70 s. A body must now come at 1 KiB a second on average once 30 s have passed,
/// and the registration endpoint reads no body before its token holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_is_cut_off_and_registration_reads_no_body_without_its_token() {
    let (dir, shutdown, running) = coordinator().await;
    let addr = running.addr;
    let token = running.api_token.expose().to_string();

    // No token: answered at once, whatever the body does.
    let head = "POST /api/v1/agents/register HTTP/1.1\r\nHost: gpuci\r\nContent-Type: application/json\r\n\
                Content-Length: 1000000\r\n\r\n{";
    let said = answer_before_the_body(addr, head).await;
    assert!(said.starts_with("HTTP/1.1 401"), "registration without a token: {said:?}");

    // The dashboard's login form, open to anyone: a body far larger than a form is refused
    // before it comes.
    let head = "POST /ui/login HTTP/1.1\r\nHost: gpuci\r\nContent-Type: application/x-www-form-urlencoded\r\n\
                Content-Length: 100000000\r\n\r\nuser=";
    let said = answer_before_the_body(addr, head).await;
    assert!(said.starts_with("HTTP/1.1 4"), "a login form of 100 MB: {said:?}");

    // With a token, a submit whose body comes a byte every 5 s: cut off, not held.
    let mut trickle = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /api/v1/pipelines HTTP/1.1\r\nHost: gpuci\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    );
    trickle.write_all(head.as_bytes()).await.unwrap();
    let (mut reader, mut writer) = trickle.into_split();
    let sender = tokio::spawn(async move {
        while writer.write_all(b" ").await.is_ok() {
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    });
    let mut got = Vec::new();
    let ended = tokio::time::timeout(ENDS_WITHIN, async {
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf).await {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    sender.abort();
    let said = String::from_utf8_lossy(&got);
    assert!(ended.is_ok(), "a trickled body still held its connection after {ENDS_WITHIN:?}: {said:?}");
    assert!(said.is_empty() || said.starts_with("HTTP/1.1 4"), "{said}");
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), running.task).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sends `head` (and the start of a body it never finishes); the first answer, which must
/// come within 10 s, before the rest of the body.
async fn answer_before_the_body(addr: std::net::SocketAddr, head: &str) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut answer = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut answer))
        .await
        .unwrap_or_else(|_| panic!("no answer within 10 s to {head:?}"))
        .unwrap();
    String::from_utf8_lossy(&answer[..n]).into_owned()
}

/// One address cannot take every connection: a client holding slow requests at the body floor
/// held each connection (and a file descriptor) for hours, and 450 of them left a leader with
/// 400 open files answering nobody (outsider attack). Over its share, a connection is answered
/// 503 at once and closed; other addresses are served; a connection given back makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_gets_its_share_of_connections_and_others_are_still_served() {
    const SHARE: usize = 8;
    let (dir, shutdown, running) = coordinator_with(Some(SHARE)).await;
    let addr = running.addr;
    let mut held = Vec::new();
    for _ in 0..SHARE {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // Half a head: a connection in its request, as a slow client's is.
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: gpuci\r\n").await.unwrap();
        held.push(s);
    }
    let over = TcpStream::connect(addr).await.unwrap();
    let said = until_closed(over).await.expect("the connection over the share is closed");
    assert!(said.starts_with("HTTP/1.1 503"), "{said}");
    assert!(said.contains("from your address"), "{said}");

    // Another address is served meanwhile.
    let other = reqwest::Client::builder().local_address("127.0.0.2".parse::<std::net::IpAddr>().ok()).build().unwrap();
    let r = other.get(format!("{}/healthz", running.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);

    // Given back, the share is there again.
    drop(held);
    let http = reqwest::Client::new();
    let mut status = None;
    for _ in 0..100 {
        match http.get(format!("{}/healthz", running.url)).send().await {
            Ok(r) if r.status() == 200 => {
                status = Some(200);
                break;
            }
            Ok(r) => status = Some(r.status().as_u16()),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, Some(200), "connections closed by the client are given back");
    shutdown.cancel();
    let _ = running.task.await;
    let _ = std::fs::remove_dir_all(dir);
}

/// An agent's channel counts as a client connection until its hello is accepted: sockets
/// upgraded with one agent's credential and then left silent held 370 connections from one
/// address (ten times its share) until the coordinator ran out of files (outsider attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgraded_channels_without_a_hello_count_against_their_address() {
    const SHARE: usize = 8;
    let (dir, shutdown, running) = coordinator_with(Some(SHARE)).await;
    let addr = running.addr;
    let upgrade = channel_request(&register(&running, "silent").await);
    let mut silent = Vec::new();
    for _ in 0..SHARE {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(upgrade.as_bytes()).await.unwrap();
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await.unwrap().unwrap();
        let head = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        silent.push(s);
    }
    let over = TcpStream::connect(addr).await.unwrap();
    let said = until_closed(over).await.expect("the connection over the share is closed");
    assert!(said.starts_with("HTTP/1.1 503"), "upgraded silent channels must count: {said}");
    drop(silent);
    shutdown.cancel();
    let _ = running.task.await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A channel the agent replaced by connecting again is closed by the coordinator, even when
/// its peer never answers the close: one agent's credential piled up 379 replaced channels
/// from one address, and the coordinator ran out of files (outsider attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_channel_is_closed_even_when_its_peer_never_answers() {
    let (dir, shutdown, running) = coordinator().await;
    let upgrade = channel_request(&register(&running, "twice").await);
    let hello = gpuci_protocol::agent::AgentMessage::Hello(Box::new(gpuci_protocol::agent::Hello {
        protocol: gpuci_protocol::PROTOCOL_VERSION,
        agent_version: "test".into(),
        name: "twice".into(),
        hostname: "twice".into(),
        slots: 1,
        tags: Default::default(),
        gpus: Vec::new(),
        gpu_backend: "simulated".into(),
        isolation: "none".into(),
        container_runtime: None,
        running: Vec::new(),
        journal_incomplete: None,
        paused: None,
        interrupted: None,
        ends_at_ms: None,
        refuses: None,
    }));
    let payload = serde_json::to_vec(&hello).unwrap();
    // A masked text frame (a zero mask leaves the payload as it is), as a client sends.
    let mut frame = vec![0x81, 0x80 | 126, (payload.len() >> 8) as u8, payload.len() as u8, 0, 0, 0, 0];
    frame.extend_from_slice(&payload);
    let open = || async {
        let mut s = TcpStream::connect(running.addr).await.unwrap();
        s.write_all(upgrade.as_bytes()).await.unwrap();
        s.write_all(&frame).await.unwrap();
        // The switch and the welcome.
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("welcome") {
            let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await.unwrap().unwrap();
            assert!(n > 0, "closed before the welcome: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        s
    };
    let first = open().await;
    let _second = open().await;
    // The first never answers the close it is sent; it must still be closed.
    let ended = until_closed(first).await;
    assert!(ended.is_ok(), "the replaced channel is still open: {ended:?}");
    shutdown.cancel();
    let _ = running.task.await;
    let _ = std::fs::remove_dir_all(dir);
}
