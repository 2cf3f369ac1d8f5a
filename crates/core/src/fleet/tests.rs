//! The autoscaler's rules, one test each: plain data in, actions and reasons out.

use super::*;
use crate::gpu::GpuRequirements;
use crate::placement::Needs;

const NOW: UnixSecs = 1_704_103_200; // Monday 2024-01-01 10:00 UTC

fn fleet(name: &str) -> FleetSpec {
    FleetSpec {
        name: name.into(),
        provider: ProviderKind::Aws,
        settings: toml::Table::new(),
        machine: MachineSpec {
            gpu_model: "NVIDIA T4".into(),
            gpus: 1,
            gpu_memory: crate::quantity::Bytes(16 << 30),
            compute_capability: Some(crate::gpu::ComputeCapability { major: 7, minor: 5 }),
            cpus: 4,
            memory: crate::quantity::Bytes(16 << 30),
            tags: BTreeMap::new(),
            container_runtime: true,
            time_limit_s: None,
        },
        offers: vec![
            Offer {
                instance_type: "g4dn.xlarge".into(),
                zone: "a".into(),
                price_per_hour: 0.5,
                spot_price_per_hour: Some(0.2),
            },
            Offer {
                instance_type: "g4dn.xlarge".into(),
                zone: "b".into(),
                price_per_hour: 0.5,
                spot_price_per_hour: None,
            },
        ],
        capacity: CapacityPolicy::OnDemand,
        min_idle: 0,
        max: 5,
        idle_timeout_s: Some(600),
        boot_timeout_s: 600,
        idle_action: IdleAction::Delete,
        stopped_timeout_s: None,
        stopped_price_per_hour: 0.0,
        warm: Vec::new(),
        daily_budget: None,
        spot_breaker: SpotBreaker::default(),
        simulate: None,
    }
}

fn job(id: &str, since: UnixSecs, fleet: &str) -> QueuedJob {
    QueuedJob {
        id: id.into(),
        queued_since: since,
        gpus: 1,
        fleets: vec![fleet.into()],
        repository: None,
        expected_run_s: None,
    }
}

fn machine(id: &str, fleet: &str, state: MachineState, since: UnixSecs) -> Machine {
    let busy = state == MachineState::Busy;
    Machine {
        id: id.into(),
        fleet: fleet.into(),
        offer: 0,
        capacity: Capacity::OnDemand,
        state,
        created_at: since.min(NOW - 3600),
        since,
        gpus_busy: u32::from(busy),
        jobs: if busy { vec![format!("job-on-{id}")] } else { Vec::new() },
        note: None,
    }
}

/// Everything `decide` reads, owned, with defaults a test changes.
struct World {
    now: UnixSecs,
    fleets: Vec<FleetSpec>,
    queued: Vec<QueuedJob>,
    machines: Vec<Machine>,
    spend: BTreeMap<String, f64>,
    unavailable: Vec<UnavailableOffer>,
    interruptions: BTreeMap<String, Vec<UnixSecs>>,
    budgets: Vec<crate::fleet::RepoBudget>,
    repo_spend: BTreeMap<String, f64>,
    history: BTreeMap<String, FleetHistory>,
    upcoming: Vec<UpcomingJob>,
}

impl World {
    fn new(fleets: Vec<FleetSpec>) -> World {
        World {
            now: NOW,
            fleets,
            queued: Vec::new(),
            machines: Vec::new(),
            spend: BTreeMap::new(),
            unavailable: Vec::new(),
            interruptions: BTreeMap::new(),
            budgets: Vec::new(),
            repo_spend: BTreeMap::new(),
            history: BTreeMap::new(),
            upcoming: Vec::new(),
        }
    }

    fn decide(&self) -> Decision {
        decide(&AutoscaleInput {
            now: self.now,
            fleets: &self.fleets,
            queued: &self.queued,
            machines: &self.machines,
            spend_today: &self.spend,
            budgets: &self.budgets,
            repo_spend_today: &self.repo_spend,
            unavailable: &self.unavailable,
            interruptions: &self.interruptions,
            history: &self.history,
            upcoming: &self.upcoming,
        })
    }
}

/// Actions in a short form: `create t4 #0 on-demand`, `delete m-1`, …
fn short(d: &Decision) -> Vec<String> {
    d.actions
        .iter()
        .map(|a| match a {
            Action::Create { fleet, offer, capacity, .. } => format!("create {fleet} #{offer} {capacity}"),
            Action::Start { machine, .. } => format!("start {machine}"),
            Action::Stop { machine, .. } => format!("stop {machine}"),
            Action::Delete { machine, .. } => format!("delete {machine}"),
            Action::BootFailed { machine, .. } => format!("boot-failed {machine}"),
        })
        .collect()
}

