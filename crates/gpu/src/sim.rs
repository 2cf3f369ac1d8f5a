//! A simulated inventory from a spec such as `4xH100-80GB` or `2xA100-40GB,2xL4`, for tests,
//! benchmarks and `gpuci simulate`. Every GPU it produces has `simulated: true`.

use crate::backend::{BackendKind, GpuBackend, GpuError, GpuProcess, GpuSample, HealthCounters};
use crate::fake::{FakeGpuState, StateTable};
use gpuci_core::gpu::{ComputeCapability, GpuInfo, Version};
use gpuci_core::quantity::Bytes;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// A known model: spec name, marketing name per memory size, compute capability.
struct Model {
    key: &'static str,
    /// (memory in GB as written in specs, name NVML reports, total MiB NVML reports).
    /// The first entry is the default when a spec gives no size. Totals are what real
    /// boards report (a little under the marketing size), so requirements like
    /// `memory: ">=80GiB"` behave in simulation as they will on real hardware.
    variants: &'static [(u32, &'static str, u64)],
    cc: (u32, u32),
}

const MODELS: &[Model] = &[
    Model { key: "H100", variants: &[(80, "NVIDIA H100 80GB HBM3", 81_559)], cc: (9, 0) },
    Model { key: "H200", variants: &[(141, "NVIDIA H200", 143_771)], cc: (9, 0) },
    Model {
        key: "A100",
        variants: &[(80, "NVIDIA A100-SXM4-80GB", 81_920), (40, "NVIDIA A100-SXM4-40GB", 40_960)],
        cc: (8, 0),
    },
    Model { key: "L4", variants: &[(24, "NVIDIA L4", 23_034)], cc: (8, 9) },
    Model { key: "L40S", variants: &[(48, "NVIDIA L40S", 46_068)], cc: (8, 9) },
    Model { key: "A10", variants: &[(24, "NVIDIA A10", 23_028)], cc: (8, 6) },
    Model { key: "T4", variants: &[(16, "Tesla T4", 15_360)], cc: (7, 5) },
    Model {
        key: "V100",
        variants: &[(32, "Tesla V100-SXM2-32GB", 32_768), (16, "Tesla V100-SXM2-16GB", 16_384)],
        cc: (7, 0),
    },
    Model { key: "RTX4090", variants: &[(24, "NVIDIA GeForce RTX 4090", 24_564)], cc: (8, 9) },
];

fn known_models() -> String {
    MODELS
        .iter()
        .map(|m| {
            let sizes: Vec<String> = m.variants.iter().map(|v| format!("{}GB", v.0)).collect();
            format!("{} ({})", m.key, sizes.join("/"))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// One `NxMODEL[-MEMGB]` entry of a spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimulatedGroup {
    pub count: u32,
    pub model: &'static str,
    pub memory_gb: u32,
}

/// A parsed simulated-inventory spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimulatedSpec {
    pub groups: Vec<SimulatedGroup>,
}

impl FromStr for SimulatedSpec {
    type Err = GpuError;
    fn from_str(spec: &str) -> Result<Self, GpuError> {
        let err = |detail: String| GpuError::SimSpec { spec: spec.to_string(), detail };
        let mut groups = Vec::new();
        for part in spec.split(',').map(str::trim) {
            if part.is_empty() {
                return Err(err("empty entry; write e.g. 4xH100-80GB,2xL4".into()));
            }
            // "4xH100-80GB" or "H100": a count needs a digit prefix, so "RTX4090" is a model.
            let (count, rest) = match part.split_once(['x', 'X']) {
                Some((n, rest)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => {
                    (n.parse::<u32>().map_err(|_| err(format!("count {n:?} is too large")))?, rest)
                }
                _ => (1, part),
            };
            if count == 0 {
                return Err(err(format!("{part:?}: count must be at least 1")));
            }
            let (name, mem) = match rest.split_once('-') {
                Some((name, mem)) => (name, Some(mem)),
                None => (rest, None),
            };
            let model = MODELS
                .iter()
                .find(|m| m.key.eq_ignore_ascii_case(name.trim()))
                .ok_or_else(|| err(format!("unknown model {name:?}; known models: {}", known_models())))?;
            let memory_gb = match mem {
                None => model.variants[0].0,
                Some(mem) => {
                    let digits = mem.trim().trim_end_matches(['B', 'b']).trim_end_matches(['G', 'g']);
                    let gb: u32 =
                        digits.parse().map_err(|_| err(format!("memory {mem:?} of {name}: expected e.g. 80GB")))?;
                    if !model.variants.iter().any(|v| v.0 == gb) {
                        return Err(err(format!("{} comes with {}", model.key, known_sizes(model))));
                    }
                    gb
                }
            };
            groups.push(SimulatedGroup { count, model: model.key, memory_gb });
        }
        Ok(SimulatedSpec { groups })
    }
}

fn known_sizes(m: &Model) -> String {
    m.variants.iter().map(|v| format!("{}GB", v.0)).collect::<Vec<_>>().join(" or ")
}

impl fmt::Display for SimulatedSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> =
            self.groups.iter().map(|g| format!("{}x{}-{}GB", g.count, g.model, g.memory_gb)).collect();
        f.write_str(&parts.join(","))
    }
}

