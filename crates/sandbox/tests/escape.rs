//! Escape attempts: each must fail, with the reason in the assertion message.
//!
//! They need root, bubblewrap and writable cgroups. When something is missing they skip with a
//! message, except under `CI=true`, where a skipped security test would be a silent hole: there
//! they fail.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use gpuci_core::quantity::Bytes;
use gpuci_sandbox::{detect, CgroupUse, ExitInfo, Isolation, JobUser, Resources, Sandbox, SandboxSpec};
use tokio::io::AsyncReadExt;

#[derive(Clone, Copy)]
struct Needs {
    bwrap: bool,
    cgroups: bool,
}
const ALL: Needs = Needs { bwrap: true, cgroups: true };

fn ready(test: &str, needs: Needs) -> bool {
    let caps = detect();
    let mut missing = Vec::new();
    if std::os::unix::fs::MetadataExt::uid(&fs::metadata("/proc/self").expect("/proc/self")) != 0 {
        missing.push("root");
    }
    if needs.bwrap && caps.bubblewrap.is_none() {
        missing.push("bubblewrap (apt-get install bubblewrap)");
    }
    if needs.cgroups && !caps.cgroup_writable {
        missing.push("writable cgroups");
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("{test}: needs {}", missing.join(", "));
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{msg} (CI=true: security tests must not be skipped)");
    }
    eprintln!("SKIP {msg}");
    false
}

fn job_id(name: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("test-{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// A workspaces root outside /tmp (which is a fresh tmpfs inside), laid out as the agent's:
/// traversable (0711) but not listable, so the job's bwrap (running as the job's uid) reaches
/// its own workspace and nothing else.
fn workspaces() -> tempfile::TempDir {
    let d = tempfile::Builder::new().prefix("gpuci-ws-").tempdir_in("/var/tmp").expect("tempdir");
    fs::set_permissions(d.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).expect("chmod");
    d
}

/// A fresh unprivileged uid (= gid) per workspace, as the agent gives one per slot; no account
/// on the host has it.
fn test_user() -> JobUser {
    static N: AtomicU32 = AtomicU32::new(0);
    let uid = 1_610_000_000 + (std::process::id() % 100_000) * 64 + N.fetch_add(1, Ordering::Relaxed) % 64;
    JobUser { uid, gid: uid }
}

fn spec(name: &str, ws: &Path, script: &str, isolation: Isolation) -> SandboxSpec {
    let mut s = SandboxSpec::new(job_id(name), ws, vec!["bash".into(), "-c".into(), script.into()]);
    s.env = BTreeMap::from([
        ("PATH".to_string(), "/usr/local/bin:/usr/bin:/bin".to_string()),
        ("HOME".to_string(), ws.display().to_string()),
    ]);
    s.isolation = isolation;
    if let Some(root) = ws.parent() {
        s.hide_paths.push(root.to_path_buf());
    }
    // The workspace's owner is the job user (mkws gives each its own).
    let uid = std::os::unix::fs::MetadataExt::uid(&fs::metadata(ws).expect("workspace"));
    if uid != 0 {
        s.user = Some(JobUser { uid, gid: std::os::unix::fs::MetadataExt::gid(&fs::metadata(ws).expect("workspace")) });
    }
    s
}

fn mkws(root: &Path, name: &str) -> PathBuf {
    mkws_as(root, name, test_user())
}

fn mkws_as(root: &Path, name: &str, user: JobUser) -> PathBuf {
    let p = root.join(name);
    fs::create_dir(&p).expect("mkdir workspace");
    std::os::unix::fs::chown(&p, Some(user.uid), Some(user.gid)).expect("chown workspace");
    fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o700)).expect("chmod");
    p
}

struct Run {
    exit: ExitInfo,
    out: String,
    err: String,
}

async fn run(spec: &SandboxSpec) -> Run {
    let (mut sb, mut so, mut se) = Sandbox::spawn(spec).expect("spawn");
    let (mut out, mut err) = (String::new(), String::new());
    let (exit, _, _) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(sb.wait(), so.read_to_string(&mut out), se.read_to_string(&mut err))
    })
    .await
    .expect("job did not finish within 60 s");
    sb.cleanup().await.expect("cleanup");
    Run { exit: exit.expect("wait"), out, err }
}