#[test]
fn queued_jobs_create_one_machine_each() {
    let mut w = World::new(vec![fleet("t4")]);
    w.queued = vec![job("j2", NOW - 5, "t4"), job("j1", NOW - 10, "t4")];
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand", "create t4 #0 on-demand"]);
    assert_eq!(d.waiting["j1"], "waiting for a new machine of fleet t4 (g4dn.xlarge in a, on-demand) to boot");
    assert_eq!(d.fleets[0].wanted, 2);
}

#[test]
fn idle_and_booting_machines_are_used_before_new_ones() {
    let mut w = World::new(vec![fleet("t4")]);
    w.machines =
        vec![machine("m-1", "t4", MachineState::Idle, NOW - 30), machine("m-2", "t4", MachineState::Booting, NOW - 42)];
    w.queued = vec![job("j1", NOW - 3, "t4"), job("j2", NOW - 2, "t4"), job("j3", NOW - 1, "t4")];
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand"], "only j3 needs a new machine");
    assert_eq!(d.waiting["j1"], "machine m-1 of fleet t4 has free GPUs; waiting for the scheduler");
    assert_eq!(d.waiting["j2"], "waiting for machine m-2 of fleet t4 (booting, 42 s)");
}

#[test]
fn a_multi_gpu_machine_takes_several_small_jobs() {
    let mut f = fleet("a100x4");
    f.machine.gpus = 4;
    let mut w = World::new(vec![f]);
    w.queued = (0..5).map(|i| job(&format!("j{i}"), NOW - 10 + i, "a100x4")).collect();
    w.queued.push(QueuedJob {
        id: "big".into(),
        queued_since: NOW,
        gpus: 3,
        fleets: vec!["a100x4".into()],
        repository: None,
        expected_run_s: None,
    });
    // 3 + 1 on one machine, then 1+1+1+1 on the next: first fit, largest first.
    assert_eq!(short(&w.decide()), ["create a100x4 #0 on-demand", "create a100x4 #0 on-demand"]);
    w.queued.push(QueuedJob {
        id: "huge".into(),
        queued_since: NOW,
        gpus: 8,
        fleets: vec!["a100x4".into()],
        repository: None,
        expected_run_s: None,
    });
    let d = w.decide();
    assert_eq!(d.waiting["huge"], "no fleet has a machine that fits this job (8 GPUs)");
}

#[test]
fn busy_machines_are_never_stopped_or_deleted() {
    let mut w = World::new(vec![fleet("t4")]);
    w.machines = vec![machine("m-1", "t4", MachineState::Busy, NOW - 86_400)];
    let d = w.decide();
    assert!(d.actions.is_empty(), "{:?}", d.actions);
}

#[test]
fn booting_past_boot_timeout_is_a_boot_failure() {
    let mut w = World::new(vec![fleet("t4")]);
    w.machines = vec![
        machine("m-1", "t4", MachineState::Booting, NOW - 600),
        machine("m-2", "t4", MachineState::Requested, NOW - 599),
    ];
    let d = w.decide();
    assert_eq!(short(&d), ["boot-failed m-1"]);
    assert_eq!(d.wake_at, Some(NOW + 1), "m-2 times out in one second");
    // A job waiting for m-1 gets a new machine in the same pass, of the next offer: the one
    // that did not boot is skipped as after a capacity error (not booted again in a loop).
    w.queued = vec![job("j1", NOW - 100, "t4"), job("j2", NOW - 50, "t4")];
    let d = w.decide();
    assert_eq!(short(&d), ["boot-failed m-1", "create t4 #1 on-demand"]);
    // With no other offer, nothing is created until the skip ends.
    w.fleets[0].offers.truncate(1);
    let d = w.decide();
    assert_eq!(short(&d), ["boot-failed m-1"]);
    assert_eq!(d.waiting["j1"], "waiting for machine m-2 of fleet t4 (booting, 9m59s)");
    // The job left over is told a machine did not come up, not that there was no capacity.
    assert_eq!(
        d.waiting["j2"],
        "fleet t4: a new machine did not come up: machine m-1: agent did not connect within boot_timeout 10m00s (10m00s booting); trying again in 10m00s"
    );
    assert_eq!(d.fleets[0].why, d.waiting["j2"]);
}

