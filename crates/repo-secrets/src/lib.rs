//! gpuci-repo-secrets: secrets kept encrypted in a repository's pipeline file, so a
//! repository's maintainers manage their own secrets without the coordinator's admin token.
//!
//! `gpuci secret encrypt --repo octo/kernels [--ref refs/heads/main] CODECOV_TOKEN` encrypts a
//! value to the coordinator's public key and prints `CODECOV_TOKEN: "gpuci:v1:<key id>:<age>"`
//! for the step's `secrets:` map. The part after the key id is a standard age file (X25519
//! recipient), base64: `age --decrypt -i KEY` opens it. What is encrypted is a small JSON
//! document naming the secret, the repository and the ref pattern with the value, so the
//! binding is inside the authenticated ciphertext: pasted into another repository, another
//! ref's pipeline or under another name, it opens but does not [`Sealed::check`].
//!
//! The coordinator keeps its X25519 identities in a key ring directory (one `AGE-SECRET-KEY-…`
//! file per key, 0600, in a 0700 directory beside — never in — the database). The newest key
//! is the one `encrypt` uses; older ones still decrypt what was encrypted to them, so a key
//! rotates without re-encrypting every repository at once, and is retired by removing its file.
//!
//! What this crate must not do: decide who may have a secret (the coordinator does, with
//! `gpuci_core::secret_scope`), or log or print a value.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use age::secrecy::ExposeSecret;
use base64::Engine;
use gpuci_core::secret_scope::{JobSource, SecretScope};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Every ciphertext starts with this.
pub const PREFIX: &str = "gpuci:v1:";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("not a gpuci secret (expected gpuci:v1:<key id>:<base64>, from `gpuci secret encrypt`)")]
    Format,
    #[error("encrypted for key {0}, which this coordinator does not have (rotated out? encrypt it again with `gpuci secret encrypt`)")]
    UnknownKey(String),
    #[error("does not decrypt with key {0}: altered or truncated")]
    Decrypt(String),
    #[error("key ring {dir}: {source}")]
    Io { dir: PathBuf, source: io::Error },
    #[error("key ring {path}: not an age X25519 identity")]
    BadKey { path: PathBuf },
    #[error("{0}")]
    Recipient(String),
}

/// What is encrypted: the value and where it may be used.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sealed {
    pub name: String,
    pub repository: String,
    #[serde(rename = "ref", default, skip_serializing_if = "Option::is_none")]
    pub ref_pattern: Option<String>,
    value: String,
}

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealed")
            .field("name", &self.name)
            .field("repository", &self.repository)
            .field("ref", &self.ref_pattern)
            .field("value", &"***")
            .finish()
    }
}

impl Sealed {
    /// The scope it was encrypted for.
    pub fn scope(&self) -> SecretScope {
        match &self.ref_pattern {
            Some(p) => SecretScope::Ref { repository: self.repository.clone(), pattern: p.clone() },
            None => SecretScope::Repository(self.repository.clone()),
        }
    }

    /// The value, when `job` may have it under the name `as_name`; else why not.
    pub fn check(&self, as_name: &str, job: &JobSource) -> Result<&str, String> {
        if self.name != as_name {
            return Err(format!(
                "the encrypted value given as `{as_name}` was encrypted as `{}`; encrypt it again under this name",
                self.name
            ));
        }
        // `gpuci secret encrypt` refuses a NUL, but anyone with the public key can make a
        // ciphertext: the job would get a value cut short, and unmasked (outsider finding).
        if self.value.contains('\0') {
            return Err(format!("encrypted secret `{as_name}` holds a NUL byte, which no environment variable can"));
        }
        let scope = self.scope();
        match gpuci_core::secret_scope::choose(as_name, std::slice::from_ref(&scope), job) {
            Ok(_) => Ok(&self.value),
            Err(gpuci_core::secret_scope::Refusal::NoSecrets { .. }) => {
                Err(format!("encrypted secret `{as_name}` is not given to {}, which gets no secrets", job.description))
            }
            Err(_) => Err(format!(
                "encrypted secret `{as_name}` was encrypted for {scope}; this job is from {}",
                job.description
            )),
        }
    }
}

/// The key id of a recipient: 12 hex digits of its SHA-256.
pub fn key_id(recipient: &str) -> String {
    hex::encode(&Sha256::digest(recipient.as_bytes())[..6])
}

