//! When the next Actions runner starts for a workflow job whose runner went away without
//! taking it, and what the job's record says meanwhile. Pure functions over plain data; the
//! service reads the record and the ended runner job, calls these, and stores what they
//! return. The rules live here and nowhere else:
//!
//! - A runner that ended by itself without taking a job (its `run.sh` exited, whatever the
//!   code: the real runner exits 0 when it will not run as root; or it never started: not
//!   installed, not registered) is an *exit*. Exits in a row are counted on the record, and the
//!   next runner waits `first × 2^(exits − 1)`, at most [`Policy::cap`], the last fifth of it
//!   random so records that failed together do not retry together. Without this one queued
//!   job started a runner as fast as the agent could run one (87 registrations in 10 s).
//! - From [`Policy::report_after`] exits in a row the record's reason says so, with the last
//!   exit (`runner exited 3 times without taking a job: exit 0, 'Must not run interactively
//!   with sudo'`), and keeps saying so while the next runner waits, is queued, or until the
//!   queue timeout cancels the run (whose reason then carries it).
//! - A runner gpuci itself ended (cancelled: idle timeout, the job ended elsewhere) or lost
//!   with its agent is not an exit: nothing is counted and the next runner may start at once,
//!   as before (the idle timeout already spaces those).
//! - Retrying never stops on its own: the pool's `queue_timeout` bounds it, cancelling the run
//!   on GitHub with the reason.
//! - A failed question to GitHub about a queued job (is its run from a fork?) keeps the record,
//!   with the error as its reason, and asks again after the same backoff.
//! - GitHub's rate limit comes first: while the client is held back (its `held_until`, or a
//!   call's `ApiError::retry_not_before`), nothing is tried before the end GitHub named, whatever
//!   the backoff says ([`next_attempt`]), and the reason says `GitHub rate limit until HH:MM:SS
//!   UTC`. A runner job that failed because its registration was held back is not an exit: the
//!   runner never had a chance to run.

use gpuci_core::job::JobState;
use gpuci_protocol::JobId;
use std::time::Duration;

/// Exits in a row from which the record's reason names them.
pub const REPORT_AFTER: u32 = 3;
/// The longest pause between runners.
pub const CAP: Duration = Duration::from_secs(300);
/// The most characters of a runner's last line kept in a reason.
const MAX_LINE_CHARS: usize = 200;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The pause after the first exit (the pool's `runner_backoff`).
    pub first: Duration,
    /// The longest pause (at least `first`).
    pub cap: Duration,
    pub report_after: u32,
}

impl Policy {
    pub fn new(first: Duration) -> Policy {
        Policy { first, cap: CAP.max(first), report_after: REPORT_AFTER }
    }
}

/// How a runner job ended, as the service read it from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerEnd {
    pub job: JobId,
    pub state: JobState,
    /// The job's reason (why it failed, who cancelled it).
    pub reason: String,
    pub exit_code: Option<i32>,
    /// Whether the job's process ever started.
    pub started: bool,
    /// The runner's last line of output (its last stderr line if it wrote any).
    pub last_line: Option<String>,
    /// Whether the runner took a workflow job (GitHub said so).
    pub took_job: bool,
}

/// What the record holds of past exits (its `runner_exits` and `last_runner_exit`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exits {
    pub count: u32,
    pub last: Option<String>,
}

/// What to do with a queued record whose runner job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Not an exit: start another runner when the pool has room.
    Now { reason: String },
    /// An exit: wait until `retry_at_ms`, then start another.
    Wait { exits: Exits, retry_at_ms: i64, reason: String },
}

/// When to try again: at `backoff_at_ms` (the caller's own backoff), but never before the end of
/// GitHub's rate limit (`not_before_ms`), which is GitHub's to name.
pub fn next_attempt(backoff_at_ms: i64, not_before_ms: Option<i64>) -> i64 {
    not_before_ms.map_or(backoff_at_ms, |held| backoff_at_ms.max(held))
}

/// `GitHub rate limit until HH:MM:SS UTC`, for a hold ending at `until_ms` (Unix milliseconds).
pub fn rate_limit_reason(until_ms: i64) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(until_ms.max(0) as u64);
    format!("GitHub rate limit until {} UTC", gpuci_github::ratelimit::utc_hms(at))
}

