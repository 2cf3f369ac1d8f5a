//! One long-lived thread that forks the processes which outlive the request that made them.
//!
//! A parent-death signal (`PR_SET_PDEATHSIG`, which bwrap's `--die-with-parent` sets) fires
//! when the *thread* that forked the process exits, not the process. A job started ahead of
//! time (see `warm.rs`) is forked long before it runs, from whichever task prepared it; a tokio
//! blocking thread exits when idle and would take the job with it. Forks that must outlive
//! their caller go through this thread, which lives as long as the process.
//!
//! It runs one request at a time, in order; a request is a closure that forks and returns.

use std::sync::mpsc;
use std::sync::OnceLock;

type Task = Box<dyn FnOnce() + Send + 'static>;

fn sender() -> Option<&'static mpsc::Sender<Task>> {
    static TX: OnceLock<Option<mpsc::Sender<Task>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Task>();
        let started = std::thread::Builder::new().name("gpuci-spawner".into()).spawn(move || {
            for task in rx {
                // A panicking request must not take the thread (and every later fork) down.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
            }
        });
        match started {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::error!(error = %e, "could not start the spawner thread; jobs start the slow way");
                None
            }
        }
    })
    .as_ref()
}

/// Runs `f` on the spawner thread, inside the caller's tokio runtime (tokio process handles
/// made there belong to it). `None` when the thread is unavailable or `f` panicked.
pub(crate) async fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let handle = tokio::runtime::Handle::current();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task: Task = Box::new(move || {
        let _entered = handle.enter();
        let _ = tx.send(f());
    });
    sender()?.send(task).ok()?;
    rx.await.ok()
}

/// As [`run`], from synchronous code (no tokio runtime needed: for `std::process` forks).
/// Must not be called from the spawner thread itself.
pub(crate) fn run_sync<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    let task: Task = Box::new(move || {
        let _ = tx.send(f());
    });
    sender()?.send(task).ok()?;
    rx.recv().ok()
}
