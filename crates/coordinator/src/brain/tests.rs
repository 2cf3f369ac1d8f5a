//! Tests of the brain's pure helpers and of state that must survive a restart.

use super::secrets::secret_source;
use super::*;

/// Regression: a stored origin that does not parse fell into the "submitted through the
/// API" branch, which may have every secret.
#[test]
fn a_pipeline_whose_origin_cannot_be_read_gets_no_secret() {
    let p = gpuci_store::PipelineRecord {
        id: 1,
        file_name: "x.yml".into(),
        source: String::new(),
        workspace_upload: None,
        repository: Some("https://github.com/acme/x.git".into()),
        origin: Some("{\"kind\": \"from-the-future\"".into()),
        created_at_ms: 0,
    };
    let s = secret_source(Some(&p), "github.com");
    assert!(!s.may_have_secrets, "{s:?}");
    let api = gpuci_store::PipelineRecord { origin: None, ..p };
    assert!(secret_source(Some(&api), "github.com").may_have_secrets);
}

/// Regression (outsider attack): a cancel accepted (stored, acknowledged, sent) was only
/// remembered in memory; after a restart the coordinator neither sent it again nor judged
/// the job's result as cancelled, and the job ran to `succeeded`. The stored reason is the
/// record of it, and a restarted coordinator picks it up.
#[tokio::test]
async fn a_cancel_accepted_before_a_restart_is_still_under_way_after_it() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let job = |state| gpuci_store::NewJob { state, ..queued(gpuci_core::pipeline::Step::new("a", "sleep 60")) };
    let (_, jobs) =
        store.create_pipeline(new_pipeline(), vec![job(JobState::Queued), job(JobState::Queued)]).await.unwrap();
    store.set_reason(jobs[0].id, &format!("{CANCELLING}cancelled by user")).await.unwrap();
    let (key, _) = gpuci_store::SecretsKey::generate();
    let brain = Brain::load(store, Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    assert_eq!(brain.cancelling.get(&jobs[0].id).map(String::as_str), Some("cancelled by user"));
    assert!(!brain.cancelling.contains_key(&jobs[1].id));
}

#[test]
fn silence_is_counted_only_while_the_coordinator_ran() {
    let t0 = Instant::now();
    let s = |secs| Duration::from_secs(secs);
    let tick = Duration::from_millis(200);
    // Heard at t0; the coordinator ran 5 s, then stalled 15 s: 5.2 s of silence counted.
    let heard = heard_after_stall(t0, s(15), tick, t0 + s(20));
    assert_eq!((t0 + s(20)).duration_since(heard), s(5) + tick);
    // Heard during the stall's last moments (a message read on waking): never in the future.
    assert_eq!(heard_after_stall(t0 + s(19), s(15), tick, t0 + s(20)), t0 + s(20));
    assert!(!stalled(t0, t0 + Duration::from_millis(900), tick), "a late tick is not a stall");
    assert!(stalled(t0, t0 + s(15), tick));
}

/// Regression (outsider attack): a coordinator stalled for 8 s every 9 s gave its agents a
/// fresh `lost_after` at each stall, so a dead agent was never declared lost and its jobs
/// stayed `running`. Silence adds up across stalls.
#[test]
fn a_dead_agent_is_lost_after_lost_after_of_running_time_however_often_the_coordinator_stalls() {
    let t0 = Instant::now();
    let (tick, lost_after) = (Duration::from_millis(200), Duration::from_secs(10));
    let mut last_seen = t0; // the agent died here
    let mut now = t0;
    let mut ran = Duration::ZERO;
    let lost_at = loop {
        // 1 s of running (ticks), then an 8 s stall.
        now += Duration::from_secs(1);
        ran += Duration::from_secs(1);
        if now.saturating_duration_since(last_seen) > lost_after {
            break ran;
        }
        let stall = Duration::from_secs(8);
        now += stall;
        last_seen = heard_after_stall(last_seen, stall, tick, now);
        assert!(ran < Duration::from_secs(60), "never declared lost");
    };
    assert!(lost_at <= lost_after + Duration::from_secs(2), "lost after {lost_at:?} of running time");
}

#[test]
fn an_agent_settles_its_jobs_by_what_its_journal_holds() {
    let ours = [(1, JobState::Assigned), (2, JobState::Running), (3, JobState::Assigned), (4, JobState::Running)];
    let holds = [3, 4, 9];
    let plan = reconcile(&ours, &holds, false, &[]);
    assert_eq!(
        plan,
        Reconciled { keep: vec![3, 4], forget: vec![9], requeue: vec![1], lost: vec![2], cancelled: vec![] }
    );
    // An incomplete journal may have dropped job 1's arrival: it may have run, so it is
    // lost, never handed out again.
    let plan = reconcile(&ours, &holds, true, &[]);
    assert_eq!(
        plan,
        Reconciled { keep: vec![3, 4], forget: vec![9], requeue: vec![], lost: vec![1, 2], cancelled: vec![] }
    );
}

/// A placement pass tells each job of a shape that found no place the same reason without
/// trying it again, yet still checks what only the job can be refused for (a secret it may
/// not have), and a job of another shape is judged on its own.
#[tokio::test]
async fn a_pass_judges_each_shape_once_and_still_checks_each_jobs_secrets() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let step = |key: &str, gpus: u32, secret: Option<&str>| {
        let mut s = gpuci_core::pipeline::Step::new(key, "true");
        s.gpu.count = gpus;
        s.secrets = secret.map(|n| vec![n.to_string()]).unwrap_or_default();
        queued(s)
    };
    let (_, jobs) = store
        .create_pipeline(
            new_pipeline(),
            vec![
                step("a", 1, None),
                step("b", 1, None),
                step("c", 1, None),
                step("d", 2, None),
                step("e", 1, Some("NOPE")),
            ],
        )
        .await
        .unwrap();
    let (key, _) = gpuci_store::SecretsKey::generate();
    let mut brain = Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    connect_fake_agent(&mut brain, "agent-1", 1);
    brain.place_now().await;
    let got = |i: usize| {
        let store = store.clone();
        let id = jobs[i].id;
        async move { store.get_job(id).await.unwrap().unwrap() }
    };
    assert_eq!(got(0).await.state, JobState::Assigned);
    let (b, c, d, e) = (got(1).await, got(2).await, got(3).await, got(4).await);
    assert_eq!((b.state, c.state), (JobState::Queued, JobState::Queued));
    assert!(b.reason.contains("GPU"), "{}", b.reason);
    assert_eq!(b.reason, c.reason, "one shape, one reason");
    assert_eq!(d.state, JobState::Queued);
    assert!(d.reason.contains('2'), "judged on its own needs: {}", d.reason);
    assert_ne!(d.reason, b.reason);
    assert_eq!(e.state, JobState::Failed, "a secret it may not have still ends it at once: {}", e.reason);
    assert!(e.reason.contains("NOPE"), "{}", e.reason);
}

