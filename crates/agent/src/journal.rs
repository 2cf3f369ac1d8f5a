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
//! Every rewrite starts with a `header`. The journal is the only record of which jobs this
//! agent received, so damage to it is never passed over quietly: a journal that is missing
//! although the agent ran before (its `agent.json` is there), empty, without its header, or
//! with an unreadable record before its last line is refused ([`Damage`]), and the agent does
//! not start until an operator resets it (`--reset-journal`). A torn last line — a crash or a
//! power cut mid-write, or a file cut short — may have taken records with it. After a reset or
//! a torn end the journal is *incomplete*: the agent says so when it connects, and the
//! coordinator then treats a job it assigned and the agent does not hold as lost (it may have
//! started here) instead of handing it out again as never received. Once the coordinator has
//! settled that (`reconciled`), the journal is whole again.
//!
//! What no check can see: a file cut exactly at a line boundary, or replaced by an older copy,
//! reads as a shorter history. Those are the operator's to avoid (the data dir is the agent's).
//!
//! Effects are in [`Journal`]; [`recover`] and [`assess`] are pure.

use gpuci_core::job::Outcome;
use gpuci_protocol::agent::{JobEvent, JobFinished, Unenforced};
use gpuci_protocol::JobId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    /// The first record of every file the agent writes.
    Header {
        version: u32,
        /// Why the journal may lack records: set after a reset or a torn end, until the
        /// coordinator has settled the agent's jobs knowing it (`reconciled`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        incomplete: Option<String>,
    },
    /// The coordinator accepted a connection that told it the journal was incomplete.
    Reconciled,
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
        /// What the agent did not enforce for the job, sent again with its start after a
        /// restart (absent in journals of older agents: nothing said).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        unenforced: Vec<Unenforced>,
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
    started: Option<(u32, i64, Vec<Unenforced>)>,
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
            Record::Started { job_id, pid, started_at_us, unenforced } => {
                if let Some(k) = jobs.get_mut(job_id) {
                    k.started = Some((*pid, *started_at_us, unenforced.clone()));
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
            Record::Header { .. } | Record::Reconciled => {}
        }
    }
    jobs.into_iter()
        .map(|(job_id, k)| {
            let mut events = Vec::new();
            let started_at = k.started.as_ref().map(|(_, at, _)| *at);
            if let Some((pid, started_at_us, unenforced)) = k.started {
                events.push(JobEvent::Started { job_id, pid, started_at_us, unenforced });
            }
            let result = k.finished.unwrap_or_else(|| JobFinished {
                job_id,
                outcome: Outcome::Lost {
                    reason: if started_at.is_some() {
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
                started_at_us: Some(started_at.unwrap_or(k.received_at_us)),
                lines: None,
                telemetry: None,
                gpu_health: BTreeMap::new(),
            });
            events.push(JobEvent::Finished(result));
            (job_id, events)
        })
        .collect()
}

/// The journal's format; a header with another version is refused, not guessed at.
pub const VERSION: u32 = 1;

/// Why a journal cannot be trusted as it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Damage(pub String);

/// What an earlier run left, judged.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Assessed {
    /// Its records, the header left out.
    pub records: Vec<Record>,
    /// Why records may be missing (see the module header), or `None` when it is whole.
    pub incomplete: Option<String>,
}

/// Judge a journal's lines. `lines`: `None` when there is no file; each line parsed or
/// not. `ran_before`: this agent has run before (its identity is stored), so it had a
/// journal.
pub fn assess(lines: Option<Vec<Result<Record, String>>>, ran_before: bool) -> Result<Assessed, Damage> {
    let Some(mut lines) = lines else {
        return if ran_before {
            Err(Damage("the journal is missing, though this agent has run before (its agent.json is there)".into()))
        } else {
            Ok(Assessed::default())
        };
    };
    // A torn last line is what a crash mid-write leaves; anywhere else, a line that does not
    // read is damage.
    let mut torn = None;
    if let Some(Err(e)) = lines.last() {
        torn = Some(e.clone());
        lines.pop();
    }
    let mut records = Vec::with_capacity(lines.len());
    for (i, line) in lines.into_iter().enumerate() {
        match line {
            Ok(r) => records.push(r),
            Err(e) => return Err(Damage(format!("line {} of the journal is unreadable ({e})", i + 1))),
        }
    }
    let mut incomplete = match records.first() {
        Some(Record::Header { version, incomplete }) if *version == VERSION => incomplete.clone(),
        Some(Record::Header { version, .. }) => {
            return Err(Damage(format!("the journal is of version {version}; this agent reads version {VERSION}")))
        }
        _ if records.is_empty() && torn.is_none() => {
            return Err(Damage("the journal is empty: it has not even its header".into()))
        }
        _ => {
            return Err(Damage("the journal does not start with its header: it was emptied, cut or overwritten".into()))
        }
    };
    records.remove(0);
    if records.iter().any(|r| matches!(r, Record::Header { .. })) {
        return Err(Damage("the journal holds a second header: two files were joined".into()));
    }
    if records.contains(&Record::Reconciled) {
        incomplete = None;
        records.retain(|r| *r != Record::Reconciled);
    }
    if let Some(e) = torn {
        incomplete.get_or_insert(format!(
            "its journal ended in a torn record ({e}): a crash or power cut mid-write, or a file cut short"
        ));
    }
    Ok(Assessed { records, incomplete })
}

