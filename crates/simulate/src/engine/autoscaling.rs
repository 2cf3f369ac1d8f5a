//! The coordinator's fleets loop, played on the simulated clock: ask the autoscaler
//! ([`gpuci_core::fleet::decide`]) what to do and apply its actions to the simulated provider
//! (creates and starts that may meet an outage, stops, deletes, billing and spend). It decides
//! nothing itself: the decisions are `decide`'s, as in the coordinator.

use super::{Engine, Ev, Extra, JobState, Mode};
use gpuci_core::fleet::{
    decide, offer_unavailable_after_error, Action, AutoscaleInput, Capacity, Machine, MachineState, StepState,
};
use std::collections::BTreeMap;

impl Engine<'_> {
    pub(super) fn autoscale(&mut self) {
        let now = self.now;
        self.unavailable.retain(|u| u.until > now);
        self.backoffs.forget(now);
        for spec in &self.fleets {
            if let Some(times) = self.interruptions.get_mut(&spec.name) {
                let keep = spec.spot_breaker.window_s + spec.spot_breaker.on_demand_for_s;
                times.retain(|&t| t + keep > now);
            }
        }
        if self.any_budget {
            self.update_spend();
        }
        // The learned idle hold and level ups read a day of arrivals and ends: worked out
        // again once a simulated minute (the coordinator does it every pass).
        if self.mode == Mode::Decide {
            for spec in &self.fleets {
                if let Some(h) = self.history.get_mut(&spec.name) {
                    if h.learned_ups.as_ref().is_none_or(|(at, _)| now >= at + 60) {
                        h.relearn(spec, now);
                    }
                }
            }
        }
        for h in self.history.values_mut() {
            if let Some(p) = h.profile.as_mut() {
                p.observe_until(now);
            }
        }
        // The blocked jobs' expected starts (the gpuci policy only: the baselines react to the
        // queue alone).
        let upcoming = if self.mode == Mode::Decide {
            let jobs = &self.jobs;
            let (fleets, job_fleet) = (&self.fleets, &self.job_fleet);
            self.pipelines.upcoming(
                self.trace,
                |j| match jobs[j].state {
                    JobState::Pending | JobState::Blocked => Some(StepState::Blocked),
                    JobState::Queued => Some(StepState::Queued),
                    JobState::Running { start, .. } | JobState::Off { start } => {
                        Some(StepState::Running { since: start })
                    }
                    JobState::Done => None,
                },
                |j| job_fleet[j].map(|f| fleets[f].name.clone()),
                now,
            )
        } else {
            Vec::new()
        };
        let decision = decide(&AutoscaleInput {
            now,
            fleets: &self.fleets,
            queued: &self.queue,
            machines: &self.live,
            spend_today: &self.spend,
            budgets: &[],
            repo_spend_today: &BTreeMap::new(),
            unavailable: &self.unavailable,
            interruptions: &self.interruptions,
            history: &self.history,
            upcoming: &upcoming,
        });
        for action in decision.actions {
            self.apply(action);
        }
        if let Some(w) = decision.wake_at.filter(|&w| w > now) {
            if self.wakes.insert(w) {
                self.push(w, Ev::Wake);
            }
        }
    }

    fn update_spend(&mut self) {
        let day = self.now / 86_400;
        if day != self.day {
            self.day = day;
            self.closed_today.iter_mut().for_each(|c| *c = 0.0);
        }
        let day_start = day * 86_400;
        let mut spend = self.closed_today.clone();
        for x in &self.extra {
            if let Some(from) = x.billed_from {
                spend[x.fleet] += self.now.saturating_sub(from.max(day_start)) as f64 * x.price_per_hour / 3600.0;
            }
        }
        for (f, s) in spend.into_iter().enumerate() {
            self.spend.insert(self.fleets[f].name.clone(), s);
        }
    }

    /// What the fleet's history remembers of its offers' outages (as the coordinator keeps it):
    /// a refusal for want of capacity opens one, a create or start the provider took ends it.
    fn outage_seen(&mut self, f: usize, offer: usize, capacity: Capacity, took: bool) {
        let now = self.now;
        if let Some(h) = self.history.get_mut(&self.fleets[f].name) {
            if took {
                h.took(offer, capacity, now);
            } else {
                h.refused(offer, capacity, now);
            }
        }
    }

    fn machine_index(&self, id: &str) -> Option<usize> {
        self.live.iter().position(|m| m.id == id)
    }

    fn apply(&mut self, action: Action) {
        let now = self.now;
        match action {
            Action::Create { fleet, offer, capacity, .. } => {
                let Some(f) = self.fleets.iter().position(|s| s.name == fleet) else { return };
                // A fleet whose jobs are all done makes nothing more (`Engine::left`).
                if self.closed[f] {
                    return;
                }
                if self.refused(f, offer, capacity, false) {
                    self.tally[f].capacity_errors += 1;
                    let skip = self.backoffs.error(offer_unavailable_after_error(&fleet, offer, capacity, now), now);
                    self.unavailable.push(skip);
                    self.outage_seen(f, offer, capacity, false);
                    self.wake_after_refusal();
                    return;
                }
                self.backoffs.success(&fleet, offer, capacity);
                self.outage_seen(f, offer, capacity, true);
                let num = self.next_machine;
                self.next_machine += 1;
                let spec = &self.fleets[f];
                let price = spec.offers.get(offer).map_or(0.0, |o| o.price(capacity));
                self.live.push(Machine {
                    id: format!("m-{num:07}"),
                    fleet,
                    offer,
                    capacity,
                    state: MachineState::Booting,
                    created_at: now,
                    since: now,
                    gpus_busy: 0,
                    jobs: Vec::new(),
                    note: None,
                });
                self.extra.push(Extra {
                    num,
                    fleet: f,
                    epoch: 0,
                    billed_from: Some(now),
                    price_per_hour: price,
                    gpus: spec.machine.gpus,
                    exists_from: now,
                    stopped_from: None,
                    disk_usd_per_hour: self.offers[f].get(offer).map_or(0.0, |o| o.disk_usd_per_hour),
                    starting: false,
                });
                self.tally[f].launched += 1;
                let boot = self.profiles[f].boot.sample(&mut self.rng_boot[f]);
                self.push(now + boot, Ev::Ready { machine: num, epoch: 0 });
                self.arm_interruption(self.live.len() - 1);
            }
            Action::Start { machine, .. } => {
                let Some(k) = self.machine_index(&machine) else { return };
                if self.live[k].state != MachineState::Stopped {
                    return;
                }
                let f = self.extra[k].fleet;
                let (offer, capacity) = (self.live[k].offer, self.live[k].capacity);
                if self.refused(f, offer, capacity, true) {
                    // It stays stopped; the autoscaler hears of it as of a failed create.
                    self.tally[f].start_capacity_errors += 1;
                    let name = self.fleets[f].name.clone();
                    let skip = self.backoffs.error(offer_unavailable_after_error(&name, offer, capacity, now), now);
                    self.unavailable.push(skip);
                    self.outage_seen(f, offer, capacity, false);
                    self.wake_after_refusal();
                    return;
                }
                let name = self.fleets[f].name.clone();
                self.backoffs.success(&name, offer, capacity);
                self.outage_seen(f, offer, capacity, true);
                self.end_stopped(k);
                self.extra[k].epoch += 1;
                self.extra[k].billed_from = Some(now);
                self.extra[k].starting = true;
                self.live[k].state = MachineState::Booting;
                self.live[k].since = now;
                self.tally[f].starts += 1;
                let t = self.profiles[f].start.sample(&mut self.rng_boot[f]);
                let (num, epoch) = (self.extra[k].num, self.extra[k].epoch);
                self.push(now + t, Ev::Ready { machine: num, epoch });
                self.arm_interruption(k);
            }
            Action::Stop { machine, .. } => {
                let Some(k) = self.machine_index(&machine) else { return };
                let f = self.extra[k].fleet;
                self.extra[k].epoch += 1;
                self.live[k].state = MachineState::Stopping;
                self.live[k].since = now;
                let t = self.profiles[f].stop.sample(&mut self.rng_boot[f]);
                let (num, epoch) = (self.extra[k].num, self.extra[k].epoch);
                self.push(now + t, Ev::Stopped { machine: num, epoch });
            }
            Action::Delete { machine, .. } => {
                if let Some(k) = self.machine_index(&machine) {
                    self.close_billing(k);
                    self.close_disk(k);
                    self.remove(k);
                }
            }
            Action::BootFailed { machine, .. } => {
                if let Some(k) = self.machine_index(&machine) {
                    self.tally[self.extra[k].fleet].boot_failures += 1;
                    self.close_billing(k);
                    self.close_disk(k);
                    self.remove(k);
                }
            }
        }
    }

    /// A spot machine gets its interruption time when it is created or started.
    fn arm_interruption(&mut self, k: usize) {
        if self.live[k].capacity != Capacity::Spot {
            return;
        }
        let f = self.extra[k].fleet;
        let rate = self.offers[f].get(self.live[k].offer).map_or(0.0, |o| o.spot_interruptions_per_hour) / 3600.0;
        let after = self.rng_spot[f].exp(rate);
        if after.is_finite() && after < 1e12 {
            let (num, epoch) = (self.extra[k].num, self.extra[k].epoch);
            self.push(self.now + (after.ceil() as u64).max(1), Ev::Interrupt { machine: num, epoch });
        }
    }
}
