//! Artifacts over HTTP: agents upload a job's files when its step ends and download the
//! files a job names in `artifacts_from:` before its command runs; people list and download
//! them, and read a job's test reports. Storage and its gate are [`crate::artifacts`]; the
//! rules (paths, caps, retention) are `gpuci_core::artifacts`'; this applies them.
//!
//! Who may do what:
//! - Upload (`PUT /api/v1/jobs/{id}/artifact-upload?path=P`): only the agent the job is
//!   assigned to, with its credential, while the job is assigned or running. The path is
//!   checked again here ([`gpuci_core::artifacts::check_path`]); the caps are checked
//!   against the declared length before a byte is read and against the real length before
//!   the row is written, under one lock, so concurrent uploads cannot pass a cap together.
//! - Inputs (`GET /api/v1/jobs/{id}/artifact-inputs[/{sha256}]`): only the agent holding the
//!   job, and only blobs of the steps that job names in `artifacts_from:`.
//! - Listing and download (`GET /api/v1/jobs/{id}/artifacts`, `…/artifact?path=P`) and the
//!   test report (`…/test-report`): the API token, the same rule as the job's log
//!   (`/api/v1/jobs/{id}/logs`). A download is always `application/octet-stream` with
//!   `nosniff` and `attachment`: a job's HTML never renders on the coordinator's origin.

use crate::artifacts::info;
use crate::auth::AGENT_ID_HEADER;
use crate::auth::{bearer, verify_hash};
use crate::blobs::{BlobError, BlobStore};
use crate::error::{ApiError, ApiPath, ApiQuery};
use crate::state::AppState;
use crate::uploads::TempFile;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use gpuci_core::artifacts::{admit, check_path, Usage};
use gpuci_core::job::JobState;
use gpuci_protocol::api::JobTestReport;
use gpuci_protocol::api::{ArtifactInfo, ArtifactInputs, ErrorBody};
use gpuci_protocol::JobId;
use gpuci_store::{ArtifactRecord, JobRecord};
use sha2::{Digest, Sha256};
use std::path::Path;
use tokio::io::AsyncWriteExt;

/// The agent a request comes from, when it carries that agent's credential.
async fn agent_of(st: &AppState, headers: &HeaderMap) -> Result<String, ApiError> {
    let unauthorized = |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, m);
    let offered = bearer(headers).ok_or_else(|| unauthorized("missing agent credential"))?;
    let agent_id = headers
        .get(AGENT_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| unauthorized("only agents use this endpoint (x-gpuci-agent-id and its credential)"))?;
    match st.store.get_agent(agent_id).await? {
        Some(a) if verify_hash(offered, &a.credential_hash) => Ok(agent_id.to_string()),
        _ => Err(unauthorized("unknown agent or wrong credential")),
    }
}

/// Job `id`, when `agent` holds it (assigned or running).
async fn held_job(st: &AppState, id: JobId, agent: &str) -> Result<JobRecord, ApiError> {
    let job = crate::api::load_job(st, id).await?;
    if job.agent_id.as_deref() != Some(agent) {
        return Err(ApiError::new(StatusCode::FORBIDDEN, format!("job {id} is not assigned to this agent")));
    }
    if !matches!(job.state, JobState::Assigned | JobState::Running) {
        return Err(ApiError::new(StatusCode::CONFLICT, format!("job {id} has ended ({})", job.state)));
    }
    Ok(job)
}

#[derive(utoipa::OpenApi)]
#[openapi(
    paths(upload, inputs, input_blob, list, download, job_report),
    components(schemas(ArtifactInfo, ArtifactInputs, gpuci_protocol::api::JobTestReport))
)]
pub struct ArtifactsDoc;

/// `?path=`: an artifact's path, relative to the job's workspace.
#[derive(serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PathQuery {
    path: String,
}

/// The free space an artifact upload must leave on the coordinator's disk.
const MIN_FREE_DISK: u64 = 2 << 30;

