//! Values the REST client takes and returns. Responses are read through private wire structs shaped
//! like GitHub's JSON and flattened into these, so callers never depend on GitHub's nesting.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

/// A repository, `owner/name`. Owner and name are kept apart so that paths are built from validated
/// parts rather than from a string that might hold a stray `/` or `..`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Repo {
    pub owner: String,
    pub name: String,
}

impl Repo {
    /// Parses `owner/name`. `None` unless both halves are non-empty and made of the characters GitHub
    /// allows in logins and repository names (ASCII letters, digits, `-`, `_`, `.`), and the name is not
    /// `.` or `..`.
    pub fn parse(full_name: &str) -> Option<Repo> {
        let (owner, name) = full_name.split_once('/')?;
        let valid = |s: &str| {
            !s.is_empty()
                && s != "."
                && s != ".."
                && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        (valid(owner) && valid(name)).then(|| Repo { owner: owner.to_owned(), name: name.to_owned() })
    }

    pub fn full_name(&self) -> String {
        format!("{}/{}", self.owner, self.name)
    }
}

impl fmt::Display for Repo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.owner, self.name)
    }
}

/// What the coordinator asks for when it registers a just-in-time runner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JitRunnerSpec {
    /// Unique per runner; GitHub refuses (409) a name already registered.
    pub name: String,
    pub runner_group_id: u64,
    /// At least one label (GitHub: 1..=100).
    pub labels: Vec<String>,
}

/// A registered JIT runner; `encoded_jit_config` is handed to `run.sh` in the
/// environment (`ACTIONS_RUNNER_INPUT_JITCONFIG`), never on its command line.
#[derive(Debug, Clone)]
pub struct JitConfig {
    pub runner_id: u64,
    pub runner_name: String,
    pub encoded_jit_config: crate::Secret,
}

/// A self-hosted runner registered on a repository.
#[derive(Clone, Debug, Deserialize)]
pub struct Runner {
    pub id: u64,
    pub name: String,
    /// `online` or `offline`.
    pub status: String,
    pub busy: bool,
    /// Label names; GitHub sends `[{id, name, type}]`.
    #[serde(deserialize_with = "label_names")]
    pub labels: Vec<String>,
}

fn label_names<'de, D: Deserializer<'de>>(de: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    struct Label {
        name: String,
    }
    Ok(Vec::<Label>::deserialize(de)?.into_iter().map(|l| l.name).collect())
}

/// A workflow run, reduced to what gpuci reconciles on.
#[derive(Clone, Debug)]
pub struct WorkflowRun {
    pub id: u64,
    pub head_sha: String,
    /// The triggering event: `push`, `pull_request`, …
    pub event: String,
    /// `queued`, `in_progress`, `completed`, … (GitHub documents it as nullable).
    pub status: Option<String>,
    /// Where the head commit lives; differs from `repository_full_name` for fork PRs, and is `None`
    /// when the head repository has been deleted.
    pub head_repository_full_name: Option<String>,
    pub repository_full_name: String,
}

