//! Fleets end to end: a real coordinator with `[[fleet]]`s whose machines are real `gpuci agent`
//! processes made by the exec provider's reference program
//! (`crates/providers/tests/exec-ref/gpuci-exec-local`, speaking docs/providers/exec.md). Jobs
//! that no agent can take make machines appear; idle machines go away; what went wrong is
//! shown on the fleet and on the waiting job.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

fn reference_program() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../providers/tests/exec-ref/gpuci-exec-local")
}

/// A fleet of 1×L4 machines (simulated GPUs) made by the reference program.
fn fleet_toml(state: &Path, extra: &str, settings: &str) -> String {
    format!(
        r#"
[[fleet]]
name = "l4"
provider = "exec"
max = 2
idle_timeout = "2s"
boot_timeout = "90s"
{extra}
[fleet.machine]
gpu_model = "NVIDIA L4"
gpus = 1
gpu_memory = "22GiB"
cpus = 2
memory = "4GiB"
[[fleet.offer]]
instance_type = "small"
zone = "lab-a"
price_per_hour = 3.6
[[fleet.offer]]
instance_type = "large"
zone = "lab-b"
price_per_hour = 7.2
[fleet.settings]
command = ["python3", "{program}"]
state_dir = "{state}"
agent_program = "{bin}"
agent_args = ["--simulate-gpus", "1xL4", "--slots", "1", "--leave-after-unreachable", "30s", "--isolation", "{iso}"]
{settings}
"#,
        program = reference_program().display(),
        state = state.display(),
        bin = BIN,
        iso = isolation(),
    )
}

struct Fleet {
    _dir: tempfile::TempDir,
    server: Server,
    state: PathBuf,
}

fn start(extra: &str, settings: &str) -> Fleet {
    let dir = tempdir();
    let state = dir.path().join("machines");
    let config = dir.path().join("server.toml");
    std::fs::write(&config, fleet_toml(&state, extra, settings)).unwrap();
    let server = Server::start_on(
        &dir.path().join("server"),
        "127.0.0.1:0",
        vec![
            "--heartbeat".into(),
            "200ms".into(),
            "--lost-after".into(),
            "20s".into(),
            "--fleet-interval".into(),
            "300ms".into(),
            "--config".into(),
            config.display().to_string(),
        ],
    );
    Fleet { _dir: dir, server, state }
}

impl Fleet {
    fn status(&self) -> Value {
        let fleets: Vec<Value> = self.server.api().get("/api/v1/fleets");
        fleets.into_iter().find(|f| f["name"] == "l4").expect("fleet l4")
    }

    fn machines(&self) -> Vec<Value> {
        self.status()["machines"].as_array().cloned().unwrap_or_default()
    }

    /// The reference program's records: every machine it was asked to make.
    fn made(&self) -> Vec<Value> {
        made_in(&self.state)
    }

    fn running_machines(&self) -> usize {
        self.made().iter().filter(|m| m["state"] == "running").count()
    }
}

/// The reference program's records under `state`.
fn made_in(state: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    for e in walk(state) {
        if e.extension().is_some_and(|x| x == "json") {
            if let Ok(v) = serde_json::from_str::<Value>(&std::fs::read_to_string(&e).unwrap_or_default()) {
                if v.get("provider_id").is_some() {
                    out.push(v);
                }
            }
        }
    }
    out
}

const TWO_L4_JOBS: &str = "steps:\n  - key: a\n    gpus: 1\n    gpu: {model: \"*L4\"}\n    command: echo on $GPUCI_GPUS && sleep 1\n  - key: b\n    gpus: 1\n    gpu: {model: \"*L4\"}\n    command: echo on $GPUCI_GPUS && sleep 1\n";

/// From zero machines: jobs no agent can take make machines appear (never more than `max`),
/// the jobs run on them, and once idle past `idle_timeout` the machines are deleted and the
/// fleet is back at zero, with what they cost recorded.
#[test]
fn scales_from_zero_on_demand_and_back_to_zero_when_idle() {
    let f = start("", "");
    assert!(f.machines().is_empty());
    let api = f.server.api();
    let p = api.submit(TWO_L4_JOBS);
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{:#}", f.status());
    for j in &done.jobs {
        let log = api.log_text(j.id);
        assert!(log.contains("on GPU-"), "job {} ran without its leased L4: {log}", j.id);
        // Its share of the machine: 1 of 1 GPU at $3.60/h, for the time it ran.
        let j = api.job(j.id);
        let cost = j.cost.clone().expect("a job on a fleet machine has a cost");
        let ran = (j.finished_at_ms.unwrap() - j.started_at_ms.unwrap()) as f64 / 1000.0;
        assert!((cost.usd - ran * 0.001).abs() < 1e-9 && cost.fleet == "l4", "{cost:?} for {ran} s");
    }
    let made = f.made();
    assert!((1..=2).contains(&made.len()), "machines made: {made:#?}");
    // The agents came from those machines.
    let agents = api.agents();
    assert!(agents.iter().all(|a| a.name.starts_with("l4-m-")), "{agents:#?}");

    wait_until_or(
        "the fleet back at zero machines",
        T,
        || f.machines().is_empty() && f.running_machines() == 0,
        || format!("{:#}\n{:#?}", f.status(), f.made()),
    );
    let status = f.status();
    assert!(status["spend_today_usd"].as_f64().unwrap() > 0.0, "{status:#}");
    // gpuci fleets, for people.
    let out = std::process::Command::new(BIN)
        .args(["fleets", "--server", &f.server.url, "--token", &f.server.token])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("fleet l4 (exec): 0 machines") && text.contains("spent today $"), "{text}");

    // The cost report: the jobs' shares under their repository, the rest as overhead, adding
    // up to what the machines were billed.
    let report: Value = api.get("/api/v1/cost?days=1");
    let rows = report["rows"].as_array().unwrap();
    let jobs: f64 = rows.iter().filter(|r| !r["repository"].is_null()).map(|r| r["usd"].as_f64().unwrap()).sum();
    let expected: f64 = done.jobs.iter().map(|j| api.job(j.id).cost.unwrap().usd).sum();
    assert!((jobs - expected).abs() < 1e-6, "{report:#}");
    let total = report["total_usd"].as_f64().unwrap();
    assert!((total - status["spend_today_usd"].as_f64().unwrap()).abs() < 0.01, "{report:#} vs {status:#}");
    assert!(report["overhead_usd"].as_f64().unwrap() > 0.0, "boot and idle are overhead: {report:#}");
    // One job's whole cost: its share while it ran plus its part of its machine's boot and
    // idle. Machines that ran jobs are paid for by them in full.
    let costs: Vec<_> = done.jobs.iter().map(|j| api.job(j.id).cost.unwrap()).collect();
    let whole: f64 = costs.iter().map(|c| c.usd + c.overhead_usd.expect("its share of boot and idle")).sum();
    assert!(costs.iter().all(|c| c.overhead_usd.unwrap() > 0.0), "{costs:?}");
    let used: std::collections::BTreeSet<_> = costs.iter().map(|c| c.machine.clone()).collect();
    if used.len() == made.len() {
        assert!((whole - total).abs() < 1e-6, "jobs' whole costs {whole} vs billed {total}: {costs:?}");
    } else {
        assert!(whole < total && whole > expected, "jobs' whole costs {whole} vs billed {total}: {costs:?}");
    }
    let out = std::process::Command::new(BIN)
        .args(["cost", "--days", "1", "--server", &f.server.url, "--token", &f.server.token])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("(overhead: boot, idle)") && text.contains("total $"), "{text}");
}