/// A queued job of `step` (its pipeline is set when it is stored).
pub(crate) fn queued(step: gpuci_core::pipeline::Step) -> gpuci_store::NewJob {
    gpuci_store::NewJob {
        pipeline_id: 0,
        step,
        env: BTreeMap::new(),
        state: JobState::Queued,
        reason: "waiting".into(),
        attempt: 1,
        retry_of: None,
        created_at_ms: 1,
    }
}

pub(crate) fn new_pipeline() -> gpuci_store::NewPipeline {
    gpuci_store::NewPipeline {
        file_name: "x.yml".into(),
        source: String::new(),
        workspace_upload: None,
        repository: None,
        origin: None,
        created_at_ms: 1,
    }
}

/// An agent's jobs are a look-up kept with the active jobs: a job moved to another agent, or
/// ended, is no longer its former agent's.
#[tokio::test]
async fn an_agents_jobs_follow_the_job_from_agent_to_agent_and_to_its_end() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let new = queued(gpuci_core::pipeline::Step::new("a", "true"));
    let (_, jobs) = store.create_pipeline(new_pipeline(), vec![new.clone(), new]).await.unwrap();
    let (key, _) = gpuci_store::SecretsKey::generate();
    let mut brain = Brain::load(store, Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    let on = |b: &Brain, agent: &str| b.jobs_on(agent).map(|j| j.id).collect::<Vec<_>>();
    let (mut a, mut b) = (jobs[0].clone(), jobs[1].clone());
    a.state = JobState::Running;
    a.agent_id = Some("agent-1".into());
    b.state = JobState::Assigned;
    b.agent_id = Some("agent-1".into());
    brain.publish(&a);
    brain.publish(&b);
    assert_eq!(on(&brain, "agent-1"), [a.id, b.id]);
    b.agent_id = Some("agent-2".into());
    brain.publish(&b);
    assert_eq!((on(&brain, "agent-1"), on(&brain, "agent-2")), (vec![a.id], vec![b.id]));
    a.state = JobState::Succeeded;
    brain.publish(&a);
    b.state = JobState::Lost;
    brain.publish(&b);
    assert!(on(&brain, "agent-1").is_empty() && on(&brain, "agent-2").is_empty());
    assert!(brain.on_agent.is_empty(), "nothing left behind");
}

/// An agent named `id` with `gpus` H100s, connected (its messages go nowhere).
fn connect_fake_agent(brain: &mut Brain, id: &str, gpus: u32) {
    std::mem::forget(connect_fake_agent_rx(brain, id, gpus));
}

/// [`connect_fake_agent`], with what is sent to the agent.
fn connect_fake_agent_rx(brain: &mut Brain, id: &str, gpus: u32) -> mpsc::UnboundedReceiver<CoordinatorMessage> {
    let gpus = (0..gpus)
        .map(|i| {
            serde_json::from_value::<gpuci_core::gpu::GpuInfo>(serde_json::json!({
                "uuid": if gpus == 1 { "GPU-one".to_string() } else { format!("GPU-{id}-{i}") },
                "index": i, "name": "H100", "memory": 85899345920u64,
                "compute_capability": {"major": 9, "minor": 0}, "driver_version": "550.54",
                "device_node": format!("/dev/nvidia{i}")
            }))
            .unwrap()
        })
        .collect();
    let (tx, rx) = mpsc::unbounded_channel();
    brain.agents.insert(
        id.into(),
        AgentState {
            id: id.into(),
            name: id.into(),
            hostname: id.into(),
            tags: BTreeMap::new(),
            slots: 4,
            gpus,
            health: BTreeMap::new(),
            gpu_backend: "fake".into(),
            isolation: "bubblewrap".into(),
            refuses: None,
            container_runtime: None,
            link: Link::Connected,
            conn: Some((1, tx)),
            last_seen: Instant::now(),
            last_seen_ms: 1,
            reason: String::new(),
            paused: None,
            interrupted: None,
            withdrawn: None,
            first_job_at_ms: None,
            ends_at_ms: None,
        },
    );
    rx
}

