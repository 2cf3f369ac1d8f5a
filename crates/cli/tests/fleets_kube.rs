//! The `kubernetes` provider end to end. No Kubernetes API server can run on these machines,
//! so the coordinator's kube-rs client talks to an API-shaped server of the project's own
//! (`crates/kube/testserver`): it follows the API's conventions (resourceVersion, label
//! selectors, watch streams, Status bodies), validates every object gpuci sends against the
//! official JSON schemas (the `kubernetes-validate` package), enforces the RBAC Role gpuci
//! ships (`deploy/kubernetes/base/rbac.yaml`), schedules pods onto simulated GPU nodes and runs
//! each pod's command as a local process — here a real `gpuci agent --allocation kubernetes`
//! with simulated GPUs whose UUIDs are the node's.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(120);
const TOKEN: &str = "test-cluster-token";
const NS: &str = "gpuci-runners";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The virtualenv with kubernetes-validate (scripts/test makes it).
fn python() -> Option<PathBuf> {
    let venv =
        std::env::var_os("GPUCI_KUBE_VENV").map_or_else(|| PathBuf::from("/var/tmp/gpuci-kube-venv"), PathBuf::from);
    let py = venv.join("bin/python");
    let ok = Command::new(&py).args(["-c", "import kubernetes_validate"]).output().is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI=true and no kubernetes-validate in {} (scripts/test installs it)", venv.display());
    }
    eprintln!("skipped: no kubernetes-validate in {}", venv.display());
    None
}

/// The simulated GPU UUIDs of node `name` (the agent's `--simulate-host`).
fn node_uuids(name: &str, n: u32) -> Vec<String> {
    (0..n).map(|i| gpuci_gpu::sim::simulated_uuid(name, i)).collect()
}

struct Cluster {
    child: Child,
    url: String,
    log_dir: PathBuf,
}

