//! gpuci's GitHub client against the test server when GitHub has a bad moment: a revoked or
//! expired installation token (401), server errors, secondary rate limits with `retry-after`,
//! an exhausted primary limit. Outcomes are asserted (the call succeeded, how many requests
//! reached GitHub, what the client kept), never how fast anything was.
//!
//! Rate limits of minutes run on tokio's paused clock (`start_paused`): the test server stamps
//! each request with tokio's clock too, so "nothing arrived before GitHub's time" is checked on
//! the server's record without waiting minutes.

use std::time::{Duration, SystemTime};

use gpuci_github::{ApiError, AppCredentials, Client, Credentials, JitRunnerSpec, Repo, RetryPolicy, Secret};
use gpuci_github_testserver::{Fault, FaultKind, Options, TestGitHub};

const APP_ID: u64 = 4243;
const INSTALLATION: u64 = 7;

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/../github/tests/fixtures/{name}",
        std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

async fn server() -> TestGitHub {
    let gh = TestGitHub::start(Options {
        app_id: APP_ID,
        app_public_key_pem: Some(fixture("test-app-key.pub.pem")),
        ..Options::default()
    })
    .await;
    gh.add_repo("octo/gpu", INSTALLATION);
    gh
}

/// Short pauses; GitHub's own waits are sat out up to 5 s.
fn client(gh: &TestGitHub) -> Client {
    let app = AppCredentials::new(APP_ID, &Secret::new(fixture("test-app-key.pem"))).expect("test key");
    Client::new(&gh.url, Credentials::App(app)).with_retry(RetryPolicy {
        attempts: 4,
        base: Duration::from_millis(10),
        max_backoff: Duration::from_millis(40),
        max_wait: Duration::from_secs(5),
        timeout: Duration::from_secs(20),
    })
}

fn repo() -> Repo {
    Repo::parse("octo/gpu").expect("repo")
}

/// (method, path, status) of every request whose path contains `part`, oldest first.
fn answered(gh: &TestGitHub, part: &str) -> Vec<(String, u16)> {
    gh.requests().into_iter().filter(|r| r.path.contains(part)).map(|r| (r.method, r.status)).collect()
}

fn assert_clean(gh: &TestGitHub) {
    let errors = gh.validation_errors();
    assert!(errors.is_empty(), "requests or responses off GitHub's description: {errors:#?}");
}

#[tokio::test]
async fn a_revoked_installation_token_is_dropped_and_the_call_succeeds_with_a_fresh_one() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let c = client(&gh);
    c.get_job(&repo(), job.job_id).await.expect("first call");
    assert_eq!(gh.tokens_issued(), 1);

    gh.revoke_installation_tokens();
    let j = c.get_job(&repo(), job.job_id).await.expect("the call succeeds with a new token");
    assert_eq!(j.id, job.job_id);
    assert_eq!(gh.tokens_issued(), 2, "one fresh token");
    let path = format!("/actions/jobs/{}", job.job_id);
    assert_eq!(answered(&gh, &path).iter().map(|(_, s)| *s).collect::<Vec<_>>(), vec![200, 401, 200]);

    // Later calls use the new token: no token per call.
    c.get_job(&repo(), job.job_id).await.expect("third call");
    assert_eq!(gh.tokens_issued(), 2);
    assert_clean(&gh);
}

#[tokio::test]
async fn an_installation_token_that_expired_early_is_replaced() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let c = client(&gh);
    c.list_runs(&repo(), Some("queued"), None).await.expect("first call");
    gh.expire_installation_tokens();
    let runs = c.list_runs(&repo(), Some("queued"), None).await.expect("the call succeeds");
    assert!(runs.iter().any(|r| r.id == job.run_id), "{runs:?}");
    assert_eq!(gh.tokens_issued(), 2);
    assert_clean(&gh);
}

#[tokio::test]
async fn a_token_github_keeps_refusing_is_tried_once_more_not_forever() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let c = client(&gh);
    c.get_job(&repo(), job.job_id).await.expect("first call");
    // Every token refused, the fresh one too: GitHub's answer comes back, after one fresh try.
    let path = format!("/actions/jobs/{}", job.job_id);
    gh.inject(Fault::new("GET", &path, FaultKind::Status(401)));
    let err = c.get_job(&repo(), job.job_id).await.expect_err("still refused");
    assert!(matches!(&err, ApiError::Status { status, .. } if status.as_u16() == 401), "{err:?}");
    assert!(!err.is_transient());
    assert_eq!(answered(&gh, &path).len(), 3, "the first call, then the refused one and its one retry");
    assert_eq!(gh.tokens_issued(), 2);
}

