//! `GET /api/v1/github/jobs`: the GitHub workflow jobs gpuci serves or served, with the state
//! and reason of each — why a job has no runner yet, or why gpuci cancelled its run.
//! `GET /api/v1/github/status`: whether GitHub is configured, GitHub's rate-limit figures per
//! credential as gpuci last saw them, and how many workflow jobs are in each state.
//!
//! Its answer also carries GitHub's rate-limit figures as gpuci last saw them, in headers (the
//! body stays the list it always was): those of the credential with the fewest requests left,
//! `x-gpuci-github-ratelimit-{limit,remaining,used,reset,credential}`, named after GitHub's own.

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::Json;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct GithubJob {
    /// GitHub's workflow job id.
    pub id: i64,
    pub repository: String,
    pub run_id: i64,
    pub name: String,
    pub labels: Vec<String>,
    pub pool: String,
    /// `queued`, `in_progress`, `completed`, `cancelled` (by gpuci), `refused` or `stuck`.
    pub state: String,
    pub reason: String,
    /// The gpuci job running its runner.
    pub runner_job_id: Option<i64>,
    /// The runner that took it.
    pub runner_name: Option<String>,
    pub queued_at_ms: i64,
    pub updated_at_ms: i64,
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct GithubJobsQuery {
    /// Only jobs still queued or in progress.
    #[serde(default)]
    pub active: bool,
    /// At most this many, newest first (default 100, at most 1000).
    pub limit: Option<u32>,
}

/// One rate limit as GitHub last reported it (`x-ratelimit-*` headers).
#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct RateLimitView {
    /// Whose: `app`, `installation <id>` or `token`.
    pub credential: String,
    /// `core` for the REST API.
    pub resource: String,
    pub limit: u64,
    pub remaining: u64,
    pub used: Option<u64>,
    /// When the window resets, Unix seconds.
    pub reset: i64,
    /// When GitHub said so, Unix seconds.
    pub observed_at: i64,
}

#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct GithubStatus {
    /// Whether the coordinator has a `[github]` section.
    pub configured: bool,
    /// Fewest requests left first.
    pub rate_limits: Vec<RateLimitView>,
    /// Workflow jobs still queued or in progress, by state.
    pub active_jobs: std::collections::BTreeMap<String, u64>,
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(list_github_jobs, github_status), components(schemas(GithubJob, GithubStatus, RateLimitView)))]
pub struct GithubApiDoc;

/// The GitHub integration at a glance: rate limits left, workflow jobs waiting.
#[utoipa::path(get, path = "/api/v1/github/status", responses((status = 200, body = GithubStatus)))]
pub async fn github_status(State(st): State<AppState>) -> Result<Json<GithubStatus>, ApiError> {
    let mut rate_limits: Vec<RateLimitView> = st
        .github
        .as_ref()
        .map(|g| g.client.rate_limits())
        .unwrap_or_default()
        .into_iter()
        .map(|l| RateLimitView {
            credential: l.credential,
            resource: l.resource,
            limit: l.limit,
            remaining: l.remaining,
            used: l.used,
            reset: l.reset,
            observed_at: l.observed_at,
        })
        .collect();
    rate_limits.sort_by(|a, b| (a.remaining, &a.credential).cmp(&(b.remaining, &b.credential)));
    let mut active_jobs = std::collections::BTreeMap::new();
    for r in st.store.github_jobs(true, 100_000).await? {
        *active_jobs.entry(r.state).or_insert(0) += 1;
    }
    Ok(Json(GithubStatus { configured: st.github.is_some(), rate_limits, active_jobs }))
}

