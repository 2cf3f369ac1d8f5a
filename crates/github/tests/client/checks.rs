//! What a commit shows: check runs created and updated, commit statuses with their description cut
//! to GitHub's limit.

use super::*;

#[tokio::test]
async fn check_runs_are_created_and_updated_with_documented_bodies() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let id = client.create_check_run(&kernels(), &new_check_run()).await.expect("create");
    assert_eq!(id, 4);
    let update = CheckRunUpdate {
        status: Some(CheckStatus::Completed),
        conclusion: Some(Conclusion::ActionRequired),
        details_url: None,
        output: Some(CheckOutput { title: "Needs approval".into(), summary: "A maintainer must add `gpu-ok`.".into() }),
    };
    client.update_check_run(&kernels(), id, &update).await.expect("update");

    let requests = s.github.api_requests();
    let create = &requests[1];
    assert_eq!((create.method.as_str(), create.path.as_str()), ("POST", "/repos/gpu-lab/kernels/check-runs"));
    assert_eq!(
        create.body,
        json!({ "name": "gpuci / test", "head_sha": SHA, "status": "queued",
                "details_url": "https://gpuci.example/jobs/17", "external_id": "17" })
    );
    let patch = &requests[2];
    assert_eq!((patch.method.as_str(), patch.path.as_str()), ("PATCH", "/repos/gpu-lab/kernels/check-runs/4"));
    assert_eq!(
        patch.body,
        json!({ "status": "completed", "conclusion": "action_required",
                "output": { "title": "Needs approval", "summary": "A maintainer must add `gpu-ok`." } })
    );
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn commit_status_description_is_cut_to_140_characters() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let long = "é".repeat(200);
    let status = CommitStatus {
        state: StatusState::Failure,
        context: "gpuci/h100".into(),
        target_url: Some("https://gpuci.example/jobs/17".into()),
        description: Some(long),
    };
    client.create_status(&kernels(), SHA, &status).await.expect("status");
    let req = &s.github.requests()[0];
    assert_eq!(req.path, format!("/repos/gpu-lab/kernels/statuses/{SHA}"));
    let sent = req.body["description"].as_str().expect("description");
    assert_eq!(sent.chars().count(), 140);
    assert!(sent.ends_with('…'));
    assert_eq!(req.body["state"], "failure");
    assert_eq!(req.body["context"], "gpuci/h100");
    assert_all_documented(&s.github);
}
