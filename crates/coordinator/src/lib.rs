//! gpuci-coordinator: the server. REST API and the agent channel (axum), the scheduler that
//! owns live state ([`brain`]), reapers for queue timeouts and lost agents, fleets, cron
//! schedules ([`schedules`]), the web dashboard ([`ui`]), `/metrics` ([`metrics`]) and the
//! OpenAPI document.
//!
//! It must not run jobs or touch GPUs itself (agents do), and must not hold state outside the
//! scheduler task and the store, but for what is only ever shown: running jobs' latest GPU
//! samples ([`live`]) and counters. Shutdown is handed in as a `CancellationToken`.

pub mod api;
pub mod artifacts;
pub mod artifacts_gc;
pub mod auth;
pub mod blobs;
pub mod blobs_watch;
pub mod brain;
mod channel;
mod convert;
pub mod datadir;
pub mod error;
mod fleet_inputs;
pub mod fleets;
pub mod github;
pub mod hub;
pub mod identity;
mod job_cost;
pub mod live;
pub mod metrics;
pub mod origin;
pub mod parsed;
mod proxy;
pub mod repos;
pub mod schedules;
mod serve;
mod standby;
pub mod state;
pub mod test_reports;
pub mod ui;
pub mod uploads;
pub mod uploads_gc;
pub mod vault;

use anyhow::Context;
use auth::Secret;
use axum::routing::{get, post};
use axum::Router;
use gpuci_store::{PostgresStore, SqliteStore, Store};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use api::{audit, pipeline_actions, secrets};
pub use brain::Timing;
pub use state::AppState;

/// Where state lives.
#[derive(Clone)]
pub enum Database {
    /// A SQLite file (the default: `<data-dir>/gpuci.db`).
    Sqlite(PathBuf),
    /// A Postgres URL (`postgres://user:password@host/db`), for coordinators sharing one
    /// database. It may hold a password: Debug and messages show it redacted.
    Postgres(String),
    /// Private, in memory: gone at exit (`gpuci run`).
    Memory,
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Database::Sqlite(p) => f.debug_tuple("Sqlite").field(p).finish(),
            Database::Postgres(url) => f.debug_tuple("Postgres").field(&gpuci_store::redact_url(url)).finish(),
            Database::Memory => f.write_str("Memory"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    /// Holds tokens, the secrets key and, by default, the database: 0700, files 0600.
    pub data_dir: PathBuf,
    /// The most connections one client address may hold open that are not an agent's
    /// channel (`serve::ConnLimits`): `None` computes it from the open-file limit, `Some(0)`
    /// sets none (behind a load balancer or reverse proxy, which is one address for all).
    pub max_connections_per_address: Option<usize>,
    pub database: Database,
    pub timing: Timing,
    /// Upload garbage collection: uploads unused for `retention` and needed by no job that
    /// may still run are deleted, as are the least recently used ones over `max_total`
    /// (`[uploads]` in the server config; [`uploads_gc`]).
    pub uploads_gc: uploads_gc::GcConfig,
    /// Artifacts' caps, retention and size cap (`[artifacts]`; [`artifacts_gc`]).
    pub artifacts: artifacts_gc::ArtifactsConfig,
    /// Where uploads' and artifacts' bytes live (`[blobs]`; [`blobs`]): the data dir by
    /// default, or an S3 bucket every coordinator of the database shares.
    pub blobs: blobs::BlobsConfig,
    /// The `[github]` section of the config file, with its secrets read.
    pub github: Option<Arc<github::GithubConfig>>,
    /// The key secret values are sealed with; default `<data-dir>/secrets.key`.
    pub secrets_key_file: Option<PathBuf>,
    /// The names (and addresses, behind NAT or a load balancer) agents and the CLI reach this
    /// coordinator by (`--public-name`): it proves its identity key for those and for the
    /// address a request comes in on. Empty: for any name, and for its own addresses only.
    pub public_names: Vec<String>,
    /// Files read at start that hold credentials (the config file, the GitHub App key, the
    /// webhook secret): hidden from jobs of an agent in the same process.
    pub credential_files: Vec<PathBuf>,
    /// An agent in this process keeps its data dir, and so the jobs' workspaces, inside the
    /// data dir (`gpuci up`): the data dir is 0711 so job users can pass through it.
    /// With a Postgres database another coordinator leads: wait as its standby and take over
    /// when its claim lapses, instead of refusing to start.
    pub standby: bool,
    pub agent_inside: bool,
    /// The most log this coordinator stores per job (bytes of text, a newline counted as one),
    /// whatever an agent sends: agents cut a job's log at their own cap; this one is defence in
    /// depth against an agent that does not.
    pub max_log_bytes: u64,
    /// The `[[fleet]]`s of the config file: machines created on demand ([`fleets`]).
    pub fleets: Vec<gpuci_core::fleet::FleetSpec>,
    /// The `[[budget]]`s of repositories.
    pub budgets: Vec<gpuci_core::fleet::RepoBudget>,
    /// How often the fleets' reconcile loop runs.
    pub fleet_interval: std::time::Duration,
    /// Repositories whose jobs and logs the dashboard shows without sign-in (`[dashboard]`),
    /// as configured: `owner/name` (on the GitHub host) or `host/path`; read with
    /// [`Config::github_host`] at start, where one that names no repository is refused.
    pub public_repositories: Vec<String>,
    /// `[[concurrency.shared]]`: concurrency groups shared between repositories (every other
    /// group is its repository's and trust class's own).
    pub concurrency_shared: Vec<gpuci_core::concurrency::SharedGroup>,
    /// Start a new, empty SQLite database although the data dir was used before (its
    /// database file is missing or empty). Without it that is refused
    /// ([`datadir::check_database`]); with it, a database that holds data is still never replaced.
    pub new_database: bool,
    /// The `[[schedule]]`s of the config file: pipelines submitted on a cron schedule ([`schedules`]).
    pub schedules: Vec<gpuci_core::schedule_config::ScheduleSpec>,
}

impl Config {
    /// The GitHub host repositories named `owner/name` are on: GitHub Enterprise's when
    /// `[github] api_url` names one, `github.com` otherwise.
    pub fn github_host(&self) -> String {
        gpuci_core::repo::github_host_of_api_url(self.github.as_ref().map(|g| g.api_url.as_str()))
    }

