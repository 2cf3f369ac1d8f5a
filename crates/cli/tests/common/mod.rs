//! The test harness: real `gpuci server` and `gpuci agent` processes on 127.0.0.1 with temp
//! data dirs, and a small API client. Deadlines here bound how long a test waits for an
//! outcome; they never assert speed.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report
#![allow(dead_code)]

use gpuci_gpu::{FakeGpus, SimulatedGpus};
use gpuci_protocol::api::{AgentSummary, JobSummary, PipelineSummary, SubmitPipeline};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

pub const BIN: &str = env!("CARGO_BIN_EXE_gpuci");

pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("gpuci-test-").tempdir().expect("tempdir")
}

/// A directory every uid may write (jobs run as unprivileged uids), under `dir` made 0711.
pub fn shared_dir(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let p = dir.path().join(name);
    std::fs::create_dir_all(&p).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
    p
}

pub struct Server {
    pub child: Child,
    pub url: String,
    pub data_dir: PathBuf,
    pub token: String,
    pub args: Vec<String>,
}

impl Server {
    /// Start a coordinator with short timers (heartbeat 200ms, lost after `lost_after`).
    pub fn start(data_dir: &Path, lost_after: &str) -> Server {
        Self::start_on(
            data_dir,
            "127.0.0.1:0",
            vec!["--heartbeat".into(), "200ms".into(), "--lost-after".into(), lost_after.into()],
        )
    }

    /// A coordinator for fleet tests: quick heartbeats, the fleets' reconcile loop every
    /// `interval`, the server config file `config`.
    pub fn start_fleets(data_dir: &Path, config: &Path, interval: &str) -> Server {
        let args = ["--heartbeat", "200ms", "--fleet-interval", interval, "--config"];
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        args.push(config.display().to_string());
        Server::start_on(data_dir, "127.0.0.1:0", args)
    }

    pub fn start_on(data_dir: &Path, listen: &str, args: Vec<String>) -> Server {
        Self::start_with_env(data_dir, listen, args, &[])
    }

    /// As [`Server::start_on`], with these variables added to the server's environment.
    pub fn start_with_env(data_dir: &Path, listen: &str, args: Vec<String>, env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(BIN)
            .envs(env.iter().copied())
            .arg("server")
            .arg("--listen")
            .arg(listen)
            .arg("--data-dir")
            .arg(data_dir)
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn gpuci server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read url");
        let url = line.trim().to_string();
        assert!(url.starts_with("http://127.0.0.1:"), "server printed {url:?}");
        let token = std::fs::read_to_string(data_dir.join("api-token")).expect("api token").trim().to_string();
        Server { child, url, data_dir: data_dir.to_path_buf(), token, args }
    }

    pub fn registration_token(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("registration-token"))
            .expect("registration token")
            .trim()
            .to_string()
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// kill -9, then start again on the same address with the same data dir.
    pub fn restart_hard(&mut self) {
        self.kill9();
        let listen = self.url.trim_start_matches("http://").to_string();
        let next = Server::start_on(&self.data_dir, &listen, self.args.clone());
        // The old process is already dead; dropping it only reaps again.
        drop(std::mem::replace(self, next));
    }

