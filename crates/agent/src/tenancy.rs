//! Who may share this host with a job that runs outside the sandbox.
//!
//! A job outside the sandbox (`sandbox: none`, or an agent with `--isolation none`; only for
//! trusted origins on an agent started with `--allow-unsandboxed`) runs on the host's file
//! system, in the host's process and network namespaces, and sees every GPU node the host
//! has. Another repository's job beside it could be watched, its GPU memory read, its host
//! services reached: a trusted origin of one repository is no trusted party of another's
//! (an outsider printed another repository's secret into an unsandboxed step's log). So:
//!
//! - a job outside the sandbox starts only when no job of another repository is on the host,
//!   and no job of another repository starts while it is there;
//! - jobs inside the sandbox share the host as before, whatever their repository.
//!
//! Fairness, and why it cannot deadlock: jobs are taken in the order they arrive; a job
//! waits only for jobs that arrived *before* it ([`blocker`]), so the earliest job never
//! waits and every wait ends when an earlier job ends. A waiting unsandboxed job therefore
//! holds back later jobs of other repositories (it is not starved by a stream of them).
//!
//! The tenant is the pipeline's repository as the coordinator names it. Pipelines without one
//! (submitted through the API or `gpuci submit` outside a repository, by a token holder) are
//! one tenant together: the operator's own work.

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// One job on the host (running, or waiting to).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    pub job_id: i64,
    /// The repository; empty for pipelines without one (see the module header).
    pub owner: String,
    pub unsandboxed: bool,
}

/// The job in `earlier` that `job` must wait for, if any: one of another owner where either
/// runs outside the sandbox. `earlier` are the jobs that arrived before `job`, oldest first.
pub fn blocker<'a>(earlier: &'a [Tenant], job: &Tenant) -> Option<&'a Tenant> {
    earlier.iter().find(|e| e.owner != job.owner && (e.unsandboxed || job.unsandboxed))
}

/// The jobs on this host, in the order they arrived. One per agent.
#[derive(Default)]
pub struct Tenancy {
    jobs: Mutex<Vec<Tenant>>,
    changed: Notify,
}

/// A job's place on the host; leaving it (drop) lets jobs waiting behind it go.
pub struct Seat {
    tenancy: Arc<Tenancy>,
    job_id: i64,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.tenancy.lock().retain(|t| t.job_id != self.job_id);
        self.tenancy.changed.notify_waiters();
    }
}

impl Tenancy {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Tenant>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `job`'s place and waits until it may start; `waiting` hears once, with the job
    /// it waits for, if it must. `None`: cancelled while waiting (the place is given up).
    pub async fn enter(
        self: &Arc<Self>,
        job: Tenant,
        cancel: &CancellationToken,
        waiting: impl FnOnce(&Tenant),
    ) -> Option<Seat> {
        let job_id = job.job_id;
        self.lock().push(job);
        let seat = Seat { tenancy: self.clone(), job_id };
        let mut told = Some(waiting);
        loop {
            // Registered before the check, so an end between the check and the wait is seen.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let blocked = {
                let jobs = self.lock();
                let at = jobs.iter().position(|t| t.job_id == job_id).unwrap_or(0);
                blocker(&jobs[..at], &jobs[at]).cloned()
            };
            let Some(by) = blocked else { return Some(seat) };
            if let Some(tell) = told.take() {
                tell(&by);
            }
            tokio::select! {
                () = changed => {}
                () = cancel.cancelled() => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(job_id: i64, owner: &str, unsandboxed: bool) -> Tenant {
        Tenant { job_id, owner: owner.into(), unsandboxed }
    }

    #[test]
    fn only_an_unsandboxed_job_keeps_other_repositories_apart() {
        let sandboxed_a = t(1, "github.com/a/x", false);
        assert_eq!(blocker(std::slice::from_ref(&sandboxed_a), &t(2, "github.com/b/y", false)), None);
        assert_eq!(blocker(std::slice::from_ref(&sandboxed_a), &t(2, "github.com/a/x", true)), None, "same repository");
        assert_eq!(blocker(std::slice::from_ref(&sandboxed_a), &t(2, "github.com/b/y", true)), Some(&sandboxed_a));
        let unsandboxed_a = t(3, "github.com/a/x", true);
        assert_eq!(blocker(std::slice::from_ref(&unsandboxed_a), &t(4, "github.com/b/y", false)), Some(&unsandboxed_a));
        assert_eq!(blocker(std::slice::from_ref(&unsandboxed_a), &t(4, "github.com/a/x", false)), None);
        // A host's spelling differs: another tenant.
        assert!(blocker(&[t(5, "gitlab.com/a/x", false)], &t(6, "github.com/a/x", true)).is_some());
    }

    #[tokio::test]
    async fn an_unsandboxed_job_waits_for_another_repositorys_job_and_holds_back_later_ones() {
        let tenancy = Arc::new(Tenancy::default());
        let cancel = CancellationToken::new();
        let first = tenancy.enter(t(1, "b", false), &cancel, |_| panic!("the first job never waits")).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let (tn, c, tx2) = (tenancy.clone(), cancel.clone(), tx.clone());
        let unsandboxed = tokio::spawn(async move {
            let seat = tn.enter(t(2, "a", true), &c, |by| assert_eq!(by.job_id, 1)).await;
            tx2.send(2).unwrap();
            seat
        });
        tokio::task::yield_now().await;
        let (tn, c) = (tenancy.clone(), cancel.clone());
        let later = tokio::spawn(async move {
            let seat = tn.enter(t(3, "b", false), &c, |by| assert_eq!(by.job_id, 2)).await;
            tx.send(3).unwrap();
            seat
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(rx.try_recv().is_err(), "nothing may start beside job 1's repository's neighbour");
        drop(first);
        assert_eq!(rx.recv().await, Some(2));
        let seat2 = unsandboxed.await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(rx.try_recv().is_err(), "job 3 (another repository) must wait for the unsandboxed job");
        drop(seat2);
        assert_eq!(rx.recv().await, Some(3));
        assert!(later.await.unwrap().is_some());
    }

    #[tokio::test]
    async fn a_cancelled_wait_gives_up_its_place() {
        let tenancy = Arc::new(Tenancy::default());
        let cancel = CancellationToken::new();
        let _first = tenancy.enter(t(1, "b", false), &cancel, |_| {}).await.unwrap();
        let c2 = CancellationToken::new();
        let (tn, c) = (tenancy.clone(), c2.clone());
        let waiting = tokio::spawn(async move { tn.enter(t(2, "a", true), &c, |_| {}).await.is_none() });
        tokio::task::yield_now().await;
        c2.cancel();
        assert!(waiting.await.unwrap(), "cancelled");
        assert_eq!(tenancy.lock().len(), 1, "the cancelled job left the queue");
    }
}
