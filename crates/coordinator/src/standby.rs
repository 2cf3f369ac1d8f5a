//! What a standby coordinator answers on its address while another leads (docs/ha.md):
//! `/healthz` 200 (the process is up) and `/readyz` 503, so a load balancer's health check, an
//! agent or the CLI given several coordinators (which ask each `/readyz`) can tell it from a
//! leader and from a dead host.
//!
//! With GitHub configured, it **accepts webhook deliveries**
//! (`POST /api/v1/github/webhook`), admitted and checked as the leader does it
//! (`github::intake`, `api::webhook::verify`; a replayed body is refused as there) and
//! queued in the database (`Store::queue_delivery_once`, recorded as a delivery, and its body's
//! hash, in the same transaction), where
//! the leader takes them (`github::service`) — GitHub does not send a failed delivery again by
//! itself, so one sent to a standby, or during a failover, must not be refused. Its database
//! connections are not fenced (it holds no claim), which the fence allows.
//!
//! It proves the installation's identity key itself (`GET /api/v1/identity`, as the leader
//! does: a client given only this address proves it before it sends a credential). Everything
//! else (the API, the dashboard) it passes on to the leader, once the leader has proved the
//! installation's identity key at the address it recorded (`crate::proxy`); 503 when it
//! cannot. What it is passing on when it stops standing by is cut. It has loaded no state and
//! holds no claim.
//!
//! The socket is bound once, at start, and kept: when the standby takes over, this small
//! server stops and the coordinator serves on the very same socket (connections that arrive
//! in between wait in its backlog), so its address never stops accepting.

use crate::api::webhook::{reply, seen_before, verify, Verified, WebhookReply};
use crate::error::ApiError;
use crate::github::intake::{Intake, Refused};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Json;
use gpuci_store::{NewDelivery, Store};
use std::net::SocketAddr;
use std::sync::Arc;
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
pub fn listen(
    listen: SocketAddr,
    webhooks: Option<Webhooks>,
    proxy: Option<crate::proxy::Proxy>,
    limits: crate::serve::ConnLimits,
) -> anyhow::Result<Option<StandingBy>> {
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
    let mut app =
        axum::Router::new().route("/healthz", get(crate::api::server_info)).route("/readyz", get(not_leading));
    app = match proxy {
        // Everything else to the leader, when this standby can prove one (`crate::proxy`);
        // what it is still passing on when it stops standing by is cut then.
        Some(p) => {
            let p = Arc::new(p.until(stop.clone()));
            let proves = p.clone();
            app.route(
                "/api/v1/identity",
                get(
                    move |headers: HeaderMap,
                          uri: axum::http::Uri,
                          local: Option<axum::Extension<axum::extract::ConnectInfo<crate::identity::LocalAddr>>>,
                          q: axum::extract::Query<std::collections::HashMap<String, String>>| {
                        let p = proves.clone();
                        async move {
                            let local = local.map(|axum::Extension(axum::extract::ConnectInfo(l))| l.0);
                            p.prove(&headers, &uri, q.get("nonce").map_or("", String::as_str), local).await
                        }
                    },
                ),
            )
            .fallback(move |req: axum::extract::Request| {
                let p = p.clone();
                async move { p.forward(req).await }
            })
        }
        None => app.fallback(not_leading),
    };
    if let Some(w) = webhooks {
        // The body's limits are `Intake`'s (it reads the body itself).
        app = app.merge(
            axum::Router::new()
                .route("/api/v1/github/webhook", axum::routing::post(queue_webhook))
                .with_state(Arc::new(w)),
        );
    }
    let until = stop.clone();
    // Each request knows its client's address (the proxy gives each client a share), and
    // must come in time, as the leader's do: a standby whose files slow clients hold could not
    // open what it needs to take over.
    let task = tokio::spawn(crate::serve::serve(served, app, limits, until));
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

/// What a standby needs to accept webhook deliveries: the database (unfenced), the secret and
/// its own gate for bodies.
pub struct Webhooks {
    pub store: Arc<dyn Store>,
    pub secret: gpuci_github::Secret,
    pub intake: Intake,
}

/// A delivery to a standby: admitted, checked, then queued for the leader (202), or known
/// already (200).
async fn queue_webhook(
    State(w): State<Arc<Webhooks>>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<WebhookReply>), Refused> {
    let admitted = w.intake.admit(&headers, body).await?;
    Ok(queue_admitted(&w, &headers, &admitted.body).await?)
}

async fn queue_admitted(
    w: &Webhooks,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(StatusCode, Json<WebhookReply>), ApiError> {
    let (event_name, delivery, body_sha256) = match verify(w.secret.expose().as_bytes(), headers, body)? {
        Verified::Answered(answer) => return Ok(answer),
        Verified::ToAct { event_name, delivery, body_sha256, .. } => (event_name, delivery, body_sha256),
    };
    // Checked above; kept with the body so that the leader checks it again (the inbox is a
    // table anyone who can write the database can write).
    let signature = headers.get("x-hub-signature-256").and_then(|v| v.to_str().ok());
    let record = NewDelivery {
        delivery: &delivery,
        event: &event_name,
        body_sha256: Some(&body_sha256),
        signature,
        now_ms: crate::brain::now_ms(),
    };
    if let Some(answer) = seen_before(w.store.queue_delivery_once(&record, body).await?, &delivery, &event_name) {
        return Ok(answer);
    }
    tracing::info!(%delivery, event = event_name, "webhook accepted by this standby; queued for the leader");
    Ok(reply(
        StatusCode::ACCEPTED,
        "accepted",
        format!("{event_name} delivery {delivery} (queued by a standby for the leader)"),
    ))
}
