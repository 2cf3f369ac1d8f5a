//! Job cgroups on v1 (one directory per controller) and v2 (one directory).
//!
//! Job cgroups live at `<agent's own cgroup>/gpuci/<job_id>` in each hierarchy, so limits that
//! apply to the agent (a container's memory limit, a systemd slice) keep applying to its jobs.
//! On v2 that needs a delegated subtree (systemd `Delegate=yes`) whose controllers can be enabled
//! for `gpuci/`; when they cannot, asking for a limit fails with a clear error instead of running
//! unlimited.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gpuci_core::pipeline::Resources;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::{CgroupKind, SandboxError};

/// Directory under the agent's own cgroup that holds one cgroup per job.
pub(crate) const GROUP: &str = "gpuci";
const CPU_PERIOD_US: u64 = 100_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Controller {
    Memory,
    Pids,
    Cpu,
    Freezer,
    Devices,
}

impl Controller {
    const ALL: [Controller; 5] = [Self::Memory, Self::Pids, Self::Cpu, Self::Freezer, Self::Devices];
    fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Pids => "pids",
            Self::Cpu => "cpu",
            Self::Freezer => "freezer",
            Self::Devices => "devices",
        }
    }
}

/// Where the job cgroups of this process go: `base` is the agent's own cgroup in a hierarchy.
#[derive(Clone, Debug)]
pub(crate) enum Layout {
    V1 { bases: Vec<(Controller, PathBuf)> },
    V2 { base: PathBuf },
}

impl Layout {
    pub(crate) fn kind(&self) -> CgroupKind {
        match self {
            Self::V1 { .. } => CgroupKind::V1,
            Self::V2 { .. } => CgroupKind::V2,
        }
    }

    /// The directories the agent must be able to write (create `gpuci/` in).
    fn key_dirs(&self) -> Vec<&Path> {
        match self {
            Self::V1 { bases } => bases
                .iter()
                .filter(|(c, _)| matches!(c, Controller::Memory | Controller::Pids))
                .map(|(_, p)| p.as_path())
                .collect(),
            Self::V2 { base } => vec![base.as_path()],
        }
    }

    pub(crate) fn writable(&self) -> bool {
        let dirs = self.key_dirs();
        !dirs.is_empty()
            && dirs.iter().all(|d| {
                let g = d.join(GROUP);
                let probe = if g.is_dir() { g } else { d.to_path_buf() };
                nix::unistd::access(&probe, nix::unistd::AccessFlags::W_OK).is_ok()
            })
    }
}

/// The cgroup layout of this process, detected once from `/proc/self/mounts` and `/proc/self/cgroup`.
pub(crate) fn layout() -> Option<&'static Layout> {
    static LAYOUT: OnceLock<Option<Layout>> = OnceLock::new();
    LAYOUT
        .get_or_init(|| {
            let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
            let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
            detect_layout(&mounts, &own, &|p| p.is_dir(), &|p| fs::read_to_string(p).ok())
        })
        .as_ref()
}

/// Pure part of the detection, testable with fake file contents.
pub(crate) fn detect_layout(
    mounts: &str,
    own_cgroups: &str,
    is_dir: &dyn Fn(&Path) -> bool,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Option<Layout> {
    let mut v1 = Vec::new();
    let mut v2_mount = None;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        let (mnt, fstype, opts) = (Path::new(f[1]), f[2], f[3]);
        if fstype == "cgroup" {
            for c in Controller::ALL {
                if opts.split(',').any(|o| o == c.name()) && !v1.iter().any(|(k, _)| *k == c) {
                    v1.push((c, mnt.to_path_buf()));
                }
            }
        } else if fstype == "cgroup2" && v2_mount.is_none() {
            v2_mount = Some(mnt.to_path_buf());
        }
    }
    // `<id>:<controllers>:<path>` per hierarchy; v2 is `0::<path>`.
    let own_path = |want: Option<&str>| -> String {
        own_cgroups
            .lines()
            .filter_map(|l| {
                let mut it = l.splitn(3, ':');
                let (_, ctrls, path) = (it.next()?, it.next()?, it.next()?);
                let hit = match want {
                    Some(w) => ctrls.split(',').any(|c| c == w),
                    None => ctrls.is_empty(),
                };
                hit.then(|| path.to_string())
            })
            .next()
            .unwrap_or_else(|| "/".to_string())
    };
    let base_of = |mnt: &Path, own: String| {
        let nested = mnt.join(own.trim_start_matches('/'));
        // Inside a cgroup namespace the mount may already be our own cgroup.
        if is_dir(&nested) {
            nested
        } else {
            mnt.to_path_buf()
        }
    };
    if v1.iter().any(|(c, _)| matches!(c, Controller::Memory | Controller::Pids)) {
        let bases = v1.into_iter().map(|(c, mnt)| (c, base_of(&mnt, own_path(Some(c.name()))))).collect();
        return Some(Layout::V1 { bases });
    }
    let mnt = v2_mount?;
    // A hybrid system's `unified` mount has no controllers: not usable for limits.
    let ctrls = read(&mnt.join("cgroup.controllers"))?;
    ctrls.split_whitespace().next()?;
    Some(Layout::V2 { base: base_of(&mnt, own_path(None)) })
}

