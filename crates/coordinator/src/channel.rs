//! The agent channel: one WebSocket per agent. The first frame must be `Hello`; after it the
//! coordinator pushes `Assign`/`Cancel`/`Acked`, and the agent sends heartbeats and numbered
//! job events (starts, log lines, results).
//!
//! Events are applied in the order they arrive, each before the next is read: log lines are
//! stored here, starts and results go to the scheduler, which answers once it has committed
//! them. Only then is the event acknowledged (`Acked { upto: n }`). When one cannot be
//! committed (the database fails, the disk is full) the connection is closed without that
//! acknowledgement: the agent reconnects after a backoff and sends it again. So a job's end is
//! never seen before its last line, and nothing the agent was told is stored is not.

use crate::auth::{bearer, verify_hash};
use crate::brain::Command;
use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use gpuci_protocol::agent::{AgentMessage, CoordinatorMessage, JobEvent, LogChunk, Stream};
use gpuci_protocol::JobId;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// Samples one telemetry message may carry (an agent buffers at most this many).
const MAX_SAMPLES_PER_MESSAGE: usize = 4096;

pub use crate::auth::AGENT_ID_HEADER;

/// Read and write buffer of each agent's WebSocket.
const LINK_BUFFER_BYTES: usize = 16 << 10;

pub async fn connect(
    State(st): State<AppState>,
    counted: Option<axum::Extension<crate::serve::ConnCount>>,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let Some(agent_id) = headers.get(AGENT_ID_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string) else {
        return ApiError::new(StatusCode::BAD_REQUEST, format!("missing {AGENT_ID_HEADER} header")).into_response();
    };
    let Some(cred) = bearer(&headers) else {
        return ApiError::new(StatusCode::UNAUTHORIZED, "missing agent credential").into_response();
    };
    // Out of contact with its database past its claim, another coordinator may lead: the
    // agent goes to it (through the load balancer or DNS name it uses) rather than here.
    if let Some(why) = st.not_leading() {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("{why}; try again")).into_response();
    }
    let known = match st.store.get_agent(&agent_id).await {
        Ok(a) => a,
        Err(e) => return ApiError::from(e).into_response(),
    };
    // Same answer for unknown agent and wrong credential: don't tell which.
    let Some(known) = known.filter(|a| verify_hash(cred, &a.credential_hash)) else {
        return ApiError::new(StatusCode::UNAUTHORIZED, "unknown agent or wrong credential; register again")
            .into_response();
    };
    // Buffers sized for the messages an agent link carries (heartbeats, job events, log
    // batches of a few KiB): the 128 KiB default read buffer, allocated for every connection,
    // was most of a coordinator's memory per connected agent (BENCHMARKS.md, "The coordinator
    // under load"). Larger messages still arrive whole; they take more reads.
    ws.max_message_size(64 << 20)
        .read_buffer_size(LINK_BUFFER_BYTES)
        .write_buffer_size(LINK_BUFFER_BYTES)
        .on_upgrade(move |socket| serve(st, agent_id, known.name, socket, counted))
}

/// Why an agent registered as `name` may not claim the fleet machine its hello's tags name: a
/// machine's agent is registered (with the machine's own token) as `<fleet>-<machine>`, and
/// only that agent is the machine's (an agent of another machine claimed one: outsider finding).
fn machine_claim_refused(name: &str, tags: &std::collections::BTreeMap<String, String>) -> Option<String> {
    let machine = tags.get(gpuci_providers::TAG_MACHINE)?;
    let fleet = tags.get(gpuci_providers::TAG_FLEET).map_or("", String::as_str);
    (name != format!("{fleet}-{machine}"))
        .then(|| format!("this agent was registered as {name:?}, not as fleet {fleet:?}'s machine {machine:?}"))
}

