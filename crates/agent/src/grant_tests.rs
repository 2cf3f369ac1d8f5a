//! The grant-resolution cases of `grant.rs`, one test per mechanism (see its header for the
//! source of each), plus the reader against a temp dir standing in for `/`.

use super::*;
use gpuci_core::gpu::MigInstance;
use gpuci_core::quantity::Bytes;
use gpuci_gpu::{GpuBackend, SimulatedGpus};

/// The host's four GPUs: index i, `/dev/nvidia<i>`.
fn host() -> Vec<GpuInfo> {
    SimulatedGpus::build("4xL4".parse().unwrap(), "node-a", Path::new("/dev"), None).unwrap().inventory().unwrap()
}

/// What NVML shows inside a container given `host[i]` for each i: those GPUs, numbered from 0,
/// keeping their UUIDs and device nodes.
fn container_view(picks: &[usize]) -> Vec<GpuInfo> {
    let h = host();
    picks
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let mut g = h[i].clone();
            g.index = k as u32;
            g
        })
        .collect()
}

fn allowed(minors: &[u32]) -> Vec<(u32, Access)> {
    minors.iter().map(|&n| (n, Access::Allowed)).collect()
}

fn facts(env: Option<&str>, nodes: Vec<(u32, Access)>, inventory: Vec<GpuInfo>, expect: Option<u32>) -> PodFacts {
    PodFacts { nvidia_visible_devices: env.map(Into::into), nodes, inventory, expect, ..Default::default() }
}

fn uuid(i: usize) -> String {
    host()[i].uuid.clone()
}

#[test]
fn envvar_with_uuids_is_those_gpus() {
    // A real container: NVML sees the granted GPU only, its node injected.
    let g = resolve(&facts(Some(&uuid(2)), allowed(&[2]), container_view(&[2]), Some(1))).unwrap();
    assert_eq!(g.uuids, vec![uuid(2)]);
    assert!(g.source.starts_with("NVIDIA_VISIBLE_DEVICES=GPU-"), "{}", g.source);
    // The test double: the node's whole simulated inventory, no device node at all.
    let two = format!("{},{}", uuid(3), uuid(1));
    let g = resolve(&facts(Some(&two), Vec::new(), host(), Some(2))).unwrap();
    assert_eq!(g.uuids, vec![uuid(3), uuid(1)]);
    let e = resolve(&facts(Some("GPU-00000000-0000-0000-0000-000000000000"), Vec::new(), host(), None)).unwrap_err();
    assert!(matches!(e, GrantError::NotVisible { .. }) && e.to_string().contains("it reports: 0 GPU-"), "{e}");
}

#[test]
fn envvar_with_indices_is_the_hosts_numbering_not_the_containers() {
    // Host index 2 in a container that sees one GPU: NVML calls it 0; the runtime resolved it.
    let g = resolve(&facts(Some("2"), allowed(&[2]), container_view(&[2]), Some(1))).unwrap();
    assert_eq!(g.uuids, vec![uuid(2)]);
    // A container that sees every GPU (privileged; the test double): NVML's index is the host's.
    let g = resolve(&facts(Some("2"), allowed(&[0, 1, 2, 3]), host(), Some(1))).unwrap();
    assert_eq!(g.uuids, vec![uuid(2)]);
    let g = resolve(&facts(Some("1,3"), Vec::new(), host(), Some(2))).unwrap();
    assert_eq!(g.uuids, vec![uuid(1), uuid(3)]);
    let e = resolve(&facts(Some("7"), Vec::new(), host(), None)).unwrap_err();
    assert!(matches!(e, GrantError::NotVisible { ref entry, .. } if entry == "7"), "{e}");
}

#[test]
fn volume_mounts_files_name_the_gpus_by_uuid_or_index() {
    let mut f = facts(Some(VOLUME_MOUNTS_DIR), allowed(&[1]), container_view(&[1]), Some(1));
    f.volume_mounts = Some(vec![uuid(1)]);
    let g = resolve(&f).unwrap();
    assert_eq!(g.uuids, vec![uuid(1)]);
    assert!(g.source.starts_with("/var/run/nvidia-container-devices/ (GPU-"), "{}", g.source);
    // DEVICE_ID_STRATEGY=index (Bottlerocket's default), seen with the host's numbering.
    let mut f = facts(Some(VOLUME_MOUNTS_DIR), allowed(&[0, 1, 2, 3]), host(), Some(2));
    f.volume_mounts = Some(vec!["0".into(), "3".into()]);
    assert_eq!(resolve(&f).unwrap().uuids, vec![uuid(0), uuid(3)]);
    // The variable says "look at the files", and there are none.
    let f = facts(Some("/var/run/nvidia-container-devices/"), allowed(&[1]), container_view(&[1]), Some(1));
    assert_eq!(resolve(&f).unwrap_err(), GrantError::VolumeMountsEmpty);
}

