//! The reaper's decisions: which silent agents are lost, what becomes of their jobs, and
//! which queued jobs have waited past their queue timeout. One pure function, [`decide`],
//! over what the coordinator's scheduler observed at a tick (its agents' links and silences,
//! its active jobs); the scheduler applies the answer in order (store first, then memory,
//! then the agents) and decides nothing itself. Also the allowance for the coordinator's own
//! stalls ([`stalled`], [`heard_after_stall`]), applied to agents' silences before.
//!
//! The rules, here and nowhere else:
//! - **Silence.** An agent is silent for the time since it was last heard (or went away).
//!   One connected but silent for more than `lost_after` has its connection dropped ("missed
//!   heartbeats") and is lost at once, not after another `lost_after`. One disconnected for
//!   more than `lost_after` is lost.
//! - **The coordinator's stalls are not agents' silence.** A reaper tick that comes much later
//!   than its period means the coordinator did not run (SIGSTOP, a paused VM, a blocked disk);
//!   that time, less one tick, is not counted against any agent ([`heard_after_stall`]).
//! - **A lost agent's jobs end**: `lost` ("the job's outcome is unknown"), or `cancelled` with
//!   the cancel's reason when a cancel was under way. Each `lost` one gets a line in its log,
//!   once, saying its output may stop short. Their retry is [`crate::requeue`]'s. Jobs still
//!   held by an agent already lost (their end could not be stored) are ended again at every
//!   tick: a job of a dead agent never stays `running`.
//! - **Queue timeout.** A queued job ready to place (its dependencies done, its group free)
//!   for more than its step's queue timeout ends `timed_out`, saying what it waited for.
//!   Waiting for a dependency does not count: the clock starts when it became ready.
//!
//! Everything is in the order of agents' and jobs' ids, so the same input gives the same
//! answer. What must not live here: I/O, clocks (the caller hands in `now` and each agent's
//! silence), the store's types, logging.

use crate::job::JobState;
use std::time::{Duration, Instant};

/// Why a connected agent that stopped sending heartbeats is disconnected.
pub const MISSED_HEARTBEATS: &str = "missed heartbeats";

/// An agent's link as the scheduler holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    Connected,
    Disconnected,
    Lost,
}

/// An agent as [`decide`] needs it.
#[derive(Clone, Copy, Debug)]
pub struct AgentSeen<'a> {
    pub id: &'a str,
    /// Its name, for reasons.
    pub name: &'a str,
    pub link: Link,
    /// How long it has been silent (since its last message, or since it went away), with
    /// the coordinator's stalls taken out ([`heard_after_stall`]).
    pub silent_for: Duration,
    /// When it was last heard, wall clock (ms since the epoch), for "last seen n s ago".
    pub last_seen_ms: i64,
}

/// An active (not ended) job as [`decide`] needs it.
#[derive(Clone, Copy, Debug)]
pub struct ActiveJob<'a> {
    pub id: i64,
    pub state: JobState,
    /// The agent it is assigned to.
    pub agent: Option<&'a str>,
    /// When it became ready to place (ms since the epoch); `None`: not ready (waits on a
    /// dependency or its concurrency group) or not queued.
    pub ready_since_ms: Option<i64>,
    /// Its step's queue timeout.
    pub queue_timeout: crate::Duration,
    /// Its reason now (what a queued job waits for).
    pub reason: &'a str,
    /// The reason of a cancel under way, if one is.
    pub cancelling: Option<&'a str>,
    /// Its log already says its output may be missing (an earlier tick ended it lost, and the
    /// store did not take the end).
    pub noted_lost: bool,
}

/// What the reaper does at one tick: [`decide`]'s answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reaping {
    /// Agents lost now, or lost already with jobs not yet ended, in id order.
    pub lost: Vec<LostAgent>,
    /// Queued jobs past their queue timeout, in id order: each ends `timed_out` (never
    /// retried: [`crate::requeue::retries`]).
    pub timed_out: Vec<QueueTimeout>,
}

impl Reaping {
    /// Whether a scheduling pass follows: capacity or work changed.
    pub fn schedules(&self) -> bool {
        !self.lost.is_empty() || !self.timed_out.is_empty()
    }
}

