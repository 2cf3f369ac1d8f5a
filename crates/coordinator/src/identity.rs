//! This installation's identity key ([`gpuci_core::coordinator_identity`]): made once per
//! database by the first coordinator that starts, its secret sealed with the secrets key and
//! kept in the database, so every coordinator of that database (a standby, a restart, a
//! rolling upgrade) proves the same key. Agents and the CLI pin it and ask for a proof
//! (`GET /api/v1/identity?nonce=…`) before they send an address any credential.
//!
//! The secret is also kept in `<data-dir>/coordinator-key` (0600), so a database made anew
//! keeps the installation's key; the public key in `<data-dir>/coordinator-key.pub`, for an
//! operator to hand to agents (`--coordinator-key`) and for the CLI on this host.
//!
//! Must not: hand out or log the secret; answer without a well-formed nonce.

use gpuci_core::coordinator_identity::{SigningIdentity, SECRET_LEN};
use gpuci_store::{SecretsKey, Store, StoredIdentity};
use std::path::Path;

/// The name the secret is sealed under (binds the sealed value to this use).
const SEALED_AS: &str = "gpuci:coordinator-identity";
/// The file beside the data dir's tokens that holds the public key.
pub const PUBLIC_KEY_FILE: &str = "coordinator-key.pub";
/// The file that holds the secret (hex, 0600): the key stays the installation's when its
/// database is made anew (`--new-database`), as its tokens and secrets key do.
pub const SECRET_KEY_FILE: &str = "coordinator-key";

