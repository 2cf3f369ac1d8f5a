//! One reconcile pass: list what each fleet's provider has, join it with the store's machines
//! and the connected agents, ask `gpuci_core::fleet::decide` what to do, and hand the actions
//! to `dispatch`. Decisions are `decide`'s; this only gathers its input and records what the
//! provider says happened (boot stages, ends, interruptions). It must not call a provider's
//! create, delete, stop or start: those are the worker's, off the loop's task.

use super::provider::{adopted, valid_machine_id};
use super::{capacity_of, now_s, Loop, LIST_WAIT};
use crate::brain::{ask, Command, FleetView};
use gpuci_core::fleet::ending::{classify_end, EndedMachine, MachineEnd};
use gpuci_core::fleet::strays::{create_timeout_s, place_stray, requested_grace_s, Stray, StrayFate};
use gpuci_core::fleet::{
    decide, fits, offer_unavailable_after_error, Action, AutoscaleInput, FleetSpec, Machine, MachineState, QueuedJob,
    SkipCause,
};
use gpuci_core::placement::Needs;
use gpuci_providers::{ProviderMachine, ProviderState};
use gpuci_store::MachineRecord;
use std::collections::{BTreeMap, HashMap};

impl Loop {
    /// One reconcile pass over every fleet.
    pub(super) async fn pass(&mut self) {
        self.collect_workers().await;
        // A fleet whose provider still carries out the last pass's actions: its rows change
        // under this pass (a start recorded after they were read, a create's new row), so this
        // pass only looks at it. Nothing it saw of that fleet is written or acted on (an older
        // row written over the start's made a machine whose agent was on its way back look
        // lost, and a second machine was made); its actions wait for the worker anyway.
        let busy: Vec<bool> = self.fleets.iter().map(|r| r.worker.is_some()).collect();
        let now = now_s();
        let now_ms = now as i64 * 1000;
        self.unavailable.retain(|u| u.until > now);
        self.backoffs.forget(now);
        let records = match self.deps.store.machines(true).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "fleets: cannot read machines this pass");
                return;
            }
        };
        let mut records: BTreeMap<String, MachineRecord> = records.into_iter().map(|r| (r.id.clone(), r)).collect();

        // What exists, per fleet; a fleet whose list fails sits this pass out (deciding on a
        // partial view could create duplicates or delete what runs).
        let mut listed: BTreeMap<String, ProviderMachine> = BTreeMap::new();
        let mut ok_fleets = vec![false; self.fleets.len()];
        // Listed with this installation's tags and no live row: adopted or deleted once the
        // fleet's count is known (`gpuci_core::fleet::strays`).
        let mut strays: Vec<(usize, ProviderMachine)> = Vec::new();
        let mut list_errors = Vec::new();
        // Every fleet's list at once, each its own task: a pass waits a short while for them,
        // and a fleet whose provider has not answered by then sits this pass out while its list
        // goes on (one slow or hanging provider holds up no other fleet).
        for run in self.fleets.iter_mut() {
            if let (None, Some(p)) = (&run.listing, &run.provider) {
                let p = p.clone();
                run.listing = Some(tokio::spawn(async move { p.list().await }));
            }
        }
        let deadline = tokio::time::Instant::now() + LIST_WAIT;
        let mut lists = Vec::with_capacity(self.fleets.len());
        for run in self.fleets.iter_mut() {
            let Some(handle) = run.listing.as_mut() else {
                lists.push(None);
                continue;
            };
            match tokio::time::timeout_at(deadline, handle).await {
                Ok(result) => {
                    run.listing = None;
                    lists.push(Some(result.unwrap_or_else(|e| {
                        Err(gpuci_providers::ProviderError::new(gpuci_providers::ErrorKind::Transient, e.to_string()))
                    })));
                }
                Err(_) => {
                    let slow = format!("its provider has not answered `list` for {LIST_WAIT:?}; nothing decided for this fleet this pass");
                    tracing::debug!(fleet = %run.spec.name, "{slow}");
                    lists.push(None);
                }
            }
        }
        for (i, (run, list)) in self.fleets.iter().zip(lists).enumerate() {
            let Some(list) = list else { continue };
            match list {
                Ok(ms) => {
                    ok_fleets[i] = true;
                    let fleet = &run.spec;
                    let mut seen = std::collections::HashSet::new();
                    for m in ms {
                        // Ids go into tags, paths and terminals: a provider's odd ones are
                        // refused, and shown (escaped) on the fleet.
                        if !valid_machine_id(&m.machine) {
                            let shown: String = m.machine.chars().take(80).collect();
                            list_errors.push((
                                i,
                                format!("the provider listed a machine id that is not a short token of letters, digits, . _ -: {shown:?}; ignored"),
                            ));
                            continue;
                        }
                        if !seen.insert(m.machine.clone()) {
                            list_errors.push((
                                i,
                                format!("the provider listed machine {} twice; the first entry counts", m.machine),
                            ));
                            continue;
                        }
                        // Listed by this fleet's provider: one of its machines, unless the
                        // store says it belongs to another fleet (a provider that lists too much).
                        if records.get(&m.machine).is_some_and(|r| r.fleet != fleet.name) {
                            continue;
                        }
                        if !records.contains_key(&m.machine) && m.state != ProviderState::Terminated {
                            strays.push((i, m.clone()));
                        }
                        listed.insert(m.machine.clone(), m);
                    }
                }
                Err(e) => list_errors
                    .push((i, format!("listing machines failed: {e}; nothing decided for this fleet this pass"))),
            }
        }
        // Each stray is adopted while its fleet has room under `max` for it, else deleted: a
        // create that outlived its row (a coordinator killed mid-create, its create finished
        // after the next coordinator's grace) is never counted beyond `max`, nor left running
        // untracked. Counted: the fleet's live rows not stopped, then each stray adopted.
        let mut counted: Vec<u32> = self
            .fleets
            .iter()
            .map(|f| {
                records
                    .values()
                    .filter(|r| r.fleet == f.spec.name && !matches!(r.state.as_str(), "stopped" | "stopping" | "ended"))
                    .filter(|r| {
                        !listed.get(&r.id).is_some_and(|pm| {
                            matches!(
                                pm.state,
                                ProviderState::Terminated | ProviderState::Stopped | ProviderState::Stopping
                            )
                        })
                    })
                    .count() as u32
            })
            .collect();
        let mut stray_deletes: Vec<MachineRecord> = Vec::new();
        for (fi, m) in strays {
            // Perhaps its worker's create, listed before its row was read.
            if busy[fi] {
                continue;
            }
            let fleet = &self.fleets[fi].spec;
            let stopped = matches!(m.state, ProviderState::Stopped | ProviderState::Stopping);
            let rec = adopted(fleet, &m, now_ms);
            match place_stray(fleet.max, counted[fi], Stray { stopped }) {
                StrayFate::Adopt => {
                    tracing::info!(fleet = %fleet.name, machine = %m.machine, "adopting a machine this coordinator's store did not know");
                    if !stopped {
                        counted[fi] += 1;
                    }
                    // Recorded at once, whatever the join below changes: billing refers to the row.
                    if let Err(e) = self.deps.store.put_machine(&rec).await {
                        tracing::warn!(machine = %rec.id, error = %e, "fleets: cannot record an adopted machine");
                    }
                    records.insert(rec.id.clone(), rec);
                }
                StrayFate::Delete { reason } => {
                    tracing::warn!(fleet = %fleet.name, machine = %m.machine, "deleting a machine with no live record: {reason}");
                    list_errors.push((fi, format!("machine {}: {reason}; deleted", m.machine)));
                    stray_deletes.push(MachineRecord { reason: Some(reason), ..rec });
                }
            }
        }
        for (i, what) in list_errors {
            self.error(i, what);
        }
        // The scheduler's view is taken after the lists: an agent that registered before its
        // machine was listed as ended is then known to have registered (`ending`).
        let view: FleetView = match ask(&self.deps.brain, |reply| Command::FleetView { reply }).await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "fleets: no view of the scheduler this pass");
                return;
            }
        };
        let agents: HashMap<&str, &crate::brain::FleetAgent> =
            view.agents.iter().map(|a| (a.machine.as_str(), a)).collect();

        // Join what the store knows with what is listed: end what is gone, note boot stages.
        let mut machines: Vec<Machine> = Vec::new();
        let mut writes: Vec<MachineRecord> = Vec::new();
        let mut drain_done: Vec<String> = Vec::new();
        let mut lost_machines: Vec<String> = Vec::new();
        let mut ended_agents: Vec<(String, String)> = Vec::new();
        let absent: HashMap<&str, bool> = view.absent.iter().map(|(m, lost)| (m.as_str(), *lost)).collect();
        let mut notes: Vec<(usize, String)> = Vec::new();
        let mut bill_open: Vec<(String, i64)> = Vec::new();
        let mut bill_close: Vec<(String, i64)> = Vec::new();
        for rec in records.values_mut() {
            let Some(fi) = self.fleets.iter().position(|f| f.spec.name == rec.fleet) else { continue };
            if !ok_fleets[fi] {
                continue;
            }
            let fleet = &self.fleets[fi].spec;
            // A create may take the provider's own timeout: its row waits at least that long.
            let grace_ms = requested_grace_s(create_timeout_s(fleet.provider, &fleet.settings)) as i64 * 1000;
            let before = rec.clone();
            let pm = listed.get(&rec.id);
            let gone = match pm {
                // A new machine may not be listed yet (a cloud's listing lags its creates);
                // one that was listed running and whose agent connected is gone when it is
                // no longer listed (a pod deleted with its node).
                // An agent still connected is never ended for want of a listing (a stale
                // watch, a pod relabelled by someone else): its machine is plainly there.
                None if agents.contains_key(rec.id.as_str()) => false,
                None => {
                    now_ms - rec.requested_at_ms > grace_ms
                        || (rec.running_at_ms.is_some() && rec.connected_at_ms.is_some())
                }
                Some(pm) => pm.state == ProviderState::Terminated,
            };
            if gone && busy[fi] {
                continue;
            }
            if gone {
                let busy = agents.get(rec.id.as_str()).is_some_and(|a| a.running > 0);
                // Judged by the agent's registration, never by what the last pass saw: an
                // allocation cancelled a second after its agent registered is taken back, not
                // a boot failure (`gpuci_core::fleet::ending`).
                let registered = this_boots_agent(&view, rec).or_else(|| rec.agent_id.clone());
                let end = classify_end(&EndedMachine {
                    seen_ending: pm.is_some(),
                    registered_agent: registered.as_deref(),
                    retired_by_fleet: rec.state == "ended" || rec.state == "stopped",
                });
                let died_booting = end == MachineEnd::BootFailure;
                // Ended before its agent ever registered (an agent that exits at start, an
                // instance that fails its boot): a boot failure, so its offer is skipped for a
                // while instead of made again at once, in a loop.
                if died_booting {
                    let offer =
                        fleet.offers.iter().position(|o| o.instance_type == rec.instance_type && o.zone == rec.zone);
                    // The provider's words for how it ended (an image the kubelet cannot pull,
                    // a Slurm job's reason) are what the fleet and its waiting jobs say.
                    let what = match pm.and_then(|p| p.note.as_deref()) {
                        Some(n) => format!(
                            "machine {} ended before its agent connected: {}",
                            rec.id,
                            gpuci_core::text::escape(n)
                        ),
                        None => format!(
                            "machine {} ended before its agent connected (see the provider's log of it)",
                            rec.id
                        ),
                    };
                    if let Some(o) = offer {
                        let u = offer_unavailable_after_error(&fleet.name, o, capacity_of(rec), now)
                            .because(SkipCause::BootFailed, what.clone());
                        let skip = self.backoffs.error(u, now);
                        self.unavailable.push(skip);
                    }
                    notes.push((
                        fi,
                        format!(
                            "{what}; {} skipped for a while",
                            fleet.offers.get(offer.unwrap_or(0)).map_or_else(String::new, |o| o.label())
                        ),
                    ));
                }
                // Its agent may have had no chance to say so (killed at once, its node lost):
                // jobs it was given go back to the queue, once, as for a machine taken back.
                if let MachineEnd::TakenBack { agent } = &end {
                    tracing::info!(fleet = %fleet.name, machine = %rec.id, agent = %agent, "machine ended after its agent registered: taken back, its jobs queued again");
                    rec.agent_id.get_or_insert_with(|| agent.clone());
                    rec.connected_at_ms.get_or_insert(now_ms);
                    let reason = pm.and_then(|p| p.note.clone()).unwrap_or_else(|| "gone at the provider".into());
                    ended_agents.push((agent.clone(), format!("machine {} ended: {reason}", rec.id)));
                }
                rec.state = "ended".into();
                rec.ended_at_ms = Some(now_ms);
                rec.reason.get_or_insert_with(|| {
                    if busy && !died_booting { "gone at the provider while running jobs" } else { end.reason() }.into()
                });
                if let Some(note) = pm.and_then(|p| p.note.clone()) {
                    rec.reason = Some(note);
                }
                bill_close.push((rec.id.clone(), now_ms));
                self.idle_since.remove(&rec.id);
                writes.push(rec.clone());
                continue;
            }
            let agent = agents.get(rec.id.as_str());
            if let Some(pm) = pm {
                rec.provider_id = Some(pm.provider_id.clone());
                if matches!(pm.state, ProviderState::Running) && rec.running_at_ms.is_none() {
                    rec.running_at_ms = Some(now_ms);
                }
            }
            if let Some(a) = agent.filter(|_| !busy[fi]) {
                if rec.connected_at_ms.is_none() {
                    // Booted: its offer's boot failures in a row are over (a create the
                    // provider took does not end them, `Backoffs::success`).
                    if let Some(o) =
                        fleet.offers.iter().position(|o| o.instance_type == rec.instance_type && o.zone == rec.zone)
                    {
                        self.backoffs.booted(&fleet.name, o, capacity_of(rec));
                    }
                }
                rec.agent_id = Some(a.agent_id.clone());
                rec.connected_at_ms.get_or_insert(now_ms);
                if let Some(t) = a.first_job_at_ms.filter(|t| *t >= rec.requested_at_ms) {
                    rec.first_job_at_ms.get_or_insert(t);
                } else if a.running > 0 {
                    rec.first_job_at_ms.get_or_insert(now_ms);
                }
            }
            let state = match (pm.map(|p| p.state), agent) {
                (None, _) => MachineState::Requested,
                (Some(ProviderState::Stopped), _) => MachineState::Stopped,
                (Some(ProviderState::Stopping), _) => MachineState::Stopping,
                (Some(_), Some(a)) if a.interrupted.is_some() => MachineState::Draining,
                (Some(_), Some(a)) if a.running > 0 => MachineState::Busy,
                (Some(_), Some(_)) => MachineState::Idle,
                // Its agent connected once and is away now (this coordinator restarted, a
                // network blip): held, neither booting nor idle, until it comes back; once the
                // scheduler counts it lost (its jobs ended so), the machine is of no use.
                (Some(_), None) if rec.connected_at_ms.is_some() => {
                    if absent.get(rec.id.as_str()) == Some(&true) && !busy[fi] {
                        lost_machines.push(rec.id.clone());
                    }
                    MachineState::Draining
                }
                (Some(_), None) => MachineState::Booting,
            };
            if let (MachineState::Draining, Some(a), false) = (state, agent, busy[fi]) {
                // Counted once per machine, for the fleet's spot breaker; deleted once its
                // jobs are back in the queue (the provider takes it anyway).
                if self.interrupted_seen.insert(rec.id.clone()) {
                    self.interruptions.entry(rec.fleet.clone()).or_default().push(now);
                    let why = a.interrupted.clone().unwrap_or_default();
                    notes.push((fi, format!("machine {}: {why}; its jobs were queued again", rec.id)));
                    rec.reason = Some(why);
                    // In the store: the breaker counts it after a restart too.
                    rec.interrupted_at_ms.get_or_insert(now_ms);
                }
                if a.running == 0 {
                    drain_done.push(rec.id.clone());
                }
            }
            rec.state = match state {
                MachineState::Requested => "requested",
                MachineState::Booting => "booting",
                MachineState::Draining => "draining",
                MachineState::Idle | MachineState::Busy => "ready",
                MachineState::Stopping => "stopping",
                MachineState::Stopped => "stopped",
            }
            .into();
            if state != MachineState::Stopped {
                self.stopped_since.remove(&rec.id);
            }
            // Seen stopped by this pass: its bill ends, whoever stopped it (a stop the
            // provider carried out but did not answer, a coordinator killed after asking).
            if state == MachineState::Stopped && before.state != "stopped" && !busy[fi] {
                bill_close.push((rec.id.clone(), now_ms));
            }
            let since = match state {
                MachineState::Idle => *self.idle_since.entry(rec.id.clone()).or_insert(now),
                MachineState::Stopped => {
                    self.idle_since.remove(&rec.id);
                    *self.stopped_since.entry(rec.id.clone()).or_insert(now)
                }
                // The boot clock counts from this coordinator's start at the earliest: an agent
                // cannot connect to a coordinator that is not running.
                MachineState::Requested | MachineState::Booting => {
                    self.idle_since.remove(&rec.id);
                    ((rec.requested_at_ms / 1000) as u64).max(self.started_s)
                }
                _ => {
                    self.idle_since.remove(&rec.id);
                    (rec.requested_at_ms / 1000) as u64
                }
            };
            let offer = fleet
                .offers
                .iter()
                .position(|o| o.instance_type == rec.instance_type && o.zone == rec.zone)
                .unwrap_or(0);
            let capacity = capacity_of(rec);
            if matches!(state, MachineState::Booting | MachineState::Idle | MachineState::Busy) && !busy[fi] {
                bill_open.push((rec.id.clone(), pm.and_then(|p| p.launched_at).map_or(now_ms, |t| t as i64 * 1000)));
            }
            machines.push(Machine {
                id: rec.id.clone(),
                fleet: rec.fleet.clone(),
                offer,
                capacity,
                state,
                created_at: (rec.requested_at_ms / 1000) as u64,
                since,
                gpus_busy: agent.map_or(0, |a| a.gpus_busy),
                jobs: Vec::new(),
                note: pm.and_then(|p| p.note.clone()),
            });
            match pm.and_then(|p| p.note.clone()) {
                Some(n) => {
                    self.provider_notes.insert(rec.id.clone(), gpuci_core::text::escape(&n).to_string());
                }
                None => {
                    self.provider_notes.remove(&rec.id);
                }
            }
            if *rec != before && !busy[fi] {
                writes.push(rec.clone());
            }
        }
        for (fi, what) in notes {
            self.error(fi, what);
        }
        for (agent, reason) in ended_agents {
            let _ = self.deps.brain.send(Command::MachineEnded { agent, reason }).await;
        }
        for w in &writes {
            if let Err(e) = self.deps.store.put_machine(w).await {
                tracing::warn!(machine = %w.id, error = %e, "fleets: cannot record a machine");
            }
        }
        for (m, t) in bill_close {
            let _ = self.deps.store.close_billing(&m, t).await;
        }
        for (m, t) in bill_open {
            let _ = self.deps.store.open_billing(&m, t).await;
        }

        // Demand: waiting jobs, with the fleets whose machines they fit.
        // Only fleets whose machines were listed: deciding for one seen as empty would create
        // what may already exist.
        let specs: Vec<FleetSpec> = self
            .fleets
            .iter()
            .zip(&ok_fleets)
            .filter(|(f, ok)| f.provider.is_some() && **ok)
            .map(|(f, _)| f.spec.clone())
            .collect();
        let mut repos: HashMap<i64, Option<String>> = HashMap::new();
        let mut queued: Vec<QueuedJob> = Vec::new();
        for w in &view.waiting {
            let needs = Needs {
                tags: &w.tags,
                gpu: &w.gpu,
                container: w.container,
                deadline: crate::brain::job_deadline(w.timeout, now_ms),
            };
            let fleets: Vec<String> = specs.iter().filter(|s| fits(s, &needs)).map(|s| s.name.clone()).collect();
            if fleets.is_empty() {
                continue;
            }
            // Repositories matter to budgets only.
            let repository = if self.deps.budgets.is_empty() {
                None
            } else {
                if let std::collections::hash_map::Entry::Vacant(e) = repos.entry(w.pipeline_id) {
                    let p = self.deps.store.get_pipeline(w.pipeline_id).await;
                    e.insert(p.ok().flatten().and_then(|p| {
                        crate::repos::name_of_pipeline(
                            p.repository.as_deref(),
                            p.origin.as_deref(),
                            &self.deps.github_host,
                        )
                    }));
                }
                repos.get(&w.pipeline_id).cloned().flatten()
            };
            queued.push(QueuedJob {
                id: w.id.to_string(),
                queued_since: (w.since_ms / 1000) as u64,
                gpus: w.gpu.count,
                fleets,
                repository,
                // Filled in below from its step's recent runs (for budgets).
                expected_run_s: None,
            });
        }
        let spend = self.spend_today(now).await;
        let repo_spend = self.repo_spend_today(now).await;
        self.inputs.refresh(self.deps.store.as_ref(), &specs, now).await;
        for s in &specs {
            self.history.entry(s.name.clone()).or_default().profile = self.inputs.profile(&s.name);
        }
        let active = self.deps.store.active_jobs().await;
        // Each active GPU job first seen (waiting, placed or running) is an arrival of the
        // first fleet it fits, at when it was queued; one counted that is no longer active has
        // left its fleet's demand (ended wherever it ran, or cancelled): an end, for the idle
        // spells. Not when the store did not answer: that is not every job ending.
        if let Ok(active) = &active {
            let now_ms = now as i64 * 1000;
            for j in active {
                if self.in_demand.contains_key(&j.id) {
                    continue;
                }
                let Some(f) = crate::fleet_inputs::fleet_of(j, &specs, now_ms) else { continue };
                let queued_ms = if j.step.depends_on.is_empty() { Some(j.created_at_ms) } else { j.started_at_ms };
                let at = queued_ms.map_or(now, |ms| ((ms.max(0) / 1000) as u64).min(now));
                let h = self.history.entry(specs[f].name.clone()).or_default();
                let k = h.arrivals.partition_point(|&t| t <= at);
                h.arrivals.insert(k, at);
                h.trim(now, gpuci_core::fleet::idle::STOPPED_WINDOW_S);
                self.in_demand.insert(j.id, specs[f].name.clone());
            }
            let live: std::collections::HashSet<i64> = active.iter().map(|j| j.id).collect();
            let history = &mut self.history;
            self.in_demand.retain(|id, fleet| {
                if live.contains(id) {
                    return true;
                }
                if let Some(h) = history.get_mut(fleet) {
                    let k = h.ends.partition_point(|&t| t <= now);
                    h.ends.insert(k, now);
                }
                false
            });
        }
        for s in &specs {
            if let Some(h) = self.history.get_mut(&s.name) {
                h.relearn(s, now);
            }
        }
        let active = active.unwrap_or_default();
        let upcoming = self.inputs.upcoming(&active, &specs, now);
        // Each waiting job's expected run, from its step's recent runs: a fleet or repository
        // under a budget counts it before a machine is made for it.
        let steps: HashMap<String, &str> = active.iter().map(|j| (j.id.to_string(), j.step.key.as_str())).collect();
        for q in &mut queued {
            q.expected_run_s = steps.get(&q.id).and_then(|key| self.inputs.expected_run_s(key));
        }
        let decision = decide(&AutoscaleInput {
            now,
            fleets: &specs,
            queued: &queued,
            machines: &machines,
            spend_today: &spend,
            budgets: &self.deps.budgets,
            repo_spend_today: &repo_spend,
            unavailable: &self.unavailable,
            interruptions: &self.interruptions,
            history: &self.history,
            upcoming: &upcoming,
        });
        // A job waiting on a fleet whose provider is in trouble (its list did not come back
        // this pass, or it failed within the last minute) is told so, not only the fleet.
        let trouble: BTreeMap<&str, String> = self
            .fleets
            .iter()
            .zip(&ok_fleets)
            .filter_map(|(run, ok)| {
                // An error that skipped an offer is said already, in the provider's words, by
                // the autoscaler's reason for as long as the skip lasts (`no_offer_reason`):
                // not a second time here.
                let said = |e: &str| {
                    self.unavailable.iter().any(|u| {
                        u.fleet == run.spec.name && u.until > now && !u.message.is_empty() && e.contains(&u.message)
                    })
                };
                let recent = run
                    .errors
                    .front()
                    .filter(|(t, e)| now.saturating_sub(*t) <= 60 && !said(e))
                    .map(|(_, e)| e.clone());
                let why = match (ok, recent, &run.unavailable_reason) {
                    (_, _, Some(u)) => u.clone(),
                    (false, _, None) => "its provider did not answer this pass".to_string(),
                    (true, Some(e), None) => e,
                    (true, None, None) => return None,
                };
                Some((run.spec.name.as_str(), why))
            })
            .collect();
        let mut notes: BTreeMap<i64, String> =
            decision.waiting.iter().filter_map(|(id, why)| Some((id.parse().ok()?, why.clone()))).collect();
        // A job no configured fleet can ever serve waits for nothing: it is told so from zero,
        // naming each fleet and why (`gpuci_core::fleet::fit`), and each fleet's summary names
        // it, instead of "no agent is connected" beside "enough machines".
        let configured: Vec<FleetSpec> = self.fleets.iter().map(|f| f.spec.clone()).collect();
        let mut unservable: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for w in &view.waiting {
            let needs = Needs {
                tags: &w.tags,
                gpu: &w.gpu,
                container: w.container,
                deadline: crate::brain::job_deadline(w.timeout, now_ms),
            };
            let Some(why) = gpuci_core::fleet::fit::no_fleet_serves(&configured, &needs) else { continue };
            notes.insert(w.id, why);
            for f in &configured {
                if let Some(here) = gpuci_core::fleet::fit::why_not(f, &needs) {
                    unservable.entry(f.name.clone()).or_default().push((w.id.to_string(), here));
                }
            }
        }
        for w in &view.waiting {
            let needs = Needs {
                tags: &w.tags,
                gpu: &w.gpu,
                container: w.container,
                deadline: crate::brain::job_deadline(w.timeout, now_ms),
            };
            let id = w.id;
            for run in self.fleets.iter().filter(|r| fits(&r.spec, &needs)) {
                let f = &run.spec.name;
                if let Some(why) = trouble.get(f.as_str()) {
                    let shown: String = why.chars().take(300).collect();
                    let note = notes.entry(id).or_default();
                    if !note.is_empty() {
                        note.push_str("; ");
                    }
                    note.push_str(&format!("fleet {f}: {shown}"));
                }
            }
        }
        let reached = gpuci_core::fleet::budget::all_reached(&self.deps.budgets, &repo_spend);
        let _ = self.deps.brain.send(Command::FleetNotes { notes, reached }).await;
        let mut actions = decision.actions.clone();
        for machine in drain_done {
            let reason = "its machine is being taken back and its jobs are queued again".to_string();
            actions.push(Action::Delete { machine, reason });
        }
        for machine in lost_machines {
            let reason = "its agent is lost (silent past lost_after); the machine is of no use".to_string();
            actions.push(Action::Delete { machine, reason });
        }
        // Strays past `max`: deleted (an agent connected from one is first withdrawn, and one
        // running a job is kept until it runs none, as for any delete).
        for mut rec in stray_deletes {
            if let Some(a) = agents.get(rec.id.as_str()) {
                rec.agent_id = Some(a.agent_id.clone());
            }
            let reason = rec.reason.clone().unwrap_or_default();
            actions.push(Action::Delete { machine: rec.id.clone(), reason });
            records.insert(rec.id.clone(), rec);
        }
        self.dispatch(actions, &records, now_ms).await;
        // The breaker looks back `window_s` and holds for `on_demand_for_s`: older times go.
        let keep_from = now.saturating_sub(2 * 3600);
        for times in self.interruptions.values_mut() {
            times.retain(|t| *t >= keep_from);
        }
        let summaries: Vec<gpuci_core::fleet::FleetSummary> = decision
            .fleets
            .iter()
            .map(|s| match unservable.get(&s.fleet) {
                Some(unfit) => gpuci_core::fleet::FleetSummary {
                    why: gpuci_core::fleet::fit::with_unservable(&s.why, unfit),
                    ..s.clone()
                },
                None => s.clone(),
            })
            .collect();
        self.publish(&summaries, &spend).await;
    }
}

/// The agent that registered from `rec` during its latest boot, if one did: heard from since
/// the machine was (re)requested. A stopped machine started again keeps its agent's identity,
/// and that agent's registration from before the stop is not this boot's (else the restarted
/// machine read as one whose agent had come and gone, and a new machine was made).
pub(super) fn this_boots_agent(view: &FleetView, rec: &MachineRecord) -> Option<String> {
    view.registered
        .get(&rec.id)
        .filter(|(_, last_seen_ms)| *last_seen_ms >= rec.requested_at_ms)
        .map(|(agent, _)| agent.clone())
}
