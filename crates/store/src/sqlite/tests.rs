//! The SQLite backend's own tests: what only a file on a disk can show (a full disk, a damaged
//! file). The behaviour both backends share is held by the crate's common store suite.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use super::*;
use gpuci_core::pipeline::Step;
use std::io::Write;
use std::path::PathBuf;

/// A small tmpfs of its own, so a test can fill the disk under the database. Mounting
/// needs root: under CI (`CI=true`) a test that cannot mount fails; elsewhere it is
/// skipped with a note.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::Builder::new().prefix("gpuci-small-disk-").tempdir().unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
            .arg(dir.path())
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallDisk { dir }),
            other => {
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                    Err(e) => e.to_string(),
                };
                assert!(
                    std::env::var("CI").as_deref() != Ok("true"),
                    "CI=true but a tmpfs cannot be mounted ({why}); these tests run as root"
                );
                eprintln!("note: skipped: cannot mount a small tmpfs ({why}); run as root to fill a disk");
                None
            }
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Write a file until the disk is full; returns it (remove it to free the space).
    fn fill(&self) -> PathBuf {
        let path = self.path().join("filler");
        let mut f = std::fs::File::create(&path).unwrap();
        for chunk in [64 * 1024, 512, 1] {
            let buf = vec![0u8; chunk];
            while f.write_all(&buf).is_ok() {}
        }
        let _ = f.sync_all();
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

fn pipeline(name: &str) -> NewPipeline {
    NewPipeline {
        file_name: name.into(),
        source: "steps: []".into(),
        workspace_upload: None,
        repository: None,
        origin: None,
        created_at_ms: 1,
    }
}

fn job(key: &str) -> NewJob {
    NewJob {
        pipeline_id: 0,
        step: Step::new(key, "true"),
        env: Default::default(),
        state: JobState::Queued,
        reason: "queued".into(),
        attempt: 1,
        retry_of: None,
        created_at_ms: 1,
    }
}

/// Regression (issue 10, item 3): after a commit failed on a full disk, sqlx kept counting
/// the transaction SQLite had rolled back, and every later "commit" returned Ok without
/// reaching the file, also once space was back.
#[tokio::test]
async fn after_a_full_disk_every_write_that_returns_ok_is_durable() {
    let Some(disk) = SmallDisk::mount("2m") else { return };
    let path = disk.path().join("gpuci.db");
    let s = SqliteStore::open(&path).await.unwrap();
    let (before, _) = s.create_pipeline(pipeline("before.yml"), vec![job("a")]).await.unwrap();

    let filler = disk.fill();
    for i in 0..3 {
        let e = s.create_pipeline(pipeline("full.yml"), vec![job("a")]).await.unwrap_err();
        assert!(e.is_unavailable(), "attempt {i}: {e}");
        assert_eq!(e.reason(), "database or disk is full", "attempt {i}");
        assert!(e.to_string().contains("(SQLite code 13)"), "{e}");
    }
    std::fs::remove_file(filler).unwrap();

    // Space is back: the same store writes again, and what it says it stored is there.
    let (after, jobs) = s.create_pipeline(pipeline("after.yml"), vec![job("a")]).await.unwrap();
    assert!(
        s.get_pipeline(after.id).await.unwrap().is_some(),
        "pipeline {} was acknowledged but is not stored",
        after.id
    );
    let done = JobChange {
        state: Some(JobState::Succeeded),
        reason: Some("exited with code 0".into()),
        finished_at_ms: Some(2),
        ..Default::default()
    };
    s.update_job(jobs[0].id, &[JobState::Queued], done).await.unwrap();
    assert_eq!(s.get_job(jobs[0].id).await.unwrap().unwrap().state, JobState::Succeeded);
    drop(s);

    let s = SqliteStore::open(&path).await.unwrap();
    let names: Vec<String> = s.list_pipelines(10).await.unwrap().into_iter().map(|p| p.file_name).collect();
    assert_eq!(names, ["after.yml", "before.yml"]);
    assert!(s.get_pipeline(before.id).await.unwrap().is_some());
    assert_eq!(s.get_job(jobs[0].id).await.unwrap().unwrap().state, JobState::Succeeded);
}

/// A job's end and its retry are one write: when it fails, neither is stored.
#[tokio::test]
async fn a_job_ends_with_its_retry_or_not_at_all() {
    let Some(disk) = SmallDisk::mount("2m") else { return };
    let s = SqliteStore::open(&disk.path().join("gpuci.db")).await.unwrap();
    let (_, jobs) = s.create_pipeline(pipeline("p.yml"), vec![job("a")]).await.unwrap();
    let failed = || JobChange { state: Some(JobState::Failed), reason: Some("exit 1".into()), ..Default::default() };
    let retry = NewJob { pipeline_id: jobs[0].pipeline_id, attempt: 2, retry_of: Some(jobs[0].id), ..job("a") };

    let filler = disk.fill();
    let e = s.update_job_and_insert(jobs[0].id, &[JobState::Queued], failed(), retry.clone()).await.unwrap_err();
    assert!(e.is_unavailable(), "{e}");
    std::fs::remove_file(filler).unwrap();
    let all = s.pipeline_jobs(jobs[0].pipeline_id).await.unwrap();
    assert_eq!((all.len(), all[0].state), (1, JobState::Queued), "{all:?}");

    let (ended, next) = s.update_job_and_insert(jobs[0].id, &[JobState::Queued], failed(), retry).await.unwrap();
    assert_eq!((ended.state, next.state, next.retry_of), (JobState::Failed, JobState::Queued, Some(ended.id)));
    assert_eq!(s.pipeline_jobs(jobs[0].pipeline_id).await.unwrap().len(), 2);
}

/// A file that is not a database says so once, and is recognised as damaged.
#[tokio::test]
async fn a_damaged_file_is_refused_and_said_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuci.db");
    std::fs::write(&path, vec![0x5a; 8192]).unwrap();
    let Err(e) = SqliteStore::open(&path).await else { panic!("a damaged file opened") };
    assert!(e.is_damaged() && !e.is_unavailable(), "{e}");
    let text = e.to_string();
    assert_eq!(text.matches("file is not a database").count(), 1, "{text}");
    assert!(std::error::Error::source(&e).is_none(), "the chain would repeat it: {text}");
}

/// The in-memory database lives as long as the store, not as long as a connection: the pool
/// replaces connections (one it found broken after an abandoned request, or one past sqlx's
/// idle and lifetime limits, 10 and 30 minutes by default), and the last connection to an
/// in-memory database closing destroys it, so a long `gpuci run` lost every job and the
/// next request failed with "no such table".
#[tokio::test]
async fn the_in_memory_database_outlives_the_connections_of_its_pool() {
    let s = SqliteStore::in_memory().await.unwrap();
    let (_, jobs) = s
        .create_pipeline(
            NewPipeline {
                file_name: "p.yml".into(),
                source: String::new(),
                workspace_upload: None,
                repository: None,
                origin: None,
                created_at_ms: 1,
            },
            vec![NewJob {
                pipeline_id: 0,
                step: Step::new("k", "true"),
                env: Default::default(),
                state: gpuci_core::job::JobState::Queued,
                reason: "queued".into(),
                attempt: 1,
                retry_of: None,
                created_at_ms: 1,
            }],
        )
        .await
        .unwrap();
    // The pool's connection closed, as the pool itself closes one it retires.
    s.pool.acquire().await.unwrap().close().await.unwrap();
    let job = s.get_job(jobs[0].id).await.expect("the database is still there");
    assert_eq!(job.map(|j| j.id), Some(jobs[0].id));
}
