//! Agents and their links: settling an agent's jobs when it connects ([`reconcile`]),
//! GPU health and release, disconnects, the reaper that declares silent agents lost (allowing
//! for the coordinator's own stalls, [`heard_after_stall`]), and machines being taken back.

use super::*;

/// What to do with an agent's jobs when it connects: [`reconcile`]'s answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Ours and held by the agent: its events (start, output, result) will follow.
    pub keep: Vec<JobId>,
    /// Held by the agent but not (or no longer) ours: it is told why and stops them.
    pub forget: Vec<JobId>,
    /// Assigned to it, never received: back to the queue.
    pub requeue: Vec<JobId>,
    /// Running on it by our record (or assigned, when its journal is incomplete), unknown to
    /// it: ended `lost`.
    pub lost: Vec<JobId>,
}

/// Settle an agent's jobs on connect. `ours`: the active jobs assigned to it, with their
/// state; `holds`: the jobs it holds (its journal: received and not yet acknowledged as
/// finished). The agent journals an assignment before starting it, so a job it does not hold
/// never started there and may be handed out again; one we had recorded as running, it must
/// have lost (its data dir was replaced). When the agent says its journal may lack records
/// (`journal_incomplete`), a job it does not hold may have started there all the same: lost
/// too, never handed out again as if it had not run.
pub fn reconcile(ours: &[(JobId, JobState)], holds: &[JobId], journal_incomplete: bool) -> Reconciled {
    let held: BTreeSet<JobId> = holds.iter().copied().collect();
    let mine: BTreeSet<JobId> = ours.iter().map(|(id, _)| *id).collect();
    let mut r = Reconciled { forget: held.difference(&mine).copied().collect(), ..Default::default() };
    for (id, state) in ours {
        match (held.contains(id), state) {
            (true, _) => r.keep.push(*id),
            (false, JobState::Assigned) if !journal_incomplete => r.requeue.push(*id),
            (false, _) => r.lost.push(*id),
        }
    }
    r
}

/// When an agent counts as last heard after the coordinator did not run for `stall` (SIGSTOP,
/// a paused VM, a blocked disk): moved forward by the time it was not running, less the one
/// tick it would have waited anyway, never past `now`. A coordinator that did not run heard
/// nobody, however faithfully its agents sent heartbeats; counting that time declared every
/// healthy agent lost the moment it ran again (outsider attack: a 15 s stall with
/// `lost_after` 10 s ended every running job `lost`). Moving, not resetting: silence adds up
/// across stalls, so a coordinator that stalls again and again still finds a dead agent lost
/// after `lost_after` of its own running time (resetting gave it a fresh `lost_after` at
/// every stall, and its jobs stayed `running` for ever).
pub fn heard_after_stall(last_seen: Instant, stall: Duration, tick: Duration, now: Instant) -> Instant {
    last_seen.checked_add(stall.saturating_sub(tick)).map_or(now, |t| t.min(now))
}

