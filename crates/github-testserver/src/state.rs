//! The server's in-memory world (repositories, runs, jobs, runners, tokens) and the JSON shapes
//! GitHub answers with. All of it sits behind one mutex that is never held across an `.await`.

use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Value};
use time::OffsetDateTime;

use crate::{JobView, Recorded, RunnerView};

pub(crate) const ZERO_SHA: &str = "0000000000000000000000000000000000000000";

pub(crate) fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

/// GitHub's timestamp format: seconds, `Z`.
pub(crate) fn ts(t: OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// A stable, 40-hex-digit stand-in for a git object id.
pub(crate) fn fake_sha(seed: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(seed.as_bytes()))[..40].to_owned()
}

pub(crate) struct Repo {
    pub id: u64,
    pub owner: String,
    pub name: String,
    pub installation_id: u64,
    pub collaborators: HashMap<String, String>,
    /// sha → path → content.
    pub trees: HashMap<String, BTreeMap<String, String>>,
    /// The order trees were set in: the newest is the default head for queued jobs.
    pub tree_order: Vec<String>,
    pub branches: HashMap<String, String>,
    pub pulls: BTreeMap<u64, Pull>,
}

impl Repo {
    pub fn full_name(&self) -> String {
        format!("{}/{}", self.owner, self.name)
    }

    /// Resolves a ref (full sha, unique sha prefix of 7+, branch, `refs/heads/x`) to a sha with a tree.
    pub fn resolve_ref(&self, r: &str) -> Option<String> {
        let r = r.strip_prefix("refs/heads/").unwrap_or(r);
        if self.trees.contains_key(r) {
            return Some(r.to_owned());
        }
        if let Some(sha) = self.branches.get(r) {
            return Some(sha.clone());
        }
        if r.len() >= 7 {
            let hits: Vec<&String> = self.trees.keys().filter(|k| k.starts_with(r)).collect();
            if hits.len() == 1 {
                return Some(hits[0].clone());
            }
        }
        None
    }

    /// The commit a new run is for: the default branch's head, else the newest tree, else made up.
    pub fn head_sha(&self, seed: u64) -> String {
        self.branches
            .get("main")
            .or_else(|| self.tree_order.last())
            .cloned()
            .unwrap_or_else(|| fake_sha(&format!("{}#{seed}", self.full_name())))
    }
}

pub(crate) struct Pull {
    pub head_sha: String,
    pub base_sha: String,
    pub head_ref: String,
    pub fork: bool,
    pub author: String,
    pub association: String,
    pub labels: Vec<String>,
    pub created_at: OffsetDateTime,
}

pub(crate) struct Run {
    pub id: u64,
    pub repo: String,
    pub run_number: u64,
    pub head_sha: String,
    pub head_branch: String,
    pub event: String,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
    pub cancelled: bool,
}

pub(crate) struct Job {
    pub id: u64,
    pub run_id: u64,
    pub repo: String,
    pub name: String,
    pub labels: Vec<String>,
    pub script: String,
    pub status: String,
    pub conclusion: Option<String>,
    pub runner_id: Option<u64>,
    pub runner_name: Option<String>,
    pub runner_group_id: Option<u64>,
    pub created_at: OffsetDateTime,
    pub started_at: Option<OffsetDateTime>,
    pub completed_at: Option<OffsetDateTime>,
}

impl Job {
    pub fn view(&self) -> JobView {
        JobView {
            status: self.status.clone(),
            conclusion: self.conclusion.clone(),
            runner_name: self.runner_name.clone(),
            run_id: self.run_id,
        }
    }
}

/// Where a runner is registered: a repository (`owner/name`) or an organization (`org`).
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Scope {
    Repo(String),
    Org(String),
}

impl Scope {
    pub fn as_string(&self) -> String {
        match self {
            Scope::Repo(r) | Scope::Org(r) => r.clone(),
        }
    }

    /// Whether a job in `repo` (`owner/name`) may run on a runner registered here.
    pub fn covers(&self, repo: &str) -> bool {
        match self {
            Scope::Repo(r) => r.eq_ignore_ascii_case(repo),
            Scope::Org(org) => repo.split('/').next().is_some_and(|o| o.eq_ignore_ascii_case(org)),
        }
    }
}

