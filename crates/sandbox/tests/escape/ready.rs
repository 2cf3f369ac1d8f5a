//! Ready sandboxes (the slot's next job's bubblewrap already started): the same containment again.

use super::warm::*;
use super::*;

#[tokio::test]
async fn a_job_in_a_ready_sandbox_gets_its_own_limits() {
    if !ready("ready_limits", ALL) {
        return;
    }
    let root = workspaces();
    let user = test_user();
    let probe = ws_probe(root.path(), user);
    let mut s = spec("ready-oom", &probe, "head -c 200M /dev/zero | tail > /dev/null", Isolation::Bubblewrap);
    s.resources = Resources { memory: Some(Bytes::from_mib(64)), cpu_millis: None, pids: Some(64) };
    let (r, job) = run_ready(&s, &root.path().join("r1")).await;
    assert!(r.exit.oom_killed, "the memory limit was not applied in the ready sandbox: {:?} {}", r.exit, r.err);
    fs::remove_dir_all(&job.workspace).expect("remove");
    let mut s = spec("ready-bomb", &probe, "for i in $(seq 100); do sleep 5 & done; wait", Isolation::Bubblewrap);
    s.resources = Resources { memory: Some(Bytes::from_mib(256)), cpu_millis: None, pids: Some(16) };
    let (r, _) = run_ready(&s, &root.path().join("r2")).await;
    assert!(r.exit.pids_limit_hit, "the pids limit was not applied in the ready sandbox: {:?} {}", r.exit, r.err);
}

#[tokio::test]
async fn a_job_unlike_the_ready_sandbox_starts_from_the_waiting_shell_and_the_sandbox_is_ended() {
    if !ready("ready_misfit", ALL) {
        return;
    }
    let root = workspaces();
    let user = test_user();
    let s = spec(
        "ready-misfit",
        &ws_probe(root.path(), user),
        "id -u; ls /opt/hidden-by-the-job 2>&1 | head -1",
        Isolation::Bubblewrap,
    );
    // What makes a job differ from the sandbox started for it: more hidden, another scratch
    // size, no network, not using its workspace.
    type Change = fn(&mut SandboxSpec);
    let changes: [(&str, Change); 4] = [
        ("hidden path", |j| j.hide_paths.push("/opt".into())),
        ("scratch size", |j| j.scratch_size = Some(32 << 20)),
        ("network", |j| j.network = gpuci_sandbox::Network::Host),
        ("workspace", |j| j.workspace = j.workspace.with_file_name("elsewhere")),
    ];
    for (i, (what, change)) in changes.iter().enumerate() {
        let ws = root.path().join(format!("m{i}"));
        let (warm, mut job) = ready_for(&s, &ws).await;
        change(&mut job);
        if !job.workspace.exists() {
            fs::create_dir(&job.workspace).unwrap();
            std::os::unix::fs::chown(&job.workspace, Some(user.uid), Some(user.gid)).unwrap();
        }
        let (shell, sandbox) = (warm.pid().unwrap(), warm.ready_pid().unwrap());
        let (mut sb, mut so, _se) = Sandbox::spawn_warm(&job, Some(warm)).expect("spawn");
        assert_eq!(sb.pid(), shell, "{what}: the job did not start from the waiting shell");
        let mut out = String::new();
        so.read_to_string(&mut out).await.expect("read");
        assert!(out.starts_with(&user.uid.to_string()), "{what}: {out}");
        sb.wait().await.expect("wait");
        sb.cleanup().await.expect("cleanup");
        gone(sandbox, &format!("{what}: the unused ready sandbox")).await;
        uid_idle(user.uid, what).await;
    }
}

