//! The REST API. Handlers validate input into typed values, ask the scheduler (or read the
//! store), and answer JSON. Errors are `ErrorBody` with a 4xx/5xx status; nothing panics on
//! input. The OpenAPI document is generated from these handlers' annotations.

use crate::auth::{self, bearer};
use crate::brain::Command;
use crate::convert::{job_summary, pipeline_state};
use crate::hub::Event;
use crate::state::AppState;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use gpuci_core::job::JobState;
use gpuci_protocol::agent::{RegisterRequest, RegisterResponse};
use gpuci_protocol::api::*;
use gpuci_protocol::{JobId, PipelineId};
use gpuci_store::{AgentRecord, JobFilter, Store};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use tokio::sync::{broadcast, mpsc};
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "gpuci coordinator API", description = "Submit pipelines, follow jobs and logs, inspect agents and GPUs."),
    paths(submit_pipeline, get_pipeline, watch_pipeline, pipeline_actions::retry_failed, pipeline_actions::cancel_pipeline, list_jobs, get_job, cancel_job, job_logs, list_agents, list_fleets, cost_report, release_gpu, register_agent, agent_channel, server_info, ready, metrics::scrape, openapi_json),
    components(schemas(ErrorBody, PipelineErrorBody, LogEvent, WatchEvent, crate::fleets::FleetStatus, crate::fleets::MachineStatus)),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
pub struct ApiDoc;

/// Completes the document: the secrets and uploads endpoints (`crate::api::secrets`,
/// `crate::uploads`, documented there) go in
/// first so that they, too, get the security schemes and 401 answers of [`document_auth`].
struct BearerAuth;
impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        openapi.merge(crate::api::secrets::SecretsDoc::openapi());
        openapi.merge(uploads::UploadsDoc::openapi());
        openapi.merge(github::GithubApiDoc::openapi());
        openapi.merge(crate::api::audit::AuditDoc::openapi());
        openapi.merge(schedules::SchedulesDoc::openapi());
        document_auth(openapi);
    }
}

/// Add the security schemes, and the 401 answer to every operation that needs the API token
/// (those that do not declare their own `security`). Idempotent; call it again on a document
/// that other `OpenApi` docs were merged into, so that their operations get it too.
pub fn document_auth(openapi: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    let components = openapi.components.get_or_insert_with(Default::default);
    let bearer = |desc: &str| {
        let mut h = Http::new(HttpAuthScheme::Bearer);
        h.description = Some(desc.into());
        SecurityScheme::Http(h)
    };
    components.add_security_scheme("bearer", bearer("The API token (`<data-dir>/api-token`)."));
    components.add_security_scheme(
        "read_token",
        bearer("The read-only token (`<data-dir>/read-token`): `/metrics` and the dashboard; changes nothing."),
    );
    components.add_security_scheme(
        "registration_token",
        bearer("The registration token (`<data-dir>/registration-token`); only for registering agents."),
    );
    components.add_security_scheme(
        "agent_credential",
        bearer("An agent's own credential, as returned by `POST /api/v1/agents/register`."),
    );
    components.add_security_scheme(
        "github_signature",
        SecurityScheme::ApiKey(utoipa::openapi::security::ApiKey::Header(
            utoipa::openapi::security::ApiKeyValue::with_description(
                "X-Hub-Signature-256",
                "`sha256=` and the hex HMAC-SHA256 of the raw body with the GitHub webhook secret.",
            ),
        )),
    );
    let unauthorized = ResponseBuilder::new()
        .description("missing or invalid API token")
        .content("application/json", ContentBuilder::new().schema(Some(Ref::from_schema_name("ErrorBody"))).build())
        .build();
    for item in openapi.paths.paths.values_mut() {
        let ops = [&mut item.get, &mut item.post, &mut item.put, &mut item.delete, &mut item.patch];
        for op in ops.into_iter().flatten() {
            if op.security.is_none() {
                op.responses.responses.entry("401".into()).or_insert_with(|| unauthorized.clone().into());
            }
        }
    }
}

pub mod artifacts;
pub mod audit;
pub mod dynamic_steps;
pub mod github;
pub mod identity;
pub mod metrics;
pub mod pipeline_actions;
pub mod schedules;
pub mod secrets;
pub mod uploads;
pub mod webhook;

use crate::error::{client_or_server, json_rejection};
pub use crate::error::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};

/// Said to the raw log's handler (by the dashboard's `ui::log_access`) when an anonymous
/// visitor reads a public job's log: gpuci's own lines lose agent names and GPU UUIDs, as on
/// the job page. The function is the dashboard's; the API only applies it.
#[derive(Clone)]
pub struct LogScrub(pub std::sync::Arc<dyn Fn(LogLine) -> LogLine + Send + Sync>);

impl LogScrub {
    fn line(&self, l: LogLine) -> LogLine {
        (self.0)(l)
    }
}

