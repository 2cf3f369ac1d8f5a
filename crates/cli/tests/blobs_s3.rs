//! Uploads and artifacts in an S3 bucket (`[blobs] backend = "s3"`, docs/artifacts.md),
//! end to end against moto's S3 server: real coordinator and agent processes, credentials
//! from the standard AWS chain (the environment here). A step's artifacts reach the next
//! step and lie in the bucket, none in the data dir; a bucket that cannot be reached stops
//! the start with S3's answer; and two coordinators on one Postgres with one bucket: what the
//! leader stored is served by the standby after the leader is killed (docs/ha.md).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;
#[path = "../../aws/tests/common/moto.rs"]
mod moto;
#[path = "../../store/tests/common/pg.rs"]
#[allow(dead_code)]
mod pg;

use common::*;
use gpuci_core::job::JobState;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

/// The AWS chain, pinned to the environment: no shared files or instance metadata of the
/// machine running the tests.
const AWS_ENV: [(&str, &str); 5] = [
    ("AWS_ACCESS_KEY_ID", "test"),
    ("AWS_SECRET_ACCESS_KEY", "test"),
    ("AWS_EC2_METADATA_DISABLED", "true"),
    ("AWS_CONFIG_FILE", "/dev/null"),
    ("AWS_SHARED_CREDENTIALS_FILE", "/dev/null"),
];