/// Store one artifact of a running job (the job's agent only): the body, streamed.
#[utoipa::path(put, path = "/api/v1/jobs/{id}/artifact-upload", security(("agent_credential" = [])),
    params(("id" = i64, Path, description = "job id"), PathQuery,
        ("x-gpuci-agent-id" = String, Header, description = "the agent's id")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, description = "stored", body = ArtifactInfo),
        (status = 400, description = "a bad path, or a body that does not match its length", body = ErrorBody),
        (status = 401, description = "not an agent's credential", body = ErrorBody),
        (status = 403, description = "the job is not this agent's", body = ErrorBody),
        (status = 404, description = "no such job", body = ErrorBody),
        (status = 409, description = "the job has ended", body = ErrorBody),
        (status = 411, description = "no Content-Length", body = ErrorBody),
        (status = 413, description = "over a cap (per file, job or repository)", body = ErrorBody),
        (status = 503, description = "the blob store (an S3 bucket) could not be written: nothing was recorded; send it again", body = ErrorBody),
        (status = 507, description = "the coordinator's disk is nearly full", body = ErrorBody)))]
pub async fn upload(
    State(st): State<AppState>,
    ApiPath(id): ApiPath<JobId>,
    ApiQuery(q): ApiQuery<PathQuery>,
    req: Request,
) -> Result<(StatusCode, Json<ArtifactInfo>), ApiError> {
    let agent = agent_of(&st, req.headers()).await?;
    let job = held_job(&st, id, &agent).await?;
    check_path(&q.path)
        .map_err(|why| ApiError::new(StatusCode::BAD_REQUEST, format!("artifact {:?}: {why}", q.path)))?;
    let Some(declared) =
        req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
    else {
        return Err(ApiError::new(StatusCode::LENGTH_REQUIRED, "an artifact upload needs a Content-Length"));
    };
    let pipeline = st.store.get_pipeline(job.pipeline_id).await?;
    // A fork's pull request (or any origin not trusted) fills its own share, never the room of
    // the repository's trusted jobs.
    let untrusted = pipeline.as_ref().is_none_or(|p| {
        gpuci_core::concurrency::TrustClass::of(crate::origin::Origin::cache_origin(p.origin.as_deref()).as_ref())
            != gpuci_core::concurrency::TrustClass::Trusted
    });
    let repository = pipeline.and_then(|p| p.repository);
    let refused = |why: String| ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("artifact {}: {why}", q.path));
    let before = usage(&st, id, &q.path, repository.as_deref(), untrusted).await?;
    admit(&st.artifacts.limits, &before, declared).map_err(refused)?;

    let dir = st.artifacts.dir.clone();
    let server_error = |what: &str, e: std::io::Error| {
        tracing::error!(error = %e, dir = %dir.display(), "{what}");
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{what}: {e}"))
    };
    tokio::fs::create_dir_all(&dir).await.map_err(|e| server_error("creating the artifacts directory", e))?;
    // The caps count what jobs declare, not what the coordinator's disk holds: a sparse file
    // costs its job nothing and the coordinator its whole size (outsider attack). Whatever
    // the caps allow, an upload that would leave less than MIN_FREE_DISK free is refused, so
    // the database and the logs beside it keep their room.
    if let Ok(fs) = nix::sys::statvfs::statvfs(&dir) {
        let free = fs.blocks_available() * fs.fragment_size();
        if free.saturating_sub(declared) < MIN_FREE_DISK {
            tracing::warn!(free, job = id, "artifact refused: the coordinator's disk is nearly full");
            return Err(ApiError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                format!(
                    "artifact {}: the coordinator's disk would have less than {} free; not stored",
                    q.path,
                    gpuci_core::quantity::Bytes(MIN_FREE_DISK)
                ),
            ));
        }
    }
    let tmp = dir.join(format!(".tmp-{}", uuid::Uuid::new_v4()));
    let guard = TempFile(tmp.clone());
    let mut file = tokio::fs::File::create(&tmp).await.map_err(|e| server_error("creating an artifact file", e))?;
    let mut hasher = Sha256::new();
    let mut bytes: u64 = 0;
    let mut stream = req.into_body().into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("reading artifact {}: {e}", q.path)))?;
        bytes += chunk.len() as u64;
        if bytes > declared {
            return Err(ApiError::new(StatusCode::BAD_REQUEST, "the body is longer than its Content-Length"));
        }
        hasher.update(&chunk);
        file.write_all(&chunk).await.map_err(|e| server_error("writing an artifact", e))?;
    }
    if bytes != declared {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "the body is shorter than its Content-Length"));
    }
    file.flush().await.map_err(|e| server_error("writing an artifact", e))?;
    drop(file);
    let sha256 = hex::encode(hasher.finalize());
    let blobs = st.artifacts.blobs.clone();
    // A shared store is written now, outside the lock and the gate: a multi-GiB upload must
    // not hold every other job's artifacts (or a collector pass) back. Were the caps to refuse
    // it below, the blob no row names goes at a collector pass after the grace period.
    if blobs.shared() {
        store_blob(blobs.as_ref(), &sha256, &tmp, bytes, id, &q.path).await?;
    }
    let record = ArtifactRecord {
        job_id: id,
        path: q.path.clone(),
        size: bytes,
        sha256: sha256.clone(),
        repository: repository.clone(),
        untrusted,
        created_at_ms: crate::brain::now_ms(),
    };
    {
        let _admit = st.artifacts.admit.lock().await;
        let now = usage(&st, id, &q.path, repository.as_deref(), untrusted).await?;
        admit(&st.artifacts.limits, &now, bytes).map_err(refused)?;
        let _pin = st.artifacts.gate.read().await;
        if !blobs.shared() {
            // Synced and renamed into place (or, when there, touched).
            store_blob(blobs.as_ref(), &sha256, &tmp, bytes, id, &q.path).await?;
        }
        st.store.put_artifact(&record).await?;
    }
    if blobs.shared() {
        // A collector pass of this process that listed the blob as old before the write above
        // may have deleted it after (it held the gate, so it is over now); every later pass
        // sees the row. So: there, or stored again. Stored again failing, the row goes: no row
        // may name a blob that is not there (the agent is told 503 and sends it again).
        match blobs.exists(&sha256).await {
            Ok(true) => {}
            Ok(false) => {
                if let Err(e) = store_blob(blobs.as_ref(), &sha256, &tmp, bytes, id, &q.path).await {
                    let _ = st.store.delete_artifacts(&[(id, q.path.clone())]).await;
                    return Err(e);
                }
            }
            Err(e) => tracing::warn!(error = %e, job = id, "could not check a stored artifact"),
        }
    }
    drop(guard);
    tracing::info!(job = id, path = %record.path, bytes, "artifact stored");
    let mut answer = info(&record);
    let is_report = !job.step.test_reports.is_empty()
        && gpuci_core::artifacts::Patterns::new(&job.step.test_reports).is_ok_and(|p| p.matches(&record.path));
    if is_report {
        answer.note = Some(crate::test_reports::read(st.store.as_ref(), &st.artifacts, &record).await?);
    }
    Ok((StatusCode::CREATED, Json(answer)))
}

