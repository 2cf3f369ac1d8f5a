//! Benchmark: GitHub `workflow_job.queued` webhook → Actions runner process started, on a warm
//! host with free GPUs.
//!
//! Set-up (as in `crates/cli/tests/github.rs`): the GitHub API test server
//! (`gpuci-github-testserver`) on 127.0.0.1, a real `gpuci server --config FILE` with a `[github]`
//! section and one `[[github.pool]]` whose `install_dir` holds the runner stand-in, and a real
//! `gpuci agent --simulate-gpus 2xH100-80GB --isolation bubblewrap`, all from the release binary.
//! Jobs are queued one at a time (each waits until the previous one has finished and its GPU is
//! free again), so every figure is latency, not queueing. Each job's script is `true`.
//!
//! Per job, from the wall clock just before the test server sends the webhook (t0):
//! - "process spawned": the runner job's `started_at_ms` in gpuci, minus t0: the agent's
//!   `Sandbox::spawn` returned, i.e. bwrap was exec'd inside the job's cgroups (before its mounts).
//!   Millisecond resolution (gpuci stores ms, truncated).
//! - "run.sh running": the runner's `run.sh` printed `$EPOCHREALTIME` as its first act (the bench
//!   adds that line to the installed stand-in; a bash builtin), minus t0: bwrap's set-up done and
//!   bash started, as in `gpuci bench dispatch`.
//! - "first GitHub request": the runner stand-in's first `acquire` call to the test server, minus t0
//!   (its process is up and talking to "GitHub"; includes the stand-in's own `base64`, `date`,
//!   `mkdir` and `curl` processes).
//! - "webhook answered": the 202 reply to the delivery (the delivery record is durable by then).
//!
//! Run both fork policies: `forks = "deny"` (the default; one more GitHub API round trip to check
//! the run's head repository) and `forks = "allow"`.
//!
//! ```text
//! cargo build --release -p gpuci
//! cargo build --release -p gpuci --example bench_github
//! /var/tmp/gpuci-target/release/examples/bench_github --jobs 200 --forks both
//! ```
//!
//! Options: `--gpuci PATH` (default `/var/tmp/gpuci-target/release/gpuci`), `--jobs N` (200),
//! `--warmup N` (5, not counted), `--forks deny|allow|both` (both), `--isolation
//! bubblewrap|none` (bubblewrap). Needs root for bubblewrap and cgroups, as the agent does.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use gpuci_github_testserver::{install_fake_runner, Options, TestGitHub};
use gpuci_protocol::api::{AgentSummary, JobSummary};
use serde_json::Value;

const REPO: &str = "octo/gpu";
const APP_ID: u64 = 4711;
const SECRET: &str = "webhook-secret-for-bench";
const LIMIT: Duration = Duration::from_secs(60);
const MARK: &str = "gpuci-bench-start ";
const POLL: Duration = Duration::from_millis(5);

struct Args {
    gpuci: PathBuf,
    jobs: usize,
    warmup: usize,
    forks: Vec<&'static str>,
    isolation: String,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        gpuci: PathBuf::from("/var/tmp/gpuci-target/release/gpuci"),
        jobs: 200,
        warmup: 5,
        forks: vec!["deny", "allow"],
        isolation: "bubblewrap".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| anyhow!("{flag} needs a value"));
        match flag.as_str() {
            "--gpuci" => a.gpuci = PathBuf::from(value()?),
            "--jobs" => a.jobs = value()?.parse().context("--jobs")?,
            "--warmup" => a.warmup = value()?.parse().context("--warmup")?,
            "--forks" => {
                a.forks = match value()?.as_str() {
                    "deny" => vec!["deny"],
                    "allow" => vec!["allow"],
                    "both" => vec!["deny", "allow"],
                    other => bail!("--forks: deny, allow or both, not {other:?}"),
                }
            }
            "--isolation" => a.isolation = value()?,
            "-h" | "--help" => {
                println!(
                    "bench_github [--gpuci PATH] [--jobs N] [--warmup N] [--forks deny|allow|both] [--isolation bubblewrap|none]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}"),
        }
    }
    if a.jobs == 0 {
        bail!("--jobs must be at least 1");
    }
    Ok(a)
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../github/tests/fixtures").join(name)
}

fn wall_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64() * 1000.0).unwrap_or(0.0)
}

