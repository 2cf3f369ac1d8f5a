//! The dashboard in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
//! driven over WebDriver), and `/metrics` checked by `promtool`. Each test asserts what a
//! person would see: log lines arriving without a reload, a job cancelled from its page, a
//! quarantined GPU released, a private job refused to someone not signed in. Screenshots of
//! every main page go to `<target>/tmp/dashboard-screenshots/` (kept as test artefacts).
//!
//! With `CI=true` a missing Chromium, chromedriver or promtool fails the test; elsewhere the
//! test says so and passes without running (`./scripts/test` installs them).

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use fantoccini::{Client, Locator};
use gpuci_core::job::JobState;
use gpuci_core::quantity::Bytes;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(30);
const TAB: &str = "\u{E004}";
const ENTER: &str = "\u{E007}";

fn tool(name: &str) -> Option<std::path::PathBuf> {
    let found =
        std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|p| p.exists()));
    if found.is_none() {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true but {name} is not installed; run ./scripts/test");
        }
        eprintln!("note: {name} is not installed; skipping (./scripts/test installs it)");
    }
    found
}

/// chromedriver on a free loopback port, and a headless Chromium session through it.
struct Browser {
    driver: Child,
    client: Client,
    _profile: tempfile::TempDir,
    /// One browser at a time: on a 2-core CI machine several Chromiums at once starve the
    /// coordinator they are watching.
    _turn: tokio::sync::OwnedMutexGuard<()>,
}

static TURN: std::sync::OnceLock<std::sync::Arc<tokio::sync::Mutex<()>>> = std::sync::OnceLock::new();