pub(crate) struct Runner {
    pub id: u64,
    pub name: String,
    pub labels: Vec<String>,
    pub runner_group_id: u64,
    pub scope: Scope,
    pub deleted: bool,
    pub jobs_taken: u32,
    pub online: bool,
    pub current_job: Option<u64>,
    /// When the runner first called `/_test/runners/{id}/acquire`.
    pub first_acquire_at: Option<std::time::SystemTime>,
}

impl Runner {
    pub fn view(&self) -> RunnerView {
        RunnerView {
            id: self.id,
            name: self.name.clone(),
            labels: self.labels.clone(),
            runner_group_id: self.runner_group_id,
            repo: self.scope.as_string(),
            deleted: self.deleted,
            jobs_taken: self.jobs_taken,
            first_acquire_at: self.first_acquire_at,
        }
    }

    /// Whether this runner can take a job with `labels`: every job label is one of the runner's
    /// labels or `self-hosted` (which every self-hosted runner carries), case-insensitively.
    pub fn fits(&self, labels: &[String]) -> bool {
        labels
            .iter()
            .all(|l| l.eq_ignore_ascii_case("self-hosted") || self.labels.iter().any(|r| r.eq_ignore_ascii_case(l)))
    }
}

pub(crate) struct Token {
    pub installation_id: u64,
    pub expires_at: OffsetDateTime,
}

/// GitHub's primary rate limit for a credential: requests left in the current hour.
pub(crate) const RATE_LIMIT: u64 = 5000;

/// Requests one credential made in the current rate-limit window.
pub(crate) struct RateWindow {
    pub reset: i64,
    pub used: u64,
}

pub(crate) struct Delivery {
    pub event: String,
    pub body: Vec<u8>,
}

/// Id counters start in different ranges so a run id passed where a job id belongs finds nothing.
pub(crate) struct Ids {
    pub repo: u64,
    pub user: u64,
    pub run: u64,
    pub job: u64,
    pub runner: u64,
    pub check_run: u64,
    pub status: u64,
    pub token: u64,
    pub delivery: u64,
    pub label: u64,
}

pub(crate) struct State {
    pub base_url: String,
    pub webhook_url: Option<String>,
    pub ids: Ids,
    pub repos: BTreeMap<String, Repo>,
    pub users: HashMap<String, u64>,
    pub tokens: HashMap<String, Token>,
    pub runners: Vec<Runner>,
    pub runs: BTreeMap<u64, Run>,
    pub jobs: BTreeMap<u64, Job>,
    /// id → (repo, check run JSON).
    pub check_runs: BTreeMap<u64, (String, Value)>,
    /// (repo, sha, status JSON).
    pub statuses: Vec<(String, String, Value)>,
    pub deliveries: HashMap<String, Delivery>,
    pub delivery_log: Vec<(String, String, u16)>,
    pub requests: Vec<Recorded>,
    pub validation_errors: Vec<String>,
    /// Answers to give instead of the real ones ([`crate::Fault`]), in the order injected.
    pub faults: Vec<crate::Fault>,
    /// Credential (`installation N`, `token`, `app`) → its rate-limit window.
    pub rate_windows: HashMap<String, RateWindow>,
}

impl State {
    pub fn new(base_url: String, webhook_url: Option<String>) -> Self {
        Self {
            base_url,
            webhook_url,
            ids: Ids {
                repo: 100_000,
                user: 500_000,
                run: 1_000_000,
                job: 2_000_000,
                runner: 0,
                check_run: 3_000_000,
                status: 5_000_000,
                token: 0,
                delivery: 0,
                label: 7_000_000,
            },
            repos: BTreeMap::new(),
            users: HashMap::new(),
            tokens: HashMap::new(),
            runners: Vec::new(),
            runs: BTreeMap::new(),
            jobs: BTreeMap::new(),
            check_runs: BTreeMap::new(),
            statuses: Vec::new(),
            deliveries: HashMap::new(),
            delivery_log: Vec::new(),
            requests: Vec::new(),
            validation_errors: Vec::new(),
            faults: Vec::new(),
            rate_windows: HashMap::new(),
        }
    }

    pub fn repo(&self, full_name: &str) -> Option<&Repo> {
        self.repos.get(&full_name.to_ascii_lowercase())
    }

    pub fn repo_mut(&mut self, full_name: &str) -> Option<&mut Repo> {
        self.repos.get_mut(&full_name.to_ascii_lowercase())
    }

    pub fn user_id(&mut self, login: &str) -> u64 {
        let next = &mut self.ids.user;
        *self.users.entry(login.to_ascii_lowercase()).or_insert_with(|| {
            *next += 1;
            *next
        })
    }

