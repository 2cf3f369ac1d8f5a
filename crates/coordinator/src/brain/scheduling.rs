//! The placement pass: the hosts as placement sees them, one pass over the queue
//! ([`Brain::place_now`]) whose assignments are stored in one transaction and sent only after
//! it commits ([`Brain::commit_placements`]), repository budgets, and Actions runner
//! registrations of placed runner jobs.

use super::*;

impl Brain {
    /// Host views of connected agents, with GPU lease and quarantine state.
    fn hosts(&self) -> (Vec<HostView>, Vec<String>) {
        // The GPUs leased and each agent's slots in use, from the jobs given to agents
        // (`on_agent`): a queued job holds neither. Walking every active job instead (twice)
        // was most of a pass with 100,000 queued; counting agent by agent over every active
        // job, most of one at 2,000 agents (BENCHMARKS.md, "The coordinator under load").
        let mut leased: HashMap<&str, JobId> = HashMap::new();
        let mut busy: HashMap<&str, u32> = HashMap::new();
        for (agent, ids) in &self.on_agent {
            for j in ids.iter().filter_map(|id| self.active.get(id)).filter(|j| j.state != JobState::Queued) {
                *busy.entry(agent.as_str()).or_default() += 1;
                leased.extend(j.gpus.iter().map(|g| (g.as_str(), j.id)));
            }
        }
        let mut ids = Vec::new();
        let mut hosts = Vec::new();
        for a in self.agents.values().filter(|a| a.link == Link::Connected) {
            let busy = busy.get(a.id.as_str()).copied().unwrap_or(0);
            let gpus = a
                .gpus
                .iter()
                .map(|g| {
                    let state = if let Some(q) = self.quarantine.get(&g.uuid) {
                        GpuSlotState::Quarantined { reason: q.reason.clone() }
                    } else if let Some(GpuHealth::Unhealthy { reason }) = a.health.get(&g.uuid) {
                        GpuSlotState::Quarantined { reason: reason.clone() }
                    } else if let Some(j) = leased.get(g.uuid.as_str()) {
                        GpuSlotState::Leased { job_id: j.to_string() }
                    } else {
                        GpuSlotState::Free
                    };
                    GpuSlot { info: g.clone(), state }
                })
                .collect();
            let mut tags = a.tags.clone();
            // Agents no fleet made, so that a job held off fleet machines can ask for one.
            tags.entry(gpuci_providers::TAG_FLEET.to_string()).or_insert_with(|| NOT_A_FLEET_MACHINE.to_string());
            hosts.push(HostView {
                agent_id: a.id.clone(),
                name: a.name.clone(),
                tags,
                free_slots: if a.paused.is_some() || a.interrupted.is_some() || a.withdrawn.is_some() {
                    0
                } else {
                    a.slots.saturating_sub(busy)
                },
                total_slots: a.slots,
                container_runtime: a.container_runtime.is_some(),
                gpus,
                ends_at_ms: a.ends_at_ms,
                // No slot at all is never "busy": placement names the agent and why. An agent
                // older than the `refuses` field is described by its isolation line. Nor is
                // an agent that takes no jobs for now (paused by itself, its machine
                // interrupted or withdrawn): waiting for its jobs to end frees nothing.
                refuses: (a.slots == 0)
                    .then(|| a.refuses.clone().unwrap_or_else(|| format!("it offers no job slots ({})", a.isolation)))
                    .or_else(|| a.paused.as_ref().map(|why| format!("it is paused ({why})")))
                    .or_else(|| a.interrupted.as_ref().map(|why| format!("its machine is being interrupted ({why})")))
                    .or_else(|| a.withdrawn.as_ref().map(|why| format!("its machine is being withdrawn ({why})"))),
            });
            ids.push(a.id.clone());
        }
        (hosts, ids)
    }

    /// One scheduling pass: skip what can never run, place what fits, explain the rest.
    /// Asks for a placement pass: it runs once the commands already waiting are handled.
    pub(super) async fn schedule(&mut self) {
        self.schedule_due = true;
    }

