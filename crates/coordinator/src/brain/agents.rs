//! Agents and their links: settling an agent's jobs when it connects ([`reconcile`]),
//! GPU health and release, disconnects, the reaper that declares silent agents lost (allowing
//! for the coordinator's own stalls, [`heard_after_stall`]), and machines being taken back.
//!
//! Every decision here is a pure function of gpuci-core over plain data gathered from the
//! brain's state: `reconnect::reconcile` on connect, `reap::decide` at each tick,
//! `requeue::on_interrupted` for a machine taken back. The methods below gather that data,
//! call the function and apply its answer (store first, then memory, then the agents); they
//! decide nothing themselves.

use super::*;

// The decisions are gpuci-core's (`reconnect`, `reap`, `requeue`); re-exported where callers
// found them before.
pub use gpuci_core::reap::{heard_after_stall, stalled};
pub use gpuci_core::reconnect::{reconcile, Reconciled};
use gpuci_core::{reap, requeue};

impl Brain {
    pub(super) async fn agent_connected(
        &mut self,
        agent_id: &str,
        conn: u64,
        hello: Hello,
        tx: AgentTx,
    ) -> Result<(), BrainError> {
        if !gpuci_protocol::takes_agent(hello.protocol) {
            let why = format!(
                "agent speaks protocol {}, coordinator speaks {} (and takes agents of {} and later)",
                hello.protocol,
                gpuci_protocol::PROTOCOL_VERSION,
                gpuci_protocol::OLDEST_AGENT_PROTOCOL
            );
            let _ = tx.send(CoordinatorMessage::Refused { reason: why.clone() });
            return Err(BrainError::AgentRefused(why));
        }
        // Two machines with one identity (a data dir copied into an image after registration)
        // each took the other's connection in turn, and each connect reconciled the other's
        // jobs as never received or lost: jobs ran twice (outsider attack). A connection from
        // another host while one is live is refused, loudly; the same host connecting again
        // (its old connection not yet seen closed) replaces the old one.
        if let Some(live) = self.agents.get(agent_id).filter(|a| a.link == Link::Connected && a.conn.is_some()) {
            if live.hostname != hello.hostname {
                let why = format!(
                    "agent {} is connected from host {} already, and this connection is from host {}: two machines \
                     share one agent identity (a data dir copied after registration?); register each machine as an \
                     agent of its own",
                    live.name, live.hostname, hello.hostname
                );
                tracing::error!(agent = agent_id, reason = %why, "agent refused");
                let _ = tx.send(CoordinatorMessage::Refused { reason: why.clone() });
                return Err(BrainError::AgentRefused(why));
            }
        }
        let now = now_ms();
        let hello_json = serde_json::to_string(&hello).ok();
        let was_lost = self.agents.get(agent_id).is_some_and(|a| a.link == Link::Lost);
        let name = self.agents.get(agent_id).map_or_else(|| hello.name.clone(), |a| a.name.clone());
        // Stored first: an agent we could not record as connected is not taken as connected.
        self.store
            .update_agent(
                agent_id,
                AgentUpdate {
                    state: Some("connected".into()),
                    reason: Some(String::new()),
                    last_seen_ms: Some(now),
                    hello_json,
                },
            )
            .await?;
        let entry = AgentState {
            id: agent_id.to_string(),
            name,
            hostname: hello.hostname.clone(),
            tags: hello.tags.clone(),
            slots: hello.slots,
            gpus: hello.gpus.clone(),
            health: BTreeMap::new(),
            gpu_backend: hello.gpu_backend.clone(),
            isolation: hello.isolation.clone(),
            refuses: hello.refuses.clone(),
            container_runtime: hello.container_runtime.clone(),
            link: Link::Connected,
            conn: Some((conn, tx.clone())),
            last_seen: Instant::now(),
            last_seen_ms: now,
            reason: String::new(),
            paused: hello.paused.clone(),
            interrupted: None,
            withdrawn: None,
            first_job_at_ms: None,
            ends_at_ms: hello.ends_at_ms,
        };
        self.agents.insert(agent_id.to_string(), entry);

        // Settle what the agent holds against what we recorded (`reconcile`, pure). The
        // welcome, the first message on the connection, names what it holds that we ended.
        let ours: Vec<(JobId, JobState)> = self.jobs_on(agent_id).map(|j| (j.id, j.state)).collect();
        let holds: Vec<JobId> = hello.running.clone();
        let cancelling: Vec<JobId> =
            ours.iter().map(|(id, _)| *id).filter(|id| self.cancelling.contains_key(id)).collect();
        let plan = reconcile(&ours, &holds, hello.journal_incomplete.is_some(), &cancelling);
        // Applied before the welcome: an agent that was welcomed after saying its journal was
        // incomplete forgets that it was, so what it changes must be committed by then.
        // A change the store refuses because the job moved on there (a commit whose answer was
        // lost) takes the stored record and goes on: failing the connect closed it, the agent
        // came back, and the same refusal closed it again, for ever (outsider attack).
        for id in plan.requeue {
            // Never received (the agent journals an assignment before starting it), so it never
            // ran: safe to hand out again.
            let change = JobChange {
                state: Some(JobState::Queued),
                reason: Some(gpuci_core::reconnect::requeue_reason(&hello.name)),
                clear_assignment: true,
                ..Default::default()
            };
            match self.store.update_job(id, &[JobState::Assigned], change).await {
                Ok(rec) => self.publish(&rec),
                Err(e) if self.take_stored(id, &e).await.is_some() => {}
                Err(e) => return Err(e.into()),
            }
        }
        for id in plan.cancelled {
            let Some(j) = self.active.get(&id).cloned() else { continue };
            let why = self.cancelling.get(&id).cloned().unwrap_or_else(|| "cancelled".to_string());
            self.settle(&j, JobState::Cancelled, why).await?;
        }
        for id in plan.lost {
            let Some(j) = self.active.get(&id).cloned() else { continue };
            let why = gpuci_core::reconnect::lost_reason(&hello.name, hello.journal_incomplete.as_deref());
            self.note_in_log(&j, format!("output may be missing from here on: {why}")).await;
            self.settle(&j, JobState::Lost, why).await?;
        }
        let mut forget = Vec::new();
        for id in &plan.forget {
            let reason = self.ended_reason(*id, was_lost).await;
            tracing::info!(agent = agent_id, job = id, reason = %reason, "told agent what happened to its job");
            forget.push(Forgotten { job_id: *id, reason });
        }
        self.send(
            agent_id,
            CoordinatorMessage::Welcome {
                agent_id: agent_id.to_string(),
                heartbeat_interval_ms: self.timing.heartbeat_interval.as_millis() as u64,
                forget: forget.clone(),
            },
        );
        for f in forget {
            self.send(agent_id, CoordinatorMessage::Cancel { job_id: f.job_id, reason: f.reason });
        }
        for id in plan.keep {
            if let Some(reason) = self.cancelling.get(&id).cloned() {
                self.send(agent_id, CoordinatorMessage::Cancel { job_id: id, reason });
            }
        }
        tracing::info!(agent = agent_id, name = %hello.name, slots = hello.slots, gpus = hello.gpus.len(), "agent connected");
        if let Some(reason) = &hello.interrupted {
            self.agent_interrupted(agent_id, reason.clone()).await;
        }
        Ok(())
    }

