//! A job starts in a workspace holding its source: what `gpuci submit` uploaded
//! (`POST /api/v1/uploads`), downloaded by the agent with its own credential and unpacked
//! safely. Real server and agent processes, as in `system.rs`.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn setup(dir: &Path) -> (Server, Agent) {
    let server = Server::start(&dir.join("server"), "30s");
    let agent = Agent::start(&server, &dir.join("agent"), "a1", &["--isolation", isolation()]);
    server.api().wait_agents(1, T);
    (server, agent)
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, text).expect("write");
}

fn submit_wait(server: &Server, file: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .arg("submit")
        .arg(file)
        .args(["--wait", "--server", &server.url, "--token", &server.token])
        .args(extra)
        .output()
        .expect("run gpuci submit")
}

/// Every log line of a job, system lines included.
fn all_log(server: &Server, job: i64) -> String {
    let r = server
        .api()
        .raw()
        .get(format!("{}/api/v1/jobs/{job}/logs", server.url))
        .bearer_auth(&server.token)
        .send()
        .expect("logs");
    r.text().expect("body")
}

fn post_upload(server: &Server, bytes: Vec<u8>, token: Option<&str>) -> reqwest::blocking::Response {
    let mut req = server
        .api()
        .raw()
        .post(format!("{}/api/v1/uploads", server.url))
        .header("content-type", "application/gzip")
        .body(bytes);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().expect("upload")
}

fn upload_id(server: &Server, bytes: Vec<u8>) -> String {
    let r = post_upload(server, bytes, Some(&server.token));
    assert_eq!(r.status(), 201);
    let v: Value = r.json().expect("json");
    v["id"].as_str().expect("id").to_string()
}

fn submit_raw(server: &Server, yaml: &str, upload: &str) -> reqwest::blocking::Response {
    server
        .api()
        .raw()
        .post(format!("{}/api/v1/pipelines", server.url))
        .bearer_auth(&server.token)
        .json(&json!({"file_name": "x.yml", "source": yaml, "workspace_upload": upload}))
        .send()
        .expect("submit")
}

type Tar = tar::Builder<flate2::write::GzEncoder<Vec<u8>>>;

fn archive(build: impl FnOnce(&mut Tar)) -> Vec<u8> {
    let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    build(&mut b);
    b.into_inner().and_then(|gz| gz.finish()).expect("archive")
}

fn header(kind: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(0o644);
    h
}

