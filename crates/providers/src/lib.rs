//! Providers: what creates, lists, stops, starts and deletes the machines of a fleet, behind
//! one contract ([`Provider`]). The coordinator's reconcile loop is the only caller: it asks a
//! provider what exists every pass and applies the autoscaler's decisions
//! (`gpuci_core::fleet::decide`) through it.
//!
//! What a provider must do: tag every machine it creates with the coordinator's id, the fleet
//! and gpuci's machine id, and find them again by those tags ([`Provider::list`]); make
//! `create` idempotent by machine id (a coordinator that crashed after asking asks again);
//! classify failures ([`ErrorKind`]) so a capacity error moves to the next offer instead of
//! failing a job. What it must not do: decide anything (how many, which, when: that is the
//! core's), remember machines between calls instead of listing them, or log credentials (the
//! registration token goes to the machine, never to a log line).

pub mod exec;
pub mod local;
pub mod slurm;

use async_trait::async_trait;
use gpuci_core::fleet::{Capacity, FleetSpec, Offer, ProviderKind};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Tag keys every machine gpuci creates carries (and its agent registers with).
pub const TAG_COORDINATOR: &str = "gpuci.coordinator";
pub const TAG_FLEET: &str = "gpuci.fleet";
pub const TAG_MACHINE: &str = "gpuci.machine";

/// `text` with every machine registration token (`gpuci_mreg.<machine>.<hex>`, the one
/// credential a machine is given) replaced by `[registration token]`: for whatever a
/// provider says back (errors, output) before it is shown or logged.
pub fn redact_machine_tokens(text: &str) -> String {
    const PREFIX: &str = "gpuci_mreg.";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(PREFIX) {
        out.push_str(&rest[..at]);
        out.push_str("[registration token]");
        let tail = &rest[at + PREFIX.len()..];
        let end =
            tail.find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))).unwrap_or(tail.len());
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// How a machine's agent starts and finds the coordinator.
#[derive(Clone, Debug, Serialize)]
pub struct AgentLaunch {
    /// The coordinator URL the agent connects to.
    pub server: String,
    /// The one credential the machine gets: registers its agent, once (a machine registration
    /// token, see the coordinator's `auth::machine_token`). Never logged.
    #[serde(skip_serializing)]
    pub registration_token: String,
    /// The coordinators' identity key (public), handed to the agent in
    /// `GPUCI_COORDINATOR_KEY` so it sends even its registration token only to an address that
    /// proves it (an agent too old to know the variable ignores it). `None`: the agent pins
    /// the key it meets at registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_key: Option<String>,
    /// [`TAG_FLEET`] and [`TAG_MACHINE`] plus the fleet's machine tags.
    pub tags: BTreeMap<String, String>,
    pub name: String,
    /// The `gpuci` program on the machine.
    pub program: String,
    /// Extra arguments for `gpuci agent` from the fleet's settings (`agent_args`).
    pub extra_args: Vec<String>,
}

impl AgentLaunch {
    /// The command line that starts the agent (the token goes in `GPUCI_REGISTRATION_TOKEN`,
    /// the coordinators' key in `GPUCI_COORDINATOR_KEY`).
    pub fn command(&self) -> Vec<String> {
        let mut c = vec![self.program.clone(), "agent".into(), "--server".into(), self.server.clone()];
        c.extend(["--name".into(), self.name.clone()]);
        for (k, v) in &self.tags {
            c.extend(["--tag".into(), format!("{k}={v}")]);
        }
        c.extend(self.extra_args.iter().cloned());
        c
    }

    /// The same as a shell script, for clouds that run one at boot (EC2 user data). Every
    /// word is single-quoted.
    pub fn user_data(&self) -> String {
        let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
        let words: Vec<String> = self.command().iter().map(|w| quote(w)).collect();
        let key = match &self.coordinator_key {
            Some(k) => format!("GPUCI_COORDINATOR_KEY={}\nexport GPUCI_COORDINATOR_KEY\n", quote(k)),
            None => String::new(),
        };
        format!(
            "#!/bin/sh\n# gpuci agent for fleet machine {}\nGPUCI_REGISTRATION_TOKEN={}\nexport GPUCI_REGISTRATION_TOKEN\n{key}exec {}\n",
            self.tags.get(TAG_MACHINE).map(String::as_str).unwrap_or("?"),
            quote(&self.registration_token),
            words.join(" ")
        )
    }
}

/// What the reconcile loop asks for.
#[derive(Clone, Debug)]
pub struct CreateRequest {
    pub machine: String,
    pub offer: Offer,
    pub capacity: Capacity,
    pub agent: AgentLaunch,
}

/// A machine's state at its provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderState {
    Pending,
    Running,
    Stopping,
    Stopped,
    Terminated,
}

