//! The `[github]` section of the server's config file (TOML): how to reach GitHub, which
//! repositories run gpuci pipelines, and the runner pools that serve `runs-on` labels.
//!
//! Parsing is strict: unknown keys, bad durations and bad GPU constraints are errors that
//! name `file:line:column` and the field. Secrets are read from files or environment
//! variables named here, never written in the file itself, and never logged.

use gpuci_core::duration::Duration;
use gpuci_core::gpu::{ComputeCapability, Constraint, GpuRequirements, Version};
use gpuci_core::quantity::Bytes;
use gpuci_github::{AppCredentials, Credentials, Secret};
use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use crate::parsed::{FieldValue, Parsed};

/// The whole server config file: `[github]`, the `[[fleet]]`s and the `[[budget]]`s (checked
/// strictly by `gpuci_core::fleet::parse_fleets` and `parse_budgets`; only accepted here).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerFile {
    pub github: Option<GithubFile>,
    #[serde(default)]
    pub fleet: Vec<toml::Table>,
    /// Repository budgets (checked by `gpuci_core::fleet::parse_budgets`).
    #[serde(default)]
    pub budget: Vec<toml::Table>,
    pub dashboard: Option<DashboardFile>,
    /// `[[concurrency.shared]]` (checked by `gpuci_core::concurrency::parse_shared_groups`).
    pub concurrency: Option<toml::Table>,
    /// `[uploads]`: garbage collection of workspace uploads.
    pub uploads: Option<UploadsFile>,
    /// `[artifacts]`: caps and retention of artifacts (`crate::artifacts_gc::ArtifactsFile`).
    pub artifacts: Option<crate::artifacts_gc::ArtifactsFile>,
    /// `[blobs]`: where uploads' and artifacts' bytes live (`crate::blobs::BlobsFile`).
    pub blobs: Option<crate::blobs::BlobsFile>,
    /// `[[schedule]]`s (checked by `gpuci_core::schedule_config::parse_schedules`).
    #[serde(default)]
    pub schedule: Vec<toml::Table>,
}

/// `[uploads]`: how long workspace uploads are kept (`crate::uploads_gc`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadsFile {
    /// An upload no job that may still run needs is deleted once unused this long (since it
    /// was last uploaded, or a pipeline naming it last changed). Default 7d; at least 1s.
    #[serde(default = "default_upload_retention")]
    pub retention: Parsed<Duration>,
    /// The most all uploads together may hold (`50GiB`); over it, the least recently used
    /// uploads no job needs go first. Default: no cap.
    #[serde(default)]
    pub max_total: Option<Parsed<Bytes>>,
}

fn default_upload_retention() -> Parsed<Duration> {
    Parsed(Duration(crate::uploads_gc::DEFAULT_RETENTION))
}

impl UploadsFile {
    /// The collector's settings (its interval is a flag, not in the file).
    pub fn apply(&self, gc: &mut crate::uploads_gc::GcConfig) {
        gc.retention = self.retention.0.as_std();
        gc.max_total = self.max_total.as_ref().map(|b| b.0 .0);
    }
}

