//! `/api/v1/secrets`: set, list (names only) and delete the secrets steps ask for by name.
//! Values go in and never come out through the API; jobs get them as environment variables
//! and their output is masked. Values are stored sealed under the coordinator's secrets key
//! ([`crate::vault`]).

use crate::api::ApiError;
use crate::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetSecret {
    pub value: String,
}

#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct SecretInfo {
    pub name: String,
    pub updated_at_ms: i64,
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(set_secret, list_secrets, delete_secret))]
pub struct SecretsDoc;

fn valid_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("invalid secret name {name:?}: use an environment variable name like HF_TOKEN"),
        ))
    }
}

/// Create or replace a secret.
#[utoipa::path(put, path = "/api/v1/secrets/{name}", params(("name" = String, Path)), request_body = SetSecret,
    responses((status = 204), (status = 400, body = gpuci_protocol::api::ErrorBody), (status = 422, body = gpuci_protocol::api::ErrorBody)))]
pub async fn set_secret(
    State(st): State<AppState>,
    Path(name): Path<String>,
    body: Result<Json<SetSecret>, axum::extract::rejection::JsonRejection>,
) -> Result<StatusCode, ApiError> {
    valid_name(&name)?;
    let Json(b) = body.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.body_text()))?;
    if b.value.is_empty() {
        return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "secret value must not be empty"));
    }
    // Sealed here, before the store sees it: the database never holds a value it could reveal.
    st.store.set_secret(&name, &st.secrets_key.seal(&name, &b.value), crate::brain::now_ms()).await?;
    tracing::info!(secret = %name, "secret set");
    Ok(StatusCode::NO_CONTENT)
}

/// Secret names (never values).
#[utoipa::path(get, path = "/api/v1/secrets", responses((status = 200, body = Vec<SecretInfo>)))]
pub async fn list_secrets(State(st): State<AppState>) -> Result<Json<Vec<SecretInfo>>, ApiError> {
    let names = st.store.secret_names().await?;
    Ok(Json(names.into_iter().map(|(name, updated_at_ms)| SecretInfo { name, updated_at_ms }).collect()))
}

/// Delete a secret.
#[utoipa::path(delete, path = "/api/v1/secrets/{name}", params(("name" = String, Path)),
    responses((status = 204), (status = 404, body = gpuci_protocol::api::ErrorBody)))]
pub async fn delete_secret(State(st): State<AppState>, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    if st.store.delete_secret(&name).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::new(StatusCode::NOT_FOUND, format!("no secret named {name:?}")))
    }
}