#[test]
fn idle_past_timeout_is_deleted_keeping_min_idle() {
    let mut f = fleet("t4");
    f.min_idle = 1;
    let mut w = World::new(vec![f]);
    w.machines = vec![
        machine("m-1", "t4", MachineState::Idle, NOW - 900),
        machine("m-2", "t4", MachineState::Idle, NOW - 700),
        machine("m-3", "t4", MachineState::Idle, NOW - 100),
    ];
    let d = w.decide();
    // Two may go (three idle, one kept); only m-1 and m-2 are past 10m, oldest first.
    assert_eq!(short(&d), ["delete m-1", "delete m-2"]);
    assert!(
        matches!(&d.actions[0], Action::Delete { reason, .. } if reason == "idle 15m00s: idle → delete after 10m00s (idle_timeout)")
    );
    w.machines.truncate(2);
    assert_eq!(short(&w.decide()), ["delete m-1"], "m-2 stays as the warm pool");
}

#[test]
fn idle_action_stop_stops_and_stopped_machines_start_before_new_ones() {
    let mut f = fleet("t4");
    f.idle_action = IdleAction::Stop;
    let mut w = World::new(vec![f]);
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW - 601)];
    assert_eq!(short(&w.decide()), ["stop m-1"]);

    w.machines = vec![
        machine("m-1", "t4", MachineState::Stopped, NOW - 500),
        machine("m-2", "t4", MachineState::Stopped, NOW - 100),
    ];
    w.queued = vec![job("j1", NOW, "t4"), job("j2", NOW, "t4"), job("j3", NOW, "t4")];
    let d = w.decide();
    assert_eq!(short(&d), ["start m-2", "start m-1", "create t4 #0 on-demand"], "most recently stopped first");
    assert_eq!(d.waiting["j1"], "waiting for machine m-2 of fleet t4 (starting, was stopped)");
}

#[test]
fn max_counts_everything_but_stopped_machines() {
    let mut f = fleet("t4");
    f.max = 2;
    f.idle_action = IdleAction::Stop;
    let mut w = World::new(vec![f]);
    w.machines = vec![
        machine("m-1", "t4", MachineState::Busy, NOW - 60),
        machine("m-2", "t4", MachineState::Stopped, NOW - 60),
        machine("m-3", "t4", MachineState::Stopped, NOW - 30),
    ];
    w.queued = vec![job("j1", NOW, "t4"), job("j2", NOW, "t4")];
    let d = w.decide();
    assert_eq!(short(&d), ["start m-3"], "one of two slots is taken by the busy machine");
    assert_eq!(d.waiting["j2"], "fleet t4: at max (2 machines)");
    assert_eq!((d.fleets[0].machines, d.fleets[0].wanted), (1, 2));
}

#[test]
fn budget_reached_blocks_creates_and_says_until_when() {
    let mut f = fleet("aws-t4");
    f.daily_budget = Some(50.0);
    f.min_idle = 2;
    let mut w = World::new(vec![f]);
    w.spend.insert("aws-t4".into(), 50.12);
    w.queued = vec![job("j1", NOW, "aws-t4")];
    let d = w.decide();
    assert!(d.actions.is_empty(), "{:?}", d.actions);
    assert_eq!(d.waiting["j1"], "fleet aws-t4: daily budget $50.00 reached ($50.12 spent); waiting until 00:00 UTC");
    assert_eq!(d.wake_at, Some(1_704_153_600), "midnight UTC");
    assert!(d.fleets[0].budget_reached);
    w.spend.insert("aws-t4".into(), 49.0);
    assert_eq!(w.decide().actions.len(), 3, "one for the job and two idle for the warm pool");
    // $49.99 spent and a 10-minute job: its machine (2-minute boot + 10 minutes at $0.50/h,
    // $0.10) would pass $50: it is not made, and the job says so (before, spend alone counted:
    // it was).
    w.spend.insert("aws-t4".into(), 49.99);
    w.queued[0].expected_run_s = Some(600);
    let d = w.decide();
    assert!(d.actions.is_empty(), "{:?}", d.actions);
    assert!(
        d.waiting["j1"].starts_with("fleet aws-t4: daily budget $50.00: $49.99 spent + $0.10 expected"),
        "{}",
        d.waiting["j1"]
    );
    // A step that never ran: nothing is expected of it; spend alone decides, as before.
    w.queued[0].expected_run_s = None;
    assert_eq!(w.decide().actions.len(), 3);
}