impl Cluster {
    /// The test API server with simulated `nodes`, and `extra` of its options (its README).
    fn start_args(dir: &Path, nodes: Value, extra: &[&str]) -> Cluster {
        let py = python().unwrap();
        std::fs::write(dir.join("nodes.json"), nodes.to_string()).unwrap();
        let log_dir = dir.join("kube");
        std::fs::create_dir_all(&log_dir).unwrap();
        let mut child = Command::new(py)
            .arg(repo().join("crates/kube/testserver/kube_api_server.py"))
            .args(["--port", "0", "--token", TOKEN, "--kubernetes-version", "1.30.0"])
            .arg("--nodes")
            .arg(dir.join("nodes.json"))
            .arg("--log-dir")
            .arg(&log_dir)
            .arg("--rbac")
            .arg(repo().join("deploy/kubernetes/base/rbac.yaml"))
            .args(["--rbac-user", "system:serviceaccount:gpuci:gpuci-coordinator"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("kube-server.log")).unwrap())
            .spawn()
            .unwrap();
        let mut first = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
        let addr = first.trim().strip_prefix("listening on ").unwrap_or_else(|| {
            panic!(
                "the test API server did not start: {first:?}\n{}",
                std::fs::read_to_string(dir.join("kube-server.log")).unwrap_or_default()
            )
        });
        let url = format!("http://{addr}");
        std::fs::write(
            dir.join("kubeconfig"),
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\nusers:\n- name: gpuci\n  user:\n    token: {TOKEN}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: gpuci\ncurrent-context: test\n"
            ),
        )
        .unwrap();
        Cluster { child, url, log_dir }
    }

    /// The test's own look at the cluster: not bound by the Role and not recorded as
    /// gpuci's (`X-Test-Inspect`).
    fn get(&self, path: &str) -> Value {
        reqwest::blocking::Client::new()
            .get(format!("{}{path}", self.url))
            .bearer_auth(TOKEN)
            .header("X-Test-Inspect", "1")
            .send()
            .and_then(|r| r.json())
            .unwrap_or(Value::Null)
    }

    fn post(&self, path: &str, body: Value) -> Value {
        reqwest::blocking::Client::new()
            .post(format!("{}{path}", self.url))
            .bearer_auth(TOKEN)
            .header("X-Test-Inspect", "1")
            .json(&body)
            .send()
            .and_then(|r| r.json())
            .unwrap_or(Value::Null)
    }

    fn delete(&self, path: &str) {
        let _ = reqwest::blocking::Client::new()
            .delete(format!("{}{path}", self.url))
            .bearer_auth(TOKEN)
            .header("X-Test-Inspect", "1")
            .send();
    }

    fn pods(&self) -> Vec<Value> {
        self.get(&format!("/api/v1/namespaces/{NS}/pods"))["items"].as_array().cloned().unwrap_or_default()
    }

    fn secrets(&self) -> Vec<Value> {
        self.get(&format!("/api/v1/namespaces/{NS}/secrets"))["items"].as_array().cloned().unwrap_or_default()
    }

    fn running_pod(&self) -> String {
        let pods = self.pods();
        let p = pods
            .iter()
            .find(|p| p["status"]["phase"] == "Running")
            .unwrap_or_else(|| panic!("no running pod: {pods:#?}"));
        p["metadata"]["name"].as_str().unwrap().to_string()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        for _ in 0..100 {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Fleet {
    dir: tempfile::TempDir,
    server: Server,
    cluster: Cluster,
}

/// One GPU node `gpu-a` (4 GPUs, tainted as GPU nodes are) and one CPU node; fleet `k8s` of
/// `gpus`-GPU pods.
fn start(gpus: u32) -> Option<Fleet> {
    start_with(gpus, "envvar-uuid")
}

/// As [`start`], with node `gpu-a`'s device plugin handing out GPUs as `device_plugin` says
/// (the test server's README: envvar-uuid, envvar-index, volume-mounts, cdi, gke, ...).
fn start_with(gpus: u32, device_plugin: &str) -> Option<Fleet> {
    start_with_cluster(gpus, device_plugin, &[])
}

/// As [`start_with`], the test API server started with `cluster_args` too.
fn start_with_cluster(gpus: u32, device_plugin: &str, cluster_args: &[&str]) -> Option<Fleet> {
    start_with_image(gpus, device_plugin, cluster_args, "gpuci:test")
}

/// As [`start_with_cluster`], the fleet's pods made of `image` (the test server fails to pull
/// one whose name contains `does-not-exist`).
fn start_with_image(gpus: u32, device_plugin: &str, cluster_args: &[&str], image: &str) -> Option<Fleet> {
    start_full(gpus, device_plugin, cluster_args, image, isolation(), "")
}

/// As [`start_with_image`], the agents started with `--isolation iso`, and more
/// `[fleet.settings]` lines.
fn start_full(
    gpus: u32,
    device_plugin: &str,
    cluster_args: &[&str],
    image: &str,
    iso: &str,
    settings: &str,
) -> Option<Fleet> {
    python()?;
    let dir = tempdir();
    let nodes = serde_json::json!([
        {"name": "gpu-a", "labels": {"nvidia.com/gpu.present": "true"},
         "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
         "gpus": 4, "gpu_uuids": node_uuids("gpu-a", 4), "cpu": "16", "memory": "64Gi",
         "device_plugin": device_plugin},
        {"name": "cpu-a", "gpus": 0, "cpu": "8", "memory": "32Gi"},
    ]);
    let cluster = Cluster::start_args(dir.path(), nodes, cluster_args);
    let config = dir.path().join("server.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[[fleet]]
name = "k8s"
provider = "kubernetes"
max = 2
idle_timeout = "3s"
boot_timeout = "90s"
[fleet.machine]
gpu_model = "NVIDIA L4"
gpus = {gpus}
gpu_memory = "22GiB"
cpus = 2
memory = "4GiB"
[[fleet.offer]]
instance_type = "pod"
price_per_hour = 0.8
[fleet.settings]
kubeconfig = "{kubeconfig}"
namespace = "{NS}"
image = "{image}"
service_account = "gpuci-runner"
node_selector = {{ "nvidia.com/gpu.present" = "true" }}
tolerations = [{{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }}]
runtime_class = "nvidia"
termination_grace_period = "10s"
agent_data_dir = "agent"
agent_program = "{bin}"
agent_args = ["--simulate-gpus", "4xL4", "--simulate-host", "gpu-a", "--slots", "1", "--isolation", "{iso}", "--terminate-grace", "8s"]
{settings}
"#,
            kubeconfig = dir.path().join("kubeconfig").display(),
            bin = BIN,
        ),
    )
    .unwrap();
    let server = Server::start_fleets(&dir.path().join("server"), &config, "300ms");
    Some(Fleet { dir, server, cluster })
}

impl Fleet {
    fn status(&self) -> Value {
        let fleets: Vec<Value> = self.server.api().get("/api/v1/fleets");
        fleets.into_iter().find(|f| f["name"] == "k8s").expect("fleet k8s")
    }

    fn explain(&self) -> String {
        let logs: Vec<String> = std::fs::read_dir(&self.cluster.log_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
            .map(|e| format!("--- {}\n{}", e.path().display(), std::fs::read_to_string(e.path()).unwrap_or_default()))
            .collect();
        let server = std::fs::read_to_string(self.dir.path().join("kube-server.log")).unwrap_or_default();
        let tail: Vec<&str> = server.lines().rev().take(40).collect();
        format!(
            "{:#}\n{}\n--- api server\n{}",
            self.status(),
            logs.join("\n"),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    fn wait_connected(&self) {
        wait_until_or(
            "the fleet saw its machines' agents connect",
            T,
            || {
                let m = self.status()["machines"].as_array().cloned().unwrap_or_default();
                !m.is_empty() && m.iter().all(|m| !m["connected_at_ms"].is_null())
            },
            || self.explain(),
        );
    }
}

/// From zero: two 1-GPU jobs make two pods, each validated by the official schemas and made
/// with only the verbs gpuci's Role grants; each agent serves exactly the GPU the device plugin
/// gave its pod (NVIDIA_VISIBLE_DEVICES), the pods carry no API credentials and the token is
/// not in their spec; idle, pods and their token secrets go away.
#[test]
fn pods_serve_the_device_plugins_gpus_and_go_away_when_idle() {
    let Some(f) = start(1) else { return };
    let api = f.server.api();
    let two = "steps:\n  - key: a\n    gpus: 1\n    command: echo on $GPUCI_GPUS && sleep 3\n  - key: b\n    gpus: 1\n    command: echo on $GPUCI_GPUS && sleep 3\n";
    let p = api.submit(two);
    wait_until_or("two agents connected", T, || api.agents().len() == 2, || f.explain());
    let pods = f.cluster.pods();
    assert_eq!(pods.len(), 2, "{pods:#?}");
    let mut granted: Vec<String> = Vec::new();
    for pod in &pods {
        let spec = &pod["spec"];
        assert_eq!(spec["automountServiceAccountToken"], false);
        assert_eq!(spec["nodeName"], "gpu-a");
        assert!(!pod.to_string().contains("gpuci_mreg."), "the registration token is not in the pod: {pod:#}");
        let gpus = pod["metadata"]["annotations"]["testserver.gpuci/gpus"].as_str().unwrap_or("").to_string();
        let agent = api
            .agents()
            .into_iter()
            .find(|a| a.gpus.iter().map(|g| g.info.uuid.clone()).collect::<Vec<_>>().join(",") == gpus)
            .unwrap_or_else(|| panic!("no agent serves exactly the pod's GPUs {gpus}: {:#?}", api.agents()));
        assert_eq!(agent.gpus.len(), 1);
        granted.push(gpus);
    }
    assert_ne!(granted[0], granted[1], "two pods, two GPUs");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());

    wait_until_or(
        "no pod and no token secret left once idle",
        T,
        || f.cluster.pods().is_empty() && f.cluster.secrets().is_empty(),
        || format!("{:#?}\n{:#?}\n{}", f.cluster.pods(), f.cluster.secrets(), f.explain()),
    );
    // Every call gpuci made was one its Role grants (the server enforced it), and it used
    // every verb the Role grants but the sweep's (least privilege, both ways).
    let requests = f.cluster.get("/_test/requests");
    let used: std::collections::BTreeSet<String> = requests
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["resource"] != Value::Null)
        .map(|r| format!("{} {} {}", r["resource"].as_str().unwrap_or(""), r["verb"].as_str().unwrap_or(""), r["code"]))
        .collect();
    assert!(used.iter().all(|u| !u.ends_with(" 403")), "a call the Role does not grant: {used:#?}");
    for want in ["pods create", "pods list", "pods watch", "pods delete", "secrets create", "secrets delete"] {
        assert!(used.iter().any(|u| u.starts_with(want)), "{want} never used: {used:#?}");
    }
}

/// However the device plugin shows the grant — indices in the variable, volume-mount files,
/// CDI-injected nodes with `void`, GKE's nodes with no variable — the job is leased exactly
/// the GPU the pod was given. Another tenant holds GPUs 0 and 1 first, so the pod's GPU is
/// neither the node's first nor index 0 of anything but the double's own numbering.
#[test]
fn every_device_plugin_mechanism_leases_exactly_the_pods_gpu() {
    for plugin in ["envvar-index", "volume-mounts", "cdi", "gke"] {
        let Some(f) = start_with(1, plugin) else { return };
        let other = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "other-tenant"},
            "spec": {"restartPolicy": "Never", "nodeSelector": {"nvidia.com/gpu.present": "true"},
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "x", "image": "busybox",
                                     "resources": {"limits": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "2"}}}]},
        });
        f.cluster.post(&format!("/api/v1/namespaces/{NS}/pods"), other);
        let api = f.server.api();
        let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo on $GPUCI_GPUS && sleep 2\n");
        let running = api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
        let ours = f.cluster.pods().into_iter().find(|p| p["metadata"]["name"] != "other-tenant").unwrap();
        let granted = ours["metadata"]["annotations"]["testserver.gpuci/gpus"].as_str().unwrap_or("").to_string();
        assert_eq!(granted, node_uuids("gpu-a", 4)[2], "{plugin}: the double gave the pod GPU 2");
        assert_eq!(running.gpus, vec![granted.clone()], "{plugin}: the job's lease\n{}", f.explain());
        let agents = api.agents();
        assert_eq!(agents.len(), 1, "{agents:#?}");
        let served: Vec<String> = agents[0].gpus.iter().map(|g| g.info.uuid.clone()).collect();
        assert_eq!(served, vec![granted], "{plugin}: the agent serves the pod's GPU only");
        let done = api.wait_pipeline(p.id, T);
        assert_eq!(done.state, "succeeded", "{plugin}: {done:#?}\n{}", f.explain());
    }
}

