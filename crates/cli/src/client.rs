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

    async fn get<T: DeserializeOwned>(&self, path: &str) -> CliResult<T> {
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
    pub async fn release_gpu(&self, uuid: &str) -> CliResult<()> {
        let resp = self
            .http
            .post(self.url(&format!("/api/v1/gpus/{uuid}/release")))
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("reaching {}", self.base))?;
        Self::check(resp).await?;
        Ok(())
    }

    pub async fn set_secret(&self, name: &str, value: &str) -> CliResult<()> {
        let resp = self
            .http
            .put(self.url(&format!("/api/v1/secrets/{name}")))
            .bearer_auth(&self.token)
            .json(&serde_json::json!({ "value": value }))
            .send()
            .await
            .with_context(|| format!("reaching {}", self.base))?;
        Self::check(resp).await?;
        Ok(())
    }
    pub async fn delete_secret(&self, name: &str) -> CliResult<()> {
        let resp = self
            .http
            .delete(self.url(&format!("/api/v1/secrets/{name}")))
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("reaching {}", self.base))?;
        Self::check(resp).await?;
        Ok(())
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