/// Requests under `/api/v1` (but registration and the agent channel, which carry their own
/// credentials) need the API token.
pub async fn require_api_token(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    match bearer(req.headers()) {
        // The caller, for handlers that record who did what (`crate::api::audit`).
        Some(t) => match crate::api::audit::identify(&st, t).await {
            Ok(actor) => {
                req.extensions_mut().insert(actor);
                next.run(req).await
            }
            Err(e) => e.into_response(),
        },
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing API token (Authorization: Bearer <token>; see <data-dir>/api-token)",
        )
        .into_response(),
    }
}

/// What job summaries name besides the job: its agent's name, and the fleet machine it ran on
/// (for its cost).
#[derive(Default)]
pub(crate) struct Known {
    pub(crate) names: HashMap<String, String>,
    /// Fleet machines by the agent that registered from them.
    pub(crate) machines: HashMap<String, gpuci_store::MachineRecord>,
}

/// [`Known`] of the agents `jobs` were given to, read for those agents only: one row each,
/// or every agent's when they are many. Every answer naming jobs read every agent's row
/// before, a submission's too (a fifth of the coordinator's CPU while 100,000 jobs were
/// submitted with 5,000 agents connected: BENCHMARKS.md, "Queued jobs by shape").
pub(crate) async fn agent_names(store: &dyn Store, jobs: &[gpuci_store::JobRecord]) -> Known {
    /// Up to this many agents are read one by one (an index look-up each).
    const ONE_BY_ONE: usize = 64;
    let ids: std::collections::BTreeSet<&str> = jobs.iter().filter_map(|j| j.agent_id.as_deref()).collect();
    if ids.is_empty() {
        return Known::default();
    }
    let names = match ids.len() <= ONE_BY_ONE {
        true => {
            let mut names = HashMap::new();
            for id in ids {
                if let Ok(Some(a)) = store.get_agent(id).await {
                    names.insert(a.id, a.name);
                }
            }
            names
        }
        false => store
            .list_agents()
            .await
            .map(|v| v.into_iter().filter(|a| ids.contains(a.id.as_str())).map(|a| (a.id, a.name)).collect())
            .unwrap_or_default(),
    };
    let machines = store
        .machines(false)
        .await
        .map(|v| v.into_iter().filter_map(|m| Some((m.agent_id.clone()?, m))).collect())
        .unwrap_or_default();
    Known { names, machines }
}

pub(crate) fn summarize(jobs: &[gpuci_store::JobRecord], known: &Known) -> Vec<JobSummary> {
    jobs.iter()
        .map(|j| {
            let mut s = job_summary(j, j.agent_id.as_ref().and_then(|a| known.names.get(a).cloned()));
            let machine = j.agent_id.as_ref().and_then(|a| known.machines.get(a));
            if let (Some(m), Some(started)) = (machine, j.started_at_ms) {
                // Never past the machine's end: a job ended `lost` later than its machine
                // was deleted ran no longer than the machine was billed.
                let end = j.finished_at_ms.unwrap_or_else(crate::brain::now_ms);
                let end = m.ended_at_ms.map_or(end, |e| end.min(e));
                let ran_ms = end - started;
                s.cost = Some(gpuci_protocol::api::JobCost {
                    usd: gpuci_core::fleet::job_cost(ran_ms, j.gpus.len() as u32, m.gpus, m.price_per_hour),
                    machine: m.id.clone(),
                    fleet: m.fleet.clone(),
                    price_per_hour: m.price_per_hour,
                    overhead_usd: None,
                });
            }
            s
        })
        .collect()
}

async fn pipeline_summary(st: &AppState, id: PipelineId) -> ApiResult<PipelineSummary> {
    let p = st
        .store
        .get_pipeline(id)
        .await?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("pipeline {id} not found")))?;
    let jobs = st.store.pipeline_jobs(id).await?;
    let jobs = summarize(&jobs, &agent_names(st.store.as_ref(), &jobs).await);
    Ok(PipelineSummary {
        id: p.id,
        file_name: p.file_name,
        created_at_ms: p.created_at_ms,
        state: pipeline_state(&jobs),
        jobs,
    })
}

/// Submit a pipeline file; every step becomes a queued job.
#[utoipa::path(post, path = "/api/v1/pipelines", request_body = SubmitPipeline,
    responses((status = 201, body = PipelineSummary),
        (status = 400, description = "the body is not a `SubmitPipeline` in JSON", body = ErrorBody),
        (status = 413, description = "the body is too large", body = ErrorBody),
        (status = 422, description = "the pipeline is invalid, its `repository` names no repository, its `workspace_upload` is not stored, or its `workspace_archive` is not a base64 gzip'ed tar of at most 512 KiB", body = ErrorBody),
        (status = 503, description = "the server is shutting down, or its database cannot store this now (a full disk); try again later", body = ErrorBody)))]
