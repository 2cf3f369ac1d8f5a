//! Store records → API bodies.

use gpuci_protocol::api::JobSummary;
use gpuci_store::JobRecord;

pub fn job_summary(j: &JobRecord, agent_name: Option<String>) -> JobSummary {
    JobSummary {
        id: j.id,
        pipeline_id: j.pipeline_id,
        step_key: j.step.key.clone(),
        name: j.step.display_name().to_string(),
        state: j.state,
        reason: j.reason.clone(),
        attempt: j.attempt,
        agent_id: j.agent_id.clone(),
        agent_name,
        gpus: j.gpus.clone(),
        created_at_ms: j.created_at_ms,
        assigned_at_ms: j.assigned_at_ms,
        started_at_ms: j.started_at_ms,
        finished_at_ms: j.finished_at_ms,
        exit_code: j.exit_code,
        telemetry: j.telemetry.clone(),
        cost: None,
        unenforced: j.unenforced.clone(),
    }
}

/// A pipeline's state: `running` while any job is unfinished, else the worst outcome.
pub fn pipeline_state(jobs: &[JobSummary]) -> String {
    use gpuci_core::job::JobState::*;
    // Only the latest attempt of each step counts.
    let mut latest: std::collections::BTreeMap<&str, &JobSummary> = std::collections::BTreeMap::new();
    for j in jobs {
        match latest.get(j.step_key.as_str()) {
            Some(o) if o.id > j.id => {}
            _ => {
                latest.insert(&j.step_key, j);
            }
        }
    }
    if latest.values().any(|j| !j.state.is_terminal()) {
        return "running".into();
    }
    let worst =
        [Lost, TimedOut, Failed, Cancelled, Skipped].into_iter().find(|s| latest.values().any(|j| j.state == *s));
    worst.map_or("succeeded".into(), |s| s.to_string())
}
