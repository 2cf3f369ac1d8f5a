//! Signed-in pages about the machines: queue, fleet, spend, and the admin's audit log.

use super::*;

pub(super) async fn queue_page(State(st): State<AppState>, headers: HeaderMap) -> Response {
    let v = viewer(&st, &headers);
    if !v.signed_in() {
        return sign_in_first("/ui/queue");
    }
    let jobs = match st
        .store
        .list_jobs(&JobFilter { states: vec![JobState::Queued], limit: Some(10_000), ..Default::default() })
        .await
    {
        Ok(j) => j,
        Err(e) => return api_error(&v, e.into()),
    };
    match rows(&st, &jobs).await {
        Ok(r) => html(gpuci_web::queue(&r, &v, now_ms())),
        Err(e) => api_error(&v, e),
    }
}

pub(super) async fn fleet_page(State(st): State<AppState>, headers: HeaderMap) -> Response {
    let v = viewer(&st, &headers);
    if !v.signed_in() {
        return sign_in_first("/ui/fleet");
    }
    let agents = match st.ask(|reply| Command::Agents { reply }).await {
        Ok(a) => a,
        Err(e) => return api_error(&v, e.into()),
    };
    let mut util = std::collections::BTreeMap::new();
    for (_, j) in st.live.snapshot() {
        for (uuid, s) in j.gpus {
            util.insert(uuid, (s.utilization_pct, s.memory_bytes));
        }
    }
    html(gpuci_web::fleet(&agents, &util, &fleets(&st), &v, now_ms()))
}

#[derive(Deserialize)]
pub(super) struct SpendQuery {
    days: Option<u32>,
}

pub(super) async fn spend_page(
    State(st): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<SpendQuery>,
) -> Response {
    let v = viewer(&st, &headers);
    if !v.signed_in() {
        return sign_in_first("/ui/spend");
    }
    let days = q.days.unwrap_or(7).clamp(1, 366);
    let now = now_ms();
    const DAY: i64 = 86_400_000;
    let from = (now.div_euclid(DAY) - i64::from(days) + 1) * DAY;
    let github_host = st.github_host();
    let (machines, stretches, runs) = match crate::fleets::cost_inputs(st.store.as_ref(), from, &github_host).await {
        Ok(x) => x,
        Err(e) => return api_error(&v, e.into()),
    };
    let report = gpuci_core::fleet::cost::report(&machines, &stretches, &runs, from, now);
    let today = now.div_euclid(DAY) * DAY;
    let mut spent: HashMap<String, f64> = HashMap::new();
    for r in gpuci_core::fleet::cost::report(&machines, &stretches, &runs, today, now).rows {
        if let Some(repo) = r.repository.filter(|r| r != gpuci_core::fleet::cost::NO_REPOSITORY) {
            *spent.entry(repo).or_insert(0.0) += r.usd;
        }
    }
    let budgets: Vec<(String, f64, f64)> = st
        .budgets
        .iter()
        .map(|b| {
            let s: f64 = spent.iter().filter(|(repo, _)| b.covers(repo)).map(|(_, usd)| usd).sum();
            (b.repository.to_string(), s, b.daily)
        })
        .collect();
    html(gpuci_web::spend(&report, &fleets(&st), &budgets, days, &v))
}

#[derive(Deserialize, Default)]
pub(super) struct AuditPageQuery {
    since: Option<String>,
    action: Option<String>,
    actor: Option<String>,
}

/// The audit log: the admin's alone (it names every token and who used it); the read-only
/// token and anonymous visitors never see it.
pub(super) async fn audit_page(
    State(st): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<AuditPageQuery>,
) -> Response {
    let v = viewer(&st, &headers);
    match v.role {
        Role::Admin => {}
        Role::Reader => {
            return page_error(StatusCode::FORBIDDEN, &v, "Not allowed", "the audit log is for the admin token only")
        }
        Role::Anonymous => return sign_in_first("/ui/audit"),
    }
    // Empty form fields mean no filter.
    let given = |s: &Option<String>| s.clone().filter(|s| !s.trim().is_empty());
    let query = crate::api::audit::AuditQuery {
        since: given(&q.since),
        action: given(&q.action),
        actor: given(&q.actor),
        limit: Some(PAGE as u32 * 5),
    };
    let filters = gpuci_web::AuditFilters {
        since: query.since.clone().unwrap_or_default(),
        action: query.action.clone().unwrap_or_default(),
        actor: query.actor.clone().unwrap_or_default(),
    };
    let entries = match query.filter(now_ms()) {
        Ok(f) => crate::api::audit::recent(&st, &f).await,
        Err(e) => Err(e),
    };
    match entries {
        Ok(e) => html(gpuci_web::audit(&e, &filters, &v)),
        Err(e) => api_error(&v, e),
    }
}
