//! A running job's GPU samples: streamed live to the coordinator (best effort, bounded), and
//! folded into the series its result carries (at most `MAX_SERIES_POINTS` points).

use gpuci_gpu::GpuSample;
use gpuci_protocol::agent::{LiveSample, TelemetryPoint, MAX_SERIES_POINTS};
use gpuci_protocol::JobId;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Samples waiting for the next message to the coordinator. Bounded: with the coordinator
/// unreachable the oldest are dropped (they are for live views; the series survives).
#[derive(Clone, Default)]
pub struct LiveBuffer(Arc<Mutex<std::collections::VecDeque<LiveSample>>>);

const LIVE_CAP: usize = 4096;

impl LiveBuffer {
    pub fn push(&self, s: LiveSample) {
        let mut q = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= LIVE_CAP {
            q.pop_front();
        }
        q.push_back(s);
    }

    pub fn take(&self) -> Vec<LiveSample> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect()
    }
}

/// One sampling tick of all a job's GPUs, combined.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Tick {
    t_s: f64,
    util_sum: f64,
    util_n: u32,
    memory: u64,
    power: Option<f64>,
}

/// Collects a job's samples into its series.
#[derive(Default)]
pub struct Series {
    ticks: Vec<Tick>,
}

impl Series {
    /// One GPU's sample at `at` after the start; samples of one tick share `at`.
    pub fn record(&mut self, at: Duration, s: &GpuSample) {
        let t_s = at.as_secs_f64();
        if self.ticks.last().is_none_or(|l| l.t_s != t_s) {
            self.ticks.push(Tick { t_s, ..Tick::default() });
        }
        let Some(t) = self.ticks.last_mut() else { return };
        if let Some(u) = s.utilization_pct {
            t.util_sum += f64::from(u.min(100));
            t.util_n += 1;
        }
        t.memory = t.memory.saturating_add(s.memory_used.0);
        if let Some(p) = s.power_watts.filter(|p| p.is_finite() && *p >= 0.0) {
            t.power = Some(t.power.unwrap_or(0.0) + p);
        }
        // A long job samples for hours: fold pairs of ticks once the list is long, so memory
        // stays bounded and the final series still spans the whole run.
        if self.ticks.len() >= 8 * MAX_SERIES_POINTS {
            self.ticks = self.ticks.chunks(2).map(merge).collect();
        }
    }

    /// The series: ticks averaged into at most `MAX_SERIES_POINTS` spans of equal count.
    pub fn finish(self) -> Vec<TelemetryPoint> {
        let per = self.ticks.len().div_ceil(MAX_SERIES_POINTS).max(1);
        self.ticks
            .chunks(per)
            .map(|c| {
                let t = merge(c);
                TelemetryPoint {
                    t_s: t.t_s,
                    utilization_pct: if t.util_n == 0 { 0.0 } else { t.util_sum / f64::from(t.util_n) },
                    memory_bytes: t.memory,
                    power_watts: t.power,
                }
            })
            .collect()
    }
}

/// Ticks averaged into one (time: the first's; memory and power: the peak over the span,
/// since a chart of memory should not hide what nearly ran out).
fn merge(c: &[Tick]) -> Tick {
    let mut out = Tick { t_s: c.first().map_or(0.0, |t| t.t_s), ..Tick::default() };
    for t in c {
        out.util_sum += t.util_sum;
        out.util_n += t.util_n;
        out.memory = out.memory.max(t.memory);
        out.power = match (out.power, t.power) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
    out
}

/// A live sample of `job` from one GPU.
pub fn live(job_id: JobId, at: Duration, uuid: &str, s: &GpuSample) -> LiveSample {
    LiveSample {
        job_id,
        gpu_uuid: uuid.to_string(),
        t_s: at.as_secs_f64(),
        utilization_pct: s.utilization_pct,
        memory_bytes: s.memory_used.0,
        power_watts: s.power_watts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_core::quantity::Bytes;

    fn s(u: u32, gib: u64) -> GpuSample {
        GpuSample {
            utilization_pct: Some(u),
            memory_used: Bytes(gib << 30),
            power_watts: Some(100.0),
            temperature_c: None,
        }
    }

    #[test]
    fn a_tick_combines_the_jobs_gpus() {
        let mut series = Series::default();
        series.record(Duration::from_secs(1), &s(20, 1));
        series.record(Duration::from_secs(1), &s(60, 3));
        series.record(Duration::from_secs(2), &s(100, 2));
        let p = series.finish();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].utilization_pct, 40.0);
        assert_eq!(p[0].memory_bytes, 4 << 30);
        assert_eq!(p[0].power_watts, Some(200.0));
        assert_eq!(p[1].t_s, 2.0);
    }

    #[test]
    fn a_long_job_keeps_a_bounded_series_over_its_whole_run() {
        let mut series = Series::default();
        for i in 0..10_000u64 {
            // Memory peaks once, at tick 7777: the series must still show it.
            let gib = if i == 7777 { 70 } else { 1 };
            series.record(Duration::from_secs(i), &s(50, gib));
            assert!(series.ticks.len() < 8 * MAX_SERIES_POINTS);
        }
        let p = series.finish();
        assert!(p.len() <= MAX_SERIES_POINTS && p.len() > MAX_SERIES_POINTS / 2, "{}", p.len());
        assert_eq!(p[0].t_s, 0.0);
        assert!(p.last().is_some_and(|l| l.t_s > 9_000.0));
        assert_eq!(p.iter().map(|p| p.memory_bytes).max(), Some(70 << 30));
        assert!(p.iter().all(|p| p.utilization_pct == 50.0));
    }

    #[test]
    fn the_live_buffer_drops_the_oldest_when_full() {
        let b = LiveBuffer::default();
        for i in 0..(LIVE_CAP + 10) {
            b.push(live(i as i64, Duration::from_secs(0), "GPU-x", &s(1, 1)));
        }
        let v = b.take();
        assert_eq!(v.len(), LIVE_CAP);
        assert_eq!(v[0].job_id, 10);
        assert!(b.take().is_empty());
    }
}
