//! A job's life and the processes around it: cancel, timeouts, coordinator and agent crashes, lost agents, slots, and the API's answers to bad requests.

use super::*;

#[test]
fn cancelling_a_running_job_kills_its_whole_process_tree() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let p = api.submit(
        r#"
steps:
  - key: long
    command:
      - (setsid sleep 3001771 &)
      - sleep 3001772 &
      - echo started
      - sleep 3001773
"#,
    );
    let id = p.jobs[0].id;
    api.wait_job(id, "running with output", T, |j| j.state == JobState::Running);
    wait_until("the job's processes", T, || processes_with("300177").len() >= 3);
    let j = api.cancel(id);
    assert!(j.reason.contains("cancel"), "{}", j.reason);
    let j = api.wait_job(id, "cancelled", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Cancelled);
    assert_eq!(j.reason, "cancelled by user");
    wait_until("every process of the job to be gone", Duration::from_secs(15), || processes_with("300177").is_empty());
    // Cancelling again is a conflict with a message, not a crash.
    let r = api.raw().post(format!("{}/api/v1/jobs/{id}/cancel", api.url)).bearer_auth(&server.token).send().unwrap();
    assert_eq!(r.status(), 409);
}

#[test]
fn a_job_over_its_timeout_ends_timed_out_and_leaves_nothing_behind() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let p = api.submit("steps:\n  - key: slow\n    timeout: 1s\n    command: [\"sleep 3002991 &\", sleep 3002992]\n");
    let j = api.wait_job(p.jobs[0].id, "finished", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::TimedOut);
    assert!(j.reason.contains("timeout of 1s"), "{}", j.reason);
    wait_until("the job's processes to be gone", Duration::from_secs(15), || processes_with("300299").is_empty());
}

#[test]
fn coordinator_killed_and_restarted_mid_run_loses_nothing_and_runs_nothing_twice() {
    let dir = tempdir();
    let ledger = shared_dir(&dir, "ledger");
    let mut server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--slots", "3", "--isolation", isolation(), "--allow-unsandboxed"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    // Each run appends to a ledger outside the sandbox (sandbox: none) so double runs show.
    let mut yaml = String::from("steps:\n");
    for i in 0..9 {
        yaml.push_str(&format!(
            "  - key: s{i}\n    sandbox: none\n    command: [\"echo run >> {}/s{i}\", sleep 1]\n",
            ledger.display()
        ));
    }
    let p = api.submit(&yaml);
    wait_until("some jobs to run", T, || std::fs::read_dir(&ledger).unwrap().count() >= 2);
    server.restart_hard();
    let api = server.api();
    let done = api.wait_pipeline(p.id, Duration::from_secs(120));
    assert_eq!(done.state, "succeeded", "{:#?}", done.jobs);
    assert_eq!(done.jobs.len(), 9, "no retries or duplicates were created");
    for i in 0..9 {
        let runs = std::fs::read_to_string(ledger.join(format!("s{i}"))).unwrap_or_default();
        assert_eq!(runs.lines().count(), 1, "step s{i} ran {} times", runs.lines().count());
    }
    api.wait_agents(1, T);
}

#[test]
fn an_agent_killed_with_sigkill_has_its_job_end_lost_with_the_reason() {
    let (dir, server, mut agent, api) = one_agent("2s", "doomed", &["--isolation", isolation()]);
    let p = api.submit("steps:\n  - key: a\n    command: sleep 3003331\n  - key: b\n    retry: {count: 1, on: [lost]}\n    command: sleep 3003332\n");
    for j in &p.jobs {
        api.wait_job(j.id, "running", T, |j| j.state == JobState::Running);
    }
    agent.kill9();
    let a = api.wait_job(p.jobs[0].id, "lost", T, |j| j.state.is_terminal());
    assert_eq!(a.state, JobState::Lost);
    assert!(a.reason.contains("agent doomed stopped sending heartbeats"), "{}", a.reason);
    // The step with `retry: on: [lost]` is queued again as a new attempt.
    // The reaper ends the agent's jobs one after the other: wait for this one too.
    let b = api.wait_job(p.jobs[1].id, "lost", T, |j| j.state.is_terminal());
    assert_eq!(b.state, JobState::Lost);
    assert!(b.reason.contains("retrying (attempt 2 of 2)"), "{}", b.reason);
    let again = api.pipeline(p.id).jobs.into_iter().find(|j| j.step_key == "b" && j.attempt == 2).expect("retry job");
    assert_eq!(again.state, JobState::Queued);
    let agents = api.agents();
    assert_eq!(agents[0].state, "lost");
    // The agent comes back; whatever its dead predecessor left running (bwrap's die-with-parent
    // normally takes it along) is swept before it runs anything, and the retry runs on it.
    let _agent = Agent::start(&server, &dir.path().join("agent"), "doomed", &["--isolation", isolation()]);
    wait_until_or(
        "the lost jobs' processes to be gone",
        Duration::from_secs(15),
        || processes_with("3003331").is_empty(),
        || format!("{:#?}", processes_with("3003331")),
    );
    api.wait_job(again.id, "running again", T, |j| j.state == JobState::Running);
}