pub async fn submit_pipeline(
    State(st): State<AppState>,
    ApiJson(req): ApiJson<SubmitPipeline>,
) -> ApiResult<(StatusCode, Json<PipelineSummary>)> {
    if req.file_name.trim().is_empty() {
        return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "file_name must not be empty"));
    }
    // It is shown in every error about the file and in listings: no NUL, no escape sequences.
    if req.file_name.len() > 1024 || req.file_name.chars().any(char::is_control) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "file_name must be at most 1024 printable characters",
        ));
    }
    check_extra_env(&req.env)?;
    let once = req.submission.as_deref().map(|key| submission_once(key, &req)).transpose()?;
    let build = check_build_facts(req.build.clone().unwrap_or_default())?;
    if let Some(r) = &req.repository {
        if r.is_empty() || r.len() > 1024 || r.chars().any(char::is_control) {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "repository must be 1-1024 printable characters",
            ));
        }
        // Read as every later use reads it (`crate::repos`): one that names no repository
        // would be stored and then quietly get no cache, no budget and no secret scope.
        let host = st.github_host();
        if let Err(e) = gpuci_core::repo::RepoId::parse(r.trim(), &host) {
            let why = if e.what.starts_with("expected") { String::new() } else { format!(" ({})", e.what) };
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "repository: {:?} names no repository{why}; expected a remote URL (https://host/owner/name, \
                     git@host:owner/name), host/path, owner/name (on {host}) or an absolute local path",
                    e.text
                ),
            ));
        }
    }
    let inline = match &req.workspace_archive {
        Some(_) if req.workspace_upload.is_some() => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "give workspace_upload or workspace_archive, not both",
            ))
        }
        Some(b64) => Some(uploads::decode_inline(b64)?),
        None => None,
    };
    // From the check that the upload exists (or storing the inline one) until the pipeline
    // naming it is committed, no upload garbage collection runs (`crate::uploads`).
    let pin = st.uploads.pin().await;
    if let Some(id) = &req.workspace_upload {
        let stored = st.uploads.contains(id).await.map_err(|e| {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("workspace_upload: looking for upload {id}: {e}"))
        })?;
        if !stored {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("workspace_upload: no upload {id:?} (POST /api/v1/uploads first)"),
            ));
        }
    }
    let pipeline = gpuci_core::pipeline::parse(&req.file_name, &req.source).map_err(|errs| {
        ApiError::with_body(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorBody {
                error: format!(
                    "{} is not a valid pipeline ({} error{})",
                    req.file_name,
                    errs.0.len(),
                    if errs.0.len() == 1 { "" } else { "s" }
                ),
                pipeline_errors: errs
                    .0
                    .into_iter()
                    .map(|e| PipelineErrorBody {
                        file: e.file,
                        line: e.line,
                        column: e.column,
                        field: e.field,
                        message: e.message,
                    })
                    .collect(),
            },
        )
    })?;
    // Stored (and synced) before the pipeline that names it is committed, as an upload is.
    let workspace_upload = match inline {
        Some(bytes) => Some(st.uploads.put(&pin, bytes).await.map_err(|e| {
            tracing::error!(error = %e, "could not store a workspace sent with a pipeline");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("storing the workspace: {e}"))
        })?),
        None => req.workspace_upload,
    };
    let (p, _) = st
        .ask(|reply| Command::Submit {
            sub: Box::new(crate::brain::Submission {
                file_name: req.file_name,
                source: req.source,
                pipeline,
                extra_env: req.env,
                workspace_upload,
                repository: req.repository,
                origin: None,
                build,
                once,
            }),
            reply,
        })
        .await?;
    drop(pin);
    Ok((StatusCode::CREATED, Json(pipeline_summary(&st, p.id).await?)))
}

/// A submission key, checked, with the digest of the request it came with (the request as
/// sent, less the key): the same request sent again has the same digest.
fn submission_once(key: &str, req: &SubmitPipeline) -> ApiResult<gpuci_store::Submission> {
    if !(16..=128).contains(&key.len()) || !key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("submission must be 16 to 128 of {}", gpuci_protocol::api::SUBMISSION_KEY_CHARS),
        ));
    }
    use sha2::Digest;
    let unkeyed = SubmitPipeline { submission: None, ..req.clone() };
    let json =
        serde_json::to_vec(&unkeyed).map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(gpuci_store::Submission { key: key.to_string(), digest: hex::encode(sha2::Sha256::digest(json)) })
}

