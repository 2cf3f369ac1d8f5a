//! The agent channel: one WebSocket per agent. The first frame must be `Hello`; after it the
//! coordinator pushes `Assign`/`Cancel`/`Ack`, and the agent sends heartbeats, job events and
//! log lines. Log lines are stored here (in order, before any later message of the same
//! connection is handled) so a job's end is never seen before its last line.

use crate::api::ApiError;
use crate::auth::{bearer, verify_hash};
use crate::brain::Command;
use crate::AppState;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use gpuci_protocol::agent::{AgentMessage, CoordinatorMessage, LogChunk, Stream};
use gpuci_protocol::JobId;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

pub const AGENT_ID_HEADER: &str = "x-gpuci-agent-id";

pub async fn connect(State(st): State<AppState>, headers: HeaderMap, ws: WebSocketUpgrade) -> Response {
    let Some(agent_id) = headers.get(AGENT_ID_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string) else {
        return ApiError::new(StatusCode::BAD_REQUEST, format!("missing {AGENT_ID_HEADER} header")).into_response();
    };
    let Some(cred) = bearer(&headers) else {
        return ApiError::new(StatusCode::UNAUTHORIZED, "missing agent credential").into_response();
    };
    let known = match st.store.get_agent(&agent_id).await {
        Ok(a) => a,
        Err(e) => return ApiError::from(e).into_response(),
    };
    // Same answer for unknown agent and wrong credential: don't tell which.
    if !known.is_some_and(|a| verify_hash(cred, &a.credential_hash)) {
        return ApiError::new(StatusCode::UNAUTHORIZED, "unknown agent or wrong credential; register again")
            .into_response();
    }
    ws.max_message_size(64 << 20).on_upgrade(move |socket| serve(st, agent_id, socket))
}

async fn serve(st: AppState, agent_id: String, socket: WebSocket) {
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
    let (tx, mut rx) = mpsc::unbounded_channel::<CoordinatorMessage>();
    let (reply, answer) = oneshot::channel();
    if st.brain.send(Command::AgentConnected { agent_id: agent_id.clone(), conn, hello, tx, reply }).await.is_err() {
        return;
    }
    let accepted = matches!(answer.await, Ok(Ok(())));

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
        // The brain queued a Refused message; let the writer deliver it.
        let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
        return;
    }

    // Per job this agent writes to: its log so far, or None when the job is not its own.
    let mut logs: HashMap<JobId, Option<JobLog>> = HashMap::new();
    let mut last_seen_sent = Instant::now();
    loop {
        let msg = tokio::select! {
            _ = st.shutdown.cancelled() => break,
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
            AgentMessage::JobStarted { job_id, started_at_us, .. } => Some(Command::AgentStarted {
                agent_id: agent_id.clone(),
                conn,
                job: job_id,
                started_at_ms: started_at_us / 1000,
            }),
            AgentMessage::JobFinished(finished) => {
                Some(Command::AgentFinished { agent_id: agent_id.clone(), conn, finished })
            }
            AgentMessage::Gpus { gpus, health } => {
                Some(Command::AgentGpus { agent_id: agent_id.clone(), conn, gpus, health })
            }
            AgentMessage::Hello(_) => None,
            AgentMessage::Log { job_id, lines } => {
                if !logs.contains_key(&job_id) {
                    // Only the agent a job is assigned to may write its log.
                    let log = match st.store.get_job(job_id).await {
                        Ok(Some(j)) if j.agent_id.as_deref() == Some(agent_id.as_str()) => {
                            match st.store.log_size(job_id).await {
                                Ok(stored) => Some(JobLog::new(j.pipeline_id, stored, st.max_log_bytes)),
                                Err(e) => {
                                    tracing::error!(job = job_id, error = %e, "could not read the log's size");
                                    None
                                }
                            }
                        }
                        _ => None,
                    };
                    logs.insert(job_id, log);
                }
                if let Some(Some(log)) = logs.get_mut(&job_id) {
                    let pipeline_id = log.pipeline_id;
                    let lines = log.admit(lines, st.max_log_bytes);
                    match st.store.append_logs(job_id, &lines).await {
                        Ok(stored) => {
                            for l in stored {
                                st.hub.log(job_id, pipeline_id, l);
                            }
                        }
                        Err(e) => tracing::error!(job = job_id, error = %e, "could not store log lines"),
                    }
                } else {
                    tracing::warn!(agent = %agent_id, job = job_id, "log lines for a job not assigned to this agent; dropped");
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
    let _ = st.brain.send(Command::AgentDisconnected { agent_id: agent_id.clone(), conn }).await;
    writer.abort();
}

/// A job's log as one connection writes it: how much is stored, against the coordinator's cap.
#[derive(Debug)]
struct JobLog {
    pipeline_id: i64,
    stored: u64,
    cut: bool,
}

impl JobLog {
    fn new(pipeline_id: i64, stored: u64, cap: u64) -> JobLog {
        // A log at its cap already ends with the notice: don't write another.
        JobLog { pipeline_id, stored, cut: stored >= cap }
    }

    /// The lines to store: those that fit under `cap`; at the first that does not, one gpuci
    /// line saying where and why the log was cut, and nothing after it.
    fn admit(&mut self, lines: Vec<LogChunk>, cap: u64) -> Vec<LogChunk> {
        if self.cut {
            return Vec::new();
        }
        let mut keep = Vec::with_capacity(lines.len());
        for l in lines {
            let size = l.text.len() as u64 + 1;
            if self.stored + size > cap {
                self.cut = true;
                let text = format!(
                    "log cut by the coordinator: this job's log reached its limit of {cap} bytes per job \
                     (gpuci server --max-log-bytes) after {} bytes; later lines are not stored",
                    self.stored
                );
                keep.push(LogChunk { ts_us: l.ts_us, stream: Stream::System, text });
                break;
            }
            self.stored += size;
            keep.push(l);
        }
        keep
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

    fn line(text: &str) -> LogChunk {
        LogChunk { ts_us: 1, stream: Stream::Stdout, text: text.into() }
    }

    #[test]
    fn an_agent_cannot_store_more_than_the_cap() {
        let mut log = JobLog::new(1, 0, 100);
        let first = log.admit((0..9).map(|_| line("123456789")).collect(), 100);
        assert_eq!(first.len(), 9);
        let second = log.admit((0..1000).map(|_| line("123456789")).collect(), 100);
        assert_eq!(second.len(), 2, "one more line fits, then the notice: {second:?}");
        assert_eq!(second[1].stream, Stream::System);
        assert!(second[1].text.contains("limit of 100 bytes") && second[1].text.contains("after 100 bytes"));
        assert!(log.admit(vec![line("more")], 100).is_empty(), "nothing after the cut");
        // A reconnecting agent finds the log at its cap: nothing more, no second notice.
        assert!(JobLog::new(1, 100, 100).admit(vec![line("x")], 100).is_empty());
    }
}
