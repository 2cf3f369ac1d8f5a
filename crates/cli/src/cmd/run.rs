//! `gpuci run FILE`: validate, start a private coordinator and agent, run the pipeline with
//! live progress, exit with its result. Nothing to set up, nothing left behind.

use super::{local, read_pipeline};
use crate::cli::RunArgs;
use crate::client::Client;
use crate::CliResult;
use gpuci_coordinator::{Database, Timing};
use tokio_util::sync::CancellationToken;

pub async fn run(a: RunArgs, shutdown: CancellationToken) -> CliResult {
    local::check_agent_args(&a.agent)?;
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
    let p = client.submit_file(&a.file, source, &a.upload).await?;
    if !a.json {
        eprintln!("running {} ({} steps) on this machine", a.file.display(), p.jobs.len());
    }
    let watch = super::follow(&client, &p, a.json);
    tokio::select! {
        r = watch => {
            let code = r?;
            inner.cancel();
            let _ = local.agent.await;
            let _ = local.server.task.await;
            Ok(code)
        }
        _ = shutdown.cancelled() => {
            eprintln!("interrupted: cancelling the pipeline's jobs");
            for j in client.pipeline(p.id).await?.jobs.iter().filter(|j| !j.state.is_terminal()) {
                let _ = client.cancel(j.id, Some("interrupted (gpuci run)".into())).await;
            }
            // Give the agent a moment to kill process trees and report.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            inner.cancel();
            Ok(130)
        }
    }
}
