//! The `slurm` provider end to end, against a real Slurm: Debian's `slurmctld`, `slurmd` and
//! `munged`, started by each test as root with fake GPU device files in `gres.conf`
//! (`common/slurm.rs`). A real coordinator's fleet submits `sbatch` jobs; each runs a real
//! `gpuci agent --allocation slurm` that serves the GPUs Slurm granted it (simulated GPUs of
//! the same numbers, as this machine has none), and jobs run in it.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;
#[path = "common/slurm.rs"]
mod slurm;

use common::*;
use gpuci_core::job::JobState;
use serde_json::Value;
use slurm::Slurm;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

struct Fleet {
    dir: tempfile::TempDir,
    server: Server,
    slurm: Slurm,
}

/// A coordinator with fleet `hpc`: machines of `gpus` GPUs, as Slurm jobs on a one-node
/// cluster with 4 GPUs. `extra`: more fleet keys; `machine`: more `[fleet.machine]` keys.
fn start(gpus: u32, extra: &str, machine: &str) -> Option<Fleet> {
    start_every(gpus, extra, machine, "300ms")
}

/// [`start`], the fleet's reconcile loop running every `interval` (`--fleet-interval`).
fn start_every(gpus: u32, extra: &str, machine: &str, interval: &str) -> Option<Fleet> {
    start_on(&slurm::Gpus::count(4), "4xL4", gpus, extra, machine, "", interval)
}

/// [`start`] on a cluster whose node has the GPUs `node`; the agents simulate `simulate`
/// (their GPU `i` is `/dev/nvidia<i>`), `settings`: more `[fleet.settings]` keys.
fn start_on(
    node: &slurm::Gpus,
    simulate: &str,
    gpus: u32,
    extra: &str,
    machine: &str,
    settings: &str,
    interval: &str,
) -> Option<Fleet> {
    let slurm = Slurm::start_with(node, "")?;
    let dir = tempdir();
    let config = dir.path().join("server.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[[fleet]]
name = "hpc"
provider = "slurm"
max = 2
idle_timeout = "3s"
boot_timeout = "90s"
{extra}
[fleet.machine]
gpu_model = "NVIDIA L4"
gpus = {gpus}
gpu_memory = "22GiB"
cpus = 1
memory = "256MiB"
{machine}
[[fleet.offer]]
instance_type = "l4"
price_per_hour = 0.5
[fleet.settings]
partition = "gpu"
slurm_conf = "{conf}"
output = "{dir}/slurm-%j.out"
agent_data_dir = "{dir}/agents"
agent_program = "{bin}"
agent_args = ["--simulate-gpus", "{simulate}", "--slots", "1", "--isolation", "{iso}", "--terminate-grace", "8s"]
{settings}
"#,
            conf = slurm.conf.display(),
            dir = dir.path().display(),
            bin = BIN,
            iso = isolation(),
        ),
    )
    .unwrap();
    let server = Server::start_fleets(&dir.path().join("server"), &config, interval);
    Some(Fleet { dir, server, slurm })
}

impl Fleet {
    fn status(&self) -> Value {
        let fleets: Vec<Value> = self.server.api().get("/api/v1/fleets");
        fleets.into_iter().find(|f| f["name"] == "hpc").expect("fleet hpc")
    }

    /// Slurm jobs of the fleet: (id, state, reason, comment).
    fn allocations(&self) -> Vec<(String, String, String, String)> {
        self.slurm.jobs().into_iter().filter(|j| j.3.contains(":hpc:")).collect()
    }

    fn live(&self) -> Vec<(String, String, String, String)> {
        self.allocations()
            .into_iter()
            .filter(|j| matches!(j.1.as_str(), "PENDING" | "RUNNING" | "CONFIGURING"))
            .collect()
    }

