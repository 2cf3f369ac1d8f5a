//! One simulated agent: registers once, connects over the real agent protocol (WebSocket,
//! `Hello`, heartbeats, numbered job events re-sent until acknowledged), and runs every job it
//! is given for `--job-secs` (a start at once, an exit 0 then). Reconnects with the real
//! agent's backoff when its coordinator goes away.

use futures::{SinkExt, StreamExt};
use gpuci_core::gpu::GpuInfo;
use gpuci_protocol::agent::{AgentMessage, CoordinatorMessage, Hello, JobEvent, JobFinished};
use gpuci_protocol::JobId;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

/// An agent's registration.
#[derive(Clone)]
pub struct Ident {
    pub agent_id: String,
    pub credential: String,
    pub name: String,
}

/// What every simulated agent reports into.
#[derive(Default)]
pub struct Shared {
    /// Agents welcomed on their current connection.
    pub connected: AtomicUsize,
    /// Connections that ended (the coordinator went away, or refused).
    pub disconnects: AtomicUsize,
    /// Assignments received: job and when.
    pub assigned: Mutex<Vec<(JobId, Instant)>>,
    /// Assignments for a job this process was already given (must stay 0).
    pub duplicates: AtomicU64,
    /// Why the last connection attempt failed, for the progress lines.
    pub last_error: Mutex<Option<String>>,
}

/// The GPUs an agent announces: `gpus` simulated H100s, unique per agent.
pub fn inventory(name: &str, gpus: u32) -> anyhow::Result<Vec<GpuInfo>> {
    Ok(gpuci_gpu::SimulatedGpus::from_spec(&format!("{gpus}xH100-80GB"), name)?.gpus().to_vec())
}

pub fn hello(ident: &Ident, gpus: &[GpuInfo], paused: bool, running: Vec<JobId>) -> Hello {
    Hello {
        protocol: gpuci_protocol::PROTOCOL_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").into(),
        name: ident.name.clone(),
        hostname: ident.name.clone(),
        slots: gpus.len() as u32,
        tags: BTreeMap::new(),
        gpus: gpus.to_vec(),
        gpu_backend: "simulated".into(),
        isolation: "none".into(),
        container_runtime: None,
        running,
        journal_incomplete: None,
        paused: paused.then(|| "gpuci-loadgen: waiting until every job is queued".to_string()),
        interrupted: None,
        ends_at_ms: None,
        refuses: None,
    }
}

fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(86_400)
}

fn now_us() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

