//! Parsing webhook payloads: GitHub's published examples (from ../shared, when present) and our own fixtures.

use std::path::PathBuf;

use gpuci_github::{
    parse_event, AuthorAssociation, Event, PullRequestAction, Repository, WebhookError, WorkflowJobAction,
};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// GitHub's examples live outside the repository; skip (passing) where the checkout has no ../shared.
fn shared_reference(name: &str) -> Option<Vec<u8>> {
    let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("../../../shared/reference/github")
        .join(name);
    match std::fs::read(&path) {
        Ok(bytes) => Some(bytes),
        Err(_) => {
            eprintln!("skipping: {} not found", path.display());
            None
        }
    }
}

fn kernels_repo() -> Repository {
    Repository { full_name: "gpu-lab/kernels".into(), owner: "gpu-lab".into(), name: "kernels".into() }
}

#[test]
fn github_example_workflow_job_queued() {
    let Some(body) = shared_reference("workflow_job.queued.json") else { return };
    let Event::WorkflowJob(job) = parse_event("workflow_job", "d-1", &body).expect("parses") else {
        panic!("not a workflow_job event")
    };
    assert_eq!(job.action, WorkflowJobAction::Queued);
    assert_eq!(job.job_id, 289782451);
    assert_eq!(job.run_id, 2202229078);
    assert_eq!(job.labels, ["ubuntu-latest"]);
    // GitHub's example has the runner filled in even though the job is queued.
    assert_eq!(job.runner_id, Some(5));
    assert_eq!(job.runner_name.as_deref(), Some("GitHub Actions 5"));
    assert_eq!(job.head_sha, "3484a3fb816e0859fd6e1cea078d76385ff50625");
    assert_eq!(job.repository.full_name, "Codertocat/Hello-World");
    assert_eq!(job.repository.name, "Hello-World");
    assert_eq!(job.installation_id, Some(3456996));
}

#[test]
fn github_example_pull_request_labeled() {
    let Some(body) = shared_reference("pull_request.labeled.json") else { return };
    let Event::PullRequest(pr) = parse_event("pull_request", "d-2", &body).expect("parses") else {
        panic!("not a pull_request event")
    };
    assert_eq!(pr.action, PullRequestAction::Labeled);
    assert_eq!(pr.number, 2);
    assert_eq!(pr.head_sha, "ec26c3e57ca3a959ca5aad62de7213c562f8c821");
    assert_eq!(pr.label.as_deref(), Some("bug"));
    assert_eq!(pr.author_association, AuthorAssociation::Owner);
    assert_eq!(pr.base_repository.full_name, "Codertocat/Hello-World");
    assert!(!pr.from_fork);
    assert_eq!(pr.title.as_deref(), Some("Update the README with new information."));
    assert_eq!(pr.author.as_deref(), Some("Codertocat"), "who opened it, not who labelled it");
}

#[test]
fn queued_workflow_job_with_null_runner_fields() {
    let Event::WorkflowJob(job) =
        parse_event("workflow_job", "d-3", &fixture("workflow_job.queued.null_runner.json")).expect("parses")
    else {
        panic!("not a workflow_job event")
    };
    assert_eq!(job.action, WorkflowJobAction::Queued);
    assert_eq!((job.job_id, job.run_id), (7001, 9001));
    assert_eq!(job.labels, ["self-hosted", "gpu", "a100"]);
    assert_eq!(job.runner_id, None);
    assert_eq!(job.runner_name, None);
    assert_eq!(job.conclusion, None);
    assert_eq!(job.repository, kernels_repo());
    assert_eq!(job.installation_id, Some(555));
}

#[test]
fn completed_workflow_job_names_the_runner_that_ran_it() {
    let Event::WorkflowJob(job) =
        parse_event("workflow_job", "d-4", &fixture("workflow_job.completed.json")).expect("parses")
    else {
        panic!("not a workflow_job event")
    };
    assert_eq!(job.action, WorkflowJobAction::Completed);
    assert_eq!(job.runner_name.as_deref(), Some("gpuci-job-17-a"));
    assert_eq!(job.conclusion.as_deref(), Some("success"));
}

