//! The harness of the GitHub tests: `Setup` (a real coordinator and agent against the test
//! GitHub), fixtures and waits.

use super::*;

pub(crate) const T: Duration = Duration::from_secs(60);
pub(crate) const REPO: &str = "octo/gpu";
pub(crate) const APP_ID: u64 = 4711;
pub(crate) const SECRET: &str = "webhook-secret-for-tests";

pub(crate) fn fixture(name: &str) -> PathBuf {
    PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("../github/tests/fixtures")
        .join(name)
}

/// What is installed at the pool's `install_dir`.
#[derive(Clone, Copy)]
pub(crate) enum Runner {
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
pub(crate) struct Setup {
    pub(crate) rt: tokio::runtime::Runtime,
    pub(crate) gh: TestGitHub,
    pub(crate) _dir: tempfile::TempDir,
    pub(crate) server: Server,
    pub(crate) _agent: Agent,
    pub(crate) api: Api,
}

impl Setup {
    /// `pool` is extra TOML for the one pool (`[[github.pool]]` named `gpu`, labels `gpu`).
    pub(crate) fn new(
        pool: &str,
        reconcile: &str,
        before_server: impl FnOnce(&tokio::runtime::Runtime, &TestGitHub),
    ) -> Setup {
        Setup::with_auth(pool, reconcile, None, before_server)
    }

    /// With `token`, gpuci authenticates with that personal access token instead of the App.
    pub(crate) fn with_auth(
        pool: &str,
        reconcile: &str,
        token: Option<&str>,
        before_server: impl FnOnce(&tokio::runtime::Runtime, &TestGitHub),
    ) -> Setup {
        Setup::build(pool, reconcile, token, Runner::TakesAJob, before_server)
    }

    pub(crate) fn with_runner(pool: &str, runner: Runner) -> Setup {
        Setup::build(pool, "1h", None, runner, |_, _| {})
    }

    pub(crate) fn build(
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
        let config = write_config(dir.path(), &gh, pool, reconcile, token, &runner_dir);
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

    pub(crate) fn github_jobs(&self) -> Vec<Value> {
        self.api.get("/api/v1/github/jobs")
    }

    pub(crate) fn jobs(&self) -> Vec<gpuci_protocol::api::JobSummary> {
        self.api.get("/api/v1/jobs")
    }

    /// Every request gpuci sent, and every response the test server gave, followed GitHub's
    /// published description.
    pub(crate) fn assert_spec_clean(&self) {
        let errors = self.gh.validation_errors();
        assert!(errors.is_empty(), "requests or responses off GitHub's description: {errors:#?}");
    }
}

pub(crate) fn wait_gh_job(
    s: &Setup,
    job_id: u64,
    what: &str,
    pred: impl Fn(&gpuci_github_testserver::JobView) -> bool,
) {
    wait_until_or(
        what,
        T,
        || s.gh.job(job_id).is_some_and(|j| pred(&j)),
        || format!("GitHub job: {:?}\ngpuci: {:#?}\nrecords: {:#?}", s.gh.job(job_id), s.jobs(), s.github_jobs()),
    );
}

pub(crate) const PIPELINE: &str = "steps:\n  - key: build\n    command: echo built\n  - key: publish\n    command: echo \"token=$TOKEN\"\n    secrets: [TOKEN]\n";

pub(crate) fn check_run<'a>(runs: &'a [Value], name: &str, sha: &str) -> Option<&'a Value> {
    runs.iter().find(|r| r["name"] == json!(name) && r["head_sha"] == json!(sha))
}

/// The record of GitHub workflow job `id`, once gpuci has one.
pub(crate) fn record(s: &Setup, id: u64) -> Option<Value> {
    s.github_jobs().into_iter().find(|r| r["id"] == json!(id))
}

pub(crate) fn reason_of(s: &Setup, id: u64) -> String {
    record(s, id).and_then(|r| r["reason"].as_str().map(str::to_string)).unwrap_or_default()
}

pub(crate) const ROOT_REFUSAL: &str = "Must not run interactively with sudo";

/// The server's config file in `dir`: `[github]` pointing at `gh` (App credentials, or the
/// personal access token `token`), with the one pool (`gpu`, labels `gpu`) plus `pool`.
pub(crate) fn write_config(
    dir: &std::path::Path,
    gh: &TestGitHub,
    pool: &str,
    reconcile: &str,
    token: Option<&str>,
    runner_dir: &std::path::Path,
) -> PathBuf {
    let secret_file = dir.join("webhook-secret");
    std::fs::write(&secret_file, SECRET).unwrap();
    let auth = match token {
        None => format!("app_id = {APP_ID}\nprivate_key_file = \"{}\"", fixture("test-app-key.pem").display()),
        Some(t) => {
            let f = dir.join("github-token");
            std::fs::write(&f, format!("{t}\n")).unwrap();
            format!("token_file = \"{}\"", f.display())
        }
    };
    let config = dir.join("gpuci-server.toml");
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
    config
}
