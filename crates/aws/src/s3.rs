//! An S3-compatible bucket as plain async calls on plain types: the coordinator's shared blob
//! storage (uploads and artifacts that every coordinator on one database reads; docs/ha.md).
//! The coordinator wraps a [`Bucket`] in its own `BlobStore` trait; this module knows keys,
//! files and byte streams, never what they hold.
//!
//! - Credentials come from the standard AWS chain (environment, the shared config and
//!   credentials files or the file the operator names, web identity, the instance's or task's
//!   role), never from gpuci's config file.
//! - Bodies stream: a put reads its (already staged, synced) local file part by part; a
//!   multipart upload for anything over [`PART_BYTES`], each part read from the file at its
//!   offset, so memory holds one part at most; a get hands back the response body as an
//!   `AsyncRead`.
//! - The SDK's request checksums are off unless an operation requires them: S3-compatible
//!   stores (MinIO, R2, moto) differ on the trailing-checksum (`aws-chunked`) encoding, and
//!   the coordinator names every object by the sha256 of its bytes anyway.
//! - Every body is sent with its `Content-MD5` (computed here from the file, part by part),
//!   which S3 (and MinIO, Ceph, R2, GCS) verifies: bytes changed on the way are refused
//!   (`BadDigest`), never stored as good. (Outsider attack: a proxy that flipped a byte of
//!   a `PutObject` body had the corrupt bytes stored and the producing job end green.) moto
//!   does not verify it; the tests stand in for S3 there.
//! - A put is checked after it returns: the object must be there at its size (`HeadObject`;
//!   S3 reads after writes consistently). A store that answers 200 without storing is an
//!   error, never a silent loss (outsider attack: the artifact row named a missing blob).
//!
//! - Every call is bounded, so a hung or unreachable S3 fails a request in seconds, with a
//!   one-line cause naming the endpoint, instead of holding it (outsider attack: a hung S3
//!   held a 1-second job for two minutes). A connection must open within
//!   [`CONNECT_TIMEOUT`]; a call without a body must be answered within [`CALL_TIMEOUT`] per
//!   attempt, [`MAX_ATTEMPTS`] attempts. A call that sends a body (`PutObject`, `UploadPart`:
//!   at most [`PART_BYTES`] each) gets [`CALL_TIMEOUT`] plus its size at [`MIN_RATE`] per
//!   attempt: a large upload is cut only if one of its parts stops moving, never for its
//!   total length; completing a multipart upload gets a minute plus the object's size at
//!   16 MiB/s (S3 assembles the parts first). A download's body, once its headers came, may stream for as long as the
//!   client reads, but S3 may not go silent for longer than [`BODY_IDLE`].
//!   (The SDK's `read_timeout` is not used: it bounds sending the request body too.)
//!
//! What it must not do: decide what to keep (the coordinator's collectors do), or retry a
//! failed multipart upload on its own beyond the SDK's per-request retries (the caller gets
//! the error; the upload is aborted so no parts linger).

use aws_sdk_s3::config::{BehaviorVersion, Region};
use aws_sdk_s3::error::ProvideErrorMetadata;
use aws_sdk_s3::primitives::{ByteStream, Length};
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

/// Objects larger than this are sent as a multipart upload of parts this size (the last
/// smaller). S3's minimum part is 5 MiB and its most parts 10,000: 8 MiB parts carry objects
/// up to 78 GiB, far above any cap gpuci sets.
pub const PART_BYTES: u64 = 8 << 20;

/// A TCP (and TLS) connection to the endpoint must be up within this.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// One attempt of a call without a body (and a `GetObject` until its headers): S3 answers
/// these in milliseconds; ten seconds is a server in trouble.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts per call (the first and one retry, the SDK's standard back-off between): the
/// caller (an agent's upload, a collector pass) tries again later on its own.
pub const MAX_ATTEMPTS: u32 = 2;
/// The slowest a body may go up before its attempt is given up: 256 KiB/s, so an 8 MiB
/// part has 10 s + 32 s.
pub const MIN_RATE: u64 = 256 << 10;
/// How long a download's body may bring no byte.
pub const BODY_IDLE: Duration = Duration::from_secs(30);

