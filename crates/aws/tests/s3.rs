//! The S3 blob bucket against a real S3 API: `moto_server` on 127.0.0.1 (the same server the
//! EC2 tests use; it serves S3 too). Bytes come back identical, large objects go up in parts,
//! a missing object or bucket is named in the error.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "common/moto.rs"]
mod moto;

use gpuci_aws::s3::{Bucket, S3Error, S3Settings, PART_BYTES};
use gpuci_aws::AwsCredentials;
use moto::Moto;
use std::io::{Read, Write};
use std::net::TcpStream;
use tokio::io::AsyncReadExt;

/// A raw, unsigned S3 request to moto (it checks no signature, but reads the service from
/// the credential scope): the test's own view of the bucket, not the code under test's.
fn s3(moto: &Moto, method: &str, path: &str) -> String {
    let addr = moto.url.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: AWS4-HMAC-SHA256 Credential=test/20260101/{}/s3/aws4_request, SignedHeaders=host, Signature=0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        moto::REGION
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn settings(moto: &Moto, bucket: &str, prefix: &str) -> S3Settings {
    S3Settings {
        bucket: bucket.into(),
        prefix: prefix.into(),
        endpoint: Some(moto.url.clone()),
        region: moto::REGION.into(),
        path_style: true,
        profile: None,
        credentials_file: None,
    }
}

fn bucket(moto: &Moto, name: &str, prefix: &str) -> Bucket {
    let answer = s3(moto, "PUT", &format!("/{name}"));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    Bucket::with_credentials(settings(moto, name, prefix), AwsCredentials::new("test", "test", None, None, "test"))
}

/// `n` bytes that do not compress and differ from run to run of the generator's seed.
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

async fn read_all(b: &Bucket, name: &str) -> Vec<u8> {
    let mut o = b.get(name).await.unwrap();
    let mut got = Vec::new();
    o.body.read_to_end(&mut got).await.unwrap();
    assert_eq!(o.bytes, got.len() as u64);
    got
}

#[tokio::test]
async fn blobs_come_back_byte_identical_and_large_ones_go_up_in_parts() {
    let Some(moto) = moto::start("s3 put/get") else { return };
    let b = bucket(&moto, "gpuci-blobs", "ci/prod");
    b.check().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // A few MiB in one PUT, and one over the part size: 8 + 8 + 4 MiB parts.
    let small = noise(3 << 20, 7);
    let large = noise((2 * PART_BYTES + (4 << 20)) as usize, 11);
    for (name, bytes) in [("artifacts/small", &small), ("artifacts/large", &large)] {
        let f = dir.path().join("staged");
        std::fs::write(&f, bytes).unwrap();
        b.put_file(name, &f, bytes.len() as u64).await.unwrap();
    }
    assert!(read_all(&b, "artifacts/small").await == small, "the small blob differs");
    assert!(read_all(&b, "artifacts/large").await == large, "the large blob differs");
    // Seen through the S3 API itself: under the prefix, and the large one as a multipart
    // object of 3 parts (its ETag is `"<md5 of the parts' md5s>-3"`).
    let listing = s3(&moto, "GET", "/gpuci-blobs?list-type=2&prefix=ci/prod/");
    assert!(listing.contains("<Key>ci/prod/artifacts/small</Key>"), "{listing}");
    assert!(listing.contains("<Key>ci/prod/artifacts/large</Key>"), "{listing}");
    let head = s3(&moto, "HEAD", "/gpuci-blobs/ci/prod/artifacts/large");
    let etag = head.lines().find(|l| l.to_ascii_lowercase().starts_with("etag:")).unwrap_or_default().to_string();
    assert!(etag.trim_end().ends_with("-3\""), "not a 3-part upload: {etag}");
    assert_eq!(b.head("artifacts/large").await.unwrap(), Some(large.len() as u64));

    let listed = b.list("artifacts").await.unwrap();
    let mut names: Vec<(&str, u64)> = listed.iter().map(|l| (l.name.as_str(), l.bytes)).collect();
    names.sort();
    assert_eq!(names, [("large", large.len() as u64), ("small", small.len() as u64)]);
    assert!(listed.iter().all(|l| l.modified_ms > 0));
    b.delete("artifacts/small").await.unwrap();
    b.delete("artifacts/small").await.unwrap(); // gone already: no error
    assert_eq!(b.head("artifacts/small").await.unwrap(), None);
    assert_eq!(b.list("artifacts").await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_missing_object_or_bucket_is_named_in_the_error() {
    let Some(moto) = moto::start("s3 missing") else { return };
    let b = bucket(&moto, "gpuci-present", "");
    match b.get("uploads/nothing.tar.gz").await {
        Err(e @ S3Error::NotFound { .. }) => {
            assert_eq!(e.to_string(), "s3://gpuci-present/uploads/nothing.tar.gz: no such object")
        }
        Err(e) => panic!("expected not found, got {e}"),
        Ok(_) => panic!("expected not found, got an object"),
    }
    let missing =
        Bucket::with_credentials(settings(&moto, "gpuci-absent", ""), AwsCredentials::new("t", "t", None, None, "t"));
    let e = missing.check().await.unwrap_err().to_string();
    assert!(e.contains("s3://gpuci-absent/") && e.contains("HeadBucket"), "{e}");
    // A file that is not there: the error names it.
    let e = b.put_file("x", std::path::Path::new("/nonexistent/staged"), 3).await.unwrap_err().to_string();
    assert!(e.contains("/nonexistent/staged"), "{e}");
}
