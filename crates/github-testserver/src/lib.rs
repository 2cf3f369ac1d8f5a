//! gpuci-github-testserver: an in-memory stand-in for the GitHub REST API and webhook sender, for
//! gpuci's integration tests only.
//!
//! What it is for: a test starts [`TestGitHub`] on `127.0.0.1:0`, points gpuci's `api_url` and
//! webhook receiver at it and drives scenarios — workflow jobs queued (with or without the webhook),
//! pull requests opened, labelled and pushed to, pushes — then asserts on what gpuci did: runners
//! registered and deleted, runs cancelled, check runs and statuses reported, labels removed. Every
//! API request and every response it sends is checked against GitHub's published description
//! (`shared/reference/github/github-openapi-gpuci-subset.json`) and the problems are collected in
//! [`TestGitHub::validation_errors`]. [`install_fake_runner`] writes a runner stand-in that takes
//! and runs queued jobs through the server; [`install_runner_that_exits`] one that exits at once.
//!
//! GitHub's bad moments on demand: [`TestGitHub::inject`] answers chosen requests with a 5xx, a
//! secondary rate limit (`retry-after`) or an exhausted rate limit; installation tokens can be
//! revoked or expired early (401 `Bad credentials`). Every API answer carries GitHub's
//! `x-ratelimit-*` headers, counted per credential.
//!
//! What it must not do: run in production or be reachable beyond loopback (it binds `127.0.0.1` only
//! and has no real security: tokens are guessable, the runner protocol is unauthenticated); talk to
//! the real GitHub; or panic inside the server on bad input — a wrong request becomes a GitHub-shaped
//! error answer plus a validation message, so a test sees every problem rather than a hung
//! connection. It models only the operations gpuci uses, not GitHub's semantics at large.

mod api;
mod hooks;
mod runner;
mod spec;
mod state;
mod tarball;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Once};

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use crate::hooks::{lock, Outgoing};
use crate::state::{now, Job, Pull, Repo, Run, State};

pub use crate::hooks::sign as sign_webhook;
pub use crate::runner::{install_fake_runner, install_runner_that_exits};

/// How a [`TestGitHub`] behaves.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where webhooks go (gpuci's receiver); `None` until [`TestGitHub::set_webhook_url`].
    pub webhook_url: Option<String>,
    /// The secret webhooks are signed with.
    pub webhook_secret: String,
    /// The GitHub App id that App JWTs must carry as `iss`.
    pub app_id: u64,
    /// When set, App JWTs must verify with this RSA public key (PEM); otherwise only their shape,
    /// algorithm (RS256), issuer and lifetime are checked.
    pub app_public_key_pem: Option<String>,
    /// A token accepted on every repository and organization endpoint, as a PAT would be.
    pub personal_token: Option<String>,
    /// The reference description: the JSON file, its directory, or a `shared/` directory holding
    /// `reference/github/`. `None`: `shared/` beside the workspace root.
    pub reference: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            webhook_url: None,
            webhook_secret: "test-webhook-secret".into(),
            app_id: 1,
            app_public_key_pem: None,
            personal_token: None,
            reference: None,
        }
    }
}

/// What [`TestGitHub::queue_workflow_job`] created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedJob {
    pub run_id: u64,
    pub job_id: u64,
    /// The `X-GitHub-Delivery` of the `workflow_job.queued` webhook (stored even when not sent, so
    /// [`TestGitHub::redeliver`] can send it late).
    pub delivery: String,
    /// HTTP status of the webhook POST; 0 if it was not sent or did not connect.
    pub status: u16,
    /// The commit the run is for.
    pub head_sha: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobView {
    /// `queued`, `in_progress` or `completed`.
    pub status: String,
    pub conclusion: Option<String>,
    pub runner_name: Option<String>,
    pub run_id: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerView {
    pub id: u64,
    pub name: String,
    pub labels: Vec<String>,
    pub runner_group_id: u64,
    /// `owner/name` for a repository runner, the organization for an organization runner.
    pub repo: String,
    pub deleted: bool,
    pub jobs_taken: u32,
    /// Wall-clock time of the runner's first `/_test/runners/{id}/acquire` call: its process was
    /// running and made its first request to "GitHub". `None` until then. For latency measurements
    /// against gpuci's own wall-clock timestamps (same host).
    pub first_acquire_at: Option<std::time::SystemTime>,
}

/// One API request the server answered (the fake runner's `/_test/` calls are not recorded).
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    /// The raw query string, without `?`.
    pub query: String,
    /// The JSON body; `Null` when empty, a string when not JSON.
    pub body: Value,
    pub status: u16,
    /// When it arrived.
    pub at: std::time::SystemTime,
    /// When it arrived by tokio's clock, which a test may pause and advance (`start_paused`):
    /// waits of minutes are then checked without waiting minutes.
    pub instant: tokio::time::Instant,
}