#[test]
fn the_api_answers_bad_requests_with_4xx_and_a_message() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let http = reqwest::blocking::Client::new();
    let url = &server.url;
    // No token, wrong token.
    assert_eq!(http.get(format!("{url}/api/v1/jobs")).send().unwrap().status(), 401);
    assert_eq!(http.get(format!("{url}/api/v1/jobs")).bearer_auth("nope").send().unwrap().status(), 401);
    let auth = |r: reqwest::blocking::RequestBuilder| r.bearer_auth(&server.token);
    // Invalid pipeline: 422 with positions.
    let r = auth(http.post(format!("{url}/api/v1/pipelines")))
        .json(&serde_json::json!({"file_name": "ci.yml", "source": "steps:\n  - comand: x\n"}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 422);
    let body: serde_json::Value = r.json().unwrap();
    let errs = body["pipeline_errors"].as_array().unwrap();
    assert!(errs.iter().any(|e| e["line"] == 2 && e["field"].as_str().unwrap().contains("comand")), "{body}");
    // Not JSON, unknown fields, wrong types: 400.
    for bad in ["not json", "{\"file_name\": 1}", "{\"file_name\": \"a\", \"source\": \"\", \"extra\": 1}"] {
        let r = auth(http.post(format!("{url}/api/v1/pipelines")))
            .header("content-type", "application/json")
            .body(bad)
            .send()
            .unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let body: serde_json::Value = r.json().unwrap();
        assert!(body["error"].as_str().is_some_and(|s| !s.is_empty()));
    }
    // A `repository` that names no repository (what caches, budgets, secret scopes and the
    // public view are keyed by): 422 naming the field and what was expected, without any
    // password the text held; nothing is stored. (Regression: such a submission was accepted.)
    for bad in [
        "not a repository",
        "kernels",
        "./relative/path",
        "ftp://example.com/acme/x",
        "https://a@b@github.com/acme/x",
        "https://github.com/",
        "https://user:s3cret@example.com/acme/x y",
    ] {
        let r = auth(http.post(format!("{url}/api/v1/pipelines")))
            .json(
                &serde_json::json!({"file_name": "ci.yml", "source": "steps:\n  - command: echo\n", "repository": bad}),
            )
            .send()
            .unwrap();
        assert_eq!(r.status(), 422, "{bad}");
        let body: serde_json::Value = r.json().unwrap();
        let error = body["error"].as_str().unwrap_or_default();
        assert!(error.starts_with("repository: ") && error.contains("expected"), "{bad}: {error}");
        assert!(!error.contains("s3cret"), "{error}");
    }
    let jobs: Vec<serde_json::Value> = auth(http.get(format!("{url}/api/v1/jobs"))).send().unwrap().json().unwrap();
    assert!(jobs.is_empty(), "a refused submission stored jobs: {jobs:#?}");
    assert_eq!(auth(http.get(format!("{url}/api/v1/pipelines/1"))).send().unwrap().status(), 404);
    assert_eq!(auth(http.get(format!("{url}/api/v1/jobs/999"))).send().unwrap().status(), 404);
    assert_eq!(auth(http.get(format!("{url}/api/v1/jobs?state=bogus"))).send().unwrap().status(), 400);
    assert_eq!(auth(http.post(format!("{url}/api/v1/gpus/GPU-x/release"))).send().unwrap().status(), 409);
    // Registration needs the registration token, not the API token.
    let r = http
        .post(format!("{url}/api/v1/agents/register"))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({"name": "x"}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 401);
    // The OpenAPI document describes every endpoint.
    let doc: serde_json::Value = http.get(format!("{url}/api/v1/openapi.json")).send().unwrap().json().unwrap();
    for path in ["/api/v1/pipelines", "/api/v1/jobs/{id}/logs", "/api/v1/agents", "/api/v1/pipelines/{id}/watch"] {
        assert!(doc["paths"][path].is_object(), "openapi lacks {path}");
    }
    // Token files are private.
    use std::os::unix::fs::PermissionsExt;
    for f in ["api-token", "registration-token"] {
        let mode = std::fs::metadata(server.data_dir.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{f}");
    }
}

#[test]
fn an_agent_that_was_frozen_past_lost_after_is_told_its_jobs_ended_and_kills_them() {
    let (_dir, _server, agent, api) = one_agent("2s", "sleepy", &["--isolation", isolation()]);
    let p = api.submit("steps:\n  - key: a\n    command: sleep 3004441\n");
    let id = p.jobs[0].id;
    api.wait_job(id, "running", T, |j| j.state == JobState::Running);
    // Freeze the agent (a network partition, a stuck host): it stops sending heartbeats.
    let pid = nix::unistd::Pid::from_raw(agent.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let j = api.wait_job(id, "lost", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Lost);
    assert!(!processes_with("3004441").is_empty(), "the job still runs on the frozen host");
    // It wakes up: the coordinator tells it the job ended, and the agent kills it.
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    wait_until("the agent to kill the job it was told about", T, || processes_with("3004441").is_empty());
    api.wait_agents(1, T);
    assert_eq!(api.job(id).state, JobState::Lost, "a lost job stays lost");
}

/// The coordinator ended a GPU job while its agent was frozen (lost) and, when the agent came
/// back, told it to kill that job and gave the same GPU to the next job in one breath. The
/// next job starts only once the former one has ended on the agent (its post-job check kills
/// whatever runs on the GPU, the new job's processes too): the agent's journal orders them.
#[test]
fn a_gpu_handed_out_again_while_its_former_job_still_ends_waits_for_that_end() {
    let (_dir, _server, agent, api) =
        one_agent("2s", "one-gpu", &["--simulate-gpus", "1xL4", "--slots", "2", "--isolation", isolation()]);
    let gpu_job = |n: &str| format!("steps:\n  - key: a\n    gpus: 1\n    command: {n}\n");
    let first = api.submit(&gpu_job("sleep 3007771")).jobs[0].id;
    api.wait_job(first, "running", T, |j| j.state == JobState::Running);
    let pid = nix::unistd::Pid::from_raw(agent.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    api.wait_job(first, "lost", T, |j| j.state.is_terminal());
    let second = api.submit(&gpu_job("echo next")).jobs[0].id;
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let j = api.wait_job(second, "done", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Succeeded, "{j:?}");
    let journal = std::fs::read_to_string(agent.data_dir.join("journal")).unwrap();
    let at = |kind: &str, job: i64, field: &str| {
        journal
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|r| r["record"] == kind && r["job_id"] == job)
            .and_then(|r| r[field].as_i64())
            .unwrap_or_else(|| panic!("no {kind} record of job {job} in the journal:\n{journal}"))
    };
    let (former_ended, next_started) =
        (at("finished", first, "finished_at_us"), at("started", second, "started_at_us"));
    assert!(
        next_started >= former_ended,
        "job {second} started {} µs before job {first}, which held the GPU, had ended",
        former_ended - next_started
    );
}

/// A job's processes outside every parent-death chain (no sandbox, a `setsid` daemon) ran on
/// after their agent was killed with SIGKILL, until the agent started again. The agent's
/// reaper now ends them as soon as the agent is gone.
#[test]
fn what_a_killed_agents_job_left_running_is_ended_by_its_reaper() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "2s");
    let uids = own_job_uids(4);
    let mut agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", "none", "--slots", "1", "--job-uids", &uids],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: a\n    command: [\"setsid sleep 3006661 &\", sleep 3006662]\n");
    api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    let running = |sleep: &str| {
        processes_with(sleep).iter().any(|p| p.split_once(": ").is_some_and(|(_, c)| c.starts_with(sleep)))
    };
    wait_until("both processes", T, || running("sleep 3006661") && running("sleep 3006662"));
    agent.kill9();
    wait_until_or(
        "the reaper to end what the killed agent's job left",
        Duration::from_secs(20),
        || processes_with("300666").is_empty(),
        || format!("{:#?}", processes_with("300666")),
    );
}

