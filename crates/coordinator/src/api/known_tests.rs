//! [`agent_names`]: the agents jobs were given to are named, read one by one when few and in
//! one scan when many, and nothing is read for jobs no agent has.

use super::*;
use crate::brain::tests::{new_pipeline, queued, stored_agent};
use gpuci_store::{NewAssignment, SqliteStore};

#[tokio::test]
async fn jobs_name_the_agents_they_were_given_to_and_no_other() {
    let store = SqliteStore::in_memory().await.unwrap();
    for i in 0..100 {
        let mut a = stored_agent(&format!("agent-{i}"));
        a.name = format!("host-{i}");
        store.insert_agent(&a).await.unwrap();
    }
    let step = |i: usize| queued(gpuci_core::pipeline::Step::new(format!("s{i}"), "true"));
    let (_, jobs) = store.create_pipeline(new_pipeline(), (0..80).map(step).collect()).await.unwrap();
    assert!(agent_names(&store, &jobs).await.names.is_empty(), "queued jobs name no agent");
    // Each of the first 70 jobs on an agent of its own, past the one-by-one reads.
    let batch: Vec<NewAssignment> = jobs[..70]
        .iter()
        .enumerate()
        .map(|(i, j)| NewAssignment {
            job: j.id,
            agent_id: format!("agent-{i}"),
            agent_name: format!("agent-{i}"),
            gpus: Vec::new(),
            token_sha256: None,
        })
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