    /// An installation's account: the owner of its first repository.
    pub fn installation_account(&self, installation_id: u64) -> Option<String> {
        self.repos.values().find(|r| r.installation_id == installation_id).map(|r| r.owner.clone())
    }

    pub fn installation_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.repos.values().map(|r| r.installation_id).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    pub fn next_delivery_id(&mut self) -> String {
        self.ids.delivery += 1;
        // GitHub's delivery ids are UUIDs; this keeps their shape and stays unique per server.
        format!("00000000-0000-4000-8000-{:012x}", self.ids.delivery)
    }

    // ---- JSON shapes -------------------------------------------------------------------------

    pub fn user_json(&mut self, login: &str) -> Value {
        let id = self.user_id(login);
        let kind = if self.repos.values().any(|r| r.owner.eq_ignore_ascii_case(login) && r.installation_id != 0) {
            "Organization"
        } else {
            "User"
        };
        user_json(&self.base_url, login, id, kind)
    }

    /// A `minimal-repository` (also what webhooks carry as `repository`).
    pub fn repo_json(&mut self, full_name: &str) -> Value {
        let (id, owner, name, fork) = match self.repo(full_name) {
            Some(r) => (r.id, r.owner.clone(), r.name.clone(), false),
            None => {
                // A fork or another outside repository: stable made-up id.
                let (o, n) = full_name.split_once('/').unwrap_or((full_name, full_name));
                let id = 900_000 + u64::from_str_radix(&fake_sha(full_name)[..5], 16).unwrap_or(0);
                (id, o.to_owned(), n.to_owned(), true)
            }
        };
        let owner_json = self.user_json(&owner);
        let api = format!("{}/repos/{owner}/{name}", self.base_url);
        let html = format!("https://github.com/{owner}/{name}");
        let mut m = serde_json::Map::new();
        m.insert("id".into(), json!(id));
        m.insert("node_id".into(), json!(format!("R_test{id}")));
        m.insert("name".into(), json!(name));
        m.insert("full_name".into(), json!(format!("{owner}/{name}")));
        m.insert("owner".into(), owner_json);
        m.insert("private".into(), json!(false));
        m.insert("html_url".into(), json!(html));
        m.insert("description".into(), Value::Null);
        m.insert("fork".into(), json!(fork));
        m.insert("url".into(), json!(api));
        for (key, suffix) in [
            ("archive_url", "/{archive_format}{/ref}"),
            ("assignees_url", "/assignees{/user}"),
            ("blobs_url", "/git/blobs{/sha}"),
            ("branches_url", "/branches{/branch}"),
            ("collaborators_url", "/collaborators{/collaborator}"),
            ("comments_url", "/comments{/number}"),
            ("commits_url", "/commits{/sha}"),
            ("compare_url", "/compare/{base}...{head}"),
            ("contents_url", "/contents/{+path}"),
            ("contributors_url", "/contributors"),
            ("deployments_url", "/deployments"),
            ("downloads_url", "/downloads"),
            ("events_url", "/events"),
            ("forks_url", "/forks"),
            ("git_commits_url", "/git/commits{/sha}"),
            ("git_refs_url", "/git/refs{/sha}"),
            ("git_tags_url", "/git/tags{/sha}"),
            ("hooks_url", "/hooks"),
            ("issue_comment_url", "/issues/comments{/number}"),
            ("issue_events_url", "/issues/events{/number}"),
            ("issues_url", "/issues{/number}"),
            ("keys_url", "/keys{/key_id}"),
            ("labels_url", "/labels{/name}"),
            ("languages_url", "/languages"),
            ("merges_url", "/merges"),
            ("milestones_url", "/milestones{/number}"),
            ("notifications_url", "/notifications{?since,all,participating}"),
            ("pulls_url", "/pulls{/number}"),
            ("releases_url", "/releases{/id}"),
            ("stargazers_url", "/stargazers"),
            ("statuses_url", "/statuses/{sha}"),
            ("subscribers_url", "/subscribers"),
            ("subscription_url", "/subscription"),
            ("tags_url", "/tags"),
            ("teams_url", "/teams"),
            ("trees_url", "/git/trees{/sha}"),
        ] {
            m.insert(key.into(), json!(format!("{api}{suffix}")));
        }
        m.insert("git_url".into(), json!(format!("git://github.com/{owner}/{name}.git")));
        m.insert("ssh_url".into(), json!(format!("git@github.com:{owner}/{name}.git")));
        m.insert("clone_url".into(), json!(format!("{html}.git")));
        m.insert("default_branch".into(), json!("main"));
        m.insert("visibility".into(), json!("public"));
        Value::Object(m)
    }

