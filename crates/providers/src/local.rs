//! The `local` provider: a fleet's machines are `gpuci agent` processes on the coordinator's
//! own host (a workstation whose GPUs are handed out one share per machine, `gpuci up`, tests).
//!
//! A machine is a process group: the agent, started in a group of its own, with its own data
//! dir (so a stopped machine started again is the same agent) and its share of the host's
//! GPUs (`gpuci agent --gpus`). What exists is read back from records under the state dir
//! (`<state_dir>/<coordinator>/<fleet>/<machine>.json`) and checked against `/proc`, so a
//! restarted coordinator finds its machines, and an agent that died is listed as terminated.
//! Every call holds an exclusive lock on `<state_dir>/.lock`: two fleets (or coordinators)
//! sharing a state dir never hand out one GPU twice.
//!
//! What it must not do: show a machine more GPUs than its share (a fleet with GPUs must name
//! the host's GPUs to share out, or simulate them), keep the registration token anywhere but
//! in the agent's environment, or signal a process group that is no longer its own.

use crate::{CreateRequest, ErrorKind, Provider, ProviderError, ProviderMachine, ProviderResult, ProviderState};
use async_trait::async_trait;
use gpuci_core::fleet::{Capacity, FleetSpec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long an agent has to end after SIGTERM before its group is killed.
const TERM_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct LocalProvider {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    fleet: String,
    root: PathBuf,
    dir: PathBuf,
    /// The host's GPUs shared out to machines, `machine_gpus` each.
    pool: Vec<String>,
    machine_gpus: u32,
    simulate_gpus: Option<String>,
    /// Paths the agents' jobs must not see (the coordinator's data dir: its database, keys and
    /// tokens), given as `--hide`.
    hide: Vec<PathBuf>,
}

/// The provider's own settings; the common ones (`agent_program`, `agent_args`, …) are the
/// coordinator's and pass through.
#[derive(Deserialize)]
struct Own {
    #[serde(default)]
    state_dir: Option<PathBuf>,
    #[serde(default)]
    gpus: Option<Vec<String>>,
    #[serde(default)]
    simulate_gpus: Option<String>,
}

/// Settings every fleet may have (read by the coordinator).
const COMMON: [&str; 5] = ["server", "agent_program", "agent_args", "leave_after_unreachable", "on_leave"];

/// One machine's record.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    machine: String,
    provider_id: String,
    state: ProviderState,
    instance_type: String,
    zone: String,
    capacity: Capacity,
    launched_at: u64,
    /// The agent's command line, without the registration token (that went to its
    /// environment once, and is spent by its registration).
    command: Vec<String>,
    data_dir: PathBuf,
    log: PathBuf,
    /// The group leader and its start time (`/proc/PID/stat` field 22), so a reused pid is
    /// never taken for the machine.
    pid: Option<i32>,
    pid_start: Option<u64>,
    /// The share of the host's GPUs while it runs (empty when stopped or simulated).
    gpus: Vec<String>,
    /// When it was found terminated.
    #[serde(default)]
    ended_at: Option<u64>,
}

impl Record {
    fn listed(&self) -> ProviderMachine {
        ProviderMachine {
            machine: self.machine.clone(),
            provider_id: self.provider_id.clone(),
            state: self.state,
            instance_type: self.instance_type.clone(),
            zone: self.zone.clone(),
            capacity: self.capacity,
            launched_at: Some(self.launched_at),
            note: None,
        }
    }
}

