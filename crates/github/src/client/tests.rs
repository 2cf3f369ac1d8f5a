//! The client's own unit tests: base64 of file contents, retry pauses, which requests may be
//! retried, path encoding. Requests against a server are in `tests/client/`.

use super::*;

#[test]
fn base64_decodes_github_wrapped_content() {
    assert_eq!(decode_base64("aGVs\nbG8g\nd29y\nbGQ=\n").as_deref(), Some(&b"hello world"[..]));
    assert_eq!(decode_base64("YQ==").as_deref(), Some(&b"a"[..]));
    assert_eq!(decode_base64("YWI=").as_deref(), Some(&b"ab"[..]));
    assert_eq!(decode_base64("").as_deref(), Some(&b""[..]));
    assert_eq!(decode_base64("+/+/").as_deref(), Some(&[0xfb, 0xff, 0xbf][..]));
    for bad in ["YQ=", "Y===", "YQ==YQ==", "YQ!=", "YW\u{e9}="] {
        assert_eq!(decode_base64(bad), None, "{bad:?}");
    }
}

fn policy() -> RetryPolicy {
    RetryPolicy {
        attempts: 4,
        base: std::time::Duration::from_secs(1),
        max_backoff: std::time::Duration::from_secs(3),
        max_wait: std::time::Duration::from_secs(20),
        timeout: std::time::Duration::from_secs(30),
    }
}

#[test]
fn backoff_doubles_up_to_its_cap_with_half_of_it_random() {
    let p = policy();
    let secs = |d: Option<std::time::Duration>| d.map(|d| d.as_secs_f64());
    // Without jitter the lower half, with the most jitter the whole pause.
    assert_eq!(secs(retry_pause(&p, 1, 0.0)), Some(0.5));
    assert_eq!(secs(retry_pause(&p, 2, 0.0)), Some(1.0));
    assert_eq!(secs(retry_pause(&p, 3, 0.0)), Some(1.5), "capped at 3 s");
    for failed in 1..4 {
        for jitter in [0.0, 0.3, 0.999, 7.0, -1.0] {
            let pause = retry_pause(&p, failed, jitter).expect("a retry is left");
            let full = (p.base * (1 << (failed - 1))).min(p.max_backoff);
            assert!(pause >= full / 2 && pause <= full, "{failed} {jitter}: {pause:?}");
        }
    }
    assert_eq!(retry_pause(&p, 4, 0.5), None, "four tries in all");
    assert_eq!(retry_pause(&p, 0, 0.5), None);
    // Huge failure counts neither overflow nor exceed the cap (attempts permitting).
    let many = RetryPolicy { attempts: u32::MAX, ..p };
    assert!(retry_pause(&many, 1000, 0.9).is_some_and(|d| d <= many.max_backoff));
}

#[test]
fn only_requests_that_may_arrive_twice_are_retried_after_a_5xx() {
    assert!(repeatable(&Method::GET, "get workflow job"));
    assert!(repeatable(&Method::DELETE, "delete repository runner"));
    assert!(repeatable(&Method::POST, "cancel workflow run"));
    assert!(!repeatable(&Method::POST, "generate JIT runner config"));
    assert!(!repeatable(&Method::POST, "create check run"));
}

#[test]
fn jitter_is_in_range() {
    for _ in 0..100 {
        let j = jitter();
        assert!((0.0..1.0).contains(&j), "{j}");
    }
}

#[test]
fn paths_are_encoded_segment_by_segment() {
    let repo = Repo::parse("gpu-lab/kernels").expect("repo");
    assert_eq!(
        repo_path("t", &repo, &["issues", "5", "labels", "needs gpu/ci: 100%"]).expect("path"),
        "/repos/gpu-lab/kernels/issues/5/labels/needs%20gpu%2Fci%3A%20100%25"
    );
    for bad in ["..", ".", ""] {
        let err = repo_path("t", &repo, &["labels", bad]).expect_err("dot segment");
        assert!(matches!(err, ApiError::InvalidArgument { .. }) && !err.is_transient(), "{err:?}");
    }
    let sneaky = Repo { owner: "..".into(), name: "x".into() };
    assert!(repo_path("t", &sneaky, &[]).is_err());
}
