//! Arguments, as clap types. Every flag that a deployment sets has an `env =`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "gpuci",
    version,
    about = "Self-hosted GPU CI: whole, healthy, isolated GPUs for CI jobs",
    propagate_version = true
)]
pub struct Cli {
    /// More log output on stderr (-v, -vv).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, global = true)]
    pub quiet: bool,
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: a few hundred bytes between variants cost nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Coordinator and one local agent in one process, with an embedded SQLite store.
    Up(UpArgs),
    /// Run a pipeline on this machine now, with no server to set up; exits with its result.
    Run(RunArgs),
    /// The coordinator alone.
    Server(ServerArgs),
    /// An agent that connects to a coordinator and runs jobs.
    Agent(AgentArgs),
    /// Submit a pipeline file to a coordinator.
    Submit(SubmitArgs),
    /// List jobs, or show one.
    Jobs(JobsArgs),
    /// Print a job's log.
    Logs(LogsArgs),
    /// A job's artifacts: `list JOB`, `download JOB [GLOB] [--dir D]`.
    Artifacts(crate::cmd::artifacts::ArtifactsArgs),
    /// From inside a running job: `upload FILE` adds FILE's steps to the job's own pipeline.
    Pipeline(crate::cmd::pipeline::PipelineArgs),
    /// Cancel a job.
    Cancel(CancelArgs),
    /// List agents with their GPUs.
    Agents(AgentsArgs),
    /// Fleets: machines by state, what the autoscaler wants and why, provider errors, spend.
    Fleets(AgentsArgs),
    /// What fleet machines cost, by day, fleet and repository, with the fleets' overhead.
    Cost(CostArgs),
    /// GitHub workflow jobs gpuci serves with runners: state and reason of each.
    Github(GithubArgs),
    /// GPU administration.
    Gpu(GpuArgs),
    /// Secrets that steps receive by name (`secrets: [HF_TOKEN]`); values are masked in logs.
    Secret(SecretArgs),
    /// The audit log: who set or removed secrets, rotated keys, made or revoked tokens,
    /// approved pull requests, cancelled jobs (admin token only).
    Audit(AuditArgs),
    /// Named API tokens: each person or CI system its own, named in the audit log (admin
    /// token only).
    Token(TokenArgs),
    /// Schedules: pipelines the coordinator submits on a cron schedule (`[[schedule]]` in
    /// its config): next run, last runs and their state; `run NAME` fires one now.
    Schedules(SchedulesArgs),
    /// Check this host as a GPU CI node.
    Doctor(DoctorArgs),
    /// Check a pipeline file without running it.
    Validate(ValidateArgs),
    /// Print the JSON Schema of the pipeline format.
    Schema,
    /// Replay a job trace through the autoscaler on a simulated clock, beside four baseline
    /// policies (always-on, a fixed 5-minute idle timeout, the best fixed idle timeout and the
    /// best fixed pair of stop and delete timeouts in hindsight): paid GPU-hours and cost
    /// against the floor any policy pays, queue waits, machines.
    Simulate(SimulateArgs),
    /// Benchmarks (see BENCHMARKS.md).
    Bench(BenchArgs),
}

/// Where the API is and how to authenticate.
#[derive(Args, Debug, Clone)]
pub struct ClientArgs {
    /// Coordinator URL; several (repeated, or comma-separated): the one that leads, asked by
    /// its /readyz (a name with several addresses: each address is asked).
    #[arg(long, env = "GPUCI_SERVER", default_value = "http://127.0.0.1:8070", global = true, value_delimiter = ',')]
    pub server: Vec<String>,
    /// API token; by default read from <data-dir>/api-token.
    #[arg(long, env = "GPUCI_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
    /// The coordinator's data dir (to find the API token on the same machine).
    #[arg(long, env = "GPUCI_DATA_DIR", global = true)]
    pub data_dir: Option<PathBuf>,
    /// The coordinators' identity key (`ed25519:…`, in the coordinator's data dir as
    /// coordinator-key.pub; read from there by default): the API token goes only to an
    /// address that proves it.
    #[arg(long, env = "GPUCI_COORDINATOR_KEY", global = true)]
    pub coordinator_key: Option<String>,
    /// Machine-readable output on stdout.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct LocalAgentArgs {
    /// Simulated GPUs for the local agent, e.g. 4xH100-80GB (always shown as simulated).
    #[arg(long, env = "GPUCI_SIMULATE_GPUS")]
    pub simulate_gpus: Option<String>,
    /// Only these of the host's GPUs, by UUID or index, comma-separated (a share of the host
    /// given to this agent), or `none`; default: all. A GPU the host lacks stops the agent at
    /// start.
    #[arg(long, env = "GPUCI_GPUS", value_parser = parse_gpu_share, action = clap::ArgAction::Set)]
    pub gpus: Option<GpuShare>,
    /// Jobs the local agent runs at once.
    #[arg(long, default_value_t = 4)]
    pub slots: u32,
    /// Tags of the local agent, key=value (repeatable).
    #[arg(long = "tag", value_parser = parse_tag)]
    pub tags: Vec<(String, String)>,
    /// Job isolation.
    #[arg(long, value_enum, default_value_t = IsolationArg::Auto)]
    pub isolation: IsolationArg,
    /// Per-job cap on the log kept: past it the job keeps running, the rest of its output is
    /// read and discarded, and the log ends with a gpuci line saying where and why it was cut.
    /// Each line counts its text plus 40 bytes (what storing a line costs), so a job printing
    /// tiny lines cannot store many times the cap.
    #[arg(long, env = "GPUCI_MAX_LOG_BYTES", default_value = "100MiB", value_parser = parse_bytes)]
    pub max_log_bytes: u64,
    /// With less free space than this on the filesystem of its data dir or workspaces, the
    /// agent takes no new jobs (`gpuci agents` says why) until space is freed; jobs it runs go
    /// on. 0: never.
    #[arg(long, env = "GPUCI_MIN_FREE_DISK", default_value = "1GiB", value_parser = parse_bytes)]
    pub min_free_disk: u64,
    #[command(flatten)]
    pub jobs: JobArgs,
}

