//! What a signed-in person sees and does in the browser: a log arriving live, a job cancelled
//! from its page, a quarantined GPU released, the main pages from the keyboard, the memory
//! chart, GPU names, folding log sections; and the log-line latency benchmark (run by hand).

use super::*;

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
