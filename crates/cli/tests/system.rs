//! Whole-system tests: a real coordinator process and real agent processes on 127.0.0.1.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

#[test]
fn multi_step_pipeline_runs_in_dependency_order_and_skips_after_failure() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--slots", "4", "--isolation", isolation()]);
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

/// Issue 30: a 2×2 matrix runs four jobs, each with its own values; a failure its step's
/// `soft_fail` covers leaves the pipeline green and its dependents run.
#[test]
fn a_matrix_runs_a_job_per_combination_and_a_soft_failure_leaves_the_pipeline_succeeded() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--slots", "4", "--isolation", isolation()]);
    let p = api.submit(
        r#"
steps:
  - key: test
    matrix:
      setup:
        python: ["3.11", "3.12"]
        cuda: ["12.4", "12.6"]
    env: {PY: "{{matrix.python}}"}
    command: "echo python=$PY cuda={{matrix.cuda}}"
  - key: flaky
    depends_on: test
    soft_fail: [3]
    command: "echo flaky; exit 3"
  - key: after-flaky
    depends_on: flaky
    command: echo ran after a soft failure
"#,
    );
    assert_eq!(p.jobs.len(), 6, "{:#?}", p.jobs);
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{:#?}", done.jobs);
    let combos = [("3.11", "12.4"), ("3.11", "12.6"), ("3.12", "12.4"), ("3.12", "12.6")];
    for (j, (py, cuda)) in done.jobs.iter().zip(combos) {
        assert_eq!(j.step_key, format!("test[python={py},cuda={cuda}]"));
        assert_eq!(j.name, format!("test (python={py}, cuda={cuda})"));
        assert_eq!(j.state, JobState::Succeeded, "{}: {}", j.name, j.reason);
        assert_eq!(api.log_text(j.id), format!("python={py} cuda={cuda}\n"));
    }
    let by_key = |k: &str| done.jobs.iter().find(|j| j.step_key == k).unwrap().clone();
    let (flaky, after) = (by_key("flaky"), by_key("after-flaky"));
    // `depends_on` the matrix step waited for all four of its jobs.
    let last_test = done.jobs[..4].iter().filter_map(|j| j.finished_at_ms).max().unwrap();
    assert!(flaky.started_at_ms.unwrap() >= last_test);
    assert_eq!((flaky.state, flaky.exit_code, flaky.soft_failed), (JobState::Failed, Some(3), true));
    assert_eq!(api.log_text(flaky.id), "flaky\n");
    assert_eq!(after.state, JobState::Succeeded, "{}", after.reason);
    assert!(!after.soft_failed && !done.jobs[0].soft_failed);
}

/// Issue 30: `allow_dependency_failure` runs a step after its dependency failed; without it
/// the step is skipped, as before; the pipeline still fails.
#[test]
fn allow_dependency_failure_runs_a_step_after_its_dependency_failed() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--slots", "2", "--isolation", isolation()]);
    let p = api.submit(
        r#"
steps:
  - key: build
    command: "echo building; exit 1"
  - key: deploy
    depends_on: build
    command: echo deploying
  - key: cleanup
    depends_on: build
    allow_dependency_failure: true
    command: echo cleaning up
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "failed", "{:#?}", done.jobs);
    let by_key = |k: &str| done.jobs.iter().find(|j| j.step_key == k).unwrap().clone();
    let (build, deploy, cleanup) = (by_key("build"), by_key("deploy"), by_key("cleanup"));
    assert_eq!((build.state, build.soft_failed), (JobState::Failed, false));
    assert_eq!(deploy.state, JobState::Skipped);
    assert!(deploy.reason.contains("`build`") && deploy.reason.contains("failed"), "{}", deploy.reason);
    assert_eq!(cleanup.state, JobState::Succeeded, "{}", cleanup.reason);
    assert!(cleanup.started_at_ms.unwrap() >= build.finished_at_ms.unwrap());
    assert_eq!(api.log_text(cleanup.id), "cleaning up\n");
}

/// Issue 30 item 3: `gpuci submit` in a git work tree sends its branch and changed paths; a
/// step whose `if:` holds runs, one whose `if:` is false is created skipped with the condition
/// and the facts it read, its dependent is skipped after it, and the pipeline succeeds.
#[test]
fn a_step_whose_condition_is_false_is_skipped_with_the_reason_and_the_pipeline_succeeds() {
    use std::process::Command;
    if Command::new("git").arg("--version").output().is_err() {
        eprintln!("git is not installed; skipped");
        return;
    }
    let (dir, server, _agent, api) = one_agent("30s", "a1", &["--slots", "2", "--isolation", isolation()]);
    let repo = dir.path().join("repo");
    std::fs::create_dir_all(repo.join("src")).unwrap();
    let git = |args: &[&str]| {
        let out = Command::new("git")
            .arg("-C")
            .arg(&repo)
            .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    std::fs::write(repo.join("README.md"), "hi\n").unwrap();
    git(&["init", "-q", "-b", "main"]);
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "first"]);
    git(&["checkout", "-q", "-b", "feature/kernels"]);
    std::fs::write(repo.join("src/gemm.cu"), "// kernel\n").unwrap();
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "kernel"]);
    let file = repo.join(".gpuci.yml");
    std::fs::write(
        &file,
        r#"steps:
  - key: kernels
    if: build.branch =~ /^feature\// && changed("src/**/*.cu") && build.event == "manual"
    command: echo testing kernels
  - key: deploy
    if: build.branch == "main"
    command: echo deploying
  - key: announce
    depends_on: deploy
    command: echo announcing
"#,
    )
    .unwrap();
    let out = Command::new(BIN)
        .arg("submit")
        .arg(&file)
        .args(["--wait", "--server", &server.url, "--token", &server.token])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "a skip by a condition does not fail the pipeline; stderr: {stderr}");
    assert!(stderr.contains("deploy skipped: skipped: `if: build.branch == \"main\"` is false"), "{stderr}");

    let id: i64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix("pipeline ")?.split_once(" submitted")?.0.parse().ok())
        .unwrap_or_else(|| panic!("no pipeline id in {stderr}"));
    let done = api.wait_pipeline(id, T);
    assert_eq!(done.state, "succeeded", "{:#?}", done.jobs);
    let by_key = |k: &str| done.jobs.iter().find(|j| j.step_key == k).unwrap().clone();
    let (kernels, deploy, announce) = (by_key("kernels"), by_key("deploy"), by_key("announce"));
    assert_eq!(kernels.state, JobState::Succeeded, "{}", kernels.reason);
    assert_eq!(api.log_text(kernels.id), "testing kernels\n");
    assert_eq!((deploy.state, deploy.skipped_by_condition), (JobState::Skipped, true));
    assert_eq!(deploy.reason, r#"skipped: `if: build.branch == "main"` is false (build.branch = "feature/kernels")"#);
    assert!(deploy.started_at_ms.is_none() && deploy.agent_id.is_none(), "it never ran");
    assert_eq!((announce.state, announce.skipped_by_condition), (JobState::Skipped, true));
    assert!(announce.reason.contains("dependency `deploy` was skipped by a condition"), "{}", announce.reason);
}

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
fn an_unplaceable_job_says_why_and_times_out_in_the_queue() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--tag", "queue=cpu", "--isolation", isolation()]);
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

