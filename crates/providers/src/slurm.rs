//! The `slurm` provider: a machine is a Slurm batch job that runs `gpuci agent --allocation
//! slurm` on whatever node Slurm picks, with the GPUs Slurm grants it (docs/providers/slurm.md).
//! gpuci asks; Slurm decides where, when and which GPUs. Nothing here manages a cluster.
//!
//! - `create` is `sbatch` (script on stdin, `--parsable`), with the fleet's partition,
//!   account, QOS, constraint, time limit and `--gres=gpu:N` (or `--gpus=N`). The job is named
//!   `gpuci.<fleet>` and its comment is `gpuci:<coordinator>:<fleet>:<machine>`: that is how it
//!   is found again ([`Provider::list`], after a coordinator restart too). Idempotent by
//!   machine id: a live job with the machine's comment is answered instead of a second one.
//! - `list` is `squeue --me -t all --name gpuci.<fleet>`: pending jobs carry Slurm's reason
//!   ("Resources", "QOSMaxGRESPerUser") into [`ProviderMachine::note`], ended ones their final
//!   state (a time limit, a cancel) — finished jobs stay listed for Slurm's `MinJobAge`, and a
//!   machine no longer listed has ended anyway.
//! - `delete` is `scancel` of the machine's job.
//!
//! The registration token reaches the job through `sbatch`'s environment (exported to the job,
//! seen by its owner and Slurm's administrators), never its command line or script. `sbatch`
//! and the others run with a clean environment: the coordinator's own settings and
//! credentials are not the agent's.

use crate::{CreateRequest, ErrorKind, Provider, ProviderError, ProviderMachine, ProviderResult, ProviderState};
use async_trait::async_trait;
use gpuci_core::fleet::{Capacity, FleetSpec};
use std::path::PathBuf;
use std::time::Duration;

/// Most bytes of a command's output read.
const MAX_OUTPUT: u64 = 8 << 20;

#[derive(Debug)]
pub struct SlurmProvider {
    coordinator: String,
    fleet: String,
    /// `gpuci.<fleet>`: the job name of every machine of this fleet.
    job_name: String,
    /// Where sbatch, squeue and scancel are; empty: `PATH`.
    bin_dir: Option<PathBuf>,
    /// `SLURM_CONF` for the commands (and, through sbatch, the agent).
    slurm_conf: Option<PathBuf>,
    /// Everything of `sbatch` but the names gpuci owns (job name, comment, output, export).
    sbatch_args: Vec<String>,
    /// Where each job's output goes, `%j` being its id.
    output: String,
    /// Where agents keep their data on the node: `<agent_data_dir>/<machine>`.
    agent_data_dir: String,
    timeout: Duration,
    /// Never repeated in an error or log line.
    secrets: Vec<String>,
    /// The fleet's (one) offer, so an adopted allocation is billed at its price.
    instance_type: String,
    /// GPUs a machine asks for: the agent checks that its grant has that many.
    machine_gpus: u32,
}

fn setting_str(fleet: &FleetSpec, key: &str) -> Result<Option<String>, String> {
    match fleet.settings.get(key) {
        None => Ok(None),
        Some(toml::Value::String(s)) if !s.trim().is_empty() => Ok(Some(s.trim().to_string())),
        Some(v) => Err(format!("fleet {}: [fleet.settings] {key}: expected a non-empty string, got {v}", fleet.name)),
    }
}

/// Settings this provider reads; any other is refused (a typo would silently change nothing).
const KNOWN: &[&str] = &[
    "server",
    "agent_program",
    "agent_args",
    "leave_after_unreachable",
    "on_leave",
    "partition",
    "account",
    "qos",
    "constraint",
    "gpu_type",
    "gpu_request",
    "request_cpus_and_memory",
    "sbatch_args",
    "slurm_conf",
    "bin_dir",
    "output",
    "agent_data_dir",
    "command_timeout",
];

