//! Warm capacity from history: an hour-of-week arrival profile per fleet, learned from the
//! fleet's own past jobs (no config), and the warm pool it asks for ahead of the usual busy
//! hours. Decided here and nowhere else; [`super::decide`] applies it.
//!
//! **The profile.** Arrivals per hour of the week (UTC, Monday 00:00–01:00 is hour 0), counted
//! over the time the caller has observed (the coordinator: the jobs table's last
//! [`PROFILE_WEEKS`] weeks; the simulator: the trace so far, never ahead). It is used once it
//! covers [`MIN_OBSERVED_S`] (a full week: every hour of the week seen at least once); before
//! that, nothing is learned and the fleet says so.
//!
//! **Warm machines.** For the hour one boot from now (the hour of `now + boot`, so a machine
//! is ready when the hour begins) the profile gives the arrival rate `λ` (jobs per second)
//! and the work that arrived then, as the mean number of machines it kept busy, `ρ` (each
//! job's run time × its share of a machine, per second observed: Little's law). The idle
//! rule ([`super::idle`]) keeps a machine while its next job is expected within `B` seconds
//! (its rent-or-buy price: stop + start, or boot + the boot a job waits), i.e. when
//! `λ · B ≥ 1`. In such an hour the fleet has `⌈ρ⌉` machines
//! ready (idle, busy or booting) one boot before it begins: the machines the idle rule would
//! keep once the hour's jobs arrive are made before they do, and the hour's first jobs find
//! them instead of waiting a boot each. In a quieter hour (`λ · B < 1`) nothing is made
//! ahead: a machine would wait longer than it saves.
//!
//! **Stopped machines ahead of busy hours.** The stopped rule ([`super::idle::stopped_hold`])
//! predicts the gap until a stopped machine is needed from the last day's arrivals; with a
//! profile it takes the larger of that and the profile's next day, so stopped machines are
//! kept through a quiet Sunday before a busy Monday and let go before a quiet weekend.
//!
//! `[[fleet.warm]]` schedules stay the operator's override: while one is active, its
//! `min_idle` is the pool and the profile is not asked.

use super::UnixSecs;
use serde::Serialize;

pub const HOURS_PER_WEEK: usize = 168;
const WEEK_S: u64 = 7 * 86_400;
/// How far back the coordinator reads the jobs table for the profile.
pub const PROFILE_WEEKS: u64 = 4;
/// The profile is used once it has seen this much: one full week.
pub const MIN_OBSERVED_S: u64 = WEEK_S;

/// Hour of the week, UTC: Monday 00:00–01:00 is 0. (1970-01-01 was a Thursday.)
pub fn hour_of_week(t: UnixSecs) -> usize {
    (((t / 3600) + 3 * 24) % HOURS_PER_WEEK as u64) as usize
}

/// Arrivals of a fleet per hour of the week, over what the caller observed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ArrivalProfile {
    /// Arrivals in each hour of the week, summed over the weeks observed.
    pub counts: Vec<u32>,
    /// Machine-seconds of work that arrived in each hour of the week (run time × the job's
    /// share of a machine), summed likewise.
    pub work_s: Vec<f64>,
    /// The observed time `[from, to)`.
    pub from: UnixSecs,
    pub to: UnixSecs,
}

impl ArrivalProfile {
    /// An empty profile observing from `from`.
    pub fn new(from: UnixSecs) -> ArrivalProfile {
        ArrivalProfile { counts: vec![0; HOURS_PER_WEEK], work_s: vec![0.0; HOURS_PER_WEEK], from, to: from }
    }

    /// From arrivals `(time, machine-seconds of work)` (any order) observed over
    /// `[from, to)`; others are ignored.
    pub fn learn(arrivals: &[(UnixSecs, f64)], from: UnixSecs, to: UnixSecs) -> ArrivalProfile {
        let mut p = ArrivalProfile::new(from);
        for &(t, work) in arrivals.iter().filter(|(t, _)| *t >= from && *t < to) {
            p.counts[hour_of_week(t)] += 1;
            p.work_s[hour_of_week(t)] += work.max(0.0);
        }
        p.to = to.max(from);
        p
    }

    /// One arrival at `t`; observed until `t` at least.
    pub fn record(&mut self, t: UnixSecs) {
        if t < self.from {
            return;
        }
        self.counts[hour_of_week(t)] += 1;
        self.to = self.to.max(t + 1);
    }

    /// The work of a job that arrived at `t` (learned when it ends: machine-seconds).
    pub fn record_work(&mut self, t: UnixSecs, machine_s: f64) {
        if t >= self.from {
            self.work_s[hour_of_week(t)] += machine_s.max(0.0);
        }
    }

    /// Mean machines kept busy by the work that arrives in the hour of the week that holds
    /// `t`; `None` before the profile is ready.
    pub fn busy_machines(&self, t: UnixSecs) -> Option<f64> {
        if !self.ready() {
            return None;
        }
        let seen = self.observed_s(hour_of_week(t));
        (seen > 0).then(|| self.work_s[hour_of_week(t)] / seen as f64)
    }

