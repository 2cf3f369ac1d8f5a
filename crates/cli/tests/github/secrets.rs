//! Secrets and GitHub refs: a secret scoped to a branch, an encrypted secret in the pipeline
//! file, and the values an approved fork gets.

use super::*;

/// Issue 14: a secret scoped to a repository's ref reaches a push to that ref and no other:
/// a push to a feature branch is refused before it runs, naming the secret's scope.
#[test]
fn a_secret_scoped_to_main_reaches_pushes_to_main_and_not_other_branches() {
    let (on_main, on_feature) =
        ("aaaa000000000000000000000000000000000000", "bbbb000000000000000000000000000000000000");
    let pipeline = "steps:\n  - key: release\n    secrets: [RELEASE_TOKEN]\n    command: test \"$RELEASE_TOKEN\" = for-main-only && echo released\n";
    let s = Setup::new("", "1h", |_, gh| {
        gh.set_tree(REPO, on_main, &[(".gpuci.yml", pipeline)]);
        gh.set_tree(REPO, on_feature, &[(".gpuci.yml", pipeline)]);
    });
    s.api
        .raw()
        .put(format!("{}/api/v1/secrets/RELEASE_TOKEN?repository={REPO}&ref=refs/heads/main", s.server.url))
        .bearer_auth(&s.server.token)
        .json(&json!({"value": "for-main-only"}))
        .send()
        .unwrap()
        .error_for_status()
        .unwrap();
    assert_eq!(s.rt.block_on(s.gh.push(REPO, "main", on_main)), 202);
    wait_until_or("the push to main's job", T, || s.jobs().len() == 1, || format!("{:#?}", s.jobs()));
    let job = s.api.wait_job(s.jobs()[0].id, "job ends", T, |j| j.state.is_terminal());
    assert_eq!(job.state, JobState::Succeeded, "{job:#?}");
    assert_eq!(s.api.log_text(job.id), "released\n");

    assert_eq!(s.rt.block_on(s.gh.push(REPO, "feature", on_feature)), 202);
    wait_until_or("the push to feature's job", T, || s.jobs().len() == 2, || format!("{:#?}", s.jobs()));
    let id = s.jobs().iter().map(|j| j.id).max().unwrap();
    let job = s.api.wait_job(id, "job ends", T, |j| j.state.is_terminal());
    assert_eq!(job.state, JobState::Failed, "{job:#?}");
    assert_eq!(
        job.reason,
        format!(
            "secret `RELEASE_TOKEN` is scoped to {REPO} refs/heads/main; this job is from a push to {REPO} refs/heads/feature"
        )
    );
    assert!(s.api.log_text(id).is_empty(), "the refused job ran");
}

/// Issue 14: a secret encrypted in `.gpuci.yml` for `refs/heads/main` opens for pushes to main
/// only: a feature branch is refused with the reason, and an approved pull request from a fork
/// (same file, same ciphertext) gets nothing.
#[test]
fn an_encrypted_secret_in_the_pipeline_file_opens_for_its_ref_and_never_for_a_fork() {
    let (on_main, on_feature, in_fork) = (
        "cccc000000000000000000000000000000000000",
        "dddd000000000000000000000000000000000000",
        "eeee000000000000000000000000000000000000",
    );
    // The coordinator's key exists once it runs; the files are made after it started.
    let s = Setup::new("", "1h", |_, gh| gh.add_collaborator(REPO, "maintainer", "write"));
    let key: Value = s
        .api
        .raw()
        .get(format!("{}/api/v1/secrets-key", s.server.url))
        .bearer_auth(&s.server.token)
        .send()
        .unwrap()
        .json()
        .unwrap();
    let scope =
        gpuci_core::secret_scope::SecretScope::Ref { repository: REPO.into(), pattern: "refs/heads/main".into() };
    let sealed =
        gpuci_repo_secrets::encrypt(key["recipient"].as_str().unwrap(), "DEPLOY_KEY", &scope, "d3pl0y").unwrap();
    let pipeline = format!(
        "steps:\n  - key: deploy\n    secrets:\n      DEPLOY_KEY: \"{sealed}\"\n    command: test \"$DEPLOY_KEY\" = d3pl0y && echo deployed\n"
    );
    for sha in [on_main, on_feature, in_fork] {
        s.gh.set_tree(REPO, sha, &[(".gpuci.yml", pipeline.as_str())]);
    }
    let last = |what: &str, count: usize| {
        wait_until_or(what, T, || s.jobs().len() == count, || format!("{:#?}", s.jobs()));
        let id = s.jobs().iter().map(|j| j.id).max().unwrap();
        s.api.wait_job(id, what, T, |j| j.state.is_terminal())
    };
    assert_eq!(s.rt.block_on(s.gh.push(REPO, "main", on_main)), 202);
    let job = last("the push to main", 1);
    assert_eq!(job.state, JobState::Succeeded, "{job:#?}");
    assert_eq!(s.api.log_text(job.id), "deployed\n");

    assert_eq!(s.rt.block_on(s.gh.push(REPO, "feature", on_feature)), 202);
    let job = last("the push to feature", 2);
    assert_eq!(job.state, JobState::Failed);
    assert_eq!(
        job.reason,
        format!(
            "encrypted secret `DEPLOY_KEY` was encrypted for {REPO} refs/heads/main; this job is from a push to {REPO} refs/heads/feature"
        )
    );

    assert_eq!(s.rt.block_on(s.gh.open_pull_request(REPO, 21, in_fork, true, "mallory", "NONE")), 202);
    assert_eq!(s.rt.block_on(s.gh.add_label(REPO, 21, "run-gpu-ci", "maintainer")), 202);
    let job = last("the approved fork pull request", 3);
    assert_eq!(job.state, JobState::Failed);
    assert!(
        job.reason.contains("pull request from a fork") && job.reason.contains("gets no secrets"),
        "{}",
        job.reason
    );
    assert!(!s.api.log_text(job.id).contains("d3pl0y"), "the fork saw the value");
}