#[test]
fn cdi_injected_nodes_with_the_variable_absent_or_void() {
    for env in [None, Some("void")] {
        let g = resolve(&facts(env, allowed(&[1]), container_view(&[1]), Some(1))).unwrap();
        assert_eq!(g.uuids, vec![uuid(1)], "{env:?}");
        assert!(g.source.starts_with("the device nodes /dev/nvidia1"), "{}", g.source);
        // The node's whole inventory (the double), two nodes injected.
        let g = resolve(&facts(env, allowed(&[0, 3]), host(), Some(2))).unwrap();
        assert_eq!(g.uuids, vec![uuid(0), uuid(3)]);
        // Nodes the device cgroup refuses are not the pod's.
        let mut nodes = allowed(&[2]);
        nodes.extend([(0, Access::Denied), (1, Access::Denied)]);
        assert_eq!(resolve(&facts(env, nodes, host(), Some(1))).unwrap().uuids, vec![uuid(2)]);
    }
    // Nodes alone cannot tell a grant from a privileged pod's view: --expect-gpus is required.
    let e = resolve(&facts(None, allowed(&[0, 1, 2, 3]), host(), None)).unwrap_err();
    assert!(matches!(e, GrantError::NodesNeedExpect { .. }), "{e}");
    // ...and must agree: a privileged pod on a 4-GPU node asked for one GPU.
    let e = resolve(&facts(Some("void"), allowed(&[0, 1, 2, 3]), host(), Some(1))).unwrap_err();
    assert!(matches!(e, GrantError::UnexpectedCount { expect: 1, .. }), "{e}");
    assert!(e.to_string().contains("grants 4 GPU(s)"), "{e}");
}

#[test]
fn gke_style_nodes_only() {
    // GKE's plugin: /dev/nvidia0 (+ nvidiactl, nvidia-uvm, which are not GPUs), no variable.
    let g = resolve(&facts(None, allowed(&[0]), container_view(&[0]), Some(1))).unwrap();
    assert_eq!(g.uuids, vec![uuid(0)]);
    // A node NVML does not know, or one the agent cannot open: refused, with the node.
    let e = resolve(&facts(None, allowed(&[0, 5]), container_view(&[0]), Some(2))).unwrap_err();
    assert!(matches!(e, GrantError::NodeNotInInventory { ref node, .. } if node == "/dev/nvidia5"), "{e}");
    let e = resolve(&facts(None, vec![(0, Access::Unknown)], container_view(&[0]), Some(1))).unwrap_err();
    assert_eq!(e, GrantError::NodeUnopenable { node: "/dev/nvidia0".into() });
    // No GPU at all: right for a CPU machine, refused where GPUs were expected.
    assert!(resolve(&facts(None, Vec::new(), Vec::new(), Some(0))).unwrap().uuids.is_empty());
    assert!(resolve(&facts(Some("none"), Vec::new(), Vec::new(), None)).unwrap().uuids.is_empty());
    let e = resolve(&facts(None, Vec::new(), Vec::new(), Some(1))).unwrap_err();
    assert!(e.to_string().contains("grants 0 GPU(s)") && e.to_string().contains("--expect-gpus"), "{e}");
}

#[test]
fn all_is_a_grant_only_when_nodes_inventory_and_expect_agree() {
    let every = allowed(&[0, 1, 2, 3]);
    // A privileged pod with the CUDA image's ENV: four nodes, four GPUs, one asked for.
    for expect in [None, Some(1)] {
        let e = resolve(&facts(Some("all"), every.clone(), host(), expect)).unwrap_err();
        assert!(matches!(e, GrantError::All { nodes: 4, inventory: 4, .. }), "{e}");
    }
    // The whole node, asked for as such.
    assert_eq!(resolve(&facts(Some("all"), every, host(), Some(4))).unwrap().uuids.len(), 4);
    // CDI injected two of four: NVML (in a real container) sees the two; four expected.
    let e = resolve(&facts(Some("all"), allowed(&[1, 2]), host(), Some(2))).unwrap_err();
    assert!(matches!(e, GrantError::All { nodes: 2, inventory: 4, .. }), "{e}");
    // The image's `all` with a volume-mounts list: the list is the grant.
    let mut f = facts(Some("all"), allowed(&[2]), container_view(&[2]), Some(1));
    f.volume_mounts = Some(vec![uuid(2)]);
    assert_eq!(resolve(&f).unwrap().uuids, vec![uuid(2)]);
}

