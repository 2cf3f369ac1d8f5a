//! Workflow jobs and Actions runners: webhooks verified, a queued job run on a fresh runner,
//! queue and idle timeouts, reconciliation after downtime, one runner per job, organisation
//! pools, a coordinator restart, retries with back-off when GitHub or a runner fails, and
//! `gpuci doctor`'s check of the runner install.

use super::*;

#[test]
fn webhooks_are_verified_and_unmatched_labels_are_ignored() {
    let s = Setup::new("", "1h", |_, _| {});
    let body = br#"{"action":"queued"}"#;
    let (code, text) = s.rt.block_on(s.gh.send_raw("workflow_job", body, None, "d-unsigned"));
    assert_eq!(code, 401, "unsigned: {text}");
    let forged = format!("sha256={}", "0".repeat(64));
    let (code, text) = s.rt.block_on(s.gh.send_raw("workflow_job", body, Some(&forged), "d-forged"));
    assert_eq!(code, 401, "forged: {text}");
    let good = gpuci_github_testserver::sign_webhook(SECRET, b"{not json");
    let (code, text) = s.rt.block_on(s.gh.send_raw("workflow_job", b"{not json", Some(&good), "d-bad"));
    assert_eq!(code, 400, "unparseable: {text}");
    let (code, text) = s.rt.block_on(s.gh.send_event("star", json!({"action": "created"})));
    assert_eq!(code, 202, "{text}");
    assert!(text.contains("ignored"), "{text}");

    // A job for GitHub-hosted runners, and one with a label the pool lacks: not ours.
    let hosted = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["ubuntu-latest"], "true", true));
    let other = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu", "a100"], "true", true));
    assert_eq!((hosted.status, other.status), (202, 202));
    // A matching job after them is handled, so by the time it has a record the others were seen.
    let ours = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo ours", true));
    wait_gh_job(&s, ours.job_id, "the matching job to complete", |j| j.status == "completed");
    let records = s.github_jobs();
    assert_eq!(records.len(), 1, "only the matching job is recorded: {records:#?}");
    assert_eq!(records[0]["id"], json!(ours.job_id));
    assert_eq!(s.gh.job(hosted.job_id).unwrap().status, "queued", "left to GitHub's own runners");
    assert_eq!(s.gh.job(other.job_id).unwrap().status, "queued");
    assert_eq!(s.gh.runners().len(), 1, "{:#?}", s.gh.runners());
    s.assert_spec_clean();
}

#[test]
fn queued_job_runs_on_a_fresh_runner_with_a_leased_gpu_and_a_redelivery_adds_nothing() {
    let s = Setup::new("max_runners = 2", "1h", |_, _| {});
    let script = "echo \"gpus=$CUDA_VISIBLE_DEVICES\"; ls /dev | grep -c '^nvidia[0-9]' || true";
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], script, true));
    assert_eq!(q.status, 202);
    assert_eq!(s.rt.block_on(s.gh.redeliver(&q.delivery)), 200, "a redelivery is acknowledged");
    assert_eq!(s.rt.block_on(s.gh.redeliver(&q.delivery)), 200);
    wait_gh_job(&s, q.job_id, "the workflow job to succeed", |j| j.conclusion.as_deref() == Some("success"));

    let runners = s.gh.runners();
    assert_eq!(runners.len(), 1, "one runner, however many deliveries: {runners:#?}");
    assert_eq!(runners[0].labels, vec!["self-hosted".to_string(), "gpu".to_string()]);
    assert_eq!(runners[0].jobs_taken, 1);
    assert_eq!(s.gh.job(q.job_id).unwrap().runner_name.as_deref(), Some(runners[0].name.as_str()));

    let runner_jobs: Vec<_> = s.jobs().into_iter().collect();
    assert_eq!(runner_jobs.len(), 1, "{runner_jobs:#?}");
    let job = s.api.wait_job(runner_jobs[0].id, "runner job to finish", T, |j| j.state.is_terminal());
    assert_eq!(job.state, JobState::Succeeded, "{job:#?}");
    assert_eq!(job.gpus.len(), 1, "the runner ran on one leased GPU");
    let log = s.api.log_text(job.id);
    assert!(log.contains("Running job"), "{log}");
    assert!(log.contains(&format!("gpus={}", job.gpus[0])), "the job saw exactly its leased GPU: {log}");
    assert!(!log.contains(&s.server.registration_token()), "{log}");

    let records = s.github_jobs();
    wait_until("the record to complete", T, || s.github_jobs()[0]["state"] == json!("completed"));
    assert_eq!(records[0]["runner_name"], json!(runners[0].name));
    // The GPU is free again for the next runner.
    wait_until("GPUs free", T, || s.api.agents()[0].gpus.iter().all(|g| g.state == "free"));
    s.assert_spec_clean();
}

