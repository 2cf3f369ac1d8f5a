//! The tiny GitHub stand-in the client is tested against: its routes, the recorded
//! requests, their checks against GitHub's published description, and the fixtures.

use super::*;

pub(crate) const APP_ID: u64 = 4711;
pub(crate) const PAT: &str = "github_pat_11TEST";
/// Installation whose tokens the stand-in makes expire in 2 minutes: inside the refresh margin.
pub(crate) const SHORT_LIVED_INSTALLATION: u64 = 2;
/// The installation the stand-in reports for every repository of `gpu-lab` and for the org itself.
pub(crate) const GPU_LAB_INSTALLATION: u64 = 7;
pub(crate) const SHA: &str = "ce587453ced02b1526dfb4cb910479d431683101";

#[derive(Debug, Clone)]
pub(crate) struct Recorded {
    pub(crate) method: Method,
    /// As sent, percent-encoding included.
    pub(crate) path: String,
    pub(crate) query: Option<String>,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Value,
}

#[derive(Default)]
pub(crate) struct Stub {
    pub(crate) requests: Mutex<Vec<Recorded>>,
    pub(crate) tokens_minted: Mutex<u64>,
}

impl Stub {
    pub(crate) fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().expect("lock").clone()
    }

    /// Requests other than the app's own (`/app/...`) endpoints.
    pub(crate) fn api_requests(&self) -> Vec<Recorded> {
        self.requests().into_iter().filter(|r| !r.path.starts_with("/app/")).collect()
    }

    pub(crate) fn count(&self, method: &str, path: &str) -> usize {
        self.requests().iter().filter(|r| r.method == method && r.path == path).count()
    }
}

/// Records every request before routing it, so handlers only shape responses.
pub(crate) async fn record(State(stub): State<Arc<Stub>>, req: Request, next: Next) -> Response {
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

pub(crate) type Stubbed = State<Arc<Stub>>;

pub(crate) fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({ "message": "Not Found", "documentation_url": "https://docs.github.com/rest" })),
    )
        .into_response()
}

pub(crate) fn user(login: &str) -> Value {
    json!({ "login": login, "id": 1, "node_id": "MDQ6VXNlcjE=", "type": "User", "site_admin": false,
            "url": format!("https://api.github.com/users/{login}") })
}

pub(crate) fn installation(id: u64, login: &str) -> Value {
    json!({
        "id": id, "account": user(login), "app_id": APP_ID, "app_slug": "gpuci", "target_id": 1,
        "target_type": "Organization", "repository_selection": "all", "permissions": { "checks": "write" },
        "events": ["workflow_job"], "single_file_name": null, "created_at": "2018-02-09T20:51:14Z",
        "updated_at": "2018-02-09T20:51:14Z", "suspended_at": null, "suspended_by": null,
        "access_tokens_url": format!("https://api.github.com/app/installations/{id}/access_tokens"),
    })
}

pub(crate) async fn access_tokens(State(stub): Stubbed, Path(installation_id): Path<u64>) -> Response {
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

pub(crate) async fn list_installations() -> Response {
    Json(json!([installation(GPU_LAB_INSTALLATION, "gpu-lab"), installation(8, "other-org")])).into_response()
}

pub(crate) async fn repo_installation(Path((owner, _repo)): Path<(String, String)>) -> Response {
    match owner.as_str() {
        "not-installed" => not_found(),
        "gpu-lab" | "missing" => Json(installation(GPU_LAB_INSTALLATION, &owner)).into_response(),
        _ => Json(installation(9, &owner)).into_response(),
    }
}

pub(crate) fn runner(id: u64, name: &str, labels: &[&str]) -> Value {
    let labels: Vec<Value> =
        labels.iter().enumerate().map(|(i, l)| json!({ "id": i, "name": l, "type": "custom" })).collect();
    json!({ "id": id, "runner_group_id": 1, "name": name, "os": "linux", "status": "online", "busy": false,
            "ephemeral": true, "version": "2.323.0", "labels": labels })
}

pub(crate) fn jitconfig_response(name: Option<String>) -> Response {
    let body = json!({ "runner": runner(23, name.as_deref().unwrap_or("?"), &["self-hosted"]),
                       "encoded_jit_config": "ZW5jb2RlZA==" });
    (StatusCode::CREATED, Json(body)).into_response()
}

pub(crate) async fn generate_jitconfig(
    Path((owner, _repo)): Path<(String, String)>,
    Json(body): Json<Value>,
) -> Response {
    if owner == "missing" {
        return not_found();
    }
    jitconfig_response(body["name"].as_str().map(String::from))
}

pub(crate) async fn generate_org_jitconfig(Json(body): Json<Value>) -> Response {
    jitconfig_response(body["name"].as_str().map(String::from))
}

/// What GitHub sends for a runner that is running a job.
pub(crate) fn runner_busy() -> Response {
    let body = json!({ "message": "Bad request - Runner \"r\" is still running a job\"", "documentation_url": "" });
    (StatusCode::UNPROCESSABLE_ENTITY, Json(body)).into_response()
}

pub(crate) async fn delete_runner(Path((_owner, _repo, runner_id)): Path<(String, String, u64)>) -> Response {
    match runner_id {
        404 => not_found(),
        422 => runner_busy(),
        _ => StatusCode::NO_CONTENT.into_response(),
    }
}

pub(crate) async fn delete_org_runner(Path((_org, runner_id)): Path<(String, u64)>) -> Response {
    if runner_id == 404 {
        return not_found();
    }
    StatusCode::NO_CONTENT.into_response()
}

/// GitHub's `Link` header: page 1 of 2 names `next` and `last`; page 2 names `prev` and `first`.
pub(crate) fn link_header(headers: &HeaderMap, page: u32) -> HeaderValue {
    let host = headers[header::HOST].to_str().expect("host");
    let url = |n: u32| format!("<http://{host}/repositories/1296269/list?per_page=100&page={n}>");
    let value = if page == 1 {
        format!("{}; rel=\"next\", {}; rel=\"last\"", url(2), url(2))
    } else {
        format!("{}; rel=\"prev\", {}; rel=\"first\"", url(1), url(1))
    };
    HeaderValue::from_str(&value).expect("header")
}

pub(crate) fn page_of(query: &Query<Vec<(String, String)>>) -> u32 {
    query.0.iter().find(|(k, _)| k == "page").map_or(1, |(_, v)| v.parse().expect("page number"))
}

pub(crate) fn param<'a>(query: &'a Query<Vec<(String, String)>>, name: &str) -> Option<&'a str> {
    query.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

