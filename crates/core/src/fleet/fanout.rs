//! Fan-out aware demand: the GPU jobs a pipeline will queue soon, so that machines for all of
//! them are asked for at once instead of one boot after another.
//!
//! A pipeline (or a GitHub workflow run) whose GPU steps wait on other steps (`depends_on`)
//! queues them only when those end. Each such step is *upcoming* when its expected start is
//! known: the latest expected end of the steps it waits on, each from its state and from the
//! step's own history ([`StepDurations`]: how long runs of a step with that key took). A step
//! whose expected start depends on a step with no history is not anticipated: nothing is
//! guessed. [`super::decide`] counts an upcoming job as demand when its expected start is
//! within one boot time of the fleet it would go to (machines it would wait for anyway), after
//! every queued job; it claims spare machines first like a queued job, so an idle machine it
//! will take is not stopped meanwhile.
//!
//! Rules, here and nowhere else:
//! - A running step ends at `started + expected duration`, never before now (one that runs
//!   longer than usual is expected to end any moment).
//! - A queued step starts now at the earliest (optimistic: a machine may be missing for it
//!   too, which is its own demand).
//! - A step that waits starts at the latest expected end of what it waits on; steps that ended
//!   (or are not in the list) end now.
//! - The expected duration of a step is the median of its last [`KEEP_RUNS`] runs (a median:
//!   one run stuck until its timeout does not move it).
//!
//! No I/O: the caller (the coordinator's fleet loop from the store, the simulator from its
//! trace) hands in the steps and their history.

use super::autoscale::{AutoscaleInput, MachineState, QueuedJob};
use super::UnixSecs;
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};

/// Runs of a step kept for its expected duration.
pub const KEEP_RUNS: usize = 20;

/// How long runs of each step took, recent last: plain data the caller keeps.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepDurations {
    runs: BTreeMap<String, VecDeque<u64>>,
}

impl StepDurations {
    /// A run of `step` that took `ran_s` (from its start to its end).
    pub fn record(&mut self, step: &str, ran_s: u64) {
        let runs = self.runs.entry(step.to_string()).or_default();
        if runs.len() == KEEP_RUNS {
            runs.pop_front();
        }
        runs.push_back(ran_s);
    }

    /// The median of its recent runs; `None` when it never ran.
    pub fn expected(&self, step: &str) -> Option<u64> {
        let runs = self.runs.get(step)?;
        let mut v: Vec<u64> = runs.iter().copied().collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied()
    }

    pub fn len(&self) -> usize {
        self.runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }
}

/// Where a step of an active pipeline is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    /// Waits for the steps it depends on.
    Blocked,
    Queued,
    Running {
        since: UnixSecs,
    },
    /// Ended (any outcome).
    Done,
}

/// One step (job) of an active pipeline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PipelineStep {
    /// The job's id (unique in the list).
    pub id: String,
    /// The step's name in its history ([`StepDurations`]).
    pub step: String,
    /// Ids of the steps it waits on (of the same list; one not in it counts as ended).
    pub after: Vec<String>,
    pub state: StepState,
    /// GPUs it needs (0: not fleet demand) and the fleets it fits ([`super::fits`]), in order.
    pub gpus: u32,
    pub fleets: Vec<String>,
    pub repository: Option<String>,
}

/// A GPU job not queued yet, expected to be at `expected_at`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UpcomingJob {
    pub id: String,
    pub gpus: u32,
    pub fleets: Vec<String>,
    pub repository: Option<String>,
    pub expected_at: UnixSecs,
    /// Its step's expected run (median of recent runs), for budgets; `None`: never ran.
    pub expected_run_s: Option<u64>,
}

/// The blocked GPU steps whose start can be expected, with when. Pure; steps in a cycle (which
/// the pipeline parser rejects) are not anticipated.
pub fn upcoming(steps: &[PipelineStep], durations: &StepDurations, now: UnixSecs) -> Vec<UpcomingJob> {
    let index: BTreeMap<&str, usize> = steps.iter().enumerate().map(|(i, s)| (s.id.as_str(), i)).collect();
    let mut ends: Vec<Memo> = vec![Memo::Unknown; steps.len()];
    let mut out = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        if s.state != StepState::Blocked || s.gpus == 0 || s.fleets.is_empty() {
            continue;
        }
        if let Some(at) = start_of(i, steps, &index, durations, now, &mut ends) {
            out.push(UpcomingJob {
                id: s.id.clone(),
                gpus: s.gpus,
                fleets: s.fleets.clone(),
                repository: s.repository.clone(),
                expected_at: at,
                expected_run_s: durations.expected(&s.step),
            });
        }
    }
    out
}

/// The upcoming jobs expected within one boot time of the first fleet they fit, as queued
/// jobs (oldest expected first), and when the next of the others comes within it.
pub(super) fn within_lead(
    input: &AutoscaleInput<'_>,
    fleet_index: &BTreeMap<&str, usize>,
) -> (Vec<QueuedJob>, Option<UnixSecs>) {
    let mut ahead = Vec::new();
    let mut next: Option<UnixSecs> = None;
    let queued: std::collections::BTreeSet<&str> = input.queued.iter().map(|q| q.id.as_str()).collect();
    for u in input.upcoming {
        if queued.contains(u.id.as_str()) {
            continue; // queued already: counted as such
        }
        let Some(fleet) = u.fleets.iter().find(|f| fleet_index.contains_key(f.as_str())) else { continue };
        // One boot ahead, or one start where a stopped machine will be started for it.
        let h = input.history.get(fleet);
        let stopped = input.machines.iter().any(|m| m.fleet == *fleet && m.state == MachineState::Stopped);
        let lead = if stopped {
            h.and_then(|h| h.start_s).unwrap_or(super::idle::DEFAULT_START_S)
        } else {
            super::autoscale::boot_s(h)
        };
        let from = u.expected_at.saturating_sub(lead);
        if from <= input.now {
            ahead.push(QueuedJob {
                id: u.id.clone(),
                queued_since: u.expected_at,
                gpus: u.gpus,
                fleets: u.fleets.clone(),
                repository: u.repository.clone(),
                expected_run_s: u.expected_run_s,
            });
        } else {
            next = Some(next.map_or(from, |n| n.min(from)));
        }
    }
    ahead.sort_by(|a, b| a.queued_since.cmp(&b.queued_since).then_with(|| a.id.cmp(&b.id)));
    (ahead, next)
}

