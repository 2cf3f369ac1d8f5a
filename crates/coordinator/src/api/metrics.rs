//! `GET /metrics`: the exposition of [`crate::metrics`]' counters and of the gauges read at
//! each scrape from what the coordinator already holds (the brain's agents and GPUs, the
//! store's active jobs, the fleets' last pass, live GPU samples). The API token or the
//! read-only token.

use crate::metrics::{render, GpuUse, Snapshot};

/// Prometheus metrics (text format 0.0.4): queue, jobs, GPUs and their use by running jobs,
/// GitHub, fleets and spend. The API token or the read-only token, as a bearer token.
#[utoipa::path(get, path = "/metrics", security(("bearer" = []), ("read_token" = [])),
    responses((status = 200, description = "the metrics", content_type = "text/plain"),
        (status = 401, description = "no token, or not one of the two", body = gpuci_protocol::api::ErrorBody),
        (status = 503, description = "the database does not answer, or the server is shutting down", body = gpuci_protocol::api::ErrorBody)))]
pub async fn scrape(
    axum::extract::State(st): axum::extract::State<crate::state::AppState>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    match crate::auth::bearer(&headers) {
        Some(t) if st.api_token.matches(t) || st.read_token.matches(t) => {}
        _ => {
            return crate::error::ApiError::new(
                StatusCode::UNAUTHORIZED,
                "/metrics needs the API token or the read-only token (<data-dir>/read-token) as a bearer token",
            )
            .into_response()
        }
    }
    let snapshot = match snapshot(&st).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    match render(&st.metrics, &snapshot) {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response(),
        Err(e) => crate::error::ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}"))
            .into_response(),
    }
}

/// Reads what the gauges show.
async fn snapshot(st: &crate::state::AppState) -> Result<Snapshot, crate::error::ApiError> {
    use gpuci_core::job::JobState;
    let now = crate::brain::now_ms();
    let active = st.store.active_jobs().await?;
    let mut s = Snapshot::default();
    for state in [JobState::Queued, JobState::Assigned, JobState::Running] {
        s.active.push((state.as_str(), active.iter().filter(|j| j.state == state).count() as u64));
    }
    let agents = st.ask(|reply| crate::brain::Command::Agents { reply }).await?;
    // A queue is a label only when an agent serves it: a pipeline (a fork's) names any queue it
    // likes, and each name would be a series.
    let served: std::collections::BTreeSet<&str> =
        agents.iter().filter_map(|a| a.tags.get("queue").map(String::as_str)).collect();
    for j in active.iter().filter(|j| j.state == JobState::Queued) {
        let queue = match j.step.agents.get("queue") {
            None => "default".to_string(),
            Some(q) if served.contains(q.as_str()) => q.clone(),
            Some(_) => "(no agent serves it)".to_string(),
        };
        s.queued.push((queue, (now - j.created_at_ms).max(0) as f64 / 1000.0));
    }
    let mut by_state: std::collections::BTreeMap<String, u64> = Default::default();
    let mut gpus: std::collections::BTreeMap<(String, String, bool), u64> = Default::default();
    let mut host_of: std::collections::HashMap<String, (String, String)> = Default::default();
    for a in &agents {
        *by_state.entry(a.state.clone()).or_insert(0) += 1;
        host_of.insert(
            a.id.clone(),
            (a.name.clone(), a.tags.get(gpuci_providers::TAG_FLEET).cloned().unwrap_or_default()),
        );
        for g in &a.gpus {
            *gpus.entry((a.name.clone(), g.state.clone(), g.info.simulated)).or_insert(0) += 1;
            if g.state == "quarantined" {
                s.quarantined.push((a.name.clone(), g.info.uuid.clone()));
            }
        }
    }
    s.agents = by_state.into_iter().collect();
    s.gpus = gpus.into_iter().map(|((a, st, sim), n)| (a, st, sim, n)).collect();
    let mut repo_of: std::collections::HashMap<i64, String> = Default::default();
    for (job, live) in st.live.snapshot() {
        let Some(j) = active.iter().find(|j| j.id == job) else { continue };
        let repository = match repo_of.get(&j.pipeline_id) {
            Some(r) => r.clone(),
            None => {
                // With its host: `github.com/acme/x` and `gitlab.com/acme/x` are two series.
                let r = st
                    .store
                    .get_pipeline(j.pipeline_id)
                    .await?
                    .and_then(|p| {
                        crate::repos::name_of_pipeline(p.repository.as_deref(), p.origin.as_deref(), &st.github_host())
                    })
                    .unwrap_or_default();
                repo_of.insert(j.pipeline_id, r.clone());
                r
            }
        };
        let (host, fleet) = host_of.get(&live.agent_id).cloned().unwrap_or_default();
        for (uuid, g) in &live.gpus {
            s.gpu_use.push(GpuUse {
                host: host.clone(),
                gpu_uuid: uuid.clone(),
                job: job.to_string(),
                repository: repository.clone(),
                fleet: fleet.clone(),
                utilization_pct: g.utilization_pct,
                memory_bytes: g.memory_bytes,
                power_watts: g.power_watts,
            });
        }
    }
    let fleets = st.fleets.read().map(|f| f.clone()).unwrap_or_default();
    for f in &fleets {
        let mut by_state: std::collections::BTreeMap<&str, u64> = Default::default();
        for m in &f.machines {
            *by_state.entry(m.state.as_str()).or_insert(0) += 1;
        }
        for (state, n) in by_state {
            s.machines.push((f.name.clone(), f.provider.clone(), state.to_string(), n));
        }
        s.fleets.push((f.name.clone(), u64::from(f.wanted), f.spend_today_usd, f.daily_budget_usd));
    }
    s.uploads = st.uploads.stored();
    s.repository_budgets = st.budgets.iter().map(|b| (b.repository.to_string(), b.daily)).collect();
    if let Some(gh) = &st.github {
        s.github_requests = gh.client.request_counts();
        let mut least: std::collections::BTreeMap<String, u64> = Default::default();
        for l in gh.client.rate_limits() {
            let e = least.entry(l.resource.clone()).or_insert(u64::MAX);
            *e = (*e).min(l.remaining);
        }
        s.github_rate_remaining = least.into_iter().collect();
    }
    if !fleets.is_empty() {
        const DAY: i64 = 86_400_000;
        let midnight = now.div_euclid(DAY) * DAY;
        let (machines, stretches, runs) =
            crate::fleets::cost_inputs(st.store.as_ref(), midnight, &st.github_host()).await?;
        let r = gpuci_core::fleet::cost::report(&machines, &stretches, &runs, midnight, now);
        let mut spend: std::collections::BTreeMap<String, f64> = Default::default();
        for row in r.rows {
            if let Some(repo) = row.repository.filter(|r| r != gpuci_core::fleet::cost::NO_REPOSITORY) {
                *spend.entry(repo).or_insert(0.0) += row.usd;
            }
        }
        s.repository_spend = spend.into_iter().collect();
    }
    Ok(s)
}
