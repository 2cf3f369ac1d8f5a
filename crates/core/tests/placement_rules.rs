//! Placement rules, one test per rule and per reason. Every check goes through both the
//! reference `place` and the indexed `Cluster`, which must agree.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::gpu::{CmpOp, ComputeCapability, Constraint, GpuInfo, GpuRequirements, Version};
use gpuci_core::placement::{place, Cluster, Deadline, GpuSlot, GpuSlotState, HostView, Needs, Placement, Unplaceable};
use gpuci_core::quantity::Bytes;
use std::collections::BTreeMap;

fn gpu(uuid: &str, index: u32, name: &str, gib: u64, cc: (u32, u32)) -> GpuInfo {
    GpuInfo {
        uuid: uuid.into(),
        index,
        name: name.into(),
        memory: Bytes(gib << 30),
        compute_capability: ComputeCapability { major: cc.0, minor: cc.1 },
        driver_version: Version::new(vec![550, 54, 15]),
        cuda_driver_version: Some(Version::new(vec![12, 4])),
        mig_enabled: None,
        mig_instances: vec![],
        ecc_enabled: None,
        persistence_mode: None,
        pci_bus_id: String::new(),
        device_node: format!("/dev/nvidia{index}"),
        simulated: true,
    }
}

fn h100(host: &str, n: u32) -> Vec<GpuInfo> {
    (0..n).map(|i| gpu(&format!("GPU-{host}-{i}"), i, "NVIDIA H100 80GB HBM3", 80, (9, 0))).collect()
}

fn host(name: &str, tags: &[(&str, &str)], slots: u32, gpus: Vec<GpuInfo>) -> HostView {
    HostView {
        agent_id: format!("agent-{name}"),
        name: name.into(),
        tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        free_slots: slots,
        total_slots: slots,
        container_runtime: true,
        gpus: gpus.into_iter().map(|info| GpuSlot { info, state: GpuSlotState::Free }).collect(),
        ends_at_ms: None,
        refuses: None,
    }
}

fn tags(t: &[(&str, &str)]) -> BTreeMap<String, String> {
    t.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn gpus(count: u32) -> GpuRequirements {
    GpuRequirements { count, ..Default::default() }
}

fn at_least_gib(count: u32, gib: u64) -> GpuRequirements {
    GpuRequirements { count, memory: Some(Constraint { op: CmpOp::Ge, value: Bytes(gib << 30) }), ..Default::default() }
}

/// Place with both implementations on the same state; they must agree exactly.
fn both(needs: &Needs<'_>, hosts: &[HostView]) -> Result<Placement, Unplaceable> {
    let reference = place(needs, hosts);
    let mut cluster = Cluster::new(hosts.to_vec());
    assert_eq!(cluster.place(needs), reference, "Cluster and place disagree");
    reference
}

fn reason(needs: &Needs<'_>, hosts: &[HostView]) -> String {
    match both(needs, hosts) {
        Ok(p) => panic!("expected unplaceable, got {p:?}"),
        Err(u) => u.reason,
    }
}

fn host_of(needs: &Needs<'_>, hosts: &[HostView]) -> usize {
    both(needs, hosts).expect("placeable").host
}

#[test]
fn eight_one_gpu_jobs_on_a_four_gpu_host() {
    let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 4))]);
    let (t, r) = (tags(&[]), gpus(1));
    let needs = Needs { tags: &t, gpu: &r, container: false, deadline: None };
    let mut placed = Vec::new();
    for j in 0..8 {
        let job = format!("job-{j}");
        let reference = place(&needs, cluster.hosts());
        let got = cluster.place_and_apply(&job, &needs);
        assert_eq!(got, reference);
        match got {
            Ok(p) if j < 4 => placed.push((job, p)),
            Err(u) if j >= 4 => assert_eq!(u.reason, "needs 1 GPU; 4 matching GPUs are leased to other jobs"),
            other => panic!("job {j}: {other:?}"),
        }
    }
    let mut uuids: Vec<&String> = placed.iter().flat_map(|(_, p)| &p.gpus).collect();
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), 4, "four distinct GPUs");
    assert_eq!(cluster.hosts()[0].free_slots, 4);

    for (job, p) in &placed[..2] {
        assert_eq!(cluster.release(p.host, job, &p.gpus), 1);
    }
    for j in 8..10 {
        let p = cluster.place_and_apply(&format!("job-{j}"), &needs).expect("fits after release");
        assert!(placed[..2].iter().any(|(_, q)| q.gpus == p.gpus), "reuses a released GPU");
    }
    assert!(cluster.place_and_apply("job-10", &needs).is_err());
}

