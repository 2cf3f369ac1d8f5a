//! Exactly once under crashes, one defect at a time (issue #10): an agent killed just after
//! its jobs started, the coordinator killed while results and output are on their way, an
//! agent frozen past `lost_after`. Real processes, SIGKILL, a ledger outside gpuci.
//! (`chaos.rs` does the same at random, at scale; `protocol_model.rs` checks the protocol's
//! interleavings.)
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use std::collections::BTreeMap;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// How often each job id appears in the ledger.
fn starts(ledger: &std::path::Path) -> BTreeMap<i64, u32> {
    let mut n = BTreeMap::new();
    for l in std::fs::read_to_string(ledger).unwrap_or_default().lines() {
        if let Ok(id) = l.trim().parse::<i64>() {
            *n.entry(id).or_default() += 1;
        }
    }
    n
}

#[test]
fn an_agent_killed_just_after_its_jobs_started_runs_none_of_them_again() {
    let dir = tempdir();
    let ledger = shared_dir(&dir, "ledger").join("started");
    // Every job (each its own uid) appends to it.
    std::fs::write(&ledger, "").unwrap();
    std::fs::set_permissions(&ledger, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let server = Server::start(&dir.path().join("server"), "30s");
    let args = ["--slots", "16", "--isolation", isolation(), "--allow-unsandboxed"];
    let mut agent = Agent::start(&server, &dir.path().join("agent"), "a1", &args);
    let api = server.api();
    api.wait_agents(1, T);
    let mut yaml = String::from("steps:\n");
    for i in 0..16 {
        yaml.push_str(&format!(
            "  - key: s{i}\n    sandbox: none\n    command: \"echo $GPUCI_JOB_ID >> {}; sleep 1\"\n",
            ledger.display()
        ));
    }
    let p = api.submit(&yaml);
    // Killed when half have started: some of their starts have not reached the coordinator.
    wait_until("8 jobs to start", T, || starts(&ledger).len() >= 8);
    agent.kill9();
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &args);
    let done = api.wait_pipeline(p.id, Duration::from_secs(120));
    let ran = starts(&ledger);
    for (id, n) in &ran {
        assert_eq!(*n, 1, "job {id} started {n} times: {:#?}", done.jobs);
    }
    assert_eq!(done.jobs.len(), 16, "no retry was asked for: {:#?}", done.jobs);
    for j in &done.jobs {
        assert!(j.state.is_terminal(), "{j:#?}");
        if ran.contains_key(&j.id) {
            assert!(j.started_at_ms.is_some(), "job {} ran and has no start time: {j:#?}", j.id);
        }
        match j.state {
            JobState::Succeeded => assert!(ran.contains_key(&j.id)),
            JobState::Lost => assert!(j.reason.contains("agent stopped"), "{}", j.reason),
            _ => panic!("{j:#?}"),
        }
    }
    wait_until("no job holds a slot", T, || api.agents()[0].running.is_empty());
}

