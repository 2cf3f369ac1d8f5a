//! `gpuci agent --server URL`: run jobs for a coordinator.

use crate::cli::{default_data_dir, AgentArgs};
use crate::{CliError, CliResult};
use tokio_util::sync::CancellationToken;

pub async fn run(a: AgentArgs, shutdown: CancellationToken) -> CliResult {
    let data_dir = a.data_dir.unwrap_or_else(|| default_data_dir("gpuci-agent"));
    // Absolute: the data dir is hidden from jobs, and the sandbox hides absolute paths only.
    let data_dir = std::path::absolute(&data_dir)?;
    let mut c = gpuci_agent::Config::new(a.server, data_dir);
    // Jobs must not see the registration token file either, nor what the operator names.
    let mut hide = a.hide.clone();
    if let Some(f) = &a.registration_token_file {
        gpuci_coordinator::datadir::warn_if_exposed(f, "the registration token file");
        hide.push(f.clone());
    }
    c.hide = super::local::hidden_forms(&hide);
    c.registration_token = match (a.registration_token, a.registration_token_file) {
        (Some(t), _) => Some(t),
        (None, Some(f)) => Some(
            std::fs::read_to_string(&f)
                .map_err(|e| CliError::Input(format!("cannot read registration token file {}: {e}", f.display())))?
                .trim()
                .to_string(),
        ),
        (None, None) => None,
    };
    if let Some(n) = a.name {
        c.name = n;
    }
    c.slots = a.local.slots;
    c.tags = a.local.tags.into_iter().collect();
    c.simulate_gpus = a.local.simulate_gpus;
    c.isolation = a.local.isolation.into();
    a.local.jobs.apply(&mut c);
    c.post_job_timeout = a.post_job_timeout;
    c.max_log_bytes = a.local.max_log_bytes;
    c.min_free_disk = a.local.min_free_disk;
    c.reset_journal = a.reset_journal;
    c.cache_limits = gpuci_agent::cache::CacheLimits {
        entry: a.cache_max_entry_size,
        total: a.cache_max_total,
        entry_files: a.cache_max_entry_files,
    };
    gpuci_agent::run(c, shutdown).await?;
    Ok(0)
}
