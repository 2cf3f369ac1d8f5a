//! The REST API against its own OpenAPI document (`/api/v1/openapi.json`): the document is
//! well formed, names every route the router serves, and what the server answers — status,
//! content type and body — is what the document says. Malformed requests never get a 5xx.
//! (`scripts/api-fuzz.sh` runs schemathesis for a deeper, slower search; this test is the
//! bounded version that CI runs.)
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use reqwest::blocking::{Client, RequestBuilder, Response};
use reqwest::Method;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const METHODS: [&str; 5] = ["get", "post", "put", "delete", "patch"];

fn client() -> Client {
    // A request that hangs (a stream that never ends) fails the test instead of blocking it.
    Client::builder().timeout(Duration::from_secs(20)).build().expect("client")
}

fn read_token(server: &Server) -> String {
    std::fs::read_to_string(server.data_dir.join("read-token")).expect("read-only token").trim().to_string()
}

fn fetch_doc(server: &Server) -> Value {
    let r = client().get(format!("{}/api/v1/openapi.json", server.url)).send().expect("openapi.json");
    assert_eq!(r.status(), 200);
    r.json().expect("the document is JSON")
}

/// Every `"$ref"` in `v`, with where it was found.
fn refs<'a>(v: &'a Value, at: &str, out: &mut Vec<(String, &'a str)>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if k == "$ref" {
                    if let Some(s) = x.as_str() {
                        out.push((at.to_string(), s));
                    }
                } else {
                    refs(x, &format!("{at}/{k}"), out);
                }
            }
        }
        Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| refs(x, &format!("{at}/{i}"), out)),
        _ => {}
    }
}

/// `(method, path)` of every route in the coordinator's router, read from its source so that a
/// new route cannot be added without this test seeing it.
fn router_routes() -> BTreeSet<(String, String)> {
    let src = std::fs::read_to_string(format!(
        "{}/../coordinator/src/lib.rs",
        std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")
    ))
    .expect("coordinator lib.rs");
    let body = &src[src.find("pub fn router(").expect("fn router")..];
    let body = &body[..body.find("\n}\n").expect("end of fn router")];
    let mut routes = BTreeSet::new();
    for chunk in body.split(".route(\"").skip(1) {
        let path = &chunk[..chunk.find('"').expect("route path")];
        // The method routers up to the end of this `.route(...)`.
        let mut depth = 1;
        let mut end = chunk.len();
        for (i, c) in chunk.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let handlers = &chunk[..end];
        for m in METHODS {
            let found = handlers
                .match_indices(&format!("{m}("))
                .any(|(i, _)| i == 0 || !handlers[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_'));
            if found {
                routes.insert((m.to_string(), path.to_string()));
            }
        }
    }
    routes
}

/// A validator for `schema`, resolving `#/components/...` against the document.
fn validator(doc: &Value, schema: &Value) -> jsonschema::Validator {
    let mut root = schema.as_object().cloned().unwrap_or_default();
    root.insert("components".into(), doc["components"].clone());
    jsonschema::draft202012::new(&Value::Object(root)).unwrap_or_else(|e| panic!("bad schema {schema}: {e}"))
}

fn operation<'a>(doc: &'a Value, method: &str, template: &str) -> &'a Value {
    let op = &doc["paths"][template][method];
    assert!(op.is_object(), "{} {template} is not in the document", method.to_uppercase());
    op
}