/// `[dashboard]`: what the web dashboard shows without sign-in.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DashboardFile {
    /// Repositories whose jobs and logs anyone may see without signing in (for open-source
    /// projects: check-run links open for everyone). Nothing else is public. `owner/name` is
    /// on the configured GitHub host; a repository elsewhere is named with its host
    /// (`gitlab.com/acme/x`).
    #[serde(default)]
    pub public_repositories: Vec<PublicRepo>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GithubFile {
    /// `https://api.github.com`, or `https://HOST/api/v3` for GitHub Enterprise Server.
    #[serde(default = "default_api_url")]
    pub api_url: String,
    /// Where people reach this coordinator; links in check runs and statuses.
    pub public_url: Option<String>,
    pub webhook_secret_file: Option<PathBuf>,
    pub webhook_secret_env: Option<String>,
    /// GitHub App authentication (preferred).
    pub app_id: Option<u64>,
    pub private_key_file: Option<PathBuf>,
    pub private_key_env: Option<String>,
    /// A personal access token instead of an App: the simple set-up for one repository.
    pub token_file: Option<PathBuf>,
    pub token_env: Option<String>,
    /// The label a maintainer adds to run a pull request's pipeline (one head SHA at a time).
    #[serde(default = "default_approval_label")]
    pub approval_label: String,
    /// How often to ask GitHub for queued jobs that a missed webhook would otherwise lose.
    #[serde(default = "default_reconcile")]
    pub reconcile_interval: Parsed<Duration>,
    /// `checks` (App only) or `statuses`; default: checks with an App, statuses with a token.
    pub report: Option<Report>,
    /// Repositories (`owner/name`) whose pushes and pull requests run their `.gpuci.yml`.
    #[serde(default)]
    pub repositories: Vec<RepoName>,
    #[serde(default = "default_pipeline_file")]
    pub pipeline_file: String,
    /// Runner pools, tried in order; the first that serves all of a job's labels takes it.
    #[serde(default, rename = "pool")]
    pub pools: Vec<PoolFile>,
    /// Webhook bodies read at the same time (each up to GitHub's 25 MB cap); one more waits
    /// up to a second for room, then gets 503 with `Retry-After` (docs/github.md). Default 8.
    #[serde(default = "default_webhook_max_bodies")]
    pub webhook_max_bodies: u32,
    /// How long a webhook body may take to arrive, whole; a slower one is cut off with 408.
    /// Default 30s.
    #[serde(default = "default_webhook_read_timeout")]
    pub webhook_read_timeout: Parsed<Duration>,
}

fn default_webhook_max_bodies() -> u32 {
    crate::github::intake::DEFAULT_MAX_BODIES
}

fn default_webhook_read_timeout() -> Parsed<Duration> {
    Parsed(Duration(crate::github::intake::DEFAULT_READ_TIMEOUT))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Report {
    Checks,
    Statuses,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForkPolicy {
    /// Jobs of workflow runs from forks get no runner (GitHub's own approval is not enough for
    /// a machine with secrets nearby).
    #[default]
    Deny,
    Allow,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolFile {
    pub name: String,
    /// The labels this pool serves; `self-hosted` is implied. A job matches when every one
    /// of its `runs-on` labels is served.
    pub labels: Vec<String>,
    /// `owner/name` or `owner/*`; empty: every repository of the installation.
    #[serde(default)]
    pub repositories: Vec<String>,
    /// Register runners with this organisation instead of the job's repository.
    pub org: Option<String>,
    #[serde(default = "default_runner_group")]
    pub runner_group_id: u64,
    /// GPUs per runner.
    #[serde(default = "default_gpus")]
    pub gpus: u32,
    /// Glob on the GPU model, e.g. `H100*`.
    pub gpu_model: Option<String>,
    /// e.g. `>=40GiB`.
    pub gpu_memory: Option<Parsed<Constraint<Bytes>>>,
    /// e.g. `>=8.0`.
    pub compute_capability: Option<Parsed<Constraint<ComputeCapability>>>,
    pub driver: Option<Parsed<Constraint<Version>>>,
    pub cuda: Option<Parsed<Constraint<Version>>>,
    /// Agent tags the runner's host must have.
    #[serde(default)]
    pub agents: BTreeMap<String, String>,
    #[serde(default = "default_max_runners")]
    pub max_runners: u32,
    #[serde(default)]
    pub forks: ForkPolicy,
    /// A job still queued on GitHub after this is cancelled there, with the reason.
    #[serde(default = "default_queue_timeout")]
    pub queue_timeout: Parsed<Duration>,
    /// A runner that has picked up no job after this is removed and its GPUs freed.
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout: Parsed<Duration>,
    /// The longest a runner (and so its job) may run.
    #[serde(default = "default_job_timeout")]
    pub job_timeout: Parsed<Duration>,
    /// Where the Actions runner is installed on the agents' hosts.
    #[serde(default = "default_install_dir")]
    pub install_dir: String,
    /// After a runner exits without taking its job, the pause before the next one; it doubles
    /// with each such exit in a row, up to 5 minutes (see `backoff`).
    #[serde(default = "default_runner_backoff")]
    pub runner_backoff: Parsed<Duration>,
}

/// `owner/name`, checked when read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoName(pub String);

impl<'de> Deserialize<'de> for RepoName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if gpuci_github::Repo::parse(&s).is_none() {
            return Err(serde::de::Error::custom(format!("expected a repository as owner/name, got {s:?}")));
        }
        Ok(RepoName(s))
    }
}

/// A public repository: `owner/name` or `host/path`, checked when read (the GitHub host a
/// bare name is on is applied at start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicRepo(pub String);

impl<'de> Deserialize<'de> for PublicRepo {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match gpuci_core::repo::RepoId::parse(&s, gpuci_core::repo::DEFAULT_GITHUB_HOST) {
            Ok(id) if !id.is_local() => Ok(PublicRepo(s)),
            _ => Err(serde::de::Error::custom(format!(
                "expected a repository as owner/name (on GitHub) or host/path, got {s:?}"
            ))),
        }
    }
}

