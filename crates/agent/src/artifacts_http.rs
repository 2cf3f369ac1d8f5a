//! A job's artifacts to and from the coordinator, as this agent (its credential and
//! `x-gpuci-agent-id`; the coordinator checks the job is this agent's). What is uploaded
//! and where a download may land are decided by [`crate::artifacts`]; everything the job
//! should know (each refusal and why, what was uploaded) goes to its log through `log`.

use crate::artifacts::{collect, create_in, Found};
use crate::workspace::UploadSource;
use futures::StreamExt;
use gpuci_core::artifacts::{ArtifactSpec, Patterns};
use gpuci_core::quantity::Bytes;
use gpuci_protocol::api::{ArtifactInputs, ErrorBody};
use gpuci_protocol::JobId;
use sha2::{Digest, Sha256};
use std::path::Path;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Uploads refused over a cap in a row after which the rest are not sent.
const CAPPED_IN_A_ROW_STOP: usize = 20;

/// Refusals said one by one in the job's log; past this, only their count.
const MAX_REFUSALS_SHOWN: usize = 50;

/// The coordinator's error sentence from a failed response.
async fn error_of(resp: reqwest::Response) -> String {
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    let message = serde_json::from_str::<ErrorBody>(&body).map(|b| b.error).unwrap_or_else(|_| body.trim().to_string());
    format!("{status}: {message}")
}

/// Uploads the files `spec` names in `workspace` for job `job`, when `spec.when` applies to
/// how the step ended; `what` names them in the log (`artifacts`, `test reports`), none is
/// over `max_file`. Never fails the job: what could not be uploaded is said in its log.
#[allow(clippy::too_many_arguments)]
pub async fn upload(
    job: JobId,
    what: &str,
    spec: &ArtifactSpec,
    max_file: u64,
    source: Option<&UploadSource>,
    workspace: &Path,
    succeeded: bool,
    log: &(dyn Fn(String) + Send + Sync),
) {
    if spec.is_empty() {
        return;
    }
    if !spec.when.applies(succeeded) {
        log(format!(
            "{what}: not uploaded (when: {}, and the step {})",
            spec.when.as_str(),
            if succeeded { "succeeded" } else { "did not succeed" }
        ));
        return;
    }
    let Some(source) = source else {
        log(format!("{what}: not uploaded: this agent has no coordinator to upload to"));
        return;
    };
    let patterns = match Patterns::new(&spec.paths) {
        Ok(p) => p,
        Err(e) => {
            log(format!("{what}: not uploaded: {e}"));
            return;
        }
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Found>(1);
    let ws = workspace.to_path_buf();
    let walker =
        tokio::task::spawn_blocking(move || collect(&ws, &patterns, max_file, |f| tx.blocking_send(f).is_ok()));
    let (mut stored, mut bytes, mut refused) = (0u64, 0u64, 0usize);
    // Caps the coordinator answers in a row (413, 507): past a few, the job's or the
    // repository's cap is reached and every further file would be sent only to be refused
    // (outsider attack: 30,000 files kept a slot busy for half an hour).
    let mut capped_in_a_row = 0usize;
    while let Some(found) = rx.recv().await {
        let (path, reason) = match found {
            Found::File { path, file, size } => match put(source, job, &path, file, size).await {
                Ok(note) => {
                    if let Some(note) = note {
                        log(format!("{what}: {path}: {note}"));
                    }
                    stored += 1;
                    bytes += size;
                    capped_in_a_row = 0;
                    continue;
                }
                Err((e, capped)) => {
                    capped_in_a_row = if capped { capped_in_a_row + 1 } else { 0 };
                    (path, e)
                }
            },
            Found::Refused { path, reason } => (path, reason),
        };
        if capped_in_a_row >= CAPPED_IN_A_ROW_STOP {
            log(format!(
                "{what}: stopped: the coordinator refused the last {CAPPED_IN_A_ROW_STOP} over a cap (last: {reason})"
            ));
            refused += 1;
            break;
        }
        refused += 1;
        if refused <= MAX_REFUSALS_SHOWN {
            log(format!("{what}: {path:?} refused: {reason}"));
        }
    }
    // The collection stops at its next file once nobody takes them.
    drop(rx);
    match walker.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => log(format!("{what}: the workspace could not be read: {e}")),
        Err(e) => log(format!("{what}: the collection stopped: {e}")),
    }
    if refused > MAX_REFUSALS_SHOWN {
        log(format!("{what}: {} more refused (not listed)", refused - MAX_REFUSALS_SHOWN));
    }
    if stored == 0 && refused == 0 {
        log(format!("{what}: no file matched {}", spec.paths.join(", ")));
    } else {
        log(format!("{what}: uploaded {stored} file(s), {}; {refused} refused", Bytes(bytes)));
    }
}