    /// Ends `j` as an agent's connect found it ([`Brain::finish`]); a refusal because the job
    /// moved on in the store takes the stored record instead ([`Brain::take_stored`]).
    async fn settle(&mut self, j: &JobRecord, state: JobState, why: String) -> Result<(), BrainError> {
        match self.finish(j, state, why, None, None, Vec::new()).await {
            Ok(_) => Ok(()),
            Err(BrainError::Store(e)) if self.take_stored(j.id, &e).await.is_some() => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub(super) async fn apply_gpus(
        &mut self,
        agent_id: &str,
        gpus: Vec<gpuci_core::gpu::GpuInfo>,
        health: BTreeMap<String, GpuHealth>,
    ) {
        let now = now_ms();
        for (uuid, h) in &health {
            if let GpuHealth::Unhealthy { reason } = h {
                if !self.quarantine.contains_key(uuid) {
                    let q = Quarantine {
                        gpu_uuid: uuid.clone(),
                        agent_id: agent_id.to_string(),
                        reason: reason.clone(),
                        since_ms: now,
                    };
                    match self.store.quarantine_gpu(&q).await {
                        Ok(()) => {
                            tracing::warn!(gpu = %uuid, reason = %reason, "GPU quarantined by its agent's health check");
                            self.quarantine.insert(uuid.clone(), q);
                        }
                        Err(e) => tracing::error!(gpu = %uuid, error = %e, "could not quarantine GPU"),
                    }
                }
            }
        }
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.gpus = gpus;
            a.health = health;
        }
    }

    pub(super) async fn release_gpu(&mut self, uuid: &str) -> Result<(), BrainError> {
        if !self.store.release_quarantine(uuid).await? {
            return Err(BrainError::NotQuarantined(uuid.to_string()));
        }
        self.quarantine.remove(uuid);
        tracing::info!(gpu = uuid, "GPU released from quarantine by hand");
        // Its agent takes the GPU's current error counters as the new baseline; otherwise the
        // error that quarantined it would quarantine it again at the next check.
        let owner = self.agents.values().find(|a| a.gpus.iter().any(|g| g.uuid == uuid)).map(|a| a.id.clone());
        if let Some(owner) = owner {
            if let Some(a) = self.agents.get_mut(&owner) {
                a.health.remove(uuid);
            }
            self.send(&owner, CoordinatorMessage::GpuReleased { uuid: uuid.to_string() });
        }
        Ok(())
    }

    /// The agent's connection is gone (`silent`: we dropped it for missed heartbeats, so we
    /// last heard from it at `last_seen`, not now). `lost_after` counts from the last time
    /// we heard from it.
    pub(super) async fn agent_disconnected(&mut self, agent_id: &str, why: &str, silent: bool) {
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.conn = None;
            a.link = Link::Disconnected;
            if !silent {
                a.last_seen = Instant::now();
            }
            a.reason = format!("disconnected: {why}");
        }
        tracing::info!(agent = agent_id, why, "agent disconnected");
        let update =
            AgentUpdate { state: Some("disconnected".into()), reason: Some(why.to_string()), ..Default::default() };
        self.record_link(agent_id, update).await;
    }

