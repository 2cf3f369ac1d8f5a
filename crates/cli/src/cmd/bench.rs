//! `gpuci bench dispatch`: how fast a submitted job's process starts on a warm agent, and how
//! many trivial jobs per second the coordinator and one agent sustain. The coordinator uses
//! a real SQLite file (WAL, synchronous=FULL) as in production.

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
    }
}

async fn dispatch(n: u32, slots: u32, isolation: IsolationArg, job_disk: u64) -> CliResult {
    let dir = tempfile::Builder::new().prefix("gpuci-bench-").tempdir()?;
    let shutdown = CancellationToken::new();
    let agent = LocalAgentArgs {
        simulate_gpus: None,
        slots,
        tags: Vec::new(),
        isolation,
        max_log_bytes: gpuci_agent::DEFAULT_MAX_LOG_BYTES,
        min_free_disk: gpuci_agent::DEFAULT_MIN_FREE_DISK,
        jobs: crate::cli::JobArgs { job_pids: gpuci_agent::DEFAULT_JOB_PIDS, job_disk, ..Default::default() },
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
    let c = Client::new(&local.server.url, local.server.api_token.expose())?;
    local::wait_for_agent(&c).await?;

    // Latency: one job at a time; the job prints bash's $EPOCHREALTIME as its first act.
    let source = "steps:\n  - key: t\n    command: echo $EPOCHREALTIME\n";
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).map_err(anyhow::Error::from)?;
    eprintln!("latency: {n} sequential jobs (isolation {isolation:?})");
    for i in 0..n + 20 {
        let t0 = now_us();
        let p = c
            .submit(&SubmitPipeline {
                file_name: "bench.yml".into(),
                source: source.into(),
                env: Default::default(),
                workspace_upload: None,
                repository: None,
            })
            .await?;
        let mut started: Option<i64> = None;
        let mut done = false;
        c.stream::<WatchEvent>(&format!("/api/v1/pipelines/{}/watch", p.id), |ev| {
            match ev {
                WatchEvent::Log { line, .. } if started.is_none() => {
                    if let Ok(secs) = line.text.trim().parse::<f64>() {
                        started = Some((secs * 1e6) as i64);
                    }
                }
                WatchEvent::Done { .. } => done = true,
                _ => {}
            }
            !done
        })
        .await?;
        // The first 20 warm the agent and the page cache; they are not counted.
        if let (Some(s), true) = (started, i >= 20) {
            hist.record((s - t0).max(0) as u64).map_err(anyhow::Error::from)?;
        }
    }
    let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "submit → process start ({} jobs): p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        hist.len(),
        ms(0.5),
        ms(0.9),
        ms(0.99),
        hist.max() as f64 / 1000.0
    );

    // Throughput: one pipeline of n independent trivial steps, `slots` at a time.
    let mut yaml = String::from("steps:\n");
    for i in 0..n {
        yaml.push_str(&format!("  - key: s{i}\n    command: \"true\"\n"));
    }
    let t0 = std::time::Instant::now();
    let p = c
        .submit(&SubmitPipeline {
            file_name: "throughput.yml".into(),
            source: yaml,
            env: Default::default(),
            workspace_upload: None,
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
    shutdown.cancel();
    let _ = local.agent.await;
    let _ = local.server.task.await;
    Ok(0)
}