/// Streams one opened file (its first `size` bytes) to the coordinator.
async fn put(
    source: &UploadSource,
    job: JobId,
    path: &str,
    file: std::fs::File,
    size: u64,
) -> Result<Option<String>, (String, bool)> {
    let url = format!("{}/api/v1/jobs/{job}/artifact-upload", source.server);
    let body = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file).take(size));
    let resp = source
        .http
        .put(&url)
        .query(&[("path", path)])
        .bearer_auth(&source.credential)
        .header("x-gpuci-agent-id", &source.agent_id)
        .header(reqwest::header::CONTENT_LENGTH, size)
        .body(reqwest::Body::wrap_stream(body))
        .send()
        .await
        .map_err(|e| (format!("upload failed: {e}"), false))?;
    if resp.status().is_success() {
        Ok(resp.json::<gpuci_protocol::api::ArtifactInfo>().await.ok().and_then(|i| i.note))
    } else {
        let capped = matches!(resp.status().as_u16(), 413 | 507);
        Err((format!("the coordinator refused it: {}", error_of(resp).await), capped))
    }
}

/// Places the artifacts of the steps job `job` names in `artifacts_from:` into `workspace`,
/// each checked against its sha256. `Err`: the job must not start (a download failed, or an
/// artifact would have landed outside the workspace).
pub async fn fetch_inputs(
    job: JobId,
    source: Option<&UploadSource>,
    workspace: &Path,
    log: &(dyn Fn(String) + Send + Sync),
) -> Result<(), String> {
    let source = source.ok_or("this agent has no coordinator to download artifacts from")?;
    let url = format!("{}/api/v1/jobs/{job}/artifact-inputs", source.server);
    let resp = source
        .http
        .get(&url)
        .bearer_auth(&source.credential)
        .header("x-gpuci-agent-id", &source.agent_id)
        .send()
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("listing the artifacts to download: {}", error_of(resp).await));
    }
    let inputs: ArtifactInputs = resp.json().await.map_err(|e| format!("listing the artifacts to download: {e}"))?;
    for note in inputs.notes {
        log(note);
    }
    let mut bytes = 0;
    for f in &inputs.files {
        let (ws, rel) = (workspace.to_path_buf(), f.path.clone());
        let file = tokio::task::spawn_blocking(move || create_in(&ws, &rel))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("artifact {:?} of job {} refused: {e}", f.path, f.job_id))?;
        let url = format!("{}/api/v1/jobs/{job}/artifact-inputs/{}", source.server, f.sha256);
        let resp = source
            .http
            .get(&url)
            .bearer_auth(&source.credential)
            .header("x-gpuci-agent-id", &source.agent_id)
            .send()
            .await
            .map_err(|e| format!("downloading artifact {:?}: {e}", f.path))?;
        if !resp.status().is_success() {
            return Err(format!("downloading artifact {:?}: {}", f.path, error_of(resp).await));
        }
        let mut out = tokio::fs::File::from_std(file);
        let mut hasher = Sha256::new();
        let mut got: u64 = 0;
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| format!("downloading artifact {:?}: {e}", f.path))?;
            got += chunk.len() as u64;
            if got > f.size {
                return Err(format!("artifact {:?}: more bytes than its size {}", f.path, f.size));
            }
            hasher.update(&chunk);
            out.write_all(&chunk).await.map_err(|e| format!("writing artifact {:?}: {e}", f.path))?;
        }
        out.flush().await.map_err(|e| format!("writing artifact {:?}: {e}", f.path))?;
        let actual = hex::encode(hasher.finalize());
        if actual != f.sha256 || got != f.size {
            return Err(format!("artifact {:?}: the download does not match its sha256 {}", f.path, f.sha256));
        }
        bytes += got;
    }
    if !inputs.files.is_empty() {
        log(format!("artifacts: {} file(s), {}, placed in the workspace", inputs.files.len(), Bytes(bytes)));
    }
    Ok(())
}