#[tokio::test]
async fn a_discarded_ready_sandbox_leaves_no_process_and_no_workspace() {
    if !ready("ready_discard", ALL) {
        return;
    }
    let root = workspaces();
    let user = test_user();
    let s = spec("ready-discard", &ws_probe(root.path(), user), "true", Isolation::Bubblewrap);
    let ws = root.path().join("d");
    let mut w = warm_spec(&s, format!("{}-warm", s.job_id));
    let mut template = s.clone();
    template.workspace = ws.clone();
    w.ready = Some(gpuci_sandbox::ReadySpec { name: format!("{}-ready", s.job_id), sandbox: template });
    let warm = gpuci_sandbox::WarmStart::prepare(w).await.expect("warm start");
    let (shell, sandbox) = (warm.pid().unwrap(), warm.ready_pid().expect("a ready sandbox"));
    let meta = fs::metadata(&ws).expect("the ready sandbox's workspace");
    assert_eq!((meta.uid(), meta.mode() & 0o777), (user.uid, 0o700), "owned by the job user, private");
    assert_eq!(fs::read_dir(&ws).unwrap().count(), 0, "empty");
    warm.discard().await;
    for pid in [shell, sandbox] {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "a waiting process outlived discard");
    }
    assert!(!ws.exists(), "the untaken workspace is left");
    // A workspace that exists already is never used for one (something else may have written it).
    fs::create_dir(&ws).unwrap();
    let mut w = warm_spec(&s, format!("{}-warm2", s.job_id));
    let mut template = s.clone();
    template.workspace = ws.clone();
    w.ready = Some(gpuci_sandbox::ReadySpec { name: format!("{}-ready2", s.job_id), sandbox: template });
    let mut warm = gpuci_sandbox::WarmStart::prepare(w).await.expect("warm start");
    assert!(warm.ready_pid().is_none() && warm.take_workspace().is_none(), "a ready sandbox on a used workspace");
    warm.discard().await;
}

/// Outsider finding (issue 9): an environment value with NULs in it became bwrap arguments of
/// its own (bwrap reads `--args FD` NUL-separated): `--cap-add ALL`, a bind of the host's `/`.
/// Refused on every path: cold, from the waiting shell, in a ready sandbox.
#[tokio::test]
async fn a_nul_byte_in_the_environment_never_becomes_a_sandbox_argument() {
    if !ready("nul_env", ALL) {
        return;
    }
    let root = workspaces();
    let user = test_user();
    let probe = ws_probe(root.path(), user);
    let outside = tempfile::Builder::new().prefix("gpuci-nul-").tempdir_in("/var/tmp").expect("tempdir");
    let planted = outside.path().join("planted");
    let script = "echo x > /outside/planted; grep CapEff /proc/self/status; id -u";
    let mut s = spec("nul-env", &probe, script, Isolation::Bubblewrap);
    let inject = format!("a\0--bind\0{}\0/outside\0--cap-add\0ALL\0--uid\00", outside.path().display());
    s.env.insert("ZZZ".into(), inject);
    let fails = |r: Result<
        (Sandbox, tokio::process::ChildStdout, tokio::process::ChildStderr),
        gpuci_sandbox::SandboxError,
    >,
                 how: &str| match r {
        Ok(_) => panic!("{how}: a job with a NUL in its environment was started"),
        Err(e) => assert!(e.to_string().contains("NUL"), "{how}: {e}"),
    };
    fails(Sandbox::spawn(&s), "cold");
    let warm = warm_for(&s).await;
    fails(Sandbox::spawn_warm(&s, Some(warm)), "waiting shell");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (warm, job) = ready_for(&s, &root.path().join("r")).await;
    fails(Sandbox::spawn_warm(&job, Some(warm)), "ready sandbox");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!planted.exists(), "the job wrote outside its sandbox");
}

/// Outsider finding (issue 9): a job started processes that claimed another job's sandbox id
/// (`GPUCI_SANDBOX_ID`, which any job can set on its own processes); that job's clean-up then
/// waited on them (10 s), killed them, and left its cgroup behind. A job in a cgroup is found
/// by its cgroup alone.
#[tokio::test]
async fn a_process_claiming_another_jobs_sandbox_id_is_not_that_jobs() {
    if !ready("marker_forged", ALL) {
        return;
    }
    // Sandboxed, and `sandbox: none` as a job user (outsider round 2: still scanned by marker).
    for isolation in [Isolation::Bubblewrap, Isolation::None] {
        claimed_by_another(isolation).await;
    }
}