/// What one placement pass costs with a long queue behind full GPUs (run by hand:
/// `cargo test --release -p gpuci-coordinator --lib a_placement_pass_with_a_long_queue -- --ignored --nocapture`;
/// `GPUCI_BENCH_JOBS`, `GPUCI_BENCH_AGENTS` change its size). BENCHMARKS.md, "The placement
/// pass with a long queue".
#[tokio::test]
#[ignore = "a benchmark, run by hand"]
async fn a_placement_pass_with_a_long_queue() {
    let n: usize = std::env::var("GPUCI_BENCH_JOBS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let agents: usize = std::env::var("GPUCI_BENCH_AGENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let (key, _) = gpuci_store::SecretsKey::generate();
    let mut step = gpuci_core::pipeline::Step::new("a", "true");
    step.gpu.count = 1;
    // `GPUCI_BENCH_SECRETS=1`: every step names a secret (most real CI jobs do).
    if std::env::var("GPUCI_BENCH_SECRETS").is_ok_and(|v| v == "1") {
        store.set_secret("HF_TOKEN", &key.seal("HF_TOKEN", "hf_x"), 1).await.unwrap();
        step.secrets = vec!["HF_TOKEN".to_string()];
    }
    let new = queued(step);
    let t0 = Instant::now();
    for _ in 0..n.div_ceil(1000) {
        store.create_pipeline(new_pipeline(), vec![new.clone(); 1000]).await.unwrap();
    }
    eprintln!("{n} jobs stored in {:.1} s", t0.elapsed().as_secs_f64());
    let mut brain = Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    for i in 0..agents {
        connect_fake_agent(&mut brain, &format!("agent-{i}"), 4);
    }
    let queued = |b: &Brain| b.active.values().filter(|j| j.state == JobState::Queued).count();
    let t = Instant::now();
    brain.place_now().await;
    let first = t.elapsed();
    let placed = n - queued(&brain);
    eprintln!("first pass: {placed} placed in {:.3} s; {} left queued", first.as_secs_f64(), queued(&brain));
    let passes: usize = std::env::var("GPUCI_BENCH_PASSES").ok().and_then(|v| v.parse().ok()).unwrap_or(5).max(1);
    let mut times = Vec::new();
    for _ in 0..passes {
        let t = Instant::now();
        brain.place_now().await;
        times.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    eprintln!(
        "a pass with every GPU busy and {} queued: median {:.2} ms (of 5: {times:.2?})",
        queued(&brain),
        times[2]
    );
    assert_eq!(placed, (agents * 4).min(n));
}

/// Regression (outsider attack, third round): a database writer copied the coordinator
/// identity key's sealed secret into the secrets table under its sealing name
/// (`gpuci:coordinator-identity`) and named that "secret" in a queued job's stored step; the
/// pass opened it (same key, same name) and gave the installation's private key to the job.
/// Names a pipeline file cannot hold are refused at placement, whatever the stored step says.
#[tokio::test]
async fn a_stored_step_naming_a_secret_no_pipeline_may_name_gets_nothing() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let (key, _) = gpuci_store::SecretsKey::generate();
    for name in ["gpuci:coordinator-identity", "gpuci:coordinator-identity@repo:octo/x"] {
        store.set_secret(name, &key.seal(name, "the private key"), 1).await.unwrap();
    }
    let job = |secret: &str| {
        let mut s = gpuci_core::pipeline::Step::new("a", "env");
        s.secrets = vec![secret.to_string()];
        queued(s)
    };
    let (_, jobs) = store
        .create_pipeline(new_pipeline(), vec![job("gpuci:coordinator-identity"), job("gpuci:coordinator-identity")])
        .await
        .unwrap();
    let mut brain = Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    connect_fake_agent(&mut brain, "agent-1", 1);
    brain.agents.get_mut("agent-1").unwrap().conn = Some((1, tx));
    brain.place_now().await;
    while let Ok(msg) = rx.try_recv() {
        assert!(!format!("{msg:?}").contains("the private key"), "sent to the agent: {msg:?}");
    }
    for j in &jobs {
        let got = store.get_job(j.id).await.unwrap().unwrap();
        assert_eq!(got.state, JobState::Failed, "{}", got.reason);
        assert!(got.reason.contains("gpuci:coordinator-identity"), "{}", got.reason);
    }
}

/// A waiting job's secrets are vetted once while the stored names stay the same (a pass
/// read every queued job's pipeline and secrets: BENCHMARKS.md, "Queued jobs with
/// secrets"); a secret deleted while jobs wait behind a busy GPU still ends them at the next
/// pass, naming it, and one set again is given to the next job placed.
#[tokio::test]
async fn waiting_jobs_are_vetted_again_when_the_stored_secrets_change() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let (key, _) = gpuci_store::SecretsKey::generate();
    store.set_secret("HF_TOKEN", &key.seal("HF_TOKEN", "hf_first"), 1).await.unwrap();
    store.set_secret("WANDB_KEY", &key.seal("WANDB_KEY", "wb"), 1).await.unwrap();
    let job = |secret: &str| {
        let mut s = gpuci_core::pipeline::Step::new("a", "env");
        s.gpu.count = 1;
        s.secrets = vec![secret.to_string()];
        queued(s)
    };
    let (_, jobs) = store
        .create_pipeline(new_pipeline(), vec![job("WANDB_KEY"), job("HF_TOKEN"), job("HF_TOKEN"), job("WANDB_KEY")])
        .await
        .unwrap();
    let mut brain =
        Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key.clone())).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    connect_fake_agent(&mut brain, "agent-1", 1);
    brain.agents.get_mut("agent-1").unwrap().conn = Some((1, tx));
    brain.place_now().await;
    brain.place_now().await;
    let state = |b: &Brain, i: usize| b.active.get(&jobs[i].id).map(|j| j.state);
    assert_eq!(state(&brain, 0), Some(JobState::Assigned));
    assert_eq!(state(&brain, 1), Some(JobState::Queued));
    assert!(rx.try_recv().is_ok(), "the first job was sent");

    store.delete_secret("HF_TOKEN").await.unwrap();
    brain.place_now().await;
    for i in [1, 2] {
        let got = store.get_job(jobs[i].id).await.unwrap().unwrap();
        assert_eq!(got.state, JobState::Failed, "job {i}: {}", got.reason);
        assert!(got.reason.contains("HF_TOKEN"), "{}", got.reason);
    }
    assert_eq!(state(&brain, 3), Some(JobState::Queued), "a job whose secret stays keeps waiting");

    // A new value under the same name (the names' fingerprint changes) is what the next
    // job placed gets.
    store.set_secret("WANDB_KEY", &key.seal("WANDB_KEY", "wb-second"), 2).await.unwrap();
    brain.place_now().await;
    let first = brain.active.get(&jobs[0].id).cloned().unwrap();
    brain.finish(&first, JobState::Succeeded, "done".into(), None, None, Vec::new()).await.unwrap();
    brain.place_now().await;
    assert_eq!(state(&brain, 3), Some(JobState::Assigned));
    let given: Vec<String> = std::iter::from_fn(|| rx.try_recv().ok())
        .filter_map(|m| match m {
            CoordinatorMessage::Assign(a) if a.job_id == jobs[3].id => a.secrets.0.get("WANDB_KEY").cloned(),
            _ => None,
        })
        .collect();
    assert_eq!(given, ["wb-second"]);
}

