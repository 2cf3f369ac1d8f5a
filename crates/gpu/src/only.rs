//! A share of a host's GPUs: an agent given some of them (`gpuci agent --gpus`: a local fleet
//! machine, a Slurm allocation, a pod's device-plugin grant) sees, checks and leases exactly
//! those, and any other GPU is as absent as one on another host.
//!
//! The share is named by UUID (`GPU-…`, `MIG-…`) or by the host's index (`0`, `3`, what
//! `nvidia-smi -L` numbers). Naming a GPU the host does not have is an error at start, never
//! a smaller share: an agent that silently advertised fewer GPUs would hide a broken grant.

use crate::backend::{BackendKind, GpuBackend, GpuError, GpuProcess, GpuSample, HealthCounters};
use gpuci_core::gpu::GpuInfo;
use std::collections::BTreeSet;
use std::sync::Arc;

/// One entry of a share.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum GpuRef {
    Uuid(String),
    Index(u32),
    /// The GPU whose device node is `/dev/nvidia<N>` (its minor number): how Slurm's
    /// `gres.conf` names GPUs (`File=/dev/nvidia[0-3]`), which need not follow NVML's index.
    Node(u32),
}

impl GpuRef {
    /// `0`, `3` (an index) or a UUID; anything else is refused with the reason.
    pub fn parse(s: &str) -> Result<GpuRef, String> {
        let s = s.trim();
        if s.is_empty() {
            return Err("an empty GPU name; give a UUID (GPU-…) or an index (0, 1, …)".into());
        }
        if s.bytes().all(|b| b.is_ascii_digit()) {
            return s.parse().map(GpuRef::Index).map_err(|_| format!("GPU index {s} is too large"));
        }
        if s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'/' | b'_')) {
            return Ok(GpuRef::Uuid(s.to_string()));
        }
        Err(format!("{s:?} is neither a GPU UUID (GPU-…) nor an index"))
    }

    fn names(&self, g: &GpuInfo) -> bool {
        match self {
            GpuRef::Uuid(u) => g.uuid == *u,
            GpuRef::Index(i) => g.index == *i,
            GpuRef::Node(n) => {
                let file = g.device_node.rsplit('/').next().unwrap_or("");
                file.strip_prefix("nvidia").and_then(|d| d.parse::<u32>().ok()) == Some(*n)
                    && file.len() > "nvidia".len()
                    && file["nvidia".len()..].bytes().all(|b| b.is_ascii_digit())
            }
        }
    }
}

/// `inner`, showing only the GPUs of the share.
pub struct OnlyGpus {
    inner: Arc<dyn GpuBackend>,
    /// The UUIDs of the share, resolved once at start (indices can change across a driver
    /// reload; a UUID cannot, so the share stays the same GPUs).
    uuids: BTreeSet<String>,
}

impl OnlyGpus {
    /// The share `refs` of what `inner` finds now. Every entry must name a GPU `inner` has.
    pub fn new(inner: Arc<dyn GpuBackend>, refs: &[GpuRef]) -> Result<OnlyGpus, GpuError> {
        if refs.is_empty() {
            // `--gpus none`: nothing to find (a host without a driver has no inventory).
            return Ok(OnlyGpus { inner, uuids: BTreeSet::new() });
        }
        let all = inner.inventory()?;
        let mut uuids = BTreeSet::new();
        for r in refs {
            match all.iter().find(|g| r.names(g)) {
                Some(g) => {
                    uuids.insert(g.uuid.clone());
                }
                None => {
                    let have: Vec<String> = all.iter().map(|g| format!("{} {}", g.index, g.uuid)).collect();
                    let named = match r {
                        GpuRef::Uuid(u) => u.clone(),
                        GpuRef::Index(i) => format!("index {i}"),
                        GpuRef::Node(n) => format!("/dev/nvidia{n}"),
                    };
                    return Err(GpuError::NoGpu {
                        reason: format!(
                            "the GPU {named} given to this agent is not on this host (it has: {})",
                            if have.is_empty() { "none".to_string() } else { have.join(", ") }
                        ),
                    });
                }
            }
        }
        Ok(OnlyGpus { inner, uuids })
    }

