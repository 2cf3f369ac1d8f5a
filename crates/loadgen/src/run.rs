//! The phases: register, connect, rest, queue and place, latency, reconnect storm.

use crate::agent::{self, Ident, Shared};
use anyhow::Context;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::args::Args;
use crate::proc_stats;

/// Every phase, in order; the summary on stdout.
pub async fn run(args: Args) -> anyhow::Result<()> {
    raise_fd_limit();
    let server: SocketAddr = args
        .server
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .context("--server: expected http://IP:PORT")?;
    let http = reqwest::Client::builder().pool_max_idle_per_host(args.concurrency).build()?;
    let mut summary = serde_json::Map::new();
    summary.insert("agents".into(), args.agents.into());
    summary.insert("gpus_per_agent".into(), args.gpus.into());

    // Register.
    let t0 = Instant::now();
    let idents = register_all(&http, &args).await?;
    let register_s = t0.elapsed().as_secs_f64();
    eprintln!("registered {} agents in {register_s:.1} s", idents.len());
    summary.insert("register_s".into(), register_s.into());

    // Connect, paused.
    let shared = Arc::new(Shared::default());
    let (go_tx, go_rx) = tokio::sync::watch::channel(false);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(idents.len());
    let gate = Arc::new(tokio::sync::Semaphore::new(args.concurrency));
    let job_time = Duration::from_secs_f64(args.job_secs.max(0.0));
    for (i, ident) in idents.into_iter().enumerate() {
        let gpus = agent::inventory(&ident.name, args.gpus)?;
        let source = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1 + (i % usize::from(args.source_ips.max(1))) as u8));
        let (mine, go, stop, gate) = (shared.clone(), go_rx.clone(), stop_rx.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            // Only the first connection is gated: a reconnect storm is part of what is measured.
            let permit = gate.acquire_owned().await;
            let first = tokio::spawn(agent::run(ident, gpus, server, source, mine, go, stop, job_time));
            drop(permit);
            let _ = first.await;
        }));
        if i % args.concurrency == args.concurrency - 1 {
            wait_for(&shared, |s| s.connected.load(Ordering::Relaxed) + args.concurrency / 2 > i, "connecting").await;
        }
    }
    wait_for(&shared, |s| s.connected.load(Ordering::Relaxed) >= args.agents, "connecting").await;
    let connect_s = t0.elapsed().as_secs_f64();
    eprintln!("connected {} agents in {connect_s:.1} s", args.agents);
    summary.insert("connect_s".into(), connect_s.into());

    // At rest.
    if let Some(pid) = args.coordinator_pid {
        let rest = proc_stats::watch(pid, Duration::from_secs(args.rest_secs)).await?;
        eprintln!(
            "at rest for {} s: {:.3} cores, RSS {:.0} MiB",
            args.rest_secs,
            rest.cores,
            rest.rss_bytes as f64 / (1 << 20) as f64
        );
        summary.insert("rest_cores".into(), rest.cores.into());
        summary.insert("rest_rss_mib".into(), (rest.rss_bytes as f64 / (1 << 20) as f64).into());
    }

    // Queue every job, then let the agents take them.
    let t0 = Instant::now();
    let queued = queue_jobs(&http, &args).await?;
    let queue_s = t0.elapsed().as_secs_f64();
    eprintln!("queued {queued} jobs in {queue_s:.1} s ({:.0} jobs/s submitted)", queued as f64 / queue_s);
    summary.insert("queued_jobs".into(), queued.into());
    summary.insert("submit_jobs_per_s".into(), (queued as f64 / queue_s).into());
    let cpu0 = args.coordinator_pid.and_then(proc_stats::cpu_ticks);
    let t_go = Instant::now();
    go_tx.send(true)?;
    // Jobs that run for a while fill the GPUs and then wait: what is measured is placing as
    // many as fit, with the rest still queued behind them.
    let fit = args.agents * args.gpus as usize;
    let placing = if args.job_secs > 0.0 { queued.min(fit) } else { queued };
    wait_for(&shared, |s| s.assigned.lock().map(|a| a.len()).unwrap_or(0) >= placing, "placing").await;
    let last = shared.assigned.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(_, t)| *t).max();
    let place_s = last.map_or(0.0, |l| (l - t_go).as_secs_f64());
    let rate = placing as f64 / place_s.max(1e-9);
    eprintln!("placed {placing} of {queued} queued jobs in {place_s:.2} s: {rate:.0} placements/s end to end");
    summary.insert("placed_jobs".into(), placing.into());
    summary.insert("placements_per_s".into(), rate.into());
    if let (Some(pid), Some(c0)) = (args.coordinator_pid, cpu0) {
        if let Some(c1) = proc_stats::cpu_ticks(pid) {
            let cores = (c1 - c0) as f64 / proc_stats::ticks_per_s() / t_go.elapsed().as_secs_f64();
            summary.insert("placing_cores".into(), cores.into());
        }
        if let Some(rss) = proc_stats::rss_bytes(pid) {
            summary.insert("after_placing_rss_mib".into(), (rss as f64 / (1 << 20) as f64).into());
        }
    }

    // Submit → assignment with free GPUs.
    if args.latency_samples > 0 {
        let (p50, p99, max) = latency(&http, &args, &shared).await?;
        eprintln!(
            "submit -> assignment ({} samples): p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms",
            args.latency_samples
        );
        summary.insert("latency_p50_ms".into(), p50.into());
        summary.insert("latency_p99_ms".into(), p99.into());
    }

    // Reconnect storm.
    if let Some(cmd) = &args.storm_cmd {
        let before = shared.disconnects.load(Ordering::Relaxed);
        let t0 = Instant::now();
        let status = tokio::process::Command::new("sh").arg("-c").arg(cmd).status().await?;
        anyhow::ensure!(status.success(), "--storm-cmd failed: {status}");
        wait_for(&shared, |s| s.disconnects.load(Ordering::Relaxed) >= before + args.agents, "dropping").await;
        wait_for(&shared, |s| s.connected.load(Ordering::Relaxed) >= args.agents, "reconnecting").await;
        let storm_s = t0.elapsed().as_secs_f64();
        eprintln!("every agent connected again {storm_s:.1} s after the restart began");
        summary.insert("reconnect_all_s".into(), storm_s.into());
        if let Some(pid) = args.storm_pid_file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
            if let Some(rss) = pid.trim().parse().ok().and_then(proc_stats::rss_bytes) {
                summary.insert("after_storm_rss_mib".into(), (rss as f64 / (1 << 20) as f64).into());
            }
        }
    }
    summary.insert("duplicate_assignments".into(), shared.duplicates.load(Ordering::Relaxed).into());
    stop_tx.send(true)?;
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    println!("{}", serde_json::Value::Object(summary));
    Ok(())
}

