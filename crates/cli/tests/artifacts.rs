//! Artifacts end to end: real coordinator and agent processes on 127.0.0.1, jobs in the
//! sandbox. A step's files reach a later step byte-identical; a failing step's files are
//! still kept; a hostile step's links, `..` and special files are refused with the reason
//! in its log, and nothing outside its workspace is read; the CLI lists and downloads them;
//! only the API token reads them, only the job's agent writes them.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use gpuci_protocol::api::ArtifactInfo;
use sha2::{Digest, Sha256};
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

fn setup() -> (tempfile::TempDir, Server, Agent, Api) {
    one_agent("30s", "a1", &["--isolation", isolation()])
}

/// A coordinator with `config` as its server config, and one agent.
fn setup_with_config(config: &str) -> (tempfile::TempDir, Server, Agent, Api) {
    let dir = tempdir();
    let path = dir.path().join("server.toml");
    std::fs::write(&path, config).unwrap();
    let args: Vec<String> =
        ["--heartbeat", "200ms", "--lost-after", "30s", "--config", path.to_str().unwrap()].map(String::from).into();
    let server = Server::start_on(&dir.path().join("server"), "127.0.0.1:0", args);
    let agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    (dir, server, agent, api)
}

fn artifacts(api: &Api, job: i64) -> Vec<ArtifactInfo> {
    api.get(&format!("/api/v1/jobs/{job}/artifacts"))
}

fn job_of<'a>(p: &'a gpuci_protocol::api::PipelineSummary, key: &str) -> &'a gpuci_protocol::api::JobSummary {
    p.jobs.iter().find(|j| j.step_key == key).unwrap_or_else(|| panic!("no job {key} in {p:#?}"))
}

fn gpuci(server: &Server, args: &[&str]) -> std::process::Output {
    std::process::Command::new(BIN)
        .args(args)
        .env("GPUCI_SERVER", &server.url)
        .env("GPUCI_TOKEN", &server.token)
        .output()
        .unwrap()
}

