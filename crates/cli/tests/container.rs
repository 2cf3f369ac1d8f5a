//! `image:` steps run in a real container: a coordinator and an agent process, podman, and a
//! busybox image imported from a local rootfs (no registry is needed or reached).
//!
//! Without podman (or a static busybox) the tests skip with a note; with CI=true they fail.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);
const IMAGE: &str = "localhost/gpuci-test:busybox";
/// A file only the test image has.
const MARKER: &str = "/etc/gpuci-test-image";

fn skip_or_fail(why: &str) -> Option<()> {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI=true but {why}; run ./scripts/test");
    }
    eprintln!("note: skipping container test: {why}");
    None
}

/// Imports [`IMAGE`] once per test binary and checks that podman can run it here.
fn image() -> Option<()> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    match READY.get_or_init(build_image) {
        Ok(()) => Some(()),
        Err(why) => skip_or_fail(why),
    }
}

fn build_image() -> Result<(), String> {
    if Command::new("podman").arg("--version").output().is_err() {
        return Err("podman is not installed (apt-get install podman)".into());
    }
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or("busybox is not installed (apt-get install busybox-static)")?;
    let dir = tempdir();
    let root = dir.path().join("rootfs");
    for d in ["bin", "etc", "tmp", "proc", "sys", "dev", "srv/drop"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    // World-writable, as `/tmp` is in every stock image: what a job could fill on the engine's
    // storage if the image were writable.
    for d in ["tmp", "srv/drop"] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(root.join(d), std::fs::Permissions::from_mode(0o1777)).unwrap();
    }
    std::fs::copy(&busybox, root.join("bin/busybox")).unwrap();
    for tool in ["sh", "echo", "cat", "ls", "hostname", "test", "printf", "tr", "grep", "wc", "pwd", "true", "unshare"]
    {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(tool)).unwrap();
    }
    std::fs::write(root.join(MARKER.trim_start_matches('/')), "gpuci test image\n").unwrap();
    let tar = dir.path().join("rootfs.tar");
    run(Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&tar).arg("."))?;
    run(Command::new("podman").arg("import").arg(&tar).arg(IMAGE))?;
    // podman installed is not podman working (cgroups, rlimits): ask it to run the image.
    run(Command::new("podman").args(["run", "--rm", "--network=none", IMAGE, "sh", "-c", "true"]))
        .map_err(|e| format!("podman cannot run a container on this host ({e}); see crates/sandbox/src/container.rs"))
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Every log line of a job, system lines included.
fn full_log(server: &Server, id: i64) -> String {
    let url = format!("{}/api/v1/jobs/{id}/logs", server.url);
    let r = server.api().raw().get(url).bearer_auth(&server.token).send().unwrap();
    let mut out = String::new();
    for line in r.text().unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["type"] == "line" {
            out.push_str(&format!("[{}] {}\n", v["stream"].as_str().unwrap_or("?"), v["text"].as_str().unwrap_or("")));
        }
    }
    out
}

/// Real character devices (the numbers of /dev/null) where the simulated GPUs' nodes are, so
/// the agent passes the leased one to the engine. `None` when this process cannot mknod.
fn fake_gpu_nodes(agent_dir: &Path, n: usize) -> Option<()> {
    let dev = agent_dir.join("sim-dev");
    std::fs::create_dir_all(&dev).unwrap();
    for i in 0..n {
        let ok = Command::new("mknod")
            .arg(dev.join(format!("nvidia{i}")))
            .args(["c", "1", "3"])
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return None;
        }
    }
    Some(())
}

