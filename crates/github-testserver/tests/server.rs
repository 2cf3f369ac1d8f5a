//! The test server driven the way gpuci's integration tests drive it: through gpuci's own GitHub
//! client, plain HTTP, a webhook receiver that verifies and parses with gpuci-github, and the fake
//! runner's run.sh.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::HeaderMap;
use gpuci_github::{AppCredentials, Event, Secret, WorkflowJobAction};
use gpuci_github_testserver::{install_fake_runner, Options, TestGitHub};
use serde_json::{json, Value};

const SECRET: &str = "webhook-secret";
const APP_ID: u64 = 4242;
const PAT: &str = "ghp_personal_test";

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/../github/tests/fixtures/{name}",
        std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

async fn server() -> TestGitHub {
    let gh = TestGitHub::start(Options {
        webhook_url: None,
        webhook_secret: SECRET.into(),
        app_id: APP_ID,
        app_public_key_pem: Some(fixture("test-app-key.pub.pem")),
        personal_token: Some(PAT.into()),
        reference: None,
    })
    .await;
    gh.add_repo("octo/gpu", 7);
    gh.add_repo("other/thing", 8);
    gh
}

fn app() -> AppCredentials {
    AppCredentials::new(APP_ID, &Secret::new(fixture("test-app-key.pem"))).expect("test key")
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .user_agent("gpuci-testserver-tests")
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
}

fn jwt(app: &AppCredentials) -> String {
    format!("Bearer {}", app.app_jwt(time::OffsetDateTime::now_utc()).expect("jwt"))
}

/// Mints an installation token the way gpuci does: App JWT → `POST .../access_tokens`.
async fn installation_token(gh: &TestGitHub, app: &AppCredentials, installation: u64) -> Result<String, u16> {
    let r = http()
        .post(format!("{}/app/installations/{installation}/access_tokens", gh.url))
        .header("authorization", jwt(app))
        .header("accept", "application/vnd.github+json")
        .json(&json!({}))
        .send()
        .await
        .expect("send");
    if r.status() != 201 {
        return Err(r.status().as_u16());
    }
    let body: Value = r.json().await.expect("json");
    assert!(time::OffsetDateTime::parse(
        body["expires_at"].as_str().expect("expires_at"),
        &time::format_description::well_known::Rfc3339
    )
    .is_ok());
    Ok(body["token"].as_str().expect("token").to_owned())
}

async fn jit(gh: &TestGitHub, auth: &str, name: &str) -> reqwest::Response {
    http()
        .post(format!("{}/repos/octo/gpu/actions/runners/generate-jitconfig", gh.url))
        .header("authorization", auth)
        .json(&json!({ "name": name, "runner_group_id": 1, "labels": ["gpu", "a100"] }))
        .send()
        .await
        .expect("send")
}