/// A job of a workflow run.
#[derive(Clone, Debug)]
pub struct WorkflowJob {
    pub id: u64,
    pub run_id: u64,
    pub name: String,
    /// `queued`, `in_progress`, `completed`, `waiting`, …
    pub status: String,
    pub conclusion: Option<String>,
    /// The job's `runs-on` labels.
    pub labels: Vec<String>,
    pub runner_name: Option<String>,
    pub head_sha: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckStatus {
    Queued,
    InProgress,
    Completed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Conclusion {
    Success,
    Failure,
    Cancelled,
    TimedOut,
    Skipped,
    Neutral,
    ActionRequired,
}

#[derive(Clone, Debug, Serialize)]
pub struct CheckOutput {
    pub title: String,
    /// Markdown; GitHub caps it at 65535 characters.
    pub summary: String,
}

/// Body of "create a check run". A `conclusion` implies `status: completed` on GitHub's side.
#[derive(Clone, Debug, Serialize)]
pub struct NewCheckRun {
    pub name: String,
    pub head_sha: String,
    pub status: CheckStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conclusion: Option<Conclusion>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub external_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<CheckOutput>,
}

/// Body of "update a check run"; fields left `None` are not sent and so stay as they are.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CheckRunUpdate {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<CheckStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conclusion: Option<Conclusion>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<CheckOutput>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StatusState {
    Pending,
    Success,
    Failure,
    Error,
}

/// A commit status (the older API that works with a personal access token, unlike check runs).
#[derive(Clone, Debug, Serialize)]
pub struct CommitStatus {
    pub state: StatusState,
    pub context: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_url: Option<String>,
    /// GitHub rejects descriptions over 140 characters; the client truncates.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// A user's role on a repository.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permission {
    Admin,
    Maintain,
    Write,
    Triage,
    Read,
    None,
}

impl Permission {
    /// Whether the user may push, i.e. is trusted to run code on gpuci's machines.
    pub fn can_write(self) -> bool {
        matches!(self, Permission::Admin | Permission::Maintain | Permission::Write)
    }

    fn from_name(name: &str) -> Option<Permission> {
        Some(match name {
            "admin" => Permission::Admin,
            "maintain" => Permission::Maintain,
            "write" => Permission::Write,
            "triage" => Permission::Triage,
            "read" => Permission::Read,
            "none" => Permission::None,
            _ => return Option::None,
        })
    }

    /// `role_name` is the precise role (`maintain`, `triage` exist only there) but may be a custom
    /// role's name on GitHub Enterprise; `permission` is the legacy `admin`/`write`/`read`/`none`
    /// that such a custom role maps to. Anything unrecognised is treated as no access.
    pub(crate) fn from_response(role_name: Option<&str>, permission: Option<&str>) -> Permission {
        role_name
            .and_then(Permission::from_name)
            .or_else(|| permission.and_then(Permission::from_name))
            .unwrap_or(Permission::None)
    }
}

/// GitHub's JSON shapes, reduced to what the public types need.
pub(crate) mod wire {
    use serde::Deserialize;
    use time::OffsetDateTime;

    use super::Runner;

    #[derive(Deserialize)]
    pub struct InstallationToken {
        pub token: String,
        #[serde(with = "time::serde::rfc3339")]
        pub expires_at: OffsetDateTime,
    }

    #[derive(Deserialize)]
    pub struct JitConfigResponse {
        pub runner: JitRunner,
        pub encoded_jit_config: String,
    }

    #[derive(Deserialize)]
    pub struct JitRunner {
        pub id: u64,
        pub name: String,
    }

    #[derive(Deserialize)]
    pub struct Installation {
        pub id: u64,
        /// Nullable in GitHub's description (an installation on a deleted account).
        pub account: Option<Account>,
    }

    #[derive(Deserialize)]
    pub struct Account {
        /// Users and organisations have `login`; enterprises have `slug` instead.
        pub login: Option<String>,
    }

    #[derive(Deserialize)]
    pub struct RunnerPage {
        pub runners: Vec<Runner>,
    }

    #[derive(Deserialize)]
    pub struct RunPage {
        pub workflow_runs: Vec<WorkflowRun>,
    }

    #[derive(Deserialize)]
    pub struct WorkflowRun {
        pub id: u64,
        pub head_sha: String,
        pub event: String,
        pub status: Option<String>,
        pub head_repository: Option<RepoRef>,
        pub repository: RepoRef,
    }

    #[derive(Deserialize)]
    pub struct RepoRef {
        pub full_name: String,
    }

    impl From<WorkflowRun> for super::WorkflowRun {
        fn from(r: WorkflowRun) -> Self {
            Self {
                id: r.id,
                head_sha: r.head_sha,
                event: r.event,
                status: r.status,
                head_repository_full_name: r.head_repository.map(|h| h.full_name),
                repository_full_name: r.repository.full_name,
            }
        }
    }

