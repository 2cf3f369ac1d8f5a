//! What a job used: a pure accumulator ([`Telemetry`]) fed with samples at timestamps the
//! caller supplies, and an async sampler ([`sample_loop`]) that feeds it until cancelled.

use crate::backend::{GpuBackend, GpuSample};
use gpuci_core::quantity::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Per-GPU figures of one job.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuTelemetry {
    pub uuid: String,
    pub samples: u64,
    pub peak_memory: Bytes,
    /// Mean over samples that reported utilisation; `None` if none did.
    pub mean_utilization_pct: Option<f64>,
    pub max_temperature_c: Option<u32>,
    pub max_power_watts: Option<f64>,
}

/// The whole job.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TelemetrySummary {
    pub gpus: Vec<GpuTelemetry>,
    /// The largest per-GPU peak (what a user sizes the next job by).
    pub peak_memory: Bytes,
    pub mean_utilization_pct: Option<f64>,
    /// Leased GPUs × wall time: what the job cost in GPU time, whether it used it or not.
    pub gpu_seconds: f64,
    pub samples: u64,
    pub failed_samples: u64,
}

#[derive(Clone, Debug, Default)]
struct Acc {
    samples: u64,
    peak: Bytes,
    util_sum: f64,
    util_n: u64,
    max_temp: Option<u32>,
    max_power: Option<f64>,
}

/// Accumulates samples of the GPUs leased to one job. Timestamps are offsets from the
/// job's start, handed in by the caller, so this stays pure and testable.
#[derive(Clone, Debug)]
pub struct Telemetry {
    per_gpu: BTreeMap<String, Acc>,
    last_at: Duration,
    failed: u64,
}

impl Telemetry {
    /// Telemetry for a job leasing `uuids`.
    pub fn new<S: Into<String>>(uuids: impl IntoIterator<Item = S>) -> Self {
        Telemetry {
            per_gpu: uuids.into_iter().map(|u| (u.into(), Acc::default())).collect(),
            last_at: Duration::ZERO,
            failed: 0,
        }
    }

    /// Record one sample of `uuid` taken `at` after the job started. Samples of GPUs not
    /// leased to the job are ignored.
    pub fn record(&mut self, at: Duration, uuid: &str, s: &GpuSample) {
        let Some(a) = self.per_gpu.get_mut(uuid) else {
            return;
        };
        self.last_at = self.last_at.max(at);
        a.samples += 1;
        a.peak = a.peak.max(s.memory_used);
        if let Some(u) = s.utilization_pct {
            a.util_sum += f64::from(u);
            a.util_n += 1;
        }
        a.max_temp = a.max_temp.max(s.temperature_c);
        if let Some(p) = s.power_watts {
            a.max_power = Some(a.max_power.map_or(p, |m: f64| m.max(p)));
        }
    }

    /// A sample that could not be read (counted, so a summary with few samples says why).
    pub fn record_failure(&mut self) {
        self.failed += 1;
    }

    /// The summary for a job that ran `elapsed` of wall time; `None` uses the last
    /// sample's timestamp.
    pub fn summary(&self, elapsed: Option<Duration>) -> TelemetrySummary {
        let wall = elapsed.unwrap_or(self.last_at);
        let gpus: Vec<GpuTelemetry> = self
            .per_gpu
            .iter()
            .map(|(uuid, a)| GpuTelemetry {
                uuid: uuid.clone(),
                samples: a.samples,
                peak_memory: a.peak,
                mean_utilization_pct: (a.util_n > 0).then(|| a.util_sum / a.util_n as f64),
                max_temperature_c: a.max_temp,
                max_power_watts: a.max_power,
            })
            .collect();
        let (sum, n) = self.per_gpu.values().fold((0.0, 0u64), |(s, n), a| (s + a.util_sum, n + a.util_n));
        TelemetrySummary {
            peak_memory: gpus.iter().map(|g| g.peak_memory).max().unwrap_or_default(),
            mean_utilization_pct: (n > 0).then(|| sum / n as f64),
            gpu_seconds: self.per_gpu.len() as f64 * wall.as_secs_f64(),
            samples: gpus.iter().map(|g| g.samples).sum(),
            failed_samples: self.failed,
            gpus,
        }
    }
}

