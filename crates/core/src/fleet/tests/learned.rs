//! Fan-out demand ([`crate::fleet::fanout`]) and warm capacity from the arrival profile
//! ([`crate::fleet::profile`]) through [`decide`]: plain data in, actions and reasons out.

use super::*;

fn upcoming(id: &str, at: UnixSecs) -> UpcomingJob {
    UpcomingJob {
        id: id.into(),
        gpus: 1,
        fleets: vec!["t4".into()],
        repository: None,
        expected_at: at,
        expected_run_s: None,
    }
}

#[test]
fn a_fan_out_expected_within_a_boot_gets_all_its_machines_at_once() {
    let mut w = World::new(vec![fleet("t4")]);
    w.queued = vec![job("j0", NOW - 5, "t4")];
    // Boot is the default 120 s: three shards in 60 s are demand now, one in 10 minutes not.
    w.upcoming =
        vec![upcoming("s1", NOW + 60), upcoming("s2", NOW + 60), upcoming("s3", NOW + 60), upcoming("late", NOW + 600)];
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand"; 4], "the queued job and the three shards");
    assert!(
        matches!(&d.actions[3], Action::Create { reason, .. } if reason.starts_with("fan-out: 1 job of a running pipeline expected within one boot (2m00s)")),
        "{:?}",
        d.actions[3]
    );
    // Upcoming jobs are not queued: no waiting reason for them, the queued one keeps its own.
    assert_eq!(d.waiting.keys().collect::<Vec<_>>(), ["j0"]);
    assert!(d.fleets[0].why.contains("4 jobs (3 of them expected within one boot)"), "{}", d.fleets[0].why);
    assert!(d.fleets[0].rules.iter().any(|r| r.starts_with("fan-out: 3 GPU jobs")), "{:?}", d.fleets[0].rules);
    // The late one wakes the loop when it comes within a boot.
    assert_eq!(d.wake_at, Some(NOW + 600 - 120));

    // Without history nothing is anticipated: only the queued job.
    w.upcoming.clear();
    assert_eq!(short(&w.decide()), ["create t4 #0 on-demand"]);
}

#[test]
fn upcoming_jobs_respect_max_after_the_queued_ones() {
    let mut f = fleet("t4");
    f.max = 2;
    let mut w = World::new(vec![f]);
    w.queued = vec![job("j0", NOW - 5, "t4")];
    w.upcoming = vec![upcoming("s1", NOW + 30), upcoming("s2", NOW + 30)];
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand"; 2], "max 2: the queued job first, then one shard");
    assert_eq!(d.waiting["j0"], "waiting for a new machine of fleet t4 (g4dn.xlarge in a, on-demand) to boot");
}

#[test]
fn an_idle_machine_an_upcoming_job_will_take_is_not_let_go() {
    let mut w = World::new(vec![fleet("t4")]);
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW - 900)];
    assert_eq!(short(&w.decide()), ["delete m-1"], "past its 10m idle_timeout");
    w.upcoming = vec![upcoming("s1", NOW + 20)];
    assert!(short(&w.decide()).is_empty(), "kept for the shard expected in 20 s, and no new machine");
    // A job already queued is not counted twice when its upcoming entry lingers.
    w.queued = vec![job("s1", NOW, "t4")];
    assert!(short(&w.decide()).is_empty());
}

#[test]
fn upcoming_jobs_from_a_pipeline_through_decide() {
    // The whole path: steps and history → upcoming → decide.
    let mut d = StepDurations::default();
    d.record("build", 100);
    let steps: Vec<PipelineStep> = std::iter::once(PipelineStep {
        id: "b".into(),
        step: "build".into(),
        after: vec![],
        state: StepState::Running { since: NOW - 50 },
        gpus: 0,
        fleets: vec![],
        repository: None,
    })
    .chain((1..=4).map(|k| PipelineStep {
        id: format!("t{k}"),
        step: "test".into(),
        after: vec!["b".into()],
        state: StepState::Blocked,
        gpus: 1,
        fleets: vec!["t4".into()],
        repository: None,
    }))
    .collect();
    let mut w = World::new(vec![fleet("t4")]);
    w.upcoming = crate::fleet::fanout::upcoming(&steps, &d, NOW);
    assert!(w.upcoming.iter().all(|u| u.expected_at == NOW + 50));
    assert_eq!(short(&w.decide()), ["create t4 #0 on-demand"; 4]);
}

