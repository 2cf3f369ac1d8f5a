//! `gpuci bench dispatch`: how fast a submitted job's process starts on a warm agent, and how
//! many trivial jobs per second the coordinator and one agent sustain. `gpuci bench client`:
//! the same seen from a user's `gpuci submit --wait` process, beside the bare-bubblewrap
//! floor. The coordinator uses a real SQLite file (WAL, synchronous=FULL) as in production.

use super::local;
use crate::cli::{BenchArgs, BenchCommand, IsolationArg, LocalAgentArgs};
use crate::client::Client;
use crate::CliResult;
use gpuci_coordinator::{Database, Timing};
use gpuci_protocol::api::{SubmitPipeline, WatchEvent};
use tokio_util::sync::CancellationToken;

fn now_us() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

pub async fn run(a: BenchArgs) -> CliResult {
    match a.command {
        BenchCommand::Dispatch { jobs, slots, isolation, job_disk } => dispatch(jobs, slots, isolation, job_disk).await,
        BenchCommand::Client { jobs, isolation, job_disk } => client(jobs, isolation, job_disk).await,
        BenchCommand::Sandbox { runs, gap } => sandbox(runs, gap).await,
        BenchCommand::Dashboard { jobs, requests, isolation } => dashboard(jobs, requests, isolation).await,
    }
}