impl Browser {
    async fn start() -> Option<Browser> {
        let chromium = tool("chromium")?;
        let chromedriver = tool("chromedriver")?;
        let turn = TURN.get_or_init(Default::default).clone().lock_owned().await;
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = tempdir();
        let caps: serde_json::Map<String, serde_json::Value> = serde_json::from_value(serde_json::json!({
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--no-first-run", "--disable-quic", "--window-size=1280,1000",
                    format!("--user-data-dir={}", profile.path().display()),
                ]
            }
        }))
        .unwrap();
        let t0 = Instant::now();
        let client = loop {
            match fantoccini::ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                .capabilities(caps.clone())
                .connect(&format!("http://127.0.0.1:{port}"))
                .await
            {
                Ok(c) => break c,
                Err(e) if t0.elapsed() < T => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("no WebDriver session: {e}"),
            }
        };
        Some(Browser { driver, client, _profile: profile, _turn: turn })
    }

    async fn screenshot(&self, name: &str) {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        let png = self.client.screenshot().await.unwrap();
        std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
    }

    async fn text(&self, css: &str) -> String {
        self.client.find(Locator::Css(css)).await.unwrap().text().await.unwrap()
    }

    /// Waits until `f` holds of the page's body text.
    async fn wait_text(&self, what: &str, f: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            // Mid-navigation (a form just posted) there may be no body for a moment.
            let body = match self.client.find(Locator::Css("body")).await {
                Ok(b) => b.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            if f(&body) {
                return body;
            }
            assert!(t0.elapsed() < T, "timed out waiting for {what}; the page says:\n{body}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn sign_in(&self, url: &str, token: &str, next: &str) {
        self.client.goto(&format!("{url}/ui/login?next={next}")).await.unwrap();
        let field = self.client.find(Locator::Id("token")).await.unwrap();
        field.send_keys(token).await.unwrap();
        field.send_keys(ENTER).await.unwrap();
        self.wait_text("the sign-in to finish", |b| b.contains("Sign out")).await;
    }

    async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// A job that prints a numbered line every 100 ms for a minute.
const TICKS: &str =
    "steps:\n  - key: ticks\n    command: for i in $(seq 1 600); do echo \"tick $i\"; sleep 0.1; done\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sign_in_watch_a_log_live_and_cancel_the_job_from_its_page() {
    let c = InProc::start("dash-live").await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    let id = running_ticks(&c).await;

    // Not signed in: the job of a private (unnamed) repository does not exist for this viewer.
    b.client.goto(&format!("{}/ui/jobs/{id}", c.url)).await.unwrap();
    let body = b.text("body").await;
    assert!(body.contains("not found") && !body.contains("tick"), "{body}");

    b.sign_in(&c.url, &c.token, &format!("/ui/jobs/{id}")).await;
    b.wait_text("the first lines", |t| t.contains("tick 3")).await;
    // Lines keep arriving on the same page: no reload (the marker set now survives).
    b.client.execute("window.__still_here = 42; return 1", vec![]).await.unwrap();
    let before = b.client.find_all(Locator::Css("#log li")).await.unwrap().len();
    b.wait_text("later lines", |t| t.contains(&format!("tick {}", before + 10))).await;
    let marker = b.client.execute("return window.__still_here", vec![]).await.unwrap();
    assert_eq!(marker, serde_json::json!(42), "the page was reloaded instead of updated");
    // Each line has a permalink.
    let link = b.client.find(Locator::Css("#L2 a.ln")).await.unwrap().attr("href").await.unwrap();
    assert_eq!(link.as_deref(), Some("#L2"));
    // Searching keeps only the matching lines.
    let search = b.client.find(Locator::Id("log-search")).await.unwrap();
    search.send_keys("tick 7").await.unwrap();
    let shown = b
        .client
        .execute("return [...document.querySelectorAll('#log li')].filter(l => !l.classList.contains('hidden')).map(l => l.textContent)", vec![])
        .await
        .unwrap();
    let shown: Vec<String> = serde_json::from_value(shown).unwrap();
    assert!(!shown.is_empty() && shown.iter().all(|l| l.contains("tick 7")), "{shown:?}");
    b.screenshot("job-running").await;

    b.client.find(Locator::Css("button.danger")).await.unwrap().click().await.unwrap();
    b.wait_text("the job to end cancelled", |t| t.contains("cancelled")).await;
    let api = c.api_in_blocking();
    let j = blocking(move || api().wait_job(id, "cancelled", T, |j| j.state.is_terminal())).await;
    assert_eq!(j.state, JobState::Cancelled, "{j:?}");
    assert!(j.reason.contains("dashboard"), "{}", j.reason);
    b.screenshot("job-cancelled").await;
    b.close().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quarantined_gpu_shows_on_the_fleet_page_and_is_released_there() {
    let c = InProc::start("dash-gpu").await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    let (api, a, fake) = (c.api_in_blocking(), c.a.clone(), c.fake.clone());
    let a2 = a.clone();
    // A job leaves memory in use on GPU A: after it, the GPU is quarantined.
    blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let p = api.submit("steps:\n  - key: dirty\n    gpus: 1\n    command: sleep 1\n");
        let id = p.jobs[0].id;
        api.wait_job(id, "running", T, |j| j.state == JobState::Running);
        fake.set(&a2, |s| s.memory_used = Bytes(3 << 30));
        api.wait_job(id, "finished", T, |j| j.state.is_terminal());
        wait_until("GPU A quarantined", T, || {
            api.agents().iter().flat_map(|x| x.gpus.iter()).any(|g| g.info.uuid == a2 && g.state == "quarantined")
        });
        // Clean again, so the release holds.
        fake.set(&a2, |s| s.memory_used = Bytes(0));
    })
    .await;

    b.sign_in(&c.url, &c.token, "/ui/fleet").await;
    let body = b.wait_text("the quarantine on the fleet page", |t| t.contains("quarantined")).await;
    assert!(body.contains("simulated"), "simulated GPUs are marked: {body}");
    b.screenshot("fleet-quarantined").await;
    let row = b.client.find(Locator::Id(&format!("gpu-{a}"))).await.unwrap();
    row.find(Locator::Css("button")).await.unwrap().click().await.unwrap();
    let api = c.api_in_blocking();
    let a3 = a.clone();
    blocking(move || {
        let api = api();
        wait_until("GPU A free again", T, || {
            api.agents().iter().flat_map(|x| x.gpus.iter()).any(|g| g.info.uuid == a3 && g.state == "free")
        })
    })
    .await;
    let state = b.client.find(Locator::Id(&format!("gpu-{a}"))).await.unwrap().attr("data-state").await.unwrap();
    assert_eq!(state.as_deref(), Some("free"));
    b.close().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_public_repositorys_job_opens_without_sign_in_and_a_private_one_does_not() {
    let c = InProc::start_with("dash-public", |cfg| cfg.public_repositories = vec!["acme/open".into()]).await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    let api = c.api_in_blocking();
    let (open, closed) = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let yaml = "steps:\n  - key: hello\n    command: echo \"hello from $GPUCI_STEP_KEY\"\n";
        let open = api.submit_from(yaml, Some("https://github.com/acme/open.git")).jobs[0].id;
        let closed = api.submit_from(yaml, Some("https://github.com/acme/secret.git")).jobs[0].id;
        api.wait_job(open, "done", T, |j| j.state.is_terminal());
        api.wait_job(closed, "done", T, |j| j.state.is_terminal());
        (open, closed)
    })
    .await;

    b.client.goto(&format!("{}/ui/jobs/{open}", c.url)).await.unwrap();
    let body = b.wait_text("the public job's log", |t| t.contains("hello from hello")).await;
    assert!(body.contains("acme/open"), "{body}");
    assert!(!body.contains("dash-public"), "no agent names for anonymous viewers: {body}");
    b.screenshot("public-job").await;
    b.client.goto(&format!("{}/ui/jobs/{closed}", c.url)).await.unwrap();
    let body = b.text("body").await;
    assert!(body.contains("not found") && !body.contains("hello from"), "{body}");
    // The list shows the public job only; the fleet page needs sign-in.
    b.client.goto(&format!("{}/ui/jobs", c.url)).await.unwrap();
    let body = b.text("main").await;
    assert!(body.contains(&format!("#{open}")) && !body.contains(&format!("#{closed} ")), "{body}");
    // So does the builds list (issue 30): the private repository's build is not there.
    let api = c.api_in_blocking();
    let (p_open, p_closed) = blocking(move || {
        let api = api();
        (api.job(open).pipeline_id, api.job(closed).pipeline_id)
    })
    .await;
    b.client.goto(&format!("{}/ui/", c.url)).await.unwrap();
    let builds = b.client.find(Locator::Css("main")).await.unwrap().html(false).await.unwrap();
    assert!(builds.contains(&format!("id=\"build-{p_open}\"")), "{builds}");
    assert!(!builds.contains(&format!("id=\"build-{p_closed}\"")) && !builds.contains("acme/secret"), "{builds}");
    b.client.goto(&format!("{}/ui/fleet", c.url)).await.unwrap();
    assert!(b.client.current_url().await.unwrap().path().starts_with("/ui/login"));
    // The live stream of a private job is refused too.
    let r = reqwest::get(format!("{}/ui/jobs/{closed}/events", c.url)).await.unwrap();
    assert_eq!(r.status(), 404);
    b.close().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_main_pages_work_from_the_keyboard_and_render_for_screenshots() {
    let c = InProc::start("dash-keys").await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    let api = c.api_in_blocking();
    let pipeline = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let p = api.submit(
            "steps:\n  - key: build\n    command: printf '\\033[1;32mok\\033[0m build\\n'\n  - key: test\n    depends_on: build\n    gpus: 1\n    command: echo test\n  - key: never\n    agents: {queue: nowhere}\n    command: echo never\n",
        );
        for j in &p.jobs[..2] {
            api.wait_job(j.id, "done", T, |j| j.state.is_terminal());
        }
        p.id
    })
    .await;
    b.sign_in(&c.url, &c.token, "/ui/").await;

    // The first Tab reaches the skip link; Enter moves focus into the main content.
    b.client.find(Locator::Css("body")).await.unwrap().send_keys(TAB).await.unwrap();
    let focused = b.client.active_element().await.unwrap();
    assert_eq!(focused.text().await.unwrap(), "Skip to content");
    focused.send_keys(ENTER).await.unwrap();
    let id = b.client.execute("return document.activeElement.id", vec![]).await.unwrap();
    assert_eq!(id, serde_json::json!("main"));
    // From the top, Tab by Tab to the Queue link, and Enter opens it.
    b.client.goto(&format!("{}/ui/", c.url)).await.unwrap();
    let mut reached = false;
    for _ in 0..8 {
        b.client.active_element().await.unwrap().send_keys(TAB).await.unwrap();
        if b.client.active_element().await.unwrap().text().await.unwrap() == "Queue" {
            reached = true;
            break;
        }
    }
    assert!(reached, "Tab never reached the Queue link");
    b.client.active_element().await.unwrap().send_keys(ENTER).await.unwrap();
    let body = b.wait_text("the queue page", |t| t.contains("waiting")).await;
    assert!(body.contains("queue=nowhere"), "the queued job's reason: {body}");
    b.screenshot("queue").await;

    b.client.goto(&format!("{}/ui/jobs", c.url)).await.unwrap();
    b.screenshot("jobs").await;
    b.client.goto(&format!("{}/ui/pipelines/{pipeline}", c.url)).await.unwrap();
    b.wait_text("the timeline", |t| t.contains("Timeline")).await;
    b.screenshot("pipeline").await;
    let first = b.client.find(Locator::Css("ol.timeline a")).await.unwrap();
    first.click().await.unwrap();
    b.wait_text("the build job's log", |t| t.contains("ok build")).await;
    // The colour escape became a styled span, not text.
    let html = b.client.find(Locator::Css("#log")).await.unwrap().html(true).await.unwrap();
    assert!(html.contains("class=\"f2 bold\"") && !html.contains("[1;32m"), "{html}");
    b.screenshot("job").await;
    b.client.goto(&format!("{}/ui/fleet", c.url)).await.unwrap();
    b.screenshot("fleet").await;
    b.client.goto(&format!("{}/ui/spend", c.url)).await.unwrap();
    b.wait_text("the spend page", |t| t.contains("Spend")).await;
    b.screenshot("spend").await;
    // A narrow window: the page still fits (tables scroll inside their box).
    b.client.set_window_size(380, 800).await.unwrap();
    b.client.goto(&format!("{}/ui/", c.url)).await.unwrap();
    let overflow =
        b.client.execute("return document.documentElement.scrollWidth <= window.innerWidth + 1", vec![]).await.unwrap();
    assert_eq!(overflow, serde_json::json!(true), "the jobs page is wider than a narrow window");
    b.screenshot("jobs-narrow").await;
    b.client.goto(&format!("{}/ui/login", c.url)).await.unwrap();
    b.screenshot("login").await;
    b.close().await;
    c.stop().await;
}