#[test]
fn concurrency_group_runs_one_at_a_time_and_cancel_in_progress_cancels_the_older_run() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--slots", "4", "--isolation", isolation()]);
    // Same group, no cancel: the second waits for the first.
    let one = api.submit("steps:\n  - key: d\n    concurrency: deploy\n    command: sleep 1\n");
    let two = api.submit("steps:\n  - key: d\n    concurrency: deploy\n    command: echo second\n");
    api.wait_job(one.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    let waiting = api.wait_job(two.jobs[0].id, "waiting", T, |j| j.reason.contains("concurrency group"));
    assert_eq!(waiting.state, JobState::Queued, "{}", waiting.reason);
    let a = api.wait_job(one.jobs[0].id, "done", T, |j| j.state.is_terminal());
    let b = api.wait_job(two.jobs[0].id, "done", T, |j| j.state.is_terminal());
    assert_eq!((a.state, b.state), (JobState::Succeeded, JobState::Succeeded));
    assert!(b.started_at_ms.unwrap() >= a.finished_at_ms.unwrap(), "never both at once");
    // cancel_in_progress: a newer run cancels the older one.
    let g = "steps:\n  - key: d\n    concurrency: {group: pr-7, cancel_in_progress: true}\n    command: sleep 30\n";
    let old = api.submit(g);
    api.wait_job(old.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    let new = api.submit(g);
    let o = api.wait_job(old.jobs[0].id, "cancelled", T, |j| j.state.is_terminal());
    assert_eq!(o.state, JobState::Cancelled);
    assert!(o.reason.contains(&format!("cancelled by job {}", new.jobs[0].id)), "{}", o.reason);
    api.wait_job(new.jobs[0].id, "running", T, |j| j.state == JobState::Running);
}

/// Regression (issue 27): concurrency groups crossed repositories. A public repository's
/// `cancel_in_progress: true` cancelled another repository's running job of the same group,
/// and one repository's long job held every other repository's jobs of the group. A group is
/// now its repository's (with the host: gitlab.com/acme/x is not github.com/acme/x) and trust
/// class's, and a waiting job's reason names it so.
#[test]
fn concurrency_groups_of_two_repositories_neither_cancel_nor_block_each_other() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--slots", "6", "--isolation", isolation()]);
    let hold = "steps:\n  - key: d\n    concurrency: deploy\n    command: sleep 60\n";
    let cancel =
        "steps:\n  - key: d\n    concurrency: {group: deploy, cancel_in_progress: true}\n    command: sleep 60\n";
    let private = api.submit_from(hold, Some("https://github.com/acme/private.git")).jobs[0].id;
    api.wait_job(private, "running", T, |j| j.state == JobState::Running);
    // The same owner/name on another host: not held by the private repository's job.
    let mirror = api.submit_from(hold, Some("https://gitlab.com/acme/private.git")).jobs[0].id;
    api.wait_job(mirror, "running beside the other repository's job", T, |j| j.state == JobState::Running);
    // Another repository cancelling "its" group: cancels nothing of the others.
    let public = api.submit_from(cancel, Some("https://github.com/rt/public.git")).jobs[0].id;
    api.wait_job(public, "running", T, |j| j.state == JobState::Running);
    for id in [private, mirror] {
        let j = api.job(id);
        assert_eq!(j.state, JobState::Running, "job {id}: {}", j.reason);
    }
    // The same repository (spelled another way) is one group: it waits, and says for whom.
    let next = api.submit_from(hold, Some("git@github.com:acme/private.git")).jobs[0].id;
    let j = api.wait_job(next, "waiting for its group", T, |j| j.reason.contains("concurrency group"));
    assert_eq!(j.state, JobState::Queued);
    assert_eq!(
        j.reason,
        format!("waiting for job {private} in concurrency group \"deploy\" of github.com/acme/private")
    );
    // And its own cancel_in_progress cancels its own older jobs only.
    let newest = api.submit_from(cancel, Some("https://github.com/acme/private")).jobs[0].id;
    let o = api.wait_job(private, "cancelled", T, |j| j.state.is_terminal());
    assert_eq!(o.state, JobState::Cancelled);
    assert!(o.reason.contains(&format!("cancelled by job {newest}")), "{}", o.reason);
    assert!(o.reason.contains("\"deploy\" of github.com/acme/private"), "{}", o.reason);
    api.wait_job(newest, "running", T, |j| j.state == JobState::Running);
    for id in [mirror, public] {
        let j = api.job(id);
        assert_eq!(j.state, JobState::Running, "job {id}: {}", j.reason);
    }
}