#[test]
fn a_job_sees_the_files_submit_uploaded() {
    let dir = tempdir();
    let (server, _agent) = setup(dir.path());
    let proj = dir.path().join("proj");
    write(&proj.join("data/input.txt"), "hello from the upload\n");
    write(&proj.join("script.sh"), "#!/bin/sh\necho script ran\n");
    std::fs::set_permissions(proj.join("script.sh"), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    write(&proj.join(".git/config"), "not a repo, but skipped all the same\n");
    let file = proj.join(".gpuci.yml");
    write(
        &file,
        "steps:\n  - key: look\n    command: cat data/input.txt && test -x script.sh && ./script.sh && test ! -e .git && echo all-good\n",
    );
    let out = submit_wait(&server, &file, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    assert!(stderr.contains("uploading 3 files"), "{stderr}");
    let jobs = server.api().get::<Vec<gpuci_protocol::api::JobSummary>>("/api/v1/jobs");
    let job = jobs[0].id;
    let log = server.api().log_text(job);
    assert!(log.contains("hello from the upload") && log.contains("script ran") && log.contains("all-good"), "{log}");
    let all = all_log(&server, job);
    assert!(all.contains("workspace: 3 files from upload "), "{all}");

    // --no-upload: an empty workspace.
    write(&file, "steps:\n  - key: empty\n    command: test ! -e data/input.txt && echo empty-ok\n");
    let out = submit_wait(&server, &file, &["--no-upload"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn in_a_git_work_tree_the_files_git_lists_are_uploaded_from_its_root() {
    if Command::new("git").arg("--version").output().is_err() {
        eprintln!("git is not installed; skipped");
        return;
    }
    let dir = tempdir();
    let (server, _agent) = setup(dir.path());
    let repo = dir.path().join("repo");
    write(&repo.join("src/lib.txt"), "tracked\n");
    write(&repo.join("new.txt"), "untracked\n");
    write(&repo.join("build/out.bin"), "ignored\n");
    write(&repo.join(".gitignore"), "build/\n");
    let git = |args: &[&str]| {
        let out = Command::new("git").arg("-C").arg(&repo).args(args).output().expect("git");
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    git(&["init", "-q"]);
    git(&["add", "src/lib.txt", ".gitignore"]);
    let file = repo.join("ci/.gpuci.yml");
    write(
        &file,
        "steps:\n  - key: look\n    command: cat src/lib.txt new.txt && test ! -e build && test ! -e .git && test -f ci/.gpuci.yml\n",
    );
    let out = submit_wait(&server, &file, &[]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
}

/// The coordinator refuses a `repository` that names none (`gpuci_core::repo`). In a work tree
/// whose `origin` names none (`%20` in an Azure DevOps URL), `gpuci submit` is not refused: it
/// submits for the work tree's path and says on stderr why the origin was passed over.
#[test]
fn an_origin_that_names_no_repository_is_passed_over_and_said() {
    if Command::new("git").arg("--version").output().is_err() {
        eprintln!("git is not installed; skipped");
        return;
    }
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let repo = dir.path().join("repo");
    let file = repo.join(".gpuci.yml");
    write(&file, "steps:\n  - key: a\n    command: echo hi\n");
    let origin = "https://dev.azure.com/org/My%20Project/_git/repo";
    for args in [&["init", "-q"][..], &["remote", "add", "origin", origin]] {
        let out = Command::new("git").arg("-C").arg(&repo).args(args).output().expect("git");
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = Command::new(BIN)
        .arg("submit")
        .arg(&file)
        .args(["--no-upload", "--server", &server.url, "--token", &server.token])
        .output()
        .expect("run gpuci submit");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    assert!(stderr.contains(origin) && stderr.contains("names no repository"), "{stderr}");
    assert!(stderr.contains("submitting for the work tree /"), "{stderr}");
}

#[test]
fn malicious_archives_are_refused_and_nothing_is_written_outside() {
    let dir = tempdir();
    let (server, agent) = setup(dir.path());
    let api = server.api();
    let dotdot = archive(|b| {
        let mut h = header(tar::EntryType::Regular, 5);
        // The raw name field: the builder's own checks would refuse `..`.
        let name = b"../escape";
        h.as_gnu_mut().expect("gnu").name[..name.len()].copy_from_slice(name);
        h.set_cksum();
        b.append(&h, &b"owned"[..]).expect("append");
    });
    let symlink = archive(|b| {
        let mut h = header(tar::EntryType::Symlink, 0);
        b.append_link(&mut h, "etc", "/etc").expect("append");
        let mut h = header(tar::EntryType::Regular, 5);
        b.append_data(&mut h, "etc/gpuci-escape", &b"owned"[..]).expect("append");
    });
    for (what, bytes, expect) in [("..", dotdot, "`..`"), ("symlink", symlink, "symlink")] {
        let id = upload_id(&server, bytes);
        let r = submit_raw(&server, "steps:\n  - key: bad\n    command: echo should-not-run\n", &id);
        assert_eq!(r.status(), 201, "{what}");
        let p: gpuci_protocol::api::PipelineSummary = r.json().expect("json");
        let done = api.wait_pipeline(p.id, T);
        let j = &done.jobs[0];
        assert_eq!(j.state.to_string(), "failed", "{what}: {j:?}");
        assert!(j.reason.contains(&format!("upload {id}")) && j.reason.contains(expect), "{what}: {}", j.reason);
        assert!(!api.log_text(j.id).contains("should-not-run"), "{what}");
    }
    assert!(!agent.data_dir.join("work/escape").exists() && !agent.data_dir.join("escape").exists());
    assert!(!Path::new("/etc/gpuci-escape").exists());
}

#[test]
fn uploads_need_a_token_or_an_agent_credential_and_submits_a_stored_upload() {
    let dir = tempdir();
    let (server, agent) = setup(dir.path());
    let http = server.api().raw().clone();
    let bytes = archive(|b| {
        let mut h = header(tar::EntryType::Regular, 2);
        b.append_data(&mut h, "a.txt", &b"hi"[..]).expect("append");
    });

    // Unauthenticated, or not gzip: refused.
    assert_eq!(post_upload(&server, bytes.clone(), None).status(), 401);
    assert_eq!(post_upload(&server, bytes.clone(), Some("gpuci_api_wrong")).status(), 401);
    assert_eq!(post_upload(&server, b"plain text".to_vec(), Some(&server.token)).status(), 400);

    // Content-addressed: the same bytes, the same id, stored once.
    let id = upload_id(&server, bytes.clone());
    assert_eq!(id.len(), 64);
    assert_eq!(upload_id(&server, bytes.clone()), id);
    let stored: Vec<_> = std::fs::read_dir(server.data_dir.join("uploads")).expect("uploads dir").flatten().collect();
    assert_eq!(stored.len(), 1, "{stored:?}");

    // Downloads: with the API token, with an agent's credential; not without either.
    let url = format!("{}/api/v1/uploads/{id}", server.url);
    let r = http.get(&url).bearer_auth(&server.token).send().expect("get");
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().expect("bytes").to_vec(), bytes);
    let ident: Value =
        serde_json::from_str(&std::fs::read_to_string(agent.data_dir.join("agent.json")).expect("agent.json"))
            .expect("identity");
    let (agent_id, credential) =
        (ident["agent_id"].as_str().expect("agent_id"), ident["credential"].as_str().expect("credential"));
    let r = http.get(&url).bearer_auth(credential).header("x-gpuci-agent-id", agent_id).send().expect("get");
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().expect("bytes").to_vec(), bytes);
    let r = http.get(&url).bearer_auth("gpuci_agent_wrong").header("x-gpuci-agent-id", agent_id).send().expect("get");
    assert_eq!(r.status(), 401);
    assert_eq!(http.get(&url).send().expect("get").status(), 401);
    let r = http.get(format!("{}/api/v1/uploads/{}", server.url, "0".repeat(64))).bearer_auth(&server.token).send();
    assert_eq!(r.expect("get").status(), 404);
    let r = http.get(format!("{}/api/v1/uploads/nope", server.url)).bearer_auth(&server.token).send();
    assert_eq!(r.expect("get").status(), 400);

    // A submit naming an upload that is not stored: 422.
    let r = submit_raw(&server, "steps:\n  - key: t\n    command: true\n", &"f".repeat(64));
    assert_eq!(r.status(), 422);
    let body: Value = r.json().expect("json");
    assert!(body["error"].as_str().unwrap_or_default().contains("workspace_upload"), "{body}");
    assert_eq!(submit_raw(&server, "steps:\n  - key: t\n    command: true\n", "../../etc/passwd").status(), 422);
    // And one that is: the job runs in it.
    let r = submit_raw(&server, "steps:\n  - key: t\n    command: test \"$(cat a.txt)\" = hi\n", &id);
    assert_eq!(r.status(), 201);
    let p: gpuci_protocol::api::PipelineSummary = r.json().expect("json");
    let done = server.api().wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
}

fn submit_inline(server: &Server, body: Value) -> reqwest::blocking::Response {
    server
        .api()
        .raw()
        .post(format!("{}/api/v1/pipelines", server.url))
        .bearer_auth(&server.token)
        .json(&body)
        .send()
        .expect("submit")
}

/// A small workspace goes with the pipeline (`workspace_archive`): stored as an upload is
/// (same content, same id), and refused with a 422 that says why when it is not base64, not
/// gzip, too large, or given beside `workspace_upload`; nothing is stored then.
#[test]
fn a_small_workspace_sent_with_the_pipeline_is_stored_as_an_upload() {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let dir = tempdir();
    let (server, _agent) = setup(dir.path());
    let bytes = archive(|b| {
        let mut h = header(tar::EntryType::Regular, 2);
        b.append_data(&mut h, "a.txt", &b"hi"[..]).expect("append");
    });
    let yaml = "steps:\n  - key: t\n    command: test \"$(cat a.txt)\" = hi\n";
    let uploads = || std::fs::read_dir(server.data_dir.join("uploads")).map(|d| d.count()).unwrap_or(0);

    let refused = |body: Value, says: &str| {
        let r = submit_inline(&server, body);
        assert_eq!(r.status(), 422);
        let body: Value = r.json().expect("json");
        let error = body["error"].as_str().unwrap_or_default().to_string();
        assert!(error.contains(says), "{error}");
    };
    refused(json!({"file_name": "x.yml", "source": yaml, "workspace_archive": "not base64!"}), "not base64");
    refused(json!({"file_name": "x.yml", "source": yaml, "workspace_archive": b64(b"plain text")}), "not gzip");
    let mut big = vec![0x1f, 0x8b];
    big.resize(gpuci_protocol::api::MAX_INLINE_WORKSPACE_BYTES + 1, 0);
    refused(json!({"file_name": "x.yml", "source": yaml, "workspace_archive": b64(&big)}), "larger than 512 KiB");
    refused(
        json!({"file_name": "x.yml", "source": yaml, "workspace_archive": b64(&bytes), "workspace_upload": "f".repeat(64)}),
        "not both",
    );
    // An invalid pipeline stores nothing either.
    refused(
        json!({"file_name": "x.yml", "source": "steps: 3\n", "workspace_archive": b64(&bytes)}),
        "not a valid pipeline",
    );
    assert_eq!(uploads(), 0);

    let r = submit_inline(&server, json!({"file_name": "x.yml", "source": yaml, "workspace_archive": b64(&bytes)}));
    assert_eq!(r.status(), 201);
    let p: gpuci_protocol::api::PipelineSummary = r.json().expect("json");
    let done = server.api().wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    // Stored under the id a separate upload of the same bytes gets.
    assert_eq!(uploads(), 1);
    let id = upload_id(&server, bytes);
    assert!(server.data_dir.join("uploads").join(format!("{id}.tar.gz")).is_file());
    assert_eq!(uploads(), 1);
}

/// `gpuci bench client` runs real `gpuci submit --wait` processes from a git work tree and
/// prints the client path beside the in-process path and the bare-bubblewrap floor (figures
/// are BENCHMARKS.md's business; here only that each is measured).
#[test]
fn bench_client_measures_the_client_path_beside_the_floor() {
    if Command::new("git").arg("--version").output().is_err() {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "CI=true but git is not installed");
        return;
    }
    let iso = isolation();
    let out = Command::new(BIN)
        .args(["bench", "client", "--jobs", "2", "--isolation", iso, "--job-disk", "none"])
        .env("GPUCI_LOG", "warn")
        .output()
        .expect("run gpuci bench client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("client: gpuci submit --wait → first instruction (2 runs): p50"), "{stdout}");
    assert!(stdout.contains("in-process submit → first instruction (2 runs)"), "{stdout}");
    if iso == "bubblewrap" {
        assert!(stdout.contains("bare bwrap floor") && stdout.contains("/ bare bwrap p50"), "{stdout}");
    }
}

/// `gpuci bench sandbox` times a job's start in a ready sandbox, from a warm start and cold, beside the bare
/// bwrap floor with the job's seccomp filter (root with bubblewrap; the figures are
/// BENCHMARKS.md's business).
#[test]
fn bench_sandbox_measures_warm_and_cold_starts_beside_the_floor() {
    if isolation() != "bubblewrap" || !nix::unistd::geteuid().is_root() {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "CI=true: this runs as root with bubblewrap");
        return;
    }
    let out = Command::new(BIN)
        .args(["bench", "sandbox", "--runs", "2", "--gap", "5ms"])
        .env("GPUCI_LOG", "warn")
        .output()
        .expect("run gpuci bench sandbox");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    for row in [
        "ready sandbox: spawn → `true` exited (2 runs)",
        "warm start: spawn → `true` exited (2 runs)",
        "cold start: spawn → `true` exited (2 runs)",
        "seccomp filter) (2 runs)",
        "p50 over the floor: ready",
    ] {
        assert!(stdout.contains(row), "{row}: {stdout}");
    }
}