/// FNV-1a: a hash that stays the same across Rust versions and runs (std's hasher does
/// not promise that), so a host keeps its simulated UUIDs across restarts.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// A UUID shaped like a real one (`GPU-8-4-4-4-12` hex digits) whose third and fourth groups
/// spell "SIM" in ASCII hex (`5349-4d..`), so a person can tell it apart in logs.
pub fn simulated_uuid(host: &str, index: u32) -> String {
    let h = fnv1a(host);
    let tail = fnv1a(&format!("{host}/{index}")) & 0xffff_ffff_ffff;
    format!("GPU-{:08x}-5349-4d{:02x}-{:04x}-{tail:012x}", h >> 32, (h >> 24) & 0xff, index & 0xffff)
}

/// A simulated GPU host. Samples are deterministic (an idle GPU) until a test or the
/// simulator changes a GPU's state with [`SimulatedGpus::set`].
#[derive(Debug)]
pub struct SimulatedGpus {
    spec: SimulatedSpec,
    table: StateTable,
}

impl SimulatedGpus {
    /// Default driver and CUDA versions reported by simulated GPUs.
    pub const DRIVER: &'static str = "550.54.15";
    pub const CUDA: &'static str = "12.4";

    /// GPUs for `spec` on host `host`, with device nodes `/dev/nvidia{i}`.
    pub fn from_spec(spec: &str, host: &str) -> Result<Self, GpuError> {
        Self::build(spec.parse()?, host, Path::new("/dev"), None)
    }

    /// Full control: device nodes `{device_dir}/nvidia{i}` (tests point this at fake device
    /// files) and optionally other driver/CUDA versions.
    pub fn build(
        spec: SimulatedSpec,
        host: &str,
        device_dir: &Path,
        versions: Option<(Version, Version)>,
    ) -> Result<Self, GpuError> {
        let (driver, cuda) = versions.unwrap_or_else(|| (Version::new(vec![550, 54, 15]), Version::new(vec![12, 4])));
        let mut gpus = Vec::new();
        for g in &spec.groups {
            let model = MODELS.iter().find(|m| m.key == g.model).ok_or_else(|| GpuError::SimSpec {
                spec: spec.to_string(),
                detail: format!("unknown model {}", g.model),
            })?;
            let variant = model.variants.iter().find(|v| v.0 == g.memory_gb).unwrap_or(&model.variants[0]);
            for _ in 0..g.count {
                let index = gpus.len() as u32;
                let node: PathBuf = device_dir.join(format!("nvidia{index}"));
                gpus.push(GpuInfo {
                    uuid: simulated_uuid(host, index),
                    index,
                    name: variant.1.to_string(),
                    memory: Bytes::from_mib(variant.2),
                    compute_capability: ComputeCapability { major: model.cc.0, minor: model.cc.1 },
                    driver_version: driver.clone(),
                    cuda_driver_version: Some(cuda.clone()),
                    mig_enabled: Some(false),
                    mig_instances: Vec::new(),
                    ecc_enabled: Some(!model.key.starts_with("RTX")),
                    persistence_mode: Some(true),
                    pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + index * 0x10),
                    device_node: node.to_string_lossy().into_owned(),
                    simulated: true,
                });
            }
        }
        Ok(SimulatedGpus { spec, table: StateTable::new(BackendKind::Simulated, gpus) })
    }

    pub fn spec(&self) -> &SimulatedSpec {
        &self.spec
    }

    pub fn gpus(&self) -> &[GpuInfo] {
        self.table.gpus()
    }

    /// Change a simulated GPU's state (load, memory, errors) for what follows.
    pub fn set(&self, uuid: &str, f: impl FnOnce(&mut FakeGpuState)) -> Result<(), GpuError> {
        self.table.update(uuid, f)
    }
}