/// A raw, unsigned S3 request to moto: the test's own view of the bucket.
fn s3(m: &moto::Moto, method: &str, path: &str) -> String {
    let addr = m.url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: AWS4-HMAC-SHA256 Credential=test/20260101/{}/s3/aws4_request, SignedHeaders=host, Signature=0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        moto::REGION
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Every key in `bucket` (ListObjectsV2; a test's few objects fit in one page).
fn keys(m: &moto::Moto, bucket: &str) -> Vec<String> {
    let listing = s3(m, "GET", &format!("/{bucket}?list-type=2"));
    assert!(listing.starts_with("HTTP/1.1 200"), "{listing}");
    listing.split("<Key>").skip(1).filter_map(|k| k.split("</Key>").next()).map(str::to_string).collect()
}

/// A server config naming `bucket` on moto.
fn config(dir: &Path, m: &moto::Moto, bucket: &str) -> PathBuf {
    let p = dir.join(format!("server-{bucket}.toml"));
    std::fs::write(
        &p,
        format!(
            "[blobs]\nbackend = \"s3\"\nbucket = \"{bucket}\"\nprefix = \"ci\"\nendpoint = \"{}\"\nregion = \"{}\"\npath_style = true\n",
            m.url,
            moto::REGION
        ),
    )
    .unwrap();
    // As an operator would (the server warns about a config file others can read).
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    p
}

fn make_bucket(m: &moto::Moto, bucket: &str) {
    let answer = s3(m, "PUT", &format!("/{bucket}"));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

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

fn submit(server: &Server, yaml: &str, upload: &str) -> i64 {
    let r = server
        .api()
        .raw()
        .post(format!("{}/api/v1/pipelines", server.url))
        .bearer_auth(&server.token)
        .json(&json!({"file_name": "x.yml", "source": yaml, "workspace_upload": upload}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().unwrap_or_default());
    r.json::<Value>().unwrap()["id"].as_i64().unwrap()
}

fn get_bytes(server: &Server, path: &str) -> (u16, Vec<u8>) {
    let r = server.api().raw().get(format!("{}{path}", server.url)).bearer_auth(&server.token).send().unwrap();
    (r.status().as_u16(), r.bytes().unwrap().to_vec())
}

/// Files (not directories) under `dir`, if it exists.
fn files_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten().filter(|e| e.path().is_file()).map(|e| e.file_name().to_string_lossy().into_owned()).collect()
        })
        .unwrap_or_default()
}

const PIPELINE: &str = r#"
steps:
  - key: build
    command: |
      test "$(cat input.txt)" = "from the workspace upload"
      head -c 3145728 /dev/urandom > blob.bin
      sha256sum blob.bin > sums.txt
      printf '<testsuite><testcase name="ok"/><testcase name="bad"><failure message="no"/></testcase></testsuite>' > report.xml
    artifacts: [blob.bin, sums.txt]
    test_reports: [report.xml]
  - key: test
    depends_on: build
    artifacts_from: build
    command: |
      sha256sum -c sums.txt
      echo "checked $(wc -c < blob.bin) bytes"
"#;

/// Runs [`PIPELINE`] on `server` from a fresh upload; the upload's id, and the build job's id
/// and its blob.bin sha256.
fn run_pipeline(server: &Server) -> (String, i64, String) {
    let api = server.api();
    let id = upload(server, archive("input.txt", "from the workspace upload"));
    let p = submit(server, PIPELINE, &id);
    let done = api.wait_pipeline(p, T);
    for j in &done.jobs {
        assert_eq!(j.state, JobState::Succeeded, "{}: {} {:?}", j.step_key, api.log_text(j.id), api.log_system(j.id));
    }
    let test = done.jobs.iter().find(|j| j.step_key == "test").unwrap();
    assert!(api.log_text(test.id).contains("checked 3145728 bytes"), "{}", api.log_text(test.id));
    let build = done.jobs.iter().find(|j| j.step_key == "build").unwrap();
    let listed: Vec<Value> = api.get(&format!("/api/v1/jobs/{}/artifacts", build.id));
    let blob = listed.iter().find(|a| a["path"] == "blob.bin").unwrap();
    (id, build.id, blob["sha256"].as_str().unwrap().to_string())
}

#[test]
fn artifacts_and_uploads_live_in_the_bucket_and_none_in_the_data_dir() {
    let Some(m) = moto::start("blobs in s3") else { return };
    make_bucket(&m, "gpuci-e2e");
    let dir = tempdir();
    let cfg = config(dir.path(), &m, "gpuci-e2e");
    let args = vec!["--heartbeat".into(), "200ms".into(), "--config".into(), cfg.display().to_string()];
    let server = Server::start_with_env(&dir.path().join("server"), "127.0.0.1:0", args, &AWS_ENV);
    let _agent = Agent::start(&server, &dir.path().join("agent"), "s3-agent", &["--isolation", isolation()]);
    server.api().wait_agents(1, T);

    let (upload_id, build, sha) = run_pipeline(&server);
    // The JUnit report was read back from the bucket.
    let r: gpuci_protocol::api::JobTestReport = server.api().get(&format!("/api/v1/jobs/{build}/test-report"));
    assert_eq!((r.summary.tests, r.summary.failures), (2, 1), "{:?}", r.files);
    let keys = keys(&m, "gpuci-e2e");
    assert!(keys.contains(&format!("ci/uploads/{upload_id}.tar.gz")), "{keys:?}");
    assert!(keys.contains(&format!("ci/artifacts/{sha}")), "{keys:?}");
    assert!(
        files_in(&server.data_dir.join("artifacts")).is_empty(),
        "{:?}",
        files_in(&server.data_dir.join("artifacts"))
    );
    assert!(files_in(&server.data_dir.join("uploads")).is_empty(), "{:?}", files_in(&server.data_dir.join("uploads")));
    // Downloads stream from the bucket, byte-identical.
    let (status, bytes) = get_bytes(&server, &format!("/api/v1/jobs/{build}/artifact?path=blob.bin"));
    assert_eq!(status, 200);
    assert_eq!(hex::encode(Sha256::digest(&bytes)), sha);
    // An object that went missing from the bucket answers 410 as a collected one does.
    let gone = s3(&m, "DELETE", &format!("/gpuci-e2e/ci/artifacts/{sha}"));
    assert!(gone.starts_with("HTTP/1.1 204"), "{gone}");
    let (status, _) = get_bytes(&server, &format!("/api/v1/jobs/{build}/artifact?path=blob.bin"));
    assert_eq!(status, 410);
}

#[test]
fn a_bucket_that_cannot_be_reached_or_a_bad_blobs_section_stops_the_start() {
    let Some(m) = moto::start("blobs start check") else { return };
    let dir = tempdir();
    let cfg = config(dir.path(), &m, "gpuci-never-made");
    let out = std::process::Command::new(BIN)
        .envs(AWS_ENV)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("server"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("[blobs] bucket \"gpuci-never-made\""), "{stderr}");
    assert!(stderr.contains("HeadBucket"), "{stderr}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[blobs]\nbackend = \"s3\"\nbucket = \"gpuci-e2e\"\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("server2"))
        .arg("--config")
        .arg(&bad)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("bad.toml: [blobs] region: required"), "{stderr}");
}

/// Two coordinators on one Postgres and one bucket: the leader stores a workspace upload and
/// a pipeline's artifacts, then is killed (SIGKILL); the standby, leading, serves both, and a
/// new pipeline naming the upload runs from it on the agent.
#[test]
fn after_a_failover_the_standby_serves_what_the_leader_stored() {
    let Some(m) = moto::start("blobs failover") else { return };
    let Some(pg) = pg::PgServer::start() else { return };
    let url = tokio::runtime::Runtime::new().unwrap().block_on(pg.create_database("gpuci_blobs_failover"));
    make_bucket(&m, "gpuci-ha");
    let dir = tempdir();
    let cfg = config(dir.path(), &m, "gpuci-ha");
    let listen = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let args: Vec<String> =
        ["--database", &url, "--heartbeat", "200ms", "--lost-after", "30s", "--config", &cfg.display().to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let mut leader = Server::start_with_env(&dir.path().join("a"), &listen, args.clone(), &AWS_ENV);
    // The standby's data dir holds the leader's tokens and secrets key (docs/ha.md), nothing else.
    let b = dir.path().join("b");
    std::fs::create_dir_all(&b).unwrap();
    for f in ["api-token", "registration-token", "read-token", "secrets.key"] {
        std::fs::copy(leader.data_dir.join(f), b.join(f)).unwrap();
    }
    let standby = {
        let (b, listen) = (b.clone(), listen.clone());
        let mut args = args.clone();
        args.push("--standby".into());
        std::thread::spawn(move || Server::start_with_env(&b, &listen, args, &AWS_ENV))
    };
    let _agent = Agent::start(&leader, &dir.path().join("agent"), "ha-agent", &["--isolation", isolation()]);
    leader.api().wait_agents(1, T);
    let (upload_id, build, sha) = run_pipeline(&leader);
    let (_, upload_bytes) = get_bytes(&leader, &format!("/api/v1/uploads/{upload_id}"));

    leader.kill9();
    let standby = standby.join().expect("the standby took over");
    assert!(
        files_in(&standby.data_dir.join("uploads")).is_empty()
            && files_in(&standby.data_dir.join("artifacts")).is_empty()
    );
    let (status, bytes) = get_bytes(&standby, &format!("/api/v1/uploads/{upload_id}"));
    assert_eq!((status, bytes.len()), (200, upload_bytes.len()));
    assert!(bytes == upload_bytes, "the upload differs after the failover");
    let (status, bytes) = get_bytes(&standby, &format!("/api/v1/jobs/{build}/artifact?path=blob.bin"));
    assert_eq!(status, 200);
    assert_eq!(hex::encode(Sha256::digest(&bytes)), sha);
    // The agent follows to the standby (same address) and a job starts from the old upload.
    let p = submit(&standby, "steps:\n  - key: again\n    command: cat input.txt\n", &upload_id);
    let api = standby.api();
    let done = api.wait_pipeline(p, T);
    let j = &done.jobs[0];
    assert_eq!(j.state, JobState::Succeeded, "{} {:?}", api.log_text(j.id), api.log_system(j.id));
    assert!(api.log_text(j.id).contains("from the workspace upload"), "{}", api.log_text(j.id));
}
