//! `gpuci agent --server URL`: run jobs for a coordinator.

use crate::cli::{default_data_dir, AgentArgs};
use crate::{CliError, CliResult};
use tokio_util::sync::CancellationToken;

pub async fn run(a: AgentArgs, shutdown: CancellationToken) -> CliResult {
    let data_dir = a.data_dir.unwrap_or_else(|| default_data_dir("gpuci-agent"));
    // Absolute: the data dir is hidden from jobs, and the sandbox hides absolute paths only.
    let data_dir = std::path::absolute(&data_dir)?;
    let servers = gpuci_agent::follow::parse_urls(&a.server).map_err(|e| CliError::Input(format!("--server: {e}")))?;
    let mut c = gpuci_agent::Config::new(servers.join(","), data_dir);
    c.reaper = Some(reaper_program());
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
    c.coordinator_key = a.coordinator_key;
    if let Some(n) = a.name {
        c.name = n;
    }
    c.slots = a.local.slots;
    c.tags = a.local.tags.into_iter().collect();
    c.simulate_gpus = a.local.simulate_gpus;
    c.simulate_host = a.simulate_host;
    c.only_gpus = a.local.gpus.map(|g| g.0);
    if let Some(engine) = a.allocation {
        let mut grant =
            gpuci_agent::allocation::from_env(engine, &|k| std::env::var(k).ok()).map_err(CliError::Input)?;
        if engine == gpuci_agent::allocation::Engine::Slurm {
            // Slurm names GRES indices; which device files they are takes the node's list.
            let files = gpuci_agent::gres::read_grant(&grant.id, a.expect_gpus, &|k| std::env::var(k).ok())
                .await
                .map_err(|e| CliError::Input(format!("--allocation slurm: job {}: {e}", grant.id)))?;
            tracing::info!(job = %grant.id, ?files, "the GPU device files Slurm granted");
            grant.gpus = files
                .iter()
                .map(|f| gpuci_agent::gres::minor_of(f).map(gpuci_gpu::GpuRef::Node))
                .collect::<Result<_, _>>()
                .map_err(|e| CliError::Input(format!("--allocation slurm: {e}")))?;
        }
        if engine == gpuci_agent::allocation::Engine::Kubernetes {
            // The device plugin's grant shows as a variable, list files or device nodes;
            // telling which GPUs they are takes the inventory the agent will serve from.
            let inventory = pod_inventory(&c).map_err(|e| {
                CliError::Input(format!("--allocation kubernetes: pod {}: GPU inventory: {e}", grant.id))
            })?;
            let root = a.grant_root.clone().unwrap_or_else(|| "/".into());
            let g = gpuci_agent::grant::read_grant(&root, a.expect_gpus, &|k| std::env::var(k).ok(), inventory)
                .map_err(|e| CliError::Input(format!("--allocation kubernetes: pod {}: {e}", grant.id)))?;
            tracing::info!(pod = %grant.id, source = %g.source, gpus = ?g.uuids, "the GPUs the device plugin granted");
            grant.gpus = g.uuids.into_iter().map(gpuci_gpu::GpuRef::Uuid).collect();
        }
        if let Some(n) = a.expect_gpus {
            if grant.gpus.len() != n as usize {
                return Err(CliError::Input(format!(
                    "--allocation: the grant has {} GPU(s) ({:?}), the fleet's machines {n}: is the engine giving the GPUs it was asked for?",
                    grant.gpus.len(),
                    grant.gpus
                )));
            }
        }
        match &c.only_gpus {
            // Given by hand as well: it must be the grant, or the agent would serve GPUs the
            // engine gave somebody else.
            Some(given) if !grant.gpus.is_empty() || !given.is_empty() => {
                if *given != grant.gpus {
                    return Err(CliError::Input(format!(
                        "--gpus {given:?} is not what the allocation granted ({:?}); leave --gpus out with --allocation",
                        grant.gpus
                    )));
                }
            }
            _ => c.only_gpus = Some(grant.gpus.clone()),
        }
        if engine == gpuci_agent::allocation::Engine::Slurm {
            // Always asked, whatever --ends-in says: the earlier end counts.
            let left = gpuci_agent::allocation::slurm_time_left(&grant.id).await.map_err(|e| {
                CliError::Input(format!("--allocation slurm: cannot tell when job {} ends: {e}", grant.id))
            })?;
            c.ends_at_ms = left.map(|d| now_ms().saturating_add(d.as_millis() as i64));
        }
        tracing::info!(engine = ?engine, allocation = %grant.id, gpus = ?grant.gpus, ends_at_ms = ?c.ends_at_ms, "running inside an allocation");
        let (tx, rx) = tokio::sync::watch::channel(None);
        c.taken_back = Some(rx);
        c.end_when_taken_back = true;
        tokio::spawn(taken_back_on_signal(grant.taken_back_reason(), tx, a.terminate_grace, shutdown.clone()));
    }
    if let Some(d) = a.ends_in {
        let end = now_ms().saturating_add(d.as_millis() as i64);
        c.ends_at_ms = Some(c.ends_at_ms.map_or(end, |e| e.min(end)));
    }
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
    c.leave_after_unreachable = a.leave_after_unreachable;
    c.interruption_notice = a.interruption_notice_url.clone().map(|u| (u, a.interruption_poll));
    match gpuci_agent::run_until(c, shutdown.clone()).await? {
        gpuci_agent::Ended::Shutdown => Ok(0),
        gpuci_agent::Ended::Left { .. } => {
            if let Some(command) = &a.on_leave {
                on_leave(command, &shutdown).await;
            }
            Ok(EXIT_LEFT)
        }
    }
}

