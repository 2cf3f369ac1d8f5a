//! `/metrics` in Prometheus' text format. Counters and histograms are bumped where things
//! happen (a job ends or starts, a webhook arrives, a GitHub or provider call returns); gauges
//! are read at each scrape from what the coordinator already holds (the brain's agents and
//! GPUs, the store's active jobs, the fleets' last pass, live GPU samples). Names follow
//! Prometheus' conventions: `gpuci_` prefix, base units, `_total` counters.
//! It must not keep a second copy of any state: a gauge that could disagree with
//! `gpuci jobs` or `gpuci agents` is a bug.

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Counters and histograms, shared by every task that bumps them.
pub struct Metrics {
    pub jobs_finished: IntCounterVec,
    pub start_latency: HistogramVec,
    pub webhook_deliveries: IntCounterVec,
    pub provider_calls: IntCounterVec,
    pub uploads_collected: IntCounterVec,
    pub uploads_collected_bytes: IntCounterVec,
}

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).unwrap_or_else(|e| panic!("metric {name}: {e}"))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let start_latency = HistogramVec::new(
            HistogramOpts::new(
                "gpuci_job_start_latency_seconds",
                "Time from a job's submission (or its retry being queued) to its process starting.",
            )
            .buckets(vec![0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0]),
            &["queue"],
        )
        .unwrap_or_else(|e| panic!("metric: {e}"));
        Metrics {
            jobs_finished: counter(
                "gpuci_jobs_finished_total",
                "Jobs that ended, by final state and a class of their reason.",
                &["state", "reason_class"],
            ),
            start_latency,
            webhook_deliveries: counter(
                "gpuci_github_webhook_deliveries_total",
                "GitHub webhook deliveries received, by event and what became of them.",
                &["event", "result"],
            ),
            provider_calls: counter(
                "gpuci_provider_calls_total",
                "Calls to fleets' providers, by fleet, provider, call and result (ok, error).",
                &["fleet", "provider", "call", "result"],
            ),
            uploads_collected: counter(
                "gpuci_uploads_collected_total",
                "Workspace uploads deleted by garbage collection, by why (retention, max_total).",
                &["why"],
            ),
            uploads_collected_bytes: counter(
                "gpuci_uploads_collected_bytes_total",
                "Bytes freed by deleting workspace uploads, by why (retention, max_total).",
                &["why"],
            ),
        }
    }

    fn register_into(&self, r: &Registry) -> prometheus::Result<()> {
        r.register(Box::new(self.jobs_finished.clone()))?;
        r.register(Box::new(self.start_latency.clone()))?;
        r.register(Box::new(self.webhook_deliveries.clone()))?;
        r.register(Box::new(self.provider_calls.clone()))?;
        r.register(Box::new(self.uploads_collected.clone()))?;
        r.register(Box::new(self.uploads_collected_bytes.clone()))?;
        Ok(())
    }

    pub fn job_finished(&self, state: gpuci_core::job::JobState, reason: &str) {
        self.jobs_finished.with_label_values(&[state.as_str(), gpuci_core::job::reason_class(state, reason)]).inc();
    }

    /// An upload garbage collection deleted.
    pub fn upload_collected(&self, why: gpuci_core::uploads::Why, bytes: u64) {
        self.uploads_collected.with_label_values(&[why.as_str()]).inc();
        self.uploads_collected_bytes.with_label_values(&[why.as_str()]).inc_by(bytes);
    }

    pub fn provider_call(&self, fleet: &str, provider: &str, call: &str, ok: bool) {
        self.provider_calls.with_label_values(&[fleet, provider, call, if ok { "ok" } else { "error" }]).inc();
    }
}

/// One running job's GPU, attributed.
#[derive(Clone, Debug)]
pub struct GpuUse {
    pub host: String,
    pub gpu_uuid: String,
    pub job: String,
    pub repository: String,
    pub fleet: String,
    pub utilization_pct: Option<u32>,
    pub memory_bytes: u64,
    pub power_watts: Option<f64>,
}

