//! Pipelines from the API: submit (store the pipeline and its first jobs), cancel a job or a
//! whole pipeline, retry one job or every failed job of a pipeline.

use super::*;

impl Brain {
    pub(super) async fn submit(&mut self, sub: Submission) -> Result<(PipelineRecord, Vec<JobRecord>), BrainError> {
        let Submission { file_name, source, pipeline, extra_env, workspace_upload, repository, origin, build, once } =
            sub;
        let now = now_ms();
        // Conditions are decided now, once: the facts are the submission's and do not change.
        let mut pipeline_env = extra_env.clone();
        pipeline_env.extend(pipeline.env.clone());
        let decisions = gpuci_core::condition::plan(&pipeline.steps, &build, &pipeline_env);
        let jobs = pipeline
            .steps
            .iter()
            .zip(decisions)
            .map(|(step, decision)| {
                let mut env = pipeline_env.clone();
                env.extend(step.env.clone());
                let mut step = step.clone();
                let (state, reason) = match decision {
                    Decision::Run { note: None } => (JobState::Queued, "queued".to_string()),
                    Decision::Run { note: Some(note) } => (JobState::Queued, format!("queued: {note}")),
                    Decision::Skip(why) => {
                        step.skipped_by_condition = true;
                        (JobState::Skipped, why)
                    }
                };
                NewJob { pipeline_id: 0, step, env, state, reason, attempt: 1, retry_of: None, created_at_ms: now }
            })
            .collect();
        let new = NewPipeline { file_name, source, workspace_upload, repository, origin, created_at_ms: now };
        let (p, jobs) = match once {
            None => self.store.create_pipeline(new, jobs).await?,
            Some(once) => match self.store.create_pipeline_once(new, jobs, &once).await? {
                gpuci_store::Created::New(p, jobs) => (p, jobs),
                // Made before (its answer lost on the way: a failover, a dropped connection):
                // that pipeline, and nothing new.
                gpuci_store::Created::Before { pipeline, same: true } => {
                    tracing::info!(pipeline, key = %once.key, "a submission sent again: answered with the pipeline it made");
                    let p = self.store.get_pipeline(pipeline).await?.ok_or(BrainError::PipelineNotFound(pipeline))?;
                    let jobs = self.store.pipeline_jobs(pipeline).await?;
                    return Ok((p, jobs));
                }
                gpuci_store::Created::Before { pipeline, same: false } => {
                    return Err(BrainError::Conflict(format!(
                        "submission key {:?} was used for another request (pipeline {pipeline}); each submission needs a key of its own",
                        once.key
                    )))
                }
            },
        };
        self.group_scopes.insert(p.id, self.group_scope(p.repository.as_deref(), p.origin.as_deref()));
        // What the builds list shows (branch, commit, subject, author, trigger). Display
        // only: a pipeline whose facts cannot be stored runs all the same, listed without them.
        match serde_json::to_string(&gpuci_core::builds::for_list(&build)) {
            Ok(json) => {
                if let Err(e) = self.store.put_pipeline_build(p.id, &json).await {
                    tracing::warn!(pipeline = p.id, error = %e, "could not store the build facts for the builds list");
                }
            }
            Err(e) => tracing::warn!(pipeline = p.id, error = %e, "build facts not serializable"),
        }
        for j in &jobs {
            self.publish(j);
        }
        // A newer job of a concurrency group with cancel_in_progress cancels the older ones
        // of the same group: same name, repository and trust class, unless shared
        // (`gpuci_core::concurrency`).
        self.note_group_scopes().await;
        for j in &jobs {
            let Some(key) =
                self.group_of(j).filter(|_| j.step.concurrency.as_ref().is_some_and(|c| c.cancel_in_progress))
            else {
                continue;
            };
            let older: Vec<JobId> = self
                .active
                .values()
                .filter(|o| o.pipeline_id != p.id && self.group_of(o).as_ref() == Some(&key))
                .map(|o| o.id)
                .collect();
            for o in older {
                let why = format!("cancelled by job {} (pipeline {}) in concurrency group {key}", j.id, p.id);
                if let Err(e) = self.cancel(o, why).await {
                    tracing::warn!(job = o, error = %e, "could not cancel job of concurrency group");
                }
            }
        }
        tracing::info!(pipeline = p.id, jobs = jobs.len(), file = %p.file_name, "pipeline submitted");
        Ok((p, jobs))
    }

    pub(super) async fn cancel(&mut self, id: JobId, reason: String) -> Result<JobRecord, BrainError> {
        match self.cancel_as_held(id, reason.clone()).await {
            // The store had moved on (a commit whose answer was lost, an earlier cancel's
            // among them): its record is taken and the cancel applies to that. Answered 500
            // before (outsider attack on Postgres).
            Err(BrainError::Store(e)) if self.take_stored(id, &e).await.is_some() => {
                self.cancel_as_held(id, reason).await
            }
            r => r,
        }
    }