/// The pause after `exits` exits (or failed checks) in a row; `jitter` in `[0, 1)`.
pub fn pause(policy: &Policy, exits: u32, jitter: f64) -> Duration {
    if exits == 0 {
        return Duration::ZERO;
    }
    let doubled = policy.first.saturating_mul(1u32 << (exits - 1).min(20));
    let full = doubled.min(policy.cap);
    // Four fifths fixed, one fifth random: never longer than the cap.
    full.mul_f64(0.8) + full.mul_f64(0.2 * jitter.clamp(0.0, 1.0))
}

/// How one exit reads: `exit 0, 'Must not run interactively with sudo'`, or, for a runner that
/// never ran, its job's reason.
pub fn describe(end: &RunnerEnd) -> String {
    let line = end.last_line.as_deref().map(str::trim).filter(|l| !l.is_empty()).map(|l| {
        // The runner's output is the job's: shown escaped, and short.
        let escaped = gpuci_core::text::escape(l);
        let mut cut: String = escaped.chars().take(MAX_LINE_CHARS).collect();
        if escaped.chars().count() > MAX_LINE_CHARS {
            cut.push('…');
        }
        cut
    });
    match (end.exit_code, line) {
        (Some(code), Some(line)) => format!("exit {code}, '{line}'"),
        (Some(code), None) => format!("exit {code}"),
        (None, _) if end.started => end.reason.clone(),
        (None, _) => format!("it never ran: {}", end.reason),
    }
}

/// The exits summary once there are enough of them, e.g. `runner exited 3 times without
/// taking a job: exit 0, '...'`.
pub fn summary(policy: &Policy, exits: &Exits) -> Option<String> {
    if exits.count < policy.report_after {
        return None;
    }
    let last = exits.last.as_deref().unwrap_or("no details");
    Some(format!("runner exited {} times without taking a job: {last}", exits.count))
}

/// A runner job of a record still queued on GitHub ended; `prior` is what the record holds;
/// `held_until_ms`: GitHub's rate limit holds the client back until then.
pub fn after_runner(
    policy: &Policy,
    prior: &Exits,
    end: &RunnerEnd,
    held_until_ms: Option<i64>,
    now_ms: i64,
    jitter: f64,
) -> Next {
    let held_until_ms = held_until_ms.filter(|at| *at > now_ms);
    if let (Some(until), false, false) = (held_until_ms, end.started, end.took_job) {
        // Its registration was refused for the rate limit (or could not have got through): the
        // runner never ran, so it is no exit, and the next one waits for GitHub's time.
        let mut reason = format!(
            "{}; runner job {} ended ({}) before its runner could register; another runner then",
            rate_limit_reason(until),
            end.job,
            end.state
        );
        if let Some(s) = summary(policy, prior) {
            reason = format!("{reason}; {s}");
        }
        return Next::Wait { exits: prior.clone(), retry_at_ms: until, reason };
    }
    let counts = !end.took_job
        && match end.state {
            JobState::Succeeded | JobState::Failed => true,
            // Its `job_timeout` passed (a runner that never took a job ran that long).
            JobState::TimedOut => end.started,
            _ => false,
        };
    if !counts {
        let mut reason =
            format!("runner job {} ended ({}): {}; waiting for another runner", end.job, end.state, end.reason);
        if let Some(s) = summary(policy, prior) {
            reason = format!("{s}; {reason}");
        }
        return Next::Now { reason };
    }
    let exits = Exits { count: prior.count.saturating_add(1), last: Some(describe(end)) };
    let wait = pause(policy, exits.count, jitter);
    let retry_at_ms = next_attempt(now_ms.saturating_add(wait.as_millis() as i64), held_until_ms);
    let then = match held_until_ms {
        Some(until) if until == retry_at_ms => format!("another runner after the {}", rate_limit_reason(until)),
        _ => format!("another runner in {}", fmt(wait)),
    };
    let reason = match summary(policy, &exits) {
        Some(s) => format!("{s}; {then}"),
        None => format!(
            "runner job {} ended ({}) without taking a job: {}; {then}",
            end.job,
            end.state,
            exits.last.as_deref().unwrap_or_default()
        ),
    };
    Next::Wait { retry_at_ms, exits, reason }
}

