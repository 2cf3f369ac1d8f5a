//! gpuci-agent: the process on a GPU host. It registers once, keeps one WebSocket to the
//! coordinator over which work is pushed, runs jobs in the sandbox on their leased GPUs,
//! streams their output, and reports results — holding each result until the coordinator
//! acknowledges it, so a coordinator restart loses nothing and runs nothing twice.
//!
//! It must not decide placement or hold scheduling state: it runs what it is assigned, on
//! the GPUs it is told, and reports what happened. One task (the loop in [`run`]) owns the
//! agent's state; job tasks only send it events.

pub mod allocation;
pub mod artifacts;
mod artifacts_http;
pub mod cache;
pub mod disk;
mod executor;
pub mod follow;
pub mod fstree;
pub mod gpuhold;
pub mod gpulock;
pub mod grant;
pub mod gres;
mod host;
pub mod identity;
pub mod interruption;
pub mod journal;
pub mod leave;
mod logmask;
pub mod outbox;
pub mod probe;
pub mod reaper;
mod registration;
pub mod series;
mod session;
pub mod slots;
pub mod steps_proxy;
pub mod tenancy;
mod transfer_retry;
pub mod unenforced;
pub mod waitline;
pub mod workspace;

pub use executor::{IsolationPolicy, JobNetwork, SlotDefaults, DEFAULT_MAX_LOG_BYTES};

/// Default `--job-pids`: enough for parallel builds and test runners, not for a fork bomb.
pub const DEFAULT_JOB_PIDS: u32 = 4096;

use anyhow::{bail, Context};
use executor::{JobContext, JobEvent};
use futures::{SinkExt, StreamExt};
use gpuci_protocol::agent::{AgentMessage, CoordinatorMessage, Hello, JobFinished, LogChunk};
use gpuci_protocol::JobId;
use host::*;
use journal::{Journal, Record};
use registration::*;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
pub struct Config {
    /// Coordinator base URL, e.g. `http://127.0.0.1:8070`, or several, comma-separated: the
    /// agent talks to the one that leads ([`follow`]).
    pub server: String,
    pub registration_token: Option<String>,
    /// The coordinators' identity key (`ed25519:<hex>`, `--coordinator-key`), pinned from the
    /// first contact so that not even the registration token goes to an address that cannot
    /// prove it; `None`: pinned at registration, trust on first use ([`follow`]).
    pub coordinator_key: Option<String>,
    pub name: String,
    pub data_dir: PathBuf,
    pub slots: u32,
    pub tags: BTreeMap<String, String>,
    /// A simulated GPU inventory (`4xH100-80GB`), for tests and benchmarks.
    pub simulate_gpus: Option<String>,
    /// The host name simulated GPUs' UUIDs are made from; default: the agent's name.
    pub simulate_host: Option<String>,
    /// Only these of the host's GPUs (`--gpus`: a share given by a fleet's provider or an
    /// operator); `None`: all of them. Naming one the host lacks stops the agent at start.
    pub only_gpus: Option<Vec<gpuci_gpu::GpuRef>>,
    /// Where the per-GPU locks live (`None`: [`gpulock::default_dir`]).
    pub gpu_lock_dir: Option<PathBuf>,
    pub isolation: IsolationPolicy,
    /// Whether steps may opt out of the sandbox (`sandbox: none`); a pool running untrusted
    /// code forbids it.
    pub allow_unsandboxed: bool,
    /// Whether jobs of trusted origins may reach cloud metadata services from their slot
    /// network (`--allow-metadata-trusted`); every other job is refused them.
    pub allow_metadata_trusted: bool,
    /// Whether steps that set `resources:` run on an agent that cannot enforce them
    /// (`--allow-unenforced-limits`; each such job's log says so). Without it they are not
    /// placed here.
    pub allow_unenforced_limits: bool,
    pub telemetry_period: Duration,
    /// How long GPU memory may take to return to baseline after a job.
    pub post_job_timeout: Duration,
    /// Use this GPU backend instead of detecting one (tests: a recording fake).
    pub gpu_backend: Option<Arc<dyn gpuci_gpu::GpuBackend>>,
    /// Absolute paths jobs must not see besides the data dir: other credentials on the host
    /// (`--hide`), the coordinator's data dir and key files when it runs in this process.
    pub hide: Vec<PathBuf>,
    /// Size limits of the steps' `cache:` store.
    pub cache_limits: cache::CacheLimits,
    /// Host uids for jobs (`--job-uids`, see `slots`); used when the agent is root. `None`:
    /// the first default block no other agent on this host holds.
    pub job_uids: Option<(u32, u32)>,
    /// What `network: default` steps get.
    pub job_network: executor::JobNetwork,
    /// TCP ports on the host's loopback that jobs in slot networks may connect to.
    pub job_host_ports: Vec<u16>,
    /// Limits for steps that set none; `memory: None` means the host's memory split by slots.
    pub job_defaults: executor::SlotDefaults,
    /// Per-job cap on the output kept in the log (bytes, a newline counted as one); past it
    /// the job keeps running and its output is discarded, with a line saying so.
    pub max_log_bytes: u64,
    /// Start even though the journal is damaged (`--reset-journal`): the jobs it held are
    /// given up as lost (see [`journal`]).
    pub reset_journal: bool,
    /// Below this much free space where it writes jobs, the agent takes no new jobs (see
    /// [`disk`]); 0: never.
    pub min_free_disk: u64,
    /// Each slot's own disk, the job's disk quota (`--job-disk`, see
    /// [`gpuci_sandbox::SlotDisk`]); 0: none, jobs share the host's disk.
    pub job_disk: u64,
    /// Give the machine up (see [`leave`]) when the coordinator has not been reachable for
    /// this long and no job runs: [`run_until`] then returns [`Ended::Left`]. `None`: never.
    pub leave_after_unreachable: Option<Duration>,
    /// Where the machine's provider posts a notice that it takes the machine back (EC2's
    /// `http://169.254.169.254/latest/meta-data/spot/instance-action`), and how often to look
    /// ([`interruption`]).
    pub interruption_notice: Option<(String, Duration)>,
    /// When the machine ends by itself (unix ms: a Slurm allocation's end), told to the
    /// coordinator so it gives the agent no job that would outlive it. The agent ends itself,
    /// idle, [`END_MARGIN`] before that.
    pub ends_at_ms: Option<i64>,
    /// A notice that the machine is being taken back, from outside (the CLI turns a cluster
    /// engine's SIGTERM into one): handled as [`Config::interruption_notice`]'s.
    pub taken_back: Option<tokio::sync::watch::Receiver<Option<String>>>,
    /// Once taken back, end as soon as no job runs and the coordinator has every result
    /// (an allocation the engine is ending: nothing is left to wait for).
    pub end_when_taken_back: bool,
    /// The `gpuci` binary, which runs the agent's reaper (`reaper`); `None` (an agent inside
    /// another program) runs none, and says so.
    pub reaper: Option<PathBuf>,
}

