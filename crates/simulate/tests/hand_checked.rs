//! A trace small enough to check by hand, asserted exactly.

use gpuci_simulate::{run_cli, CliOptions, Policy};

const CONFIG: &str = r#"
[[fleet]]
name = "t4"
provider = "exec"
max = 2
idle_timeout = "5m"
[fleet.machine]
gpu_model = "NVIDIA T4"
gpus = 1
gpu_memory = "16GiB"
cpus = 4
memory = "16GiB"
[[fleet.offer]]
instance_type = "t4-box"
price_per_hour = 3.6
[fleet.simulate]
boot = "fixed 60s"
start = "fixed 60s"
# $0.036/h, 1 % of the machine's price: a stopped second costs 0.01 GPU-second.
disk_gb = 73
disk_price_per_gb_month = 0.36
# No outage by chance: the figures below are worked out by hand.
capacity_outages_per_day = 0
spot_capacity_outages_per_day = 0
"#;

// Three 1-GPU jobs, fixed 60 s boot, no randomness (on-demand, no capacity errors):
//
//   a: submit   0, runs 100 s
//   b: submit  10, runs 200 s, group g, cancelled at 400 by c (it ended at 270: no effect)
//   c: submit 400, runs  50 s, group g, cancel_in_progress
//
// gpuci (min_idle 0, idle_timeout 5m = 300 s, max 2):
//   t=0    a queued → create m1 (ready at 60)            a starts at 60, waits 60, ends 160
//   t=10   b queued, m1 is booting but taken by a → create m2 (ready 70); b starts 70, waits 60,
//          ends 270
//   t=160  m1 idle; t=270 m2 idle
//   t=400  c queued → m1 (idle since 160, 240 s < 300) takes it at once: waits 0, ends 450
//   t=450  m1 idle again; m2 idle since 270 → deleted at 570; m1 deleted at 750 — but the run
//          ends with the last job at 450, and machines are billed to then.
//   paid: m1 0..450 = 450 s, m2 10..450 = 440 s → 890 GPU-s = 0.247222… GPU-h; cost at
//   $3.60/h = $0.89. Waits: 60, 60, 0 → p50 60, p95 60, p99 60.
//   disk: the machines exist 890 s at $0.036/h = $0.0089, none of it stopped.
//   lower bound: 100 + 200 + 50 = 350 GPU-s (b ran fully before c's submit).
//   unavoidable: levels of the ideal schedule (a 0–100, b 10–210, c 400–450):
//     level 1 busy 0–210 (a then b overlapping: m = 2 during 10–100), level 2 busy 10–100;
//     level 1: one boot (60) + gap 210→400 = 190 → min(idle 190, reboot 60, stop 30 + start
//     60 + disk 1.9) = 60; level 2: one boot (60). = 180 GPU-s.
//   packing waste: 0 (1-GPU jobs on 1-GPU machines). Floor 530, goal 1.10 × 530 = 583.
//
// always-on: peak 2 machines from 0 to 450 = 900 GPU-s, waits 0, 0, 0.
//
// fixed-idle-5m is gpuci with these settings already (no warm pool, 5 m idle): same figures.
const TRACE: &str = "job_id,submit_s,duration_s,pool,gpus,group,cancel_in_progress\n\
a,0,100,t4,1,,0\n\
b,10,200,t4,1,g,0\n\
c,400,50,t4,1,g,1\n";