async fn store_blob(
    blobs: &dyn BlobStore,
    sha256: &str,
    staged: &Path,
    bytes: u64,
    job: JobId,
    path: &str,
) -> Result<(), ApiError> {
    blobs.store(sha256, staged, bytes).await.map(|_| ()).map_err(|e| {
        tracing::error!(error = %e, job, path, location = %blobs.location(), "could not store an artifact");
        unavailable(&format!("artifact {path} was not stored"), &e)
    })
}

/// 503, which the agent sends again after a while: the blob store (an S3 bucket, or the
/// local directory) could not be written or read. Never 2xx (the artifact would be lost with
/// the job green), never 4xx (the request was fine) nor 507 (the coordinator's own disk).
pub(crate) fn unavailable(what: &str, e: &BlobError) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("the artifact store is unavailable: {e}; {what}"))
}

/// What job `id` has stored, without the artifact at `path` (an upload of the same path
/// replaces it), and what its repository has.
async fn usage(
    st: &AppState,
    id: JobId,
    path: &str,
    repository: Option<&str>,
    untrusted: bool,
) -> Result<Usage, ApiError> {
    let mine = st.store.job_artifacts(id).await?;
    let replaced: u64 = mine.iter().filter(|a| a.path == path).map(|a| a.size).sum();
    let others: Vec<&ArtifactRecord> = mine.iter().filter(|a| a.path != path).collect();
    Ok(Usage {
        job_bytes: others.iter().map(|a| a.size).sum(),
        job_files: others.len() as u64,
        repository_bytes: st.store.repository_artifact_bytes(repository, untrusted).await?.saturating_sub(replaced),
        untrusted,
    })
}

