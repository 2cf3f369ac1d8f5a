//! Tokens: the agent registration token and the API token live in the data dir (mode 0600),
//! generated on first start. Agent credentials are stored only as SHA-256 hashes. Every
//! comparison is constant-time. Token values never reach a log line: [`Secret`] prints `***`.

use sha2::{Digest, Sha256};
use std::fmt;
use std::io::Write;
use std::path::Path;
use subtle::ConstantTimeEq;

/// A secret string that never prints.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
    /// Constant-time equality with an offered value.
    pub fn matches(&self, offered: &str) -> bool {
        self.0.as_bytes().ct_eq(offered.as_bytes()).into()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// A fresh random token: 32 bytes, hex, with a prefix that says what it is.
pub fn generate(prefix: &str) -> Secret {
    let bytes: [u8; 32] = rand::random();
    Secret(format!("{prefix}_{}", hex::encode(bytes)))
}

pub fn hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Constant-time comparison of a presented credential with a stored hash.
pub fn verify_hash(offered: &str, stored_hash: &str) -> bool {
    hash(offered).as_bytes().ct_eq(stored_hash.as_bytes()).into()
}

/// Read a token file, or create it (mode 0600) with a new token.
pub fn load_or_create(path: &Path, prefix: &str) -> std::io::Result<Secret> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => return Ok(Secret(s.trim().to_string())),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let token = generate(prefix);
    write_private(path, token.expose())?;
    Ok(token)
}

/// Write a file readable by its owner only.
pub fn write_private(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    f.write_all(contents.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// `Authorization: Bearer <token>` → token.
pub fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers.get(axum::http::header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ").map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn secrets_never_print() {
        let s = generate("gpuci_api");
        assert_eq!(format!("{s:?}"), "Secret(***)");
        assert!(s.matches(s.expose()));
        assert!(!s.matches("gpuci_api_0"));
    }

    #[test]
    fn token_files_are_private_and_stable() {
        let dir = tempfile_dir();
        let p = dir.join("api-token");
        let a = load_or_create(&p, "gpuci_api").unwrap();
        let b = load_or_create(&p, "gpuci_api").unwrap();
        assert_eq!(a, b);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn hashes_verify() {
        let h = hash("abc");
        assert!(verify_hash("abc", &h));
        assert!(!verify_hash("abd", &h));
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("gpuci-auth-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
