//! `POST /api/v1/github/webhook`: GitHub's deliveries. What a body must pass before it is
//! read (headers, room, time) is `webhook_intake`'s; then the signature is checked over the
//! raw body before anything is parsed; a forged or unsigned delivery (401) and an unparseable
//! one (400) change nothing. A redelivery (same `X-GitHub-Delivery`) is acknowledged and
//! ignored, and so is a replay: a body that starts work (`push`, `pull_request`,
//! `workflow_job`) already recorded under another delivery id — GitHub signs the body, not
//! the delivery id or event name, so a captured body can come back under new ones
//! (docs/github.md, "Webhook limits and replays").
//! A standby accepts deliveries too (`crate::standby`): checked the same way here, then queued
//! in the database for the leader.

use crate::error::ApiError;
use crate::github::intake::Refused;
use crate::github::Inbound;
use crate::state::AppState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use gpuci_github::{parse_event, verify_signature, Event, SIGNATURE_HEADER};
use gpuci_protocol::api::ErrorBody;
use gpuci_store::{DeliverySeen, NewDelivery};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// GitHub caps webhook payloads at 25 MB.
pub use crate::github::intake::MAX_PAYLOAD_BYTES;

#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct WebhookReply {
    /// `accepted`, `ignored` or `duplicate` (a redelivery, or a replay of a body handled
    /// already).
    pub status: String,
    pub detail: String,
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(receive), components(schemas(WebhookReply)))]
pub struct WebhookDoc;

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Receive a GitHub webhook delivery (`ping`, `workflow_job`, `pull_request`, `push`; other
/// events are acknowledged and ignored).
#[utoipa::path(post, path = "/api/v1/github/webhook", security(("github_signature" = [])),
    request_body(content = serde_json::Value, content_type = "application/json", description = "GitHub's payload, signed with the webhook secret"),
    params(("X-GitHub-Event" = String, Header, description = "the event name"),
        ("X-GitHub-Delivery" = String, Header, description = "the delivery's unique id"),
        ("X-Hub-Signature-256" = String, Header, description = "sha256=HMAC of the body")),
    responses((status = 200, description = "a redelivery of a delivery already handled, or a replay of a body handled already under another delivery id", body = WebhookReply),
        (status = 202, description = "accepted, or ignored (an event gpuci does not act on)", body = WebhookReply),
        (status = 400, description = "missing headers or an unparseable payload", body = ErrorBody),
        (status = 401, description = "missing or wrong signature (a missing or malformed one before the body is read)", body = ErrorBody),
        (status = 404, description = "GitHub is not configured on this coordinator", body = ErrorBody),
        (status = 408, description = "the body did not arrive within github.webhook_read_timeout", body = ErrorBody),
        (status = 413, description = "a body over GitHub's 25 MB cap", body = ErrorBody),
        (status = 503, description = "as many bodies as github.webhook_max_bodies are being read (with Retry-After), or the database cannot take it now", body = ErrorBody)))]
pub async fn receive(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<WebhookReply>), Refused> {
    let r = match &st.github {
        None => Err(ApiError::new(StatusCode::NOT_FOUND, "GitHub is not configured on this coordinator").into()),
        Some(gh) => match gh.intake.admit(&headers, body).await {
            Ok(admitted) => receive_inner(&st, &headers, admitted.body).await.map_err(Refused::from),
            Err(refused) => Err(refused),
        },
    };
    // The event's name is the sender's word: counted by name only for the events gpuci knows
    // and a verified signature (anyone can post here; labels must stay few).
    let event = match (&r, header(&headers, "x-github-event")) {
        (Err(_), _) | (_, None) => "(unverified)",
        (Ok(_), Some(e)) => KNOWN_EVENTS.iter().find(|k| **k == e).copied().unwrap_or("other"),
    };
    let result = match &r {
        Ok((_, reply)) => reply.status.clone(),
        Err(e) => format!("rejected_{}", e.error.parts().0.as_u16()),
    };
    st.metrics.webhook_deliveries.with_label_values(&[event, result.as_str()]).inc();
    r
}

/// Events counted by name in `/metrics`.
const KNOWN_EVENTS: &[&str] = &[
    "ping",
    "push",
    "pull_request",
    "workflow_job",
    "workflow_run",
    "check_run",
    "check_suite",
    "installation",
    "status",
];