/// The artifacts job `job` gets from the steps it names in `artifacts_from:`. For each
/// step key, the latest job of that key in the pipeline (a retry replaces its attempt).
/// A path given by two steps comes from the first one named.
async fn inputs_of(st: &AppState, job: &JobRecord) -> Result<ArtifactInputs, ApiError> {
    let mut out = ArtifactInputs::default();
    if job.step.artifacts_from.is_empty() {
        return Ok(out);
    }
    let jobs = st.store.pipeline_jobs(job.pipeline_id).await?;
    let mut taken: std::collections::BTreeMap<String, JobId> = std::collections::BTreeMap::new();
    for key in &job.step.artifacts_from {
        let Some(source) = jobs.iter().filter(|j| &j.step.key == key && j.id != job.id).max_by_key(|j| j.id) else {
            out.notes.push(format!("artifacts: no job of step `{key}` in this pipeline"));
            continue;
        };
        let files = st.store.job_artifacts(source.id).await?;
        if files.is_empty() {
            out.notes.push(format!("artifacts: step `{key}` (job {}) uploaded none", source.id));
        }
        for f in files {
            if let Some(first) = taken.get(&f.path) {
                out.notes.push(format!(
                    "artifacts: {} from job {} is also in job {first}'s artifacts; job {first}'s is used",
                    f.path, source.id
                ));
                continue;
            }
            taken.insert(f.path.clone(), source.id);
            out.files.push(info(&f));
        }
    }
    Ok(out)
}

/// The list of what the agent holding job `id` must place in its workspace.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/artifact-inputs", security(("agent_credential" = [])),
    params(("id" = i64, Path, description = "job id"),
        ("x-gpuci-agent-id" = String, Header, description = "the agent's id")),
    responses((status = 200, description = "the files", body = ArtifactInputs),
        (status = 401, description = "not an agent's credential", body = ErrorBody),
        (status = 403, description = "the job is not this agent's", body = ErrorBody),
        (status = 404, description = "no such job", body = ErrorBody),
        (status = 409, description = "the job has ended", body = ErrorBody)))]
pub async fn inputs(
    State(st): State<AppState>,
    headers: HeaderMap,
    ApiPath(id): ApiPath<JobId>,
) -> Result<Json<ArtifactInputs>, ApiError> {
    let agent = agent_of(&st, &headers).await?;
    let job = held_job(&st, id, &agent).await?;
    Ok(Json(inputs_of(&st, &job).await?))
}

/// One blob of job `id`'s inputs, for the agent holding the job.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/artifact-inputs/{sha256}", security(("agent_credential" = [])),
    params(("id" = i64, Path, description = "job id"), ("sha256" = String, Path, description = "the file's sha256"),
        ("x-gpuci-agent-id" = String, Header, description = "the agent's id")),
    responses((status = 200, description = "the bytes", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 401, description = "not an agent's credential", body = ErrorBody),
        (status = 403, description = "the job is not this agent's", body = ErrorBody),
        (status = 404, description = "not one of the job's inputs", body = ErrorBody),
        (status = 409, description = "the job has ended", body = ErrorBody),
        (status = 410, description = "recorded, but its blob is no longer in the store (removed outside gpuci)", body = ErrorBody),
        (status = 503, description = "the blob store (an S3 bucket) could not be read", body = ErrorBody)))]
pub async fn input_blob(
    State(st): State<AppState>,
    headers: HeaderMap,
    ApiPath((id, sha256)): ApiPath<(JobId, String)>,
) -> Result<Response, ApiError> {
    let agent = agent_of(&st, &headers).await?;
    let job = held_job(&st, id, &agent).await?;
    if !inputs_of(&st, &job).await?.files.iter().any(|f| f.sha256 == sha256) {
        return Err(ApiError::new(StatusCode::NOT_FOUND, format!("job {id} gets no artifact {sha256}")));
    }
    serve_blob(&st, &sha256, None).await
}

/// A job's artifacts, by path.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/artifacts", params(("id" = i64, Path, description = "job id")),
    responses((status = 200, description = "the job's artifacts", body = Vec<ArtifactInfo>),
        (status = 401, description = "missing or invalid API token", body = ErrorBody),
        (status = 404, description = "no such job", body = ErrorBody)))]