/// Encrypts `value` for `name` in `scope` (a repository, or a repository's refs) to
/// `recipient` (`age1…`, the coordinator's current public key).
pub fn encrypt(recipient: &str, name: &str, scope: &SecretScope, value: &str) -> Result<String, Error> {
    let to = age::x25519::Recipient::from_str(recipient)
        .map_err(|e| Error::Recipient(format!("{recipient:?} is not an age X25519 recipient: {e}")))?;
    let (repository, ref_pattern) = match scope {
        SecretScope::Repository(r) => (r.clone(), None),
        SecretScope::Ref { repository, pattern } => (repository.clone(), Some(pattern.clone())),
        SecretScope::Global | SecretScope::Environment { .. } | SecretScope::ApprovedForks(_) => {
            return Err(Error::Recipient(
                "an encrypted secret belongs to a repository (and a ref): give --repo owner/name".into(),
            ))
        }
    };
    let doc = Sealed { name: name.to_string(), repository, ref_pattern, value: value.to_string() };
    let plain = serde_json::to_vec(&doc).map_err(|e| Error::Recipient(e.to_string()))?;
    let cipher = age::encrypt(&to, &plain).map_err(|e| Error::Recipient(e.to_string()))?;
    let b64 = base64::engine::general_purpose::STANDARD.encode(cipher);
    Ok(format!("{PREFIX}{}:{b64}", key_id(recipient)))
}

/// Whether `text` has the shape of a ciphertext (for the pipeline parser's message).
pub fn looks_sealed(text: &str) -> bool {
    parts(text).is_some()
}

fn parts(text: &str) -> Option<(&str, &str)> {
    let (id, b64) = text.strip_prefix(PREFIX)?.split_once(':')?;
    (id.len() == 12 && id.bytes().all(|b| b.is_ascii_hexdigit()) && !b64.is_empty()).then_some((id, b64))
}

/// The coordinator's identities. The directory is the truth: a key whose file was removed no
/// longer decrypts (retiring a key needs no restart), and a key another coordinator sharing
/// the directory made is found when a ciphertext names it.
pub struct KeyRing {
    dir: PathBuf,
    /// Oldest first; the last is current.
    keys: Vec<Key>,
}

struct Key {
    id: String,
    identity: age::x25519::Identity,
    path: PathBuf,
}

fn sequence(p: &Path) -> u64 {
    p.file_name().and_then(|n| n.to_str()).and_then(|n| n.split('-').next()?.parse::<u64>().ok()).unwrap_or(0)
}

fn load_key(path: &Path, dir: &Path) -> Result<Key, Error> {
    use std::os::unix::fs::PermissionsExt;
    let io_err = |source| Error::Io { dir: dir.to_path_buf(), source };
    // Only the owner may read a key, whatever left it looser.
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(io_err)?;
    let text = fs::read_to_string(path).map_err(io_err)?;
    let identity =
        age::x25519::Identity::from_str(text.trim()).map_err(|_| Error::BadKey { path: path.to_path_buf() })?;
    Ok(Key { id: key_id(&identity.to_public().to_string()), identity, path: path.to_path_buf() })
}

