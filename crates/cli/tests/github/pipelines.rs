//! gpuci pipelines from pushes and pull requests: run from the commit's tarball, reported as
//! check runs or commit statuses, forks waiting for approval per SHA, a new push superseding
//! the previous run, and a fork unable to poison the cache of later pushes.

use super::*;

#[test]
fn fork_pull_request_waits_for_approval_per_sha_and_never_sees_a_secret() {
    let (sha1, sha2) = ("1111111111111111111111111111111111111111", "2222222222222222222222222222222222222222");
    let s = Setup::new("", "1h", |_, gh| {
        gh.set_tree(REPO, sha1, &[(".gpuci.yml", PIPELINE), ("README.md", "fork change 1\n")]);
        gh.set_tree(REPO, sha2, &[(".gpuci.yml", PIPELINE), ("README.md", "fork change 2\n")]);
        gh.add_collaborator(REPO, "maintainer", "write");
    });
    s.api
        .raw()
        .put(format!("{}/api/v1/secrets/TOKEN", s.server.url))
        .bearer_auth(&s.server.token)
        .json(&json!({"value": "s3cr3t-value"}))
        .send()
        .unwrap()
        .error_for_status()
        .unwrap();

    assert_eq!(s.rt.block_on(s.gh.open_pull_request(REPO, 7, sha1, true, "mallory", "NONE")), 202);
    wait_until_or(
        "a pending 'waiting for approval' check",
        T,
        || check_run(&s.gh.check_runs(REPO), "gpuci", sha1).is_some(),
        || format!("{:#?}", s.gh.check_runs(REPO)),
    );
    let runs = s.gh.check_runs(REPO);
    let waiting = check_run(&runs, "gpuci", sha1).unwrap();
    assert_eq!(waiting["status"], json!("queued"), "never green while waiting: {waiting:#}");
    assert!(waiting["output"]["title"].as_str().unwrap().contains("waiting for approval"), "{waiting:#}");
    assert!(s.jobs().is_empty(), "nothing runs before approval");

    // The author labels their own PR: not an approval.
    assert_eq!(s.rt.block_on(s.gh.add_label(REPO, 7, "run-gpu-ci", "mallory")), 202);
    // A maintainer approves: the pipeline runs for sha1 and the label is spent.
    assert_eq!(s.rt.block_on(s.gh.add_label(REPO, 7, "run-gpu-ci", "maintainer")), 202);
    wait_until_or("the approved pipeline's jobs", T, || s.jobs().len() == 2, || format!("{:#?}", s.jobs()));
    for j in s.jobs() {
        s.api.wait_job(j.id, "job ends", T, |j| j.state.is_terminal());
    }
    let jobs = s.jobs();
    let build = jobs.iter().find(|j| j.step_key == "build").unwrap();
    let publish = jobs.iter().find(|j| j.step_key == "publish").unwrap();
    assert_eq!(build.state, JobState::Succeeded, "{build:#?}");
    assert_eq!(publish.state, JobState::Failed, "{publish:#?}");
    assert!(
        publish.reason.contains("pull request from a fork") && publish.reason.contains("gets no secrets"),
        "{}",
        publish.reason
    );
    for j in &jobs {
        assert!(!s.api.log_text(j.id).contains("s3cr3t"), "job {} saw the secret", j.id);
    }
    assert!(s.gh.labels(REPO, 7).is_empty(), "gpuci removes the approval label once it starts the run");
    let runs = s.gh.check_runs(REPO);
    let approved = runs.iter().rev().find(|r| r["name"] == json!("gpuci") && r["head_sha"] == json!(sha1)).unwrap();
    assert_eq!(approved["conclusion"], json!("success"), "approval settles the waiting entry: {approved:#}");
    assert!(approved["output"]["title"].as_str().unwrap().contains("approved by maintainer"), "{approved:#}");
    wait_until_or(
        "check runs for both jobs to complete",
        T,
        || {
            let runs = s.gh.check_runs(REPO);
            ["gpuci / build", "gpuci / publish"]
                .iter()
                .all(|n| check_run(&runs, n, sha1).is_some_and(|r| r["status"] == json!("completed")))
        },
        || format!("{:#?}", s.gh.check_runs(REPO)),
    );
    let runs = s.gh.check_runs(REPO);
    assert_eq!(check_run(&runs, "gpuci / build", sha1).unwrap()["conclusion"], json!("success"));
    assert_eq!(check_run(&runs, "gpuci / publish", sha1).unwrap()["conclusion"], json!("failure"));

    // A new push to the approved PR: not approved.
    assert_eq!(s.rt.block_on(s.gh.push_to_pull_request(REPO, 7, sha2)), 202);
    wait_until_or(
        "sha2 to wait for approval",
        T,
        || check_run(&s.gh.check_runs(REPO), "gpuci", sha2).is_some(),
        || format!("{:#?}", s.gh.check_runs(REPO)),
    );
    assert_eq!(s.jobs().len(), 2, "the new head SHA did not run");
    s.assert_spec_clean();
}

