//! Helpers the escape tests share: what a test needs, job specs, workspaces, running a sandbox to its end, host processes.

use super::*;

#[derive(Clone, Copy)]
pub(crate) struct Needs {
    pub(crate) bwrap: bool,
    pub(crate) cgroups: bool,
}

pub(crate) const ALL: Needs = Needs { bwrap: true, cgroups: true };

pub(crate) fn ready(test: &str, needs: Needs) -> bool {
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

pub(crate) fn job_id(name: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("test-{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// A workspaces root outside /tmp (which is a fresh tmpfs inside), laid out as the agent's:
/// traversable (0711) but not listable, so the job's bwrap (running as the job's uid) reaches
/// its own workspace and nothing else.
pub(crate) fn workspaces() -> tempfile::TempDir {
    let d = tempfile::Builder::new().prefix("gpuci-ws-").tempdir_in("/var/tmp").expect("tempdir");
    fs::set_permissions(d.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).expect("chmod");
    d
}

/// A fresh unprivileged uid (= gid) per workspace, as the agent gives one per slot; no account
/// on the host has it.
pub(crate) fn test_user() -> JobUser {
    static N: AtomicU32 = AtomicU32::new(0);
    let uid = 1_610_000_000 + (std::process::id() % 100_000) * 64 + N.fetch_add(1, Ordering::Relaxed) % 64;
    JobUser { uid, gid: uid }
}

pub(crate) fn spec(name: &str, ws: &Path, script: &str, isolation: Isolation) -> SandboxSpec {
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

pub(crate) fn mkws(root: &Path, name: &str) -> PathBuf {
    mkws_as(root, name, test_user())
}

pub(crate) fn mkws_as(root: &Path, name: &str, user: JobUser) -> PathBuf {
    let p = root.join(name);
    fs::create_dir(&p).expect("mkdir workspace");
    std::os::unix::fs::chown(&p, Some(user.uid), Some(user.gid)).expect("chown workspace");
    fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o700)).expect("chmod");
    p
}

pub(crate) struct Run {
    pub(crate) exit: ExitInfo,
    pub(crate) out: String,
    pub(crate) err: String,
}

pub(crate) async fn run(spec: &SandboxSpec) -> Run {
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
pub(crate) fn host_pids_with_marker(id: &str) -> Vec<i32> {
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

pub(crate) fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// A workspace for `spec()` to read its owner from; the ready tests move the job elsewhere.
pub(crate) fn ws_probe(root: &Path, user: JobUser) -> PathBuf {
    mkws_as(root, "probe", user)
}
