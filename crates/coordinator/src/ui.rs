//! The web dashboard: who is looking (a session cookie from signing in with the API token or
//! the read-only token, or nobody), what they may see (signed in: everything; nobody: the
//! public repositories' jobs and logs), the data each page needs, and live updates as
//! server-sent events. Pages are rendered by `gpuci_web`; changes go through the brain as the
//! API's do. Every change a page makes is a POST that carries the session's form token.

use crate::api::{agent_names, ask, summarize, ApiError};
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
use gpuci_core::audit::AuditAction;
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
/// Over HTTPS (a proxy saying `X-Forwarded-Proto: https`): `Secure`, and bound to this host
/// alone (`__Host-`), so no page on another port or subdomain ever receives it.
const SECURE_COOKIE: &str = "__Host-gpuci_session";
const SESSION_SECS: i64 = 7 * 86_400;
/// Rows a list page shows.
const PAGE: usize = 100;
/// Log lines the job page shows at first (the end of a longer log), and the most text they
/// may hold together: a hostile job's lines are long and dense.
const LOG_TAIL: i64 = 2_000;
const LOG_TAIL_BYTES: usize = 1 << 20;
/// Live streams (server-sent events) open at once; past it a stream is refused (503) and the
/// page still works, just not live.
pub const MAX_LIVE_STREAMS: usize = 256;
/// A live stream whose browser reads nothing for this long is closed (it reconnects and
/// resumes where it was).
const STALLED_STREAM: std::time::Duration = std::time::Duration::from_secs(10);

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
        .route("/ui/audit", get(audit_page))
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

fn cookie_values<'a>(headers: &'a HeaderMap, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).filter_map(
        move |c| {
            let (k, v) = c.trim().split_once('=')?;
            (k == name).then_some(v)
        },
    )
}

/// Sessions signed out before they expired: (signature, expiry in Unix seconds). In memory:
/// a restart forgets them (a new token ends every session for good).
#[derive(Default)]
pub struct Revoked(std::sync::Mutex<HashMap<String, i64>>);

impl Revoked {
    fn add(&self, sig: &str, expires: i64) {
        let now = now_ms() / 1000;
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, e| *e >= now);
        m.insert(sig.to_string(), expires);
    }
    fn contains(&self, sig: &str) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).contains_key(sig)
    }
}

/// A session cookie's role, expiry and signature, when it is one this server signed, unexpired
/// and not signed out.
fn check_session(st: &AppState, session: &str) -> Option<(Role, i64, String)> {
    let (payload, sig) = session.rsplit_once('.')?;
    let (role, expires) = payload.split_once('.')?;
    let role = match role {
        "admin" => Role::Admin,
        "read" => Role::Reader,
        _ => return None,
    };
    // One spelling only: lowercase hex, as signed.
    if sig.len() != 64 || !sig.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let expires: i64 = expires.parse().ok().filter(|e: &i64| e.to_string() == expires)?;
    let key = session_key(st, role);
    mac(&key, payload).verify_slice(&hex::decode(sig).ok()?).ok()?;
    if expires < now_ms() / 1000 || st.revoked_sessions.contains(sig) {
        return None;
    }
    Some((role, expires, sig.to_string()))
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
    // The first valid session wins: a cookie planted beside it (by a page on another port of
    // this host) can neither sign the user out nor in as someone else.
    for name in [SECURE_COOKIE, COOKIE] {
        for session in cookie_values(headers, name) {
            if let Some((role, _, _)) = check_session(st, session) {
                let key = session_key(st, role);
                return Viewer { role, csrf: sign(&key, &format!("csrf.{session}")) };
            }
        }
    }
    anonymous()
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

/// The request came over HTTPS, as a TLS-terminating proxy in front says.
fn https(headers: &HeaderMap) -> bool {
    headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()).is_some_and(|p| p.eq_ignore_ascii_case("https"))
}

