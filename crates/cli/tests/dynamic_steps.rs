//! Dynamic steps, end to end: a real `gpuci server` and `gpuci agent` (bubblewrap where it is
//! installed), jobs that add steps to their own pipeline through the agent's socket
//! (`GPUCI_API_URL`, with `curl --unix-socket` inside the sandbox, where the test's `gpuci`
//! binary is not), and `gpuci pipeline upload` itself from a job on an agent without
//! isolation. Each security check is made with a token that was live at the time (or is
//! shown live beside it), so it fails if the check it tests were missing.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use gpuci_protocol::api::{JobSummary, PipelineSummary};
use serde_json::json;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);

/// Bash lines that POST `yaml` (as `file_name`) to the job's steps socket with its token,
/// print the answer and its status on one line (`status=201 {...}`), and leave the status in
/// `$code`. They never fail the job by themselves.
fn upload_lines(file_name: &str, yaml: &str) -> String {
    let body = json!({"file_name": file_name, "source": yaml}).to_string();
    format!(
        "cat > /tmp/body.json <<'EOF'\n{body}\nEOF\n\
         code=$(curl -sS --unix-socket \"${{GPUCI_API_URL#unix:}}\" -H \"Authorization: Bearer $GPUCI_JOB_TOKEN\" \
         -H 'Content-Type: application/json' --data-binary @/tmp/body.json -o /tmp/answer -w '%{{http_code}}' http://agent/steps)\n\
         echo \"status=$code $(cat /tmp/answer)\""
    )
}

/// A one-step pipeline whose step runs `script` (bash lines).
fn one_step(key: &str, script: &str) -> String {
    let body: String = script.lines().map(|l| format!("      {l}\n")).collect();
    format!("steps:\n  - key: {key}\n    command: |\n{body}")
}

fn job<'a>(p: &'a PipelineSummary, key: &str) -> &'a JobSummary {
    p.jobs.iter().find(|j| j.step_key == key).unwrap_or_else(|| panic!("no job {key} in {p:#?}"))
}

/// The job token a job printed reversed (`echo "$GPUCI_JOB_TOKEN" | rev`): the log masks it
/// as written, as it masks every secret.
fn token_from_log(api: &Api, job: i64) -> Option<String> {
    api.log_text(job).lines().find(|l| l.ends_with("_boj_icupg")).map(|l| l.chars().rev().collect())
}

fn set_secret(server: &Server, api: &Api, name: &str, value: &str) {
    let r = api
        .raw()
        .put(format!("{}/api/v1/secrets/{name}", api.url))
        .bearer_auth(&server.token)
        .json(&json!({ "value": value }))
        .send()
        .unwrap();
    assert_eq!(r.status(), 204);
}

fn post_steps(api: &Api, job: i64, token: &str, yaml: &str) -> (u16, String) {
    let r = api
        .raw()
        .post(format!("{}/api/v1/jobs/{job}/steps", api.url))
        .bearer_auth(token)
        .json(&json!({"file_name": "gen.yml", "source": yaml}))
        .send()
        .unwrap();
    (r.status().as_u16(), r.text().unwrap())
}

