//! The leader's HTTP server: the router on HTTP/1.1 connections that a client cannot hold
//! open without sending a request.
//!
//! `axum::serve` gives hyper no timer, and without one hyper applies no header read timeout:
//! a client that opened connections and never finished a request head (or a body) held each
//! one, and its file descriptor, for ever, until the coordinator could accept no agent. Here
//! every connection has a timer: a request head must arrive within
//! [`HEADER_READ_TIMEOUT`] (also how long a kept-alive connection may sit idle between
//! requests), and a request body may pause at most [`BODY_IDLE_TIMEOUT`] between two
//! pieces and must come at [`BODY_MIN_BYTES_PER_SEC`] on average once that much time passed.
//! An agent's WebSocket, once upgraded, is the channel's (its own heartbeats bound it).
//!
//! A slow client still holds a connection (and a file descriptor) while its body comes at the
//! floor: so connections are counted, in all and by client address, from accept until they
//! end, or until an agent's channel has had its hello accepted ([`ConnCount`]); one over
//! either limit ([`ConnLimits`], decided by [`admit`]) is answered 503 and closed at once.
//! Accepted channels are not counted: they are bounded by the agents registered.
//!
//! Each request carries the connection's local address ([`LocalAddr`]) and peer address as
//! `ConnectInfo`. Must not: decide anything about a request (that is the router's).

use crate::identity::LocalAddr;
use axum::extract::ConnectInfo;
use hyper::body::{Body, Frame, SizeHint};
use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// How long a client has to send a whole request head, from the connection's start or the
/// end of its previous response (gpuci's own clients keep idle connections for less:
/// `gpuci_protocol::CLIENT_POOL_IDLE`).
pub const HEADER_READ_TIMEOUT: Duration = gpuci_protocol::REQUEST_HEAD_TIMEOUT;
/// How long a request body may send nothing before the request fails.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// After [`BODY_IDLE_TIMEOUT`], a request body must have come at this many bytes a second on
/// average since it began, or the request fails: a client that trickled a byte every few
/// seconds kept its connection (and its file descriptor) for as long as it liked (outsider
/// attack: 420 such connections to the unauthenticated registration endpoint left a leader
/// with 400 open files answering nothing for 70 s, while it kept its claim).
pub const BODY_MIN_BYTES_PER_SEC: u64 = 1024;

/// How many connections clients may hold open that are not (yet) a WebSocket: requests,
/// kept-alive connections between requests, followed logs and live pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// From every client together.
    pub total: usize,
    /// From one client address; `None`: no limit per address (a load balancer or reverse
    /// proxy in front is one address for all its clients: limit per client there).
    pub per_address: Option<usize>,
}

impl ConnLimits {
    /// For a process allowed `open_files` file descriptors: a quarter of them (at least 64)
    /// stays for the database's connections, the agents' channels and files; one client
    /// address may hold an eighth of the rest (at least 32). With 1,024 open files: 768 and
    /// 96; with 65,536: 49,152 and 6,144.
    pub fn for_open_files(open_files: u64) -> ConnLimits {
        let open_files = usize::try_from(open_files).unwrap_or(usize::MAX);
        let total = open_files.saturating_sub((open_files / 4).max(64)).max(16);
        ConnLimits { total, per_address: Some((total / 8).max(32)) }
    }
}

/// The open files this process may have, raised first to the most it is allowed (its hard
/// limit): each connection is one, and a soft limit of 1,024 (many systems' default) would
/// hold a coordinator to fewer than a thousand agents whatever its hard limit. `None`: the
/// limit is unknown.
pub fn raise_open_files() -> Option<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return Some(hard);
    }
    Some(soft)
}

/// Whether a new connection is taken, with `total` open already and `from_address` of them
/// from its client's address; the refusal says which limit it met.
pub fn admit(limits: ConnLimits, total: usize, from_address: usize) -> Result<(), String> {
    if total >= limits.total {
        return Err(format!("this coordinator holds {total} client connections, its most; try again shortly"));
    }
    match limits.per_address {
        Some(most) if from_address >= most => Err(format!(
            "{from_address} connections are open from your address, the most one address may hold; close some"
        )),
        _ => Ok(()),
    }
}