/// A capacity error for the first offer: the next offer is used and the fleet says what
/// happened; the job does not fail.
#[test]
fn a_capacity_error_moves_to_the_next_offer() {
    let f = start("", "fail_create = {small = \"capacity\"}");
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ok\n");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{:#}", f.status());
    let made = f.made();
    assert!(made.iter().all(|m| m["instance_type"] == "large"), "{made:#?}");
    let errors = f.status()["recent_errors"].to_string();
    assert!(errors.contains("small in lab-a") && errors.contains("trying the next offer"), "{errors}");
}

/// A machine whose agent never connects is deleted after `boot_timeout` and counted; the
/// waiting job says which machine it waits for meanwhile.
#[test]
fn a_machine_that_never_connects_is_deleted_after_boot_timeout() {
    let f = start("", "never_connect = true");
    // 2 s boot timeout: the fleet's own line wins over the default above (the last key in
    // TOML would be a duplicate; rewrite the file instead).
    drop(f);
    let dir = tempdir();
    let state = dir.path().join("machines");
    let config = dir.path().join("server.toml");
    std::fs::write(
        &config,
        fleet_toml(&state, "", "never_connect = true").replace("boot_timeout = \"90s\"", "boot_timeout = \"2s\""),
    )
    .unwrap();
    let server = Server::start_on(
        &dir.path().join("server"),
        "127.0.0.1:0",
        vec!["--fleet-interval".into(), "300ms".into(), "--config".into(), config.display().to_string()],
    );
    let f = Fleet { _dir: dir, server, state };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ok\n");
    let job = p.jobs[0].id;
    api.wait_job(job, "a reason naming the machine it waits for", T, |j| {
        j.reason.contains("fleet l4") || j.reason.contains("machine m-")
    });
    wait_until_or(
        "a boot failure shown on the fleet",
        T,
        || f.status()["recent_errors"].to_string().contains("deleted"),
        || format!("{:#}", f.status()),
    );
    // Deleted at the provider: its process is gone.
    wait_until_or(
        "the never-connecting machine terminated",
        T,
        || f.made().iter().any(|m| m["state"] == "terminated"),
        || format!("{:#?}", f.made()),
    );
    // Its offer is skipped for a while, not booted again in a loop: with two offers, at most
    // two machines are made however long the job waits.
    std::thread::sleep(Duration::from_secs(8));
    let made = f.made();
    assert!(made.len() <= 2, "boots in a loop: {made:#?}");
    assert!(f.status()["recent_errors"].to_string().contains("skipped for a while"), "{:#}", f.status());
    api.cancel(job);
}

/// `kill -9` of the coordinator while a machine boots; started again, it adopts what the
/// provider lists instead of making another: exactly one machine for the one job.
#[test]
fn a_coordinator_killed_during_scale_up_makes_no_duplicate() {
    let mut f = start("", "boot_delay_s = 3");
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ok\n");
    wait_until_or("a machine requested", T, || !f.made().is_empty(), || format!("{:#}", f.status()));
    f.server.restart_hard();
    let api = f.server.api();
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    let made = f.made();
    assert_eq!(made.len(), 1, "one job, one machine: {made:#?}");
}