async fn login(State(st): State<AppState>, headers: HeaderMap, Form(f): Form<LoginForm>) -> Response {
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
    let cookie = if https(&headers) {
        format!(
            "{SECURE_COOKIE}={}; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECS}",
            new_session(&st, role)
        )
    } else {
        format!("{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECS}", new_session(&st, role))
    };
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

/// Signs out: the session is revoked here (not only forgotten by the browser). Only with the
/// session's form token: another site cannot sign anyone out.
async fn logout(State(st): State<AppState>, headers: HeaderMap, Form(f): Form<CsrfForm>) -> Response {
    use subtle::ConstantTimeEq;
    let v = viewer(&st, &headers);
    if !v.signed_in() || v.csrf.is_empty() || !bool::from(v.csrf.as_bytes().ct_eq(f.csrf.as_bytes())) {
        return Redirect::to("/ui/").into_response();
    }
    for name in [SECURE_COOKIE, COOKIE] {
        for session in cookie_values(&headers, name) {
            if let Some((_, expires, sig)) = check_session(&st, session) {
                st.revoked_sessions.add(&sig, expires);
            }
        }
    }
    let mut r = Redirect::to("/ui/").into_response();
    for clear in [
        "gpuci_session=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0",
        "__Host-gpuci_session=; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age=0",
    ] {
        r.headers_mut().append(header::SET_COOKIE, HeaderValue::from_static(clear));
    }
    r
}

// ---- data -----------------------------------------------------------------------------------

/// A repository as the filter compares it: its identity with its host (`github.com/acme/x`,
/// a bare `owner/name` on the GitHub host), however it is spelled.
fn repo_key(st: &AppState, r: &str) -> String {
    gpuci_core::repo::RepoId::parse(r.trim(), &st.github_host())
        .map_or_else(|_| r.to_ascii_lowercase(), |id| id.to_string())
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
    let github_host = st.github_host();
    Ok(raw
        .into_iter()
        .map(|(id, (repository, origin))| {
            let mut o = gpuci_web::Origin {
                repository: crate::repos::name_of_pipeline(repository.as_deref(), origin.as_deref(), &github_host),
                ..Default::default()
            };
            // Public: named so in the config, and that very repository, host included
            // (GitHub's own word for GitHub origins; the remote's authority and path
            // otherwise, read strictly: `https://other.host/x@github.com/o/r` is other.host's).
            o.public = crate::repos::public_identity(repository.as_deref(), origin.as_deref(), &github_host)
                .is_some_and(|r| st.public_repositories.contains(&r));
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
    let known = agent_names(st.store.as_ref()).await;
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

/// The job and its row, if this viewer may see it.
async fn visible_job(st: &AppState, v: &Viewer, id: JobId) -> Result<JobRow, Response> {
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

/// What anonymous viewers must not learn from a public job's reason and gpuci's own lines in
/// its log: the names of agents and the UUIDs of GPUs.
struct Scrub {
    /// Agent names, longest first (a name inside another is replaced after it).
    names: Vec<String>,
}

impl Scrub {
    async fn load(st: &AppState) -> Scrub {
        let mut names: Vec<String> = st
            .store
            .list_agents()
            .await
            .map(|v| v.into_iter().map(|a| a.name).filter(|n| n.len() >= 2).collect())
            .unwrap_or_default();
        names.sort_by_key(|n| std::cmp::Reverse(n.len()));
        Scrub { names }
    }

    fn text(&self, s: &str) -> String {
        let mut out = scrub_uuids(s);
        for n in &self.names {
            out = out.replace(n.as_str(), "an agent");
        }
        out
    }

    fn row(&self, r: &mut JobRow) {
        r.job.reason = self.text(&r.job.reason);
        // Said in the job's log (scrubbed the same way): the sentences, not the agent's name.
        for u in &mut r.job.unenforced {
            u.detail = self.text(&u.detail);
        }
        r.job.agent_id = None;
        r.job.agent_name = None;
        r.job.gpus.clear();
        r.fleet = None;
        r.job.cost = None;
    }

    /// gpuci's own lines only: the job's output is the job's.
    fn line(&self, mut l: gpuci_protocol::api::LogLine) -> gpuci_protocol::api::LogLine {
        if matches!(l.stream, gpuci_protocol::agent::Stream::System) {
            l.text = self.text(&l.text);
        }
        l
    }
}

/// `GPU-…`/`MIG-…` UUIDs replaced by "a GPU".
fn scrub_uuids(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("GPU-").into_iter().chain(rest.find("MIG-")).min() {
        out.push_str(&rest[..i]);
        let tail = &rest[i + 4..];
        let len = tail.bytes().take_while(|b| b.is_ascii_hexdigit() || *b == b'-' || *b == b'/').count();
        if len >= 8 {
            out.push_str("a GPU");
        } else {
            out.push_str(&rest[i..i + 4 + len]);
        }
        rest = &tail[len..];
    }
    out.push_str(rest);
    out
}

async fn job_page(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
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
    let Some(permit) = stream_permit(&st, &v) else { return too_many_streams(&v) };
    let mut events = st.hub.subscribe();
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(16);
    tokio::spawn(async move {
        let _permit = permit;
        let mut public: HashMap<i64, bool> = HashMap::new();
        loop {
            let ev = tokio::select! {
                _ = tx.closed() => return,
                _ = st.shutdown.cancelled() => return,
                ev = events.recv() => ev,
            };
            let pipeline = match ev {
                Ok(Event::Job(j)) => Some(j.pipeline_id),
                Ok(_) => continue,
                // Fell behind: some job changed, nobody knows which.
                Err(broadcast::error::RecvError::Lagged(_)) => None,
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if !v.signed_in() {
                // Anonymous viewers hear of public pipelines only; after a lag, of nothing
                // (a private job's activity must not show as their page refreshing).
                let Some(pipeline) = pipeline else { continue };
                let visible = match public.get(&pipeline) {
                    Some(p) => *p,
                    None => {
                        let p = origins(&st, [pipeline].into())
                            .await
                            .ok()
                            .and_then(|o| o.get(&pipeline).map(|o| o.public))
                            .unwrap_or(false);
                        if public.len() > 10_000 {
                            public.clear();
                        }
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

/// Events one live stream may have waiting for its browser.
const LIVE_QUEUE: usize = 32;

/// A live stream's sender that gives up on a browser reading nothing for [`STALLED_STREAM`].
struct Stalling(tokio::sync::mpsc::Sender<SseEvent>);

impl Stalling {
    async fn send(&self, e: SseEvent) -> Result<(), ()> {
        match tokio::time::timeout(STALLED_STREAM, self.0.send(e)).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(()),
        }
    }
}

/// One of the [`MAX_LIVE_STREAMS`] places for a live stream; anonymous viewers may hold at most
/// half of them, so they cannot lock signed-in users out.
fn stream_permit(st: &AppState, v: &Viewer) -> Option<tokio::sync::OwnedSemaphorePermit> {
    if !v.signed_in() && st.live_streams.available_permits() <= MAX_LIVE_STREAMS / 2 {
        return None;
    }
    st.live_streams.clone().try_acquire_owned().ok()
}

fn too_many_streams(v: &Viewer) -> Response {
    let mut r = page_error(
        StatusCode::SERVICE_UNAVAILABLE,
        v,
        "Busy",
        "too many live pages are open; this page works without live updates (reload it)",
    );
    r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("30"));
    r
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
struct AuditPageQuery {
    since: Option<String>,
    action: Option<String>,
    actor: Option<String>,
}

/// The audit log: the admin's alone (it names every token and who used it); the read-only
/// token and anonymous visitors never see it.
async fn audit_page(State(st): State<AppState>, headers: HeaderMap, Query(q): Query<AuditPageQuery>) -> Response {
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
    let query = crate::audit::AuditQuery {
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
        Ok(f) => crate::audit::recent(&st, &f).await,
        Err(e) => Err(e),
    };
    match entries {
        Ok(e) => html(gpuci_web::audit(&e, &filters, &v)),
        Err(e) => api_error(&v, e),
    }
}

// ---- changes --------------------------------------------------------------------------------

/// A change from a page: checked (admin, form token), asked of the brain, then back to the
/// page `done` names for its answer.
async fn change<T>(
    st: &AppState,
    headers: &HeaderMap,
    csrf: &str,
    (action, object): (AuditAction, String),
    make: impl FnOnce(crate::brain::Reply<T>) -> Command,
    done: impl FnOnce(T) -> String,
) -> Response {
    let v = match may_change(st, headers, csrf) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let answer = ask(st, make).await;
    // On the record before the page says it is done (only the admin token signs in to change).
    let actor = crate::audit::Actor::dashboard(&st.api_token);
    if let Err(e) = crate::audit::record(st, &actor, action, object, &answer).await {
        return api_error(&v, e);
    }
    match answer {
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
    let audit = (AuditAction::JobCancel, format!("job {id}"));
    change(
        &st,
        &headers,
        &f.csrf,
        audit,
        |reply| Command::Cancel { job: id, reason, reply },
        |_| format!("/ui/jobs/{id}"),
    )
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
    let audit = (AuditAction::JobRetry, format!("job {id}"));
    change(
        &st,
        &headers,
        &f.csrf,
        audit,
        |reply| Command::Retry { job: id, by, reply },
        |j| format!("/ui/jobs/{}", j.id),
    )
    .await
}

async fn release(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(uuid): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let audit = (AuditAction::GpuRelease, format!("GPU {uuid}"));
    change(&st, &headers, &f.csrf, audit, |reply| Command::ReleaseGpu { uuid, reply }, |_| "/ui/fleet".to_string())
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 27): public repositories were compared as `owner/name`, read by a
    /// parser that dropped everything up to the last `@`: a look-alike remote passed for the
    /// public GitHub repository. Now the whole identity, host included, must match.
    #[test]
    fn only_the_listed_repository_with_its_host_can_be_public() {
        let public = [gpuci_core::repo::RepoId::parse("acme/open", "github.com").unwrap()];
        let is_public =
            |r: &str| crate::repos::public_identity(Some(r), None, "github.com").is_some_and(|id| public.contains(&id));
        for (remote, want) in [
            ("https://github.com/acme/open.git", true),
            ("https://GitHub.com/Acme/Open", true),
            ("git@github.com:acme/open.git", true),
            ("ssh://git@github.com:22/acme/open.git", true),
            ("github.com/acme/open", true),
            ("https://other.host/team/x@github.com/acme/open.git", false),
            ("https://github.com@other.host/acme/open.git", false),
            ("https://a@b@github.com/acme/open.git", false),
            ("https://git.internal.example/secret-team/acme/open.git", false),
            ("https://github.com.evil.example/acme/open.git", false),
            ("https://github.com/acme/open/extra", false),
            ("git@gitlab.com:acme/open.git", false),
            ("https://gitlab.com/acme/open.git", false),
            ("/home/me/acme/open", false),
            ("acme/open", false),
            ("https://github.com/acme/..", false),
        ] {
            assert_eq!(is_public(remote), want, "{remote}");
        }
    }

    #[test]
    fn gpu_uuids_are_scrubbed_from_what_anonymous_viewers_read() {
        assert_eq!(
            scrub_uuids("GPU GPU-6486fdaf-51ba-654f-8a00-d6041b960d5f failed; MIG-1a2b3c4d-0000/1/2 too; GPU-x stays"),
            "GPU a GPU failed; a GPU too; GPU-x stays"
        );
    }

    #[test]
    fn next_is_only_a_dashboard_path() {
        assert_eq!(safe_next(Some("/ui/jobs/3")), "/ui/jobs/3");
        for bad in ["https://evil.example/", "//evil.example/ui/", "/ui/\\evil", "/api/v1/jobs", "/ui/x?u=https://e"] {
            assert_eq!(safe_next(Some(bad)), "/ui/", "{bad}");
        }
    }
}
