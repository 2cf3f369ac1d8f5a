//! An agent that connects (again): what becomes of the jobs we recorded for it against the
//! jobs it says it holds. One pure function, [`reconcile`], and the reasons its requeues and
//! losses carry; the coordinator's scheduler applies them before it welcomes the agent.
//!
//! The rules, here and nowhere else:
//! - The agent journals an assignment before it starts it, so a job assigned to it that it
//!   does not hold never started there: it goes back to the queue (same attempt).
//! - A job we recorded as running there that it does not hold, it must have lost (its data
//!   dir was replaced): ended `lost`, its outcome unknown.
//! - When the agent says its journal may lack records, a job it does not hold may have
//!   started there all the same: ended `lost` too, never handed out again as if it had not
//!   run.
//! - A job it holds that is not ours (or no longer) it is told to forget, with why.
//! - A job being cancelled (the cancel was accepted while the agent was away) that it does not
//!   hold is over: it ends `cancelled`, never queued again nor called lost. One it holds is
//!   kept, and the coordinator sends the cancel again.
//!
//! What must not live here: I/O, the store's types, the protocol's messages.

use crate::job::JobState;
use std::collections::BTreeSet;

/// What to do with an agent's jobs when it connects: [`reconcile`]'s answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Ours and held by the agent: its events (start, output, result) will follow.
    pub keep: Vec<i64>,
    /// Held by the agent but not (or no longer) ours: it is told why and stops them.
    pub forget: Vec<i64>,
    /// Assigned to it, never received: back to the queue ([`requeue_reason`]).
    pub requeue: Vec<i64>,
    /// Running on it by our record (or assigned, when its journal is incomplete), unknown to
    /// it: ended `lost` ([`lost_reason`]).
    pub lost: Vec<i64>,
    /// Being cancelled, and unknown to it: ended `cancelled`, with the cancel's reason.
    pub cancelled: Vec<i64>,
}

/// Settle an agent's jobs on connect. `ours`: the active jobs assigned to it, with their
/// state; `holds`: the jobs it holds (its journal: received and not yet acknowledged as
/// finished); `journal_incomplete`: it says its journal may lack records; `cancelling`:
/// those of `ours` whose cancel is under way.
pub fn reconcile(ours: &[(i64, JobState)], holds: &[i64], journal_incomplete: bool, cancelling: &[i64]) -> Reconciled {
    let held: BTreeSet<i64> = holds.iter().copied().collect();
    let mine: BTreeSet<i64> = ours.iter().map(|(id, _)| *id).collect();
    let mut r = Reconciled { forget: held.difference(&mine).copied().collect(), ..Default::default() };
    for (id, state) in ours {
        match (held.contains(id), state) {
            (true, _) => r.keep.push(*id),
            (false, _) if cancelling.contains(id) => r.cancelled.push(*id),
            (false, JobState::Assigned) if !journal_incomplete => r.requeue.push(*id),
            (false, _) => r.lost.push(*id),
        }
    }
    r
}

/// The reason of a job queued again because agent `agent` (its name) came back without
/// having received it.
pub fn requeue_reason(agent: &str) -> String {
    format!("requeued: agent {agent} reconnected without having received it")
}

/// The reason of a job ended `lost` because agent `agent` came back without it; `journal_gap`:
/// what the agent said its journal lacks, if it did.
pub fn lost_reason(agent: &str, journal_gap: Option<&str>) -> String {
    match journal_gap {
        Some(gap) => format!(
            "agent {agent} came back saying {gap}; it may have received and started this job, so it is not \
             handed out again as never received; the job's outcome and any output not yet received are unknown"
        ),
        None => format!(
            "agent {agent} came back without any record of this job (its data dir was lost or replaced); \
             the job's outcome and any output not yet received are unknown"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobState::*;

    #[test]
    fn a_job_never_received_is_queued_again_and_one_that_ran_is_lost() {
        let plan = reconcile(&[(1, Assigned), (2, Running), (3, Running), (4, Assigned)], &[3, 4, 9], false, &[]);
        assert_eq!(
            plan,
            Reconciled { keep: vec![3, 4], forget: vec![9], requeue: vec![1], lost: vec![2], cancelled: vec![] }
        );
    }

    #[test]
    fn with_an_incomplete_journal_nothing_unheld_is_handed_out_again() {
        let plan = reconcile(&[(1, Assigned), (2, Running)], &[], true, &[]);
        assert_eq!(plan, Reconciled { lost: vec![1, 2], ..Default::default() });
        assert!(lost_reason("gpu-1", Some("its journal was cut short")).contains("may have received and started"));
        assert!(lost_reason("gpu-1", None).contains("data dir was lost or replaced"));
        assert_eq!(requeue_reason("gpu-1"), "requeued: agent gpu-1 reconnected without having received it");
    }

    /// A cancel accepted while the agent was away: a job it never received is not queued
    /// again (it would run after its cancel), one it lost track of is cancelled, not lost, and
    /// one it still holds is kept (the cancel is sent again).
    #[test]
    fn a_job_being_cancelled_ends_cancelled_unless_the_agent_still_holds_it() {
        let ours = [(1, Assigned), (2, Running), (3, Running), (4, Assigned)];
        let plan = reconcile(&ours, &[3], false, &[1, 2, 3]);
        assert_eq!(plan, Reconciled { keep: vec![3], requeue: vec![4], cancelled: vec![1, 2], ..Default::default() });
        let plan = reconcile(&ours, &[], true, &[4]);
        assert_eq!(plan, Reconciled { lost: vec![1, 2, 3], cancelled: vec![4], ..Default::default() });
    }
}
