//! Issue 27, "No audit trail": secret changes are on the record with who made them (a named
//! token or the admin token, never the token itself, never the value); `gpuci audit` lists
//! them; only the admin token reads the log; and a secret whose stored value no longer opens
//! fails its job at once, saying which secret and what to do, instead of leaving it queued.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_core::job::JobState;
use serde_json::Value;
use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// `gpuci ARGS` against `server` with `token`, `stdin` on standard input.
fn gpuci(server: &Server, token: &str, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .env("GPUCI_SERVER", &server.url)
        .env("GPUCI_TOKEN", token)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn ok(what: &str, o: Output) -> String {
    assert!(
        o.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn read_token(server: &Server) -> String {
    std::fs::read_to_string(server.data_dir.join("read-token")).unwrap().trim().to_string()
}

/// A named token made with the admin token (`gpuci token create`): its value on stdout.
fn named_token(server: &Server, name: &str) -> String {
    let out = ok("gpuci token create", gpuci(server, &server.token, &["token", "create", name], ""));
    let token = out.trim().to_string();
    assert!(token.starts_with("gpuci_tok_") && !token.contains('\n'), "{out:?}");
    token
}

/// Regression (issue 27): `secret set` left an INFO line without an actor, `secret rm`
/// nothing at all. Now both are audit entries naming the token that acted, listed by
/// `gpuci audit --json` (stdout, stable), filterable by action and actor, and the value
/// appears nowhere in the log.
#[test]
fn secret_set_and_rm_are_audited_with_the_actor() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let bot = named_token(&server, "ci-bot");
    let value = "audit-value-never-logged-41f3";

    ok("secret set", gpuci(&server, &bot, &["secret", "set", "HF_TOKEN", "--repo", "acme/x"], value));
    ok("secret rm", gpuci(&server, &server.token, &["secret", "rm", "HF_TOKEN", "--repo", "acme/x"], ""));
    // A miss is on the record too, as a miss.
    let missed = gpuci(&server, &bot, &["secret", "rm", "NOT_THERE"], "");
    assert!(!missed.status.success());

    let out = ok("gpuci audit --json", gpuci(&server, &server.token, &["audit", "--json"], ""));
    assert!(!out.contains(value), "the audit log holds the secret's value:\n{out}");
    assert!(!out.contains(&bot) && !out.contains(&server.token), "the audit log holds a token:\n{out}");
    let entries: Vec<Value> = serde_json::from_str(&out).unwrap();
    let find = |action: &str, actor: &str| {
        entries
            .iter()
            .find(|e| e["action"] == action && e["actor"] == actor && e["outcome"] == "ok")
            .unwrap_or_else(|| panic!("no {action} by {actor}:\n{out}"))
            .clone()
    };
    let set = find("secret.set", "ci-bot");
    assert_eq!(set["actor_kind"], "api-token", "{set}");
    assert!(set["object"].as_str().unwrap().contains("HF_TOKEN") && set["object"].as_str().unwrap().contains("acme/x"));
    assert!(set["credential"].as_str().unwrap().starts_with("sha256:"), "{set}");
    assert!(set["at"].as_str().unwrap().ends_with('Z'), "{set}");
    let rm = find("secret.rm", "admin");
    assert_eq!(rm["actor_kind"], "admin-token", "{rm}");
    assert_ne!(rm["credential"], set["credential"], "two tokens, two fingerprints");
    assert!(
        entries.iter().any(|e| e["action"] == "secret.rm" && e["actor"] == "ci-bot" && e["outcome"] != "ok"),
        "the missed rm is not on the record:\n{out}"
    );
    assert!(entries.iter().any(|e| e["action"] == "token.create" && e["object"] == "token ci-bot"), "{out}");

    // Filters: by actor, by action (whole or its object part), by time.
    let by_bot: Vec<Value> = serde_json::from_str(&ok(
        "audit --actor",
        gpuci(&server, &server.token, &["audit", "--json", "--actor", "ci-bot"], ""),
    ))
    .unwrap();
    assert!(!by_bot.is_empty() && by_bot.iter().all(|e| e["actor"] == "ci-bot"), "{by_bot:?}");
    let sets: Vec<Value> = serde_json::from_str(&ok(
        "audit --action",
        gpuci(&server, &server.token, &["audit", "--json", "--action", "secret.set"], ""),
    ))
    .unwrap();
    assert_eq!(sets.len(), 1, "{sets:?}");
    let secrets: Vec<Value> = serde_json::from_str(&ok(
        "audit --action secret",
        gpuci(&server, &server.token, &["audit", "--json", "--action", "secret"], ""),
    ))
    .unwrap();
    assert_eq!(secrets.len(), 3, "{secrets:?}");
    let future: Vec<Value> = serde_json::from_str(&ok(
        "audit --since",
        gpuci(&server, &server.token, &["audit", "--json", "--since", "2999-01-01T00:00:00Z"], ""),
    ))
    .unwrap();
    assert!(future.is_empty(), "{future:?}");

    // The table for people names the actor; a bad filter is refused with what was expected.
    let table = ok("gpuci audit", gpuci(&server, &server.token, &["audit"], ""));
    assert!(table.contains("ci-bot") && table.contains("secret.set"), "{table}");
    let bad = gpuci(&server, &server.token, &["audit", "--since", "yesterday"], "");
    assert_eq!(bad.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad.stderr));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("2h"), "{}", String::from_utf8_lossy(&bad.stderr));

    // A revoked token opens nothing any more.
    ok("token revoke", gpuci(&server, &server.token, &["token", "revoke", "ci-bot"], ""));
    let after = gpuci(&server, &bot, &["secret", "list"], "");
    assert!(!after.status.success(), "a revoked token still works");
}