    /// [`Brain::cancel`] of the job as this coordinator holds it.
    async fn cancel_as_held(&mut self, id: JobId, reason: String) -> Result<JobRecord, BrainError> {
        let Some(job) = self.active.get(&id).cloned() else {
            return match self.store.get_job(id).await? {
                Some(j) => Err(BrainError::AlreadyFinished { job: id, state: j.state }),
                None => Err(BrainError::JobNotFound(id)),
            };
        };
        match job.state {
            JobState::Queued => {
                let j = self.finish(&job, JobState::Cancelled, reason, None, None, Vec::new()).await?;
                Ok(j)
            }
            _ if self.registering.remove(&id).is_some() => {
                // Never sent to the agent: nothing runs yet. The runner GitHub may have
                // registered meanwhile is removed by the GitHub integration when the job ends.
                let j = self.finish(&job, JobState::Cancelled, reason, None, None, Vec::new()).await?;
                Ok(j)
            }
            _ => {
                // Stored first: a cancel the caller is told failed (503) is not sent, and one
                // accepted survives a restart (`Brain::load` reads it back).
                if let Err(e) = self.store.set_reason(id, &format!("{CANCELLING}{reason}")).await {
                    // Perhaps stored all the same (a COMMIT whose answer was lost): the
                    // reaper reads the job again and sends the cancel if the store has it.
                    self.cancels_in_doubt.insert(id, reason);
                    return Err(e.into());
                }
                Ok(self.cancel_running(job, reason))
            }
        }
    }

    /// Sends the cancel of `job` (assigned or running), stored as being cancelled, to its
    /// agent. The agent kills the process tree and reports; the job ends then. An agent
    /// that is away is told when it returns (`Brain::agent_connected`); one that never does
    /// is declared lost and the job ends cancelled (`reap::decide`). Until then the job keeps
    /// its GPUs: ending it now freed them, and a retry ran beside the attempt still running
    /// on the away agent (outsider attack: a leader frozen past its lease, agents away
    /// 11–15 s).
    fn cancel_running(&mut self, job: JobRecord, reason: String) -> JobRecord {
        self.cancels_in_doubt.remove(&job.id);
        self.cancelling.insert(job.id, reason.clone());
        let agent = job.agent_id.clone().unwrap_or_default();
        self.send(&agent, CoordinatorMessage::Cancel { job_id: job.id, reason: reason.clone() });
        let mut j = job;
        j.reason = format!("{CANCELLING}{reason}");
        self.publish(&j);
        j
    }

    /// Cancels whose store write failed ([`Brain::cancel`]), read again (each tick): one the
    /// store has after all (its COMMIT went through, its answer was lost, the caller was told
    /// 503) is sent to the agent now; before, the store said "cancelling" while the job ran
    /// on, until a restart read it back (outsider attack). One the store does not have was
    /// not made, as the caller was told; one that cannot be read yet is read at the next tick.
    pub(super) async fn settle_cancels(&mut self) {
        for (id, reason) in std::mem::take(&mut self.cancels_in_doubt) {
            let Some(job) = self.active.get(&id).filter(|j| !self.cancelling.contains_key(&j.id)).cloned() else {
                continue;
            };
            if job.state == JobState::Queued {
                continue;
            }
            match self.store.get_job(id).await {
                Ok(Some(stored)) if stored.reason.starts_with(CANCELLING) => {
                    let reason = stored.reason.strip_prefix(CANCELLING).unwrap_or(&reason).to_string();
                    tracing::warn!(job = id, "a cancel stored without an answer is sent now");
                    self.cancel_running(job, reason);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(job = id, error = %e, "could not read whether a cancel was stored; reading it again");
                    self.cancels_in_doubt.insert(id, reason);
                }
            }
        }
    }

    /// A new attempt of a finished job's step. Once per job (the newest attempt is the one to
    /// retry); not for Actions runner jobs, whose runner belongs to one GitHub job.
    pub(super) async fn retry(&mut self, id: JobId, by: &str) -> Result<JobRecord, BrainError> {
        let job = self.store.get_job(id).await?.ok_or(BrainError::JobNotFound(id))?;
        if !job.state.is_terminal() {
            return Err(BrainError::Conflict(format!("job {id} is {}; only a finished job can be retried", job.state)));
        }
        let jobs = self.store.pipeline_jobs(job.pipeline_id).await?;
        let unseen = self.take_unseen(&jobs);
        if let Some(newer) = jobs.iter().find(|j| j.step.key == job.step.key && j.id > id) {
            // A retry whose answer was lost (the caller was told 503) asked again: its job.
            if let Some(rec) = unseen.into_iter().find(|j| j.id == newer.id) {
                return Ok(rec);
            }
            return Err(BrainError::Conflict(format!("job {id} was already retried as job {}", newer.id)));
        }
        let pipeline = self.store.get_pipeline(job.pipeline_id).await?;
        if matches!(Origin::parse(pipeline.as_ref().and_then(|p| p.origin.as_deref())), Some(Origin::ActionsRunner(_)))
        {
            return Err(BrainError::Conflict(format!(
                "job {id} ran a GitHub Actions runner; re-run the workflow job on GitHub instead"
            )));
        }
        let next = next_attempt(&job, format!("retry of job {id} ({}), asked by {by}", job.state), now_ms());
        let rec = self.store.insert_job(next).await?;
        tracing::info!(job = rec.id, retry_of = id, by, "job retried by hand");
        self.publish(&rec);
        Ok(rec)
    }

