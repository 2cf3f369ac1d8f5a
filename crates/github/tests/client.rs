//! The REST client against a tiny GitHub stand-in on 127.0.0.1:0. Every request is recorded and checked
//! against GitHub's published description of its operation (../shared/reference/github, when present):
//! the path matches a template with that method, query parameter names are declared for the operation
//! and the JSON body satisfies the request schema. Response bodies follow the same description.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, patch, post};
use axum::{Json, Router};
use gpuci_github::{
    ApiError, AppCredentials, CheckOutput, CheckRunUpdate, CheckStatus, Client, CommitStatus, Conclusion, Credentials,
    JitRunnerSpec, NewCheckRun, Permission, Repo, RetryPolicy, Secret, StatusState,
};
use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::{Duration, OffsetDateTime};

const APP_ID: u64 = 4711;
const PAT: &str = "github_pat_11TEST";
/// Installation whose tokens the stand-in makes expire in 2 minutes: inside the refresh margin.
const SHORT_LIVED_INSTALLATION: u64 = 2;
/// The installation the stand-in reports for every repository of `gpu-lab` and for the org itself.
const GPU_LAB_INSTALLATION: u64 = 7;
const SHA: &str = "ce587453ced02b1526dfb4cb910479d431683101";

#[derive(Debug, Clone)]
struct Recorded {
    method: Method,
    /// As sent, percent-encoding included.
    path: String,
    query: Option<String>,
    headers: HeaderMap,
    body: Value,
}

#[derive(Default)]
struct Stub {
    requests: Mutex<Vec<Recorded>>,
    tokens_minted: Mutex<u64>,
}

impl Stub {
    fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().expect("lock").clone()
    }

    /// Requests other than the app's own (`/app/...`) endpoints.
    fn api_requests(&self) -> Vec<Recorded> {
        self.requests().into_iter().filter(|r| !r.path.starts_with("/app/")).collect()
    }

    fn count(&self, method: &str, path: &str) -> usize {
        self.requests().iter().filter(|r| r.method == method && r.path == path).count()
    }
}

/// Records every request before routing it, so handlers only shape responses.
async fn record(State(stub): State<Arc<Stub>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.expect("request body");
    let json =
        if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("request body is JSON") };
    stub.requests.lock().expect("lock").push(Recorded {
        method: parts.method.clone(),
        path: parts.uri.path().to_owned(),
        query: parts.uri.query().map(str::to_owned),
        headers: parts.headers.clone(),
        body: json,
    });
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

type Stubbed = State<Arc<Stub>>;

fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({ "message": "Not Found", "documentation_url": "https://docs.github.com/rest" })),
    )
        .into_response()
}

fn user(login: &str) -> Value {
    json!({ "login": login, "id": 1, "node_id": "MDQ6VXNlcjE=", "type": "User", "site_admin": false,
            "url": format!("https://api.github.com/users/{login}") })
}

fn installation(id: u64, login: &str) -> Value {
    json!({
        "id": id, "account": user(login), "app_id": APP_ID, "app_slug": "gpuci", "target_id": 1,
        "target_type": "Organization", "repository_selection": "all", "permissions": { "checks": "write" },
        "events": ["workflow_job"], "single_file_name": null, "created_at": "2018-02-09T20:51:14Z",
        "updated_at": "2018-02-09T20:51:14Z", "suspended_at": null, "suspended_by": null,
        "access_tokens_url": format!("https://api.github.com/app/installations/{id}/access_tokens"),
    })
}

async fn access_tokens(State(stub): Stubbed, Path(installation_id): Path<u64>) -> Response {
    let n = {
        let mut minted = stub.tokens_minted.lock().expect("lock");
        *minted += 1;
        *minted
    };
    let lifetime = if installation_id == SHORT_LIVED_INSTALLATION { Duration::minutes(2) } else { Duration::hours(1) };
    let expires_at = (OffsetDateTime::now_utc() + lifetime).format(&Rfc3339).expect("format");
    let body = json!({ "token": format!("ghs_test{n}"), "expires_at": expires_at,
                       "permissions": { "checks": "write" }, "repository_selection": "all" });
    (StatusCode::CREATED, Json(body)).into_response()
}

async fn list_installations() -> Response {
    Json(json!([installation(GPU_LAB_INSTALLATION, "gpu-lab"), installation(8, "other-org")])).into_response()
}

async fn repo_installation(Path((owner, _repo)): Path<(String, String)>) -> Response {
    match owner.as_str() {
        "not-installed" => not_found(),
        "gpu-lab" | "missing" => Json(installation(GPU_LAB_INSTALLATION, &owner)).into_response(),
        _ => Json(installation(9, &owner)).into_response(),
    }
}

fn runner(id: u64, name: &str, labels: &[&str]) -> Value {
    let labels: Vec<Value> =
        labels.iter().enumerate().map(|(i, l)| json!({ "id": i, "name": l, "type": "custom" })).collect();
    json!({ "id": id, "runner_group_id": 1, "name": name, "os": "linux", "status": "online", "busy": false,
            "ephemeral": true, "version": "2.323.0", "labels": labels })
}

fn jitconfig_response(name: Option<String>) -> Response {
    let body = json!({ "runner": runner(23, name.as_deref().unwrap_or("?"), &["self-hosted"]),
                       "encoded_jit_config": "ZW5jb2RlZA==" });
    (StatusCode::CREATED, Json(body)).into_response()
}

async fn generate_jitconfig(Path((owner, _repo)): Path<(String, String)>, Json(body): Json<Value>) -> Response {
    if owner == "missing" {
        return not_found();
    }
    jitconfig_response(body["name"].as_str().map(String::from))
}

async fn generate_org_jitconfig(Json(body): Json<Value>) -> Response {
    jitconfig_response(body["name"].as_str().map(String::from))
}

/// What GitHub sends for a runner that is running a job.
fn runner_busy() -> Response {
    let body = json!({ "message": "Bad request - Runner \"r\" is still running a job\"", "documentation_url": "" });
    (StatusCode::UNPROCESSABLE_ENTITY, Json(body)).into_response()
}

