//! `gpuci doctor`: is this host fit to be a GPU CI node? A pass/fail table with the fix for
//! each failure; `--json`; exit 1 when a check fails. On a host without GPUs it says so and
//! still checks the rest.

use crate::cli::{default_data_dir, DoctorArgs};
use crate::{CliError, CliResult};
use gpuci_core::gpu::{ComputeCapability, Version};
use gpuci_gpu::{doctor, doctor_passed, format_table, DetectOptions, DoctorOptions, Probe, SystemRunner};
use std::sync::Arc;

/// The coordinator's and the agent's data dirs (from the environment, else the defaults),
/// where they exist: they hold tokens, credentials and the database, and must be 0700.
fn data_dir_checks() -> Vec<gpuci_gpu::DoctorCheck> {
    let dir = |var: &str, name: &str| {
        std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| default_data_dir(name))
    };
    let mut out = Vec::new();
    for (check, path) in [
        ("files.data_dir", dir("GPUCI_DATA_DIR", "gpuci")),
        ("files.agent_data_dir", dir("GPUCI_AGENT_DATA_DIR", "gpuci-agent")),
    ] {
        if !path.is_dir() {
            continue;
        }
        let (status, detail, fix) = match gpuci_coordinator::datadir::exposed(&path) {
            None => (gpuci_gpu::CheckStatus::Pass, format!("{} is private to its owner", path.display()), None),
            Some(bits) => (
                gpuci_gpu::CheckStatus::Warn,
                format!("{} holds credentials but group/other have access (bits {bits:03o})", path.display()),
                Some(format!("chmod 700 {} (gpuci also does this when it next starts)", path.display())),
            ),
        };
        out.push(gpuci_gpu::DoctorCheck { name: check.into(), status, detail, fix });
    }
    out
}

pub async fn run(a: DoctorArgs) -> CliResult {
    let version = |s: &str, what: &str| {
        Version::parse(s)
            .ok_or_else(|| CliError::Input(format!("{what}: expected a version like 535 or 12.4, got {s:?}")))
    };
    let mut opts = DoctorOptions { min_driver: Some(version(&a.min_driver, "--min-driver")?), ..Default::default() };
    if let Some(c) = &a.min_cuda {
        opts.min_cuda = Some(version(c, "--min-cuda")?);
    }
    if let Some(cc) = &a.min_compute_capability {
        let v = version(cc, "--min-compute-capability")?;
        opts.min_compute_capability =
            Some(ComputeCapability { major: v.parts()[0], minor: v.parts().get(1).copied().unwrap_or(0) });
    }
    opts.probes = a.probes.into_iter().map(|(name, command)| Probe { name, command }).collect();
    let runner_checks = runner_install_checks(a.runner_dir.as_deref());
    let runner = Arc::new(SystemRunner);
    let checks = tokio::task::spawn_blocking(move || {
        let mut d = DetectOptions::new(gpuci_agent::hostname());
        d.simulate = a.simulate_gpus;
        d.runner = runner.clone();
        let detection = gpuci_gpu::detect(&d).map_err(|e| CliError::Input(e.to_string()))?;
        Ok::<_, CliError>(doctor(&opts, &detection, runner.as_ref()))
    })
    .await
    .map_err(anyhow::Error::from)??;
    let mut checks = checks;
    checks.extend(data_dir_checks());
    checks.extend(job_isolation_checks());
    checks.push(job_sandbox_check().await);
    checks.extend(runner_checks);
    let passed = doctor_passed(&checks);
    if a.json {
        let out = serde_json::json!({ "passed": passed, "checks": checks });
        println!("{}", serde_json::to_string_pretty(&out).map_err(anyhow::Error::from)?);
    } else {
        print!("{}", format_table(&checks));
        eprintln!(
            "{}",
            if passed {
                "doctor: this host can serve GPU CI jobs"
            } else {
                "doctor: some checks failed; see the fixes above"
            }
        );
    }
    Ok(if passed { 0 } else { 1 })
}

/// The Actions runner install GitHub runner pools use here: the one named, else the pools'
/// default when it exists. A host with neither serves no runner pool, which is fine.
fn runner_install_checks(named: Option<&std::path::Path>) -> Vec<gpuci_gpu::DoctorCheck> {
    let default = std::path::Path::new(gpuci_gpu::DEFAULT_RUNNER_DIR);
    match named {
        Some(dir) => gpuci_gpu::check_runner_install(dir),
        None if default.exists() => gpuci_gpu::check_runner_install(default),
        None => vec![gpuci_gpu::DoctorCheck {
            name: "runner.install".into(),
            status: gpuci_gpu::CheckStatus::Skip,
            detail: format!(
                "no Actions runner at {} and none named (--runner-dir): this host serves no GitHub runner pool",
                default.display()
            ),
            fix: None,
        }],
    }
}

