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

/// The first injected fault for this request, used up by one.
fn take_fault(inner: &Inner, method: &str, path_and_query: &str) -> Option<crate::Fault> {
    let mut st = lock(&inner.state);
    let i = st.faults.iter().position(|f| f.matches(method, path_and_query))?;
    let fault = st.faults[i].clone();
    match &mut st.faults[i].times {
        Some(1) => {
            st.faults.remove(i);
        }
        Some(n) => *n -= 1,
        None => {}
    }
    Some(fault)
}

/// What GitHub answers in the situation a fault stands for.
fn fault_reply(fault: &crate::Fault) -> Reply {
    use crate::FaultKind;
    match fault.kind {
        FaultKind::Status(status) => Reply::error(
            status,
            match status {
                401 => "Bad credentials",
                502 => "Bad Gateway",
                _ => "Server Error",
            },
        ),
        FaultKind::SecondaryRateLimit { retry_after } => {
            let mut r = Reply::error(
                403,
                "You have exceeded a secondary rate limit. Please wait a few minutes before you try again.",
            );
            r.headers.push(("retry-after".into(), retry_after.to_string()));
            r
        }
        FaultKind::SecondaryRateLimitNoHint => Reply::error(
            403,
            "You have exceeded a secondary rate limit. Please wait a few minutes before you try again.",
        ),
        FaultKind::TooManyRequests { retry_after } => {
            let mut r = Reply::error(429, "Too many requests");
            r.headers.push(("retry-after".into(), retry_after.to_string()));
            r
        }
        // The rate-limit headers (remaining 0, the reset) are added with everyone's.
        FaultKind::RateLimitExhausted { .. } => Reply::error(403, "API rate limit exceeded."),
    }
}

