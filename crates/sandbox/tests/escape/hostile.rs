//! The hostile-job suite (issue 9): each test is one attack that must fail.

use super::*;

// ---- The hostile-job suite (issue 9): each test is one attack that must fail. ----

/// A raw syscall from perl (in every Debian base system): prints `r=<ret> errno=<n>`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn syscall_probe(name: &str, nr: u64, args: &str) -> String {
    format!("perl -e '$r = syscall({nr}{args}); print \"{name} r=$r errno=\", $!+0, \"\\n\"'; ")
}

#[tokio::test]
pub(crate) async fn job_is_unprivileged_and_cannot_set_the_host_core_pattern() {
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
pub(crate) async fn job_cannot_make_a_user_namespace_to_lift_its_limits() {
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
pub(crate) async fn job_cannot_reach_kernel_keyrings_bpf_perf_or_new_namespaces() {
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

pub(crate) fn pasta_ready(test: &str) -> bool {
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
pub(crate) async fn slot_network_reaches_the_outside_but_not_the_host_or_other_slots() {
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
pub(crate) async fn slot_network_refuses_cloud_metadata_services_and_the_job_cannot_lift_it() {
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
