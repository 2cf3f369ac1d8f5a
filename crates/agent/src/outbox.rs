//! The agent's side of delivery: job events waiting for the coordinator's acknowledgement.
//!
//! Every event gets the next number `n` when it enters; it stays until an `Acked { upto }`
//! covers it, and after a reconnect everything not acknowledged is sent again, in order. Log
//! lines get their per-job line number (`seq`, from 1) here too, so the coordinator can store
//! each line once whatever it receives twice.
//!
//! Bounded: past `limit` bytes of job output (while the coordinator is unreachable or slow to
//! acknowledge) the oldest lines of the job holding the most are dropped — a job flooding its
//! log loses its own lines, not its neighbours' — and where they were the log gets one gpuci
//! line saying how many went. Starts and results are never dropped (one each per job).
//!
//! Pure state: no I/O, no clock; the agent's loop owns it and does the sending.

use gpuci_protocol::agent::{JobEvent, LogChunk, Stream};
use gpuci_protocol::JobId;
use std::collections::{BTreeMap, VecDeque};

use crate::executor::LINE_OVERHEAD;

#[derive(Debug)]
pub struct Outbox {
    limit: usize,
    /// Number of the next event.
    next_n: u64,
    /// Events up to this number were sent on the current connection.
    sent_upto: u64,
    entries: VecDeque<Entry>,
    /// Bytes of job output in `entries`, in all and per job.
    bytes: usize,
    bytes_of: BTreeMap<JobId, usize>,
    /// Per job: number of its next log line.
    next_seq: BTreeMap<JobId, u64>,
}

#[derive(Debug)]
struct Entry {
    n: u64,
    body: Body,
}

#[derive(Debug)]
enum Body {
    Event(JobEvent),
    /// Lines `first_seq ..= last_seq` of a job, dropped; sent as one gpuci line at `first_seq`.
    Dropped {
        job_id: JobId,
        first_seq: u64,
        last_seq: u64,
        bytes: u64,
        first_ts_us: i64,
    },
}

fn cost(lines: &[LogChunk]) -> usize {
    lines.iter().map(|l| l.text.len() + LINE_OVERHEAD).sum()
}

impl Outbox {
    /// An outbox that keeps at most `limit` bytes of job output.
    pub fn new(limit: usize) -> Outbox {
        Outbox {
            limit,
            next_n: 1,
            sent_upto: 0,
            entries: VecDeque::new(),
            bytes: 0,
            bytes_of: BTreeMap::new(),
            next_seq: BTreeMap::new(),
        }
    }

    /// A job starts: its lines are numbered from `first` (its log may already hold lines from
    /// an earlier run under the same id).
    pub fn start_job(&mut self, job_id: JobId, first: u64) {
        self.next_seq.insert(job_id, first.max(1));
    }

    /// How many lines of a job have been numbered.
    pub fn lines_of(&self, job_id: JobId) -> u64 {
        self.next_seq.get(&job_id).map_or(0, |n| n - 1)
    }

    /// Add a start or a result. Returns its number.
    pub fn push(&mut self, event: JobEvent) -> u64 {
        debug_assert!(!matches!(event, JobEvent::Log { .. }), "lines go through push_lines");
        if let JobEvent::Finished(f) = &event {
            // No line of this job follows its result.
            self.next_seq.remove(&f.job_id);
        }
        self.add(Body::Event(event))
    }

    /// Add a job's next lines (numbered here), dropping the oldest output while over the limit.
    pub fn push_lines(&mut self, job_id: JobId, lines: Vec<LogChunk>) {
        if lines.is_empty() {
            return;
        }
        let next = self.next_seq.entry(job_id).or_insert(1);
        let first_seq = *next;
        *next += lines.len() as u64;
        self.count(job_id, cost(&lines) as isize);
        self.add(Body::Event(JobEvent::Log { job_id, first_seq, lines }));
        self.shed();
    }

    fn add(&mut self, body: Body) -> u64 {
        let n = self.next_n;
        self.next_n += 1;
        self.entries.push_back(Entry { n, body });
        n
    }

    fn count(&mut self, job_id: JobId, delta: isize) {
        self.bytes = self.bytes.saturating_add_signed(delta);
        let b = self.bytes_of.entry(job_id).or_default();
        *b = b.saturating_add_signed(delta);
        if *b == 0 {
            self.bytes_of.remove(&job_id);
        }
    }