/// Polls `check` every 50 ms until it holds or `secs` pass.
async fn eventually(what: &str, secs: u64, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn assert_clean(gh: &TestGitHub) {
    let errs = gh.validation_errors();
    assert!(errs.is_empty(), "validation errors:\n{}", errs.join("\n"));
}

/// (event, delivery id, what gpuci-github made of it).
type Received = (String, String, Result<Event, String>);

/// A webhook receiver that checks signatures and parses payloads with gpuci-github, as gpuci does.
#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    async fn start(&self) -> String {
        let got = self.got.clone();
        let app = axum::Router::new().route(
            "/webhook",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let got = got.clone();
                async move {
                    let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
                    let (event, delivery) = (h("x-github-event"), h("x-github-delivery"));
                    assert_eq!(h("user-agent"), "GitHub-Hookshot/test");
                    assert_eq!(h("content-type"), "application/json");
                    let sig = headers.get("x-hub-signature-256").and_then(|v| v.to_str().ok());
                    if gpuci_github::verify_signature(SECRET.as_bytes(), &body, sig).is_err() {
                        got.lock().expect("lock").push((event, delivery, Err("bad signature".into())));
                        return axum::http::StatusCode::UNAUTHORIZED;
                    }
                    let parsed = gpuci_github::parse_event(&event, &delivery, &body).map_err(|e| e.to_string());
                    let ok = parsed.is_ok();
                    got.lock().expect("lock").push((event, delivery, parsed));
                    if ok {
                        axum::http::StatusCode::OK
                    } else {
                        axum::http::StatusCode::BAD_REQUEST
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/webhook", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
        url
    }

    fn events(&self) -> Vec<Received> {
        self.got.lock().expect("lock").clone()
    }

    fn job_actions(&self, job_id: u64) -> Vec<WorkflowJobAction> {
        self.events()
            .into_iter()
            .filter_map(|(_, _, e)| match e {
                Ok(Event::WorkflowJob(w)) if w.job_id == job_id => Some(w.action),
                _ => None,
            })
            .collect()
    }
}

#[tokio::test]
async fn app_gets_a_token_and_registers_a_runner() {
    let gh = server().await;
    let token = installation_token(&gh, &app(), 7).await.expect("token");
    assert!(token.starts_with("ghs_test_"));
    let auth = format!("Bearer {token}");
    let r = jit(&gh, &auth, "gpuci-1").await;
    assert_eq!(r.status(), 201);
    let body: Value = r.json().await.expect("json");
    assert_eq!(body["runner"]["name"], "gpuci-1");
    assert!(body["encoded_jit_config"].is_string());
    assert_eq!(jit(&gh, &auth, "gpuci-1").await.status(), 409);
    let runners = gh.runners();
    assert_eq!(runners.len(), 1);
    assert_eq!(runners[0].labels, ["gpu", "a100"]);
    assert_eq!((runners[0].repo.as_str(), runners[0].runner_group_id, runners[0].deleted), ("octo/gpu", 1, false));
    assert_clean(&gh);
}

#[tokio::test]
async fn operations_answer_like_github_and_validate_cleanly() {
    let gh = server().await;
    let http = http();
    let token = installation_token(&gh, &app(), 7).await.expect("token");
    let auth = format!("Bearer {token}");
    let api = |p: &str| format!("{}{p}", gh.url);

    // Runners: org variant, list, delete.
    let r = http
        .post(api("/orgs/octo/actions/runners/generate-jitconfig"))
        .header("authorization", &auth)
        .json(&json!({ "name": "org-runner", "runner_group_id": 1, "labels": ["gpu"] }))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 201);
    let body: Value = r.json().await.expect("json");
    let runner_id = body["runner"]["id"].as_u64().expect("id");
    let list: Value = http
        .get(api("/orgs/octo/actions/runners"))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(list["total_count"], 1);
    let r = http
        .delete(api(&format!("/orgs/octo/actions/runners/{runner_id}")))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 204);
    assert!(gh.runners()[0].deleted);
    let groups =
        http.get(api("/orgs/octo/actions/runner-groups")).header("authorization", &auth).send().await.expect("send");
    assert_eq!(groups.status(), 200);

    // Runs and jobs, with pagination.
    gh.set_tree(
        "octo/gpu",
        "1111111aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        &[(".gpuci.yml", "pool: gpu\n"), ("src/a.py", "print(1)\n")],
    );
    let mut queued = Vec::new();
    for _ in 0..3 {
        queued.push(gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await);
    }
    assert_eq!(queued[0].head_sha, "1111111aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa");
    let r = http
        .get(api("/repos/octo/gpu/actions/runs?status=queued&per_page=2&page=1"))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send");
    let link = r.headers().get("link").and_then(|v| v.to_str().ok()).expect("Link header").to_owned();
    assert!(link.contains("rel=\"next\"") && link.contains("page=2") && link.contains(&gh.url), "{link}");
    let page: Value = r.json().await.expect("json");
    assert_eq!(page["total_count"], 3);
    assert_eq!(page["workflow_runs"].as_array().map(Vec::len), Some(2));
    let by_sha: Value = http
        .get(api("/repos/octo/gpu/actions/runs?head_sha=nope"))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(by_sha["total_count"], 0);
    let q = &queued[0];
    let jobs: Value = http
        .get(api(&format!("/repos/octo/gpu/actions/runs/{}/jobs", q.run_id)))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(jobs["jobs"][0]["id"], q.job_id);
    let job: Value = http
        .get(api(&format!("/repos/octo/gpu/actions/jobs/{}", q.job_id)))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(job["status"], "queued");
    assert!(job["runner_name"].is_null());

    // Cancel: 202, every job cancelled, then 409.
    let cancel = api(&format!("/repos/octo/gpu/actions/runs/{}/cancel", q.run_id));
    assert_eq!(http.post(&cancel).header("authorization", &auth).send().await.expect("send").status(), 202);
    assert!(gh.run_cancelled(q.run_id));
    let view = gh.job(q.job_id).expect("job");
    assert_eq!((view.status.as_str(), view.conclusion.as_deref()), ("completed", Some("cancelled")));
    assert_eq!(http.post(&cancel).header("authorization", &auth).send().await.expect("send").status(), 409);

    // Check runs and statuses (with the personal token).
    let pat = format!("token {PAT}");
    let cr: Value = http
        .post(api("/repos/octo/gpu/check-runs"))
        .header("authorization", &pat)
        .json(&json!({ "name": "gpuci/test", "head_sha": q.head_sha, "status": "in_progress" }))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let cr_id = cr["id"].as_u64().expect("id");
    let r = http
        .patch(api(&format!("/repos/octo/gpu/check-runs/{cr_id}")))
        .header("authorization", &pat)
        .json(&json!({ "conclusion": "success", "output": { "title": "ok", "summary": "all good" } }))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let runs = gh.check_runs("octo/gpu");
    assert_eq!((runs[0]["status"].as_str(), runs[0]["conclusion"].as_str()), (Some("completed"), Some("success")));
    assert_eq!(runs[0]["output"]["summary"], "all good");
    let r = http
        .post(api(&format!("/repos/octo/gpu/statuses/{}", q.head_sha)))
        .header("authorization", &auth)
        .json(&json!({ "state": "pending", "context": "gpuci", "target_url": null }))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 201);
    assert_eq!(gh.statuses("octo/gpu", &q.head_sha)[0]["state"], "pending");

    // Labels.
    gh.open_pull_request("octo/gpu", 5, &q.head_sha, false, "alice", "MEMBER").await;
    gh.add_label("octo/gpu", 5, "run gpu", "bob").await;
    let del = api("/repos/octo/gpu/issues/5/labels/run%20gpu");
    assert_eq!(http.delete(&del).header("authorization", &auth).send().await.expect("send").status(), 200);
    assert!(gh.labels("octo/gpu", 5).is_empty());
    assert_eq!(http.delete(&del).header("authorization", &auth).send().await.expect("send").status(), 404);

    // Collaborators: maintain reads as `write`, with the role in role_name.
    gh.add_collaborator("octo/gpu", "carol", "maintain");
    let perm: Value = http
        .get(api("/repos/octo/gpu/collaborators/carol/permission"))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!((perm["permission"].as_str(), perm["role_name"].as_str()), (Some("write"), Some("maintain")));
    let r = http
        .get(api("/repos/octo/gpu/collaborators/mallory/permission"))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 404);

    // Contents and tarball.
    let file: Value = http
        .get(api(&format!("/repos/octo/gpu/contents/.gpuci.yml?ref={}", q.head_sha)))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let b64: String = file["content"].as_str().expect("content").split('\n').collect();
    use base64::Engine;
    let decoded = base64::engine::general_purpose::STANDARD.decode(b64).expect("base64");
    assert_eq!(decoded, b"pool: gpu\n");
    let missing = http
        .get(api("/repos/octo/gpu/contents/nope.yml?ref=1111111"))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send");
    assert_eq!(missing.status(), 404);
    let dir = http.get(api("/repos/octo/gpu/contents/src")).header("authorization", &auth).send().await.expect("send");
    assert_eq!(dir.status(), 200);
    let r = http
        .get(api(&format!("/repos/octo/gpu/tarball/{}", q.head_sha)))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 302);
    let location = r.headers().get("location").and_then(|v| v.to_str().ok()).expect("Location").to_owned();
    assert!(location.starts_with(&gh.url), "{location}");
    let tgz = http.get(&location).send().await.expect("send").bytes().await.expect("bytes");
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(&tgz[..]));
    let mut paths = Vec::new();
    for e in archive.entries().expect("entries") {
        let e = e.expect("entry");
        if e.header().entry_type() != tar::EntryType::XGlobalHeader {
            paths.push(e.path().expect("path").display().to_string());
        }
    }
    assert!(paths.iter().all(|p| p.starts_with("octo-gpu-1111111/")), "{paths:?}");
    assert!(paths.contains(&"octo-gpu-1111111/src/a.py".to_owned()), "{paths:?}");

    // Installations (App JWT).
    let jwt = jwt(&app());
    let inst: Value = http
        .get(api("/app/installations"))
        .header("authorization", &jwt)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(inst.as_array().map(Vec::len), Some(2));
    let r = http.get(api("/repos/octo/gpu/installation")).header("authorization", &jwt).send().await.expect("send");
    assert_eq!(r.json::<Value>().await.expect("json")["id"], 7);

    assert!(gh.requests().iter().any(|r| r.method == "PATCH" && r.body["conclusion"] == "success"));
    assert_clean(&gh);
}

