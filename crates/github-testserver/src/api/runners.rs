//! Installation tokens and self-hosted runners: minting a token, JIT runner configs for a
//! repository or an organisation, listing and deleting runners.

use super::*;

pub(super) fn access_token(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let Some(id) = ctx.p_u64("installation_id").filter(|id| st.installation_ids().contains(id)) else {
        return Reply::not_found();
    };
    st.ids.token += 1;
    let token = format!("ghs_test_{}", st.ids.token);
    let expires_at = now() + time::Duration::hours(1);
    st.tokens.insert(token.clone(), state::Token { installation_id: id, expires_at });
    Reply::json(
        201,
        json!({
            "token": token,
            "expires_at": ts(expires_at),
            "permissions": { "actions": "write", "administration": "write", "checks": "write",
                "contents": "read", "issues": "write", "metadata": "read", "statuses": "write" },
            "repository_selection": "selected",
        }),
    )
}

pub(super) fn generate_jitconfig(st: &mut State, ctx: &Ctx<'_>, scope: Scope) -> Reply {
    let name = ctx.body.get("name").and_then(Value::as_str).unwrap_or_default().to_owned();
    let group = ctx.body.get("runner_group_id").and_then(Value::as_u64);
    let labels: Vec<String> = ctx
        .body
        .get("labels")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default();
    let Some(group) = group.filter(|_| !name.is_empty() && !labels.is_empty() && labels.len() <= 100) else {
        return Reply::unprocessable("Invalid request: name, runner_group_id and 1 to 100 labels are required.");
    };
    if st.runners.iter().any(|r| !r.deleted && r.scope == scope && r.name.eq_ignore_ascii_case(&name)) {
        return Reply::error(409, &format!("Already exists - A runner with the name {name} already exists."));
    }
    st.ids.runner += 1;
    let runner = Runner {
        id: st.ids.runner,
        name,
        labels,
        runner_group_id: group,
        scope,
        deleted: false,
        jobs_taken: 0,
        online: false,
        current_job: None,
        first_acquire_at: None,
    };
    let config = base64::engine::general_purpose::STANDARD.encode(format!("{} {}", st.base_url, runner.id));
    let body = json!({ "runner": st.runner_json(&runner), "encoded_jit_config": config });
    st.runners.push(runner);
    Reply::json(201, body)
}

pub(super) fn list_runners(st: &State, ctx: &Ctx<'_>, scope: &Scope) -> Reply {
    let name = ctx.q("name");
    let runners: Vec<Value> = st
        .runners
        .iter()
        .filter(|r| !r.deleted && &r.scope == scope)
        .filter(|r| name.is_none_or(|n| r.name == n))
        .map(|r| st.runner_json(r))
        .collect();
    let total = runners.len();
    let (page, link) = paginate(runners, ctx);
    with_link(Reply::json(200, json!({ "total_count": total, "runners": page })), link)
}

pub(super) fn delete_runner(st: &mut State, ctx: &Ctx<'_>, scope: &Scope) -> Reply {
    let id = ctx.p_u64("runner_id");
    let Some(r) = st.runners.iter_mut().find(|r| Some(r.id) == id && !r.deleted && &r.scope == scope) else {
        return Reply::not_found();
    };
    if r.current_job.is_some() {
        return Reply::unprocessable(&format!("Bad request - Runner \"{}\" is still running a job\"", r.name));
    }
    r.deleted = true;
    Reply::empty(204)
}
