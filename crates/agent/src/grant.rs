//! Which GPUs a Kubernetes pod was granted (`gpuci agent --allocation kubernetes`), from what
//! the container actually shows — never from one mechanism's habits. [`resolve`] is pure;
//! [`read_grant`] gathers the facts (environment, the volume-mounts list, `/dev/nvidia*`).
//! The Slurm equivalent is [`crate::gres`].
//!
//! How each mechanism shows a grant (sources in brackets):
//! - NVIDIA device plugin, `DEVICE_LIST_STRATEGY=envvar` (its default): `NVIDIA_VISIBLE_DEVICES`
//!   is the comma-separated list; the NVIDIA container runtime injects those GPUs' device
//!   nodes [k8s-device-plugin README, "DEVICE_LIST_STRATEGY"; `server.go`,
//!   `updateResponseForDeviceListEnvVar`].
//! - `DEVICE_ID_STRATEGY=uuid` (default) lists UUIDs; `index` lists the node's indices "as seen
//!   in the output of `nvidia-smi`" on the host [README, "DEVICE_ID_STRATEGY"]. Inside a
//!   container that sees only its GPUs, NVML numbers them from 0 again, so an index is matched
//!   by NVML's index only where the container sees more GPUs than it was granted (the host's
//!   numbering: a privileged pod, or the test double); where it sees exactly as many as the
//!   list names, the list is those GPUs, whatever the numbers.
//! - `DEVICE_LIST_STRATEGY=volume-mounts` (Bottlerocket's default): the variable is set to
//!   `/var/run/nvidia-container-devices` and each granted id (UUID or index, as above) is a
//!   file of that directory (a bind of `/dev/null`) [`server.go`,
//!   `updateResponseForDeviceMounts`; bottlerocket.dev, `settings.kubelet-device-plugins.nvidia`].
//!   Its `imex/` subdirectory holds IMEX channels, not GPUs.
//! - `cdi-annotations` / `cdi-cri` (the GPU Operator's default from 25.10): with only CDI
//!   strategies the plugin sets no variable (`AllCDIEnabled` returns before the envvar
//!   branch); the CDI spec `nvidia-ctk` generates injects the device nodes and sets
//!   `NVIDIA_VISIBLE_DEVICES=void` [`server.go`, `getAllocateResponse`; CDI spec
//!   `containerEdits.env`/`deviceNodes`, container-device-interface SPEC.md]. The grant is the
//!   `/dev/nvidiaN` nodes present.
//! - GKE's own device plugin (GoogleCloudPlatform/container-engine-accelerators): no variable,
//!   only device specs — `/dev/nvidiaN` plus `/dev/nvidiactl`, `/dev/nvidia-uvm` — and a
//!   mount of the driver [GKE "Run GPUs in Standard node pools"; the plugin's `Allocate`].
//! - MIG: ids are `MIG-…` UUIDs (or `gpu:mig` indices). gpuci's inventory lists MIG devices
//!   under their GPU and leases whole GPUs only, so a MIG grant — or a node-granted GPU in MIG
//!   mode — is refused with the reason, never leased as the whole GPU.
//! - Images `FROM nvidia/cuda` set `ENV NVIDIA_VISIBLE_DEVICES=all`; the plugin's envvar
//!   strategy overrides it, the CDI strategies do not. So `all` names nothing: see below.
//!
//! The rules, here and nowhere else:
//! 1. A list (the variable, the volume-mounts files) names GPUs; two lists must name the same
//!    GPUs. `CUDA_VISIBLE_DEVICES`, where the image or pod sets it, must agree too (UUIDs: the
//!    same GPUs; indices: as many).
//! 2. Where any GPU device node is visible, every listed GPU's node must be present and
//!    openable: the runtime injects what it granted. (No node at all: the inventory is not a
//!    container's — the test double's simulated GPUs — and the list is taken as it is.)
//! 3. Without a list (no variable, `void`), the grant is the openable `/dev/nvidiaN` nodes,
//!    each of which must be a GPU of the inventory; and `--expect-gpus` must be given and
//!    agree: a privileged pod sees every node of the host, and nodes alone cannot tell.
//! 4. `all` is a grant only where nothing else could be meant: the openable nodes are every
//!    GPU NVML reports, and `--expect-gpus` says exactly that many.
//! 5. Any refusal names the sources that disagree and what to change; `--expect-gpus` checks
//!    the count at the end. The answer is inventory UUIDs: what the lease machinery holds.

use crate::gres::{minor_of, probe, Access};
use gpuci_core::gpu::GpuInfo;
use std::path::Path;

/// Where the volume-mounts strategy lists the grant, and the variable's value then.
pub const VOLUME_MOUNTS_DIR: &str = "/var/run/nvidia-container-devices";