/// How long before its machine's end ([`Config::ends_at_ms`]) an idle agent ends itself: by
/// then no job with a timeout can fit (a job is given its timeout plus a minute to report).
pub const END_MARGIN: Duration = Duration::from_secs(120);

impl Config {
    pub fn new(server: impl Into<String>, data_dir: PathBuf) -> Self {
        let host = hostname();
        Config {
            server: server.into().trim_end_matches('/').to_string(),
            registration_token: None,
            coordinator_key: None,
            name: host,
            data_dir,
            slots: 4,
            tags: BTreeMap::new(),
            simulate_gpus: None,
            simulate_host: None,
            only_gpus: None,
            gpu_lock_dir: None,
            isolation: IsolationPolicy::Auto,
            allow_unsandboxed: false,
            allow_metadata_trusted: false,
            allow_unenforced_limits: false,
            telemetry_period: Duration::from_secs(1),
            post_job_timeout: Duration::from_secs(30),
            gpu_backend: None,
            hide: Vec::new(),
            cache_limits: cache::CacheLimits::default(),
            max_log_bytes: DEFAULT_MAX_LOG_BYTES,
            job_uids: None,
            job_network: executor::JobNetwork::Slot,
            job_host_ports: Vec::new(),
            job_defaults: executor::SlotDefaults { memory: None, pids: Some(DEFAULT_JOB_PIDS), cpu_millis: None },
            reset_journal: false,
            min_free_disk: DEFAULT_MIN_FREE_DISK,
            job_disk: 0,
            leave_after_unreachable: None,
            interruption_notice: None,
            ends_at_ms: None,
            taken_back: None,
            end_when_taken_back: false,
            reaper: None,
        }
    }
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// Why [`run_until`] returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// `shutdown` was cancelled.
    Shutdown,
    /// `leave_after_unreachable` passed without the coordinator (see [`leave`]); no job runs.
    Left {
        /// The coordinator's URL.
        coordinator: String,
        /// How long it had not been reachable.
        unreachable_for: Duration,
    },
}

/// What one connection's session ended with.
enum SessionEnd {
    Shutdown,
    /// Nothing is left for this agent to do: its machine was taken back or is about to end,
    /// and no job runs.
    Done,
    Disconnected(String),
    Refused(String),
}

struct Agent {
    ctx: Arc<JobContext>,
    hello_base: Hello,
    /// Jobs running now, with their cancel handles.
    running: HashMap<JobId, CancellationToken>,
    /// Every job received and not yet acknowledged as finished (the hello's `running`).
    holds: BTreeSet<JobId>,
    /// Start times of running jobs, for their results.
    started_at: HashMap<JobId, i64>,
    /// What must survive this process: assignments received, starts, results.
    journal: Journal,
    /// Job events until the coordinator acknowledges them.
    outbox: outbox::Outbox,
    events_tx: mpsc::UnboundedSender<JobEvent>,
    events_rx: mpsc::UnboundedReceiver<JobEvent>,
    /// Where jobs are written (data dir, workspaces), watched for free space.
    disk_dirs: Vec<PathBuf>,
    min_free_disk: u64,
    /// Why it takes no new jobs now ([`disk`]).
    paused: Option<String>,
    /// `--leave-after-unreachable`.
    leave_after: Option<Duration>,
    /// The last moment it was connected (a welcome received), or its start.
    last_connected: std::time::Instant,
    /// Whether the session now ending got as far as a welcome.
    welcomed: bool,
    /// When a job last ended.
    last_job_ended: Option<std::time::Instant>,
    /// The provider's notice that it takes the machine back, once seen ([`interruption`]).
    interrupted: tokio::sync::watch::Receiver<Option<String>>,
    /// [`Config::end_when_taken_back`].
    end_when_taken_back: bool,
    /// This session told the coordinator the machine is being taken back.
    told_taken_back: bool,
    /// A job just ended by a signal the agent did not send while it runs inside an
    /// allocation: the engine's SIGTERM reaches jobs and agent alike, and the notice must
    /// reach the coordinator before that result does.
    suspect_signal: bool,
    /// [`Config::ends_at_ms`].
    ends_at_ms: Option<i64>,
    /// The coordinators given, and the one talked to now.
    coordinators: follow::Coordinators,
    /// Where `agent.json` is (a key pinned at first use is kept there).
    data_dir: PathBuf,
}

