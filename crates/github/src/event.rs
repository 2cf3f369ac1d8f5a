//! Typed webhook events: only the fields gpuci acts on, validated once at the edge.
//!
//! Payloads are read through private wire structs that mirror GitHub's nesting and then flattened into
//! the public types, so callers never depend on GitHub's JSON shape. Unknown fields are ignored
//! (GitHub adds fields often); unknown `action` values map to an `Other` variant rather than an error,
//! so a new action GitHub introduces is ignored instead of being answered with 400.

use serde::Deserialize;

use crate::webhook::WebhookError;

/// A verified, parsed webhook delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Sent once when the webhook is created.
    Ping,
    WorkflowJob(WorkflowJobEvent),
    PullRequest(PullRequestEvent),
    Push(PushEvent),
    /// An event gpuci does not handle (answered with 202).
    Ignored {
        name: String,
    },
}

/// Identifies a repository: `owner/name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repository {
    pub full_name: String,
    pub owner: String,
    pub name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkflowJobAction {
    Queued,
    InProgress,
    Completed,
    Waiting,
    #[serde(other)]
    Other,
}

/// A `workflow_job` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkflowJobEvent {
    pub action: WorkflowJobAction,
    pub job_id: u64,
    pub run_id: u64,
    pub job_name: Option<String>,
    /// The job's `runs-on` labels.
    pub labels: Vec<String>,
    /// The runner that took the job. `None` while queued: real queued deliveries carry nulls here.
    pub runner_id: Option<u64>,
    pub runner_name: Option<String>,
    pub head_sha: String,
    /// `success`, `failure`, `cancelled`, … on `completed`; `None` otherwise.
    pub conclusion: Option<String>,
    pub repository: Repository,
    /// Present when the webhook comes from a GitHub App installation.
    pub installation_id: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PullRequestAction {
    Opened,
    Synchronize,
    Reopened,
    Labeled,
    Closed,
    #[serde(other)]
    Other,
}

/// How the PR author relates to the base repository, as GitHub reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AuthorAssociation {
    Owner,
    Member,
    Collaborator,
    Contributor,
    FirstTimeContributor,
    FirstTimer,
    Mannequin,
    None,
    #[serde(other)]
    Other,
}

/// A `pull_request` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullRequestEvent {
    pub action: PullRequestAction,
    pub number: u64,
    pub head_sha: String,
    /// The branch the pull request comes from (`fix-kernel`), in its head repository.
    pub head_ref: Option<String>,
    /// `None` when the head repository has been deleted.
    pub head_repo_full_name: Option<String>,
    pub base_repository: Repository,
    pub author_association: AuthorAssociation,
    /// The label added, on `labeled`.
    pub label: Option<String>,
    /// The head branch lives in another repository than the base (or that repository is gone).
    /// This, not GitHub's `fork` flag, is what matters: a PR inside a fork from its own branch has
    /// `fork: true` on both sides but runs no outside code.
    pub from_fork: bool,
    pub installation_id: Option<u64>,
    /// Who caused the event (on `labeled`: who added the label).
    pub sender: Option<String>,
    /// The branch the pull request merges into (`main`).
    pub base_ref: Option<String>,
    /// The base repository's default branch (`main`).
    pub default_branch: Option<String>,
    /// The pull request's title (shown in builds lists; the author's words, display only).
    pub title: Option<String>,
    /// Who opened the pull request (login).
    pub author: Option<String>,
}

/// A `push` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushEvent {
    /// Full ref, e.g. `refs/heads/main`.
    pub git_ref: String,
    /// The commit the ref points to after the push (all zeros when the ref was deleted).
    pub after: String,
    pub deleted: bool,
    pub repository: Repository,
    pub installation_id: Option<u64>,
    /// The repository's default branch (`main`).
    pub default_branch: Option<String>,
    /// The first line of the pushed head commit's message (display only).
    pub subject: Option<String>,
    /// The head commit's author (GitHub login when GitHub knows it, else the name in the
    /// commit), or else who pushed.
    pub author: Option<String>,
}

