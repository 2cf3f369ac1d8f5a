//! The web dashboard: who is looking (a session cookie from signing in with the API token or
//! the read-only token, or nobody), what they may see (signed in: everything; nobody: the
//! public repositories' jobs and logs), the data each page needs, and live updates as
//! server-sent events. Pages are rendered by `gpuci_web`; changes go through the brain as the
//! API's do. Every change a page makes is a POST that carries the session's form token.
//!
//! This file holds who is looking, sign-in, the shared data (origins, rows, scrubbing) and
//! live streams; each page's handlers live in their own file: `builds` (the landing page and
//! the jobs list), `pipeline` (graph, retry failed, cancel all), `job` (page, live stream, and
//! the raw log's read rules), `fleet` (queue, fleet, spend, audit). It must not decide what a
//! pipeline's summary or a retry is: those are `gpuci_core::builds` and `gpuci_core::rerun`.

use crate::api::{agent_names, summarize};
use crate::brain::{now_ms, Command};
use crate::error::ApiError;
use crate::hub::Event;
use crate::origin::Origin as PipelineOrigin;
use crate::state::AppState;
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

mod builds;
mod fleet;
mod job;
mod pipeline;
mod schedules;
use builds::*;
use fleet::*;
pub(crate) use job::log_access;
use job::*;
use pipeline::*;

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

/// The largest dashboard form read.
const FORM_BYTES: usize = 16 * 1024;

/// A request that says it carries more than a form is answered 413 before its body is read.
async fn form_sized(req: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use axum::response::IntoResponse;
    let declared =
        req.headers().get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > FORM_BYTES as u64) {
        return (axum::http::StatusCode::PAYLOAD_TOO_LARGE, format!("a dashboard form is at most {FORM_BYTES} bytes"))
            .into_response();
    }
    next.run(req).await
}

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/ui/") }))
        .route("/ui", get(|| async { Redirect::to("/ui/") }))
        .route("/ui/", get(builds_page))
        .route("/ui/jobs", get(jobs_page))
        .route("/ui/login", get(login_page).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/jobs/{id}", get(job_page))
        .route("/ui/jobs/{id}/events", get(job_events))
        .route("/ui/jobs/{id}/cancel", post(cancel))
        .route("/ui/jobs/{id}/retry", post(retry))
        .route("/ui/pipelines/{id}", get(pipeline_page))
        .route("/ui/pipelines/{id}/retry-failed", post(retry_failed))
        .route("/ui/pipelines/{id}/cancel", post(cancel_all))
        .route("/ui/queue", get(queue_page))
        .route("/ui/fleet", get(fleet_page))
        .route("/ui/spend", get(spend_page))
        .route("/ui/audit", get(audit_page))
        .route("/ui/schedules", get(schedules::schedules_page))
        .route("/ui/schedules/{name}/run", post(schedules::run_now))
        .route("/ui/gpus/{uuid}/release", post(release))
        .route("/ui/events", get(list_events))
        .route(gpuci_web::CSS_PATH, get(|| async { asset("text/css; charset=utf-8", gpuci_web::CSS) }))
        .route(gpuci_web::JS_PATH, get(|| async { asset("text/javascript; charset=utf-8", gpuci_web::JS) }))
        // The dashboard's forms are a few fields; a login form is open to anyone, and a body
        // of the default 2 MB sent at the 1 KiB/s floor held a connection half an hour
        // (outsider attack: 450 of them emptied a leader's file table, `serve.rs`).
        .layer(axum::extract::DefaultBodyLimit::max(FORM_BYTES))
        .layer(axum::middleware::from_fn(form_sized))
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
// An axum response is the error a handler answers with, as is; boxing it buys nothing.
#[allow(clippy::result_large_err)]
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
    let summaries = summarize(jobs, &agent_names(st.store.as_ref(), jobs).await);
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
    let answer = st.ask(make).await;
    // On the record before the page says it is done (only the admin token signs in to change).
    let actor = crate::api::audit::Actor::dashboard(&st.api_token);
    if let Err(e) = crate::api::audit::record(st, &actor, action, object, &answer).await {
        return api_error(&v, e);
    }
    match answer {
        Ok(t) => Redirect::to(&done(t)).into_response(),
        Err(e) => api_error(&v, e.into()),
    }
}

/// A job id from the path; a bad one answers 400 (before anything else is checked).
// An axum response is the error a handler answers with, as is; boxing it buys nothing.
#[allow(clippy::result_large_err)]
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
