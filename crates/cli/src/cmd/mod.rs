//! One module per subcommand. Each returns an exit code or a [`CliError`].

mod agent;
pub mod artifacts;
mod audit;
mod bench;
mod doctor;
mod jobs;
pub mod local;
pub mod pipeline;
mod run;
mod schedules;
mod server;
mod simulate_store;
mod submit;
mod up;

use crate::cli::{Cli, Command, GpuCommand, SecretCommand};
use crate::client::Client;
use crate::{render, CliError, CliResult};
use gpuci_core::pipeline::Pipeline;
use std::path::Path;
use tokio_util::sync::CancellationToken;

pub async fn dispatch(cli: Cli) -> u8 {
    let shutdown = CancellationToken::new();
    // What a signal does: the long-running commands stop taking work and return; any other
    // command ends at once, as if it had no handler (an upload or a followed log that was
    // waiting went on through SIGINT and SIGTERM: outsider finding).
    let stops = matches!(cli.command, Command::Up(_) | Command::Run(_) | Command::Server(_) | Command::Agent(_));
    let signalled = match &cli.command {
        // Inside a Slurm job or a pod, SIGTERM is the engine taking the machine back.
        Command::Agent(a) if a.allocation.is_some() => None,
        _ => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(cancel_on_signal(shutdown.clone(), tx));
            Some(rx)
        }
    };
    let run = run_command(cli, shutdown);
    let r = match signalled {
        Some(signal) if !stops => tokio::select! {
            r = run => r,
            Ok(code) = signal => {
                eprintln!("interrupted");
                return code;
            }
        },
        _ => run.await,
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", format_error(&e));
            e.exit_code()
        }
    }
}

async fn run_command(cli: Cli, shutdown: CancellationToken) -> CliResult {
    match cli.command {
        Command::Up(a) => up::run(a, shutdown).await,
        Command::Run(a) => run::run(a, shutdown).await,
        Command::Server(a) => server::run(a, shutdown).await,
        Command::Agent(a) => agent::run(a, shutdown).await,
        Command::Submit(a) => submit::run(a).await,
        Command::Jobs(a) => jobs::jobs(a).await,
        Command::Logs(a) => jobs::logs(a).await,
        Command::Artifacts(a) => artifacts::run(a).await,
        Command::Pipeline(a) => pipeline::run(a).await,
        Command::Cancel(a) => jobs::cancel(a).await,
        Command::Agents(a) => agents(a).await,
        Command::Fleets(a) => fleets(a).await,
        Command::Cost(a) => cost(a).await,
        Command::Github(a) => github(a).await,
        Command::Gpu(a) => match a.command {
            GpuCommand::Release { uuid } => gpu_release(&a.client, &uuid).await,
        },
        Command::Secret(a) => secret(a).await,
        Command::Audit(a) => audit::run(a).await,
        Command::Token(a) => audit::token(a).await,
        Command::Schedules(a) => schedules::run(a).await,
        Command::Doctor(a) => doctor::run(a).await,
        Command::Validate(a) => validate(a),
        Command::Schema => {
            println!(
                "{}",
                serde_json::to_string_pretty(&gpuci_core::pipeline::schema::json_schema()).unwrap_or_default()
            );
            Ok(0)
        }
        Command::Simulate(a) => simulate(a),
        Command::Bench(a) => bench::run(a).await,
    }
}

fn format_error(e: &CliError) -> String {
    match e {
        CliError::Input(s) => s.clone(),
        CliError::Other(e) => format!("{e:#}"),
    }
}

/// SIGINT or SIGTERM: cancel, so every task stops taking work and returns; `signalled` hears
/// the exit code a shell gives a process that signal ended (130, 143).
async fn cancel_on_signal(token: CancellationToken, signalled: tokio::sync::oneshot::Sender<u8>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
        return;
    };
    let code = tokio::select! {
        _ = int.recv() => 130,
        _ = term.recv() => 143,
    };
    tracing::info!("shutting down");
    token.cancel();
    let _ = signalled.send(code);
}