#[test]
fn added_steps_run_in_dependency_order_get_secrets_and_the_pipeline_ends_after_them() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    set_secret(&server, &api, "DEPLOY_KEY", "dk-Val9e7");
    let added = "steps:\n  - key: second\n    depends_on: first\n    command: echo from-second\n\
                 \x20 - key: first\n    depends_on: gen\n    secrets: [DEPLOY_KEY]\n    command: test \"$DEPLOY_KEY\" = dk-Val9e7 && echo from-first\n";
    let script = format!(
        "{}\ntest \"$code\" = 201\necho \"$GPUCI_JOB_TOKEN\" | rev\necho \"$GPUCI_JOB_TOKEN\"",
        upload_lines("gen.yml", added)
    );
    let p = api.submit(&one_step("gen", &script));
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    assert_eq!(done.jobs.len(), 3, "{done:#?}");
    let (gen, first, second) = (job(&done, "gen"), job(&done, "first"), job(&done, "second"));
    for j in [gen, first, second] {
        assert_eq!(j.state, JobState::Succeeded, "{j:#?}\n{}", api.log_text(j.id));
    }
    // Each ran after what it depends on ended: `first` after the uploading job, `second` after `first`.
    assert!(first.started_at_ms.unwrap() >= gen.finished_at_ms.unwrap(), "{first:#?} {gen:#?}");
    assert!(second.started_at_ms.unwrap() >= first.finished_at_ms.unwrap(), "{second:#?} {first:#?}");
    assert!(api.log_text(second.id).contains("from-second"));
    let log = api.log_text(gen.id);
    assert!(log.contains("status=201"), "{log}");
    // The token is masked where the job printed it as it is.
    let token = token_from_log(&api, gen.id).expect("the job printed its token reversed");
    assert!(token.starts_with("gpuci_job_"), "{token}");
    assert!(!log.contains(&token), "the job token leaked into the log: {log}");
    // Its job has ended: the token adds nothing now, even to its own pipeline.
    let (status, body) = post_steps(&api, gen.id, &token, "steps:\n  - key: late\n    command: echo\n");
    assert_eq!(status, 401, "{body}");
    assert_eq!(api.pipeline(p.id).jobs.len(), 3);
    // The upload is in the audit log, with the job as actor.
    let audit = api
        .raw()
        .get(format!("{}/api/v1/audit?action=pipeline.upload", api.url))
        .bearer_auth(&server.token)
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(audit.contains(&format!("job {}", gen.id)) && audit.contains("gen.yml"), "{audit}");
}

