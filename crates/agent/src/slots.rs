//! Job slots: the unprivileged identity and network each running job gets.
//!
//! A root agent is given a range of host uids no account uses (`--job-uids START-END`,
//! default [`DEFAULT_JOB_UIDS`]). Slot `i` runs its jobs as `START + 2i` and its network
//! namespace is owned by `START + 2i + 1` (its holder and `pasta` run as that uid; gids are
//! the same numbers). A job is the only process of its uid while it runs, so it cannot
//! signal, trace or read another job's processes, and every file it leaves is its own. The
//! network uid is not the job's: the kernel gives the owner of a network namespace's user
//! namespace write access to that namespace's `net.*` sysctls, which a job could otherwise
//! change for the next job of its slot.
//!
//! One owner: the pool below is shared by job tasks, which take a slot for a job's whole run
//! (workspace set-up to cleanup) and give it back by dropping the guard.
//!
//! An idle slot may hold a warm start (`gpuci_sandbox::WarmStart`): its next job's first
//! process, already in its cgroup, network and uid, prepared after the slot's last job was
//! cleaned up. Only the job that takes the slot takes it, so it never exists beside another
//! job of the slot's uid.

use std::sync::{Arc, Mutex};

use gpuci_sandbox::{JobUser, SlotDisk, SlotNetwork, WarmSpec, WarmStart};
use tokio::task::JoinHandle;

/// A slot's warm start, ready or still being prepared.
type WarmCell = Mutex<Option<JoinHandle<Option<WarmStart>>>>;

/// Where default job uids come from: high enough to miss the usual account and `/etc/subuid`
/// ranges (100000–165535 for the first user, 65536 per user after it). Each agent leases one
/// block of [`BLOCK`] uids from here (the first free one; see [`lease`]); the first block is
/// what `gpuci doctor` checks against the host's accounts.
pub const DEFAULT_JOB_UIDS: (u32, u32) = (1_500_000_000, 1_500_000_000 + BLOCK - 1);
/// uids per default block: 128 slots.
pub const BLOCK: u32 = 256;
/// Default blocks tried before giving up (agents on one host).
const BLOCKS: u32 = 1024;
/// How long an explicit range held by another lock waits: the reaper of the agent that had
/// it (`crate::reaper`) keeps killing for up to 10 s.
const REAPER_GRACE: std::time::Duration = std::time::Duration::from_secs(15);
/// Where the uid locks live (see [`try_lock`]).
const LOCK_DIR: &str = "/run/gpuci-sandbox/uids";

/// A held lease on a uid range: no other agent on this host uses these uids while it lives.
/// Two agents with one range would run jobs as the same uids and kill each other's slot
/// networks. Each uid the slots use is locked on its own, so ranges that only overlap are
/// caught as surely as equal ones; and whatever a dead predecessor left running as these
/// uids is ended before the lease is handed out.
#[derive(Debug)]
pub struct UidLease {
    pub range: (u32, u32),
    /// The uids locked: each slot's job and network uid.
    uids: Vec<u32>,
    _locks: Vec<nix::fcntl::Flock<std::fs::File>>,
}

impl UidLease {
    /// Every uid the lease covers.
    pub fn uids(&self) -> &[u32] {
        &self.uids
    }

    /// Copies of the lock files' descriptors, for the agent's reaper to hold and hand on (see
    /// `reaper`): open for as long as it keeps them, whenever this lease drops.
    pub fn lock_fds(&self) -> std::io::Result<Vec<std::os::fd::OwnedFd>> {
        use std::os::fd::AsFd;
        self._locks.iter().map(|l| l.as_fd().try_clone_to_owned()).collect()
    }
}