/// Follow a pipeline until it ends: human progress, or `--json` events on stdout. Returns
/// the exit code its result gives.
pub async fn follow(client: &Client, p: &gpuci_protocol::api::PipelineSummary, json: bool) -> CliResult {
    use gpuci_protocol::api::WatchEvent;
    use std::collections::HashMap;
    let mut progress = render::Progress::new(&p.jobs);
    // A stream opened again starts from the beginning: what was shown already is not again.
    let mut shown_seq: HashMap<i64, i64> = HashMap::new();
    let mut shown_job: HashMap<i64, String> = HashMap::new();
    let mut following = Following::new(client);
    loop {
        let c = following
            .next(|secs| {
                format!(
                    "lost pipeline {}'s progress and found no coordinator to follow it from for {secs} s; it may still run: gpuci pipeline {}",
                    p.id, p.id
                )
            })
            .await?;
        let mut heard = false;
        let ended = c
            .stream::<WatchEvent>(&format!("/api/v1/pipelines/{}/watch", p.id), |ev| {
                match &ev {
                    WatchEvent::Log { job_id, line } => {
                        if shown_seq.get(job_id).is_some_and(|&s| line.seq <= s) {
                            return true;
                        }
                        shown_seq.insert(*job_id, line.seq);
                    }
                    // The text view shows a job's changes of state only; JSON shows each change.
                    WatchEvent::Job(j) => {
                        let now = serde_json::to_string(j).unwrap_or_default();
                        if shown_job.get(&j.id) == Some(&now) {
                            return true;
                        }
                        shown_job.insert(j.id, now);
                    }
                    WatchEvent::Done { .. } => {}
                }
                // Only what is new counts as hearing from it: a coordinator that sends its
                // snapshot again and again and breaks does not put off giving up.
                heard = true;
                if json {
                    if let Ok(s) = serde_json::to_string(&ev) {
                        println!("{s}");
                    }
                    if let WatchEvent::Done { state } = &ev {
                        progress.final_state = Some(state.clone());
                    }
                } else {
                    progress.on(ev);
                }
                progress.final_state.is_none()
            })
            .await;
        if progress.final_state.is_some() {
            return Ok(progress.exit_code());
        }
        // The stream broke or ended before the pipeline did: its coordinator went away (a
        // failover, a restart). The pipeline goes on without us: follow it again, from
        // whichever coordinator leads, for a while.
        let why = match ended {
            Err(CliError::Input(e)) => return Err(CliError::Input(e)),
            Err(e) => format!("{e:#}"),
            Ok(()) => "the stream ended".to_string(),
        };
        following.lost(heard);
        eprintln!("lost pipeline {}'s progress from {} ({why}); following it again", p.id, c.base());
    }
}

/// A stream followed through failovers (`submit --wait`, `logs --follow`): the coordinator to
/// open it from next. After a loss nothing is sent until a coordinator leads and proves the
/// key again ([`Client::again`]; the old address may be anyone's by then), and the command
/// gives up after [`FOLLOW_AGAIN_FOR`] without hearing anything new from any.
pub(crate) struct Following<'a> {
    client: &'a Client,
    /// The first stream's coordinator, until it is used.
    first: Option<Client>,
    /// Since when nothing new was heard, after a loss.
    lost_since: Option<std::time::Instant>,
}