/// `counted`: the connection's place among client connections, held until the hello is
/// accepted (`crate::serve::ConnCount`).
async fn serve(
    st: AppState,
    agent_id: String,
    registered_as: String,
    socket: WebSocket,
    counted: Option<axum::Extension<crate::serve::ConnCount>>,
) {
    let conn = st.conn_seq.fetch_add(1, Ordering::Relaxed);
    let (mut sink, mut stream) = socket.split();

    // The first frame is Hello.
    let hello = match tokio::time::timeout(Duration::from_secs(10), stream.next()).await {
        Ok(Some(Ok(Message::Text(t)))) => match serde_json::from_str::<AgentMessage>(&t) {
            Ok(AgentMessage::Hello(h)) => h,
            Ok(_) => return refuse(&mut sink, "the first message must be hello").await,
            Err(e) => return refuse(&mut sink, &format!("unreadable hello: {e}")).await,
        },
        _ => return,
    };
    if let Some(why) = machine_claim_refused(&registered_as, &hello.tags) {
        tracing::warn!(agent = %agent_id, "refused: {why}");
        return refuse(&mut sink, &why).await;
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<CoordinatorMessage>();
    // Acknowledgements share the brain's queue without keeping it open: when the brain drops
    // the connection (missed heartbeats) the writer must end and close the socket.
    let acks = tx.downgrade();
    let (reply, answer) = oneshot::channel();
    if st.brain.send(Command::AgentConnected { agent_id: agent_id.clone(), conn, hello, tx, reply }).await.is_err() {
        return;
    }
    let accepted = matches!(answer.await, Ok(Ok(())));
    drop(counted);

    let writer = tokio::spawn(async move {
        while let Some(msg) = rx.recv().await {
            let Ok(text) = serde_json::to_string(&msg) else { continue };
            if sink.send(Message::Text(text.into())).await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });
    if !accepted {
        // Refused (the brain queued why), or the brain could not record the connection (the
        // database failed): let the writer deliver what it has, then close, so the agent
        // retries after its backoff instead of waiting for a welcome.
        let mut writer = writer;
        if tokio::time::timeout(Duration::from_secs(2), &mut writer).await.is_err() {
            writer.abort();
        }
        let _ = st.brain.send(Command::AgentDisconnected { agent_id, conn }).await;
        return;
    }

    // Per job this agent writes to: its log so far, or None when the job is not its own.
    let mut logs: HashMap<JobId, JobLog> = HashMap::new();
    // Per job this agent sent samples of: whether it is the agent's own running job.
    let mut sampled: HashMap<JobId, bool> = HashMap::new();
    let mut last_seen_sent = Instant::now();
    let mut leading = st.leading.clone();
    // Stepping aside also ends a turn that waits on the database (a write that hangs: the
    // database cut off by a partition that drops packets), which the `select!` below would
    // only see after it; until then the socket is neither read (no pongs) nor closed, and the
    // agent would stay until its silence limit.
    let mut aside = st.leading.clone();
    let session = async {
        loop {
            let msg = tokio::select! {
                _ = st.shutdown.cancelled() => break,
                // Stepped aside (see `connect`): the agent reconnects, to the leader.
                Ok(_) = leading.wait_for(|l| !*l) => break,
                m = stream.next() => m,
            };
            let text = match msg {
                Some(Ok(Message::Text(t))) => t,
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => continue,
            };
            let msg = match serde_json::from_str::<AgentMessage>(&text) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(agent = %agent_id, error = %e, "unreadable message from agent; ignored");
                    continue;
                }
            };
            let cmd = match msg {
                AgentMessage::Heartbeat => Some(Command::AgentSeen { agent_id: agent_id.clone(), conn }),
                AgentMessage::Gpus { gpus, health } => {
                    Some(Command::AgentGpus { agent_id: agent_id.clone(), conn, gpus, health })
                }
                AgentMessage::Paused { reason } => {
                    Some(Command::AgentPaused { agent_id: agent_id.clone(), conn, reason })
                }
                AgentMessage::Interrupted { reason } => {
                    Some(Command::AgentInterrupted { agent_id: agent_id.clone(), conn, reason })
                }
                AgentMessage::Hello(_) => None,
                AgentMessage::Telemetry { mut samples } => {
                    samples.truncate(MAX_SAMPLES_PER_MESSAGE);
                    if sampled.len() > 4096 {
                        sampled.clear();
                    }
                    let mut mine = Vec::with_capacity(samples.len());
                    for s in samples {
                        let own = match sampled.get(&s.job_id) {
                            Some(own) => *own,
                            None => {
                                let own = matches!(st.store.get_job(s.job_id).await,
                                Ok(Some(j)) if j.agent_id.as_deref() == Some(agent_id.as_str()) && !j.state.is_terminal());
                                sampled.insert(s.job_id, own);
                                own
                            }
                        };
                        if own {
                            mine.push(s);
                        }
                    }
                    for (job, point) in st.live.record(&agent_id, mine) {
                        st.hub.telemetry(job, point);
                    }
                    None
                }
                AgentMessage::Event { n, event } => {
                    let applied = match event {
                        JobEvent::Log { job_id, first_seq, lines } => {
                            store_lines(&st, &agent_id, &mut logs, job_id, first_seq, lines).await
                        }
                        JobEvent::Started { job_id, started_at_us, unenforced, .. } => {
                            let (reply, answer) = oneshot::channel();
                            let cmd = Command::AgentStarted {
                                agent_id: agent_id.clone(),
                                conn,
                                job: job_id,
                                started_at_ms: started_at_us / 1000,
                                unenforced,
                                reply,
                            };
                            ask(&st, cmd, answer).await
                        }
                        JobEvent::Finished(finished) => {
                            if let Err(why) = note_lost_lines(&st, &agent_id, &mut logs, &finished).await {
                                tracing::warn!(agent = %agent_id, event = n, why, "closing the connection; the agent sends it again");
                                break;
                            }
                            st.live.end(finished.job_id);
                            let (reply, answer) = oneshot::channel();
                            ask(
                                &st,
                                Command::AgentFinished { agent_id: agent_id.clone(), conn, finished, reply },
                                answer,
                            )
                            .await
                        }
                    };
                    if let Err(why) = applied {
                        // Not acknowledged: the agent sends it again after reconnecting.
                        tracing::warn!(agent = %agent_id, event = n, why, "could not apply an agent's event; closing its connection so it sends it again later");
                        break;
                    }
                    match acks.upgrade() {
                        Some(tx) => {
                            let _ = tx.send(CoordinatorMessage::Acked { upto: n });
                        }
                        None => break,
                    }
                    // Output counts as a sign of life; tell the brain at most once a second.
                    (last_seen_sent.elapsed() > Duration::from_secs(1)).then(|| {
                        last_seen_sent = Instant::now();
                        Command::AgentSeen { agent_id: agent_id.clone(), conn }
                    })
                }
            };
            if let Some(cmd) = cmd {
                if st.brain.send(cmd).await.is_err() {
                    break;
                }
            }
        }
    };
    let mut writer = writer;
    tokio::select! {
        _ = session => {}
        Ok(_) = aside.wait_for(|l| !*l) => {}
        // The scheduler let this connection go (the agent connected again, or went silent):
        // its writer sent a close and ended. A peer that never answers the close does not
        // keep the socket: an outsider piled up 379 replaced channels of one agent, each
        // holding a file, until the coordinator could answer no one.
        () = async {
            let _ = (&mut writer).await;
            tokio::time::sleep(CLOSE_GRACE).await;
        } => {}
    }
    let _ = st.brain.send(Command::AgentDisconnected { agent_id: agent_id.clone(), conn }).await;
    writer.abort();
}