#[test]
fn gpus_come_in_device_index_order() {
    let mut g = h100("a", 4);
    g.reverse();
    let hosts = vec![host("a", &[], 4, g)];
    let (t, r) = (tags(&[]), gpus(2));
    let p = both(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts).expect("fits");
    assert_eq!(p.gpus, ["GPU-a-0", "GPU-a-1"]);
}

#[test]
fn multi_gpu_job_never_spans_hosts() {
    let hosts = vec![host("a", &[], 4, h100("a", 1)), host("b", &[], 4, h100("b", 1))];
    let t = tags(&[]);
    let r = gpus(2);
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts),
        "needs 2 GPUs; best host has 1 free (a job's GPUs must be on one host)"
    );
    let r = at_least_gib(2, 40);
    let why = reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts);
    assert!(why.starts_with("needs 2 GPUs with >=40 GiB; best host has 1 free"), "{why}");

    // With a host that has enough, the job goes there, whole.
    let mut hosts = hosts;
    hosts.push(host("c", &[], 4, h100("c", 2)));
    let p = both(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts).expect("fits on c");
    assert_eq!((p.host, p.gpus.as_slice()), (2, &["GPU-c-0".to_string(), "GPU-c-1".to_string()][..]));
}

#[test]
fn quarantined_gpu_is_never_leased() {
    let mut a = host("a", &[], 4, h100("a", 2));
    a.gpus[0].state = GpuSlotState::Quarantined { reason: "Xid 79".into() };
    let mut cluster = Cluster::new(vec![a]);
    let (t, r) = (tags(&[]), gpus(1));
    let needs = Needs { tags: &t, gpu: &r, container: false, deadline: None };
    assert_eq!(cluster.place_and_apply("j1", &needs).expect("one healthy GPU").gpus, ["GPU-a-1"]);
    let why = cluster.place_and_apply("j2", &needs).expect_err("only the quarantined one is left").reason;
    assert_eq!(why, "needs 1 GPU; 1 matching GPU is leased to other jobs");

    // Quarantining a leased GPU: its release does not make it free again.
    assert!(cluster.set_gpu_state(0, "GPU-a-1", GpuSlotState::Quarantined { reason: "ECC".into() }));
    assert_eq!(cluster.release(0, "j1", &["GPU-a-1".into()]), 0);
    assert_eq!(
        cluster.place_and_apply("j3", &needs).expect_err("all quarantined").reason,
        "needs 1 GPU; 2 matching GPUs are quarantined"
    );
}

#[test]
fn only_quarantined_gpus_match() {
    let mut a = host("a", &[], 4, h100("a", 4));
    for g in &mut a.gpus {
        g.state = GpuSlotState::Quarantined { reason: "memory held by a zombie process".into() };
    }
    let (t, r) = (tags(&[]), gpus(1));
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &[a]),
        "needs 1 GPU; 4 matching GPUs are quarantined"
    );
}

#[test]
fn quarantine_blocks_a_host_that_would_otherwise_fit() {
    let mut a = host("a", &[], 4, h100("a", 2));
    a.gpus[1].state = GpuSlotState::Quarantined { reason: "Xid 48".into() };
    let (t, r) = (tags(&[]), gpus(2));
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &[a]),
        "needs 2 GPUs; best host has 1 free, 1 matching GPU is quarantined"
    );
}

#[test]
fn best_fit_leaves_the_fewest_stranded_gpus() {
    let hosts = vec![host("a", &[], 4, h100("a", 4)), host("b", &[], 4, h100("b", 2))];
    let (t, r) = (tags(&[]), gpus(2));
    assert_eq!(host_of(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts), 1);
}

#[test]
fn best_fit_counts_only_matching_gpus_then_all_free_gpus() {
    // a: 2 H100 + 2 L4; b: 2 H100. Both have 2 free H100s; b strands fewer GPUs.
    let mut g = h100("a", 2);
    g.extend((2..4).map(|i| gpu(&format!("GPU-a-{i}"), i, "NVIDIA L4", 24, (8, 9))));
    let hosts = vec![host("a", &[], 4, g), host("b", &[], 4, h100("b", 2))];
    let t = tags(&[]);
    let r = GpuRequirements { count: 2, model: Some("H100*".into()), ..Default::default() };
    assert_eq!(host_of(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts), 1);
    // Full tie: host order decides.
    let hosts = vec![host("a", &[], 4, h100("a", 2)), host("b", &[], 4, h100("b", 2))];
    assert_eq!(host_of(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts), 0);
}