#[test]
fn an_agent_whose_journal_was_emptied_refuses_to_start_and_once_reset_runs_none_of_its_jobs_again() {
    let dir = tempdir();
    let ledger = shared_dir(&dir, "ledger").join("started");
    std::fs::write(&ledger, "").unwrap();
    std::fs::set_permissions(&ledger, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let server = Server::start(&dir.path().join("server"), "30s");
    let agent_dir = dir.path().join("agent");
    let args = ["--slots", "16", "--isolation", isolation(), "--allow-unsandboxed"];
    let mut agent = Agent::start(&server, &agent_dir, "a1", &args);
    let api = server.api();
    api.wait_agents(1, T);
    let mut yaml = String::from("steps:\n");
    for i in 0..16 {
        yaml.push_str(&format!(
            "  - key: s{i}\n    sandbox: none\n    command: \"echo $GPUCI_JOB_ID >> {}; sleep 1\"\n",
            ledger.display()
        ));
    }
    let p = api.submit(&yaml);
    wait_until("8 jobs to start", T, || starts(&ledger).len() >= 8);
    agent.kill9();
    // The journal is emptied while the agent is down (a disk fault, a careless clean-up).
    std::fs::write(agent_dir.join("journal"), "").unwrap();

    // Started again as before, it refuses, saying what is wrong and what to do.
    let mut again = std::process::Command::new(BIN)
        .args(["agent", "--server", &server.url, "--data-dir"])
        .arg(&agent_dir)
        .args(["--name", "a1"])
        .args(args)
        .env("GPUCI_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + T;
    let status = loop {
        if let Some(st) = again.try_wait().unwrap() {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = again.kill();
            panic!("the agent started with an emptied journal; jobs run again: {:?}", starts(&ledger));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut again.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("journal") && err.contains("--reset-journal"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let before = api.pipeline(p.id);
    assert!(before.jobs.iter().all(|j| j.state != JobState::Queued), "nothing was requeued meanwhile: {before:#?}");

    // Reset by the operator: every job it held is given up, none runs a second time.
    let _agent = Agent::start(&server, &agent_dir, "a1", &[&args[..], &["--reset-journal"]].concat());
    let done = api.wait_pipeline(p.id, Duration::from_secs(120));
    let ran = starts(&ledger);
    for (id, n) in &ran {
        assert_eq!(*n, 1, "job {id} started {n} times: {:#?}", done.jobs);
    }
    assert_eq!(done.jobs.len(), 16, "no retry was asked for: {:#?}", done.jobs);
    for j in &done.jobs {
        match j.state {
            JobState::Succeeded => assert!(ran.contains_key(&j.id), "{j:#?}"),
            JobState::Lost if ran.contains_key(&j.id) => {}
            JobState::Lost => assert!(j.reason.contains("--reset-journal"), "a job given up says why: {}", j.reason),
            _ => panic!("{j:#?}"),
        }
    }
    wait_until("no job holds a slot", T, || api.agents()[0].running.is_empty());
}

#[test]
fn the_coordinator_killed_while_results_and_output_are_on_their_way_loses_neither() {
    let dir = tempdir();
    let mut server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--slots", "9", "--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    // One job floods its log while eight short ones print numbered lines and end.
    let mut yaml = String::from(
        "steps:\n  - key: flood\n    command: \"head -c 20000000 /dev/zero | tr '\\\\0' x | fold -w 1000\"\n",
    );
    for i in 0..8 {
        yaml.push_str(&format!("  - key: s{i}\n    command: \"seq 1 3000 | sed 's/^/line /'\"\n"));
    }
    let p = api.submit(&yaml);
    wait_until("the flood to be under way", T, || {
        api.pipeline(p.id).jobs.iter().filter(|j| j.state == JobState::Running).count() >= 2
    });
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(300));
        server.restart_hard();
    }
    let api = server.api();
    let done = api.wait_pipeline(p.id, Duration::from_secs(180));
    for j in &done.jobs {
        assert_eq!(j.state, JobState::Succeeded, "{j:#?}");
        assert!(j.started_at_ms.is_some(), "{j:#?}");
    }
    let want: Vec<String> = (1..=3000).map(|i| format!("line {i}")).collect();
    for j in done.jobs.iter().filter(|j| j.step_key.starts_with('s')) {
        let log = api.log_text(j.id);
        let got: Vec<&str> = log.lines().filter(|l| l.starts_with("line ")).collect();
        let first_wrong = got.iter().zip(&want).position(|(g, w)| g != w);
        assert!(
            got.len() == want.len() && first_wrong.is_none(),
            "job {}: {} of {} lines, first out of place at {first_wrong:?}; its gpuci lines: {:?}",
            j.id,
            got.len(),
            want.len(),
            api.log_system(j.id)
        );
    }
    wait_until("no job holds a slot", T, || api.agents()[0].running.is_empty());
}

#[test]
fn a_frozen_agent_is_lost_after_lost_after_not_twice_that() {
    let (_dir, _server, agent, api) = one_agent("3s", "frozen", &["--isolation", isolation()]);
    let p = api.submit("steps:\n  - key: a\n    command: sleep 3007771\n");
    let id = p.jobs[0].id;
    api.wait_job(id, "running", T, |j| j.state == JobState::Running);
    let pid = nix::unistd::Pid::from_raw(agent.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let j = api.wait_job(id, "lost", T, |j| j.state.is_terminal());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    assert_eq!(j.state, JobState::Lost, "{j:#?}");
    // "… stopped sending heartbeats (last seen Ns ago)": N is lost_after (3s), give or take
    // the 1s reaper tick; before the fix it was twice lost_after.
    let secs: u64 = j.reason.split("last seen ").nth(1).and_then(|r| r.split('s').next()?.parse().ok()).unwrap();
    assert!(secs < 6, "declared lost {secs}s after the last heartbeat, lost_after is 3s: {}", j.reason);
    wait_until("the agent to kill the job it was told about", T, || processes_with("3007771").is_empty());
}

/// Regression (outsider attack): an agent killed with a job running, its coordinator started
/// afresh (`--new-database`, another port), a job submitted there, the agent restarted: it
/// registered anew and its journal's result for the *old* job 1 ended the *new* job 1 `lost`
/// ("the agent stopped while the job ran"), though that job had never run. Held jobs belong to
/// the registration that assigned them; with a new registration they are given up.
#[test]
fn a_result_held_for_an_earlier_registration_never_ends_a_job_of_a_new_database() {
    held_result_after_a_new_registration(false);
}

/// Regression (outsider attack): the same, with the coordinator back at the *same* address and
/// the agent's `agent.json` moved aside, so it registered anew there: its held result for the
/// old job 1 was applied to the new job 1 once that was assigned to it (the job "ran" without
/// running). Any new registration gives up what the journal held for the earlier one.
#[test]
fn a_result_held_for_an_earlier_registration_never_ends_a_job_at_the_same_address() {
    held_result_after_a_new_registration(true);
}

fn held_result_after_a_new_registration(same_address: bool) {
    let dir = tempdir();
    let server_dir = dir.path().join("server");
    let agent_dir = dir.path().join("agent");
    let mut server = Server::start(&server_dir, "30s");
    let args = ["--isolation", isolation()];
    let mut agent = Agent::start(&server, &agent_dir, "a1", &args);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: long\n    command: sleep 600\n");
    let old = p.jobs[0].id;
    api.wait_job(old, "running", T, |j| j.state == JobState::Running);
    agent.kill9();
    server.kill9();

    // Started over as an operator does it: the old database moved away, `--new-database`.
    for f in ["gpuci.db", "gpuci.db-wal", "gpuci.db-shm"] {
        let _ = std::fs::remove_file(server_dir.join(f));
    }
    let mut args2 = server.args.clone();
    args2.push("--new-database".into());
    let listen = if same_address {
        std::fs::rename(agent_dir.join("agent.json"), dir.path().join("agent.json.moved")).unwrap();
        server.url.trim_start_matches("http://").to_string()
    } else {
        "127.0.0.1:0".to_string()
    };
    let server = Server::start_on(&server_dir, &listen, args2);
    let api = server.api();
    let p = api.submit("steps:\n  - key: fresh\n    command: echo fresh-job-ran\n");
    let fresh = p.jobs[0].id;
    assert_eq!(fresh, old, "the test needs the new database to reuse the old job's id");
    let _agent = Agent::start(&server, &agent_dir, "a1", &args);
    let p = api.wait_pipeline(p.id, T);
    let j = &p.jobs[0];
    assert_eq!(j.state, JobState::Succeeded, "the new job was ended by the old one's result: {j:?}");
    assert!(api.log_text(fresh).contains("fresh-job-ran"));
}

/// Regression (outsider attack): two agents started on one data dir both ran, rewrote one
/// journal and knocked each other off the coordinator (305 reconnects in 40 s); their jobs
/// ended `lost` for reasons that were not true. The second is now refused at start.
#[test]
fn a_second_agent_on_the_same_data_dir_is_refused() {
    let (dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    // The lock is on the directory: removing the file that names the holder changes nothing.
    std::fs::remove_file(dir.path().join("agent/lock")).unwrap();
    let mut child = std::process::Command::new(BIN)
        .args(["agent", "--server", &server.url, "--registration-token", &server.registration_token(), "--name", "a2"])
        .arg("--data-dir")
        .arg(dir.path().join("agent"))
        .args(["--isolation", isolation()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a second agent on the same data dir ran");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "the second agent ran: {err}");
    assert!(err.contains("another agent") && err.contains("uses the data dir"), "{err}");
    // The first is undisturbed.
    let p = api.submit("steps:\n  - key: ok\n    command: echo still-fine\n");
    assert_eq!(api.wait_pipeline(p.id, T).jobs[0].state, JobState::Succeeded);
    assert_eq!(api.agents().len(), 1);
}

/// Regression (outsider attack): a coordinator that did not run for longer than `lost_after`
/// (SIGSTOP here; a paused VM or a blocked disk alike) declared its agents lost the moment it
/// ran again, though they had sent heartbeats all along, and killed every running job.
#[test]
fn a_stalled_coordinator_does_not_declare_its_healthy_agents_lost() {
    let (_dir, server, _agent, api) = one_agent("2s", "a1", &["--isolation", isolation()]);
    let p = api.submit("steps:\n  - key: long\n    command: [\"sleep 5\", \"echo survived-the-stall\"]\n");
    let id = p.jobs[0].id;
    api.wait_job(id, "running", T, |j| j.state == JobState::Running);
    let pid = nix::unistd::Pid::from_raw(server.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    std::thread::sleep(Duration::from_secs(4));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let p = api.wait_pipeline(p.id, T);
    assert_eq!(p.jobs[0].state, JobState::Succeeded, "{:?}", p.jobs[0]);
    assert!(api.log_text(id).contains("survived-the-stall"));
}

/// Regression (outsider attack): a job ended in the store by another writer (a second
/// coordinator on the database, an operator) while its agent ran it. Its result could never be
/// recorded; the coordinator closed the agent's connection to have it sent again, for ever
/// (seven reconnects a second), and the agent's later events were stuck behind it. The stored
/// end stands and the result is acknowledged; the agent's next job runs and is recorded.
#[test]
fn a_result_for_a_job_already_ended_in_the_store_is_acknowledged_not_refused_for_ever() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let p = api.submit("steps:\n  - key: a\n    command: sleep 2; echo first\n");
    let id = p.jobs[0].id;
    api.wait_job(id, "running", T, |j| j.state == JobState::Running);
    let db = server.data_dir.join("gpuci.db");
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&db).busy_timeout(Duration::from_secs(10));
        let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts).await.unwrap();
        sqlx::query(
            "UPDATE jobs SET state = 'cancelled', reason = 'ended by an operator', finished_at_ms = 1 WHERE id = ?",
        )
        .bind(id)
        .execute(&mut conn)
        .await
        .unwrap();
    });
    std::thread::sleep(Duration::from_secs(3)); // the job ends on the agent; its result is sent
    let q = api.submit("steps:\n  - key: b\n    command: echo second\n");
    let done = api.wait_pipeline(q.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{:?}", done.jobs[0]);
    let first = api.pipeline(p.id).jobs[0].clone();
    assert_eq!((first.state, first.reason.as_str()), (JobState::Cancelled, "ended by an operator"));
    assert_eq!(api.agents()[0].state, "connected");
}

/// Regression (outsider attack): an agent whose log could not be written (stderr on a full
/// disk) panicked at the first failed write and its jobs ended `lost`. It keeps working; only
/// the log lines are gone.
#[test]
fn an_agent_whose_log_cannot_be_written_keeps_running_its_jobs() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let mut child = std::process::Command::new(BIN)
        .args(["agent", "--server", &server.url, "--registration-token", &server.registration_token(), "--name", "a1"])
        .arg("--data-dir")
        .arg(dir.path().join("agent"))
        .args(["--isolation", isolation()])
        .env("GPUCI_LOG", "debug")
        .stdout(std::process::Stdio::null())
        .stderr(full)
        .spawn()
        .unwrap();
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: a\n    command: echo fine\n");
    let j = api.wait_job(p.jobs[0].id, "finished", T, |j| j.state.is_terminal());
    let alive = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(j.state, JobState::Succeeded, "{j:?}");
    assert!(alive, "the agent died");
}

/// Regression (outsider attack): the coordinator's database restored from a backup hands out
/// job ids again. The agent's connection remembered an old job of the same id as "not this
/// agent's" (its late lines were dropped, rightly), and then dropped every line of the new
/// job of that id, which ended `succeeded` with an empty log.
#[test]
fn after_a_restored_backup_a_new_job_with_an_old_id_keeps_its_log() {
    let dir = tempdir();
    let server_dir = dir.path().join("server");
    let mut server = Server::start(&server_dir, "30s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: one\n    command: echo one\n");
    api.wait_pipeline(p.id, T);
    // The backup: taken with the coordinator stopped.
    server.kill9();
    let backup = dir.path().join("backup");
    std::fs::create_dir_all(&backup).unwrap();
    let files = ["gpuci.db", "gpuci.db-wal", "gpuci.db-shm"];
    for f in files {
        let _ = std::fs::copy(server_dir.join(f), backup.join(f));
    }
    let listen = server.url.trim_start_matches("http://").to_string();
    let mut server = Server::start_on(&server_dir, &listen, server.args.clone());
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: old\n    command: echo old-two; sleep 300\n");
    let old = p.jobs[0].id;
    api.wait_job(old, "running", T, |j| j.state == JobState::Running);
    // Restored: job `old` never existed; its id is handed out again.
    server.kill9();
    for f in files {
        let _ = std::fs::remove_file(server_dir.join(f));
        let _ = std::fs::copy(backup.join(f), server_dir.join(f));
    }
    let server = Server::start_on(&server_dir, &listen, server.args.clone());
    let api = server.api();
    api.wait_agents(1, T);
    std::thread::sleep(Duration::from_secs(2)); // the agent gives up the old job; its lines come
    let p = api.submit("steps:\n  - key: new\n    command: echo new-two\n");
    let fresh = p.jobs[0].id;
    assert_eq!(fresh, old, "the test needs the restored database to hand out the old id");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{:?}", done.jobs[0]);
    let log = api.log_text(fresh);
    assert!(log.contains("new-two") && !log.contains("old-two"), "{log}");
}

/// A machine taken back (a Slurm `scancel`, a pod deleted): the engine's SIGTERM reaches the
/// job and the agent at about the same time, and the job's death often reaches the agent
/// first. Under bubblewrap a job killed by SIGTERM ends with status 143 (128 + the signal),
/// not "killed by a signal". The job did nothing wrong: it is queued again, not failed (a CI
/// finding: it failed whenever its death reached the agent before the agent's own SIGTERM).
/// Here the job kills itself with SIGTERM and the notice comes just after its death.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_killed_by_the_engines_sigterm_just_before_the_agent_hears_of_it_is_queued_again() {
    let (notice_tx, notice_rx) = tokio::sync::watch::channel(None::<String>);
    let c = InProc::start_configured(
        "fakehost-taken-back",
        |_| {},
        |a| {
            a.taken_back = Some(notice_rx);
            a.end_when_taken_back = true;
        },
    )
    .await;
    let api = c.api_in_blocking();
    let step = "steps:\n  - key: a\n    gpus: 1\n    command: echo dying; sleep 0.5; kill -TERM $$; sleep 30\n";
    let first = blocking(move || {
        let api = api();
        let p = api.submit(step);
        let id = p.jobs[0].id;
        api.wait_job(id, "its output", T, |_| api.log_text(id).contains("dying"));
        id
    })
    .await;
    // The job dies 0.5 s after its line; the agent hears of its machine's end 0.3 s after that.
    tokio::time::sleep(Duration::from_millis(800)).await;
    notice_tx.send(Some("Slurm is ending allocation 7 (scancel)".into())).unwrap();
    let api = c.api_in_blocking();
    let (old, next) = blocking(move || {
        let api = api();
        let old = api.wait_job(first, "ended", T, |j| j.state.is_terminal());
        let pipeline = api.pipeline(old.pipeline_id);
        (old, pipeline.jobs.into_iter().find(|j| j.id != first))
    })
    .await;
    assert_eq!(old.state, JobState::Lost, "taken back, not failed: {old:#?}");
    assert!(old.reason.contains("taken back"), "{}", old.reason);
    let next = next.expect("queued again as its next attempt");
    assert_eq!(next.attempt, 2, "{next:#?}");
    c.stop().await;
}

/// A coordinator that stops answering without closing the connection (frozen with SIGSTOP, a
/// VM paused, its host cut off): the agent leaves it after three heartbeats' worth of silence
/// (at least 10 s) and connects again, which a load balancer sends to the coordinator that
/// leads now. Before, it waited on the silent connection for ever, and a standby that took
/// over ended the agent's running jobs `lost` and ran them again (outsider attack). Played by
/// a bare WebSocket server that welcomes the agent and then reads nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_leaves_a_coordinator_that_stopped_answering_and_connects_again() {
    use futures::{SinkExt, StreamExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let dir = tempdir();
    let data = dir.path().join("agent");
    std::fs::create_dir_all(&data).unwrap();
    let identity = serde_json::json!({ "agent_id": "a-1", "credential": "c", "server": url });
    std::fs::write(data.join("agent.json"), identity.to_string()).unwrap();
    let mut ac = gpuci_agent::Config::new(url.clone(), data);
    ac.name = "silent-test".into();
    // Registered before (its agent.json above), no journal yet: it starts with a new one.
    ac.reset_journal = true;
    ac.slots = 1;
    ac.isolation = gpuci_agent::IsolationPolicy::Auto;
    let gpus = gpuci_gpu::SimulatedGpus::from_spec("1xH100-80GB", "silent").unwrap().gpus().to_vec();
    ac.gpu_backend = Some(std::sync::Arc::new(gpuci_gpu::FakeGpus::new(gpus)));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut agent = tokio::spawn(gpuci_agent::run(ac, shutdown.clone()));
    // The first connection: welcomed, then never read again (pings unanswered).
    let first = tokio::select! {
        a = accept_channel(&listener) => a,
        r = &mut agent => panic!("the agent ended before it connected: {r:?}"),
    };
    let tcp = first;
    let mut ws = tokio_tungstenite::accept_async(tcp).await.unwrap();
    let hello = ws.next().await.unwrap().unwrap();
    assert!(hello.to_text().unwrap().contains("\"hello\""), "{hello:?}");
    let welcome = gpuci_protocol::agent::CoordinatorMessage::Welcome {
        agent_id: "a-1".into(),
        heartbeat_interval_ms: 200,
        forget: vec![],
    };
    ws.send(serde_json::to_string(&welcome).unwrap().into()).await.unwrap();
    let t0 = std::time::Instant::now();
    // A second connection, while the first is still open.
    let second = tokio::time::timeout(T, accept_channel(&listener)).await;
    let after = t0.elapsed();
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), agent).await;
    drop(ws);
    assert!(second.is_ok(), "the agent stayed on a coordinator that answered nothing for {after:?}");
    eprintln!("left a silent coordinator after {:.1} s", after.as_secs_f64());
}

