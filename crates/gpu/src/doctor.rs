//! `gpuci doctor`, the library half: checks of this host returned as data. The CLI prints
//! them ([`format_table`]) or serialises them (`--json`); [`doctor_passed`] decides the
//! exit status. External commands go through [`CommandRunner`] and paths come from
//! [`DoctorOptions`], so every check runs in tests.
//!
//! On a host with no NVIDIA GPU the GPU checks are `Skip` ("no NVIDIA GPU on this host"),
//! not `Fail`: a CPU-only agent is legitimate. NVIDIA hardware or a driver that is present
//! but does not answer is a `Fail`.

use crate::backend::BackendKind;
use crate::command::CommandRunner;
use crate::detect::Detection;
use gpuci_core::gpu::{ComputeCapability, GpuInfo, Version};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckStatus {
    Pass,
    Warn,
    Fail,
    Skip,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoctorCheck {
    /// Stable identifier, e.g. `gpu.driver`, `sandbox.cgroups`, `probe.nccl`.
    pub name: String,
    pub status: CheckStatus,
    pub detail: String,
    /// What to do about a `Warn` or `Fail`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl DoctorCheck {
    fn new(name: &str, status: CheckStatus, detail: impl Into<String>) -> Self {
        DoctorCheck { name: name.to_string(), status, detail: detail.into(), fix: None }
    }
    fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// A user-defined check: `command` runs under `sh -c` and passes on exit 0.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct Probe {
    pub name: String,
    pub command: String,
}

#[derive(Clone, Debug)]
pub struct DoctorOptions {
    pub min_driver: Option<Version>,
    pub min_cuda: Option<Version>,
    pub min_compute_capability: Option<ComputeCapability>,
    pub probes: Vec<Probe>,
    /// `/dev`: where `nvidiactl` and `nvidia-uvm` are looked for.
    pub dev_dir: PathBuf,
    /// `/sys/fs/cgroup`.
    pub cgroup_root: PathBuf,
    /// `/proc/mounts`: mount options of the cgroup file systems.
    pub mounts_file: PathBuf,
    /// `/sys/bus/pci/devices`: used to tell "no NVIDIA hardware" from "driver broken".
    pub pci_devices_dir: PathBuf,
    pub command_timeout: Duration,
    pub probe_timeout: Duration,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        DoctorOptions {
            min_driver: None,
            min_cuda: None,
            min_compute_capability: None,
            probes: Vec::new(),
            dev_dir: PathBuf::from("/dev"),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            mounts_file: PathBuf::from("/proc/mounts"),
            pci_devices_dir: PathBuf::from("/sys/bus/pci/devices"),
            command_timeout: Duration::from_secs(15),
            probe_timeout: Duration::from_secs(120),
        }
    }
}

/// Run every check. GPU facts come from `detection` (what the agent will use); commands
/// from `runner`.
pub fn doctor(opts: &DoctorOptions, detection: &Detection, runner: &dyn CommandRunner) -> Vec<DoctorCheck> {
    let mut checks = Vec::new();
    let gpus = check_inventory(opts, detection, &mut checks);
    match &gpus {
        Some(gpus) => {
            let simulated = detection.kind() == BackendKind::Simulated;
            checks.push(check_driver(opts, gpus));
            checks.push(check_cuda(opts, gpus));
            checks.push(check_compute_capability(opts, gpus));
            checks.push(if simulated {
                DoctorCheck::new("gpu.nvidia_smi", CheckStatus::Skip, "simulated GPUs: nvidia-smi not consulted")
            } else {
                check_nvidia_smi(opts, runner)
            });
            checks.push(check_persistence(gpus));
            checks.push(check_device_nodes(opts, gpus, simulated));
        }
        None => {
            // Still ask nvidia-smi when hardware is there: its message is often the clue.
            let hardware = nvidia_hardware(opts).is_some();
            for name in ["gpu.driver", "gpu.cuda", "gpu.compute_capability"] {
                checks.push(DoctorCheck::new(name, CheckStatus::Skip, "no NVIDIA GPU on this host"));
            }
            checks.push(if hardware {
                check_nvidia_smi(opts, runner)
            } else {
                DoctorCheck::new("gpu.nvidia_smi", CheckStatus::Skip, "no NVIDIA GPU on this host")
            });
            for name in ["gpu.persistence_mode", "gpu.device_nodes"] {
                checks.push(DoctorCheck::new(name, CheckStatus::Skip, "no NVIDIA GPU on this host"));
            }
        }
    }
    checks.push(check_bubblewrap(opts, runner));
    checks.push(check_cgroups(&opts.cgroup_root));
    checks.push(check_cgroup_join_latency(&std::fs::read_to_string(&opts.mounts_file).unwrap_or_default()));
    checks.push(check_container_runtime(opts, runner));
    for p in &opts.probes {
        checks.push(run_probe(opts, runner, p));
    }
    checks
}

/// False when any check failed; warnings and skips pass.
pub fn doctor_passed(checks: &[DoctorCheck]) -> bool {
    !checks.iter().any(|c| c.status == CheckStatus::Fail)
}

