//! A small typed client for the coordinator's REST API.

use crate::cli::{default_data_dir, ClientArgs};
use crate::{CliError, CliResult};
use anyhow::Context;
use futures::StreamExt;
use gpuci_protocol::api::*;
use serde::de::DeserializeOwned;

pub struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    pub fn new(base: &str, token: &str) -> CliResult<Self> {
        let http = reqwest::Client::builder().connect_timeout(std::time::Duration::from_secs(5)).build()?;
        Ok(Client { http, base: base.trim_end_matches('/').to_string(), token: token.to_string() })
    }

    /// From `--server`/`--token`, or the token file in the data dir.
    pub fn from_args(a: &ClientArgs) -> CliResult<Self> {
        let token = match &a.token {
            Some(t) => t.clone(),
            None => {
                let dir = a.data_dir.clone().unwrap_or_else(|| default_data_dir("gpuci"));
                let path = dir.join("api-token");
                std::fs::read_to_string(&path).map(|s| s.trim().to_string()).map_err(|e| {
                    CliError::Input(format!(
                        "no API token: pass --token or GPUCI_TOKEN, or run on the coordinator's machine ({}: {e})",
                        path.display()
                    ))
                })?
            }
        };
        Self::new(&a.server, &token)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn check(resp: reqwest::Response) -> CliResult<reqwest::Response> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let body: Option<ErrorBody> = serde_json::from_str(&text).ok();
        let msg = match body {
            Some(b) if !b.pipeline_errors.is_empty() => {
                let lines: Vec<String> = b
                    .pipeline_errors
                    .iter()
                    .map(|e| format!("{}:{}:{}: {}: {}", e.file, e.line, e.column, e.field, e.message))
                    .collect();
                return Err(CliError::Input(format!("{}\n{}", b.error, lines.join("\n"))));
            }
            Some(b) => b.error,
            None => text,
        };
        if status.is_client_error() && status != reqwest::StatusCode::UNAUTHORIZED {
            return Err(CliError::Input(format!("{msg} ({status})")));
        }
        Err(CliError::Other(anyhow::anyhow!("{msg} ({status})")))
    }

    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> CliResult<T> {
        let resp = self
            .http
            .get(self.url(path))
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("reaching {}", self.base))?;
        Ok(Self::check(resp).await?.json().await?)
    }

    async fn post<B: serde::Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> CliResult<T> {
        let resp = self
            .http
            .post(self.url(path))
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .with_context(|| format!("reaching {}", self.base))?;
        Ok(Self::check(resp).await?.json().await?)
    }

    pub async fn submit(&self, req: &SubmitPipeline) -> CliResult<PipelineSummary> {
        self.post("/api/v1/pipelines", req).await
    }
    pub async fn pipeline(&self, id: i64) -> CliResult<PipelineSummary> {
        self.get(&format!("/api/v1/pipelines/{id}")).await
    }
    pub async fn jobs(&self, query: &str) -> CliResult<Vec<JobSummary>> {
        self.get(&format!("/api/v1/jobs?{query}")).await
    }
    pub async fn job(&self, id: i64) -> CliResult<JobSummary> {
        self.get(&format!("/api/v1/jobs/{id}")).await
    }
    pub async fn cancel(&self, id: i64, reason: Option<String>) -> CliResult<JobSummary> {
        self.post(&format!("/api/v1/jobs/{id}/cancel"), &CancelRequest { reason }).await
    }
    pub async fn agents(&self) -> CliResult<Vec<AgentSummary>> {
        self.get("/api/v1/agents").await
    }
    /// Send a request that answers with no body; a non-2xx becomes the server's error message.
    async fn send_no_content(&self, req: reqwest::RequestBuilder) -> CliResult<()> {
        let resp = req.bearer_auth(&self.token).send().await.with_context(|| format!("reaching {}", self.base))?;
        Self::check(resp).await?;
        Ok(())
    }
    pub async fn release_gpu(&self, uuid: &str) -> CliResult<()> {
        self.send_no_content(self.http.post(self.url(&format!("/api/v1/gpus/{uuid}/release")))).await
    }
    pub async fn set_secret(&self, name: &str, value: &str) -> CliResult<()> {
        let req =
            self.http.put(self.url(&format!("/api/v1/secrets/{name}"))).json(&serde_json::json!({ "value": value }));
        self.send_no_content(req).await
    }
    pub async fn delete_secret(&self, name: &str) -> CliResult<()> {
        self.send_no_content(self.http.delete(self.url(&format!("/api/v1/secrets/{name}")))).await
    }
    pub async fn secrets(&self) -> CliResult<Vec<serde_json::Value>> {
        self.get("/api/v1/secrets").await
    }

    /// Stream an NDJSON endpoint, calling `each` per item until it returns false or the stream ends.
    pub async fn stream<T: DeserializeOwned>(&self, path: &str, mut each: impl FnMut(T) -> bool) -> CliResult<()> {
        let resp = self
            .http
            .get(self.url(path))
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("reaching {}", self.base))?;
        let mut body = Self::check(resp).await?.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        while let Some(chunk) = body.next().await {
            buf.extend_from_slice(&chunk?);
            while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=pos).collect();
                let item: T = serde_json::from_slice(&line[..line.len() - 1]).context("reading event stream")?;
                if !each(item) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