/// Past the fleet's daily budget no machine is created, and the waiting job says why.
#[test]
fn a_reached_budget_stops_scale_up_and_the_job_says_so() {
    // $3.60 an hour: a thousandth of a dollar is one second of a machine.
    let f = start("daily_budget = 0.001", "");
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: sleep 2\n");
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded", "{:#}", f.status());
    wait_until_or("the budget reached", T, || f.status()["budget_reached"] == true, || format!("{:#}", f.status()));
    wait_until_or("no machine left", T, || f.machines().is_empty(), || format!("{:#}", f.status()));
    let made = f.made().len();
    let p = api.submit("steps:\n  - key: b\n    gpus: 1\n    command: echo late\n");
    let job = p.jobs[0].id;
    let j = api.wait_job(job, "a reason naming the budget", T, |j| j.reason.contains("budget"));
    assert!(j.reason.contains("fleet l4") && j.reason.contains("$0.00"), "{}", j.reason);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(f.made().len(), made, "a machine was made past the budget: {:#?}", f.made());
    assert_eq!(api.job(job).state, gpuci_core::job::JobState::Queued);
    api.cancel(job);
}

/// `idle_action = "stop"`: an idle machine is stopped, not deleted, and started again for the
/// next job (the same machine, the same agent identity) before any new one is made.
#[test]
fn idle_machines_are_stopped_and_started_again_for_the_next_job() {
    let f = start("idle_action = \"stop\"", "stop = true");
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo first\n");
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded", "{:#}", f.status());
    wait_until_or(
        "the idle machine stopped",
        T,
        || f.machines().iter().any(|m| m["state"] == "stopped"),
        || format!("{:#}", f.status()),
    );
    let stopped = f.machines()[0]["id"].as_str().unwrap().to_string();
    let agent = api.job(p.jobs[0].id).agent_id.clone();
    let p = api.submit("steps:\n  - key: b\n    gpus: 1\n    command: echo second\n");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{:#}", f.status());
    assert_eq!(f.made().len(), 1, "started again, not made anew: {:#?}", f.made());
    assert_eq!(api.job(p.jobs[0].id).agent_id, agent, "the same agent identity");
    assert!(f.machines().iter().any(|m| m["id"] == stopped.as_str()), "{:#}", f.status());
}

/// A provider program that echoes what it was given (a cloud API quoting the user data back in
/// an error): the registration token never reaches the fleet's status, `gpuci fleets` or the
/// coordinator's log, and the program's control characters are shown escaped.
#[test]
fn a_provider_that_echoes_the_registration_token_does_not_leak_it() {
    let dir = tempdir();
    let program = dir.path().join("echoing-provider");
    std::fs::write(
        &program,
        r#"#!/usr/bin/env python3
import json, sys
op = sys.argv[1]
req = json.load(sys.stdin)
if op == "list":
    print(json.dumps({"machines": []}))
    sys.exit(0)
token = req.get("agent", {}).get("registration_token", "")
sys.stderr.write("debug: user data was " + req.get("agent", {}).get("user_data", "") + "\n")
print(json.dumps({"error": {"kind": "invalid", "message": "rejected token=" + token + " \x1b[31mRED\r\nFAKE LINE"}}))
sys.exit(1)
"#,
    )
    .unwrap();
    std::fs::set_permissions(&program, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let config = dir.path().join("server.toml");
    let toml = fleet_toml(&dir.path().join("machines"), "", "").replace(
        &format!("command = [\"python3\", \"{}\"]", reference_program().display()),
        &format!("command = [\"{}\"]", program.display()),
    );
    std::fs::write(&config, toml).unwrap();
    let log = dir.path().join("server.log");
    let mut child = std::process::Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--fleet-interval", "300ms", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.path().join("server"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    let url = line.trim().to_string();
    let data = dir.path().join("server");
    let token = std::fs::read_to_string(data.join("api-token")).unwrap().trim().to_string();
    let registration = std::fs::read_to_string(data.join("registration-token")).unwrap().trim().to_string();
    let api = Api::new(&url, &token);
    api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ok\n");
    let status = || {
        let fleets: Vec<Value> = api.get("/api/v1/fleets");
        fleets[0].clone()
    };
    wait_until_or(
        "the provider's error on the fleet",
        T,
        || status()["recent_errors"].to_string().contains("rejected token="),
        || format!("{:#}", status()),
    );
    let shown = status().to_string();
    assert!(!shown.contains(&registration) && shown.contains("[registration token]"), "{shown}");
    let out = std::process::Command::new(BIN).args(["fleets", "--server", &url, "--token", &token]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains(&registration), "{text}");
    assert!(
        !text.contains('\u{1b}') && !text.contains("\r\nFAKE"),
        "control characters reached the terminal: {text:?}"
    );
    let _ = child.kill();
    let _ = child.wait();
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("debug: user data was"), "the program's stderr is logged");
    assert!(!logged.contains(&registration), "the registration token is in the coordinator's log");
}

/// A machine is given a registration token of its own, never the coordinator's: it registers
/// that machine's one agent while the machine is being made, and nothing else. A job on the
/// machine that reads it back (EC2 user data is readable from the instance) finds it spent.
#[test]
fn a_machines_registration_token_registers_its_one_agent_and_is_spent() {
    let f = start("", "");
    let api = f.server.api();
    let done = api.wait_pipeline(api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ok\n").id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    let made = f.made();
    let token = made[0]["registration_token"].as_str().expect("the machine's token").to_string();
    let machine = made[0]["machine"].as_str().unwrap().to_string();
    let coordinators = std::fs::read_to_string(f.server.data_dir.join("registration-token")).unwrap();
    assert_ne!(token, coordinators.trim(), "a machine got the coordinator's registration token");
    assert!(token.starts_with(&format!("gpuci_mreg.{machine}.")), "{token}");
    let register = |bearer: &str| {
        let r = api
            .raw()
            .post(format!("{}/api/v1/agents/register", f.server.url))
            .bearer_auth(bearer)
            .json(&serde_json::json!({"name": "rogue"}))
            .send()
            .unwrap();
        (r.status().as_u16(), r.text().unwrap_or_default())
    };
    let (status, body) = register(&token);
    assert_eq!(status, 401, "a spent machine token registered another agent: {body}");
    assert!(body.contains("used already"), "{body}");
    // Another machine's name on this token, a made-up machine: refused too.
    let (status, _) = register(&token.replacen(&machine, "m-other", 1));
    assert_eq!(status, 401);
    let forged = format!("gpuci_mreg.m-nope.{}", "0".repeat(64));
    assert_eq!(register(&forged).0, 401);
    // Only the machine's own agent registered with it, under the machine's name.
    let agents = api.agents();
    assert!(agents.iter().any(|a| a.name == format!("l4-{machine}")), "{agents:#?}");
    assert!(!agents.iter().any(|a| a.name == "rogue"), "{agents:#?}");
}

/// Provider settings that could never work are refused when the server starts, naming the
/// fleet and the setting.
#[test]
fn impossible_provider_settings_are_refused_at_start() {
    let dir = tempdir();
    let base = fleet_toml(&dir.path().join("machines"), "", "");
    let no_command = base.replace(&format!("command = [\"python3\", \"{}\"]", reference_program().display()), "");
    for (toml, says) in [
        (no_command, "command"),
        (base.replace("[fleet.settings]", "[fleet.settings]\ntimeout = \"0s\""), "timeout"),
        (base.replace("idle_timeout = \"2s\"", "idle_timeout = \"2s\"\nidle_action = \"stop\""), "stop = true"),
        (base.replace("name = \"l4\"", &format!("name = \"{}\"", "a".repeat(200))), "name"),
    ] {
        let config = dir.path().join("bad.toml");
        std::fs::write(&config, &toml).unwrap();
        let out = std::process::Command::new(BIN)
            .args(["server", "--listen", "127.0.0.1:0", "--config"])
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.path().join("server"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("bad.toml") && err.contains(says), "{says}: {err}");
    }
}

/// An instance metadata service of our own: answers the spot interruption notice while `on`.
struct NoticeServer {
    url: String,
    on: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl NoticeServer {
    fn start() -> NoticeServer {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/latest/meta-data/spot/instance-action", listener.local_addr().unwrap());
        let on = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = on.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let mut conn = conn;
                let mut buf = [0u8; 4096];
                let n = conn.read(&mut buf).unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]);
                let notice = flag.load(std::sync::atomic::Ordering::SeqCst)
                    && req.starts_with("GET /latest/meta-data/spot/instance-action");
                let resp = if notice {
                    let body = r#"{"action": "terminate", "time": "2026-11-24T08:22:00Z"}"#;
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len())
                } else {
                    "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_string()
                };
                let _ = conn.write_all(resp.as_bytes());
            }
        });
        NoticeServer { url, on }
    }

    fn set(&self, on: bool) {
        self.on.store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Spot interruptions: a machine whose agent sees the notice takes no new job, its running job
/// is ended `lost` and queued again once (a new attempt, whatever the step's retry policy);
/// after two interruptions the fleet's breaker asks for on-demand machines only.
#[test]
fn spot_interruptions_requeue_the_job_once_and_trip_the_breaker() {
    let notice = NoticeServer::start();
    let extra = "capacity = \"spot-then-on-demand\"";
    let f = {
        let fleet = start(extra, "");
        drop(fleet);
        // Rebuilt with the notice URL in the agents' arguments and spot prices.
        let dir = tempdir();
        let state = dir.path().join("machines");
        let config = dir.path().join("server.toml");
        let toml = fleet_toml(&state, extra, "")
            .replace(
                "\"--isolation\",",
                &format!(
                    "\"--interruption-notice-url\", \"{}\", \"--interruption-poll\", \"200ms\", \"--isolation\",",
                    notice.url
                ),
            )
            .replace("price_per_hour = 3.6", "price_per_hour = 3.6\nspot_price_per_hour = 1.2");
        std::fs::write(&config, toml).unwrap();
        let server = Server::start_on(
            &dir.path().join("server"),
            "127.0.0.1:0",
            vec!["--fleet-interval".into(), "300ms".into(), "--config".into(), config.display().to_string()],
        );
        Fleet { _dir: dir, server, state }
    };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: work\n    gpus: 1\n    command: sleep 4 && echo done\n");
    let attempts = || {
        let mut jobs = api.pipeline(p.id).jobs;
        jobs.sort_by_key(|j| j.attempt);
        jobs
    };
    for round in 1..=2u32 {
        wait_until_or(
            &format!("attempt {round} running"),
            T,
            || attempts().iter().any(|j| j.attempt == round && j.state == gpuci_core::job::JobState::Running),
            || format!("{:#?}\n{:#}", attempts(), f.status()),
        );
        notice.set(true);
        wait_until_or(
            &format!("attempt {round} ended lost and attempt {} queued", round + 1),
            T,
            || attempts().iter().any(|j| j.attempt == round + 1),
            || format!("{:#?}", attempts()),
        );
        notice.set(false);
        let old = attempts().into_iter().find(|j| j.attempt == round).unwrap();
        assert_eq!(old.state, gpuci_core::job::JobState::Lost, "{old:#?}");
        assert!(old.reason.contains("taken back") && old.reason.contains("spot interruption notice"), "{}", old.reason);
    }
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    let jobs = attempts();
    assert_eq!(jobs.len(), 3, "each interruption queued the job again exactly once: {jobs:#?}");
    assert!(api.log_text(jobs[2].id).contains("done"));
    // Two spot machines interrupted, then on-demand only: the breaker.
    let mut made = f.made();
    // In the order they were asked for: machine ids are UUIDv7s, which begin with their
    // creation time in milliseconds (`launched_at` is in seconds: two in one second tied,
    // and the order of the state files decided; a flake).
    made.sort_by_key(|m| m["machine"].as_str().unwrap_or_default().to_string());
    let capacities: Vec<&str> = made.iter().map(|m| m["capacity"].as_str().unwrap_or("?")).collect();
    assert_eq!(capacities, ["spot", "spot", "on-demand"], "{made:#?}");
    let status = f.status();
    assert!(status["breaker_open_until"].as_u64().is_some(), "{status:#}");
    assert!(
        status["recent_errors"].to_string().contains("taken back")
            || status["recent_errors"].to_string().contains("queued again"),
        "{status:#}"
    );
    // The breaker survives a coordinator restart: the interruptions are in the store.
    let mut f = f;
    f.server.restart_hard();
    wait_until_or(
        "the breaker open again after the restart",
        T,
        || {
            let fleets: Vec<Value> = f.server.api().get("/api/v1/fleets");
            fleets.iter().any(|fl| fl["name"] == "l4" && fl["breaker_open_until"].as_u64().is_some())
        },
        || format!("{:#}", f.status()),
    );
}

/// A provider program for the tests that misbehaves as `[fleet.settings] mode` says.
fn hostile_provider(dir: &Path) -> PathBuf {
    let program = dir.join("hostile-provider");
    std::fs::write(
        &program,
        r#"#!/usr/bin/env python3
import json, sys, time
op = sys.argv[1]
req = json.load(sys.stdin)
mode = req["settings"].get("mode")
if mode == "hang":
    time.sleep(600)
if mode == "wrongid":
    if op == "create":
        m = {"machine": req["machine"] + "-x", "provider_id": "p1", "state": "running"}
        print(json.dumps({"machine": m}))
    else:
        print(json.dumps({"machines": []} if op == "list" else {}))
    sys.exit(0)
if mode == "weird" and op == "list":
    ids = ["m-\x1b[2Jcleared\nFAKE", "../../etc/passwd", "x" * 5000, "m-dup", "m-dup"]
    print(json.dumps({"machines": [{"machine": i, "provider_id": "p", "state": "running"} for i in ids]}))
    sys.exit(0)
print(json.dumps({"machines": []} if op == "list" else {"error": {"kind": "invalid", "message": "no"}}))
sys.exit(0 if op == "list" else 1)
"#,
    )
    .unwrap();
    std::fs::set_permissions(&program, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    program
}

fn server_with(dir: &Path, toml: &str) -> Server {
    let config = dir.join("server.toml");
    std::fs::write(&config, toml).unwrap();
    Server::start_on(
        &dir.join("server"),
        "127.0.0.1:0",
        vec!["--fleet-interval".into(), "300ms".into(), "--config".into(), config.display().to_string()],
    )
}

/// A fleet whose provider never answers holds up no other fleet: an L4 job gets its machine
/// from the healthy fleet while the other fleet's calls hang.
#[test]
fn a_hanging_provider_does_not_hold_up_another_fleet() {
    let dir = tempdir();
    let hostile = hostile_provider(dir.path());
    let hanging = format!(
        "[[fleet]]\nname = \"stuck\"\nprovider = \"exec\"\nmax = 1\n[fleet.machine]\ngpu_model = \"NVIDIA A10\"\ngpus = 1\ngpu_memory = \"20GiB\"\ncpus = 2\nmemory = \"4GiB\"\n[[fleet.offer]]\ninstance_type = \"a10\"\nprice_per_hour = 1.0\n[fleet.settings]\ncommand = [\"{}\"]\nmode = \"hang\"\n",
        hostile.display()
    );
    let toml = format!("{hanging}{}", fleet_toml(&dir.path().join("machines"), "", ""));
    let server = server_with(dir.path(), &toml);
    let api = server.api();
    let stuck = api.submit("steps:\n  - key: a10\n    gpus: 1\n    gpu: {model: \"*A10\"}\n    command: echo never\n");
    let p = api.submit("steps:\n  - key: l4\n    gpus: 1\n    gpu: {model: \"*L4\"}\n    command: echo ok\n");
    let done = api.wait_pipeline(p.id, Duration::from_secs(60));
    assert_eq!(done.state, "succeeded", "{done:#?}");
    // The job that waits on the hanging fleet says why, not only the fleet.
    let j = api.wait_job(stuck.jobs[0].id, "a reason naming the fleet's trouble", T, |j| {
        j.reason.contains("fleet stuck: its provider did not answer")
    });
    assert_eq!(j.state, gpuci_core::job::JobState::Queued);
    api.cancel(stuck.jobs[0].id);
}

/// A provider that answers a create with another machine's id: refused and said on the fleet.
#[test]
fn a_create_answered_for_another_machine_is_refused() {
    let dir = tempdir();
    let hostile = hostile_provider(dir.path());
    let toml = fleet_toml(&dir.path().join("machines"), "", "mode = \"wrongid\"").replace(
        &format!("command = [\"python3\", \"{}\"]", reference_program().display()),
        &format!("command = [\"{}\"]", hostile.display()),
    );
    let server = server_with(dir.path(), &toml);
    let api = server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ok\n");
    let status = || -> Value { api.get::<Vec<Value>>("/api/v1/fleets")[0].clone() };
    wait_until_or(
        "the refusal on the fleet",
        T,
        || status()["recent_errors"].to_string().contains("answered a create of"),
        || format!("{:#}", status()),
    );
    api.cancel(p.jobs[0].id);
}

/// Machine ids a provider lists that are not short tokens (control characters, paths, huge,
/// twice) are ignored and said, never shown raw.
#[test]
fn odd_machine_ids_from_a_provider_are_ignored_and_never_shown_raw() {
    let dir = tempdir();
    let hostile = hostile_provider(dir.path());
    let toml = fleet_toml(&dir.path().join("machines"), "", "mode = \"weird\"").replace(
        &format!("command = [\"python3\", \"{}\"]", reference_program().display()),
        &format!("command = [\"{}\"]", hostile.display()),
    );
    let server = server_with(dir.path(), &toml);
    let api = server.api();
    let status = || -> Value { api.get::<Vec<Value>>("/api/v1/fleets")[0].clone() };
    wait_until_or(
        "the odd ids said on the fleet",
        T,
        || status()["recent_errors"].to_string().contains("not a short token"),
        || format!("{:#}", status()),
    );
    let s = status();
    assert_eq!(s["machines"].as_array().map(Vec::len), Some(1), "only m-dup, once: {s:#}");
    let out = std::process::Command::new(BIN)
        .args(["fleets", "--server", &server.url, "--token", &server.token])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains('\u{1b}') && !text.contains("\nFAKE") && text.len() < 20_000, "{text:?}");
}

/// A fleet taken out of the config while its machines exist: they are shown as orphaned, not
/// forgotten.
#[test]
fn machines_of_a_fleet_removed_from_the_config_are_shown_as_orphaned() {
    let dir = tempdir();
    let state = dir.path().join("machines");
    let long = fleet_toml(&state, "", "").replace("idle_timeout = \"2s\"", "idle_timeout = \"10m\"");
    let mut server = server_with(dir.path(), &long);
    let api = server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ok\n");
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded");
    server.kill9();
    std::fs::write(dir.path().join("server.toml"), long.replace("name = \"l4\"", "name = \"l4renamed\"")).unwrap();
    server.restart_hard();
    let api = server.api();
    let fleets = || api.get::<Vec<Value>>("/api/v1/fleets");
    wait_until_or(
        "the old fleet shown with its orphaned machine",
        T,
        || fleets().iter().any(|f| f["name"] == "l4" && f["machines"].to_string().contains("orphaned")),
        || format!("{:#?}", fleets()),
    );
    // Cleaned up by the test: the reference program's agents.
    for m in walk(&state) {
        if m.extension().is_some_and(|x| x == "json") {
            if let Ok(v) = serde_json::from_str::<Value>(&std::fs::read_to_string(&m).unwrap_or_default()) {
                // Only a process that is still this machine's agent (pids come round).
                let Some(pid) = v["pid"].as_i64().filter(|_| v["state"] == "running") else { continue };
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let dir = v["agent_data_dir"].as_str().unwrap_or("\0");
                if String::from_utf8_lossy(&cmdline).contains(dir) {
                    let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
                }
            }
        }
    }
}

/// An idle machine being deleted takes no job meanwhile: a job submitted while the (slow)
/// delete runs gets another machine and runs once, instead of landing on the machine that is
/// going away and ending `lost`.
#[test]
fn a_machine_being_deleted_takes_no_new_job() {
    let dir = tempdir();
    let marker = dir.path().join("deleting");
    let wrapper = dir.path().join("slow-delete");
    std::fs::write(
        &wrapper,
        format!(
            r#"#!/usr/bin/env python3
import os, subprocess, sys, time
op = sys.argv[1]
body = sys.stdin.buffer.read()
if op == "delete":
    open("{marker}", "w").close()
    time.sleep(6)
r = subprocess.run(["python3", "{reference}", op], input=body)
sys.exit(r.returncode)
"#,
            marker = marker.display(),
            reference = reference_program().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let toml = fleet_toml(&dir.path().join("machines"), "", "timeout = \"30s\"").replace(
        &format!("command = [\"python3\", \"{}\"]", reference_program().display()),
        &format!("command = [\"{}\"]", wrapper.display()),
    );
    let server = server_with(dir.path(), &toml);
    let api = server.api();
    let first = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo first\n");
    assert_eq!(api.wait_pipeline(first.id, T).state, "succeeded");
    let old_agent = api.job(first.jobs[0].id).agent_id.clone();
    wait_until("the idle machine's delete under way", T, || marker.exists());
    let second = api.submit("steps:\n  - key: b\n    gpus: 1\n    command: echo second\n");
    let done = api.wait_pipeline(second.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    assert_eq!(done.jobs.len(), 1, "ran once: {done:#?}");
    assert_ne!(api.job(second.jobs[0].id).agent_id, old_agent, "placed on the machine being deleted");
}

/// A machine the provider lists under this coordinator's id that the store does not know (the
/// database restored from a backup taken before it was made) is adopted: recorded, billed,
/// managed, not duplicated.
#[test]
fn a_listed_machine_the_store_does_not_know_is_adopted() {
    let dir = tempdir();
    let long =
        fleet_toml(&dir.path().join("machines"), "", "").replace("idle_timeout = \"2s\"", "idle_timeout = \"10m\"");
    let mut server = server_with(dir.path(), &long);
    let state = dir.path().join("machines");
    let api = server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ok\n");
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded");
    let machine = made_in(&state)[0]["machine"].as_str().unwrap().to_string();
    server.kill9();
    // The store forgets the machine, as a restore of an older backup would.
    let db = dir.path().join("server/gpuci.db");
    let forgot = std::process::Command::new("python3")
        .args(["-c", "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute('DELETE FROM machine_billing'); c.execute('DELETE FROM machines'); c.commit()"])
        .arg(&db)
        .status()
        .unwrap();
    assert!(forgot.success());
    server.restart_hard();
    let api = server.api();
    let fleets = || api.get::<Vec<Value>>("/api/v1/fleets");
    wait_until_or(
        "the machine adopted",
        T,
        || fleets().iter().any(|fl| fl["name"] == "l4" && fl["machines"].to_string().contains(&machine)),
        || format!("{:#?}", fleets()),
    );
    // Billed again from what the provider says, and no second machine made.
    let report: Value = api.get("/api/v1/cost?days=1");
    assert!(report["total_usd"].as_f64().unwrap() > 0.0, "{report:#}");
    assert_eq!(made_in(&state).len(), 1, "{:#?}", made_in(&state));
}

/// A create that outlives its row (a coordinator killed mid-create; the next one ended the
/// row unlisted and asked for a replacement; the first create then finished) leaves a machine
/// at the provider with this installation's tags and no live row. With the fleet at `max`
/// already, it is deleted, never adopted past `max` nor left running untracked (attack3 F-D:
/// "2 machines, wants 2 (max 1)").
#[test]
fn a_machine_whose_row_was_ended_is_deleted_when_the_fleet_is_at_max() {
    let dir = tempdir();
    let toml = fleet_toml(&dir.path().join("machines"), "", "")
        .replace("max = 2", "max = 1")
        .replace("idle_timeout = \"2s\"", "idle_timeout = \"10m\"");
    let mut server = server_with(dir.path(), &toml);
    let state = dir.path().join("machines");
    let api = server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ok\n");
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded");
    let first = made_in(&state)[0]["machine"].as_str().unwrap().to_string();
    server.kill9();
    // What the next coordinator did: ended the row (not listed within its grace) and recorded
    // a replacement, whose create is under way (requested, not listed yet).
    let db = dir.path().join("server/gpuci.db");
    let script = r#"
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1]); c.row_factory = sqlite3.Row
now = int(time.time() * 1000)
row = dict(c.execute('SELECT * FROM machines WHERE id = ?', (sys.argv[2],)).fetchone())
c.execute("UPDATE machines SET state = 'ended', ended_at_ms = ?, reason = 'gone at the provider' WHERE id = ?", (now, sys.argv[2]))
row.update(id='m-replacement0001', state='requested', requested_at_ms=now, provider_id=None, agent_id=None,
           running_at_ms=None, connected_at_ms=None, first_job_at_ms=None, ended_at_ms=None)
c.execute('INSERT INTO machines (%s) VALUES (%s)' % (','.join(row), ','.join('?' * len(row))), list(row.values()))
c.commit()
"#;
    let done = std::process::Command::new("python3").args(["-c", script]).arg(&db).arg(&first).status().unwrap();
    assert!(done.success());
    server.restart_hard();
    let running = |m: &str| {
        made_in(&state).iter().any(|r| r["machine"] == m && (r["state"] == "running" || r["state"] == "pending"))
    };
    let api = server.api();
    let fleets = || api.get::<Vec<Value>>("/api/v1/fleets");
    wait_until_or(
        "the machine with no live row deleted at the provider",
        T,
        || !running(&first),
        || format!("{:#?}\n{:#?}", made_in(&state), fleets()),
    );
    let fleet = fleets().into_iter().find(|f| f["name"] == "l4").unwrap();
    assert!(fleet["count"].as_u64().unwrap() <= 1, "{fleet:#}");
    assert_eq!(made_in(&state).len(), 1, "no other machine made: {:#?}", made_in(&state));
}

/// A coordinator restart does not take a busy machine for one that never booted: after the
/// restart, before its agent has reconnected, the machine is held, not deleted, and the job on
/// it finishes once.
#[test]
fn a_restart_keeps_busy_machines_older_than_boot_timeout() {
    let dir = tempdir();
    let toml =
        fleet_toml(&dir.path().join("machines"), "", "").replace("boot_timeout = \"90s\"", "boot_timeout = \"3s\"");
    let mut server = server_with(dir.path(), &toml);
    let api = server.api();
    let p = api.submit("steps:\n  - key: long\n    gpus: 1\n    command: sleep 10 && echo done\n");
    let job = p.jobs[0].id;
    api.wait_job(job, "running", T, |j| j.state == gpuci_core::job::JobState::Running);
    std::thread::sleep(Duration::from_secs(4)); // the machine is now older than boot_timeout
    server.restart_hard();
    let api = server.api();
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    assert_eq!(done.jobs.len(), 1, "ran once, not lost and retried: {done:#?}");
    let fleets: Vec<Value> = api.get("/api/v1/fleets");
    assert!(!fleets[0]["recent_errors"].to_string().contains("boot_timeout"), "{:#}", fleets[0]);
}

/// An agent started on a machine already being taken back says so before its first job: it is
/// given none, and `gpuci agents` says why.
#[test]
fn an_agent_whose_machine_is_already_being_taken_back_takes_no_job() {
    let notice = NoticeServer::start();
    notice.set(true);
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "doomed",
        &["--isolation", isolation(), "--interruption-notice-url", &notice.url],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: a\n    command: echo never\n");
    wait_until_or(
        "the agent's reason",
        T,
        || api.agents().iter().any(|a| a.reason.contains("spot interruption notice")),
        || format!("{:#?}", api.agents()),
    );
    std::thread::sleep(Duration::from_secs(2));
    let j = api.job(p.jobs[0].id);
    assert_eq!(j.state, gpuci_core::job::JobState::Queued, "{j:#?}");
    assert_eq!(j.attempt, 1);
    api.cancel(j.id);
}

/// A coordinator restarted while its only offers refuse (a capacity outage) keeps their
/// back-off: it does not ask them again at once, and their skips keep growing from where they
/// were instead of starting again at 15 s. (Before, the back-off lived in memory only: the
/// restarted coordinator asked every refusing offer at its first pass.)
#[test]
fn a_restart_during_a_capacity_outage_keeps_the_offers_back_off() {
    let dir = tempdir();
    let calls = dir.path().join("creates.log");
    let wrapper = dir.path().join("provider.sh");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n[ \"$1\" = create ] && date +%s >> '{}'\nexec python3 '{}' \"$@\"\n",
            calls.display(),
            reference_program().display()
        ),
    )
    .unwrap();
    let toml = fleet_toml(&dir.path().join("machines"), "", "fail_create = {\"*\" = \"capacity\"}").replace(
        &format!("command = [\"python3\", \"{}\"]", reference_program().display()),
        &format!("command = [\"sh\", \"{}\"]", wrapper.display()),
    );
    let mut server = server_with(dir.path(), &toml);
    let api = server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo never\n");
    let creates = || std::fs::read_to_string(&calls).unwrap_or_default().lines().count();
    // Both offers refused twice: each skip now 30 s (15 s, then doubled).
    // Each refusal taken in by the loop (its machine record ended first): no create is in
    // flight when the coordinator is killed (one killed during a create finds its record and
    // waits for that machine instead: the exactly-once rule, not the back-off).
    let refusals = || {
        let fleets: Vec<Value> = api.get("/api/v1/fleets");
        fleets.first().map_or(0, |f| f["recent_errors"].to_string().matches("simulated capacity error").count())
    };
    wait_until("both offers refused twice", Duration::from_secs(90), || refusals() >= 4 && creates() == refusals());
    let before = creates();
    server.restart_hard();
    // Several passes of the restarted coordinator (300 ms apart) while the job still waits.
    let api = server.api();
    wait_until("the restarted coordinator has made passes", T, || {
        let fleets: Vec<Value> = api.get("/api/v1/fleets");
        fleets.first().is_some_and(|f| f["why"] != "not reconciled yet")
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(creates(), before, "the restarted coordinator asked refusing offers again at once");
    assert_eq!(api.job(p.jobs[0].id).state, gpuci_core::job::JobState::Queued);
    api.cancel(p.jobs[0].id);
}

/// An idle machine is kept through a capacity outage of its fleet's only offer (a machine let
/// go could not be had again until the outage ends), also across a coordinator restart, and
/// let go as usual once the offer takes a create again. Before, the coordinator never told the
/// idle rule of the outages it met: the machine was stopped after the usual hold (38 s: half of
/// stop 30 s + start 45 s), outage or not.
#[test]
fn an_idle_machine_is_kept_through_a_capacity_outage_of_its_only_offer() {
    let dir = tempdir();
    let calls = dir.path().join("calls.log");
    let outage = dir.path().join("outage");
    let wrapper = dir.path().join("provider.sh");
    // The reference program, except that while `outage` exists every create and start is
    // refused for want of capacity. Every call is logged, refusals as `OP refused`.
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nif {{ [ \"$1\" = create ] || [ \"$1\" = start ]; }} && [ -e '{outage}' ]; then\n  cat >/dev/null\n  \
             echo \"$1 refused\" >> '{calls}'\n  echo '{{\"error\": {{\"kind\": \"capacity\", \"message\": \"no capacity (test outage)\"}}}}'\n  \
             exit 1\nfi\necho \"$1\" >> '{calls}'\nexec python3 '{reference}' \"$@\"\n",
            outage = outage.display(),
            calls = calls.display(),
            reference = reference_program().display()
        ),
    )
    .unwrap();
    // One offer, stopping, the idle hold from cost (no idle_timeout).
    let toml = fleet_toml(&dir.path().join("machines"), "idle_action = \"stop\"", "stop = true")
        .replace("idle_timeout = \"2s\"\n", "")
        .replace("[[fleet.offer]]\ninstance_type = \"large\"\nzone = \"lab-b\"\nprice_per_hour = 7.2\n", "")
        .replace(
            &format!("command = [\"python3\", \"{}\"]", reference_program().display()),
            &format!("command = [\"sh\", \"{}\"]", wrapper.display()),
        );
    assert!(!toml.contains("idle_timeout") && !toml.contains("large"), "{toml}");
    let mut server = server_with(dir.path(), &toml);
    let log = || std::fs::read_to_string(&calls).unwrap_or_default();
    let count = |op: &str| log().lines().filter(|l| *l == op).count();
    let fleet = |api: &Api| -> Value { api.get::<Vec<Value>>("/api/v1/fleets")[0].clone() };
    let api = server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo first\n");
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded", "{:#}", fleet(&api));

    // The outage begins. Two jobs: one runs on the idle machine, the other asks for a second
    // machine and is refused, then runs on the first machine after the first job.
    std::fs::write(&outage, "").unwrap();
    let two = "steps:\n  - key: a\n    gpus: 1\n    command: sleep 3\n  - key: b\n    gpus: 1\n    command: sleep 3\n";
    let p = api.submit(two);
    wait_until_or("a create refused", T, || count("create refused") >= 1, log);
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded", "{:#}", fleet(&api));

    // Restarted (or taken over) during the outage: the idle machine's hold counts afresh, and
    // the outage must still be known.
    server.restart_hard();
    let api = server.api();
    wait_until_or(
        "the machine idle again after the restart",
        T,
        || fleet(&api)["machines"].as_array().is_some_and(|m| m.len() == 1 && m[0]["state"] == "idle"),
        || format!("{:#}", fleet(&api)),
    );
    // Past the usual hold (38 s), well within the outage's (75 s + the outage's age).
    std::thread::sleep(Duration::from_secs(55));
    let s = fleet(&api);
    assert_eq!(count("stop"), 0, "the idle machine was stopped during the outage: {}\n{s:#}", log());
    assert_eq!(count("delete"), 0, "{}", log());
    assert_eq!(s["machines"][0]["state"], "idle", "{s:#}");

    // The outage ends: the offer takes the next create (a second machine for the second of two
    // jobs), and both machines idle afterwards are stopped after the usual hold, not the
    // outage's (which would be over two minutes by now).
    std::fs::remove_file(&outage).unwrap();
    let p = api.submit(two);
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded", "{:#}", fleet(&api));
    assert_eq!(count("create"), 2, "{}", log());
    wait_until_or(
        "both idle machines stopped once the offer took a create",
        Duration::from_secs(90),
        || count("stop") == 2,
        || format!("{}\n{:#}", log(), fleet(&api)),
    );
    assert_eq!(count("start refused"), 0, "{}", log());
}