/// How long a connection the scheduler let go waits for its peer's answer to the close.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Ask the scheduler to apply an event; `Err` when it could not commit it (or is gone).
async fn ask(st: &AppState, cmd: Command, answer: oneshot::Receiver<Result<(), String>>) -> Result<(), String> {
    st.brain.send(cmd).await.map_err(|_| "the coordinator is shutting down".to_string())?;
    answer.await.map_err(|_| "the coordinator is shutting down".to_string())?
}

/// Store a job's numbered lines, once each, under the coordinator's cap. Lines of a job that
/// is not this agent's are dropped (and acknowledged: sending them again changes nothing).
async fn store_lines(
    st: &AppState,
    agent_id: &str,
    logs: &mut HashMap<JobId, JobLog>,
    job_id: JobId,
    first_seq: u64,
    lines: Vec<LogChunk>,
) -> Result<(), String> {
    if let std::collections::hash_map::Entry::Vacant(slot) = logs.entry(job_id) {
        // Only the agent a job is assigned to may write its log. A job that is not this
        // agent's is asked about again next time, never remembered as not: it may be assigned
        // here later under the same id (a database restored from a backup hands out ids
        // again), and its whole log was dropped (outsider attack).
        match st.store.get_job(job_id).await.map_err(|e| e.to_string())? {
            Some(j) if j.agent_id.as_deref() == Some(agent_id) => {
                let (stored, last_seq) = st.store.log_extent(job_id).await.map_err(|e| e.to_string())?;
                slot.insert(JobLog::new(j.pipeline_id, stored, last_seq, st.max_log_bytes));
            }
            _ => {}
        }
    }
    let Some(log) = logs.get_mut(&job_id) else {
        tracing::warn!(agent = %agent_id, job = job_id, "log lines for a job not assigned to this agent; dropped");
        return Ok(());
    };
    let pipeline_id = log.pipeline_id;
    let (first, lines) = log.admit(first_seq as i64, lines, st.max_log_bytes);
    if lines.is_empty() {
        return Ok(());
    }
    match st.store.append_logs(job_id, Some(first), &lines).await {
        Ok(stored) => {
            log.stored_through(&stored);
            for l in stored {
                st.hub.log(job_id, pipeline_id, l);
            }
            Ok(())
        }
        Err(e) => {
            // What this connection counted is not known to be stored: count again next time.
            logs.remove(&job_id);
            Err(format!("storing log lines of job {job_id}: {e}"))
        }
    }
}

