//! The command loop ([`Brain::run`]) with nothing to handle: it writes the waiting jobs'
//! reasons the passes left unwritten.

use super::tests::one_gpu_jobs;
use super::*;

/// Reasons a pass left unwritten (it placed a job, so it told one) are written by the loop
/// when no command comes: every waiting job is told why without another pass.
#[tokio::test]
async fn an_idle_loop_writes_the_reasons_the_passes_left() {
    let (store, jobs, mut brain) = one_gpu_jobs(5).await;
    brain.reasons_per_write = 1;
    let (_tx, rx) = mpsc::channel(8);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(brain.run(rx, shutdown.clone()));
    let mut told = 0;
    for _ in 0..200 {
        told = 0;
        for j in &jobs[1..] {
            told += usize::from(store.get_job(j.id).await.unwrap().unwrap().reason.contains("leased"));
        }
        if told == jobs.len() - 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    running.await.unwrap();
    assert_eq!(told, 4, "every waiting job told, one write at a time, with no command");
}