fn default_api_url() -> String {
    "https://api.github.com".into()
}
fn default_approval_label() -> String {
    "run-gpu-ci".into()
}
fn default_reconcile() -> Parsed<Duration> {
    Parsed(Duration::from_str("5m").unwrap_or_default())
}
fn default_pipeline_file() -> String {
    ".gpuci.yml".into()
}
fn default_runner_group() -> u64 {
    1
}
fn default_gpus() -> u32 {
    1
}
fn default_max_runners() -> u32 {
    4
}
fn default_queue_timeout() -> Parsed<Duration> {
    Parsed(Duration::from_str("30m").unwrap_or_default())
}
fn default_idle_timeout() -> Parsed<Duration> {
    Parsed(Duration::from_str("10m").unwrap_or_default())
}
fn default_job_timeout() -> Parsed<Duration> {
    Parsed(Duration::from_str("6h").unwrap_or_default())
}
fn default_install_dir() -> String {
    "/opt/actions-runner".into()
}
fn default_runner_backoff() -> Parsed<Duration> {
    Parsed(Duration::from_str("10s").unwrap_or_default())
}

/// A config error with where it is.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// Parse a server config file's text. `file` names it in errors.
pub fn parse(file: &str, text: &str) -> Result<ServerFile, ConfigError> {
    let parsed: ServerFile = toml::from_str(text).map_err(|e| {
        let at = e.span().map(|span| line_col(text, span.start));
        let message = e.message().trim_end().to_string();
        match at {
            Some((line, col)) => ConfigError(format!("{file}:{line}:{col}: {message}")),
            None => ConfigError(format!("{file}: {message}")),
        }
    })?;
    if let Some(g) = &parsed.github {
        validate(file, text, g)?;
    }
    if parsed.uploads.as_ref().is_some_and(|u| u.retention.0.as_std().is_zero()) {
        let at = text.find("retention").map(|i| line_col(text, i)).map_or(String::new(), |(l, c)| format!(":{l}:{c}"));
        return Err(ConfigError(format!(
            "{file}{at}: uploads.retention: must be at least 1s (an upload is named by its pipeline a moment after it is sent)"
        )));
    }
    Ok(parsed)
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rfind('\n').map_or(before.len(), |i| before.len() - i - 1) + 1;
    (line, col)
}

