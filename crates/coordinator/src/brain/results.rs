//! A job's life after placement: agents' starts and results, stored in one transaction per
//! batch ([`Brain::flush_events`]) and answered only after it commits; ending a job
//! ([`Brain::finish`]), queueing its retry, and notes written into its log.
//!
//! Whether an ended job is retried, and whether a job whose GPU failed its pre-job check goes
//! back to the queue, is decided by gpuci-core's `requeue` over the job's plain data; this
//! stores and publishes what it says.

use super::*;
use gpuci_core::requeue;

impl Brain {
    /// End a job now, release its GPUs, quarantine failed ones, and queue a retry if the
    /// policy says so.
    pub(super) async fn finish(
        &mut self,
        job: &JobRecord,
        state: JobState,
        reason: String,
        exit_code: Option<i32>,
        telemetry: Option<gpuci_protocol::agent::JobTelemetry>,
        quarantine: Vec<Quarantine>,
    ) -> Result<JobRecord, BrainError> {
        self.finish_at(job, state, reason, exit_code, telemetry, quarantine, None).await
    }

    /// [`Brain::finish`], ended when its agent says (`reported_ms`, [`ended_at`]).
    #[allow(clippy::too_many_arguments)]
    async fn finish_at(
        &mut self,
        job: &JobRecord,
        state: JobState,
        reason: String,
        exit_code: Option<i32>,
        telemetry: Option<gpuci_protocol::agent::JobTelemetry>,
        quarantine: Vec<Quarantine>,
        reported_ms: Option<i64>,
    ) -> Result<JobRecord, BrainError> {
        let now = now_ms();
        let finished_at_ms = reported_ms.map_or(now, |r| ended_at(job, r, now));
        // Whether it runs again, and the reasons: `requeue::on_end` (a job that never left
        // the queue is never retried).
        let ending = requeue::on_end(job.id, &job.step, job.state, job.attempt, state, reason);
        let expect = [JobState::Queued, JobState::Assigned, JobState::Running];
        let change = JobChange {
            state: Some(state),
            reason: Some(ending.reason),
            finished_at_ms: Some(finished_at_ms),
            exit_code,
            telemetry,
            release_leases: true,
            quarantine: quarantine.clone(),
            ..Default::default()
        };
        // The end and its retry are one commit: were the retry a second write, a failure
        // between the two would leave a job ended without the retry its policy promised.
        // Nothing below (memory, watchers, the log) changes until it is stored.
        let (rec, next) = if let Some(retry) = ending.retry {
            let next = next_attempt(job, retry, now);
            let (rec, next) = self.store.update_job_and_insert(job.id, &expect, change, next).await?;
            (rec, Some(next))
        } else {
            (self.store.update_job(job.id, &expect, change).await?, None)
        };
        self.finished(&rec, next.as_ref(), quarantine);
        Ok(rec)
    }

    /// A job's end stored (with its retry, if any): memory, watchers and metrics follow.
    fn finished(&mut self, rec: &JobRecord, next: Option<&JobRecord>, quarantine: Vec<Quarantine>) {
        self.ready_since.remove(&rec.id);
        for q in quarantine {
            tracing::warn!(gpu = %q.gpu_uuid, agent = %q.agent_id, reason = %q.reason, "GPU quarantined");
            self.quarantine.insert(q.gpu_uuid.clone(), q);
        }
        self.cancelling.remove(&rec.id);
        self.metrics.job_finished(rec.state, &rec.reason);
        self.publish(rec);
        tracing::info!(job = rec.id, state = %rec.state, reason = %rec.reason, "job finished");
        if let Some(next) = next {
            self.publish(next);
        }
    }

    pub(super) async fn ended_reason(&self, id: JobId, was_lost: bool) -> String {
        match self.store.get_job(id).await {
            Ok(Some(j)) => format!("job {id} already ended {}: {}", j.state, j.reason),
            _ if was_lost => format!("job {id} was declared lost while this agent was away"),
            _ => format!("job {id} is unknown to the coordinator"),
        }
    }

