//! The leader's HTTP server: the router on HTTP/1.1 connections that a client cannot hold
//! open without sending a request.
//!
//! `axum::serve` gives hyper no timer, and without one hyper applies no header read timeout:
//! a client that opened connections and never finished a request head (or a body) held each
//! one, and its file descriptor, for ever, until the coordinator could accept no agent. Here
//! every connection has a timer: a request head must arrive within
//! [`HEADER_READ_TIMEOUT`] (also how long a kept-alive connection may sit idle between
//! requests), and a request body may pause at most [`BODY_IDLE_TIMEOUT`] between two
//! pieces and must come at [`BODY_MIN_BYTES_PER_SEC`] on average once that much time passed. An agent's WebSocket, once upgraded, is the channel's (its own heartbeats bound it).
//!
//! Each request carries the connection's local address ([`LocalAddr`]) and peer address as
//! `ConnectInfo`. Must not: decide anything about a request (that is the router's).

use crate::identity::LocalAddr;
use axum::extract::ConnectInfo;
use hyper::body::{Body, Frame, SizeHint};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::pin::Pin;
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

/// Serves `app` on `listener` until `shutdown`, then waits for the requests in flight.
pub async fn serve(listener: tokio::net::TcpListener, app: axum::Router, shutdown: CancellationToken) {
    let (closed_tx, closed_rx) = tokio::sync::watch::channel(());
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
        // No Nagle: an assignment is one small frame that must leave now, not after the
        // peer's delayed ACK (40 ms on Linux).
        let _ = io.set_nodelay(true);
        let local = io.local_addr().unwrap_or_else(|_| ([0, 0, 0, 0], 0).into());
        let app = app.clone();
        let service = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
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
            drop(closed);
        });
    }
    drop(listener);
    drop(closed_rx);
    closed_tx.closed().await;
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
