//! Regression: the scheduler's indexed cluster must respect job slots for jobs without GPUs.
use gpuci_core::gpu::GpuRequirements;
use gpuci_core::placement::{Cluster, HostView, Needs};
use std::collections::BTreeMap;

#[test]
fn zero_gpu_jobs_never_exceed_a_hosts_slots() {
    let host = HostView {
        agent_id: "a".into(),
        name: "a".into(),
        tags: BTreeMap::new(),
        free_slots: 2,
        total_slots: 2,
        container_runtime: false,
        gpus: Vec::new(),
        ends_at_ms: None,
        refuses: None,
    };
    let mut c = Cluster::new(vec![host]);
    let tags = BTreeMap::new();
    let gpu = GpuRequirements::default();
    let needs = Needs { tags: &tags, gpu: &gpu, container: false, deadline: None };
    assert!(c.place_and_apply("1", &needs).is_ok());
    assert!(c.place_and_apply("2", &needs).is_ok());
    let third = c.place_and_apply("3", &needs);
    assert!(third.is_err(), "a third job was placed on a 2-slot host: {third:?}");
    assert_eq!(c.hosts()[0].free_slots, 0);
}
