//! The start-up probe: one real job sandbox, made as a job's is, before the agent offers a
//! slot (and by `gpuci doctor`, which calls the same function).
//!
//! Checking the parts one by one (is `bwrap` installed, may users create user namespaces,
//! is the cgroup tree writable) said "all green" in a pod whose masked `/proc` makes every
//! sandbox fail at its first mount. So the probe starts the thing itself: as the slot's job
//! user, in the slot's network namespace, with a cgroup and limits (or, where the container
//! gives none, the rlimit that stands in for them), under bubblewrap with the job seccomp
//! filter, and the command inside checks from the job's side what it was promised: not root,
//! a PID namespace of its own, the seccomp filter, `no_new_privs`. A failure comes back with
//! its cause and fix in words ([`gpuci_sandbox::diagnose`]).
//!
//! It must not leave anything behind: its workspace, cgroup and processes go before it returns.

use std::path::Path;

use gpuci_sandbox::{CgroupUse, JobUser, Network, Resources, Sandbox, SandboxSpec};

/// The probe's job, run by `sh` inside the sandbox: each promise checked from inside, with
/// what failed on standard output and exit status 3. Only the shell's builtins and /proc: the
/// image need not have `id` or `grep`.
const CHECKS: &str = r#"
sc=; nnp=; uid=
while read -r k v _; do
  case "$k" in Seccomp:) sc=$v ;; NoNewPrivs:) nnp=$v ;; Uid:) uid=$v ;; esac
done < /proc/self/status
[ "$sc" = 2 ] || { echo "the job runs without its seccomp filter (Seccomp: $sc)"; exit 3; }
[ "$nnp" = 1 ] || { echo "no_new_privs is not set on the job"; exit 3; }
[ "$uid" != 0 ] || { echo "the job runs as root"; exit 3; }
[ "$$" -lt 100 ] || { echo "the job is not in a PID namespace of its own (its shell is pid $$)"; exit 3; }
echo sandbox-ok
"#;

/// How the probe's sandbox is made: what a job of this agent gets.
pub struct ProbeSpec<'a> {
    /// The slot's job user (a root agent), or `None`: the agent's own uid.
    pub user: Option<JobUser>,
    /// The slot's network namespace, when jobs get one.
    pub network: Option<Network>,
    /// `Required` where jobs get cgroups (a root agent with a writable tree), `Auto` otherwise.
    pub cgroups: CgroupUse,
    /// Where the probe's workspace is made (the agent's work root).
    pub work_root: &'a Path,
}

/// Starts one job sandbox as described and checks it from inside. `Ok` says what worked;
/// `Err` says what failed, with the cause and fix when they are known.
pub async fn job_sandbox(p: ProbeSpec<'_>) -> Result<String, String> {
    // Unique in this process too: several agents may start at once in one process (`gpuci
    // up`, tests), and two probes of one name would share a cgroup.
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let id = format!("probe-{}-{n}", std::process::id());
    let dir = p.work_root.join(format!(".{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let result = async {
        let mut spec = SandboxSpec::new(&id, &dir, vec!["sh".into(), "-c".into(), CHECKS.into()]);
        spec.env.insert("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into());
        spec.user = p.user;
        if let Some(u) = p.user {
            crate::fstree::give_to(&dir, u).map_err(|e| format!("chown {}: {e}", dir.display()))?;
        }
        if let Some(n) = p.network.clone() {
            spec.network = n;
        }
        spec.cgroups = p.cgroups;
        spec.resources =
            Resources { memory: Some(gpuci_core::quantity::Bytes(256 << 20)), pids: Some(64), cpu_millis: None };
        spec.scratch_size = Some(16 << 20);
        let (mut sb, mut out, mut err) = Sandbox::spawn(&spec).map_err(|e| e.to_string())?;
        let (mut said, mut text) = (String::new(), String::new());
        let _ = tokio::join!(
            tokio::io::AsyncReadExt::read_to_string(&mut out, &mut said),
            tokio::io::AsyncReadExt::read_to_string(&mut err, &mut text)
        );
        let exit = sb.wait().await.map_err(|e| e.to_string())?;
        let _ = sb.cleanup().await;
        match exit.code {
            Some(0) if said.contains("sandbox-ok") => {
                let who = match p.user {
                    Some(u) => format!("as uid {}", u.uid),
                    None => format!("as the agent's uid {}", nix::unistd::geteuid()),
                };
                Ok(format!(
                    "a job sandbox started {who} with its own user, PID and mount namespaces and the seccomp filter"
                ))
            }
            Some(3) => Err(format!("the job sandbox started but broke a promise: {}", said.trim())),
            _ => Err(explain(&exit.to_string(), &text)),
        }
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// bubblewrap's failure in words: its own line, then the cause and fix when known.
pub fn explain(exit: &str, stderr: &str) -> String {
    let line = stderr.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("no message");
    match gpuci_sandbox::diagnose(stderr) {
        Some(d) => format!("a job sandbox cannot start here ({line}): {}; fix: {}", d.cause, d.fix),
        None => format!("a job sandbox failed to start ({exit}): {line}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_names_bubblewraps_line_and_its_cause() {
        let e = explain("exit status 1", "bwrap: Can't mount proc on /newroot/proc: Operation not permitted\n");
        assert!(e.contains("Can't mount proc"), "{e}");
        assert!(e.contains("masked") && e.contains("procMount: Unmasked"), "{e}");
        let other = explain("exit status 1", "bwrap: something new\n");
        assert_eq!(other, "a job sandbox failed to start (exit status 1): bwrap: something new");
    }
}
