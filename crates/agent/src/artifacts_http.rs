//! A job's artifacts to and from the coordinator, as this agent (its credential and
//! `x-gpuci-agent-id`; the coordinator checks the job is this agent's). What is uploaded
//! and where a download may land are decided by [`crate::artifacts`]; everything the job
//! should know (each refusal and why, what was uploaded) goes to its log through `log`.
//! A transfer cut off or answered 5xx (a coordinator failover) is tried again at the
//! coordinator leading then, within the bound of [`crate::transfer_retry`]; an artifact still
//! not stored then is returned to the caller, and fails the step.

use crate::artifacts::{collect, create_in, Found};
use crate::transfer_retry::{retry, Failure, GaveUp, LostArtifact};
use crate::workspace::UploadSource;
use futures::StreamExt;
use gpuci_core::artifacts::{ArtifactSpec, Patterns};
use gpuci_core::quantity::Bytes;
use gpuci_protocol::api::{ArtifactInputs, ErrorBody};
use gpuci_protocol::JobId;
use sha2::{Digest, Sha256};
use std::path::Path;
use tokio::io::AsyncWriteExt;

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
/// over `max_file`. A file cut off or refused for a while (a failover) is sent again
/// ([`crate::transfer_retry`]). What could not be uploaded is said in the job's log; the
/// files lost that way (the coordinator unreachable or failing throughout, not a cap nor a
/// file refused) are returned: they fail the step.
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
) -> Vec<LostArtifact> {
    let mut lost = Vec::new();
    if spec.is_empty() {
        return lost;
    }
    if !spec.when.applies(succeeded) {
        log(format!(
            "{what}: not uploaded (when: {}, and the step {})",
            spec.when.as_str(),
            if succeeded { "succeeded" } else { "did not succeed" }
        ));
        return lost;
    }
    let Some(source) = source else {
        log(format!("{what}: not uploaded: this agent has no coordinator to upload to"));
        return lost;
    };
    let patterns = match Patterns::new(&spec.paths) {
        Ok(p) => p,
        Err(e) => {
            log(format!("{what}: not uploaded: {e}"));
            return lost;
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
            Found::File { path, file, size } => match put(source, job, &path, file, size, what, log).await {
                Ok(note) => {
                    if let Some(note) = note {
                        log(format!("{what}: {path}: {note}"));
                    }
                    stored += 1;
                    bytes += size;
                    capped_in_a_row = 0;
                    continue;
                }
                Err(e) if e.is_lost() => {
                    log(format!("{what}: {path:?} was NOT stored: {e}; the step fails"));
                    lost.push(LostArtifact { path, why: e.to_string() });
                    // The coordinator was out of reach for the whole bound: the step fails
                    // already, and each further file would wait as long again.
                    log(format!("{what}: stopped: the files after it (if any) were not sent"));
                    break;
                }
                Err(e) => {
                    capped_in_a_row = if e.last.is_cap() { capped_in_a_row + 1 } else { 0 };
                    match e.last {
                        Failure::Final(why) => (path, why),
                        _ => (path, format!("the coordinator refused it: {e}")),
                    }
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
    if stored == 0 && refused == 0 && lost.is_empty() {
        log(format!("{what}: no file matched {}", spec.paths.join(", ")));
    } else {
        let not_stored = match lost.len() {
            0 => String::new(),
            n => format!("; {n} NOT stored (the coordinator could not be reached or failed)"),
        };
        log(format!("{what}: uploaded {stored} file(s), {}; {refused} refused{not_stored}", Bytes(bytes)));
    }
    lost
}

/// Bytes read from a file for an upload's body at a time.
const CHUNK: usize = 256 << 10;

/// Streams one opened file (its first `size` bytes) to the coordinator, again from its start
/// at the coordinator leading then when a try is cut off or answered 5xx (a failover).
async fn put(
    source: &UploadSource,
    job: JobId,
    path: &str,
    file: std::fs::File,
    size: u64,
    what: &str,
    log: &(dyn Fn(String) + Send + Sync),
) -> Result<Option<String>, GaveUp> {
    // The descriptor `collect` opened, read at explicit offsets: every try reads the same
    // file from its start, whatever a try before left behind (a job cannot swap the file
    // between tries: it is never opened again by its path).
    let file = std::sync::Arc::new(file);
    let on_retry = |e: &Failure, wait: std::time::Duration| {
        log(format!("{what}: {path}: {e}; sending it again in {} ms", wait.as_millis()));
    };
    retry(&source.retry, || put_once(source, job, path, file.clone(), size), on_retry).await
}

async fn put_once(
    source: &UploadSource,
    job: JobId,
    path: &str,
    file: std::sync::Arc<std::fs::File>,
    size: u64,
) -> Result<Option<String>, Failure> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    // The coordinator leading now (after a failover, the new one).
    let (http, base) = source.endpoint().await?;
    let url = format!("{base}/api/v1/jobs/{job}/artifact-upload");
    let sent = Arc::new(AtomicU64::new(0));
    let read_error: Arc<Mutex<Option<String>>> = Arc::default();
    let (sent2, read_error2) = (sent.clone(), read_error.clone());
    let body = futures::stream::try_unfold(0u64, move |at| {
        let (file, sent, read_error) = (file.clone(), sent2.clone(), read_error2.clone());
        async move {
            if at >= size {
                return Ok(None);
            }
            let len = usize::try_from(size - at).unwrap_or(CHUNK).min(CHUNK);
            let read = tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; len];
                file.read_exact_at(&mut buf, at).map(|()| buf)
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            match read {
                Ok(buf) => {
                    sent.store(at + len as u64, Ordering::Relaxed);
                    Ok(Some((buf, at + len as u64)))
                }
                Err(e) => {
                    *read_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                    Err(e)
                }
            }
        }
    });
    let request = http
        .put(&url)
        .query(&[("path", path)])
        .bearer_auth(&source.credential)
        .header("x-gpuci-agent-id", &source.agent_id)
        .header(reqwest::header::CONTENT_LENGTH, size)
        .body(reqwest::Body::wrap_stream(body))
        .send();
    let resp = tokio::select! {
        r = request => r,
        () = stalled(&sent, size, source.retry.stall) => {
            return Err(Failure::Transport(format!(
                "the upload made no progress for {} ms", source.retry.stall.as_millis()
            )));
        }
    };
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            if let Some(why) = read_error.lock().unwrap_or_else(|e| e.into_inner()).take() {
                return Err(Failure::Final(format!("reading the file: {why}")));
            }
            return Err(Failure::Transport(format!("upload failed: {e}")));
        }
    };
    if resp.status().is_success() {
        Ok(resp.json::<gpuci_protocol::api::ArtifactInfo>().await.ok().and_then(|i| i.note))
    } else {
        Err(status_failure(resp).await)
    }
}

