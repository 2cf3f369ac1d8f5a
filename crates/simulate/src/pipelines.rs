//! Jobs that wait on other jobs (a trace's `after` column: a pipeline's `depends_on`), for the
//! engine: which are blocked, which a job's end releases, and what the coordinator would hand
//! `decide` as upcoming demand ([`gpuci_core::fleet::fanout`]) from the steps' history.
//!
//! Rules, as the coordinator's: a job is queued when every job it waits on has ended; if one
//! of them was cancelled (or could never run), it is cancelled too (GitHub skips it, gpuci
//! marks it skipped) and so, in turn, are the jobs waiting on it. A step's history is the run
//! times of its finished jobs (not cancelled ones), learned as the run goes, never ahead.

use crate::trace::TraceJob;
use gpuci_core::fleet::{PipelineStep, StepDurations, StepState, UnixSecs, UpcomingJob};
use std::collections::{BTreeMap, BTreeSet};

pub(crate) struct Deps {
    deps: Vec<Vec<usize>>,
    dependents: Vec<Vec<usize>>,
    /// Jobs each still waits on.
    waiting: Vec<u32>,
    /// One it waited on was cancelled.
    failed: Vec<bool>,
    /// Submitted, waiting on others.
    pub blocked: BTreeSet<usize>,
    pub durations: StepDurations,
}

impl Deps {
    pub fn new(trace: &[TraceJob]) -> Deps {
        let index: BTreeMap<&str, usize> = trace.iter().enumerate().map(|(i, j)| (j.id.as_str(), i)).collect();
        let deps: Vec<Vec<usize>> =
            trace.iter().map(|j| j.after.iter().filter_map(|d| index.get(d.as_str()).copied()).collect()).collect();
        let mut dependents = vec![Vec::new(); trace.len()];
        for (i, ds) in deps.iter().enumerate() {
            for &d in ds {
                dependents[d].push(i);
            }
        }
        Deps {
            waiting: deps.iter().map(|d| d.len() as u32).collect(),
            failed: vec![false; trace.len()],
            deps,
            dependents,
            blocked: BTreeSet::new(),
            durations: StepDurations::default(),
        }
    }

    /// At its submit: whether `job` must wait (it is then blocked).
    pub fn must_wait(&mut self, job: usize) -> bool {
        let wait = self.waiting[job] > 0;
        if wait {
            self.blocked.insert(job);
        }
        wait
    }

    /// `job` ended (`ok`: finished, not cancelled). The blocked jobs this releases, each with
    /// whether it may run (false: one it waited on was cancelled).
    pub fn ended(&mut self, job: usize, ok: bool) -> Vec<(usize, bool)> {
        let mut out = Vec::new();
        for k in 0..self.dependents[job].len() {
            let d = self.dependents[job][k];
            self.waiting[d] = self.waiting[d].saturating_sub(1);
            self.failed[d] |= !ok;
            if self.waiting[d] == 0 && self.blocked.remove(&d) {
                out.push((d, !self.failed[d]));
            }
        }
        out
    }

    /// The blocked GPU jobs with an expected start, as the coordinator computes them: every
    /// blocked job and the unfinished jobs it waits on, through `state` (`None`: ended) and
    /// `fleet` (the fleet a job would go to).
    pub fn upcoming(
        &self,
        trace: &[TraceJob],
        state: impl Fn(usize) -> Option<StepState>,
        fleet: impl Fn(usize) -> Option<String>,
        now: UnixSecs,
    ) -> Vec<UpcomingJob> {
        if self.blocked.is_empty() {
            return Vec::new();
        }
        let mut seen = BTreeSet::new();
        let mut todo: Vec<usize> = self.blocked.iter().copied().collect();
        let mut steps = Vec::new();
        while let Some(j) = todo.pop() {
            if !seen.insert(j) {
                continue;
            }
            let Some(st) = state(j) else { continue };
            todo.extend(self.deps[j].iter().copied());
            let t = &trace[j];
            steps.push(PipelineStep {
                id: t.id.clone(),
                step: t.step_name().to_string(),
                after: t.after.clone(),
                state: st,
                gpus: t.gpus,
                fleets: fleet(j).into_iter().collect(),
                repository: None,
            });
        }
        steps.sort_by(|a, b| a.id.cmp(&b.id));
        gpuci_core::fleet::fanout::upcoming(&steps, &self.durations, now)
    }
}
