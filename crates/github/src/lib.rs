//! gpuci-github: the edge between gpuci and GitHub.
//!
//! What it is for:
//! - [`webhook`]: verifying `X-Hub-Signature-256` over the raw body and turning the handful of webhook
//!   events gpuci reacts to into typed values ([`Event`]), so nothing deeper sees raw JSON;
//! - [`auth`]: GitHub App authentication (app JWT, RS256) with secrets that never print;
//! - [`client`]: a small REST client for the operations gpuci needs (installation tokens, JIT runners,
//!   workflow runs and jobs, check runs and statuses, labels, permissions, contents and tarballs), with
//!   a configurable base URL for GitHub Enterprise Server and for tests; [`types`] holds its values;
//! - [`ratelimit`]: GitHub's rate limits as the client obeys them (one "not before" per client).
//!
//! What it must not do: make scheduling or policy decisions (which pool serves a job, whether a PR is
//! approved, when to cancel), or touch the store. It reports what GitHub said; the coordinator decides.

pub mod auth;
pub mod client;
pub mod event;
pub mod ratelimit;
pub mod types;
pub mod webhook;

pub use auth::{AppCredentials, AuthError, Secret};
pub use client::{retry_pause, ApiError, Client, Credentials, RateLimit, RetryPolicy};
pub use event::{
    parse_event, AuthorAssociation, Event, PullRequestAction, PullRequestEvent, PushEvent, Repository,
    WorkflowJobAction, WorkflowJobEvent,
};
pub use types::{
    CheckOutput, CheckRunUpdate, CheckStatus, CommitStatus, Conclusion, JitConfig, JitRunnerSpec, NewCheckRun,
    Permission, Repo, Runner, StatusState, WorkflowJob, WorkflowRun,
};
pub use webhook::{signature_digest, verify_signature, WebhookError, SIGNATURE_HEADER};