/// Parses a delivery whose signature has already been verified.
///
/// `event_name` is the `X-GitHub-Event` header; `delivery_id` (`X-GitHub-Delivery`) is only used to
/// name the delivery in errors.
pub fn parse_event(event_name: &str, delivery_id: &str, body: &[u8]) -> Result<Event, WebhookError> {
    Ok(match event_name {
        "ping" => Event::Ping,
        "workflow_job" => {
            let w: wire::WorkflowJobPayload = decode(event_name, delivery_id, body)?;
            Event::WorkflowJob(WorkflowJobEvent {
                action: w.action,
                job_id: w.workflow_job.id,
                run_id: w.workflow_job.run_id,
                job_name: w.workflow_job.name,
                labels: w.workflow_job.labels,
                runner_id: w.workflow_job.runner_id,
                runner_name: w.workflow_job.runner_name,
                head_sha: w.workflow_job.head_sha,
                conclusion: w.workflow_job.conclusion,
                repository: w.repository.into(),
                installation_id: w.installation.map(|i| i.id),
            })
        }
        "pull_request" => {
            let p: wire::PullRequestPayload = decode(event_name, delivery_id, body)?;
            let default_branch = p.pull_request.base.repo.default_branch.clone();
            let base_ref = p.pull_request.base.git_ref;
            let base_repository: Repository = p.pull_request.base.repo.into();
            let head_repo_full_name = p.pull_request.head.repo.map(|r| r.full_name);
            let from_fork = head_repo_full_name.as_deref() != Some(base_repository.full_name.as_str());
            Event::PullRequest(PullRequestEvent {
                action: p.action,
                number: p.number,
                head_sha: p.pull_request.head.sha,
                head_ref: p.pull_request.head.git_ref,
                head_repo_full_name,
                base_repository,
                author_association: p.pull_request.author_association,
                label: p.label.map(|l| l.name),
                sender: p.sender.map(|s| s.login),
                from_fork,
                installation_id: p.installation.map(|i| i.id),
                base_ref,
                default_branch,
                title: p.pull_request.title,
                author: p.pull_request.user.map(|u| u.login),
            })
        }
        "push" => {
            let p: wire::PushPayload = decode(event_name, delivery_id, body)?;
            let subject = p.head_commit.as_ref().and_then(|c| c.message.lines().next()).map(str::to_owned);
            let author = p
                .head_commit
                .and_then(|c| c.author)
                .and_then(|a| a.username.or(a.name))
                .or_else(|| p.pusher.and_then(|u| u.name))
                .or_else(|| p.sender.map(|s| s.login));
            Event::Push(PushEvent {
                subject,
                author,
                git_ref: p.git_ref,
                after: p.after,
                deleted: p.deleted,
                default_branch: p.repository.default_branch.clone(),
                repository: p.repository.into(),
                installation_id: p.installation.map(|i| i.id),
            })
        }
        other => Event::Ignored { name: other.to_owned() },
    })
}

fn decode<T: serde::de::DeserializeOwned>(event: &str, delivery_id: &str, body: &[u8]) -> Result<T, WebhookError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| WebhookError::InvalidPayload {
        event: event.to_owned(),
        delivery_id: delivery_id.to_owned(),
        path: e.path().to_string(),
        message: e.into_inner().to_string(),
    })
}

/// GitHub's JSON shapes, reduced to what the public types need.
mod wire {
    use serde::Deserialize;

    use super::{AuthorAssociation, PullRequestAction, WorkflowJobAction};

    #[derive(Deserialize)]
    pub struct Installation {
        pub id: u64,
    }

    #[derive(Deserialize)]
    pub struct Owner {
        pub login: String,
    }

    #[derive(Deserialize)]
    pub struct Repository {
        pub full_name: String,
        pub name: String,
        pub owner: Owner,
        #[serde(default)]
        pub default_branch: Option<String>,
    }

    impl From<Repository> for super::Repository {
        fn from(r: Repository) -> Self {
            Self { full_name: r.full_name, owner: r.owner.login, name: r.name }
        }
    }

    #[derive(Deserialize)]
    pub struct WorkflowJobPayload {
        pub action: WorkflowJobAction,
        pub workflow_job: WorkflowJob,
        pub repository: Repository,
        pub installation: Option<Installation>,
    }

    #[derive(Deserialize)]
    pub struct WorkflowJob {
        pub id: u64,
        pub run_id: u64,
        pub name: Option<String>,
        pub labels: Vec<String>,
        pub runner_id: Option<u64>,
        pub runner_name: Option<String>,
        pub head_sha: String,
        pub conclusion: Option<String>,
    }

    #[derive(Deserialize)]
    pub struct PullRequestPayload {
        pub action: PullRequestAction,
        pub number: u64,
        pub pull_request: PullRequest,
        pub label: Option<Label>,
        #[serde(default)]
        pub sender: Option<Owner>,
        pub installation: Option<Installation>,
    }

    #[derive(Deserialize)]
    pub struct PullRequest {
        pub head: Head,
        pub base: Base,
        pub author_association: AuthorAssociation,
        #[serde(default)]
        pub title: Option<String>,
        #[serde(default)]
        pub user: Option<Owner>,
    }

    #[derive(Deserialize)]
    pub struct Head {
        pub sha: String,
        #[serde(default, rename = "ref")]
        pub git_ref: Option<String>,
        pub repo: Option<HeadRepo>,
    }

    #[derive(Deserialize)]
    pub struct HeadRepo {
        pub full_name: String,
    }

    #[derive(Deserialize)]
    pub struct Base {
        pub repo: Repository,
        #[serde(default, rename = "ref")]
        pub git_ref: Option<String>,
    }

    #[derive(Deserialize)]
    pub struct Label {
        pub name: String,
    }

    #[derive(Deserialize)]
    pub struct PushPayload {
        #[serde(rename = "ref")]
        pub git_ref: String,
        pub after: String,
        #[serde(default)]
        pub deleted: bool,
        pub repository: Repository,
        pub installation: Option<Installation>,
        /// `null` when the push deleted the ref.
        #[serde(default)]
        pub head_commit: Option<HeadCommit>,
        #[serde(default)]
        pub pusher: Option<Pusher>,
        #[serde(default)]
        pub sender: Option<Owner>,
    }

    #[derive(Deserialize)]
    pub struct HeadCommit {
        #[serde(default)]
        pub message: String,
        #[serde(default)]
        pub author: Option<CommitAuthor>,
    }

    #[derive(Deserialize)]
    pub struct CommitAuthor {
        #[serde(default)]
        pub name: Option<String>,
        /// Present when the commit's e-mail belongs to a GitHub account.
        #[serde(default)]
        pub username: Option<String>,
    }

    #[derive(Deserialize)]
    pub struct Pusher {
        #[serde(default)]
        pub name: Option<String>,
    }
}
