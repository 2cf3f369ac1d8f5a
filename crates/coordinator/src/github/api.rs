//! `GET /api/v1/github/jobs`: the GitHub workflow jobs gpuci serves or served, with the state
//! and reason of each — why a job has no runner yet, or why gpuci cancelled its run.

use crate::api::ApiError;
use crate::AppState;
use axum::extract::{Query, State};
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

#[derive(utoipa::OpenApi)]
#[openapi(paths(list_github_jobs), components(schemas(GithubJob)))]
pub struct GithubApiDoc;

/// GitHub workflow jobs that matched a runner pool, newest first.
#[utoipa::path(get, path = "/api/v1/github/jobs", params(GithubJobsQuery),
    responses((status = 200, body = Vec<GithubJob>), (status = 400, body = gpuci_protocol::api::ErrorBody)))]
pub async fn list_github_jobs(
    State(st): State<AppState>,
    q: Result<Query<GithubJobsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<GithubJob>>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::new(axum::http::StatusCode::BAD_REQUEST, e.body_text()))?;
    let records = st.store.github_jobs(q.active, q.limit.unwrap_or(100).min(1000)).await?;
    Ok(Json(
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
    ))
}