/// Whether the reaper's timer came this late: the coordinator was not running in between.
/// A tick that is late by less than a second (a slow store write, a loaded host) is not a
/// stall; heartbeats keep coming through those.
pub fn stalled(previous_tick: Instant, now: Instant, tick: Duration) -> bool {
    now.saturating_duration_since(previous_tick) > 2 * tick + Duration::from_secs(1)
}

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
        let ours: Vec<(JobId, JobState)> =
            self.active.values().filter(|j| j.agent_id.as_deref() == Some(agent_id)).map(|j| (j.id, j.state)).collect();
        let holds: Vec<JobId> = hello.running.clone();
        let plan = reconcile(&ours, &holds, hello.journal_incomplete.is_some());
        // Applied before the welcome: an agent that was welcomed after saying its journal was
        // incomplete forgets that it was, so what it changes must be committed by then.
        for id in plan.requeue {
            // Never received (the agent journals an assignment before starting it), so it never
            // ran: safe to hand out again.
            let rec = self
                .store
                .update_job(
                    id,
                    &[JobState::Assigned],
                    JobChange {
                        state: Some(JobState::Queued),
                        reason: Some(format!("requeued: agent {} reconnected without having received it", hello.name)),
                        clear_assignment: true,
                        ..Default::default()
                    },
                )
                .await?;
            self.publish(&rec);
        }
        for id in plan.lost {
            let Some(j) = self.active.get(&id).cloned() else { continue };
            let why = match &hello.journal_incomplete {
                Some(gap) => format!(
                    "agent {} came back saying {gap}; it may have received and started this job, so it is not \
                     handed out again as never received; the job's outcome and any output not yet received are unknown",
                    hello.name
                ),
                None => format!(
                    "agent {} came back without any record of this job (its data dir was lost or replaced); \
                     the job's outcome and any output not yet received are unknown",
                    hello.name
                ),
            };
            self.note_in_log(&j, format!("output may be missing from here on: {why}")).await;
            self.finish(&j, JobState::Lost, why, None, None, Vec::new()).await?;
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

    /// Timer work: queue timeouts, silent agents, lost agents.
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
        if self.store_deaf && !self.store_hears_again().await {
            // Still no writes: nobody's silence counts (queue timeouts wait too: they are writes).
            return;
        }
        // Silent but connected → drop the connection; away too long → lost.
        let ids: Vec<String> = self.agents.keys().cloned().collect();
        let mut lost_any = false;
        for id in ids {
            let (link, age) = {
                let a = &self.agents[&id];
                (a.link, now.saturating_duration_since(a.last_seen))
            };
            if link == Link::Connected && age > self.timing.lost_after {
                // Silent for `lost_after`: that is lost, now, not after another `lost_after`.
                self.agent_disconnected(&id, "missed heartbeats", true).await;
            }
            let a = &self.agents[&id];
            if a.link == Link::Disconnected && now.saturating_duration_since(a.last_seen) > self.timing.lost_after {
                self.agent_lost(&id).await;
                lost_any = true;
            } else if a.link == Link::Lost && self.active.values().any(|j| j.agent_id.as_deref() == Some(id.as_str())) {
                let (name, secs) = (a.name.clone(), (now_wall - a.last_seen_ms).max(0) / 1000);
                self.end_jobs_of_lost(&id, &name, secs).await;
                lost_any = true;
            }
        }
        // Queue timeouts.
        let expired: Vec<JobRecord> = self
            .active
            .values()
            .filter(|j| j.state == JobState::Queued)
            .filter(|j| {
                self.ready_since
                    .get(&j.id)
                    .is_some_and(|t| now_wall - t > j.step.effective_queue_timeout().as_millis() as i64)
            })
            .cloned()
            .collect();
        for j in &expired {
            let why = format!("still queued after queue_timeout {}: {}", j.step.effective_queue_timeout(), j.reason);
            if let Err(e) = self.finish(j, JobState::TimedOut, why, None, None, Vec::new()).await {
                tracing::error!(job = j.id, error = %e, "could not time out job");
            }
        }
        if lost_any || !expired.is_empty() {
            self.schedule().await;
        }
    }

    async fn agent_lost(&mut self, agent_id: &str) {
        let (name, secs) = {
            let a = &self.agents[agent_id];
            (a.name.clone(), (now_ms() - a.last_seen_ms).max(0) / 1000)
        };
        let update = AgentUpdate {
            state: Some("lost".into()),
            reason: Some(format!("no heartbeat for {secs}s")),
            ..Default::default()
        };
        if let Err(e) = self.store.update_agent(agent_id, update).await {
            // The store takes no writes, so the coordinator cannot hear its agents either:
            // their events cannot be stored and their connections are closed to have them sent
            // again. Their silence is not theirs (see `store_deaf`).
            if !self.store_deaf {
                tracing::warn!(error = %e, "the store takes no writes: no agent is declared lost until it does, and then each gets lost_after to be heard");
            }
            self.store_deaf = true;
            return;
        }
        self.unsaved_links.remove(agent_id);
        if let Some(a) = self.agents.get_mut(agent_id) {
            a.link = Link::Lost;
            a.reason = format!("lost: no heartbeat for {secs}s");
        }
        tracing::warn!(agent = agent_id, name = %name, "agent lost");
        self.end_jobs_of_lost(agent_id, &name, secs).await;
    }

    /// End the jobs of a lost agent. Called when it is declared lost and, for any it still
    /// has (the store could not take the end then: a full disk, the database away), again on
    /// every reap until they are ended: a job of a dead agent never stays `running`
    /// (outsider attack: one failed write left it so until the coordinator restarted).
    async fn end_jobs_of_lost(&mut self, agent_id: &str, name: &str, secs: i64) {
        let jobs: Vec<JobRecord> =
            self.active.values().filter(|j| j.agent_id.as_deref() == Some(agent_id)).cloned().collect();
        for j in jobs {
            let why = match self.cancelling.get(&j.id) {
                Some(r) => r.clone(),
                None => format!(
                    "agent {name} stopped sending heartbeats (last seen {secs}s ago); the job's outcome is unknown"
                ),
            };
            let state = if self.cancelling.contains_key(&j.id) { JobState::Cancelled } else { JobState::Lost };
            if state == JobState::Lost && self.noted_lost.insert(j.id) {
                self.note_in_log(&j, format!("output may be missing from here on: {why}")).await;
            }
            match self.finish(&j, state, why, None, None, Vec::new()).await {
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
    /// step's retry policy (the job did nothing wrong). Once: a notice repeated after a
    /// reconnect finds those jobs ended already. The agent is told to stop the old runs.
    pub(super) async fn agent_interrupted(&mut self, agent_id: &str, reason: String) {
        let Some(a) = self.agents.get_mut(agent_id) else { return };
        let first = a.interrupted.is_none();
        a.interrupted = Some(reason.clone());
        let name = a.name.clone();
        if first {
            tracing::warn!(agent = %name, %reason, "the agent's machine is being taken back");
        }
        let jobs: Vec<JobRecord> = self
            .active
            .values()
            .filter(|j| j.agent_id.as_deref() == Some(agent_id))
            .filter(|j| matches!(j.state, JobState::Assigned | JobState::Running))
            .cloned()
            .collect();
        for job in jobs {
            let now = now_ms();
            let why = format!("lost: machine {name} is being taken back ({reason})");
            // A job taken back again and again (a spot market in a storm, a notice that comes
            // and goes) stops being queued again at some point, saying so.
            if job.attempt >= MAX_INTERRUPTED_ATTEMPTS {
                let why = format!("{why}; not queued again: this was attempt {}", job.attempt);
                if let Err(e) = self.finish(&job, JobState::Lost, why.clone(), None, None, Vec::new()).await {
                    tracing::error!(job = job.id, error = %e, "could not end a job of an interrupted machine");
                }
                self.send(agent_id, CoordinatorMessage::Cancel { job_id: job.id, reason: why });
                continue;
            }
            self.note_in_log(&job, format!("{why}; this run is stopped and the job queued again")).await;
            let change = JobChange {
                state: Some(JobState::Lost),
                reason: Some(format!("{why}; queued again as attempt {}", job.attempt + 1)),
                finished_at_ms: Some(now),
                release_leases: true,
                ..Default::default()
            };
            let next =
                next_attempt(&job, format!("queued again: job {} was on a machine being taken back", job.id), now);
            match self.store.update_job_and_insert(job.id, &[JobState::Assigned, JobState::Running], change, next).await
            {
                Ok((rec, next)) => {
                    self.ready_since.remove(&rec.id);
                    self.cancelling.remove(&rec.id);
                    self.registering.remove(&rec.id);
                    self.publish(&rec);
                    self.publish(&next);
                    self.send(agent_id, CoordinatorMessage::Cancel { job_id: rec.id, reason: why.clone() });
                    tracing::info!(job = rec.id, next = next.id, "job on an interrupted machine queued again");
                }
                Err(e) => {
                    tracing::error!(job = job.id, error = %e, "could not queue again a job of an interrupted machine")
                }
            }
        }
    }
}