    /// Store an agent's new link; if the store cannot take it now, keep it for the next reap
    /// (a newer link replaces an older one; a reconnect, stored first, clears it).
    async fn record_link(&mut self, agent_id: &str, update: AgentUpdate) {
        if let Err(e) = self.store.update_agent(agent_id, update.clone()).await {
            tracing::error!(agent = agent_id, error = %e, state = ?update.state, "could not record the agent's state; trying again");
            self.unsaved_links.insert(agent_id.to_string(), update);
        } else {
            self.unsaved_links.remove(agent_id);
        }
    }

    /// Whether the store takes writes again after it did not ([`Brain::store_deaf`]): one
    /// small write, an agent's reason as it is. When it does, every agent gets `lost_after`
    /// from now to be heard, as after a restart: while the store took no writes, no agent
    /// could be (outsider attack: a database down or a disk full for longer than `lost_after`
    /// ended healthy agents' finished jobs `lost` the moment it came back, and retried them).
    async fn store_hears_again(&mut self) -> bool {
        let probe = self.agents.values().find(|a| a.link != Link::Connected).map(|a| (a.id.clone(), a.reason.clone()));
        if let Some((id, reason)) = probe {
            let update = AgentUpdate { reason: Some(reason), ..Default::default() };
            if self.store.update_agent(&id, update).await.is_err() {
                return false;
            }
        }
        self.store_deaf = false;
        let now = Instant::now();
        for a in self.agents.values_mut() {
            a.last_seen = a.last_seen.max(now);
        }
        tracing::info!("the store takes writes again; every agent has lost_after from now to be heard");
        true
    }

