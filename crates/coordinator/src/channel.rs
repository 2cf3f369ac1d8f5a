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
use gpuci_protocol::agent::{AgentMessage, CoordinatorMessage};
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

    let mut pipelines: HashMap<JobId, Option<i64>> = HashMap::new();
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
                let pipeline = match pipelines.get(&job_id) {
                    Some(p) => *p,
                    None => {
                        // Only the agent a job is assigned to may write its log.
                        let p = match st.store.get_job(job_id).await {
                            Ok(Some(j)) if j.agent_id.as_deref() == Some(agent_id.as_str()) => Some(j.pipeline_id),
                            _ => None,
                        };
                        pipelines.insert(job_id, p);
                        p
                    }
                };
                if let Some(pipeline_id) = pipeline {
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

async fn refuse(sink: &mut futures::stream::SplitSink<WebSocket, Message>, reason: &str) {
    if let Ok(t) = serde_json::to_string(&CoordinatorMessage::Refused { reason: reason.to_string() }) {
        let _ = sink.send(Message::Text(t.into())).await;
    }
    let _ = sink.close().await;
}
