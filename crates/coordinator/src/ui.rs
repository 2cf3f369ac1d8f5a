//! The web dashboard: who is looking (a session cookie from signing in with the API token or
//! the read-only token, or nobody), what they may see (signed in: everything; nobody: the
//! public repositories' jobs and logs), the data each page needs, and live updates as
//! server-sent events. Pages are rendered by `gpuci_web`; changes go through the brain as the
//! API's do. Every change a page makes is a POST that carries the session's form token.

use crate::api::{agent_names, ask, load_job, summarize, ApiError};
use crate::brain::{now_ms, Command};
use crate::hub::Event;
use crate::origin::Origin as PipelineOrigin;
use crate::AppState;
use axum::extract::{Form, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use gpuci_core::job::JobState;
use gpuci_protocol::api::JobSummary;
use gpuci_protocol::JobId;
use gpuci_store::JobFilter;
use gpuci_web::{JobRow, Role, Viewer};
use hmac::{Hmac, Mac};
use maud::Markup;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;
use tokio::sync::broadcast;

const COOKIE: &str = "gpuci_session";
const SESSION_SECS: i64 = 7 * 86_400;
/// Rows a list page shows.
const PAGE: usize = 100;
/// Log lines the job page shows at first (the end of a longer log).
const LOG_TAIL: i64 = 5_000;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/ui/") }))
        .route("/ui", get(|| async { Redirect::to("/ui/") }))
        .route("/ui/", get(jobs_page))
        .route("/ui/login", get(login_page).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/jobs/{id}", get(job_page))
        .route("/ui/jobs/{id}/events", get(job_events))
        .route("/ui/jobs/{id}/cancel", post(cancel))
        .route("/ui/jobs/{id}/retry", post(retry))
        .route("/ui/pipelines/{id}", get(pipeline_page))
        .route("/ui/queue", get(queue_page))
        .route("/ui/fleet", get(fleet_page))
        .route("/ui/spend", get(spend_page))
        .route("/ui/gpus/{uuid}/release", post(release))
        .route("/ui/events", get(list_events))
        .route(gpuci_web::CSS_PATH, get(|| async { asset("text/css; charset=utf-8", gpuci_web::CSS) }))
        .route(gpuci_web::JS_PATH, get(|| async { asset("text/javascript; charset=utf-8", gpuci_web::JS) }))
        .layer(axum::middleware::map_response(headers))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "public, max-age=31536000, immutable")], body)
        .into_response()
}

/// What every dashboard response carries: no scripts but ours, no framing, no sniffing.
async fn headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.entry(header::CACHE_CONTROL).or_insert(HeaderValue::from_static("no-store"));
    r
}

// ---- who is looking -------------------------------------------------------------------------

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Admin => "admin",
        Role::Reader => "read",
        Role::Anonymous => "none",
    }
}

/// The key a session of `role` is signed with: derived from that role's token, so a new
/// token ends every session made with the old one.
fn session_key(st: &AppState, role: Role) -> Vec<u8> {
    let token = match role {
        Role::Admin => st.api_token.expose(),
        Role::Reader => st.read_token.expose(),
        Role::Anonymous => "",
    };
    Sha256::digest(format!("gpuci dashboard session\0{}\0{token}", role_name(role))).to_vec()
}

fn mac(key: &[u8], msg: &str) -> Hmac<Sha256> {
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    m.update(msg.as_bytes());
    m
}

fn sign(key: &[u8], msg: &str) -> String {
    hex::encode(mac(key, msg).finalize().into_bytes())
}

fn new_session(st: &AppState, role: Role) -> String {
    let payload = format!("{}.{}", role_name(role), now_ms() / 1000 + SESSION_SECS);
    let sig = sign(&session_key(st, role), &payload);
    format!("{payload}.{sig}")
}

fn cookie_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).find_map(|c| {
        let (k, v) = c.trim().split_once('=')?;
        (k == name).then_some(v)
    })
}

