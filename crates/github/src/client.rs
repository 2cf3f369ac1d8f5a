//! A small GitHub REST client for the operations gpuci needs. Every request carries GitHub's media
//! type, API version and a User-Agent (GitHub rejects requests without one).
//!
//! Two kinds of credentials: a GitHub App (app JWT → per-installation tokens, found per repository or
//! organisation and cached) or a personal access token for a single repository.

use std::collections::HashMap;
use std::fmt::Write as _;

use reqwest::header::HeaderMap;
use reqwest::{Method, StatusCode};
use serde::{de::DeserializeOwned, Serialize};
use time::{Duration, OffsetDateTime};
use tokio::sync::Mutex;

use crate::auth::{AppCredentials, AuthError, Secret};
// Re-exported so `client::JitConfig` and `client::JitRunnerSpec` keep working; they moved to `types`.
use crate::types::{
    wire, CheckRunUpdate, CommitStatus, NewCheckRun, Permission, Repo, Runner, WorkflowJob, WorkflowRun,
};
pub use crate::types::{JitConfig, JitRunnerSpec};

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
/// GitHub rejects commit status descriptions longer than this (in characters).
const STATUS_DESCRIPTION_MAX_CHARS: usize = 140;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("GitHub {operation}: request failed: {source}")]
    Transport { operation: &'static str, source: reqwest::Error },
    /// `rate_limited` is GitHub saying "slow down" (429, or 403 with an exhausted rate limit or a
    /// `retry-after`), as opposed to a 403 for missing permissions.
    #[error("GitHub {operation}: HTTP {status}: {body}")]
    Status { operation: &'static str, status: StatusCode, rate_limited: bool, body: String },
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

impl ApiError {
    /// Whether retrying the same request later may succeed (network trouble, rate limits, GitHub 5xx).
    pub fn is_transient(&self) -> bool {
        match self {
            ApiError::Transport { .. } => true,
            ApiError::Status { status, rate_limited, .. } => status.is_server_error() || *rate_limited,
            ApiError::Decode { .. }
            | ApiError::Auth(_)
            | ApiError::AppOnly { .. }
            | ApiError::NotInstalled { .. }
            | ApiError::TooLarge { .. }
            | ApiError::InvalidArgument { .. }
            | ApiError::UnsupportedContent { .. } => false,
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

#[derive(Clone, Copy)]
enum Auth<'a> {
    AppJwt,
    Token(&'a Secret),
}

/// A response that arrived, whatever its status.
struct Reply {
    operation: &'static str,
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    /// The reply itself if it is a 2xx, else the typed error.
    fn success(self) -> Result<Reply, ApiError> {
        if self.status.is_success() {
            return Ok(self);
        }
        let remaining_zero = self.headers.get("x-ratelimit-remaining").is_some_and(|v| v.as_bytes() == b"0");
        let rate_limited = self.status == StatusCode::TOO_MANY_REQUESTS
            || (self.status == StatusCode::FORBIDDEN && (remaining_zero || self.headers.contains_key("retry-after")));
        // GitHub's error bodies are short JSON messages; cap them so a proxy's HTML page stays readable.
        let body: String = String::from_utf8_lossy(&self.body).chars().take(500).collect();
        Err(ApiError::Status { operation: self.operation, status: self.status, rate_limited, body })
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

/// A GitHub client. Cheap to share behind an `Arc`; the caches are internal.
pub struct Client {
    http: reqwest::Client,
    base_url: String,
    credentials: Credentials,
    /// Installation id → token.
    tokens: Mutex<HashMap<u64, CachedToken>>,
    repo_installations: Mutex<HashMap<Repo, u64>>,
    /// Lower-cased organisation login → installation id (GitHub logins are case-insensitive).
    org_installations: Mutex<HashMap<String, u64>>,
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
        Self {
            http: reqwest::Client::new(),
            base_url,
            credentials,
            tokens: Mutex::new(HashMap::new()),
            repo_installations: Mutex::new(HashMap::new()),
            org_installations: Mutex::new(HashMap::new()),
        }
    }

    pub fn is_app(&self) -> bool {
        matches!(self.credentials, Credentials::App(_))
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
            .call(OP, Method::POST, &path, &[], Auth::AppJwt, Some(&serde_json::json!({})))
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
        const OP: &str = "get repository installation";
        if let Credentials::Token(pat) = &self.credentials {
            return Ok(pat.clone());
        }
        let cached = self.repo_installations.lock().await.get(repo).copied();
        let installation_id = match cached {
            Some(id) => id,
            None => {
                let path = repo_path(OP, repo, &["installation"])?;
                let reply = self.call(OP, Method::GET, &path, &[], Auth::AppJwt, NO_BODY).await?;
                if reply.status == StatusCode::NOT_FOUND {
                    return Err(ApiError::NotInstalled { target: repo.full_name() });
                }
                let installation: wire::Installation = reply.success()?.json()?;
                self.repo_installations.lock().await.insert(repo.clone(), installation.id);
                installation.id
            }
        };
        let token = self.installation_token(installation_id).await;
        if token.as_ref().is_err_and(|e| e.is_status(StatusCode::NOT_FOUND)) {
            // The app was uninstalled (and perhaps reinstalled under a new id): look it up afresh next time.
            self.repo_installations.lock().await.remove(repo);
        }
        token
    }

    /// Token for calls on organisation `org`: App → the installation whose account is `org` (from
    /// GET /app/installations, cached); Token → the PAT.
    async fn org_token(&self, org: &str) -> Result<Secret, ApiError> {
        const OP: &str = "list app installations";
        if let Credentials::Token(pat) = &self.credentials {
            return Ok(pat.clone());
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
        let token = self.installation_token(installation_id).await;
        if token.as_ref().is_err_and(|e| e.is_status(StatusCode::NOT_FOUND)) {
            self.org_installations.lock().await.remove(&key);
        }
        token
    }

    /// Registers a just-in-time runner on `repo`.
    pub async fn generate_jitconfig(&self, repo: &Repo, spec: &JitRunnerSpec) -> Result<JitConfig, ApiError> {
        const OP: &str = "generate JIT runner config";
        let path = repo_path(OP, repo, &["actions", "runners", "generate-jitconfig"])?;
        let token = self.repo_token(repo).await?;
        let resp: wire::JitConfigResponse =
            self.call(OP, Method::POST, &path, &[], Auth::Token(&token), Some(spec)).await?.success()?.json()?;
        Ok(jit_config(resp))
    }

    /// Registers a just-in-time runner on organisation `org`.
    pub async fn generate_org_jitconfig(&self, org: &str, spec: &JitRunnerSpec) -> Result<JitConfig, ApiError> {
        const OP: &str = "generate organization JIT runner config";
        let path = org_path(OP, org, &["actions", "runners", "generate-jitconfig"])?;
        let token = self.org_token(org).await?;
        let resp: wire::JitConfigResponse =
            self.call(OP, Method::POST, &path, &[], Auth::Token(&token), Some(spec)).await?.success()?.json()?;
        Ok(jit_config(resp))
    }

    /// Removes a runner from `repo`; one that is already gone (404) counts as removed.
    pub async fn delete_runner(&self, repo: &Repo, runner_id: u64) -> Result<(), ApiError> {
        const OP: &str = "delete repository runner";
        let path = repo_path(OP, repo, &["actions", "runners", &runner_id.to_string()])?;
        let token = self.repo_token(repo).await?;
        let reply = self.call(OP, Method::DELETE, &path, &[], Auth::Token(&token), NO_BODY).await?;
        if reply.status != StatusCode::NOT_FOUND {
            reply.success()?;
        }
        Ok(())
    }

    /// Removes a runner from organisation `org`; one that is already gone (404) counts as removed.
    pub async fn delete_org_runner(&self, org: &str, runner_id: u64) -> Result<(), ApiError> {
        const OP: &str = "delete organization runner";
        let path = org_path(OP, org, &["actions", "runners", &runner_id.to_string()])?;
        let token = self.org_token(org).await?;
        let reply = self.call(OP, Method::DELETE, &path, &[], Auth::Token(&token), NO_BODY).await?;
        if reply.status != StatusCode::NOT_FOUND {
            reply.success()?;
        }
        Ok(())
    }

    /// The self-hosted runners registered on `repo` (all pages, up to 1000 runners).
    pub async fn list_runners(&self, repo: &Repo) -> Result<Vec<Runner>, ApiError> {
        const OP: &str = "list repository runners";
        let path = repo_path(OP, repo, &["actions", "runners"])?;
        let token = self.repo_token(repo).await?;
        self.paginate(OP, &path, Vec::new(), Auth::Token(&token), |page: wire::RunnerPage| page.runners).await
    }

    /// Cancels a workflow run; one that already finished (409) counts as cancelled.
    pub async fn cancel_run(&self, repo: &Repo, run_id: u64) -> Result<(), ApiError> {
        const OP: &str = "cancel workflow run";
        let path = repo_path(OP, repo, &["actions", "runs", &run_id.to_string(), "cancel"])?;
        let token = self.repo_token(repo).await?;
        let reply = self.call(OP, Method::POST, &path, &[], Auth::Token(&token), NO_BODY).await?;
        if reply.status != StatusCode::CONFLICT {
            reply.success()?;
        }
        Ok(())
    }

    /// GET /repos/{owner}/{repo}/actions/runs?status=..&head_sha=..&per_page=100, following pages up to 10.
    pub async fn list_runs(
        &self,
        repo: &Repo,
        status: Option<&str>,
        head_sha: Option<&str>,
    ) -> Result<Vec<WorkflowRun>, ApiError> {
        const OP: &str = "list workflow runs";
        let path = repo_path(OP, repo, &["actions", "runs"])?;
        let mut query = Vec::new();
        if let Some(status) = status {
            query.push(("status", status.to_owned()));
        }
        if let Some(head_sha) = head_sha {
            query.push(("head_sha", head_sha.to_owned()));
        }
        let token = self.repo_token(repo).await?;
        self.paginate(OP, &path, query, Auth::Token(&token), |page: wire::RunPage| {
            page.workflow_runs.into_iter().map(WorkflowRun::from).collect()
        })
        .await
    }

    /// The jobs of the latest attempt of a workflow run (all pages, up to 1000 jobs).
    pub async fn list_run_jobs(&self, repo: &Repo, run_id: u64) -> Result<Vec<WorkflowJob>, ApiError> {
        const OP: &str = "list workflow run jobs";
        let path = repo_path(OP, repo, &["actions", "runs", &run_id.to_string(), "jobs"])?;
        let token = self.repo_token(repo).await?;
        self.paginate(OP, &path, Vec::new(), Auth::Token(&token), |page: wire::JobPage| {
            page.jobs.into_iter().map(WorkflowJob::from).collect()
        })
        .await
    }

    pub async fn get_job(&self, repo: &Repo, job_id: u64) -> Result<WorkflowJob, ApiError> {
        const OP: &str = "get workflow job";
        let path = repo_path(OP, repo, &["actions", "jobs", &job_id.to_string()])?;
        let token = self.repo_token(repo).await?;
        let job: wire::WorkflowJob =
            self.call(OP, Method::GET, &path, &[], Auth::Token(&token), NO_BODY).await?.success()?.json()?;
        Ok(job.into())
    }

    /// Creates a check run and returns its id. Check runs are a GitHub App feature: GitHub refuses
    /// personal access tokens, so with one this fails at once with [`ApiError::AppOnly`] (use
    /// [`Client::create_status`] instead).
    pub async fn create_check_run(&self, repo: &Repo, run: &NewCheckRun) -> Result<u64, ApiError> {
        const OP: &str = "create check run";
        if !self.is_app() {
            return Err(ApiError::AppOnly { operation: OP });
        }
        let path = repo_path(OP, repo, &["check-runs"])?;
        let token = self.repo_token(repo).await?;
        let created: wire::CheckRun =
            self.call(OP, Method::POST, &path, &[], Auth::Token(&token), Some(run)).await?.success()?.json()?;
        Ok(created.id)
    }

    /// Updates the fields of a check run that are set in `update` (GitHub App only, as above).
    pub async fn update_check_run(
        &self,
        repo: &Repo,
        check_run_id: u64,
        update: &CheckRunUpdate,
    ) -> Result<(), ApiError> {
        const OP: &str = "update check run";
        if !self.is_app() {
            return Err(ApiError::AppOnly { operation: OP });
        }
        let path = repo_path(OP, repo, &["check-runs", &check_run_id.to_string()])?;
        let token = self.repo_token(repo).await?;
        self.call(OP, Method::PATCH, &path, &[], Auth::Token(&token), Some(update)).await?.success()?;
        Ok(())
    }

    /// Sets a commit status on `sha`. A description over GitHub's 140 characters is cut to fit (with
    /// `…`) rather than rejected, since it is only a summary.
    pub async fn create_status(&self, repo: &Repo, sha: &str, status: &CommitStatus) -> Result<(), ApiError> {
        const OP: &str = "create commit status";
        let path = repo_path(OP, repo, &["statuses", sha])?;
        let mut status = status.clone();
        if let Some(description) = &mut status.description {
            if description.chars().count() > STATUS_DESCRIPTION_MAX_CHARS {
                *description = description.chars().take(STATUS_DESCRIPTION_MAX_CHARS - 1).chain(['…']).collect();
            }
        }
        let token = self.repo_token(repo).await?;
        self.call(OP, Method::POST, &path, &[], Auth::Token(&token), Some(&status)).await?.success()?;
        Ok(())
    }

    /// Removes `label` from an issue or pull request; a label that is not there (404) counts as removed.
    pub async fn remove_label(&self, repo: &Repo, issue_number: u64, label: &str) -> Result<(), ApiError> {
        const OP: &str = "remove label";
        let path = repo_path(OP, repo, &["issues", &issue_number.to_string(), "labels", label])?;
        let token = self.repo_token(repo).await?;
        let reply = self.call(OP, Method::DELETE, &path, &[], Auth::Token(&token), NO_BODY).await?;
        if reply.status != StatusCode::NOT_FOUND {
            reply.success()?;
        }
        Ok(())
    }

    /// `username`'s role on `repo`; [`Permission::None`] when GitHub does not know them (404).
    pub async fn collaborator_permission(&self, repo: &Repo, username: &str) -> Result<Permission, ApiError> {
        const OP: &str = "get collaborator permission";
        let path = repo_path(OP, repo, &["collaborators", username, "permission"])?;
        let token = self.repo_token(repo).await?;
        let reply = self.call(OP, Method::GET, &path, &[], Auth::Token(&token), NO_BODY).await?;
        if reply.status == StatusCode::NOT_FOUND {
            return Ok(Permission::None);
        }
        let resp: wire::CollaboratorPermission = reply.success()?.json()?;
        Ok(Permission::from_response(resp.role_name.as_deref(), resp.permission.as_deref()))
    }

    /// GET contents/{path}?ref=..; None on 404; decodes the base64 `content` (GitHub wraps lines with \n).
    ///
    /// Directories, symlinks, submodules and files over 1 MB (for which GitHub sends no content) are
    /// [`ApiError::UnsupportedContent`].
    pub async fn file_contents(&self, repo: &Repo, path: &str, git_ref: &str) -> Result<Option<Vec<u8>>, ApiError> {
        const OP: &str = "get repository content";
        let file_segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let mut segments = vec!["contents"];
        segments.extend(&file_segments);
        let url_path = repo_path(OP, repo, &segments)?;
        let token = self.repo_token(repo).await?;
        let query = [("ref", git_ref.to_owned())];
        let reply = self.call(OP, Method::GET, &url_path, &query, Auth::Token(&token), NO_BODY).await?;
        if reply.status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let unsupported =
            |reason: String| ApiError::UnsupportedContent { operation: OP, path: path.to_owned(), reason };
        let entry = match reply.success()?.json()? {
            wire::Contents::Directory(entries) => {
                return Err(unsupported(format!("is a directory ({} entries), not a file", entries.len())))
            }
            wire::Contents::Entry(entry) => entry,
        };
        if entry.kind != "file" {
            return Err(unsupported(format!("is a {}, not a file", entry.kind)));
        }
        match (entry.encoding.as_deref(), entry.content) {
            (Some("base64"), Some(content)) => {
                decode_base64(&content).map(Some).ok_or_else(|| unsupported("content is not valid base64".into()))
            }
            (encoding, _) => Err(unsupported(format!(
                "GitHub sent no inline content (encoding {encoding:?}; files over 1 MB are not inlined)"
            ))),
        }
    }

    /// GET tarball/{ref}; follows GitHub's redirect; refuses bodies over max_bytes (ApiError variant, not transient).
    ///
    /// GitHub redirects to another host (codeload); the HTTP client drops the `Authorization` header on
    /// such a redirect, so the token never leaves for a host it was not issued for.
    pub async fn tarball(&self, repo: &Repo, git_ref: &str, max_bytes: u64) -> Result<Vec<u8>, ApiError> {
        const OP: &str = "download tarball";
        let mut segments = vec!["tarball"];
        segments.extend(git_ref.split('/'));
        let path = repo_path(OP, repo, &segments)?;
        let token = self.repo_token(repo).await?;
        let too_large = ApiError::TooLarge { operation: OP, limit: max_bytes };
        let transport = |source| ApiError::Transport { operation: OP, source };
        let mut resp = self.request(Method::GET, &path, &[], token.expose()).send().await.map_err(transport)?;
        if !resp.status().is_success() {
            let (status, headers) = (resp.status(), resp.headers().clone());
            let body = resp.bytes().await.map_err(transport)?.to_vec();
            return Reply { operation: OP, status, headers, body }.success().map(|_| Vec::new());
        }
        if resp.content_length().is_some_and(|len| len > max_bytes) {
            return Err(too_large);
        }
        // Counted as it streams: a chunked response has no length to check up front.
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(transport)? {
            if (body.len() + chunk.len()) as u64 > max_bytes {
                return Err(too_large);
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
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
            let reply = self.call(operation, Method::GET, path, &query, auth, NO_BODY).await?.success()?;
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

    /// Sends one request and reads the whole response. Only transport failures are errors here; the
    /// caller decides which statuses are fine (see [`Reply::success`]).
    async fn call<B: Serialize + ?Sized>(
        &self,
        operation: &'static str,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        auth: Auth<'_>,
        body: Option<&B>,
    ) -> Result<Reply, ApiError> {
        let bearer = match (auth, &self.credentials) {
            (Auth::AppJwt, Credentials::App(app)) => app.app_jwt(OffsetDateTime::now_utc())?,
            (Auth::AppJwt, Credentials::Token(_)) => return Err(ApiError::AppOnly { operation }),
            (Auth::Token(token), _) => token.expose().to_owned(),
        };
        let mut req = self.request(method, path, query, &bearer);
        if let Some(body) = body {
            req = req.json(body);
        }
        let transport = |source| ApiError::Transport { operation, source };
        let resp = req.send().await.map_err(transport)?;
        let (status, headers) = (resp.status(), resp.headers().clone());
        let body = resp.bytes().await.map_err(transport)?.to_vec();
        Ok(Reply { operation, status, headers, body })
    }
}

fn jit_config(resp: wire::JitConfigResponse) -> JitConfig {
    JitConfig {
        runner_id: resp.runner.id,
        runner_name: resp.runner.name,
        encoded_jit_config: Secret::new(resp.encoded_jit_config),
    }
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
mod tests {
    use super::*;

    #[test]
    fn base64_decodes_github_wrapped_content() {
        assert_eq!(decode_base64("aGVs\nbG8g\nd29y\nbGQ=\n").as_deref(), Some(&b"hello world"[..]));
        assert_eq!(decode_base64("YQ==").as_deref(), Some(&b"a"[..]));
        assert_eq!(decode_base64("YWI=").as_deref(), Some(&b"ab"[..]));
        assert_eq!(decode_base64("").as_deref(), Some(&b""[..]));
        assert_eq!(decode_base64("+/+/").as_deref(), Some(&[0xfb, 0xff, 0xbf][..]));
        for bad in ["YQ=", "Y===", "YQ==YQ==", "YQ!=", "YW\u{e9}="] {
            assert_eq!(decode_base64(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn paths_are_encoded_segment_by_segment() {
        let repo = Repo::parse("gpu-lab/kernels").expect("repo");
        assert_eq!(
            repo_path("t", &repo, &["issues", "5", "labels", "needs gpu/ci: 100%"]).expect("path"),
            "/repos/gpu-lab/kernels/issues/5/labels/needs%20gpu%2Fci%3A%20100%25"
        );
        for bad in ["..", ".", ""] {
            let err = repo_path("t", &repo, &["labels", bad]).expect_err("dot segment");
            assert!(matches!(err, ApiError::InvalidArgument { .. }) && !err.is_transient(), "{err:?}");
        }
        let sneaky = Repo { owner: "..".into(), name: "x".into() };
        assert!(repo_path("t", &sneaky, &[]).is_err());
    }
}
