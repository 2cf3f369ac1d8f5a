//! A job slot's network: a network namespace with egress through user-mode networking
//! (`pasta`, from the passt project), made once per slot when the agent starts and joined by
//! each job of that slot.
//!
//! Why per slot and not per job: attaching pasta costs 8–70 ms on a 2-core VM, more than the
//! rest of a job's start-up; a slot runs one job at a time and every process of a job is
//! killed before the next starts, so listening sockets and abstract sockets do not carry over.
//!
//! How it is built, and why the job cannot change it:
//! - a *holder* process (a shell that sleeps, [`HOLDER`]) runs as the slot network's own uid
//!   (not a job's) in a new user namespace, which owns a new network namespace; when the agent
//!   dies, however, it takes pasta with it;
//! - `pasta --runas <that uid> <holder pid>` joins them, creates the tap interface, copies the
//!   host's addresses and routes into it (`--config-net`) and forwards the job's connections
//!   out through ordinary sockets of its own. `--no-map-gw` keeps the gateway address from
//!   reaching the host; `-t none -u none` forwards nothing in; `-T`/`-U` forward exactly the
//!   host ports the operator allows (a package mirror or GitHub Enterprise on the agent's host)
//!   and nothing else of the host's loopback;
//! - a job's child joins the namespace as root (`setns`) and then drops to the job's uid;
//!   bwrap then makes the job's own user namespace, a sibling of the holder's. The network
//!   namespace's owner is a user namespace the job is not in, so the job holds no capability
//!   over it: it cannot add addresses, change routes or sysctls, or bring the tap down. The
//!   host's abstract unix sockets belong to the host's network namespace and are out of reach.
//!
//! - cloud metadata services (`169.254.169.254` and the others of `metadata::DENIED`) are
//!   refused inside the namespace by routing-policy rules the agent adds before the slot's
//!   first job (`metadata.rs`): pasta would otherwise make the job's connection from the host
//!   and hand it the instance role's credentials.
//!
//! What it does not stop: connections to the host's *non-loopback* addresses leave through
//! pasta like any other egress, so a service on the agent's host bound to `0.0.0.0` is
//! reachable as it is from the network. Bind such services to loopback, or filter them.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use crate::JobUser;

/// The holder's program. It gets SIGTERM when the agent dies (a parent-death signal, see
/// `child.rs`) and then kills every process of its uid, pasta included: pasta has forked into
/// the background and nothing else would end it. `kill -1` never signals the caller, and only
/// reaches processes of the same uid (the holder has no capability outside its namespace).
pub(crate) const HOLDER: &str = "trap 'kill -KILL -1; exit 0' TERM; while :; do sleep 86400 & wait $!; done";

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("pasta (from the passt package) is not installed: jobs cannot get a network namespace with egress (apt-get install passt), or run them with `network: none`")]
    PastaMissing,
    #[error("starting the network namespace holder for uid {uid}: {source}")]
    Holder { uid: u32, source: std::io::Error },
    #[error("pasta for uid {uid} failed: {message}")]
    Pasta { uid: u32, message: String },
    #[error("keeping cloud metadata services out of the network namespace of uid {uid}: {source}")]
    Metadata { uid: u32, source: crate::metadata::MetadataError },
}

/// One slot's network namespace and its pasta. Dropping it ends both.
#[derive(Debug)]
pub struct SlotNetwork {
    owner: JobUser,
    holder: Child,
    netns: Arc<OwnedFd>,
}

