//! Carrying out one fleet's actions through its provider, off the loop's task, so that a slow
//! or hanging provider holds up its own fleet only. Each result comes back to the loop as an
//! [`super::Effect`]; the worker keeps no state of its own and decides nothing.

use super::launch::{agent_args, local_agent_program};
use super::{capacity_of, Effect, Worker};
use crate::brain::Command;
use gpuci_core::fleet::{offer_unavailable_after_error, Action, Capacity, SkipCause};
use gpuci_providers::{AgentLaunch, CreateRequest, ProviderState, TAG_COORDINATOR, TAG_FLEET, TAG_MACHINE};
use gpuci_store::MachineRecord;
use std::collections::BTreeMap;

impl Worker {
    pub(super) async fn apply(
        &self,
        action: &Action,
        records: &BTreeMap<String, MachineRecord>,
        now_ms: i64,
        out: &mut Vec<Effect>,
    ) {
        let p = &self.provider;
        match action {
            Action::Create { offer, capacity, reason, .. } => self.create(*offer, *capacity, reason, now_ms, out).await,
            Action::Delete { machine, reason } | Action::BootFailed { machine, reason } => {
                let boot_failed = matches!(action, Action::BootFailed { .. });
                let Some(rec) = records.get(machine) else { return };
                tracing::info!(fleet = %rec.fleet, machine = %machine, "deleting: {reason}");
                match p.delete(machine).await {
                    Ok(()) => {
                        let ended = MachineRecord {
                            state: "ended".into(),
                            reason: Some(reason.clone()),
                            ended_at_ms: Some(now_ms),
                            boot_failed,
                            ..rec.clone()
                        };
                        let _ = self.store.put_machine(&ended).await;
                        let _ = self.store.close_billing(machine, now_ms).await;
                        out.push(Effect::Gone(machine.clone()));
                        if boot_failed {
                            // A machine of this offer that never came up: the next one would
                            // likely not either (a broken image, a wrong network). Skip the
                            // offer for a while instead of paying for boots in a loop.
                            if let Some(o) = self.offer_of(rec) {
                                let capacity = capacity_of(rec);
                                out.push(Effect::Unavailable(
                                    offer_unavailable_after_error(&rec.fleet, o, capacity, now_ms as u64 / 1000)
                                        .because(SkipCause::BootFailed, format!("machine {machine}: {reason}")),
                                ));
                            }
                            out.push(Effect::Error(format!(
                                "machine {machine}: {reason}; deleted, and its offer ({} in {}) skipped for a while",
                                rec.instance_type, rec.zone
                            )));
                        }
                    }
                    Err(e) => {
                        self.restore(rec).await;
                        out.push(Effect::Error(format!("deleting machine {machine}: {e}")));
                    }
                }
            }
            Action::Stop { machine, reason } => {
                let Some(rec) = records.get(machine) else { return };
                tracing::info!(fleet = %rec.fleet, machine = %machine, "stopping: {reason}");
                match p.stop(machine).await {
                    Ok(_) => {
                        let stopped =
                            MachineRecord { state: "stopped".into(), reason: Some(reason.clone()), ..rec.clone() };
                        let _ = self.store.put_machine(&stopped).await;
                        let _ = self.store.close_billing(machine, now_ms).await;
                        out.push(Effect::Gone(machine.clone()));
                    }
                    Err(e) => {
                        self.restore(rec).await;
                        out.push(Effect::Error(format!("stopping machine {machine}: {e}")));
                    }
                }
            }
            Action::Start { machine, reason } => {
                let Some(rec) = records.get(machine) else { return };
                tracing::info!(fleet = %rec.fleet, machine = %machine, "starting: {reason}");
                // Recorded as booting before it is asked for, as a create is: a start the
                // provider carried out but did not answer (a timeout, a coordinator killed in
                // between) leaves a row whose agent from before the stop does not count (else
                // the running machine read as one whose agent had gone, was deleted, and
                // another made). A start that did not happen is seen stopped by the next pass.
                let started = MachineRecord {
                    state: "booting".into(),
                    reason: Some(reason.clone()),
                    // Boot stages count again from this start.
                    requested_at_ms: now_ms,
                    running_at_ms: None,
                    connected_at_ms: None,
                    first_job_at_ms: None,
                    agent_id: None,
                    ..rec.clone()
                };
                if let Err(e) = self.store.put_machine(&started).await {
                    out.push(Effect::Error(format!("cannot record the start of machine {machine}: {e}")));
                    return;
                }
                match p.start(machine).await {
                    Ok(pm) => {
                        if let Some(o) = self.offer_of(rec) {
                            out.push(Effect::Took { fleet: rec.fleet.clone(), offer: o, capacity: capacity_of(rec) });
                        }
                        let from = pm.launched_at.map_or(now_ms, |t| (t as i64 * 1000).max(now_ms));
                        let _ = self.store.open_billing(machine, from).await;
                    }
                    Err(e) => {
                        // A start refused for want of capacity did not happen: the row is as it
                        // was (its agent, whose jobs its cost report counts). Any other error
                        // leaves the outcome unknown, and the booting row stands for the next
                        // pass to judge by what the provider lists.
                        if e.is_capacity() {
                            let _ = self.store.put_machine(rec).await;
                        }
                        // A stopped machine is pinned to its offer: a start refused for want of
                        // capacity skips the offer as a failed create does, so the autoscaler
                        // creates on another offer instead of starting this one every pass.
                        if e.is_capacity() {
                            if let Some(o) = self.offer_of(rec) {
                                let cause = match e.kind {
                                    gpuci_providers::ErrorKind::Refused => SkipCause::Refused,
                                    _ => SkipCause::Capacity,
                                };
                                out.push(Effect::Unavailable(
                                    offer_unavailable_after_error(
                                        &rec.fleet,
                                        o,
                                        capacity_of(rec),
                                        now_ms as u64 / 1000,
                                    )
                                    .because(cause, format!("starting machine {machine}: {}", e.message)),
                                ));
                            }
                        }
                        out.push(Effect::Error(format!("starting machine {machine}: {e}")));
                    }
                }
            }
        }
    }