async fn delete_runner(Path((_owner, _repo, runner_id)): Path<(String, String, u64)>) -> Response {
    match runner_id {
        404 => not_found(),
        422 => runner_busy(),
        _ => StatusCode::NO_CONTENT.into_response(),
    }
}

async fn delete_org_runner(Path((_org, runner_id)): Path<(String, u64)>) -> Response {
    if runner_id == 404 {
        return not_found();
    }
    StatusCode::NO_CONTENT.into_response()
}

/// GitHub's `Link` header: page 1 of 2 names `next` and `last`; page 2 names `prev` and `first`.
fn link_header(headers: &HeaderMap, page: u32) -> HeaderValue {
    let host = headers[header::HOST].to_str().expect("host");
    let url = |n: u32| format!("<http://{host}/repositories/1296269/list?per_page=100&page={n}>");
    let value = if page == 1 {
        format!("{}; rel=\"next\", {}; rel=\"last\"", url(2), url(2))
    } else {
        format!("{}; rel=\"prev\", {}; rel=\"first\"", url(1), url(1))
    };
    HeaderValue::from_str(&value).expect("header")
}

fn page_of(query: &Query<Vec<(String, String)>>) -> u32 {
    query.0.iter().find(|(k, _)| k == "page").map_or(1, |(_, v)| v.parse().expect("page number"))
}

fn param<'a>(query: &'a Query<Vec<(String, String)>>, name: &str) -> Option<&'a str> {
    query.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

async fn list_runners(headers: HeaderMap, query: Query<Vec<(String, String)>>) -> Response {
    let page = page_of(&query);
    let runners = if page == 1 {
        vec![runner(1, "gpuci-a", &["self-hosted", "gpu"]), runner(2, "gpuci-b", &["self-hosted"])]
    } else {
        vec![runner(3, "gpuci-c", &["self-hosted", "h100"])]
    };
    ([(header::LINK, link_header(&headers, page))], Json(json!({ "total_count": 3, "runners": runners })))
        .into_response()
}

async fn cancel_run(Path((_owner, _repo, run_id)): Path<(String, String, u64)>) -> Response {
    if run_id == 409 {
        let body = json!({ "message": "Cannot cancel a workflow run that is completed.", "documentation_url": "" });
        return (StatusCode::CONFLICT, Json(body)).into_response();
    }
    (StatusCode::ACCEPTED, Json(json!({}))).into_response()
}

fn minimal_repo(full_name: &str) -> Value {
    let (owner, name) = full_name.split_once('/').expect("full name");
    json!({ "id": 1296269, "node_id": "MDEwOlJlcG9zaXRvcnkxMjk2MjY5", "name": name, "full_name": full_name,
            "owner": user(owner), "private": false, "fork": false,
            "url": format!("https://api.github.com/repos/{full_name}") })
}

fn workflow_run(id: u64, head_sha: &str, event: &str, status: &str, head_repo: Option<&str>) -> Value {
    json!({
        "id": id, "name": "CI", "node_id": "MDEyOldvcmtmbG93IFJ1bjI2OTI4OQ==", "head_branch": "main",
        "head_sha": head_sha, "path": ".github/workflows/ci.yml", "run_number": 562, "run_attempt": 1,
        "event": event, "display_title": "Add GPU tests", "status": status, "conclusion": null,
        "workflow_id": 159038, "url": format!("https://api.github.com/repos/gpu-lab/kernels/actions/runs/{id}"),
        "html_url": format!("https://github.com/gpu-lab/kernels/actions/runs/{id}"), "pull_requests": [],
        "created_at": "2020-01-22T19:33:08Z", "updated_at": "2020-01-22T19:33:08Z",
        "jobs_url": "", "logs_url": "", "check_suite_url": "", "artifacts_url": "", "cancel_url": "",
        "rerun_url": "", "workflow_url": "", "head_commit": null,
        "repository": minimal_repo("gpu-lab/kernels"),
        "head_repository": head_repo.map(minimal_repo),
    })
}

async fn list_runs(headers: HeaderMap, query: Query<Vec<(String, String)>>) -> Response {
    let page = page_of(&query);
    let sha = param(&query, "head_sha").unwrap_or(SHA);
    let status = param(&query, "status").unwrap_or("queued");
    let runs = if page == 1 {
        vec![
            workflow_run(30433642, sha, "push", status, Some("gpu-lab/kernels")),
            workflow_run(30433643, sha, "pull_request", status, Some("contributor/kernels")),
        ]
    } else {
        // A fork PR whose head repository has since been deleted.
        vec![workflow_run(30433644, sha, "pull_request", status, None)]
    };
    ([(header::LINK, link_header(&headers, page))], Json(json!({ "total_count": 3, "workflow_runs": runs })))
        .into_response()
}

fn job(id: u64, run_id: u64, name: &str, status: &str, runner_name: Option<&str>) -> Value {
    let conclusion = if status == "completed" { json!("success") } else { Value::Null };
    json!({
        "id": id, "run_id": run_id, "run_url": "", "run_attempt": 1, "node_id": "MDg6Q2hlY2tSdW40",
        "head_sha": SHA, "url": "", "html_url": "", "status": status, "conclusion": conclusion,
        "created_at": "2020-01-20T17:42:40Z", "started_at": "2020-01-20T17:42:40Z", "completed_at": null,
        "name": name, "steps": [], "check_run_url": "", "labels": ["self-hosted", "gpu"],
        "runner_id": runner_name.map(|_| 1), "runner_name": runner_name, "runner_group_id": null,
        "runner_group_name": null, "workflow_name": "CI", "head_branch": "main",
    })
}

async fn list_jobs(
    Path((_owner, _repo, run_id)): Path<(String, String, u64)>,
    headers: HeaderMap,
    query: Query<Vec<(String, String)>>,
) -> Response {
    let page = page_of(&query);
    let jobs = if page == 1 {
        vec![
            job(1, run_id, "build", "completed", Some("gpuci-a")),
            job(2, run_id, "test", "in_progress", Some("gpuci-b")),
        ]
    } else {
        vec![job(3, run_id, "bench", "queued", None)]
    };
    ([(header::LINK, link_header(&headers, page))], Json(json!({ "total_count": 3, "jobs": jobs }))).into_response()
}

