//! Finding a job's processes without cgroups: every process started by the sandbox carries
//! `GPUCI_SANDBOX_ID=<id>` in its initial environment, and a daemonised grandchild keeps it. A
//! process that execs itself with a scrubbed environment escapes this scan; that is why the
//! scan is the fallback and cgroups (or bwrap's PID namespace) are the real mechanism.

use std::fs;

pub const MARKER: &str = "GPUCI_SANDBOX_ID";

/// Pids of live processes whose environment holds `GPUCI_SANDBOX_ID=<job_id>` and that run as
/// `uid` (any of their uids): the variable is the job's own to set, and any other job can set
/// it too, so a process of another uid claiming the id is not the job's.
pub(crate) fn pids_with_marker(job_id: &str, uid: u32) -> Vec<i32> {
    let mut pids = pids_where(|value| value == job_id.as_bytes());
    let want = uid.to_string();
    pids.retain(|pid| {
        fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|st| {
            st.lines().find_map(|l| l.strip_prefix("Uid:")).is_some_and(|u| u.split_whitespace().any(|x| x == want))
        })
    });
    pids
}

/// Pids of live processes whose sandbox id starts with `prefix`.
pub(crate) fn pids_with_marker_prefix(prefix: &str) -> Vec<i32> {
    pids_where(|value| value.starts_with(prefix.as_bytes()))
}

fn pids_where(matches: impl Fn(&[u8]) -> bool) -> Vec<i32> {
    let key = format!("{MARKER}=");
    let me = std::process::id() as i32;
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        // Unreadable (another user's process, or it just exited): not ours to find.
        let Ok(env) = fs::read(e.path().join("environ")) else {
            continue;
        };
        if env.split(|b| *b == 0).any(|kv| kv.strip_prefix(key.as_bytes()).is_some_and(&matches)) {
            out.push(pid);
        }
    }
    out
}

/// Pids of live processes any of whose uids (real, effective, saved, file system) is `uid`.
/// Zombies are not counted: they run nothing and hold nothing (an orphaned job process stays
/// one until the host's init reaps it, which on some hosts takes a while). A process whose
/// main thread has exited while other threads run reads `State: Z` too, and is very much
/// alive (an outsider hid a thread that read later jobs' environments that way): only a
/// zombie with no thread left but its own is skipped.
pub(crate) fn pids_of_uid(uid: u32) -> Vec<i32> {
    pids_of_uids(&[uid]).into_iter().map(|(pid, _)| pid).collect()
}

/// Live processes (pid, the matching uid) any of whose uids is in `uids`, in one pass over
/// `/proc`; zombies are not counted, as in [`pids_of_uid`].
pub(crate) fn pids_of_uids(uids: &[u32]) -> Vec<(i32, u32)> {
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id() as i32;
    rd.flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
            if pid == me {
                return None;
            }
            let status = fs::read_to_string(e.path().join("status")).ok()?;
            if is_dead(&status) {
                return None;
            }
            let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
            let uid = line.split_whitespace().filter_map(|u| u.parse::<u32>().ok()).find(|u| uids.contains(u))?;
            Some((pid, uid))
        })
        .collect()
}

/// Whether a process's `/proc/PID/status` says it runs nothing: a zombie (or dead) whose thread
/// group has no other thread. A zombie leader of a group with live threads is alive.
fn is_dead(status: &str) -> bool {
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let zombie = field("State:").is_some_and(|s| s.starts_with('Z') || s.starts_with('X'));
    let threads = field("Threads:").and_then(|t| t.parse::<u32>().ok()).unwrap_or(1);
    zombie && threads <= 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_leader_with_live_threads_is_alive() {
        assert!(is_dead("Name:\tsleep\nState:\tZ (zombie)\nThreads:\t1\n"));
        assert!(!is_dead("Name:\tpython3\nState:\tZ (zombie)\nThreads:\t2\n"), "its other thread runs");
        assert!(!is_dead("Name:\tsleep\nState:\tS (sleeping)\nThreads:\t1\n"));
        assert!(is_dead("State:\tX (dead)\n"));
    }
}