async fn receive_inner(
    st: &AppState,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<(StatusCode, Json<WebhookReply>), ApiError> {
    let Some(gh) = &st.github else {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "GitHub is not configured on this coordinator"));
    };
    let (event_name, delivery, event, body_sha256) =
        match verify(gh.webhook_secret.expose().as_bytes(), headers, &body)? {
            Verified::Answered(answer) => return Ok(answer),
            Verified::ToAct { event_name, delivery, event, body_sha256 } => (event_name, delivery, event, body_sha256),
        };
    let record = NewDelivery {
        delivery: &delivery,
        event: &event_name,
        body_sha256: Some(&body_sha256),
        // Acted on here, not queued: nothing to check again.
        signature: None,
        now_ms: crate::brain::now_ms(),
    };
    if let Some(answer) = seen_before(st.store.record_delivery_once(&record).await?, &delivery, &event_name) {
        return Ok(answer);
    }
    tracing::debug!(%delivery, event = event_name, "webhook accepted");
    gh.inbound
        .send(Inbound::Event(*event))
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the coordinator is shutting down"))?;
    Ok(reply(StatusCode::ACCEPTED, "accepted", format!("{event_name} delivery {delivery}")))
}

/// A delivery whose signature and headers were checked.
pub(crate) enum Verified {
    /// Nothing to act on (a ping, an event gpuci ignores): the answer.
    Answered((StatusCode, Json<WebhookReply>)),
    /// An event to act on, once its delivery (and its body's SHA-256, hex) is recorded.
    ToAct { event_name: String, delivery: String, event: Box<Event>, body_sha256: String },
}

/// Checks a delivery: the signature over the raw body first (401), then the headers and the
/// payload (400). Shared by the leader, which acts on it, and a standby, which queues it.
pub(crate) fn verify(secret: &[u8], headers: &HeaderMap, body: &[u8]) -> Result<Verified, ApiError> {
    verify_signature(secret, body, header(headers, SIGNATURE_HEADER))
        .map_err(|e| ApiError::new(StatusCode::UNAUTHORIZED, e.to_string()))?;
    let event_name = header(headers, "x-github-event")
        .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "missing X-GitHub-Event header"))?;
    let delivery = header(headers, "x-github-delivery")
        .filter(|d| !d.is_empty() && d.len() <= 128)
        .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "missing or invalid X-GitHub-Delivery header"))?;
    let event =
        parse_event(event_name, delivery, body).map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()))?;
    match &event {
        Event::Ignored { name } => Ok(Verified::Answered(reply(
            StatusCode::ACCEPTED,
            "ignored",
            format!("gpuci does not act on `{name}` events"),
        ))),
        Event::Ping => Ok(Verified::Answered(reply(StatusCode::ACCEPTED, "accepted", "pong".into()))),
        _ => Ok(Verified::ToAct {
            event_name: event_name.to_string(),
            delivery: delivery.to_string(),
            event: Box::new(event),
            body_sha256: hex::encode(Sha256::digest(body)),
        }),
    }
}

/// The answer to a delivery recorded before (a redelivery) or whose body was (a replay), if
/// it was; `None` for a new one, to act on.
pub(crate) fn seen_before(
    seen: DeliverySeen,
    delivery: &str,
    event_name: &str,
) -> Option<(StatusCode, Json<WebhookReply>)> {
    match seen {
        DeliverySeen::New => None,
        DeliverySeen::Redelivery => Some(duplicate(delivery, event_name)),
        DeliverySeen::Replay { delivery: first, event: first_event } => {
            tracing::warn!(%delivery, event = event_name, first_delivery = %first, first_event = %first_event,
                "webhook body handled before under another delivery id; ignored (a replay?)");
            Some(reply(
                StatusCode::OK,
                "duplicate",
                format!(
                    "delivery {delivery}: this body was handled already as {first_event} delivery {first}; \
                     not acted on again"
                ),
            ))
        }
    }
}

pub(crate) fn reply(status: StatusCode, s: &str, detail: String) -> (StatusCode, Json<WebhookReply>) {
    (status, Json(WebhookReply { status: s.into(), detail }))
}

pub(crate) fn duplicate(delivery: &str, event_name: &str) -> (StatusCode, Json<WebhookReply>) {
    tracing::info!(%delivery, event = event_name, "webhook redelivery ignored");
    reply(StatusCode::OK, "duplicate", format!("delivery {delivery} was already handled"))
}
