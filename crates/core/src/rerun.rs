//! "Retry failed" on a pipeline: which of its jobs run again. A pure function over the
//! pipeline's jobs; the coordinator queues a new attempt of each job it names.
//!
//! The rules, here and nowhere else:
//! - Only the **latest attempt** of each step counts (an earlier failure retried since is
//!   history).
//! - A step is retried when its latest attempt ended `failed`, `timed_out` or `lost` and is
//!   not a soft failure (`crate::progress::is_soft_failure`: it did not fail the pipeline).
//!   `cancelled` is not retried: somebody chose to stop it (retry that job by hand).
//! - Every step that depends on a retried step, directly or through others, runs again too
//!   when its latest attempt has ended, whatever the outcome (it was skipped because of the
//!   failure, or ran with `allow_dependency_failure` against the failed result). A step
//!   skipped by its `if:` stays skipped: the condition has not changed. A dependent still
//!   queued or running is left alone: it waits on the new attempt (the gate reads latest
//!   attempts).
//! - Nothing to retry is an empty answer, not an error: the caller says so.

use crate::job::JobState;
use std::collections::{BTreeMap, BTreeSet};

/// A job of the pipeline, as this decision needs it.
#[derive(Clone, Copy, Debug)]
pub struct PipelineJob<'a> {
    pub job_id: i64,
    pub step_key: &'a str,
    pub depends_on: &'a [String],
    pub state: JobState,
    pub soft_failed: bool,
    pub skipped_by_condition: bool,
}

/// Why a job runs again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// It failed, timed out or was lost.
    Failed,
    /// It depends on `0` (a step key), which runs again.
    DependsOn(String),
}

/// The job ids (latest attempts) to run again, oldest first, each with why.
pub fn retry_failed<'a>(jobs: impl IntoIterator<Item = PipelineJob<'a>>) -> Vec<(i64, Why)> {
    let mut latest: BTreeMap<&str, PipelineJob<'a>> = BTreeMap::new();
    for j in jobs {
        match latest.get(j.step_key) {
            Some(o) if o.job_id > j.job_id => {}
            _ => {
                latest.insert(j.step_key, j);
            }
        }
    }
    let mut chosen: BTreeMap<&str, Why> = latest
        .values()
        .filter(|j| matches!(j.state, JobState::Failed | JobState::TimedOut | JobState::Lost) && !j.soft_failed)
        .map(|j| (j.step_key, Why::Failed))
        .collect();
    // Dependents, to a fixed point (a pipeline is acyclic; the bound is the step count).
    let mut frontier: BTreeSet<&str> = chosen.keys().copied().collect();
    while !frontier.is_empty() {
        let mut next = BTreeSet::new();
        for j in latest.values() {
            if chosen.contains_key(j.step_key) || !j.state.is_terminal() || j.skipped_by_condition {
                continue;
            }
            if let Some(dep) = j.depends_on.iter().find(|d| frontier.contains(d.as_str())) {
                chosen.insert(j.step_key, Why::DependsOn(dep.clone()));
                next.insert(j.step_key);
            }
        }
        frontier = next;
    }
    let mut out: Vec<(i64, Why)> = chosen.into_iter().map(|(k, why)| (latest[k].job_id, why)).collect();
    out.sort_by_key(|(id, _)| *id);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobState::*;

    struct J {
        id: i64,
        key: &'static str,
        deps: Vec<String>,
        state: JobState,
        soft: bool,
        cond: bool,
    }

    fn j(id: i64, key: &'static str, deps: &[&str], state: JobState) -> J {
        J { id, key, deps: deps.iter().map(|d| d.to_string()).collect(), state, soft: false, cond: false }
    }

    fn ids(jobs: &[J]) -> Vec<i64> {
        retry_failed(jobs.iter().map(|j| PipelineJob {
            job_id: j.id,
            step_key: j.key,
            depends_on: &j.deps,
            state: j.state,
            soft_failed: j.soft,
            skipped_by_condition: j.cond,
        }))
        .into_iter()
        .map(|(id, _)| id)
        .collect()
    }

    #[test]
    fn a_failed_job_and_everything_after_it() {
        let jobs = [
            j(1, "build", &[], Succeeded),
            j(2, "test", &["build"], Failed),
            j(3, "bench", &["test"], Skipped),
            j(4, "deploy", &["bench"], Skipped),
            j(5, "lint", &[], Succeeded),
        ];
        assert_eq!(ids(&jobs), [2, 3, 4]);
    }

    #[test]
    fn timed_out_and_lost_count_cancelled_and_soft_failures_do_not() {
        let mut soft = j(4, "flaky", &[], Failed);
        soft.soft = true;
        let jobs = [j(1, "a", &[], TimedOut), j(2, "b", &[], Lost), j(3, "c", &[], Cancelled), soft];
        assert_eq!(ids(&jobs), [1, 2]);
    }

    #[test]
    fn only_the_latest_attempt_counts() {
        // `a` failed, was retried and passed: nothing to do. `b` passed, then failed on a retry.
        let jobs =
            [j(1, "a", &[], Failed), j(2, "b", &[], Succeeded), j(3, "a", &[], Succeeded), j(4, "b", &[], Failed)];
        assert_eq!(ids(&jobs), [4]);
        assert!(ids(&[j(1, "a", &[], Succeeded)]).is_empty());
    }

    #[test]
    fn a_condition_skip_stays_and_a_running_dependent_waits() {
        let mut cond = j(2, "nightly", &["a"], Skipped);
        cond.cond = true;
        let jobs = [j(1, "a", &[], Failed), cond, j(3, "b", &["a"], Queued)];
        assert_eq!(ids(&jobs), [1]);
    }

    #[test]
    fn a_dependent_that_ran_anyway_runs_again_and_diamonds_once() {
        // `report` has allow_dependency_failure: it ran (and passed) against the failure.
        let jobs = [
            j(1, "a", &[], Failed),
            j(2, "left", &["a"], Skipped),
            j(3, "right", &["a"], Skipped),
            j(4, "join", &["left", "right"], Skipped),
            j(5, "report", &["a"], Succeeded),
        ];
        assert_eq!(ids(&jobs), [1, 2, 3, 4, 5]);
        let why = retry_failed(jobs.iter().map(|j| PipelineJob {
            job_id: j.id,
            step_key: j.key,
            depends_on: &j.deps,
            state: j.state,
            soft_failed: false,
            skipped_by_condition: false,
        }));
        assert_eq!(why[0], (1, Why::Failed));
        assert_eq!(why[3], (4, Why::DependsOn("left".into())));
    }
}