pub async fn list(
    State(st): State<AppState>,
    ApiPath(id): ApiPath<JobId>,
) -> Result<Json<Vec<ArtifactInfo>>, ApiError> {
    crate::api::load_job(&st, id).await?;
    Ok(Json(st.store.job_artifacts(id).await?.iter().map(info).collect()))
}

/// One artifact of a job, by its path.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/artifact", params(("id" = i64, Path, description = "job id"), PathQuery),
    responses((status = 200, description = "the bytes", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 401, description = "missing or invalid API token", body = ErrorBody),
        (status = 404, description = "no such job or artifact", body = ErrorBody),
        (status = 410, description = "recorded, but its blob is no longer in the store (removed outside gpuci)", body = ErrorBody),
        (status = 503, description = "the blob store (an S3 bucket) could not be read", body = ErrorBody)))]
pub async fn download(
    State(st): State<AppState>,
    ApiPath(id): ApiPath<JobId>,
    ApiQuery(PathQuery { path }): ApiQuery<PathQuery>,
) -> Result<Response, ApiError> {
    crate::api::load_job(&st, id).await?;
    let found = st.store.job_artifacts(id).await?.into_iter().find(|a| a.path == path);
    let Some(a) = found else {
        return Err(ApiError::new(StatusCode::NOT_FOUND, format!("job {id} has no artifact {path:?}")));
    };
    let name = a.path.rsplit('/').next().unwrap_or("artifact").replace(['"', '\\'], "_");
    serve_blob(&st, &a.sha256, Some(&name)).await
}

async fn serve_blob(st: &AppState, sha256: &str, name: Option<&str>) -> Result<Response, ApiError> {
    if !crate::uploads::valid_id(sha256) {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "an artifact is named by its sha256 in lowercase hex"));
    }
    let blob = match st.artifacts.open(sha256).await {
        Ok(Some(b)) => b,
        Ok(None) => {
            // A row names it, and retention deletes the row first (a download then answers
            // 404), so it went some other way: deleted from the store by hand or by a
            // lifecycle rule, lost with a disk, taken by another coordinator's collector
            // around a takeover (module docs of `crate::blobs`) — or collected by retention
            // in the moment between reading the row and opening the blob.
            return Err(ApiError::new(
                StatusCode::GONE,
                format!(
                    "artifact {sha256} is recorded but no longer in the artifact store ({}): it was removed outside \
                     gpuci's retention (by hand, a bucket lifecycle rule, a lost disk); run the job again to make it anew",
                    st.artifacts.blobs.location()
                ),
            ));
        }
        Err(e) => {
            tracing::error!(error = %e, "could not open an artifact");
            return Err(unavailable(&format!("artifact {sha256} cannot be read now"), &e));
        }
    };
    let mut r = Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::X_CONTENT_TYPE_OPTIONS, "nosniff")
        .header("x-gpuci-sha256", sha256);
    if let Some(name) = name {
        r = r.header(header::CONTENT_DISPOSITION, format!("attachment; filename=\"{name}\""));
    }
    r = r.header(header::CONTENT_LENGTH, blob.bytes);
    // Checked against its name as it streams: bytes the store changed end the body in an
    // error short of its length (`crate::blobs::checked`), never a clean 200.
    let body = crate::blobs::checked::checked(
        blob,
        sha256.to_string(),
        format!("artifact {sha256}"),
        st.artifacts.blobs.location(),
    );
    Ok(r.body(Body::from_stream(body)).unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}

/// `GET /api/v1/jobs/{id}/test-report` (API token, as the job's log): 404 when the job has
/// none.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/test-report", params(("id" = i64, Path, description = "job id")),
    responses((status = 200, description = "the job's test reports read together", body = JobTestReport),
        (status = 401, description = "missing or invalid API token", body = gpuci_protocol::api::ErrorBody),
        (status = 404, description = "no such job, or it has no test reports", body = gpuci_protocol::api::ErrorBody)))]
pub async fn job_report(
    State(st): State<AppState>,
    ApiPath(id): ApiPath<JobId>,
) -> Result<Json<JobTestReport>, ApiError> {
    crate::api::load_job(&st, id).await?;
    match crate::test_reports::of_job(st.store.as_ref(), id).await? {
        Some(r) => Ok(Json(r)),
        None => Err(ApiError::new(axum::http::StatusCode::NOT_FOUND, format!("job {id} has no test reports"))),
    }
}