/// Lock files, one per job or network uid in use, held (`flock`) for the agent's life. A lock
/// file's name is its uid (the first uid of a block, as agents that locked whole blocks
/// named theirs).
fn try_lock(uid: u32) -> Result<Option<nix::fcntl::Flock<std::fs::File>>, String> {
    let path = format!("{LOCK_DIR}/{uid}.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("opening {path}: {e}"))?;
    match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(Some(l)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(format!("locking {path}: {e}")),
    }
}

/// Why a range could not be leased.
enum Refused {
    /// Another live agent holds one of its uids.
    Held(u32),
    /// Processes left by a dead agent run as its uids and could not be ended.
    Occupied(String),
    Failed(String),
}

/// Locks every uid `slots` slots use in `range`, then ends what runs as them.
fn take(range: (u32, u32), slots: u32) -> Result<UidLease, Refused> {
    let uids: Vec<u32> =
        users_for(range, slots).map_err(Refused::Failed)?.iter().flat_map(|s| [s.job.uid, s.network.uid]).collect();
    let mut locks = Vec::with_capacity(uids.len());
    for &uid in &uids {
        match try_lock(uid).map_err(Refused::Failed)? {
            Some(l) => locks.push(l),
            None => return Err(Refused::Held(uid)),
        }
    }
    match gpuci_sandbox::end_processes_of(&uids, std::time::Duration::from_secs(5)) {
        Ok(0) => {}
        Ok(n) => tracing::warn!(
            processes = n,
            uids = %format!("{}-{}", range.0, range.0 + 2 * slots - 1),
            "killed processes an earlier agent left running as these job uids"
        ),
        Err(left) => {
            let list: Vec<String> = left.iter().take(8).map(|(pid, uid)| format!("pid {pid} (uid {uid})")).collect();
            return Err(Refused::Occupied(format!(
                "processes left by an earlier agent still run as these job uids and could not be ended: {}{}; \
                 a job must be the only process of its uid",
                list.join(", "),
                if left.len() > 8 { format!(" and {} more", left.len() - 8) } else { String::new() }
            )));
        }
    }
    Ok(UidLease { range, uids, _locks: locks })
}

/// Leases `explicit` (`--job-uids`), or else the first free default block.
pub fn lease(explicit: Option<(u32, u32)>, slots: u32) -> Result<UidLease, String> {
    use std::os::unix::fs::DirBuilderExt;
    // The parent is where job users find the /etc view: passable by all, not 0700 as a
    // recursive create with the lock dir's mode would leave it on a fresh host.
    gpuci_sandbox::ensure_run_dir(std::path::Path::new(gpuci_sandbox::RUN_DIR))
        .map_err(|e| format!("preparing {}: {e}", gpuci_sandbox::RUN_DIR))?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(LOCK_DIR)
        .map_err(|e| format!("creating {LOCK_DIR}: {e}"))?;
    let uid_map = std::fs::read_to_string("/proc/self/uid_map").unwrap_or_default();
    if let Some(range) = explicit {
        users_for(range, slots)?;
        if !mapped(&uid_map, range) {
            return Err(format!(
                "--job-uids {}-{}: not all of these uids exist in this user namespace (/proc/self/uid_map: {}); \
                 a pod with hostUsers: false maps 0-65535: give a range inside it",
                range.0,
                range.1,
                uid_map.split_whitespace().collect::<Vec<_>>().join(" ")
            ));
        }
        // The reaper of an agent that just ended on these uids holds them while it sweeps
        // (seconds at most): wait for it rather than refuse a restart.
        let deadline = std::time::Instant::now() + REAPER_GRACE;
        let mut taken = take(range, slots);
        while matches!(taken, Err(Refused::Held(_))) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(100));
            taken = take(range, slots);
        }
        return taken.map_err(|why| match why {
            Refused::Held(uid) => format!(
                "--job-uids {}-{}: another agent on this host holds uid {uid} of these; give each agent its own range",
                range.0, range.1
            ),
            Refused::Occupied(e) => format!("--job-uids {}-{}: {e}", range.0, range.1),
            Refused::Failed(e) => e,
        });
    }
    if 2 * slots > BLOCK {
        return Err(format!(
            "{slots} slots need {} uids, more than a default block of {BLOCK}: give --job-uids",
            2 * slots
        ));
    }
    let starts = default_blocks(&uid_map);
    if starts.is_empty() {
        return Err(format!(
            "this user namespace maps no block of {BLOCK} uids the agent could give its jobs (/proc/self/uid_map: {}): \
             give --job-uids",
            uid_map.split_whitespace().collect::<Vec<_>>().join(" ")
        ));
    }
    let mut occupied = Vec::new();
    for &start in &starts {
        match take((start, start + BLOCK - 1), slots) {
            Ok(lease) => return Ok(lease),
            Err(Refused::Held(_)) => {}
            Err(Refused::Occupied(e)) => {
                // Never run jobs beside such a process; another block may be clean.
                tracing::error!(block = start, "{e}");
                occupied.push(format!("{start}-{}: {e}", start + BLOCK - 1));
            }
            Err(Refused::Failed(e)) => return Err(e),
        }
    }
    if occupied.is_empty() {
        Err(format!("all {} default blocks of job uids are held by other agents: give --job-uids", starts.len()))
    } else {
        Err(format!("no default block of job uids is free and clean: {}", occupied.join("; ")))
    }
}