/// Checks across fields. Errors point at the `[[github.pool]]` (or `[github]`) header.
fn validate(file: &str, text: &str, g: &GithubFile) -> Result<(), ConfigError> {
    let at = |needle: &str, nth: usize| {
        text.match_indices(needle)
            .nth(nth)
            .map(|(i, _)| line_col(text, i))
            .map_or(String::new(), |(l, c)| format!(":{l}:{c}"))
    };
    let gh = at("[github]", 0);
    let app = g.app_id.is_some() || g.private_key_file.is_some() || g.private_key_env.is_some();
    let token = g.token_file.is_some() || g.token_env.is_some();
    if app == token {
        return Err(ConfigError(format!(
            "{file}{gh}: github: give either a GitHub App (app_id and private_key_file or private_key_env) or a token (token_file or token_env)"
        )));
    }
    if app && (g.app_id.is_none() || (g.private_key_file.is_none() == g.private_key_env.is_none())) {
        return Err(ConfigError(format!(
            "{file}{gh}: github: a GitHub App needs app_id and exactly one of private_key_file, private_key_env"
        )));
    }
    if g.webhook_secret_file.is_none() == g.webhook_secret_env.is_none() {
        return Err(ConfigError(format!(
            "{file}{gh}: github: give exactly one of webhook_secret_file, webhook_secret_env (every webhook is verified)"
        )));
    }
    if g.webhook_max_bodies == 0 {
        return Err(ConfigError(format!("{file}{gh}: github.webhook_max_bodies must be at least 1")));
    }
    if g.webhook_read_timeout.0.as_std().is_zero() {
        return Err(ConfigError(format!("{file}{gh}: github.webhook_read_timeout must be longer than 0s")));
    }
    if token && g.report == Some(Report::Checks) {
        return Err(ConfigError(format!("{file}{gh}: github.report: check runs need a GitHub App; use \"statuses\"")));
    }
    let mut names = std::collections::BTreeSet::new();
    for (i, p) in g.pools.iter().enumerate() {
        let here = at("[[github.pool]]", i);
        let bad = |what: String| Err(ConfigError(format!("{file}{here}: github.pool[{i}] ({}): {what}", p.name)));
        if !names.insert(p.name.as_str()) {
            return bad("another pool has this name".into());
        }
        if p.labels.is_empty() {
            return bad("labels: give at least one label (the runs-on labels this pool serves)".into());
        }
        if p.max_runners == 0 {
            return bad("max_runners must be at least 1".into());
        }
        if !p.install_dir.starts_with('/') {
            return bad(format!("install_dir must be an absolute path, got {:?}", p.install_dir));
        }
        if let Some(r) =
            p.repositories.iter().find(|r| r.split_once('/').is_none_or(|(o, n)| o.is_empty() || n.is_empty()))
        {
            return bad(format!("repositories: expected owner/name or owner/*, got {r:?}"));
        }
    }
    Ok(())
}

/// The `[github]` section with its secrets read: what the coordinator runs with.
#[derive(Debug)]
pub struct GithubConfig {
    pub api_url: String,
    pub public_url: Option<String>,
    pub webhook_secret: Secret,
    pub credentials: Credentials,
    pub approval_label: String,
    pub reconcile_interval: std::time::Duration,
    pub report: Report,
    pub repositories: Vec<String>,
    pub pipeline_file: String,
    pub pools: Vec<Pool>,
    /// What a webhook body may take: how many at once, how long (`github::intake`).
    pub webhook_limits: crate::github::intake::Limits,
}

/// A runner pool, resolved.
#[derive(Clone, Debug)]
pub struct Pool {
    pub name: String,
    pub labels: Vec<String>,
    pub repositories: Vec<String>,
    pub org: Option<String>,
    pub runner_group_id: u64,
    pub gpu: GpuRequirements,
    pub agents: BTreeMap<String, String>,
    pub max_runners: u32,
    pub forks: ForkPolicy,
    pub queue_timeout: std::time::Duration,
    pub idle_timeout: std::time::Duration,
    pub job_timeout: Duration,
    pub install_dir: String,
    /// The first pause after a runner exits without taking its job.
    pub runner_backoff: std::time::Duration,
}