/// A lost agent and the ends of its jobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostAgent {
    pub agent: String,
    /// Connected but silent past `lost_after`: its connection is dropped
    /// ([`MISSED_HEARTBEATS`]) before it is declared lost.
    pub drop_connection: bool,
    /// Declared lost at this tick (the declaration is stored first; while the store takes no
    /// writes, nothing else of this agent is done); `None`: it was lost already.
    pub declare: Option<Declared>,
    /// Its jobs' ends, in id order.
    pub jobs: Vec<LostJob>,
}

/// The reasons of an agent declared lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Declared {
    /// The stored agent's reason.
    pub stored: String,
    /// The reason the scheduler shows for it.
    pub shown: String,
}

/// How a job of a lost agent ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostJob {
    pub job: i64,
    /// `lost`, or `cancelled` when a cancel was under way.
    pub state: JobState,
    pub reason: String,
    /// A line for the job's log, written before the end (once: `None` when it was noted
    /// already, or the job is cancelled).
    pub log_note: Option<String>,
}

/// A queued job past its queue timeout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueTimeout {
    pub job: i64,
    pub reason: String,
}

/// What the reaper does now. `agents` and `jobs` in any order; `now_ms` is the wall clock
/// (ms since the epoch) and `lost_after` how long an agent may be silent.
pub fn decide(agents: &[AgentSeen<'_>], jobs: &[ActiveJob<'_>], now_ms: i64, lost_after: Duration) -> Reaping {
    let mut agents: Vec<&AgentSeen<'_>> = agents.iter().collect();
    agents.sort_by_key(|a| a.id);
    let mut jobs: Vec<&ActiveJob<'_>> = jobs.iter().collect();
    jobs.sort_by_key(|j| j.id);
    let mut out = Reaping::default();
    for a in agents {
        let silent = a.silent_for > lost_after;
        let secs = (now_ms - a.last_seen_ms).max(0) / 1000;
        let (drop_connection, declare) = match a.link {
            Link::Connected | Link::Disconnected if silent => (
                a.link == Link::Connected,
                Some(Declared {
                    stored: format!("no heartbeat for {secs}s"),
                    shown: format!("lost: no heartbeat for {secs}s"),
                }),
            ),
            Link::Lost => (false, None),
            Link::Connected | Link::Disconnected => continue,
        };
        let mine: Vec<LostJob> =
            jobs.iter().filter(|j| j.agent == Some(a.id)).map(|j| lost_job(j, a.name, secs)).collect();
        if declare.is_none() && mine.is_empty() {
            continue;
        }
        out.lost.push(LostAgent { agent: a.id.to_string(), drop_connection, declare, jobs: mine });
    }
    out.timed_out = jobs
        .iter()
        .filter(|j| j.state == JobState::Queued)
        .filter(|j| j.ready_since_ms.is_some_and(|t| now_ms - t > j.queue_timeout.as_millis() as i64))
        .map(|j| QueueTimeout {
            job: j.id,
            reason: format!("still queued after queue_timeout {}: {}", j.queue_timeout, j.reason),
        })
        .collect();
    out
}

/// How job `j` of lost agent `name`, last heard `secs` ago, ends.
fn lost_job(j: &ActiveJob<'_>, name: &str, secs: i64) -> LostJob {
    match j.cancelling {
        Some(why) => LostJob { job: j.id, state: JobState::Cancelled, reason: why.to_string(), log_note: None },
        None => {
            let reason = format!(
                "agent {name} stopped sending heartbeats (last seen {secs}s ago); the job's outcome is unknown"
            );
            let log_note = (!j.noted_lost).then(|| format!("output may be missing from here on: {reason}"));
            LostJob { job: j.id, state: JobState::Lost, reason, log_note }
        }
    }
}

/// When an agent counts as last heard after the coordinator did not run for `stall` (SIGSTOP,
/// a paused VM, a blocked disk): moved forward by the time it was not running, less the one
/// tick it would have waited anyway, never past `now`. A coordinator that did not run heard
/// nobody, however faithfully its agents sent heartbeats; counting that time declared every
/// healthy agent lost the moment it ran again (outsider attack: a 15 s stall with
/// `lost_after` 10 s ended every running job `lost`). Moving, not resetting: silence adds up
/// across stalls, so a coordinator that stalls again and again still finds a dead agent lost
/// after `lost_after` of its own running time (resetting gave it a fresh `lost_after` at
/// every stall, and its jobs stayed `running` for ever).
pub fn heard_after_stall(last_seen: Instant, stall: Duration, tick: Duration, now: Instant) -> Instant {
    last_seen.checked_add(stall.saturating_sub(tick)).map_or(now, |t| t.min(now))
}

