//! GPU system tests: leases, placement across hosts, requirements, health checks and
//! quarantine, as a user sees them through the API and the CLI.
//!
//! Tests 1–3 use real `gpuci server` / `gpuci agent` processes with simulated GPUs. The
//! quarantine tests run a coordinator and an agent in this process, because the agent's GPU
//! backend must be a [`FakeGpus`] that the test makes dirty at the moment it chooses.

// A failed unwrap in a test is the test failing, with the value in the message.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use gpuci_core::job::JobState;
use gpuci_core::quantity::Bytes;
use gpuci_gpu::GpuProcess;
use gpuci_protocol::api::{AgentSummary, GpuView, JobSummary};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

fn gpu_uuids(agent: &AgentSummary) -> Vec<String> {
    agent.gpus.iter().map(|g| g.info.uuid.clone()).collect()
}

fn agent_named(api: &Api, name: &str) -> AgentSummary {
    api.agents().into_iter().find(|a| a.name == name).unwrap_or_else(|| panic!("no agent {name}"))
}

fn gpu_view(api: &Api, uuid: &str) -> GpuView {
    api.agents()
        .into_iter()
        .flat_map(|a| a.gpus)
        .find(|g| g.info.uuid == uuid)
        .unwrap_or_else(|| panic!("GPU {uuid} is not listed"))
}

/// The UUIDs a job printed on its `gpus=` line (from `$CUDA_VISIBLE_DEVICES`).
fn printed_gpus(api: &Api, job: &JobSummary) -> Vec<String> {
    let log = api.log_text(job.id);
    let lines: Vec<&str> = log.lines().filter_map(|l| l.strip_prefix("gpus=")).collect();
    assert_eq!(lines.len(), 1, "job {} should print one gpus= line, log: {log:?}", job.id);
    lines[0].split(',').filter(|s| !s.is_empty()).map(str::to_string).collect()
}

/// The three variables the agent sets must all name exactly the leased UUIDs.
const PRINT_GPUS: &str = r#"echo "gpus=$CUDA_VISIBLE_DEVICES"; test "$NVIDIA_VISIBLE_DEVICES" = "$CUDA_VISIBLE_DEVICES"; test "$GPUCI_GPUS" = "$CUDA_VISIBLE_DEVICES""#;

fn yaml_step(key: &str, extra: &str, command: &str) -> String {
    format!("  - key: {key}\n{extra}    command: {}\n", serde_json::to_string(command).unwrap())
}

#[test]
fn one_gpu_jobs_get_distinct_gpus_and_queue_while_all_are_leased() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--simulate-gpus", "4xH100-80GB", "--slots", "8", "--isolation", isolation()],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let a1 = agent_named(&api, "a1");
    let inventory = gpu_uuids(&a1);
    assert_eq!(inventory.len(), 4);
    assert!(a1.gpus.iter().all(|g| g.info.simulated && g.state == "free"), "{:#?}", a1.gpus);

    let mut yaml = String::from("steps:\n");
    for i in 0..8 {
        yaml.push_str(&yaml_step(&format!("j{i}"), "    gpus: 1\n", &format!("{PRINT_GPUS}; sleep 1.5")));
    }
    let p = api.submit(&yaml);
    assert_eq!(p.jobs.len(), 8);

    // While the first four hold every GPU, the others wait and say why.
    wait_until("4 jobs running and 4 queued", T, || {
        let jobs = api.pipeline(p.id).jobs;
        let active = jobs.iter().filter(|j| matches!(j.state, JobState::Assigned | JobState::Running)).count();
        let queued = jobs.iter().filter(|j| j.state == JobState::Queued).count();
        // The reason is set by the scheduler's pass just after the state shows.
        let explained = jobs.iter().filter(|j| j.state == JobState::Queued).all(|j| j.reason != "queued");
        active == 4 && queued == 4 && explained
    });
    let jobs = api.pipeline(p.id).jobs;
    let queued: Vec<&JobSummary> = jobs.iter().filter(|j| j.state == JobState::Queued).collect();
    assert!(!queued.is_empty());
    for j in &queued {
        assert!(
            j.reason.contains("needs 1 GPU") && j.reason.contains("4 matching GPUs are leased"),
            "queued job {} says {:?}",
            j.id,
            j.reason
        );
    }
    let leased: BTreeSet<String> =
        jobs.iter().filter(|j| j.state != JobState::Queued).flat_map(|j| j.gpus.clone()).collect();
    assert_eq!(leased.len(), 4, "the 4 running jobs hold 4 distinct GPUs: {jobs:#?}");
    let a1 = agent_named(&api, "a1");
    assert!(a1.gpus.iter().all(|g| g.state == "leased" && g.job_id.is_some()), "{:#?}", a1.gpus);

    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{:#?}", done.jobs);
    let mut intervals = Vec::new();
    for j in &done.jobs {
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        let printed = printed_gpus(&api, j);
        assert_eq!(printed.len(), 1, "job {} saw {printed:?}", j.id);
        assert!(inventory.contains(&printed[0]), "job {} saw {printed:?}, not in {inventory:?}", j.id);
        assert_eq!(printed, j.gpus, "the job saw exactly its lease");
        intervals.push((j.started_at_ms.unwrap(), j.finished_at_ms.unwrap(), printed[0].clone(), j.id));
    }
    // No two jobs that ran at the same time shared a GPU.
    for (i, a) in intervals.iter().enumerate() {
        for b in &intervals[i + 1..] {
            let overlap = a.0 < b.1 && b.0 < a.1;
            assert!(!(overlap && a.2 == b.2), "jobs {} and {} overlapped on {}: {intervals:?}", a.3, b.3, a.2);
        }
    }
    // At most four at once, although the agent has eight slots.
    let most = intervals.iter().map(|a| intervals.iter().filter(|b| b.0 <= a.0 && a.0 < b.1).count()).max().unwrap();
    assert!(most <= 4, "{most} jobs ran at once on 4 GPUs: {intervals:?}");
    assert!(agent_named(&api, "a1").gpus.iter().all(|g| g.state == "free"));
}