pub(crate) async fn list_runners(headers: HeaderMap, query: Query<Vec<(String, String)>>) -> Response {
    let page = page_of(&query);
    let runners = if page == 1 {
        vec![runner(1, "gpuci-a", &["self-hosted", "gpu"]), runner(2, "gpuci-b", &["self-hosted"])]
    } else {
        vec![runner(3, "gpuci-c", &["self-hosted", "h100"])]
    };
    ([(header::LINK, link_header(&headers, page))], Json(json!({ "total_count": 3, "runners": runners })))
        .into_response()
}

pub(crate) async fn cancel_run(Path((_owner, _repo, run_id)): Path<(String, String, u64)>) -> Response {
    if run_id == 409 {
        let body = json!({ "message": "Cannot cancel a workflow run that is completed.", "documentation_url": "" });
        return (StatusCode::CONFLICT, Json(body)).into_response();
    }
    (StatusCode::ACCEPTED, Json(json!({}))).into_response()
}

pub(crate) fn minimal_repo(full_name: &str) -> Value {
    let (owner, name) = full_name.split_once('/').expect("full name");
    json!({ "id": 1296269, "node_id": "MDEwOlJlcG9zaXRvcnkxMjk2MjY5", "name": name, "full_name": full_name,
            "owner": user(owner), "private": false, "fork": false,
            "url": format!("https://api.github.com/repos/{full_name}") })
}

