//! The NVML backend. `nvml-wrapper` loads `libnvidia-ml.so` when [`NvmlBackend::init`] runs,
//! so the binary starts on hosts without NVIDIA and `init` returns the reason instead.
//!
//! Real: every `GpuInfo` field, samples, compute processes (including those inside MIG
//! instances), retired pages, pending retirement, volatile uncorrectable ECC, temperature
//! and the slowdown threshold. Best effort: MIG instances (profile parsed from the MIG
//! device name), and Xid counting: a background thread waits on an NVML event set for
//! critical Xid errors, so counts start when this backend starts and are `None` on GPUs
//! that cannot register the event. Hopper row remapping is not read (the wrapper does not
//! expose it); uncorrectable ECC counts still catch those failures.

use crate::backend::{BackendKind, GpuBackend, GpuError, GpuProcess, GpuSample, HealthCounters};
use crate::command::lock;
use gpuci_core::gpu::{ComputeCapability, GpuInfo, MigInstance, Version};
use gpuci_core::quantity::Bytes;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, RetirementCause, TemperatureSensor, TemperatureThreshold,
};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// `nvmlDeviceGetMigMode` reports 1 for enabled.
const MIG_ENABLED: u32 = 1;

#[derive(Debug, Default)]
struct XidCounts {
    /// Per GPU UUID: (events seen, last Xid code). Only GPUs registered for the event.
    by_uuid: HashMap<String, (u64, Option<u64>)>,
}

pub struct NvmlBackend {
    nvml: Arc<Nvml>,
    xids: Arc<Mutex<XidCounts>>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend").finish_non_exhaustive()
    }
}