/// Changes need the API token and the session's form token: a read-only session, a form
/// from elsewhere and a made-up cookie change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changes_need_the_admin_token_and_the_form_token() {
    let c = InProc::start("dash-csrf").await;
    let id = running_ticks(&c).await;
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let read_token = std::fs::read_to_string(c.data_dir().join("server/read-token")).unwrap();
    let session = |token: String| {
        let http = http.clone();
        let url = c.url.clone();
        async move {
            let r = http.post(format!("{url}/ui/login")).form(&[("token", token.trim())]).send().await.unwrap();
            assert_eq!(r.status(), 303);
            let cookie = r.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
            assert!(r.headers()["set-cookie"].to_str().unwrap().contains("HttpOnly"));
            cookie
        }
    };
    let csrf_of = |cookie: String| {
        let http = http.clone();
        let url = format!("{}/ui/jobs/{id}", c.url);
        async move {
            let page = http.get(url).header("cookie", cookie).send().await.unwrap().text().await.unwrap();
            page.split("name=\"csrf\" value=\"").nth(1).map(|s| s.split('"').next().unwrap().to_string())
        }
    };
    let cancel = |cookie: String, csrf: String| {
        let http = http.clone();
        let url = format!("{}/ui/jobs/{id}/cancel", c.url);
        async move { http.post(url).header("cookie", cookie).form(&[("csrf", csrf)]).send().await.unwrap().status() }
    };
    let reader = session(read_token).await;
    // A read-only session sees no cancel button, and a post is refused.
    let reader_csrf = csrf_of(reader.clone()).await.unwrap_or_default();
    assert_eq!(cancel(reader.clone(), reader_csrf).await, 403);
    let admin = session(c.token.clone()).await;
    assert_eq!(cancel(admin.clone(), "forged".into()).await, 403, "a wrong form token");
    let forged = admin.replace("gpuci_session=admin.", "gpuci_session=admin.9").to_string();
    assert_eq!(cancel(forged, "x".into()).await, 403, "a made-up cookie is nobody");
    let api = c.api_in_blocking();
    let j = blocking(move || api().job(id)).await;
    assert_eq!(j.state, JobState::Running, "nothing above may cancel: {j:?}");
    let csrf = csrf_of(admin.clone()).await.expect("an admin page carries a form token");
    assert_eq!(cancel(admin, csrf).await, 303);
    let api = c.api_in_blocking();
    let j = blocking(move || api().wait_job(id, "cancelled", T, |j| j.state.is_terminal())).await;
    assert_eq!(j.state, JobState::Cancelled);
    // Signing out: not from a form without the session's token (another site cannot sign
    // anyone out), and then for good (the old cookie no longer opens a page).
    let admin2 = session(c.token.clone()).await;
    let queue = |cookie: String| {
        let http = http.clone();
        let url = format!("{}/ui/queue", c.url);
        async move { http.get(url).header("cookie", cookie).send().await.unwrap().status() }
    };
    assert_eq!(queue(admin2.clone()).await, 200);
    let logout = |cookie: String, csrf: String| {
        let http = http.clone();
        let url = format!("{}/ui/logout", c.url);
        async move { http.post(url).header("cookie", cookie).form(&[("csrf", csrf)]).send().await.unwrap() }
    };
    let r = logout(admin2.clone(), String::new()).await;
    assert!(r.headers().get("set-cookie").is_none(), "signed out without the form token");
    assert_eq!(queue(admin2.clone()).await, 200);
    // One spelling of a signature only.
    let (head, sig) = admin2.rsplit_once('.').unwrap();
    assert_eq!(queue(format!("{head}.{}", sig.to_uppercase())).await, 303);
    let csrf = csrf_of(admin2.clone()).await.unwrap();
    logout(admin2.clone(), csrf).await;
    assert_eq!(queue(admin2).await, 303, "a signed-out session still opened a page");
    // After sign-in, only a dashboard path is a place to go (never another site).
    let r = http
        .post(format!("{}/ui/login", c.url))
        .form(&[("token", c.token.as_str()), ("next", "https://elsewhere.example/")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["location"], "/ui/");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_pass_promtool_and_attribute_the_running_jobs_gpu() {
    let Some(promtool) = tool("promtool") else { return };
    let c = InProc::start("dash-metrics").await;
    let api = c.api_in_blocking();
    let (a, fake) = (c.a.clone(), c.fake.clone());
    let id = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let p = api.submit_from(
            "steps:\n  - key: burn\n    gpus: 1\n    command: sleep 30\n",
            Some("https://github.com/acme/kernels.git"),
        );
        let id = p.jobs[0].id;
        // A queue nobody serves, named by a pipeline: one label for all such, not its name.
        api.submit("steps:\n  - key: lost\n    agents: {queue: invented-by-a-fork-7f3a}\n    command: echo never\n");
        api.wait_job(id, "running", T, |j| j.state == JobState::Running);
        fake.set(&a, |s| {
            s.utilization_pct = 87;
            s.memory_used = Bytes(5 << 30)
        });
        id
    })
    .await;
    let http = reqwest::Client::new();
    let url = format!("{}/metrics", c.url);
    assert_eq!(http.get(&url).send().await.unwrap().status(), 401, "metrics need a token");
    let read_token = std::fs::read_to_string(c.data_dir().join("server/read-token")).unwrap();
    let t0 = Instant::now();
    let text = loop {
        let text = http.get(&url).bearer_auth(read_token.trim()).send().await.unwrap().text().await.unwrap();
        if text.contains("gpuci_gpu_utilization_ratio{") && text.contains("0.87") {
            break text;
        }
        assert!(t0.elapsed() < T, "no attributed GPU sample yet:\n{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let want = format!(
        "gpuci_gpu_utilization_ratio{{fleet=\"\",gpu_uuid=\"{}\",host=\"dash-metrics\",job_id=\"{id}\",repository=\"github.com/acme/kernels\"}} 0.87",
        c.a
    );
    assert!(text.contains(&want), "missing {want}\n{text}");
    assert!(text.contains("gpuci_job_start_latency_seconds_count{queue=\"default\"} 1"), "{text}");
    assert!(text.contains("gpuci_gpu_leases 1"), "{text}");
    assert!(text.contains("gpuci_queue_jobs{queue=\"(no agent serves it)\"} 1"), "{text}");
    assert!(!text.contains("invented-by-a-fork"), "{text}");
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut check.stdin.take().unwrap(), text.as_bytes()).unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let ready = http.get(format!("{}/readyz", c.url)).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let api = c.api_in_blocking();
    blocking(move || api().cancel(id)).await;
    c.stop().await;
}