/// Where the blobs are (`[blobs]` with `backend = "s3"`; docs/artifacts.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Settings {
    pub bucket: String,
    /// Every key starts with it (no leading or trailing `/`); empty: the bucket's root.
    pub prefix: String,
    /// Another endpoint than AWS's (MinIO, R2, a test server); `None`: AWS's for the region.
    pub endpoint: Option<String>,
    pub region: String,
    /// `https://endpoint/bucket/key` instead of `https://bucket.endpoint/key`: what most
    /// S3-compatible servers want.
    pub path_style: bool,
    /// A profile of the shared AWS config files to take credentials from; `None`: the chain's
    /// default (`AWS_PROFILE`, else `default`).
    pub profile: Option<String>,
    /// A credentials file (the AWS shared-credentials format) read in place of
    /// `~/.aws/credentials`.
    pub credentials_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum S3Error {
    #[error("s3://{bucket}/{key}: no such object")]
    NotFound { bucket: String, key: String },
    /// What S3 (or the network on the way) answered, with its error code when it sent one.
    #[error("s3://{bucket}/{key}: {operation}: {message}")]
    Service { bucket: String, key: String, operation: &'static str, message: String },
    #[error("s3://{bucket}/{key}: reading {file}: {source}")]
    File { bucket: String, key: String, file: PathBuf, source: std::io::Error },
}

/// One object as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    /// The key without the bucket's prefix and the listed directory: a bare name.
    pub name: String,
    pub bytes: u64,
    /// Its last write (Unix ms): for a multipart upload, when the upload began.
    pub modified_ms: i64,
}

/// An object's bytes, streamed.
pub struct Object {
    pub bytes: u64,
    pub body: Pin<Box<dyn tokio::io::AsyncRead + Send>>,
}

/// One bucket (and prefix) through one client.
#[derive(Clone, Debug)]
pub struct Bucket {
    client: aws_sdk_s3::Client,
    settings: S3Settings,
}

fn http_client() -> aws_sdk_s3::config::SharedHttpClient {
    aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
}

/// An error and its sources as one line, `outer: inner: …`, each said once (hyper repeats
/// its cause). Never the `Debug` dump `DisplayErrorContext` appends.
fn one_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(e);
    while let Some(err) = next {
        let text = err.to_string().replace(['\n', '\r'], " ");
        if !text.is_empty() && !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = err.source();
    }
    parts.join(": ")
}

/// What S3 said, as one line: its code and message when it sent them, else the cause (a
/// refused connection, a timeout) and where it was sent (`(http://127.0.0.1:9)`).
fn describe<E>(e: &aws_sdk_s3::error::SdkError<E, aws_sdk_s3::config::http::HttpResponse>, at: &str) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    use aws_sdk_s3::error::SdkError;
    match e {
        SdkError::ServiceError(s) => {
            let err = s.err();
            match (err.code(), err.message()) {
                (Some(c), Some(m)) => format!("{c}: {m}"),
                (Some(c), None) => c.to_string(),
                // A HEAD's error has no body: the status is all there is.
                _ => format!("HTTP {} from {at}", s.raw().status().as_u16()),
            }
        }
        _ => format!("{} ({at})", one_line(e)),
    }
}

/// Timeouts for a call that sends `bytes` of body (module docs).
fn body_timeouts(bytes: u64) -> aws_sdk_s3::config::Builder {
    attempt_timeouts(CALL_TIMEOUT + Duration::from_secs(bytes / MIN_RATE))
}

/// Timeouts for completing a multipart upload of `bytes`: S3 assembles the parts before it
/// answers (AWS: "could take several minutes", keeping the connection alive with
/// whitespace), so a minute plus the object's size at 16 MiB/s.
fn complete_timeouts(bytes: u64) -> aws_sdk_s3::config::Builder {
    attempt_timeouts(Duration::from_secs(60 + bytes / (16 << 20)))
}

fn attempt_timeouts(attempt: Duration) -> aws_sdk_s3::config::Builder {
    aws_sdk_s3::config::Builder::new().timeout_config(
        aws_sdk_s3::config::timeout::TimeoutConfig::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .operation_attempt_timeout(attempt)
            // Both attempts and the back-off between.
            .operation_timeout(attempt * MAX_ATTEMPTS + Duration::from_secs(5))
            .build(),
    )
}

/// A download's body that fails when S3 sends nothing for [`BODY_IDLE`]. Only waits on S3
/// count: the body is read when the client wants more, never ahead of it.
struct IdleBody {
    inner: Pin<Box<dyn tokio::io::AsyncRead + Send>>,
    idle: Option<Pin<Box<tokio::time::Sleep>>>,
    what: String,
}

