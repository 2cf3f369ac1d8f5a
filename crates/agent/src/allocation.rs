//! An agent inside what a cluster engine granted (`gpuci agent --allocation slurm|kubernetes`):
//! a Slurm job or a Kubernetes pod that a fleet asked for. The engine owns the GPUs; the agent
//! uses exactly the ones it was given, says when the grant ends, and treats the engine's
//! SIGTERM as the machine being taken back (its jobs are queued again, once).
//!
//! Reading the grant is pure ([`from_env`], [`parse_time_left`]) so tests can feed it any
//! environment; running `squeue` is the one effect ([`slurm_time_left`]).
//!
//! What a grant names:
//! - Slurm: `SLURM_JOB_GPUS` (a batch job) or `SLURM_STEP_GPUS` (a step): the GPUs' GRES
//!   indices, their positions in the node's GRES list — not the minor numbers of their device
//!   files (`File=/dev/nvidia[4-7]`: index 0 is `/dev/nvidia4`). [`crate::gres`] maps them to
//!   device files, which are matched by device node ([`GpuRef::Node`]); [`from_env`] only
//!   checks that this is a Slurm job and leaves `gpus` empty.
//! - Kubernetes: the device plugin's grant shows in several ways (the variable with UUIDs or
//!   indices, volume-mount files, CDI- or GKE-injected device nodes); [`crate::grant`] reads
//!   them all against the GPU inventory; [`from_env`] only names the pod and leaves `gpus`
//!   empty.
//!
//! A grant the agent cannot read is an error, never "all GPUs": an agent that took every GPU
//! of a shared node would hand out GPUs Slurm gave to somebody else.

use gpuci_gpu::GpuRef;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Slurm,
    Kubernetes,
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "slurm" => Ok(Engine::Slurm),
            "kubernetes" => Ok(Engine::Kubernetes),
            other => Err(format!("{other:?}: expected slurm or kubernetes")),
        }
    }
}

/// What the engine granted this agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub engine: Engine,
    /// The Slurm job id, or the pod's name.
    pub id: String,
    /// The GPUs granted; empty: none.
    pub gpus: Vec<GpuRef>,
}

impl Allocation {
    /// What the coordinator and the jobs' logs are told when the engine ends the allocation.
    pub fn taken_back_reason(&self) -> String {
        match self.engine {
            Engine::Slurm => format!(
                "Slurm is ending allocation {} (scancel, its time limit, preemption or a node failure)",
                self.id
            ),
            Engine::Kubernetes => {
                format!("Kubernetes is deleting pod {} (eviction, a node drain, preemption or a delete)", self.id)
            }
        }
    }
}

/// The grant, from the environment the engine gave the agent (`env` answers a variable).
pub fn from_env(engine: Engine, env: &dyn Fn(&str) -> Option<String>) -> Result<Allocation, String> {
    let var = |k: &str| env(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    match engine {
        Engine::Slurm => {
            let id = var("SLURM_JOB_ID")
                .ok_or("--allocation slurm: SLURM_JOB_ID is not set; this agent is not running inside a Slurm job")?;
            // The GPUs: `crate::gres::read_grant`, which needs the node's GRES list.
            Ok(Allocation { engine, id, gpus: Vec::new() })
        }
        Engine::Kubernetes => {
            let id = var("GPUCI_POD_NAME").or_else(|| var("HOSTNAME")).unwrap_or_else(|| "(unknown pod)".into());
            // The GPUs: `crate::grant::read_grant`, which needs the inventory and the pod's /dev.
            Ok(Allocation { engine, id, gpus: Vec::new() })
        }
    }
}

/// `0,1,3-5` → `[0, 1, 3, 4, 5]` (Slurm's lists of GPU indices).
pub fn parse_index_list(s: &str) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b) = (
            a.parse::<u32>().map_err(|_| format!("{part:?} is not an index or a range of indices"))?,
            b.parse::<u32>().map_err(|_| format!("{part:?} is not an index or a range of indices"))?,
        );
        if b < a || b - a > 1024 {
            return Err(format!("{part:?} is not a range of indices"));
        }
        for i in a..=b {
            if !out.contains(&i) {
                out.push(i);
            }
        }
    }
    Ok(out)
}