/// How the agent confines jobs (see docs/sandbox.md).
#[derive(Args, Debug, Clone, Default)]
pub struct JobArgs {
    /// Let trusted jobs run outside the sandbox: steps with `sandbox: none`, and every job
    /// when bubblewrap cannot work on this host. Without it such steps are not placed here
    /// (they wait, with the reason, until their queue timeout), and an agent without a
    /// working sandbox takes no jobs. Jobs from forks, outside contributors and
    /// Actions runners never run unsandboxed.
    #[arg(long, env = "GPUCI_ALLOW_UNSANDBOXED")]
    pub allow_unsandboxed: bool,
    /// Let jobs of trusted origins reach the cloud instance metadata service
    /// (169.254.169.254 and the like), and with it the machine's instance role. By default
    /// every job's network refuses those addresses; jobs from forks, outside contributors and
    /// Actions runners are refused them always.
    #[arg(long, env = "GPUCI_ALLOW_METADATA_TRUSTED")]
    pub allow_metadata_trusted: bool,
    /// Run steps that set `resources:` (memory, cpus, pids) even where this agent cannot
    /// enforce them (it is not root and has no job cgroups); each such job's log and
    /// `gpuci jobs show` (under "NOT enforced:") say so. Without it such steps are not placed
    /// here and wait, with the reason.
    #[arg(long, env = "GPUCI_ALLOW_UNENFORCED_LIMITS")]
    pub allow_unenforced_limits: bool,
    /// Host uids (and gids) for jobs of a root agent, START-END: two per slot (the job's and
    /// its network's); no account may use them, nor another agent. Default: the first block
    /// of 256 from 1500000000 that no other agent on this host holds.
    #[arg(long, env = "GPUCI_JOB_UIDS", value_parser = parse_uid_range)]
    pub job_uids: Option<(u32, u32)>,
    /// What `network: default` steps get: `slot` (a network namespace per slot with egress
    /// through pasta; nothing of the host's loopback), `host` (the host's network: other
    /// jobs' and the host's loopback services), or `none`.
    #[arg(long, env = "GPUCI_JOB_NETWORK", value_enum, default_value_t = JobNetworkArg::Slot)]
    pub job_network: JobNetworkArg,
    /// A TCP port on the host's loopback that jobs may connect to at 127.0.0.1:PORT
    /// (repeatable): a package mirror, a GitHub Enterprise Server on this host. Nothing else
    /// of the host's loopback is reachable.
    #[arg(long = "job-host-port", env = "GPUCI_JOB_HOST_PORTS", value_delimiter = ',')]
    pub job_host_ports: Vec<u16>,
    /// Memory limit of a job whose step sets none. Default: the host's memory / slots.
    #[arg(long, env = "GPUCI_JOB_MEMORY", value_parser = parse_bytes)]
    pub job_memory: Option<u64>,
    /// Process limit of a job whose step sets none.
    #[arg(long, env = "GPUCI_JOB_PIDS", default_value_t = gpuci_agent::DEFAULT_JOB_PIDS)]
    pub job_pids: u32,
    /// CPU limit of a job whose step sets none, in CPUs (1.5). Default: none.
    #[arg(long, env = "GPUCI_JOB_CPUS", value_parser = parse_cpus)]
    pub job_cpus: Option<u32>,
    /// Disk quota of a job: its workspace (with the caches restored into it) lives on a disk
    /// of this size of its slot's own, so a job cannot fill the host's disk; past it its
    /// writes fail and it ends "disk quota exceeded". Needs a root agent and loop devices: a
    /// root agent that cannot make them takes no jobs. `none`: no quota (jobs share the
    /// host's disk).
    #[arg(long, env = "GPUCI_JOB_DISK", default_value = "20GiB", value_parser = parse_job_disk)]
    pub job_disk: u64,
}

