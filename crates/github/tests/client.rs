//! The REST client against a tiny GitHub stand-in on 127.0.0.1:0. Requests are recorded and checked
//! against GitHub's published description of each operation (../shared/reference/github, when present).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use gpuci_github::{ApiError, AppCredentials, Client, JitRunnerSpec, Secret};
use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::{Duration, OffsetDateTime};

const APP_ID: u64 = 4711;
/// Installation whose tokens the stand-in makes expire in 2 minutes: inside the refresh margin.
const SHORT_LIVED_INSTALLATION: u64 = 2;

#[derive(Debug, Clone)]
struct Recorded {
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Value,
}

#[derive(Default)]
struct Stub {
    requests: Mutex<Vec<Recorded>>,
}

impl Stub {
    fn record(&self, method: Method, uri: &Uri, headers: HeaderMap, body: &Bytes) -> usize {
        let body = if body.is_empty() { Value::Null } else { serde_json::from_slice(body).unwrap_or(Value::Null) };
        let mut requests = self.requests.lock().expect("lock");
        requests.push(Recorded { method, path: uri.path().to_owned(), headers, body });
        requests.len()
    }

    fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().expect("lock").clone()
    }
}

async fn access_tokens(
    State(stub): State<Arc<Stub>>,
    Path(installation_id): Path<u64>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    let n = stub.record(method, &uri, headers, &body);
    let lifetime = if installation_id == SHORT_LIVED_INSTALLATION { Duration::minutes(2) } else { Duration::hours(1) };
    let expires_at = (OffsetDateTime::now_utc() + lifetime).format(&Rfc3339).expect("format");
    (StatusCode::CREATED, Json(json!({ "token": format!("ghs_test{n}"), "expires_at": expires_at })))
}

async fn generate_jitconfig(
    State(stub): State<Arc<Stub>>,
    Path((owner, _repo)): Path<(String, String)>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    stub.record(method, &uri, headers, &body);
    if owner == "missing" {
        return (StatusCode::NOT_FOUND, Json(json!({ "message": "Not Found" })));
    }
    let name = serde_json::from_slice::<Value>(&body).ok().and_then(|b| b["name"].as_str().map(String::from));
    (
        StatusCode::CREATED,
        Json(json!({
            "runner": { "id": 23, "name": name, "os": "linux", "status": "offline", "busy": false, "labels": [] },
            "encoded_jit_config": "ZW5jb2RlZA==",
        })),
    )
}

async fn start_stub() -> (String, Arc<Stub>) {
    let stub = Arc::new(Stub::default());
    let app = Router::new()
        .route("/app/installations/{installation_id}/access_tokens", post(access_tokens))
        .route("/repos/{owner}/{repo}/actions/runners/generate-jitconfig", post(generate_jitconfig))
        .with_state(stub.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), stub)
}