/// The largest upload the coordinator accepts.
pub const MAX_UPLOAD_BYTES: u64 = 512 << 20;

/// A workspace packed for upload: a gzip'ed tar in a temporary file.
pub struct PackedWorkspace {
    pub root: std::path::PathBuf,
    pub files: usize,
    pub bytes: u64,
    archive: tempfile::NamedTempFile,
}

/// Which directory a pipeline's workspace is made of: `upload` if given, else the git work tree
/// holding `pipeline_file`, else the file's directory. `None` with `--no-upload`.
pub fn workspace_root(pipeline_file: &std::path::Path, a: &crate::cli::UploadArgs) -> Option<std::path::PathBuf> {
    if a.no_upload {
        return None;
    }
    if let Some(dir) = &a.upload {
        return Some(dir.clone());
    }
    let dir = match pipeline_file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    Some(git_toplevel(&dir).unwrap_or(dir))
}

fn git_toplevel(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["rev-parse", "--show-toplevel"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let top = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !top.trim().is_empty()).then(|| std::path::PathBuf::from(top.trim_end_matches('\n')))
}

/// The files under `root` to upload, relative to it: what git lists (tracked, and untracked but
/// not ignored) in a git work tree, else every file, skipping `.git`.
fn workspace_files(root: &std::path::Path) -> CliResult<Vec<std::path::PathBuf>> {
    use std::path::PathBuf;
    if git_toplevel(root).is_some() {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(["ls-files", "-z", "--cached", "--others", "--exclude-standard"])
            .output()
            .with_context(|| format!("running git ls-files in {}", root.display()))?;
        if !out.status.success() {
            return Err(CliError::Other(anyhow::anyhow!(
                "git ls-files in {}: {}",
                root.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let mut files: Vec<PathBuf> = Vec::new();
        for name in out.stdout.split(|b| *b == 0).filter(|n| !n.is_empty()) {
            use std::os::unix::ffi::OsStrExt;
            let rel = PathBuf::from(std::ffi::OsStr::from_bytes(name));
            // Deleted but still in the index, or a submodule (a directory): not uploaded.
            match std::fs::symlink_metadata(root.join(&rel)) {
                Ok(m) if !m.is_dir() => files.push(rel),
                _ => {}
            }
        }
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let mut files = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        let entries = std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?;
        for e in entries {
            let e = e.with_context(|| format!("reading {}", dir.display()))?;
            let name = rel.join(e.file_name());
            let kind = e.file_type().with_context(|| format!("reading {}", root.join(&name).display()))?;
            if kind.is_dir() {
                if e.file_name() != ".git" {
                    stack.push(name);
                }
            } else if kind.is_file() || kind.is_symlink() {
                files.push(name);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Pack the files of `root` into a gzip'ed tar, modes kept (executable or not), owners and times
/// not: the same files make the same archive, and so the same upload id.
pub fn pack_workspace(root: &std::path::Path) -> CliResult<PackedWorkspace> {
    let meta =
        std::fs::metadata(root).map_err(|e| CliError::Input(format!("cannot upload {}: {e}", root.display())))?;
    if !meta.is_dir() {
        return Err(CliError::Input(format!("cannot upload {}: not a directory", root.display())));
    }
    let files = workspace_files(root)?;
    let archive = tempfile::Builder::new().prefix("gpuci-upload-").suffix(".tar.gz").tempfile()?;
    let gz = flate2::write::GzEncoder::new(std::io::BufWriter::new(archive.reopen()?), flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    tar.mode(tar::HeaderMode::Deterministic);
    tar.follow_symlinks(false);
    for rel in &files {
        tar.append_path_with_name(root.join(rel), rel)
            .with_context(|| format!("packing {}", root.join(rel).display()))?;
    }
    let gz = tar.into_inner().context("packing the workspace")?;
    let mut out = gz.finish().context("packing the workspace")?;
    std::io::Write::flush(&mut out)?;
    drop(out);
    let bytes = archive.as_file().metadata()?.len();
    if bytes > MAX_UPLOAD_BYTES {
        return Err(CliError::Input(format!(
            "{}: {} files make {:.1} MiB compressed, more than the {} MiB an upload may have; \
             choose a smaller directory (--upload DIR) or --no-upload",
            root.display(),
            files.len(),
            bytes as f64 / (1 << 20) as f64,
            MAX_UPLOAD_BYTES >> 20
        )));
    }
    Ok(PackedWorkspace { root: root.to_path_buf(), files: files.len(), bytes, archive })
}

impl Client {
    /// Upload a packed workspace; returns its id.
    pub async fn upload(&self, w: &PackedWorkspace) -> CliResult<UploadInfo> {
        let file = tokio::fs::File::open(w.archive.path()).await?;
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(file));
        let resp = self
            .http
            .post(self.url("/api/v1/uploads"))
            .bearer_auth(&self.token)
            .header(reqwest::header::CONTENT_TYPE, "application/gzip")
            .header(reqwest::header::CONTENT_LENGTH, w.bytes)
            .body(body)
            .send()
            .await
            .with_context(|| format!("reaching {}", self.base))?;
        Ok(Self::check(resp).await?.json().await?)
    }

    /// Pack and upload the workspace of `pipeline_file` (see [`workspace_root`]), telling on
    /// stderr what goes up. `None` with `--no-upload`.
    /// Upload the pipeline's work tree (unless told not to) and submit the pipeline with it.
    pub async fn submit_file(
        &self,
        file: &std::path::Path,
        source: String,
        upload: &crate::cli::UploadArgs,
    ) -> CliResult<PipelineSummary> {
        let workspace_upload = self.upload_workspace(file, upload).await?;
        self.submit(&SubmitPipeline {
            file_name: file.display().to_string(),
            source,
            env: Default::default(),
            workspace_upload,
            repository: repository_of(file),
        })
        .await
    }

    pub async fn upload_workspace(
        &self,
        pipeline_file: &std::path::Path,
        a: &crate::cli::UploadArgs,
    ) -> CliResult<Option<String>> {
        let Some(root) = workspace_root(pipeline_file, a) else { return Ok(None) };
        let packed = tokio::task::spawn_blocking(move || pack_workspace(&root))
            .await
            .map_err(|e| CliError::Other(anyhow::anyhow!("packing the workspace: {e}")))??;
        eprintln!(
            "uploading {} files ({:.1} MiB) from {}",
            packed.files,
            packed.bytes as f64 / (1 << 20) as f64,
            packed.root.display()
        );
        Ok(Some(self.upload(&packed).await?.id))
    }
}

/// The repository a pipeline file belongs to, as caches are keyed: its git `origin` URL, else
/// the work tree's path; none outside git.
pub fn repository_of(file: &std::path::Path) -> Option<String> {
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .filter(|s| !s.is_empty())
    };
    git(&["config", "--get", "remote.origin.url"]).or_else(|| git(&["rev-parse", "--show-toplevel"]))
}