/// A plain-text table for people (stderr or a terminal): status, name, detail, then the
/// fix indented on its own line.
pub fn format_table(checks: &[DoctorCheck]) -> String {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    let mut out = String::new();
    for c in checks {
        let status = match c.status {
            CheckStatus::Pass => "ok  ",
            CheckStatus::Warn => "WARN",
            CheckStatus::Fail => "FAIL",
            CheckStatus::Skip => "skip",
        };
        let mut lines = c.detail.lines();
        let _ = writeln!(out, "{status}  {:width$}  {}", c.name, lines.next().unwrap_or_default());
        for l in lines {
            let _ = writeln!(out, "      {:width$}  {l}", "");
        }
        if let Some(fix) = &c.fix {
            let _ = writeln!(out, "      {:width$}  fix: {fix}", "");
        }
    }
    out
}

/// A description of NVIDIA hardware or driver presence, if any: a PCI display/3D device
/// with vendor 0x10de, or `/dev/nvidiactl`.
fn nvidia_hardware(opts: &DoctorOptions) -> Option<String> {
    if let Ok(entries) = std::fs::read_dir(&opts.pci_devices_dir) {
        for e in entries.flatten() {
            let read = |f: &str| std::fs::read_to_string(e.path().join(f)).unwrap_or_default();
            if read("vendor").trim() == "0x10de" && read("class").trim().starts_with("0x03") {
                return Some(format!("NVIDIA PCI device {}", e.file_name().to_string_lossy()));
            }
        }
    }
    let ctl = opts.dev_dir.join("nvidiactl");
    ctl.exists().then(|| format!("{} exists", ctl.display()))
}

fn summarize_models(gpus: &[GpuInfo]) -> String {
    let mut groups: Vec<(String, usize)> = Vec::new();
    for g in gpus {
        match groups.iter_mut().find(|(n, _)| *n == g.name) {
            Some((_, n)) => *n += 1,
            None => groups.push((g.name.clone(), 1)),
        }
    }
    groups.iter().map(|(name, n)| format!("{n} × {name}")).collect::<Vec<_>>().join(", ")
}

fn check_inventory(opts: &DoctorOptions, d: &Detection, checks: &mut Vec<DoctorCheck>) -> Option<Vec<GpuInfo>> {
    const NAME: &str = "gpu.inventory";
    let reason = d.no_gpu_reason();
    let gpus = match d.backend.inventory() {
        Ok(g) if !g.is_empty() => g,
        Ok(_) => {
            let why = reason.unwrap_or_else(|| format!("{} lists no GPU", d.kind()));
            checks.push(match nvidia_hardware(opts) {
                Some(hw) => DoctorCheck::new(NAME, CheckStatus::Fail, format!("{hw}, but no GPU answers ({why})"))
                    .fix("look for NVRM/Xid lines in `sudo dmesg`; reload the NVIDIA driver or reboot; check that the driver matches the kernel"),
                None => DoctorCheck::new(NAME, CheckStatus::Skip, format!("no NVIDIA GPU on this host ({why})")),
            });
            return None;
        }
        Err(e) => {
            checks.push(
                DoctorCheck::new(NAME, CheckStatus::Fail, format!("reading the GPU inventory failed: {e}"))
                    .fix("look for NVRM/Xid lines in `sudo dmesg`; reload the NVIDIA driver or reboot"),
            );
            return None;
        }
    };
    let mut detail = format!("{} via {}", summarize_models(&gpus), d.kind());
    if !d.fallback_reasons.is_empty() {
        let _ = write!(detail, " ({})", d.fallback_reasons.join("; "));
    }
    checks.push(if d.kind() == BackendKind::Simulated {
        DoctorCheck::new(NAME, CheckStatus::Warn, format!("SIMULATED, not real hardware: {detail}"))
    } else {
        DoctorCheck::new(NAME, CheckStatus::Pass, detail)
    });
    Some(gpus)
}

fn check_driver(opts: &DoctorOptions, gpus: &[GpuInfo]) -> DoctorCheck {
    const NAME: &str = "gpu.driver";
    let Some(v) = gpus.iter().map(|g| &g.driver_version).min() else {
        return DoctorCheck::new(NAME, CheckStatus::Skip, "no GPU");
    };
    match &opts.min_driver {
        Some(min) if v < min => {
            DoctorCheck::new(NAME, CheckStatus::Fail, format!("driver {v} is older than the required {min}"))
                .fix(format!("install NVIDIA driver {min} or newer"))
        }
        Some(min) => DoctorCheck::new(NAME, CheckStatus::Pass, format!("driver {v} (>= {min})")),
        None => DoctorCheck::new(NAME, CheckStatus::Pass, format!("driver {v}")),
    }
}

fn check_cuda(opts: &DoctorOptions, gpus: &[GpuInfo]) -> DoctorCheck {
    const NAME: &str = "gpu.cuda";
    let v = gpus.iter().filter_map(|g| g.cuda_driver_version.as_ref()).min();
    let fix =
        |min: &Version| format!("the CUDA version comes with the driver: install a driver that supports CUDA {min}");
    match (v, &opts.min_cuda) {
        (None, Some(min)) => {
            DoctorCheck::new(NAME, CheckStatus::Fail, format!("CUDA driver version unknown (required {min})"))
                .fix(fix(min))
        }
        (None, None) => DoctorCheck::new(
            NAME,
            CheckStatus::Warn,
            "CUDA driver version unknown; jobs asking for `cuda:` will not match",
        ),
        (Some(v), Some(min)) if v < min => DoctorCheck::new(
            NAME,
            CheckStatus::Fail,
            format!("driver supports CUDA {v}, older than the required {min}"),
        )
        .fix(fix(min)),
        (Some(v), Some(min)) => DoctorCheck::new(NAME, CheckStatus::Pass, format!("CUDA {v} (>= {min})")),
        (Some(v), None) => DoctorCheck::new(NAME, CheckStatus::Pass, format!("CUDA {v}")),
    }
}