async fn get_job(Path((_owner, _repo, job_id)): Path<(String, String, u64)>) -> Response {
    let message = |m: &str| Json(json!({ "message": m, "documentation_url": "" }));
    match job_id {
        500 => (StatusCode::BAD_GATEWAY, message("Server Error")).into_response(),
        403 => (
            StatusCode::FORBIDDEN,
            [("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1700000000")],
            message("API rate limit exceeded for installation ID 7."),
        )
            .into_response(),
        401 => (StatusCode::FORBIDDEN, message("Resource not accessible by integration")).into_response(),
        _ => Json(job(job_id, 29679449, "build", "queued", None)).into_response(),
    }
}

fn check_run(id: u64, body: &Value) -> Value {
    json!({
        "id": id, "head_sha": body["head_sha"].as_str().unwrap_or(SHA), "node_id": "MDg6Q2hlY2tSdW40",
        "external_id": body["external_id"], "url": "", "html_url": "", "details_url": body["details_url"],
        "status": body["status"].as_str().unwrap_or("queued"), "conclusion": body["conclusion"],
        "started_at": "2018-05-04T01:14:52Z", "completed_at": null, "name": body["name"].as_str().unwrap_or("gpu"),
        "output": { "title": null, "summary": null, "text": null, "annotations_count": 0, "annotations_url": "" },
        "check_suite": { "id": 5 }, "app": null, "pull_requests": [],
    })
}

async fn create_check_run(Json(body): Json<Value>) -> Response {
    (StatusCode::CREATED, Json(check_run(4, &body))).into_response()
}

async fn update_check_run(Path((_o, _r, id)): Path<(String, String, u64)>, Json(body): Json<Value>) -> Response {
    Json(check_run(id, &body)).into_response()
}

async fn create_status(Json(body): Json<Value>) -> Response {
    let status = json!({
        "url": "", "avatar_url": null, "id": 1, "node_id": "MDY6U3RhdHVzMQ==", "state": body["state"],
        "description": body["description"], "target_url": body["target_url"], "context": body["context"],
        "created_at": "2012-07-20T01:19:13Z", "updated_at": "2012-07-20T01:19:13Z", "creator": user("gpuci"),
    });
    (StatusCode::CREATED, Json(status)).into_response()
}

async fn remove_label(Path((_o, _r, _n, name)): Path<(String, String, u64, String)>) -> Response {
    if name == "absent" {
        return (StatusCode::NOT_FOUND, Json(json!({ "message": "Label does not exist", "documentation_url": "" })))
            .into_response();
    }
    // GitHub answers with the labels that remain.
    Json(json!([{ "id": 208045946, "node_id": "MDU6TGFiZWwyMDgwNDU5NDY=", "url": "", "name": "bug",
                  "description": "Something isn't working", "color": "f29513", "default": true }]))
    .into_response()
}

async fn collaborator_permission(Path((_o, _r, username)): Path<(String, String, String)>) -> Response {
    let (permission, role_name) = match username.as_str() {
        "admin-user" => ("admin", "admin"),
        "maintainer" => ("write", "maintain"),
        "triager" => ("read", "triage"),
        "custom-role" => ("write", "gpu-operators"),
        "reader" => ("read", "read"),
        _ => return not_found(),
    };
    let mut user = user(&username);
    user["permissions"] = json!({ "admin": false, "maintain": false, "push": true, "triage": true, "pull": true });
    user["role_name"] = json!(role_name);
    Json(json!({ "permission": permission, "role_name": role_name, "user": user })).into_response()
}

/// `# gpuci\njobs: {}\n` repeated, base64-encoded and wrapped at 60 columns as GitHub does.
fn gpuci_yml() -> Vec<u8> {
    b"# gpuci pipeline\njobs:\n  test: { gpus: 1 }\n".repeat(4)
}

fn github_base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() { char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]) } else { '=' });
        }
    }
    let lines: Vec<&str> = out.as_bytes().chunks(60).map(|l| std::str::from_utf8(l).expect("ascii")).collect();
    lines.join("\n") + "\n"
}

async fn contents(Path((_o, _r, path)): Path<(String, String, String)>) -> Response {
    match path.as_str() {
        ".gpuci/pipeline.yml" => Json(json!({
            "type": "file", "encoding": "base64", "size": gpuci_yml().len(), "name": "pipeline.yml",
            "path": path, "content": github_base64(&gpuci_yml()), "sha": "3d21ec53a331a6f037a91c368710b99387d012c1",
            "url": "", "git_url": "", "html_url": "", "download_url": "", "_links": { "self": "", "git": "", "html": "" },
        }))
        .into_response(),
        ".gpuci" => Json(json!([{ "type": "file", "size": 625, "name": "pipeline.yml", "path": ".gpuci/pipeline.yml",
                                  "sha": "3d21ec53a331a6f037a91c368710b99387d012c1", "url": "", "git_url": "",
                                  "html_url": "", "download_url": "", "_links": { "self": "", "git": "", "html": "" } }]))
        .into_response(),
        _ => not_found(),
    }
}

/// GitHub answers `tarball/{ref}` with a redirect to codeload, another host.
async fn tarball(
    State(codeload): State<String>,
    Path((owner, repo, git_ref)): Path<(String, String, String)>,
) -> Response {
    let location = format!("{codeload}/{owner}/{repo}/legacy.tar.gz/{git_ref}");
    (StatusCode::FOUND, [(header::LOCATION, location)]).into_response()
}

const TARBALL_BYTES: usize = 10_000;

async fn codeload(Path((_o, _r, git_ref)): Path<(String, String, String)>) -> Response {
    let bytes = vec![0x1f_u8; TARBALL_BYTES];
    if git_ref == "chunked" {
        // No Content-Length: the cap must hold while streaming.
        let chunks: Vec<Result<Bytes, std::io::Error>> =
            bytes.chunks(1000).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        return Body::from_stream(futures::stream::iter(chunks)).into_response();
    }
    ([(header::CONTENT_TYPE, "application/x-gzip")], bytes).into_response()
}

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