/// Submits [`TICKS`] and returns its job once it runs.
async fn running_ticks(c: &InProc) -> i64 {
    let api = c.api_in_blocking();
    blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let p = api.submit(TICKS);
        api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running).id
    })
    .await
}

/// Benchmark, not a test (run by hand; see BENCHMARKS.md): how long a line a job prints takes
/// to appear on an open job page. The job prints its own clock with each line; the page
/// records its clock when each line is added (same host, same clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "benchmark: cargo test -p gpuci --test dashboard -- --ignored --nocapture log_line_latency"]
async fn log_line_latency() {
    let c = InProc::start("dash-bench").await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    let api = c.api_in_blocking();
    let id = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let p = api.submit(
            "steps:\n  - key: clock\n    command: sleep 3; for i in $(seq 1 200); do echo \"at $(date +%s%3N)\"; sleep 0.05; done\n",
        );
        api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running).id
    })
    .await;
    b.sign_in(&c.url, &c.token, &format!("/ui/jobs/{id}")).await;
    b.client
        .execute(
            "window.__arrivals = []; new MutationObserver(ms => { const now = Date.now(); for (const m of ms) for (const n of m.addedNodes) \
             { const t = /at (\\d+)/.exec(n.textContent || ''); if (t) window.__arrivals.push(now - Number(t[1])); } })\
             .observe(document.getElementById('log'), {childList: true}); return 1",
            vec![],
        )
        .await
        .unwrap();
    b.wait_text("the last line", |t| t.contains("Duration") && t.contains("succeeded")).await;
    let v = b.client.execute("return window.__arrivals", vec![]).await.unwrap();
    let mut ms: Vec<i64> = serde_json::from_value(v).unwrap();
    ms.sort();
    assert!(ms.len() > 150, "only {} lines were seen arriving", ms.len());
    let q = |p: f64| ms[((ms.len() - 1) as f64 * p) as usize];
    println!(
        "job prints a line -> line in the open page ({} lines): p50 {} ms, p90 {} ms, p99 {} ms, max {} ms",
        ms.len(),
        q(0.5),
        q(0.9),
        q(0.99),
        ms[ms.len() - 1]
    );
    b.close().await;
    c.stop().await;
}

