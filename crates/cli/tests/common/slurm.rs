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
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
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
        if let Err(why) = Slurm::available() {
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
        for i in 0..gpus {
            // /dev/null's numbers: slurmd only needs a character device to give GPUs indices.
            let node = l.join(format!("dev/nvidia{i}"));
            nix::sys::stat::mknod(
                &node,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(1, 3),
            )
            .unwrap();
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
        let last = gpus.saturating_sub(1);
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
                 SlurmctldDebug=info\nSlurmdDebug=info\nMailProg=/bin/true\n\
                 ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
                 JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n\
                 SchedulerType=sched/backfill\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 GresTypes=gpu\nSlurmdParameters=config_overrides\nReturnToService=2\nMpiDefault=none\n\
                 KillWait=5\nMinJobAge=300\nMessageTimeout=5\n\
                 SchedulerParameters=sched_min_interval=0,batch_sched_delay=0,sched_interval=1,default_queue_depth=1000\n\
                 {extra}\n\
                 NodeName=gpuci-node NodeAddr=127.0.0.1 NodeHostname={host} CPUs=8 RealMemory=4000 Gres=gpu:{gpus} State=UNKNOWN\n\
                 PartitionName=gpu Nodes=gpuci-node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO\n",
                ctld = free_port(),
                slurmd = free_port(),
                l = l.display(),
                host = hostname(),
            ),
        )
        .unwrap();
        std::fs::write(l.join("etc/gres.conf"), format!("Name=gpu File={}/dev/nvidia[0-{last}]\n", l.display()))
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
        let mut s = Slurm { dir, conf, daemons };
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
            if !vars.iter().any(|v| *v == conf.as_bytes()) {
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
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