#[test]
fn a_push_runs_the_commits_pipeline_from_its_tarball_and_reports_check_runs() {
    let sha = "3333333333333333333333333333333333333333";
    let pipeline =
        "steps:\n  - key: test\n    command: cat src/version.txt && test \"$GITHUB_SHA\" = \"$(cat src/sha.txt)\"\n";
    let s = Setup::new("", "1h", |_, gh| {
        gh.set_tree(REPO, sha, &[(".gpuci.yml", pipeline), ("src/version.txt", "v1.2.3\n"), ("src/sha.txt", sha)]);
    });
    assert_eq!(s.rt.block_on(s.gh.push(REPO, "main", sha)), 202);
    wait_until_or("the pipeline's job", T, || s.jobs().len() == 1, || format!("{:#?}", s.jobs()));
    let job = s.api.wait_job(s.jobs()[0].id, "job ends", T, |j| j.state.is_terminal());
    assert_eq!(job.state, JobState::Succeeded, "{job:#?}\n{}", s.api.log_text(job.id));
    assert!(s.api.log_text(job.id).contains("v1.2.3"), "the workspace is the repository at the commit");
    wait_until_or(
        "a successful check run",
        T,
        || check_run(&s.gh.check_runs(REPO), "gpuci / test", sha).is_some_and(|r| r["conclusion"] == json!("success")),
        || format!("{:#?}", s.gh.check_runs(REPO)),
    );
    let run = s.gh.check_runs(REPO).into_iter().find(|r| r["name"] == json!("gpuci / test")).unwrap();
    assert!(run["details_url"].as_str().unwrap().ends_with(&format!("/ui/jobs/{}", job.id)), "{run:#}");
    // The builds list names the push's commit subject and author, from the webhook.
    let page = s
        .api
        .raw()
        .get(format!("{}/ui/", s.server.url))
        .bearer_auth(&s.server.token)
        .send()
        .and_then(|r| r.text())
        .expect("builds page");
    assert!(page.contains("test commit") && page.contains("test-pusher"), "no subject or author:\n{page}");
    s.assert_spec_clean();
}

#[test]
fn with_a_personal_token_results_go_back_as_commit_statuses() {
    let sha = "4444444444444444444444444444444444444444";
    let s = Setup::with_auth("forks = \"allow\"", "1h", Some("ghp_test_personal_token"), |_, gh| {
        gh.set_tree(REPO, sha, &[(".gpuci.yml", "steps:\n  - key: unit\n    command: echo ok\n")]);
    });
    // Runners work with a token too.
    let q = s.rt.block_on(s.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "echo via-pat", true));
    wait_gh_job(&s, q.job_id, "the job to succeed", |j| j.conclusion.as_deref() == Some("success"));
    assert_eq!(s.rt.block_on(s.gh.push(REPO, "main", sha)), 202);
    wait_until_or(
        "a success status",
        T,
        || {
            s.gh.statuses(REPO, sha)
                .iter()
                .any(|st| st["context"] == json!("gpuci/unit") && st["state"] == json!("success"))
        },
        || format!("{:#?}", s.gh.statuses(REPO, sha)),
    );
    assert!(s.gh.check_runs(REPO).is_empty(), "no check runs without an App");
    assert!(s.gh.requests().iter().all(|r| !r.path.contains("/access_tokens")), "a token needs no installation tokens");
    s.assert_spec_clean();
}