/// Check one answer against the document: its status is documented for the operation, its
/// content type is one documented for that status, and its body matches the schema (every
/// line, for NDJSON). Returns the body.
fn conforms(doc: &Value, method: &str, template: &str, r: Response) -> (u16, String) {
    let what = format!("{} {template}", method.to_uppercase());
    let status = r.status().as_u16();
    let ctype = r
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or_default().trim().to_string());
    let body = r.text().expect("body");
    let op = operation(doc, method, template);
    let resp = op["responses"].get(status.to_string()).or_else(|| op["responses"].get("default"));
    let resp = resp.unwrap_or_else(|| {
        panic!("{what}: status {status} is not documented (documented: {:?}); body: {body}", op["responses"])
    });
    let Some(content) = resp["content"].as_object() else {
        assert!(body.is_empty(), "{what} {status}: no content documented, got {body:?}");
        return (status, body);
    };
    let ctype = ctype.unwrap_or_else(|| panic!("{what} {status}: no content type; body {body:?}"));
    let media = content.get(&ctype).unwrap_or_else(|| {
        panic!("{what} {status}: content type {ctype} is not documented ({:?})", content.keys().collect::<Vec<_>>())
    });
    let Some(schema) = media.get("schema") else { return (status, body) };
    let v = validator(doc, schema);
    let instances: Vec<&str> = match ctype.as_str() {
        "application/json" => vec![body.as_str()],
        "application/x-ndjson" => body.lines().collect(),
        _ => vec![],
    };
    for text in instances {
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{what} {status}: {e}: {text}"));
        let errors: Vec<String> = v.iter_errors(&value).map(|e| format!("{}: {e}", e.instance_path)).collect();
        assert!(
            errors.is_empty(),
            "{what} {status}: the body does not match its schema:\n{}\n{text}",
            errors.join("\n")
        );
    }
    (status, body)
}

#[test]
fn the_document_is_openapi_3_and_names_every_route() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let doc = fetch_doc(&server);

    // The shape of an OpenAPI 3 document.
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "openapi: {}", doc["openapi"]);
    assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
    let paths = doc["paths"].as_object().expect("paths");
    let schemes = doc["components"]["securitySchemes"].as_object().expect("securitySchemes");
    let mut operation_ids = BTreeSet::new();
    for (path, item) in paths {
        assert!(path.starts_with('/'), "path {path}");
        let item = item.as_object().expect("path item");
        for (method, op) in item {
            assert!(METHODS.contains(&method.as_str()), "{path}: unexpected key {method}");
            let what = format!("{} {path}", method.to_uppercase());
            let id = op["operationId"].as_str().unwrap_or_else(|| panic!("{what}: no operationId"));
            assert!(operation_ids.insert(id.to_string()), "{what}: duplicate operationId {id}");
            let responses = op["responses"].as_object().expect("responses");
            assert!(!responses.is_empty(), "{what}: no responses");
            for (code, r) in responses {
                assert!(
                    code == "default" || code.parse::<u16>().is_ok_and(|c| (100..600).contains(&c)),
                    "{what}: status {code}"
                );
                assert!(r["description"].is_string(), "{what} {code}: a response needs a description");
            }
            // Path parameters: each `{name}` declared once, in the path, required.
            let params = op["parameters"].as_array().cloned().unwrap_or_default();
            for p in &params {
                let place = p["in"].as_str().unwrap_or_default();
                assert!(["path", "query", "header", "cookie"].contains(&place), "{what}: parameter in {place:?}");
                let name = p["name"].as_str().expect("parameter name");
                if place == "path" {
                    assert!(path.contains(&format!("{{{name}}}")), "{what}: path parameter {name} not in the path");
                    assert_eq!(p["required"], true, "{what}: path parameter {name} must be required");
                }
            }
            for seg in path.split('/').filter(|s| s.starts_with('{')) {
                let name = seg.trim_start_matches('{').trim_end_matches('}');
                assert!(
                    params.iter().any(|p| p["in"] == "path" && p["name"] == name),
                    "{what}: path parameter {name} is not declared"
                );
            }
            // Security requirements name known schemes; operations that need a token document 401.
            let security = op.get("security").unwrap_or(&doc["security"]);
            let mut needs_token = false;
            for req in security.as_array().expect("security") {
                for scheme in req.as_object().expect("security requirement").keys() {
                    assert!(schemes.contains_key(scheme), "{what}: unknown security scheme {scheme}");
                    needs_token = true;
                }
            }
            if needs_token {
                assert!(responses.contains_key("401"), "{what} needs a token but documents no 401");
            }
        }
    }
    // Every reference resolves inside the document, and every schema is a valid JSON Schema.
    let mut found = Vec::new();
    refs(&doc, "#", &mut found);
    for (at, r) in found {
        let target = r.strip_prefix('#').and_then(|p| doc.pointer(p));
        assert!(target.is_some(), "{at}: dangling $ref {r}");
    }
    for (name, schema) in doc["components"]["schemas"].as_object().expect("schemas") {
        assert!(jsonschema::meta::is_valid(schema), "schema {name} is not a valid JSON Schema: {schema}");
    }

    // Every route of the router is documented, with the method it is served on.
    let routes = router_routes();
    assert!(routes.len() >= 14, "could not read the routes from lib.rs: {routes:?}");
    for (method, path) in &routes {
        assert!(
            doc["paths"][path][method].is_object(),
            "{} {path} is served but not in the document",
            method.to_uppercase()
        );
    }
    // ...and the document names nothing that is not served.
    for (path, item) in paths {
        for method in item.as_object().into_iter().flat_map(|m| m.keys()) {
            assert!(
                routes.contains(&(method.clone(), path.clone())),
                "{} {path} is documented but not routed",
                method.to_uppercase()
            );
        }
    }
}

