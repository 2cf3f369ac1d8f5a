//! `gpuci up`: coordinator + one local agent, embedded SQLite in the data dir.

use super::{local, read_pipeline};
use crate::cli::{default_data_dir, UpArgs};
use crate::client::Client;
use crate::render::Progress;
use crate::CliResult;
use gpuci_coordinator::{Database, Timing};
use gpuci_protocol::api::WatchEvent;
use tokio_util::sync::CancellationToken;

pub async fn run(a: UpArgs, shutdown: CancellationToken) -> CliResult {
    local::check_agent_args(&a.agent)?;
    // Validate pipelines before starting anything.
    let mut pipelines = Vec::new();
    for f in &a.pipelines {
        let (source, _) = read_pipeline(f)?;
        pipelines.push((f.display().to_string(), f.clone(), source));
    }
    let data_dir = a.data_dir.clone().unwrap_or_else(|| default_data_dir("gpuci"));
    // Absolute: the sandbox hides paths only as absolute ones (a relative data dir would be
    // refused as a hide path, failing every job).
    let data_dir = std::path::absolute(&data_dir)?;
    let db = data_dir.join("gpuci.db");
    let key_file = a.secrets_key_file.as_deref().map(std::path::absolute).transpose()?;
    let key_shown = key_file.clone().unwrap_or_else(|| data_dir.join("secrets.key"));
    // Read and checked before anything starts: a wrong file names itself and where.
    let file = a.config.as_deref().map(|p| super::server::ConfigFile::load(p, &data_dir)).transpose()?;
    let local = local::start_configured(
        &data_dir,
        a.listen,
        Database::Sqlite(db.clone()),
        &a.agent,
        Timing::default(),
        |c| {
            c.secrets_key_file = key_file;
            c.new_database = a.new_database;
            if let Some(f) = file {
                f.apply(c);
            }
        },
        shutdown.clone(),
    )
    .await?;
    let url = local.server.url.clone();
    println!("{url}");
    eprintln!("gpuci is up at {url}");
    eprintln!(
        "  dashboard: {url}/ui/ (sign in with the API token in {}, or the read-only token in {})",
        data_dir.join("api-token").display(),
        data_dir.join("read-token").display()
    );
    eprintln!("  data:   {} (database {})", data_dir.display(), db.display());
    eprintln!("  key:    {} (seals secret values; back it up apart from the database)", key_shown.display());
    eprintln!(
        "  token:  {} (for the CLI: --data-dir {} or GPUCI_TOKEN)",
        data_dir.join("api-token").display(),
        data_dir.display()
    );
    eprintln!(
        "  agents: gpuci agent --server {url} --registration-token-file {}",
        data_dir.join("registration-token").display()
    );
    eprintln!("  try:    gpuci jobs --server {url} --data-dir {}", data_dir.display());
    let client = Client::new(&url, local.server.api_token.expose())?;
    local::wait_for_agent(&client).await?;
    let mut result = 0u8;
    for (file_name, path, source) in pipelines {
        let p = client.submit_file(&path, source, &a.upload).await?;
        eprintln!("submitted {file_name} as pipeline {} ({} jobs)", p.id, p.jobs.len());
        let mut progress = Progress::new(&p.jobs);
        let path = format!("/api/v1/pipelines/{}/watch", p.id);
        let watch = client.stream::<WatchEvent>(&path, |ev| {
            progress.on(ev);
            progress.final_state.is_none()
        });
        tokio::select! {
            r = watch => r?,
            _ = shutdown.cancelled() => break,
        }
        result = result.max(progress.exit_code());
    }
    if a.exit_when_done && !a.pipelines.is_empty() {
        shutdown.cancel();
    } else if !a.pipelines.is_empty() {
        eprintln!("still serving at {url}; Ctrl-C to stop");
    }
    shutdown.cancelled().await;
    let _ = local.agent.await;
    let _ = local.server.task.await;
    Ok(result)
}