    /// Timer work: queue timeouts, silent agents, lost agents. Decided by
    /// [`reap::decide`] over the agents' silences and the active jobs; applied here in its
    /// order.
    pub(super) async fn reap(&mut self) {
        let now = Instant::now();
        let now_wall = now_ms();
        if let Some(previous) = self.last_tick.replace(now) {
            if stalled(previous, now, self.timing.tick) {
                let stall = now.saturating_duration_since(previous);
                tracing::warn!(
                    stalled_for = ?stall,
                    "the coordinator did not run for a while (stopped, paused or blocked); that time does not count against its agents' lost_after"
                );
                for a in self.agents.values_mut() {
                    a.last_seen = heard_after_stall(a.last_seen, stall, self.timing.tick, now);
                }
            }
        }
        for (id, update) in std::mem::take(&mut self.unsaved_links) {
            // Only what is still true: a reconnect meanwhile stored its own state.
            if self.agents.get(&id).is_some_and(|a| a.link != Link::Connected) {
                self.record_link(&id, update).await;
            }
        }
        self.settle_cancels().await;
        if self.store_deaf && !self.store_hears_again().await {
            // Still no writes: nobody's silence counts (queue timeouts wait too: they are writes).
            return;
        }
        let plan = {
            let agents: Vec<reap::AgentSeen<'_>> = self
                .agents
                .values()
                .map(|a| reap::AgentSeen {
                    id: &a.id,
                    name: &a.name,
                    link: link_seen(a.link),
                    silent_for: now.saturating_duration_since(a.last_seen),
                    last_seen_ms: a.last_seen_ms,
                })
                .collect();
            let jobs: Vec<reap::ActiveJob<'_>> = self
                .active
                .values()
                .map(|j| reap::ActiveJob {
                    id: j.id,
                    state: j.state,
                    agent: j.agent_id.as_deref(),
                    ready_since_ms: self.ready_since.get(&j.id).copied(),
                    queue_timeout: j.step.effective_queue_timeout(),
                    reason: &j.reason,
                    cancelling: self.cancelling.get(&j.id).map(String::as_str),
                    noted_lost: self.noted_lost.contains(&j.id),
                })
                .collect();
            reap::decide(&agents, &jobs, now_wall, self.lost_after_now(now))
        };
        for lost in &plan.lost {
            self.apply_lost(lost).await;
        }
        for t in &plan.timed_out {
            // Still queued: nothing above ends a queued job, but the answer is applied to what is.
            let Some(j) = self.active.get(&t.job).filter(|j| j.state == JobState::Queued).cloned() else { continue };
            // `settle`: a timeout the store took though its answer was lost is taken from the
            // store, not tried again every second (outsider attack).
            if let Err(e) = self.settle(&j, JobState::TimedOut, t.reason.clone()).await {
                tracing::error!(job = j.id, error = %e, "could not time out job");
            }
        }
        if plan.schedules() {
            self.schedule().await;
        }
    }

    /// One lost agent of [`reap::decide`]'s answer: its connection dropped, it declared lost
    /// (stored first: while the store takes no writes, nothing else of it is done), its jobs
    /// ended.
    async fn apply_lost(&mut self, lost: &reap::LostAgent) {
        let id = lost.agent.as_str();
        if lost.drop_connection {
            // Silent for `lost_after`: that is lost, now, not after another `lost_after`.
            self.agent_disconnected(id, reap::MISSED_HEARTBEATS, true).await;
        }
        if let Some(declared) = &lost.declare {
            if !self.declare_lost(id, declared).await {
                return;
            }
        }
        self.end_jobs_of_lost(&lost.jobs).await;
    }

