//! GitHub integration, end to end: a real `gpuci server` (with a `[github]` config) and
//! `gpuci agent` (simulated GPUs, bubblewrap), against the GitHub API test server from
//! `gpuci-github-testserver`, which checks every request gpuci sends (and every response it
//! gives) against GitHub's published REST description, sends signed webhooks, and provides a
//! stand-in for the Actions runner's `run.sh` that registers with its JIT config, takes one
//! job, runs it and exits.

// A failed unwrap in a test is the test failing, with the value in the message.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use gpuci_core::job::JobState;
use gpuci_github_testserver::{install_fake_runner, install_runner_that_exits, Fault, FaultKind, Options, TestGitHub};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const REPO: &str = "octo/gpu";
const APP_ID: u64 = 4711;
const SECRET: &str = "webhook-secret-for-tests";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("../github/tests/fixtures")
        .join(name)
}

/// What is installed at the pool's `install_dir`.
#[derive(Clone, Copy)]
enum Runner {
    /// The stand-in that takes one job, runs it and exits.
    TakesAJob,
    /// A `run.sh` that prints this on stderr and exits 0 without asking for a job, as the real
    /// runner does when it will not run as root.
    ExitsAtOnce(&'static str),
    /// Nothing: `install_dir` does not exist on the agent's host.
    NotInstalled,
}

/// A coordinator configured for the test GitHub, one agent with 2 simulated H100s, the
/// runner stand-in installed, and the test GitHub's webhooks pointed at the coordinator.
struct Setup {
    rt: tokio::runtime::Runtime,
    gh: TestGitHub,
    _dir: tempfile::TempDir,
    server: Server,
    _agent: Agent,
    api: Api,
}

impl Setup {
    /// `pool` is extra TOML for the one pool (`[[github.pool]]` named `gpu`, labels `gpu`).
    fn new(pool: &str, reconcile: &str, before_server: impl FnOnce(&tokio::runtime::Runtime, &TestGitHub)) -> Setup {
        Setup::with_auth(pool, reconcile, None, before_server)
    }

    /// With `token`, gpuci authenticates with that personal access token instead of the App.
    fn with_auth(
        pool: &str,
        reconcile: &str,
        token: Option<&str>,
        before_server: impl FnOnce(&tokio::runtime::Runtime, &TestGitHub),
    ) -> Setup {
        Setup::build(pool, reconcile, token, Runner::TakesAJob, before_server)
    }

    fn with_runner(pool: &str, runner: Runner) -> Setup {
        Setup::build(pool, "1h", None, runner, |_, _| {})
    }

    fn build(
        pool: &str,
        reconcile: &str,
        token: Option<&str>,
        runner: Runner,
        before_server: impl FnOnce(&tokio::runtime::Runtime, &TestGitHub),
    ) -> Setup {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let gh = rt.block_on(TestGitHub::start(Options {
            webhook_secret: SECRET.into(),
            app_id: APP_ID,
            app_public_key_pem: Some(std::fs::read_to_string(fixture("test-app-key.pub.pem")).unwrap()),
            personal_token: token.map(str::to_string),
            ..Options::default()
        }));
        gh.add_repo(REPO, 31);
        before_server(&rt, &gh);
        let dir = tempdir();
        // Runner jobs run as a slot's unprivileged uid: the install must be on a path other
        // users may pass through, as a real install_dir is (/opt/actions-runner).
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
        let runner_dir = dir.path().join("actions-runner");
        match runner {
            Runner::TakesAJob => install_fake_runner(&runner_dir).unwrap(),
            Runner::ExitsAtOnce(message) => install_runner_that_exits(&runner_dir, 0, message).unwrap(),
            Runner::NotInstalled => {}
        }
        let secret_file = dir.path().join("webhook-secret");
        std::fs::write(&secret_file, SECRET).unwrap();
        let auth = match token {
            None => format!("app_id = {APP_ID}\nprivate_key_file = \"{}\"", fixture("test-app-key.pem").display()),
            Some(t) => {
                let f = dir.path().join("github-token");
                std::fs::write(&f, format!("{t}\n")).unwrap();
                format!("token_file = \"{}\"", f.display())
            }
        };
        let config = dir.path().join("gpuci-server.toml");
        std::fs::write(
            &config,
            format!(
                r#"
[github]
api_url = "{api}"
{auth}
webhook_secret_file = "{secret}"
reconcile_interval = "{reconcile}"
repositories = ["{REPO}"]

[[github.pool]]
name = "gpu"
labels = ["gpu"]
repositories = ["{REPO}"]
install_dir = "{runner}"
{pool}
"#,
                api = gh.url,
                secret = secret_file.display(),
                runner = runner_dir.display(),
            ),
        )
        .unwrap();
        let server = Server::start_on(
            &dir.path().join("server"),
            "127.0.0.1:0",
            vec![
                "--heartbeat".into(),
                "200ms".into(),
                "--lost-after".into(),
                "30s".into(),
                "--config".into(),
                config.display().to_string(),
            ],
        );
        gh.set_webhook_url(&format!("{}/api/v1/github/webhook", server.url));
        let agent = Agent::start(
            &server,
            &dir.path().join("agent"),
            "gpu-host",
            &[
                "--simulate-gpus",
                "2xH100-80GB",
                "--slots",
                "4",
                "--isolation",
                isolation(),
                // The test GitHub lives on this host's loopback, like a GitHub Enterprise
                // Server on the agent host: the one port jobs may reach there.
                "--job-host-port",
                gh.url.rsplit(':').next().unwrap().trim_end_matches('/'),
            ],
        );
        let api = server.api();
        api.wait_agents(1, T);
        Setup { rt, gh, _dir: dir, server, _agent: agent, api }
    }

    fn github_jobs(&self) -> Vec<Value> {
        self.api.get("/api/v1/github/jobs")
    }

    fn jobs(&self) -> Vec<gpuci_protocol::api::JobSummary> {
        self.api.get("/api/v1/jobs")
    }

    /// Every request gpuci sent, and every response the test server gave, followed GitHub's
    /// published description.
    fn assert_spec_clean(&self) {
        let errors = self.gh.validation_errors();
        assert!(errors.is_empty(), "requests or responses off GitHub's description: {errors:#?}");
    }
}

fn wait_gh_job(s: &Setup, job_id: u64, what: &str, pred: impl Fn(&gpuci_github_testserver::JobView) -> bool) {
    wait_until_or(
        what,
        T,
        || s.gh.job(job_id).is_some_and(|j| pred(&j)),
        || format!("GitHub job: {:?}\ngpuci: {:#?}\nrecords: {:#?}", s.gh.job(job_id), s.jobs(), s.github_jobs()),
    );
}

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

const PIPELINE: &str = "steps:\n  - key: build\n    command: echo built\n  - key: publish\n    command: echo \"token=$TOKEN\"\n    secrets: [TOKEN]\n";

fn check_run<'a>(runs: &'a [Value], name: &str, sha: &str) -> Option<&'a Value> {
    runs.iter().find(|r| r["name"] == json!(name) && r["head_sha"] == json!(sha))
}

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

/// The record of GitHub workflow job `id`, once gpuci has one.
fn record(s: &Setup, id: u64) -> Option<Value> {
    s.github_jobs().into_iter().find(|r| r["id"] == json!(id))
}

fn reason_of(s: &Setup, id: u64) -> String {
    record(s, id).and_then(|r| r["reason"].as_str().map(str::to_string)).unwrap_or_default()
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

const ROOT_REFUSAL: &str = "Must not run interactively with sudo";

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