#[test]
fn mig_is_refused_clearly() {
    let mut inv = container_view(&[0]);
    inv[0].mig_enabled = Some(true);
    inv[0].mig_instances =
        vec![MigInstance { uuid: "MIG-4f1e".into(), profile: "1g.5gb".into(), memory: Bytes(5 << 30) }];
    let e = resolve(&facts(Some("MIG-4f1e"), allowed(&[0]), inv.clone(), Some(1))).unwrap_err();
    assert_eq!(
        e,
        GrantError::Mig {
            by: "NVIDIA_VISIBLE_DEVICES=MIG-4f1e".into(),
            entry: "MIG-4f1e".into(),
            parent: Some(uuid(0))
        }
    );
    assert!(e.to_string().contains("leases whole GPUs only"), "{e}");
    // The index strategy's MIG form, `gpu:mig`.
    let e = resolve(&facts(Some("0:1"), allowed(&[0]), inv.clone(), Some(1))).unwrap_err();
    assert!(matches!(e, GrantError::Mig { parent: None, .. }), "{e}");
    // CDI/GKE with MIG: the parent's node is injected; leasing it whole would be wrong.
    let e = resolve(&facts(None, allowed(&[0]), inv, Some(1))).unwrap_err();
    assert_eq!(e, GrantError::MigMode { uuid: uuid(0), node: "/dev/nvidia0".into() });
}

#[test]
fn sources_that_disagree_are_refused_naming_both() {
    // The variable and the volume-mounts files.
    let mut f = facts(Some(&uuid(1)), Vec::new(), host(), Some(1));
    f.volume_mounts = Some(vec![uuid(2)]);
    let e = resolve(&f).unwrap_err().to_string();
    assert!(e.contains(&format!("NVIDIA_VISIBLE_DEVICES={} → [{}]", uuid(1), uuid(1))), "{e}");
    assert!(e.contains(&format!("/var/run/nvidia-container-devices/ ({}) → [{}]", uuid(2), uuid(2))), "{e}");
    // The list and the device nodes: the listed GPU's node absent, or refused by the cgroup.
    let e = resolve(&facts(Some(&uuid(1)), allowed(&[2]), host(), Some(1))).unwrap_err();
    assert!(matches!(e, GrantError::NodeMissing { state: "is not in the container", .. }), "{e}");
    assert!(e.to_string().contains("/dev/nvidia1"), "{e}");
    let nodes = vec![(1, Access::Denied), (2, Access::Allowed)];
    let e = resolve(&facts(Some(&uuid(1)), nodes, host(), Some(1))).unwrap_err().to_string();
    assert!(e.contains("EPERM"), "{e}");
    // CUDA_VISIBLE_DEVICES set in the pod: UUIDs must be the same GPUs, indices as many.
    let mut f = facts(Some(&uuid(1)), allowed(&[1]), host(), Some(1));
    f.cuda_visible_devices = Some(uuid(3));
    let e = resolve(&f).unwrap_err().to_string();
    assert!(e.contains("CUDA_VISIBLE_DEVICES=GPU-") && e.contains("NVIDIA_VISIBLE_DEVICES=GPU-"), "{e}");
    f.cuda_visible_devices = Some("0,1".into());
    assert!(resolve(&f).unwrap_err().to_string().contains("CUDA_VISIBLE_DEVICES=0,1 → [2 GPU(s)]"));
    f.cuda_visible_devices = Some("0".into());
    assert_eq!(resolve(&f).unwrap().uuids, vec![uuid(1)]);
    // Garbage in the list.
    let e = resolve(&facts(Some("GPU 1; rm -rf"), Vec::new(), host(), None)).unwrap_err();
    assert!(matches!(e, GrantError::BadEntry { .. }), "{e}");
}

#[test]
fn the_reader_sees_a_directory_standing_in_for_the_container() {
    let root = tempfile::tempdir().unwrap();
    let dev = root.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for f in ["nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] {
        std::fs::write(dev.join(f), "").unwrap();
    }
    let env_of =
        |pairs: Vec<(&'static str, String)>| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
    // CDI / GKE: nodes only.
    let g = read_grant(root.path(), Some(1), &env_of(vec![]), host()).unwrap();
    assert_eq!(g.uuids, vec![uuid(2)]);
    // volume-mounts: one file per GPU, and an `imex/` directory that is not one.
    let list = root.path().join("var/run/nvidia-container-devices");
    std::fs::create_dir_all(list.join("imex")).unwrap();
    std::fs::write(list.join(uuid(2)), "").unwrap();
    let env = env_of(vec![("NVIDIA_VISIBLE_DEVICES", VOLUME_MOUNTS_DIR.to_string())]);
    let g = read_grant(root.path(), Some(1), &env, host()).unwrap();
    assert_eq!((g.uuids, g.source), (vec![uuid(2)], format!("{VOLUME_MOUNTS_DIR}/ ({})", uuid(2))));
    // A list file naming a GPU whose node the runtime did not inject.
    std::fs::write(list.join(uuid(0)), "").unwrap();
    let e = read_grant(root.path(), Some(2), &env, host()).unwrap_err();
    assert!(matches!(e, GrantError::NodeMissing { ref node, .. } if node == "/dev/nvidia0"), "{e}");
}
