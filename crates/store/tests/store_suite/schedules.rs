//! Schedules: exactly-once fires, arming, and fires cut short by a stop.

use crate::pg;
use gpuci_store::*;

/// Schedules: a fire is recorded once per occurrence (the exactly-once guard across
/// restarts), armed once, and fires cut short by a stop are marked.
async fn schedules_suite(s: &dyn Store) {
    assert_eq!(s.schedules_last_checked().await.unwrap(), None);
    assert_eq!(s.arm_schedule("nightly", 1_000).await.unwrap(), 1_000);
    assert_eq!(s.arm_schedule("nightly", 9_000).await.unwrap(), 1_000, "armed once");
    s.schedule_checked("nightly", 5_000).await.unwrap();
    assert_eq!(s.arm_schedule("nightly", 9_000).await.unwrap(), 5_000, "last looked at");
    s.schedule_checked("new", 6_000).await.unwrap();
    assert_eq!(s.arm_schedule("new", 9_000).await.unwrap(), 6_000);
    assert_eq!(s.schedules_last_checked().await.unwrap(), Some(6_000));
    let fire = |cause: &str, at: i64| ScheduleFireRecord {
        id: 0,
        schedule: "nightly".into(),
        cause: cause.into(),
        scheduled_at_ms: at,
        fired_at_ms: at + 5,
        skipped_from_ms: None,
        pipeline_id: None,
        error: None,
    };
    assert_eq!(s.last_cron_fire("nightly").await.unwrap(), None);
    let a = s.record_schedule_fire(&fire("cron", 60_000)).await.unwrap().expect("first");
    assert_eq!(s.record_schedule_fire(&fire("cron", 60_000)).await.unwrap(), None, "an occurrence fires once");
    let b = s.record_schedule_fire(&fire("manual", 60_000)).await.unwrap().expect("a manual run is its own");
    let c = s.record_schedule_fire(&fire("cron", 120_000)).await.unwrap().expect("the next occurrence");
    assert_eq!(s.last_cron_fire("nightly").await.unwrap(), Some(120_000));
    s.finish_schedule_fire(a, Some(7), None).await.unwrap();
    s.finish_schedule_fire(b, None, Some("git: no such repository")).await.unwrap();
    assert_eq!(s.interrupt_schedule_fires("stopped").await.unwrap(), 1);
    let all = s.schedule_fires(Some("nightly"), 10).await.unwrap();
    assert_eq!(all.iter().map(|f| f.id).collect::<Vec<_>>(), [c, b, a], "newest first");
    assert_eq!((all[2].pipeline_id, all[2].error.as_deref()), (Some(7), None));
    assert_eq!(all[1].error.as_deref(), Some("git: no such repository"));
    assert_eq!(all[0].error.as_deref(), Some("stopped"));
    assert_eq!(all[0].fired_at_ms, 120_005);
    assert!(s.schedule_fires(Some("other"), 10).await.unwrap().is_empty());
    assert_eq!(s.schedule_fires(None, 2).await.unwrap().len(), 2);
}

#[tokio::test]
async fn sqlite_store_passes_schedules_suite() {
    let dir = tempfile::tempdir().unwrap();
    schedules_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_schedules_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("schedules").await).await.unwrap();
    schedules_suite(&s).await;
}