/// Issue 28: a fleet under a budget counts what the machines it would make are expected to
/// cost (boot and their jobs' expected runs) before making them, so it does not start
/// machines whose jobs the budget will not cover.
#[test]
fn a_budget_counts_the_expected_cost_of_queued_and_upcoming_jobs_before_scaling_up() {
    let mut f = fleet("t4");
    f.daily_budget = Some(50.0);
    let mut w = World::new(vec![f]);
    w.spend.insert("t4".into(), 47.0);
    // Three 2-hour jobs: $0.50/h × (2 min boot + 2 h) = $1.0167 each; $47 + 2 × 1.0167 fits,
    // a third would make $50.05.
    w.queued =
        (0..3).map(|i| QueuedJob { expected_run_s: Some(7200), ..job(&format!("j{i}"), NOW + i, "t4") }).collect();
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand", "create t4 #0 on-demand"]);
    assert_eq!(
        d.waiting["j2"],
        "fleet t4: daily budget $50.00: $47.00 spent + $2.03 expected for 2 already given machines + $1.02 expected \
         for this one (boot and expected run) would pass it; no machine is made for it, so none is stopped mid-job"
    );
    assert!(d.fleets[0].why.contains("creating 2"), "{}", d.fleets[0].why);
    assert!(
        d.fleets[0].rules.iter().any(|r| r.starts_with("budget: fleet t4: daily budget $50.00")),
        "{:?}",
        d.fleets[0].rules
    );
    assert_eq!(d.wake_at, Some(1_704_153_600), "the budget frees at midnight UTC");
    // Short jobs all fit.
    w.queued.iter_mut().for_each(|j| j.expected_run_s = Some(600));
    assert_eq!(w.decide().actions.len(), 3);
    // An upcoming fan-out job counts after the queued ones: it is the one left out.
    w.queued.truncate(2);
    w.queued.iter_mut().for_each(|j| j.expected_run_s = Some(7200));
    w.upcoming = vec![UpcomingJob {
        id: "shard".into(),
        gpus: 1,
        fleets: vec!["t4".into()],
        repository: None,
        expected_at: NOW + 60,
        expected_run_s: Some(7200),
    }];
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand", "create t4 #0 on-demand"]);
    assert!(d.fleets[0].why.contains("creating 2"), "{}", d.fleets[0].why);
    // Nothing known of the jobs' runs: nothing expected, spend alone decides, as before.
    w.upcoming.clear();
    w.queued.iter_mut().for_each(|j| j.expected_run_s = None);
    assert_eq!(w.decide().actions.len(), 2);
}

/// A repository's budget counts each of its jobs' expected shares before a machine is made
/// for it, with what the same pass gave its other jobs.
#[test]
fn a_repository_budget_counts_the_expected_cost_of_its_queued_jobs() {
    let mut w = World::new(vec![fleet("t4")]);
    w.budgets =
        crate::fleet::parse_budgets("s.toml", "[[budget]]\nrepository = \"acme/*\"\ndaily = 2.0\n", "github.com")
            .expect("parses");
    w.repo_spend.insert("github.com/acme/kernels".into(), 1.0);
    let of = |id: &str, repo: &str, since| QueuedJob {
        repository: Some(repo.into()),
        expected_run_s: Some(3600), // $0.50 each at $0.50/h
        ..job(id, since, "t4")
    };
    w.queued = vec![
        of("a", "github.com/acme/kernels", NOW),
        of("b", "github.com/acme/docs", NOW + 1),
        of("c", "github.com/acme/kernels", NOW + 2),
        of("d", "github.com/other/x", NOW + 3),
    ];
    let d = w.decide();
    assert_eq!(short(&d).len(), 3, "a, b (1 + 0.5 + 0.5 = 2) and d; not c");
    assert!(
        d.waiting["c"].starts_with(
            "repository github.com/acme/*: daily budget $2.00: $1.00 spent + $1.00 expected for 2 already given machines"
        ),
        "{}",
        d.waiting["c"]
    );
    assert!(d.waiting["d"].contains("new machine"), "{}", d.waiting["d"]);
}