    /// Mean machine-seconds of work per arrival, over everything observed; `None` before
    /// any job's work is known.
    pub fn mean_work_s(&self) -> Option<f64> {
        let n: u64 = self.counts.iter().map(|&c| u64::from(c)).sum();
        let w: f64 = self.work_s.iter().sum();
        (n > 0 && w > 0.0).then(|| w / n as f64)
    }

    /// Observed until `t` (no arrival since the last one).
    pub fn observe_until(&mut self, t: UnixSecs) {
        self.to = self.to.max(t);
    }

    /// Whether it has seen enough to be used.
    pub fn ready(&self) -> bool {
        self.to.saturating_sub(self.from) >= MIN_OBSERVED_S
    }

    /// Seconds of hour-of-week `how` observed: whole weeks, then the part-week after them
    /// (shorter than a week, so it meets the hour at most twice: partly at its start, and
    /// again a week later).
    fn observed_s(&self, how: usize) -> u64 {
        let span = self.to.saturating_sub(self.from);
        let rest_from = self.from + (span / WEEK_S) * WEEK_S;
        let mut s = (span / WEEK_S) * 3600;
        let h0 = rest_from / 3600;
        let delta = (how + HOURS_PER_WEEK - hour_of_week(rest_from)) % HOURS_PER_WEEK;
        let first = (h0 + delta as u64) * 3600;
        for occ in [first, first + WEEK_S] {
            let (a, b) = (occ.max(rest_from), (occ + 3600).min(self.to));
            s += b.saturating_sub(a);
        }
        s
    }

    /// Mean arrivals per hour in the hour of the week that holds `t`; `None` before the
    /// profile is [`ready`](Self::ready).
    pub fn rate_per_hour(&self, t: UnixSecs) -> Option<f64> {
        if !self.ready() {
            return None;
        }
        let how = hour_of_week(t);
        let seen = self.observed_s(how);
        (seen > 0).then(|| f64::from(self.counts[how]) * 3600.0 / seen as f64)
    }

    /// Mean arrivals expected in `[t, t + span)`, hour by hour; `None` before it is ready.
    pub fn expected_within(&self, t: UnixSecs, span: u64) -> Option<f64> {
        if !self.ready() {
            return None;
        }
        let mut sum = 0.0;
        let mut at = t;
        while at < t + span {
            let end = (((at / 3600) + 1) * 3600).min(t + span);
            sum += self.rate_per_hour(at).unwrap_or(0.0) * (end - at) as f64 / 3600.0;
            at = end;
        }
        Some(sum)
    }
}

/// The machines the profile wants ready at `now`, and why in words.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LearnedWarm {
    /// Machines idle, busy or booting.
    pub ready: u32,
    pub why: String,
    /// When the answer may change (the next hour edge one boot ahead).
    pub next_change: UnixSecs,
}

const DAY_NAMES: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];

/// `Mon 09:00 UTC`.
pub fn hour_label(t: UnixSecs) -> String {
    let how = hour_of_week(t);
    format!("{} {:02}:00 UTC", DAY_NAMES[how / 24], how % 24)
}