/// `(inside start, count)` of each line of a `uid_map` (`inside outside count`).
fn map_ranges(uid_map: &str) -> Vec<(u64, u64)> {
    uid_map
        .lines()
        .filter_map(|l| {
            let f: Vec<u64> = l.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            (f.len() == 3).then(|| (f[0], f[2]))
        })
        .collect()
}

/// Whether every uid of `range` exists in the user namespace `uid_map` describes: a job
/// uid outside it cannot be switched to (`setuid` fails with EINVAL).
pub fn mapped(uid_map: &str, range: (u32, u32)) -> bool {
    let (lo, hi) = (u64::from(range.0), u64::from(range.1));
    map_ranges(uid_map).iter().any(|&(start, count)| start <= lo && hi < start + count)
}

/// The default blocks of job uids to try, in order, for a process in the user namespace
/// `uid_map` describes. On a host (the initial namespace maps every uid) and in namespaces
/// that map them, the blocks from [`DEFAULT_JOB_UIDS`] up. In a smaller namespace (a pod with
/// `hostUsers: false` maps 0-65535) blocks from the top of its ranges down, above the system
/// and first user accounts (uid 1000) and clear of 65534/65535 (nobody, the overflow uid).
/// The agent checks the chosen block against the image's accounts (`account_in`) at start.
pub fn default_blocks(uid_map: &str) -> Vec<u32> {
    let block = u64::from(BLOCK);
    let high: Vec<u32> =
        (0..BLOCKS).map(|i| DEFAULT_JOB_UIDS.0 + i * BLOCK).filter(|&s| mapped(uid_map, (s, s + BLOCK - 1))).collect();
    if !high.is_empty() {
        return high;
    }
    let mut out = Vec::new();
    for (start, count) in map_ranges(uid_map) {
        let end = (start + count).min(u64::from(u32::MAX)); // exclusive
        let mut top = end / block * block;
        while top >= block && top - block >= start.max(1000) && out.len() < BLOCKS as usize {
            let lo = top - block;
            top -= block;
            if lo <= 65535 && lo + block > 65534 {
                continue;
            }
            out.push(lo as u32);
        }
    }
    out
}

/// Parses `START-END` (inclusive).
pub fn parse_uid_range(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s.split_once('-').ok_or_else(|| format!("{s:?}: expected START-END, e.g. 200000-200063"))?;
    let start: u32 = a.trim().parse().map_err(|e| format!("{s:?}: start {a:?}: {e}"))?;
    let end: u32 = b.trim().parse().map_err(|e| format!("{s:?}: end {b:?}: {e}"))?;
    if start == 0 || end < start {
        return Err(format!("{s:?}: need 0 < START <= END"));
    }
    if end == u32::MAX {
        return Err(format!("{s:?}: {end} is the kernel's invalid uid"));
    }
    // bubblewrap takes uids as signed ints: one of 2^31 or more cannot be mapped into a job's
    // user namespace, and the agent would find no working sandbox (outsider finding).
    if end > i32::MAX as u32 {
        return Err(format!("{s:?}: job uids must be below 2147483648 (bubblewrap cannot map {end})"));
    }
    Ok((start, end))
}