impl<'a> Following<'a> {
    pub(crate) fn new(client: &'a Client) -> Following<'a> {
        Following { client, first: Some(client.clone()), lost_since: None }
    }

    /// The coordinator to open the stream from: the command's own at first, then whichever
    /// leads, asked every second; `Err` with `gave_up(seconds)` once none was found for
    /// [`FOLLOW_AGAIN_FOR`].
    pub(crate) async fn next(&mut self, gave_up: impl Fn(u64) -> String) -> CliResult<Client> {
        if let Some(c) = self.first.take() {
            return Ok(c);
        }
        loop {
            let since = *self.lost_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() >= FOLLOW_AGAIN_FOR {
                return Err(CliError::Other(anyhow::anyhow!(gave_up(FOLLOW_AGAIN_FOR.as_secs()))));
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            match self.client.again().await {
                Ok(next) => return Ok(next),
                Err(e) => eprintln!("{e}"),
            }
        }
    }

    /// The stream was lost; `heard`: it brought something new first (only that starts the
    /// give-up clock again: a coordinator that sends its snapshot again and breaks does not).
    pub(crate) fn lost(&mut self, heard: bool) {
        if heard {
            self.lost_since = None;
        }
    }
}

/// How long `--wait` keeps trying to follow a pipeline whose coordinator went away: a
/// takeover takes seconds (docs/ha.md).
pub(crate) const FOLLOW_AGAIN_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// Read and validate a pipeline file; errors name file:line:column.
pub fn read_pipeline(path: &Path) -> CliResult<(String, Pipeline)> {
    let text =
        std::fs::read_to_string(path).map_err(|e| CliError::Input(format!("cannot read {}: {e}", path.display())))?;
    let name = path.display().to_string();
    let p = gpuci_core::pipeline::parse(&name, &text).map_err(|e| CliError::Input(e.to_string()))?;
    Ok((text, p))
}

/// `gpuci simulate --config server.toml --trace jobs.csv`: figures on stdout (a table, or
/// JSON), errors naming the file and place.
fn simulate(a: crate::cli::SimulateArgs) -> CliResult {
    let read =
        |p: &Path| std::fs::read_to_string(p).map_err(|e| CliError::Input(format!("cannot read {}: {e}", p.display())));
    let config = read(&a.config)?;
    let mut opts = gpuci_simulate::CliOptions { seed: a.seed, policies: a.policies, ..Default::default() };
    let (trace, trace_name) = match (&a.trace, &a.from_store) {
        (Some(t), None) => (read(t)?, t.display().to_string()),
        (None, Some(source)) => {
            // The coordinator's own history, replayed on the config's fleets (read-only).
            let fleets = gpuci_core::fleet::parse_fleets(&a.config.display().to_string(), &config)
                .map_err(|e| CliError::Input(e.to_string()))?;
            let since_ms =
                (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64
                    - i64::from(a.days) * 86_400)
                    * 1000;
            let replay = simulate_store::load(source, &fleets, since_ms).map_err(CliError::Input)?;
            if replay.jobs.is_empty() {
                return Err(CliError::Input(format!(
                    "--from-store: no job ran in the last {} days ({} never ran, {} fit no fleet)",
                    a.days, replay.not_run, replay.no_fleet
                )));
            }
            eprintln!(
                "replaying {} jobs of the last {} days from the store ({} left out: never ran or still running; {} GPU jobs fit no fleet of {})",
                replay.jobs.len(),
                a.days,
                replay.not_run,
                replay.no_fleet,
                a.config.display()
            );
            opts.epoch = replay.epoch;
            let name = format!("store {}", gpuci_store::redact_url(source));
            (gpuci_simulate::trace::to_csv(&replay.jobs), name)
        }
        _ => return Err(CliError::Input("give --trace FILE or --from-store DATABASE, one of them".into())),
    };
    let started = std::time::Instant::now();
    let report = gpuci_simulate::run_cli(&config, &a.config.display().to_string(), &trace, &trace_name, &opts)
        .map_err(CliError::Input)?;
    eprintln!("simulated in {:.1} s", started.elapsed().as_secs_f64());
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report).map_err(anyhow::Error::from)?);
    } else {
        println!("{report}");
    }
    Ok(0)
}

fn validate(a: crate::cli::ValidateArgs) -> CliResult {
    if a.files.is_empty() {
        return Err(CliError::Input("name at least one pipeline file".into()));
    }
    let mut bad = 0;
    let mut report = Vec::new();
    for f in &a.files {
        match read_pipeline(f) {
            Ok((_, p)) => {
                if !a.json {
                    eprintln!("{}: ok ({} steps)", f.display(), p.steps.len());
                }
                report.push(serde_json::json!({"file": f, "ok": true, "steps": p.steps.len()}));
            }
            Err(e) => {
                bad += 1;
                if !a.json {
                    eprintln!("{}", format_error(&e));
                }
                report.push(serde_json::json!({"file": f, "ok": false, "error": format_error(&e)}));
            }
        }
    }
    if a.json {
        println!("{}", serde_json::Value::Array(report));
    }
    Ok(if bad > 0 { 2 } else { 0 })
}

async fn agents(a: crate::cli::AgentsArgs) -> CliResult {
    let c = Client::from_args(&a.client)?;
    let agents = c.agents().await?;
    if a.client.json {
        println!("{}", serde_json::to_string_pretty(&agents).map_err(anyhow::Error::from)?);
    } else if agents.is_empty() {
        eprintln!("no agents registered");
    } else {
        print!("{}", render::agents_table(&agents));
    }
    Ok(0)
}

async fn fleets(a: crate::cli::AgentsArgs) -> CliResult {
    let c = Client::from_args(&a.client)?;
    let fleets: Vec<serde_json::Value> = c.get("/api/v1/fleets").await?;
    if a.client.json {
        println!("{}", serde_json::to_string_pretty(&fleets).map_err(anyhow::Error::from)?);
        return Ok(0);
    }
    if fleets.is_empty() {
        eprintln!("no fleets (add [[fleet]] to the server's config file: docs/fleets.md)");
    }
    print!("{}", render::fleets(&fleets));
    Ok(0)
}

