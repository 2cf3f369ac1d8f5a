//! Unit tests of the provider: refusals classified, pods built from settings, settings refused.
use super::*;

fn fleet(settings: &str) -> FleetSpec {
    gpuci_core::fleet::parse_fleets(
        "server.toml",
        &format!(
            r#"
[[fleet]]
name = "k8s-gpu"
provider = "kubernetes"
max = 5
[fleet.machine]
gpu_model = "NVIDIA A10G"
gpus = 1
gpu_memory = "24GiB"
cpus = 4
memory = "16GiB"
[[fleet.offer]]
instance_type = "pod"
price_per_hour = 1.0
[fleet.settings]
{settings}
"#
        ),
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .remove(0)
}

#[test]
fn refusals_the_next_pass_would_get_again_back_the_fleet_off() {
    for (code, reason, message, kind) in [
        (
            403,
            "Forbidden",
            r#"pods "gpuci-m-1" is forbidden: pod rejected: RuntimeClass "nvidia" not found"#,
            ErrorKind::Refused,
        ),
        (
            422,
            "Invalid",
            r#"Pod "gpuci-m-1" is invalid: spec.runtimeClassName: Invalid value: "Nvidia": a lowercase RFC 1123 subdomain"#,
            ErrorKind::Refused,
        ),
        (400, "BadRequest", "RuntimeClass \"kata\" not found", ErrorKind::Refused),
        (
            403,
            "Forbidden",
            r#"pods "gpuci-m-1" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false"#,
            ErrorKind::Refused,
        ),
        (
            403,
            "Forbidden",
            r#"admission webhook "gk.example.com" denied the request: GPU pods need a team label"#,
            ErrorKind::Refused,
        ),
        (
            403,
            "Forbidden",
            r#"pods "gpuci-m-1" is forbidden: exceeded quota: gpu, requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=4, limited: requests.nvidia.com/gpu=4"#,
            ErrorKind::Quota,
        ),
        (
            403,
            "Forbidden",
            r#"pods is forbidden: User "x" cannot create resource "pods" in API group """#,
            ErrorKind::Invalid,
        ),
        (422, "Invalid", r#"Pod "gpuci-m-1" is invalid: spec.containers[0].image: Required value"#, ErrorKind::Invalid),
        (404, "NotFound", r#"pods "gpuci-m-1" not found"#, ErrorKind::NotFound),
        (409, "Conflict", "the object has been modified", ErrorKind::Transient),
        (500, "InternalError", "etcdserver: request timed out", ErrorKind::Transient),
        (429, "TooManyRequests", "rate limited", ErrorKind::Transient),
    ] {
        assert_eq!(kind_of_status(code, reason, message), kind, "{code} {message}");
    }
    // What backs the offer off (the fleets loop's `is_capacity`).
    assert!(err(ErrorKind::Refused, "x").is_capacity());
    assert!(!err(ErrorKind::Invalid, "x").is_capacity());
}

#[test]
fn a_container_the_kubelet_cannot_start_ends_the_pod_with_the_kubelets_words() {
    let pod = |reason: &str, message: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "gpuci-m-1"},
            "status": {"phase": "Pending", "containerStatuses": [{
                "name": "agent", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}}}]}
        }))
        .unwrap()
    };
    for (reason, message, ended) in [
        ("ErrImagePull", "rpc error: pull access denied for gpuci/agent", true),
        ("ImagePullBackOff", "Back-off pulling image \"gpuci/agent:1\"", true),
        ("CreateContainerConfigError", "failed to get sandbox runtime: no runtime for \"nvidia\" is configured", true),
        ("RunContainerError", "failed to create containerd task: unknown runtime handler \"nvidia\"", true),
        ("CreateContainerConfigError", "secret \"gpuci-m-1-token\" not found", false),
        ("ContainerCreating", "", false),
    ] {
        let (state, note) = pod_state(&pod(reason, message));
        assert_eq!(state == ProviderState::Terminated, ended, "{reason}: {message}");
        let note = note.unwrap();
        assert!(note.contains(reason) && note.contains(message), "{note}");
    }
}

#[test]
fn settings_are_checked_before_anything_is_asked_of_the_cluster() {
    for (s, says) in [
        ("", "image: give the agent's container image"),
        ("image = \"x\"\nnamespce = \"a\"", "not a setting of the kubernetes provider"),
        ("image = \"x\"\nnamespace = \"Bad_NS\"", "is not a namespace name"),
        ("image = \"x\"\ntolerations = [{ key = \"a\", operator = \"Maybe\" }]", "expected Exists or Equal"),
        ("image = \"x\"\nagent_args = [\"--gpus\", \"0\"]", "gives the agent its GPUs"),
        ("image = \"x\"\nlabels = { \"gpuci.dev/fleet\" = \"other\" }", "gpuci.dev/ labels are gpuci's"),
        ("image = \"x\"\ntermination_grace_period = \"1s\"", "at least 5s"),
        ("image = \"x\"\nsandbox = \"gvisor\"", "expected \"user-namespace\""),
        ("image = \"x\"\nprivileged = true\nsandbox = \"user-namespace\"", "contradicts"),
        ("image = \"x\"\ndevice_resources = { tun = \"1\" }", "extended resource"),
        ("image = \"x\"\ndevice_resources = { \"squat.ai/tun\" = \"one\" }", "whole number"),
    ] {
        let e = KubeProvider::from_settings(&fleet(s), "c1").unwrap_err();
        assert!(e.contains(says), "{s}: {e}");
    }
}

