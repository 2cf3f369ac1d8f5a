//! The `local` provider end to end: a real coordinator whose fleet's machines are real
//! `gpuci agent` processes on this host, each given its own share of the host's GPUs (here a
//! simulated 4×L4 host, shared out by index), made when jobs need them and ended when idle.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

struct Fleet {
    _dir: tempfile::TempDir,
    server: Server,
    data: PathBuf,
}

fn start(extra: &str) -> Fleet {
    start_with(extra, "")
}

/// `top`: more of the config file, before the fleet (`[[budget]]`s).
fn start_with(extra: &str, top: &str) -> Fleet {
    start_full(extra, top, r#"["1", "3"]"#)
}

/// `pool`: the host's GPUs the fleet shares out (of a simulated 4×L4 host).
fn start_full(extra: &str, top: &str, pool: &str) -> Fleet {
    start_config("idle_timeout = \"2s\"", extra, top, pool)
}

/// `idle`: the fleet's idle setting line (empty: the idle hold the coordinator works out).
fn start_config(idle: &str, extra: &str, top: &str, pool: &str) -> Fleet {
    let dir = tempdir();
    let data = dir.path().join("server");
    let config = dir.path().join("server.toml");
    std::fs::write(
        &config,
        format!(
            r#"
{top}
[[fleet]]
name = "ws"
provider = "local"
max = 2
{idle}
boot_timeout = "90s"
{extra}
[fleet.machine]
gpu_model = "NVIDIA L4"
gpus = 1
gpu_memory = "22GiB"
cpus = 2
memory = "4GiB"
[[fleet.offer]]
instance_type = "workstation"
price_per_hour = 0.36
[fleet.settings]
simulate_gpus = "4xL4"
gpus = {pool}
agent_args = ["--slots", "1", "--isolation", "{iso}"]
"#,
            iso = isolation()
        ),
    )
    .unwrap();
    let server = Server::start_on(
        &data,
        "127.0.0.1:0",
        vec![
            "--heartbeat".into(),
            "200ms".into(),
            "--fleet-interval".into(),
            "300ms".into(),
            "--config".into(),
            config.display().to_string(),
        ],
    );
    Fleet { _dir: dir, server, data }
}

impl Fleet {
    fn status(&self) -> Value {
        let fleets: Vec<Value> = self.server.api().get("/api/v1/fleets");
        fleets.into_iter().find(|f| f["name"] == "ws").expect("fleet ws")
    }

    fn machines(&self) -> Vec<Value> {
        self.status()["machines"].as_array().cloned().unwrap_or_default()
    }

    /// The provider's records (`<data dir>/local-machines/<coordinator>/ws/*.json`).
    fn records(&self) -> Vec<Value> {
        let mut out = Vec::new();
        for coordinator in std::fs::read_dir(self.data.join("local-machines")).into_iter().flatten().flatten() {
            for e in std::fs::read_dir(coordinator.path().join("ws")).into_iter().flatten().flatten() {
                if e.path().extension().is_some_and(|x| x == "json") {
                    out.push(serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap());
                }
            }
        }
        out
    }

    /// `gpuci agent` processes whose data dir lies under the local machines' directory.
    fn agent_processes(&self) -> usize {
        let root = self.data.join("local-machines");
        processes_with(root.to_str().unwrap()).len()
    }
}

fn record_state(r: &Value) -> &str {
    r["state"].as_str().unwrap_or("?")
}

/// From zero: two GPU jobs make two local machines, each an agent that sees exactly its own
/// GPU of the host's share (index 1 or 3, never both, never 0 or 2); idle, they are deleted and
/// nothing of them is left running.
#[test]
fn local_machines_get_disjoint_gpus_and_go_away_when_idle() {
    // Deleted when idle, as the fleet says (a local fleet stops by default).
    let f = start("idle_action = \"delete\"");
    let api = f.server.api();
    let two = "steps:\n  - key: a\n    gpus: 1\n    command: echo on $GPUCI_GPUS && sleep 3\n  - key: b\n    gpus: 1\n    command: echo on $GPUCI_GPUS && sleep 3\n";
    let p = api.submit(two);
    wait_until_or("two agents connected", T, || api.agents().len() == 2, || format!("{:#}", f.status()));
    let agents = api.agents();
    let mut indices: Vec<u32> = Vec::new();
    for a in &agents {
        assert!(a.name.starts_with("ws-m-"), "{a:#?}");
        assert_eq!(a.gpus.len(), 1, "an agent shows its share only: {:#?}", a.gpus);
        indices.push(a.gpus[0].info.index);
    }
    indices.sort();
    assert_eq!(indices, [1, 3], "each machine its own GPU of the share");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    let on: Vec<String> = done.jobs.iter().map(|j| api.log_text(j.id)).collect();
    assert!(on.iter().all(|l| l.contains("on GPU-")) && on[0] != on[1], "{on:?}");
    for j in &done.jobs {
        assert_eq!(api.job(j.id).cost.expect("a cost").fleet, "ws");
    }

    wait_until_or(
        "back at zero machines, no agent left running",
        T,
        || f.machines().is_empty() && f.agent_processes() == 0 && f.records().is_empty(),
        || format!("{:#}\n{:#?}", f.status(), f.records()),
    );
}

/// `idle_action = "stop"`: the idle machine's agent ends and its GPU is free; the next job
/// starts the same machine again, as the same agent (no new registration, no new machine).
#[test]
fn an_idle_local_machine_is_stopped_and_started_again() {
    // No idle_action: stop is the default where the provider can stop (issue 28).
    let f = start("");
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo first\n");
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded", "{:#}", f.status());
    let agent = api.job(p.jobs[0].id).agent_id.clone();
    wait_until_or(
        "the idle machine stopped, its agent gone",
        T,
        || f.records().iter().any(|r| record_state(r) == "stopped") && f.agent_processes() == 0,
        || format!("{:#}\n{:#?}", f.status(), f.records()),
    );
    let p = api.submit("steps:\n  - key: b\n    gpus: 1\n    command: echo second\n");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{:#}", f.status());
    assert_eq!(f.records().len(), 1, "started again, not made anew: {:#?}", f.records());
    assert_eq!(api.job(p.jobs[0].id).agent_id, agent, "the same agent identity");
    drop(f);
}

/// A fleet whose machines have GPUs must say which of the host's GPUs they share out: the
/// server refuses to start rather than run agents that would each see every GPU.
#[test]
fn a_local_fleet_that_would_share_every_gpu_is_refused_at_start() {
    let dir = tempdir();
    let config = dir.path().join("server.toml");
    std::fs::write(
        &config,
        "[[fleet]]\nname = \"ws\"\nprovider = \"local\"\nmax = 2\n[fleet.machine]\ngpu_model = \"NVIDIA L4\"\ngpus = 1\ngpu_memory = \"22GiB\"\ncpus = 2\nmemory = \"4GiB\"\n[[fleet.offer]]\ninstance_type = \"ws\"\nprice_per_hour = 0.1\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("fleet ws") && err.contains("say which of this host's GPUs"), "{err}");
    assert!(!Path::new(&dir.path().join("data/local-machines")).exists());
}

/// A repository past its `[[budget]]`: once its jobs' shares reach the budget, its next job
/// makes no machine, takes none that exists, and says why; another repository's job still
/// gets one. What was spent
/// shows in the cost report under the repository (with its host, `github.com/acme/kernels`,
/// also for a remote URL).
#[test]
fn a_repository_past_its_budget_gets_no_new_machine_and_says_so() {
    // $0.36 an hour: $0.0001 a second; the first job runs 2 s.
    let f = start_with("idle_action = \"delete\"", "[[budget]]\nrepository = \"acme/*\"\ndaily = 0.0001\n");
    let api = f.server.api();
    let p = api.submit_from(
        "steps:\n  - key: a\n    gpus: 1\n    command: sleep 2\n",
        Some("https://github.com/acme/kernels.git"),
    );
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded", "{:#}", f.status());
    wait_until_or("no machine left", T, || f.machines().is_empty(), || format!("{:#}", f.status()));
    let made = f.status()["machines"].as_array().map_or(0, Vec::len);
    assert_eq!(made, 0);

    let over = api.submit_from("steps:\n  - key: b\n    gpus: 1\n    command: echo late\n", Some("acme/docs"));
    let job = over.jobs[0].id;
    let j = api.wait_job(job, "a reason naming the repository's budget", T, |j| j.reason.contains("budget"));
    assert!(j.reason.contains("repository github.com/acme/*: daily budget $0.00 reached"), "{}", j.reason);
    std::thread::sleep(Duration::from_secs(2));
    assert!(f.machines().is_empty(), "a machine was made past the budget: {:#}", f.status());
    assert_eq!(api.job(job).state, gpuci_core::job::JobState::Queued);

    // Another repository's job gets a machine; the held job does not take it, before or
    // after, and neither does a new job of acme submitted while that machine is idle.
    let other = api.submit_from("steps:\n  - key: c\n    gpus: 1\n    command: echo fine\n", Some("beta/x"));
    assert_eq!(api.wait_pipeline(other.id, T).state, "succeeded", "{:#}", f.status());
    let idle = api.submit_from("steps:\n  - key: d\n    gpus: 1\n    command: echo late\n", Some("acme/kernels"));
    std::thread::sleep(Duration::from_secs(1));
    for id in [job, idle.jobs[0].id] {
        let j = api.job(id);
        assert_eq!(j.state, gpuci_core::job::JobState::Queued, "{j:#?}");
        assert!(j.reason.starts_with("repository github.com/acme/*: daily budget"), "{}", j.reason);
        api.cancel(id);
    }
    assert_eq!(api.agents().len(), 2, "one machine for acme's first job, one for beta's");
    // The same owner on another host is another owner: acme's budget does not hold it.
    let gitlab = api.submit_from(
        "steps:\n  - key: e\n    gpus: 1\n    command: echo mine\n",
        Some("https://gitlab.com/acme/kernels.git"),
    );
    assert_eq!(api.wait_pipeline(gitlab.id, T).state, "succeeded", "{:#}", f.status());
    let report: Value = api.get("/api/v1/cost?days=1");
    let acme: f64 = report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["repository"] == "github.com/acme/kernels")
        .map(|r| r["usd"].as_f64().unwrap())
        .sum();
    assert!(acme >= 0.0001, "{report:#}");
}

/// A machine whose agent ends at start (its share names a GPU the host lacks) is a boot
/// failure: the offer is skipped for a while instead of a new machine made every pass.
#[test]
fn a_machine_whose_agent_dies_at_start_is_not_made_again_in_a_loop() {
    let f = start_full("", "", r#"["7"]"#);
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo never\n");
    wait_until_or(
        "the failure shown on the fleet",
        T,
        || f.status()["recent_errors"].to_string().contains("ended before its agent connected"),
        || format!("{:#}", f.status()),
    );
    std::thread::sleep(Duration::from_secs(4));
    let logs: Vec<PathBuf> = walk(&f.data.join("local-machines"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    assert_eq!(logs.len(), 1, "one machine made, not one a pass: {logs:?}");
    let log = std::fs::read_to_string(&logs[0]).unwrap();
    assert!(log.contains("the GPU index 7 given to this agent is not on this host"), "{log}");
    api.cancel(p.jobs[0].id);
}

/// Fleet `ws` as [`start_full`] makes it, with more `[fleet.machine]` keys and more agent
/// arguments (issue 26's reasons need a `time_limit` and an agent that takes no jobs).
fn start_own(machine: &str, agent_args: &str) -> Fleet {
    let dir = tempdir();
    let data = dir.path().join("server");
    let config = dir.path().join("server.toml");
    let iso = isolation();
    std::fs::write(
        &config,
        format!(
            "[[fleet]]\nname = \"ws\"\nprovider = \"local\"\nmax = 2\nidle_timeout = \"30s\"\nboot_timeout = \"90s\"\n\
             [fleet.machine]\ngpu_model = \"NVIDIA L4\"\ngpus = 1\ngpu_memory = \"22GiB\"\ncpus = 2\nmemory = \"4GiB\"\n{machine}\n\
             [[fleet.offer]]\ninstance_type = \"workstation\"\nprice_per_hour = 0.36\n\
             [fleet.settings]\nsimulate_gpus = \"4xL4\"\ngpus = [\"1\", \"3\"]\n\
             agent_args = [\"--slots\", \"1\", \"--isolation\", \"{iso}\"{agent_args}]\n"
        ),
    )
    .unwrap();
    let server = Server::start_on(
        &data,
        "127.0.0.1:0",
        vec![
            "--heartbeat".into(),
            "200ms".into(),
            "--fleet-interval".into(),
            "300ms".into(),
            "--config".into(),
            config.display().to_string(),
        ],
    );
    Fleet { _dir: dir, server, data }
}

/// Issue 26: from zero machines, a job no fleet can ever serve (a timeout past the fleet's
/// `time_limit`, more GPUs than its machine has, a GPU model it does not offer, a tag its
/// machines lack) waited as "no agent is connected" while `gpuci fleets` said "enough
/// machines". Now each says so from zero, naming the fleet and why, `gpuci fleets` (and the
/// dashboard, which shows the same summary) names them, no machine is made, and each ends at
/// its queue_timeout with that reason.
#[test]
fn a_job_no_fleet_can_serve_says_why_from_zero_and_ends_at_its_queue_timeout() {
    let f = start_own("time_limit = \"5m\"", "");
    let api = f.server.api();
    let p = api.submit(
        &[
            "steps:",
            "  - {key: long, gpus: 1, timeout: 10m, queue_timeout: 6s, command: echo never}",
            "  - {key: two, gpus: 2, queue_timeout: 6s, command: echo never}",
            "  - {key: h100, gpus: 1, gpu: {model: \"H100*\"}, queue_timeout: 6s, command: echo never}",
            "  - {key: arm, gpus: 1, agents: {arch: arm64}, queue_timeout: 6s, command: echo never}",
        ]
        .join("\n"),
    );
    let ids: Vec<i64> = p.jobs.iter().map(|j| j.id).collect();
    let expect = [
        "fleet ws: its machines live at most time_limit 5m",
        "fleet ws: its machines have 1 GPU, the job needs 2",
        "fleet ws: its GPUs (NVIDIA L4) do not match: model",
        "fleet ws: its machines do not carry tag arch=arm64",
    ];
    for (id, want) in ids.iter().zip(expect) {
        let j = api.wait_job(*id, "the reason naming the fleet", T, |j| j.reason.contains(want));
        assert!(j.reason.contains("no fleet can ever run this job"), "{j:#?}");
        assert!(j.reason.contains("ends at its queue_timeout"), "{j:#?}");
    }
    let why = f.status()["why"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("4 waiting jobs no fleet can run"), "{why}");
    assert!(why.contains(&format!("job {} cannot run here: its machines live at most time_limit 5m", ids[0])), "{why}");
    assert!(f.machines().is_empty(), "no machine is made for what none can run: {:#}", f.status());
    for (id, want) in ids.iter().zip(expect) {
        let j = api.wait_job(*id, "ended at its queue_timeout", T, |j| j.state.is_terminal());
        assert!(j.reason.contains("queue_timeout"), "{j:#?}");
        assert!(j.reason.contains(want), "ends with that reason: {j:#?}");
    }
}

/// Issue 26: an agent that takes no jobs (here: a root agent whose jobs' disk quota cannot be
/// set up) held its machine idle while the job's reason called it "busy (no free job slot)"
/// until queue_timeout. The reason names the agent and its own words.
#[test]
fn an_agent_that_takes_no_jobs_is_named_with_its_reason_not_busy() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: only a root agent refuses jobs for want of a disk quota");
        return;
    }
    let f = start_own("", ", \"--min-free-disk\", \"1000000TiB\"");
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    queue_timeout: 60s\n    command: echo never\n");
    let j = api.wait_job(p.jobs[0].id, "the refusing agent named", T, |j| j.reason.contains("takes no jobs"));
    assert!(j.reason.contains("agent ws-"), "{j:#?}");
    assert!(j.reason.contains("disk quota cannot be set up") || j.reason.contains("no working job sandbox"), "{j:#?}");
    // Never "busy", for as long as it waits.
    for _ in 0..20 {
        let j = api.job(p.jobs[0].id);
        assert!(!j.reason.contains("busy"), "{j:#?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    api.cancel(p.jobs[0].id);
}

/// The idle hold learned from the fleet's idle spells (issue 28): the coordinator counts each
/// GPU job a pass sees (waiting, placed or running) as an arrival, and its end when it is no
/// longer active. Jobs one after another on the fleet's one machine make a spell each (the
/// gap from one's end to the next one's arrival); once the last day holds 20, the fleet's
/// idle rule says it learned from them. Jobs run 2 s, so a pass (every 300 ms) sees each.
#[test]
fn the_coordinator_learns_the_idle_hold_from_the_jobs_it_saw() {
    let f = start_config("", "", "", r#"["1", "3"]"#);
    let api = f.server.api();
    let why = |f: &Fleet| f.status()["why"].as_str().unwrap_or("").to_string();
    for k in 0..23 {
        let p = api.submit(&format!("steps:\n  - key: s{k}\n    gpus: 1\n    command: sleep 2\n"));
        assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded", "{:#}", f.status());
        if k < 19 {
            assert!(!why(&f).contains("idle spells"), "learned from fewer than 20 spells after {k} jobs: {}", why(&f));
        }
    }
    wait_until_or(
        "the idle rule learned from the spells",
        T,
        || why(&f).contains("over the last day's 2") && why(&f).contains(" idle spells"),
        || why(&f),
    );
}
