//! Tools for the chaos test (`tests/chaos.rs`): a seeded random source whose seed is printed
//! so a schedule can be replayed, process stderr sent to files (hundreds of jobs and a dozen
//! restarts would bury the test's own report; the files are read back when explaining a
//! failure), and a reaper for the job processes a run leaves behind.
#![allow(dead_code)]

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// splitmix64: small, good enough to pick kill moments, and the same sequence for the same
/// seed on every machine (timing still differs, so a replay is close, not identical).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// A duration between `lo_ms` and `hi_ms`.
    pub fn millis(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        Duration::from_millis(lo_ms + self.below(hi_ms - lo_ms + 1))
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// `GPUCI_CHAOS_SEED` when set, else one from the clock.
pub fn seed_from_env() -> u64 {
    match std::env::var("GPUCI_CHAOS_SEED") {
        Ok(s) => s.trim().parse().unwrap_or_else(|e| panic!("GPUCI_CHAOS_SEED={s:?}: {e}")),
        Err(_) => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64,
    }
}

/// A count from the environment, or `default`.
pub fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(s) => s.trim().parse().unwrap_or_else(|e| panic!("{name}={s:?}: {e}")),
        Err(_) => default,
    }
}

static STDERR: Mutex<()> = Mutex::new(());

/// Run `spawn` with this process's stderr pointing at `log` (appended), so the children it
/// starts with an inherited stderr write there. The test's own messages are unaffected: the
/// test harness captures them in memory, not through fd 2.
pub fn with_stderr_to<T>(log: &Path, spawn: impl FnOnce() -> T) -> T {
    let _one_at_a_time = STDERR.lock().unwrap_or_else(|e| e.into_inner());
    let file = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("open process log");
    let saved = nix::unistd::dup(2).expect("dup stderr");
    nix::unistd::dup2(file.as_raw_fd(), 2).expect("dup2 log over stderr");
    // Put stderr back even when `spawn` panics: the panic message must reach the terminal.
    struct Restore(i32);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = nix::unistd::dup2(self.0, 2);
            let _ = nix::unistd::close(self.0);
        }
    }
    let _restore = Restore(saved);
    spawn()
}

/// The job processes of one run: those whose environment holds `CHAOS_MARKER=<marker>` (the
/// pipeline's env gives every job that variable). Nothing else on the host is touched, so
/// leftovers of other tests or other runs (the same job uids are reused) are left alone.
/// Dropping it kills what is left.
pub struct JobReaper {
    needle: Vec<u8>,
}

impl JobReaper {
    pub fn new(marker: &str) -> JobReaper {
        JobReaper { needle: format!("CHAOS_MARKER={marker}").into_bytes() }
    }

    /// `(pid, command line)` of each live process of this run's jobs.
    pub fn running(&self) -> Vec<(i32, String)> {
        let mut found = Vec::new();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
            let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
            if !env.split(|b| *b == 0).any(|var| var == self.needle.as_slice()) {
                continue;
            }
            // A zombie is already dead; its parent just has not reaped it yet.
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            if stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')) {
                continue;
            }
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            found.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ").trim().to_string()));
        }
        found
    }

    pub fn kill_all(&self) {
        for _ in 0..20 {
            let left = self.running();
            if left.is_empty() {
                return;
            }
            for (pid, _) in left {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for JobReaper {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Where a run keeps the stderr of each process it starts.
pub struct ProcessLogs {
    pub dir: PathBuf,
}

impl ProcessLogs {
    pub fn coordinator(&self) -> PathBuf {
        self.dir.join("coordinator.log")
    }

    pub fn agent(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }
}