struct StandIn {
    base: String,
    github: Arc<Stub>,
    codeload: Arc<Stub>,
}

async fn start_stub() -> StandIn {
    let codeload_stub = Arc::new(Stub::default());
    let codeload_base = serve(
        Router::new()
            .route("/{owner}/{repo}/legacy.tar.gz/{*ref}", get(codeload))
            .layer(middleware::from_fn_with_state(codeload_stub.clone(), record)),
    )
    .await;

    let github = Arc::new(Stub::default());
    let repo = "/repos/{owner}/{repo}";
    let app = Router::new()
        .route("/app/installations/{installation_id}/access_tokens", post(access_tokens))
        .route("/app/installations", get(list_installations))
        .route(&format!("{repo}/installation"), get(repo_installation))
        .route(&format!("{repo}/actions/runners/generate-jitconfig"), post(generate_jitconfig))
        .route("/orgs/{org}/actions/runners/generate-jitconfig", post(generate_org_jitconfig))
        .route(&format!("{repo}/actions/runners/{{runner_id}}"), delete(delete_runner))
        .route("/orgs/{org}/actions/runners/{runner_id}", delete(delete_org_runner))
        .route(&format!("{repo}/actions/runners"), get(list_runners))
        .route(&format!("{repo}/actions/runs/{{run_id}}/cancel"), post(cancel_run))
        .route(&format!("{repo}/actions/runs"), get(list_runs))
        .route(&format!("{repo}/actions/runs/{{run_id}}/jobs"), get(list_jobs))
        .route(&format!("{repo}/actions/jobs/{{job_id}}"), get(get_job))
        .route(&format!("{repo}/check-runs"), post(create_check_run))
        .route(&format!("{repo}/check-runs/{{check_run_id}}"), patch(update_check_run))
        .route(&format!("{repo}/statuses/{{sha}}"), post(create_status))
        .route(&format!("{repo}/issues/{{issue_number}}/labels/{{name}}"), delete(remove_label))
        .route(&format!("{repo}/collaborators/{{username}}/permission"), get(collaborator_permission))
        .route(&format!("{repo}/contents/{{*path}}"), get(contents))
        .with_state(github.clone())
        .merge(Router::new().route(&format!("{repo}/tarball/{{*ref}}"), get(tarball)).with_state(codeload_base))
        .layer(middleware::from_fn_with_state(github.clone(), record));
    StandIn { base: serve(app).await, github, codeload: codeload_stub }
}

fn fixture(name: &str) -> String {
    let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One quick retry, and no sitting out GitHub's waits: these tests are about what each answer
/// means (`crates/github-testserver/tests/faults.rs` covers the retries).
fn quick_retry() -> RetryPolicy {
    let ms = std::time::Duration::from_millis;
    RetryPolicy { attempts: 2, base: ms(1), max_backoff: ms(1), max_wait: ms(0), timeout: ms(10_000) }
}

fn app_client(base_url: &str) -> Client {
    let app = AppCredentials::new(APP_ID, &Secret::new(fixture("test-app-key.pem"))).expect("test key");
    Client::new(base_url, Credentials::App(app)).with_retry(quick_retry())
}

fn pat_client(base_url: &str) -> Client {
    Client::new(base_url, Credentials::Token(Secret::new(PAT))).with_retry(quick_retry())
}

fn kernels() -> Repo {
    Repo::parse("gpu-lab/kernels").expect("repo")
}

/// Headers GitHub asks every client to send.
fn assert_github_headers(req: &Recorded) {
    assert_eq!(req.headers["accept"], "application/vnd.github+json", "{req:?}");
    assert_eq!(req.headers["x-github-api-version"], "2022-11-28", "{req:?}");
    assert!(req.headers["user-agent"].to_str().expect("ascii").starts_with("gpuci/"), "{req:?}");
}

fn bearer(req: &Recorded) -> &str {
    let value = req.headers["authorization"].to_str().expect("ascii");
    value.strip_prefix("Bearer ").unwrap_or_else(|| panic!("not a bearer token: {value}"))
}

fn assert_app_jwt(req: &Recorded) {
    let public = jsonwebtoken::DecodingKey::from_rsa_pem(fixture("test-app-key.pub.pem").as_bytes()).expect("key");
    let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::RS256);
    validation.set_issuer(&[APP_ID.to_string()]);
    jsonwebtoken::decode::<Value>(bearer(req), &public, &validation).expect("request carries a valid app JWT");
}

/// Every request the stand-in saw carries GitHub's headers and matches GitHub's description.
fn assert_all_documented(stub: &Stub) {
    let spec = openapi();
    for req in stub.requests() {
        assert_github_headers(&req);
        if let Some(spec) = &spec {
            assert_matches_openapi(spec, &req);
        }
    }
}

#[tokio::test]
async fn installation_token_is_minted_with_the_app_jwt_and_cached() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    assert!(client.is_app());

    let first = client.installation_token(99).await.expect("token");
    let second = client.installation_token(99).await.expect("token");
    assert_eq!(first.expose(), "ghs_test1");
    assert_eq!(second.expose(), "ghs_test1", "second call must come from the cache");

    let requests = s.github.requests();
    assert_eq!(requests.len(), 1);
    let req = &requests[0];
    assert_eq!((req.method.as_str(), req.path.as_str()), ("POST", "/app/installations/99/access_tokens"));
    assert_app_jwt(req);
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn token_close_to_expiry_is_refreshed() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let first = client.installation_token(SHORT_LIVED_INSTALLATION).await.expect("token");
    let second = client.installation_token(SHORT_LIVED_INSTALLATION).await.expect("token");
    assert_ne!(first.expose(), second.expose());
    assert_eq!(s.github.requests().len(), 2);
}