#[test]
fn a_steps_files_reach_the_next_step_byte_identical_and_the_cli_gets_them() {
    let (dir, server, _agent, api) = setup();
    // 3 MiB of every byte value (not text, not compressible), and a file in a subdirectory.
    let p = api.submit(
        r#"
steps:
  - key: build
    command: |
      mkdir -p dist/sub logs
      head -c 3145728 /dev/urandom > dist/blob.bin
      printf 'hello\n' > dist/sub/note.txt
      printf 'not an artifact\n' > logs/other.log
      sha256sum dist/blob.bin dist/sub/note.txt > sums.txt
    artifacts: ["dist/**", sums.txt]
  - key: test
    depends_on: build
    artifacts_from: build
    command: |
      sha256sum -c sums.txt
      test ! -e logs/other.log
      echo "checked $(wc -c < dist/blob.bin) bytes"
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let build = job_of(&done, "build");
    let test = job_of(&done, "test");
    assert_eq!(build.state, JobState::Succeeded, "{}: {:?}", build.reason, api.log_system(build.id));
    assert_eq!(
        test.state,
        JobState::Succeeded,
        "{}: {}\n{:?}",
        test.reason,
        api.log_text(test.id),
        api.log_system(test.id)
    );
    assert!(api.log_text(test.id).contains("checked 3145728 bytes"));
    assert!(
        api.log_system(test.id).iter().any(|l| l.contains("artifacts: 3 file(s)")),
        "{:?}",
        api.log_system(test.id)
    );

    let listed = artifacts(&api, build.id);
    let paths: Vec<&str> = listed.iter().map(|a| a.path.as_str()).collect();
    assert_eq!(paths, ["dist/blob.bin", "dist/sub/note.txt", "sums.txt"]);
    assert_eq!(listed[0].size, 3 << 20);

    // The CLI: list (human and --json) and download, checked against the stored hashes.
    let out = gpuci(&server, &["artifacts", "list", &build.id.to_string(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let via_cli: Vec<ArtifactInfo> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(via_cli, listed);
    let dest = dir.path().join("dl");
    let out =
        gpuci(&server, &["artifacts", "download", &build.id.to_string(), "dist/**", "--dir", dest.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2, "one line per file written");
    let blob = std::fs::read(dest.join("dist/blob.bin")).unwrap();
    assert_eq!(hex::encode(Sha256::digest(&blob)), listed[0].sha256);
    assert_eq!(std::fs::read(dest.join("dist/sub/note.txt")).unwrap(), b"hello\n");
    assert!(!dest.join("sums.txt").exists(), "the glob chose the files");
    // Files already there are not replaced without --overwrite (a job may name its files
    // `.git/config`), and nothing is written then.
    std::fs::write(dest.join("dist/sub/note.txt"), b"mine\n").unwrap();
    let again = ["artifacts", "download", &build.id.to_string(), "dist/**", "--dir", dest.to_str().unwrap()];
    let out = gpuci(&server, &again);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--overwrite"), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(dest.join("dist/sub/note.txt")).unwrap(), b"mine\n");
    let out = gpuci(&server, &[&again[..], &["--overwrite"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(dest.join("dist/sub/note.txt")).unwrap(), b"hello\n");
    let out = gpuci(&server, &["artifacts", "download", &build.id.to_string(), "nothing/*"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no artifact matching"));
}

#[test]
fn a_failing_steps_artifacts_are_kept_unless_it_asked_for_success_only() {
    let (_dir, _server, _agent, api) = setup();
    let p = api.submit(
        r#"
steps:
  - key: crash
    command: |
      echo "segfault in kernel 7" > crash.log
      exit 3
    artifacts: crash.log
  - key: only-on-success
    command: |
      echo data > out.txt
      exit 1
    artifacts: {paths: [out.txt], when: on_success}
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let crash = job_of(&done, "crash");
    assert_eq!(crash.state, JobState::Failed);
    let kept = artifacts(&api, crash.id);
    assert_eq!(kept.len(), 1, "{:?}", api.log_system(crash.id));
    assert_eq!(kept[0].path, "crash.log");
    let other = job_of(&done, "only-on-success");
    assert!(artifacts(&api, other.id).is_empty());
    assert!(
        api.log_system(other.id).iter().any(|l| l.contains("not uploaded (when: on_success")),
        "{:?}",
        api.log_system(other.id)
    );
}

#[test]
fn a_hostile_steps_links_and_special_files_are_refused_and_nothing_outside_is_read() {
    let (dir, server, _agent, api) = setup();
    // A file outside the workspace the job can name but must never get uploaded.
    let outside = shared_dir(&dir, "outside");
    std::fs::write(outside.join("secret.txt"), b"the agent's secret").unwrap();
    let secret = outside.join("secret.txt");
    let p = api.submit(&format!(
        r#"
steps:
  - key: evil
    command: |
      mkdir -p out
      ln -s /etc/passwd out/passwd
      ln -s {secret} out/secret.txt
      ln -s /etc out/etcdir
      ln -s loop out/loop
      mkfifo out/pipe
      echo fine > out/ok.txt
      printf 'x' > "out/$(printf 'new\nline').txt"
    artifacts: ["out/**"]
"#,
        secret = secret.display()
    ));
    let done = api.wait_pipeline(p.id, T);
    let evil = job_of(&done, "evil");
    assert_eq!(evil.state, JobState::Succeeded, "{}", evil.reason);
    let stored = artifacts(&api, evil.id);
    assert_eq!(
        stored.iter().map(|a| a.path.as_str()).collect::<Vec<_>>(),
        ["out/ok.txt"],
        "{:?}",
        api.log_system(evil.id)
    );
    let log = api.log_system(evil.id).join("\n");
    for (path, why) in [
        ("out/passwd", "a symbolic link"),
        ("out/secret.txt", "a symbolic link"),
        ("out/etcdir", "a symbolic link"),
        ("out/loop", "a symbolic link"),
        ("out/pipe", "named pipe"),
        ("out/new\\nline.txt", "control character"),
    ] {
        assert!(
            log.lines().any(|l| l.contains(&format!("{path:?}").replace("\\\\", "\\")) && l.contains(why)),
            "no refusal of {path} ({why}) in:\n{log}"
        );
    }
    // Nothing stored holds the outside file's bytes or /etc/passwd's.
    let store = server.data_dir.join("artifacts");
    for f in walk(&store) {
        let bytes = std::fs::read(&f).unwrap();
        assert!(!String::from_utf8_lossy(&bytes).contains("the agent's secret"), "{}", f.display());
        assert!(!String::from_utf8_lossy(&bytes).contains("root:"), "{}", f.display());
    }
}

#[test]
fn dotdot_patterns_are_refused_at_submission_with_their_position() {
    let (_dir, server, _agent, api) = setup();
    let r = api
        .raw()
        .post(format!("{}/api/v1/pipelines", server.url))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({
            "file_name": "ci.yml",
            "source": "steps:\n  - command: make\n    artifacts: [\"../../etc/passwd\"]\n",
        }))
        .send()
        .unwrap();
    assert_eq!(r.status(), 422);
    let body = r.text().unwrap();
    assert!(body.contains("must stay inside the workspace") && body.contains("\"line\":3"), "{body}");
}

#[test]
fn only_the_jobs_agent_uploads_and_only_a_token_reads() {
    let (_dir, server, _agent, api) = setup();
    let p = api.submit("steps:\n  - key: a\n    command: echo hi > a.txt\n    artifacts: a.txt\n");
    let done = api.wait_pipeline(p.id, T);
    let job = job_of(&done, "a").id;
    assert_eq!(artifacts(&api, job).len(), 1);
    let http = api.raw();
    // Reading needs the API token, like the job's log.
    for path in [format!("/api/v1/jobs/{job}/artifacts"), format!("/api/v1/jobs/{job}/artifact?path=a.txt")] {
        let r = http.get(format!("{}{path}", server.url)).send().unwrap();
        assert_eq!(r.status(), 401, "{path}");
    }
    let r = http
        .get(format!("{}/api/v1/jobs/{job}/artifact?path=a.txt", server.url))
        .bearer_auth(&server.token)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/octet-stream");
    assert_eq!(r.headers()["x-content-type-options"], "nosniff");
    assert_eq!(r.bytes().unwrap().as_ref(), b"hi\n");
    // Writing: the API token is not an agent, and the job has ended anyway.
    let r = http
        .put(format!("{}/api/v1/jobs/{job}/artifact-upload?path=b.txt", server.url))
        .bearer_auth(&server.token)
        .body("forged")
        .send()
        .unwrap();
    assert_eq!(r.status(), 401, "{}", r.text().unwrap());
    let r = http
        .put(format!("{}/api/v1/jobs/{job}/artifact-upload?path=b.txt", server.url))
        .bearer_auth("made-up")
        .header("x-gpuci-agent-id", "no-such-agent")
        .body("forged")
        .send()
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(artifacts(&api, job).len(), 1, "nothing forged was stored");
}

#[test]
fn caps_from_the_server_config_refuse_with_the_reason_and_a_matrix_passes_all_its_jobs_files() {
    let (_dir, _server, _agent, api) = setup_with_config("[artifacts]\nmax_file = \"1KiB\"\nmax_job = \"1MiB\"\n");
    let p = api.submit(
        r#"
steps:
  - key: build
    matrix: {setup: {n: [1, 2]}}
    command: |
      echo "job {{matrix.n}}" > out-{{matrix.n}}.txt
      head -c 2048 /dev/zero > big-{{matrix.n}}.bin
    artifacts: ["out-*.txt", "big-*.bin"]
  - key: test
    depends_on: build
    artifacts_from: build
    command: |
      cat out-1.txt out-2.txt
      test ! -e big-1.bin
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let test = job_of(&done, "test");
    assert_eq!(test.state, JobState::Succeeded, "{}\n{:?}", test.reason, api.log_system(test.id));
    assert_eq!(api.log_text(test.id), "job 1\njob 2\n");
    let build = done.jobs.iter().find(|j| j.step_key == "build[n=1]").unwrap();
    assert_eq!(artifacts(&api, build.id).iter().map(|a| a.path.as_str()).collect::<Vec<_>>(), ["out-1.txt"]);
    let log = api.log_system(build.id).join("\n");
    assert!(
        log.contains("\"big-1.bin\" refused") && log.contains("413") && log.contains("per-file cap of 1024 B"),
        "{log}"
    );
}

#[test]
fn junit_reports_are_read_and_hostile_ones_refused_with_the_reason() {
    let (_dir, server, _agent, api) = setup();
    let p = api.submit(
        r#"
steps:
  - key: tests
    command: |
      cat > report.xml <<'XML'
      <?xml version="1.0"?>
      <testsuites><testsuite name="gpu">
        <testcase classname="tests.test_kernels" name="test_add"/>
        <testcase classname="tests.test_kernels" name="test_mul"><failure message="assert 3 == 4">x = 3 &amp; y = 4</failure></testcase>
        <testcase classname="tests.test_io" name="test_skip"><skipped/></testcase>
      </testsuite></testsuites>
      XML
      cat > laughs.xml <<'XML'
      <?xml version="1.0"?>
      <!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]>
      <testsuite><testcase name="x"><failure message="&lol2;"/></testcase></testsuite>
      XML
      truncate -s 1G huge.xml
      exit 1
    test_reports: ["*.xml"]
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let job = job_of(&done, "tests");
    assert_eq!(job.state, JobState::Failed);
    let log = api.log_system(job.id).join("\n");
    assert!(
        log.contains("test reports: report.xml: test report: 3 tests: 1 passed, 1 failed, 0 errors, 1 skipped"),
        "{log}"
    );
    assert!(log.contains("laughs.xml: test report not read: a DOCTYPE"), "{log}");
    assert!(log.contains("\"huge.xml\" refused: 1 GiB is over the per-file cap of 64 MiB"), "{log}");

    let r: gpuci_protocol::api::JobTestReport = api.get(&format!("/api/v1/jobs/{}/test-report", job.id));
    assert_eq!((r.summary.tests, r.summary.failures, r.summary.skipped), (3, 1, 1));
    assert_eq!(r.summary.failed[0].name, "test_mul");
    assert!(r.summary.failed[0].message.contains("x = 3 & y = 4"));
    assert!(r.files.iter().any(|f| f.path == "laughs.xml" && f.error.as_deref().unwrap_or("").contains("DOCTYPE")));

    let out = gpuci(&server, &["jobs", "show", &job.id.to_string()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("Tests:     3 tests: 1 passed, 1 failed, 0 errors, 1 skipped"), "{text}");
    assert!(text.contains("FAILURE tests.test_kernels.test_mul") && text.contains("assert 3 == 4"), "{text}");
    assert!(text.contains("laughs.xml: not read"), "{text}");
    let out = gpuci(&server, &["jobs", "show", &job.id.to_string(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["test_report"]["summary"]["failures"], 1, "{v}");
    assert_eq!(v["id"], job.id);

    // The job's page: the counts, the failed test with its message, the unreadable file, and
    // the report files as artifacts with their download links.
    let page = api
        .raw()
        .get(format!("{}/ui/jobs/{}", server.url, job.id))
        .bearer_auth(api.token())
        .send()
        .and_then(|r| r.text())
        .unwrap();
    for want in [
        "3 tests: 1 passed, 1 failed, 0 errors, 1 skipped",
        "tests.test_kernels.test_mul",
        "x = 3 &amp; y = 4",
        "laughs.xml",
        &format!("/api/v1/jobs/{}/artifact?path=report.xml", job.id),
    ] {
        assert!(page.contains(want), "the job page lacks {want:?}:\n{page}");
    }
    assert!(!page.contains("<!ENTITY"), "nothing of a hostile report is markup");
}

/// A public repository's artifacts and test report follow its public view: anonymous viewers
/// see them on the job page and download them; a private repository's need a token.
#[test]
fn a_public_repositorys_artifacts_are_open_to_anonymous_viewers_and_a_private_ones_are_not() {
    let (_dir, server, _agent, api) = setup_with_config("[dashboard]\npublic_repositories = [\"acme/open\"]\n");
    let yaml = "steps:\n  - key: build\n    command: echo wheel-bytes > dist.whl\n    artifacts: [dist.whl]\n";
    let open = api.submit_from(yaml, Some("https://github.com/acme/open.git"));
    let closed = api.submit_from(yaml, Some("https://github.com/acme/secret.git"));
    let open = job_of(&api.wait_pipeline(open.id, T), "build").id;
    let closed = job_of(&api.wait_pipeline(closed.id, T), "build").id;
    let anon = reqwest::blocking::Client::new();
    let get = |path: String| anon.get(format!("{}{path}", server.url)).send().unwrap();
    let r = get(format!("/api/v1/jobs/{open}/artifact?path=dist.whl"));
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().unwrap(), "wheel-bytes\n");
    assert_eq!(get(format!("/api/v1/jobs/{open}/artifacts")).status(), 200);
    assert!(get(format!("/ui/jobs/{open}")).text().unwrap().contains("dist.whl"));
    for path in [format!("/api/v1/jobs/{closed}/artifact?path=dist.whl"), format!("/api/v1/jobs/{closed}/artifacts")] {
        assert_eq!(get(path.clone()).status(), 401, "{path}");
    }
}

/// A fork's pull request fills only its own share of the repository cap (a fifth), never the
/// trusted jobs' room. The fork's origin is written into the coordinator's database as the
/// GitHub integration writes it (the GitHub tests cover how it gets there).
#[test]
fn a_forks_artifacts_fill_their_own_share_and_never_the_trusted_jobs_room() {
    let (dir, _server, _agent, api) = setup_with_config("[artifacts]\nmax_repository = \"5KiB\"\n");
    // The fork's job waits for its origin to be set (the test does it at once).
    let fork = api.submit(
        "steps:\n  - key: fork\n    command: |\n      sleep 3\n      head -c 900 /dev/zero > small.bin\n      head -c 2048 /dev/zero > big.bin\n    artifacts: [\"*.bin\"]\n",
    );
    make_fork_pull_request(&dir.path().join("server").join("gpuci.db"), fork.id);
    let done = api.wait_pipeline(fork.id, T);
    let job = job_of(&done, "fork");
    let stored: Vec<_> = artifacts(&api, job.id).into_iter().map(|a| a.path).collect();
    assert_eq!(stored, ["small.bin"], "a fifth of 5 KiB is 1 KiB: the 2 KiB file is over it");
    let log = api.log_system(job.id).join("\n");
    assert!(log.contains("\"big.bin\" refused") && log.contains("untrusted"), "{log}");
    // A trusted job of the same repository (no repository here: the same class of jobs) still
    // has its whole 5 KiB: the fork's 900 bytes are not in its count.
    let trusted = api.submit(
        "steps:\n  - key: main\n    command: head -c 4608 /dev/zero > release.bin\n    artifacts: [release.bin]\n",
    );
    let done = api.wait_pipeline(trusted.id, T);
    let job = job_of(&done, "main");
    assert_eq!(
        artifacts(&api, job.id).into_iter().map(|a| a.path).collect::<Vec<_>>(),
        ["release.bin"],
        "{:?}",
        api.log_system(job.id)
    );
}
