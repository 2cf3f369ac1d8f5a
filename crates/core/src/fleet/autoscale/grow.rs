//! One fleet's growing and shrinking, after [`super::decide`] has matched queued jobs to the
//! machines that exist: new machines for the unmatched jobs (packed first-fit, stopped ones
//! started first, within `max`, the budget and the offers not skipped), the warm pool, boot
//! timeouts, and the idle and stopped holds; and the reasons each fleet and waiting job is
//! given. The rules are those in `autoscale`'s header; this is where most of them are applied.

use super::{
    boot_s, expected_run_s, next_utc_midnight, price_now, Action, AutoscaleInput, Blocked, Decision, FleetSummary,
    FleetWork, Machine, MachineState, QueuedJob, Wake,
};
use crate::fleet::idle::{idle_hold, stopped_hold, stopped_hold_in_line};
use crate::fleet::unavailable::no_offer_reason;
use crate::fleet::{secs, FleetSpec, IdleAction, UnixSecs};

pub(super) fn grow_and_shrink(
    spec: &FleetSpec,
    w: &mut FleetWork<'_>,
    input: &AutoscaleInput<'_>,
    ahead: &std::collections::BTreeSet<&str>,
    out: &mut Decision,
    wake: &mut Wake,
) -> FleetSummary {
    let now = input.now;
    // New machines for the unmatched jobs, packed first-fit (largest first).
    let mut demand = w.demand.clone();
    // Queued jobs' machines first; upcoming jobs fill what is left of them, then get their own.
    let is_ahead = |j: &QueuedJob| ahead.contains(j.id.as_str());
    demand.sort_by(|a, b| {
        is_ahead(a)
            .cmp(&is_ahead(b))
            .then(b.gpus.cmp(&a.gpus))
            .then(a.queued_since.cmp(&b.queued_since))
            .then(a.id.cmp(&b.id))
    });
    let mut bins: Vec<(u32, Vec<&QueuedJob>)> = Vec::new();
    for job in demand {
        match bins.iter_mut().find(|(free, _)| *free >= job.gpus) {
            Some((free, jobs)) => {
                *free -= job.gpus;
                jobs.push(job);
            }
            None => bins.push((spec.machine.gpus - job.gpus, vec![job])),
        }
    }
    // Spare: idle machines and booting ones that no queued job waits for.
    let idle_spare =
        w.slots.iter().filter(|s| !s.claimed && input.machines[s.machine].state == MachineState::Idle).count();
    let booting_spare = w.booting.iter().filter(|s| !s.claimed).count();
    let spare = (idle_spare + booting_spare) as u32;
    // Machines the profile wants ready (idle, busy or booting) ahead of a busy hour.
    let alive = input
        .machines
        .iter()
        .filter(|m| {
            m.fleet == spec.name
                && matches!(
                    m.state,
                    MachineState::Requested | MachineState::Booting | MachineState::Idle | MachineState::Busy
                )
        })
        .count() as u32;
    let ready_target = match (&w.learned, &w.blocked) {
        (Some(l), None) => l.ready,
        _ => 0,
    };
    let ready_missing = ready_target.saturating_sub(alive + bins.len() as u32);
    let warm_missing = w.warm_target.saturating_sub(spare).max(ready_missing);
    let want_more = bins.len() as u32 + warm_missing;
    let room = w.max.saturating_sub(w.counted);
    // Under a daily budget, the machines for jobs are made only while spend today plus their
    // expected cost (boot or start, and their longest job's expected run) stays within it
    // (`super::budget`): a machine is not made for work the budget will not cover.
    let mut over_budget: Option<(usize, crate::fleet::budget::Expected)> = None;
    if let (Some(budget), None) = (spec.daily_budget, &w.blocked) {
        let spent = input.spend_today.get(&spec.name).copied().unwrap_or(0.0);
        let history = input.history.get(&spec.name);
        let price = price_now(spec, w.offer);
        let costs: Vec<f64> = bins
            .iter()
            .enumerate()
            .map(|(k, (_, jobs))| {
                let up = if k < w.stopped.len() {
                    history.and_then(|h| h.start_s).unwrap_or(crate::fleet::idle::DEFAULT_START_S)
                } else {
                    boot_s(history)
                };
                // Nothing known of any of its jobs: nothing expected (spend alone decides).
                match jobs.iter().filter_map(|j| expected_run_s(j, spec, history)).max() {
                    Some(run) => crate::fleet::budget::machine_usd(price, up, run),
                    None => 0.0,
                }
            })
            .collect();
        let n = crate::fleet::budget::admit(budget, spent, &costs);
        if n < bins.len() {
            let admitted: f64 = costs[..n].iter().sum();
            over_budget = Some((
                n,
                crate::fleet::budget::Expected {
                    whose: format!("fleet {}", spec.name),
                    daily: budget,
                    spent,
                    admitted,
                    admitted_n: n,
                    next: costs[n],
                },
            ));
        }
    }
    let want_more = match &over_budget {
        // No warm machine either: the budget is spoken for.
        Some((n, _)) => *n as u32,
        None => want_more,
    };
    let grant = if w.blocked.is_some() { 0 } else { want_more.min(room) };

    // Stopped machines first, then new ones.
    let mut given: Vec<String> = Vec::new();
    let mut stopped = w.stopped.iter();
    let mut created = 0u32;
    for k in 0..grant {
        let for_jobs = (k as usize) < bins.len();
        let why = if for_jobs {
            let jobs = &bins[k as usize].1;
            let n = jobs.iter().filter(|j| !is_ahead(j)).count();
            let m = jobs.len() - n;
            match (n, m) {
                (_, 0) => {
                    format!("{n} queued job{} fit{} no existing machine", plural(n), if n == 1 { "s" } else { "" })
                }
                (0, m) => format!(
                    "fan-out: {m} job{} of a running pipeline expected within one boot ({})",
                    plural(m),
                    secs(boot_s(input.history.get(&spec.name)))
                ),
                (n, m) => {
                    format!("{n} queued job{} and {m} expected within one boot fit no existing machine", plural(n))
                }
            }
        } else {
            if ready_missing > w.warm_target.saturating_sub(spare) {
                format!("warm from history: {ready_target} ready wanted, {alive} up")
            } else {
                format!("warm pool: {} idle wanted, {} spare", w.warm_target, spare)
            }
        };
        if let Some(&i) = stopped.next() {
            let m = &input.machines[i];
            out.actions.push(Action::Start { machine: m.id.clone(), reason: why });
            given.push(format!("waiting for machine {} of fleet {} (starting, was stopped)", m.id, spec.name));
        } else if let Some((o, cap)) = w.offer {
            let why = match w.held.first() {
                Some(&i) => format!(
                    "{why}; stopped machine {} is not started: its offer ({}, {}) is skipped after a refusal",
                    input.machines[i].id,
                    spec.offers.get(input.machines[i].offer).map_or_else(String::new, |o| o.label()),
                    input.machines[i].capacity
                ),
                None => why,
            };
            out.actions.push(Action::Create { fleet: spec.name.clone(), offer: o, capacity: cap, reason: why });
            given.push(format!(
                "waiting for a new machine of fleet {} ({}, {cap}) to boot",
                spec.name,
                spec.offers[o].label()
            ));
            created += 1;
        } else {
            break;
        }
    }
    let granted = given.len();
    let short = match &over_budget {
        Some((n, e)) if granted >= *n => {
            wake.at(next_utc_midnight(now));
            e.reason()
        }
        _ => blocked_reason(spec, w, room.saturating_sub(granted as u32), now),
    };
    for (k, (_, jobs)) in bins.iter().enumerate() {
        let reason = given.get(k).cloned().unwrap_or_else(|| short.clone());
        for job in jobs.iter().filter(|j| !is_ahead(j)) {
            out.waiting.insert(job.id.clone(), reason.clone());
        }
    }
    if let Some(Blocked::Budget { .. }) = w.blocked {
        wake.at(next_utc_midnight(now));
    }
    if let Some(u) = w.breaker_until {
        wake.at(u);
    }
    if granted < want_more as usize {
        if let Some(u) = w.no_offer_until {
            wake.at(u);
        }
    }
    for s in &spec.warm {
        if let Some(t) = s.next_change_after(now) {
            wake.at(t);
        }
    }

    // Idle machines past their timeout that no job waits for, keeping the warm pool.
    let mut idle: Vec<&Machine> = w
        .slots
        .iter()
        .filter(|s| !s.claimed)
        .map(|s| &input.machines[s.machine])
        .filter(|m| m.state == MachineState::Idle && !m.runs_jobs())
        .collect();
    idle.sort_by(|a, b| a.since.cmp(&b.since).then_with(|| a.id.cmp(&b.id)));
    let history = input.history.get(&spec.name);
    // How long an idle machine is kept: the fleet's `idle_timeout`, else rent or buy from its
    // recent arrivals with as many machines waiting for them as are idle now.
    let idle_rule = idle_hold(spec, history, idle.len() as u32, now);
    let idle_after = idle_rule.after_s.unwrap_or(u64::MAX);
    // Idle machines kept: the warm pool, and what the profile wants ready beyond the busy and
    // booting ones.
    let others = alive.saturating_sub(idle.len() as u32);
    let keep = (w.warm_target as usize).saturating_sub(booting_spare).max(ready_target.saturating_sub(others) as usize);
    let mut removable = idle.len().saturating_sub(keep);
    let mut removed = 0u32;
    for m in &idle {
        let expires = m.since.saturating_add(idle_after);
        if removable == 0 {
            break;
        }
        if now < expires {
            wake.at(expires);
            continue;
        }
        let reason = format!("idle {}: {}", secs(now.saturating_sub(m.since)), idle_rule.why);
        out.actions.push(match spec.idle_action {
            IdleAction::Stop => Action::Stop { machine: m.id.clone(), reason },
            IdleAction::Delete => Action::Delete { machine: m.id.clone(), reason },
        });
        removable -= 1;
        removed += 1;
    }

    // Stopped machines not started now (the oldest stopped last in both lists) are deleted
    // once their disk has cost what keeping them can save: `stopped_timeout`, else rent or
    // buy (`crate::fleet::idle::stopped_hold`). A stopped machine is never deleted the pass it is
    // started, and one whose offer is skipped waits out its hold like the others.
    let started_now = granted.min(w.stopped.len());
    let left: Vec<&Machine> = w.stopped.iter().skip(started_now).chain(&w.held).map(|&i| &input.machines[i]).collect();
    let waiting = (idle.len() + left.len()) as u32;
    let stopped_rule = stopped_hold(spec, history, waiting, now);
    let mut deleted_stopped = 0u32;
    // Each by its place in line when the fleet's work is known (`stopped_hold_in_line`).
    let in_use = (alive as usize).saturating_sub(idle.len()) + started_now;
    let ups = if left.is_empty() { Vec::new() } else { history.map(|h| h.level_ups_fresh(now)).unwrap_or_default() };
    // The least a stopped machine is kept for the wait goal, learned with the idle hold.
    let floor = history
        .and_then(|h| h.learned_idle.as_ref())
        .filter(|l| crate::fleet::idle::fresh(l.at, now))
        .and_then(|l| l.stopped_floor.as_ref());
    for (k, m) in left.iter().enumerate() {
        let place = (idle.len() + k + 1) as u32;
        let rule = stopped_hold_in_line(spec, history, in_use as u32, place, &ups, now);
        let rule = rule.as_ref().unwrap_or(&stopped_rule);
        let Some(mut after) = rule.after_s else { continue };
        let mut why = rule.why.clone();
        if let Some((floor, words)) = floor.filter(|(f, _)| *f > after) {
            after = *floor;
            why = format!("{why}; {words}");
        }
        let expires = m.since.saturating_add(after);
        if now < expires {
            wake.at(expires);
            continue;
        }
        let reason = format!("stopped {}: {}", secs(now.saturating_sub(m.since)), why);
        out.actions.push(Action::Delete { machine: m.id.clone(), reason });
        deleted_stopped += 1;
    }
    let mut rules = vec![idle_rule.why];
    if let Some(l) = &w.learned {
        rules.push(l.why.clone());
        wake.at(l.next_change);
    } else if spec.warm.iter().any(|s| s.active_at(now)) {
        rules.push(format!("warm: {} idle (a [[fleet.warm]] schedule, over what history suggests)", w.warm_target));
    }
    if w.ahead > 0 {
        rules.push(format!(
            "fan-out: {} GPU job{} of running pipelines expected within one boot ({}) count as demand now",
            w.ahead,
            plural(w.ahead as usize),
            secs(boot_s(history))
        ));
    }
    if spec.idle_action == IdleAction::Stop || !left.is_empty() {
        rules.push(stopped_rule.why);
    }
    if let Some((_, e)) = &over_budget {
        rules.push(format!("budget: {}", e.reason()));
    }

    let starts = granted as u32 - created;
    let why = if granted > 0 {
        let all = bins.iter().map(|b| b.1.len()).sum::<usize>();
        let soon = bins.iter().flat_map(|b| &b.1).filter(|j| is_ahead(j)).count();
        let soon = if soon > 0 { format!(" ({soon} of them expected within one boot)") } else { String::new() };
        format!(
            "{all} job{}{soon} without a machine, warm pool {}: starting {starts}, creating {created}",
            plural(all),
            w.warm_target
        )
    } else if want_more > 0 {
        short
    } else if removed > 0 || deleted_stopped > 0 {
        let mut parts = Vec::new();
        if removed > 0 {
            let verb = if spec.idle_action == IdleAction::Stop { "stopping" } else { "deleting" };
            parts.push(format!("{verb} {removed} idle past {}", secs(idle_after)));
        }
        if deleted_stopped > 0 {
            parts.push(format!("deleting {deleted_stopped} stopped past their hold"));
        }
        parts.join(", ")
    } else {
        "enough machines".to_string()
    };
    FleetSummary {
        fleet: spec.name.clone(),
        machines: w.counted,
        wanted: (w.counted + granted as u32).saturating_sub(removed),
        why,
        breaker_open_until: w.breaker_until,
        budget_reached: matches!(w.blocked, Some(Blocked::Budget { .. })),
        rules,
    }
}

/// Why a fleet gives no (more) machines now.
fn blocked_reason(spec: &FleetSpec, w: &FleetWork<'_>, room: u32, now: UnixSecs) -> String {
    match &w.blocked {
        Some(Blocked::Budget { budget, spent }) => format!(
            "fleet {}: daily budget ${budget:.2} reached (${spent:.2} spent); waiting until 00:00 UTC",
            spec.name
        ),
        Some(Blocked::SpotOnlyBreaker { until }) => format!(
            "fleet {}: spot interrupted {} times within {}; the fleet uses spot only, waiting {} for the breaker to close",
            spec.name,
            spec.spot_breaker.interruptions,
            secs(spec.spot_breaker.window_s),
            secs(until.saturating_sub(now))
        ),
        None if room == 0 => format!("fleet {}: at max ({} machines)", spec.name, spec.max),
        None => no_offer_reason(spec, &w.skipped, now),
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}
