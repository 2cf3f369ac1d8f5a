//! Postgres backend: the audit log and API tokens. A token is stored as its hash only; creating and revoking one
//! writes its audit entry in the same transaction.
//! The `Store` impl in `postgres.rs` forwards to these methods; they hold this area's SQL and nothing else.

use super::*;

/// Append an audit entry inside the caller's transaction; returns its id.
pub(super) async fn insert_audit(conn: &mut sqlx::PgConnection, a: &NewAudit) -> Result<i64> {
    let row = sqlx::query(
        "INSERT INTO audit_log (at_ms, actor_kind, actor, credential, action, object, outcome) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
    )
    .bind(a.at_ms)
    .bind(&a.actor_kind)
    .bind(&a.actor)
    .bind(&a.credential)
    .bind(&a.action)
    .bind(&a.object)
    .bind(&a.outcome)
    .fetch_one(conn)
    .await?;
    Ok(row.get(0))
}

fn audit_from_row(r: &PgRow) -> AuditRecord {
    AuditRecord {
        id: r.get(0),
        entry: NewAudit {
            at_ms: r.get(1),
            actor_kind: r.get(2),
            actor: r.get(3),
            credential: r.get(4),
            action: r.get(5),
            object: r.get(6),
            outcome: r.get(7),
        },
    }
}

fn token_from_row(r: &PgRow) -> ApiTokenRecord {
    ApiTokenRecord {
        name: r.get(0),
        hash: r.get(1),
        created_at_ms: r.get(2),
        created_by: r.get(3),
        revoked_at_ms: r.get(4),
    }
}

impl PostgresStore {
    pub(super) async fn append_audit(&self, entry: &NewAudit) -> Result<AuditRecord> {
        let mut tx = self.pool.begin().await?;
        let id = insert_audit(&mut tx, entry).await?;
        tx.commit().await?;
        Ok(AuditRecord { id, entry: entry.clone() })
    }

    pub(super) async fn audit_log(&self, f: &AuditFilter) -> Result<Vec<AuditRecord>> {
        let rows = sqlx::query(
            "SELECT id, at_ms, actor_kind, actor, credential, action, object, outcome FROM audit_log \
             WHERE ($1::BIGINT IS NULL OR at_ms >= $1) \
             AND ($2::TEXT IS NULL OR action = $2 OR action LIKE $3 ESCAPE '\\') \
             AND ($4::TEXT IS NULL OR actor = $4) ORDER BY id DESC LIMIT $5",
        )
        .bind(f.since_ms)
        .bind(&f.action)
        .bind(f.action_prefix())
        .bind(&f.actor)
        .bind(f.limit())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(audit_from_row).collect())
    }

    pub(super) async fn create_api_token(&self, t: &ApiTokenRecord, audit: &NewAudit) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query(
            "INSERT INTO api_tokens (name, hash, created_at_ms, created_by, revoked_at_ms) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        )
        .bind(&t.name)
        .bind(&t.hash)
        .bind(t.created_at_ms)
        .bind(&t.created_by)
        .bind(t.revoked_at_ms)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(super) async fn revoke_api_token(&self, name: &str, now_ms: i64, audit: &NewAudit) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query("UPDATE api_tokens SET revoked_at_ms = $1 WHERE name = $2 AND revoked_at_ms IS NULL")
            .bind(now_ms)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        insert_audit(&mut tx, audit).await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(super) async fn api_tokens(&self) -> Result<Vec<ApiTokenRecord>> {
        let rows = sqlx::query(
            r#"SELECT name, hash, created_at_ms, created_by, revoked_at_ms FROM api_tokens ORDER BY name COLLATE "C""#,
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(token_from_row).collect())
    }

    pub(super) async fn live_api_token(&self, hash: &str) -> Result<Option<ApiTokenRecord>> {
        let row = sqlx::query(
            "SELECT name, hash, created_at_ms, created_by, revoked_at_ms FROM api_tokens \
             WHERE hash = $1 AND revoked_at_ms IS NULL",
        )
        .bind(hash)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(token_from_row))
    }
}