/// The sandbox's own start, warm and cold, beside the bare-bwrap floor with the same
/// namespaces and seccomp filter. Each row waits `gap` first, so on a cgroup v1 host the cold
/// start pays the RCU grace period a job arriving at an idle agent pays.
async fn sandbox(n: u32, gap: std::time::Duration) -> CliResult {
    use gpuci_sandbox::{JobUser, Sandbox, SandboxSpec, WarmSpec, WarmStart};
    if !nix::unistd::geteuid().is_root() {
        return Err(
            anyhow::anyhow!("gpuci bench sandbox needs root (jobs run as a job uid, as under a root agent)").into()
        );
    }
    let floor = BareBwrap::find(IsolationArg::Bubblewrap)
        .ok_or_else(|| anyhow::anyhow!("gpuci bench sandbox needs bubblewrap"))?;
    let user = JobUser { uid: BareBwrap::uid() - 2, gid: BareBwrap::uid() - 2 };
    // In a container that gives no cgroup of its own (a user-namespaced pod), jobs start
    // without one, as an agent there starts them (the container's limits bind them).
    let cgroups = match gpuci_sandbox::probe_cgroups() {
        Ok(_) => gpuci_sandbox::CgroupUse::Required,
        Err(e) => {
            eprintln!("no job cgroups here ({e}): jobs start without one, as an agent here starts them");
            gpuci_sandbox::CgroupUse::Auto
        }
    };
    let root = tempfile::Builder::new().prefix("gpuci-bench-sandbox-").tempdir_in("/var/tmp")?;
    std::fs::set_permissions(root.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711))?;
    let ws = root.path().join("ws");
    std::fs::create_dir(&ws)?;
    std::os::unix::fs::chown(&ws, Some(user.uid), Some(user.gid))?;
    eprintln!(
        "{n} rounds (+10 not counted), {} ms idle before each start; jobs as uid {}; floor: {} with the job's seccomp filter",
        gap.as_millis(),
        user.uid,
        floor.describe()
    );
    let spec_in = |name: String, ws: &std::path::Path| {
        let mut s = SandboxSpec::new(name, ws, vec!["true".into()]);
        s.env.insert("PATH".into(), "/usr/bin:/bin".into());
        s.user = Some(user);
        s.hide_paths.push(root.path().to_path_buf());
        s.resources.memory = Some(gpuci_core::quantity::Bytes::from_mib(512));
        s.resources.pids = Some(256);
        s.cgroups = cgroups;
        s
    };
    let (mut ready_h, mut warm_h, mut cold_h, mut bare_h) = (histogram()?, histogram()?, histogram()?, histogram()?);
    // One start, from `warm` or cold: spawn → `true` exited (µs); clean-up is not timed.
    let start = |spec: SandboxSpec, warm: Option<WarmStart>| async move {
        let t = std::time::Instant::now();
        let (mut sb, _so, _se) = Sandbox::spawn_warm(&spec, warm).map_err(anyhow::Error::from)?;
        sb.wait().await.map_err(anyhow::Error::from)?;
        let us = t.elapsed().as_micros() as u64;
        sb.cleanup().await.map_err(anyhow::Error::from)?;
        Ok::<u64, anyhow::Error>(us)
    };
    let pid = std::process::id();
    for i in 0..n + 10 {
        let counted = i >= 10;
        // Not an agent's warm-start names (`is_warm_name`): an agent starting meanwhile sweeps
        // empty cgroups of that shape, and these are empty until the spawn.
        let warm_spec = |name: String, ready: Option<gpuci_sandbox::ReadySpec>| WarmSpec {
            name,
            user,
            network: None,
            cgroups,
            nproc: Some(256),
            ready,
        };
        // The waiting shell alone, then a ready sandbox (its workspace made by the warm start).
        // Without a cgroup the warm start's process limit is the job's (256), set as it waits.
        {
            let shell =
                WarmStart::prepare(warm_spec(format!("bench-w{pid}-{i}"), None)).await.map_err(anyhow::Error::from)?;
            tokio::time::sleep(gap).await;
            let us = start(spec_in(format!("bench-w-{pid}-{i}"), &ws), Some(shell)).await?;
            if counted {
                warm_h.record(us).map_err(anyhow::Error::from)?;
            }
            let ready_ws = root.path().join(format!("ws-{i}"));
            let ready = gpuci_sandbox::ReadySpec {
                name: format!("bench-r{pid}-{i}"),
                sandbox: spec_in("ready".into(), &ready_ws),
            };
            let mut warm = WarmStart::prepare(warm_spec(format!("bench-s{pid}-{i}"), Some(ready)))
                .await
                .map_err(anyhow::Error::from)?;
            let taken =
                warm.take_workspace().ok_or_else(|| anyhow::anyhow!("the ready sandbox could not be started"))?;
            tokio::time::sleep(gap).await;
            let us = start(spec_in(format!("bench-r-{pid}-{i}"), &taken), Some(warm)).await?;
            std::fs::remove_dir(&taken)?;
            if counted {
                ready_h.record(us).map_err(anyhow::Error::from)?;
            }
        }
        tokio::time::sleep(gap).await;
        let us = start(spec_in(format!("bench-c-{pid}-{i}"), &ws), None).await?;
        if counted {
            cold_h.record(us).map_err(anyhow::Error::from)?;
        }
        tokio::time::sleep(gap).await;
        let us = floor.run_filtered().await?;
        if counted {
            bare_h.record(us).map_err(anyhow::Error::from)?;
        }
    }
    if !ready_h.is_empty() {
        println!("{}", summary("gpuci sandbox, ready sandbox: spawn → `true` exited", &ready_h));
        println!("{}", summary("gpuci sandbox, warm start: spawn → `true` exited", &warm_h));
    }
    println!("{}", summary("gpuci sandbox, cold start: spawn → `true` exited", &cold_h));
    println!("{}", summary("bare bwrap floor (same namespaces and seccomp filter)", &bare_h));
    let p50 = |h: &hdrhistogram::Histogram<u64>| h.value_at_quantile(0.5) as f64;
    if ready_h.is_empty() {
        println!("p50 over the floor: cold {:.2}×", p50(&cold_h) / p50(&bare_h).max(1.0));
    } else {
        println!(
            "p50 over the floor: ready {:.2}×, warm {:.2}×, cold {:.2}×",
            p50(&ready_h) / p50(&bare_h).max(1.0),
            p50(&warm_h) / p50(&bare_h).max(1.0),
            p50(&cold_h) / p50(&bare_h).max(1.0)
        );
    }
    Ok(0)
}

