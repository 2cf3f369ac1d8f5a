//! GitHub App authentication: the app signs a short-lived JWT with its private key and trades it for
//! installation tokens (see [`crate::Client::installation_token`]).

use std::fmt;

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde::Serialize;
use time::OffsetDateTime;

/// A secret string (private key, token, webhook secret). `Debug` and `Display` print `***`, so a
/// secret inside a config or error struct never reaches a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself; call only where it is sent or used as a key.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("GitHub App {app_id}: private key is not a valid RSA PEM key: {source}")]
    InvalidPrivateKey { app_id: u64, source: jsonwebtoken::errors::Error },
    #[error("GitHub App {app_id}: cannot sign JWT: {source}")]
    Sign { app_id: u64, source: jsonwebtoken::errors::Error },
}

/// A GitHub App's identity. The key is parsed once, at construction, so a bad key fails at start-up
/// rather than on the first webhook.
#[derive(Clone)]
pub struct AppCredentials {
    app_id: u64,
    key: EncodingKey,
}

impl fmt::Debug for AppCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AppCredentials").field("app_id", &self.app_id).field("private_key", &"***").finish()
    }
}

#[derive(Serialize)]
struct Claims {
    iat: i64,
    exp: i64,
    iss: String,
}

/// GitHub rejects app JWTs that live longer than 10 minutes; 9 leaves room for clock drift.
const JWT_LIFETIME_SECS: i64 = 9 * 60;
/// Backdating `iat` absorbs a GitHub clock that runs behind ours, as GitHub's docs recommend.
const JWT_BACKDATE_SECS: i64 = 60;

impl AppCredentials {
    pub fn new(app_id: u64, private_key: &Secret) -> Result<Self, AuthError> {
        let key = EncodingKey::from_rsa_pem(private_key.expose().as_bytes())
            .map_err(|source| AuthError::InvalidPrivateKey { app_id, source })?;
        Ok(Self { app_id, key })
    }

    pub fn app_id(&self) -> u64 {
        self.app_id
    }

    /// A JWT for the app's own endpoints (`/app/...`), valid from `now - 60 s` to `now + 9 min`.
    pub fn app_jwt(&self, now: OffsetDateTime) -> Result<String, AuthError> {
        let now = now.unix_timestamp();
        let claims =
            Claims { iat: now - JWT_BACKDATE_SECS, exp: now + JWT_LIFETIME_SECS, iss: self.app_id.to_string() };
        jsonwebtoken::encode(&Header::new(Algorithm::RS256), &claims, &self.key)
            .map_err(|source| AuthError::Sign { app_id: self.app_id, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_never_prints() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?} {s}"), "*** ***");
        assert_eq!(s.expose(), "hunter2");
    }

    #[test]
    fn bad_key_is_rejected_at_construction() {
        let err = AppCredentials::new(7, &Secret::new("not a key")).expect_err("must fail");
        assert!(err.to_string().contains("GitHub App 7"), "{err}");
        assert!(!err.to_string().contains("not a key"));
    }
}