    /// Record a start, with what the agent did not enforce for the job (kept with the job for
    /// `gpuci jobs show`, the API and the job page). Idempotent: a start already recorded, or
    /// of a job that has ended or is not this agent's, changes nothing.
    /// The stored change a job's start makes, or `None` when it changes nothing (the job is
    /// not this agent's, or not waiting to start).
    fn start_change(
        &self,
        agent_id: &str,
        id: JobId,
        started_at_ms: i64,
        unenforced: Vec<gpuci_protocol::agent::Unenforced>,
    ) -> Option<JobChange> {
        let j = self.active.get(&id)?;
        if j.agent_id.as_deref() != Some(agent_id) || j.state != JobState::Assigned {
            return None;
        }
        let reason = match self.cancelling.get(&id) {
            // The stored record of an accepted cancel stays until the job ends.
            Some(r) => format!("{CANCELLING}{r}"),
            None => format!("running on {}", self.agents.get(agent_id).map_or(agent_id, |a| a.name.as_str())),
        };
        Some(JobChange {
            state: Some(JobState::Running),
            reason: Some(reason),
            started_at_ms: Some(started_at_ms),
            unenforced: Some(unenforced),
            ..Default::default()
        })
    }

    /// A start stored: counted and published.
    fn started(&mut self, rec: &JobRecord, started_at_ms: i64) {
        let queue = rec.step.agents.get("queue").map_or("default", String::as_str);
        let waited = (started_at_ms - rec.created_at_ms).max(0) as f64 / 1000.0;
        self.metrics.start_latency.with_label_values(&[queue]).observe(waited);
        self.publish(rec);
    }

    async fn job_started(
        &mut self,
        agent_id: &str,
        id: JobId,
        started_at_ms: i64,
        unenforced: Vec<gpuci_protocol::agent::Unenforced>,
    ) -> Result<(), String> {
        let Some(change) = self.start_change(agent_id, id, started_at_ms, unenforced) else { return Ok(()) };
        match self.store.update_job(id, &[JobState::Assigned], change).await {
            Ok(rec) => {
                self.started(&rec, started_at_ms);
                Ok(())
            }
            Err(e) if self.caught_up(id, &e, true).await => Ok(()),
            Err(e) => {
                tracing::error!(job = id, error = %e, "could not record job start; the agent will send it again");
                Err(format!("recording the start of job {id}: {e}"))
            }
        }
    }

    /// Adds a start to the batch ([`Brain::flush_events`]).
    pub(super) fn batch_start(
        &mut self,
        agent_id: &str,
        job: JobId,
        started_at_ms: i64,
        unenforced: Vec<gpuci_protocol::agent::Unenforced>,
        reply: EventReply,
    ) {
        // A start sent again (a resend) while the job has an update in the batch answers as
        // that update does.
        let item = match self.events.index.get(&job) {
            Some(i) => Some(*i),
            None => self.start_change(agent_id, job, started_at_ms, unenforced).map(|change| {
                self.push_update(
                    JobUpdate { job, expect: vec![JobState::Assigned], change },
                    AfterCommit::Started { started_at_ms },
                )
            }),
        };
        self.events.answers.push((reply, item));
    }

