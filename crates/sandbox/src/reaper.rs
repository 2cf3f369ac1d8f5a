//! A container's reaper: the one process of an `image:` step that may outlive the agent, and
//! only to remove the step's container.
//!
//! A bubblewrap job dies with the agent through its parent-death signal and its pid namespace
//! (see lib.rs). An image step's processes are not the agent's descendants: the engine's client
//! (which has the signal, and dies) hands the container to `conmon`, which daemonises, and the
//! container runs in cgroups of the engine's own. An agent killed with SIGKILL left conmon and
//! the container running as the job's uid, with its environment, workspace and GPU, until the
//! same agent started again (outsider attack), while the coordinator marked the job lost and
//! could run it a second time elsewhere.
//!
//! So every image step gets a reaper, started before the engine's client: `sh` reading a pipe
//! whose only write end the agent holds. When the agent has removed the container itself it
//! writes `done` and the reaper exits. Any other end of the pipe — the agent died, however —
//! makes the reaper run the engine's `rm --force` on the container (SIGKILL at once, then
//! removal). A pipe rather than a parent-death signal: the kernel closes a dead process's
//! descriptors whatever killed it, and the signal would follow the forking thread, not the
//! process.
//!
//! The reaper runs as the agent (root; the engine needs it), in its own process group, in `/`,
//! with only `PATH` and `HOME` from the agent's environment and its output on /dev/null (the
//! agent's stderr may be a pipe nobody reads once the agent is gone: a write there would kill
//! the engine's client). It ignores SIGTERM, SIGINT and SIGHUP, so a signal sent to the agent's
//! whole process group or unit does not take it before the agent has ended.
//!
//! Not covered: whatever kills the reaper itself with SIGKILL together with the agent (a
//! `systemctl kill -s KILL` of the agent's unit, the final SIGKILL of a stop that timed out);
//! then the container lives on until the agent's next start-up sweep, as before.

use std::process::Stdio;

use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStdin, Command};

use crate::{container, ContainerRuntime, SandboxError};

/// Ignore the signals a service manager or terminal sends to a whole group; wait for a word or
/// the end of the pipe; unless the word is `done`, run the removal (the script's arguments).
const SCRIPT: &str = "trap '' TERM INT HUP; read -r word; [ \"$word\" = done ] && exit 0; exec \"$@\"";

const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The running reaper of one container. Dropping it without [`ContainerReaper::disarm`] closes
/// the pipe, and the reaper removes the container (as when the agent dies).
#[derive(Debug)]
pub struct ContainerReaper {
    child: Child,
    pipe: Option<ChildStdin>,
    job_id: String,
}

impl ContainerReaper {
    /// Starts the reaper of container `name` (of job `job_id`). Needs a tokio runtime.
    pub fn start(runtime: &ContainerRuntime, job_id: &str, name: &str) -> Result<Self, SandboxError> {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(SCRIPT)
            .arg("gpuci-reaper")
            .args(container::remove_argv(runtime, name))
            .env_clear()
            .env("PATH", PATH)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(false);
        if let Some(home) = std::env::var_os("HOME") {
            cmd.env("HOME", home);
        }
        let spawn_error = |source| SandboxError::Spawn {
            job_id: job_id.to_string(),
            program: "/bin/sh (the container's reaper)".into(),
            source,
        };
        let mut child = cmd.spawn().map_err(spawn_error)?;
        // The write end is the agent's alone: std opens pipes close-on-exec, so no other
        // process the agent starts holds it open past its agent.
        let pipe = child.stdin.take().ok_or_else(|| spawn_error(std::io::Error::other("no pipe to the reaper")))?;
        Ok(ContainerReaper { child, pipe: Some(pipe), job_id: job_id.to_string() })
    }

    /// The agent removed the container itself: the reaper exits without doing anything.
    /// An error says the reaper was gone before (then the step ran without its guard).
    pub async fn disarm(mut self) -> Result<(), SandboxError> {
        let pid = self.child.id().unwrap_or(0);
        let wait_error = |source| SandboxError::Wait { job_id: self.job_id.clone(), pid, source };
        if let Some(mut pipe) = self.pipe.take() {
            // A reaper that died early makes this write fail (EPIPE; the agent ignores SIGPIPE).
            pipe.write_all(b"done\n").await.map_err(wait_error)?;
        }
        let status = self.child.wait().await.map_err(wait_error)?;
        if status.success() {
            Ok(())
        } else {
            Err(wait_error(std::io::Error::other(format!("the container's reaper ended early ({status})"))))
        }
    }
}

impl Drop for ContainerReaper {
    fn drop(&mut self) {
        // Not disarmed: closing the pipe has the reaper remove the container; tokio reaps it.
        self.pipe.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ContainerEngine;
    use std::path::Path;
    use std::time::Duration;

    /// An "engine" that records its arguments in `dir/removed`.
    fn fake_engine(dir: &Path) -> ContainerRuntime {
        use std::os::unix::fs::PermissionsExt;
        let engine = dir.join("engine");
        std::fs::write(&engine, format!("#!/bin/sh\necho \"$@\" > {}/removed\n", dir.display())).unwrap();
        std::fs::set_permissions(&engine, std::fs::Permissions::from_mode(0o755)).unwrap();
        ContainerRuntime { engine: ContainerEngine::Podman, path: engine }
    }

    async fn wait_for(path: &Path) -> String {
        for _ in 0..600 {
            if let Ok(text) = std::fs::read_to_string(path) {
                if !text.is_empty() {
                    return text;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} was never written", path.display());
    }

    #[tokio::test]
    async fn an_agent_that_goes_without_disarming_has_the_container_removed() {
        let dir = tempfile::tempdir().unwrap();
        let reaper = ContainerReaper::start(&fake_engine(dir.path()), "j1", "gpuci-j1").unwrap();
        drop(reaper);
        assert_eq!(wait_for(&dir.path().join("removed")).await, "rm --force --time=0 --volumes gpuci-j1\n");
    }

    #[tokio::test]
    async fn a_disarmed_reaper_removes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let reaper = ContainerReaper::start(&fake_engine(dir.path()), "j2", "gpuci-j2").unwrap();
        reaper.disarm().await.unwrap();
        assert!(!dir.path().join("removed").exists());
    }
}
