//! Who is calling, and the record of what they changed.
//!
//! **Credentials.** `/api/v1` takes the admin token (`<data-dir>/api-token`) or a named API
//! token (`gpuci token create NAME`, stored as its SHA-256 only). Both may submit, cancel and
//! set secrets; only the admin token lists the audit log and makes or revokes named tokens,
//! so a leaked CI token can neither read who did what nor mint itself a successor. The
//! read-only token (`<data-dir>/read-token`) is for the dashboard and `/metrics`: on the API
//! it is told so with a 403, never taken for the admin.
//!
//! **The audit log.** Every change of a secret, of the key for encrypted secrets, of a named
//! token, every approval, cancel, retry and GPU release is recorded with its actor (kind of
//! credential, name, fingerprint: never the token), the object (a secret's name and scope,
//! never its value) and the outcome. Where the change is in the database (secrets, tokens,
//! approvals) the entry is written in the same transaction, so there is no change without
//! its entry and no entry without its change. Where it is not (the key ring is files, a
//! cancel goes through the scheduler), the entry is committed after the change and before
//! the answer: nothing is acknowledged unrecorded, and if the entry cannot be stored the
//! caller gets a 503 that says the change happened but is not on the record.

use crate::auth::{self, Secret};
use crate::error::{ApiError, ApiQuery};
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use gpuci_core::audit::{fingerprint, AuditAction};
use gpuci_protocol::api::{AuditEntry, CreateToken, CreatedToken, ErrorBody, TokenInfo};
use gpuci_store::{ApiTokenRecord, AuditFilter, AuditRecord, NewAudit};
use serde::Deserialize;

/// Prefix of named API tokens: lets the API look one up only when it can be one.
pub const NAMED_TOKEN_PREFIX: &str = "gpuci_tok_";

/// Who made a request, as the audit log names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Actor {
    /// `admin-token`, `api-token`, `dashboard`, `github`.
    pub kind: &'static str,
    pub name: String,
    pub credential: Option<String>,
}

impl Actor {
    /// The admin token (`<data-dir>/api-token`), named `admin`.
    pub fn admin(token: &Secret) -> Actor {
        Actor { kind: "admin-token", name: "admin".into(), credential: Some(fingerprint(&auth::hash(token.expose()))) }
    }

    /// A dashboard session signed in with the admin token.
    pub fn dashboard(token: &Secret) -> Actor {
        Actor { kind: "dashboard", ..Actor::admin(token) }
    }

    fn named(t: &ApiTokenRecord) -> Actor {
        Actor { kind: "api-token", name: t.name.clone(), credential: Some(fingerprint(&t.hash)) }
    }

    pub fn is_admin(&self) -> bool {
        self.kind == "admin-token"
    }

    /// The entry for `action` on `object`, ended as `outcome`.
    pub fn entry(&self, action: AuditAction, object: impl Into<String>, outcome: impl Into<String>) -> NewAudit {
        NewAudit {
            at_ms: crate::brain::now_ms(),
            actor_kind: self.kind.into(),
            actor: self.name.clone(),
            credential: self.credential.clone(),
            action: action.as_str().into(),
            object: object.into(),
            outcome: outcome.into(),
        }
    }
}

/// The actor a bearer token on `/api/v1` stands for; 401 for no valid token, 403 for the
/// read-only token.
pub async fn identify(st: &AppState, token: &str) -> Result<Actor, ApiError> {
    if st.api_token.matches(token) {
        return Ok(Actor::admin(&st.api_token));
    }
    if token.starts_with(NAMED_TOKEN_PREFIX) {
        // Looked up by hash: the database holds no token, and equality of two SHA-256
        // digests tells an attacker nothing about the token.
        if let Some(t) = st.store.live_api_token(&auth::hash(token)).await? {
            return Ok(Actor::named(&t));
        }
    } else if st.read_token.matches(token) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "the read-only token signs in to the dashboard and scrapes /metrics; the API needs the API token or a named token (gpuci token create)",
        ));
    }
    Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid API token"))
}

fn admin_only(actor: &Actor, what: &str) -> Result<(), ApiError> {
    if actor.is_admin() {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("only the admin token (<data-dir>/api-token) may {what}; token {:?} may not", actor.name),
        ))
    }
}