/// What the privilege model needs on this host (docs/sandbox.md): a uid range no account
/// uses, user namespaces for unprivileged uids, and pasta for the slots' networks.
fn job_isolation_checks() -> Vec<gpuci_gpu::DoctorCheck> {
    use gpuci_gpu::{CheckStatus, DoctorCheck};
    let check = |name: &str, status, detail: String, fix: Option<String>| DoctorCheck {
        name: name.into(),
        status,
        detail,
        fix,
    };
    let mut out = Vec::new();
    let caps = gpuci_sandbox::detect();
    out.push(if caps.user_namespaces {
        check(
            "sandbox.user_namespaces",
            CheckStatus::Pass,
            "unprivileged uids may create user namespaces (each job's bwrap runs as the job's uid)".into(),
            None,
        )
    } else {
        check(
            "sandbox.user_namespaces",
            CheckStatus::Fail,
            "unprivileged user namespaces are off: bwrap cannot run as a job's uid, and the agent takes no jobs".into(),
            Some(
                "sysctl -w user.max_user_namespaces=15000 (and kernel.unprivileged_userns_clone=1 where it exists)"
                    .into(),
            ),
        )
    });
    if nix::unistd::geteuid().is_root() {
        // What a job's start does, not what the root cgroup offers: a nested cgroup can lack
        // the controllers its parent has.
        let own = gpuci_sandbox::own_limits();
        out.push(match gpuci_sandbox::probe_cgroups() {
            Ok(detail) => check("sandbox.job_cgroup", CheckStatus::Pass, detail, None),
            Err(e) if own.memory.is_some() => check(
                "sandbox.job_cgroup",
                CheckStatus::Warn,
                format!(
                    "no cgroup of its own can be made for a job ({e}); this container's limits ({}) bind the job of \
                     an agent started with --slots 1, whose steps may not ask for limits of their own unless it \
                     has --allow-unenforced-limits",
                    own.describe()
                ),
                Some("run the agent with --slots 1 here, or give it a delegated cgroup (a privileged pod, or a host service with Delegate=yes)".into()),
            ),
            Err(e) => check(
                "sandbox.job_cgroup",
                CheckStatus::Fail,
                format!("a job's cgroup cannot be made here, so the agent takes no jobs: {e}"),
                Some("run the agent as a systemd service with Delegate=yes, or start it in the root cgroup or a cgroup of its own whose parent delegates memory and pids".into()),
            ),
        });
        let (lo, hi) = first_job_uids();
        let used = gpuci_agent::slots::account_in(lo, hi);
        out.push(match used {
            None => check("sandbox.job_uids", CheckStatus::Pass, format!("uids {lo}-{hi} (the default --job-uids) belong to no account: jobs run as one of them per slot, never as root"), None),
            Some(name) => check("sandbox.job_uids", CheckStatus::Fail, format!("account {name:?} has a uid in {lo}-{hi}, the default --job-uids"), Some("start the agent with --job-uids START-END over uids no account uses (two per slot)".into())),
        });
    } else {
        out.push(check(
            "sandbox.job_uids",
            CheckStatus::Warn,
            format!(
                "not root: jobs will run as this uid ({}) inside a user namespace, with no network egress",
                nix::unistd::geteuid()
            ),
            Some("run the agent as root: each slot then gets its own unprivileged uid and network namespace".into()),
        ));
    }
    let pasta = caps.pasta.is_some();
    let tun =
        std::fs::metadata("/dev/net/tun").map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777);
    out.push(match (pasta, &tun) {
        (true, Ok(mode)) if mode & 0o006 == 0o006 => match slot_network_made() {
            Ok(()) => check(
                "sandbox.network",
                CheckStatus::Pass,
                "pasta and /dev/net/tun: each slot gets a network namespace with egress and no view of the host's loopback"
                    .into(),
                None,
            ),
            Err(e) => check(
                "sandbox.network",
                CheckStatus::Fail,
                format!("a slot's network namespace cannot be made here ({e}): `network: default` steps would get no network"),
                Some("in a container, the agent needs user namespaces and /dev/net/tun (see docs/sandbox.md and docs/providers/kubernetes.md)".into()),
            ),
        },
        (false, _) => check(
            "sandbox.network",
            CheckStatus::Fail,
            "pasta is not installed: `network: default` steps would get no network".into(),
            Some("apt-get install passt".into()),
        ),
        (true, Ok(mode)) => check(
            "sandbox.network",
            CheckStatus::Fail,
            format!("/dev/net/tun is mode {mode:03o}: pasta, running as a slot's unprivileged uid, cannot open it"),
            Some("chmod 0666 /dev/net/tun (Debian's udev rule does this; minimal VMs and containers lack it)".into()),
        ),
        (true, Err(e)) => check(
            "sandbox.network",
            CheckStatus::Fail,
            format!("/dev/net/tun: {e}"),
            Some("load the tun module (modprobe tun)".into()),
        ),
    });
    out.push(if nix::unistd::geteuid().is_root() {
        // Made for real, as the agent makes each slot's: a small one, gone at once.
        let probe = tempfile::Builder::new().prefix("gpuci-doctor-disk-").tempdir();
        let made = probe.as_ref().map_err(|e| e.to_string()).and_then(|d| {
            gpuci_sandbox::SlotDisk::create(&d.path().join("probe.img"), &d.path().join("mnt"), 16 << 20).map(drop)
        });
        match made {
            Ok(()) => check(
                "sandbox.job_disk",
                CheckStatus::Pass,
                "loop devices and mkfs.ext4: each slot gets a disk of its own (--job-disk), a job cannot fill the host's"
                    .into(),
                None,
            ),
            Err(e) => check(
                "sandbox.job_disk",
                CheckStatus::Fail,
                format!("a slot disk cannot be made ({e}): the agent takes no jobs unless started with --job-disk none"),
                Some("apt-get install e2fsprogs; give the agent loop devices (modprobe loop; in a container, /dev/loop-control)".into()),
            ),
        }
    } else {
        check(
            "sandbox.job_disk",
            CheckStatus::Warn,
            "not root: no disk quota, jobs share the agent's disk".into(),
            Some("run the agent as root: each slot then gets a disk of its own (--job-disk)".into()),
        )
    });
    out
}