fn check_compute_capability(opts: &DoctorOptions, gpus: &[GpuInfo]) -> DoctorCheck {
    const NAME: &str = "gpu.compute_capability";
    let mut caps: Vec<ComputeCapability> = gpus.iter().map(|g| g.compute_capability).collect();
    caps.sort();
    caps.dedup();
    let list = caps.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
    match opts.min_compute_capability {
        Some(min) => {
            let low: Vec<String> = gpus
                .iter()
                .filter(|g| g.compute_capability < min)
                .map(|g| format!("GPU {} ({}, {})", g.index, g.name, g.compute_capability))
                .collect();
            if low.is_empty() {
                DoctorCheck::new(NAME, CheckStatus::Pass, format!("{list} (>= {min})"))
            } else {
                DoctorCheck::new(NAME, CheckStatus::Fail, format!("below the required {min}: {}", low.join(", ")))
                    .fix("lower min_compute_capability or move these GPUs to a pool that allows them")
            }
        }
        None => DoctorCheck::new(NAME, CheckStatus::Pass, list),
    }
}

/// `nvidia-smi --query-gpu=name` rather than bare `nvidia-smi`: the bare command can exit 0
/// with a crashed driver, the query cannot.
fn check_nvidia_smi(opts: &DoctorOptions, runner: &dyn CommandRunner) -> DoctorCheck {
    const NAME: &str = "gpu.nvidia_smi";
    match runner.run("nvidia-smi", &["--query-gpu=name", "--format=csv,noheader"], opts.command_timeout) {
        Ok(out) if out.success() && !out.stdout.trim().is_empty() => DoctorCheck::new(
            NAME,
            CheckStatus::Pass,
            format!("lists {} GPU(s)", out.stdout.lines().filter(|l| !l.trim().is_empty()).count()),
        ),
        Ok(out) => {
            let code = out.status.map_or("a signal".into(), |c| format!("exit code {c}"));
            DoctorCheck::new(NAME, CheckStatus::Fail, format!("nvidia-smi query failed ({code}): {}", out.tail(5))).fix(
                "the driver is not answering: look for NVRM/Xid lines in `sudo dmesg`; reload the driver or reboot",
            )
        }
        Err(e) => DoctorCheck::new(NAME, CheckStatus::Fail, e.to_string())
            .fix("install the NVIDIA driver utilities (nvidia-smi) or fix PATH"),
    }
}

fn check_persistence(gpus: &[GpuInfo]) -> DoctorCheck {
    const NAME: &str = "gpu.persistence_mode";
    let off: Vec<String> =
        gpus.iter().filter(|g| g.persistence_mode == Some(false)).map(|g| g.index.to_string()).collect();
    if !off.is_empty() {
        return DoctorCheck::new(
            NAME,
            CheckStatus::Warn,
            format!("off on GPU {}: every job pays the driver start-up time", off.join(", ")),
        )
        .fix("enable nvidia-persistenced (systemctl enable --now nvidia-persistenced) or run `sudo nvidia-smi -pm 1`");
    }
    if gpus.iter().all(|g| g.persistence_mode.is_none()) {
        return DoctorCheck::new(NAME, CheckStatus::Skip, "persistence mode not reported");
    }
    DoctorCheck::new(NAME, CheckStatus::Pass, "on")
}

/// Opens each node for reading and writing, as CUDA will: exists-and-mode checks miss
/// group membership and ACLs.
fn check_device_nodes(opts: &DoctorOptions, gpus: &[GpuInfo], simulated: bool) -> DoctorCheck {
    const NAME: &str = "gpu.device_nodes";
    let mut nodes: Vec<PathBuf> = gpus.iter().map(|g| PathBuf::from(&g.device_node)).collect();
    if !simulated {
        nodes.push(opts.dev_dir.join("nvidiactl"));
        nodes.push(opts.dev_dir.join("nvidia-uvm"));
    }
    let (mut missing, mut denied) = (Vec::new(), Vec::new());
    for n in &nodes {
        match std::fs::OpenOptions::new().read(true).write(true).open(n) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => missing.push(n.display().to_string()),
            Err(e) => denied.push(format!("{} ({e})", n.display())),
        }
    }
    if !missing.is_empty() {
        return DoctorCheck::new(NAME, CheckStatus::Fail, format!("missing: {}", missing.join(", ")))
            .fix("load the modules and create the nodes: `sudo nvidia-modprobe -u -c=0` (nvidia-uvm is created on first CUDA use)");
    }
    if !denied.is_empty() {
        return DoctorCheck::new(
            NAME,
            CheckStatus::Fail,
            format!("not readable and writable by this user: {}", denied.join(", ")),
        )
        .fix("add this user to the group that owns the nodes (see `ls -l /dev/nvidia*`), or fix the udev rule");
    }
    DoctorCheck::new(NAME, CheckStatus::Pass, format!("{} node(s) readable and writable", nodes.len()))
}