/// GitHub workflow jobs that matched a runner pool, newest first. The headers carry GitHub's
/// rate-limit figures for the credential with the fewest requests left, once gpuci has called
/// GitHub.
#[utoipa::path(get, path = "/api/v1/github/jobs", params(GithubJobsQuery),
    responses(
        (status = 200, body = Vec<GithubJob>, headers(
            ("x-gpuci-github-ratelimit-limit" = u64, description = "GitHub's `x-ratelimit-limit`: requests per window"),
            ("x-gpuci-github-ratelimit-remaining" = u64, description = "GitHub's `x-ratelimit-remaining`"),
            ("x-gpuci-github-ratelimit-used" = u64, description = "GitHub's `x-ratelimit-used`"),
            ("x-gpuci-github-ratelimit-reset" = i64, description = "GitHub's `x-ratelimit-reset`: when the window resets, Unix seconds"),
            ("x-gpuci-github-ratelimit-credential" = String, description = "whose figures: `installation <id>`, `app` or `token`"),
        )),
        (status = 400, body = gpuci_protocol::api::ErrorBody)))]
pub async fn list_github_jobs(
    State(st): State<AppState>,
    q: Result<Query<GithubJobsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<(HeaderMap, Json<Vec<GithubJob>>), ApiError> {
    let Query(q) = q.map_err(|e| ApiError::new(axum::http::StatusCode::BAD_REQUEST, e.body_text()))?;
    let records = st.store.github_jobs(q.active, q.limit.unwrap_or(100).min(1000)).await?;
    let limits = st.github.as_ref().map(|g| g.client.rate_limits()).unwrap_or_default();
    Ok((
        rate_limit_headers(&limits),
        Json(
            records
                .into_iter()
                .map(|r| GithubJob {
                    id: r.id,
                    repository: r.repository,
                    run_id: r.run_id,
                    name: r.name,
                    labels: r.labels,
                    pool: r.pool,
                    state: r.state,
                    reason: r.reason,
                    runner_job_id: r.runner_job_id,
                    runner_name: r.runner_name,
                    queued_at_ms: r.queued_at_ms,
                    updated_at_ms: r.updated_at_ms,
                })
                .collect(),
        ),
    ))
}

/// The figures of the REST (`core`) limit with the fewest requests left, as headers.
pub fn rate_limit_headers(limits: &[gpuci_github::RateLimit]) -> HeaderMap {
    let mut h = HeaderMap::new();
    let Some(l) = limits.iter().filter(|l| l.resource == "core").min_by_key(|l| (l.remaining, l.credential.clone()))
    else {
        return h;
    };
    let mut put = |name: &'static str, value: String| {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(HeaderName::from_static(name), v);
        }
    };
    put("x-gpuci-github-ratelimit-limit", l.limit.to_string());
    put("x-gpuci-github-ratelimit-remaining", l.remaining.to_string());
    if let Some(used) = l.used {
        put("x-gpuci-github-ratelimit-used", used.to_string());
    }
    put("x-gpuci-github-ratelimit-reset", l.reset.to_string());
    put("x-gpuci-github-ratelimit-credential", l.credential.clone());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(credential: &str, resource: &str, remaining: u64) -> gpuci_github::RateLimit {
        gpuci_github::RateLimit {
            credential: credential.into(),
            resource: resource.into(),
            limit: 5000,
            remaining,
            used: Some(5000 - remaining),
            reset: 1_700_003_600,
            observed_at: 1_700_000_000,
        }
    }

    #[test]
    fn the_headers_show_the_credential_with_the_fewest_requests_left() {
        assert!(rate_limit_headers(&[]).is_empty(), "nothing before gpuci has called GitHub");
        let h = rate_limit_headers(&[
            limit("app", "core", 4999),
            limit("installation 31", "core", 120),
            limit("installation 32", "search", 2),
        ]);
        let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        assert_eq!(get("x-gpuci-github-ratelimit-credential"), "installation 31");
        assert_eq!(get("x-gpuci-github-ratelimit-remaining"), "120");
        assert_eq!(get("x-gpuci-github-ratelimit-limit"), "5000");
        assert_eq!(get("x-gpuci-github-ratelimit-used"), "4880");
        assert_eq!(get("x-gpuci-github-ratelimit-reset"), "1700003600");
    }
}
