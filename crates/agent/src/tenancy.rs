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
//! Jobs wait in the order they arrive ([`crate::waitline`], which says why that cannot
//! deadlock): a waiting unsandboxed job holds back later jobs of other repositories (it is
//! not starved by a stream of them).
//!
//! The tenant is the pipeline's repository as the coordinator names it. Pipelines without one
//! (submitted through the API or `gpuci submit` outside a repository, by a token holder) are
//! one tenant together: the operator's own work.

use crate::waitline::{Entrant, Line, Place};

/// One job on the host (running, or waiting to).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    pub job_id: i64,
    /// The repository; empty for pipelines without one (see the module header).
    pub owner: String,
    pub unsandboxed: bool,
}

/// The jobs on this host, in the order they arrived. One per agent.
pub type Tenancy = Line<Tenant>;

/// A job's place on the host; leaving it (drop) lets jobs waiting behind it go.
pub type Seat = Place<Tenant>;

impl Entrant for Tenant {
    fn job_id(&self) -> i64 {
        self.job_id
    }

    fn waits_for(&self, earlier: &Self) -> bool {
        earlier.owner != self.owner && (earlier.unsandboxed || self.unsandboxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::waitline::blocker;
    use std::sync::Arc;
    use tokio_util::sync::CancellationToken;

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
        assert_eq!(tenancy.len(), 1, "the cancelled job left the queue");
    }
}
