//! Finding a job's processes without cgroups: every process started by the sandbox carries
//! `GPUCI_SANDBOX_ID=<id>` in its initial environment, and a daemonised grandchild keeps it. A
//! process that execs itself with a scrubbed environment escapes this scan; that is why the
//! scan is the fallback and cgroups (or bwrap's PID namespace) are the real mechanism.

use std::fs;

pub const MARKER: &str = "GPUCI_SANDBOX_ID";

/// Pids of live processes whose environment holds `GPUCI_SANDBOX_ID=<job_id>`.
pub(crate) fn pids_with_marker(job_id: &str) -> Vec<i32> {
    pids_where(|value| value == job_id.as_bytes())
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
