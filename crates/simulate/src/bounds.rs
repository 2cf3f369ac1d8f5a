//! What a trace costs at the least, per fleet, computed from the trace alone (the same for
//! every policy):
//!
//! - **lower bound**: every job starts the second it is submitted and runs on exactly its
//!   GPUs; a job cancelled by a newer one of its group (`cancel_in_progress`) runs only until
//!   that newer job's submit time. `Σ gpus × run time`.
//! - **unavoidable boots**: what a clairvoyant autoscaler that knows the whole trace still
//!   pays on machines that take `b` seconds (the fleet's mean boot time) to boot. Take the
//!   machines the ideal schedule needs at each instant, `m(t) = ⌈GPUs in use / GPUs per
//!   machine⌉`, and stack them in levels (machine k is busy while `m(t) ≥ k`). Each level pays
//!   one boot before its first busy stretch, and for every gap between two busy stretches the
//!   cheaper of idling through it or deleting and booting again just in time: `min(gap, b)`.
//!   Plus the GPUs a machine holds that no job uses (`m(t) × GPUs per machine − GPUs in use`).
//!   This is the least any policy pays with zero queue wait; a policy may pay less only by
//!   making jobs wait.

use crate::trace::TraceJob;
use std::collections::HashMap;

/// Per fleet, in GPU-seconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Bound {
    pub lower_bound_gpu_s: f64,
    pub unavoidable_gpu_s: f64,
    /// `Σ gpus × duration` with no cancellation.
    pub trace_gpu_s: f64,
    pub peak_machines: u32,
}

/// For each job (in trace order), when a newer job of its group cancels it, if one does:
/// the first later submit (strictly later: jobs submitted in the same second are one push's
/// shards) of a job of the same group with `cancel_in_progress`.
pub fn cancel_times(trace: &[TraceJob]) -> Vec<Option<u64>> {
    let mut out = vec![None; trace.len()];
    let mut by_group: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, j) in trace.iter().enumerate() {
        if !j.group.is_empty() {
            by_group.entry(j.group.as_str()).or_default().push(i);
        }
    }
    for jobs in by_group.values() {
        // Walk back in submit order, block by block of equal submit times.
        let mut next_cancel: Option<u64> = None;
        let mut k = jobs.len();
        while k > 0 {
            let t = trace[jobs[k - 1]].submit_s;
            let mut start = k;
            while start > 0 && trace[jobs[start - 1]].submit_s == t {
                start -= 1;
            }
            for &j in &jobs[start..k] {
                out[j] = next_cancel;
            }
            if jobs[start..k].iter().any(|&j| trace[j].cancel_in_progress) {
                next_cancel = Some(t);
            }
            k = start;
        }
    }
    out
}

/// The ideal run time of each job: its duration, cut at its cancel time.
pub fn ideal_run(job: &TraceJob, cancel_at: Option<u64>) -> u64 {
    match cancel_at {
        Some(c) => job.duration_s.min(c.saturating_sub(job.submit_s)),
        None => job.duration_s,
    }
}

/// The bound of one fleet from its jobs' ideal runs `(start, run, gpus)`.
pub fn fleet_bound(runs: &[(u64, u64, u32)], gpus_per_machine: u32, boot_s: f64) -> Bound {
    let g = u64::from(gpus_per_machine.max(1));
    let mut b = Bound::default();
    let mut edges: Vec<(u64, i64)> = Vec::with_capacity(runs.len() * 2);
    for &(start, run, gpus) in runs {
        b.lower_bound_gpu_s += (run * u64::from(gpus)) as f64;
        if run > 0 {
            edges.push((start, i64::from(gpus)));
            edges.push((start + run, -i64::from(gpus)));
        }
    }
    // Ends before starts at one instant: a machine freed and taken again has no gap.
    edges.sort_unstable_by_key(|&(t, d)| (t, d));
    let (mut in_use, mut machines, mut last_t) = (0i64, 0u64, 0u64);
    let mut last_free: Vec<Option<u64>> = Vec::new();
    let mut i = 0;
    while i < edges.len() {
        let t = edges[i].0;
        b.unavoidable_gpu_s += ((machines * g) as i64 - in_use).max(0) as f64 * (t - last_t) as f64;
        while i < edges.len() && edges[i].0 == t {
            in_use += edges[i].1;
            i += 1;
        }
        let now_machines = (in_use.max(0) as u64).div_ceil(g);
        for level in machines..now_machines {
            let level = level as usize;
            if level >= last_free.len() {
                last_free.push(None);
            }
            let pay = match last_free[level] {
                None => boot_s,
                Some(free) => ((t - free) as f64).min(boot_s),
            };
            b.unavoidable_gpu_s += pay * g as f64;
        }
        for level in now_machines..machines {
            last_free[level as usize] = Some(t);
        }
        machines = now_machines;
        b.peak_machines = b.peak_machines.max(machines as u32);
        last_t = t;
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str, submit: u64, duration: u64, group: &str, cancel: bool) -> TraceJob {
        TraceJob {
            id: id.into(),
            submit_s: submit,
            duration_s: duration,
            pool: "t4".into(),
            gpus: 1,
            group: group.into(),
            cancel_in_progress: cancel,
        }
    }

    #[test]
    fn newer_pushes_cancel_older_jobs_of_their_group_only() {
        let trace = vec![
            job("a", 0, 100, "pr1", true),
            job("a2", 0, 100, "pr1", true), // same second: a sibling shard, not a newer push
            job("b", 10, 100, "pr2", true),
            job("c", 50, 100, "pr1", true),
            job("d", 60, 100, "main", false),
            job("e", 70, 100, "main", false), // cancel_in_progress = 0: d runs on
        ];
        assert_eq!(cancel_times(&trace), [Some(50), Some(50), None, None, None, None]);
        assert_eq!(ideal_run(&trace[0], Some(50)), 50);
        assert_eq!(ideal_run(&trace[0], Some(500)), 100);
    }

    #[test]
    fn levels_pay_one_boot_then_the_cheaper_of_idle_or_reboot() {
        // Two jobs back to back with a 30 s gap, boot 60 s: one boot + 30 s idle.
        let b = fleet_bound(&[(0, 100, 1), (130, 100, 1)], 1, 60.0);
        assert_eq!((b.lower_bound_gpu_s, b.unavoidable_gpu_s, b.peak_machines), (200.0, 90.0, 1));
        // A 500 s gap: reboot (60) is cheaper than idling.
        let b = fleet_bound(&[(0, 100, 1), (600, 100, 1)], 1, 60.0);
        assert_eq!(b.unavoidable_gpu_s, 120.0);
        // Two at once: two levels, two boots; a 2-GPU machine for 1-GPU jobs wastes a GPU.
        let b = fleet_bound(&[(0, 100, 1), (0, 100, 1)], 1, 60.0);
        assert_eq!((b.unavoidable_gpu_s, b.peak_machines), (120.0, 2));
        let b = fleet_bound(&[(0, 100, 1)], 2, 60.0);
        assert_eq!(b.unavoidable_gpu_s, 2.0 * 60.0 + 100.0);
    }
}