/// Whether a job ended the way an engine's stop signal (SIGHUP, SIGINT, SIGKILL, SIGTERM)
/// ends it: killed by it, or exited with 128 + it, as bubblewrap (which runs every sandboxed
/// job) and shells report a child the signal killed.
fn ended_by_a_stop_signal(outcome: &gpuci_core::job::Outcome) -> bool {
    use gpuci_core::job::Outcome;
    matches!(outcome, Outcome::Signalled { signal: 1 | 2 | 9 | 15 } | Outcome::Exited { code: 129 | 130 | 137 | 143 })
}

/// How long a job's death by a signal waits for the engine's SIGTERM to this agent before its
/// result is sent ([`Agent::suspect_signal`]).
const SIGNAL_GRACE: Duration = Duration::from_millis(1500);

/// How often the agent re-reads its GPU inventory and reports a change.
const INVENTORY_REFRESH: Duration = Duration::from_secs(30);

/// Cap on job output kept until the coordinator acknowledges it (bytes, see [`outbox`]);
/// older lines are dropped first, and the log says how many.
const OUTBOX_LIMIT: usize = 16 * 1024 * 1024;

/// Past this size the journal is rewritten with only the jobs still held.
const JOURNAL_COMPACT_BYTES: u64 = 4 << 20;

/// Default of `--min-free-disk`.
pub const DEFAULT_MIN_FREE_DISK: u64 = 1 << 30;

/// How often the agent looks at its free disk space.
const DISK_CHECK: Duration = Duration::from_secs(5);

/// Run the agent until `shutdown`. Running jobs are cancelled on shutdown and their results
/// reported if the coordinator is reachable. As [`run_until`], for agents that never leave.
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_until(config, shutdown).await.map(|_| ())
}

