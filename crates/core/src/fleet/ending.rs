//! How a fleet machine that has ended at its provider is booked: a boot failure, a machine
//! taken back, or one its fleet retired itself.
//!
//! The rule is judged by the agent's registration, which the coordinator records durably the
//! moment the agent connects — never by whether the last reconcile pass happened to see the
//! agent connected. A Slurm allocation cancelled a second after its agent registered (a
//! `scancel`, a preemption, a first job that OOM-kills the allocation, a node failure) falls
//! between two passes; booking it as a boot failure would skip the fleet's offer for
//! [`super::CAPACITY_ERROR_BACKOFF_S`], tell the requeued job "every offer had a capacity
//! error", and leave the jobs of an agent killed without a word to `lost_after`.
//!
//! - **Retired**: its fleet deleted or stopped it (the row already says so): nothing to do.
//! - **Taken back**: an agent registered from it: the jobs that agent was given are queued
//!   again, once, as for a spot interruption; the offer is not penalised (the machine booted,
//!   so the image and the offer work).
//! - **Boot failure**: the provider showed it ending and no agent ever registered from it: its
//!   offer is skipped for a while, so a broken image is not booted in a loop.
//! - **Vanished**: no longer listed, never registered, never seen ending: nothing says it
//!   failed (a listing can lose a machine), so no penalty; the next pass decides afresh.

use serde::Serialize;

/// What is known of a machine found ended, as plain data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndedMachine<'a> {
    /// The provider listed it as ended (rather than no longer listing it at all).
    pub seen_ending: bool,
    /// The agent that registered from it, if one ever did (from the durable registration).
    pub registered_agent: Option<&'a str>,
    /// Its fleet deleted or stopped it itself (its row is `ended` or `stopped` already).
    pub retired_by_fleet: bool,
}

/// How an ended machine is booked ([module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "end", rename_all = "snake_case")]
pub enum MachineEnd {
    Retired,
    /// Queue the agent's jobs again, once; no offer penalty.
    TakenBack {
        agent: String,
    },
    /// Skip its offer for a while.
    BootFailure,
    Vanished,
}

impl MachineEnd {
    /// The machine row's end reason when the provider gave none.
    pub fn reason(&self) -> &'static str {
        match self {
            MachineEnd::Retired => "deleted or stopped by its fleet",
            MachineEnd::TakenBack { .. } => {
                "ended at the provider after its agent registered; its jobs were queued again"
            }
            MachineEnd::BootFailure => "ended before its agent connected",
            MachineEnd::Vanished => "gone at the provider",
        }
    }
}

/// Book an ended machine. Pure; the fleets loop applies the answer.
pub fn classify_end(m: &EndedMachine<'_>) -> MachineEnd {
    match (m.retired_by_fleet, m.registered_agent, m.seen_ending) {
        (true, _, _) => MachineEnd::Retired,
        (false, Some(agent), _) => MachineEnd::TakenBack { agent: agent.to_string() },
        (false, None, true) => MachineEnd::BootFailure,
        (false, None, false) => MachineEnd::Vanished,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(seen_ending: bool, registered_agent: Option<&str>, retired_by_fleet: bool) -> MachineEnd {
        classify_end(&EndedMachine { seen_ending, registered_agent, retired_by_fleet })
    }

    #[test]
    fn an_allocation_cancelled_after_its_agent_registered_is_taken_back_not_a_boot_failure() {
        // The last pass never saw the agent connected; the registration is what counts.
        assert_eq!(ended(true, Some("a1"), false), MachineEnd::TakenBack { agent: "a1".into() });
        // Also when the provider no longer lists it at all (a pod deleted with its node).
        assert_eq!(ended(false, Some("a1"), false), MachineEnd::TakenBack { agent: "a1".into() });
    }

    #[test]
    fn a_machine_that_ended_before_any_agent_registered_is_a_boot_failure() {
        assert_eq!(ended(true, None, false), MachineEnd::BootFailure);
    }

    #[test]
    fn a_machine_that_only_vanished_from_the_listing_is_not_penalised() {
        assert_eq!(ended(false, None, false), MachineEnd::Vanished);
    }

    #[test]
    fn what_its_fleet_deleted_or_stopped_is_retired_whatever_else_is_known() {
        for seen in [false, true] {
            for agent in [None, Some("a1")] {
                assert_eq!(ended(seen, agent, true), MachineEnd::Retired);
            }
        }
    }

    #[test]
    fn every_end_has_a_reason_in_words() {
        for e in [
            MachineEnd::Retired,
            MachineEnd::TakenBack { agent: "a".into() },
            MachineEnd::BootFailure,
            MachineEnd::Vanished,
        ] {
            assert!(!e.reason().is_empty());
        }
    }
}
