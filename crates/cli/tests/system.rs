//! Whole-system tests: a real coordinator process and real agent processes on 127.0.0.1.

mod common;

use common::*;
use gpuci_core::job::JobState;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

#[test]
fn multi_step_pipeline_runs_in_dependency_order_and_skips_after_failure() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--slots", "4", "--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit(
        r#"
steps:
  - key: build
    command: [echo built, sleep 0.3]
  - key: test
    depends_on: [build]
    command: "echo testing; exit 3"
  - key: lint
    depends_on: [build]
    command: echo linted
  - key: deploy
    depends_on: [test, lint]
    command: echo deploying
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "failed");
    let by_key = |k: &str| done.jobs.iter().find(|j| j.step_key == k).unwrap().clone();
    let (build, test, lint, deploy) = (by_key("build"), by_key("test"), by_key("lint"), by_key("deploy"));
    assert_eq!(build.state, JobState::Succeeded, "{}", build.reason);
    assert_eq!(lint.state, JobState::Succeeded);
    assert_eq!(test.state, JobState::Failed);
    assert_eq!(test.reason, "exited with code 3");
    assert_eq!(test.exit_code, Some(3));
    assert_eq!(deploy.state, JobState::Skipped);
    assert!(deploy.reason.contains("`test`") && deploy.reason.contains("failed"), "{}", deploy.reason);
    assert!(deploy.started_at_ms.is_none(), "a skipped step never runs");
    // Dependents start only after their dependency finished.
    assert!(test.started_at_ms.unwrap() >= build.finished_at_ms.unwrap());
    assert!(lint.started_at_ms.unwrap() >= build.finished_at_ms.unwrap());
    assert_eq!(api.log_text(build.id), "built\n");
    assert_eq!(api.log_text(test.id), "testing\n");
}

#[test]
fn cancelling_a_running_job_kills_its_whole_process_tree() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
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
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: slow\n    timeout: 1s\n    command: [\"sleep 3002991 &\", sleep 3002992]\n");
    let j = api.wait_job(p.jobs[0].id, "finished", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::TimedOut);
    assert!(j.reason.contains("timeout of 1s"), "{}", j.reason);
    wait_until("the job's processes to be gone", Duration::from_secs(15), || processes_with("300299").is_empty());
}

#[test]
fn an_unplaceable_job_says_why_and_times_out_in_the_queue() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent =
        Agent::start(&server, &dir.path().join("agent"), "a1", &["--tag", "queue=cpu", "--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p =
        api.submit("steps:\n  - key: k\n    agents: {queue: cuda}\n    queue_timeout: 2s\n    command: echo never\n");
    let id = p.jobs[0].id;
    let j = api.wait_job(id, "explained", T, |j| j.reason.contains("queue=cuda"));
    assert_eq!(j.state, JobState::Queued);
    assert_eq!(j.reason, "no connected agent has tag queue=cuda");
    let j = api.wait_job(id, "timed out", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::TimedOut);
    assert!(
        j.reason.starts_with("still queued after queue_timeout 2s: no connected agent has tag queue=cuda"),
        "{}",
        j.reason
    );
}

#[test]
fn coordinator_killed_and_restarted_mid_run_loses_nothing_and_runs_nothing_twice() {
    let dir = tempdir();
    let ledger = dir.path().join("ledger");
    std::fs::create_dir_all(&ledger).unwrap();
    let mut server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--slots", "3", "--isolation", isolation()]);
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
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "2s");
    let mut agent = Agent::start(&server, &dir.path().join("agent"), "doomed", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: a\n    command: sleep 3003331\n  - key: b\n    retry: {count: 1, on: [lost]}\n    command: sleep 3003332\n");
    for j in &p.jobs {
        api.wait_job(j.id, "running", T, |j| j.state == JobState::Running);
    }
    agent.kill9();
    let a = api.wait_job(p.jobs[0].id, "lost", T, |j| j.state.is_terminal());
    assert_eq!(a.state, JobState::Lost);
    assert!(a.reason.contains("agent doomed stopped sending heartbeats"), "{}", a.reason);
    // The step with `retry: on: [lost]` is queued again as a new attempt.
    let b = api.job(p.jobs[1].id);
    assert_eq!(b.state, JobState::Lost);
    assert!(b.reason.contains("retrying (attempt 2 of 2)"), "{}", b.reason);
    let again = api.pipeline(p.id).jobs.into_iter().find(|j| j.step_key == "b" && j.attempt == 2).expect("retry job");
    assert_eq!(again.state, JobState::Queued);
    let agents = api.agents();
    assert_eq!(agents[0].state, "lost");
    // With the agent dead, the sandbox died with it: nothing is left running.
    wait_until("the lost jobs' processes to be gone", Duration::from_secs(15), || processes_with("300333").is_empty());
    // The agent comes back: the retry runs on it.
    let _agent = Agent::start(&server, &dir.path().join("agent"), "doomed", &["--isolation", isolation()]);
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