#[test]
fn a_multi_gpu_job_never_spans_hosts() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let iso = isolation();
    let _a1 =
        Agent::start(&server, &dir.path().join("a1"), "a1", &["--simulate-gpus", "1xH100-80GB", "--isolation", iso]);
    let _a2 =
        Agent::start(&server, &dir.path().join("a2"), "a2", &["--simulate-gpus", "1xH100-80GB", "--isolation", iso]);
    let api = server.api();
    api.wait_agents(2, T);

    let p = api.submit(&format!("steps:\n{}", yaml_step("pair", "    gpus: 2\n", PRINT_GPUS)));
    let id = p.jobs[0].id;
    let j = api.wait_job(id, "explained", T, |j| j.reason.contains("best host has 1 free"));
    assert_eq!(j.state, JobState::Queued);
    assert!(j.reason.starts_with("needs 2 GPUs;") && j.reason.contains("one host"), "{}", j.reason);
    // Two free GPUs in total are not enough: it stays queued.
    std::thread::sleep(Duration::from_millis(500));
    let j = api.job(id);
    assert_eq!(j.state, JobState::Queued, "{j:?}");
    assert!(j.gpus.is_empty());

    let _a3 =
        Agent::start(&server, &dir.path().join("a3"), "a3", &["--simulate-gpus", "2xH100-80GB", "--isolation", iso]);
    let j = api.wait_job(id, "finished", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Succeeded, "{j:?}");
    assert_eq!(j.agent_name.as_deref(), Some("a3"));
    let a3 = gpu_uuids(&agent_named(&api, "a3"));
    let mut got = j.gpus.clone();
    got.sort();
    let mut want = a3.clone();
    want.sort();
    assert_eq!(got, want, "both GPUs from a3");
    let mut printed = printed_gpus(&api, &j);
    printed.sort();
    assert_eq!(printed, want, "the job saw both of a3's GPUs and nothing else");
}