impl Drop for NvmlBackend {
    fn drop(&mut self) {
        // The watcher wakes at least once a second and exits; no join, so drop never blocks.
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn not_answering(uuid: Option<&str>, op: &str, e: NvmlError) -> GpuError {
    GpuError::NotAnswering { backend: BackendKind::Nvml, uuid: uuid.map(str::to_string), detail: format!("{op}: {e}") }
}

/// NVML's CUDA driver version integer (`12040`) as `12.4`.
pub fn cuda_version_from_int(v: i32) -> Version {
    let v = v.max(0) as u32;
    Version::new(vec![v / 1000, (v % 1000) / 10])
}

/// The MIG profile from a MIG device name: `NVIDIA A100-SXM4-40GB MIG 1g.5gb` → `1g.5gb`.
pub fn mig_profile_from_name(name: &str) -> String {
    name.rsplit_once("MIG ").map(|(_, p)| p.trim().to_string()).unwrap_or_else(|| name.to_string())
}

impl NvmlBackend {
    /// Load NVML and start watching for Xid events. Fails on hosts without the library or
    /// with a driver that does not answer; the error says which.
    pub fn init() -> Result<Self, GpuError> {
        let nvml = Arc::new(Nvml::init().map_err(|e| not_answering(None, "loading NVML", e))?);
        let backend = NvmlBackend { nvml, xids: Arc::default(), stop: Arc::new(AtomicBool::new(false)) };
        backend.start_xid_watch();
        Ok(backend)
    }

    fn start_xid_watch(&self) {
        let (nvml, xids, stop) = (self.nvml.clone(), self.xids.clone(), self.stop.clone());
        let spawned =
            std::thread::Builder::new().name("gpuci-xid-watch".into()).spawn(move || watch_xids(&nvml, &xids, &stop));
        if let Err(e) = spawned {
            tracing::warn!("cannot start the Xid watcher, Xid errors will not be counted: {e}");
        }
    }

    fn device(&self, uuid: &str) -> Result<Device<'_>, GpuError> {
        self.nvml.device_by_uuid(uuid).map_err(|e| match e {
            NvmlError::NotFound | NvmlError::InvalidArg => GpuError::UnknownGpu { uuid: uuid.to_string() },
            e => not_answering(Some(uuid), "looking up the device", e),
        })
    }

    fn gpu_info(&self, d: &Device<'_>, driver: &Version, cuda: &Option<Version>) -> Result<GpuInfo, GpuError> {
        let uuid = d.uuid().map_err(|e| not_answering(None, "reading the UUID", e))?;
        let u = Some(uuid.as_str());
        let index = d.index().map_err(|e| not_answering(u, "reading the index", e))?;
        let cc = d.cuda_compute_capability().map_err(|e| not_answering(u, "reading the compute capability", e))?;
        let mig_enabled = d.mig_mode().ok().map(|m| m.current == MIG_ENABLED);
        let mig_instances = if mig_enabled == Some(true) { mig_instances(d) } else { Vec::new() };
        // Device nodes follow the minor number, which need not equal the NVML index.
        let minor = d.minor_number().unwrap_or(index);
        Ok(GpuInfo {
            index,
            name: d.name().map_err(|e| not_answering(u, "reading the name", e))?,
            memory: Bytes(d.memory_info().map_err(|e| not_answering(u, "reading memory", e))?.total),
            compute_capability: ComputeCapability { major: cc.major.max(0) as u32, minor: cc.minor.max(0) as u32 },
            driver_version: driver.clone(),
            cuda_driver_version: cuda.clone(),
            mig_enabled,
            mig_instances,
            ecc_enabled: d.is_ecc_enabled().ok().map(|s| s.currently_enabled),
            persistence_mode: d.is_in_persistent_mode().ok(),
            pci_bus_id: d.pci_info().map(|p| p.bus_id).unwrap_or_default(),
            device_node: format!("/dev/nvidia{minor}"),
            simulated: false,
            uuid,
        })
    }
}

/// MIG devices of a GPU in MIG mode. Slots without an instance answer NotFound and are
/// skipped; any other error ends the listing (best effort).
fn mig_instances(d: &Device<'_>) -> Vec<MigInstance> {
    let max = d.mig_device_count().unwrap_or(0);
    let mut out = Vec::new();
    for i in 0..max {
        let mig = match d.mig_device_by_index(i) {
            Ok(m) => m,
            Err(NvmlError::NotFound) | Err(NvmlError::InvalidArg) => continue,
            Err(e) => {
                tracing::debug!("listing MIG devices stopped at slot {i}: {e}");
                break;
            }
        };
        if let (Ok(uuid), Ok(name)) = (mig.uuid(), mig.name()) {
            let memory = mig.memory_info().map(|m| Bytes(m.total)).unwrap_or_default();
            out.push(MigInstance { uuid, profile: mig_profile_from_name(&name), memory });
        }
    }
    out
}

fn watch_xids(nvml: &Nvml, xids: &Mutex<XidCounts>, stop: &AtomicBool) {
    let count = match nvml.device_count() {
        Ok(n) => n,
        Err(e) => return tracing::warn!("Xid watcher: cannot count devices: {e}"),
    };
    let mut set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => return tracing::warn!("Xid watcher: cannot create an NVML event set: {e}"),
    };
    let mut registered = 0;
    for i in 0..count {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        let Ok(uuid) = d.uuid() else { continue };
        if !d.supported_event_types().is_ok_and(|t| t.contains(EventTypes::CRITICAL_XID_ERROR)) {
            tracing::info!("{uuid} cannot report Xid events; its Xid count stays unknown");
            continue;
        }
        set = match d.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(s) => {
                lock(xids).by_uuid.insert(uuid, (0, None));
                registered += 1;
                s
            }
            Err(e) => {
                // A failed registration releases the set; start a new one for the rest.
                tracing::warn!("{uuid}: cannot register for Xid events: {}", e.error);
                match nvml.create_event_set() {
                    Ok(s) => s,
                    Err(e) => return tracing::warn!("Xid watcher: cannot create an NVML event set: {e}"),
                }
            }
        };
    }
    if registered == 0 {
        return;
    }
    while !stop.load(Ordering::Relaxed) {
        match set.wait(1000) {
            Ok(ev) => {
                let code = match ev.event_data {
                    Some(XidError::Value(v)) => Some(v),
                    _ => None,
                };
                if let Ok(uuid) = ev.device.uuid() {
                    tracing::warn!("{uuid}: Xid {}", code.map_or("?".to_string(), |c| c.to_string()));
                    let mut x = lock(xids);
                    let entry = x.by_uuid.entry(uuid).or_insert((0, None));
                    entry.0 += 1;
                    entry.1 = code.or(entry.1);
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::debug!("Xid watcher: waiting for events failed: {e}");
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
    }
}

impl GpuBackend for NvmlBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Nvml
    }

    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let n = self.nvml.device_count().map_err(|e| not_answering(None, "counting devices", e))?;
        let driver_text =
            self.nvml.sys_driver_version().map_err(|e| not_answering(None, "reading the driver version", e))?;
        let driver = Version::parse(&driver_text).unwrap_or_else(|| Version::new(vec![0]));
        let cuda = self.nvml.sys_cuda_driver_version().ok().map(cuda_version_from_int);
        let mut gpus = Vec::with_capacity(n as usize);
        for i in 0..n {
            let d = self.nvml.device_by_index(i).map_err(|e| not_answering(None, &format!("opening device {i}"), e))?;
            gpus.push(self.gpu_info(&d, &driver, &cuda)?);
        }
        gpus.sort_by_key(|g| g.index);
        Ok(gpus)
    }

    fn sample(&self, uuid: &str) -> Result<GpuSample, GpuError> {
        let d = self.device(uuid)?;
        let mem = d.memory_info().map_err(|e| not_answering(Some(uuid), "reading memory", e))?;
        Ok(GpuSample {
            utilization_pct: d.utilization_rates().ok().map(|u| u.gpu),
            memory_used: Bytes(mem.used),
            power_watts: d.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
            temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
        })
    }

    fn processes(&self, uuid: &str) -> Result<Vec<GpuProcess>, GpuError> {
        let d = self.device(uuid)?;
        let mut procs =
            d.running_compute_processes().map_err(|e| not_answering(Some(uuid), "listing compute processes", e))?;
        // In MIG mode the processes live on the MIG devices; ask each one too.
        if d.mig_mode().is_ok_and(|m| m.current == MIG_ENABLED) {
            for i in 0..d.mig_device_count().unwrap_or(0) {
                if let Ok(p) = d.mig_device_by_index(i).and_then(|m| m.running_compute_processes()) {
                    procs.extend(p);
                }
            }
        }
        let mut out: Vec<GpuProcess> = procs
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid,
                used_memory: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(Bytes(b)),
                    UsedGpuMemory::Unavailable => None,
                },
            })
            .collect();
        out.sort_by_key(|p| p.pid);
        out.dedup_by_key(|p| p.pid);
        Ok(out)
    }

    fn health_counters(&self, uuid: &str) -> Result<HealthCounters, GpuError> {
        let d = self.device(uuid)?;
        // Memory is the one reading every GPU supports: if it fails, NVML is not answering.
        let mem = d.memory_info().map_err(|e| not_answering(Some(uuid), "reading memory", e))?;
        let retired = |cause| d.retired_pages(cause).map(|p| p.len() as u64);
        let retired_pages =
            match (retired(RetirementCause::MultipleSingleBitEccErrors), retired(RetirementCause::DoubleBitEccError)) {
                (Ok(a), Ok(b)) => Some(a + b),
                (Ok(a), Err(_)) | (Err(_), Ok(a)) => Some(a),
                (Err(_), Err(_)) => None,
            };
        let (xid_errors, last_xid) = match lock(&self.xids).by_uuid.get(uuid) {
            Some(&(n, last)) => (Some(n), last),
            None => (None, None),
        };
        Ok(HealthCounters {
            xid_errors,
            last_xid,
            retired_pages,
            retired_pages_pending: d.are_pages_pending_retired().ok(),
            ecc_uncorrectable_volatile: d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).ok(),
            temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
            slowdown_temperature_c: d.temperature_threshold(TemperatureThreshold::Slowdown).ok(),
            memory_used: Bytes(mem.used),
            memory_total: Bytes(mem.total),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_version_integer() {
        assert_eq!(cuda_version_from_int(12040), Version::new(vec![12, 4]));
        assert_eq!(cuda_version_from_int(11080), Version::new(vec![11, 8]));
        assert_eq!(cuda_version_from_int(12020).to_string(), "12.2");
    }

    #[test]
    fn mig_profile() {
        assert_eq!(mig_profile_from_name("NVIDIA A100-SXM4-40GB MIG 1g.5gb"), "1g.5gb");
        assert_eq!(mig_profile_from_name("NVIDIA H100 80GB HBM3 MIG 3g.40gb"), "3g.40gb");
    }

    /// On hosts without NVIDIA this must fail cleanly (no panic, no abort), with a reason.
    #[test]
    fn init_fails_cleanly_without_nvidia() {
        match NvmlBackend::init() {
            Ok(b) => assert_eq!(b.kind(), BackendKind::Nvml),
            Err(e) => assert!(e.to_string().contains("NVML did not answer: loading NVML"), "{e}"),
        }
    }
}