/// A Slurm duration as `squeue -o %L` prints the time left: `MM:SS`, `HH:MM:SS` or
/// `D-HH:MM:SS`; `None` for `UNLIMITED` / `NOT_SET` (no limit).
pub fn parse_time_left(s: &str) -> Result<Option<Duration>, String> {
    let s = s.trim();
    if matches!(s, "UNLIMITED" | "NOT_SET" | "INVALID" | "N/A") {
        return Ok(None);
    }
    let bad = || format!("{s:?} is not a Slurm time left (D-HH:MM:SS)");
    let (days, clock) = match s.split_once('-') {
        Some((d, rest)) => (d.parse::<u64>().map_err(|_| bad())?, rest),
        None => (0, s),
    };
    let parts = clock.split(':').map(|p| p.parse::<u64>().map_err(|_| bad())).collect::<Result<Vec<_>, _>>()?;
    let secs = match parts.as_slice() {
        [m, s] => m * 60 + s,
        [h, m, s] => h * 3600 + m * 60 + s,
        _ => return Err(bad()),
    };
    Ok(Some(Duration::from_secs(days * 86_400 + secs)))
}

/// How long this Slurm job has left, asked of `squeue` (the job inherits the submitter's
/// `SLURM_CONF`); `None`: no time limit. One line of output for one job: bounded.
pub async fn slurm_time_left(job_id: &str) -> Result<Option<Duration>, String> {
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::process::Command::new("squeue")
            .args(["--noheader", "--states=all", "--format=%L", "--jobs", job_id])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .map_err(|_| "squeue did not answer within 20s".to_string())?
    .map_err(|e| format!("cannot run squeue: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "squeue -j {job_id} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout[..out.stdout.len().min(4096)]).into_owned();
    let line = text.lines().next().ok_or_else(|| format!("squeue does not list job {job_id}"))?;
    parse_time_left(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn a_slurm_grant_is_a_slurm_job_whose_gpus_gres_resolves() {
        // SLURM_JOB_GPUS are GRES indices, not minors: never read here as device nodes.
        let a = from_env(
            Engine::Slurm,
            &env(&[("SLURM_JOB_ID", "42"), ("SLURM_JOB_GPUS", "2,3"), ("CUDA_VISIBLE_DEVICES", "0,1")]),
        )
        .unwrap();
        assert_eq!(a, Allocation { engine: Engine::Slurm, id: "42".into(), gpus: Vec::new() });
        let e = from_env(Engine::Slurm, &env(&[("SLURM_JOB_GPUS", "0")])).unwrap_err();
        assert!(e.contains("not running inside a Slurm job"), "{e}");
    }

    #[test]
    fn a_pod_grant_names_the_pod_and_leaves_the_gpus_to_grant() {
        // Whatever the variable holds (even `all`, or the volume-mounts path): `grant` decides.
        for v in ["GPU-aa,GPU-bb", "all", "/var/run/nvidia-container-devices", "void"] {
            let a =
                from_env(Engine::Kubernetes, &env(&[("GPUCI_POD_NAME", "gpuci-m-1"), ("NVIDIA_VISIBLE_DEVICES", v)]))
                    .unwrap();
            assert_eq!((a.id.as_str(), a.gpus.len()), ("gpuci-m-1", 0), "{v}");
        }
    }

    #[test]
    fn index_lists_and_ranges() {
        assert_eq!(parse_index_list("0,1,3-5"), Ok(vec![0, 1, 3, 4, 5]));
        assert_eq!(parse_index_list("2,2"), Ok(vec![2]));
        assert!(parse_index_list("5-3").is_err());
        assert!(parse_index_list("0-99999").is_err());
        assert!(parse_index_list("").is_err());
    }

    #[test]
    fn slurm_times_left() {
        let min = |m: u64| Some(Duration::from_secs(m * 60));
        assert_eq!(parse_time_left("5:00"), Ok(min(5)));
        assert_eq!(parse_time_left("1:02:03"), Ok(Some(Duration::from_secs(3723))));
        assert_eq!(parse_time_left("2-00:00:00"), Ok(min(2 * 24 * 60)));
        assert_eq!(parse_time_left("UNLIMITED"), Ok(None));
        assert!(parse_time_left("soon").is_err());
        assert!(parse_time_left("1:2:3:4").is_err());
    }
}
