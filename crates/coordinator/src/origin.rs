//! Where a pipeline came from, beyond its file, as stored with it: a GitHub push or pull
//! request, or an Actions runner job queued for a GitHub workflow job. The scheduler reads it
//! to decide what a job may have (secrets) and what placing it involves (registering a runner).

use gpuci_core::cache::CacheOrigin;
use gpuci_core::condition::{BuildEvent, BuildFacts};
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
    /// Pull requests: the branch it comes from (`build.branch` in conditions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_branch: Option<String>,
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
    /// What the builds list shows: the head commit's subject (a push) or the pull request's
    /// title, and its author. The author's own words: display only, never a fact a
    /// condition or a trust decision reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub author: Option<String>,
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

    /// What a GitHub build is, for steps' `if:`: its branch (a push's, or a pull request's
    /// head branch), its tag (a push of `refs/tags/…`; `""` for a branch push; unknown for a
    /// pull request), event and commit. Changed paths are not known from the webhook alone:
    /// unknown, so `changed(…)` never skips a step on GitHub yet.
    pub fn build_facts(&self) -> BuildFacts {
        let Origin::Github(g) = self else { return BuildFacts::default() };
        let event = match g.event.as_str() {
            "push" => Some(BuildEvent::Push),
            "pull_request" => Some(BuildEvent::PullRequest),
            _ => None,
        };
        let git_ref = g.git_ref.as_deref();
        let (branch, tag) = match (event, git_ref) {
            (Some(BuildEvent::Push), Some(r)) => match (r.strip_prefix("refs/heads/"), r.strip_prefix("refs/tags/")) {
                (Some(b), _) => (Some(b.to_string()), Some(String::new())),
                (_, Some(t)) => (None, Some(t.to_string())),
                _ => (None, None),
            },
            (Some(BuildEvent::PullRequest), _) => (g.head_branch.clone(), None),
            _ => (None, None),
        };
        BuildFacts {
            branch,
            tag,
            event,
            commit: Some(g.sha.clone()),
            changed: None,
            subject: g.subject.clone(),
            author: g.author.clone(),
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
            head_branch: None,
            base_branch: None,
            default_branch: Some("main".into()),
            trusted: true,
            approved_by: None,
            subject: None,
            author: None,
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

    #[test]
    fn build_facts_come_from_the_push_or_the_pull_request() {
        let push = |git_ref: &str| {
            Origin::Github(GithubOrigin {
                repository: "octo/gpu".into(),
                sha: "abc".into(),
                event: "push".into(),
                pr: None,
                secrets: true,
                git_ref: Some(git_ref.into()),
                head_branch: None,
                base_branch: None,
                default_branch: Some("main".into()),
                trusted: true,
                approved_by: Some("maintainer".into()),
                subject: Some("Speed up the kernel".into()),
                author: Some("ada".into()),
            })
        };
        let f = push("refs/heads/release/1.2").build_facts();
        assert_eq!(
            f,
            BuildFacts {
                branch: Some("release/1.2".into()),
                tag: Some(String::new()),
                event: Some(BuildEvent::Push),
                commit: Some("abc".into()),
                changed: None,
                subject: Some("Speed up the kernel".into()),
                author: Some("ada".into()),
            }
        );
        let f = push("refs/tags/v1.0").build_facts();
        assert_eq!((f.branch, f.tag), (None, Some("v1.0".into())));
        let Origin::Github(g) = push("refs/heads/x") else { unreachable!() };
        let pr = Origin::Github(GithubOrigin {
            event: "pull_request".into(),
            pr: Some(7),
            git_ref: None,
            head_branch: Some("fix".into()),
            ..g
        });
        let f = pr.build_facts();
        assert_eq!((f.branch.as_deref(), f.tag, f.event), (Some("fix"), None, Some(BuildEvent::PullRequest)));
    }
}
