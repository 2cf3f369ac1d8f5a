//! A small GitHub REST client for the operations gpuci needs. Every request carries GitHub's media
//! type, API version and a User-Agent (GitHub rejects requests without one).
//!
//! Two kinds of credentials: a GitHub App (app JWT → per-installation tokens, found per repository or
//! organisation and cached) or a personal access token for a single repository.
//!
//! Failures that may pass are tried again here, so callers see only those that did not:
//! - a 401 on an installation token (GitHub revoked it, or it expired before the cache thought) drops
//!   the cached token and sends the request once more with a fresh one;
//! - rate limits hold back the whole client (and its clones) until the time GitHub named, however
//!   long: [`crate::ratelimit`] has the rules. A call sits a hold out when it ends within
//!   [`RetryPolicy::max_wait`]; a longer one comes back at once as [`ApiError::RateLimited`] with
//!   its end, and every call before that end gets the same answer without anything being sent, so
//!   a caller that retries too early cannot reach GitHub early;
//! - 5xx answers and timeouts are retried with exponential backoff and jitter, but only for requests
//!   that may safely arrive twice (not a POST that creates something: a runner registered twice, a
//!   second check run); a connection that was never made is retried for every request.
//!
//! The rate-limit figures of every answer (`x-ratelimit-*`) are kept per credential and resource, for
//! [`Client::rate_limits`].

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::SystemTime;

use reqwest::header::HeaderMap;
use reqwest::{Method, StatusCode};
use serde::{de::DeserializeOwned, Serialize};
use time::{Duration, OffsetDateTime};
use tokio::sync::Mutex;

use crate::auth::{AppCredentials, AuthError, Secret};
pub use crate::ratelimit::RateLimit;
use crate::ratelimit::{self, utc_hms, Gate, Limit};
// Re-exported so `client::JitConfig` and `client::JitRunnerSpec` keep working; they moved to `types`.
use crate::types::{
    wire, CheckRunUpdate, CommitStatus, NewCheckRun, Permission, Repo, Runner, WorkflowJob, WorkflowRun,
};
pub use crate::types::{JitConfig, JitRunnerSpec};

// The operations, one module per API area; the plumbing (credentials, retries, rate limits,
// paging) stays here.
mod actions;
mod checks;
mod repos;
mod runners;

const API_VERSION: &str = "2022-11-28";
const USER_AGENT: &str = concat!("gpuci/", env!("CARGO_PKG_VERSION"));
/// Installation tokens live one hour; refresh this long before `expires_at` so a token is never
/// handed out that expires in the middle of a request or a runner registration.
const TOKEN_REFRESH_MARGIN: Duration = Duration::minutes(5);
/// GitHub's largest page size.
const PER_PAGE: u32 = 100;
/// At most this many pages (1000 items) per listing: enough for any one repository's live runs and
/// jobs, and a bound on how long a reconcile pass can spend on one listing.
const MAX_PAGES: u32 = 10;
/// How the client tries again after an answer that may change: see the module header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries per request, the first included; at least 1.
    pub attempts: u32,
    /// The pause after the first failure. Each later one doubles, up to `max_backoff`; half of
    /// each pause is random, so clients that failed together do not come back together.
    pub base: std::time::Duration,
    pub max_backoff: std::time::Duration,
    /// The longest rate-limit hold a call sits out before it sends. A call that finds the client
    /// held back for longer returns [`ApiError::RateLimited`] at once, with the hold's end: the
    /// caller (a single task that others wait behind) keeps the work and tries again no earlier.
    /// It bounds how long a call waits, never how long the client waits.
    pub max_wait: std::time::Duration,
    /// The most one request may take, answer included.
    pub timeout: std::time::Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 4,
            base: std::time::Duration::from_millis(500),
            max_backoff: std::time::Duration::from_secs(8),
            max_wait: std::time::Duration::from_secs(20),
            timeout: std::time::Duration::from_secs(30),
        }
    }
}

