//! Tokens: the agent registration token and the API token live in the data dir (mode 0600),
//! generated on first start. Agent credentials are stored only as SHA-256 hashes. Every
//! comparison is constant-time. Token values never reach a log line: [`Secret`] prints `***`.

use sha2::{Digest, Sha256};
use std::fmt;
use std::io::Write;
use std::path::Path;
use subtle::ConstantTimeEq;

pub const AGENT_ID_HEADER: &str = "x-gpuci-agent-id";

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

/// Prefix of a machine's registration token (see [`machine_token`]).
pub const MACHINE_TOKEN_PREFIX: &str = "gpuci_mreg.";

/// The registration token of one fleet machine: `gpuci_mreg.<machine>.<HMAC-SHA256 of the
/// machine id under the coordinator's registration token>`. It registers one agent, for that
/// machine only, while the machine is being made (`api::register_agent`), so what lies on the
/// machine (an EC2 instance's user data can be read by anything on it that reaches the
/// metadata service, jobs included) is spent by the time a job could read it, and never opens
/// anything else. Derived, not stored: nothing to keep in step with the store.
pub fn machine_token(registration_token: &Secret, machine: &str) -> String {
    format!("{MACHINE_TOKEN_PREFIX}{machine}.{}", hex::encode(machine_mac(registration_token, machine)))
}

fn machine_mac(registration_token: &Secret, machine: &str) -> Vec<u8> {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(registration_token.expose().as_bytes())
        .expect("HMAC takes any key length");
    mac.update(b"gpuci machine registration\0");
    mac.update(machine.as_bytes());
    mac.finalize().into_bytes().to_vec()
}

/// The machine a presented machine registration token was made for, when it is genuine.
pub fn machine_of_token<'a>(registration_token: &Secret, offered: &'a str) -> Option<&'a str> {
    let rest = offered.strip_prefix(MACHINE_TOKEN_PREFIX)?;
    let (machine, mac) = rest.rsplit_once('.')?;
    let mac = hex::decode(mac).ok()?;
    let genuine: bool = machine_mac(registration_token, machine).ct_eq(&mac).into();
    (genuine && !machine.is_empty()).then_some(machine)
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

/// Sessions signed out before they expired: (signature, expiry in Unix seconds). In memory:
/// a restart forgets them (a new token ends every session for good).
#[derive(Default)]
pub struct RevokedSessions(std::sync::Mutex<std::collections::HashMap<String, i64>>);

impl RevokedSessions {
    pub(crate) fn add(&self, sig: &str, expires: i64) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, e| *e >= now);
        m.insert(sig.to_string(), expires);
    }
    pub(crate) fn contains(&self, sig: &str) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).contains_key(sig)
    }
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

#[cfg(test)]
mod machine_token_tests {
    use super::*;

    #[test]
    fn a_machine_token_names_its_machine_and_nothing_else_opens() {
        let key = Secret::new("gpuci_reg_0123");
        let t = machine_token(&key, "m-7");
        assert!(t.starts_with("gpuci_mreg.m-7."), "{t}");
        assert_eq!(machine_of_token(&key, &t), Some("m-7"));
        // Another machine's name on this machine's MAC, another key, a cut or changed MAC.
        assert_eq!(machine_of_token(&key, &t.replace("m-7", "m-8")), None);
        assert_eq!(machine_of_token(&Secret::new("gpuci_reg_other"), &t), None);
        assert_eq!(machine_of_token(&key, &t[..t.len() - 2]), None);
        let mut flipped = t.clone().into_bytes();
        let last = flipped.len() - 1;
        flipped[last] = if flipped[last] == b'0' { b'1' } else { b'0' };
        assert_eq!(machine_of_token(&key, std::str::from_utf8(&flipped).unwrap()), None);
        assert_eq!(machine_of_token(&key, key.expose()), None, "the registration token is not a machine token");
        assert_eq!(machine_of_token(&key, "gpuci_mreg..00"), None);
    }
}