/// A pod the scheduler cannot place says why, in the scheduler's words, on the waiting job.
#[test]
fn an_unschedulable_pod_says_why_on_the_waiting_job() {
    let Some(f) = start(8) else { return };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 8\n    command: echo never\n");
    let j = api.wait_job(p.jobs[0].id, "waiting on the scheduler's reason", T, |j| j.reason.contains("Unschedulable"));
    assert!(j.reason.contains("Insufficient nvidia.com/gpu") && j.reason.contains("fleet k8s"), "{}", j.reason);
}

/// `runtime_class = "nvidia"` on a cluster without that RuntimeClass (no GPU Operator): the
/// API refuses the pod (403, the RuntimeClass admission plugin's words). The fleet backs off
/// instead of creating every pass, and the waiting job and `gpuci fleets` carry the API's message.
#[test]
fn a_missing_runtime_class_backs_the_fleet_off_with_the_apis_words() {
    let Some(f) = start_with_cluster(1, "envvar-uuid", &["--runtime-classes", "runc"]) else { return };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo never\n");
    let said = r#"RuntimeClass "nvidia" not found"#;
    let j = api.wait_job(p.jobs[0].id, "waiting with the API's refusal", T, |j| j.reason.contains(said));
    assert!(j.reason.contains("fleet k8s"), "{}", j.reason);
    // Ten fleet intervals (300ms) later: still the one create, and still the API's words.
    std::thread::sleep(Duration::from_secs(3));
    let requests: Vec<Value> = f.cluster.get("/_test/requests").as_array().cloned().unwrap_or_default();
    let creates = requests.iter().filter(|r| r["verb"] == "create" && r["resource"] == "pods").count();
    assert!(creates <= 1, "{creates} pod creates: {requests:#?}");
    assert!(f.cluster.pods().is_empty(), "{:#?}", f.cluster.pods());
    let j = api.job(p.jobs[0].id);
    assert!(j.reason.contains(said), "{}", j.reason);
    // (JSON text: the message's quotes are escaped there.)
    assert!(f.status().to_string().contains("pod rejected: RuntimeClass"), "{}", f.explain());
    // Said as the refusal it is, on the fleet and the job: not "a capacity error".
    let why = f.status()["why"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("the cluster refused the pod") && why.contains(said), "{}", f.explain());
    assert!(!why.contains("capacity error") && !j.reason.contains("capacity error"), "{why}\n{}", j.reason);
}

