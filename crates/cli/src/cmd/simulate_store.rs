//! `gpuci simulate --config server.toml --from-store DB`: the coordinator's own job history,
//! read from its store, as the trace to replay (`gpuci_simulate::history`).
//!
//! Read-only: a SQLite file is copied (with its `-wal` file, so what was committed there is
//! seen) into a temporary directory and the copy is opened, so neither the file nor a running
//! coordinator's locks are touched; a Postgres database is read through the store's own
//! connection (which refuses a database without gpuci's tables and, like any gpuci binary,
//! applies pending migrations when this binary is newer than the database: run it with the
//! coordinator's version). Only the store's read API is used.

use gpuci_core::fleet::{fits, FleetSpec};
use gpuci_core::placement::{Deadline, Needs};
use gpuci_simulate::history::{replay, PastJob, Replay};
use gpuci_store::{JobRecord, Store};
use std::path::Path;

/// Where the history comes from: a `postgres://` URL, else a SQLite file.
pub async fn open(source: &str) -> Result<(Box<dyn Store>, Option<tempfile::TempDir>), String> {
    if source.starts_with("postgres://") || source.starts_with("postgresql://") {
        let store = gpuci_store::PostgresStore::connect_existing(source)
            .await
            .map_err(|e| format!("--from-store {}: {e}", gpuci_store::redact_url(source)))?;
        return Ok((Box::new(store), None));
    }
    let path = Path::new(source);
    if !path.is_file() {
        return Err(format!("--from-store {source}: no such SQLite file (or give a postgres:// URL)"));
    }
    let dir = tempfile::tempdir().map_err(|e| format!("--from-store: cannot make a temporary directory: {e}"))?;
    let copy = dir.path().join("gpuci.db");
    std::fs::copy(path, &copy).map_err(|e| format!("--from-store {source}: cannot copy it: {e}"))?;
    let wal = path.with_file_name(format!("{}-wal", path.file_name().and_then(|n| n.to_str()).unwrap_or("")));
    if wal.is_file() {
        std::fs::copy(&wal, dir.path().join("gpuci.db-wal"))
            .map_err(|e| format!("--from-store {}: cannot copy it: {e}", wal.display()))?;
    }
    let store =
        gpuci_store::SqliteStore::open_existing(&copy).await.map_err(|e| format!("--from-store {source}: {e}"))?;
    Ok((Box::new(store), Some(dir)))
}

/// [`open`] and [`read`] from sync code, on a thread of its own with its own runtime (the CLI
/// may already run inside one, where blocking on another would panic).
pub fn load(source: &str, fleets: &[FleetSpec], since_ms: i64) -> Result<Replay, String> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("--from-store: cannot start a runtime: {e}"))?;
            rt.block_on(async {
                let (store, _copy) = open(source).await?;
                read(store.as_ref(), fleets, since_ms).await
            })
        })
        .join()
        .unwrap_or_else(|_| Err("--from-store: reading the store failed".to_string()))
    })
}

/// The jobs that ran since `since_ms`, each with the first fleet of `fleets` it fits.
pub async fn read(store: &dyn Store, fleets: &[FleetSpec], since_ms: i64) -> Result<Replay, String> {
    let jobs = store.jobs_ran_since(since_ms).await.map_err(|e| format!("--from-store: reading jobs: {e}"))?;
    Ok(replay(&jobs.iter().filter(|j| j.created_at_ms >= since_ms).map(|j| past(j, fleets)).collect::<Vec<_>>()))
}