/// Ends once the body of an upload has been read no further for `stall` while some of it is
/// still to send; never, once it is all sent (then the HTTP client's read timeout bounds the
/// wait for the answer).
async fn stalled(sent: &std::sync::atomic::AtomicU64, size: u64, stall: std::time::Duration) {
    use std::sync::atomic::Ordering;
    let mut last = sent.load(Ordering::Relaxed);
    let mut since = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(stall / 8).await;
        let now = sent.load(Ordering::Relaxed);
        if now != last || now >= size {
            last = now;
            since = tokio::time::Instant::now();
        } else if since.elapsed() >= stall {
            return;
        }
    }
}

/// A coordinator's answer that is not a success, as a [`Failure`].
async fn status_failure(resp: reqwest::Response) -> Failure {
    let status = resp.status().as_u16();
    let message = error_of(resp).await;
    Failure::Status { status, message }
}

/// Places the artifacts of the steps job `job` names in `artifacts_from:` into `workspace`,
/// each checked against its sha256; the listing and each file are fetched again (a file
/// from its start) when a try is cut off or answered 5xx (a failover). `Err`: the job must
/// not start (a download failed, or an artifact would have landed outside the workspace).
pub async fn fetch_inputs(
    job: JobId,
    source: Option<&UploadSource>,
    workspace: &Path,
    log: &(dyn Fn(String) + Send + Sync),
) -> Result<(), String> {
    let source = source.ok_or("this agent has no coordinator to download artifacts from")?;
    let on_retry = |what: &str, e: &Failure, wait: std::time::Duration| {
        log(format!("artifacts: {what}: {e}; trying again in {} ms", wait.as_millis()));
    };
    let inputs = retry(&source.retry, || list_inputs(source, job), |e, w| on_retry("listing", e, w))
        .await
        .map_err(|e| format!("listing the artifacts to download: {e}"))?;
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
        let shown = format!("{:?}", f.path);
        retry(&source.retry, || fetch_one(source, job, f, &file), |e, w| on_retry(&shown, e, w))
            .await
            .map_err(|e| format!("downloading artifact {:?}: {e}", f.path))?;
        bytes += f.size;
    }
    if !inputs.files.is_empty() {
        log(format!("artifacts: {} file(s), {}, placed in the workspace", inputs.files.len(), Bytes(bytes)));
    }
    Ok(())
}