/// What the container shows, as plain data; [`resolve`] decides.
#[derive(Clone, Debug, Default)]
pub struct PodFacts {
    pub nvidia_visible_devices: Option<String>,
    pub cuda_visible_devices: Option<String>,
    /// The file names under [`VOLUME_MOUNTS_DIR`]; `None`: no such directory.
    pub volume_mounts: Option<Vec<String>>,
    /// `/dev/nvidiaN` present: (N, what an open said).
    pub nodes: Vec<(u32, Access)>,
    /// What NVML (or nvidia-smi, or the simulation) reports.
    pub inventory: Vec<GpuInfo>,
    /// `--expect-gpus`.
    pub expect: Option<u32>,
}

/// The GPUs to serve: inventory UUIDs, and the source that named them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodGrant {
    pub uuids: Vec<String>,
    pub source: String,
}

/// Why the agent cannot tell which GPUs its pod was granted; each names what to fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    #[error("{by}: {entry:?} is neither a GPU UUID (GPU-…) nor an index")]
    BadEntry { by: String, entry: String },
    #[error(
        "{by}: {entry} is a MIG device{}: gpuci leases whole GPUs only; give this fleet nodes \
         without MIG, or set the device plugin's MIG_STRATEGY=none",
        parent.as_ref().map(|p| format!(" of GPU {p}")).unwrap_or_default()
    )]
    Mig { by: String, entry: String, parent: Option<String> },
    #[error(
        "GPU {uuid} ({node}) is in MIG mode: the pod was granted MIG devices, and gpuci leases whole GPUs only; \
         disable MIG on this fleet's nodes"
    )]
    MigMode { uuid: String, node: String },
    #[error("{by}: {entry} is not a GPU NVML reports in this container (it reports: {have})")]
    NotVisible { by: String, entry: String, have: String },
    #[error(
        "{by} names {uuid}, but its device node {node} {state}: the container runtime did not inject what the \
         device plugin listed (is the pod's runtimeClassName the NVIDIA runtime?)"
    )]
    NodeMissing { by: String, uuid: String, node: String, state: &'static str },
    #[error("two sources name different GPUs: {a} → [{a_gpus}], but {b} → [{b_gpus}]")]
    Disagree { a: String, a_gpus: String, b: String, b_gpus: String },
    #[error(
        "NVIDIA_VISIBLE_DEVICES=all names no GPU in particular (an image FROM nvidia/cuda sets it; the device plugin's \
         CDI strategies leave it): the pod can open {nodes} GPU device node(s), NVML reports {inventory} GPU(s), \
         --expect-gpus is {expect}; taken as the grant only when all three agree. Set ENV NVIDIA_VISIBLE_DEVICES=void \
         in the agent's image"
    )]
    All { nodes: usize, inventory: usize, expect: String },
    #[error(
        "NVIDIA_VISIBLE_DEVICES={VOLUME_MOUNTS_DIR} (the device plugin's volume-mounts strategy) but that directory \
         lists no GPU: is the pod's GPU limit set, and the runtime's accept-nvidia-visible-devices-as-volume-mounts on?"
    )]
    VolumeMountsEmpty,
    #[error(
        "the grant shows only as device nodes ({nodes}), with no list from the device plugin: without --expect-gpus \
         a privileged pod (which sees every GPU of the node) cannot be told from a grant"
    )]
    NodesNeedExpect { nodes: String },
    #[error("{node} is in the container, but NVML reports no GPU with that device node (it reports: {have})")]
    NodeNotInInventory { node: String, have: String },
    #[error(
        "{node} is in the container but cannot be opened (not EPERM from the device cgroup): check its permissions"
    )]
    NodeUnopenable { node: String },
    #[error(
        "NVML gives GPU {uuid} no device node ({device_node:?}): cannot match it with the nodes the pod was given"
    )]
    NoMinor { uuid: String, device_node: String },
    #[error(
        "{by} grants {} GPU(s) [{}], the fleet's machines have {expect} (--expect-gpus): is the pod's \
         nvidia.com/gpu limit what the fleet asks for, and does the device plugin say which GPUs it gave?",
        uuids.len(), uuids.join(", ")
    )]
    UnexpectedCount { by: String, uuids: Vec<String>, expect: u32 },
    #[error("cannot read {path}: {detail}")]
    Unreadable { path: String, detail: String },
}

fn minor(g: &GpuInfo) -> Option<u32> {
    minor_of(&g.device_node).ok()
}

fn node_path(n: u32) -> String {
    format!("/dev/nvidia{n}")
}

fn have(inv: &[GpuInfo]) -> String {
    if inv.is_empty() {
        return "none".into();
    }
    inv.iter().map(|g| format!("{} {} {}", g.index, g.uuid, g.device_node)).collect::<Vec<_>>().join(", ")
}