#[test]
fn retry_on_failed_creates_a_new_attempt_that_can_succeed() {
    let dir = tempdir();
    let marker = shared_dir(&dir, "m").join("marker");
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent =
        Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", isolation(), "--allow-unsandboxed"]);
    let api = server.api();
    api.wait_agents(1, T);
    // Fails the first time (no marker yet), succeeds the second.
    let yaml = format!(
        "steps:\n  - key: flaky\n    sandbox: none\n    retry: {{count: 2, on: [failed]}}\n    command: \"if [ -e {m} ]; then echo ok; else touch {m}; exit 1; fi\"\n",
        m = marker.display()
    );
    let p = api.submit(&yaml);
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{:#?}", done.jobs);
    assert_eq!(done.jobs.len(), 2);
    assert_eq!(done.jobs[0].state, JobState::Failed);
    assert!(done.jobs[0].reason.contains("retrying (attempt 2 of 3)"), "{}", done.jobs[0].reason);
    assert_eq!((done.jobs[1].attempt, done.jobs[1].state), (2, JobState::Succeeded));
}

#[test]
fn secrets_reach_the_job_and_are_masked_in_its_log_even_when_written_in_pieces() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let value = "hf_Sup3rS3cretValue42";
    let r = api
        .raw()
        .put(format!("{}/api/v1/secrets/HF_TOKEN", api.url))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({"value": value}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 204);
    // Listing shows names, never values.
    let listed =
        api.raw().get(format!("{}/api/v1/secrets", api.url)).bearer_auth(&server.token).send().unwrap().text().unwrap();
    assert!(listed.contains("HF_TOKEN") && !listed.contains(value), "{listed}");
    let p = api.submit(
        r#"
steps:
  - key: uses
    secrets: [HF_TOKEN]
    command:
      - echo "token=$HF_TOKEN"
      - printf '%s' "${HF_TOKEN:0:6}"; sleep 0.3; printf '%s\n' "${HF_TOKEN:6}"
      - echo "$HF_TOKEN" >&2
      - test "$HF_TOKEN" = hf_Sup3rS3cretValue42
  - key: missing
    secrets: [NOT_SET]
    command: echo never
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let uses = &done.jobs[0];
    assert_eq!(uses.state, JobState::Succeeded, "{}", uses.reason);
    let log = api
        .raw()
        .get(format!("{}/api/v1/jobs/{}/logs", api.url, uses.id))
        .bearer_auth(&server.token)
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(!log.contains("Sup3rS3cret"), "secret leaked into the log: {log}");
    assert_eq!(api.log_text(uses.id), "token=***\n***\n***\n");
    let missing = &done.jobs[1];
    assert_eq!(missing.state, JobState::Failed);
    assert_eq!(missing.reason, "secret `NOT_SET` is not set (gpuci secret set NOT_SET)");
}

#[test]
fn a_job_over_its_memory_limit_fails_with_out_of_memory_and_a_fork_bomb_is_contained() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let p = api.submit(
        r#"
steps:
  - key: hog
    resources: {memory: 64MiB}
    command: python3 -c "b = bytearray(300 * 1024 * 1024); print(len(b))"
  - key: bomb
    resources: {pids: 32, memory: 256MiB}
    timeout: 20s
    command: "f() { f | f & }; f; sleep 2; echo survived"
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let hog = &done.jobs[0];
    assert_eq!(hog.state, JobState::Failed, "{}", hog.reason);
    assert_eq!(hog.reason, "out of memory (limit 64 MiB)");
    // The fork bomb hits the pids limit; the machine (and this test) carry on, and nothing of
    // it is left afterwards.
    let bomb = &done.jobs[1];
    assert!(bomb.state.is_terminal(), "{bomb:?}");
    wait_until("the fork bomb's processes to be gone", Duration::from_secs(20), || processes_with("f | f").is_empty());
}

/// Issue 9: a job filling its workspace stops at its disk quota ("disk quota exceeded"), not
/// at the host's disk; the next job of the slot starts with an empty workspace and its whole
/// quota. The agent's mounts go with it when it is killed.
#[test]
fn a_job_filling_its_workspace_stops_at_its_disk_quota_and_the_host_disk_is_untouched() {
    if !nix::unistd::geteuid().is_root() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: system tests run as root");
        eprintln!("SKIP: slot disks need a root agent");
        return;
    }
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let mut agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", isolation(), "--slots", "1", "--job-disk", "64MiB"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    assert!(api.agents()[0].isolation.contains("a 64 MiB disk per slot"), "{}", api.agents()[0].isolation);
    let host_free =
        || nix::sys::statvfs::statvfs(dir.path()).map(|s| s.blocks_available() * s.fragment_size()).unwrap();
    let before = host_free();
    let p = api.submit("steps:\n  - key: fill\n    command: head -c 200000000 /dev/zero > big\n");
    let done = api.wait_pipeline(p.id, T);
    let fill = &done.jobs[0];
    assert_eq!(fill.state, JobState::Failed, "{fill:?}");
    assert!(fill.reason.starts_with("disk quota exceeded (limit 64 MiB)"), "{}", fill.reason);
    let after = host_free();
    assert!(before.saturating_sub(after) < 100 << 20, "the host disk lost {} bytes", before.saturating_sub(after));
    let p = api.submit(
        r#"
steps:
  - key: next
    command: |
      test ! -e big && echo "workspace empty"
      head -c 40000000 /dev/zero > fits && echo "40 MB fit"
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let next = &done.jobs[0];
    assert_eq!(next.state, JobState::Succeeded, "{next:?}");
    let log = api.log_text(next.id);
    assert!(log.contains("workspace empty") && log.contains("40 MB fit"), "{log}");
    // Killed, the agent leaves no mount behind.
    let mounts_of = |d: &std::path::Path| {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.contains(&*d.to_string_lossy()))
            .count()
    };
    agent.kill9();
    wait_until("the slot disk to be unmounted", T, || mounts_of(dir.path()) == 0);
}

/// Outsider finding (issue 9): a job that filled its slot's disk to the last block with many
/// files in a subdirectory left a workspace the agent could not remove (emptying a directory
/// moves its entries up, which needs a new directory block), and every later job on the slot
/// failed with "No space left on device" until the agent restarted.
#[test]
fn a_slot_disk_filled_to_the_last_block_is_emptied_for_the_next_job() {
    if !nix::unistd::geteuid().is_root() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: system tests run as root");
        eprintln!("SKIP: slot disks need a root agent");
        return;
    }
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", isolation(), "--slots", "1", "--job-disk", "64MiB"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let fill = r#"
steps:
  - key: fill
    command: |
      set +e
      mkdir d && cd d
      for i in $(seq 1 2500); do : > "file-with-a-rather-long-name-to-grow-the-directory-$i"; done
      head -c 100000000 /dev/zero > big 2>/dev/null
      for i in $(seq 1 500); do echo x > "s$i" 2>/dev/null || break; done
      for i in $(seq 1 500); do mkdir "m$i" 2>/dev/null || break; done
      df -k . | tail -1
      exit 0
"#;
    // And (outsider round 2) a directory of hundreds of thousands of hard links: entries that
    // cost no inode, so only the disk's blocks bound them, then the rest of the disk filled.
    let links = r#"
steps:
  - key: links
    command: |
      python3 - <<'PY'
      import os, itertools, string
      os.mkdir('d'); os.mkdir('e'); ch = string.ascii_letters + string.digits; b = None; c = n = 0
      try:
        for L in (1, 2, 3, 4):
          for t in itertools.product(ch, repeat=L):
            if b is None or c >= 64000: b = 'e/b%d' % n; open(b, 'w').close(); c = 0
            os.link(b, 'd/' + ''.join(t)); c += 1; n += 1
      except OSError as x: print(n, x)
      try:
        with open('e/big', 'wb') as f:
          while 1: f.write(b'x' * 65536)
      except OSError as x: print(x)
      PY
"#;
    for attack in [fill, links] {
        let done = api.wait_pipeline(api.submit(attack).id, T);
        assert!(done.jobs[0].state.is_terminal(), "{:?}", done.jobs[0]);
        next_jobs_run(&api);
    }
}