/// Containers (running or not) whose name ends with `suffix`.
fn containers_ending(suffix: &str) -> Vec<String> {
    let out = Command::new("podman").args(["ps", "-a", "--format", "{{.Names}}"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.ends_with(suffix)).map(str::to_string).collect()
}

#[test]
fn an_image_step_runs_in_the_container_with_only_its_leased_gpu() {
    if image().is_none() {
        return;
    }
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let agent_dir = dir.path().join("agent");
    let devices = fake_gpu_nodes(&agent_dir, 2).is_some();
    let _agent =
        Agent::start(&server, &agent_dir, "c1", &["--simulate-gpus", "2xH100-80GB", "--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let agent = api.agents().into_iter().find(|a| a.name == "c1").unwrap();
    assert_eq!(agent.container_runtime.as_deref(), Some("podman"), "the agent must advertise podman: {agent:#?}");

    let script = [
        "echo in-image=$(cat /etc/gpuci-test-image)",
        "test ! -e /etc/debian_version && echo host-etc=absent",
        "echo hostname=$(hostname)",
        "echo pid1=$(tr '\\0' ' ' < /proc/1/cmdline)",
        "echo pwd=$(pwd) ws=$GPUCI_WORKSPACE",
        "echo written-in-container > from-container.txt",
        "echo workspace-file=$(cat \"$GPUCI_WORKSPACE/from-container.txt\")",
        "echo devices=$(ls /dev | grep nvidia | tr '\\n' ' ')",
        "echo gpus=$GPUCI_GPUS",
        "(echo x > /srv/drop/x) 2>/dev/null && echo image=writable || echo image=read-only",
        "echo scratch > /tmp/s && echo tmp=$(cat /tmp/s)",
        "grep -q '10\\.88\\.' /proc/net/fib_trie && echo net=engine-bridge || echo net=not-the-bridge",
        "(unshare -U true) 2>/dev/null && echo userns=allowed || echo userns=denied",
    ]
    .join("\n");
    let yaml = format!(
        "steps:\n  - key: boxed\n    image: {IMAGE}\n    gpus: 1\n    command: {}\n",
        serde_json::to_string(&script).unwrap()
    );
    let t0 = std::time::Instant::now();
    let p = api.submit(&yaml);
    let id = p.jobs[0].id;
    let j = api.wait_job(id, "finished", T, |j| j.state.is_terminal());
    let log = full_log(&server, id);
    eprintln!("container job took {:?}; log:\n{log}", t0.elapsed());
    assert_eq!(j.state, JobState::Succeeded, "{}\n{log}", j.reason);
    assert!(log.contains(&format!("[system] running in container image {IMAGE} (Podman)")), "{log}");
    assert!(log.contains("[stdout] in-image=gpuci test image"), "the image's own file: {log}");
    assert!(log.contains("[stdout] host-etc=absent"), "the host's /etc is not visible: {log}");
    assert!(log.contains("bash is not in this image; running the step with sh -e"), "{log}");
    let ws = log.lines().find_map(|l| l.strip_prefix("[stdout] pwd=")).unwrap();
    let (pwd, env_ws) = ws.split_once(" ws=").unwrap();
    assert_eq!(pwd, env_ws, "the workspace is the working directory");
    // The slot's prepared workspace (`ws-N`, made with its ready sandbox) or one made for the job.
    assert!(pwd.contains("/slot-") && (pwd.contains("/ws-") || pwd.contains(&format!("job-{id}"))), "{pwd}");
    assert!(log.contains("[stdout] workspace-file=written-in-container"), "{log}");
    let pid1 = log.lines().find_map(|l| l.strip_prefix("[stdout] pid1=")).unwrap();
    assert!(
        pid1.contains("init") && pid1.contains("gpuci-step"),
        "pid 1 is the engine's init running the step: {pid1}"
    );

    // Outsider attacks: the image's own files were writable on the engine's storage (host
    // disk, no quota), and the job sat on the engine's bridge beside every other container.
    assert!(log.contains("[stdout] image=read-only") && log.contains("[stdout] tmp=scratch"), "{log}");
    assert!(log.contains("[stdout] net=not-the-bridge"), "the job joined the engine's bridge: {log}");
    // And the engine's default seccomp profile let it make a user namespace (and mount in it).
    assert!(log.contains("[stdout] userns=denied"), "no gpuci seccomp filter in the container: {log}");

    assert_eq!(j.gpus.len(), 1);
    let leased = agent.gpus.iter().find(|g| g.info.uuid == j.gpus[0]).unwrap().info.index;
    assert!(log.contains(&format!("[stdout] gpus={}", j.gpus[0])), "{log}");
    let seen = log.lines().find_map(|l| l.strip_prefix("[stdout] devices=")).unwrap().trim().to_string();
    if devices {
        assert_eq!(seen, format!("nvidia{leased}"), "only the leased GPU's node is in the container");
    } else {
        eprintln!("note: cannot mknod here; simulated GPUs have no device nodes, so none are passed");
        assert_eq!(seen, "");
    }
    wait_until("the job's container to be removed", Duration::from_secs(15), || {
        containers_ending(&format!("-job-{id}")).is_empty()
    });
}

#[test]
fn a_failing_command_in_the_container_fails_the_job_with_its_exit_code() {
    if image().is_none() {
        return;
    }
    let (_dir, server, _agent, api) = one_agent("30s", "c2", &["--isolation", isolation()]);
    let p = api.submit(&format!(
        "steps:\n  - key: bad\n    image: {IMAGE}\n    command: [\"echo before\", \"exit 7\", \"echo never\"]\n"
    ));
    let id = p.jobs[0].id;
    let j = api.wait_job(id, "finished", T, |j| j.state.is_terminal());
    let log = full_log(&server, id);
    assert_eq!(j.state, JobState::Failed, "{log}");
    assert_eq!(j.exit_code, Some(7), "{log}");
    assert_eq!(j.reason, "exited with code 7");
    assert!(log.contains("[stdout] before") && !log.contains("never"), "{log}");
    wait_until("the job's container to be removed", Duration::from_secs(15), || {
        containers_ending(&format!("-job-{id}")).is_empty()
    });
}

/// Regression (outsider attack, critical): the engine's client runs as root outside any
/// sandbox, and ran with the job's workspace as its working directory and `HOME`: podman
/// looked up registry credentials in the workspace and ran the "credential helper" the job
/// named there (`x/../pwn`, resolved from the working directory), as root. The client's
/// directory and home are the agent's own now; nothing of the workspace steers it.
#[test]
fn the_engine_client_runs_nothing_from_the_jobs_workspace() {
    if image().is_none() {
        return;
    }
    let (dir, server, _agent, _api) = one_agent("30s", "c3", &["--isolation", isolation()]);
    let work = dir.path().join("work");
    let marker = dir.path().join("PWNED");
    let pwn = work.join("pwn");
    std::fs::create_dir_all(work.join(".config/containers")).unwrap();
    std::fs::create_dir_all(work.join(".docker")).unwrap();
    std::fs::create_dir_all(work.join("docker-credential-x")).unwrap();
    std::fs::write(work.join("docker-credential-x/keep"), "an upload carries files, not empty directories\n").unwrap();
    let helpers = r#"{"credHelpers":{"evil.invalid":"x/../pwn"}}"#;
    std::fs::write(work.join(".config/containers/auth.json"), helpers).unwrap();
    std::fs::write(work.join(".docker/config.json"), helpers).unwrap();
    std::fs::write(
        work.join(".config/containers/registries.conf"),
        "unqualified-search-registries = [\"evil.invalid\"]\n",
    )
    .unwrap();
    std::fs::write(&pwn, format!("#!/bin/sh\nid > {}\necho '{{}}'\n", marker.display())).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&pwn, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let file = work.join("pwn.yml");
    std::fs::write(&file, "steps:\n  - key: pull\n    image: \"evil.invalid/foo:1\"\n    command: echo never\n")
        .unwrap();
    let out = Command::new(BIN)
        .arg("submit")
        .arg(&file)
        .args(["--wait", "--server", &server.url, "--token", &server.token])
        .output()
        .unwrap();
    assert!(!out.status.success(), "the image cannot be pulled here: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!marker.exists(), "the job's credential helper ran on the host: {:?}", std::fs::read_to_string(&marker));
}

/// Real uids of the processes running now.
fn running_uids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())))
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        .filter_map(|st| st.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok())
        .collect()
}