#[test]
fn three_jobs_by_hand() {
    let report = run_cli(CONFIG, "server.toml", TRACE, "trace.csv", &CliOptions::default()).expect("runs");
    assert_eq!(report.jobs, 3);
    assert_eq!(report.runs.len(), 5);
    let gpuci = &report.runs[0];
    assert_eq!(gpuci.policy, Policy::Gpuci);
    let t = &gpuci.total;
    assert_eq!(gpuci.horizon_s, 450);
    assert!((t.paid_gpu_hours * 3600.0 - 890.0).abs() < 1e-6, "{}", t.paid_gpu_hours * 3600.0);
    assert!((t.cost_usd - 0.89).abs() < 1e-9, "{}", t.cost_usd);
    assert!((t.lower_bound_gpu_hours * 3600.0 - 350.0).abs() < 1e-6);
    assert!((t.unavoidable_gpu_hours * 3600.0 - 180.0).abs() < 1e-6);
    assert_eq!(t.packing_waste_gpu_hours, 0.0);
    assert!((t.floor_gpu_hours * 3600.0 - 530.0).abs() < 1e-6);
    assert!((t.target_gpu_hours * 3600.0 - 583.0).abs() < 1e-6);
    assert!((t.disk_usd - 0.0089).abs() < 1e-12, "{}", t.disk_usd);
    assert!((t.total_usd - 0.8989).abs() < 1e-12, "{}", t.total_usd);
    assert_eq!((t.stopped_disk_usd, t.stopped_disk_gpu_hours, t.charged_gpu_hours), (0.0, 0.0, t.paid_gpu_hours));
    assert!((t.ran_gpu_hours * 3600.0 - 350.0).abs() < 1e-6);
    assert_eq!((t.wait_p50_s, t.wait_p95_s, t.wait_p99_s), (60, 60, 60));
    assert_eq!((t.machines_launched, t.boots, t.cancelled, t.interruptions), (2, 2, 0, 0));
    // 890 ≤ 1.10 × 530 = 583? No: the goal is missed here, because the run is so short that
    // idle time dominates. The figures say so rather than hide it.
    assert!(!t.cost_goal_met);
    assert!(t.wait_goal_met, "p95 60 s ≤ boot 60 s");

    let always = &report.runs[1];
    assert_eq!(always.policy, Policy::AlwaysOn);
    assert!((always.total.paid_gpu_hours * 3600.0 - 900.0).abs() < 1e-6);
    assert_eq!((always.total.wait_p95_s, always.total.machines_launched), (0, 2));

    let fixed = &report.runs[2];
    assert_eq!(fixed.policy, Policy::FixedIdle5m);
    assert!((fixed.total.paid_gpu_hours - t.paid_gpu_hours).abs() < 1e-9);
}

#[test]
fn a_newer_push_cancels_the_running_job() {
    // b runs 200 s from 70; c at 100 cancels it at 100 (30 s run). Ideal: b runs 10→100 = 90 s.
    let trace = TRACE.replace("c,400,50", "c,100,50");
    let report = run_cli(CONFIG, "server.toml", &trace, "trace.csv", &CliOptions::default()).expect("runs");
    let t = &report.runs[0].total;
    assert_eq!(t.cancelled, 1);
    assert!((t.lower_bound_gpu_hours * 3600.0 - (100.0 + 90.0 + 50.0)).abs() < 1e-6);
    assert!((t.ran_gpu_hours * 3600.0 - (100.0 + 30.0 + 50.0)).abs() < 1e-6);
}

#[test]
fn errors_name_the_file_and_place() {
    let e = run_cli(
        CONFIG,
        "server.toml",
        "job_id,submit_s,duration_s,pool,gpus\na,0,1,v100,1\n",
        "trace.csv",
        &CliOptions::default(),
    )
    .unwrap_err();
    assert_eq!(e, "trace.csv: job a: pool: no fleet named \"v100\" in server.toml (fleets: t4)");
    let e = run_cli(
        CONFIG,
        "server.toml",
        "job_id,submit_s,duration_s,pool,gpus\na,0,1,t4,2\n",
        "trace.csv",
        &CliOptions::default(),
    )
    .unwrap_err();
    assert_eq!(e, "trace.csv: job a: gpus: 2 is more than a t4 machine has");
    let e = run_cli(&CONFIG.replace("max = 2", "max = 0"), "server.toml", TRACE, "trace.csv", &CliOptions::default())
        .unwrap_err();
    assert_eq!(e, "server.toml:5:1: fleet[0] (t4): max: must be at least 1");
}

