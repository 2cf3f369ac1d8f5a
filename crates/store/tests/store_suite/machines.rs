//! Fleet machines and their billing stretches.

use crate::pg;
use gpuci_store::*;

/// Machines of fleets and their billing stretches: upsert by id, active ones listed, one open
/// stretch at a time, closed never before it opened.
async fn machines_suite(s: &dyn Store) {
    let m = MachineRecord {
        id: "m-1".into(),
        fleet: "t4".into(),
        provider_id: None,
        instance_type: "g4dn.xlarge".into(),
        zone: "us-east-1a".into(),
        capacity: "spot".into(),
        price_per_hour: 0.526,
        gpus: 1,
        state: "requested".into(),
        reason: None,
        agent_id: None,
        requested_at_ms: 1_000,
        running_at_ms: None,
        connected_at_ms: None,
        first_job_at_ms: None,
        ended_at_ms: None,
        boot_failed: false,
        interrupted_at_ms: None,
    };
    s.put_machine(&m).await.unwrap();
    let booted = MachineRecord {
        interrupted_at_ms: Some(2_500),
        provider_id: Some("i-0abc".into()),
        state: "ready".into(),
        running_at_ms: Some(2_000),
        connected_at_ms: Some(3_000),
        ..m.clone()
    };
    s.put_machine(&booted).await.unwrap();
    s.put_machine(&MachineRecord { id: "m-2".into(), requested_at_ms: 1_500, ..m.clone() }).await.unwrap();
    assert_eq!(
        s.machines(true).await.unwrap(),
        vec![booted.clone(), MachineRecord { id: "m-2".into(), requested_at_ms: 1_500, ..m.clone() }]
    );

    s.open_billing("m-1", 2_000).await.unwrap();
    s.open_billing("m-1", 2_500).await.unwrap(); // already open: no second stretch
    s.close_billing("m-1", 10_000).await.unwrap();
    s.open_billing("m-1", 20_000).await.unwrap(); // started again
    s.open_billing("m-2", 5_000).await.unwrap();
    s.close_billing("m-2", 4_000).await.unwrap(); // a clock that stepped back: an empty stretch
    let all = s.billing_since(0).await.unwrap();
    assert_eq!(
        all,
        vec![
            BillingInterval { machine_id: "m-1".into(), from_ms: 2_000, to_ms: Some(10_000) },
            BillingInterval { machine_id: "m-2".into(), from_ms: 5_000, to_ms: Some(5_000) },
            BillingInterval { machine_id: "m-1".into(), from_ms: 20_000, to_ms: None },
        ]
    );
    let recent = s.billing_since(15_000).await.unwrap();
    assert_eq!(recent, vec![BillingInterval { machine_id: "m-1".into(), from_ms: 20_000, to_ms: None }]);

    s.put_machine(&MachineRecord { state: "ended".into(), ended_at_ms: Some(30_000), ..booted.clone() }).await.unwrap();
    let active: Vec<String> = s.machines(true).await.unwrap().into_iter().map(|m| m.id).collect();
    assert_eq!(active, ["m-2"]);
    assert_eq!(s.machines(false).await.unwrap().len(), 2);
}

#[tokio::test]
async fn sqlite_store_passes_machines_suite() {
    let dir = tempfile::tempdir().unwrap();
    machines_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_machines_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("machines").await).await.unwrap();
    machines_suite(&s).await;
}
