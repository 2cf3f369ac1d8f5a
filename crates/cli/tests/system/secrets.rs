//! Secrets: masked in logs, scoped to their repository, environment and encrypted pipeline-file values.

use super::*;

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