/// Regression (outsider attack, a leader frozen past its lease): a cancel accepted while the
/// job's agent was away ended the job at once and freed its GPU, so a retry started beside
/// the attempt still running on that agent (both ran for 4.9 s). Now the job stays, keeping
/// its GPU and refusing a retry, until its agent reports it ended or comes back without it;
/// either way it ends `cancelled`, never queued again.
#[tokio::test]
async fn a_job_cancelled_while_its_agent_is_away_keeps_its_gpu_until_the_agent_settles_it() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let job = || {
        let mut s = gpuci_core::pipeline::Step::new("a", "sleep 600");
        s.gpu.count = 1;
        queued(s)
    };
    let (_, jobs) = store.create_pipeline(new_pipeline(), vec![job(), job()]).await.unwrap();
    let (key, _) = gpuci_store::SecretsKey::generate();
    store.insert_agent(&stored_agent("agent-1")).await.unwrap();
    let mut brain = Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    connect_fake_agent(&mut brain, "agent-1", 1);
    brain.place_now().await;
    let (first, second) = (jobs[0].id, jobs[1].id);
    assert_eq!(brain.active.get(&first).map(|j| j.state), Some(JobState::Assigned));

    brain.agent_disconnected("agent-1", "connection closed", false).await;
    let answer = brain.cancel(first, "cancelled by alice".into()).await.unwrap();
    assert!(!answer.state.is_terminal(), "told {answer:?}");
    assert!(answer.reason.starts_with(CANCELLING), "{}", answer.reason);
    let stored = store.get_job(first).await.unwrap().unwrap();
    assert!(!stored.state.is_terminal(), "ended while its agent is away: {stored:?}");
    assert!(
        matches!(brain.retry(first, "alice").await, Err(BrainError::Conflict(_))),
        "a retry while the attempt may still run"
    );

    // The agent comes back holding the job: it is told to cancel it, and the GPU stays
    // leased until it reports the end; the queued job is not placed on it meanwhile.
    let gpus = brain.agents["agent-1"].gpus.clone();
    let hello = |running: Vec<JobId>| agent_1_hello("agent-1", gpus.clone(), running);
    let (tx, mut rx) = mpsc::unbounded_channel();
    brain.agent_connected("agent-1", 2, hello(vec![first]), tx).await.unwrap();
    brain.place_now().await;
    let sent: Vec<CoordinatorMessage> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
    assert!(
        sent.iter().any(|m| matches!(m, CoordinatorMessage::Cancel { job_id, .. } if *job_id == first)),
        "{sent:?}"
    );
    assert!(!sent.iter().any(|m| matches!(m, CoordinatorMessage::Assign(_))), "placed on a GPU still in use: {sent:?}");
    assert_eq!(brain.active.get(&second).map(|j| j.state), Some(JobState::Queued));

    // Gone again, and back without the job (it ended while away): cancelled, not requeued.
    brain.agent_disconnected("agent-1", "connection closed", false).await;
    let (tx, _rx) = mpsc::unbounded_channel();
    brain.agent_connected("agent-1", 3, hello(vec![]), tx).await.unwrap();
    let ended = store.get_job(first).await.unwrap().unwrap();
    assert_eq!((ended.state, ended.reason.as_str()), (JobState::Cancelled, "cancelled by alice"));
    brain.place_now().await;
    assert_eq!(brain.active.get(&second).map(|j| j.state), Some(JobState::Assigned), "the GPU is free now");
}

/// Regression (outsider attack): a standby with a 1 s heartbeat and a 16 s `lost_after` (its
/// own start-up check passed) took over from a leader whose agents had a 5 s heartbeat, and
/// called them lost 16 s after it led, before they had left the frozen leader: a running job
/// ended `lost`. The former leader's heartbeat (in its leader record) now sets how long the
/// agents get.
#[tokio::test]
async fn after_a_takeover_agents_get_the_time_the_former_leaders_heartbeat_needs() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    store.insert_agent(&stored_agent("agent-1")).await.unwrap();
    let (key, _) = gpuci_store::SecretsKey::generate();
    let timing =
        Timing { lost_after: Duration::from_secs(16), heartbeat_interval: Duration::from_secs(1), ..Timing::default() };
    let load = || async {
        let mut b =
            Brain::load(store.clone(), Arc::new(Hub::new()), timing.clone(), Arc::new(key.clone())).await.unwrap();
        connect_fake_agent(&mut b, "agent-1", 1);
        let a = b.agents.get_mut("agent-1").unwrap();
        a.link = Link::Disconnected;
        a.conn = None;
        // Silent for 20 s: past this coordinator's own 16 s.
        a.last_seen = Instant::now() - Duration::from_secs(20);
        b
    };
    let mut plain = load().await;
    plain.reap().await;
    assert_eq!(plain.agents["agent-1"].link, Link::Lost, "without a takeover, 16 s is the limit");

    let mut took_over = load().await.with_takeover_from(Duration::from_secs(5));
    took_over.reap().await;
    assert_ne!(took_over.agents["agent-1"].link, Link::Lost, "a 5 s heartbeat's agents need 25 s");
    took_over.agents.get_mut("agent-1").unwrap().last_seen = Instant::now() - Duration::from_secs(26);
    took_over.reap().await;
    assert_eq!(took_over.agents["agent-1"].link, Link::Lost);
}

/// An agent as registered, for tests that connect it.
/// What agent-1 says when it connects from `hostname` with `gpus`, holding `running`.
fn agent_1_hello(hostname: &str, gpus: Vec<gpuci_core::gpu::GpuInfo>, running: Vec<JobId>) -> Hello {
    Hello {
        protocol: gpuci_protocol::PROTOCOL_VERSION,
        agent_version: "test".into(),
        name: "agent-1".into(),
        hostname: hostname.into(),
        slots: 4,
        tags: BTreeMap::new(),
        gpus,
        gpu_backend: "fake".into(),
        isolation: "bubblewrap".into(),
        container_runtime: None,
        running,
        journal_incomplete: None,
        paused: None,
        interrupted: None,
        ends_at_ms: None,
        refuses: None,
    }
}

pub(crate) fn stored_agent(id: &str) -> gpuci_store::AgentRecord {
    gpuci_store::AgentRecord {
        id: id.into(),
        name: id.into(),
        credential_hash: String::new(),
        registered_at_ms: 1,
        last_seen_ms: None,
        state: "online".into(),
        reason: String::new(),
        hello_json: None,
    }
}

