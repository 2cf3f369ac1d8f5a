//! The idle hold learned from the fleet's idle spells ([`crate::fleet::idle::hindsight_hold`],
//! [`FleetHistory::idle_spells`]): worked by hand, against a brute force, and through
//! [`decide`].

use super::*;
use crate::fleet::idle::{hindsight_hold, MIN_SPELLS};

/// What a hold pays over spells, by the rule's cost model: rent up to the hold, then buy.
fn paid(hold: u64, buy: f64, spells: &[u64]) -> f64 {
    spells.iter().map(|&g| if g <= hold { g as f64 } else { hold as f64 + buy }).sum()
}

#[test]
fn idle_spells_follow_the_fleets_demand_up_and_down() {
    // Two jobs at 0 and 10; the first ends at 100 (2 → 1: a machine free), the second at 130
    // (1 → 0: another). A job at 160 takes the machine freed last (level 0 → 1: spell 30 s);
    // one at 400 takes the other (1 → 2: spell 300 s). One ends at 500 and nothing comes:
    // open, 100 s so far at 600 (the end at 700 is after it).
    let h = FleetHistory { arrivals: vec![0, 10, 160, 400], ends: vec![100, 130, 500, 700], ..FleetHistory::default() };
    let (done, open) = h.idle_spells(600, 86_400);
    assert_eq!(done, [30, 300]);
    assert_eq!(open, [100]);
    // An end and an arrival in the same second: the machine is taken at once (a 0 s spell).
    let h = FleetHistory { arrivals: vec![0, 50], ends: vec![50], ..FleetHistory::default() };
    assert_eq!(h.idle_spells(60, 86_400), (vec![0], vec![]));
    // Spells that began before the window are left out; ends of jobs that arrived before
    // the arrivals kept free nothing.
    let h = FleetHistory { arrivals: vec![1_000, 1_100], ends: vec![5, 1_050, 1_060], ..FleetHistory::default() };
    assert_eq!(h.idle_spells(2_000, 86_400), (vec![50], vec![]));
    assert_eq!(h.idle_spells(2_000, 900), (vec![], vec![]));
    // No ends kept: nothing to learn from.
    let h = FleetHistory { arrivals: vec![0, 10], ..FleetHistory::default() };
    assert_eq!(h.idle_spells(600, 86_400), (vec![], vec![]));
}

#[test]
fn the_learned_hold_is_the_cheapest_hold_in_hindsight() {
    let buy = 75.0;
    // Sparse: every spell is long. Letting go at once pays 75 per spell; any hold pays more.
    let sparse = vec![3_600; MIN_SPELLS];
    assert_eq!(hindsight_hold(buy, &sparse, &[]), Some((0, MIN_SPELLS)));
    // Dense: every spell is 40 s. Keeping for 40 s pays 40 per spell, letting go 75.
    let dense = vec![40; MIN_SPELLS];
    assert_eq!(hindsight_hold(buy, &dense, &[]), Some((40, MIN_SPELLS)));
    // Too few spells: not learned.
    assert_eq!(hindsight_hold(buy, &dense[1..], &[]), None);
    // Open spells already longer than any hold tried count as long; shorter ones are left out.
    assert_eq!(hindsight_hold(buy, &dense[1..], &[10_000]), Some((40, MIN_SPELLS)));
    assert_eq!(hindsight_hold(buy, &dense[1..], &[10]), None);
    // Mixed, against a brute force over every hold 0 ..= 2B: the same cost, and the longest
    // hold of that cost.
    let mut seed = 7u64;
    for _ in 0..200 {
        let spells: Vec<u64> = (0..MIN_SPELLS + 10)
            .map(|_| {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                let r = seed >> 33;
                if r.is_multiple_of(3) {
                    r % 40
                } else {
                    r % 400
                }
            })
            .collect();
        let (hold, n) = hindsight_hold(buy, &spells, &[]).expect("enough spells");
        assert_eq!(n, spells.len());
        let best = (0..=150).map(|t| paid(t, buy, &spells)).fold(f64::INFINITY, f64::min);
        assert!((paid(hold, buy, &spells) - best).abs() < 1e-6, "{hold}: {} against {best}", paid(hold, buy, &spells));
        assert!((hold + 1..=150).all(|t| paid(t, buy, &spells) > best + 1e-6), "a longer hold costs as little: {hold}");
    }
}

