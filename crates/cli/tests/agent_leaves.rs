//! `gpuci agent --leave-after-unreachable`: an agent on a machine gpuci created gives the
//! machine up when the coordinator is gone, so a dead coordinator does not leave GPUs billing;
//! an agent not told to keeps waiting for it. Real processes; the coordinator dies by SIGKILL.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use std::process::Child;
use std::time::{Duration, Instant};

/// `gpuci agent`'s exit status when it leaves (`cmd::agent::EXIT_LEFT`, in `--help`).
const EXIT_LEFT: i32 = 75;

/// Generous: the agent is due to leave 2 s after the coordinator died; this only bounds the wait.
const LEAVE_WITHIN: Duration = Duration::from_secs(30);

/// The agent's exit status once it has exited, or the reason it did not within `limit`.
fn exit_within(child: &mut Child, limit: Duration) -> Result<Option<i32>, String> {
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Ok(status.code());
        }
        if t0.elapsed() > limit {
            return Err(format!("still running after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn still_running(child: &mut Child) -> bool {
    child.try_wait().unwrap().is_none()
}

#[test]
fn an_agent_told_to_leave_exits_and_runs_its_command_when_the_coordinator_is_gone_one_not_told_stays() {
    let dir = tempdir();
    let mut server = Server::start(&dir.path().join("server"), "30s");
    let marker = dir.path().join("left");
    let on_leave = format!("touch '{}'", marker.display());
    let mut leaver = Agent::start(
        &server,
        &dir.path().join("leaver"),
        "leaver",
        &["--isolation", isolation(), "--leave-after-unreachable", "2s", "--on-leave", &on_leave],
    );
    let mut stayer = Agent::start(&server, &dir.path().join("stayer"), "stayer", &["--isolation", isolation()]);
    server.api().wait_agents(2, Duration::from_secs(60));
    // Connected, and the coordinator is there: the flag alone does nothing.
    assert!(still_running(&mut leaver.child) && !marker.exists());

    server.kill9();
    let code = exit_within(&mut leaver.child, LEAVE_WITHIN).unwrap();
    assert_eq!(code, Some(EXIT_LEFT), "the leaving agent's exit status");
    assert!(marker.exists(), "the on-leave command did not run");

    // By now the coordinator has been gone longer than the other agent's would-be limit;
    // a few more seconds of it, and that agent still waits for the coordinator.
    std::thread::sleep(Duration::from_secs(3));
    assert!(still_running(&mut stayer.child), "an agent without --leave-after-unreachable exited");
    stayer.kill9();
}

/// A running job keeps the machine (its result can still reach a coordinator that returns);
/// the agent leaves once the job has ended and the limit has passed again.
#[test]
fn a_running_job_keeps_a_leaving_agent_until_it_ends() {
    let dir = tempdir();
    let mut server = Server::start(&dir.path().join("server"), "30s");
    let marker = dir.path().join("left");
    let on_leave = format!("touch '{}'", marker.display());
    let mut agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", isolation(), "--leave-after-unreachable", "2s", "--on-leave", &on_leave],
    );
    let api = server.api();
    api.wait_agents(1, Duration::from_secs(60));
    let p = api.submit("steps:\n  - key: long\n    command: [echo started, sleep 12]\n");
    let j = api.wait_job(p.jobs[0].id, "running", Duration::from_secs(60), |j| {
        j.state == JobState::Running || j.state.is_terminal()
    });
    assert_eq!(j.state, JobState::Running, "the job did not start: {j:?}");

    server.kill9();
    // The job sleeps 12 s from before the kill: 6 s after it, it surely still runs, and the
    // coordinator has been gone three times the limit.
    std::thread::sleep(Duration::from_secs(6));
    assert!(still_running(&mut agent.child), "the agent left while its job ran");
    assert!(!marker.exists(), "the on-leave command ran while a job ran");

    let code = exit_within(&mut agent.child, Duration::from_secs(60)).unwrap();
    assert_eq!(code, Some(EXIT_LEFT));
    assert!(marker.exists(), "the on-leave command did not run");
}