#[test]
fn a_job_waiting_past_its_queue_timeout_is_cancelled_on_github_with_the_reason() {
    // No agent has an A100: the runner job can never be placed.
    let s = Setup::new("gpu_model = \"A100*\"\nqueue_timeout = \"2s\"", "1h", |_, _| {});
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "true", true));
    wait_until_or("the run to be cancelled", T, || s.gh.run_cancelled(q.run_id), || format!("{:#?}", s.github_jobs()));
    wait_until("the record to say why", T, || s.github_jobs()[0]["state"] == json!("cancelled"));
    let record = &s.github_jobs()[0];
    let reason = record["reason"].as_str().unwrap();
    assert!(reason.contains("no GPU runner after"), "{reason}");
    assert!(reason.contains("A100"), "the scheduler's reason is kept: {reason}");
    let job = s.api.wait_job(record["runner_job_id"].as_i64().unwrap_or(0).max(1), "runner job ends", T, |j| {
        j.state.is_terminal()
    });
    assert_eq!(job.state, JobState::Cancelled, "{job:#?}");
    assert!(s.gh.runners().is_empty(), "no runner was ever registered");
    // The reason is shown where people look.
    let out = std::process::Command::new(BIN)
        .args(["github", "jobs", "--server", &s.server.url, "--token", &s.server.token])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && table.contains("cancelled") && table.contains("no GPU runner after"), "{table}");
    s.assert_spec_clean();
}

