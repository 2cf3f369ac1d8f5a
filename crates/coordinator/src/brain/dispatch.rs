//! The command loop: [`Brain::run`] takes the commands already waiting (up to
//! `COMMANDS_PER_PASS`), hands each to [`Brain::handle`], then stores the batch of agents'
//! events and, if something changed, runs one placement pass. `handle` stores the waiting
//! events first unless the command is one of them, then routes the [`Command`] to the part
//! of the brain that decides it.

use super::*;

impl Brain {
    /// Run until `shutdown`; then return, leaving durable state as it is.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Command>, shutdown: CancellationToken) {
        self.hearing_from_now(Instant::now());
        let mut tick = tokio::time::interval(self.timing.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.place_now().await;
        loop {
            let cmd = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => Command::Tick,
                c = rx.recv() => match c { Some(c) => c, None => break },
                // Nothing else to do: the reasons the last passes left unwritten.
                () = std::future::ready(()), if !self.untold.is_empty() => {
                    self.tell_waiting(Vec::new(), self.reasons_per_write).await;
                    continue;
                }
            };
            self.handle(cmd).await;
            // Everything already waiting first (heartbeats, results), in arrival order, at
            // most a bounded batch so a flood cannot hold placement off for ever; then one
            // placement pass for all of it.
            for _ in 0..COMMANDS_PER_PASS {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd).await,
                    Err(_) => break,
                }
            }
            self.flush_events().await;
            if std::mem::take(&mut self.schedule_due) {
                self.place_now().await;
            }
        }
        tracing::debug!("scheduler stopped");
    }

    /// From `now` on this coordinator can hear its agents: each one not connected gets its
    /// whole `lost_after` (and a takeover's longer grace) from here, not from when the state was
    /// loaded. A start-up that took long (a slow database, a starved machine) would otherwise
    /// have spent their grace before any could reconnect, and the first reap would end their
    /// running jobs `lost` (CI: a restart whose agent's reconnect waited behind that reap).
    fn hearing_from_now(&mut self, now: Instant) {
        for a in self.agents.values_mut().filter(|a| a.link != Link::Connected) {
            a.last_seen = a.last_seen.max(now);
        }
        if let Some((until, least)) = self.takeover_grace {
            self.takeover_grace = Some((until.max(now + least), least));
        }
        self.last_tick = Some(now);
    }

    async fn handle(&mut self, cmd: Command) {
        // Agents' events wait for one commit together, but never past a command that could
        // read or change what they change: commands apply in arrival order.
        if !matches!(cmd, Command::AgentStarted { .. } | Command::AgentFinished { .. } | Command::AgentSeen { .. }) {
            self.flush_events().await;
        }
        match cmd {
            Command::Submit { sub, reply } => {
                let r = self.submit(*sub).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::RunnerRegistered { job, placement, result } => {
                self.runner_registered(job, placement, result).await;
                self.schedule().await;
            }
            Command::Cancel { job, reason, reply } => {
                let r = self.cancel(job, reason).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::Retry { job, by, reply } => {
                let r = self.retry(job, &by).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::RetryFailed { pipeline, by, reply } => {
                let r = self.retry_failed(pipeline, &by).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::CancelPipeline { pipeline, reason, reply } => {
                let r = self.cancel_pipeline(pipeline, reason).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::AgentConnected { agent_id, conn, hello, tx, reply } => {
                let r = self.agent_connected(&agent_id, conn, *hello, tx).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::AgentStarted { agent_id, conn, job, started_at_ms, unenforced, reply } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    if let Some(a) = self.agents.get_mut(&agent_id) {
                        a.first_job_at_ms.get_or_insert(started_at_ms);
                    }
                    // Stored and answered with the other events of this run of commands.
                    self.batch_start(&agent_id, job, started_at_ms, unenforced, reply);
                } else {
                    let _ = reply.send(Err(STALE.into()));
                }
            }
            Command::AgentFinished { agent_id, conn, finished, reply } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    // A plain result joins the batch; any other (a retry, a requeue, a start
                    // that went missing) is applied alone, after the batch before it.
                    if let Some((finished, reply)) = self.batch_finish(&agent_id, finished, reply) {
                        self.flush_events().await;
                        let r = self.job_finished(&agent_id, finished).await;
                        let _ = reply.send(r);
                    }
                } else {
                    let _ = reply.send(Err(STALE.into()));
                }
                self.schedule().await;
            }
            Command::AgentGpus { agent_id, conn, gpus, health } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    self.apply_gpus(&agent_id, gpus, health).await;
                    self.schedule().await;
                }
            }
            Command::AgentSeen { agent_id, conn } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                }
            }
            Command::AgentPaused { agent_id, conn, reason } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    if let Some(a) = self.agents.get_mut(&agent_id) {
                        match &reason {
                            Some(why) => tracing::warn!(agent = %a.name, why, "agent takes no new jobs"),
                            None => tracing::info!(agent = %a.name, "agent takes new jobs again"),
                        }
                        a.paused = reason;
                    }
                    self.schedule().await;
                }
            }
            Command::AgentInterrupted { agent_id, conn, reason } => {
                if self.is_current(&agent_id, conn) {
                    self.touch(&agent_id);
                    self.agent_interrupted(&agent_id, reason).await;
                    self.schedule().await;
                }
            }
            Command::AgentDisconnected { agent_id, conn } => {
                if self.is_current(&agent_id, conn) {
                    self.agent_disconnected(&agent_id, "connection closed", false).await;
                }
            }
            Command::ReleaseGpu { uuid, reply } => {
                let r = self.release_gpu(&uuid).await;
                let _ = reply.send(r);
                self.schedule().await;
            }
            Command::Agents { reply } => {
                let _ = reply.send(Ok(self.agent_summaries()));
            }
            Command::FleetView { reply } => {
                let _ = reply.send(Ok(self.fleet_view()));
            }
            Command::Withdraw { agents, reason, reply } => {
                let mut gone = Vec::new();
                for id in agents {
                    let busy = self.jobs_on(&id).any(|j| j.state != JobState::Queued);
                    match self.agents.get_mut(&id) {
                        Some(_) if busy => {}
                        Some(a) => {
                            a.withdrawn = Some(reason.clone());
                            gone.push(id);
                        }
                        // Not known here (never connected, or forgotten): nothing can land on it.
                        None => gone.push(id),
                    }
                }
                let _ = reply.send(Ok(gone));
            }
            Command::Restore { agent } => {
                if let Some(a) = self.agents.get_mut(&agent) {
                    a.withdrawn = None;
                }
                self.schedule().await;
            }
            Command::MachineEnded { agent, reason } => {
                let holds = self.jobs_on(&agent).any(|j| matches!(j.state, JobState::Assigned | JobState::Running));
                if holds && self.agents.contains_key(&agent) {
                    self.agent_interrupted(&agent, reason).await;
                    self.schedule().await;
                }
            }
            Command::FleetNotes { notes, reached } => {
                let changed = notes != self.fleet_notes || reached != self.budgets_reached;
                self.fleet_notes = notes;
                if reached.is_empty() {
                    self.repository_of.clear();
                }
                self.budgets_reached = reached;
                if changed {
                    self.schedule().await;
                }
            }
            Command::AddSteps { job, file_name, source, reply } => {
                // Only while the job runs: its end (however it ends) ends its token.
                let r = match self.active.get(&job) {
                    Some(j)
                        if matches!(j.state, JobState::Assigned | JobState::Running)
                            && !self.cancelling.contains_key(&job) =>
                    {
                        let j = j.clone();
                        crate::brain::dynamic_steps::add(self.store.as_ref(), &j, &file_name, &source).await
                    }
                    _ => Err(crate::brain::dynamic_steps::AddError::NotRunning(job)),
                };
                if let Ok(jobs) = &r {
                    for j in jobs {
                        self.publish(j);
                    }
                    tracing::info!(job, added = jobs.len(), file = %file_name, "steps added by a running job");
                    self.schedule().await;
                }
                let _ = reply.send(r);
            }
            Command::Tick => {
                self.reap().await;
            }
        }
    }
}
