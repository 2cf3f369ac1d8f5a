//! Where the bytes of uploads and artifacts live: a [`BlobStore`] — content-addressed
//! blobs by name, with put (from a staged local file), get (streamed), exists, delete and a
//! listing for the collectors. Two backends:
//!
//! - [`LocalBlobs`], the default: a directory in the data dir (`<data-dir>/uploads`,
//!   `<data-dir>/artifacts`), exactly the layout of before. One coordinator owns it.
//! - [`S3Blobs`]: an S3-compatible bucket (`[blobs] backend = "s3"`), which every
//!   coordinator on one database reads, so a standby that takes over serves what the old
//!   leader stored (docs/ha.md). The SDK stays in `gpuci-aws`; this is a thin adapter.
//!
//! Every blob is first written to a temporary file in the local directory while the request
//! body is hashed (the name is the hash, known only at the end; caps are checked on the
//! real length), then handed to [`BlobStore::store`]: the local backend renames it into
//! place, S3 uploads it (multipart above 8 MiB). A staged file is removed when its request
//! ends; the collectors delete those an interrupted request left.
//!
//! Collection and shared stores: a collector pass in one process excludes that process's
//! writers by a gate (`crate::uploads`, `crate::artifacts`), which cannot exclude another
//! coordinator's. So a blob no row names is deleted only once its last write is older than a
//! grace period ([`SHARED_GRACE`]; on every store, though the local one needs it only for
//! workspace uploads not yet named by a pipeline), and with a shared store every store of a blob
//! writes it again (refreshing its last write) rather than trusting that it is there. The
//! write happens outside the gate (no network call under it), so a pass of the same process
//! may list the blob as old just before the write and delete it just after; the writer
//! therefore checks the blob is there once the pass is over (taking the gate) and stores it
//! again if not. What is left, and is not closed by construction: the same interleaving with
//! a pass of *another* coordinator, whose gate the writer cannot take, landing its delete
//! after the writer's check. Only the leader serves the API, so that needs two coordinators
//! that both act as leader (around a takeover). A download then answers 410 Gone (a row
//! whose blob is missing); nothing is served wrong.
//!
//! Failures: a blob that could not be stored or read is a [`BlobError`]; the HTTP handlers
//! answer it with 503 ("the artifact store is unavailable: …"), which clients send again,
//! and record no row for a blob that did not land. Every S3 call is bounded
//! (`gpuci_aws::s3`'s timeouts), so that answer comes in seconds when S3 hangs.
//!
//! Integrity: a store into S3 sends each body with its `Content-MD5` (S3 refuses bytes
//! changed on the way) and is checked afterwards (the object there, at its size), so a
//! store that failed, or that S3 only said it did, is an error and no row names the blob.
//! A download is checked against the blob's name as it streams ([`checked`]): bytes that do
//! not hash to it end the response in an error, short of its length, never as a clean 200.

pub mod checked;