fn next_jobs_run(api: &Api) {
    for round in 0..3 {
        let p = api.submit("steps:\n  - key: next\n    command: test ! -e d && echo clean-slot\n");
        let done = api.wait_pipeline(p.id, T);
        let next = &done.jobs[0];
        assert_eq!(next.state, JobState::Succeeded, "round {round}: {next:?}");
        assert!(api.log_text(next.id).contains("clean-slot"), "round {round}");
    }
}

#[test]
fn a_restarted_agent_sweeps_the_jobs_its_killed_predecessor_left_running() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "2s");
    // No bubblewrap, so nothing dies with the agent: only the sweep can clean up.
    let mut agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", "none"]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: a\n    command: [\"setsid sleep 3005551 &\", sleep 3005552]\n");
    api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    wait_until("both processes", T, || processes_with("300555").len() >= 2);
    agent.kill9();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!processes_with("300555").is_empty(), "without a sandbox the job outlives a killed agent");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", "none"]);
    wait_until_or(
        "the sweep",
        T,
        || processes_with("300555").is_empty(),
        || format!("{:#?}", processes_with("300555")),
    );
}

#[test]
fn a_sandboxed_job_cannot_read_the_agents_credential_or_host_keys() {
    if isolation() != "bubblewrap" {
        return;
    }
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let agent_dir = dir.path().join("agent");
    let _agent = Agent::start(&server, &agent_dir, "a1", &["--isolation", "bubblewrap"]);
    let api = server.api();
    api.wait_agents(1, T);
    let cred = agent_dir.join("agent.json");
    assert!(cred.exists());
    let yaml = format!(
        "steps:\n  - key: peek\n    command:\n      - \"if cat {cred} 2>/dev/null; then echo LEAK-CRED; fi\"\n      - \"if ls -A /etc/ssl/private 2>/dev/null | grep -q .; then echo LEAK-KEYS; fi\"\n      - \"if cat /etc/shadow 2>/dev/null; then echo LEAK-SHADOW; fi\"\n      - \"if ls {server_dir} 2>/dev/null; then echo LEAK-SERVER; fi\"\n      - echo looked\n",
        cred = cred.display(),
        server_dir = server.data_dir.display()
    );
    let p = api.submit(&yaml);
    let j = api.wait_job(p.jobs[0].id, "done", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Succeeded, "{}", j.reason);
    assert_eq!(api.log_text(j.id), "looked\n");
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

#[test]
fn an_agent_runs_no_unsandboxed_step_unless_started_with_allow_unsandboxed() {
    // The default: no flag needed to refuse `sandbox: none` (issue 9: it was allowed).
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "strict", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: host\n    sandbox: none\n    queue_timeout: 2s\n    command: echo on-the-host\n  - key: boxed\n    command: echo boxed\n");
    let done = api.wait_pipeline(p.id, T);
    let (host, boxed) = (&done.jobs[0], &done.jobs[1]);
    assert_eq!(boxed.state, JobState::Succeeded);
    assert_eq!(host.state, JobState::TimedOut);
    assert!(host.reason.contains("needs an agent that allows `sandbox: none`"), "{}", host.reason);
    assert!(host.started_at_ms.is_none());
}

#[test]
fn cache_paths_are_kept_per_repository_between_jobs() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let submit = |repo: &str, command: &str| {
        let source = format!("steps:\n  - key: c\n    cache: [.cache/data]\n    command: {command:?}\n");
        let r = api
            .raw()
            .post(format!("{}/api/v1/pipelines", api.url))
            .bearer_auth(&server.token)
            .json(&serde_json::json!({"file_name": "c.yml", "source": source, "repository": repo}))
            .send()
            .unwrap();
        assert_eq!(r.status(), 201);
        let p: gpuci_protocol::api::PipelineSummary = r.json().unwrap();
        let done = api.wait_pipeline(p.id, T);
        assert_eq!(done.state, "succeeded", "{:#?}", done.jobs);
        api.log_text(done.jobs[0].id)
    };
    submit("git@example.invalid:org/a.git", "mkdir -p .cache/data && echo kept > .cache/data/x");
    assert_eq!(submit("git@example.invalid:org/a.git", "cat .cache/data/x"), "kept\n");
    // Another repository never sees it.
    assert_eq!(submit("git@example.invalid:org/b.git", "test ! -e .cache/data/x && echo clean"), "clean\n");
}

#[test]
fn an_image_step_waits_for_an_agent_with_a_working_container_engine() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    // A docker CLI without a daemon (as on this machine) is not a runtime: not advertised.
    if api.agents()[0].container_runtime.is_some() {
        eprintln!("this host has a working container engine; the waiting case cannot be shown here");
        return;
    }
    let p = api.submit("steps:\n  - key: boxed\n    image: debian:12\n    queue_timeout: 2s\n    command: echo hi\n");
    let j = api.wait_job(p.jobs[0].id, "timed out", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::TimedOut);
    assert!(j.reason.contains("needs a container runtime"), "{}", j.reason);
    assert!(j.started_at_ms.is_none(), "an image step never falls back to the host");
}

/// Live (not zombie) processes any of whose uids is `uid`: (pid, command line).
fn live_processes_of_uid(uid: u32) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else { continue };
        let state = status.lines().find_map(|l| l.strip_prefix("State:")).unwrap_or("").trim_start();
        let ours = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .is_some_and(|u| u.split_whitespace().any(|x| x == uid.to_string()));
        if ours && !state.starts_with('Z') && !state.starts_with('X') {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            found.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ").trim_end().to_string()));
        }
    }
    found
}

/// Parent pid of `pid`, from `/proc/PID/stat` (the field after the command's closing paren).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// An idle slot's waiting processes: (the waiting shell, the ready sandbox's bwrap), when the
/// slot's uid runs exactly those two and what the sandbox runs inside (bwrap's init and
/// `/bin/sh -s`), nothing else.
fn idle_slot(uid: u32) -> Option<(u32, u32)> {
    let procs = live_processes_of_uid(uid);
    let of_uid = |pid: u32| procs.iter().any(|(p, _)| *p == pid);
    let top: Vec<&(u32, String)> = procs.iter().filter(|(p, _)| !parent_of(*p).is_some_and(of_uid)).collect();
    let shell = top.iter().find(|(_, c)| c == "/bin/sh -s")?.0;
    let ready = top.iter().find(|(_, c)| c.contains("bwrap --args") && c.ends_with(" -- /bin/sh -s"))?.0;
    let inner = procs.iter().filter(|(_, c)| c.contains("bwrap --args") || c == "/bin/sh -s").count();
    (top.len() == 2 && procs.len() == 4 && inner == 4).then_some((shell, ready))
}