/// Everything the gauges show, read at one scrape.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Queued jobs: (queue, seconds waited).
    pub queued: Vec<(String, f64)>,
    /// Active jobs by state.
    pub active: Vec<(&'static str, u64)>,
    /// Agents: (state, count).
    pub agents: Vec<(String, u64)>,
    /// GPUs: (agent name, state, simulated, count).
    pub gpus: Vec<(String, String, bool, u64)>,
    /// Quarantined GPUs: (agent name, GPU UUID).
    pub quarantined: Vec<(String, String)>,
    pub gpu_use: Vec<GpuUse>,
    /// Fleets: (fleet, provider, machine state, count).
    pub machines: Vec<(String, String, String, u64)>,
    /// Fleets: (fleet, wanted, spend today USD, daily budget USD).
    pub fleets: Vec<(String, u64, f64, Option<f64>)>,
    /// Today's attributed spend per repository.
    pub repository_spend: Vec<(String, f64)>,
    /// GitHub API requests by result, and the rate-limit figures (credential kind, resource,
    /// remaining), when GitHub is configured.
    pub github_requests: Vec<(&'static str, u64)>,
    pub github_rate_remaining: Vec<(String, u64)>,
    /// `[[budget]]`s: (repository or owner/*, daily USD).
    pub repository_budgets: Vec<(String, f64)>,
    /// Workspace uploads stored: (count, bytes).
    pub uploads: (u64, u64),
}

fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<GaugeVec> {
    let g = GaugeVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

fn int_gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntGaugeVec> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

/// The exposition text of `m` and `s`.
pub fn render(m: &Metrics, s: &Snapshot) -> prometheus::Result<String> {
    let r = Registry::new();
    m.register_into(&r)?;
    let info = int_gauge(&r, "gpuci_build_info", "The coordinator's version (always 1).", &["version"])?;
    info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);

    let depth = int_gauge(
        &r,
        "gpuci_queue_jobs",
        "Jobs waiting to be placed, by queue (a step's `agents: {queue}`).",
        &["queue"],
    )?;
    let oldest = gauge(
        &r,
        "gpuci_queue_oldest_wait_seconds",
        "How long the longest-waiting queued job has waited, by queue.",
        &["queue"],
    )?;
    let mut by_queue: std::collections::BTreeMap<&str, (i64, f64)> = Default::default();
    for (q, waited) in &s.queued {
        let e = by_queue.entry(q.as_str()).or_insert((0, 0.0));
        e.0 += 1;
        e.1 = e.1.max(*waited);
    }
    for (q, (n, w)) in by_queue {
        depth.with_label_values(&[q]).set(n);
        oldest.with_label_values(&[q]).set(w);
    }
    let jobs = int_gauge(&r, "gpuci_jobs", "Jobs not yet finished, by state.", &["state"])?;
    for (state, n) in &s.active {
        jobs.with_label_values(&[state]).set(*n as i64);
    }
    let agents = int_gauge(&r, "gpuci_agents", "Agents the coordinator knows, by state.", &["state"])?;
    for (state, n) in &s.agents {
        agents.with_label_values(&[state]).set(*n as i64);
    }
    let gpus = int_gauge(
        &r,
        "gpuci_gpus",
        "GPUs of known agents, by host (the agent's name), state (free, leased, quarantined) and whether simulated.",
        &["host", "state", "simulated"],
    )?;
    let mut leased = 0;
    for (agent, state, sim, n) in &s.gpus {
        gpus.with_label_values(&[agent.as_str(), state.as_str(), if *sim { "true" } else { "false" }]).set(*n as i64);
        if state == "leased" {
            leased += *n as i64;
        }
    }
    let leases = IntGauge::new("gpuci_gpu_leases", "GPUs leased to jobs now.")?;
    r.register(Box::new(leases.clone()))?;
    leases.set(leased);
    let q = int_gauge(
        &r,
        "gpuci_gpu_quarantined",
        "1 for each quarantined GPU (see `gpuci agents` for the reason).",
        &["host", "gpu_uuid"],
    )?;
    for (agent, uuid) in &s.quarantined {
        q.with_label_values(&[agent, uuid]).set(1);
    }
    // `job_id`, not `job`: Prometheus' own `job` label (the scrape job) would rename it.
    let labels = ["host", "gpu_uuid", "job_id", "repository", "fleet"];
    let util = gauge(
        &r,
        "gpuci_gpu_utilization_ratio",
        "A running job's GPU: the share of the last sample period a kernel ran (0-1).",
        &labels,
    )?;
    let mem = gauge(&r, "gpuci_gpu_memory_used_bytes", "A running job's GPU: memory in use.", &labels)?;
    let power = gauge(&r, "gpuci_gpu_power_watts", "A running job's GPU: power drawn.", &labels)?;
    for u in &s.gpu_use {
        let l = [u.host.as_str(), &u.gpu_uuid, &u.job, &u.repository, &u.fleet];
        if let Some(p) = u.utilization_pct {
            util.with_label_values(&l).set(f64::from(p.min(100)) / 100.0);
        }
        mem.with_label_values(&l).set(u.memory_bytes as f64);
        if let Some(w) = u.power_watts.filter(|w| w.is_finite() && *w >= 0.0) {
            power.with_label_values(&l).set(w);
        }
    }
    let machines = int_gauge(
        &r,
        "gpuci_fleet_machines",
        "Fleets' machines, by fleet, provider and state.",
        &["fleet", "provider", "state"],
    )?;
    for (fleet, provider, state, n) in &s.machines {
        machines.with_label_values(&[fleet, provider, state]).set(*n as i64);
    }
    let wanted = int_gauge(&r, "gpuci_fleet_machines_wanted", "Machines the autoscaler wants per fleet.", &["fleet"])?;
    let spend = gauge(&r, "gpuci_fleet_spend_today_usd", "What a fleet's machines cost since 00:00 UTC.", &["fleet"])?;
    let budget = gauge(&r, "gpuci_fleet_daily_budget_usd", "A fleet's daily budget, where it has one.", &["fleet"])?;
    for (fleet, w, usd, b) in &s.fleets {
        wanted.with_label_values(&[fleet]).set(*w as i64);
        spend.with_label_values(&[fleet]).set(*usd);
        if let Some(b) = b {
            budget.with_label_values(&[fleet]).set(*b);
        }
    }
    let repo = gauge(
        &r,
        "gpuci_repository_spend_today_usd",
        "Jobs' shares of fleet machines since 00:00 UTC, by repository (what repository budgets count).",
        &["repository"],
    )?;
    for (name, usd) in &s.repository_spend {
        repo.with_label_values(&[name]).set(*usd);
    }
    let budgets = gauge(
        &r,
        "gpuci_repository_daily_budget_usd",
        "A `[[budget]]`'s daily USD, by the repository (or owner/*) it covers.",
        &["budget"],
    )?;
    for (name, daily) in &s.repository_budgets {
        budgets.with_label_values(&[name]).set(*daily);
    }
    let gh = IntCounterVec::new(
        Opts::new(
            "gpuci_github_api_requests_total",
            "Calls to GitHub's REST API, by result (2xx, 3xx, 4xx, 5xx, error: no answer).",
        ),
        &["result"],
    )?;
    r.register(Box::new(gh.clone()))?;
    for (result, n) in &s.github_requests {
        gh.with_label_values(&[result]).inc_by(*n);
    }
    let rate = int_gauge(
        &r,
        "gpuci_github_api_rate_limit_remaining",
        "Requests left in GitHub's current rate-limit window, as its last answer said, by resource.",
        &["resource"],
    )?;
    for (resource, remaining) in &s.github_rate_remaining {
        rate.with_label_values(&[resource]).set(*remaining as i64);
    }
    let uploads =
        IntGauge::new("gpuci_uploads", "Workspace uploads stored (the collector's last count, plus uploads since).")?;
    r.register(Box::new(uploads.clone()))?;
    uploads.set(i64::try_from(s.uploads.0).unwrap_or(i64::MAX));
    let upload_bytes = IntGauge::new("gpuci_uploads_bytes", "Bytes of the workspace uploads stored.")?;
    r.register(Box::new(upload_bytes.clone()))?;
    upload_bytes.set(i64::try_from(s.uploads.1).unwrap_or(i64::MAX));
    let mut out = Vec::new();
    TextEncoder::new().encode(&r.gather(), &mut out)?;
    String::from_utf8(out).map_err(|e| prometheus::Error::Msg(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_and_counters_render_with_their_labels() {
        let m = Metrics::new();
        m.job_finished(gpuci_core::job::JobState::Failed, "exited with code 3");
        m.start_latency.with_label_values(&["default"]).observe(0.2);
        let s = Snapshot {
            queued: vec![("cuda".into(), 5.0), ("cuda".into(), 65.5), ("default".into(), 1.0)],
            gpus: vec![("ws-1".into(), "leased".into(), false, 2), ("ws-1".into(), "free".into(), false, 1)],
            gpu_use: vec![GpuUse {
                host: "ws-1".into(),
                gpu_uuid: "GPU-1".into(),
                job: "7".into(),
                repository: "acme/kernels".into(),
                fleet: "".into(),
                utilization_pct: Some(87),
                memory_bytes: 1 << 30,
                power_watts: Some(250.5),
            }],
            ..Default::default()
        };
        let text = render(&m, &s).expect("render");
        for want in [
            "gpuci_queue_jobs{queue=\"cuda\"} 2",
            "gpuci_queue_oldest_wait_seconds{queue=\"cuda\"} 65.5",
            "gpuci_gpu_leases 2",
            "gpuci_jobs_finished_total{reason_class=\"exit_code\",state=\"failed\"} 1",
            "gpuci_job_start_latency_seconds_count{queue=\"default\"} 1",
            "gpuci_gpu_utilization_ratio{fleet=\"\",gpu_uuid=\"GPU-1\",host=\"ws-1\",job_id=\"7\",repository=\"acme/kernels\"} 0.87",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }
}
