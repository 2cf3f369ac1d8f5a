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
    config.standby = a.standby;
    config.max_connections_per_address = a.max_connections_per_address;
    config.public_names = a.public_names.iter().map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect();
    config.fleet_interval = a.fleet_interval;
    config.uploads_gc.interval = a.upload_collect_interval;
    config.timing = Timing { heartbeat_interval: a.heartbeat, lost_after: a.lost_after, ..Timing::default() };
    if let Some(path) = &a.config {
        ConfigFile::load(path, &data_dir)?.apply(&mut config);
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

/// The server's config file (`--config`), read and checked: what `gpuci server` and
/// `gpuci up` take from it. Every error names the file (and, from the parsers, line and column).
pub struct ConfigFile {
    credential_files: Vec<std::path::PathBuf>,
    fleets: Vec<gpuci_core::fleet::FleetSpec>,
    budgets: Vec<gpuci_core::fleet::RepoBudget>,
    concurrency_shared: Vec<gpuci_core::concurrency::SharedGroup>,
    uploads: Option<gpuci_coordinator::github::config::UploadsFile>,
    artifacts: Option<gpuci_coordinator::artifacts_gc::ArtifactsFile>,
    blobs: gpuci_coordinator::blobs::BlobsConfig,
    public_repositories: Option<Vec<String>>,
    github: Option<gpuci_coordinator::github::GithubConfig>,
    schedules: Vec<gpuci_core::schedule_config::ScheduleSpec>,
}

impl ConfigFile {
    pub fn load(path: &Path, data_dir: &Path) -> Result<ConfigFile, CliError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::Input(format!("reading config file {}: {e}", path.display())))?;
        let file = gpuci_coordinator::github::config::parse(&path.display().to_string(), &text)
            .map_err(|e| CliError::Input(e.to_string()))?;
        // Files naming or holding credentials: said so when others can read them, and kept
        // from jobs of an agent in this process.
        let mut credential_files = vec![path.to_path_buf()];
        if let Some(gh) = &file.github {
            credential_files.extend(gh.secret_files().into_iter().map(Path::to_path_buf));
        }
        for f in &credential_files {
            gpuci_coordinator::datadir::warn_if_exposed(f, "this config or key file");
        }
        let fleets = gpuci_core::fleet::parse_fleets(&path.display().to_string(), &text)
            .map_err(|e| CliError::Input(e.to_string()))?;
        // A bare `owner/name` in budgets, shared concurrency groups and public repositories
        // is on the configured GitHub host (GitHub Enterprise's when `[github] api_url` names one).
        let github_host = gpuci_core::repo::github_host_of_api_url(file.github.as_ref().map(|g| g.api_url.as_str()));
        let budgets = gpuci_core::fleet::parse_budgets(&path.display().to_string(), &text, &github_host)
            .map_err(|e| CliError::Input(e.to_string()))?;
        let concurrency_shared =
            gpuci_core::concurrency::parse_shared_groups(&path.display().to_string(), &text, &github_host)
                .map_err(|e| CliError::Input(e.to_string()))?;
        let schedules = gpuci_core::schedule_config::parse_schedules(&path.display().to_string(), &text, &github_host)
            .map_err(|e| CliError::Input(e.to_string()))?;
        // Each fleet's provider settings are checked now: a fleet that could never make a
        // machine is refused at start, not found dead later.
        for f in &fleets {
            if let Err(e) = gpuci_coordinator::fleets::provider_for(f, "check", "", data_dir) {
                return Err(CliError::Input(format!("{}: {e}", path.display())));
            }
        }
        let blobs = match &file.blobs {
            Some(b) => b.resolve().map_err(|e| CliError::Input(format!("{}: {e}", path.display())))?,
            None => Default::default(),
        };
        let github = match file.github {
            Some(gh) => Some(gh.resolve().map_err(|e| CliError::Input(format!("{}: {e}", path.display())))?),
            None => None,
        };
        Ok(ConfigFile {
            credential_files,
            fleets,
            budgets,
            concurrency_shared,
            uploads: file.uploads,
            artifacts: file.artifacts,
            blobs,
            public_repositories: file.dashboard.map(|d| d.public_repositories.iter().map(|r| r.0.clone()).collect()),
            github,
            schedules,
        })
    }

    pub fn apply(self, config: &mut Config) {
        config.credential_files = self.credential_files;
        config.fleets = self.fleets;
        config.budgets = self.budgets;
        config.concurrency_shared = self.concurrency_shared;
        config.schedules = self.schedules;
        if let Some(u) = &self.uploads {
            u.apply(&mut config.uploads_gc);
        }
        if let Some(a) = &self.artifacts {
            a.apply(&mut config.artifacts);
        }
        config.blobs = self.blobs;
        if let Some(p) = self.public_repositories {
            config.public_repositories = p;
        }
        if let Some(gh) = self.github {
            config.github = Some(std::sync::Arc::new(gh));
        }
    }
}
