//! Jobs: what runs, and the state machine every job follows.
//!
//! ```text
//! queued ──► assigned ──► running ──► succeeded | failed | cancelled | timed_out | lost
//!   │            │
//!   │            └──► queued (agent never received it; safe to hand out again)
//!   └──► cancelled | timed_out (queue timeout) | skipped (a dependency did not succeed)
//! ```
//! Every transition carries a human-readable reason. Terminal states never change.

use crate::pipeline::Step;
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Queued,
    Assigned,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    TimedOut,
    Lost,
    Skipped,
}

impl JobState {
    pub const ALL: [JobState; 9] = [
        JobState::Queued,
        JobState::Assigned,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
        JobState::TimedOut,
        JobState::Lost,
        JobState::Skipped,
    ];

    pub fn is_terminal(self) -> bool {
        !matches!(self, JobState::Queued | JobState::Assigned | JobState::Running)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Assigned => "assigned",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::TimedOut => "timed_out",
            JobState::Lost => "lost",
            JobState::Skipped => "skipped",
        }
    }

    /// Whether `self → to` is a legal transition.
    pub fn can_become(self, to: JobState) -> bool {
        use JobState::*;
        matches!(
            (self, to),
            (Queued, Assigned | Cancelled | TimedOut | Skipped)
                | (Assigned, Running | Queued | Succeeded | Failed | Cancelled | TimedOut | Lost)
                | (Running, Succeeded | Failed | Cancelled | TimedOut | Lost)
        )
    }
}

/// How the reason of [`Outcome::ArtifactsLost`] begins.
const ARTIFACTS_LOST: &str = "exited with code 0, but its artifacts were not stored";

/// A small, fixed set of words for why a job ended, from its state and reason (a metric's
/// label: bounded, unlike the reason itself).
pub fn reason_class(state: JobState, reason: &str) -> &'static str {
    let r = reason.to_ascii_lowercase();
    match state {
        JobState::Queued | JobState::Assigned | JobState::Running => "active",
        JobState::Succeeded => "exit_0",
        JobState::Cancelled => "cancelled",
        JobState::Lost => "lost",
        JobState::Skipped => "skipped",
        JobState::TimedOut if r.starts_with("still queued") => "queue_timeout",
        JobState::TimedOut => "timeout",
        JobState::Failed if r.starts_with(ARTIFACTS_LOST) => "artifacts_lost",
        JobState::Failed if r.starts_with("exited with code") => "exit_code",
        JobState::Failed if r.starts_with("killed by signal") => "signal",
        JobState::Failed if r.starts_with("out of memory") => "out_of_memory",
        JobState::Failed if r.contains("disk quota") => "disk_quota",
        JobState::Failed if r.starts_with("could not start") => "start_failed",
        JobState::Failed if r.contains("gpu") => "gpu",
        JobState::Failed => "other",
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for JobState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        JobState::ALL.into_iter().find(|st| st.as_str() == s).ok_or_else(|| format!("unknown job state {s:?}"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("job {job}: illegal transition {from} → {to}")]
pub struct IllegalTransition {
    pub job: String,
    pub from: JobState,
    pub to: JobState,
}

/// Check a transition, naming the job when it is illegal.
pub fn transition(job: &str, from: JobState, to: JobState) -> Result<JobState, IllegalTransition> {
    if from.can_become(to) {
        Ok(to)
    } else {
        Err(IllegalTransition { job: job.to_string(), from, to })
    }
}

/// How a finished process ended, as the agent saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    Exited {
        code: i32,
    },
    Signalled {
        signal: i32,
    },
    TimedOut {
        after_ms: u64,
    },
    Cancelled {
        reason: String,
    },
    /// The kernel's OOM killer ended the job at its memory limit.
    OutOfMemory {
        limit: Option<crate::quantity::Bytes>,
    },
    /// The job failed after filling its slot's disk (workspace and restored caches) to its
    /// limit; the host's disk was never touched.
    DiskQuotaExceeded {
        limit: crate::quantity::Bytes,
        /// How it ended: its exit code, or the signal that killed it (negative).
        code: i32,
    },
    /// The job could not be started at all (bad working dir, missing shell, unhealthy GPU).
    StartFailed {
        error: String,
    },
    /// Its agent stopped (killed, crashed, host rebooted) while the job ran: the process died
    /// with it, and output it had not sent yet is gone. Reported by the agent's next run from
    /// its journal.
    Lost {
        reason: String,
    },
    /// The job's command succeeded, but an artifact it names could not be stored: the
    /// coordinator was unreachable or failing for the whole retry bound (not a cap, not a
    /// file refused). Green must mean the artifacts are there.
    ArtifactsLost {
        error: String,
    },
}