/// What a fleet whose machines take `lead_s` to be ready and whose idle rule buys back at
/// `buy_s` seconds of rent should have ready now, capped at `max`. `None` when the profile is
/// not ready.
pub fn learned_warm(p: &ArrivalProfile, now: UnixSecs, lead_s: u64, buy_s: f64, max: u32) -> Option<LearnedWarm> {
    let at = now + lead_s;
    let rate = p.rate_per_hour(at)?;
    let busy = p.busy_machines(at).unwrap_or(0.0);
    let kept = rate / 3600.0 * buy_s >= 1.0;
    let ready = if kept { (busy.ceil() as u32).max(1).min(max) } else { 0 };
    let next_change = ((at / 3600) + 1) * 3600 - lead_s;
    let weeks = p.to.saturating_sub(p.from) as f64 / WEEK_S as f64;
    let why = if ready == 0 {
        format!(
            "warm from history: none ahead of {} ({rate:.1} jobs/h there over {weeks:.1} weeks: a ready machine \
             would wait longer for its job than its rent or buy price, {:.0} s)",
            hour_label(at),
            buy_s
        )
    } else {
        format!(
            "warm from history: {ready} ready ahead of {} ({rate:.1} jobs/h there over {weeks:.1} weeks, keeping \
             {busy:.1} machines busy on average; a job every {:.0} s is within the rent or buy price, {:.0} s)",
            hour_label(at),
            3600.0 / rate,
            buy_s
        )
    };
    Some(LearnedWarm { ready, why, next_change })
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2024-01-01 00:00 UTC, a Monday.
    const MON: UnixSecs = 1_704_067_200;

    #[test]
    fn hours_of_the_week_start_on_monday() {
        assert_eq!(hour_of_week(MON), 0);
        assert_eq!(hour_of_week(MON + 9 * 3600 + 59), 9);
        assert_eq!(hour_of_week(MON + 6 * 86_400 + 23 * 3600), 167);
        assert_eq!(hour_of_week(MON + WEEK_S), 0);
        assert_eq!(hour_label(MON + 86_400 + 14 * 3600), "Tue 14:00 UTC");
    }

    #[test]
    fn rates_are_per_observed_hour_and_wait_for_a_full_week() {
        // Two weeks: 30 jobs each Monday 09:00–10:00, 1 each night hour 03:00.
        let mut arrivals = Vec::new();
        for w in 0..2 {
            for d in 0..7 {
                arrivals.push((MON + w * WEEK_S + d * 86_400 + 3 * 3600 + 5, 60.0));
            }
            for k in 0..30 {
                arrivals.push((MON + w * WEEK_S + 9 * 3600 + k * 100, 240.0));
            }
        }
        let p = ArrivalProfile::learn(&arrivals, MON, MON + 2 * WEEK_S);
        assert_eq!(p.rate_per_hour(MON + 9 * 3600 + 1800), Some(30.0));
        assert_eq!(p.rate_per_hour(MON + 3 * 3600), Some(1.0));
        assert_eq!(p.rate_per_hour(MON + 12 * 3600), Some(0.0));
        assert_eq!(p.busy_machines(MON + 9 * 3600), Some(2.0), "30 jobs of 4 minutes an hour");
        let e = p.expected_within(MON + 8 * 3600 + 1800, 3600).expect("ready");
        assert!((e - 15.0).abs() < 1e-9, "{e}");
        // Six days: not ready, nothing learned.
        let young = ArrivalProfile::learn(&arrivals, MON, MON + 6 * 86_400);
        assert_eq!(young.rate_per_hour(MON + 9 * 3600), None);
        // Incremental recording agrees with learning from the list.
        let mut inc = ArrivalProfile::new(MON);
        for &(t, work) in &arrivals {
            inc.record(t);
            inc.record_work(t, work);
        }
        inc.observe_until(MON + 2 * WEEK_S);
        assert_eq!(inc, p);
    }

    #[test]
    fn a_part_week_counts_only_the_hours_it_saw() {
        // Observed 1.5 weeks: Monday 09:00 was seen twice, Friday 09:00 once.
        let at = [MON + 9 * 3600, MON + WEEK_S + 9 * 3600, MON + 4 * 86_400 + 9 * 3600].map(|t| (t, 1.0));
        let p = ArrivalProfile::learn(&at, MON, MON + WEEK_S + 3 * 86_400 + 12 * 3600);
        assert_eq!(p.rate_per_hour(MON + 9 * 3600), Some(1.0));
        assert_eq!(p.rate_per_hour(MON + 4 * 86_400 + 9 * 3600), Some(1.0));
    }

    #[test]
    fn machines_are_ready_for_the_hours_work_when_the_idle_rule_would_keep_them() {
        let mut arrivals = Vec::new();
        for w in 0..2 {
            for k in 0..120 {
                arrivals.push((MON + w * WEEK_S + 9 * 3600 + k * 30, 75.0)); // 120 jobs/h at 09:00, 2.5 busy
            }
            for k in 0..10 {
                arrivals.push((MON + w * WEEK_S + 11 * 3600 + k * 360, 300.0)); // 10 jobs/h at 11:00
            }
        }
        let p = ArrivalProfile::learn(&arrivals, MON, MON + 2 * WEEK_S);
        let now = MON + 2 * WEEK_S + 9 * 3600 - 120; // 08:58, boot 2 min: ahead of 09:00
        let w = learned_warm(&p, now, 120, 120.0, 10).expect("ready");
        assert_eq!(w.ready, 3, "⌈2.5⌉ busy on average; a job every 30 s is within 120 s");
        assert!(w.why.starts_with("warm from history: 3 ready ahead of Mon 09:00 UTC (120.0 jobs/h"), "{}", w.why);
        assert_eq!(w.next_change, MON + 2 * WEEK_S + 10 * 3600 - 120);
        assert_eq!(learned_warm(&p, now, 120, 120.0, 2).map(|w| w.ready), Some(2), "capped at max");
        // 11:00: a job every 6 minutes, longer than the 120 s a machine may wait: none ahead.
        let w = learned_warm(&p, now + 2 * 3600, 120, 120.0, 10).expect("ready");
        assert_eq!(w.ready, 0);
        assert!(w.why.starts_with("warm from history: none ahead of Mon 11:00 UTC"), "{}", w.why);
        // With a 15-minute buy price (a fleet that deletes, slow boots), it is worth it: 1 ready.
        assert_eq!(learned_warm(&p, now + 2 * 3600, 120, 900.0, 10).map(|w| w.ready), Some(1));
    }
}