/// Waits until `done`, printing progress every 2 s (and the last connection error).
async fn wait_for(shared: &Shared, done: impl Fn(&Shared) -> bool, what: &str) {
    let mut last = Instant::now();
    while !done(shared) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if last.elapsed() > Duration::from_secs(2) {
            last = Instant::now();
            let err = shared.last_error.lock().map(|e| e.clone()).unwrap_or_default();
            eprintln!(
                "{what}: {} connected, {} assigned{}",
                shared.connected.load(Ordering::Relaxed),
                shared.assigned.lock().map(|a| a.len()).unwrap_or(0),
                err.map(|e| format!("; last error: {e}")).unwrap_or_default()
            );
        }
    }
}

async fn register_all(http: &reqwest::Client, args: &Args) -> anyhow::Result<Vec<Ident>> {
    use futures::StreamExt;
    let run = std::process::id();
    let results: Vec<anyhow::Result<Ident>> = futures::stream::iter(0..args.agents)
        .map(|i| async move {
            let name = format!("loadgen-{run}-{i}");
            let r: serde_json::Value = http
                .post(format!("{}/api/v1/agents/register", args.server))
                .bearer_auth(&args.registration_token)
                .json(&serde_json::json!({ "name": name }))
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            let field = |k: &str| r[k].as_str().map(str::to_string).with_context(|| format!("no {k} in {r}"));
            Ok(Ident { agent_id: field("agent_id")?, credential: field("credential")?, name })
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    results.into_iter().collect()
}

async fn submit(http: &reqwest::Client, args: &Args, source: String) -> anyhow::Result<usize> {
    let r: serde_json::Value = http
        .post(format!("{}/api/v1/pipelines", args.server))
        .bearer_auth(&args.api_token)
        .json(&serde_json::json!({ "file_name": "loadgen.yml", "source": source }))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    Ok(r["jobs"].as_array().map_or(0, Vec::len))
}

fn pipeline(steps: usize) -> String {
    let mut s = String::from("steps:\n");
    for i in 0..steps {
        s.push_str(&format!("  - key: s{i}\n    gpus: 1\n    command: \"true\"\n"));
    }
    s
}

async fn queue_jobs(http: &reqwest::Client, args: &Args) -> anyhow::Result<usize> {
    use futures::StreamExt;
    let per = args.steps_per_pipeline.max(1);
    let sizes: Vec<usize> = (0..args.jobs.div_ceil(per)).map(|i| per.min(args.jobs - i * per)).collect();
    let counts: Vec<anyhow::Result<usize>> =
        futures::stream::iter(sizes).map(|n| submit(http, args, pipeline(n))).buffer_unordered(8).collect().await;
    counts.into_iter().sum()
}

/// Single-step pipelines one at a time (every GPU free): submit sent → the agent's
/// assignment received, in ms: p50, p99, max.
async fn latency(http: &reqwest::Client, args: &Args, shared: &Shared) -> anyhow::Result<(f64, f64, f64)> {
    let mut h = hdrhistogram::Histogram::<u64>::new(3)?;
    for _ in 0..args.latency_samples {
        let before = shared.assigned.lock().map(|a| a.len()).unwrap_or(0);
        let t0 = Instant::now();
        submit(http, args, pipeline(1)).await?;
        wait_for(shared, |s| s.assigned.lock().map(|a| a.len()).unwrap_or(0) > before, "latency").await;
        let at = shared.assigned.lock().unwrap_or_else(|e| e.into_inner())[before].1;
        h.record((at - t0).as_micros() as u64)?;
    }
    let ms = |v: u64| v as f64 / 1000.0;
    Ok((ms(h.value_at_quantile(0.5)), ms(h.value_at_quantile(0.99)), ms(h.max())))
}

/// As many open files as allowed: one per connection, and tens of thousands of them.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        // Root may raise the hard limit too.
        let want = hard.max(1 << 20);
        if setrlimit(Resource::RLIMIT_NOFILE, want, want).is_err() {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}