#[allow(clippy::too_many_arguments)]
/// Runs one agent until `stop`: connects from `source` (a loopback address of its own, so that
/// tens of thousands of connections do not run out of one address's ports), re-connects
/// with backoff, and takes jobs once `go` is true.
pub async fn run(
    ident: Ident,
    gpus: Vec<GpuInfo>,
    server: SocketAddr,
    source: IpAddr,
    shared: std::sync::Arc<Shared>,
    mut go: tokio::sync::watch::Receiver<bool>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    job_time: Duration,
) {
    // Events not acknowledged yet, re-sent on every new connection (as the real agent's outbox).
    let mut outbox: Vec<(u64, JobEvent)> = Vec::new();
    let mut next_n = 1u64;
    let mut seen = std::collections::HashSet::new();
    // Jobs started and not finished yet: when each finishes, and when it started (us).
    let mut running: Vec<(tokio::time::Instant, JobId, i64)> = Vec::new();
    let mut backoff = Duration::from_millis(100);
    loop {
        if *stop.borrow() {
            return;
        }
        let ended = session(
            &ident,
            &gpus,
            server,
            source,
            &shared,
            &mut go,
            &mut stop,
            &mut outbox,
            &mut next_n,
            &mut seen,
            &mut running,
            job_time,
        )
        .await;
        match ended {
            Ok(true) => return,
            Ok(false) => backoff = Duration::from_millis(100),
            Err(e) => {
                *shared.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{e:#}"));
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
        // Jitter, as many agents losing one coordinator must not come back in one instant.
        let jitter = Duration::from_millis(u64::from(ident.name.bytes().fold(0u8, |a, b| a.wrapping_add(b))) % 100);
        tokio::select! {
            _ = tokio::time::sleep(backoff + jitter) => {}
            _ = stop.changed() => return,
        }
    }
}

/// One connection. `Ok(true)`: told to stop; `Ok(false)`: the coordinator went away.
#[allow(clippy::too_many_arguments)]
async fn session(
    ident: &Ident,
    gpus: &[GpuInfo],
    server: SocketAddr,
    source: IpAddr,
    shared: &Shared,
    go: &mut tokio::sync::watch::Receiver<bool>,
    stop: &mut tokio::sync::watch::Receiver<bool>,
    outbox: &mut Vec<(u64, JobEvent)>,
    next_n: &mut u64,
    seen: &mut std::collections::HashSet<JobId>,
    running: &mut Vec<(tokio::time::Instant, JobId, i64)>,
    job_time: Duration,
) -> anyhow::Result<bool> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source, 0))?;
    let stream = tokio::time::timeout(Duration::from_secs(30), socket.connect(server)).await??;
    let mut req = format!("ws://{server}/api/v1/agents/connect").into_client_request()?;
    req.headers_mut().insert("authorization", format!("Bearer {}", ident.credential).parse()?);
    req.headers_mut().insert("x-gpuci-agent-id", ident.agent_id.parse()?);
    let (ws, _) = tokio::time::timeout(Duration::from_secs(30), tokio_tungstenite::client_async(req, stream)).await??;
    let (mut sink, mut stream) = ws.split();
    let mut held: Vec<JobId> = outbox
        .iter()
        .filter_map(|(_, e)| match e {
            JobEvent::Finished(f) => Some(f.job_id),
            _ => None,
        })
        .collect();
    held.extend(running.iter().map(|r| r.1));
    let hello = hello(ident, gpus, !*go.borrow(), held);
    sink.send(Message::Text(serde_json::to_string(&AgentMessage::Hello(Box::new(hello)))?.into())).await?;
    let heartbeat = match tokio::time::timeout(Duration::from_secs(60), stream.next()).await? {
        Some(Ok(Message::Text(t))) => match serde_json::from_str::<CoordinatorMessage>(&t)? {
            CoordinatorMessage::Welcome { heartbeat_interval_ms, .. } => Duration::from_millis(heartbeat_interval_ms),
            CoordinatorMessage::Refused { reason } => anyhow::bail!("refused: {reason}"),
            other => anyhow::bail!("expected a welcome, got {other:?}"),
        },
        other => anyhow::bail!("expected a welcome, got {other:?}"),
    };
    for (n, event) in outbox.iter() {
        let m = AgentMessage::Event { n: *n, event: event.clone() };
        sink.feed(Message::Text(serde_json::to_string(&m)?.into())).await?;
    }
    sink.flush().await?;
    shared.connected.fetch_add(1, Ordering::Relaxed);
    let _guard = Disconnect(shared);
    let mut tick = tokio::time::interval(heartbeat);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = stop.changed() => {
                let _ = sink.close().await;
                return Ok(true);
            }
            Ok(()) = go.changed() => {
                if *go.borrow() {
                    sink.send(Message::Text(serde_json::to_string(&AgentMessage::Paused { reason: None })?.into())).await?;
                }
            }
            _ = tick.tick() => sink.send(Message::Text(serde_json::to_string(&AgentMessage::Heartbeat)?.into())).await?,
            _ = tokio::time::sleep_until(running.iter().map(|r| r.0).min().unwrap_or_else(far_future)), if !running.is_empty() => {
                let now = tokio::time::Instant::now();
                let (done, still): (Vec<_>, Vec<_>) = running.drain(..).partition(|r| r.0 <= now);
                *running = still;
                for (_, job_id, started) in done {
                    let finished = JobEvent::Finished(JobFinished {
                        job_id,
                        outcome: gpuci_core::job::Outcome::Exited { code: 0 },
                        finished_at_us: now_us(),
                        started_at_us: Some(started),
                        lines: Some(0),
                        telemetry: None,
                        gpu_health: BTreeMap::new(),
                    });
                    let m = AgentMessage::Event { n: *next_n, event: finished.clone() };
                    outbox.push((*next_n, finished));
                    *next_n += 1;
                    sink.feed(Message::Text(serde_json::to_string(&m)?.into())).await?;
                }
                sink.flush().await?;
            }
            msg = stream.next() => match msg {
                Some(Ok(Message::Text(t))) => match serde_json::from_str::<CoordinatorMessage>(&t)? {
                    CoordinatorMessage::Assign(a) => {
                        let at = Instant::now();
                        if !seen.insert(a.job_id) {
                            shared.duplicates.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        shared.assigned.lock().unwrap_or_else(|e| e.into_inner()).push((a.job_id, at));
                        let t = now_us();
                        let started = JobEvent::Started { job_id: a.job_id, pid: 1, started_at_us: t, unenforced: vec![] };
                        let m = AgentMessage::Event { n: *next_n, event: started.clone() };
                        outbox.push((*next_n, started));
                        *next_n += 1;
                        sink.send(Message::Text(serde_json::to_string(&m)?.into())).await?;
                        running.push((tokio::time::Instant::now() + job_time, a.job_id, t));
                    }
                    CoordinatorMessage::Acked { upto } => outbox.retain(|(n, _)| *n > upto),
                    CoordinatorMessage::Refused { reason } => anyhow::bail!("refused: {reason}"),
                    _ => {}
                },
                Some(Ok(Message::Close(_))) | None => return Ok(false),
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(_)) => {}
            }
        }
    }
}

/// Counts a welcomed connection's end, however it ends.
struct Disconnect<'a>(&'a Shared);

impl Drop for Disconnect<'_> {
    fn drop(&mut self) {
        self.0.connected.fetch_sub(1, Ordering::Relaxed);
        self.0.disconnects.fetch_add(1, Ordering::Relaxed);
    }
}
