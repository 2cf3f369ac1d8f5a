//! A blob's bytes as an HTTP response body that is checked against the sha256 the blob is
//! named by while it streams. Every blob is content-addressed, so a download that does not
//! hash to its name is bytes the store changed (a corrupt disk, an S3 that answers with other
//! bytes): the response must not end as a clean, complete 200.
//!
//! The last chunk read is held back until the store's body has ended and the hash (and the
//! length) is known: on a match it goes out and the body ends; on a mismatch the body ends
//! with an error instead, so the server cuts the connection short of its `Content-Length`
//! and the client sees a broken transfer, never the whole of a wrong file. (Outsider attack:
//! bytes flipped on the S3 side were served whole with 200; only the `x-gpuci-sha256`
//! header told.) The mismatch is logged with the blob's name and where it is stored.
//!
//! What it does not do: repair or delete the blob (it may be the store's read path that is
//! wrong, not the object), or tell the client why (the status line has gone out already).

use super::Blob;
use axum::body::Bytes;
use futures::{Stream, StreamExt};
use sha2::{Digest, Sha256};

/// The bytes of `blob`, which must hash to `sha256` (lowercase hex) and be `blob.bytes` long.
/// `what` names the blob in the log (`artifact <sha>`, `upload <id>`), `location` its store.
pub fn checked(
    blob: Blob,
    sha256: String,
    what: String,
    location: String,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let state = State {
        inner: tokio_util::io::ReaderStream::new(blob.body),
        hasher: Sha256::new(),
        held: None,
        read: 0,
        expected_bytes: blob.bytes,
        sha256,
        what,
        location,
        done: false,
    };
    futures::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        loop {
            match s.inner.next().await {
                Some(Ok(chunk)) if chunk.is_empty() => {}
                Some(Ok(chunk)) => {
                    s.hasher.update(&chunk);
                    s.read += chunk.len() as u64;
                    if let Some(previous) = s.held.replace(chunk) {
                        return Some((Ok(previous), s));
                    }
                }
                Some(Err(e)) => {
                    tracing::error!(error = %e, blob = %s.what, location = %s.location, "reading a blob failed mid-download");
                    s.done = true;
                    return Some((Err(e), s));
                }
                None => {
                    s.done = true;
                    let got = hex::encode(std::mem::take(&mut s.hasher).finalize());
                    if got == s.sha256 && s.read == s.expected_bytes {
                        return s.held.take().map(|last| (Ok(last), s));
                    }
                    tracing::error!(
                        blob = %s.what,
                        location = %s.location,
                        read = s.read,
                        expected_bytes = s.expected_bytes,
                        sha256 = %got,
                        "the store returned bytes that do not match the blob's sha256; the download is cut off"
                    );
                    let e = std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "{} in {}: the stored bytes ({} bytes, sha256 {got}) do not match its name ({}, {} bytes)",
                            s.what, s.location, s.read, s.sha256, s.expected_bytes
                        ),
                    );
                    return Some((Err(e), s));
                }
            }
        }
    })
}

struct State {
    inner: tokio_util::io::ReaderStream<std::pin::Pin<Box<dyn tokio::io::AsyncRead + Send>>>,
    hasher: Sha256,
    held: Option<Bytes>,
    read: u64,
    expected_bytes: u64,
    sha256: String,
    what: String,
    location: String,
    done: bool,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    async fn collect(body: &'static [u8], named: &[u8]) -> (Vec<u8>, Option<String>) {
        let blob = Blob { bytes: named.len() as u64, body: Box::pin(body) };
        let mut s = Box::pin(checked(blob, hex::encode(Sha256::digest(named)), "artifact x".into(), "here".into()));
        let mut out = Vec::new();
        while let Some(item) = s.next().await {
            match item {
                Ok(b) => out.extend_from_slice(&b),
                Err(e) => return (out, Some(e.to_string())),
            }
        }
        (out, None)
    }

    #[tokio::test]
    async fn matching_bytes_pass_whole_and_other_bytes_end_in_an_error_short_of_the_end() {
        assert_eq!(collect(b"hello", b"hello").await, (b"hello".to_vec(), None));
        assert_eq!(collect(b"", b"").await, (Vec::new(), None));
        let (got, err) = collect(b"jello", b"hello").await;
        assert!(got.len() < 5, "a wrong file is never sent whole: {got:?}");
        assert!(err.unwrap().contains("do not match"));
        let (got, err) = collect(b"hel", b"hello").await;
        assert!(got.len() < 3 && err.is_some(), "{got:?}");
    }
}
