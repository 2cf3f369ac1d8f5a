//! Webhook deliveries: payloads shaped like GitHub's, signed with `X-Hub-Signature-256`, sent in
//! order by one task so a `completed` never overtakes the `in_progress` before it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use tokio::sync::{mpsc, oneshot};

use crate::state::{ts, Job, State};

/// `sha256=` + hex HMAC-SHA256 of `body` keyed with `secret`, as GitHub signs deliveries.
pub fn sign(secret: &str, body: &[u8]) -> String {
    // HMAC takes keys of any length; `new_from_slice` cannot fail here.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret.as_bytes()) {
        Ok(m) => m,
        Err(_) => return String::new(),
    };
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

pub(crate) struct Outgoing {
    pub event: String,
    pub delivery: String,
    pub body: Vec<u8>,
    /// `None`: sign with the configured secret; `Some(None)`: no signature header; `Some(Some(s))`: `s`.
    pub signature: Option<Option<String>>,
    pub reply: Option<oneshot::Sender<(u16, String)>>,
}

pub(crate) type Sender = mpsc::UnboundedSender<Outgoing>;

/// Runs until every sender is dropped. Status 0 means "not delivered" (no URL, connection refused).
pub(crate) async fn deliver_loop(state: Arc<Mutex<State>>, secret: String, mut rx: mpsc::UnboundedReceiver<Outgoing>) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap_or_default();
    while let Some(out) = rx.recv().await {
        let url = lock(&state).webhook_url.clone();
        let (status, text) = match url {
            None => (0, String::from("no webhook_url configured")),
            Some(url) => {
                let mut req = http
                    .post(url)
                    .header("X-GitHub-Event", &out.event)
                    .header("X-GitHub-Delivery", &out.delivery)
                    .header("X-GitHub-Hook-ID", "1")
                    .header("Content-Type", "application/json")
                    .header("User-Agent", "GitHub-Hookshot/test")
                    .body(out.body.clone());
                let signature = match out.signature {
                    None => Some(sign(&secret, &out.body)),
                    Some(s) => s,
                };
                if let Some(sig) = signature {
                    req = req.header("X-Hub-Signature-256", sig);
                }
                match req.send().await {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        (status, resp.text().await.unwrap_or_default())
                    }
                    Err(e) => (0, e.to_string()),
                }
            }
        };
        lock(&state).delivery_log.push((out.event.clone(), out.delivery.clone(), status));
        if let Some(reply) = out.reply {
            let _ = reply.send((status, text));
        }
    }
}

pub(crate) fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // A panic while holding the lock (a bug in a test helper) should not hide every later result.
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Stores a new delivery (so it can be redelivered) and returns its id and body.
pub(crate) fn record(st: &mut State, event: &str, payload: &Value) -> (String, Vec<u8>) {
    let delivery = st.next_delivery_id();
    let body = serde_json::to_vec(payload).unwrap_or_default();
    st.deliveries.insert(delivery.clone(), crate::state::Delivery { event: event.to_owned(), body: body.clone() });
    (delivery, body)
}

fn installation(id: u64) -> Value {
    json!({ "id": id, "node_id": format!("MDIzOkludGVncmF0aW9uSW5zdGFsbGF0aW9u{id}") })
}

pub(crate) fn workflow_job_payload(st: &mut State, job: &Job, action: &str) -> Value {
    let job_json = st.job_json(job);
    let repo_json = st.repo_json(&job.repo);
    let installation_id = st.repo(&job.repo).map(|r| r.installation_id).unwrap_or_default();
    let sender = st.user_json("test-actor");
    json!({
        "action": action,
        "workflow_job": job_json,
        "repository": repo_json,
        "sender": sender,
        "installation": installation(installation_id),
    })
}

pub(crate) struct PullEvent<'a> {
    pub repo: &'a str,
    pub number: u64,
    pub action: &'a str,
    pub label: Option<&'a str>,
    pub sender: &'a str,
    pub before: Option<String>,
}

