//! Self-hosted runners: JIT configs for a repository and an organisation, deleting runners (gone
//! or busy), listing them across pages.

use super::*;

#[tokio::test]
async fn generate_jitconfig_sends_the_documented_request() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let jit = client.generate_jitconfig(&kernels(), &spec("gpuci-job-17-a")).await.expect("jit config");
    assert_eq!(jit.runner_id, 23);
    assert_eq!(jit.runner_name, "gpuci-job-17-a");
    assert_eq!(jit.encoded_jit_config.expose(), "ZW5jb2RlZA==");
    assert_eq!(format!("{:?}", jit.encoded_jit_config), "***");

    let requests = s.github.api_requests();
    assert_eq!(requests.len(), 2, "installation lookup, JIT config: {requests:?}");
    let req = &requests[1];
    assert_eq!(
        (req.method.as_str(), req.path.as_str()),
        ("POST", "/repos/gpu-lab/kernels/actions/runners/generate-jitconfig")
    );
    assert_eq!(bearer(req), "ghs_test1", "JIT config must use the installation token, not the app JWT");
    assert_eq!(req.body, json!({ "name": "gpuci-job-17-a", "runner_group_id": 1, "labels": ["self-hosted", "gpu"] }));
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn org_jitconfig_finds_the_installation_by_account_login_once() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let jit = client.generate_org_jitconfig("gpu-lab", &spec("gpuci-org-1")).await.expect("jit");
    assert_eq!(jit.runner_name, "gpuci-org-1");
    // Logins are case-insensitive on GitHub; the cached lookup serves both spellings.
    client.generate_org_jitconfig("GPU-Lab", &spec("gpuci-org-2")).await.expect("jit");
    client.delete_org_runner("gpu-lab", 23).await.expect("delete");
    client.delete_org_runner("gpu-lab", 404).await.expect("already gone is fine");

    assert_eq!(s.github.count("GET", "/app/installations"), 1);
    assert_eq!(s.github.count("POST", &format!("/app/installations/{GPU_LAB_INSTALLATION}/access_tokens")), 1);
    assert_eq!(s.github.count("POST", "/orgs/gpu-lab/actions/runners/generate-jitconfig"), 1);
    assert_eq!(s.github.count("POST", "/orgs/GPU-Lab/actions/runners/generate-jitconfig"), 1);

    let err = client.generate_org_jitconfig("nobody", &spec("x")).await.expect_err("not installed");
    assert!(matches!(&err, ApiError::NotInstalled { target } if target == "nobody") && !err.is_transient(), "{err:?}");
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn deleting_a_runner_that_is_gone_succeeds_but_a_busy_one_fails() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    client.delete_runner(&kernels(), 23).await.expect("204");
    client.delete_runner(&kernels(), 404).await.expect("404 means already gone");
    let err = client.delete_runner(&kernels(), 422).await.expect_err("busy runner");
    assert!(matches!(err, ApiError::Status { status: StatusCode::UNPROCESSABLE_ENTITY, .. }), "{err:?}");
    assert!(!err.is_transient());
    assert_eq!(s.github.count("DELETE", "/repos/gpu-lab/kernels/actions/runners/404"), 1);
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn runners_follow_pagination_and_flatten_labels() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let runners = client.list_runners(&kernels()).await.expect("runners");
    let names: Vec<&str> = runners.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["gpuci-a", "gpuci-b", "gpuci-c"]);
    assert_eq!(runners[0].labels, ["self-hosted", "gpu"]);
    assert_eq!((runners[2].id, runners[2].status.as_str(), runners[2].busy), (3, "online", false));

    let queries: Vec<_> = s.github.requests().into_iter().map(|r| r.query.unwrap_or_default()).collect();
    assert_eq!(queries, ["per_page=100&page=1", "per_page=100&page=2"], "stops after the page without rel=next");
    assert_all_documented(&s.github);
}