/// `sbatch` options gpuci sets itself; given in `sbatch_args` they would break listing, the
/// token's delivery or the GPU request.
const OWN_OPTIONS: &[&str] = &[
    "--job-name",
    "-J",
    "--comment",
    "--output",
    "-o",
    "--error",
    "-e",
    "--export",
    "--parsable",
    "--wrap",
    "--gres",
    "--gpus",
    "-G",
    "--array",
    "-a",
    "--time",
    "-t",
    // More GPUs than machine.gpus, where the agent would serve them all.
    "--gpus-per-node",
    "--gpus-per-task",
    "--gpus-per-socket",
    "--tres-per-task",
    // gpuci queues a machine's jobs again itself; Slurm re-running the batch job would start
    // the machine's agent again with its registration token spent.
    "--requeue",
    "--no-requeue",
    // Another user's job, or a job listing cannot find: it could not be cancelled.
    "--uid",
    "--gid",
    "--nodes",
    "-N",
    "--export-file",
    "--get-user-env",
    "--chdir",
    "-D",
];

/// Whether `word` (one of `sbatch_args`) sets an option gpuci owns, also abbreviated: sbatch
/// takes any unambiguous prefix of a long option (`--comm=x` is `--comment=x`).
fn owned_option(word: &str) -> bool {
    let name = word.split('=').next().unwrap_or("");
    if let Some(long) = name.strip_prefix("--") {
        return !long.is_empty()
            && OWN_OPTIONS.iter().filter_map(|o| o.strip_prefix("--")).any(|o| o.starts_with(long));
    }
    // Short options, alone (`-J`) or with their value glued on (`-Jname`).
    OWN_OPTIONS.iter().filter(|o| o.len() == 2).any(|o| name.starts_with(o))
}