/// Directory under the agent's own v2 cgroup that the agent's processes move to when that
/// cgroup must hand controllers down to its jobs' (`gpuci/`).
pub(crate) const AGENT_LEAF: &str = "gpuci-agent";

/// Moves every process of `base` into `base/gpuci-agent` (made if missing), so that `base`
/// may enable controllers for its children. Processes that end meanwhile are skipped.
fn move_to_leaf(base: &Path) -> io::Result<()> {
    let leaf = base.join(AGENT_LEAF);
    match fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    // Processes may fork while they are moved: a few rounds until the cgroup is empty.
    for _ in 0..10 {
        let pids = read_pids(&base.join("cgroup.procs"));
        if pids.is_empty() {
            return Ok(());
        }
        for pid in pids {
            match fs::write(leaf.join("cgroup.procs"), pid.to_string()) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Err(io::Error::other("processes kept appearing in the agent's cgroup"))
}

/// One job's cgroup(s).
#[derive(Debug)]
pub(crate) struct JobCgroup {
    job_id: String,
    v2: bool,
    /// v1: one directory per controller; v2: one entry with `Controller::Memory` as a placeholder.
    dirs: Vec<(Controller, PathBuf)>,
    memory_limit: Option<u64>,
}

fn write_file(job_id: &str, path: &Path, value: &str) -> Result<(), SandboxError> {
    fs::write(path, value).map_err(|source| SandboxError::Cgroup {
        job_id: job_id.to_string(),
        op: format!("write {value:?} to"),
        path: path.to_path_buf(),
        source,
    })
}

fn read_counter(path: &Path, key: &str) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next()? == key).then(|| it.next()?.parse().ok())?
    })
}

/// Makes and removes a job cgroup with a memory and a process limit, as a job's would be:
/// `Err` says why jobs that need limits could not start here (controllers not delegated to the
/// agent's cgroup, a cgroup that holds other processes and so cannot hand them down).
pub fn probe() -> Result<String, String> {
    let layout = layout().ok_or("no cgroup filesystem is mounted")?;
    let resources =
        Resources { memory: Some(gpuci_core::quantity::Bytes(256 << 20)), cpu_millis: None, pids: Some(64) };
    // Unique in this process: agents started at once in one process probe at once.
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = format!("probe-c{}-{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let cg = JobCgroup::create(layout, &name, &resources, &[]).map_err(|e| {
        let here = layout.key_dirs().iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ");
        match layout {
            Layout::V2 { .. } => format!(
                "{e} (this process's cgroup is {here}; it must be writable by the agent and able to enable memory \
                 and pids for its children: run the agent in a systemd unit with Delegate=yes, or give its \
                 container a delegated cgroup)"
            ),
            Layout::V1 { .. } => format!(
                "{e} (this process's cgroups are {here}; the agent must be able to make cgroups under them: run it \
                 as root on the host, or give its container a writable cgroup tree)"
            ),
        }
    })?;
    let where_ = cg.dirs.first().map(|(_, d)| d.display().to_string()).unwrap_or_default();
    cg.remove_dirs();
    Ok(format!("a job cgroup with memory and pids limits can be made ({where_})"))
}