/// A size, or `none` (0: no quota).
pub fn parse_job_disk(s: &str) -> Result<u64, String> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(0);
    }
    let b = parse_bytes(s)?;
    if b < 16 << 20 {
        return Err(format!("{s:?}: a job disk needs at least 16MiB (or `none`)"));
    }
    Ok(b)
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JobNetworkArg {
    #[default]
    Slot,
    Host,
    None,
}

impl JobArgs {
    /// Applies these settings to an agent's config.
    pub fn apply(&self, c: &mut gpuci_agent::Config) {
        c.allow_unsandboxed = self.allow_unsandboxed;
        c.allow_metadata_trusted = self.allow_metadata_trusted;
        c.allow_unenforced_limits = self.allow_unenforced_limits;
        c.job_uids = self.job_uids;
        c.job_network = match self.job_network {
            JobNetworkArg::Slot => gpuci_agent::JobNetwork::Slot,
            JobNetworkArg::Host => gpuci_agent::JobNetwork::Host,
            JobNetworkArg::None => gpuci_agent::JobNetwork::None,
        };
        c.job_host_ports = self.job_host_ports.clone();
        c.job_defaults = gpuci_agent::SlotDefaults {
            memory: self.job_memory.map(gpuci_core::quantity::Bytes),
            pids: Some(self.job_pids),
            cpu_millis: self.job_cpus,
        };
        c.job_disk = self.job_disk;
    }
}

pub fn parse_uid_range(s: &str) -> Result<(u32, u32), String> {
    gpuci_agent::slots::parse_uid_range(s)
}

pub fn parse_cpus(s: &str) -> Result<u32, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if !(v > 0.0 && v <= 4096.0) {
        return Err(format!("{s:?}: expected a number of CPUs, e.g. 1.5"));
    }
    Ok((v * 1000.0).round() as u32)
}

#[derive(Args, Debug)]
pub struct UpArgs {
    #[arg(long, env = "GPUCI_LISTEN", default_value = "127.0.0.1:8070")]
    pub listen: SocketAddr,
    /// State, tokens and workspaces. Default: $XDG_DATA_HOME/gpuci or ~/.local/share/gpuci.
    #[arg(long, env = "GPUCI_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    #[command(flatten)]
    pub agent: LocalAgentArgs,
    /// Pipelines to submit once up; their progress is shown. The server keeps running.
    pub pipelines: Vec<PathBuf>,
    /// Exit when the given pipelines have finished, with their result (for scripts and demos).
    #[arg(long)]
    pub exit_when_done: bool,
    /// The key secret values are sealed with at rest (32 raw bytes or 64 hex digits), kept
    /// apart from the database. Created (mode 0600) when absent and no sealed value exists.
    /// Coordinators sharing a database share it. Default: `secrets.key` in the data dir.
    #[arg(long, env = "GPUCI_SECRETS_KEY_FILE")]
    pub secrets_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub upload: UploadArgs,
    /// As `gpuci server --new-database`: start over with a new, empty database although the
    /// data dir was used before and its database is missing or empty. Use it once.
    #[arg(long)]
    pub new_database: bool,
    /// The server's config file, as `gpuci server --config` takes it (`[github]`,
    /// `[[fleet]]`, `[dashboard] public_repositories`, budgets, `[uploads]`).
    #[arg(long, env = "GPUCI_CONFIG")]
    pub config: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The pipeline file.
    #[arg(default_value = ".gpuci.yml")]
    pub file: PathBuf,
    #[command(flatten)]
    pub agent: LocalAgentArgs,
    /// Events as NDJSON on stdout instead of human output.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub upload: UploadArgs,
}