impl SlurmProvider {
    pub fn from_settings(fleet: &FleetSpec, coordinator: &str) -> Result<Self, String> {
        let bad = |what: String| format!("fleet {}: [fleet.settings] {what}", fleet.name);
        for key in fleet.settings.keys() {
            if !KNOWN.contains(&key.as_str()) {
                return Err(bad(format!("{key}: not a setting of the slurm provider (see docs/providers/slurm.md)")));
            }
        }
        if fleet.capacity != gpuci_core::fleet::CapacityPolicy::OnDemand {
            return Err(bad("capacity: a slurm fleet's machines are Slurm jobs; leave capacity out".into()));
        }
        if fleet.idle_action == gpuci_core::fleet::IdleAction::Stop {
            return Err(bad("idle_action = \"stop\": a Slurm job cannot be stopped and started; use delete".into()));
        }
        let m = &fleet.machine;
        // One node: the agent serves the GPUs of the node it runs on, so they must all be there.
        let mut args: Vec<String> = vec!["--nodes=1".to_string()];
        for (key, flag) in [("partition", "--partition"), ("account", "--account"), ("qos", "--qos")] {
            if let Some(v) = setting_str(fleet, key)? {
                args.push(format!("{flag}={v}"));
            }
        }
        if let Some(c) = setting_str(fleet, "constraint")? {
            args.push(format!("--constraint={c}"));
        }
        let gpu_type = setting_str(fleet, "gpu_type")?;
        if let Some(t) = &gpu_type {
            if !t.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.')) {
                return Err(bad(format!("gpu_type: {t:?} is not a GRES type name (e.g. a100)")));
            }
        }
        if m.gpus > 0 {
            let what = match &gpu_type {
                Some(t) => format!("{t}:{}", m.gpus),
                None => m.gpus.to_string(),
            };
            match setting_str(fleet, "gpu_request")?.as_deref() {
                None | Some("gres") => args.push(format!("--gres=gpu:{what}")),
                Some("gpus") => args.push(format!("--gpus={what}")),
                Some(other) => return Err(bad(format!("gpu_request: {other:?}: expected \"gres\" or \"gpus\""))),
            }
        }
        let with_resources = match fleet.settings.get("request_cpus_and_memory") {
            None => true,
            Some(toml::Value::Boolean(b)) => *b,
            Some(v) => return Err(bad(format!("request_cpus_and_memory: expected true or false, got {v}"))),
        };
        if with_resources {
            args.push(format!("--cpus-per-task={}", m.cpus.max(1)));
            args.push(format!("--mem={}M", (m.memory.0 >> 20).max(1)));
        }
        if let Some(t) = m.time_limit_s {
            // Minutes, rounded down: the allocation must not outlive what placement assumed.
            args.push(format!("--time={}", (t / 60).max(1)));
        }
        if let Some(extra) = fleet.settings.get("sbatch_args") {
            let words = extra
                .as_array()
                .and_then(|a| a.iter().map(|w| w.as_str().map(String::from)).collect::<Option<Vec<_>>>())
                .ok_or_else(|| bad("sbatch_args: expected a list of strings, e.g. [\"--exclusive\"]".into()))?;
            for w in &words {
                if owned_option(w) {
                    return Err(bad(format!(
                        "sbatch_args: {w:?}: gpuci sets this itself (job name, comment, output, environment, GPUs, time from machine.time_limit)"
                    )));
                }
            }
            args.extend(words);
        }
        let timeout = match setting_str(fleet, "command_timeout")? {
            None => Duration::from_secs(60),
            Some(t) => t
                .parse::<gpuci_core::duration::Duration>()
                .map(|d| d.as_std())
                .map_err(|e| bad(format!("command_timeout: {e}")))?,
        };
        if timeout < Duration::from_secs(1) {
            return Err(bad("command_timeout: give at least 1s".into()));
        }
        for key in ["server", "agent_program", "leave_after_unreachable", "on_leave"] {
            setting_str(fleet, key)?;
        }
        if let Some(args) = fleet.settings.get("agent_args") {
            let args = args
                .as_array()
                .filter(|a| a.iter().all(|w| w.is_str()))
                .ok_or_else(|| bad("agent_args: expected a list of strings, e.g. [\"--slots\", \"1\"]".into()))?;
            for w in args.iter().filter_map(|w| w.as_str()) {
                let name = w.split('=').next().unwrap_or("");
                if matches!(name, "--gpus" | "--data-dir" | "--allocation" | "--ends-in") {
                    return Err(bad(format!(
                        "agent_args: {w:?}: the slurm provider gives the agent its GPUs (Slurm's grant) and data dir"
                    )));
                }
            }
        }
        Ok(SlurmProvider {
            coordinator: coordinator.to_string(),
            fleet: fleet.name.clone(),
            job_name: format!("gpuci.{}", fleet.name),
            bin_dir: setting_str(fleet, "bin_dir")?.map(PathBuf::from),
            slurm_conf: setting_str(fleet, "slurm_conf")?.map(PathBuf::from),
            sbatch_args: args,
            output: setting_str(fleet, "output")?.unwrap_or_else(|| "/tmp/gpuci-slurm-%j.out".into()),
            agent_data_dir: setting_str(fleet, "agent_data_dir")?.unwrap_or_else(|| "${TMPDIR:-/tmp}".into()),
            timeout,
            secrets: Vec::new(),
            instance_type: fleet.offers.first().map(|o| o.instance_type.clone()).unwrap_or_default(),
            machine_gpus: m.gpus,
        })
    }

    /// Never show `secret` (the coordinator's registration token) in what Slurm says back.
    pub fn with_secret(mut self, secret: &str) -> Self {
        if !secret.is_empty() {
            self.secrets.push(secret.to_string());
        }
        self
    }

    fn comment(&self, machine: &str) -> String {
        format!("gpuci:{}:{}:{machine}", self.coordinator, self.fleet)
    }

    fn redact(&self, text: &str) -> String {
        let text = self.secrets.iter().fold(text.to_string(), |t, s| t.replace(s.as_str(), "[registration token]"));
        crate::redact_machine_tokens(&text)
    }

    /// Run a Slurm command with a clean environment (plus `env`), `stdin` as its input.
    async fn run(
        &self,
        program: &str,
        args: &[String],
        env: &[(&str, &str)],
        stdin: Option<&str>,
    ) -> ProviderResult<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let path = match &self.bin_dir {
            Some(d) => d.join(program),
            None => PathBuf::from(program),
        };
        let mut cmd = tokio::process::Command::new(&path);
        cmd.args(args).env_clear();
        for k in ["PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ"] {
            if let Some(v) = std::env::var_os(k) {
                cmd.env(k, v);
            }
        }
        match &self.slurm_conf {
            Some(c) => {
                cmd.env("SLURM_CONF", c);
            }
            None => {
                if let Some(c) = std::env::var_os("SLURM_CONF") {
                    cmd.env("SLURM_CONF", c);
                }
            }
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        // The job's output file is made with the submitter's umask (sbatch passes it on):
        // the agent's log is nobody else's to read.
        #[allow(unsafe_code)]
        // SAFETY: umask(2) is async-signal-safe and touches no memory of this process.
        unsafe {
            cmd.pre_exec(|| {
                libc::umask(0o077);
                Ok(())
            });
        }
        cmd.stdin(if stdin.is_some() { std::process::Stdio::piped() } else { std::process::Stdio::null() })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| {
            ProviderError::new(
                ErrorKind::Invalid,
                format!("cannot run {}: {e} (set bin_dir to where Slurm's commands are)", path.display()),
            )
        })?;
        let input = stdin.map(str::to_string);
        let mut w = child.stdin.take();
        let (out, err) = (child.stdout.take(), child.stderr.take());
        let work = async {
            if let (Some(w), Some(text)) = (w.as_mut(), input) {
                let _ = w.write_all(text.as_bytes()).await;
            }
            drop(w.take());
            let (mut o, mut e) = (Vec::new(), Vec::new());
            let ro = async {
                if let Some(out) = out {
                    let _ = out.take(MAX_OUTPUT).read_to_end(&mut o).await;
                }
            };
            let re = async {
                if let Some(err) = err {
                    let _ = err.take(MAX_OUTPUT).read_to_end(&mut e).await;
                }
            };
            tokio::join!(ro, re);
            (child.wait().await, o, e)
        };
        let (status, out, err) = tokio::time::timeout(self.timeout, work).await.map_err(|_| {
            ProviderError::new(
                ErrorKind::Transient,
                format!("{program}: no answer within {:?} (is slurmctld up?)", self.timeout),
            )
        })?;
        let status = status.map_err(|e| ProviderError::new(ErrorKind::Transient, format!("{program}: {e}")))?;
        let err = self.redact(String::from_utf8_lossy(&err).trim());
        if !status.success() {
            let err = gpuci_core::text::escape(&err).to_string();
            return Err(ProviderError::new(classify(&err), format!("{program} failed ({status}): {err}")));
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    async fn jobs(&self) -> ProviderResult<Vec<Job>> {
        let args: Vec<String> =
            ["--me", "--noheader", "--states=all", &format!("--name={}", self.job_name), "--format=%i|%T|%r|%k"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        let out = self.run("squeue", &args, &[], None).await?;
        Ok(parse_squeue(&out))
    }

    /// The machine's job: the live one if any, else the last one listed.
    async fn job_of(&self, machine: &str) -> ProviderResult<Option<Job>> {
        let comment = self.comment(machine);
        let mut mine: Vec<Job> = self.jobs().await?.into_iter().filter(|j| j.comment == comment).collect();
        mine.sort_by_key(|j| (j.state() != ProviderState::Terminated, j.id.parse::<u64>().unwrap_or(0)));
        Ok(mine.pop())
    }

    fn listed(&self, j: &Job) -> Option<ProviderMachine> {
        let prefix = format!("gpuci:{}:{}:", self.coordinator, self.fleet);
        let machine = j.comment.strip_prefix(&prefix)?.to_string();
        Some(ProviderMachine {
            machine,
            provider_id: j.id.clone(),
            state: j.state(),
            instance_type: self.instance_type.clone(),
            zone: String::new(),
            capacity: Capacity::OnDemand,
            launched_at: None,
            note: j.note(),
        })
    }

    /// The batch script: the agent, with its GPUs and end from Slurm (`--allocation slurm`).
    /// The token is in the environment, not here.
    fn script(&self, req: &CreateRequest) -> String {
        let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
        let mut words: Vec<String> = req.agent.command().iter().map(|w| quote(w)).collect();
        words.extend(["'--allocation'".into(), "'slurm'".into()]);
        words.extend(["'--expect-gpus'".into(), format!("'{}'", self.machine_gpus)]);
        words.push("'--data-dir'".into());
        // The data dir's base may use the node's environment (`${TMPDIR:-/tmp}`): left
        // unquoted, it is the operator's setting, never a machine's or job's text.
        words.push(format!(
            "\"{}\"/{}",
            self.agent_data_dir.replace('"', ""),
            quote(&format!("gpuci-agent-{}", req.machine))
        ));
        // sbatch ran under umask 077 (the job's output file is private); the agent and its
        // sandbox need the usual one.
        format!(
            "#!/bin/sh\n# gpuci agent for fleet {} machine {}\numask 022\nexec {}\n",
            self.fleet,
            req.machine,
            words.join(" ")
        )
    }
}

/// One line of `squeue --format=%i|%T|%r|%k`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Job {
    id: String,
    state: String,
    reason: String,
    comment: String,
}