/// A pod the API accepts but whose container can never start: its image cannot be pulled
/// (`ErrImagePull`, then `ImagePullBackOff`, the kubelet's words). The fleet's condition in
/// `gpuci fleets` and the waiting job's reason carry the kubelet's message (not "a capacity
/// error"); the offer is skipped for a while instead of a pod made every pass; the pod, which
/// would hold its node's GPU while it backs off, is deleted.
#[test]
fn a_pod_whose_image_cannot_be_pulled_backs_the_fleet_off_with_the_kubelets_words() {
    let image = "registry.example/gpuci:does-not-exist";
    let Some(f) = start_with_image(1, "envvar-uuid", &[], image) else { return };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo never\n");
    // Either of the kubelet's two messages names the image.
    let j = api.wait_job(p.jobs[0].id, "waiting with the kubelet's words", T, |j| j.reason.contains(image));
    assert!(j.reason.contains("fleet k8s") && j.reason.contains("pull"), "{}", j.reason);
    assert!(!j.reason.contains("capacity error"), "{}", j.reason);
    let creates = || {
        let requests: Vec<Value> = f.cluster.get("/_test/requests").as_array().cloned().unwrap_or_default();
        requests.iter().filter(|r| r["verb"] == "create" && r["resource"] == "pods").count()
    };
    // Ten fleet intervals (300ms) later: still the one create, and still the kubelet's words.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(creates(), 1, "{}", f.explain());
    let j = api.job(p.jobs[0].id);
    assert_eq!(j.state, JobState::Queued, "{j:#?}");
    assert!(j.reason.contains(image), "{}", j.reason);
    let why = f.status()["why"].as_str().unwrap_or_default().to_string();
    assert!(why.contains(image) && !why.contains("capacity error"), "{}", f.explain());
    let out =
        Command::new(BIN).args(["fleets", "--server", &f.server.url, "--token", &f.server.token]).output().unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && shown.contains(image), "{shown}");
    assert!(!shown.contains("capacity error"), "{shown}");
    // The refused pod does not stay (it would hold its node's GPU), nor does its token.
    wait_until_or(
        "the refused pod and its token secret deleted",
        T,
        || f.cluster.pods().is_empty() && f.cluster.secrets().is_empty(),
        || format!("{:#?}\n{}", f.cluster.pods(), f.explain()),
    );
    assert_eq!(creates(), 1, "{}", f.explain());
}

