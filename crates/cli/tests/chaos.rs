//! Chaos test for issue #10, "exactly once, under crashes": gpuci promises that nothing is
//! lost and nothing runs twice whatever crashes. Here a real coordinator (SQLite, then
//! Postgres) and several real agents with simulated GPUs run a few hundred short jobs while
//! the test SIGKILLs the coordinator and the agents at random moments. The windows where
//! crashes hurt are milliseconds long, so about half the kills are aimed: at the moment a job
//! is seen `assigned` (committed, perhaps started by its agent, its start not yet recorded), or
//! right after a batch of jobs was submitted (dispatch cut in the middle). Some agents stay
//! down past `--lost-after`, some come back while the coordinator is down. When everything is
//! up again and has settled, it checks:
//!
//! - every job acknowledged by a submit exists, and every job is terminal: `succeeded`, or
//!   `lost`/`failed` with a reason that names the agent (a retry is a new job id with a higher
//!   attempt, which is fine);
//! - no job id started twice, by a ledger outside gpuci: each job first appends its
//!   `$GPUCI_JOB_ID` to one file (O_APPEND, `>>`) in a directory the job uids can write, so
//!   the steps run with `sandbox: none` on agents started with `--allow-unsandboxed`; and no
//!   job ran that gpuci does not know, and none succeeded without running;
//! - no GPU lease is held and no agent lists a running job, every agent is connected again;
//! - no job process is left running on the host;
//! - each job prints 20 numbered lines: a succeeded job's log has all of them, in order, once
//!   each, or a gpuci line (stream `system`) saying output was lost; no job's log has a line
//!   twice or out of order.
//!
//! On failure it prints the seed, the kill timeline, the count per broken invariant and, for
//! a few jobs, their state, reason, ledger count, log and the coordinator's and agents' log
//! lines about them; the run's directory (process logs, ledger, data dirs) is kept.
//!
//! Scale, from the environment (defaults sized for a 2-core CI machine: under a minute per
//! backend on an idle one, 20 s of it the kills, the rest settling and checking):
//!
//! - `GPUCI_CHAOS_JOBS` (200): jobs submitted, in one pipeline per wave between kills;
//! - `GPUCI_CHAOS_COORDINATOR_KILLS` (5), `GPUCI_CHAOS_AGENT_KILLS` (6, round-robin over the agents);
//! - `GPUCI_CHAOS_AGENTS` (3; 4 slots and 2 simulated GPUs each);
//! - `GPUCI_CHAOS_SEED`: replays a run's schedule (it is printed at the start; timing still
//!   differs from run to run, so a replay is close, not identical).
//!
//! A long run by hand:
//!
//! ```text
//! GPUCI_CHAOS_JOBS=1000 GPUCI_CHAOS_COORDINATOR_KILLS=20 GPUCI_CHAOS_AGENT_KILLS=20 \
//!     cargo test -p gpuci --test chaos -- --nocapture
//! ```
//!
//! The two backends never run at the same time (one lock), so a machine runs one chaos run at
//! once. With `CI=true` a missing bubblewrap or Postgres fails the test instead of skipping.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "common/chaos_kit.rs"]
mod chaos_kit;
mod common;
// The store suite's throwaway Postgres server (a real one: initdb, pg_ctl).
#[path = "../../store/tests/common/pg.rs"]
#[allow(dead_code)] // the store suite uses more of it than this test
mod pg;

use chaos_kit::{env_count, seed_from_env, with_stderr_to, JobReaper, ProcessLogs, Rng};
use common::*;
use gpuci_core::job::JobState;
use gpuci_protocol::api::{AgentSummary, JobSummary, PipelineSummary, SubmitPipeline};
use pg::PgServer;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines each job prints.
const LINES: u32 = 20;
const HEARTBEAT: &str = "200ms";
/// Short, so an agent that stays down is declared lost within the run; long enough that an
/// agent whose coordinator restarted reconnects in time (its backoff is capped at 5 s, and the
/// coordinator is down at most 1.5 s).
const LOST_AFTER: Duration = Duration::from_secs(4);
const SLOTS: &str = "4";
const GPUS: &str = "2xH100-80GB";
/// With nothing changing for this long, what is still open is stuck (a job takes ~2 s).
const STALL: Duration = Duration::from_secs(45);

