//! A real Slurm cluster of one node for a test: Debian's `munged`, `slurmctld` and `slurmd`,
//! started as root with their config, state and logs under a temp dir, on free loopback
//! ports, with `n` fake GPUs (character devices in `gres.conf`). Each test gets its own
//! cluster; several run at once. Dropping it kills the daemons and every job process they
//! started (slurmstepd outlives slurmd, and jobs outlive both).
//!
//! Not installed and not `CI=true`: [`Slurm::start`] says so and answers `None` (the test
//! skips); with `CI=true` a missing Slurm fails the test.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Slurm {
    dir: tempfile::TempDir,
    pub conf: PathBuf,
    daemons: Vec<(&'static str, Child)>,
    /// With `ConstrainDevices=yes`: the cgroup v1 devices directory slurmd makes for the node.
    device_cgroup: Option<PathBuf>,
}

/// How the test node's GPUs are configured: what real nodes write, down to the files that
/// do not start at `nvidia0`, gaps, and typed lines.
#[derive(Clone, Debug)]
pub struct Gpus {
    /// slurm.conf's `Gres=` for the node: `gpu:4`, `gpu:h100:2,gpu:a100:2`.
    pub node_gres: String,
    /// gres.conf; `{dev}` stands for the cluster's own /dev directory.
    pub gres_conf: String,
    /// The minor numbers of the fake device files `{dev}/nvidia<N>` to make.
    pub minors: Vec<u32>,
    /// `TaskPlugin=task/cgroup` with `ConstrainDevices=yes` (cgroup v1): each job may open only
    /// its GPUs' files. The fake files then carry the NVIDIA driver's numbers (195:N), which
    /// the cgroup tells apart (opening a granted one answers ENXIO, a refused one EPERM);
    /// otherwise /dev/null's, which any job may open.
    pub constrain_devices: bool,
}

impl Gpus {
    /// `n` GPUs, `File={dev}/nvidia[0-(n-1)]`.
    pub fn count(n: u32) -> Gpus {
        Gpus {
            node_gres: format!("gpu:{n}"),
            gres_conf: format!("Name=gpu File={{dev}}/nvidia[0-{}]\n", n.saturating_sub(1)),
            minors: (0..n).collect(),
            constrain_devices: false,
        }
    }

    /// One untyped gres.conf line `File={dev}/nvidia<files>` (`[4-7]`, `[0,2,3]`) naming
    /// `count` files, over the device files `minors` (a node may have a file gres.conf leaves
    /// out: a GPU taken out of service).
    pub fn files(files: &str, count: u32, minors: &[u32]) -> Gpus {
        Gpus {
            node_gres: format!("gpu:{count}"),
            gres_conf: format!("Name=gpu File={{dev}}/nvidia{files}\n"),
            minors: minors.to_vec(),
            constrain_devices: false,
        }
    }
}