#[test]
fn gpu_requirements_are_matched_and_mismatches_explained() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--simulate-gpus", "2xH100-80GB", "--slots", "4", "--isolation", isolation()],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let inventory = gpu_uuids(&agent_named(&api, "a1"));
    let yaml = format!(
        "steps:\n{}{}{}{}",
        yaml_step("huge", "    gpus: 1\n    gpu: {memory: \">=100GiB\"}\n", PRINT_GPUS),
        yaml_step("ampere", "    gpus: 1\n    gpu: {model: \"A100*\"}\n", PRINT_GPUS),
        yaml_step("hopper", "    gpus: 1\n    gpu: {model: \"H100*\"}\n", PRINT_GPUS),
        yaml_step("big", "    gpus: 1\n    gpu: {memory: \">=64GiB\", compute_capability: \">=9.0\"}\n", PRINT_GPUS),
    );
    let p = api.submit(&yaml);
    let id = |k: &str| p.jobs.iter().find(|j| j.step_key == k).unwrap().id;

    let huge = api.wait_job(id("huge"), "explained", T, |j| j.reason.contains("no GPU matches"));
    assert_eq!(huge.state, JobState::Queued);
    assert!(huge.reason.contains("memory") && huge.reason.contains("100"), "{}", huge.reason);
    let ampere = api.wait_job(id("ampere"), "explained", T, |j| j.reason.contains("no GPU matches"));
    assert_eq!(ampere.state, JobState::Queued);
    assert!(
        ampere.reason.contains("model") && ampere.reason.contains("A100*") && ampere.reason.contains("H100"),
        "{}",
        ampere.reason
    );
    for k in ["hopper", "big"] {
        let j = api.wait_job(id(k), "finished", T, |j| j.state.is_terminal());
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        let printed = printed_gpus(&api, &j);
        assert!(printed.len() == 1 && inventory.contains(&printed[0]), "{k} saw {printed:?}");
    }
    // The others did not fall back to a GPU that does not fit.
    for k in ["huge", "ampere"] {
        let j = api.job(id(k));
        assert_eq!(j.state, JobState::Queued, "{j:?}");
        assert!(j.gpus.is_empty());
    }
}

fn run_one(api: &Api, command: &str, extra: &str) -> JobSummary {
    let p = api.submit(&format!("steps:\n{}", yaml_step("g", extra, command)));
    api.wait_job(p.jobs[0].id, "finished", T, |j| j.state.is_terminal())
}

