//! The `kubernetes` provider: a machine is a Pod that runs `gpuci agent --allocation
//! kubernetes`, with `nvidia.com/gpu` limits, node selector, tolerations, runtime class,
//! service account, image and resources from the fleet (docs/providers/kubernetes.md). The
//! cluster decides where and which GPUs (the NVIDIA device plugin); gpuci asks and gives back.
//! Nothing here schedules, scales nodes or watches anything but its own pods.
//!
//! - `create`: the Pod `gpuci-<machine>` (labels name the coordinator, fleet and machine), then
//!   a Secret `gpuci-<machine>-token` owned by it, holding the machine's one-time registration
//!   token; the agent reads it through `secretKeyRef` (never in the pod spec, which anyone who
//!   may read pods can see). Idempotent by machine id: an existing pod of ours is answered.
//! - `list`: answered from a watch of this fleet's pods (a reflector: list once, then watch
//!   events; re-listed by the watcher when the server says the watch is too old). A watch
//!   that is failing makes `list` fail, rather than answer a stale view.
//! - Pending pods carry the scheduler's words (`Unschedulable: 0/5 nodes are available: …`)
//!   or the kubelet's (`ErrImagePull`) into [`ProviderMachine::note`]; a pod evicted or lost
//!   with its node ends with its reason, and the coordinator queues its jobs again once.
//! - `delete`: the pod (with its grace period: the agent's SIGTERM hands back its jobs) and
//!   its secret (which the cluster's garbage collector also removes with its owner pod).
//!   Pods of ours that ended (evicted, failed) are deleted once the coordinator has seen them.
//! - A pod is ours by its labels *and* its name (`gpuci-<machine>`): a pod someone else made
//!   with our labels is never taken for a machine.
//!
//! The pods get no Kubernetes credentials (`automountServiceAccountToken: false`) and no
//! service links: a job in them must not reach the API as anybody.

use async_trait::async_trait;
use futures::StreamExt;
use gpuci_core::fleet::{Capacity, CapacityPolicy, FleetSpec};
use gpuci_providers::{
    CreateRequest, ErrorKind, Provider, ProviderError, ProviderMachine, ProviderResult, ProviderState,
};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::OnceCell;

/// Label keys on everything gpuci makes (values are the coordinator's id, fleet, machine).
pub const LABEL_COORDINATOR: &str = "gpuci.dev/coordinator";
pub const LABEL_FLEET: &str = "gpuci.dev/fleet";
pub const LABEL_MACHINE: &str = "gpuci.dev/machine";
const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";

/// How long one watch request lasts at the server (then the watcher watches again).
const WATCH_TIMEOUT_S: u32 = 55;
/// Silence on a connection past this is an error (the server sends bookmarks, and ends each
/// watch within [`WATCH_TIMEOUT_S`]).
const READ_TIMEOUT: Duration = Duration::from_secs(75);

/// The fleet's settings, checked.
#[derive(Clone, Debug)]
struct Settings {
    namespace: String,
    image: String,
    image_pull_policy: Option<String>,
    image_pull_secrets: Vec<String>,
    service_account: Option<String>,
    node_selector: BTreeMap<String, String>,
    tolerations: Vec<serde_json::Value>,
    runtime_class: Option<String>,
    priority_class: Option<String>,
    cpu: String,
    memory: String,
    sandbox: PodSandbox,
    /// `ephemeral-storage` request and limit: the pod's disk, the job's disk quota in a pod.
    ephemeral_storage: Option<String>,
    /// More extended resources in the container's limits, e.g. `squat.ai/tun = 1` for a
    /// device plugin that hands out `/dev/net/tun`.
    device_resources: BTreeMap<String, String>,
    termination_grace_s: i64,
    agent_data_dir: String,
    kubeconfig: Option<String>,
    context: Option<String>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

const KNOWN: &[&str] = &[
    "server",
    "agent_program",
    "agent_args",
    "leave_after_unreachable",
    "on_leave",
    "namespace",
    "image",
    "image_pull_policy",
    "image_pull_secrets",
    "service_account",
    "node_selector",
    "tolerations",
    "runtime_class",
    "priority_class",
    "cpu",
    "memory",
    "privileged",
    "sandbox",
    "ephemeral_storage",
    "device_resources",
    "termination_grace_period",
    "agent_data_dir",
    "kubeconfig",
    "context",
    "labels",
    "annotations",
];

/// What the agent's container is given so that gpuci's job sandbox can work inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodSandbox {
    /// The default: the pod in a user namespace of its own (`hostUsers: false`), `/proc`
    /// unmasked (`procMount: Unmasked`, allowed only with that), `CAP_SYS_ADMIN` added (it
    /// holds only over the pod's own namespaces; the `RuntimeDefault` seccomp profile lets
    /// user namespaces be made only with it) and AppArmor unconfined (runtimes' default
    /// profiles deny mounts, which bubblewrap makes in the job's namespaces). Needs
    /// Kubernetes 1.33 or later (user namespaces on by default) on a runtime that supports
    /// them (containerd 2.0, CRI-O 1.25) and Linux 6.3 or later.
    UserNamespace,
    /// `privileged: true`: every capability and device of the node, the node's cgroup tree.
    Privileged,
    /// Nothing added: the container as the runtime makes it. Its masked `/proc` stops every
    /// job sandbox: the agent then takes no jobs and says why.
    Container,
}