impl tokio::io::AsyncRead for IdleBody {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future;
        use std::task::Poll;
        match self.inner.as_mut().poll_read(cx, buf) {
            Poll::Ready(r) => {
                self.idle = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let idle = self.idle.get_or_insert_with(|| Box::pin(tokio::time::sleep(BODY_IDLE)));
                match idle.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("{}: S3 sent no byte for {}s", self.what, BODY_IDLE.as_secs()),
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl Bucket {
    /// A client for `settings`, with credentials from the standard AWS chain. Makes no call:
    /// [`Bucket::check`] does.
    pub async fn connect(settings: S3Settings) -> Bucket {
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http_client())
            .region(Region::new(settings.region.clone()));
        if let Some(p) = &settings.profile {
            loader = loader.profile_name(p);
        }
        if let Some(f) = &settings.credentials_file {
            #[allow(deprecated)] // the alias is the only public path to the type in aws-config 1.x
            let files = aws_config::profile::profile_file::ProfileFiles::builder()
                .include_default_config_file(true)
                .with_file(aws_config::profile::profile_file::ProfileFileKind::Credentials, f)
                .build();
            loader = loader.profile_files(files);
        }
        let shared = loader.load().await;
        Self::from_sdk_config(&shared, settings)
    }

    /// As [`Bucket::connect`], with fixed credentials (tests).
    pub fn with_credentials(settings: S3Settings, credentials: crate::AwsCredentials) -> Bucket {
        let shared = aws_config::SdkConfig::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(settings.region.clone()))
            .credentials_provider(aws_sdk_s3::config::SharedCredentialsProvider::new(credentials))
            .http_client(http_client())
            .build();
        Self::from_sdk_config(&shared, settings)
    }

    fn from_sdk_config(shared: &aws_config::SdkConfig, settings: S3Settings) -> Bucket {
        use aws_sdk_s3::config::{RequestChecksumCalculation, ResponseChecksumValidation};
        let mut config = aws_sdk_s3::config::Builder::from(shared)
            .force_path_style(settings.path_style)
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .retry_config(aws_sdk_s3::config::retry::RetryConfig::standard().with_max_attempts(MAX_ATTEMPTS))
            .timeout_config(
                aws_sdk_s3::config::timeout::TimeoutConfig::builder()
                    .connect_timeout(CONNECT_TIMEOUT)
                    // A GetObject's operation ends with its headers: its body streams on,
                    // watched by `IdleBody`. Calls with a body override these (`body_timeouts`).
                    .operation_attempt_timeout(CALL_TIMEOUT)
                    .operation_timeout(CALL_TIMEOUT * MAX_ATTEMPTS + Duration::from_secs(5))
                    .build(),
            );
        if let Some(url) = &settings.endpoint {
            config = config.endpoint_url(url);
        }
        Bucket { client: aws_sdk_s3::Client::from_conf(config.build()), settings }
    }

    pub fn settings(&self) -> &S3Settings {
        &self.settings
    }

    /// `s3://bucket/prefix`, for messages.
    pub fn url(&self) -> String {
        format!("s3://{}/{}", self.settings.bucket, self.settings.prefix)
    }

    fn key(&self, name: &str) -> String {
        if self.settings.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}/{name}", self.settings.prefix)
        }
    }

    fn service(&self, key: &str, operation: &'static str, message: String) -> S3Error {
        S3Error::Service { bucket: self.settings.bucket.clone(), key: key.to_string(), operation, message }
    }

    /// Where requests go, for messages: the endpoint, or AWS's for the region.
    fn at(&self) -> String {
        match &self.settings.endpoint {
            Some(e) => e.clone(),
            None => format!("AWS S3 in {}", self.settings.region),
        }
    }

    /// [`S3Error::Service`] from what the SDK answered.
    fn failed<E>(
        &self,
        key: &str,
        operation: &'static str,
        e: &aws_sdk_s3::error::SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    ) -> S3Error
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        self.service(key, operation, describe(e, &self.at()))
    }

    /// `HeadBucket`: the bucket exists and these credentials reach it.
    pub async fn check(&self) -> Result<(), S3Error> {
        self.client
            .head_bucket()
            .bucket(&self.settings.bucket)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| self.failed("", "HeadBucket", &e))
    }

    /// Store the `bytes` bytes of `file` as `name` (a key under the prefix), replacing what
    /// was there. The file must not change meanwhile.
    pub async fn put_file(&self, name: &str, file: &Path, bytes: u64) -> Result<(), S3Error> {
        let key = self.key(name);
        let read_error = |source| S3Error::File {
            bucket: self.settings.bucket.clone(),
            key: key.clone(),
            file: file.to_path_buf(),
            source,
        };
        let part = |offset: u64, length: u64| {
            ByteStream::read_from().path(file).offset(offset).length(Length::Exact(length)).build()
        };
        if bytes <= PART_BYTES {
            let md5 = content_md5(file, 0, bytes).await.map_err(read_error)?;
            let body = part(0, bytes).await.map_err(|e| read_error(std::io::Error::other(e)))?;
            self.client
                .put_object()
                .bucket(&self.settings.bucket)
                .key(&key)
                .content_length(i64::try_from(bytes).unwrap_or(i64::MAX))
                .content_md5(md5)
                .body(body)
                .customize()
                .config_override(body_timeouts(bytes))
                .send()
                .await
                .map_err(|e| self.failed(&key, "PutObject", &e))?;
            return self.stored(name, &key, "PutObject", bytes).await;
        }
        let created = self
            .client
            .create_multipart_upload()
            .bucket(&self.settings.bucket)
            .key(&key)
            .send()
            .await
            .map_err(|e| self.failed(&key, "CreateMultipartUpload", &e))?;
        let Some(upload_id) = created.upload_id().map(str::to_string) else {
            return Err(self.service(&key, "CreateMultipartUpload", "the answer names no upload id".into()));
        };
        let sent = async {
            let mut parts = Vec::new();
            let mut offset = 0;
            let mut number = 1;
            while offset < bytes {
                let length = PART_BYTES.min(bytes - offset);
                let md5 = content_md5(file, offset, length).await.map_err(read_error)?;
                let body = part(offset, length).await.map_err(|e| read_error(std::io::Error::other(e)))?;
                let done = self
                    .client
                    .upload_part()
                    .bucket(&self.settings.bucket)
                    .key(&key)
                    .upload_id(&upload_id)
                    .part_number(number)
                    .content_length(i64::try_from(length).unwrap_or(i64::MAX))
                    .content_md5(md5)
                    .body(body)
                    .customize()
                    .config_override(body_timeouts(length))
                    .send()
                    .await
                    .map_err(|e| self.failed(&key, "UploadPart", &e))?;
                parts.push(CompletedPart::builder().part_number(number).set_e_tag(done.e_tag).build());
                offset += length;
                number += 1;
            }
            let completed = self
                .client
                .complete_multipart_upload()
                .bucket(&self.settings.bucket)
                .key(&key)
                .upload_id(&upload_id)
                .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(parts)).build())
                .customize()
                .config_override(complete_timeouts(bytes))
                .send()
                .await;
            match completed {
                Ok(_) => self.stored(name, &key, "CompleteMultipartUpload", bytes).await,
                // A 200 whose body the SDK cannot read: some S3-compatible servers (moto 5.x)
                // answer `<CompleteMultipartUploadResponse>` where S3 says `…Result`. (A real
                // failure of a complete comes as an error document, which is no 200.) Whether
                // the object is there, whole, decides.
                Err(e) if e.raw_response().is_some_and(|r| r.status().as_u16() == 200) => {
                    match self.head(name).await? {
                        Some(n) if n == bytes => Ok(()),
                        _ => Err(self.failed(&key, "CompleteMultipartUpload", &e)),
                    }
                }
                Err(e) => Err(self.failed(&key, "CompleteMultipartUpload", &e)),
            }
        }
        .await;
        if sent.is_err() {
            // Parts of an unfinished upload are billed until aborted.
            let _ = self
                .client
                .abort_multipart_upload()
                .bucket(&self.settings.bucket)
                .key(&key)
                .upload_id(&upload_id)
                .send()
                .await;
        }
        sent
    }

    /// After a put S3 answered with success: `name` must be there with its `bytes` bytes. A
    /// store that said 200 and kept nothing (or something else) is an error, so the caller
    /// records nothing for the object and sends it again later.
    async fn stored(&self, name: &str, key: &str, operation: &'static str, bytes: u64) -> Result<(), S3Error> {
        match self.head(name).await? {
            Some(n) if n == bytes => Ok(()),
            Some(n) => Err(self.service(
                key,
                operation,
                format!("S3 answered success, but the object is {n} bytes, not the {bytes} sent; not stored"),
            )),
            None => Err(self.service(
                key,
                operation,
                "S3 answered success, but the object is not there (HeadObject: no such object); not stored".into(),
            )),
        }
    }

    /// The bytes of `name`, streamed; [`S3Error::NotFound`] when there is no such object.
    pub async fn get(&self, name: &str) -> Result<Object, S3Error> {
        let key = self.key(name);
        match self.client.get_object().bucket(&self.settings.bucket).key(&key).send().await {
            Ok(o) => Ok(Object {
                bytes: o.content_length().and_then(|n| u64::try_from(n).ok()).unwrap_or(0),
                body: Box::pin(IdleBody {
                    inner: Box::pin(o.body.into_async_read()),
                    idle: None,
                    what: format!("s3://{}/{key} at {}", self.settings.bucket, self.at()),
                }),
            }),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => {
                Err(S3Error::NotFound { bucket: self.settings.bucket.clone(), key })
            }
            Err(e) => Err(self.failed(&key, "GetObject", &e)),
        }
    }

    /// The size of `name`, or `None` when there is no such object.
    pub async fn head(&self, name: &str) -> Result<Option<u64>, S3Error> {
        let key = self.key(name);
        match self.client.head_object().bucket(&self.settings.bucket).key(&key).send().await {
            Ok(o) => Ok(Some(o.content_length().and_then(|n| u64::try_from(n).ok()).unwrap_or(0))),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_not_found()) => Ok(None),
            Err(e) => Err(self.failed(&key, "HeadObject", &e)),
        }
    }

    /// Delete `name`; an object already gone is no error (S3 answers the same).
    pub async fn delete(&self, name: &str) -> Result<(), S3Error> {
        let key = self.key(name);
        self.client
            .delete_object()
            .bucket(&self.settings.bucket)
            .key(&key)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| self.failed(&key, "DeleteObject", &e))
    }

    /// Every object directly under `dir/` (a key under the prefix), all pages.
    pub async fn list(&self, dir: &str) -> Result<Vec<Listed>, S3Error> {
        let start = format!("{}/", self.key(dir));
        let mut out = Vec::new();
        let mut pages =
            self.client.list_objects_v2().bucket(&self.settings.bucket).prefix(&start).into_paginator().send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.failed(&start, "ListObjectsV2", &e))?;
            for o in page.contents() {
                let Some(name) = o.key().and_then(|k| k.strip_prefix(&start)) else { continue };
                if name.contains('/') {
                    continue;
                }
                out.push(Listed {
                    name: name.to_string(),
                    bytes: o.size().and_then(|n| u64::try_from(n).ok()).unwrap_or(0),
                    // No date (a server that sends none): as if written now, so a collector's
                    // grace period spares it rather than taking it as ancient.
                    modified_ms: o.last_modified().and_then(|t| t.to_millis().ok()).unwrap_or_else(now_ms),
                });
            }
        }
        Ok(out)
    }
}

/// The `Content-MD5` header (base64 of the MD5) of `length` bytes of `file` at `offset`: at
/// most one part ([`PART_BYTES`]), read in pieces, off the async threads.
async fn content_md5(file: &Path, offset: u64, length: u64) -> Result<String, std::io::Error> {
    use base64::Engine;
    use md5::Digest;
    use std::io::{Read, Seek};
    let file = file.to_path_buf();
    let digest = tokio::task::spawn_blocking(move || {
        let mut f = std::fs::File::open(&file)?;
        f.seek(std::io::SeekFrom::Start(offset))?;
        let mut hasher = md5::Md5::new();
        let mut buf = vec![0u8; 256 << 10];
        let mut left = length;
        while left > 0 {
            let want = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
            let n = f.read(&mut buf[..want])?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the file is shorter than its size",
                ));
            }
            hasher.update(&buf[..n]);
            left -= n as u64;
        }
        Ok(hasher.finalize())
    })
    .await
    .map_err(std::io::Error::other)??;
    Ok(base64::engine::general_purpose::STANDARD.encode(digest))
}

fn now_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}
