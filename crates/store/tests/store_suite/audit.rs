//! The audit log: entries written with the change they record, listed and filtered.

use crate::pg;
use gpuci_store::*;

fn audit(at_ms: i64, actor: &str, action: &str, object: &str) -> NewAudit {
    NewAudit {
        at_ms,
        actor_kind: "api-token".into(),
        actor: actor.into(),
        credential: Some("sha256:0123456789ab".into()),
        action: action.into(),
        object: object.into(),
        outcome: "ok".into(),
    }
}

/// The audit log (issue 27): secret changes, token changes and approvals are written with
/// their entry in one transaction; entries list newest first and filter by time, action (and
/// the actions under it) and actor.
async fn audit_suite(s: &dyn Store) {
    assert!(s.audit_log(&AuditFilter::default()).await.unwrap().is_empty());

    s.set_secret_audited("HF_TOKEN", "sealed-1", 10, &audit(10, "ci-bot", "secret.set", "HF_TOKEN (every pipeline)"))
        .await
        .unwrap();
    assert_eq!(s.secret_names().await.unwrap(), vec![("HF_TOKEN".to_string(), 10)]);
    // A delete of nothing deletes nothing and records nothing here (the caller records the
    // refusal if it wants one).
    assert!(!s.delete_secret_audited("NOPE", &audit(11, "ci-bot", "secret.rm", "NOPE")).await.unwrap());
    assert!(s.delete_secret_audited("HF_TOKEN", &audit(12, "admin", "secret.rm", "HF_TOKEN")).await.unwrap());
    assert!(s.secret_names().await.unwrap().is_empty());

    let own = s.append_audit(&audit(13, "admin", "secrets-key.rotate", "key k1")).await.unwrap();
    assert_eq!(own.entry.action, "secrets-key.rotate");

    // Tokens: by hash while live; a name is never used twice, revoked or not.
    let tok = ApiTokenRecord {
        name: "ci-bot".into(),
        hash: "ab".repeat(32),
        created_at_ms: 14,
        created_by: "admin".into(),
        revoked_at_ms: None,
    };
    assert!(s.create_api_token(&tok, &audit(14, "admin", "token.create", "token ci-bot")).await.unwrap());
    assert!(!s.create_api_token(&tok, &audit(14, "admin", "token.create", "token ci-bot")).await.unwrap());
    assert_eq!(s.live_api_token(&tok.hash).await.unwrap(), Some(tok.clone()));
    assert!(s.revoke_api_token("ci-bot", 15, &audit(15, "admin", "token.revoke", "token ci-bot")).await.unwrap());
    assert!(!s.revoke_api_token("ci-bot", 16, &audit(16, "admin", "token.revoke", "token ci-bot")).await.unwrap());
    assert_eq!(s.live_api_token(&tok.hash).await.unwrap(), None, "a revoked token opens nothing");
    let again = ApiTokenRecord { hash: "cd".repeat(32), ..tok.clone() };
    assert!(!s.create_api_token(&again, &audit(17, "admin", "token.create", "token ci-bot")).await.unwrap());
    assert_eq!(s.api_tokens().await.unwrap(), vec![ApiTokenRecord { revoked_at_ms: Some(15), ..tok }]);

    // An approval is on the record with the GitHub login that gave it.
    s.put_approval(&ApprovalRecord {
        repository: "octo/gpu".into(),
        pr: 7,
        head_sha: "abc".into(),
        approved_by: "maintainer-1".into(),
        approved_at_ms: 18,
    })
    .await
    .unwrap();

    let all = s.audit_log(&AuditFilter::default()).await.unwrap();
    let seen: Vec<(&str, &str)> = all.iter().map(|r| (r.entry.action.as_str(), r.entry.actor.as_str())).collect();
    assert_eq!(
        seen,
        [
            ("approval.grant", "maintainer-1"),
            ("token.revoke", "admin"),
            ("token.create", "admin"),
            ("secrets-key.rotate", "admin"),
            ("secret.rm", "admin"),
            ("secret.set", "ci-bot"),
        ],
        "newest first, only what happened"
    );
    assert!(all.windows(2).all(|w| w[0].id > w[1].id));
    assert_eq!(all[5].entry, audit(10, "ci-bot", "secret.set", "HF_TOKEN (every pipeline)"));
    assert_eq!(all[0].entry.actor_kind, "github");
    assert!(all[0].entry.object.contains("octo/gpu#7") && all[0].entry.object.contains("abc"), "{:?}", all[0]);

    let actions = |f: AuditFilter| async move {
        s.audit_log(&f).await.unwrap().into_iter().map(|r| r.entry.action).collect::<Vec<_>>()
    };
    assert_eq!(
        actions(AuditFilter { action: Some("secret".into()), ..Default::default() }).await,
        ["secret.rm", "secret.set"]
    );
    assert_eq!(actions(AuditFilter { action: Some("secret.rm".into()), ..Default::default() }).await, ["secret.rm"]);
    // `secret` is a whole segment: `secrets-key.rotate` is not under it, nor `%` a wildcard.
    assert_eq!(actions(AuditFilter { action: Some("secre".into()), ..Default::default() }).await, Vec::<String>::new());
    assert_eq!(actions(AuditFilter { action: Some("%".into()), ..Default::default() }).await, Vec::<String>::new());
    assert_eq!(actions(AuditFilter { actor: Some("ci-bot".into()), ..Default::default() }).await, ["secret.set"]);
    assert_eq!(
        actions(AuditFilter { since_ms: Some(15), ..Default::default() }).await,
        ["approval.grant", "token.revoke"]
    );
    assert_eq!(actions(AuditFilter { limit: Some(1), ..Default::default() }).await, ["approval.grant"]);
}

#[tokio::test]
async fn sqlite_store_passes_audit_suite() {
    let dir = tempfile::tempdir().unwrap();
    audit_suite(&SqliteStore::open(&dir.path().join("gpuci.db")).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_store_passes_audit_suite() {
    let Some(server) = pg::PgServer::start() else { return };
    let s = PostgresStore::connect(&server.create_database("audit").await).await.unwrap();
    audit_suite(&s).await;
}