fn wait_quarantined(api: &Api, uuid: &str) -> GpuView {
    let t0 = std::time::Instant::now();
    loop {
        let g = gpu_view(api, uuid);
        if g.state == "quarantined" {
            return g;
        }
        assert!(t0.elapsed() < T, "GPU {uuid} was never quarantined: {g:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn cli(c: &InProc, args: &[&str]) -> std::process::Output {
    std::process::Command::new(BIN)
        .args(args)
        .args(["--server", &c.url, "--token", &c.token])
        .env_remove("GPUCI_SERVER")
        .env_remove("GPUCI_TOKEN")
        .output()
        .expect("run gpuci")
}

/// A process the agent may SIGKILL: it plays a compute process on a GPU. Killed on drop.
struct Victim(std::process::Child);

impl Victim {
    fn id(&self) -> u32 {
        self.0.id()
    }
    /// Whether it has exited (been killed): not yet reaped, so a zombie.
    fn exited(&self) -> bool {
        match std::fs::read_to_string(format!("/proc/{}/stat", self.id())) {
            Ok(stat) => stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')),
            Err(_) => true,
        }
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn victim() -> Victim {
    Victim(std::process::Command::new("sleep").arg("300").spawn().expect("spawn sleep"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_process_left_on_a_gpu_is_killed_the_gpu_quarantined_and_skipped_until_released() {
    let c = Arc::new(InProc::start("fakehost-left").await);
    let c2 = c.clone();
    blocking(move || {
        let c = c2;
        let api = c.api();
        api.wait_agents(1, T);
        let (a, b) = (c.a.clone(), c.b.clone());

        // The job starts on A; while it runs, a process of its own appears on A and outlives it.
        let p = api.submit(&format!("steps:\n{}", yaml_step("dirty", "    gpus: 1\n", "sleep 1")));
        let id = p.jobs[0].id;
        let j = api.wait_job(id, "running", T, |j| j.state == JobState::Running);
        assert_eq!(j.gpus, vec![a.clone()]);
        let left = victim();
        c.fake.set(&a, |s| {
            s.processes.push(GpuProcess { pid: left.id(), used_memory: Some(Bytes(2 << 30)) });
            s.memory_used = Bytes(2 << 30);
        });
        let j = api.wait_job(id, "finished", T, |j| j.state.is_terminal());
        // The job's own result is recorded as it was; the GPU's state is separate.
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        assert_eq!(j.exit_code, Some(0));
        // The agent killed the leftover process.
        wait_until("the leftover process to be killed", T, || left.exited());
        let g = wait_quarantined(&api, &a);
        let reason = g.reason.clone().unwrap_or_default();
        assert!(reason.contains(&format!("process {} still holds the GPU", left.id())), "{reason}");
        assert!(reason.contains(&format!("job {id}")), "the reason names the job: {reason}");
        assert_eq!(gpu_view(&api, &b).state, "free");

        // Following jobs get B, never A.
        for _ in 0..3 {
            let j = run_one(&api, PRINT_GPUS, "    gpus: 1\n");
            assert_eq!(j.state, JobState::Succeeded, "{j:?}");
            assert_eq!(j.gpus, vec![b.clone()]);
            assert_eq!(printed_gpus(&api, &j), vec![b.clone()]);
        }
        // Two GPUs cannot be had while one is quarantined; the reason says so.
        let p = api.submit(&format!("steps:\n{}", yaml_step("pair", "    gpus: 2\n", PRINT_GPUS)));
        let pair = p.jobs[0].id;
        let j = api.wait_job(pair, "explained", T, |j| j.reason.contains("quarantined"));
        assert_eq!(j.state, JobState::Queued, "{j:?}");

        // The operator cleans the GPU and returns it: the waiting job gets both.
        c.fake.set(&a, |s| {
            s.processes.clear();
            s.memory_used = Bytes::from_mib(4);
        });
        let r = api.raw().post(format!("{}/api/v1/gpus/{a}/release", c.url)).bearer_auth(&c.token).send().unwrap();
        assert_eq!(r.status(), 204, "{}", r.text().unwrap_or_default());
        let j = api.wait_job(pair, "finished", T, |j| j.state.is_terminal());
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        let mut printed = printed_gpus(&api, &j);
        printed.sort();
        let mut want = vec![a.clone(), b.clone()];
        want.sort();
        assert_eq!(printed, want);
        // And A alone again.
        let j = run_one(&api, PRINT_GPUS, "    gpus: 1\n");
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        assert_eq!(j.gpus, vec![a.clone()]);
        assert_eq!(gpu_view(&api, &a).state, "free");
        // Releasing a GPU that is not quarantined is a conflict.
        let r = api.raw().post(format!("{}/api/v1/gpus/{a}/release", c.url)).bearer_auth(&c.token).send().unwrap();
        assert_eq!(r.status(), 409);
    })
    .await;
    Arc::into_inner(c).expect("one owner").stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_not_returned_after_a_job_quarantines_the_gpu() {
    let c = Arc::new(InProc::start("fakehost-mem").await);
    let c2 = c.clone();
    blocking(move || {
        let c = c2;
        let api = c.api();
        api.wait_agents(1, T);
        let a = c.a.clone();
        let p = api.submit(&format!("steps:\n{}", yaml_step("leak", "    gpus: 1\n", "sleep 1")));
        let id = p.jobs[0].id;
        let j = api.wait_job(id, "running", T, |j| j.state == JobState::Running);
        assert_eq!(j.gpus, vec![a.clone()]);
        // The job allocates 10 GiB that is never given back (a leaked context, no process listed).
        c.fake.set(&a, |s| s.memory_used = Bytes(10 << 30));
        let j = api.wait_job(id, "finished", T, |j| j.state.is_terminal());
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        let t0 = std::time::Instant::now();
        while gpu_view(&api, &a).state != "quarantined" && t0.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let g = gpu_view(&api, &a);
        assert_eq!(g.state, "quarantined", "GPU with 10 GiB still in use after the job: {g:#?}");
        let reason = g.reason.unwrap_or_default();
        assert!(reason.contains("did not return to baseline"), "{reason}");
        // The next job gets B.
        let j = run_one(&api, PRINT_GPUS, "    gpus: 1\n");
        assert_eq!(j.gpus, vec![c.b.clone()]);
    })
    .await;
    Arc::into_inner(c).expect("one owner").stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_xid_error_during_a_job_quarantines_the_gpu() {
    let c = Arc::new(InProc::start("fakehost-xid").await);
    let c2 = c.clone();
    blocking(move || {
        let c = c2;
        let api = c.api();
        api.wait_agents(1, T);
        let a = c.a.clone();
        let p = api.submit(&format!("steps:\n{}", yaml_step("xid", "    gpus: 1\n", "sleep 1")));
        let id = p.jobs[0].id;
        let j = api.wait_job(id, "running", T, |j| j.state == JobState::Running);
        assert_eq!(j.gpus, vec![a.clone()]);
        c.fake.set(&a, |s| {
            s.xid_errors += 1;
            s.last_xid = Some(79);
        });
        let j = api.wait_job(id, "finished", T, |j| j.state.is_terminal());
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        let t0 = std::time::Instant::now();
        while gpu_view(&api, &a).state != "quarantined" && t0.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let g = gpu_view(&api, &a);
        assert_eq!(g.state, "quarantined", "GPU with a new Xid 79 during the job: {g:#?}");
        assert!(g.reason.unwrap_or_default().contains("1 new Xid error since last check (last: Xid 79)"));
    })
    .await;
    Arc::into_inner(c).expect("one owner").stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pre_job_quarantine_is_not_called_post_job() {
    let c = Arc::new(InProc::start("fakehost-label").await);
    let c2 = c.clone();
    blocking(move || {
        let c = c2;
        let api = c.api();
        api.wait_agents(1, T);
        let a = c.a.clone();
        c.fake.set(&a, |s| s.memory_used = Bytes(3 << 30));
        let j = run_one(&api, "true", "    gpus: 1\n");
        // Requeued off the dirty GPU, it runs on the clean one.
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        let reason = wait_quarantined(&api, &a).reason.unwrap_or_default();
        assert!(reason.contains("memory used 3 GiB"), "{reason}");
        assert!(reason.contains("pre-job check"), "{reason}");
        assert!(!reason.contains("post-job"), "a pre-job failure is labelled post-job: {reason}");
    })
    .await;
    Arc::into_inner(c).expect("one owner").stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_failing_its_pre_job_check_is_quarantined_its_job_requeued_and_the_cli_shows_and_releases_it() {
    let c = Arc::new(InProc::start("fakehost-pre").await);
    let c2 = c.clone();
    blocking(move || {
        let c = c2;
        let api = c.api();
        api.wait_agents(1, T);
        let (a, b) = (c.a.clone(), c.b.clone());

        // A foreign compute process sits on A before any job.
        let foreign = victim();
        let pid = foreign.id();
        c.fake.set(&a, |s| {
            s.processes.push(GpuProcess { pid, used_memory: Some(Bytes(3 << 30)) });
            s.memory_used = Bytes(3 << 30);
        });
        // The job is not at fault: it goes back to the queue and runs on B, never on A.
        let j = run_one(&api, PRINT_GPUS, "    gpus: 1\n");
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        assert_eq!(j.gpus, vec![b.clone()]);
        assert_eq!(printed_gpus(&api, &j), vec![b.clone()]);
        let g = wait_quarantined(&api, &a);
        let reason = g.reason.clone().unwrap_or_default();
        assert!(reason.contains(&format!("process {pid} still holds the GPU")), "{reason}");
        assert!(reason.contains("memory used 3 GiB"), "{reason}");
        // A pre-job failure does not kill a process the job never started.
        assert!(!foreign.exited(), "the agent killed a process that was not the job's");

        // The next job goes to B.
        let j = run_one(&api, PRINT_GPUS, "    gpus: 1\n");
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        assert_eq!(printed_gpus(&api, &j), vec![b.clone()]);

        // `gpuci agents` marks simulated GPUs and shows the quarantine with its reason.
        let out = cli(&c, &["agents"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "gpuci agents: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(stdout.matches("(simulated)").count(), 2, "{stdout}");
        let row_a = stdout.lines().find(|l| l.contains(&a)).unwrap_or_else(|| panic!("no row for {a}: {stdout}"));
        assert!(row_a.contains(&format!("QUARANTINED: {reason}")), "{stdout}");
        let row_b = stdout.lines().find(|l| l.contains(&b)).unwrap_or_else(|| panic!("no row for {b}: {stdout}"));
        assert!(!row_b.contains("QUARANTINED") && row_b.trim_end().ends_with("free"), "{stdout}");

        // `gpuci gpu release` returns it to service.
        drop(foreign);
        c.fake.set(&a, |s| {
            s.processes.clear();
            s.memory_used = Bytes::from_mib(4);
        });
        let out = cli(&c, &["gpu", "release", &a]);
        assert!(out.status.success(), "gpuci gpu release: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(gpu_view(&api, &a).state, "free");
        let out = cli(&c, &["agents"]);
        assert!(!String::from_utf8_lossy(&out.stdout).contains("QUARANTINED"));
        // Releasing it again fails with a message.
        let out = cli(&c, &["gpu", "release", &a]);
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("not quarantined"), "{out:?}");
        let j = run_one(&api, PRINT_GPUS, "    gpus: 1\n");
        assert_eq!(j.state, JobState::Succeeded, "{j:?}");
        assert_eq!(printed_gpus(&api, &j), vec![a.clone()]);
    })
    .await;
    Arc::into_inner(c).expect("one owner").stop().await;
}
