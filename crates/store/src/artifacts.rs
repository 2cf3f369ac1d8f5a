//! Artifact rows (`artifacts` table, migrations sqlite 0012 / postgres 0009): which file of
//! which job is stored under which content hash. The SQL of both backends lives here; their
//! `Store` impls only call it. The bytes are the coordinator's business, never the store's.

use crate::Result;
use gpuci_protocol::JobId;
use sqlx::Row;

/// One stored artifact: a file of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArtifactRecord {
    pub job_id: JobId,
    /// Relative to the job's workspace; checked by `gpuci_core::artifacts::check_path`.
    pub path: String,
    pub size: u64,
    /// Lowercase hex sha256 of the bytes: where they are stored.
    pub sha256: String,
    /// The repository of the job's pipeline, for the per-repository cap.
    pub repository: Option<String>,
    /// Uploaded by an untrusted job (a pull request from a fork, ...): counted against the
    /// repository's untrusted budget, apart from its trusted jobs' (`gpuci_core::artifacts::admit`).
    pub untrusted: bool,
    pub created_at_ms: i64,
}

/// The coordinator's reading of one test report a job uploaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestReportRecord {
    pub job_id: JobId,
    pub path: String,
    /// `gpuci_core::test_report::TestReport` as JSON, when the file could be read.
    pub report_json: Option<String>,
    /// Why it could not be read.
    pub error: Option<String>,
}

const COLUMNS: &str = "job_id, path, size, sha256, repository, untrusted, created_at_ms";

fn from_row<R: Row>(r: &R) -> Result<ArtifactRecord>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'a> i64: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> String: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> Option<String>: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> bool: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    let size: i64 = r.try_get("size")?;
    Ok(ArtifactRecord {
        job_id: r.try_get("job_id")?,
        path: r.try_get("path")?,
        size: u64::try_from(size).unwrap_or(0),
        sha256: r.try_get("sha256")?,
        repository: r.try_get("repository")?,
        untrusted: r.try_get("untrusted")?,
        created_at_ms: r.try_get("created_at_ms")?,
    })
}

pub(crate) mod sqlite {
    use super::*;
    use sqlx::SqlitePool;

    pub async fn put(pool: &SqlitePool, a: &ArtifactRecord) -> Result<()> {
        sqlx::query(&format!("INSERT OR REPLACE INTO artifacts ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"))
            .bind(a.job_id)
            .bind(&a.path)
            .bind(i64::try_from(a.size).unwrap_or(i64::MAX))
            .bind(&a.sha256)
            .bind(&a.repository)
            .bind(a.untrusted)
            .bind(a.created_at_ms)
            .execute(pool)
            .await?;
        Ok(())
    }

