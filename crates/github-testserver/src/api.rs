//! The HTTP side: one fallback handler that records and validates every API request, routes it to an
//! operation, validates the answer and sends it. `/_test/...` paths (the fake runner's protocol and
//! the archive download) are not GitHub API and skip validation and recording.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State as AxState};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::Response;
use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::hooks::{self, lock, Outgoing};
use crate::spec::{percent_decode, Spec, Template};
use crate::state::{self, now, ts, Job, Runner, Scope, State};
use crate::Recorded;

// The operations by API area, who may call them and injected faults each have a module; this one
// routes, validates and answers.
mod auth;
mod checks;
mod faults;
mod repos;
mod runner_protocol;
mod runners;
mod runs;
use auth::{bearer, check_app_jwt, check_org_access, check_repo_access};
use checks::{create_check_run, create_status, update_check_run};
use faults::{fault_reply, rate_limit_headers, take_fault};
use repos::{collaborator_permission, contents, remove_label};
use runner_protocol::test_route;
use runners::{access_token, delete_runner, generate_jitconfig, list_runners};
use runs::{cancel_run, list_runs};

const DOCS: &str = "https://docs.github.com/rest";

pub(crate) struct Inner {
    pub state: Arc<Mutex<State>>,
    pub spec: Option<Spec>,
    pub app_id: u64,
    pub app_key: Option<DecodingKey>,
    pub personal_token: Option<String>,
    pub hooks: hooks::Sender,
    pub base_url: String,
}

impl Inner {
    /// Queues a `workflow_job` delivery; called with the state lock held, never waits.
    fn job_webhook(&self, st: &mut State, job_id: u64, action: &str) {
        let Some(job) = st.jobs.get(&job_id) else { return };
        let job = clone_job(job);
        let payload = hooks::workflow_job_payload(st, &job, action);
        let (delivery, body) = hooks::record(st, "workflow_job", &payload);
        let _ =
            self.hooks.send(Outgoing { event: "workflow_job".into(), delivery, body, signature: None, reply: None });
    }
}

fn clone_job(j: &Job) -> Job {
    Job {
        id: j.id,
        run_id: j.run_id,
        repo: j.repo.clone(),
        name: j.name.clone(),
        labels: j.labels.clone(),
        script: j.script.clone(),
        status: j.status.clone(),
        conclusion: j.conclusion.clone(),
        runner_id: j.runner_id,
        runner_name: j.runner_name.clone(),
        runner_group_id: j.runner_group_id,
        created_at: j.created_at,
        started_at: j.started_at,
        completed_at: j.completed_at,
    }
}

/// What an operation answers.
struct Reply {
    status: u16,
    body: Option<Value>,
    headers: Vec<(String, String)>,
}

impl Reply {
    fn json(status: u16, body: Value) -> Self {
        Self { status, body: Some(body), headers: Vec::new() }
    }
    fn empty(status: u16) -> Self {
        Self { status, body: None, headers: Vec::new() }
    }
    fn error(status: u16, message: &str) -> Self {
        Self::json(status, json!({ "message": message, "documentation_url": DOCS, "status": status.to_string() }))
    }
    fn not_found() -> Self {
        Self::error(404, "Not Found")
    }
    fn bad_credentials() -> Self {
        Self::error(401, "Bad credentials")
    }
    /// GitHub's `validation-error-simple` shape (422).
    fn unprocessable(message: &str) -> Self {
        Self::json(422, json!({ "message": message, "documentation_url": DOCS }))
    }
}

#[derive(Clone, Copy)]
enum Op {
    AccessToken,
    ListInstallations,
    RepoInstallation,
    JitRepo,
    JitOrg,
    RunnersRepo,
    RunnersOrg,
    DeleteRunnerRepo,
    DeleteRunnerOrg,
    CancelRun,
    ListRuns,
    ListJobs,
    GetJob,
    CreateCheckRun,
    UpdateCheckRun,
    CreateStatus,
    RemoveLabel,
    CollaboratorPermission,
    Contents,
    Tarball,
    RunnerGroups,
}

