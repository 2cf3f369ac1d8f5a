//! The GitHub integration's records: deliveries, workflow job records, runners, approvals and
//! check runs.

use crate::pg;
use gpuci_store::*;

/// The GitHub integration's records: deliveries deduplicate, job records insert once, runners,
/// approvals per SHA and check run ids round-trip.
async fn github_suite(s: &dyn Store) {
    assert!(s.record_delivery("d-1", "workflow_job", 1).await.unwrap());
    assert!(!s.record_delivery("d-1", "workflow_job", 2).await.unwrap(), "a redelivery is not new");
    assert!(s.record_delivery("d-2", "ping", 3).await.unwrap());

    // Queued for the leader (a standby's deliveries): recorded as deliveries too, so a
    // redelivery to either path is known; taken once, oldest first, with their bodies.
    assert!(s.queue_delivery("d-3", "workflow_job", br#"{"n":3}"#, 5).await.unwrap());
    assert!(s.queue_delivery("d-4", "push", &[0, 159, 255], 4).await.unwrap());
    assert!(!s.queue_delivery("d-3", "workflow_job", b"again", 6).await.unwrap(), "a redelivery is not new");
    assert!(!s.queue_delivery("d-1", "workflow_job", b"{}", 6).await.unwrap(), "handled by the leader already");
    assert!(!s.record_delivery("d-4", "push", 7).await.unwrap(), "queued is recorded");
    let taken = s.take_queued_deliveries(10).await.unwrap();
    let got: Vec<_> =
        taken.iter().map(|d| (d.delivery.as_str(), d.event.as_str(), d.body.as_slice(), d.received_at_ms)).collect();
    assert_eq!(got, vec![("d-4", "push", &[0u8, 159, 255][..], 4), ("d-3", "workflow_job", &br#"{"n":3}"#[..], 5)]);
    assert!(s.take_queued_deliveries(10).await.unwrap().is_empty(), "taken once");
    for i in 0..5 {
        assert!(s.queue_delivery(&format!("q-{i}"), "push", b"{}", 100 + i).await.unwrap());
    }
    let first = s.take_queued_deliveries(2).await.unwrap();
    assert_eq!(first.iter().map(|d| d.delivery.as_str()).collect::<Vec<_>>(), ["q-0", "q-1"]);
    assert_eq!(s.take_queued_deliveries(10).await.unwrap().len(), 3);

    let mut job = GithubJobRecord {
        id: 77,
        repository: "octo/gpu".into(),
        run_id: 5,
        name: "test".into(),
        labels: vec!["self-hosted".into(), "gpu".into()],
        pool: "h100".into(),
        state: "queued".into(),
        runner_job_id: None,
        runner_name: None,
        reason: "queued".into(),
        queued_at_ms: 10,
        updated_at_ms: 10,
        runner_exits: 0,
        last_runner_exit: None,
        check_failures: 0,
        retry_at_ms: None,
    };
    assert!(s.insert_github_job(&job).await.unwrap());
    let mut twice = job.clone();
    twice.name = "other".into();
    assert!(!s.insert_github_job(&twice).await.unwrap());
    assert_eq!(s.get_github_job(77).await.unwrap().unwrap(), job);
    // The backoff state survives a restart: it is in the record.
    job.runner_exits = 3;
    job.last_runner_exit = Some("exit 0, 'Must not run interactively with sudo'".into());
    job.check_failures = 2;
    job.retry_at_ms = Some(12_345);
    s.put_github_job(&job).await.unwrap();
    assert_eq!(s.get_github_job(77).await.unwrap().unwrap(), job);
    job.state = "completed".into();
    job.runner_name = Some("gpuci-1".into());
    s.put_github_job(&job).await.unwrap();
    assert_eq!(s.get_github_job(77).await.unwrap().unwrap().runner_name.as_deref(), Some("gpuci-1"));
    assert!(s.github_jobs(true, 10).await.unwrap().is_empty());
    assert_eq!(s.github_jobs(false, 10).await.unwrap().len(), 1);
    assert!(s.get_github_job(78).await.unwrap().is_none());

    let mut runner = RunnerRecord {
        name: "gpuci-1".into(),
        job_id: 3,
        pool: "h100".into(),
        repository: "octo/gpu".into(),
        org: None,
        runner_id: None,
        github_job_id: None,
        state: "queued".into(),
        created_at_ms: 1,
        updated_at_ms: 1,
    };
    s.put_runner(&runner).await.unwrap();
    assert_eq!(s.runners(true).await.unwrap(), vec![runner.clone()]);
    runner.state = "done".into();
    runner.runner_id = Some(9);
    s.put_runner(&runner).await.unwrap();
    assert!(s.runners(true).await.unwrap().is_empty());
    assert_eq!(s.get_runner("gpuci-1").await.unwrap().unwrap().runner_id, Some(9));

    let approval = ApprovalRecord {
        repository: "octo/gpu".into(),
        pr: 4,
        head_sha: "abc".into(),
        approved_by: "maintainer".into(),
        approved_at_ms: 5,
    };
    s.put_approval(&approval).await.unwrap();
    assert_eq!(s.get_approval("octo/gpu", 4, "abc").await.unwrap(), Some(approval));
    assert_eq!(s.get_approval("octo/gpu", 4, "def").await.unwrap(), None, "an approval is for one SHA");

    assert_eq!(s.get_check_run(3).await.unwrap(), None);
    s.set_check_run(3, 1234).await.unwrap();
    assert_eq!(s.get_check_run(3).await.unwrap(), Some(1234));
}

#[tokio::test]
async fn sqlite_file_store_passes_github_suite() {
    let dir = tempfile::tempdir().unwrap();
    github_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_github_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("github").await).await.unwrap();
    github_suite(&s).await;
}

/// Replay protection (docs/github.md): a body that starts work is recorded once. The same
/// delivery id again (GitHub's "Redeliver") is a redelivery; a new id with a body seen before
/// is a replay and records nothing, under whatever event name it comes; queued deliveries
/// (a standby's) are checked the same way, across both paths. Everything is pruned by age,
/// deliveries included, and tombstones of workflow jobs round-trip.
async fn replay_suite(s: &dyn Store) {
    let d = |delivery: &'static str, event: &'static str, sha: Option<&'static str>, now_ms| NewDelivery {
        delivery,
        event,
        body_sha256: sha,
        signature: None,
        now_ms,
    };
    assert_eq!(s.record_delivery_once(&d("r-1", "push", Some("aa"), 10)).await.unwrap(), DeliverySeen::New);
    assert_eq!(
        s.record_delivery_once(&d("r-1", "push", Some("aa"), 11)).await.unwrap(),
        DeliverySeen::Redelivery,
        "GitHub's redelivery reuses the id"
    );
    let replay = DeliverySeen::Replay { delivery: "r-1".into(), event: "push".into() };
    assert_eq!(s.record_delivery_once(&d("r-2", "push", Some("aa"), 12)).await.unwrap(), replay);
    assert_eq!(s.record_delivery_once(&d("r-3", "pull_request", Some("aa"), 12)).await.unwrap(), replay);
    assert_eq!(
        s.queue_delivery_once(&d("r-4", "push", Some("aa"), 13), b"{}").await.unwrap(),
        replay,
        "a standby refuses a replay of a body the leader acted on"
    );
    assert!(s.take_queued_deliveries(10).await.unwrap().is_empty(), "a replay is not queued");
    assert!(s.record_delivery("r-2", "push", 14).await.unwrap(), "a replay records nothing, not even its id");
    assert_eq!(s.queue_delivery_once(&d("r-5", "push", Some("bb"), 15), b"x").await.unwrap(), DeliverySeen::New);
    assert_eq!(
        s.record_delivery_once(&d("r-6", "push", Some("bb"), 16)).await.unwrap(),
        DeliverySeen::Replay { delivery: "r-5".into(), event: "push".into() },
        "the leader refuses a replay of a body a standby queued"
    );
    let queued = s.take_queued_deliveries(10).await.unwrap();
    assert_eq!(queued.len(), 1);
    assert_eq!(queued[0].signature, None, "queued without one");
    // A queued body keeps the signature it came with, for the leader to check again.
    let signed = NewDelivery { signature: Some("sha256=00ff"), ..d("r-9", "push", Some("cc"), 16) };
    assert_eq!(s.queue_delivery_once(&signed, b"y").await.unwrap(), DeliverySeen::New);
    let taken = s.take_queued_deliveries(10).await.unwrap();
    assert_eq!(taken.iter().map(|q| q.signature.as_deref()).collect::<Vec<_>>(), [Some("sha256=00ff")]);
    assert_eq!(s.record_delivery_once(&d("r-7", "ping", None, 17)).await.unwrap(), DeliverySeen::New);

    s.put_github_tombstone(501, "completed", 10).await.unwrap();
    s.put_github_tombstone(501, "in_progress", 11).await.unwrap();
    assert_eq!(s.github_tombstone(501).await.unwrap().as_deref(), Some("completed"), "the first word is kept");
    assert_eq!(s.github_tombstone(502).await.unwrap(), None);
    s.put_github_tombstone(503, "in_progress", 20).await.unwrap();

    let pruned = s.prune_github_records(13).await.unwrap();
    assert_eq!(pruned, Pruned { deliveries: 1, payloads: 1, tombstones: 1 }, "r-1, its body and job 501 are older");
    assert_eq!(
        s.record_delivery_once(&d("r-8", "push", Some("aa"), 30)).await.unwrap(),
        DeliverySeen::New,
        "forgotten after the retention"
    );
    assert_eq!(s.github_tombstone(501).await.unwrap(), None);
    assert_eq!(s.github_tombstone(503).await.unwrap().as_deref(), Some("in_progress"));
    assert!(!s.record_delivery("r-5", "push", 31).await.unwrap(), "younger deliveries are kept");
}

#[tokio::test]
async fn sqlite_file_store_passes_replay_suite() {
    let dir = tempfile::tempdir().unwrap();
    replay_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_replay_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("github_replay").await).await.unwrap();
    replay_suite(&s).await;
}