/// The limits that bind this process's own cgroup, tightest of it and its ancestors within
/// the mounted hierarchy: in a container, what the runtime set (a pod's `resources.limits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnLimits {
    pub memory: Option<u64>,
    pub pids: Option<u64>,
    /// CPU, in thousandths of a CPU.
    pub cpu_millis: Option<u64>,
}

impl OwnLimits {
    /// In words, e.g. "memory 24 GiB, 6 CPUs, no process limit".
    pub fn describe(&self) -> String {
        let memory =
            self.memory.map_or("no memory limit".to_string(), |m| format!("memory {}", gpuci_core::quantity::Bytes(m)));
        let cpu = self.cpu_millis.map_or("no CPU limit".to_string(), |c| format!("{} CPUs", c as f64 / 1000.0));
        let pids = self.pids.map_or("no process limit".to_string(), |p| format!("{p} processes"));
        format!("{memory}, {cpu}, {pids}")
    }
}

/// A limit file's value: `max` (v2) and v1's "unlimited" (a page-rounded `i64::MAX`) are none.
pub(crate) fn parse_limit(text: &str) -> Option<u64> {
    let t = text.trim();
    let v: u64 = t.parse().ok()?;
    (v < (1 << 62)).then_some(v)
}

/// `cpu.max` ("QUOTA PERIOD" or "max PERIOD") in thousandths of a CPU.
pub(crate) fn parse_cpu_max(text: &str) -> Option<u64> {
    let mut it = text.split_whitespace();
    let quota: u64 = it.next()?.parse().ok()?;
    let period: u64 = it.next()?.parse().ok()?;
    (period > 0).then(|| quota * 1000 / period)
}

/// The limits on this process's cgroup and its ancestors up to the hierarchy's mount point.
pub fn own_limits() -> OwnLimits {
    let Some(layout) = layout() else { return OwnLimits::default() };
    let tightest = |dir: &Path, stop: &Path, file: &str, parse: &dyn Fn(&str) -> Option<u64>| {
        let mut best: Option<u64> = None;
        let mut d = Some(dir);
        while let Some(cur) = d {
            if let Some(v) = fs::read_to_string(cur.join(file)).ok().as_deref().and_then(parse) {
                best = Some(best.map_or(v, |b| b.min(v)));
            }
            if cur == stop {
                break;
            }
            d = cur.parent().filter(|p| p.starts_with(stop));
        }
        best
    };
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mount_of = |dir: &Path| -> PathBuf {
        mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1).map(PathBuf::from))
            .filter(|m| dir.starts_with(m) && m.starts_with("/sys/fs/cgroup"))
            .max_by_key(|m| m.as_os_str().len())
            .unwrap_or_else(|| dir.to_path_buf())
    };
    match layout {
        Layout::V2 { base } => {
            let stop = mount_of(base);
            OwnLimits {
                memory: tightest(base, &stop, "memory.max", &parse_limit),
                pids: tightest(base, &stop, "pids.max", &parse_limit),
                cpu_millis: tightest(base, &stop, "cpu.max", &parse_cpu_max),
            }
        }
        Layout::V1 { bases } => {
            let of = |c: Controller| bases.iter().find(|(k, _)| *k == c).map(|(_, p)| p.clone());
            let read = |c: Controller, file: &str, parse: &dyn Fn(&str) -> Option<u64>| {
                of(c).and_then(|d| tightest(&d, &mount_of(&d), file, parse))
            };
            let cpu = of(Controller::Cpu).and_then(|d| {
                let quota: i64 = fs::read_to_string(d.join("cpu.cfs_quota_us")).ok()?.trim().parse().ok()?;
                let period: u64 = fs::read_to_string(d.join("cpu.cfs_period_us")).ok()?.trim().parse().ok()?;
                (quota > 0 && period > 0).then(|| quota as u64 * 1000 / period)
            });
            OwnLimits {
                memory: read(Controller::Memory, "memory.limit_in_bytes", &parse_limit),
                pids: read(Controller::Pids, "pids.max", &parse_limit),
                cpu_millis: cpu,
            }
        }
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn read_pids(path: &Path) -> Vec<i32> {
    fs::read_to_string(path).map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect()).unwrap_or_default()
}

