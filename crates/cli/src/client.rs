//! A small typed client for the coordinator's REST API.

use crate::cli::{default_data_dir, ClientArgs};
use crate::worktree::WorkTree;
use crate::{CliError, CliResult};
use anyhow::Context;
use futures::StreamExt;
use gpuci_protocol::api::*;
use serde::de::DeserializeOwned;

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
    /// The coordinator's endpoint and the installation's key it proves before every request
    /// that carries the token (given with `--coordinator-key`, read beside the token, or the
    /// one it proved when the command started); `None`: nothing to prove (no key known, or a
    /// coordinator too old to prove one).
    proof: Option<(gpuci_agent::follow::Target, String)>,
    /// Every coordinator's URL and the key to pin, when the leader was found among them: a
    /// command that outlives a failover finds the new leader ([`Client::again`]). The key is
    /// the one the first leader proved when none was given: the next must prove the same.
    among: Option<(Vec<String>, Option<String>)>,
}

impl Client {
    pub fn new(base: &str, token: &str) -> CliResult<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(5))
            .pool_idle_timeout(gpuci_protocol::CLIENT_POOL_IDLE)
            .build()?;
        Ok(Client {
            http,
            base: base.trim_end_matches('/').to_string(),
            token: token.to_string(),
            proof: None,
            among: None,
        })
    }

    /// A client of the coordinator that leads among `servers` (see [`leader`]) and proves the
    /// identity key `pin` (when one is given).
    pub fn of_leader(servers: &[String], token: &str, pin: Option<String>) -> CliResult<Self> {
        let urls = gpuci_agent::follow::parse_urls(servers).map_err(|e| CliError::Input(format!("--server: {e}")))?;
        let target = leader(urls.clone(), pin.clone())?;
        Self::of_target(target, urls, token.to_string(), pin)
    }

    /// A client of `target`, found among `urls`; it proves `pin`, or the key it proved when
    /// found, before each request.
    fn of_target(
        target: gpuci_agent::follow::Target,
        urls: Vec<String>,
        token: String,
        pin: Option<String>,
    ) -> CliResult<Self> {
        let http = target.client(reqwest::Client::builder().connect_timeout(std::time::Duration::from_secs(5)))?;
        let key = pin.or_else(|| target.key.clone());
        Ok(Client {
            http,
            base: target.base.clone(),
            token,
            proof: key.clone().map(|k| (target, k)),
            among: Some((urls, key)),
        })
    }

    /// A client of whichever coordinator leads now (the same one when only one was given):
    /// for a command that lost its coordinator midway (a failover, a restart).
    pub async fn again(&self) -> CliResult<Client> {
        let Some((urls, pin)) = self.among.clone() else {
            return Ok(self.clone());
        };
        let target = find_leader(urls.clone(), pin.clone()).await?;
        Self::of_target(target, urls, self.token.clone(), pin)
    }

    /// The coordinator this client talks to.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// From `--server`/`--token`/`--coordinator-key`, or the token and key files in the data dir.
    pub fn from_args(a: &ClientArgs) -> CliResult<Self> {
        let dir = a.data_dir.clone().unwrap_or_else(|| default_data_dir("gpuci"));
        let token = match &a.token {
            Some(t) => t.clone(),
            None => {
                let path = dir.join("api-token");
                std::fs::read_to_string(&path).map(|s| s.trim().to_string()).map_err(|e| {
                    CliError::Input(format!(
                        "no API token: pass --token or GPUCI_TOKEN, or run on the coordinator's machine ({}: {e})",
                        path.display()
                    ))
                })?
            }
        };
        let pin = match &a.coordinator_key {
            Some(k) => Some(
                gpuci_core::coordinator_identity::parse_key(k)
                    .map_err(|e| CliError::Input(format!("--coordinator-key: {e}")))?,
            ),
            // On the coordinator's machine: the key it wrote beside the token (a file that is
            // there but not a key is an error, not a reason to go unpinned).
            None => {
                let path = dir.join(gpuci_coordinator::identity::PUBLIC_KEY_FILE);
                match std::fs::read_to_string(&path) {
                    Ok(k) => Some(
                        gpuci_core::coordinator_identity::parse_key(&k)
                            .map_err(|e| CliError::Input(format!("{}: {e}", path.display())))?,
                    ),
                    Err(_) => None,
                }
            }
        };
        if pin.is_none() && a.server.len() > 1 {
            eprintln!(
                "note: no coordinator identity key pinned (--coordinator-key or GPUCI_COORDINATOR_KEY; the \
                 coordinator's data dir has it as coordinator-key.pub): the API token goes to whichever address \
                 leads"
            );
        }
        Self::of_leader(&a.server, &token, pin)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends `req` with the API token. With a key to prove, the coordinator proves it first on
    /// this client, whose kept-alive connection the request then goes over: the token is not
    /// sent on a new connection to an address that proved the key a moment ago on another
    /// (one that changed hands in between, a killed leader's port taken during a failover,
    /// got it before).
    async fn send(&self, req: reqwest::RequestBuilder) -> CliResult<reqwest::Response> {
        if let Some((target, key)) = self.proof.as_ref().filter(|_| self.base.starts_with("http://")) {
            let req = req.bearer_auth(&self.token).build()?;
            return send_proved(target, key, req)
                .await
                .map_err(|e| CliError::Other(e.context(format!("reaching {}", self.base))));
        }
        // Over TLS the certificate names whom the connection reached; the proof goes first on
        // the pooled connection the request then takes.
        if let Some((target, key)) = &self.proof {
            gpuci_agent::follow::prove_with(&self.http, target, Some(key)).await.map_err(|why| {
                CliError::Other(anyhow::anyhow!(
                    "{} did not prove the coordinators' identity key: {why}; the API token was not sent",
                    self.base
                ))
            })?;
        }
        Ok(req.bearer_auth(&self.token).send().await.with_context(|| format!("reaching {}", self.base))?)
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
        let resp = self.send(self.http.get(self.url(path))).await?;
        Ok(Self::check(resp).await?.json().await?)
    }

    async fn post<B: serde::Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> CliResult<T> {
        let resp = self.send(self.http.post(self.url(path)).json(body)).await?;
        Ok(Self::check(resp).await?.json().await?)
    }

    /// Submits `req`. With a submission key, sent again while no answer comes (the
    /// connection fails, no answer within [`SUBMIT_ANSWER_WAIT`], or the coordinator answers
    /// with a server error: a failover, a restart, a frozen leader),
    /// to whichever coordinator leads then, for up to [`RESEND_FOR`]: the key makes the
    /// pipeline once however often it arrives. A coordinator too old to take a key is sent
    /// the request without one, and the CLI says what that risks.
    pub async fn submit(&self, req: &SubmitPipeline) -> CliResult<PipelineSummary> {
        if req.submission.is_none() {
            return self.post("/api/v1/pipelines", req).await;
        }
        let t0 = std::time::Instant::now();
        let mut client = self.clone();
        let mut req = std::borrow::Cow::Borrowed(req);
        loop {
            // A frozen coordinator never answers: the request is given up after a while and
            // sent again (its key makes that safe), not waited on for ever (outsider attack:
            // a leader SIGSTOPped just after the request left held `gpuci submit` 396 s).
            let sent = tokio::time::timeout(
                SUBMIT_ANSWER_WAIT,
                client.send(client.http.post(client.url("/api/v1/pipelines")).json(&*req)),
            )
            .await
            .unwrap_or_else(|_| {
                Err(CliError::Other(anyhow::anyhow!("no answer within {} s", SUBMIT_ANSWER_WAIT.as_secs())))
            });
            let why = match sent {
                // Any server error: with the key, sending it again cannot make the pipeline
                // twice (a leader resumed after a freeze answered 500 for a write its database
                // had ended, while another led).
                Ok(resp) if resp.status().is_server_error() => {
                    let status = resp.status();
                    let text = resp.text().await.unwrap_or_default();
                    let said: Option<ErrorBody> = serde_json::from_str(&text).ok();
                    format!("{} answered {status}: {}", client.base, said.map_or(text, |b| b.error))
                }
                Ok(resp) => match Self::check(resp).await {
                    Err(CliError::Input(e)) if e.contains("unknown field `submission`") && req.submission.is_some() => {
                        eprintln!(
                            "note: {} is too old to take a submission key: sent without one (if this answer is                              lost, sending it again could make the pipeline twice)",
                            client.base
                        );
                        req.to_mut().submission = None;
                        continue;
                    }
                    checked => return Ok(checked?.json().await?),
                },
                Err(e) => format!("{e}"),
            };
            if t0.elapsed() >= RESEND_FOR {
                return Err(CliError::Other(anyhow::anyhow!(
                    "submitting: {why}; no coordinator answered for {} s (the pipeline is made at most once:                      `gpuci pipelines` shows whether it was)",
                    RESEND_FOR.as_secs()
                )));
            }
            eprintln!("submitting: {why}; sending it again (with its key: the pipeline is made once)");
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            match client.again().await {
                Ok(c) => client = c,
                Err(e) => eprintln!("submitting: {e}"),
            }
        }
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
        let resp = self.send(req).await?;
        Self::check(resp).await?;
        Ok(())
    }
    pub async fn release_gpu(&self, uuid: &str) -> CliResult<()> {
        self.send_no_content(self.http.post(self.url(&format!("/api/v1/gpus/{uuid}/release")))).await
    }
    pub async fn set_secret(&self, name: &str, scope: &crate::cli::SecretScopeArgs, value: &str) -> CliResult<()> {
        let req = self
            .http
            .put(self.url(&format!("/api/v1/secrets/{name}")))
            .query(&scope_query(scope))
            .json(&serde_json::json!({ "value": value }));
        self.send_no_content(req).await
    }
    pub async fn delete_secret(&self, name: &str, scope: &crate::cli::SecretScopeArgs) -> CliResult<()> {
        self.send_no_content(self.http.delete(self.url(&format!("/api/v1/secrets/{name}"))).query(&scope_query(scope)))
            .await
    }
    pub async fn secrets_key(&self, rotate: bool) -> CliResult<serde_json::Value> {
        if rotate {
            return self.post("/api/v1/secrets-key", &serde_json::json!({})).await;
        }
        self.get("/api/v1/secrets-key").await
    }
    pub async fn secrets(&self) -> CliResult<Vec<serde_json::Value>> {
        self.get("/api/v1/secrets").await
    }
    /// `GET /api/v1/audit` with these filters (encoded here).
    pub async fn audit(&self, query: &[(&str, String)]) -> CliResult<Vec<gpuci_protocol::api::AuditEntry>> {
        let resp = self.send(self.http.get(self.url("/api/v1/audit")).query(query)).await?;
        Ok(Self::check(resp).await?.json().await?)
    }
    pub async fn create_token(&self, name: &str) -> CliResult<gpuci_protocol::api::CreatedToken> {
        self.post("/api/v1/tokens", &gpuci_protocol::api::CreateToken { name: name.to_string() }).await
    }
    pub async fn revoke_token(&self, name: &str) -> CliResult<()> {
        let mut url = reqwest::Url::parse(&self.url("/api/v1/tokens")).map_err(anyhow::Error::from)?;
        // One path segment, whatever the name holds (the server refuses odd names itself).
        url.path_segments_mut().map_err(|()| anyhow::anyhow!("bad server URL {}", self.base))?.push(name);
        self.send_no_content(self.http.delete(url)).await
    }

    /// Fire a schedule now (`POST /api/v1/schedules/{name}/run`).
    pub async fn run_schedule(&self, name: &str) -> CliResult<gpuci_protocol::api::ScheduleFire> {
        let mut url = reqwest::Url::parse(&self.url("/api/v1/schedules")).map_err(anyhow::Error::from)?;
        url.path_segments_mut().map_err(|()| anyhow::anyhow!("bad server URL {}", self.base))?.push(name).push("run");
        let resp = self.send(self.http.post(url)).await?;
        Ok(Self::check(resp).await?.json().await?)
    }

    /// GET `segments` under the base URL (each percent-encoded as one path segment) with
    /// `query`, checked for errors; the body is the caller's to read (`gpuci artifacts download`).
    pub async fn get_raw(&self, segments: &[&str], query: &[(&str, &str)]) -> CliResult<reqwest::Response> {
        let mut url = reqwest::Url::parse(&self.base).map_err(|e| CliError::Input(format!("--server: {e}")))?;
        url.path_segments_mut()
            .map_err(|_| CliError::Input("--server: not a base URL".into()))?
            .pop_if_empty()
            .extend(segments);
        url.query_pairs_mut().extend_pairs(query);
        let resp = self.send(self.http.get(url)).await?;
        Self::check(resp).await
    }

    /// Stream an NDJSON endpoint, calling `each` per item until it returns false or the stream ends.
    pub async fn stream<T: DeserializeOwned>(&self, path: &str, mut each: impl FnMut(T) -> bool) -> CliResult<()> {
        // The answer's head is waited for as its body is: a coordinator that froze after
        // taking the connection never answers, and waiting on it without asking held
        // `gpuci logs --follow` for ever (a failover test, the leader stopped mid-request).
        let sent = self.send(self.http.get(self.url(path)));
        tokio::pin!(sent);
        let resp = loop {
            tokio::select! {
                resp = &mut sent => break resp?,
                () = tokio::time::sleep(STREAM_QUIET) => self.still_there().await?,
            }
        };
        let mut body = Self::check(resp).await?.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        loop {
            let chunk = tokio::select! {
                chunk = body.next() => chunk,
                // Quiet: a job that prints nothing, or a coordinator that froze or no longer
                // leads (its stream stays open and says nothing for ever). Asked which.
                () = tokio::time::sleep(STREAM_QUIET) => {
                    self.still_there().await?;
                    continue;
                }
            };
            let Some(chunk) = chunk else { break };
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

    /// Whether the coordinator of a quiet stream still answers, and still leads when it was
    /// found among several (a standby serves only what it passes on to the leader).
    async fn still_there(&self) -> CliResult<()> {
        let several = self.among.as_ref().is_some_and(|(urls, _)| urls.len() > 1);
        let path = if several { "/readyz" } else { "/healthz" };
        let asked = self.http.get(self.url(path)).timeout(STILL_THERE_WAIT).send().await;
        match asked {
            Ok(r) if r.status().is_success() => Ok(()),
            Ok(r) => Err(CliError::Other(anyhow::anyhow!("{} answers {path} {} now", self.base, r.status()))),
            Err(e) => Err(CliError::Other(anyhow::anyhow!(
                "{} did not answer {path} within {} s: {e}",
                self.base,
                STILL_THERE_WAIT.as_secs()
            ))),
        }
    }
}

/// A stream quiet this long asks whether its coordinator is still there.
const STREAM_QUIET: std::time::Duration = std::time::Duration::from_secs(10);
/// How long that question waits for an answer.
const STILL_THERE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// The largest upload the coordinator accepts.
pub const MAX_UPLOAD_BYTES: u64 = 512 << 20;

/// A workspace packed for upload: a gzip'ed tar in a temporary file.
pub struct PackedWorkspace {
    pub root: std::path::PathBuf,
    pub files: usize,
    pub bytes: u64,
    archive: tempfile::NamedTempFile,
}

/// Pack the files of `root` into a gzip'ed tar, modes kept (executable or not), owners and times
/// not: the same files make the same archive, and so the same upload id.
pub fn pack_workspace(root: &std::path::Path, files: &[std::path::PathBuf]) -> CliResult<PackedWorkspace> {
    let archive = tempfile::Builder::new().prefix("gpuci-upload-").suffix(".tar.gz").tempfile()?;
    let gz = flate2::write::GzEncoder::new(std::io::BufWriter::new(archive.reopen()?), flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    tar.mode(tar::HeaderMode::Deterministic);
    tar.follow_symlinks(false);
    for rel in files {
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
            .send(
                self.http
                    .post(self.url("/api/v1/uploads"))
                    .header(reqwest::header::CONTENT_TYPE, "application/gzip")
                    .header(reqwest::header::CONTENT_LENGTH, w.bytes)
                    .body(body),
            )
            .await?;
        Ok(Self::check(resp).await?.json().await?)
    }

    /// Upload the pipeline's work tree (unless told not to) and submit the pipeline with it.
    pub async fn submit_file(
        &self,
        file: &std::path::Path,
        source: String,
        upload: &crate::cli::UploadArgs,
    ) -> CliResult<PipelineSummary> {
        // Each phase's time at debug level (`GPUCI_LOG=debug`): this is the path a user waits on.
        let t0 = std::time::Instant::now();
        let ms = || t0.elapsed().as_secs_f64() * 1000.0;
        let (f, list_files) = (file.to_path_buf(), !upload.no_upload && upload.upload.is_none());
        let tree = tokio::task::spawn_blocking(move || WorkTree::probe(&f, list_files))
            .await
            .map_err(|e| CliError::Other(anyhow::anyhow!("asking git about {}: {e}", file.display())))?;
        tracing::debug!(ms = ms(), top = ?tree.top, "asked git");
        let (workspace_upload, workspace_archive) = match self.send_workspace(&tree, upload).await? {
            Workspace::None => (None, None),
            Workspace::Uploaded(id) => (Some(id), None),
            Workspace::Inline(b64) => (None, Some(b64)),
        };
        tracing::debug!(ms = ms(), "packed (and uploaded if large)");
        let (repository, passed_over) = tree.repository();
        if let Some(note) = passed_over {
            eprintln!("note: {}", gpuci_core::text::escape(&note));
        }
        // Only a file that says `if` anywhere can have a condition (a merge key or an alias
        // still spells it): the rest do not wait on git for facts nobody reads.
        let build = if source.contains("if") {
            let top = tree.top.clone();
            let facts = tokio::task::spawn_blocking(move || crate::worktree::build_facts(top.as_deref()))
                .await
                .map_err(|e| CliError::Other(anyhow::anyhow!("asking git about the build: {e}")))?;
            tracing::debug!(ms = ms(), ?facts, "build facts");
            facts
        } else {
            // What the builds list shows (commit, subject, author, branch): cheap to ask.
            let top = tree.top.clone();
            tokio::task::spawn_blocking(move || crate::worktree::commit_facts(top.as_deref()))
                .await
                .map_err(|e| CliError::Other(anyhow::anyhow!("asking git about the commit: {e}")))?
        };
        let p = self
            .submit(&SubmitPipeline {
                submission: Some(uuid::Uuid::new_v4().simple().to_string()),
                build: Some(build),
                file_name: file.display().to_string(),
                source,
                env: Default::default(),
                workspace_upload,
                workspace_archive,
                repository,
            })
            .await;
        tracing::debug!(ms = ms(), "submitted");
        p
    }

    /// Pack the workspace ([`WorkTree::upload_root`]), telling on stderr what goes up, and
    /// upload it unless it is small enough to go with the pipeline.
    async fn send_workspace(&self, tree: &WorkTree, a: &crate::cli::UploadArgs) -> CliResult<Workspace> {
        let Some((root, files)) = tree.upload_root(a)? else { return Ok(Workspace::None) };
        let packed = tokio::task::spawn_blocking(move || pack_workspace(&root, &files))
            .await
            .map_err(|e| CliError::Other(anyhow::anyhow!("packing the workspace: {e}")))??;
        tracing::debug!(files = packed.files, bytes = packed.bytes, "packed");
        eprintln!(
            "uploading {} files ({:.1} MiB) from {}",
            packed.files,
            packed.bytes as f64 / (1 << 20) as f64,
            packed.root.display()
        );
        if packed.bytes <= MAX_INLINE_WORKSPACE_BYTES as u64 {
            use base64::Engine;
            let bytes = std::fs::read(packed.archive.path()).context("reading the packed workspace")?;
            return Ok(Workspace::Inline(base64::engine::general_purpose::STANDARD.encode(bytes)));
        }
        Ok(Workspace::Uploaded(self.upload(&packed).await?.id))
    }
}

/// Sends `req` (its token in it) over a plain-HTTP connection of its own on which `target`
/// has just proved the installation's key `key`: the request can go nowhere else. A pooled
/// client sent it on a new connection when the proved one had closed (a coordinator killed
/// just then, its port taken: outsider attack, 11–13 of 30 requests through a relay that
/// closed after each proof).
async fn send_proved(
    target: &gpuci_agent::follow::Target,
    key: &str,
    req: reqwest::Request,
) -> anyhow::Result<reqwest::Response> {
    use anyhow::Context;
    let url = req.url().clone();
    let host_name = url.host_str().context("a URL with no host")?.to_string();
    // What `Host` says (the proof was for it): the URL's host, and its port unless it is the
    // scheme's default.
    let host = match url.port() {
        Some(p) => format!("{host_name}:{p}"),
        None => host_name.clone(),
    };
    let tcp = gpuci_agent::follow::proved_stream(target, key).await.map_err(|why| {
        anyhow::anyhow!(
            "{} did not prove the coordinators' identity key: {why}; the API token was not sent",
            target.base
        )
    })?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, reqwest::Body>(hyper_util::rt::TokioIo::new(tcp)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut sent: hyper::Request<reqwest::Body> = req.try_into()?;
    let path = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_string(),
    };
    *sent.uri_mut() = path.parse()?;
    sent.headers_mut().insert(hyper::header::HOST, host.parse()?);
    let resp = sender.send_request(sent).await?;
    Ok(reqwest::Response::from(resp.map(|body| reqwest::Body::wrap_stream(http_body_util::BodyDataStream::new(body)))))
}

/// How a pipeline's workspace goes to the coordinator.
enum Workspace {
    /// `--no-upload`.
    None,
    /// Uploaded first; its id.
    Uploaded(String),
    /// Small: sent with the pipeline (base64 of the archive).
    Inline(String),
}

/// How long one sending of a submission waits for its answer ([`Client::submit`]).
const SUBMIT_ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// How long a submission is sent again while no coordinator answers it ([`Client::submit`]).
const RESEND_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// How long the CLI waits for one of several coordinators to lead (a takeover takes seconds,
/// docs/ha.md) before it gives up.
const LEADER_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// The coordinator to talk to: the one URL given, or among several (and every address of a
/// name) the one whose `/readyz` says it leads, asked once when the command starts.
///
/// Asked on a thread of its own with its own runtime: `from_args` is called from async
/// commands on a current-thread runtime, where it cannot wait on a future, and making it
/// async would change every command for a moment's wait at start.
fn leader(urls: Vec<String>, pin: Option<String>) -> CliResult<gpuci_agent::follow::Target> {
    let asked = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let rt =
                    tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(anyhow::Error::from)?;
                rt.block_on(find_leader(urls, pin))
            })
            .join()
    });
    asked.unwrap_or_else(|_| Err(CliError::Other(anyhow::anyhow!("finding the leading coordinator failed"))))
}