async fn cost(a: crate::cli::CostArgs) -> CliResult {
    let c = Client::from_args(&a.client)?;
    let report: serde_json::Value = c.get(&format!("/api/v1/cost?days={}", a.days)).await?;
    if a.client.json {
        println!("{}", serde_json::to_string_pretty(&report).map_err(anyhow::Error::from)?);
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = report["rows"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| {
            vec![
                r["day"].as_str().unwrap_or_default().to_string(),
                gpuci_core::text::escape(r["fleet"].as_str().unwrap_or_default()).to_string(),
                r["repository"]
                    .as_str()
                    .map_or("(overhead: boot, idle)".into(), |r| gpuci_core::text::escape(r).to_string()),
                format!("{:.1}", r["gpu_hours"].as_f64().unwrap_or(0.0)),
                format!("${:.2}", r["usd"].as_f64().unwrap_or(0.0)),
            ]
        })
        .collect();
    if rows.is_empty() {
        eprintln!("no fleet machine was billed in the last {} days", a.days);
    } else {
        print!("{}", render::table(&["DAY", "FLEET", "REPOSITORY", "GPU-H", "COST"], &rows));
    }
    println!(
        "total ${:.2}, of which overhead ${:.2}",
        report["total_usd"].as_f64().unwrap_or(0.0),
        report["overhead_usd"].as_f64().unwrap_or(0.0)
    );
    Ok(0)
}

async fn github(a: crate::cli::GithubArgs) -> CliResult {
    let c = Client::from_args(&a.client)?;
    let (active, limit) = match a.command {
        crate::cli::GithubCommand::Jobs { active, limit } => (active, limit),
        crate::cli::GithubCommand::Status => return github_status(&c, a.client.json).await,
    };
    let jobs: Vec<serde_json::Value> = c.get(&format!("/api/v1/github/jobs?active={active}&limit={limit}")).await?;
    if a.client.json {
        println!("{}", serde_json::Value::Array(jobs));
        return Ok(0);
    }
    if jobs.is_empty() {
        eprintln!("no GitHub workflow jobs (is [github] configured, with a pool serving their labels?)");
        return Ok(0);
    }
    let text = |v: &serde_json::Value| v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string());
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            vec![
                text(&j["id"]),
                text(&j["repository"]),
                text(&j["name"]),
                text(&j["pool"]),
                text(&j["state"]),
                j["runner_job_id"].as_i64().map_or("-".into(), |i| i.to_string()),
                render::elapsed(j["queued_at_ms"].as_i64().unwrap_or(0)),
                text(&j["reason"]),
            ]
        })
        .collect();
    print!(
        "{}",
        render::table(&["JOB", "REPOSITORY", "NAME", "POOL", "STATE", "RUNNER JOB", "QUEUED", "REASON"], &rows)
    );
    Ok(0)
}

async fn github_status(c: &Client, json: bool) -> CliResult {
    let st: serde_json::Value = c.get("/api/v1/github/status").await?;
    if json {
        println!("{st}");
        return Ok(0);
    }
    if st["configured"] != serde_json::Value::Bool(true) {
        eprintln!("GitHub is not configured on this coordinator (no [github] section)");
        return Ok(0);
    }
    let limits = st["rate_limits"].as_array().cloned().unwrap_or_default();
    if limits.is_empty() {
        println!("rate limits: not seen yet (gpuci has not called GitHub)");
    }
    let rows: Vec<Vec<String>> = limits
        .iter()
        .map(|l| {
            let reset = l["reset"].as_i64().unwrap_or(0);
            let now =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
            vec![
                l["credential"].as_str().unwrap_or("?").to_string(),
                l["resource"].as_str().unwrap_or("?").to_string(),
                format!("{} of {}", l["remaining"], l["limit"]),
                format!("in {}s", (reset - now).max(0)),
            ]
        })
        .collect();
    if !rows.is_empty() {
        print!("{}", render::table(&["CREDENTIAL", "RESOURCE", "LEFT", "RESETS"], &rows));
    }
    let jobs = st["active_jobs"].as_object().cloned().unwrap_or_default();
    let waiting: Vec<String> = jobs.iter().map(|(k, v)| format!("{v} {k}")).collect();
    println!("workflow jobs: {}", if waiting.is_empty() { "none active".to_string() } else { waiting.join(", ") });
    Ok(0)
}