/// The installation's key. Kept in the data dir ([`SECRET_KEY_FILE`]) and, sealed with the
/// secrets key, in the database (so a standby that has the secrets key has the key too).
/// - the file and the database agree: that key;
/// - a file and no key in the database (a new database, an upgrade): the file's, recorded;
/// - no file and a key in the database (a standby, a data dir made anew): the database's,
///   written to the file;
/// - neither: a new key, in both;
/// - they disagree: refused (this data dir belongs to another installation than the database).
pub async fn load_or_create(store: &dyn Store, key: &SecretsKey, data_dir: &Path) -> anyhow::Result<SigningIdentity> {
    let file = data_dir.join(SECRET_KEY_FILE);
    let from_file = match std::fs::read_to_string(&file) {
        Ok(text) => {
            Some(parse_secret(&text).ok_or_else(|| anyhow::anyhow!("{}: not a coordinator key", file.display()))?)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(anyhow::anyhow!("reading {}: {e}", file.display())),
    };
    let fresh = from_file.clone().unwrap_or_else(|| SigningIdentity::from_secret(&rand::random::<[u8; SECRET_LEN]>()));
    let new = StoredIdentity {
        public_key: fresh.public_key(),
        sealed_secret: key.seal(SEALED_AS, &hex::encode(fresh.secret())),
    };
    let stored = store.coordinator_identity(&new, crate::brain::now_ms()).await?;
    let identity = match from_file {
        Some(mine) if mine.public_key() == stored.public_key => mine,
        Some(mine) => anyhow::bail!(
            "this data dir's coordinator identity key ({}, in {}) is not the database's ({}): the data dir belongs to another installation; use the leader's data dir files (docs/ha.md)",
            mine.public_key(),
            file.display(),
            stored.public_key
        ),
        None => {
            let opened = key.open(SEALED_AS, &stored.sealed_secret).map_err(|e| {
                anyhow::anyhow!(
                    "the coordinator identity key in the database does not open with this coordinator's secrets key \
                     (key {}): {e}; every coordinator of one database needs the same secrets key file",
                    key.id()
                )
            })?;
            let identity = parse_secret(&opened)
                .ok_or_else(|| anyhow::anyhow!("the coordinator identity key in the database is malformed"))?;
            if identity.public_key() != stored.public_key {
                anyhow::bail!(
                    "the coordinator identity key in the database does not match its public key {}",
                    stored.public_key
                );
            }
            crate::auth::write_private(&file, &format!("{}\n", hex::encode(identity.secret())))
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", file.display()))?;
            identity
        }
    };
    let public = data_dir.join(PUBLIC_KEY_FILE);
    if std::fs::read_to_string(&public).ok().as_deref().map(str::trim) != Some(identity.public_key().as_str()) {
        std::fs::write(&public, format!("{}\n", identity.public_key()))
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", public.display()))?;
    }
    tracing::info!(key = %identity.public_key(), file = %public.display(), "coordinator identity key (agents and the CLI pin it)");
    Ok(identity)
}

/// The installation's public key as a standby knows it without trusting the database's word:
/// its data dir's own secret ([`SECRET_KEY_FILE`]) if it has one, else the database's sealed
/// secret opened with this coordinator's secrets key and checked against the public key
/// beside it (someone who can write the database but lacks the secrets key cannot make a
/// sealed key that opens). `None` while no coordinator has made the key. Writes nothing.
pub async fn installation_key(store: &dyn Store, key_file: &Path, data_dir: &Path) -> anyhow::Result<Option<String>> {
    Ok(installation_identity(store, key_file, data_dir).await?.map(|i| i.public_key()))
}

/// The installation's key to sign with, found as [`installation_key`] finds its public half:
/// a standby proves it too (it holds the secret as any coordinator of the installation does),
/// so that a client given only the standby's address can send it a credential to pass on.
pub async fn installation_identity(
    store: &dyn Store,
    key_file: &Path,
    data_dir: &Path,
) -> anyhow::Result<Option<SigningIdentity>> {
    let file = data_dir.join(SECRET_KEY_FILE);
    match std::fs::read_to_string(&file) {
        Ok(text) => {
            let mine =
                parse_secret(&text).ok_or_else(|| anyhow::anyhow!("{}: not a coordinator key", file.display()))?;
            return Ok(Some(mine));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => anyhow::bail!("reading {}: {e}", file.display()),
    }
    let Some(stored) = store.stored_identity().await? else { return Ok(None) };
    let bytes =
        std::fs::read(key_file).map_err(|e| anyhow::anyhow!("reading the secrets key {}: {e}", key_file.display()))?;
    let key = SecretsKey::from_file_contents(&bytes)
        .map_err(|e| anyhow::anyhow!("the secrets key {}: {e}", key_file.display()))?;
    let opened = key.open(SEALED_AS, &stored.sealed_secret).map_err(|e| {
        anyhow::anyhow!(
            "the identity key in the database does not open with this coordinator's secrets key (key {}): {e}",
            key.id()
        )
    })?;
    let identity =
        parse_secret(&opened).ok_or_else(|| anyhow::anyhow!("the identity key in the database is malformed"))?;
    if identity.public_key() != stored.public_key {
        anyhow::bail!("the identity key in the database does not match its public key {}", stored.public_key);
    }
    Ok(Some(identity))
}

fn parse_secret(text: &str) -> Option<SigningIdentity> {
    let secret: [u8; SECRET_LEN] = hex::decode(text.trim()).ok()?.try_into().ok()?;
    Some(SigningIdentity::from_secret(&secret))
}

/// The local address a connection came in on: what an address literal in `Host` must be for
/// this coordinator to sign for it ([`gpuci_core::coordinator_identity::signs_for`]).
#[derive(Clone, Copy, Debug)]
pub struct LocalAddr(pub std::net::SocketAddr);

/// The state name the installation's coordinator id is kept under ([`coordinator_id`]).
const COORDINATOR_ID_STATE: &str = "coordinator_id";
/// The data dir's copy of it.
pub const COORDINATOR_ID_FILE: &str = "coordinator-id";

/// The installation's coordinator id: the tag (`gpuci.coordinator`) every fleet machine is
/// made with and listed by, so it must be the same on every coordinator of a database, or a
/// coordinator that takes over would not see the machines its predecessor made (orphaned,
/// and made again). Kept in the database, with a copy in `<data-dir>/coordinator-id`:
/// - the database has one: that one (a data dir that says another is told so loudly and
///   rewritten: machines tagged with its old id are not this installation's to manage);
/// - only the file (a single coordinator from before the id was kept in the database, or a
///   database made anew): the file's, recorded;
/// - neither: a new one, in both.
///
/// Called by the leader only (after its claim), so two coordinators never make one each.
pub async fn coordinator_id(store: &dyn Store, data_dir: &Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let file = data_dir.join(COORDINATOR_ID_FILE);
    let in_file = match std::fs::read_to_string(&file) {
        Ok(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Ok(_) => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(anyhow::Error::new(e).context(format!("reading {}", file.display()))),
    };
    let in_db: Option<String> = match store.coordinator_state(COORDINATOR_ID_STATE).await? {
        Some(json) => Some(serde_json::from_str(&json).context("the database's coordinator id is damaged")?),
        None => None,
    };
    let id = match (in_db, in_file) {
        (Some(db), Some(f)) if db == f => return Ok(db),
        (Some(db), Some(f)) => {
            tracing::warn!(
                database = %db,
                data_dir = %f,
                "this data dir's coordinator id differs from its database's: using the database's (the installation's);                  fleet machines tagged gpuci.coordinator={f} are not managed by this installation and must be removed by hand                  if any exist"
            );
            db
        }
        (Some(db), None) => db,
        (None, Some(f)) => {
            store
                .put_coordinator_state(COORDINATOR_ID_STATE, &serde_json::to_string(&f)?, crate::brain::now_ms())
                .await?;
            return Ok(f);
        }
        (None, None) => {
            let new = crate::auth::generate("gpuci_coord").expose().to_string();
            store
                .put_coordinator_state(COORDINATOR_ID_STATE, &serde_json::to_string(&new)?, crate::brain::now_ms())
                .await?;
            new
        }
    };
    crate::auth::write_private(&file, &id).with_context(|| format!("writing {}", file.display()))?;
    Ok(id)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a panic is the failure report
mod tests {
    use super::*;
    use gpuci_store::SqliteStore;

    fn fresh_dir(tag: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("gpuci-identity-{tag}-{}-{}", std::process::id(), rand::random::<u64>()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Every coordinator of one database proves one key: a restart, a standby with its own
    /// data dir and the same secrets key (the key comes from the database, then its file); a
    /// coordinator with another secrets key and no key file is refused at start. A database
    /// made anew in the same data dir keeps the key (its file), as agents pinned it (the CI
    /// failure of `a_result_held_for_an_earlier_registration_never_ends_a_job_of_a_new_database`:
    /// the pinned agent refused the coordinator after `--new-database`). A data dir of another
    /// installation on a database with a key is refused.
    #[tokio::test]
    async fn one_key_per_installation_across_standbys_and_a_new_database() {
        let dir = fresh_dir("a");
        let store = SqliteStore::open(&dir.join("gpuci.db")).await.unwrap();
        let (key, bytes) = SecretsKey::generate();
        let a = load_or_create(&store, &key, &dir).await.unwrap();
        assert_eq!(load_or_create(&store, &key, &dir).await.unwrap().public_key(), a.public_key(), "a restart");
        let written = std::fs::read_to_string(dir.join(PUBLIC_KEY_FILE)).unwrap();
        assert_eq!(written.trim(), a.public_key());
        // A standby: its own data dir, the same secrets key.
        let standby = fresh_dir("s");
        let b = load_or_create(&store, &SecretsKey::from_bytes(&bytes), &standby).await.unwrap();
        assert_eq!(b.public_key(), a.public_key());
        // Another secrets key, no key file: refused.
        let (other, _) = SecretsKey::generate();
        let stranger = fresh_dir("x");
        let e = load_or_create(&store, &other, &stranger).await.unwrap_err().to_string();
        assert!(e.contains("same secrets key"), "{e}");
        // The database made anew in the same data dir: the same key.
        let store2 = SqliteStore::open(&dir.join("gpuci-new.db")).await.unwrap();
        assert_eq!(load_or_create(&store2, &key, &dir).await.unwrap().public_key(), a.public_key());
        // Another installation's data dir on this database: refused.
        let other_dir = fresh_dir("o");
        let store3 = SqliteStore::open(&other_dir.join("gpuci.db")).await.unwrap();
        let c = load_or_create(&store3, &key, &other_dir).await.unwrap();
        assert_ne!(c.public_key(), a.public_key(), "another database, another key");
        let e = load_or_create(&store, &key, &other_dir).await.unwrap_err().to_string();
        assert!(e.contains("another installation"), "{e}");
        for d in [dir, standby, stranger, other_dir] {
            let _ = std::fs::remove_dir_all(&d);
        }
    }

    /// Every coordinator of a database tags fleet machines with one id, whatever its data dir
    /// held (a standby's own file included), so one that takes over lists its predecessor's
    /// machines; a single coordinator's existing id is kept.
    #[tokio::test]
    async fn every_coordinator_of_a_database_tags_machines_with_one_id() {
        let dbs = fresh_dir("ids");
        let store = gpuci_store::SqliteStore::open(&dbs.join("one.db")).await.unwrap();
        let (a, b, c) = (fresh_dir("a"), fresh_dir("b"), fresh_dir("c"));
        std::fs::write(a.as_path().join(COORDINATOR_ID_FILE), "gpuci_coord_fromafile\n").unwrap();
        std::fs::write(b.as_path().join(COORDINATOR_ID_FILE), "gpuci_coord_standbysown").unwrap();
        let first = coordinator_id(&store, a.as_path()).await.unwrap();
        assert_eq!(first, "gpuci_coord_fromafile", "an existing id is kept");
        assert_eq!(coordinator_id(&store, b.as_path()).await.unwrap(), first, "a standby's own file gives way");
        assert_eq!(std::fs::read_to_string(b.as_path().join(COORDINATOR_ID_FILE)).unwrap(), first);
        assert_eq!(coordinator_id(&store, c.as_path()).await.unwrap(), first, "a new data dir");
        let fresh = gpuci_store::SqliteStore::open(&dbs.join("two.db")).await.unwrap();
        let d = fresh_dir("d");
        let made = coordinator_id(&fresh, d.as_path()).await.unwrap();
        assert!(made.starts_with("gpuci_coord"), "{made}");
        assert_eq!(coordinator_id(&fresh, &fresh_dir("e")).await.unwrap(), made);
    }
}