/// Run the agent until `shutdown`, or until it leaves (`leave_after_unreachable`, see
/// [`leave`]): what to do then (power the machine off, exit) is the caller's.
pub async fn run_until(config: Config, shutdown: CancellationToken) -> anyhow::Result<Ended> {
    // Where `--leave-after-unreachable` counts from if the agent never connects.
    let started = std::time::Instant::now();
    std::fs::create_dir_all(&config.data_dir).with_context(|| format!("creating {}", config.data_dir.display()))?;
    // One agent per data dir, held for this process's life: two would rewrite one journal
    // and each take the other's jobs for dead ones.
    let _data_dir_lock = lock_data_dir(&config.data_dir)?;
    // The journal first: a damaged one stops the agent before it registers or touches
    // anything. What an earlier run of this agent still owes the coordinator: its jobs died
    // with it (the sweep below kills what is left of them).
    let ran_before = config.data_dir.join("agent.json").exists();
    let mut owed = BTreeMap::new();
    let journal_path = config.data_dir.join("journal");
    let (mut journal, _) = match Journal::open(&journal_path, ran_before, config.reset_journal, |records| {
        owed = journal::recover(records, executor::now_us());
        journal::records_for(&owed)
    }) {
        Ok(j) => j,
        Err(journal::OpenError::Damaged(damage)) => bail!(
            "{}: {damage}. The journal is how this agent knows which jobs it received; started without it, \
             the coordinator could run one of them a second time. To give up the jobs it held as lost \
             (the coordinator will not hand them out again as never received), start the agent once \
             with --reset-journal.",
            journal_path.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("opening the journal {}", journal_path.display())),
    };
    let given_key = match &config.coordinator_key {
        Some(k) => Some(
            gpuci_core::coordinator_identity::parse_key(k).map_err(|e| anyhow::anyhow!("--coordinator-key: {e}"))?,
        ),
        None => None,
    };
    let mut coordinators = follow::Coordinators::new(
        follow::parse_urls(&[&config.server]).with_context(|| format!("--server {}", config.server))?,
    )
    .with_pin(given_key.clone().or_else(|| identity::kept_key(&config.data_dir)));
    let (identity, registered_anew) = match register(&config, &mut coordinators, started, &shutdown).await? {
        Registered::Yes(id, anew) => (id, anew),
        Registered::No(ended) => return Ok(ended),
    };
    // The key given wins over the one kept; the one kept holds when none is given.
    match (&given_key, &identity.coordinator_key) {
        (Some(given), Some(kept)) if given != kept => {
            tracing::warn!(
                given,
                kept,
                "--coordinator-key differs from the key this agent pinned when it registered: using the one given"
            );
        }
        (None, Some(kept)) => coordinators = coordinators.with_pin(Some(kept.clone())),
        _ => {}
    }
    // Jobs held in the journal were assigned through the earlier registration. Under a new one
    // (another coordinator; one started over on a new database; `agent.json` gone) their
    // results could only reach a coordinator that never assigned them to this identity, and
    // there match an unrelated job of the same id: they are given up. Whoever assigned them
    // counts them lost when the earlier registration never comes back.
    if registered_anew && !owed.is_empty() {
        let jobs: Vec<_> = owed.keys().collect();
        tracing::warn!(?jobs, coordinator = %config.server, "this agent registered anew: giving up the jobs its journal held for its earlier registration (their results cannot be reported through this one)");
        owed.clear();
        journal.replace(&[]).with_context(|| format!("rewriting the journal {}", journal_path.display()))?;
    }

    let mut opts = gpuci_gpu::DetectOptions::new(config.simulate_host.clone().unwrap_or_else(|| config.name.clone()));
    opts.simulate = config.simulate_gpus.clone();
    opts.simulated_device_dir = config.data_dir.join("sim-dev");
    let (backend, backend_name) = match &config.gpu_backend {
        Some(b) => (b.clone(), format!("{:?}", b.kind()).to_lowercase()),
        None => {
            let detection = gpuci_gpu::detect(&opts).context("GPU inventory")?;
            let name = match detection.no_gpu_reason() {
                Some(why) => format!("none: {why}"),
                None => format!("{:?}", detection.kind()).to_lowercase(),
            };
            (detection.backend.clone(), name)
        }
    };
    // A share of the host's GPUs: everything below (inventory, health, leases, telemetry)
    // sees only those.
    let backend: Arc<dyn gpuci_gpu::GpuBackend> = match &config.only_gpus {
        None => backend,
        Some(refs) => Arc::new(
            gpuci_gpu::OnlyGpus::new(backend, refs)
                .with_context(|| format!("--gpus: the GPUs given to this agent ({backend_name})"))?,
        ),
    };
    let inventory = match backend.inventory() {
        Ok(i) => i,
        Err(e) => {
            tracing::error!(error = %e, "GPU inventory failed; advertising no GPUs");
            Vec::new()
        }
    };
    // Real GPUs are this agent's alone while it runs (see `gpulock`).
    let _gpu_locks = if matches!(backend.kind(), gpuci_gpu::BackendKind::Nvml | gpuci_gpu::BackendKind::NvidiaSmi) {
        let uuids: Vec<String> = inventory.iter().map(|g| g.uuid.clone()).collect();
        let dir = config.gpu_lock_dir.clone().unwrap_or_else(gpulock::default_dir);
        Some(gpulock::claim(&dir, &uuids, &config.name).map_err(anyhow::Error::msg)?)
    } else {
        None
    };
    let caps = gpuci_sandbox::detect();
    let container_runtime = match &caps.container_runtime {
        Some(rt) => match engine_answers(rt).await {
            Ok(()) => Some(rt.clone()),
            Err(why) => {
                tracing::warn!(engine = %rt.path.display(), why, "container engine found but not usable; not advertising containers");
                None
            }
        },
        None => None,
    };
    let root = nix::unistd::geteuid().is_root();
    let agent_tag: String = identity.agent_id.chars().filter(char::is_ascii_alphanumeric).take(12).collect();
    let work_root = if root { root_work_dir(&config.data_dir, &agent_tag)? } else { config.data_dir.join("work") };
    std::fs::create_dir_all(&work_root)?;
    private_dirs(&config.data_dir)?;
    // Workspaces an earlier run of this agent left (it died mid-job, or with a ready sandbox's
    // empty workspace waiting): the work root is this agent's alone (its data dir is locked).
    let root_dir = work_root.clone();
    let stale = tokio::task::spawn_blocking(move || sweep_workspaces(&root_dir)).await.unwrap_or(0);
    if stale > 0 {
        tracing::info!(workspaces = stale, dir = %work_root.display(), "removed workspaces an earlier run left");
    }
    let (slots, disk_problem, disk_size) = if root {
        let (s, problem, size) = make_slots(&config, &work_root).await?;
        (Some(s), problem, size)
    } else {
        let problem = (config.job_disk > 0).then(|| "the agent is not root: jobs share its disk".to_string());
        (None, problem, config.job_disk)
    };
    if let Some(why) = &disk_problem {
        tracing::error!(why, "no disk quota for jobs");
    }
    // Job cgroups: a root agent's jobs get limits they may not lift. Where none can be made
    // (an unprivileged pod: its cgroup tree is read-only, or belongs to an unmapped uid) but
    // the container has a memory limit of its own and the agent runs one job at a time, the
    // container's limits bound that job, its processes are limited by RLIMIT_NPROC on its own
    // uid, and the OOM killer takes it before the agent: said at start, in every such job's
    // log, and steps that ask for limits of their own are refused unless the operator allowed
    // them unenforced. Any other root agent without job cgroups takes no jobs.
    let cgroup_problem = gpuci_sandbox::probe_cgroups().err();
    let own_limits = gpuci_sandbox::own_limits();
    let container_limits = match (&slots, &cgroup_problem) {
        (Some(_), Some(_)) if config.slots == 1 && own_limits.memory.is_some() => Some(own_limits),
        _ => None,
    };
    let bwrap_problem = if caps.bubblewrap.is_none() {
        Some("bubblewrap is not installed (apt-get install bubblewrap)".to_string())
    } else if !caps.user_namespaces {
        Some("user namespaces are off for unprivileged users (sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone)".to_string())
    } else {
        match (&slots, &cgroup_problem, container_limits) {
            (Some(_), Some(e), None) => Some(format!(
                "job cgroups: {e}{}",
                if config.slots > 1 {
                    "; in a container with limits of its own, one slot (--slots 1) lets those limits bind the job"
                } else {
                    ""
                }
            )),
            _ => {
                let guard = slots.as_ref().and_then(|s| s.take());
                let spec = probe::ProbeSpec {
                    user: guard.as_ref().map(|g| g.user()),
                    network: match config.job_network {
                        executor::JobNetwork::Slot => guard
                            .as_ref()
                            .and_then(|g| g.network())
                            .map(|n| gpuci_sandbox::Network::Namespace(n.namespace())),
                        _ => None,
                    },
                    cgroups: if slots.is_some() && cgroup_problem.is_none() {
                        gpuci_sandbox::CgroupUse::Required
                    } else {
                        gpuci_sandbox::CgroupUse::Auto
                    },
                    // On the slot's own disk where it has one, as its jobs' workspaces are.
                    work_root: guard.as_ref().and_then(|g| g.disk()).map_or(work_root.as_path(), |d| d.path()),
                };
                let probed = probe::job_sandbox(spec).await;
                drop(guard);
                match probed {
                    Ok(what) => {
                        tracing::info!(probe = %what, "job sandbox works");
                        None
                    }
                    Err(e) => Some(e),
                }
            }
        }
    };
    let limits_problem = match (&slots, &cgroup_problem, container_limits) {
        (_, None, _) => None,
        (Some(_), Some(e), Some(own)) => Some(format!(
            "no cgroup of its own can be made for a job here ({e}); the container's own limits ({}) bind this \
             agent's one job instead, with its process limit as RLIMIT_NPROC",
            own.describe()
        )),
        (None, Some(e), _) => Some(format!("no job cgroups for an agent that is not root: {e}")),
        // A root agent without job cgroups and no container limits takes no jobs (above).
        (Some(_), Some(_), None) => None,
    };
    if let Some(why) = &limits_problem {
        tracing::error!(
            why,
            allow_unenforced_limits = config.allow_unenforced_limits,
            "memory, CPU and process limits of steps are NOT enforced as asked"
        );
    }
    if config.isolation == IsolationPolicy::None && !config.allow_unsandboxed {
        bail!("--isolation none runs jobs outside the sandbox: add --allow-unsandboxed to mean it");
    }
    let isolation_desc = match (&bwrap_problem, config.isolation, &slots) {
        (_, IsolationPolicy::None, _) => "none (--isolation none, --allow-unsandboxed)".to_string(),
        (None, _, Some(s)) => format!(
            "bubblewrap; jobs as uids {}+ (one per slot), seccomp, {}",
            s.first_uid(),
            match config.job_network {
                executor::JobNetwork::Slot => "a network namespace per slot",
                executor::JobNetwork::Host => "the HOST network (--job-network host)",
                executor::JobNetwork::None => "no network",
            }
        ),
        (None, _, None) => format!(
            "bubblewrap; agent not root: jobs as the agent's uid {} in a user namespace, seccomp, no network egress",
            nix::unistd::geteuid()
        ),
        (Some(why), _, _) if config.allow_unsandboxed => {
            format!("none: {why} (--allow-unsandboxed: trusted jobs run unsandboxed)")
        }
        (Some(why), _, _) => {
            format!("unavailable: {why}; this agent takes no jobs (or start it with --allow-unsandboxed)")
        }
    };
    // The disk quota: a root agent that cannot give each slot its disk takes no jobs (unless
    // told `--job-disk none`); one that is not root says so and goes on, as it does for its
    // weaker sandbox.
    let quota_refused = root && disk_problem.is_some();
    let isolation_desc = match (&disk_problem, if config.job_disk == 0 { 0 } else { disk_size.max(1) }) {
        (_, 0) => format!("{isolation_desc}; no disk quota (--job-disk none)"),
        (None, size) => format!("{isolation_desc}; a {} disk per slot", gpuci_core::quantity::Bytes(size)),
        (Some(why), _) if quota_refused => {
            format!("{isolation_desc}; disk quota unavailable: {why}; this agent takes no jobs (or start it with --job-disk none)")
        }
        (Some(why), _) => format!("{isolation_desc}; no disk quota: {why}"),
    };
    // An agent that cannot sandbox and may not run unsandboxed offers no slots at all.
    let takes_jobs = (bwrap_problem.is_none() || config.allow_unsandboxed) && !quota_refused;
    // Said to the coordinator in so many words: its waiting jobs are told why, not "busy".
    let refuses = match (&bwrap_problem, &disk_problem) {
        _ if takes_jobs => None,
        (Some(why), _) if !config.allow_unsandboxed => {
            Some(format!("no working job sandbox: {why} (or start it with --allow-unsandboxed)"))
        }
        (_, Some(why)) => {
            Some(format!("its jobs' disk quota cannot be set up: {why} (or start it with --job-disk none)"))
        }
        _ => Some("it offers no job slots".to_string()),
    };
    if let Some(why) = &bwrap_problem {
        tracing::error!(why, allow_unsandboxed = config.allow_unsandboxed, "no working sandbox");
    }
    let mut job_defaults = config.job_defaults;
    if job_defaults.memory.is_none() {
        job_defaults.memory = own_limits
            .memory
            .or_else(host_memory)
            .map(|m| gpuci_core::quantity::Bytes(m / u64::from(config.slots.max(1))));
    }
    let health = gpuci_gpu::HealthPolicy { post_job_timeout: config.post_job_timeout, ..Default::default() };
    let ctx = Arc::new(JobContext {
        sandbox_prefix: identity.agent_id.chars().filter(char::is_ascii_alphanumeric).take(12).collect(),
        work_root: work_root.clone(),
        hide_paths: [config.data_dir.clone(), work_root.clone()]
            .into_iter()
            .chain(config.hide.iter().cloned())
            .collect(),
        gpus: backend.clone(),
        inventory: std::sync::RwLock::new(inventory.clone()),
        isolation: config.isolation,
        allow_unsandboxed: config.allow_unsandboxed,
        allow_metadata_trusted: config.allow_metadata_trusted,
        limits_problem: limits_problem.clone(),
        allow_unenforced_limits: config.allow_unenforced_limits,
        disk_quota_problem: match (config.job_disk, root) {
            (0, _) => Some("the agent was started with --job-disk none".into()),
            (_, false) => Some("the agent is not root".into()),
            (_, true) => disk_problem.clone(),
        },
        // bwrap runs as the job's uid in a user namespace, also under a root agent: without
        // user namespaces it is as good as absent. `probe::job_sandbox` above makes sure.
        bubblewrap: bwrap_problem.is_none(),
        default_network: config.job_network,
        defaults: job_defaults,
        // The pod's pids.max counts the agent's threads and its job's processes together: a
        // job held to RLIMIT_NPROC above it could fork until the agent cannot start a thread
        // (outsider attack). The job gets what is left after a reserve for the agent.
        pids_cap: container_limits.and_then(|l| l.pids).map(|p| {
            let reserve = (p / 8).max(256);
            u32::try_from(p.saturating_sub(reserve).max(16)).unwrap_or(u32::MAX)
        }),
        slots: slots.clone(),
        container_runtime: container_runtime.clone(),
        health,
        baselines: std::sync::Mutex::new(Default::default()),
        telemetry_period: config.telemetry_period,
        max_log_bytes: config.max_log_bytes,
        live: Default::default(),
        tenancy: Default::default(),
        gpu_holds: Default::default(),
        caches: Arc::new(cache::CacheStore::open(config.data_dir.join("cache"), config.cache_limits)),
        uploads: Some(
            workspace::UploadSource::new(
                coordinators.current(),
                &identity.agent_id,
                &identity.credential,
                config.data_dir.join("uploads"),
            )
            .context("HTTP client for uploads")?,
        ),
    });
    // Whatever an earlier run of this agent left (it may have died with SIGKILL) goes first.
    let prefix = format!("{}-", ctx.sandbox_prefix);
    let job_uids = ctx.slots.as_ref().and_then(|s| s.lease()).map(|l| l.uids().to_vec()).unwrap_or_default();
    let swept = tokio::task::spawn_blocking(move || gpuci_sandbox::sweep(&prefix, &job_uids)).await.unwrap_or_default();
    if swept.stale_warm_removed > 0 {
        tracing::info!(cgroups = swept.stale_warm_removed, "removed empty warm-start cgroups of agents that are gone");
    }
    if swept.processes_killed + swept.cgroups_removed > 0 {
        tracing::warn!(
            processes = swept.processes_killed,
            cgroups = swept.cgroups_removed,
            "killed what an earlier run of this agent left behind"
        );
    }
    // From now on whatever this agent starts is ended when it dies, however it dies; a
    // return sweeps too, once the guard drops (a shutdown ends and reports its jobs first).
    let lease = ctx.slots.as_ref().and_then(|s| s.lease());
    let _reaper = reaper::guard(config.reaper.clone(), &format!("{}-", ctx.sandbox_prefix), lease);
    // Each idle slot's first job can start warm (after the sweep: it would take them).
    if let Some(slots) = &ctx.slots {
        let idle: Vec<_> = std::iter::from_fn(|| slots.take()).collect();
        for slot in &idle {
            if let Some(spec) = executor::warm_spec(&ctx, slot) {
                slot.prepare_warm(spec);
            }
        }
    }
    // Baselines are taken now, while the GPUs are idle.
    for g in ctx.inventory.read().unwrap_or_else(|e| e.into_inner()).iter() {
        executor::baseline(&ctx, &g.uuid);
    }
    if let (IsolationPolicy::Bubblewrap, Some(why)) = (config.isolation, &bwrap_problem) {
        bail!("--isolation bubblewrap: {why}");
    }
    tracing::info!(gpus = inventory.len(), backend = %backend_name, isolation = %isolation_desc, slots = config.slots, "agent ready");
    let hello_base = Hello {
        protocol: gpuci_protocol::PROTOCOL_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").into(),
        name: config.name.clone(),
        hostname: hostname(),
        slots: if takes_jobs { config.slots } else { 0 },
        tags: {
            let mut t = config.tags.clone();
            let v = if config.allow_unsandboxed { "allowed" } else { "forbidden" };
            t.insert(gpuci_protocol::agent::UNSANDBOXED_TAG.to_string(), v.to_string());
            let r = executor::resources_tag(limits_problem.as_deref(), config.allow_unenforced_limits);
            t.insert(gpuci_protocol::agent::RESOURCES_TAG.to_string(), r.to_string());
            t
        },
        gpus: inventory,
        gpu_backend: backend_name,
        isolation: isolation_desc.clone(),
        container_runtime: container_runtime.as_ref().map(|r| format!("{:?}", r.engine).to_lowercase()),
        running: Vec::new(),
        journal_incomplete: None,
        paused: None,
        interrupted: None,
        ends_at_ms: config.ends_at_ms,
        refuses,
    };
    let mut outbox = outbox::Outbox::new(OUTBOX_LIMIT);
    let mut holds = BTreeSet::new();
    for (job_id, events) in owed {
        tracing::warn!(job = job_id, "a job of an earlier run of this agent; reporting how it ended");
        holds.insert(job_id);
        for e in events {
            outbox.push(e);
        }
    }
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    // Looked at once before the first connection, so a machine already being taken back says
    // so in its hello and is given no job.
    let initial = match &config.interruption_notice {
        Some((url, _)) => interruption::check_once(url).await,
        None => None,
    };
    let (notice_tx, mut interrupted) = tokio::sync::watch::channel(initial.clone());
    if let (Some((url, every)), None) = (config.interruption_notice.clone(), initial) {
        tokio::spawn(interruption::watch(url, every, notice_tx, shutdown.clone()));
    }
    if let Some(outside) = &config.taken_back {
        interrupted = outside.clone();
    }
    let mut agent = Agent {
        ctx,
        hello_base,
        running: HashMap::new(),
        holds,
        started_at: HashMap::new(),
        journal,
        outbox,
        events_tx,
        events_rx,
        disk_dirs: vec![config.data_dir.clone(), work_root.clone()],
        min_free_disk: config.min_free_disk,
        paused: None,
        leave_after: config.leave_after_unreachable,
        last_connected: started,
        welcomed: false,
        last_job_ended: None,
        interrupted,
        end_when_taken_back: config.end_when_taken_back,
        told_taken_back: false,
        suspect_signal: false,
        ends_at_ms: config.ends_at_ms,
        coordinators,
        data_dir: config.data_dir.clone(),
    };
    agent.check_disk();
    let ended = agent.run(identity, shutdown).await;
    if let Some(slots) = &slots {
        slots.discard_warm().await;
    }
    ended
}