/// Two weeks in which Monday 10:00–11:00 UTC brings 120 jobs to `t4` (NOW is a Monday 10:00).
fn busy_mondays() -> FleetHistory {
    let week = 7 * 86_400;
    let mut arrivals = Vec::new();
    for w in 1..=2 {
        for k in 0..120 {
            arrivals.push((NOW - w * week + k * 30, 75.0)); // 2.5 machines busy on average
        }
    }
    let profile = ArrivalProfile::learn(&arrivals, NOW - 2 * week - 3600, NOW - 3600);
    FleetHistory { profile: Some(profile), ..FleetHistory::default() }
}

#[test]
fn machines_are_made_warm_ahead_of_the_usual_busy_hour() {
    let mut f = fleet("t4");
    f.idle_action = IdleAction::Stop; // buy price: stop 30 + start 45 + start 45 = 120 s
    let mut w = World::new(vec![f]);
    w.history.insert("t4".into(), busy_mondays());
    w.now = NOW - 120; // one boot before 10:00
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand"; 3], "⌈2.5⌉ ready: a job every 30 s is within 120 s");
    assert!(
        d.fleets[0].rules.iter().any(|r| r.starts_with("warm from history: 3 ready ahead of Mon 10:00 UTC")),
        "{:?}",
        d.fleets[0].rules
    );
    assert!(
        matches!(&d.actions[0], Action::Create { reason, .. } if reason == "warm from history: 3 ready wanted, 0 up")
    );
    // Busy machines count as ready: two busy, one idle → nothing more, and the idle one stays
    // past its idle hold.
    w.machines = vec![
        machine("m-1", "t4", MachineState::Busy, NOW - 900),
        machine("m-2", "t4", MachineState::Busy, NOW - 900),
        machine("m-3", "t4", MachineState::Idle, NOW - 3000),
    ];
    assert!(short(&w.decide()).is_empty());
    w.machines.clear();
    // Two hours earlier nothing is expected: no machine, and the fleet says why.
    w.now = NOW - 2 * 3600;
    let d = w.decide();
    assert!(short(&d).is_empty());
    assert!(
        d.fleets[0].rules.iter().any(|r| r.starts_with("warm from history: none ahead of Mon 08:00 UTC")),
        "{:?}",
        d.fleets[0].rules
    );
    assert_eq!(d.wake_at, Some(NOW - 3600 - 120), "looks again one boot before the next hour edge");
}

#[test]
fn an_active_warm_schedule_overrides_what_history_suggests() {
    let mut f = fleet("t4");
    f.idle_action = IdleAction::Stop;
    f.warm = vec![WarmSchedule {
        days: Days::parse("mon").expect("days"),
        from_min: 0,
        to_min: 24 * 60,
        timezone: jiff::tz::TimeZone::UTC,
        min_idle: 1,
    }];
    let mut w = World::new(vec![f]);
    w.history.insert("t4".into(), busy_mondays());
    w.now = NOW - 120;
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand"], "the schedule's 1, not history's 3");
    assert!(
        d.fleets[0].rules.iter().any(|r| r.starts_with("warm: 1 idle (a [[fleet.warm]] schedule")),
        "{:?}",
        d.fleets[0].rules
    );
}

#[test]
fn a_profile_shorter_than_a_week_learns_nothing() {
    let mut h = busy_mondays();
    if let Some(p) = h.profile.as_mut() {
        p.from = p.to - 6 * 86_400;
    }
    let mut w = World::new(vec![fleet("t4")]);
    w.history.insert("t4".into(), h);
    w.now = NOW - 120;
    assert!(short(&w.decide()).is_empty());
}

