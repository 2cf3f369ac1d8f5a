//! The fleets tests' harness: a coordinator with exec fleets run by the reference program,
//! a metadata service for spot notices, and a provider that misbehaves on purpose.

use super::*;

pub(crate) const T: Duration = Duration::from_secs(120);

pub(crate) fn reference_program() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../providers/tests/exec-ref/gpuci-exec-local")
}

/// A fleet of 1×L4 machines (simulated GPUs) made by the reference program.
pub(crate) fn fleet_toml(state: &Path, extra: &str, settings: &str) -> String {
    format!(
        r#"
[[fleet]]
name = "l4"
provider = "exec"
max = 2
idle_timeout = "2s"
boot_timeout = "90s"
{extra}
[fleet.machine]
gpu_model = "NVIDIA L4"
gpus = 1
gpu_memory = "22GiB"
cpus = 2
memory = "4GiB"
[[fleet.offer]]
instance_type = "small"
zone = "lab-a"
price_per_hour = 3.6
[[fleet.offer]]
instance_type = "large"
zone = "lab-b"
price_per_hour = 7.2
[fleet.settings]
command = ["python3", "{program}"]
state_dir = "{state}"
agent_program = "{bin}"
agent_args = ["--simulate-gpus", "1xL4", "--slots", "1", "--leave-after-unreachable", "30s", "--isolation", "{iso}"]
{settings}
"#,
        program = reference_program().display(),
        state = state.display(),
        bin = BIN,
        iso = isolation(),
    )
}

pub(crate) struct Fleet {
    pub(crate) _dir: tempfile::TempDir,
    pub(crate) server: Server,
    pub(crate) state: PathBuf,
}

pub(crate) fn start(extra: &str, settings: &str) -> Fleet {
    let dir = tempdir();
    let state = dir.path().join("machines");
    let config = dir.path().join("server.toml");
    std::fs::write(&config, fleet_toml(&state, extra, settings)).unwrap();
    let server = Server::start_on(
        &dir.path().join("server"),
        "127.0.0.1:0",
        vec![
            "--heartbeat".into(),
            "200ms".into(),
            "--lost-after".into(),
            "20s".into(),
            "--fleet-interval".into(),
            "300ms".into(),
            "--config".into(),
            config.display().to_string(),
        ],
    );
    Fleet { _dir: dir, server, state }
}

impl Fleet {
    pub(crate) fn status(&self) -> Value {
        let fleets: Vec<Value> = self.server.api().get("/api/v1/fleets");
        fleets.into_iter().find(|f| f["name"] == "l4").expect("fleet l4")
    }

    pub(crate) fn machines(&self) -> Vec<Value> {
        self.status()["machines"].as_array().cloned().unwrap_or_default()
    }

    /// The reference program's records: every machine it was asked to make.
    pub(crate) fn made(&self) -> Vec<Value> {
        made_in(&self.state)
    }

    pub(crate) fn running_machines(&self) -> usize {
        self.made().iter().filter(|m| m["state"] == "running").count()
    }
}

/// The reference program's records under `state`.
pub(crate) fn made_in(state: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    for e in walk(state) {
        if e.extension().is_some_and(|x| x == "json") {
            if let Ok(v) = serde_json::from_str::<Value>(&std::fs::read_to_string(&e).unwrap_or_default()) {
                if v.get("provider_id").is_some() {
                    out.push(v);
                }
            }
        }
    }
    out
}

/// The last lines of every machine's agent output under `state` (the reference program's
/// `<machine>.log`), for a failure's report: what the agents said is otherwise lost with the
/// temporary dir.
pub(crate) fn machine_logs(state: &Path) -> String {
    let mut out = String::new();
    for e in walk(state) {
        if e.extension().is_some_and(|x| x == "log") {
            let text = std::fs::read_to_string(&e).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {} (last 60 lines)\n", e.display()));
            for l in &lines[lines.len().saturating_sub(60)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    out
}

pub(crate) const TWO_L4_JOBS: &str = "steps:\n  - key: a\n    gpus: 1\n    gpu: {model: \"*L4\"}\n    command: echo on $GPUCI_GPUS && sleep 1\n  - key: b\n    gpus: 1\n    gpu: {model: \"*L4\"}\n    command: echo on $GPUCI_GPUS && sleep 1\n";

/// An instance metadata service of our own: answers the spot interruption notice while `on`.
pub(crate) struct NoticeServer {
    pub(crate) url: String,
    pub(crate) on: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl NoticeServer {
    pub(crate) fn start() -> NoticeServer {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/latest/meta-data/spot/instance-action", listener.local_addr().unwrap());
        let on = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = on.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let mut conn = conn;
                let mut buf = [0u8; 4096];
                let n = conn.read(&mut buf).unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]);
                let notice = flag.load(std::sync::atomic::Ordering::SeqCst)
                    && req.starts_with("GET /latest/meta-data/spot/instance-action");
                let resp = if notice {
                    let body = r#"{"action": "terminate", "time": "2026-11-24T08:22:00Z"}"#;
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len())
                } else {
                    "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_string()
                };
                let _ = conn.write_all(resp.as_bytes());
            }
        });
        NoticeServer { url, on }
    }

    pub(crate) fn set(&self, on: bool) {
        self.on.store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A provider program for the tests that misbehaves as `[fleet.settings] mode` says.
pub(crate) fn hostile_provider(dir: &Path) -> PathBuf {
    let program = dir.join("hostile-provider");
    std::fs::write(
        &program,
        r#"#!/usr/bin/env python3
import json, sys, time
op = sys.argv[1]
req = json.load(sys.stdin)
mode = req["settings"].get("mode")
if mode == "hang":
    time.sleep(600)
if mode == "wrongid":
    if op == "create":
        m = {"machine": req["machine"] + "-x", "provider_id": "p1", "state": "running"}
        print(json.dumps({"machine": m}))
    else:
        print(json.dumps({"machines": []} if op == "list" else {}))
    sys.exit(0)
if mode == "weird" and op == "list":
    ids = ["m-\x1b[2Jcleared\nFAKE", "../../etc/passwd", "x" * 5000, "m-dup", "m-dup"]
    print(json.dumps({"machines": [{"machine": i, "provider_id": "p", "state": "running"} for i in ids]}))
    sys.exit(0)
print(json.dumps({"machines": []} if op == "list" else {"error": {"kind": "invalid", "message": "no"}}))
sys.exit(0 if op == "list" else 1)
"#,
    )
    .unwrap();
    std::fs::set_permissions(&program, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    program
}

pub(crate) fn server_with(dir: &Path, toml: &str) -> Server {
    let config = dir.join("server.toml");
    std::fs::write(&config, toml).unwrap();
    Server::start_on(
        &dir.join("server"),
        "127.0.0.1:0",
        vec!["--fleet-interval".into(), "300ms".into(), "--config".into(), config.display().to_string()],
    )
}