#[test]
fn real_answers_match_the_documented_responses() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--simulate-gpus", "2xH100-80GB", "--isolation", isolation()],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let doc = fetch_doc(&server);
    let http = client();
    let url = &server.url;
    let auth = |r: RequestBuilder| r.bearer_auth(&server.token);

    let p = api.submit(
        "steps:\n  - key: gpu\n    gpus: 1\n    command: echo on the gpu\n  - key: fail\n    depends_on: [gpu]\n    command: echo out; echo err >&2; exit 3\n  - key: never\n    depends_on: [fail]\n    command: echo never\n",
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "failed", "{done:#?}");
    let job = done.jobs[0].id;

    let get = |path: &str| auth(http.get(format!("{url}{path}"))).send().expect("get");
    let cases: Vec<(&str, &str, Response, u16)> = vec![
        ("get", "/healthz", http.get(format!("{url}/healthz")).send().unwrap(), 200),
        ("get", "/api/v1/openapi.json", http.get(format!("{url}/api/v1/openapi.json")).send().unwrap(), 200),
        (
            "get",
            "/api/v1/identity",
            http.get(format!("{url}/api/v1/identity?nonce={}", "ab".repeat(32))).send().unwrap(),
            200,
        ),
        ("get", "/api/v1/identity", http.get(format!("{url}/api/v1/identity?nonce=xyz")).send().unwrap(), 400),
        ("get", "/api/v1/jobs/{id}", get(&format!("/api/v1/jobs/{job}")), 200),
        ("get", "/api/v1/jobs/{id}", get("/api/v1/jobs/999999"), 404),
        ("get", "/api/v1/jobs/{id}", get("/api/v1/jobs/-1"), 404),
        ("get", "/api/v1/jobs/{id}", get("/api/v1/jobs/99999999999999999999"), 400),
        ("get", "/api/v1/jobs/{id}", http.get(format!("{url}/api/v1/jobs/{job}")).send().unwrap(), 401),
        ("get", "/api/v1/jobs", get("/api/v1/jobs"), 200),
        ("get", "/api/v1/jobs", get(&format!("/api/v1/jobs?state=failed,skipped&pipeline={}&limit=2", p.id)), 200),
        ("get", "/api/v1/jobs", get("/api/v1/jobs?state=bogus"), 400),
        ("get", "/api/v1/jobs", get("/api/v1/jobs?limit=-1"), 400),
        ("get", "/api/v1/jobs/{id}/logs", get(&format!("/api/v1/jobs/{}/logs", done.jobs[1].id)), 200),
        ("get", "/api/v1/jobs/{id}/logs", get(&format!("/api/v1/jobs/{job}/logs?follow=true&after=0")), 200),
        ("get", "/api/v1/jobs/{id}/logs", get(&format!("/api/v1/jobs/{job}/logs?follow=perhaps")), 400),
        ("get", "/api/v1/jobs/{id}/logs", get("/api/v1/jobs/0/logs"), 404),
        ("get", "/api/v1/pipelines/{id}", get(&format!("/api/v1/pipelines/{}", p.id)), 200),
        ("get", "/api/v1/pipelines/{id}", get("/api/v1/pipelines/abc"), 400),
        ("get", "/api/v1/pipelines/{id}/watch", get(&format!("/api/v1/pipelines/{}/watch", p.id)), 200),
        ("get", "/api/v1/pipelines/{id}/watch", get("/api/v1/pipelines/-9223372036854775808/watch"), 404),
        ("get", "/api/v1/agents", get("/api/v1/agents"), 200),
        (
            "post",
            "/api/v1/jobs/{id}/cancel",
            auth(http.post(format!("{url}/api/v1/jobs/{job}/cancel"))).send().unwrap(),
            409,
        ),
        (
            "post",
            "/api/v1/jobs/{id}/cancel",
            auth(http.post(format!("{url}/api/v1/jobs/{job}/cancel")).json(&json!({"reason": 5}))).send().unwrap(),
            400,
        ),
        (
            "post",
            "/api/v1/jobs/{id}/cancel",
            auth(http.post(format!("{url}/api/v1/jobs/77/cancel"))).send().unwrap(),
            404,
        ),
        (
            "post",
            "/api/v1/pipelines",
            auth(http.post(format!("{url}/api/v1/pipelines")))
                .json(&json!({"file_name": "x.yml", "source": "steps:\n  - comand: x\n"}))
                .send()
                .unwrap(),
            422,
        ),
        (
            "post",
            "/api/v1/pipelines",
            auth(http.post(format!("{url}/api/v1/pipelines")))
                .json(&json!({"file_name": "x.yml", "source": "steps: []", "env": {"1BAD": "x"}}))
                .send()
                .unwrap(),
            422,
        ),
        (
            "post",
            "/api/v1/pipelines",
            // A control character in the file name (it is shown in errors and listings).
            auth(http.post(format!("{url}/api/v1/pipelines")))
                .json(&json!({"file_name": "x\u{0}.yml\u{1b}[31m", "source": "steps:\n  - command: env\n"}))
                .send()
                .unwrap(),
            422,
        ),
        (
            "post",
            "/api/v1/pipelines",
            auth(http.post(format!("{url}/api/v1/pipelines"))).body("{").send().unwrap(),
            400,
        ),
        (
            "post",
            "/api/v1/gpus/{uuid}/release",
            auth(http.post(format!("{url}/api/v1/gpus/GPU-x/release"))).send().unwrap(),
            409,
        ),
        (
            "post",
            "/api/v1/agents/register",
            http.post(format!("{url}/api/v1/agents/register"))
                .bearer_auth(server.registration_token())
                .json(&json!({"name": "doc-check"}))
                .send()
                .unwrap(),
            201,
        ),
        (
            "post",
            "/api/v1/agents/register",
            auth(http.post(format!("{url}/api/v1/agents/register"))).json(&json!({"name": "x"})).send().unwrap(),
            401,
        ),
        (
            "post",
            "/api/v1/agents/register",
            http.post(format!("{url}/api/v1/agents/register"))
                .bearer_auth(server.registration_token())
                .json(&json!({"name": "\u{7}"}))
                .send()
                .unwrap(),
            422,
        ),
        ("get", "/api/v1/agents/connect", http.get(format!("{url}/api/v1/agents/connect")).send().unwrap(), 400),
        ("get", "/api/v1/secrets", get("/api/v1/secrets"), 200),
        (
            "post",
            "/api/v1/tokens",
            auth(http.post(format!("{url}/api/v1/tokens"))).json(&json!({"name": "doc-bot"})).send().unwrap(),
            201,
        ),
        ("get", "/api/v1/tokens", get("/api/v1/tokens"), 200),
        ("get", "/api/v1/audit", get("/api/v1/audit?since=1d&action=token"), 200),
        ("get", "/api/v1/audit", get("/api/v1/audit?since=yesterday"), 400),
        (
            "get",
            "/api/v1/audit",
            http.get(format!("{url}/api/v1/audit")).bearer_auth(read_token(&server)).send().unwrap(),
            403,
        ),
        (
            "delete",
            "/api/v1/tokens/{name}",
            auth(http.delete(format!("{url}/api/v1/tokens/nope"))).send().unwrap(),
            404,
        ),
    ];
    let mut bodies = Vec::new();
    for (method, template, r, want) in cases {
        let (status, body) = conforms(&doc, method, template, r);
        assert_eq!(status, want, "{} {template}: {body}", method.to_uppercase());
        bodies.push((template, status, body));
    }
    // The bodies carried what this pipeline made: a leased GPU, logs on both streams, the end.
    let job_body = &bodies.iter().find(|(t, s, _)| *t == "/api/v1/jobs/{id}" && *s == 200).unwrap().2;
    let j: Value = serde_json::from_str(job_body).unwrap();
    assert_eq!(j["gpus"].as_array().map(Vec::len), Some(1), "{j}");
    let logs = &bodies.iter().find(|(t, s, _)| *t == "/api/v1/jobs/{id}/logs" && *s == 200).unwrap().2;
    assert!(logs.contains("\"stderr\"") && logs.lines().last().is_some_and(|l| l.contains("\"end\"")), "{logs}");
    let watch = &bodies.iter().find(|(t, s, _)| *t == "/api/v1/pipelines/{id}/watch" && *s == 200).unwrap().2;
    assert!(watch.lines().last().is_some_and(|l| l.contains("\"done\"")), "{watch}");
    let agents = &bodies.iter().find(|(t, _, _)| *t == "/api/v1/agents").unwrap().2;
    assert!(agents.contains("H100"), "{agents}");
}