/// The next connection that is the agent channel: an identity challenge before it (the
/// agent asks each address to prove the coordinators' key) is answered 404, as a coordinator
/// too old to have one answers (this stand-in has none).
async fn accept_channel(listener: &tokio::net::TcpListener) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    loop {
        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut head = [0u8; 64];
        let mut n = 0;
        for _ in 0..100 {
            n = tcp.peek(&mut head).await.unwrap_or(0);
            if n >= 20 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if head[..n].starts_with(b"GET /api/v1/identity") {
            let _ = tcp.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
            continue;
        }
        return tcp;
    }
}

/// Group commit (issue 29): a placement pass stores all its assignments in one transaction
/// and sends none before it commits. Here the coordinator's database refuses every
/// assignment (a trigger, as a full disk or a fenced leader would refuse the whole commit):
/// no job reaches the agent, each says why it waits, and once the database takes writes
/// again each runs exactly once, with no other event needed to place it again.
#[test]
fn a_placement_pass_whose_commit_fails_sends_nothing_and_its_jobs_run_once_afterwards() {
    let dir = tempdir();
    let ledger = shared_dir(&dir, "ledger").join("started");
    std::fs::write(&ledger, "").unwrap();
    std::fs::set_permissions(&ledger, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let server = Server::start(&dir.path().join("server"), "30s");
    let db = server.data_dir.join("gpuci.db");
    let sql = |sql: &'static str| {
        let db = db.clone();
        tokio::runtime::Runtime::new().unwrap().block_on(async move {
            let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&db).busy_timeout(Duration::from_secs(10));
            let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts).await.unwrap();
            sqlx::query(sql).execute(&mut conn).await.unwrap();
        })
    };
    sql("CREATE TRIGGER refuse_assignments BEFORE UPDATE OF state ON jobs WHEN NEW.state = 'assigned' \
         BEGIN SELECT RAISE(ABORT, 'injected: assignments refused'); END");
    let args = ["--slots", "4", "--isolation", isolation(), "--allow-unsandboxed"];
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &args);
    let api = server.api();
    api.wait_agents(1, T);
    let mut yaml = String::from("steps:\n");
    for i in 0..4 {
        yaml.push_str(&format!(
            "  - key: s{i}\n    sandbox: none\n    command: \"echo $GPUCI_JOB_ID >> {}\"\n",
            ledger.display()
        ));
    }
    let p = api.submit(&yaml);
    for j in &p.jobs {
        let j = api.wait_job(j.id, "its refused placement", T, |j| j.reason.contains("could not be stored"));
        assert_eq!(j.state, JobState::Queued, "{j:?}");
        assert!(j.reason.contains("injected: assignments refused"), "{}", j.reason);
    }
    // Passes keep being refused meanwhile (each tick); none may have reached the agent.
    std::thread::sleep(Duration::from_secs(2));
    assert!(starts(&ledger).is_empty(), "an assignment that was never stored ran: {:?}", starts(&ledger));
    assert!(p.jobs.iter().all(|j| api.job(j.id).state == JobState::Queued));
    sql("DROP TRIGGER refuse_assignments");
    let done = api.wait_pipeline(p.id, T);
    let ran = starts(&ledger);
    assert_eq!(ran.len(), 4, "{ran:?} {:#?}", done.jobs);
    for j in &done.jobs {
        assert_eq!(j.state, JobState::Succeeded, "{j:#?}");
        assert_eq!(ran.get(&j.id), Some(&1), "job {} ran {:?} times", j.id, ran.get(&j.id));
    }
    assert_eq!(done.jobs.len(), 4, "{:#?}", done.jobs);
}