async fn list_inputs(source: &UploadSource, job: JobId) -> Result<ArtifactInputs, Failure> {
    let (http, base) = source.endpoint().await?;
    let url = format!("{base}/api/v1/jobs/{job}/artifact-inputs");
    let resp = http
        .get(&url)
        .bearer_auth(&source.credential)
        .header("x-gpuci-agent-id", &source.agent_id)
        .send()
        .await
        .map_err(|e| Failure::Transport(format!("GET {url}: {e}")))?;
    if !resp.status().is_success() {
        return Err(status_failure(resp).await);
    }
    // Read whole first: a body cut off is the network's, one that does not parse is not.
    let body = resp.bytes().await.map_err(|e| Failure::Transport(format!("GET {url}: {e}")))?;
    serde_json::from_slice(&body).map_err(|e| Failure::Final(format!("GET {url}: {e}")))
}

/// One try of downloading input `f` into `file` (created by `create_in`; emptied first, so
/// every try writes it from its start) and checking it.
async fn fetch_one(
    source: &UploadSource,
    job: JobId,
    f: &gpuci_protocol::api::ArtifactInfo,
    file: &std::fs::File,
) -> Result<(), Failure> {
    use std::io::Seek;
    let local = |e: std::io::Error| Failure::Final(format!("writing artifact {:?}: {e}", f.path));
    let mut out = file.try_clone().map_err(local)?;
    out.set_len(0).map_err(local)?;
    out.seek(std::io::SeekFrom::Start(0)).map_err(local)?;
    let mut out = tokio::fs::File::from_std(out);
    let (http, base) = source.endpoint().await?;
    let url = format!("{base}/api/v1/jobs/{job}/artifact-inputs/{}", f.sha256);
    let resp = http
        .get(&url)
        .bearer_auth(&source.credential)
        .header("x-gpuci-agent-id", &source.agent_id)
        .send()
        .await
        .map_err(|e| Failure::Transport(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(status_failure(resp).await);
    }
    let mut hasher = Sha256::new();
    let mut got: u64 = 0;
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| Failure::Transport(format!("cut off after {got} bytes: {e}")))?;
        got += chunk.len() as u64;
        if got > f.size {
            return Err(Failure::Final(format!("more bytes than its size {}", f.size)));
        }
        hasher.update(&chunk);
        out.write_all(&chunk).await.map_err(local)?;
    }
    out.flush().await.map_err(local)?;
    if got < f.size {
        return Err(Failure::Transport(format!("cut off after {got} of {} bytes", f.size)));
    }
    let actual = hex::encode(hasher.finalize());
    if actual != f.sha256 {
        return Err(Failure::Final(format!("the download does not match its sha256 {}", f.sha256)));
    }
    Ok(())
}

#[cfg(test)]
#[path = "transfer_tests.rs"]
mod transfer_tests;