impl Pool {
    /// Whether this pool takes jobs of `repository` (`owner/name`).
    pub fn serves_repository(&self, repository: &str) -> bool {
        self.repositories.is_empty()
            || self.repositories.iter().any(|r| match r.strip_suffix("/*") {
                Some(owner) => repository.split_once('/').is_some_and(|(o, _)| o.eq_ignore_ascii_case(owner)),
                None => r.eq_ignore_ascii_case(repository),
            })
    }

    /// Whether every `runs-on` label is served (`self-hosted` always is). Labels compare
    /// case-insensitively, as GitHub's do.
    pub fn serves_labels(&self, labels: &[String]) -> bool {
        !labels.is_empty()
            && labels
                .iter()
                .all(|l| l.eq_ignore_ascii_case("self-hosted") || self.labels.iter().any(|p| p.eq_ignore_ascii_case(l)))
    }

    /// The labels a runner of this pool registers with.
    pub fn runner_labels(&self) -> Vec<String> {
        let mut labels = vec!["self-hosted".to_string()];
        labels.extend(self.labels.iter().filter(|l| !l.eq_ignore_ascii_case("self-hosted")).cloned());
        labels
    }
}

/// Why a workflow job gets no runner from gpuci.
#[derive(Debug, PartialEq, Eq)]
pub enum NoPool {
    /// No pool serves all its labels (a job for GitHub-hosted or other runners): ignored.
    Labels,
    /// A pool serves the labels but not this repository.
    Repository(String),
}