pub(crate) fn workflow_run(id: u64, head_sha: &str, event: &str, status: &str, head_repo: Option<&str>) -> Value {
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

pub(crate) async fn list_runs(headers: HeaderMap, query: Query<Vec<(String, String)>>) -> Response {
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

pub(crate) fn job(id: u64, run_id: u64, name: &str, status: &str, runner_name: Option<&str>) -> Value {
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

pub(crate) async fn list_jobs(
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

pub(crate) async fn get_job(Path((_owner, _repo, job_id)): Path<(String, String, u64)>) -> Response {
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

pub(crate) fn check_run(id: u64, body: &Value) -> Value {
    json!({
        "id": id, "head_sha": body["head_sha"].as_str().unwrap_or(SHA), "node_id": "MDg6Q2hlY2tSdW40",
        "external_id": body["external_id"], "url": "", "html_url": "", "details_url": body["details_url"],
        "status": body["status"].as_str().unwrap_or("queued"), "conclusion": body["conclusion"],
        "started_at": "2018-05-04T01:14:52Z", "completed_at": null, "name": body["name"].as_str().unwrap_or("gpu"),
        "output": { "title": null, "summary": null, "text": null, "annotations_count": 0, "annotations_url": "" },
        "check_suite": { "id": 5 }, "app": null, "pull_requests": [],
    })
}

pub(crate) async fn create_check_run(Json(body): Json<Value>) -> Response {
    (StatusCode::CREATED, Json(check_run(4, &body))).into_response()
}

pub(crate) async fn update_check_run(
    Path((_o, _r, id)): Path<(String, String, u64)>,
    Json(body): Json<Value>,
) -> Response {
    Json(check_run(id, &body)).into_response()
}

pub(crate) async fn create_status(Json(body): Json<Value>) -> Response {
    let status = json!({
        "url": "", "avatar_url": null, "id": 1, "node_id": "MDY6U3RhdHVzMQ==", "state": body["state"],
        "description": body["description"], "target_url": body["target_url"], "context": body["context"],
        "created_at": "2012-07-20T01:19:13Z", "updated_at": "2012-07-20T01:19:13Z", "creator": user("gpuci"),
    });
    (StatusCode::CREATED, Json(status)).into_response()
}

pub(crate) async fn remove_label(Path((_o, _r, _n, name)): Path<(String, String, u64, String)>) -> Response {
    if name == "absent" {
        return (StatusCode::NOT_FOUND, Json(json!({ "message": "Label does not exist", "documentation_url": "" })))
            .into_response();
    }
    // GitHub answers with the labels that remain.
    Json(json!([{ "id": 208045946, "node_id": "MDU6TGFiZWwyMDgwNDU5NDY=", "url": "", "name": "bug",
                  "description": "Something isn't working", "color": "f29513", "default": true }]))
    .into_response()
}

pub(crate) async fn collaborator_permission(Path((_o, _r, username)): Path<(String, String, String)>) -> Response {
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
pub(crate) fn gpuci_yml() -> Vec<u8> {
    b"# gpuci pipeline\njobs:\n  test: { gpus: 1 }\n".repeat(4)
}

pub(crate) fn github_base64(bytes: &[u8]) -> String {
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

pub(crate) async fn contents(Path((_o, _r, path)): Path<(String, String, String)>) -> Response {
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
pub(crate) async fn tarball(
    State(codeload): State<String>,
    Path((owner, repo, git_ref)): Path<(String, String, String)>,
) -> Response {
    let location = format!("{codeload}/{owner}/{repo}/legacy.tar.gz/{git_ref}");
    (StatusCode::FOUND, [(header::LOCATION, location)]).into_response()
}

pub(crate) const TARBALL_BYTES: usize = 10_000;

pub(crate) async fn codeload(Path((_o, _r, git_ref)): Path<(String, String, String)>) -> Response {
    let bytes = vec![0x1f_u8; TARBALL_BYTES];
    if git_ref == "chunked" {
        // No Content-Length: the cap must hold while streaming.
        let chunks: Vec<Result<Bytes, std::io::Error>> =
            bytes.chunks(1000).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        return Body::from_stream(futures::stream::iter(chunks)).into_response();
    }
    ([(header::CONTENT_TYPE, "application/x-gzip")], bytes).into_response()
}

pub(crate) async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

pub(crate) struct StandIn {
    pub(crate) base: String,
    pub(crate) github: Arc<Stub>,
    pub(crate) codeload: Arc<Stub>,
}

pub(crate) async fn start_stub() -> StandIn {
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

pub(crate) fn fixture(name: &str) -> String {
    let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One quick retry, and no sitting out GitHub's waits: these tests are about what each answer
/// means (`crates/github-testserver/tests/faults.rs` covers the retries).
pub(crate) fn quick_retry() -> RetryPolicy {
    let ms = std::time::Duration::from_millis;
    RetryPolicy { attempts: 2, base: ms(1), max_backoff: ms(1), max_wait: ms(0), timeout: ms(10_000) }
}

pub(crate) fn app_client(base_url: &str) -> Client {
    let app = AppCredentials::new(APP_ID, &Secret::new(fixture("test-app-key.pem"))).expect("test key");
    Client::new(base_url, Credentials::App(app)).with_retry(quick_retry())
}

pub(crate) fn pat_client(base_url: &str) -> Client {
    Client::new(base_url, Credentials::Token(Secret::new(PAT))).with_retry(quick_retry())
}

pub(crate) fn kernels() -> Repo {
    Repo::parse("gpu-lab/kernels").expect("repo")
}

/// Headers GitHub asks every client to send.
pub(crate) fn assert_github_headers(req: &Recorded) {
    assert_eq!(req.headers["accept"], "application/vnd.github+json", "{req:?}");
    assert_eq!(req.headers["x-github-api-version"], "2022-11-28", "{req:?}");
    assert!(req.headers["user-agent"].to_str().expect("ascii").starts_with("gpuci/"), "{req:?}");
}

pub(crate) fn bearer(req: &Recorded) -> &str {
    let value = req.headers["authorization"].to_str().expect("ascii");
    value.strip_prefix("Bearer ").unwrap_or_else(|| panic!("not a bearer token: {value}"))
}

pub(crate) fn assert_app_jwt(req: &Recorded) {
    let public = jsonwebtoken::DecodingKey::from_rsa_pem(fixture("test-app-key.pub.pem").as_bytes()).expect("key");
    let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::RS256);
    validation.set_issuer(&[APP_ID.to_string()]);
    jsonwebtoken::decode::<Value>(bearer(req), &public, &validation).expect("request carries a valid app JWT");
}

/// Every request the stand-in saw carries GitHub's headers and matches GitHub's description.
pub(crate) fn assert_all_documented(stub: &Stub) {
    let spec = openapi();
    for req in stub.requests() {
        assert_github_headers(&req);
        if let Some(spec) = &spec {
            assert_matches_openapi(spec, &req);
        }
    }
}

pub(crate) fn spec(name: &str) -> JitRunnerSpec {
    JitRunnerSpec { name: name.into(), runner_group_id: 1, labels: vec!["self-hosted".into(), "gpu".into()] }
}

pub(crate) fn new_check_run() -> NewCheckRun {
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

// This file is the stand-in, the clients and the shared checks; the tests are in one module per
// API area, in this one binary.
