//! Secret values at rest: sealed with ChaCha20-Poly1305 under a key that is never stored in
//! the database, so a copy of the database (a backup, a stolen file, a Postgres dump) reveals
//! no secret value.
//!
//! A stored value reads `v1:<key-id>:<nonce>:<ciphertext>` (nonce and ciphertext base64
//! without padding). The nonce is random per value. The associated data binds the value to
//! its secret's name and to the key id, so a value copied into another row (`HF_TOKEN`'s into
//! `DEPLOY_KEY`) does not open. The key id (8 hex digits of a hash of the key) lets a later
//! key rotation tell which key sealed a row, and lets start-up refuse a key file that is not
//! the one the rows were sealed with instead of failing job by job.
//!
//! The [`Store`] methods move stored text only; sealing and opening happen in the
//! coordinator, which holds the key. Rows written before sealing existed hold plain text:
//! [`seal_plaintext_secrets`] rewrites them once.

use crate::{Store, StoreError};
use base64::engine::general_purpose::STANDARD_NO_PAD as B64;
use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// Bytes in a key.
pub const KEY_LEN: usize = 32;
const NONCE_LEN: usize = 12;
const VERSION: &str = "v1";

/// The key secret values are sealed with. Never printed.
#[derive(Clone)]
pub struct SecretsKey {
    id: String,
    cipher: ChaCha20Poly1305,
}

impl std::fmt::Debug for SecretsKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretsKey").field("id", &self.id).field("key", &"***").finish()
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    #[error("a secrets key must be {KEY_LEN} bytes, or {} hex digits; found {found} bytes", KEY_LEN * 2)]
    KeyLength { found: usize },
    #[error("secret {name:?}: the stored value is not sealed ({reason})")]
    NotSealed { name: String, reason: &'static str },
    #[error("secret {name:?} was sealed with key {sealed_with}, but the key given is {key}")]
    WrongKey { name: String, sealed_with: String, key: String },
    #[error("secret {name:?}: the stored value does not open with key {key} (altered, or copied from another secret)")]
    Tampered { name: String, key: String },
}

impl SecretsKey {
    /// A fresh random key.
    pub fn generate() -> (SecretsKey, [u8; KEY_LEN]) {
        let bytes: [u8; KEY_LEN] = rand::random();
        (SecretsKey::from_bytes(&bytes), bytes)
    }

    pub fn from_bytes(bytes: &[u8; KEY_LEN]) -> SecretsKey {
        let digest = Sha256::new().chain_update(b"gpuci secrets key id\0").chain_update(bytes).finalize();
        let id = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
        SecretsKey { id, cipher: ChaCha20Poly1305::new(Key::from_slice(bytes)) }
    }

    /// A key file's contents: the raw 32 bytes (`head -c 32 /dev/urandom`), or 64 hex digits
    /// with optional surrounding white space (`openssl rand -hex 32`).
    pub fn from_file_contents(contents: &[u8]) -> Result<SecretsKey, SealError> {
        if let Ok(bytes) = <[u8; KEY_LEN]>::try_from(contents) {
            return Ok(SecretsKey::from_bytes(&bytes));
        }
        let text = contents.trim_ascii();
        let hex_digit = |c: u8| (c as char).to_digit(16);
        if text.len() == KEY_LEN * 2 && text.iter().all(|c| hex_digit(*c).is_some()) {
            let mut bytes = [0u8; KEY_LEN];
            for (i, pair) in text.chunks(2).enumerate() {
                bytes[i] = (hex_digit(pair[0]).unwrap_or(0) * 16 + hex_digit(pair[1]).unwrap_or(0)) as u8;
            }
            return Ok(SecretsKey::from_bytes(&bytes));
        }
        Err(SealError::KeyLength { found: contents.len() })
    }