/// A pod evicted under a running job (node pressure), and a node removed from the cluster:
/// each time the job is ended `lost` and queued again once, and runs on a new pod.
#[test]
fn an_evicted_pod_or_a_lost_node_queues_its_job_again_once() {
    let Some(f) = start(1) else { return };
    let api = f.server.api();
    let step = "steps:\n  - key: a\n    gpus: 1\n    command: if [ \"$GPUCI_ATTEMPT\" = 1 ]; then sleep 300; fi; echo attempt $GPUCI_ATTEMPT done\n";
    let p = api.submit(step);
    let first = p.jobs[0].id;
    api.wait_job(first, "running", T, |j| j.state == JobState::Running);
    f.wait_connected();
    let pod = f.cluster.running_pod();
    f.cluster.post(&format!("/_test/evict/{NS}/{pod}"), Value::Null);
    let lost = api.wait_job(first, "lost", T, |j| j.state == JobState::Lost);
    assert!(lost.reason.contains("taken back"), "{lost:#?}");
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    assert_eq!(done.jobs.len(), 2, "queued again once: {done:#?}");

    let p = api.submit(step);
    let first = p.jobs[0].id;
    api.wait_job(first, "running", T, |j| j.state == JobState::Running);
    f.wait_connected();
    f.cluster.delete("/_test/nodes/gpu-a");
    let lost = api.wait_job(first, "lost", T, |j| j.state == JobState::Lost);
    assert!(lost.reason.contains("taken back"), "{lost:#?}");
    f.cluster.post(
        "/_test/nodes",
        serde_json::json!({"name": "gpu-a", "labels": {"nvidia.com/gpu.present": "true"}, "gpus": 4, "gpu_uuids": node_uuids("gpu-a", 4)}),
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    assert_eq!(done.jobs.len(), 2, "queued again once: {done:#?}");
}

/// A coordinator killed with a pod up adopts it after its restart (found by its labels
/// through the watch), makes no second one, and the job finishes.
#[test]
fn a_restarted_coordinator_adopts_its_pods() {
    let Some(mut f) = start(1) else { return };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: sleep 6; echo finished\n");
    api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    let before: Vec<Value> = f.cluster.pods().iter().map(|p| p["metadata"]["name"].clone()).collect();
    assert_eq!(before.len(), 1);
    f.server.restart_hard();
    let api = f.server.api();
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    let created = f.cluster.get("/_test/requests");
    let creates =
        created.as_array().unwrap().iter().filter(|r| r["resource"] == "pods" && r["verb"] == "create").count();
    assert_eq!(creates, 1, "adopted, not made again");
}

/// The manifests a user applies (namespace, RBAC, the coordinator's Deployment and Service, the
/// kustomize base and the EKS overlay) pass the official schemas and gpuci's own checks.
#[test]
fn the_shipped_manifests_pass_the_official_schemas() {
    let Some(py) = python() else { return };
    let out =
        Command::new(py).arg(repo().join("deploy/kubernetes/check_manifests.py")).arg("--no-render").output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("ok   base/rbac.yaml") && text.contains("kustomization"), "{text}");
}

