//! `gpuci pipeline upload FILE`: from inside a running job, add the steps of FILE (`-`: stdin)
//! to the job's own pipeline (docs/pipelines.md, "Dynamic steps").
//!
//! It needs what the agent gives the job: `GPUCI_JOB_ID`, `GPUCI_JOB_TOKEN` (a credential that
//! adds steps to this job's pipeline while it runs and does nothing else) and `GPUCI_API_URL`
//! (`unix:PATH`, the agent's socket in the workspace, or an `http(s)://` coordinator). The
//! coordinator validates the file; its errors name `file:line:column` and the field, as
//! `gpuci submit`'s do. The keys of the jobs added go to stdout, one a line.

use crate::{CliError, CliResult};
use clap::{Args, Subcommand};
use gpuci_protocol::api::{ErrorBody, StepsAdded, UploadSteps};
use std::io::Read;

#[derive(Args, Debug)]
pub struct PipelineArgs {
    #[command(subcommand)]
    pub command: PipelineCommand,
}

#[derive(Subcommand, Debug)]
pub enum PipelineCommand {
    /// Add the steps of FILE (`-`: standard input) to this job's pipeline (inside a job only).
    Upload {
        file: String,
        /// Print the API's answer as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Largest file read (the coordinator refuses more than 256 KiB; this only bounds memory).
const MAX_READ: u64 = 1 << 20;

fn env(name: &str) -> CliResult<String> {
    std::env::var(name).map_err(|_| {
        CliError::Input(format!("{name} is not set: `gpuci pipeline upload` works inside a gpuci job only"))
    })
}

pub async fn run(a: PipelineArgs) -> CliResult<u8> {
    let PipelineCommand::Upload { file, json } = a.command;
    let (job, token, api) = (env("GPUCI_JOB_ID")?, env("GPUCI_JOB_TOKEN")?, env("GPUCI_API_URL")?);
    let job: i64 = job.trim().parse().map_err(|_| CliError::Input(format!("GPUCI_JOB_ID={job:?} is not a job id")))?;
    let (name, mut source) = (if file == "-" { "(stdin)".to_string() } else { file.clone() }, String::new());
    let read = if file == "-" {
        std::io::stdin().take(MAX_READ).read_to_string(&mut source)
    } else {
        std::fs::File::open(&file).and_then(|f| f.take(MAX_READ).read_to_string(&mut source))
    };
    read.map_err(|e| CliError::Input(format!("{name}: {e}")))?;
    let body = serde_json::to_vec(&UploadSteps { file_name: name, source }).map_err(anyhow::Error::from)?;
    let path = format!("/api/v1/jobs/{job}/steps");
    let (status, text) = match api.strip_prefix("unix:") {
        Some(socket) => over_unix(socket, &path, &token, &body).await?,
        None => {
            let resp = reqwest::Client::new()
                .post(format!("{}{path}", api.trim_end_matches('/')))
                .bearer_auth(&token)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body)
                .send()
                .await?;
            (resp.status().as_u16(), resp.text().await.unwrap_or_default())
        }
    };
    if !(200..300).contains(&status) {
        let msg = match serde_json::from_str::<ErrorBody>(&text) {
            Ok(b) if !b.pipeline_errors.is_empty() => {
                let lines: Vec<String> = b
                    .pipeline_errors
                    .iter()
                    .map(|e| format!("{}:{}:{}: {}: {}", e.file, e.line, e.column, e.field, e.message))
                    .collect();
                return Err(CliError::Input(format!("{}\n{}", b.error, lines.join("\n"))));
            }
            Ok(b) => b.error,
            Err(_) => text,
        };
        return Err(CliError::Input(format!("{msg} ({status})")));
    }
    let added: StepsAdded =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("unreadable answer from the coordinator: {e}"))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&added).map_err(anyhow::Error::from)?);
    } else {
        for j in &added.jobs {
            println!("{}", j.step_key);
        }
        eprintln!("{} step(s) added to pipeline {}", added.jobs.len(), added.pipeline_id);
    }
    Ok(0)
}

/// One HTTP/1.1 POST over the agent's unix socket (`gpuci_agent::steps_proxy`); the status
/// and the body of the answer.
async fn over_unix(socket: &str, path: &str, token: &str, body: &[u8]) -> CliResult<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| anyhow::anyhow!("reaching the agent at {socket}: {e}"))?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: gpuci-agent\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.map_err(anyhow::Error::from)?;
    conn.write_all(body).await.map_err(anyhow::Error::from)?;
    let mut answer = Vec::new();
    conn.take(4 << 20).read_to_end(&mut answer).await.map_err(anyhow::Error::from)?;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| anyhow::anyhow!("unreadable answer from the agent: {head:?}"))?;
    Ok((status, body.to_string()))
}
