//! The fake runner's protocol and archive downloads under `/_test/...`: not GitHub API, so not
//! validated or recorded. A runner long-polls for its job and reports how it ended.

use super::*;

pub(super) async fn test_route(
    inner: &Arc<Inner>,
    method: &Method,
    rest: &str,
    query: &[(String, String)],
) -> Response {
    let parts: Vec<&str> = rest.split('/').collect();
    let q = |name: &str| query.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let text = |status: u16, body: String| {
        Response::builder()
            .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
            .header("content-type", "text/plain; charset=utf-8")
            .body(Body::from(body))
            .unwrap_or_else(|_| Response::new(Body::empty()))
    };
    match (method.as_str(), parts.as_slice()) {
        ("POST", ["runners", id, "acquire"]) => {
            let Ok(id) = id.parse::<u64>() else { return text(404, "no such runner\n".into()) };
            let (status, body) = acquire(inner, id).await;
            text(status, body)
        }
        ("POST", ["runners", id, "complete"]) => {
            let id = id.parse::<u64>().unwrap_or(0);
            let job = q("job").and_then(|j| j.parse::<u64>().ok()).unwrap_or(0);
            let exit = q("exit").and_then(|e| e.parse::<i32>().ok()).unwrap_or(1);
            let (status, body) = complete(inner, id, job, exit);
            text(status, body)
        }
        ("GET", ["jobs", id, "status"]) => {
            let st = lock(&inner.state);
            match id.parse::<u64>().ok().and_then(|id| st.jobs.get(&id)) {
                Some(j) => text(200, format!("{}\n", j.status)),
                None => text(404, "no such job\n".into()),
            }
        }
        ("GET", ["codeload", owner, repo, sha]) => {
            let files = {
                let st = lock(&inner.state);
                st.repo(&format!("{owner}/{repo}")).and_then(|r| r.trees.get(*sha).cloned())
            };
            let Some(files) = files else { return text(404, "Not Found\n".into()) };
            match crate::tarball::build(owner, repo, sha, &files) {
                Ok(bytes) => Response::builder()
                    .status(200)
                    .header("content-type", "application/x-gzip")
                    .header(
                        "content-disposition",
                        format!("attachment; filename={owner}-{repo}-{}.tar.gz", &sha[..7.min(sha.len())]),
                    )
                    .body(Body::from(bytes))
                    .unwrap_or_else(|_| Response::new(Body::empty())),
                Err(e) => text(500, format!("archive: {e}\n")),
            }
        }
        _ => text(404, "no such test endpoint\n".into()),
    }
}

/// How long an acquire request waits for a job before answering 204, like the runner's long poll.
const LONG_POLL: Duration = Duration::from_secs(2);

/// Hands runner `id` the oldest queued job it can run (200: `JOB_ID<TAB>RUN_ID<TAB>NAME\n` then the script),
/// 204 when none came within [`LONG_POLL`], 410 when the runner was deleted.
async fn acquire(inner: &Inner, id: u64) -> (u16, String) {
    let deadline = tokio::time::Instant::now() + LONG_POLL;
    loop {
        {
            let mut guard = lock(&inner.state);
            let st = &mut *guard;
            let Some(idx) = st.runners.iter().position(|r| r.id == id) else {
                return (404, "no such runner\n".into());
            };
            if st.runners[idx].deleted {
                return (410, "runner was deleted\n".into());
            }
            st.runners[idx].online = true;
            st.runners[idx].first_acquire_at.get_or_insert_with(std::time::SystemTime::now);
            if let Some(job_id) = st.runners[idx].current_job {
                // A retried acquire after a lost answer gets the same job again.
                if let Some(j) = st.jobs.get(&job_id) {
                    return (200, format!("{}\t{}\t{}\n{}", j.id, j.run_id, j.name, j.script));
                }
            }
            let runner = &st.runners[idx];
            let candidate = st
                .jobs
                .values()
                .filter(|j| j.status == "queued" && runner.scope.covers(&j.repo) && runner.fits(&j.labels))
                .filter(|j| !st.runs.get(&j.run_id).is_some_and(|r| r.cancelled))
                .min_by_key(|j| (j.created_at, j.id))
                .map(|j| j.id);
            if let Some(job_id) = candidate {
                let (rid, rname, rgroup) = (runner.id, runner.name.clone(), runner.runner_group_id);
                let t = now();
                let reply = {
                    let Some(j) = st.jobs.get_mut(&job_id) else { continue };
                    j.status = "in_progress".into();
                    j.runner_id = Some(rid);
                    j.runner_name = Some(rname);
                    j.runner_group_id = Some(rgroup);
                    j.started_at = Some(t);
                    format!("{}\t{}\t{}\n{}", j.id, j.run_id, j.name, j.script)
                };
                let run_id = st.jobs.get(&job_id).map(|j| j.run_id).unwrap_or_default();
                if let Some(run) = st.runs.get_mut(&run_id) {
                    run.updated_at = t;
                }
                let r = &mut st.runners[idx];
                r.current_job = Some(job_id);
                r.jobs_taken += 1;
                inner.job_webhook(st, job_id, "in_progress");
                return (200, reply);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return (204, String::new());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The runner finished `job_id` with `exit`: the job completes (unless a cancel got there first) and
/// the just-in-time runner is removed, as GitHub removes an ephemeral runner after its one job.
fn complete(inner: &Inner, runner_id: u64, job_id: u64, exit: i32) -> (u16, String) {
    let mut guard = lock(&inner.state);
    let st = &mut *guard;
    let Some(idx) = st.runners.iter().position(|r| r.id == runner_id) else {
        return (404, "no such runner\n".into());
    };
    if st.runners[idx].current_job != Some(job_id) {
        return (409, "this runner does not hold that job\n".into());
    }
    let t = now();
    let mut send = false;
    if let Some(j) = st.jobs.get_mut(&job_id) {
        if j.status != "completed" {
            j.status = "completed".into();
            j.conclusion = Some(if exit == 0 { "success" } else { "failure" }.into());
            j.completed_at = Some(t);
            send = true;
        }
    }
    let run_id = st.jobs.get(&job_id).map(|j| j.run_id).unwrap_or_default();
    if let Some(run) = st.runs.get_mut(&run_id) {
        run.updated_at = t;
    }
    let r = &mut st.runners[idx];
    r.current_job = None;
    r.deleted = true;
    if send {
        inner.job_webhook(st, job_id, "completed");
    }
    (204, String::new())
}