/// A repository past its budget: its job makes no machine, takes none that exists, and says
/// why; another repository's job (and one with no repository) still gets one.
#[test]
fn a_repository_past_its_budget_gets_no_new_machine() {
    let mut w = World::new(vec![fleet("t4")]);
    w.budgets =
        crate::fleet::parse_budgets("s.toml", "[[budget]]\nrepository = \"acme/*\"\ndaily = 20.0\n", "github.com")
            .unwrap();
    w.repo_spend.insert("github.com/acme/kernels".into(), 12.5);
    w.repo_spend.insert("github.com/acme/docs".into(), 7.5);
    let of = |id: &str, repo: Option<&str>| QueuedJob { repository: repo.map(String::from), ..job(id, NOW, "t4") };
    w.queued =
        vec![of("over", Some("github.com/acme/kernels")), of("other", Some("github.com/beta/x")), of("none", None)];
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand", "create t4 #0 on-demand"], "{d:#?}");
    assert_eq!(
        d.waiting["over"],
        "repository github.com/acme/*: daily budget $20.00 reached ($20.00 spent); no machine is made for its jobs until 00:00 UTC"
    );
    assert_eq!(d.wake_at, Some(1_704_153_600), "midnight UTC");
    assert!(!d.waiting["other"].contains("budget"));

    // Under the budget: demand like any other job.
    w.repo_spend.insert("github.com/acme/docs".into(), 7.49);
    assert_eq!(w.decide().actions.len(), 3);

    // Over it, with an idle machine: the job is held off it (and nothing is made); the
    // machine is not kept for it either.
    w.repo_spend.insert("github.com/acme/docs".into(), 8.0);
    w.queued = vec![of("over", Some("github.com/acme/kernels"))];
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW - 3600)];
    let d = w.decide();
    assert_eq!(short(&d), ["delete m-1"], "idle past its timeout, no job waits for it");
    assert!(d.waiting["over"].contains("daily budget $20.00 reached"), "{}", d.waiting["over"]);
    let reached = crate::fleet::budget::all_reached(&w.budgets, &w.repo_spend);
    assert!(
        reached.iter().any(|b| b.covers("github.com/acme/kernels"))
            && !reached.iter().any(|b| b.covers("github.com/beta/x"))
    );
}

#[test]
fn unavailable_offers_are_skipped_then_on_demand() {
    let mut f = fleet("t4");
    f.capacity = CapacityPolicy::SpotThenOnDemand;
    let mut w = World::new(vec![f]);
    w.queued = vec![job("j1", NOW, "t4")];
    assert_eq!(short(&w.decide()), ["create t4 #0 spot"]);
    w.unavailable = vec![offer_unavailable_after_error("t4", 0, Capacity::Spot, NOW - 60)];
    assert_eq!(short(&w.decide()), ["create t4 #1 spot"], "next offer");
    w.unavailable.push(offer_unavailable_after_error("t4", 1, Capacity::Spot, NOW - 30));
    assert_eq!(short(&w.decide()), ["create t4 #0 on-demand"], "then on-demand");
    w.unavailable.push(offer_unavailable_after_error("t4", 0, Capacity::OnDemand, NOW));
    w.unavailable.push(offer_unavailable_after_error("t4", 1, Capacity::OnDemand, NOW));
    let d = w.decide();
    assert!(d.actions.is_empty());
    assert_eq!(d.waiting["j1"], "fleet t4: every offer had a capacity error; trying again in 9m00s");
    assert_eq!(d.wake_at, Some(NOW + 540));
    w.now = NOW + 541;
    assert_eq!(short(&w.decide()), ["create t4 #0 spot"], "the first spot offer is back");
}

/// Regression: offers a cluster refused (an admission policy, a RuntimeClass it lacks) made
/// the fleet and its waiting jobs say "every offer had a capacity error".
#[test]
fn refused_offers_are_said_as_refusals_in_the_providers_words() {
    let mut f = fleet("k8s");
    f.provider = ProviderKind::Kubernetes;
    f.offers.truncate(1);
    let mut w = World::new(vec![f]);
    w.queued = vec![job("j1", NOW, "k8s")];
    let api = r#"creating pod gpuci-m-1: pods "gpuci-m-1" is forbidden: violates PodSecurity "restricted:latest" (403 Forbidden)"#;
    w.unavailable =
        vec![offer_unavailable_after_error("k8s", 0, Capacity::OnDemand, NOW - 2).because(SkipCause::Refused, api)];
    let d = w.decide();
    assert!(d.actions.is_empty(), "{:?}", short(&d));
    let said = format!("fleet k8s: the cluster refused the pod: {api}; trying again in 9m58s");
    assert_eq!(d.waiting["j1"], said);
    assert_eq!(d.fleets[0].why, said);
    assert_eq!(d.wake_at, Some(NOW + 598));
    // An older capacity error of the same offer ends sooner: the refusal holds it and is said.
    w.unavailable.insert(0, offer_unavailable_after_error("k8s", 0, Capacity::OnDemand, NOW - 300));
    assert_eq!(w.decide().waiting["j1"], said);
}