impl PodSandbox {
    fn parse(s: &str) -> Option<PodSandbox> {
        match s {
            "user-namespace" => Some(Self::UserNamespace),
            "privileged" => Some(Self::Privileged),
            "container" => Some(Self::Container),
            _ => None,
        }
    }
}

/// Whether `s` is a DNS-1123 label (namespaces, runtime classes, secret names' parts).
fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Whether `s` is a valid label value (empty allowed).
fn label_value(s: &str) -> bool {
    s.len() <= 63
        && (s.is_empty()
            || (s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
                && s.as_bytes()[0].is_ascii_alphanumeric()
                && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()))
}

fn string_map(fleet: &FleetSpec, key: &str) -> Result<BTreeMap<String, String>, String> {
    match fleet.settings.get(key) {
        None => Ok(BTreeMap::new()),
        Some(toml::Value::Table(t)) => t
            .iter()
            .map(|(k, v)| match v {
                toml::Value::String(s) => Ok((k.clone(), s.clone())),
                other => Err(format!("{key}.{k}: expected a string, got {other}")),
            })
            .collect(),
        Some(v) => Err(format!("{key}: expected a table of strings, got {v}")),
    }
}

fn string(fleet: &FleetSpec, key: &str) -> Result<Option<String>, String> {
    match fleet.settings.get(key) {
        None => Ok(None),
        Some(toml::Value::String(s)) if !s.trim().is_empty() => Ok(Some(s.trim().to_string())),
        Some(v) => Err(format!("{key}: expected a non-empty string, got {v}")),
    }
}