fn routes() -> &'static [(Method, Template, Op)] {
    static ROUTES: OnceLock<Vec<(Method, Template, Op)>> = OnceLock::new();
    ROUTES.get_or_init(|| {
        let multi = ["path", "ref", "sha"];
        let r = |m: Method, t: &str, op: Op| (m, Template::new(t, &multi), op);
        vec![
            r(Method::POST, "/app/installations/{installation_id}/access_tokens", Op::AccessToken),
            r(Method::GET, "/app/installations", Op::ListInstallations),
            r(Method::GET, "/repos/{owner}/{repo}/installation", Op::RepoInstallation),
            r(Method::POST, "/repos/{owner}/{repo}/actions/runners/generate-jitconfig", Op::JitRepo),
            r(Method::POST, "/orgs/{org}/actions/runners/generate-jitconfig", Op::JitOrg),
            r(Method::GET, "/repos/{owner}/{repo}/actions/runners", Op::RunnersRepo),
            r(Method::GET, "/orgs/{org}/actions/runners", Op::RunnersOrg),
            r(Method::DELETE, "/repos/{owner}/{repo}/actions/runners/{runner_id}", Op::DeleteRunnerRepo),
            r(Method::DELETE, "/orgs/{org}/actions/runners/{runner_id}", Op::DeleteRunnerOrg),
            r(Method::POST, "/repos/{owner}/{repo}/actions/runs/{run_id}/cancel", Op::CancelRun),
            r(Method::GET, "/repos/{owner}/{repo}/actions/runs", Op::ListRuns),
            r(Method::GET, "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs", Op::ListJobs),
            r(Method::GET, "/repos/{owner}/{repo}/actions/jobs/{job_id}", Op::GetJob),
            r(Method::POST, "/repos/{owner}/{repo}/check-runs", Op::CreateCheckRun),
            r(Method::PATCH, "/repos/{owner}/{repo}/check-runs/{check_run_id}", Op::UpdateCheckRun),
            r(Method::POST, "/repos/{owner}/{repo}/statuses/{sha}", Op::CreateStatus),
            r(Method::DELETE, "/repos/{owner}/{repo}/issues/{issue_number}/labels/{name}", Op::RemoveLabel),
            r(Method::GET, "/repos/{owner}/{repo}/collaborators/{username}/permission", Op::CollaboratorPermission),
            r(Method::GET, "/repos/{owner}/{repo}/contents/{path}", Op::Contents),
            r(Method::GET, "/repos/{owner}/{repo}/tarball/{ref}", Op::Tarball),
            r(Method::GET, "/orgs/{org}/actions/runner-groups", Op::RunnerGroups),
        ]
    })
}

/// Everything an operation needs to know about its request.
struct Ctx<'a> {
    params: HashMap<String, String>,
    query: &'a [(String, String)],
    headers: &'a HeaderMap,
    body: Value,
    raw_path: &'a str,
    raw_query: &'a str,
    base: &'a str,
}

impl Ctx<'_> {
    fn p(&self, name: &str) -> &str {
        self.params.get(name).map(String::as_str).unwrap_or_default()
    }
    fn p_u64(&self, name: &str) -> Option<u64> {
        self.p(name).parse().ok()
    }
    fn q(&self, name: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
    fn repo(&self) -> String {
        format!("{}/{}", self.p("owner"), self.p("repo"))
    }
}

