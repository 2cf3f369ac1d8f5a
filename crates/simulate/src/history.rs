//! A coordinator's own job history as a trace: what `gpuci simulate --from-store` replays, so
//! an operator sees what the fleet config would have cost on their real weeks.
//!
//! The caller (the CLI) reads the jobs from the store and says which fleet each would go to
//! (the first whose machines it fits, as the autoscaler counts demand); this turns them into
//! [`TraceJob`]s, plainly:
//! - a job arrives when it was created (its `submit_s`, from the earliest job kept); a step
//!   that waited on others (`depends_on`) is replayed as waiting on those jobs of its
//!   pipeline (`after`), so the simulation queues it when they end there, not when they
//!   ended in the past;
//! - it runs as long as it ran (start to end): the simulated machine is as fast as the real
//!   one; a cancelled or failed job runs as long as it did;
//! - a job that never started (cancelled while queued) or has not ended is left out, and so is
//!   a GPU job no fleet of the config fits (it ran on machines no fleet makes): both counted;
//! - a job with no GPU runs off the fleets ([`crate::trace`]); a retry is a job of its own.
//!
//! What the store does not keep is not replayed: concurrency groups (no cancel-in-progress), and
//! when a job became ready after its dependencies (the simulation's own ends decide it).
//! No I/O here.

use crate::trace::TraceJob;
use gpuci_core::fleet::UnixSecs;
use serde::Serialize;
use std::collections::BTreeMap;

/// One stored job, as the replay needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PastJob {
    pub id: i64,
    pub pipeline: i64,
    /// The step's key (its run-time history is kept under it).
    pub step: String,
    /// Keys of the steps of its pipeline it waited on.
    pub depends_on: Vec<String>,
    pub gpus: u32,
    /// The fleet it would go to; `None`: no fleet fits it.
    pub fleet: Option<String>,
    pub created_ms: i64,
    pub started_ms: Option<i64>,
    pub ended_ms: Option<i64>,
}

/// The trace, its second 0 (unix time), and what was left out.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Replay {
    pub jobs: Vec<TraceJob>,
    pub epoch: UnixSecs,
    /// GPU jobs no fleet of the config fits.
    pub no_fleet: usize,
    /// Jobs that never started, or have not ended.
    pub not_run: usize,
}

/// The pool a job with no GPU is given in the trace (it runs off the fleets).
pub const NO_GPU_POOL: &str = "no-gpu";

/// The history as a trace. Jobs come back in arrival order, each after the jobs it waits on.
pub fn replay(jobs: &[PastJob]) -> Replay {
    let mut no_fleet = 0;
    let mut not_run = 0;
    let mut kept: Vec<&PastJob> = Vec::new();
    for j in jobs {
        match (j.started_ms, j.ended_ms) {
            (Some(s), Some(e)) if e >= s => {}
            _ => {
                not_run += 1;
                continue;
            }
        }
        if j.gpus > 0 && j.fleet.is_none() {
            no_fleet += 1;
            continue;
        }
        kept.push(j);
    }
    kept.sort_by_key(|j| (j.created_ms, j.id));
    let epoch_ms = kept.first().map_or(0, |j| j.created_ms);
    // The latest kept attempt of each step of each pipeline so far: what a step waits on.
    let mut latest: BTreeMap<(i64, &str), (&PastJob, u64)> = BTreeMap::new();
    let mut out = Vec::with_capacity(kept.len());
    for j in kept {
        let submit_s = ((j.created_ms - epoch_ms).max(0) / 1000) as u64;
        let after: Vec<String> = j
            .depends_on
            .iter()
            .filter_map(|d| latest.get(&(j.pipeline, d.as_str())))
            .filter(|(_, at)| *at <= submit_s)
            .map(|(dep, _)| dep.id.to_string())
            .collect();
        let ran_ms = j.ended_ms.unwrap_or(0) - j.started_ms.unwrap_or(0);
        out.push(TraceJob {
            id: j.id.to_string(),
            submit_s,
            duration_s: ((ran_ms + 999) / 1000).max(1) as u64,
            pool: j.fleet.clone().unwrap_or_else(|| NO_GPU_POOL.to_string()),
            gpus: j.gpus,
            group: String::new(),
            cancel_in_progress: false,
            after,
            step: j.step.clone(),
        });
        latest.insert((j.pipeline, j.step.as_str()), (j, submit_s));
    }
    Replay { jobs: out, epoch: (epoch_ms / 1000).max(0) as UnixSecs, no_fleet, not_run }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: i64, pipeline: i64, step: &str, gpus: u32, created: i64, ran: Option<(i64, i64)>) -> PastJob {
        PastJob {
            id,
            pipeline,
            step: step.into(),
            depends_on: Vec::new(),
            gpus,
            fleet: (gpus > 0).then(|| "t4".to_string()),
            created_ms: created,
            started_ms: ran.map(|r| r.0),
            ended_ms: ran.map(|r| r.1),
        }
    }

    #[test]
    fn stored_jobs_become_a_trace_with_their_dependencies_and_run_times() {
        const T0: i64 = 1_704_103_200_000;
        let mut test = job(2, 1, "test", 1, T0, Some((T0 + 200_000, T0 + 500_500)));
        test.depends_on = vec!["build".into()];
        let jobs = vec![
            test,
            job(1, 1, "build", 0, T0, Some((T0 + 1_000, T0 + 181_000))),
            // Never started; still running; on a GPU no fleet has.
            job(3, 1, "lint", 1, T0, None),
            job(4, 2, "test", 1, T0 + 60_000, Some((T0 + 61_000, T0 + 50_000))),
            PastJob { fleet: None, ..job(5, 3, "big", 8, T0 + 5_000, Some((T0 + 6_000, T0 + 9_000))) },
            // A retry of the test, later: waits on nothing it was not created after.
            job(6, 1, "test", 1, T0 + 900_000, Some((T0 + 950_000, T0 + 1_000_000))),
        ];
        let r = replay(&jobs);
        assert_eq!((r.epoch, r.not_run, r.no_fleet), (1_704_103_200, 2, 1));
        type Row<'a> = (&'a str, u64, u64, &'a str, u32, Vec<String>);
        let rows: Vec<Row<'_>> = r
            .jobs
            .iter()
            .map(|j| (j.id.as_str(), j.submit_s, j.duration_s, j.pool.as_str(), j.gpus, j.after.clone()))
            .collect();
        assert_eq!(
            rows,
            [
                ("1", 0, 180, NO_GPU_POOL, 0, vec![]),
                ("2", 0, 301, "t4", 1, vec!["1".to_string()]),
                ("6", 900, 50, "t4", 1, vec![]),
            ]
        );
        assert_eq!(r.jobs[1].step, "test");
        // What it makes is a trace the simulator reads back as it is.
        let csv = crate::trace::to_csv(&r.jobs);
        assert_eq!(crate::trace::parse_trace("store", &csv).expect("parses"), r.jobs);
    }

    #[test]
    fn an_empty_history_is_an_empty_trace() {
        let r = replay(&[]);
        assert!(r.jobs.is_empty());
        assert_eq!((r.no_fleet, r.not_run), (0, 0));
    }
}
