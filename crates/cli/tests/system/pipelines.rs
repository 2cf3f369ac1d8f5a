//! Pipelines as a user writes them: dependency order, matrix, soft failure, conditions, concurrency groups, retries, caches, and jobs no agent can take.

use super::*;

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