#[tokio::test]
async fn app_auth_looks_up_the_repo_installation_once_and_caches_it() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let repo = kernels();

    let token = client.repo_token(&repo).await.expect("token");
    assert_eq!(token.expose(), "ghs_test1");
    client.list_runners(&repo).await.expect("runners");
    client.cancel_run(&repo, 1).await.expect("cancel");
    // Another repository of the same installation: looked up, but the installation's token is reused.
    let other = Repo::parse("gpu-lab/other").expect("repo");
    assert_eq!(client.repo_token(&other).await.expect("token").expose(), "ghs_test1");

    assert_eq!(s.github.count("GET", "/repos/gpu-lab/kernels/installation"), 1, "{:?}", s.github.requests());
    assert_eq!(s.github.count("GET", "/repos/gpu-lab/other/installation"), 1);
    assert_eq!(s.github.count("POST", &format!("/app/installations/{GPU_LAB_INSTALLATION}/access_tokens")), 1);
    for req in s.github.requests() {
        if req.path.starts_with("/app/") || req.path.ends_with("/installation") {
            assert_app_jwt(&req);
        } else {
            assert_eq!(bearer(&req), "ghs_test1", "{req:?}");
        }
    }
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn app_not_installed_on_the_repo_is_a_typed_permanent_error() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let repo = Repo::parse("not-installed/kernels").expect("repo");
    let err = client.list_runners(&repo).await.expect_err("not installed");
    assert!(matches!(&err, ApiError::NotInstalled { target } if target == "not-installed/kernels"), "{err:?}");
    assert!(!err.is_transient());
    assert_eq!(s.github.requests().len(), 1, "nothing but the lookup is sent");
}

#[tokio::test]
async fn pat_auth_sends_the_pat_and_never_touches_app_endpoints() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    assert!(!client.is_app());

    assert_eq!(client.repo_token(&repo).await.expect("token").expose(), PAT);
    client.list_runs(&repo, None, None).await.expect("runs");
    client.delete_runner(&repo, 5).await.expect("delete");
    let status =
        CommitStatus { state: StatusState::Pending, context: "gpuci".into(), target_url: None, description: None };
    client.create_status(&repo, SHA, &status).await.expect("status");
    client.generate_org_jitconfig("gpu-lab", &spec("gpuci-org-1")).await.expect("org jit");

    let err = client.installation_token(1).await.expect_err("no app");
    assert!(matches!(err, ApiError::AppOnly { .. }) && !err.is_transient(), "{err:?}");
    // Check runs are a GitHub App feature; GitHub refuses PATs, so the client does not even ask.
    let run = new_check_run();
    assert!(matches!(client.create_check_run(&repo, &run).await, Err(ApiError::AppOnly { .. })));
    let update = CheckRunUpdate::default();
    assert!(matches!(client.update_check_run(&repo, 4, &update).await, Err(ApiError::AppOnly { .. })));

    let requests = s.github.requests();
    assert!(!requests.is_empty());
    for req in &requests {
        assert!(!req.path.starts_with("/app/") && !req.path.ends_with("/installation"), "{req:?}");
        assert_eq!(bearer(req), PAT, "{req:?}");
    }
    assert!(!format!("{client:?}").contains(PAT), "Debug must not print the PAT");
    assert_all_documented(&s.github);
}

fn spec(name: &str) -> JitRunnerSpec {
    JitRunnerSpec { name: name.into(), runner_group_id: 1, labels: vec!["self-hosted".into(), "gpu".into()] }
}

