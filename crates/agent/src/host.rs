//! What the agent sets up on its host before it connects: the data dir's lock and modes,
//! the root of job workspaces (and the start-up sweep of what a dead agent left there), a
//! root agent's slots (uids, networks, disks), the host's memory, and whether a container
//! engine answers. Effects only; every decision is in the modules they call.

use super::*;

/// A container CLI without a reachable engine (docker without dockerd) must not be advertised.
pub(crate) async fn engine_answers(rt: &gpuci_sandbox::ContainerRuntime) -> Result<(), String> {
    let run = tokio::process::Command::new(&rt.path).args(rt.engine.info_args()).kill_on_drop(true).output();
    match tokio::time::timeout(Duration::from_secs(10), run).await {
        Ok(Ok(o)) if o.status.success() => Ok(()),
        Ok(Ok(o)) => {
            Err(String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("engine did not answer").to_string())
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("`info` did not answer within 10s".into()),
    }
}

/// A root agent's slots: uids checked against the host's accounts, and a network namespace
/// per slot when steps get the slot network by default.
/// The slots of a root agent, and why they have no disks of their own when `--job-disk` asked
/// for them and they could not be made.
pub(crate) async fn make_slots(
    config: &Config,
    work_root: &std::path::Path,
) -> anyhow::Result<(Arc<slots::Slots>, Option<String>, u64)> {
    let lease = slots::lease(config.job_uids, config.slots).map_err(anyhow::Error::msg)?;
    let ids = slots::users_for(lease.range, config.slots).map_err(anyhow::Error::msg)?;
    let (lo, hi) = (lease.range.0, lease.range.0 + 2 * config.slots - 1);
    if let Some(name) = slots::account_in(lo, hi) {
        bail!("--job-uids {lo}-{hi}: the account {name:?} has a uid in that range; jobs need uids no account uses");
    }
    let mut networks = Vec::new();
    for s in &ids {
        if config.job_network != executor::JobNetwork::Slot {
            networks.push(None);
            continue;
        }
        let (owner, ports) = (s.network, config.job_host_ports.clone());
        let net = tokio::task::spawn_blocking(move || gpuci_sandbox::SlotNetwork::start(owner, &ports)).await?;
        match net {
            Ok(n) => networks.push(Some(n)),
            Err(e) => {
                // No silent host network: such jobs get none, and say so (executor).
                tracing::error!(error = %e, "no network namespace with egress for job slots: `network: default` steps get no network (see gpuci doctor)");
                networks.clear();
                networks.extend(ids.iter().map(|_| None));
                break;
            }
        }
    }
    let mut disks = Vec::new();
    let mut disk_problem = None;
    let images = config.data_dir.join("slot-disks");
    // A size the host can hold, measured with no image of an earlier run taking room.
    let size = if config.job_disk == 0 {
        Ok(0)
    } else {
        for e in std::fs::read_dir(&images).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().ends_with(".img") {
                let _ = std::fs::remove_file(e.path());
            }
        }
        disk::free_bytes(&images)
            .map_err(|e| format!("reading free space of {}: {e}", images.display()))
            .and_then(|free| disk::slot_disk_size(config.job_disk, free, config.min_free_disk, ids.len() as u32))
            .map(|(size, why)| {
                if let Some(why) = why {
                    tracing::warn!("{why}");
                }
                size
            })
    };
    if let Err(e) = &size {
        disk_problem = Some(format!("cannot make a disk for each job slot: {e}"));
    }
    let size = size.unwrap_or(0);
    if size > 0 {
        let t0 = std::time::Instant::now();
        for i in 0..ids.len() {
            let image = images.join(format!("slot-{i}.img"));
            let mount = work_root.join(format!("slot-{i}"));
            match tokio::task::spawn_blocking(move || gpuci_sandbox::SlotDisk::create(&image, &mount, size)).await? {
                Ok(d) => disks.push(Some(d)),
                Err(e) => {
                    disks.clear();
                    disk_problem = Some(format!("cannot make a disk for each job slot: {e}"));
                    break;
                }
            }
        }
        tracing::info!(slots = disks.len(), size, ms = t0.elapsed().as_millis() as u64, "slot disks ready");
    }
    disks.resize_with(ids.len(), || None);
    let (first, last) = (ids.first().map(|s| s.job.uid), ids.last().map(|s| s.network.uid));
    tracing::info!(slots = ids.len(), uids = ?(first, last), networks = networks.iter().filter(|n| n.is_some()).count(), "job slots ready");
    let size = if disks.iter().any(Option::is_some) { size } else { 0 };
    Ok((slots::Slots::new(Some(lease), ids.iter().map(|s| s.job).collect(), networks, disks), disk_problem, size))
}

