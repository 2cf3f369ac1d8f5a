//! Reading a repository: removing a label, a collaborator's permission, one file's contents
//! (base64, wrapped as GitHub wraps it).

use super::*;

pub(super) fn remove_label(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let number = ctx.p_u64("issue_number").unwrap_or(0);
    let name = ctx.p("name");
    let Some(pr) = st.repo_mut(&repo).and_then(|r| r.pulls.get_mut(&number)) else {
        return Reply::not_found();
    };
    let Some(pos) = pr.labels.iter().position(|l| l.eq_ignore_ascii_case(name)) else {
        return Reply::error(404, "Label does not exist");
    };
    pr.labels.remove(pos);
    let remaining = pr.labels.clone();
    let full = st.repo(&repo).map(|r| r.full_name()).unwrap_or(repo);
    let labels: Vec<Value> = remaining.iter().map(|l| st.label_json(&full, l)).collect();
    Reply::json(200, Value::Array(labels))
}

pub(super) fn collaborator_permission(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let login = ctx.p("username").to_owned();
    let Some(role) = st
        .repo(&repo)
        .and_then(|r| r.collaborators.iter().find(|(k, _)| k.eq_ignore_ascii_case(&login)).map(|(_, v)| v.clone()))
    else {
        return Reply::error(404, &format!("{login} is not a collaborator"));
    };
    // GitHub's `permission` is the legacy four-level value: maintain reads as write, triage as read;
    // only `role_name` carries the full role.
    let legacy = match role.as_str() {
        "admin" => "admin",
        "maintain" | "write" => "write",
        "triage" | "read" => "read",
        _ => "none",
    };
    let rank = ["read", "triage", "write", "maintain", "admin"].iter().position(|r| *r == role).unwrap_or(0);
    let mut user = st.user_json(&login);
    user["permissions"] = json!({
        "pull": true, "triage": rank >= 1, "push": rank >= 2, "maintain": rank >= 3, "admin": rank >= 4,
    });
    user["role_name"] = json!(role);
    Reply::json(200, json!({ "permission": legacy, "role_name": role, "user": user }))
}

pub(super) fn contents(st: &State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let Some(r) = st.repo(&repo) else { return Reply::not_found() };
    let sha = match ctx.q("ref") {
        Some(reference) => r.resolve_ref(reference),
        None => r.branches.get("main").cloned().or_else(|| r.tree_order.last().cloned()),
    };
    let Some(tree) = sha.as_ref().and_then(|s| r.trees.get(s)) else { return Reply::not_found() };
    let sha = sha.unwrap_or_default();
    let path = ctx.p("path").trim_matches('/').to_owned();
    let api = format!("{}/repos/{}", st.base_url, r.full_name());
    let item = |p: &str, kind: &str, size: usize| {
        let name = p.rsplit('/').next().unwrap_or(p);
        let blob = state::fake_sha(&format!("{sha}:{p}"));
        let self_url = format!("{api}/contents/{p}?ref={sha}");
        let html = format!("https://github.com/{}/blob/{sha}/{p}", r.full_name());
        let git = format!("{api}/git/blobs/{blob}");
        json!({
            "type": kind, "size": size, "name": name, "path": p, "sha": blob, "url": self_url,
            "git_url": git, "html_url": html,
            "download_url": if kind == "file" { json!(format!("https://raw.githubusercontent.com/{}/{sha}/{p}", r.full_name())) } else { Value::Null },
            "_links": { "self": self_url, "git": git, "html": html },
        })
    };
    if let Some(content) = tree.get(&path) {
        let mut v = item(&path, "file", content.len());
        v["encoding"] = json!("base64");
        v["content"] = json!(wrapped_base64(content.as_bytes()));
        return Reply::json(200, v);
    }
    let prefix = if path.is_empty() { String::new() } else { format!("{path}/") };
    let mut entries: BTreeMap<String, Value> = BTreeMap::new();
    for (p, content) in tree.iter().filter(|(p, _)| p.starts_with(&prefix)) {
        let rest = &p[prefix.len()..];
        match rest.split_once('/') {
            Some((dir, _)) => {
                let dir_path = format!("{prefix}{dir}");
                entries.entry(dir_path.clone()).or_insert_with(|| item(&dir_path, "dir", 0));
            }
            None => {
                entries.insert(p.clone(), item(p, "file", content.len()));
            }
        }
    }
    if entries.is_empty() {
        return Reply::not_found();
    }
    Reply::json(200, Value::Array(entries.into_values().collect()))
}

/// Base64 with a newline after every 60 characters, as the contents API sends it.
fn wrapped_base64(bytes: &[u8]) -> String {
    let flat = base64::engine::general_purpose::STANDARD.encode(bytes);
    let mut out = String::with_capacity(flat.len() + flat.len() / 60 + 1);
    for chunk in flat.as_bytes().chunks(60) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out
}