#[tokio::test]
async fn generate_jitconfig_sends_the_documented_request() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let jit = client.generate_jitconfig(&kernels(), &spec("gpuci-job-17-a")).await.expect("jit config");
    assert_eq!(jit.runner_id, 23);
    assert_eq!(jit.runner_name, "gpuci-job-17-a");
    assert_eq!(jit.encoded_jit_config.expose(), "ZW5jb2RlZA==");
    assert_eq!(format!("{:?}", jit.encoded_jit_config), "***");

    let requests = s.github.api_requests();
    assert_eq!(requests.len(), 2, "installation lookup, JIT config: {requests:?}");
    let req = &requests[1];
    assert_eq!(
        (req.method.as_str(), req.path.as_str()),
        ("POST", "/repos/gpu-lab/kernels/actions/runners/generate-jitconfig")
    );
    assert_eq!(bearer(req), "ghs_test1", "JIT config must use the installation token, not the app JWT");
    assert_eq!(req.body, json!({ "name": "gpuci-job-17-a", "runner_group_id": 1, "labels": ["self-hosted", "gpu"] }));
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn org_jitconfig_finds_the_installation_by_account_login_once() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let jit = client.generate_org_jitconfig("gpu-lab", &spec("gpuci-org-1")).await.expect("jit");
    assert_eq!(jit.runner_name, "gpuci-org-1");
    // Logins are case-insensitive on GitHub; the cached lookup serves both spellings.
    client.generate_org_jitconfig("GPU-Lab", &spec("gpuci-org-2")).await.expect("jit");
    client.delete_org_runner("gpu-lab", 23).await.expect("delete");
    client.delete_org_runner("gpu-lab", 404).await.expect("already gone is fine");

    assert_eq!(s.github.count("GET", "/app/installations"), 1);
    assert_eq!(s.github.count("POST", &format!("/app/installations/{GPU_LAB_INSTALLATION}/access_tokens")), 1);
    assert_eq!(s.github.count("POST", "/orgs/gpu-lab/actions/runners/generate-jitconfig"), 1);
    assert_eq!(s.github.count("POST", "/orgs/GPU-Lab/actions/runners/generate-jitconfig"), 1);

    let err = client.generate_org_jitconfig("nobody", &spec("x")).await.expect_err("not installed");
    assert!(matches!(&err, ApiError::NotInstalled { target } if target == "nobody") && !err.is_transient(), "{err:?}");
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn deleting_a_runner_that_is_gone_succeeds_but_a_busy_one_fails() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    client.delete_runner(&kernels(), 23).await.expect("204");
    client.delete_runner(&kernels(), 404).await.expect("404 means already gone");
    let err = client.delete_runner(&kernels(), 422).await.expect_err("busy runner");
    assert!(matches!(err, ApiError::Status { status: StatusCode::UNPROCESSABLE_ENTITY, .. }), "{err:?}");
    assert!(!err.is_transient());
    assert_eq!(s.github.count("DELETE", "/repos/gpu-lab/kernels/actions/runners/404"), 1);
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn cancelling_a_finished_run_succeeds() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    client.cancel_run(&kernels(), 30433642).await.expect("202");
    client.cancel_run(&kernels(), 409).await.expect("409 means the run already finished");
    let req = &s.github.requests()[0];
    assert_eq!(
        (req.method.as_str(), req.path.as_str()),
        ("POST", "/repos/gpu-lab/kernels/actions/runs/30433642/cancel")
    );
    assert_eq!(req.body, Value::Null, "cancel has no request body");
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn runners_follow_pagination_and_flatten_labels() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let runners = client.list_runners(&kernels()).await.expect("runners");
    let names: Vec<&str> = runners.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["gpuci-a", "gpuci-b", "gpuci-c"]);
    assert_eq!(runners[0].labels, ["self-hosted", "gpu"]);
    assert_eq!((runners[2].id, runners[2].status.as_str(), runners[2].busy), (3, "online", false));

    let queries: Vec<_> = s.github.requests().into_iter().map(|r| r.query.unwrap_or_default()).collect();
    assert_eq!(queries, ["per_page=100&page=1", "per_page=100&page=2"], "stops after the page without rel=next");
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn runs_are_filtered_paginated_and_flattened() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let runs = client.list_runs(&kernels(), Some("queued"), Some(SHA)).await.expect("runs");
    assert_eq!(runs.len(), 3);
    assert_eq!((runs[0].id, runs[0].event.as_str(), runs[0].status.as_deref()), (30433642, "push", Some("queued")));
    assert_eq!(runs[1].head_repository_full_name.as_deref(), Some("contributor/kernels"));
    assert_eq!(runs[2].head_repository_full_name, None, "deleted fork");
    assert!(runs.iter().all(|r| r.repository_full_name == "gpu-lab/kernels" && r.head_sha == SHA));

    let requests = s.github.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[1].query.as_deref(), Some(&*format!("status=queued&head_sha={SHA}&per_page=100&page=2")));
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn run_jobs_are_paginated_and_a_single_job_is_read() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let jobs = client.list_run_jobs(&kernels(), 29679449).await.expect("jobs");
    let summary: Vec<_> = jobs.iter().map(|j| (j.id, j.status.as_str(), j.conclusion.as_deref())).collect();
    assert_eq!(summary, [(1, "completed", Some("success")), (2, "in_progress", None), (3, "queued", None)]);
    assert_eq!(jobs[1].runner_name.as_deref(), Some("gpuci-b"));
    assert!(jobs.iter().all(|j| j.run_id == 29679449 && j.labels == ["self-hosted", "gpu"] && j.head_sha == SHA));

    let job = client.get_job(&kernels(), 399444496).await.expect("job");
    assert_eq!((job.id, job.run_id, job.name.as_str(), job.runner_name), (399444496, 29679449, "build", None));
    assert_eq!(s.github.requests().len(), 3);
    assert_all_documented(&s.github);
}

fn new_check_run() -> NewCheckRun {
    NewCheckRun {
        name: "gpuci / test".into(),
        head_sha: SHA.into(),
        status: CheckStatus::Queued,
        conclusion: None,
        details_url: Some("https://gpuci.example/jobs/17".into()),
        external_id: Some("17".into()),
        output: None,
    }
}