fn fixture(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn client(base_url: &str) -> Client {
    let app = AppCredentials::new(APP_ID, &Secret::new(fixture("test-app-key.pem"))).expect("test key");
    Client::new(base_url, app)
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

#[tokio::test]
async fn installation_token_is_minted_with_the_app_jwt_and_cached() {
    let (base, stub) = start_stub().await;
    let client = client(&base);

    let first = client.installation_token(99).await.expect("token");
    let second = client.installation_token(99).await.expect("token");
    assert_eq!(first.expose(), "ghs_test1");
    assert_eq!(second.expose(), "ghs_test1", "second call must come from the cache");

    let requests = stub.requests();
    assert_eq!(requests.len(), 1);
    let req = &requests[0];
    assert_eq!((req.method.as_str(), req.path.as_str()), ("POST", "/app/installations/99/access_tokens"));
    assert_github_headers(req);
    let public = jsonwebtoken::DecodingKey::from_rsa_pem(fixture("test-app-key.pub.pem").as_bytes()).expect("key");
    let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::RS256);
    validation.set_issuer(&[APP_ID.to_string()]);
    jsonwebtoken::decode::<Value>(bearer(req), &public, &validation).expect("request carries a valid app JWT");
    assert_matches_openapi(req, "/app/installations/{installation_id}/access_tokens");
}

#[tokio::test]
async fn token_close_to_expiry_is_refreshed() {
    let (base, stub) = start_stub().await;
    let client = client(&base);
    let first = client.installation_token(SHORT_LIVED_INSTALLATION).await.expect("token");
    let second = client.installation_token(SHORT_LIVED_INSTALLATION).await.expect("token");
    assert_ne!(first.expose(), second.expose());
    assert_eq!(stub.requests().len(), 2);
}

#[tokio::test]
async fn generate_jitconfig_sends_the_documented_request() {
    let (base, stub) = start_stub().await;
    let client = client(&base);
    let spec = JitRunnerSpec {
        name: "gpuci-job-17-a".into(),
        runner_group_id: 1,
        labels: vec!["self-hosted".into(), "gpu".into()],
    };
    let jit = client.generate_jitconfig(7, "gpu-lab", "kernels", &spec).await.expect("jit config");
    assert_eq!(jit.runner_id, 23);
    assert_eq!(jit.runner_name, "gpuci-job-17-a");
    assert_eq!(jit.encoded_jit_config.expose(), "ZW5jb2RlZA==");
    assert_eq!(format!("{:?}", jit.encoded_jit_config), "***");

    let requests = stub.requests();
    assert_eq!(requests.len(), 2, "one token, one JIT config: {requests:?}");
    let req = &requests[1];
    assert_eq!(
        (req.method.as_str(), req.path.as_str()),
        ("POST", "/repos/gpu-lab/kernels/actions/runners/generate-jitconfig")
    );
    assert_github_headers(req);
    assert_eq!(bearer(req), "ghs_test1", "JIT config must use the installation token, not the app JWT");
    assert_eq!(req.body, json!({ "name": "gpuci-job-17-a", "runner_group_id": 1, "labels": ["self-hosted", "gpu"] }));
    assert_matches_openapi(req, "/repos/{owner}/{repo}/actions/runners/generate-jitconfig");
}

#[tokio::test]
async fn http_errors_are_typed_and_not_transient() {
    let (base, _stub) = start_stub().await;
    let client = client(&base);
    let spec = JitRunnerSpec { name: "r".into(), runner_group_id: 1, labels: vec!["gpu".into()] };
    let err = client.generate_jitconfig(7, "missing", "repo", &spec).await.expect_err("404");
    assert!(matches!(err, ApiError::Status { status: StatusCode::NOT_FOUND, .. }), "{err:?}");
    assert!(!err.is_transient());
    assert!(err.to_string().contains("generate JIT runner config") && err.to_string().contains("Not Found"), "{err}");
}

#[tokio::test]
async fn unreachable_github_is_transient() {
    // Bind then drop a listener so the port is (almost certainly) closed.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let err = client(&format!("http://{addr}")).installation_token(1).await.expect_err("refused");
    assert!(matches!(err, ApiError::Transport { .. }) && err.is_transient(), "{err:?}");
}

/// Checks a recorded request against its operation in GitHub's OpenAPI description: the path template
/// has a `post` operation and the JSON body satisfies the request schema (required fields, types,
/// array bounds). Skipped, with a message, where ../shared is absent.
fn assert_matches_openapi(req: &Recorded, template: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/reference/github/github-openapi-gpuci-subset.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipping OpenAPI check: {} not found", path.display());
        return;
    };
    let spec: Value = serde_json::from_str(&text).expect("OpenAPI JSON");
    let op = &spec["paths"][template][req.method.as_str().to_lowercase()];
    assert!(op.is_object(), "{} {template} is not in GitHub's description", req.method);
    let request_body = &op["requestBody"];
    if request_body.is_null() {
        return;
    }
    let schema = &request_body["content"]["application/json"]["schema"];
    if request_body["required"] == json!(true) || !req.body.is_null() {
        let mut errors = Vec::new();
        validate(&spec, schema, &req.body, "body", &mut errors);
        assert!(errors.is_empty(), "{} {template}: {errors:?}", req.method);
    }
}

/// The small part of JSON Schema that GitHub's request bodies for these operations use.
fn validate(spec: &Value, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
    if let Some(reference) = schema["$ref"].as_str() {
        let target = reference.trim_start_matches("#/").split('/').fold(spec, |node, key| &node[key]);
        return validate(spec, target, value, at, errors);
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
fn openapi_check_catches_a_bad_body() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/reference/github/github-openapi-gpuci-subset.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipping: {} not found", path.display());
        return;
    };
    let spec: Value = serde_json::from_str(&text).expect("OpenAPI JSON");
    let schema = &spec["paths"]["/repos/{owner}/{repo}/actions/runners/generate-jitconfig"]["post"]["requestBody"]
        ["content"]["application/json"]["schema"];
    let mut errors = Vec::new();
    validate(&spec, schema, &json!({ "name": 5, "runner_group_id": 1, "labels": [] }), "body", &mut errors);
    assert_eq!(errors.len(), 2, "{errors:?}");
}
