//! The reconcile loop as a task: it owns the loop's memory ([`super::Loop`]), runs a pass per
//! interval or wake-up until shutdown, hands each fleet's actions to a worker off its task,
//! takes the workers' effects back, and publishes each fleet's status. The pass itself (what
//! exists, what to do) is `pass`; carrying actions out is `worker`.

use super::cost::cost_inputs;
use super::{now_s, Effect, Loop, Worker, RECENT_ERRORS, WAKE_GAP};
use super::{FleetStatus, MachineStatus};
use crate::brain::{ask, Command};
use gpuci_core::fleet::{Action, SkipCause, UnixSecs};
use gpuci_store::MachineRecord;
use std::collections::{BTreeMap, HashMap};
use tokio_util::sync::CancellationToken;

impl Loop {
    /// Interruptions of the last two hours, from the store: the spot breaker survives a restart.
    pub(super) async fn recall_interruptions(&mut self) {
        let since_ms = (now_s().saturating_sub(2 * 3600) * 1000) as i64;
        let Ok(all) = self.deps.store.machines(false).await else { return };
        for m in all {
            let Some(t) = m.interrupted_at_ms.filter(|t| *t >= since_ms) else { continue };
            self.interrupted_seen.insert(m.id.clone());
            self.interruptions.entry(m.fleet.clone()).or_default().push((t / 1000) as u64);
        }
    }

