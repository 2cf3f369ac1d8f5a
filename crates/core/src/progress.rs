//! How the jobs of a pipeline combine: whether a failure is soft, when a job may start after
//! its dependencies, and the pipeline's state. Pure functions; the coordinator applies them.
//!
//! The rules, here and nowhere else:
//! - A job **soft fails** when it ended `failed` or `timed_out` and its step's `soft_fail`
//!   covers that (`true`: both; a list of exit codes: `failed` with one of those codes).
//!   It keeps its state (`failed`) and is marked soft failed, as Buildkite does. Lost,
//!   cancelled and skipped jobs never soft fail: those say nothing about the step.
//! - A dependency is **satisfied** when its latest attempt succeeded or soft failed. A job
//!   waits while any dependency is unfinished. When one ended otherwise the job is skipped
//!   at once (it never runs), unless its step has `allow_dependency_failure: true`: then it
//!   runs once every dependency has ended, whatever the outcome.
//! - A job **skipped by a condition** (its `if:` was false, or through `depends_on` a
//!   dependency's: `crate::condition::plan`, applied at submission) is a skipped dependency
//!   like any other for the steps after it, but counts as neither success nor failure.
//! - The **pipeline's state**, from the latest attempt of each step: `running` while any is
//!   unfinished, else the worst outcome that is not a soft failure nor a skip by a condition,
//!   in the order `lost`, `timed_out`, `failed`, `cancelled`, `skipped`; `succeeded` when
//!   there is none (a pipeline whose every step a condition skipped succeeded, as in GitHub
//!   Actions).

use crate::job::JobState;
use crate::pipeline::{SoftFail, Step};
use std::collections::BTreeMap;

/// Whether a job of a step with `soft_fail` that ended in `state` with `exit_code` soft failed.
pub fn is_soft_failure(soft_fail: &SoftFail, state: JobState, exit_code: Option<i32>) -> bool {
    match soft_fail {
        SoftFail::Never => false,
        SoftFail::Always => matches!(state, JobState::Failed | JobState::TimedOut),
        SoftFail::ExitCodes(codes) => state == JobState::Failed && exit_code.is_some_and(|c| codes.contains(&c)),
    }
}

/// The latest attempt of a step, as a dependency or a member of a pipeline sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempt<'a> {
    pub step_key: &'a str,
    pub job_id: i64,
    pub state: JobState,
    pub soft_failed: bool,
    /// Created skipped because a condition was false (`Step::skipped_by_condition`).
    pub skipped_by_condition: bool,
}

/// Whether a job of `step` in `state` was skipped by a condition rather than by an outcome.
pub fn is_skipped_by_condition(step: &Step, state: JobState) -> bool {
    state == JobState::Skipped && step.skipped_by_condition
}

/// What a queued job may do now, given its dependencies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Every dependency is satisfied (or ended, with `allow_dependency_failure`).
    Ready,
    /// A dependency is unfinished; the reason names it.
    Wait(String),
    /// It can never run: a dependency did not succeed, or does not exist.
    Skip(String),
}

/// The gate for a job of `step`, `latest` giving the latest attempt of each dependency by key
/// (`None`: no such step). A dependency that rules the job out wins over one still running,
/// so a doomed job is skipped as soon as that is known.
pub fn gate<'a>(step: &Step, latest: impl Fn(&str) -> Option<Attempt<'a>>) -> Gate {
    let mut wait = None;
    for dep in &step.depends_on {
        match latest(dep) {
            None => return Gate::Skip(format!("dependency `{dep}` does not exist")),
            Some(a) if !a.state.is_terminal() => {
                if wait.is_none() {
                    wait = Some(format!("waiting for `{dep}` (job {}, {})", a.job_id, a.state));
                }
            }
            Some(a) if a.state == JobState::Succeeded || a.soft_failed || step.allow_dependency_failure => {}
            Some(a) => {
                return Gate::Skip(format!("dependency `{dep}` (job {}) {}; this step never ran", a.job_id, a.state))
            }
        }
    }
    wait.map_or(Gate::Ready, Gate::Wait)
}

