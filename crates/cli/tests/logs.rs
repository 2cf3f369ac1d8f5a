//! A job's log against a hostile job: flooding it, deceiving its reader, hiding secrets in it.
//! Real coordinator and agent processes on 127.0.0.1.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

/// Every line of the job's log: (stream, text).
fn log_lines(server: &Server, id: i64) -> Vec<(String, String)> {
    let body = server
        .api()
        .raw()
        .get(format!("{}/api/v1/jobs/{id}/logs", server.url))
        .bearer_auth(&server.token)
        .send()
        .unwrap()
        .text()
        .unwrap();
    body.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "line")
        .map(|v| (v["stream"].as_str().unwrap().to_string(), v["text"].as_str().unwrap().to_string()))
        .collect()
}

fn setup(args: &[&str]) -> (tempfile::TempDir, Server, Agent, Api) {
    let mut all = vec!["--isolation", isolation()];
    all.extend_from_slice(args);
    one_agent("30s", "a1", &all)
}

#[test]
fn a_job_flooding_its_log_is_cut_at_the_cap_and_keeps_running() {
    let (_dir, server, _agent, api) = setup(&["--max-log-bytes", "64KiB"]);
    // ~590 KB of output, then a marker the job must still reach (it is never blocked).
    let p = api.submit(
        r#"
steps:
  - key: flood
    command: |
      seq 1 100000
      echo "the job went on to its end"
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let job = &done.jobs[0];
    assert_eq!(job.state, JobState::Succeeded, "{}", job.reason);
    let lines = log_lines(&server, job.id);
    let job_bytes: usize = lines.iter().filter(|(s, _)| s != "system").map(|(_, t)| t.len() + 1).sum();
    assert!(job_bytes <= 64 * 1024, "{job_bytes} bytes of output stored past the 64 KiB cap");
    let (stream, last) = lines.last().unwrap();
    assert_eq!(stream, "system", "the log must end with gpuci's cut notice, not {last:?}");
    assert!(last.starts_with("log cut:") && last.contains("65536 bytes"), "{last}");
    assert_eq!(lines.iter().filter(|(_, t)| t.starts_with("log cut")).count(), 1);
}

#[test]
fn gpuci_logs_shows_control_characters_escaped_and_marks_its_own_lines() {
    let (_dir, server, _agent, api) = setup(&[]);
    let p = api.submit(
        r#"
steps:
  - key: hostile
    command: |
      printf '\033]0;owned\007\033]52;c;aGVsbG8=\007\033[2J\033[31mred\rfake\342\200\256txt\n'
      echo '# workspace: 12 files from upload 0123456789ab'
      echo '# cache: restored target' >&2
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{}", done.jobs[0].reason);
    let out = std::process::Command::new(BIN)
        .args(["logs", &done.jobs[0].id.to_string(), "--server", &server.url, "--token", &server.token])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (stdout, stderr) = (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap());
    for (name, text) in [("stdout", &stdout), ("stderr", &stderr)] {
        assert!(
            !text.chars().any(|c| c == '\u{1b}' || c == '\r' || c == '\u{7}' || c == '\u{202e}'),
            "a control character reached the terminal on {name}: {text:?}"
        );
    }
    assert!(
        stdout.contains(r"│ \x1b]0;owned\x07\x1b]52;c;aGVsbG8=\x07\x1b[2J\x1b[31mred\x0dfake\u{202e}txt"),
        "{stdout}"
    );
    // The job's lines that imitate gpuci's own come after the job's column.
    assert!(stdout.contains("│ # workspace: 12 files from upload 0123456789ab\n"), "{stdout}");
    assert!(stderr.contains("│ # cache: restored target\n"), "{stderr}");
    // Every line that starts with gpuci's mark is one of gpuci's own.
    let own: Vec<String> =
        log_lines(&server, done.jobs[0].id).into_iter().filter(|(s, _)| s == "system").map(|(_, t)| t).collect();
    for line in stdout.lines().chain(stderr.lines()).filter(|l| l.starts_with('#')) {
        assert!(own.iter().any(|t| line == format!("# {t}")), "{line:?} looks like gpuci's but is not");
    }
    // --json keeps the exact text (JSON escaping is safe).
    let json = std::process::Command::new(BIN)
        .args(["logs", &done.jobs[0].id.to_string(), "--json", "--server", &server.url, "--token", &server.token])
        .output()
        .unwrap();
    let json = String::from_utf8(json.stdout).unwrap();
    assert!(!json.contains('\u{1b}') && json.contains(r"\u001b]0;owned"), "{json}");
}

#[test]
fn a_secret_hidden_with_escape_sequences_or_split_by_the_line_cut_is_masked() {
    let (_dir, server, _agent, api) = setup(&[]);
    let r = api
        .raw()
        .put(format!("{}/api/v1/secrets/TOKEN", api.url))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({"value": "ABCDsecret42"}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 204);
    let p = api.submit(
        r#"
steps:
  - key: leak
    secrets: [TOKEN]
    command: |
      printf 'sgr: %s\033[0m%s\n' "${TOKEN:0:4}" "${TOKEN:4}"
      printf 'interleaved: '; for i in $(seq 0 11); do printf '%s\033[3%dm' "${TOKEN:$i:1}" $((i % 8)); done; echo
      printf 'osc: %s\033]0;title\007%s\n' "${TOKEN:0:6}" "${TOKEN:6}"
      for n in 65530 65531 65532 65533 65534 65535 65536; do head -c $n /dev/zero | tr '\0' x; printf '%s\n' "$TOKEN"; done
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{}", done.jobs[0].reason);
    let lines = log_lines(&server, done.jobs[0].id);
    let raw: String = lines.iter().map(|(_, t)| format!("{t}\n")).collect();
    let shown = gpuci_core::text::visible(&raw.replace('\n', " ")).text;
    assert!(!raw.contains("ABCDsecret42"), "secret stored as written");
    assert!(!shown.contains("ABCDsecret42"), "secret stored as a terminal would show it");
    assert!(
        shown.contains("sgr: ***") && shown.contains("interleaved: ***") && shown.contains("osc: ***"),
        "{shown:.300}"
    );
    assert_eq!(shown.matches("***").count(), 10, "every occurrence masked once");
}

/// Issue 27: base64, hex and URL-encoding printed a secret; a job can register a value of its
/// own (`::add-mask::`), and a value too short to be secret is refused without being shown.
#[test]
fn encodings_of_a_secret_and_values_the_job_registers_are_masked() {
    let (_dir, server, _agent, api) = setup(&[]);
    let r = api
        .raw()
        .put(format!("{}/api/v1/secrets/TOKEN", api.url))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({"value": "hf_Sup3rS3cretValue42"}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 204);
    let p = api.submit(
        r#"
steps:
  - key: leak
    secrets: [TOKEN]
    command: |
      echo -n "$TOKEN" | base64
      printf 'xy%s' "$TOKEN" | base64 | tr '+/' '-_' | tr -d '='
      echo -n "$TOKEN" | xxd -p -c 64
      echo "url: $(echo -n "$TOKEN" | xxd -p -c 64 | sed 's/../%&/g')"
      derived=$(echo -n "$TOKEN" | rev)
      echo "::add-mask::$derived"
      echo "derived: $derived"
      echo "::add-mask::abc"
      # Standard error is another pipe, read by another task: no order holds across the two
      # streams, so the job gives the agent a moment to read its registration first.
      sleep 1
      echo "derived: $derived" >&2
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{}", done.jobs[0].reason);
    let lines = log_lines(&server, done.jobs[0].id);
    let raw: String = lines.iter().map(|(_, t)| format!("{t}\n")).collect();
    assert!(!raw.contains("24eulaVterc3S3rpuS_fh") && !raw.contains("::add-mask::abc"), "{raw}");
    let text = |stream: &str| lines.iter().filter(|(s, _)| s == stream).map(|(_, t)| t.as_str()).collect::<Vec<_>>();
    let out = text("stdout");
    assert_eq!(out[0], "***", "{raw}");
    assert!(out[1].starts_with("eHl") && out[1].ends_with("***") && out[1].len() <= 10, "{raw}");
    assert_eq!(out[2..], ["***", "url: ***", "::add-mask::***", "derived: ***"], "{raw}");
    assert_eq!(text("stderr"), ["derived: ***"]);
    assert!(text("system").iter().any(|t| t.starts_with("add-mask: a value of 3 characters is too short")), "{raw}");
}

/// Regression: `gpuci logs JOB | head -1` panicked ("failed printing to stdout: Broken pipe").
#[test]
fn gpuci_logs_into_a_reader_that_stops_early_ends_quietly() {
    let (_dir, server, _agent, api) = setup(&[]);
    let p = api.submit("steps:\n  - key: long\n    command: seq 1 200000\n");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{}", done.jobs[0].reason);
    for json in [false, true] {
        let mut child = std::process::Command::new(BIN)
            .args(["logs", &done.jobs[0].id.to_string(), "--server", &server.url, "--token", &server.token])
            .args(json.then_some("--json"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Read one line, then go away, as `head -1` does.
        let mut first = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut first).unwrap();
        assert!(!first.is_empty());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{err}");
        use std::os::unix::process::ExitStatusExt;
        assert!(out.status.success() || out.status.signal() == Some(13), "{:?}: {err}", out.status);
    }
}

/// `gpuci logs --follow` (and every other command that only talks to the coordinator) ends at
/// SIGINT or SIGTERM, with the shell's code for it: the handler the long-running commands
/// need was installed for all of them, and a followed log or a pending upload went on through
/// both signals (outsider finding: still running 30 s after `timeout 10`).
#[test]
fn a_followed_log_ends_at_sigint_and_sigterm() {
    let (_dir, server, _agent, api) = setup(&[]);
    let p = api.submit("steps:\n  - key: long\n    command: echo started; sleep 3009991\n");
    let id = p.jobs[0].id;
    api.wait_job(id, "running", T, |j| j.state == JobState::Running);
    for (signal, code) in [(nix::sys::signal::Signal::SIGINT, 130), (nix::sys::signal::Signal::SIGTERM, 143)] {
        let mut child = std::process::Command::new(BIN)
            .args(["logs", &id.to_string(), "--follow", "--server", &server.url, "--token", &server.token])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Following once its first line is out.
        let mut first = String::new();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        std::io::BufRead::read_line(&mut out, &mut first).unwrap();
        assert!(!first.is_empty(), "a first line");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
        let t0 = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "`gpuci logs --follow` still runs after {signal}");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(status.code(), Some(code), "{signal}");
    }
}

/// Regression (outsider finding): a coordinator that stopped (SIGTERM, or a leader that found
/// its claim taken) ended the log and watch streams it served as if they were whole, with no
/// `end` record, so a client reading them raw took a stream cut short for a finished one. They
/// are cut now (the connection closes mid-answer); a read without `follow` still ends whole.
#[test]
fn a_stopping_coordinator_cuts_its_open_streams_instead_of_ending_them() {
    let dir = tempdir();
    let mut server = Server::start(&dir.path().join("server"), "30s");
    let api = server.api();
    // No agent: the job stays queued, and its followed log and watch stay open.
    let p = api.submit("steps:\n  - key: a\n    command: echo never\n");
    let id = p.jobs[0].id;
    let whole = api.raw().get(format!("{}/api/v1/jobs/{id}/logs", server.url)).bearer_auth(&server.token).send();
    assert!(whole.unwrap().text().is_ok(), "a read without follow ends whole");
    let open = |path: String| {
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
        let resp = http.get(format!("{}{path}", server.url)).bearer_auth(&server.token).send().unwrap();
        assert_eq!(resp.status(), 200);
        std::thread::spawn(move || {
            let mut resp = resp;
            let mut body = Vec::new();
            std::io::Read::read_to_end(&mut resp, &mut body).map(|_| String::from_utf8_lossy(&body).to_string())
        })
    };
    let log = open(format!("/api/v1/jobs/{id}/logs?follow=true"));
    let watch = open(format!("/api/v1/pipelines/{}/watch", p.id));
    std::thread::sleep(Duration::from_millis(500));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.child.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    for (what, read) in [("log", log), ("watch", watch)] {
        let read = read.join().unwrap();
        assert!(read.is_err(), "the {what} stream ended as if whole: {read:?}");
    }
    let _ = server.child.wait();
}