    pub fn secrets_key_source(&self) -> vault::KeySource {
        match (&self.database, &self.secrets_key_file) {
            (_, Some(p)) => vault::KeySource::File(p.clone()),
            (Database::Memory, None) => vault::KeySource::Ephemeral,
            _ => vault::KeySource::File(self.data_dir.join("secrets.key")),
        }
    }

    /// Every path on this host that holds this coordinator's credentials or state: what a
    /// job on the same host must never see (an agent in the same process hides them all).
    pub fn private_paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.data_dir.clone()];
        if let Database::Sqlite(db) = &self.database {
            paths.push(db.clone());
        }
        if let vault::KeySource::File(k) = self.secrets_key_source() {
            paths.push(k);
        }
        paths.extend(self.credential_files.iter().cloned());
        // What lies in the data dir is hidden with it (a separate cover inside the covered
        // dir would show up there as an empty /dev/null).
        let data_dir = self.data_dir.clone();
        paths.retain(|p| p == &data_dir || !p.starts_with(&data_dir));
        paths
    }

    pub fn new(listen: SocketAddr, data_dir: PathBuf) -> Self {
        let database = Database::Sqlite(data_dir.join("gpuci.db"));
        Config {
            listen,
            data_dir,
            max_connections_per_address: None,
            database,
            timing: Timing::default(),
            uploads_gc: uploads_gc::GcConfig::default(),
            artifacts: artifacts_gc::ArtifactsConfig::default(),
            blobs: blobs::BlobsConfig::default(),
            github: None,
            secrets_key_file: None,
            public_names: Vec::new(),
            credential_files: Vec::new(),
            agent_inside: false,
            standby: false,
            max_log_bytes: DEFAULT_MAX_LOG_BYTES,
            fleets: Vec::new(),
            budgets: Vec::new(),
            fleet_interval: std::time::Duration::from_secs(5),
            public_repositories: Vec::new(),
            concurrency_shared: Vec::new(),
            new_database: false,
            schedules: Vec::new(),
        }
    }
}

/// Default per-job log cap: the agents' default (100 MiB) and room for gpuci's own lines.
/// The data dir's key ring for secrets encrypted in pipeline files (`gpuci secret encrypt`):
/// one file per key, 0600, in a 0700 directory. Coordinators sharing a database need the same.
pub const REPO_SECRETS_KEYS: &str = "repo-secrets-keys";

pub const DEFAULT_MAX_LOG_BYTES: u64 = 101 * 1024 * 1024;