use async_trait::async_trait;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// How old a blob no row (or pipeline) names must be before a collector deletes it, on every
/// store: longer than any store of a blob takes from its write to the commit of the row that
/// names it, and than a client takes from posting an upload to submitting its pipeline.
pub const SHARED_GRACE: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    #[error("{what} {path}: {source}")]
    Local { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    S3(#[from] gpuci_aws::s3::S3Error),
}

/// One blob as listed: a bare name (`<sha256>`, `<sha256>.tar.gz`, `.tmp-…`).
pub type Listed = gpuci_aws::s3::Listed;

/// A blob's bytes, streamed.
pub struct Blob {
    pub bytes: u64,
    pub body: Pin<Box<dyn tokio::io::AsyncRead + Send>>,
}

/// Blobs by name in one namespace (uploads, or artifacts).
#[async_trait]
pub trait BlobStore: Send + Sync + std::fmt::Debug {
    /// Where, for messages: a directory or `s3://bucket/prefix/namespace`.
    fn location(&self) -> String;

    /// Whether other coordinators write here too (see the module docs): a store then writes
    /// a blob again rather than trusting that it is there.
    fn shared(&self) -> bool;

    /// Make the `bytes` bytes of `staged` (a synced local file the caller removes afterwards,
    /// if it is still there) the blob `name`. Returns whether the blob was new. When it was
    /// there already, its last write becomes now (the collectors count age from it).
    async fn store(&self, name: &str, staged: &Path, bytes: u64) -> Result<bool, BlobError>;

    /// The blob `name`, or `None` when there is none.
    async fn open(&self, name: &str) -> Result<Option<Blob>, BlobError>;

    async fn exists(&self, name: &str) -> Result<bool, BlobError>;

    /// Delete `name`; one already gone is no error.
    async fn delete(&self, name: &str) -> Result<(), BlobError>;

    /// Every blob (and, locally, every other file) there.
    async fn list(&self) -> Result<Vec<Listed>, BlobError>;

    /// Whether the store answers now ([`crate::blobs_watch`]); a local directory always does
    /// (its failures are the disk's, reported where they happen).
    async fn check(&self) -> Result<(), BlobError> {
        Ok(())
    }
}

/// A directory of the data dir.
#[derive(Clone, Debug)]
pub struct LocalBlobs {
    dir: PathBuf,
}

impl LocalBlobs {
    pub fn new(dir: PathBuf) -> Self {
        LocalBlobs { dir }
    }
}

fn modified_ms(m: &std::fs::Metadata) -> i64 {
    m.modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Mark a file as just used.
pub(crate) fn touch(path: &Path) {
    if let Ok(f) = std::fs::File::options().write(true).open(path) {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
}

#[async_trait]
impl BlobStore for LocalBlobs {
    fn location(&self) -> String {
        self.dir.display().to_string()
    }

    fn shared(&self) -> bool {
        false
    }

    async fn store(&self, name: &str, staged: &Path, _bytes: u64) -> Result<bool, BlobError> {
        let (dir, path, staged) = (self.dir.clone(), self.dir.join(name), staged.to_path_buf());
        tokio::task::spawn_blocking(move || {
            if path.is_file() {
                // Used again: the collectors count age from the last use.
                touch(&path);
                return Ok(false);
            }
            let failed = |what, source| BlobError::Local { what, path: path.clone(), source };
            // Synced before it gets its name: whatever names it is committed after this.
            std::fs::File::open(&staged).and_then(|f| f.sync_all()).map_err(|e| failed("syncing", e))?;
            std::fs::rename(&staged, &path).map_err(|e| failed("storing", e))?;
            let _ = std::fs::File::open(&dir).and_then(|d| d.sync_all());
            Ok(true)
        })
        .await
        .map_err(|e| BlobError::Local {
            what: "storing",
            path: self.dir.join(name),
            source: std::io::Error::other(e),
        })?
    }

    async fn open(&self, name: &str) -> Result<Option<Blob>, BlobError> {
        let path = self.dir.join(name);
        match tokio::fs::File::open(&path).await {
            Ok(f) => {
                let bytes = f.metadata().await.map(|m| m.len()).unwrap_or(0);
                Ok(Some(Blob { bytes, body: Box::pin(f) }))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(BlobError::Local { what: "opening", path, source }),
        }
    }

    async fn exists(&self, name: &str) -> Result<bool, BlobError> {
        Ok(tokio::fs::metadata(self.dir.join(name)).await.is_ok_and(|m| m.is_file()))
    }

    async fn delete(&self, name: &str) -> Result<(), BlobError> {
        let path = self.dir.join(name);
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(BlobError::Local { what: "deleting", path, source }),
        }
    }

    async fn list(&self) -> Result<Vec<Listed>, BlobError> {
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || list_dir(&dir)).await.map_err(|e| BlobError::Local {
            what: "reading",
            path: self.dir.clone(),
            source: std::io::Error::other(e),
        })?
    }
}

/// The plain files in `dir`; a missing directory holds none.
pub(crate) fn list_dir(dir: &Path) -> Result<Vec<Listed>, BlobError> {
    let failed = |source| BlobError::Local { what: "reading", path: dir.to_path_buf(), source };
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(failed(e)),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(failed)?;
        // Gone between the listing and the look: a temporary file renamed into place.
        let Ok(m) = e.metadata() else { continue };
        if m.is_file() {
            out.push(Listed {
                name: e.file_name().to_string_lossy().into_owned(),
                bytes: m.len(),
                modified_ms: modified_ms(&m),
            });
        }
    }
    Ok(out)
}

/// One namespace (`uploads`, `artifacts`) of a bucket.
#[derive(Clone, Debug)]
pub struct S3Blobs {
    bucket: gpuci_aws::s3::Bucket,
    namespace: &'static str,
}

impl S3Blobs {
    pub fn new(bucket: gpuci_aws::s3::Bucket, namespace: &'static str) -> Self {
        S3Blobs { bucket, namespace }
    }

    fn name(&self, name: &str) -> String {
        format!("{}/{name}", self.namespace)
    }
}

#[async_trait]
impl BlobStore for S3Blobs {
    fn location(&self) -> String {
        format!("{}/{}", self.bucket.url().trim_end_matches('/'), self.namespace)
    }

    fn shared(&self) -> bool {
        true
    }

    async fn store(&self, name: &str, staged: &Path, bytes: u64) -> Result<bool, BlobError> {
        let existed = self.bucket.head(&self.name(name)).await?.is_some();
        // Written again even when it is there: its last write is what keeps a collector on
        // another coordinator from taking it (module docs). Sent with its Content-MD5 and
        // checked to be there at its size afterwards (`Bucket::put_file`): an error, not a
        // row for a blob that is missing or corrupt.
        self.bucket.put_file(&self.name(name), staged, bytes).await?;
        Ok(!existed)
    }

    async fn open(&self, name: &str) -> Result<Option<Blob>, BlobError> {
        match self.bucket.get(&self.name(name)).await {
            Ok(o) => Ok(Some(Blob { bytes: o.bytes, body: o.body })),
            Err(gpuci_aws::s3::S3Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn exists(&self, name: &str) -> Result<bool, BlobError> {
        Ok(self.bucket.head(&self.name(name)).await?.is_some())
    }

    async fn delete(&self, name: &str) -> Result<(), BlobError> {
        Ok(self.bucket.delete(&self.name(name)).await?)
    }

    async fn list(&self) -> Result<Vec<Listed>, BlobError> {
        Ok(self.bucket.list(self.namespace).await?)
    }

    async fn check(&self) -> Result<(), BlobError> {
        Ok(self.bucket.check().await?)
    }
}

/// Which backend (`[blobs]` in the server config).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum BlobsConfig {
    /// `<data-dir>/uploads` and `<data-dir>/artifacts`.
    #[default]
    Local,
    S3(gpuci_aws::s3::S3Settings),
}

/// The stores for uploads and for artifacts. With S3, the bucket is checked first
/// (`HeadBucket`): a coordinator that could not reach it refuses to start, with S3's answer.
pub async fn open(config: &BlobsConfig, data_dir: &Path) -> anyhow::Result<(Arc<dyn BlobStore>, Arc<dyn BlobStore>)> {
    match config {
        BlobsConfig::Local => Ok((
            Arc::new(LocalBlobs::new(data_dir.join("uploads"))),
            Arc::new(LocalBlobs::new(data_dir.join("artifacts"))),
        )),
        BlobsConfig::S3(s) => {
            if let Some(url) = &s.endpoint {
                check_resolved(url).await?;
            }
            let bucket = gpuci_aws::s3::Bucket::connect(s.clone()).await;
            // Bounded (gpuci_aws::s3's timeouts): a silent endpoint fails the start in
            // seconds, saying so, rather than holding it.
            bucket.check().await.map_err(|e| {
                let at = s.endpoint.clone().unwrap_or_else(|| format!("AWS's endpoint for {}", s.region));
                anyhow::anyhow!(
                    "[blobs] bucket {:?} at {at}: the bucket cannot be reached, so the coordinator does not start \
                     (uploads and artifacts could not be stored): {e}",
                    s.bucket
                )
            })?;
            tracing::info!(bucket = %bucket.url(), "uploads and artifacts in S3");
            Ok((Arc::new(S3Blobs::new(bucket.clone(), "uploads")), Arc::new(S3Blobs::new(bucket, "artifacts"))))
        }
    }
}

/// `[blobs]` in the server config file: every key optional, unknown keys refused.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlobsFile {
    /// `local` (the default) or `s3`.
    #[serde(default)]
    pub backend: Backend,
    pub bucket: Option<String>,
    /// A key prefix inside the bucket (`gpuci/prod`).
    pub prefix: Option<String>,
    /// An endpoint other than AWS's: `https://minio.example:9000`. Checked as it is read
    /// ([`Endpoint`]), so a refusal names the file, line and column.
    pub endpoint: Option<Endpoint>,
    pub region: Option<String>,
    /// Path-style addressing (MinIO and most S3-compatible servers want it). Default false.
    pub path_style: Option<bool>,
    /// A profile of the shared AWS config files.
    pub profile: Option<String>,
    /// An AWS shared-credentials file to read instead of `~/.aws/credentials`.
    pub credentials_file: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Local,
    S3,
}

impl BlobsFile {
    /// The checked settings; an error names the field.
    pub fn resolve(&self) -> Result<BlobsConfig, String> {
        let field = |name: &str, why: &str| format!("[blobs] {name}: {why}");
        match self.backend {
            Backend::Local => {
                let s3_only = [
                    ("bucket", self.bucket.is_some()),
                    ("prefix", self.prefix.is_some()),
                    ("endpoint", self.endpoint.is_some()),
                    ("region", self.region.is_some()),
                    ("path_style", self.path_style.is_some()),
                    ("profile", self.profile.is_some()),
                    ("credentials_file", self.credentials_file.is_some()),
                ];
                match s3_only.iter().find(|(_, set)| *set) {
                    Some((name, _)) => Err(field(name, "only with backend = \"s3\"")),
                    None => Ok(BlobsConfig::Local),
                }
            }
            Backend::S3 => {
                let bucket = self.bucket.clone().ok_or_else(|| field("bucket", "required with backend = \"s3\""))?;
                if let Err(why) = check_bucket(&bucket) {
                    return Err(field("bucket", &format!("{bucket:?}: {why}")));
                }
                let region = self.region.clone().ok_or_else(|| {
                    field(
                        "region",
                        "required with backend = \"s3\" (any value, e.g. us-east-1, for most S3-compatible servers)",
                    )
                })?;
                if region.is_empty() || !region.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
                    return Err(field("region", &format!("{region:?} is not a region name (like eu-west-1)")));
                }
                let prefix = self.prefix.clone().unwrap_or_default().trim_matches('/').to_string();
                if prefix.split('/').any(|p| p == ".." || p == ".") || prefix.contains("//") {
                    return Err(field("prefix", &format!("{prefix:?}: no `.`, `..` or empty parts")));
                }
                if let Some(f) = &self.credentials_file {
                    if !f.is_file() {
                        return Err(field("credentials_file", &format!("{}: no such file", f.display())));
                    }
                }
                Ok(BlobsConfig::S3(gpuci_aws::s3::S3Settings {
                    bucket,
                    prefix,
                    endpoint: self.endpoint.as_ref().map(|e| e.0.clone()),
                    region,
                    path_style: self.path_style.unwrap_or(false),
                    profile: self.profile.clone(),
                    credentials_file: self.credentials_file.clone(),
                }))
            }
        }
    }
}

/// `[blobs] endpoint`: an `http://` or `https://` URL whose host is not link-local.
///
/// Link-local addresses (169.254.0.0/16, fe80::/10) are where clouds serve instance metadata
/// and the instance's role credentials (169.254.169.254, fd00:ec2::254 aside). An endpoint
/// there sends the coordinator's signed S3 requests, and reads their answers as blobs, to
/// that service: refused. The host is read as the resolver would read it, so `2852039166`,
/// `0xa9fea9fe` and `169.254.43518` are 169.254.169.254 too. A *name* that resolves there is
/// not known until it is resolved: [`open`] checks the addresses at start.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub struct Endpoint(pub String);

impl TryFrom<String> for Endpoint {
    type Error = String;

    fn try_from(url: String) -> Result<Self, String> {
        let bad = |why: &str| format!("[blobs] endpoint {url:?}: {why}");
        let Some(rest) = url.strip_prefix("https://").or_else(|| url.strip_prefix("http://")) else {
            return Err(bad("expected an http:// or https:// URL"));
        };
        if rest.is_empty() || rest.contains(char::is_whitespace) {
            return Err(bad("expected an http:// or https:// URL"));
        }
        let Some((host, _)) = host_port(&url) else {
            return Err(bad("the URL names no host"));
        };
        if host_ip(&host).is_some_and(is_link_local) {
            return Err(bad(
                "a link-local address (169.254.0.0/16, fe80::/10) is where the cloud's instance metadata and \
                 role credentials are served, never an S3 endpoint",
            ));
        }
        Ok(Endpoint(url))
    }
}

/// The host (without brackets) and port of an `http://` or `https://` URL.
fn host_port(url: &str) -> Option<(String, u16)> {
    let (rest, default_port) = match url.strip_prefix("https://") {
        Some(r) => (r, 443),
        None => (url.strip_prefix("http://")?, 80),
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_and_port = authority.rsplit('@').next().unwrap_or_default();
    let (host, port) = match host_and_port.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']')?;
            (host, after.strip_prefix(':'))
        }
        None => match host_and_port.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host_and_port, None),
        },
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default_port,
    };
    (!host.is_empty()).then(|| (host.to_string(), port))
}

