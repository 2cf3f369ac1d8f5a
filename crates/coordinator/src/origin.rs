//! Where a pipeline came from, beyond its file, as stored with it: a GitHub push or pull
//! request, or an Actions runner job queued for a GitHub workflow job. The scheduler reads it
//! to decide what a job may have (secrets) and what placing it involves (registering a runner).

use gpuci_core::cache::CacheOrigin;
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
    /// Pushes: the full ref pushed (`refs/heads/main`). Caches are kept per ref.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git_ref: Option<String>,
    /// Pull requests: the branch it merges into; it may read that branch's cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_branch: Option<String>,
    /// The repository's default branch: every push and pull request may read its cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_branch: Option<String>,
    /// Pull requests: from a branch of the repository itself, by an owner, member or
    /// collaborator. Its caches are trusted; any other pull request's are not, approved or
    /// not. Records written before this field read as untrusted.
    #[serde(default)]
    pub trusted: bool,
    /// Pull requests that ran on a maintainer's approval (of this head SHA): who approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_by: Option<String>,
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

    /// What caches care about, for a pipeline whose stored origin is `json` (`None`: submitted
    /// through the API). An origin that cannot be read gets `None`: no cache at all, rather
    /// than a guess at its trust.
    pub fn cache_origin(json: Option<&str>) -> Option<CacheOrigin> {
        let Some(json) = json else { return Some(CacheOrigin::Direct) };
        Some(match Origin::parse(Some(json))? {
            Origin::ActionsRunner(_) => CacheOrigin::ActionsRunner,
            Origin::Github(g) if g.event == "push" => {
                CacheOrigin::Push { git_ref: g.git_ref, default_branch: g.default_branch }
            }
            Origin::Github(g) => match g.pr {
                Some(number) => CacheOrigin::PullRequest {
                    number,
                    base_branch: g.base_branch,
                    default_branch: g.default_branch,
                    trusted: g.trusted,
                },
                // Neither a push nor a pull request: nothing says whom to trust.
                None => return None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_origins_come_from_the_stored_origin() {
        assert_eq!(Origin::cache_origin(None), Some(CacheOrigin::Direct), "submitted through the API");
        let push = Origin::Github(GithubOrigin {
            repository: "octo/gpu".into(),
            sha: "1".repeat(40),
            event: "push".into(),
            pr: None,
            secrets: true,
            git_ref: Some("refs/heads/dev".into()),
            base_branch: None,
            default_branch: Some("main".into()),
            trusted: true,
            approved_by: None,
        });
        assert_eq!(
            Origin::cache_origin(Some(&push.to_json())),
            Some(CacheOrigin::Push { git_ref: Some("refs/heads/dev".into()), default_branch: Some("main".into()) })
        );
        assert_eq!(Origin::cache_origin(Some("{not json")), None, "unreadable: no cache, not a guess");
    }

    #[test]
    fn pull_requests_recorded_before_trust_was_stored_read_as_untrusted() {
        let old =
            r#"{"kind":"github","repository":"octo/gpu","sha":"abc","event":"pull_request","pr":4,"secrets":true}"#;
        assert_eq!(
            Origin::cache_origin(Some(old)),
            Some(CacheOrigin::PullRequest { number: 4, base_branch: None, default_branch: None, trusted: false })
        );
    }
}
