//! The harness of the dashboard tests: the browser (headless Chromium over WebDriver), the
//! tools it needs, and the ticking job the pages watch.

use super::*;

pub(crate) const T: Duration = Duration::from_secs(30);
pub(crate) const TAB: &str = "\u{E004}";
pub(crate) const ENTER: &str = "\u{E007}";

pub(crate) fn tool(name: &str) -> Option<std::path::PathBuf> {
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
pub(crate) struct Browser {
    pub(crate) driver: Child,
    pub(crate) client: Client,
    pub(crate) _profile: tempfile::TempDir,
    /// One browser at a time: on a 2-core CI machine several Chromiums at once starve the
    /// coordinator they are watching.
    pub(crate) _turn: tokio::sync::OwnedMutexGuard<()>,
}

impl Browser {
    pub(crate) async fn start() -> Option<Browser> {
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

    pub(crate) async fn screenshot(&self, name: &str) {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        let png = self.client.screenshot().await.unwrap();
        std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
    }

    pub(crate) async fn text(&self, css: &str) -> String {
        self.client.find(Locator::Css(css)).await.unwrap().text().await.unwrap()
    }

    /// Waits until `f` holds of the page's body text.
    pub(crate) async fn wait_text(&self, what: &str, f: impl Fn(&str) -> bool) -> String {
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

    pub(crate) async fn sign_in(&self, url: &str, token: &str, next: &str) {
        self.client.goto(&format!("{url}/ui/login?next={next}")).await.unwrap();
        let field = self.client.find(Locator::Id("token")).await.unwrap();
        field.send_keys(token).await.unwrap();
        field.send_keys(ENTER).await.unwrap();
        self.wait_text("the sign-in to finish", |b| b.contains("Sign out")).await;
    }

    pub(crate) async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

pub(crate) static TURN: std::sync::OnceLock<std::sync::Arc<tokio::sync::Mutex<()>>> = std::sync::OnceLock::new();

/// A job that prints a numbered line every 100 ms for a minute.
pub(crate) const TICKS: &str =
    "steps:\n  - key: ticks\n    command: for i in $(seq 1 600); do echo \"tick $i\"; sleep 0.1; done\n";

/// Submits [`TICKS`] and returns its job once it runs.
pub(crate) async fn running_ticks(c: &InProc) -> i64 {
    let api = c.api_in_blocking();
    blocking(move || {
        let api = api();
        api.wait_agents(1, T);
        let p = api.submit(TICKS);
        api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running).id
    })
    .await
}

/// A read-only session cookie from signing in over HTTP.
pub(crate) async fn session_cookie(url: &str, token: &str) -> String {
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let r = http.post(format!("{url}/ui/login")).form(&[("token", token.trim())]).send().await.unwrap();
    assert_eq!(r.status(), 303);
    r.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string()
}