/// Issue 14: the approval policy. An approved pull request from a fork gets exactly the values
/// set for approved forks of its repository (`--approved-forks`), and none of the others.
#[test]
fn an_approved_fork_gets_only_the_values_set_for_approved_forks() {
    let sha = "ffff000000000000000000000000000000000000";
    // A third step snoops: every environment variable of every process it can see, and the
    // files it can read where a secret might lie.
    let pipeline = "steps:\n  - key: coverage\n    secrets: [CODECOV_TOKEN]\n    command: test \"$CODECOV_TOKEN\" = for-approved-forks && echo uploaded\n  - key: deploy\n    secrets: [DEPLOY_KEY]\n    command: echo never\n  - key: snoop\n    command: env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; grep -rsI . \"$HOME\" /tmp /etc/gpuci 2>/dev/null | head -c 100000; true\n";
    let s = Setup::new("", "1h", |_, gh| {
        gh.set_tree(REPO, sha, &[(".gpuci.yml", pipeline)]);
        gh.add_collaborator(REPO, "maintainer", "write");
    });
    let put = |path: &str, value: &str| {
        s.api
            .raw()
            .put(format!("{}/api/v1/secrets/{path}", s.server.url))
            .bearer_auth(&s.server.token)
            .json(&json!({ "value": value }))
            .send()
            .unwrap()
            .error_for_status()
            .unwrap();
    };
    put(&format!("CODECOV_TOKEN?repository={REPO}&approved_forks=true"), "for-approved-forks");
    put(&format!("CODECOV_TOKEN?repository={REPO}"), "for-the-repository-only");
    put(&format!("DEPLOY_KEY?repository={REPO}"), "d3pl0y-never-for-forks");
    assert_eq!(s.rt.block_on(s.gh.open_pull_request(REPO, 31, sha, true, "mallory", "NONE")), 202);
    assert_eq!(s.rt.block_on(s.gh.add_label(REPO, 31, "run-gpu-ci", "maintainer")), 202);
    wait_until_or("the approved pull request's jobs", T, || s.jobs().len() == 3, || format!("{:#?}", s.jobs()));
    let jobs: Vec<_> =
        s.jobs().iter().map(|j| s.api.wait_job(j.id, "job ends", T, |j| j.state.is_terminal())).collect();
    let coverage = jobs.iter().find(|j| j.step_key == "coverage").unwrap();
    let deploy = jobs.iter().find(|j| j.step_key == "deploy").unwrap();
    assert_eq!(coverage.state, JobState::Succeeded, "{coverage:#?}");
    assert_eq!(s.api.log_text(coverage.id), "uploaded\n");
    assert_eq!(deploy.state, JobState::Failed);
    assert!(
        deploy.reason.contains("an approved pull request from a fork")
            && deploy.reason.contains("approved by maintainer"),
        "{}",
        deploy.reason
    );
    for j in &jobs {
        let log = s.api.log_text(j.id);
        assert!(
            !log.contains("for-the-repository-only") && !log.contains("d3pl0y"),
            "job {} saw a secret: {log}",
            j.id
        );
    }
    let snoop = jobs.iter().find(|j| j.step_key == "snoop").unwrap();
    let log = s.api.log_text(snoop.id);
    assert!(log.contains("GPUCI_JOB_ID="), "the snooping step ran: {log}");
    assert!(
        !log.contains("CODECOV_TOKEN=for-approved-forks"),
        "another step's secret reached the snooping step: {log}"
    );
    // The approval that let it have a secret is on the record, with the login that gave it.
    let audit: Vec<serde_json::Value> = s.api.get("/api/v1/audit?action=approval");
    assert!(
        audit.iter().any(|e| e["actor"] == "maintainer"
            && e["actor_kind"] == "github"
            && e["object"].as_str().is_some_and(|o| o.contains("#31") && o.contains(sha))),
        "{audit:?}"
    );
}