    pub fn api(&self) -> Api {
        Api::new(&self.url, &self.token)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Agent {
    pub child: Child,
    pub data_dir: PathBuf,
}

impl Agent {
    pub fn start(server: &Server, data_dir: &Path, name: &str, extra: &[&str]) -> Agent {
        Agent::start_with_env(server, data_dir, name, extra, &[])
    }

    /// As [`Agent::start`], with `env` added to the agent's environment.
    pub fn start_with_env(
        server: &Server,
        data_dir: &Path,
        name: &str,
        extra: &[&str],
        env: &[(&str, String)],
    ) -> Agent {
        let child = Command::new(BIN)
            .arg("agent")
            .arg("--server")
            .arg(&server.url)
            .arg("--registration-token")
            .arg(server.registration_token())
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--name")
            .arg(name)
            .args(extra)
            // Without bubblewrap (a developer's machine; never CI) jobs can only run
            // unsandboxed, which an agent does only when told.
            .args(extra.windows(2).any(|w| w == ["--isolation", "none"]).then_some("--allow-unsandboxed"))
            .env("GPUCI_LOG", "info")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn gpuci agent");
        Agent { child, data_dir: data_dir.to_path_buf() }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The agent's reaper (`gpuci_agent::reaper`), once it runs.
    pub fn reaper_pid(&self) -> Option<u32> {
        let agent = self.child.id();
        proc_entries().find_map(|(pid, st)| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            (status_field(&st, "PPid:") == Some(agent) && cmd.split(|b| *b == 0).nth(1) == Some(b"agent-reaper"))
                .then_some(pid)
        })
    }

    /// SIGKILL to the agent and its reaper together (`systemctl kill -s KILL` of its unit):
    /// what its jobs left is then ended only by its next start.
    pub fn kill9_with_reaper(&mut self) {
        let t0 = Instant::now();
        let reaper = loop {
            if let Some(pid) = self.reaper_pid() {
                break pid;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "the agent's reaper never ran");
            std::thread::sleep(Duration::from_millis(50));
        };
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(reaper as i32), nix::sys::signal::Signal::SIGKILL);
        self.kill9();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // A killed agent's slot networks' holders (its `sh -c ...sleep...` children) take their
        // pasta along; this makes sure of it on hosts where they could not (and test runs
        // would pile them up).
        let uids = slot_network_uids(self.child.id());
        self.kill9();
        for uid in uids {
            kill_processes_of_uid(uid);
        }
    }
}

fn proc_entries() -> impl Iterator<Item = (u32, String)> {
    std::fs::read_dir("/proc").into_iter().flatten().flatten().filter_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        Some((pid, std::fs::read_to_string(e.path().join("status")).ok()?))
    })
}

fn status_field(status: &str, field: &str) -> Option<u32> {
    status.lines().find_map(|l| l.strip_prefix(field))?.split_whitespace().next()?.parse().ok()
}

/// The real uids of `agent`'s children that hold slot networks.
fn slot_network_uids(agent: u32) -> Vec<u32> {
    proc_entries()
        .filter(|(_, st)| status_field(st, "PPid:") == Some(agent))
        .filter(|(pid, _)| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.ends_with(b"sleep 86400 & wait $!; done\0"))
        })
        .filter_map(|(_, st)| status_field(&st, "Uid:"))
        .filter(|uid| *uid != 0)
        .collect()
}

