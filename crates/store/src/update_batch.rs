//! Deciding a batch of state changes ([`Store::update_jobs`](crate::Store::update_jobs)) from
//! the stored states of its jobs, for the backends' set-based writes: each change in order, as
//! one change at a time would be decided. Pure: the backends read, call [`decide`], write.

use crate::{JobId, JobState, JobUpdate, StoreError};
use std::collections::{HashMap, HashSet};

/// A batch decided: `answers[i]` is the index in `accepted` of change `i`, or why it was
/// refused; `accepted` are the changes to write, in batch order.
pub(crate) struct Decided<'a> {
    pub answers: Vec<Result<usize, StoreError>>,
    pub accepted: Vec<&'a JobUpdate>,
}

impl Decided<'_> {
    /// The accepted changes' jobs whose assignment is forgotten (back to the queue).
    pub fn cleared(&self) -> Vec<JobId> {
        self.accepted.iter().filter(|u| u.change.clear_assignment).map(|u| u.job).collect()
    }

    /// The accepted changes' jobs whose GPU leases are released (ended, or back to the queue).
    pub fn released(&self) -> Vec<JobId> {
        self.accepted.iter().filter(|u| u.change.release_leases || u.change.clear_assignment).map(|u| u.job).collect()
    }
}

/// Whether a set-based write can apply the batch: no job in it twice (one row of a set-based
/// `UPDATE … FROM` per job; a job changed twice in one batch is written change by change).
pub(crate) fn each_job_once(batch: &[JobUpdate]) -> bool {
    let mut seen = HashSet::with_capacity(batch.len());
    batch.iter().all(|u| seen.insert(u.job))
}

/// `state`: the stored state of the batch's jobs (absent: no such job). A change is refused
/// when its job is not found or is in none of the states it expects (an empty `expect`
/// expects any); a refused change writes nothing and the others stand.
pub(crate) fn decide(batch: &[JobUpdate], mut state: HashMap<JobId, JobState>) -> Decided<'_> {
    let mut answers = Vec::with_capacity(batch.len());
    let mut accepted: Vec<&JobUpdate> = Vec::with_capacity(batch.len());
    for u in batch {
        match state.get(&u.job).copied() {
            None => answers.push(Err(StoreError::JobNotFound(u.job))),
            Some(found) if !u.expect.is_empty() && !u.expect.contains(&found) => {
                let expected = u.expect.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("|");
                answers.push(Err(StoreError::Conflict { job: u.job, expected, found }));
            }
            Some(found) => {
                state.insert(u.job, u.change.state.unwrap_or(found));
                answers.push(Ok(accepted.len()));
                accepted.push(u);
            }
        }
    }
    Decided { answers, accepted }
}

/// The answers of a decided batch: `Ok(())` for an accepted change (its job's record is now
/// [`JobChange::applied_to`](crate::JobChange::applied_to) the one before), or why it was
/// refused.
pub(crate) fn answer(decided: Decided<'_>) -> Vec<crate::Result<()>> {
    decided.answers.into_iter().map(|d| d.map(|_| ())).collect()
}

/// The jobs a batch's accepted changes ended (their token rows go with them).
pub(crate) fn ended(batch: &[JobUpdate], out: &[crate::Result<()>]) -> Vec<JobId> {
    batch
        .iter()
        .zip(out)
        .filter(|(u, r)| r.is_ok() && u.change.state.is_some_and(JobState::is_terminal))
        .map(|(u, _)| u.job)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobChange;

    fn u(job: JobId, expect: &[JobState], to: Option<JobState>) -> JobUpdate {
        JobUpdate { job, expect: expect.to_vec(), change: JobChange { state: to, ..Default::default() } }
    }

    #[test]
    fn each_change_is_decided_against_the_state_the_earlier_ones_left() {
        use JobState::*;
        let batch = [
            u(1, &[Assigned], Some(Running)),
            u(1, &[Assigned], Some(Failed)),
            u(1, &[Running], Some(Succeeded)),
            u(2, &[], None),
            u(3, &[Running], Some(Succeeded)),
            u(4, &[Queued], Some(Cancelled)),
        ];
        let state = HashMap::from([(1, Assigned), (2, Cancelled), (3, Cancelled)]);
        let d = decide(&batch, state);
        assert_eq!(d.accepted.iter().map(|a| a.job).collect::<Vec<_>>(), [1, 1, 2]);
        let why: Vec<String> = d.answers.iter().map(|r| format!("{r:?}")).collect();
        assert!(matches!(d.answers[0], Ok(0)), "{why:?}");
        assert!(matches!(d.answers[1], Err(StoreError::Conflict { job: 1, found: Running, .. })), "{why:?}");
        assert!(matches!(d.answers[2], Ok(1)), "{why:?}");
        assert!(matches!(d.answers[3], Ok(2)), "an empty expect takes any state: {why:?}");
        assert!(matches!(d.answers[4], Err(StoreError::Conflict { job: 3, found: Cancelled, .. })), "{why:?}");
        assert!(matches!(d.answers[5], Err(StoreError::JobNotFound(4))), "{why:?}");
        assert!(!each_job_once(&batch));
        assert!(each_job_once(&batch[2..]));
    }
}