#[tokio::test]
async fn check_runs_are_created_and_updated_with_documented_bodies() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let id = client.create_check_run(&kernels(), &new_check_run()).await.expect("create");
    assert_eq!(id, 4);
    let update = CheckRunUpdate {
        status: Some(CheckStatus::Completed),
        conclusion: Some(Conclusion::ActionRequired),
        details_url: None,
        output: Some(CheckOutput { title: "Needs approval".into(), summary: "A maintainer must add `gpu-ok`.".into() }),
    };
    client.update_check_run(&kernels(), id, &update).await.expect("update");

    let requests = s.github.api_requests();
    let create = &requests[1];
    assert_eq!((create.method.as_str(), create.path.as_str()), ("POST", "/repos/gpu-lab/kernels/check-runs"));
    assert_eq!(
        create.body,
        json!({ "name": "gpuci / test", "head_sha": SHA, "status": "queued",
                "details_url": "https://gpuci.example/jobs/17", "external_id": "17" })
    );
    let patch = &requests[2];
    assert_eq!((patch.method.as_str(), patch.path.as_str()), ("PATCH", "/repos/gpu-lab/kernels/check-runs/4"));
    assert_eq!(
        patch.body,
        json!({ "status": "completed", "conclusion": "action_required",
                "output": { "title": "Needs approval", "summary": "A maintainer must add `gpu-ok`." } })
    );
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn commit_status_description_is_cut_to_140_characters() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let long = "é".repeat(200);
    let status = CommitStatus {
        state: StatusState::Failure,
        context: "gpuci/h100".into(),
        target_url: Some("https://gpuci.example/jobs/17".into()),
        description: Some(long),
    };
    client.create_status(&kernels(), SHA, &status).await.expect("status");
    let req = &s.github.requests()[0];
    assert_eq!(req.path, format!("/repos/gpu-lab/kernels/statuses/{SHA}"));
    let sent = req.body["description"].as_str().expect("description");
    assert_eq!(sent.chars().count(), 140);
    assert!(sent.ends_with('…'));
    assert_eq!(req.body["state"], "failure");
    assert_eq!(req.body["context"], "gpuci/h100");
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn label_names_are_url_encoded_and_a_missing_label_is_fine() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    client.remove_label(&kernels(), 42, "needs gpu/ci: ok?").await.expect("removed");
    client.remove_label(&kernels(), 42, "absent").await.expect("404 means not there");
    let err = client.remove_label(&kernels(), 42, "..").await.expect_err("dot segment");
    assert!(matches!(err, ApiError::InvalidArgument { .. }), "{err:?}");
    let paths: Vec<_> = s.github.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(
        paths,
        [
            "/repos/gpu-lab/kernels/issues/42/labels/needs%20gpu%2Fci%3A%20ok%3F",
            "/repos/gpu-lab/kernels/issues/42/labels/absent"
        ]
    );
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn collaborator_permission_reads_role_name_then_permission() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    for (user, expected) in [
        ("admin-user", Permission::Admin),
        ("maintainer", Permission::Maintain),
        ("triager", Permission::Triage),
        ("custom-role", Permission::Write),
        ("reader", Permission::Read),
        ("stranger", Permission::None),
    ] {
        assert_eq!(client.collaborator_permission(&repo, user).await.expect("permission"), expected, "{user}");
    }
    assert!(client.collaborator_permission(&repo, "maintainer").await.expect("permission").can_write());
    assert!(!client.collaborator_permission(&repo, "triager").await.expect("permission").can_write());
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn file_contents_decodes_wrapped_base64_and_maps_404_to_none() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    assert!(github_base64(&gpuci_yml()).trim_end().contains('\n'), "the fixture must be wrapped like GitHub's");
    let file = client.file_contents(&repo, ".gpuci/pipeline.yml", SHA).await.expect("contents");
    assert_eq!(file, Some(gpuci_yml()));
    assert_eq!(client.file_contents(&repo, ".gpuci/missing.yml", "main").await.expect("404"), None);
    let err = client.file_contents(&repo, ".gpuci", "main").await.expect_err("directory");
    assert!(matches!(err, ApiError::UnsupportedContent { .. }) && !err.is_transient(), "{err:?}");

    let first = &s.github.requests()[0];
    assert_eq!(first.path, "/repos/gpu-lab/kernels/contents/.gpuci/pipeline.yml");
    assert_eq!(first.query.as_deref(), Some(&*format!("ref={SHA}")));
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn tarball_follows_the_redirect_without_the_token_and_enforces_the_cap() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    let tar = client.tarball(&repo, SHA, TARBALL_BYTES as u64).await.expect("tarball at the limit");
    assert_eq!(tar.len(), TARBALL_BYTES);

    let err = client.tarball(&repo, SHA, TARBALL_BYTES as u64 - 1).await.expect_err("over the limit");
    assert!(matches!(err, ApiError::TooLarge { limit, .. } if limit == TARBALL_BYTES as u64 - 1), "{err:?}");
    assert!(!err.is_transient());
    let err = client.tarball(&repo, "chunked", 2500).await.expect_err("over the limit while streaming");
    assert!(matches!(err, ApiError::TooLarge { .. }), "{err:?}");
    assert_eq!(client.tarball(&repo, "chunked", 1 << 20).await.expect("chunked").len(), TARBALL_BYTES);

    let github = s.github.requests();
    assert_eq!(github[0].path, format!("/repos/gpu-lab/kernels/tarball/{SHA}"));
    assert_eq!(bearer(&github[0]), PAT);
    let codeload = s.codeload.requests();
    assert_eq!(codeload.len(), 4);
    assert!(
        codeload.iter().all(|r| !r.headers.contains_key("authorization")),
        "the token must not follow the redirect to another host"
    );
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn http_errors_are_typed_and_not_transient() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let missing = Repo::parse("missing/repo").expect("repo");
    let err = client.generate_jitconfig(&missing, &spec("r")).await.expect_err("404");
    assert!(matches!(err, ApiError::Status { status: StatusCode::NOT_FOUND, .. }), "{err:?}");
    assert!(!err.is_transient());
    assert!(err.to_string().contains("generate JIT runner config") && err.to_string().contains("Not Found"), "{err}");
}

#[tokio::test]
async fn server_errors_and_rate_limits_are_transient_permission_errors_are_not() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    let server = client.get_job(&repo, 500).await.expect_err("502");
    assert!(matches!(server, ApiError::Status { status: StatusCode::BAD_GATEWAY, .. }) && server.is_transient());
    let limited = client.get_job(&repo, 403).await.expect_err("rate limited");
    assert!(matches!(limited, ApiError::RateLimited { .. }) && limited.is_transient(), "{limited:?}");
    assert!(limited.retry_not_before().is_some(), "{limited:?}");
    // A fresh client: the rate limit holds back every call on the first one.
    let forbidden = pat_client(&s.base).get_job(&repo, 401).await.expect_err("forbidden");
    assert!(
        matches!(forbidden, ApiError::Status { status: StatusCode::FORBIDDEN, .. })
            && !forbidden.is_transient()
            && forbidden.retry_not_before().is_none(),
        "{forbidden:?}"
    );
}

#[tokio::test]
async fn unreachable_github_is_transient() {
    // Bind then drop a listener so the port is (almost certainly) closed.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let err = app_client(&format!("http://{addr}")).installation_token(1).await.expect_err("refused");
    assert!(matches!(err, ApiError::Transport { .. }) && err.is_transient(), "{err:?}");
}

fn openapi() -> Option<Value> {
    let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("../../../shared/reference/github/github-openapi-gpuci-subset.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(serde_json::from_str(&text).expect("OpenAPI JSON")),
        Err(_) => {
            eprintln!("skipping OpenAPI check: {} not found", path.display());
            None
        }
    }
}

fn resolve<'a>(spec: &'a Value, node: &'a Value) -> &'a Value {
    match node["$ref"].as_str() {
        Some(reference) => reference.trim_start_matches("#/").split('/').fold(spec, |node, key| &node[key]),
        None => node,
    }
}