fn kill_processes_of_uid(uid: u32) {
    for (pid, st) in proc_entries() {
        if status_field(&st, "Uid:") == Some(uid) {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

pub struct Api {
    http: reqwest::blocking::Client,
    pub url: String,
    token: String,
}

impl Api {
    pub fn new(url: &str, token: &str) -> Api {
        Api {
            http: reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().expect("client"),
            url: url.into(),
            token: token.into(),
        }
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    pub fn submit(&self, yaml: &str) -> PipelineSummary {
        self.submit_from(yaml, None)
    }

    /// As [`Api::submit`], from a work tree of `repository` (as `gpuci submit` says).
    pub fn submit_from(&self, yaml: &str, repository: Option<&str>) -> PipelineSummary {
        let r = self
            .http
            .post(format!("{}/api/v1/pipelines", self.url))
            .bearer_auth(&self.token)
            .json(&SubmitPipeline {
                submission: None,
                build: None,
                file_name: "test.yml".into(),
                source: yaml.into(),
                env: Default::default(),
                workspace_upload: None,
                workspace_archive: None,
                repository: repository.map(str::to_string),
            })
            .send()
            .expect("submit");
        assert_eq!(r.status(), 201, "submit failed: {}", r.text().unwrap_or_default());
        r.json().expect("pipeline json")
    }

    pub fn job(&self, id: i64) -> JobSummary {
        self.get(&format!("/api/v1/jobs/{id}"))
    }

    pub fn pipeline(&self, id: i64) -> PipelineSummary {
        self.get(&format!("/api/v1/pipelines/{id}"))
    }

    pub fn agents(&self) -> Vec<AgentSummary> {
        self.get("/api/v1/agents")
    }

    pub fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        let r = self.http.get(format!("{}{path}", self.url)).bearer_auth(&self.token).send().expect("get");
        let status = r.status();
        assert!(status.is_success(), "GET {path}: {status}: {}", r.text().unwrap_or_default());
        r.json().expect("json")
    }

    pub fn raw(&self) -> &reqwest::blocking::Client {
        &self.http
    }

    pub fn cancel(&self, id: i64) -> JobSummary {
        let r = self
            .http
            .post(format!("{}/api/v1/jobs/{id}/cancel", self.url))
            .bearer_auth(&self.token)
            .json(&serde_json::json!({}))
            .send()
            .expect("cancel");
        assert!(r.status().is_success(), "cancel: {}", r.status());
        r.json().expect("json")
    }

    /// The job's whole log as text (stdout and stderr lines).
    pub fn log_text(&self, id: i64) -> String {
        let r =
            self.http.get(format!("{}/api/v1/jobs/{id}/logs", self.url)).bearer_auth(&self.token).send().expect("logs");
        let body = r.text().expect("body");
        let mut out = String::new();
        for line in body.lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("ndjson");
            if v["type"] == "line" && v["stream"] != "system" {
                out.push_str(v["text"].as_str().unwrap_or_default());
                out.push('\n');
            }
        }
        out
    }

    /// gpuci's own lines in a job's log (stream `system`).
    pub fn log_system(&self, id: i64) -> Vec<String> {
        let r =
            self.http.get(format!("{}/api/v1/jobs/{id}/logs", self.url)).bearer_auth(&self.token).send().expect("logs");
        let body = r.text().expect("body");
        body.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["type"] == "line" && v["stream"] == "system")
            .map(|v| v["text"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// Wait until `pred` holds for the job, or panic with its last state.
    pub fn wait_job(&self, id: i64, what: &str, limit: Duration, pred: impl Fn(&JobSummary) -> bool) -> JobSummary {
        let t0 = Instant::now();
        loop {
            let j = self.job(id);
            if pred(&j) {
                return j;
            }
            if t0.elapsed() > limit {
                panic!("job {id} never became {what}: {j:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn wait_pipeline(&self, id: i64, limit: Duration) -> PipelineSummary {
        let t0 = Instant::now();
        loop {
            let p = self.pipeline(id);
            if p.state != "running" {
                return p;
            }
            if t0.elapsed() > limit {
                panic!("pipeline {id} did not finish: {p:#?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn wait_agents(&self, n: usize, limit: Duration) {
        let t0 = Instant::now();
        while self.agents().iter().filter(|a| a.state == "connected").count() < n {
            assert!(t0.elapsed() < limit, "{n} agents did not connect: {:#?}", self.agents());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Every file under `dir`, recursively (none if it does not exist).
pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else { return out };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Processes whose command line contains `marker`.
pub fn processes_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(marker) {
                found.push(format!("{}: {cmd}", e.file_name().to_string_lossy()));
            }
        }
    }
    found
}

/// A coordinator (agents lost after `lost_after`) and one connected agent started with
/// `args`, in a fresh temp dir: the set-up most system tests share.
pub fn one_agent(lost_after: &str, name: &str, args: &[&str]) -> (tempfile::TempDir, Server, Agent, Api) {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), lost_after);
    let agent = Agent::start(&server, &dir.path().join("agent"), name, args);
    let api = server.api();
    api.wait_agents(1, Duration::from_secs(60));
    (dir, server, agent, api)
}

pub fn wait_until_or(what: &str, limit: Duration, f: impl Fn() -> bool, explain: impl Fn() -> String) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}: {}", explain());
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn wait_until(what: &str, limit: Duration, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Isolation for agents in tests: bubblewrap needs root and bwrap; CI has both.
pub fn isolation() -> &'static str {
    let have =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join("bwrap").exists())).unwrap_or(false);
    match (have, std::env::var("CI").as_deref()) {
        (true, _) => "bubblewrap",
        (false, Ok("true")) => panic!("CI=true but bubblewrap (bwrap) is not installed; run ./scripts/test"),
        (false, _) => {
            eprintln!("note: bubblewrap not installed; system tests run jobs without isolation");
            "none"
        }
    }
}

// ---------------------------------------------------------------------------------------
// In-process coordinator + agent with fake GPUs (tests that make a GPU dirty, or configure
// the coordinator in ways its command line does not reach).

pub struct InProc {
    pub url: String,
    pub token: String,
    pub fake: Arc<FakeGpus>,
    /// UUIDs in device order: placement takes the lowest free index first.
    pub a: String,
    pub b: String,
    pub shutdown: CancellationToken,
    pub agent: tokio::task::JoinHandle<anyhow::Result<()>>,
    pub _dir: tempfile::TempDir,
}

impl InProc {
    pub async fn start(host: &str) -> InProc {
        Self::start_with(host, |_| {}).await
    }

    /// As [`InProc::start`], with the coordinator's config changed by `configure` first.
    pub async fn start_with(host: &str, configure: impl FnOnce(&mut gpuci_coordinator::Config)) -> InProc {
        Self::start_configured(host, configure, |_| {}).await
    }

    /// As [`InProc::start_with`], with the agent's config changed by `agent` too.
    pub async fn start_configured(
        host: &str,
        configure: impl FnOnce(&mut gpuci_coordinator::Config),
        agent: impl FnOnce(&mut gpuci_agent::Config),
    ) -> InProc {
        let dir = tempdir();
        let shutdown = CancellationToken::new();
        let mut config = gpuci_coordinator::Config::new("127.0.0.1:0".parse().unwrap(), dir.path().join("server"));
        config.database = gpuci_coordinator::Database::Memory;
        configure(&mut config);
        let server = gpuci_coordinator::start(config, shutdown.clone()).await.expect("start coordinator");
        let fake = Arc::new(FakeGpus::new(SimulatedGpus::from_spec("2xH100-80GB", host).unwrap().gpus().to_vec()));
        let mut ac = gpuci_agent::Config::new(server.url.clone(), dir.path().join("agent"));
        ac.registration_token = Some(server.registration_token.expose().to_string());
        ac.name = host.to_string();
        ac.slots = 4;
        ac.isolation = gpuci_agent::IsolationPolicy::Auto;
        ac.post_job_timeout = Duration::from_millis(500);
        ac.gpu_backend = Some(fake.clone());
        agent(&mut ac);
        let agent = tokio::spawn(gpuci_agent::run(ac, shutdown.clone()));
        let uuids = fake.uuids();
        InProc {
            url: server.url.clone(),
            token: server.api_token.expose().to_string(),
            fake,
            a: uuids[0].clone(),
            b: uuids[1].clone(),
            shutdown,
            agent,
            _dir: dir,
        }
    }

    pub fn api(&self) -> Api {
        Api::new(&self.url, &self.token)
    }

    /// Makes the blocking API client where it is used: built (or dropped) on a runtime's
    /// worker thread, it panics, so blocking test code calls this inside [`blocking`].
    pub fn api_in_blocking(&self) -> impl Fn() -> Api + Send + 'static {
        let (url, token) = (self.url.clone(), self.token.clone());
        move || Api::new(&url, &token)
    }

    /// The temp dir holding `server/` (the coordinator's data dir) and `agent/`.
    pub fn data_dir(&self) -> &Path {
        self._dir.path()
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.agent).await;
    }
}

/// Run blocking test code (the blocking API client) off the runtime's worker threads.
pub async fn blocking<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Makes pipeline `pipeline` of the coordinator whose SQLite database is `db` come from a pull
/// request from a fork (#7 of `octo/kernels`), written as the GitHub integration writes such an
/// origin (the GitHub tests cover how it gets there). For tests of what untrusted jobs may do;
/// the pipeline's jobs must not have started yet.
#[allow(dead_code)] // not every test binary acts out a fork
pub fn make_fork_pull_request(db: &Path, pipeline: i64) {
    let origin = serde_json::json!({"kind": "github", "repository": "octo/kernels", "sha": "1".repeat(40),
        "event": "pull_request", "pr": 7, "secrets": false})
    .to_string();
    tokio::runtime::Runtime::new().expect("runtime").block_on(async {
        let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(db).busy_timeout(Duration::from_secs(10));
        let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts).await.expect("database");
        sqlx::query("UPDATE pipelines SET origin = ? WHERE id = ?")
            .bind(&origin)
            .bind(pipeline)
            .execute(&mut conn)
            .await
            .expect("origin set");
    });
}