/// A result says how many lines the job printed; any the log does not have by now died with
/// the agent before it could send them (it journals results, not output). The log says so,
/// where they would have been, instead of ending short in silence.
async fn note_lost_lines(
    st: &AppState,
    agent_id: &str,
    logs: &mut HashMap<JobId, JobLog>,
    f: &gpuci_protocol::agent::JobFinished,
) -> Result<(), String> {
    let Some(printed) = f.lines else { return Ok(()) };
    let missing_from = match logs.get(&f.job_id) {
        Some(log) if log.cut => return Ok(()),
        Some(log) => log.last_seq + 1,
        None => match st.store.get_job(f.job_id).await.map_err(|e| e.to_string())? {
            Some(j) if j.agent_id.as_deref() == Some(agent_id) && !j.state.is_terminal() => {
                let (stored, last_seq) = st.store.log_extent(f.job_id).await.map_err(|e| e.to_string())?;
                if stored >= st.max_log_bytes {
                    return Ok(());
                }
                last_seq + 1
            }
            _ => return Ok(()),
        },
    };
    if missing_from > printed as i64 {
        return Ok(());
    }
    let text = format!(
        "lines {missing_from}-{printed} of this job's output were lost: its agent stopped (killed or crashed) \
         before it could send them"
    );
    let line = LogChunk { ts_us: f.finished_at_us, stream: Stream::System, text };
    tracing::warn!(job = f.job_id, lines = printed as i64 - missing_from + 1, "job output lost with its agent");
    let stored = st.store.append_logs(f.job_id, Some(missing_from), &[line]).await.map_err(|e| e.to_string())?;
    if let Some(log) = logs.get_mut(&f.job_id) {
        log.stored_through(&stored);
    }
    if let Ok(Some(j)) = st.store.get_job(f.job_id).await {
        for l in stored {
            st.hub.log(f.job_id, j.pipeline_id, l);
        }
    }
    Ok(())
}

/// A job's log as one connection writes it: how much is stored, against the coordinator's cap.
#[derive(Debug)]
struct JobLog {
    pipeline_id: i64,
    /// Bytes stored.
    stored: u64,
    /// Highest line number stored.
    last_seq: i64,
    cut: bool,
}

impl JobLog {
    fn new(pipeline_id: i64, stored: u64, last_seq: i64, cap: u64) -> JobLog {
        // A log at its cap already ends with the notice: don't write another.
        JobLog { pipeline_id, stored, last_seq, cut: stored >= cap }
    }

    /// Count lines the store has taken.
    fn stored_through(&mut self, stored: &[gpuci_protocol::api::LogLine]) {
        if let Some(l) = stored.last() {
            self.last_seq = self.last_seq.max(l.seq);
        }
    }

