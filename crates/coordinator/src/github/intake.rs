//! What a webhook body must pass before it is read (docs/github.md, "Webhook limits and replays"). Anyone can
//! post to `/api/v1/github/webhook`, and a body is only known to be GitHub's once all of it
//! has been read and its HMAC checked; up to GitHub's 25 MB each. So, in this order:
//!
//! 1. the headers: no or a malformed `X-Hub-Signature-256` is 401, no `X-GitHub-Event` or
//!    `X-GitHub-Delivery` 400, a `Content-Length` over 25 MB 413 — answered at once, the body
//!    never read (the connection is closed after the answer);
//! 2. room, counted in bytes as they arrive: the bodies being read, verified and handled at a
//!    time per server (the leader's and a standby's each) hold at most
//!    [`Limits::max_bodies`] × 25 MB together; a chunk that finds no room within
//!    [`WAIT_FOR_ROOM`] ends its delivery with 503 and `Retry-After` (GitHub shows the failed
//!    delivery, which can be redelivered). A body holds only what it has sent: a sender that
//!    announces a body and sends nothing holds nothing (when room was counted per body, eight
//!    such connections with made-up signatures kept every real delivery out: outsider finding);
//! 3. the body, whole, within [`Limits::read_timeout`] (408 after it) and 25 MB (413).
//!
//! Memory held by webhook bodies is so bounded whoever sends them, and a sender that stalls
//! mid-body holds what it sent for `read_timeout` at most. To keep real deliveries out an
//! attacker must keep `max_bodies` × 25 MB in flight, sent. The signature itself is checked by
//! the caller (`webhook::verify`), on the bytes read here.

use crate::error::ApiError;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use gpuci_github::{signature_digest, SIGNATURE_HEADER};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The most GitHub sends in one webhook delivery (its documented cap), and so the most a
/// body may be here.
pub const MAX_PAYLOAD_BYTES: usize = 25 << 20;

/// Room for this many whole bodies (25 MB each) at a time by default
/// (`github.webhook_max_bodies`).
pub const DEFAULT_MAX_BODIES: u32 = 8;
/// How long a body may take to arrive, whole, by default (`github.webhook_read_timeout`).
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a delivery waits for room before it is answered 503: a burst of GitHub's small
/// deliveries passes, a flood is refused.
pub const WAIT_FOR_ROOM: Duration = Duration::from_secs(1);
/// What a 503 asks the sender to wait, in seconds.
pub const RETRY_AFTER_S: u64 = 10;

/// What webhook bodies may take (the `[github]` section's `webhook_max_bodies`,
/// `webhook_read_timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_bodies: u32,
    pub read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_bodies: DEFAULT_MAX_BODIES, read_timeout: DEFAULT_READ_TIMEOUT }
    }
}

/// One server's gate for webhook bodies (cheap to clone: the room is shared).
#[derive(Clone, Debug)]
pub struct Intake {
    limits: Limits,
    room: Arc<Semaphore>,
}

/// A body read whole, and the room it holds until dropped (after it was handled).
pub struct Admitted {
    pub body: Bytes,
    _room: Vec<OwnedSemaphorePermit>,
}

/// A delivery refused before or while its body was read: an [`ApiError`], with
/// `Retry-After` when the refusal is for now only.
pub struct Refused {
    pub error: ApiError,
    pub retry_after_s: Option<u64>,
}

impl From<ApiError> for Refused {
    fn from(error: ApiError) -> Self {
        Refused { error, retry_after_s: None }
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let mut r = self.error.into_response();
        if let Some(s) = self.retry_after_s {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Step 1: what the headers alone say. The same checks `webhook::verify` makes again with the
/// body (it also serves deliveries taken from the standby inbox); here they cost nothing.
pub fn check_headers(headers: &HeaderMap) -> Result<(), ApiError> {
    signature_digest(header_str(headers, SIGNATURE_HEADER))
        .map_err(|e| ApiError::new(StatusCode::UNAUTHORIZED, e.to_string()))?;
    if header_str(headers, "x-github-event").is_none_or(str::is_empty) {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "missing X-GitHub-Event header"));
    }
    if header_str(headers, "x-github-delivery").is_none_or(|d| d.is_empty() || d.len() > 128) {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "missing or invalid X-GitHub-Delivery header"));
    }
    let length = header_str(headers, header::CONTENT_LENGTH.as_str()).and_then(|l| l.parse::<u64>().ok());
    if length.is_some_and(|l| l > MAX_PAYLOAD_BYTES as u64) {
        return Err(too_large());
    }
    Ok(())
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("webhook body over {} MB (GitHub's own cap)", MAX_PAYLOAD_BYTES >> 20),
    )
}

impl Intake {
    pub fn new(limits: Limits) -> Self {
        let bytes = limits.max_bodies.max(1) as usize * MAX_PAYLOAD_BYTES;
        Intake { limits, room: Arc::new(Semaphore::new(bytes)) }
    }

    /// The headers checked, the body read whole, room taken for each chunk as it arrives: or
    /// why not.
    pub async fn admit(&self, headers: &HeaderMap, body: Body) -> Result<Admitted, Refused> {
        check_headers(headers)?;
        let read = read_capped(body, MAX_PAYLOAD_BYTES, &self.room);
        match tokio::time::timeout(self.limits.read_timeout, read).await {
            Ok(Ok((body, room))) => Ok(Admitted { body, _room: room }),
            Ok(Err(Refusal::Error(e))) => Err(e.into()),
            Ok(Err(Refusal::NoRoom)) => {
                tracing::warn!(
                    max_bodies = self.limits.max_bodies,
                    "webhook delivery refused: as many body bytes as allowed are being read"
                );
                Err(Refused {
                    error: ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "this coordinator is reading {} webhook bodies' worth already (github.webhook_max_bodies); try again later",
                            self.limits.max_bodies
                        ),
                    ),
                    retry_after_s: Some(RETRY_AFTER_S),
                })
            }
            Err(_) => {
                tracing::warn!(timeout = ?self.limits.read_timeout, "webhook delivery cut off: its body did not arrive in time");
                Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the webhook body did not arrive within {} (github.webhook_read_timeout)",
                        gpuci_core::duration::Duration(self.limits.read_timeout)
                    ),
                )
                .into())
            }
        }
    }
}

enum Refusal {
    Error(ApiError),
    NoRoom,
}

/// The body, refused with 413 as soon as it passes `cap` (whatever `Content-Length` said),
/// each chunk taking its room from `room` as it arrives. Nothing is set aside for what a
/// `Content-Length` announces.
async fn read_capped(
    body: Body,
    cap: usize,
    room: &Arc<Semaphore>,
) -> Result<(Bytes, Vec<OwnedSemaphorePermit>), Refusal> {
    let mut stream = body.into_data_stream();
    let mut out = Vec::new();
    let mut held = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            Refusal::Error(ApiError::new(StatusCode::BAD_REQUEST, format!("reading the webhook body: {e}")))
        })?;
        if out.len() + chunk.len() > cap {
            return Err(Refusal::Error(too_large()));
        }
        let n = u32::try_from(chunk.len()).map_err(|_| Refusal::Error(too_large()))?;
        match tokio::time::timeout(WAIT_FOR_ROOM, room.clone().acquire_many_owned(n)).await {
            Ok(Ok(permit)) => held.push(permit),
            // Timed out, or (never: it is not closed) closed.
            _ => return Err(Refusal::NoRoom),
        }
        out.extend_from_slice(&chunk);
    }
    Ok((out.into(), held))
}