#[test]
fn cpu_job_prefers_hosts_without_free_gpus() {
    let t = tags(&[]);
    let r = gpus(0);
    let needs = Needs { tags: &t, gpu: &r, container: false, deadline: None };
    let mut busy_gpu = host("busy-gpu", &[], 4, h100("busy-gpu", 2));
    for g in &mut busy_gpu.gpus {
        g.state = GpuSlotState::Leased { job_id: "other".into() };
    }
    let gpu_host = host("gpu", &[], 8, h100("gpu", 4));
    let cpu_small = host("cpu-small", &[], 2, vec![]);
    let cpu_big = host("cpu-big", &[], 6, vec![]);
    // CPU-only hosts first, the one with more free slots first.
    let hosts = vec![gpu_host.clone(), busy_gpu.clone(), cpu_small.clone(), cpu_big];
    assert_eq!(host_of(&needs, &hosts), 3);
    // A host whose GPUs are all leased before one with free GPUs.
    let hosts = vec![gpu_host.clone(), busy_gpu];
    assert_eq!(host_of(&needs, &hosts), 1);
    // A GPU host only when nothing else has a slot.
    let mut full = cpu_small;
    full.free_slots = 0;
    assert_eq!(host_of(&needs, &[full, gpu_host]), 1);
}

#[test]
fn zero_gpu_job_needs_only_a_slot_and_tags() {
    let hosts = vec![host("a", &[("queue", "cpu")], 1, vec![])];
    let (t, r) = (tags(&[("queue", "cpu")]), gpus(0));
    let p = both(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts).expect("fits");
    assert_eq!(p, Placement { host: 0, gpus: vec![] });
}

#[test]
fn reason_no_agent_connected() {
    let (t, r) = (tags(&[]), gpus(1));
    assert_eq!(reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &[]), "no agent is connected");
}

#[test]
fn reason_missing_tag() {
    let hosts = vec![host("a", &[("queue", "big")], 4, h100("a", 4)), host("b", &[("arch", "arm64")], 4, vec![])];
    let r = gpus(1);
    let t = tags(&[("queue", "cuda")]);
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts),
        "no connected agent has tag queue=cuda"
    );
    // Each tag exists, but not together.
    let t = tags(&[("queue", "big"), ("arch", "arm64")]);
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts),
        "no connected agent has all of the tags arch=arm64, queue=big"
    );
}

#[test]
fn reason_no_container_runtime() {
    let mut a = host("a", &[("queue", "cuda")], 4, h100("a", 4));
    a.container_runtime = false;
    let mut b = host("b", &[("queue", "big")], 4, h100("b", 4));
    b.container_runtime = true;
    let (t, r) = (tags(&[("queue", "cuda")]), gpus(1));
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: true, deadline: None }, &[a.clone(), b]),
        "needs a container runtime; no agent with tag queue=cuda has podman or docker"
    );
    let t = tags(&[]);
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: true, deadline: None }, &[a]),
        "needs a container runtime; no connected agent has podman or docker"
    );
}

#[test]
fn reason_no_gpu_matches() {
    let a = host("a", &[], 4, vec![gpu("GPU-a-0", 0, "NVIDIA A10", 24, (8, 6))]);
    let t = tags(&[]);
    let r = GpuRequirements { count: 1, model: Some("H100*".into()), ..Default::default() };
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, std::slice::from_ref(&a)),
        "needs 1 GPU; no GPU matches: model \"NVIDIA A10\" (needs H100*)"
    );
    let r = at_least_gib(1, 40);
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &[a]),
        "needs 1 GPU; no GPU matches: memory 24 GiB (needs >=40 GiB)"
    );
    // The H100s are on another queue: say where we looked.
    let hosts = vec![
        host("a", &[("queue", "cuda")], 4, vec![gpu("GPU-a-0", 0, "NVIDIA L4", 24, (8, 9))]),
        host("b", &[("queue", "big")], 4, h100("b", 4)),
    ];
    let (t, r) =
        (tags(&[("queue", "cuda")]), GpuRequirements { count: 1, model: Some("H100*".into()), ..Default::default() });
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts),
        "needs 1 GPU; no GPU matches on agents with tag queue=cuda: model \"NVIDIA L4\" (needs H100*)"
    );
}

