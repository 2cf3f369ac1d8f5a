//! What a trace costs at the least, per fleet, computed from the trace alone (the same for
//! every policy), on the fleet's own machine size. Three parts, in GPU-seconds, that add up to
//! the **floor** (what the best policy that knows the future pays with zero queue wait):
//!
//! - **lower bound**: every job starts the second it is submitted and runs on exactly its
//!   GPUs; a job cancelled by a newer one of its group (`cancel_in_progress`) runs only until
//!   that newer job's submit time. `Σ gpus × run time`. Independent of machine size.
//! - **packing waste**: machines come whole. At each instant the ideal schedule needs at least
//!   `m(t) = ⌈GPUs in use / GPUs per machine⌉` machines (even if jobs could move between
//!   machines at no cost), so it holds `m(t) × GPUs per machine − GPUs in use` GPUs no job
//!   uses: a 1-GPU job alone on a 4-GPU machine wastes 3 GPUs for as long as it runs.
//!   `∫ (m(t) × g − in use(t)) dt`.
//! - **unavoidable boots**: what a clairvoyant autoscaler that knows the whole trace still
//!   pays to have those `m(t)` machines ready in time, on machines that take `b` seconds (the
//!   fleet's mean boot time) to boot. Stack the machines in levels (machine k is busy while
//!   `m(t) ≥ k`). Each level pays one boot before its first busy stretch, and for every gap
//!   between two busy stretches the cheapest of: idling through it (`gap`), deleting and
//!   booting again just in time (`b`), and — where the provider can stop machines — stopping
//!   and starting again (`stop + start` seconds billed, plus the stopped disk for the gap at
//!   its share `d` of the machine's price: `stop + start + d × gap`). Times `g` GPUs.
//!
//! A policy may pay less than the floor only by making jobs wait (or, on a spot offer, being
//! lucky with prices: the floor is in GPU-hours, not dollars).

use crate::trace::TraceJob;
use std::collections::HashMap;

/// Per fleet, in GPU-seconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Bound {
    pub lower_bound_gpu_s: f64,
    /// Boots and gaps only (see the module header).
    pub unavoidable_gpu_s: f64,
    pub packing_gpu_s: f64,
    /// `Σ gpus × duration` with no cancellation.
    pub trace_gpu_s: f64,
    pub peak_machines: u32,
}

impl Bound {
    /// Lower bound + unavoidable boots + packing waste.
    pub fn floor_gpu_s(&self) -> f64 {
        self.lower_bound_gpu_s + self.unavoidable_gpu_s + self.packing_gpu_s
    }
}

/// What bringing a machine of a fleet up costs, in seconds of the whole machine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MachineCosts {
    /// Mean boot time of a new machine.
    pub boot_s: f64,
    /// Where the provider can stop machines.
    pub restart: Option<Restart>,
}

/// Stopping a machine and starting it again.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Restart {
    /// Mean stop time plus mean start time: billed at the machine's price.
    pub stop_start_s: f64,
    /// The stopped disk's price as a share of the machine's (per second stopped).
    pub disk_share: f64,
}

impl MachineCosts {
    /// The cheapest way through a gap of `gap` seconds between two busy stretches.
    fn gap(&self, gap: f64) -> f64 {
        let mut pay = gap.min(self.boot_s);
        if let Some(r) = self.restart {
            pay = pay.min(r.stop_start_s + r.disk_share * gap);
        }
        pay
    }
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

/// The ideal run time of a job that starts at `start`: its duration, cut at its cancel time.
pub fn ideal_run(job: &TraceJob, start: u64, cancel_at: Option<u64>) -> u64 {
    match cancel_at {
        Some(c) => job.duration_s.min(c.saturating_sub(start)),
        None => job.duration_s,
    }
}

/// The ideal start and run of each job (trace order, which [`crate::trace::parse_trace`]
/// keeps with every job after those it waits on): at its submit, or when the last job it
/// waits on ends with no wait; a job that waits on one cancelled before its end is never run
/// (run 0), as the simulator skips it.
pub fn ideal_runs(trace: &[TraceJob], cancels: &[Option<u64>]) -> Vec<(u64, u64)> {
    let index: HashMap<&str, usize> = trace.iter().enumerate().map(|(i, j)| (j.id.as_str(), i)).collect();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(trace.len());
    let mut skipped = vec![false; trace.len()];
    for (i, j) in trace.iter().enumerate() {
        let mut start = j.submit_s;
        for d in &j.after {
            let Some(&k) = index.get(d.as_str()).filter(|&&k| k < i) else { continue };
            let (s, r) = out[k];
            start = start.max(s + r);
            skipped[i] |= skipped[k] || r < trace[k].duration_s;
        }
        let run = if skipped[i] { 0 } else { ideal_run(j, start, cancels[i]) };
        out.push((start, run));
    }
    out
}

/// The bound of one fleet from its jobs' ideal runs `(start, run, gpus)`.
pub fn fleet_bound(runs: &[(u64, u64, u32)], gpus_per_machine: u32, costs: &MachineCosts) -> Bound {
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
        b.packing_gpu_s += ((machines * g) as i64 - in_use).max(0) as f64 * (t - last_t) as f64;
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
                None => costs.boot_s,
                Some(free) => costs.gap((t - free) as f64),
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
            after: Vec::new(),
            step: String::new(),
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
        assert_eq!(ideal_run(&trace[0], 0, Some(50)), 50);
        assert_eq!(ideal_run(&trace[0], 0, Some(500)), 100);
    }