impl Settings {
    fn parse(fleet: &FleetSpec) -> Result<Settings, String> {
        for key in fleet.settings.keys() {
            if !KNOWN.contains(&key.as_str()) {
                return Err(format!(
                    "{key}: not a setting of the kubernetes provider (see docs/providers/kubernetes.md)"
                ));
            }
        }
        let namespace = string(fleet, "namespace")?.unwrap_or_else(|| "gpuci-runners".into());
        if !dns_label(&namespace) {
            return Err(format!("namespace: {namespace:?} is not a namespace name"));
        }
        let image = string(fleet, "image")?.ok_or("image: give the agent's container image (with gpuci in it)")?;
        let image_pull_policy = string(fleet, "image_pull_policy")?;
        if let Some(p) = &image_pull_policy {
            if !matches!(p.as_str(), "Always" | "IfNotPresent" | "Never") {
                return Err(format!("image_pull_policy: {p:?}: expected Always, IfNotPresent or Never"));
            }
        }
        let image_pull_secrets = match fleet.settings.get("image_pull_secrets") {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(|s| s.as_str().map(String::from)).collect::<Option<Vec<_>>>())
                .ok_or("image_pull_secrets: expected a list of secret names")?,
        };
        let tolerations = match fleet.settings.get("tolerations") {
            None => Vec::new(),
            Some(toml::Value::Array(a)) => {
                let mut out = Vec::new();
                for (i, t) in a.iter().enumerate() {
                    let t = t.as_table().ok_or(format!("tolerations[{i}]: expected a table"))?;
                    let mut v = serde_json::Map::new();
                    for (k, val) in t {
                        let json = match (k.as_str(), val) {
                            ("key" | "value" | "operator" | "effect", toml::Value::String(s)) => json!(s),
                            ("toleration_seconds", toml::Value::Integer(n)) => json!(n),
                            _ => {
                                return Err(format!(
                                    "tolerations[{i}].{k}: expected key, operator, value, effect (strings) or toleration_seconds"
                                ))
                            }
                        };
                        let name = if k == "toleration_seconds" { "tolerationSeconds" } else { k.as_str() };
                        v.insert(name.to_string(), json);
                    }
                    if let Some(op) = v.get("operator").and_then(|o| o.as_str()) {
                        if !matches!(op, "Exists" | "Equal") {
                            return Err(format!("tolerations[{i}].operator: {op:?}: expected Exists or Equal"));
                        }
                    }
                    if let Some(e) = v.get("effect").and_then(|o| o.as_str()) {
                        if !matches!(e, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
                            return Err(format!(
                                "tolerations[{i}].effect: {e:?}: expected NoSchedule, PreferNoSchedule or NoExecute"
                            ));
                        }
                    }
                    out.push(serde_json::Value::Object(v));
                }
                out
            }
            Some(v) => return Err(format!("tolerations: expected a list of tables, got {v}")),
        };
        let labels = string_map(fleet, "labels")?;
        for (k, v) in &labels {
            if k.starts_with("gpuci.dev/") || !label_value(v) {
                return Err(format!("labels.{k}: gpuci.dev/ labels are gpuci's, and values are label values"));
            }
        }
        let m = &fleet.machine;
        let termination_grace_s = match string(fleet, "termination_grace_period")? {
            None => 30,
            Some(t) => t
                .parse::<gpuci_core::duration::Duration>()
                .map_err(|e| format!("termination_grace_period: {e}"))?
                .as_std()
                .as_secs() as i64,
        };
        if termination_grace_s < 5 {
            return Err("termination_grace_period: give the agent at least 5s to hand its jobs back".into());
        }
        let privileged = match fleet.settings.get("privileged") {
            None => None,
            Some(toml::Value::Boolean(b)) => Some(*b),
            Some(v) => return Err(format!("privileged: expected true or false, got {v}")),
        };
        let sandbox = match (string(fleet, "sandbox")?, privileged) {
            (None, None | Some(false)) => PodSandbox::UserNamespace,
            (None, Some(true)) => PodSandbox::Privileged,
            (Some(v), p) => {
                let mode = PodSandbox::parse(&v).ok_or_else(|| {
                    format!(
                        "sandbox: {v:?}: expected \"user-namespace\" (the default), \"privileged\" or \"container\""
                    )
                })?;
                if p.is_some_and(|p| p != (mode == PodSandbox::Privileged)) {
                    return Err(format!(
                        "privileged = {} contradicts sandbox = {v:?}: give one of them",
                        p.unwrap_or(false)
                    ));
                }
                mode
            }
        };
        let device_resources = string_map(fleet, "device_resources")?;
        for (k, v) in &device_resources {
            if !k.contains('/') || k.starts_with("kubernetes.io/") || v.parse::<u32>().is_err() {
                return Err(format!(
                    "device_resources.{k} = {v:?}: expected an extended resource (a name with a domain, e.g. \"squat.ai/tun\") and a whole number"
                ));
            }
        }

        Ok(Settings {
            namespace,
            image,
            image_pull_policy,
            image_pull_secrets,
            service_account: string(fleet, "service_account")?,
            node_selector: string_map(fleet, "node_selector")?,
            tolerations,
            runtime_class: string(fleet, "runtime_class")?,
            priority_class: string(fleet, "priority_class")?,
            cpu: string(fleet, "cpu")?.unwrap_or_else(|| m.cpus.max(1).to_string()),
            memory: string(fleet, "memory")?.unwrap_or_else(|| format!("{}Mi", (m.memory.0 >> 20).max(64))),
            sandbox,
            ephemeral_storage: string(fleet, "ephemeral_storage")?,
            device_resources,
            termination_grace_s,
            agent_data_dir: string(fleet, "agent_data_dir")?.unwrap_or_else(|| "/var/lib/gpuci-agent".into()),
            kubeconfig: string(fleet, "kubeconfig")?,
            context: string(fleet, "context")?,
            labels,
            annotations: string_map(fleet, "annotations")?,
        })
    }
}

/// What the watch of this fleet's pods last said.
#[derive(Default)]
struct WatchHealth {
    /// The last error, while the watch is failing.
    failing: Option<String>,
}

/// The client and the reflector of this fleet's pods, made at the first call (reading the
/// kubeconfig or the in-cluster account is async).
struct Connected {
    client: kube::Client,
    pods: Store<Pod>,
    health: Arc<Mutex<WatchHealth>>,
    watch: tokio::task::JoinHandle<()>,
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

pub struct KubeProvider {
    fleet: String,
    coordinator: String,
    machine_gpus: u32,
    capacity: Capacity,
    time_limit_s: Option<u64>,
    settings: Settings,
    /// The fleet's (one) offer, so an adopted pod is billed at its price.
    offer: (String, String),
    connected: OnceCell<Connected>,
    /// Secrets are swept at most this often.
    last_sweep: Mutex<Option<std::time::Instant>>,
}

impl std::fmt::Debug for KubeProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeProvider").field("fleet", &self.fleet).field("namespace", &self.settings.namespace).finish()
    }
}