async fn claimed_by_another(isolation: Isolation) {
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let s = spec("marker-victim", &ws, "sleep 0.3", isolation);
    // Another job's process (here: started by the test, as another uid) claiming the victim's id.
    let other = test_user();
    let mut claimant = std::process::Command::new("sleep");
    claimant.arg("30").env("GPUCI_SANDBOX_ID", &s.job_id);
    std::os::unix::process::CommandExt::uid(&mut claimant, other.uid);
    std::os::unix::process::CommandExt::gid(&mut claimant, other.gid);
    let mut claimant = claimant.spawn().expect("claimant");
    let (mut sb, _so, _se) = Sandbox::spawn(&s).expect("spawn");
    assert!(sb.has_cgroup(), "this test needs a job cgroup");
    assert!(!sb.pids().contains(&(claimant.id() as i32)), "the claimant counted as the job's");
    sb.wait().await.expect("wait");
    let t = std::time::Instant::now();
    sb.cleanup().await.expect("the job's clean-up");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "{isolation:?}: the clean-up waited on a process that is not the job's"
    );
    assert!(
        claimant.try_wait().expect("try_wait").is_none(),
        "{isolation:?}: the clean-up killed another job's process"
    );
    claimant.kill().expect("kill");
    claimant.wait().expect("wait");
}