/// Which files a pipeline's jobs start with in their workspace.
#[derive(Args, Debug, Clone, Default)]
pub struct UploadArgs {
    /// Start jobs in an empty workspace: upload no files.
    #[arg(long, conflicts_with = "upload")]
    pub no_upload: bool,
    /// Upload this directory as the workspace (in a git work tree: the files git does not
    /// ignore). Default: the git work tree holding the pipeline file, else its directory.
    #[arg(long, value_name = "DIR")]
    pub upload: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct ServerArgs {
    #[arg(long, env = "GPUCI_LISTEN", default_value = "127.0.0.1:8070")]
    pub listen: SocketAddr,
    #[arg(long, env = "GPUCI_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Agents silent this long are lost and their jobs end `lost`.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub lost_after: std::time::Duration,
    /// How often agents send heartbeats.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub heartbeat: std::time::Duration,
    /// How often the fleets' reconcile loop asks providers what exists and decides.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub fleet_interval: std::time::Duration,
    /// How often workspace uploads are garbage-collected (at start, then at this interval);
    /// what goes is set by `[uploads]` in the config file.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub upload_collect_interval: std::time::Duration,
    /// The server's config file (TOML; the `[github]` section: App, webhook secret, runner
    /// pools; `[[fleet]]`s of machines made on demand). See docs/github.md, docs/fleets.md.
    #[arg(long, env = "GPUCI_CONFIG")]
    pub config: Option<PathBuf>,
    /// Keep state in Postgres at this URL (`postgres://user:password@host:5432/gpuci`).
    /// Default: the SQLite file `gpuci.db` in the data dir.
    #[arg(long, env = "GPUCI_DATABASE_URL", hide_env_values = true)]
    pub database: Option<String>,
    /// The key secret values are sealed with at rest (32 raw bytes or 64 hex digits), kept
    /// apart from the database. Created (mode 0600) when absent and no sealed value exists.
    /// Coordinators sharing a database share it. Default: `secrets.key` in the data dir.
    #[arg(long, env = "GPUCI_SECRETS_KEY_FILE")]
    pub secrets_key_file: Option<PathBuf>,
    /// The most log stored per job, whatever an agent sends (agents cut at their own
    /// --max-log-bytes, 100MiB by default; this leaves room for gpuci's own lines). Counted
    /// as the agents count: each line's text plus 40 bytes.
    #[arg(long, env = "GPUCI_SERVER_MAX_LOG_BYTES", default_value = "101MiB", value_parser = parse_bytes)]
    pub max_log_bytes: u64,
    /// Start over with a new, empty database although the data dir was used before and its
    /// `gpuci.db` is missing or empty (refused without this flag: restore it from a backup
    /// instead). Registered agents must register again. A database that holds data is never
    /// replaced; use it once, not in a service file.
    #[arg(long)]
    pub new_database: bool,
    /// With a Postgres --database another coordinator leads: wait as its standby (on
    /// --listen, answering /healthz 200 and everything else 503, so load balancers and agents
    /// given several coordinators pass it by) and take over within seconds when the leader
    /// stops renewing its claim (killed, paused, cut off from the database), instead of
    /// refusing to start. The standby's data dir holds copies of the leader's tokens and keys
    /// (docs/ha.md).
    #[arg(long, env = "GPUCI_STANDBY")]
    pub standby: bool,
    /// The most connections one client address may hold open, agents' channels not counted
    /// (requests, followed logs, live pages); over it a connection is answered 503. Default:
    /// an eighth of what the open-file limit leaves for clients (at least 32). 0: no limit per
    /// address, for a coordinator behind a load balancer or reverse proxy (one address for all
    /// its clients: limit per client there). docs/ha.md, "Slow clients".
    #[arg(long, env = "GPUCI_MAX_CONNECTIONS_PER_ADDRESS")]
    pub max_connections_per_address: Option<usize>,
    /// A name (or address) agents and the CLI reach this coordinator by, repeated or
    /// comma-separated: it proves its identity key only for these and for the address a
    /// request comes in on, so a relay at another address gets no proof (docs/ha.md). Give the
    /// DNS names in agents' --server and, behind NAT or a load balancer, the address they dial.
    /// None given: any name is signed (a relay by name is then not stopped).
    #[arg(long = "public-name", env = "GPUCI_PUBLIC_NAMES", value_delimiter = ',')]
    pub public_names: Vec<String>,
}

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// Coordinator URL; several (repeated, or comma-separated) where a standby stands beside
    /// the leader: the agent talks to the one that leads, asked by its /readyz, and moves to
    /// the new leader after a failover (a name with several addresses: each is asked).
    #[arg(long, env = "GPUCI_SERVER", required = true, value_delimiter = ',')]
    pub server: Vec<String>,
    /// Needed the first time only; afterwards the agent's own credential in its data dir is used.
    #[arg(long, env = "GPUCI_REGISTRATION_TOKEN", hide_env_values = true)]
    pub registration_token: Option<String>,
    /// Read the registration token from this file.
    #[arg(long, env = "GPUCI_REGISTRATION_TOKEN_FILE")]
    pub registration_token_file: Option<PathBuf>,
    /// The coordinators' identity key (`ed25519:…`, in the coordinator's data dir as
    /// coordinator-key.pub): no address that cannot prove it is sent any credential, the
    /// registration token included. Default: pinned at registration (first use).
    #[arg(long, env = "GPUCI_COORDINATOR_KEY")]
    pub coordinator_key: Option<String>,
    /// Default: $XDG_DATA_HOME/gpuci-agent or ~/.local/share/gpuci-agent.
    #[arg(long, env = "GPUCI_AGENT_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Default: the host name.
    #[arg(long, env = "GPUCI_AGENT_NAME")]
    pub name: Option<String>,
    #[command(flatten)]
    pub local: LocalAgentArgs,
    /// Accepted for old scripts: refusing `sandbox: none` is now the default (see
    /// --allow-unsandboxed).
    #[arg(long, hide = true, conflicts_with = "allow_unsandboxed")]
    pub forbid_unsandboxed: bool,
    /// A path jobs must not see (repeatable; colon-separated in the variable): other
    /// credentials on this host. The agent's data dir and registration token file are always
    /// hidden, also inside directories the sandbox shows (/usr, /opt, /etc).
    #[arg(long = "hide", value_name = "PATH", env = "GPUCI_AGENT_HIDE", value_delimiter = ':')]
    pub hide: Vec<PathBuf>,
    /// How long GPU memory may take to return to baseline after a job before the GPU is quarantined.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub post_job_timeout: std::time::Duration,
    /// Largest cache one job may save (all its `cache:` paths); a bigger one is not saved and
    /// the job's log says so.
    #[arg(long, env = "GPUCI_CACHE_MAX_ENTRY_SIZE", default_value = "10GiB")]
    pub cache_max_entry_size: gpuci_core::quantity::Bytes,
    /// Most files, directories and links one job's cache may hold; a cache with more is not
    /// saved and the job's log says so.
    #[arg(long, env = "GPUCI_CACHE_MAX_ENTRY_FILES", default_value_t = 1_000_000)]
    pub cache_max_entry_files: u64,
    /// All caches on this agent together; past it the least recently used are removed.
    #[arg(long, env = "GPUCI_CACHE_MAX_TOTAL", default_value = "50GiB")]
    pub cache_max_total: gpuci_core::quantity::Bytes,
    /// Start although the agent's journal (in its data dir) is damaged or missing, giving up
    /// the jobs it held: the coordinator ends every job it had assigned here and the agent
    /// does not report as `lost`, rather than hand one out again that may have run. Only
    /// when the agent refused to start and said to; an intact journal is kept as it is.
    #[arg(long)]
    pub reset_journal: bool,
    /// For a machine that exists only to run this agent (one gpuci created): give it up when
    /// the coordinator has not been reachable for this long (e.g. 10m) and no job runs, so a
    /// dead coordinator does not leave GPUs billing. A running job keeps the machine; the
    /// clock restarts when the last job ends (its result can still reach a coordinator that
    /// comes back). The agent then runs --on-leave, if given, and exits with status 75
    /// (EX_TEMPFAIL), for a service manager or cloud-init to act on. Default: never.
    #[arg(long, env = "GPUCI_LEAVE_AFTER_UNREACHABLE", value_parser = parse_duration, value_name = "DURATION")]
    pub leave_after_unreachable: Option<std::time::Duration>,
    /// A shell command (run with `sh -c`, once) when the agent leaves, e.g. `shutdown -h now`
    /// or `sudo poweroff`; its exit status is logged. Only with --leave-after-unreachable.
    #[arg(long, env = "GPUCI_ON_LEAVE", value_name = "COMMAND", requires = "leave_after_unreachable")]
    pub on_leave: Option<String>,
    /// Where the machine's provider posts a notice that it takes the machine back: on EC2
    /// spot, http://169.254.169.254/latest/meta-data/spot/instance-action. Once a notice is
    /// there the agent takes no new job and the coordinator puts its jobs back in the queue,
    /// once. Default: not watched.
    #[arg(long, env = "GPUCI_INTERRUPTION_NOTICE_URL", value_name = "URL")]
    pub interruption_notice_url: Option<String>,
    /// How often to look at --interruption-notice-url.
    #[arg(long, default_value = "5s", value_parser = parse_duration, hide = true)]
    pub interruption_poll: std::time::Duration,
    /// This agent runs inside what a cluster engine granted (set by the slurm and kubernetes
    /// fleets): it serves exactly the GPUs of the grant (Slurm's SLURM_JOB_GPUS, GRES indices
    /// mapped to device files through the node's gres.conf; the device plugin's
    /// NVIDIA_VISIBLE_DEVICES; an unreadable or ambiguous grant is an error, never all GPUs),
    /// tells the coordinator when the allocation ends (Slurm: from squeue) so it is given no
    /// job that would outlive it, and takes the engine's SIGTERM as the machine being taken
    /// back: its jobs are queued again, once, and it ends when none runs (a second signal, or
    /// --terminate-grace, ends it at once).
    #[arg(long, env = "GPUCI_ALLOCATION", value_name = "slurm|kubernetes")]
    pub allocation: Option<gpuci_agent::allocation::Engine>,
    /// The machine ends this long after the agent starts (a pod's activeDeadlineSeconds);
    /// like a Slurm allocation's end, no job that would outlive it is given to the agent.
    #[arg(long, env = "GPUCI_ENDS_IN", value_parser = parse_duration, value_name = "DURATION")]
    pub ends_in: Option<std::time::Duration>,
    /// With --allocation: how long after the engine's SIGTERM the agent ends even if its jobs'
    /// results have not reached the coordinator (keep it under Slurm's KillWait, 30s by
    /// default, and a pod's terminationGracePeriodSeconds).
    #[arg(long, default_value = "20s", value_parser = parse_duration, value_name = "DURATION")]
    pub terminate_grace: std::time::Duration,
    /// With --simulate-gpus: the host name simulated GPU UUIDs are made from (default: the
    /// agent's name), so agents on one simulated node share its UUIDs (tests, demos).
    #[arg(long, hide = true, requires = "simulate_gpus")]
    pub simulate_host: Option<String>,
    /// With --allocation: how many GPUs the grant must have (the fleet's machine.gpus); a
    /// grant of another size stops the agent at start instead of serving the wrong number.
    #[arg(long, requires = "allocation", value_name = "N")]
    pub expect_gpus: Option<u32>,
    /// With --allocation kubernetes: the directory that stands for the container's `/` when
    /// reading the grant (`/dev/nvidia*`, `/var/run/nvidia-container-devices/`). Tests only:
    /// the Kubernetes test double's pods are local processes.
    #[arg(long, hide = true, env = "GPUCI_GRANT_ROOT", value_name = "DIR")]
    pub grant_root: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
pub struct SubmitArgs {
    pub file: PathBuf,
    /// Follow the pipeline until it ends; exit with its result.
    #[arg(long)]
    pub wait: bool,
    #[command(flatten)]
    pub upload: UploadArgs,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Args, Debug)]