fn err(kind: ErrorKind, message: impl Into<String>) -> ProviderError {
    ProviderError::new(kind, message)
}

/// What kind of failure an API Status (`code`, `reason`, `message`) is. A refusal that the
/// next pass would get again (a RuntimeClass the cluster lacks, Pod Security or an admission
/// webhook denying the pod, a ResourceQuota) must back the fleet off, not make a create
/// every pass: those are [`ErrorKind::Refused`] or [`ErrorKind::Quota`].
fn kind_of_status(code: u16, reason: &str, message: &str) -> ErrorKind {
    let m = message.to_ascii_lowercase();
    match code {
        403 | 422 if m.contains("exceeded quota") || m.contains("forbidden: exceeded quota") => ErrorKind::Quota,
        // `pod rejected: RuntimeClass "nvidia" not found` (the RuntimeClass admission
        // plugin), or a runtime class field refused by validation.
        400 | 403 | 422 if m.contains("runtimeclass") => ErrorKind::Refused,
        // Pod Security admission (`violates PodSecurity "restricted:latest": …`), a
        // validating webhook (`admission webhook "x" denied the request: …`), or a
        // ValidatingAdmissionPolicy (`… denied request: …`).
        403 if m.contains("violates podsecurity")
            || m.contains("admission webhook")
            || m.contains("denied request")
            || m.contains("denied the request") =>
        {
            ErrorKind::Refused
        }
        404 => ErrorKind::NotFound,
        400 | 401 | 403 | 422 => ErrorKind::Invalid,
        409 => ErrorKind::Transient,
        _ if reason == "Forbidden" && m.contains("exceeded quota") => ErrorKind::Quota,
        _ => ErrorKind::Transient,
    }
}

/// What kind of failure an API error is.
fn api_error(what: &str, e: kube::Error) -> ProviderError {
    match &e {
        kube::Error::Api(s) => err(
            kind_of_status(s.code, &s.reason, &s.message),
            format!("{what}: {} ({} {})", s.message, s.code, s.reason),
        ),
        other => err(ErrorKind::Transient, format!("{what}: {other}")),
    }
}

/// Whether a waiting container's state (`reason`, `message`) is one the kubelet will not get
/// past by itself: an image that cannot be pulled, or a runtime handler the node lacks. Such a
/// pod is ended (a boot failure: its offer is skipped for a while) rather than left waiting.
/// A missing secret (`CreateContainerConfigError` otherwise) is not: the token secret is made
/// just after the pod.
fn waiting_is_refusal(reason: &str, message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    match reason {
        "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" => true,
        "RunContainerError" | "CreateContainerConfigError" | "CreateContainerError" => {
            m.contains("runtime handler") || m.contains("runtimeclass") || m.contains("no runtime for")
        }
        _ => false,
    }
}

impl KubeProvider {
    pub fn from_settings(fleet: &FleetSpec, coordinator: &str) -> Result<KubeProvider, String> {
        let settings = Settings::parse(fleet).map_err(|e| format!("fleet {}: [fleet.settings] {e}", fleet.name))?;
        if !label_value(&fleet.name) || !label_value(coordinator) {
            return Err(format!(
                "fleet {}: a kubernetes fleet's name must be a label value (letters, digits, - _ .; at most 63)",
                fleet.name
            ));
        }
        if fleet.idle_action == gpuci_core::fleet::IdleAction::Stop {
            return Err(format!(
                "fleet {}: idle_action = \"stop\": a pod cannot be stopped and started; use delete",
                fleet.name
            ));
        }
        if let Some(args) = fleet.settings.get("agent_args").and_then(|a| a.as_array()) {
            for w in args.iter().filter_map(|w| w.as_str()) {
                let name = w.split('=').next().unwrap_or("");
                if matches!(name, "--gpus" | "--data-dir" | "--allocation" | "--ends-in") {
                    return Err(format!(
                        "fleet {}: [fleet.settings] agent_args: {w:?}: the kubernetes provider gives the agent its GPUs (the device plugin's grant), data dir and end",
                        fleet.name
                    ));
                }
            }
        }
        Ok(KubeProvider {
            fleet: fleet.name.clone(),
            coordinator: coordinator.to_string(),
            machine_gpus: fleet.machine.gpus,
            capacity: if fleet.capacity == CapacityPolicy::Spot { Capacity::Spot } else { Capacity::OnDemand },
            time_limit_s: fleet.machine.time_limit_s,
            settings,
            offer: fleet.offers.first().map(|o| (o.instance_type.clone(), o.zone.clone())).unwrap_or_default(),
            connected: OnceCell::new(),
            last_sweep: Mutex::new(None),
        })
    }