/// Issue 9 (speed): an idle slot holds its next job's sandbox, already started in its cgroup
/// and as its uid (and, beside it, a waiting shell for jobs laid out otherwise); the job
/// starts in that sandbox, and a fresh pair waits once the job is gone. Nothing else ever
/// runs as the slot's uid while it is idle.
#[test]
fn a_slots_next_job_starts_in_its_ready_sandbox_and_nothing_else_runs_as_the_slots_uid() {
    if isolation() != "bubblewrap" || !nix::unistd::geteuid().is_root() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: system tests run as root with bubblewrap");
        eprintln!("SKIP: warm starts need a root agent with bubblewrap");
        return;
    }
    let uid = 1_620_000_000 + (std::process::id() % 50_000) * 16;
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let uids = format!("{uid}-{}", uid + 1);
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", "bubblewrap", "--slots", "1", "--job-uids", &uids, "--job-disk", "none"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    wait_until_or(
        "the slot's waiting processes",
        T,
        || idle_slot(uid).is_some(),
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    let (shell, ready) = idle_slot(uid).unwrap();
    let p = api.submit("steps:\n  - key: a\n    command: [sleep 2, echo ran-in-the-ready-sandbox]\n");
    // The job runs inside the ready sandbox (a descendant of its bwrap); the shell is gone.
    let inside_ready = || {
        live_processes_of_uid(uid).iter().any(|(pid, cmd)| {
            let mut p = *pid;
            let mut chain = 0;
            while let Some(parent) = parent_of(p).filter(|_| chain < 8) {
                if parent == ready {
                    return cmd.contains("sleep 2");
                }
                (p, chain) = (parent, chain + 1);
            }
            false
        })
    };
    wait_until_or("the job in the ready sandbox", T, inside_ready, || format!("{:?}", live_processes_of_uid(uid)));
    // Killed at the hand-over (SIGKILL takes a moment to land): gone, not waiting beside the job.
    wait_until_or(
        "the waiting shell to be gone",
        T,
        || !live_processes_of_uid(uid).iter().any(|(p, _)| *p == shell),
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{:?}", done.jobs[0]);
    assert!(api.log_text(done.jobs[0].id).contains("ran-in-the-ready-sandbox"));
    // Then exactly one new pair, and nothing else of the uid.
    wait_until_or(
        "a fresh pair of waiting processes and nothing else",
        T,
        || idle_slot(uid).is_some_and(|(s, r)| s != shell && r != ready),
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    // A job laid out otherwise (no network) starts from the waiting shell: it becomes the job's bwrap.
    let (shell, ready) = idle_slot(uid).unwrap();
    let p =
        api.submit("steps:\n  - key: b\n    network: none\n    command: [sleep 2, echo ran-from-the-waiting-shell]\n");
    wait_until_or(
        "the waiting shell to become the job",
        T,
        || {
            std::fs::read_to_string(format!("/proc/{shell}/cmdline"))
                .is_ok_and(|c| c.contains("bwrap") && c.contains("bash"))
        },
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    wait_until_or(
        "the ready sandbox to be gone",
        T,
        || !live_processes_of_uid(uid).iter().any(|(p, _)| *p == ready),
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{:?}", done.jobs[0]);
    assert!(api.log_text(done.jobs[0].id).contains("ran-from-the-waiting-shell"));
}

/// Issue 9: nothing of a root agent outlives it, however it ends: its running job, the
/// waiting process of an idle slot, and the slot networks' holders and pasta (these ran on
/// until another agent took the same uids).
#[test]
fn an_agent_killed_with_sigkill_leaves_no_process_of_its_slots_uids() {
    if isolation() != "bubblewrap" || !nix::unistd::geteuid().is_root() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: system tests run as root with bubblewrap");
        eprintln!("SKIP: slots need a root agent with bubblewrap");
        return;
    }
    let uid = 1_620_000_008 + (std::process::id() % 50_000) * 16;
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let uids = format!("{uid}-{}", uid + 3);
    let mut agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", "bubblewrap", "--slots", "2", "--job-uids", &uids, "--job-disk", "none"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: a\n    command: sleep 3007771\n");
    api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    let ours = || (uid..uid + 4).flat_map(live_processes_of_uid).collect::<Vec<_>>();
    // A running job, a waiting process for the idle slot, two holders with their pasta.
    wait_until_or("the slots' processes", T, || ours().len() >= 6, || format!("{:?}", ours()));
    // Killed without the Drop's clean-up of holder uids.
    let _ = agent.child.kill();
    let _ = agent.child.wait();
    wait_until_or(
        "every process of the slots' uids to be gone",
        Duration::from_secs(10),
        || ours().is_empty(),
        || format!("{:?}", ours()),
    );
}

/// The job's system lines (gpuci's own), one per line.
fn system_lines(api: &Api, id: i64) -> String {
    let body = api.raw().get(format!("{}/api/v1/jobs/{id}/logs", api.url)).bearer_auth(api.token()).send().unwrap();
    let mut out = String::new();
    for line in body.text().unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("ndjson");
        if v["type"] == "line" && v["stream"] == "system" {
            out.push_str(v["text"].as_str().unwrap_or_default());
            out.push('\n');
        }
    }
    out
}