#[test]
fn a_webhook_missed_while_the_coordinator_was_down_is_recovered_by_reconciliation() {
    let mut missed = None;
    let s = Setup::new("", "1s", |rt, gh| {
        missed = Some(rt.block_on(gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo recovered", false)));
    });
    let q = missed.unwrap();
    assert_eq!(q.status, 0, "no webhook was sent");
    wait_gh_job(&s, q.job_id, "the missed job to run", |j| j.conclusion.as_deref() == Some("success"));
    assert_eq!(s.gh.runners().len(), 1);
    s.assert_spec_clean();
}

#[test]
fn a_runner_that_never_gets_a_job_is_removed_and_its_gpu_freed() {
    // GitHub says a job is queued, but by the time the runner asks there is none for it (another
    // runner took it, it was re-run elsewhere): the runner would wait forever.
    let s = Setup::new("forks = \"allow\"\nidle_timeout = \"2s\"\nqueue_timeout = \"1h\"", "1h", |_, _| {});
    let payload = json!({
        "action": "queued",
        "workflow_job": {
            "id": 900001, "run_id": 800001, "name": "phantom", "status": "queued", "conclusion": null,
            "labels": ["self-hosted", "gpu"], "runner_id": null, "runner_name": null,
            "runner_group_id": null, "runner_group_name": null, "head_sha": "0123456789abcdef0123456789abcdef01234567",
            "workflow_name": "ci", "head_branch": "main"
        },
        "repository": {"id": 1, "name": "gpu", "full_name": REPO, "owner": {"login": "octo"}, "private": false},
        "sender": {"login": "octo"},
        "installation": {"id": 31}
    });
    let (code, text) = s.rt.block_on(s.gh.send_event("workflow_job", payload));
    assert_eq!(code, 202, "{text}");
    wait_until_or(
        "the idle runner to be deregistered",
        T,
        || s.gh.runners().first().is_some_and(|r| r.deleted),
        || format!("{:#?}\n{:#?}", s.gh.runners(), s.jobs()),
    );
    let job = s.api.wait_job(s.jobs()[0].id, "the runner job to end", T, |j| j.state.is_terminal());
    assert_eq!(job.state, JobState::Cancelled, "{job:#?}");
    assert!(job.reason.contains("took no job"), "{}", job.reason);
    wait_until("GPUs free", T, || s.api.agents()[0].gpus.iter().all(|g| g.state == "free"));
    s.assert_spec_clean();
}

#[test]
fn more_jobs_than_runners_all_run_one_runner_each_and_none_is_left_registered() {
    // Two runners at a time for four jobs: a runner takes whichever matching job is oldest, so
    // runners end up serving jobs other than the one they were queued for.
    let s = Setup::new("max_runners = 2\nforks = \"allow\"", "1h", |_, _| {});
    let queued: Vec<_> = (0..4)
        .map(|i| s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], &format!("echo job {i}"), true)))
        .collect();
    for q in &queued {
        wait_gh_job(&s, q.job_id, "every job to succeed", |j| j.conclusion.as_deref() == Some("success"));
    }
    let runners = s.gh.runners();
    assert_eq!(runners.len(), 4, "one runner per job: {runners:#?}");
    assert!(runners.iter().all(|r| r.jobs_taken == 1 && r.deleted), "each took one job and is gone: {runners:#?}");
    let names: std::collections::BTreeSet<_> =
        queued.iter().map(|q| s.gh.job(q.job_id).unwrap().runner_name.unwrap()).collect();
    assert_eq!(names.len(), 4, "four different runners ran the four jobs");
    wait_until_or(
        "every record completed with its runner",
        T,
        || s.github_jobs().iter().all(|r| r["state"] == json!("completed") && r["runner_name"].is_string()),
        || format!("{:#?}", s.github_jobs()),
    );
    // Never more than two runner jobs at once: their running intervals overlap at most pairwise.
    let jobs = s.jobs();
    assert_eq!(jobs.len(), 4, "{jobs:#?}");
    for j in &jobs {
        let at = j.started_at_ms.unwrap();
        let running =
            jobs.iter().filter(|o| o.started_at_ms.unwrap() <= at && o.finished_at_ms.is_none_or(|f| f > at)).count();
        assert!(running <= 2, "{running} runners at {at}: {jobs:#?}");
    }
    s.assert_spec_clean();
}

#[test]
fn an_org_pool_registers_runners_with_the_organisation() {
    let s = Setup::new("org = \"octo\"\nrunner_group_id = 1\nforks = \"allow\"", "1h", |_, _| {});
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo org", true));
    wait_gh_job(&s, q.job_id, "the job to succeed", |j| j.conclusion.as_deref() == Some("success"));
    let runners = s.gh.runners();
    assert_eq!(runners.len(), 1, "{runners:#?}");
    assert_eq!(runners[0].repo, "octo", "registered at the organisation: {runners:#?}");
    assert!(s.gh.requests().iter().any(|r| r.path == "/orgs/octo/actions/runners/generate-jitconfig"));
    s.assert_spec_clean();
}

#[test]
fn a_coordinator_killed_while_a_runner_works_settles_everything_after_restart() {
    let mut s = Setup::new("forks = \"allow\"", "1s", |_, _| {});
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "sleep 2; echo done", true));
    wait_gh_job(&s, q.job_id, "the runner to take the job", |j| j.status == "in_progress");
    s.server.restart_hard();
    // The `completed` webhook is sent while the coordinator is down, or just after it is back.
    wait_gh_job(&s, q.job_id, "the job to succeed on GitHub", |j| j.conclusion.as_deref() == Some("success"));
    wait_until_or(
        "the record to complete",
        T,
        || s.github_jobs().first().is_some_and(|r| r["state"] == json!("completed")),
        || format!("{:#?}", s.github_jobs()),
    );
    let job = s.api.wait_job(s.jobs()[0].id, "the runner job to end", T, |j| j.state.is_terminal());
    assert_eq!(job.state, JobState::Succeeded, "{job:#?}");
    assert_eq!(s.gh.runners().len(), 1, "no second runner: {:#?}", s.gh.runners());
    wait_until("GPUs free", T, || s.api.agents()[0].gpus.iter().all(|g| g.state == "free"));
    s.assert_spec_clean();
}