impl Agent {
    /// Look at the free space where jobs are written and pause or resume taking jobs
    /// ([`disk::decide`]). True when that changed.
    fn check_disk(&mut self) -> bool {
        let least = self
            .disk_dirs
            .iter()
            .filter_map(|d| match disk::free_bytes(d) {
                Ok(free) => Some((free, d)),
                Err(e) => {
                    tracing::warn!(dir = %d.display(), error = %e, "cannot read the free space");
                    None
                }
            })
            .min();
        let Some((free, dir)) = least else { return false };
        let now = disk::decide(dir, free, self.min_free_disk, self.paused.is_some());
        if now == self.paused {
            return false;
        }
        match &now {
            Some(why) => tracing::error!(why, "taking no new jobs"),
            None => tracing::info!(free, "enough free disk space again: taking new jobs"),
        }
        self.paused = now;
        true
    }

    async fn run(&mut self, id: identity::Identity, shutdown: CancellationToken) -> anyhow::Result<Ended> {
        // Tries in a row that found no coordinator to talk to.
        let mut failures = 0;
        'connect: loop {
            if shutdown.is_cancelled() {
                break;
            }
            let ended = self.session(&id, &shutdown).await;
            if std::mem::take(&mut self.welcomed) {
                self.last_connected = std::time::Instant::now();
            }
            // Jittered exponential backoff, capped at 5 s (1 s while several coordinators answer
            // and none leads: a takeover); job events are still collected meanwhile.
            let wait = match ended {
                Ok(SessionEnd::Shutdown) => break,
                Ok(SessionEnd::Done) => return Ok(Ended::Shutdown),
                Ok(SessionEnd::Refused(why)) => bail!("the coordinator refused this agent: {why}"),
                Ok(SessionEnd::Disconnected(why)) => {
                    tracing::warn!(why, "disconnected from coordinator; reconnecting");
                    failures = 0;
                    gpuci_core::coordinators::backoff(failures, false, rand::random::<f64>())
                }
                Err(e) => {
                    let leaderless = e.downcast_ref::<follow::NoLeader>().is_some();
                    let wait = gpuci_core::coordinators::backoff(failures, leaderless, rand::random::<f64>());
                    tracing::warn!(error = %format!("{e:#}"), retry_in = ?wait, "cannot reach coordinator");
                    wait
                }
            };
            failures = failures.saturating_add(1);
            let deadline = tokio::time::Instant::now() + wait;
            loop {
                // Asked again after every job event: the last job's end restarts the clock.
                let recheck_at = match self.leave_verdict() {
                    Some(leave::Verdict::Leave { unreachable_for }) => {
                        // No job runs (the rule): nothing to cancel.
                        return Ok(leaving(&id.server, unreachable_for));
                    }
                    Some(leave::Verdict::Stay { recheck_at: Some(at) }) => Some(tokio::time::Instant::from_std(at)),
                    _ => None,
                };
                tokio::select! {
                    _ = shutdown.cancelled() => break 'connect,
                    _ = tokio::time::sleep_until(deadline) => break,
                    _ = tokio::time::sleep_until(recheck_at.unwrap_or(deadline)), if recheck_at.is_some() => {}
                    Some(ev) = self.events_rx.recv() => self.drain_events(ev),
                }
            }
        }
        // Shutting down: stop jobs; their results are lost with us unless sent in time.
        for c in self.running.values() {
            c.cancel();
        }
        Ok(Ended::Shutdown)
    }

    /// The taken-back notice, if there is one this session has not told the coordinator and
    /// there is something to hand back (an idle agent that ends at once just goes: its fleet
    /// deleting it when idle is the common case).
    fn taken_back_untold(&mut self) -> Option<String> {
        let reason = self.interrupted.borrow_and_update().clone()?;
        if self.told_taken_back {
            return None;
        }
        tracing::warn!(%reason, "the machine is being taken back; taking no new job");
        if self.end_when_taken_back && self.running.is_empty() && self.outbox.is_empty() {
            return None;
        }
        self.told_taken_back = true;
        Some(reason)
    }

    /// Why this agent should end now, if it should: its machine is being taken back
    /// ([`Config::end_when_taken_back`]) or nearly at its end, no job runs and the coordinator
    /// has every result.
    fn done_here(&self, end_at: Option<tokio::time::Instant>) -> Option<String> {
        if !self.running.is_empty() || !self.outbox.is_empty() {
            return None;
        }
        if self.end_when_taken_back {
            if let Some(why) = self.interrupted.borrow().clone() {
                return Some(format!("taken back ({why}), and no job runs"));
            }
        }
        match end_at {
            Some(t) if t <= tokio::time::Instant::now() => {
                Some(format!("this machine ends within {}s, too soon for any job", END_MARGIN.as_secs()))
            }
            _ => None,
        }
    }

    /// [`leave::decide`] on what the agent knows now; `None` without `--leave-after-unreachable`.
    /// Asked only between connections.
    fn leave_verdict(&self) -> Option<leave::Verdict> {
        let facts = leave::Facts {
            last_connected: self.last_connected,
            last_job_ended: self.last_job_ended,
            running_jobs: self.running.len(),
        };
        Some(leave::decide(self.leave_after?, &facts, std::time::Instant::now()))
    }

    /// Take in one event from a job task: journal what must survive us, queue it for the
    /// coordinator. `lines` collects consecutive log lines of one job, to go as one event.
    fn on_event(&mut self, ev: JobEvent, lines: &mut Option<(JobId, Vec<LogChunk>)>) {
        // The line's in-flight budget is given back here: the outbox bounds it from now on.
        if let JobEvent::Log { job_id, chunk, held } = ev {
            drop(held);
            match lines {
                Some((j, batch)) if *j == job_id && batch.len() < LINES_PER_EVENT => batch.push(chunk),
                _ => {
                    self.flush_lines(lines);
                    *lines = Some((job_id, vec![chunk]));
                }
            }
            return;
        }
        self.flush_lines(lines);
        match ev {
            JobEvent::Started { job_id, pid, at_us, unenforced } => {
                self.started_at.insert(job_id, at_us);
                let record = Record::Started { job_id, pid, started_at_us: at_us, unenforced: unenforced.clone() };
                self.journal_write(&record, false);
                self.outbox.push(gpuci_protocol::agent::JobEvent::Started {
                    job_id,
                    pid,
                    started_at_us: at_us,
                    unenforced,
                });
            }
            JobEvent::Finished(mut f) => {
                self.running.remove(&f.job_id);
                if self.end_when_taken_back && ended_by_a_stop_signal(&f.outcome) {
                    self.suspect_signal = true;
                }
                self.last_job_ended = Some(std::time::Instant::now());
                f.started_at_us = f.started_at_us.or(self.started_at.remove(&f.job_id));
                f.lines = Some(self.outbox.lines_of(f.job_id));
                self.journal_write(&Record::Finished(f.clone()), true);
                self.outbox.push(gpuci_protocol::agent::JobEvent::Finished(f));
            }
            JobEvent::Log { .. } => {}
        }
    }

    fn flush_lines(&mut self, lines: &mut Option<(JobId, Vec<LogChunk>)>) {
        if let Some((job_id, batch)) = lines.take() {
            self.outbox.push_lines(job_id, batch);
        }
    }

    fn journal_write(&mut self, r: &Record, sync: bool) {
        if let Err(e) = self.journal.write(r, sync) {
            tracing::error!(error = %e, record = ?r, "could not write the agent's journal: if this agent dies now, the coordinator may not learn how this job ended");
        }
    }

    /// Everything job tasks have reported so far goes into the outbox.
    fn drain_events(&mut self, first: JobEvent) {
        let mut lines = None;
        self.on_event(first, &mut lines);
        for _ in 0..4096 {
            match self.events_rx.try_recv() {
                Ok(e) => self.on_event(e, &mut lines),
                Err(_) => break,
            }
        }
        self.flush_lines(&mut lines);
    }

    /// The coordinator committed every event up to `upto`.
    fn acked(&mut self, upto: u64) {
        for job_id in self.outbox.ack(upto) {
            self.holds.remove(&job_id);
            self.journal_write(&Record::Done { job_id }, false);
        }
        if let Err(e) = self.journal.compact_if_over(JOURNAL_COMPACT_BYTES) {
            tracing::warn!(error = %e, "could not compact the journal");
        }
    }
}

