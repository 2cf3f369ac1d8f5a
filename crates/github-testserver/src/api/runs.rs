//! Workflow runs: listing them and cancelling one (which ends its jobs and sends their webhooks).

use super::*;

pub(super) fn cancel_run(inner: &Inner, st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let Some(run_id) =
        ctx.p_u64("run_id").filter(|id| st.runs.get(id).is_some_and(|r| r.repo.eq_ignore_ascii_case(&repo)))
    else {
        return Reply::not_found();
    };
    if st.run_status(run_id).0 == "completed" {
        return Reply::error(409, "Cannot cancel a workflow run that is completed.");
    }
    let t = now();
    if let Some(run) = st.runs.get_mut(&run_id) {
        run.cancelled = true;
        run.updated_at = t;
    }
    let ids: Vec<u64> =
        st.jobs.values().filter(|j| j.run_id == run_id && j.status != "completed").map(|j| j.id).collect();
    for id in ids {
        if let Some(j) = st.jobs.get_mut(&id) {
            j.status = "completed".into();
            j.conclusion = Some("cancelled".into());
            j.completed_at = Some(t);
        }
        inner.job_webhook(st, id, "completed");
    }
    Reply::json(202, json!({}))
}

pub(super) fn list_runs(st: &mut State, ctx: &Ctx<'_>) -> Reply {
    let repo = ctx.repo();
    let ids: Vec<u64> = st.runs.values().rev().filter(|r| r.repo.eq_ignore_ascii_case(&repo)).map(|r| r.id).collect();
    let mut selected = Vec::new();
    for id in ids {
        let (status, conclusion) = st.run_status(id);
        let Some(run) = st.runs.get(&id) else { continue };
        let keep = ctx.q("status").is_none_or(|s| s == status || conclusion.as_deref() == Some(s))
            && ctx.q("head_sha").is_none_or(|s| s == run.head_sha)
            && ctx.q("branch").is_none_or(|b| b == run.head_branch)
            && ctx.q("event").is_none_or(|e| e == run.event);
        if keep {
            selected.push(id);
        }
    }
    let total = selected.len();
    let (page, link) = paginate(selected, ctx);
    let runs: Vec<Value> = page.into_iter().map(|id| st.run_json(id)).collect();
    with_link(Reply::json(200, json!({ "total_count": total, "workflow_runs": runs })), link)
}
