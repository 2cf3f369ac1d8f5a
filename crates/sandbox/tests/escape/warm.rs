//! Warm starts (a process waiting in its cgroup for the slot's next job): the same containment as a cold start.

use super::*;

// ---- Warm starts (a process waiting in its cgroup for the slot's next job): the same
// containment as a cold start, every attack above included. ----

/// A warm start for `spec`'s user, named `name`.
pub(crate) fn warm_spec(spec: &SandboxSpec, name: String) -> gpuci_sandbox::WarmSpec {
    gpuci_sandbox::WarmSpec {
        name,
        user: spec.user.expect("a job user"),
        network: None,
        cgroups: spec.cgroups,
        nproc: spec.resources.pids.map(u64::from),
        ready: None,
    }
}

pub(crate) async fn warm_for(spec: &SandboxSpec) -> gpuci_sandbox::WarmStart {
    let w = warm_spec(spec, format!("{}-warm", spec.job_id));
    gpuci_sandbox::WarmStart::prepare(w).await.expect("warm start")
}

pub(crate) async fn run_warm(spec: &SandboxSpec) -> Run {
    let warm = warm_for(spec).await;
    let waiting = warm.pid().expect("the warm start's pid");
    let started = Sandbox::spawn_warm(spec, Some(warm)).expect("spawn");
    assert_eq!(started.0.pid(), waiting, "the job did not start from the warm start");
    finish(started).await
}

/// Waits for a started job (at most 60 s), cleans up, and checks its first process is gone.
pub(crate) async fn finish(started: (Sandbox, tokio::process::ChildStdout, tokio::process::ChildStderr)) -> Run {
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
pub(crate) async fn a_warm_started_job_is_the_same_job_as_a_cold_started_one() {
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
pub(crate) async fn ready_for(spec: &SandboxSpec, ready_ws: &Path) -> (gpuci_sandbox::WarmStart, SandboxSpec) {
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
pub(crate) async fn run_ready(spec: &SandboxSpec, ready_ws: &Path) -> (Run, SandboxSpec) {
    let (warm, job) = ready_for(spec, ready_ws).await;
    let (shell, sandbox) = (warm.pid().expect("shell pid"), warm.ready_pid().expect("ready pid"));
    let started = Sandbox::spawn_warm(&job, Some(warm)).expect("spawn");
    assert_eq!(started.0.pid(), sandbox, "the job did not start in the ready sandbox");
    let run = finish(started).await;
    gone(shell, "the waiting shell beside the ready sandbox").await;
    (run, job)
}

/// Waits (at most 10 s) for no live process of `uid` to be left.
pub(crate) async fn uid_idle(uid: u32, what: &str) {
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
pub(crate) async fn gone(pid: u32, what: &str) {
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
pub(crate) async fn a_job_in_a_ready_sandbox_is_the_same_job_as_a_cold_started_one() {
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
pub(crate) fn watch_cmdlines(
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
pub(crate) async fn no_secret_is_ever_on_a_command_line_in_cold_warm_or_ready_starts() {
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