/// Regression (outsider attack): an image step outlived `kill -9` of its agent. The engine's
/// client died with the agent, but conmon and the container kept running as the job's uid,
/// with its environment and workspace (a GPU job kept its GPU), while the coordinator marked
/// the job lost and could run it again elsewhere; only a restart of the same agent ended it.
/// Nothing of an image step may outlive its agent, however it ends.
#[test]
fn an_image_step_does_not_outlive_its_agent_killed_with_sigkill() {
    if image().is_none() {
        return;
    }
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let mut agent = Agent::start(&server, &dir.path().join("agent"), "c4", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    // A detached child that ignores TERM and HUP, and a long sleep: neither ends on its own.
    let script = "echo uid=$(busybox id -u)\n\
        (busybox setsid sh -c 'trap \"\" TERM HUP; while :; do busybox sleep 1; done' &)\n\
        echo started\n\
        busybox sleep 600";
    let p = api.submit(&format!(
        "steps:\n  - key: long\n    image: {IMAGE}\n    network: none\n    command: {}\n",
        serde_json::to_string(script).unwrap()
    ));
    let id = p.jobs[0].id;
    wait_until_or(
        "the image step to start",
        T,
        || full_log(&server, id).contains("[stdout] started"),
        || format!("{:?}\n{}", api.job(id), full_log(&server, id)),
    );
    let log = full_log(&server, id);
    let uid: u32 = log.lines().find_map(|l| l.strip_prefix("[stdout] uid=")).unwrap().trim().parse().unwrap();
    assert_ne!(uid, 0, "the job runs as a uid of its own: {log}");
    assert!(running_uids().contains(&uid), "the job's processes run as uid {uid}");
    // This agent's container: the tests of this file run at once, each with a job 1.
    let agents: Vec<gpuci_protocol::api::AgentSummary> = api.get("/api/v1/agents");
    let prefix: String = agents[0].id.chars().filter(char::is_ascii_alphanumeric).take(12).collect();
    let mine = format!("{prefix}-job-{id}");
    assert_eq!(containers_ending(&mine).len(), 1, "the job's container is there");

    agent.kill9();
    // Bounded wait, not a speed check: the container, conmon and every process of the job's
    // uid must go without an agent (before the fix they ran for the full 600 s).
    wait_until_or(
        "nothing of the image step to be left after its agent's kill -9",
        Duration::from_secs(90),
        || containers_ending(&mine).is_empty() && !running_uids().contains(&uid),
        || {
            format!(
                "containers: {:?}; processes of uid {uid}: {}",
                containers_ending(&mine),
                running_uids().iter().filter(|u| **u == uid).count()
            )
        },
    );
}
