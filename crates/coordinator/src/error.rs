//! The HTTP side's one error and its extractors: [`ApiError`] (a status and an
//! [`ErrorBody`]), and `Path`, `Query` and `Json` wrappers that answer malformed input with it
//! as a JSON 4xx instead of axum's plain text. Every handler (API, dashboard, agent channel,
//! webhooks) answers with it; it sits below them all and knows nothing of any handler.

use crate::brain::BrainError;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use gpuci_protocol::api::ErrorBody;
use serde::de::DeserializeOwned;

/// `Path`, answering a segment that does not parse (an id that is not an integer, or beyond
/// i64) with a JSON 400 instead of axum's plain-text one.
pub struct ApiPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ApiPath(v)),
            Err(e) => Err(ApiError::new(client_or_server(e.status()), e.body_text())),
        }
    }
}

/// `Query`, answering a malformed query string with a JSON 400.
pub struct ApiQuery<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(v)) => Ok(ApiQuery(v)),
            Err(e) => Err(ApiError::new(client_or_server(e.status()), e.body_text())),
        }
    }
}

/// `Json`, answering any unreadable body (no JSON content type, bad syntax, wrong types,
/// unknown fields) with a JSON 400, or 413 when it is too large.
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(e) => Err(json_rejection(e)),
        }
    }
}

/// A user's mistake is a 400 (413 for a body over the limit); an extractor that cannot work at
/// all (a route/handler mismatch) stays a 500.
pub(crate) fn client_or_server(status: StatusCode) -> StatusCode {
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => status,
        s if s.is_server_error() => s,
        _ => StatusCode::BAD_REQUEST,
    }
}

pub(crate) fn json_rejection(e: JsonRejection) -> ApiError {
    ApiError::new(client_or_server(e.status()), e.body_text())
}

pub struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiError {
    /// An error with a whole body (a pipeline file's errors).
    pub(crate) fn with_body(status: StatusCode, body: ErrorBody) -> Self {
        ApiError { status, body }
    }

    pub fn new(status: StatusCode, msg: impl Into<String>) -> Self {
        ApiError { status, body: ErrorBody { error: msg.into(), pipeline_errors: Vec::new() } }
    }

    /// The status and the message (for pages that show the error in HTML).
    pub fn parts(&self) -> (StatusCode, String) {
        (self.status, self.body.error.clone())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

impl From<BrainError> for ApiError {
    fn from(e: BrainError) -> Self {
        let status = match &e {
            BrainError::JobNotFound(_) | BrainError::PipelineNotFound(_) => StatusCode::NOT_FOUND,
            BrainError::AlreadyFinished { .. } | BrainError::NotQuarantined(_) | BrainError::Conflict(_) => {
                StatusCode::CONFLICT
            }
            BrainError::AgentRefused(_) => StatusCode::BAD_REQUEST,
            BrainError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            // Commands change state: what failed is storing the change.
            BrainError::Store(e) => return ApiError::store(e, "could not store this"),
        };
        if status.is_server_error() {
            tracing::error!(error = %e, "request failed");
        }
        ApiError::new(status, e.to_string())
    }
}

impl From<gpuci_store::StoreError> for ApiError {
    fn from(e: gpuci_store::StoreError) -> Self {
        ApiError::store(&e, "could not use its database")
    }
}

impl ApiError {
    /// A store error: 503 with the database's reason when the database cannot do it now (a
    /// full disk, an I/O error, a lost connection) or another coordinator leads it (a fenced
    /// write): nothing was stored and the same request may succeed later; anything else is a
    /// 500. `doing`: what the coordinator could not
    /// do, after "the coordinator".
    pub fn store(e: &gpuci_store::StoreError, doing: &str) -> Self {
        if e.is_fenced() {
            // A former leader: nothing was written, and the leader now would take it.
            tracing::warn!("request refused: another coordinator leads the database now");
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the coordinator {doing}: another coordinator leads its database now, and nothing was stored; \
                     send it again to the coordinator that leads"
                ),
            );
        }
        if let gpuci_store::StoreError::Conflict { job, found, .. } = e {
            // A compare-and-set the store refused: the job moved on meanwhile (another
            // request, an agent's event, a commit whose answer was lost). Not a server fault.
            tracing::warn!(error = %e, "request refused: the job changed meanwhile");
            return ApiError::new(
                StatusCode::CONFLICT,
                format!("the coordinator {doing}: job {job} is {found} now; look at it again before asking"),
            );
        }
        if e.is_unavailable() {
            tracing::warn!(error = %e, "request refused: the database cannot take it now");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the coordinator {doing}: {}; try again later", e.reason()),
            )
        } else {
            tracing::error!(error = %e, "request failed");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("the coordinator {doing}: {e}"))
        }
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A compare-and-set the store refused reaches a caller as 409 with the job's state, not
    /// as a 500: the job moved on meanwhile, which is no fault of the server.
    #[test]
    fn a_refused_compare_and_set_is_a_conflict_not_a_server_error() {
        let e = gpuci_store::StoreError::Conflict {
            job: 7,
            expected: "queued".into(),
            found: gpuci_core::job::JobState::Cancelled,
        };
        let a = ApiError::from(BrainError::Store(e));
        assert_eq!(a.status, StatusCode::CONFLICT);
        assert!(a.body.error.contains("job 7 is cancelled"), "{}", a.body.error);
    }
}
