//! The S3 blob bucket when S3 is not there: an endpoint that accepts connections and never
//! answers, and one where nothing listens. Regression (outsider attack): a hung S3 held a
//! 1-second job for two minutes, and an unreachable one answered with a `Debug` dump of the
//! SDK's error. Every call must end, with a one-line cause naming the endpoint.
//!
//! No S3 server is needed: both endpoints are sockets of this test on 127.0.0.1. Nothing here
//! measures time; a generous tokio timeout only turns a hang into a failure.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_aws::s3::{Bucket, S3Settings};
use gpuci_aws::AwsCredentials;
use std::net::TcpListener;
use std::time::Duration;

/// Turns a hang into a failure; far above any bound the bucket sets itself.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn bucket_at(endpoint: &str) -> Bucket {
    let settings = S3Settings {
        bucket: "gpuci-outage".into(),
        prefix: "ci".into(),
        endpoint: Some(endpoint.into()),
        region: "us-east-1".into(),
        path_style: true,
        profile: None,
        credentials_file: None,
    };
    Bucket::with_credentials(settings, AwsCredentials::new("test", "test", None, None, "test"))
}

/// A listener that accepts every connection and holds it open without a byte.
fn silent_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().flatten() {
            held.push(s);
        }
    });
    url
}

/// An address where nothing listens (bound, noted, released).
fn closed_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

fn guard<T>(what: &'static str) -> impl FnOnce(tokio::time::error::Elapsed) -> T {
    move |_| panic!("{what}: still waiting after {HANG_GUARD:?}")
}

/// Every call the coordinator makes, each bounded by the guard; their error messages.
async fn every_call_fails(b: &Bucket) -> Vec<(&'static str, String)> {
    let dir = tempfile::tempdir().unwrap();
    let staged = dir.path().join("staged");
    std::fs::write(&staged, vec![7u8; 1024]).unwrap();
    let (check, put, get, head, delete, list) = tokio::join!(
        tokio::time::timeout(HANG_GUARD, b.check()),
        tokio::time::timeout(HANG_GUARD, b.put_file("artifacts/x", &staged, 1024)),
        tokio::time::timeout(HANG_GUARD, b.get("artifacts/x")),
        tokio::time::timeout(HANG_GUARD, b.head("artifacts/x")),
        tokio::time::timeout(HANG_GUARD, b.delete("artifacts/x")),
        tokio::time::timeout(HANG_GUARD, b.list("artifacts")),
    );
    vec![
        ("HeadBucket", check.unwrap_or_else(guard("check")).unwrap_err().to_string()),
        ("PutObject", put.unwrap_or_else(guard("put_file")).unwrap_err().to_string()),
        ("GetObject", get.unwrap_or_else(guard("get")).err().unwrap().to_string()),
        ("HeadObject", head.unwrap_or_else(guard("head")).unwrap_err().to_string()),
        ("DeleteObject", delete.unwrap_or_else(guard("delete")).unwrap_err().to_string()),
        ("ListObjectsV2", list.unwrap_or_else(guard("list")).unwrap_err().to_string()),
    ]
}

/// One line, no `Debug` of the SDK's types, the operation and the endpoint named.
fn assert_one_line(operation: &str, message: &str, endpoint: &str) {
    eprintln!("{operation}: {message}");
    assert!(!message.contains('\n'), "{operation}: more than one line: {message}");
    for debug in ["DispatchFailure {", "ConnectorError {", "TimeoutError {", "Some(", "source:"] {
        assert!(!message.contains(debug), "{operation}: a Debug dump ({debug:?}): {message}");
    }
    assert!(message.contains(operation), "{operation}: the operation is not named: {message}");
    assert!(message.contains(endpoint), "{operation}: the endpoint is not named: {message}");
    assert!(message.len() < 400, "{operation}: {} characters: {message}", message.len());
}

#[tokio::test]
async fn an_endpoint_that_never_answers_fails_every_call_with_a_timeout() {
    let endpoint = silent_endpoint();
    let b = bucket_at(&endpoint);
    for (operation, message) in every_call_fails(&b).await {
        assert_one_line(operation, &message, &endpoint);
        assert!(message.contains("timed out") || message.contains("timeout"), "{operation}: {message}");
    }
}

#[tokio::test]
async fn an_endpoint_where_nothing_listens_fails_every_call_with_connection_refused() {
    let endpoint = closed_endpoint();
    let b = bucket_at(&endpoint);
    for (operation, message) in every_call_fails(&b).await {
        assert_one_line(operation, &message, &endpoint);
        assert!(message.to_ascii_lowercase().contains("connection refused"), "{operation}: {message}");
    }
}

/// A download whose body stops halfway: the body read fails, it does not wait for ever
/// (the headers came, so the call's own timeouts are over; the body has its idle bound).
#[tokio::test]
async fn a_download_whose_body_stops_fails_the_read() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut s in listener.incoming().flatten() {
            use std::io::{Read, Write};
            let mut request = Vec::new();
            let mut byte = [0u8; 1];
            while !request.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap_or(0) == 1 {
                request.push(byte[0]);
            }
            let _ = s.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nContent-Type: application/octet-stream\r\n\r\nten bytes.",
            );
            held.push(s);
        }
    });
    let b = bucket_at(&endpoint);
    let mut o = tokio::time::timeout(HANG_GUARD, b.get("artifacts/x")).await.unwrap_or_else(guard("get")).unwrap();
    assert_eq!(o.bytes, 100);
    let mut got = Vec::new();
    let read = tokio::time::timeout(HANG_GUARD, tokio::io::AsyncReadExt::read_to_end(&mut o.body, &mut got))
        .await
        .unwrap_or_else(guard("reading the body"));
    let e = read.unwrap_err();
    eprintln!("body: {e}");
    assert_eq!(got, b"ten bytes.");
}
