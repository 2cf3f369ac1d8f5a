//! Deciding a batch of assignments ([`Store::assign_jobs`](crate::Store::assign_jobs)) from
//! what the database holds, for both backends' set-based writes: each assignment in order, as
//! one assignment at a time would be decided. Pure: the backends read, call [`decide`], write.

use crate::{JobId, JobState, NewAssignment, StoreError};
use std::collections::HashMap;

/// A batch decided: `answers[i]` is the index in `accepted` of assignment `i`, or why it was
/// refused; `accepted` are the assignments to write, in batch order.
pub(crate) struct Decided<'a> {
    pub answers: Vec<Result<usize, StoreError>>,
    pub accepted: Vec<&'a NewAssignment>,
}

/// `state`: the stored state of the batch's jobs (absent: no such job); `held`: which job
/// holds each of the batch's GPUs that is leased. A job is assigned only from `queued`, and
/// only to GPUs no one holds, an earlier assignment of the batch included.
pub(crate) fn decide<'a>(
    batch: &'a [NewAssignment],
    mut state: HashMap<JobId, JobState>,
    mut held: HashMap<String, JobId>,
) -> Decided<'a> {
    let mut answers = Vec::with_capacity(batch.len());
    let mut accepted: Vec<&NewAssignment> = Vec::new();
    for a in batch {
        let refused = match state.get(&a.job) {
            None => Some(StoreError::JobNotFound(a.job)),
            Some(s) if *s != JobState::Queued => {
                Some(StoreError::Conflict { job: a.job, expected: "queued".into(), found: *s })
            }
            Some(_) => {
                a.gpus.iter().find_map(|g| held.get(g).map(|h| StoreError::GpuLeased { gpu: g.clone(), holder: *h }))
            }
        };
        match refused {
            Some(e) => answers.push(Err(e)),
            None => {
                for g in &a.gpus {
                    held.insert(g.clone(), a.job);
                }
                state.insert(a.job, JobState::Assigned);
                answers.push(Ok(accepted.len()));
                accepted.push(a);
            }
        }
    }
    Decided { answers, accepted }
}

/// The answers of a decided batch: `Ok(())` for an accepted one (its record is now
/// [`NewAssignment::applied_to`] the one before), or why it was refused.
pub(crate) fn answer(decided: Decided<'_>) -> Vec<crate::Result<()>> {
    decided.answers.into_iter().map(|d| d.map(|_| ())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(job: JobId, gpus: &[&str]) -> NewAssignment {
        NewAssignment {
            job,
            agent_id: "agent".into(),
            agent_name: "agent".into(),
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            token_sha256: None,
        }
    }

    #[test]
    fn each_assignment_is_decided_as_if_the_earlier_ones_were_written() {
        let batch = [a(1, &["g1"]), a(2, &["g1"]), a(1, &["g2"]), a(3, &["g3"]), a(4, &["g4"]), a(5, &["g5"])];
        let state = HashMap::from([
            (1, JobState::Queued),
            (2, JobState::Queued),
            (3, JobState::Running),
            (5, JobState::Queued),
        ]);
        let held = HashMap::from([("g5".to_string(), 9)]);
        let d = decide(&batch, state, held);
        assert_eq!(d.accepted.iter().map(|a| a.job).collect::<Vec<_>>(), [1]);
        let why: Vec<String> = d.answers.iter().map(|r| format!("{r:?}")).collect();
        assert!(matches!(d.answers[0], Ok(0)));
        assert!(matches!(d.answers[1], Err(StoreError::GpuLeased { holder: 1, .. })), "{why:?}");
        assert!(matches!(d.answers[2], Err(StoreError::Conflict { job: 1, found: JobState::Assigned, .. })), "{why:?}");
        assert!(matches!(d.answers[3], Err(StoreError::Conflict { job: 3, .. })), "{why:?}");
        assert!(matches!(d.answers[4], Err(StoreError::JobNotFound(4))), "{why:?}");
        assert!(matches!(d.answers[5], Err(StoreError::GpuLeased { holder: 9, .. })), "{why:?}");
    }
}