impl JobCgroup {
    /// Creates the job's cgroup(s) and writes the limits. A leftover empty cgroup of the same
    /// name (an agent crash) is replaced, so counters such as `oom_kill` start at zero.
    pub(crate) fn create(
        layout: &Layout,
        job_id: &str,
        resources: &Resources,
        deny_devices: &[(u64, u64)],
    ) -> Result<JobCgroup, SandboxError> {
        // Only the hierarchies this job needs: memory and pids (limits, OOM and fork-limit
        // reporting), freezer (race-free tree kill); cpu only with a CPU limit and devices
        // only when there are GPU nodes to deny. Each directory is a mkdir plus a
        // cgroup.procs write at start and an rmdir at cleanup.
        let mut cg = Self::create_dirs(layout, job_id, &|c| match c {
            Controller::Memory | Controller::Pids | Controller::Freezer => true,
            Controller::Cpu => resources.cpu_millis.is_some(),
            Controller::Devices => !deny_devices.is_empty(),
        })?;
        if let Err(e) = cg.apply(resources, deny_devices) {
            cg.remove_dirs();
            return Err(e);
        }
        Ok(cg)
    }

    /// A cgroup in every hierarchy a job could need, without limits yet: for a process started
    /// ahead of its job (see `warm.rs`), whose limits [`JobCgroup::apply`] writes when the job
    /// is known. Unused controllers cost nothing but a directory.
    pub(crate) fn create_unlimited(layout: &Layout, name: &str) -> Result<JobCgroup, SandboxError> {
        Self::create_dirs(layout, name, &|_| true)
    }