    pub async fn of_job(pool: &SqlitePool, job: JobId) -> Result<Vec<ArtifactRecord>> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM artifacts WHERE job_id = ? ORDER BY path"))
            .bind(job)
            .fetch_all(pool)
            .await?;
        rows.iter().map(from_row).collect()
    }

    pub async fn all(pool: &SqlitePool) -> Result<Vec<ArtifactRecord>> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM artifacts ORDER BY created_at_ms, job_id, path"))
            .fetch_all(pool)
            .await?;
        rows.iter().map(from_row).collect()
    }

    pub async fn repository_bytes(pool: &SqlitePool, repository: Option<&str>, untrusted: bool) -> Result<u64> {
        let row = sqlx::query("SELECT COALESCE(SUM(size), 0) FROM artifacts WHERE repository IS ? AND untrusted = ?")
            .bind(repository)
            .bind(untrusted)
            .fetch_one(pool)
            .await?;
        Ok(u64::try_from(row.try_get::<i64, _>(0)?).unwrap_or(0))
    }

    pub async fn delete(pool: &SqlitePool, keys: &[(JobId, String)]) -> Result<()> {
        let mut tx = pool.begin().await?;
        for (job, path) in keys {
            for table in ["artifacts", "test_reports"] {
                sqlx::query(&format!("DELETE FROM {table} WHERE job_id = ? AND path = ?"))
                    .bind(job)
                    .bind(path)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }
}

pub(crate) mod sqlite_reports {
    use super::*;
    use sqlx::SqlitePool;

    pub async fn put(pool: &SqlitePool, r: &TestReportRecord) -> Result<()> {
        sqlx::query("INSERT OR REPLACE INTO test_reports (job_id, path, report_json, error) VALUES (?, ?, ?, ?)")
            .bind(r.job_id)
            .bind(&r.path)
            .bind(&r.report_json)
            .bind(&r.error)
            .execute(pool)
            .await?;
        Ok(())
    }

    pub async fn of_job(pool: &SqlitePool, job: JobId) -> Result<Vec<TestReportRecord>> {
        let rows =
            sqlx::query("SELECT job_id, path, report_json, error FROM test_reports WHERE job_id = ? ORDER BY path")
                .bind(job)
                .fetch_all(pool)
                .await?;
        rows.iter()
            .map(|r| {
                Ok(TestReportRecord {
                    job_id: r.try_get("job_id")?,
                    path: r.try_get("path")?,
                    report_json: r.try_get("report_json")?,
                    error: r.try_get("error")?,
                })
            })
            .collect()
    }
}

pub(crate) mod postgres_reports {
    use super::*;
    use sqlx::PgPool;

    pub async fn put(pool: &PgPool, r: &TestReportRecord) -> Result<()> {
        sqlx::query(
            "INSERT INTO test_reports (job_id, path, report_json, error) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (job_id, path) DO UPDATE SET report_json = EXCLUDED.report_json, error = EXCLUDED.error",
        )
        .bind(r.job_id)
        .bind(&r.path)
        .bind(&r.report_json)
        .bind(&r.error)
        .execute(pool)
        .await?;
        Ok(())
    }

    pub async fn of_job(pool: &PgPool, job: JobId) -> Result<Vec<TestReportRecord>> {
        let rows =
            sqlx::query("SELECT job_id, path, report_json, error FROM test_reports WHERE job_id = $1 ORDER BY path")
                .bind(job)
                .fetch_all(pool)
                .await?;
        rows.iter()
            .map(|r| {
                Ok(TestReportRecord {
                    job_id: r.try_get("job_id")?,
                    path: r.try_get("path")?,
                    report_json: r.try_get("report_json")?,
                    error: r.try_get("error")?,
                })
            })
            .collect()
    }
}

pub(crate) mod postgres {
    use super::*;
    use sqlx::PgPool;

    pub async fn put(pool: &PgPool, a: &ArtifactRecord) -> Result<()> {
        sqlx::query(&format!(
            "INSERT INTO artifacts ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (job_id, path) DO UPDATE \
             SET size = EXCLUDED.size, sha256 = EXCLUDED.sha256, repository = EXCLUDED.repository, \
             untrusted = EXCLUDED.untrusted, created_at_ms = EXCLUDED.created_at_ms"
        ))
        .bind(a.job_id)
        .bind(&a.path)
        .bind(i64::try_from(a.size).unwrap_or(i64::MAX))
        .bind(&a.sha256)
        .bind(&a.repository)
        .bind(a.untrusted)
        .bind(a.created_at_ms)
        .execute(pool)
        .await?;
        Ok(())
    }

    pub async fn of_job(pool: &PgPool, job: JobId) -> Result<Vec<ArtifactRecord>> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM artifacts WHERE job_id = $1 ORDER BY path"))
            .bind(job)
            .fetch_all(pool)
            .await?;
        rows.iter().map(from_row).collect()
    }

    pub async fn all(pool: &PgPool) -> Result<Vec<ArtifactRecord>> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM artifacts ORDER BY created_at_ms, job_id, path"))
            .fetch_all(pool)
            .await?;
        rows.iter().map(from_row).collect()
    }

    pub async fn repository_bytes(pool: &PgPool, repository: Option<&str>, untrusted: bool) -> Result<u64> {
        let row = sqlx::query(
            "SELECT COALESCE(SUM(size), 0)::BIGINT FROM artifacts \
             WHERE repository IS NOT DISTINCT FROM $1 AND untrusted = $2",
        )
        .bind(repository)
        .bind(untrusted)
        .fetch_one(pool)
        .await?;
        Ok(u64::try_from(row.try_get::<i64, _>(0)?).unwrap_or(0))
    }

    pub async fn delete(pool: &PgPool, keys: &[(JobId, String)]) -> Result<()> {
        let mut tx = pool.begin().await?;
        for (job, path) in keys {
            for table in ["artifacts", "test_reports"] {
                sqlx::query(&format!("DELETE FROM {table} WHERE job_id = $1 AND path = $2"))
                    .bind(job)
                    .bind(path)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }
}
