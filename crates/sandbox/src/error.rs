//! The one error type of this crate. Every variant names the job and the path or call that failed.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Why a sandbox could not be started, observed or cleaned up.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("job {job_id:?}: invalid job id: {reason}")]
    InvalidJobId { job_id: String, reason: &'static str },

    #[error("job {job_id}: invalid sandbox spec: {reason}")]
    InvalidSpec { job_id: String, reason: String },

    #[error("job {job_id}: bubblewrap (bwrap) is not installed or not on PATH; install it (apt-get install bubblewrap) or opt out with `sandbox: none`")]
    BubblewrapMissing { job_id: String },

    #[error("job {job_id}: cgroups are required but unusable: {reason}")]
    CgroupUnavailable { job_id: String, reason: String },

    #[error("job {job_id}: cgroup {op} {}: {source}", path.display())]
    Cgroup {
        job_id: String,
        /// What was attempted: "mkdir", "write memory.limit_in_bytes", "rmdir", ...
        op: String,
        path: PathBuf,
        source: io::Error,
    },

    #[error("job {job_id}: cgroup {} already holds running processes {pids:?} (a job with this id is still running?)", path.display())]
    CgroupBusy { job_id: String, path: PathBuf, pids: Vec<i32> },

    #[error("job {job_id}: device {}: {reason}", path.display())]
    Device { job_id: String, path: PathBuf, reason: String },

    #[error("job {job_id}: workspace {}: {reason}", path.display())]
    Workspace { job_id: String, path: PathBuf, reason: String },

    #[error("job {job_id}: passing sandbox arguments through a memfd: {source}")]
    ArgsFd { job_id: String, source: io::Error },

    #[error("job {job_id}: spawning {program}: {source}")]
    Spawn { job_id: String, program: String, source: io::Error },

    #[error("job {job_id}: waitpid({pid}): {source}")]
    Wait { job_id: String, pid: u32, source: io::Error },

    #[error("job {job_id}: kill({pid}, SIGKILL): {source}")]
    Kill { job_id: String, pid: i32, source: nix::Error },

    #[error("job {job_id}: {} process(es) still alive {waited:?} after SIGKILL: pids {pids:?}", pids.len())]
    Leftover { job_id: String, pids: Vec<i32>, waited: Duration },
}

impl SandboxError {
    /// The job this error is about.
    pub fn job_id(&self) -> &str {
        match self {
            Self::InvalidJobId { job_id, .. }
            | Self::InvalidSpec { job_id, .. }
            | Self::BubblewrapMissing { job_id }
            | Self::CgroupUnavailable { job_id, .. }
            | Self::Cgroup { job_id, .. }
            | Self::CgroupBusy { job_id, .. }
            | Self::Device { job_id, .. }
            | Self::Workspace { job_id, .. }
            | Self::ArgsFd { job_id, .. }
            | Self::Spawn { job_id, .. }
            | Self::Wait { job_id, .. }
            | Self::Kill { job_id, .. }
            | Self::Leftover { job_id, .. } => job_id,
        }
    }
}
