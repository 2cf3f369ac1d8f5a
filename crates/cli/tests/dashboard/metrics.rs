//! `/metrics`: valid for `promtool`, a running job's GPU attributed to it, repositories named
//! with their host.

use super::*;

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