#[tokio::test]
async fn server_errors_on_reads_are_retried_until_github_answers() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let path = format!("/actions/jobs/{}", job.job_id);
    gh.inject(Fault::new("GET", &path, FaultKind::Status(502)).times(2));
    let c = client(&gh);
    c.get_job(&repo(), job.job_id).await.expect("the third try gets through");
    assert_eq!(answered(&gh, &path).iter().map(|(_, s)| *s).collect::<Vec<_>>(), vec![502, 502, 200]);

    // An outage longer than the tries: the error comes back, transient, after `attempts` tries.
    gh.inject(Fault::new("GET", &path, FaultKind::Status(503)));
    let err = c.get_job(&repo(), job.job_id).await.expect_err("GitHub is down");
    assert!(err.is_transient(), "{err:?}");
    assert!(err.to_string().contains("503"), "{err}");
    assert_eq!(answered(&gh, &path).len(), 3 + 4, "four tries, no more");
    assert_clean(&gh);
}

#[tokio::test]
async fn a_runner_registration_is_not_sent_twice_after_a_server_error() {
    let gh = server().await;
    gh.inject(Fault::new("POST", "generate-jitconfig", FaultKind::Status(500)).times(1));
    let spec = JitRunnerSpec { name: "r1".into(), runner_group_id: 1, labels: vec!["gpu".into()] };
    let err = client(&gh).generate_jitconfig(&repo(), &spec).await.expect_err("500");
    assert!(err.is_transient(), "the caller may try later: {err:?}");
    assert_eq!(answered(&gh, "generate-jitconfig").len(), 1, "GitHub may have registered it: not repeated");
    assert_clean(&gh);
}

#[tokio::test]
async fn a_secondary_rate_limit_is_waited_out_as_long_as_github_asks() {
    let gh = server().await;
    gh.inject(Fault::new("POST", "generate-jitconfig", FaultKind::SecondaryRateLimit { retry_after: 1 }).times(1));
    let spec = JitRunnerSpec { name: "r1".into(), runner_group_id: 1, labels: vec!["gpu".into()] };
    let jit = client(&gh).generate_jitconfig(&repo(), &spec).await.expect("registered after the wait");
    assert_eq!(jit.runner_name, "r1");
    let tries: Vec<_> = gh.requests().into_iter().filter(|r| r.path.ends_with("generate-jitconfig")).collect();
    assert_eq!(tries.iter().map(|r| r.status).collect::<Vec<_>>(), vec![403, 201], "a rate limit was not processed");
    let waited = tries[1].at.duration_since(tries[0].at).unwrap_or_default();
    assert!(waited >= Duration::from_secs(1), "retry-after: 1 was honoured, waited {waited:?}");
    assert_eq!(gh.runners().len(), 1);
    assert_clean(&gh);
}

#[tokio::test]
async fn a_wait_longer_than_a_call_sits_out_comes_back_with_its_end_and_holds_every_later_call() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let path = format!("/actions/jobs/{}", job.job_id);
    gh.inject(Fault::new("GET", &path, FaultKind::TooManyRequests { retry_after: 3600 }));
    let c = client(&gh);
    let before = SystemTime::now();
    let err = c.get_job(&repo(), job.job_id).await.expect_err("rate limited for an hour");
    assert!(err.is_transient(), "{err:?}");
    let until = err.retry_not_before().unwrap_or_else(|| panic!("no time to retry at: {err:?}"));
    assert!(until >= before + Duration::from_secs(3600), "{err:?}");
    assert!(matches!(err, ApiError::RateLimited { status: Some(s), .. } if s.as_u16() == 429), "{err:?}");
    assert!(err.to_string().contains("GitHub rate limit until "), "{err}");
    assert_eq!(c.held_until(), Some(until));
    assert_eq!(answered(&gh, &path).len(), 1, "not retried inside the client");

    // Every other call on the client, and on a clone, is refused without reaching GitHub.
    let sent = gh.requests().len();
    for c in [&c, &c.clone()] {
        let err = c.list_runs(&repo(), None, None).await.expect_err("held back");
        assert!(matches!(err, ApiError::RateLimited { status: None, .. }), "{err:?}");
        assert_eq!(err.retry_not_before(), Some(until));
    }
    assert_eq!(gh.requests().len(), sent, "nothing sent while held back");
    assert_clean(&gh);
}