#[test]
fn a_new_push_to_a_pull_request_cancels_its_previous_run() {
    let (sha1, sha2) = ("5555555555555555555555555555555555555555", "6666666666666666666666666666666666666666");
    let slow = "steps:\n  - key: test\n    command: sleep 30\n";
    let s = Setup::new("", "1h", |_, gh| {
        gh.set_tree(REPO, sha1, &[(".gpuci.yml", slow)]);
        gh.set_tree(REPO, sha2, &[(".gpuci.yml", "steps:\n  - key: test\n    command: echo second\n")]);
    });
    // A collaborator's pull request from a branch of the repository runs without approval.
    assert_eq!(s.rt.block_on(s.gh.open_pull_request(REPO, 9, sha1, false, "octo", "COLLABORATOR")), 202);
    wait_until_or(
        "the first run to start",
        T,
        || s.jobs().first().is_some_and(|j| j.state == JobState::Running),
        || format!("{:#?}", s.jobs()),
    );
    let first = s.jobs()[0].id;
    assert_eq!(s.rt.block_on(s.gh.push_to_pull_request(REPO, 9, sha2)), 202);
    let old = s.api.wait_job(first, "the superseded job to end", T, |j| j.state.is_terminal());
    assert_eq!(old.state, JobState::Cancelled, "{old:#?}");
    assert!(old.reason.contains("concurrency group"), "{}", old.reason);
    wait_until_or(
        "the new run to succeed",
        T,
        || s.jobs().iter().any(|j| j.id != first && j.state == JobState::Succeeded),
        || format!("{:#?}", s.jobs()),
    );
    wait_until_or(
        "check runs: first cancelled, second green",
        T,
        || {
            let runs = s.gh.check_runs(REPO);
            check_run(&runs, "gpuci / test", sha1).is_some_and(|r| r["conclusion"] == json!("cancelled"))
                && check_run(&runs, "gpuci / test", sha2).is_some_and(|r| r["conclusion"] == json!("success"))
        },
        || format!("{:#?}", s.gh.check_runs(REPO)),
    );
    s.assert_spec_clean();
}

/// Issue 9, cache poisoning: a fork's pull request shared the push pipelines' cache, so a
/// script it planted there ran in the next trusted push. It may read main's cache, never write it.
#[test]
fn cache_poisoning_a_fork_pull_request_cannot_plant_files_for_later_pushes() {
    let (base, fork, later) = (
        "7777777777777777777777777777777777777777",
        "8888888888888888888888888888888888888888",
        "9999999999999999999999999999999999999999",
    );
    let step = |command: &str| format!("steps:\n  - key: test\n    cache: [cache]\n    command: {command:?}\n");
    let (on_main, in_fork, next_push) = (
        step("mkdir -p cache && echo from-main > cache/base.txt"),
        step("cat cache/base.txt && echo 'echo pwned' > cache/evil.sh && (chmod 4755 cache/evil.sh || true)"),
        step("cat cache/base.txt && test ! -e cache/evil.sh && echo no-planted-script"),
    );
    let s = Setup::new("", "1h", |_, gh| {
        gh.set_tree(REPO, base, &[(".gpuci.yml", on_main.as_str())]);
        gh.set_tree(REPO, fork, &[(".gpuci.yml", in_fork.as_str())]);
        gh.set_tree(REPO, later, &[(".gpuci.yml", next_push.as_str())]);
        gh.add_collaborator(REPO, "maintainer", "write");
    });
    let run = |count: usize, what: &str| {
        wait_until_or(what, T, || s.jobs().len() == count, || format!("{:#?}", s.jobs()));
        let id = s.jobs().iter().map(|j| j.id).max().unwrap();
        let job = s.api.wait_job(id, what, T, |j| j.state.is_terminal());
        let log = s.api.log_text(id);
        assert_eq!(job.state, JobState::Succeeded, "{what}: {job:#?}\n{log}");
        log
    };

    assert_eq!(s.rt.block_on(s.gh.push(REPO, "main", base)), 202);
    run(1, "the push to main fills main's cache");

    assert_eq!(s.rt.block_on(s.gh.open_pull_request(REPO, 11, fork, true, "mallory", "NONE")), 202);
    assert_eq!(s.rt.block_on(s.gh.add_label(REPO, 11, "run-gpu-ci", "maintainer")), 202);
    let log = run(2, "the approved fork pull request");
    assert!(log.contains("from-main"), "a pull request reads its base branch's cache:\n{log}");

    assert_eq!(s.rt.block_on(s.gh.push(REPO, "main", later)), 202);
    let log = run(3, "the next push to main");
    assert!(log.contains("from-main"), "main's own cache is still there:\n{log}");
    assert!(log.contains("no-planted-script"), "{log}");
    s.assert_spec_clean();
}
