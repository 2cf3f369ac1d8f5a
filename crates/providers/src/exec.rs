//! The `exec` provider: a program of the user's speaks a small JSON protocol on stdin/stdout
//! (docs/providers/exec.md), so a cloud gpuci has no code for (Lambda, RunPod, an on-prem
//! hypervisor) is one script away. One process per call; a call past its timeout is killed
//! with its process group and counts as transient.

use crate::{CreateRequest, ErrorKind, Provider, ProviderError, ProviderMachine, ProviderResult};
use async_trait::async_trait;
use gpuci_core::fleet::FleetSpec;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The most of a program's output read (stdout, stderr each).
const MAX_OUTPUT: u64 = 4 << 20;

#[derive(Debug)]
pub struct ExecProvider {
    command: Vec<String>,
    timeout: Duration,
    can_stop: bool,
    coordinator: String,
    fleet: String,
    /// `[fleet.settings]` as JSON, passed on as `settings`.
    settings: Value,
    /// Credentials the program is given (the registration token): never repeated in a log
    /// line or an error, whatever the program echoes.
    secrets: Vec<String>,
}

/// The settings gpuci itself reads; the rest are the program's.
#[derive(Deserialize)]
struct Own {
    command: Vec<String>,
    #[serde(default)]
    timeout: Option<String>,
    #[serde(default)]
    stop: bool,
}

impl ExecProvider {
    pub fn from_settings(fleet: &FleetSpec, coordinator: &str) -> Result<Self, String> {
        let bad = |what: String| format!("fleet {}: [fleet.settings]: {what}", fleet.name);
        let settings = serde_json::to_value(&fleet.settings).map_err(|e| bad(e.to_string()))?;
        let own: Own = serde_json::from_value(settings.clone()).map_err(|e| {
            bad(format!("{e} (an exec fleet needs command = [\"/path/to/program\", …], see docs/providers/exec.md)"))
        })?;
        if own.command.is_empty() || own.command[0].is_empty() {
            return Err(bad("command: give the program to run, e.g. command = [\"/usr/local/bin/my-cloud\"]".into()));
        }
        let timeout = match &own.timeout {
            None => Duration::from_secs(120),
            Some(t) => {
                t.parse::<gpuci_core::duration::Duration>().map(|d| d.0).map_err(|e| bad(format!("timeout: {e}")))?
            }
        };
        if let Some(v) = fleet.settings.get("leave_after_unreachable") {
            let ok = v.as_str().is_some_and(|t| {
                t == "off" || t.parse::<gpuci_core::duration::Duration>().is_ok_and(|d| d.0 >= Duration::from_secs(10))
            });
            if !ok {
                return Err(bad(format!(
                    "leave_after_unreachable: {v}: give a duration of at least 10s (default {}) or \"off\"",
                    "10m"
                )));
            }
        }
        if timeout < Duration::from_secs(1) {
            return Err(bad(format!("timeout: {timeout:?} is too short for any program; give at least 1s")));
        }
        if fleet.idle_action == gpuci_core::fleet::IdleAction::Stop && !own.stop {
            return Err(bad(
                "idle_action = \"stop\" needs a program that can stop and start machines: say stop = true in [fleet.settings]"
                    .into(),
            ));
        }
        Ok(ExecProvider {
            command: own.command,
            timeout,
            can_stop: own.stop,
            coordinator: coordinator.to_string(),
            fleet: fleet.name.clone(),
            settings,
            secrets: Vec::new(),
        })
    }

    /// Never show `secret` in what the program says.
    pub fn with_secret(mut self, secret: &str) -> Self {
        if !secret.is_empty() {
            self.secrets.push(secret.to_string());
        }
        self
    }

    fn redact(&self, text: &str) -> String {
        let text = self.secrets.iter().fold(text.to_string(), |t, s| t.replace(s.as_str(), "[registration token]"));
        crate::redact_machine_tokens(&text)
    }

    /// Run `command… op` with `extra` merged into the common request; the answer's JSON.
    async fn call(&self, op: &str, extra: Value) -> ProviderResult<Value> {
        self.call_raw(op, extra).await.map_err(|e| ProviderError::new(e.kind, self.redact(&e.message)))
    }