fn wait_for<T>(what: &str, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        if t0.elapsed() > LIMIT {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(POLL);
    }
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Api {
    http: reqwest::blocking::Client,
    url: String,
    token: String,
}

impl Api {
    fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T> {
        let r = self.http.get(format!("{}{path}", self.url)).bearer_auth(&self.token).send()?;
        if !r.status().is_success() {
            bail!("GET {path}: {}", r.status());
        }
        Ok(r.json()?)
    }

    /// The wall-clock ms `run.sh` printed as its first line, from the job's log.
    fn run_sh_start_ms(&self, job: i64) -> Result<f64> {
        let r = self.http.get(format!("{}/api/v1/jobs/{job}/logs", self.url)).bearer_auth(&self.token).send()?;
        for line in r.text()?.lines() {
            let v: Value = serde_json::from_str(line)?;
            if let Some(t) = v["text"].as_str().and_then(|t| t.trim().strip_prefix(MARK)) {
                return Ok(t.parse::<f64>().with_context(|| format!("{MARK}{t}"))? * 1000.0);
            }
        }
        bail!("job {job}: no {MARK:?} line in the log")
    }
}

/// Test GitHub, coordinator and one agent, as in `crates/cli/tests/github.rs`.
struct Setup {
    rt: tokio::runtime::Runtime,
    gh: TestGitHub,
    api: Api,
    _agent: Proc,
    _server: Proc,
    dir: tempfile::TempDir,
}

impl Setup {
    fn new(args: &Args, forks: &str) -> Result<Setup> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let gh = rt.block_on(TestGitHub::start(Options {
            webhook_secret: SECRET.into(),
            app_id: APP_ID,
            app_public_key_pem: Some(std::fs::read_to_string(fixture("test-app-key.pub.pem"))?),
            ..Options::default()
        }));
        gh.add_repo(REPO, 31);
        let dir = tempfile::Builder::new().prefix("gpuci-bench-github-").tempdir()?;
        let runner_dir = dir.path().join("actions-runner");
        install_fake_runner(&runner_dir)?;
        // The stand-in's first act prints the time (a bash builtin, no extra process), as
        // `gpuci bench dispatch` does: "run.sh is running".
        let run_sh = runner_dir.join("run.sh");
        let text = std::fs::read_to_string(&run_sh)?;
        let (shebang, rest) = text.split_once('\n').context("run.sh is empty")?;
        std::fs::write(&run_sh, format!("{shebang}\necho \"{MARK}$EPOCHREALTIME\"\n{rest}"))?;
        let secret_file = dir.path().join("webhook-secret");
        std::fs::write(&secret_file, SECRET)?;
        let config = dir.path().join("gpuci-server.toml");
        std::fs::write(
            &config,
            format!(
                r#"
[github]
api_url = "{api}"
app_id = {APP_ID}
private_key_file = "{key}"
webhook_secret_file = "{secret}"
reconcile_interval = "1h"
repositories = ["{REPO}"]

[[github.pool]]
name = "gpu"
labels = ["gpu"]
repositories = ["{REPO}"]
install_dir = "{runner}"
forks = "{forks}"
"#,
                api = gh.url,
                key = fixture("test-app-key.pem").display(),
                secret = secret_file.display(),
                runner = runner_dir.display(),
            ),
        )?;
        let data = dir.path().join("server");
        let mut server = Proc(
            Command::new(&args.gpuci)
                .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
                .arg(&data)
                .args(["--heartbeat", "200ms", "--lost-after", "30s", "--config"])
                .arg(&config)
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(dir.path().join("server.log"))?)
                .spawn()
                .with_context(|| format!("spawn {} server", args.gpuci.display()))?,
        );
        let mut line = String::new();
        BufReader::new(server.0.stdout.take().context("server stdout")?).read_line(&mut line)?;
        let url = line.trim().to_string();
        if !url.starts_with("http://127.0.0.1:") {
            bail!("server printed {url:?}; see {}", dir.path().join("server.log").display());
        }
        let token = std::fs::read_to_string(data.join("api-token"))?.trim().to_string();
        let registration = std::fs::read_to_string(data.join("registration-token"))?.trim().to_string();
        gh.set_webhook_url(&format!("{url}/api/v1/github/webhook"));
        let agent = Proc(
            Command::new(&args.gpuci)
                .args(["agent", "--server", &url, "--registration-token", &registration, "--data-dir"])
                .arg(dir.path().join("agent"))
                .args(["--name", "gpu-host", "--simulate-gpus", "2xH100-80GB", "--slots", "4"])
                .args(["--isolation", &args.isolation])
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.path().join("agent.log"))?)
                .spawn()
                .context("spawn gpuci agent")?,
        );
        let api = Api { http: reqwest::blocking::Client::builder().timeout(LIMIT).build()?, url, token };
        wait_for("the agent to connect", || {
            let agents: Vec<AgentSummary> = api.get("/api/v1/agents")?;
            Ok(agents.iter().any(|a| a.state == "connected").then_some(()))
        })?;
        Ok(Setup { rt, gh, api, _agent: agent, _server: server, dir })
    }

    /// Queues one workflow job (webhook sent), waits until it has run and the host is idle again,
    /// and returns ms after t0.
    fn one(&self) -> Result<Sample> {
        let t0_wall = SystemTime::now();
        let t0 = Instant::now();
        let q = self.rt.block_on(self.gh.queue_workflow_job(REPO, &["self-hosted", "gpu"], "true", true));
        let answered = t0.elapsed().as_secs_f64() * 1000.0;
        if q.status != 202 {
            bail!("webhook answered {}", q.status);
        }
        let gh_job = wait_for("the workflow job to complete on GitHub", || {
            Ok(self.gh.job(q.job_id).filter(|j| j.status == "completed"))
        })?;
        if gh_job.conclusion.as_deref() != Some("success") {
            bail!("workflow job {} concluded {:?}", q.job_id, gh_job.conclusion);
        }
        let runner_name = gh_job.runner_name.context("completed job without a runner")?;
        let runner_job = wait_for("gpuci's record to complete", || {
            let records: Vec<Value> = self.api.get("/api/v1/github/jobs")?;
            let rec = records.into_iter().find(|r| r["id"].as_u64() == Some(q.job_id));
            Ok(rec.filter(|r| r["state"] == "completed").and_then(|r| r["runner_job_id"].as_i64()))
        })?;
        let job = wait_for("the runner job to finish", || {
            let j: JobSummary = self.api.get(&format!("/api/v1/jobs/{runner_job}"))?;
            Ok(j.state.is_terminal().then_some(j))
        })?;
        wait_for("GPUs free", || {
            let agents: Vec<AgentSummary> = self.api.get("/api/v1/agents")?;
            Ok(agents.iter().all(|a| a.gpus.iter().all(|g| g.state == "free")).then_some(()))
        })?;
        let started_ms = job.started_at_ms.context("runner job without started_at_ms")? as f64;
        let runner = self.gh.runners().into_iter().find(|r| r.name == runner_name).context("runner not registered")?;
        let first = runner.first_acquire_at.context("runner never called acquire")?;
        let run_sh = self.api.run_sh_start_ms(runner_job)?;
        let t0_ms = wall_ms(t0_wall);
        Ok(Sample { spawned: started_ms - t0_ms, run_sh: run_sh - t0_ms, first: wall_ms(first) - t0_ms, answered })
    }
}