#[test]
fn pull_request_from_a_fork() {
    let Event::PullRequest(pr) =
        parse_event("pull_request", "d-5", &fixture("pull_request.opened.fork.json")).expect("parses")
    else {
        panic!("not a pull_request event")
    };
    assert_eq!(pr.action, PullRequestAction::Opened);
    assert_eq!(pr.head_repo_full_name.as_deref(), Some("mallory/kernels"));
    assert_eq!(pr.base_repository, kernels_repo());
    assert_eq!(pr.author_association, AuthorAssociation::FirstTimeContributor);
    assert_eq!(pr.label, None);
    assert!(pr.from_fork);
    assert_eq!(pr.base_ref.as_deref(), Some("main"), "its base branch: caches it may read");
}

#[test]
fn pull_request_whose_head_repo_was_deleted_counts_as_fork() {
    let Event::PullRequest(pr) =
        parse_event("pull_request", "d-6", &fixture("pull_request.synchronize.deleted_head_repo.json"))
            .expect("parses")
    else {
        panic!("not a pull_request event")
    };
    assert_eq!(pr.action, PullRequestAction::Synchronize);
    assert_eq!(pr.head_repo_full_name, None);
    assert!(pr.from_fork);
    assert_eq!(pr.installation_id, None);
}

#[test]
fn push() {
    let Event::Push(push) = parse_event("push", "d-7", &fixture("push.json")).expect("parses") else {
        panic!("not a push event")
    };
    assert_eq!(push.git_ref, "refs/heads/main");
    assert_eq!(push.after, "5555555555555555555555555555555555555555");
    assert!(!push.deleted);
    assert_eq!(push.repository, kernels_repo());
    assert_eq!(push.subject.as_deref(), Some("Fix the reduction kernel on sm_90"), "the message's first line");
    assert_eq!(push.author.as_deref(), Some("ada"), "the author's login");
}

#[test]
fn a_push_names_its_author_by_what_the_payload_has() {
    let body = String::from_utf8(fixture("push.json")).expect("utf8");
    let mut v: serde_json::Value = serde_json::from_str(&body).expect("json");
    // A commit e-mail GitHub does not know: no username, the name in the commit.
    v["head_commit"]["author"].as_object_mut().expect("author").remove("username");
    let Ok(Event::Push(p)) = parse_event("push", "d-11", v.to_string().as_bytes()) else { panic!("parses") };
    assert_eq!(p.author.as_deref(), Some("Ada Lovelace"));
    // A deleted ref: head_commit is null; who pushed.
    v["head_commit"] = serde_json::Value::Null;
    let Ok(Event::Push(p)) = parse_event("push", "d-12", v.to_string().as_bytes()) else { panic!("parses") };
    assert_eq!((p.subject, p.author.as_deref()), (None, Some("ada")));
}

#[test]
fn ping_and_unhandled_events() {
    assert_eq!(parse_event("ping", "d-8", br#"{"zen":"Design for failure."}"#), Ok(Event::Ping));
    assert_eq!(parse_event("issues", "d-9", b"{}"), Ok(Event::Ignored { name: "issues".into() }));
}

#[test]
fn unknown_action_is_not_an_error() {
    let body = String::from_utf8(fixture("workflow_job.completed.json")).expect("utf8");
    let body = body.replace(r#""action": "completed""#, r#""action": "teleported""#);
    let Ok(Event::WorkflowJob(job)) = parse_event("workflow_job", "d-10", body.as_bytes()) else {
        panic!("should parse")
    };
    assert_eq!(job.action, WorkflowJobAction::Other);
}

#[test]
fn unparseable_payload_names_event_delivery_and_path() {
    let body = String::from_utf8(fixture("workflow_job.queued.null_runner.json")).expect("utf8");
    let body = body.replace(r#""run_id": 9001"#, r#""run_id": "nine""#);
    let err = parse_event("workflow_job", "d-11", body.as_bytes()).expect_err("must fail");
    let WebhookError::InvalidPayload { ref event, ref delivery_id, ref path, .. } = err else {
        panic!("wrong error {err:?}")
    };
    assert_eq!((event.as_str(), delivery_id.as_str(), path.as_str()), ("workflow_job", "d-11", "workflow_job.run_id"));
    let msg = err.to_string();
    assert!(msg.contains("workflow_job") && msg.contains("d-11") && msg.contains("workflow_job.run_id"), "{msg}");

    let err = parse_event("push", "d-12", b"not json").expect_err("must fail");
    assert!(matches!(err, WebhookError::InvalidPayload { .. }), "{err:?}");
    let err = parse_event("pull_request", "d-13", br#"{"action":"opened"}"#).expect_err("must fail");
    assert!(err.to_string().contains("number"), "{err}");
}