/// One list's entries → inventory positions (deduplicated, in the list's order).
fn resolve_list(source: &str, entries: &[String], inv: &[GpuInfo]) -> Result<Vec<usize>, GrantError> {
    let err = |e: &str| GrantError::NotVisible { by: source.into(), entry: e.into(), have: have(inv) };
    let mut out: Vec<usize> = Vec::new();
    for e in entries {
        let e = e.trim();
        let i = if e.starts_with("MIG-") || (e.contains(':') && e.split(':').all(|p| p.parse::<u32>().is_ok())) {
            let parent = inv.iter().find(|g| g.mig_instances.iter().any(|m| m.uuid == e)).map(|g| g.uuid.clone());
            return Err(GrantError::Mig { by: source.into(), entry: e.into(), parent });
        } else if let Ok(index) = e.parse::<u32>() {
            // The host's index. A container that sees exactly as many GPUs as the list
            // names sees only those (renumbered from 0): the runtime resolved the indices.
            if inv.len() == entries.len() {
                let pos = out.len();
                if pos >= inv.len() {
                    return Err(err(e));
                }
                pos
            } else {
                inv.iter().position(|g| g.index == index).ok_or_else(|| err(e))?
            }
        } else if e.starts_with("GPU-") && e.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            inv.iter().position(|g| g.uuid == e).ok_or_else(|| err(e))?
        } else {
            return Err(GrantError::BadEntry { by: source.into(), entry: e.into() });
        };
        if !out.contains(&i) {
            out.push(i);
        }
    }
    Ok(out)
}

fn names(set: &[usize], inv: &[GpuInfo]) -> String {
    set.iter().map(|&i| inv[i].uuid.as_str()).collect::<Vec<_>>().join(", ")
}

fn same(a: &[usize], b: &[usize]) -> bool {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort_unstable();
    b.sort_unstable();
    a == b
}

/// The GPUs this pod was granted; see the module header for the rules.
pub fn resolve(f: &PodFacts) -> Result<PodGrant, GrantError> {
    let inv = &f.inventory;
    let env = f.nvidia_visible_devices.as_deref().map(str::trim).filter(|v| !v.is_empty());
    let files: Vec<String> = f.volume_mounts.clone().unwrap_or_default();
    let split = |v: &str| v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect::<Vec<_>>();

    // Rule 1: the lists, each resolved on its own, then compared.
    let mut lists: Vec<(String, Vec<usize>)> = Vec::new();
    let mut all = false;
    match env {
        None | Some("void") => {}
        Some("all") => all = true,
        // `none`: the runtime gives no GPU (nvidia-container-runtime's documented value).
        Some("none") => lists.push(("NVIDIA_VISIBLE_DEVICES=none".into(), Vec::new())),
        Some(v) if v.trim_end_matches('/') == VOLUME_MOUNTS_DIR => {
            if files.is_empty() {
                return Err(GrantError::VolumeMountsEmpty);
            }
        }
        Some(v) => {
            let source = format!("NVIDIA_VISIBLE_DEVICES={v}");
            let set = resolve_list(&source, &split(v), inv)?;
            lists.push((source, set));
        }
    }
    if !files.is_empty() {
        let source = format!("{VOLUME_MOUNTS_DIR}/ ({})", files.join(" "));
        let set = resolve_list(&source, &files, inv)?;
        lists.push((source, set));
    }
    for pair in lists.windows(2) {
        if !same(&pair[0].1, &pair[1].1) {
            return Err(GrantError::Disagree {
                a: pair[0].0.clone(),
                a_gpus: names(&pair[0].1, inv),
                b: pair[1].0.clone(),
                b_gpus: names(&pair[1].1, inv),
            });
        }
    }

    // What the device nodes show.
    let mut usable: Vec<u32> = Vec::new();
    for &(n, access) in &f.nodes {
        match access {
            Access::Allowed => usable.push(n),
            Access::Denied => {}
            Access::Unknown => return Err(GrantError::NodeUnopenable { node: node_path(n) }),
        }
    }
    let by_nodes = || -> Result<Vec<usize>, GrantError> {
        usable
            .iter()
            .map(|&n| {
                inv.iter()
                    .position(|g| minor(g) == Some(n))
                    .ok_or_else(|| GrantError::NodeNotInInventory { node: node_path(n), have: have(inv) })
            })
            .collect()
    };
    let nodes_desc = || usable.iter().map(|&n| node_path(n)).collect::<Vec<_>>().join(" ");

    let (source, set) = if let Some((source, set)) = lists.into_iter().next() {
        // Rule 2: what the list names, the runtime must have injected.
        if !f.nodes.is_empty() {
            for &i in &set {
                let g = &inv[i];
                let n = minor(g)
                    .ok_or_else(|| GrantError::NoMinor { uuid: g.uuid.clone(), device_node: g.device_node.clone() })?;
                let state = match f.nodes.iter().find(|(m, _)| *m == n) {
                    None => "is not in the container",
                    Some((_, Access::Denied)) => "is refused by the container's device cgroup (EPERM)",
                    Some(_) => continue,
                };
                return Err(GrantError::NodeMissing { by: source, uuid: g.uuid.clone(), node: node_path(n), state });
            }
        }
        (source, set)
    } else if all {
        // Rule 4.
        let set = by_nodes()?;
        if set.is_empty() || set.len() != inv.len() || f.expect != Some(set.len() as u32) {
            return Err(GrantError::All {
                nodes: usable.len(),
                inventory: inv.len(),
                expect: f.expect.map_or("not given".into(), |n| n.to_string()),
            });
        }
        (format!("NVIDIA_VISIBLE_DEVICES=all with the device nodes {}", nodes_desc()), set)
    } else {
        // Rule 3: CDI, GKE: the nodes are the grant.
        let set = by_nodes()?;
        if !set.is_empty() && f.expect.is_none() {
            return Err(GrantError::NodesNeedExpect { nodes: nodes_desc() });
        }
        let var = match env {
            Some(v) => format!("NVIDIA_VISIBLE_DEVICES={v}"),
            None => "no NVIDIA_VISIBLE_DEVICES".into(),
        };
        (format!("the device nodes {} ({var})", if set.is_empty() { "(none)".into() } else { nodes_desc() }), set)
    };

    // Rule 1, last source: CUDA_VISIBLE_DEVICES, where something set it in the pod.
    if let Some(cuda) = f.cuda_visible_devices.as_deref().map(str::trim).filter(|v| !v.is_empty()) {
        let entries = split(cuda);
        let cuda_src = format!("CUDA_VISIBLE_DEVICES={cuda}");
        if entries.iter().all(|e| e.starts_with("GPU-") || e.starts_with("MIG-")) {
            let other = resolve_list(&cuda_src, &entries, inv)?;
            if !same(&other, &set) {
                return Err(GrantError::Disagree {
                    a: source,
                    a_gpus: names(&set, inv),
                    b: cuda_src,
                    b_gpus: names(&other, inv),
                });
            }
        } else if entries.len() != set.len() {
            // CUDA's indices count the GPUs the container sees; fewer or more than the
            // grant is a pod spec at odds with the plugin.
            return Err(GrantError::Disagree {
                a: source,
                a_gpus: names(&set, inv),
                b: cuda_src,
                b_gpus: format!("{} GPU(s)", entries.len()),
            });
        }
    }
    for &i in &set {
        if inv[i].mig_enabled == Some(true) {
            return Err(GrantError::MigMode { uuid: inv[i].uuid.clone(), node: inv[i].device_node.clone() });
        }
    }
    let uuids: Vec<String> = set.iter().map(|&i| inv[i].uuid.clone()).collect();
    if let Some(n) = f.expect {
        if uuids.len() != n as usize {
            return Err(GrantError::UnexpectedCount { by: source, uuids, expect: n });
        }
    }
    Ok(PodGrant { uuids, source })
}

