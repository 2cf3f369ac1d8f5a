//! Becoming an agent of the coordinators: the identity kept in the data dir, or a
//! registration with the coordinator that leads and proves the installation's key
//! ([`crate::identity`], [`crate::follow`]), retried through a failover or an outage as
//! `--leave-after-unreachable` allows.

use super::*;

pub(crate) enum Registered {
    Yes(identity::Identity, bool),
    No(Ended),
}

/// [`identity::load`] or [`identity::register`] with the coordinator that leads; an agent
/// that may leave retries a registration that cannot reach a coordinator until it is due to
/// leave (a machine whose coordinator died before its agent registered must not bill
/// forever), and so does one given several coordinators (a failover may be under way);
/// otherwise the first failure ends the agent.
pub(crate) async fn register(
    config: &Config,
    coordinators: &mut follow::Coordinators,
    started: std::time::Instant,
    shutdown: &CancellationToken,
) -> anyhow::Result<Registered> {
    if let Some(id) = identity::load(&config.data_dir, &config.server)? {
        return Ok(Registered::Yes(id, false));
    }
    let mut failures = 0;
    loop {
        let (targets, said) = coordinators.candidates().await;
        let e = match identity::register(
            &config.data_dir,
            &config.server,
            &targets,
            &config.name,
            config.registration_token.as_deref(),
        )
        .await
        {
            Ok(id) => return Ok(Registered::Yes(id, true)),
            Err(e) => e,
        };
        if e.downcast_ref::<identity::Unreachable>().is_none() {
            return Err(e);
        }
        let several = coordinators.urls().len() > 1 || !said.is_empty();
        let recheck_at = match config.leave_after_unreachable {
            None if !several => return Err(e),
            None => None,
            Some(limit) => {
                let facts = leave::Facts { last_connected: started, last_job_ended: None, running_jobs: 0 };
                match leave::decide(limit, &facts, std::time::Instant::now()) {
                    leave::Verdict::Leave { unreachable_for } => {
                        return Ok(Registered::No(leaving(&config.server, unreachable_for)));
                    }
                    leave::Verdict::Stay { recheck_at } => recheck_at,
                }
            }
        };
        // Several coordinators: a failover takes seconds, asked again soon; one: as before.
        let backoff = if several {
            gpuci_core::coordinators::backoff(failures, true, rand::random::<f64>())
        } else {
            Duration::from_secs(1u64 << failures.min(5)).min(Duration::from_secs(30))
        };
        failures = failures.saturating_add(1);
        tracing::warn!(error = %format!("{e:#}"), coordinators = %said, retry_in = ?backoff, "cannot register");
        let mut wait = tokio::time::Instant::now() + backoff;
        if let Some(at) = recheck_at {
            wait = wait.min(tokio::time::Instant::from_std(at));
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(Registered::No(Ended::Shutdown)),
            _ = tokio::time::sleep_until(wait) => {}
        }
    }
}

/// Says why the agent leaves (at WARN, for whoever reads why the machine went away).
pub(crate) fn leaving(coordinator: &str, unreachable_for: Duration) -> Ended {
    // Whole seconds: "10m3s", not "10m3s412ms".
    let shown = gpuci_core::Duration(Duration::from_secs(unreachable_for.as_secs().max(1)));
    tracing::warn!("leaving: the coordinator at {coordinator} has not been reachable for {shown}");
    Ended::Left { coordinator: coordinator.to_string(), unreachable_for }
}
