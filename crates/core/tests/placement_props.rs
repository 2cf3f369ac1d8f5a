//! Property tests for placement: random hosts, GPUs and a random sequence of placements and
//! releases. The indexed `Cluster` must agree with the reference `place` at every step, and
//! every placement must obey the rules; an unplaceable answer must be true.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::gpu::{mismatch, CmpOp, ComputeCapability, Constraint, GpuInfo, GpuRequirements, Version};
use gpuci_core::placement::{place, Cluster, GpuSlot, GpuSlotState, HostView, Needs};
use gpuci_core::quantity::Bytes;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};

const MODELS: [(&str, u64, (u32, u32)); 4] = [
    ("NVIDIA H100 80GB HBM3", 80, (9, 0)),
    ("NVIDIA A100-SXM4-80GB", 80, (8, 0)),
    ("NVIDIA A100-SXM4-40GB", 40, (8, 0)),
    ("NVIDIA L4", 24, (8, 9)),
];
const GLOBS: [&str; 4] = ["H100*", "*A100*80GB", "a100*", "L4"];
const TAGS: [(&str, &str); 3] = [("queue", "cuda"), ("queue", "big"), ("arch", "x86_64")];

#[derive(Clone, Debug)]
struct HostSpec {
    tags: Vec<usize>,
    slots: u32,
    container: bool,
    /// (model, state: 0..=5 free, 6 quarantined, 7 leased to a job from before)
    gpus: Vec<(usize, u8)>,
}

#[derive(Clone, Debug)]
enum Op {
    Place {
        count: u32,
        memory: Option<u64>,
        cc: Option<(u32, u32)>,
        model: Option<usize>,
        tags: Vec<usize>,
        container: bool,
    },
    /// Release the n-th running job (modulo how many run).
    Release(usize),
}

fn host_spec() -> impl Strategy<Value = HostSpec> {
    (
        prop::collection::vec(0..TAGS.len(), 0..3),
        0u32..4,
        any::<bool>(),
        prop::collection::vec((0..MODELS.len(), 0u8..8), 0..6),
    )
        .prop_map(|(tags, slots, container, gpus)| HostSpec { tags, slots, container, gpus })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            prop_oneof![Just(0u32), Just(1), Just(1), Just(2), Just(3), Just(4), Just(6)],
            prop::option::weighted(0.3, prop_oneof![Just(24u64), Just(40), Just(80)]),
            prop::option::weighted(0.2, prop_oneof![Just((8u32, 0u32)), Just((8, 9)), Just((9, 0))]),
            prop::option::weighted(0.2, 0..MODELS.len()),
            prop::collection::vec(0..TAGS.len(), 0..2),
            prop::bool::weighted(0.3),
        )
            .prop_map(|(count, memory, cc, model, tags, container)| Op::Place { count, memory, cc, model, tags, container }),
        2 => any::<usize>().prop_map(Op::Release),
    ]
}

fn build(specs: &[HostSpec]) -> Vec<HostView> {
    specs
        .iter()
        .enumerate()
        .map(|(h, s)| HostView {
            agent_id: format!("agent-{h}"),
            name: format!("host-{h}"),
            tags: s.tags.iter().map(|&t| (TAGS[t].0.to_string(), TAGS[t].1.to_string())).collect(),
            free_slots: s.slots,
            total_slots: s.slots,
            container_runtime: s.container,
            gpus: s
                .gpus
                .iter()
                .enumerate()
                .map(|(g, &(m, st))| {
                    let (name, gib, cc) = MODELS[m];
                    let info = GpuInfo {
                        uuid: format!("GPU-{h}-{g}"),
                        // Device indexes deliberately not in vector order.
                        index: (g as u32 * 7 + 3) % 11,
                        name: name.into(),
                        memory: Bytes(gib << 30),
                        compute_capability: ComputeCapability { major: cc.0, minor: cc.1 },
                        driver_version: Version::new(vec![550]),
                        cuda_driver_version: Some(Version::new(vec![12, 4])),
                        mig_enabled: None,
                        mig_instances: vec![],
                        ecc_enabled: None,
                        persistence_mode: None,
                        pci_bus_id: String::new(),
                        device_node: format!("/dev/nvidia{g}"),
                        simulated: true,
                    };
                    let state = match st {
                        6 => GpuSlotState::Quarantined { reason: "test".into() },
                        7 => GpuSlotState::Leased { job_id: format!("old-{h}-{g}") },
                        _ => GpuSlotState::Free,
                    };
                    GpuSlot { info, state }
                })
                .collect(),
            ends_at_ms: None,
            // A host with no slots at all takes no jobs: both implementations must name it so.
            refuses: (s.slots == 0).then(|| format!("host-{h} refuses")),
        })
        .collect()
}