static ONE_RUN_AT_A_TIME: Mutex<()> = Mutex::new(());

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Sqlite,
    Postgres,
}

#[test]
fn chaos_sqlite_every_job_runs_exactly_once_under_sigkills() {
    let _one = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    run(Backend::Sqlite, None);
}

#[test]
fn chaos_postgres_every_job_runs_exactly_once_under_sigkills() {
    let _one = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(server) = PgServer::start() else { return };
    let url = tokio::runtime::Runtime::new().unwrap().block_on(server.create_database("gpuci_chaos"));
    run(Backend::Postgres, Some(Pg { _server: server, url }));
}

/// A Postgres server and the database the coordinator uses.
struct Pg {
    _server: PgServer,
    url: String,
}

struct Scale {
    jobs: usize,
    coordinator_kills: usize,
    agent_kills: usize,
    agents: usize,
    seed: u64,
}

impl Scale {
    fn from_env() -> Scale {
        Scale {
            jobs: env_count("GPUCI_CHAOS_JOBS", 200),
            coordinator_kills: env_count("GPUCI_CHAOS_COORDINATOR_KILLS", 5),
            agent_kills: env_count("GPUCI_CHAOS_AGENT_KILLS", 6),
            agents: env_count("GPUCI_CHAOS_AGENTS", 3).max(1),
            seed: seed_from_env(),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Kill {
    Coordinator,
    Agent(usize),
}

/// When a kill strikes.
#[derive(Clone, Copy, Debug)]
enum At {
    /// After this long.
    Delay(Duration),
    /// As soon as a job is seen `assigned` (to the agent about to be killed): the assignment
    /// is committed, the agent may have started the job, its start is not recorded yet.
    Dispatch,
}

/// The processes of one run and what it needs to restart them. Fields drop in order: the
/// coordinator and agents first, then their jobs' leftovers, then Postgres, then the files.
struct Rig {
    server: Server,
    agents: Vec<Option<Agent>>,
    /// Agents down, and when each comes back.
    pending: Vec<(usize, Instant)>,
    reaper: JobReaper,
    _pg: Option<Pg>,
    logs: ProcessLogs,
    root: PathBuf,
    agent_args: Vec<String>,
    ledger: PathBuf,
    marker: String,
    t0: Instant,
    timeline: Vec<String>,
    dir: Option<tempfile::TempDir>,
}

fn run(backend: Backend, pg: Option<Pg>) {
    let scale = Scale::from_env();
    let mut rng = Rng::new(scale.seed);
    let mut rig = Rig::start(backend, &scale, pg);
    eprintln!(
        "chaos ({backend:?}): seed {} (replay with GPUCI_CHAOS_SEED={}), {} jobs, {} coordinator kills, \
         {} agent kills over {} agents; run dir {}",
        scale.seed,
        scale.seed,
        scale.jobs,
        scale.coordinator_kills,
        scale.agent_kills,
        scale.agents,
        rig.root.display()
    );

    // The kills, in a random order; agent kills round-robin so each agent gets its share.
    let mut kills: Vec<Kill> = (0..scale.coordinator_kills)
        .map(|_| Kill::Coordinator)
        .chain((0..scale.agent_kills).map(|i| Kill::Agent(i % scale.agents)))
        .collect();
    rng.shuffle(&mut kills);
    // One wave of jobs before each kill and one after the last, so jobs are queued, being
    // dispatched and running whenever something dies.
    let waves = kills.len() + 1;
    let mut acknowledged: BTreeSet<i64> = BTreeSet::new();
    let mut submitted = 0;
    for (w, kill) in kills.iter().map(Some).chain([None]).enumerate() {
        let n = scale.jobs * (w + 1) / waves - scale.jobs * w / waves;
        if n > 0 {
            let p = rig.submit(&wave_yaml(&mut rng, w, n, &rig.ledger, &rig.marker));
            rig.note(format!("submitted wave {w}: pipeline {} with {n} jobs", p.id));
            acknowledged.extend(p.jobs.iter().map(|j| j.id));
            submitted += n;
        }
        let Some(kill) = kill else { break };
        // The windows that matter are short (between an assignment's commit and the start's,
        // between a job's end and its result's commit), so half the kills wait for a dispatch
        // to be under way and strike at once; the rest land at random moments while jobs run.
        match *kill {
            Kill::Coordinator => {
                let when = match rng.below(10) {
                    0..=3 => At::Dispatch,
                    // Cutting the dispatch of the wave just submitted.
                    4..=5 => At::Delay(rng.millis(0, 150)),
                    _ => At::Delay(rng.millis(300, 3000)),
                };
                let down = rng.millis(0, 1500);
                rig.kill_coordinator(when, down);
            }
            Kill::Agent(i) => {
                let when = if rng.chance(0.5) { At::Dispatch } else { At::Delay(rng.millis(300, 3000)) };
                // A third stay down past --lost-after: their jobs must end `lost`. The others
                // come back in time for the coordinator to reconcile with them.
                let down = if rng.chance(0.33) { LOST_AFTER + rng.millis(500, 2500) } else { rng.millis(0, 2500) };
                rig.kill_agent(i, when, down);
            }
        }
    }
    assert_eq!(submitted, scale.jobs);
    rig.restart_every_agent();
    rig.note("chaos over; everything is up".into());

    let settle_limit = Duration::from_secs(120) + Duration::from_millis(300) * scale.jobs as u32;
    let settled = rig.settle(settle_limit);
    rig.note(format!("settled: {settled}"));
    let report = rig.check(&acknowledged);
    eprintln!("{}", report.summary);
    if !report.violations.is_empty() {
        let kept = rig.dir.take().map(|d| d.keep());
        panic!(
            "chaos ({backend:?}, seed {}): gpuci broke its promises; replay with GPUCI_CHAOS_SEED={}\n{}\n\
             run dir kept at {}",
            scale.seed,
            scale.seed,
            report.explain(&rig),
            kept.map(|p| p.display().to_string()).unwrap_or_default()
        );
    }
}

/// One pipeline of `n` steps. Each appends its job id to the ledger first, then prints
/// `LINES` numbered lines slowly enough (0.4–2.4 s in all) that kills land mid-job. A third
/// of them take a GPU; half retry once when lost.
fn wave_yaml(rng: &mut Rng, wave: usize, n: usize, ledger: &Path, marker: &str) -> String {
    let mut yaml = format!("env:\n  CHAOS_MARKER: {marker}\nsteps:\n");
    for i in 0..n {
        let pause = ["0.02", "0.04", "0.08", "0.12"][rng.below(4) as usize];
        let command = format!(
            "echo \"$GPUCI_JOB_ID\" >> {ledger}; i=1; while [ $i -le {LINES} ]; do \
             echo \"chaos job $GPUCI_JOB_ID line $i\"; sleep {pause}; i=$((i+1)); done",
            ledger = ledger.display()
        );
        let _ = write!(yaml, "  - key: w{wave}s{i}\n    sandbox: none\n    timeout: 2m\n");
        if rng.chance(0.33) {
            yaml.push_str("    gpus: 1\n");
        }
        if rng.chance(0.5) {
            yaml.push_str("    retry: {count: 1, on: [lost]}\n");
        }
        let _ = writeln!(yaml, "    command: {}", serde_json::to_string(&command).unwrap());
    }
    yaml
}

impl Rig {
    fn start(backend: Backend, scale: &Scale, pg: Option<Pg>) -> Rig {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new().prefix("gpuci-chaos-").tempdir().unwrap();
        let root = dir.path().to_path_buf();
        // The job uids must reach the ledger: the run dir passable, the ledger open to all.
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711)).unwrap();
        let ledger_dir = root.join("ledger");
        std::fs::create_dir(&ledger_dir).unwrap();
        std::fs::set_permissions(&ledger_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let ledger = ledger_dir.join("started");
        std::fs::File::create(&ledger).unwrap();
        std::fs::set_permissions(&ledger, std::fs::Permissions::from_mode(0o666)).unwrap();
        let logs = ProcessLogs { dir: root.join("logs") };
        std::fs::create_dir(&logs.dir).unwrap();

        let mut args: Vec<String> =
            vec!["--heartbeat".into(), HEARTBEAT.into(), "--lost-after".into(), format!("{}s", LOST_AFTER.as_secs())];
        if backend == Backend::Postgres {
            args.extend(["--database".into(), pg.as_ref().expect("a Postgres server").url.clone()]);
        }
        let server =
            with_stderr_to(&logs.coordinator(), || Server::start_on(&root.join("server"), "127.0.0.1:0", args));
        let marker = format!("chaos-{}-{}-{:?}", std::process::id(), scale.seed, backend);
        let agent_args: Vec<String> =
            ["--slots", SLOTS, "--simulate-gpus", GPUS, "--isolation", isolation(), "--allow-unsandboxed"]
                .into_iter()
                .map(String::from)
                .collect();
        let mut rig = Rig {
            server,
            agents: (0..scale.agents).map(|_| None).collect(),
            pending: Vec::new(),
            reaper: JobReaper::new(&marker),
            _pg: pg,
            logs,
            root,
            agent_args,
            ledger,
            marker,
            t0: Instant::now(),
            timeline: Vec::new(),
            dir: Some(dir),
        };
        for i in 0..scale.agents {
            rig.start_agent(i);
        }
        rig.server.api().wait_agents(scale.agents, Duration::from_secs(60));
        rig
    }

    fn agent_name(i: usize) -> String {
        format!("chaos-a{i}")
    }

    fn note(&mut self, what: String) {
        self.timeline.push(format!("t+{:6.2}s {what}", self.t0.elapsed().as_secs_f64()));
    }

    fn start_agent(&mut self, i: usize) {
        let name = Rig::agent_name(i);
        let args: Vec<&str> = self.agent_args.iter().map(String::as_str).collect();
        let data_dir = self.root.join("agents").join(&name);
        let agent = with_stderr_to(&self.logs.agent(&name), || Agent::start(&self.server, &data_dir, &name, &args));
        self.agents[i] = Some(agent);
    }

    /// Start the agents whose time has come.
    fn pump(&mut self) {
        let now = Instant::now();
        let due: Vec<usize> = self.pending.iter().filter(|(_, at)| *at <= now).map(|(i, _)| *i).collect();
        self.pending.retain(|(_, at)| *at > now);
        for i in due {
            self.start_agent(i);
            self.note(format!("agent {} started again", Rig::agent_name(i)));
        }
    }

    fn sleep_pumping(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while Instant::now() < until {
            self.pump();
            std::thread::sleep(Duration::from_millis(20).min(until.saturating_duration_since(Instant::now())));
        }
        self.pump();
    }

    /// Wait as `when` says; say what happened.
    fn wait_for(&mut self, when: At, agent: Option<usize>) -> String {
        match when {
            At::Delay(d) => {
                self.sleep_pumping(d);
                format!("after {d:?}")
            }
            At::Dispatch => {
                let name = agent.map(Rig::agent_name);
                let t0 = Instant::now();
                while t0.elapsed() < Duration::from_secs(4) {
                    let assigned: Vec<JobSummary> = self.get("/api/v1/jobs?state=assigned&limit=100");
                    if let Some(j) = assigned.iter().find(|j| name.is_none() || j.agent_name == name) {
                        return format!(
                            "right after job {} was assigned to {}",
                            j.id,
                            j.agent_name.as_deref().unwrap_or("?")
                        );
                    }
                    self.sleep_pumping(Duration::from_millis(5));
                }
                "after waiting 4s for a dispatch that did not come".into()
            }
        }
    }

    fn kill_coordinator(&mut self, when: At, down: Duration) {
        let moment = self.wait_for(when, None);
        self.server.kill9();
        self.note(format!("kill -9 coordinator {moment} (down {down:?})"));
        self.sleep_pumping(down);
        let log = self.logs.coordinator();
        let restarted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_stderr_to(&log, || self.server.restart_hard());
        }));
        if restarted.is_err() {
            panic!("the coordinator did not start again after kill -9; its log ends:\n{}", tail(&log, 40));
        }
        self.note("coordinator started again".into());
    }

    fn kill_agent(&mut self, i: usize, when: At, down: Duration) {
        if self.agents[i].is_none() {
            // Still down from an earlier kill: bring it back, let it reconnect, kill it again.
            self.pending.retain(|(a, _)| *a != i);
            self.start_agent(i);
            self.note(format!("agent {} started early, to be killed again", Rig::agent_name(i)));
            self.sleep_pumping(Duration::from_millis(500));
        }
        let moment = self.wait_for(when, Some(i));
        if let Some(mut a) = self.agents[i].take() {
            a.kill9();
        }
        self.note(format!("kill -9 agent {} {moment} (down {down:?})", Rig::agent_name(i)));
        self.pending.push((i, Instant::now() + down));
    }

    fn restart_every_agent(&mut self) {
        while !self.pending.is_empty() {
            self.sleep_pumping(Duration::from_millis(50));
        }
    }

    fn api(&self) -> Api {
        self.server.api()
    }

    /// Submit, retrying while the coordinator restarts or answers 503. A submit whose answer
    /// was lost may have been committed anyway; its jobs are then simply more jobs to check.
    fn submit(&mut self, yaml: &str) -> PipelineSummary {
        let body = SubmitPipeline {
            submission: None,
            build: None,
            file_name: "chaos.yml".into(),
            source: yaml.into(),
            env: Default::default(),
            workspace_upload: None,
            workspace_archive: None,
            repository: None,
        };
        let t0 = Instant::now();
        loop {
            let r = self
                .api()
                .raw()
                .post(format!("{}/api/v1/pipelines", self.server.url))
                .bearer_auth(&self.server.token)
                .json(&body)
                .send();
            match r {
                Ok(r) if r.status() == 201 => return r.json().expect("pipeline json"),
                Ok(r) if r.status().is_server_error() => {}
                Ok(r) => panic!("submit: {} {}", r.status(), r.text().unwrap_or_default()),
                Err(_) => {}
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "the coordinator took no submit for 60 s");
            self.sleep_pumping(Duration::from_millis(200));
        }
    }

    /// GET with retries (the coordinator may still be recovering).
    fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        let t0 = Instant::now();
        loop {
            let r = self.api().raw().get(format!("{}{path}", self.server.url)).bearer_auth(&self.server.token).send();
            match r {
                Ok(r) if r.status().is_success() => return r.json().expect("json"),
                Ok(r) if !r.status().is_server_error() => panic!("GET {path}: {}", r.status()),
                _ => {}
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "GET {path} failed for 60 s");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn jobs(&self) -> Vec<JobSummary> {
        let mut jobs: Vec<JobSummary> = self.get("/api/v1/jobs?limit=10000");
        jobs.sort_by_key(|j| j.id);
        jobs
    }

    /// Wait until every job is terminal, nothing has changed for `STALL`, or `limit` passed.
    fn settle(&mut self, limit: Duration) -> String {
        let t0 = Instant::now();
        let mut last = String::new();
        let mut changed = Instant::now();
        loop {
            let jobs = self.jobs();
            let open: Vec<String> =
                jobs.iter().filter(|j| !j.state.is_terminal()).map(|j| format!("{}:{}", j.id, j.state)).collect();
            if open.is_empty() {
                return format!("all {} jobs terminal after {:.1}s", jobs.len(), t0.elapsed().as_secs_f64());
            }
            let now = format!("{} {}", jobs.len(), open.join(","));
            if now != last {
                last = now;
                changed = Instant::now();
            }
            if changed.elapsed() > STALL || t0.elapsed() > limit {
                return format!(
                    "gave up after {:.1}s with {} jobs open (nothing changed for {:.1}s)",
                    t0.elapsed().as_secs_f64(),
                    open.len(),
                    changed.elapsed().as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn job_log(&self, id: i64) -> Vec<(i64, String, String)> {
        let t0 = Instant::now();
        loop {
            let r = self
                .api()
                .raw()
                .get(format!("{}/api/v1/jobs/{id}/logs", self.server.url))
                .bearer_auth(&self.server.token)
                .send()
                .and_then(|r| r.error_for_status())
                .and_then(|r| r.text());
            if let Ok(body) = r {
                return body
                    .lines()
                    .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("log ndjson"))
                    .filter(|v| v["type"] == "line")
                    .map(|v| {
                        (
                            v["seq"].as_i64().unwrap_or(-1),
                            v["stream"].as_str().unwrap_or_default().to_string(),
                            v["text"].as_str().unwrap_or_default().to_string(),
                        )
                    })
                    .collect();
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "job {id}'s log could not be read for 60 s");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn check(&mut self, acknowledged: &BTreeSet<i64>) -> Report {
        let mut v = Violations::default();
        let agents_expected = self.agents.len();

        // Agents back and GPUs free (a GPU is given back after its job's post-job check).
        let t0 = Instant::now();
        let agents: Vec<AgentSummary> = loop {
            let agents: Vec<AgentSummary> = self.get("/api/v1/agents");
            let connected = agents.iter().filter(|a| a.state == "connected").count();
            let idle = agents
                .iter()
                .all(|a| a.running.is_empty() && a.gpus.iter().all(|g| g.state == "free" && g.job_id.is_none()));
            if (connected >= agents_expected && idle) || t0.elapsed() > Duration::from_secs(20) {
                break agents;
            }
            std::thread::sleep(Duration::from_millis(250));
        };
        for i in 0..agents_expected {
            let name = Rig::agent_name(i);
            match agents.iter().find(|a| a.name == name) {
                Some(a) if a.state == "connected" => {}
                Some(a) => v.add("agent not connected at the end", format!("{name}: {} ({})", a.state, a.reason)),
                None => v.add("agent not connected at the end", format!("{name}: not listed")),
            }
        }
        let mut gpus_total = 0;
        for a in &agents {
            if !a.running.is_empty() {
                v.add("agent still lists running jobs", format!("{} lists {:?}", a.name, a.running));
            }
            for g in &a.gpus {
                gpus_total += 1;
                if g.state != "free" || g.job_id.is_some() {
                    v.add(
                        "GPU not free at the end",
                        format!(
                            "{} {} on {}: {} job {:?} {}",
                            g.info.uuid,
                            g.info.name,
                            a.name,
                            g.state,
                            g.job_id,
                            g.reason.clone().unwrap_or_default()
                        ),
                    );
                }
            }
        }

        // Job processes: those of ended jobs must be gone (killed by their agent, or swept
        // when it started again).
        let t0 = Instant::now();
        while !self.reaper.running().is_empty() && t0.elapsed() < Duration::from_secs(15) {
            std::thread::sleep(Duration::from_millis(200));
        }
        for (pid, cmd) in self.reaper.running() {
            v.add("job process left running", format!("pid {pid}: {cmd}"));
        }

        let jobs = self.jobs();
        let by_id: HashMap<i64, &JobSummary> = jobs.iter().map(|j| (j.id, j)).collect();
        let ledger_text = std::fs::read_to_string(&self.ledger).unwrap_or_default();
        let mut started: BTreeMap<i64, usize> = BTreeMap::new();
        for line in ledger_text.lines() {
            match line.trim().parse::<i64>() {
                Ok(id) => *started.entry(id).or_default() += 1,
                Err(_) => v.add("ledger line that is no job id", format!("{line:?}")),
            }
        }

        for id in acknowledged {
            if !by_id.contains_key(id) {
                v.add("acknowledged job missing", format!("job {id} was in a 201 answer but is not listed"));
            }
        }
        for (id, n) in &started {
            if !by_id.contains_key(id) {
                v.add("job ran that gpuci does not know", format!("job id {id} in the ledger {n}x"));
            }
        }

        let mut states: BTreeMap<String, usize> = BTreeMap::new();
        let mut explained_losses = 0;
        let mut retries = 0;
        for j in &jobs {
            *states.entry(j.state.to_string()).or_default() += 1;
            if j.attempt > 1 {
                retries += 1;
            }
            let runs = started.get(&j.id).copied().unwrap_or(0);
            if runs > 1 {
                v.job("job started twice (same id)", j.id);
            }
            match j.state {
                JobState::Succeeded => {
                    if runs == 0 {
                        v.job("succeeded without running", j.id);
                    }
                }
                JobState::Lost | JobState::Failed if j.reason.contains("agent") => {}
                s if !s.is_terminal() => v.job("job never ended", j.id),
                _ => v.job("job ended otherwise than succeeded or lost with its agent", j.id),
            }
            if j.state == JobState::Lost && j.reason.contains("retrying") {
                let next = jobs
                    .iter()
                    .any(|r| r.pipeline_id == j.pipeline_id && r.step_key == j.step_key && r.attempt == j.attempt + 1);
                if !next {
                    v.job("retry announced but no new attempt", j.id);
                }
            }
            if j.state.is_terminal() {
                match check_log(j.id, &self.job_log(j.id)) {
                    LogVerdict::Complete => {}
                    LogVerdict::Explained => {
                        if j.state == JobState::Succeeded {
                            explained_losses += 1;
                        }
                    }
                    LogVerdict::SilentLoss if j.state == JobState::Succeeded => {
                        v.job("succeeded job's log lost lines silently", j.id)
                    }
                    LogVerdict::SilentLoss => {}
                    LogVerdict::Garbled(why) => v.job_because("log line twice, out of order or foreign", j.id, &why),
                }
            }
        }

        let mut summary = String::new();
        let _ = writeln!(summary, "chaos timeline:");
        for t in &self.timeline {
            let _ = writeln!(summary, "  {t}");
        }
        let _ = writeln!(
            summary,
            "chaos result: {} jobs ({} acknowledged at submit, {retries} retries), states {states:?}; \
             ledger: {} starts of {} ids; {explained_losses} succeeded jobs with an explained gap in \
             their log; {gpus_total} GPUs on {} agents; {} invariant(s) broken",
            jobs.len(),
            acknowledged.len(),
            started.values().sum::<usize>(),
            started.len(),
            agents.len(),
            v.by_kind.len(),
        );
        for (kind, items) in &v.by_kind {
            let _ = writeln!(summary, "  BROKEN {kind}: {}", items.len());
        }
        Report { summary, violations: v, jobs, started }
    }
}

#[derive(Default)]
struct Violations {
    by_kind: BTreeMap<&'static str, Vec<String>>,
    jobs: BTreeMap<&'static str, Vec<i64>>,
}

impl Violations {
    fn add(&mut self, kind: &'static str, what: String) {
        self.by_kind.entry(kind).or_default().push(what);
    }

    fn job(&mut self, kind: &'static str, id: i64) {
        self.job_because(kind, id, "");
    }

    fn job_because(&mut self, kind: &'static str, id: i64, why: &str) {
        self.add(kind, format!("job {id} {why}"));
        self.jobs.entry(kind).or_default().push(id);
    }

    fn is_empty(&self) -> bool {
        self.by_kind.is_empty()
    }
}

struct Report {
    summary: String,
    violations: Violations,
    jobs: Vec<JobSummary>,
    started: BTreeMap<i64, usize>,
}

impl Report {
    /// The summary, then per broken invariant a few examples: for a job its record, ledger
    /// count, log, and what the coordinator and agents logged about it.
    fn explain(&self, rig: &Rig) -> String {
        let mut out = self.summary.clone();
        let by_id: HashMap<i64, &JobSummary> = self.jobs.iter().map(|j| (j.id, j)).collect();
        for (kind, items) in &self.violations.by_kind {
            let _ = writeln!(out, "\n== {kind}: {} ==", items.len());
            let Some(ids) = self.violations.jobs.get(kind) else {
                for item in items.iter().take(10) {
                    let _ = writeln!(out, "  {item}");
                }
                continue;
            };
            let _ = writeln!(out, "  all: {ids:?}");
            for item in items.iter().filter(|i| !i.ends_with(' ')).take(5) {
                let _ = writeln!(out, "  {item}");
            }
            for id in ids.iter().take(3) {
                let Some(j) = by_id.get(id) else { continue };
                let _ = writeln!(
                    out,
                    "  job {} (pipeline {}, step {}, attempt {}) {} on {}: {:?}; started {}x per the ledger; \
                     started_at {:?}, finished_at {:?}",
                    j.id,
                    j.pipeline_id,
                    j.step_key,
                    j.attempt,
                    j.state,
                    j.agent_name.as_deref().unwrap_or("-"),
                    j.reason,
                    self.started.get(id).copied().unwrap_or(0),
                    j.started_at_ms,
                    j.finished_at_ms
                );
                let log = rig.job_log(*id);
                let _ = writeln!(out, "    log ({} lines):", log.len());
                for (seq, stream, text) in log.iter().take(40) {
                    let _ = writeln!(out, "      {seq:>3} {stream:<6} {text}");
                }
                let mentions =
                    |l: &str| l.split(|c: char| c.is_whitespace() || c == ',').any(|w| w == format!("job={id}"));
                for (who, path) in std::iter::once(("coordinator".to_string(), rig.logs.coordinator()))
                    .chain((0..rig.agents.len()).map(|i| (Rig::agent_name(i), rig.logs.agent(&Rig::agent_name(i)))))
                {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    let hits: Vec<&str> = text.lines().filter(|l| mentions(l)).collect();
                    if !hits.is_empty() {
                        let _ = writeln!(out, "    {who} log about it:");
                        for l in &hits[hits.len().saturating_sub(12)..] {
                            let _ = writeln!(out, "      {l}");
                        }
                    }
                }
            }
        }
        out
    }
}

enum LogVerdict {
    /// Every line, once, in order.
    Complete,
    /// Lines missing, and a gpuci line says output was lost.
    Explained,
    /// Lines missing, nothing says so.
    SilentLoss,
    /// A line twice, out of order, or not one the job printed.
    Garbled(String),
}

fn check_log(id: i64, log: &[(i64, String, String)]) -> LogVerdict {
    let mut last_seq = i64::MIN;
    let mut next = 1;
    let mut seen = 0;
    let mut explained = false;
    let prefix = format!("chaos job {id} line ");
    for (seq, stream, text) in log {
        if *seq <= last_seq {
            return LogVerdict::Garbled(format!("seq {seq} after {last_seq}"));
        }
        last_seq = *seq;
        if stream == "system" {
            let t = text.to_lowercase();
            explained |= ["lost", "dropped", "missing"].iter().any(|w| t.contains(w));
            continue;
        }
        let Some(n) = text.strip_prefix(&prefix).and_then(|n| n.parse::<u32>().ok()) else {
            return LogVerdict::Garbled(format!("{stream} line {text:?}"));
        };
        if n < next || n > LINES {
            return LogVerdict::Garbled(format!("line {n} where {next} or later was due"));
        }
        next = n + 1;
        seen += 1;
    }
    match (seen == LINES, explained) {
        (true, _) => LogVerdict::Complete,
        (false, true) => LogVerdict::Explained,
        (false, false) => LogVerdict::SilentLoss,
    }
}

/// The last `n` lines of a file.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
