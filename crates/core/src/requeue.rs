//! Requeue and retry: whether a job that ends runs again as a new attempt, and what becomes
//! of a job whose machine is taken back or whose GPU failed its pre-job check. Pure
//! functions over one job's plain data; the coordinator's scheduler applies their answers
//! (one store commit for an end and its next attempt) and words nothing itself.
//!
//! The rules, here and nowhere else:
//! - **Retry policy.** A job that ends `failed`, `timed_out` or `lost` runs again when its
//!   step's `retry` says so ([`crate::job::should_retry`]) — except one that never left the
//!   queue (a queue timeout): it did not fail, and a retry would only wait again. The end's
//!   reason says which attempt of how many comes next.
//! - **A machine taken back** (a spot interruption notice, the provider saying the machine
//!   ended): each job assigned to it or running there ends `lost` and is queued again as its
//!   next attempt, whatever the retry policy (the job did nothing wrong) — until attempt
//!   [`MAX_INTERRUPTED_ATTEMPTS`]: a job taken back again and again (a spot market in a storm,
//!   a notice that comes and goes) then ends `lost` and says it is not queued again.
//! - **A GPU that fails its pre-job check**: an assigned job that could not start because a
//!   leased GPU was found unhealthy goes back to the queue (same attempt, assignment cleared):
//!   the GPU's fault, not the job's.
//!
//! What must not live here: I/O, clocks, the store's types. Callers hand in the job's state,
//! step and attempt; these functions hand back states and reasons.

use crate::job::{should_retry, JobState, Outcome};
use crate::pipeline::Step;

/// A job on a machine taken back is queued again until this attempt; then it ends `lost`.
pub const MAX_INTERRUPTED_ATTEMPTS: u32 = 5;

/// Whether a job that was `was` and ends `ended` on attempt `attempt` runs again under its
/// step's retry policy. A job that never left the queue (a queue timeout) is never retried.
pub fn retries(step: &Step, was: JobState, ended: JobState, attempt: u32) -> bool {
    was != JobState::Queued && should_retry(step, ended, attempt)
}

/// How a job ends, with its next attempt when the retry policy asks for one: [`on_end`]'s
/// answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    /// The ended job's reason (with "retrying (attempt n of m)" when it is retried).
    pub reason: String,
    /// The reason of the next attempt to queue in the same commit, or `None`: no retry.
    pub retry: Option<String>,
}

/// The end of job `job_id` (state `was`, attempt `attempt`, step `step`) in state `ended`
/// for `reason`, and whether it is retried.
pub fn on_end(job_id: i64, step: &Step, was: JobState, attempt: u32, ended: JobState, reason: String) -> Ending {
    if !retries(step, was, ended, attempt) {
        return Ending { reason, retry: None };
    }
    Ending {
        reason: format!("{reason}; retrying (attempt {} of {})", attempt + 1, step.retry.count + 1),
        retry: Some(format!("retry of job {job_id} ({ended})")),
    }
}

/// Whether a job that was `was` and reports `outcome` goes back to the queue because a
/// leased GPU failed its pre-job check (`unhealthy`: the GPUs the agent found unhealthy,
/// quarantined in the same commit); the queued job's reason, or `None` when the job ends as
/// its outcome says.
pub fn after_start_failed(was: JobState, outcome: &Outcome, unhealthy: &[String]) -> Option<String> {
    let gpu_failed =
        was == JobState::Assigned && matches!(outcome, Outcome::StartFailed { .. }) && !unhealthy.is_empty();
    gpu_failed.then(|| format!("requeued: GPU {} failed its health check and was quarantined", unhealthy.join(", ")))
}

/// A job on a machine being taken back, as [`on_interrupted`] needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnMachine {
    pub id: i64,
    pub state: JobState,
    pub attempt: u32,
}

/// What becomes of one job on a machine being taken back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Interruption {
    /// Ended `lost` and queued again as its next attempt, in one commit; its agent is told to
    /// stop the old run (`cancel`).
    Requeue {
        /// A line for the job's log.
        log_note: String,
        /// The ended job's reason.
        ended: String,
        /// The next attempt's reason.
        next: String,
        /// What the agent is told when asked to stop the old run.
        cancel: String,
    },
    /// Taken back too often: ended `lost` for `reason`, not queued again; the agent is told
    /// the same reason when asked to stop it.
    EndLost { reason: String },
}

