//! The `local` provider with a stand-in agent program (a shell script that records its
//! arguments and environment, then waits): machines are real process groups on this host, and
//! what the tests check is what a process, `/proc` and the state dir show, not the provider's
//! word. The same provider with real `gpuci agent`s runs in the CLI's `fleets_local` tests.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::fleet::{parse_fleets, Capacity, FleetSpec};
use gpuci_providers::local::LocalProvider;
use gpuci_providers::{AgentLaunch, CreateRequest, ErrorKind, Provider, ProviderState};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn fleet(name: &str, gpus: u32, settings: &str) -> FleetSpec {
    let text = format!(
        r#"
[[fleet]]
name = "{name}"
provider = "local"
max = 4
[fleet.machine]
gpus = {gpus}
gpu_model = "NVIDIA L4"
gpu_memory = "22GiB"
cpus = 2
memory = "4GiB"
[[fleet.offer]]
instance_type = "workstation"
price_per_hour = 0.5
[fleet.settings]
{settings}
"#
    );
    parse_fleets("server.toml", &text).unwrap_or_else(|e| panic!("{e}\n{text}")).remove(0)
}

/// A stand-in for `gpuci`: writes its arguments and environment next to it (its working
/// directory is the machine's directory), starts a child in its group, and waits.
fn fake_agent(dir: &Path) -> PathBuf {
    let p = dir.join("fake-gpuci");
    std::fs::write(
        &p,
        "#!/bin/sh\nprintf '%s\\n' \"$@\" > args.tmp && mv args.tmp args\nenv > env\nsleep 1000 &\nexec sleep 1000\n",
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

struct Host {
    dir: tempfile::TempDir,
    program: PathBuf,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().unwrap();
        let program = fake_agent(dir.path());
        Host { dir, program }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn provider(&self, spec: &FleetSpec) -> LocalProvider {
        LocalProvider::from_settings(spec, "coord1", &self.state()).unwrap()
    }

    fn request(&self, spec: &FleetSpec, machine: &str) -> CreateRequest {
        let mut tags = BTreeMap::new();
        tags.insert(gpuci_providers::TAG_MACHINE.to_string(), machine.to_string());
        CreateRequest {
            machine: machine.to_string(),
            offer: spec.offers[0].clone(),
            capacity: Capacity::OnDemand,
            agent: AgentLaunch {
                server: "http://127.0.0.1:9".into(),
                registration_token: format!("gpuci_mreg.{machine}.00ff"),
                coordinator_key: None,
                tags,
                name: format!("{}-{machine}", spec.name),
                program: self.program.display().to_string(),
                extra_args: vec![],
            },
        }
    }

    fn machine_dir(&self, spec: &FleetSpec, machine: &str) -> PathBuf {
        self.state().join("coord1").join(&spec.name).join(machine)
    }

    /// The stand-in's arguments once it has written them.
    fn args(&self, spec: &FleetSpec, machine: &str) -> Vec<String> {
        let path = self.machine_dir(spec, machine).join("args");
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(t) = std::fs::read_to_string(&path) {
                return t.lines().map(String::from).collect();
            }
            assert!(Instant::now() < until, "{} never appeared", path.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn env(&self, spec: &FleetSpec, machine: &str) -> String {
        self.args(spec, machine);
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(t) = std::fs::read_to_string(self.machine_dir(spec, machine).join("env")) {
                if !t.is_empty() {
                    return t;
                }
            }
            assert!(Instant::now() < until);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Pids of processes whose working directory is the machine's directory.
    fn processes(&self, spec: &FleetSpec, machine: &str) -> Vec<i32> {
        let dir = self.machine_dir(spec, machine);
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
            .filter(|pid| {
                let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .map(|s| s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
                    .unwrap_or(true);
                !zombie && std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|c| c == dir)
            })
            .collect()
    }
}

fn gpus_arg(args: &[String]) -> Option<String> {
    args.iter().position(|a| a == "--gpus").map(|i| args[i + 1].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_are_process_groups_created_once_listed_and_deleted() {
    let host = Host::new();
    let spec = fleet("cpu", 0, "");
    let p = host.provider(&spec);
    let req = host.request(&spec, "m-1");
    let made = p.create(&req).await.unwrap();
    assert_eq!((made.machine.as_str(), made.state), ("m-1", ProviderState::Running));
    let args = host.args(&spec, "m-1");
    let data_dir = host.machine_dir(&spec, "m-1").join("agent");
    assert_eq!(args[..3], ["agent", "--server", "http://127.0.0.1:9"]);
    assert!(args.windows(2).any(|w| w == ["--data-dir", data_dir.to_str().unwrap()]), "{args:?}");
    // The token reaches the agent's environment and nothing on disk.
    assert!(host.env(&spec, "m-1").contains("GPUCI_REGISTRATION_TOKEN=gpuci_mreg.m-1.00ff"));
    let on_disk = walk(&host.state()).into_iter().filter(|f| !f.ends_with("env")).flat_map(std::fs::read);
    for bytes in on_disk {
        assert!(!String::from_utf8_lossy(&bytes).contains("gpuci_mreg"), "the token was written down");
    }
    // The script writes its env file before it starts its child: wait for both processes.
    let until = Instant::now() + Duration::from_secs(20);
    while host.processes(&spec, "m-1").len() < 2 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(host.processes(&spec, "m-1").len(), 2, "the agent and its child");

    // Asked again (a coordinator that crashed after asking): the same machine, no second one.
    let again = p.create(&req).await.unwrap();
    assert_eq!(again.provider_id, made.provider_id);
    assert_eq!(host.processes(&spec, "m-1").len(), 2);
    // A coordinator started again finds it.
    let listed = host.provider(&spec).list().await.unwrap();
    assert_eq!(
        listed.iter().map(|m| (m.machine.as_str(), m.state)).collect::<Vec<_>>(),
        [("m-1", ProviderState::Running)]
    );

    p.delete("m-1").await.unwrap();
    assert!(host.processes(&spec, "m-1").is_empty(), "the whole group is gone");
    assert!(p.list().await.unwrap().is_empty());
    assert!(!host.machine_dir(&spec, "m-1").exists());
    p.delete("m-1").await.unwrap(); // deleted already: fine
    for bad in ["../x", "", ".hidden", "a/b"] {
        assert_eq!(p.delete(bad).await.unwrap_err().kind, ErrorKind::Invalid, "{bad:?}");
    }
}

/// GPUs are shared out, never twice: not between machines, not between fleets on one state
/// dir; the host running out is a capacity error; a deleted, stopped or dead machine's GPUs
/// are free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_machine_gets_a_share_of_the_hosts_gpus_and_no_gpu_goes_twice() {
    let host = Host::new();
    let pool = r#"gpus = ["0", "1", "2"]"#;
    let a = fleet("a", 1, pool);
    let b = fleet("b", 1, pool);
    let (pa, pb) = (host.provider(&a), host.provider(&b));
    pa.create(&host.request(&a, "a1")).await.unwrap();
    pb.create(&host.request(&b, "b1")).await.unwrap();
    pa.create(&host.request(&a, "a2")).await.unwrap();
    let shares: Vec<String> =
        [(&a, "a1"), (&b, "b1"), (&a, "a2")].iter().map(|(f, m)| gpus_arg(&host.args(f, m)).unwrap()).collect();
    let mut sorted = shares.clone();
    sorted.sort();
    assert_eq!(sorted, ["0", "1", "2"], "{shares:?}");

    let full = pb.create(&host.request(&b, "b2")).await.unwrap_err();
    assert_eq!(full.kind, ErrorKind::Capacity, "{full}");
    assert!(full.message.contains("0 of its 3 shared GPUs free"), "{full}");
    assert!(!host.machine_dir(&b, "b2").exists(), "a refused machine leaves nothing");

    // A stopped machine holds no GPU; started again, it gets one back if one is free.
    pa.stop("a1").await.unwrap();
    assert!(host.processes(&a, "a1").is_empty());
    pb.create(&host.request(&b, "b2")).await.unwrap();
    assert_eq!(gpus_arg(&host.args(&b, "b2")).unwrap(), shares[0]);
    assert_eq!(pa.start("a1").await.unwrap_err().kind, ErrorKind::Capacity);

    // A machine whose agent died is terminated, and its GPU free.
    let leader = host.processes(&a, "a2").into_iter().min().unwrap();
    nix_kill(leader);
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let listed = pa.list().await.unwrap();
        if listed.iter().any(|m| m.machine == "a2" && m.state == ProviderState::Terminated) {
            break;
        }
        assert!(Instant::now() < until, "a dead agent is never listed terminated: {listed:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(host.processes(&a, "a2").is_empty(), "what the dead agent started went with it");
    std::fs::remove_file(host.machine_dir(&a, "a1").join("args")).unwrap();
    pa.start("a1").await.unwrap();
    assert_eq!(gpus_arg(&host.args(&a, "a1")).unwrap(), shares[2]);
    for (f, p, m) in [(&a, &pa, "a1"), (&b, &pb, "b1"), (&b, &pb, "b2")] {
        p.delete(m).await.unwrap();
        assert!(host.processes(f, m).is_empty());
    }
}

/// Stop ends the agent and keeps its data dir; start runs the same agent again (same data
/// dir), without the registration token, which its first start spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_machine_starts_again_as_the_same_agent_without_a_token() {
    let host = Host::new();
    let spec = fleet("s", 1, r#"simulate_gpus = "1xL4""#);
    let p = host.provider(&spec);
    p.create(&host.request(&spec, "m-1")).await.unwrap();
    let first = host.args(&spec, "m-1");
    assert!(first.windows(2).any(|w| w == ["--simulate-gpus", "1xL4"]), "{first:?}");
    let data_dir = host.machine_dir(&spec, "m-1").join("agent");
    std::fs::write(data_dir.join("agent.json"), "{}").unwrap();
    assert_eq!(p.stop("m-1").await.unwrap().state, ProviderState::Stopped);
    assert!(host.processes(&spec, "m-1").is_empty());
    assert_eq!(p.list().await.unwrap()[0].state, ProviderState::Stopped);
    std::fs::remove_file(host.machine_dir(&spec, "m-1").join("args")).unwrap();
    std::fs::remove_file(host.machine_dir(&spec, "m-1").join("env")).unwrap();
    assert_eq!(p.start("m-1").await.unwrap().state, ProviderState::Running);
    assert_eq!(host.args(&spec, "m-1"), first);
    assert!(!host.env(&spec, "m-1").contains("GPUCI_REGISTRATION_TOKEN"));
    assert!(data_dir.join("agent.json").exists(), "the agent's identity survives a stop");
    p.delete("m-1").await.unwrap();
    assert_eq!(p.start("m-1").await.unwrap_err().kind, ErrorKind::NotFound);
}

#[test]
fn settings_that_would_share_a_gpu_or_cannot_work_are_refused() {
    let host = Host::new();
    let refused = |gpus: u32, settings: &str| {
        LocalProvider::from_settings(&fleet("f", gpus, settings), "coord1", &host.state()).unwrap_err()
    };
    let e = refused(1, "");
    assert!(
        e.contains("say which of this host's GPUs") && e.contains("every local agent would otherwise see every GPU"),
        "{e}"
    );
    assert!(refused(2, r#"simulate_gpus = "1xL4""#)
        .contains("gives each machine 1 GPUs, but [fleet.machine] says gpus = 2"));
    assert!(refused(2, r#"gpus = ["0"]"#).contains("names 1 GPU(s); one machine needs 2"));
    assert!(refused(1, r#"gpus = ["0", "0"]"#).contains("0 is named twice"));
    assert!(refused(1, r#"gpus = ["0; rm -rf /"]"#).contains("neither a GPU UUID"));
    assert!(refused(0, r#"command = ["x"]"#).contains("unknown setting \"command\""));
    assert!(refused(0, r#"state_dir = "relative""#).contains("give an absolute path"));
    // One GPU named twice, written two ways, or handed out by the fleet's own agent_args.
    assert!(refused(1, r#"gpus = ["0", "00"]"#).contains("0 is named twice"));
    assert!(refused(1, r#"gpus = ["0", "GPU-1"]"#).contains("all UUIDs or all indices"));
    for flag in ["--gpus", "--gpus=2", "--simulate-gpus", "--data-dir"] {
        let e = refused(0, &format!("agent_args = [\"{flag}\", \"x\"]"));
        assert!(e.contains("is the local provider's to give"), "{flag}: {e}");
    }
    // The common settings pass through to the coordinator.
    LocalProvider::from_settings(
        &fleet("f", 0, "agent_program = \"/bin/true\"\nleave_after_unreachable = \"5m\""),
        "coord1",
        &host.state(),
    )
    .unwrap();
}

fn nix_kill(pid: i32) {
    std::process::Command::new("kill").arg("-KILL").arg(pid.to_string()).status().unwrap();
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The records say what to run and which groups to signal: a state dir someone else can write
/// is refused, and a record that names another machine than its file (a path elsewhere) is
/// not used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_dir_others_can_write_and_forged_records_are_refused() {
    let host = Host::new();
    let spec = fleet("cpu", 0, "");
    let p = host.provider(&spec);
    p.create(&host.request(&spec, "m-1")).await.unwrap();
    let fleet_dir = host.state().join("coord1/cpu");
    // A record renamed to another machine's file: its own `machine` no longer matches.
    std::fs::copy(fleet_dir.join("m-1.json"), fleet_dir.join("m-2.json")).unwrap();
    let e = p.start("m-2").await.unwrap_err();
    assert!(e.message.contains("names another machine; not used"), "{e}");
    std::fs::remove_file(fleet_dir.join("m-2.json")).unwrap();

    std::fs::set_permissions(&fleet_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = p.list().await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Invalid);
    assert!(e.message.contains("that no one else can write") && e.message.contains("mode 777"), "{e}");
    assert_eq!(p.delete("m-1").await.unwrap_err().kind, ErrorKind::Invalid, "nothing is signalled");
    assert!(!host.processes(&spec, "m-1").is_empty());
    std::fs::set_permissions(&fleet_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    p.delete("m-1").await.unwrap();
    assert!(host.processes(&spec, "m-1").is_empty());
}

/// A machine without GPUs sees none of the host's (`--gpus none`), and an agent gets none of
/// the coordinator's environment but what a program needs (here: no CARGO_* variable of the
/// test process, which a coordinator's GPUCI_* settings or credentials would be).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_get_no_gpus_they_were_not_given_and_a_clean_environment() {
    let host = Host::new();
    let spec = fleet("cpu", 0, "");
    let p = host.provider(&spec);
    p.create(&host.request(&spec, "m-1")).await.unwrap();
    let args = host.args(&spec, "m-1");
    assert_eq!(gpus_arg(&args).as_deref(), Some("none"), "{args:?}");
    let env = host.env(&spec, "m-1");
    assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
    assert!(!env.contains("CARGO_"), "the coordinator's environment leaked: {env}");
    assert!(env.contains("PATH=") && env.contains("GPUCI_REGISTRATION_TOKEN="), "{env}");
    p.delete("m-1").await.unwrap();
}