impl KeyRing {
    /// Loads the key ring in `dir`, making the directory (0700) and a first key when there is
    /// none.
    pub fn open(dir: &Path) -> Result<KeyRing, Error> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let io_err = |source| Error::Io { dir: dir.to_path_buf(), source };
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io_err)?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io_err)?;
        let mut files: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(io_err)?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "key"))
            .collect();
        // Named `<sequence>-<key id>.key`: the sequence orders them.
        files.sort_by_key(|p| sequence(p));
        let keys = files.iter().map(|p| load_key(p, dir)).collect::<Result<Vec<_>, _>>()?;
        let mut ring = KeyRing { dir: dir.to_path_buf(), keys };
        if ring.keys.is_empty() {
            ring.rotate()?;
        }
        Ok(ring)
    }

    /// Adds a new current key; the old ones keep decrypting.
    pub fn rotate(&mut self) -> Result<String, Error> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let identity = age::x25519::Identity::generate();
        let recipient = identity.to_public().to_string();
        let id = key_id(&recipient);
        let next = self.keys.iter().map(|k| sequence(&k.path)).max().unwrap_or(0) + 1;
        let path = self.dir.join(format!("{next}-{id}.key"));
        let io_err = |source| Error::Io { dir: self.dir.clone(), source };
        let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(io_err)?;
        f.write_all(identity.to_string().expose_secret().as_bytes()).map_err(io_err)?;
        f.write_all(b"\n").map_err(io_err)?;
        f.sync_all().map_err(io_err)?;
        self.keys.push(Key { id: id.clone(), identity, path });
        Ok(id)
    }

    /// The current public key (`age1…`) and its id.
    pub fn current(&self) -> (String, String) {
        let k = self.keys.last().expect("a key ring always has a key");
        (k.identity.to_public().to_string(), k.id.clone())
    }

    /// Every key id whose file is still there, oldest first.
    pub fn ids(&self) -> Vec<String> {
        self.keys.iter().filter(|k| k.path.exists()).map(|k| k.id.clone()).collect()
    }

    /// Opens a ciphertext from a pipeline file.
    pub fn decrypt(&self, text: &str) -> Result<Sealed, Error> {
        let (id, b64) = parts(text).ok_or(Error::Format)?;
        // A key made since (by another coordinator sharing the directory) is read from its
        // file; a key whose file is gone is retired.
        let found;
        let key = match self.keys.iter().find(|k| k.id == id) {
            Some(k) if k.path.exists() => k,
            Some(_) => return Err(Error::UnknownKey(id.into())),
            None => {
                let suffix = format!("-{id}.key");
                let file = fs::read_dir(&self.dir)
                    .ok()
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path())
                    .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(&suffix)));
                found = file.and_then(|p| load_key(&p, &self.dir).ok()).filter(|k| k.id == id);
                found.as_ref().ok_or_else(|| Error::UnknownKey(id.into()))?
            }
        };
        let cipher = base64::engine::general_purpose::STANDARD.decode(b64).map_err(|_| Error::Format)?;
        let plain = age::decrypt(&key.identity, &cipher).map_err(|_| Error::Decrypt(id.into()))?;
        serde_json::from_slice(&plain).map_err(|_| Error::Decrypt(id.into()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report
    use super::*;

    fn job(repo: &str, git_ref: Option<&str>, may: bool) -> JobSource {
        JobSource {
            repository: Some(repo.into()),
            git_ref: git_ref.map(str::to_string),
            environment: None,
            may_have_secrets: may,
            approved_fork: false,
            description: format!("a push to {repo} {}", git_ref.unwrap_or("-")),
        }
    }

    #[test]
    fn a_value_opens_only_for_its_repository_ref_and_name() {
        let dir = tempfile::tempdir().unwrap();
        let ring = KeyRing::open(&dir.path().join("keys")).unwrap();
        let (recipient, _) = ring.current();
        let scope = SecretScope::Ref { repository: "octo/kernels".into(), pattern: "refs/heads/main".into() };
        let text = encrypt(&recipient, "CODECOV_TOKEN", &scope, "c0dec0v").unwrap();
        assert!(text.starts_with(PREFIX) && !text.contains("c0dec0v"), "{text}");
        let sealed = ring.decrypt(&text).unwrap();
        assert!(!format!("{sealed:?}").contains("c0dec0v"), "Debug shows the value");
        assert_eq!(sealed.check("CODECOV_TOKEN", &job("octo/kernels", Some("refs/heads/main"), true)), Ok("c0dec0v"));
        let e = sealed.check("CODECOV_TOKEN", &job("octo/kernels", Some("refs/heads/feature"), true)).unwrap_err();
        assert_eq!(e, "encrypted secret `CODECOV_TOKEN` was encrypted for octo/kernels refs/heads/main; this job is from a push to octo/kernels refs/heads/feature");
        assert!(sealed.check("CODECOV_TOKEN", &job("evil/kernels", Some("refs/heads/main"), true)).is_err());
        assert!(sealed
            .check("OTHER", &job("octo/kernels", Some("refs/heads/main"), true))
            .unwrap_err()
            .contains("encrypted as `CODECOV_TOKEN`"));
        assert!(sealed
            .check("CODECOV_TOKEN", &job("octo/kernels", Some("refs/heads/main"), false))
            .unwrap_err()
            .contains("gets no secrets"));
    }

    /// Outsider round 2: the CLI refuses a NUL, but anyone with the public key can make a
    /// ciphertext; the job got the value cut at the NUL (through a container's env file).
    #[test]
    fn a_value_with_a_nul_byte_made_by_hand_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ring = KeyRing::open(&dir.path().join("keys")).unwrap();
        let (recipient, _) = ring.current();
        let scope = SecretScope::Repository("octo/kernels".into());
        let text = encrypt(&recipient, "ENC1", &scope, "a\0b").unwrap();
        let sealed = ring.decrypt(&text).unwrap();
        let e = sealed.check("ENC1", &job("octo/kernels", Some("refs/heads/main"), true)).unwrap_err();
        assert!(e.contains("NUL"), "{e}");
    }

    #[test]
    fn the_ciphertext_is_a_standard_age_file_and_tampering_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let ring = KeyRing::open(dir.path()).unwrap();
        let (recipient, id) = ring.current();
        let text = encrypt(&recipient, "T", &SecretScope::Repository("a/b".into()), "v4lue").unwrap();
        let b64 = text.rsplit(':').next().unwrap();
        let bytes = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
        assert!(bytes.starts_with(b"age-encryption.org/v1\n"), "not an age file");
        // One byte changed in the payload.
        let mut bad = bytes.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        let bad = format!("{PREFIX}{id}:{}", base64::engine::general_purpose::STANDARD.encode(bad));
        assert!(matches!(ring.decrypt(&bad), Err(Error::Decrypt(_))));
        assert!(matches!(ring.decrypt("gpuci:v1:nothex:abc"), Err(Error::Format)));
        assert!(matches!(ring.decrypt("plain text"), Err(Error::Format)));
    }

    #[test]
    fn a_rotated_key_still_opens_what_was_encrypted_to_it_until_its_file_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mut ring = KeyRing::open(dir.path()).unwrap();
        let (old_recipient, old_id) = ring.current();
        let old = encrypt(&old_recipient, "T", &SecretScope::Repository("a/b".into()), "old").unwrap();
        let new_id = ring.rotate().unwrap();
        assert_ne!(new_id, old_id);
        assert_eq!(ring.current().1, new_id, "the new key is current");
        // Reloaded from disk: same keys, same order.
        let ring = KeyRing::open(dir.path()).unwrap();
        assert_eq!(ring.ids(), vec![old_id.clone(), new_id.clone()]);
        assert!(ring.decrypt(&old).is_ok(), "the old key still decrypts");
        for e in fs::read_dir(dir.path()).unwrap().flatten() {
            if e.file_name().to_string_lossy().contains(&old_id) {
                fs::remove_file(e.path()).unwrap();
            }
        }
        // The running ring stops using it at once (no restart), and stops listing it.
        assert!(matches!(ring.decrypt(&old), Err(Error::UnknownKey(id)) if id == old_id));
        assert_eq!(ring.ids(), vec![new_id.clone()]);
        let ring = KeyRing::open(dir.path()).unwrap();
        assert!(matches!(ring.decrypt(&old), Err(Error::UnknownKey(id)) if id == old_id));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(fs::metadata(dir.path()).unwrap().permissions().mode() & 0o777, 0o700);
        for e in fs::read_dir(dir.path()).unwrap().flatten() {
            assert_eq!(e.metadata().unwrap().permissions().mode() & 0o777, 0o600, "{:?}", e.path());
        }
    }
}

#[cfg(test)]
mod shared_dir_tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report
    use super::*;

    #[test]
    fn a_key_another_coordinator_made_in_the_shared_directory_decrypts() {
        let dir = tempfile::tempdir().unwrap();
        let a = KeyRing::open(dir.path()).unwrap();
        let mut b = KeyRing::open(dir.path()).unwrap();
        b.rotate().unwrap();
        let (recipient, _) = b.current();
        let text = encrypt(&recipient, "T", &SecretScope::Repository("a/b".into()), "v").unwrap();
        assert!(a.decrypt(&text).is_ok(), "the first ring did not find the second's new key");
    }

    #[test]
    fn a_key_file_left_readable_by_others_is_tightened() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        drop(KeyRing::open(dir.path()).unwrap());
        for e in fs::read_dir(dir.path()).unwrap().flatten() {
            fs::set_permissions(e.path(), fs::Permissions::from_mode(0o644)).unwrap();
        }
        drop(KeyRing::open(dir.path()).unwrap());
        for e in fs::read_dir(dir.path()).unwrap().flatten() {
            assert_eq!(e.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        }
    }
}
