//! What the agent keeps while the coordinator is unreachable: job starts, and job output up to
//! a number of bytes. Past it the oldest lines go, and the log says so: the first message sent
//! for that job after the reconnect is a gpuci line with how many lines were dropped. A gap in
//! a log is never silent.
//!
//! Job starts are never dropped (one per job). Results are not kept here: the agent holds
//! them until acknowledged and reports them in its hello.

use gpuci_protocol::agent::{AgentMessage, LogChunk, Stream};
use gpuci_protocol::JobId;
use std::collections::{BTreeMap, VecDeque};

/// Lines per `Log` message when the backlog is sent.
const LINES_PER_MESSAGE: usize = 1000;

#[derive(Debug)]
pub struct Backlog {
    limit: usize,
    started: Vec<AgentMessage>,
    lines: VecDeque<(JobId, LogChunk)>,
    /// Bytes of `lines`, each counted as text plus [`crate::executor::LINE_OVERHEAD`].
    bytes: usize,
    /// Per job: lines and bytes of text dropped, and when the first of them was written.
    dropped: BTreeMap<JobId, Dropped>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Dropped {
    lines: u64,
    bytes: u64,
    first_ts_us: i64,
}

fn cost(chunk: &LogChunk) -> usize {
    chunk.text.len() + crate::executor::LINE_OVERHEAD
}

impl Backlog {
    /// A backlog that holds at most `limit` bytes of output.
    pub fn new(limit: usize) -> Backlog {
        Backlog { limit, started: Vec::new(), lines: VecDeque::new(), bytes: 0, dropped: BTreeMap::new() }
    }

    pub fn started(&mut self, msg: AgentMessage) {
        self.started.push(msg);
    }

    /// Keep a line, dropping the oldest lines while over the limit.
    pub fn line(&mut self, job_id: JobId, chunk: LogChunk) {
        self.bytes += cost(&chunk);
        self.lines.push_back((job_id, chunk));
        while self.bytes > self.limit {
            let Some((job, old)) = self.lines.pop_front() else { break };
            self.bytes -= cost(&old);
            let d = self.dropped.entry(job).or_insert(Dropped { first_ts_us: old.ts_us, ..Default::default() });
            d.lines += 1;
            d.bytes += old.text.len() as u64 + 1;
        }
    }

    /// Bytes of output held now.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Everything to send after the hello, in order: starts, then per job a notice of what
    /// was dropped (where the gap is: before the lines kept), then the lines kept.
    pub fn take(&mut self) -> Vec<AgentMessage> {
        let mut out = std::mem::take(&mut self.started);
        for (job_id, d) in std::mem::take(&mut self.dropped) {
            let text = format!(
                "{} lines ({} bytes) of output dropped while the coordinator was unreachable \
                 (the agent keeps at most {} bytes of output until it reconnects)",
                d.lines, d.bytes, self.limit
            );
            out.push(AgentMessage::Log {
                job_id,
                lines: vec![LogChunk { ts_us: d.first_ts_us, stream: Stream::System, text }],
            });
        }
        let mut batch: Option<(JobId, Vec<LogChunk>)> = None;
        for (job_id, chunk) in std::mem::take(&mut self.lines) {
            match &mut batch {
                Some((j, lines)) if *j == job_id && lines.len() < LINES_PER_MESSAGE => lines.push(chunk),
                _ => {
                    if let Some((job_id, lines)) = batch.replace((job_id, vec![chunk])) {
                        out.push(AgentMessage::Log { job_id, lines });
                    }
                }
            }
        }
        if let Some((job_id, lines)) = batch {
            out.push(AgentMessage::Log { job_id, lines });
        }
        self.bytes = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn chunk(text: &str) -> LogChunk {
        LogChunk { ts_us: 1, stream: Stream::Stdout, text: text.into() }
    }

    #[test]
    fn the_backlog_is_bounded_in_bytes_and_says_what_it_dropped() {
        let mut b = Backlog::new(10_000);
        b.started(AgentMessage::JobStarted { job_id: 7, pid: 1, started_at_us: 0 });
        for i in 0..100_000 {
            b.line(7, chunk(&format!("line {i}")));
            assert!(b.bytes() <= 10_000, "backlog grew to {} bytes", b.bytes());
        }
        let msgs = b.take();
        assert!(matches!(msgs[0], AgentMessage::JobStarted { job_id: 7, .. }), "the start is never dropped");
        let AgentMessage::Log { job_id: 7, lines } = &msgs[1] else { panic!("no notice: {:?}", msgs[1]) };
        assert_eq!(lines[0].stream, Stream::System);
        let kept: usize = msgs[2..]
            .iter()
            .map(|m| match m {
                AgentMessage::Log { lines, .. } => lines.len(),
                _ => 0,
            })
            .sum();
        let dropped = 100_000 - kept;
        assert!(
            lines[0].text.starts_with(&format!("{dropped} lines (")),
            "the notice must count the dropped lines: {}",
            lines[0].text
        );
        assert!(lines[0].text.contains("dropped while the coordinator was unreachable"));
        let AgentMessage::Log { lines, .. } = msgs.last().unwrap() else { panic!() };
        assert_eq!(lines.last().unwrap().text, "line 99999", "the newest lines are kept");
        assert_eq!(b.bytes(), 0);
        assert!(b.take().is_empty());
    }

    #[test]
    fn nothing_dropped_no_notice() {
        let mut b = Backlog::new(10_000);
        b.line(1, chunk("a"));
        b.line(2, chunk("b"));
        let msgs = b.take();
        assert_eq!(msgs.len(), 2);
        assert!(msgs.iter().all(|m| matches!(m, AgentMessage::Log { lines, .. } if lines[0].stream == Stream::Stdout)));
    }
}
