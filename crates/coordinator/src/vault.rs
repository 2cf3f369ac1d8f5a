//! The key secret values are sealed with, and the start-up rules around it.
//!
//! The key lives in a file apart from the database: `<data-dir>/secrets.key` by default, or
//! `--secrets-key-file` (`GPUCI_SECRETS_KEY_FILE`), which coordinators sharing one Postgres
//! database must point at the same key. It is never written to the database, so a copy of
//! the database alone reveals no secret value.
//!
//! At start, in this order:
//! - key file present: it is read (raw 32 bytes or 64 hex digits) and tightened to 0600;
//! - key file absent and no sealed value in the database: a new key is created (0600) and
//!   logged; absent while sealed values exist: start-up fails and says which key is missing.
//!   A silent new key would make every stored secret unreadable;
//! - a sealed value under another key id: start-up fails, naming both keys (a wrong key file
//!   is found now, not by each job that needs a secret);
//! - values stored in plain text by an older gpuci are sealed in place, with a warning.
//!
//! `gpuci run`'s in-memory database uses a key that lives only in memory.

use crate::datadir;
use gpuci_store::{SealError, SecretsAtRest, SecretsKey, Store, StoreError};
use std::path::{Path, PathBuf};

/// Where the key comes from.
#[derive(Clone, Debug)]
pub enum KeySource {
    File(PathBuf),
    /// A fresh key for this process only (an in-memory database).
    Ephemeral,
}

/// Each message names its cause itself (`{error}`), never also as a `source`: a chain printer
/// (`{:#}`) would print it twice.
#[derive(Debug, thiserror::Error)]
pub enum VaultError {
    #[error(
        "secrets key file {path} is missing, but the database holds {count} sealed secret value(s) (key {key_ids}); \
         restore that key file (or point --secrets-key-file / GPUCI_SECRETS_KEY_FILE at it): a new key could not open them"
    )]
    KeyMissing { path: PathBuf, count: usize, key_ids: String },
    #[error("secrets key file {path}: {error}")]
    Unreadable { path: PathBuf, error: std::io::Error },
    #[error("secrets key file {path}: {error}")]
    Malformed { path: PathBuf, error: SealError },
    #[error("creating secrets key file {path}: {error}")]
    Create { path: PathBuf, error: std::io::Error },
    #[error(
        "secrets key file {path} holds key {key}, but secret value(s) {names} were sealed with key {other}; \
         pass the key file they were sealed with"
    )]
    WrongKey { path: PathBuf, key: String, other: String, names: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    DataDir(#[from] datadir::DataDirError),
}

/// The key to seal and open secret values with, after the checks above; plain-text rows are
/// sealed by the time it returns.
pub async fn unlock(store: &dyn Store, source: &KeySource) -> Result<SecretsKey, VaultError> {
    let path = match source {
        KeySource::Ephemeral => {
            let (key, _) = SecretsKey::generate();
            seal_plaintext(store, &key).await?;
            return Ok(key);
        }
        KeySource::File(p) => p,
    };
    let at_rest = SecretsAtRest::survey(store).await?;
    let key = match std::fs::read(path) {
        Ok(bytes) => {
            datadir::restrict(path)?;
            let key = SecretsKey::from_file_contents(&bytes)
                .map_err(|error| VaultError::Malformed { path: path.clone(), error })?;
            tracing::info!(path = %path.display(), key = key.id(), "secrets key loaded");
            key
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if !at_rest.sealed.is_empty() {
                return Err(VaultError::KeyMissing {
                    path: path.clone(),
                    count: at_rest.sealed.values().map(Vec::len).sum(),
                    key_ids: at_rest.sealed.keys().cloned().collect::<Vec<_>>().join(", "),
                });
            }
            create(path)?
        }
        Err(error) => return Err(VaultError::Unreadable { path: path.clone(), error }),
    };
    if let Some((other, names)) = at_rest.sealed.iter().find(|(id, _)| id.as_str() != key.id()) {
        return Err(VaultError::WrongKey {
            path: path.clone(),
            key: key.id().to_string(),
            other: other.clone(),
            names: names.join(", "),
        });
    }
    seal_plaintext(store, &key).await?;
    Ok(key)
}

fn create(path: &Path) -> Result<SecretsKey, VaultError> {
    let err = |error| VaultError::Create { path: path.to_path_buf(), error };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let (key, bytes) = SecretsKey::generate();
    match datadir::create_private(path, &bytes) {
        Ok(()) => {
            tracing::info!(path = %path.display(), key = key.id(), "created a new secrets key (keep it with backups of the database, apart from them)");
            Ok(key)
        }
        // Another coordinator sharing this key file created it a moment ago: use that one.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let bytes = std::fs::read(path).map_err(|error| VaultError::Unreadable { path: path.into(), error })?;
            SecretsKey::from_file_contents(&bytes).map_err(|error| VaultError::Malformed { path: path.into(), error })
        }
        Err(e) => Err(err(e)),
    }
}