#[test]
fn reason_no_gpu_at_all() {
    let hosts = vec![host("a", &[("queue", "cpu")], 4, vec![])];
    let (t, r) = (tags(&[("queue", "cpu")]), gpus(1));
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts),
        "needs 1 GPU; no agent with tag queue=cpu has a GPU"
    );
}

#[test]
fn reason_all_agents_busy() {
    let mut hosts: Vec<HostView> =
        (0..3).map(|i| host(&format!("h{i}"), &[("queue", "cuda")], 2, h100(&format!("h{i}"), 4))).collect();
    for h in &mut hosts {
        h.free_slots = 0;
    }
    let t = tags(&[("queue", "cuda")]);
    for count in [0, 1, 4] {
        let r = gpus(count);
        assert_eq!(
            reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts),
            "all 3 matching agents are busy (no free job slot)"
        );
    }
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &gpus(1), container: false, deadline: None }, &hosts[..1]),
        "the only matching agent is busy (no free job slot)"
    );
}

#[test]
fn reason_leased_to_other_jobs() {
    let mut a = host("a", &[], 4, h100("a", 2));
    for g in &mut a.gpus {
        g.state = GpuSlotState::Leased { job_id: "other".into() };
    }
    let (t, r) = (tags(&[]), gpus(2));
    let needs = Needs { tags: &t, gpu: &r, container: false, deadline: None };
    assert_eq!(reason(&needs, &[a.clone()]), "needs 2 GPUs; 2 matching GPUs are leased to other jobs");
    a.gpus[0].state = GpuSlotState::Free;
    assert_eq!(reason(&needs, &[a]), "needs 2 GPUs; best host has 1 free, 1 matching GPU is leased to other jobs");
}

#[test]
fn reason_host_too_small() {
    let hosts = vec![host("a", &[], 4, h100("a", 4))];
    let (t, r) = (tags(&[]), at_least_gib(8, 40));
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts),
        "needs 8 GPUs with >=40 GiB; best host has 4 free"
    );
    let mut hosts = hosts;
    hosts[0].gpus[0].state = GpuSlotState::Leased { job_id: "other".into() };
    assert_eq!(
        reason(&Needs { tags: &t, gpu: &r, container: false, deadline: None }, &hosts),
        "needs 8 GPUs with >=40 GiB; best host has 4 matching, 3 free"
    );
}

#[test]
fn release_leaves_other_jobs_gpus_alone() {
    let mut cluster = Cluster::new(vec![host("a", &[], 4, h100("a", 2))]);
    let (t, r) = (tags(&[]), gpus(1));
    let needs = Needs { tags: &t, gpu: &r, container: false, deadline: None };
    let p1 = cluster.place_and_apply("j1", &needs).expect("fits");
    let p2 = cluster.place_and_apply("j2", &needs).expect("fits");
    assert_eq!(cluster.release(0, "j1", &p2.gpus), 0, "j1 does not hold j2's GPU");
    assert_eq!(cluster.release(0, "j1", &p1.gpus), 1);
    assert_eq!(cluster.hosts()[0].gpus[1].state, GpuSlotState::Leased { job_id: "j2".into() });
    assert_eq!(cluster.place_and_apply("j3", &needs).expect("fits").gpus, p1.gpus);
}

#[test]
fn cluster_follows_host_changes() {
    let mut cluster = Cluster::new(vec![host("a", &[("queue", "cuda")], 4, h100("a", 1))]);
    let (t, r) = (tags(&[("queue", "big")]), gpus(1));
    let needs = Needs { tags: &t, gpu: &r, container: false, deadline: None };
    assert!(cluster.place(&needs).is_err());
    let b = cluster.push_host(host("b", &[("queue", "big")], 4, h100("b", 1)));
    assert_eq!(cluster.place(&needs).expect("b fits").host, b);
    cluster.replace_host(b, host("b", &[("queue", "cuda")], 4, h100("b", 1)));
    assert_eq!(cluster.place(&needs).expect_err("b retagged").reason, "no connected agent has tag queue=big");
    cluster.replace_host(0, host("a", &[("queue", "big")], 4, h100("a", 1)));
    assert_eq!(cluster.place(&needs).expect("a retagged").host, 0);
    // The indexed cluster and the reference agree on the edited hosts.
    assert_eq!(cluster.place(&needs), place(&needs, cluster.hosts()));
}