/// Regression (CI: `a_restart_keeps_busy_machines_older_than_boot_timeout`): a restarted
/// coordinator gave its agents `lost_after` from when it loaded its state, not from when it
/// could hear them. A start-up that took long (a slow database, a starved machine) left them
/// nothing, and its first reap ended a running job `lost` before its agent's reconnect, already
/// waiting in the queue, was read.
#[tokio::test]
async fn agents_get_lost_after_from_when_the_scheduler_runs_not_from_when_it_loaded() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    store.insert_agent(&stored_agent("agent-1")).await.unwrap();
    let (key, _) = gpuci_store::SecretsKey::generate();
    let timing = Timing { lost_after: Duration::from_secs(30), tick: Duration::from_millis(100), ..Timing::default() };
    let mut b = Brain::load(store.clone(), Arc::new(Hub::new()), timing, Arc::new(key)).await.unwrap();
    assert_eq!(b.agents["agent-1"].link, Link::Disconnected);
    // As if loading took 40 s: the agent's grace, counted from then, is spent.
    b.agents.get_mut("agent-1").unwrap().last_seen = Instant::now() - Duration::from_secs(40);
    let (_tx, rx) = tokio::sync::mpsc::channel(8);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(b.run(rx, shutdown.clone()));
    // Several ticks: the first reap and those after it.
    tokio::time::sleep(Duration::from_millis(350)).await;
    shutdown.cancel();
    running.await.unwrap();
    let a = store.get_agent("agent-1").await.unwrap().unwrap();
    assert_ne!(a.state, "lost", "{a:?}");
}

/// A long queue on a busy cluster is not rewritten at every pass (issue 29, item 5): a waiting
/// job's reason is given again when only its counts changed ("2 matching GPUs are leased" →
/// "4 …") at most every `REASON_COUNTS_EVERY_MS`, in memory and in the store alike; changed
/// words are given at once. Every job's reason was rewritten (a clone, a store row and a
/// watcher's message each) at every pass whose counts moved: most of a pass with 100,000
/// queued jobs.
#[tokio::test]
async fn a_waiting_jobs_counts_are_refreshed_now_and_then_and_its_words_at_once() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let one = || {
        let mut s = gpuci_core::pipeline::Step::new("a", "true");
        s.gpu.count = 1;
        queued(s)
    };
    let (_, jobs) = store.create_pipeline(new_pipeline(), (0..8).map(|_| one()).collect()).await.unwrap();
    let last = jobs[7].id;
    let (key, _) = gpuci_store::SecretsKey::generate();
    let mut brain = Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    connect_fake_agent(&mut brain, "agent-1", 2);
    brain.place_now().await;
    let told = |brain: &Brain| brain.active[&last].reason.clone();
    let stored = || {
        let store = store.clone();
        async move { store.get_job(last).await.unwrap().unwrap().reason }
    };
    let first = told(&brain);
    assert!(first.contains("2 matching GPUs are leased"), "{first}");
    assert_eq!(stored().await, first);
    // Two more GPUs, taken by the next two jobs: the same words, other counts. Not given yet.
    connect_fake_agent(&mut brain, "agent-2", 2);
    brain.place_now().await;
    assert_eq!(brain.active.values().filter(|j| j.state == JobState::Assigned).count(), 4);
    assert_eq!((told(&brain), stored().await), (first.clone(), first.clone()), "counts alone rewrote the queue");
    // Once the counts are due, given.
    brain.counts_refreshed_ms -= super::scheduling::REASON_COUNTS_EVERY_MS;
    brain.place_now().await;
    let now = told(&brain);
    assert!(now.contains("4 matching GPUs are leased"), "{now}");
    assert_eq!(stored().await, now);
    // Other words at once: with no agent connected, the reason says so.
    for a in brain.agents.values_mut() {
        a.link = Link::Disconnected;
    }
    brain.place_now().await;
    assert_eq!(
        (told(&brain), stored().await),
        ("no agent is connected".to_string(), "no agent is connected".to_string())
    );
}

/// Jobs that need only a place wait by shape (`brain/queue.rs`) and are still placed in queue
/// order among the jobs looked at one by one; one queued later behind a full shape is told
/// why at once, and the fleets see every waiting job, batched or not.
#[tokio::test]
async fn jobs_waiting_by_shape_keep_queue_order_and_are_told_and_seen_by_the_fleets() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let step = |key: &str, grouped: bool| {
        let mut s = gpuci_core::pipeline::Step::new(key, "true");
        s.gpu.count = 1;
        if grouped {
            s.concurrency =
                Some(gpuci_core::pipeline::Concurrency { group: format!("g-{key}"), cancel_in_progress: false });
        }
        queued(s)
    };
    // Plain, grouped, plain, grouped, plain, plain: ids in that order.
    let kinds = [false, true, false, true, false, false];
    let steps = kinds.iter().enumerate().map(|(i, g)| step(&format!("s{i}"), *g)).collect();
    let (_, jobs) = store.create_pipeline(new_pipeline(), steps).await.unwrap();
    let ids: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    let (key, _) = gpuci_store::SecretsKey::generate();
    let mut brain = Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    assert_eq!(brain.queue.each().collect::<Vec<_>>(), [ids[1], ids[3]], "the grouped jobs are taken one by one");
    connect_fake_agent(&mut brain, "agent-1", 3);
    brain.place_now().await;
    let assigned: Vec<JobId> = brain.active.values().filter(|j| j.state == JobState::Assigned).map(|j| j.id).collect();
    assert_eq!(assigned, ids[..3], "the first three in queue order, batched or not");
    for id in &ids[3..] {
        assert!(brain.active[id].reason.contains("leased"), "job {id}: {}", brain.active[id].reason);
    }
    // One more of the full shape, queued later: told at once, stored, and seen by the fleets.
    let (_, more) = store.create_pipeline(new_pipeline(), vec![step("late", false)]).await.unwrap();
    let late = more[0].id;
    brain.publish(&more[0]);
    brain.place_now().await;
    let why = brain.active[&late].reason.clone();
    assert!(why.contains("leased"), "{why}");
    assert_eq!(store.get_job(late).await.unwrap().unwrap().reason, why);
    let mut waiting: Vec<JobId> = brain.fleet_view().waiting.iter().map(|w| w.id).collect();
    waiting.sort_unstable();
    assert_eq!(waiting, [ids[3], ids[4], ids[5], late]);
    // A GPU frees up: the first waiting job in queue order takes it, the grouped one.
    connect_fake_agent(&mut brain, "agent-2", 1);
    brain.place_now().await;
    assert_eq!(brain.active[&ids[3]].state, JobState::Assigned);
    assert_eq!(brain.active[&ids[4]].state, JobState::Queued);
}

