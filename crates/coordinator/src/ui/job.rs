//! A job's page and its live stream: state, log, GPU charts.

use super::*;
use crate::api::LogScrub;

/// The job and its row, if this viewer may see it.
pub(super) async fn visible_job(st: &AppState, v: &Viewer, id: JobId) -> Result<JobRow, Response> {
    // One answer for a job that does not exist and one this viewer may not see.
    let not_found = || {
        let hint = if v.signed_in() { "" } else { " (sign in to see private repositories' jobs)" };
        page_error(StatusCode::NOT_FOUND, v, "Not found", &format!("job {id} not found{hint}"))
    };
    let j = match st.store.get_job(id).await {
        Ok(Some(j)) => j,
        Ok(None) => return Err(not_found()),
        Err(e) => return Err(api_error(v, e.into())),
    };
    let mut row = rows(st, &[j]).await.map_err(|e| api_error(v, e))?.remove(0);
    if !v.signed_in() {
        if !row.origin.public {
            return Err(not_found());
        }
        Scrub::load(st).await.row(&mut row);
    }
    Ok(row)
}

pub(super) async fn job_page(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let v = viewer(&st, &headers);
    let id = match job_id(&st, &headers, &id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    let row = match visible_job(&st, &v, id).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    match job_inner(&st, &v, row).await {
        Ok(m) => html(m),
        Err(e) => api_error(&v, e),
    }
}

pub(super) async fn job_inner(st: &AppState, v: &Viewer, mut row: JobRow) -> Result<Markup, ApiError> {
    let id = row.job.id;
    // Only where the cost shows at all (not to anonymous viewers of a public job).
    crate::job_cost::add_overhead(st.store.as_ref(), &mut row.job).await;
    let (count, last) = st.store.log_extent(id).await?;
    let _ = count;
    let after = (last - LOG_TAIL).max(0);
    let mut lines = Vec::new();
    let mut from = after;
    loop {
        let chunk = st.store.read_logs(id, from, 1000).await?;
        let n = chunk.len();
        if let Some(l) = chunk.last() {
            from = l.seq;
        }
        lines.extend(chunk);
        if n < 1000 {
            break;
        }
    }
    // Within the byte budget, the newest lines win.
    let mut bytes = 0usize;
    let keep_from = lines
        .iter()
        .rposition(|l| {
            bytes += l.text.len().min(gpuci_web::MAX_LINE_SHOWN);
            bytes > LOG_TAIL_BYTES
        })
        .map_or(0, |i| i + 1);
    let after = after + keep_from as i64;
    let lines: Vec<_> = lines.into_iter().skip(keep_from).collect();
    let lines = if v.signed_in() {
        lines
    } else {
        let scrub = Scrub::load(st).await;
        lines.into_iter().map(|l| scrub.line(l)).collect()
    };
    let points = match (&row.job.telemetry, st.live.job(id)) {
        (Some(t), _) if !t.series.is_empty() => t.series.clone(),
        (_, Some(l)) => l.points,
        _ => Vec::new(),
    };
    let memory_total = memory_of(st, &row.job).await;
    let retried_by = if row.job.state.is_terminal() {
        st.store
            .pipeline_jobs(row.job.pipeline_id)
            .await?
            .iter()
            .find(|j| j.step.key == row.job.step_key && j.id > id)
            .map(|j| j.id)
    } else {
        None
    };
    let artifacts = st.store.job_artifacts(id).await?.iter().map(crate::artifacts::info).collect();
    let tests = crate::test_reports::of_job(st.store.as_ref(), id).await?;
    let mut row = row;
    if let Some(check) = st.store.get_check_run(id).await? {
        if let (Some(url), Some(_)) = (&row.origin.repository_url, &row.origin.sha) {
            row.origin.check_run_url = Some(format!("{url}/runs/{check}"));
        }
    }
    let page =
        gpuci_web::JobPage { row, lines, skipped_lines: after, points, memory_total, retried_by, artifacts, tests };
    Ok(gpuci_web::job(&page, v, now_ms()))
}

/// The leased GPUs' memory together, from their agent's inventory.
pub(super) async fn memory_of(st: &AppState, j: &JobSummary) -> Option<u64> {
    if j.gpus.is_empty() {
        return None;
    }
    let agents = st.ask(|reply| Command::Agents { reply }).await.ok()?;
    let total: u64 = agents
        .iter()
        .flat_map(|a| a.gpus.iter())
        .filter(|g| j.gpus.contains(&g.info.uuid))
        .map(|g| g.info.memory.0)
        .sum();
    (total > 0).then_some(total)
}

#[derive(Deserialize)]
pub(super) struct AfterQuery {
    after: Option<i64>,
}

/// A job page's live stream: `line` (rendered), `state`, `charts`, and `end` once it finished.
pub(super) async fn job_events(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<AfterQuery>,
) -> Response {
    let v = viewer(&st, &headers);
    let id = match job_id(&st, &headers, &id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    if let Err(r) = visible_job(&st, &v, id).await {
        return r;
    }
    let Some(permit) = stream_permit(&st, &v) else { return too_many_streams(&v) };
    let scrub = if v.signed_in() { None } else { Some(Scrub::load(&st).await) };
    // A reconnecting browser says where it was.
    let resume = headers.get("last-event-id").and_then(|h| h.to_str().ok()).and_then(|s| s.parse::<i64>().ok());
    let mut last = resume.or(q.after).unwrap_or(0).max(0);
    let mut events = st.hub.subscribe();
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(LIVE_QUEUE);
    tokio::spawn(async move {
        let _permit = permit;
        let tx = Stalling(tx);
        let line_event = |l: &gpuci_protocol::api::LogLine| {
            let scrubbed;
            let l = match &scrub {
                Some(s) => {
                    scrubbed = s.line(l.clone());
                    &scrubbed
                }
                None => l,
            };
            let html = gpuci_web::log_line(l).into_string();
            SseEvent::default()
                .event("line")
                .id(l.seq.to_string())
                .data(serde_json::json!({"seq": l.seq, "html": html}).to_string())
        };
        let state_event = |j: &JobSummary| {
            SseEvent::default().event("state").data(
                serde_json::json!({
                    "badge": gpuci_web::state_fragment(j),
                    "reason": gpuci_web::ansi::visible(&scrub.as_ref().map_or_else(|| j.reason.clone(), |s| s.text(&j.reason))),
                    "duration": gpuci_web::job_duration(j, now_ms()),
                })
                .to_string(),
            )
        };
        let mut last_charts = std::time::Instant::now() - std::time::Duration::from_secs(10);
        // The leased GPUs' memory together: the memory chart's top, as the page drew it
        // (regression: live charts were drawn without it and said "of 0.0 GiB"). Looked up
        // on the first samples: a job opened while queued has no GPUs yet.
        let mut memory_total: Option<u64> = None;
        loop {
            // Catch up from the store (at first, and after falling behind the hub).
            loop {
                let Ok(lines) = st.store.read_logs(id, last, 1000).await else { return };
                let n = lines.len();
                for l in &lines {
                    last = l.seq;
                    if tx.send(line_event(l)).await.is_err() {
                        return;
                    }
                }
                if n < 1000 {
                    break;
                }
            }
            let Ok(Some(job)) = st.store.get_job(id).await else { return };
            if job.state.is_terminal() {
                let s = crate::convert::job_summary(&job, None);
                let _ = tx.send(state_event(&s)).await;
                let _ = tx.send(SseEvent::default().event("end").data(job.state.as_str())).await;
                return;
            }
            loop {
                let ev = tokio::select! {
                    _ = tx.0.closed() => return,
                    _ = st.shutdown.cancelled() => return,
                    ev = events.recv() => ev,
                };
                match ev {
                    Ok(Event::Log { job_id, line, .. }) if job_id == id && line.seq == last + 1 => {
                        last = line.seq;
                        if tx.send(line_event(&line)).await.is_err() {
                            return;
                        }
                    }
                    Ok(Event::Log { job_id, line, .. }) if job_id == id && line.seq > last + 1 => break,
                    Ok(Event::Job(j)) if j.id == id => {
                        if j.state.is_terminal() {
                            break;
                        }
                        if tx.send(state_event(&j)).await.is_err() {
                            return;
                        }
                    }
                    Ok(Event::Telemetry { job_id, .. }) if job_id == id && last_charts.elapsed().as_secs() >= 2 => {
                        last_charts = std::time::Instant::now();
                        if memory_total.is_none() {
                            if let Ok(Some(j)) = st.store.get_job(id).await {
                                memory_total = memory_of(&st, &crate::convert::job_summary(&j, None)).await;
                            }
                        }
                        if let Some(l) = st.live.job(id) {
                            let html = gpuci_web::charts_fragment(&l.points, memory_total).into_string();
                            let e =
                                SseEvent::default().event("charts").data(serde_json::json!({"html": html}).to_string());
                            if tx.send(e).await.is_err() {
                                return;
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => break,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    let stream = futures::StreamExt::map(stream, Ok::<_, Infallible>);
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// Who may read a job's raw log (`GET /api/v1/jobs/N/logs`, linked from the job page): the
/// job page's rules. A bearer token is the API's to judge (the admin or a named token). Without
/// one, a dashboard session (the read-only one too) reads every job's log, and nobody reads a
/// public repository's job's log. Anything else is refused as before (401), whether the job
/// exists or not. (Regression: the link answered 401 to a signed-in read-only user.)
pub(crate) async fn log_access(
    State(st): State<AppState>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if crate::auth::bearer(req.headers()).is_some() {
        return crate::api::require_api_token(State(st), req, next).await;
    }
    let v = viewer(&st, req.headers());
    if v.signed_in() {
        return next.run(req).await;
    }
    // A public job's log, artifacts and test report, as its page shows them.
    let id = req
        .uri()
        .path()
        .strip_prefix("/api/v1/jobs/")
        .and_then(|p| p.split_once('/'))
        .filter(|(_, what)| matches!(*what, "logs" | "artifacts" | "artifact" | "test-report"))
        .and_then(|(id, _)| id.parse::<JobId>().ok());
    if let Some(id) = id {
        if visible_job(&st, &v, id).await.is_ok() {
            let scrub = Scrub::load(&st).await;
            req.extensions_mut().insert(LogScrub(std::sync::Arc::new(move |l| scrub.line(l))));
            return next.run(req).await;
        }
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "missing API token (Authorization: Bearer <token>; see <data-dir>/api-token), or sign in to the dashboard",
    )
    .into_response()
}