/// The name of an account in `/etc/passwd` whose uid lies in `lo..=hi`: such uids cannot
/// be job uids (the job would be that account). Read by the agent at start and by doctor.
pub fn account_in(lo: u32, hi: u32) -> Option<String> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        let uid: u32 = f.nth(1)?.parse().ok()?;
        (lo..=hi).contains(&uid).then(|| name.to_string())
    })
}

/// One slot's identities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotIds {
    /// The job's uid and gid.
    pub job: JobUser,
    /// Owner of the slot's network namespace.
    pub network: JobUser,
}

/// Each slot's uids, from the range.
pub fn users_for(range: (u32, u32), slots: u32) -> Result<Vec<SlotIds>, String> {
    let have = u64::from(range.1 - range.0) + 1;
    if have < 2 * u64::from(slots) {
        return Err(format!(
            "--job-uids {}-{} has {have} uids; {slots} slots need {} (two per slot: the job's and its network's)",
            range.0,
            range.1,
            2 * slots
        ));
    }
    let user = |uid| JobUser { uid, gid: uid };
    Ok((0..slots).map(|i| SlotIds { job: user(range.0 + 2 * i), network: user(range.0 + 2 * i + 1) }).collect())
}

/// The slots of a root agent.
#[derive(Debug)]
pub struct Slots {
    /// Held while the slots exist.
    _lease: Option<UidLease>,
    users: Vec<JobUser>,
    /// Per slot: its network namespace, when the agent made them.
    networks: Vec<Option<SlotNetwork>>,
    /// Per slot: its own disk (the job's disk quota), when the agent made them.
    disks: Vec<Option<SlotDisk>>,
    /// Per slot: the warm start waiting for its next job.
    warm: Vec<WarmCell>,
    free: Mutex<Vec<usize>>,
}

impl Slots {
    pub fn new(
        lease: Option<UidLease>,
        users: Vec<JobUser>,
        networks: Vec<Option<SlotNetwork>>,
        disks: Vec<Option<SlotDisk>>,
    ) -> Arc<Slots> {
        let free = (0..users.len()).rev().collect();
        let warm = users.iter().map(|_| Mutex::new(None)).collect();
        Arc::new(Slots { _lease: lease, users, networks, disks, warm, free: Mutex::new(free) })
    }

    /// The uid lease the slots hold, if any.
    pub fn lease(&self) -> Option<&UidLease> {
        self._lease.as_ref()
    }

    /// The first slot's job uid.
    pub fn first_uid(&self) -> u32 {
        self.users.first().map_or(0, |u| u.uid)
    }

    /// Ends every slot's warm start and removes its cgroup (the agent is stopping).
    pub async fn discard_warm(&self) {
        for cell in &self.warm {
            let pending = cell.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(Ok(Some(w))) = match pending {
                Some(p) => Some(p.await),
                None => None,
            } {
                w.discard().await;
            }
        }
    }

    /// A free slot, or `None` when every slot is running a job (the coordinator places no
    /// more jobs than slots, so this is a bug or a race with a job still cleaning up).
    pub fn take(self: &Arc<Self>) -> Option<SlotGuard> {
        let index = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
        Some(SlotGuard { slots: self.clone(), index, metadata_allowed: Default::default() })
    }
}

/// A slot held for one job; given back on drop.
#[derive(Debug)]
pub struct SlotGuard {
    slots: Arc<Slots>,
    index: usize,
    /// The job may reach cloud metadata services (`allow_metadata`): the refusal is put back
    /// before the slot is.
    metadata_allowed: std::sync::atomic::AtomicBool,
}