/// Host pids whose environment holds `GPUCI_SANDBOX_ID=<id>`, read independently of the crate.
fn host_pids_with_marker(id: &str) -> Vec<i32> {
    let needle = format!("GPUCI_SANDBOX_ID={id}");
    fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let env = fs::read(e.path().join("environ")).ok()?;
            env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()).then_some(pid)
        })
        .collect()
}

#[tokio::test]
async fn job_cannot_read_another_running_jobs_workspace() {
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
async fn job_cannot_read_agent_tokens() {
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
async fn job_sees_only_its_leased_gpu_nodes() {
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
async fn leased_gpu_nodes_open_when_the_workspaces_are_mounted_nodev() {
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
async fn job_cannot_signal_the_agent_or_another_job() {
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

async fn oom(isolation: Isolation) {
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
async fn memory_limit_ends_in_oom_under_bubblewrap() {
    if ready("oom_bwrap", ALL) {
        oom(Isolation::Bubblewrap).await;
    }
}

#[tokio::test]
async fn memory_limit_ends_in_oom_without_isolation() {
    if ready("oom_none", Needs { bwrap: false, cgroups: true }) {
        oom(Isolation::None).await;
    }
}

async fn fork_bomb(isolation: Isolation) {
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
async fn fork_bomb_is_stopped_by_pids_limit_under_bubblewrap() {
    if ready("fork_bomb_bwrap", ALL) {
        fork_bomb(Isolation::Bubblewrap).await;
    }
}

#[tokio::test]
async fn fork_bomb_is_stopped_by_pids_limit_without_isolation() {
    if ready("fork_bomb_none", Needs { bwrap: false, cgroups: true }) {
        fork_bomb(Isolation::None).await;
    }
}

async fn leftover(isolation: Isolation, cgroups: CgroupUse) {
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
async fn background_processes_do_not_survive_cleanup_with_cgroup() {
    if ready("leftover_cgroup", Needs { bwrap: false, cgroups: true }) {
        leftover(Isolation::None, CgroupUse::Required).await;
    }
}

#[tokio::test]
async fn background_processes_do_not_survive_cleanup_without_cgroup() {
    if ready("leftover_nocgroup", Needs { bwrap: false, cgroups: false }) {
        leftover(Isolation::None, CgroupUse::Disabled).await;
    }
}

#[tokio::test]
async fn background_processes_do_not_survive_cleanup_under_bubblewrap() {
    if ready("leftover_bwrap", ALL) {
        leftover(Isolation::Bubblewrap, CgroupUse::Required).await;
    }
}

#[tokio::test]
async fn agent_environment_does_not_leak() {
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
async fn secrets_are_not_on_bwraps_command_line_and_caps_are_dropped() {
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
async fn network_none_cannot_reach_the_host() {
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

// ---- The hostile-job suite (issue 9): each test is one attack that must fail. ----

/// A raw syscall from perl (in every Debian base system): prints `r=<ret> errno=<n>`.
#[cfg(target_arch = "x86_64")]
fn syscall_probe(name: &str, nr: u64, args: &str) -> String {
    format!("perl -e '$r = syscall({nr}{args}); print \"{name} r=$r errno=\", $!+0, \"\\n\"'; ")
}

#[tokio::test]
async fn job_is_unprivileged_and_cannot_set_the_host_core_pattern() {
    // The attack that got host root: core_pattern piped to a workspace script, run by the
    // kernel as root outside every namespace.
    if !ready("core_pattern", ALL) {
        return;
    }
    let before = fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap();
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let script = "id -u; grep CapEff /proc/self/status; \
                  echo '|/bin/sh -c id' > /proc/sys/kernel/core_pattern && echo WROTE-CORE-PATTERN; \
                  echo 1 > /proc/sys/kernel/sysrq && echo WROTE-SYSRQ; true";
    let s = spec("corepat", &ws, script, Isolation::Bubblewrap);
    let want_uid = s.user.expect("a job user").uid;
    let r = run(&s).await;
    assert_eq!(r.out.lines().next(), Some(want_uid.to_string().as_str()), "job must run as its own uid: {}", r.out);
    assert!(r.out.contains("CapEff:\t0000000000000000"), "capabilities: {}", r.out);
    assert!(!r.out.contains("WROTE"), "a kernel knob was written: {}", r.out);
    assert_eq!(fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap(), before, "host core_pattern changed");
}

#[tokio::test]
async fn job_cannot_make_a_user_namespace_to_lift_its_limits() {
    // The attack: unshare -Ur gives every capability in a new user namespace; with them the
    // job mounted its v1 memory/pids cgroups and wrote `max`.
    if !ready("userns", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    let script = "unshare -Ur true && echo USERNS-OK; \
                  unshare -Urm sh -c 'mount -t tmpfs x /mnt' && echo MOUNT-OK; \
                  mkdir -p m && mount -t cgroup -o memory cgroup m && echo CGROUP-MOUNTED; \
                  python3 -c 'import os; os.unshare(os.CLONE_NEWUSER); print(\"PY-USERNS-OK\")' 2>/dev/null; \
                  cat /proc/self/cgroup >/dev/null; true";
    let mut s = spec("userns", &ws, script, Isolation::Bubblewrap);
    s.resources.memory = Some(Bytes(256 << 20));
    s.resources.pids = Some(64);
    let r = run(&s).await;
    for bad in ["USERNS-OK", "MOUNT-OK", "CGROUP-MOUNTED", "PY-USERNS-OK"] {
        assert!(!r.out.contains(bad), "{bad}: {}\n{}", r.out, r.err);
    }
    // And the limit holds: 512 MiB under a 256 MiB limit ends in the OOM killer.
    let mut s =
        spec("userns-oom", &ws, "python3 -c 'b = bytearray(512 << 20); print(\"ALLOCATED\")'", Isolation::Bubblewrap);
    s.resources.memory = Some(Bytes(256 << 20));
    let r = run(&s).await;
    assert!(!r.out.contains("ALLOCATED") && r.exit.oom_killed, "memory limit did not hold: {:?} {}", r.exit, r.out);
}

#[cfg(target_arch = "x86_64")]
#[tokio::test]
async fn job_cannot_reach_kernel_keyrings_bpf_perf_or_new_namespaces() {
    if !ready("seccomp", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    // x86_64 numbers: keyctl 250 (KEYCTL_GET_KEYRING_ID of the user keyring, create), add_key
    // 248, bpf 321, perf_event_open 298, userfaultfd 323, io_uring_setup 425, clone3 435,
    // x32 keyctl 0x40000000+250; unshare 272 (CLONE_NEWUSER = 0x10000000), mount 165.
    let script = [
        syscall_probe("keyctl", 250, ", 0, -4, 1"),
        syscall_probe("add_key", 248, ", (my $t = \"user\"), (my $d = \"k\"), (my $v = \"v\"), 1, -4"),
        syscall_probe("bpf", 321, ", 0, 0, 0"),
        syscall_probe("perf", 298, ", 0, 0, -1, -1, 0"),
        syscall_probe("uffd", 323, ", 0"),
        syscall_probe("iouring", 425, ", 1, 0"),
        syscall_probe("clone3", 435, ", 0, 0"),
        syscall_probe("x32keyctl", 0x4000_0000 + 250, ", 0, -4, 1"),
        syscall_probe("unshare_user", 272, ", 0x10000000"),
        syscall_probe("mount", 165, ", (my $s = \"none\"), (my $t = \"/tmp\"), (my $f = \"tmpfs\"), 0, 0"),
        // Positive control: an ordinary call still works.
        syscall_probe("getpid", 39, ""),
    ]
    .concat();
    let r = run(&spec("seccomp", &ws, &script, Isolation::Bubblewrap)).await;
    let line = |name: &str| r.out.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_default().to_string();
    for (name, errno) in [
        ("keyctl", libc::EPERM),
        ("add_key", libc::EPERM),
        ("bpf", libc::EPERM),
        ("perf", libc::EPERM),
        ("uffd", libc::EPERM),
        ("iouring", libc::EPERM),
        ("unshare_user", libc::EPERM),
        ("mount", libc::EPERM),
        ("clone3", libc::ENOSYS),
        ("x32keyctl", libc::ENOSYS),
    ] {
        assert_eq!(line(name), format!("{name} r=-1 errno={errno}"), "{name} was not denied: {}\n{}", r.out, r.err);
    }
    assert!(line("getpid").starts_with("getpid r=") && !line("getpid").contains("r=-1"), "control: {}", r.out);
    // Ordinary work still runs: threads (clone without CLONE_NEWUSER) and a compiler-like fork/exec.
    let r = run(&spec("seccomp-ok", &ws, "python3 -c 'import threading; t = threading.Thread(target=print, args=(\"THREAD\",)); t.start(); t.join()'; sh -c 'echo CHILD'", Isolation::Bubblewrap)).await;
    assert!(r.out.contains("THREAD") && r.out.contains("CHILD"), "ordinary work broke: {} {}", r.out, r.err);
}

fn pasta_ready(test: &str) -> bool {
    let tun_ok = fs::metadata("/dev/net/tun")
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o006 == 0o006);
    let pasta = ["/usr/bin/pasta", "/usr/local/bin/pasta"].iter().any(|p| Path::new(p).exists());
    if pasta && *tun_ok.as_ref().unwrap_or(&false) {
        return true;
    }
    let msg = format!("{test}: needs pasta (apt-get install passt) and /dev/net/tun mode 0666 (found {tun_ok:?})");
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{msg} (CI=true: security tests must not be skipped)");
    }
    eprintln!("SKIP {msg}");
    false
}

#[tokio::test]
async fn slot_network_reaches_the_outside_but_not_the_host_or_other_slots() {
    // The attack: with the host's network a job reached another job's 127.0.0.1 listener and
    // abstract socket, every host loopback service, and host abstract sockets (peer uid 0).
    if !ready("slot_network", ALL) || !pasta_ready("slot_network") {
        return;
    }
    use std::os::linux::net::SocketAddrExt;
    let private = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let allowed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (private_port, allowed_port) = (private.local_addr().unwrap().port(), allowed.local_addr().unwrap().port());
    let abstract_name = format!("gpuci-test-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes()).unwrap();
    let _abstract = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();

    let slot_a = gpuci_sandbox::SlotNetwork::start(test_user(), &[allowed_port]).expect("slot network a");
    let slot_b = gpuci_sandbox::SlotNetwork::start(test_user(), &[]).expect("slot network b");
    let root = workspaces();
    // A job in slot B listens on its own loopback.
    let wb = mkws(root.path(), "b");
    let mut sb_spec = spec("slot-b", &wb, "python3 -c 'import socket,time; s=socket.socket(); s.bind((\"127.0.0.1\", 47011)); s.listen(); print(\"LISTENING\", flush=True); time.sleep(30)'", Isolation::Bubblewrap);
    sb_spec.network = gpuci_sandbox::Network::Namespace(slot_b.namespace());
    let (mut job_b, mut b_out, _b_err) = Sandbox::spawn(&sb_spec).expect("spawn b");
    let mut buf = [0u8; 9];
    b_out.read_exact(&mut buf).await.expect("job b listens (positive control)");

    let wa = mkws(root.path(), "a");
    let script = format!(
        "try() {{ timeout 5 bash -c \"echo hi > /dev/tcp/127.0.0.1/$1\" 2>/dev/null && echo \"REACHED-$2\"; }}; \
         try {private_port} HOST-LOOPBACK; try {allowed_port} ALLOWED; try 47011 OTHER-SLOT; \
         python3 -c 'import socket; s=socket.socket(socket.AF_UNIX); s.connect(\"\\0{abstract_name}\"); print(\"REACHED-HOST-ABSTRACT\")' 2>/dev/null; \
         ip addr add 10.99.0.1/32 dev lo 2>/dev/null && echo CHANGED-ADDRESSES; \
         ip link set lo down 2>/dev/null && echo CHANGED-LINK; \
         ip -o link | grep -v ' lo:' | grep -q UP && echo HAS-EGRESS-INTERFACE; true"
    );
    let mut s = spec("slot-a", &wa, &script, Isolation::Bubblewrap);
    s.network = gpuci_sandbox::Network::Namespace(slot_a.namespace());
    let r = run(&s).await;
    assert!(
        r.out.contains("REACHED-ALLOWED"),
        "positive control: the allowed host port must be reachable: {} {}",
        r.out,
        r.err
    );
    assert!(r.out.contains("HAS-EGRESS-INTERFACE"), "no egress interface: {} {}", r.out, r.err);
    // (The gateway address is not probed: under --no-map-gw it is the real gateway, off this
    // machine, and tests send nothing beyond loopback.)
    for bad in
        ["REACHED-HOST-LOOPBACK", "REACHED-OTHER-SLOT", "REACHED-HOST-ABSTRACT", "CHANGED-ADDRESSES", "CHANGED-LINK"]
    {
        assert!(!r.out.contains(bad), "{bad}: {}\n{}", r.out, r.err);
    }
    job_b.kill_tree().unwrap();
    let _ = job_b.wait().await;
    job_b.cleanup().await.unwrap();
    drop((slot_a, slot_b));
}

/// The cloud metadata probe: connects to each address and prints `ADDR ERRNO` (0: connected).
const METADATA_PROBE: &str = r#"python3 - <<'PY'
import errno, socket
for addr in ["169.254.169.254", "169.254.170.2", "100.100.100.200", "168.63.129.16", "fd00:ec2::254", "fd00:ec2::23", "fd20:ce::254", "::ffff:169.254.169.254"]:
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((addr, 80))
        print(addr, 0, flush=True)
    except socket.timeout:
        print(addr, "timeout", flush=True)
    except OSError as e:
        print(addr, errno.errorcode.get(e.errno, e.errno), flush=True)
PY
ip rule del pref 1000 2>/dev/null && echo DELETED-RULE; ip -6 rule del pref 1000 2>/dev/null && echo DELETED-RULE6; true"#;

/// Addresses the probe tries.
const METADATA_ADDRS: [&str; 8] = [
    "169.254.169.254",
    "169.254.170.2",
    "100.100.100.200",
    "168.63.129.16",
    "fd00:ec2::254",
    "fd00:ec2::23",
    "fd20:ce::254",
    "::ffff:169.254.169.254",
];

#[tokio::test]
async fn slot_network_refuses_cloud_metadata_services_and_the_job_cannot_lift_it() {
    // The attack: pasta made the job's connection to 169.254.169.254 from the host's stack,
    // and on a cloud machine the job read the instance role's credentials (IMDSv1 and v2).
    // Here the kernel must refuse each connection inside the namespace (EACCES from the
    // `prohibit` rule) before pasta sees it; without the rules it reaches pasta (a timeout or
    // a refusal from the host's side, never EACCES).
    if !ready("metadata", ALL) || !pasta_ready("metadata") {
        return;
    }
    let slot = gpuci_sandbox::SlotNetwork::start(test_user(), &[]).expect("slot network");
    let root = workspaces();
    let ws = mkws(root.path(), "m");
    let mut s = spec("metadata", &ws, METADATA_PROBE, Isolation::Bubblewrap);
    s.network = gpuci_sandbox::Network::Namespace(slot.namespace());
    let r = run(&s).await;
    for addr in METADATA_ADDRS {
        let line = r.out.lines().find(|l| l.split(' ').next() == Some(addr));
        let want = format!("{addr} EACCES");
        assert_eq!(line, Some(want.as_str()), "{addr} was not refused in the namespace: {}\n{}", r.out, r.err);
    }
    assert!(!r.out.contains("DELETED-RULE"), "the job removed a metadata rule: {}", r.out);

    // An operator's allowance for trusted origins lifts them, and the refusal comes back.
    slot.set_metadata(true).expect("allow");
    s.job_id = job_id("metadata-allowed");
    let allowed = run(&s).await;
    let line = allowed.out.lines().find(|l| l.starts_with("169.254.169.254 ")).unwrap_or_default().to_string();
    assert_ne!(line, "169.254.169.254 EACCES", "allowed, yet refused: {}", allowed.out);
    slot.set_metadata(false).expect("deny again");
    slot.set_metadata(false).expect("denying twice is no error");
    s.job_id = job_id("metadata-denied");
    let again = run(&s).await;
    assert!(again.out.contains("169.254.169.254 EACCES"), "the refusal did not come back: {}", again.out);
}

// ---- Warm starts (a process waiting in its cgroup for the slot's next job): the same
// containment as a cold start, every attack above included. ----

/// A warm start for `spec`'s user, named `name`.
fn warm_spec(spec: &SandboxSpec, name: String) -> gpuci_sandbox::WarmSpec {
    gpuci_sandbox::WarmSpec {
        name,
        user: spec.user.expect("a job user"),
        network: None,
        cgroups: spec.cgroups,
        nproc: spec.resources.pids.map(u64::from),
        ready: None,
    }
}

async fn warm_for(spec: &SandboxSpec) -> gpuci_sandbox::WarmStart {
    let w = warm_spec(spec, format!("{}-warm", spec.job_id));
    gpuci_sandbox::WarmStart::prepare(w).await.expect("warm start")
}

async fn run_warm(spec: &SandboxSpec) -> Run {
    let warm = warm_for(spec).await;
    let waiting = warm.pid().expect("the warm start's pid");
    let started = Sandbox::spawn_warm(spec, Some(warm)).expect("spawn");
    assert_eq!(started.0.pid(), waiting, "the job did not start from the warm start");
    finish(started).await
}

/// Waits for a started job (at most 60 s), cleans up, and checks its first process is gone.
async fn finish(started: (Sandbox, tokio::process::ChildStdout, tokio::process::ChildStderr)) -> Run {
    let (mut sb, mut so, mut se) = started;
    let first = sb.pid();
    let (mut out, mut err) = (String::new(), String::new());
    let (exit, _, _) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(sb.wait(), so.read_to_string(&mut out), se.read_to_string(&mut err))
    })
    .await
    .expect("job did not finish within 60 s");
    sb.cleanup().await.expect("cleanup");
    assert!(!Path::new(&format!("/proc/{first}")).exists(), "the job's first process outlived cleanup");
    Run { exit: exit.expect("wait"), out, err }
}

#[tokio::test]
async fn a_warm_started_job_is_the_same_job_as_a_cold_started_one() {
    if !ready("warm_same", ALL) {
        return;
    }
    let root = workspaces();
    let ws = mkws(root.path(), "w");
    // Who it is, what it holds, what it sees, where it is: all must match a cold start.
    let script = "id; grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; ls /proc/self/fd; \
                  env | grep -v GPUCI_SANDBOX_ID | sort; cat /proc/self/cgroup | grep -c gpuci; \
                  echo '|/bin/sh -c id' > /proc/sys/kernel/core_pattern && echo WROTE-CORE-PATTERN; \
                  unshare -Ur true && echo USERNS-OK; ls /; true";
    let mut s = spec("warm-same", &ws, script, Isolation::Bubblewrap);
    s.env.insert("JOB_SECRET".into(), "only-in-the-job".into());
    s.resources = Resources { memory: Some(Bytes::from_mib(256)), cpu_millis: None, pids: Some(64) };
    let cold = run(&s).await;
    s.job_id = job_id("warm-same-w");
    let warm = run_warm(&s).await;
    assert!(cold.exit.success() && warm.exit.success(), "{:?} {} / {:?} {}", cold.exit, cold.err, warm.exit, warm.err);
    assert_eq!(warm.out, cold.out, "warm and cold starts differ; stderr: {} / {}", warm.err, cold.err);
    assert!(warm.out.contains("JOB_SECRET=only-in-the-job"), "{}", warm.out);
    assert!(!warm.out.contains("WROTE") && !warm.out.contains("USERNS-OK"), "{}", warm.out);
}

/// A warm start for `spec`'s user with a ready sandbox laid out as `spec` in the workspace
/// `ready_ws` (made by the warm start): the warm start, and `spec` moved into that workspace.
async fn ready_for(spec: &SandboxSpec, ready_ws: &Path) -> (gpuci_sandbox::WarmStart, SandboxSpec) {
    let mut w = warm_spec(spec, format!("{}-warm", spec.job_id));
    let mut template = spec.clone();
    template.workspace = ready_ws.to_path_buf();
    template.env.clear();
    template.argv.clear();
    w.ready = Some(gpuci_sandbox::ReadySpec { name: format!("{}-ready", spec.job_id), sandbox: template });
    let mut warm = gpuci_sandbox::WarmStart::prepare(w).await.expect("warm start");
    let ws = warm.take_workspace().expect("the ready sandbox was started");
    assert_eq!(ws, ready_ws);
    let mut job = spec.clone();
    job.workspace = ws;
    if let Some(home) = job.env.get_mut("HOME") {
        *home = ready_ws.display().to_string();
    }
    (warm, job)
}

/// Runs `spec` from a warm start with a ready sandbox made for it; asserts it started in
/// that sandbox and that the waiting shell beside it is gone.
async fn run_ready(spec: &SandboxSpec, ready_ws: &Path) -> (Run, SandboxSpec) {
    let (warm, job) = ready_for(spec, ready_ws).await;
    let (shell, sandbox) = (warm.pid().expect("shell pid"), warm.ready_pid().expect("ready pid"));
    let started = Sandbox::spawn_warm(&job, Some(warm)).expect("spawn");
    assert_eq!(started.0.pid(), sandbox, "the job did not start in the ready sandbox");
    let run = finish(started).await;
    gone(shell, "the waiting shell beside the ready sandbox").await;
    (run, job)
}

/// Waits (at most 10 s) for no live process of `uid` to be left.
async fn uid_idle(uid: u32, what: &str) {
    let live = || {
        fs::read_dir("/proc").unwrap().flatten().any(|e| {
            fs::read_to_string(e.path().join("status")).is_ok_and(|s| {
                s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some(&uid.to_string()))
                    && !s.lines().any(|l| l.starts_with("State:") && (l.contains('Z') || l.contains('X')))
            })
        })
    };
    let wait = async {
        while live() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .unwrap_or_else(|_| panic!("{what}: processes of uid {uid} are left"));
}

/// Waits (at most 10 s) for `pid` to be gone.
async fn gone(pid: u32, what: &str) {
    let wait = async {
        while fs::read_to_string(format!("/proc/{pid}/status"))
            .is_ok_and(|s| !s.lines().any(|l| l.starts_with("State:") && l.contains('Z')))
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .unwrap_or_else(|_| panic!("{what} (pid {pid}) was not ended"));
}

#[tokio::test]
async fn a_job_in_a_ready_sandbox_is_the_same_job_as_a_cold_started_one() {
    if !ready("ready_same", ALL) {
        return;
    }
    let root = workspaces();
    let user = test_user();
    let ws = root.path().join("r");
    // Who it is, what it holds, what it sees, where it is, its environment to the byte: all
    // must match a cold start of the same job in the same workspace.
    let script = "id; grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; ls /proc/self/fd; \
                  env -0 | grep -zv GPUCI_SANDBOX_ID | sort -z | od -c; cat /proc/self/cgroup | grep -c gpuci; \
                  pwd; ls -a; stat -c '%U %a' .; echo '|/bin/sh -c id' > /proc/sys/kernel/core_pattern && echo WROTE-CORE-PATTERN; \
                  unshare -Ur true && echo USERNS-OK; ls /; cat /etc/passwd | tail -1; printenv JOB_SECRET; true";
    let mut s = spec("ready-same", &ws_probe(root.path(), user), script, Isolation::Bubblewrap);
    s.user = Some(user);
    s.env.insert("JOB_SECRET".into(), "only-in-the-job".into());
    s.env.insert("TRICKY".into(), "it's \"$HOME\" `id` $(id); }\nexec true".into());
    s.resources = Resources { memory: Some(Bytes::from_mib(256)), cpu_millis: None, pids: Some(64) };
    s.scratch_size = Some(64 << 20);
    let (ready, job) = run_ready(&s, &ws).await;
    let mut cold_spec = job.clone();
    cold_spec.job_id = job_id("ready-same-c");
    let cold = run(&cold_spec).await;
    assert!(
        cold.exit.success() && ready.exit.success(),
        "{:?} {} / {:?} {}",
        cold.exit,
        cold.err,
        ready.exit,
        ready.err
    );
    assert_eq!(ready.out, cold.out, "ready and cold starts differ; stderr: {} / {}", ready.err, cold.err);
    assert!(ready.out.contains("only-in-the-job"), "{}", ready.out);
    assert!(!ready.out.contains("WROTE") && !ready.out.contains("USERNS-OK"), "{}", ready.out);

    // What a shell's `export` refuses (dash: `OPTIND` must be a number; bash: `UID` is
    // read-only), and names no shell takes: bwrap's `--setenv` sets them all (outsider
    // finding). Such a job starts from the waiting shell, with the same environment.
    fs::remove_dir_all(&job.workspace).expect("remove");
    for (k, v) in [("OPTIND", "abc"), ("UID", "0"), ("A.B-C", "dots"), ("-i", "dash"), ("PWD", "/nowhere")] {
        s.env.insert(k.into(), v.into());
    }
    s.job_id = job_id("ready-odd");
    let (warm, job) = ready_for(&s, &ws).await;
    let (shell, sandbox) = (warm.pid().expect("shell pid"), warm.ready_pid().expect("ready pid"));
    let started = Sandbox::spawn_warm(&job, Some(warm)).expect("spawn");
    assert_eq!(started.0.pid(), shell, "odd names must start from the waiting shell");
    let odd = finish(started).await;
    gone(sandbox, "the ready sandbox beside the waiting shell").await;
    let mut cold_spec = job.clone();
    cold_spec.job_id = job_id("ready-odd-c");
    let cold = run(&cold_spec).await;
    assert_eq!(odd.out, cold.out, "a warm and a cold start differ; stderr: {} / {}", odd.err, cold.err);
}

/// Every host process's command line, as any local user reads it (`/proc/PID/cmdline` is
/// world-readable), searched for `needle` until `stop`: the hits.
fn watch_cmdlines(
    needle: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<(Vec<String>, u64)> {
    std::thread::spawn(move || {
        let (mut hits, mut scans) = (Vec::new(), 0u64);
        while !stop.load(Ordering::Relaxed) {
            scans += 1;
            for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
                if !e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())) {
                    continue;
                }
                if let Ok(c) = fs::read(e.path().join("cmdline")) {
                    if c.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                        hits.push(String::from_utf8_lossy(&c).replace('\0', " "));
                    }
                }
            }
        }
        (hits, scans)
    })
}

#[tokio::test]
async fn no_secret_is_ever_on_a_command_line_in_cold_warm_or_ready_starts() {
    // The attack: a job started in a ready sandbox got its environment as
    // `env -i -- NAME=value... ARGV`, so until `env` exec'd the command every secret of the job
    // was in /proc/PID/cmdline, readable by every local user; a long PATH (walked by
    // execvp) widened the window at will. Here a watcher scans every command line while
    // jobs with such a PATH start every way a job can start.
    if !ready("argv_secrets", ALL) {
        return;
    }
    let starts: usize = std::env::var("GPUCI_ARGV_STARTS").ok().and_then(|n| n.parse().ok()).unwrap_or(40);
    let secret = format!("argv-canary-{}-{}", std::process::id(), rand_suffix());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = watch_cmdlines(secret.clone(), stop.clone());
    let root = workspaces();
    let user = test_user();
    let probe = ws_probe(root.path(), user);
    // 4,000 directories that do not exist before the real ones: execvp tries each.
    let long_path: String =
        (0..4000).map(|i| format!("/nonexistent/d{i}:")).collect::<String>() + "/usr/local/bin:/usr/bin:/bin";
    let mut s = spec("argv", &probe, "printenv GPUCI_CANARY >/dev/null", Isolation::Bubblewrap);
    s.env.insert("GPUCI_CANARY".into(), secret.clone());
    s.env.insert("PATH".into(), long_path);
    s.argv = vec!["bash".into(), "-c".into(), "printenv GPUCI_CANARY >/dev/null".into()];
    for i in 0..starts {
        s.job_id = job_id("argv-ready");
        let (r, job) = run_ready(&s, &root.path().join(format!("r{i}"))).await;
        assert!(r.exit.success(), "{:?} {}", r.exit, r.err);
        fs::remove_dir_all(&job.workspace).expect("remove");
        s.job_id = job_id("argv-warm");
        let r = run_warm(&s).await;
        assert!(r.exit.success(), "{:?} {}", r.exit, r.err);
        s.job_id = job_id("argv-cold");
        let r = run(&s).await;
        assert!(r.exit.success(), "{:?} {}", r.exit, r.err);
    }
    stop.store(true, Ordering::Relaxed);
    let (hits, scans) = watcher.join().expect("watcher");
    assert!(scans > 0);
    assert!(
        hits.is_empty(),
        "a secret was on a command line ({} of {scans} scans, {starts} x 3 starts): {:?}",
        hits.len(),
        hits.first()
    );
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// A workspace for `spec()` to read its owner from; the ready tests move the job elsewhere.
fn ws_probe(root: &Path, user: JobUser) -> PathBuf {
    mkws_as(root, "probe", user)
}

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
    let report = gpuci_sandbox::sweep("another-agent-");
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
