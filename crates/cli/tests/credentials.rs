//! Issue 9: every gpuci credential is invisible to jobs and protected at rest. A job is
//! hostile (code from a pull request) and tries to read the coordinator's tokens and
//! database; the database alone, copied without the key, reveals no secret value.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())).permissions().mode() & 0o777
}

/// A temp dir under /opt, which the sandbox shows read-only to every job; removed on drop.
/// Made 0755 as an operator's `mkdir /opt/gpuci` would be.
fn dir_under_opt() -> tempfile::TempDir {
    let d = tempfile::Builder::new().prefix("gpuci-test-").tempdir_in("/opt").expect("a temp dir under /opt (root)");
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

/// `gpuci up` on 127.0.0.1:0 with `args`; killed on drop.
struct Up {
    child: Child,
    api: Api,
}

impl Up {
    fn start(data_dir: &Path, args: &[&str]) -> Up {
        let mut cmd = Command::new(BIN);
        cmd.args(["up", "--listen", "127.0.0.1:0", "--isolation", isolation(), "--data-dir"]).arg(data_dir).args(args);
        Up::spawn(cmd, data_dir)
    }

    fn spawn(mut cmd: Command, data_dir: &Path) -> Up {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn gpuci up");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let url = line.trim().to_string();
        assert!(url.starts_with("http://127.0.0.1:"), "gpuci up printed {url:?}");
        let token = std::fs::read_to_string(data_dir.join("api-token")).unwrap().trim().to_string();
        let api = Api::new(&url, &token);
        api.wait_agents(1, T);
        Up { child, api }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn set_secret(api: &Api, token: &str, name: &str, value: &str) {
    let r = api
        .raw()
        .put(format!("{}/api/v1/secrets/{name}", api.url))
        .bearer_auth(token)
        .json(&serde_json::json!({ "value": value }))
        .send()
        .unwrap();
    assert_eq!(r.status(), 204, "setting secret {name}");
}

/// Whether `needle` occurs in any of the files' bytes.
fn files_contain(files: &[PathBuf], needle: &str) -> Option<PathBuf> {
    files
        .iter()
        .find(|f| std::fs::read(f).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle.as_bytes())))
        .cloned()
}

fn db_files(dir: &Path) -> Vec<PathBuf> {
    ["gpuci.db", "gpuci.db-wal", "gpuci.db-shm"].iter().map(|f| dir.join(f)).collect()
}

/// A step that tries every way to the coordinator's files and says what it found.
fn snooping_pipeline(dir: &Path) -> String {
    let d = dir.display();
    format!(
        "steps:\n  - key: snoop\n    command:\n      - \"ls -la {d} || true\"\n      - \"for f in api-token registration-token secrets.key gpuci.db gpuci.db-wal; do \
         if [ -e {d}/$f ]; then echo PRESENT:$f; cat {d}/$f | tr -c '[:print:]' ' ' | head -c 100000; echo; fi; done; true\"\n      \
         - \"echo snooped\"\n"
    )
}

/// Regression (issue 9): `gpuci up --data-dir /opt/...` — a directory the sandbox binds — let a
/// job read the API and registration tokens and the database. Now the whole data dir is
/// hidden (covered), for a job running as root too.
#[test]
fn a_job_cannot_read_the_coordinators_data_dir_under_a_bound_directory() {
    if isolation() != "bubblewrap" {
        eprintln!("skipped: needs bubblewrap");
        return;
    }
    let opt = dir_under_opt();
    let data = opt.path().join("data");
    let up = Up::start(&data, &[]);
    let api_token = std::fs::read_to_string(data.join("api-token")).unwrap().trim().to_string();
    let reg_token = std::fs::read_to_string(data.join("registration-token")).unwrap().trim().to_string();
    set_secret(&up.api, &api_token, "HF_TOKEN", "hf-value-the-job-must-not-see-7c1e");
    let p = up.api.submit(&snooping_pipeline(&data));
    let p = up.api.wait_pipeline(p.id, T);
    let log = up.api.log_text(p.jobs[0].id);
    assert!(log.contains("snooped"), "the job did not run to the end: {p:?}\n{log}");
    for (what, secret) in [
        ("API token", api_token.as_str()),
        ("registration token", reg_token.as_str()),
        ("secret value", "hf-value-the-job-must-not-see-7c1e"),
        // Pipeline rows of the database: the job's own command is stored there.
        ("database contents", "for f in api-token"),
    ] {
        let tail = &secret[secret.len().saturating_sub(24)..];
        assert!(!log.contains(tail), "the job read the {what}:\n{log}");
    }
    assert!(!log.contains("PRESENT:"), "the job saw a file of the coordinator's data dir:\n{log}");
}

/// `gpuci agent --hide PATH` keeps other credentials on the host from jobs, inside a bound
/// directory too; the registration token file the agent was started with is hidden as well.
#[test]
fn agent_hides_what_it_is_told_and_its_registration_token_file() {
    if isolation() != "bubblewrap" {
        eprintln!("skipped: needs bubblewrap");
        return;
    }
    let opt = dir_under_opt();
    let cred = opt.path().join("cloud-credentials");
    std::fs::write(&cred, "cloud-secret-3f9a\n").unwrap();
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let reg_file = opt.path().join("registration-token");
    std::fs::write(&reg_file, server.registration_token()).unwrap();
    let _agent = Command::new(BIN)
        .args(["agent", "--server", &server.url, "--name", "a", "--isolation", "bubblewrap"])
        .arg("--registration-token-file")
        .arg(&reg_file)
        .arg("--data-dir")
        .arg(dir.path().join("agent"))
        .arg("--hide")
        .arg(&cred)
        .stdout(Stdio::null())
        .spawn()
        .map(|child| Agent { child, data_dir: dir.path().join("agent") })
        .unwrap();
    let api = server.api();
    api.wait_agents(1, T);
    let o = opt.path().display();
    let p = api.submit(&format!(
        "steps:\n  - key: snoop\n    command: [\"cat {o}/cloud-credentials {o}/registration-token || true\", \"ls {o} || true\", \"echo snooped\"]\n"
    ));
    let p = api.wait_pipeline(p.id, T);
    let log = api.log_text(p.jobs[0].id);
    assert!(log.contains("snooped"), "{p:?}\n{log}");
    assert!(!log.contains("cloud-secret-3f9a"), "the job read a hidden file:\n{log}");
    assert!(!log.contains(&server.registration_token()[10..]), "the job read the registration token:\n{log}");
}

/// Regression (issue 9): the data dir was 0755 and `gpuci.db` 0644. A new data dir is made
/// private; a loose one left by an older gpuci is tightened at start.
#[test]
fn coordinator_and_agent_files_are_private_after_start() {
    let dir = tempdir();
    // Fresh: created by gpuci.
    let fresh = dir.path().join("fresh");
    let server = Server::start(&fresh, "30s");
    set_secret_with(&server, "X", "v");
    let agent_dir = dir.path().join("agent");
    let _agent = Agent::start(&server, &agent_dir, "a", &["--isolation", isolation()]);
    server.api().wait_agents(1, T);
    assert_eq!(mode(&fresh), 0o700);
    for f in ["api-token", "registration-token", "secrets.key", "gpuci.db"] {
        assert_eq!(mode(&fresh.join(f)), 0o600, "{f}");
    }
    for f in ["gpuci.db-wal", "gpuci.db-shm"] {
        if fresh.join(f).exists() {
            assert_eq!(mode(&fresh.join(f)), 0o600, "{f}");
        }
    }
    // 0700, or 0711 where jobs run as their own uids and pass through to their workspaces:
    // never listable or readable by others.
    assert_eq!(mode(&agent_dir) & 0o766, 0o700, "agent data dir mode {:o}", mode(&agent_dir));
    assert_eq!(mode(&agent_dir.join("agent.json")), 0o600);
    // Regression (outsider attack): the slots' disk images (every workspace, readable with
    // debugfs), uploaded work trees and saved caches were 0644 in 0755 directories whose
    // names anyone can guess below a 0711 data dir.
    for d in ["uploads", "cache", "slot-disks"] {
        assert_eq!(mode(&agent_dir.join(d)), 0o700, "{d}");
    }
    for e in std::fs::read_dir(agent_dir.join("slot-disks")).unwrap() {
        let p = e.unwrap().path();
        assert_eq!(mode(&p) & 0o077, 0, "{} mode {:o}", p.display(), mode(&p));
    }
    drop(server);

    // Loose: as an older gpuci (or a umask of 022 and a hand-made dir) left it: a used data
    // dir, its database included, opened up.
    let loose = dir.path().join("loose");
    drop(Server::start(&loose, "30s"));
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(loose.join("api-token"), "gpuci_api_0123\n").unwrap();
    for f in ["api-token", "gpuci.db"] {
        std::fs::set_permissions(loose.join(f), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let server = Server::start(&loose, "30s");
    assert_eq!(server.token, "gpuci_api_0123");
    assert_eq!(mode(&loose), 0o700);
    assert_eq!(mode(&loose.join("api-token")), 0o600);
    assert_eq!(mode(&loose.join("gpuci.db")), 0o600);
}

fn set_secret_with(server: &Server, name: &str, value: &str) {
    set_secret(&server.api(), &server.token, name, value);
}

/// Regression (issue 9): `gpuci.db` held secret values in plain text. Now the files of the
/// database, read byte by byte, hold none; the job still gets the value, after a restart too.
#[test]
fn the_database_without_the_key_reveals_no_secret_value() {
    let dir = tempdir();
    let data = dir.path().join("server");
    let mut server = Server::start(&data, "30s");
    let value = "hf-at-rest-marker-5d2b";
    set_secret_with(&server, "HF_TOKEN", value);
    assert_eq!(files_contain(&db_files(&data), value), None, "a database file holds the secret value");
    server.restart_hard();
    assert_eq!(files_contain(&db_files(&data), value), None, "a database file holds the secret value");
    assert!(!std::fs::read(data.join("secrets.key")).unwrap().is_empty());

    // The job gets the value (its log would mask it; the hash proves it arrived intact).
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit(
        "steps:\n  - key: use\n    secrets: [HF_TOKEN]\n    command: \"printf %s \\\"$HF_TOKEN\\\" | sha256sum\"\n",
    );
    let p = api.wait_pipeline(p.id, T);
    let log = api.log_text(p.jobs[0].id);
    let expected = sha256_hex(value);
    assert!(log.contains(&expected), "the job did not get the secret's value: {p:?}\n{log}");
}

fn sha256_hex(s: &str) -> String {
    let out = Command::new("sha256sum").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().and_then(|mut c| {
        use std::io::Write;
        c.stdin.take().unwrap().write_all(s.as_bytes())?;
        c.wait_with_output()
    });
    String::from_utf8(out.unwrap().stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

/// Regression (issue 9): a lost key file must stop the coordinator with a message that says
/// what is missing, not start it with a new key that cannot open the stored values.
#[test]
fn start_with_sealed_secrets_and_no_key_fails_and_says_what_is_missing() {
    let dir = tempdir();
    let data = dir.path().join("server");
    let server = Server::start(&data, "30s");
    set_secret_with(&server, "HF_TOKEN", "v");
    drop(server);
    let key = data.join("secrets.key");
    std::fs::remove_file(&key).unwrap();
    let out = Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started without its key: {stderr}");
    assert!(out.stdout.is_empty(), "it printed a URL: {}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains(&key.display().to_string()) && stderr.contains("missing"), "{stderr}");
    assert!(!key.exists(), "a new key was made in silence");
}

/// Regression (outsider attack): descriptors the agent inherited from whoever started it
/// reached every job. `exec 7<root-only-file 8>>root-only-log; exec gpuci up` let a job
/// `cat <&7` and `echo >&8` as its unprivileged uid.
#[test]
fn a_job_cannot_use_descriptors_its_agent_inherited() {
    let dir = tempdir();
    let secret = dir.path().join("root-only-secret");
    let log_file = dir.path().join("root-only-log");
    std::fs::write(&secret, "inherited-secret-5d21\n").unwrap();
    std::fs::write(&log_file, "").unwrap();
    for f in [&secret, &log_file] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let data = dir.path().join("data");
    let mut cmd = Command::new("bash");
    cmd.args([
        "-c",
        "exec 7<\"$1\" 8>>\"$2\"; exec \"$0\" up --listen 127.0.0.1:0 --isolation \"$3\" --data-dir \"$4\"",
        BIN,
    ])
    .arg(&secret)
    .arg(&log_file)
    .arg(isolation())
    .arg(&data);
    let up = Up::spawn(cmd, &data);
    let p = up.api.submit(
        "steps:\n  - key: fds\n    command:\n      - \"cat <&7 || echo no-fd-7\"\n      - \"echo job-wrote-here >&8 || echo no-fd-8\"\n      - \"ls -l /proc/self/fd/ || true\"\n      - \"echo done-probing\"\n",
    );
    let p = up.api.wait_pipeline(p.id, T);
    let log = up.api.log_text(p.jobs[0].id);
    assert!(log.contains("done-probing"), "the job did not run to the end: {p:?}\n{log}");
    assert!(!log.contains("inherited-secret-5d21"), "the job read through an inherited descriptor:\n{log}");
    assert_eq!(std::fs::read_to_string(&log_file).unwrap(), "", "the job wrote through an inherited descriptor");
}