fn err(kind: ErrorKind, message: impl Into<String>) -> ProviderError {
    ProviderError::new(kind, message)
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> ProviderError {
    err(ErrorKind::Transient, format!("{what} {}: {e}", path.display()))
}

impl LocalProvider {
    /// `default_state_dir`: where machines live unless the settings say `state_dir` (the
    /// coordinator's data dir gives `<data dir>/local-machines`).
    pub fn from_settings(fleet: &FleetSpec, coordinator: &str, default_state_dir: &Path) -> Result<Self, String> {
        let bad = |what: String| format!("fleet {}: [fleet.settings]: {what}", fleet.name);
        let mut own_table = fleet.settings.clone();
        for k in COMMON {
            own_table.remove(k);
        }
        let known = ["state_dir", "gpus", "simulate_gpus"];
        if let Some(k) = own_table.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(bad(format!(
                "unknown setting {k:?} for a local fleet (it takes {}, and {})",
                known.join(", "),
                COMMON.join(", ")
            )));
        }
        let own: Own = own_table.try_into().map_err(|e: toml::de::Error| bad(e.message().to_string()))?;
        let root = own.state_dir.unwrap_or_else(|| default_state_dir.to_path_buf());
        if !root.is_absolute() {
            return Err(bad(format!("state_dir {}: give an absolute path", root.display())));
        }
        let safe = |what: &str, s: &str| {
            if s.is_empty() || s == "." || s == ".." || s.contains(['/', '\0']) {
                Err(bad(format!("{what} {s:?} cannot name a directory")))
            } else {
                Ok(())
            }
        };
        safe("coordinator id", coordinator)?;
        safe("fleet name", &fleet.name)?;
        if let Some(args) = fleet.settings.get("agent_args").and_then(|v| v.as_array()) {
            let own_flags = ["--gpus", "--simulate-gpus", "--data-dir"];
            for a in args.iter().filter_map(|a| a.as_str()) {
                if let Some(f) = own_flags.iter().find(|f| a == **f || a.starts_with(&format!("{f}="))) {
                    return Err(bad(format!(
                        "agent_args: {f} is the local provider's to give (use gpus, simulate_gpus, state_dir)"
                    )));
                }
            }
        }
        let pool: Vec<String> = own.gpus.unwrap_or_default().iter().map(|g| canonical_gpu(g)).collect();
        let mut seen = BTreeSet::new();
        for g in &pool {
            if g.is_empty() || !g.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'/' | b'_')) {
                return Err(bad(format!("gpus: {g:?} is neither a GPU UUID (GPU-…) nor an index")));
            }
            if !seen.insert(g) {
                return Err(bad(format!("gpus: {g} is named twice")));
            }
        }
        // One GPU named two ways (its index and its UUID) cannot be told apart here: the
        // agents' per-GPU locks would catch it, but a pool of one kind cannot have it.
        if pool.iter().any(|g| g.bytes().all(|b| b.is_ascii_digit()))
            && pool.iter().any(|g| !g.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err(bad("gpus: give all UUIDs or all indices, not both (one GPU could be named twice)".into()));
        }
        let need = fleet.machine.gpus;
        match (&own.simulate_gpus, pool.is_empty()) {
            (Some(_), false) => {}
            (Some(spec), true) => {
                let count = simulated_count(spec).map_err(|e| bad(format!("simulate_gpus: {e}")))?;
                if count != need {
                    return Err(bad(format!(
                        "simulate_gpus {spec:?} gives each machine {count} GPUs, but [fleet.machine] says gpus = {need}"
                    )));
                }
            }
            (None, true) if need > 0 => {
                return Err(bad(format!(
                    "its machines have {need} GPU(s) each: say which of this host's GPUs they share out, \
                     gpus = [\"GPU-…\", …] (UUIDs or indices, see nvidia-smi -L), or simulate_gpus = \"{need}xL4\" \
                     (every local agent would otherwise see every GPU of the host)"
                )));
            }
            (None, _) => {}
        }
        if !pool.is_empty() && (pool.len() as u64) < u64::from(need) {
            return Err(bad(format!("gpus names {} GPU(s); one machine needs {need}", pool.len())));
        }
        let dir = root.join(coordinator).join(&fleet.name);
        Ok(LocalProvider {
            inner: Arc::new(Inner {
                fleet: fleet.name.clone(),
                root,
                dir,
                pool,
                machine_gpus: need,
                simulate_gpus: own.simulate_gpus,
                hide: Vec::new(),
            }),
        })
    }

    /// Jobs on this fleet's machines must not see `paths` (the coordinator's data dir).
    pub fn hiding(mut self, paths: Vec<PathBuf>) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.hide = paths;
        }
        self
    }

    /// Run `f` under the state dir's lock, off the async runtime.
    async fn locked<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> ProviderResult<T> + Send + 'static,
    ) -> ProviderResult<T> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let _lock = inner.lock()?;
            f(&inner)
        })
        .await
        .map_err(|e| err(ErrorKind::Transient, format!("local provider task: {e}")))?
    }
}