pub struct JobsArgs {
    #[command(subcommand)]
    pub show: Option<JobsSub>,
    /// Only these states (comma-separated), e.g. queued,running.
    #[arg(long)]
    pub state: Option<String>,
    #[arg(long)]
    pub pipeline: Option<i64>,
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Subcommand, Debug)]
pub enum JobsSub {
    /// One job in full: reason, agent, GPUs, telemetry.
    Show { id: i64 },
}

/// Each line starts with a column only gpuci writes: `│` before the job's output (stdout
/// lines on stdout, stderr lines on stderr), `#` before gpuci's own lines about the job
/// (sandbox, cache, GPU checks, log cut; on stderr). The job's text is shown with control
/// characters made visible (ESC as `\x1b`, `\r` as `\x0d`, a bidi override as `\u{202e}`),
/// so it can neither act on the terminal nor start a line of its own. `--json` gives the exact
/// text.
#[derive(Args, Debug)]
pub struct LogsArgs {
    pub job: i64,
    /// Follow until the job ends.
    #[arg(short, long)]
    pub follow: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Args, Debug)]
pub struct CancelArgs {
    pub job: i64,
    #[arg(long)]
    pub reason: Option<String>,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Args, Debug)]
pub struct AgentsArgs {
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Args, Debug)]
pub struct AuditArgs {
    /// Entries at or after this: a UTC time (2026-11-28T12:00:00Z) or a duration back from
    /// now (2h, 7d).
    #[arg(long)]
    pub since: Option<String>,
    /// An action (secret.set, secret.rm, secrets-key.rotate, token.create, token.revoke,
    /// approval.grant, job.cancel, job.retry, gpu.release, schedule.run, pipeline.upload) or the part
    /// before its dot (secret).
    #[arg(long)]
    pub action: Option<String>,
    /// Entries of this actor: `admin`, a named token, a GitHub login.
    #[arg(long)]
    pub actor: Option<String>,
    /// At most this many entries, newest first.
    #[arg(long, default_value_t = 1000)]
    pub limit: u32,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Args, Debug)]