    async fn call_raw(&self, op: &str, extra: Value) -> ProviderResult<Value> {
        let mut req = json!({
            "protocol": 1,
            "op": op,
            "coordinator": self.coordinator,
            "fleet": self.fleet,
            "settings": self.settings,
        });
        if let (Some(r), Value::Object(e)) = (req.as_object_mut(), extra) {
            r.extend(e);
        }
        let body = serde_json::to_vec(&req).map_err(|e| ProviderError::new(ErrorKind::Invalid, e.to_string()))?;
        let transient = |what: String| ProviderError::new(ErrorKind::Transient, what);
        let program = &self.command[0];
        let mut child = tokio::process::Command::new(program)
            .args(&self.command[1..])
            .arg(op)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| ProviderError::new(ErrorKind::Invalid, format!("cannot run {program}: {e}")))?;
        let pgid = child.id();
        let (mut stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
        let run = async {
            if let Some(w) = stdin.as_mut() {
                // A program that does not read its input still gets to answer.
                let _ = w.write_all(&body).await;
            }
            drop(stdin.take());
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let read_out = async {
                if let Some(o) = stdout {
                    let _ = o.take(MAX_OUTPUT).read_to_end(&mut out).await;
                }
            };
            let read_err = async {
                if let Some(e) = stderr {
                    let _ = e.take(MAX_OUTPUT).read_to_end(&mut err).await;
                }
            };
            tokio::join!(read_out, read_err);
            let status = child.wait().await;
            (status, out, err)
        };
        let (status, out, err) = match tokio::time::timeout(self.timeout, run).await {
            Ok(r) => r,
            Err(_) => {
                kill_group(pgid);
                return Err(transient(format!("{program} {op}: no answer within {:?}; killed", self.timeout)));
            }
        };
        // No group kill here: the program has been reaped, so its pid (the group's id) may
        // already belong to an unrelated process and group (pids come round fast). A program
        // that leaves processes behind in its group keeps them; only one that outlives its
        // timeout has its group killed, while it is still ours (not yet reaped).
        if !err.is_empty() {
            let text = self.redact(&String::from_utf8_lossy(&err[..err.len().min(4096)]));
            let text = gpuci_core::text::escape(text.trim_end()).to_string();
            tracing::info!(fleet = %self.fleet, op, stderr = %text, "exec provider said");
        }
        let status = status.map_err(|e| transient(format!("{program} {op}: {e}")))?;
        let answer: Value = serde_json::from_slice(&out).map_err(|e| {
            let kind = if status.success() { ErrorKind::Invalid } else { ErrorKind::Transient };
            ProviderError::new(kind, format!("{program} {op} ({status}): its output is not one JSON object: {e}"))
        })?;
        if let Some(e) = answer.get("error") {
            let kind = e
                .get("kind")
                .cloned()
                .and_then(|k| serde_json::from_value::<ErrorKind>(k).ok())
                .unwrap_or(ErrorKind::Transient);
            let message = e.get("message").and_then(Value::as_str).unwrap_or("(no message)");
            return Err(ProviderError::new(kind, format!("{program} {op}: {message}")));
        }
        if !status.success() {
            return Err(transient(format!("{program} {op}: {status}, and no error object")));
        }
        Ok(answer)
    }

    fn machine_of(&self, op: &str, answer: Value) -> ProviderResult<ProviderMachine> {
        let m = answer.get("machine").cloned().unwrap_or(Value::Null);
        serde_json::from_value(m).map_err(|e| {
            ProviderError::new(ErrorKind::Invalid, format!("{} {op}: `machine` in the answer: {e}", self.command[0]))
        })
    }
}

/// End a call's process group (the program and whatever it started in its group). Only while
/// the program is not yet reaped: until then its pid, and so the group's id, cannot be reused.
#[allow(unsafe_code)]
fn kill_group(pgid: Option<u32>) {
    if let Some(pgid) = pgid.and_then(|p| i32::try_from(p).ok()).filter(|p| *p > 1) {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory is touched.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
}

#[async_trait]
impl Provider for ExecProvider {
    fn can_stop(&self) -> bool {
        self.can_stop
    }

    async fn create(&self, req: &CreateRequest) -> ProviderResult<ProviderMachine> {
        let mut agent = serde_json::to_value(&req.agent).unwrap_or(Value::Null);
        if let Some(a) = agent.as_object_mut() {
            a.insert("registration_token".into(), Value::String(req.agent.registration_token.clone()));
            a.insert("command".into(), json!(req.agent.command()));
            a.insert("user_data".into(), Value::String(req.agent.user_data()));
        }
        let answer = self
            .call(
                "create",
                json!({
                    "machine": req.machine,
                    "offer": {"instance_type": req.offer.instance_type, "zone": req.offer.zone,
                              "price_per_hour": req.offer.price(req.capacity)},
                    "capacity": req.capacity,
                    "agent": agent,
                }),
            )
            .await?;
        self.machine_of("create", answer)
    }

    async fn list(&self) -> ProviderResult<Vec<ProviderMachine>> {
        let answer = self.call("list", json!({})).await?;
        let list = answer.get("machines").cloned().unwrap_or(Value::Null);
        serde_json::from_value(list).map_err(|e| {
            ProviderError::new(ErrorKind::Invalid, format!("{} list: `machines` in the answer: {e}", self.command[0]))
        })
    }

    async fn delete(&self, machine: &str) -> ProviderResult<()> {
        match self.call("delete", json!({ "machine": machine })).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn stop(&self, machine: &str) -> ProviderResult<ProviderMachine> {
        let answer = self.call("stop", json!({ "machine": machine })).await?;
        self.machine_of("stop", answer)
    }

    async fn start(&self, machine: &str) -> ProviderResult<ProviderMachine> {
        let answer = self.call("start", json!({ "machine": machine })).await?;
        self.machine_of("start", answer)
    }
}