/// Record an action whose change is not in the database (or did not happen), before the
/// caller answers. `outcome`: the action's result; its error text is the outcome.
pub async fn record<T, E: std::fmt::Display>(
    st: &AppState,
    actor: &Actor,
    action: AuditAction,
    object: impl Into<String>,
    outcome: &Result<T, E>,
) -> Result<(), ApiError> {
    let text = match outcome {
        Ok(_) => "ok".to_string(),
        Err(e) => format!("failed: {e}"),
    };
    let object = object.into();
    match st.store.append_audit(&actor.entry(action, object.clone(), text)).await {
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::error!(error = %e, action = %action, object = %object, actor = %actor.name,
                "could not record an action in the audit log");
            let mut err = ApiError::store(&e, "could not record this in the audit log");
            if outcome.is_ok() {
                // The change itself took effect: say so, so nobody repeats it blindly.
                let (status, msg) = err.parts();
                err = ApiError::new(status, format!("{action} of {object} took effect, but {msg}"));
            }
            Err(err)
        }
    }
}

fn entry(r: AuditRecord) -> AuditEntry {
    let e = r.entry;
    AuditEntry {
        id: r.id,
        at: gpuci_core::audit::utc(e.at_ms),
        at_ms: e.at_ms,
        actor_kind: e.actor_kind,
        actor: e.actor,
        credential: e.credential,
        action: e.action,
        object: e.object,
        outcome: e.outcome,
    }
}

/// `GET /api/v1/audit` filters.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Entries at or after this: a UTC time (`2026-11-28T12:00:00Z`) or a duration back from
    /// now (`2h`, `7d`).
    pub since: Option<String>,
    /// An action (`secret.rm`) or every action on an object (`secret`).
    pub action: Option<String>,
    /// A token's name (`admin`, a named token) or a GitHub login, exactly.
    pub actor: Option<String>,
    /// At most this many, newest first (1 to 100000; default 1000).
    pub limit: Option<u32>,
}

impl AuditQuery {
    /// The store's filter; a bad value is a 400 that says what was expected.
    pub fn filter(&self, now_ms: i64) -> Result<AuditFilter, ApiError> {
        let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, m);
        let since_ms =
            self.since.as_deref().map(|s| gpuci_core::audit::parse_since(s, now_ms)).transpose().map_err(bad)?;
        if let Some(a) = &self.action {
            gpuci_core::audit::check_action_filter(a).map_err(bad)?;
        }
        if let Some(l) = self.limit {
            if !(1..=100_000).contains(&l) {
                return Err(bad(format!("limit {l}: expected 1 to 100000")));
            }
        }
        Ok(AuditFilter { since_ms, action: self.action.clone(), actor: self.actor.clone(), limit: self.limit })
    }
}

/// The audit log, newest first (admin token only).
#[utoipa::path(get, path = "/api/v1/audit", params(AuditQuery),
    responses((status = 200, body = Vec<AuditEntry>), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub async fn list_audit(
    State(st): State<AppState>,
    Extension(actor): Extension<Actor>,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> Result<Json<Vec<AuditEntry>>, ApiError> {
    admin_only(&actor, "read the audit log")?;
    let filter = q.filter(crate::brain::now_ms())?;
    Ok(Json(st.store.audit_log(&filter).await?.into_iter().map(entry).collect()))
}

/// The audit log for the dashboard (the caller checked the viewer is the admin).
pub async fn recent(st: &AppState, filter: &AuditFilter) -> Result<Vec<AuditEntry>, ApiError> {
    Ok(st.store.audit_log(filter).await?.into_iter().map(entry).collect())
}

fn valid_token_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        // `admin` names the admin token in the log; a named token must not pass for it.
        && !name.eq_ignore_ascii_case("admin");
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("invalid token name {name:?}: 1 to 64 letters, digits, '-', '_' or '.', and not \"admin\""),
        ))
    }
}

