//! What fleets cost, by day, fleet and repository: pure arithmetic over billed stretches of
//! machines and the runs of jobs on them. A machine's billed time that no job's share covers
//! (boot, idle, GPUs no job leased) is the fleet's overhead, shown as such.

use serde::Serialize;
use std::collections::BTreeMap;

const DAY_MS: i64 = 86_400_000;

/// A machine as the report needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct BilledMachine {
    pub id: String,
    pub fleet: String,
    pub gpus: u32,
    pub price_per_hour: f64,
}

/// A stretch of billed time of a machine; `to_ms` `None` while it lasts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stretch {
    pub machine: String,
    pub from_ms: i64,
    pub to_ms: Option<i64>,
}

/// A job's run on a machine.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    pub machine: String,
    pub repository: Option<String>,
    pub gpus: u32,
    pub from_ms: i64,
    pub to_ms: Option<i64>,
}

/// The repository column of jobs that had none (submitted through the API without one).
pub const NO_REPOSITORY: &str = "(none)";

#[derive(Clone, Debug, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct CostRow {
    /// `YYYY-MM-DD` (UTC).
    pub day: String,
    pub fleet: String,
    /// The repository whose jobs it was; `None`: the fleet's overhead (boot, idle, unleased GPUs).
    pub repository: Option<String>,
    pub usd: f64,
    pub gpu_hours: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct CostReport {
    pub from_ms: i64,
    pub to_ms: i64,
    pub rows: Vec<CostRow>,
    pub total_usd: f64,
    pub overhead_usd: f64,
}

fn overlap(a: (i64, i64), b: (i64, i64)) -> i64 {
    (a.1.min(b.1) - a.0.max(b.0)).max(0)
}

fn day_name(day_start_ms: i64) -> String {
    let secs = day_start_ms.div_euclid(1000);
    jiff::Timestamp::from_second(secs)
        .map_or_else(|_| format!("day {}", day_start_ms / DAY_MS), |t| t.strftime("%Y-%m-%d").to_string())
}

/// Cost from `from_ms` to `to_ms` (open stretches and runs end at `to_ms`), split by UTC day.
pub fn report(machines: &[BilledMachine], stretches: &[Stretch], runs: &[Run], from_ms: i64, to_ms: i64) -> CostReport {
    let by_id: BTreeMap<&str, &BilledMachine> = machines.iter().map(|m| (m.id.as_str(), m)).collect();
    // (day, fleet, repository) → (usd, gpu-ms)
    let mut cells: BTreeMap<(i64, String, Option<String>), (f64, f64)> = BTreeMap::new();
    let usd_per_ms = |m: &BilledMachine| m.price_per_hour / 3_600_000.0;
    let mut day = from_ms.div_euclid(DAY_MS) * DAY_MS;
    while day < to_ms {
        let window = (day.max(from_ms), (day + DAY_MS).min(to_ms));
        for s in stretches {
            let Some(m) = by_id.get(s.machine.as_str()) else { continue };
            let ms = overlap((s.from_ms, s.to_ms.unwrap_or(to_ms)), window) as f64;
            if ms > 0.0 {
                let c = cells.entry((day, m.fleet.clone(), None)).or_default();
                c.0 += ms * usd_per_ms(m);
                c.1 += ms * f64::from(m.gpus);
            }
        }
        for r in runs {
            let Some(m) = by_id.get(r.machine.as_str()) else { continue };
            if m.gpus == 0 || r.gpus == 0 {
                continue;
            }
            // Only what the machine was billed for counts (a run is inside a stretch).
            let billed: i64 = stretches
                .iter()
                .filter(|s| s.machine == r.machine)
                .map(|s| overlap((s.from_ms, s.to_ms.unwrap_or(to_ms)), (r.from_ms, r.to_ms.unwrap_or(to_ms))))
                .sum();
            let ms = overlap((r.from_ms, r.to_ms.unwrap_or(to_ms)), window).min(billed) as f64;
            if ms <= 0.0 {
                continue;
            }
            let share = f64::from(r.gpus.min(m.gpus)) / f64::from(m.gpus);
            let usd = ms * usd_per_ms(m) * share;
            let gpu_ms = ms * f64::from(r.gpus.min(m.gpus));
            let c = cells
                .entry((day, m.fleet.clone(), Some(r.repository.clone().unwrap_or_else(|| NO_REPOSITORY.into()))))
                .or_default();
            c.0 += usd;
            c.1 += gpu_ms;
            // Taken out of the fleet's overhead for that day.
            let o = cells.entry((day, m.fleet.clone(), None)).or_default();
            o.0 -= usd;
            o.1 -= gpu_ms;
        }
        day += DAY_MS;
    }
    let mut rep = CostReport { from_ms, to_ms, ..CostReport::default() };
    for ((day, fleet, repository), (usd, gpu_ms)) in cells {
        // Rounding can leave a hair below zero in the overhead.
        let usd = if usd.abs() < 1e-9 { 0.0 } else { usd };
        rep.total_usd += usd;
        if repository.is_none() {
            rep.overhead_usd += usd;
        }
        rep.rows.push(CostRow { day: day_name(day), fleet, repository, usd, gpu_hours: gpu_ms / 3_600_000.0 });
    }
    rep
}