/// A coordinator (SQLite file) and one warm local agent, in this process.
struct Bench {
    dir: tempfile::TempDir,
    shutdown: CancellationToken,
    local: local::Local,
    client: Client,
}

impl Bench {
    async fn start(slots: u32, isolation: IsolationArg, job_disk: u64) -> CliResult<Bench> {
        let dir = tempfile::Builder::new().prefix("gpuci-bench-").tempdir()?;
        let shutdown = CancellationToken::new();
        let agent = LocalAgentArgs {
            simulate_gpus: None,
            gpus: None,
            slots,
            tags: Vec::new(),
            isolation,
            max_log_bytes: gpuci_agent::DEFAULT_MAX_LOG_BYTES,
            min_free_disk: gpuci_agent::DEFAULT_MIN_FREE_DISK,
            jobs: crate::cli::JobArgs {
                job_pids: gpuci_agent::DEFAULT_JOB_PIDS,
                job_disk,
                // `--isolation none` says it: the benchmark's own trivial jobs, unsandboxed.
                allow_unsandboxed: isolation == IsolationArg::None,
                ..Default::default()
            },
        };
        let db = Database::Sqlite(dir.path().join("gpuci.db"));
        let local = local::start(
            dir.path(),
            "127.0.0.1:0".parse().expect("literal"),
            db,
            &agent,
            Timing::default(),
            shutdown.clone(),
        )
        .await?;
        let client = Client::new(&local.server.url, local.server.api_token.expose())?;
        local::wait_for_agent(&client).await?;
        Ok(Bench { dir, shutdown, local, client })
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.local.agent.await;
        let _ = self.local.server.task.await;
        drop(self.dir);
    }
}

/// The one-step pipeline every latency sample runs: its first act prints bash's
/// `$EPOCHREALTIME` (a builtin, no extra process).
const PROBE: &str = "steps:\n  - key: t\n    command: echo $EPOCHREALTIME\n";

/// The job's first-instruction time (µs since the epoch), from a line of its output.
fn first_instruction(text: &str) -> Option<i64> {
    text.trim().parse::<f64>().ok().filter(|s| *s > 1e9).map(|s| (s * 1e6) as i64)
}

/// Submit [`PROBE`] through the API from this process and wait for it: microseconds from
/// just before the submit to the job's first instruction.
async fn dispatch_once(c: &Client) -> CliResult<Option<i64>> {
    let t0 = now_us();
    let p = c
        .submit(&SubmitPipeline {
            submission: None,
            build: None,
            file_name: "bench.yml".into(),
            source: PROBE.into(),
            env: Default::default(),
            workspace_upload: None,
            workspace_archive: None,
            repository: None,
        })
        .await?;
    let mut started: Option<i64> = None;
    let mut done = false;
    c.stream::<WatchEvent>(&format!("/api/v1/pipelines/{}/watch", p.id), |ev| {
        match ev {
            WatchEvent::Log { line, .. } if started.is_none() => started = first_instruction(&line.text),
            WatchEvent::Done { .. } => done = true,
            _ => {}
        }
        !done
    })
    .await?;
    Ok(started.map(|s| (s - t0).max(0)))
}

fn histogram() -> CliResult<hdrhistogram::Histogram<u64>> {
    Ok(hdrhistogram::Histogram::<u64>::new(3).map_err(anyhow::Error::from)?)
}

fn summary(what: &str, h: &hdrhistogram::Histogram<u64>) -> String {
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    format!(
        "{what} ({} runs): p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        h.len(),
        ms(0.5),
        ms(0.9),
        ms(0.99),
        h.max() as f64 / 1000.0
    )
}