    /// A placement pass: every queued job placed where it fits, or told why it waits.
    pub(super) async fn place_now(&mut self) {
        let began = std::time::Instant::now();
        self.note_group_scopes().await;
        // Skips cascade through depends_on; repeat until nothing changes.
        let groups = loop {
            let groups = self.group_index();
            // Only jobs looked at one by one can be blocked (`brain/queue.rs`).
            let skips: Vec<(JobRecord, String)> = self
                .queue
                .each()
                .filter_map(|id| self.active.get(&id))
                .filter_map(|j| match self.blocked(j, &groups) {
                    Some(Err(why)) => Some((j.clone(), why)),
                    _ => None,
                })
                .collect();
            if skips.is_empty() {
                break groups;
            }
            for (j, why) in skips {
                if let Err(e) = self.finish(&j, JobState::Skipped, why, None, None, Vec::new()).await {
                    tracing::error!(job = j.id, error = %e, "could not skip job");
                }
            }
        };
        let skipped_at = began.elapsed();
        let (hosts, ids) = self.hosts();
        // The indexed cluster answers each job without scanning every host; it is rebuilt per
        // pass from live state, so it can never drift from it.
        let mut cluster = placement::Cluster::new(hosts);
        // Ids, not records: a pass over 100,000 queued jobs cloned every record (BENCHMARKS.md,
        // "The coordinator under load"); a record is cloned only to be placed or to change.
        // The jobs taken one by one: those the queue keeps so, those with a fleets' note, and
        // every job while a repository's budget is reached (what a job may use then depends on
        // its repository). The others are taken by shape, as batches.
        let batched = self.budgets_reached.is_empty();
        let mut queued: Vec<JobId> = self.queue.each().collect();
        let notes_before = queued.len();
        match batched {
            true => queued.extend(self.fleet_notes.keys().copied().filter(|id| self.queue.bucketed(*id))),
            false => queued.extend(self.queue.buckets().flat_map(|(_, b)| b.jobs.iter().copied())),
        }
        if queued.len() > notes_before {
            queued.sort_unstable();
        }
        let batch_ids: Vec<(u64, Vec<JobId>)> = match batched {
            true => self
                .queue
                .buckets()
                .map(|(b, bucket)| {
                    let ids = bucket.jobs.iter().copied().filter(|id| !self.fleet_notes.contains_key(id)).collect();
                    (b, ids)
                })
                .filter(|(_, ids): &(u64, Vec<JobId>)| !ids.is_empty())
                .collect(),
            false => Vec::new(),
        };
        let now = now_ms();
        // Why each job waits, written in one transaction at the end of the pass.
        let mut reasons: Vec<(JobId, String)> = Vec::new();
        // This pass's assignments, stored in one transaction before any is sent.
        let mut placed: Vec<Placed> = Vec::new();
        // Pipelines read this pass (a pipeline's steps are placed one after another).
        let mut pipelines: HashMap<PipelineId, PipelineRecord> = HashMap::new();
        // Where the pipelines of jobs with secrets came from, and the stored secrets' names:
        // read at most once a pass.
        let mut sources: HashMap<PipelineId, gpuci_core::secret_scope::JobSource> = HashMap::new();
        let mut stored_secrets: Option<secrets::StoredSecrets> = None;
        // Vetted jobs that left the queue.
        if self.secrets_vetted.len() > 2 * self.queue.len() + 1024 {
            let active = &self.active;
            self.secrets_vetted.retain(|id, _| active.get(id).is_some_and(|j| j.state == JobState::Queued));
        }
        // What the pass needs to know of each job that takes the store to learn: whether its
        // repository's budget holds it off fleet machines, what blocks it, and whether it may
        // have the secrets it names (one that may not ends now).
        let mut ready: Vec<Ready> = Vec::with_capacity(queued.len());
        for id in queued {
            // One look-up per job when no budget is reached (the common case).
            let held = match self.budgets_reached.is_empty() {
                true => false,
                false => match self.active.get(&id) {
                    Some(j) => {
                        let j = j.clone();
                        self.budget_held(&j).await
                    }
                    None => continue,
                },
            };
            let Some(j) = self.active.get(&id) else { continue };
            let blocked = match self.blocked(j, &groups) {
                Some(Ok(why)) | Some(Err(why)) => Some(why),
                None => None,
            };
            let stand_in = stand_in_tags(j, held);
            // A job that names secrets is vetted even when it cannot be placed now: one that
            // may not have them ends at once. The names are read once a pass, and a job
            // vetted under the same names is not vetted again (`brain/secrets.rs`).
            if blocked.is_none() && names_secrets(j) {
                if stored_secrets.is_none() {
                    match self.stored_secrets().await {
                        Ok(s) => stored_secrets = Some(s),
                        Err(e) => {
                            tracing::error!(job = id, error = %e, "could not read secrets");
                            continue;
                        }
                    }
                }
                let Some(stored) = stored_secrets.as_ref() else { continue };
                let Some(j) = self.active.get(&id) else { continue };
                if self.secrets_vetted.get(&id).is_none_or(|(fingerprint, _)| *fingerprint != stored.fingerprint) {
                    let source = match self.job_source(&mut sources, j).await {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::error!(job = id, error = %e, "could not read the job's pipeline");
                            continue;
                        }
                    };
                    match self.vet_secrets(j, &source, stored) {
                        Ok(given) => {
                            self.secrets_vetted.insert(id, (stored.fingerprint, given));
                        }
                        Err(why) => {
                            let j = j.clone();
                            if let Err(e) = self.finish(&j, JobState::Failed, why, None, None, Vec::new()).await {
                                tracing::error!(job = j.id, error = %e, "could not fail job");
                            }
                            continue;
                        }
                    }
                }
            }
            ready.push((id, held, blocked, stand_in));
        }
        let ready_at = began.elapsed();
        // A waiting job's counts ("7 matching GPUs are leased") are given again at most every
        // `REASON_COUNTS_EVERY_MS`; changed words at once (`placement::pass::Counts`).
        let counts = match now.saturating_sub(self.counts_refreshed_ms) >= REASON_COUNTS_EVERY_MS {
            true => {
                self.counts_refreshed_ms = now;
                placement::pass::Counts::Refresh
            }
            false => placement::pass::Counts::Keep,
        };
        // The pass itself decides (`gpuci_core::placement::pass`, pure); what follows applies.
        let decisions = {
            let candidates = ready.iter_mut().filter_map(|(id, held, blocked, stand_in)| {
                let (id, held) = (*id, *held);
                let j = self.active.get(&id)?;
                Some(placement::pass::Candidate {
                    id,
                    needs: Needs {
                        tags: stand_in.as_ref().unwrap_or(&j.step.agents),
                        gpu: &j.step.gpu,
                        container: j.step.image.is_some(),
                        deadline: job_deadline(j.step.timeout, now),
                    },
                    blocked: blocked.take(),
                    group: self.group_of(j),
                    told: &j.reason,
                    fleet_note: self.fleet_notes.get(&id).map(String::as_str),
                    held,
                })
            });
            let batches: Vec<placement::pass::Batch<'_>> = batch_ids
                .iter()
                .filter_map(|(b, ids)| {
                    let shape = &self.queue.bucket(*b)?.shape;
                    let needs = Needs {
                        tags: &shape.tags,
                        gpu: &shape.gpu,
                        container: shape.container,
                        deadline: job_deadline(shape.timeout, now),
                    };
                    Some(placement::pass::Batch { needs, ids })
                })
                .collect();
            // `batches` and `batch_ids` agree index for index: a bucket is never gone mid-pass.
            debug_assert_eq!(batches.len(), batch_ids.len());
            placement::pass::pass_batched(&mut cluster, candidates, &batches, explain_unplaced, counts)
        };
        let passed_at = began.elapsed();
        let mut unplaceable = queue::Waiting::default();
        for decision in decisions {
            let (id, placement) = match decision {
                placement::pass::Decision::BatchWaits { batch, from, reason } => {
                    let (b, ids) = &batch_ids[batch];
                    unplaceable.batches.push(self.batch_waits(*b, &ids[from..], reason, counts, now, &mut reasons));
                    continue;
                }
                placement::pass::Decision::Waits { id, reason } => {
                    self.ready_since.remove(&id);
                    if let Some(why) = reason {
                        reasons.push((id, why));
                    }
                    continue;
                }
                placement::pass::Decision::Unplaced { id, reason } => {
                    self.ready_since.entry(id).or_insert(now);
                    unplaceable.each.insert(id);
                    if let Some(why) = reason {
                        reasons.push((id, why));
                    }
                    continue;
                }
                placement::pass::Decision::Placed { id, placement } => (id, placement),
            };
            self.ready_since.entry(id).or_insert(now);
            let Some(j) = self.active.get(&id).cloned() else { continue };
            let agent_id = ids[placement.host].clone();
            tracing::debug!(job = j.id, agent = %agent_id, free_slots = cluster.hosts()[placement.host].free_slots, "placed");
            // Its secrets are opened now that it has a place, not while it waits.
            let (secrets, given) = match self.secrets_vetted.get(&id) {
                Some((_, given)) if names_secrets(&j) => {
                    let given = given.clone();
                    let source = match self.job_source(&mut sources, &j).await {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::error!(job = id, error = %e, "could not read the job's pipeline");
                            continue;
                        }
                    };
                    match self.open_secrets(&j, &given, &source).await {
                        Ok(values) => (values, given),
                        Err(secrets::NotOpened::Wait(why)) => {
                            // The place it was given goes to another job at the next pass,
                            // which comes at once.
                            self.schedule_due = true;
                            note_reason(&mut reasons, &j, why);
                            continue;
                        }
                        Err(secrets::NotOpened::Fail(why)) => {
                            tracing::warn!(job = j.id, reason = %why, "job failed: a secret does not open");
                            if let Err(e) = self.finish(&j, JobState::Failed, why, None, None, Vec::new()).await {
                                tracing::error!(job = j.id, error = %e, "could not fail job");
                            }
                            self.schedule_due = true;
                            continue;
                        }
                    }
                }
                _ => (BTreeMap::new(), Vec::new()),
            };
            let pipeline = match pipelines.get(&j.pipeline_id) {
                Some(p) => Ok(Some(p.clone())),
                None => self.store.get_pipeline(j.pipeline_id).await.inspect(|p| {
                    if let Some(p) = p {
                        pipelines.insert(p.id, p.clone());
                    }
                }),
            };
            let (workspace_upload, cache, origin, trusted, repository) = match pipeline {
                Ok(Some(p)) => {
                    let origin = Origin::parse(p.origin.as_deref());
                    // Caches by repository and trust class: what may be restored and where
                    // the job saves is the core's rule (`cache::scope`). Keyed by the
                    // repository's identity with its host: two spellings of one remote share
                    // a cache, two hosts never do, and a remote that names no repository
                    // unambiguously gets none.
                    let repository =
                        crate::repos::name_of_pipeline(p.repository.as_deref(), p.origin.as_deref(), &self.github_host);
                    let cache = match (&repository, Origin::cache_origin(p.origin.as_deref())) {
                        (Some(repository), Some(o)) if !j.step.cache.is_empty() => {
                            gpuci_core::cache::scope(repository, &o)
                        }
                        _ => gpuci_core::cache::CacheScope::none(),
                    };
                    let trusted =
                        gpuci_core::trust::may_run_unsandboxed(Origin::cache_origin(p.origin.as_deref()).as_ref());
                    // The agent's tenant (who may share a host with a job outside the
                    // sandbox): the identity, else the remote as given, never merged with
                    // pipelines that name no repository.
                    let tenant = repository.or(p.repository);
                    (p.workspace_upload, cache, origin, trusted, tenant)
                }
                Ok(None) => (None, gpuci_core::cache::CacheScope::none(), None, false, None),
                Err(e) => {
                    tracing::error!(job = j.id, error = %e, "could not read the job's pipeline");
                    continue;
                }
            };
            // The audit record of which secrets (names and scopes, never values) this run is
            // given, in the job's log, before the agent's lines.
            if !given.is_empty() {
                let list: Vec<String> = given
                    .iter()
                    .map(|(n, scope)| match j.step.encrypted_secrets.contains_key(n) {
                        true => format!("{n} (encrypted in the pipeline for {scope})"),
                        false => format!("{n} (scope: {scope})"),
                    })
                    .collect();
                self.note_in_log(&j, format!("secrets given to this run: {}", list.join(", "))).await;
            }
            // Its job token (`crate::brain::dynamic_steps`), stored as a hash with the
            // assignment, and given as a secret: the job's log masks it.
            let mut secrets = secrets;
            let mut token_sha256 = None;
            if !matches!(origin, Some(Origin::ActionsRunner(_))) {
                let (token, sha256) = crate::brain::dynamic_steps::new_token();
                secrets.insert(crate::brain::dynamic_steps::JOB_TOKEN_ENV.to_string(), token);
                token_sha256 = Some(sha256);
            }
            placed.push(Placed {
                agent_id,
                gpus: placement.gpus,
                job: j,
                secrets,
                workspace_upload,
                cache,
                origin,
                trusted,
                repository,
                // Set below, for the whole pass at once.
                log_from: 1,
                token_sha256,
            });
        }
        // A requeued job keeps its log (and the lines noted above are in it): this run's lines
        // are numbered after it. One read for the pass; if it fails, nothing is placed now.
        let ids: Vec<JobId> = placed.iter().map(|p| p.job.id).collect();
        let decided = began.elapsed();
        let last = if ids.is_empty() { Ok(HashMap::new()) } else { self.store.last_log_lines(&ids).await };
        match last {
            Ok(last) => {
                for p in &mut placed {
                    p.log_from = last.get(&p.job.id).map_or(1, |l| *l as u64 + 1);
                }
                self.commit_placements(placed, &mut reasons).await;
            }
            Err(e) => {
                tracing::error!(jobs = ids.len(), error = %e, "could not read the placed jobs' logs; they wait for the next pass")
            }
        }
        // A pass that placed jobs tells few: its placements' agents wait for the next pass.
        let limit = match ids.is_empty() {
            true => self.reasons_per_write,
            false => (self.reasons_per_write / PLACING_PASS_TELLS_LESS).max(1),
        };
        let told = self.tell_waiting(reasons, limit).await;
        if let Some(wake) = &self.fleet_wake {
            if unplaceable.grew_from(&self.unplaceable) {
                wake.notify_one();
            }
        }
        tracing::debug!(
            target: "gpuci::pass",
            unplaced = unplaceable.each.len(),
            batches_waiting = unplaceable.batches.len(),
            placed = ids.len(),
            told,
            skips_ms = skipped_at.as_secs_f64() * 1e3,
            ready_ms = ready_at.as_secs_f64() * 1e3,
            pass_ms = passed_at.as_secs_f64() * 1e3,
            decided_ms = decided.as_secs_f64() * 1e3,
            total_ms = began.elapsed().as_secs_f64() * 1e3,
            "placement pass"
        );
        self.unplaceable = unplaceable;
    }

    /// A bucket's jobs from `ids[0]` on wait for `reason` (a pass found no place for their
    /// shape): the jobs that must hear it are told (all of them when the words changed or
    /// counts are refreshed, else only those not told yet: `brain/queue.rs`). Returns what
    /// the fleets see of them.
    fn batch_waits(
        &mut self,
        b: u64,
        ids: &[JobId],
        reason: String,
        counts: placement::pass::Counts,
        now: i64,
        reasons: &mut Vec<(JobId, String)>,
    ) -> (u64, JobId, u64) {
        let Some(bucket) = self.queue.bucket_mut(b) else { return (b, JobId::MAX, 0) };
        let from = ids.first().copied().unwrap_or(JobId::MAX);
        let all = counts == placement::pass::Counts::Refresh
            || !bucket.said.as_deref().is_some_and(|s| placement::pass::same_but_numbers(s, &reason));
        let visit: Vec<JobId> = match all {
            true => ids.to_vec(),
            false => bucket.fresh.range(from..).copied().filter(|id| ids.binary_search(id).is_ok()).collect(),
        };
        for id in &visit {
            bucket.fresh.remove(id);
        }
        bucket.said = Some(reason.clone());
        let added = bucket.added;
        for id in visit {
            let Some(j) = self.active.get(&id) else { continue };
            self.ready_since.entry(id).or_insert(now);
            if placement::pass::tell(&j.reason, &reason, counts) {
                reasons.push((id, reason.clone()));
            }
        }
        (b, from, added)
    }

    /// Why jobs wait: `reasons` join those not yet written (a job's newer reason replaces its
    /// older one), and at most `limit` of them, oldest job first, are written now in one
    /// statement; the rest are written by the next passes, or by the command loop when
    /// it has nothing else to do (`dispatch.rs`). A pass that must tell 92,000 jobs new
    /// counts held every placement back 0.5–1.2 s while it wrote them all (BENCHMARKS.md,
    /// "Queued jobs by shape"). A job placed, cancelled or ended meanwhile is not told: the
    /// store, too, writes a reason only over a queued job's. Returns how many were written.
    pub(super) async fn tell_waiting(&mut self, reasons: Vec<(JobId, String)>, limit: usize) -> usize {
        self.untold.extend(reasons);
        let mut chunk = Vec::with_capacity(self.untold.len().min(limit));
        while chunk.len() < limit {
            let Some((id, why)) = self.untold.pop_first() else { break };
            if self.active.get(&id).is_some_and(|j| j.state == JobState::Queued && j.reason != why) {
                chunk.push((id, why));
            }
        }
        let told = chunk.len();
        if !chunk.is_empty() {
            match self.store.set_reasons(&chunk).await {
                Ok(()) => self.told(chunk),
                // Not written again until its words change or counts are refreshed: a store
                // that is down is not asked again for each of them.
                Err(e) => tracing::error!(jobs = told, error = %e, "could not record why jobs wait"),
            }
        }
        told
    }

    /// The store refused an assignment because the job is assigned there while this
    /// coordinator holds it queued: an earlier pass's commit went through though its answer
    /// was lost (the connection dropped during COMMIT), so that assignment was never sent and
    /// the job never ran. It goes back to the queue in the store, its leases released, to be
    /// placed again; before, every later pass was refused and the job never ran (outsider
    /// attack).
    /// Found in another state (cancelled or timed out in the queue by a commit whose answer
    /// was lost), the stored record is taken ([`Brain::take_stored`]).
    async fn assigned_unconfirmed(&mut self, id: JobId, e: &StoreError) {
        let (StoreError::Conflict { found: JobState::Assigned, .. }, Some(JobState::Queued)) =
            (e, self.active.get(&id).map(|j| j.state))
        else {
            // The place it was given goes to another job at the next pass.
            self.schedule_due = true;
            self.take_stored(id, e).await;
            return;
        };
        let change = JobChange {
            state: Some(JobState::Queued),
            reason: Some(
                "queued again: an earlier assignment was stored but its commit was never confirmed, so it was never sent"
                    .to_string(),
            ),
            clear_assignment: true,
            ..Default::default()
        };
        match self.store.update_job(id, &[JobState::Assigned], change).await {
            Ok(rec) => {
                tracing::warn!(
                    job = id,
                    "an assignment stored without confirmation was never sent; the job is queued again"
                );
                self.publish(&rec);
                self.schedule_due = true;
            }
            Err(e) => {
                tracing::error!(job = id, error = %e, "could not queue again a job whose assignment was never sent")
            }
        }
    }

    /// Group commit of a placement pass: every assignment is stored in one transaction, with
    /// its job token's hash, and only after it commits is any sent (an assignment is never
    /// sent before it is durable, and a job never holds a token the store does not know).
    /// If the commit fails, nothing is sent, the jobs stay queued (saying why) and the next
    /// pass places them again.
    async fn commit_placements(&mut self, placed: Vec<Placed>, reasons: &mut Vec<(JobId, String)>) {
        if placed.is_empty() {
            return;
        }
        let batch: Vec<NewAssignment> = placed
            .iter()
            .map(|p| NewAssignment {
                job: p.job.id,
                agent_id: p.agent_id.clone(),
                agent_name: self.agents.get(&p.agent_id).map_or_else(|| p.agent_id.clone(), |a| a.name.clone()),
                gpus: p.gpus.clone(),
                token_sha256: p.token_sha256.clone(),
            })
            .collect();
        let began = std::time::Instant::now();
        let at = now_ms();
        let results = match self.store.assign_jobs(&batch, at).await {
            Ok(results) => results,
            Err(e) => {
                tracing::error!(jobs = batch.len(), error = %e, "could not store a placement pass's assignments; none sent");
                for p in placed {
                    let name = self.agents.get(&p.agent_id).map_or(p.agent_id.as_str(), |a| a.name.as_str());
                    let why = format!(
                        "waiting: placed on {name}, but the assignment could not be stored ({}); placing again",
                        e.reason()
                    );
                    note_reason(reasons, &p.job, why);
                }
                // Not before the next command or tick: a store that stays down is not hammered.
                self.schedule_due = true;
                return;
            }
        };
        let stored = began.elapsed();
        let count = placed.len();
        for ((placed, result), assigned) in placed.into_iter().zip(results).zip(&batch) {
            let Placed {
                agent_id, secrets, workspace_upload, cache, origin, trusted, repository, log_from, job, ..
            } = placed;
            let rec = match result {
                // The store wrote exactly this (`NewAssignment::applied_to`): nothing to read back.
                Ok(()) => assigned.applied_to(&job, at),
                Err(e) => {
                    tracing::error!(job = job.id, error = %e, "could not assign job");
                    self.assigned_unconfirmed(job.id, &e).await;
                    continue;
                }
            };
            self.publish(&rec);
            let mut env = rec.env.clone();
            env.insert("GPUCI".into(), "true".into());
            env.insert("GPUCI_JOB_ID".into(), rec.id.to_string());
            env.insert("GPUCI_PIPELINE_ID".into(), rec.pipeline_id.to_string());
            env.insert("GPUCI_STEP_KEY".into(), rec.step.key.clone());
            env.insert("GPUCI_ATTEMPT".into(), rec.attempt.to_string());
            let runner = match origin {
                Some(Origin::ActionsRunner(r)) => Some(r),
                _ => None,
            };
            let assignment = Assignment {
                job_id: rec.id,
                pipeline_id: rec.pipeline_id,
                name: rec.step.display_name().to_string(),
                step: rec.step.clone(),
                env,
                gpus: rec.gpus.clone(),
                secrets: gpuci_protocol::agent::SecretValues(secrets),
                workspace_upload: workspace_upload.clone(),
                cache,
                runner_dir: runner.as_ref().map(|r| r.install_dir.clone()),
                trusted,
                repository,
                log_from,
            };
            match (runner, &self.registrar) {
                (None, _) => {
                    // If the send fails the connection is gone; the reconnect (or
                    // the lost-agent reaper) settles the job.
                    self.send(&agent_id, CoordinatorMessage::Assign(Box::new(assignment)));
                }
                (Some(r), Some((registrar, tx))) => {
                    // The GPUs are leased; register the runner without holding up
                    // the scheduler, and send the assignment when GitHub answers.
                    self.placements += 1;
                    let placement = self.placements;
                    self.registering.insert(rec.id, (placement, assignment));
                    let (registrar, tx, job, agent) = (registrar.clone(), tx.clone(), rec.id, agent_id.clone());
                    tokio::spawn(async move {
                        let result = registrar.register(job, &agent, &r).await;
                        let _ = tx.send(Command::RunnerRegistered { job, placement, result }).await;
                    });
                }
                (Some(_), None) => {
                    let why = "an Actions runner job, but GitHub is not configured on this coordinator".to_string();
                    if let Err(e) = self.finish(&rec, JobState::Failed, why, None, None, Vec::new()).await {
                        tracing::error!(job = rec.id, error = %e, "could not fail job");
                    }
                }
            }
        }
        tracing::debug!(
            target: "gpuci::pass",
            placed = count,
            stored_ms = stored.as_secs_f64() * 1e3,
            sent_ms = (began.elapsed() - stored).as_secs_f64() * 1e3,
            "assignments committed and sent"
        );
    }

    pub(super) async fn runner_registered(&mut self, id: JobId, placement: u64, result: Result<RunnerGrant, String>) {
        let current = self.registering.get(&id).is_some_and(|(p, _)| *p == placement);
        let job = self.active.get(&id).filter(|j| j.state == JobState::Assigned).cloned();
        let (Some(job), true) = (job, current) else {
            // Cancelled, or requeued (and perhaps placed again) meanwhile: this runner is not needed.
            if let (Ok(grant), Some((registrar, _))) = (result, &self.registrar) {
                let registrar = registrar.clone();
                tokio::spawn(async move { registrar.discard(grant).await });
            }
            return;
        };
        let Some((_, mut assignment)) = self.registering.remove(&id) else { return };
        match result {
            Ok(grant) => {
                tracing::info!(job = id, runner = %grant.runner_name, "runner registered");
                assignment.secrets.0.insert(JIT_CONFIG_ENV.to_string(), grant.jit_config);
                assignment.env.insert("GPUCI_RUNNER_NAME".into(), grant.runner_name);
                let agent = job.agent_id.clone().unwrap_or_default();
                self.send(&agent, CoordinatorMessage::Assign(Box::new(assignment)));
            }
            Err(e) => {
                let why = format!("could not register an Actions runner with GitHub: {e}");
                if let Err(e) = self.finish(&job, JobState::Failed, why, None, None, Vec::new()).await {
                    tracing::error!(job = id, error = %e, "could not fail job");
                }
            }
        }
    }
}