fn check_bubblewrap(opts: &DoctorOptions, runner: &dyn CommandRunner) -> DoctorCheck {
    const NAME: &str = "sandbox.bubblewrap";
    match runner.run("bwrap", &["--version"], opts.command_timeout) {
        Ok(out) if out.success() => DoctorCheck::new(NAME, CheckStatus::Pass, out.stdout.trim().to_string()),
        Ok(out) => DoctorCheck::new(NAME, CheckStatus::Fail, format!("bwrap --version failed: {}", out.tail(3)))
            .fix("reinstall bubblewrap; check that unprivileged user namespaces are allowed"),
        Err(e) => DoctorCheck::new(NAME, CheckStatus::Fail, format!("{e}: jobs cannot be isolated"))
            .fix("install bubblewrap (apt install bubblewrap / dnf install bubblewrap)"),
    }
}

/// Joining a cgroup waits for an RCU grace period unless the cgroup2 mount has `favordynmods`
/// (Linux >= 6.0); on a quiet host that is 12-16 ms added to every job's start. A hint, not a
/// failure: the option makes fork and exit slightly dearer for every process on the host.
pub fn check_cgroup_join_latency(mounts: &str) -> DoctorCheck {
    const NAME: &str = "sandbox.cgroup_join";
    let cgroup2: Vec<(&str, &str)> = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && f[2] == "cgroup2").then(|| (f[1], f[3]))
        })
        .collect();
    match cgroup2.iter().find(|(_, opts)| !opts.split(',').any(|o| o == "favordynmods")) {
        None if cgroup2.is_empty() => DoctorCheck::new(NAME, CheckStatus::Skip, "no cgroup2 mount"),
        None => DoctorCheck::new(NAME, CheckStatus::Pass, "cgroup2 mounted with favordynmods"),
        Some((at, _)) => DoctorCheck::new(
            NAME,
            CheckStatus::Warn,
            format!(
                "cgroup2 at {at} without favordynmods: each job's cgroup join can wait ~15 ms for an RCU grace period"
            ),
        )
        .fix(format!("mount -o remount,favordynmods {at} (Linux >= 6.0; trades a little fork/exit speed host-wide)")),
    }
}

fn check_cgroups(root: &Path) -> DoctorCheck {
    const NAME: &str = "sandbox.cgroups";
    let wanted = ["memory", "pids"];
    if let Ok(controllers) = std::fs::read_to_string(root.join("cgroup.controllers")) {
        let have: Vec<&str> = controllers.split_whitespace().collect();
        let missing: Vec<&str> = wanted.iter().copied().filter(|w| !have.contains(w)).collect();
        return if missing.is_empty() {
            DoctorCheck::new(NAME, CheckStatus::Pass, format!("cgroup v2 at {} with memory, pids", root.display()))
        } else {
            DoctorCheck::new(NAME, CheckStatus::Fail, format!("cgroup v2 at {} lacks the {} controller(s)", root.display(), missing.join(", ")))
                .fix("enable the controllers (e.g. `echo +memory +pids > /sys/fs/cgroup/cgroup.subtree_control`) or delegate them to the agent's systemd unit (Delegate=yes)")
        };
    }
    let missing: Vec<&str> = wanted.iter().copied().filter(|w| !root.join(w).is_dir()).collect();
    if missing.is_empty() {
        return DoctorCheck::new(NAME, CheckStatus::Pass, format!("cgroup v1 at {} with memory, pids", root.display()));
    }
    DoctorCheck::new(
        NAME,
        CheckStatus::Fail,
        format!("no cgroup {} controller under {}", missing.join(", "), root.display()),
    )
    .fix("mount cgroup2 at /sys/fs/cgroup (boot with systemd.unified_cgroup_hierarchy=1)")
}

fn check_container_runtime(opts: &DoctorOptions, runner: &dyn CommandRunner) -> DoctorCheck {
    const NAME: &str = "container.runtime";
    // The engine must answer, not just its client: a docker CLI without a daemon cannot run a
    // container, and the agent does not advertise one.
    let mut found_cli: Option<(&str, String)> = None;
    // podman's `info` has no `.ServerVersion`: that template fails even when podman works.
    for (rt, field) in [("podman", "{{.Version.Version}}"), ("docker", "{{.ServerVersion}}")] {
        match runner.run(rt, &["info", "--format", field], opts.command_timeout) {
            Ok(out) if out.success() => {
                return DoctorCheck::new(NAME, CheckStatus::Pass, format!("{rt} {} answers", out.stdout.trim()));
            }
            Ok(out) => {
                let why = out.tail(1);
                found_cli.get_or_insert((rt, if why.is_empty() { "the engine did not answer".into() } else { why }));
            }
            Err(_) => {}
        }
    }
    match found_cli {
        Some((rt, why)) => DoctorCheck::new(
            NAME,
            CheckStatus::Warn,
            format!("{rt} is installed but its engine does not answer ({why}): steps with `image:` will not be offered to this agent"),
        )
        .fix(format!("start the engine (e.g. `systemctl start {rt}`) or install rootless podman")),
        None => DoctorCheck::new(NAME, CheckStatus::Warn, "neither podman nor docker works: steps with `image:` cannot run here")
            .fix("install podman (rootless) or docker"),
    }
}