impl SlotNetwork {
    /// Creates the namespace as `owner` (a uid no job runs as) and attaches pasta, allowing
    /// the job TCP connections to exactly `host_ports` on the host's loopback.
    pub fn start(owner: JobUser, host_ports: &[u16]) -> Result<SlotNetwork, NetworkError> {
        let pasta = crate::find_program("pasta").ok_or(NetworkError::PastaMissing)?;

        let holder_err = |source| NetworkError::Holder { uid: owner.uid, source };
        // What an earlier agent left for this uid (it may have died with SIGKILL).
        kill_processes_of(owner.uid);
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", HOLDER]).env_clear().stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        crate::child::install_namespace_holder(
            &mut cmd,
            owner.uid,
            owner.gid,
            format!("0 {} 1", owner.uid).into_bytes(),
            format!("0 {} 1", owner.gid).into_bytes(),
        );
        // Forked by the spawner thread: the holder dies with the thread that forked it (see
        // `child.rs`), and this function may run on a short-lived one.
        let spawned = crate::spawner::run_sync(move || cmd.spawn())
            .unwrap_or_else(|| Err(std::io::Error::other("the spawner thread is not available")));
        let mut holder = spawned.map_err(holder_err)?;
        // The namespaces exist once spawn returned: the child made them before it exec'd.
        let netns = match File::open(format!("/proc/{}/ns/net", holder.id())) {
            Ok(f) => Arc::new(OwnedFd::from(f)),
            Err(e) => {
                let _ = holder.kill();
                let _ = holder.wait();
                return Err(holder_err(e));
            }
        };
        let forward = if host_ports.is_empty() {
            "none".to_string()
        } else {
            host_ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",")
        };
        let out = Command::new(pasta)
            .args(["--config-net", "--no-map-gw", "-t", "none", "-u", "none", "-T", &forward, "-U", "none", "-q"])
            .arg("--runas")
            .arg(format!("{}:{}", owner.uid, owner.gid))
            .arg(holder.id().to_string())
            .env_clear()
            .stdin(Stdio::null())
            .output();
        let failed = |message: String| {
            kill_processes_of(owner.uid);
            NetworkError::Pasta { uid: owner.uid, message }
        };
        match out {
            // pasta forks into the background once the namespace is configured. No job may
            // use the namespace before the metadata rules are in: a slot without them is none.
            Ok(o) if o.status.success() => {
                let net = SlotNetwork { owner, holder, netns };
                match crate::metadata::set_denied(&net.netns, true) {
                    Ok(()) => Ok(net),
                    // Dropping `net` ends the holder and pasta.
                    Err(source) => Err(NetworkError::Metadata { uid: owner.uid, source }),
                }
            }
            Ok(o) => {
                let _ = holder.kill();
                let _ = holder.wait();
                let text = String::from_utf8_lossy(&o.stderr);
                // Debian's pasta also complains that it cannot reach syslog; keep the rest.
                let why: Vec<&str> = text.lines().filter(|l| !l.contains("syslog") && !l.trim().is_empty()).collect();
                Err(failed(format!("{} ({})", why.join("; "), o.status)))
            }
            Err(e) => {
                let _ = holder.kill();
                let _ = holder.wait();
                Err(failed(e.to_string()))
            }
        }
    }

    /// The namespace, for [`crate::Network::Namespace`].
    pub fn namespace(&self) -> Arc<OwnedFd> {
        self.netns.clone()
    }

    pub fn owner(&self) -> JobUser {
        self.owner
    }

    /// Lets the slot's jobs reach cloud metadata services (`allowed`), or refuses them again
    /// (the default from [`SlotNetwork::start`]). For an agent whose operator allows metadata
    /// to trusted origins: the agent allows it just before such a job starts and refuses it
    /// again once every process of the job is gone, before the slot takes another job; a
    /// slot whose refusal cannot be restored must take no job.
    pub fn set_metadata(&self, allowed: bool) -> Result<(), NetworkError> {
        crate::metadata::set_denied(&self.netns, !allowed)
            .map_err(|source| NetworkError::Metadata { uid: self.owner.uid, source })
    }
}

impl Drop for SlotNetwork {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
        kill_processes_of(self.owner.uid);
    }
}

/// SIGKILLs every process whose real uid is `uid` (the holder and pasta; that uid is
/// gpuci's alone, `doctor` checks no account uses it).
fn kill_processes_of(uid: u32) {
    if uid == 0 {
        return;
    }
    for pid in crate::procscan::pids_of_uid(uid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
}