    /// Until the fleet has seen the agent of each of its machines connect (a machine that
    /// ends before that counts as a failed boot, not as one taken back).
    fn wait_connected(&self) {
        wait_until_or(
            "the fleet saw its machines' agents connect",
            T,
            || {
                let s = self.status();
                let m = s["machines"].as_array().cloned().unwrap_or_default();
                !m.is_empty() && m.iter().all(|m| !m["connected_at_ms"].is_null())
            },
            || self.explain(),
        );
    }

    fn agent_processes(&self) -> usize {
        processes_with(&self.dir.path().join("agents").display().to_string()).len()
    }

    fn explain(&self) -> String {
        let outputs: Vec<String> = std::fs::read_dir(self.dir.path())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("slurm-"))
            .map(|e| format!("--- {}\n{}", e.path().display(), std::fs::read_to_string(e.path()).unwrap_or_default()))
            .collect();
        format!("{:#}\n{:?}\n{}\n{}", self.status(), self.slurm.jobs(), outputs.join("\n"), self.slurm.logs())
    }
}

/// From zero: two 2-GPU jobs make two Slurm allocations; each agent serves exactly the GPUs
/// Slurm granted its job (SLURM_JOB_GPUS), never the other's; idle allocations are cancelled
/// with scancel and nothing of them is left running.
#[test]
fn allocations_serve_slurms_gpus_and_are_cancelled_when_idle() {
    let Some(f) = start(2, "", "") else { return };
    let api = f.server.api();
    let two = "steps:\n  - key: a\n    gpus: 2\n    command: echo on $GPUCI_GPUS && sleep 4\n  - key: b\n    gpus: 2\n    command: echo on $GPUCI_GPUS && sleep 4\n";
    let p = api.submit(two);
    wait_until_or("two agents connected", T, || api.agents().len() == 2, || f.explain());

    // Each agent's GPUs are its Slurm job's: the indices Slurm chose, disjoint.
    let mut seen: Vec<u32> = Vec::new();
    for (id, state, _, _) in f.live() {
        assert_eq!(state, "RUNNING");
        let env = f.slurm.job_env(&id).unwrap_or_else(|| panic!("job {id}'s agent process: {}", f.explain()));
        let granted = env.iter().find(|(k, _)| k == "SLURM_JOB_GPUS").map(|(_, v)| v.clone()).expect("SLURM_JOB_GPUS");
        let name = env.iter().find(|(k, _)| k == "SLURM_JOB_NAME").map(|(_, v)| v.clone());
        assert_eq!(name.as_deref(), Some("gpuci.hpc"));
        let indices = |a: &gpuci_protocol::api::AgentSummary| {
            a.gpus.iter().map(|g| g.info.index.to_string()).collect::<Vec<_>>().join(",")
        };
        let agent = api
            .agents()
            .into_iter()
            .find(|a| indices(a) == granted)
            .unwrap_or_else(|| panic!("no agent serves exactly Slurm's grant {granted}: {:#?}", api.agents()));
        seen.extend(agent.gpus.iter().map(|g| g.info.index));
    }
    seen.sort();
    assert_eq!(seen, [0, 1, 2, 3], "two allocations, four GPUs, none twice");

    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    let on: Vec<String> = done.jobs.iter().map(|j| api.log_text(j.id)).collect();
    assert!(on.iter().all(|l| l.contains("on GPU-")) && on[0] != on[1], "{on:?}");

    wait_until_or(
        "every allocation cancelled once idle, no agent left running",
        T,
        || {
            f.live().is_empty()
                && f.agent_processes() == 0
                && f.status()["machines"].as_array().is_some_and(|m| m.is_empty())
        },
        || f.explain(),
    );
    // The agents' output files are the fleet's own (sbatch runs under umask 077).
    use std::os::unix::fs::PermissionsExt;
    for e in std::fs::read_dir(f.dir.path()).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("slurm-") {
            let mode = e.metadata().unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "{} is mode {mode:o}", e.path().display());
        }
    }
    let ended: Vec<String> = f.allocations().into_iter().map(|j| j.1).collect();
    assert!(ended.iter().all(|s| s == "CANCELLED" || s == "COMPLETED"), "{ended:?}");
}