pub(crate) async fn handle(AxState(inner): AxState<Arc<Inner>>, req: Request) -> Response {
    let method = req.method().clone();
    let uri = req.uri().clone();
    let headers = req.headers().clone();
    let body = axum::body::to_bytes(req.into_body(), 64 << 20).await.unwrap_or_default();
    let path = uri.path().to_owned();
    let raw_query = uri.query().unwrap_or_default().to_owned();
    let query: Vec<(String, String)> = raw_query
        .split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(&k.replace('+', " ")), percent_decode(&v.replace('+', " ")))
        })
        .collect();

    if let Some(rest) = path.strip_prefix("/_test/") {
        return test_route(&inner, &method, rest, &query).await;
    }

    let mut problems = Vec::new();
    let op_ref = inner.spec.as_ref().map(|spec| {
        let (op, errs) = spec.check_request(method.as_str(), &path, &query, &body);
        problems.extend(errs);
        op
    });
    if !headers.contains_key("user-agent") {
        problems.push(format!("{method} {path}: no User-Agent header (GitHub answers such requests with 403)"));
    }

    let body_json: Value = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()))
    };
    let routed =
        routes().iter().filter(|(m, _, _)| *m == method).find_map(|(_, t, op)| t.matches(&path).map(|p| (p, *op)));
    let fault = take_fault(&inner, method.as_str(), &format!("{path}?{raw_query}"));
    let reply = match (&fault, routed) {
        (Some(fault), _) => fault_reply(fault),
        (None, None) => Reply::not_found(),
        (None, Some((params, op))) => {
            let ctx = Ctx {
                params,
                query: &query,
                headers: &headers,
                body: body_json.clone(),
                raw_path: &path,
                raw_query: &raw_query,
                base: &inner.base_url,
            };
            dispatch(&inner, op, &ctx)
        }
    };

    if let (Some(spec), Some(Some(op))) = (inner.spec.as_ref(), op_ref.as_ref()) {
        problems.extend(spec.check_response(op, reply.status, reply.body.as_ref()));
    }
    let mut reply = reply;
    {
        let mut st = lock(&inner.state);
        rate_limit_headers(inner.personal_token.as_deref(), &mut st, &headers, fault.as_ref(), &mut reply);
        st.validation_errors.extend(problems);
        st.requests.push(Recorded {
            method: method.to_string(),
            path: path.clone(),
            query: raw_query.clone(),
            body: body_json,
            status: reply.status,
            at: std::time::SystemTime::now(),
            instant: tokio::time::Instant::now(),
        });
    }
    into_response(reply)
}

fn into_response(reply: Reply) -> Response {
    let mut b =
        Response::builder().status(StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR));
    for (k, v) in &reply.headers {
        b = b.header(k, v);
    }
    let body = match reply.body {
        Some(v) => {
            b = b.header("content-type", "application/json; charset=utf-8");
            Body::from(serde_json::to_vec(&v).unwrap_or_default())
        }
        None => Body::empty(),
    };
    b.header("x-github-api-version-selected", "2022-11-28").body(body).unwrap_or_else(|_| Response::new(Body::empty()))
}