/// A coordinator killed between queuing a runner job and recording it on its workflow job (a
/// leader's `kill -9` in a failover): the one that leads next takes that runner job instead of
/// queuing a second for the same workflow job (seen once in CI: three runner jobs for two).
#[test]
fn a_runner_job_queued_but_not_recorded_before_a_kill_is_taken_not_queued_again() {
    // No agent fits the pool: the runner job stays queued.
    let mut s = Setup::new("agents = { rack = \"nowhere\" }", "1s", |_, _| {});
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "true", true));
    wait_until_or(
        "the runner job recorded",
        T,
        || s.github_jobs().first().is_some_and(|r| !r["runner_job_id"].is_null()),
        || format!("{:#?}", s.github_jobs()),
    );
    let runner = s.jobs()[0].id;
    // The crash's window, made: the runner job queued, its workflow job's record without it.
    s.server.kill9();
    let db = s.server.data_dir.join("gpuci.db");
    let out = std::process::Command::new("sqlite3")
        .arg(&db)
        .arg(format!("UPDATE github_jobs SET runner_job_id = NULL WHERE id = {}", q.job_id))
        .output()
        .expect("run sqlite3");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    s.server.restart_hard();
    let api = s.server.api();
    wait_until_or(
        "the runner job recorded again",
        T,
        || s.github_jobs().first().is_some_and(|r| !r["runner_job_id"].is_null()),
        || format!("{:#?}", s.github_jobs()),
    );
    // A few ticks more: nothing else is queued.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let jobs: Vec<gpuci_protocol::api::JobSummary> = api.get("/api/v1/jobs");
    assert_eq!(jobs.iter().filter(|j| j.step_key == "runner").count(), 1, "one runner job: {jobs:#?}");
    assert_eq!(s.github_jobs()[0]["runner_job_id"], serde_json::json!(runner), "{:#?}", s.github_jobs());
}

/// Issue 10, item 4: GitHub revoked the installation token gpuci had cached. The call that
/// got 401 was never retried with a new token, the queued job whose fork check failed was
/// dropped, and every call failed until the cache thought the token expired (up to an hour).
#[test]
fn regression_issue_10_a_revoked_installation_token_is_replaced_and_the_next_job_runs() {
    let s = Setup::new("", "1h", |_, _| {});
    let first = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo first", true));
    wait_gh_job(&s, first.job_id, "the first job to succeed", |j| j.conclusion.as_deref() == Some("success"));
    let issued = s.gh.tokens_issued();

    s.gh.revoke_installation_tokens();
    let second = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo second", true));
    wait_gh_job(&s, second.job_id, "the job after the revocation to succeed", |j| {
        j.conclusion.as_deref() == Some("success")
    });
    assert!(s.gh.tokens_issued() > issued, "a fresh token was minted");
    let refused: Vec<_> = s.gh.requests().into_iter().filter(|r| r.status == 401).collect();
    assert!(!refused.is_empty(), "the revoked token was refused at least once: {:#?}", s.gh.requests());
    assert_eq!(s.gh.runners().len(), 2, "one runner per job: {:#?}", s.gh.runners());
    s.assert_spec_clean();
}

