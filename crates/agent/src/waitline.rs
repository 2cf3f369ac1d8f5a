//! A line of this host's jobs in which a job may have to wait for earlier ones: the shape
//! both of [`crate::tenancy`] (a job outside the sandbox and other repositories' jobs) and of
//! [`crate::gpuhold`] (a GPU and the job that held it before) take.
//!
//! Why it cannot deadlock: jobs are taken in the order they arrive, and a job waits only for
//! jobs that arrived *before* it ([`Entrant::waits_for`] is asked of earlier ones only), so the
//! earliest job never waits and every wait ends when an earlier job leaves. A waiting job
//! holds back later jobs that would wait for it: it is not starved by a stream of them.
//!
//! One owner per line (the agent's `JobContext`); job tasks only enter and leave it.

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// A job in a line: what it is and whom it must wait for.
pub trait Entrant: Clone + Send {
    fn job_id(&self) -> i64;
    /// Whether this job must wait while `earlier` (which arrived before it) is in the line.
    fn waits_for(&self, earlier: &Self) -> bool;
}

/// The first job of `earlier` (oldest first) that `job` must wait for, if any.
pub fn blocker<'a, T: Entrant>(earlier: &'a [T], job: &T) -> Option<&'a T> {
    earlier.iter().find(|e| job.waits_for(e))
}

/// The jobs in the line, in the order they arrived.
pub struct Line<T> {
    jobs: Mutex<Vec<T>>,
    changed: Notify,
}

impl<T> Default for Line<T> {
    fn default() -> Self {
        Line { jobs: Mutex::new(Vec::new()), changed: Notify::new() }
    }
}

/// A job's place in a line; leaving it (drop) lets jobs waiting behind it go.
pub struct Place<T: Entrant> {
    line: Arc<Line<T>>,
    job_id: i64,
}

impl<T: Entrant> Drop for Place<T> {
    fn drop(&mut self) {
        self.line.lock().retain(|t| t.job_id() != self.job_id);
        self.line.changed.notify_waiters();
    }
}

impl<T: Entrant> Line<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<T>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Jobs in the line now (waiting or not).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes `job`'s place and waits until it may go on; `waiting` hears once, with the job
    /// it waits for, if it must. `None`: cancelled while waiting (the place is given up).
    pub async fn enter(
        self: &Arc<Self>,
        job: T,
        cancel: &CancellationToken,
        waiting: impl FnOnce(&T),
    ) -> Option<Place<T>> {
        let job_id = job.job_id();
        self.lock().push(job);
        let place = Place { line: self.clone(), job_id };
        let mut told = Some(waiting);
        loop {
            // Registered before the check, so a leave between the check and the wait is seen.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let blocked = {
                let jobs = self.lock();
                let at = jobs.iter().position(|t| t.job_id() == job_id).unwrap_or(0);
                blocker(&jobs[..at], &jobs[at]).cloned()
            };
            let Some(by) = blocked else { return Some(place) };
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