/// The default job uids an agent here would lease first: the host's high block, or in a
/// user namespace (a pod with `hostUsers: false`) a block inside what it maps.
fn first_job_uids() -> (u32, u32) {
    let map = std::fs::read_to_string("/proc/self/uid_map").unwrap_or_default();
    match gpuci_agent::slots::default_blocks(&map).first() {
        Some(&start) => (start, start + gpuci_agent::slots::BLOCK - 1),
        None => gpuci_agent::slots::DEFAULT_JOB_UIDS,
    }
}

/// A real job sandbox, started as the agent starts its probe (`gpuci_agent::probe`): as a
/// job uid when root, with a cgroup and limits where they can be made. The check that counts:
/// the parts above can each pass while the whole fails (a masked /proc in a pod).
async fn job_sandbox_check() -> gpuci_gpu::DoctorCheck {
    use gpuci_gpu::{CheckStatus, DoctorCheck};
    let root = nix::unistd::geteuid().is_root();
    let result = async {
        let dir = tempfile::Builder::new().prefix("gpuci-doctor-sandbox-").tempdir().map_err(|e| e.to_string())?;
        // The job uid must be able to reach its workspace inside.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711))
            .map_err(|e| e.to_string())?;
        // A job uid leased like an agent's (held until the probe ends): never one a running
        // agent's job is using, and never swept by an agent starting meanwhile.
        let lease = if root { Some(gpuci_agent::slots::lease(None, 1)?) } else { None };
        let user = match &lease {
            Some(l) => Some(gpuci_agent::slots::users_for(l.range, 1)?[0].job),
            None => None,
        };
        let cgroups = if root && gpuci_sandbox::probe_cgroups().is_ok() {
            gpuci_sandbox::CgroupUse::Required
        } else {
            gpuci_sandbox::CgroupUse::Auto
        };
        gpuci_agent::probe::job_sandbox(gpuci_agent::probe::ProbeSpec {
            user,
            network: None,
            cgroups,
            work_root: dir.path(),
        })
        .await
    }
    .await;
    match result {
        Ok(detail) => DoctorCheck { name: "sandbox.job_sandbox".into(), status: CheckStatus::Pass, detail, fix: None },
        Err(e) => {
            let (detail, fix) = match e.split_once("; fix: ") {
                Some((d, f)) => (d.to_string(), Some(f.to_string())),
                None => (e, None),
            };
            DoctorCheck {
                name: "sandbox.job_sandbox".into(),
                status: CheckStatus::Fail,
                detail: format!("{detail}: the agent takes no jobs (unless started with --allow-unsandboxed, for trusted jobs only)"),
                fix,
            }
        }
    }
}

/// A slot's network made for real, as the agent makes each (root only; an agent that is not
/// root gives its jobs none): on uids leased like an agent's, so a running agent's are never
/// touched, and gone at once.
fn slot_network_made() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    let lease = gpuci_agent::slots::lease(None, 1)?;
    let ids = gpuci_agent::slots::users_for(lease.range, 1)?;
    let net = gpuci_sandbox::SlotNetwork::start(ids[0].network, &[]).map_err(|e| e.to_string())?;
    drop(net);
    Ok(())
}
