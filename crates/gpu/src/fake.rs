//! [`FakeGpus`]: a recording fake for tests across the workspace (agent, coordinator),
//! plus the per-GPU state table it shares with the simulated backend.

use crate::backend::{BackendKind, GpuBackend, GpuError, GpuProcess, GpuSample, HealthCounters};
use crate::command::lock;
use gpuci_core::gpu::GpuInfo;
use gpuci_core::quantity::Bytes;
use std::collections::HashMap;
use std::sync::Mutex;

/// The mutable state of one fake or simulated GPU. Tests change it to make a GPU dirty,
/// hot, broken or silent.
#[derive(Clone, Debug, PartialEq)]
pub struct FakeGpuState {
    pub processes: Vec<GpuProcess>,
    pub memory_used: Bytes,
    pub utilization_pct: u32,
    pub power_watts: f64,
    pub temperature_c: u32,
    pub slowdown_temperature_c: u32,
    pub xid_errors: u64,
    pub last_xid: Option<u64>,
    pub retired_pages: u64,
    pub retired_pages_pending: bool,
    pub ecc_uncorrectable_volatile: u64,
    /// `Some(detail)`: every call about this GPU fails as if NVML stopped answering.
    pub not_answering: Option<String>,
}

impl Default for FakeGpuState {
    /// An idle, healthy GPU.
    fn default() -> Self {
        FakeGpuState {
            processes: Vec::new(),
            memory_used: Bytes::from_mib(4),
            utilization_pct: 0,
            power_watts: 60.0,
            temperature_c: 35,
            slowdown_temperature_c: 87,
            xid_errors: 0,
            last_xid: None,
            retired_pages: 0,
            retired_pages_pending: false,
            ecc_uncorrectable_volatile: 0,
            not_answering: None,
        }
    }
}

/// GPU facts plus per-UUID state, answering the [`GpuBackend`] calls. Shared by
/// [`FakeGpus`] and [`crate::SimulatedGpus`].
#[derive(Debug)]
pub(crate) struct StateTable {
    kind: BackendKind,
    gpus: Vec<GpuInfo>,
    state: Mutex<HashMap<String, FakeGpuState>>,
}

impl StateTable {
    pub(crate) fn new(kind: BackendKind, gpus: Vec<GpuInfo>) -> Self {
        let state = gpus.iter().map(|g| (g.uuid.clone(), FakeGpuState::default())).collect();
        StateTable { kind, gpus, state: Mutex::new(state) }
    }

    pub(crate) fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    pub(crate) fn update(&self, uuid: &str, f: impl FnOnce(&mut FakeGpuState)) -> Result<(), GpuError> {
        let mut state = lock(&self.state);
        let s = state.get_mut(uuid).ok_or_else(|| GpuError::UnknownGpu { uuid: uuid.to_string() })?;
        f(s);
        Ok(())
    }

    pub(crate) fn get(&self, uuid: &str) -> Result<FakeGpuState, GpuError> {
        let state = lock(&self.state);
        let s = state.get(uuid).ok_or_else(|| GpuError::UnknownGpu { uuid: uuid.to_string() })?;
        match &s.not_answering {
            Some(detail) => {
                Err(GpuError::NotAnswering { backend: self.kind, uuid: Some(uuid.to_string()), detail: detail.clone() })
            }
            None => Ok(s.clone()),
        }
    }

    pub(crate) fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let state = lock(&self.state);
        // A GPU that stopped answering makes the whole inventory fail, as NVML does when
        // one device handle errors during enumeration.
        if let Some((uuid, s)) = state.iter().find(|(_, s)| s.not_answering.is_some()) {
            return Err(GpuError::NotAnswering {
                backend: self.kind,
                uuid: Some(uuid.clone()),
                detail: s.not_answering.clone().unwrap_or_default(),
            });
        }
        Ok(self.gpus.clone())
    }

    pub(crate) fn sample(&self, uuid: &str) -> Result<GpuSample, GpuError> {
        let s = self.get(uuid)?;
        Ok(GpuSample {
            utilization_pct: Some(s.utilization_pct),
            memory_used: s.memory_used,
            power_watts: Some(s.power_watts),
            temperature_c: Some(s.temperature_c),
        })
    }

    pub(crate) fn processes(&self, uuid: &str) -> Result<Vec<GpuProcess>, GpuError> {
        Ok(self.get(uuid)?.processes)
    }

    pub(crate) fn health_counters(&self, uuid: &str) -> Result<HealthCounters, GpuError> {
        let s = self.get(uuid)?;
        let total = self.gpus.iter().find(|g| g.uuid == uuid).map(|g| g.memory).unwrap_or_default();
        Ok(HealthCounters {
            xid_errors: Some(s.xid_errors),
            last_xid: s.last_xid,
            retired_pages: Some(s.retired_pages),
            retired_pages_pending: Some(s.retired_pages_pending),
            ecc_uncorrectable_volatile: Some(s.ecc_uncorrectable_volatile),
            temperature_c: Some(s.temperature_c),
            slowdown_temperature_c: Some(s.slowdown_temperature_c),
            memory_used: s.memory_used,
            memory_total: total,
        })
    }
}