pub(crate) fn pull_request_payload(st: &mut State, ev: &PullEvent<'_>) -> Option<Value> {
    let repo = st.repo(ev.repo)?;
    let full = repo.full_name();
    let name = repo.name.clone();
    let owner = repo.owner.clone();
    let installation_id = repo.installation_id;
    let pr = repo.pulls.get(&ev.number)?;
    let (head_sha, base_sha, head_ref, fork, author, association, labels, created) = (
        pr.head_sha.clone(),
        pr.base_sha.clone(),
        pr.head_ref.clone(),
        pr.fork,
        pr.author.clone(),
        pr.association.clone(),
        pr.labels.clone(),
        ts(pr.created_at),
    );
    let head_full = if fork { format!("{author}/{name}") } else { full.clone() };
    let head_owner = if fork { author.clone() } else { owner.clone() };
    let head_repo = st.repo_json(&head_full);
    let base_repo = st.repo_json(&full);
    let user = st.user_json(&author);
    let head_user = st.user_json(&head_owner);
    let base_user = st.user_json(&owner);
    let sender = st.user_json(ev.sender);
    let label_objs: Vec<Value> = labels.iter().map(|l| st.label_json(&full, l)).collect();
    let api = format!("{}/repos/{full}", st.base_url);
    let number = ev.number;
    let now = ts(crate::state::now());
    let mut payload = json!({
        "action": ev.action,
        "number": number,
        "pull_request": {
            "url": format!("{api}/pulls/{number}"),
            "id": 800_000 + number,
            "node_id": format!("PR_test{number}"),
            "html_url": format!("https://github.com/{full}/pull/{number}"),
            "number": number,
            "state": "open",
            "locked": false,
            "title": format!("Test pull request {number}"),
            "user": user,
            "body": null,
            "labels": label_objs,
            "created_at": created,
            "updated_at": now,
            "closed_at": null,
            "merged_at": null,
            "merge_commit_sha": null,
            "draft": false,
            "statuses_url": format!("{api}/statuses/{head_sha}"),
            "head": {
                "label": format!("{head_owner}:{head_ref}"),
                "ref": head_ref,
                "sha": head_sha,
                "user": head_user,
                "repo": head_repo,
            },
            "base": {
                "label": format!("{owner}:main"),
                "ref": "main",
                "sha": base_sha,
                "user": base_user,
                "repo": base_repo.clone(),
            },
            "author_association": association,
            "merged": false,
            "mergeable": null,
            "commits": 1,
        },
        "repository": base_repo,
        "sender": sender,
        "installation": installation(installation_id),
    });
    if let Some(label) = ev.label {
        payload["label"] = st.label_json(&full, label);
    }
    if let Some(before) = &ev.before {
        payload["before"] = json!(before);
        payload["after"] = json!(head_sha);
    }
    Some(payload)
}

pub(crate) fn push_payload(st: &mut State, repo: &str, branch: &str, before: &str, sha: &str) -> Option<Value> {
    let r = st.repo(repo)?;
    let (full, installation_id) = (r.full_name(), r.installation_id);
    let repo_json = st.repo_json(&full);
    let sender = st.user_json("test-pusher");
    let now = ts(crate::state::now());
    let commit = json!({
        "id": sha,
        "tree_id": crate::state::fake_sha(&format!("tree:{sha}")),
        "distinct": true,
        "message": "test commit",
        "timestamp": now,
        "url": format!("https://github.com/{full}/commit/{sha}"),
        "author": { "name": "Test Pusher", "email": "pusher@example.com", "username": "test-pusher" },
        "committer": { "name": "Test Pusher", "email": "pusher@example.com", "username": "test-pusher" },
        "added": [], "removed": [], "modified": [],
    });
    Some(json!({
        "ref": format!("refs/heads/{branch}"),
        "before": before,
        "after": sha,
        "repository": repo_json,
        "pusher": { "name": "test-pusher", "email": "pusher@example.com" },
        "sender": sender,
        "installation": installation(installation_id),
        "created": before == crate::state::ZERO_SHA,
        "deleted": false,
        "forced": false,
        "base_ref": null,
        "compare": format!("https://github.com/{full}/compare/{}...{}", &before[..12.min(before.len())], &sha[..12.min(sha.len())]),
        "commits": [commit.clone()],
        "head_commit": commit,
    }))
}