/// A submission's build facts: bounded, printable text (they end up in skip reasons), paths
/// without NUL; more changed paths than [`MAX_CHANGED_PATHS`] is refused (send none: unknown).
///
/// [`MAX_CHANGED_PATHS`]: gpuci_core::condition::MAX_CHANGED_PATHS
fn check_build_facts(b: gpuci_core::condition::BuildFacts) -> ApiResult<gpuci_core::condition::BuildFacts> {
    use gpuci_core::condition::MAX_CHANGED_PATHS;
    let bad = |what: &str| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, format!("build.{what}"));
    for (name, value) in [("branch", &b.branch), ("tag", &b.tag), ("commit", &b.commit)] {
        if value.as_ref().is_some_and(|v| v.len() > 1024 || v.chars().any(char::is_control)) {
            return Err(bad(&format!("{name} must be at most 1024 printable characters")));
        }
    }
    if let Some(paths) = &b.changed {
        if paths.len() > MAX_CHANGED_PATHS {
            return Err(bad(&format!(
                "changed lists {} paths, more than {MAX_CHANGED_PATHS}; leave it out (changes unknown)",
                paths.len()
            )));
        }
        if paths.iter().any(|p| p.is_empty() || p.len() > 4096 || p.contains('\0')) {
            return Err(bad("changed: each path must be 1-4096 bytes without NUL"));
        }
    }
    Ok(b)
}

/// The extra environment of a submission: names as in a pipeline's `env`, values without NUL.
fn check_extra_env(env: &BTreeMap<String, String>) -> ApiResult<()> {
    for (name, value) in env {
        let mut chars = name.chars();
        let valid_name = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid_name {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "env: invalid variable name {name:?}: expected letters, digits and `_`, not starting with a digit"
                ),
            ));
        }
        if value.contains('\0') {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("env: {name} contains a NUL character"),
            ));
        }
    }
    Ok(())
}

/// A pipeline and all its jobs.
#[utoipa::path(get, path = "/api/v1/pipelines/{id}", params(("id" = i64, Path, description = "pipeline id")),
    responses((status = 200, body = PipelineSummary),
        (status = 400, description = "the id is not an integer", body = ErrorBody),
        (status = 404, description = "no such pipeline", body = ErrorBody)))]
pub async fn get_pipeline(
    State(st): State<AppState>,
    ApiPath(id): ApiPath<PipelineId>,
) -> ApiResult<Json<PipelineSummary>> {
    Ok(Json(pipeline_summary(&st, id).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct JobsQuery {
    /// Comma-separated states, e.g. `queued,running`.
    pub state: Option<String>,
    /// Only the jobs of this pipeline.
    #[param(value_type = Option<i64>)]
    pub pipeline: Option<PipelineId>,
    /// At most this many (default 100, at most 10000).
    pub limit: Option<u32>,
}

/// Jobs, newest first.
#[utoipa::path(get, path = "/api/v1/jobs", params(JobsQuery),
    responses((status = 200, body = Vec<JobSummary>),
        (status = 400, description = "a malformed query, or an unknown state", body = ErrorBody)))]
pub async fn list_jobs(
    State(st): State<AppState>,
    ApiQuery(q): ApiQuery<JobsQuery>,
) -> ApiResult<Json<Vec<JobSummary>>> {
    let mut states = Vec::new();
    for s in q.state.iter().flat_map(|s| s.split(',')).map(str::trim).filter(|s| !s.is_empty()) {
        states.push(s.parse::<JobState>().map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e))?);
    }
    let filter =
        JobFilter { states, pipeline: q.pipeline, limit: Some(q.limit.unwrap_or(100).min(10_000)), before: None };
    let jobs = st.store.list_jobs(&filter).await?;
    Ok(Json(summarize(&jobs, &agent_names(st.store.as_ref(), &jobs).await)))
}

pub(crate) async fn load_job(st: &AppState, id: JobId) -> ApiResult<gpuci_store::JobRecord> {
    st.store.get_job(id).await?.ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("job {id} not found")))
}

/// One job, with its reason and telemetry.
#[utoipa::path(get, path = "/api/v1/jobs/{id}", params(("id" = i64, Path, description = "job id")),
    responses((status = 200, body = JobSummary),
        (status = 400, description = "the id is not an integer", body = ErrorBody),
        (status = 404, description = "no such job", body = ErrorBody)))]
pub async fn get_job(State(st): State<AppState>, ApiPath(id): ApiPath<JobId>) -> ApiResult<Json<JobSummary>> {
    let j = load_job(&st, id).await?;
    let known = agent_names(st.store.as_ref(), std::slice::from_ref(&j)).await;
    let mut s = summarize(&[j], &known).remove(0);
    crate::job_cost::add_overhead(st.store.as_ref(), &mut s).await;
    Ok(Json(s))
}

/// Cancel a job: a queued job ends at once; a running one when its agent has killed its process tree.
#[utoipa::path(post, path = "/api/v1/jobs/{id}/cancel", params(("id" = i64, Path, description = "job id")),
    request_body(content = Option<CancelRequest>, description = "optional; without a body (or a `reason`) the reason is `cancelled by user`"),
    responses((status = 200, body = JobSummary),
        (status = 400, description = "the id is not an integer, or the body is not a `CancelRequest` in JSON", body = ErrorBody),
        (status = 404, description = "no such job", body = ErrorBody),
        (status = 409, description = "already finished", body = ErrorBody),
        (status = 503, description = "the server is shutting down, or its database cannot store this now (a full disk); try again later", body = ErrorBody)))]