/// How many GPUs `4xH100-80GB,2xL4` gives.
fn simulated_count(spec: &str) -> Result<u32, String> {
    let mut n = 0u32;
    for part in spec.split(',').map(str::trim) {
        let count = match part.split_once(['x', 'X']) {
            Some((c, _)) if !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit()) => {
                c.parse::<u32>().map_err(|_| format!("count {c:?} is too large"))?
            }
            _ if part.is_empty() => return Err("an empty entry; write e.g. 1xL4".into()),
            _ => 1,
        };
        n = n.checked_add(count).ok_or("too many GPUs")?;
    }
    Ok(n)
}

/// An exclusive flock, released on drop.
struct Lock(std::fs::File);

impl Drop for Lock {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: flock(2) on a descriptor this value owns.
        unsafe {
            libc::flock(self.0.as_raw_fd(), libc::LOCK_UN);
        }
    }
}

impl Inner {
    #[allow(unsafe_code)]
    fn lock(&self) -> ProviderResult<Lock> {
        use std::os::fd::AsRawFd;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|e| io_err("cannot create", &self.dir, e))?;
        // The records say what to run and which process groups to signal: only a state dir
        // no one else can write may be read.
        for d in [&self.root, &self.dir.parent().unwrap_or(&self.root).to_path_buf(), &self.dir] {
            private_dir(d)?;
        }
        let path = self.root.join(".lock");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| io_err("cannot open", &path, e))?;
        // SAFETY: flock(2) on a descriptor we own; blocks this (blocking-pool) thread only.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        if rc != 0 {
            return Err(io_err("cannot lock", &path, std::io::Error::last_os_error()));
        }
        Ok(Lock(f))
    }

    fn record_path(&self, machine: &str) -> PathBuf {
        self.dir.join(format!("{machine}.json"))
    }

    fn machine_dir(&self, machine: &str) -> PathBuf {
        self.dir.join(machine)
    }

    fn read(&self, machine: &str) -> ProviderResult<Option<Record>> {
        if machine.is_empty() || machine.contains(['/', '\0']) || machine.starts_with('.') {
            return Err(err(ErrorKind::Invalid, format!("machine id {machine:?} cannot name a file")));
        }
        let path = self.record_path(machine);
        let bytes =
            std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path).and_then(|mut f| {
                let mut b = Vec::new();
                std::io::Read::read_to_end(&mut f, &mut b).map(|_| b)
            });
        match bytes {
            Ok(b) => {
                let mut r: Record = serde_json::from_slice(&b)
                    .map_err(|e| err(ErrorKind::Transient, format!("machine record {}: {e}", path.display())))?;
                if r.machine != machine {
                    return Err(err(
                        ErrorKind::Transient,
                        format!("machine record {} names another machine; not used", path.display()),
                    ));
                }
                // Where its files are follows from the machine id, whatever the record says.
                r.data_dir = self.machine_dir(machine).join("agent");
                r.log = self.dir.join(format!("{machine}.log"));
                Ok(Some(r))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("cannot read", &path, e)),
        }
    }

    fn write(&self, r: &Record) -> ProviderResult<()> {
        let path = self.record_path(&r.machine);
        let tmp = path.with_extension("json.tmp");
        let body = serde_json::to_vec_pretty(r).map_err(|e| err(ErrorKind::Transient, e.to_string()))?;
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(|e| io_err("cannot write", &tmp, e))?;
        f.write_all(&body).and_then(|()| f.sync_all()).map_err(|e| io_err("cannot write", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io_err("cannot write", &path, e))
    }

    fn remove(&self, machine: &str) {
        let _ = std::fs::remove_file(self.record_path(machine));
        let _ = std::fs::remove_dir_all(self.machine_dir(machine));
    }

    /// Records of every machine of this fleet, refreshed against `/proc`.
    fn all(&self) -> ProviderResult<Vec<Record>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir).map_err(|e| io_err("cannot list", &self.dir, e))?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(machine) = name.strip_suffix(".json") {
                match self.read(machine) {
                    // An ended machine is listed for an hour (so the coordinator sees it end),
                    // then forgotten.
                    Ok(Some(r)) if r.ended_at.is_some_and(|t| t + 3600 < now()) => self.remove(machine),
                    Ok(Some(r)) => out.push(self.refresh(r)?),
                    Ok(None) => {}
                    Err(e) => tracing::warn!(fleet = %self.fleet, error = %e, "skipping an unreadable machine record"),
                }
            }
        }
        out.sort_by(|a, b| a.machine.cmp(&b.machine));
        Ok(out)
    }

    /// A running machine whose agent has ended is terminated (what a cloud says of an
    /// instance that crashed): what its group left is killed and its GPUs are free again.
    fn refresh(&self, mut r: Record) -> ProviderResult<Record> {
        if matches!(r.state, ProviderState::Running | ProviderState::Pending) && !leader_alive(&r) {
            tracing::info!(fleet = %self.fleet, machine = %r.machine, pid = ?r.pid, "the machine's agent has ended: terminated");
            kill_group(&r)?;
            r.state = ProviderState::Terminated;
            r.gpus.clear();
            r.pid = None;
            r.ended_at = Some(now());
            self.write(&r)?;
        }
        Ok(r)
    }

    /// GPUs of the pool held by running machines of any fleet under this state dir.
    fn gpus_in_use(&self) -> BTreeSet<String> {
        let mut used = BTreeSet::new();
        let Ok(coordinators) = std::fs::read_dir(&self.root) else { return used };
        for c in coordinators.flatten().filter(|e| e.path().is_dir()) {
            let Ok(fleets) = std::fs::read_dir(c.path()) else { continue };
            for f in fleets.flatten().filter(|e| e.path().is_dir()) {
                let Ok(files) = std::fs::read_dir(f.path()) else { continue };
                for file in files.flatten() {
                    if file.path().extension().is_none_or(|x| x != "json") {
                        continue;
                    }
                    let Ok(bytes) = std::fs::read(file.path()) else { continue };
                    if let Ok(r) = serde_json::from_slice::<Record>(&bytes) {
                        if matches!(r.state, ProviderState::Running | ProviderState::Pending) && leader_alive(&r) {
                            used.extend(r.gpus.iter().map(|g| canonical_gpu(g)));
                        }
                    }
                }
            }
        }
        used
    }

    /// The machine's share of the pool, or a capacity error when the host has no more.
    fn take_gpus(&self) -> ProviderResult<Vec<String>> {
        if self.pool.is_empty() {
            return Ok(Vec::new());
        }
        let used = self.gpus_in_use();
        let free: Vec<String> = self.pool.iter().filter(|g| !used.contains(&canonical_gpu(g))).cloned().collect();
        if free.len() < self.machine_gpus as usize {
            return Err(err(
                ErrorKind::Capacity,
                format!(
                    "this host has {} of its {} shared GPUs free; a machine needs {}",
                    free.len(),
                    self.pool.len(),
                    self.machine_gpus
                ),
            ));
        }
        Ok(free.into_iter().take(self.machine_gpus as usize).collect())
    }

    /// Start the machine's agent in a process group of its own.
    fn launch(&self, r: &mut Record, token: Option<&str>) -> ProviderResult<()> {
        r.gpus = self.take_gpus()?;
        let mut command = r.command.clone();
        if let Some(spec) = &self.simulate_gpus {
            command.extend(["--simulate-gpus".into(), spec.clone()]);
        }
        for h in &self.hide {
            command.extend(["--hide".into(), h.display().to_string()]);
        }
        if !r.gpus.is_empty() {
            command.extend(["--gpus".into(), r.gpus.join(",")]);
        } else if self.simulate_gpus.is_none() {
            // A machine without GPUs sees none of the host's.
            command.extend(["--gpus".into(), "none".into()]);
        }
        let dir = self.machine_dir(&r.machine);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&r.data_dir)
            .map_err(|e| io_err("cannot create", &r.data_dir, e))?;
        let mut log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&r.log)
            .map_err(|e| io_err("cannot open", &r.log, e))?;
        let _ = writeln!(log, "--- {} gpuci local provider: starting {command:?}", now());
        let mut cmd = std::process::Command::new(&command[0]);
        cmd.args(&command[1..])
            .current_dir(&dir)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().map_err(|e| io_err("cannot open", &r.log, e))?)
            .stderr(log)
            .env_clear()
            .process_group(0);
        // Only what a program needs to run: not the coordinator's settings (GPUCI_*, which an
        // agent would read as its own) nor its credentials (database URL, cloud keys).
        for k in PASSED_ENV {
            if let Some(v) = std::env::var_os(k) {
                cmd.env(k, v);
            }
        }
        if std::env::var_os("PATH").is_none() {
            cmd.env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        }
        if let Some(t) = token {
            cmd.env("GPUCI_REGISTRATION_TOKEN", t);
        }
        let mut child = cmd.spawn().map_err(|e| {
            r.gpus.clear();
            err(ErrorKind::Invalid, format!("cannot start {}: {e}", command[0]))
        })?;
        let pid = i32::try_from(child.id()).map_err(|_| err(ErrorKind::Transient, "pid out of range"))?;
        r.pid = Some(pid);
        r.pid_start = proc_stat(pid).map(|s| s.start);
        r.state = ProviderState::Running;
        r.launched_at = now();
        // Reaped by this thread while this process lives; by init after it has gone.
        std::thread::Builder::new()
            .name(format!("reap-{pid}"))
            .spawn(move || {
                let _ = child.wait();
            })
            .map_err(|e| err(ErrorKind::Transient, format!("cannot start a reaper thread: {e}")))?;
        Ok(())
    }

    fn create(&self, req: &CreateRequest) -> ProviderResult<ProviderMachine> {
        let m = &req.machine;
        if let Some(r) = self.read(m)? {
            let r = self.refresh(r)?;
            if r.state != ProviderState::Terminated {
                return Ok(r.listed());
            }
            // Created again after it ended: a new machine, with a fresh disk.
            self.remove(m);
        }
        let dir = self.machine_dir(m);
        let data_dir = dir.join("agent");
        let mut command = req.agent.command();
        command.extend(["--data-dir".into(), data_dir.display().to_string()]);
        let mut r = Record {
            machine: m.clone(),
            provider_id: format!("local-{}-{m}", std::process::id()),
            state: ProviderState::Pending,
            instance_type: req.offer.instance_type.clone(),
            zone: req.offer.zone.clone(),
            capacity: req.capacity,
            launched_at: now(),
            command,
            data_dir,
            log: self.dir.join(format!("{m}.log")),
            pid: None,
            pid_start: None,
            gpus: Vec::new(),
            ended_at: None,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| io_err("cannot create", &dir, e))?;
        if let Err(e) = self.launch(&mut r, Some(&req.agent.registration_token)) {
            self.remove(m);
            return Err(e);
        }
        if let Err(e) = self.write(&r) {
            // Not recorded, so not findable: it must not run (it holds a token and GPUs).
            let _ = kill_group(&r);
            self.remove(m);
            return Err(e);
        }
        tracing::info!(fleet = %self.fleet, machine = %m, pid = ?r.pid, gpus = ?r.gpus, "local machine started");
        Ok(r.listed())
    }

    fn delete(&self, machine: &str) -> ProviderResult<()> {
        let Some(r) = self.read(machine)? else { return Ok(()) };
        kill_group(&r)?;
        self.remove(machine);
        Ok(())
    }

    fn existing(&self, machine: &str) -> ProviderResult<Record> {
        match self.read(machine)? {
            Some(r) => {
                let r = self.refresh(r)?;
                if r.state == ProviderState::Terminated {
                    Err(err(ErrorKind::NotFound, format!("machine {machine} has ended")))
                } else {
                    Ok(r)
                }
            }
            None => Err(err(ErrorKind::NotFound, format!("no machine {machine}"))),
        }
    }

    fn stop(&self, machine: &str) -> ProviderResult<ProviderMachine> {
        let mut r = self.existing(machine)?;
        if r.state != ProviderState::Stopped {
            kill_group(&r)?;
            r.state = ProviderState::Stopped;
            r.pid = None;
            r.pid_start = None;
            r.gpus.clear();
            self.write(&r)?;
        }
        Ok(r.listed())
    }

    fn start(&self, machine: &str) -> ProviderResult<ProviderMachine> {
        let mut r = self.existing(machine)?;
        if r.state == ProviderState::Stopped {
            // The same command and data dir: the same agent, with the identity it registered.
            self.launch(&mut r, None)?;
            if let Err(e) = self.write(&r) {
                let _ = kill_group(&r);
                return Err(e);
            }
        }
        Ok(r.listed())
    }
}

