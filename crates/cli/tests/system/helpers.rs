//! Helpers the system tests share: slot processes, secrets encrypted for a pipeline file, agents without root, `jobs show`.

use super::*;

pub(crate) fn next_jobs_run(api: &Api) {
    for round in 0..3 {
        let p = api.submit("steps:\n  - key: next\n    command: test ! -e d && echo clean-slot\n");
        let done = api.wait_pipeline(p.id, T);
        let next = &done.jobs[0];
        assert_eq!(next.state, JobState::Succeeded, "round {round}: {next:?}");
        assert!(api.log_text(next.id).contains("clean-slot"), "round {round}");
    }
}

/// Live (not zombie) processes any of whose uids is `uid`: (pid, command line).
pub(crate) fn live_processes_of_uid(uid: u32) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else { continue };
        let state = status.lines().find_map(|l| l.strip_prefix("State:")).unwrap_or("").trim_start();
        let ours = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .is_some_and(|u| u.split_whitespace().any(|x| x == uid.to_string()));
        if ours && !state.starts_with('Z') && !state.starts_with('X') {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            found.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ").trim_end().to_string()));
        }
    }
    found
}

/// Parent pid of `pid`, from `/proc/PID/stat` (the field after the command's closing paren).
pub(crate) fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// An idle slot's waiting processes: (the waiting shell, the ready sandbox's bwrap), when the
/// slot's uid runs exactly those two and what the sandbox runs inside (bwrap's init and
/// `/bin/sh -s`), nothing else.
pub(crate) fn idle_slot(uid: u32) -> Option<(u32, u32)> {
    let procs = live_processes_of_uid(uid);
    let of_uid = |pid: u32| procs.iter().any(|(p, _)| *p == pid);
    let top: Vec<&(u32, String)> = procs.iter().filter(|(p, _)| !parent_of(*p).is_some_and(of_uid)).collect();
    let shell = top.iter().find(|(_, c)| c == "/bin/sh -s")?.0;
    let ready = top.iter().find(|(_, c)| c.contains("bwrap --args") && c.ends_with(" -- /bin/sh -s"))?.0;
    let inner = procs.iter().filter(|(_, c)| c.contains("bwrap --args") || c == "/bin/sh -s").count();
    (top.len() == 2 && procs.len() == 4 && inner == 4).then_some((shell, ready))
}

/// The job's system lines (gpuci's own), one per line.
pub(crate) fn system_lines(api: &Api, id: i64) -> String {
    let body = api.raw().get(format!("{}/api/v1/jobs/{id}/logs", api.url)).bearer_auth(api.token()).send().unwrap();
    let mut out = String::new();
    for line in body.text().unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("ndjson");
        if v["type"] == "line" && v["stream"] == "system" {
            out.push_str(v["text"].as_str().unwrap_or_default());
            out.push('\n');
        }
    }
    out
}

/// `gpuci secret encrypt`, run as a repository's maintainer would: with the coordinator's
/// public key only, no token. The printed line is what goes under `secrets:`.
pub(crate) fn encrypt_line(recipient: &str, name: &str, repo: &str, git_ref: Option<&str>, value: &str) -> String {
    use std::io::Write;
    let mut cmd = std::process::Command::new(BIN);
    cmd.args(["secret", "encrypt", name, "--repo", repo, "--recipient", recipient, "--server", "http://127.0.0.1:9"]);
    if let Some(r) = git_ref {
        cmd.args(["--ref", r]);
    }
    let mut child = cmd
        .env_remove("GPUCI_TOKEN")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(format!("{value}\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(line.starts_with(&format!("{name}: \"gpuci:v1:")) && !line.contains(value), "{line}");
    line
}

/// A `gpuci agent` as an unprivileged user (the set-up the Slurm guide recommends), with its
/// own data dir; `None` (with a message) where this machine cannot run one.
pub(crate) fn unprivileged_agent(
    server: &Server,
    root: &std::path::Path,
    name: &str,
    extra: &[&str],
) -> Option<std::process::Child> {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP: starting an agent as another user needs root");
        return None;
    }
    let data = root.join(name);
    std::fs::create_dir_all(&data).unwrap();
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711)).unwrap();
    std::os::unix::fs::chown(&data, Some(65534), Some(65534)).unwrap();
    let child = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--reset-env", "--"])
        .arg(BIN)
        .args(["agent", "--server", &server.url, "--registration-token", &server.registration_token()])
        .arg("--data-dir")
        .arg(&data)
        .args(["--name", name])
        .args(extra)
        .env("GPUCI_LOG", "info")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("setpriv (util-linux)");
    Some(child)
}

/// `gpuci jobs show ID` (with `--json`: its JSON) against `server`.
pub(crate) fn jobs_show(server: &Server, id: i64, json: bool) -> String {
    let out = std::process::Command::new(BIN)
        .args(["jobs", "show", &id.to_string(), "--server", &server.url, "--token", &server.token])
        .args(json.then_some("--json"))
        .output()
        .expect("gpuci jobs show");
    assert!(out.status.success(), "gpuci jobs show {id}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The keys of what a job's agent did not enforce, as `gpuci jobs show --json` has them.
pub(crate) fn unenforced_keys(server: &Server, id: i64) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&jobs_show(server, id, true)).unwrap();
    let list = v["unenforced"].as_array().unwrap_or_else(|| panic!("no `unenforced` list in {v:#}"));
    list.iter().map(|u| u["key"].as_str().unwrap().to_string()).collect()
}