    /// Adds a plain result (a running job of this agent's ends, no retry, nothing to note in
    /// its log) to the batch, or hands it back to be applied alone ([`Brain::job_finished`]).
    pub(super) fn batch_finish(
        &mut self,
        agent_id: &str,
        f: JobFinished,
        reply: EventReply,
    ) -> Option<(JobFinished, EventReply)> {
        let Some(job) = self.active.get(&f.job_id) else {
            // Already ended (cancelled while the agent was away, or sent twice): nothing to store.
            self.events.answers.push((reply, None));
            return None;
        };
        let (state, reason) = f.outcome.verdict_after_cancel(self.cancelling.get(&f.job_id).map(String::as_str));
        let plain = job.agent_id.as_deref() == Some(agent_id)
            && job.state == JobState::Running
            && !self.events.index.contains_key(&f.job_id)
            && !matches!(f.outcome, Outcome::Lost { .. })
            && !requeue::retries(&job.step, job.state, state, job.attempt);
        if !plain {
            return Some((f, reply));
        }
        let now = now_ms();
        let quarantine: Vec<Quarantine> = f
            .gpu_health
            .iter()
            .filter_map(|(uuid, h)| match h {
                GpuHealth::Unhealthy { reason } => Some(Quarantine {
                    gpu_uuid: uuid.clone(),
                    agent_id: agent_id.to_string(),
                    reason: format!("job {}: {reason}", f.job_id),
                    since_ms: now,
                }),
                GpuHealth::Healthy => None,
            })
            .collect();
        let exit_code = match f.outcome {
            Outcome::Exited { code } => Some(code),
            _ => None,
        };
        // As `finish` stores it.
        let change = JobChange {
            state: Some(state),
            reason: Some(reason),
            finished_at_ms: Some(ended_at(job, f.finished_at_us / 1000, now)),
            exit_code,
            telemetry: f.telemetry,
            release_leases: true,
            quarantine: quarantine.clone(),
            ..Default::default()
        };
        let expect = vec![JobState::Queued, JobState::Assigned, JobState::Running];
        let item = self.push_update(JobUpdate { job: f.job_id, expect, change }, AfterCommit::Finished { quarantine });
        self.events.answers.push((reply, Some(item)));
        None
    }

    fn push_update(&mut self, update: JobUpdate, after: AfterCommit) -> usize {
        let b = &mut self.events;
        b.index.insert(update.job, b.updates.len());
        b.updates.push(update);
        b.after.push(after);
        b.updates.len() - 1
    }

    /// Group commit of agents' events: every start and plain result handled since the last
    /// flush is stored in one transaction, and each is answered (so acknowledged to its
    /// agent) only after that commit. A failed commit answers each with the error: nothing is
    /// acknowledged, and the agents send their events again.
    pub(super) async fn flush_events(&mut self) {
        if self.events.answers.is_empty() {
            return;
        }
        let EventBatch { updates, after, answers, .. } = std::mem::take(&mut self.events);
        let outcome: Vec<Result<(), String>> = if updates.is_empty() {
            Vec::new()
        } else {
            match self.store.update_jobs(&updates).await {
                Err(e) => {
                    tracing::error!(events = updates.len(), error = %e, "could not record agents' events; they will send them again");
                    updates.iter().map(|u| Err(format!("recording an event of job {}: {e}", u.job))).collect()
                }
                Ok(results) => {
                    let mut outcome = Vec::with_capacity(results.len());
                    // Each job as the batch's earlier changes left it (a job changed twice).
                    let mut changed: HashMap<JobId, JobRecord> = HashMap::new();
                    for ((u, r), after) in updates.iter().zip(results).zip(after) {
                        let r = match r {
                            Ok(()) => self.as_changed(&mut changed, u).await,
                            Err(e) => Err(e),
                        };
                        outcome.push(match r {
                            Ok(rec) => {
                                match after {
                                    AfterCommit::Started { started_at_ms } => self.started(&rec, started_at_ms),
                                    AfterCommit::Finished { quarantine } => self.finished(&rec, None, quarantine),
                                }
                                Ok(())
                            }
                            Err(e) if self.caught_up(u.job, &e, matches!(after, AfterCommit::Started { .. })).await => {
                                Ok(())
                            }
                            Err(e) => {
                                tracing::error!(job = u.job, error = %e, "could not record an agent's event; it will send it again");
                                Err(format!("recording an event of job {}: {e}", u.job))
                            }
                        });
                    }
                    outcome
                }
            }
        };
        for (reply, item) in answers {
            let _ = reply.send(item.map_or(Ok(()), |i| outcome[i].clone()));
        }
    }