    /// Which key this is: 8 hex digits, safe to log.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The text to store for secret `name` holding `value`.
    pub fn seal(&self, name: &str, value: &str) -> String {
        let nonce: [u8; NONCE_LEN] = rand::random();
        let aad = associated_data(&self.id, name);
        let sealed = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: value.as_bytes(), aad: aad.as_bytes() })
            // Only fails for messages longer than 256 GiB.
            .expect("ChaCha20-Poly1305 seals any value below 256 GiB");
        format!("{VERSION}:{}:{}:{}", self.id, B64.encode(nonce), B64.encode(sealed))
    }

    /// The value of secret `name` from its stored text.
    pub fn open(&self, name: &str, stored: &str) -> Result<String, SealError> {
        let s = parse(stored).map_err(|reason| SealError::NotSealed { name: name.into(), reason })?;
        if s.key_id != self.id {
            return Err(SealError::WrongKey { name: name.into(), sealed_with: s.key_id.into(), key: self.id.clone() });
        }
        let aad = associated_data(&self.id, name);
        let tampered = || SealError::Tampered { name: name.into(), key: self.id.clone() };
        let plain = self
            .cipher
            .decrypt(Nonce::from_slice(&s.nonce), Payload { msg: &s.ciphertext, aad: aad.as_bytes() })
            .map_err(|_| tampered())?;
        String::from_utf8(plain).map_err(|_| tampered())
    }
}

/// What the associated data covers: the format version, the key and the secret's name (its
/// scope: secrets are global today; a scoped secret adds its scope here).
fn associated_data(key_id: &str, name: &str) -> String {
    format!("gpuci secret {VERSION}\0{key_id}\0global\0{name}")
}

struct Parsed<'a> {
    key_id: &'a str,
    nonce: [u8; NONCE_LEN],
    ciphertext: Vec<u8>,
}

fn parse(stored: &str) -> Result<Parsed<'_>, &'static str> {
    let mut parts = stored.splitn(4, ':');
    let (Some(VERSION), Some(key_id), Some(nonce), Some(ct)) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("no v1:<key-id>:<nonce>:<ciphertext> header");
    };
    if key_id.len() != 8 || !key_id.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err("bad key id");
    }
    let nonce = B64.decode(nonce).ok().and_then(|n| <[u8; NONCE_LEN]>::try_from(n).ok()).ok_or("bad nonce")?;
    let ciphertext = B64.decode(ct).map_err(|_| "bad ciphertext encoding")?;
    if ciphertext.len() < 16 {
        return Err("ciphertext shorter than its tag");
    }
    Ok(Parsed { key_id, nonce, ciphertext })
}

/// The key id a stored value was sealed with, or None for plain text (a row from before
/// sealing).
pub fn sealed_with(stored: &str) -> Option<&str> {
    parse(stored).ok().map(|p| p.key_id)
}

/// How the secret rows are stored, by name.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SecretsAtRest {
    /// Rows from before sealing.
    pub plaintext: Vec<String>,
    /// Sealed rows by the id of the key that sealed them.
    pub sealed: BTreeMap<String, Vec<String>>,
}

impl SecretsAtRest {
    pub async fn survey(store: &dyn Store) -> Result<SecretsAtRest, StoreError> {
        let names: Vec<String> = store.secret_names().await?.into_iter().map(|(n, _)| n).collect();
        let mut out = SecretsAtRest::default();
        for (name, stored) in store.secret_values(&names).await? {
            match sealed_with(&stored) {
                Some(id) => out.sealed.entry(id.to_string()).or_default().push(name),
                None => out.plaintext.push(name),
            }
        }
        Ok(out)
    }
}