impl GpuBackend for SimulatedGpus {
    fn kind(&self) -> BackendKind {
        BackendKind::Simulated
    }
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.table.inventory()
    }
    fn sample(&self, uuid: &str) -> Result<GpuSample, GpuError> {
        self.table.sample(uuid)
    }
    fn processes(&self, uuid: &str) -> Result<Vec<GpuProcess>, GpuError> {
        self.table.processes(uuid)
    }
    fn health_counters(&self, uuid: &str) -> Result<HealthCounters, GpuError> {
        self.table.health_counters(uuid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let s: SimulatedSpec = "4xH100-80GB".parse().unwrap();
        assert_eq!(s.groups, vec![SimulatedGroup { count: 4, model: "H100", memory_gb: 80 }]);
        let s: SimulatedSpec = "2xA100-40GB, 2xl4-24gb".parse().unwrap();
        assert_eq!(s.to_string(), "2xA100-40GB,2xL4-24GB");
        assert_eq!("8xH100".parse::<SimulatedSpec>().unwrap().groups[0].count, 8);
        assert_eq!("RTX4090".parse::<SimulatedSpec>().unwrap().groups[0].count, 1);
        assert_eq!("A100".parse::<SimulatedSpec>().unwrap().groups[0].memory_gb, 80);
    }

    #[test]
    fn rejects_bad_specs_with_the_known_list() {
        let e = "2xB200".parse::<SimulatedSpec>().unwrap_err().to_string();
        assert!(
            e.contains("unknown model \"B200\"") && e.contains("H100 (80GB)") && e.contains("A100 (80GB/40GB)"),
            "{e}"
        );
        let e = "A100-24GB".parse::<SimulatedSpec>().unwrap_err().to_string();
        assert!(e.contains("A100 comes with 80GB or 40GB"), "{e}");
        assert!("0xH100".parse::<SimulatedSpec>().is_err());
        assert!("H100,,L4".parse::<SimulatedSpec>().is_err());
    }

    #[test]
    fn inventory_is_marked_simulated_and_indexed() {
        let sim = SimulatedGpus::build("2xA100-40GB,1xL4".parse().unwrap(), "host-a", Path::new("/tmp/fake-dev"), None)
            .unwrap();
        let inv = sim.inventory().unwrap();
        assert_eq!(inv.len(), 3);
        assert!(inv.iter().all(|g| g.simulated));
        assert_eq!(inv[2].name, "NVIDIA L4");
        assert_eq!(inv[2].index, 2);
        assert_eq!(inv[2].compute_capability, ComputeCapability { major: 8, minor: 9 });
        assert_eq!(inv[1].device_node, "/tmp/fake-dev/nvidia1");
        assert_eq!(inv[0].memory.mib(), 40_960);
    }

    #[test]
    fn uuids_are_stable_per_host_and_differ_between_hosts() {
        let a = simulated_uuid("host-a", 0);
        assert_eq!(a, simulated_uuid("host-a", 0));
        assert_ne!(a, simulated_uuid("host-b", 0));
        assert_ne!(a, simulated_uuid("host-a", 1));
        let groups: Vec<usize> = a.trim_start_matches("GPU-").split('-').map(str::len).collect();
        assert_eq!(groups, vec![8, 4, 4, 4, 12], "{a}");
        assert!(a.contains("-5349-4d"));
    }

    #[test]
    fn samples_follow_state() {
        let sim = SimulatedGpus::from_spec("1xH100", "h").unwrap();
        let u = sim.gpus()[0].uuid.clone();
        assert_eq!(sim.sample(&u).unwrap().utilization_pct, Some(0));
        sim.set(&u, |s| s.utilization_pct = 97).unwrap();
        assert_eq!(sim.sample(&u).unwrap().utilization_pct, Some(97));
    }
}