#[tokio::test]
async fn rate_limit_figures_are_kept_per_credential() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let c = client(&gh);
    assert!(c.rate_limits().is_empty());
    c.get_job(&repo(), job.job_id).await.expect("call");
    c.get_job(&repo(), job.job_id).await.expect("call");
    let limits = c.rate_limits();
    let inst = limits
        .iter()
        .find(|l| l.credential == format!("installation {INSTALLATION}"))
        .unwrap_or_else(|| panic!("no installation figures: {limits:?}"));
    assert_eq!((inst.resource.as_str(), inst.limit, inst.remaining, inst.used), ("core", 5000, 4998, Some(2)));
    assert!(inst.reset > 0);
    assert!(limits.iter().any(|l| l.credential == "app"), "the App's own calls too: {limits:?}");

    // Used up: the figures say so, and the wait (an hour) is the caller's.
    let path = format!("/actions/jobs/{}", job.job_id);
    gh.inject(Fault::new("GET", &path, FaultKind::RateLimitExhausted { reset_in: 3600 }).times(1));
    let err = c.get_job(&repo(), job.job_id).await.expect_err("exhausted");
    assert!(err.is_transient(), "{err:?}");
    let inst = c.rate_limits().into_iter().find(|l| l.credential == format!("installation {INSTALLATION}"));
    let inst = inst.expect("installation figures");
    assert_eq!(inst.remaining, 0);
    assert_clean(&gh);
}

/// GitHub's answers and what reached it, in order, by tokio's clock.
fn arrivals(gh: &TestGitHub) -> Vec<(tokio::time::Instant, String, u16)> {
    gh.requests().into_iter().map(|r| (r.instant, format!("{} {}", r.method, r.path), r.status)).collect()
}

/// Asserts that nothing reached the server after `limited` (the rate-limit answer) and before
/// `limited + wait`, and that something did after (the caller got through).
fn assert_quiet(gh: &TestGitHub, limited: tokio::time::Instant, wait: Duration) {
    let all = arrivals(gh);
    let early: Vec<_> = all.iter().filter(|(at, _, _)| *at > limited && *at < limited + wait).collect();
    assert!(early.is_empty(), "sent before GitHub's time ({wait:?} after the limit): {early:#?}");
    assert!(all.iter().any(|(at, _, _)| *at >= limited + wait), "nothing sent after the wait: {all:#?}");
}

/// A caller as impatient as gpuci's were: whatever the error, it tries again `every` later,
/// with several calls on the client (and a clone), until `call` succeeds.
async fn impatient(c: &Client, every: Duration, job_id: u64) -> u32 {
    let clone = c.clone();
    let sha = "a".repeat(40);
    let status = gpuci_github::CommitStatus {
        state: gpuci_github::StatusState::Pending,
        context: "gpuci".into(),
        target_url: None,
        description: None,
    };
    for tries in 1..=1000 {
        let _ = clone.list_runs(&repo(), Some("queued"), None).await;
        let _ = c.create_status(&repo(), &sha, &status).await;
        if c.get_job(&repo(), job_id).await.is_ok() {
            return tries;
        }
        tokio::time::sleep(every).await;
    }
    panic!("never got through");
}

/// Issue 27: a `retry-after` longer than a call sits out was handed back to callers, which
/// retried on their own 8–10 s backoff, long before GitHub's time.
#[tokio::test(start_paused = true)]
async fn regression_issue_27_retry_after_is_obeyed_to_the_second_by_every_call() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let path = format!("/actions/jobs/{}", job.job_id);
    let c = client(&gh);
    c.get_job(&repo(), job.job_id).await.expect("a first call: token and installation found");
    gh.inject(Fault::new("GET", &path, FaultKind::SecondaryRateLimit { retry_after: 90 }).times(1));
    let tries = impatient(&c, Duration::from_secs(8), job.job_id).await;
    assert!(tries > 1, "the limit was not seen");
    let limited = arrivals(&gh).into_iter().find(|(_, _, s)| *s == 403).expect("the limit").0;
    assert_quiet(&gh, limited, Duration::from_secs(90));
    assert_eq!(answered(&gh, &path).iter().map(|(_, s)| *s).collect::<Vec<_>>(), vec![200, 403, 200]);
    assert_eq!(c.held_until(), None, "over");
    assert_clean(&gh);
}

