//! The builds view and `gpuci up`: builds listed newest first, a pipeline's graph, "Retry
//! failed" and "Cancel all", and `gpuci up`'s dashboard address and config file.

use super::*;

/// Issue 30: `gpuci up` says where the dashboard is and how to sign in, and takes the
/// server's config file (`--config`) as `gpuci server` does: its public repositories apply,
/// and a wrong file is refused before anything starts, naming itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpuci_up_prints_the_dashboard_and_takes_a_config_file() {
    let bin = env!("CARGO_BIN_EXE_gpuci");
    let dir = tempdir();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[dashboard]\npublic_repositorys = [\"acme/open\"]\n").unwrap();
    let out = Command::new(bin)
        .args(["up", "--listen", "127.0.0.1:0", "--slots", "1", "--config"])
        .arg(&bad)
        .arg("--data-dir")
        .arg(dir.path().join("bad-data"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("bad.toml") && err.contains("public_repositorys"), "{err}");
    assert!(!dir.path().join("bad-data/gpuci.db").exists(), "nothing started");

    let good = dir.path().join("gpuci.toml");
    std::fs::write(&good, "[dashboard]\npublic_repositories = [\"acme/open\"]\n").unwrap();
    let data = dir.path().join("data");
    let mut up = Command::new(bin)
        .args(["up", "--listen", "127.0.0.1:0", "--slots", "1", "--config"])
        .arg(&good)
        .arg("--data-dir")
        .arg(&data)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = up.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let t0 = Instant::now();
    let line = loop {
        let l = rx.recv_timeout(T.saturating_sub(t0.elapsed())).expect("gpuci up never named its dashboard");
        if l.contains("dashboard:") {
            break l;
        }
    };
    assert!(line.contains("/ui/") && line.contains("api-token") && line.contains("read-token"), "{line}");
    let url = line.split_whitespace().find(|w| w.starts_with("http://")).unwrap().to_string();
    let token = std::fs::read_to_string(data.join("api-token")).unwrap();
    let http = reqwest::Client::new();
    let page = http.get(&url).bearer_auth(token.trim()).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("Builds"));
    // The file's public repository is public: its build shows to nobody-signed-in.
    let base = url.trim_end_matches("/ui/").to_string();
    let submit = |repo: &str| {
        http.post(format!("{base}/api/v1/pipelines")).bearer_auth(token.trim()).json(&serde_json::json!({
            "file_name": "x.yml", "source": "steps:\n  - key: a\n    command: 'true'\n",
            "repository": format!("https://github.com/acme/{repo}.git"),
        }))
    };
    let open: serde_json::Value = submit("open").send().await.unwrap().json().await.unwrap();
    let closed: serde_json::Value = submit("secret").send().await.unwrap().json().await.unwrap();
    let list = http.get(&url).send().await.unwrap().text().await.unwrap();
    assert!(list.contains(&format!("id=\"build-{}\"", open["id"])), "{list}");
    assert!(!list.contains(&format!("id=\"build-{}\"", closed["id"])), "{list}");
    let _ = up.kill();
    let _ = up.wait();
}

