//! `/api/v1/uploads`: a client (`gpuci submit`) posts a gzip'ed tar of the files a job's
//! workspace starts from; agents (with their credential) and the API token download it.
//! Storage, pins and collection are [`crate::uploads`]'.

use crate::auth::AGENT_ID_HEADER;
use crate::auth::{bearer, verify_hash};
use crate::blobs::BlobError;
use crate::error::{ApiError, ApiPath};
use crate::state::AppState;
use crate::uploads::{blob_name, valid_id, TempFile, MAX_UPLOAD_BYTES};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use gpuci_protocol::api::{ErrorBody, UploadInfo, MAX_INLINE_WORKSPACE_BYTES};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

#[derive(utoipa::OpenApi)]
#[openapi(paths(create_upload, get_upload), components(schemas(UploadInfo)))]
pub struct UploadsDoc;

/// The bytes of a workspace sent with a pipeline (`SubmitPipeline::workspace_archive`):
/// base64, at most [`MAX_INLINE_WORKSPACE_BYTES`] decoded, gzip data.
pub fn decode_inline(b64: &str) -> Result<Vec<u8>, ApiError> {
    use base64::Engine;
    let unprocessable = |what: String| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, what);
    // Checked before decoding: base64 is 4 characters per 3 bytes.
    if b64.len() > MAX_INLINE_WORKSPACE_BYTES.div_ceil(3) * 4 {
        return Err(unprocessable(format!(
            "workspace_archive: larger than {} KiB; POST /api/v1/uploads and name it in workspace_upload",
            MAX_INLINE_WORKSPACE_BYTES >> 10
        )));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| unprocessable(format!("workspace_archive: not base64: {e}")))?;
    if bytes.len() > MAX_INLINE_WORKSPACE_BYTES {
        return Err(unprocessable(format!(
            "workspace_archive: larger than {} KiB; POST /api/v1/uploads and name it in workspace_upload",
            MAX_INLINE_WORKSPACE_BYTES >> 10
        )));
    }
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        return Err(unprocessable("workspace_archive: not gzip data (expected a .tar.gz)".into()));
    }
    Ok(bytes)
}

fn is_gzip_content_type(v: &str) -> bool {
    let mime = v.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    mime == "application/gzip" || mime == "application/x-gzip"
}

/// Store a workspace upload: a gzip'ed tar of the files every job of a pipeline starts from.
/// The id is the sha256 of the bytes; posting the same bytes again answers the same id.
#[utoipa::path(post, path = "/api/v1/uploads",
    request_body(content = Vec<u8>, content_type = "application/gzip", description = "a gzip'ed tar, at most 512 MiB"),
    responses((status = 201, body = UploadInfo),
        (status = 400, description = "the body is empty or not gzip data", body = ErrorBody),
        (status = 413, description = "the body is larger than 512 MiB", body = ErrorBody),
        (status = 415, description = "the content type is not `application/gzip`", body = ErrorBody),
        (status = 503, description = "the blob store (an S3 bucket) could not be written", body = ErrorBody)))]
pub async fn create_upload(
    State(st): State<AppState>,
    req: Request,
) -> Result<(StatusCode, Json<UploadInfo>), ApiError> {
    let headers = req.headers();
    if !headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(is_gzip_content_type) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "expected `Content-Type: application/gzip` (a gzip'ed tar)",
        ));
    }
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the upload is larger than {} MiB; upload fewer files (gpuci submit --upload DIR)",
                MAX_UPLOAD_BYTES >> 20
            ),
        )
    };
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_UPLOAD_BYTES) {
        return Err(too_large());
    }
    let dir = &st.uploads.dir;
    let server_error = |what: &str, e: std::io::Error| {
        tracing::error!(error = %e, dir = %dir.display(), "{what}");
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{what}: {e}"))
    };
    tokio::fs::create_dir_all(dir).await.map_err(|e| server_error("creating the uploads directory", e))?;
    let tmp = dir.join(format!(".tmp-{}", uuid::Uuid::new_v4()));
    // Removes the temporary file on every early return.
    let guard = TempFile(tmp.clone());
    let mut file = tokio::fs::File::create(&tmp).await.map_err(|e| server_error("creating an upload file", e))?;
    let mut hasher = Sha256::new();
    let mut bytes: u64 = 0;
    let mut head: Vec<u8> = Vec::with_capacity(2);
    let mut stream = req.into_body().into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("reading the upload: {e}")))?;
        bytes += chunk.len() as u64;
        if bytes > MAX_UPLOAD_BYTES {
            return Err(too_large());
        }
        if head.len() < 2 {
            head.extend(chunk.iter().take(2 - head.len()).copied());
        }
        hasher.update(&chunk);
        file.write_all(&chunk).await.map_err(|e| server_error("writing an upload", e))?;
    }
    if head != [0x1f, 0x8b] {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "the upload is not gzip data (expected a .tar.gz)"));
    }
    let id = hex::encode(hasher.finalize());
    file.flush().await.map_err(|e| server_error("writing an upload", e))?;
    drop(file);
    // Whether the blob is there and storing or touching it happen with no collector pass
    // of this process between (the store syncs the file before it gets its name). The
    // client names the upload in a pipeline later: the touch makes it recent, and the
    // collector's size cap leaves recent uploads alone. A shared store is written before
    // the pin: never a network call under it.
    let pin = if st.uploads.blobs.shared() { None } else { Some(st.uploads.pin().await) };
    let new = st.uploads.blobs.store(&blob_name(&id), &tmp, bytes).await.map_err(|e| {
        tracing::error!(error = %e, location = %st.uploads.blobs.location(), "could not store an upload");
        unavailable(&format!("upload {id} was not stored; send it again"), &e)
    })?;
    drop(pin);
    if st.uploads.blobs.shared() {
        // A collector pass of this process that listed the object as old before the write
        // above may have deleted it after: once any pass in progress is over (the pin), it is
        // there or stored again; later passes see its fresh last write.
        let _pin = st.uploads.pin().await;
        let there = st.uploads.blobs.exists(&blob_name(&id)).await.unwrap_or(true);
        if !there {
            st.uploads
                .blobs
                .store(&blob_name(&id), &tmp, bytes)
                .await
                .map_err(|e| unavailable(&format!("upload {id} was not stored; send it again"), &e))?;
        }
    }
    if new {
        st.uploads.note_stored(bytes);
        tracing::info!(upload = %id, bytes, location = %st.uploads.blobs.location(), "upload stored");
    }
    drop(guard);
    Ok((StatusCode::CREATED, Json(UploadInfo { id, bytes })))
}