pub struct SchedulesArgs {
    #[command(subcommand)]
    pub command: Option<SchedulesCommand>,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Subcommand, Debug)]
pub enum SchedulesCommand {
    /// List the schedules: cron, time zone, next run (local and UTC), last run and its state (the default).
    List,
    /// Fire a schedule now (also a disabled one); prints the pipeline it submitted.
    Run { name: String },
}

#[derive(Args, Debug)]
pub struct TokenArgs {
    #[command(subcommand)]
    pub command: TokenCommand,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Make a named API token; prints it once, on stdout (store it now: only its hash is kept).
    Create { name: String },
    /// List named tokens (never their values).
    List,
    /// Revoke a named token at once. Its name is never given to another token.
    Revoke { name: String },
}

#[derive(Args, Debug)]
pub struct CostArgs {
    /// UTC days back from now, today included.
    #[arg(long, default_value_t = 7)]
    pub days: u32,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Args, Debug)]
pub struct GithubArgs {
    #[command(subcommand)]
    pub command: GithubCommand,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Subcommand, Debug)]
pub enum GithubCommand {
    /// Workflow jobs that matched a runner pool, newest first, with why each waits or was cancelled.
    Jobs {
        /// Only jobs still queued or in progress.
        #[arg(long)]
        active: bool,
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// GitHub's rate limits left per credential, and how many workflow jobs wait.
    Status,
}

#[derive(Args, Debug)]
pub struct GpuArgs {
    #[command(subcommand)]
    pub command: GpuCommand,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Subcommand, Debug)]
