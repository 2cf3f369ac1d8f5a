//! The installation's identity key (`coordinator_identity` table, migrations sqlite 0021 /
//! postgres 0020): one row holding the public key and the secret sealed by the coordinator
//! (this crate never sees it open). The first coordinator to start makes it; every later one
//! (a standby taking over, a restart) reads the same row. The SQL of both backends lives
//! here; their `Store` impls only call it.

use crate::Result;
use sqlx::Row;

/// The stored identity: the public key (`ed25519:<hex>`) and the sealed secret.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredIdentity {
    pub public_key: String,
    pub sealed_secret: String,
}

impl std::fmt::Debug for StoredIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredIdentity").field("public_key", &self.public_key).finish_non_exhaustive()
    }
}

const SELECT: &str = "SELECT public_key, sealed_secret FROM coordinator_identity WHERE id = 1";

fn from_row<R: Row>(r: &R) -> Result<StoredIdentity>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'a> String: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    Ok(StoredIdentity { public_key: r.try_get("public_key")?, sealed_secret: r.try_get("sealed_secret")? })
}

pub(crate) mod sqlite {
    use super::*;
    use sqlx::SqlitePool;

    pub async fn get(pool: &SqlitePool) -> Result<Option<StoredIdentity>> {
        sqlx::query(SELECT).fetch_optional(pool).await?.map(|r| from_row(&r)).transpose()
    }

    pub async fn get_or_put(pool: &SqlitePool, new: &StoredIdentity, now_ms: i64) -> Result<StoredIdentity> {
        sqlx::query(
            "INSERT INTO coordinator_identity (id, public_key, sealed_secret, created_at_ms) VALUES (1, ?, ?, ?) \
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(&new.public_key)
        .bind(&new.sealed_secret)
        .bind(now_ms)
        .execute(pool)
        .await?;
        from_row(&sqlx::query(SELECT).fetch_one(pool).await?)
    }
}

pub(crate) mod postgres {
    use super::*;
    use sqlx::PgPool;

    pub async fn get(pool: &PgPool) -> Result<Option<StoredIdentity>> {
        sqlx::query(SELECT).fetch_optional(pool).await?.map(|r| from_row(&r)).transpose()
    }

    pub async fn get_or_put(pool: &PgPool, new: &StoredIdentity, now_ms: i64) -> Result<StoredIdentity> {
        // Read first: a coordinator that finds the row (a restart, a standby taking over)
        // writes nothing.
        if let Some(r) = sqlx::query(SELECT).fetch_optional(pool).await? {
            return from_row(&r);
        }
        sqlx::query(
            "INSERT INTO coordinator_identity (id, public_key, sealed_secret, created_at_ms) VALUES (1, $1, $2, $3) \
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(&new.public_key)
        .bind(&new.sealed_secret)
        .bind(now_ms)
        .execute(pool)
        .await?;
        from_row(&sqlx::query(SELECT).fetch_one(pool).await?)
    }
}