/// Group commit (issue 29): agents' starts are stored in one transaction per run of commands
/// and acknowledged only after it commits. Here the database refuses every start (a trigger):
/// nothing is acknowledged, the agent sends its events again, and once the database takes
/// writes again each job's start and result are stored once and no job ran twice.
#[test]
fn starts_whose_commit_fails_are_not_acknowledged_and_are_stored_once_when_sent_again() {
    let dir = tempdir();
    let ledger = shared_dir(&dir, "ledger").join("started");
    std::fs::write(&ledger, "").unwrap();
    std::fs::set_permissions(&ledger, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let server = Server::start(&dir.path().join("server"), "30s");
    let db = server.data_dir.join("gpuci.db");
    let sql = |sql: &'static str| {
        let db = db.clone();
        tokio::runtime::Runtime::new().unwrap().block_on(async move {
            let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&db).busy_timeout(Duration::from_secs(10));
            let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts).await.unwrap();
            sqlx::query(sql).execute(&mut conn).await.unwrap();
        })
    };
    sql("CREATE TRIGGER refuse_starts BEFORE UPDATE OF state ON jobs WHEN NEW.state = 'running' \
         BEGIN SELECT RAISE(ABORT, 'injected: starts refused'); END");
    let args = ["--slots", "4", "--isolation", isolation(), "--allow-unsandboxed"];
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &args);
    let api = server.api();
    api.wait_agents(1, T);
    let mut yaml = String::from("steps:\n");
    for i in 0..4 {
        yaml.push_str(&format!(
            "  - key: s{i}\n    sandbox: none\n    command: \"echo $GPUCI_JOB_ID >> {}\"\n",
            ledger.display()
        ));
    }
    let p = api.submit(&yaml);
    wait_until("every job to run on the agent", T, || starts(&ledger).len() == 4);
    // Their starts (and so their results, which follow them) cannot be stored meanwhile.
    std::thread::sleep(Duration::from_secs(2));
    for j in &p.jobs {
        let j = api.job(j.id);
        assert_eq!(j.state, JobState::Assigned, "a start the store refused counts: {j:?}");
    }
    sql("DROP TRIGGER refuse_starts");
    let done = api.wait_pipeline(p.id, T);
    let ran = starts(&ledger);
    assert_eq!(done.jobs.len(), 4, "{:#?}", done.jobs);
    for j in &done.jobs {
        assert_eq!(j.state, JobState::Succeeded, "{j:#?}");
        assert!(j.started_at_ms.is_some(), "{j:#?}");
        assert_eq!(ran.get(&j.id), Some(&1), "job {} ran {:?} times", j.id, ran.get(&j.id));
    }
}
