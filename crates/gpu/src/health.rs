//! The health gate: is this GPU fit to take a job, and did the last job leave it clean?
//!
//! The decisions ([`evaluate`]) are pure functions over [`HealthCounters`]; the two entry
//! points only read through [`GpuBackend`] and call them.
//!
//! After a job the agent does, in order:
//! 1. [`leftover_processes`]: compute processes still on the GPU. The caller kills them
//!    (the sandbox owns process-tree killing; this crate never sends signals).
//! 2. [`post_job_check`]: waits, bounded by the policy's timeout and the caller's
//!    cancellation, for the processes to go and memory to return to the baseline, then
//!    decides `Healthy` or `Quarantine` with every reason found.
//!
//! The baseline is taken when the GPU is first found healthy (agent start, or an operator
//! clearing a quarantine): any Xid, retired page or uncorrectable ECC error after it
//! quarantines the GPU until a person looks at it.

use crate::backend::{GpuBackend, GpuError, GpuProcess, HealthCounters};
use gpuci_core::quantity::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How much memory an idle GPU may show in use.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryLimit {
    Absolute(Bytes),
    /// A fraction (0.05 = 5%) of the GPU's total memory.
    FractionOfTotal(f64),
}

impl MemoryLimit {
    pub fn bytes(self, total: Bytes) -> Bytes {
        match self {
            MemoryLimit::Absolute(b) => b,
            MemoryLimit::FractionOfTotal(f) => Bytes((total.0 as f64 * f.clamp(0.0, 1.0)) as u64),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HealthPolicy {
    /// Pre-job: memory in use on an idle GPU above this means something holds it.
    pub idle_memory_limit: MemoryLimit,
    /// Post-job: memory counts as returned when within this much of the baseline.
    pub memory_tolerance: Bytes,
    /// Used only when the GPU does not report its slowdown temperature.
    pub fallback_max_temperature_c: u32,
    /// How long the post-job check waits for processes to exit and memory to be freed.
    pub post_job_timeout: Duration,
    pub poll_interval: Duration,
}

impl Default for HealthPolicy {
    /// 1 GiB idle memory, 256 MiB tolerance, 85 °C fallback, 30 s post-job wait, 500 ms polls.
    fn default() -> Self {
        HealthPolicy {
            idle_memory_limit: MemoryLimit::Absolute(Bytes(Bytes::GIB)),
            memory_tolerance: Bytes::from_mib(256),
            fallback_max_temperature_c: 85,
            post_job_timeout: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
        }
    }
}

/// Counters as they were when the GPU was last known good.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthBaseline {
    pub xid_errors: Option<u64>,
    pub retired_pages: Option<u64>,
    pub ecc_uncorrectable_volatile: Option<u64>,
    pub memory_used: Bytes,
}

impl HealthBaseline {
    pub fn from_counters(c: &HealthCounters) -> Self {
        HealthBaseline {
            xid_errors: c.xid_errors,
            retired_pages: c.retired_pages,
            ecc_uncorrectable_volatile: c.ecc_uncorrectable_volatile,
            memory_used: c.memory_used,
        }
    }

    pub fn capture(backend: &dyn GpuBackend, uuid: &str) -> Result<Self, GpuError> {
        Ok(Self::from_counters(&backend.health_counters(uuid)?))
    }
}

/// Why a GPU must not take jobs, specific enough for a person to act on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum QuarantineReason {
    NotAnswering { detail: String },
    Gone { uuid: String },
    ProcessesPresent { pids: Vec<u32> },
    MemoryInUse { used: Bytes, limit: Bytes },
    MemoryNotReturned { used: Bytes, baseline: Bytes, waited: Duration },
    NewXid { count: u64, last: Option<u64> },
    NewRetiredPages { count: u64 },
    RetirementPending,
    NewEccErrors { count: u64 },
    TooHot { temperature_c: u32, limit_c: u32 },
}

fn plural(n: u64, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

impl fmt::Display for QuarantineReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use QuarantineReason::*;
        match self {
            NotAnswering { detail } => write!(f, "{detail}"),
            Gone { uuid } => write!(f, "GPU {uuid} is no longer visible on this host"),
            ProcessesPresent { pids } if pids.len() == 1 => {
                write!(f, "process {} still holds the GPU", pids[0])
            }
            ProcessesPresent { pids } => {
                let p: Vec<String> = pids.iter().map(u32::to_string).collect();
                write!(f, "processes {} still hold the GPU", p.join(", "))
            }
            MemoryInUse { used, limit } => {
                write!(f, "memory used {used} with no job running (limit {limit})")
            }
            MemoryNotReturned { used, baseline, waited } => {
                write!(f, "memory used {used} did not return to baseline {baseline} within {}s", waited.as_secs())
            }
            NewXid { count, last } => {
                write!(f, "{} since last check", plural(*count, "new Xid error", "new Xid errors"))?;
                match last {
                    Some(x) => write!(f, " (last: Xid {x})"),
                    None => Ok(()),
                }
            }
            NewRetiredPages { count } => {
                write!(f, "{} since last check", plural(*count, "new retired page", "new retired pages"))
            }
            RetirementPending => write!(f, "a page retirement is pending until the GPU is reset"),
            NewEccErrors { count } => {
                write!(
                    f,
                    "{} since last check",
                    plural(*count, "new uncorrectable ECC error", "new uncorrectable ECC errors")
                )
            }
            TooHot { temperature_c, limit_c } => {
                write!(f, "temperature {temperature_c} °C is at or above the slowdown limit {limit_c} °C")
            }
        }
    }
}