    fn check(&self, uuid: &str) -> Result<(), GpuError> {
        if self.uuids.contains(uuid) {
            Ok(())
        } else {
            Err(GpuError::UnknownGpu { uuid: uuid.to_string() })
        }
    }
}

impl GpuBackend for OnlyGpus {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }

    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        Ok(self.inner.inventory()?.into_iter().filter(|g| self.uuids.contains(&g.uuid)).collect())
    }

    fn sample(&self, uuid: &str) -> Result<GpuSample, GpuError> {
        self.check(uuid)?;
        self.inner.sample(uuid)
    }

    fn processes(&self, uuid: &str) -> Result<Vec<GpuProcess>, GpuError> {
        self.check(uuid)?;
        self.inner.processes(uuid)
    }

    fn health_counters(&self, uuid: &str) -> Result<HealthCounters, GpuError> {
        self.check(uuid)?;
        self.inner.health_counters(uuid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimulatedGpus;

    fn host() -> (tempfile::TempDir, Arc<dyn GpuBackend>) {
        let dir = tempfile::tempdir().unwrap();
        let gpus = SimulatedGpus::build("4xL4".parse().unwrap(), "host-a", dir.path(), None).unwrap();
        (dir, Arc::new(gpus))
    }

    #[test]
    fn a_share_shows_and_answers_for_its_gpus_only() {
        let (_dir, inner) = host();
        let all = inner.inventory().unwrap();
        let share = OnlyGpus::new(inner.clone(), &[GpuRef::Index(2), GpuRef::Uuid(all[0].uuid.clone())]).unwrap();
        let seen: Vec<String> = share.inventory().unwrap().into_iter().map(|g| g.uuid).collect();
        assert_eq!(seen, vec![all[0].uuid.clone(), all[2].uuid.clone()]);
        assert!(share.sample(&all[2].uuid).is_ok());
        for outside in [&all[1].uuid, &all[3].uuid] {
            assert_eq!(share.sample(outside), Err(GpuError::UnknownGpu { uuid: outside.clone() }));
            assert!(share.processes(outside).is_err());
            assert!(share.health_counters(outside).is_err());
        }
    }

    #[test]
    fn a_gpu_the_host_lacks_is_an_error_not_a_smaller_share() {
        let (_dir, inner) = host();
        for r in [GpuRef::Index(4), GpuRef::Uuid("GPU-00000000-0000-0000-0000-000000000000".into())] {
            let e = OnlyGpus::new(inner.clone(), &[GpuRef::Index(0), r]).err().unwrap().to_string();
            assert!(e.contains("is not on this host") && e.contains("it has: 0 GPU-"), "{e}");
        }
    }

    #[test]
    fn a_device_node_names_the_gpu_by_its_minor_number_not_its_index() {
        let (_dir, inner) = host();
        let all = inner.inventory().unwrap();
        let share = OnlyGpus::new(inner.clone(), &[GpuRef::Node(3), GpuRef::Node(1)]).unwrap();
        let seen: Vec<String> = share.inventory().unwrap().into_iter().map(|g| g.uuid).collect();
        assert_eq!(seen, vec![all[1].uuid.clone(), all[3].uuid.clone()]);
        let mut g = all[0].clone();
        g.device_node = "/dev/nvidia12".into();
        assert!(GpuRef::Node(12).names(&g) && !GpuRef::Node(1).names(&g) && !GpuRef::Index(12).names(&g));
        g.device_node = "/dev/nvidiactl".into();
        assert!(!GpuRef::Node(0).names(&g));
        let e = OnlyGpus::new(inner, &[GpuRef::Node(7)]).err().unwrap().to_string();
        assert!(e.contains("/dev/nvidia7 given to this agent is not on this host"), "{e}");
    }

    #[test]
    fn names_parse_strictly() {
        assert_eq!(GpuRef::parse(" 3 "), Ok(GpuRef::Index(3)));
        assert_eq!(GpuRef::parse("GPU-1a2b"), Ok(GpuRef::Uuid("GPU-1a2b".into())));
        assert_eq!(GpuRef::parse("MIG-GPU-1a2b/1/0"), Ok(GpuRef::Uuid("MIG-GPU-1a2b/1/0".into())));
        assert!(GpuRef::parse("").is_err());
        assert!(GpuRef::parse("GPU 1; rm").is_err());
        assert!(GpuRef::parse("99999999999").is_err());
    }
}