/// The viewer of a request: a bearer token (scripts, tests) or the session cookie.
fn viewer(st: &AppState, headers: &HeaderMap) -> Viewer {
    if let Some(t) = crate::auth::bearer(headers) {
        let role = if st.api_token.matches(t) {
            Role::Admin
        } else if st.read_token.matches(t) {
            Role::Reader
        } else {
            Role::Anonymous
        };
        // A bearer token cannot be sent by another site's page: no form token needed.
        return Viewer { role, csrf: String::new() };
    }
    let Some(session) = cookie_value(headers, COOKIE) else { return anonymous() };
    let Some((payload, sig)) = session.rsplit_once('.') else { return anonymous() };
    let Some((role, expires)) = payload.split_once('.') else { return anonymous() };
    let role = match role {
        "admin" => Role::Admin,
        "read" => Role::Reader,
        _ => return anonymous(),
    };
    let key = session_key(st, role);
    let Ok(sig) = hex::decode(sig) else { return anonymous() };
    if mac(&key, payload).verify_slice(&sig).is_err() {
        return anonymous();
    }
    if expires.parse::<i64>().map_or(true, |e| e < now_ms() / 1000) {
        return anonymous();
    }
    Viewer { role, csrf: sign(&key, &format!("csrf.{session}")) }
}

fn anonymous() -> Viewer {
    Viewer { role: Role::Anonymous, csrf: String::new() }
}

/// A change from a page: the viewer must be an admin, and a cookie session must send back its
/// form token from a page of this origin.
fn may_change(st: &AppState, headers: &HeaderMap, csrf: &str) -> Result<Viewer, Response> {
    let v = viewer(st, headers);
    if v.role != Role::Admin {
        let msg =
            if v.signed_in() { "the read-only token changes nothing" } else { "sign in with the API token first" };
        return Err(page_error(StatusCode::FORBIDDEN, &v, "Not allowed", msg));
    }
    if crate::auth::bearer(headers).is_none() {
        use subtle::ConstantTimeEq;
        if v.csrf.is_empty() || !bool::from(v.csrf.as_bytes().ct_eq(csrf.as_bytes())) {
            return Err(page_error(
                StatusCode::FORBIDDEN,
                &v,
                "Not allowed",
                "the form is stale or came from elsewhere; reload the page and try again",
            ));
        }
        if let (Some(origin), Some(host)) = (headers.get(header::ORIGIN), headers.get(header::HOST)) {
            let origin = origin.to_str().unwrap_or_default();
            let host = host.to_str().unwrap_or_default();
            if origin.split_once("://").map(|(_, h)| h) != Some(host) {
                return Err(page_error(StatusCode::FORBIDDEN, &v, "Not allowed", "the form came from another site"));
            }
        }
    }
    Ok(v)
}

fn html(m: Markup) -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], m.into_string()).into_response()
}

fn page_error(status: StatusCode, v: &Viewer, title: &str, text: &str) -> Response {
    (status, html(gpuci_web::message(title, v, text))).into_response()
}

/// Signed-in pages send nobody to the sign-in page, and back here after.
fn sign_in_first(path: &str) -> Response {
    Redirect::to(&format!("/ui/login?next={}", gpuci_web::enc(path))).into_response()
}

fn api_error(v: &Viewer, e: ApiError) -> Response {
    let (status, msg) = e.parts();
    page_error(status, v, "Error", &msg)
}

// ---- sign-in --------------------------------------------------------------------------------

#[derive(Deserialize)]
struct LoginQuery {
    next: Option<String>,
}

/// Only paths of this dashboard: never another site (an open redirect).
fn safe_next(next: Option<&str>) -> String {
    match next {
        Some(n) if n.starts_with("/ui/") && !n.starts_with("//") && !n.contains('\\') && !n.contains("://") => {
            n.to_string()
        }
        _ => "/ui/".to_string(),
    }
}

async fn login_page(Query(q): Query<LoginQuery>) -> Response {
    html(gpuci_web::login(None, &safe_next(q.next.as_deref())))
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
    next: Option<String>,
}