/// Issue 10, item 4: a fork check that fails (GitHub answering 503 for a while) no longer
/// drops the queued job: its record says what failed, and it runs once GitHub answers.
#[test]
fn regression_issue_10_a_failed_fork_check_keeps_the_job_and_it_runs_once_github_answers() {
    let s = Setup::new("runner_backoff = \"1s\"", "1h", |_, gh| {
        gh.inject(Fault::new("GET", "/actions/runs", FaultKind::Status(503)));
    });
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo kept", true));
    assert_eq!(q.status, 202);
    wait_until_or(
        "the record to say the check failed",
        T,
        || {
            let reason = reason_of(&s, q.job_id);
            reason.contains("could not ask GitHub whether the run comes from a fork") && reason.contains("503")
        },
        || format!("{:#?}", s.github_jobs()),
    );
    assert_eq!(record(&s, q.job_id).unwrap()["state"], json!("queued"));
    assert!(s.gh.runners().is_empty(), "no runner before the check passes");
    assert!(s.jobs().is_empty(), "no runner job before the check passes: {:#?}", s.jobs());

    s.gh.clear_faults();
    wait_gh_job(&s, q.job_id, "the kept job to succeed", |j| j.conclusion.as_deref() == Some("success"));
    let runners = s.gh.runners();
    assert_eq!(runners.len(), 1, "{runners:#?}");
    assert_eq!(runners[0].jobs_taken, 1, "the job ran once");
    s.assert_spec_clean();
}

