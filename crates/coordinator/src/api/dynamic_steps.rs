//! `POST /api/v1/jobs/{id}/steps`: a running job adds steps to its own pipeline, with its job
//! token as the bearer token. The token, the rules and the brain's half are
//! [`crate::brain::dynamic_steps`]'; each upload that passed the token check is recorded in the
//! audit log with the job as actor.

use crate::api::audit::Actor;
use crate::brain::dynamic_steps::{AddError, JOB_TOKEN_ENV};
use crate::brain::{BrainError, Command};
use crate::error::{ApiError, ApiJson, ApiPath};
use crate::state::AppState;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use gpuci_core::audit::AuditAction;
use gpuci_core::pipeline::upload::{MAX_UPLOADS_PER_JOB, MAX_UPLOAD_BYTES};
use gpuci_protocol::api::{ErrorBody, PipelineErrorBody, StepsAdded, UploadSteps};
use gpuci_protocol::JobId;

fn unauthorized(msg: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, msg)
}

/// Adds steps to the pipeline of job `id`, from inside that job (its `GPUCI_JOB_TOKEN` as the
/// bearer token; `gpuci pipeline upload`).
#[utoipa::path(post, path = "/api/v1/jobs/{id}/steps", params(("id" = i64, Path, description = "the uploading job's id")),
    request_body = UploadSteps,
    security(("job_token" = [])),
    responses((status = 201, description = "the jobs added", body = StepsAdded),
        (status = 400, description = "the id is not an integer, or the body is not JSON", body = ErrorBody),
        (status = 401, description = "no job token, not this job's, or the job is not running", body = ErrorBody),
        (status = 413, description = "the file is larger than 256 KiB", body = ErrorBody),
        (status = 422, description = "the file is not a valid pipeline, or names a key the pipeline has", body = ErrorBody),
        (status = 429, description = "the job has made 16 uploads", body = ErrorBody),
        (status = 503, description = "the server is shutting down, or its database cannot store this now; try again later", body = ErrorBody)))]
pub async fn add_steps(
    State(st): State<AppState>,
    ApiPath(id): ApiPath<JobId>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<UploadSteps>,
) -> Result<(StatusCode, Json<StepsAdded>), ApiError> {
    let Some(token) = crate::auth::bearer(&headers) else {
        return Err(unauthorized(format!(
            "a job token is needed ({JOB_TOKEN_ENV} of job {id}, as Authorization: Bearer)"
        )));
    };
    let hash = crate::auth::hash(token);
    // Compared as digests: equal digests of unequal tokens are out of reach, and the stored
    // digest tells nothing of the token.
    let row = st.store.job_token(id).await?;
    let Some(row) = row.filter(|r| crate::auth::verify_hash(token, &r.token_sha256)) else {
        return Err(unauthorized(format!("invalid job token for job {id}")));
    };
    // Every upload counts, refused or not, and past the cap nothing is parsed or put on the
    // audit record: a job looping on a bad file ends at the cap (outsider finding: 17,591
    // refused uploads in 40 s, each an audit row).
    if row.uploads >= MAX_UPLOADS_PER_JOB {
        return Err(into_api_error(AddError::TooMany { job: id }));
    }
    let job = crate::api::load_job(&st, id).await?;
    if job.state.is_terminal() {
        // Clutter only (every use checks the job), but nothing needs it now.
        if let Err(e) = st.store.delete_job_token(id).await {
            tracing::warn!(job = id, error = %e, "could not delete an ended job's token");
        }
        return Err(unauthorized(format!("job {id} has ended ({}): its job token adds no steps", job.state)));
    }
    if req.file_name.trim().is_empty() || req.file_name.len() > 1024 || req.file_name.chars().any(char::is_control) {
        return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "file_name must be 1-1024 printable characters"));
    }
    if req.source.len() > MAX_UPLOAD_BYTES {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "{}: {} bytes, more than the {MAX_UPLOAD_BYTES} an uploaded pipeline may have",
                req.file_name,
                req.source.len()
            ),
        ));
    }
    let actor =
        Actor { kind: "job", name: format!("job {id}"), credential: Some(gpuci_core::audit::fingerprint(&hash)) };
    let file_name = req.file_name.clone();
    let (reply, rx) = tokio::sync::oneshot::channel();
    let r =
        match st.brain.send(Command::AddSteps { job: id, file_name: req.file_name, source: req.source, reply }).await {
            Ok(()) => rx.await.unwrap_or(Err(AddError::Brain(BrainError::ShuttingDown))),
            Err(_) => Err(AddError::Brain(BrainError::ShuttingDown)),
        };
    if matches!(r, Err(AddError::Invalid { .. })) {
        if let Err(e) = st.store.count_failed_upload(id).await {
            tracing::warn!(job = id, error = %e, "could not count a refused upload");
        }
    }
    let object = format!("pipeline {} ({file_name})", job.pipeline_id);
    let outcome = r.as_ref().map(|jobs| jobs.len()).map_err(|e| e.to_string());
    let audited = crate::api::audit::record(&st, &actor, AuditAction::PipelineUpload, object, &outcome).await;
    let jobs = r.map_err(into_api_error)?;
    audited?;
    let known = crate::api::agent_names(st.store.as_ref(), &jobs).await;
    Ok((
        StatusCode::CREATED,
        Json(StepsAdded { pipeline_id: job.pipeline_id, jobs: crate::api::summarize(&jobs, &known) }),
    ))
}

fn into_api_error(e: AddError) -> ApiError {
    match e {
        AddError::Invalid { file, errors } => {
            let n = errors.len();
            let error = format!("{file} is not a valid pipeline ({n} error{})", if n == 1 { "" } else { "s" });
            let body = errors
                .0
                .into_iter()
                .map(|e| PipelineErrorBody {
                    file: e.file,
                    line: e.line,
                    column: e.column,
                    field: e.field,
                    message: e.message,
                })
                .collect();
            ApiError::with_body(StatusCode::UNPROCESSABLE_ENTITY, ErrorBody { error, pipeline_errors: body })
        }
        AddError::NotRunning(_) => unauthorized(e.to_string()),
        AddError::TooMany { .. } => ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()),
        AddError::Runner(_) => ApiError::new(StatusCode::CONFLICT, e.to_string()),
        AddError::Brain(b) => b.into(),
    }
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(add_steps), components(schemas(UploadSteps, StepsAdded)), modifiers(&JobTokenScheme))]
pub struct DynamicStepsDoc;

/// The job token's security scheme, declared where it is used.
struct JobTokenScheme;
impl utoipa::Modify for JobTokenScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
        let mut h = Http::new(HttpAuthScheme::Bearer);
        h.description = Some(format!(
            "A running job's own token (`{JOB_TOKEN_ENV}`): adds steps to that job's pipeline while it runs, nothing else."
        ));
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme("job_token", SecurityScheme::Http(h));
    }
}