/// Environment variables a local agent gets from the coordinator's environment.
const PASSED_ENV: [&str; 9] = ["PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR", "RUST_LOG", "XDG_RUNTIME_DIR"];

/// A GPU name as compared: an index without leading zeros (`007` is `7`), a UUID as given.
fn canonical_gpu(g: &str) -> String {
    let g = g.trim();
    if !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()) {
        let t = g.trim_start_matches('0');
        return if t.is_empty() { "0".into() } else { t.into() };
    }
    g.to_string()
}

/// `dir` is a directory (not a link) owned by this process's user and writable by no one
/// else; an error a person can act on otherwise.
fn private_dir(dir: &Path) -> ProviderResult<()> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(dir).map_err(|e| io_err("cannot inspect", dir, e))?;
    // SAFETY: geteuid(2) has no preconditions and touches no memory.
    #[allow(unsafe_code)]
    let me = unsafe { libc::geteuid() };
    if !m.is_dir() || m.uid() != me || m.mode() & 0o022 != 0 {
        return Err(err(
            ErrorKind::Invalid,
            format!(
                "state dir {} must be a directory owned by uid {me} that no one else can write (it is {}uid {}, mode {:o}); machines' records there say what runs",
                dir.display(),
                if m.is_dir() { "" } else { "not a directory, " },
                m.uid(),
                m.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

struct Stat {
    state: char,
    pgrp: i32,
    start: u64,
}

/// State, process group and start time of `pid` from `/proc/PID/stat`.
fn proc_stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces or ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(Stat { state: f.first()?.chars().next()?, pgrp: f.get(2)?.parse().ok()?, start: f.get(19)?.parse().ok()? })
}

/// Whether the machine's group leader runs and is the process that was started.
fn leader_alive(r: &Record) -> bool {
    let Some(pid) = r.pid else { return false };
    match proc_stat(pid) {
        Some(s) if s.state != 'Z' && s.state != 'X' => r.pid_start.is_none_or(|t| t == s.start),
        _ => false,
    }
}

/// Live members of process group `pgid`.
fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else { return Vec::new() };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|&pid| proc_stat(pid).is_some_and(|s| s.pgrp == pgid && s.state != 'Z' && s.state != 'X'))
        .collect()
}

/// Whether the group named by the record is still the one started: its leader is that
/// process, or gone while members remain (a group's id is not reused while it has members).
fn group_is_ours(r: &Record) -> bool {
    let Some(pid) = r.pid else { return false };
    match proc_stat(pid) {
        Some(s) if s.state != 'Z' && s.state != 'X' => r.pid_start.is_none_or(|t| t == s.start) && s.pgrp == pid,
        _ => true,
    }
}

/// SIGTERM the machine's process group, then SIGKILL what is left after [`TERM_GRACE`].
#[allow(unsafe_code)]
fn kill_group(r: &Record) -> ProviderResult<()> {
    let Some(pgid) = r.pid.filter(|p| *p > 1) else { return Ok(()) };
    if !group_is_ours(r) || group_members(pgid).is_empty() {
        return Ok(());
    }
    for (sig, grace) in [(libc::SIGTERM, TERM_GRACE), (libc::SIGKILL, Duration::from_secs(5))] {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory is touched.
        unsafe {
            libc::kill(-pgid, sig);
        }
        let until = Instant::now() + grace;
        while Instant::now() < until {
            if group_members(pgid).is_empty() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Err(err(ErrorKind::Transient, format!("process group {pgid} of machine {} survived SIGKILL", r.machine)))
}

#[async_trait]
impl Provider for LocalProvider {
    fn can_stop(&self) -> bool {
        true
    }

    async fn create(&self, req: &CreateRequest) -> ProviderResult<ProviderMachine> {
        let req = req.clone();
        self.locked(move |i| i.create(&req)).await
    }

    async fn list(&self) -> ProviderResult<Vec<ProviderMachine>> {
        self.locked(|i| Ok(i.all()?.iter().map(Record::listed).collect())).await
    }

    async fn delete(&self, machine: &str) -> ProviderResult<()> {
        let m = machine.to_string();
        self.locked(move |i| i.delete(&m)).await
    }

    async fn stop(&self, machine: &str) -> ProviderResult<ProviderMachine> {
        let m = machine.to_string();
        self.locked(move |i| i.stop(&m)).await
    }

    async fn start(&self, machine: &str) -> ProviderResult<ProviderMachine> {
        let m = machine.to_string();
        self.locked(move |i| i.start(&m)).await
    }
}
