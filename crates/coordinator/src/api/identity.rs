//! `GET /api/v1/identity?nonce=…`: proves this coordinator holds the installation's key
//! ([`crate::identity`]) for the host a request named, when that host is its own. Asked
//! before any credential is sent, so it needs none.

use crate::error::ApiError;
use crate::identity::LocalAddr;
use crate::state::AppState;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use gpuci_core::coordinator_identity::IdentityProof;

/// The query of a proof's request.
#[derive(serde::Deserialize, utoipa::IntoParams)]
pub struct Challenge {
    /// 64 lowercase hex digits, fresh for each ask.
    nonce: String,
}

/// Proves this coordinator holds the installation's key: signs the nonce and the host the
/// request named, when that host is its own. No credential needed: it is asked before one is
/// sent.
#[utoipa::path(get, path = "/api/v1/identity", params(Challenge), security(()),
    responses((status = 200, body = IdentityProof),
        (status = 400, body = gpuci_protocol::api::ErrorBody, description = "no well-formed nonce or Host"),
        (status = 421, body = gpuci_protocol::api::ErrorBody, description = "the Host is not one of this coordinator's")))]
pub async fn prove(
    State(st): State<AppState>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    local: Option<axum::Extension<axum::extract::ConnectInfo<LocalAddr>>>,
    Query(c): Query<Challenge>,
) -> Result<Json<IdentityProof>, ApiError> {
    // HTTP/1.1 names it in `Host`; HTTP/2 in the request's authority.
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| uri.authority().map(|a| a.as_str()))
        .filter(|h| !h.is_empty() && h.len() <= 255)
        .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "the request names no Host"))?;
    let local = local.map(|axum::Extension(axum::extract::ConnectInfo(LocalAddr(a)))| a);
    if !gpuci_core::coordinator_identity::signs_for(host, local, &st.public_names) {
        tracing::warn!(host, ?local, "refused to prove the identity key for a host that is not this coordinator's (a relay, or a name or address missing from --public-name)");
        return Err(ApiError::new(
            StatusCode::MISDIRECTED_REQUEST,
            format!(
                "{host:?} is not this coordinator's: it proves its key only for the address a request comes in on and the names given with --public-name; add the name or address agents use there"
            ),
        ));
    }
    st.identity.prove(&c.nonce, host).map(Json).map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()))
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(prove), components(schemas(IdentityProof)))]
pub struct IdentityDoc;