#[tokio::test]
async fn bad_credentials_get_githubs_401() {
    let gh = server().await;
    let http = http();
    let other_installation = installation_token(&gh, &app(), 8).await.expect("token");
    let url = format!("{}/repos/octo/gpu/actions/runners", gh.url);
    for auth in [None, Some("Bearer ghs_made_up".to_owned()), Some(format!("Bearer {other_installation}"))] {
        let mut req = http.get(&url);
        if let Some(a) = &auth {
            req = req.header("authorization", a);
        }
        let r = req.send().await.expect("send");
        assert_eq!(r.status(), 401, "{auth:?}");
        let body: Value = r.json().await.expect("json");
        assert!(body["message"].is_string() && body["documentation_url"].is_string(), "{body}");
    }
    // An App JWT signed with another key, and an installation token used as an App JWT.
    let stranger = "-----BEGIN RSA PRIVATE KEY-----\nnot a key\n-----END RSA PRIVATE KEY-----\n";
    assert!(AppCredentials::new(APP_ID, &Secret::new(stranger)).is_err());
    let wrong_app = AppCredentials::new(APP_ID + 1, &Secret::new(fixture("test-app-key.pem"))).expect("key");
    assert_eq!(installation_token(&gh, &wrong_app, 7).await, Err(401));
    assert_eq!(installation_token(&gh, &app(), 99).await, Err(404));
    let r = http
        .post(format!("{}/app/installations/7/access_tokens", gh.url))
        .header("authorization", format!("Bearer {other_installation}"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 401);
    assert_clean(&gh);
}

#[tokio::test]
async fn webhooks_are_signed_and_parse_with_gpuci() {
    let gh = server().await;
    let receiver = Receiver::default();
    gh.set_webhook_url(&receiver.start().await);

    let q = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", true).await;
    assert_eq!(q.status, 200);
    let missed = gh.queue_workflow_job("octo/gpu", &["gpu"], "true", false).await;
    assert_eq!(missed.status, 0);
    assert_eq!(
        gh.open_pull_request(
            "octo/gpu",
            9,
            "abcabcabcabcabcabcabcabcabcabcabcabcabca",
            true,
            "eve",
            "FIRST_TIME_CONTRIBUTOR"
        )
        .await,
        200
    );
    assert_eq!(gh.add_label("octo/gpu", 9, "gpu-ok", "alice").await, 200);
    assert_eq!(gh.push_to_pull_request("octo/gpu", 9, "defdefdefdefdefdefdefdefdefdefdefdefdefd").await, 200);
    assert_eq!(gh.push("octo/gpu", "main", "0123456789012345678901234567890123456789").await, 200);
    assert_eq!(gh.redeliver(&q.delivery).await, 200);
    assert_eq!(gh.redeliver(&missed.delivery).await, 200);
    let (status, _) = gh.send_raw("ping", b"{}", Some("sha256=00"), "raw-1").await;
    assert_eq!(status, 401);
    let (status, _) = gh.send_event("ping", json!({ "zen": "Keep it logically awesome." })).await;
    assert_eq!(status, 200);

    let events = receiver.events();
    assert_eq!(events.len(), 9, "{events:?}");
    let Ok(Event::WorkflowJob(w)) = &events[0].2 else { panic!("{:?}", events[0]) };
    assert_eq!((w.action, w.job_id, w.run_id), (WorkflowJobAction::Queued, q.job_id, q.run_id));
    assert_eq!((w.runner_id, w.runner_name.as_deref()), (None, None));
    assert_eq!(w.labels, ["self-hosted", "gpu"]);
    assert_eq!((w.installation_id, w.repository.full_name.as_str()), (Some(7), "octo/gpu"));
    let Ok(Event::PullRequest(opened)) = &events[1].2 else { panic!("{:?}", events[1]) };
    assert!(opened.from_fork);
    assert_eq!(opened.head_repo_full_name.as_deref(), Some("eve/gpu"));
    let Ok(Event::PullRequest(labeled)) = &events[2].2 else { panic!("{:?}", events[2]) };
    assert_eq!(labeled.label.as_deref(), Some("gpu-ok"));
    let Ok(Event::PullRequest(sync)) = &events[3].2 else { panic!("{:?}", events[3]) };
    assert_eq!(sync.head_sha, "defdefdefdefdefdefdefdefdefdefdefdefdefd");
    let Ok(Event::Push(push)) = &events[4].2 else { panic!("{:?}", events[4]) };
    assert_eq!((push.git_ref.as_str(), push.deleted), ("refs/heads/main", false));
    assert_eq!(events[5].1, q.delivery, "redelivery keeps the delivery id");
    assert_eq!(events[6].1, missed.delivery);
    assert_eq!(gh.labels("octo/gpu", 9), ["gpu-ok"]);

    let log = gh.webhook_deliveries();
    assert_eq!(log.len(), 9);
    let mut ids: Vec<&String> = log.iter().map(|(_, d, _)| d).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 8, "the redelivery reuses its id: {log:?}");
    assert_clean(&gh);
}

