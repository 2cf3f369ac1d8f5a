//! Transfers between this agent and its coordinator (a job's artifacts up and down, the
//! workspace upload down) that a coordinator failover cuts off are tried again, at whichever
//! coordinator leads by then; which failures are tried again, how long the agent waits and
//! when it gives up are decided here and nowhere else.
//!
//! Why: with several coordinators (docs/ha.md) the leader can die mid-transfer. The standby
//! taking over answers 503 until it leads (a takeover takes ≤ 4 s, ≤ 9 s with a leader frozen
//! mid-write), and the agent finds the new leader on its own (`crate::follow`, which updates
//! the [`crate::follow::Current`] every try reads again). A transfer given up at once lost the
//! artifact while its job stayed green, and failed a job whose input download a few seconds
//! later would have worked.
//!
//! Rules:
//! - Tried again ([`Failure::is_transient`]): a transport failure (connection refused or
//!   reset, a body cut off either way, a timeout) and the answers 500, 502, 503 (a standby,
//!   a leader stepping aside), 504. Never: any other answer, 4xx above all — 413 and 507 (a
//!   cap: the same bytes get the same answer), 410 (deleted), 409 (the job has ended),
//!   401/403 — nor a failure on this side (the file, the disk).
//! - Back-off ([`Policy::wait`]): 250 ms doubling to 5 s, each wait drawn between half and
//!   all of that, so agents that lost the same leader do not come back in step.
//! - Bound ([`Policy::DEFAULT`]): no try starts more than 2 minutes after the first one
//!   began. That covers a takeover (≤ 9 s), the agent noticing a frozen leader (three silent
//!   heartbeats, ≥ 10 s) and its reconnect back-off (≤ 5 s plus jitter) several times over,
//!   and holds a finished job's slot at most that much longer. A try under way is not cut by
//!   the bound; a try's own limits are the HTTP client's (connect 30 s, a read stalled 120 s)
//!   and, for an upload's body, [`Policy::stall`] (a frozen leader keeps the connection open
//!   and reads nothing; TCP keeps probing a zero window, so this bound is set here explicitly
//!   rather than left to whether the client's read timeout runs while it writes).
//! - What gives up is never silent: an artifact not stored fails its step
//!   ([`outcome_after_uploads`]), an input not fetched fails the job's start.

use gpuci_core::job::Outcome;
use std::future::Future;
use std::time::Duration;

/// How a transfer is tried again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The wait after the first failed try.
    pub first: Duration,
    /// The longest wait between two tries.
    pub max: Duration,
    /// No try starts later than this after the first began.
    pub total: Duration,
    /// An upload whose body makes no progress for this long is cut (and tried again).
    pub stall: Duration,
}

impl Policy {
    pub const DEFAULT: Policy = Policy {
        first: Duration::from_millis(250),
        max: Duration::from_secs(5),
        total: Duration::from_secs(120),
        stall: Duration::from_secs(120),
    };

    /// The wait before the next try, after `failed` (≥ 1) tries failed transiently and
    /// `elapsed` since the first began; `None`: give up. `jitter` in `[0, 1)` picks the wait
    /// between half and all of the back-off.
    pub fn wait(&self, failed: u32, elapsed: Duration, jitter: f64) -> Option<Duration> {
        let doubled = self.first.saturating_mul(1u32.checked_shl(failed.saturating_sub(1)).unwrap_or(u32::MAX));
        let backoff = doubled.min(self.max);
        let wait = backoff.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0));
        (elapsed.saturating_add(wait) <= self.total).then_some(wait)
    }
}

impl Default for Policy {
    fn default() -> Self {
        Policy::DEFAULT
    }
}

/// Whether the coordinator's answer `status` may be different on another try.
pub fn transient_status(status: u16) -> bool {
    matches!(status, 500 | 502 | 503 | 504)
}

/// How one try of a transfer failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// No answer: the connection failed, was cut, or timed out.
    #[error("{0}")]
    Transport(String),
    /// The coordinator answered `status`; `message` says it with its words
    /// (`503 Service Unavailable: this coordinator is a standby`).
    #[error("{message}")]
    Status { status: u16, message: String },
    /// On this side, or an answer that trying again cannot change.
    #[error("{0}")]
    Final(String),
}