/// The running `gpuci` binary, which runs the agent's reaper: `/proc/self/exe` names this
/// very file even after an upgrade replaced it on disk.
pub(crate) fn reaper_program() -> std::path::PathBuf {
    std::path::PathBuf::from("/proc/self/exe")
}

/// The inventory the agent will serve from, detected as `gpuci_agent::run_until` does
/// (simulated GPUs included), before any share of it is taken.
fn pod_inventory(c: &gpuci_agent::Config) -> Result<Vec<gpuci_core::gpu::GpuInfo>, gpuci_gpu::GpuError> {
    let mut opts = gpuci_gpu::DetectOptions::new(c.simulate_host.clone().unwrap_or_else(|| c.name.clone()));
    opts.simulate = c.simulate_gpus.clone();
    opts.simulated_device_dir = c.data_dir.join("sim-dev");
    gpuci_gpu::detect(&opts)?.backend.inventory()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// Inside an allocation the engine's SIGTERM (scancel, a time limit, a pod deleted or
/// evicted) means the machine is being taken back: say so to the agent, which tells the
/// coordinator (its jobs are queued again) and ends once none runs. Ends the agent anyway
/// `grace` later, or at a second signal, or at SIGINT.
async fn taken_back_on_signal(
    reason: String,
    notice: tokio::sync::watch::Sender<Option<String>>,
    grace: std::time::Duration,
    shutdown: CancellationToken,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
        tracing::error!("cannot listen for signals; ending now");
        shutdown.cancel();
        return;
    };
    tokio::select! {
        _ = int.recv() => {
            tracing::info!("shutting down");
            shutdown.cancel();
            return;
        }
        _ = term.recv() => {}
    }
    tracing::warn!(%reason, "SIGTERM from the engine: the machine is being taken back");
    let _ = notice.send(Some(reason));
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
        _ = tokio::time::sleep(grace) => tracing::warn!(grace = ?grace, "ending before every result reached the coordinator"),
        _ = shutdown.cancelled() => return,
    }
    shutdown.cancel();
}

/// The exit status of an agent that left (`--leave-after-unreachable`): EX_TEMPFAIL, so a
/// service manager can tell it from a failure (1) and a bad command line (2).
pub const EXIT_LEFT: u8 = 75;

/// How long the agent waits for `--on-leave` before exiting anyway. Not killed then: it may be
/// the machine's shutdown in progress.
const ON_LEAVE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs `--on-leave` once and logs how it ended. A shutdown it starts usually stops this
/// process too (SIGTERM): then the agent stops waiting and exits.
async fn on_leave(command: &str, shutdown: &CancellationToken) {
    tracing::info!(command, "running the on-leave command");
    // No stdin: a `sudo` that wants a password fails instead of waiting for one.
    let child = tokio::process::Command::new("sh").arg("-c").arg(command).stdin(std::process::Stdio::null()).spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(command, error = %e, "cannot start the on-leave command");
            return;
        }
    };
    tokio::select! {
        status = child.wait() => match status {
            Ok(s) if s.success() => tracing::info!(command, status = %s, "the on-leave command succeeded"),
            Ok(s) => tracing::error!(command, status = %s, "the on-leave command failed"),
            Err(e) => tracing::error!(command, error = %e, "cannot wait for the on-leave command"),
        },
        _ = tokio::time::sleep(ON_LEAVE_WAIT) => {
            tracing::warn!(command, waited = ?ON_LEAVE_WAIT, "the on-leave command still runs; exiting without waiting for it");
        }
        _ = shutdown.cancelled() => {
            tracing::warn!(command, "told to stop while the on-leave command runs; exiting without waiting for it");
        }
    }
}