#[test]
fn malformed_requests_never_get_a_5xx() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let doc = fetch_doc(&server);
    // A fresh connection per request: the server closes one whose large body it did not read.
    let http = Client::builder().timeout(Duration::from_secs(20)).pool_max_idle_per_host(0).build().expect("client");
    let odd_segments = [
        "-1",
        "0",
        "9223372036854775807",
        "-9223372036854775808",
        "9223372036854775808",
        "99999999999999999999999999",
        "1e3",
        "0x10",
        "abc",
        "%FF%FE",
        "%00",
        "%2F..%2F",
        "%20",
        &"9".repeat(5000),
    ];
    let odd_queries = [
        "",
        "?",
        "?limit=-1",
        "?limit=99999999999",
        "?limit=abc",
        "?state=,,,",
        "?state=queued,nope",
        "?pipeline=-5&limit=0",
        "?pipeline=1.5",
        "?follow=2&after=x",
        "?after=-9223372036854775808",
        "?unknown=1&limit=1&limit=2",
        "?%FF=%FE",
    ];
    let nested = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let deep_yaml = json!({"file_name": "deep.yml", "source": "[".repeat(100_000)}).to_string();
    let big = json!({"file_name": "big.yml", "source": "x".repeat(4 << 20)}).to_string();
    let odd_bodies: Vec<(Option<&str>, String)> = vec![
        (None, String::new()),
        (Some("application/json"), String::new()),
        (Some("application/json"), "null".into()),
        (Some("application/json"), "{".into()),
        (Some("application/json"), "[]".into()),
        (Some("application/json"), "\"\\ud800\"".into()),
        (Some("application/json"), json!({"file_name": 1, "source": [], "reason": {}, "name": null}).to_string()),
        (Some("application/json"), json!({"file_name": "", "source": "", "env": {"": "\u{0}"}}).to_string()),
        (Some("application/json"), json!({"file_name": "a", "source": "steps: [", "env": {"A": "\u{0}"}}).to_string()),
        (Some("application/json"), json!({"name": "x".repeat(1000), "value": ""}).to_string()),
        (Some("application/json"), nested),
        (Some("application/json"), deep_yaml),
        (Some("application/json"), big),
        (Some("text/plain"), "{\"reason\": \"x\"}".into()),
        (Some("application/json; charset=latin1"), "{\"reason\": \"\u{e9}\"}".into()),
        (Some("application/x-www-form-urlencoded"), "a=b".into()),
    ];

    let mut checked = 0;
    let mut check = |what: String, r: reqwest::Result<Response>| {
        let r = match r {
            Ok(r) => r,
            // A server that answers (401, 413) before reading a large body may close the
            // connection while the client still sends it; that is no failure of the server.
            Err(e) if what.contains(" MiB") && (e.is_request() || e.is_body()) => return,
            Err(e) => panic!("{what}: no answer: {e:?}"),
        };
        let status = r.status();
        let body = r.text().unwrap_or_default();
        assert!(!status.is_server_error(), "{what}: {status}: {body}");
        checked += 1;
    };
    for (template, item) in doc["paths"].as_object().expect("paths") {
        if template == "/api/v1/agents/connect" {
            continue; // a WebSocket upgrade; checked below
        }
        let has_param = template.contains('{');
        let segments: Vec<&str> = if has_param { odd_segments.to_vec() } else { vec![""] };
        for seg in &segments {
            let path = if has_param {
                let start = template.find('{').unwrap();
                let end = template.find('}').unwrap();
                format!("{}{seg}{}", &template[..start], &template[end + 1..])
            } else {
                template.clone()
            };
            // Documented methods with odd queries; wrong methods too.
            for method in ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"] {
                let documented = item.get(method.to_lowercase()).is_some();
                let queries: &[&str] = if documented { &odd_queries } else { &[""] };
                for q in queries {
                    let m = Method::from_bytes(method.as_bytes()).unwrap();
                    let r = http.request(m, format!("{}{path}{q}", server.url)).bearer_auth(&server.token).send();
                    check(format!("{method} {path}{q}"), r);
                }
            }
            // Odd bodies on the documented methods that take one, with each token.
            for method in ["post", "put"].into_iter().filter(|m| item.get(*m).is_some()) {
                if has_param && !["-1", "abc", "%FF%FE"].contains(seg) {
                    continue;
                }
                for token in [server.token.clone(), server.registration_token()] {
                    for (ctype, body) in &odd_bodies {
                        let m = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
                        let mut req = http.request(m, format!("{}{path}", server.url)).bearer_auth(&token);
                        if let Some(c) = ctype {
                            req = req.header("content-type", *c);
                        }
                        let r = req.body(body.clone()).send();
                        let size = if body.len() > 1 << 20 {
                            format!("{} MiB", body.len() >> 20)
                        } else {
                            format!("{} bytes", body.len())
                        };
                        check(format!("{} {path} ({ctype:?}, {size})", method.to_uppercase()), r);
                    }
                }
            }
        }
    }
    // Odd headers: broken tokens, the agent channel without a WebSocket or with a bad agent id.
    for token in ["", "Bearer", "Bearer ", "Basic abc", "Bearer \u{e9}", &format!("Bearer {}", "x".repeat(10_000))] {
        let r = http.get(format!("{}/api/v1/jobs", server.url)).header("authorization", token).send();
        check(format!("GET /api/v1/jobs with Authorization {:.20?}", token), r);
    }
    for agent in ["", "nope", "%00", &"a".repeat(5000)] {
        let r = http
            .get(format!("{}/api/v1/agents/connect", server.url))
            .header("x-gpuci-agent-id", agent)
            .header("connection", "upgrade")
            .header("upgrade", "websocket")
            .header("sec-websocket-version", "13")
            .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
            .bearer_auth("gpuci_agent_nope")
            .send();
        check(format!("GET /api/v1/agents/connect as agent {agent:.20?}"), r);
    }
    assert!(checked > 500, "only {checked} requests were checked");
    // And the server is still there.
    let r = http.get(format!("{}/healthz", server.url)).send().expect("healthz");
    assert_eq!(r.status(), 200);
}