    /// While over the limit, drop the oldest lines of the job holding the most output.
    fn shed(&mut self) {
        while self.bytes > self.limit {
            let Some((&job, _)) = self.bytes_of.iter().max_by_key(|(_, b)| **b) else { break };
            let Some(i) = self
                .entries
                .iter()
                .position(|e| matches!(&e.body, Body::Event(JobEvent::Log { job_id, .. }) if *job_id == job))
            else {
                break;
            };
            let placeholder =
                Body::Event(JobEvent::Started { job_id: 0, pid: 0, started_at_us: 0, unenforced: vec![] });
            let Body::Event(JobEvent::Log { job_id, first_seq, lines }) =
                std::mem::replace(&mut self.entries[i].body, placeholder)
            else {
                unreachable!("position() matched a log entry")
            };
            self.count(job_id, -(cost(&lines) as isize));
            let last_seq = first_seq + lines.len() as u64 - 1;
            let text_bytes: u64 = lines.iter().map(|l| l.text.len() as u64 + 1).sum();
            let first_ts_us = lines.first().map_or(0, |l| l.ts_us);
            // Extend this job's notice right before it, if it has not been sent yet.
            let sent_upto = self.sent_upto;
            let merged = self.entries.iter_mut().take(i).rev().find_map(|e| match &mut e.body {
                Body::Dropped { job_id: j, last_seq: l, bytes, .. }
                    if *j == job_id && *l + 1 == first_seq && e.n > sent_upto =>
                {
                    *l = last_seq;
                    *bytes += text_bytes;
                    Some(())
                }
                _ => None,
            });
            if merged.is_some() {
                self.entries.remove(i);
            } else {
                self.entries[i].body = Body::Dropped { job_id, first_seq, last_seq, bytes: text_bytes, first_ts_us };
            }
        }
    }

    /// Events not yet sent on this connection, in order, marked sent.
    pub fn to_send(&mut self) -> Vec<(u64, JobEvent)> {
        let limit = self.limit;
        let out: Vec<(u64, JobEvent)> =
            self.entries.iter().filter(|e| e.n > self.sent_upto).map(|e| (e.n, render(&e.body, limit))).collect();
        if let Some((n, _)) = out.last() {
            self.sent_upto = *n;
        }
        out
    }

    /// The connection is gone: what it carried and was not acknowledged is sent again.
    pub fn rewind(&mut self) {
        self.sent_upto = 0;
    }

    /// The coordinator committed everything up to `upto`. Returns the jobs whose result that
    /// covered: the agent forgets them.
    pub fn ack(&mut self, upto: u64) -> Vec<JobId> {
        let mut done = Vec::new();
        while self.entries.front().is_some_and(|e| e.n <= upto) {
            let Some(e) = self.entries.pop_front() else { break };
            match e.body {
                Body::Event(JobEvent::Log { job_id, lines, .. }) => self.count(job_id, -(cost(&lines) as isize)),
                Body::Event(JobEvent::Finished(f)) => done.push(f.job_id),
                _ => {}
            }
        }
        done
    }