pub async fn cancel_job(
    State(st): State<AppState>,
    axum::Extension(actor): axum::Extension<crate::api::audit::Actor>,
    ApiPath(id): ApiPath<JobId>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<JobSummary>> {
    let body = body.map_err(|e| ApiError::new(client_or_server(e.status()), e.body_text()))?;
    let req = if body.iter().all(u8::is_ascii_whitespace) {
        // No body at all (with or without a content type): the default reason.
        None
    } else {
        let json = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(is_json_content_type);
        if !json {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "Expected request with `Content-Type: application/json`",
            ));
        }
        // `null` is as good as no body.
        Json::<Option<CancelRequest>>::from_bytes(&body).map_err(json_rejection)?.0
    };
    let reason = req.and_then(|b| b.reason).unwrap_or_else(|| "cancelled by user".into());
    let j = st.ask(|reply| Command::Cancel { job: id, reason, reply }).await;
    let audited =
        crate::api::audit::record(&st, &actor, gpuci_core::audit::AuditAction::JobCancel, format!("job {id}"), &j)
            .await;
    // A cancel that failed answers with its own error (a full disk is a 503 either way); one
    // that took effect but could not be recorded says so.
    let j = j?;
    audited?;
    let known = agent_names(st.store.as_ref(), std::slice::from_ref(&j)).await;
    Ok(Json(summarize(&[j], &known).remove(0)))
}

/// `application/json`, or `application/<anything>+json`, with any parameters.
fn is_json_content_type(v: &str) -> bool {
    let mime = v.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogsQuery {
    /// Keep the stream open until the job ends.
    #[serde(default)]
    pub follow: bool,
    /// Only lines after this sequence number.
    #[serde(default)]
    pub after: i64,
}

/// What a stream's producer sends last when its answer is whole ([`ndjson`]).
const WHOLE: Bytes = Bytes::new();

/// An NDJSON answer of what `rx` carries. It ends as an answer ends only when its producer
/// said it is whole ([`WHOLE`], after the job's `end` or the pipeline's `done`, or the lines a
/// read without `follow` asked for); a producer that stops otherwise (this coordinator shutting
/// down or losing its claim, the store failing) cuts the connection, so that no client takes a
/// stream cut short for a finished one (outsider finding: a stopping leader's streams ended
/// cleanly, with no `end` record).
fn ndjson(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures::stream::unfold((rx, false), |(mut rx, cut)| async move {
        if cut {
            return None;
        }
        match rx.recv().await {
            Some(b) if b.is_empty() => None,
            Some(b) => Some((Ok(b), (rx, false))),
            None => Some((Err(std::io::Error::other("the stream was cut short")), (rx, true))),
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn line<T: serde::Serialize>(v: &T) -> Bytes {
    let mut s = serde_json::to_vec(v).unwrap_or_default();
    s.push(b'\n');
    Bytes::from(s)
}

/// A job's log as NDJSON `LogEvent`s; with `follow`, live until the job ends.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/logs", params(("id" = i64, Path, description = "job id"), LogsQuery),
    responses((status = 200, description = "one `LogEvent` per line (an ended job's last is `end`); a stream the coordinator could not finish (it stopped, lost its database or its lead) is cut, never ended as if whole", content_type = "application/x-ndjson", body = LogEvent),
        (status = 400, description = "the id is not an integer, or a malformed query", body = ErrorBody),
        (status = 404, description = "no such job", body = ErrorBody)))]
pub async fn job_logs(
    State(st): State<AppState>,
    ApiPath(id): ApiPath<JobId>,
    ApiQuery(q): ApiQuery<LogsQuery>,
    scrub: Option<axum::Extension<LogScrub>>,
) -> ApiResult<Response> {
    load_job(&st, id).await?;
    // An anonymous reader of a public job's log: gpuci's own lines scrubbed (`ui::log_access`).
    let scrub = scrub.map(|s| s.0);
    let line = move |e: &LogEvent| match (e, &scrub) {
        (LogEvent::Line(l), Some(s)) => line(&LogEvent::Line(s.line(l.clone()))),
        _ => line(e),
    };
    let mut events = st.hub.subscribe();
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    tokio::spawn(async move {
        let mut last = q.after;
        loop {
            // Catch up from the store.
            loop {
                let Ok(lines) = st.store.read_logs(id, last, 1000).await else { return };
                let n = lines.len();
                for l in lines {
                    last = l.seq;
                    if tx.send(line(&LogEvent::Line(l))).await.is_err() {
                        return;
                    }
                }
                if n < 1000 {
                    break;
                }
            }
            let Ok(Some(job)) = st.store.get_job(id).await else { return };
            if job.state.is_terminal() || !q.follow {
                if job.state.is_terminal() {
                    let _ = tx.send(line(&LogEvent::End { state: job.state, reason: job.reason })).await;
                }
                let _ = tx.send(WHOLE).await;
                return;
            }
            // Live: lines as they come; on the job's end or a lag, go back to the store.
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = st.shutdown.cancelled() => return,
                    ev = events.recv() => match ev {
                        Ok(Event::Log { job_id, line: l, .. }) if job_id == id && l.seq == last + 1 => {
                            last = l.seq;
                            if tx.send(line(&LogEvent::Line(l))).await.is_err() { return; }
                        }
                        Ok(Event::Log { job_id, line: l, .. }) if job_id == id && l.seq > last + 1 => break,
                        Ok(Event::Job(j)) if j.id == id && j.state.is_terminal() => break,
                        Ok(_) => {}
                        Err(broadcast::error::RecvError::Lagged(_)) => break,
                        Err(broadcast::error::RecvError::Closed) => return,
                    }
                }
            }
        }
    });
    Ok(ndjson(rx))
}

/// Follow a pipeline: its jobs' changes and log lines as NDJSON `WatchEvent`s, until it ends.
#[utoipa::path(get, path = "/api/v1/pipelines/{id}/watch", params(("id" = i64, Path, description = "pipeline id")),
    responses((status = 200, description = "one `WatchEvent` per line; the last is `done`; a stream the coordinator could not finish is cut, never ended as if whole", content_type = "application/x-ndjson", body = WatchEvent),
        (status = 400, description = "the id is not an integer", body = ErrorBody),
        (status = 404, description = "no such pipeline", body = ErrorBody)))]
