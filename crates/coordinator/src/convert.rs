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
        soft_failed: gpuci_core::progress::is_soft_failure(&j.step.soft_fail, j.state, j.exit_code),
        skipped_by_condition: gpuci_core::progress::is_skipped_by_condition(&j.step, j.state),
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

/// A pipeline's state: `running` while any job is unfinished, else the worst outcome that is
/// not a soft failure (`gpuci_core::progress::pipeline_state`).
pub fn pipeline_state(jobs: &[JobSummary]) -> String {
    gpuci_core::progress::pipeline_state(jobs.iter().map(|j| gpuci_core::progress::Attempt {
        step_key: &j.step_key,
        job_id: j.id,
        state: j.state,
        soft_failed: j.soft_failed,
        skipped_by_condition: j.skipped_by_condition,
    }))
    .to_string()
}