#[test]
fn a_job_token_adds_steps_to_its_own_pipeline_while_it_runs_and_opens_nothing_else() {
    let (_dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    set_secret(&server, &api, "HF_TOKEN", "hf-s3cr3t");
    let victim = api.submit(&one_step("victim", "sleep 120"));
    let attacker = api.submit(&one_step("attacker", "echo \"$GPUCI_JOB_TOKEN\" | rev\nsleep 120"));
    let (v, a) = (victim.jobs[0].id, attacker.jobs[0].id);
    api.wait_job(v, "victim runs", T, |j| j.state == JobState::Running);
    api.wait_job(a, "attacker runs", T, |j| j.state == JobState::Running);
    wait_until("the attacker's token in its log", T, || token_from_log(&api, a).is_some());
    let token = token_from_log(&api, a).unwrap();

    // Another pipeline's running job: refused, nothing added.
    let (status, body) = post_steps(&api, v, &token, "steps:\n  - key: planted\n    command: echo\n");
    assert_eq!(status, 401, "{body}");
    assert_eq!(api.pipeline(victim.id).jobs.len(), 1);
    // Nothing else of the API: reading jobs, logs, secrets; submitting; setting a secret.
    let http = api.raw();
    let tries = [
        http.get(format!("{}/api/v1/jobs", api.url)),
        http.get(format!("{}/api/v1/jobs/{v}", api.url)),
        http.get(format!("{}/api/v1/jobs/{v}/logs", api.url)),
        http.get(format!("{}/api/v1/secrets", api.url)),
        http.post(format!("{}/api/v1/pipelines", api.url))
            .json(&json!({"file_name": "x.yml", "source": "steps:\n  - command: env\n    secrets: [HF_TOKEN]\n"})),
        http.put(format!("{}/api/v1/secrets/HF_TOKEN", api.url)).json(&json!({"value": "replaced"})),
        http.post(format!("{}/api/v1/jobs/{v}/cancel", api.url)).json(&json!({})),
    ];
    for t in tries {
        let r = t.bearer_auth(&token).send().unwrap();
        let (status, url) = (r.status().as_u16(), r.url().to_string());
        assert!(status == 401 || status == 403, "{url}: {status} {}", r.text().unwrap());
    }
    assert_eq!(api.job(v).state, JobState::Running, "the victim was not cancelled");
    // The token was live all along: it adds steps to its own pipeline.
    let (status, body) = post_steps(&api, a, &token, "steps:\n  - key: own\n    command: echo own\n");
    assert_eq!(status, 201, "{body}");
    assert!(body.contains("\"own\""), "{body}");
    // Cancelled, its job's token ends with it.
    api.cancel(a);
    api.wait_job(a, "attacker ends", T, |j| j.state.is_terminal());
    let (status, body) = post_steps(&api, a, &token, "steps:\n  - key: after\n    command: echo\n");
    assert_eq!(status, 401, "{body}");
    assert!(!api.pipeline(attacker.id).jobs.iter().any(|j| j.step_key == "after"));
    api.cancel(v);
}

#[test]
fn key_clashes_bad_files_and_too_many_uploads_add_nothing_and_say_why() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let clash = upload_lines("clash.yml", "steps:\n  - key: gen\n    command: echo\n");
    let bad = upload_lines("bad.yml", "steps:\n  - key: x\n    comand: echo\n");
    // 17 uploads of one step each after the two refused ones: refused uploads count too, so
    // the 15th is over the cap of 16 — and a bad file past the cap is not even read.
    let many = "for i in $(seq 1 17); do\n\
                printf '{\"file_name\":\"g.yml\",\"source\":\"steps:\\\\n  - key: k%s\\\\n    command: echo\\\\n\"}' \"$i\" > /tmp/b.json\n\
                c=$(curl -sS --unix-socket \"${GPUCI_API_URL#unix:}\" -H \"Authorization: Bearer $GPUCI_JOB_TOKEN\" -H 'Content-Type: application/json' --data-binary @/tmp/b.json -o /tmp/a -w '%{http_code}' http://agent/steps)\n\
                echo \"upload $i: $c $(cat /tmp/a)\"\n\
                done";
    let late_bad = upload_lines("late.yml", "steps:\n  - key: y\n    comand: echo\n");
    let script = format!("{clash}\n{bad}\n{many}\n{late_bad}");
    let p = api.submit(&one_step("gen", &script));
    let done = api.wait_pipeline(p.id, T);
    let gen = job(&done, "gen");
    let log = api.log_text(gen.id);
    assert_eq!(gen.state, JobState::Succeeded, "{log}");
    let line = |prefix: &str| log.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("{prefix}: {log}"));
    // Key clash: 422 at the key, naming it.
    let clash = line("status=422");
    assert!(clash.contains("`gen` is already used"), "{clash}");
    assert!(clash.contains("\"line\":2") && clash.contains("\"field\":\"steps[0].key\""), "{clash}");
    // A bad file: its position and field.
    let bad = log.lines().filter(|l| l.starts_with("status=422")).nth(1).unwrap_or_else(|| panic!("{log}"));
    assert!(bad.contains("\"file\":\"bad.yml\",\"line\":3,\"column\":5,\"field\":\"steps[0].comand\""), "{bad}");
    for i in 1..=14 {
        assert!(line(&format!("upload {i}: ")).contains(": 201 "), "{log}");
    }
    for i in 15..=17 {
        let over = line(&format!("upload {i}: "));
        assert!(over.contains(": 429 ") && over.contains("16 uploads"), "{over}");
    }
    assert!(line("status=429").contains("16 uploads"), "the late bad file is refused by the cap: {log}");
    // Only the 14 accepted uploads added anything.
    let keys: Vec<&str> = done.jobs.iter().map(|j| j.step_key.as_str()).collect();
    assert_eq!(done.jobs.len(), 15, "{keys:?}");
    assert!(!keys.contains(&"x") && !keys.contains(&"k15") && !keys.contains(&"y"), "{keys:?}");
    assert_eq!(done.state, "succeeded", "{done:#?}");
}