/// A store with `n` queued 1-GPU jobs of one pipeline, agent-1 registered, and a brain
/// loaded from it with agent-1 connected (one GPU).
pub(crate) async fn one_gpu_jobs(n: usize) -> (Arc<gpuci_store::SqliteStore>, Vec<JobRecord>, Brain) {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let step = || {
        let mut s = gpuci_core::pipeline::Step::new("a", "true");
        s.gpu.count = 1;
        queued(s)
    };
    let (_, jobs) = store.create_pipeline(new_pipeline(), (0..n).map(|_| step()).collect()).await.unwrap();
    store.insert_agent(&stored_agent("agent-1")).await.unwrap();
    let (key, _) = gpuci_store::SecretsKey::generate();
    let mut brain = Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    connect_fake_agent(&mut brain, "agent-1", 1);
    (store, jobs, brain)
}

/// An assignment the store took though its answer was lost (the connection dropped during
/// COMMIT) was never sent: the next pass, refused by the store ("found assigned"), queues the
/// job again and places it, instead of being refused at every pass for ever (outsider attack).
#[tokio::test]
async fn an_assignment_stored_without_an_answer_is_queued_again_and_placed() {
    let (store, jobs, mut brain) = one_gpu_jobs(1).await;
    let id = jobs[0].id;
    // The commit the coordinator never heard back from.
    let lost = NewAssignment {
        job: id,
        agent_id: "agent-1".into(),
        agent_name: "agent-1".into(),
        gpus: vec!["GPU-one".into()],
        token_sha256: None,
    };
    store.assign_jobs(&[lost], now_ms()).await.unwrap().remove(0).unwrap();
    brain.place_now().await;
    assert_eq!(brain.active[&id].state, JobState::Queued);
    assert!(brain.active[&id].reason.contains("never sent"), "{}", brain.active[&id].reason);
    brain.place_now().await;
    let stored = store.get_job(id).await.unwrap().unwrap();
    assert_eq!((brain.active[&id].state, stored.state), (JobState::Assigned, JobState::Assigned));
    assert_eq!(stored.gpus, ["GPU-one"]);
    assert_eq!(store.get_job(id).await.unwrap().unwrap().attempt, jobs[0].attempt, "the same attempt: it never ran");
}

/// A start the store took though its answer was lost: the agent's resend is answered as
/// applied and the coordinator takes the stored record, instead of refusing the resend for
/// ever (each refusal closed the agent's connection: outsider attack).
#[tokio::test]
async fn a_start_stored_without_an_answer_is_taken_when_the_agent_sends_it_again() {
    let (store, jobs, mut brain) = one_gpu_jobs(1).await;
    let id = jobs[0].id;
    brain.place_now().await;
    assert_eq!(brain.active[&id].state, JobState::Assigned);
    let started = JobChange {
        state: Some(JobState::Running),
        reason: Some("running on agent-1".into()),
        started_at_ms: Some(now_ms()),
        ..Default::default()
    };
    store.update_job(id, &[JobState::Assigned], started).await.unwrap();
    let (reply, answer) = oneshot::channel();
    brain.batch_start("agent-1", id, now_ms(), Vec::new(), reply);
    brain.flush_events().await;
    assert_eq!(answer.await.unwrap(), Ok(()));
    assert_eq!(brain.active[&id].state, JobState::Running);
}

/// A cancel the store took though its answer was lost (the API answered 503): the job is
/// still queued in memory, and a pass that gives it a GPU is refused ("found cancelled").
/// The coordinator takes the stored record and the GPU goes to the next job, instead of to
/// the cancelled one at every pass for ever (outsider attack).
#[tokio::test]
async fn a_job_ended_in_the_store_behind_the_scheduler_gives_its_place_to_the_next() {
    let (store, jobs, mut brain) = one_gpu_jobs(2).await;
    let (first, second) = (jobs[0].id, jobs[1].id);
    let cancelled =
        JobChange { state: Some(JobState::Cancelled), reason: Some("cancelled by alice".into()), ..Default::default() };
    store.update_job(first, &[JobState::Queued], cancelled).await.unwrap();
    brain.place_now().await;
    assert!(!brain.active.contains_key(&first), "the stored end was taken");
    assert!(brain.schedule_due, "the place goes to another job at once");
    brain.place_now().await;
    assert_eq!(brain.active.get(&second).map(|j| j.state), Some(JobState::Assigned));
    assert_eq!(store.get_job(first).await.unwrap().unwrap().state, JobState::Cancelled);
}

/// An agent's connect whose requeue of a job it never received is refused because the
/// requeue already went through (its commit's answer was lost): the connect takes the stored
/// record and succeeds, instead of failing, closing the connection, and failing again at
/// every reconnect (outsider attack).
#[tokio::test]
async fn a_connect_whose_requeue_went_through_already_takes_the_stored_job() {
    let (store, jobs, mut brain) = one_gpu_jobs(1).await;
    let id = jobs[0].id;
    brain.place_now().await;
    assert_eq!(brain.active[&id].state, JobState::Assigned);
    brain.agent_disconnected("agent-1", "connection closed", false).await;
    let requeued = JobChange {
        state: Some(JobState::Queued),
        reason: Some("requeued: agent agent-1 reconnected without it".into()),
        clear_assignment: true,
        ..Default::default()
    };
    store.update_job(id, &[JobState::Assigned], requeued).await.unwrap();
    let hello = agent_1_hello("agent-1", brain.agents["agent-1"].gpus.clone(), vec![]);
    let (tx, _rx) = mpsc::unbounded_channel();
    brain.agent_connected("agent-1", 2, hello, tx).await.expect("the connect goes through");
    assert_eq!(brain.active[&id].state, JobState::Queued);
    brain.place_now().await;
    assert_eq!(brain.active[&id].state, JobState::Assigned, "placed again");
}