/// Sample `uuids` every `period` until `cancel` fires, calling `sink` with each sample
/// (to stream it) and returning the job's summary. The first sample is taken at once.
/// Backend calls run on a blocking thread: `nvidia-smi` may take a second.
pub async fn sample_loop(
    backend: Arc<dyn GpuBackend>,
    uuids: Vec<String>,
    period: Duration,
    cancel: CancellationToken,
    mut sink: impl FnMut(Duration, &str, &GpuSample) + Send,
) -> TelemetrySummary {
    let start = tokio::time::Instant::now();
    let mut telemetry = Telemetry::new(uuids.iter().cloned());
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tick.tick() => {}
        }
        let (b, u) = (backend.clone(), uuids.clone());
        let results = match tokio::task::spawn_blocking(move || {
            u.iter().map(|id| (id.clone(), b.sample(id))).collect::<Vec<_>>()
        })
        .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("GPU sampling task failed: {e}");
                telemetry.record_failure();
                continue;
            }
        };
        let at = start.elapsed();
        for (uuid, r) in results {
            match r {
                Ok(s) => {
                    telemetry.record(at, &uuid, &s);
                    sink(at, &uuid, &s);
                }
                Err(e) => {
                    tracing::debug!("sampling {uuid}: {e}");
                    telemetry.record_failure();
                }
            }
        }
    }
    telemetry.summary(Some(start.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FakeGpus, SimulatedGpus};

    fn s(util: u32, mem_gib: u64) -> GpuSample {
        GpuSample {
            utilization_pct: Some(util),
            memory_used: Bytes(mem_gib << 30),
            power_watts: Some(300.0),
            temperature_c: Some(50),
        }
    }

    #[test]
    fn accumulates_peaks_means_and_gpu_seconds() {
        let mut t = Telemetry::new(["a", "b"]);
        t.record(Duration::from_secs(0), "a", &s(10, 1));
        t.record(Duration::from_secs(1), "a", &s(90, 30));
        t.record(Duration::from_secs(1), "b", &s(50, 5));
        t.record(Duration::from_secs(1), "not-leased", &s(100, 70));
        t.record_failure();
        let sum = t.summary(Some(Duration::from_secs(60)));
        assert_eq!(sum.peak_memory, Bytes(30 << 30));
        assert_eq!(sum.mean_utilization_pct, Some(50.0));
        assert_eq!(sum.gpu_seconds, 120.0);
        assert_eq!((sum.samples, sum.failed_samples), (3, 1));
        assert_eq!(sum.gpus[0].mean_utilization_pct, Some(50.0));
        assert_eq!(sum.gpus[1].peak_memory, Bytes(5 << 30));
        assert_eq!(t.summary(None).gpu_seconds, 2.0, "falls back to the last sample's time");
    }

    #[test]
    fn no_samples_means_unknown_not_zero() {
        let sum = Telemetry::new(["a"]).summary(Some(Duration::from_secs(10)));
        assert_eq!(sum.mean_utilization_pct, None);
        assert_eq!(sum.gpu_seconds, 10.0);
    }

    #[tokio::test]
    async fn sampler_stops_on_cancel_and_summarises() {
        let fake = Arc::new(FakeGpus::new(SimulatedGpus::from_spec("2xL4", "h").unwrap().gpus().to_vec()));
        let uuids = fake.uuids();
        fake.set(&uuids[0], |st| {
            st.utilization_pct = 80;
            st.memory_used = Bytes(10 << 30);
        });
        let cancel = CancellationToken::new();
        let c2 = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            c2.cancel();
        });
        let mut seen = 0;
        let sum =
            sample_loop(fake.clone(), uuids.clone(), Duration::from_millis(10), cancel, |_, _, _| seen += 1).await;
        assert!(sum.samples >= 4, "{sum:?}");
        assert_eq!(sum.samples, seen);
        assert_eq!(sum.peak_memory, Bytes(10 << 30));
        assert_eq!(sum.gpus[0].uuid.len(), uuids[0].len());
        assert!(sum.gpu_seconds >= 0.2);
    }
}