    pub fn installation_json(&mut self, installation_id: u64, app_id: u64) -> Value {
        let account = self.installation_account(installation_id).unwrap_or_else(|| "test-owner".into());
        let mut account_json = self.user_json(&account);
        // The description's list-installations item says `allOf: [simple-user, enterprise]` (the single
        // installation says `anyOf`), so the account carries enterprise's required fields too.
        account_json["name"] = json!(account);
        account_json["slug"] = json!(account.to_ascii_lowercase());
        account_json["created_at"] = json!("2024-01-01T00:00:00Z");
        account_json["updated_at"] = json!("2024-01-01T00:00:00Z");
        let target_id = account_json["id"].clone();
        let kind = account_json["type"].clone();
        json!({
            "id": installation_id,
            "account": account_json,
            "repository_selection": "selected",
            "access_tokens_url": format!("{}/app/installations/{installation_id}/access_tokens", self.base_url),
            "repositories_url": format!("{}/installation/repositories", self.base_url),
            "html_url": format!("https://github.com/settings/installations/{installation_id}"),
            "app_id": app_id,
            "app_slug": "gpuci-test",
            "target_id": target_id,
            "target_type": kind,
            "permissions": {
                "actions": "write", "administration": "write", "checks": "write", "contents": "read",
                "issues": "write", "metadata": "read", "pull_requests": "write", "statuses": "write"
            },
            "events": ["pull_request", "push", "workflow_job"],
            "created_at": "2024-01-01T00:00:00Z",
            "updated_at": "2024-01-01T00:00:00Z",
            "single_file_name": null,
            "suspended_by": null,
            "suspended_at": null
        })
    }

    pub fn runner_json(&self, r: &Runner) -> Value {
        let mut labels = vec![json!({ "id": 1, "name": "self-hosted", "type": "read-only" })];
        for (i, l) in r.labels.iter().enumerate() {
            if !l.eq_ignore_ascii_case("self-hosted") {
                labels.push(json!({ "id": 100 + i, "name": l, "type": "custom" }));
            }
        }
        json!({
            "id": r.id,
            "runner_group_id": r.runner_group_id,
            "name": r.name,
            "os": "Linux",
            "status": if r.online { "online" } else { "offline" },
            "busy": r.current_job.is_some(),
            "labels": labels,
            "ephemeral": true,
        })
    }

    pub fn job_json(&self, j: &Job) -> Value {
        let run = self.runs.get(&j.run_id);
        let api = format!("{}/repos/{}", self.base_url, j.repo);
        let steps: Vec<Value> = match j.status.as_str() {
            "queued" => Vec::new(),
            _ => vec![json!({
                "name": "Run script",
                "status": j.status,
                "conclusion": j.conclusion,
                "number": 1,
                "started_at": j.started_at.map(ts),
                "completed_at": j.completed_at.map(ts),
            })],
        };
        json!({
            "id": j.id,
            "run_id": j.run_id,
            "run_url": format!("{api}/actions/runs/{}", j.run_id),
            "run_attempt": 1,
            "node_id": format!("CR_test{}", j.id),
            "head_sha": run.map(|r| r.head_sha.clone()).unwrap_or_default(),
            "url": format!("{api}/actions/jobs/{}", j.id),
            "html_url": format!("https://github.com/{}/actions/runs/{}/job/{}", j.repo, j.run_id, j.id),
            "status": j.status,
            "conclusion": j.conclusion,
            "created_at": ts(j.created_at),
            "started_at": ts(j.started_at.unwrap_or(j.created_at)),
            "completed_at": j.completed_at.map(ts),
            "name": j.name,
            "steps": steps,
            "check_run_url": format!("{api}/check-runs/{}", j.id),
            "labels": j.labels,
            "runner_id": j.runner_id,
            "runner_name": j.runner_name,
            "runner_group_id": j.runner_group_id,
            "runner_group_name": j.runner_group_id.map(|_| "Default"),
            "workflow_name": "gpuci-test",
            "head_branch": run.map(|r| r.head_branch.clone()),
        })
    }