#[tokio::test]
async fn signature_matches_githubs_documented_vector() {
    assert_eq!(
        gpuci_github_testserver::sign_webhook("It's a Secret to Everybody", b"Hello, World!"),
        "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    );
}

#[tokio::test]
async fn bad_request_bodies_are_caught_by_the_validator() {
    let gh = server().await;
    if !gh.validating() {
        eprintln!("reference description not found; skipping");
        return;
    }
    let http = http();
    let r = http
        .post(format!("{}/repos/octo/gpu/check-runs", gh.url))
        .header("authorization", format!("Bearer {PAT}"))
        .json(&json!({ "name": "x", "status": "done" }))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 422);
    let _ = http
        .get(format!("{}/repos/octo/gpu/actions/runs?colour=red", gh.url))
        .header("authorization", format!("Bearer {PAT}"))
        .send()
        .await;
    let errs = gh.validation_errors().join("\n");
    assert!(errs.contains("required property `head_sha` is missing"), "{errs}");
    assert!(errs.contains("\"done\" is not one of"), "{errs}");
    assert!(errs.contains("query parameter `colour` is not declared"), "{errs}");

    // The response schemas catch what a careless handler would send.
    let job = json!({ "id": 1, "status": "running" });
    let errs = gh.validate_component("job", &job).expect("validating").join("\n");
    assert!(errs.contains("required property `run_id` is missing"), "{errs}");
    assert!(errs.contains("\"running\" is not one of"), "{errs}");
}