pub async fn watch_pipeline(State(st): State<AppState>, ApiPath(id): ApiPath<PipelineId>) -> ApiResult<Response> {
    let mut events = st.hub.subscribe();
    let first = pipeline_summary(&st, id).await?;
    let (tx, rx) = mpsc::channel::<Bytes>(1024);
    tokio::spawn(async move {
        let mut jobs: HashMap<JobId, JobSummary> = first.jobs.iter().map(|j| (j.id, j.clone())).collect();
        let mut last_seq: HashMap<JobId, i64> = HashMap::new();
        for j in &first.jobs {
            if tx.send(line(&WatchEvent::Job(j.clone()))).await.is_err() {
                return;
            }
        }
        // Lines already written before we subscribed, every one (a watch opened again after a
        // failover goes on from the last line its client showed: none may be missing).
        for j in &first.jobs {
            if !send_stored_lines(&st, &tx, j.id, &mut last_seq).await {
                return;
            }
        }
        loop {
            let all: Vec<JobSummary> = jobs.values().cloned().collect();
            let state = pipeline_state(&all);
            if state != "running" {
                let _ = tx.send(line(&WatchEvent::Done { state })).await;
                let _ = tx.send(WHOLE).await;
                return;
            }
            let ev = tokio::select! {
                _ = tx.closed() => return,
                _ = st.shutdown.cancelled() => return,
                ev = events.recv() => ev,
            };
            match ev {
                Ok(Event::Job(j)) if j.pipeline_id == id => {
                    jobs.insert(j.id, (*j).clone());
                    if tx.send(line(&WatchEvent::Job(*j))).await.is_err() {
                        return;
                    }
                }
                Ok(Event::Log { job_id, pipeline_id, line: l }) if pipeline_id == id => {
                    if l.seq > last_seq.get(&job_id).copied().unwrap_or(0) {
                        last_seq.insert(job_id, l.seq);
                        if tx.send(line(&WatchEvent::Log { job_id, line: l })).await.is_err() {
                            return;
                        }
                    }
                }
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    // Resynchronise from the store.
                    if let Ok(fresh) = pipeline_summary(&st, id).await {
                        for j in fresh.jobs {
                            if !send_stored_lines(&st, &tx, j.id, &mut last_seq).await {
                                return;
                            }
                            let _ = tx.send(line(&WatchEvent::Job(j.clone()))).await;
                            jobs.insert(j.id, j);
                        }
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    Ok(ndjson(rx))
}

/// Sends job `job`'s stored lines after the last one sent (`last_seq`), page by page; `false`
/// when the watcher is gone.
async fn send_stored_lines(
    st: &AppState,
    tx: &mpsc::Sender<Bytes>,
    job: JobId,
    last_seq: &mut HashMap<JobId, i64>,
) -> bool {
    const PAGE: u32 = 10_000;
    loop {
        let since = last_seq.get(&job).copied().unwrap_or(0);
        let Ok(lines) = st.store.read_logs(job, since, PAGE).await else { return true };
        let n = lines.len();
        for l in lines {
            last_seq.insert(job, l.seq);
            if tx.send(line(&WatchEvent::Log { job_id: job, line: l })).await.is_err() {
                return false;
            }
        }
        if n < PAGE as usize {
            return true;
        }
    }
}

/// Agents with their GPUs, leases and quarantines.
#[utoipa::path(get, path = "/api/v1/agents",
    responses((status = 200, body = Vec<AgentSummary>),
        (status = 503, description = "the server is shutting down", body = ErrorBody)))]
pub async fn list_agents(State(st): State<AppState>) -> ApiResult<Json<Vec<AgentSummary>>> {
    Ok(Json(st.ask(|reply| Command::Agents { reply }).await?))
}

/// Return a quarantined GPU to service by hand.
#[utoipa::path(post, path = "/api/v1/gpus/{uuid}/release", params(("uuid" = String, Path, description = "the GPU's UUID")),
    responses((status = 204, description = "released"),
        (status = 400, description = "the path is not valid UTF-8", body = ErrorBody),
        (status = 409, description = "not quarantined (or not known)", body = ErrorBody),
        (status = 503, description = "the server is shutting down, or its database cannot store this now (a full disk); try again later", body = ErrorBody)))]
pub async fn release_gpu(
    State(st): State<AppState>,
    axum::Extension(actor): axum::Extension<crate::api::audit::Actor>,
    ApiPath(uuid): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let object = format!("GPU {uuid}");
    let done = st.ask(|reply| Command::ReleaseGpu { uuid, reply }).await;
    let audited =
        crate::api::audit::record(&st, &actor, gpuci_core::audit::AuditAction::GpuRelease, object, &done).await;
    done?;
    audited?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CostQuery {
    /// Days back from now (UTC days, today included); default 7, at most 366.
    pub days: Option<u32>,
}

/// What fleet machines cost, by UTC day, fleet and repository; what no job's share covers (boot,
/// idle, GPUs no job leased) is the fleet's overhead (rows without a repository).
#[utoipa::path(get, path = "/api/v1/cost", params(CostQuery),
    responses((status = 200, body = gpuci_core::fleet::cost::CostReport), (status = 400, body = ErrorBody)))]
