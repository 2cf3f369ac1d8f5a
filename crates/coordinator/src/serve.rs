//! The leader's HTTP server: the router on HTTP/1.1 connections that a client cannot hold
//! open without sending a request.
//!
//! `axum::serve` gives hyper no timer, and without one hyper applies no header read timeout:
//! a client that opened connections and never finished a request head (or a body) held each
//! one, and its file descriptor, for ever, until the coordinator could accept no agent. Here
//! every connection has a timer: a request head must arrive within
//! [`HEADER_READ_TIMEOUT`] (also how long a kept-alive connection may sit idle between
//! requests), and a request body may pause at most [`BODY_IDLE_TIMEOUT`] between two
//! pieces. An agent's WebSocket, once upgraded, is the channel's (its own heartbeats bound it).
//!
//! Each request carries the connection's local address ([`LocalAddr`]) and peer address as
//! `ConnectInfo`. Must not: decide anything about a request (that is the router's).

use crate::identity::LocalAddr;
use axum::extract::ConnectInfo;
use std::net::SocketAddr;
use std::pin::pin;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// How long a client has to send a whole request head, from the connection's start or the
/// end of its previous response (gpuci's own clients keep idle connections for less:
/// `gpuci_protocol::CLIENT_POOL_IDLE`).
pub const HEADER_READ_TIMEOUT: Duration = gpuci_protocol::REQUEST_HEAD_TIMEOUT;
/// How long a request body may send nothing before the request fails.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

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
            let req =
                req.map(|body| axum::body::Body::new(tower_http::timeout::TimeoutBody::new(BODY_IDLE_TIMEOUT, body)));
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
