//! The jobs list (and the builds list): what the landing page shows, filtered and paged.

use super::*;

// ---- pages ----------------------------------------------------------------------------------

#[derive(Deserialize, Default)]
pub(super) struct JobsQuery {
    #[serde(default)]
    repo: String,
    #[serde(default)]
    state: String,
    #[serde(default)]
    fleet: String,
    before: Option<i64>,
}

pub(super) async fn jobs_page(State(st): State<AppState>, headers: HeaderMap, Query(q): Query<JobsQuery>) -> Response {
    let v = viewer(&st, &headers);
    match jobs_inner(&st, &v, q).await {
        Ok(m) => html(m),
        Err(e) => api_error(&v, e),
    }
}

pub(super) async fn jobs_inner(st: &AppState, v: &Viewer, q: JobsQuery) -> Result<Markup, ApiError> {
    let mut states = Vec::new();
    if !q.state.is_empty() {
        states.push(q.state.parse::<JobState>().map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e))?);
    }
    let filtering = !q.repo.is_empty() || !q.fleet.is_empty() || !v.signed_in();
    // With a filter the store cannot apply, read a larger window and filter it here; the next
    // page starts after the window (so a run of jobs the viewer may not see never ends the
    // listing).
    let window = match (filtering, v.signed_in()) {
        (false, _) => PAGE as u32 + 1,
        (true, true) => 5_000,
        (true, false) => 1_000,
    };
    let jobs = st.store.list_jobs(&JobFilter { states, pipeline: None, limit: Some(window), before: q.before }).await?;
    // Filter on the records (cheap), then make rows of what is shown only.
    let known = agent_names(st.store.as_ref(), &jobs).await;
    let origins = origins(st, jobs.iter().map(|j| j.pipeline_id).collect()).await?;
    let want_repo = (!q.repo.is_empty()).then(|| repo_key(st, &q.repo));
    let fleet_of =
        |j: &gpuci_store::JobRecord| j.agent_id.as_ref().and_then(|a| known.machines.get(a)).map(|m| m.fleet.as_str());
    let kept: Vec<gpuci_store::JobRecord> = jobs
        .iter()
        .filter(|j| {
            let o = origins.get(&j.pipeline_id);
            (v.signed_in() || o.is_some_and(|o| o.public))
                && want_repo.as_ref().is_none_or(|w| {
                    o.and_then(|o| o.repository.as_deref()).map(|r| repo_key(st, r)).as_ref() == Some(w)
                })
                && (q.fleet.is_empty() || fleet_of(j) == Some(q.fleet.as_str()))
        })
        .take(PAGE + 1)
        .cloned()
        .collect();
    let next_page = if kept.len() > PAGE {
        kept.get(PAGE - 1).map(|j| j.id)
    } else if jobs.len() == window as usize {
        jobs.last().map(|j| j.id)
    } else {
        None
    };
    let mut all: Vec<JobRow> = summarize(&kept[..kept.len().min(PAGE)], &known)
        .into_iter()
        .map(|job| {
            let origin = origins.get(&job.pipeline_id).cloned().unwrap_or_default();
            let fleet = job.cost.as_ref().map(|c| c.fleet.clone());
            JobRow { job, origin, fleet }
        })
        .collect();
    let mut repositories: BTreeSet<String> = origins.values().filter_map(|o| o.repository.clone()).collect();
    if !v.signed_in() {
        repositories = st.public_repositories.iter().map(ToString::to_string).collect();
        let scrub = Scrub::load(st).await;
        for r in &mut all {
            scrub.row(r);
        }
    }
    if !q.repo.is_empty() {
        repositories.insert(q.repo.clone());
    }
    let fleets: Vec<String> = st.fleets.read().map(|f| f.iter().map(|f| f.name.clone()).collect()).unwrap_or_default();
    let filters = gpuci_web::JobFilters { repository: q.repo, state: q.state, fleet: q.fleet };
    Ok(gpuci_web::jobs(&all, &filters, &repositories.into_iter().collect::<Vec<_>>(), &fleets, next_page, v, now_ms()))
}

/// Builds a page shows.
const BUILDS_PAGE: usize = 50;

#[derive(Deserialize, Default)]
pub(super) struct BuildsQuery {
    before: Option<i64>,
}