/// Issue 10, item 4: server errors and a secondary rate limit on the way are retried (the
/// rate limit after GitHub's `retry-after`), the job runs once, and GitHub's rate-limit
/// figures show on `GET /api/v1/github/jobs`.
#[test]
fn server_errors_and_a_secondary_rate_limit_are_retried_and_the_job_runs_once() {
    let s = Setup::new("", "1h", |_, gh| {
        // The fork check (reconciliation lists runs too, without `head_sha`).
        gh.inject(Fault::new("GET", "/actions/runs?head_sha=", FaultKind::Status(502)).times(2));
        let limited = FaultKind::SecondaryRateLimit { retry_after: 1 };
        gh.inject(Fault::new("POST", "/actions/runners/generate-jitconfig", limited).times(1));
    });
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo retried", true));
    wait_gh_job(&s, q.job_id, "the job to succeed", |j| j.conclusion.as_deref() == Some("success"));
    let statuses = |part: &str, query: &str| -> Vec<u16> {
        let requests = s.gh.requests().into_iter();
        requests.filter(|r| r.path.ends_with(part) && r.query.starts_with(query)).map(|r| r.status).collect()
    };
    let check = statuses("/actions/runs", "head_sha=");
    assert_eq!(check, vec![502, 502, 200], "the fork check got through on its third try");
    assert_eq!(statuses("/generate-jitconfig", ""), vec![403, 201], "the registration waited out the rate limit");
    let runners = s.gh.runners();
    assert_eq!((runners.len(), runners[0].jobs_taken), (1, 1), "{runners:#?}");
    assert_eq!(s.jobs().len(), 1, "one runner job: {:#?}", s.jobs());

    let r =
        s.api.raw().get(format!("{}/api/v1/github/jobs", s.server.url)).bearer_auth(&s.server.token).send().unwrap();
    let header = |n: &str| r.headers().get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    assert_eq!(header("x-gpuci-github-ratelimit-limit"), "5000");
    let remaining: u64 = header("x-gpuci-github-ratelimit-remaining").parse().unwrap();
    assert!(remaining < 5000, "{remaining}");
    assert!(header("x-gpuci-github-ratelimit-credential").starts_with("installation "), "{:?}", r.headers());
    // The same figures, per credential, on the status endpoint (`gpuci github status`).
    let status: Value = s.api.get("/api/v1/github/status");
    assert_eq!(status["configured"], json!(true));
    let core = status["rate_limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["resource"] == json!("core") && l["credential"].as_str().unwrap().starts_with("installation "))
        .cloned()
        .unwrap_or_else(|| panic!("{status:#}"));
    assert_eq!(core["limit"], json!(5000));
    assert!(core["remaining"].as_u64().unwrap() < 5000, "{status:#}");
    s.assert_spec_clean();
}

/// Issue 10, item 8: a runner whose run.sh exits 0 without taking a job (the real runner
/// refusing to run as root) was replaced at once, forever: one queued job made 87 JIT
/// registrations in 10 s. Now the next runner waits longer after each such exit, and from
/// the third the record says so, with the runner's last stderr line.
#[test]
fn regression_issue_10_a_runner_that_exits_without_a_job_is_retried_with_backoff_and_the_reason_says_so() {
    let s = Setup::with_runner("runner_backoff = \"2s\"\nforks = \"allow\"", Runner::ExitsAtOnce(ROOT_REFUSAL));
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo never", true));
    let expected = format!("runner exited 3 times without taking a job: exit 0, '{ROOT_REFUSAL}'");
    wait_until_or(
        "the record to name the exits",
        T,
        || reason_of(&s, q.job_id).contains(&expected),
        || format!("{:#?}\nregistrations: {}", s.github_jobs(), s.gh.runners().len()),
    );
    // After the third exit the next runner is at least 6 s away: three registrations, a
    // fourth at most if this test was slow to look.
    let runners = s.gh.runners();
    assert!((3..=4).contains(&runners.len()), "registrations stayed bounded: {runners:#?}");
    assert!(runners.iter().filter(|r| r.deleted).count() >= 3, "each runner that exited was removed: {runners:#?}");
    assert!(runners.iter().all(|r| r.jobs_taken == 0));
    assert_eq!(s.gh.job(q.job_id).unwrap().status, "queued", "the workflow job is still GitHub's to give");
    let record = record(&s, q.job_id).unwrap();
    assert_eq!(record["state"], json!("queued"));
    // The runner jobs themselves ended as the runner did.
    let ended = s.jobs().into_iter().filter(|j| j.state == JobState::Succeeded).count();
    assert!(ended >= 3, "{:#?}", s.jobs());
    s.assert_spec_clean();
}

/// Issue 10, item 8, the other way to get there: no runner installed at `install_dir`.
#[test]
fn regression_issue_10_a_runner_that_is_not_installed_is_retried_with_backoff() {
    let s = Setup::with_runner("runner_backoff = \"2s\"\nforks = \"allow\"", Runner::NotInstalled);
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo never", true));
    wait_until_or(
        "the record to name the exits",
        T,
        || reason_of(&s, q.job_id).contains("runner exited 3 times without taking a job"),
        || format!("{:#?}\n{:#?}\nregistrations: {}", s.github_jobs(), s.jobs(), s.gh.runners().len()),
    );
    let runners = s.gh.runners();
    assert!(runners.len() <= 4, "registrations stayed bounded: {runners:#?}");
    eprintln!("reason: {}", reason_of(&s, q.job_id));
    s.assert_spec_clean();
}

/// `gpuci doctor` on an agent host checks the Actions runner install for the unprivileged uid
/// jobs run as: a runner unpacked under a private directory cannot start, and says so.
#[test]
fn doctor_checks_that_the_job_user_can_run_the_runner_install() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempdir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let good = dir.path().join("actions-runner");
    install_fake_runner(&good).unwrap();
    let private = dir.path().join("home");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    install_fake_runner(&private.join("actions-runner")).unwrap();

    let runner_checks = |path: &std::path::Path| -> Vec<(String, String, String)> {
        let out = std::process::Command::new(BIN)
            .args(["doctor", "--json", "--simulate-gpus", "1xH100-80GB", "--runner-dir"])
            .arg(path)
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("doctor --json: {e}\n{}", String::from_utf8_lossy(&out.stderr)));
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["name"].as_str().is_some_and(|n| n.starts_with("runner.")))
            .map(|c| {
                (c["name"].as_str().unwrap().into(), c["status"].as_str().unwrap().into(), c["detail"].to_string())
            })
            .collect()
    };
    let ok = runner_checks(&good);
    assert_eq!(ok.iter().map(|c| c.1.as_str()).collect::<Vec<_>>(), vec!["pass", "pass"], "{ok:#?}");
    let closed = runner_checks(&private.join("actions-runner"));
    let job_user = closed.iter().find(|c| c.0 == "runner.job_user").unwrap();
    assert_eq!(job_user.1, "fail", "{closed:#?}");
    assert!(job_user.2.contains("not searchable by other users"), "{closed:#?}");
    let missing = runner_checks(&dir.path().join("nowhere"));
    assert_eq!(missing[0].1, "fail", "{missing:#?}");
}