fn curl_available() -> bool {
    let ok = std::process::Command::new("curl").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "curl is required for the fake runner tests on CI");
        eprintln!("curl not found; skipping the fake runner test");
    }
    ok
}

async fn register_runner(gh: &TestGitHub, name: &str, labels: &[&str]) -> String {
    let r = http()
        .post(format!("{}/repos/octo/gpu/actions/runners/generate-jitconfig", gh.url))
        .header("authorization", format!("Bearer {PAT}"))
        .json(&json!({ "name": name, "runner_group_id": 1, "labels": labels }))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 201);
    r.json::<Value>().await.expect("json")["encoded_jit_config"].as_str().expect("config").to_owned()
}

#[tokio::test]
async fn fake_runner_takes_runs_and_completes_a_queued_job() {
    if !curl_available() {
        return;
    }
    let gh = server().await;
    let receiver = Receiver::default();
    gh.set_webhook_url(&receiver.start().await);
    let dir = tempfile::tempdir().expect("tempdir");
    install_fake_runner(dir.path()).expect("install");
    assert!(dir.path().join("bin/Runner.Listener").is_file());

    let q = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "echo hello-from-job; exit 0", true).await;
    assert_eq!(gh.job(q.job_id).expect("job").status, "queued");
    let config = register_runner(&gh, "runner-a", &["gpu", "linux"]).await;
    let child = tokio::process::Command::new(dir.path().join("run.sh"))
        .args(["--jitconfig", &config])
        // These tests run the stand-in directly, maybe as root: allowed as the real one allows it.
        .env("RUNNER_ALLOW_RUNASROOT", "1")
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn run.sh");
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("run.sh finishes")
        .expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "run.sh failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for needle in ["Connected to GitHub", "Running job: test", "hello-from-job", "completed with result: Succeeded"] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
    let job = gh.job(q.job_id).expect("job");
    assert_eq!((job.status.as_str(), job.conclusion.as_deref()), ("completed", Some("success")));
    assert_eq!(job.runner_name.as_deref(), Some("runner-a"));
    let runner = &gh.runners()[0];
    assert!(runner.deleted);
    assert_eq!(runner.jobs_taken, 1);
    eventually("in_progress and completed webhooks", 10, || receiver.job_actions(q.job_id).len() == 3).await;
    assert_eq!(
        receiver.job_actions(q.job_id),
        [WorkflowJobAction::Queued, WorkflowJobAction::InProgress, WorkflowJobAction::Completed]
    );
    let completed = receiver.events().into_iter().find_map(|(_, _, e)| match e {
        Ok(Event::WorkflowJob(w)) if w.action == WorkflowJobAction::Completed => Some(w),
        _ => None,
    });
    let completed = completed.expect("completed event");
    assert_eq!(
        (completed.conclusion.as_deref(), completed.runner_name.as_deref()),
        (Some("success"), Some("runner-a"))
    );
    let diag = std::fs::read_to_string(dir.path().join("_diag/Runner.log")).expect("_diag/Runner.log");
    assert!(diag.contains("running job"), "{diag}");

    // The runner is gone: a second run.sh with the same config is told so and exits 1.
    let status = tokio::process::Command::new(dir.path().join("run.sh"))
        .args(["--jitconfig", &config])
        // These tests run the stand-in directly, maybe as root: allowed as the real one allows it.
        .env("RUNNER_ALLOW_RUNASROOT", "1")
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .expect("run.sh");
    assert_eq!(status.code(), Some(1));
    assert_clean(&gh);
}