impl Job {
    fn state(&self) -> ProviderState {
        match self.state.as_str() {
            "PENDING" | "CONFIGURING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" | "RESV_DEL_HOLD" => {
                ProviderState::Pending
            }
            "RUNNING" | "RESIZING" | "SIGNALING" | "STAGE_OUT" => ProviderState::Running,
            // Suspended by Slurm is not stopped by gpuci (which could start it again): held.
            "COMPLETING" | "SUSPENDED" | "STOPPED" => ProviderState::Stopping,
            // COMPLETED, CANCELLED, FAILED, TIMEOUT, NODE_FAIL, PREEMPTED, BOOT_FAIL,
            // DEADLINE, OUT_OF_MEMORY, REVOKED, SPECIAL_EXIT and whatever comes next.
            _ => ProviderState::Terminated,
        }
    }

    /// For people: why it waits, or how it ended.
    fn note(&self) -> Option<String> {
        match self.state() {
            ProviderState::Pending => Some(match pending_meaning(&self.reason) {
                Some(m) => format!("Slurm job {} pending: {} ({m})", self.id, self.reason),
                None => format!("Slurm job {} pending: {}", self.id, self.reason),
            }),
            ProviderState::Stopping if self.state != "COMPLETING" => Some(format!(
                "Slurm job {} {} (its processes are stopped; its jobs end lost unless resumed within lost_after)",
                self.id, self.state
            )),
            ProviderState::Terminated => Some(format!(
                "Slurm job {} {}{}",
                self.id,
                self.state,
                match self.state.as_str() {
                    "TIMEOUT" => " (its time limit)".to_string(),
                    "CANCELLED" => " (scancel, or its allocation was revoked)".to_string(),
                    "NODE_FAIL" => " (its node failed)".to_string(),
                    "PREEMPTED" => " (preempted by a higher-priority job)".to_string(),
                    _ if self.reason != "None" && !self.reason.is_empty() => format!(" ({})", self.reason),
                    _ => String::new(),
                }
            )),
            _ => None,
        }
    }
}

