//! Running jobs' GPU samples as their agents send them: the latest per GPU (for `/metrics` and
//! the fleet page) and the points so far per job (the job page's charts, until the job's result
//! brings its whole series). Memory only: after a restart the next samples fill it again.
//! Written by the agents' connections, each for its own jobs only; read by pages and scrapes.

use gpuci_protocol::agent::{LiveSample, TelemetryPoint, MAX_SERIES_POINTS};
use gpuci_protocol::JobId;
use std::collections::{BTreeMap, HashMap};
use std::sync::RwLock;
use std::time::{Duration, Instant};

/// What one running job's GPUs did lately.
#[derive(Clone, Debug)]
pub struct JobLive {
    pub agent_id: String,
    /// The newest sample of each of its GPUs.
    pub gpus: BTreeMap<String, LiveSample>,
    /// Its GPUs together, oldest first (at most `2 × MAX_SERIES_POINTS`, thinned when full).
    pub points: Vec<TelemetryPoint>,
    updated: Instant,
}

/// Entries no sample refreshed for this long are dropped (the job ended, its agent went).
const STALE: Duration = Duration::from_secs(120);

#[derive(Default)]
pub struct LiveTelemetry {
    jobs: RwLock<HashMap<JobId, JobLive>>,
}

impl LiveTelemetry {
    /// Records samples of `agent_id`'s jobs (the caller checked they are its own) and returns
    /// the new points, one per job and sampling tick.
    pub fn record(&self, agent_id: &str, samples: Vec<LiveSample>) -> Vec<(JobId, TelemetryPoint)> {
        let now = Instant::now();
        let mut jobs = self.jobs.write().unwrap_or_else(|e| e.into_inner());
        jobs.retain(|_, j| now.duration_since(j.updated) < STALE);
        let mut fresh: Vec<(JobId, TelemetryPoint)> = Vec::new();
        let mut util_n: HashMap<(JobId, u64), u32> = HashMap::new();
        for s in samples {
            let j = jobs.entry(s.job_id).or_insert_with(|| JobLive {
                agent_id: agent_id.to_string(),
                gpus: BTreeMap::new(),
                points: Vec::new(),
                updated: now,
            });
            j.updated = now;
            let key = (s.job_id, s.t_s.to_bits());
            let i = match fresh.iter().position(|(id, p)| *id == s.job_id && p.t_s.to_bits() == s.t_s.to_bits()) {
                Some(i) => i,
                None => {
                    fresh.push((s.job_id, TelemetryPoint { t_s: s.t_s, ..Default::default() }));
                    fresh.len() - 1
                }
            };
            let p = &mut fresh[i].1;
            if let Some(u) = s.utilization_pct {
                let n = util_n.entry(key).or_insert(0);
                p.utilization_pct = (p.utilization_pct * f64::from(*n) + f64::from(u.min(100))) / f64::from(*n + 1);
                *n += 1;
            }
            p.memory_bytes = p.memory_bytes.saturating_add(s.memory_bytes);
            if let Some(w) = s.power_watts.filter(|w| w.is_finite() && *w >= 0.0) {
                p.power_watts = Some(p.power_watts.unwrap_or(0.0) + w);
            }
            j.gpus.insert(s.gpu_uuid.clone(), s);
        }
        for (id, p) in &fresh {
            if let Some(j) = jobs.get_mut(id) {
                j.points.push(p.clone());
                if j.points.len() >= 2 * MAX_SERIES_POINTS {
                    // Keep every other point: the chart still spans the whole run.
                    j.points = j.points.iter().step_by(2).cloned().collect();
                }
            }
        }
        fresh
    }

    /// Forget a job (it ended: its result carries the series).
    pub fn end(&self, job: JobId) {
        self.jobs.write().unwrap_or_else(|e| e.into_inner()).remove(&job);
    }

    pub fn job(&self, job: JobId) -> Option<JobLive> {
        self.jobs.read().unwrap_or_else(|e| e.into_inner()).get(&job).cloned()
    }

    pub fn snapshot(&self) -> Vec<(JobId, JobLive)> {
        let now = Instant::now();
        let jobs = self.jobs.read().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<(JobId, JobLive)> = jobs
            .iter()
            .filter(|(_, j)| now.duration_since(j.updated) < STALE)
            .map(|(id, j)| (*id, j.clone()))
            .collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(job: JobId, gpu: &str, t: f64, u: u32, mem: u64) -> LiveSample {
        LiveSample {
            job_id: job,
            gpu_uuid: gpu.into(),
            t_s: t,
            utilization_pct: Some(u),
            memory_bytes: mem,
            power_watts: Some(50.0),
        }
    }

    #[test]
    fn samples_of_one_tick_make_one_point_per_job() {
        let l = LiveTelemetry::default();
        let fresh = l.record("a", vec![s(1, "g0", 1.0, 10, 5), s(1, "g1", 1.0, 30, 7), s(2, "g2", 1.0, 90, 1)]);
        assert_eq!(fresh.len(), 2);
        assert_eq!(fresh[0].1.utilization_pct, 20.0);
        assert_eq!(fresh[0].1.memory_bytes, 12);
        assert_eq!(fresh[0].1.power_watts, Some(100.0));
        let j = l.job(1).expect("job 1");
        assert_eq!(j.gpus.len(), 2);
        assert_eq!(j.points.len(), 1);
        l.end(1);
        assert!(l.job(1).is_none());
        assert_eq!(l.snapshot().len(), 1);
    }

    #[test]
    fn a_long_run_keeps_bounded_points() {
        let l = LiveTelemetry::default();
        for i in 0..5000 {
            l.record("a", vec![s(1, "g0", f64::from(i), 50, 1)]);
        }
        let j = l.job(1).expect("job");
        assert!(j.points.len() < 2 * MAX_SERIES_POINTS);
        assert_eq!(j.points[0].t_s, 0.0);
    }
}