/// One call made to a [`FakeGpus`], in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FakeCall {
    Inventory,
    Sample(String),
    Processes(String),
    HealthCounters(String),
}

/// A recording fake GPU backend. Public (not `cfg(test)`) so agent and coordinator tests
/// can use it.
///
/// ```
/// use gpuci_gpu::{FakeGpus, GpuBackend, SimulatedGpus};
/// let fake = FakeGpus::new(SimulatedGpus::from_spec("2xH100", "test-host").unwrap().gpus().to_vec());
/// let uuid = fake.uuids()[0].clone();
/// fake.set(&uuid, |s| s.xid_errors += 1);
/// assert_eq!(fake.health_counters(&uuid).unwrap().xid_errors, Some(1));
/// ```
#[derive(Debug)]
pub struct FakeGpus {
    table: StateTable,
    calls: Mutex<Vec<FakeCall>>,
}

impl FakeGpus {
    pub fn new(gpus: Vec<GpuInfo>) -> Self {
        FakeGpus { table: StateTable::new(BackendKind::Fake, gpus), calls: Mutex::new(Vec::new()) }
    }

    pub fn gpus(&self) -> &[GpuInfo] {
        self.table.gpus()
    }

    pub fn uuids(&self) -> Vec<String> {
        self.table.gpus().iter().map(|g| g.uuid.clone()).collect()
    }

    /// Change the state of one GPU.
    ///
    /// # Panics
    /// If `uuid` is not one of this fake's GPUs: that is a bug in the test.
    pub fn set(&self, uuid: &str, f: impl FnOnce(&mut FakeGpuState)) {
        if let Err(e) = self.table.update(uuid, f) {
            panic!("FakeGpus::set: {e}");
        }
    }

    /// The state of one GPU as it is now (ignores `not_answering`).
    pub fn state(&self, uuid: &str) -> Option<FakeGpuState> {
        lock(&self.table.state).get(uuid).cloned()
    }

    /// Every call made so far, in order.
    pub fn calls(&self) -> Vec<FakeCall> {
        lock(&self.calls).clone()
    }

    fn record(&self, call: FakeCall) {
        lock(&self.calls).push(call);
    }
}

impl GpuBackend for FakeGpus {
    fn kind(&self) -> BackendKind {
        BackendKind::Fake
    }
    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.record(FakeCall::Inventory);
        self.table.inventory()
    }
    fn sample(&self, uuid: &str) -> Result<GpuSample, GpuError> {
        self.record(FakeCall::Sample(uuid.to_string()));
        self.table.sample(uuid)
    }
    fn processes(&self, uuid: &str) -> Result<Vec<GpuProcess>, GpuError> {
        self.record(FakeCall::Processes(uuid.to_string()));
        self.table.processes(uuid)
    }
    fn health_counters(&self, uuid: &str) -> Result<HealthCounters, GpuError> {
        self.record(FakeCall::HealthCounters(uuid.to_string()));
        self.table.health_counters(uuid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimulatedGpus;

    fn fake() -> FakeGpus {
        FakeGpus::new(SimulatedGpus::from_spec("2xA100-40GB", "h").unwrap().gpus().to_vec())
    }

    #[test]
    fn records_calls_and_reflects_state() {
        let f = fake();
        let u = f.uuids()[1].clone();
        f.set(&u, |s| {
            s.memory_used = Bytes(3 << 30);
            s.processes.push(GpuProcess { pid: 42, used_memory: None });
        });
        assert_eq!(f.sample(&u).unwrap().memory_used, Bytes(3 << 30));
        assert_eq!(f.processes(&u).unwrap()[0].pid, 42);
        assert_eq!(f.inventory().unwrap().len(), 2);
        assert_eq!(f.calls(), vec![FakeCall::Sample(u.clone()), FakeCall::Processes(u.clone()), FakeCall::Inventory]);
    }

    #[test]
    fn silent_gpu_fails_every_call() {
        let f = fake();
        let u = f.uuids()[0].clone();
        f.set(&u, |s| s.not_answering = Some("GPU is lost".into()));
        let e = f.health_counters(&u).unwrap_err();
        assert!(e.to_string().contains("GPU is lost"), "{e}");
        assert!(f.inventory().is_err());
        assert!(matches!(f.sample("GPU-nope"), Err(GpuError::UnknownGpu { .. })));
    }
}