/// How often a waiting job's reason is given again when only its counts changed (the words
/// at once): a long queue's reasons are rewritten at most this often on a busy cluster.
pub(super) const REASON_COUNTS_EVERY_MS: i64 = 30_000;

/// At most this many waiting jobs' reasons are written at once ([`Brain::tell_waiting`]):
/// about 50 ms of SQLite on the 2-core VM, the longest a placement waits behind telling.
pub(super) const REASONS_PER_WRITE: usize = 4096;

/// A pass that placed jobs writes at most `REASONS_PER_WRITE / this` reasons: enough that a
/// cluster placing at every pass still tells its queue, little enough that the next pass,
/// and the agents it places on, are not held back by it.
const PLACING_PASS_TELLS_LESS: usize = 8;

/// A queued job as the pass is told of it: its id, whether its budget holds it, what blocks
/// it, its stand-in tags ([`stand_in_tags`]).
type Ready = (JobId, bool, Option<String>, Option<BTreeMap<String, String>>);

/// Whether the job names secrets (stored or encrypted in its pipeline).
pub(super) fn names_secrets(j: &JobRecord) -> bool {
    !(j.step.secrets.is_empty() && j.step.encrypted_secrets.is_empty())
}

/// The tags a job asks for plus the scheduler's stand-ins for what is not a tag: `sandbox:
/// none` runs only where the agent allows it, limits only where they hold (or where the
/// operator allowed them unenforced: the job's log then says so), never silently without
/// them; a job its repository's budget holds goes only to machines no fleet made. `None`:
/// the job's own tags are all.
pub(super) fn stand_in_tags(j: &JobRecord, held: bool) -> Option<BTreeMap<String, String>> {
    let unsandboxed = j.step.sandbox == gpuci_core::pipeline::SandboxMode::None;
    let r = &j.step.resources;
    let limited = r.memory.is_some() || r.cpu_millis.is_some() || r.pids.is_some();
    if !(unsandboxed || held || limited) {
        return None;
    }
    let mut t = j.step.agents.clone();
    if unsandboxed {
        t.insert(UNSANDBOXED_TAG.to_string(), "allowed".to_string());
    }
    if limited {
        t.insert(RESOURCES_TAG.to_string(), "taken".to_string());
    }
    if held {
        t.insert(gpuci_providers::TAG_FLEET.to_string(), NOT_A_FLEET_MACHINE.to_string());
    }
    Some(t)
}

/// Placement's reason for a job nothing takes, with a stand-in tag it names said in words.
/// An agent that takes no jobs (no working sandbox, no disk quota) is named with its reason
/// by placement itself (`HostView::refuses`), never "busy".
fn explain_unplaced(needs: &Needs<'_>, reason: String) -> String {
    if needs.tags.contains_key(UNSANDBOXED_TAG) && reason.contains(UNSANDBOXED_TAG) {
        "needs an agent that allows `sandbox: none`; every matching agent refuses it (start one with --allow-unsandboxed)"
            .to_string()
    } else if needs.tags.contains_key(RESOURCES_TAG) && reason.contains(RESOURCES_TAG) {
        "sets resources: (memory, cpus or pids), and no matching agent can enforce them (an agent needs job cgroups of \
         its own: a systemd unit with Delegate=yes for one that is not root, a delegated cgroup in a container, where \
         only the container's own limits apply otherwise; or start it with --allow-unenforced-limits to run such steps \
         with their limits unenforced, said in their logs)"
            .to_string()
    } else {
        reason
    }
}
