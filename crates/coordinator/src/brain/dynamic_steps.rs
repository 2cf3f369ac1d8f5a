//! Dynamic steps: a running job adds steps to its own pipeline (`gpuci pipeline upload`).
//!
//! The credential is a job token: a fresh random token made when the job is given to an
//! agent ([`new_token`]), stored only as its sha256 (`job_tokens`, written by the job's
//! assignment in the placement pass's one transaction), sent to the agent with the
//! job's secrets (so the agent hands it to the job as `GPUCI_JOB_TOKEN` and masks it in the
//! job's log like any secret). It does one thing: `POST /api/v1/jobs/{id}/steps` for the job
//! it was made for, while that job is assigned or running. It is not an API token, so every
//! other endpoint answers it 401; a retried job is a new job with a new token; the job's end
//! (success, failure, cancel, timeout, lost) ends it, because every use asks the brain, which
//! holds the job's state, and nothing else.
//!
//! The job reaches this endpoint through its agent (`gpuci_agent::steps_proxy`): the agent
//! serves a unix socket in the job's own directory and forwards the request, so a job with
//! `network: none` or the slot network (where the coordinator's loopback address is out of
//! reach) can add steps too, and the job needs no route to the coordinator.
//!
//! What the file may say is `gpuci_core::pipeline::upload`'s rule. The added jobs belong to
//! the uploading job's pipeline, so they have its origin and its trust class: a fork pull
//! request's added step gets no secrets and is sandboxed whatever the file says. Each upload
//! that passed the token check is recorded in the audit log with the job as actor.

use crate::brain::BrainError;
use crate::origin::Origin;
use gpuci_core::condition::Decision;
use gpuci_core::job::JobState;
use gpuci_core::pipeline::upload::{parse_upload, Existing, MAX_UPLOADS_PER_JOB};
use gpuci_core::pipeline::PipelineErrors;
use gpuci_protocol::JobId;
use gpuci_store::{JobRecord, NewJob, Store, StoreError};

/// The variable the job finds its token in.
pub const JOB_TOKEN_ENV: &str = "GPUCI_JOB_TOKEN";
/// What a job token starts with: a reader of a log or a leak report can tell what it is.
pub const JOB_TOKEN_PREFIX: &str = "gpuci_job_";

/// A new job token: the value the job gets, and its sha256, which the placement pass stores
/// with the job's assignment (`NewAssignment::token_sha256`), in the same commit: a job never
/// holds a token the coordinator does not know, and a refused assignment stores none.
pub(crate) fn new_token() -> (String, String) {
    let token = crate::auth::generate(JOB_TOKEN_PREFIX);
    let sha256 = crate::auth::hash(token.expose());
    (token.expose().to_string(), sha256)
}

/// Why an upload added nothing.
#[derive(Debug, thiserror::Error)]
pub enum AddError {
    #[error("{file} is not a valid pipeline ({} error{})", .errors.len(), if .errors.len() == 1 { "" } else { "s" })]
    Invalid { file: String, errors: PipelineErrors },
    #[error("job {0} is not running: its job token adds no steps")]
    NotRunning(JobId),
    #[error("job {job} has made {MAX_UPLOADS_PER_JOB} uploads, the most one job may")]
    TooMany { job: JobId },
    #[error("job {0} runs a GitHub Actions runner; its pipeline takes no added steps")]
    Runner(JobId),
    #[error(transparent)]
    Brain(#[from] BrainError),
}

impl From<StoreError> for AddError {
    fn from(e: StoreError) -> Self {
        AddError::Brain(BrainError::Store(e))
    }
}

/// The brain's half: `by` is the uploading job as the brain holds it, assigned or running
/// (the brain checks). Reads its pipeline as stored now, validates the file against it,
/// decides the new steps' `if:`, and stores them with the upload counted, in one commit.
pub(crate) async fn add(
    store: &dyn Store,
    by: &JobRecord,
    file_name: &str,
    source: &str,
) -> Result<Vec<JobRecord>, AddError> {
    let pipeline = store.get_pipeline(by.pipeline_id).await?.ok_or(BrainError::PipelineNotFound(by.pipeline_id))?;
    if matches!(Origin::parse(pipeline.origin.as_deref()), Some(Origin::ActionsRunner(_))) {
        return Err(AddError::Runner(by.id));
    }
    let trusted = gpuci_core::trust::may_run_unsandboxed(Origin::cache_origin(pipeline.origin.as_deref()).as_ref());
    let jobs = store.pipeline_jobs(by.pipeline_id).await?;
    let existing = Existing::new(jobs.iter().map(|j| &j.step), trusted);
    let added = parse_upload(file_name, source, &existing)
        .map_err(|errors| AddError::Invalid { file: file_name.to_string(), errors })?;
    // `if:` is decided with the facts the pipeline was submitted with (changed paths are not
    // kept: a condition on them runs its step, as for unknown facts).
    let build = store
        .pipeline_builds(&[by.pipeline_id])
        .await?
        .get(&by.pipeline_id)
        .and_then(|json| serde_json::from_str::<gpuci_core::condition::BuildFacts>(json).ok())
        .unwrap_or_default();
    let decisions = gpuci_core::condition::plan(&added.steps, &build, &added.env);
    let now = crate::brain::now_ms();
    let who = format!("added by job {} ({})", by.id, by.step.key);
    let new: Vec<NewJob> = added
        .steps
        .iter()
        .zip(decisions)
        .map(|(step, decision)| {
            let mut env = added.env.clone();
            env.extend(step.env.clone());
            let mut step = step.clone();
            let (state, reason) = match decision {
                Decision::Run { note: None } => (JobState::Queued, format!("queued: {who}")),
                Decision::Run { note: Some(note) } => (JobState::Queued, format!("queued: {who}; {note}")),
                Decision::Skip(why) => {
                    step.skipped_by_condition = true;
                    (JobState::Skipped, why)
                }
            };
            NewJob {
                pipeline_id: by.pipeline_id,
                step,
                env,
                state,
                reason,
                attempt: 1,
                retry_of: None,
                created_at_ms: now,
            }
        })
        .collect();
    store.add_uploaded_jobs(by.id, new, MAX_UPLOADS_PER_JOB).await?.ok_or(AddError::TooMany { job: by.id })
}