    /// The unfinished jobs of `jobs` (a pipeline's, as stored) that the scheduler does not
    /// hold, taken: a write that added them went through though its answer was lost (a retry
    /// answered 503), and they waited unseen, never placed nor cancellable, until a restart
    /// (outsider attack). Every unfinished job is in `Brain::active` otherwise.
    fn take_unseen(&mut self, jobs: &[JobRecord]) -> Vec<JobRecord> {
        let unseen: Vec<JobRecord> =
            jobs.iter().filter(|j| !j.state.is_terminal() && !self.active.contains_key(&j.id)).cloned().collect();
        for j in &unseen {
            tracing::warn!(job = j.id, state = %j.state, "a job the store holds and the scheduler did not (a write whose answer was lost); taking it");
            self.publish(j);
            self.schedule_due = true;
        }
        unseen
    }

    /// A new attempt of each job of the pipeline that `gpuci_core::rerun::retry_failed`
    /// names. All are stored before the scheduler runs (one command), so no new dependent is
    /// gated on its dependency's old, failed attempt.
    pub(super) async fn retry_failed(&mut self, pipeline: PipelineId, by: &str) -> Result<Vec<JobRecord>, BrainError> {
        let p = self.store.get_pipeline(pipeline).await?.ok_or(BrainError::PipelineNotFound(pipeline))?;
        if matches!(Origin::parse(p.origin.as_deref()), Some(Origin::ActionsRunner(_))) {
            return Err(BrainError::Conflict(format!(
                "pipeline {pipeline} ran a GitHub Actions runner; re-run the workflow on GitHub instead"
            )));
        }
        let jobs = self.store.pipeline_jobs(pipeline).await?;
        let unseen = self.take_unseen(&jobs);
        let plan = gpuci_core::rerun::retry_failed(jobs.iter().map(|j| gpuci_core::rerun::PipelineJob {
            job_id: j.id,
            step_key: &j.step.key,
            depends_on: &j.step.depends_on,
            state: j.state,
            soft_failed: gpuci_core::progress::is_soft_failure(&j.step.soft_fail, j.state, j.exit_code),
            skipped_by_condition: gpuci_core::progress::is_skipped_by_condition(&j.step, j.state),
        }));
        if plan.is_empty() {
            // A retry whose answer was lost (the caller was told 503) asked again: its jobs.
            if !unseen.is_empty() {
                return Ok(unseen);
            }
            return Err(BrainError::Conflict(format!("pipeline {pipeline} has no failed job to retry")));
        }
        let now = now_ms();
        let mut out = Vec::new();
        for (id, why) in plan {
            let Some(job) = jobs.iter().find(|j| j.id == id) else { continue };
            let why = match why {
                gpuci_core::rerun::Why::Failed => format!("retry of job {id} ({})", job.state),
                gpuci_core::rerun::Why::DependsOn(dep) => format!("retry of job {id}: `{dep}` runs again"),
            };
            let rec = self.store.insert_job(next_attempt(job, format!("{why}, asked by {by}"), now)).await?;
            self.publish(&rec);
            out.push(rec);
        }
        tracing::info!(pipeline, jobs = out.len(), by, "failed jobs of the pipeline retried by hand");
        Ok(out)
    }

    pub(super) async fn cancel_pipeline(
        &mut self,
        pipeline: PipelineId,
        reason: String,
    ) -> Result<Vec<JobRecord>, BrainError> {
        if self.store.get_pipeline(pipeline).await?.is_none() {
            return Err(BrainError::PipelineNotFound(pipeline));
        }
        let ids: Vec<JobId> =
            self.active.values().filter(|j| j.pipeline_id == pipeline).map(|j| j.id).collect::<Vec<_>>();
        let mut out = Vec::new();
        for id in ids {
            match self.cancel(id, reason.clone()).await {
                Ok(j) => out.push(j),
                // Ended meanwhile: nothing to cancel.
                Err(BrainError::AlreadyFinished { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
}