/// A pod someone else makes with gpuci's labels (naming a busy machine of the fleet, and
/// failing at once) is not taken for that machine: the job on the real pod finishes, once.
#[test]
fn a_foreign_pod_with_our_labels_decides_nothing() {
    let Some(f) = start(1) else { return };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: sleep 5; echo finished\n");
    api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    f.wait_connected();
    let real = f.cluster.pods().into_iter().next().unwrap();
    let labels = real["metadata"]["labels"].clone();
    let foreign = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "aaa-lookalike", "labels": labels},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "x", "image": "busybox", "command": ["false"]}]},
    });
    f.cluster.post(&format!("/api/v1/namespaces/{NS}/pods"), foreign);
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{}", f.explain());
    assert_eq!(done.jobs.len(), 1, "not queued again: {done:#?}");
    assert!(api.log_text(done.jobs[0].id).contains("finished"));
}

/// The documented default pod form (`sandbox = "user-namespace"`: `hostUsers: false`,
/// `procMount: Unmasked`, `CAP_SYS_ADMIN` inside the pod's user namespace), acted out by the
/// double's runtime with real namespaces and the pod's memory limit as its cgroup: the job
/// runs in gpuci's sandbox inside it, and a hostile job holds nothing of the agent's. What the
/// pod cannot give (a job cgroup, a disk of its own) is listed on the job.
#[test]
fn a_job_in_the_default_pod_is_sandboxed_and_holds_nothing_of_the_agents() {
    if isolation() != "bubblewrap" {
        return;
    }
    let Some(f) = start(1) else { return };
    let api = f.server.api();
    let port = api_port(&f);
    // Each line a verdict the test reads back; `NO-…` lines are escapes.
    let probe = format!(
        r#"
set +e
while read -r k v _; do case "$k" in Uid:) uid=$v ;; CapEff:) cap=$v ;; Seccomp:) sc=$v ;; NoNewPrivs:) nnp=$v ;; esac; done < /proc/self/status
echo "uid=$uid cap=$cap seccomp=$sc nnp=$nnp"
echo "pids=$(ls /proc | grep -c '^[0-9]')"
env | grep -q GPUCI_REGISTRATION_TOKEN && echo NO-token-in-env
grep -rqs gpuci_mreg / --include=environ 2>/dev/null
for p in /proc/[0-9]*; do tr '\0' '\n' < $p/environ 2>/dev/null | grep -q GPUCI_REGISTRATION_TOKEN && echo NO-agent-environ-$p; done
ls agent >/dev/null 2>&1 && echo NO-agent-data-dir
echo "nproc=$(ulimit -u)"; ulimit -u unlimited 2>/dev/null && echo NO-raised-nproc
echo "oom=$(cat /proc/self/oom_score_adj)"; echo 0 > /proc/self/oom_score_adj 2>/dev/null && echo NO-lowered-oom
mkdir /sys/fs/cgroup/x 2>/dev/null && echo NO-cgroup-write
(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo NO-reached-coordinator
unshare -r true 2>/dev/null && echo NO-new-userns
echo probe-done
"#
    );
    let yaml = format!("steps:\n  - key: hostile\n    gpus: 1\n    command: |\n{}", indent(&probe, 6));
    let p = api.submit(&yaml);
    let done = api.wait_pipeline(p.id, T);
    let job = done.jobs[0].id;
    let log = api.log_text(job);
    assert_eq!(done.state, "succeeded", "{done:#?}\n{log}\n{}", f.explain());
    assert!(log.contains("probe-done"), "{log}");
    // oom_score_adj may be lowered again in a pod (only a process with CAP_SYS_RESOURCE in
    // the host's user namespace sets a floor under it): said in the docs, not an escape.
    assert!(
        !log.lines().any(|l| l.starts_with("NO-") && l != "NO-lowered-oom"),
        "an escape from the sandbox in the pod: {log}"
    );
    assert!(log.contains("cap=0000000000000000 seccomp=2 nnp=1"), "{log}");
    assert!(!log.contains("uid=0 "), "the job is not root: {log}");
    let pids: u32 =
        log.split("pids=").nth(1).and_then(|t| t.lines().next()).and_then(|n| n.trim().parse().ok()).unwrap();
    assert!(pids < 10, "the job sees its own processes only: {pids}\n{log}");
    assert!(log.contains("nproc=4096"), "the process limit stands in for a cgroup's: {log}");
    assert!(log.contains("oom=1000"), "the OOM killer takes the job first: {log}");
    // What the pod could not give is said on the job, not only in the agent's output.
    let shown: Value = api.get(&format!("/api/v1/jobs/{job}"));
    let keys: Vec<&str> = shown["unenforced"].as_array().unwrap().iter().filter_map(|u| u["key"].as_str()).collect();
    assert!(keys.contains(&"limits") && keys.contains(&"disk_quota"), "{shown:#}");
    let pod = &f.cluster.pods()[0];
    assert_eq!(pod["spec"]["hostUsers"], false, "{pod:#}");
    assert!(pod["spec"]["containers"][0]["securityContext"].get("privileged").is_none(), "{pod:#}");
}