async fn secret(a: crate::cli::SecretArgs) -> CliResult {
    // Made when a command needs the coordinator: `encrypt --recipient` works with the
    // coordinator's public key alone, on a maintainer's machine that has no token.
    let client = || Client::from_args(&a.client);
    match a.command {
        SecretCommand::Set { name, scope } => {
            use std::io::Read;
            let mut value = String::new();
            std::io::stdin().read_to_string(&mut value)?;
            // One trailing newline comes from `echo` or a terminal, not from the secret.
            let value = value.strip_suffix('\n').unwrap_or(&value);
            client()?.set_secret(&name, &scope, value).await?;
            eprintln!("secret {name} set for {}", scope_text(&scope));
        }
        SecretCommand::List => {
            let list = client()?.secrets().await?;
            if a.client.json {
                println!("{}", serde_json::Value::Array(list));
            } else {
                for s in list {
                    let scope = crate::cli::SecretScopeArgs {
                        repository: s["repository"].as_str().map(str::to_string),
                        ref_pattern: s["ref"].as_str().map(str::to_string),
                        environment: s["environment"].as_str().map(str::to_string),
                        approved_forks: s["approved_forks"].as_bool().unwrap_or(false),
                    };
                    println!("{}\t{}", s["name"].as_str().unwrap_or_default(), scope_text(&scope));
                }
            }
        }
        SecretCommand::Encrypt { name, scope, recipient } => {
            use std::io::Read;
            if scope.environment.is_some() || scope.approved_forks {
                return Err(CliError::Input(
                    "an encrypted secret is bound to a repository and ref, not an environment; set environment secrets with `gpuci secret set --environment`".into(),
                ));
            }
            let sc = gpuci_core::secret_scope::SecretScope::from_parts(
                scope.repository.as_deref(),
                scope.ref_pattern.as_deref(),
            )
            .map_err(CliError::Input)?;
            if sc == gpuci_core::secret_scope::SecretScope::Global {
                return Err(CliError::Input(
                    "an encrypted secret belongs to a repository: give --repo owner/name (and --ref to narrow it)"
                        .into(),
                ));
            }
            if !gpuci_core::pipeline::is_env_name(&name) {
                return Err(CliError::Input(format!(
                    "invalid secret name {name:?}: use an environment variable name like HF_TOKEN"
                )));
            }
            let recipient = match recipient {
                Some(r) => r,
                None => client()?.secrets_key(false).await?["recipient"].as_str().unwrap_or_default().to_string(),
            };
            let mut value = String::new();
            std::io::stdin().read_to_string(&mut value)?;
            let value = value.strip_suffix('\n').unwrap_or(&value);
            if value.is_empty() {
                return Err(CliError::Input("the value (standard input) is empty".into()));
            }
            if value.contains('\0') {
                return Err(CliError::Input(
                    "the value contains a NUL byte (environment variables end there); encode binary values, e.g. base64".into(),
                ));
            }
            let text = gpuci_repo_secrets::encrypt(&recipient, &name, &sc, value)
                .map_err(|e| CliError::Input(e.to_string()))?;
            println!("{name}: \"{text}\"");
            eprintln!("encrypted {name} for {sc}; put the line above under the step's `secrets:` (a map)");
        }
        SecretCommand::Key { rotate } => {
            let key = client()?.secrets_key(rotate).await?;
            if a.client.json {
                println!("{key}");
            } else {
                println!("{}", key["recipient"].as_str().unwrap_or_default());
                let ids: Vec<&str> =
                    key["key_ids"].as_array().into_iter().flatten().filter_map(|v| v.as_str()).collect();
                eprintln!(
                    "key {} (current); keys that still decrypt: {}",
                    key["key_id"].as_str().unwrap_or_default(),
                    ids.join(", ")
                );
            }
        }
        SecretCommand::Rm { name, scope } => {
            client()?.delete_secret(&name, &scope).await?;
            eprintln!("secret {name} deleted for {}", scope_text(&scope));
        }
    }
    Ok(0)
}

fn scope_text(s: &crate::cli::SecretScopeArgs) -> String {
    match gpuci_core::secret_scope::SecretScope::from_query(
        s.repository.as_deref(),
        s.ref_pattern.as_deref(),
        s.environment.as_deref(),
        s.approved_forks,
    ) {
        Ok(scope) => scope.to_string(),
        Err(why) => why,
    }
}

async fn gpu_release(c: &crate::cli::ClientArgs, uuid: &str) -> CliResult {
    Client::from_args(c)?.release_gpu(uuid).await?;
    eprintln!("GPU {uuid} returned to service");
    Ok(0)
}