    /// A run is completed when all its jobs are; its conclusion is the worst of theirs.
    pub fn run_status(&self, run_id: u64) -> (String, Option<String>) {
        let jobs: Vec<&Job> = self.jobs.values().filter(|j| j.run_id == run_id).collect();
        if jobs.iter().all(|j| j.status == "completed") {
            let worst = ["cancelled", "failure", "success"]
                .into_iter()
                .find(|c| jobs.iter().any(|j| j.conclusion.as_deref() == Some(c)))
                .unwrap_or("success");
            let cancelled = self.runs.get(&run_id).is_some_and(|r| r.cancelled);
            (String::from("completed"), Some(if cancelled { "cancelled" } else { worst }.to_owned()))
        } else if jobs.iter().any(|j| j.status == "in_progress") {
            ("in_progress".into(), None)
        } else {
            ("queued".into(), None)
        }
    }

    pub fn run_json(&mut self, run_id: u64) -> Value {
        let Some(run) = self.runs.get(&run_id) else { return Value::Null };
        let (status, conclusion) = self.run_status(run_id);
        let (repo, head_sha, head_branch, event, number) =
            (run.repo.clone(), run.head_sha.clone(), run.head_branch.clone(), run.event.clone(), run.run_number);
        let (created, updated) = (ts(run.created_at), ts(run.updated_at));
        let repo_json = self.repo_json(&repo);
        let actor = self.user_json("test-actor");
        let api = format!("{}/repos/{repo}/actions/runs/{run_id}", self.base_url);
        json!({
            "id": run_id,
            "name": "gpuci-test",
            "node_id": format!("WFR_test{run_id}"),
            "check_suite_id": run_id + 10_000_000,
            "head_branch": head_branch,
            "head_sha": head_sha,
            "path": ".github/workflows/gpu.yml",
            "run_number": number,
            "run_attempt": 1,
            "event": event,
            "display_title": "gpuci test run",
            "status": status,
            "conclusion": conclusion,
            "workflow_id": 42,
            "url": api,
            "html_url": format!("https://github.com/{repo}/actions/runs/{run_id}"),
            "pull_requests": [],
            "created_at": created,
            "updated_at": updated,
            "run_started_at": created,
            "actor": actor.clone(),
            "triggering_actor": actor,
            "jobs_url": format!("{api}/jobs"),
            "logs_url": format!("{api}/logs"),
            "check_suite_url": format!("{}/repos/{repo}/check-suites/{}", self.base_url, run_id + 10_000_000),
            "artifacts_url": format!("{api}/artifacts"),
            "cancel_url": format!("{api}/cancel"),
            "rerun_url": format!("{api}/rerun"),
            "previous_attempt_url": null,
            "workflow_url": format!("{}/repos/{repo}/actions/workflows/42", self.base_url),
            "head_commit": {
                "id": head_sha,
                "tree_id": fake_sha(&format!("tree:{head_sha}")),
                "message": "test commit",
                "timestamp": created,
                "author": { "name": "Test Author", "email": "author@example.com" },
                "committer": { "name": "Test Author", "email": "author@example.com" }
            },
            "repository": repo_json.clone(),
            "head_repository": repo_json,
        })
    }

    pub fn label_json(&mut self, repo: &str, name: &str) -> Value {
        self.ids.label += 1;
        json!({
            "id": self.ids.label,
            "node_id": format!("LA_test{}", self.ids.label),
            "url": format!("{}/repos/{repo}/labels/{name}", self.base_url),
            "name": name,
            "description": null,
            "color": "ededed",
            "default": false,
        })
    }
}

pub(crate) fn user_json(base: &str, login: &str, id: u64, kind: &str) -> Value {
    let api = format!("{base}/users/{login}");
    json!({
        "login": login,
        "id": id,
        "node_id": format!("U_test{id}"),
        "avatar_url": format!("https://avatars.githubusercontent.com/u/{id}?v=4"),
        "gravatar_id": "",
        "url": api,
        "html_url": format!("https://github.com/{login}"),
        "followers_url": format!("{api}/followers"),
        "following_url": format!("{api}/following{{/other_user}}"),
        "gists_url": format!("{api}/gists{{/gist_id}}"),
        "starred_url": format!("{api}/starred{{/owner}}{{/repo}}"),
        "subscriptions_url": format!("{api}/subscriptions"),
        "organizations_url": format!("{api}/orgs"),
        "repos_url": format!("{api}/repos"),
        "events_url": format!("{api}/events{{/privacy}}"),
        "received_events_url": format!("{api}/received_events"),
        "type": kind,
        "site_admin": false,
    })
}