/// Whether slurmd's task/cgroup can constrain devices here: cgroup v1 with a writable
/// `devices` controller (Slurm 22.05's cgroup/v2 plugin needs a systemd-delegated tree).
pub fn device_cgroup_available() -> Result<(), String> {
    let root = Path::new("/sys/fs/cgroup/devices");
    if !root.join("devices.allow").exists() {
        return Err("no cgroup v1 devices controller at /sys/fs/cgroup/devices".into());
    }
    let probe = root.join(format!("gpuci-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).map_err(|e| format!("cannot make a devices cgroup: {e}"))?;
    let _ = std::fs::remove_dir(&probe);
    Ok(())
}

/// A port for a daemon of the test cluster, from below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`, 32768 and up by default). A port taken by binding `:0`
/// came from that range, which every other test's `:0` listener and every outgoing connection
/// draws from too: between our probe and slurmctld's own bind another test took one, and
/// slurmctld died with "Address already in use" (seen in CI). Below it only another test
/// cluster's pick can collide, and the probe binds on every address, as slurmctld does.
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    for _ in 0..1000 {
        let n = N.fetch_add(1, Ordering::Relaxed);
        let port = 20_000
            + (seed.wrapping_add(std::process::id().wrapping_mul(7919)).wrapping_add(n.wrapping_mul(104_729)) % 12_000)
                as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port below the ephemeral range for the test Slurm cluster")
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

impl Slurm {
    /// Whether this machine can run a cluster (the daemons installed, root).
    pub fn available() -> Result<(), String> {
        for d in ["/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch"] {
            if !Path::new(d).exists() {
                return Err(format!("{d} is missing (apt-get install slurmctld slurmd slurm-client munge)"));
            }
        }
        if !nix::unistd::geteuid().is_root() {
            return Err("a test Slurm cluster needs root".into());
        }
        Ok(())
    }

    /// A cluster with `gpus` fake GPUs on its one node, `extra` appended to slurm.conf.
    pub fn start(gpus: u32, extra: &str) -> Option<Slurm> {
        Slurm::start_with(&Gpus::count(gpus), extra)
    }

    /// A cluster whose one node has the GPUs `g`, `extra` appended to slurm.conf.
    pub fn start_with(g: &Gpus, extra: &str) -> Option<Slurm> {
        let why =
            Slurm::available().and_then(|()| if g.constrain_devices { device_cgroup_available() } else { Ok(()) });
        if let Err(why) = why {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("CI=true and no Slurm: {why}");
            }
            eprintln!("skipped: {why}");
            return None;
        }
        let dir = tempfile::Builder::new().prefix("gpuci-slurm-").tempdir().unwrap();
        let l = dir.path();
        for d in ["etc", "state", "spool", "log", "run", "dev", "munge"] {
            std::fs::create_dir_all(l.join(d)).unwrap();
        }
        use std::os::unix::fs::PermissionsExt;
        for d in [l.to_path_buf(), l.join("munge")] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        for &i in &g.minors {
            // /dev/null's numbers: slurmd only needs a character device to give GPUs indices.
            // For a device cgroup, the driver's (195:N): no driver answers them (ENXIO), but
            // the cgroup's verdict (EPERM) comes first.
            let node = l.join(format!("dev/nvidia{i}"));
            let (major, minor) = if g.constrain_devices { (195, u64::from(i)) } else { (1, 3) };
            nix::sys::stat::mknod(
                &node,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(major, minor),
            )
            .unwrap();
            // mknod's mode is masked by the umask; jobs run as root here anyway.
            std::fs::set_permissions(&node, std::fs::Permissions::from_mode(0o666)).unwrap();
        }
        let mut key = vec![0u8; 1024];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key).unwrap();
        std::fs::write(l.join("munge/munge.key"), key).unwrap();
        std::fs::set_permissions(l.join("munge/munge.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
        let log = |name: &str| std::fs::File::create(l.join(format!("log/{name}.out"))).unwrap();
        let mut daemons = Vec::new();
        let munged = Command::new("/usr/sbin/munged")
            .arg("-F")
            .arg(format!("--socket={}", l.join("munge/munge.sock").display()))
            .arg(format!("--key-file={}", l.join("munge/munge.key").display()))
            .arg(format!("--pid-file={}", l.join("munge/munged.pid").display()))
            .arg(format!("--seed-file={}", l.join("munge/munged.seed").display()))
            .arg(format!("--log-file={}", l.join("log/munged.log").display()))
            .stdout(log("munged"))
            .stderr(log("munged-err"))
            .spawn()
            .unwrap();
        daemons.push(("munged", munged));
        let t0 = Instant::now();
        while !l.join("munge/munge.sock").exists() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let conf = l.join("etc/slurm.conf");
        let task = if g.constrain_devices { "task/cgroup" } else { "task/none" };
        // With a device cgroup, slurmstepd logs what it allows and denies (a test's witness).
        let slurmd_debug = if g.constrain_devices { "verbose\nDebugFlags=Gres" } else { "info" };
        if g.constrain_devices {
            std::fs::write(
                l.join("etc/cgroup.conf"),
                "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nConstrainDevices=yes\n",
            )
            .unwrap();
        }
        std::fs::write(
            &conf,
            format!(
                "ClusterName=gpucitest\n\
                 SlurmctldHost=localhost(127.0.0.1)\n\
                 SlurmctldPort={ctld}\n\
                 SlurmdPort={slurmd}\n\
                 SlurmUser=root\nSlurmdUser=root\n\
                 AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={l}/munge/munge.sock\n\
                 StateSaveLocation={l}/state\nSlurmdSpoolDir={l}/spool\n\
                 SlurmctldPidFile={l}/run/slurmctld.pid\nSlurmdPidFile={l}/run/slurmd.pid\n\
                 SlurmctldLogFile={l}/log/slurmctld.log\nSlurmdLogFile={l}/log/slurmd.log\n\
                 SlurmctldDebug=info\nSlurmdDebug={slurmd_debug}\nMailProg=/bin/true\n\
                 ProctrackType=proctrack/linuxproc\nTaskPlugin={task}\n\
                 JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n\
                 SchedulerType=sched/backfill\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 GresTypes=gpu\nSlurmdParameters=config_overrides\nReturnToService=2\nMpiDefault=none\n\
                 KillWait=5\nMinJobAge=300\nMessageTimeout=5\n\
                 SchedulerParameters=sched_min_interval=0,batch_sched_delay=0,sched_interval=1,default_queue_depth=1000\n\
                 {extra}\n\
                 NodeName=gpuci-node NodeAddr=127.0.0.1 NodeHostname={host} CPUs=8 RealMemory=4000 Gres={gres} State=UNKNOWN\n\
                 PartitionName=gpu Nodes=gpuci-node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO\n",
                ctld = free_port(),
                slurmd = free_port(),
                l = l.display(),
                host = hostname(),
                gres = g.node_gres,
            ),
        )
        .unwrap();
        std::fs::write(l.join("etc/gres.conf"), g.gres_conf.replace("{dev}", &l.join("dev").display().to_string()))
            .unwrap();
        let ctld = Command::new("/usr/sbin/slurmctld")
            .args(["-D", "-i", "-f"])
            .arg(&conf)
            .env("SLURM_CONF", &conf)
            .stdin(Stdio::null())
            .stdout(log("slurmctld"))
            .stderr(log("slurmctld-err"))
            .spawn()
            .unwrap();
        daemons.push(("slurmctld", ctld));
        let slurmd = Command::new("/usr/sbin/slurmd")
            .args(["-D", "-N", "gpuci-node", "-f"])
            .arg(&conf)
            .env("SLURM_CONF", &conf)
            .stdin(Stdio::null())
            .stdout(log("slurmd"))
            .stderr(log("slurmd-err"))
            .spawn()
            .unwrap();
        daemons.push(("slurmd", slurmd));
        // slurmd's cgroup/v1 plugin names the node's tree after it (one test at a time uses it).
        let device_cgroup = g.constrain_devices.then(|| PathBuf::from("/sys/fs/cgroup/devices/slurm_gpuci-node"));
        let mut s = Slurm { dir, conf, daemons, device_cgroup };
        let t0 = Instant::now();
        loop {
            for (name, c) in &mut s.daemons {
                if let Ok(Some(status)) = c.try_wait() {
                    let out = std::fs::read_to_string(s.dir.path().join(format!("log/{name}.out"))).unwrap_or_default();
                    let log = std::fs::read_to_string(s.dir.path().join(format!("log/{name}.log"))).unwrap_or_default();
                    panic!("{name} died ({status}) while the test cluster started:\n{out}\n{}", tail(&log, 20));
                }
            }
            if s.command("sinfo", &["-h", "-n", "gpuci-node", "-o", "%T"]).map(|o| o.trim() == "idle").unwrap_or(false)
            {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "the test Slurm cluster did not come up: {}", s.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("slurm: up in {:?} ({})", t0.elapsed(), s.conf.display());
        Some(s)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A Slurm client command against this cluster, under a timeout; its stdout.
    pub fn command(&self, program: &str, args: &[&str]) -> Result<String, String> {
        let out = Command::new("timeout")
            .arg("10")
            .arg(program)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!("{program} {args:?}: {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
        }
    }

    /// Every job of this cluster as `squeue -t all` shows it: (id, state, reason, comment).
    pub fn jobs(&self) -> Vec<(String, String, String, String)> {
        let out = self.command("squeue", &["-h", "-t", "all", "-o", "%i|%T|%r|%k"]).unwrap_or_default();
        out.lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.splitn(4, '|').collect();
                (f.len() == 4).then(|| (f[0].into(), f[1].into(), f[2].into(), f[3].into()))
            })
            .collect()
    }

    /// The environment of a running batch job's script (its process), by job id.
    pub fn job_env(&self, job: &str) -> Option<Vec<(String, String)>> {
        for e in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
            let pairs: Vec<(String, String)> = env
                .split(|b| *b == 0)
                .filter_map(|kv| {
                    let kv = String::from_utf8_lossy(kv);
                    kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string()))
                })
                .collect();
            let has = |k: &str, v: &str| pairs.iter().any(|(a, b)| a == k && b == v);
            if has("SLURM_CONF", &self.conf.display().to_string()) && has("SLURM_JOB_ID", job) {
                return Some(pairs);
            }
        }
        None
    }

    pub fn logs(&self) -> String {
        let mut out = String::new();
        for name in ["slurmctld", "slurmd"] {
            let log = std::fs::read_to_string(self.dir.path().join(format!("log/{name}.log"))).unwrap_or_default();
            out.push_str(&format!("--- {name}.log\n{}\n", tail(&log, 30)));
        }
        out
    }

    /// Kill every process of this cluster's jobs: slurmstepd sessions and anything that carries
    /// this cluster's `SLURM_CONF` with a job id.
    fn sweep(&self) {
        let conf = format!("SLURM_CONF={}", self.conf.display());
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
            let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
            if !vars.contains(&conf.as_bytes()) {
                continue;
            }
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            let pid = nix::unistd::Pid::from_raw(pid);
            if comm.trim() == "slurmstepd" {
                if let Ok(sid) = nix::unistd::getsid(Some(pid)) {
                    if sid.as_raw() > 1 && sid != nix::unistd::getsid(None).unwrap() {
                        let _ = nix::sys::signal::killpg(sid, nix::sys::signal::Signal::SIGKILL);
                    }
                }
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            } else if vars.iter().any(|v| v.starts_with(b"SLURM_JOB_ID=")) {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        self.sweep();
        for (_, c) in &mut self.daemons {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.sweep();
        // The job cgroups slurmstepd would have removed (and the agent's own sandbox cgroups
        // under them): deepest first, an rmdir each. Killed processes leave their cgroup a
        // moment after the kill, so this tries for a while.
        if let Some(root) = &self.device_cgroup {
            fn remove(d: &Path) {
                for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                    if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                        remove(&e.path());
                    }
                }
                let _ = std::fs::remove_dir(d);
            }
            let t0 = Instant::now();
            while root.exists() && t0.elapsed() < Duration::from_secs(10) {
                remove(root);
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
