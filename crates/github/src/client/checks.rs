//! What a commit shows: check runs and commit statuses. Requests go through the client's
//! `send`, which owns credentials, retries and rate limits; a POST that creates a check run is
//! never sent twice.

use super::*;

/// GitHub rejects commit status descriptions longer than this (in characters).
const STATUS_DESCRIPTION_MAX_CHARS: usize = 140;

impl Client {
    /// Creates a check run and returns its id. Check runs are a GitHub App feature: GitHub refuses
    /// personal access tokens, so with one this fails at once with [`ApiError::AppOnly`] (use
    /// [`Client::create_status`] instead).
    pub async fn create_check_run(&self, repo: &Repo, run: &NewCheckRun) -> Result<u64, ApiError> {
        const OP: &str = "create check run";
        if !self.is_app() {
            return Err(ApiError::AppOnly { operation: OP });
        }
        let path = repo_path(OP, repo, &["check-runs"])?;
        let created: wire::CheckRun =
            self.send(OP, Method::POST, &path, &[], Auth::Repo(repo), Some(run)).await?.success()?.json()?;
        Ok(created.id)
    }

    /// Updates the fields of a check run that are set in `update` (GitHub App only, as above).
    pub async fn update_check_run(
        &self,
        repo: &Repo,
        check_run_id: u64,
        update: &CheckRunUpdate,
    ) -> Result<(), ApiError> {
        const OP: &str = "update check run";
        if !self.is_app() {
            return Err(ApiError::AppOnly { operation: OP });
        }
        let path = repo_path(OP, repo, &["check-runs", &check_run_id.to_string()])?;
        self.send(OP, Method::PATCH, &path, &[], Auth::Repo(repo), Some(update)).await?.success()?;
        Ok(())
    }

    /// Sets a commit status on `sha`. A description over GitHub's 140 characters is cut to fit (with
    /// `…`) rather than rejected, since it is only a summary.
    pub async fn create_status(&self, repo: &Repo, sha: &str, status: &CommitStatus) -> Result<(), ApiError> {
        const OP: &str = "create commit status";
        let path = repo_path(OP, repo, &["statuses", sha])?;
        let mut status = status.clone();
        if let Some(description) = &mut status.description {
            if description.chars().count() > STATUS_DESCRIPTION_MAX_CHARS {
                *description = description.chars().take(STATUS_DESCRIPTION_MAX_CHARS - 1).chain(['…']).collect();
            }
        }
        self.send(OP, Method::POST, &path, &[], Auth::Repo(repo), Some(&status)).await?.success()?;
        Ok(())
    }
}
