//! `gpuci server`: the coordinator alone.

use crate::cli::{default_data_dir, ServerArgs};
use crate::{CliError, CliResult};
use gpuci_coordinator::{Config, Database, Timing};
use std::path::Path;
use tokio_util::sync::CancellationToken;

pub async fn run(a: ServerArgs, shutdown: CancellationToken) -> CliResult {
    let data_dir = a.data_dir.unwrap_or_else(|| default_data_dir("gpuci"));
    let mut config = Config::new(a.listen, data_dir.clone());
    config.secrets_key_file = a.secrets_key_file.clone();
    if let Some(url) = &a.database {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            // Not echoed: it may hold a password.
            return Err(CliError::Input(
                "--database: expected a postgres:// URL (leave it out for SQLite in the data dir)".into(),
            ));
        }
        config.database = Database::Postgres(url.clone());
    }
    config.max_log_bytes = a.max_log_bytes;
    config.new_database = a.new_database;
    config.fleet_interval = a.fleet_interval;
    config.uploads_gc.interval = a.upload_collect_interval;
    config.timing = Timing { heartbeat_interval: a.heartbeat, lost_after: a.lost_after, ..Timing::default() };
    if let Some(path) = &a.config {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::Input(format!("reading config file {}: {e}", path.display())))?;
        let file = gpuci_coordinator::github::config::parse(&path.display().to_string(), &text)
            .map_err(|e| CliError::Input(e.to_string()))?;
        // Files naming or holding credentials: said so when others can read them, and kept
        // from jobs of an agent in this process.
        let mut credential_files = vec![path.clone()];
        if let Some(gh) = &file.github {
            credential_files.extend(gh.secret_files().into_iter().map(Path::to_path_buf));
        }
        for f in &credential_files {
            gpuci_coordinator::datadir::warn_if_exposed(f, "this config or key file");
        }
        config.credential_files = credential_files;
        config.fleets = gpuci_core::fleet::parse_fleets(&path.display().to_string(), &text)
            .map_err(|e| CliError::Input(e.to_string()))?;
        // A bare `owner/name` in budgets, shared concurrency groups and public repositories
        // is on the configured GitHub host (GitHub Enterprise's when `[github] api_url` names one).
        let github_host = gpuci_core::repo::github_host_of_api_url(file.github.as_ref().map(|g| g.api_url.as_str()));
        config.budgets = gpuci_core::fleet::parse_budgets(&path.display().to_string(), &text, &github_host)
            .map_err(|e| CliError::Input(e.to_string()))?;
        config.concurrency_shared =
            gpuci_core::concurrency::parse_shared_groups(&path.display().to_string(), &text, &github_host)
                .map_err(|e| CliError::Input(e.to_string()))?;
        // Each fleet's provider settings are checked now: a fleet that could never make a
        // machine is refused at start, not found dead later.
        for f in &config.fleets {
            if let Err(e) = gpuci_coordinator::fleets::provider_for(f, "check", "", &data_dir) {
                return Err(CliError::Input(format!("{}: {e}", path.display())));
            }
        }
        if let Some(u) = &file.uploads {
            u.apply(&mut config.uploads_gc);
        }
        if let Some(d) = &file.dashboard {
            config.public_repositories = d.public_repositories.iter().map(|r| r.0.clone()).collect();
        }
        if let Some(gh) = file.github {
            let resolved = gh.resolve().map_err(|e| CliError::Input(format!("{}: {e}", path.display())))?;
            config.github = Some(std::sync::Arc::new(resolved));
        }
    }
    let running = gpuci_coordinator::start(config, shutdown).await?;
    println!("{}", running.url);
    eprintln!(
        "coordinator at {} (data dir {}; registration token in {})",
        running.url,
        data_dir.display(),
        data_dir.join("registration-token").display()
    );
    running.task.await.map_err(anyhow::Error::from)??;
    Ok(0)
}