/// The pause before try `failed + 1` after a 5xx or a failed connection, after `failed` tries
/// failed, or `None`: give up now. `jitter` is a random number in `[0, 1)`. Rate limits are not
/// paused here: they hold the whole client (see [`crate::ratelimit`]).
pub fn retry_pause(policy: &RetryPolicy, failed: u32, jitter: f64) -> Option<std::time::Duration> {
    if failed == 0 || failed >= policy.attempts {
        return None;
    }
    let jitter = jitter.clamp(0.0, 1.0);
    let doubled = policy.base.saturating_mul(1u32 << (failed - 1).min(16));
    let pause = doubled.min(policy.max_backoff);
    Some(pause / 2 + (pause / 2).mul_f64(jitter))
}

/// A random number in `[0, 1)` for jitter. Not for secrets: it spreads retries, nothing more.
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Whether a request may arrive twice without harm: reads, deletes and updates, and the two POSTs
/// that create nothing lasting (a token, a cancel). A POST that registers a runner or creates a check
/// run is not retried after a 5xx or a timeout: GitHub may have done it.
fn repeatable(method: &Method, operation: &str) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::PUT | Method::DELETE | Method::PATCH)
        || operation == "cancel workflow run"
        || operation == "create installation access token"
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("GitHub {operation}: request failed: {source}")]
    Transport { operation: &'static str, source: reqwest::Error },
    /// GitHub answered with an error that is not a rate limit (a 403 here is a missing permission).
    #[error("GitHub {operation}: HTTP {status}: {body}")]
    Status { operation: &'static str, status: StatusCode, body: String },
    /// GitHub's rate limit holds the client back until `until`: nothing may be sent before then.
    /// `status` and `body` are GitHub's answer; `None`: this call was not sent, the client was
    /// already held back by an earlier answer.
    #[error("GitHub {operation}: GitHub rate limit until {} UTC ({})", utc_hms(*until), limited_detail(*status, body))]
    RateLimited { operation: &'static str, until: SystemTime, status: Option<StatusCode>, body: String },
    #[error("GitHub {operation}: unexpected response body at `{path}`: {source}")]
    Decode { operation: &'static str, path: String, source: serde_json::Error },
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error("GitHub {operation}: needs GitHub App credentials, but this client has a personal access token")]
    AppOnly { operation: &'static str },
    #[error("the GitHub App is not installed on `{target}`")]
    NotInstalled { target: String },
    #[error("GitHub {operation}: response is larger than the {limit}-byte limit")]
    TooLarge { operation: &'static str, limit: u64 },
    #[error("GitHub {operation}: {reason}")]
    InvalidArgument { operation: &'static str, reason: String },
    #[error("GitHub {operation}: `{path}`: {reason}")]
    UnsupportedContent { operation: &'static str, path: String, reason: String },
}

fn limited_detail(status: Option<StatusCode>, body: &str) -> String {
    match status {
        Some(status) => format!("HTTP {status}: {body}"),
        None => "not sent: an earlier answer holds the client back".to_owned(),
    }
}

impl ApiError {
    /// Whether retrying the same request later may succeed (network trouble, rate limits, GitHub 5xx).
    pub fn is_transient(&self) -> bool {
        match self {
            ApiError::Transport { .. } => true,
            ApiError::Status { status, .. } => status.is_server_error(),
            ApiError::RateLimited { .. } => true,
            ApiError::Decode { .. }
            | ApiError::Auth(_)
            | ApiError::AppOnly { .. }
            | ApiError::NotInstalled { .. }
            | ApiError::TooLarge { .. }
            | ApiError::InvalidArgument { .. }
            | ApiError::UnsupportedContent { .. } => false,
        }
    }

    /// The earliest time the same call may be tried again, when GitHub named one (a rate limit):
    /// a caller schedules its retry no earlier, whatever its own backoff says.
    pub fn retry_not_before(&self) -> Option<SystemTime> {
        match self {
            ApiError::RateLimited { until, .. } => Some(*until),
            _ => None,
        }
    }

    fn is_status(&self, wanted: StatusCode) -> bool {
        matches!(self, ApiError::Status { status, .. } if *status == wanted)
    }
}

/// How the client authenticates.
#[derive(Clone, Debug)]
pub enum Credentials {
    /// A GitHub App: works on every repository and organisation it is installed on.
    App(AppCredentials),
    /// A personal access token, for a single repository (or an organisation it administers).
    Token(Secret),
}

struct CachedToken {
    token: Secret,
    expires_at: OffsetDateTime,
}

/// Whom a request acts as; the bearer is found (and refreshed after a 401) per try.
#[derive(Clone, Copy)]
enum Auth<'a> {
    /// The App itself (its JWT, minted per request).
    AppJwt,
    /// The installation of this repository, or the personal access token.
    Repo(&'a Repo),
    /// The installation of this organisation, or the personal access token.
    Org(&'a str),
}

/// A bearer for one try, and the installation it belongs to (to drop it after a 401).
struct Bearer {
    value: String,
    installation: Option<u64>,
    /// For the rate-limit figures.
    credential: String,
}

/// A response that arrived, whatever its status.
struct Reply {
    operation: &'static str,
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    /// The reply itself if it is a 2xx, else the typed error. (A rate-limit answer never gets
    /// here: the retry loop turns it into [`ApiError::RateLimited`].)
    fn success(self) -> Result<Reply, ApiError> {
        if self.status.is_success() {
            return Ok(self);
        }
        Err(ApiError::Status { operation: self.operation, status: self.status, body: self.short_body() })
    }

    /// GitHub's error bodies are short JSON messages; cut so a proxy's HTML page stays readable.
    fn short_body(&self) -> String {
        String::from_utf8_lossy(&self.body).chars().take(500).collect()
    }

    fn json<T: DeserializeOwned>(&self) -> Result<T, ApiError> {
        let de = &mut serde_json::Deserializer::from_slice(&self.body);
        serde_path_to_error::deserialize(de).map_err(|e| ApiError::Decode {
            operation: self.operation,
            path: e.path().to_string(),
            source: e.into_inner(),
        })
    }

    /// Whether GitHub's `Link` header announces another page.
    fn has_next_page(&self) -> bool {
        self.headers
            .get_all(reqwest::header::LINK)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|link| link.split(';').skip(1).any(|param| param.trim() == "rel=\"next\""))
    }
}

const NO_BODY: Option<&()> = None;

/// A GitHub client. Cheap to share behind an `Arc`, or to clone: a clone shares the caches, the
/// figures and the rate-limit hold, so it is the same client to GitHub.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base_url: String,
    credentials: Credentials,
    retry: RetryPolicy,
    /// Nothing is sent before its end (GitHub's rate limits).
    gate: Arc<Gate>,
    /// (credential, resource) → the latest figures.
    rate_limits: Arc<std::sync::Mutex<BTreeMap<(String, String), RateLimit>>>,
    /// Requests sent, by result: `2xx`, `3xx`, `4xx`, `5xx`, `error` (no answer).
    requests: Arc<std::sync::Mutex<BTreeMap<&'static str, u64>>>,
    /// Installation id → token.
    tokens: Arc<Mutex<HashMap<u64, CachedToken>>>,
    repo_installations: Arc<Mutex<HashMap<Repo, u64>>>,
    /// Lower-cased organisation login → installation id (GitHub logins are case-insensitive).
    org_installations: Arc<Mutex<HashMap<String, u64>>>,
}

/// What the retry loop hands back: a 2xx still unread (a tarball streams), or any other answer read.
enum Answer {
    Success(reqwest::Response),
    Other(Reply),
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base_url", &self.base_url)
            .field("credentials", &self.credentials)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// `base_url` is `https://api.github.com`, `https://HOST/api/v3` for GitHub Enterprise Server, or a
    /// test server's address.
    pub fn new(base_url: impl Into<String>, credentials: Credentials) -> Self {
        let base_url = base_url.into().trim_end_matches('/').to_owned();
        // A connection GitHub never accepts must not hold a caller for the whole request timeout.
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        Self {
            http,
            base_url,
            credentials,
            retry: RetryPolicy::default(),
            gate: Arc::default(),
            rate_limits: Arc::default(),
            requests: Arc::default(),
            tokens: Arc::default(),
            repo_installations: Arc::default(),
            org_installations: Arc::default(),
        }
    }

    /// The same client with another retry policy (tests use short pauses).
    pub fn with_retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = RetryPolicy { attempts: policy.attempts.max(1), ..policy };
        self
    }

    pub fn is_app(&self) -> bool {
        matches!(self.credentials, Credentials::App(_))
    }

    /// Requests sent so far, by result (`2xx`, `3xx`, `4xx`, `5xx`, `error`: no answer).
    pub fn request_counts(&self) -> Vec<(&'static str, u64)> {
        self.requests.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, v)| (*k, *v)).collect()
    }

    /// Until when GitHub's rate limit holds this client back (nothing is sent before), while it
    /// does: for callers that say why they wait, and schedule no earlier.
    pub fn held_until(&self) -> Option<SystemTime> {
        self.gate.until().map(|end| end.wall)
    }

    /// GitHub's rate-limit figures as of the latest answer, per credential and resource.
    pub fn rate_limits(&self) -> Vec<RateLimit> {
        self.rate_limits.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    /// Drops `token` from the cache (GitHub refused it), unless another request already replaced it.
    async fn forget_token(&self, installation_id: u64, token: &str) {
        let mut tokens = self.tokens.lock().await;
        if tokens.get(&installation_id).is_some_and(|c| c.token.expose() == token) {
            tokens.remove(&installation_id);
        }
    }

    /// An installation access token, from the cache while it has more than 5 minutes left.
    pub async fn installation_token(&self, installation_id: u64) -> Result<Secret, ApiError> {
        const OP: &str = "create installation access token";
        if !self.is_app() {
            return Err(ApiError::AppOnly { operation: OP });
        }
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
        let resp: wire::InstallationToken = self
            .send(OP, Method::POST, &path, &[], Auth::AppJwt, Some(&serde_json::json!({})))
            .await?
            .success()?
            .json()?;
        let token = Secret::new(resp.token);
        tokens.insert(installation_id, CachedToken { token: token.clone(), expires_at: resp.expires_at });
        Ok(token)
    }

    /// Token for calls on `repo`: App → installation of the repo (GET /repos/{owner}/{repo}/installation,
    /// id cached per repo) then the cached installation token; Token → the PAT.
    pub async fn repo_token(&self, repo: &Repo) -> Result<Secret, ApiError> {
        self.repo_token_of(repo).await.map(|(token, _)| token)
    }

    /// [`Client::repo_token`] and the installation it belongs to (`None`: the personal token).
    async fn repo_token_of(&self, repo: &Repo) -> Result<(Secret, Option<u64>), ApiError> {
        const OP: &str = "get repository installation";
        if let Credentials::Token(pat) = &self.credentials {
            return Ok((pat.clone(), None));
        }
        let cached = self.repo_installations.lock().await.get(repo).copied();
        let installation_id = match cached {
            Some(id) => id,
            None => {
                let path = repo_path(OP, repo, &["installation"])?;
                let reply = self.send(OP, Method::GET, &path, &[], Auth::AppJwt, NO_BODY).await?;
                if reply.status == StatusCode::NOT_FOUND {
                    return Err(ApiError::NotInstalled { target: repo.full_name() });
                }
                let installation: wire::Installation = reply.success()?.json()?;
                self.repo_installations.lock().await.insert(repo.clone(), installation.id);
                installation.id
            }
        };
        let token = self.installation_token(installation_id).await.map(|t| (t, Some(installation_id)));
        if token.as_ref().is_err_and(|e| e.is_status(StatusCode::NOT_FOUND)) {
            // The app was uninstalled (and perhaps reinstalled under a new id): look it up afresh next time.
            self.repo_installations.lock().await.remove(repo);
        }
        token
    }

    /// Token for calls on organisation `org`: App → the installation whose account is `org` (from
    /// GET /app/installations, cached); Token → the PAT.
    async fn org_token(&self, org: &str) -> Result<(Secret, Option<u64>), ApiError> {
        const OP: &str = "list app installations";
        if let Credentials::Token(pat) = &self.credentials {
            return Ok((pat.clone(), None));
        }
        let key = org.to_ascii_lowercase();
        let cached = self.org_installations.lock().await.get(&key).copied();
        let installation_id = match cached {
            Some(id) => id,
            None => {
                let installations: Vec<wire::Installation> =
                    self.paginate(OP, "/app/installations", Vec::new(), Auth::AppJwt, |page| page).await?;
                let mut known = self.org_installations.lock().await;
                for installation in &installations {
                    if let Some(login) = installation.account.as_ref().and_then(|a| a.login.as_deref()) {
                        known.insert(login.to_ascii_lowercase(), installation.id);
                    }
                }
                *known.get(&key).ok_or_else(|| ApiError::NotInstalled { target: org.to_owned() })?
            }
        };
        let token = self.installation_token(installation_id).await.map(|t| (t, Some(installation_id)));
        if token.as_ref().is_err_and(|e| e.is_status(StatusCode::NOT_FOUND)) {
            self.org_installations.lock().await.remove(&key);
        }
        token
    }

    /// GETs `path` page by page (`per_page=100&page=N`) while GitHub's `Link` header names a next page,
    /// up to [`MAX_PAGES`].
    async fn paginate<P: DeserializeOwned, T>(
        &self,
        operation: &'static str,
        path: &str,
        mut query: Vec<(&'static str, String)>,
        auth: Auth<'_>,
        items: impl Fn(P) -> Vec<T>,
    ) -> Result<Vec<T>, ApiError> {
        query.push(("per_page", PER_PAGE.to_string()));
        query.push(("page", String::new()));
        let mut all = Vec::new();
        for page in 1..=MAX_PAGES {
            if let Some(last) = query.last_mut() {
                last.1 = page.to_string();
            }
            let reply = self.send(operation, Method::GET, path, &query, auth, NO_BODY).await?.success()?;
            let batch = items(reply.json()?);
            let done = batch.is_empty() || !reply.has_next_page();
            all.extend(batch);
            if done {
                break;
            }
        }
        Ok(all)
    }

    fn request(&self, method: Method, path: &str, query: &[(&str, String)], bearer: &str) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base_url))
            .bearer_auth(bearer)
            .header(reqwest::header::ACCEPT, "application/vnd.github+json")
            .header("X-GitHub-Api-Version", API_VERSION)
            .header(reqwest::header::USER_AGENT, USER_AGENT);
        if !query.is_empty() {
            req = req.query(query);
        }
        req
    }

    /// The bearer for one try: a fresh App JWT, or the installation's cached token.
    async fn bearer(&self, operation: &'static str, auth: Auth<'_>) -> Result<Bearer, ApiError> {
        let (token, installation) = match auth {
            Auth::AppJwt => {
                let Credentials::App(app) = &self.credentials else { return Err(ApiError::AppOnly { operation }) };
                let value = app.app_jwt(OffsetDateTime::now_utc())?;
                return Ok(Bearer { value, installation: None, credential: "app".into() });
            }
            // Boxed: finding the token sends requests of its own (as the App), through here.
            Auth::Repo(repo) => Box::pin(self.repo_token_of(repo)).await?,
            Auth::Org(org) => Box::pin(self.org_token(org)).await?,
        };
        let credential = match installation {
            Some(id) => format!("installation {id}"),
            None => "token".into(),
        };
        Ok(Bearer { value: token.expose().to_owned(), installation, credential })
    }

    /// Sends one request and reads the whole answer, trying again as the module header says. Only
    /// transport failures are errors here; the caller decides which statuses are fine (see
    /// [`Reply::success`]).
    async fn send<B: Serialize + ?Sized>(
        &self,
        operation: &'static str,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        auth: Auth<'_>,
        body: Option<&B>,
    ) -> Result<Reply, ApiError> {
        match self.exchange(operation, method, path, query, auth, body, self.retry.timeout).await? {
            Answer::Success(resp) => read(operation, resp).await,
            Answer::Other(reply) => Ok(reply),
        }
    }

    /// Waits out a rate-limit hold that ends within [`RetryPolicy::max_wait`]; a longer one is
    /// [`ApiError::RateLimited`], and nothing is sent.
    async fn pass_gate(&self, operation: &'static str) -> Result<(), ApiError> {
        while let Some(end) = self.gate.until() {
            if end.at.saturating_duration_since(tokio::time::Instant::now()) > self.retry.max_wait {
                return Err(ApiError::RateLimited { operation, until: end.wall, status: None, body: String::new() });
            }
            // Checked again after: another answer may have moved the end meanwhile.
            tokio::time::sleep_until(end.at).await;
        }
        Ok(())
    }

    /// The retry loop: sends until an answer is final. Every try passes the rate-limit gate first.
    #[allow(clippy::too_many_arguments)]
    async fn exchange<B: Serialize + ?Sized>(
        &self,
        operation: &'static str,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        auth: Auth<'_>,
        body: Option<&B>,
        timeout: std::time::Duration,
    ) -> Result<Answer, ApiError> {
        let repeatable = repeatable(&method, operation);
        let mut refreshed = false;
        let mut failed = 0;
        loop {
            self.pass_gate(operation).await?;
            let bearer = self.bearer(operation, auth).await?;
            // Finding the bearer may have taken a while (a token minted): the gate again.
            self.pass_gate(operation).await?;
            let mut req = self.request(method.clone(), path, query, &bearer.value).timeout(timeout);
            if let Some(body) = body {
                req = req.json(body);
            }
            let sent = tokio::time::Instant::now();
            let result = req.send().await;
            self.count(&result);
            let resp = match result {
                Ok(resp) => resp,
                // A connection never made carried nothing: any request may go again.
                Err(e) if e.is_connect() || repeatable => {
                    failed += 1;
                    match retry_pause(&self.retry, failed, jitter()) {
                        Some(pause) => {
                            tokio::time::sleep(pause).await;
                            continue;
                        }
                        None => return Err(ApiError::Transport { operation, source: e }),
                    }
                }
                Err(source) => return Err(ApiError::Transport { operation, source }),
            };
            let now = OffsetDateTime::now_utc().unix_timestamp();
            let status = resp.status();
            if let Some(limit) = RateLimit::from_headers(&bearer.credential, resp.headers(), now) {
                let mut limits = self.rate_limits.lock().unwrap_or_else(|e| e.into_inner());
                limits.insert((limit.credential.clone(), limit.resource.clone()), limit);
            }
            if status.is_success() {
                return Ok(Answer::Success(resp));
            }
            // Error bodies are short; a secondary rate limit is told apart from a missing
            // permission only by its message.
            let reply = read(operation, resp).await?;
            if status == StatusCode::UNAUTHORIZED {
                // GitHub revoked the installation token, or it expired before the cache thought:
                // drop it and try once with a fresh one. A 401 on the App's own JWT or on a
                // personal token will not pass by retrying.
                if let (Some(id), false) = (bearer.installation, refreshed) {
                    self.forget_token(id, &bearer.value).await;
                    refreshed = true;
                    continue;
                }
            }
            if let Some(limit) = ratelimit::limit_of(status, &reply.headers, &reply.body, now) {
                let end = self.gate.limited(limit, sent);
                failed += 1;
                // Sent again only once the hold is over (the gate sees to it); a request that was
                // refused created nothing, so any request may go again.
                let within = end.at.saturating_duration_since(tokio::time::Instant::now()) <= self.retry.max_wait;
                if within && failed < self.retry.attempts {
                    continue;
                }
                let body = reply.short_body();
                return Err(ApiError::RateLimited { operation, until: end.wall, status: Some(status), body });
            }
            if status.is_server_error() {
                // A 503 may say when to come back: every call waits for it, not only this one.
                if let Some(wait) = ratelimit::retry_after(&reply.headers, now) {
                    self.gate.limited(Limit::Hinted(wait), sent);
                }
                failed += 1;
                if repeatable {
                    if let Some(pause) = retry_pause(&self.retry, failed, jitter()) {
                        tokio::time::sleep(pause).await;
                        continue;
                    }
                }
            }
            return Ok(Answer::Other(reply));
        }
    }

    fn count(&self, result: &Result<reqwest::Response, reqwest::Error>) {
        let class = match result {
            Ok(r) if r.status().is_success() => "2xx",
            Ok(r) if r.status().is_redirection() => "3xx",
            Ok(r) if r.status().is_client_error() => "4xx",
            Ok(_) => "5xx",
            Err(_) => "error",
        };
        *self.requests.lock().unwrap_or_else(|e| e.into_inner()).entry(class).or_insert(0) += 1;
    }
}

/// Reads a whole answer.
async fn read(operation: &'static str, resp: reqwest::Response) -> Result<Reply, ApiError> {
    let (status, headers) = (resp.status(), resp.headers().clone());
    let body = resp.bytes().await.map_err(|source| ApiError::Transport { operation, source })?.to_vec();
    Ok(Reply { operation, status, headers, body })
}

/// `/repos/{owner}/{name}/{segments...}`, each part percent-encoded.
fn repo_path(operation: &'static str, repo: &Repo, segments: &[&str]) -> Result<String, ApiError> {
    let mut parts = vec!["repos", repo.owner.as_str(), repo.name.as_str()];
    parts.extend_from_slice(segments);
    url_path(operation, &parts)
}

/// `/orgs/{org}/{segments...}`, each part percent-encoded.
fn org_path(operation: &'static str, org: &str, segments: &[&str]) -> Result<String, ApiError> {
    let mut parts = vec!["orgs", org];
    parts.extend_from_slice(segments);
    url_path(operation, &parts)
}

/// Joins path segments, percent-encoding everything but RFC 3986's unreserved characters, so a label
/// like `needs gpu/ci` stays one segment. Empty, `.` and `..` segments are refused: URL parsers
/// resolve dot segments (even encoded ones), which would turn a label or file path into a different
/// API endpoint.
fn url_path(operation: &'static str, segments: &[&str]) -> Result<String, ApiError> {
    let mut path = String::new();
    for segment in segments {
        if segment.is_empty() || *segment == "." || *segment == ".." {
            return Err(ApiError::InvalidArgument {
                operation,
                reason: format!("path segment {segment:?} is empty or a dot segment"),
            });
        }
        path.push('/');
        for byte in segment.bytes() {
            if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
                path.push(char::from(byte));
            } else {
                // Writing to a String cannot fail.
                let _ = write!(path, "%{byte:02X}");
            }
        }
    }
    Ok(path)
}

/// Standard base64 with padding, ignoring the line breaks GitHub inserts every 60 characters.
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let symbols: Vec<u8> = text.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let quads = symbols.chunks_exact(4);
    if !quads.remainder().is_empty() {
        return None;
    }
    let count = quads.len();
    let mut out = Vec::with_capacity(count * 3);
    for (i, quad) in quads.enumerate() {
        let padding = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if padding > 2 || (padding > 0 && i + 1 != count) {
            return None;
        }
        let mut n = 0u32;
        for &c in &quad[..4 - padding] {
            n = (n << 6) | value(c)?;
        }
        n <<= 6 * padding as u32;
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - padding]);
    }
    Some(out)
}

#[cfg(test)]
mod tests;