async fn login(State(st): State<AppState>, Form(f): Form<LoginForm>) -> Response {
    let token = f.token.trim();
    let role = if st.api_token.matches(token) {
        Role::Admin
    } else if st.read_token.matches(token) {
        Role::Reader
    } else {
        let next = safe_next(f.next.as_deref());
        return (StatusCode::UNAUTHORIZED, html(gpuci_web::login(Some("That token is not valid."), &next)))
            .into_response();
    };
    let cookie =
        format!("{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECS}", new_session(&st, role));
    let mut r = Redirect::to(&safe_next(f.next.as_deref())).into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

#[derive(Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

async fn logout(State(st): State<AppState>, headers: HeaderMap, Form(f): Form<CsrfForm>) -> Response {
    let v = viewer(&st, &headers);
    use subtle::ConstantTimeEq;
    if v.signed_in() && !v.csrf.is_empty() && !bool::from(v.csrf.as_bytes().ct_eq(f.csrf.as_bytes())) {
        return page_error(StatusCode::FORBIDDEN, &v, "Not allowed", "the form is stale; reload the page");
    }
    let mut r = Redirect::to("/ui/").into_response();
    r.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static("gpuci_session=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
    );
    r
}

// ---- data -----------------------------------------------------------------------------------

/// `owner/name`, lowercase, however a pipeline spells its repository.
fn repo_key(r: &str) -> String {
    crate::fleets::repository_name(r).to_ascii_lowercase()
}

fn is_public(st: &AppState, repository: Option<&str>) -> bool {
    repository.is_some_and(|r| {
        let r = repo_key(r);
        st.public_repositories.iter().any(|p| repo_key(p) == r)
    })
}

/// GitHub's web address for a repository, from the configured API address.
fn github_web(st: &AppState) -> Option<String> {
    let api = st.github_api_url.as_deref().unwrap_or("https://api.github.com").trim_end_matches('/');
    if api == "https://api.github.com" {
        Some("https://github.com".into())
    } else {
        api.strip_suffix("/api/v3").map(str::to_string)
    }
}

/// Origins of these pipelines: (repository `owner/name`, the view).
async fn origins(st: &AppState, pipelines: BTreeSet<i64>) -> Result<HashMap<i64, gpuci_web::Origin>, ApiError> {
    let ids: Vec<i64> = pipelines.into_iter().collect();
    let raw = st.store.pipeline_origins(&ids).await?;
    let web = github_web(st);
    Ok(raw
        .into_iter()
        .map(|(id, (repository, origin))| {
            let mut o = gpuci_web::Origin {
                repository: repository.as_deref().map(crate::fleets::repository_name),
                ..Default::default()
            };
            match PipelineOrigin::parse(origin.as_deref()) {
                Some(PipelineOrigin::Github(g)) => {
                    o.repository = Some(g.repository.clone());
                    o.sha = Some(g.sha);
                    o.pr = g.pr;
                    o.event = Some(g.event);
                    o.repository_url = web.as_ref().map(|w| format!("{w}/{}", g.repository));
                }
                Some(PipelineOrigin::ActionsRunner(r)) => {
                    o.repository = Some(r.repository.clone());
                    o.event = Some("workflow_job".into());
                    o.repository_url = web.as_ref().map(|w| format!("{w}/{}", r.repository));
                }
                None => {}
            }
            (id, o)
        })
        .collect())
}

async fn rows(st: &AppState, jobs: &[gpuci_store::JobRecord]) -> Result<Vec<JobRow>, ApiError> {
    let summaries = summarize(jobs, &agent_names(st.store.as_ref()).await);
    let origins = origins(st, jobs.iter().map(|j| j.pipeline_id).collect()).await?;
    Ok(summaries
        .into_iter()
        .map(|job| {
            let origin = origins.get(&job.pipeline_id).cloned().unwrap_or_default();
            let fleet = job.cost.as_ref().map(|c| c.fleet.clone());
            JobRow { job, origin, fleet }
        })
        .collect())
}

fn fleets(st: &AppState) -> Vec<crate::fleets::FleetStatus> {
    st.fleets.read().map(|f| f.clone()).unwrap_or_default()
}

// ---- pages ----------------------------------------------------------------------------------

#[derive(Deserialize, Default)]
struct JobsQuery {
    #[serde(default)]
    repo: String,
    #[serde(default)]
    state: String,
    #[serde(default)]
    fleet: String,
    before: Option<i64>,
}

async fn jobs_page(State(st): State<AppState>, headers: HeaderMap, Query(q): Query<JobsQuery>) -> Response {
    let v = viewer(&st, &headers);
    match jobs_inner(&st, &v, q).await {
        Ok(m) => html(m),
        Err(e) => api_error(&v, e),
    }
}

async fn jobs_inner(st: &AppState, v: &Viewer, q: JobsQuery) -> Result<Markup, ApiError> {
    let mut states = Vec::new();
    if !q.state.is_empty() {
        states.push(q.state.parse::<JobState>().map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e))?);
    }
    let filtering = !q.repo.is_empty() || !q.fleet.is_empty() || !v.signed_in();
    // With a filter the store cannot apply, read a larger window and filter it here.
    let window = if filtering { 5_000 } else { PAGE as u32 + 1 };
    let jobs = st.store.list_jobs(&JobFilter { states, pipeline: None, limit: Some(window), before: q.before }).await?;
    let mut all = rows(st, &jobs).await?;
    let mut repositories: BTreeSet<String> = all.iter().filter_map(|r| r.origin.repository.clone()).collect();
    if !v.signed_in() {
        all.retain(|r| is_public(st, r.origin.repository.as_deref()));
        repositories.retain(|r| is_public(st, Some(r)));
        for p in st.public_repositories.iter() {
            repositories.insert(p.clone());
        }
    }
    if !q.repo.is_empty() {
        let want = repo_key(&q.repo);
        all.retain(|r| r.origin.repository.as_deref().map(repo_key).as_deref() == Some(want.as_str()));
        repositories.insert(q.repo.clone());
    }
    if !q.fleet.is_empty() {
        all.retain(|r| r.fleet.as_deref() == Some(q.fleet.as_str()));
    }
    let next_page = (all.len() > PAGE || jobs.len() == window as usize)
        .then(|| all.get(PAGE.min(all.len()).saturating_sub(1)).map(|r| r.job.id))
        .flatten();
    all.truncate(PAGE);
    let fleets: Vec<String> = st.fleets.read().map(|f| f.iter().map(|f| f.name.clone()).collect()).unwrap_or_default();
    let filters = gpuci_web::JobFilters { repository: q.repo, state: q.state, fleet: q.fleet };
    Ok(gpuci_web::jobs(&all, &filters, &repositories.into_iter().collect::<Vec<_>>(), &fleets, next_page, v, now_ms()))
}

