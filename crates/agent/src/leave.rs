//! When an agent gives its machine up because the coordinator is gone
//! (`gpuci agent --leave-after-unreachable`): the rule lives here and nowhere else; the agent's
//! loop feeds it plain facts and acts on the answer (the CLI runs `--on-leave` and exits).
//!
//! The rule: leave once the coordinator has been unreachable for `limit` *continuously* and no
//! job runs. The clock counts from the later of
//! - the last moment the agent was connected (a welcome received; its start if never), and
//! - the moment the last job ended.
//!
//! Why a running job keeps the machine, and why its end restarts the clock: a job's result is
//! journaled and held until the coordinator acknowledges it (see the crate docs), and a
//! coordinator that comes back gives every agent `lost_after` to return, so a coordinator
//! restart or a long outage during a long job costs nothing if the machine stays. Leaving the
//! moment the job ends would throw that result away after paying for the whole job; one more
//! `limit` of waiting is the most it costs. The trap: a job with no `timeout` that never ends
//! keeps the machine for as long as it runs.

use std::time::{Duration, Instant};

/// What the agent knows when it asks.
#[derive(Clone, Copy, Debug)]
pub struct Facts {
    /// The last moment it had a working connection (its start if it never had one).
    pub last_connected: Instant,
    /// When its last job ended, if one did.
    pub last_job_ended: Option<Instant>,
    /// Jobs running now (received and not finished).
    pub running_jobs: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not yet. Ask again at `recheck_at`; `None`: only when something changes (a job ends),
    /// or never (the limit is too large to reach).
    Stay { recheck_at: Option<Instant> },
    /// Leave: the coordinator has not been reachable for `unreachable_for` (at least `limit`).
    Leave { unreachable_for: Duration },
}

/// Whether an agent not connected now should leave at `now`, given `limit`
/// (`--leave-after-unreachable`). Only asked while disconnected: a connected agent stays.
pub fn decide(limit: Duration, facts: &Facts, now: Instant) -> Verdict {
    if facts.running_jobs > 0 {
        return Verdict::Stay { recheck_at: None };
    }
    let quiet_since = facts.last_job_ended.map_or(facts.last_connected, |ended| ended.max(facts.last_connected));
    let Some(due) = quiet_since.checked_add(limit) else {
        return Verdict::Stay { recheck_at: None };
    };
    if now >= due {
        Verdict::Leave { unreachable_for: now.saturating_duration_since(facts.last_connected) }
    } else {
        Verdict::Stay { recheck_at: Some(due) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);
    const LIMIT: Duration = Duration::from_secs(600);

    fn facts(t0: Instant, connected_at: u64, job_ended_at: Option<u64>, running_jobs: usize) -> Facts {
        Facts {
            last_connected: t0 + S * connected_at as u32,
            last_job_ended: job_ended_at.map(|t| t0 + S * t as u32),
            running_jobs,
        }
    }

    #[test]
    fn an_idle_agent_leaves_once_the_limit_has_passed_since_it_was_last_connected() {
        let t0 = Instant::now();
        let f = facts(t0, 100, None, 0);
        assert_eq!(decide(LIMIT, &f, t0 + S * 100), Verdict::Stay { recheck_at: Some(t0 + S * 700) });
        assert_eq!(decide(LIMIT, &f, t0 + S * 699), Verdict::Stay { recheck_at: Some(t0 + S * 700) });
        assert_eq!(decide(LIMIT, &f, t0 + S * 700), Verdict::Leave { unreachable_for: LIMIT });
        assert_eq!(decide(LIMIT, &f, t0 + S * 750), Verdict::Leave { unreachable_for: S * 650 });
    }

    #[test]
    fn an_agent_that_never_connected_counts_from_its_start() {
        let t0 = Instant::now();
        let f = Facts { last_connected: t0, last_job_ended: None, running_jobs: 0 };
        assert!(matches!(decide(LIMIT, &f, t0 + S * 599), Verdict::Stay { .. }));
        assert_eq!(decide(LIMIT, &f, t0 + LIMIT), Verdict::Leave { unreachable_for: LIMIT });
    }

    #[test]
    fn a_running_job_keeps_the_agent_however_long_the_coordinator_is_gone() {
        let t0 = Instant::now();
        for running in [1, 3] {
            let f = facts(t0, 0, None, running);
            assert_eq!(decide(LIMIT, &f, t0 + S * 86_400), Verdict::Stay { recheck_at: None });
        }
    }

    #[test]
    fn the_clock_restarts_when_the_last_job_ends() {
        let t0 = Instant::now();
        // Disconnected at 0, the job ended at 1000 (long past the limit): another full limit.
        let f = facts(t0, 0, Some(1000), 0);
        assert_eq!(decide(LIMIT, &f, t0 + S * 1000), Verdict::Stay { recheck_at: Some(t0 + S * 1600) });
        assert_eq!(decide(LIMIT, &f, t0 + S * 1600), Verdict::Leave { unreachable_for: S * 1600 });
    }

    #[test]
    fn a_job_that_ended_before_the_last_connection_does_not_count() {
        let t0 = Instant::now();
        let f = facts(t0, 500, Some(100), 0);
        assert_eq!(decide(LIMIT, &f, t0 + S * 1100), Verdict::Leave { unreachable_for: LIMIT });
    }

    #[test]
    fn a_limit_too_large_to_reach_never_leaves() {
        let t0 = Instant::now();
        let f = facts(t0, 0, None, 0);
        assert_eq!(decide(Duration::MAX, &f, t0 + S * 86_400), Verdict::Stay { recheck_at: None });
    }

    /// Over a grid of moments: leaving happens exactly when no job runs and `limit` has passed
    /// since both the last connection and the last job's end; a `Stay` with a recheck time
    /// never names a time at or before `now`.
    #[test]
    fn leaving_happens_exactly_when_the_rule_says() {
        let t0 = Instant::now();
        let limit = S * 10;
        for connected_at in 0..30u64 {
            for now in connected_at..50 {
                // A job ends at or before the moment asked about, never after.
                for job_ended_at in std::iter::once(None).chain((0..=now).map(Some)) {
                    for running in 0..2 {
                        let f = facts(t0, connected_at, job_ended_at, running);
                        let quiet = now - connected_at.max(job_ended_at.unwrap_or(0));
                        let want = running == 0 && quiet >= 10;
                        match decide(limit, &f, t0 + S * now as u32) {
                            Verdict::Leave { unreachable_for } => {
                                assert!(want, "left: {f:?} at {now}");
                                assert_eq!(unreachable_for, S * (now - connected_at) as u32);
                            }
                            Verdict::Stay { recheck_at } => {
                                assert!(!want, "stayed: {f:?} at {now}");
                                if let Some(at) = recheck_at {
                                    assert!(at > t0 + S * now as u32, "{f:?} at {now}: recheck at {at:?}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