/// Removes `job-*` and `ws-*` entries of the work root (never following links); how many.
pub(crate) fn sweep_workspaces(work_root: &std::path::Path) -> usize {
    let mut removed = 0;
    for e in std::fs::read_dir(work_root).into_iter().flatten().flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if (name.starts_with("job-") || name.starts_with("ws-")) && fstree::remove_tree(&e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Total memory of the host (`MemTotal` in /proc/meminfo), bytes.
pub(crate) fn host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 =
        text.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// Locks the data dir itself (`flock` on the directory, released when the process ends,
/// however it ends; a lock file could be deleted under a running agent) and writes this pid
/// to `<data_dir>/lock` for the next one to name; or says which process holds it.
pub(crate) fn lock_data_dir(data_dir: &std::path::Path) -> anyhow::Result<nix::fcntl::Flock<std::fs::File>> {
    let dir = std::fs::File::open(data_dir).with_context(|| format!("opening {}", data_dir.display()))?;
    let pid_file = data_dir.join("lock");
    match flock_patiently(dir) {
        Ok(held) => {
            std::fs::write(&pid_file, format!("{}\n", std::process::id()))
                .with_context(|| format!("writing {}", pid_file.display()))?;
            Ok(held)
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            let pid = std::fs::read_to_string(&pid_file).unwrap_or_default();
            bail!(
                "another agent (pid {}) uses the data dir {}: each agent needs a data dir of its own (--data-dir)",
                if pid.trim().is_empty() { "unknown" } else { pid.trim() },
                data_dir.display()
            )
        }
        Err((_, e)) => Err(anyhow::anyhow!("locking {}: {e}", data_dir.display())),
    }
}

/// `flock` (exclusive), retried for up to 3 s: an agent killed while one of its children was
/// between `fork` and `exec` (joining a cgroup can take a grace period there) leaves that child
/// holding the lock for some milliseconds, and a restart at once was refused. A live agent
/// holds it for good.
pub(crate) fn flock_patiently(
    f: std::fs::File,
) -> Result<nix::fcntl::Flock<std::fs::File>, (std::fs::File, nix::errno::Errno)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let mut f = f;
    loop {
        match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Err((back, nix::errno::Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                f = back;
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// What the agent keeps of jobs' files outside their workspaces: uploaded work trees, saved
/// caches, the slots' disk images (which hold every job's workspace, readable with `debugfs`).
/// The data dir may be 0711 (see [`root_work_dir`]), and these names are known to anyone: each
/// is 0700, so no other uid on the host reads a job's files through them.
pub(crate) fn private_dirs(data_dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    for name in ["uploads", "cache", "slot-disks"] {
        let d = data_dir.join(name);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&d)
            .with_context(|| format!("creating {}", d.display()))?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("setting mode 0700 on {}", d.display()))?;
    }
    Ok(())
}

/// Where a root agent keeps job workspaces. A job's bwrap runs as the job's uid and must
/// reach its workspace (`<root>/job-N`, 0700, the job user's), so every directory above it
/// must let other uids pass (`o+x`) without letting them list (`<root>` is 0711). The data
/// dir's `work` when that holds (the data dir itself is then made 0711: everything in it is
/// 0600/0700 of its own); else (a data dir under `/root` or inside the coordinator's 0700
/// data dir, as with `gpuci up`) `/var/lib/gpuci/work/<agent>`.
pub(crate) fn root_work_dir(data_dir: &std::path::Path, agent_tag: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let passable = |d: &std::path::Path| std::fs::metadata(d).is_ok_and(|m| m.mode() & 0o001 != 0);
    let dir = if data_dir.parent().is_some_and(|p| p.ancestors().all(passable)) {
        std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o711))
            .with_context(|| format!("setting mode 0711 on {}", data_dir.display()))?;
        data_dir.join("work")
    } else {
        let base = std::path::Path::new("/var/lib/gpuci/work");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o711)
            .create(base)
            .with_context(|| format!("creating {}", base.display()))?;
        for d in [std::path::Path::new("/var/lib/gpuci"), base] {
            let m = std::fs::symlink_metadata(d)?;
            if !m.is_dir() || m.uid() != 0 {
                bail!(
                    "{} must be a directory owned by root (it is not): refusing to keep job workspaces there",
                    d.display()
                );
            }
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711))?;
        }
        base.join(agent_tag)
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o711)
        .create(&dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))?;
    tracing::info!(dir = %dir.display(), "job workspaces");
    Ok(dir)
}