    pub(super) async fn run(mut self, shutdown: CancellationToken) {
        self.recall_interruptions().await;
        self.recall_backoffs().await;
        tracing::info!(fleets = self.fleets.len(), coordinator = %self.deps.coordinator_id, "fleets reconcile loop on");
        let (wake, worker_done) = (self.deps.wake.clone(), self.worker_done.clone());
        loop {
            self.pass().await;
            self.keep_backoffs().await;
            let next = tokio::time::Instant::now() + self.deps.interval;
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep_until(next) => break,
                    _ = wake.notified() => {
                        // A burst of submissions is one pass, not one each.
                        tokio::time::sleep(WAKE_GAP.min(self.deps.interval)).await;
                        break;
                    }
                    // A refusal is kept as soon as it is taken in, not after the next pass: a
                    // coordinator killed in between would ask the refusing offer again at once.
                    _ = worker_done.notified() => {
                        // Its task ends just after it notifies.
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        self.collect_workers().await;
                        self.keep_backoffs().await;
                    }
                }
            }
        }
    }

    pub(super) fn error(&mut self, fleet: usize, what: String) {
        // Provider text: one line, escaped, so it cannot forge log lines.
        tracing::warn!(fleet = %self.fleets[fleet].spec.name, "{}", gpuci_core::text::escape(&what));
        let errors = &mut self.fleets[fleet].errors;
        errors.push_front((now_s(), what));
        errors.truncate(RECENT_ERRORS);
    }

    /// USD spent today per repository (its jobs' shares, as the cost report counts them);
    /// empty when no repository has a budget (nothing would read it).
    pub(super) async fn repo_spend_today(&self, now: UnixSecs) -> BTreeMap<String, f64> {
        let mut spend = BTreeMap::new();
        if self.deps.budgets.is_empty() {
            return spend;
        }
        let midnight_ms = (now - now % 86_400) as i64 * 1000;
        match cost_inputs(self.deps.store.as_ref(), midnight_ms, &self.deps.github_host).await {
            Ok((machines, stretches, runs)) => {
                let r = gpuci_core::fleet::cost::report(&machines, &stretches, &runs, midnight_ms, now as i64 * 1000);
                for row in r.rows {
                    if let Some(repo) = row.repository.filter(|r| r != gpuci_core::fleet::cost::NO_REPOSITORY) {
                        *spend.entry(repo).or_insert(0.0) += row.usd;
                    }
                }
            }
            // Not knowing what was spent must not lift a budget: every budget counts as
            // reached until the store answers again.
            Err(e) => {
                tracing::warn!(error = %e, "fleets: cannot sum today's spend per repository; holding back jobs of repositories with a budget");
                for b in &self.deps.budgets {
                    spend.insert(b.repository.sample().to_string(), f64::INFINITY);
                }
            }
        }
        spend
    }

    pub(super) async fn spend_today(&self, now: UnixSecs) -> BTreeMap<String, f64> {
        let midnight_ms = (now - now % 86_400) as i64 * 1000;
        let now_ms = now as i64 * 1000;
        let mut spend = BTreeMap::new();
        let (Ok(stretches), Ok(all)) =
            (self.deps.store.billing_since(midnight_ms).await, self.deps.store.machines(false).await)
        else {
            return spend;
        };
        let by_id: HashMap<&str, &MachineRecord> = all.iter().map(|m| (m.id.as_str(), m)).collect();
        for s in stretches {
            let Some(m) = by_id.get(s.machine_id.as_str()) else { continue };
            let from = s.from_ms.max(midnight_ms);
            let to = s.to_ms.unwrap_or(now_ms).min(now_ms);
            if to > from {
                *spend.entry(m.fleet.clone()).or_insert(0.0) += (to - from) as f64 / 3_600_000.0 * m.price_per_hour;
            }
        }
        spend
    }

    /// Take in what finished workers changed.
    pub(super) async fn collect_workers(&mut self) {
        for fi in 0..self.fleets.len() {
            let done = self.fleets[fi].worker.as_ref().is_some_and(|w| w.is_finished());
            if !done {
                continue;
            }
            let Some(worker) = self.fleets[fi].worker.take() else { continue };
            // A list begun while the worker ran may show the machines as they were before its
            // actions (a started machine still stopped, a deleted one still there): dropped,
            // and the next pass lists again.
            if let Some(listing) = self.fleets[fi].listing.take() {
                listing.abort();
            }
            let effects = match worker.await {
                Ok(e) => e,
                Err(e) => vec![Effect::Error(format!("carrying out the autoscaler's actions failed: {e}"))],
            };
            for effect in effects {
                match effect {
                    Effect::Error(what) => self.error(fi, what),
                    Effect::Unavailable(u) => {
                        let now = now_s();
                        // A create or start refused for want of capacity opens (or extends) the
                        // offer's outage, which the idle rule reads (`gpuci_core::fleet::idle`);
                        // a platform's refusal or a failed boot is no outage.
                        if u.cause == SkipCause::Capacity {
                            self.history.entry(u.fleet.clone()).or_default().refused(u.offer, u.capacity, now);
                        }
                        let skip = self.backoffs.error(u, now);
                        self.unavailable.push(skip);
                    }
                    Effect::Took { fleet, offer, capacity } => {
                        self.backoffs.success(&fleet, offer, capacity);
                        if let Some(h) = self.history.get_mut(&fleet) {
                            h.took(offer, capacity, now_s());
                        }
                    }
                    Effect::Gone(machine) => {
                        self.idle_since.remove(&machine);
                    }
                }
            }
        }
    }

    /// Hand each fleet its actions, carried out off this task; a fleet still busy with the
    /// last pass's gets none now (the next pass decides again from what is then listed).
    pub(super) async fn dispatch(
        &mut self,
        actions: Vec<Action>,
        records: &BTreeMap<String, MachineRecord>,
        now_ms: i64,
    ) {
        // A fleet whose provider is still busy with the last pass's actions gets none now, and
        // its agents are not withdrawn for them either (a withdrawn agent whose stop was then
        // dropped took no job and was never stopped: its machine billed on, the job waited).
        let fleet_of = |a: &Action| match a {
            Action::Create { fleet, .. } => Some(fleet.clone()),
            Action::Delete { machine, .. }
            | Action::BootFailed { machine, .. }
            | Action::Stop { machine, .. }
            | Action::Start { machine, .. } => records.get(machine).map(|r| r.fleet.clone()),
        };
        let actions: Vec<Action> = actions
            .into_iter()
            .filter(|a| {
                let busy = fleet_of(a)
                    .and_then(|f| self.fleets.iter().find(|r| r.spec.name == f))
                    .is_some_and(|r| r.worker.is_some());
                if busy {
                    tracing::debug!(action = ?a, "its fleet's provider is still busy with the last pass's actions");
                }
                !busy
            })
            .collect();
        // A machine to delete or stop whose agent is connected: the scheduler first stops
        // placing jobs on it, and only a machine still running nothing goes (a job placed since
        // this pass's view keeps its machine).
        let agent_of = |m: &str| records.get(m).and_then(|r| r.agent_id.clone());
        let to_withdraw: Vec<String> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Delete { machine, .. } | Action::Stop { machine, .. } => agent_of(machine),
                _ => None,
            })
            .collect();
        let withdrawn: std::collections::HashSet<String> = if to_withdraw.is_empty() {
            Default::default()
        } else {
            let reason = "its machine is being deleted or stopped by its fleet".to_string();
            match ask(&self.deps.brain, |reply| Command::Withdraw { agents: to_withdraw, reason, reply }).await {
                Ok(ids) => ids.into_iter().collect(),
                Err(e) => {
                    tracing::warn!(error = %e, "fleets: the scheduler did not answer; nothing deleted or stopped this pass");
                    Default::default()
                }
            }
        };
        let actions: Vec<Action> = actions
            .into_iter()
            .filter(|a| match a {
                Action::Delete { machine, .. } | Action::Stop { machine, .. } => {
                    agent_of(machine).is_none_or(|agent| withdrawn.contains(&agent))
                }
                _ => true,
            })
            .collect();
        let mut by_fleet: BTreeMap<usize, Vec<Action>> = BTreeMap::new();
        for a in actions {
            if let Some(fi) = fleet_of(&a).and_then(|f| self.fleets.iter().position(|r| r.spec.name == f)) {
                by_fleet.entry(fi).or_default().push(a);
            }
        }
        for (fi, actions) in by_fleet {
            let run = &mut self.fleets[fi];
            let Some(provider) = run.provider.clone() else { continue };
            let worker = Worker {
                brain: self.deps.brain.clone(),
                spec: run.spec.clone(),
                provider,
                store: self.deps.store.clone(),
                coordinator_id: self.deps.coordinator_id.clone(),
                server_url: self.deps.server_url.clone(),
                registration_token: self.deps.registration_token.clone(),
                coordinator_key: self.deps.coordinator_key.clone(),
            };
            let records: BTreeMap<String, MachineRecord> =
                records.iter().filter(|(_, r)| r.fleet == run.spec.name).map(|(k, v)| (k.clone(), v.clone())).collect();
            let done = self.worker_done.clone();
            run.worker = Some(tokio::spawn(async move {
                let mut effects = Vec::new();
                for a in &actions {
                    // Each action's own time: a worker's actions run one after another (a
                    // slow provider's creates minutes apart), and a new row's age counts from
                    // when it was asked for, not from the pass that decided it.
                    let now_ms = (super::now_s() as i64 * 1000).max(now_ms);
                    worker.apply(a, &records, now_ms, &mut effects).await;
                }
                // Woken after this returns: the loop takes the effects in (a finished
                // handle) a moment later; `notify_one` keeps the wake-up if none waits yet.
                let _notify = NotifyOnDrop(done);
                effects
            }));
        }
    }

    pub(super) async fn publish(
        &mut self,
        summaries: &[gpuci_core::fleet::FleetSummary],
        spend: &BTreeMap<String, f64>,
    ) {
        let records = self.deps.store.machines(true).await.unwrap_or_default();
        let mut out = Vec::new();
        for run in &self.fleets {
            let s = summaries.iter().find(|s| s.fleet == run.spec.name);
            let machines: Vec<MachineStatus> = records
                .iter()
                .filter(|r| r.fleet == run.spec.name)
                .map(|r| {
                    let state = match (r.state.as_str(), self.idle_since.contains_key(&r.id)) {
                        ("ready", true) => "idle",
                        ("ready", false) => "busy",
                        (s, _) => s,
                    };
                    MachineStatus { note: self.provider_notes.get(&r.id).cloned(), ..machine_status(r, state) }
                })
                .collect();
            let count = machines.iter().filter(|m| m.state != "stopped").count() as u32;
            out.push(FleetStatus {
                name: run.spec.name.clone(),
                provider: run.spec.provider.to_string(),
                machines,
                // After this pass's actions (the summary counts before them).
                count,
                wanted: s.map_or(0, |s| s.wanted),
                max: run.spec.max,
                min_idle: run.spec.min_idle,
                // The decision, then how long idle and stopped machines are kept and why.
                why: s.map_or_else(String::new, |s| {
                    std::iter::once(s.why.as_str())
                        .chain(s.rules.iter().map(String::as_str))
                        .collect::<Vec<_>>()
                        .join("; ")
                }),
                spend_today_usd: spend.get(&run.spec.name).copied().unwrap_or(0.0),
                daily_budget_usd: run.spec.daily_budget,
                budget_reached: s.is_some_and(|s| s.budget_reached),
                breaker_open_until: s.and_then(|s| s.breaker_open_until),
                recent_errors: run.errors.iter().cloned().collect(),
                unavailable: run.unavailable_reason.clone(),
            });
        }
        // Machines of fleets no longer in the config: nothing manages them now. Said loudly,
        // and shown, so they are not left billing unseen.
        let mut orphans: BTreeMap<&str, Vec<&MachineRecord>> = BTreeMap::new();
        for r in records.iter().filter(|r| !self.fleets.iter().any(|f| f.spec.name == r.fleet)) {
            orphans.entry(r.fleet.as_str()).or_default().push(r);
        }
        for (fleet, machines) in orphans {
            let ids: Vec<&str> = machines.iter().map(|m| m.id.as_str()).collect();
            let what = format!(
                "fleet {fleet} is no longer in the config, but its machines {} still exist as far as gpuci knows: \
                 nothing deletes them now; put the fleet back (they are then managed again) or delete them at the provider",
                ids.join(", ")
            );
            if self.warned_orphans.insert(fleet.to_string()) {
                tracing::warn!("{what}");
            }
            out.push(FleetStatus {
                name: fleet.to_string(),
                provider: "?".into(),
                count: machines.len() as u32,
                unavailable: Some(what),
                machines: machines.iter().map(|r| machine_status(r, "orphaned")).collect(),
                ..FleetStatus::default()
            });
        }
        if let Ok(mut st) = self.statuses.write() {
            *st = out;
        }
    }
}

/// A stored machine, in `state`, as the fleets listing shows it.
pub(super) fn machine_status(r: &MachineRecord, state: &str) -> MachineStatus {
    MachineStatus {
        id: r.id.clone(),
        state: state.to_string(),
        provider_id: r.provider_id.clone(),
        instance_type: r.instance_type.clone(),
        zone: r.zone.clone(),
        capacity: r.capacity.clone(),
        agent_id: r.agent_id.clone(),
        requested_at_ms: r.requested_at_ms,
        running_at_ms: r.running_at_ms,
        connected_at_ms: r.connected_at_ms,
        first_job_at_ms: r.first_job_at_ms,
        note: None,
    }
}

/// Notifies the loop when dropped: after the worker's task has handed its effects back.
struct NotifyOnDrop(std::sync::Arc<tokio::sync::Notify>);

impl Drop for NotifyOnDrop {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}