/// The connections counted now. One owner: the accept loop adds, [`Counted`] gives back.
#[derive(Default)]
struct Open {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
}

/// A request's hold on its connection's place in the count: the agents' channel keeps it
/// past the upgrade until the agent's hello is accepted, so sockets upgraded and then left
/// silent count like any other (outsider attack: one agent's credential held 370 of them from
/// one address, ten times its share, until the coordinator ran out of files).
#[derive(Clone)]
pub struct ConnCount(#[allow(dead_code)] Arc<Counted>);

/// One counted connection; given back when it ends (or becomes a WebSocket) and no request
/// holds it ([`ConnCount`]).
struct Counted {
    open: Arc<Mutex<Open>>,
    address: IpAddr,
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_address.get_mut(&self.address) {
            *n -= 1;
            if *n == 0 {
                open.by_address.remove(&self.address);
            }
        }
    }
}

/// Count a connection from `address`, or say why it is refused.
fn count(open: &Arc<Mutex<Open>>, limits: ConnLimits, address: IpAddr) -> Result<Counted, String> {
    let mut o = open.lock().unwrap_or_else(|e| e.into_inner());
    admit(limits, o.total, o.by_address.get(&address).copied().unwrap_or(0))?;
    o.total += 1;
    *o.by_address.entry(address).or_insert(0) += 1;
    Ok(Counted { open: open.clone(), address })
}

/// Serves `app` on `listener` until `shutdown`, then waits for the requests in flight.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    shutdown: CancellationToken,
) {
    let (closed_tx, closed_rx) = tokio::sync::watch::channel(());
    let open = Arc::new(Mutex::new(Open::default()));
    let mut last_warned: Option<tokio::time::Instant> = None;
    loop {
        let (io, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of file descriptors, or a connection reset before it was accepted: the
                // listener itself is fine. A pause, so a full fd table is not a busy loop.
                Err(e) => {
                    tracing::warn!(error = %e, "could not accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // An IPv4 client on a dual-stack socket is one address, however it is written.
        let counted = match count(&open, limits, peer.ip().to_canonical()) {
            Ok(c) => c,
            Err(why) => {
                if last_warned.is_none_or(|t| t.elapsed() >= REFUSAL_WARN_EVERY) {
                    tracing::warn!(%peer, reason = %why, "connection refused (503); said at most every {}s", REFUSAL_WARN_EVERY.as_secs());
                    last_warned = Some(tokio::time::Instant::now());
                }
                refuse(io, &why);
                continue;
            }
        };
        // No Nagle: an assignment is one small frame that must leave now, not after the
        // peer's delayed ACK (40 ms on Linux).
        let _ = io.set_nodelay(true);
        let local = io.local_addr().unwrap_or_else(|_| ([0, 0, 0, 0], 0).into());
        let app = app.clone();
        let counted = ConnCount(Arc::new(counted));
        let held = counted.clone();
        let service = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(held.clone());
            req.extensions_mut().insert(ConnectInfo(LocalAddr(local)));
            req.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
            let req = req.map(|body| axum::body::Body::new(Paced::new(body)));
            app.clone().oneshot(req)
        });
        let (shutdown, closed) = (shutdown.clone(), closed_rx.clone());
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
            let mut conn = pin!(builder.serve_connection(hyper_util::rt::TokioIo::new(io), service).with_upgrades());
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, error = %e, "connection ended");
                    }
                }
                _ = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(counted);
            drop(closed);
        });
    }
    drop(listener);
    drop(closed_rx);
    closed_tx.closed().await;
}

/// How often a refused connection is logged (a flood would otherwise flood the log too).
const REFUSAL_WARN_EVERY: Duration = Duration::from_secs(10);

/// Answer a refused connection with 503 and close it, without waiting on the client: what the
/// socket's buffer does not take now is not sent.
fn refuse(io: tokio::net::TcpStream, why: &str) {
    let body = format!("{{\"error\":{}}}\n", serde_json::Value::String(why.to_string()));
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    );
    let _ = io.try_write(answer.as_bytes());
}