impl Failure {
    pub fn is_transient(&self) -> bool {
        match self {
            Failure::Transport(_) => true,
            Failure::Status { status, .. } => transient_status(*status),
            Failure::Final(_) => false,
        }
    }

    /// A cap of the coordinator's (per file, job, repository, its disk).
    pub fn is_cap(&self) -> bool {
        matches!(self, Failure::Status { status: 413 | 507, .. })
    }
}

/// A transfer that failed for good: its last failure, and whether it was given up on while
/// still transient (the coordinator unreachable or failing throughout the bound).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GaveUp {
    pub last: Failure,
    pub tries: u32,
    pub elapsed: Duration,
}

impl std::fmt::Display for GaveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.last)?;
        if self.tries > 1 {
            let over = gpuci_core::Duration::from_millis(u64::try_from(self.elapsed.as_millis()).unwrap_or(u64::MAX));
            write!(f, " (after {} tries over {over})", self.tries)?;
        }
        Ok(())
    }
}

impl std::error::Error for GaveUp {}

impl GaveUp {
    /// Given up on a failure that is the coordinator's or the network's, not the file's.
    pub fn is_lost(&self) -> bool {
        self.last.is_transient()
    }
}

/// Runs `attempt` until it succeeds, fails for good, or `policy` gives up; `on_retry` hears
/// each transient failure and the wait before the next try. Each try builds its request
/// anew (the coordinator's URL read again, the file from its start).
pub async fn retry<T, F, Fut>(
    policy: &Policy,
    mut attempt: F,
    mut on_retry: impl FnMut(&Failure, Duration),
) -> Result<T, GaveUp>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Failure>>,
{
    let start = tokio::time::Instant::now();
    let mut tries = 0u32;
    loop {
        tries += 1;
        let last = match attempt().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let elapsed = start.elapsed();
        let wait = if last.is_transient() { policy.wait(tries, elapsed, rand::random::<f64>()) } else { None };
        let Some(wait) = wait else {
            return Err(GaveUp { last, tries, elapsed });
        };
        on_retry(&last, wait);
        tokio::time::sleep(wait).await;
    }
}

/// An artifact that could not be stored: the coordinator unreachable or failing for the
/// whole bound (not a cap, not a file refused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostArtifact {
    pub path: String,
    pub why: String,
}

