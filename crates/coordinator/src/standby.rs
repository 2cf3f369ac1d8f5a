//! What a standby coordinator answers on its address while another leads (docs/ha.md):
//! `/healthz` 200 (the process is up), `/readyz` 503 and every other request 503 ("a standby:
//! ask the leader"), so a load balancer's health check, an agent or the CLI given several
//! coordinators (which ask each `/readyz`) can tell it from a leader and from a dead host.
//! A standby serves nothing else: it has loaded no state and holds no claim.
//!
//! The socket is bound once, at start, and kept: when the standby takes over, this small
//! server stops and the coordinator serves on the very same socket (connections that arrive
//! in between wait in its backlog), so its address never stops accepting.

use crate::error::ApiError;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use std::net::SocketAddr;
use tokio_util::sync::CancellationToken;

/// The standby's server: [`StandingBy::take_over`] stops it and hands back the socket.
pub struct StandingBy {
    listener: std::net::TcpListener,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// Bind `listen` and answer as a standby on it. An address already in use (a leader on the
/// same host and port, which only works for a leader that dies, docs/ha.md) is not an error
/// here: `None`, and the coordinator binds it when it takes over, as before standbys listened.
pub fn listen(listen: SocketAddr) -> anyhow::Result<Option<StandingBy>> {
    let listener = match std::net::TcpListener::bind(listen) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            tracing::warn!(%listen, "standing by without listening: the address is in use (by the leader?); binding it on taking over");
            return Ok(None);
        }
        Err(e) => return Err(anyhow::Error::new(e).context(format!("binding {listen}"))),
    };
    listener.set_nonblocking(true)?;
    let served = tokio::net::TcpListener::from_std(listener.try_clone()?)?;
    let stop = CancellationToken::new();
    let app = axum::Router::new()
        .route("/healthz", get(crate::api::server_info))
        .route("/readyz", get(not_leading))
        .fallback(not_leading);
    let until = stop.clone();
    let task = tokio::spawn(async move {
        let served = axum::serve(served, app).with_graceful_shutdown(async move { until.cancelled().await });
        if let Err(e) = served.await {
            tracing::warn!(error = %e, "the standby's server stopped");
        }
    });
    tracing::info!(address = %listener.local_addr()?, "standing by: /healthz 200, /readyz 503 until this coordinator leads");
    Ok(Some(StandingBy { listener, stop, task }))
}

impl StandingBy {
    /// Stop answering as a standby; the socket, still bound and listening, is the leader's now.
    pub async fn take_over(self) -> anyhow::Result<tokio::net::TcpListener> {
        self.stop.cancel();
        // Graceful: a /readyz answered just now finishes; the server's copy of the socket
        // closes. A client that holds a request open does not hold up the takeover.
        let abort = self.task.abort_handle();
        if tokio::time::timeout(std::time::Duration::from_secs(1), self.task).await.is_err() {
            abort.abort();
        }
        Ok(tokio::net::TcpListener::from_std(self.listener)?)
    }
}

async fn not_leading() -> axum::response::Response {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "a standby: another coordinator leads this database; this one takes over if its claim lapses",
    )
    .into_response()
}
