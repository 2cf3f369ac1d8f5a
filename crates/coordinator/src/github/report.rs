//! Results back to GitHub: one check run (GitHub App) or commit status (token) per gpuci job,
//! plus the pipeline-level "gpuci" entry for an invalid file or a pull request waiting for
//! approval. Runs as its own task with an ordered queue, so a slow GitHub delays reports, not
//! scheduling, and a job's updates arrive in the order they happened. A report held back by
//! GitHub's rate limit waits for the time GitHub named, however long, and is not dropped; the
//! ones behind it wait with it (they would be refused until then too).

use super::config::Report;
use gpuci_core::job::JobState;
use gpuci_github::{
    CheckOutput, CheckRunUpdate, CheckStatus, Client, CommitStatus, Conclusion, NewCheckRun, Repo, StatusState,
};
use gpuci_protocol::JobId;
use gpuci_store::Store;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// One thing to tell GitHub about a commit.
#[derive(Clone, Debug)]
pub enum Item {
    /// A gpuci job's state; `soft`: a failure its step's `soft_fail` covers.
    Job { repo: Repo, sha: String, job: JobId, name: String, key: String, state: JobState, soft: bool, reason: String },
    /// The pipeline as a whole: waiting for approval, approved (its jobs report on their own),
    /// or failed (an invalid file, or gpuci could not start it).
    Pipeline { repo: Repo, sha: String, state: PipelineReport, title: String, summary: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipelineReport {
    /// Pending, never green.
    WaitingForApproval,
    Approved,
    Failed,
}

pub struct Reporter {
    pub client: Arc<Client>,
    pub store: Arc<dyn Store>,
    pub mode: Report,
    pub public_url: String,
}

const PIPELINE_CONTEXT: &str = "gpuci";

impl Reporter {
    pub async fn run(self, mut rx: mpsc::UnboundedReceiver<Item>, shutdown: CancellationToken) {
        loop {
            let item = tokio::select! {
                _ = shutdown.cancelled() => break,
                i = rx.recv() => match i { Some(i) => i, None => break },
            };
            let mut failures = 0;
            loop {
                let e = match self.send(&item).await {
                    Ok(()) => break,
                    Err(e) => e,
                };
                if e.retry_not_before().is_none() {
                    failures += 1;
                }
                let Some(at) = next_attempt(SystemTime::now(), &e, failures) else {
                    tracing::warn!(error = %e, ?item, "could not report to GitHub");
                    break;
                };
                if e.retry_not_before().is_some() {
                    tracing::info!(error = %e, "reports to GitHub wait for its rate limit");
                }
                let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }

    /// The job's dashboard page: its live log, GPUs and cost (open without sign-in for
    /// repositories in `[dashboard] public_repositories`).
    fn logs_url(&self, job: JobId) -> String {
        format!("{}/ui/jobs/{job}", self.public_url)
    }

    async fn send(&self, item: &Item) -> Result<(), gpuci_github::ApiError> {
        match (item, self.mode) {
            (Item::Job { repo, sha, job, name, key, state, soft, reason }, Report::Checks) => {
                let (status, conclusion) = check_state(*state, *soft);
                let title = if *soft { format!("{state} (soft fail)") } else { state.to_string() };
                let mut summary = reason.clone();
                if state.is_terminal() {
                    if let Ok(Some(r)) = crate::test_reports::of_job(self.store.as_ref(), *job).await {
                        summary.push_str(&crate::test_reports::markdown(&r));
                    }
                }
                let output = CheckOutput { title, summary };
                match self.store.get_check_run(*job).await.ok().flatten() {
                    Some(id) => {
                        let update = CheckRunUpdate {
                            status: Some(status),
                            conclusion,
                            details_url: Some(self.logs_url(*job)),
                            output: Some(output),
                        };
                        self.client.update_check_run(repo, id as u64, &update).await
                    }
                    None => {
                        let run = NewCheckRun {
                            name: format!("gpuci / {name}"),
                            head_sha: sha.clone(),
                            status,
                            conclusion,
                            details_url: Some(self.logs_url(*job)),
                            external_id: Some(format!("{job}:{key}")),
                            output: Some(output),
                        };
                        let id = self.client.create_check_run(repo, &run).await?;
                        if let Err(e) = self.store.set_check_run(*job, id as i64).await {
                            tracing::warn!(job, error = %e, "could not record the check run id");
                        }
                        Ok(())
                    }
                }
            }
            (Item::Job { repo, sha, job, key, state, soft, reason, .. }, Report::Statuses) => {
                let status = CommitStatus {
                    state: if *soft { StatusState::Success } else { status_state(*state) },
                    context: format!("{PIPELINE_CONTEXT}/{key}"),
                    target_url: Some(self.logs_url(*job)),
                    description: Some(if *soft {
                        format!("{state} (soft fail): {reason}")
                    } else {
                        format!("{state}: {reason}")
                    }),
                };
                self.client.create_status(repo, sha, &status).await
            }
            (Item::Pipeline { repo, sha, state, title, summary }, Report::Checks) => {
                let (status, conclusion) = match state {
                    PipelineReport::WaitingForApproval => (CheckStatus::Queued, None),
                    PipelineReport::Approved => (CheckStatus::Completed, Some(Conclusion::Success)),
                    PipelineReport::Failed => (CheckStatus::Completed, Some(Conclusion::Failure)),
                };
                let run = NewCheckRun {
                    name: PIPELINE_CONTEXT.into(),
                    head_sha: sha.clone(),
                    status,
                    conclusion,
                    details_url: None,
                    external_id: None,
                    output: Some(CheckOutput { title: title.clone(), summary: summary.clone() }),
                };
                self.client.create_check_run(repo, &run).await.map(|_| ())
            }
            (Item::Pipeline { repo, sha, state, title, .. }, Report::Statuses) => {
                let status = CommitStatus {
                    state: match state {
                        PipelineReport::WaitingForApproval => StatusState::Pending,
                        PipelineReport::Approved => StatusState::Success,
                        PipelineReport::Failed => StatusState::Failure,
                    },
                    context: PIPELINE_CONTEXT.into(),
                    target_url: None,
                    description: Some(title.clone()),
                };
                self.client.create_status(repo, sha, &status).await
            }
        }
    }
}

/// When to send a report again after `error`, or `None`: give it up. `failures` counts the
/// failures other than rate limits, this one included. A rate limit is waited out until the
/// time GitHub named, however long (dropping the report would leave a check pending forever);
/// other transient trouble gets a few quick tries, so one bad report never holds up the ones
/// behind it for long.
pub(crate) fn next_attempt(now: SystemTime, error: &gpuci_github::ApiError, failures: u32) -> Option<SystemTime> {
    if let Some(until) = error.retry_not_before() {
        return Some(until.max(now));
    }
    (error.is_transient() && (1..3).contains(&failures)).then(|| now + Duration::from_millis(500 << (failures - 1)))
}

/// A soft failure is `neutral`: shown, but it does not fail the commit.
fn check_state(s: JobState, soft: bool) -> (CheckStatus, Option<Conclusion>) {
    match s {
        JobState::Failed | JobState::TimedOut if soft => (CheckStatus::Completed, Some(Conclusion::Neutral)),
        JobState::Queued => (CheckStatus::Queued, None),
        JobState::Assigned | JobState::Running => (CheckStatus::InProgress, None),
        JobState::Succeeded => (CheckStatus::Completed, Some(Conclusion::Success)),
        JobState::Failed | JobState::Lost => (CheckStatus::Completed, Some(Conclusion::Failure)),
        JobState::Cancelled => (CheckStatus::Completed, Some(Conclusion::Cancelled)),
        JobState::TimedOut => (CheckStatus::Completed, Some(Conclusion::TimedOut)),
        JobState::Skipped => (CheckStatus::Completed, Some(Conclusion::Skipped)),
    }
}

fn status_state(s: JobState) -> StatusState {
    match s {
        JobState::Queued | JobState::Assigned | JobState::Running => StatusState::Pending,
        JobState::Succeeded | JobState::Skipped => StatusState::Success,
        JobState::Failed | JobState::Lost | JobState::Cancelled | JobState::TimedOut => StatusState::Failure,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_github::ApiError;

    /// Issue 30: a soft failure shows on the commit without failing it.
    #[test]
    fn a_soft_failure_is_a_neutral_check_run() {
        assert!(matches!(check_state(JobState::Failed, true).1, Some(Conclusion::Neutral)));
        assert!(matches!(check_state(JobState::TimedOut, true).1, Some(Conclusion::Neutral)));
        assert!(matches!(check_state(JobState::Failed, false).1, Some(Conclusion::Failure)));
        assert!(matches!(check_state(JobState::Succeeded, true).1, Some(Conclusion::Success)));
    }

    #[test]
    fn regression_issue_27_a_rate_limited_report_waits_for_githubs_time_not_our_backoff() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let until = now + Duration::from_secs(3600);
        let limited = ApiError::RateLimited { operation: "create check run", until, status: None, body: String::new() };
        assert_eq!(next_attempt(now, &limited, 0), Some(until));
        assert_eq!(next_attempt(now, &limited, 2), Some(until), "however many other failures came before");
        let past = ApiError::RateLimited {
            operation: "x",
            until: now - Duration::from_secs(1),
            status: None,
            body: String::new(),
        };
        assert_eq!(next_attempt(now, &past, 0), Some(now));

        let down = ApiError::Status {
            operation: "create check run",
            status: axum::http::StatusCode::BAD_GATEWAY,
            body: String::new(),
        };
        assert_eq!(next_attempt(now, &down, 1), Some(now + Duration::from_millis(500)));
        assert_eq!(next_attempt(now, &down, 2), Some(now + Duration::from_secs(1)));
        assert_eq!(next_attempt(now, &down, 3), None, "three tries in all");
        let denied =
            ApiError::Status { operation: "x", status: axum::http::StatusCode::FORBIDDEN, body: String::new() };
        assert_eq!(next_attempt(now, &denied, 1), None);
    }
}