/// Reads the facts under `root` (`/`; tests and the Kubernetes test double give a directory
/// standing in for the container's) and resolves them.
pub fn read_grant(
    root: &Path,
    expect: Option<u32>,
    env: &dyn Fn(&str) -> Option<String>,
    inventory: Vec<GpuInfo>,
) -> Result<PodGrant, GrantError> {
    let list_dir = root.join(VOLUME_MOUNTS_DIR.trim_start_matches('/'));
    let volume_mounts = match std::fs::read_dir(&list_dir) {
        Ok(dir) => {
            let mut names: Vec<String> = dir
                .flatten()
                // `imex/` holds IMEX channels, not GPUs.
                .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir()))
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            Some(names)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(GrantError::Unreadable { path: list_dir.display().to_string(), detail: e.to_string() }),
    };
    let dev = root.join("dev");
    let mut nodes: Vec<(u32, Access)> = match std::fs::read_dir(&dev) {
        Ok(dir) => dir
            .flatten()
            .filter_map(|e| {
                let p = e.path();
                minor_of(&p.display().to_string()).ok().map(|n| (n, probe(&p)))
            })
            .collect(),
        Err(e) => return Err(GrantError::Unreadable { path: dev.display().to_string(), detail: e.to_string() }),
    };
    nodes.sort_unstable_by_key(|(n, _)| *n);
    let facts = PodFacts {
        nvidia_visible_devices: env("NVIDIA_VISIBLE_DEVICES"),
        cuda_visible_devices: env("CUDA_VISIBLE_DEVICES"),
        volume_mounts,
        nodes,
        inventory,
        expect,
    };
    tracing::debug!(?facts, "what the pod shows of its GPUs");
    resolve(&facts)
}

#[cfg(test)]
#[path = "grant_tests.rs"]
mod tests;