/// An agent that paused itself (low disk) is named with its reason, never called busy: its
/// slots are free, and waiting for its jobs to end frees nothing (outsider attack).
#[tokio::test]
async fn a_paused_agent_is_named_with_its_reason_not_called_busy() {
    let (_, jobs, mut brain) = one_gpu_jobs(1).await;
    brain.agents.get_mut("agent-1").unwrap().paused = Some("free disk is below --min-free-disk".into());
    brain.place_now().await;
    let why = &brain.active[&jobs[0].id].reason;
    assert!(why.contains("agent agent-1 takes no jobs: it is paused (free disk is below --min-free-disk)"), "{why}");
    assert!(!why.contains("busy"), "{why}");
}

/// Two machines with one agent identity (a data dir copied after registration): while one
/// is connected, the other is refused with why, instead of each taking the other's
/// connection and reconciling its jobs away (jobs ran twice: outsider attack). The same host
/// connecting again replaces its old connection, as before.
#[tokio::test]
async fn a_second_machine_with_a_connected_agents_identity_is_refused() {
    let (_, _, mut brain) = one_gpu_jobs(0).await;
    let hello = |hostname: &str| agent_1_hello(hostname, vec![], vec![]);
    let (tx, _rx) = mpsc::unbounded_channel();
    brain.agent_connected("agent-1", 2, hello("agent-1"), tx).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let refused = brain.agent_connected("agent-1", 3, hello("copy-of-agent-1"), tx).await;
    assert!(
        matches!(&refused, Err(BrainError::AgentRefused(why)) if why.contains("share one agent identity")),
        "{refused:?}"
    );
    assert!(matches!(rx.try_recv(), Ok(CoordinatorMessage::Refused { .. })));
    assert_eq!(brain.agents["agent-1"].conn.as_ref().map(|c| c.0), Some(2), "the live connection is kept");
    let (tx, _rx) = mpsc::unbounded_channel();
    brain.agent_connected("agent-1", 4, hello("agent-1"), tx).await.expect("the same host again");
    assert_eq!(brain.agents["agent-1"].conn.as_ref().map(|c| c.0), Some(4));
}

/// A retry the store took though its answer was lost (the caller was told 503): the new
/// attempt waited unseen, never placed and not cancellable, and asking again was refused
/// ("already retried"). Asking again now answers with that attempt, which is placed.
#[tokio::test]
async fn a_retry_stored_without_an_answer_is_taken_when_asked_again() {
    let store = Arc::new(gpuci_store::SqliteStore::in_memory().await.unwrap());
    let mut s = gpuci_core::pipeline::Step::new("a", "false");
    s.gpu.count = 1;
    let (p, jobs) = store.create_pipeline(new_pipeline(), vec![queued(s)]).await.unwrap();
    let failed =
        JobChange { state: Some(JobState::Failed), reason: Some("exited with code 1".into()), ..Default::default() };
    let failed = store.update_job(jobs[0].id, &[JobState::Queued], failed).await.unwrap();
    let (key, _) = gpuci_store::SecretsKey::generate();
    let mut brain = Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    connect_fake_agent(&mut brain, "agent-1", 1);
    // The insert whose answer was lost.
    let unseen = store.insert_job(next_attempt(&failed, "retry".into(), now_ms())).await.unwrap();
    let again = brain.retry(failed.id, "alice").await.expect("the retry that went through");
    assert_eq!(again.id, unseen.id);
    assert!(brain.retry_failed(p.id, "alice").await.is_err(), "nothing left to retry, and nothing unseen");
    brain.place_now().await;
    assert_eq!(brain.active.get(&unseen.id).map(|j| j.state), Some(JobState::Assigned));
}

/// A queue timeout the store took though its answer was lost: the reaper takes the stored
/// end instead of failing to time the job out again every second (outsider attack).
#[tokio::test]
async fn a_queue_timeout_stored_without_an_answer_is_taken_by_the_reaper() {
    let (store, jobs, mut brain) = one_gpu_jobs(1).await;
    let id = jobs[0].id;
    brain.agents.get_mut("agent-1").unwrap().paused = Some("paused".into());
    brain.ready_since.insert(id, 0);
    let timed_out =
        JobChange { state: Some(JobState::TimedOut), reason: Some("still queued".into()), ..Default::default() };
    store.update_job(id, &[JobState::Queued], timed_out).await.unwrap();
    brain.reap().await;
    assert!(!brain.active.contains_key(&id), "the stored end was taken");
    assert_eq!(store.get_job(id).await.unwrap().unwrap().reason, "still queued");
}

/// Telling a long queue why it waits is written a chunk at a time, oldest job first, and a
/// pass that placed jobs tells fewer, so a placement never waits behind all of it (a pass
/// telling 92,000 jobs held placements back up to 1.2 s); a job placed before its reason was
/// written keeps its assignment's.
#[tokio::test]
async fn a_long_queue_is_told_a_chunk_at_a_time_and_never_over_a_placed_job() {
    let (store, jobs, mut brain) = one_gpu_jobs(8).await;
    brain.reasons_per_write = 3;
    let ids: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    brain.place_now().await;
    assert_eq!(brain.active[&ids[0]].state, JobState::Assigned);
    for (i, id) in ids.iter().enumerate().skip(1) {
        let reason = store.get_job(*id).await.unwrap().unwrap().reason;
        assert_eq!(reason.contains("leased"), i == 1, "job {i}: {reason}");
        assert_eq!(brain.active[id].reason, reason, "job {i}: the scheduler says what the store says");
    }
    // GPUs free up before the rest is written: the next four in queue order are placed, three
    // of them before they were told why they waited.
    connect_fake_agent(&mut brain, "agent-2", 4);
    brain.agents.get_mut("agent-2").unwrap().name = "host-2".into();
    brain.place_now().await;
    while !brain.untold.is_empty() {
        brain.tell_waiting(Vec::new(), brain.reasons_per_write).await;
    }
    for (i, id) in ids.iter().enumerate() {
        let j = store.get_job(*id).await.unwrap().unwrap();
        match i {
            // Named by the agent's name, not its id.
            0 => assert_eq!(j.reason, "assigned to agent agent-1"),
            1..=4 => assert!(
                j.state == JobState::Assigned && j.reason == "assigned to agent host-2",
                "job {i}: {:?} {}",
                j.state,
                j.reason
            ),
            _ => assert!(j.state == JobState::Queued && j.reason.contains("leased"), "job {i}: {}", j.reason),
        }
        assert_eq!(brain.active[id].reason, j.reason, "job {i}");
    }
}