/// Issue 30, the builds view end to end: the landing page lists builds newest first with
/// their commit, branch, author and trigger (as `gpuci submit` sends them); a pipeline's page
/// draws its steps' graph; "Retry failed" queues a new attempt of the failed step and of the
/// step after it, and "Cancel all" stops what runs; a read-only viewer gets neither button
/// and a 403 from the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn builds_list_pipeline_graph_retry_failed_and_cancel_all() {
    let c = InProc::start("dash-builds").await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    let http = reqwest::Client::new();
    let submit = |source: &str, facts: serde_json::Value| {
        http.post(format!("{}/api/v1/pipelines", c.url)).bearer_auth(&c.token).json(&serde_json::json!({
            "file_name": ".gpuci.yml", "source": source, "build": facts,
            "repository": "https://github.com/acme/kernels.git",
        }))
    };
    let api = c.api_in_blocking();
    blocking(move || api().wait_agents(1, T)).await;
    // `test` fails on its first attempt and passes on the next.
    let failing = "steps:\n  - key: build\n    command: echo built\n  - key: test\n    depends_on: build\n    command: test \"$GPUCI_ATTEMPT\" -gt 1\n  - key: bench\n    depends_on: test\n    command: echo benched\n  - key: lint\n    command: echo linted\n";
    let facts = serde_json::json!({
        "event": "manual", "branch": "fix/<b>gemm</b>", "commit": "0123456789abcdef0123456789abcdef01234567",
        "subject": "Faster GEMM <script>alert(1)</script>", "author": "Ada Lovelace",
    });
    let first: serde_json::Value = submit(failing, facts).send().await.unwrap().json().await.unwrap();
    let first_id = first["id"].as_i64().unwrap();
    let api = c.api_in_blocking();
    let done = blocking(move || api().wait_pipeline(first_id, T)).await;
    assert_eq!(done.state, "failed", "{done:?}");
    let second: serde_json::Value = submit(TICKS, serde_json::json!({"event": "schedule", "branch": "main"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let second_id = second["id"].as_i64().unwrap();

    // The landing page: newest first, with what was built.
    b.sign_in(&c.url, &c.token, "/ui/").await;
    let body = b
        .wait_text("both builds", |t| t.contains(&format!("#{second_id}")) && t.contains(&format!("#{first_id}")))
        .await;
    assert!(body.find(&format!("#{second_id}")) < body.find(&format!("#{first_id}")), "newest first: {body}");
    let row = b.text(&format!("#build-{first_id}")).await;
    for want in [
        "failed",
        "acme/kernels",
        "Faster GEMM <script>alert(1)</script>",
        "fix/<b>gemm</b>",
        "Ada Lovelace",
        "manual",
        "0123456789",
    ] {
        assert!(row.contains(want), "{want:?} in {row}");
    }
    assert!(b.text(&format!("#build-{second_id}")).await.contains("schedule"));
    let scripts =
        b.client.execute("return document.querySelectorAll('main script, main b').length", vec![]).await.unwrap();
    assert_eq!(scripts, serde_json::json!(0), "the subject and branch are text");
    b.screenshot("builds").await;

    // The pipeline page: its graph, and the failed step retried with the step after it.
    b.client.goto(&format!("{}/ui/pipelines/{first_id}", c.url)).await.unwrap();
    b.wait_text("the graph", |t| t.contains("Steps")).await;
    let nodes = b.client.find_all(Locator::Css("svg.graph g.node")).await.unwrap().len();
    assert_eq!(nodes, 4);
    let edges = b.client.find_all(Locator::Css("svg.graph path.edge")).await.unwrap().len();
    assert_eq!(edges, 2, "build → test → bench");
    b.screenshot("pipeline-graph").await;
    let before: std::collections::BTreeSet<i64> = done.jobs.iter().map(|j| j.id).collect();
    b.client.find(Locator::Css("form[action$='/retry-failed'] button")).await.unwrap().click().await.unwrap();
    let api = c.api_in_blocking();
    let after = blocking(move || {
        let api = api();
        wait_until("the retried steps to finish", T, || {
            let p = api.pipeline(first_id);
            p.jobs.len() == 6 && p.state == "succeeded"
        });
        api.pipeline(first_id)
    })
    .await;
    let mut new: Vec<(String, u32)> =
        after.jobs.iter().filter(|j| !before.contains(&j.id)).map(|j| (j.step_key.clone(), j.attempt)).collect();
    new.sort();
    assert_eq!(new, [("bench".to_string(), 2), ("test".to_string(), 2)], "only the failed step and what followed it");
    b.wait_text("the retried pipeline", |t| t.contains("succeeded")).await;

    // A read-only viewer: no buttons, and the API says 403 to its token.
    let read_token = std::fs::read_to_string(c.data_dir().join("server/read-token")).unwrap();
    let reader = session_cookie(&c.url, &read_token).await;
    let page = http
        .get(format!("{}/ui/pipelines/{second_id}", c.url))
        .header("cookie", &reader)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("svg") && !page.contains("Cancel all") && !page.contains("retry-failed"), "{page}");
    let api_post = |path: String, token: String| {
        let http = http.clone();
        async move { http.post(path).bearer_auth(token.trim()).send().await.unwrap().status() }
    };
    let cancel_url = format!("{}/api/v1/pipelines/{second_id}/cancel", c.url);
    assert_eq!(api_post(cancel_url.clone(), read_token.clone()).await, 403);
    assert_eq!(http.post(&cancel_url).header("cookie", &reader).send().await.unwrap().status(), 401);
    let form = http
        .post(format!("{}/ui/pipelines/{second_id}/cancel", c.url))
        .header("cookie", &reader)
        .form(&[("csrf", "x")])
        .send()
        .await
        .unwrap();
    assert_eq!(form.status(), 403, "a read-only session's form");
    assert_eq!(
        api_post(format!("{}/api/v1/pipelines/{first_id}/retry-failed", c.url), c.token.clone()).await,
        409,
        "nothing failed now"
    );
    assert_eq!(api_post(format!("{}/api/v1/pipelines/x/cancel", c.url), c.token.clone()).await, 400);
    assert_eq!(api_post(format!("{}/api/v1/pipelines/999999/cancel", c.url), c.token.clone()).await, 404);
    // "Cancel all" from the page, as the admin.
    b.client.goto(&format!("{}/ui/pipelines/{second_id}", c.url)).await.unwrap();
    b.wait_text("the running pipeline", |t| t.contains("Cancel all")).await;
    b.client.find(Locator::Css("form[action$='/cancel'] button")).await.unwrap().click().await.unwrap();
    let api = c.api_in_blocking();
    let p = blocking(move || api().wait_pipeline(second_id, T)).await;
    assert_eq!(p.state, "cancelled", "{p:?}");
    assert!(p.jobs.iter().all(|j| j.reason.contains("dashboard")), "{p:?}");
    b.close().await;
    c.stop().await;
}
