//! Coordinator restarts and crashes: machines ended, kept or adopted, back-off and outages kept.

use super::*;

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
    let logs = || machine_logs(&dir.path().join("machines"));
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", logs());
    assert_eq!(done.jobs.len(), 1, "ran once, not lost and retried: {done:#?}\n{}", logs());
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
