//! Choosing a backend: simulated if asked, else NVML, else `nvidia-smi`, else an empty
//! inventory that keeps the reason, so `doctor` and the agent can say why there is no GPU.

use crate::backend::{BackendKind, GpuBackend, GpuError, GpuProcess, GpuSample, HealthCounters};
use crate::command::{CommandRunner, SystemRunner};
use crate::nvml::NvmlBackend;
use crate::sim::SimulatedGpus;
use crate::smi::NvidiaSmi;
use gpuci_core::gpu::GpuInfo;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Clone)]
pub struct DetectOptions {
    /// A simulated inventory spec (`4xH100-80GB`); when set, nothing real is probed.
    pub simulate: Option<String>,
    /// Seeds simulated UUIDs, so two simulated agents on one machine differ.
    pub host: String,
    /// Where simulated device nodes live (`{dir}/nvidia{i}`); tests use a temp dir.
    pub simulated_device_dir: PathBuf,
    /// Skip NVML (tests, or a broken library that crashes the process).
    pub try_nvml: bool,
    pub runner: Arc<dyn CommandRunner>,
}

impl DetectOptions {
    pub fn new(host: impl Into<String>) -> Self {
        DetectOptions {
            simulate: None,
            host: host.into(),
            simulated_device_dir: PathBuf::from("/dev"),
            try_nvml: true,
            runner: Arc::new(SystemRunner),
        }
    }
}

/// The chosen backend and why the better ones were not chosen.
pub struct Detection {
    pub backend: Arc<dyn GpuBackend>,
    /// E.g. `["NVML: ... libnvidia-ml.so: cannot open shared object file"]` when falling
    /// back to nvidia-smi. Empty when the first choice worked.
    pub fallback_reasons: Vec<String>,
}

impl Detection {
    pub fn kind(&self) -> BackendKind {
        self.backend.kind()
    }
    /// Why there is no GPU, when there is none.
    pub fn no_gpu_reason(&self) -> Option<String> {
        (self.kind() == BackendKind::None).then(|| self.fallback_reasons.join("; "))
    }
}

/// Pick a backend. Fails only for an invalid `simulate` spec; a host without GPUs gets
/// [`NoGpus`] with the reasons.
pub fn detect(opts: &DetectOptions) -> Result<Detection, GpuError> {
    if let Some(spec) = &opts.simulate {
        let sim = SimulatedGpus::build(spec.parse()?, &opts.host, &opts.simulated_device_dir, None)?;
        return Ok(Detection { backend: Arc::new(sim), fallback_reasons: Vec::new() });
    }
    let mut reasons = Vec::new();
    if opts.try_nvml {
        match NvmlBackend::init() {
            Ok(nvml) => return Ok(Detection { backend: Arc::new(nvml), fallback_reasons: reasons }),
            Err(e) => reasons.push(format!("NVML: {}", strip_backend(&e))),
        }
    }
    let smi = NvidiaSmi::new(opts.runner.clone());
    match smi.inventory() {
        Ok(gpus) if !gpus.is_empty() => {
            tracing::info!("NVML unavailable ({}); using nvidia-smi", reasons.join("; "));
            return Ok(Detection { backend: Arc::new(smi), fallback_reasons: reasons });
        }
        Ok(_) => reasons.push("nvidia-smi: lists no GPU".to_string()),
        Err(e) => reasons.push(format!("nvidia-smi: {}", strip_backend(&e))),
    }
    let reason = reasons.join("; ");
    Ok(Detection { backend: Arc::new(NoGpus { reason }), fallback_reasons: reasons })
}

/// `NVML did not answer: loading NVML: x` reads better as `NVML: loading NVML: x`.
fn strip_backend(e: &GpuError) -> String {
    match e {
        GpuError::NotAnswering { detail, .. } => detail.clone(),
        e => e.to_string(),
    }
}

/// The backend of a host with no usable NVIDIA GPU: an empty inventory plus the reason.
#[derive(Clone, Debug)]
pub struct NoGpus {
    pub reason: String,
}

impl NoGpus {
    fn err(&self, uuid: &str) -> GpuError {
        GpuError::UnknownGpu { uuid: uuid.to_string() }
    }
}

impl GpuBackend for NoGpus {
    fn kind(&self) -> BackendKind {
        BackendKind::None
    }
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        Ok(Vec::new())
    }
    fn sample(&self, uuid: &str) -> Result<GpuSample, GpuError> {
        Err(self.err(uuid))
    }
    fn processes(&self, uuid: &str) -> Result<Vec<GpuProcess>, GpuError> {
        Err(self.err(uuid))
    }
    fn health_counters(&self, uuid: &str) -> Result<HealthCounters, GpuError> {
        Err(self.err(uuid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{CommandOutput, FakeRunner};

    #[test]
    fn simulated_when_asked() {
        let mut o = DetectOptions::new("h");
        o.simulate = Some("2xT4".into());
        let d = detect(&o).unwrap();
        assert_eq!(d.kind(), BackendKind::Simulated);
        assert_eq!(d.backend.inventory().unwrap().len(), 2);
        o.simulate = Some("2xB300".into());
        assert!(detect(&o).is_err());
    }

    #[test]
    fn falls_back_to_nvidia_smi_then_to_nothing_with_reasons() {
        let runner = Arc::new(FakeRunner::new());
        let mut o = DetectOptions::new("h");
        o.try_nvml = false;
        o.runner = runner.clone();
        let d = detect(&o).unwrap();
        assert_eq!(d.kind(), BackendKind::None);
        assert_eq!(d.no_gpu_reason().unwrap(), "nvidia-smi: command not found");
        assert!(d.backend.inventory().unwrap().is_empty());

        runner.on("nvidia-smi", Ok(CommandOutput::ok(include_str!("../fixtures/h100-query-gpu.csv"))));
        let d = detect(&o).unwrap();
        assert_eq!(d.kind(), BackendKind::NvidiaSmi);
        assert_eq!(d.no_gpu_reason(), None);
    }
}