/// Issue 27: an exhausted rate limit is waited out until `x-ratelimit-reset`, by every call.
#[tokio::test(start_paused = true)]
async fn regression_issue_27_a_reset_two_minutes_out_holds_every_call_until_then() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let path = format!("/actions/jobs/{}", job.job_id);
    let c = client(&gh);
    c.get_job(&repo(), job.job_id).await.expect("a first call");
    gh.inject(Fault::new("GET", &path, FaultKind::RateLimitExhausted { reset_in: 120 }).times(1));
    impatient(&c, Duration::from_secs(10), job.job_id).await;
    let limited = arrivals(&gh).into_iter().find(|(_, _, s)| *s == 403).expect("the limit").0;
    // The reset is in whole seconds by GitHub's clock: at least 119 s of it are left.
    assert_quiet(&gh, limited, Duration::from_secs(119));
    assert_clean(&gh);
}

/// Issue 27: a secondary limit with no hint holds back every call on the client for at least a
/// minute, then twice as long at each limit in a row (other calls getting through in between do
/// not end the row); a long quiet does.
#[tokio::test(start_paused = true)]
async fn regression_issue_27_a_secondary_limit_without_a_hint_holds_the_whole_client_a_minute_then_longer() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let path = format!("/actions/jobs/{}", job.job_id);
    let c = client(&gh);
    c.get_job(&repo(), job.job_id).await.expect("a first call");
    gh.inject(Fault::new("GET", &path, FaultKind::SecondaryRateLimitNoHint).times(3));
    // A caller that would try every second.
    impatient(&c, Duration::from_secs(1), job.job_id).await;
    let limits: Vec<_> = arrivals(&gh).into_iter().filter(|(_, _, s)| *s == 403).map(|(at, _, _)| at).collect();
    assert_eq!(limits.len(), 3, "{:#?}", arrivals(&gh));
    for (limited, wait) in limits.iter().zip([60, 120, 240]) {
        assert_quiet(&gh, *limited, Duration::from_secs(wait));
    }
    assert_eq!(answered(&gh, &path).iter().map(|(_, s)| *s).collect::<Vec<_>>(), vec![200, 403, 403, 403, 200]);

    // A quarter of an hour and more without a limit ends the row: a minute again, not eight.
    tokio::time::sleep(Duration::from_secs(20 * 60)).await;
    gh.inject(Fault::new("GET", &path, FaultKind::SecondaryRateLimitNoHint).times(1));
    let err = c.get_job(&repo(), job.job_id).await.expect_err("limited again");
    let until = err.retry_not_before().expect("an end");
    let left = until.duration_since(SystemTime::now()).expect("ahead");
    assert!(left > Duration::from_secs(59) && left <= Duration::from_secs(60), "{left:?}");
    assert_clean(&gh);
}

/// A hold within what a call sits out is waited out inside the call; the other calls wait too.
#[tokio::test(start_paused = true)]
async fn a_short_hold_is_sat_out_inside_the_call_and_holds_the_others_as_well() {
    let gh = server().await;
    let job = gh.queue_workflow_job("octo/gpu", &["self-hosted", "gpu"], "true", false).await;
    let path = format!("/actions/jobs/{}", job.job_id);
    let c = client(&gh);
    c.get_job(&repo(), job.job_id).await.expect("a first call");
    gh.inject(Fault::new("GET", &path, FaultKind::TooManyRequests { retry_after: 4 }).times(1));
    let r = repo();
    let (a, b) = tokio::join!(c.get_job(&r, job.job_id), async {
        // Sent once the limit is known.
        tokio::time::sleep(Duration::from_millis(500)).await;
        c.list_runs(&r, None, None).await
    });
    a.expect("the limited call got through after the wait");
    b.expect("the other call too");
    let limited = arrivals(&gh).into_iter().find(|(_, _, s)| *s == 429).expect("the limit").0;
    assert_quiet(&gh, limited, Duration::from_secs(4));
    assert_clean(&gh);
}
