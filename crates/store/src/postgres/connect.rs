//! Postgres backend: opening the store (pool, TLS, migrations), the sole-use claim and the
//! fence a leader's writes carry, and redacting a URL for logs.

use super::*;

impl PostgresStore {
    /// Connect to `url` (`postgres://user:password@host:port/database`) and run pending
    /// migrations. Migrations take Postgres's advisory lock, so coordinators starting together
    /// apply them once. The URL's `sslmode`, `sslrootcert`, `sslcert` and `sslkey` work as in
    /// libpq (TLS by rustls with ring; `sslrootcert` is trusted in addition to the system's
    /// roots); [`tls`](Self::tls) says what the connection got.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, false, i64::MAX).await
    }

    /// As [`connect_existing`](Self::connect_existing), as a coordinator whose newest
    /// migration is `newest` would: the rolling-upgrade tests' stand-in for the previous version.
    pub async fn connect_as_of(url: &str, newest: i64) -> Result<Self> {
        Self::connect_with(url, true, newest).await
    }

    /// As [`connect`](Self::connect), but refuses ([`StoreError::NotGpuci`], before anything
    /// is written) a database without gpuci's tables: for a coordinator whose data dir shows
    /// it ran before, an empty database means the wrong one, not a first start.
    pub async fn connect_existing(url: &str) -> Result<Self> {
        Self::connect_with(url, true, i64::MAX).await
    }

    async fn connect_with(url: &str, existing: bool, newest: i64) -> Result<Self> {
        let options =
            PgConnectOptions::from_str(url)?.application_name("gpuci").options([("synchronous_commit", "on")]);
        let pool = Self::pool(options.clone()).await?;
        let tls = DbTls::new(&options, Self::session_tls(&pool).await);
        if existing {
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT table_name::text FROM information_schema.tables \
                 WHERE table_schema = current_schema() ORDER BY table_name",
            )
            .fetch_all(&pool)
            .await?;
            if !tables.iter().any(|t| t == "jobs") {
                return Err(StoreError::NotGpuci(tables));
            }
        }
        // Under Postgres's advisory lock, as sqlx takes it for the migrations themselves, so a
        // coordinator of the next version migrating at the same moment is seen whole or not at all.
        let m = crate::compat::migrator(&MIGRATOR, newest);
        let mut lock = pool.acquire().await?;
        sqlx::query("SELECT pg_advisory_lock(7460656)").execute(&mut *lock).await?;
        let checked = async {
            let applied: Option<i64> = sqlx::query_scalar(
                "SELECT MAX(version) FROM _sqlx_migrations WHERE to_regclass('_sqlx_migrations') IS NOT NULL",
            )
            .fetch_one(&mut *lock)
            .await
            .ok()
            .flatten();
            let oldest: Option<i64> = if applied.is_some() {
                sqlx::query_scalar(
                    "SELECT oldest_reader FROM schema_compat WHERE id = 1 AND to_regclass('schema_compat') IS NOT NULL",
                )
                .fetch_optional(&mut *lock)
                .await
                .ok()
                .flatten()
            } else {
                None
            };
            crate::compat::decide(applied, crate::compat::newest(&m), oldest).map_err(StoreError::TooOld)
        }
        .await;
        let _ = sqlx::query("SELECT pg_advisory_unlock(7460656)").execute(&mut *lock).await;
        drop(lock);
        checked?;
        m.run(&pool).await?;
        Ok(Self { pool, options, tls })
    }

    /// The TLS version of a session of `pool`, as the server reports it; `None` for plain
    /// text, and when the view cannot be read (it can for one's own session since 9.5).
    async fn session_tls(pool: &PgPool) -> Option<String> {
        sqlx::query_scalar::<_, Option<String>>(
            "SELECT CASE WHEN ssl THEN version END FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        )
        .fetch_optional(pool)
        .await
        .ok()
        .flatten()
        .flatten()
    }

    /// Whether the connection is encrypted and the server verified, as found when the store
    /// was opened (every connection uses the same options).
    pub fn tls(&self) -> &DbTls {
        &self.tls
    }

    async fn pool(options: PgConnectOptions) -> Result<PgPool> {
        Ok(PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?)
    }

    /// This store with every write fenced by `epoch`, the one [`claim_sole_use`] returned: its
    /// connections carry the epoch, and the database refuses each of their writes once another
    /// coordinator has claimed the database since ([`StoreError::is_fenced`]; the trigger in
    /// `migrations/postgres/0013_fencing.sql`). The unfenced pool is closed.
    ///
    /// [`claim_sole_use`]: Self::claim_sole_use
    ///
    /// The fenced sessions are also ended by the server when they sit inside a transaction
    /// for [`IDLE_IN_TRANSACTION`] (the coordinator frozen or cut off mid-write): the rows they
    /// hold, the claim's among them, would otherwise keep a standby from taking over for as
    /// long as the freeze lasts (outsider attack: for ever under SIGSTOP, two hours of TCP
    /// keepalive when cut off). The transaction is rolled back; nothing half-written stays.
    pub async fn fence(self, epoch: i64) -> Result<Self> {
        let options = self.options.clone().options([
            ("gpuci.epoch", epoch.to_string()),
            ("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION.as_millis().to_string()),
        ]);
        let pool = Self::pool(options.clone()).await?;
        let tls = DbTls::new(&options, Self::session_tls(&pool).await);
        self.pool.close().await;
        Ok(Self { pool, options, tls })
    }

    /// Claim this database for one coordinator, as `holder` (its host and data dir) in
    /// `process` (this run). The store is safe under concurrent writers, but a coordinator
    /// keeps its agents' links in memory, and two on one database each declared the other's
    /// agents lost; until coordinators share agents, there is one per database. A claim is a
    /// row renewed every few seconds ([`renew_sole_use`](Self::renew_sole_use)); it passes to
    /// another holder only once it is older than `lease`, and at once to the same holder (the
    /// same coordinator restarted: its data dir lock shows the old run is gone). A row, not
    /// an advisory lock: that lived on one connection, and a Postgres restart or a dropped
    /// connection gave it up silently while the coordinator ran on (outsider attack).
    /// `Err(SoleUseHeld)`: another holds it.
    pub async fn claim_sole_use(
        &self,
        holder: &str,
        process: &str,
        lease: Duration,
    ) -> Result<std::result::Result<Claim, SoleUseHeld>> {
        self.claim(holder, process, lease, false).await
    }

    /// As [`claim_sole_use`](Self::claim_sole_use) for a standby: only a lapsed claim passes,
    /// even one of the same holder (a copy of the leader's data dir on another machine, a
    /// restored backup, a cloned VM: the data dir lock cannot tell a live leader there).
    pub async fn claim_as_standby(
        &self,
        holder: &str,
        process: &str,
        lease: Duration,
    ) -> Result<std::result::Result<Claim, SoleUseHeld>> {
        self.claim(holder, process, lease, true).await
    }

    async fn claim(
        &self,
        holder: &str,
        process: &str,
        lease: Duration,
        standby: bool,
    ) -> Result<std::result::Result<Claim, SoleUseHeld>> {
        // The claim waits for writes under way (they hold its row in share mode), but not for
        // ever: a leader frozen inside a transaction holds it until its session is ended
        // (`idle_in_transaction_session_timeout`, see `fence`); meanwhile this fails as
        // transient and the caller asks again. Its age is judged by the clock when the row is
        // finally updated (`clock_timestamp()`), not when this statement began to wait.
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET LOCAL lock_timeout = '1s'").execute(&mut *tx).await?;
        let claimed: Option<i64> = sqlx::query_scalar(
            "INSERT INTO coordinator_lease (id, holder, process, renewed_at, epoch) \
             VALUES (1, $1, $2, clock_timestamp(), 1) \
             ON CONFLICT (id) DO UPDATE SET holder = EXCLUDED.holder, process = EXCLUDED.process, \
                renewed_at = clock_timestamp(), epoch = coordinator_lease.epoch + 1 \
             WHERE (coordinator_lease.holder = EXCLUDED.holder AND NOT $4) \
                OR coordinator_lease.renewed_at < clock_timestamp() - make_interval(secs => $3) \
             RETURNING epoch",
        )
        .bind(holder)
        .bind(process)
        .bind(lease.as_secs_f64())
        .bind(standby)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        if let Some(epoch) = claimed {
            return Ok(Ok(Claim { epoch }));
        }
        let row = sqlx::query(
            "SELECT holder, process, EXTRACT(EPOCH FROM clock_timestamp() - renewed_at)::float8 AS age \
             FROM coordinator_lease WHERE id = 1",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Err(SoleUseHeld {
            holder: row.try_get("holder")?,
            process: row.try_get("process")?,
            renewed_secs_ago: row.try_get::<f64, _>("age")?.max(0.0),
        }))
    }

    /// Renew this process's claim. `false`: it is no longer this process's (it lapsed and
    /// another took it): the coordinator must stop.
    pub async fn renew_sole_use(&self, holder: &str, process: &str) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE coordinator_lease SET renewed_at = clock_timestamp() WHERE id = 1 AND holder = $1 AND process = $2",
        )
        .bind(holder)
        .bind(process)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// How long a leader's session may sit inside a transaction before the server ends it
/// ([`PostgresStore::fence`]): a takeover waits at most this long for a frozen leader.
pub const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

/// A claim made ([`PostgresStore::claim_sole_use`]): `epoch` counts the claims ever made on
/// the database, this one included; [`PostgresStore::fence`] makes the store's writes carry it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Claim {
    pub epoch: i64,
}