    #[derive(Deserialize)]
    pub struct JobPage {
        pub jobs: Vec<WorkflowJob>,
    }

    #[derive(Deserialize)]
    pub struct WorkflowJob {
        pub id: u64,
        pub run_id: u64,
        pub name: String,
        pub status: String,
        pub conclusion: Option<String>,
        pub labels: Vec<String>,
        pub runner_name: Option<String>,
        pub head_sha: String,
    }

    impl From<WorkflowJob> for super::WorkflowJob {
        fn from(j: WorkflowJob) -> Self {
            Self {
                id: j.id,
                run_id: j.run_id,
                name: j.name,
                status: j.status,
                conclusion: j.conclusion,
                labels: j.labels,
                runner_name: j.runner_name,
                head_sha: j.head_sha,
            }
        }
    }

    #[derive(Deserialize)]
    pub struct CheckRun {
        pub id: u64,
    }

    #[derive(Deserialize)]
    pub struct CollaboratorPermission {
        pub permission: Option<String>,
        pub role_name: Option<String>,
    }

    /// `contents/{path}` answers an object for a file or symlink and an array for a directory; only
    /// files carry `content`.
    #[derive(Deserialize)]
    #[serde(untagged)]
    pub enum Contents {
        Entry(ContentEntry),
        Directory(Vec<serde::de::IgnoredAny>),
    }

    #[derive(Deserialize)]
    pub struct ContentEntry {
        #[serde(rename = "type")]
        pub kind: String,
        pub content: Option<String>,
        pub encoding: Option<String>,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_parse_accepts_github_names_only() {
        let repo = Repo::parse("gpu-lab/kernels.rs").expect("valid");
        assert_eq!((repo.owner.as_str(), repo.name.as_str()), ("gpu-lab", "kernels.rs"));
        assert_eq!(repo.full_name(), "gpu-lab/kernels.rs");
        for bad in ["", "a", "a/", "/b", "a/b/c", "a/..", "a b/c", "a/b?x", "a/b%2F"] {
            assert_eq!(Repo::parse(bad), Option::None, "{bad:?}");
        }
    }

    #[test]
    fn permission_prefers_role_name_and_falls_back_to_permission() {
        assert_eq!(Permission::from_response(Some("maintain"), Some("write")), Permission::Maintain);
        assert_eq!(Permission::from_response(Some("triage"), Some("read")), Permission::Triage);
        // A custom Enterprise role: its name says nothing, the legacy permission does.
        assert_eq!(Permission::from_response(Some("gpu-operators"), Some("write")), Permission::Write);
        assert_eq!(Permission::from_response(Option::None, Some("admin")), Permission::Admin);
        assert_eq!(Permission::from_response(Option::None, Option::None), Permission::None);
        assert_eq!(Permission::from_response(Some("owner?"), Some("superuser")), Permission::None);
        let writers: Vec<_> = [
            Permission::Admin,
            Permission::Maintain,
            Permission::Write,
            Permission::Triage,
            Permission::Read,
            Permission::None,
        ]
        .into_iter()
        .filter(|p| p.can_write())
        .collect();
        assert_eq!(writers, [Permission::Admin, Permission::Maintain, Permission::Write]);
    }

    #[test]
    fn bodies_skip_unset_fields() {
        let update = CheckRunUpdate { conclusion: Some(Conclusion::TimedOut), ..Default::default() };
        assert_eq!(serde_json::to_value(&update).expect("json"), serde_json::json!({ "conclusion": "timed_out" }));
        let status = CommitStatus {
            state: StatusState::Pending,
            context: "gpuci".into(),
            target_url: Option::None,
            description: Option::None,
        };
        assert_eq!(
            serde_json::to_value(&status).expect("json"),
            serde_json::json!({ "state": "pending", "context": "gpuci" })
        );
    }
}