/// What a person who is not signed in can learn: nothing of private jobs (not even that they
/// exist), no agent names in a public job's reason, and they cannot hold every live stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn anonymous_viewers_learn_nothing_private_and_cannot_take_every_live_stream() {
    let c = InProc::start_with("dash-anon", |cfg| cfg.public_repositories = vec!["acme/open".into()]).await;
    let api = c.api_in_blocking();
    let (open, closed, mirror) = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let open = api.submit_from(TICKS, Some("https://github.com/acme/open.git")).jobs[0].id;
        let closed = api.submit_from(TICKS, Some("https://github.com/acme/secret.git")).jobs[0].id;
        // The same owner/name on another host is another repository.
        let mirror = api.submit_from(TICKS, Some("https://git.internal.example/team/acme/open.git")).jobs[0].id;
        api.wait_job(open, "running", T, |j| j.state == JobState::Running);
        (open, closed, mirror)
    })
    .await;
    let http = reqwest::Client::new();
    let get = |path: String| {
        let http = http.clone();
        let url = c.url.clone();
        async move {
            let r = http.get(format!("{url}{path}")).send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (status, page) = get(format!("/ui/jobs/{open}")).await;
    assert_eq!(status, 200);
    assert!(page.contains("running on an agent") && !page.contains("dash-anon"), "{page}");
    // A private job, a job on a look-alike repository and one that does not exist answer alike.
    let nowhere = 9_999_999;
    let (s1, p1) = get(format!("/ui/jobs/{closed}")).await;
    let (s2, p2) = get(format!("/ui/jobs/{mirror}")).await;
    let (s3, p3) = get(format!("/ui/jobs/{nowhere}")).await;
    assert_eq!((s1, s2, s3), (404, 404, 404));
    assert_eq!(p1.replace(&closed.to_string(), "N"), p3.replace(&nowhere.to_string(), "N"));
    assert_eq!(p2.replace(&mirror.to_string(), "N"), p3.replace(&nowhere.to_string(), "N"));
    let (s4, _) = get(format!("/ui/jobs/{closed}/events")).await;
    assert_eq!(s4, 404);
    // Anonymous live streams take at most half of the places; a signed-in one still gets one.
    let mut held = Vec::new();
    let mut refused = None;
    for i in 0..200 {
        let r = http.get(format!("{}/ui/events", c.url)).send().await.unwrap();
        if r.status() == 503 {
            refused = Some(i);
            break;
        }
        held.push(r);
    }
    assert_eq!(refused, Some(128), "anonymous streams should stop at half of 256");
    let r = http.get(format!("{}/ui/events", c.url)).bearer_auth(&c.token).send().await.unwrap();
    assert_eq!(r.status(), 200, "a signed-in viewer still gets a live stream");
    drop(held);
    let api = c.api_in_blocking();
    blocking(move || {
        let api = api();
        for id in [open, closed, mirror] {
            api.cancel(id);
        }
    })
    .await;
    c.stop().await;
}

/// Regression (issue 27): the dashboard read a remote's repository by dropping everything up
/// to the last `@`, so `https://other.host/team/x@github.com/acme/open.git` passed for the
/// public `github.com/acme/open`, and its jobs and logs were shown to anyone. The same
/// owner/name on another host is another repository too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_look_alike_remote_with_an_at_sign_in_its_path_is_not_public() {
    let c = InProc::start_with("dash-lookalike", |cfg| cfg.public_repositories = vec!["acme/open".into()]).await;
    let api = c.api_in_blocking();
    let (open, lookalike, gitlab) = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let yaml = "steps:\n  - key: hello\n    command: echo \"hello from $GPUCI_STEP_KEY\"\n";
        let open = api.submit_from(yaml, Some("https://github.com/acme/open.git")).jobs[0].id;
        let lookalike = api.submit_from(yaml, Some("https://other.host/team/x@github.com/acme/open.git")).jobs[0].id;
        let gitlab = api.submit_from(yaml, Some("https://gitlab.com/acme/open.git")).jobs[0].id;
        for id in [open, lookalike, gitlab] {
            api.wait_job(id, "done", T, |j| j.state.is_terminal());
        }
        (open, lookalike, gitlab)
    })
    .await;
    let get = |path: String| {
        let url = format!("{}{path}", c.url);
        async move {
            let r = reqwest::get(url).await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    assert_eq!(get(format!("/ui/jobs/{open}")).await.0, 200, "the public repository's job");
    for id in [lookalike, gitlab] {
        let (status, page) = get(format!("/ui/jobs/{id}")).await;
        assert_eq!(status, 404, "job {id} is not public: {page}");
        assert_eq!(get(format!("/ui/jobs/{id}/events")).await.0, 404);
    }
    let (_, list) = get("/ui/jobs".to_string()).await;
    assert!(list.contains(&format!("#{open}")), "{list}");
    for id in [lookalike, gitlab] {
        assert!(!list.contains(&format!("#{id}<")) && !list.contains(&format!("#{id} ")), "{list}");
    }
    // The builds list (issue 30) decides the same way.
    let (_, builds) = get("/ui/".to_string()).await;
    let api = c.api_in_blocking();
    let pipelines = blocking(move || {
        let api = api();
        [open, lookalike, gitlab].map(|j| api.job(j).pipeline_id)
    })
    .await;
    assert!(builds.contains(&format!("id=\"build-{}\"", pipelines[0])), "{builds}");
    for p in &pipelines[1..] {
        assert!(!builds.contains(&format!("id=\"build-{p}\"")), "{builds}");
    }
    c.stop().await;
}

/// Regression (issue 27): metrics labelled a job's repository `owner/name`, so
/// `gitlab.com/acme/x` and `github.com/acme/x` were one series (and one line of cost, one
/// budget). Each is now named with its host.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_owner_and_name_on_two_hosts_are_two_repositories_in_metrics() {
    let c = InProc::start("dash-hosts").await;
    let api = c.api_in_blocking();
    let (a, b, fake) = (c.a.clone(), c.b.clone(), c.fake.clone());
    blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let yaml = "steps:\n  - key: burn\n    gpus: 1\n    command: sleep 30\n";
        let one = api.submit_from(yaml, Some("https://github.com/acme/x.git")).jobs[0].id;
        let two = api.submit_from(yaml, Some("git@gitlab.com:acme/x.git")).jobs[0].id;
        for id in [one, two] {
            api.wait_job(id, "running", T, |j| j.state == JobState::Running);
        }
        for uuid in [&a, &b] {
            fake.set(uuid, |s| s.utilization_pct = 55);
        }
    })
    .await;
    let read_token = std::fs::read_to_string(c.data_dir().join("server/read-token")).unwrap();
    let http = reqwest::Client::new();
    let t0 = Instant::now();
    loop {
        let text = http
            .get(format!("{}/metrics", c.url))
            .bearer_auth(read_token.trim())
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let series = |repo: &str| {
            text.lines()
                .any(|l| l.starts_with("gpuci_gpu_utilization_ratio{") && l.contains(&format!("repository=\"{repo}\"")))
        };
        if series("github.com/acme/x") && series("gitlab.com/acme/x") {
            assert!(!text.contains("repository=\"acme/x\""), "{text}");
            break;
        }
        assert!(t0.elapsed() < T, "not two series, one per host, yet:\n{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    c.stop().await;
}

// ---- issue 30: the builds view and the dashboard's defects -----------------------------------

/// A read-only session cookie from signing in over HTTP.
async fn session_cookie(url: &str, token: &str) -> String {
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let r = http.post(format!("{url}/ui/login")).form(&[("token", token.trim())]).send().await.unwrap();
    assert_eq!(r.status(), 303);
    r.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string()
}

/// Regression (issue 30): the memory chart's live updates were drawn without the GPUs'
/// total, so a running job's page said "of 0.0 GiB" two seconds after it opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_memory_chart_keeps_its_total_on_live_updates() {
    let c = InProc::start("dash-chart").await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    let (api, a, fake) = (c.api_in_blocking(), c.a.clone(), c.fake.clone());
    let id = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let id = api.submit("steps:\n  - key: burn\n    gpus: 1\n    command: sleep 60\n").jobs[0].id;
        api.wait_job(id, "running", T, |j| j.state == JobState::Running);
        fake.set(&a, |s| s.memory_used = Bytes(20 << 30));
        id
    })
    .await;
    b.sign_in(&c.url, &c.token, &format!("/ui/jobs/{id}")).await;
    b.wait_text("the first chart", |t| t.contains("peak")).await;
    // The total as the page was served (the leased GPU's memory), to hold live updates to.
    let served = b.text("#charts").await;
    let total = served.split(" of ").nth(1).and_then(|t| t.lines().next()).unwrap_or_default().to_string();
    assert!(total.ends_with("GiB") && !total.starts_with("0.0"), "{served}");
    // The charts are replaced by a live update: wait for a new figure, then read it.
    b.client.execute("window.__fig = document.querySelector('#charts figure'); return 1", vec![]).await.unwrap();
    let t0 = Instant::now();
    loop {
        let replaced =
            b.client.execute("return document.querySelector('#charts figure') !== window.__fig", vec![]).await.unwrap();
        if replaced == serde_json::json!(true) {
            break;
        }
        assert!(t0.elapsed() < T, "no live chart update");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let charts = b.text("#charts").await;
    assert!(charts.contains(&format!("peak 20.0 GiB of {total}")), "the leased H100's total, {total}: {charts}");
    assert!(!charts.contains("of 0.0 GiB"), "{charts}");
    let api = c.api_in_blocking();
    blocking(move || api().cancel(id)).await;
    b.close().await;
    c.stop().await;
}