/// A request body that must keep coming: no pause over [`BODY_IDLE_TIMEOUT`], and at least
/// [`BODY_MIN_BYTES_PER_SEC`] on average once [`BODY_IDLE_TIMEOUT`] has passed.
struct Paced {
    inner: hyper::body::Incoming,
    started: tokio::time::Instant,
    bytes: u64,
    idle: Pin<Box<tokio::time::Sleep>>,
}

impl Paced {
    fn new(inner: hyper::body::Incoming) -> Paced {
        let now = tokio::time::Instant::now();
        Paced { inner, started: now, bytes: 0, idle: Box::pin(tokio::time::sleep_until(now + BODY_IDLE_TIMEOUT)) }
    }
}

/// Why a body that has sent `bytes` in `elapsed` is too slow, if it is.
fn too_slow(elapsed: Duration, bytes: u64) -> Option<String> {
    let owed = elapsed.saturating_sub(BODY_IDLE_TIMEOUT).as_secs().saturating_add(1) * BODY_MIN_BYTES_PER_SEC;
    (elapsed > BODY_IDLE_TIMEOUT && bytes < owed).then(|| {
        format!(
            "the request body came too slowly ({bytes} bytes in {}s; at least {BODY_MIN_BYTES_PER_SEC} bytes a second is needed)",
            elapsed.as_secs()
        )
    })
}

impl Body for Paced {
    type Data = axum::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.bytes += data.len() as u64;
                }
                let now = tokio::time::Instant::now();
                if let Some(why) = too_slow(now - this.started, this.bytes) {
                    return Poll::Ready(Some(Err(why.into())));
                }
                this.idle.as_mut().reset(now + BODY_IDLE_TIMEOUT);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.idle.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(format!(
                    "the request body sent nothing for {}s",
                    BODY_IDLE_TIMEOUT.as_secs()
                )
                .into()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_limited_in_all_and_per_address() {
        let l = ConnLimits::for_open_files(1024);
        assert_eq!(l, ConnLimits { total: 768, per_address: Some(96) });
        assert_eq!(ConnLimits::for_open_files(65_536), ConnLimits { total: 49_152, per_address: Some(6_144) });
        assert_eq!(ConnLimits::for_open_files(100), ConnLimits { total: 36, per_address: Some(32) });
        assert_eq!(ConnLimits::for_open_files(10).total, 16, "never none");
        assert_eq!(admit(l, 0, 0), Ok(()));
        assert_eq!(admit(l, 767, 95), Ok(()));
        assert!(admit(l, 768, 0).unwrap_err().contains("its most"));
        assert!(admit(l, 100, 96).unwrap_err().contains("from your address"));
        assert_eq!(admit(ConnLimits { per_address: None, ..l }, 100, 500), Ok(()), "behind a load balancer");
    }

    #[test]
    fn a_counted_connection_is_given_back_when_it_ends() {
        let open = Arc::new(Mutex::new(Open::default()));
        let limits = ConnLimits { total: 3, per_address: Some(2) };
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
        let a1 = count(&open, limits, a).unwrap();
        let _a2 = count(&open, limits, a).unwrap();
        assert!(count(&open, limits, a).is_err(), "a third from one address");
        let b1 = count(&open, limits, b).unwrap();
        assert!(count(&open, limits, b).is_err(), "a fourth in all");
        drop(a1);
        assert!(count(&open, limits, b).is_ok(), "room again");
        drop(b1);
        assert_eq!(open.lock().unwrap().by_address.keys().collect::<Vec<_>>(), [&a], "only a's second is left");
    }

    #[test]
    fn a_body_must_keep_its_pace_once_the_idle_time_has_passed() {
        let s = Duration::from_secs;
        assert_eq!(too_slow(s(29), 0), None, "nothing is asked before the idle time");
        assert_eq!(too_slow(s(30), 3), None);
        assert!(too_slow(s(31), 3).is_some(), "a byte every ten seconds");
        assert_eq!(too_slow(s(31), 4096), None);
        assert!(too_slow(s(130), 50 * 1024).is_some(), "under a KiB a second since the grace");
        assert_eq!(too_slow(s(130), 200 * 1024), None, "a slow but real upload");
    }
}
