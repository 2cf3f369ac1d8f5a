//! The store test suite. Every backend runs the same checks: SQLite (a file in a temp dir,
//! WAL, as in production, plus the in-memory variant) and Postgres (a real throwaway server,
//! see `common/pg.rs`; skipped with a message where Postgres is not installed, unless CI=true).
//! One binary (each links the whole store), one module per area of the store.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "../common/pg.rs"]
mod pg;

use gpuci_core::job::JobState;
use gpuci_core::pipeline::Step;
use gpuci_store::*;
use std::collections::BTreeMap;

mod artifacts;
mod audit;
mod failover;
mod github;
mod group_commit;
mod job_tokens;
mod jobs;
mod machines;
mod schedules;
mod sealing;
mod unenforced;
mod uploads;

fn new_job(key: &str) -> NewJob {
    NewJob {
        pipeline_id: 0,
        step: Step::new(key, "echo hi"),
        env: BTreeMap::from([("A".into(), "1".into())]),
        state: JobState::Queued,
        reason: "waiting".into(),
        attempt: 1,
        retry_of: None,
        created_at_ms: 1000,
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos() as u64)
}
