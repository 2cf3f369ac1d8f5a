//! The sandbox's walls: workspaces, users, limits, the network and what a job leaves behind.

use super::*;

#[tokio::test]
pub(crate) async fn job_cannot_read_another_running_jobs_workspace() {
    if !ready("other_workspace", ALL) {
        return;
    }
    let root = workspaces();
    let (wa, wb) = (mkws(root.path(), "a"), mkws(root.path(), "b"));
    fs::write(wa.join("secret.txt"), "A-SECRET").expect("write");
    let a_spec = spec("ws-a", &wa, "cat secret.txt; sleep 30", Isolation::Bubblewrap);
    let (mut a, mut a_out, _a_err) = Sandbox::spawn(&a_spec).expect("spawn a");
    let mut buf = [0u8; 8];
    a_out.read_exact(&mut buf).await.expect("A reads its own workspace (positive control)");
    assert_eq!(&buf, b"A-SECRET");

    let script = format!("cat {0}/secret.txt; ls {1}", wa.display(), root.path().display());
    let b = run(&spec("ws-b", &wb, &script, Isolation::Bubblewrap)).await;
    assert!(!b.out.contains("A-SECRET"), "job B read job A's workspace: {}", b.out);
    assert!(b.err.contains("No such file"), "expected A's workspace to not exist for B: {}", b.err);
    assert_eq!(b.out.trim(), "b", "B sees only its own workspace in the workspaces root");
    a.kill_tree().expect("kill a");
    a.cleanup().await.expect("cleanup a");
}

#[tokio::test]
pub(crate) async fn job_cannot_read_agent_tokens() {
    if !ready("agent_tokens", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    // Under a bound directory (/opt), hidden by hide_paths.
    fs::create_dir_all("/opt").expect("/opt");
    let data = tempfile::Builder::new().prefix("gpuci-agent-").tempdir_in("/opt").expect("tempdir");
    fs::write(data.path().join("token"), "TOKEN-IN-OPT").expect("write");
    // Under a directory that is simply not bound (/var/lib).
    let lib = tempfile::Builder::new().prefix("gpuci-agent-").tempdir_in("/var/lib").expect("tempdir");
    fs::write(lib.path().join("token"), "TOKEN-IN-VARLIB").expect("write");
    let mut s = spec(
        "tokens",
        &ws,
        &format!(
            "cat {0}/token; ls -A {0}; cat {1}/token; cat /etc/shadow; cat /root/.bash_history; true",
            data.path().display(),
            lib.path().display()
        ),
        Isolation::Bubblewrap,
    );
    s.hide_paths.push(data.path().to_path_buf());
    let r = run(&s).await;
    assert!(!r.out.contains("TOKEN-IN-OPT"), "token under a hide path was readable: {}", r.out);
    assert!(!r.out.contains("TOKEN-IN-VARLIB"), "token under an unbound dir was readable: {}", r.out);
    assert!(!r.out.contains("root:"), "/etc/shadow was readable: {}", r.out);
    assert!(r.out.trim().is_empty(), "the hidden dir must look empty: {:?}", r.out);
    assert!(r.err.contains(&format!("{}/token: No such file", lib.path().display())), "{}", r.err);
}

#[tokio::test]
pub(crate) async fn job_sees_only_its_leased_gpu_nodes() {
    if !ready("gpu_nodes", ALL) {
        return;
    }
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let dev = tempfile::Builder::new().prefix("gpuci-dev-").tempdir_in("/var/tmp").expect("tempdir");
    for n in ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl"] {
        // Like /dev/null: harmless to open.
        mknod(&dev.path().join(n), SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(1, 3)).expect("mknod");
    }
    let mut s = spec(
        "gpu",
        &ws,
        "ls /dev | grep nvidia; test -c /dev/nvidia1 && echo x > /dev/nvidia1 && echo wrote-leased; \
         for n in 0 2 3; do test -c /dev/nvidia$n && echo VISIBLE-$n; done; echo done",
        Isolation::Bubblewrap,
    );
    s.gpu_devices = vec![dev.path().join("nvidia1")];
    s.gpu_common_devices = vec![dev.path().join("nvidiactl"), dev.path().join("nvidia-uvm")];
    let r = run(&s).await;
    let lines: Vec<&str> = r.out.lines().collect();
    assert_eq!(lines, ["nvidia1", "nvidiactl", "wrote-leased", "done"], "stderr: {}", r.err);
}