/// Issue 14: a secret belongs to a scope — every pipeline, one repository, or a repository's
/// refs — and a job gets the narrowest that covers it; another repository's pipeline is
/// refused with the scopes the secret has. Setting it again rotates it. The job's log records
/// which secrets (names and scopes, never values) the run was given.
#[test]
fn a_repositorys_secret_reaches_only_that_repositorys_jobs_and_the_narrowest_scope_wins() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let put = |name: &str, query: &str, value: &str| {
        let r = api
            .raw()
            .put(format!("{}/api/v1/secrets/{name}{query}", api.url))
            .bearer_auth(&server.token)
            .json(&serde_json::json!({ "value": value }))
            .send()
            .unwrap();
        assert_eq!(r.status(), 204, "{}", r.text().unwrap_or_default());
    };
    put("DEPLOY_KEY", "?repository=octo/kernels", "key-of-octo-kernels");
    put("UPLOAD_TOKEN", "", "token-for-everyone");
    put("UPLOAD_TOKEN", "?repository=octo/kernels", "token-for-kernels");
    put("UPLOAD_TOKEN", "?repository=octo/kernels&ref=refs/heads/main", "token-for-main");
    // Bad scopes are refused with the reason.
    let bad = api
        .raw()
        .put(format!("{}/api/v1/secrets/X?ref=refs/heads/main", api.url))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({ "value": "v" }))
        .send()
        .unwrap();
    assert_eq!(bad.status(), 422);
    assert!(bad.text().unwrap().contains("needs a repository"));
    // A value the job could only get cut short (at its NUL), unmasked: refused.
    let nul = api
        .raw()
        .put(format!("{}/api/v1/secrets/X?repository=octo/kernels", api.url))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({ "value": "before\u{0}after" }))
        .send()
        .unwrap();
    assert_eq!(nul.status(), 422);
    assert!(nul.text().unwrap().contains("NUL"));
    let listed: serde_json::Value =
        api.raw().get(format!("{}/api/v1/secrets", api.url)).bearer_auth(&server.token).send().unwrap().json().unwrap();
    let text = listed.to_string();
    assert!(!text.contains("key-of") && !text.contains("token-for"), "values listed: {text}");
    assert_eq!(listed.as_array().unwrap().len(), 4, "{listed:#}");
    assert!(text.contains(r#""ref":"refs/heads/main""#), "{text}");

    let pipeline = r#"
steps:
  - key: deploy
    secrets: [DEPLOY_KEY, UPLOAD_TOKEN]
    command:
      - test "$DEPLOY_KEY" = key-of-octo-kernels && echo deploy-key-ok
      - test "$UPLOAD_TOKEN" = token-for-kernels && echo repository-scope-won
"#;
    // From octo/kernels (no ref known for an API submission): the repository's values.
    let p = api.submit_from(pipeline, Some("octo/kernels"));
    let done = api.wait_pipeline(p.id, T);
    let job = &done.jobs[0];
    assert_eq!(job.state, JobState::Succeeded, "{}", job.reason);
    assert_eq!(api.log_text(job.id), "deploy-key-ok\nrepository-scope-won\n");
    let notes = system_lines(&api, job.id);
    assert!(
        notes.contains(
            "secrets given to this run: DEPLOY_KEY (scope: octo/kernels), UPLOAD_TOKEN (scope: octo/kernels)"
        ),
        "{notes}"
    );
    // From another repository: refused before it runs, naming the secret's scope.
    let p = api.submit_from(pipeline, Some("evil/fork-of-kernels"));
    let done = api.wait_pipeline(p.id, T);
    let job = &done.jobs[0];
    assert_eq!(job.state, JobState::Failed);
    // Not told which repositories have it.
    assert_eq!(
        job.reason,
        "secret `DEPLOY_KEY` is not set for evil/fork-of-kernels (gpuci secret set DEPLOY_KEY --repo evil/fork-of-kernels)"
    );
    assert!(!api.log_text(job.id).contains("ok"), "the refused job ran");
    // The global value reaches a pipeline of any other repository; a rotation the next job.
    let global = "steps:\n  - key: g\n    secrets: [UPLOAD_TOKEN]\n    command: test \"$UPLOAD_TOKEN\" = \"$WANT\" && echo got-it\n";
    put("UPLOAD_TOKEN", "", "rotated-token");
    let p = api.submit_from(&global.replace("$WANT", "rotated-token"), Some("someone/else"));
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{}", done.jobs[0].reason);
    assert!(system_lines(&api, done.jobs[0].id).contains("UPLOAD_TOKEN (scope: every pipeline)"));
    // Deleting the repository's value leaves the global one for octo/kernels.
    let r = api
        .raw()
        .delete(format!("{}/api/v1/secrets/UPLOAD_TOKEN?repository=octo/kernels", api.url))
        .bearer_auth(&server.token)
        .send()
        .unwrap();
    assert_eq!(r.status(), 204);
    let p = api.submit_from(&global.replace("$WANT", "rotated-token"), Some("octo/kernels"));
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{}", done.jobs[0].reason);
    // `gpuci submit` reports its work tree's origin URL: that names octo/kernels too.
    let p = api.submit_from(pipeline, Some("git@github.com:octo/kernels.git"));
    let done = api.wait_pipeline(p.id, T);
    // It ran (got both secrets: DEPLOY_KEY's, and UPLOAD_TOKEN's global value, whose test fails).
    assert_eq!(done.jobs[0].state, JobState::Failed, "{:?}", done.jobs[0]);
    assert_eq!(done.jobs[0].reason, "exited with code 1");
    assert_eq!(api.log_text(done.jobs[0].id), "deploy-key-ok\n");
    let p = api.submit_from(
        "steps:\n  - key: d\n    secrets: [DEPLOY_KEY]\n    command: test \"$DEPLOY_KEY\" = key-of-octo-kernels\n",
        Some("https://github.com/octo/kernels.git"),
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{}", done.jobs[0].reason);
}

/// `gpuci secret encrypt`, run as a repository's maintainer would: with the coordinator's
/// public key only, no token. The printed line is what goes under `secrets:`.
fn encrypt_line(recipient: &str, name: &str, repo: &str, git_ref: Option<&str>, value: &str) -> String {
    use std::io::Write;
    let mut cmd = std::process::Command::new(BIN);
    cmd.args(["secret", "encrypt", name, "--repo", repo, "--recipient", recipient, "--server", "http://127.0.0.1:9"]);
    if let Some(r) = git_ref {
        cmd.args(["--ref", r]);
    }
    let mut child = cmd
        .env_remove("GPUCI_TOKEN")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(format!("{value}\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(line.starts_with(&format!("{name}: \"gpuci:v1:")) && !line.contains(value), "{line}");
    line
}

/// Issue 14: a secret encrypted in the pipeline file opens on the coordinator for the
/// repository (and ref) it was encrypted for; copied into another repository's pipeline or
/// used under another name it is refused with the reason; a rotated key still opens what was
/// encrypted to the old one.
#[test]
fn a_secret_encrypted_in_the_pipeline_file_opens_only_for_its_repository() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let key: serde_json::Value = api
        .raw()
        .get(format!("{}/api/v1/secrets-key", api.url))
        .bearer_auth(&server.token)
        .send()
        .unwrap()
        .json()
        .unwrap();
    let recipient = key["recipient"].as_str().unwrap().to_string();
    assert!(recipient.starts_with("age1"), "{key}");
    let line = encrypt_line(&recipient, "CODECOV_TOKEN", "octo/kernels", None, "c0dec0v-value");
    let pipeline = |line: &str| {
        format!(
            "steps:\n  - key: upload\n    secrets:\n      {line}\n    command: test \"$CODECOV_TOKEN\" = c0dec0v-value && echo opened && echo \"$CODECOV_TOKEN\"\n"
        )
    };
    let p = api.submit_from(&pipeline(&line), Some("octo/kernels"));
    let done = api.wait_pipeline(p.id, T);
    let job = &done.jobs[0];
    assert_eq!(job.state, JobState::Succeeded, "{}", job.reason);
    assert_eq!(api.log_text(job.id), "opened\n***\n", "the value is masked like any secret");
    assert!(system_lines(&api, job.id).contains("CODECOV_TOKEN (encrypted in the pipeline for octo/kernels)"));
    // Pasted into another repository's pipeline.
    let p = api.submit_from(&pipeline(&line), Some("evil/kernels"));
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Failed);
    assert_eq!(
        done.jobs[0].reason,
        "encrypted secret `CODECOV_TOKEN` was encrypted for octo/kernels; this job is from a pipeline submitted through the API from a work tree of evil/kernels"
    );
    // Used under another name.
    let renamed = line.replacen("CODECOV_TOKEN:", "OTHER_TOKEN:", 1);
    let p = api.submit_from(&pipeline(&renamed).replace("$CODECOV_TOKEN", "$OTHER_TOKEN"), Some("octo/kernels"));
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Failed);
    assert!(done.jobs[0].reason.contains("was encrypted as `CODECOV_TOKEN`"), "{}", done.jobs[0].reason);
    // One byte of the ciphertext changed: refused, nothing in clear.
    let cut = line.len() - 6;
    let tampered =
        format!("{}{}{}", &line[..cut], if &line[cut..cut + 1] == "A" { "B" } else { "A" }, &line[cut + 1..]);
    let p = api.submit_from(&pipeline(&tampered), Some("octo/kernels"));
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Failed);
    assert!(done.jobs[0].reason.starts_with("encrypted secret `CODECOV_TOKEN`: "), "{}", done.jobs[0].reason);
    // Rotation: a new current key; the old ciphertext still opens.
    let rotated: serde_json::Value = api
        .raw()
        .post(format!("{}/api/v1/secrets-key", api.url))
        .bearer_auth(&server.token)
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_ne!(rotated["recipient"], key["recipient"]);
    assert_eq!(rotated["key_ids"].as_array().unwrap().len(), 2, "{rotated}");
    let p = api.submit_from(&pipeline(&line), Some("octo/kernels"));
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{}", done.jobs[0].reason);
}