/// The journal file, open for appending.
pub struct Journal {
    path: PathBuf,
    file: File,
    incomplete: Option<String>,
    /// Length of the file up to its last whole record. A write that fails part-way (a full
    /// disk) leaves part of a line; the file is cut back to here before anything else is
    /// appended, so a torn record never ends up mid-file (which reads as damage at restart).
    whole: u64,
}

impl Journal {
    /// Read and [`assess`] what an earlier run left, then start a fresh file: a header, then
    /// only `keep`'s records. Returns the journal and what was read.
    ///
    /// With `reset`, a damaged journal is not refused: what could be read is kept and the
    /// journal is marked incomplete, with the damage as the reason.
    pub fn open(
        path: &Path,
        ran_before: bool,
        reset: bool,
        keep: impl FnOnce(&[Record]) -> Vec<Record>,
    ) -> Result<(Journal, Assessed), OpenError> {
        let lines = match File::open(path) {
            Ok(f) => {
                let mut lines = Vec::new();
                for line in std::io::BufReader::new(f).split(b'\n') {
                    let line = line?;
                    lines.push(
                        std::str::from_utf8(&line)
                            .map_err(|e| e.to_string())
                            .and_then(|l| serde_json::from_str::<Record>(l).map_err(|e| e.to_string())),
                    );
                }
                Some(lines)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e.into()),
        };
        let assessed = match assess(lines, ran_before) {
            Ok(a) => a,
            Err(damage) if reset => {
                tracing::warn!(%damage, "resetting the damaged journal (--reset-journal)");
                Assessed {
                    records: Vec::new(),
                    incomplete: Some(format!("its journal was reset by the operator (--reset-journal): {damage}")),
                }
            }
            Err(damage) => return Err(OpenError::Damaged(damage)),
        };
        if let Some(why) = &assessed.incomplete {
            tracing::warn!(why, "the journal may lack records: the coordinator will count as lost, not requeue, any job it assigned here that the journal does not name");
        }
        let kept = keep(&assessed.records);
        let journal = Journal::rewrite(path, assessed.incomplete.clone(), &kept)?;
        Ok((journal, assessed))
    }