#[tokio::test]
async fn a_warm_started_job_gets_its_own_limits() {
    if !ready("warm_limits", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let mut s = spec("warm-oom", &ws, "head -c 200M /dev/zero | tail > /dev/null", Isolation::Bubblewrap);
    s.resources = Resources { memory: Some(Bytes::from_mib(64)), cpu_millis: None, pids: Some(64) };
    let r = run_warm(&s).await;
    assert!(r.exit.oom_killed, "the memory limit was not applied to the warm start: {:?} {}", r.exit, r.err);
    assert_eq!(r.exit.to_string(), "out of memory (limit 64 MiB)");
    let mut s = spec("warm-bomb", &ws, "for i in $(seq 100); do sleep 5 & done; wait", Isolation::Bubblewrap);
    s.resources = Resources { memory: Some(Bytes::from_mib(256)), cpu_millis: None, pids: Some(16) };
    let r = run_warm(&s).await;
    assert!(r.exit.pids_limit_hit, "the pids limit was not applied to the warm start: {:?} {}", r.exit, r.err);
}

#[tokio::test]
async fn a_warm_start_that_does_not_fit_is_discarded_and_the_job_starts_cold() {
    if !ready("warm_misfit", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let s = spec("warm-misfit", &ws, "id -u", Isolation::Bubblewrap);
    let mut other = s.clone();
    other.user = Some(test_user());
    let warm = warm_for(&other).await;
    let waiting = warm.pid().expect("pid");
    let (mut sb, mut so, _se) = Sandbox::spawn_warm(&s, Some(warm)).expect("spawn");
    assert_ne!(sb.pid(), waiting, "a warm start of another user ran the job");
    let mut out = String::new();
    so.read_to_string(&mut out).await.expect("read");
    assert_eq!(out.trim(), s.user.unwrap().uid.to_string());
    sb.wait().await.expect("wait");
    sb.cleanup().await.expect("cleanup");
    let gone = async {
        while Path::new(&format!("/proc/{waiting}")).exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), gone).await.expect("the misfit warm start was not ended");
}

#[tokio::test]
async fn a_discarded_warm_start_leaves_no_process_and_no_cgroup() {
    if !ready("warm_discard", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let s = spec("warm-discard", &ws, "true", Isolation::Bubblewrap);
    let warm = warm_for(&s).await;
    let pid = warm.pid().expect("pid");
    let cgroups = fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("its cgroups");
    let memory = cgroups.lines().find(|l| l.contains(":memory:")).map(|l| l.rsplit(':').next().unwrap().to_string());
    let uid = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(uid.lines().any(|l| l.starts_with("Uid:") && l.contains(&s.user.unwrap().uid.to_string())), "{uid}");
    warm.discard().await;
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "the waiting process outlived discard");
    if let Some(m) = memory {
        let dir = Path::new("/sys/fs/cgroup/memory").join(m.trim_start_matches('/'));
        assert!(!dir.exists(), "its cgroup {} is left", dir.display());
    }
}

#[tokio::test]
async fn a_warm_start_is_refused_while_anything_runs_as_its_uid() {
    // A process of the uid (a job's leftover) could trace the waiting process and read the
    // next job's secrets from it: none may wait beside one.
    if !ready("warm_busy", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let s = spec("warm-busy", &ws, "sleep 30", Isolation::Bubblewrap);
    let (mut sb, _o, _e) = Sandbox::spawn(&s).expect("spawn");
    let w = warm_spec(&s, format!("{}-warm", s.job_id));
    let e = gpuci_sandbox::WarmStart::prepare(w).await.expect_err("a warm start beside a running process of its uid");
    assert!(e.to_string().contains("still running"), "{e}");
    sb.kill_tree().expect("kill");
    sb.wait().await.expect("wait");
    sb.cleanup().await.expect("cleanup");
    // Once the uid is idle again it is allowed.
    warm_for(&s).await.discard().await;
}

#[tokio::test]
async fn any_agents_start_up_sweep_removes_warm_cgroups_left_empty_and_spares_live_ones() {
    if !ready("warm_sweep", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let s = spec("warm-sweep", &ws, "true", Isolation::Bubblewrap);
    let memory_dir = |pid: u32| {
        let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
        let rel =
            text.lines().find(|l| l.contains(":memory:")).expect("memory line").rsplit(':').next().unwrap().to_string();
        Path::new("/sys/fs/cgroup/memory").join(rel.trim_start_matches('/'))
    };
    // Named as agents name them (`<agent>-warm-<slot>-<n>`; the other tests' names do not
    // have that form, so this sweep cannot race their warm starts while they are being made).
    let prefix = format!("t{}", std::process::id() % 100_000_000);
    let named = |spec: &SandboxSpec, n: u32| warm_spec(spec, format!("{prefix}-warm-0-{n}"));
    // One left behind by an agent killed for good (its waiting process died with it) ...
    let dead = gpuci_sandbox::WarmStart::prepare(named(&s, 0)).await.expect("warm start");
    let dead_pid = dead.pid().expect("pid");
    let dead_dir = memory_dir(dead_pid);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(dead_pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let gone = async {
        while fs::read_to_string(dead_dir.join("cgroup.procs")).is_ok_and(|p| !p.trim().is_empty()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), gone).await.expect("the killed process left its cgroup");
    std::mem::forget(dead); // as a killed agent would: nobody discards it
                            // ... and one of a live agent, waiting.
    let mut other = s.clone();
    other.user = Some(test_user());
    let live = gpuci_sandbox::WarmStart::prepare(named(&other, 1)).await.expect("warm start");
    let live_dir = memory_dir(live.pid().expect("pid"));
    let report = gpuci_sandbox::sweep("another-agent-", &[]);
    assert!(report.stale_warm_removed >= 1, "{report:?}");
    assert!(!dead_dir.exists(), "the dead agent's warm cgroup {} is left", dead_dir.display());
    assert!(live_dir.exists(), "a live agent's warm cgroup was removed");
    live.discard().await;
}

/// Without a cgroup (a container that gives none), a job with a uid of its own leaves nothing
/// behind, however it hid: here a process with an empty environment (no marker) in a session
/// of its own, double-forked away from the job's tree. An outsider kept one alive in a pod by
/// stopping bubblewrap's init under ptrace and spied on the slot's next job; every process of
/// the job's uid now goes at cleanup.
#[tokio::test]
async fn without_a_cgroup_nothing_of_the_jobs_uid_outlives_it() {
    if !ready("without_a_cgroup_nothing_of_the_jobs_uid_outlives_it", Needs { bwrap: false, cgroups: false }) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "hide");
    let mut s = spec(
        "hide",
        &ws,
        "(env -i /usr/bin/setsid /bin/sleep 300 </dev/null >/dev/null 2>&1 &) ; sleep 0.3; echo left",
        Isolation::None,
    );
    s.cgroups = gpuci_sandbox::CgroupUse::Disabled;
    let uid = s.user.expect("a job uid").uid;
    let r = run(&s).await;
    assert_eq!(r.out.trim(), "left", "{}", r.err);
    let survivors: Vec<String> = fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())))
        .filter_map(|e| fs::read_to_string(e.path().join("status")).ok())
        .filter(|st| {
            !st.lines().any(|l| l.starts_with("State:") && l.contains('Z'))
                && st.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some(&uid.to_string()))
        })
        .map(|st| st.lines().take(1).collect())
        .collect();
    assert!(survivors.is_empty(), "processes of the job's uid {uid} outlived it: {survivors:?}");
}