    fn selector(&self) -> String {
        format!("{LABEL_COORDINATOR}={},{LABEL_FLEET}={}", self.coordinator, self.fleet)
    }

    fn pod_name(machine: &str) -> String {
        format!("gpuci-{}", machine.to_ascii_lowercase())
    }

    async fn client_config(&self) -> ProviderResult<kube::Config> {
        let options = kube::config::KubeConfigOptions { context: self.settings.context.clone(), ..Default::default() };
        match &self.settings.kubeconfig {
            Some(path) => {
                let kc = kube::config::Kubeconfig::read_from(path)
                    .map_err(|e| err(ErrorKind::Invalid, format!("kubeconfig {path}: {e}")))?;
                kube::Config::from_custom_kubeconfig(kc, &options)
                    .await
                    .map_err(|e| err(ErrorKind::Invalid, format!("kubeconfig {path}: {e}")))
            }
            None if self.settings.context.is_some() => kube::Config::from_kubeconfig(&options)
                .await
                .map_err(|e| err(ErrorKind::Invalid, format!("kubeconfig: {e}"))),
            // $KUBECONFIG or ~/.kube/config, else the in-cluster service account.
            None => kube::Config::infer()
                .await
                .map_err(|e| err(ErrorKind::Invalid, format!("no Kubernetes credentials: {e}"))),
        }
    }

    async fn connected(&self) -> ProviderResult<&Connected> {
        self.connected
            .get_or_try_init(|| async {
                let mut config = self.client_config().await?;
                // A watch that goes silent (a load balancer that black-holes an idle stream)
                // must fail, not hang: the server ends each watch within WATCH_TIMEOUT_S and
                // sends bookmarks meanwhile, so silence past READ_TIMEOUT is an error.
                config.read_timeout = Some(READ_TIMEOUT);
                let client = kube::Client::try_from(config)
                    .map_err(|e| err(ErrorKind::Invalid, format!("Kubernetes client: {e}")))?;
                let api: Api<Pod> = Api::namespaced(client.clone(), &self.settings.namespace);
                let (store, writer) = reflector::store();
                let health = Arc::new(Mutex::new(WatchHealth::default()));
                let stream = reflector::reflector(
                    writer,
                    watcher(api, watcher::Config::default().labels(&self.selector()).timeout(WATCH_TIMEOUT_S))
                        .default_backoff(),
                );
                let h = health.clone();
                let fleet = self.fleet.clone();
                let watch = tokio::spawn(async move {
                    futures::pin_mut!(stream);
                    while let Some(ev) = stream.next().await {
                        let mut h = h.lock().unwrap_or_else(|e| e.into_inner());
                        match ev {
                            // A re-list in progress is not yet a working view.
                            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                            Ok(_) => {
                                if h.failing.take().is_some() {
                                    tracing::info!(fleet = %fleet, "watch of the fleet's pods works again");
                                }
                            }
                            Err(e) => {
                                if h.failing.is_none() {
                                    tracing::warn!(fleet = %fleet, error = %e, "watch of the fleet's pods failing");
                                }
                                h.failing = Some(e.to_string());
                            }
                        }
                    }
                });
                Ok(Connected { client, pods: store, health, watch })
            })
            .await
    }

    fn listed(&self, pod: &Pod) -> Option<ProviderMachine> {
        let labels = pod.metadata.labels.as_ref()?;
        if labels.get(LABEL_COORDINATOR)? != &self.coordinator || labels.get(LABEL_FLEET)? != &self.fleet {
            return None;
        }
        let machine = labels.get(LABEL_MACHINE)?.clone();
        // Labels anyone may set; the name is the one gpuci gave it (a pod of another name
        // with our labels is not a machine of ours, and must not decide one's fate).
        if pod.metadata.name.as_deref() != Some(Self::pod_name(&machine).as_str()) {
            return None;
        }
        let (state, note) = pod_state(pod);
        Some(ProviderMachine {
            machine,
            provider_id: pod.metadata.name.clone().unwrap_or_default(),
            state,
            instance_type: self.offer.0.clone(),
            zone: self.offer.1.clone(),
            capacity: self.capacity,
            launched_at: pod.metadata.creation_timestamp.as_ref().map(|t| t.0.as_second().max(0) as u64),
            note,
        })
    }