    const BOOT_60: MachineCosts = MachineCosts { boot_s: 60.0, restart: None };

    #[test]
    fn levels_pay_one_boot_then_the_cheaper_of_idle_or_reboot() {
        // Two jobs back to back with a 30 s gap, boot 60 s: one boot + 30 s idle.
        let b = fleet_bound(&[(0, 100, 1), (130, 100, 1)], 1, &BOOT_60);
        assert_eq!((b.lower_bound_gpu_s, b.unavoidable_gpu_s, b.peak_machines), (200.0, 90.0, 1));
        // A 500 s gap: reboot (60) is cheaper than idling.
        let b = fleet_bound(&[(0, 100, 1), (600, 100, 1)], 1, &BOOT_60);
        assert_eq!(b.unavoidable_gpu_s, 120.0);
        // Two at once: two levels, two boots.
        let b = fleet_bound(&[(0, 100, 1), (0, 100, 1)], 1, &BOOT_60);
        assert_eq!((b.unavoidable_gpu_s, b.packing_gpu_s, b.peak_machines), (120.0, 0.0, 2));
    }

    #[test]
    fn packing_waste_is_the_gpus_a_whole_machine_holds_that_no_job_fills() {
        // One 1-GPU job of 100 s on a 2-GPU machine: the boot is paid on both GPUs (120), and
        // the idle GPU beside the job is packing waste (100), apart from the boot.
        let b = fleet_bound(&[(0, 100, 1)], 2, &BOOT_60);
        assert_eq!((b.lower_bound_gpu_s, b.unavoidable_gpu_s, b.packing_gpu_s), (100.0, 120.0, 100.0));
        assert_eq!(b.floor_gpu_s(), 320.0);
        // Three 1-GPU jobs on 4-GPU machines: one machine, one GPU spare.
        let b = fleet_bound(&[(0, 100, 1), (0, 100, 1), (0, 100, 1)], 4, &BOOT_60);
        assert_eq!((b.packing_gpu_s, b.peak_machines), (100.0, 1));
        // Five: two machines, three spare (a job never spans machines, nor do GPUs).
        let b = fleet_bound(&[(0, 100, 1); 5], 4, &BOOT_60);
        assert_eq!((b.packing_gpu_s, b.unavoidable_gpu_s, b.peak_machines), (300.0, 480.0, 2));
        // A 4-GPU job fills its machine: no waste.
        let b = fleet_bound(&[(0, 100, 4)], 4, &BOOT_60);
        assert_eq!(b.packing_gpu_s, 0.0);
    }

    #[test]
    fn where_machines_can_stop_a_gap_may_cost_a_stop_and_a_start_and_the_disk() {
        // A 500 s gap, boot 60: reboot 60. With stop + start = 40 s and the disk at 1 % of the
        // machine's price: 40 + 0.01 × 500 = 45 < 60.
        let stop = MachineCosts { boot_s: 60.0, restart: Some(Restart { stop_start_s: 40.0, disk_share: 0.01 }) };
        let b = fleet_bound(&[(0, 100, 1), (600, 100, 1)], 1, &stop);
        assert_eq!(b.unavoidable_gpu_s, 60.0 + 45.0);
        // A 20 s gap: idling (20) is still the cheapest.
        let b = fleet_bound(&[(0, 100, 1), (120, 100, 1)], 1, &stop);
        assert_eq!(b.unavoidable_gpu_s, 60.0 + 20.0);
        // A day-long gap: the disk for a day (864) costs more than a reboot (60).
        let b = fleet_bound(&[(0, 100, 1), (86_500, 100, 1)], 1, &stop);
        assert_eq!(b.unavoidable_gpu_s, 120.0);
    }
}