async fn seal_plaintext(store: &dyn Store, key: &SecretsKey) -> Result<(), VaultError> {
    let sealed = gpuci_store::seal_plaintext_secrets(store, key).await?;
    if !sealed.is_empty() {
        tracing::warn!(count = sealed.len(), names = %sealed.join(", "), key = key.id(),
            "secret values were stored in plain text (an older gpuci); sealed them in place");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_store::SqliteStore;

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpuci-vault-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{e}"));
        d
    }

    #[tokio::test]
    async fn a_key_is_created_once_then_reused() {
        let dir = tempdir();
        let store = SqliteStore::in_memory().await.unwrap_or_else(|e| panic!("{e}"));
        let src = KeySource::File(dir.join("secrets.key"));
        let a = unlock(&store, &src).await.unwrap_or_else(|e| panic!("{e}"));
        store.set_secret("X", &a.seal("X", "v"), 1).await.unwrap_or_else(|e| panic!("{e}"));
        let b = unlock(&store, &src).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.id(), b.id());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("secrets.key")).map(|m| m.permissions().mode() & 0o777).unwrap_or(0);
        assert_eq!(mode, 0o600);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Regression (issue 9): a lost key file must not be replaced by a new key in silence.
    #[tokio::test]
    async fn a_missing_key_with_sealed_values_is_an_error_that_names_it() {
        let dir = tempdir();
        let store = SqliteStore::in_memory().await.unwrap_or_else(|e| panic!("{e}"));
        let path = dir.join("secrets.key");
        let key = unlock(&store, &KeySource::File(path.clone())).await.unwrap_or_else(|e| panic!("{e}"));
        store.set_secret("HF_TOKEN", &key.seal("HF_TOKEN", "v"), 1).await.unwrap_or_else(|e| panic!("{e}"));
        std::fs::remove_file(&path).unwrap_or_else(|e| panic!("{e}"));
        let err = unlock(&store, &KeySource::File(path.clone())).await.expect_err("must refuse");
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains(key.id()) && msg.contains("missing"),
            "{msg}"
        );
        assert!(!path.exists(), "no new key was written");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn another_key_file_is_refused() {
        let dir = tempdir();
        let store = SqliteStore::in_memory().await.unwrap_or_else(|e| panic!("{e}"));
        let (other, _) = SecretsKey::generate();
        store.set_secret("X", &other.seal("X", "v"), 1).await.unwrap_or_else(|e| panic!("{e}"));
        let (_, bytes) = SecretsKey::generate();
        std::fs::write(dir.join("k"), bytes).unwrap_or_else(|e| panic!("{e}"));
        let err = unlock(&store, &KeySource::File(dir.join("k"))).await.expect_err("must refuse");
        assert!(matches!(err, VaultError::WrongKey { other: ref o, .. } if o == other.id()), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Regression: printed through the CLI (`{:#}`), a key file error said its cause twice.
    #[tokio::test]
    async fn a_key_file_error_says_its_cause_once() {
        let dir = tempdir();
        let store = SqliteStore::in_memory().await.unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(dir.join("short.key"), b"not a key").unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir(dir.join("dir.key")).unwrap_or_else(|e| panic!("{e}"));
        for name in ["short.key", "dir.key"] {
            let err = unlock(&store, &KeySource::File(dir.join(name))).await.expect_err("must refuse");
            let cause = match &err {
                VaultError::Malformed { error, .. } => error.to_string(),
                VaultError::Unreadable { error, .. } => error.to_string(),
                other => panic!("{other}"),
            };
            let printed = format!("{:#}", anyhow::Error::new(err));
            assert_eq!(printed.matches(&cause).count(), 1, "{printed}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
