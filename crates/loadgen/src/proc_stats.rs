//! A process's CPU time and resident memory, read from `/proc/PID` (Linux).

use std::time::{Duration, Instant};

/// User + system CPU time in clock ticks.
pub fn cpu_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces, inside parentheses).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

pub fn ticks_per_s() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().map_or(100.0, |t| t as f64)
}

/// Resident set size in bytes.
pub fn rss_bytes(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

pub struct Watched {
    /// CPU used over the time watched, in cores.
    pub cores: f64,
    /// The largest RSS seen.
    pub rss_bytes: u64,
}

/// Watches `pid` for `d`.
pub async fn watch(pid: i32, d: Duration) -> anyhow::Result<Watched> {
    let c0 = cpu_ticks(pid).ok_or_else(|| anyhow::anyhow!("cannot read /proc/{pid}/stat"))?;
    let t0 = Instant::now();
    let mut rss = 0;
    while t0.elapsed() < d {
        rss = rss.max(rss_bytes(pid).unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let c1 = cpu_ticks(pid).ok_or_else(|| anyhow::anyhow!("the coordinator (pid {pid}) is gone"))?;
    Ok(Watched { cores: (c1 - c0) as f64 / ticks_per_s() / t0.elapsed().as_secs_f64(), rss_bytes: rss })
}
