//! The inputs of the fleets' cost report, read from the store: machines, billed stretches and
//! the jobs that ran on them. The report itself is computed elsewhere (`gpuci_core`).

use gpuci_store::Store;
use std::collections::HashMap;

/// What the cost report is computed from, since `from_ms`: fleet machines, their billed
/// stretches, and the jobs that ran on them with their repositories (printed identities with
/// their host, `github.com/acme/x`; a bare `owner/name` is on `github_host`).
pub async fn cost_inputs(
    store: &dyn Store,
    from_ms: i64,
    github_host: &str,
) -> gpuci_store::Result<(
    Vec<gpuci_core::fleet::cost::BilledMachine>,
    Vec<gpuci_core::fleet::cost::Stretch>,
    Vec<gpuci_core::fleet::cost::Run>,
)> {
    use gpuci_core::fleet::cost::{BilledMachine, Run, Stretch};
    let machines = store.machines(false).await?;
    let stretches = store.billing_since(from_ms).await?;
    let by_agent: HashMap<&str, &str> =
        machines.iter().filter_map(|m| Some((m.agent_id.as_deref()?, m.id.as_str()))).collect();
    let mut runs = Vec::new();
    // No fleet machine ever: no job ran on one (and the jobs need not be read).
    let ran = if by_agent.is_empty() { Vec::new() } else { store.jobs_ran_since(from_ms).await? };
    let on_machines: Vec<(&gpuci_store::JobRecord, &str, i64)> =
        ran.iter().filter_map(|j| Some((j, *by_agent.get(j.agent_id.as_deref()?)?, j.started_at_ms?))).collect();
    let pipelines: Vec<i64> = on_machines
        .iter()
        .map(|(j, _, _)| j.pipeline_id)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let repos = store.pipeline_origins(&pipelines).await?;
    for (j, machine, started) in on_machines {
        runs.push(Run {
            machine: machine.to_string(),
            repository: repos
                .get(&j.pipeline_id)
                .and_then(|(r, o)| crate::repos::name_of_pipeline(r.as_deref(), o.as_deref(), github_host)),
            gpus: j.gpus.len() as u32,
            from_ms: started,
            to_ms: j.finished_at_ms,
        });
    }
    let machines: Vec<BilledMachine> = machines
        .iter()
        .map(|m| BilledMachine {
            id: m.id.clone(),
            fleet: m.fleet.clone(),
            gpus: m.gpus,
            price_per_hour: m.price_per_hour,
        })
        .collect();
    let stretches: Vec<Stretch> =
        stretches.into_iter().map(|s| Stretch { machine: s.machine_id, from_ms: s.from_ms, to_ms: s.to_ms }).collect();
    Ok((machines, stretches, runs))
}