pub async fn cost_report(
    State(st): State<AppState>,
    ApiQuery(q): ApiQuery<CostQuery>,
) -> ApiResult<Json<gpuci_core::fleet::cost::CostReport>> {
    use gpuci_core::fleet::cost::report;
    let days = q.days.unwrap_or(7);
    if !(1..=366).contains(&days) {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "days: expected 1 to 366"));
    }
    let now = crate::brain::now_ms();
    const DAY: i64 = 86_400_000;
    let from = (now.div_euclid(DAY) - i64::from(days) + 1) * DAY;
    let (machines, stretches, runs) = crate::fleets::cost_inputs(st.store.as_ref(), from, &st.github_host()).await?;
    Ok(Json(report(&machines, &stretches, &runs, from, now)))
}

/// Fleets: machines by state, what the autoscaler wants and why, recent provider errors,
/// spend today (as the reconcile loop last saw them).
#[utoipa::path(get, path = "/api/v1/fleets", responses((status = 200, body = Vec<crate::fleets::FleetStatus>)))]
pub async fn list_fleets(State(st): State<AppState>) -> ApiResult<Json<Vec<crate::fleets::FleetStatus>>> {
    let fleets = st.fleets.read().map(|f| f.clone()).unwrap_or_default();
    Ok(Json(fleets))
}

/// The largest registration request read (a name and a few fields).
const MAX_REGISTER_BYTES: usize = 64 * 1024;

/// Register an agent with the registration token; returns its own credential, once.
#[utoipa::path(post, path = "/api/v1/agents/register", request_body = RegisterRequest, security(("registration_token" = [])),
    responses((status = 201, body = RegisterResponse),
        (status = 400, description = "the body is not a `RegisterRequest` in JSON", body = ErrorBody),
        (status = 401, description = "missing or invalid registration token", body = ErrorBody),
        (status = 413, description = "the body is too large", body = ErrorBody),
        (status = 422, description = "an invalid agent name", body = ErrorBody),
        (status = 503, description = "the database cannot store this now (a full disk); try again later", body = ErrorBody)))]
