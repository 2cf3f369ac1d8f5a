//! A job's output on its way to the agent loop: lines read from the job's pipes, cut at
//! [`LINE_CUT`], masked, counted against the job's log cap and its in-flight budget.
//! Nothing here starts, waits for or ends the job's process; a job that writes faster than
//! the agent forwards waits on its own pipe, never in memory here.

use super::*;

/// The longest line forwarded; a longer run without a newline continues as the next line.
pub(super) const LINE_CUT: usize = 64 * 1024;

/// The most of a cut line held back for the next piece, so no secret straddles the cut
/// (see `Masker::cut`).
const MAX_CARRY: usize = 16 * 1024;

/// Where a job's lines go: gpuci's own lines at once, the job's output through its log cap
/// and its in-flight budget.
#[derive(Clone)]
pub(super) struct Emitter {
    job_id: JobId,
    pub(super) tx: mpsc::UnboundedSender<JobEvent>,
    /// The job's secrets and the values it registered (`::add-mask::`).
    mask: Arc<JobMask>,
    /// The job's in-flight budget ([`JOB_IN_FLIGHT_BYTES`]).
    budget: Arc<Semaphore>,
    cap: Arc<std::sync::Mutex<LogCap>>,
}

/// How much of the job's output was kept, against its cap.
#[derive(Debug, Default)]
pub(super) struct LogCap {
    limit: u64,
    bytes: u64,
    lines: u64,
    cut: bool,
}

impl Emitter {
    pub(super) fn new(
        job_id: JobId,
        tx: mpsc::UnboundedSender<JobEvent>,
        mask: Arc<JobMask>,
        max_log_bytes: u64,
    ) -> Emitter {
        Emitter {
            job_id,
            tx,
            mask,
            budget: Arc::new(Semaphore::new(JOB_IN_FLIGHT_BYTES)),
            cap: Arc::new(std::sync::Mutex::new(LogCap { limit: max_log_bytes, ..Default::default() })),
        }
    }

    pub(super) fn system(&self, text: impl Into<String>) {
        let text = self.mask.get().mask(&text.into());
        let chunk = LogChunk { ts_us: now_us(), stream: Stream::System, text };
        let _ = self.tx.send(JobEvent::Log { job_id: self.job_id, chunk, held: None });
    }

    pub(super) fn is_cut(&self) -> bool {
        self.cap.lock().unwrap_or_else(|e| e.into_inner()).cut
    }

    /// One line of the job's output, already masked. Waits while the job's in-flight budget is
    /// spent (backpressure on the job's pipe). False: stop forwarding (cut, or agent gone).
    pub(super) async fn output(&self, stream: Stream, text: String) -> bool {
        let size = gpuci_protocol::agent::log_line_cost(&text);
        let notice = {
            let mut cap = self.cap.lock().unwrap_or_else(|e| e.into_inner());
            if cap.cut {
                return false;
            }
            if cap.bytes + size > cap.limit {
                cap.cut = true;
                Some(format!(
                    "log cut: the job's output reached this agent's limit of {} bytes per job (--max-log-bytes; \
                     a line counts its text and {} bytes for storing it) after {} bytes in {} lines; the rest of \
                     its output is read and discarded while the job runs",
                    cap.limit,
                    gpuci_protocol::agent::LOG_LINE_COST,
                    cap.bytes,
                    cap.lines
                ))
            } else {
                cap.bytes += size;
                cap.lines += 1;
                None
            }
        };
        if let Some(notice) = notice {
            self.system(notice);
            return false;
        }
        let weight = (text.len() + LINE_OVERHEAD).min(JOB_IN_FLIGHT_BYTES) as u32;
        let Ok(held) = self.budget.clone().acquire_many_owned(weight).await else { return false };
        let chunk = LogChunk { ts_us: now_us(), stream, text };
        self.tx.send(JobEvent::Log { job_id: self.job_id, chunk, held: Some(held) }).is_ok()
    }
}

