//! gpuci-gpu: facts about the GPUs on this host, and checks over those facts.
//!
//! What lives here:
//! - [`GpuBackend`], the one narrow trait through which everything reads GPUs, with four
//!   implementations: [`NvmlBackend`] (real, loads `libnvidia-ml.so` at run time),
//!   [`NvidiaSmi`] (fallback that parses `nvidia-smi` CSV), [`SimulatedGpus`] (from a spec
//!   such as `4xH100-80GB`, always marked `simulated`) and [`FakeGpus`] (a recording fake
//!   whose state tests mutate). [`detect()`] picks one and keeps the reason when none works.
//! - [`health`]: the pre-job and post-job gate, pure decisions over data read through the
//!   trait (`Healthy` or `Quarantine` with reasons a person can act on).
//! - [`telemetry`]: a pure accumulator (peak memory, mean utilisation, GPU-seconds) and an
//!   async sampler that stops on a handed-in cancellation token.
//! - [`doctor`](mod@doctor): host checks (driver, CUDA, device nodes, sandbox, container runtime, probes)
//!   returned as data; the CLI prints them. External commands go through [`CommandRunner`].
//!
//! What must not live here: scheduling or placement (that is `gpuci-core`), killing
//! processes or touching cgroups (the sandbox/agent do that with the pids we report),
//! or any decision about *which job* gets a GPU. This crate reports facts and check
//! results; callers decide what to do with them.

// A failed unwrap in a test is the test failing, with the value in the message.
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod backend;
pub mod command;
pub mod detect;
pub mod doctor;
pub mod fake;
pub mod health;
pub mod nvml;
pub mod only;
pub mod sim;
pub mod smi;
pub mod telemetry;

pub use backend::{BackendKind, GpuBackend, GpuError, GpuProcess, GpuSample, HealthCounters};
pub use command::{CommandError, CommandOutput, CommandRunner, FakeRunner, SystemRunner};
pub use detect::{detect, DetectOptions, Detection, NoGpus};
pub use doctor::{
    check_runner_install, doctor, doctor_passed, format_table, CheckStatus, DoctorCheck, DoctorOptions, Probe,
    DEFAULT_RUNNER_DIR,
};
pub use fake::{FakeCall, FakeGpuState, FakeGpus};
pub use health::{
    leftover_processes, post_job_check, pre_job_check, CheckResult, HealthBaseline, HealthPolicy, MemoryLimit,
    QuarantineReason,
};
pub use nvml::NvmlBackend;
pub use only::{GpuRef, OnlyGpus};
pub use sim::{SimulatedGpus, SimulatedSpec};
pub use smi::NvidiaSmi;
pub use telemetry::{sample_loop, GpuTelemetry, Telemetry, TelemetrySummary};