/// Regression (issue 30): the jobs list printed each GPU as its UUID's first 12 characters,
/// the same for both GPUs of a simulated host (`GPU-<host hash>`). Each now has a name no
/// other GPU on the page has, and its whole UUID as its title.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpus_on_one_page_have_names_that_tell_them_apart() {
    let c = InProc::start("dash-uuids").await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    assert_eq!(c.a[..12], c.b[..12], "the premise: the two simulated GPUs share a prefix");
    let api = c.api_in_blocking();
    let id = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let id = api.submit("steps:\n  - key: both\n    gpus: 2\n    command: echo two\n").jobs[0].id;
        api.wait_job(id, "done", T, |j| j.state.is_terminal()).id
    })
    .await;
    b.sign_in(&c.url, &c.token, "/ui/jobs").await;
    let cells = b
        .client
        .execute(
            &format!("return [...document.querySelectorAll('#job-{id} code.uuid')].map(e => [e.textContent, e.title])"),
            vec![],
        )
        .await
        .unwrap();
    let cells: Vec<(String, String)> = serde_json::from_value(cells).unwrap();
    assert_eq!(cells.len(), 2, "{cells:?}");
    assert_ne!(cells[0].0, cells[1].0, "two GPUs, one name: {cells:?}");
    let titles: std::collections::BTreeSet<&str> = cells.iter().map(|c| c.1.as_str()).collect();
    assert_eq!(titles, [c.a.as_str(), c.b.as_str()].into_iter().collect(), "full UUIDs in the titles");
    for (short, full) in &cells {
        assert!(short.len() < full.len() && full.ends_with(short.trim_start_matches('…')), "{short} of {full}");
    }
    b.close().await;
    c.stop().await;
}