/// GitHub's `x-ratelimit-*` headers, counted per credential per hour, on every API answer whose
/// credential the server knows.
fn rate_limit_headers(
    personal_token: Option<&str>,
    st: &mut State,
    headers: &HeaderMap,
    fault: Option<&crate::Fault>,
    reply: &mut Reply,
) {
    let Some(token) = bearer(headers) else { return };
    let credential = if personal_token == Some(token.as_str()) {
        "token".to_owned()
    } else if let Some(t) = st.tokens.get(&token) {
        format!("installation {}", t.installation_id)
    } else if token.matches('.').count() == 2 {
        "app".to_owned()
    } else {
        return;
    };
    let now = now().unix_timestamp();
    let window = st.rate_windows.entry(credential).or_insert(state::RateWindow { reset: now + 3600, used: 0 });
    if window.reset <= now {
        *window = state::RateWindow { reset: now + 3600, used: 0 };
    }
    window.used += 1;
    let (mut remaining, mut reset) = (state::RATE_LIMIT.saturating_sub(window.used), window.reset);
    if let Some(crate::FaultKind::RateLimitExhausted { reset_in }) = fault.map(|f| &f.kind) {
        (remaining, reset) = (0, now + *reset_in as i64);
    }
    let used = state::RATE_LIMIT - remaining;
    for (k, v) in [
        ("x-ratelimit-limit", state::RATE_LIMIT.to_string()),
        ("x-ratelimit-remaining", remaining.to_string()),
        ("x-ratelimit-used", used.to_string()),
        ("x-ratelimit-reset", reset.to_string()),
        ("x-ratelimit-resource", "core".to_owned()),
    ] {
        reply.headers.push((k.into(), v));
    }
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

fn bearer(headers: &HeaderMap) -> Option<String> {
    let value = headers.get("authorization")?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") || scheme.eq_ignore_ascii_case("token")).then(|| token.trim().to_owned())
}

#[derive(Deserialize)]
struct Claims {
    iat: i64,
    exp: i64,
    iss: Value,
}

/// Checks an App JWT the way GitHub does: RS256, `iss` = app id, expiring at most 10 minutes out.
fn check_app_jwt(inner: &Inner, headers: &HeaderMap) -> Result<(), Reply> {
    let token = bearer(headers).ok_or_else(|| Reply::error(401, "Requires authentication"))?;
    let header =
        jsonwebtoken::decode_header(&token).map_err(|_| Reply::error(401, "A JSON web token could not be decoded"))?;
    if header.alg != Algorithm::RS256 {
        return Err(Reply::error(401, "A JSON web token could not be decoded"));
    }
    let claims: Claims = match &inner.app_key {
        Some(key) => {
            let mut v = Validation::new(Algorithm::RS256);
            v.set_required_spec_claims(&["exp", "iat", "iss"]);
            v.leeway = 30;
            jsonwebtoken::decode::<Claims>(&token, key, &v)
                .map_err(|e| Reply::error(401, &format!("A JSON web token could not be decoded ({e})")))?
                .claims
        }
        None => {
            jsonwebtoken::dangerous::insecure_decode::<Claims>(&token)
                .map_err(|_| Reply::error(401, "A JSON web token could not be decoded"))?
                .claims
        }
    };
    let iss_ok = match &claims.iss {
        Value::String(s) => s == &inner.app_id.to_string(),
        Value::Number(n) => n.as_u64() == Some(inner.app_id),
        _ => false,
    };
    if !iss_ok {
        return Err(Reply::error(401, "'Issuer' claim ('iss') must be an Integer"));
    }
    let now = now().unix_timestamp();
    if claims.exp <= now {
        return Err(Reply::error(401, "'Expiration time' claim ('exp') must be a numeric value representing the future time at which the assertion expires"));
    }
    if claims.exp - now > 600 + 30 || claims.exp - claims.iat > 600 + 30 {
        return Err(Reply::error(401, "'Expiration time' claim ('exp') is too far in the future"));
    }
    if claims.iat > now + 60 {
        return Err(Reply::error(
            401,
            "'Issued at' claim ('iat') must be an Integer representing the time that the assertion was issued",
        ));
    }
    Ok(())
}

/// The installation a token was issued for (`None` for the personal token), or 401.
fn check_token(inner: &Inner, st: &State, headers: &HeaderMap) -> Result<Option<u64>, Reply> {
    let token = bearer(headers).ok_or_else(|| Reply::error(401, "Requires authentication"))?;
    if inner.personal_token.as_deref() == Some(token.as_str()) {
        return Ok(None);
    }
    match st.tokens.get(&token) {
        Some(t) if t.expires_at > now() => Ok(Some(t.installation_id)),
        _ => Err(Reply::bad_credentials()),
    }
}

fn check_repo_access(inner: &Inner, st: &State, headers: &HeaderMap, repo: &str) -> Result<(), Reply> {
    let installation = check_token(inner, st, headers)?;
    let Some(r) = st.repo(repo) else { return Err(Reply::not_found()) };
    match installation {
        None => Ok(()),
        Some(id) if id == r.installation_id => Ok(()),
        Some(_) => Err(Reply::bad_credentials()),
    }
}

fn check_org_access(inner: &Inner, st: &State, headers: &HeaderMap, org: &str) -> Result<(), Reply> {
    let installation = check_token(inner, st, headers)?;
    if !st.repos.values().any(|r| r.owner.eq_ignore_ascii_case(org)) {
        return Err(Reply::not_found());
    }
    match installation {
        None => Ok(()),
        Some(id) if st.installation_account(id).is_some_and(|a| a.eq_ignore_ascii_case(org)) => Ok(()),
        Some(_) => Err(Reply::bad_credentials()),
    }
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

fn access_token(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let Some(id) = ctx.p_u64("installation_id").filter(|id| st.installation_ids().contains(id)) else {
        return Reply::not_found();
    };
    st.ids.token += 1;
    let token = format!("ghs_test_{}", st.ids.token);
    let expires_at = now() + time::Duration::hours(1);
    st.tokens.insert(token.clone(), state::Token { installation_id: id, expires_at });
    Reply::json(
        201,
        json!({
            "token": token,
            "expires_at": ts(expires_at),
            "permissions": { "actions": "write", "administration": "write", "checks": "write",
                "contents": "read", "issues": "write", "metadata": "read", "statuses": "write" },
            "repository_selection": "selected",
        }),
    )
}

fn generate_jitconfig(st: &mut State, ctx: &Ctx<'_>, scope: Scope) -> Reply {
    let name = ctx.body.get("name").and_then(Value::as_str).unwrap_or_default().to_owned();
    let group = ctx.body.get("runner_group_id").and_then(Value::as_u64);
    let labels: Vec<String> = ctx
        .body
        .get("labels")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default();
    let Some(group) = group.filter(|_| !name.is_empty() && !labels.is_empty() && labels.len() <= 100) else {
        return Reply::unprocessable("Invalid request: name, runner_group_id and 1 to 100 labels are required.");
    };
    if st.runners.iter().any(|r| !r.deleted && r.scope == scope && r.name.eq_ignore_ascii_case(&name)) {
        return Reply::error(409, &format!("Already exists - A runner with the name {name} already exists."));
    }
    st.ids.runner += 1;
    let runner = Runner {
        id: st.ids.runner,
        name,
        labels,
        runner_group_id: group,
        scope,
        deleted: false,
        jobs_taken: 0,
        online: false,
        current_job: None,
        first_acquire_at: None,
    };
    let config = base64::engine::general_purpose::STANDARD.encode(format!("{} {}", st.base_url, runner.id));
    let body = json!({ "runner": st.runner_json(&runner), "encoded_jit_config": config });
    st.runners.push(runner);
    Reply::json(201, body)
}

fn list_runners(st: &State, ctx: &Ctx<'_>, scope: &Scope) -> Reply {
    let name = ctx.q("name");
    let runners: Vec<Value> = st
        .runners
        .iter()
        .filter(|r| !r.deleted && &r.scope == scope)
        .filter(|r| name.is_none_or(|n| r.name == n))
        .map(|r| st.runner_json(r))
        .collect();
    let total = runners.len();
    let (page, link) = paginate(runners, ctx);
    with_link(Reply::json(200, json!({ "total_count": total, "runners": page })), link)
}

fn delete_runner(st: &mut State, ctx: &Ctx<'_>, scope: &Scope) -> Reply {
    let id = ctx.p_u64("runner_id");
    let Some(r) = st.runners.iter_mut().find(|r| Some(r.id) == id && !r.deleted && &r.scope == scope) else {
        return Reply::not_found();
    };
    if r.current_job.is_some() {
        return Reply::unprocessable(&format!("Bad request - Runner \"{}\" is still running a job\"", r.name));
    }
    r.deleted = true;
    Reply::empty(204)
}

fn cancel_run(inner: &Inner, st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let Some(run_id) =
        ctx.p_u64("run_id").filter(|id| st.runs.get(id).is_some_and(|r| r.repo.eq_ignore_ascii_case(&repo)))
    else {
        return Reply::not_found();
    };
    if st.run_status(run_id).0 == "completed" {
        return Reply::error(409, "Cannot cancel a workflow run that is completed.");
    }
    let t = now();
    if let Some(run) = st.runs.get_mut(&run_id) {
        run.cancelled = true;
        run.updated_at = t;
    }
    let ids: Vec<u64> =
        st.jobs.values().filter(|j| j.run_id == run_id && j.status != "completed").map(|j| j.id).collect();
    for id in ids {
        if let Some(j) = st.jobs.get_mut(&id) {
            j.status = "completed".into();
            j.conclusion = Some("cancelled".into());
            j.completed_at = Some(t);
        }
        inner.job_webhook(st, id, "completed");
    }
    Reply::json(202, json!({}))
}

fn list_runs(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let ids: Vec<u64> = st.runs.values().rev().filter(|r| r.repo.eq_ignore_ascii_case(&repo)).map(|r| r.id).collect();
    let mut selected = Vec::new();
    for id in ids {
        let (status, conclusion) = st.run_status(id);
        let Some(run) = st.runs.get(&id) else { continue };
        let keep = ctx.q("status").is_none_or(|s| s == status || conclusion.as_deref() == Some(s))
            && ctx.q("head_sha").is_none_or(|s| s == run.head_sha)
            && ctx.q("branch").is_none_or(|b| b == run.head_branch)
            && ctx.q("event").is_none_or(|e| e == run.event);
        if keep {
            selected.push(id);
        }
    }
    let total = selected.len();
    let (page, link) = paginate(selected, ctx);
    let runs: Vec<Value> = page.into_iter().map(|id| st.run_json(id)).collect();
    with_link(Reply::json(200, json!({ "total_count": total, "workflow_runs": runs })), link)
}

fn create_check_run(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let (Some(name), Some(head_sha)) =
        (ctx.body.get("name").and_then(Value::as_str), ctx.body.get("head_sha").and_then(Value::as_str))
    else {
        return Reply::unprocessable("Invalid request: name and head_sha are required.");
    };
    st.ids.check_run += 1;
    let id = st.ids.check_run;
    let repo = ctx.repo();
    let app_owner = st.user_json("gpuci-test-owner");
    let mut cr = json!({
        "id": id,
        "head_sha": head_sha,
        "node_id": format!("CR_test{id}"),
        "external_id": "",
        "url": format!("{}/repos/{repo}/check-runs/{id}", st.base_url),
        "html_url": format!("https://github.com/{repo}/runs/{id}"),
        "details_url": null,
        "status": "queued",
        "conclusion": null,
        "started_at": ts(now()),
        "completed_at": null,
        "output": { "title": null, "summary": null, "text": null, "annotations_count": 0,
            "annotations_url": format!("{}/repos/{repo}/check-runs/{id}/annotations", st.base_url) },
        "name": name,
        "check_suite": { "id": 4_000_000 + id },
        "app": {
            "id": 1, "slug": "gpuci-test", "node_id": "A_test1", "owner": app_owner, "name": "gpuci (test)",
            "description": null, "external_url": "https://example.com", "html_url": "https://github.com/apps/gpuci-test",
            "created_at": "2024-01-01T00:00:00Z", "updated_at": "2024-01-01T00:00:00Z",
            "permissions": { "checks": "write" }, "events": [],
        },
        "pull_requests": [],
    });
    apply_check_run_fields(&mut cr, &ctx.body);
    st.check_runs.insert(id, (repo, cr.clone()));
    Reply::json(201, cr)
}

fn update_check_run(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let Some((_, cr)) = ctx
        .p_u64("check_run_id")
        .and_then(|id| st.check_runs.get_mut(&id))
        .filter(|(r, _)| r.eq_ignore_ascii_case(&repo))
    else {
        return Reply::not_found();
    };
    apply_check_run_fields(cr, &ctx.body);
    Reply::json(200, cr.clone())
}

/// Copies a create/update body onto a check run as GitHub does: a conclusion completes the run.
fn apply_check_run_fields(cr: &mut Value, body: &Value) {
    for key in ["name", "details_url", "external_id", "status", "started_at", "completed_at", "conclusion"] {
        if let Some(v) = body.get(key) {
            cr[key] = v.clone();
        }
    }
    if let Some(out) = body.get("output") {
        for key in ["title", "summary", "text"] {
            if let Some(v) = out.get(key) {
                cr["output"][key] = v.clone();
            }
        }
        if let Some(a) = out.get("annotations").and_then(Value::as_array) {
            let n = cr["output"]["annotations_count"].as_u64().unwrap_or(0) + a.len() as u64;
            cr["output"]["annotations_count"] = json!(n);
        }
    }
    if body.get("conclusion").is_some_and(|c| !c.is_null()) {
        cr["status"] = json!("completed");
        if cr["completed_at"].is_null() {
            cr["completed_at"] = json!(ts(now()));
        }
    }
}

fn create_status(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let Some(state_value) = ctx.body.get("state").and_then(Value::as_str) else {
        return Reply::unprocessable("Invalid request: state is required.");
    };
    st.ids.status += 1;
    let id = st.ids.status;
    let repo = ctx.repo();
    let sha = ctx.p("sha").to_owned();
    let creator = st.user_json("gpuci-test[bot]");
    let t = ts(now());
    let status = json!({
        "url": format!("{}/repos/{repo}/statuses/{sha}", st.base_url),
        "avatar_url": null,
        "id": id,
        "node_id": format!("SC_test{id}"),
        "state": state_value,
        "description": ctx.body.get("description").cloned().unwrap_or(Value::Null),
        "target_url": ctx.body.get("target_url").cloned().unwrap_or(Value::Null),
        "context": ctx.body.get("context").and_then(Value::as_str).unwrap_or("default"),
        "created_at": t,
        "updated_at": t,
        "creator": creator,
    });
    st.statuses.push((repo, sha, status.clone()));
    let mut reply = Reply::json(201, status);
    reply.headers.push(("location".into(), format!("{}{}", st.base_url, ctx.raw_path)));
    reply
}

fn remove_label(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let number = ctx.p_u64("issue_number").unwrap_or(0);
    let name = ctx.p("name");
    let Some(pr) = st.repo_mut(&repo).and_then(|r| r.pulls.get_mut(&number)) else {
        return Reply::not_found();
    };
    let Some(pos) = pr.labels.iter().position(|l| l.eq_ignore_ascii_case(name)) else {
        return Reply::error(404, "Label does not exist");
    };
    pr.labels.remove(pos);
    let remaining = pr.labels.clone();
    let full = st.repo(&repo).map(|r| r.full_name()).unwrap_or(repo);
    let labels: Vec<Value> = remaining.iter().map(|l| st.label_json(&full, l)).collect();
    Reply::json(200, Value::Array(labels))
}

fn collaborator_permission(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let login = ctx.p("username").to_owned();
    let Some(role) = st
        .repo(&repo)
        .and_then(|r| r.collaborators.iter().find(|(k, _)| k.eq_ignore_ascii_case(&login)).map(|(_, v)| v.clone()))
    else {
        return Reply::error(404, &format!("{login} is not a collaborator"));
    };
    // GitHub's `permission` is the legacy four-level value: maintain reads as write, triage as read;
    // only `role_name` carries the full role.
    let legacy = match role.as_str() {
        "admin" => "admin",
        "maintain" | "write" => "write",
        "triage" | "read" => "read",
        _ => "none",
    };
    let rank = ["read", "triage", "write", "maintain", "admin"].iter().position(|r| *r == role).unwrap_or(0);
    let mut user = st.user_json(&login);
    user["permissions"] = json!({
        "pull": true, "triage": rank >= 1, "push": rank >= 2, "maintain": rank >= 3, "admin": rank >= 4,
    });
    user["role_name"] = json!(role);
    Reply::json(200, json!({ "permission": legacy, "role_name": role, "user": user }))
}

fn contents(st: &State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let Some(r) = st.repo(&repo) else { return Reply::not_found() };
    let sha = match ctx.q("ref") {
        Some(reference) => r.resolve_ref(reference),
        None => r.branches.get("main").cloned().or_else(|| r.tree_order.last().cloned()),
    };
    let Some(tree) = sha.as_ref().and_then(|s| r.trees.get(s)) else { return Reply::not_found() };
    let sha = sha.unwrap_or_default();
    let path = ctx.p("path").trim_matches('/').to_owned();
    let api = format!("{}/repos/{}", st.base_url, r.full_name());
    let item = |p: &str, kind: &str, size: usize| {
        let name = p.rsplit('/').next().unwrap_or(p);
        let blob = state::fake_sha(&format!("{sha}:{p}"));
        let self_url = format!("{api}/contents/{p}?ref={sha}");
        let html = format!("https://github.com/{}/blob/{sha}/{p}", r.full_name());
        let git = format!("{api}/git/blobs/{blob}");
        json!({
            "type": kind, "size": size, "name": name, "path": p, "sha": blob, "url": self_url,
            "git_url": git, "html_url": html,
            "download_url": if kind == "file" { json!(format!("https://raw.githubusercontent.com/{}/{sha}/{p}", r.full_name())) } else { Value::Null },
            "_links": { "self": self_url, "git": git, "html": html },
        })
    };
    if let Some(content) = tree.get(&path) {
        let mut v = item(&path, "file", content.len());
        v["encoding"] = json!("base64");
        v["content"] = json!(wrapped_base64(content.as_bytes()));
        return Reply::json(200, v);
    }
    let prefix = if path.is_empty() { String::new() } else { format!("{path}/") };
    let mut entries: BTreeMap<String, Value> = BTreeMap::new();
    for (p, content) in tree.iter().filter(|(p, _)| p.starts_with(&prefix)) {
        let rest = &p[prefix.len()..];
        match rest.split_once('/') {
            Some((dir, _)) => {
                let dir_path = format!("{prefix}{dir}");
                entries.entry(dir_path.clone()).or_insert_with(|| item(&dir_path, "dir", 0));
            }
            None => {
                entries.insert(p.clone(), item(p, "file", content.len()));
            }
        }
    }
    if entries.is_empty() {
        return Reply::not_found();
    }
    Reply::json(200, Value::Array(entries.into_values().collect()))
}

/// Base64 with a newline after every 60 characters, as the contents API sends it.
fn wrapped_base64(bytes: &[u8]) -> String {
    let flat = base64::engine::general_purpose::STANDARD.encode(bytes);
    let mut out = String::with_capacity(flat.len() + flat.len() / 60 + 1);
    for chunk in flat.as_bytes().chunks(60) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out
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

// ---- the fake runner's protocol and archive downloads (not GitHub API) ----------------------------

async fn test_route(inner: &Arc<Inner>, method: &Method, rest: &str, query: &[(String, String)]) -> Response {
    let parts: Vec<&str> = rest.split('/').collect();
    let q = |name: &str| query.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let text = |status: u16, body: String| {
        Response::builder()
            .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
            .header("content-type", "text/plain; charset=utf-8")
            .body(Body::from(body))
            .unwrap_or_else(|_| Response::new(Body::empty()))
    };
    match (method.as_str(), parts.as_slice()) {
        ("POST", ["runners", id, "acquire"]) => {
            let Ok(id) = id.parse::<u64>() else { return text(404, "no such runner\n".into()) };
            let (status, body) = acquire(inner, id).await;
            text(status, body)
        }
        ("POST", ["runners", id, "complete"]) => {
            let id = id.parse::<u64>().unwrap_or(0);
            let job = q("job").and_then(|j| j.parse::<u64>().ok()).unwrap_or(0);
            let exit = q("exit").and_then(|e| e.parse::<i32>().ok()).unwrap_or(1);
            let (status, body) = complete(inner, id, job, exit);
            text(status, body)
        }
        ("GET", ["jobs", id, "status"]) => {
            let st = lock(&inner.state);
            match id.parse::<u64>().ok().and_then(|id| st.jobs.get(&id)) {
                Some(j) => text(200, format!("{}\n", j.status)),
                None => text(404, "no such job\n".into()),
            }
        }
        ("GET", ["codeload", owner, repo, sha]) => {
            let files = {
                let st = lock(&inner.state);
                st.repo(&format!("{owner}/{repo}")).and_then(|r| r.trees.get(*sha).cloned())
            };
            let Some(files) = files else { return text(404, "Not Found\n".into()) };
            match crate::tarball::build(owner, repo, sha, &files) {
                Ok(bytes) => Response::builder()
                    .status(200)
                    .header("content-type", "application/x-gzip")
                    .header(
                        "content-disposition",
                        format!("attachment; filename={owner}-{repo}-{}.tar.gz", &sha[..7.min(sha.len())]),
                    )
                    .body(Body::from(bytes))
                    .unwrap_or_else(|_| Response::new(Body::empty())),
                Err(e) => text(500, format!("archive: {e}\n")),
            }
        }
        _ => text(404, "no such test endpoint\n".into()),
    }
}

/// How long an acquire request waits for a job before answering 204, like the runner's long poll.
const LONG_POLL: Duration = Duration::from_secs(2);

/// Hands runner `id` the oldest queued job it can run (200: `JOB_ID<TAB>RUN_ID<TAB>NAME\n` then the script),
/// 204 when none came within [`LONG_POLL`], 410 when the runner was deleted.
async fn acquire(inner: &Inner, id: u64) -> (u16, String) {
    let deadline = tokio::time::Instant::now() + LONG_POLL;
    loop {
        {
            let mut guard = lock(&inner.state);
            let st = &mut *guard;
            let Some(idx) = st.runners.iter().position(|r| r.id == id) else {
                return (404, "no such runner\n".into());
            };
            if st.runners[idx].deleted {
                return (410, "runner was deleted\n".into());
            }
            st.runners[idx].online = true;
            st.runners[idx].first_acquire_at.get_or_insert_with(std::time::SystemTime::now);
            if let Some(job_id) = st.runners[idx].current_job {
                // A retried acquire after a lost answer gets the same job again.
                if let Some(j) = st.jobs.get(&job_id) {
                    return (200, format!("{}\t{}\t{}\n{}", j.id, j.run_id, j.name, j.script));
                }
            }
            let runner = &st.runners[idx];
            let candidate = st
                .jobs
                .values()
                .filter(|j| j.status == "queued" && runner.scope.covers(&j.repo) && runner.fits(&j.labels))
                .filter(|j| !st.runs.get(&j.run_id).is_some_and(|r| r.cancelled))
                .min_by_key(|j| (j.created_at, j.id))
                .map(|j| j.id);
            if let Some(job_id) = candidate {
                let (rid, rname, rgroup) = (runner.id, runner.name.clone(), runner.runner_group_id);
                let t = now();
                let reply = {
                    let Some(j) = st.jobs.get_mut(&job_id) else { continue };
                    j.status = "in_progress".into();
                    j.runner_id = Some(rid);
                    j.runner_name = Some(rname);
                    j.runner_group_id = Some(rgroup);
                    j.started_at = Some(t);
                    format!("{}\t{}\t{}\n{}", j.id, j.run_id, j.name, j.script)
                };
                let run_id = st.jobs.get(&job_id).map(|j| j.run_id).unwrap_or_default();
                if let Some(run) = st.runs.get_mut(&run_id) {
                    run.updated_at = t;
                }
                let r = &mut st.runners[idx];
                r.current_job = Some(job_id);
                r.jobs_taken += 1;
                inner.job_webhook(st, job_id, "in_progress");
                return (200, reply);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return (204, String::new());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The runner finished `job_id` with `exit`: the job completes (unless a cancel got there first) and
/// the just-in-time runner is removed, as GitHub removes an ephemeral runner after its one job.
fn complete(inner: &Inner, runner_id: u64, job_id: u64, exit: i32) -> (u16, String) {
    let mut guard = lock(&inner.state);
    let st = &mut *guard;
    let Some(idx) = st.runners.iter().position(|r| r.id == runner_id) else {
        return (404, "no such runner\n".into());
    };
    if st.runners[idx].current_job != Some(job_id) {
        return (409, "this runner does not hold that job\n".into());
    }
    let t = now();
    let mut send = false;
    if let Some(j) = st.jobs.get_mut(&job_id) {
        if j.status != "completed" {
            j.status = "completed".into();
            j.conclusion = Some(if exit == 0 { "success" } else { "failure" }.into());
            j.completed_at = Some(t);
            send = true;
        }
    }
    let run_id = st.jobs.get(&job_id).map(|j| j.run_id).unwrap_or_default();
    if let Some(run) = st.runs.get_mut(&run_id) {
        run.updated_at = t;
    }
    let r = &mut st.runners[idx];
    r.current_job = None;
    r.deleted = true;
    if send {
        inner.job_webhook(st, job_id, "completed");
    }
    (204, String::new())
}
