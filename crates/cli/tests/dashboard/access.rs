//! Who may see and change what: public and private repositories' jobs and logs, look-alike
//! remotes, anonymous viewers, and the tokens a change needs.

use super::*;

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