pub enum GpuCommand {
    /// Return a quarantined GPU to service.
    Release { uuid: String },
}

#[derive(Args, Debug)]
pub struct SecretArgs {
    #[command(subcommand)]
    pub command: SecretCommand,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Subcommand, Debug)]
pub enum SecretCommand {
    /// Set (or rotate) a secret in a scope; the value is read from standard input (never from
    /// the command line). Without --repo it is given to every pipeline that names it.
    Set {
        name: String,
        #[command(flatten)]
        scope: SecretScopeArgs,
    },
    /// List secret names and scopes (never values).
    List,
    /// Delete a secret's value in one scope.
    Rm {
        name: String,
        #[command(flatten)]
        scope: SecretScopeArgs,
    },
    /// Encrypt a value (read from standard input) for a repository's pipeline file; prints
    /// `NAME: "gpuci:v1:…"` for the step's `secrets:` map. Only jobs of that repository (and
    /// ref pattern) get it, never pull requests from forks. Needs no admin token with
    /// --recipient (the coordinator's public key, from `gpuci secret key`).
    Encrypt {
        name: String,
        #[command(flatten)]
        scope: SecretScopeArgs,
        /// The coordinator's public key (`age1…`); default: ask the coordinator.
        #[arg(long)]
        recipient: Option<String>,
    },
    /// Print the coordinator's public key for `gpuci secret encrypt` (and every key id that
    /// still decrypts); --rotate makes a new one first.
    Key {
        #[arg(long)]
        rotate: bool,
    },
}

/// Where a secret applies. A job gets the narrowest scope that covers it: a matching ref of
/// its repository, else its repository, else every pipeline.
#[derive(Args, Debug, Clone, Default)]
pub struct SecretScopeArgs {
    /// Only jobs from this repository (owner/name).
    #[arg(long = "repo")]
    pub repository: Option<String>,
    /// Only jobs of --repo whose git ref matches: refs/heads/main, refs/tags/v* (`*` matches anything).
    #[arg(long = "ref", requires = "repository")]
    pub ref_pattern: Option<String>,
    /// Only steps of --repo that declare this deployment environment (`environment:`); with
    /// --ref, only on matching refs.
    #[arg(long, requires = "repository")]
    pub environment: Option<String>,
    /// The value approved pull requests from forks of --repo get (the approval policy; by
    /// default forks get no secrets, approved or not). Nothing else gets this value.
    #[arg(long, requires = "repository", conflicts_with_all = ["ref_pattern", "environment"])]
    pub approved_forks: bool,
}

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Minimum NVIDIA driver version.
    #[arg(long, default_value = "525")]
    pub min_driver: String,
    /// Minimum CUDA driver version.
    #[arg(long)]
    pub min_cuda: Option<String>,
    /// Minimum compute capability, e.g. 7.0.
    #[arg(long)]
    pub min_compute_capability: Option<String>,
    /// Extra probe, NAME=COMMAND (repeatable), e.g. torch='python3 -c "import torch; assert torch.cuda.is_available()"'.
    #[arg(long = "probe", value_parser = parse_tag)]
    pub probes: Vec<(String, String)>,
    /// Check a simulated inventory instead of the real one.
    #[arg(long)]
    pub simulate_gpus: Option<String>,
    /// The Actions runner install that GitHub runner pools use on this host (their
    /// `install_dir`): checked to be there and usable by the unprivileged uids jobs run as.
    /// Default: /opt/actions-runner when it exists.
    #[arg(long, env = "GPUCI_RUNNER_INSTALL_DIR")]
    pub runner_dir: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// The server config file with the `[[fleet]]`s (and their `[fleet.simulate]` tables).
    #[arg(long)]
    pub config: PathBuf,
    /// CSV with a header: job_id, submit_s, duration_s, pool, gpus, group, cancel_in_progress.
    #[arg(long, required_unless_present = "from_store", conflicts_with = "from_store")]
    pub trace: Option<PathBuf>,
    /// Replay the coordinator's own job history instead of a trace: its SQLite file (copied,
    /// never written) or its postgres:// URL. Jobs that started in the last --days days.
    #[arg(long, value_name = "DATABASE")]
    pub from_store: Option<String>,
    /// With --from-store: how many days of history.
    #[arg(long, default_value_t = 14, requires = "from_store")]
    pub days: u32,
    /// Seed of the simulated boot times, interruptions and capacity errors.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Only this policy (repeatable): gpuci, always-on, fixed-idle-5m, best-fixed-idle,
    /// best-fixed-stop. Default: all five.
    #[arg(long = "policy", value_parser = parse_policy)]
    pub policies: Vec<gpuci_simulate::Policy>,
    /// The figures as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