impl From<GpuError> for QuarantineReason {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::UnknownGpu { uuid } => QuarantineReason::Gone { uuid },
            e => QuarantineReason::NotAnswering { detail: e.to_string() },
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum CheckResult {
    Healthy,
    Quarantine { reasons: Vec<QuarantineReason> },
}

impl CheckResult {
    fn from_reasons(reasons: Vec<QuarantineReason>) -> Self {
        if reasons.is_empty() {
            CheckResult::Healthy
        } else {
            CheckResult::Quarantine { reasons }
        }
    }
    pub fn is_healthy(&self) -> bool {
        matches!(self, CheckResult::Healthy)
    }
    /// All reasons in one line, `None` when healthy.
    pub fn reason(&self) -> Option<String> {
        match self {
            CheckResult::Healthy => None,
            CheckResult::Quarantine { reasons } => {
                Some(reasons.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))
            }
        }
    }
}

/// The counter rules, shared by both checks: new Xid / retired pages / uncorrectable ECC
/// since the baseline, a pending retirement, temperature at the slowdown limit. A counter
/// either side cannot read is skipped, never guessed.
pub fn evaluate(c: &HealthCounters, baseline: &HealthBaseline, policy: &HealthPolicy) -> Vec<QuarantineReason> {
    let new = |now: Option<u64>, then: Option<u64>| match (now, then) {
        (Some(n), Some(t)) if n > t => Some(n - t),
        (Some(n), None) if n > 0 => Some(n),
        _ => None,
    };
    let mut reasons = Vec::new();
    if let Some(count) = new(c.xid_errors, baseline.xid_errors) {
        reasons.push(QuarantineReason::NewXid { count, last: c.last_xid });
    }
    if let Some(count) = new(c.retired_pages, baseline.retired_pages) {
        reasons.push(QuarantineReason::NewRetiredPages { count });
    }
    if c.retired_pages_pending == Some(true) {
        reasons.push(QuarantineReason::RetirementPending);
    }
    if let Some(count) = new(c.ecc_uncorrectable_volatile, baseline.ecc_uncorrectable_volatile) {
        reasons.push(QuarantineReason::NewEccErrors { count });
    }
    let limit_c = c.slowdown_temperature_c.unwrap_or(policy.fallback_max_temperature_c);
    if let Some(t) = c.temperature_c.filter(|&t| t >= limit_c) {
        reasons.push(QuarantineReason::TooHot { temperature_c: t, limit_c });
    }
    reasons
}

fn pids(procs: &[GpuProcess]) -> Vec<u32> {
    procs.iter().map(|p| p.pid).collect()
}

/// Before a job: NVML answers, no compute process, memory below the idle limit, no new
/// errors since the baseline, not at the slowdown temperature.
pub fn pre_job_check(
    backend: &dyn GpuBackend,
    uuid: &str,
    baseline: &HealthBaseline,
    policy: &HealthPolicy,
) -> CheckResult {
    let counters = match backend.health_counters(uuid) {
        Ok(c) => c,
        Err(e) => return CheckResult::from_reasons(vec![e.into()]),
    };
    let procs = match backend.processes(uuid) {
        Ok(p) => p,
        Err(e) => return CheckResult::from_reasons(vec![e.into()]),
    };
    let mut reasons = Vec::new();
    if !procs.is_empty() {
        reasons.push(QuarantineReason::ProcessesPresent { pids: pids(&procs) });
    }
    let limit = policy.idle_memory_limit.bytes(counters.memory_total);
    if counters.memory_used > limit {
        reasons.push(QuarantineReason::MemoryInUse { used: counters.memory_used, limit });
    }
    reasons.extend(evaluate(&counters, baseline, policy));
    CheckResult::from_reasons(reasons)
}