/// Regression (issue 30): the raw log (`/api/v1/jobs/N/logs`, linked from the job page)
/// answered 401 to a signed-in read-only user. It follows the job page's rules now: any
/// dashboard session reads it, nobody reads a public repository's, and a private job's log
/// is refused to nobody-signed-in as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_raw_log_follows_the_job_pages_read_rules() {
    let c = InProc::start_with("dash-rawlog", |cfg| cfg.public_repositories = vec!["acme/open".into()]).await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    let api = c.api_in_blocking();
    let (open, closed) = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let yaml = "steps:\n  - key: hello\n    gpus: 1\n    command: echo \"raw line from $GPUCI_STEP_KEY\"\n";
        let open = api.submit_from(yaml, Some("https://github.com/acme/open.git")).jobs[0].id;
        let closed = api.submit_from(yaml, Some("https://github.com/acme/secret.git")).jobs[0].id;
        api.wait_job(open, "done", T, |j| j.state.is_terminal());
        api.wait_job(closed, "done", T, |j| j.state.is_terminal());
        (open, closed)
    })
    .await;
    let read_token = std::fs::read_to_string(c.data_dir().join("server/read-token")).unwrap();
    // In the browser, signed in read-only: the raw log the page links to opens (fetched as
    // the link would be: Chromium saves NDJSON instead of showing it).
    b.sign_in(&c.url, read_token.trim(), &format!("/ui/jobs/{closed}")).await;
    let got = b
        .client
        .execute_async(
            &format!("const done = arguments[arguments.length - 1]; fetch('/api/v1/jobs/{closed}/logs', {{credentials: 'same-origin'}}).then(r => r.text().then(t => done([r.status, t])))"),
            vec![],
        )
        .await
        .unwrap();
    let (status, body): (u16, String) = serde_json::from_value(got).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("raw line from hello") && body.contains("\"end\""), "{body}");
    b.close().await;
    // Over HTTP: the read-only cookie, nobody, a made-up cookie, the API token.
    let http = reqwest::Client::new();
    let logs = |id: i64| format!("{}/api/v1/jobs/{id}/logs", c.url);
    let reader = session_cookie(&c.url, &read_token).await;
    let r = http.get(logs(closed)).header("cookie", &reader).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("raw line from hello"));
    let r = http.get(logs(closed)).send().await.unwrap();
    assert_eq!(r.status(), 401, "a private job's log, nobody signed in");
    assert!(!r.text().await.unwrap().contains("raw line"));
    let forged = reader.replace("gpuci_session=read.", "gpuci_session=admin.");
    assert_eq!(http.get(logs(closed)).header("cookie", forged).send().await.unwrap().status(), 401);
    assert_eq!(http.get(logs(999_999)).send().await.unwrap().status(), 401, "as a private job");
    // A public repository's log, nobody signed in: gpuci's own lines lose GPU UUIDs.
    let r = http.get(logs(open)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("raw line from hello"), "{text}");
    assert!(!text.contains(&c.a) && !text.contains(&c.b), "no GPU UUIDs for anonymous readers: {text}");
    // The API's own rules stand: the admin token reads; the read-only token as a bearer is
    // still the API's 403.
    assert_eq!(http.get(logs(closed)).bearer_auth(&c.token).send().await.unwrap().status(), 200);
    assert_eq!(http.get(logs(closed)).bearer_auth(read_token.trim()).send().await.unwrap().status(), 403);
    c.stop().await;
}

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