    /// The lines to store, numbered from `first_seq`: those not stored before that fit under
    /// `cap`; at the first that does not, one gpuci line saying where and why the log was
    /// cut (in its place), and nothing after it. Returns the first one's number and the lines.
    fn admit(&mut self, first_seq: i64, lines: Vec<LogChunk>, cap: u64) -> (i64, Vec<LogChunk>) {
        // Sent before (a resend after a reconnect): already stored and counted.
        let skip = usize::try_from(self.last_seq + 1 - first_seq).unwrap_or(0).min(lines.len());
        let first = first_seq + skip as i64;
        if self.cut {
            return (first, Vec::new());
        }
        let mut keep = Vec::with_capacity(lines.len());
        for l in lines.into_iter().skip(skip) {
            let size = gpuci_protocol::agent::log_line_cost(&l.text);
            if self.stored + size > cap {
                self.cut = true;
                let text = format!(
                    "log cut by the coordinator: this job's log reached its limit of {cap} bytes per job \
                     (gpuci server --max-log-bytes; a line counts its text and {} bytes for storing it) after {} \
                     bytes; later lines are not stored",
                    gpuci_protocol::agent::LOG_LINE_COST,
                    self.stored
                );
                keep.push(LogChunk { ts_us: l.ts_us, stream: Stream::System, text });
                break;
            }
            self.stored += size;
            keep.push(l);
        }
        (first, keep)
    }
}

async fn refuse(sink: &mut futures::stream::SplitSink<WebSocket, Message>, reason: &str) {
    if let Ok(t) = serde_json::to_string(&CoordinatorMessage::Refused { reason: reason.to_string() }) {
        let _ = sink.send(Message::Text(t.into())).await;
    }
    let _ = sink.close().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_machines_own_agent_claims_the_machine() {
        let tags = |f: &str, m: &str| {
            std::collections::BTreeMap::from([
                (gpuci_providers::TAG_FLEET.to_string(), f.to_string()),
                (gpuci_providers::TAG_MACHINE.to_string(), m.to_string()),
                ("pool".to_string(), "l4".to_string()),
            ])
        };
        assert_eq!(machine_claim_refused("l4-m-1", &tags("l4", "m-1")), None);
        assert!(machine_claim_refused("l4b-m-2", &tags("l4", "m-1")).is_some(), "another machine's agent");
        assert!(machine_claim_refused("whatever", &tags("l4", "m-1")).is_some());
        let mut no_fleet = tags("l4", "m-1");
        no_fleet.remove(gpuci_providers::TAG_FLEET);
        assert!(machine_claim_refused("l4-m-1", &no_fleet).is_some());
        assert_eq!(machine_claim_refused("gpu-host", &std::collections::BTreeMap::new()), None, "not a machine");
    }

    fn line(text: &str) -> LogChunk {
        LogChunk { ts_us: 1, stream: Stream::Stdout, text: text.into() }
    }

    // A line of 9 characters counts 49 against the cap (its text and the cost of storing it).
    const CAP: u64 = 490;

    #[test]
    fn an_agent_cannot_store_more_than_the_cap() {
        let mut log = JobLog::new(1, 0, 0, CAP);
        let (at, first) = log.admit(1, (0..9).map(|_| line("123456789")).collect(), CAP);
        assert_eq!((at, first.len()), (1, 9));
        log.last_seq = 9;
        let (at, second) = log.admit(10, (0..1000).map(|_| line("123456789")).collect(), CAP);
        assert_eq!((at, second.len()), (10, 2), "one more line fits, then the notice: {second:?}");
        assert_eq!(second[1].stream, Stream::System);
        assert!(second[1].text.contains("limit of 490 bytes") && second[1].text.contains("after 490 bytes"));
        assert!(log.admit(1010, vec![line("more")], CAP).1.is_empty(), "nothing after the cut");
        // A reconnecting agent finds the log at its cap: nothing more, no second notice.
        assert!(JobLog::new(1, CAP, 11, CAP).admit(12, vec![line("x")], CAP).1.is_empty());
    }

    #[test]
    fn tiny_lines_cannot_store_many_times_the_cap() {
        // A job printing empty lines: each still costs a row.
        let mut log = JobLog::new(1, 0, 0, 4000);
        let (_, kept) = log.admit(1, (0..10_000).map(|_| line("")).collect(), 4000);
        assert_eq!(kept.len(), 100 + 1, "100 empty lines and the notice");
    }

    #[test]
    fn lines_sent_again_are_neither_stored_nor_counted_twice() {
        let mut log = JobLog::new(1, 98, 2, CAP);
        let (at, lines) = log.admit(1, vec![line("123456789"), line("123456789"), line("new")], CAP);
        assert_eq!(at, 3);
        assert_eq!(lines.iter().map(|l| l.text.as_str()).collect::<Vec<_>>(), ["new"]);
        assert_eq!(log.stored, 98 + 43);
        assert!(log.admit(1, vec![line("a")], CAP).1.is_empty());
    }
}