fn parse_policy(s: &str) -> Result<gpuci_simulate::Policy, String> {
    gpuci_simulate::Policy::parse(s)
        .ok_or_else(|| format!("{s:?}: expected gpuci, always-on, fixed-idle-5m, best-fixed-idle or best-fixed-stop"))
}

#[derive(Args, Debug)]
pub struct ValidateArgs {
    pub files: Vec<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Submit → process-start latency and throughput of trivial jobs on a warm local agent.
    Dispatch {
        #[arg(long, default_value_t = 1000)]
        jobs: u32,
        /// Jobs in flight at once for the throughput phase.
        #[arg(long, default_value_t = 8)]
        slots: u32,
        #[arg(long, value_enum, default_value_t = IsolationArg::Auto)]
        isolation: IsolationArg,
        /// Each slot's disk (the job's disk quota), as `gpuci agent --job-disk`; `none` to
        /// measure without.
        #[arg(long, default_value = "20GiB", value_parser = parse_job_disk)]
        job_disk: u64,
    },
    /// The dashboard's server time with many jobs in the store: runs `jobs` trivial jobs (100
    /// per pipeline, 10 repositories), then times each main page and `/metrics`.
    Dashboard {
        #[arg(long, default_value_t = 10_000)]
        jobs: u32,
        /// Timed requests per page.
        #[arg(long, default_value_t = 50)]
        requests: u32,
        #[arg(long, value_enum, default_value_t = IsolationArg::Auto)]
        isolation: IsolationArg,
    },
    /// The path a user waits on: a separate `gpuci submit --wait` process (pipeline file in a
    /// small git work tree, a file changed each round, uploaded) to the step's first instruction, interleaved with the
    /// in-process submit → process start and a bare bubblewrap start (the floor), so all three
    /// see the same machine load.
    Client {
        #[arg(long, default_value_t = 200)]
        jobs: u32,
        #[arg(long, value_enum, default_value_t = IsolationArg::Auto)]
        isolation: IsolationArg,
        /// As for `dispatch`.
        #[arg(long, default_value = "20GiB", value_parser = parse_job_disk)]
        job_disk: u64,
    },
    /// The sandbox alone (root, bubblewrap): a job's start from a warm start and from cold,
    /// each `true` to its exit, interleaved with a bare bwrap with the same namespaces and
    /// seccomp filter (the floor), after an idle gap each, as jobs arrive on a real agent.
    Sandbox {
        #[arg(long, default_value_t = 200)]
        runs: u32,
        /// The idle time before each start.
        #[arg(long, default_value = "50ms", value_parser = parse_duration)]
        gap: std::time::Duration,
    },
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsolationArg {
    /// Bubblewrap when installed, else none.
    Auto,
    Bubblewrap,
    None,
}

impl From<IsolationArg> for gpuci_agent::IsolationPolicy {
    fn from(a: IsolationArg) -> Self {
        match a {
            IsolationArg::Auto => gpuci_agent::IsolationPolicy::Auto,
            IsolationArg::Bubblewrap => gpuci_agent::IsolationPolicy::Bubblewrap,
            IsolationArg::None => gpuci_agent::IsolationPolicy::None,
        }
    }
}

pub fn parse_tag(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// `--gpus`: GPUs by UUID or index, comma-separated, or `none`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuShare(pub Vec<gpuci_gpu::GpuRef>);

pub fn parse_gpu_share(s: &str) -> Result<GpuShare, String> {
    if s.trim() == "none" {
        return Ok(GpuShare(Vec::new()));
    }
    let refs = s.split(',').map(gpuci_gpu::GpuRef::parse).collect::<Result<Vec<_>, _>>()?;
    let mut seen = std::collections::BTreeSet::new();
    if let Some(twice) = refs.iter().find(|r| !seen.insert(*r)) {
        return Err(format!("{twice:?} is named twice"));
    }
    Ok(GpuShare(refs))
}

pub fn parse_bytes(s: &str) -> Result<u64, String> {
    s.parse::<gpuci_core::quantity::Bytes>().map(|b| b.0).map_err(|e| e.to_string())
}

pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    s.parse::<gpuci_core::Duration>().map(|d| d.as_std()).map_err(|e| e.to_string())
}

/// `$XDG_DATA_HOME/<name>` or `~/.local/share/<name>`.
pub fn default_data_dir(name: &str) -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join(name);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".local/share").join(name)
}