    /// `u`'s job as the store holds it once `u` (accepted) is written: built from this
    /// coordinator's copy (`JobChange::applied_to`, exactly what the store wrote), read back
    /// only for a job it does not hold.
    async fn as_changed(
        &self,
        changed: &mut HashMap<JobId, JobRecord>,
        u: &JobUpdate,
    ) -> Result<JobRecord, StoreError> {
        let rec = match changed.get(&u.job).or_else(|| self.active.get(&u.job)) {
            Some(held) => u.change.applied_to(held),
            None => self.store.get_job(u.job).await?.ok_or(StoreError::JobNotFound(u.job))?,
        };
        changed.insert(u.job, rec.clone());
        Ok(rec)
    }

    /// Record a result. Idempotent: a result for a job already ended (cancelled while the
    /// agent was away, or sent twice) or not this agent's changes nothing.
    pub(super) async fn job_finished(&mut self, agent_id: &str, f: JobFinished) -> Result<(), String> {
        let id = f.job_id;
        let Some(mut job) = self.active.get(&id).cloned() else { return Ok(()) };
        if job.agent_id.as_deref() != Some(agent_id) {
            tracing::warn!(job = id, agent = agent_id, "result from an agent the job is not assigned to; ignored");
            return Ok(());
        }
        // Every job that ran has its start time, even when the start event went missing.
        if job.state == JobState::Assigned {
            if let Some(at) = f.started_at_us {
                // The start event (and with it what was not enforced) went missing: only an
                // agent that died while starting the job sends none.
                self.job_started(agent_id, id, at / 1000, Vec::new()).await?;
                job = self.active.get(&id).cloned().unwrap_or(job);
            }
        }
        let (state, reason) = f.outcome.verdict_after_cancel(self.cancelling.get(&id).map(String::as_str));
        let exit_code = match f.outcome {
            Outcome::Exited { code } => Some(code),
            _ => None,
        };
        let now = now_ms();
        let quarantine: Vec<Quarantine> = f
            .gpu_health
            .iter()
            .filter_map(|(uuid, h)| match h {
                GpuHealth::Unhealthy { reason } => Some(Quarantine {
                    gpu_uuid: uuid.clone(),
                    agent_id: agent_id.to_string(),
                    reason: format!("job {id}: {reason}"),
                    since_ms: now,
                }),
                GpuHealth::Healthy => None,
            })
            .collect();
        // The job never started because a leased GPU failed its pre-job check: that is the
        // GPU's fault, not the job's. Quarantine the GPU and put the job back in the queue.
        // (`requeue::after_start_failed`.)
        let gpus: Vec<String> = quarantine.iter().map(|q: &Quarantine| q.gpu_uuid.clone()).collect();
        if let Some(why) = requeue::after_start_failed(job.state, &f.outcome, &gpus) {
            let change = JobChange {
                state: Some(JobState::Queued),
                reason: Some(why),
                clear_assignment: true,
                quarantine: quarantine.clone(),
                ..Default::default()
            };
            return match self.store.update_job(id, &[JobState::Assigned], change).await {
                Ok(rec) => {
                    for q in quarantine {
                        tracing::warn!(gpu = %q.gpu_uuid, reason = %q.reason, "GPU quarantined");
                        self.quarantine.insert(q.gpu_uuid.clone(), q);
                    }
                    self.publish(&rec);
                    Ok(())
                }
                Err(e) => {
                    tracing::error!(job = id, error = %e, "could not requeue job; the agent will send its result again");
                    Err(format!("requeueing job {id}: {e}"))
                }
            };
        }
        if let Outcome::Lost { reason } = &f.outcome {
            // The log says where its output may stop short, not just the job's reason.
            self.note_in_log(&job, format!("output may be missing from here on: {reason}")).await;
        }
        let reported = Some(f.finished_at_us / 1000);
        match self.finish_at(&job, state, reason, exit_code, f.telemetry, quarantine, reported).await {
            Ok(_) => Ok(()),
            Err(BrainError::Store(e)) if self.ended_in_store(id, &e).await => Ok(()),
            Err(e) => {
                tracing::error!(job = id, error = %e, "could not record job result; the agent will send it again");
                Err(format!("recording the result of job {id}: {e}"))
            }
        }
    }

