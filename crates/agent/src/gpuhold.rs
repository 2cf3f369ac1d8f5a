//! A GPU is one job's from before its pre-job check until after its post-job check: a job
//! given a GPU whose former job on this agent is still ending waits for that end.
//!
//! The coordinator can hand a GPU out again while its former job still runs here: it ended
//! that job while the agent was away (declared lost, or cancelled), and tells the agent to
//! kill it on its return, in the same breath as it assigns the next job (outsider attack:
//! the next job came 11–17 ms after the cancel). Started at once, the new job's pre-job check
//! would find the old job's memory on the GPU and quarantine a healthy GPU, and the old job's
//! post-job check kills every process on the GPU — the new job's too. So a job takes its
//! GPUs in the order jobs arrive ([`crate::waitline`]) and says in its log whom it waits for.
//! Jobs without GPUs never wait here.

use crate::waitline::{Entrant, Line, Place};

/// A job and the GPUs (by UUID) it was given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuClaim {
    pub job_id: i64,
    pub gpus: Vec<String>,
}

impl Entrant for GpuClaim {
    fn job_id(&self) -> i64 {
        self.job_id
    }

    fn waits_for(&self, earlier: &Self) -> bool {
        earlier.gpus.iter().any(|g| self.gpus.contains(g))
    }
}

/// The agent's GPUs and the jobs that hold them or wait for them.
pub type GpuHolds = Line<GpuClaim>;

/// A job's hold on its GPUs; dropped after its post-job check.
pub type Held = Place<GpuClaim>;

/// The GPUs `by` holds that `job` waits for, for the log.
pub fn shared(job: &GpuClaim, by: &GpuClaim) -> Vec<String> {
    job.gpus.iter().filter(|g| by.gpus.contains(g)).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::waitline::blocker;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    fn c(job_id: i64, gpus: &[&str]) -> GpuClaim {
        GpuClaim { job_id, gpus: gpus.iter().map(|g| g.to_string()).collect() }
    }

    #[test]
    fn a_job_waits_only_for_earlier_jobs_on_one_of_its_gpus() {
        let earlier = [c(1, &["GPU-a", "GPU-b"]), c(2, &["GPU-c"])];
        assert_eq!(blocker(&earlier, &c(3, &["GPU-b"])), Some(&earlier[0]));
        assert_eq!(blocker(&earlier, &c(3, &["GPU-c", "GPU-d"])), Some(&earlier[1]));
        assert_eq!(blocker(&earlier, &c(3, &["GPU-d"])), None);
        assert_eq!(blocker(&earlier, &c(3, &[])), None, "a job without GPUs never waits");
        assert_eq!(shared(&c(3, &["GPU-b", "GPU-c"]), &earlier[0]), ["GPU-b"]);
    }

    #[tokio::test]
    async fn a_gpu_goes_to_its_next_job_only_when_the_former_one_has_left() {
        let holds = Arc::new(GpuHolds::default());
        let cancel = CancellationToken::new();
        let former = holds.enter(c(1, &["GPU-a"]), &cancel, |_| panic!("nothing held it")).await.unwrap();
        let beside = holds.enter(c(2, &["GPU-b"]), &cancel, |_| panic!("another GPU")).await.unwrap();
        let (h, k) = (holds.clone(), cancel.clone());
        let (told_tx, told_rx) = tokio::sync::oneshot::channel();
        let next = tokio::spawn(async move {
            h.enter(c(3, &["GPU-a", "GPU-b"]), &k, |by| told_tx.send(by.job_id).unwrap()).await.is_some()
        });
        assert_eq!(told_rx.await.unwrap(), 1, "told whom it waits for");
        drop(former);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!next.is_finished(), "GPU-b is still job 2's");
        drop(beside);
        assert!(tokio::time::timeout(Duration::from_secs(5), next).await.unwrap().unwrap());
    }

    #[tokio::test]
    async fn a_job_cancelled_while_it_waits_leaves_the_line() {
        let holds = Arc::new(GpuHolds::default());
        let _former = holds.enter(c(1, &["GPU-a"]), &CancellationToken::new(), |_| {}).await.unwrap();
        let cancel = CancellationToken::new();
        let (h, k) = (holds.clone(), cancel.clone());
        let waiting = tokio::spawn(async move { h.enter(c(2, &["GPU-a"]), &k, |_| {}).await.is_none() });
        tokio::time::sleep(Duration::from_millis(20)).await;
        cancel.cancel();
        assert!(waiting.await.unwrap(), "gave up");
        assert_eq!(holds.len(), 1, "only the former job is left");
    }
}