#[test]
fn spot_breaker_opens_after_two_interruptions_in_15_minutes() {
    let mut f = fleet("t4");
    f.capacity = CapacityPolicy::SpotThenOnDemand;
    let spec = f.clone();
    assert_eq!(breaker_open_until(&spec, &[NOW - 1000, NOW - 100], NOW), None, "900 s apart is outside the window");
    assert_eq!(breaker_open_until(&spec, &[NOW - 899, NOW - 100], NOW), Some(NOW - 100 + 1800));
    assert_eq!(breaker_open_until(&spec, &[NOW - 2000, NOW - 1900], NOW), None, "closed after 30 minutes");
    let mut w = World::new(vec![f]);
    w.queued = vec![job("j1", NOW, "t4")];
    w.interruptions.insert("t4".into(), vec![NOW - 600, NOW - 60]);
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand"]);
    assert_eq!(d.fleets[0].breaker_open_until, Some(NOW - 60 + 1800));
    // A spot-only fleet waits instead.
    w.fleets[0].capacity = CapacityPolicy::Spot;
    let d = w.decide();
    assert!(d.actions.is_empty());
    assert!(d.waiting["j1"].starts_with("fleet t4: spot interrupted 2 times within 15m00s; the fleet uses spot only"));
    assert_eq!(d.wake_at, Some(NOW - 60 + 1800));
}

#[test]
fn warm_schedule_raises_the_pool_in_its_window() {
    let mut f = fleet("t4");
    f.warm = vec![WarmSchedule {
        days: Days::parse("mon-fri").expect("days"),
        from_min: 8 * 60,
        to_min: 19 * 60,
        timezone: jiff::tz::db().get("Europe/Berlin").expect("bundled tz"),
        min_idle: 2,
    }];
    let mut w = World::new(vec![f]);
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW - 3600)];
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #0 on-demand"], "11:00 Berlin on a Monday: two idle wanted, one there");
    assert!(matches!(&d.actions[0], Action::Create { reason, .. } if reason == "warm pool: 2 idle wanted, 1 spare"));
    // Saturday: the idle machine goes.
    w.now = NOW + 5 * 86_400;
    w.machines[0].since = w.now - 700;
    assert_eq!(short(&w.decide()), ["delete m-1"]);
}

#[test]
fn a_job_that_fits_two_fleets_goes_to_the_first_that_can_grow() {
    let mut a = fleet("a");
    a.max = 1;
    let mut w = World::new(vec![a, fleet("b")]);
    w.machines = vec![machine("m-1", "a", MachineState::Busy, NOW)];
    w.queued = vec![QueuedJob {
        id: "j1".into(),
        queued_since: NOW,
        gpus: 1,
        fleets: vec!["a".into(), "b".into()],
        repository: None,
        expected_run_s: None,
    }];
    assert_eq!(short(&w.decide()), ["create b #0 on-demand"]);
}

#[test]
fn the_same_input_gives_the_same_decision_whatever_the_order() {
    let mut w = World::new(vec![fleet("t4")]);
    w.machines = vec![
        machine("m-2", "t4", MachineState::Idle, NOW - 700),
        machine("m-1", "t4", MachineState::Idle, NOW - 700),
        machine("m-3", "t4", MachineState::Booting, NOW - 700),
    ];
    w.queued = vec![job("j2", NOW, "t4"), job("j1", NOW, "t4")];
    let a = w.decide();
    w.machines.reverse();
    w.queued.reverse();
    assert_eq!(a, w.decide());
    assert_eq!(a.waiting["j1"], "machine m-1 of fleet t4 has free GPUs; waiting for the scheduler");
}