/// One job's figures, ms after t0.
struct Sample {
    /// gpuci's `started_at_ms`: the agent's sandbox spawn returned (bwrap exec'd in the job's cgroups).
    spawned: f64,
    /// `run.sh`'s first line ran (bwrap's set-up done, bash started).
    run_sh: f64,
    /// The runner stand-in's first request to the test GitHub (`acquire`).
    first: f64,
    /// The webhook's 202 reply.
    answered: f64,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summary(name: &str, mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    format!(
        "{name:<22} p50 {:>7.1} ms  p90 {:>7.1} ms  p99 {:>7.1} ms  max {:>7.1} ms",
        pct(&v, 50.0),
        pct(&v, 90.0),
        pct(&v, 99.0),
        v[v.len() - 1]
    )
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn run(args: &Args, forks: &str) -> Result<()> {
    let setup = Setup::new(args, forks)?;
    let logs: &Path = setup.dir.path();
    for _ in 0..args.warmup {
        setup.one().with_context(|| format!("warm-up; logs in {}", logs.display()))?;
    }
    let mut samples = Vec::with_capacity(args.jobs);
    let load_before = loadavg();
    let t = Instant::now();
    for i in 0..args.jobs {
        samples.push(setup.one().with_context(|| format!("job {i}; logs in {}", logs.display()))?);
    }
    println!(
        "forks = \"{forks}\", isolation {}: {} jobs one at a time ({} warm-up not counted), {:.1} s, load average {} → {}",
        args.isolation,
        args.jobs,
        args.warmup,
        t.elapsed().as_secs_f64(),
        load_before,
        loadavg()
    );
    let col = |f: fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<_>>();
    println!("  {}", summary("process spawned", col(|s| s.spawned)));
    println!("  {}", summary("run.sh running", col(|s| s.run_sh)));
    println!("  {}", summary("first GitHub request", col(|s| s.first)));
    println!("  {}", summary("webhook answered", col(|s| s.answered)));
    let errors = setup.gh.validation_errors();
    if !errors.is_empty() {
        println!("  test server validation problems: {errors:#?}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = parse_args()?;
    if !args.gpuci.is_file() {
        bail!("{} not found; build it with `cargo build --release -p gpuci` or pass --gpuci", args.gpuci.display());
    }
    for forks in &args.forks {
        run(&args, forks)?;
    }
    Ok(())
}
