//! The placement pass: the hosts as placement sees them, one pass over the queue
//! ([`Brain::place_now`]) whose assignments are stored in one transaction and sent only after
//! it commits ([`Brain::commit_placements`]), repository budgets, and Actions runner
//! registrations of placed runner jobs.

use super::*;

impl Brain {
    /// Host views of connected agents, with GPU lease and quarantine state.
    fn hosts(&self) -> (Vec<HostView>, Vec<String>) {
        let leased: HashMap<&str, JobId> =
            self.active.values().flat_map(|j| j.gpus.iter().map(move |g| (g.as_str(), j.id))).collect();
        // Each agent's slots in use, counted in one walk over the active jobs: counting them
        // agent by agent walked every active job once per agent, and at 2,000 agents and
        // 10,000 jobs that was most of a placement pass (BENCHMARKS.md, "The coordinator
        // under load").
        let mut busy: HashMap<&str, u32> = HashMap::new();
        for j in self.active.values().filter(|j| j.state != JobState::Queued) {
            if let Some(agent) = j.agent_id.as_deref() {
                *busy.entry(agent).or_default() += 1;
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
                // older than the `refuses` field is described by its isolation line.
                refuses: (a.slots == 0)
                    .then(|| a.refuses.clone().unwrap_or_else(|| format!("it offers no job slots ({})", a.isolation))),
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
        self.note_group_scopes().await;
        // Skips cascade through depends_on; repeat until nothing changes.
        let groups = loop {
            let groups = self.group_index();
            let skips: Vec<(JobRecord, String)> = self
                .active
                .values()
                .filter(|j| j.state == JobState::Queued)
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
        let (hosts, ids) = self.hosts();
        // The indexed cluster answers each job without scanning every host; it is rebuilt per
        // pass from live state, so it can never drift from it.
        let mut cluster = placement::Cluster::new(hosts);
        // Ids, not records: a pass over 100,000 queued jobs cloned every record (BENCHMARKS.md,
        // "The coordinator under load"); a record is cloned only to be placed or to change.
        let queued: Vec<JobId> = self.active.values().filter(|j| j.state == JobState::Queued).map(|j| j.id).collect();
        let now = now_ms();
        let mut placed_groups: BTreeSet<gpuci_core::concurrency::GroupKey> = BTreeSet::new();
        let mut unplaceable = Vec::new();
        // Needs that found no place this pass, and why: a pass only takes capacity, so a
        // later job with the same needs finds none either and is told the same.
        let mut full = FullShapes::default();
        // Why each job waits, written in one transaction at the end of the pass.
        let mut reasons: Vec<(JobRecord, String)> = Vec::new();
        // This pass's assignments, stored in one transaction before any is sent.
        let mut placed: Vec<Placed> = Vec::new();
        // Pipelines read this pass (a pipeline's steps are placed one after another).
        let mut pipelines: HashMap<PipelineId, PipelineRecord> = HashMap::new();
        // Where the pipelines of jobs with secrets came from, and the stored secrets' names:
        // read at most once a pass.
        let mut sources: HashMap<PipelineId, gpuci_core::secret_scope::JobSource> = HashMap::new();
        let mut stored_secrets: Option<secrets::StoredSecrets> = None;
        // Vetted jobs that left the queue.
        if self.secrets_vetted.len() > 2 * queued.len() + 1024 {
            let active = &self.active;
            self.secrets_vetted.retain(|id, _| active.get(id).is_some_and(|j| j.state == JobState::Queued));
        }
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
            let why = match self.blocked(j, &groups) {
                Some(Ok(why)) | Some(Err(why)) => Some(why),
                None => None,
            };
            let why = match (why, self.group_of(j)) {
                (None, Some(key)) if placed_groups.contains(&key) => {
                    Some(format!("waiting for another job in concurrency group {key}"))
                }
                (w, _) => w,
            };
            if let Some(why) = why {
                self.ready_since.remove(&id);
                note_reason(&mut reasons, j, why);
                continue;
            }
            self.ready_since.entry(id).or_insert(now);
            // `sandbox: none` runs only where the agent allows it.
            let unsandboxed = j.step.sandbox == gpuci_core::pipeline::SandboxMode::None;
            // Limits a step asks for run only where they hold, or where the operator allowed
            // them unenforced (the job's log then says so): never silently without them.
            let r = &j.step.resources;
            let limited = r.memory.is_some() || r.cpu_millis.is_some() || r.pids.is_some();
            // A job that names secrets is vetted even when it cannot be placed now: one that
            // may not have them ends at once. The names are read once a pass, and a job
            // vetted under the same names is not vetted again (`brain/secrets.rs`).
            let with_secrets = !(j.step.secrets.is_empty() && j.step.encrypted_secrets.is_empty());
            if with_secrets {
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
            let Some(j) = self.active.get(&id) else { continue };
            if let Some(reason) = full.reason(&Shape::of(j, unsandboxed, limited, held)) {
                unplaceable.push(id);
                match self.fleet_notes.get(&id) {
                    // Told already (most of a long queue, pass after pass): nothing to make.
                    None if j.reason == reason => {}
                    note => note_reason(&mut reasons, j, with_fleet_note(reason, held, note)),
                }
                continue;
            }
            let j = j.clone();
            let (secrets, given) = match self.secrets_vetted.get(&id) {
                Some((_, given)) if with_secrets => {
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
                            note_reason(&mut reasons, &j, why);
                            continue;
                        }
                        Err(secrets::NotOpened::Fail(why)) => {
                            tracing::warn!(job = j.id, reason = %why, "job failed: a secret does not open");
                            if let Err(e) = self.finish(&j, JobState::Failed, why, None, None, Vec::new()).await {
                                tracing::error!(job = j.id, error = %e, "could not fail job");
                            }
                            continue;
                        }
                    }
                }
                _ => (BTreeMap::new(), Vec::new()),
            };
            let tags = if unsandboxed || held || limited {
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
                std::borrow::Cow::Owned(t)
            } else {
                std::borrow::Cow::Borrowed(&j.step.agents)
            };
            let needs = Needs {
                tags: &tags,
                gpu: &j.step.gpu,
                container: j.step.image.is_some(),
                deadline: job_deadline(j.step.timeout, now),
            };
            // Applied to this pass's view at once; if the commit below fails the GPUs only
            // look taken until the next pass.
            match cluster.place_and_apply(&j.id.to_string(), &needs) {
                Ok(p) => {
                    let agent_id = ids[p.host].clone();
                    tracing::debug!(job = j.id, agent = %agent_id, free_slots = cluster.hosts()[p.host].free_slots, "placed");
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
                            // Caches by repository and trust class: what may be restored and
                            // where the job saves is the core's rule (`cache::scope`).
                            // Keyed by the repository's identity with its host: two spellings
                            // of one remote share a cache, two hosts never do, and a remote
                            // that names no repository unambiguously gets none.
                            let repository = crate::repos::name_of_pipeline(
                                p.repository.as_deref(),
                                p.origin.as_deref(),
                                &self.github_host,
                            );
                            let cache = match (&repository, Origin::cache_origin(p.origin.as_deref())) {
                                (Some(repository), Some(o)) if !j.step.cache.is_empty() => {
                                    gpuci_core::cache::scope(repository, &o)
                                }
                                _ => gpuci_core::cache::CacheScope::none(),
                            };
                            let trusted = gpuci_core::trust::may_run_unsandboxed(
                                Origin::cache_origin(p.origin.as_deref()).as_ref(),
                            );
                            // The agent's tenant (who may share a host with a job outside the
                            // sandbox): the identity, else the remote as given, never merged
                            // with pipelines that name no repository.
                            let tenant = repository.or(p.repository);
                            (p.workspace_upload, cache, origin, trusted, tenant)
                        }
                        Ok(None) => (None, gpuci_core::cache::CacheScope::none(), None, false, None),
                        Err(e) => {
                            tracing::error!(job = j.id, error = %e, "could not read the job's pipeline");
                            continue;
                        }
                    };

                    // The audit record of which secrets (names and scopes, never values) this
                    // run is given, in the job's log, before the agent's lines.
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
                    if let Some(key) = self.group_of(&j) {
                        placed_groups.insert(key);
                    }
                    placed.push(Placed {
                        agent_id,
                        gpus: p.gpus,
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
                Err(u) => {
                    let reason = if unsandboxed && u.reason.contains(UNSANDBOXED_TAG) {
                        "needs an agent that allows `sandbox: none`; every matching agent refuses it (start one with --allow-unsandboxed)"
                            .to_string()
                    } else if limited && u.reason.contains(RESOURCES_TAG) {
                        "sets resources: (memory, cpus or pids), and no matching agent can enforce them (an agent needs \
                         job cgroups of its own: a systemd unit with Delegate=yes for one that is not root, a delegated \
                         cgroup in a container, where only the container's own limits apply otherwise; or start it with \
                         --allow-unenforced-limits to run such steps with their limits unenforced, said in their logs)"
                            .to_string()
                    } else {
                        u.reason
                    };
                    // An agent that takes no jobs (no working sandbox, no disk quota) is named
                    // with its reason by placement itself (`HostView::refuses`), never "busy".
                    full.note(&Shape::of(&j, unsandboxed, limited, held), &reason);
                    let reason = with_fleet_note(&reason, held, self.fleet_notes.get(&j.id));
                    unplaceable.push(j.id);
                    note_reason(&mut reasons, &j, reason);
                }
            }
        }
        // A requeued job keeps its log (and the lines noted above are in it): this run's lines
        // are numbered after it. One read for the pass; if it fails, nothing is placed now.
        let ids: Vec<JobId> = placed.iter().map(|p| p.job.id).collect();
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
        if !reasons.is_empty() {
            let rows: Vec<(JobId, String)> = reasons.iter().map(|(j, why)| (j.id, why.clone())).collect();
            match self.store.set_reasons(&rows).await {
                Ok(()) => {
                    for (mut rec, why) in reasons {
                        rec.reason = why;
                        self.publish(&rec);
                    }
                }
                Err(e) => tracing::error!(jobs = rows.len(), error = %e, "could not record why jobs wait"),
            }
        }
        let unplaceable: BTreeSet<JobId> = unplaceable.into_iter().collect();
        if let Some(wake) = &self.fleet_wake {
            if !unplaceable.is_subset(&self.unplaceable) {
                wake.notify_one();
            }
        }
        self.unplaceable = unplaceable;
    }

    /// Group commit of a placement pass: every assignment is stored in one transaction, with
    /// its job token's hash, and only after it commits is any sent (an assignment is never
    /// sent before it is durable, and a job never holds a token the store does not know).
    /// If the commit fails, nothing is sent, the jobs stay queued (saying why) and the next
    /// pass places them again.
    async fn commit_placements(&mut self, placed: Vec<Placed>, reasons: &mut Vec<(JobRecord, String)>) {
        if placed.is_empty() {
            return;
        }
        let batch: Vec<NewAssignment> = placed
            .iter()
            .map(|p| NewAssignment {
                job: p.job.id,
                agent_id: p.agent_id.clone(),
                gpus: p.gpus.clone(),
                token_sha256: p.token_sha256.clone(),
            })
            .collect();
        let results = match self.store.assign_jobs(&batch, now_ms()).await {
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
        for (placed, result) in placed.into_iter().zip(results) {
            let Placed {
                agent_id, secrets, workspace_upload, cache, origin, trusted, repository, log_from, job, ..
            } = placed;
            let rec = match result {
                Ok(rec) => rec,
                Err(e) => {
                    tracing::error!(job = job.id, error = %e, "could not assign job");
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

/// What placement sees of a job: two jobs of one shape fit the same places. Borrowed from
/// the job: looking one up allocates nothing.
#[derive(Hash, PartialEq, Eq, Clone, Copy)]
struct Shape<'a> {
    agents: &'a BTreeMap<String, String>,
    gpu: &'a gpuci_core::gpu::GpuRequirements,
    container: bool,
    timeout: Option<gpuci_core::duration::Duration>,
    unsandboxed: bool,
    limited: bool,
    held: bool,
}

impl<'a> Shape<'a> {
    fn of(j: &'a JobRecord, unsandboxed: bool, limited: bool, held: bool) -> Shape<'a> {
        Shape {
            agents: &j.step.agents,
            gpu: &j.step.gpu,
            container: j.step.image.is_some(),
            timeout: j.step.timeout,
            unsandboxed,
            limited,
            held,
        }
    }

    fn key(&self) -> u64 {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        BuildHasherDefault::<DefaultHasher>::default().hash_one(self)
    }
}

/// A [`Shape`] kept past its job's borrow.
struct OwnedShape {
    agents: BTreeMap<String, String>,
    gpu: gpuci_core::gpu::GpuRequirements,
    rest: (bool, Option<gpuci_core::duration::Duration>, bool, bool, bool),
}

impl OwnedShape {
    fn is(&self, s: &Shape<'_>) -> bool {
        self.rest == (s.container, s.timeout, s.unsandboxed, s.limited, s.held)
            && &self.agents == s.agents
            && &self.gpu == s.gpu
    }
}

/// The shapes a placement pass found no place for, with placement's reason (before the
/// fleets' note, which is the job's own).
#[derive(Default)]
struct FullShapes(HashMap<u64, Vec<(OwnedShape, String)>>);

impl FullShapes {
    fn reason(&self, shape: &Shape<'_>) -> Option<&str> {
        self.0.get(&shape.key())?.iter().find(|(s, _)| s.is(shape)).map(|(_, r)| r.as_str())
    }

    fn note(&mut self, shape: &Shape<'_>, reason: &str) {
        if self.reason(shape).is_none() {
            let owned = OwnedShape {
                agents: shape.agents.clone(),
                gpu: shape.gpu.clone(),
                rest: (shape.container, shape.timeout, shape.unsandboxed, shape.limited, shape.held),
            };
            self.0.entry(shape.key()).or_default().push((owned, reason.to_string()));
        }
    }
}

/// A waiting job's reason with the fleets' word on it; a job held off fleet machines by its
/// repository's budget is told only that (placement's reason names the stand-in tag).
fn with_fleet_note(reason: &str, held: bool, note: Option<&String>) -> String {
    match note {
        Some(note) if held => note.clone(),
        Some(note) => format!("{reason}; {note}"),
        None => reason.to_string(),
    }
}
