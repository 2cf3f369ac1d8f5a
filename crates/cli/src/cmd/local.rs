//! A coordinator and an agent in this process: `gpuci up`, `gpuci run`, benchmarks.

use crate::cli::LocalAgentArgs;
use anyhow::Context;
use gpuci_coordinator::{Config, Database, Running, Timing};
use std::net::SocketAddr;
use std::path::Path;
use tokio_util::sync::CancellationToken;

pub struct Local {
    pub server: Running,
    pub agent: tokio::task::JoinHandle<anyhow::Result<()>>,
}

pub async fn start(
    data_dir: &Path,
    listen: SocketAddr,
    database: Database,
    agent: &LocalAgentArgs,
    timing: Timing,
    shutdown: CancellationToken,
) -> anyhow::Result<Local> {
    let mut config = Config::new(listen, data_dir.to_path_buf());
    config.database = database;
    config.timing = timing;
    let server = gpuci_coordinator::start(config, shutdown.clone()).await?;
    let mut ac = gpuci_agent::Config::new(server.url.clone(), data_dir.join("agent"));
    ac.registration_token = Some(server.registration_token.expose().to_string());
    ac.slots = agent.slots;
    ac.tags = agent.tags.iter().cloned().collect();
    ac.simulate_gpus = agent.simulate_gpus.clone();
    ac.isolation = agent.isolation.into();
    ac.name = format!("{} (local)", gpuci_agent::hostname());
    let agent = tokio::spawn(gpuci_agent::run(ac, shutdown));
    Ok(Local { server, agent })
}

/// Wait until the local agent is connected, so the first job does not wait for it.
pub async fn wait_for_agent(client: &crate::client::Client) -> anyhow::Result<()> {
    for _ in 0..200 {
        if client.agents().await.map_err(|e| anyhow::anyhow!("{e}"))?.iter().any(|a| a.state == "connected") {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    Err(anyhow::anyhow!("the local agent did not connect within 5s")).context("starting the local agent")
}