impl SlotGuard {
    pub fn user(&self) -> JobUser {
        self.slots.users[self.index]
    }

    pub fn network(&self) -> Option<&SlotNetwork> {
        self.slots.networks.get(self.index).and_then(Option::as_ref)
    }

    /// The slot's own disk, where its job's workspace goes.
    pub fn disk(&self) -> Option<&SlotDisk> {
        self.slots.disks.get(self.index).and_then(Option::as_ref)
    }

    pub fn index(&self) -> usize {
        self.index
    }

    /// Lets this slot's job reach cloud metadata services (a trusted job on an agent started
    /// with `--allow-metadata-trusted`). The refusal comes back when the guard is dropped,
    /// after the job's processes are gone; a slot where it cannot is never given out again.
    pub fn allow_metadata(&self) -> Result<(), String> {
        let Some(net) = self.network() else { return Err("the slot has no network namespace".into()) };
        self.metadata_allowed.store(true, std::sync::atomic::Ordering::SeqCst);
        net.set_metadata(true).map_err(|e| e.to_string())
    }

    /// The warm start prepared for this slot's next job, once ready (`None`: there is none, or
    /// preparing it failed; the job then starts cold).
    pub async fn take_warm(&self) -> Option<WarmStart> {
        let pending = self.slots.warm[self.index].lock().unwrap_or_else(|e| e.into_inner()).take()?;
        pending.await.ok().flatten()
    }

    /// Starts preparing a warm start for the slot's next job. Call only once the slot's job
    /// is gone (its processes killed), before giving the slot back.
    pub fn prepare_warm(&self, spec: WarmSpec) {
        let task = tokio::spawn(async move {
            match WarmStart::prepare(spec).await {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!(error = %e, "could not prepare a warm start; the slot's next job starts cold");
                    None
                }
            }
        });
        let old = self.slots.warm[self.index].lock().unwrap_or_else(|e| e.into_inner()).replace(task);
        if let Some(old) = old {
            tokio::spawn(async move {
                if let Ok(Some(w)) = old.await {
                    w.discard().await;
                }
            });
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if self.metadata_allowed.load(std::sync::atomic::Ordering::SeqCst) {
            if let Some(Err(e)) = self.network().map(|n| n.set_metadata(false)) {
                // Never a silent hole: the slot leaves service rather than run an untrusted
                // job where the metadata service answers.
                tracing::error!(slot = self.index, error = %e, "could not refuse cloud metadata again; this slot takes no more jobs");
                return;
            }
        }
        self.slots.free.lock().unwrap_or_else(|e| e.into_inner()).push(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_agents_never_lease_the_same_uids() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: leases live in /run (root)");
            return;
        }
        let a = lease(None, 4).expect("a block");
        let b = lease(None, 4).expect("another block");
        assert_ne!(a.range, b.range, "a second agent got the first one's uids");
        let e = lease(Some(a.range), 4).expect_err("an explicit range someone holds");
        assert!(e.contains("another agent"), "{e}");
        let start = a.range.0;
        drop(a);
        assert!(lease(Some((start, start + 7)), 4).is_ok(), "free again once its agent is gone");
    }

    /// A free range for the tests below: explicit, so it never meets a default block a
    /// running agent (another test's) holds.
    fn test_range(n: u32) -> (u32, u32) {
        let start = 3_000_000_000 + (std::process::id() % 10_000) * 1_024 + n * 128;
        (start, start + 63)
    }