/// What becomes of each job on machine `machine` (an agent's name) being taken back for
/// `notice`: those assigned to it or running there, in the order given; the others
/// (queued, or ended meanwhile) are left alone.
pub fn on_interrupted(machine: &str, notice: &str, jobs: &[OnMachine]) -> Vec<(i64, Interruption)> {
    jobs.iter()
        .filter(|j| matches!(j.state, JobState::Assigned | JobState::Running))
        .map(|j| {
            let why = format!("lost: machine {machine} is being taken back ({notice})");
            let what = if j.attempt >= MAX_INTERRUPTED_ATTEMPTS {
                Interruption::EndLost { reason: format!("{why}; not queued again: this was attempt {}", j.attempt) }
            } else {
                Interruption::Requeue {
                    log_note: format!("{why}; this run is stopped and the job queued again"),
                    ended: format!("{why}; queued again as attempt {}", j.attempt + 1),
                    next: format!("queued again: job {} was on a machine being taken back", j.id),
                    cancel: why,
                }
            };
            (j.id, what)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::RetryOn;
    use crate::pipeline::RetryPolicy;
    use JobState::*;

    fn step(count: u32, on: &[RetryOn]) -> Step {
        Step { retry: RetryPolicy { count, on: on.to_vec() }, ..Step::new("a", "true") }
    }

    #[test]
    fn a_lost_job_is_retried_until_its_count_is_spent_then_stays_lost() {
        let s = step(2, &[RetryOn::Lost]);
        let first = on_end(7, &s, Running, 1, Lost, "agent went away".into());
        assert_eq!(first.reason, "agent went away; retrying (attempt 2 of 3)");
        assert_eq!(first.retry.as_deref(), Some("retry of job 7 (lost)"));
        assert!(on_end(8, &s, Running, 2, Lost, "again".into()).retry.is_some());
        let last = on_end(9, &s, Running, 3, Lost, "and again".into());
        assert_eq!(last, Ending { reason: "and again".into(), retry: None });
    }

    #[test]
    fn only_the_outcomes_the_policy_names_are_retried() {
        let s = step(3, &[RetryOn::Lost]);
        assert_eq!(on_end(1, &s, Running, 1, Failed, "exit 1".into()).retry, None, "a failing test is not retried");
        assert_eq!(on_end(1, &s, Running, 1, Succeeded, "ok".into()).retry, None);
        assert_eq!(on_end(1, &s, Running, 1, Cancelled, "by user".into()).retry, None);
        let f = step(1, &[RetryOn::Failed, RetryOn::TimedOut]);
        assert!(on_end(1, &f, Running, 1, Failed, "exit 1".into()).retry.is_some());
        assert!(on_end(1, &f, Assigned, 1, TimedOut, "slow".into()).retry.is_some());
        assert_eq!(
            on_end(1, &step(0, &[]), Running, 1, Lost, "gone".into()).retry,
            None,
            "the default retries nothing"
        );
    }

    /// A queue timeout is not the job's failure: retrying it would only wait again.
    #[test]
    fn a_job_that_timed_out_in_the_queue_is_not_retried() {
        let s = step(3, &[RetryOn::TimedOut]);
        let e = on_end(4, &s, Queued, 1, TimedOut, "still queued after queue_timeout 1h".into());
        assert_eq!(e, Ending { reason: "still queued after queue_timeout 1h".into(), retry: None });
        assert!(!retries(&s, Queued, TimedOut, 1));
        assert!(retries(&s, Running, TimedOut, 1));
    }

    #[test]
    fn an_unhealthy_gpu_at_start_requeues_the_job_and_nothing_else_does() {
        let failed = Outcome::StartFailed { error: "GPU check failed".into() };
        let gpus = vec!["GPU-1".to_string(), "GPU-2".to_string()];
        assert_eq!(
            after_start_failed(Assigned, &failed, &gpus).as_deref(),
            Some("requeued: GPU GPU-1, GPU-2 failed its health check and was quarantined")
        );
        assert_eq!(after_start_failed(Assigned, &failed, &[]), None, "no GPU to blame: the job failed to start");
        assert_eq!(after_start_failed(Running, &failed, &gpus), None, "it had started");
        assert_eq!(after_start_failed(Assigned, &Outcome::Exited { code: 1 }, &gpus), None);
    }

    #[test]
    fn jobs_on_a_machine_taken_back_are_queued_again_until_the_last_attempt_then_lost() {
        let jobs = [
            OnMachine { id: 1, state: Running, attempt: 1 },
            OnMachine { id: 2, state: Queued, attempt: 1 },
            OnMachine { id: 3, state: Assigned, attempt: MAX_INTERRUPTED_ATTEMPTS - 1 },
            OnMachine { id: 4, state: Running, attempt: MAX_INTERRUPTED_ATTEMPTS },
            OnMachine { id: 5, state: Lost, attempt: 1 },
        ];
        let out = on_interrupted("spot-7", "spot interruption in 2 min", &jobs);
        let ids: Vec<i64> = out.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [1, 3, 4], "only assigned and running jobs are taken back");
        let why = "lost: machine spot-7 is being taken back (spot interruption in 2 min)";
        assert_eq!(
            out[0].1,
            Interruption::Requeue {
                log_note: format!("{why}; this run is stopped and the job queued again"),
                ended: format!("{why}; queued again as attempt 2"),
                next: "queued again: job 1 was on a machine being taken back".into(),
                cancel: why.into(),
            }
        );
        assert!(matches!(&out[1].1, Interruption::Requeue { ended, .. } if ended.ends_with("attempt 5")));
        assert_eq!(
            out[2].1,
            Interruption::EndLost {
                reason: format!("{why}; not queued again: this was attempt {MAX_INTERRUPTED_ATTEMPTS}")
            }
        );
    }

    /// The retry policy does not matter to a machine taken back: a step that retries nothing
    /// is queued again all the same (its attempt is not the job's fault).
    #[test]
    fn a_job_taken_back_ends_lost_only_at_its_last_attempt_whatever_its_policy() {
        for attempt in 1..MAX_INTERRUPTED_ATTEMPTS {
            let out = on_interrupted("m", "n", &[OnMachine { id: 1, state: Running, attempt }]);
            assert!(matches!(out[0].1, Interruption::Requeue { .. }), "attempt {attempt}");
        }
        let out =
            on_interrupted("m", "n", &[OnMachine { id: 1, state: Running, attempt: MAX_INTERRUPTED_ATTEMPTS + 3 }]);
        assert!(matches!(out[0].1, Interruption::EndLost { .. }));
    }
}