#[derive(Clone, Copy, PartialEq)]
enum Memo {
    Unknown,
    Visiting,
    Known(Option<UnixSecs>),
}

/// When step `i` is expected to start.
fn start_of(
    i: usize,
    steps: &[PipelineStep],
    index: &BTreeMap<&str, usize>,
    d: &StepDurations,
    now: UnixSecs,
    memo: &mut [Memo],
) -> Option<UnixSecs> {
    let mut at = now;
    for dep in &steps[i].after {
        let Some(&j) = index.get(dep.as_str()) else { continue };
        at = at.max(end_of(j, steps, index, d, now, memo)?);
    }
    Some(at)
}

/// When step `i` is expected to end.
fn end_of(
    i: usize,
    steps: &[PipelineStep],
    index: &BTreeMap<&str, usize>,
    d: &StepDurations,
    now: UnixSecs,
    memo: &mut [Memo],
) -> Option<UnixSecs> {
    match memo[i] {
        Memo::Known(v) => return v,
        Memo::Visiting => return None,
        Memo::Unknown => {}
    }
    memo[i] = Memo::Visiting;
    let s = &steps[i];
    let v = match s.state {
        StepState::Done => Some(now),
        StepState::Running { since } => d.expected(&s.step).map(|run| since.saturating_add(run).max(now)),
        StepState::Queued => d.expected(&s.step).map(|run| now + run),
        StepState::Blocked => match start_of(i, steps, index, d, now, memo) {
            Some(start) => d.expected(&s.step).map(|run| start + run),
            None => None,
        },
    };
    memo[i] = Memo::Known(v);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(id: &str, after: &[&str], state: StepState, gpus: u32) -> PipelineStep {
        PipelineStep {
            id: id.into(),
            step: id.trim_end_matches(char::is_numeric).into(),
            after: after.iter().map(|s| s.to_string()).collect(),
            state,
            gpus,
            fleets: if gpus > 0 { vec!["t4".into()] } else { Vec::new() },
            repository: None,
        }
    }

    #[test]
    fn a_fan_out_after_a_build_is_expected_when_the_build_usually_ends() {
        let mut d = StepDurations::default();
        for run in [100, 90, 3000, 110, 95] {
            d.record("build", run); // one stuck run: the median ignores it
        }
        let now = 1_000;
        let steps = vec![
            step("build", &[], StepState::Running { since: 950 }, 0),
            step("test1", &["build"], StepState::Blocked, 1),
            step("test2", &["build"], StepState::Blocked, 1),
            step("test3", &["build"], StepState::Blocked, 1),
        ];
        let up = upcoming(&steps, &d, now);
        assert_eq!(up.len(), 3);
        assert!(up.iter().all(|u| u.expected_at == 950 + 100), "{up:?}");
        // The build overran its usual time: expected to end now.
        let up = upcoming(&steps, &d, 2_000);
        assert!(up.iter().all(|u| u.expected_at == 2_000));
    }

    #[test]
    fn chains_add_up_and_unknown_steps_are_not_guessed() {
        let mut d = StepDurations::default();
        d.record("build", 60);
        d.record("lint", 30);
        let steps = vec![
            step("build", &[], StepState::Queued, 0),
            step("lint", &["build"], StepState::Blocked, 0),
            step("gpu", &["lint"], StepState::Blocked, 2),
            // Waits on a step that never ran: no expected start.
            step("new", &[], StepState::Queued, 0),
            step("after-new", &["new"], StepState::Blocked, 1),
            // Waits on a step of another list (ended): starts now.
            step("solo", &["gone"], StepState::Blocked, 1),
            // Not GPU work: never fleet demand.
            step("docs", &["build"], StepState::Blocked, 0),
        ];
        let up = upcoming(&steps, &d, 500);
        let got: Vec<(&str, u64, u32)> = up.iter().map(|u| (u.id.as_str(), u.expected_at, u.gpus)).collect();
        assert_eq!(got, [("gpu", 500 + 60 + 30, 2), ("solo", 500, 1)]);
    }

    #[test]
    fn a_cycle_is_not_anticipated_and_does_not_loop() {
        let mut d = StepDurations::default();
        d.record("a", 10);
        d.record("b", 10);
        let steps = vec![step("a", &["b"], StepState::Blocked, 1), step("b", &["a"], StepState::Blocked, 1)];
        assert!(upcoming(&steps, &d, 0).is_empty());
    }

    #[test]
    fn history_keeps_the_last_runs() {
        let mut d = StepDurations::default();
        for k in 0..(KEEP_RUNS as u64 + 10) {
            d.record("s", if k < 10 { 10_000 } else { 50 });
        }
        assert_eq!(d.expected("s"), Some(50));
        assert_eq!(d.expected("never"), None);
    }
}