#[test]
fn same_seed_same_report() {
    let config = CONFIG.replace("boot = \"fixed 60s\"", "boot = \"lognormal 90s 0.5\"");
    let trace = gpuci_simulate::trace::to_csv(&gpuci_simulate::gen::generate(5, 1, 2_000))
        .replace(",a100,", ",t4,")
        .replace(",h100x2,2,", ",t4,1,");
    let opts = CliOptions { seed: 7, ..CliOptions::default() };
    let config = config.replace("max = 2", "max = 40");
    let a = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let b = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    assert_eq!(a, b);
    assert!(a.runs[0].total.jobs > 1_000);
    let json = serde_json::to_value(&a).expect("serializes");
    assert_eq!(json["runs"][0]["policy"], "gpuci");
    assert_eq!(json["runs"][3]["policy"], "best-fixed-idle");
    assert!(json["runs"][0]["total"]["packing_waste_gpu_hours"].is_number());
    assert!(a.to_string().contains("policy fixed-idle-5m"));
    // The sweep holds 5 minutes, so the hindsight best is never worse than fixed-idle-5m
    // where that meets the wait goal.
    assert_eq!(a.sweep.len(), gpuci_simulate::IDLE_GRID_S.len());
    let (fixed, best) = (&a.runs[2], &a.runs[3]);
    for (f, b) in fixed.fleets.iter().zip(&best.fleets) {
        if f.wait_goal_met {
            assert!(b.wait_goal_met && b.total_usd <= f.total_usd + 1e-9, "{f:?} {b:?}");
        }
    }
}

/// A fleet that stops idle machines after a minute instead of deleting them; fixed times, the
/// disk at 1 % of the machine's price ($0.036/h against $3.60/h, and the policy is told so), no
/// outage by chance.
const STOP_CONFIG: &str = r#"
[[fleet]]
name = "t4"
provider = "exec"
max = 2
idle_timeout = "1m"
idle_action = "stop"
stopped_price_per_hour = 0.036
[fleet.machine]
gpu_model = "NVIDIA T4"
gpus = 1
gpu_memory = "16GiB"
cpus = 4
memory = "16GiB"
[[fleet.offer]]
instance_type = "t4-box"
price_per_hour = 3.6
[fleet.simulate]
boot = "fixed 60s"
start = "fixed 60s"
stop = "fixed 30s"
disk_gb = 73
disk_price_per_gb_month = 0.36
capacity_outages_per_day = 0
spot_capacity_outages_per_day = 0
"#;

const HEADER: &str = "job_id,submit_s,duration_s,pool,gpus\n";