/// An answer the server gives instead of the real one, to see how gpuci copes with GitHub
/// having a bad moment. It is recorded and validated like any answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// Only requests with this method (`GET`, `POST`, ...); `None`: any.
    pub method: Option<String>,
    /// Only requests whose path, with `?` and the query after it, contains this.
    pub path_contains: String,
    pub kind: FaultKind,
    /// How many requests get it; `None`: every one until [`TestGitHub::clear_faults`].
    pub times: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultKind {
    /// This status (a 5xx; or 401, as for a token GitHub refuses), with GitHub's error body.
    Status(u16),
    /// GitHub's secondary rate limit: 403 with `retry-after` (seconds).
    SecondaryRateLimit { retry_after: u64 },
    /// 429 with `retry-after` (seconds).
    TooManyRequests { retry_after: u64 },
    /// A secondary rate limit that says nothing of when it ends: 403 with GitHub's secondary
    /// rate limit message and no `retry-after` (GitHub: then wait at least a minute).
    SecondaryRateLimitNoHint,
    /// The primary rate limit used up: 403, `x-ratelimit-remaining: 0`, reset in this many seconds.
    RateLimitExhausted { reset_in: u64 },
}

impl Fault {
    /// `kind` for every `method` request whose path (and `?query`) contains `path_contains`, until
    /// cleared.
    pub fn new(method: &str, path_contains: &str, kind: FaultKind) -> Fault {
        Fault { method: Some(method.to_owned()), path_contains: path_contains.to_owned(), kind, times: None }
    }

    /// Only for the next `n` matching requests.
    pub fn times(mut self, n: u32) -> Fault {
        self.times = Some(n.max(1));
        self
    }

    pub(crate) fn matches(&self, method: &str, path_and_query: &str) -> bool {
        self.method.as_deref().is_none_or(|m| m.eq_ignore_ascii_case(method))
            && path_and_query.contains(&self.path_contains)
    }
}

/// A running test server. Dropping it stops the server and the webhook sender.
pub struct TestGitHub {
    /// `http://127.0.0.1:PORT`, no trailing slash.
    pub url: String,
    inner: Arc<api::Inner>,
    server: tokio::task::JoinHandle<()>,
    sender: tokio::task::JoinHandle<()>,
}

impl Drop for TestGitHub {
    fn drop(&mut self) {
        self.server.abort();
        self.sender.abort();
    }
}

static MISSING_REFERENCE: Once = Once::new();

