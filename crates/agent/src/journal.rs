//! The agent's journal: what it must remember across its own death (SIGKILL, crash, reboot).
//!
//! One JSON record per line, appended to `<data dir>/journal`:
//! - `received`: an assignment arrived. Written and synced before anything of the job starts,
//!   so a job the journal does not name never ran here, and the coordinator may requeue it.
//! - `started`: its process started (pid, time).
//! - `finished`: its result. Synced before it is sent.
//! - `done`: the coordinator acknowledged the result; the job is forgotten.
//!
//! After a restart [`recover`] turns the journal into what the agent still owes the
//! coordinator: for each job not `done`, its start (if any) and its result — the recorded one,
//! or, when the job was still running, `lost` (its process died with the agent; the new run's
//! sweep has killed whatever was left). The file is then rewritten with only those jobs.
//!
//! Effects are in [`Journal`]; [`recover`] is pure.

use gpuci_core::job::Outcome;
use gpuci_protocol::agent::{JobEvent, JobFinished};
use gpuci_protocol::JobId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    Received {
        job_id: JobId,
        /// When it arrived: the start time of a job the agent died while starting.
        #[serde(default)]
        at_us: i64,
    },
    Started {
        job_id: JobId,
        pid: u32,
        started_at_us: i64,
    },
    Finished(JobFinished),
    Done {
        job_id: JobId,
    },
}

/// One job as the journal knows it.
#[derive(Clone, Debug, Default, PartialEq)]
struct Known {
    received_at_us: i64,
    started: Option<(u32, i64)>,
    finished: Option<JobFinished>,
}

/// What a restarted agent owes the coordinator, job by job (ascending id): the events to send
/// again, in order, ending with each job's result.
pub fn recover(records: &[Record], now_us: i64) -> BTreeMap<JobId, Vec<JobEvent>> {
    let mut jobs: BTreeMap<JobId, Known> = BTreeMap::new();
    for r in records {
        match r {
            Record::Received { job_id, at_us } => {
                jobs.entry(*job_id).or_default().received_at_us = *at_us;
            }
            Record::Started { job_id, pid, started_at_us } => {
                if let Some(k) = jobs.get_mut(job_id) {
                    k.started = Some((*pid, *started_at_us));
                }
            }
            Record::Finished(f) => {
                if let Some(k) = jobs.get_mut(&f.job_id) {
                    k.finished = Some(f.clone());
                }
            }
            Record::Done { job_id } => {
                jobs.remove(job_id);
            }
        }
    }
    jobs.into_iter()
        .map(|(job_id, k)| {
            let mut events = Vec::new();
            if let Some((pid, started_at_us)) = k.started {
                events.push(JobEvent::Started { job_id, pid, started_at_us });
            }
            let result = k.finished.unwrap_or_else(|| JobFinished {
                job_id,
                outcome: Outcome::Lost {
                    reason: if k.started.is_some() {
                        "the agent stopped while the job ran (killed, crashed or its host restarted): the \
                         job's processes died with it, and output it had not sent yet is lost"
                            .into()
                    } else {
                        "the agent stopped while starting the job (killed, crashed or its host restarted); \
                         whether its process started is unknown, and if it did it died with the agent"
                            .into()
                    },
                },
                finished_at_us: now_us,
                // It may have started after it arrived: count that as its start.
                started_at_us: Some(k.started.map_or(k.received_at_us, |(_, at)| at)),
                lines: None,
                telemetry: None,
                gpu_health: BTreeMap::new(),
            });
            events.push(JobEvent::Finished(result));
            (job_id, events)
        })
        .collect()
}

/// The journal file, open for appending.
pub struct Journal {
    path: PathBuf,
    file: File,
}