    fn create_dirs(
        layout: &Layout,
        job_id: &str,
        want: &dyn Fn(Controller) -> bool,
    ) -> Result<JobCgroup, SandboxError> {
        let err = |op: &str, path: &Path, source: io::Error| SandboxError::Cgroup {
            job_id: job_id.to_string(),
            op: op.to_string(),
            path: path.to_path_buf(),
            source,
        };
        let dirs: Vec<(Controller, PathBuf)> = match layout {
            Layout::V1 { bases } => {
                bases.iter().filter(|(c, _)| want(*c)).map(|(c, b)| (*c, b.join(GROUP).join(job_id))).collect()
            }
            Layout::V2 { base } => {
                // Enable controllers for gpuci/ and its children. Failing here is not fatal on
                // its own: a limit that is asked for and cannot be written is.
                // One controller per write: a write naming one the parent does not offer
                // enables none of them.
                // Whether a write was refused with EBUSY: the cgroup holds processes, and
                // cgroup v2 hands controllers down only from a cgroup without any.
                let enable = |dir: &Path| {
                    let mut busy = false;
                    for c in ["+memory", "+pids", "+cpu"] {
                        if let Err(e) = fs::write(dir.join("cgroup.subtree_control"), c) {
                            busy |= e.raw_os_error() == Some(libc::EBUSY);
                        }
                    }
                    busy
                };
                if enable(base) {
                    // The agent is in the cgroup it was given (a container's, a service's):
                    // it moves itself and what else is there to a leaf beside its jobs' (the
                    // "no internal processes" rule), then hands the controllers down.
                    move_to_leaf(base).map_err(|e| err("moving the agent to a leaf cgroup under", base, e))?;
                    enable(base);
                }
                let group = base.join(GROUP);
                fs::create_dir_all(&group).map_err(|e| err("mkdir", &group, e))?;
                enable(&group);
                vec![(Controller::Memory, group.join(job_id))]
            }
        };
        let mut cg = JobCgroup {
            job_id: job_id.to_string(),
            v2: matches!(layout, Layout::V2 { .. }),
            dirs: Vec::new(),
            memory_limit: None,
        };
        for (c, dir) in dirs {
            if let Some(parent) = dir.parent() {
                fs::create_dir_all(parent).map_err(|e| err("mkdir", parent, e))?;
            }
            match fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    let pids = read_pids(&dir.join("cgroup.procs"));
                    if !pids.is_empty() {
                        cg.remove_dirs();
                        return Err(SandboxError::CgroupBusy { job_id: job_id.to_string(), path: dir, pids });
                    }
                    remove_tree(&dir).map_err(|e| err("rmdir (stale)", &dir, e))?;
                    fs::create_dir(&dir).map_err(|e| err("mkdir", &dir, e))?;
                }
                Err(e) => {
                    cg.remove_dirs();
                    return Err(err("mkdir", &dir, e));
                }
            }
            cg.dirs.push((c, dir));
        }
        Ok(cg)
    }

    fn dir(&self, c: Controller) -> Option<&Path> {
        if self.v2 {
            return self.dirs.first().map(|(_, d)| d.as_path());
        }
        self.dirs.iter().find(|(k, _)| *k == c).map(|(_, d)| d.as_path())
    }

    /// Writes the limits (and, on v1, the device denials). Also on a cgroup that already has
    /// its process: lowering a limit below what it uses fails, and a started process uses
    /// next to nothing.
    pub(crate) fn apply(&mut self, r: &Resources, deny_devices: &[(u64, u64)]) -> Result<(), SandboxError> {
        self.memory_limit = r.memory.map(|b| b.0);
        let id = &self.job_id;
        let need = |c: Controller, file: &str| -> Result<PathBuf, SandboxError> {
            let p = self.dir(c).map(|d| d.join(file)).filter(|p| p.exists());
            p.ok_or_else(|| SandboxError::CgroupUnavailable {
                job_id: id.clone(),
                reason: format!("{} limit requested but {file} does not exist (controller not enabled?)", c.name()),
            })
        };
        if let Some(mem) = r.memory {
            let v = mem.0.to_string();
            if self.v2 {
                write_file(id, &need(Controller::Memory, "memory.max")?, &v)?;
                if let Some(d) = self.dir(Controller::Memory) {
                    let swap = d.join("memory.swap.max");
                    if swap.exists() {
                        write_file(id, &swap, "0")?;
                    }
                }
            } else {
                write_file(id, &need(Controller::Memory, "memory.limit_in_bytes")?, &v)?;
                // memsw = memory + swap; equal to the memory limit means no swap. Absent when
                // the kernel runs without swap accounting.
                if let Some(d) = self.dir(Controller::Memory) {
                    let memsw = d.join("memory.memsw.limit_in_bytes");
                    if memsw.exists() {
                        write_file(id, &memsw, &v)?;
                    }
                }
            }
        }
        if let Some(pids) = r.pids {
            write_file(id, &need(Controller::Pids, "pids.max")?, &pids.to_string())?;
        }
        if let Some(millis) = r.cpu_millis {
            let quota = (u64::from(millis) * CPU_PERIOD_US / 1000).max(1000);
            if self.v2 {
                write_file(id, &need(Controller::Cpu, "cpu.max")?, &format!("{quota} {CPU_PERIOD_US}"))?;
            } else {
                write_file(id, &need(Controller::Cpu, "cpu.cfs_period_us")?, &CPU_PERIOD_US.to_string())?;
                write_file(id, &need(Controller::Cpu, "cpu.cfs_quota_us")?, &quota.to_string())?;
            }
        }
        // v1 only (v2 needs BPF): non-leased GPU nodes stay unopenable even without bwrap.
        if !self.v2 {
            if let Some(d) = self.dir(Controller::Devices) {
                for (major, minor) in deny_devices {
                    write_file(id, &d.join("devices.deny"), &format!("c {major}:{minor} rwm"))?;
                }
            }
        }
        Ok(())
    }

    /// The cgroup's directory name.
    pub(crate) fn name(&self) -> &str {
        &self.job_id
    }

    /// The `cgroup.procs` files the child writes itself into before exec.
    pub(crate) fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|(_, d)| d.join("cgroup.procs")).collect()
    }

    /// Every process in any of the job's cgroups (including sub-cgroups a root job made).
    pub(crate) fn pids(&self) -> Vec<i32> {
        let mut all = BTreeSet::new();
        for (_, d) in &self.dirs {
            collect_pids(d, &mut all);
        }
        all.into_iter().collect()
    }

    /// SIGKILLs every process in the cgroup without racing against forks: v2 `cgroup.kill`, else
    /// freeze, kill, thaw (v1 freezer / v2 `cgroup.freeze`), else kill repeatedly until empty
    /// (the pids limit bounds how long a fork loop can keep up).
    pub(crate) fn kill_all(&self) -> Result<(), SandboxError> {
        if self.v2 {
            if let Some(d) = self.dir(Controller::Memory) {
                let k = d.join("cgroup.kill");
                if k.exists() {
                    return write_file(&self.job_id, &k, "1");
                }
                let freeze = d.join("cgroup.freeze");
                if freeze.exists() {
                    write_file(&self.job_id, &freeze, "1")?;
                    wait_until(Duration::from_millis(500), || {
                        read_counter(&d.join("cgroup.events"), "frozen") == Some(1)
                    });
                    self.kill_listed()?;
                    return write_file(&self.job_id, &freeze, "0");
                }
            }
        } else if let Some(d) = self.dir(Controller::Freezer) {
            let state = d.join("freezer.state");
            write_file(&self.job_id, &state, "FROZEN")?;
            wait_until(Duration::from_millis(500), || {
                fs::read_to_string(&state).map(|s| s.trim() == "FROZEN").unwrap_or(false)
            });
            // Frozen tasks take the SIGKILL when thawed.
            let killed = self.kill_listed();
            write_file(&self.job_id, &state, "THAWED")?;
            return killed.map(|_| ());
        }
        for _ in 0..100 {
            if self.kill_listed()? == 0 {
                break;
            }
        }
        Ok(())
    }

    fn kill_listed(&self) -> Result<usize, SandboxError> {
        let pids = self.pids();
        for &pid in &pids {
            match kill(Pid::from_raw(pid), Signal::SIGKILL) {
                Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                Err(source) => return Err(SandboxError::Kill { job_id: self.job_id.clone(), pid, source }),
            }
        }
        Ok(pids.len())
    }

    /// Whether the kernel OOM killer killed a process of this job. Only v1 kernels older than
    /// 4.13 lack the `oom_kill` counter; there `failcnt > 0` together with a SIGKILL is taken.
    pub(crate) fn oom_killed(&self, died_of_sigkill: bool) -> bool {
        let Some(d) = self.dir(Controller::Memory) else {
            return false;
        };
        if self.v2 {
            return read_counter(&d.join("memory.events"), "oom_kill").unwrap_or(0) > 0;
        }
        match read_counter(&d.join("memory.oom_control"), "oom_kill") {
            Some(n) => n > 0,
            None => died_of_sigkill && read_u64(&d.join("memory.failcnt")).unwrap_or(0) > 0,
        }
    }

    pub(crate) fn memory_peak(&self) -> Option<u64> {
        let d = self.dir(Controller::Memory)?;
        read_u64(&d.join(if self.v2 { "memory.peak" } else { "memory.max_usage_in_bytes" }))
    }

    pub(crate) fn memory_limit(&self) -> Option<u64> {
        self.memory_limit
    }

    /// Whether a fork failed because of the pids limit.
    pub(crate) fn pids_limit_hit(&self) -> bool {
        self.dir(Controller::Pids).and_then(|d| read_counter(&d.join("pids.events"), "max")).unwrap_or(0) > 0
    }

    /// Removes the cgroup directories; fails with `EBUSY` while processes remain.
    pub(crate) fn remove(&self) -> Result<(), SandboxError> {
        for (_, d) in &self.dirs {
            if d.exists() {
                remove_tree(d).map_err(|source| SandboxError::Cgroup {
                    job_id: self.job_id.clone(),
                    op: "rmdir".to_string(),
                    path: d.clone(),
                    source,
                })?;
            }
        }
        Ok(())
    }

    /// The job cgroups a previous run left behind whose names start with `prefix` (an agent
    /// killed with SIGKILL cleans up nothing).
    pub(crate) fn leftovers(layout: &Layout, prefix: &str) -> Vec<JobCgroup> {
        let (bases, v2): (Vec<(Controller, PathBuf)>, bool) = match layout {
            Layout::V1 { bases } => (bases.clone(), false),
            Layout::V2 { base } => (vec![(Controller::Memory, base.clone())], true),
        };
        let mut by_job: std::collections::BTreeMap<String, Vec<(Controller, PathBuf)>> = Default::default();
        for (c, base) in bases {
            let Ok(rd) = fs::read_dir(base.join(GROUP)) else { continue };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(prefix) && e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    by_job.entry(name).or_default().push((c, e.path()));
                }
            }
        }
        by_job.into_iter().map(|(job_id, dirs)| JobCgroup { job_id, v2, dirs, memory_limit: None }).collect()
    }

    fn remove_dirs(&self) {
        for (_, d) in &self.dirs {
            let _ = remove_tree(d);
        }
    }
}