/// Issue 30: a log's sections (Buildkite's `--- `/`+++ `, Actions' `::group::`) fold and
/// unfold, every line shows its time, and a hostile title stays text.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn log_sections_fold_and_lines_show_their_time() {
    let c = InProc::start("dash-sections").await;
    let Some(b) = Browser::start().await else { return c.stop().await };
    let api = c.api_in_blocking();
    let id = blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let yaml = r#"steps:
  - key: sections
    command: |
      echo "before any section"
      echo "--- :hammer: Build"
      echo "compiling a"
      echo "compiling b"
      echo "::group::<img src=x onerror=alert(1)>"
      echo "inside the group"
      echo "::endgroup::"
      echo "+++ Tests"
      echo "test output"
"#;
        let id = api.submit(yaml).jobs[0].id;
        api.wait_job(id, "done", T, |j| j.state.is_terminal()).id
    })
    .await;
    b.sign_in(&c.url, &c.token, &format!("/ui/jobs/{id}")).await;
    b.wait_text("the log", |t| t.contains("test output")).await;
    let shown = |text: &'static str| {
        let client = b.client.clone();
        async move {
            let js = format!(
                "return [...document.querySelectorAll('#log li')].filter(l => l.textContent.includes({text:?})).map(l => l.offsetParent !== null)"
            );
            let v: Vec<bool> = serde_json::from_value(client.execute(&js, vec![]).await.unwrap()).unwrap();
            assert_eq!(v.len(), 1, "{text}: {v:?}");
            v[0]
        }
    };
    assert!(shown("before any section").await);
    assert!(!shown("compiling a").await, "`---` folds its section");
    assert!(!shown("inside the group").await, "`::group::` folds its section");
    assert!(shown("test output").await, "`+++` opens its section");
    let toggles = b.client.find_all(Locator::Css("#log button.sec-toggle")).await.unwrap();
    assert_eq!(toggles.len(), 3);
    assert_eq!(toggles[0].text().await.unwrap().trim(), ":hammer: Build");
    assert_eq!(toggles[1].text().await.unwrap().trim(), "<img src=x onerror=alert(1)>", "the title is text");
    let imgs = b.client.execute("return document.querySelectorAll('#log img').length", vec![]).await.unwrap();
    assert_eq!(imgs, serde_json::json!(0));
    toggles[0].click().await.unwrap();
    assert!(shown("compiling a").await && shown("compiling b").await, "unfolded");
    assert_eq!(toggles[0].attr("aria-expanded").await.unwrap().as_deref(), Some("true"));
    assert!(!shown("inside the group").await, "the other section stays folded");
    // Each line carries its time.
    let times = b.client.find_all(Locator::Css("#log li time.ts")).await.unwrap();
    assert!(times.len() >= 9, "{}", times.len());
    let t = times[0].text().await.unwrap();
    assert!(t.len() == 8 && t.as_bytes()[2] == b':' && t.as_bytes()[5] == b':', "{t}");
    b.screenshot("job-sections").await;
    b.close().await;
    c.stop().await;
}