    #[test]
    fn an_agent_ends_what_a_dead_agent_left_running_on_its_uids() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var("CI").is_err(), "CI=true: this test needs root (job uids)");
            eprintln!("SKIP: job uids need root");
            return;
        }
        use std::os::unix::process::CommandExt;
        let range = test_range(0);
        let first = lease(Some(range), 4).expect("a free range");
        // What a killed agent's job (or warm start) left: a process of a slot's job uid and
        // one of a slot's network uid, still running once the agent's lease is gone; and one
        // whose main thread has exited while another thread runs on (its status reads
        // `State: Z`, an outsider's way of hiding a spy from the sweep).
        let mut left: Vec<_> = [range.0 + 2, range.0 + 5]
            .iter()
            .map(|&uid| std::process::Command::new("sleep").arg("300").uid(uid).gid(uid).spawn().expect("sleep"))
            .collect();
        let hidden = std::process::Command::new("python3")
            .args([
                "-c",
                "import ctypes, threading, time\n\
                 threading.Thread(target=lambda: time.sleep(300)).start()\n\
                 ctypes.CDLL(None).pthread_exit(None)",
            ])
            .uid(range.0)
            .gid(range.0)
            .spawn()
            .expect("python3");
        let status = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        for _ in 0..200 {
            if status(hidden.id()).contains("State:\tZ") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(status(hidden.id()).contains("Threads:\t2"), "{}", status(hidden.id()));
        left.push(hidden);
        drop(first);
        let second = lease(Some(range), 4).expect("the range is free again");
        for child in &mut left {
            // The lease returns once they are gone: reaped or a zombie, never running.
            let gone = match child.try_wait() {
                Ok(Some(_)) => true,
                _ => std::fs::read_to_string(format!("/proc/{}/status", child.id()))
                    .map(|s| {
                        s.lines().any(|l| l.starts_with("State:") && l.contains('Z'))
                            && s.lines().any(|l| l.starts_with("Threads:") && l.trim_end().ends_with('1'))
                    })
                    .unwrap_or(true),
            };
            let _ = child.kill();
            let _ = child.wait();
            assert!(gone, "pid {} of an earlier agent still runs as a job uid the new agent leased", child.id());
        }
        drop(second);
    }

    /// A dead agent's leftovers frozen in their cgroup (the agent was killed between freezing
    /// a job's cgroup to end it and thawing it): SIGKILL alone does not end a frozen process,
    /// so a new agent that leased those uids gave up on them after 5 s (a CI failure: a warm
    /// start's `sleep` frozen for 43 minutes). The sweep thaws them and they end.
    #[test]
    fn an_agent_ends_a_dead_agents_leftovers_even_when_they_are_frozen() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var("CI").is_err(), "CI=true: this test needs root (job uids)");
            eprintln!("SKIP: job uids need root");
            return;
        }
        use std::os::unix::process::CommandExt;
        let v1 = std::path::Path::new("/sys/fs/cgroup/freezer");
        let (dir, freeze, frozen, thawed) = if v1.join("freezer.state").exists() || v1.is_dir() {
            (v1.join(format!("gpuci-test-frozen-{}", std::process::id())), "freezer.state", "FROZEN", "THAWED")
        } else {
            let root = std::path::Path::new("/sys/fs/cgroup");
            (root.join(format!("gpuci-test-frozen-{}", std::process::id())), "cgroup.freeze", "1", "0")
        };
        if std::fs::create_dir_all(&dir).is_err() {
            assert!(std::env::var("CI").is_err(), "CI=true: this test needs a freezer cgroup");
            eprintln!("SKIP: no freezer cgroup here");
            return;
        }
        let range = test_range(2);
        let first = lease(Some(range), 4).expect("a free range");
        let mut child =
            std::process::Command::new("sleep").arg("300").uid(range.0 + 2).gid(range.0 + 2).spawn().expect("sleep");
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).expect("into the cgroup");
        std::fs::write(dir.join(freeze), frozen).expect("frozen");
        drop(first);
        let second = lease(Some(range), 4);
        let gone = matches!(child.try_wait(), Ok(Some(_)))
            || std::fs::read_to_string(format!("/proc/{}/status", child.id()))
                .map(|s| s.lines().any(|l| l.starts_with("State:") && l.contains('Z')))
                .unwrap_or(true);
        let _ = std::fs::write(dir.join(freeze), thawed);
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir(&dir);
        assert!(second.is_ok(), "the uids were refused: {:?}", second.err());
        assert!(gone, "the frozen leftover still runs as a job uid the new agent leased");
    }

    #[test]
    fn overlapping_ranges_are_never_leased_twice() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var("CI").is_err(), "CI=true: this test needs root (job uids)");
            eprintln!("SKIP: leases live in /run (root)");
            return;
        }
        let (lo, hi) = test_range(1);
        let a = lease(Some((lo, hi)), 32).expect("a free range");
        // Another agent's range starting inside the first one's: slot 0 of the second would
        // run its jobs as slot 16 of the first.
        let e = lease(Some((lo + 32, hi + 32)), 16).expect_err("an overlapping range");
        assert!(e.contains("another agent"), "{e}");
        drop(a);
        assert!(lease(Some((lo + 32, hi + 32)), 16).is_ok(), "free once the first agent is gone");
    }

    #[test]
    fn job_uids_come_from_what_the_user_namespace_maps() {
        let host = "         0          0 4294967295\n";
        assert_eq!(default_blocks(host)[0], DEFAULT_JOB_UIDS.0, "a host keeps the high blocks");
        // A pod with hostUsers: false: 0-65535 only. The 1.5e9 uids do not exist there, and
        // setuid to them failed, so the agent took no jobs.
        let pod = "         0     100000      65536\n";
        let blocks = default_blocks(pod);
        assert_eq!(blocks[0], 65536 - 2 * BLOCK, "the top block holds nobody (65534): skipped");
        assert!(blocks.iter().all(|&b| b >= 1000 && u64::from(b) + u64::from(BLOCK) <= 65534), "{blocks:?}");
        assert!(blocks.iter().all(|&b| mapped(pod, (b, b + BLOCK - 1))));
        assert!(!mapped(pod, DEFAULT_JOB_UIDS), "the host default is not in the pod");
        assert!(mapped(pod, (60000, 60063)));
        // Two ranges, one too small for a block.
        let split = "0 100000 1000\n5000 200000 600\n";
        assert_eq!(default_blocks(split), vec![5120], "only 5120-5375 fits in 5000-5599 above 1000");
        assert!(default_blocks("0 100000 1\n").is_empty(), "a single-uid namespace has no room");
        assert!(default_blocks("").is_empty());
    }

    #[test]
    fn ranges_parse_and_give_one_network_owner_and_one_uid_per_slot() {
        assert_eq!(parse_uid_range("200000-200063"), Ok((200000, 200063)));
        for bad in ["", "5", "0-10", "10-5", "a-b", "1-4294967295", "2700000000-2700000063"] {
            assert!(parse_uid_range(bad).is_err(), "{bad}");
        }
        let ids = users_for((200000, 200007), 4).expect("8 uids for 4 slots");
        assert_eq!(ids.iter().map(|s| s.job.uid).collect::<Vec<_>>(), vec![200000, 200002, 200004, 200006]);
        assert_eq!(ids.iter().map(|s| s.network.uid).collect::<Vec<_>>(), vec![200001, 200003, 200005, 200007]);
        assert!(users_for((200000, 200006), 4).is_err(), "7 uids are one short for 4 slots");
    }

    #[test]
    fn a_slot_is_held_by_one_job_at_a_time() {
        let ids = users_for((300000, 300003), 2).expect("range");
        let slots = Slots::new(None, ids.iter().map(|s| s.job).collect(), vec![None, None], vec![None, None]);
        let a = slots.take().expect("first");
        let b = slots.take().expect("second");
        assert_ne!(a.user(), b.user());
        assert!(slots.take().is_none(), "both slots are held");
        let uid = a.user().uid;
        drop(a);
        assert_eq!(slots.take().map(|g| g.user().uid), Some(uid), "given back on drop");
    }
}