impl Journal {
    /// Read what an earlier run left (a torn last line, from a crash mid-write, is ignored),
    /// then start a fresh file holding only `keep`'s records. Returns the journal and the
    /// records read.
    pub fn open(path: &Path, keep: impl FnOnce(&[Record]) -> Vec<Record>) -> std::io::Result<(Journal, Vec<Record>)> {
        let mut records = Vec::new();
        match File::open(path) {
            Ok(f) => {
                for line in std::io::BufReader::new(f).lines() {
                    let line = line?;
                    match serde_json::from_str::<Record>(&line) {
                        Ok(r) => records.push(r),
                        Err(e) if !line.trim().is_empty() => {
                            tracing::warn!(error = %e, "unreadable journal line ignored (torn by a crash?)")
                        }
                        Err(_) => {}
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let kept = keep(&records);
        // Rewrite: a new file, synced, renamed over the old one, and the directory synced.
        let tmp = path.with_extension("new");
        {
            let mut f = OpenOptions::new().create(true).write(true).truncate(true).mode_0600().open(&tmp)?;
            for r in &kept {
                f.write_all(&line_of(r))?;
            }
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let file = OpenOptions::new().append(true).open(path)?;
        Ok((Journal { path: path.to_path_buf(), file }, records))
    }

    /// Append a record; with `sync`, return only once it is on disk.
    pub fn write(&mut self, r: &Record, sync: bool) -> std::io::Result<()> {
        self.file.write_all(&line_of(r))?;
        if sync {
            self.file.sync_data()?;
        }
        Ok(())
    }

    /// Past `bytes`, rewrite the file with only the records of jobs not `done` (as at start),
    /// so a busy agent's journal stays small.
    pub fn compact_if_over(&mut self, bytes: u64) -> std::io::Result<()> {
        if self.file.metadata()?.len() <= bytes {
            return Ok(());
        }
        let (fresh, _) = Journal::open(&self.path, live_records)?;
        *self = fresh;
        Ok(())
    }
}

/// The records of jobs not yet `done`, in their order.
pub fn live_records(records: &[Record]) -> Vec<Record> {
    let done: std::collections::BTreeSet<JobId> = records
        .iter()
        .filter_map(|r| match r {
            Record::Done { job_id } => Some(*job_id),
            _ => None,
        })
        .collect();
    records
        .iter()
        .filter(|r| {
            let id = match r {
                Record::Received { job_id, .. } | Record::Started { job_id, .. } | Record::Done { job_id } => *job_id,
                Record::Finished(f) => f.job_id,
            };
            !done.contains(&id)
        })
        .cloned()
        .collect()
}

fn line_of(r: &Record) -> Vec<u8> {
    let mut v = serde_json::to_vec(r).unwrap_or_default();
    v.push(b'\n');
    v
}

trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}

impl Mode0600 for OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o600)
    }
}

/// The records a fresh journal keeps for what [`recover`] found owed.
pub fn records_for(owed: &BTreeMap<JobId, Vec<JobEvent>>) -> Vec<Record> {
    let mut out = Vec::new();
    for (job_id, events) in owed {
        let at_us = events
            .iter()
            .find_map(|e| match e {
                JobEvent::Started { started_at_us, .. } => Some(*started_at_us),
                JobEvent::Finished(f) => f.started_at_us,
                JobEvent::Log { .. } => None,
            })
            .unwrap_or(0);
        out.push(Record::Received { job_id: *job_id, at_us });
        for e in events {
            match e {
                JobEvent::Started { job_id, pid, started_at_us } => {
                    out.push(Record::Started { job_id: *job_id, pid: *pid, started_at_us: *started_at_us })
                }
                JobEvent::Finished(f) => out.push(Record::Finished(f.clone())),
                JobEvent::Log { .. } => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn fin(job_id: JobId, code: i32) -> JobFinished {
        JobFinished {
            job_id,
            outcome: Outcome::Exited { code },
            finished_at_us: 5,
            started_at_us: Some(2),
            lines: None,
            telemetry: None,
            gpu_health: BTreeMap::new(),
        }
    }

    #[test]
    fn a_job_running_when_the_agent_died_is_owed_as_lost_with_its_start() {
        let records = vec![
            Record::Received { job_id: 1, at_us: 1 },
            Record::Started { job_id: 1, pid: 10, started_at_us: 2 },
            Record::Received { job_id: 2, at_us: 1 },
            Record::Started { job_id: 2, pid: 11, started_at_us: 3 },
            Record::Finished(fin(2, 0)),
            Record::Received { job_id: 3, at_us: 1 },
            Record::Started { job_id: 3, pid: 12, started_at_us: 4 },
            Record::Finished(fin(3, 1)),
            Record::Done { job_id: 3 },
            Record::Received { job_id: 4, at_us: 7 },
        ];
        let owed = recover(&records, 99);
        assert_eq!(owed.keys().copied().collect::<Vec<_>>(), [1, 2, 4], "3 was acknowledged");
        let JobEvent::Finished(lost) = &owed[&1][1] else { panic!() };
        assert!(matches!(&lost.outcome, Outcome::Lost { reason } if reason.contains("died with it")));
        assert_eq!(lost.started_at_us, Some(2), "the start is kept");
        assert_eq!(owed[&2][1], JobEvent::Finished(fin(2, 0)), "a recorded result is sent as it was");
        assert_eq!(owed[&4].len(), 1, "no start seen: only the result");
        assert!(
            matches!(&owed[&4][0], JobEvent::Finished(f) if f.started_at_us == Some(7)),
            "it may have started: its arrival counts as its start"
        );
        // Rewriting the journal with what is owed recovers the same thing again.
        assert_eq!(recover(&records_for(&owed), 99), owed);
    }

    #[test]
    fn compaction_keeps_exactly_the_jobs_not_done() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let (mut j, _) = Journal::open(&path, |_| Vec::new()).unwrap();
        for id in 0..2000 {
            j.write(&Record::Received { job_id: id, at_us: 1 }, false).unwrap();
            j.write(&Record::Started { job_id: id, pid: 1, started_at_us: 2 }, false).unwrap();
            if id != 1500 {
                j.write(&Record::Finished(fin(id, 0)), false).unwrap();
                j.write(&Record::Done { job_id: id }, false).unwrap();
            }
            j.compact_if_over(16 << 10).unwrap();
            assert!(std::fs::metadata(&path).unwrap().len() < 20 << 10);
        }
        let (_, left) = Journal::open(&path, |r| r.to_vec()).unwrap();
        let owed = recover(&left, 9);
        assert_eq!(owed.keys().copied().collect::<Vec<_>>(), [1500], "only the job still running is owed");
    }

    #[test]
    fn the_file_survives_a_torn_last_line_and_is_rewritten_with_what_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let (mut j, old) = Journal::open(&path, |_| Vec::new()).unwrap();
        assert!(old.is_empty());
        j.write(&Record::Received { job_id: 5, at_us: 1 }, true).unwrap();
        j.write(&Record::Started { job_id: 5, pid: 1, started_at_us: 1 }, false).unwrap();
        drop(j);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"record\":\"finis").unwrap();
        drop(f);
        let (_, read) = Journal::open(&path, |r| r[..1].to_vec()).unwrap();
        assert_eq!(read.len(), 2);
        let (_, again) = Journal::open(&path, |r| r.to_vec()).unwrap();
        assert_eq!(again, vec![Record::Received { job_id: 5, at_us: 1 }]);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }
}
