//! `/api/v1/secrets`: set, list (names and scopes only) and delete the secrets steps ask for
//! by name. Values go in and never come out through the API; jobs get them as environment
//! variables and their output is masked. Values are stored sealed under the coordinator's
//! secrets key ([`crate::vault`]).
//!
//! A secret has a scope (`?repository=owner/name`, plus `&ref=refs/heads/main` or a pattern
//! such as `refs/tags/v*`; neither: every pipeline). One name may have a value in several
//! scopes; a job gets the narrowest that covers it (`gpuci_core::secret_scope`). Setting a
//! name again in the same scope replaces (rotates) its value.

use crate::api::audit::Actor;
use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use gpuci_core::audit::AuditAction;
use gpuci_core::secret_scope::SecretScope;
use serde::{Deserialize, Serialize};

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetSecret {
    pub value: String,
}

#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct SecretInfo {
    pub name: String,
    /// `owner/name` for a repository's secret; absent: every pipeline's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    /// The ref pattern it is limited to, within `repository`.
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub ref_pattern: Option<String>,
    /// The deployment environment it belongs to, within `repository`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    /// The value approved pull requests from forks of `repository` get.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approved_forks: bool,
    pub updated_at_ms: i64,
}

/// Where a secret applies: `?repository=owner/name[&ref=PATTERN]`; neither: everywhere.
#[derive(Deserialize, Default, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ScopeQuery {
    pub repository: Option<String>,
    #[serde(rename = "ref")]
    #[param(rename = "ref")]
    pub ref_pattern: Option<String>,
    /// A deployment environment of `repository` (steps declare it with `environment:`).
    pub environment: Option<String>,
    /// `true`: the value approved pull requests from forks of `repository` get (the approval
    /// policy; nothing else gets it).
    pub approved_forks: Option<bool>,
}

impl ScopeQuery {
    /// The scope asked for. Its repository is read as a repository identity first, so that
    /// one repository is one scope however it is spelled: `owner/name` on `github_host` (as
    /// stored scopes always named it), `host/path` elsewhere (`gitlab.com/acme/x` is not
    /// `acme/x`).
    fn scope(&self, github_host: &str) -> Result<SecretScope, ApiError> {
        let repository = match self.repository.as_deref() {
            Some(r) => Some(
                gpuci_core::repo::RepoId::parse(r.trim(), github_host)
                    .map(|id| id.short_on(github_host))
                    .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?,
            ),
            None => None,
        };
        SecretScope::from_query(
            repository.as_deref(),
            self.ref_pattern.as_deref(),
            self.environment.as_deref(),
            self.approved_forks.unwrap_or(false),
        )
        .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e))
    }
}

fn query(q: Result<Query<ScopeQuery>, axum::extract::rejection::QueryRejection>) -> Result<ScopeQuery, ApiError> {
    q.map(|Query(q)| q).map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.body_text()))
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(set_secret, list_secrets, delete_secret, public_key, rotate_key))]
pub struct SecretsDoc;

/// The key secrets in pipeline files are encrypted to (`gpuci secret encrypt`).
#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct PublicKey {
    /// The current key, an age X25519 recipient (`age1…`): encrypt to this one.
    pub recipient: String,
    pub key_id: String,
    /// Every key that still decrypts, oldest first (the last is current).
    pub key_ids: Vec<String>,
}

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

/// Create or replace (rotate) a secret in a scope.
#[utoipa::path(put, path = "/api/v1/secrets/{name}", params(("name" = String, Path), ScopeQuery), request_body = SetSecret,
    responses((status = 204), (status = 400, body = gpuci_protocol::api::ErrorBody), (status = 422, body = gpuci_protocol::api::ErrorBody)))]
pub async fn set_secret(
    State(st): State<AppState>,
    Extension(actor): Extension<Actor>,
    Path(name): Path<String>,
    scope: Result<Query<ScopeQuery>, axum::extract::rejection::QueryRejection>,
    body: Result<Json<SetSecret>, axum::extract::rejection::JsonRejection>,
) -> Result<StatusCode, ApiError> {
    valid_name(&name)?;
    let scope = query(scope)?.scope(&st.github_host())?;
    let Json(b) = body.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.body_text()))?;
    if b.value.is_empty() {
        return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "secret value must not be empty"));
    }
    // A job's environment variable ends at a NUL: the job would get a prefix of the value
    // that output masking (which looks for the whole value) does not catch.
    if b.value.contains('\0') {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "secret value must not contain a NUL byte (environment variables end there); encode binary values, e.g. base64",
        ));
    }
    // Sealed here, before the store sees it: the database never holds a value it could reveal.
    // The row's name carries the scope, and the seal covers the row's name: a value copied
    // into another scope's row does not open.
    let row = scope.storage_name(&name);
    // The value and the record of who set it commit together (the record names the secret
    // and its scope, never the value).
    let audit = actor.entry(AuditAction::SecretSet, object(&name, &scope), "ok");
    st.store.set_secret_audited(&row, &st.secrets_key.seal(&row, &b.value), crate::brain::now_ms(), &audit).await?;
    tracing::info!(secret = %name, scope = %scope, actor = %actor.name, actor_kind = actor.kind, "secret set");
    Ok(StatusCode::NO_CONTENT)
}

