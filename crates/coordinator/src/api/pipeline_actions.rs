//! Actions on a whole pipeline: "retry failed" (a new attempt of each failed job and what
//! depended on it, as `gpuci_core::rerun` decides) and "cancel all" (every unfinished job).
//! Both change state: the API token or a named token (the read-only token gets a 403, as on
//! every `/api/v1` change), each recorded in the audit log before the answer. The dashboard's
//! buttons (`ui::pipeline`) ask the brain the same commands after their own checks.

use crate::api::{agent_names, summarize};
use crate::brain::Command;
use crate::error::{ApiPath, ApiResult};
use crate::state::AppState;
use axum::extract::State;
use axum::{Extension, Json};
use gpuci_core::audit::AuditAction;
use gpuci_protocol::api::{ErrorBody, JobSummary};
use gpuci_protocol::PipelineId;

/// Runs the pipeline's failed, timed-out and lost jobs again, with every job after them.
#[utoipa::path(post, path = "/api/v1/pipelines/{id}/retry-failed", params(("id" = i64, Path, description = "pipeline id")),
    responses((status = 200, description = "the new attempts, queued", body = Vec<JobSummary>),
        (status = 400, description = "the id is not an integer", body = ErrorBody),
        (status = 403, description = "the read-only token changes nothing", body = ErrorBody),
        (status = 404, description = "no such pipeline", body = ErrorBody),
        (status = 409, description = "no failed job to retry, or a pipeline of a GitHub Actions runner", body = ErrorBody),
        (status = 503, description = "the server is shutting down, or its database cannot store this now; try again later", body = ErrorBody)))]
pub async fn retry_failed(
    State(st): State<AppState>,
    Extension(actor): Extension<crate::api::audit::Actor>,
    ApiPath(id): ApiPath<PipelineId>,
) -> ApiResult<Json<Vec<JobSummary>>> {
    let by = format!("{} {}", actor.kind, actor.name);
    let r = st.ask(|reply| Command::RetryFailed { pipeline: id, by, reply }).await;
    let audited =
        crate::api::audit::record(&st, &actor, AuditAction::JobRetry, format!("pipeline {id} (failed jobs)"), &r).await;
    let jobs = r?;
    audited?;
    Ok(Json(summarize(&jobs, &agent_names(st.store.as_ref(), &jobs).await)))
}

/// Cancels every unfinished job of the pipeline.
#[utoipa::path(post, path = "/api/v1/pipelines/{id}/cancel", params(("id" = i64, Path, description = "pipeline id")),
    responses((status = 200, description = "the jobs cancelled (or being cancelled); empty when all had ended", body = Vec<JobSummary>),
        (status = 400, description = "the id is not an integer", body = ErrorBody),
        (status = 403, description = "the read-only token changes nothing", body = ErrorBody),
        (status = 404, description = "no such pipeline", body = ErrorBody),
        (status = 503, description = "the server is shutting down, or its database cannot store this now; try again later", body = ErrorBody)))]
pub async fn cancel_pipeline(
    State(st): State<AppState>,
    Extension(actor): Extension<crate::api::audit::Actor>,
    ApiPath(id): ApiPath<PipelineId>,
) -> ApiResult<Json<Vec<JobSummary>>> {
    let reason = format!("pipeline cancelled by {}", actor.name);
    let r = st.ask(|reply| Command::CancelPipeline { pipeline: id, reason, reply }).await;
    let audited =
        crate::api::audit::record(&st, &actor, AuditAction::JobCancel, format!("pipeline {id} (all jobs)"), &r).await;
    let jobs = r?;
    audited?;
    Ok(Json(summarize(&jobs, &agent_names(st.store.as_ref(), &jobs).await)))
}
