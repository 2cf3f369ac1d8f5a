//! Secret values at rest: sealing of plain-text rows, what the store hands back, and no
//! plain text left in a SQLite file's free pages or WAL.

use crate::pg;
use gpuci_store::*;
use std::collections::BTreeMap;

/// Secret values at rest: rows written in plain text before sealing existed are sealed once,
/// keeping their update times; sealed rows are left alone; what the store hands back (the
/// stored column) holds no value, and opens only with the key and under its own name.
async fn sealing_suite(s: &dyn Store) {
    s.set_secret("OLD_PLAIN", "plain-value-from-before", 7).await.unwrap();
    let (key, _) = SecretsKey::generate();
    s.set_secret("NEW_SEALED", &key.seal("NEW_SEALED", "sealed-value"), 8).await.unwrap();
    let before = SecretsAtRest::survey(s).await.unwrap();
    assert_eq!(before.plaintext, vec!["OLD_PLAIN".to_string()]);
    assert_eq!(before.sealed, BTreeMap::from([(key.id().to_string(), vec!["NEW_SEALED".to_string()])]));

    assert_eq!(seal_plaintext_secrets(s, &key).await.unwrap(), vec!["OLD_PLAIN".to_string()]);
    assert_eq!(seal_plaintext_secrets(s, &key).await.unwrap(), Vec::<String>::new(), "sealing twice is a no-op");
    let after = SecretsAtRest::survey(s).await.unwrap();
    assert!(after.plaintext.is_empty(), "{after:?}");
    assert_eq!(s.secret_names().await.unwrap(), vec![("NEW_SEALED".into(), 8), ("OLD_PLAIN".into(), 7)]);

    let stored = s.secret_values(&["OLD_PLAIN".into(), "NEW_SEALED".into()]).await.unwrap();
    for (name, value) in [("OLD_PLAIN", "plain-value-from-before"), ("NEW_SEALED", "sealed-value")] {
        assert!(!stored[name].contains(value), "{name} is stored readable: {}", stored[name]);
        assert_eq!(key.open(name, &stored[name]).unwrap(), value);
    }
    // A plain-text row not named as a secret (the name the identity key is sealed under,
    // written by someone with the database) is not sealed: no sealing oracle.
    s.set_secret("gpuci:coordinator-identity", "00ff", 10).await.unwrap();
    s.set_secret("HF_TOKEN@repo:github.com/acme/x", "scoped-plain", 11).await.unwrap();
    assert_eq!(seal_plaintext_secrets(s, &key).await.unwrap(), vec!["HF_TOKEN@repo:github.com/acme/x".to_string()]);
    let left = s.secret_values(&["gpuci:coordinator-identity".into()]).await.unwrap();
    assert_eq!(left["gpuci:coordinator-identity"], "00ff");
    assert!(key.open("gpuci:coordinator-identity", &left["gpuci:coordinator-identity"]).is_err());
    s.delete_secret("gpuci:coordinator-identity").await.unwrap();
    s.delete_secret("HF_TOKEN@repo:github.com/acme/x").await.unwrap();
    // A row's value copied into another row does not open there.
    s.set_secret("OLD_PLAIN", &stored["NEW_SEALED"], 9).await.unwrap();
    let swapped = s.secret_values(&["OLD_PLAIN".into()]).await.unwrap();
    assert!(matches!(key.open("OLD_PLAIN", &swapped["OLD_PLAIN"]), Err(SealError::Tampered { .. })));
}

#[tokio::test]
async fn sqlite_store_passes_sealing_suite() {
    sealing_suite(&SqliteStore::in_memory().await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_sealing_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("sealing").await).await.unwrap();
    sealing_suite(&s).await;
}

/// Regression (issue 9): a plain-text secret sealed in place must not survive in the SQLite
/// file's free pages or WAL, and the files are private to their owner from the start.
#[tokio::test]
async fn sqlite_file_keeps_no_plaintext_after_sealing_and_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    let s = SqliteStore::open(&path).await.unwrap();
    s.set_secret("HF_TOKEN", "hf-plaintext-marker-91f3", 1).await.unwrap();
    let (key, _) = SecretsKey::generate();
    seal_plaintext_secrets(&s, &key).await.unwrap();
    for suffix in ["", "-wal", "-shm"] {
        let f = dir.path().join(format!("gpuci.db{suffix}"));
        let Ok(bytes) = std::fs::read(&f) else { continue };
        assert!(
            !bytes.windows(b"hf-plaintext-marker-91f3".len()).any(|w| w == b"hf-plaintext-marker-91f3"),
            "{} still holds the plain-text value",
            f.display()
        );
        let mode = std::fs::metadata(&f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}: mode {mode:o}", f.display());
    }
}
