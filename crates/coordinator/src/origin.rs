//! Where a pipeline came from, beyond its file, as stored with it: a GitHub push or pull
//! request, or an Actions runner job queued for a GitHub workflow job. The scheduler reads it
//! to decide what a job may have (secrets) and what placing it involves (registering a runner).

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Origin {
    /// One ephemeral GitHub Actions runner on the leased GPUs.
    ActionsRunner(RunnerOrigin),
    /// A repository's `.gpuci.yml` run for a push or a pull request.
    Github(GithubOrigin),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerOrigin {
    pub pool: String,
    /// `owner/name` of the workflow job's repository.
    pub repository: String,
    /// Register at the organisation level instead of the repository.
    pub org: Option<String>,
    pub labels: Vec<String>,
    pub runner_group_id: u64,
    /// The runner's install directory on the agent's host.
    pub install_dir: String,
    /// The workflow job that caused it (a runner may end up running another of the same labels).
    pub github_job_id: i64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GithubOrigin {
    pub repository: String,
    pub sha: String,
    /// `push` or `pull_request`.
    pub event: String,
    pub pr: Option<u64>,
    /// Whether the steps may have the secrets they name. False for pull requests from forks.
    pub secrets: bool,
}

impl Origin {
    pub fn parse(json: Option<&str>) -> Option<Origin> {
        let json = json?;
        match serde_json::from_str(json) {
            Ok(o) => Some(o),
            Err(e) => {
                tracing::error!(error = %e, "unreadable pipeline origin");
                None
            }
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}