    /// Bytes of job output held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Events held (sent or not).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn render(body: &Body, limit: usize) -> JobEvent {
    match body {
        Body::Event(e) => e.clone(),
        Body::Dropped { job_id, first_seq, last_seq, bytes, first_ts_us } => {
            let count = last_seq - first_seq + 1;
            let text = format!(
                "{count} lines ({bytes} bytes) of output dropped (lines {first_seq}-{last_seq}): the coordinator \
                 was unreachable or slow and the agent keeps at most {limit} bytes of output for it"
            );
            JobEvent::Log {
                job_id: *job_id,
                first_seq: *first_seq,
                lines: vec![LogChunk { ts_us: *first_ts_us, stream: Stream::System, text }],
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use gpuci_core::job::Outcome;
    use gpuci_protocol::agent::JobFinished;

    fn line(text: &str) -> LogChunk {
        LogChunk { ts_us: 1, stream: Stream::Stdout, text: text.into() }
    }

    fn finished(job_id: JobId) -> JobEvent {
        JobEvent::Finished(JobFinished {
            job_id,
            outcome: Outcome::Exited { code: 0 },
            finished_at_us: 2,
            started_at_us: Some(1),
            lines: None,
            telemetry: None,
            gpu_health: Default::default(),
        })
    }

    #[test]
    fn events_are_resent_after_a_reconnect_until_acknowledged() {
        let mut o = Outbox::new(1 << 20);
        o.push(JobEvent::Started { job_id: 1, pid: 9, started_at_us: 1, unenforced: vec![] });
        o.push_lines(1, vec![line("a"), line("b")]);
        o.push_lines(1, vec![line("c")]);
        o.push(finished(1));
        let first = o.to_send();
        assert_eq!(first.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [1, 2, 3, 4]);
        assert!(o.to_send().is_empty(), "sent once per connection");
        assert_eq!(o.ack(2), Vec::<JobId>::new());
        o.rewind();
        let again = o.to_send();
        assert_eq!(again.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [3, 4]);
        assert!(matches!(&again[0].1, JobEvent::Log { first_seq: 3, lines, .. } if lines[0].text == "c"));
        assert_eq!(o.ack(4), vec![1], "the result's ack releases the job");
        assert!(o.is_empty());
        assert_eq!(o.bytes(), 0);
    }

    #[test]
    fn output_over_the_limit_becomes_one_numbered_notice_and_starts_and_results_stay() {
        let mut o = Outbox::new(10_000);
        o.push(JobEvent::Started { job_id: 7, pid: 1, started_at_us: 0, unenforced: vec![] });
        for i in 0..10_000 {
            o.push_lines(7, vec![line(&format!("line {i}"))]);
            assert!(o.bytes() <= 10_000 + 100, "held {} bytes", o.bytes());
        }
        o.push(finished(7));
        let sent = o.to_send();
        assert!(matches!(sent[0].1, JobEvent::Started { job_id: 7, .. }));
        let JobEvent::Log { first_seq: 1, lines, .. } = &sent[1].1 else { panic!("{:?}", sent[1]) };
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].stream, Stream::System);
        let JobEvent::Log { first_seq: kept_from, .. } = &sent[2].1 else { panic!("{:?}", sent[2]) };
        let dropped = kept_from - 1;
        assert!(lines[0].text.starts_with(&format!("{dropped} lines (")), "{}", lines[0].text);
        assert!(lines[0].text.contains(&format!("(lines 1-{dropped})")), "{}", lines[0].text);
        // The kept lines are numbered on from the gap, without holes, up to the last.
        let mut expect = *kept_from;
        for (_, e) in &sent[2..sent.len() - 1] {
            let JobEvent::Log { first_seq, lines, .. } = e else { panic!("{e:?}") };
            assert_eq!(*first_seq, expect);
            expect += lines.len() as u64;
        }
        assert_eq!(expect, 10_001);
        assert!(matches!(sent.last().unwrap().1, JobEvent::Finished(_)), "the result is never dropped");
    }

    #[test]
    fn a_flooding_job_loses_its_own_lines_not_its_neighbours() {
        let mut o = Outbox::new(100_000);
        o.push_lines(2, vec![line("quiet 1")]);
        for i in 0..10_000 {
            o.push_lines(1, vec![line(&format!("flood {i:0>50}"))]);
        }
        o.push_lines(2, vec![line("quiet 2")]);
        let quiet: Vec<String> = o
            .to_send()
            .into_iter()
            .filter_map(|(_, e)| match e {
                JobEvent::Log { job_id: 2, lines, .. } => Some(lines.into_iter().map(|l| l.text)),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(quiet, ["quiet 1", "quiet 2"]);
        assert!(o.bytes() <= 100_000);
    }

    #[test]
    fn a_notice_already_sent_is_not_changed_a_new_one_follows() {
        let mut o = Outbox::new(200);
        for i in 0..3 {
            o.push_lines(1, vec![line(&format!("{i:0>100}"))]);
        }
        let before = o.to_send();
        assert!(matches!(&before[0].1, JobEvent::Log { lines, .. } if lines[0].stream == Stream::System));
        for i in 3..6 {
            o.push_lines(1, vec![line(&format!("{i:0>100}"))]);
        }
        let after = o.to_send();
        // Entries sent before are never re-numbered: the new notice covers only new drops.
        for (n, e) in &after {
            assert!(*n > before.last().unwrap().0);
            if let JobEvent::Log { first_seq, lines, .. } = e {
                if lines[0].stream == Stream::System {
                    assert!(*first_seq > 1, "{e:?}");
                }
            }
        }
    }
}