#[tokio::test]
async fn cancelling_a_run_stops_the_fake_runners_job() {
    if !curl_available() {
        return;
    }
    let gh = server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    install_fake_runner(dir.path()).expect("install");
    // A job the runner cannot take (label mismatch) stays queued; the matching one is taken.
    let other = gh.queue_workflow_job("octo/gpu", &["h100"], "true", false).await;
    let q = gh.queue_workflow_job("octo/gpu", &["gpu"], "echo started; sleep 60; echo not-reached", false).await;
    let config = register_runner(&gh, "runner-b", &["gpu"]).await;
    let child = tokio::process::Command::new(dir.path().join("run.sh"))
        .args(["--jitconfig", &config])
        // These tests run the stand-in directly, maybe as root: allowed as the real one allows it.
        .env("RUNNER_ALLOW_RUNASROOT", "1")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn run.sh");
    eventually("the job to start", 20, || gh.job(q.job_id).is_some_and(|j| j.status == "in_progress")).await;
    assert_eq!(gh.job(other.job_id).expect("job").status, "queued");
    let r = http()
        .post(format!("{}/repos/octo/gpu/actions/runs/{}/cancel", gh.url, q.run_id))
        .header("authorization", format!("Bearer {PAT}"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 202);
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("run.sh stops")
        .expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("completed with result: Canceled") && !stdout.contains("not-reached"), "{stdout}");
    assert_eq!(gh.job(q.job_id).expect("job").conclusion.as_deref(), Some("cancelled"));
    assert!(gh.runners()[0].deleted);
    assert_clean(&gh);
}

#[tokio::test]
async fn without_the_reference_validation_is_off_and_everything_still_works() {
    let gh = TestGitHub::start(Options {
        reference: Some("/nonexistent/gpuci-reference".into()),
        personal_token: Some(PAT.into()),
        ..Options::default()
    })
    .await;
    gh.add_repo("octo/gpu", 7);
    assert!(!gh.validating());
    let r = http()
        .get(format!("{}/repos/octo/gpu/actions/runners?colour=red", gh.url))
        .header("authorization", format!("Bearer {PAT}"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    assert!(gh.validation_errors().is_empty());
    assert_eq!(gh.requests().len(), 1);
}

#[tokio::test]
async fn the_stand_in_refuses_root_like_the_real_runner() {
    if !nix_is_root() {
        eprintln!("SKIP: needs root to see the refusal");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    install_fake_runner(dir.path()).expect("install");
    let out = tokio::process::Command::new(dir.path().join("run.sh"))
        .args(["--jitconfig", "eA=="])
        .env_remove("RUNNER_ALLOW_RUNASROOT")
        .output()
        .await
        .expect("run.sh");
    // actions/runner's run-helper.sh: a message and exit 0, without taking a job.
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Must not run interactively with sudo"));
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|v| v.split_whitespace().nth(1)).map(|u| u == "0")
        })
        .unwrap_or(false)
}
