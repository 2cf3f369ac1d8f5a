//! A small GitHub REST client for the operations gpuci needs. Every request carries GitHub's media
//! type, API version and a User-Agent (GitHub rejects requests without one).

use std::collections::HashMap;

use reqwest::{Method, StatusCode};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use time::{Duration, OffsetDateTime};
use tokio::sync::Mutex;

use crate::auth::{AppCredentials, AuthError, Secret};

const API_VERSION: &str = "2022-11-28";
const USER_AGENT: &str = concat!("gpuci/", env!("CARGO_PKG_VERSION"));
/// Installation tokens live one hour; refresh this long before `expires_at` so a token is never
/// handed out that expires in the middle of a request or a runner registration.
const TOKEN_REFRESH_MARGIN: Duration = Duration::minutes(5);

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("GitHub {operation}: request failed: {source}")]
    Transport { operation: &'static str, source: reqwest::Error },
    #[error("GitHub {operation}: HTTP {status}: {body}")]
    Status { operation: &'static str, status: StatusCode, body: String },
    #[error("GitHub {operation}: unexpected response body: {source}")]
    Decode { operation: &'static str, source: serde_json::Error },
    #[error(transparent)]
    Auth(#[from] AuthError),
}

impl ApiError {
    /// Whether retrying the same request later may succeed (network trouble, rate limits, GitHub 5xx).
    pub fn is_transient(&self) -> bool {
        match self {
            ApiError::Transport { .. } => true,
            ApiError::Status { status, .. } => status.is_server_error() || *status == StatusCode::TOO_MANY_REQUESTS,
            ApiError::Decode { .. } | ApiError::Auth(_) => false,
        }
    }
}

/// What the coordinator asks for when it registers a just-in-time runner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JitRunnerSpec {
    /// Unique per runner; GitHub refuses (409) a name already registered.
    pub name: String,
    pub runner_group_id: u64,
    /// At least one label (GitHub: 1..=100).
    pub labels: Vec<String>,
}

/// A registered JIT runner; `encoded_jit_config` is handed to `run.sh --jitconfig`.
#[derive(Debug, Clone)]
pub struct JitConfig {
    pub runner_id: u64,
    pub runner_name: String,
    pub encoded_jit_config: Secret,
}

#[derive(Deserialize)]
struct InstallationTokenResponse {
    token: String,
    #[serde(with = "time::serde::rfc3339")]
    expires_at: OffsetDateTime,
}

#[derive(Deserialize)]
struct JitConfigResponse {
    runner: JitRunner,
    encoded_jit_config: String,
}

#[derive(Deserialize)]
struct JitRunner {
    id: u64,
    name: String,
}

struct CachedToken {
    token: Secret,
    expires_at: OffsetDateTime,
}

enum Auth<'a> {
    AppJwt,
    Token(&'a Secret),
}

/// A GitHub App's client. Cheap to share behind an `Arc`; the token cache is internal.
pub struct Client {
    http: reqwest::Client,
    base_url: String,
    app: AppCredentials,
    tokens: Mutex<HashMap<u64, CachedToken>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("base_url", &self.base_url).field("app", &self.app).finish_non_exhaustive()
    }
}

impl Client {
    /// `base_url` is `https://api.github.com`, `https://HOST/api/v3` for GitHub Enterprise Server, or a
    /// test server's address.
    pub fn new(base_url: impl Into<String>, app: AppCredentials) -> Self {
        let base_url = base_url.into().trim_end_matches('/').to_owned();
        Self { http: reqwest::Client::new(), base_url, app, tokens: Mutex::new(HashMap::new()) }
    }

    /// An installation access token, from the cache while it has more than 5 minutes left.
    pub async fn installation_token(&self, installation_id: u64) -> Result<Secret, ApiError> {
        // Holding the lock across the request means concurrent callers for a cold cache wait for one
        // token instead of each minting their own; token minting is rare (hourly per installation).
        let mut tokens = self.tokens.lock().await;
        let now = OffsetDateTime::now_utc();
        if let Some(cached) = tokens.get(&installation_id) {
            if cached.expires_at - TOKEN_REFRESH_MARGIN > now {
                return Ok(cached.token.clone());
            }
        }
        let path = format!("/app/installations/{installation_id}/access_tokens");
        let resp: InstallationTokenResponse = self
            .send("create installation access token", Method::POST, &path, Auth::AppJwt, Some(&serde_json::json!({})))
            .await?;
        let token = Secret::new(resp.token);
        tokens.insert(installation_id, CachedToken { token: token.clone(), expires_at: resp.expires_at });
        Ok(token)
    }

    /// Registers a just-in-time runner on `owner/repo`.
    pub async fn generate_jitconfig(
        &self,
        installation_id: u64,
        owner: &str,
        repo: &str,
        spec: &JitRunnerSpec,
    ) -> Result<JitConfig, ApiError> {
        let token = self.installation_token(installation_id).await?;
        let path = format!("/repos/{owner}/{repo}/actions/runners/generate-jitconfig");
        let resp: JitConfigResponse =
            self.send("generate JIT runner config", Method::POST, &path, Auth::Token(&token), Some(spec)).await?;
        Ok(JitConfig {
            runner_id: resp.runner.id,
            runner_name: resp.runner.name,
            encoded_jit_config: Secret::new(resp.encoded_jit_config),
        })
    }

    async fn send<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        operation: &'static str,
        method: Method,
        path: &str,
        auth: Auth<'_>,
        body: Option<&B>,
    ) -> Result<T, ApiError> {
        let bearer = match auth {
            Auth::AppJwt => self.app.app_jwt(OffsetDateTime::now_utc())?,
            Auth::Token(token) => token.expose().to_owned(),
        };
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base_url))
            .bearer_auth(bearer)
            .header(reqwest::header::ACCEPT, "application/vnd.github+json")
            .header("X-GitHub-Api-Version", API_VERSION)
            .header(reqwest::header::USER_AGENT, USER_AGENT);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req.send().await.map_err(|source| ApiError::Transport { operation, source })?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|source| ApiError::Transport { operation, source })?;
        if !status.is_success() {
            // GitHub's error bodies are short JSON messages; cap them so a proxy's HTML page stays readable.
            let body: String = String::from_utf8_lossy(&bytes).chars().take(500).collect();
            return Err(ApiError::Status { operation, status, body });
        }
        serde_json::from_slice(&bytes).map_err(|source| ApiError::Decode { operation, source })
    }
}
