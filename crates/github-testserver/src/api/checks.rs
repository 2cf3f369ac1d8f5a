//! What a commit shows: check runs created and updated, commit statuses.

use super::*;

pub(super) fn create_check_run(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let (Some(name), Some(head_sha)) =
        (ctx.body.get("name").and_then(Value::as_str), ctx.body.get("head_sha").and_then(Value::as_str))
    else {
        return Reply::unprocessable("Invalid request: name and head_sha are required.");
    };
    st.ids.check_run += 1;
    let id = st.ids.check_run;
    let repo = ctx.repo();
    let app_owner = st.user_json("gpuci-test-owner");
    let mut cr = json!({
        "id": id,
        "head_sha": head_sha,
        "node_id": format!("CR_test{id}"),
        "external_id": "",
        "url": format!("{}/repos/{repo}/check-runs/{id}", st.base_url),
        "html_url": format!("https://github.com/{repo}/runs/{id}"),
        "details_url": null,
        "status": "queued",
        "conclusion": null,
        "started_at": ts(now()),
        "completed_at": null,
        "output": { "title": null, "summary": null, "text": null, "annotations_count": 0,
            "annotations_url": format!("{}/repos/{repo}/check-runs/{id}/annotations", st.base_url) },
        "name": name,
        "check_suite": { "id": 4_000_000 + id },
        "app": {
            "id": 1, "slug": "gpuci-test", "node_id": "A_test1", "owner": app_owner, "name": "gpuci (test)",
            "description": null, "external_url": "https://example.com", "html_url": "https://github.com/apps/gpuci-test",
            "created_at": "2024-01-01T00:00:00Z", "updated_at": "2024-01-01T00:00:00Z",
            "permissions": { "checks": "write" }, "events": [],
        },
        "pull_requests": [],
    });
    apply_check_run_fields(&mut cr, &ctx.body);
    st.check_runs.insert(id, (repo, cr.clone()));
    Reply::json(201, cr)
}

pub(super) fn update_check_run(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let Some((_, cr)) = ctx
        .p_u64("check_run_id")
        .and_then(|id| st.check_runs.get_mut(&id))
        .filter(|(r, _)| r.eq_ignore_ascii_case(&repo))
    else {
        return Reply::not_found();
    };
    apply_check_run_fields(cr, &ctx.body);
    Reply::json(200, cr.clone())
}

/// Copies a create/update body onto a check run as GitHub does: a conclusion completes the run.
fn apply_check_run_fields(cr: &mut Value, body: &Value) {
    for key in ["name", "details_url", "external_id", "status", "started_at", "completed_at", "conclusion"] {
        if let Some(v) = body.get(key) {
            cr[key] = v.clone();
        }
    }
    if let Some(out) = body.get("output") {
        for key in ["title", "summary", "text"] {
            if let Some(v) = out.get(key) {
                cr["output"][key] = v.clone();
            }
        }
        if let Some(a) = out.get("annotations").and_then(Value::as_array) {
            let n = cr["output"]["annotations_count"].as_u64().unwrap_or(0) + a.len() as u64;
            cr["output"]["annotations_count"] = json!(n);
        }
    }
    if body.get("conclusion").is_some_and(|c| !c.is_null()) {
        cr["status"] = json!("completed");
        if cr["completed_at"].is_null() {
            cr["completed_at"] = json!(ts(now()));
        }
    }
}

pub(super) fn create_status(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let Some(state_value) = ctx.body.get("state").and_then(Value::as_str) else {
        return Reply::unprocessable("Invalid request: state is required.");
    };
    st.ids.status += 1;
    let id = st.ids.status;
    let repo = ctx.repo();
    let sha = ctx.p("sha").to_owned();
    let creator = st.user_json("gpuci-test[bot]");
    let t = ts(now());
    let status = json!({
        "url": format!("{}/repos/{repo}/statuses/{sha}", st.base_url),
        "avatar_url": null,
        "id": id,
        "node_id": format!("SC_test{id}"),
        "state": state_value,
        "description": ctx.body.get("description").cloned().unwrap_or(Value::Null),
        "target_url": ctx.body.get("target_url").cloned().unwrap_or(Value::Null),
        "context": ctx.body.get("context").and_then(Value::as_str).unwrap_or("default"),
        "created_at": t,
        "updated_at": t,
        "creator": creator,
    });
    st.statuses.push((repo, sha, status.clone()));
    let mut reply = Reply::json(201, status);
    reply.headers.push(("location".into(), format!("{}{}", st.base_url, ctx.raw_path)));
    reply
}