/// Refuses an endpoint whose name resolves to a link-local address (module docs of
/// [`Endpoint`]); one that does not resolve now is left to the bucket check to report.
async fn check_resolved(url: &str) -> anyhow::Result<()> {
    let Some((host, port)) = host_port(url) else { return Ok(()) };
    if let Ok(addrs) = tokio::net::lookup_host((host.as_str(), port)).await {
        for a in addrs {
            if is_link_local(a.ip()) {
                anyhow::bail!(
                    "[blobs] endpoint {url:?}: {host} resolves to {}, a link-local address (where the cloud's \
                     instance metadata and role credentials are served), never an S3 endpoint; the coordinator \
                     does not start",
                    a.ip()
                );
            }
        }
    }
    Ok(())
}

/// The address `host` names literally, read as the C resolver reads a numeric host
/// (`inet_aton`: one to four parts, each decimal, `0x` hex or `0` octal).
fn host_ip(host: &str) -> Option<std::net::IpAddr> {
    if let Ok(v6) = host.parse::<std::net::Ipv6Addr>() {
        return Some(v6.into());
    }
    let parts: Vec<u64> = host
        .trim_end_matches('.')
        .split('.')
        .map(|p| {
            let p = p.to_ascii_lowercase();
            if let Some(hex) = p.strip_prefix("0x") {
                u64::from_str_radix(hex, 16).ok()
            } else if p.len() > 1 && p.starts_with('0') {
                u64::from_str_radix(&p[1..], 8).ok()
            } else {
                p.parse().ok()
            }
        })
        .collect::<Option<_>>()?;
    let v = match parts.as_slice() {
        [a] => *a,
        [a, b] if *a < 256 => (a << 24) | b,
        [a, b, c] if *a < 256 && *b < 256 => (a << 24) | (b << 16) | c,
        [a, b, c, d] if [a, b, c, d].iter().all(|x| **x < 256) => (a << 24) | (b << 16) | (c << 8) | d,
        _ => return None,
    };
    u32::try_from(v).ok().map(|v| std::net::Ipv4Addr::from(v).into())
}