#[test]
fn a_restarted_agent_sweeps_the_jobs_its_killed_predecessor_left_running() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "2s");
    // No bubblewrap, so nothing dies with the agent: only the sweep can clean up. Job uids of
    // the test's own: a default block freed by the kill is another test's agent's to lease,
    // and leasing ends what runs as it (this test's leftovers, before the restart came).
    let uids = own_job_uids(2);
    let args = ["--isolation", "none", "--slots", "1", "--job-uids", &uids];
    let mut agent = Agent::start(&server, &dir.path().join("agent"), "a1", &args);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: a\n    command: [\"setsid sleep 3005551 &\", sleep 3005552]\n");
    api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    // Each sleep itself, not the shell whose command line names both (under load the
    // backgrounded `setsid sleep` may not have started yet when the shell already has).
    let running = |sleep: &str| {
        processes_with(sleep).iter().any(|p| p.split_once(": ").is_some_and(|(_, c)| c.starts_with(sleep)))
    };
    wait_until("both processes", T, || running("sleep 3005551") && running("sleep 3005552"));
    // The agent and its reaper, together (a unit killed with SIGKILL).
    agent.kill9_with_reaper();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!processes_with("300555").is_empty(), "without a sandbox and a reaper the job outlives a killed agent");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &args);
    wait_until_or(
        "the sweep",
        T,
        || processes_with("300555").is_empty(),
        || format!("{:#?}", processes_with("300555")),
    );
}