/// The reason of a record whose runner job was just queued: that, and past exits if they are
/// worth telling.
pub fn queued_reason(policy: &Policy, job: JobId, exits: &Exits) -> String {
    match summary(policy, exits) {
        Some(s) => format!("runner job {job} queued; {s}"),
        None => format!("runner job {job} queued"),
    }
}

/// Why a record is still queued at its queue timeout: the exits when there were enough,
/// else what its runner job waits for (`runner_job_reason`), else its own reason.
pub fn stuck_why(policy: &Policy, exits: &Exits, runner_job_reason: Option<&str>, own_reason: &str) -> String {
    match (summary(policy, exits), runner_job_reason) {
        (Some(s), _) => s,
        (None, Some(r)) => r.to_string(),
        (None, None) => own_reason.to_string(),
    }
}

/// A question to GitHub about a queued record failed (`failures` so far, this one included):
/// when to ask again, and the reason to keep. `held_until_ms`: GitHub's rate limit holds the
/// client back until then (from the error, or the client).
pub fn check_failed(
    policy: &Policy,
    failures: u32,
    error: &str,
    held_until_ms: Option<i64>,
    now_ms: i64,
    jitter: f64,
) -> (i64, String) {
    let wait = pause(policy, failures, jitter);
    let tries = if failures == 1 { "1 try".to_string() } else { format!("{failures} tries") };
    let at = next_attempt(now_ms.saturating_add(wait.as_millis() as i64), held_until_ms.filter(|at| *at > now_ms));
    let reason = match held_until_ms.filter(|until| *until == at) {
        Some(until) => format!(
            "{}; could not ask GitHub whether the run comes from a fork ({tries}): {error}; asking again then",
            rate_limit_reason(until)
        ),
        None => format!(
            "could not ask GitHub whether the run comes from a fork ({tries}): {error}; asking again in {}",
            fmt(wait)
        ),
    };
    (at, reason)
}