#[test]
fn fits_uses_placement_against_the_machine_spec() {
    let spec = fleet("t4");
    let tags = BTreeMap::new();
    let gpu =
        |count, model: Option<&str>| GpuRequirements { count, model: model.map(String::from), ..Default::default() };
    let needs = |g: &GpuRequirements| fits(&spec, &Needs { tags: &tags, gpu: g, container: true, deadline: None });
    assert!(needs(&gpu(1, Some("T4"))));
    assert!(!needs(&gpu(2, None)), "one GPU per machine");
    assert!(!needs(&gpu(1, Some("A100*"))));
    let cc = GpuRequirements {
        count: 1,
        compute_capability: Some(crate::gpu::Constraint {
            op: crate::gpu::CmpOp::Ge,
            value: crate::gpu::ComputeCapability { major: 8, minor: 0 },
        }),
        ..Default::default()
    };
    assert!(!needs(&cc), "T4 is 7.5");
    let mut unknown_cc = spec.clone();
    unknown_cc.machine.compute_capability = None;
    assert!(
        fits(&unknown_cc, &Needs { tags: &tags, gpu: &cc, container: true, deadline: None }),
        "unknown is assumed to fit"
    );
    let mut want_tag = BTreeMap::new();
    want_tag.insert("cloud".to_string(), "aws".to_string());
    assert!(!fits(&spec, &Needs { tags: &want_tag, gpu: &gpu(1, None), container: false, deadline: None }));
}

/// A fleet whose machines live `time_limit` (Slurm allocations) is demand only for jobs whose
/// timeout fits in it, less the minute an agent takes to start: otherwise it would make an
/// allocation that takes nothing, delete it when idle, and make another.
#[test]
fn a_job_longer_than_the_fleets_time_limit_is_not_its_demand() {
    let mut spec = fleet("t4");
    spec.machine.time_limit_s = Some(3600);
    let tags = BTreeMap::new();
    let gpu = GpuRequirements { count: 1, ..Default::default() };
    let runs = |spec: &FleetSpec, ms: Option<u64>| {
        let deadline = ms.map(|runs_for_ms| crate::placement::Deadline { now_ms: 1_700_000_000_000, runs_for_ms });
        fits(spec, &Needs { tags: &tags, gpu: &gpu, container: true, deadline })
    };
    assert!(runs(&spec, Some(30 * 60_000)));
    assert!(runs(&spec, Some(59 * 60_000)), "59m fits in 1h less the agent's start");
    assert!(!runs(&spec, Some(59 * 60_000 + 1)));
    assert!(!runs(&spec, Some(2 * 3_600_000)));
    assert!(runs(&spec, None), "a job without a timeout may start anywhere");
    spec.machine.time_limit_s = None;
    assert!(runs(&spec, Some(100 * 3_600_000)));
}

/// A fleet on the defaults: idle and stopped times from cost, the stopped tier.
fn stopping(name: &str) -> FleetSpec {
    let mut f = fleet(name);
    f.idle_timeout_s = None;
    f.idle_action = IdleAction::Stop;
    f.stopped_price_per_hour = 0.011;
    f
}

/// Regression (issue 28): a stopped machine whose start was refused for want of capacity was
/// started again every pass while the outage lasted (341,015 refused starts in the two-week
/// simulation) and no machine was made on another offer.
#[test]
fn regression_a_refused_restart_holds_the_stopped_machine_and_the_fleet_creates_elsewhere() {
    let mut w = World::new(vec![stopping("t4")]);
    w.machines = vec![machine("m-1", "t4", MachineState::Stopped, NOW - 300)];
    w.queued = vec![job("j1", NOW - 10, "t4")];
    assert_eq!(short(&w.decide()), ["start m-1"]);
    // The start was refused: the coordinator and the simulator mark the offer as after a
    // failed create.
    w.unavailable = vec![offer_unavailable_after_error("t4", 0, Capacity::OnDemand, NOW - 5)];
    let d = w.decide();
    assert_eq!(short(&d), ["create t4 #1 on-demand"], "the next offer, not the same stopped machine");
    let Action::Create { reason, .. } = &d.actions[0] else { unreachable!() };
    assert!(reason.contains("stopped machine m-1 is not started"), "{reason}");
    // Every offer skipped: nothing is asked, and the fleet looks again when the skip ends.
    w.unavailable.push(offer_unavailable_after_error("t4", 1, Capacity::OnDemand, NOW - 5));
    let d = w.decide();
    assert!(short(&d).is_empty(), "{:?}", short(&d));
    assert_eq!(d.wake_at, Some(NOW - 5 + CAPACITY_ERROR_BACKOFF_S));
}