async fn dispatch(n: u32, slots: u32, isolation: IsolationArg, job_disk: u64) -> CliResult {
    let bench = Bench::start(slots, isolation, job_disk).await?;
    let c = &bench.client;
    // Latency: one job at a time.
    let mut hist = histogram()?;
    eprintln!("latency: {n} sequential jobs (isolation {isolation:?})");
    for i in 0..n + 20 {
        let took = dispatch_once(c).await?;
        // The first 20 warm the agent and the page cache; they are not counted.
        if let (Some(us), true) = (took, i >= 20) {
            hist.record(us as u64).map_err(anyhow::Error::from)?;
        }
    }
    println!("{}", summary("submit → process start", &hist));

    // Throughput: one pipeline of n independent trivial steps, `slots` at a time.
    let mut yaml = String::from("steps:\n");
    for i in 0..n {
        yaml.push_str(&format!("  - key: s{i}\n    command: \"true\"\n"));
    }
    let t0 = std::time::Instant::now();
    let p = c
        .submit(&SubmitPipeline {
            submission: None,
            build: None,
            file_name: "throughput.yml".into(),
            source: yaml,
            env: Default::default(),
            workspace_upload: None,
            workspace_archive: None,
            repository: None,
        })
        .await?;
    let mut state = String::new();
    c.stream::<WatchEvent>(&format!("/api/v1/pipelines/{}/watch", p.id), |ev| {
        if let WatchEvent::Done { state: s } = ev {
            state = s;
            return false;
        }
        true
    })
    .await?;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "throughput: {n} trivial jobs in {secs:.2} s = {:.0} jobs/s with {slots} slots ({state})",
        f64::from(n) / secs
    );
    bench.stop().await;
    Ok(0)
}

/// Fills the store with `n` finished jobs (through the real path: submit, agent, results),
/// then times the dashboard's pages and `/metrics` as a browser would fetch them (loopback
/// HTTP included: an upper bound on the server's time).
async fn dashboard(n: u32, requests: u32, isolation: IsolationArg) -> CliResult {
    let bench = Bench::start(8, isolation, 0).await?;
    let c = &bench.client;
    let per = 100u32;
    let pipelines = n.div_ceil(per);
    eprintln!("running {n} jobs in {pipelines} pipelines of {per} (isolation {isolation:?}) ...");
    let t0 = std::time::Instant::now();
    let mut ids = Vec::new();
    for p in 0..pipelines {
        let mut yaml = String::from("steps:\n");
        for i in 0..per.min(n - p * per) {
            yaml.push_str(&format!("  - key: s{i}\n    command: echo \"step {i} of pipeline {p}\"\n"));
        }
        let sub = c
            .submit(&SubmitPipeline {
                submission: None,
                build: None,
                file_name: format!("bench-{p}.yml"),
                source: yaml,
                env: Default::default(),
                workspace_upload: None,
                workspace_archive: None,
                repository: Some(format!("https://github.com/acme/repo{}.git", p % 10)),
            })
            .await?;
        ids.push(sub.id);
        // Keep a few pipelines in flight, not all: the store grows as it would.
        if ids.len() >= 4 {
            let first = ids[ids.len() - 4];
            wait_done(c, first).await?;
        }
    }
    for id in &ids {
        wait_done(c, *id).await?;
    }
    eprintln!("{n} jobs done in {:.1} s", t0.elapsed().as_secs_f64());
    let mid = ids[ids.len() / 2];
    let job = c.pipeline(mid).await?.jobs.first().map_or(1, |j| j.id);
    let http = reqwest::Client::new();
    let token = bench.local.server.api_token.expose().to_string();
    let pages = [
        "/ui/".to_string(),
        format!("/ui/?before={mid}"),
        "/ui/jobs".to_string(),
        "/ui/jobs?repo=acme/repo3".to_string(),
        "/ui/jobs?state=succeeded".to_string(),
        format!("/ui/pipelines/{mid}"),
        format!("/ui/jobs/{job}"),
        "/ui/queue".to_string(),
        "/ui/fleet".to_string(),
        "/ui/spend".to_string(),
        "/metrics".to_string(),
    ];
    println!("dashboard with {n} jobs in the store ({requests} requests per page, after 5 warm-ups):");
    for page in pages {
        let mut h = histogram()?;
        let mut bytes = 0;
        for i in 0..requests + 5 {
            let t = std::time::Instant::now();
            let r = http.get(format!("{}{page}", bench.local.server.url)).bearer_auth(&token).send().await?;
            let status = r.status();
            let body = r.bytes().await?;
            if !status.is_success() {
                return Err(anyhow::anyhow!("GET {page}: {status}").into());
            }
            if i >= 5 {
                h.record(t.elapsed().as_micros() as u64).map_err(anyhow::Error::from)?;
            }
            bytes = body.len();
        }
        println!("  {}, {} KiB", summary(&format!("GET {page}"), &h), bytes / 1024);
    }
    bench.stop().await;
    Ok(0)
}