/// What the pending reasons people meet most often mean.
fn pending_meaning(reason: &str) -> Option<&'static str> {
    Some(match reason {
        "Resources" => "the partition has no node with the GPUs free now",
        "Priority" => "jobs of higher priority are ahead of it",
        "QOSMaxGRESPerUser" => "the QOS's limit on GPUs per user is reached",
        "QOSMaxJobsPerUserLimit" | "QOSMaxSubmitJobPerUserLimit" => "the QOS's limit on jobs per user is reached",
        "AssocGrpGRES" | "AssocMaxGRESPerJob" | "AssocGrpGRESMinutes" => "the account's GPU limit is reached",
        "AssocGrpJobsLimit" | "AssocMaxJobsLimit" => "the account's job limit is reached",
        "ReqNodeNotAvail" => "a node it needs is down, drained or reserved",
        "PartitionTimeLimit" => "machine.time_limit is above the partition's MaxTime: it will never start",
        "PartitionNodeLimit" | "BadConstraints" => "no node of the partition can ever satisfy it",
        "PartitionDown" | "PartitionInactive" => "the partition is down",
        "JobHeldUser" | "JobHeldAdmin" => "held: release it with scontrol release",
        "Reservation" | "ReqNodeNotAvail,_Reserved_for_maintenance" => "waiting for a reservation",
        "BeginTime" => "not to start before its begin time",
        "Dependency" => "waiting for another job",
        "launch_failed_requeued_held" => "its launch failed and Slurm held it",
        _ => return None,
    })
}

fn parse_squeue(out: &str) -> Vec<Job> {
    out.lines()
        .filter_map(|l| {
            let mut f = l.trim().splitn(4, '|');
            let id = f.next()?.trim().to_string();
            if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
                return None;
            }
            Some(Job {
                id,
                state: f.next()?.trim().to_string(),
                reason: f.next()?.trim().to_string(),
                comment: f.next().unwrap_or("").trim().to_string(),
            })
        })
        .collect()
}

/// What kind of failure Slurm's words describe.
fn classify(err: &str) -> ErrorKind {
    let has = |s: &str| err.contains(s);
    if has("Invalid partition")
        || has("Invalid account")
        || has("Invalid qos")
        || has("Invalid generic resource")
        || has("Requested node configuration is not available")
        || has("Invalid feature specification")
        || has("Requested time limit is invalid")
        || has("invalid option")
        || has("unrecognized option")
        || has("No such file or directory")
    {
        ErrorKind::Invalid
    } else if has("MaxSubmitJob") || has("Job violates accounting/QOS policy") || has("AssocMaxSubmitJobLimit") {
        ErrorKind::Quota
    } else if has("Invalid job id") {
        ErrorKind::NotFound
    } else {
        ErrorKind::Transient
    }
}

