//! The inventory trait and the plain data it returns.

use gpuci_core::gpu::GpuInfo;
use gpuci_core::quantity::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Which implementation answered. Shown by `doctor` and the agent so a person knows
/// whether the facts came from the driver, from `nvidia-smi`, or from a simulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    Nvml,
    NvidiaSmi,
    Simulated,
    Fake,
    /// No NVIDIA GPU was found; the inventory is empty.
    None,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Nvml => "NVML",
            BackendKind::NvidiaSmi => "nvidia-smi",
            BackendKind::Simulated => "simulated",
            BackendKind::Fake => "fake",
            BackendKind::None => "none",
        })
    }
}

/// One telemetry reading of one GPU. Fields a GPU or backend cannot report are `None`
/// rather than 0, so a missing power sensor never reads as "idle".
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    /// Percent of the last sample period a kernel was running (0..=100).
    pub utilization_pct: Option<u32>,
    pub memory_used: Bytes,
    pub power_watts: Option<f64>,
    pub temperature_c: Option<u32>,
}

/// A process holding a compute context on a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuProcess {
    pub pid: u32,
    /// `None` where the driver does not say (e.g. some containers, WDDM).
    pub used_memory: Option<Bytes>,
}

/// Counters the health gate compares against a baseline. A counter the GPU or backend
/// cannot read is `None`; the gate then neither passes nor fails on it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthCounters {
    /// Critical Xid events seen since this backend started watching (NVML event sets).
    /// `None` where events cannot be watched (nvidia-smi, or the GPU does not support them).
    pub xid_errors: Option<u64>,
    /// The last Xid code seen, for the quarantine reason ("Xid 79" means fell off the bus).
    pub last_xid: Option<u64>,
    /// Pages retired for single- plus double-bit ECC errors (pre-Hopper; Hopper remaps rows).
    pub retired_pages: Option<u64>,
    /// A page retirement waits for a GPU reset: the GPU must not take jobs until then.
    pub retired_pages_pending: Option<bool>,
    /// Uncorrectable ECC errors since the driver loaded (volatile counter).
    pub ecc_uncorrectable_volatile: Option<u64>,
    pub temperature_c: Option<u32>,
    /// The temperature at which the GPU starts slowing its clocks.
    pub slowdown_temperature_c: Option<u32>,
    pub memory_used: Bytes,
    pub memory_total: Bytes,
}

/// Why a GPU backend could not answer. Every variant names the GPU or command involved.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// The driver or tool did not answer (driver crashed, GPU fell off the bus, timeout).
    #[error("{backend} did not answer{}: {detail}", for_gpu(.uuid))]
    NotAnswering { backend: BackendKind, uuid: Option<String>, detail: String },
    #[error("no GPU with UUID {uuid} on this host")]
    UnknownGpu { uuid: String },
    #[error("cannot parse nvidia-smi {what}: {detail} (in {line:?})")]
    Parse { what: &'static str, line: String, detail: String },
    #[error("invalid simulated GPU spec {spec:?}: {detail}")]
    SimSpec { spec: String, detail: String },
    #[error("no NVIDIA GPU found ({reason})")]
    NoGpu { reason: String },
}

fn for_gpu(uuid: &Option<String>) -> String {
    uuid.as_ref().map(|u| format!(" for {u}")).unwrap_or_default()
}

impl GpuError {
    /// Worth asking again shortly (a busy driver, a slow `nvidia-smi`); a missing GPU or a
    /// bad spec will not fix itself.
    pub fn is_transient(&self) -> bool {
        matches!(self, GpuError::NotAnswering { .. })
    }
}

/// Everything the rest of gpuci reads from GPUs goes through this trait, so the whole
/// system runs in tests with [`crate::FakeGpus`] or [`crate::SimulatedGpus`].
///
/// Calls are synchronous and short: NVML answers in microseconds to milliseconds,
/// `nvidia-smi` runs under a timeout. Async callers with many GPUs may move them to a
/// blocking thread.
pub trait GpuBackend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// All GPUs on the host, ordered by index.
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError>;
    fn sample(&self, uuid: &str) -> Result<GpuSample, GpuError>;
    /// Processes with a compute context on the GPU.
    fn processes(&self, uuid: &str) -> Result<Vec<GpuProcess>, GpuError>;
    fn health_counters(&self, uuid: &str) -> Result<HealthCounters, GpuError>;
}