/// Idle time from cost: with no recent arrival an idle machine is let go early (half of what
/// a stop and restart bills, in seconds of its price: stop 30 s + start 45 s = 75 s → 38 s;
/// the 45 s a job then waits for the start is within one boot, the wait the fleet promises,
/// and is not priced); with arrivals sooner than that, late (150 s).
#[test]
fn idle_time_comes_from_cost_and_the_fleets_arrivals() {
    let mut w = World::new(vec![stopping("t4")]);
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW - 38)];
    let d = w.decide();
    assert_eq!(short(&d), ["stop m-1"]);
    assert!(
        d.fleets[0].rules[0].starts_with("idle → stop after 38 s (rent or buy: no job in the last hour"),
        "{}",
        d.fleets[0].rules[0]
    );
    assert!(d.fleets[0].rules[0].ends_with("stop 30 s + start 45 s; a start's wait is within one boot)"));
    w.machines[0].since = NOW - 37;
    let d = w.decide();
    assert!(short(&d).is_empty());
    assert_eq!(d.wake_at, Some(NOW + 1));

    // 120 jobs in the last hour, one machine idle: one every 30 s, sooner than 75 s.
    let arrivals: Vec<UnixSecs> = (0..120).map(|k| NOW - 3600 + 30 * k).collect();
    w.history.insert("t4".into(), FleetHistory { arrivals, ..FleetHistory::default() });
    w.machines[0].since = NOW - 149;
    assert!(short(&w.decide()).is_empty(), "kept up to 2 × 75 s");
    w.machines[0].since = NOW - 150;
    let d = w.decide();
    assert_eq!(short(&d), ["stop m-1"]);
    assert!(d.fleets[0].rules[0].contains("sooner than a stop pays back in 75 s"), "{}", d.fleets[0].rules[0]);

    // A fleet that deletes: a boot and the boot a job waits, 2 × 120 s, halved with no arrival.
    let mut f = fleet("t4");
    f.idle_timeout_s = None;
    let mut w = World::new(vec![f]);
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW - 120)];
    assert_eq!(short(&w.decide()), ["delete m-1"]);
    w.machines[0].since = NOW - 119;
    assert!(short(&w.decide()).is_empty());

    // The operator's idle_timeout overrides the rule.
    let mut f = stopping("t4");
    f.idle_timeout_s = Some(600);
    let mut w = World::new(vec![f]);
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW - 300)];
    let d = w.decide();
    assert!(short(&d).is_empty());
    assert_eq!(d.fleets[0].rules[0], "idle → stop after 10m00s (idle_timeout)");
}

/// A stopped machine's disk bills while it waits; it is deleted once that has cost what a
/// restart saves over a fresh boot: (boot 120 s − start 45 s) × 2 (billed and waited) at
/// $0.50/h = $0.0208, over $0.011/h of disk = 6,818 s; halved with no recent arrival.
#[test]
fn stopped_machines_are_deleted_when_their_disk_costs_more_than_a_boot_saves() {
    let mut w = World::new(vec![stopping("t4")]);
    w.machines = vec![
        machine("m-1", "t4", MachineState::Stopped, NOW - 3409),
        machine("m-2", "t4", MachineState::Stopped, NOW - 3000),
    ];
    let d = w.decide();
    assert_eq!(short(&d), ["delete m-1"]);
    assert_eq!(d.wake_at, Some(NOW + 409));
    let Action::Delete { reason, .. } = &d.actions[0] else { unreachable!() };
    assert!(reason.starts_with("stopped 56m49s: stopped → delete after 56m49s (rent or buy"), "{reason}");

    // One that is started this pass is not deleted, however long it was stopped.
    w.queued = vec![job("j1", NOW, "t4")];
    w.machines[0].since = NOW - 100_000;
    w.machines[1].since = NOW - 100_001;
    assert_eq!(short(&w.decide()), ["start m-1", "delete m-2"]);

    // A stopped machine that costs nothing (a local machine) is kept.
    let mut f = stopping("t4");
    f.stopped_price_per_hour = 0.0;
    let mut w = World::new(vec![f]);
    w.machines = vec![machine("m-1", "t4", MachineState::Stopped, NOW - 30 * 86_400)];
    let d = w.decide();
    assert!(short(&d).is_empty());
    assert!(d.fleets[0].rules.iter().any(|r| r.contains("costs nothing")));
}

/// Fan-out demand and warm capacity learned from history (issue 28).
mod learned;

/// Idle machines through capacity outages of the fleet's offers (issue 28).
mod outage;

/// The idle hold learned from the fleet's idle spells (issue 28).
mod spells;