#[async_trait]
impl Provider for SlurmProvider {
    fn can_stop(&self) -> bool {
        false
    }

    async fn create(&self, req: &CreateRequest) -> ProviderResult<ProviderMachine> {
        if let Some(j) = self.job_of(&req.machine).await? {
            if j.state() != ProviderState::Terminated {
                return self.listed(&j).ok_or_else(|| ProviderError::new(ErrorKind::Invalid, "unreadable job comment"));
            }
        }
        let mut args = vec![
            "--parsable".to_string(),
            format!("--job-name={}", self.job_name),
            format!("--comment={}", self.comment(&req.machine)),
            format!("--output={}", self.output),
            "--export=ALL".to_string(),
            "--no-requeue".to_string(),
        ];
        args.extend(self.sbatch_args.iter().cloned());
        let script = self.script(req);
        let token = req.agent.registration_token.as_str();
        let mut env = vec![("GPUCI_REGISTRATION_TOKEN", token)];
        if let Some(k) = &req.agent.coordinator_key {
            env.push(("GPUCI_COORDINATOR_KEY", k.as_str()));
        }
        let out = self
            .run("sbatch", &args, &env, Some(&script))
            .await
            .map_err(|e| ProviderError::new(e.kind, self.redact(&e.message)))?;
        let id = out.trim().split(';').next().unwrap_or("").trim().to_string();
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ProviderError::new(
                ErrorKind::Transient,
                format!("sbatch answered {:?}, not a job id", gpuci_core::text::escape(out.trim())),
            ));
        }
        tracing::info!(fleet = %self.fleet, machine = %req.machine, slurm_job = %id, "submitted");
        Ok(ProviderMachine {
            machine: req.machine.clone(),
            provider_id: id.clone(),
            state: ProviderState::Pending,
            instance_type: self.instance_type.clone(),
            zone: String::new(),
            capacity: Capacity::OnDemand,
            launched_at: None,
            note: Some(format!("Slurm job {id} submitted")),
        })
    }

    async fn list(&self) -> ProviderResult<Vec<ProviderMachine>> {
        let jobs = self.jobs().await?;
        // One machine per id: a live job wins over an ended one (a resubmission).
        let mut by_machine: std::collections::BTreeMap<String, ProviderMachine> = Default::default();
        for j in &jobs {
            if let Some(m) = self.listed(j) {
                let replace = match by_machine.get(&m.machine) {
                    None => true,
                    Some(old) => old.state == ProviderState::Terminated && m.state != ProviderState::Terminated,
                };
                if replace {
                    by_machine.insert(m.machine.clone(), m);
                }
            }
        }
        Ok(by_machine.into_values().collect())
    }

    async fn delete(&self, machine: &str) -> ProviderResult<()> {
        let Some(j) = self.job_of(machine).await? else { return Ok(()) };
        if j.state() == ProviderState::Terminated {
            return Ok(());
        }
        match self.run("scancel", std::slice::from_ref(&j.id), &[], None).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn stop(&self, _machine: &str) -> ProviderResult<ProviderMachine> {
        Err(ProviderError::new(ErrorKind::Invalid, "a Slurm job cannot be stopped"))
    }

    async fn start(&self, _machine: &str) -> ProviderResult<ProviderMachine> {
        Err(ProviderError::new(ErrorKind::Invalid, "a Slurm job cannot be started again"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(settings: &str, time_limit: Option<u64>) -> FleetSpec {
        let mut f = gpuci_core::fleet::parse_fleets(
            "server.toml",
            &format!(
                r#"
[[fleet]]
name = "hpc"
provider = "slurm"
max = 4
[fleet.machine]
gpu_model = "NVIDIA A100-SXM4-80GB"
gpus = 2
gpu_memory = "80GiB"
cpus = 16
memory = "64GiB"
[[fleet.offer]]
instance_type = "a100"
price_per_hour = 2.0
[fleet.settings]
{settings}
"#
            ),
        )
        .unwrap_or_else(|e| panic!("{e}"))
        .remove(0);
        f.machine.time_limit_s = time_limit;
        f
    }

    #[test]
    fn the_fleet_becomes_sbatch_options() {
        let p = SlurmProvider::from_settings(
            &fleet(
                "partition = \"gpu\"\naccount = \"ml\"\nqos = \"ci\"\nconstraint = \"nvlink\"\ngpu_type = \"a100\"",
                Some(4 * 3600),
            ),
            "c1",
        )
        .unwrap();
        assert_eq!(
            p.sbatch_args,
            [
                "--nodes=1",
                "--partition=gpu",
                "--account=ml",
                "--qos=ci",
                "--constraint=nvlink",
                "--gres=gpu:a100:2",
                "--cpus-per-task=16",
                "--mem=65536M",
                "--time=240"
            ]
        );
        let p =
            SlurmProvider::from_settings(&fleet("gpu_request = \"gpus\"\nrequest_cpus_and_memory = false", None), "c1")
                .unwrap();
        assert_eq!(p.sbatch_args, ["--nodes=1", "--gpus=2"]);
        let p =
            SlurmProvider::from_settings(&fleet("sbatch_args = [\"--exclusive\", \"--mail-type=NONE\"]", None), "c1")
                .unwrap();
        assert!(p.sbatch_args.ends_with(&["--exclusive".to_string(), "--mail-type=NONE".to_string()]));
    }

    #[test]
    fn settings_that_would_break_listing_or_the_grant_are_refused() {
        for (s, says) in [
            ("sbatch_args = [\"--job-name=x\"]", "gpuci sets this itself"),
            ("sbatch_args = [\"-Jx\"]", "gpuci sets this itself"),
            ("sbatch_args = [\"--gres=gpu:8\"]", "gpuci sets this itself"),
            ("sbatch_args = [\"--comm=x\"]", "gpuci sets this itself"),
            ("sbatch_args = [\"--gpus-per-n=4\"]", "gpuci sets this itself"),
            ("sbatch_args = [\"--uid=ci\"]", "gpuci sets this itself"),
            ("agent_args = \"--gpus all\"", "expected a list of strings"),
            ("agent_args = [\"--ends-in=100h\"]", "gives the agent its GPUs"),
            ("agent_args = [\"--gpus\", \"0\"]", "gives the agent its GPUs"),
            ("partiton = \"gpu\"", "not a setting of the slurm provider"),
            ("gpu_request = \"cards\"", "expected \"gres\" or \"gpus\""),
            ("gpu_type = \"a100;rm\"", "not a GRES type name"),
        ] {
            let e = SlurmProvider::from_settings(&fleet(s, None), "c1").unwrap_err();
            assert!(e.contains(says), "{s}: {e}");
        }
    }

    #[test]
    fn squeue_lines_become_machines_with_slurms_words() {
        let p = SlurmProvider::from_settings(&fleet("", None), "c1").unwrap();
        let jobs = parse_squeue(
            "12|PENDING|Resources|gpuci:c1:hpc:m-1\n13|RUNNING|None|gpuci:c1:hpc:m-2\n14|TIMEOUT|TimeLimit|gpuci:c1:hpc:m-3\n\
             15|RUNNING|None|gpuci:c2:hpc:m-9\n16|PENDING|QOSMaxGRESPerUser|(null)\ngarbage\n",
        );
        let listed: Vec<ProviderMachine> = jobs.iter().filter_map(|j| p.listed(j)).collect();
        assert_eq!(listed.len(), 3, "another coordinator's job and a stranger's are not ours");
        assert_eq!(listed[0].state, ProviderState::Pending);
        assert_eq!(
            listed[0].note.as_deref(),
            Some("Slurm job 12 pending: Resources (the partition has no node with the GPUs free now)")
        );
        assert_eq!(listed[1].state, ProviderState::Running);
        assert_eq!(listed[1].note, None);
        assert_eq!(listed[2].state, ProviderState::Terminated);
        assert_eq!(listed[2].note.as_deref(), Some("Slurm job 14 TIMEOUT (its time limit)"));
    }

    #[test]
    fn slurms_errors_are_classified() {
        assert_eq!(
            classify("sbatch: error: Batch job submission failed: Invalid partition name specified"),
            ErrorKind::Invalid
        );
        assert_eq!(
            classify("sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission failed: Job violates accounting/QOS policy"),
            ErrorKind::Quota
        );
        assert_eq!(
            classify("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation"),
            ErrorKind::Transient
        );
    }
}