/// Issue 14: a secret of a deployment environment reaches only the steps that declare it.
#[test]
fn an_environments_secret_reaches_only_steps_that_declare_the_environment() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let r = api
        .raw()
        .put(format!("{}/api/v1/secrets/PYPI_TOKEN?repository=octo/kernels&environment=release", api.url))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({ "value": "pypi-release-token" }))
        .send()
        .unwrap();
    assert_eq!(r.status(), 204, "{}", r.text().unwrap_or_default());
    let listed =
        api.raw().get(format!("{}/api/v1/secrets", api.url)).bearer_auth(&server.token).send().unwrap().text().unwrap();
    assert!(listed.contains(r#""environment":"release""#) && !listed.contains("pypi-release"), "{listed}");
    let p = api.submit_from(
        r#"
steps:
  - key: publish
    environment: release
    secrets: [PYPI_TOKEN]
    command: test "$PYPI_TOKEN" = pypi-release-token && echo published
  - key: test
    secrets: [PYPI_TOKEN]
    command: echo never
"#,
        Some("octo/kernels"),
    );
    let done = api.wait_pipeline(p.id, T);
    let (publish, test) = (&done.jobs[0], &done.jobs[1]);
    assert_eq!(publish.state, JobState::Succeeded, "{}", publish.reason);
    assert_eq!(api.log_text(publish.id), "published\n");
    assert!(system_lines(&api, publish.id).contains("PYPI_TOKEN (scope: octo/kernels environment release)"));
    assert_eq!(test.state, JobState::Failed);
    assert_eq!(
        test.reason,
        "secret `PYPI_TOKEN` is scoped to octo/kernels environment release; this job is from a pipeline submitted through the API from a work tree of octo/kernels"
    );
}

/// Issue 27 (outsider finding): a `sandbox: none` step of one repository ran beside another
/// repository's job and printed that job's secret into its own log. A job outside the sandbox
/// now shares its agent with no other repository: it waits until the other repository's job
/// has ended (and says for which job), then runs.
#[test]
fn a_job_outside_the_sandbox_never_runs_beside_another_repositorys_job() {
    let dir = tempdir();
    let ledger = shared_dir(&dir, "ledger");
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--slots", "2", "--isolation", isolation(), "--allow-unsandboxed"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    // Repository A: a sandboxed job that runs for a while and prints when it ends.
    let a = api.submit_from(
        "steps:\n  - key: a\n    command: [\"sleep 3\", \"date +%s.%N\"]\n",
        Some("https://github.com/acme/private.git"),
    );
    let a_job = a.jobs[0].id;
    api.wait_job(a_job, "repository A's job to run", T, |j| j.state == JobState::Running);
    // Repository B: a step outside the sandbox, which notes when it starts.
    let b = api.submit_from(
        &format!(
            "steps:\n  - key: b\n    sandbox: none\n    command: [\"date +%s.%N > {}/b-start\"]\n",
            ledger.display()
        ),
        Some("https://github.com/other/public.git"),
    );
    let b_job = b.jobs[0].id;
    let b_done = api.wait_job(b_job, "repository B's job to end", T, |j| j.state.is_terminal());
    assert_eq!(b_done.state, JobState::Succeeded, "{}", b_done.reason);
    let a_done = api.wait_job(a_job, "repository A's job to end", T, |j| j.state.is_terminal());
    assert_eq!(a_done.state, JobState::Succeeded, "{}", a_done.reason);
    let a_end: f64 = api.log_text(a_job).trim().parse().expect("A printed its end");
    let b_start: f64 = std::fs::read_to_string(ledger.join("b-start")).unwrap().trim().parse().unwrap();
    assert!(b_start >= a_end, "B ran outside the sandbox at {b_start} while A ran until {a_end}");
    let said = api.log_system(b_job);
    assert!(
        said.iter().any(|l| l.contains(&format!("waiting for job {a_job} of another repository"))),
        "B's log does not say what it waited for: {said:?}"
    );
}

/// A `gpuci agent` as an unprivileged user (the set-up the Slurm guide recommends), with its
/// own data dir; `None` (with a message) where this machine cannot run one.
fn unprivileged_agent(
    server: &Server,
    root: &std::path::Path,
    name: &str,
    extra: &[&str],
) -> Option<std::process::Child> {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP: starting an agent as another user needs root");
        return None;
    }
    let data = root.join(name);
    std::fs::create_dir_all(&data).unwrap();
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711)).unwrap();
    std::os::unix::fs::chown(&data, Some(65534), Some(65534)).unwrap();
    let child = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--reset-env", "--"])
        .arg(BIN)
        .args(["agent", "--server", &server.url, "--registration-token", &server.registration_token()])
        .arg("--data-dir")
        .arg(&data)
        .args(["--name", name])
        .args(extra)
        .env("GPUCI_LOG", "info")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("setpriv (util-linux)");
    Some(child)
}