    /// Store that the agent is lost, then hold it so; false when the store took no write.
    async fn declare_lost(&mut self, agent_id: &str, declared: &reap::Declared) -> bool {
        let update =
            AgentUpdate { state: Some("lost".into()), reason: Some(declared.stored.clone()), ..Default::default() };
        if let Err(e) = self.store.update_agent(agent_id, update).await {
            // The store takes no writes, so the coordinator cannot hear its agents either:
            // their events cannot be stored and their connections are closed to have them sent
            // again. Their silence is not theirs (see `store_deaf`).
            if !self.store_deaf {
                tracing::warn!(error = %e, "the store takes no writes: no agent is declared lost until it does, and then each gets lost_after to be heard");
            }
            self.store_deaf = true;
            return false;
        }
        self.unsaved_links.remove(agent_id);
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.link = Link::Lost;
            a.reason = declared.shown.clone();
            tracing::warn!(agent = agent_id, name = %a.name, "agent lost");
        }
        true
    }

    /// End the jobs of a lost agent as [`reap::decide`] says. Done when it is declared lost
    /// and, for any it still has (the store could not take the end then: a full disk, the
    /// database away), again on every reap until they are ended: a job of a dead agent never
    /// stays `running` (outsider attack: one failed write left it so until the coordinator
    /// restarted).
    async fn end_jobs_of_lost(&mut self, ends: &[reap::LostJob]) {
        for end in ends {
            let Some(j) = self.active.get(&end.job).cloned() else { continue };
            if let Some(note) = &end.log_note {
                if self.noted_lost.insert(j.id) {
                    self.note_in_log(&j, note.clone()).await;
                }
            }
            match self.finish(&j, end.state, end.reason.clone(), None, None, Vec::new()).await {
                Ok(_) => {
                    self.noted_lost.remove(&j.id);
                }
                Err(BrainError::Store(e)) if self.ended_in_store(j.id, &e).await => {
                    self.noted_lost.remove(&j.id);
                }
                Err(e) => tracing::error!(job = j.id, error = %e, "could not end a job of a lost agent; trying again"),
            }
        }
    }

    /// The agent's machine is being taken back: it takes no new job, and each job it runs is
    /// ended `lost` and queued again as its next attempt in the same commit, whatever the
    /// step's retry policy (the job did nothing wrong), until [`requeue::on_interrupted`]
    /// says it was taken back too often. Once: a notice repeated after a reconnect finds those
    /// jobs ended already. The agent is told to stop the old runs.
    pub(super) async fn agent_interrupted(&mut self, agent_id: &str, reason: String) {
        let Some(a) = self.agents.get_mut(agent_id) else { return };
        let first = a.interrupted.is_none();
        a.interrupted = Some(reason.clone());
        let name = a.name.clone();
        if first {
            tracing::warn!(agent = %name, %reason, "the agent's machine is being taken back");
        }
        let jobs: BTreeMap<JobId, JobRecord> = self.jobs_on(agent_id).map(|j| (j.id, j.clone())).collect();
        let on: Vec<requeue::OnMachine> =
            jobs.values().map(|j| requeue::OnMachine { id: j.id, state: j.state, attempt: j.attempt }).collect();
        for (id, what) in requeue::on_interrupted(&name, &reason, &on) {
            let Some(job) = jobs.get(&id) else { continue };
            match what {
                requeue::Interruption::EndLost { reason: why } => {
                    if let Err(e) = self.finish(job, JobState::Lost, why.clone(), None, None, Vec::new()).await {
                        tracing::error!(job = job.id, error = %e, "could not end a job of an interrupted machine");
                    }
                    self.send(agent_id, CoordinatorMessage::Cancel { job_id: job.id, reason: why });
                }
                requeue::Interruption::Requeue { log_note, ended, next, cancel } => {
                    self.note_in_log(job, log_note).await;
                    let now = now_ms();
                    let change = JobChange {
                        state: Some(JobState::Lost),
                        reason: Some(ended),
                        finished_at_ms: Some(now),
                        release_leases: true,
                        ..Default::default()
                    };
                    let next = next_attempt(job, next, now);
                    let expect = [JobState::Assigned, JobState::Running];
                    match self.store.update_job_and_insert(job.id, &expect, change, next).await {
                        Ok((rec, next)) => {
                            self.ready_since.remove(&rec.id);
                            self.cancelling.remove(&rec.id);
                            self.registering.remove(&rec.id);
                            self.publish(&rec);
                            self.publish(&next);
                            self.send(agent_id, CoordinatorMessage::Cancel { job_id: rec.id, reason: cancel });
                            tracing::info!(job = rec.id, next = next.id, "job on an interrupted machine queued again");
                        }
                        Err(e) => {
                            tracing::error!(job = job.id, error = %e, "could not queue again a job of an interrupted machine")
                        }
                    }
                }
            }
        }
    }
}

/// The brain's link as the reaper's decision reads it.
fn link_seen(link: Link) -> reap::Link {
    match link {
        Link::Connected => reap::Link::Connected,
        Link::Disconnected => reap::Link::Disconnected,
        Link::Lost => reap::Link::Lost,
    }
}
