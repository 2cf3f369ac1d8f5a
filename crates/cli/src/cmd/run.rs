//! `gpuci run FILE`: validate, start a private coordinator and agent, run the pipeline with
//! live progress, exit with its result. Nothing to set up, nothing left behind.

use super::{local, read_pipeline};
use crate::cli::RunArgs;
use crate::client::Client;
use crate::render::Progress;
use crate::CliResult;
use gpuci_coordinator::{Database, Timing};
use gpuci_protocol::api::{SubmitPipeline, WatchEvent};
use tokio_util::sync::CancellationToken;

pub async fn run(a: RunArgs, shutdown: CancellationToken) -> CliResult {
    let (source, _) = read_pipeline(&a.file)?;
    let dir = tempfile::Builder::new().prefix("gpuci-run-").tempdir()?;
    let inner = shutdown.child_token();
    let local = local::start(
        dir.path(),
        "127.0.0.1:0".parse().expect("literal"),
        Database::Memory,
        &a.agent,
        Timing::default(),
        inner.clone(),
    )
    .await?;
    let client = Client::new(&local.server.url, local.server.api_token.expose())?;
    local::wait_for_agent(&client).await?;
    let workspace_upload = client.upload_workspace(&a.file, &a.upload).await?;
    let p = client
        .submit(&SubmitPipeline {
            file_name: a.file.display().to_string(),
            source,
            env: Default::default(),
            workspace_upload,
        })
        .await?;
    if !a.json {
        eprintln!("running {} ({} steps) on this machine", a.file.display(), p.jobs.len());
    }
    let mut progress = Progress::new(&p.jobs);
    let json = a.json;
    let path = format!("/api/v1/pipelines/{}/watch", p.id);
    let watch = client.stream::<WatchEvent>(&path, |ev| {
        if json {
            if let Ok(s) = serde_json::to_string(&ev) {
                println!("{s}");
            }
            if let WatchEvent::Done { state } = &ev {
                progress.final_state = Some(state.clone());
            }
        } else {
            progress.on(ev);
        }
        progress.final_state.is_none()
    });
    tokio::select! {
        r = watch => r?,
        _ = shutdown.cancelled() => {
            eprintln!("interrupted: cancelling the pipeline's jobs");
            for j in client.pipeline(p.id).await?.jobs.iter().filter(|j| !j.state.is_terminal()) {
                let _ = client.cancel(j.id, Some("interrupted (gpuci run)".into())).await;
            }
            // Give the agent a moment to kill process trees and report.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            inner.cancel();
            return Ok(130);
        }
    }
    inner.cancel();
    let _ = local.agent.await;
    let _ = local.server.task.await;
    Ok(progress.exit_code())
}
