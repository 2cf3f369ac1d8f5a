//! Workspace uploads are garbage-collected (issue 29, shared uploads): with a short
//! `[uploads] retention`, an old finished pipeline's upload is deleted and a queued pipeline's
//! is kept; a download of the collected one answers 410 Gone, and a job that needs it (a retry
//! by hand) fails with that reason instead of waiting. Real server and agent processes.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn archive(name: &str, text: &str) -> Vec<u8> {
    let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    let mut h = tar::Header::new_gnu();
    h.set_size(text.len() as u64);
    h.set_mode(0o644);
    b.append_data(&mut h, name, text.as_bytes()).unwrap();
    b.into_inner().and_then(|gz| gz.finish()).unwrap()
}

fn upload(server: &Server, bytes: Vec<u8>) -> String {
    let r = server
        .api()
        .raw()
        .post(format!("{}/api/v1/uploads", server.url))
        .bearer_auth(&server.token)
        .header("content-type", "application/gzip")
        .body(bytes)
        .send()
        .unwrap();
    assert_eq!(r.status(), 201);
    r.json::<Value>().unwrap()["id"].as_str().unwrap().to_string()
}

/// Submit `yaml` naming `upload`; the id of its one job.
fn submit(server: &Server, yaml: &str, upload: &str) -> i64 {
    let r = server
        .api()
        .raw()
        .post(format!("{}/api/v1/pipelines", server.url))
        .bearer_auth(&server.token)
        .json(&json!({"file_name": "x.yml", "source": yaml, "workspace_upload": upload}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 201);
    r.json::<Value>().unwrap()["jobs"][0]["id"].as_i64().unwrap()
}

fn stored(server: &Server, id: &str) -> bool {
    server.data_dir.join("uploads").join(format!("{id}.tar.gz")).is_file()
}

fn metrics(server: &Server) -> String {
    let r = server.api().raw().get(format!("{}/metrics", server.url)).bearer_auth(&server.token).send().unwrap();
    r.text().unwrap()
}

/// Retry job `id` by hand, from the dashboard (sign in, the page's form token, the button).
fn retry_from_dashboard(server: &Server, id: i64) {
    let http = reqwest::blocking::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let r = http.post(format!("{}/ui/login", server.url)).form(&[("token", server.token.as_str())]).send().unwrap();
    assert_eq!(r.status(), 303);
    let cookie = r.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
    let page =
        http.get(format!("{}/ui/jobs/{id}", server.url)).header("cookie", &cookie).send().unwrap().text().unwrap();
    let csrf = page.split("name=\"csrf\" value=\"").nth(1).unwrap().split('"').next().unwrap().to_string();
    let r = http
        .post(format!("{}/ui/jobs/{id}/retry", server.url))
        .header("cookie", &cookie)
        .form(&[("csrf", csrf)])
        .send()
        .unwrap();
    assert_eq!(r.status(), 303, "retry refused: {}", r.text().unwrap_or_default());
}

fn start(dir: &Path) -> (Server, Agent) {
    let config = dir.join("server.toml");
    std::fs::write(&config, "[uploads]\nretention = \"2s\"\n").unwrap();
    let args = ["--heartbeat", "200ms", "--upload-collect-interval", "200ms", "--config"];
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.push(config.display().to_string());
    let server = Server::start_on(&dir.join("server"), "127.0.0.1:0", args);
    let agent = Agent::start(&server, &dir.join("agent"), "a1", &["--isolation", isolation()]);
    server.api().wait_agents(1, T);
    (server, agent)
}

#[test]
fn an_old_finished_pipelines_upload_goes_a_queued_ones_stays_and_a_job_needing_the_gone_one_fails_with_410() {
    let dir = tempdir();
    let (server, agent) = start(dir.path());
    let api = server.api();

    let finished = upload(&server, archive("a.txt", "from the finished pipeline\n"));
    let job = submit(&server, "steps:\n  - key: a\n    command: cat a.txt\n", &finished);
    let j = api.wait_job(job, "the first job to end", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Succeeded, "{j:?}");
    // A pipeline that waits: no agent serves its queue.
    let queued_bytes = archive("b.txt", "from the queued pipeline\n");
    let queued_len = queued_bytes.len();
    let queued = upload(&server, queued_bytes);
    let waiting =
        submit(&server, "steps:\n  - key: b\n    agents: {queue: nowhere}\n    command: cat b.txt\n", &queued);

    // Two seconds after the first pipeline finished, its upload goes.
    wait_until("the finished pipeline's upload to be collected", T, || !stored(&server, &finished));
    wait_until("the collection to be counted", T, || {
        metrics(&server).contains("gpuci_uploads_collected_total{why=\"retention\"} 1")
    });
    // The queued pipeline's upload outlives its retention many times over.
    std::thread::sleep(Duration::from_secs(3));
    assert!(stored(&server, &queued), "a queued pipeline's upload was deleted");
    assert_eq!(api.job(waiting).state, JobState::Queued);
    let m = metrics(&server);
    assert!(m.contains("\ngpuci_uploads 1\n"), "{m}");
    assert!(m.contains(&format!("\ngpuci_uploads_bytes {queued_len}\n")), "{m}");
    assert!(m.contains("gpuci_uploads_collected_bytes_total{why=\"retention\"} "), "{m}");

    // Downloading the collected upload: 410 with the reason; one never stored: 404.
    let get = |id: &str| {
        api.raw().get(format!("{}/api/v1/uploads/{id}", server.url)).bearer_auth(&server.token).send().unwrap()
    };
    let r = get(&finished);
    assert_eq!(r.status(), 410);
    let error = r.json::<Value>().unwrap()["error"].as_str().unwrap().to_string();
    assert!(error.contains(&finished) && error.contains("garbage-collected") && error.contains("retention"), "{error}");
    assert_eq!(get(&"0".repeat(64)).status(), 404);
    // Naming it in a new pipeline is refused at once.
    let r = api
        .raw()
        .post(format!("{}/api/v1/pipelines", server.url))
        .bearer_auth(&server.token)
        .json(&json!({"file_name": "x.yml", "source": "steps:\n  - key: c\n    command: true\n", "workspace_upload": finished}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 422);

    // A retry by hand needs it. The agent's own copy is dropped first, as an agent that never
    // ran the job would not have one: the job fails, saying why, and does not wait.
    std::fs::remove_file(agent.data_dir.join("uploads").join(format!("{finished}.tar.gz"))).unwrap();
    retry_from_dashboard(&server, job);
    let pipeline = api.job(job).pipeline_id;
    let jobs = api.get::<Vec<gpuci_protocol::api::JobSummary>>(&format!("/api/v1/jobs?pipeline={pipeline}"));
    let retry = jobs.iter().find(|r| r.id > job).unwrap().id;
    let r = api.wait_job(retry, "the retry to end", T, |j| j.state.is_terminal());
    assert_eq!(r.state, JobState::Failed, "{r:?}");
    assert!(r.reason.contains("410 Gone") && r.reason.contains(&format!("upload {finished} is gone")), "{}", r.reason);
}

#[test]
fn a_zero_retention_is_refused_with_where_it_is() {
    let dir = tempdir();
    let config = dir.path().join("server.toml");
    std::fs::write(&config, "[uploads]\nretention = \"0s\"\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("server"))
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("server.toml:2:1: uploads.retention: must be at least 1s"), "{stderr}");
}