/// Through `decide`: a fleet whose last day's spells were all long stops an idle machine at
/// once and says why; one whose spells were short keeps it for them; too few spells and the
/// prediction rule of `idle_time_comes_from_cost_and_the_fleets_arrivals` decides.
#[test]
fn an_idle_machine_is_held_as_long_as_the_last_days_spells_paid_best() {
    // 30 jobs, one an hour, each ending 10 minutes after it came: 29 spells of 50 minutes.
    let arrivals: Vec<UnixSecs> = (0..30).map(|k| NOW - 30 * 3600 + 3600 * k + 1800).collect();
    let ends: Vec<UnixSecs> = arrivals.iter().map(|a| a + 600).collect();
    let mut w = World::new(vec![stopping("t4")]);
    w.history.insert("t4".into(), FleetHistory { arrivals, ends, ..FleetHistory::default() });
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW)];
    let d = w.decide();
    assert_eq!(short(&d), ["stop m-1"]);
    assert!(
        d.fleets[0].rules[0].starts_with(
            "idle → stop after 0 s (the hold that would have paid least over the last day's 24 idle spells, 0 of \
             them no longer; a stop pays back in 75 s"
        ),
        "{}",
        d.fleets[0].rules[0]
    );

    // Jobs every 2 minutes that run 60 s: spells of 60 s, kept for them.
    let arrivals: Vec<UnixSecs> = (0..40).map(|k| NOW - 4800 + 120 * k).collect();
    let ends: Vec<UnixSecs> = arrivals.iter().map(|a| a + 60).collect();
    w.history.insert("t4".into(), FleetHistory { arrivals, ends, ..FleetHistory::default() });
    w.machines[0].since = NOW - 59;
    let d = w.decide();
    assert!(short(&d).is_empty(), "{:?}", short(&d));
    assert!(d.fleets[0].rules[0].starts_with("idle → stop after 60 s (the hold"), "{}", d.fleets[0].rules[0]);
    w.machines[0].since = NOW - 60;
    assert_eq!(short(&w.decide()), ["stop m-1"]);

    // Worked out by the caller (`relearn`) and used while fresh: the same.
    let h = w.history.get_mut("t4").expect("kept");
    h.relearn(&stopping("t4"), NOW);
    assert_eq!(h.learned_idle.as_ref().map(|l| (l.after_s, l.spells)), Some((Some(60), 39)));
    assert_eq!(short(&w.decide()), ["stop m-1"]);

    // Ten spells: too few; the prediction rule (38 s with no arrival in the last hour).
    let arrivals: Vec<UnixSecs> = (0..10).map(|k| NOW - 30 * 3600 + 3600 * k).collect();
    let ends: Vec<UnixSecs> = arrivals.iter().map(|a| a + 600).collect();
    w.history.insert("t4".into(), FleetHistory { arrivals, ends, ..FleetHistory::default() });
    w.machines[0].since = NOW - 37;
    let d = w.decide();
    assert!(short(&d).is_empty());
    assert!(d.fleets[0].rules[0].starts_with("idle → stop after 38 s (rent or buy"), "{}", d.fleets[0].rules[0]);
}

#[test]
fn stopped_machines_are_kept_so_that_one_job_in_twenty_at_most_waits_a_boot() {
    use crate::fleet::idle::{stopped_floor, SpellWalk};
    // 100 jobs, 2 of which found no spell to end (boots whatever was kept): 5 may wait a boot,
    // 3 more. Rests after a 0 s idle hold and the 30 s stop: 4,970, 3,970, 2,970, 1,970 … s;
    // keeping 1,971 s leaves the three longest to boot.
    let walk =
        |fresh| SpellWalk { done: vec![1000, 2000, 3000, 4000, 5000, 60, 10], open: vec![], arrived: 100, fresh };
    let (hold, words) = stopped_floor(&walk(2), 0).expect("a floor");
    assert_eq!(hold, 1971);
    assert!(
        words.starts_with("stopped machines kept at least 32m51s so that at most 3 more of the last day's 100 jobs")
    );
    // A longer idle hold leaves shorter rests: 4,000 − 600 − 30 + 1.
    assert_eq!(stopped_floor(&walk(2), 600).map(|f| f.0), Some(1371));
    // The unavoidable boots spend the share: nothing to keep for.
    assert_eq!(stopped_floor(&walk(6), 0), None);
    // Few enough long spells: no floor needed.
    assert_eq!(stopped_floor(&SpellWalk { done: vec![5000, 4000], open: vec![], arrived: 100, fresh: 0 }, 0), None);
}

/// Through `decide`: one job an hour for a day, each running a minute, leaves spells of 59
/// minutes; the learned idle hold is 0 (stop at once), and with 24 jobs one may wait a boot,
/// which the day's first took: every stopped machine is kept at least 3,540 − 30 + 1 =
/// 3,511 s, longer than the stopped rule's own 3,409 s (four machines waiting: a gap longer
/// than its price, let go early, `stopped_machines_are_deleted_when_their_disk_costs_more_than_a_boot_saves`).
#[test]
fn the_wait_goal_keeps_stopped_machines_past_the_stopped_rule() {
    let arrivals: Vec<UnixSecs> = (0..24).map(|k| NOW - 86_400 + 3600 * k + 60).collect();
    let ends: Vec<UnixSecs> = arrivals.iter().map(|a| a + 60).collect();
    let mut h = FleetHistory { arrivals, ends, ..FleetHistory::default() };
    h.relearn(&stopping("t4"), NOW);
    let mut w = World::new(vec![stopping("t4")]);
    w.history.insert("t4".into(), h);
    w.machines = (1..=4).map(|k| machine(&format!("m-{k}"), "t4", MachineState::Stopped, NOW - 3000 - k)).collect();
    w.machines[3].since = NOW - 3500;
    assert!(short(&w.decide()).is_empty(), "kept past 3,409 s: {:?}", short(&w.decide()));
    w.machines[3].since = NOW - 3511;
    let d = w.decide();
    assert_eq!(short(&d), ["delete m-4"]);
    let Action::Delete { reason, .. } = &d.actions[0] else { unreachable!() };
    assert!(
        reason.contains("; stopped machines kept at least 58m31s so that at most 0 more of the last day's 24 jobs"),
        "{reason}"
    );
}