impl TestGitHub {
    /// Starts the server on `127.0.0.1:0`.
    ///
    /// # Panics
    /// If the port cannot be bound or `app_public_key_pem` is not an RSA public key: test set-up bugs.
    pub async fn start(opts: Options) -> TestGitHub {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
        let url = format!("http://{}", listener.local_addr().expect("local address"));
        let state = Arc::new(Mutex::new(State::new(url.clone(), opts.webhook_url.clone())));

        let reference = spec::locate(&opts.reference.clone().unwrap_or_else(spec::default_reference));
        let spec = if reference.is_file() {
            match spec::Spec::load(&reference) {
                Ok(s) => Some(s),
                Err(e) => {
                    lock(&state).validation_errors.push(format!("reference description unusable: {e}"));
                    None
                }
            }
        } else {
            MISSING_REFERENCE.call_once(|| {
                eprintln!(
                    "gpuci-github-testserver: {} not found; request and response validation is off",
                    reference.display()
                );
            });
            None
        };
        let app_key = opts.app_public_key_pem.as_deref().map(|pem| {
            jsonwebtoken::DecodingKey::from_rsa_pem(pem.as_bytes()).expect("app_public_key_pem is an RSA public key")
        });

        let (tx, rx) = mpsc::unbounded_channel();
        let sender = tokio::spawn(hooks::deliver_loop(state.clone(), opts.webhook_secret.clone(), rx));
        let inner = Arc::new(api::Inner {
            state,
            spec,
            app_id: opts.app_id,
            app_key,
            personal_token: opts.personal_token.clone(),
            hooks: tx,
            base_url: url.clone(),
        });
        let router = axum::Router::new().fallback(api::handle).with_state(inner.clone());
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, router).await {
                eprintln!("gpuci-github-testserver: server stopped: {e}");
            }
        });
        TestGitHub { url, inner, server, sender }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.inner.state)
    }

    pub fn set_webhook_url(&self, url: &str) {
        self.state().webhook_url = Some(url.to_owned());
    }

    /// Registers `owner/name` as installed in App installation `installation_id`.
    pub fn add_repo(&self, full_name: &str, installation_id: u64) {
        let (owner, name) = full_name.split_once('/').expect("repository name is owner/name");
        let mut st = self.state();
        st.ids.repo += 1;
        let id = st.ids.repo;
        st.repos.insert(
            full_name.to_ascii_lowercase(),
            Repo {
                id,
                owner: owner.to_owned(),
                name: name.to_owned(),
                installation_id,
                collaborators: Default::default(),
                trees: Default::default(),
                tree_order: Vec::new(),
                branches: Default::default(),
                pulls: BTreeMap::new(),
            },
        );
    }

    /// `permission`: `admin`, `maintain`, `write`, `triage` or `read`.
    pub fn add_collaborator(&self, repo: &str, login: &str, permission: &str) {
        let mut st = self.state();
        let r = st.repo_mut(repo).unwrap_or_else(|| panic!("add_repo({repo:?}) first"));
        r.collaborators.insert(login.to_owned(), permission.to_owned());
    }

    /// The files of commit `sha`, served by the contents and tarball endpoints.
    pub fn set_tree(&self, repo: &str, sha: &str, files: &[(&str, &str)]) {
        let mut st = self.state();
        let r = st.repo_mut(repo).unwrap_or_else(|| panic!("add_repo({repo:?}) first"));
        r.trees.insert(sha.to_owned(), files.iter().map(|(p, c)| ((*p).to_owned(), (*c).to_owned())).collect());
        r.tree_order.retain(|s| s != sha);
        r.tree_order.push(sha.to_owned());
    }

    /// Creates a workflow run with one queued job carrying these `runs-on` labels; `script` is what a
    /// runner runs for it (bash). The run's commit is `main`'s head if [`Self::push`] set one, else
    /// the newest [`Self::set_tree`] sha. `send_webhook = false` simulates a webhook gpuci missed.
    pub async fn queue_workflow_job(&self, repo: &str, labels: &[&str], script: &str, send_webhook: bool) -> QueuedJob {
        let (queued, body) = {
            let mut st = self.state();
            st.ids.run += 1;
            st.ids.job += 1;
            let (run_id, job_id) = (st.ids.run, st.ids.job);
            let r = st.repo(repo).unwrap_or_else(|| panic!("add_repo({repo:?}) first"));
            let full = r.full_name();
            let head_sha = r.head_sha(run_id);
            let run_number = st.runs.values().filter(|x| x.repo.eq_ignore_ascii_case(&full)).count() as u64 + 1;
            let t = now();
            st.runs.insert(
                run_id,
                Run {
                    id: run_id,
                    repo: full.clone(),
                    run_number,
                    head_sha: head_sha.clone(),
                    head_branch: "main".into(),
                    event: "push".into(),
                    created_at: t,
                    updated_at: t,
                    cancelled: false,
                },
            );
            let job = Job {
                id: job_id,
                run_id,
                repo: full,
                name: "test".into(),
                labels: labels.iter().map(|l| (*l).to_owned()).collect(),
                script: script.to_owned(),
                status: "queued".into(),
                conclusion: None,
                runner_id: None,
                runner_name: None,
                runner_group_id: None,
                created_at: t,
                started_at: None,
                completed_at: None,
            };
            let payload = hooks::workflow_job_payload(&mut st, &job, "queued");
            st.jobs.insert(job_id, job);
            let (delivery, body) = hooks::record(&mut st, "workflow_job", &payload);
            (QueuedJob { run_id, job_id, delivery, status: 0, head_sha }, body)
        };
        let status = if send_webhook {
            self.send(Outgoing {
                event: "workflow_job".into(),
                delivery: queued.delivery.clone(),
                body,
                signature: None,
                reply: None,
            })
            .await
            .0
        } else {
            0
        };
        QueuedJob { status, ..queued }
    }

    async fn send(&self, mut out: Outgoing) -> (u16, String) {
        let (tx, rx) = oneshot::channel();
        out.reply = Some(tx);
        if self.inner.hooks.send(out).is_err() {
            return (0, "webhook sender stopped".into());
        }
        rx.await.unwrap_or((0, "webhook sender stopped".into()))
    }

    /// Sends a stored delivery again: same body, same `X-GitHub-Delivery`. 0 if unknown.
    pub async fn redeliver(&self, delivery: &str) -> u16 {
        let stored = self.state().deliveries.get(delivery).map(|d| (d.event.clone(), d.body.clone()));
        let Some((event, body)) = stored else { return 0 };
        self.send(Outgoing { event, delivery: delivery.to_owned(), body, signature: None, reply: None }).await.0
    }

    /// Sends `payload` as event `event`, signed with the webhook secret. Returns status and body.
    pub async fn send_event(&self, event: &str, payload: Value) -> (u16, String) {
        let (delivery, body) = hooks::record(&mut self.state(), event, &payload);
        self.send(Outgoing { event: event.to_owned(), delivery, body, signature: None, reply: None }).await
    }

    /// Sends `body` as is, with `signature` as the `X-Hub-Signature-256` header (none if `None`).
    pub async fn send_raw(&self, event: &str, body: &[u8], signature: Option<&str>, delivery: &str) -> (u16, String) {
        self.send(Outgoing {
            event: event.to_owned(),
            delivery: delivery.to_owned(),
            body: body.to_vec(),
            signature: Some(signature.map(str::to_owned)),
            reply: None,
        })
        .await
    }

    async fn send_pull_event(&self, ev: hooks::PullEvent<'_>) -> u16 {
        let stored = {
            let mut st = self.state();
            let payload = hooks::pull_request_payload(&mut st, &ev).unwrap_or_else(|| {
                panic!("pull request {}#{} is not open (open_pull_request first)", ev.repo, ev.number)
            });
            hooks::record(&mut st, "pull_request", &payload)
        };
        let (delivery, body) = stored;
        self.send(Outgoing { event: "pull_request".into(), delivery, body, signature: None, reply: None }).await.0
    }

    /// Sends `pull_request.opened`. `fork`: the head branch lives in `author`'s fork of the repository.
    pub async fn open_pull_request(
        &self,
        repo: &str,
        number: u64,
        head_sha: &str,
        fork: bool,
        author: &str,
        association: &str,
    ) -> u16 {
        {
            let mut st = self.state();
            let r = st.repo_mut(repo).unwrap_or_else(|| panic!("add_repo({repo:?}) first"));
            let base_sha = r.branches.get("main").cloned().unwrap_or_else(|| state::fake_sha(&format!("{repo}:base")));
            r.pulls.insert(
                number,
                Pull {
                    head_sha: head_sha.to_owned(),
                    base_sha,
                    head_ref: if fork { "patch-1".into() } else { format!("pr-{number}") },
                    fork,
                    author: author.to_owned(),
                    association: association.to_owned(),
                    labels: Vec::new(),
                    created_at: now(),
                },
            );
        }
        self.send_pull_event(hooks::PullEvent {
            repo,
            number,
            action: "opened",
            label: None,
            sender: author,
            before: None,
        })
        .await
    }

    /// Moves the PR's head to `new_sha` and sends `pull_request.synchronize`.
    pub async fn push_to_pull_request(&self, repo: &str, number: u64, new_sha: &str) -> u16 {
        let (before, author) = {
            let mut st = self.state();
            let pr = st
                .repo_mut(repo)
                .and_then(|r| r.pulls.get_mut(&number))
                .unwrap_or_else(|| panic!("open_pull_request({repo:?}, {number}) first"));
            let before = std::mem::replace(&mut pr.head_sha, new_sha.to_owned());
            (before, pr.author.clone())
        };
        self.send_pull_event(hooks::PullEvent {
            repo,
            number,
            action: "synchronize",
            label: None,
            sender: &author,
            before: Some(before),
        })
        .await
    }

    /// Adds `label` to the PR (it stays until deleted through the API) and sends `pull_request.labeled`.
    pub async fn add_label(&self, repo: &str, number: u64, label: &str, sender: &str) -> u16 {
        {
            let mut st = self.state();
            let pr = st
                .repo_mut(repo)
                .and_then(|r| r.pulls.get_mut(&number))
                .unwrap_or_else(|| panic!("open_pull_request({repo:?}, {number}) first"));
            if !pr.labels.iter().any(|l| l == label) {
                pr.labels.push(label.to_owned());
            }
        }
        self.send_pull_event(hooks::PullEvent {
            repo,
            number,
            action: "labeled",
            label: Some(label),
            sender,
            before: None,
        })
        .await
    }

    /// Moves `branch` to `sha` and sends `push`.
    pub async fn push(&self, repo: &str, branch: &str, sha: &str) -> u16 {
        let (delivery, body) = {
            let mut st = self.state();
            let r = st.repo_mut(repo).unwrap_or_else(|| panic!("add_repo({repo:?}) first"));
            let before = r.branches.insert(branch.to_owned(), sha.to_owned()).unwrap_or_else(|| state::ZERO_SHA.into());
            let payload = hooks::push_payload(&mut st, repo, branch, &before, sha).unwrap_or(Value::Null);
            hooks::record(&mut st, "push", &payload)
        };
        self.send(Outgoing { event: "push".into(), delivery, body, signature: None, reply: None }).await.0
    }

    pub fn job(&self, job_id: u64) -> Option<JobView> {
        self.state().jobs.get(&job_id).map(Job::view)
    }

    /// Whether the run was cancelled through the API.
    pub fn run_cancelled(&self, run_id: u64) -> bool {
        self.state().runs.get(&run_id).is_some_and(|r| r.cancelled)
    }

    /// Every runner ever registered, deleted ones included, in registration order.
    pub fn runners(&self) -> Vec<RunnerView> {
        self.state().runners.iter().map(state::Runner::view).collect()
    }

    /// The repository's check runs as they stand after every PATCH, in creation order.
    pub fn check_runs(&self, repo: &str) -> Vec<Value> {
        self.state().check_runs.values().filter(|(r, _)| r.eq_ignore_ascii_case(repo)).map(|(_, v)| v.clone()).collect()
    }

    /// Commit statuses posted for `sha`, oldest first.
    pub fn statuses(&self, repo: &str, sha: &str) -> Vec<Value> {
        self.state()
            .statuses
            .iter()
            .filter(|(r, s, _)| r.eq_ignore_ascii_case(repo) && s == sha)
            .map(|(_, _, v)| v.clone())
            .collect()
    }

    /// The PR's current labels.
    pub fn labels(&self, repo: &str, number: u64) -> Vec<String> {
        self.state().repo(repo).and_then(|r| r.pulls.get(&number)).map(|p| p.labels.clone()).unwrap_or_default()
    }

    /// From now on, requests matching `fault` get its answer instead of the real one.
    pub fn inject(&self, fault: Fault) {
        self.state().faults.push(fault);
    }

    /// Every request gets its real answer again.
    pub fn clear_faults(&self) {
        self.state().faults.clear();
    }

    /// Revokes every installation token issued so far, as GitHub does when an App's permissions
    /// change or a token is revoked through the API: requests carrying one get 401
    /// `Bad credentials`. New tokens work.
    pub fn revoke_installation_tokens(&self) {
        self.state().tokens.clear();
    }

    /// Makes every installation token issued so far expire now, whatever `expires_at` said:
    /// requests carrying one get 401 `Bad credentials`. New tokens work.
    pub fn expire_installation_tokens(&self) {
        let past = now() - time::Duration::seconds(1);
        for t in self.state().tokens.values_mut() {
            t.expires_at = past;
        }
    }

    /// Installation tokens issued so far (`POST .../access_tokens` answered 201).
    pub fn tokens_issued(&self) -> u64 {
        self.state().ids.token
    }

    /// Every API request answered so far, oldest first.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state().requests.clone()
    }

    /// Problems found checking requests and responses against the reference description.
    pub fn validation_errors(&self) -> Vec<String> {
        self.state().validation_errors.clone()
    }

    /// Webhook deliveries attempted so far: (event, delivery id, HTTP status; 0 = not delivered).
    pub fn webhook_deliveries(&self) -> Vec<(String, String, u16)> {
        self.state().delivery_log.clone()
    }

    /// Validates `value` against a component schema of the reference description (e.g. `"job"`),
    /// or `None` when the description is not loaded.
    pub fn validate_component(&self, schema: &str, value: &Value) -> Option<Vec<String>> {
        self.inner.spec.as_ref().map(|s| s.validate_component(schema, value))
    }

    /// Whether the reference description was found and requests/responses are being validated.
    pub fn validating(&self) -> bool {
        self.inner.spec.is_some()
    }
}