/// A started coordinator.
pub struct Running {
    pub addr: SocketAddr,
    pub url: String,
    pub api_token: Secret,
    pub registration_token: Secret,
    pub task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

pub fn router(st: AppState) -> Router {
    let webhook_limit = axum::extract::DefaultBodyLimit::max(api::webhook::MAX_PAYLOAD_BYTES);
    let authed = Router::new()
        .route("/api/v1/pipelines", post(api::submit_pipeline))
        .route("/api/v1/pipelines/{id}", get(api::get_pipeline))
        .route("/api/v1/pipelines/{id}/watch", get(api::watch_pipeline))
        .route("/api/v1/pipelines/{id}/retry-failed", post(pipeline_actions::retry_failed))
        .route("/api/v1/pipelines/{id}/cancel", post(pipeline_actions::cancel_pipeline))
        .route("/api/v1/jobs", get(api::list_jobs))
        .route("/api/v1/jobs/{id}", get(api::get_job))
        .route("/api/v1/jobs/{id}/cancel", post(api::cancel_job))
        .route("/api/v1/agents", get(api::list_agents))
        .route("/api/v1/fleets", get(api::list_fleets))
        .route("/api/v1/cost", get(api::cost_report))
        .route("/api/v1/github/jobs", get(api::github::list_github_jobs))
        .route("/api/v1/github/status", get(api::github::github_status))
        .route("/api/v1/gpus/{uuid}/release", post(api::release_gpu))
        .route("/api/v1/secrets", get(secrets::list_secrets))
        .route("/api/v1/secrets-key", get(secrets::public_key).post(secrets::rotate_key))
        .route("/api/v1/uploads", post(api::uploads::create_upload))
        .route("/api/v1/secrets/{name}", axum::routing::put(secrets::set_secret).delete(secrets::delete_secret))
        .route("/api/v1/schedules", get(api::schedules::list_schedules))
        .route("/api/v1/schedules/{name}/run", post(api::schedules::run_schedule))
        .route("/api/v1/audit", get(audit::list_audit))
        .route("/api/v1/tokens", get(audit::list_tokens).post(audit::create_token))
        .route("/api/v1/tokens/{name}", axum::routing::delete(audit::revoke_token))
        .route_layer(axum::middleware::from_fn_with_state(st.clone(), api::require_api_token));
    // The raw log follows the job page's read rules (a dashboard session reads it too).
    let logs = Router::new()
        .route("/api/v1/jobs/{id}/logs", get(api::job_logs))
        .route("/api/v1/jobs/{id}/artifacts", get(api::artifacts::list))
        .route("/api/v1/jobs/{id}/test-report", get(api::artifacts::job_report))
        .route("/api/v1/jobs/{id}/artifact", get(api::artifacts::download))
        .route_layer(axum::middleware::from_fn_with_state(st.clone(), ui::log_access));
    Router::new()
        .merge(authed)
        .merge(logs)
        .route("/api/v1/agents/register", post(api::register_agent))
        .route("/api/v1/agents/connect", get(channel::connect))
        .route("/api/v1/uploads/{id}", get(api::uploads::get_upload))
        // Agents, with their credential (`artifacts`).
        .route("/api/v1/jobs/{id}/artifact-upload", axum::routing::put(api::artifacts::upload))
        .route("/api/v1/jobs/{id}/steps", post(api::dynamic_steps::add_steps))
        .route("/api/v1/jobs/{id}/artifact-inputs", get(api::artifacts::inputs))
        .route("/api/v1/jobs/{id}/artifact-inputs/{sha256}", get(api::artifacts::input_blob))
        .route("/api/v1/openapi.json", get(openapi_json))
        .route("/api/v1/github/webhook", post(api::webhook::receive).layer(webhook_limit))
        .route("/healthz", get(api::server_info))
        .route("/readyz", get(api::ready))
        .route("/api/v1/identity", get(api::identity::prove))
        .route("/metrics", get(api::metrics::scrape))
        .merge(ui::router())
        .fallback(|| async {
            api::ApiError::new(axum::http::StatusCode::NOT_FOUND, "no such endpoint; see /api/v1/openapi.json")
        })
        .with_state(st)
}

/// The OpenAPI document of every endpoint.
pub fn openapi() -> utoipa::openapi::OpenApi {
    use utoipa::OpenApi;
    let mut doc = api::ApiDoc::openapi();
    doc.merge(secrets::SecretsDoc::openapi());
    doc.merge(api::identity::IdentityDoc::openapi());
    doc.merge(api::artifacts::ArtifactsDoc::openapi());
    doc.merge(api::dynamic_steps::DynamicStepsDoc::openapi());
    doc.merge(api::webhook::WebhookDoc::openapi());
    doc
}

async fn openapi_json() -> axum::Json<utoipa::openapi::OpenApi> {
    axum::Json(openapi())
}

/// Open the store, load state, bind the listener and start serving. Returns once the server
/// accepts connections.
pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<Running> {
    let limits = connection_limits(config.max_connections_per_address);
    if config.standby {
        // A standby that takes over from a frozen leader counts its agents' silence from then,
        // while they may still wait on the frozen one (outsider attack: `--heartbeat 10s` with
        // the default `--lost-after 30s` ended 12 running jobs `lost` that then ran to the end).
        let least = gpuci_protocol::least_lost_after_for_takeover(config.timing.heartbeat_interval);
        anyhow::ensure!(
            config.timing.lost_after >= least,
            "--lost-after {}s is too short for a standby with --heartbeat {}s: an agent still attached to a frozen \
             leader leaves it only after {}s of silence, and this coordinator would call it lost before it comes; \
             use --lost-after {}s or more (or a shorter --heartbeat)",
            config.timing.lost_after.as_secs_f64(),
            config.timing.heartbeat_interval.as_secs_f64(),
            (gpuci_protocol::agent_silence_limit(config.timing.heartbeat_interval) + config.timing.heartbeat_interval)
                .as_secs_f64(),
            least.as_secs_f64().ceil(),
        );
    }
    datadir::prepare(&config.data_dir, config.agent_inside)?;
    // One coordinator per data dir (and, below, per Postgres database), held for its life.
    let data_dir_lock = datadir::lock(&config.data_dir)?;
    // A Postgres database's claim, renewed while this coordinator runs.
    let mut renewal: Option<tokio::task::JoinHandle<anyhow::Error>> = None;
    // A standby answers on its address while it waits (`/readyz` 503), and leads on that socket.
    let mut standing_by: Option<standby::StandingBy> = None;
    // The claim's epoch, once this coordinator leads a Postgres database.
    let mut led_epoch: Option<i64> = None;
    // Whether this coordinator may act as the database's leader now: false while its claim
    // could not be renewed for longer than it lasts (it may have passed to a standby).
    let (leading_tx, leading) = tokio::sync::watch::channel(true);
    let mut claim_renewed: Option<Arc<state::ClaimClock>> = None;
    let mut must_be_gpuci = false;
    if let Database::Sqlite(db) = &config.database {
        // Before anything new is written: the tokens made below would hide that this dir
        // was used before.
        must_be_gpuci = datadir::check_database(&config.data_dir, db, config.new_database)?;
        // The default lies in the data dir (already done); a database elsewhere gets the same.
        for suffix in ["", "-wal", "-shm"] {
            let mut p = db.clone().into_os_string();
            p.push(suffix);
            datadir::restrict(std::path::Path::new(&p))?;
        }
    }
    // A bucket this coordinator cannot reach is refused now, before it leads or waits to.
    let (upload_blobs, artifact_blobs) = blobs::open(&config.blobs, &config.data_dir).await?;
    let store: Arc<dyn Store> = match &config.database {
        Database::Sqlite(p) => {
            match if must_be_gpuci { SqliteStore::open_existing(p).await } else { SqliteStore::open(p).await } {
                Ok(s) => Arc::new(s),
                Err(e @ gpuci_store::StoreError::NotGpuci(_)) => anyhow::bail!(
                    "database {}: {e}, but this data dir was used before (found {}): starting would make it a new, \
                 empty gpuci database. Restore the database from a backup, or move the file away and start with \
                 --new-database to begin an empty one",
                    p.display(),
                    datadir::signs_of_use(&config.data_dir).join(", ")
                ),
                Err(e) if e.is_damaged() => anyhow::bail!(
                    "opening database {}: {e}: the file is damaged or is not a gpuci database; restore it from a \
                 backup, or move it (and any {}-wal beside it) away and start with --new-database to begin an \
                 empty one",
                    p.display(),
                    p.display()
                ),
                Err(e) => return Err(e).with_context(|| format!("opening database {}", p.display())),
            }
        }
        Database::Postgres(url) => {
            // As with SQLite: a data dir that ran before (its tokens, its uploads) pointed at
            // a database without gpuci's tables is the wrong database, not a first start.
            let used = datadir::signs_of_use(&config.data_dir);
            let connected = if config.new_database || used.is_empty() {
                PostgresStore::connect(url).await
            } else {
                PostgresStore::connect_existing(url).await
            };
            match connected {
                Ok(s) => {
                    // Encrypted? Server verified? Said at every start, and as a warning naming
                    // the fix when a remote host is reached with less than verify-full (the
                    // rule: gpuci_store::DbTls::warning).
                    let database = gpuci_store::redact_url(url);
                    match s.tls().warning() {
                        Some(warning) => tracing::warn!(%database, connection = %s.tls(), "{warning}"),
                        None => tracing::info!(%database, connection = %s.tls(), "database connection"),
                    }
                    let holder = sole_use_holder(&config.data_dir)?;
                    let process = format!("pid {} ({})", std::process::id(), uuid::Uuid::new_v4());
                    if config.standby {
                        let webhooks = config.github.as_ref().map(|gh| standby::Webhooks {
                            store: Arc::new(s.clone()) as Arc<dyn Store>,
                            secret: gh.webhook_secret.clone(),
                            intake: crate::github::intake::Intake::new(gh.webhook_limits),
                        });
                        let source = match config.secrets_key_source() {
                            vault::KeySource::File(p) => p,
                            vault::KeySource::Ephemeral => config.data_dir.join("secrets.key"),
                        };
                        let proxy = proxy::Proxy::new(
                            Arc::new(s.clone()) as Arc<dyn Store>,
                            proxy::KeySource { secrets_key_file: source, data_dir: config.data_dir.clone() },
                        )
                        .within(limits)
                        .named(config.public_names.clone());
                        standing_by = standby::listen(config.listen, webhooks, Some(proxy), limits)?;
                    }
                    let claim = lead_or_stand_by(&s, &holder, &process, url, config.standby, &shutdown).await?;
                    tracing::info!(epoch = claim.epoch, "this coordinator leads the database");
                    led_epoch = Some(claim.epoch);
                    let s = s.fence(claim.epoch).await.with_context(|| {
                        format!("connecting to database {} as its leader", gpuci_store::redact_url(url))
                    })?;
                    // Renewed from now on, not once start-up is done: loading a large
                    // database may take longer than the claim lasts.
                    let clock = Arc::new(state::ClaimClock::default());
                    claim_renewed = Some(clock.clone());
                    renewal = Some(tokio::spawn(keep_sole_use(s.clone(), holder, process, leading_tx.clone(), clock)));
                    Arc::new(s)
                }
                Err(e @ gpuci_store::StoreError::NotGpuci(_)) => anyhow::bail!(
                    "database {}: {e}, but this data dir was used before (found {}): starting would make it a new, \
                 empty gpuci database and every agent would have to register again. Point --database at the \
                 database this coordinator used, or start with --new-database to begin an empty one",
                    gpuci_store::redact_url(url),
                    used.join(", ")
                ),
                Err(e) => return Err(e).with_context(|| format!("opening database {}", gpuci_store::redact_url(url))),
            }
        }
        Database::Memory => Arc::new(SqliteStore::in_memory().await?),
    };
    // The database exists now: from here on, a used data dir without it is refused. Then the
    // tokens, so that a first start cut short leaves no sign of use without a database.
    if let Database::Sqlite(p) = &config.database {
        datadir::mark_database_made(&config.data_dir, &p.display().to_string())
            .with_context(|| format!("writing {}", config.data_dir.join(datadir::DATABASE_MADE).display()))?;
    }
    let api_token = auth::load_or_create(&config.data_dir.join("api-token"), "gpuci_api").context("API token file")?;
    let registration_token = auth::load_or_create(&config.data_dir.join("registration-token"), "gpuci_reg")
        .context("registration token file")?;
    let read_token =
        auth::load_or_create(&config.data_dir.join("read-token"), "gpuci_read").context("read-only token file")?;
    // Public repositories are identities with their host: `acme/x` is the GitHub host's,
    // and `gitlab.com/acme/x` never passes for it.
    let public_repositories = config
        .public_repositories
        .iter()
        .map(|r| gpuci_core::repo::RepoId::parse(r, &config.github_host()))
        .collect::<Result<Vec<_>, _>>()
        .context("[dashboard] public_repositories")?;
    let metrics = Arc::new(metrics::Metrics::new());
    let secrets_key = Arc::new(vault::unlock(store.as_ref(), &config.secrets_key_source()).await?);
    let identity = Arc::new(
        identity::load_or_create(store.as_ref(), &secrets_key, &config.data_dir)
            .await
            .context("the coordinator identity key")?,
    );
    // The keys secrets encrypted in pipeline files open with: beside the database, never in it.
    let keys_dir = config.data_dir.join(REPO_SECRETS_KEYS);
    let repo_keys = Arc::new(std::sync::RwLock::new(
        gpuci_repo_secrets::KeyRing::open(&keys_dir).with_context(|| format!("key ring {}", keys_dir.display()))?,
    ));
    let hub = Arc::new(hub::Hub::new());
    let fleet_wake = Arc::new(tokio::sync::Notify::new());
    let mut brain = brain::Brain::load(store.clone(), hub.clone(), config.timing.clone(), secrets_key.clone())
        .await
        .context("loading state")?
        .with_repo_keys(repo_keys.clone())
        .with_metrics(metrics.clone())
        .with_fleet_wake(fleet_wake.clone())
        .with_repositories(config.github_host(), config.concurrency_shared.clone());
    let (tx, rx) = mpsc::channel(4096);
    let uploads = uploads::Uploads::with_store(config.data_dir.join("uploads"), upload_blobs);
    let listener = match standing_by.take() {
        Some(s) => s.take_over().await.with_context(|| format!("serving on {}", config.listen))?,
        None => {
            tokio::net::TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?
        }
    };
    let addr = listener.local_addr()?;
    if let Some(epoch) = led_epoch {
        // The former leader's agents follow its heartbeat, not ours: they get the time that
        // needs before any is called lost (`Brain::with_takeover_from`).
        let former = match store.coordinator_state(proxy::LEADER_STATE).await {
            Ok(Some(text)) => serde_json::from_str::<proxy::LeaderRecord>(&text).ok(),
            _ => None,
        };
        if let Some(record) = former.filter(|r| r.epoch < epoch) {
            // A record without a heartbeat is an older coordinator's: the default one.
            let heartbeat = record
                .heartbeat_ms
                .map_or(brain::Timing::default().heartbeat_interval, std::time::Duration::from_millis);
            brain = brain.with_takeover_from(heartbeat);
        }
        // Where a standby passes requests on to (`proxy`): written by the leader only (fenced).
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
        let record = proxy::LeaderRecord {
            urls: proxy::leader_urls(addr, &config.public_names, hostname.as_deref()),
            key: identity.public_key(),
            epoch,
            heartbeat_ms: Some(config.timing.heartbeat_interval.as_millis() as u64),
        };
        store
            .put_coordinator_state(proxy::LEADER_STATE, &serde_json::to_string(&record)?, brain::now_ms())
            .await
            .context("recording where this coordinator leads")?;
    }
    let github = match &config.github {
        None => None,
        Some(gh) => {
            let client = Arc::new(gpuci_github::Client::new(gh.api_url.clone(), gh.credentials.clone()));
            brain = brain.with_registrar(
                Arc::new(github::Registrar { client: client.clone(), store: store.clone() }),
                tx.clone(),
            );
            let deps = github::service::Deps {
                store: store.clone(),
                brain: tx.clone(),
                hub: hub.clone(),
                uploads: uploads.clone(),
                public_url: format!("http://{addr}"),
                tick: config.timing.tick.min(std::time::Duration::from_millis(500)),
            };
            tracing::info!(api = %gh.api_url, pools = gh.pools.len(), repositories = gh.repositories.len(), "GitHub integration on");
            Some(github::start(gh.clone(), client, deps, shutdown.clone()))
        }
    };
    // The fleets' loop talks to the brain and the store; agents on its machines connect here
    // with the registration token.
    let coordinator_id = identity::coordinator_id(store.as_ref(), &config.data_dir).await.context("coordinator id")?;
    let fleet_statuses = fleets::start(
        config.fleets.clone(),
        fleets::Deps {
            store: store.clone(),
            brain: tx.clone(),
            coordinator_id: coordinator_id.chars().filter(|c| c.is_ascii_alphanumeric()).take(24).collect(),
            server_url: format!("http://{addr}"),
            registration_token: registration_token.expose().to_string(),
            coordinator_key: identity.public_key(),
            interval: config.fleet_interval,
            data_dir: config.data_dir.clone(),
            budgets: config.budgets.clone(),
            github_host: config.github_host(),
            metrics: metrics.clone(),
            wake: fleet_wake,
        },
        shutdown.clone(),
    );
    let schedules = schedules::start(
        config.schedules.clone(),
        schedules::Deps {
            store: store.clone(),
            brain: tx.clone(),
            uploads: uploads.clone(),
            work_dir: config.data_dir.join("schedules"),
        },
        shutdown.clone(),
    )
    .await
    .context("arming the schedules")?;
    let st = AppState {
        leading,
        claim_renewed,
        store,
        brain: tx,
        hub,
        api_token: api_token.clone(),
        registration_token: registration_token.clone(),
        secrets_key,
        identity,
        public_names: Arc::new(config.public_names.clone()),
        repo_keys,
        conn_seq: Arc::new(AtomicU64::new(1)),
        shutdown: shutdown.clone(),
        uploads,
        artifacts: artifacts::Artifacts::with_store(
            config.data_dir.join("artifacts"),
            config.artifacts.limits,
            artifact_blobs,
        ),
        github,
        max_log_bytes: config.max_log_bytes,
        fleets: fleet_statuses,
        machine_registrations: Arc::new(tokio::sync::Mutex::new(())),
        metrics,
        live: Arc::new(live::LiveTelemetry::default()),
        read_token,
        public_repositories: Arc::new(public_repositories),
        budgets: Arc::new(config.budgets.clone()),
        github_api_url: config.github.as_ref().map(|g| g.api_url.clone()),
        revoked_sessions: Arc::new(auth::RevokedSessions::default()),
        live_streams: Arc::new(tokio::sync::Semaphore::new(ui::MAX_LIVE_STREAMS)),
        schedules,
    };
    tokio::spawn(uploads_gc::run(
        st.store.clone(),
        st.uploads.clone(),
        st.metrics.clone(),
        config.uploads_gc,
        shutdown.clone(),
    ));
    tokio::spawn(artifacts_gc::run(st.store.clone(), st.artifacts.clone(), config.artifacts, shutdown.clone()));
    tokio::spawn(blobs_watch::run(st.artifacts.blobs().clone(), shutdown.clone()));
    let app = router(st);
    let brain_task = tokio::spawn(brain.run(rx, shutdown.clone()));
    let sd = shutdown.clone();
    let shutdown_on_loss = shutdown.clone();
    let task = tokio::spawn(async move {
        // Each connection knows the address it came in on, and must send its requests in time.
        let served = serve::serve(listener, app, limits, sd);
        let result = tokio::select! {
            () = served => Ok(()),
            lost = async {
                match renewal {
                    Some(task) => task.await.unwrap_or_else(|e| anyhow::anyhow!("the claim's renewal failed: {e}")),
                    None => std::future::pending().await,
                }
            } => {
                tracing::error!(error = %lost, "stopping");
                shutdown_on_loss.cancel();
                Err(lost)
            }
        };
        let _ = brain_task.await;
        drop(data_dir_lock);
        result
    });
    tracing::info!(%addr, "coordinator listening");
    Ok(Running { addr, url: format!("http://{addr}"), api_token, registration_token, task })
}

/// How long a coordinator's claim on a Postgres database lasts without renewal; renewed every
/// [`SOLE_USE_RENEW`].
pub const SOLE_USE_LEASE: std::time::Duration = std::time::Duration::from_secs(4);
const SOLE_USE_RENEW: std::time::Duration = std::time::Duration::from_secs(1);

/// Who claims a database: this host and data dir (the same coordinator restarted takes its
/// claim back at once; its data dir lock shows the earlier run is gone).
/// The data dir is named by an id kept in it (`<data dir>/instance-id`, made once), not by its
/// path alone: another directory mounted at the same path on a host of the same name (two
/// containers) took over a healthy coordinator's database at once (outsider attack).
fn sole_use_holder(data_dir: &std::path::Path) -> anyhow::Result<String> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let dir = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let id_file = data_dir.join("instance-id");
    let id = match std::fs::read_to_string(&id_file) {
        Ok(id) if !id.trim().is_empty() => id.trim().to_string(),
        _ => {
            let id = uuid::Uuid::new_v4().to_string();
            datadir::create_private(&id_file, format!("{id}\n").as_bytes())
                .or_else(|e| if e.kind() == std::io::ErrorKind::AlreadyExists { Ok(()) } else { Err(e) })
                .with_context(|| format!("writing {}", id_file.display()))?;
            std::fs::read_to_string(&id_file)
                .with_context(|| format!("reading {}", id_file.display()))?
                .trim()
                .to_string()
        }
    };
    Ok(format!("{}:{} ({id})", host.trim(), dir.display()))
}

