//! [`agent_names`]: the agents jobs were given to are named, read one by one when few and in
//! one scan when many, and nothing is read for jobs no agent has.

use super::*;
use gpuci_store::{AgentRecord, NewAssignment, SqliteStore};

fn agent(i: usize) -> AgentRecord {
    AgentRecord {
        id: format!("agent-{i}"),
        name: format!("host-{i}"),
        credential_hash: String::new(),
        registered_at_ms: 1,
        last_seen_ms: None,
        state: "online".into(),
        reason: String::new(),
        hello_json: None,
    }
}

#[tokio::test]
async fn jobs_name_the_agents_they_were_given_to_and_no_other() {
    let store = SqliteStore::in_memory().await.unwrap();
    for i in 0..100 {
        store.insert_agent(&agent(i)).await.unwrap();
    }
    let pipeline = gpuci_store::NewPipeline {
        origin: None,
        file_name: "p.yml".into(),
        source: "steps: []".into(),
        workspace_upload: None,
        repository: None,
        created_at_ms: 1,
    };
    let step = |i: usize| gpuci_store::NewJob {
        pipeline_id: 0,
        step: gpuci_core::pipeline::Step::new(format!("s{i}"), "true"),
        env: Default::default(),
        state: gpuci_core::job::JobState::Queued,
        reason: "queued".into(),
        attempt: 1,
        retry_of: None,
        created_at_ms: 1,
    };
    let (_, jobs) = store.create_pipeline(pipeline, (0..80).map(step).collect()).await.unwrap();
    assert!(agent_names(&store, &jobs).await.names.is_empty(), "queued jobs name no agent");
    // Each of the first 70 jobs on an agent of its own, past the one-by-one reads.
    let batch: Vec<NewAssignment> = jobs[..70]
        .iter()
        .enumerate()
        .map(|(i, j)| NewAssignment { job: j.id, agent_id: format!("agent-{i}"), gpus: Vec::new(), token_sha256: None })
        .collect();
    assert!(store.assign_jobs(&batch, 2).await.unwrap().iter().all(|r| r.is_ok()));
    let jobs = store.pipeline_jobs(jobs[0].pipeline_id).await.unwrap();
    for few in [&jobs[..3], &jobs[..]] {
        let known = agent_names(&store, few).await;
        let want: HashMap<String, String> =
            few.iter().filter_map(|j| j.agent_id.clone()).map(|a| (a.clone(), a.replace("agent-", "host-"))).collect();
        assert_eq!(known.names, want);
    }
}
