//! Dynamic steps: a running job adds steps to its own pipeline (`gpuci pipeline upload`).
//!
//! The credential is a job token: a fresh random token made when the job is given to an
//! agent ([`new_token`]), stored only as its sha256 (`job_tokens`, written by the job's
//! assignment in the placement pass's one transaction), sent to the agent with the
//! job's secrets (so the agent hands it to the job as `GPUCI_JOB_TOKEN` and masks it in the
//! job's log like any secret). It does one thing: `POST /api/v1/jobs/{id}/steps` for the job
//! it was made for, while that job is assigned or running. It is not an API token, so every
//! other endpoint answers it 401; a retried job is a new job with a new token; the job's end
//! (success, failure, cancel, timeout, lost) ends it, because every use asks the brain, which
//! holds the job's state, and nothing else.
//!
//! The job reaches this endpoint through its agent (`gpuci_agent::steps_proxy`): the agent
//! serves a unix socket in the job's own directory and forwards the request, so a job with
//! `network: none` or the slot network (where the coordinator's loopback address is out of
//! reach) can add steps too, and the job needs no route to the coordinator.
//!
//! What the file may say is `gpuci_core::pipeline::upload`'s rule. The added jobs belong to
//! the uploading job's pipeline, so they have its origin and its trust class: a fork pull
//! request's added step gets no secrets and is sandboxed whatever the file says. Each upload
//! that passed the token check is recorded in the audit log with the job as actor.

use crate::api::{ApiError, ApiJson, ApiPath};
use crate::audit::Actor;
use crate::brain::{BrainError, Command};
use crate::origin::Origin;
use crate::AppState;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use gpuci_core::audit::AuditAction;
use gpuci_core::condition::Decision;
use gpuci_core::job::JobState;
use gpuci_core::pipeline::upload::{parse_upload, Existing, MAX_UPLOADS_PER_JOB, MAX_UPLOAD_BYTES};
use gpuci_core::pipeline::PipelineErrors;
use gpuci_protocol::api::{ErrorBody, PipelineErrorBody, StepsAdded, UploadSteps};
use gpuci_protocol::JobId;
use gpuci_store::{JobRecord, NewJob, Store, StoreError};

/// The variable the job finds its token in.
pub const JOB_TOKEN_ENV: &str = "GPUCI_JOB_TOKEN";
/// What a job token starts with: a reader of a log or a leak report can tell what it is.
pub const JOB_TOKEN_PREFIX: &str = "gpuci_job_";

/// A new job token: the value the job gets, and its sha256, which the placement pass stores
/// with the job's assignment (`NewAssignment::token_sha256`), in the same commit: a job never
/// holds a token the coordinator does not know, and a refused assignment stores none.
pub(crate) fn new_token() -> (String, String) {
    let token = crate::auth::generate(JOB_TOKEN_PREFIX);
    let sha256 = crate::auth::hash(token.expose());
    (token.expose().to_string(), sha256)
}

/// Why an upload added nothing.
#[derive(Debug, thiserror::Error)]
pub enum AddError {
    #[error("{file} is not a valid pipeline ({} error{})", .errors.len(), if .errors.len() == 1 { "" } else { "s" })]
    Invalid { file: String, errors: PipelineErrors },
    #[error("job {0} is not running: its job token adds no steps")]
    NotRunning(JobId),
    #[error("job {job} has made {MAX_UPLOADS_PER_JOB} uploads, the most one job may")]
    TooMany { job: JobId },
    #[error("job {0} runs a GitHub Actions runner; its pipeline takes no added steps")]
    Runner(JobId),
    #[error(transparent)]
    Brain(#[from] BrainError),
}

impl From<StoreError> for AddError {
    fn from(e: StoreError) -> Self {
        AddError::Brain(BrainError::Store(e))
    }
}

/// The brain's half: `by` is the uploading job as the brain holds it, assigned or running
/// (the brain checks). Reads its pipeline as stored now, validates the file against it,
/// decides the new steps' `if:`, and stores them with the upload counted, in one commit.
pub(crate) async fn add(
    store: &dyn Store,
    by: &JobRecord,
    file_name: &str,
    source: &str,
) -> Result<Vec<JobRecord>, AddError> {
    let pipeline = store.get_pipeline(by.pipeline_id).await?.ok_or(BrainError::PipelineNotFound(by.pipeline_id))?;
    if matches!(Origin::parse(pipeline.origin.as_deref()), Some(Origin::ActionsRunner(_))) {
        return Err(AddError::Runner(by.id));
    }
    let trusted = gpuci_core::trust::may_run_unsandboxed(Origin::cache_origin(pipeline.origin.as_deref()).as_ref());
    let jobs = store.pipeline_jobs(by.pipeline_id).await?;
    let existing = Existing::new(jobs.iter().map(|j| &j.step), trusted);
    let added = parse_upload(file_name, source, &existing)
        .map_err(|errors| AddError::Invalid { file: file_name.to_string(), errors })?;
    // `if:` is decided with the facts the pipeline was submitted with (changed paths are not
    // kept: a condition on them runs its step, as for unknown facts).
    let build = store
        .pipeline_builds(&[by.pipeline_id])
        .await?
        .get(&by.pipeline_id)
        .and_then(|json| serde_json::from_str::<gpuci_core::condition::BuildFacts>(json).ok())
        .unwrap_or_default();
    let decisions = gpuci_core::condition::plan(&added.steps, &build, &added.env);
    let now = crate::brain::now_ms();
    let who = format!("added by job {} ({})", by.id, by.step.key);
    let new: Vec<NewJob> = added
        .steps
        .iter()
        .zip(decisions)
        .map(|(step, decision)| {
            let mut env = added.env.clone();
            env.extend(step.env.clone());
            let mut step = step.clone();
            let (state, reason) = match decision {
                Decision::Run { note: None } => (JobState::Queued, format!("queued: {who}")),
                Decision::Run { note: Some(note) } => (JobState::Queued, format!("queued: {who}; {note}")),
                Decision::Skip(why) => {
                    step.skipped_by_condition = true;
                    (JobState::Skipped, why)
                }
            };
            NewJob {
                pipeline_id: by.pipeline_id,
                step,
                env,
                state,
                reason,
                attempt: 1,
                retry_of: None,
                created_at_ms: now,
            }
        })
        .collect();
    store.add_uploaded_jobs(by.id, new, MAX_UPLOADS_PER_JOB).await?.ok_or(AddError::TooMany { job: by.id })
}

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
    let audited = crate::audit::record(&st, &actor, AuditAction::PipelineUpload, object, &outcome).await;
    let jobs = r.map_err(into_api_error)?;
    audited?;
    let known = crate::api::agent_names(st.store.as_ref()).await;
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