/// The outcome of a step once its artifacts were uploaded: one that succeeded fails when any
/// artifact was lost (green means the artifacts are there); any other keeps its own outcome,
/// which already fails it and says more.
pub fn outcome_after_uploads(outcome: Outcome, lost: &[LostArtifact]) -> Outcome {
    match (&outcome, lost) {
        (Outcome::Exited { code: 0 }, [first, ..]) => {
            let more = match lost.len() {
                1 => String::new(),
                n => format!(" and {} more", n - 1),
            };
            Outcome::ArtifactsLost {
                error: format!("artifact {:?} could not be stored{more}: {}", first.path, first.why),
            }
        }
        _ => outcome,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Policy = Policy::DEFAULT;

    #[test]
    fn waits_double_to_the_cap_and_jitter_only_shortens_them() {
        let ms = |d: Option<Duration>| d.map(|d| d.as_millis());
        assert_eq!(ms(P.wait(1, Duration::ZERO, 0.999_999)), Some(249));
        assert_eq!(ms(P.wait(1, Duration::ZERO, 0.0)), Some(125));
        assert_eq!(ms(P.wait(2, Duration::ZERO, 0.0)), Some(250));
        assert_eq!(ms(P.wait(5, Duration::ZERO, 0.0)), Some(2000));
        assert_eq!(ms(P.wait(6, Duration::ZERO, 0.0)), Some(2500), "capped at 5 s, halved");
        assert_eq!(ms(P.wait(40, Duration::ZERO, 0.0)), Some(2500), "no overflow however many tries");
        assert_eq!(ms(P.wait(u32::MAX, Duration::ZERO, 2.0)), Some(5000), "jitter clamped");
    }

    #[test]
    fn no_try_starts_past_the_bound() {
        assert!(P.wait(3, Duration::from_secs(119), 0.0).is_some());
        assert_eq!(P.wait(30, Duration::from_secs(118), 0.0), None, "2.5 s would end past 2 minutes");
        assert_eq!(P.wait(1, Duration::from_secs(121), 0.0), None);
        // The bound is long enough for a takeover (≤ 9 s) plus the agent's reconnect, many times.
        let mut elapsed = Duration::ZERO;
        let mut tries = 0;
        while let Some(w) = P.wait(tries + 1, elapsed, 0.5) {
            tries += 1;
            elapsed += w;
        }
        assert!(elapsed >= Duration::from_secs(110) && tries >= 20, "{tries} tries over {elapsed:?}");
    }

    #[test]
    fn what_is_tried_again() {
        for s in [500, 502, 503, 504] {
            assert!(Failure::Status { status: s, message: String::new() }.is_transient(), "{s}");
        }
        for s in [400, 401, 403, 404, 409, 410, 411, 413, 429, 501, 507] {
            assert!(!Failure::Status { status: s, message: String::new() }.is_transient(), "{s}");
        }
        assert!(Failure::Transport("connection reset".into()).is_transient());
        assert!(!Failure::Final("reading the file: EIO".into()).is_transient());
        assert!(Failure::Status { status: 413, message: String::new() }.is_cap());
        assert!(Failure::Status { status: 507, message: String::new() }.is_cap());
    }

    #[test]
    fn a_lost_artifact_fails_a_green_step_and_leaves_a_red_one_as_it_was() {
        let lost = [
            LostArtifact { path: "dist/a.whl".into(), why: "connection refused".into() },
            LostArtifact { path: "dist/b.whl".into(), why: "503".into() },
        ];
        let out = outcome_after_uploads(Outcome::Exited { code: 0 }, &lost);
        let (state, reason) = out.verdict();
        assert_eq!(state, gpuci_core::job::JobState::Failed);
        assert!(reason.contains("\"dist/a.whl\" could not be stored and 1 more: connection refused"), "{reason}");
        assert_eq!(outcome_after_uploads(Outcome::Exited { code: 0 }, &[]), Outcome::Exited { code: 0 });
        assert_eq!(outcome_after_uploads(Outcome::Exited { code: 2 }, &lost), Outcome::Exited { code: 2 });
        let t = Outcome::TimedOut { after_ms: 5 };
        assert_eq!(outcome_after_uploads(t.clone(), &lost), t);
    }

    /// On tokio's paused clock: the waits are the policy's exactly and the tries take no
    /// time, so the bound is checked, not the machine's speed (a CI run measured 100.17 ms
    /// against the 100 ms bound on the real clock).
    #[tokio::test(start_paused = true)]
    async fn retry_stops_at_a_final_failure_and_gives_up_at_the_bound() {
        // The rules of DEFAULT, in milliseconds.
        const P: Policy = Policy {
            first: Duration::from_millis(1),
            max: Duration::from_millis(4),
            total: Duration::from_millis(100),
            stall: Duration::from_millis(100),
        };
        let mut n = 0;
        let r: Result<(), GaveUp> = retry(
            &P,
            || {
                n += 1;
                async { Err(Failure::Status { status: 413, message: "over the cap".into() }) }
            },
            |_, _| {},
        )
        .await;
        assert_eq!(n, 1, "a cap is not tried again");
        assert!(!r.unwrap_err().is_lost());
        let mut n = 0;
        let r: Result<(), GaveUp> = retry(
            &P,
            || {
                n += 1;
                async { Err(Failure::Transport("connection refused".into())) }
            },
            |_, _| {},
        )
        .await;
        let e = r.unwrap_err();
        assert!(e.is_lost() && e.tries == n && n > 10, "{e}");
        assert!(e.elapsed <= P.total, "{:?}", e.elapsed);
        assert!(e.to_string().starts_with("connection refused (after "), "{e}");
    }
}