    /// The machine stays after all: its agent takes jobs again.
    pub(super) async fn restore(&self, rec: &MachineRecord) {
        if let Some(agent) = rec.agent_id.clone() {
            let _ = self.brain.send(Command::Restore { agent }).await;
        }
    }

    pub(super) fn offer_of(&self, rec: &MachineRecord) -> Option<usize> {
        self.spec.offers.iter().position(|o| o.instance_type == rec.instance_type && o.zone == rec.zone)
    }

    pub(super) async fn create(
        &self,
        offer_at: usize,
        capacity: Capacity,
        reason: &str,
        now_ms: i64,
        out: &mut Vec<Effect>,
    ) {
        let fleet = &self.spec;
        let Some(offer) = fleet.offers.get(offer_at).cloned() else { return };
        let id = format!("m-{}", &uuid::Uuid::now_v7().simple().to_string()[..16]);
        let rec = MachineRecord {
            id: id.clone(),
            fleet: fleet.name.clone(),
            provider_id: None,
            instance_type: offer.instance_type.clone(),
            zone: offer.zone.clone(),
            capacity: capacity.as_str().into(),
            price_per_hour: offer.price(capacity),
            gpus: fleet.machine.gpus,
            state: "requested".into(),
            reason: Some(reason.to_string()),
            agent_id: None,
            requested_at_ms: now_ms,
            running_at_ms: None,
            connected_at_ms: None,
            first_job_at_ms: None,
            ended_at_ms: None,
            boot_failed: false,
            interrupted_at_ms: None,
        };
        // Recorded before it is asked for: a crash in between leaves a row the next pass ends
        // (never listed) or joins with what the provider made (listed, by its tag).
        if let Err(e) = self.store.put_machine(&rec).await {
            out.push(Effect::Error(format!("cannot record a new machine: {e}")));
            return;
        }
        let mut tags = fleet.machine.tags.clone();
        tags.insert(TAG_COORDINATOR.into(), self.coordinator_id.clone());
        tags.insert(TAG_FLEET.into(), fleet.name.clone());
        tags.insert(TAG_MACHINE.into(), id.clone());
        let setting = |k: &str| fleet.settings.get(k);
        let agent = AgentLaunch {
            server: setting("server").and_then(|v| v.as_str()).unwrap_or(&self.server_url).to_string(),
            // Its own token, spent by its agent's registration: never the coordinator's, which
            // a job on the machine could read back (EC2 user data, a provider's files).
            registration_token: crate::auth::machine_token(
                &crate::auth::Secret::new(self.registration_token.clone()),
                &id,
            ),
            coordinator_key: Some(self.coordinator_key.clone()),
            tags,
            name: format!("{}-{id}", fleet.name),
            program: match setting("agent_program").and_then(|v| v.as_str()) {
                Some(p) => p.to_string(),
                // A local machine runs the agent of this very build.
                None if fleet.provider == gpuci_core::fleet::ProviderKind::Local => local_agent_program(),
                None => "gpuci".to_string(),
            },
            extra_args: agent_args(&fleet.settings),
        };
        tracing::info!(fleet = %fleet.name, machine = %id, offer = %offer.label(), %capacity, "creating: {reason}");
        let req = CreateRequest { machine: id.clone(), offer: offer.clone(), capacity, agent };
        let answer = self.provider.create(&req).await.and_then(|pm| {
            if pm.machine == id {
                Ok(pm)
            } else {
                let shown: String = pm.machine.chars().take(80).collect();
                Err(gpuci_providers::ProviderError::new(
                    gpuci_providers::ErrorKind::Invalid,
                    format!("the provider answered a create of {id} with machine {shown:?}"),
                ))
            }
        });
        match answer {
            Ok(pm) => {
                out.push(Effect::Took { fleet: fleet.name.clone(), offer: offer_at, capacity });
                let made = MachineRecord {
                    provider_id: Some(pm.provider_id.clone()),
                    state: "booting".into(),
                    running_at_ms: (pm.state == ProviderState::Running).then_some(now_ms),
                    ..rec
                };
                let _ = self.store.put_machine(&made).await;
                let from = pm.launched_at.map_or(now_ms, |t| t as i64 * 1000);
                let _ = self.store.open_billing(&id, from).await;
            }
            Err(e) => {
                let capacity_error = e.is_capacity();
                if capacity_error {
                    // Which it was decides what the fleet says: "a capacity error" of a
                    // cluster's refusal sends people looking for capacity.
                    let cause = match e.kind {
                        gpuci_providers::ErrorKind::Refused => SkipCause::Refused,
                        _ => SkipCause::Capacity,
                    };
                    out.push(Effect::Unavailable(
                        offer_unavailable_after_error(&fleet.name, offer_at, capacity, now_ms as u64 / 1000)
                            .because(cause, e.message.clone()),
                    ));
                }
                let what = format!(
                    "{} for {} ({capacity}){}",
                    e.message,
                    offer.label(),
                    if capacity_error { "; trying the next offer" } else { "" }
                );
                out.push(Effect::Error(what.clone()));
                let ended =
                    MachineRecord { state: "ended".into(), reason: Some(what), ended_at_ms: Some(now_ms), ..rec };
                let _ = self.store.put_machine(&ended).await;
            }
        }
    }
}