/// Does any host fit, judged directly from the rules (no code shared with `place`)?
fn anything_fits(needs: &Needs<'_>, hosts: &[HostView]) -> bool {
    hosts.iter().any(|h| {
        needs.tags.iter().all(|(k, v)| h.tags.get(k) == Some(v))
            && (!needs.container || h.container_runtime)
            && h.free_slots > 0
            && h.gpus.iter().filter(|g| g.state == GpuSlotState::Free && mismatch(needs.gpu, &g.info).is_none()).count()
                >= needs.gpu.count as usize
    })
}

fn check(specs: Vec<HostSpec>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut reference = build(&specs);
    let mut cluster = Cluster::new(reference.clone());
    let mut running: Vec<(String, usize, Vec<String>)> = Vec::new();
    for (n, op) in ops.into_iter().enumerate() {
        match op {
            Op::Release(k) => {
                if running.is_empty() {
                    continue;
                }
                let (job, host, gpus) = running.remove(k % running.len());
                let freed = cluster.release(host, &job, &gpus);
                prop_assert_eq!(freed, gpus.len());
                for g in &mut reference[host].gpus {
                    if gpus.contains(&g.info.uuid) {
                        g.state = GpuSlotState::Free;
                    }
                }
                reference[host].free_slots += 1;
            }
            Op::Place { count, memory, cc, model, tags, container } => {
                let req = GpuRequirements {
                    count,
                    memory: memory.map(|g| Constraint { op: CmpOp::Ge, value: Bytes(g << 30) }),
                    compute_capability: cc
                        .map(|(major, minor)| Constraint { op: CmpOp::Ge, value: ComputeCapability { major, minor } }),
                    model: model.map(|m| GLOBS[m].to_string()),
                    ..Default::default()
                };
                let tags: BTreeMap<String, String> =
                    tags.iter().map(|&t| (TAGS[t].0.to_string(), TAGS[t].1.to_string())).collect();
                let needs = Needs { tags: &tags, gpu: &req, container, deadline: None };
                let job = format!("job-{n}");
                let expected = place(&needs, &reference);
                let got = cluster.place_and_apply(&job, &needs);
                prop_assert_eq!(&got, &expected, "Cluster and place disagree");
                match got {
                    Err(u) => {
                        prop_assert!(!u.reason.is_empty());
                        prop_assert!(
                            !anything_fits(&needs, &reference),
                            "said unplaceable ({}) but a host fits",
                            u.reason
                        );
                    }
                    Ok(p) => {
                        let h = &mut reference[p.host];
                        prop_assert!(needs.tags.iter().all(|(k, v)| h.tags.get(k) == Some(v)));
                        prop_assert!(!container || h.container_runtime);
                        prop_assert!(h.free_slots > 0);
                        prop_assert_eq!(p.gpus.len(), count as usize);
                        let distinct: HashSet<&String> = p.gpus.iter().collect();
                        prop_assert_eq!(distinct.len(), p.gpus.len());
                        for uuid in &p.gpus {
                            // On the chosen host: a job never spans hosts.
                            let Some(g) = h.gpus.iter_mut().find(|g| &g.info.uuid == uuid) else {
                                return Err(TestCaseError::fail(format!("GPU {uuid} is not on host {}", p.host)));
                            };
                            // Free before: never leased twice, never quarantined.
                            prop_assert_eq!(&g.state, &GpuSlotState::Free);
                            prop_assert!(mismatch(&req, &g.info).is_none());
                            g.state = GpuSlotState::Leased { job_id: job.clone() };
                        }
                        h.free_slots -= 1;
                        running.push((job, p.host, p.gpus));
                    }
                }
            }
        }
        prop_assert_eq!(cluster.hosts(), &reference[..], "cluster state drifted from the reference");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn cluster_agrees_with_place_and_obeys_the_rules(
        specs in prop::collection::vec(host_spec(), 0..7),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        check(specs, ops)?;
    }
}