/// Asks `urls` which coordinator leads (each proving the key `pin`, when one is given), for up
/// to [`LEADER_WAIT`]. A future a command can drop at Ctrl-C.
async fn find_leader(urls: Vec<String>, pin: Option<String>) -> CliResult<gpuci_agent::follow::Target> {
    let coordinators = gpuci_agent::follow::Coordinators::new(urls).with_pin(pin);
    let t0 = std::time::Instant::now();
    let mut failures = 0;
    loop {
        let (targets, said) = coordinators.candidates().await;
        if let Some(t) = targets.into_iter().next() {
            return Ok(t);
        }
        if t0.elapsed() >= LEADER_WAIT {
            return Err(CliError::Other(anyhow::anyhow!(
                "none of the coordinators leads now ({said}); waited {}s",
                LEADER_WAIT.as_secs()
            )));
        }
        if failures == 0 {
            eprintln!("no coordinator leads now ({said}); waiting up to {}s", LEADER_WAIT.as_secs());
        }
        // Jitter from the clock: a CLI has no need of a better random source here.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        tokio::time::sleep(gpuci_core::coordinators::backoff(failures, true, f64::from(nanos) / 1e9)).await;
        failures += 1;
    }
}

fn scope_query(scope: &crate::cli::SecretScopeArgs) -> Vec<(&'static str, String)> {
    let mut q = Vec::new();
    if let Some(r) = &scope.repository {
        q.push(("repository", r.clone()));
    }
    if let Some(p) = &scope.ref_pattern {
        q.push(("ref", p.clone()));
    }
    if let Some(e) = &scope.environment {
        q.push(("environment", e.clone()));
    }
    if scope.approved_forks {
        q.push(("approved_forks", "true".to_string()));
    }
    q
}
