//! Credentials: an App's JWT and its installation tokens (minted, cached, refreshed, found per
//! repository once), and a personal access token that never touches the App's endpoints.

use super::*;

#[tokio::test]
async fn installation_token_is_minted_with_the_app_jwt_and_cached() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    assert!(client.is_app());

    let first = client.installation_token(99).await.expect("token");
    let second = client.installation_token(99).await.expect("token");
    assert_eq!(first.expose(), "ghs_test1");
    assert_eq!(second.expose(), "ghs_test1", "second call must come from the cache");

    let requests = s.github.requests();
    assert_eq!(requests.len(), 1);
    let req = &requests[0];
    assert_eq!((req.method.as_str(), req.path.as_str()), ("POST", "/app/installations/99/access_tokens"));
    assert_app_jwt(req);
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn token_close_to_expiry_is_refreshed() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let first = client.installation_token(SHORT_LIVED_INSTALLATION).await.expect("token");
    let second = client.installation_token(SHORT_LIVED_INSTALLATION).await.expect("token");
    assert_ne!(first.expose(), second.expose());
    assert_eq!(s.github.requests().len(), 2);
}

#[tokio::test]
async fn app_auth_looks_up_the_repo_installation_once_and_caches_it() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let repo = kernels();

    let token = client.repo_token(&repo).await.expect("token");
    assert_eq!(token.expose(), "ghs_test1");
    client.list_runners(&repo).await.expect("runners");
    client.cancel_run(&repo, 1).await.expect("cancel");
    // Another repository of the same installation: looked up, but the installation's token is reused.
    let other = Repo::parse("gpu-lab/other").expect("repo");
    assert_eq!(client.repo_token(&other).await.expect("token").expose(), "ghs_test1");

    assert_eq!(s.github.count("GET", "/repos/gpu-lab/kernels/installation"), 1, "{:?}", s.github.requests());
    assert_eq!(s.github.count("GET", "/repos/gpu-lab/other/installation"), 1);
    assert_eq!(s.github.count("POST", &format!("/app/installations/{GPU_LAB_INSTALLATION}/access_tokens")), 1);
    for req in s.github.requests() {
        if req.path.starts_with("/app/") || req.path.ends_with("/installation") {
            assert_app_jwt(&req);
        } else {
            assert_eq!(bearer(&req), "ghs_test1", "{req:?}");
        }
    }
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn app_not_installed_on_the_repo_is_a_typed_permanent_error() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let repo = Repo::parse("not-installed/kernels").expect("repo");
    let err = client.list_runners(&repo).await.expect_err("not installed");
    assert!(matches!(&err, ApiError::NotInstalled { target } if target == "not-installed/kernels"), "{err:?}");
    assert!(!err.is_transient());
    assert_eq!(s.github.requests().len(), 1, "nothing but the lookup is sent");
}

#[tokio::test]
async fn pat_auth_sends_the_pat_and_never_touches_app_endpoints() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    assert!(!client.is_app());

    assert_eq!(client.repo_token(&repo).await.expect("token").expose(), PAT);
    client.list_runs(&repo, None, None).await.expect("runs");
    client.delete_runner(&repo, 5).await.expect("delete");
    let status =
        CommitStatus { state: StatusState::Pending, context: "gpuci".into(), target_url: None, description: None };
    client.create_status(&repo, SHA, &status).await.expect("status");
    client.generate_org_jitconfig("gpu-lab", &spec("gpuci-org-1")).await.expect("org jit");

    let err = client.installation_token(1).await.expect_err("no app");
    assert!(matches!(err, ApiError::AppOnly { .. }) && !err.is_transient(), "{err:?}");
    // Check runs are a GitHub App feature; GitHub refuses PATs, so the client does not even ask.
    let run = new_check_run();
    assert!(matches!(client.create_check_run(&repo, &run).await, Err(ApiError::AppOnly { .. })));
    let update = CheckRunUpdate::default();
    assert!(matches!(client.update_check_run(&repo, 4, &update).await, Err(ApiError::AppOnly { .. })));

    let requests = s.github.requests();
    assert!(!requests.is_empty());
    for req in &requests {
        assert!(!req.path.starts_with("/app/") && !req.path.ends_with("/installation"), "{req:?}");
        assert_eq!(bearer(req), PAT, "{req:?}");
    }
    assert!(!format!("{client:?}").contains(PAT), "Debug must not print the PAT");
    assert_all_documented(&s.github);
}