/// The job and its row, if this viewer may see it.
async fn visible_job(st: &AppState, v: &Viewer, id: JobId) -> Result<JobRow, Response> {
    let j = load_job(st, id).await.map_err(|e| api_error(v, e))?;
    let row = rows(st, &[j]).await.map_err(|e| api_error(v, e))?.remove(0);
    if !v.signed_in() && !is_public(st, row.origin.repository.as_deref()) {
        // The same answer as a job that does not exist: private jobs are not confirmed.
        return Err(page_error(
            StatusCode::NOT_FOUND,
            v,
            "Not found",
            &format!("job {id} not found (sign in to see private repositories' jobs)"),
        ));
    }
    Ok(row)
}

async fn job_page(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let v = viewer(&st, &headers);
    let Ok(id) = id.parse::<JobId>() else {
        return page_error(StatusCode::BAD_REQUEST, &v, "Bad request", "a job id is a number");
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

async fn job_inner(st: &AppState, v: &Viewer, row: JobRow) -> Result<Markup, ApiError> {
    let id = row.job.id;
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
    if let Some(check) = st.store.get_check_run(id).await? {
        let mut row = row;
        if let (Some(url), Some(_)) = (&row.origin.repository_url, &row.origin.sha) {
            row.origin.check_run_url = Some(format!("{url}/runs/{check}"));
        }
        let page = gpuci_web::JobPage { row, lines, skipped_lines: after, points, memory_total, retried_by };
        return Ok(gpuci_web::job(&page, v, now_ms()));
    }
    let page = gpuci_web::JobPage { row, lines, skipped_lines: after, points, memory_total, retried_by };
    Ok(gpuci_web::job(&page, v, now_ms()))
}

/// The leased GPUs' memory together, from their agent's inventory.
async fn memory_of(st: &AppState, j: &JobSummary) -> Option<u64> {
    if j.gpus.is_empty() {
        return None;
    }
    let agents = ask(st, |reply| Command::Agents { reply }).await.ok()?;
    let total: u64 = agents
        .iter()
        .flat_map(|a| a.gpus.iter())
        .filter(|g| j.gpus.contains(&g.info.uuid))
        .map(|g| g.info.memory.0)
        .sum();
    (total > 0).then_some(total)
}

#[derive(Deserialize)]
struct AfterQuery {
    after: Option<i64>,
}

/// A job page's live stream: `line` (rendered), `state`, `charts`, and `end` once it finished.
async fn job_events(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<AfterQuery>,
) -> Response {
    let v = viewer(&st, &headers);
    let Ok(id) = id.parse::<JobId>() else {
        return page_error(StatusCode::BAD_REQUEST, &v, "Bad request", "a job id is a number");
    };
    if let Err(r) = visible_job(&st, &v, id).await {
        return r;
    }
    // A reconnecting browser says where it was.
    let resume = headers.get("last-event-id").and_then(|h| h.to_str().ok()).and_then(|s| s.parse::<i64>().ok());
    let mut last = resume.or(q.after).unwrap_or(0).max(0);
    let mut events = st.hub.subscribe();
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(512);
    tokio::spawn(async move {
        let line_event = |l: &gpuci_protocol::api::LogLine| {
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
                    "reason": j.reason,
                    "duration": gpuci_web::job_duration(j, now_ms()),
                })
                .to_string(),
            )
        };
        let mut last_charts = std::time::Instant::now() - std::time::Duration::from_secs(10);
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
                    _ = tx.closed() => return,
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
                        if let Some(l) = st.live.job(id) {
                            let html = gpuci_web::charts_fragment(&l.points, None).into_string();
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

/// List pages' live stream: `job` whenever a job this viewer may see changes (no data: the
/// page fetches itself again).
async fn list_events(State(st): State<AppState>, headers: HeaderMap) -> Response {
    let v = viewer(&st, &headers);
    let mut events = st.hub.subscribe();
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(16);
    tokio::spawn(async move {
        let mut public: HashMap<i64, bool> = HashMap::new();
        loop {
            let ev = tokio::select! {
                _ = tx.closed() => return,
                _ = st.shutdown.cancelled() => return,
                ev = events.recv() => ev,
            };
            let pipeline = match ev {
                Ok(Event::Job(j)) => j.pipeline_id,
                Ok(_) => continue,
                Err(broadcast::error::RecvError::Lagged(_)) => 0,
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if !v.signed_in() && pipeline != 0 {
                let visible = match public.get(&pipeline) {
                    Some(p) => *p,
                    None => {
                        let repo = st.store.get_pipeline(pipeline).await.ok().flatten().and_then(|p| p.repository);
                        let origin = st.store.get_pipeline(pipeline).await.ok().flatten().and_then(|p| p.origin);
                        let repo = match PipelineOrigin::parse(origin.as_deref()) {
                            Some(PipelineOrigin::Github(g)) => Some(g.repository),
                            Some(PipelineOrigin::ActionsRunner(r)) => Some(r.repository),
                            None => repo,
                        };
                        let p = is_public(&st, repo.as_deref());
                        public.insert(pipeline, p);
                        p
                    }
                };
                if !visible {
                    continue;
                }
            }
            // Many changes at once make one event: the page refetches once anyway.
            if tx.try_send(SseEvent::default().event("job").data("")).is_err() && tx.is_closed() {
                return;
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    let stream = futures::StreamExt::map(stream, Ok::<_, Infallible>);
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

async fn pipeline_page(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
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
    let jobs = match st.store.pipeline_jobs(id).await {
        Ok(j) => j,
        Err(e) => return api_error(&v, e.into()),
    };
    let rows = match rows(&st, &jobs).await {
        Ok(r) => r,
        Err(e) => return api_error(&v, e),
    };
    let repo = origins(&st, [id].into()).await.ok().and_then(|o| o.get(&id).and_then(|o| o.repository.clone()));
    if !v.signed_in() && !is_public(&st, repo.as_deref()) {
        return not_found(&v);
    }
    let summaries: Vec<JobSummary> = rows.iter().map(|r| r.job.clone()).collect();
    let state = crate::convert::pipeline_state(&summaries);
    html(gpuci_web::pipeline(id, &p.file_name, &state, &rows, &v, now_ms()))
}

async fn queue_page(State(st): State<AppState>, headers: HeaderMap) -> Response {
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

async fn fleet_page(State(st): State<AppState>, headers: HeaderMap) -> Response {
    let v = viewer(&st, &headers);
    if !v.signed_in() {
        return sign_in_first("/ui/fleet");
    }
    let agents = match ask(&st, |reply| Command::Agents { reply }).await {
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
struct SpendQuery {
    days: Option<u32>,
}

async fn spend_page(State(st): State<AppState>, headers: HeaderMap, Query(q): Query<SpendQuery>) -> Response {
    let v = viewer(&st, &headers);
    if !v.signed_in() {
        return sign_in_first("/ui/spend");
    }
    let days = q.days.unwrap_or(7).clamp(1, 366);
    let now = now_ms();
    const DAY: i64 = 86_400_000;
    let from = (now.div_euclid(DAY) - i64::from(days) + 1) * DAY;
    let (machines, stretches, runs) = match crate::fleets::cost_inputs(st.store.as_ref(), from).await {
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
            (b.repository.clone(), s, b.daily)
        })
        .collect();
    html(gpuci_web::spend(&report, &fleets(&st), &budgets, days, &v))
}

// ---- changes --------------------------------------------------------------------------------

/// A change from a page: checked (admin, form token), asked of the brain, then back to the
/// page `done` names for its answer.
async fn change<T>(
    st: &AppState,
    headers: &HeaderMap,
    csrf: &str,
    make: impl FnOnce(crate::brain::Reply<T>) -> Command,
    done: impl FnOnce(T) -> String,
) -> Response {
    let v = match may_change(st, headers, csrf) {
        Ok(v) => v,
        Err(r) => return r,
    };
    match ask(st, make).await {
        Ok(t) => Redirect::to(&done(t)).into_response(),
        Err(e) => api_error(&v, e.into()),
    }
}

/// A job id from the path; a bad one answers 400 (before anything else is checked).
fn job_id(st: &AppState, headers: &HeaderMap, raw: &str) -> Result<JobId, Response> {
    raw.parse::<JobId>()
        .map_err(|_| page_error(StatusCode::BAD_REQUEST, &viewer(st, headers), "Bad request", "a job id is a number"))
}

async fn cancel(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let id = match job_id(&st, &headers, &id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    let reason = "cancelled from the dashboard".to_string();
    change(&st, &headers, &f.csrf, |reply| Command::Cancel { job: id, reason, reply }, |_| format!("/ui/jobs/{id}"))
        .await
}

async fn retry(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let id = match job_id(&st, &headers, &id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    let by = "the dashboard".to_string();
    change(&st, &headers, &f.csrf, |reply| Command::Retry { job: id, by, reply }, |j| format!("/ui/jobs/{}", j.id))
        .await
}

async fn release(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(uuid): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    change(&st, &headers, &f.csrf, |reply| Command::ReleaseGpu { uuid, reply }, |_| "/ui/fleet".to_string()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_is_only_a_dashboard_path() {
        assert_eq!(safe_next(Some("/ui/jobs/3")), "/ui/jobs/3");
        for bad in ["https://evil.example/", "//evil.example/ui/", "/ui/\\evil", "/api/v1/jobs", "/ui/x?u=https://e"] {
            assert_eq!(safe_next(Some(bad)), "/ui/", "{bad}");
        }
    }
}