/// A machine as its provider lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProviderMachine {
    /// gpuci's machine id (from its tag).
    pub machine: String,
    /// The provider's own id (an instance id, a job id, a pod name).
    pub provider_id: String,
    pub state: ProviderState,
    #[serde(default)]
    pub instance_type: String,
    #[serde(default)]
    pub zone: String,
    #[serde(default = "on_demand")]
    pub capacity: Capacity,
    /// When billing started (unix seconds), if the provider says.
    #[serde(default)]
    pub launched_at: Option<u64>,
    /// What the provider says of the machine's state, for people: why it is still pending (a
    /// Slurm job's reason, a pod the scheduler cannot place), or why it ended (a time limit,
    /// an eviction). Shown in waiting jobs' reasons and the fleet's status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

fn on_demand() -> Capacity {
    Capacity::OnDemand
}

/// How a provider call failed, which decides what the reconcile loop does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// No capacity for this offer now (`InsufficientInstanceCapacity`): try the next one.
    Capacity,
    /// An account limit: like capacity, and shown.
    Quota,
    /// The machine does not exist.
    NotFound,
    /// The request cannot work as configured.
    Invalid,
    /// The platform refuses what this fleet asks for (a Kubernetes admission policy, a
    /// RuntimeClass the cluster lacks, an image that cannot be pulled): the offer is skipped
    /// for a while like after a capacity error, with the platform's words shown, instead of
    /// being asked again every pass.
    Refused,
    /// Anything that may pass: retried next pass.
    #[serde(other)]
    Transient,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ProviderError {
    pub kind: ErrorKind,
    pub message: String,
}

impl ProviderError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ProviderError { kind, message: message.into() }
    }

    /// Whether the offer should be skipped for a while (next offer, next capacity type).
    pub fn is_capacity(&self) -> bool {
        matches!(self.kind, ErrorKind::Capacity | ErrorKind::Quota | ErrorKind::Refused)
    }
}

pub type ProviderResult<T> = Result<T, ProviderError>;

/// The contract every provider keeps. Calls may take long (a cloud API): the reconcile loop
/// makes them off the scheduler's task.
#[async_trait]
pub trait Provider: Send + Sync {
    /// Whether [`stop`](Provider::stop) and [`start`](Provider::start) work.
    fn can_stop(&self) -> bool;
    /// Create a machine, or answer the one that exists with this machine id.
    async fn create(&self, req: &CreateRequest) -> ProviderResult<ProviderMachine>;
    /// Every machine of this coordinator and fleet that exists (by tags).
    async fn list(&self) -> ProviderResult<Vec<ProviderMachine>>;
    /// Delete a machine; one that does not exist is deleted already.
    async fn delete(&self, machine: &str) -> ProviderResult<()>;
    async fn stop(&self, machine: &str) -> ProviderResult<ProviderMachine>;
    async fn start(&self, machine: &str) -> ProviderResult<ProviderMachine>;
}

/// The provider of `fleet`, for coordinator `coordinator`, which hands `registration_token` to
/// the machines it makes (and never repeats it) and keeps what it must under `data_dir` (the
/// coordinator's); an error a person can act on when the fleet's settings are wrong or its
/// provider is not built into this version.
pub fn for_fleet(
    fleet: &FleetSpec,
    coordinator: &str,
    registration_token: &str,
    data_dir: &std::path::Path,
) -> Result<Box<dyn Provider>, String> {
    match fleet.provider {
        ProviderKind::Exec => {
            Ok(Box::new(exec::ExecProvider::from_settings(fleet, coordinator)?.with_secret(registration_token)))
        }
        ProviderKind::Local => {
            let root = std::path::absolute(data_dir.join("local-machines")).map_err(|e| e.to_string())?;
            let data_dir = std::path::absolute(data_dir).map_err(|e| e.to_string())?;
            Ok(Box::new(local::LocalProvider::from_settings(fleet, coordinator, &root)?.hiding(vec![data_dir])))
        }
        ProviderKind::Slurm => {
            Ok(Box::new(slurm::SlurmProvider::from_settings(fleet, coordinator)?.with_secret(registration_token)))
        }
        other => Err(format!(
            "fleet {}: provider {other} is built in its own crate (gpuci-aws, gpuci-kube): ask the coordinator's provider_for",
            fleet.name
        )),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn machine_tokens_are_redacted_wherever_they_stand() {
        let t = "gpuci_mreg.m-3f2a.0123456789abcdef";
        assert_eq!(
            super::redact_machine_tokens(&format!("echo {t}; TOKEN={t}\n{t}")),
            "echo [registration token]; TOKEN=[registration token]\n[registration token]"
        );
        assert_eq!(super::redact_machine_tokens("nothing here"), "nothing here");
        assert_eq!(super::redact_machine_tokens("gpuci_mreg."), "[registration token]");
    }
}