    fn pod(&self, req: &CreateRequest) -> ProviderResult<Pod> {
        let s = &self.settings;
        let name = Self::pod_name(&req.machine);
        let mut labels = s.labels.clone();
        labels.insert(LABEL_MANAGED_BY.into(), "gpuci".into());
        labels.insert(LABEL_COORDINATOR.into(), self.coordinator.clone());
        labels.insert(LABEL_FLEET.into(), self.fleet.clone());
        labels.insert(LABEL_MACHINE.into(), req.machine.clone());
        let mut args: Vec<String> = req.agent.command();
        args.extend(["--allocation".into(), "kubernetes".into(), "--data-dir".into(), s.agent_data_dir.clone()]);
        // A grant of another size (the device plugin's CDI strategy sets no variable) is the
        // agent's error at start, not an agent that serves no GPU and takes nothing.
        args.extend(["--expect-gpus".into(), self.machine_gpus.to_string()]);
        if let Some(t) = self.time_limit_s {
            args.extend(["--ends-in".into(), format!("{t}s")]);
        }
        // A pod has no loop devices for a disk per slot: its own ephemeral storage (with
        // `ephemeral_storage` set, evicted by the kubelet past it) is its one job's disk; and
        // its cgroup tree is not the agent's to write, so the container's limits bind its one
        // job (the agent says both at start and in each job's log). The operator's own
        // `agent_args` win.
        if s.sandbox != PodSandbox::Privileged {
            let named = |flag: &str| req.agent.extra_args.iter().any(|a| a.split('=').next() == Some(flag));
            if !named("--job-disk") {
                args.extend(["--job-disk".into(), "none".into()]);
            }
            if !named("--slots") {
                args.extend(["--slots".into(), "1".into()]);
            }
        }
        // The pod's own `$(VAR)` expansion would rewrite an argument that holds one; `$$` is
        // a literal `$` to the kubelet.
        let args: Vec<String> = args.into_iter().map(|a| a.replace('$', "$$")).collect();
        let mut limits = serde_json::Map::new();
        limits.insert("cpu".into(), json!(s.cpu));
        limits.insert("memory".into(), json!(s.memory));
        if self.machine_gpus > 0 {
            limits.insert("nvidia.com/gpu".into(), json!(self.machine_gpus.to_string()));
        }
        for (k, v) in &s.device_resources {
            limits.insert(k.clone(), json!(v));
        }
        let mut requests = serde_json::Map::new();
        requests.insert("cpu".into(), json!(s.cpu));
        requests.insert("memory".into(), json!(s.memory));
        if let Some(e) = &s.ephemeral_storage {
            limits.insert("ephemeral-storage".into(), json!(e));
            requests.insert("ephemeral-storage".into(), json!(e));
        }
        let uses_data_volume = s.agent_data_dir.starts_with('/');
        let mut container = json!({
            "name": "agent",
            "image": s.image,
            "command": [args[0]],
            "args": &args[1..],
            "env": [
                {"name": "GPUCI_REGISTRATION_TOKEN",
                 "valueFrom": {"secretKeyRef": {"name": format!("{name}-token"), "key": "token"}}},
                {"name": "GPUCI_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ],
            "resources": {"limits": limits, "requests": requests},
            // An agent that cannot start says why on stderr; the kubelet keeps that tail as the
            // container's termination message, and the fleet shows it.
            "terminationMessagePolicy": "FallbackToLogsOnError",
        });
        if let (Some(k), Some(env)) = (&req.agent.coordinator_key, container["env"].as_array_mut()) {
            env.push(json!({"name": "GPUCI_COORDINATOR_KEY", "value": k}));
        }
        if let Some(p) = &s.image_pull_policy {
            container["imagePullPolicy"] = json!(p);
        }
        match s.sandbox {
            PodSandbox::Privileged => container["securityContext"] = json!({"privileged": true}),
            PodSandbox::UserNamespace => {
                container["securityContext"] = json!({
                    "procMount": "Unmasked",
                    "capabilities": {"add": ["SYS_ADMIN"]},
                    "seccompProfile": {"type": "RuntimeDefault"},
                    "appArmorProfile": {"type": "Unconfined"},
                })
            }
            PodSandbox::Container => {}
        }
        if uses_data_volume {
            container["volumeMounts"] = json!([{"name": "agent-data", "mountPath": s.agent_data_dir}]);
        }
        let mut spec = json!({
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": s.termination_grace_s,
            "containers": [container],
        });
        if uses_data_volume {
            spec["volumes"] = json!([{"name": "agent-data", "emptyDir": match &s.ephemeral_storage {
                Some(e) => json!({"sizeLimit": e}),
                None => json!({}),
            }}]);
        }
        if s.sandbox == PodSandbox::UserNamespace {
            spec["hostUsers"] = json!(false);
        }
        if let Some(sa) = &s.service_account {
            spec["serviceAccountName"] = json!(sa);
        }
        if !s.node_selector.is_empty() {
            spec["nodeSelector"] = json!(s.node_selector);
        }
        if !s.tolerations.is_empty() {
            spec["tolerations"] = json!(s.tolerations);
        }
        if let Some(rc) = &s.runtime_class {
            spec["runtimeClassName"] = json!(rc);
        }
        if let Some(pc) = &s.priority_class {
            spec["priorityClassName"] = json!(pc);
        }
        if !s.image_pull_secrets.is_empty() {
            spec["imagePullSecrets"] =
                json!(s.image_pull_secrets.iter().map(|n| json!({"name": n})).collect::<Vec<_>>());
        }
        if let Some(t) = self.time_limit_s {
            // A backstop past the agent's own end (`--ends-in`), which leaves idle before:
            // the deadline counts from the pod's start, before its image is pulled.
            spec["activeDeadlineSeconds"] = json!(t + 600);
        }
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "annotations": s.annotations},
            "spec": spec,
        });
        serde_json::from_value(pod).map_err(|e| err(ErrorKind::Invalid, format!("building the pod: {e}")))
    }

    /// Delete this fleet's pods that have ended (evicted, failed, lost with their node): their
    /// machines are ended already, and nothing else would remove them. At most once a minute,
    /// so the coordinator has seen each as ended first. Their token secrets go with them
    /// (owned by the pod: the cluster's garbage collector deletes them).
    async fn sweep_ended(&self, c: &Connected) {
        {
            let mut last = self.last_sweep.lock().unwrap_or_else(|e| e.into_inner());
            match *last {
                None => {
                    *last = Some(std::time::Instant::now());
                    return;
                }
                Some(t) if t.elapsed() < Duration::from_secs(60) => return,
                Some(_) => *last = Some(std::time::Instant::now()),
            }
        }
        let pods: Api<Pod> = Api::namespaced(c.client.clone(), &self.settings.namespace);
        for pod in c.pods.state() {
            let Some(m) = self.listed(&pod) else { continue };
            if m.state == ProviderState::Terminated && pod.metadata.deletion_timestamp.is_none() {
                tracing::info!(fleet = %self.fleet, pod = %m.provider_id, "deleting a pod that has ended");
                let _ = pods.delete(&m.provider_id, &DeleteParams::default()).await;
            }
        }
    }
}