fn token_info(t: ApiTokenRecord) -> TokenInfo {
    TokenInfo {
        credential: fingerprint(&t.hash),
        name: t.name,
        created_at_ms: t.created_at_ms,
        created_by: t.created_by,
        revoked_at_ms: t.revoked_at_ms,
    }
}

/// Make a named API token (admin token only). Its value is in this answer and nowhere else.
#[utoipa::path(post, path = "/api/v1/tokens", request_body = CreateToken,
    responses((status = 201, body = CreatedToken), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn create_token(
    State(st): State<AppState>,
    Extension(actor): Extension<Actor>,
    body: Result<Json<CreateToken>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<CreatedToken>), ApiError> {
    admin_only(&actor, "create tokens")?;
    let Json(req) = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    valid_token_name(&req.name)?;
    let token = auth::generate(NAMED_TOKEN_PREFIX.trim_end_matches('_'));
    let rec = ApiTokenRecord {
        name: req.name.clone(),
        hash: auth::hash(token.expose()),
        created_at_ms: crate::brain::now_ms(),
        created_by: actor.name.clone(),
        revoked_at_ms: None,
    };
    let audit = actor.entry(AuditAction::TokenCreate, format!("token {}", req.name), "ok");
    if !st.store.create_api_token(&rec, &audit).await? {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("a token named {:?} exists or existed (names are never reused); choose another", req.name),
        ));
    }
    tracing::info!(token = %req.name, by = %actor.name, "named API token created");
    let credential = fingerprint(&rec.hash);
    Ok((StatusCode::CREATED, Json(CreatedToken { name: req.name, token: token.expose().to_string(), credential })))
}

/// Named API tokens, revoked ones included (admin token only; never values).
#[utoipa::path(get, path = "/api/v1/tokens",
    responses((status = 200, body = Vec<TokenInfo>), (status = 403, body = ErrorBody)))]
pub async fn list_tokens(
    State(st): State<AppState>,
    Extension(actor): Extension<Actor>,
) -> Result<Json<Vec<TokenInfo>>, ApiError> {
    admin_only(&actor, "list tokens")?;
    Ok(Json(st.store.api_tokens().await?.into_iter().map(token_info).collect()))
}

/// Revoke a named API token at once (admin token only).
#[utoipa::path(delete, path = "/api/v1/tokens/{name}", params(("name" = String, Path)),
    responses((status = 204), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn revoke_token(
    State(st): State<AppState>,
    Extension(actor): Extension<Actor>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    admin_only(&actor, "revoke tokens")?;
    let audit = actor.entry(AuditAction::TokenRevoke, format!("token {name}"), "ok");
    if st.store.revoke_api_token(&name, crate::brain::now_ms(), &audit).await? {
        tracing::info!(token = %name, by = %actor.name, "named API token revoked");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::new(StatusCode::NOT_FOUND, format!("no live token named {name:?}")))
    }
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(list_audit, create_token, list_tokens, revoke_token))]
pub struct AuditDoc;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_names_are_plain_and_never_admin() {
        for ok in ["ci-bot", "release.v2", "A_1"] {
            assert!(valid_token_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "admin", "ADMIN", "a b", "x/y", "é", &"x".repeat(65)] {
            assert!(valid_token_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_bad_filter_is_a_400_that_says_why() {
        let q = AuditQuery { since: Some("yesterday".into()), ..Default::default() };
        let (status, msg) = q.filter(0).expect_err("refused").parts();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(msg.contains("2h"), "{msg}");
        let q = AuditQuery { action: Some("secrets".into()), ..Default::default() };
        assert!(q.filter(0).expect_err("refused").parts().1.contains("secret.set"));
        let q = AuditQuery { limit: Some(0), ..Default::default() };
        assert_eq!(q.filter(0).expect_err("refused").parts().0, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn the_admin_fingerprint_is_not_the_token() {
        let t = auth::generate("gpuci_api");
        let a = Actor::admin(&t);
        let fp = a.credential.clone().unwrap_or_default();
        assert!(fp.starts_with("sha256:") && fp.len() == 19, "{fp}");
        assert!(!t.expose().contains(&fp[7..]), "the fingerprint is no part of the token");
        assert!(a.is_admin() && !Actor::dashboard(&t).is_admin());
    }
}