/// A pod made as the runtime makes any container (`sandbox = "container"`: its `/proc`
/// masked, no `CAP_SYS_ADMIN`): the job sandbox cannot start there. An agent left to choose
/// (`--isolation auto`, the default) takes no jobs, and the waiting job says why and what fixes
/// it, in words, never "busy"; one told `--isolation bubblewrap` exits, and the fleet shows its
/// last words (the pod's termination message).
#[test]
fn a_plain_container_pod_takes_no_jobs_and_says_why() {
    if isolation() != "bubblewrap" {
        return;
    }
    let plain = "sandbox = \"container\"";
    let Some(f) = start_full(1, "envvar-uuid", &[], "gpuci:test", "bubblewrap", plain) else { return };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ran\n");
    let job = p.jobs[0].id;
    wait_until_or(
        "the job says why the pod did not come up, in the agent's words",
        T,
        || {
            let r = api.job(job).reason;
            r.contains("did not come up") && r.contains("Can't mount proc")
        },
        || format!("{:#?}\n{}", api.job(job), f.explain()),
    );
    drop(f);
    let Some(f) = start_full(1, "envvar-uuid", &[], "gpuci:test", "auto", plain) else { return };
    let api = f.server.api();
    let p = api.submit("steps:\n  - key: a\n    gpus: 1\n    command: echo ran\n");
    let job = p.jobs[0].id;
    wait_until_or(
        "the job says why the pod's agent takes none",
        T,
        || {
            let j = api.job(job);
            j.reason.contains("masked") && j.reason.contains("procMount: Unmasked")
        },
        || {
            format!(
                "{:#?}
{}",
                api.job(job),
                f.explain()
            )
        },
    );
    let waiting = api.job(job);
    assert_eq!(waiting.state, JobState::Queued, "{waiting:#?}");
    assert!(!waiting.reason.contains("busy"), "{}", waiting.reason);
    assert!(!api.log_text(job).contains("ran"), "the job never ran");
}

fn indent(text: &str, n: usize) -> String {
    text.lines().map(|l| format!("{}{l}\n", " ".repeat(n))).collect()
}

/// The coordinator's port, as a job in a pod on this host would try to reach it.
fn api_port(f: &Fleet) -> u16 {
    let url = &f.server.url;
    url.rsplit(':').next().and_then(|p| p.trim_end_matches('/').parse().ok()).expect("port in the url")
}