/// A pod's state as a machine's, and what to tell people about it.
fn pod_state(pod: &Pod) -> (ProviderState, Option<String>) {
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    if pod.metadata.deletion_timestamp.is_some() && phase != "Failed" && phase != "Succeeded" {
        return (ProviderState::Stopping, Some(format!("pod {name} is being deleted")));
    }
    match phase {
        "Running" => (ProviderState::Running, None),
        "Succeeded" | "Failed" => {
            let why = status
                .and_then(|s| s.reason.clone().map(|r| (r, s.message.clone().unwrap_or_default())))
                .map(|(r, m)| format!("{r}: {}", m.trim()))
                .or_else(|| {
                    let c = status?.container_statuses.as_ref()?.first()?;
                    let t = c.state.as_ref()?.terminated.as_ref()?;
                    // The agent's last words (`terminationMessagePolicy: FallbackToLogsOnError`:
                    // the kubelet keeps the log's tail): why it could not start, say.
                    let said = t
                        .message
                        .as_deref()
                        .and_then(|m| m.lines().map(str::trim).rfind(|l| !l.is_empty()))
                        .map(|l| format!(": {}", l.chars().take(600).collect::<String>()))
                        .unwrap_or_default();
                    Some(format!("{} (exit code {}){said}", t.reason.clone().unwrap_or_default(), t.exit_code))
                })
                .unwrap_or_else(|| phase.to_string());
            (ProviderState::Terminated, Some(format!("pod {name} {}: {why}", phase.to_lowercase())))
        }
        _ => {
            // Why it waits: the scheduler's condition, else the kubelet's container state.
            let unscheduled = status.and_then(|s| s.conditions.as_ref()).and_then(|cs| {
                cs.iter().find(|c| c.type_ == "PodScheduled" && c.status == "False").map(|c| {
                    format!(
                        "pod {name} pending: {}: {}",
                        c.reason.clone().unwrap_or_default(),
                        c.message.clone().unwrap_or_default().trim()
                    )
                })
            });
            let waiting = || {
                let c = status?.container_statuses.as_ref()?.first()?;
                let w = c.state.as_ref()?.waiting.as_ref()?;
                let reason = w.reason.clone().unwrap_or_default();
                let message = w.message.clone().unwrap_or_default();
                let refused = waiting_is_refusal(&reason, &message);
                let state = if refused { "refused" } else { "pending" };
                Some((
                    refused,
                    match message.trim() {
                        "" => format!("pod {name} {state}: {reason}"),
                        m => format!("pod {name} {state}: {reason}: {m}"),
                    },
                ))
            };
            match (unscheduled, waiting()) {
                (Some(u), _) => (ProviderState::Pending, Some(u)),
                (None, Some((true, why))) => (ProviderState::Terminated, Some(why)),
                (None, w) => (ProviderState::Pending, w.map(|(_, why)| why)),
            }
        }
    }
}