/// A pipeline's state: `Running`, or how it ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipelineState {
    Running,
    Ended(JobState),
}

impl PipelineState {
    pub fn as_str(self) -> &'static str {
        match self {
            PipelineState::Running => "running",
            PipelineState::Ended(s) => s.as_str(),
        }
    }
}

impl std::fmt::Display for PipelineState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The state of a pipeline with these jobs (every attempt; only the latest of a step counts).
pub fn pipeline_state<'a>(jobs: impl IntoIterator<Item = Attempt<'a>>) -> PipelineState {
    let mut latest: BTreeMap<&str, Attempt<'a>> = BTreeMap::new();
    for j in jobs {
        match latest.get(j.step_key) {
            Some(o) if o.job_id > j.job_id => {}
            _ => {
                latest.insert(j.step_key, j);
            }
        }
    }
    if latest.values().any(|j| !j.state.is_terminal()) {
        return PipelineState::Running;
    }
    let counted = |s: JobState| latest.values().any(|j| j.state == s && !j.soft_failed && !j.skipped_by_condition);
    let worst = [JobState::Lost, JobState::TimedOut, JobState::Failed, JobState::Cancelled, JobState::Skipped]
        .into_iter()
        .find(|s| counted(*s));
    PipelineState::Ended(worst.unwrap_or(JobState::Succeeded))
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobState::*;

    fn at(step_key: &str, job_id: i64, state: JobState) -> Attempt<'_> {
        Attempt { step_key, job_id, state, soft_failed: false, skipped_by_condition: false }
    }

    fn soft(a: Attempt<'_>) -> Attempt<'_> {
        Attempt { soft_failed: true, ..a }
    }

    #[test]
    fn soft_fail_true_covers_failures_and_timeouts_but_not_lost_or_cancelled() {
        for (state, code, soft) in [
            (Failed, Some(1), true),
            (Failed, None, true), // killed by a signal, out of memory
            (TimedOut, None, true),
            (Lost, None, false),
            (Cancelled, None, false),
            (Skipped, None, false),
            (Succeeded, Some(0), false),
        ] {
            assert_eq!(is_soft_failure(&SoftFail::Always, state, code), soft, "{state} {code:?}");
            assert!(!is_soft_failure(&SoftFail::Never, state, code));
        }
    }

    #[test]
    fn soft_fail_exit_codes_cover_only_those_codes() {
        let codes = SoftFail::ExitCodes(vec![2, 42]);
        assert!(is_soft_failure(&codes, Failed, Some(42)));
        assert!(is_soft_failure(&codes, Failed, Some(2)));
        assert!(!is_soft_failure(&codes, Failed, Some(1)));
        assert!(!is_soft_failure(&codes, Failed, None), "a signal is no exit code");
        assert!(!is_soft_failure(&codes, TimedOut, None));
    }

    #[test]
    fn a_failed_dependency_skips_the_step_and_a_running_one_makes_it_wait() {
        let mut step = Step::new("deploy", "make deploy");
        step.depends_on = vec!["build".into(), "test".into()];
        let jobs = [at("build", 1, Succeeded), at("test", 2, Running)];
        let latest = |k: &str| jobs.iter().copied().find(|a| a.step_key == k);
        assert_eq!(gate(&step, latest), Gate::Wait("waiting for `test` (job 2, running)".into()));

        let jobs = [at("build", 1, Running), at("test", 2, Failed)];
        let latest = |k: &str| jobs.iter().copied().find(|a| a.step_key == k);
        assert_eq!(
            gate(&step, latest),
            Gate::Skip("dependency `test` (job 2) failed; this step never ran".into()),
            "a doomed job is skipped without waiting for the rest"
        );

        let jobs = [at("build", 1, Succeeded), at("test", 2, Succeeded)];
        assert_eq!(gate(&step, |k: &str| jobs.iter().copied().find(|a| a.step_key == k)), Gate::Ready);
        assert_eq!(gate(&step, |_: &str| None), Gate::Skip("dependency `build` does not exist".into()));
    }

    #[test]
    fn a_soft_failed_dependency_counts_as_done() {
        let mut step = Step::new("report", "make report");
        step.depends_on = vec!["flaky".into()];
        let jobs = [soft(at("flaky", 3, Failed))];
        assert_eq!(gate(&step, |k: &str| jobs.iter().copied().find(|a| a.step_key == k)), Gate::Ready);
    }

    #[test]
    fn allow_dependency_failure_runs_after_any_outcome_but_still_waits() {
        let mut step = Step::new("cleanup", "make clean");
        step.depends_on = vec!["a".into(), "b".into()];
        step.allow_dependency_failure = true;
        for outcome in [Failed, TimedOut, Lost, Cancelled, Skipped, Succeeded] {
            let jobs = [at("a", 1, outcome), at("b", 2, Failed)];
            assert_eq!(gate(&step, |k: &str| jobs.iter().copied().find(|a| a.step_key == k)), Gate::Ready, "{outcome}");
        }
        let jobs = [at("a", 1, Failed), at("b", 2, Queued)];
        assert_eq!(
            gate(&step, |k: &str| jobs.iter().copied().find(|a| a.step_key == k)),
            Gate::Wait("waiting for `b` (job 2, queued)".into())
        );
        assert!(
            matches!(gate(&step, |_: &str| None), Gate::Skip(_)),
            "a dependency that does not exist is never allowed"
        );
    }

    #[test]
    fn pipeline_state_is_the_worst_hard_outcome_of_each_steps_latest_attempt() {
        assert_eq!(pipeline_state([at("a", 1, Succeeded), at("b", 2, Running)]), PipelineState::Running);
        assert_eq!(pipeline_state([at("a", 1, Succeeded), at("b", 2, Failed)]).as_str(), "failed");
        assert_eq!(
            pipeline_state([at("a", 1, Succeeded), soft(at("b", 2, Failed))]).as_str(),
            "succeeded",
            "a soft failure leaves the pipeline green"
        );
        assert_eq!(pipeline_state([soft(at("a", 1, TimedOut)), at("b", 2, Cancelled)]).as_str(), "cancelled");
        assert_eq!(
            pipeline_state([at("a", 1, Failed), at("a", 3, Succeeded)]).as_str(),
            "succeeded",
            "a retry that passed"
        );
        assert_eq!(
            pipeline_state([at("a", 3, Failed), at("a", 1, Succeeded)]).as_str(),
            "failed",
            "the latest attempt counts"
        );
        assert_eq!(pipeline_state([at("a", 1, Lost), at("b", 2, Failed), at("c", 4, Skipped)]).as_str(), "lost");
        assert_eq!(
            pipeline_state([at("a", 1, Failed), at("cleanup", 2, Succeeded)]).as_str(),
            "failed",
            "a step allowed to run after a failure does not make the failure go away"
        );
        assert_eq!(pipeline_state(Vec::new()).as_str(), "succeeded");
    }

    #[test]
    fn a_skip_by_a_condition_is_neither_success_nor_failure() {
        let by_condition = |a: Attempt<'static>| Attempt { skipped_by_condition: true, ..a };
        assert_eq!(
            pipeline_state([at("a", 1, Succeeded), by_condition(at("deploy", 2, Skipped))]).as_str(),
            "succeeded"
        );
        assert_eq!(pipeline_state([by_condition(at("a", 1, Skipped))]).as_str(), "succeeded");
        assert_eq!(pipeline_state([at("a", 1, Failed), by_condition(at("b", 2, Skipped))]).as_str(), "failed");
        assert_eq!(
            pipeline_state([by_condition(at("a", 1, Skipped)), at("b", 2, Skipped)]).as_str(),
            "skipped",
            "a skip for another reason still counts"
        );
        let mut step = Step::new("deploy", "make deploy");
        step.skipped_by_condition = true;
        assert!(is_skipped_by_condition(&step, Skipped));
        assert!(!is_skipped_by_condition(&step, Succeeded), "a retry run by hand is an ordinary job");
    }
}