#[test]
fn the_pod_asks_for_gpus_and_gets_no_credentials() {
    let p = KubeProvider::from_settings(
        &fleet(
            "image = \"gpuci:1\"\nnode_selector = { \"nvidia.com/gpu.present\" = \"true\" }\n\
             tolerations = [{ key = \"nvidia.com/gpu\", operator = \"Exists\", effect = \"NoSchedule\" }]\n\
             runtime_class = \"nvidia\"\nservice_account = \"gpuci-runner\"",
        ),
        "c1",
    )
    .unwrap();
    let req = request(&["--slots", "1"]);
    let pod = serde_json::to_value(p.pod(&req).unwrap()).unwrap();
    let text = pod.to_string();
    assert!(!text.contains("secret\""), "the token is not in the pod: {text}");
    let spec = &pod["spec"];
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(spec["enableServiceLinks"], false);
    assert_eq!(spec["runtimeClassName"], "nvidia");
    assert_eq!(spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"], "1");
    assert_eq!(spec["tolerations"][0]["operator"], "Exists");
    assert_eq!(pod["metadata"]["labels"]["gpuci.dev/machine"], "m-1");
    let args: Vec<String> = serde_json::from_value(spec["containers"][0]["args"].clone()).unwrap();
    assert!(args.windows(2).any(|w| w == ["--allocation", "kubernetes"]), "{args:?}");
    assert_eq!(args.iter().filter(|a| *a == "--slots").count(), 1, "the operator's --slots only: {args:?}");
    assert!(args.windows(2).any(|w| w == ["--job-disk", "none"]), "{args:?}");
}

fn request(extra: &[&str]) -> CreateRequest {
    CreateRequest {
        machine: "m-1".into(),
        offer: fleet("image = \"x\"").offers[0].clone(),
        capacity: Capacity::OnDemand,
        agent: gpuci_providers::AgentLaunch {
            server: "http://gpuci:8080".into(),
            registration_token: "gpuci_mreg.m-1.secret".into(),
            coordinator_key: Some(format!("ed25519:{}", "ab".repeat(32))),
            tags: BTreeMap::new(),
            name: "k8s-gpu-m-1".into(),
            program: "gpuci".into(),
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
        },
    }
}

#[test]
fn the_default_pod_is_user_namespaced_with_proc_unmasked_and_not_privileged() {
    let p = KubeProvider::from_settings(&fleet("image = \"gpuci:1\""), "c1").unwrap();
    let pod = serde_json::to_value(p.pod(&request(&[])).unwrap()).unwrap();
    let spec = &pod["spec"];
    assert_eq!(spec["hostUsers"], false, "{spec}");
    let sc = &spec["containers"][0]["securityContext"];
    // The agent pins the coordinators' key from its first contact.
    let env = spec["containers"][0]["env"].as_array().unwrap();
    assert!(
        env.iter()
            .any(|e| e["name"] == "GPUCI_COORDINATOR_KEY" && e["value"] == format!("ed25519:{}", "ab".repeat(32))),
        "{env:?}"
    );
    assert_eq!(sc["procMount"], "Unmasked");
    assert_eq!(sc["capabilities"]["add"], json!(["SYS_ADMIN"]));
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    assert_eq!(sc["appArmorProfile"]["type"], "Unconfined");
    assert!(sc.get("privileged").is_none(), "{sc}");
    let args: Vec<String> = serde_json::from_value(spec["containers"][0]["args"].clone()).unwrap();
    assert!(args.windows(2).any(|w| w == ["--slots", "1"]), "{args:?}");
    assert!(args.windows(2).any(|w| w == ["--job-disk", "none"]), "{args:?}");
    // The operator's own choice wins, in either spelling.
    let pod = serde_json::to_value(p.pod(&request(&["--job-disk=10GiB", "--slots", "2"])).unwrap()).unwrap();
    let args: Vec<String> = serde_json::from_value(pod["spec"]["containers"][0]["args"].clone()).unwrap();
    assert!(!args.iter().any(|a| a == "none"), "{args:?}");
    assert_eq!(args.iter().filter(|a| *a == "--slots").count(), 1, "{args:?}");
}

#[test]
fn privileged_and_plain_container_pods_are_what_they_say() {
    for (settings, privileged) in [
        ("image = \"x\"\nprivileged = true", true),
        ("image = \"x\"\nsandbox = \"privileged\"", true),
        ("image = \"x\"\nsandbox = \"container\"", false),
    ] {
        let p = KubeProvider::from_settings(&fleet(settings), "c1").unwrap();
        let pod = serde_json::to_value(p.pod(&request(&[])).unwrap()).unwrap();
        let spec = &pod["spec"];
        assert!(spec.get("hostUsers").is_none(), "{settings}: {spec}");
        let sc = &spec["containers"][0]["securityContext"];
        assert_eq!(sc.get("privileged").and_then(|v| v.as_bool()).unwrap_or(false), privileged, "{settings}: {sc}");
        assert!(sc.get("procMount").is_none(), "{settings}");
    }
}

#[test]
fn disk_and_device_resources_reach_the_container() {
    let p = KubeProvider::from_settings(
        &fleet("image = \"x\"\nephemeral_storage = \"50Gi\"\ndevice_resources = { \"squat.ai/tun\" = \"1\" }"),
        "c1",
    )
    .unwrap();
    let pod = serde_json::to_value(p.pod(&request(&[])).unwrap()).unwrap();
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["resources"]["limits"]["ephemeral-storage"], "50Gi");
    assert_eq!(c["resources"]["requests"]["ephemeral-storage"], "50Gi");
    assert_eq!(c["resources"]["limits"]["squat.ai/tun"], "1");
    assert_eq!(pod["spec"]["volumes"][0]["emptyDir"]["sizeLimit"], "50Gi");
}