/// Issue 26: Slurm names a job's GPUs by GRES index — the position in the node's GRES list —
/// not by device minor. On a node whose list is `node`, with `hog` (somebody else's
/// `--gres` request) holding GPUs first, the fleet's 1-GPU allocation must be served as
/// `/dev/nvidia<want>` exactly: the agent's one GPU is that device (simulated GPU `i` is
/// `/dev/nvidia<i>`), and the job is leased that GPU's UUID. Before the fix the agent read
/// the index as a minor and served `/dev/nvidia<index>`.
fn served_device_is_the_granted_one(node: slurm::Gpus, settings: &str, hog: Option<&str>, want: u32) {
    let Some(f) = start_on(&node, "8xL4", 1, "", "", settings, "300ms") else { return };
    if let Some(hog) = hog {
        let id = f
            .slurm
            .command(
                "sbatch",
                &["--parsable", hog, "--job-name=someone-else", "--output=/dev/null", "--wrap", "sleep 300"],
            )
            .unwrap();
        let id = id.trim().to_string();
        wait_until_or(
            "somebody else's job runs",
            T,
            || f.slurm.jobs().iter().any(|j| j.0 == id && j.1 == "RUNNING"),
            || f.explain(),
        );
    }
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo on $GPUCI_GPUS && sleep 3\n");
    let job = api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    let (alloc, _, _, _) = f.live().into_iter().find(|j| j.1 == "RUNNING").expect("the fleet's allocation");
    // Slurm's own word on which device file it granted: its per-node IDX, and slurmd's log
    // of the node's list (index order) — so the expectation is Slurm's, not this test's.
    let shown = f.slurm.command("scontrol", &["-d", "show", "job", &alloc]).unwrap();
    let idx = shown.split("(IDX:").nth(1).and_then(|r| r.split(')').next()).unwrap_or("").to_string();
    let slurmd_log = std::fs::read_to_string(f.slurm.dir().join("log/slurmd.log")).unwrap_or_default();
    eprintln!("allocation {alloc}: IDX {idx}; serving must be /dev/nvidia{want}");
    if node.constrain_devices {
        // task/cgroup says which file it let the allocation's job open.
        let allowed = format!("devices.allow: adding c 195:{want} rwm");
        wait_until_or(
            "slurmd's device cgroup log",
            T,
            || std::fs::read_to_string(f.slurm.dir().join("log/slurmd.log")).unwrap_or_default().contains(&allowed),
            || f.explain(),
        );
    }
    let agents: Vec<_> = api.agents().into_iter().filter(|a| a.state == "connected").collect();
    assert_eq!(agents.len(), 1, "{agents:#?}");
    let served: Vec<u32> = agents[0].gpus.iter().map(|g| g.info.index).collect();
    assert_eq!(
        served,
        [want],
        "Slurm granted GRES index {idx} (/dev/nvidia{want}); the agent serves /dev/nvidia{served:?}\n{}\n{}",
        f.explain(),
        slurmd_log.lines().filter(|l| l.contains("device number")).collect::<Vec<_>>().join("\n")
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    let log = api.log_text(job.id);
    assert!(log.contains(&format!("on {}", agents[0].gpus[0].info.uuid)), "leased another GPU: {log}");
}

/// `File=/dev/nvidia[4-7]`: a job granted `/dev/nvidia4` sees `SLURM_JOB_GPUS=0`.
#[test]
fn a_gres_list_from_nvidia4_serves_nvidia4_for_index_0() {
    served_device_is_the_granted_one(slurm::Gpus::files("[4-7]", 4, &[4, 5, 6, 7]), "", None, 4);
}

/// `File=/dev/nvidia[0,2,3]` (a broken GPU taken out): with index 0 held, index 1 is `nvidia2`.
#[test]
fn a_gres_list_with_a_gap_serves_nvidia2_for_index_1() {
    served_device_is_the_granted_one(slurm::Gpus::files("[0,2,3]", 3, &[0, 1, 2, 3]), "", Some("--gres=gpu:1"), 2);
}

/// A typed split across two gres.conf lines: Slurm orders the types as slurm.conf's `Gres=`
/// lists them (`gpu:h100:2,gpu:a100:2`), not as gres.conf writes them (a100 first), so the
/// fleet's `--gres=gpu:h100:1` is index 0 = `/dev/nvidia2` (the old reading served an A100).
#[test]
fn a_typed_split_follows_slurm_confs_type_order() {
    let node = slurm::Gpus {
        node_gres: "gpu:h100:2,gpu:a100:2".into(),
        gres_conf: "Name=gpu Type=a100 File={dev}/nvidia[0-1]\nName=gpu Type=h100 File={dev}/nvidia[2-3]\n".into(),
        minors: vec![0, 1, 2, 3],
        constrain_devices: false,
    };
    served_device_is_the_granted_one(node, "gpu_type = \"h100\"", None, 2);
}

/// `ConstrainDevices=yes` (task/cgroup, cgroup v1): the job may open only its GPU's file. The
/// agent serves the granted one, and its device cgroup agrees (the agent checks).
#[test]
fn with_constrain_devices_the_agent_serves_what_the_cgroup_lets_it_open() {
    let mut node = slurm::Gpus::files("[0,2,3]", 3, &[0, 1, 2, 3]);
    node.constrain_devices = true;
    served_device_is_the_granted_one(node, "", Some("--gres=gpu:1"), 2);
}

/// Slurm's pending reason shows on the waiting job: with every GPU of the cluster held by a
/// job outside gpuci, the fleet's allocation waits (`Resources`) and the job says so.
#[test]
fn a_pending_allocation_shows_slurms_reason_on_the_waiting_job() {
    let Some(f) = start(1, "", "") else { return };
    // Somebody else's job holds all four GPUs.
    let hog = f
        .slurm
        .command(
            "sbatch",
            &["--parsable", "--gres=gpu:4", "--job-name=someone-else", "--output=/dev/null", "--wrap", "sleep 300"],
        )
        .unwrap();
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ran on $GPUCI_GPUS\n");
    let job = p.jobs[0].id;
    let waiting = api.wait_job(job, "waiting on Slurm's reason", T, |j| j.reason.contains("pending: Resources"));
    let reason = waiting.reason;
    assert!(reason.contains("fleet hpc") && reason.contains("Slurm job"), "{reason}");
    // And on the machine, as `gpuci fleets` shows it.
    let note = f.status()["machines"][0]["note"].as_str().unwrap_or("").to_string();
    assert!(note.contains("pending: Resources"), "{note}");
    // The GPUs come free: the allocation starts and the job runs.
    f.slurm.command("scancel", &[hog.trim()]).unwrap();
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
}

/// Slurm ends an allocation under a running job: `scancel` by an administrator (the agent's
/// SIGTERM), and a killed agent (no word from it). Each time the job is ended `lost` and
/// queued again once, and its next attempt runs on a new allocation.
#[test]
fn an_allocation_slurm_ends_queues_its_job_again_once() {
    let Some(f) = start(1, "", "") else { return };
    let api = f.server.api();
    // The first attempt sleeps (and is taken away); later ones finish at once.
    let step = "steps:\n  - key: a\n    gpus: 1\n    command: if [ \"$GPUCI_ATTEMPT\" = 1 ]; then sleep 300; fi; echo attempt $GPUCI_ATTEMPT done\n";
    let p = api.submit(step);
    let first = p.jobs[0].id;
    api.wait_job(first, "running", T, |j| j.state == JobState::Running);
    f.wait_connected();
    let (id, _, _, _) = f.live().into_iter().next().unwrap();
    f.slurm.command("scancel", &[&id]).unwrap();
    let lost = api.wait_job(first, "lost", T, |j| j.state == JobState::Lost);
    assert!(lost.reason.contains(&format!("Slurm is ending allocation {id}")), "{lost:#?}");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    let attempts: Vec<i64> = done.jobs.iter().map(|j| j.id).collect();
    assert_eq!(attempts.len(), 2, "queued again once: {done:#?}");
    assert!(api.log_text(attempts[1]).contains("attempt 2 done"));

    // Killed outright: the agent says nothing; the listing (Slurm job FAILED) does.
    let p = api.submit(step);
    let first = p.jobs[0].id;
    api.wait_job(first, "running", T, |j| j.state == JobState::Running);
    f.wait_connected();
    let (id, _, _, _) = f.live().into_iter().find(|j| j.1 == "RUNNING").unwrap();
    f.slurm.command("scancel", &["--signal=KILL", "--batch", &id]).unwrap();
    let lost = api.wait_job(first, "lost", T, |j| j.state == JobState::Lost);
    assert!(lost.reason.contains("ended"), "{lost:#?}");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    assert_eq!(done.jobs.len(), 2, "queued again once: {done:#?}");
}

/// A coordinator killed with allocations up comes back and adopts them by their comment: no
/// second allocation for the same machine, and the running job finishes.
#[test]
fn a_restarted_coordinator_adopts_its_allocations() {
    let Some(mut f) = start(1, "", "") else { return };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: sleep 6; echo finished\n");
    api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    let before: Vec<String> = f.allocations().into_iter().map(|j| j.0).collect();
    assert_eq!(before.len(), 1);
    f.server.restart_hard();
    let api = f.server.api();
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    let after: Vec<String> = f.allocations().into_iter().map(|j| j.0).collect();
    assert_eq!(after, before, "adopted, not submitted again");
}

/// `machine.time_limit` becomes the allocation's `--time`; a job whose timeout cannot fit in
/// it makes no allocation (it would take nothing and be cancelled, over and over), one that
/// fits runs.
#[test]
fn the_time_limit_bounds_the_jobs_an_allocation_takes() {
    let Some(f) = start(1, "", "time_limit = \"5m\"") else { return };
    let api = f.server.api();
    let long = api.submit("steps:\n  - key: long\n    gpus: 1\n    timeout: 10m\n    command: echo never\n");
    let short = api.submit("steps:\n  - key: short\n    gpus: 1\n    timeout: 2m\n    command: echo fits\n");
    let done = api.wait_pipeline(short.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    let limits = f.slurm.command("squeue", &["-h", "-t", "all", "-o", "%l"]).unwrap();
    assert!(limits.lines().all(|l| l.trim() == "5:00"), "{limits}");
    let j = api.job(long.jobs[0].id);
    assert_eq!(j.state, JobState::Queued, "{j:#?}");
    assert_eq!(f.allocations().len(), 1, "only the job that fits made an allocation: {}", f.explain());
}

/// Submit → job start when a Slurm allocation must be made first (from zero machines each
/// time), against a bare `srun --gres=gpu:1 true` on the same cluster. Not a pass/fail test:
/// `cargo test -p gpuci --test fleets_slurm -- --ignored --nocapture submit_to_start`
/// prints the figures BENCHMARKS.md quotes.
#[test]
#[ignore = "benchmark: cargo test -p gpuci --test fleets_slurm -- --ignored --nocapture submit_to_start"]
fn submit_to_start() {
    fn stats(mut v: Vec<f64>) -> String {
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        format!("n={n} median {:.3} s, min {:.3}, max {:.3}", v[n / 2], v[0], v[n - 1])
    }
    let runs: usize = std::env::var("GPUCI_BENCH_RUNS").ok().and_then(|r| r.parse().ok()).unwrap_or(8);
    for interval in ["1s", "5s"] {
        let Some(f) = start_every(1, "", "", interval) else { return };
        let api = f.server.api();
        let mut srun = Vec::new();
        for _ in 0..20 {
            let t0 = std::time::Instant::now();
            f.slurm.command("srun", &["--gres=gpu:1", "true"]).unwrap();
            srun.push(t0.elapsed().as_secs_f64());
        }
        let mut gpuci = Vec::new();
        for _ in 0..runs {
            wait_until_or(
                "no allocation left",
                T,
                || f.live().is_empty() && api.agents().iter().all(|a| a.state != "connected"),
                || f.explain(),
            );
            let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: \"true\"\n");
            let j = api.wait_job(p.jobs[0].id, "started", T, |j| j.started_at_ms.is_some());
            gpuci.push((j.started_at_ms.unwrap() - j.created_at_ms) as f64 / 1000.0);
            api.wait_pipeline(p.id, T);
        }
        eprintln!("BENCH fleet-interval {interval}: srun --gres=gpu:1 true: {}", stats(srun.clone()));
        eprintln!(
            "BENCH fleet-interval {interval}: gpuci submit -> job start (new allocation): {}",
            stats(gpuci.clone())
        );
        let med = |mut v: Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        eprintln!("BENCH fleet-interval {interval}: ratio of medians {:.1}x", med(gpuci) / med(srun));
    }
}

/// Issue 26: an allocation `scancel`led within one `--fleet-interval` of its agent
/// connecting (before any reconcile pass saw the agent) is taken back, not a boot failure:
/// its job runs again on a new allocation, the fleet's offer is not skipped, and no reason
/// ever says "capacity error". Prints the time from the `scancel` to the job running again
/// (BENCHMARKS.md quotes it).
#[test]
fn an_allocation_cancelled_right_after_its_agent_registered_is_taken_back() {
    // A long interval: the pass that would have seen the agent connected comes too late.
    let Some(f) = start_every(1, "", "", "20s") else { return };
    let api = f.server.api();
    let step = "steps:\n  - key: a\n    gpus: 1\n    command: if [ \"$GPUCI_ATTEMPT\" = 1 ]; then sleep 300; fi; echo attempt $GPUCI_ATTEMPT done\n";
    let p = api.submit(step);
    let first = p.jobs[0].id;
    // Cancelled the moment its agent registers.
    wait_until_or(
        "the allocation's agent registered",
        T,
        || api.agents().iter().any(|a| a.state == "connected"),
        || f.explain(),
    );
    let (id, _, _, _) = f.live().into_iter().next().expect("one allocation");
    let t0 = std::time::Instant::now();
    f.slurm.command("scancel", &[&id]).unwrap();
    let bad_reason = std::cell::RefCell::new(None::<String>);
    let rerun = std::cell::RefCell::new(None::<(i64, f64)>);
    wait_until_or(
        "the job ran again after the scancel",
        T,
        || {
            let jobs = api.pipeline(p.id).jobs;
            for j in &jobs {
                if j.reason.contains("capacity error") || j.reason.contains("before its agent connected") {
                    bad_reason.borrow_mut().get_or_insert(format!("job {}: {}", j.id, j.reason));
                }
            }
            match jobs.iter().find(|j| j.id != first && j.started_at_ms.is_some()) {
                Some(j) => {
                    rerun.borrow_mut().get_or_insert((j.id, t0.elapsed().as_secs_f64()));
                    true
                }
                None => false,
            }
        },
        || f.explain(),
    );
    let (_, secs) = rerun.borrow().expect("ran again");
    eprintln!("BENCH scancel right after the agent registered -> job running again (fleet-interval 20s): {secs:.2} s");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    assert_eq!(done.jobs.len(), 2, "queued again once: {done:#?}");
    assert!(api.log_text(done.jobs[1].id).contains("attempt 2 done"));
    assert_eq!(*bad_reason.borrow(), None, "{}", f.explain());
    let allocations = f.allocations();
    assert!(allocations.len() >= 2, "ran again on a new allocation: {allocations:?}");
    // No penalty on the fleet: its offer was not skipped, nothing booked as a failed boot.
    let s = f.status();
    let errors = s["recent_errors"].to_string();
    assert!(!errors.contains("before its agent connected") && !errors.contains("skipped"), "{s:#}");
    assert!(!s["why"].as_str().unwrap_or("").contains("capacity error"), "{s:#}");
}
