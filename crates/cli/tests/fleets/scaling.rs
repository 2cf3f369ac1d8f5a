//! Scaling up and down: offers, boot timeouts, budgets, stopped machines, registration tokens, spot interruptions.

use super::*;

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

/// A provider slow to answer (a program that waits for the instance's new state): a pass that
/// read the machines before a start was recorded sees the machine listed running, its agent
/// from before the stop not back yet. Still one machine: the stopped one, started again, takes
/// the job, and no pass's older view is written over the start's record.
#[test]
fn a_start_answered_after_the_machine_runs_makes_no_second_machine() {
    let f = start("idle_action = \"stop\"", "stop = true\nanswer_delay_s = 1.5\nboot_delay_s = 3");
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo first\n");
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded", "{:#}", f.status());
    wait_until_or(
        "the idle machine stopped",
        T,
        || f.machines().iter().any(|m| m["state"] == "stopped"),
        || format!("{:#}", f.status()),
    );
    let p = api.submit("steps:\n  - key: b\n    gpus: 1\n    command: echo second\n");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{:#}", f.status());
    // Passes go on while the start is answered: a second machine would be made by now.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(f.made().len(), 1, "started again, not made anew: {:#?}\n{:#}", f.made(), f.status());
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
