//! What every HTTP handler (API, dashboard, agent channel, webhooks) is handed: the store,
//! the scheduler's command channel, the hubs and handles of the loops, tokens and keys. Plain
//! handles only, built once by [`crate::start`]; it decides nothing and names no handler.

use crate::{artifacts, auth, brain, fleets, github, hub, live, metrics, schedules, uploads};
use auth::Secret;
use gpuci_store::Store;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
pub struct AppState {
    /// Whether this coordinator leads its database now (always, with SQLite): while false it
    /// answers `/readyz` with 503 and takes no agent (`keep_sole_use` in the crate root).
    pub leading: tokio::sync::watch::Receiver<bool>,
    /// When its claim on a Postgres database was last renewed; `None` with SQLite (no claim).
    pub claim_renewed: Option<Arc<ClaimClock>>,
    pub store: Arc<dyn Store>,
    pub brain: mpsc::Sender<brain::Command>,
    pub hub: Arc<hub::Hub>,
    pub api_token: Secret,
    pub registration_token: Secret,
    /// Seals secret values before they are stored ([`crate::vault`]).
    pub secrets_key: Arc<gpuci_store::SecretsKey>,
    /// The installation's identity key, proved to agents and the CLI ([`crate::identity`]).
    pub identity: Arc<gpuci_core::coordinator_identity::SigningIdentity>,
    /// Names (and addresses) this coordinator is reached by besides its socket's own
    /// address (`crate::Config::public_names`).
    pub public_names: Arc<Vec<String>>,
    /// Opens secrets encrypted in pipeline files; its current public key is handed out.
    pub repo_keys: Arc<std::sync::RwLock<gpuci_repo_secrets::KeyRing>>,
    pub conn_seq: Arc<AtomicU64>,
    pub shutdown: CancellationToken,
    /// Workspace uploads: `<data-dir>/uploads`.
    pub uploads: uploads::Uploads,
    /// Artifacts: `<data-dir>/artifacts` ([`crate::artifacts`]).
    pub artifacts: artifacts::Artifacts,
    /// Set when GitHub is configured: what the webhook endpoint needs.
    pub github: Option<github::Handle>,
    /// Per-job cap on stored log (`crate::Config::max_log_bytes`).
    pub max_log_bytes: u64,
    /// What each fleet has and wants, as the reconcile loop last saw it.
    pub fleets: fleets::Statuses,
    /// Held while a machine's registration token is checked and spent, so two registrations
    /// with one token cannot both pass (one coordinator per database: this process is all).
    pub machine_registrations: Arc<tokio::sync::Mutex<()>>,
    /// Counters and histograms for `/metrics`.
    pub metrics: Arc<metrics::Metrics>,
    /// Running jobs' latest GPU samples.
    pub live: Arc<live::LiveTelemetry>,
    /// Signs in to the dashboard and scrapes `/metrics`; changes nothing (`<data-dir>/read-token`).
    pub read_token: Secret,
    /// Repositories whose jobs and logs the dashboard shows without sign-in.
    pub public_repositories: Arc<Vec<gpuci_core::repo::RepoId>>,
    /// Repository budgets (the spend page).
    pub budgets: Arc<Vec<gpuci_core::fleet::RepoBudget>>,
    /// GitHub's API address, when GitHub is configured (links to repositories and check runs).
    pub github_api_url: Option<String>,
    /// Dashboard sessions signed out before they expired.
    pub revoked_sessions: Arc<auth::RevokedSessions>,
    /// Live streams (server-sent events) open at once, at most `ui::MAX_LIVE_STREAMS`.
    pub live_streams: Arc<tokio::sync::Semaphore>,
    /// The schedules and their task's queue.
    pub schedules: schedules::Handle,
}

/// When this coordinator's claim on its database was last renewed (by `keep_sole_use` in the
/// crate root, every second).
pub struct ClaimClock(std::sync::Mutex<std::time::Instant>);

impl Default for ClaimClock {
    /// Renewed now.
    fn default() -> ClaimClock {
        ClaimClock(std::sync::Mutex::new(std::time::Instant::now()))
    }
}

impl ClaimClock {
    /// Renewed by a statement sent at `asked_at` (the database's stamp is no earlier).
    pub fn renewed_at(&self, asked_at: std::time::Instant) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = asked_at;
    }

    pub fn age(&self) -> std::time::Duration {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).elapsed()
    }
}

impl AppState {
    /// Why this coordinator may not act as its database's leader now, if it may not: it
    /// stepped aside, or its claim was last renewed longer ago than a claim lasts. The second
    /// is seen before the renewal task says so: a former leader resumed after a freeze
    /// answered `/readyz` 200 for about 20 ms (outsider attack), until that task ran.
    pub fn not_leading(&self) -> Option<String> {
        let lease = crate::SOLE_USE_LEASE;
        if !*self.leading.borrow() {
            return Some(format!(
                "not leading: this coordinator's claim on the database could not be renewed for longer than it \
                 lasts ({}s), and a standby may lead now",
                lease.as_secs()
            ));
        }
        let age = self.claim_renewed.as_ref()?.age();
        (age > lease).then(|| {
            format!(
                "not leading: this coordinator's claim on the database was last renewed {:.1}s ago, longer than it \
                 lasts ({}s); a standby may lead now",
                age.as_secs_f64(),
                lease.as_secs()
            )
        })
    }

    /// Send a command to the scheduler and wait for its answer.
    pub async fn ask<T>(
        &self,
        make: impl FnOnce(tokio::sync::oneshot::Sender<Result<T, brain::BrainError>>) -> brain::Command,
    ) -> Result<T, brain::BrainError> {
        brain::ask(&self.brain, make).await
    }

    /// The GitHub host a bare `owner/name` is on (`crate::Config::github_host`).
    pub fn github_host(&self) -> String {
        gpuci_core::repo::github_host_of_api_url(self.github_api_url.as_deref())
    }
}