    /// Whether `e` says the stored job has already ended (an operator's or another process's
    /// write this coordinator did not make): then the stored end stands, memory follows it,
    /// and the agent's event is acknowledged. Sending it again could never succeed: refusing
    /// it kept the agent reconnecting for ever, its later events stuck behind it (outsider
    /// attack).
    /// The store refused an agent's event because the job is not in the state this
    /// coordinator held: an earlier commit went through though its answer was lost (the
    /// connection dropped during COMMIT), or the job ended meanwhile. The stored record is
    /// read and taken, so that memory follows the store again (a start refused for ever,
    /// closing its agent's connection at each resend, wedged that agent: outsider attack),
    /// and the event counts as applied when it has nothing left to change: the job ended,
    /// or, for a start (`start`), it is no longer waiting to start.
    pub(super) async fn caught_up(&mut self, id: JobId, e: &StoreError, start: bool) -> bool {
        let StoreError::Conflict { found, .. } = e else { return false };
        if found.is_terminal() {
            return self.ended_in_store(id, e).await;
        }
        match self.take_stored(id, e).await {
            Some(state) => state.is_terminal() || (start && state != JobState::Assigned),
            None => false,
        }
    }

    /// The store refused a change of job `id` because the job is not in the state this
    /// coordinator held (`e`, a [`StoreError::Conflict`]): a commit whose answer was lost
    /// went through after all (a cancel, a requeue, an assignment, a start). The stored record
    /// is read and taken, so that memory follows the store again; refused again and again
    /// otherwise, such a job never ran (or kept a GPU) until a restart (outsider attacks).
    /// Returns the stored state, `None` when `e` is no conflict or the record cannot be read.
    pub(super) async fn take_stored(&mut self, id: JobId, e: &StoreError) -> Option<JobState> {
        let StoreError::Conflict { .. } = e else { return None };
        let stored = self.store.get_job(id).await.ok()??;
        let held = self.active.get(&id).map(|j| (j.state, j.agent_id.clone()));
        if held != Some((stored.state, stored.agent_id.clone())) {
            tracing::warn!(job = id, state = %stored.state, "the store had moved on (a commit whose answer was lost); taking its record");
            self.publish(&stored);
        }
        Some(stored.state)
    }

    pub(super) async fn ended_in_store(&mut self, id: JobId, e: &StoreError) -> bool {
        let StoreError::Conflict { found, .. } = e else { return false };
        if !found.is_terminal() {
            return false;
        }
        match self.store.get_job(id).await {
            Ok(Some(stored)) => {
                tracing::warn!(job = id, state = %stored.state, reason = %stored.reason, "the job had already ended in the store; its agent's event is not applied");
                self.publish(&stored);
                true
            }
            _ => false,
        }
    }

    /// Append a gpuci line to a job's log (after whatever is stored).
    pub(super) async fn note_in_log(&self, job: &JobRecord, text: String) {
        let line = gpuci_protocol::agent::LogChunk {
            ts_us: now_ms() * 1000,
            stream: gpuci_protocol::agent::Stream::System,
            text,
        };
        match self.store.append_logs(job.id, None, &[line]).await {
            Ok(stored) => {
                for l in stored {
                    self.hub.log(job.id, job.pipeline_id, l);
                }
            }
            Err(e) => tracing::warn!(job = job.id, error = %e, "could not add a line to the job's log"),
        }
    }
}

/// When a job its agent reports ended at `reported_ms` (the agent's clock) is recorded as
/// ended: that time, but never before the job started (or was assigned) nor after `now_ms`
/// (the coordinator's clock: an agent's clock may be off). A result that reached the
/// coordinator late (it was down, the agent away) was recorded as ending when it arrived: a
/// 2 s job whose result waited 8 s for a restart ran 10.9 s by its record and its cost
/// (outsider check).
pub(super) fn ended_at(job: &JobRecord, reported_ms: i64, now_ms: i64) -> i64 {
    let floor = job.started_at_ms.or(job.assigned_at_ms).unwrap_or(i64::MIN).min(now_ms);
    reported_ms.clamp(floor, now_ms)
}