    /// A new file with a header and `records`, synced, renamed over the old one, and the
    /// directory synced.
    fn rewrite(path: &Path, incomplete: Option<String>, records: &[Record]) -> std::io::Result<Journal> {
        let tmp = path.with_extension("new");
        {
            let mut f = OpenOptions::new().create(true).write(true).truncate(true).mode_0600().open(&tmp)?;
            f.write_all(&line_of(&Record::Header { version: VERSION, incomplete: incomplete.clone() }))?;
            for r in records {
                f.write_all(&line_of(r))?;
            }
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let file = OpenOptions::new().append(true).open(path)?;
        let whole = file.metadata()?.len();
        Ok(Journal { path: path.to_path_buf(), file, incomplete, whole })
    }

    /// Rewrite the file with only `records` (keeping why it may be incomplete).
    pub fn replace(&mut self, records: &[Record]) -> std::io::Result<()> {
        *self = Journal::rewrite(&self.path, self.incomplete.clone(), records)?;
        Ok(())
    }

    /// Why the journal may lack records, until the coordinator has settled it.
    pub fn incomplete(&self) -> Option<&str> {
        self.incomplete.as_deref()
    }

    /// The coordinator has settled this agent's jobs knowing the journal was incomplete.
    pub fn reconciled(&mut self) -> std::io::Result<()> {
        if self.incomplete.is_some() {
            self.write(&Record::Reconciled, true)?;
            self.incomplete = None;
        }
        Ok(())
    }

    /// Append a record; with `sync`, return only once it is on disk. A write that fails
    /// leaves the file as it was before it (see [`Journal::whole`]).
    pub fn write(&mut self, r: &Record, sync: bool) -> std::io::Result<()> {
        if self.file.metadata()?.len() != self.whole {
            // An earlier failed write's tail that could not be cut then (the disk was full).
            self.file.set_len(self.whole)?;
        }
        let line = line_of(r);
        if let Err(e) = self.file.write_all(&line) {
            if let Err(cut) = self.file.set_len(self.whole) {
                tracing::warn!(error = %cut, "could not cut a torn journal record; it is cut before the next record");
            }
            return Err(e);
        }
        self.whole += line.len() as u64;
        if sync {
            self.file.sync_data()?;
        }
        Ok(())
    }

    /// Past `bytes`, rewrite the file with only the records of jobs not `done` (as at start),
    /// so a busy agent's journal stays small.
    pub fn compact_if_over(&mut self, bytes: u64) -> Result<(), OpenError> {
        if self.file.metadata()?.len() <= bytes {
            return Ok(());
        }
        let (fresh, _) = Journal::open(&self.path, true, false, live_records)?;
        *self = fresh;
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("the agent's journal is damaged: {0}")]
    Damaged(Damage),
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
                Record::Header { .. } | Record::Reconciled => return false,
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
                JobEvent::Started { job_id, pid, started_at_us, unenforced } => out.push(Record::Started {
                    job_id: *job_id,
                    pid: *pid,
                    started_at_us: *started_at_us,
                    unenforced: unenforced.clone(),
                }),
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
            Record::Started { job_id: 1, pid: 10, started_at_us: 2, unenforced: vec![] },
            Record::Received { job_id: 2, at_us: 1 },
            Record::Started { job_id: 2, pid: 11, started_at_us: 3, unenforced: vec![] },
            Record::Finished(fin(2, 0)),
            Record::Received { job_id: 3, at_us: 1 },
            Record::Started { job_id: 3, pid: 12, started_at_us: 4, unenforced: vec![] },
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

    /// A restarted agent sends a job's start again with what it did not enforce for the job
    /// (issue 26), and reads the records of an agent older than that list.
    #[test]
    fn a_start_owed_after_a_restart_keeps_what_was_not_enforced() {
        use gpuci_protocol::agent::Protection;
        let said = vec![Unenforced { key: Protection::Limits, detail: "no memory limit (no cgroups)".into() }];
        let records = vec![
            Record::Received { job_id: 1, at_us: 1 },
            Record::Started { job_id: 1, pid: 10, started_at_us: 2, unenforced: said.clone() },
        ];
        let owed = recover(&records, 99);
        assert_eq!(owed[&1][0], JobEvent::Started { job_id: 1, pid: 10, started_at_us: 2, unenforced: said.clone() });
        assert_eq!(recover(&records_for(&owed), 99), owed, "kept through a rewrite");
        let line = serde_json::to_string(&records[1]).unwrap();
        assert_eq!(serde_json::from_str::<Record>(&line).unwrap(), records[1]);
        let old: Record =
            serde_json::from_str(r#"{"record":"started","job_id":1,"pid":10,"started_at_us":2}"#).unwrap();
        assert_eq!(old, Record::Started { job_id: 1, pid: 10, started_at_us: 2, unenforced: vec![] });
    }

    #[test]
    fn compaction_keeps_exactly_the_jobs_not_done() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let (mut j, _) = Journal::open(&path, false, false, |_| Vec::new()).unwrap();
        for id in 0..2000 {
            j.write(&Record::Received { job_id: id, at_us: 1 }, false).unwrap();
            j.write(&Record::Started { job_id: id, pid: 1, started_at_us: 2, unenforced: vec![] }, false).unwrap();
            if id != 1500 {
                j.write(&Record::Finished(fin(id, 0)), false).unwrap();
                j.write(&Record::Done { job_id: id }, false).unwrap();
            }
            j.compact_if_over(16 << 10).unwrap();
            assert!(std::fs::metadata(&path).unwrap().len() < 20 << 10);
        }
        let (_, left) = Journal::open(&path, true, false, |r| r.to_vec()).unwrap();
        let owed = recover(&left.records, 9);
        assert_eq!(owed.keys().copied().collect::<Vec<_>>(), [1500], "only the job still running is owed");
    }

    fn read_damage(path: &Path, ran_before: bool) -> String {
        match Journal::open(path, ran_before, false, |r| r.to_vec()) {
            Err(OpenError::Damaged(d)) => d.0,
            Err(e) => panic!("not damage: {e}"),
            Ok(_) => panic!("a damaged journal was accepted"),
        }
    }

    #[test]
    fn a_torn_last_line_is_passed_over_and_leaves_the_journal_incomplete_until_reconciled() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let (mut j, old) = Journal::open(&path, false, false, |_| Vec::new()).unwrap();
        assert_eq!(old, Assessed::default());
        j.write(&Record::Received { job_id: 5, at_us: 1 }, true).unwrap();
        j.write(&Record::Started { job_id: 5, pid: 1, started_at_us: 1, unenforced: vec![] }, false).unwrap();
        drop(j);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"record\":\"finis").unwrap();
        drop(f);
        let (j, read) = Journal::open(&path, true, false, |r| r[..1].to_vec()).unwrap();
        assert_eq!(read.records.len(), 2);
        assert!(read.incomplete.as_deref().unwrap_or_default().contains("torn"), "{read:?}");
        assert!(j.incomplete().is_some());
        drop(j);
        // Still incomplete after a restart that did not reach the coordinator...
        let (mut j, again) = Journal::open(&path, true, false, |r| r.to_vec()).unwrap();
        assert_eq!(again.records, vec![Record::Received { job_id: 5, at_us: 1 }]);
        assert!(again.incomplete.is_some());
        // ...and whole once the coordinator has settled it, also across compaction.
        j.reconciled().unwrap();
        assert!(j.incomplete().is_none());
        drop(j);
        let (_, whole) = Journal::open(&path, true, false, |r| r.to_vec()).unwrap();
        assert_eq!(whole, Assessed { records: vec![Record::Received { job_id: 5, at_us: 1 }], incomplete: None });
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }

    /// Regression (outsider attack): a record written while the agent's disk was full was
    /// left half on disk, the records after it were appended behind it, and the agent then
    /// refused to start ("unreadable record before its last line"). A failed write's tail is
    /// cut before the next record.
    #[test]
    fn a_record_torn_by_a_failed_write_never_ends_up_mid_file() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("journal");
        let (mut j, _) = Journal::open(&path, false, false, |_| Vec::new()).unwrap();
        j.write(&Record::Received { job_id: 1, at_us: 0 }, true).unwrap();
        // What a write cut short by a full disk leaves.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"record":"finished","job_id":1,"out"#).unwrap();
        drop(f);
        j.write(&Record::Done { job_id: 1 }, true).unwrap();
        j.write(&Record::Received { job_id: 2, at_us: 0 }, true).unwrap();
        drop(j);
        let (_, read) = Journal::open(&path, true, false, |r| r.to_vec()).expect("the journal reads whole");
        assert_eq!(read.incomplete, None);
        assert_eq!(
            read.records,
            vec![
                Record::Received { job_id: 1, at_us: 0 },
                Record::Done { job_id: 1 },
                Record::Received { job_id: 2, at_us: 0 }
            ]
        );
    }

    #[test]
    fn a_damaged_journal_is_refused_and_a_reset_marks_it_incomplete() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        // Missing: fine for a new agent, damage for one that ran before.
        assert!(read_damage(&path, true).contains("missing"));
        let (mut j, _) = Journal::open(&path, false, false, |_| Vec::new()).unwrap();
        for id in 1..=4 {
            j.write(&Record::Received { job_id: id, at_us: 1 }, true).unwrap();
        }
        drop(j);
        let whole = std::fs::read(&path).unwrap();

        std::fs::write(&path, b"").unwrap();
        assert!(read_damage(&path, true).contains("empty"));
        // Cut at the front (the header gone), with or without a torn first line.
        let second_line = whole.iter().position(|b| *b == b'\n').unwrap() + 1;
        std::fs::write(&path, &whole[second_line..]).unwrap();
        assert!(read_damage(&path, true).contains("header"));
        std::fs::write(&path, &whole[second_line + 3..]).unwrap();
        assert!(read_damage(&path, true).contains("line 1"));
        // A line in the middle that does not read.
        let mut bad = whole.clone();
        bad[second_line + 2] = b'#';
        std::fs::write(&path, &bad).unwrap();
        assert!(read_damage(&path, true).contains("line 2"), "{}", read_damage(&path, true));
        // Two files joined.
        std::fs::write(&path, [whole.clone(), whole.clone()].concat()).unwrap();
        assert!(read_damage(&path, true).contains("second header"));
        // Another version.
        std::fs::write(&path, b"{\"record\":\"header\",\"version\":99}\n").unwrap();
        assert!(read_damage(&path, true).contains("version 99"));

        // A reset starts over, incomplete, naming the damage.
        std::fs::write(&path, b"").unwrap();
        let (j, read) = Journal::open(&path, true, true, |r| r.to_vec()).unwrap();
        assert!(read.records.is_empty());
        let why = j.incomplete().unwrap_or_default().to_string();
        assert!(why.contains("--reset-journal") && why.contains("empty"), "{why}");
        drop(j);
        let (_, after) = Journal::open(&path, true, false, |r| r.to_vec()).unwrap();
        assert_eq!(after.incomplete.as_deref(), Some(why.as_str()), "the reset is remembered until reconciled");
        // A reset of a whole journal changes nothing.
        std::fs::write(&path, &whole).unwrap();
        let (_, read) = Journal::open(&path, true, true, |r| r.to_vec()).unwrap();
        assert_eq!((read.records.len(), read.incomplete), (4, None));
    }
}
