//! Fan-out demand and warm capacity from history through `gpuci simulate` (issue 28): the
//! gpuci policy against the same fleet run as a fixed 5-minute timeout (no anticipation).

use gpuci_simulate::{run_cli, CliOptions, Policy};

/// One on-demand T4 fleet that deletes after 5 idle minutes (so gpuci and fixed-idle-5m differ
/// only by what they anticipate), fixed 60 s boots, no outage.
const CONFIG: &str = r#"
[[fleet]]
name = "t4"
provider = "exec"
max = 8
idle_timeout = "5m"
idle_action = "delete"
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
capacity_outages_per_day = 0
spot_capacity_outages_per_day = 0
"#;

fn run(report: &gpuci_simulate::Report, policy: Policy) -> &gpuci_simulate::Figures {
    &report.runs.iter().find(|r| r.policy == policy).expect("policy ran").total
}

fn opts() -> CliOptions {
    CliOptions { policies: vec![Policy::Gpuci, Policy::FixedIdle5m], ..CliOptions::default() }
}

// 40 pipelines two hours apart: a 200 s build (no GPU) and three 300 s T4 shards after it.
//   fixed-idle-5m: each shard is queued when the build ends and waits one boot: 60 s, every one.
//   gpuci: from the second pipeline on the build's history says it ends 200 s after its start;
//          60 s (one boot) before that the three shards are demand: their machines are ready
//          as the build ends and they wait 0. Only the first pipeline's three (of 120) wait.
//          The machines boot at the same price either way: the same GPU-hours.
#[test]
fn a_fan_out_after_a_build_finds_its_machines_ready() {
    let mut trace = String::from("job_id,submit_s,duration_s,pool,gpus,after,step\n");
    for p in 0..40 {
        let t = p * 7200;
        trace.push_str(&format!("b{p},{t},200,cpu,0,,build\n"));
        for k in 0..3 {
            trace.push_str(&format!("s{p}-{k},{t},300,t4,1,b{p},shard\n"));
        }
    }
    let report = run_cli(CONFIG, "server.toml", &trace, "trace.csv", &opts()).expect("runs");
    let (g, f) = (run(&report, Policy::Gpuci), run(&report, Policy::FixedIdle5m));
    assert_eq!((f.jobs, f.wait_p50_s, f.wait_p95_s), (120, 60, 60));
    assert_eq!((g.jobs, g.wait_p50_s, g.wait_p95_s, g.wait_p99_s), (120, 0, 0, 60));
    assert!((g.paid_gpu_hours - f.paid_gpu_hours).abs() < 1e-9, "{} vs {}", g.paid_gpu_hours, f.paid_gpu_hours);
    assert_eq!(g.machines_launched, f.machines_launched);
    // The bound counts the shards from the build's end, not their submit.
    assert!((g.lower_bound_gpu_hours - 40.0 * 3.0 * 300.0 / 3600.0).abs() < 1e-9);
    assert_eq!(report.unserved_jobs, 0, "a job with no GPU runs off the fleets");
}

// A cancelled build takes its shards with it (they are never queued, and cost nothing).
#[test]
fn shards_of_a_cancelled_build_never_run() {
    let trace = "job_id,submit_s,duration_s,pool,gpus,group,cancel_in_progress,after,step\n\
                 b1,0,200,cpu,0,pr1,1,,build\n\
                 s1,0,300,t4,1,pr1,1,b1,shard\n\
                 b2,100,200,cpu,0,pr1,1,,build\n\
                 s2,100,300,t4,1,pr1,1,b2,shard\n";
    let report = run_cli(CONFIG, "server.toml", trace, "trace.csv", &opts()).expect("runs");
    let g = run(&report, Policy::Gpuci);
    assert_eq!((g.jobs, g.cancelled, g.machines_launched), (2, 1, 1), "only s2 ran");
    assert!((g.lower_bound_gpu_hours - 300.0 / 3600.0).abs() < 1e-9);
}

// Four weeks; every day from 09:00 to 10:00 UTC a 30 s job each minute, nothing else.
//   fixed-idle-5m: each day the first job waits one boot (60 s) and the second, queued as the
//          first starts on the only machine, 30 s: 56 of 1,680 (3.3 %) wait: p99 60 s.
//   gpuci: after a week the profile has 60 jobs/h at 09:00 keeping 0.5 machines busy, and a
//          job every minute is within a delete fleet's rent-or-buy price (boot + the boot a job
//          waits, 120 s): ⌈0.5⌉ = 1 machine is made one boot before 09:00 and the day's first
//          job finds it ready. Only the first week's 14 wait (0.8 %): p99 0 s. It pays no
//          more: the machine it makes early is the one fixed-idle-5m makes late.
#[test]
fn machines_are_ready_before_the_usual_busy_hour() {
    let mut trace = String::from("job_id,submit_s,duration_s,pool,gpus\n");
    for d in 0..28 {
        for k in 0..60 {
            trace.push_str(&format!("j{d}-{k},{},30,t4,1\n", d * 86_400 + 9 * 3600 + k * 60));
        }
    }
    let report = run_cli(CONFIG, "server.toml", &trace, "trace.csv", &opts()).expect("runs");
    let (g, f) = (run(&report, Policy::Gpuci), run(&report, Policy::FixedIdle5m));
    assert_eq!((f.jobs, f.wait_p99_s), (1680, 60));
    assert_eq!((g.jobs, g.wait_p99_s), (1680, 0));
    assert!(g.paid_gpu_hours <= f.paid_gpu_hours, "{} vs {}", g.paid_gpu_hours, f.paid_gpu_hours);
}