impl Outcome {
    /// The terminal state and reason this outcome gives a job.
    pub fn verdict(&self) -> (JobState, String) {
        match self {
            Outcome::Exited { code: 0 } => (JobState::Succeeded, "exited with code 0".into()),
            Outcome::Exited { code } => (JobState::Failed, format!("exited with code {code}")),
            Outcome::Signalled { signal } => (JobState::Failed, format!("killed by signal {signal}")),
            Outcome::TimedOut { after_ms } => (
                JobState::TimedOut,
                format!(
                    "exceeded its timeout of {}; the whole process tree was killed",
                    crate::Duration::from_millis(*after_ms)
                ),
            ),
            Outcome::Cancelled { reason } => (JobState::Cancelled, reason.clone()),
            Outcome::OutOfMemory { limit: Some(l) } => (JobState::Failed, format!("out of memory (limit {l})")),
            Outcome::OutOfMemory { limit: None } => (JobState::Failed, "out of memory".into()),
            Outcome::DiskQuotaExceeded { limit, code } => (
                JobState::Failed,
                format!(
                    "disk quota exceeded (limit {limit}): the job filled its workspace disk, then {}",
                    if *code >= 0 {
                        format!("exited with code {code}")
                    } else {
                        format!("was killed by signal {}", -code)
                    }
                ),
            ),
            Outcome::StartFailed { error } => (JobState::Failed, format!("could not start: {error}")),
            Outcome::Lost { reason } => (JobState::Lost, reason.clone()),
            Outcome::ArtifactsLost { error } => (JobState::Failed, format!("{ARTIFACTS_LOST}: {error}")),
        }
    }

    /// The verdict when gpuci had asked for the job to be cancelled (`cancelling` is why) before
    /// this outcome arrived. A job that ended badly meanwhile ended because of, or racing, the
    /// cancel (a runner that sees its registration removed exits 1): it is cancelled, with the
    /// cancel's reason and what it did. One that succeeded first keeps its success.
    pub fn verdict_after_cancel(&self, cancelling: Option<&str>) -> (JobState, String) {
        let (state, reason) = self.verdict();
        match cancelling {
            Some(why) if state != JobState::Succeeded => match self {
                Outcome::Cancelled { .. } => (JobState::Cancelled, why.to_string()),
                _ => (JobState::Cancelled, format!("{why}; before it was stopped: {reason}")),
            },
            _ => (state, reason),
        }
    }
}

/// Which outcomes a retry policy retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RetryOn {
    Failed,
    TimedOut,
    Lost,
}

/// Whether a job that ended in `state` on attempt `attempt` (1-based) should run again.
pub fn should_retry(step: &Step, state: JobState, attempt: u32) -> bool {
    let on = match state {
        JobState::Failed => RetryOn::Failed,
        JobState::TimedOut => RetryOn::TimedOut,
        JobState::Lost => RetryOn::Lost,
        _ => return false,
    };
    attempt <= step.retry.count && step.retry.on.contains(&on)
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobState::*;

    #[test]
    fn a_job_that_fails_while_being_cancelled_is_cancelled_but_a_success_stands() {
        let text = "the runner took no job within 2s (idle_timeout); removed";
        let why = Some(text);
        let (state, reason) = Outcome::Exited { code: 1 }.verdict_after_cancel(why);
        assert_eq!(state, Cancelled);
        assert!(reason.starts_with("the runner took no job") && reason.contains("exited with code 1"), "{reason}");
        let (state, reason) = Outcome::Cancelled { reason: "killed".into() }.verdict_after_cancel(why);
        assert_eq!((state, reason.as_str()), (Cancelled, text));
        assert_eq!(Outcome::Exited { code: 0 }.verdict_after_cancel(why).0, Succeeded);
        assert_eq!(Outcome::Exited { code: 1 }.verdict_after_cancel(None).0, Failed);
        // Whatever the outcome's words, the reason reads as one sentence.
        let lost = Outcome::Lost { reason: "the agent stopped while the job ran".into() };
        let (state, reason) = lost.verdict_after_cancel(Some("cancelled by alice"));
        assert_eq!(state, Cancelled);
        assert_eq!(reason, "cancelled by alice; before it was stopped: the agent stopped while the job ran");
    }

    #[test]
    fn terminal_states_never_change() {
        for from in JobState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in JobState::ALL {
                assert!(!from.can_become(to), "{from} must not become {to}");
            }
        }
    }

    #[test]
    fn legal_paths() {
        assert!(Queued.can_become(Assigned));
        assert!(Assigned.can_become(Running));
        assert!(Running.can_become(Succeeded));
        assert!(Queued.can_become(Skipped));
        assert!(Assigned.can_become(Queued));
        assert!(!Running.can_become(Queued), "a started job must never be handed out again");
        assert!(!Queued.can_become(Running));
        assert!(!Queued.can_become(Lost));
        let e = transition("j1", Running, Queued).unwrap_err();
        assert_eq!(e.to_string(), "job j1: illegal transition running → queued");
    }

    #[test]
    fn a_step_whose_artifacts_were_lost_fails_with_its_own_class() {
        let (state, reason) =
            Outcome::ArtifactsLost { error: "artifact \"a\" could not be stored: 503".into() }.verdict();
        assert_eq!(state, Failed);
        assert!(reason.contains("artifacts were not stored") && reason.contains("503"), "{reason}");
        assert_eq!(reason_class(state, &reason), "artifacts_lost");
        assert_eq!(reason_class(Failed, "exited with code 3"), "exit_code");
    }

    #[test]
    fn outcomes_give_reasons() {
        assert_eq!(Outcome::Exited { code: 3 }.verdict(), (Failed, "exited with code 3".into()));
        assert_eq!(Outcome::Exited { code: 0 }.verdict().0, Succeeded);
        let (st, why) = Outcome::TimedOut { after_ms: 90_000 }.verdict();
        assert_eq!(st, TimedOut);
        assert!(why.contains("1m30s"), "{why}");
    }

    #[test]
    fn state_names_round_trip() {
        for s in JobState::ALL {
            assert_eq!(s.as_str().parse::<JobState>().unwrap(), s);
        }
    }
}