/// Claims the database for this coordinator. Held by another: refused, or with `standby`,
/// tried again every [`STANDBY_RETRY`] until the holder's claim lapses (it stopped renewing:
/// killed, paused, cut off) or `shutdown`.
async fn lead_or_stand_by(
    store: &PostgresStore,
    holder: &str,
    process: &str,
    url: &str,
    standby: bool,
    shutdown: &CancellationToken,
) -> anyhow::Result<gpuci_store::Claim> {
    let mut told = false;
    loop {
        let claim = if standby {
            store.claim_as_standby(holder, process, SOLE_USE_LEASE).await
        } else {
            store.claim_sole_use(holder, process, SOLE_USE_LEASE).await
        };
        let held = match claim {
            Ok(Ok(claim)) => return Ok(claim),
            Ok(Err(held)) => held,
            // Standing by, the database may come and go: the leader is affected as much.
            Err(e) if standby && e.is_unavailable() => {
                tracing::warn!(error = %e, "standing by: cannot reach the database; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => anyhow::bail!("shut down while standing by; this coordinator never led"),
                    _ = tokio::time::sleep(STANDBY_RETRY) => continue,
                }
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("claiming database {} for this coordinator", gpuci_store::redact_url(url))
                })
            }
        };
        if !standby {
            anyhow::bail!(
                "database {}: another gpuci coordinator leads it ({}, {}; renewed {:.0}s ago). A second \
                 coordinator on one database runs as a standby (--standby): it takes over when the leader's \
                 claim lapses, {}s after its last renewal",
                gpuci_store::redact_url(url),
                held.holder,
                held.process,
                held.renewed_secs_ago,
                SOLE_USE_LEASE.as_secs()
            );
        }
        if !told {
            tracing::info!(
                leader = %held.holder,
                process = %held.process,
                "standing by: another coordinator leads this database; taking over if its claim lapses ({}s without renewal)",
                SOLE_USE_LEASE.as_secs()
            );
            told = true;
        }
        tokio::select! {
            _ = shutdown.cancelled() => anyhow::bail!("shut down while standing by; this coordinator never led"),
            _ = tokio::time::sleep(STANDBY_RETRY) => {}
        }
    }
}

