//! Providers that hang, lie or misbehave, and machines the store and the provider disagree on.

use super::*;

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