/// `gpuci jobs show ID` (with `--json`: its JSON) against `server`.
fn jobs_show(server: &Server, id: i64, json: bool) -> String {
    let out = std::process::Command::new(BIN)
        .args(["jobs", "show", &id.to_string(), "--server", &server.url, "--token", &server.token])
        .args(json.then_some("--json"))
        .output()
        .expect("gpuci jobs show");
    assert!(out.status.success(), "gpuci jobs show {id}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The keys of what a job's agent did not enforce, as `gpuci jobs show --json` has them.
fn unenforced_keys(server: &Server, id: i64) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&jobs_show(server, id, true)).unwrap();
    let list = v["unenforced"].as_array().unwrap_or_else(|| panic!("no `unenforced` list in {v:#}"));
    list.iter().map(|u| u["key"].as_str().unwrap().to_string()).collect()
}

/// Issue 26 (no silent loss of protection): an agent that is not root ran steps with
/// `resources:` limits unenforced, and only the agent's own output said so. Such a step now
/// waits with the reason; with `--allow-unenforced-limits` it runs, and its log says the limits
/// are not enforced. `gpuci jobs show`, its `--json` and the API list what was not enforced
/// for each job: no limits and no disk quota of the job's own.
#[test]
fn limits_an_agent_cannot_enforce_are_refused_unless_the_operator_allowed_them() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let agents = dir.path().join("agents");
    let Some(mut strict) = unprivileged_agent(&server, &agents, "strict", &["--slots", "1"]) else { return };
    let api = server.api();
    api.wait_agents(1, T);
    let limited = "steps:\n  - key: limited\n    resources: {memory: 1GiB}\n    command: [\"echo ran\"]\n";
    let p = api.submit(limited);
    let job = p.jobs[0].id;
    let waiting = api.wait_job(job, "the limited step's reason", T, |j| j.reason.contains("resources:"));
    assert_eq!(waiting.state, JobState::Queued, "{}", waiting.reason);
    assert!(waiting.reason.contains("--allow-unenforced-limits"), "{}", waiting.reason);
    // A step without limits runs there, and its log says that none are enforced.
    let plain = api.submit("steps:\n  - key: plain\n    command: [\"echo ran\"]\n");
    let done = api.wait_job(plain.jobs[0].id, "the plain step", T, |j| j.state.is_terminal());
    assert_eq!(done.state, JobState::Succeeded, "{}", done.reason);
    let said = api.log_system(done.id);
    if said.iter().all(|l| !l.contains("limits:")) {
        // This machine delegates cgroups to unprivileged users: limits hold, nothing to refuse.
        eprintln!("SKIP: an unprivileged agent can make job cgroups here: {said:?}");
        let _ = strict.kill();
        return;
    }
    assert!(said.iter().any(|l| l.contains("no memory, CPU or process limit is enforced")), "{said:?}");
    // An agent that is not root gives no slot a disk of its own either; the log says so too.
    assert!(said.iter().any(|l| l.starts_with("disk_quota: no disk quota")), "{said:?}");
    assert_eq!(unenforced_keys(&server, done.id), ["limits", "disk_quota"]);
    let listed = api.job(done.id).unenforced;
    assert!(listed[0].detail.contains("no memory, CPU or process limit is enforced"), "{listed:?}");
    let _ = strict.kill();
    let _ = strict.wait();

    let Some(mut lenient) =
        unprivileged_agent(&server, &agents, "lenient", &["--slots", "1", "--allow-unenforced-limits"])
    else {
        return;
    };
    let ran = api.wait_job(job, "the limited step on the lenient agent", T, |j| j.state.is_terminal());
    assert_eq!(ran.state, JobState::Succeeded, "{}", ran.reason);
    let said = api.log_system(job);
    assert!(
        said.iter().any(|l| l.contains("resources: are NOT enforced") && l.contains("--allow-unenforced-limits")),
        "{said:?}"
    );
    // What the log says, `gpuci jobs show` says in a block of its own, and so does the API.
    let shown = jobs_show(&server, job, false);
    let block = shown.split_once("NOT enforced:\n").map(|(_, b)| b).unwrap_or_else(|| panic!("{shown}"));
    let limits = block.lines().next().unwrap();
    assert!(
        limits.trim_start().starts_with("limits ")
            && limits.contains("resources: are NOT enforced")
            && limits.contains("--allow-unenforced-limits"),
        "{shown}"
    );
    assert!(block.lines().nth(1).is_some_and(|l| l.trim_start().starts_with("disk_quota ")), "{shown}");
    assert_eq!(unenforced_keys(&server, job), ["limits", "disk_quota"]);
    let listed = api.job(job).unenforced;
    assert!(listed[0].detail.contains("--allow-unenforced-limits"), "{listed:?}");
    let _ = lenient.kill();
    let _ = lenient.wait();
}

/// Issue 26, the other side: a job on a root agent that sets up everything (bubblewrap, job
/// cgroups, a disk and a network namespace per slot) went without nothing, and `gpuci jobs
/// show` and the API list nothing.
#[test]
fn a_job_on_a_fully_enforcing_agent_lists_nothing_unenforced() {
    if !nix::unistd::geteuid().is_root() || isolation() != "bubblewrap" {
        eprintln!("SKIP: a fully enforcing agent needs root and bubblewrap");
        return;
    }
    let (_dir, server, _agent, api) = one_agent("30s", "root", &["--slots", "1", "--isolation", "bubblewrap"]);
    let p = api.submit("steps:\n  - key: limited\n    resources: {memory: 1GiB}\n    command: [\"echo ran\"]\n");
    let done = api.wait_job(p.jobs[0].id, "the job on the root agent", T, |j| j.state.is_terminal());
    assert_eq!(done.state, JobState::Succeeded, "{}", done.reason);
    assert!(done.started_at_ms.is_some());
    assert_eq!(api.job(done.id).unenforced, vec![]);
    assert_eq!(unenforced_keys(&server, done.id), Vec::<String>::new(), "`--json` has the field, empty");
    let shown = jobs_show(&server, done.id, false);
    assert!(!shown.contains("NOT enforced"), "{shown}");
    let said = api.log_system(done.id);
    assert!(!said.iter().any(|l| l.contains("NOT enforced") || l.starts_with("disk_quota:")), "{said:?}");
}