/// A host that ends by itself (a Slurm allocation) takes no job that may outlive it; a host
/// that lasts is preferred over none, and a job without a timeout may start anywhere.
#[test]
fn a_job_goes_only_where_its_timeout_fits_before_the_host_ends() {
    let now = 1_000_000_000;
    let mut a = host("a", &[], 4, h100("a", 1));
    a.ends_at_ms = Some(now + 30 * 60_000);
    let mut b = host("b", &[], 4, h100("b", 1));
    b.ends_at_ms = Some(now + 2 * 3_600_000 + 60_000);
    let (t, r) = (tags(&[]), gpus(1));
    let hour = Some(Deadline { now_ms: now, runs_for_ms: 3_600_000 });
    let needs = Needs { tags: &t, gpu: &r, container: false, deadline: hour };
    assert_eq!(host_of(&needs, &[a.clone(), b.clone()]), 1, "a ends in 30m, b in 2h 1m");
    assert_eq!(
        reason(&needs, std::slice::from_ref(&a)),
        "may run for 1h (its timeout); no agent that could take it now lasts that long (the most left is 30m: the end of its allocation)"
    );
    let short = Some(Deadline { now_ms: now, runs_for_ms: 20 * 60_000 });
    assert_eq!(host_of(&Needs { deadline: short, ..needs.clone() }, std::slice::from_ref(&a)), 0);
    assert_eq!(host_of(&Needs { deadline: None, ..needs.clone() }, std::slice::from_ref(&a)), 0);
    // Too short and busy: the time is the reason, where some host could take it now.
    let mut full = b.clone();
    full.free_slots = 0;
    assert!(reason(&needs, &[a.clone(), full.clone()]).contains("the most left is 30m"));
    // Only busy hosts: busy is the reason, as before.
    assert_eq!(reason(&needs, &[full]), "the only matching agent is busy (no free job slot)");
    // A lasting host beats an ending one however the keys rank them.
    let lasting = host("c", &[], 4, h100("c", 4));
    assert_eq!(host_of(&needs, &[a, lasting]), 1);
}

/// Issue 26: an agent that takes no jobs (its disk quota cannot be set up, no working
/// sandbox) offers no slot; a job it would fit was told "busy (no free job slot)" until its
/// queue timeout. It is named with its own reason, in both implementations.
#[test]
fn an_agent_that_takes_no_jobs_is_never_called_busy() {
    let why = "disk quota unavailable: no project quota on /var/lib/gpuci (or start it with --job-disk none)";
    let mut refusing = host("quota", &[], 0, h100("q", 2));
    refusing.refuses = Some(why.into());
    let (t, r) = (tags(&[]), gpus(1));
    let needs = Needs { tags: &t, gpu: &r, container: false, deadline: None };
    assert_eq!(reason(&needs, std::slice::from_ref(&refusing)), format!("agent quota takes no jobs: {why}"));
    // A CPU-only job too.
    let cpu = gpus(0);
    let cpu_needs = Needs { gpu: &cpu, ..needs.clone() };
    assert_eq!(reason(&cpu_needs, std::slice::from_ref(&refusing)), format!("agent quota takes no jobs: {why}"));
    // Beside a host that is busy for real: both are said.
    let mut full = host("full", &[], 1, h100("f", 2));
    full.free_slots = 0;
    assert_eq!(
        reason(&needs, &[refusing.clone(), full.clone()]),
        format!("agent quota takes no jobs: {why}; the other matching agent is busy (no free job slot)")
    );
    // Two refusing: counted, the first named.
    let mut second = refusing.clone();
    second.name = "quota2".into();
    second.agent_id = "agent-quota2".into();
    assert_eq!(reason(&needs, &[refusing, second]), format!("2 matching agents take no jobs (agent quota: {why})"));
    // Only busy: as before.
    assert_eq!(reason(&needs, &[full]), "the only matching agent is busy (no free job slot)");
}

// A pass over a queue (`placement::pass`): what the scheduler applies.