/// The slot's disk (and often the workspaces' filesystem) is mounted `nodev`: a device node
/// made there cannot be opened, and CUDA finds no GPU (seen on a real H100). The job's GPU
/// nodes must open all the same.
#[tokio::test]
pub(crate) async fn leased_gpu_nodes_open_when_the_workspaces_are_mounted_nodev() {
    if !ready("gpu_nodes_nodev", ALL) {
        return;
    }
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let root = workspaces();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "nodev,nosuid,size=16m,mode=0711", "tmpfs"])
        .arg(root.path())
        .status()
        .expect("mount");
    assert!(mounted.success(), "mounting a nodev tmpfs for the workspaces");
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
    let _unmount = Unmount(root.path());
    let ws = mkws(root.path(), "w");
    let dev = tempfile::Builder::new().prefix("gpuci-dev-").tempdir_in("/var/tmp").expect("tempdir");
    mknod(&dev.path().join("nvidia0"), SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(1, 3)).expect("mknod");
    let mut s = spec("gpu-nodev", &ws, "echo x > /dev/nvidia0 && echo opened", Isolation::Bubblewrap);
    s.gpu_devices = vec![dev.path().join("nvidia0")];
    let r = run(&s).await;
    assert_eq!(r.out.trim(), "opened", "the leased node could not be opened: {}", r.err);
    // Nothing is left behind in the place the private nodes were made.
    assert!(!Path::new(gpuci_sandbox::PRIVATE_DEV_ROOT).join(&s.job_id).exists());
}

#[tokio::test]
pub(crate) async fn job_cannot_signal_the_agent_or_another_job() {
    if !ready("signal", ALL) {
        return;
    }
    let root = workspaces();
    let (wa, wb) = (mkws(root.path(), "a"), mkws(root.path(), "b"));
    let (mut a, _ao, _ae) = Sandbox::spawn(&spec("sig-a", &wa, "sleep 30", Isolation::Bubblewrap)).expect("spawn a");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let a_pids = a.pids();
    assert!(!a_pids.is_empty(), "job A has processes (positive control)");
    let me = std::process::id();
    let mut script = format!("kill -0 {me} && echo AGENT-VISIBLE; kill -TERM {me} && echo AGENT-SIGNALLED; ");
    for p in &a_pids {
        script.push_str(&format!("kill -KILL {p} && echo JOB-A-KILLED; "));
    }
    script.push_str("true");
    let b = run(&spec("sig-b", &wb, &script, Isolation::Bubblewrap)).await;
    assert!(!b.out.contains("AGENT"), "job signalled the agent: {}", b.out);
    assert!(!b.out.contains("JOB-A-KILLED"), "job signalled another job: {}", b.out);
    assert!(b.err.contains("No such process"), "expected the pids to be invisible: {}", b.err);
    assert_eq!(a.pids(), a_pids, "job A is untouched");
    a.kill_tree().expect("kill");
    let exit = a.wait().await.expect("wait");
    assert_eq!(exit.signal, Some(9), "kill_tree ended A with SIGKILL: {exit:?}");
    a.cleanup().await.expect("cleanup");
}

pub(crate) async fn oom(isolation: Isolation) {
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    // `tail` keeps the whole (newline-free) input in memory: 200 MiB against a 64 MiB limit.
    let mut s = spec("oom", &ws, "head -c 200M /dev/zero | tail > /dev/null", isolation);
    s.resources = Resources { memory: Some(Bytes::from_mib(64)), cpu_millis: None, pids: Some(64) };
    let r = run(&s).await;
    assert!(r.exit.oom_killed, "exceeding the memory limit was not detected as OOM: {:?} {}", r.exit, r.err);
    assert!(!r.exit.success());
    assert_eq!(r.exit.to_string(), "out of memory (limit 64 MiB)");
    if let Some(peak) = r.exit.memory_peak {
        assert!(peak.0 <= 64 << 20, "peak {peak} above the limit");
    }
}

#[tokio::test]
pub(crate) async fn memory_limit_ends_in_oom_under_bubblewrap() {
    if ready("oom_bwrap", ALL) {
        oom(Isolation::Bubblewrap).await;
    }
}

#[tokio::test]
pub(crate) async fn memory_limit_ends_in_oom_without_isolation() {
    if ready("oom_none", Needs { bwrap: false, cgroups: true }) {
        oom(Isolation::None).await;
    }
}

