//! A pipeline's page: its jobs, their timeline and dependency graph, and its actions.

use super::*;

pub(super) async fn pipeline_page(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let v = viewer(&st, &headers);
    let Ok(id) = id.parse::<i64>() else {
        return page_error(StatusCode::BAD_REQUEST, &v, "Bad request", "a pipeline id is a number");
    };
    let not_found = |v: &Viewer| page_error(StatusCode::NOT_FOUND, v, "Not found", &format!("pipeline {id} not found"));
    let p = match st.store.get_pipeline(id).await {
        Ok(Some(p)) => p,
        Ok(None) => return not_found(&v),
        Err(e) => return api_error(&v, e.into()),
    };
    // Whether this viewer may see it, before its jobs are read: a private pipeline answers as
    // fast as one that does not exist.
    if !v.signed_in()
        && !origins(&st, [id].into()).await.ok().and_then(|o| o.get(&id).map(|o| o.public)).unwrap_or(false)
    {
        return not_found(&v);
    }
    let jobs = match st.store.pipeline_jobs(id).await {
        Ok(j) => j,
        Err(e) => return api_error(&v, e.into()),
    };
    let mut rows = match rows(&st, &jobs).await {
        Ok(r) => r,
        Err(e) => return api_error(&v, e),
    };
    if !v.signed_in() {
        let scrub = Scrub::load(&st).await;
        for r in &mut rows {
            scrub.row(r);
        }
    }
    let summaries: Vec<JobSummary> = rows.iter().map(|r| r.job.clone()).collect();
    let state = crate::convert::pipeline_state(&summaries);
    let depends_on = jobs.iter().map(|j| (j.step.key.clone(), j.step.depends_on.clone())).collect();
    let page = gpuci_web::PipelinePage { id, file_name: p.file_name, state, rows, depends_on };
    html(gpuci_web::pipeline(&page, &v, now_ms()))
}

/// A pipeline id from the path; a bad one answers 400 (before anything else is checked).
// An axum response is the error a handler answers with, as is; boxing it buys nothing.
#[allow(clippy::result_large_err)]
fn pipeline_id(st: &AppState, headers: &HeaderMap, raw: &str) -> Result<i64, Response> {
    raw.parse::<i64>().map_err(|_| {
        page_error(StatusCode::BAD_REQUEST, &viewer(st, headers), "Bad request", "a pipeline id is a number")
    })
}

/// "Retry failed" from the pipeline page: `POST /api/v1/pipelines/N/retry-failed`'s command,
/// after the page's checks (the admin, the form token).
pub(super) async fn retry_failed(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let id = match pipeline_id(&st, &headers, &id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    let by = "the dashboard".to_string();
    let audit = (AuditAction::JobRetry, format!("pipeline {id} (failed jobs)"));
    change(
        &st,
        &headers,
        &f.csrf,
        audit,
        |reply| Command::RetryFailed { pipeline: id, by, reply },
        |_| format!("/ui/pipelines/{id}"),
    )
    .await
}

/// "Cancel all" from the pipeline page.
pub(super) async fn cancel_all(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let id = match pipeline_id(&st, &headers, &id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    let reason = "pipeline cancelled from the dashboard".to_string();
    let audit = (AuditAction::JobCancel, format!("pipeline {id} (all jobs)"));
    change(
        &st,
        &headers,
        &f.csrf,
        audit,
        |reply| Command::CancelPipeline { pipeline: id, reason, reply },
        |_| format!("/ui/pipelines/{id}"),
    )
    .await
}