pub async fn register_agent(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<(StatusCode, Json<RegisterResponse>)> {
    let offered = bearer(&headers).unwrap_or_default();
    let for_machine = auth::machine_of_token(&st.registration_token, offered);
    if !(st.registration_token.matches(offered) || for_machine.is_some()) {
        return Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid or missing registration token"));
    }
    // The body is read only once the token holds: anyone can reach this endpoint, and a body
    // read first let them hold the request (and its connection) while they sent it.
    let bytes = axum::body::to_bytes(body, MAX_REGISTER_BYTES).await.map_err(|e| {
        let e = e.into_inner();
        match e.is::<http_body_util::LengthLimitError>() {
            true => {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the body is over {MAX_REGISTER_BYTES} bytes"))
            }
            false => ApiError::new(StatusCode::BAD_REQUEST, format!("reading the request: {e}")),
        }
    })?;
    let Json(req) = Json::<RegisterRequest>::from_bytes(&bytes).map_err(json_rejection)?;
    let mut name = req.name.trim().to_string();
    if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
        return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "agent name must be 1-128 printable characters"));
    }
    // A machine's token registers that machine's one agent, while the machine is being made;
    // checked and spent under one lock.
    let _spending = match for_machine {
        Some(machine) => {
            let held = st.machine_registrations.clone().lock_owned().await;
            name = machine_agent_name(&st, machine).await?;
            Some(held)
        }
        None => None,
    };
    let name = name.as_str();
    let id = uuid::Uuid::new_v4().to_string();
    let credential = auth::generate("gpuci_agent");
    st.store
        .insert_agent(&AgentRecord {
            id: id.clone(),
            name: name.to_string(),
            credential_hash: auth::hash(credential.expose()),
            registered_at_ms: crate::brain::now_ms(),
            last_seen_ms: None,
            state: "disconnected".into(),
            reason: "registered, not yet connected".into(),
            hello_json: None,
        })
        .await
        .map_err(|e| ApiError::store(&e, "could not store this"))?;
    tracing::info!(agent = %id, name, "agent registered");
    Ok((StatusCode::CREATED, Json(RegisterResponse { agent_id: id, credential: credential.expose().to_string() })))
}

/// The name the agent of fleet machine `machine` registers under, `<fleet>-<machine>` (as the
/// machine was told), when its registration token may still be spent: the machine is being
/// made (not ended) and no agent has that name yet. 401 otherwise, saying which.
async fn machine_agent_name(st: &AppState, machine: &str) -> ApiResult<String> {
    let refuse = |why: String| Err(ApiError::new(StatusCode::UNAUTHORIZED, why));
    let machines = st.store.machines(true).await.map_err(|e| ApiError::store(&e, "could not read machines"))?;
    let Some(rec) = machines.iter().find(|m| m.id == machine && m.state != "ended") else {
        return refuse(format!("the registration token of machine {machine} is for a machine that is not being made"));
    };
    let name = format!("{}-{}", rec.fleet, rec.id);
    let agents = st.store.list_agents().await.map_err(|e| ApiError::store(&e, "could not read agents"))?;
    if agents.iter().any(|a| a.name == name) {
        return refuse(format!("the registration token of machine {machine} was used already (agent {name})"));
    }
    Ok(name)
}

/// The agent channel: a WebSocket carrying the agent protocol (`gpuci_protocol::agent`). Only
/// documented here; the handler is `channel::connect`.
#[utoipa::path(get, path = "/api/v1/agents/connect", security(("agent_credential" = [])),
    params(("x-gpuci-agent-id" = String, Header, description = "the agent's id, as returned by registration")),
    responses((status = 101, description = "switched to the WebSocket agent protocol"),
        (status = 400, description = "not a WebSocket upgrade (plain text), or no agent id",
            content((ErrorBody = "application/json"), (String = "text/plain"))),
        (status = 401, description = "unknown agent or wrong credential", body = ErrorBody),
        (status = 426, description = "the connection cannot be upgraded", content_type = "text/plain", body = String)))]
#[allow(dead_code)]
fn agent_channel() {}

/// Version of the server and of the agent protocol. Needs no token.
#[utoipa::path(get, path = "/healthz", security(()), responses((status = 200, body = ServerInfo)))]
pub async fn server_info() -> Json<ServerInfo> {
    Json(ServerInfo { version: env!("CARGO_PKG_VERSION").into(), protocol: gpuci_protocol::PROTOCOL_VERSION })
}

/// Ready to serve: this coordinator leads its database, which answers, and the scheduler
/// runs. 503 with the reason otherwise (a load balancer sends no traffic; `/healthz` says only
/// that the process is up). With Postgres the answer comes from memory: the claim renewed in
/// the last seconds is the database's answer (a query here took 2.47 s behind a slow database
/// link, past the clients' 2 s probe, and the CLI found no leader).
#[utoipa::path(get, path = "/readyz", security(()), responses((status = 200, description = "ready"), (status = 503, body = ErrorBody)))]
pub async fn ready(State(st): State<AppState>) -> ApiResult<&'static str> {
    if st.brain.is_closed() || st.shutdown.is_cancelled() {
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down"));
    }
    if let Some(why) = st.not_leading() {
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why));
    }
    if st.claim_renewed.is_none() {
        st.store.list_pipelines(1).await.map_err(|e| {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("the database does not answer: {}", e.reason()))
        })?;
    }
    Ok("ready\n")
}

/// This document. Needs no token.
#[utoipa::path(get, path = "/api/v1/openapi.json", security(()),
    responses((status = 200, description = "the OpenAPI 3.1 document of this API", body = Object)))]
pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

#[cfg(test)]
mod known_tests;