/// After a job: the compute processes still on the GPU, for the caller to kill.
pub fn leftover_processes(backend: &dyn GpuBackend, uuid: &str) -> Result<Vec<GpuProcess>, GpuError> {
    backend.processes(uuid)
}

/// After a job (and after the caller killed [`leftover_processes`]): wait until no compute
/// process remains and memory is back within `policy.memory_tolerance` of the baseline,
/// polling every `policy.poll_interval` for at most `policy.post_job_timeout`. Cancellation
/// stops the wait and decides on what is seen at that moment.
pub async fn post_job_check(
    backend: &dyn GpuBackend,
    uuid: &str,
    baseline: &HealthBaseline,
    policy: &HealthPolicy,
    cancel: &CancellationToken,
) -> CheckResult {
    let start = tokio::time::Instant::now();
    let deadline = start + policy.post_job_timeout;
    let target = Bytes(baseline.memory_used.0.saturating_add(policy.memory_tolerance.0));
    loop {
        let (counters, procs) = match backend.health_counters(uuid).and_then(|c| Ok((c, backend.processes(uuid)?))) {
            Ok(x) => x,
            Err(e) => return CheckResult::from_reasons(vec![e.into()]),
        };
        let settled = procs.is_empty() && counters.memory_used <= target;
        let now = tokio::time::Instant::now();
        if settled || now >= deadline || cancel.is_cancelled() {
            let mut reasons = Vec::new();
            if !procs.is_empty() {
                reasons.push(QuarantineReason::ProcessesPresent { pids: pids(&procs) });
            }
            if counters.memory_used > target {
                reasons.push(QuarantineReason::MemoryNotReturned {
                    used: counters.memory_used,
                    baseline: baseline.memory_used,
                    waited: now - start,
                });
            }
            reasons.extend(evaluate(&counters, baseline, policy));
            return CheckResult::from_reasons(reasons);
        }
        let wake = (now + policy.poll_interval).min(deadline);
        tokio::select! {
            _ = tokio::time::sleep_until(wake) => {}
            _ = cancel.cancelled() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FakeGpus, SimulatedGpus};
    use std::sync::Arc;

    fn setup() -> (FakeGpus, String, HealthBaseline) {
        let fake = FakeGpus::new(SimulatedGpus::from_spec("2xH100", "h").unwrap().gpus().to_vec());
        let uuid = fake.uuids()[0].clone();
        let baseline = HealthBaseline::capture(&fake, &uuid).unwrap();
        (fake, uuid, baseline)
    }

    #[test]
    fn clean_gpu_is_healthy() {
        let (fake, uuid, base) = setup();
        assert_eq!(pre_job_check(&fake, &uuid, &base, &HealthPolicy::default()), CheckResult::Healthy);
    }

    #[test]
    fn dirty_gpu_is_quarantined_with_every_reason() {
        let (fake, uuid, base) = setup();
        fake.set(&uuid, |s| {
            s.memory_used = Bytes(3 << 30);
            s.processes.push(GpuProcess { pid: 1234, used_memory: Some(Bytes(3 << 30)) });
        });
        let r = pre_job_check(&fake, &uuid, &base, &HealthPolicy::default());
        assert_eq!(
            r.reason().unwrap(),
            "process 1234 still holds the GPU; memory used 3 GiB with no job running (limit 1 GiB)"
        );
    }

    #[test]
    fn memory_limit_as_fraction() {
        let (fake, uuid, base) = setup();
        fake.set(&uuid, |s| s.memory_used = Bytes(3 << 30));
        let policy = HealthPolicy { idle_memory_limit: MemoryLimit::FractionOfTotal(0.05), ..Default::default() };
        // 5% of an H100's 79.6 GiB is ~4 GiB, so 3 GiB passes.
        assert!(pre_job_check(&fake, &uuid, &base, &policy).is_healthy());
    }

    #[test]
    fn xid_ecc_and_retired_pages_since_baseline_quarantine() {
        let (fake, uuid, base) = setup();
        fake.set(&uuid, |s| {
            s.xid_errors = 2;
            s.last_xid = Some(79);
            s.ecc_uncorrectable_volatile = 1;
            s.retired_pages = 3;
            s.retired_pages_pending = true;
        });
        let r = pre_job_check(&fake, &uuid, &base, &HealthPolicy::default()).reason().unwrap();
        assert_eq!(
            r,
            "2 new Xid errors since last check (last: Xid 79); 3 new retired pages since last check; \
             a page retirement is pending until the GPU is reset; 1 new uncorrectable ECC error since last check"
        );
        // Re-baselining (an operator cleared the GPU) makes old errors old news.
        let fresh = HealthBaseline::capture(&fake, &uuid).unwrap();
        fake.set(&uuid, |s| s.retired_pages_pending = false);
        assert!(pre_job_check(&fake, &uuid, &fresh, &HealthPolicy::default()).is_healthy());
    }

    #[test]
    fn too_hot_uses_the_slowdown_threshold() {
        let (fake, uuid, base) = setup();
        fake.set(&uuid, |s| {
            s.temperature_c = 88;
            s.slowdown_temperature_c = 87;
        });
        let r = pre_job_check(&fake, &uuid, &base, &HealthPolicy::default());
        assert_eq!(r.reason().unwrap(), "temperature 88 °C is at or above the slowdown limit 87 °C");
    }

    #[test]
    fn silent_nvml_quarantines() {
        let (fake, uuid, base) = setup();
        fake.set(&uuid, |s| s.not_answering = Some("GPU is lost".into()));
        let r = pre_job_check(&fake, &uuid, &base, &HealthPolicy::default());
        assert_eq!(r.reason().unwrap(), format!("fake did not answer for {uuid}: GPU is lost"));
        let r = pre_job_check(&fake, "GPU-gone", &base, &HealthPolicy::default());
        assert_eq!(r.reason().unwrap(), "GPU GPU-gone is no longer visible on this host");
    }

    #[tokio::test(start_paused = true)]
    async fn post_job_reports_leftovers_then_waits_for_memory() {
        let (fake, uuid, base) = setup();
        let fake = Arc::new(fake);
        fake.set(&uuid, |s| {
            s.memory_used = Bytes(20 << 30);
            s.processes.push(GpuProcess { pid: 777, used_memory: None });
        });
        assert_eq!(leftover_processes(fake.as_ref(), &uuid).unwrap()[0].pid, 777);
        // The caller kills 777; memory drains a little later.
        fake.set(&uuid, |s| s.processes.clear());
        let (f2, u2) = (fake.clone(), uuid.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            f2.set(&u2, |s| s.memory_used = Bytes::from_mib(4));
        });
        let t0 = tokio::time::Instant::now();
        let r = post_job_check(fake.as_ref(), &uuid, &base, &HealthPolicy::default(), &CancellationToken::new()).await;
        assert_eq!(r, CheckResult::Healthy);
        assert!(t0.elapsed() >= Duration::from_secs(5) && t0.elapsed() < Duration::from_secs(6));
    }

    #[tokio::test(start_paused = true)]
    async fn post_job_gives_up_at_the_deadline() {
        let (fake, uuid, base) = setup();
        fake.set(&uuid, |s| s.memory_used = Bytes((31 << 30) / 10));
        let base = HealthBaseline { memory_used: Bytes(512 << 20), ..base };
        let r = post_job_check(&fake, &uuid, &base, &HealthPolicy::default(), &CancellationToken::new()).await;
        assert_eq!(r.reason().unwrap(), "memory used 3.1 GiB did not return to baseline 512 MiB within 30s");
    }

    #[tokio::test(start_paused = true)]
    async fn post_job_reports_a_process_that_survived_the_kill() {
        let (fake, uuid, base) = setup();
        fake.set(&uuid, |s| s.processes.push(GpuProcess { pid: 1234, used_memory: None }));
        let cancel = CancellationToken::new();
        cancel.cancel();
        let t0 = tokio::time::Instant::now();
        let r = post_job_check(&fake, &uuid, &base, &HealthPolicy::default(), &cancel).await;
        assert_eq!(r.reason().unwrap(), "process 1234 still holds the GPU");
        assert_eq!(t0.elapsed(), Duration::ZERO, "a cancelled check decides at once");
    }

    #[tokio::test(start_paused = true)]
    async fn post_job_xid_during_the_job_quarantines() {
        let (fake, uuid, base) = setup();
        fake.set(&uuid, |s| s.xid_errors += 1);
        let r = post_job_check(&fake, &uuid, &base, &HealthPolicy::default(), &CancellationToken::new()).await;
        assert_eq!(r.reason().unwrap(), "1 new Xid error since last check");
    }

    #[test]
    fn reasons_serialize_with_a_kind_tag() {
        let r = CheckResult::Quarantine { reasons: vec![QuarantineReason::ProcessesPresent { pids: vec![1] }] };
        let j = serde_json::to_string(&r).unwrap();
        assert_eq!(j, r#"{"result":"quarantine","reasons":[{"kind":"processes_present","pids":[1]}]}"#);
    }
}