fn fmt(d: Duration) -> String {
    // Whole seconds read better in a reason than milliseconds of jitter.
    let secs = d.as_millis().div_ceil(1000) as u64;
    gpuci_core::duration::Duration::from_millis(secs * 1000).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy::new(Duration::from_secs(10))
    }

    fn end(state: JobState, code: Option<i32>, line: Option<&str>) -> RunnerEnd {
        RunnerEnd {
            job: 42,
            state,
            reason: "exited 0".into(),
            exit_code: code,
            started: code.is_some(),
            last_line: line.map(str::to_string),
            took_job: false,
        }
    }

    const ROOT: &str = "Must not run interactively with sudo";

    #[test]
    fn pauses_double_up_to_the_cap_and_jitter_only_shortens_the_last_fifth() {
        let p = policy();
        let s = |n, j| pause(&p, n, j).as_secs_f64();
        assert_eq!(s(0, 0.5), 0.0);
        assert_eq!((s(1, 0.0), s(2, 0.0), s(3, 0.0)), (8.0, 16.0, 32.0));
        assert_eq!((s(1, 1.0), s(2, 1.0)), (10.0, 20.0));
        assert_eq!(s(6, 1.0), 300.0, "capped at 5 minutes");
        assert_eq!(s(u32::MAX, 1.0), 300.0, "no overflow");
        for n in 1..12 {
            assert!(pause(&p, n, 0.7) <= pause(&p, n + 1, 0.7), "never shorter after another exit");
            assert!(pause(&p, n, 0.99) <= p.cap);
        }
        // A first pause above the cap is the cap.
        let slow = Policy::new(Duration::from_secs(900));
        assert_eq!(pause(&slow, 4, 1.0), Duration::from_secs(900));
    }

    #[test]
    fn regression_issue_10_a_runner_that_exits_0_without_a_job_is_not_replaced_at_once() {
        let p = policy();
        let first =
            after_runner(&p, &Exits::default(), &end(JobState::Succeeded, Some(0), Some(ROOT)), None, 1_000, 0.0);
        let Next::Wait { exits, retry_at_ms, reason } = first else { panic!("{first:?}") };
        assert_eq!(exits, Exits { count: 1, last: Some(format!("exit 0, '{ROOT}'")) });
        assert_eq!(retry_at_ms, 1_000 + 8_000);
        assert_eq!(
            reason,
            format!("runner job 42 ended (succeeded) without taking a job: exit 0, '{ROOT}'; another runner in 8s")
        );

        let second = after_runner(&p, &exits, &end(JobState::Succeeded, Some(0), Some(ROOT)), None, 20_000, 0.0);
        let Next::Wait { exits, retry_at_ms, .. } = second else { panic!("{second:?}") };
        assert_eq!((exits.count, retry_at_ms), (2, 20_000 + 16_000));

        let third = after_runner(&p, &exits, &end(JobState::Succeeded, Some(0), Some(ROOT)), None, 50_000, 0.0);
        let Next::Wait { exits, reason, .. } = third else { panic!("{third:?}") };
        assert_eq!(exits.count, 3);
        assert_eq!(
            reason,
            format!("runner exited 3 times without taking a job: exit 0, '{ROOT}'; another runner in 32s")
        );
        // The next runner's queued reason keeps saying so.
        assert_eq!(
            queued_reason(&p, 43, &exits),
            format!("runner job 43 queued; runner exited 3 times without taking a job: exit 0, '{ROOT}'")
        );
        assert_eq!(queued_reason(&p, 43, &Exits { count: 2, last: None }), "runner job 43 queued");
    }

    #[test]
    fn a_runner_that_never_started_counts_and_says_why() {
        let p = policy();
        let mut e = end(JobState::Failed, None, None);
        e.reason = "could not register an Actions runner with GitHub: HTTP 403".into();
        let Next::Wait { exits, .. } = after_runner(&p, &Exits::default(), &e, None, 0, 0.0) else { panic!() };
        assert_eq!(
            exits.last.as_deref(),
            Some("it never ran: could not register an Actions runner with GitHub: HTTP 403")
        );
        let e = end(JobState::Failed, Some(127), Some("bash: /opt/actions-runner/run.sh: No such file or directory"));
        let Next::Wait { exits, .. } = after_runner(&p, &Exits::default(), &e, None, 0, 0.0) else { panic!() };
        assert_eq!(
            exits.last.as_deref(),
            Some("exit 127, 'bash: /opt/actions-runner/run.sh: No such file or directory'")
        );
    }

    #[test]
    fn runners_gpuci_ended_or_that_took_a_job_are_not_exits() {
        let p = policy();
        let prior = Exits { count: 1, last: Some("exit 0".into()) };
        let mut cancelled = end(JobState::Cancelled, None, None);
        cancelled.reason = "the runner took no job within 10m (idle_timeout); removed".into();
        for e in [
            cancelled,
            end(JobState::Lost, None, None),
            end(JobState::TimedOut, None, None),
            RunnerEnd { took_job: true, ..end(JobState::Succeeded, Some(0), None) },
        ] {
            let next = after_runner(&p, &prior, &e, None, 0, 0.0);
            assert!(
                matches!(&next, Next::Now { reason } if reason.contains("waiting for another runner")),
                "{e:?}: {next:?}"
            );
        }
        // Past exits stay in the reason once they are worth telling.
        let many = Exits { count: 3, last: Some("exit 0".into()) };
        let Next::Now { reason } = after_runner(&p, &many, &end(JobState::Lost, None, None), None, 0, 0.0) else {
            panic!()
        };
        assert!(
            reason.starts_with("runner exited 3 times without taking a job: exit 0; runner job 42 ended (lost)"),
            "{reason}"
        );
    }

    #[test]
    fn a_runners_last_line_is_escaped_and_cut() {
        let long = format!("\u{1b}[31m{}", "x".repeat(500));
        let d = describe(&end(JobState::Failed, Some(1), Some(&long)));
        assert!(d.starts_with("exit 1, '\\x1b[31mxxx"), "{d}");
        assert!(d.ends_with("…'") && d.chars().count() < 220, "{d}");
        assert_eq!(describe(&end(JobState::Succeeded, Some(0), Some("  "))), "exit 0");
    }

    #[test]
    fn the_queue_timeout_says_what_was_wrong() {
        let p = policy();
        let many = Exits { count: 4, last: Some(format!("exit 0, '{ROOT}'")) };
        assert_eq!(
            stuck_why(&p, &many, Some("waiting for a GPU"), "x"),
            format!("runner exited 4 times without taking a job: exit 0, '{ROOT}'")
        );
        assert_eq!(stuck_why(&p, &Exits::default(), Some("waiting for a GPU"), "x"), "waiting for a GPU");
        assert_eq!(stuck_why(&p, &Exits::default(), None, "own"), "own");
    }

    #[test]
    fn a_failed_check_keeps_the_job_and_asks_again_later() {
        let p = policy();
        let (at, reason) = check_failed(&p, 1, "GitHub list workflow runs: HTTP 503: Server Error", None, 1_000, 0.0);
        assert_eq!(at, 9_000);
        assert_eq!(
            reason,
            "could not ask GitHub whether the run comes from a fork (1 try): GitHub list workflow runs: HTTP 503: Server Error; asking again in 8s"
        );
        let (at, reason) = check_failed(&p, 3, "timeout", None, 0, 1.0);
        assert_eq!(at, 40_000);
        assert!(reason.contains("(3 tries)"), "{reason}");
    }

    // 2023-11-14 22:13:20 UTC, in milliseconds.
    const T0: i64 = 1_700_000_000_000;

    #[test]
    fn regression_issue_27_githubs_time_comes_before_our_backoff() {
        assert_eq!(next_attempt(T0 + 8_000, None), T0 + 8_000);
        assert_eq!(next_attempt(T0 + 8_000, Some(T0 + 90_000)), T0 + 90_000, "never before GitHub's time");
        assert_eq!(next_attempt(T0 + 300_000, Some(T0 + 90_000)), T0 + 300_000, "a longer backoff stands");
        assert_eq!(rate_limit_reason(T0 + 90_000), "GitHub rate limit until 22:14:50 UTC");
    }

    #[test]
    fn regression_issue_27_a_fork_check_held_back_by_a_rate_limit_asks_again_at_githubs_time() {
        let p = policy();
        let error = "GitHub list workflow runs: GitHub rate limit until 22:15:20 UTC (HTTP 429 Too Many Requests: )";
        let (at, reason) = check_failed(&p, 1, error, Some(T0 + 120_000), T0, 0.0);
        assert_eq!(at, T0 + 120_000, "not after the 8 s backoff");
        assert!(reason.starts_with("GitHub rate limit until 22:15:20 UTC; could not ask GitHub"), "{reason}");
        assert!(reason.ends_with("asking again then"), "{reason}");
        // A hold already over changes nothing.
        assert_eq!(check_failed(&p, 1, "x", Some(T0 - 1), T0, 0.0).0, T0 + 8_000);
    }

    #[test]
    fn regression_issue_27_a_runner_held_back_by_a_rate_limit_is_no_exit_and_waits_for_githubs_time() {
        let p = policy();
        let mut e = end(JobState::Failed, None, None);
        e.reason = "could not register an Actions runner with GitHub: ...".into();
        let prior = Exits { count: 1, last: Some("exit 0".into()) };
        let next = after_runner(&p, &prior, &e, Some(T0 + 90_000), T0, 0.0);
        let Next::Wait { exits, retry_at_ms, reason } = next else { panic!("{next:?}") };
        assert_eq!(exits, prior, "not counted");
        assert_eq!(retry_at_ms, T0 + 90_000);
        assert!(reason.starts_with("GitHub rate limit until 22:14:50 UTC; runner job 42 ended (failed)"), "{reason}");
        // A runner that ran and exited counts, and still waits for GitHub's time.
        let ran = end(JobState::Succeeded, Some(0), Some(ROOT));
        let Next::Wait { exits, retry_at_ms, reason } = after_runner(&p, &prior, &ran, Some(T0 + 90_000), T0, 0.0)
        else {
            panic!()
        };
        assert_eq!((exits.count, retry_at_ms), (2, T0 + 90_000));
        assert!(reason.ends_with("another runner after the GitHub rate limit until 22:14:50 UTC"), "{reason}");
    }
}
