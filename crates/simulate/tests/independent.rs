//! Each fleet's figures are its own: a fleet with no job costs nothing under any policy, a
//! fleet's bill ends with its own last job whatever other fleets still run, and the policy
//! prices stopped machines at the disk the simulated world bills. (Found by an outside check
//! of `gpuci simulate`, issue 28.)

use gpuci_simulate::{run_cli, CliOptions, Policy, Report};

// `s` stops (start 20 s, stop 10 s), `d` deletes; both boot in 60 s. $3.60/h = $0.001/s;
// disk 730 GB at $0.36/GB-month = $0.36/h = $0.0001/s.
const CONFIG: &str = r#"
[[fleet]]
name = "s"
provider = "exec"
max = 2
[fleet.settings]
stop = true
[fleet.machine]
gpu_model = "NVIDIA T4"
gpus = 1
gpu_memory = "16GiB"
cpus = 4
memory = "16GiB"
[[fleet.offer]]
instance_type = "box"
price_per_hour = 3.6
[fleet.simulate]
boot = "fixed 60s"
start = "fixed 20s"
stop = "fixed 10s"
disk_gb = 730
disk_price_per_gb_month = 0.36
capacity_outages_per_day = 0
spot_capacity_outages_per_day = 0

[[fleet]]
name = "d"
provider = "exec"
max = 2
[fleet.machine]
gpu_model = "NVIDIA T4"
gpus = 1
gpu_memory = "16GiB"
cpus = 4
memory = "16GiB"
[[fleet.offer]]
instance_type = "box"
price_per_hour = 3.6
[fleet.simulate]
boot = "fixed 60s"
capacity_outages_per_day = 0
spot_capacity_outages_per_day = 0
"#;

const HEADER: &str = "job_id,submit_s,duration_s,pool,gpus\n";

fn run(trace: &str) -> Report {
    run_cli(CONFIG, "server.toml", &format!("{HEADER}{trace}"), "trace.csv", &CliOptions::default()).expect("runs")
}

fn fleet<'a>(r: &'a Report, policy: Policy, name: &str) -> &'a gpuci_simulate::Figures {
    let run = r.runs.iter().find(|p| p.policy == policy).expect("policy ran");
    run.fleets.iter().find(|f| f.fleet == name).expect("fleet")
}

#[test]
fn a_fleet_with_no_job_costs_nothing() {
    let r = run("a,0,100,s,1\n");
    for policy in Policy::ALL {
        let d = fleet(&r, policy, "d");
        assert_eq!((d.machines_launched, d.total_usd), (0, 0.0), "{policy}: {d:?}");
    }
    // always-on: one machine for `s`'s peak of one, 0–100 s (no boot: bought ahead).
    let s = fleet(&r, Policy::AlwaysOn, "s");
    assert_eq!(s.machines_launched, 1);
    assert!((s.cost_usd - 0.1).abs() < 1e-9, "{}", s.cost_usd);
}

#[test]
fn a_fleets_bill_ends_with_its_own_last_job() {
    let alone = run("a,0,100,s,1\nb,600,100,s,1\n");
    let beside = run("a,0,100,s,1\nb,600,100,s,1\nz,50000,100,d,1\n");
    for policy in Policy::ALL {
        let (x, y) = (fleet(&alone, policy, "s"), fleet(&beside, policy, "s"));
        assert_eq!(
            (x.total_usd, x.paid_gpu_hours, x.stopped_disk_gpu_hours, x.wait_p95_s),
            (y.total_usd, y.paid_gpu_hours, y.stopped_disk_gpu_hours, y.wait_p95_s),
            "{policy}: `s` moved with `d`'s job at 50,000 s"
        );
    }
    // always-on by hand: `s` runs one machine from 0 to b's end at 700 s: $0.70.
    assert!((fleet(&beside, Policy::AlwaysOn, "s").cost_usd - 0.7).abs() < 1e-9);
}

/// The policy is told the disk the world bills: $0.36/h here, not the 100 GB default
/// ($0.011/h). Deleting a stopped machine is then worth it after (boot 60 − start 20) × 2 ×
/// $0.001/s / $0.0001/s = 800 s of disk (halved with no arrival in the last day: 400 s), not
/// the ~26,000 s the default disk would say: with jobs at 0, 1,000 and 30,000 the machine is
/// deleted long before the third.
#[test]
fn the_policy_prices_stopped_machines_at_the_disk_the_world_bills() {
    let r = run("a,0,100,s,1\nb,1000,100,s,1\nc,30000,100,s,1\n");
    let s = fleet(&r, Policy::Gpuci, "s");
    assert!(s.stopped_machine_hours * 3600.0 < 2_000.0, "kept stopped {} s", s.stopped_machine_hours * 3600.0);
    assert!(s.floor_ratio < 2.0, "{}", s.floor_ratio);
    // Named in the config, the operator's price is what the policy believes.
    let named = CONFIG
        .replace("[fleet.settings]\nstop = true", "stopped_price_per_hour = 0.011\n[fleet.settings]\nstop = true");
    let r = run_cli(
        &named,
        "server.toml",
        &format!("{HEADER}a,0,100,s,1\nb,1000,100,s,1\nc,30000,100,s,1\n"),
        "t.csv",
        &CliOptions::default(),
    )
    .expect("runs");
    let s = fleet(&r, Policy::Gpuci, "s");
    assert!(s.stopped_machine_hours * 3600.0 > 10_000.0, "kept stopped {} s", s.stopped_machine_hours * 3600.0);
}