/// A job's part of its machine's overhead — the billed time no job's own share covers: boot,
/// idle, GPUs no job leased — so far (open stretches and runs end at `now_ms`), split over the
/// runs on the machine by GPU-time. `runs` are every run on machine `m` (others are ignored),
/// `job` the index of the job's own run in it. A machine that ran jobs exists for them: what
/// it cost beyond their running time is theirs too, in proportion to what each used.
pub fn overhead_share(m: &BilledMachine, stretches: &[Stretch], runs: &[Run], job: usize, now_ms: i64) -> f64 {
    let Some(mine) = runs.get(job).filter(|r| r.machine == m.id) else { return 0.0 };
    if m.gpus == 0 {
        return 0.0;
    }
    let stretches: Vec<&Stretch> = stretches.iter().filter(|s| s.machine == m.id).collect();
    let span = |from: i64, to: Option<i64>| (from, to.unwrap_or(now_ms).min(now_ms));
    let billed_ms: i64 = stretches.iter().map(|s| overlap(span(s.from_ms, s.to_ms), (i64::MIN, i64::MAX))).sum();
    // A run counts only where the machine was billed (as in the report).
    let gpu_ms = |r: &Run| -> f64 {
        let ran: i64 = stretches.iter().map(|s| overlap(span(s.from_ms, s.to_ms), span(r.from_ms, r.to_ms))).sum();
        ran as f64 * f64::from(r.gpus.min(m.gpus))
    };
    let used: f64 = runs.iter().filter(|r| r.machine == m.id).map(gpu_ms).sum();
    if used <= 0.0 {
        return 0.0;
    }
    let usd_per_gpu_ms = m.price_per_hour / 3_600_000.0 / f64::from(m.gpus);
    let overhead = (billed_ms as f64 * f64::from(m.gpus) - used).max(0.0) * usd_per_gpu_ms;
    overhead * gpu_ms(mine) / used
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_carries_its_part_of_its_machines_boot_and_idle() {
        // A 4-GPU machine at $8/h billed 2 h (booting and idle around its jobs); a 2-GPU job
        // for 1 h and a 1-GPU job for 30 min. Used: 2 GPU-h + 0.5 GPU-h of 8 GPU-h billed;
        // overhead 5.5 GPU-h × $2 = $11, split 2 : 0.5.
        let machine = m("m1", 4, 8.0);
        let stretches = [Stretch { machine: "m1".into(), from_ms: 0, to_ms: Some(2 * H) }];
        let run = |gpus, from_ms, to_ms| Run { machine: "m1".into(), repository: None, gpus, from_ms, to_ms };
        let runs = [run(2, H / 2, Some(3 * H / 2)), run(1, 0, Some(H / 2))];
        let a = overhead_share(&machine, &stretches, &runs, 0, 10 * H);
        let b = overhead_share(&machine, &stretches, &runs, 1, 10 * H);
        assert!((a - 8.8).abs() < 1e-9 && (b - 2.2).abs() < 1e-9, "{a} {b}");
        // With the jobs' own $5, the machine's $16 is paid in full by its jobs.
        let own = crate::fleet::job_cost(H, 2, 4, 8.0) + crate::fleet::job_cost(H / 2, 1, 4, 8.0);
        assert!((a + b + own - 16.0).abs() < 1e-9);
        // A machine still up: its idle so far, up to now.
        let open = [Stretch { machine: "m1".into(), from_ms: 0, to_ms: None }];
        let at_1h = overhead_share(&machine, &open, &[run(4, 0, Some(H / 2))], 0, H);
        assert!((at_1h - 4.0).abs() < 1e-9, "half an hour idle on 4 GPUs at $2/GPU-h: {at_1h}");
        // Another machine's run, or a job not on this machine, carries nothing.
        let other = [Run { machine: "m2".into(), ..run(1, 0, Some(H)) }];
        assert_eq!(overhead_share(&machine, &stretches, &other, 0, 10 * H), 0.0);
        assert_eq!(overhead_share(&machine, &stretches, &runs, 5, 10 * H), 0.0);
    }

    const H: i64 = 3_600_000;

    fn m(id: &str, gpus: u32, price: f64) -> BilledMachine {
        BilledMachine { id: id.into(), fleet: "f".into(), gpus, price_per_hour: price }
    }

    #[test]
    fn jobs_pay_their_share_and_the_rest_is_overhead() {
        // A 4-GPU machine at $8/h billed for 2 h; a 2-GPU job of repo a for 1 h; a 1-GPU job
        // of repo b for 30 min. Machine: $16. a: 1 h × $8 × 2/4 = $4; b: 0.5 × 8 × 1/4 = $1.
        let day0 = 20_000 * DAY_MS;
        let machines = [m("m1", 4, 8.0)];
        let stretches = [Stretch { machine: "m1".into(), from_ms: day0, to_ms: Some(day0 + 2 * H) }];
        let runs = [
            Run { machine: "m1".into(), repository: Some("a".into()), gpus: 2, from_ms: day0, to_ms: Some(day0 + H) },
            Run {
                machine: "m1".into(),
                repository: Some("b".into()),
                gpus: 1,
                from_ms: day0 + H,
                to_ms: Some(day0 + H + H / 2),
            },
        ];
        let r = report(&machines, &stretches, &runs, day0, day0 + DAY_MS);
        let usd =
            |repo: Option<&str>| r.rows.iter().find(|c| c.repository.as_deref() == repo).map(|c| c.usd).unwrap_or(-1.0);
        assert!((usd(Some("a")) - 4.0).abs() < 1e-9, "{r:?}");
        assert!((usd(Some("b")) - 1.0).abs() < 1e-9, "{r:?}");
        assert!((usd(None) - 11.0).abs() < 1e-9, "{r:?}");
        assert!((r.total_usd - 16.0).abs() < 1e-9 && (r.overhead_usd - 11.0).abs() < 1e-9);
        assert_eq!(r.rows[0].day, "2024-10-04");
    }

    #[test]
    fn a_stretch_across_midnight_is_split_and_open_ones_end_at_the_report_end() {
        let day0 = 20_000 * DAY_MS;
        let machines = [m("m1", 1, 3.6)];
        let stretches = [Stretch { machine: "m1".into(), from_ms: day0 + DAY_MS - H, to_ms: None }];
        let r = report(&machines, &stretches, &[], day0, day0 + DAY_MS + 2 * H);
        let days: Vec<(&str, f64)> = r.rows.iter().map(|c| (c.day.as_str(), c.usd)).collect();
        assert_eq!(days.len(), 2, "{r:?}");
        assert!((days[0].1 - 3.6).abs() < 1e-9 && (days[1].1 - 7.2).abs() < 1e-9, "{days:?}");
    }

    #[test]
    fn a_run_outside_billed_time_costs_nothing() {
        let day0 = 20_000 * DAY_MS;
        let machines = [m("m1", 1, 3.6)];
        let stretches = [Stretch { machine: "m1".into(), from_ms: day0, to_ms: Some(day0 + H) }];
        let runs =
            [Run { machine: "m1".into(), repository: None, gpus: 1, from_ms: day0 + 2 * H, to_ms: Some(day0 + 3 * H) }];
        let r = report(&machines, &stretches, &runs, day0, day0 + DAY_MS);
        assert!((r.total_usd - 3.6).abs() < 1e-9 && (r.overhead_usd - 3.6).abs() < 1e-9, "{r:?}");
    }
}
