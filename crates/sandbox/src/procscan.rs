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
    pids_where(|u| u == uid, |value| value == job_id.as_bytes())
}

/// Pids of live processes whose sandbox id starts with `prefix` and that run as this process's
/// own uid or one of `job_uids`: the uids an agent's jobs run as. Another agent's job may set
/// any id it likes on its own processes; those are not this agent's to kill, and their
/// environments are not even read (a job that gave thousands of processes megabytes of
/// environment each held an agent's reaper in this scan for minutes).
pub(crate) fn pids_with_marker_prefix(prefix: &str, job_uids: &[u32]) -> Vec<i32> {
    let me = nix::unistd::geteuid().as_raw();
    pids_where(|u| u == me || job_uids.contains(&u), |value| value.starts_with(prefix.as_bytes()))
}

/// How much of a process's environment is read for the marker. The sandbox sets it in the
/// job's first environment, far below this; a process that pushed it further out has
/// rewritten its environment, which escapes the scan anyway (see the module header).
const ENV_SCAN_LIMIT: u64 = 256 * 1024;

/// Live processes any of whose uids `owned_by` accepts (checked first, from the small status
/// file) whose environment holds the marker with a value `matches` accepts.
fn pids_where(owned_by: impl Fn(u32) -> bool, matches: impl Fn(&[u8]) -> bool) -> Vec<i32> {
    use std::io::Read;
    let key = format!("{MARKER}=");
    let me = std::process::id() as i32;
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut env = Vec::with_capacity(64 * 1024);
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let owned = fs::read_to_string(e.path().join("status")).is_ok_and(|st| {
            st.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .is_some_and(|u| u.split_whitespace().filter_map(|x| x.parse().ok()).any(&owned_by))
        });
        if !owned {
            continue;
        }
        // Unreadable (another user's process, or it just exited): not ours to find.
        env.clear();
        let Ok(f) = fs::File::open(e.path().join("environ")) else {
            continue;
        };
        if f.take(ENV_SCAN_LIMIT).read_to_end(&mut env).is_err() {
            continue;
        }
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

    fn sleeper(prefix: &str, uid: Option<u32>) -> std::process::Child {
        let mut cmd = match uid {
            Some(u) => {
                let mut c = std::process::Command::new("setpriv");
                c.args(["--reuid", &u.to_string(), "--regid", &u.to_string(), "--clear-groups", "sleep", "30"]);
                c
            }
            None => {
                let mut c = std::process::Command::new("sleep");
                c.arg("30");
                c
            }
        };
        cmd.env(MARKER, format!("{prefix}job-1")).spawn().unwrap()
    }

    fn found(prefix: &str, uids: &[u32], pid: u32) -> bool {
        // The child has exec'd once its environment names the marker.
        for _ in 0..100 {
            if pids_with_marker_prefix(prefix, uids).contains(&(pid as i32)) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn a_marked_process_of_another_uid_is_not_the_agents() {
        let mut own = sleeper("procscanown1-", None);
        assert!(found("procscanown1-", &[], own.id()), "a marked process of the agent's own uid");
        let _ = own.kill();
        let _ = own.wait();
        if !nix::unistd::geteuid().is_root() || std::process::Command::new("setpriv").arg("--version").output().is_err()
        {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: runs as root with setpriv");
            eprintln!("SKIP: another uid needs root and setpriv");
            return;
        }
        let uid = 1_620_999_000 + std::process::id() % 900;
        let mut other = sleeper("procscanother1-", Some(uid));
        // Until setpriv has dropped to `uid` it is root, this process's own uid.
        let dropped = || {
            fs::read_to_string(format!("/proc/{}/status", other.id())).is_ok_and(|st| {
                st.lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .is_some_and(|u| u.split_whitespace().all(|x| x == uid.to_string()))
            })
        };
        for _ in 0..200 {
            if dropped() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(dropped(), "setpriv never dropped to uid {uid}");
        assert!(found("procscanother1-", &[uid], other.id()), "one of the agent's job uids");
        assert!(!pids_with_marker_prefix("procscanother1-", &[]).contains(&(other.id() as i32)), "another uid's");
        let _ = other.kill();
        let _ = other.wait();
    }

    #[test]
    fn a_zombie_leader_with_live_threads_is_alive() {
        assert!(is_dead("Name:\tsleep\nState:\tZ (zombie)\nThreads:\t1\n"));
        assert!(!is_dead("Name:\tpython3\nState:\tZ (zombie)\nThreads:\t2\n"), "its other thread runs");
        assert!(!is_dead("Name:\tsleep\nState:\tS (sleeping)\nThreads:\t1\n"));
        assert!(is_dead("State:\tX (dead)\n"));
    }
}