/// Only the admin token reads the audit log: the read-only token gets 403 (on the API and the
/// dashboard), a named token 403, no token 401; anonymous visitors are sent to sign in.
#[test]
fn only_the_admin_token_reads_the_audit_log() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let http = reqwest::blocking::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let url = format!("{}/api/v1/audit", server.url);
    let reader = read_token(&server);
    let r = http.get(&url).bearer_auth(&reader).send().unwrap();
    assert_eq!(r.status(), 403, "the read-only token: {}", r.text().unwrap());
    let r = http.get(&url).send().unwrap();
    assert_eq!(r.status(), 401);
    let bot = named_token(&server, "ci-bot");
    let r = http.get(&url).bearer_auth(&bot).send().unwrap();
    assert_eq!(r.status(), 403, "a named token: {}", r.text().unwrap());
    let r = http.get(&url).bearer_auth(&server.token).send().unwrap();
    assert_eq!(r.status(), 200);
    let r = http.get(format!("{url}?action=nope")).bearer_auth(&server.token).send().unwrap();
    assert_eq!(r.status(), 400);
    let cli = gpuci(&server, &reader, &["audit", "--json"], "");
    assert!(!cli.status.success() && cli.stdout.is_empty(), "gpuci audit with the read-only token");

    let page = format!("{}/ui/audit", server.url);
    let r = http.get(&page).bearer_auth(&reader).send().unwrap();
    assert_eq!(r.status(), 403, "the dashboard's audit page, read-only");
    let r = http.get(&page).send().unwrap();
    assert!(r.status().is_redirection(), "anonymous: {}", r.status());
    let r = http.get(&page).bearer_auth(&server.token).send().unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().unwrap();
    assert!(body.contains("token.create") && body.contains("ci-bot"), "{body}");
}

/// Regression (issue 27): a stored value that no longer opens (written under another key, as
/// a coordinator with another key file sharing the database would; or altered) left the job
/// queued, "waiting", until its queue timeout (30 minutes). Now it fails at once with a
/// reason that names the secret and what to do, and never the value.
#[test]
fn a_job_whose_secret_no_longer_opens_fails_at_once_with_the_reason() {
    let (dir, server, _agent, api) = one_agent("30s", "a", &["--isolation", isolation()]);
    let status = api
        .raw()
        .put(format!("{}/api/v1/secrets/HF_TOKEN", server.url))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({"value": "first-value"}))
        .send()
        .unwrap()
        .status();
    assert_eq!(status, 204);
    // The row rewritten behind the coordinator's back, sealed with a key it does not hold.
    let db = dir.path().join("server").join("gpuci.db");
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        use gpuci_store::Store;
        let store = gpuci_store::SqliteStore::open_existing(&db).await.unwrap();
        let rows = store.secret_names().await.unwrap();
        assert_eq!(rows.len(), 1, "{rows:?}");
        let (other, _) = gpuci_store::SecretsKey::generate();
        store.set_secret(&rows[0].0, &other.seal(&rows[0].0, "other-value-5e1d"), 2).await.unwrap();
    });

    let p = api.submit("steps:\n  - key: use\n    secrets: [HF_TOKEN]\n    command: \"echo should-not-run\"\n");
    let j = api.wait_job(p.jobs[0].id, "failed", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Failed, "{j:?}");
    assert!(j.reason.contains("HF_TOKEN") && j.reason.contains("does not open"), "{}", j.reason);
    assert!(j.reason.contains("gpuci secret set HF_TOKEN") && j.reason.contains("key file"), "{}", j.reason);
    assert!(!j.reason.contains("other-value-5e1d") && !j.reason.contains("first-value"), "{}", j.reason);
    assert!(!api.log_text(j.id).contains("should-not-run"), "the job ran");
}