pub(super) async fn pump(
    out: Emitter,
    stdout: impl AsyncRead + Unpin + Send + 'static,
    stderr: impl AsyncRead + Unpin + Send + 'static,
) {
    let a = tokio::spawn(lines(out.clone(), Stream::Stdout, stdout));
    let b = tokio::spawn(lines(out, Stream::Stderr, stderr));
    let _ = a.await;
    let _ = b.await;
}

/// Forward output line by line, secrets masked, never faster than the agent sends it on. A
/// line is complete before it is masked, so a secret written in several pieces is still caught.
/// Lines are cut at [`LINE_CUT`] so one runaway line cannot blow up memory; the cut keeps back
/// a tail for the next piece so a secret across it is still masked. Invalid UTF-8 is replaced,
/// not dropped. Past the log cap the pipe is still drained, so the job never blocks on it.
/// An `::add-mask::` line on standard output registers its value (see `crate::logmask`)
/// before the line is masked, so it shows as `::add-mask::***`; a refused one is not shown at
/// all, only why (never the value), and neither is one longer than the cut.
pub(super) async fn lines(out: Emitter, stream: Stream, r: impl AsyncRead + Unpin) {
    let mut reader = BufReader::new(r);
    let mut line: Vec<u8> = Vec::new();
    // Inside an `::add-mask::` line too long to take: its rest is read and never shown.
    let mut skipping = false;
    loop {
        if out.is_cut() {
            return discard(reader).await;
        }
        let room = LINE_CUT.saturating_sub(line.len()).max(1) as u64;
        let text = match (&mut reader).take(room).read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) if line.is_empty() => return,
            Ok(_) | Err(_) if skipping => {
                skipping = line.last() != Some(&b'\n');
                line.clear();
                continue;
            }
            Ok(0) | Err(_) => {
                if let Some(text) = complete_line(&out, stream, &line) {
                    out.output(stream, text).await;
                }
                return;
            }
            Ok(_) if line.last() == Some(&b'\n') => {
                while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    line.pop();
                }
                let text = complete_line(&out, stream, &line);
                line.clear();
                match text {
                    Some(text) => text,
                    None => continue,
                }
            }
            Ok(_) if line.len() >= LINE_CUT => {
                let whole = complete_utf8(&line);
                let piece = String::from_utf8_lossy(&line[..whole]);
                if stream == Stream::Stdout && gpuci_core::mask::add_mask_command(&piece).is_some() {
                    out.system(gpuci_core::mask::RegisterError::TooLong { len: line.len() }.to_string());
                    skipping = true;
                    line.clear();
                    continue;
                }
                let (now, carry) = out.mask.get().cut(&piece, MAX_CARRY);
                line.drain(..whole);
                line.splice(0..0, carry.into_bytes());
                if now.is_empty() {
                    continue;
                }
                now
            }
            // End of input without a newline; the next read says so.
            Ok(_) => continue,
        };
        if !out.output(stream, text).await {
            if out.is_cut() {
                return discard(reader).await;
            }
            return;
        }
    }
}

/// A whole line of output (newline removed), masked; an `::add-mask::` line on standard
/// output registers its value first. `None`: nothing of the line is shown (a refused
/// registration: its log says why instead).
fn complete_line(out: &Emitter, stream: Stream, line: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(line);
    if stream == Stream::Stdout {
        if let Some(Err(refused)) = out.mask.command(&text) {
            out.system(refused.to_string());
            return None;
        }
    }
    Some(out.mask.get().mask(&text))
}

/// Read to the end and throw it away: past the cap the job must not block on a full pipe.
async fn discard(mut r: impl AsyncRead + Unpin) {
    let mut buf = vec![0u8; 64 * 1024];
    while matches!(r.read(&mut buf).await, Ok(n) if n > 0) {}
}

/// How much of `bytes` is whole UTF-8 characters: a character split by a cut waits for the
/// next piece instead of becoming two replacement characters.
pub(super) fn complete_utf8(bytes: &[u8]) -> usize {
    let n = bytes.len();
    for back in 1..=3.min(n) {
        let b = bytes[n - back];
        if b & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back for its lead byte
        }
        let width = match b {
            0xF0..=0xF7 => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
        return if width > back { n - back } else { n };
    }
    n
}