fn past(j: &JobRecord, fleets: &[FleetSpec]) -> PastJob {
    let needs = Needs {
        tags: &j.step.agents,
        gpu: &j.step.gpu,
        container: j.step.image.is_some(),
        deadline: j.step.timeout.map(|t| Deadline { now_ms: 0, runs_for_ms: t.as_std().as_millis() as u64 }),
    };
    let fleet =
        if j.step.gpu.count == 0 { None } else { fleets.iter().find(|f| fits(f, &needs)).map(|f| f.name.clone()) };
    PastJob {
        id: j.id,
        pipeline: j.pipeline_id,
        step: j.step.key.clone(),
        depends_on: j.step.depends_on.clone(),
        gpus: j.step.gpu.count,
        fleet,
        created_ms: j.created_at_ms,
        started_ms: j.started_at_ms,
        ended_ms: j.finished_at_ms,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use gpuci_core::job::JobState;
    use gpuci_core::pipeline::Step;
    use gpuci_store::{JobChange, NewJob, NewPipeline};
    use std::collections::BTreeMap;

    const FLEETS: &str = r#"
[[fleet]]
name = "t4"
provider = "exec"
max = 2
[fleet.settings]
stop = true
[fleet.machine]
gpu_model = "NVIDIA T4"
gpus = 1
gpu_memory = "16GiB"
cpus = 4
memory = "16GiB"
[[fleet.offer]]
instance_type = "t4-box"
price_per_hour = 0.5
[fleet.simulate]
boot = "fixed 60s"
capacity_outages_per_day = 0
"#;

    /// A store filled through the store API (a build, a GPU test waiting on it, a GPU job no
    /// fleet fits, one never started) replays as the trace of what ran, through the
    /// simulator with the config's fleets; the database file is left as it was.
    #[tokio::test]
    async fn a_stores_history_replays_through_the_simulator_and_the_file_is_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("gpuci.db");
        let t0: i64 = 1_704_103_200_000;
        {
            let s = gpuci_store::SqliteStore::open(&db).await.unwrap();
            let step = |key: &str, gpus: u32, after: &[&str]| {
                let mut st = Step::new(key.to_string(), "true");
                st.gpu.count = gpus;
                st.depends_on = after.iter().map(|a| a.to_string()).collect();
                st
            };
            let new = |st: Step| NewJob {
                pipeline_id: 0,
                step: st,
                env: BTreeMap::new(),
                state: JobState::Queued,
                reason: "queued".into(),
                attempt: 1,
                retry_of: None,
                created_at_ms: t0,
            };
            let mut big = step("big", 8, &[]);
            big.gpu.count = 8;
            let p = NewPipeline {
                file_name: ".gpuci.yml".into(),
                source: String::new(),
                workspace_upload: None,
                repository: None,
                origin: None,
                created_at_ms: t0,
            };
            let jobs =
                vec![new(step("build", 0, &[])), new(step("test", 1, &["build"])), new(big), new(step("lint", 1, &[]))];
            let (_, jobs) = s.create_pipeline(p, jobs).await.unwrap();
            for (j, (start, end)) in jobs.iter().zip([(1i64, 121i64), (130, 430), (2, 10)]) {
                let run = |state, at: i64| JobChange {
                    state: Some(state),
                    started_at_ms: (state == JobState::Running).then_some(t0 + at * 1000),
                    finished_at_ms: (state == JobState::Succeeded).then_some(t0 + at * 1000),
                    ..JobChange::default()
                };
                s.update_job(j.id, &[JobState::Queued], run(JobState::Running, start)).await.unwrap();
                s.update_job(j.id, &[JobState::Running], run(JobState::Succeeded, end)).await.unwrap();
            }
        }
        // The filling store closes its pool in the background: wait until its files stop changing.
        let files = || {
            let wal = dir.path().join("gpuci.db-wal");
            (std::fs::read(&db).unwrap(), std::fs::read(&wal).unwrap_or_default())
        };
        let mut before = files();
        for _ in 0..50 {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            let now = files();
            if now == before {
                break;
            }
            before = now;
        }
        let fleets = gpuci_core::fleet::parse_fleets("server.toml", FLEETS).unwrap();
        let (store, _copy) = open(db.to_str().unwrap()).await.unwrap();
        let r = read(store.as_ref(), &fleets, t0 - 1).await.unwrap();
        // The job that never started is not read at all (the store gives the jobs that ran).
        assert_eq!((r.no_fleet, r.not_run, r.epoch), (1, 0, 1_704_103_200));
        let rows: Vec<(&str, u64, u32, &[String])> =
            r.jobs.iter().map(|j| (j.pool.as_str(), j.duration_s, j.gpus, j.after.as_slice())).collect();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].0, rows[0].1, rows[0].2), (gpuci_simulate::history::NO_GPU_POOL, 120, 0));
        assert_eq!((rows[1].0, rows[1].1, rows[1].2, rows[1].3), ("t4", 300, 1, &[r.jobs[0].id.clone()][..]));
        drop(store);
        assert!(files() == before, "the store's files are only read");

        // Replayed: the test waits for the build (120 s) and a 60 s boot that starts as the
        // build ends at the earliest: the fan-out rule asks for it a boot ahead.
        let opts = gpuci_simulate::CliOptions { epoch: r.epoch, ..Default::default() };
        let csv = gpuci_simulate::trace::to_csv(&r.jobs);
        let report = gpuci_simulate::run_cli(FLEETS, "server.toml", &csv, "store", &opts).unwrap();
        let gpuci = report.runs.iter().find(|p| p.policy == gpuci_simulate::Policy::Gpuci).unwrap();
        assert_eq!(gpuci.total.jobs, 1);
        assert!(gpuci.total.paid_gpu_hours > 0.0);
        assert!(gpuci.total.wait_p95_s <= 60, "{}", gpuci.total.wait_p95_s);

        // What `gpuci simulate --from-store` calls, from inside a runtime as the CLI is.
        assert_eq!(load(db.to_str().unwrap(), &fleets, t0 - 1).unwrap(), r);

        // Not a store: a clear error naming it.
        let e = open(dir.path().join("none.db").to_str().unwrap()).await.err().unwrap();
        assert!(e.contains("none.db: no such SQLite file"), "{e}");
    }
}