fn secs(hours: f64) -> f64 {
    hours * 3600.0
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn run(report: &gpuci_simulate::Report, policy: Policy) -> &gpuci_simulate::PolicyRun {
    report.runs.iter().find(|r| r.policy == policy).expect("policy ran")
}

// a: submit 0, runs 100 s; b: submit 1000, runs 100 s. gpuci with stop after 1 minute idle:
//   t=0    create m1 (billed from 0); ready 60; a runs 60–160 (wait 60)
//   t=220  idle 60 s → stop; stopped at 250 (billed until then): 250 GPU-s
//   t=1000 b → start m1 (billed from 1000); ready 1060; b runs 1060–1160 (wait 60): 160 GPU-s
//   paid 410 GPU-s = $0.41. Disk: m1 exists 0–1160 = 1160 s × $0.036/h = $0.0116, of which
//   stopped 250–1000 = 750 s = $0.0075 — in GPU-seconds at $3.60/h: 7.5. Charged 417.5 GPU-s.
// fixed-idle-5m deletes instead: m1 0–460, m2 1000–1160 = 620 GPU-s, disk 620 s = $0.0062,
// nothing stopped.
// Floor: 200 + one boot (60) + the 900 s gap's cheapest: min(idle 900, reboot 60, stop 30 +
// start 60 + disk 9) = 60 → 320 GPU-s.
#[test]
fn stopped_machines_bill_their_disk() {
    let trace = format!("{HEADER}a,0,100,t4,1\nb,1000,100,t4,1\n");
    let report = run_cli(STOP_CONFIG, "server.toml", &trace, "trace.csv", &CliOptions::default()).expect("runs");
    let t = &run(&report, Policy::Gpuci).total;
    assert!(close(secs(t.paid_gpu_hours), 410.0), "{}", secs(t.paid_gpu_hours));
    assert!(close(t.cost_usd, 0.41), "{}", t.cost_usd);
    assert!(close(t.disk_usd, 0.0116), "{}", t.disk_usd);
    assert!(close(t.stopped_disk_usd, 0.0075), "{}", t.stopped_disk_usd);
    assert!(close(secs(t.stopped_machine_hours), 750.0));
    assert!(close(secs(t.stopped_disk_gpu_hours), 7.5), "{}", secs(t.stopped_disk_gpu_hours));
    assert!(close(secs(t.charged_gpu_hours), 417.5));
    assert!(close(t.total_usd, 0.41 + 0.0116));
    assert!(close(secs(t.floor_gpu_hours), 320.0), "{}", secs(t.floor_gpu_hours));
    assert!(close(t.floor_ratio, 417.5 / 320.0));
    assert_eq!((t.machines_launched, t.boots, t.starts, t.wait_p95_s), (1, 2, 1, 60));

    let d = &run(&report, Policy::FixedIdle5m).total;
    assert!(close(secs(d.paid_gpu_hours), 620.0), "{}", secs(d.paid_gpu_hours));
    assert!(close(d.disk_usd, 0.0062) && d.stopped_disk_usd == 0.0 && d.stopped_machine_hours == 0.0);
    assert!(report.to_string().contains("+disk"));
}

// The stop config again, and the offer has no capacity from 900 to 1100 s.
//   gpuci: a as above; m1 stopped at 250.
//   t=1000 b → start m1: refused. The offer is skipped as after a failed create, and the
//          stopped machine with it: it is not started again every pass (issue 28: 341,015
//          refused starts on the two weeks), but by its back-off (15 s, doubling): refused
//          again at 1015 and 1045, started at 1105 (the outage ended at 1100): ready 1165, b
//          runs 1165–1265 (waits 165). Before the back-off the skip was a fixed 10 minutes: b
//          waited 660 s.
//   t=1110 c: m1 is taken by b → create m2, ready 1170, c runs 1170–1270 (waits 60).
//   paid 250 + (1105–1270) 165 + (1110–1270) 160 = 575 GPU-s; stopped 250–1105 = 855 s =
//   $0.00855.
//   fixed-idle-5m: m1 deleted at 460; b at 1000 → creates refused at 1000, 1015, 1045; made at
//   1105 (b waits 165); c at 1110 gets its own (waits 60).
// With a second offer (no outage), gpuci creates there one reconcile interval after the
// refusal: m2 at 1005 (ready 1065, b waits 65), m3 at 1110 for c (ready 1170, waits 60).
#[test]
fn regression_a_refused_restart_is_not_retried_every_pass_and_the_fleet_creates_elsewhere() {
    let outage = "[[fleet.simulate.offer]]\ninstance_type = \"t4-box\"\noutages = [[900, 1100]]\n";
    let config = format!("{STOP_CONFIG}{outage}");
    let trace = format!("{HEADER}a,0,100,t4,1\nb,1000,100,t4,1\nc,1110,100,t4,1\n");
    let report = run_cli(&config, "server.toml", &trace, "trace.csv", &CliOptions::default()).expect("runs");
    let t = &run(&report, Policy::Gpuci).total;
    assert_eq!((t.start_capacity_errors, t.capacity_errors, t.starts, t.machines_launched), (3, 0, 1, 2));
    assert_eq!((t.wait_p50_s, t.wait_p95_s), (60, 165));
    assert!(close(secs(t.paid_gpu_hours), 575.0), "{}", secs(t.paid_gpu_hours));
    assert!(close(t.stopped_disk_usd, 0.00855), "{}", t.stopped_disk_usd);

    let d = &run(&report, Policy::FixedIdle5m).total;
    assert_eq!((d.capacity_errors, d.start_capacity_errors, d.machines_launched), (3, 0, 3));
    assert_eq!((d.wait_p50_s, d.wait_p95_s), (60, 165));
    assert!(close(secs(d.paid_gpu_hours), 460.0 + 165.0 + 160.0), "{}", secs(d.paid_gpu_hours));
    assert!(report.to_string().contains("caperr c/s"));

    let two_offers = STOP_CONFIG.replace(
        "[fleet.simulate]",
        "[[fleet.offer]]\ninstance_type = \"t4-box\"\nzone = \"b\"\nprice_per_hour = 3.6\n[fleet.simulate]",
    );
    let config = format!(
        "{two_offers}[[fleet.simulate.offer]]\ninstance_type = \"t4-box\"\nzone = \"\"\noutages = [[900, 1100]]\n"
    );
    let report = run_cli(&config, "server.toml", &trace, "trace.csv", &CliOptions::default()).expect("runs");
    let t = &run(&report, Policy::Gpuci).total;
    // m1's offer is asked again 15 s after its refusal, so c (1110, after the outage) starts
    // m1 (ready 1170, waits 60) instead of a third machine being made.
    assert_eq!((t.start_capacity_errors, t.capacity_errors, t.starts, t.machines_launched), (1, 0, 1, 2));
    assert_eq!((t.wait_p50_s, t.wait_p95_s), (60, 65));
}

// max = 1; a (0, 100 s) and b (10, 200 s) overlap, so the trace's peak is 2 machines.
// Always-on keeps max = 1: b waits for a's machine: runs 100–300 (wait 90); 300 GPU-s.
#[test]
fn always_on_respects_max() {
    let config = CONFIG.replace("max = 2", "max = 1");
    let trace = format!("{HEADER}a,0,100,t4,1\nb,10,200,t4,1\n");
    let opts = CliOptions { policies: vec![Policy::AlwaysOn], ..CliOptions::default() };
    let report = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let t = &report.runs[0].total;
    assert_eq!((t.machines_launched, t.wait_p50_s, t.wait_p95_s), (1, 0, 90));
    assert!(close(secs(t.paid_gpu_hours), 300.0), "{}", secs(t.paid_gpu_hours));
    // With max = 2 it has both.
    let report = run_cli(CONFIG, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    assert_eq!((report.runs[0].total.machines_launched, report.runs[0].total.wait_p95_s), (2, 0));
}

// 4-GPU machines, $4/h ($1 a GPU-hour), boot and start 60 s, stop 30 s, disk free.
//   a, b: submit 0, 100 s, 1 GPU each; c: submit 1000, 50 s, 4 GPUs.
//   lower bound: 100 + 100 + 4 × 50 = 400 GPU-s.
//   packing waste: a and b need one machine, two of its GPUs idle for 100 s = 200; c fills one.
//   unavoidable boots: one level, busy 0–100 and 1000–1050: a boot (60), and for the 900 s
//   gap min(idle 900, reboot 60, stop + start 90) = 60 → 120 s × 4 GPUs = 480.
//   floor 1080 GPU-s, goal 1.10 × 1080 = 1188.
//   gpuci (delete after 5 m): a and b packed on one machine, 0–460 (1840 GPU-s); c on a new
//   one 1000–1110 (440): 2280 GPU-s, 2.11 × the floor.
#[test]
fn the_floor_separates_the_bound_boots_and_packing_waste() {
    let config = CONFIG
        .replace("gpus = 1", "gpus = 4")
        .replace("price_per_hour = 3.6", "price_per_hour = 4.0")
        .replace("disk_price_per_gb_month = 0.36", "disk_price_per_gb_month = 0");
    let trace = format!("{HEADER}a,0,100,t4,1\nb,0,100,t4,1\nc,1000,50,t4,4\n");
    let opts = CliOptions { policies: vec![Policy::Gpuci], ..CliOptions::default() };
    let report = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let t = &report.runs[0].total;
    assert!(close(secs(t.lower_bound_gpu_hours), 400.0));
    assert!(close(secs(t.packing_waste_gpu_hours), 200.0), "{}", secs(t.packing_waste_gpu_hours));
    assert!(close(secs(t.unavoidable_gpu_hours), 480.0), "{}", secs(t.unavoidable_gpu_hours));
    assert!(close(secs(t.floor_gpu_hours), 1080.0));
    assert!(close(secs(t.target_gpu_hours), 1188.0));
    assert!(close(secs(t.paid_gpu_hours), 2280.0), "{}", secs(t.paid_gpu_hours));
    assert!(close(t.floor_ratio, 2280.0 / 1080.0));
    assert!(!t.cost_goal_met);
    let table = report.to_string();
    assert!(table.contains("+packing") && table.contains("xfloor"), "{table}");
}

// a: 0, 100 s; b: 200, 100 s; boot 60 s. Swept idle timeouts:
//   0s:  m1 deleted at 160; b gets a new machine 200–360 (wait 60): 160 + 160 = 320 GPU-s
//   1m:  m1 idle 160–200 takes b at once: 0–300 = 300 GPU-s, waits 60 and 0
//   2m, 10m: the same 300 (the run ends at 300)
// Each meets the wait goal (p95 60 ≤ boot 60); the cheapest is 1m (the first of the ties).
#[test]
fn best_fixed_idle_is_the_cheapest_timeout_that_meets_the_wait_goal() {
    let trace = format!("{HEADER}a,0,100,t4,1\nb,200,100,t4,1\n");
    let opts = CliOptions {
        policies: vec![Policy::BestFixedIdle],
        idle_grid_s: vec![600, 0, 60, 120],
        ..CliOptions::default()
    };
    let report = run_cli(CONFIG, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let best = &report.runs[0];
    assert_eq!(best.policy, Policy::BestFixedIdle);
    assert_eq!(best.fleets[0].idle_timeout_s, Some(60));
    assert!(close(secs(best.total.paid_gpu_hours), 300.0), "{}", secs(best.total.paid_gpu_hours));
    assert!(close(best.total.total_usd, 0.30 + 0.003));
    let grid: Vec<u64> = report.sweep.iter().map(|p| p.idle_timeout_s).collect();
    assert_eq!(grid, [0, 60, 120, 600]);
    let paid: Vec<f64> =
        report.sweep.iter().map(|p| (secs(p.fleets[0].charged_gpu_hours) * 1e6).round() / 1e6).collect();
    assert_eq!(paid, [320.0, 300.0, 300.0, 300.0]);
    let chosen: Vec<bool> = report.sweep.iter().map(|p| p.fleets[0].chosen).collect();
    assert_eq!(chosen, [false, true, false, false]);
    assert!(report.to_string().contains("policy best-fixed-idle (idle timeout t4 1m;"), "{report}");

    // gpuci (5m idle here) is held against the cheapest swept timeout that waits no longer:
    // every point has p95 60 s, the cheapest is 1m, and gpuci pays the same.
    let opts = CliOptions { policies: vec![Policy::Gpuci, Policy::BestFixedIdle], ..opts.clone() };
    let report = run_cli(CONFIG, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let m = report.runs[0].fleets[0].fixed_idle_at_same_wait.clone().expect("a match");
    assert_eq!((m.idle_timeout_s, m.wait_p95_s), (60, 60));
    assert!(close(m.total_usd, report.runs[0].fleets[0].total_usd));
    assert_eq!(report.runs[1].fleets[0].fixed_idle_at_same_wait, None);
    assert!(report.to_string().contains("against the best-fixed-idle sweep at equal or better p95 wait"));

    // None meets the wait goal (max 1: b waits 150 s behind a, whatever the timeout): the
    // lowest p95 wins, then the cheapest, then the shortest timeout.
    let config = CONFIG.replace("max = 2", "max = 1");
    let trace = format!("{HEADER}a,0,100,t4,1\nb,10,100,t4,1\n");
    let opts = CliOptions { policies: vec![Policy::BestFixedIdle], idle_grid_s: vec![0, 60], ..opts };
    let report = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let best = &report.runs[0];
    assert_eq!((best.fleets[0].idle_timeout_s, best.total.wait_p95_s, best.total.wait_goal_met), (Some(0), 150, false));
}

// best-fixed-stop on a fleet that stops (start 20 s, stop 30 s), a at 0 (100 s), b at 1000:
// idle 0 + stopped 15m (the first pair of the grid; every pair with idle 0 costs the same):
//   m1 created at 0, ready 60, a runs 60–160, stopped at once: billed 0–190 (the stop bills);
//   stopped 190–1000 (its delete would come at 1090); b starts it at 1000: billed 1000–1120,
//   ready 1020, b runs to 1120, the end. Paid 310 GPU-s = $0.31; disk 0–1120 at $0.036/h =
//   $0.0112; stopped 810 s of it = 8.1 GPU-s. Waits 60 (the boot) and 20 (the start).
// Longer idle timeouts pay their idle seconds too. On the fleet that cannot stop (CONFIG),
// the same pairs delete after the idle timeout: b boots (paid 160 + 160 = 320 GPU-s).
#[test]
fn best_fixed_stop_is_the_cheapest_pair_of_timeouts_that_meets_the_wait_goal() {
    let config = CONFIG
        .replace("[fleet.machine]", "[fleet.settings]\nstop = true\n[fleet.machine]")
        .replace("start = \"fixed 60s\"", "start = \"fixed 20s\"");
    let trace = format!("{HEADER}a,0,100,t4,1\nb,1000,100,t4,1\n");
    let opts = CliOptions { policies: vec![Policy::BestFixedStop], ..CliOptions::default() };
    let report = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let best = &report.runs[0];
    assert_eq!(best.policy, Policy::BestFixedStop);
    let t = &best.fleets[0];
    assert_eq!((t.idle_timeout_s, t.stopped_timeout_s), (Some(0), Some(900)));
    assert_eq!((t.machines_launched, t.starts, t.wait_p50_s, t.wait_p95_s), (1, 1, 20, 60));
    assert!(close(secs(t.paid_gpu_hours), 310.0), "{}", secs(t.paid_gpu_hours));
    assert!((secs(t.stopped_disk_gpu_hours) - 8.1).abs() < 1e-9, "{}", secs(t.stopped_disk_gpu_hours));
    assert!((t.total_usd - 0.3212).abs() < 1e-9, "{}", t.total_usd);
    assert_eq!(report.stop_sweep.len(), gpuci_simulate::stop_grid().len());
    let chosen: Vec<(u64, Option<u64>)> = report
        .stop_sweep
        .iter()
        .filter(|p| p.fleets[0].chosen)
        .map(|p| (p.idle_timeout_s, p.stopped_timeout_s))
        .collect();
    assert_eq!(chosen, [(0, Some(900))]);
    let text = report.to_string();
    assert!(text.contains("policy best-fixed-stop (idle timeout t4 0s + stopped 15m;"), "{text}");
    assert!(text.contains("best-fixed-stop sweep (stop after idle, delete after stopped"), "{text}");

    // The fleet that cannot stop deletes after the idle timeout: b boots.
    let report = run_cli(CONFIG, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let t = &report.runs[0].fleets[0];
    assert_eq!((t.idle_timeout_s, t.stopped_timeout_s, t.starts, t.machines_launched), (Some(0), None, 0, 2));
    assert!(close(secs(t.paid_gpu_hours), 320.0), "{}", secs(t.paid_gpu_hours));
}

// Two spot fleets on one config: `fast` has an offer whose own rate (1 an hour) overrides the
// fleet's (0); `slow` keeps the fleet's 0. Each fleet gets one 1-hour job an hour for 200
// hours. Interruptions are drawn per machine-hour from the offer's rate: `fast` sees about one
// per spot hour it pays, `slow` none; one seed gives one result.
#[test]
fn spot_interruptions_come_from_each_offers_rate_and_the_seed() {
    let fleet = |name: &str, offer: &str| {
        format!(
            r#"
[[fleet]]
name = "{name}"
provider = "aws"
capacity = "spot"
max = 50
idle_timeout = "5m"
[fleet.spot_breaker]
interruptions = 100000
window = "1m"
on_demand_for = "1m"
[fleet.machine]
gpu_model = "NVIDIA T4"
gpus = 1
gpu_memory = "16GiB"
cpus = 4
memory = "16GiB"
[[fleet.offer]]
instance_type = "{offer}"
zone = "us-east-1a"
price_per_hour = 1.0
spot_price_per_hour = 0.3
[fleet.simulate]
boot = "fixed 60s"
spot_interruptions_per_hour = 0
spot_capacity_outages_per_day = 0
"#
        )
    };
    let config = format!(
        "{}[[fleet.simulate.offer]]\ninstance_type = \"g4dn.xlarge\"\nspot_interruptions_per_hour = 1.0\n{}",
        fleet("fast", "g4dn.xlarge"),
        fleet("slow", "g5.xlarge")
    );
    let mut trace = String::from(HEADER);
    for i in 0..200u64 {
        trace.push_str(&format!("f{i},{},3600,fast,1\ns{i},{},3600,slow,1\n", i * 3600, i * 3600));
    }
    let opts = CliOptions { policies: vec![Policy::Gpuci], ..CliOptions::default() };
    let a = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let b = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    assert_eq!(a, b);
    let (fast, slow) = (&a.runs[0].fleets[0], &a.runs[0].fleets[1]);
    assert_eq!((slow.interruptions, slow.reruns), (0, 0));
    let hours = fast.paid_gpu_hours;
    let n = f64::from(fast.interruptions);
    assert!((n - hours).abs() < 4.0 * hours.sqrt(), "{n} interruptions in {hours:.0} spot hours");
    // A machine taken back while idle reruns nothing.
    assert!(fast.reruns > 0 && fast.reruns <= fast.interruptions, "{} {}", fast.reruns, fast.interruptions);
    let other = run_cli(&config, "server.toml", &trace, "trace.csv", &CliOptions { seed: 2, ..opts }).expect("runs");
    assert_ne!(other.runs[0].fleets[0].interruptions, fast.interruptions);
}

// Starts always refused: the stopped machine is tried once per skip of its back-off (1000,
// 1015, 1045, 1105, 1225, then every 120 s, the back-off's cap: 1345, 1465, 1585, 1705) and
// deleted at its stopped hold (1500 s after its stop at 250: 1750, as above); and creates are
// always refused too from 500 s on (an outage that never ends: at 1825, when the offer's last
// skip ends, then every 2 minutes). So b never runs. The run gives up 7 days after the
// trace's end (1100 s) and counts b as unfinished, with its wait so far in the percentiles: up
// to the last look before then (the last refused create at 1825 + 5033 × 120 = 605,785 s,
// and the look 5 s after it): 604,790 s.
#[test]
fn a_policy_that_never_gets_a_machine_ends_the_run_and_shows_in_the_waits() {
    let config = format!(
        "{}[[fleet.simulate.offer]]\ninstance_type = \"t4-box\"\noutages = [[500, 100000000]]\n",
        STOP_CONFIG.replace("stop = \"fixed 30s\"", "stop = \"fixed 30s\"\nstart_capacity_error_rate = 1.0")
    );
    let trace = format!("{HEADER}a,0,100,t4,1\nb,1000,100,t4,1\n");
    let opts = CliOptions { policies: vec![Policy::Gpuci], ..CliOptions::default() };
    let report = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let t = &report.runs[0].total;
    // Refused starts at 1000, 1015, 1045, 1105, 1225 (skips 15 s doubling), then every 120 s
    // (the back-off's cap) to 1705; the stopped machine is deleted at its hold (1750); creates
    // from 1825 (the offer's last skip ends), every 120 s until the run gives up (1100 + 7 days).
    assert_eq!((t.unfinished_jobs, t.wait_p99_s, t.starts), (1, 1825 + 5033 * 120 + 5 - 1000, 0));
    assert_eq!(t.start_capacity_errors, 9);
    assert_eq!(t.capacity_errors, (1100 + 7 * 86_400 - 1825) / 120 + 1);
    assert!(close(secs(t.paid_gpu_hours), 250.0));
    assert!(report.to_string().contains("1 jobs never ran to their end"));
}

// Starts always refused, creates not: starts refused at 1000, 1015, 1045, 1105, 1225 (the
// back-off doubling from 15 s), 1345, 1465, 1585, 1705 (its cap, 120 s); the stopped machine is
// deleted at its stopped hold (1750) and a new one made when the offer's skip ends (1825): b
// runs after all (ready 1885).
#[test]
fn a_stopped_machine_that_never_starts_is_deleted_and_replaced() {
    let config = STOP_CONFIG.replace("stop = \"fixed 30s\"", "stop = \"fixed 30s\"\nstart_capacity_error_rate = 1.0");
    let trace = format!("{HEADER}a,0,100,t4,1\nb,1000,100,t4,1\n");
    let opts = CliOptions { policies: vec![Policy::Gpuci], ..CliOptions::default() };
    let report = run_cli(&config, "server.toml", &trace, "trace.csv", &opts).expect("runs");
    let t = &report.runs[0].total;
    assert_eq!((t.unfinished_jobs, t.start_capacity_errors, t.machines_launched, t.wait_p95_s), (0, 9, 2, 885));
}