#[test]
fn an_agent_never_runs_more_jobs_than_its_slots() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--slots", "2", "--isolation", isolation()]);
    let mut yaml = String::from("steps:\n");
    for i in 0..6 {
        yaml.push_str(&format!("  - key: s{i}\n    command: sleep 0.3\n"));
    }
    let done = api.wait_pipeline(api.submit(&yaml).id, T);
    assert_eq!(done.state, "succeeded");
    let spans: Vec<(i64, i64)> =
        done.jobs.iter().map(|j| (j.started_at_ms.unwrap(), j.finished_at_ms.unwrap())).collect();
    for (s, _) in &spans {
        let at_once = spans.iter().filter(|(a, b)| a <= s && s < b).count();
        assert!(at_once <= 2, "{at_once} jobs ran at once on a 2-slot agent: {spans:?}");
    }
}

/// Two job uids (one slot) no other test of this binary uses: `offset` (even, below 16) into
/// the block of 16 the binary takes by its pid (see `isolation.rs` for the offsets in use).
fn own_job_uids(offset: u32) -> String {
    let uid = 1_620_000_000 + (std::process::id() % 50_000) * 16 + offset;
    format!("{uid}-{}", uid + 1)
}

/// A watch opened on a pipeline with a long log sends every stored line: it sent the first
/// 100,000 of each job's only, and a `gpuci submit --wait` that follows a pipeline again after
/// a failover (it goes on after the last line it showed) never saw the rest.
#[test]
fn a_watch_sends_every_stored_line_of_a_long_log() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let p = api.submit("steps:\n  - key: long\n    command: seq 1 120000\n");
    assert_eq!(api.wait_pipeline(p.id, T).state, "succeeded");
    let body = api
        .raw()
        .get(format!("{}/api/v1/pipelines/{}/watch", api.url, p.id))
        .bearer_auth(&server.token)
        .send()
        .unwrap()
        .text()
        .unwrap();
    let seqs: Vec<i64> = body
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == "log")
        .filter_map(|v| v["line"]["seq"].as_i64())
        .collect();
    let printed = api.log_text(p.jobs[0].id).lines().filter(|l| l.parse::<u32>().is_ok()).count();
    assert_eq!(printed, 120_000, "the job's own lines stored");
    assert!(seqs.len() >= 120_000, "{} lines sent, the last {:?}", seqs.len(), seqs.last());
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "each line once, in order");
}
