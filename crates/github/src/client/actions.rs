//! GitHub Actions workflow runs and their jobs: listing, reading, cancelling. Requests go
//! through the client's `send`/`paginate`, which own credentials, retries and rate limits.

use super::*;

impl Client {
    /// Cancels a workflow run; one that already finished (409) counts as cancelled.
    pub async fn cancel_run(&self, repo: &Repo, run_id: u64) -> Result<(), ApiError> {
        const OP: &str = "cancel workflow run";
        let path = repo_path(OP, repo, &["actions", "runs", &run_id.to_string(), "cancel"])?;
        let reply = self.send(OP, Method::POST, &path, &[], Auth::Repo(repo), NO_BODY).await?;
        if reply.status != StatusCode::CONFLICT {
            reply.success()?;
        }
        Ok(())
    }

    /// GET /repos/{owner}/{repo}/actions/runs?status=..&head_sha=..&per_page=100, following pages up to 10.
    pub async fn list_runs(
        &self,
        repo: &Repo,
        status: Option<&str>,
        head_sha: Option<&str>,
    ) -> Result<Vec<WorkflowRun>, ApiError> {
        const OP: &str = "list workflow runs";
        let path = repo_path(OP, repo, &["actions", "runs"])?;
        let mut query = Vec::new();
        if let Some(status) = status {
            query.push(("status", status.to_owned()));
        }
        if let Some(head_sha) = head_sha {
            query.push(("head_sha", head_sha.to_owned()));
        }
        self.paginate(OP, &path, query, Auth::Repo(repo), |page: wire::RunPage| {
            page.workflow_runs.into_iter().map(WorkflowRun::from).collect()
        })
        .await
    }

    /// The jobs of the latest attempt of a workflow run (all pages, up to 1000 jobs).
    pub async fn list_run_jobs(&self, repo: &Repo, run_id: u64) -> Result<Vec<WorkflowJob>, ApiError> {
        const OP: &str = "list workflow run jobs";
        let path = repo_path(OP, repo, &["actions", "runs", &run_id.to_string(), "jobs"])?;
        self.paginate(OP, &path, Vec::new(), Auth::Repo(repo), |page: wire::JobPage| {
            page.jobs.into_iter().map(WorkflowJob::from).collect()
        })
        .await
    }

    pub async fn get_job(&self, repo: &Repo, job_id: u64) -> Result<WorkflowJob, ApiError> {
        const OP: &str = "get workflow job";
        let path = repo_path(OP, repo, &["actions", "jobs", &job_id.to_string()])?;
        let job: wire::WorkflowJob =
            self.send(OP, Method::GET, &path, &[], Auth::Repo(repo), NO_BODY).await?.success()?.json()?;
        Ok(job.into())
    }
}