fn run_probe(opts: &DoctorOptions, runner: &dyn CommandRunner, p: &Probe) -> DoctorCheck {
    let name = format!("probe.{}", p.name);
    match runner.run("sh", &["-c", &p.command], opts.probe_timeout) {
        Ok(out) if out.success() => DoctorCheck::new(&name, CheckStatus::Pass, format!("`{}` exited 0", p.command)),
        Ok(out) => {
            let code = out.status.map_or("was killed by a signal".into(), |c| format!("exited {c}"));
            let tail = out.tail(5);
            let detail = if tail.is_empty() {
                format!("`{}` {code}", p.command)
            } else {
                format!("`{}` {code}:\n{tail}", p.command)
            };
            DoctorCheck::new(&name, CheckStatus::Fail, detail)
        }
        Err(e) => DoctorCheck::new(&name, CheckStatus::Fail, format!("`{}`: {e}", p.command)),
    }
}

/// Where pools install the Actions runner unless they name another `install_dir`.
pub const DEFAULT_RUNNER_DIR: &str = "/opt/actions-runner";

/// The Actions runner install at `dir`, for runner jobs. The agent runs every job as an
/// unprivileged uid of its own (1500000000 and up), which owns nothing on the host and is in
/// none of its groups: only the *other* permission bits count for it. So every directory on
/// the way to the install must let others pass (`o+x`), the install be readable and
/// searchable by others, and `run.sh` and `config.sh` (and `bin/Runner.Listener`, which
/// `run.sh` starts) readable and executable by others. An install others may write is a
/// warning: a job, or any user of the host, could change the runner the next job runs.
///
/// Without this, a runner that cannot start exits at once and its job waits for the next,
/// which the coordinator spaces out but cannot make work.
pub fn check_runner_install(dir: &Path) -> Vec<DoctorCheck> {
    use std::os::unix::fs::PermissionsExt;
    let shown = dir.display();
    let mode = |p: &Path| std::fs::metadata(p).map(|m| (m.is_dir(), m.permissions().mode() & 0o7777));
    let install = match mode(dir) {
        Ok((true, _)) => {
            let missing: Vec<&str> = ["run.sh", "config.sh"].into_iter().filter(|f| !dir.join(f).is_file()).collect();
            if missing.is_empty() {
                DoctorCheck::new("runner.install", CheckStatus::Pass, format!("Actions runner at {shown}"))
            } else {
                DoctorCheck::new(
                    "runner.install",
                    CheckStatus::Fail,
                    format!("{shown} has no {}: not an Actions runner install", missing.join(" or ")),
                )
                .fix(format!("unpack the actions-runner release (github.com/actions/runner) into {shown}"))
            }
        }
        Ok((false, _)) => DoctorCheck::new("runner.install", CheckStatus::Fail, format!("{shown} is not a directory"))
            .fix("unpack the actions-runner release into a directory and name it in the pool's install_dir"),
        Err(e) => DoctorCheck::new("runner.install", CheckStatus::Fail, format!("{shown}: {e}")).fix(format!(
            "unpack the actions-runner release (github.com/actions/runner) into {shown}, or set the pool's install_dir"
        )),
    };
    if install.status != CheckStatus::Pass {
        let skipped = DoctorCheck::new("runner.job_user", CheckStatus::Skip, "no runner install to check");
        return vec![install, skipped];
    }
    // What a uid that is neither owner nor in the group may do: the "other" bits.
    let mut problems = Vec::new();
    let mut fixes = Vec::new();
    for ancestor in dir.ancestors().skip(1) {
        match mode(ancestor) {
            Ok((_, m)) if m & 0o001 == 0 => {
                problems.push(format!("{} is not searchable by other users (mode {m:03o})", ancestor.display()));
                fixes.push(format!("chmod o+x {}", ancestor.display()));
            }
            Ok(_) => {}
            Err(e) => problems.push(format!("{}: {e}", ancestor.display())),
        }
    }
    let mut writable = Vec::new();
    let mut entries = vec![(dir.to_path_buf(), true)];
    entries.extend(["run.sh", "config.sh", "bin/Runner.Listener"].iter().map(|f| (dir.join(f), false)));
    let mut closed = false;
    for (path, is_dir) in entries {
        let Ok((_, m)) = mode(&path) else { continue };
        if m & 0o005 != 0o005 {
            let what = if is_dir { "readable and searchable" } else { "readable and executable" };
            problems.push(format!("{} is not {what} by other users (mode {m:03o})", path.display()));
            closed = true;
        }
        if m & 0o022 != 0 {
            writable.push(path.display().to_string());
        }
    }
    if closed {
        // `X`: directories and what is already executable by someone, not every data file.
        fixes.push(format!("chmod -R o+rX {shown}"));
    }
    let check = if !problems.is_empty() {
        DoctorCheck::new(
            "runner.job_user",
            CheckStatus::Fail,
            format!(
                "jobs run as unprivileged uids (1500000000 and up) and cannot start the runner: {}",
                problems.join("; ")
            ),
        )
        .fix(fixes.join(" && "))
    } else if !writable.is_empty() {
        DoctorCheck::new(
            "runner.job_user",
            CheckStatus::Warn,
            format!(
                "jobs can start the runner, but group or other users may write {}: they could change the runner the next job runs",
                writable.join(", ")
            ),
        )
        .fix(format!("chmod -R go-w {shown}"))
    } else {
        DoctorCheck::new(
            "runner.job_user",
            CheckStatus::Pass,
            "jobs (unprivileged uids) can reach and run run.sh and config.sh; only their owner may change them",
        )
    };
    vec![install, check]
}