async fn wait_done(c: &Client, pipeline: i64) -> CliResult<()> {
    c.stream::<WatchEvent>(&format!("/api/v1/pipelines/{pipeline}/watch"), |ev| !matches!(ev, WatchEvent::Done { .. }))
        .await?;
    Ok(())
}

/// Interleaved rounds of: a `gpuci submit --wait` process (this binary) from a small git work
/// tree, to the step's first instruction; the same submitted from this process; a bare
/// bubblewrap start with a job's namespaces (the floor gpuci's sandbox is held to).
async fn client(n: u32, isolation: IsolationArg, job_disk: u64) -> CliResult {
    let bench = Bench::start(1, isolation, job_disk).await?;
    let exe = std::env::current_exe()?;
    let tree = tempfile::Builder::new().prefix("gpuci-bench-tree-").tempdir()?;
    let file = tree.path().join("bench.gpuci.yml");
    std::fs::write(&file, PROBE)?;
    std::fs::write(tree.path().join("README.md"), "a small work tree, as a user's would be\n")?;
    let git = std::process::Command::new("git").arg("-C").arg(tree.path()).args(["init", "-q"]).status();
    let in_git = git.is_ok_and(|s| s.success());
    let floor = BareBwrap::find(isolation);
    eprintln!(
        "{n} rounds (+10 not counted), isolation {isolation:?}; client from {} ({}); bare bwrap floor: {}",
        tree.path().display(),
        if in_git { "a git work tree" } else { "no git: a plain directory" },
        floor.as_ref().map_or("not measured (no bubblewrap)".to_string(), BareBwrap::describe)
    );
    let (mut from_client, mut from_api, mut bare) = (histogram()?, histogram()?, histogram()?);
    let token = bench.local.server.api_token.expose().to_string();
    for i in 0..n + 10 {
        let counted = i >= 10;
        // A changed file each round, as between a user's submits: every upload is new.
        std::fs::write(tree.path().join("CHANGES.md"), format!("round {i}\n"))?;
        let t0 = now_us();
        let mut child = tokio::process::Command::new(&exe)
            .arg("submit")
            .arg(&file)
            .args(["--wait", "--json", "--server", &bench.local.server.url])
            .env("GPUCI_TOKEN", &token)
            .current_dir(tree.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        let mut started = None;
        while let Some(line) = lines.next_line().await? {
            if let (None, Ok(WatchEvent::Log { line, .. })) = (started, serde_json::from_str::<WatchEvent>(&line)) {
                started = first_instruction(&line.text);
            }
        }
        let status = child.wait().await?;
        match started {
            Some(s) if counted => from_client.record((s - t0).max(0) as u64).map_err(anyhow::Error::from)?,
            Some(_) => {}
            None => return Err(anyhow::anyhow!("gpuci submit --wait ({status}) printed no start time").into()),
        }
        if let (Some(us), true) = (dispatch_once(&bench.client).await?, counted) {
            from_api.record(us as u64).map_err(anyhow::Error::from)?;
        }
        if let Some(f) = &floor {
            let us = f.run().await?;
            if counted {
                bare.record(us).map_err(anyhow::Error::from)?;
            }
        }
    }
    println!("{}", summary("client: gpuci submit --wait → first instruction", &from_client));
    println!("{}", summary("in-process submit → first instruction", &from_api));
    if !bare.is_empty() {
        println!("{}", summary("bare bwrap floor (same namespaces, `true`)", &bare));
        let p50 = |h: &hdrhistogram::Histogram<u64>| h.value_at_quantile(0.5) as f64;
        println!("in-process dispatch p50 / bare bwrap p50: {:.2}×", p50(&from_api) / p50(&bare).max(1.0));
    }
    bench.stop().await;
    Ok(0)
}

/// A bare bubblewrap start with the namespaces a job gets (user, as an unprivileged uid when
/// run as root; pid, ipc, uts, net, cgroup), `/usr` read-only and fresh `/proc`, `/dev`,
/// `/tmp`, running `true`: what any bubblewrap sandbox costs at the least.
struct BareBwrap {
    bwrap: std::path::PathBuf,
    /// Run as this uid (when this process is root), as gpuci runs its jobs.
    uid: Option<u32>,
}

impl BareBwrap {
    /// An unprivileged uid outside the usual ranges, used only for the floor's runs: the
    /// last but a few of the first default block of job uids in this user namespace.
    fn uid() -> u32 {
        let map = std::fs::read_to_string("/proc/self/uid_map").unwrap_or_default();
        gpuci_agent::slots::default_blocks(&map).first().map_or(1_500_000_000, |b| *b) + 250
    }

    fn find(isolation: IsolationArg) -> Option<BareBwrap> {
        if isolation == IsolationArg::None {
            return None;
        }
        let bwrap = ["/usr/bin/bwrap", "/bin/bwrap", "/usr/local/bin/bwrap"]
            .iter()
            .map(std::path::PathBuf::from)
            .find(|p| p.exists())?;
        Some(BareBwrap { bwrap, uid: nix::unistd::geteuid().is_root().then(Self::uid) })
    }

    fn describe(&self) -> String {
        match self.uid {
            Some(u) => format!("{} as uid {u}", self.bwrap.display()),
            None => format!("{} as this user", self.bwrap.display()),
        }
    }

    async fn run(&self) -> CliResult<u64> {
        self.run_with(&[]).await
    }

    /// As [`BareBwrap::run`], with the job's seccomp filter (`--add-seccomp-fd`, as gpuci passes it).
    async fn run_filtered(&self) -> CliResult<u64> {
        let programs = gpuci_sandbox::seccomp::memfds()?;
        // Inheritable copies for this one bwrap (the originals are close-on-exec).
        let mut copies: Vec<std::os::fd::OwnedFd> = Vec::new();
        for f in &programs {
            let c = std::os::fd::AsFd::as_fd(f).try_clone_to_owned()?;
            let fd = std::os::fd::AsRawFd::as_raw_fd(&c);
            nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()))
                .map_err(anyhow::Error::from)?;
            copies.push(c);
        }
        let mut extra = Vec::new();
        for c in &copies {
            extra.push("--add-seccomp-fd".to_string());
            extra.push(std::os::fd::AsRawFd::as_raw_fd(c).to_string());
        }
        self.run_with(&extra).await
    }

    async fn run_with(&self, extra: &[String]) -> CliResult<u64> {
        let mut cmd = tokio::process::Command::new(&self.bwrap);
        cmd.args(extra);
        cmd.args(["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net"])
            .args(["--unshare-cgroup-try", "--ro-bind", "/usr", "/usr"])
            .args(["--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"])
            .args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--die-with-parent", "--new-session"])
            .args(["--cap-drop", "ALL", "true"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if let Some(uid) = self.uid {
            // std drops root's supplementary groups when it sets a uid as root.
            cmd.uid(uid).gid(uid);
        }
        let t0 = std::time::Instant::now();
        let status = cmd.status().await?;
        if !status.success() {
            return Err(anyhow::anyhow!("bare bwrap failed ({status})").into());
        }
        Ok(t0.elapsed().as_micros() as u64)
    }
}