/// Secret names and scopes (never values).
#[utoipa::path(get, path = "/api/v1/secrets", responses((status = 200, body = Vec<SecretInfo>)))]
pub async fn list_secrets(State(st): State<AppState>) -> Result<Json<Vec<SecretInfo>>, ApiError> {
    let rows = st.store.secret_names().await?;
    let mut list: Vec<SecretInfo> = rows
        .into_iter()
        .filter_map(|(row, updated_at_ms)| {
            let (name, scope) = SecretScope::parse_storage_name(&row)?;
            let approved_forks = matches!(scope, SecretScope::ApprovedForks(_));
            let (repository, ref_pattern, environment) = match scope {
                SecretScope::Global => (None, None, None),
                SecretScope::Repository(r) | SecretScope::ApprovedForks(r) => (Some(r), None, None),
                SecretScope::Ref { repository, pattern } => (Some(repository), Some(pattern), None),
                SecretScope::Environment { repository, environment, pattern } => {
                    (Some(repository), pattern, Some(environment))
                }
            };
            Some(SecretInfo { name, repository, ref_pattern, environment, approved_forks, updated_at_ms })
        })
        .collect();
    list.sort_by(|a, b| {
        (&a.name, &a.repository, &a.environment, &a.ref_pattern).cmp(&(
            &b.name,
            &b.repository,
            &b.environment,
            &b.ref_pattern,
        ))
    });
    Ok(Json(list))
}

/// Delete a secret's value in one scope.
#[utoipa::path(delete, path = "/api/v1/secrets/{name}", params(("name" = String, Path), ScopeQuery),
    responses((status = 204), (status = 404, body = gpuci_protocol::api::ErrorBody)))]
pub async fn delete_secret(
    State(st): State<AppState>,
    Extension(actor): Extension<Actor>,
    Path(name): Path<String>,
    scope: Result<Query<ScopeQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<StatusCode, ApiError> {
    valid_name(&name)?;
    let scope = query(scope)?.scope(&st.github_host())?;
    let audit = actor.entry(AuditAction::SecretRm, object(&name, &scope), "ok");
    if st.store.delete_secret_audited(&scope.storage_name(&name), &audit).await? {
        tracing::info!(secret = %name, scope = %scope, actor = %actor.name, actor_kind = actor.kind, "secret deleted");
        Ok(StatusCode::NO_CONTENT)
    } else {
        let err = ApiError::new(StatusCode::NOT_FOUND, format!("no secret named {name:?} for {scope}"));
        // A miss is on the record too: someone tried to remove a secret that is not there.
        let missed: Result<(), String> = Err("not found".into());
        crate::api::audit::record(&st, &actor, AuditAction::SecretRm, object(&name, &scope), &missed).await?;
        Err(err)
    }
}

/// How the audit log names a secret: its name and scope (never its value).
fn object(name: &str, scope: &SecretScope) -> String {
    format!("{name} ({scope})")
}

fn public_key_of(ring: &gpuci_repo_secrets::KeyRing) -> PublicKey {
    let (recipient, key_id) = ring.current();
    PublicKey { recipient, key_id, key_ids: ring.ids() }
}

/// The current public key for `gpuci secret encrypt` (it is public: maintainers of a
/// repository may be given it to encrypt their own secrets without an API token).
#[utoipa::path(get, path = "/api/v1/secrets-key", responses((status = 200, body = PublicKey)))]
pub async fn public_key(State(st): State<AppState>) -> Json<PublicKey> {
    let ring = st.repo_keys.read().unwrap_or_else(|e| e.into_inner());
    Json(public_key_of(&ring))
}

/// Make a new current key. The old ones keep decrypting what was encrypted to them; retire
/// one by removing its file from the key ring directory once nothing uses it.
#[utoipa::path(post, path = "/api/v1/secrets-key", responses((status = 200, body = PublicKey), (status = 500, body = gpuci_protocol::api::ErrorBody)))]
pub async fn rotate_key(
    State(st): State<AppState>,
    Extension(actor): Extension<Actor>,
) -> Result<Json<PublicKey>, ApiError> {
    // The ring's lock is not held across the audit write (a std lock over an await).
    let (rotated, key) = {
        let mut ring = st.repo_keys.write().unwrap_or_else(|e| e.into_inner());
        let rotated = ring.rotate().map_err(|e| e.to_string());
        (rotated, public_key_of(&ring))
    };
    let object = match &rotated {
        Ok(id) => format!("key {id}"),
        Err(_) => "key for encrypted secrets".to_string(),
    };
    crate::api::audit::record(&st, &actor, AuditAction::SecretsKeyRotate, object, &rotated).await?;
    let id = rotated.map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e))?;
    tracing::info!(key_id = %id, actor = %actor.name, "new key for encrypted secrets");
    Ok(Json(key))
}