/// A stopping T4 fleet that has seen 100 jobs in the last day, each 450 s of a machine.
fn t4_with_a_day_of_work() -> (FleetSpec, FleetHistory) {
    let mut f = fleet("t4");
    f.idle_action = IdleAction::Stop;
    f.idle_timeout_s = None;
    f.offers[0].price_per_hour = 0.526;
    f.stopped_price_per_hour = crate::fleet::idle::DEFAULT_STOPPED_PRICE_PER_HOUR;
    let arrivals: Vec<(UnixSecs, f64)> = (0..100).map(|k| (NOW - 86_000 + k * 860, 450.0)).collect();
    let profile = ArrivalProfile::learn(&arrivals, NOW - 86_400, NOW);
    let h = FleetHistory {
        arrivals: arrivals.iter().map(|a| a.0).collect(),
        boot_s: Some(124),
        start_s: Some(45),
        profile: Some(profile),
        ..FleetHistory::default()
    };
    (f, h)
}

#[test]
fn stopped_machines_deep_in_line_are_let_go_first() {
    use crate::fleet::idle::stopped_hold_in_line;
    let (f, mut h) = t4_with_a_day_of_work();
    // 100 single jobs of 450 s, 860 s apart: one machine at a time, 100 times a day. Add 10
    // pushes of three shards at once (2 more each): three at once 10 times.
    for k in 0..10 {
        let t = NOW - 80_000 + k * 8_000 + 500;
        h.arrivals.extend([t, t]);
    }
    h.arrivals.sort_unstable();
    let ups = h.level_ups(NOW);
    assert_eq!(ups, [100, 10, 10]);
    // Buy: (124 − 45) × 2 s of a $0.526/h T4 over a $0.011/h disk ≈ 2h06m (7,583 s).
    let first = stopped_hold_in_line(&f, Some(&h), 0, 1, &ups, NOW).expect("work known");
    let third = stopped_hold_in_line(&f, Some(&h), 0, 3, &ups, NOW).expect("work known");
    let fourth = stopped_hold_in_line(&f, Some(&h), 0, 4, &ups, NOW).expect("work known");
    // First in line: needed every ~14 minutes: kept 2B. Third: every 2.4 h, later than B:
    // let go at B/2. Fourth: never seen: B/2.
    assert_eq!(first.after_s, Some(15_167), "{}", first.why);
    assert_eq!(third.after_s, Some(3_792), "{}", third.why);
    assert_eq!(fourth.after_s, Some(3_792), "{}", fourth.why);
    assert!(
        third.why.contains("3 in line with 0 in use; the fleet went up to 3 at once 10 times in the last day"),
        "{}",
        third.why
    );
    // Two busy machines put the first stopped one third in line.
    assert_eq!(stopped_hold_in_line(&f, Some(&h), 2, 1, &ups, NOW).map(|r| r.after_s), Some(third.after_s));
    // No profile (work unknown) or a stopped_timeout: the shared rule decides.
    assert!(stopped_hold_in_line(&f, Some(&FleetHistory { profile: None, ..h.clone() }), 0, 1, &ups, NOW).is_none());
    let fixed = FleetSpec { stopped_timeout_s: Some(600), ..f.clone() };
    assert!(stopped_hold_in_line(&fixed, Some(&h), 0, 1, &ups, NOW).is_none());

    // Through decide: four stopped for 1h10m (the most recently stopped first in line): the
    // first is kept (2B); the second (two at once 10 times a day: every 2.4 h) and the deeper
    // ones go.
    let mut w = World::new(vec![f]);
    w.history.insert("t4".into(), h);
    w.machines = vec![
        machine("m-1", "t4", MachineState::Stopped, NOW - 4_200),
        machine("m-2", "t4", MachineState::Stopped, NOW - 4_300),
        machine("m-3", "t4", MachineState::Stopped, NOW - 4_400),
        machine("m-4", "t4", MachineState::Stopped, NOW - 4_500),
    ];
    let d = w.decide();
    assert_eq!(short(&d), ["delete m-2", "delete m-3", "delete m-4"]);
    assert!(
        matches!(&d.actions[1], Action::Delete { reason, .. } if reason.starts_with("stopped 73m20s: stopped → delete after 63m12s (rent or buy: 3 in line")),
        "{:?}",
        d.actions[1]
    );
}