/// 503: the blob store (an S3 bucket, or the local directory) could not be written or read;
/// the client or agent sends the request again after a while. Never a 4xx: the request was fine.
fn unavailable(what: &str, e: &BlobError) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("the workspace upload store is unavailable: {e}; {what}"))
}

/// What an agent (or anyone) fetching a collected upload is told; the agent fails the job with it.
pub fn gone_message(id: &str) -> String {
    format!(
        "upload {id} is gone: the coordinator garbage-collected it after its pipelines finished and it went \
         unused for the upload retention (`[uploads] retention` in the server config, 7d by default), or to \
         keep uploads under `[uploads] max_total`; submit the pipeline again to upload its files anew"
    )
}

/// Whether the request carries the API token, or (with `x-gpuci-agent-id`) the credential of
/// that agent — checked as the agent channel checks it.
async fn authorized(st: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(offered) = bearer(headers) else {
        return Err(ApiError::new(StatusCode::UNAUTHORIZED, "missing API token or agent credential"));
    };
    if let Some(agent_id) = headers.get(AGENT_ID_HEADER).and_then(|v| v.to_str().ok()) {
        let known = st.store.get_agent(agent_id).await?;
        if known.is_some_and(|a| verify_hash(offered, &a.credential_hash)) {
            return Ok(());
        }
        return Err(ApiError::new(StatusCode::UNAUTHORIZED, "unknown agent or wrong credential"));
    }
    if st.api_token.matches(offered) {
        Ok(())
    } else {
        Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid API token"))
    }
}

/// Download an upload (a gzip'ed tar). With the API token, or as an agent: its credential and
/// the `x-gpuci-agent-id` header.
#[utoipa::path(get, path = "/api/v1/uploads/{id}",
    security(("bearer" = []), ("agent_credential" = [])),
    params(("id" = String, Path, description = "the upload's id: its sha256 in lowercase hex"),
        ("x-gpuci-agent-id" = Option<String>, Header, description = "with an agent credential: the agent's id")),
    responses((status = 200, description = "the upload", content_type = "application/gzip", body = Vec<u8>),
        (status = 400, description = "the id is not a sha256 in lowercase hex", body = ErrorBody),
        (status = 401, description = "missing or invalid API token or agent credential", body = ErrorBody),
        (status = 404, description = "no such upload", body = ErrorBody),
        (status = 410, description = "the upload was stored once (a pipeline names it) and has been garbage-collected since", body = ErrorBody),
        (status = 503, description = "the blob store (an S3 bucket) could not be read", body = ErrorBody)))]
pub async fn get_upload(
    State(st): State<AppState>,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    authorized(&st, &headers).await?;
    if !valid_id(&id) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "an upload id is a sha256 in lowercase hex (64 characters)",
        ));
    }
    let blob = match st.uploads.blobs.open(&blob_name(&id)).await {
        Ok(Some(b)) => b,
        Ok(None) => {
            // A pipeline names it: it was stored once and collected since.
            if !st.store.upload_uses(std::slice::from_ref(&id)).await?.is_empty() {
                return Err(ApiError::new(StatusCode::GONE, gone_message(&id)));
            }
            return Err(ApiError::new(StatusCode::NOT_FOUND, format!("upload {id} not found")));
        }
        Err(e) => {
            tracing::error!(error = %e, "could not open an upload");
            return Err(unavailable(&format!("upload {id} cannot be read now"), &e));
        }
    };
    // Checked against its id (its sha256) as it streams: bytes the store changed end the
    // body in an error short of its length (`crate::blobs::checked`), never a clean 200.
    let bytes = blob.bytes;
    let body = crate::blobs::checked::checked(blob, id.clone(), format!("upload {id}"), st.uploads.blobs.location());
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "application/gzip")
        .header(header::CONTENT_LENGTH, bytes)
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}