/// The landing page: pipelines (builds), newest first, a page at a time.
pub(super) async fn builds_page(
    State(st): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<BuildsQuery>,
) -> Response {
    let v = viewer(&st, &headers);
    match builds_inner(&st, &v, q).await {
        Ok(m) => html(m),
        Err(e) => api_error(&v, e),
    }
}

async fn builds_inner(st: &AppState, v: &Viewer, q: BuildsQuery) -> Result<Markup, ApiError> {
    // Anonymous viewers see public repositories' builds only: read a window and keep those
    // (the next page starts after the window, so a run of private builds never ends the list).
    let window = if v.signed_in() { BUILDS_PAGE as u32 + 1 } else { 1_000 };
    let pipelines = st.store.pipelines_before(q.before, window).await?;
    let origins = origins(st, pipelines.iter().map(|p| p.id).collect()).await?;
    let kept: Vec<&gpuci_store::PipelineRecord> = pipelines
        .iter()
        .filter(|p| v.signed_in() || origins.get(&p.id).is_some_and(|o| o.public))
        .take(BUILDS_PAGE + 1)
        .collect();
    let next_page = if kept.len() > BUILDS_PAGE {
        kept.get(BUILDS_PAGE - 1).map(|p| p.id)
    } else if pipelines.len() == window as usize {
        pipelines.last().map(|p| p.id)
    } else {
        None
    };
    let shown: Vec<&gpuci_store::PipelineRecord> = kept.into_iter().take(BUILDS_PAGE).collect();
    let ids: Vec<i64> = shown.iter().map(|p| p.id).collect();
    let jobs = st.store.jobs_of_pipelines(&ids).await?;
    let facts = st.store.pipeline_builds(&ids).await?;
    let known = agent_names(st.store.as_ref(), &jobs).await;
    let now = now_ms();
    // Jobs by pipeline, once (a page holds up to 50 pipelines of any number of jobs).
    let mut by_pipeline: HashMap<i64, Vec<&gpuci_store::JobRecord>> = HashMap::new();
    for j in &jobs {
        by_pipeline.entry(j.pipeline_id).or_default().push(j);
    }
    let rows = shown
        .iter()
        .map(|p| {
            // Only what the summary needs: no job summaries (their telemetry series) are made.
            let build_jobs: Vec<gpuci_core::builds::BuildJob> = by_pipeline
                .get(&p.id)
                .into_iter()
                .flatten()
                .map(|j| gpuci_core::builds::BuildJob {
                    job_id: j.id,
                    step_key: &j.step.key,
                    state: j.state,
                    soft_failed: gpuci_core::progress::is_soft_failure(&j.step.soft_fail, j.state, j.exit_code),
                    skipped_by_condition: gpuci_core::progress::is_skipped_by_condition(&j.step, j.state),
                    started_at_ms: j.started_at_ms,
                    finished_at_ms: j.finished_at_ms,
                    gpus: j.gpus.len() as u32,
                    // Cost is infrastructure: not for anonymous viewers (as on the job page).
                    cost_usd: if v.signed_in() { job_cost(&known, j, now) } else { None },
                })
                .collect();
            // Unreadable facts (a record from a newer version) list the build without them.
            let facts = facts.get(&p.id).and_then(|f| serde_json::from_str(f).ok()).unwrap_or_default();
            gpuci_web::BuildRow {
                id: p.id,
                file_name: p.file_name.clone(),
                created_at_ms: p.created_at_ms,
                origin: origins.get(&p.id).cloned().unwrap_or_default(),
                facts,
                summary: gpuci_core::builds::summarize(p.created_at_ms, &build_jobs, now),
            }
        })
        .collect::<Vec<_>>();
    Ok(gpuci_web::builds(&rows, next_page, v))
}

/// What a job cost on a fleet machine, as the job page says (`api::summarize`): its share of
/// the machine's GPUs × the machine's price, for its run (never past the machine's end).
fn job_cost(known: &crate::api::Known, j: &gpuci_store::JobRecord, now: i64) -> Option<f64> {
    let m = known.machines.get(j.agent_id.as_ref()?)?;
    let started = j.started_at_ms?;
    let end = j.finished_at_ms.unwrap_or(now);
    let end = m.ended_at_ms.map_or(end, |e| end.min(e));
    Some(gpuci_core::fleet::job_cost(end - started, j.gpus.len() as u32, m.gpus, m.price_per_hour))
}