mod a_pass {
    use super::*;
    use gpuci_core::placement::pass::{pass, pass_batched, same_but_numbers, tell, Batch, Candidate, Counts, Decision};

    fn ready<'a>(id: i64, t: &'a BTreeMap<String, String>, g: &'a GpuRequirements, told: &'a str) -> Candidate<'a> {
        Candidate {
            id,
            needs: Needs { tags: t, gpu: g, container: false, deadline: None },
            blocked: None,
            group: None,
            told,
            fleet_note: None,
            held: false,
        }
    }

    fn placed(d: &[Decision]) -> Vec<i64> {
        d.iter().filter_map(|d| if let Decision::Placed { id, .. } = d { Some(*id) } else { None }).collect()
    }

    #[test]
    fn jobs_take_capacity_in_queue_order_and_the_rest_are_told_why_once() {
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 2))]);
        let (t, one) = (tags(&[]), gpus(1));
        let jobs = (1..=5).map(|id| ready(id, &t, &one, ""));
        let d = pass(&mut cluster, jobs, |_, r| r, Counts::Refresh);
        assert_eq!(placed(&d), [1, 2]);
        let Decision::Unplaced { id: 3, reason: Some(why) } = &d[2] else { panic!("{:?}", d[2]) };
        assert!(why.contains("leased"), "{why}");
        // A job already told that reason is not told again.
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 2))]);
        let told = why.clone();
        let d = pass(
            &mut cluster,
            (1..=4).map(|id| ready(id, &t, &one, if id > 2 { &told } else { "" })),
            |_, r| r,
            Counts::Refresh,
        );
        assert_eq!(&d[2..], [Decision::Unplaced { id: 3, reason: None }, Decision::Unplaced { id: 4, reason: None }]);
    }

    #[test]
    fn a_reason_whose_counts_alone_changed_is_given_again_only_when_counts_are_refreshed() {
        // Told when one of the host's two GPUs was leased; now both are (a job placed
        // elsewhere in the meantime): the same words, another count.
        let (t, one) = (tags(&[]), gpus(1));
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 2))]);
        let d = pass(&mut cluster, (1..=3).map(|id| ready(id, &t, &one, "")), |_, r| r, Counts::Refresh);
        let Decision::Unplaced { id: 3, reason: Some(now) } = &d[2] else { panic!("{:?}", d[2]) };
        let told = now.replacen('2', "1", 1);
        assert_ne!(&told, now);
        assert!(same_but_numbers(&told, now), "{told} / {now}");
        let (tr, or) = (&t, &one);
        let queue = |told: &'static str| (1..=4).map(move |id| ready(id, tr, or, if id > 2 { told } else { "" }));
        let told: &'static str = Box::leak(told.into_boxed_str());
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 2))]);
        let d = pass(&mut cluster, queue(told), |_, r| r, Counts::Keep);
        assert_eq!(&d[2..], [Decision::Unplaced { id: 3, reason: None }, Decision::Unplaced { id: 4, reason: None }]);
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 2))]);
        let d = pass(&mut cluster, queue(told), |_, r| r, Counts::Refresh);
        assert_eq!(d[2], Decision::Unplaced { id: 3, reason: Some(now.clone()) });
        // Other words are given at once, counts kept or not.
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 2))]);
        let d = pass(&mut cluster, queue("needs 1 GPU; no GPU matches: 3 of them are A100"), |_, r| r, Counts::Keep);
        assert_eq!(d[3], Decision::Unplaced { id: 4, reason: Some(now.clone()) });
        // And so are reasons a job waits for (a dependency, a group), numbers or not.
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 2))]);
        let mut job = ready(5, &t, &one, "waiting for job 17");
        job.blocked = Some("waiting for job 18".into());
        let d = pass(&mut cluster, [job], |_, r| r, Counts::Keep);
        assert_eq!(d[0], Decision::Waits { id: 5, reason: Some("waiting for job 18".into()) });
    }

    #[test]
    fn words_are_compared_with_every_number_taken_as_one() {
        assert!(same_but_numbers(
            "needs 1 GPU; 7 matching GPUs are leased",
            "needs 1 GPU; 12 matching GPUs are leased"
        ));
        assert!(same_but_numbers("all 2 matching agents are busy", "all 2000 matching agents are busy"));
        assert!(same_but_numbers("", ""));
        assert!(!same_but_numbers("needs 1 GPU; 7 leased", "needs 1 GPU; 7 leased, 1 quarantined"));
        assert!(!same_but_numbers("needs 2 GPUs", "needs 2 GPU"));
        assert!(!same_but_numbers("best host has 1 free", "best host has free"));
        assert!(!same_but_numbers("x7", "x"));
    }

    #[test]
    fn a_full_shape_is_not_asked_again_and_another_shape_still_fits() {
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 1)), host("b", &[("cpu", "y")], 4, vec![])]);
        let (none, cpu, one, zero) = (tags(&[]), tags(&[("cpu", "y")]), gpus(1), gpus(0));
        let asked = std::cell::Cell::new(0);
        let jobs = vec![
            ready(1, &none, &one, ""),
            ready(2, &none, &one, ""),
            ready(3, &none, &one, ""),
            ready(4, &cpu, &zero, ""),
        ];
        let d = pass(
            &mut cluster,
            jobs,
            |_, r| {
                asked.set(asked.get() + 1);
                format!("reworded: {r}")
            },
            Counts::Refresh,
        );
        assert_eq!(placed(&d), [1, 4]);
        assert_eq!(asked.get(), 1, "one shape found full, reworded once");
        for i in [1, 2] {
            let Decision::Unplaced { reason: Some(r), .. } = &d[i] else { panic!("{:?}", d[i]) };
            assert!(r.starts_with("reworded: "), "{r}");
        }
    }

    #[test]
    fn blocked_jobs_wait_and_one_job_of_a_concurrency_group_is_placed_per_pass() {
        use gpuci_core::concurrency::{group_key, TrustClass};
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 4))]);
        let (t, one) = (tags(&[]), gpus(1));
        let repo = gpuci_core::repo::RepoId::parse("o/r", "github.com").unwrap();
        let key = group_key("deploy", Some(&repo), TrustClass::Trusted, &[]);
        let mut jobs = vec![ready(1, &t, &one, ""), ready(2, &t, &one, ""), ready(3, &t, &one, "")];
        jobs[0].blocked = Some("waiting for `build`".into());
        jobs[1].group = Some(key.clone());
        jobs[2].group = Some(key);
        let d = pass(&mut cluster, jobs, |_, r| r, Counts::Refresh);
        assert_eq!(d[0], Decision::Waits { id: 1, reason: Some("waiting for `build`".into()) });
        assert_eq!(placed(&d), [2]);
        let Decision::Waits { id: 3, reason: Some(r) } = &d[2] else { panic!("{:?}", d[2]) };
        assert!(r.contains("concurrency group"), "{r}");
    }

    /// What a pass decided for each job, a batch's waiting jobs each on its own.
    fn per_job(d: &[Decision], batches: &[(usize, Vec<i64>)]) -> BTreeMap<i64, String> {
        let mut out = BTreeMap::new();
        for d in d {
            match d {
                Decision::Placed { id, placement } => {
                    out.insert(*id, format!("placed on {} {:?}", placement.host, placement.gpus))
                }
                Decision::Unplaced { id, reason } => out.insert(*id, format!("waits: {reason:?}")),
                Decision::Waits { id, reason } => out.insert(*id, format!("blocked: {reason:?}")),
                Decision::BatchWaits { batch, from, reason } => {
                    for id in &batches[*batch].1[*from..] {
                        out.insert(*id, format!("waits: {:?}", Some(reason.clone())));
                    }
                    None
                }
            };
        }
        out
    }

    proptest::proptest! {
        /// Jobs given as batches (by shape) are decided as the same jobs one by one: the same
        /// places in queue order, the same reasons, whatever the mix of shapes, blocked and
        /// grouped jobs around them.
        #[test]
        fn batches_are_decided_as_their_jobs_one_by_one(
            hosts in proptest::collection::vec((0u32..4, 0u32..5, proptest::bool::ANY), 0..5),
            queue in proptest::collection::vec((0usize..4, 0u8..6), 0..60),
        ) {
            use gpuci_core::concurrency::{group_key, TrustClass};
            let hosts: Vec<HostView> = hosts
                .iter()
                .enumerate()
                .map(|(i, (n, slots, cpu))| {
                    let name = format!("h{i}");
                    let t: &[(&str, &str)] = if *cpu { &[("cpu", "y")] } else { &[] };
                    host(&name, t, *slots, h100(&name, *n))
                })
                .collect();
            let shapes = [(tags(&[]), gpus(1)), (tags(&[]), gpus(2)), (tags(&[("cpu", "y")]), gpus(0)), (tags(&[]), gpus(0))];
            let key = group_key("g", None, TrustClass::Untrusted, &[]);
            // Kind 0: blocked; 1: in a group; otherwise plain (batched in the second pass).
            let one_by_one = queue.iter().enumerate().map(|(i, (shape, kind))| {
                let mut c = ready(i as i64 + 1, &shapes[*shape].0, &shapes[*shape].1, "");
                match kind {
                    0 => c.blocked = Some("waiting for `build`".into()),
                    1 => c.group = Some(key.clone()),
                    _ => {}
                }
                c
            });
            let expected = pass(&mut Cluster::new(hosts.clone()), one_by_one, |_, r| format!("said: {r}"), Counts::Keep);
            let singles = queue.iter().enumerate().filter(|(_, (_, k))| *k < 2).map(|(i, (shape, kind))| {
                let mut c = ready(i as i64 + 1, &shapes[*shape].0, &shapes[*shape].1, "");
                match kind {
                    0 => c.blocked = Some("waiting for `build`".into()),
                    _ => c.group = Some(key.clone()),
                }
                c
            });
            let ids: Vec<(usize, Vec<i64>)> = (0..shapes.len())
                .map(|s| (s, queue.iter().enumerate().filter(|(_, (sh, k))| *k >= 2 && *sh == s).map(|(i, _)| i as i64 + 1).collect()))
                .filter(|(_, ids): &(usize, Vec<i64>)| !ids.is_empty())
                .collect();
            let batches: Vec<Batch<'_>> = ids
                .iter()
                .map(|(s, ids)| Batch { needs: Needs { tags: &shapes[*s].0, gpu: &shapes[*s].1, container: false, deadline: None }, ids })
                .collect();
            let mut cluster = Cluster::new(hosts.clone());
            let got = pass_batched(&mut cluster, singles, &batches, |_, r| format!("said: {r}"), Counts::Keep);
            proptest::prop_assert_eq!(per_job(&got, &ids), per_job(&expected, &[]));
            // Decided in queue order: the placements come in the order the one-by-one pass made them.
            proptest::prop_assert_eq!(placed(&got), placed(&expected));
        }
    }

    #[test]
    fn a_batch_whose_shape_is_full_is_decided_at_once() {
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 2))]);
        let (t, one) = (tags(&[]), gpus(1));
        let ids: Vec<i64> = (1..=100_000).collect();
        let batch = Batch { needs: Needs { tags: &t, gpu: &one, container: false, deadline: None }, ids: &ids };
        let asked = std::cell::Cell::new(0);
        let d = pass_batched(
            &mut cluster,
            std::iter::empty(),
            &[batch],
            |_, r| {
                asked.set(asked.get() + 1);
                r
            },
            Counts::Keep,
        );
        assert_eq!(placed(&d), [1, 2]);
        let [_, _, Decision::BatchWaits { batch: 0, from: 2, reason }] = &d[..] else { panic!("{d:?}") };
        assert!(reason.contains("leased"), "{reason}");
        assert_eq!(asked.get(), 1);
        assert!(tell("", reason, Counts::Keep));
        assert!(!tell(&reason.replacen('2', "7", 1), reason, Counts::Keep));
        assert!(tell(&reason.replacen('2', "7", 1), reason, Counts::Refresh));
    }

    #[test]
    fn the_fleets_word_is_added_and_a_job_held_by_its_budget_hears_only_that() {
        let mut cluster = Cluster::new(vec![host("a", &[], 8, h100("a", 1))]);
        let (t, two) = (tags(&[]), gpus(2));
        let mut jobs = vec![ready(1, &t, &two, ""), ready(2, &t, &two, "")];
        jobs[0].fleet_note = Some("a machine is on its way");
        jobs[1].fleet_note = Some("the repository's budget is reached");
        jobs[1].held = true;
        let d = pass(&mut cluster, jobs, |_, r| r, Counts::Refresh);
        let Decision::Unplaced { reason: Some(r1), .. } = &d[0] else { panic!("{:?}", d[0]) };
        assert!(r1.ends_with("; a machine is on its way"), "{r1}");
        assert_eq!(d[1], Decision::Unplaced { id: 2, reason: Some("the repository's budget is reached".into()) });
    }
}
