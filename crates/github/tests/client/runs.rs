//! Workflow runs and their jobs: cancelling, listing with filters across pages, reading one job.

use super::*;

#[tokio::test]
async fn cancelling_a_finished_run_succeeds() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    client.cancel_run(&kernels(), 30433642).await.expect("202");
    client.cancel_run(&kernels(), 409).await.expect("409 means the run already finished");
    let req = &s.github.requests()[0];
    assert_eq!(
        (req.method.as_str(), req.path.as_str()),
        ("POST", "/repos/gpu-lab/kernels/actions/runs/30433642/cancel")
    );
    assert_eq!(req.body, Value::Null, "cancel has no request body");
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn runs_are_filtered_paginated_and_flattened() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let runs = client.list_runs(&kernels(), Some("queued"), Some(SHA)).await.expect("runs");
    assert_eq!(runs.len(), 3);
    assert_eq!((runs[0].id, runs[0].event.as_str(), runs[0].status.as_deref()), (30433642, "push", Some("queued")));
    assert_eq!(runs[1].head_repository_full_name.as_deref(), Some("contributor/kernels"));
    assert_eq!(runs[2].head_repository_full_name, None, "deleted fork");
    assert!(runs.iter().all(|r| r.repository_full_name == "gpu-lab/kernels" && r.head_sha == SHA));

    let requests = s.github.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[1].query.as_deref(), Some(&*format!("status=queued&head_sha={SHA}&per_page=100&page=2")));
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn run_jobs_are_paginated_and_a_single_job_is_read() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let jobs = client.list_run_jobs(&kernels(), 29679449).await.expect("jobs");
    let summary: Vec<_> = jobs.iter().map(|j| (j.id, j.status.as_str(), j.conclusion.as_deref())).collect();
    assert_eq!(summary, [(1, "completed", Some("success")), (2, "in_progress", None), (3, "queued", None)]);
    assert_eq!(jobs[1].runner_name.as_deref(), Some("gpuci-b"));
    assert!(jobs.iter().all(|j| j.run_id == 29679449 && j.labels == ["self-hosted", "gpu"] && j.head_sha == SHA));

    let job = client.get_job(&kernels(), 399444496).await.expect("job");
    assert_eq!((job.id, job.run_id, job.name.as_str(), job.runner_name), (399444496, 29679449, "build", None));
    assert_eq!(s.github.requests().len(), 3);
    assert_all_documented(&s.github);
}