/// The first pool that serves the job's labels and repository.
pub fn match_pool<'a>(pools: &'a [Pool], repository: &str, labels: &[String]) -> Result<&'a Pool, NoPool> {
    let by_labels: Vec<&Pool> = pools.iter().filter(|p| p.serves_labels(labels)).collect();
    if by_labels.is_empty() {
        return Err(NoPool::Labels);
    }
    by_labels
        .iter()
        .find(|p| p.serves_repository(repository))
        .copied()
        .ok_or_else(|| NoPool::Repository(by_labels.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")))
}

fn read_secret(what: &str, file: Option<&Path>, env: Option<&str>) -> Result<Secret, ConfigError> {
    let value = match (file, env) {
        (Some(f), _) => std::fs::read_to_string(f)
            .map_err(|e| ConfigError(format!("github.{what}_file: reading {}: {e}", f.display())))?,
        (None, Some(v)) => std::env::var(v)
            .map_err(|_| ConfigError(format!("github.{what}_env: environment variable {v} is not set")))?,
        (None, None) => return Err(ConfigError(format!("github: {what} is not configured"))),
    };
    let value = value.trim().to_string();
    if value.is_empty() {
        return Err(ConfigError(format!("github: the {what} is empty")));
    }
    Ok(Secret::new(value))
}

impl GithubFile {
    /// The files this section reads credentials from (App key, webhook secret, token).
    pub fn secret_files(&self) -> Vec<&Path> {
        [&self.webhook_secret_file, &self.private_key_file, &self.token_file]
            .into_iter()
            .flatten()
            .map(PathBuf::as_path)
            .collect()
    }

    /// Read the secrets it names and resolve the pools.
    pub fn resolve(&self) -> Result<GithubConfig, ConfigError> {
        let webhook_secret =
            read_secret("webhook_secret", self.webhook_secret_file.as_deref(), self.webhook_secret_env.as_deref())?;
        let credentials = match self.app_id {
            Some(app_id) => {
                let pem =
                    read_secret("private_key", self.private_key_file.as_deref(), self.private_key_env.as_deref())?;
                let app =
                    AppCredentials::new(app_id, &pem).map_err(|e| ConfigError(format!("github.private_key: {e}")))?;
                Credentials::App(app)
            }
            None => Credentials::Token(read_secret("token", self.token_file.as_deref(), self.token_env.as_deref())?),
        };
        let report = self.report.unwrap_or(if self.app_id.is_some() { Report::Checks } else { Report::Statuses });
        let pools = self
            .pools
            .iter()
            .map(|p| Pool {
                name: p.name.clone(),
                labels: p.labels.clone(),
                repositories: p.repositories.clone(),
                org: p.org.clone(),
                runner_group_id: p.runner_group_id,
                gpu: GpuRequirements {
                    count: p.gpus,
                    memory: p.gpu_memory.clone().map(|m| m.0),
                    compute_capability: p.compute_capability.clone().map(|c| c.0),
                    model: p.gpu_model.clone(),
                    driver: p.driver.clone().map(|d| d.0),
                    cuda: p.cuda.clone().map(|c| c.0),
                    mig_profile: None,
                },
                agents: p.agents.clone(),
                max_runners: p.max_runners,
                forks: p.forks,
                queue_timeout: p.queue_timeout.0.as_std(),
                idle_timeout: p.idle_timeout.0.as_std(),
                job_timeout: p.job_timeout.0,
                install_dir: p.install_dir.clone(),
                runner_backoff: p.runner_backoff.0.as_std(),
            })
            .collect();
        Ok(GithubConfig {
            api_url: self.api_url.trim_end_matches('/').to_string(),
            public_url: self.public_url.as_ref().map(|u| u.trim_end_matches('/').to_string()),
            webhook_secret,
            credentials,
            approval_label: self.approval_label.clone(),
            reconcile_interval: self.reconcile_interval.0.as_std(),
            report,
            repositories: self.repositories.iter().map(|r| r.0.clone()).collect(),
            pipeline_file: self.pipeline_file.clone(),
            pools,
            webhook_limits: crate::github::intake::Limits {
                max_bodies: self.webhook_max_bodies,
                read_timeout: self.webhook_read_timeout.0.as_std(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[github]
app_id = 42
private_key_env = "GPUCI_TEST_NO_SUCH_KEY"
webhook_secret_env = "GPUCI_TEST_NO_SUCH_SECRET"
repositories = ["octo/gpu"]

[[github.pool]]
name = "h100"
labels = ["gpu", "h100"]
repositories = ["octo/*"]
gpus = 2
gpu_memory = ">=40GiB"
compute_capability = "9.0"
queue_timeout = "20m"
"#;

    #[test]
    fn a_good_file_parses_with_defaults() {
        let f = parse("server.toml", GOOD).expect("parses");
        let g = f.github.expect("github");
        assert_eq!(g.api_url, "https://api.github.com");
        assert_eq!(g.approval_label, "run-gpu-ci");
        let p = &g.pools[0];
        assert_eq!(p.max_runners, 4);
        assert_eq!(p.forks, ForkPolicy::Deny);
        assert_eq!(p.queue_timeout.0.as_std(), std::time::Duration::from_secs(1200));
        assert_eq!(p.install_dir, "/opt/actions-runner");
        assert_eq!(p.runner_backoff.0.as_std(), std::time::Duration::from_secs(10));
        assert_eq!(g.webhook_max_bodies, 8);
        assert_eq!(g.webhook_read_timeout.0.as_std(), std::time::Duration::from_secs(30));
    }

    #[test]
    fn webhook_limits_must_let_a_delivery_through() {
        let with = |extra: &str| {
            GOOD.replacen("repositories = [\"octo/gpu\"]", &format!("repositories = [\"octo/gpu\"]\n{extra}"), 1)
        };
        let e = parse("server.toml", &with("webhook_max_bodies = 0")).expect_err("no room").to_string();
        assert!(e.starts_with("server.toml:2:1:") && e.contains("webhook_max_bodies must be at least 1"), "{e}");
        let e = parse("server.toml", &with("webhook_read_timeout = \"0s\"")).expect_err("no time").to_string();
        assert!(e.contains("webhook_read_timeout must be longer than 0s"), "{e}");
        let g = parse("server.toml", &with("webhook_max_bodies = 2\nwebhook_read_timeout = \"4s\"")).expect("parses");
        let g = g.github.expect("github");
        assert_eq!((g.webhook_max_bodies, g.webhook_read_timeout.0.as_std()), (2, std::time::Duration::from_secs(4)));
    }

    #[test]
    fn errors_name_file_line_column_and_field() {
        let bad = GOOD.replace("queue_timeout = \"20m\"", "queue_timeout = \"soon\"");
        let e = parse("server.toml", &bad).expect_err("bad duration").to_string();
        assert!(e.starts_with("server.toml:15:17:") && e.contains("a duration"), "{e}");

        let bad = GOOD.replace("gpus = 2", "gpu = 2");
        let e = parse("server.toml", &bad).expect_err("unknown key").to_string();
        assert!(e.starts_with("server.toml:12:1:") && e.contains("unknown field `gpu`"), "{e}");

        let bad = GOOD.replace("gpu_memory = \">=40GiB\"", "gpu_memory = \"lots\"");
        let e = parse("server.toml", &bad).expect_err("bad memory").to_string();
        assert!(e.contains("server.toml:13:") && e.contains("memory size"), "{e}");

        let bad = GOOD.replace("repositories = [\"octo/gpu\"]", "repositories = [\"octo\"]");
        let e = parse("server.toml", &bad).expect_err("bad repo").to_string();
        assert!(e.starts_with("server.toml:6:") && e.contains("owner/name"), "{e}");

        let bad = GOOD.replace("labels = [\"gpu\", \"h100\"]", "labels = []");
        let e = parse("server.toml", &bad).expect_err("no labels").to_string();
        assert!(e.starts_with("server.toml:8:1: github.pool[0] (h100): labels"), "{e}");

        let bad = GOOD.replace("app_id = 42\n", "");
        let e = parse("server.toml", &bad).expect_err("key without app id").to_string();
        assert!(e.contains("app_id"), "{e}");
    }

    #[test]
    fn missing_secret_is_named_not_shown() {
        let f = parse("server.toml", GOOD).expect("parses");
        let e = f.github.expect("github").resolve().expect_err("no env var").to_string();
        assert!(e.contains("GPUCI_TEST_NO_SUCH_SECRET is not set"), "{e}");
    }

    fn pool(labels: &[&str], repos: &[&str]) -> Pool {
        Pool {
            name: "p".into(),
            labels: labels.iter().map(|s| s.to_string()).collect(),
            repositories: repos.iter().map(|s| s.to_string()).collect(),
            org: None,
            runner_group_id: 1,
            gpu: GpuRequirements::default(),
            agents: BTreeMap::new(),
            max_runners: 1,
            forks: ForkPolicy::Deny,
            queue_timeout: std::time::Duration::from_secs(1),
            idle_timeout: std::time::Duration::from_secs(1),
            job_timeout: Duration::from_str("1h").unwrap_or_default(),
            install_dir: "/opt/actions-runner".into(),
            runner_backoff: std::time::Duration::from_secs(10),
        }
    }

    #[test]
    fn a_pool_must_serve_every_label_and_the_repository() {
        let l = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let pools = vec![pool(&["gpu", "h100"], &["octo/gpu"]), pool(&["gpu"], &["other/*"])];
        assert!(match_pool(&pools, "octo/gpu", &l(&["self-hosted", "GPU"])).is_ok());
        assert_eq!(match_pool(&pools, "octo/gpu", &l(&["self-hosted", "gpu", "a100"])).err(), Some(NoPool::Labels));
        assert_eq!(match_pool(&pools, "octo/gpu", &l(&["ubuntu-latest"])).err(), Some(NoPool::Labels));
        assert!(match_pool(&pools, "other/x", &l(&["gpu"])).is_ok());
        assert_eq!(match_pool(&pools, "third/x", &l(&["gpu"])).err(), Some(NoPool::Repository("p, p".into())));
        assert_eq!(pools[0].runner_labels(), l(&["self-hosted", "gpu", "h100"]));
    }
}