fn dispatch(inner: &Inner, op: Op, ctx: &Ctx<'_>) -> Reply {
    let mut guard = lock(&inner.state);
    let st = &mut *guard;
    let auth = match op {
        Op::AccessToken | Op::ListInstallations | Op::RepoInstallation => check_app_jwt(inner, ctx.headers),
        Op::JitOrg | Op::RunnersOrg | Op::DeleteRunnerOrg | Op::RunnerGroups => {
            check_org_access(inner, st, ctx.headers, ctx.p("org"))
        }
        _ => check_repo_access(inner, st, ctx.headers, &ctx.repo()),
    };
    if let Err(reply) = auth {
        return reply;
    }
    match op {
        Op::AccessToken => access_token(st, ctx),
        Op::ListInstallations => {
            let all: Vec<Value> =
                st.installation_ids().into_iter().map(|id| st.installation_json(id, inner.app_id)).collect();
            let (page, link) = paginate(all, ctx);
            with_link(Reply::json(200, Value::Array(page)), link)
        }
        Op::RepoInstallation => match st.repo(&ctx.repo()).map(|r| r.installation_id) {
            Some(id) => Reply::json(200, st.installation_json(id, inner.app_id)),
            None => Reply::not_found(),
        },
        Op::JitRepo => generate_jitconfig(st, ctx, Scope::Repo(ctx.repo())),
        Op::JitOrg => generate_jitconfig(st, ctx, Scope::Org(ctx.p("org").to_owned())),
        Op::RunnersRepo => list_runners(st, ctx, &Scope::Repo(ctx.repo())),
        Op::RunnersOrg => list_runners(st, ctx, &Scope::Org(ctx.p("org").to_owned())),
        Op::DeleteRunnerRepo => delete_runner(st, ctx, &Scope::Repo(ctx.repo())),
        Op::DeleteRunnerOrg => delete_runner(st, ctx, &Scope::Org(ctx.p("org").to_owned())),
        Op::CancelRun => cancel_run(inner, st, ctx),
        Op::ListRuns => list_runs(st, ctx),
        Op::ListJobs => {
            let repo = ctx.repo();
            let Some(run_id) =
                ctx.p_u64("run_id").filter(|id| st.runs.get(id).is_some_and(|r| r.repo.eq_ignore_ascii_case(&repo)))
            else {
                return Reply::not_found();
            };
            let jobs: Vec<Value> = st.jobs.values().filter(|j| j.run_id == run_id).map(|j| st.job_json(j)).collect();
            let total = jobs.len();
            let (page, link) = paginate(jobs, ctx);
            with_link(Reply::json(200, json!({ "total_count": total, "jobs": page })), link)
        }
        Op::GetJob => {
            let repo = ctx.repo();
            match ctx.p_u64("job_id").and_then(|id| st.jobs.get(&id)).filter(|j| j.repo.eq_ignore_ascii_case(&repo)) {
                Some(j) => Reply::json(200, st.job_json(j)),
                None => Reply::not_found(),
            }
        }
        Op::CreateCheckRun => create_check_run(st, ctx),
        Op::UpdateCheckRun => update_check_run(st, ctx),
        Op::CreateStatus => create_status(st, ctx),
        Op::RemoveLabel => remove_label(st, ctx),
        Op::CollaboratorPermission => collaborator_permission(st, ctx),
        Op::Contents => contents(st, ctx),
        Op::Tarball => {
            let repo = ctx.repo();
            let Some(r) = st.repo(&repo) else { return Reply::not_found() };
            let Some(sha) = r.resolve_ref(ctx.p("ref")) else { return Reply::not_found() };
            let location = format!("{}/_test/codeload/{}/{}/{sha}", st.base_url, r.owner, r.name);
            Reply { status: 302, body: None, headers: vec![("location".into(), location)] }
        }
        Op::RunnerGroups => {
            let org = ctx.p("org");
            let group = json!({
                "id": 1, "name": "Default", "visibility": "all", "default": true,
                "runners_url": format!("{}/orgs/{org}/actions/runner-groups/1/runners", st.base_url),
                "inherited": false, "allows_public_repositories": true,
            });
            Reply::json(200, json!({ "total_count": 1, "runner_groups": [group] }))
        }
    }
}

/// GitHub's pagination: `per_page` (default 30, at most 100) and `page` (from 1), with a `Link` header.
fn paginate<T>(items: Vec<T>, ctx: &Ctx<'_>) -> (Vec<T>, Option<String>) {
    let per_page = ctx.q("per_page").and_then(|v| v.parse::<usize>().ok()).unwrap_or(30).clamp(1, 100);
    let page = ctx.q("page").and_then(|v| v.parse::<usize>().ok()).unwrap_or(1).max(1);
    let total = items.len();
    let last = total.div_ceil(per_page).max(1);
    let page_items: Vec<T> = items.into_iter().skip((page - 1) * per_page).take(per_page).collect();
    if last <= 1 {
        return (page_items, None);
    }
    let url_for = |n: usize| {
        let mut pairs: Vec<String> = ctx
            .raw_query
            .split('&')
            .filter(|kv| !kv.is_empty() && !kv.starts_with("page=") && !kv.starts_with("per_page="))
            .map(str::to_owned)
            .collect();
        pairs.push(format!("per_page={per_page}"));
        pairs.push(format!("page={n}"));
        format!("<{}{}?{}>", ctx.base, ctx.raw_path, pairs.join("&"))
    };
    let mut links = Vec::new();
    if page > 1 {
        links.push(format!("{}; rel=\"prev\"", url_for(page - 1)));
    }
    if page < last {
        links.push(format!("{}; rel=\"next\"", url_for(page + 1)));
        links.push(format!("{}; rel=\"last\"", url_for(last)));
    }
    if page > 1 {
        links.push(format!("{}; rel=\"first\"", url_for(1)));
    }
    (page_items, (!links.is_empty()).then(|| links.join(", ")))
}

fn with_link(mut reply: Reply, link: Option<String>) -> Reply {
    if let Some(link) = link {
        reply.headers.push(("link".into(), link));
    }
    reply
}