/// A pull request from a fork: its added steps stay untrusted whatever the file says. The
/// pipeline's origin is written into the coordinator's database as the GitHub integration
/// writes it for a fork's pull request (the GitHub tests cover how it gets there).
#[test]
fn a_fork_pull_requests_added_step_gets_no_secret_and_no_unsandboxed_run() {
    let (dir, server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    set_secret(&server, &api, "DEPLOY_KEY", "dk-F0rkVal");
    let wants_secret = "steps:\n  - key: steal\n    secrets: [DEPLOY_KEY]\n    command: echo \"got=$DEPLOY_KEY\"\n";
    let unsandboxed = "steps:\n  - key: escape\n    sandbox: none\n    command: echo out\n";
    // The job waits for its origin to be set (the test does it at once; 5 s is ample).
    let script =
        format!("sleep 5\n{}\n{}", upload_lines("steal.yml", wants_secret), upload_lines("escape.yml", unsandboxed));
    let p = api.submit(&one_step("gen", &script));
    make_fork_pull_request(&dir.path().join("server").join("gpuci.db"), p.id);
    let done = api.wait_pipeline(p.id, T);
    let gen = job(&done, "gen");
    let log = api.log_text(gen.id);
    assert_eq!(gen.state, JobState::Succeeded, "{log}");
    // The step asking for a secret was added, and got none: the pipeline's origin decides.
    let steal = job(&done, "steal");
    assert_eq!(steal.state, JobState::Failed, "{steal:#?}");
    assert!(
        steal.reason.contains("pull request from a fork") && steal.reason.contains("gets no secrets"),
        "{}",
        steal.reason
    );
    assert!(!api.log_text(steal.id).contains("F0rkVal"));
    // `sandbox: none` from an untrusted origin: refused at the field, nothing added.
    let escape = log.lines().filter(|l| l.starts_with("status=")).nth(1).unwrap_or_else(|| panic!("{log}"));
    assert!(escape.starts_with("status=422") && escape.contains("\"field\":\"steps[0].sandbox\""), "{escape}");
    assert!(!done.jobs.iter().any(|j| j.step_key == "escape"), "{done:#?}");
}

/// `gpuci pipeline upload` itself, from a job on an agent without isolation (where the
/// test's binary is in reach): keys on stdout, errors as `file:line:column: field: message`.
#[test]
fn gpuci_pipeline_upload_prints_the_added_keys_and_names_file_line_column_on_error() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--isolation", "none"]);
    let script = format!(
        "printf 'steps:\\n  - key: fine\\n    command: echo fine-ran\\n' > ok.yml\n\
         {BIN} pipeline upload ok.yml\n\
         printf 'steps:\\n  - key: x\\n    comand: echo\\n' > bad.yml\n\
         if {BIN} pipeline upload bad.yml; then echo unexpected; else echo \"exit=$?\"; fi\n\
         printf 'steps:\\n  - key: stdin\\n    command: echo\\n' | {BIN} pipeline upload -"
    );
    let p = api.submit(&one_step("gen", &script));
    let done = api.wait_pipeline(p.id, T);
    let gen = job(&done, "gen");
    let log = api.log_text(gen.id);
    assert_eq!(gen.state, JobState::Succeeded, "{log}");
    assert!(log.lines().any(|l| l == "fine"), "the added key on stdout: {log}");
    assert!(log.contains("bad.yml:3:5: steps[0].comand: "), "{log}");
    assert!(log.contains("exit=2") && !log.contains("unexpected"), "{log}");
    assert!(log.lines().any(|l| l == "stdin"), "{log}");
    let keys: Vec<&str> = done.jobs.iter().map(|j| j.step_key.as_str()).collect();
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(api.log_text(job(&done, "fine").id).contains("fine-ran"));
    assert_eq!(done.state, "succeeded");
}