#[async_trait]
impl Provider for KubeProvider {
    fn can_stop(&self) -> bool {
        false
    }

    async fn create(&self, req: &CreateRequest) -> ProviderResult<ProviderMachine> {
        let c = self.connected().await?;
        let pods: Api<Pod> = Api::namespaced(c.client.clone(), &self.settings.namespace);
        let secrets: Api<Secret> = Api::namespaced(c.client.clone(), &self.settings.namespace);
        let name = Self::pod_name(&req.machine);
        let pod = match pods.create(&PostParams::default(), &self.pod(req)?).await {
            Ok(p) => p,
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let existing = pods.get(&name).await.map_err(|e| api_error(&format!("reading pod {name}"), e))?;
                return match self.listed(&existing) {
                    Some(m) if m.machine == req.machine => Ok(m),
                    _ => Err(err(ErrorKind::Invalid, format!("pod {name} exists and is not this fleet's machine"))),
                };
            }
            Err(e) => return Err(api_error(&format!("creating pod {name}"), e)),
        };
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: name.clone(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            ..Default::default()
        };
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(format!("{name}-token")),
                labels: pod.metadata.labels.clone(),
                owner_references: Some(vec![owner]),
                ..Default::default()
            },
            string_data: Some(BTreeMap::from([("token".to_string(), req.agent.registration_token.clone())])),
            type_: Some("Opaque".into()),
            ..Default::default()
        };
        match secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => {
                // The pod would wait for its token forever: take it back now.
                let _ = pods.delete(&name, &DeleteParams::default().grace_period(0)).await;
                return Err(api_error(&format!("creating secret {name}-token"), e));
            }
        }
        tracing::info!(fleet = %self.fleet, machine = %req.machine, pod = %name, "pod created");
        self.listed(&pod).ok_or_else(|| err(ErrorKind::Invalid, "the created pod lacks gpuci's labels"))
    }

    async fn list(&self) -> ProviderResult<Vec<ProviderMachine>> {
        let c = self.connected().await?;
        if let Some(e) = c.health.lock().unwrap_or_else(|e| e.into_inner()).failing.clone() {
            return Err(err(ErrorKind::Transient, format!("the watch of this fleet's pods is failing: {e}")));
        }
        if tokio::time::timeout(Duration::from_secs(10), c.pods.wait_until_ready()).await.is_err() {
            return Err(err(ErrorKind::Transient, "the first list of this fleet's pods has not come yet"));
        }
        let machines: Vec<ProviderMachine> = c.pods.state().iter().filter_map(|p| self.listed(p)).collect();
        self.sweep_ended(c).await;
        Ok(machines)
    }

    async fn delete(&self, machine: &str) -> ProviderResult<()> {
        let c = self.connected().await?;
        let pods: Api<Pod> = Api::namespaced(c.client.clone(), &self.settings.namespace);
        let secrets: Api<Secret> = Api::namespaced(c.client.clone(), &self.settings.namespace);
        let name = Self::pod_name(machine);
        match pods.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(api_error(&format!("deleting pod {name}"), e)),
        }
        match secrets.delete(&format!("{name}-token"), &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(api_error(&format!("deleting secret {name}-token"), e)),
        }
    }

    async fn stop(&self, _machine: &str) -> ProviderResult<ProviderMachine> {
        Err(err(ErrorKind::Invalid, "a pod cannot be stopped"))
    }

    async fn start(&self, _machine: &str) -> ProviderResult<ProviderMachine> {
        Err(err(ErrorKind::Invalid, "a pod cannot be started again"))
    }
}

#[cfg(test)]
mod tests;
