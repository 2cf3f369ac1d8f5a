//! What both backends share: the column lists and the mapping of result rows to records
//! (generated per row type by [`row_mappers`], since the two backends' row types differ only in
//! name for these columns), and the small encodings both use.

use crate::*;
use gpuci_protocol::agent::Stream;

pub(crate) const JOB_COLUMNS: &str =
    "id, pipeline_id, step_json, env_json, state, reason, attempt, retry_of, agent_id, gpus_json, \
     created_at_ms, assigned_at_ms, started_at_ms, finished_at_ms, exit_code, telemetry_json, unenforced_json";
pub(crate) const PIPELINE_COLUMNS: &str = "id, file_name, source, workspace_upload, repository, origin, created_at_ms";
pub(crate) const GITHUB_JOB_COLUMNS: &str = "id, repository, run_id, name, labels, pool, state, runner_job_id, runner_name, reason, queued_at_ms, updated_at_ms, \
     runner_exits, last_runner_exit, check_failures, retry_at_ms";
pub(crate) const MACHINE_COLUMNS: &str =
    "id, fleet, provider_id, instance_type, zone, capacity, price_per_hour, gpus, state, reason, \
     agent_id, requested_at_ms, running_at_ms, connected_at_ms, first_job_at_ms, ended_at_ms, boot_failed, interrupted_at_ms";
pub(crate) const RUNNER_COLUMNS: &str =
    "name, job_id, pool, repository, org, runner_id, github_job_id, state, created_at_ms, updated_at_ms";

pub(crate) fn corrupt(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{what}: {e}"))
}

pub(crate) fn stream_str(s: Stream) -> &'static str {
    match s {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
        Stream::System => "system",
    }
}

pub(crate) fn stream_parse(s: &str) -> Stream {
    match s {
        "stderr" => Stream::Stderr,
        "system" => Stream::System,
        _ => Stream::Stdout,
    }
}

/// `job_from_row`, `pipeline_from_row`, `github_job_from_row`, `runner_from_row` and
/// `agent_from_row` for one backend's row type.
macro_rules! row_mappers {
    ($row:ty) => {
        pub(crate) fn job_from_row(r: &$row) -> Result<JobRecord> {
            let state: String = r.get("state");
            let telemetry: Option<String> = r.get("telemetry_json");
            let unenforced: Option<String> = r.get("unenforced_json");
            Ok(JobRecord {
                id: r.get("id"),
                pipeline_id: r.get("pipeline_id"),
                step: serde_json::from_str(r.get("step_json")).map_err(|e| corrupt("step_json", e))?,
                env: serde_json::from_str(r.get("env_json")).map_err(|e| corrupt("env_json", e))?,
                state: state.parse().map_err(|e| corrupt("state", e))?,
                reason: r.get("reason"),
                attempt: r.get::<i64, _>("attempt").try_into().unwrap_or(1),
                retry_of: r.get("retry_of"),
                agent_id: r.get("agent_id"),
                gpus: serde_json::from_str(r.get("gpus_json")).map_err(|e| corrupt("gpus_json", e))?,
                created_at_ms: r.get("created_at_ms"),
                assigned_at_ms: r.get("assigned_at_ms"),
                started_at_ms: r.get("started_at_ms"),
                finished_at_ms: r.get("finished_at_ms"),
                exit_code: r.get("exit_code"),
                telemetry: telemetry
                    .map(|t| serde_json::from_str(&t))
                    .transpose()
                    .map_err(|e| corrupt("telemetry_json", e))?,
                unenforced: unenforced
                    .map(|u| serde_json::from_str(&u))
                    .transpose()
                    .map_err(|e| corrupt("unenforced_json", e))?
                    .unwrap_or_default(),
            })
        }

        pub(crate) fn pipeline_from_row(r: &$row) -> PipelineRecord {
            PipelineRecord {
                id: r.get("id"),
                file_name: r.get("file_name"),
                source: r.get("source"),
                workspace_upload: r.get("workspace_upload"),
                repository: r.get("repository"),
                origin: r.get("origin"),
                created_at_ms: r.get("created_at_ms"),
            }
        }

        pub(crate) fn github_job_from_row(r: &$row) -> Result<GithubJobRecord> {
            let labels: String = r.get("labels");
            Ok(GithubJobRecord {
                id: r.get("id"),
                repository: r.get("repository"),
                run_id: r.get("run_id"),
                name: r.get("name"),
                labels: serde_json::from_str(&labels).map_err(|e| corrupt("github_jobs.labels", e))?,
                pool: r.get("pool"),
                state: r.get("state"),
                runner_job_id: r.get("runner_job_id"),
                runner_name: r.get("runner_name"),
                reason: r.get("reason"),
                queued_at_ms: r.get("queued_at_ms"),
                updated_at_ms: r.get("updated_at_ms"),
                runner_exits: r.get::<i64, _>("runner_exits").clamp(0, i64::from(u32::MAX)) as u32,
                last_runner_exit: r.get("last_runner_exit"),
                check_failures: r.get::<i64, _>("check_failures").clamp(0, i64::from(u32::MAX)) as u32,
                retry_at_ms: r.get("retry_at_ms"),
            })
        }

        pub(crate) fn runner_from_row(r: &$row) -> RunnerRecord {
            RunnerRecord {
                name: r.get("name"),
                job_id: r.get("job_id"),
                pool: r.get("pool"),
                repository: r.get("repository"),
                org: r.get("org"),
                runner_id: r.get("runner_id"),
                github_job_id: r.get("github_job_id"),
                state: r.get("state"),
                created_at_ms: r.get("created_at_ms"),
                updated_at_ms: r.get("updated_at_ms"),
            }
        }

        pub(crate) fn machine_from_row(r: &$row) -> MachineRecord {
            MachineRecord {
                id: r.get("id"),
                fleet: r.get("fleet"),
                provider_id: r.get("provider_id"),
                instance_type: r.get("instance_type"),
                zone: r.get("zone"),
                capacity: r.get("capacity"),
                price_per_hour: r.get("price_per_hour"),
                gpus: r.get::<i64, _>("gpus").clamp(0, i64::from(u32::MAX)) as u32,
                state: r.get("state"),
                reason: r.get("reason"),
                agent_id: r.get("agent_id"),
                requested_at_ms: r.get("requested_at_ms"),
                running_at_ms: r.get("running_at_ms"),
                connected_at_ms: r.get("connected_at_ms"),
                first_job_at_ms: r.get("first_job_at_ms"),
                ended_at_ms: r.get("ended_at_ms"),
                boot_failed: r.get::<i64, _>("boot_failed") != 0,
                interrupted_at_ms: r.get("interrupted_at_ms"),
            }
        }

        pub(crate) fn agent_from_row(r: &$row) -> AgentRecord {
            AgentRecord {
                id: r.get("id"),
                name: r.get("name"),
                credential_hash: r.get("credential_hash"),
                registered_at_ms: r.get("registered_at_ms"),
                last_seen_ms: r.get("last_seen_ms"),
                state: r.get("state"),
                reason: r.get("reason"),
                hello_json: r.get("hello_json"),
            }
        }
    };
}
pub(crate) use row_mappers;