/// Lines per log event.
const LINES_PER_EVENT: usize = 1000;

#[cfg(test)]
mod tests {
    #[test]
    fn the_start_up_sweep_removes_only_workspaces() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        for d in ["job-7/src", "ws-3", "slot-0", ".engine", "keep"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::write(root.join("job-7/src/main.rs"), "x").unwrap();
        let outside = tempfile::tempdir().expect("tempdir");
        std::fs::write(outside.path().join("precious"), "x").unwrap();
        std::os::unix::fs::symlink(outside.path(), root.join("ws-9")).unwrap();
        assert_eq!(super::sweep_workspaces(root), 3);
        let mut left: Vec<String> =
            std::fs::read_dir(root).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, [".engine", "keep", "slot-0"]);
        assert!(outside.path().join("precious").exists(), "a link was followed");
    }

    #[test]
    fn a_stop_signal_is_seen_whether_the_job_was_killed_or_exited_128_plus_it() {
        use gpuci_core::job::Outcome;
        for o in [Outcome::Signalled { signal: 15 }, Outcome::Exited { code: 143 }, Outcome::Exited { code: 137 }] {
            assert!(super::ended_by_a_stop_signal(&o), "{o:?}");
        }
        for o in [Outcome::Exited { code: 1 }, Outcome::Signalled { signal: 11 }, Outcome::Exited { code: 139 }] {
            assert!(!super::ended_by_a_stop_signal(&o), "{o:?}");
        }
    }
}
