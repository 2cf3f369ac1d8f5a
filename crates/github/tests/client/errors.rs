//! How failures come back: typed HTTP errors, which of them are transient, an unreachable GitHub.

use super::*;

#[tokio::test]
async fn http_errors_are_typed_and_not_transient() {
    let s = start_stub().await;
    let client = app_client(&s.base);
    let missing = Repo::parse("missing/repo").expect("repo");
    let err = client.generate_jitconfig(&missing, &spec("r")).await.expect_err("404");
    assert!(matches!(err, ApiError::Status { status: StatusCode::NOT_FOUND, .. }), "{err:?}");
    assert!(!err.is_transient());
    assert!(err.to_string().contains("generate JIT runner config") && err.to_string().contains("Not Found"), "{err}");
}

#[tokio::test]
async fn server_errors_and_rate_limits_are_transient_permission_errors_are_not() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    let server = client.get_job(&repo, 500).await.expect_err("502");
    assert!(matches!(server, ApiError::Status { status: StatusCode::BAD_GATEWAY, .. }) && server.is_transient());
    let limited = client.get_job(&repo, 403).await.expect_err("rate limited");
    assert!(matches!(limited, ApiError::RateLimited { .. }) && limited.is_transient(), "{limited:?}");
    assert!(limited.retry_not_before().is_some(), "{limited:?}");
    // A fresh client: the rate limit holds back every call on the first one.
    let forbidden = pat_client(&s.base).get_job(&repo, 401).await.expect_err("forbidden");
    assert!(
        matches!(forbidden, ApiError::Status { status: StatusCode::FORBIDDEN, .. })
            && !forbidden.is_transient()
            && forbidden.retry_not_before().is_none(),
        "{forbidden:?}"
    );
}

#[tokio::test]
async fn unreachable_github_is_transient() {
    // Bind then drop a listener so the port is (almost certainly) closed.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let err = app_client(&format!("http://{addr}")).installation_token(1).await.expect_err("refused");
    assert!(matches!(err, ApiError::Transport { .. }) && err.is_transient(), "{err:?}");
}