/// The operation whose path template matches `path` for `method`, preferring the template with the
/// most literal segments (`runners/generate-jitconfig` over `runners/{runner_id}`). A parameter marked
/// `x-multi-segment` at the end of a template takes the rest of the path.
fn find_operation<'a>(spec: &'a Value, method: &Method, path: &str) -> Option<(&'a str, &'a Value)> {
    let method = method.as_str().to_lowercase();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let mut best: Option<(usize, &str, &Value)> = None;
    for (template, item) in spec["paths"].as_object()?.iter() {
        let Some(op) = item.get(&method) else { continue };
        let parts: Vec<&str> = template.trim_start_matches('/').split('/').collect();
        let multi_segment_tail = parts.last().is_some_and(|last| {
            let name = last.trim_start_matches('{').trim_end_matches('}');
            op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| resolve(spec, p))
                .any(|p| p["name"] == name && p["in"] == "path" && p["x-multi-segment"] == json!(true))
        });
        let fits = if multi_segment_tail { segments.len() >= parts.len() } else { segments.len() == parts.len() };
        let matches =
            fits && parts.iter().zip(&segments).all(|(part, segment)| part.starts_with('{') || part == segment);
        if matches {
            let literals = parts.iter().filter(|p| !p.starts_with('{')).count();
            if best.as_ref().is_none_or(|(n, ..)| literals > *n) {
                best = Some((literals, template.as_str(), op));
            }
        }
    }
    best.map(|(_, template, op)| (template, op))
}

/// Checks a recorded request against its operation in GitHub's OpenAPI description: a path template
/// has the method, every query parameter is declared for the operation, and the JSON body satisfies
/// the request schema (required fields, types, enums, array bounds).
fn assert_matches_openapi(spec: &Value, req: &Recorded) {
    let Some((template, op)) = find_operation(spec, &req.method, &req.path) else {
        panic!("{} {} matches no operation in GitHub's description", req.method, req.path);
    };
    let declared: Vec<&str> = op["parameters"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| resolve(spec, p))
        .filter(|p| p["in"] == "query")
        .filter_map(|p| p["name"].as_str())
        .collect();
    for pair in req.query.as_deref().unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let name = pair.split('=').next().unwrap_or_default();
        assert!(declared.contains(&name), "{} {template}: query parameter `{name}` is not declared", req.method);
    }
    let request_body = &op["requestBody"];
    if request_body.is_null() {
        assert!(req.body.is_null(), "{} {template} takes no body, got {}", req.method, req.body);
        return;
    }
    let schema = &request_body["content"]["application/json"]["schema"];
    if request_body["required"] == json!(true) || !req.body.is_null() {
        let mut errors = Vec::new();
        validate(spec, schema, &req.body, "body", &mut errors);
        assert!(errors.is_empty(), "{} {template}: {errors:?}", req.method);
    }
}

/// The small part of JSON Schema that GitHub's request bodies for these operations use.
fn validate(spec: &Value, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
    if schema["$ref"].is_string() {
        return validate(spec, resolve(spec, schema), value, at, errors);
    }
    if value.is_null() && schema["nullable"] == json!(true) {
        return;
    }
    let ok = match schema["type"].as_str() {
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    };
    if !ok {
        errors.push(format!("{at}: expected {}, got {value}", schema["type"]));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(value) {
            errors.push(format!("{at}: {value} is not one of {allowed:?}"));
        }
    }
    if let (Some(text), Some(max)) = (value.as_str(), schema["maxLength"].as_u64()) {
        if text.chars().count() as u64 > max {
            errors.push(format!("{at}: longer than {max} characters"));
        }
    }
    if let Some(object) = value.as_object() {
        for field in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
            if !object.contains_key(field) {
                errors.push(format!("{at}: missing required `{field}`"));
            }
        }
        for (key, item) in object {
            match schema["properties"].get(key) {
                Some(property) => validate(spec, property, item, &format!("{at}.{key}"), errors),
                None if schema["additionalProperties"] == json!(false) => {
                    errors.push(format!("{at}: unknown property `{key}`"))
                }
                None => {}
            }
        }
    }
    if let Some(items) = value.as_array() {
        let len = items.len() as u64;
        if schema["minItems"].as_u64().is_some_and(|min| len < min)
            || schema["maxItems"].as_u64().is_some_and(|max| len > max)
        {
            errors.push(format!("{at}: {len} items is outside the allowed range"));
        }
        for (i, item) in items.iter().enumerate() {
            validate(spec, &schema["items"], item, &format!("{at}[{i}]"), errors);
        }
    }
}

#[test]
fn openapi_check_catches_bad_bodies_paths_and_query_names() {
    let Some(spec) = openapi() else { return };
    let schema = &spec["paths"]["/repos/{owner}/{repo}/actions/runners/generate-jitconfig"]["post"]["requestBody"]
        ["content"]["application/json"]["schema"];
    let mut errors = Vec::new();
    validate(&spec, schema, &json!({ "name": 5, "runner_group_id": 1, "labels": [] }), "body", &mut errors);
    assert_eq!(errors.len(), 2, "{errors:?}");

    let schema = &spec["paths"]["/repos/{owner}/{repo}/check-runs"]["post"]["requestBody"]["content"]
        ["application/json"]["schema"];
    let mut errors = Vec::new();
    validate(&spec, schema, &json!({ "name": "x", "head_sha": SHA, "status": "done" }), "body", &mut errors);
    assert_eq!(errors.len(), 1, "enum: {errors:?}");

    let request = |method: Method, path: &str, query: Option<&str>| Recorded {
        method,
        path: path.into(),
        query: query.map(String::from),
        headers: HeaderMap::new(),
        body: Value::Null,
    };
    let (template, _) = find_operation(&spec, &Method::DELETE, "/repos/o/r/actions/runners/5").expect("known");
    assert_eq!(template, "/repos/{owner}/{repo}/actions/runners/{runner_id}");
    let (template, _) = find_operation(&spec, &Method::GET, "/repos/o/r/contents/a/b/c.yml").expect("multi-segment");
    assert_eq!(template, "/repos/{owner}/{repo}/contents/{path}");
    assert!(find_operation(&spec, &Method::PUT, "/repos/o/r/actions/runners/5").is_none());
    assert!(find_operation(&spec, &Method::GET, "/repos/o/r/actions/runners/5/labels").is_none());
    let undeclared = request(Method::GET, "/repos/o/r/actions/runs", Some("per_page=100&sha=abc"));
    assert!(std::panic::catch_unwind(|| assert_matches_openapi(&spec, &undeclared)).is_err());
    let declared = request(Method::GET, "/repos/o/r/actions/runs", Some("per_page=100&head_sha=abc&page=2"));
    assert_matches_openapi(&spec, &declared);
}