fn collect_pids(dir: &Path, into: &mut BTreeSet<i32>) {
    into.extend(read_pids(&dir.join("cgroup.procs")));
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                collect_pids(&e.path(), into);
            }
        }
    }
}

/// cgroup directories are removed with rmdir, children first (their files cannot be unlinked).
fn remove_tree(dir: &Path) -> io::Result<()> {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_tree(&e.path())?;
            }
        }
    }
    match fs::remove_dir(dir) {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() && start.elapsed() < limit {
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn limit_files_parse_as_a_container_runtime_writes_them() {
        assert_eq!(parse_limit("25769803776\n"), Some(25769803776));
        assert_eq!(parse_limit("max\n"), None, "v2: no limit");
        assert_eq!(parse_limit("9223372036854771712\n"), None, "v1: no limit (page-rounded i64::MAX)");
        assert_eq!(parse_limit("4096"), Some(4096));
        assert_eq!(parse_cpu_max("600000 100000\n"), Some(6000));
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("50000 100000"), Some(500));
        let l = OwnLimits { memory: Some(24 << 30), pids: None, cpu_millis: Some(6000) };
        assert_eq!(l.describe(), "memory 24 GiB, 6 CPUs, no process limit");
    }

    use super::*;

    const HYBRID_MOUNTS: &str = "\
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";
    const HYBRID_OWN: &str = "8:pids:/\n6:freezer:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n";

    #[test]
    fn v1_nests_under_own_cgroup_per_controller() {
        let l = detect_layout(HYBRID_MOUNTS, HYBRID_OWN, &|_| true, &|_| Some(String::new())).expect("layout");
        let Layout::V1 { bases } = l else { panic!("expected v1") };
        let mem = bases.iter().find(|(c, _)| *c == Controller::Memory).map(|(_, p)| p.clone());
        assert_eq!(mem, Some(PathBuf::from("/sys/fs/cgroup/memory/process_api/abc")));
        let pids = bases.iter().find(|(c, _)| *c == Controller::Pids).map(|(_, p)| p.clone());
        assert_eq!(pids, Some(PathBuf::from("/sys/fs/cgroup/pids")));
    }

    #[test]
    fn v1_falls_back_to_mount_when_own_path_is_not_visible() {
        let l = detect_layout(HYBRID_MOUNTS, HYBRID_OWN, &|_| false, &|_| None).expect("layout");
        let Layout::V1 { bases } = l else { panic!("expected v1") };
        assert!(bases.iter().any(|(_, p)| p == Path::new("/sys/fs/cgroup/memory")));
    }

    #[test]
    fn pure_v2_uses_unified_path() {
        let mounts = "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n";
        let own = "0::/system.slice/gpuci-agent.service\n";
        let l = detect_layout(mounts, own, &|_| true, &|_| Some("cpu memory pids\n".into())).expect("layout");
        let Layout::V2 { base } = l else { panic!("expected v2") };
        assert_eq!(base, PathBuf::from("/sys/fs/cgroup/system.slice/gpuci-agent.service"));
    }

    #[test]
    fn v2_without_controllers_is_unusable() {
        let mounts = "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert!(detect_layout(mounts, "0::/\n", &|_| true, &|_| Some("\n".into())).is_none());
    }

    #[test]
    fn counters_parse() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("memory.oom_control");
        fs::write(&p, "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n").expect("write");
        assert_eq!(read_counter(&p, "oom_kill"), Some(3));
        assert_eq!(read_counter(&p, "oom_kill_disable"), Some(0));
        assert_eq!(read_counter(&p, "missing"), None);
    }
}