#[cfg(test)]
mod runner_tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A runner install under a temp dir that others may pass through, as /opt is.
    fn install() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        chmod(tmp.path(), 0o755);
        let dir = tmp.path().join("actions-runner");
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        for f in ["run.sh", "config.sh", "bin/Runner.Listener"] {
            std::fs::write(dir.join(f), "#!/bin/sh\n").unwrap();
            chmod(&dir.join(f), 0o755);
        }
        chmod(&dir, 0o755);
        (tmp, dir)
    }

    fn status(checks: &[DoctorCheck], name: &str) -> (CheckStatus, String, Option<String>) {
        let c = checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name}: {checks:#?}"));
        (c.status, c.detail.clone(), c.fix.clone())
    }

    #[test]
    fn a_good_install_passes() {
        let (_tmp, dir) = install();
        let checks = check_runner_install(&dir);
        assert_eq!(status(&checks, "runner.install").0, CheckStatus::Pass, "{checks:#?}");
        assert_eq!(status(&checks, "runner.job_user").0, CheckStatus::Pass, "{checks:#?}");
    }

    #[test]
    fn a_missing_install_or_run_sh_fails_with_the_fix() {
        let tmp = tempfile::tempdir().unwrap();
        let checks = check_runner_install(&tmp.path().join("nope"));
        let (s, detail, fix) = status(&checks, "runner.install");
        assert_eq!(s, CheckStatus::Fail);
        assert!(detail.contains("nope") && fix.unwrap().contains("actions-runner"), "{detail}");
        assert_eq!(status(&checks, "runner.job_user").0, CheckStatus::Skip);

        let (_tmp, dir) = install();
        std::fs::remove_file(dir.join("run.sh")).unwrap();
        let (s, detail, _) = status(&check_runner_install(&dir), "runner.install");
        assert_eq!(s, CheckStatus::Fail);
        assert!(detail.contains("no run.sh"), "{detail}");
    }

    #[test]
    fn an_install_the_job_user_cannot_reach_or_run_fails() {
        // The home-directory mistake: unpacked under a 0700 directory.
        let (tmp, dir) = install();
        chmod(tmp.path(), 0o700);
        let (s, detail, fix) = status(&check_runner_install(&dir), "runner.job_user");
        assert_eq!(s, CheckStatus::Fail, "{detail}");
        assert!(detail.contains("not searchable by other users (mode 700)"), "{detail}");
        assert_eq!(fix.unwrap(), format!("chmod o+x {}", tmp.path().display()));
        chmod(tmp.path(), 0o755);

        // run.sh executable by its owner only.
        chmod(&dir.join("run.sh"), 0o744);
        let (s, detail, fix) = status(&check_runner_install(&dir), "runner.job_user");
        assert_eq!(s, CheckStatus::Fail, "{detail}");
        assert!(detail.contains("run.sh is not readable and executable by other users (mode 744)"), "{detail}");
        assert!(fix.unwrap().contains("chmod -R o+rX"));
    }

    #[test]
    fn an_install_others_may_write_is_a_warning() {
        let (_tmp, dir) = install();
        chmod(&dir.join("run.sh"), 0o777);
        let (s, detail, fix) = status(&check_runner_install(&dir), "runner.job_user");
        assert_eq!(s, CheckStatus::Warn, "{detail}");
        assert!(detail.contains("run.sh"), "{detail}");
        assert!(fix.unwrap().contains("go-w"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{CommandError, CommandOutput, FakeRunner};
    use crate::detect::NoGpus;
    use crate::fake::FakeGpus;
    use crate::sim::SimulatedGpus;
    use std::sync::Arc;

    struct Host {
        dir: tempfile::TempDir,
        runner: FakeRunner,
    }

    /// A host with bwrap, podman and cgroup v2; no NVIDIA hardware unless added.
    fn host() -> Host {
        let dir = tempfile::tempdir().unwrap();
        for d in ["dev", "cgroup", "pci"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        std::fs::write(dir.path().join("cgroup/cgroup.controllers"), "cpuset cpu io memory hugetlb pids rdma misc\n")
            .unwrap();
        let runner = FakeRunner::new();
        runner
            .on("bwrap --version", Ok(CommandOutput::ok("bubblewrap 0.9.0\n")))
            .on("podman info --format {{.Version.Version}}", Ok(CommandOutput::ok("4.9.3\n")));
        Host { dir, runner }
    }

    impl Host {
        fn opts(&self) -> DoctorOptions {
            let mounts = self.dir.path().join("mounts");
            std::fs::write(&mounts, "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,favordynmods 0 0\n").unwrap();
            DoctorOptions {
                dev_dir: self.dir.path().join("dev"),
                cgroup_root: self.dir.path().join("cgroup"),
                mounts_file: mounts,
                pci_devices_dir: self.dir.path().join("pci"),
                ..Default::default()
            }
        }
        fn add_nvidia_pci(&self) {
            let d = self.dir.path().join("pci/0000:18:00.0");
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("vendor"), "0x10de\n").unwrap();
            std::fs::write(d.join("class"), "0x030200\n").unwrap();
        }
        /// Four "H100"s whose device nodes are files in the temp dev dir.
        fn gpus(&self, driver: &str) -> Detection {
            let dev = self.dir.path().join("dev");
            for n in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
                std::fs::write(dev.join(n), "").unwrap();
            }
            let versions = Some((Version::parse(driver).unwrap(), Version::parse("12.2").unwrap()));
            let sim = SimulatedGpus::build("2xH100".parse().unwrap(), "h", &dev, versions).unwrap();
            // Through FakeGpus so doctor sees a real (non-simulated) backend kind.
            let gpus = sim.gpus().iter().cloned().map(|mut g| {
                g.simulated = false;
                g
            });
            Detection { backend: Arc::new(FakeGpus::new(gpus.collect())), fallback_reasons: vec![] }
        }
        fn status(&self, checks: &[DoctorCheck], name: &str) -> (CheckStatus, String) {
            let c = checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no check {name}"));
            (c.status, c.detail.clone())
        }
    }

    fn no_gpus() -> Detection {
        let reason =
            "NVML: loading NVML: libnvidia-ml.so: cannot open shared object file; nvidia-smi: command not found"
                .to_string();
        Detection { backend: Arc::new(NoGpus { reason: reason.clone() }), fallback_reasons: vec![reason] }
    }

    #[test]
    fn no_gpu_host_skips_gpu_checks_and_still_checks_the_rest() {
        let h = host();
        let checks = doctor(&h.opts(), &no_gpus(), &h.runner);
        let (s, d) = h.status(&checks, "gpu.inventory");
        assert_eq!(s, CheckStatus::Skip);
        assert!(d.starts_with("no NVIDIA GPU on this host (NVML: loading NVML"), "{d}");
        for name in ["gpu.driver", "gpu.nvidia_smi", "gpu.device_nodes"] {
            assert_eq!(h.status(&checks, name).0, CheckStatus::Skip, "{name}");
        }
        assert_eq!(h.status(&checks, "sandbox.bubblewrap"), (CheckStatus::Pass, "bubblewrap 0.9.0".into()));
        assert_eq!(h.status(&checks, "sandbox.cgroups").0, CheckStatus::Pass);
        assert_eq!(h.status(&checks, "container.runtime").1, "podman 4.9.3 answers");
        assert!(doctor_passed(&checks));
        assert!(!h.runner.calls().iter().any(|c| c.starts_with("nvidia-smi")), "no GPU: nvidia-smi not run");
    }

    #[test]
    fn crashed_driver_fails() {
        let h = host();
        h.add_nvidia_pci();
        h.runner.on("nvidia-smi", Ok(CommandOutput::failed(9, include_str!("../fixtures/crashed-driver.txt"), "")));
        let checks = doctor(&h.opts(), &no_gpus(), &h.runner);
        let (s, d) = h.status(&checks, "gpu.inventory");
        assert_eq!(s, CheckStatus::Fail);
        assert!(d.starts_with("NVIDIA PCI device 0000:18:00.0, but no GPU answers"), "{d}");
        let (s, d) = h.status(&checks, "gpu.nvidia_smi");
        assert_eq!(s, CheckStatus::Fail);
        assert!(d.contains("exit code 9") && d.contains("couldn't communicate with the NVIDIA driver"), "{d}");
        assert!(!doctor_passed(&checks));
    }

    #[test]
    fn healthy_gpu_host_passes() {
        let h = host();
        h.runner.on(
            "nvidia-smi --query-gpu=name --format=csv,noheader",
            Ok(CommandOutput::ok("NVIDIA H100 80GB HBM3\nNVIDIA H100 80GB HBM3\n")),
        );
        let opts = DoctorOptions { min_driver: Version::parse("535"), min_cuda: Version::parse("12.0"), ..h.opts() };
        let checks = doctor(&opts, &h.gpus("550.54.15"), &h.runner);
        assert!(checks.iter().all(|c| c.status == CheckStatus::Pass), "{}", format_table(&checks));
        assert_eq!(h.status(&checks, "gpu.inventory").1, "2 × NVIDIA H100 80GB HBM3 via fake");
        assert_eq!(h.status(&checks, "gpu.device_nodes").1, "4 node(s) readable and writable");
    }

    #[test]
    fn old_driver_and_cuda_fail_with_a_fix() {
        let h = host();
        let opts = DoctorOptions {
            min_driver: Version::parse("550"),
            min_cuda: Version::parse("12.4"),
            min_compute_capability: Some(ComputeCapability { major: 9, minor: 0 }),
            ..h.opts()
        };
        let checks = doctor(&opts, &h.gpus("535.104.05"), &h.runner);
        let c = checks.iter().find(|c| c.name == "gpu.driver").unwrap();
        // Shown as the driver writes it, leading zeros included.
        assert_eq!(
            (c.status, c.detail.as_str()),
            (CheckStatus::Fail, "driver 535.104.05 is older than the required 550")
        );
        assert_eq!(c.fix.as_deref(), Some("install NVIDIA driver 550 or newer"));
        assert_eq!(h.status(&checks, "gpu.cuda").0, CheckStatus::Fail);
        assert_eq!(h.status(&checks, "gpu.compute_capability").0, CheckStatus::Pass);
        assert!(!doctor_passed(&checks));
    }

    #[test]
    fn failing_probe_shows_the_last_lines() {
        let h = host();
        let long: String = (1..=20).map(|i| format!("line {i}\n")).collect();
        h.runner.on(
            "sh -c python -c 'import torch'",
            Ok(CommandOutput::failed(1, long, "ModuleNotFoundError: No module named 'torch'")),
        );
        h.runner.on("sh -c true", Ok(CommandOutput::ok("")));
        let opts = DoctorOptions {
            probes: vec![
                Probe { name: "torch".into(), command: "python -c 'import torch'".into() },
                Probe { name: "ok".into(), command: "true".into() },
            ],
            ..h.opts()
        };
        let checks = doctor(&opts, &no_gpus(), &h.runner);
        let (s, d) = h.status(&checks, "probe.torch");
        assert_eq!(s, CheckStatus::Fail);
        assert_eq!(d, "`python -c 'import torch'` exited 1:\nline 17\nline 18\nline 19\nline 20\nModuleNotFoundError: No module named 'torch'");
        assert_eq!(h.status(&checks, "probe.ok").0, CheckStatus::Pass);
        assert!(!doctor_passed(&checks));
        let table = format_table(&checks);
        assert!(table.contains("FAIL  probe.torch"), "{table}");
        assert!(table.contains("        line 20") || table.contains("line 20"), "{table}");
    }

    #[test]
    fn missing_sandbox_pieces_and_device_nodes() {
        let h = host();
        h.runner.on("bwrap --version", Err(CommandError::NotFound { program: "bwrap".into() }));
        std::fs::write(h.dir.path().join("cgroup/cgroup.controllers"), "cpu io\n").unwrap();
        let d = h.gpus("550.54.15");
        std::fs::remove_file(h.opts().dev_dir.join("nvidia-uvm")).unwrap();
        let checks = doctor(&h.opts(), &d, &h.runner);
        assert_eq!(h.status(&checks, "sandbox.bubblewrap").0, CheckStatus::Fail);
        assert!(h.status(&checks, "sandbox.cgroups").1.contains("lacks the memory, pids controller(s)"));
        assert!(h.status(&checks, "gpu.device_nodes").1.ends_with("dev/nvidia-uvm"));
        assert_eq!(h.status(&checks, "gpu.nvidia_smi").0, CheckStatus::Fail, "nvidia-smi missing on a GPU host");
    }

    #[test]
    fn simulated_inventory_warns_and_checks_its_device_files() {
        let h = host();
        let dev = h.opts().dev_dir;
        std::fs::write(dev.join("nvidia0"), "").unwrap();
        let sim = SimulatedGpus::build("1xL4".parse().unwrap(), "h", &dev, None).unwrap();
        let d = Detection { backend: Arc::new(sim), fallback_reasons: vec![] };
        let checks = doctor(&h.opts(), &d, &h.runner);
        let (s, detail) = h.status(&checks, "gpu.inventory");
        assert_eq!(
            (s, detail.as_str()),
            (CheckStatus::Warn, "SIMULATED, not real hardware: 1 × NVIDIA L4 via simulated")
        );
        assert_eq!(h.status(&checks, "gpu.device_nodes").0, CheckStatus::Pass);
        assert_eq!(h.status(&checks, "gpu.nvidia_smi").0, CheckStatus::Skip);
        assert!(doctor_passed(&checks));
        let json = serde_json::to_value(&checks[0]).unwrap();
        assert_eq!(json["status"], "warn");
    }
}

#[cfg(test)]
mod engine_tests {
    use super::*;
    use crate::{CommandOutput, FakeRunner};

    #[test]
    fn a_container_cli_without_its_daemon_is_a_warning_not_a_runtime() {
        let runner = FakeRunner::new();
        runner.on(
            "docker info --format {{.ServerVersion}}",
            Ok(CommandOutput::failed(1, "", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock.")),
        );
        let c = check_container_runtime(&DoctorOptions::default(), &runner);
        assert_eq!(c.status, CheckStatus::Warn);
        assert!(c.detail.contains("docker is installed but its engine does not answer"), "{}", c.detail);
        assert!(c.detail.contains("Cannot connect to the Docker daemon"), "{}", c.detail);
    }
}

#[cfg(test)]
mod cgroup_join_tests {
    use super::*;

    #[test]
    fn favordynmods_hint() {
        let without = "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n";
        let c = check_cgroup_join_latency(without);
        assert_eq!(c.status, CheckStatus::Warn);
        assert!(c.fix.unwrap().contains("remount,favordynmods /sys/fs/cgroup/unified"));
        let with = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,favordynmods 0 0\n";
        assert_eq!(check_cgroup_join_latency(with).status, CheckStatus::Pass);
        assert_eq!(check_cgroup_join_latency("proc /proc proc rw 0 0\n").status, CheckStatus::Skip);
    }
}