/// Whether the reaper's timer came this late: the coordinator was not running in between.
/// A tick that is late by less than a second (a slow store write, a loaded host) is not a
/// stall; heartbeats keep coming through those.
pub fn stalled(previous_tick: Instant, now: Instant, tick: Duration) -> bool {
    now.saturating_duration_since(previous_tick) > 2 * tick + Duration::from_secs(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobState::*;

    const NOW: i64 = 1_000_000;
    const LOST_AFTER: Duration = Duration::from_secs(30);

    fn agent(id: &'static str, link: Link, silent_s: u64) -> AgentSeen<'static> {
        AgentSeen {
            id,
            name: id,
            link,
            silent_for: Duration::from_secs(silent_s),
            last_seen_ms: NOW - silent_s as i64 * 1000,
        }
    }

    fn job(id: i64, state: JobState, agent: Option<&'static str>) -> ActiveJob<'static> {
        ActiveJob {
            id,
            state,
            agent,
            ready_since_ms: None,
            queue_timeout: crate::Duration::from_secs(60),
            reason: "waiting for a GPU",
            cancelling: None,
            noted_lost: false,
        }
    }

    #[test]
    fn an_agent_silent_past_lost_after_is_lost_and_its_running_jobs_end_lost() {
        let agents = [agent("a", Link::Connected, 31), agent("b", Link::Connected, 29)];
        let jobs = [job(1, Running, Some("a")), job(2, Running, Some("b")), job(3, Assigned, Some("a"))];
        let r = decide(&agents, &jobs, NOW, LOST_AFTER);
        assert_eq!(r.lost.len(), 1, "{r:?}");
        let a = &r.lost[0];
        assert_eq!(a.agent, "a");
        assert!(a.drop_connection, "a connected agent's connection is dropped first");
        assert_eq!(
            a.declare,
            Some(Declared { stored: "no heartbeat for 31s".into(), shown: "lost: no heartbeat for 31s".into() })
        );
        let ended: Vec<(i64, JobState)> = a.jobs.iter().map(|j| (j.job, j.state)).collect();
        assert_eq!(ended, [(1, Lost), (3, Lost)], "b's job goes on: b was heard 29 s ago");
        assert_eq!(
            a.jobs[0].reason,
            "agent a stopped sending heartbeats (last seen 31s ago); the job's outcome is unknown"
        );
        assert_eq!(
            a.jobs[0].log_note.as_deref(),
            Some("output may be missing from here on: agent a stopped sending heartbeats (last seen 31s ago); the job's outcome is unknown")
        );
        assert!(r.schedules());
    }

    #[test]
    fn silence_of_exactly_lost_after_is_not_yet_lost() {
        let r = decide(&[agent("a", Link::Disconnected, 30)], &[job(1, Running, Some("a"))], NOW, LOST_AFTER);
        assert_eq!(r, Reaping::default());
        assert!(!r.schedules());
    }

    #[test]
    fn a_disconnected_agent_is_lost_after_lost_after_without_dropping_anything() {
        let r = decide(&[agent("a", Link::Disconnected, 45)], &[], NOW, LOST_AFTER);
        assert_eq!(r.lost.len(), 1);
        assert!(!r.lost[0].drop_connection);
        assert!(r.lost[0].declare.is_some());
        assert!(r.lost[0].jobs.is_empty());
        assert!(r.schedules(), "an agent lost is capacity gone: the pass re-reads it");
    }

    /// A lost agent is declared once; the jobs whose end the store did not take are ended
    /// again at every tick, and their log is noted only once.
    #[test]
    fn jobs_of_an_agent_lost_already_are_ended_again_and_noted_once() {
        let agents = [agent("a", Link::Lost, 600), agent("b", Link::Lost, 600)];
        let mut noted = job(1, Running, Some("a"));
        noted.noted_lost = true;
        let r = decide(&agents, &[noted, job(2, Running, Some("a"))], NOW, LOST_AFTER);
        assert_eq!(r.lost.len(), 1, "b, lost with no job, needs nothing: {r:?}");
        assert_eq!(r.lost[0].declare, None, "declared once");
        assert_eq!(r.lost[0].jobs[0].log_note, None, "noted already");
        assert!(r.lost[0].jobs[1].log_note.is_some());
    }

    #[test]
    fn a_job_being_cancelled_on_a_lost_agent_ends_cancelled_with_the_cancels_reason() {
        let mut j = job(1, Running, Some("a"));
        j.cancelling = Some("cancelled by alice");
        let r = decide(&[agent("a", Link::Disconnected, 31)], &[j], NOW, LOST_AFTER);
        assert_eq!(
            r.lost[0].jobs,
            [LostJob { job: 1, state: Cancelled, reason: "cancelled by alice".into(), log_note: None }]
        );
    }

    /// A stall of the coordinator itself longer than `lost_after` does not make its agents
    /// lost: their silence is counted only while it ran.
    #[test]
    fn a_stall_of_the_coordinator_does_not_make_agents_lost() {
        let tick = Duration::from_secs(1);
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // Heard at t0 + 5 s, then the coordinator stopped from t0 + 6 s to t0 + 46 s.
        let (last_seen, previous_tick, now) = (t0 + s(5), t0 + s(6), t0 + s(46));
        assert!(stalled(previous_tick, now, tick));
        let heard = heard_after_stall(last_seen, now - previous_tick, tick, now);
        let mut a = agent("a", Link::Connected, 0);
        a.silent_for = now.saturating_duration_since(heard);
        assert!(a.silent_for <= s(2), "{:?}", a.silent_for);
        let r = decide(&[a], &[job(1, Running, Some("a"))], NOW, LOST_AFTER);
        assert_eq!(r, Reaping::default());
        // Without the allowance the same agent was lost.
        a.silent_for = now.saturating_duration_since(last_seen);
        assert_eq!(decide(&[a], &[job(1, Running, Some("a"))], NOW, LOST_AFTER).lost.len(), 1);
    }

    #[test]
    fn a_late_tick_of_under_a_second_is_not_a_stall() {
        let tick = Duration::from_secs(1);
        let t0 = Instant::now();
        assert!(!stalled(t0, t0 + Duration::from_millis(2900), tick));
        assert!(stalled(t0, t0 + Duration::from_millis(3100), tick));
    }

    /// Silence adds up across stalls: a dead agent is still found lost after `lost_after`
    /// of the coordinator's own running time, however often it stalls.
    #[test]
    fn a_dead_agent_is_lost_even_if_the_coordinator_stalls_again_and_again() {
        let tick = Duration::from_secs(1);
        let t0 = Instant::now();
        let mut last_seen = t0;
        let mut now = t0;
        let mut lost_at = None;
        for round in 0..100 {
            // 5 s of running, then a 20 s stall.
            now += Duration::from_secs(5);
            let a =
                AgentSeen { silent_for: now.saturating_duration_since(last_seen), ..agent("a", Link::Disconnected, 0) };
            if !decide(&[a], &[], NOW, LOST_AFTER).lost.is_empty() {
                lost_at = Some(round);
                break;
            }
            let stall = Duration::from_secs(20);
            now += stall;
            last_seen = heard_after_stall(last_seen, stall, tick, now);
        }
        assert!(lost_at.is_some(), "the dead agent was never found lost");
    }

    #[test]
    fn a_queued_job_times_out_only_after_waiting_ready_for_its_queue_timeout() {
        let mut ready_long = job(1, Queued, None);
        ready_long.ready_since_ms = Some(NOW - 61_000);
        let mut ready_short = job(2, Queued, None);
        ready_short.ready_since_ms = Some(NOW - 59_000);
        let waiting_on_dependency = job(3, Queued, None);
        let mut running = job(4, Running, Some("a"));
        running.ready_since_ms = Some(NOW - 600_000);
        let r = decide(&[], &[running, waiting_on_dependency, ready_short, ready_long], NOW, LOST_AFTER);
        assert_eq!(
            r.timed_out,
            [QueueTimeout { job: 1, reason: "still queued after queue_timeout 1m: waiting for a GPU".into() }]
        );
        assert!(r.schedules());
    }

    #[test]
    fn the_answer_is_in_id_order_whatever_the_input_order() {
        let agents = [agent("b", Link::Disconnected, 99), agent("a", Link::Disconnected, 99)];
        let jobs = [job(9, Running, Some("a")), job(2, Running, Some("a")), job(5, Running, Some("b"))];
        let r = decide(&agents, &jobs, NOW, LOST_AFTER);
        let order: Vec<(&str, Vec<i64>)> =
            r.lost.iter().map(|a| (a.agent.as_str(), a.jobs.iter().map(|j| j.job).collect())).collect();
        assert_eq!(order, [("a", vec![2, 9]), ("b", vec![5])]);
    }
}