/// What clients may hold open (`serve::ConnLimits`), from the open-file limit (raised to
/// its most first) and `--max-connections-per-address`.
pub fn connection_limits(per_address: Option<usize>) -> serve::ConnLimits {
    let files = serve::raise_open_files();
    let mut limits = serve::ConnLimits::for_open_files(files.unwrap_or(1024));
    match per_address {
        Some(0) => limits.per_address = None,
        Some(n) => limits.per_address = Some(n),
        None => {}
    }
    tracing::info!(
        open_files = files,
        connections = limits.total,
        per_address = limits.per_address,
        "client connections limited (agents' channels are not counted)"
    );
    limits
}

/// How often a standby coordinator tries to claim the database.
const STANDBY_RETRY: std::time::Duration = std::time::Duration::from_millis(500);

/// Renews the claim on a Postgres database every [`SOLE_USE_RENEW`] and returns only when it
/// is lost: another coordinator took it (it lapsed: this one did not run, or could not reach
/// the database, for [`SOLE_USE_LEASE`]). While renewals fail for longer than the claim lasts,
/// a standby may lead already: this coordinator steps aside (`leading` false: `/readyz`
/// answers 503, agents are disconnected and refused, so a load balancer and the agents turn
/// to the new leader) until a renewal succeeds again — then nobody took the claim and it leads
/// on — or is refused, and it stops. Its writes are refused by the database meanwhile anyway
/// once another claimed it (fencing).
async fn keep_sole_use(
    store: PostgresStore,
    holder: String,
    process: String,
    leading: tokio::sync::watch::Sender<bool>,
    clock: Arc<state::ClaimClock>,
) -> anyhow::Error {
    let mut last_renewed = std::time::Instant::now();
    let mut failing = false;
    loop {
        tokio::time::sleep(SOLE_USE_RENEW).await;
        // A database that stops answering without closing the connection (a partition that
        // drops packets) would hold a renewal forever, and with it the stepping aside below:
        // a renewal that takes longer than what is left of the claim counts as failed.
        let left = SOLE_USE_LEASE.saturating_sub(last_renewed.elapsed()).max(SOLE_USE_RENEW);
        // The claim runs from when the database stamped it, which is no later than this: an
        // answer that comes late (a slow link, a freeze just after the stamp) must not make
        // the claim look younger than it is (outsider attack: a former leader answered
        // `/readyz` 200 for 3.4–4.0 s after a standby had taken over).
        let asked_at = std::time::Instant::now();
        let renewed = match tokio::time::timeout(left, store.renew_sole_use(&holder, &process)).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer from the database within {}ms", left.as_millis())),
        };
        match renewed {
            Ok(true) => {
                if failing {
                    tracing::info!("the claim on the database is renewed again");
                }
                if !*leading.borrow() {
                    tracing::warn!("leading again: nobody took the claim while the database could not be reached");
                }
                clock.renewed_at(asked_at);
                // Only a change is sent: every agent connection's task waits on this.
                leading.send_if_modified(|l| !std::mem::replace(l, true));
                failing = false;
                last_renewed = asked_at;
            }
            Ok(false) => {
                leading.send_replace(false);
                return anyhow::anyhow!(
                    "this coordinator no longer leads its database: another coordinator (a standby) took it \
                     over, as a claim passes on when it was not renewed for {}s (this coordinator did not run, \
                     or could not reach the database, that long); stopping, as two must never lead one database",
                    SOLE_USE_LEASE.as_secs()
                );
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "could not renew the claim on the database; retrying");
                }
                failing = true;
                if last_renewed.elapsed() > SOLE_USE_LEASE && *leading.borrow() {
                    tracing::error!(
                        "the claim on the database was not renewed for {}s: a standby may lead now; taking no \
                         agents and answering /readyz with 503 until it is renewed or taken",
                        SOLE_USE_LEASE.as_secs()
                    );
                    leading.send_replace(false);
                }
            }
        }
    }
}