/// 169.254.0.0/16 or fe80::/10 (also as an IPv4-mapped IPv6 address).
fn is_link_local(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => v4.is_link_local(),
        std::net::IpAddr::V6(v6) => {
            (v6.segments()[0] & 0xffc0) == 0xfe80 || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_link_local())
        }
    }
}

/// S3's bucket naming rules (the general-purpose ones): 3 to 63 of `a-z 0-9 . -`, starting
/// and ending with a letter or digit.
fn check_bucket(name: &str) -> Result<(), &'static str> {
    if !(3..=63).contains(&name.len()) {
        return Err("a bucket name is 3 to 63 characters");
    }
    if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-') {
        return Err("a bucket name has only lowercase letters, digits, `.` and `-`");
    }
    let edge = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if !name.bytes().next().is_some_and(edge) || !name.bytes().last().is_some_and(edge) {
        return Err("a bucket name starts and ends with a letter or digit");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parse(text: &str) -> Result<BlobsConfig, String> {
        let f: BlobsFile = toml::from_str(text).map_err(|e| e.to_string())?;
        f.resolve()
    }

    #[test]
    fn the_default_is_the_local_directory_and_s3_needs_bucket_and_region() {
        assert_eq!(parse("").unwrap(), BlobsConfig::Local);
        assert_eq!(parse("backend = \"local\"").unwrap(), BlobsConfig::Local);
        let s3 = parse(
            "backend = \"s3\"\nbucket = \"ci-blobs\"\nprefix = \"/gpuci/prod/\"\nregion = \"eu-west-1\"\n\
             endpoint = \"http://127.0.0.1:9000\"\npath_style = true",
        )
        .unwrap();
        let BlobsConfig::S3(s) = s3 else { panic!("{s3:?}") };
        assert_eq!((s.bucket.as_str(), s.prefix.as_str(), s.path_style), ("ci-blobs", "gpuci/prod", true));
        for (text, names) in [
            ("backend = \"s3\"\nregion = \"x\"", "[blobs] bucket: required"),
            ("backend = \"s3\"\nbucket = \"ci-blobs\"", "[blobs] region: required"),
            ("backend = \"s3\"\nbucket = \"CI_Blobs\"\nregion = \"x\"", "[blobs] bucket: \"CI_Blobs\""),
            ("backend = \"s3\"\nbucket = \"ci\"\nregion = \"x\"", "[blobs] bucket"),
            ("backend = \"s3\"\nbucket = \"ci-b\"\nregion = \"x\"\nendpoint = \"minio:9000\"", "[blobs] endpoint"),
            ("backend = \"s3\"\nbucket = \"ci-b\"\nregion = \"x\"\nprefix = \"a/../b\"", "[blobs] prefix"),
            ("bucket = \"ci-blobs\"", "[blobs] bucket: only with backend = \"s3\""),
            ("backend = \"gcs\"", "unknown variant `gcs`"),
            ("bucket_name = \"x\"", "unknown field `bucket_name`"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(names), "{text:?}: {e}");
        }
    }

    /// Regression (outsider attack): an endpoint in the cloud's metadata range was accepted,
    /// so the coordinator's signed requests went to the instance metadata service. Refused
    /// as the config is read, naming the file, line, column and field; every spelling the
    /// resolver reads as such an address too.
    #[test]
    fn a_link_local_endpoint_is_refused_with_where_it_is() {
        let text = |endpoint: &str| {
            format!(
                "[blobs]\nbackend = \"s3\"\nbucket = \"ci-blobs\"\nregion = \"us-east-1\"\nendpoint = \"{endpoint}\"\n"
            )
        };
        for endpoint in [
            "http://169.254.169.254",
            "http://169.254.169.254:80/latest/meta-data",
            "https://user@169.254.0.1:9000",
            "http://[fe80::1]:9000",
            "http://[febf::1]",
            "http://[::ffff:169.254.169.254]",
            "http://2852039166",
            "http://0xa9fea9fe",
            "http://0251.0376.0251.0376",
            "http://169.254.43518",
        ] {
            let e = crate::github::config::parse("server.toml", &text(endpoint)).unwrap_err().to_string();
            assert!(e.starts_with("server.toml:5:12: "), "{endpoint}: {e}");
            assert!(e.contains("[blobs] endpoint") && e.contains("link-local"), "{endpoint}: {e}");
        }
        for fine in
            ["http://127.0.0.1:9000", "https://s3.eu-west-1.amazonaws.com", "http://[::1]:9000", "http://169.255.0.1"]
        {
            let f = crate::github::config::parse("server.toml", &text(fine)).unwrap();
            let BlobsConfig::S3(s) = f.blobs.unwrap().resolve().unwrap() else { panic!("{fine}: not s3") };
            assert_eq!(s.endpoint.as_deref(), Some(fine));
        }
    }

    #[tokio::test]
    async fn the_local_store_renames_into_place_touches_again_and_streams_back() {
        use tokio::io::AsyncReadExt;
        let dir = std::env::temp_dir().join(format!("gpuci-blobs-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = LocalBlobs::new(dir.clone());
        let staged = dir.join(".tmp-1");
        std::fs::write(&staged, b"abc").unwrap();
        assert!(store.store("x", &staged, 3).await.unwrap());
        assert!(!staged.exists());
        std::fs::write(&staged, b"abc").unwrap();
        assert!(!store.store("x", &staged, 3).await.unwrap(), "the same name again is not new");
        let mut blob = store.open("x").await.unwrap().unwrap();
        let mut got = Vec::new();
        blob.body.read_to_end(&mut got).await.unwrap();
        assert_eq!((blob.bytes, got.as_slice()), (3, &b"abc"[..]));
        assert!(store.open("y").await.unwrap().is_none());
        store.delete("x").await.unwrap();
        store.delete("x").await.unwrap();
        assert!(!store.exists("x").await.unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