/// Whether `row` is named as `gpuci secret set` names rows: an environment variable name,
/// then its scope after `@`. Names the coordinator seals its own values under (the identity
/// key's `gpuci:coordinator-identity`) never are.
fn is_user_secret_row(row: &str) -> bool {
    let name = row.split_once('@').map_or(row, |(n, _)| n);
    name.len() <= 128
        && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Seal every row that still holds plain text, keeping its update time. Returns the names
/// sealed. Idempotent; two coordinators doing it at once both write valid sealed values.
///
/// Only rows named as users' secrets are: a plain-text row under another name was not written
/// by any gpuci (an older one stored users' secrets only) but by someone writing the database,
/// and sealing it would make the coordinator a sealing oracle — a row named as the identity
/// key's sealed secret, sealed here, would become a key of the writer's choosing (outsider
/// finding). Such rows are left as they are and said loudly.
pub async fn seal_plaintext_secrets(store: &dyn Store, key: &SecretsKey) -> Result<Vec<String>, StoreError> {
    let rows = store.secret_names().await?;
    let names: Vec<String> = rows.iter().map(|(n, _)| n.clone()).collect();
    let values = store.secret_values(&names).await?;
    let mut sealed = Vec::new();
    for (name, updated_at_ms) in rows {
        let Some(stored) = values.get(&name) else { continue };
        if sealed_with(stored).is_none() {
            if !is_user_secret_row(&name) {
                tracing::error!(row = %name, "a plain-text row in the secrets table is not named as a secret; not sealed \
                    (no gpuci writes such a row: someone wrote the database directly); delete it");
                continue;
            }
            store.set_secret(&name, &key.seal(&name, stored), updated_at_ms).await?;
            sealed.push(name);
        }
    }
    if !sealed.is_empty() {
        store.purge_freed_space().await?;
    }
    Ok(sealed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_never_appear_in_the_stored_text() {
        let (k, _) = SecretsKey::generate();
        let s = k.seal("HF_TOKEN", "hf_abc:def");
        assert!(!s.contains("hf_abc"), "{s}");
        assert!(s.starts_with(&format!("v1:{}:", k.id())));
        assert_eq!(k.open("HF_TOKEN", &s).unwrap(), "hf_abc:def");
        // A random nonce per value: the same value seals differently each time.
        assert_ne!(s, k.seal("HF_TOKEN", "hf_abc:def"));
    }

    #[test]
    fn a_value_moved_to_another_name_or_altered_does_not_open() {
        let (k, _) = SecretsKey::generate();
        let s = k.seal("HF_TOKEN", "v");
        assert!(matches!(k.open("DEPLOY_KEY", &s), Err(SealError::Tampered { .. })));
        let mut bytes = s.into_bytes();
        let last = bytes.len() - 2;
        bytes[last] = if bytes[last] == b'A' { b'B' } else { b'A' };
        assert!(matches!(k.open("HF_TOKEN", &String::from_utf8(bytes).unwrap()), Err(SealError::Tampered { .. })));
    }

    #[test]
    fn another_key_is_named_not_tried() {
        let (a, _) = SecretsKey::generate();
        let (b, _) = SecretsKey::generate();
        let s = a.seal("X", "v");
        assert_eq!(sealed_with(&s), Some(a.id()));
        match b.open("X", &s) {
            Err(SealError::WrongKey { sealed_with, key, .. }) => {
                assert_eq!((sealed_with, key), (a.id().into(), b.id().into()))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn key_files_are_raw_bytes_or_hex() {
        let (k, bytes) = SecretsKey::generate();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(SecretsKey::from_file_contents(&bytes).unwrap().id(), k.id());
        assert_eq!(SecretsKey::from_file_contents(format!("{hex}\n").as_bytes()).unwrap().id(), k.id());
        assert!(matches!(SecretsKey::from_file_contents(b"short"), Err(SealError::KeyLength { found: 5 })));
        assert!(format!("{k:?}").contains("***"));
    }

    #[test]
    fn plain_text_is_not_taken_for_sealed() {
        for v in ["hf_token", "v1:abc", "v1:0123abcd:x:y", ""] {
            assert_eq!(sealed_with(v), None, "{v}");
        }
    }
}
