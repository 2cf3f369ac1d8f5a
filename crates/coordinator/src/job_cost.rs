//! What one job cost, whole: its own share of its fleet machine while it ran, plus its part of
//! the machine's overhead (boot, idle, GPUs no job leased) in the machine's current boot, split
//! over the jobs that ran on it by GPU-time (`gpuci_core::fleet::cost::overhead_share`). For
//! one job's views only — its API record, its page, its GitHub check — as it reads the
//! machine's billing and jobs.

use gpuci_core::fleet::cost::{overhead_share, BilledMachine, Run, Stretch};
use gpuci_protocol::api::JobSummary;
use gpuci_store::{JobRecord, Store};

/// Fills `s.cost.overhead_usd` when the job ran on a fleet machine. A store error leaves it
/// unset (the job's own cost still shows) and is logged.
pub(crate) async fn add_overhead(store: &dyn Store, s: &mut JobSummary) {
    let (id, started) = (s.id, s.started_at_ms);
    let Some(cost) = s.cost.as_mut() else { return };
    match overhead(store, id, started, &cost.machine).await {
        Ok(o) => cost.overhead_usd = o,
        Err(e) => tracing::warn!(job = id, error = %e, "could not read the machine's billing for the job's cost"),
    }
}

async fn overhead(
    store: &dyn Store,
    job: gpuci_protocol::JobId,
    started: Option<i64>,
    machine: &str,
) -> gpuci_store::Result<Option<f64>> {
    let Some(m) = store.machines(false).await?.into_iter().find(|m| m.id == machine) else { return Ok(None) };
    let (Some(agent), Some(started)) = (m.agent_id.clone(), started) else { return Ok(None) };
    let from = m.requested_at_ms.min(started);
    let stretches: Vec<Stretch> = store
        .billing_since(from)
        .await?
        .into_iter()
        .filter(|b| b.machine_id == m.id)
        .map(|b| Stretch { machine: b.machine_id, from_ms: b.from_ms, to_ms: b.to_ms })
        .collect();
    let now = crate::brain::now_ms();
    let end = |j: &JobRecord| j.finished_at_ms.map(|f| m.ended_at_ms.map_or(f, |e| f.min(e)));
    let mut runs = Vec::new();
    let mut mine = None;
    for j in store.jobs_ran_since(from).await? {
        let Some(started) = j.started_at_ms.filter(|_| j.agent_id.as_deref() == Some(agent.as_str())) else {
            continue;
        };
        if j.id == job {
            mine = Some(runs.len());
        }
        runs.push(Run {
            machine: m.id.clone(),
            repository: None,
            gpus: j.gpus.len() as u32,
            from_ms: started,
            to_ms: end(&j),
        });
    }
    let Some(mine) = mine else { return Ok(None) };
    let billed =
        BilledMachine { id: m.id.clone(), fleet: m.fleet.clone(), gpus: m.gpus, price_per_hour: m.price_per_hour };
    Ok(Some(overhead_share(&billed, &stretches, &runs, mine, now)))
}
