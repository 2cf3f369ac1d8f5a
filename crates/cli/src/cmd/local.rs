//! A coordinator and an agent in this process: `gpuci up`, `gpuci run`, benchmarks.

use crate::cli::LocalAgentArgs;
use anyhow::Context;
use gpuci_coordinator::{Config, Database, Running, Timing};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
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
    start_configured(data_dir, listen, database, agent, timing, |_| {}, shutdown).await
}

/// [`start`], with a last say on the coordinator's config (`gpuci up`'s key file).
///
/// The agent's jobs run on the host this coordinator keeps its tokens, database and keys on:
/// every one of those paths ([`Config::private_paths`]) is hidden from them, also where it
/// lies inside a directory the sandbox shows (`gpuci up --data-dir /opt/gpuci`).
pub async fn start_configured(
    data_dir: &Path,
    listen: SocketAddr,
    database: Database,
    agent: &LocalAgentArgs,
    timing: Timing,
    configure: impl FnOnce(&mut Config),
    shutdown: CancellationToken,
) -> anyhow::Result<Local> {
    let mut config = Config::new(listen, data_dir.to_path_buf());
    config.database = database;
    config.timing = timing;
    // The coordinator's own cap sits above the agent's: room for the agent's cut notice.
    config.max_log_bytes = agent.max_log_bytes.saturating_add(1024 * 1024);
    config.agent_inside = true;
    configure(&mut config);
    let private = config.private_paths();
    let server = gpuci_coordinator::start(config, shutdown.clone()).await?;
    let mut ac = gpuci_agent::Config::new(server.url.clone(), data_dir.join("agent"));
    ac.reaper = Some(super::agent::reaper_program());
    ac.registration_token = Some(server.registration_token.expose().to_string());
    ac.slots = agent.slots;
    ac.tags = agent.tags.iter().cloned().collect();
    ac.simulate_gpus = agent.simulate_gpus.clone();
    ac.only_gpus = agent.gpus.clone().map(|g| g.0);
    ac.isolation = agent.isolation.into();
    ac.max_log_bytes = agent.max_log_bytes;
    ac.min_free_disk = agent.min_free_disk;
    agent.jobs.apply(&mut ac);
    ac.name = format!("{} (local)", gpuci_agent::hostname());
    ac.hide = hidden_forms(&private);
    let agent = tokio::spawn(gpuci_agent::run(ac, shutdown));
    Ok(Local { server, agent })
}

/// The local agent's flags that it would refuse, refused before anything starts (exit 2): the
/// agent refuses them too, but inside its own task, where `gpuci up` and `gpuci run` only saw
/// that it never connected ("the local agent did not connect within 30s").
pub fn check_agent_args(agent: &LocalAgentArgs) -> Result<(), crate::CliError> {
    if agent.isolation == crate::cli::IsolationArg::None && !agent.jobs.allow_unsandboxed {
        return Err(crate::CliError::Input(
            "--isolation none runs jobs outside the sandbox: add --allow-unsandboxed to mean it".into(),
        ));
    }
    Ok(())
}

/// Each path as the sandbox must hide it: absolute, and also its real location when a
/// symlink leads there (a job could reach the target through another bound path).
pub fn hidden_forms(paths: &[PathBuf]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for p in paths {
        let forms = [std::path::absolute(p).ok(), std::fs::canonicalize(p).ok()];
        for f in forms.into_iter().flatten() {
            if !out.contains(&f) {
                out.push(f);
            }
        }
    }
    out
}

/// How long the local agent may take to connect: its start probes a real sandbox, makes its
/// slots' networks and ends what a dead agent left on its uids (up to 5 s alone), which on a
/// busy 2-core machine took more than the 5 s once allowed.
const AGENT_START: std::time::Duration = std::time::Duration::from_secs(30);

/// Wait until the local agent is connected, so the first job does not wait for it.
pub async fn wait_for_agent(client: &crate::client::Client) -> anyhow::Result<()> {
    let t0 = std::time::Instant::now();
    let mut said = false;
    while t0.elapsed() < AGENT_START {
        if client.agents().await.map_err(|e| anyhow::anyhow!("{e}"))?.iter().any(|a| a.state == "connected") {
            return Ok(());
        }
        if !said && t0.elapsed() >= std::time::Duration::from_secs(5) {
            eprintln!("waiting for the local agent to start (up to {}s)", AGENT_START.as_secs());
            said = true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    Err(anyhow::anyhow!("the local agent did not connect within {}s", AGENT_START.as_secs()))
        .context("starting the local agent")
}
