//! `/api/v1/uploads`: the files a job's workspace starts from. A client (`gpuci submit`) posts
//! a gzip'ed tar; it is stored content-addressed as `<sha256>.tar.gz` in the blob store
//! ([`crate::blobs`]: `<data-dir>/uploads/` by default, or a shared S3 bucket), written to a
//! temporary file while hashed, synced, then stored: a reader never sees half a file, and the
//! same content is stored once. A pipeline names it by id (`SubmitPipeline::workspace_upload`)
//! and each agent downloads it with its own credential before running a job.
//!
//! The coordinator does not look inside the archive; agents unpack it, refusing entries that
//! would land outside the workspace.
//!
//! Uploads are garbage-collected ([`crate::uploads_gc`]; the rules in `gpuci_core::uploads`).
//! Content addressing makes that racy by nature: the bytes a collector is about to delete may
//! be posted again, or named by a new pipeline, at that moment. So every use that makes an
//! upload wanted (storing or touching its file, and checking it exists through committing
//! the pipeline that names it) holds an [`UploadPin`], and the collector gathers its facts,
//! decides and deletes holding the gate's other side: a use comes wholly before a pass
//! (which then sees it) or wholly after (which then stores the file anew or is refused).
//! A download of a collected upload that a pipeline names answers 410 Gone.
//!
//! With a shared store (S3) the gate is this process's only: another coordinator's collector
//! is kept off a new upload by its fresh last write (an upload is written again each time
//! it is posted, and the size cap spares uploads used in the last `FRESH_MS`; module docs of
//! [`crate::blobs`]). A posted upload is written to the shared store before the pin is
//! taken, never under it; an archive the coordinator makes itself ([`Uploads::put`]) is
//! written under its caller's pin (it must exist before the pipeline naming it commits).

use crate::api::{ApiError, ApiPath};
use crate::auth::{bearer, verify_hash};
use crate::blobs::{BlobError, BlobStore, LocalBlobs};
use crate::channel::AGENT_ID_HEADER;
use crate::AppState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use gpuci_protocol::api::{ErrorBody, UploadInfo, MAX_INLINE_WORKSPACE_BYTES};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// The largest upload accepted.
pub const MAX_UPLOAD_BYTES: u64 = 512 << 20;

#[derive(utoipa::OpenApi)]
#[openapi(paths(create_upload, get_upload), components(schemas(UploadInfo)))]
pub struct UploadsDoc;

/// Where uploads live: a blob store, and `<data-dir>/uploads` (the store itself by default;
/// with a shared store, where uploads are staged on their way to it).
#[derive(Clone, Debug)]
pub struct Uploads {
    dir: PathBuf,
    blobs: Arc<dyn BlobStore>,
    /// Read side: a use in progress ([`UploadPin`]); write side: a collector pass.
    gate: Arc<tokio::sync::RwLock<()>>,
    /// How many uploads are stored and their bytes: as the collector's last pass counted
    /// them, plus those stored since (for `/metrics`).
    count: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
}

/// Held while an upload is being made wanted: from before its file is stored or touched, or
/// checked to exist, until the pipeline that names it is committed (or the request gives up).
/// While any pin is held, no collector pass runs. Hold it briefly: never over a download
/// or a network call, since a waiting pass holds back new pins.
#[must_use]
pub struct UploadPin(#[allow(dead_code)] tokio::sync::OwnedRwLockReadGuard<()>);

impl Uploads {
    /// Uploads in the local directory `dir`.
    pub fn new(dir: PathBuf) -> Self {
        let blobs = Arc::new(LocalBlobs::new(dir.clone()));
        Self::with_store(dir, blobs)
    }

    /// Uploads in `blobs`, staged in `dir`.
    pub fn with_store(dir: PathBuf, blobs: Arc<dyn BlobStore>) -> Self {
        Uploads { dir, blobs, gate: Arc::default(), count: Arc::default(), bytes: Arc::default() }
    }

    /// The local directory: the uploads themselves with the local store, else their staging.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blobs(&self) -> &Arc<dyn BlobStore> {
        &self.blobs
    }

    /// A pin: no collector pass runs until it is dropped.
    pub async fn pin(&self) -> UploadPin {
        UploadPin(self.gate.clone().read_owned().await)
    }

    /// The collector's side of the gate: no pin is held while it lives.
    pub(crate) async fn exclusive(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.gate.clone().write_owned().await
    }

    /// Stored uploads and their bytes (the collector's last count, plus uploads since).
    pub fn stored(&self) -> (u64, u64) {
        (self.count.load(Ordering::Relaxed), self.bytes.load(Ordering::Relaxed))
    }

    /// Set by the collector, under its side of the gate.
    pub(crate) fn set_stored(&self, count: u64, bytes: u64) {
        self.count.store(count, Ordering::Relaxed);
        self.bytes.store(bytes, Ordering::Relaxed);
    }

    fn note_stored(&self, bytes: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The local file of upload `id` (with the local store); `None` when `id` is not a
    /// sha256 in lowercase hex.
    pub fn path(&self, id: &str) -> Option<PathBuf> {
        valid_id(id).then(|| self.dir.join(blob_name(id)))
    }

    /// Whether upload `id` is in the local directory (the local store's test helper; a
    /// request asks [`Uploads::contains`]).
    pub fn exists(&self, id: &str) -> bool {
        self.path(id).is_some_and(|p| p.is_file())
    }

    /// Whether upload `id` is stored, in whichever store.
    pub async fn contains(&self, id: &str) -> Result<bool, BlobError> {
        if !valid_id(id) {
            return Ok(false);
        }
        self.blobs.exists(&blob_name(id)).await
    }

    /// Store an archive the coordinator made itself (a repository at a commit); returns its id.
    /// The caller holds `_pin` until the pipeline naming it is committed.
    pub async fn put(&self, _pin: &UploadPin, bytes: Vec<u8>) -> std::io::Result<String> {
        let dir = self.dir.clone();
        let len = bytes.len() as u64;
        let tmp = dir.join(format!(".tmp-{}", uuid::Uuid::new_v4()));
        let guard = TempFile(tmp.clone());
        let id = {
            let tmp = tmp.clone();
            tokio::task::spawn_blocking(move || {
                use std::io::Write;
                std::fs::create_dir_all(&dir)?;
                let id = hex::encode(Sha256::digest(&bytes));
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(&bytes)?;
                f.sync_all()?;
                Ok::<_, std::io::Error>(id)
            })
            .await
            .map_err(std::io::Error::other)??
        };
        let new = self.blobs.store(&blob_name(&id), &tmp, len).await.map_err(std::io::Error::other)?;
        drop(guard);
        if new {
            self.note_stored(len);
        }
        Ok(id)
    }
}

/// The blob an upload is stored as.
pub fn blob_name(id: &str) -> String {
    format!("{id}.tar.gz")
}

/// A sha256 in lowercase hex: 64 characters of `0-9a-f`.
pub fn valid_id(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

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

struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
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
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "application/gzip")
        .header(header::CONTENT_LENGTH, blob.bytes)
        .body(Body::from_stream(tokio_util::io::ReaderStream::new(blob.body)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}