/// A cancel of a running job whose store write failed, though perhaps after it committed (the
/// API answered 503): the reaper reads the job again. Stored after all, the cancel is sent
/// to the agent; before, the store said "cancelling" while the job ran on (it could end
/// `succeeded`) until a restart. Not stored, nothing is sent: the caller was told it failed.
#[tokio::test]
async fn a_cancel_stored_without_an_answer_is_sent_to_the_agent_by_the_reaper() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    let store = Arc::new(gpuci_store::SqliteStore::open(&path).await.unwrap());
    let step = |key: &str| {
        let mut s = gpuci_core::pipeline::Step::new(key, "sleep 600");
        s.gpu.count = 1;
        queued(s)
    };
    let (_, jobs) = store.create_pipeline(new_pipeline(), vec![step("a"), step("b")]).await.unwrap();
    let (stored_after_all, never_stored) = (jobs[0].id, jobs[1].id);
    store.insert_agent(&stored_agent("agent-1")).await.unwrap();
    let (key, _) = gpuci_store::SecretsKey::generate();
    let mut brain = Brain::load(store.clone(), Arc::new(Hub::new()), Timing::default(), Arc::new(key)).await.unwrap();
    let mut sent = connect_fake_agent_rx(&mut brain, "agent-1", 2);
    brain.place_now().await;
    for id in [stored_after_all, never_stored] {
        let (reply, answer) = oneshot::channel();
        brain.batch_start("agent-1", id, now_ms(), Vec::new(), reply);
        brain.flush_events().await;
        assert_eq!(answer.await.unwrap(), Ok(()));
    }
    let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&path);
    let mut db = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&opts).await.unwrap();
    sqlx::query(
        "CREATE TRIGGER no_cancels BEFORE UPDATE OF reason ON jobs WHEN NEW.reason LIKE 'cancelling:%' \
         BEGIN SELECT RAISE(ABORT, 'injected: disk I/O error'); END",
    )
    .execute(&mut db)
    .await
    .unwrap();
    for id in [stored_after_all, never_stored] {
        assert!(brain.cancel(id, "cancelled by alice".into()).await.is_err());
    }
    sqlx::query("DROP TRIGGER no_cancels").execute(&mut db).await.unwrap();
    // The one commit that went through, though its answer never came.
    store.set_reason(stored_after_all, &format!("{CANCELLING}cancelled by alice")).await.unwrap();
    while sent.try_recv().is_ok() {}
    brain.reap().await;
    let mut cancels = Vec::new();
    while let Ok(m) = sent.try_recv() {
        if let CoordinatorMessage::Cancel { job_id, reason } = m {
            cancels.push((job_id, reason));
        }
    }
    assert_eq!(cancels, [(stored_after_all, "cancelled by alice".to_string())]);
    assert!(brain.active[&stored_after_all].reason.starts_with(CANCELLING));
    assert_eq!(brain.active[&never_stored].state, JobState::Running);
    assert!(!brain.active[&never_stored].reason.starts_with(CANCELLING));
    assert!(brain.cancels_in_doubt.is_empty(), "each was read again once");
}

/// A cancel of a job the store had ended behind the scheduler (an earlier cancel or queue
/// timeout whose answer was lost): the stored record is taken and the caller told the job
/// has finished (409), not a 500 from the store's refusal (outsider attack on Postgres).
#[tokio::test]
async fn a_cancel_of_a_job_ended_behind_the_scheduler_says_it_has_finished() {
    let (store, jobs, mut brain) = one_gpu_jobs(1).await;
    let id = jobs[0].id;
    let cancelled =
        JobChange { state: Some(JobState::Cancelled), reason: Some("cancelled by alice".into()), ..Default::default() };
    store.update_job(id, &[JobState::Queued], cancelled).await.unwrap();
    let e = brain.cancel(id, "cancelled by bob".into()).await.unwrap_err();
    assert!(matches!(e, BrainError::AlreadyFinished { state: JobState::Cancelled, .. }), "{e:?}");
    assert!(!brain.active.contains_key(&id), "the stored end was taken");
    assert_eq!(store.get_job(id).await.unwrap().unwrap().reason, "cancelled by alice");
}

/// A result that reaches the coordinator late (it was down, its agent away) is recorded as
/// ending when its agent says, within the job's start and now: a 2 s job whose result
/// waited 8 s for a restart ran 10.9 s by its record and its cost (outsider check).
#[tokio::test]
async fn a_late_result_is_recorded_as_ending_when_its_agent_says() {
    let (store, jobs, mut brain) = one_gpu_jobs(1).await;
    let id = jobs[0].id;
    brain.place_now().await;
    let now = now_ms();
    let (reply, answer) = oneshot::channel();
    brain.batch_start("agent-1", id, now - 60_000, Vec::new(), reply);
    brain.flush_events().await;
    assert_eq!(answer.await.unwrap(), Ok(()));
    let ended = JobFinished {
        job_id: id,
        outcome: Outcome::Exited { code: 0 },
        finished_at_us: (now - 58_000) * 1000,
        started_at_us: None,
        lines: None,
        telemetry: None,
        gpu_health: BTreeMap::new(),
    };
    let (reply, answer) = oneshot::channel();
    assert!(brain.batch_finish("agent-1", ended, reply).is_none(), "a plain end");
    brain.flush_events().await;
    assert_eq!(answer.await.unwrap(), Ok(()));
    let j = store.get_job(id).await.unwrap().unwrap();
    assert_eq!((j.state, j.finished_at_ms.unwrap() - j.started_at_ms.unwrap()), (JobState::Succeeded, 2_000));
    // An agent's clock that is off: never before the start, never after now.
    assert_eq!(super::results::ended_at(&j, j.started_at_ms.unwrap() - 5_000, now), j.started_at_ms.unwrap());
    assert_eq!(super::results::ended_at(&j, now + 3_600_000, now), now);
}