/// Who holds the database ([`PostgresStore::claim_sole_use`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SoleUseHeld {
    pub holder: String,
    pub process: String,
    pub renewed_secs_ago: f64,
}

/// `url` with its password replaced by `***`, for logs and error messages: the one in the
/// user info and a `password=` query parameter (libpq and sqlx take both).
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else { return url.to_string() };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let authority = match authority.rfind('@').and_then(|at| Some((at, authority[..at].find(':')?))) {
        Some((at, colon)) => format!("{}:***{}", &authority[..colon], &authority[at..]),
        None => authority.to_string(),
    };
    let tail = &rest[authority_end..];
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let params: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                    _ => p.to_string(),
                })
                .collect();
            format!("{path}?{}", params.join("&"))
        }
        None => tail.to_string(),
    };
    format!("{}{authority}{tail}", &url[..scheme_end])
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn redact_url_hides_only_the_password() {
        assert_eq!(redact_url("postgres://gpuci:s3cr%40t@db:5432/gpuci"), "postgres://gpuci:***@db:5432/gpuci");
        assert_eq!(redact_url("postgres://gpuci@db/gpuci"), "postgres://gpuci@db/gpuci");
        assert_eq!(redact_url("postgres://db/gpuci?user=a"), "postgres://db/gpuci?user=a");
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(
            redact_url("postgres://db/gpuci?sslmode=verify-full&password=s3cr3t&sslrootcert=/ca.pem"),
            "postgres://db/gpuci?sslmode=verify-full&password=***&sslrootcert=/ca.pem"
        );
        assert_eq!(redact_url("postgres://u:pw@db?password=pw2"), "postgres://u:***@db?password=***");
    }
}