pub(crate) async fn fork_bomb(isolation: Isolation) {
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let mut s = spec("bomb", &ws, "bomb() { bomb | bomb & }; bomb; sleep 3; exit 0", isolation);
    s.resources = Resources { memory: Some(Bytes::from_mib(256)), cpu_millis: Some(500), pids: Some(64) };
    let (mut sb, _o, _e) = Sandbox::spawn(&s).expect("spawn");
    let mut most = 0;
    for _ in 0..30 {
        most = most.max(sb.pids().len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(most <= 64, "{most} processes despite pids: 64");
    sb.kill_tree().expect("kill_tree");
    let exit = tokio::time::timeout(Duration::from_secs(20), sb.wait()).await.expect("ends after kill").expect("wait");
    assert!(exit.pids_limit_hit, "pids limit was never hit: {exit:?}");
    let id = s.job_id.clone();
    tokio::time::timeout(Duration::from_secs(20), sb.cleanup()).await.expect("cleanup in time").expect("cleanup");
    assert_eq!(host_pids_with_marker(&id), Vec::<i32>::new(), "fork bomb processes survived");
}

#[tokio::test]
pub(crate) async fn fork_bomb_is_stopped_by_pids_limit_under_bubblewrap() {
    if ready("fork_bomb_bwrap", ALL) {
        fork_bomb(Isolation::Bubblewrap).await;
    }
}

#[tokio::test]
pub(crate) async fn fork_bomb_is_stopped_by_pids_limit_without_isolation() {
    if ready("fork_bomb_none", Needs { bwrap: false, cgroups: true }) {
        fork_bomb(Isolation::None).await;
    }
}

pub(crate) async fn leftover(isolation: Isolation, cgroups: CgroupUse) {
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let script = "setsid sleep 1000 & nohup sleep 1000 >/dev/null 2>&1 & (sleep 1000 &); \
                  setsid bash -c 'sleep 1000 & sleep 1000' & sleep 0.3; exit 0";
    let mut s = spec("leftover", &ws, script, isolation);
    s.cgroups = cgroups;
    let id = s.job_id.clone();
    let (mut sb, _o, _e) = Sandbox::spawn(&s).expect("spawn");
    let exit = tokio::time::timeout(Duration::from_secs(20), sb.wait()).await.expect("exits").expect("wait");
    assert_eq!(exit.code, Some(0), "{exit:?}");
    if isolation == Isolation::None {
        assert!(host_pids_with_marker(&id).len() >= 4, "daemons are running before cleanup (positive control)");
    }
    sb.cleanup().await.expect("cleanup");
    assert_eq!(host_pids_with_marker(&id), Vec::<i32>::new(), "a background process of the job survived cleanup");
}

#[tokio::test]
pub(crate) async fn background_processes_do_not_survive_cleanup_with_cgroup() {
    if ready("leftover_cgroup", Needs { bwrap: false, cgroups: true }) {
        leftover(Isolation::None, CgroupUse::Required).await;
    }
}

#[tokio::test]
pub(crate) async fn background_processes_do_not_survive_cleanup_without_cgroup() {
    if ready("leftover_nocgroup", Needs { bwrap: false, cgroups: false }) {
        leftover(Isolation::None, CgroupUse::Disabled).await;
    }
}

#[tokio::test]
pub(crate) async fn background_processes_do_not_survive_cleanup_under_bubblewrap() {
    if ready("leftover_bwrap", ALL) {
        leftover(Isolation::Bubblewrap, CgroupUse::Required).await;
    }
}

#[tokio::test]
pub(crate) async fn agent_environment_does_not_leak() {
    if !ready("env", ALL) {
        return;
    }
    // Test-only: set before any job of this test spawns; other tests never read it.
    std::env::set_var("GPUCI_TEST_AGENT_SENTINEL", "agent-secret");
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    for iso in [Isolation::Bubblewrap, Isolation::None] {
        let mut s = spec("env", &ws, "env", iso);
        s.env.insert("JOB_SECRET".into(), "job-secret-value".into());
        let r = run(&s).await;
        assert!(!r.out.contains("agent-secret"), "{iso:?}: agent env leaked: {}", r.out);
        assert!(r.out.contains("JOB_SECRET=job-secret-value"), "{iso:?}: {}", r.out);
        assert!(r.out.contains(&format!("GPUCI_SANDBOX_ID={}", s.job_id)), "{iso:?}: {}", r.out);
    }
}

#[tokio::test]
pub(crate) async fn secrets_are_not_on_bwraps_command_line_and_caps_are_dropped() {
    if !ready("cmdline", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let mut s = spec("cmdline", &ws, "grep CapEff /proc/self/status; sleep 2", Isolation::Bubblewrap);
    s.env.insert("JOB_SECRET".into(), "s3cr3t-on-cmdline".into());
    let (mut sb, mut so, _e) = Sandbox::spawn(&s).expect("spawn");
    let cmdline = fs::read(format!("/proc/{}/cmdline", sb.pid())).expect("cmdline");
    assert!(
        !String::from_utf8_lossy(&cmdline).contains("s3cr3t"),
        "secret visible in the world-readable cmdline of bwrap"
    );
    let mut out = String::new();
    so.read_to_string(&mut out).await.expect("read");
    assert_eq!(out.split_whitespace().last(), Some("0000000000000000"), "capabilities kept: {out}");
    sb.wait().await.expect("wait");
    sb.cleanup().await.expect("cleanup");
}

#[tokio::test]
pub(crate) async fn network_none_cannot_reach_the_host() {
    if !ready("network", ALL) {
        return;
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("addr").port();
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let script =
        format!("(echo hi > /dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo CONNECTED; cat /sys/class/net/*/operstate");
    let mut s = spec("net", &ws, &script, Isolation::Bubblewrap);
    let r = run(&s).await;
    assert!(!r.out.contains("CONNECTED"), "network: none reached 127.0.0.1:{port}");
    assert!(!r.out.contains("up"), "host interfaces visible: {}", r.out);
    // Positive control: with network the same connect works.
    s.network = gpuci_sandbox::Network::Host;
    s.job_id = job_id("net-on");
    let r = run(&s).await;
    assert!(r.out.contains("CONNECTED"), "control with network failed: {} {}", r.out, r.err);
}
