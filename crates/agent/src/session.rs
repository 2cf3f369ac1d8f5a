//! The agent channel, one connection of it: opening it to a coordinator that proved the
//! installation's key ([`crate::follow`]), the hello, then handling what the coordinator
//! sends ([`Agent::on_message`]) and sending the outbox until the connection ends. The
//! agent's state stays the [`Agent`]'s (one owner); this is where it meets the wire.

use super::*;

impl Agent {
    pub(crate) async fn session(
        &mut self,
        id: &identity::Identity,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<SessionEnd> {
        let (targets, said) = self.coordinators.candidates_next().await;
        if targets.is_empty() {
            return Err(follow::NoLeader { said }.into());
        }
        let mut failed = Vec::new();
        let mut connected = None;
        for t in &targets {
            match connect(t, id, self.coordinators.pinned().or(t.key.as_deref())).await {
                Ok(ws) => {
                    connected = Some((ws, t));
                    break;
                }
                // Refused for its credential: no other coordinator of its database knows it either.
                Err(e) if targets.len() == 1 || e.downcast_ref::<Unknown>().is_some() => return Err(e),
                Err(e) => failed.push(format!("{}: {e:#}", t.base)),
            }
        }
        let Some((ws, target)) = connected else { bail!("no coordinator answered: {}", failed.join("; ")) };
        if let Some(key) = self.coordinators.used(target) {
            // An agent registered before identity keys: the first key met is kept.
            let mut id = id.clone();
            identity::pin(&self.data_dir, &mut id, &key)?;
        }
        let (mut sink, mut stream) = ws.split();
        let mut hello = self.hello_base.clone();
        hello.running = self.holds.iter().copied().collect();
        hello.journal_incomplete = self.journal.incomplete().map(str::to_string);
        hello.paused = self.paused.clone();
        hello.interrupted = self.interrupted.borrow().clone();
        self.told_taken_back = hello.interrupted.is_some();
        send(&mut sink, &AgentMessage::Hello(Box::new(hello))).await?;
        // A new connection: everything not acknowledged goes again.
        self.outbox.rewind();

        // Welcome first.
        let heartbeat = match tokio::time::timeout(Duration::from_secs(15), stream.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => match serde_json::from_str::<CoordinatorMessage>(&t)? {
                CoordinatorMessage::Welcome { heartbeat_interval_ms, forget, .. } => {
                    // The coordinator has settled our jobs knowing what the journal lacked.
                    if self.journal.incomplete().is_some() {
                        if let Err(e) = self.journal.reconciled() {
                            tracing::error!(error = %e, "could not record in the journal that the coordinator settled its gaps");
                        }
                    }
                    for f in forget {
                        tracing::warn!(job = f.job_id, reason = %f.reason, "coordinator ended a job while we were apart");
                        // Its result (when it comes) is acknowledged like any other.
                        if let Some(c) = self.running.get(&f.job_id) {
                            c.cancel();
                        }
                    }
                    Duration::from_millis(heartbeat_interval_ms.max(100))
                }
                CoordinatorMessage::Refused { reason } => return Ok(SessionEnd::Refused(reason)),
                other => bail!("expected welcome, got {other:?}"),
            },
            Ok(Some(Ok(_))) => bail!("unexpected frame before welcome"),
            Ok(Some(Err(e))) => return Err(e.into()),
            Ok(None) => return Ok(SessionEnd::Disconnected("closed before welcome".into())),
            Err(_) => bail!("no welcome within 15s"),
        };
        self.welcomed = true;
        tracing::info!(server = %target.base, running = self.running.len(), "connected to coordinator");
        self.send_outbox(&mut sink).await?;
        let mut tick = tokio::time::interval(heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Reconciliation of the GPU inventory (a GPU fell off the bus, MIG was reconfigured).
        let mut refresh = tokio::time::interval(INVENTORY_REFRESH);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        refresh.tick().await;
        let mut disk = tokio::time::interval(DISK_CHECK);
        disk.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        disk.tick().await;
        // An agent whose machine ends by itself ends itself, idle, a little before.
        let end_at = self.ends_at_ms.map(|end| {
            let left = Duration::from_millis((end - executor::now_us() / 1000).max(0) as u64);
            tokio::time::Instant::now() + left.saturating_sub(END_MARGIN)
        });
        let mut last_heard = tokio::time::Instant::now();
        let silence_limit = gpuci_protocol::agent_silence_limit(heartbeat);
        // A coordinator quiet this long (two heartbeats, at least 2 s) may be frozen while a
        // standby took over: the others are asked who leads, every 2 s while it stays quiet,
        // and the agent goes to one that proves it does. Waiting for `silence_limit` alone kept
        // agents on a frozen leader 15–19 s (outsider attack), though a standby led in 4–6 s.
        let ask_after = (heartbeat * 2).max(Duration::from_secs(2));
        let mut asked_at: Option<tokio::time::Instant> = None;
        let mut asking: Option<tokio::task::JoinHandle<Option<String>>> = None;
        let several = self.coordinators.may_move();
        loop {
            // A notice is told before anything else this turn: a cluster engine's SIGTERM
            // reaches the jobs too, and their ends must not reach the coordinator first (they
            // would be failures, not jobs to queue again).
            if let Some(reason) = self.taken_back_untold() {
                send(&mut sink, &AgentMessage::Interrupted { reason }).await?;
            }
            if let Some(why) = self.done_here(end_at) {
                tracing::info!("{why}; ending this agent");
                let _ = sink.close().await;
                return Ok(SessionEnd::Done);
            }
            tokio::select! {
                _ = shutdown.cancelled() => {
                    let _ = sink.close().await;
                    return Ok(SessionEnd::Shutdown);
                }
                _ = tokio::time::sleep_until(end_at.unwrap_or_else(tokio::time::Instant::now)), if end_at.is_some_and(|t| t > tokio::time::Instant::now()) => {}
                _ = refresh.tick() => {
                    let backend = self.ctx.gpus.clone();
                    if let Ok(Ok(now)) = tokio::task::spawn_blocking(move || backend.inventory()).await {
                        if now != self.hello_base.gpus {
                            tracing::info!(before = self.hello_base.gpus.len(), after = now.len(), "GPU inventory changed");
                            self.hello_base.gpus = now.clone();
                            *self.ctx.inventory.write().unwrap_or_else(|e| e.into_inner()) = now.clone();
                            send(&mut sink, &AgentMessage::Gpus { gpus: now, health: BTreeMap::new() }).await?;
                        }
                    }
                }
                _ = tokio::time::sleep_until(
                    (last_heard + ask_after).max(asked_at.map_or(last_heard, |t| t + Duration::from_secs(2)))
                ), if several && asking.is_none() => {
                    let (others, now) = (self.coordinators.clone(), target.clone());
                    asked_at = Some(tokio::time::Instant::now());
                    asking = Some(tokio::spawn(async move { others.another_leads(&now).await }));
                }
                answer = async { asking.as_mut().expect("guarded").await }, if asking.is_some() => {
                    asking = None;
                    if let Ok(Some(leader)) = answer {
                        if last_heard.elapsed() >= ask_after {
                            self.coordinators.left_quiet(target);
                            return Ok(SessionEnd::Disconnected(format!(
                                "the coordinator did not answer for {}s, and {leader} leads now",
                                last_heard.elapsed().as_secs()
                            )));
                        }
                    }
                }
                _ = tick.tick() => {
                    // A coordinator that stopped answering (frozen, its host gone without
                    // closing the connection) is left for a new connection, which a load
                    // balancer sends to whichever coordinator leads now. Pings are answered
                    // by the coordinator's connection itself, however busy its scheduler.
                    if last_heard.elapsed() > silence_limit {
                        return Ok(SessionEnd::Disconnected(format!(
                            "the coordinator did not answer for {}s",
                            last_heard.elapsed().as_secs()
                        )));
                    }
                    sink.send(Message::Ping(Vec::new().into())).await?;
                    let samples = self.ctx.live.take();
                    if !samples.is_empty() {
                        send(&mut sink, &AgentMessage::Telemetry { samples }).await?;
                    }
                    send(&mut sink, &AgentMessage::Heartbeat).await?;
                }
                Ok(()) = self.interrupted.changed() => {
                    if let Some(reason) = self.taken_back_untold() {
                        send(&mut sink, &AgentMessage::Interrupted { reason }).await?;
                    }
                }
                _ = disk.tick() => {
                    if self.check_disk() {
                        send(&mut sink, &AgentMessage::Paused { reason: self.paused.clone() }).await?;
                    }
                }
                Some(ev) = self.events_rx.recv() => {
                    // Drain what is ready: low latency when idle, few frames under load.
                    self.drain_events(ev);
                    if std::mem::take(&mut self.suspect_signal) && self.interrupted.borrow().is_none() {
                        // The engine's SIGTERM may be on its way to this agent too: give it a
                        // moment, so the job is queued again rather than failed.
                        let _ = tokio::time::timeout(SIGNAL_GRACE, self.interrupted.changed()).await;
                    }
                    if let Some(reason) = self.taken_back_untold() {
                        send(&mut sink, &AgentMessage::Interrupted { reason }).await?;
                    }
                    self.send_outbox(&mut sink).await?;
                }
                msg = stream.next() => match msg.inspect(|m| if m.is_ok() { last_heard = tokio::time::Instant::now() }) {
                    Some(Ok(Message::Text(t))) => match serde_json::from_str::<CoordinatorMessage>(&t) {
                        Ok(m) => if let Some(end) = self.on_message(m) { return Ok(end) },
                        Err(e) => tracing::warn!(error = %e, "unreadable message from coordinator; ignored"),
                    },
                    Some(Ok(Message::Close(_))) | None => return Ok(SessionEnd::Disconnected("closed by coordinator".into())),
                    Some(Err(e)) => return Ok(SessionEnd::Disconnected(e.to_string())),
                    Some(Ok(_)) => {}
                },
            }
        }
    }

    fn on_message(&mut self, m: CoordinatorMessage) -> Option<SessionEnd> {
        match m {
            CoordinatorMessage::Assign(mut a) => {
                // On a machine that ends by itself, no job runs past the end: one without a
                // timeout (or with one longer than what is left) is given what is left, less
                // a minute to report, and ends timed out, not taken down with the machine
                // (and queued again, to take the next machine down too).
                if let Some(end) = self.ends_at_ms {
                    let left_ms = (end - executor::now_us() / 1000 - 60_000).max(1_000) as u64;
                    let left = gpuci_core::duration::Duration(Duration::from_millis(left_ms));
                    if a.step.timeout.is_none_or(|t| t.0 > left.0) {
                        tracing::info!(job = a.job_id, timeout = ?left.0, "the job's timeout is what is left of this machine");
                        a.step.timeout = Some(left);
                    }
                }
                if self.holds.contains(&a.job_id) {
                    tracing::warn!(job = a.job_id, "assignment for a job this agent already has; ignored");
                    return None;
                }
                tracing::info!(job = a.job_id, name = %a.name, gpus = ?a.gpus, "job assigned");
                self.holds.insert(a.job_id);
                // On disk before anything of the job starts: a job the journal does not name
                // never ran here, which is what lets the coordinator hand it out again.
                if let Err(e) =
                    self.journal.write(&Record::Received { job_id: a.job_id, at_us: executor::now_us() }, true)
                {
                    tracing::error!(job = a.job_id, error = %e, "could not journal the assignment; not running it");
                    let error = format!("the agent could not record the assignment in its journal: {e}");
                    let _ = self.events_tx.send(JobEvent::Finished(JobFinished {
                        job_id: a.job_id,
                        outcome: gpuci_core::job::Outcome::StartFailed { error },
                        finished_at_us: executor::now_us(),
                        started_at_us: None,
                        lines: None,
                        telemetry: None,
                        gpu_health: BTreeMap::new(),
                    }));
                    return None;
                }
                self.outbox.start_job(a.job_id, a.log_from);
                let cancel = CancellationToken::new();
                self.running.insert(a.job_id, cancel.clone());
                tokio::spawn(executor::run_job(*a, self.ctx.clone(), self.events_tx.clone(), cancel));
            }
            CoordinatorMessage::Cancel { job_id, reason } => {
                if let Some(c) = self.running.get(&job_id) {
                    tracing::info!(job = job_id, reason = %reason, "cancelling job");
                    c.cancel();
                }
            }
            CoordinatorMessage::Acked { upto } => self.acked(upto),
            CoordinatorMessage::Refused { reason } => return Some(SessionEnd::Refused(reason)),
            CoordinatorMessage::GpuReleased { uuid } => {
                tracing::info!(gpu = %uuid, "GPU returned to service; taking a new health baseline");
                self.ctx.baselines.lock().unwrap_or_else(|e| e.into_inner()).remove(&uuid);
                executor::baseline(&self.ctx, &uuid);
            }
            CoordinatorMessage::Welcome { .. } => {}
        }
        None
    }
}

impl Agent {
    /// Send what the outbox has not sent on this connection, then flush once.
    async fn send_outbox<S>(&mut self, sink: &mut S) -> anyhow::Result<()>
    where
        S: futures::Sink<Message> + Unpin,
        S::Error: std::error::Error + Send + Sync + 'static,
    {
        let events = self.outbox.to_send();
        if events.is_empty() {
            return Ok(());
        }
        for (n, event) in events {
            let text = serde_json::to_string(&AgentMessage::Event { n, event })?;
            sink.feed(Message::Text(text.into())).await?;
        }
        sink.flush().await?;
        Ok(())
    }
}

/// The agent channel could not be opened because the coordinator does not know this agent's
/// credential (401).
#[derive(Debug, thiserror::Error)]
#[error("the coordinator at {server} does not know this agent's credential (401): it was started on another database, or this agent was removed there. To register again, move agent.json (in the agent's data dir) aside and start the agent with --registration-token (jobs held for the old registration are then given up)")]
pub(crate) struct Unknown {
    server: String,
}

pub(crate) type Channel = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Open the agent channel to `target` (at its address, when it has one: one of several a name
/// resolved to). With a key to prove (`key`) on a plain `ws://` URL, the coordinator proves it
/// first on the very TCP connection the handshake, which carries the credential, then goes
/// over (a new connection opened after a proof on another went to whoever held the address
/// by then: a killed coordinator's port taken in that moment got the agent's credential).
pub(crate) async fn connect(
    target: &follow::Target,
    id: &identity::Identity,
    key: Option<&str>,
) -> anyhow::Result<Channel> {
    let url = format!("{}/api/v1/agents/connect", target.base.replacen("http", "ws", 1));
    let mut req = url.as_str().into_client_request()?;
    req.headers_mut().insert("authorization", format!("Bearer {}", id.credential).parse()?);
    req.headers_mut().insert("x-gpuci-agent-id", id.agent_id.parse()?);
    let plain = target.base.starts_with("http://");
    let opened = tokio::time::timeout(Duration::from_secs(10), async {
        match (target.addr, key.filter(|_| plain)) {
            (_, Some(key)) => {
                let tcp = follow::proved_stream(target, key)
                    .await
                    .map_err(|why| tokio_tungstenite::tungstenite::Error::Io(std::io::Error::other(why)))?;
                tokio_tungstenite::client_async_tls_with_config(req, tcp, None, None).await
            }
            (Some(addr), None) => {
                let tcp =
                    tokio::net::TcpStream::connect(addr).await.map_err(tokio_tungstenite::tungstenite::Error::Io)?;
                let _ = tcp.set_nodelay(true);
                // TLS for a `wss://` URL (the name in the URL is the one checked in the
                // certificate), plain for `ws://`: never the handshake, which carries the
                // credential, in the clear to a TLS port (outsider finding).
                tokio_tungstenite::client_async_tls_with_config(req, tcp, None, None).await
            }
            (None, None) => tokio_tungstenite::connect_async_with_config(req, None, true).await,
        }
    })
    .await
    .context("connect timed out")?;
    let (ws, _) = opened.map_err(|e| match &e {
        tokio_tungstenite::tungstenite::Error::Http(r) if r.status() == 401 => {
            anyhow::Error::new(Unknown { server: target.base.clone() })
        }
        _ => anyhow::Error::new(e).context("connecting"),
    })?;
    Ok(ws)
}

pub(crate) async fn send<S>(sink: &mut S, msg: &AgentMessage) -> anyhow::Result<()>
where
    S: futures::Sink<Message> + Unpin,
    S::Error: std::error::Error + Send + Sync + 'static,
{
    let text = serde_json::to_string(msg)?;
    sink.send(Message::Text(text.into())).await?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    /// Outsider finding: with an `https://` URL reached at one of its addresses, the agent
    /// sent the WebSocket handshake, with its credential, in plain text to the TLS port. Now
    /// the first bytes it sends there are a TLS ClientHello.
    #[tokio::test]
    async fn an_https_coordinator_at_an_address_gets_tls_not_the_credential_in_the_clear() {
        use tokio::io::AsyncReadExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let heard = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.unwrap().unwrap_or(0);
            buf.truncate(n);
            buf
        });
        let target = follow::Target::at(&format!("https://localhost:{}", addr.port()), addr);
        let id = identity::Identity {
            agent_id: "a1".into(),
            credential: "gpuci_agent_SECRET".into(),
            server: target.base.clone(),
            coordinator_key: None,
        };
        let _ = connect(&target, &id, None).await;
        let first = heard.await.unwrap();
        assert!(!first.is_empty(), "nothing was sent");
        assert_eq!(first[0], 0x16, "not a TLS handshake record: {:?}", String::from_utf8_lossy(&first));
        assert!(!String::from_utf8_lossy(&first).contains("SECRET"));
    }
}
