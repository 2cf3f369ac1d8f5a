//! A standby passes the API and the dashboard on to the leader (docs/ha.md): a person or a
//! script given any coordinator's address is served, whichever leads. The leader records
//! where it is reached and its identity key in the database ([`LEADER_STATE`], a fenced write:
//! only the coordinator that holds the claim can make it); a standby reads that record, asks
//! the address to prove the key (`GET /api/v1/identity`, as agents and the CLI do) and only
//! then sends it a request, credentials included, **on the connection the proof was made on**
//! (a proof holds for one TCP connection, never for an address: a process that takes a dead
//! leader's port is sent nothing). The key it asks for is the installation's as this standby
//! knows it (its data dir's key, or the database's sealed key opened with its secrets key),
//! never the record's: a record that names another key (written by someone who can write the
//! database) is refused, loudly. The client's `Host` goes on as it came.
//!
//! Not passed on: the agent channel (a WebSocket; agents given several addresses find the
//! leader themselves), `/readyz` (a standby's own answer), the identity proof (it proves the
//! coordinator asked, and a standby proves nothing) and webhooks (a standby queues those
//! itself, `crate::standby`). Must not: send a request to an address it has not proved.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use gpuci_core::coordinator_identity::{self as identity, IdentityProof};
use gpuci_store::Store;
use hyper::client::conn::http1::SendRequest;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The state name of the leader's record.
pub const LEADER_STATE: &str = "leader";

/// Where the leader is reached, and the key it proves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderRecord {
    /// Base URLs, best first: its socket's address (when it is a specific one), then its
    /// public names.
    pub urls: Vec<String>,
    /// The installation's identity key (`ed25519:<hex>`).
    pub key: String,
    pub epoch: i64,
    /// The heartbeat interval this leader gives its agents (ms): how long they take to leave
    /// it when it freezes, which whoever takes over must wait for. Absent in records of
    /// older coordinators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_ms: Option<u64>,
}

/// The URLs a leader bound to `addr` is reached at: the address itself unless it is
/// unspecified (`0.0.0.0`, `::`), then each public name (`NAME` or `NAME:PORT`; a bare name
/// gets the socket's port), then, for an unspecified address, the host's name.
pub fn leader_urls(addr: SocketAddr, public_names: &[String], hostname: Option<&str>) -> Vec<String> {
    let mut urls = Vec::new();
    if !addr.ip().is_unspecified() {
        urls.push(format!("http://{addr}"));
    }
    for name in public_names {
        let has_port =
            name.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && !h.ends_with(':') && p.parse::<u16>().is_ok())
                || (name.starts_with('[') && name.contains("]:"));
        urls.push(if has_port { format!("http://{name}") } else { format!("http://{name}:{}", addr.port()) });
    }
    if addr.ip().is_unspecified() {
        if let Some(h) = hostname.map(str::trim).filter(|h| !h.is_empty()) {
            urls.push(format!("http://{h}:{}", addr.port()));
        }
    }
    urls.dedup();
    urls
}

/// A leader's connection is proved once and used while it stays open and busy at most this
/// long idle: a proof holds for the TCP connection it was made on, never for an address.
/// Under the leader's own idle close (`serve.rs`), so no request goes out on a connection
/// the leader is closing.
const IDLE_FOR: Duration = gpuci_protocol::CLIENT_POOL_IDLE;
/// Proved connections kept for later requests.
const MAX_IDLE: usize = 32;
/// The leader's record is read again after this long.
const RECORD_FOR: Duration = Duration::from_secs(1);
/// Connecting to the leader, its proof, and its answer's head.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const PROOF_TIMEOUT: Duration = Duration::from_secs(5);
const HEAD_TIMEOUT: Duration = Duration::from_secs(60);
/// Requests passed on at once; more are answered 503.
const MAX_IN_FLIGHT: usize = 1024;
/// Requests one client address may have passed on at once: a share of [`MAX_IN_FLIGHT`], so
/// that one client holding requests open (a body that never arrives holds its slot until the
/// head timeout) cannot take every slot (outsider finding). Behind a load balancer every
/// client is the balancer's address: this is then the standby's whole share through it.
const MAX_IN_FLIGHT_PER_CLIENT: usize = MAX_IN_FLIGHT / 8;
// Others keep most of the slots.
const _: () = assert!(MAX_IN_FLIGHT_PER_CLIENT * 2 <= MAX_IN_FLIGHT);
/// A proof is a few hundred bytes.
const MAX_PROOF_BYTES: usize = 4096;

/// How a standby knows the installation's key (`crate::identity::installation_key`): never from
/// the leader's record, which anyone who can write the database could have written.
pub struct KeySource {
    pub secrets_key_file: PathBuf,
    pub data_dir: PathBuf,
}

/// One TCP connection to the leader, on which the installation's key was proved.
struct Proved {
    base: String,
    epoch: i64,
    sender: SendRequest<Body>,
    since: Instant,
}

/// A standby's way to the leader.
pub struct Proxy {
    store: Arc<dyn Store>,
    source: KeySource,
    /// The installation's key, once known.
    pinned: tokio::sync::OnceCell<String>,
    record: Mutex<Option<(LeaderRecord, Instant)>>,
    idle: Arc<Mutex<Vec<Proved>>>,
    in_flight: Arc<tokio::sync::Semaphore>,
    /// How many requests it passes on at once, and from one client address.
    most: (usize, usize),
    /// Requests in flight per client address.
    per_client: Arc<Mutex<Shares>>,
    /// The leader's epoch as the database says now: a relayed answer from the leader of
    /// another epoch ends, with an error, when it changes ([`Proxy::forward`]).
    leader_epoch: tokio::sync::watch::Receiver<Option<i64>>,
    /// Its writer, until the first request passed on starts the task that reads it
    /// ([`watch_epoch`]).
    epoch_writer: Mutex<Option<tokio::sync::watch::Sender<Option<i64>>>>,
    /// Cancelled when this standby stops standing by (it took over, or it is shutting down):
    /// every answer it is still passing on is cut then. Its database connections are closed
    /// at a takeover, so the epoch could no longer be read to tell.
    standing_down: tokio_util::sync::CancellationToken,
}

/// Requests in flight per client address (`None`: a request that came without one), and how
/// many of them are a client's second or later (its *repeats*).
///
/// A client's repeats share at most three quarters of the requests a standby passes on at
/// once; the last quarter is for clients' first requests. Nine addresses, each holding its
/// share (an eighth) with bodies sent at the floor rate, took every slot, and everyone else
/// got 503 (outsider attack); now that takes about as many addresses as a quarter of the
/// slots (768 at 65,536 open files, 12 at 1,024; no better at a few hundred, where a share is
/// two slots).
#[derive(Default)]
struct Shares {
    per: std::collections::HashMap<Option<std::net::IpAddr>, usize>,
    repeats: usize,
}

/// How many of `pool` slots clients' repeats may hold together.
fn repeats_limit(pool: usize) -> usize {
    pool - pool / 4
}

/// One of a client's slots, given back when dropped.
struct ClientSlot {
    shares: Arc<Mutex<Shares>>,
    client: Option<std::net::IpAddr>,
}

/// Why a client's request is not passed on.
#[derive(Debug, PartialEq, Eq)]
enum NoSlot {
    /// The client has its share in flight.
    Client,
    /// Clients' repeats hold all they may: only a first request gets through.
    Repeats,
}

impl ClientSlot {
    /// A slot for `client`, with `most` = (slots in all, one client's share).
    fn take(
        shares: &Arc<Mutex<Shares>>,
        client: Option<std::net::IpAddr>,
        most: (usize, usize),
    ) -> Result<ClientSlot, NoSlot> {
        let mut s = shares.lock().unwrap_or_else(|e| e.into_inner());
        let n = s.per.get(&client).copied().unwrap_or(0);
        if n >= most.1 {
            return Err(NoSlot::Client);
        }
        if n >= 1 {
            if s.repeats >= repeats_limit(most.0) {
                return Err(NoSlot::Repeats);
            }
            s.repeats += 1;
        }
        s.per.insert(client, n + 1);
        Ok(ClientSlot { shares: shares.clone(), client })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut s = self.shares.lock().unwrap_or_else(|e| e.into_inner());
        let n = s.per.get(&self.client).copied().unwrap_or(0);
        if n >= 2 {
            s.repeats = s.repeats.saturating_sub(1);
        }
        if n <= 1 {
            s.per.remove(&self.client);
        } else {
            s.per.insert(self.client, n - 1);
        }
    }
}

impl Proxy {
    pub fn new(store: Arc<dyn Store>, source: KeySource) -> Proxy {
        let (writer, leader_epoch) = tokio::sync::watch::channel(None);
        Proxy {
            leader_epoch,
            epoch_writer: Mutex::new(Some(writer)),
            standing_down: tokio_util::sync::CancellationToken::new(),
            store,
            source,
            pinned: tokio::sync::OnceCell::new(),
            record: Mutex::new(None),
            idle: Arc::new(Mutex::new(Vec::new())),
            in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
            most: (MAX_IN_FLIGHT, MAX_IN_FLIGHT_PER_CLIENT),
            per_client: Arc::default(),
        }
    }

    /// Cut every answer still being passed on once `stop` is cancelled (the standby took over
    /// or is shutting down).
    pub fn until(mut self, stop: tokio_util::sync::CancellationToken) -> Proxy {
        self.standing_down = stop;
        self
    }

    /// Passes on at most half of what one address may hold open at the leader, which counts
    /// this standby as one client address (`crate::serve::ConnLimits`; both coordinators are
    /// started alike): relayed requests held open by slow clients filled the leader's share
    /// for the standby's address, and every request through the standby, and every client on
    /// its host, got 503 (outsider attack). One client gets an eighth of that.
    pub fn within(mut self, limits: crate::serve::ConnLimits) -> Proxy {
        let most = limits.per_address.map_or(MAX_IN_FLIGHT, |p| (p / 2).clamp(2, MAX_IN_FLIGHT));
        self.in_flight = Arc::new(tokio::sync::Semaphore::new(most));
        self.most = (most, (most / 8).max(1));
        self
    }

    /// Passes `req` on to the leader and its answer back; 503 when there is no leader this
    /// standby can prove, or it does not answer.
    pub async fn forward(&self, req: Request) -> Response {
        let path = req.uri().path();
        if path == "/readyz" || path == "/api/v1/identity" || is_upgrade(req.headers()) {
            return not_passed_on();
        }
        // Only a path (`OPTIONS *`, an authority form: nothing to pass on).
        let Some(target) = req.uri().path_and_query().filter(|p| p.as_str().starts_with('/')).cloned() else {
            return crate::error::ApiError::new(
                StatusCode::BAD_REQUEST,
                "a standby passes on only requests for a path",
            )
            .into_response();
        };
        // Two `Host` headers: which one the leader would read is not ours to guess (RFC 9112).
        if req.headers().get_all(header::HOST).iter().count() > 1 {
            return crate::error::ApiError::new(StatusCode::BAD_REQUEST, "a request names one Host").into_response();
        }
        let client = req.extensions().get::<axum::extract::ConnectInfo<SocketAddr>>().map(|c| c.0.ip());
        let slot = match ClientSlot::take(&self.per_client, client, self.most) {
            Ok(slot) => slot,
            Err(NoSlot::Client) => {
                return unavailable(&format!(
                    "it is passing on as many requests from this client as it may ({})",
                    self.most.1
                ))
            }
            Err(NoSlot::Repeats) => {
                return unavailable(&format!(
                    "it is passing on as many requests from clients with another in flight as it may ({}); a client's first still gets through",
                    repeats_limit(self.most.0)
                ))
            }
        };
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            return unavailable("it is passing on as many requests as it may");
        };
        let record = match self.leader_record().await {
            Ok(r) => r,
            Err(why) => return unavailable(&why),
        };
        let (parts, body) = req.into_parts();
        let mut headers = without_hop_by_hop(&parts.headers);
        headers.insert(header::VIA, axum::http::HeaderValue::from_static("1.1 gpuci-standby"));
        let mut out = axum::http::Request::new(body);
        *out.method_mut() = parts.method;
        *out.uri_mut() = target.into();
        *out.headers_mut() = headers;
        let mut conn = match self.checkout(&record).await {
            Ok(c) => c,
            Err(why) => return unavailable(&why),
        };
        // The client's `Host` goes on as it came (the leader checks a form's `Origin` against
        // it); a request without one names the leader's.
        if !out.headers().contains_key(header::HOST) {
            if let Ok(v) = axum::http::HeaderValue::from_str(&host_of(&conn.base).unwrap_or_default()) {
                out.headers_mut().insert(header::HOST, v);
            }
        }
        let mut sent = tokio::time::timeout(HEAD_TIMEOUT, conn.sender.try_send_request(out)).await;
        // A kept connection the leader closed before the request went out: once more, on a
        // connection proved now.
        if let Ok(Err(e)) = &mut sent {
            if let Some(again) = e.take_message() {
                conn = match self.prove_one(&record).await {
                    Ok(c) => c,
                    Err(why) => return unavailable(&why),
                };
                sent = tokio::time::timeout(HEAD_TIMEOUT, conn.sender.try_send_request(again)).await;
            }
        }
        let resp = match sent {
            Err(_) => {
                return unavailable(&format!(
                    "the leader at {} sent no answer within {} s",
                    conn.base,
                    HEAD_TIMEOUT.as_secs()
                ))
            }
            Ok(Err(e)) => return unavailable(&format!("the leader at {} did not answer: {}", conn.base, e.error())),
            Ok(Ok(resp)) => resp,
        };
        self.keep_when_free(conn);
        if let Some(writer) = self.epoch_writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            tokio::spawn(watch_epoch(self.store.clone(), writer));
        }
        let (parts, body) = resp.into_parts();
        let data = http_body_util::BodyExt::into_data_stream(body).map(move |chunk| {
            // Counted as in flight (and as its client's) until its body ends.
            let _ = (&permit, &slot);
            chunk
        });
        let mut answer = Response::new(Body::from_stream(until_another_leads(
            data,
            self.leader_epoch.clone(),
            record.epoch,
            self.standing_down.clone(),
        )));
        *answer.status_mut() = parts.status;
        *answer.headers_mut() = without_hop_by_hop(&parts.headers);
        answer
    }

    /// The leader's record, read at most every [`RECORD_FOR`]; refused when it names another
    /// key than the installation's.
    async fn leader_record(&self) -> Result<LeaderRecord, String> {
        if let Some((r, at)) = self.record.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            if at.elapsed() < RECORD_FOR {
                return Ok(r);
            }
        }
        let record = match self.store.coordinator_state(LEADER_STATE).await {
            Ok(Some(json)) => serde_json::from_str::<LeaderRecord>(&json)
                .map_err(|e| format!("the leader's record is damaged: {e}"))?,
            Ok(None) => return Err("no coordinator has said where it leads yet".into()),
            Err(e) => return Err(format!("the database does not answer: {e}")),
        };
        let pinned = self.installation_key().await?;
        if record.key != pinned {
            tracing::error!(
                recorded = %record.key, installation = %pinned, urls = ?record.urls,
                "the leader's record in the database names another identity key than this installation's: \
                 someone wrote it who is not a coordinator of this installation; nothing is passed on to it"
            );
            return Err("the leader's record names another key than this installation's".into());
        }
        *self.record.lock().unwrap_or_else(|e| e.into_inner()) = Some((record.clone(), Instant::now()));
        Ok(record)
    }

    async fn installation_key(&self) -> Result<String, String> {
        self.pinned
            .get_or_try_init(|| async {
                match crate::identity::installation_key(
                    self.store.as_ref(),
                    &self.source.secrets_key_file,
                    &self.source.data_dir,
                )
                .await
                {
                    Ok(Some(k)) => Ok(k),
                    Ok(None) => Err("no coordinator has made the installation's identity key yet".to_string()),
                    Err(e) => Err(format!("this standby cannot tell the installation's identity key: {e:#}")),
                }
            })
            .await
            .cloned()
    }

    /// A kept connection to the leader of `record`, or one proved now.
    async fn checkout(&self, record: &LeaderRecord) -> Result<Proved, String> {
        loop {
            let kept = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some(c) = kept else { break };
            if c.epoch == record.epoch
                && record.urls.contains(&c.base)
                && c.since.elapsed() < IDLE_FOR
                && c.sender.is_ready()
                && !c.sender.is_closed()
            {
                return Ok(c);
            }
        }
        self.prove_one(record).await
    }

    /// A new connection to the first address of `record` that proves the installation's key
    /// on it.
    async fn prove_one(&self, record: &LeaderRecord) -> Result<Proved, String> {
        let mut why = Vec::new();
        for base in &record.urls {
            match prove(base, &record.key).await {
                Ok(sender) => {
                    return Ok(Proved { base: base.clone(), epoch: record.epoch, sender, since: Instant::now() })
                }
                Err(e) => why.push(format!("{base}: {e}")),
            }
        }
        Err(format!("no address of the leader proved the installation's key ({})", why.join("; ")))
    }

    /// Keeps `conn` for another request once its answer has been read.
    fn keep_when_free(&self, mut conn: Proved) {
        let idle = self.idle.clone();
        tokio::spawn(async move {
            if matches!(tokio::time::timeout(IDLE_FOR, conn.sender.ready()).await, Ok(Ok(()))) {
                conn.since = Instant::now();
                let mut idle = idle.lock().unwrap_or_else(|e| e.into_inner());
                if idle.len() < MAX_IDLE {
                    idle.push(conn);
                }
            }
        });
    }
}

/// Reads the leader's epoch from the database every [`RECORD_FOR`] into `writer`, while
/// anyone reads it (the proxy, or an answer it is still passing on after the standby took
/// over). A database that does not answer changes nothing.
async fn watch_epoch(store: Arc<dyn Store>, writer: tokio::sync::watch::Sender<Option<i64>>) {
    while writer.receiver_count() > 0 {
        if let Ok(Some(json)) = store.coordinator_state(LEADER_STATE).await {
            if let Ok(r) = serde_json::from_str::<LeaderRecord>(&json) {
                writer.send_if_modified(|e| e.replace(r.epoch) != Some(r.epoch));
            }
        }
        tokio::time::sleep(RECORD_FOR).await;
    }
}

/// The answer `data` of the leader of `epoch`, until the database names a leader of another
/// epoch: then an error, so that the client's connection is cut, not ended as if the answer
/// were whole. A frozen leader's stream (a followed log, a watched pipeline) stays open and
/// silent, and a client given only this standby's address, whose `/healthz` answers 200, was
/// never told: it waited for ever after another took over (review finding).
fn until_another_leads<S>(
    data: S,
    epoch_now: tokio::sync::watch::Receiver<Option<i64>>,
    epoch: i64,
    standing_down: tokio_util::sync::CancellationToken,
) -> impl futures::Stream<Item = Result<axum::body::Bytes, axum::BoxError>>
where
    S: futures::Stream<Item = Result<axum::body::Bytes, hyper::Error>> + Send + 'static,
{
    let another = async move {
        let mut now = epoch_now;
        loop {
            if now.borrow_and_update().is_some_and(|e| e != epoch) {
                return;
            }
            if now.changed().await.is_err() {
                // Nobody reads the epoch any more: only standing down cuts this answer.
                std::future::pending::<()>().await;
            }
        }
    };
    // This standby leads now (or stops): whoever it passed this on from does not.
    let changed = async move {
        tokio::select! {
            () = another => {}
            () = standing_down.cancelled() => {}
        }
    };
    let state = (Box::pin(data), Box::pin(changed), false);
    futures::stream::unfold(state, |(mut data, mut changed, cut)| async move {
        if cut {
            return None;
        }
        tokio::select! {
            biased;
            item = data.next() => item.map(|i| (i.map_err(axum::BoxError::from), (data, changed, false))),
            () = &mut changed => {
                let why: axum::BoxError = "another coordinator leads now: this answer of the former leader ends here".into();
                Some((Err(why), (data, changed, true)))
            }
        }
    })
}

/// `HOST:PORT` of a base URL.
fn host_of(base: &str) -> Option<String> {
    let u = reqwest::Url::parse(base).ok()?;
    let host = u.host_str()?;
    Some(match u.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_string(),
    })
}

/// A connection to `base` on which `key` was proved: the request that follows goes on this
/// same connection, so a process that took the address after the proof is sent nothing.
async fn prove(base: &str, key: &str) -> Result<SendRequest<Body>, String> {
    let url = reqwest::Url::parse(base).map_err(|e| format!("not a URL: {e}"))?;
    if url.scheme() != "http" {
        return Err(format!("a standby reaches the leader over http only, not {}", url.scheme()));
    }
    let addr = (
        url.host_str().unwrap_or_default().trim_matches(|c| c == '[' || c == ']').to_string(),
        url.port_or_known_default().unwrap_or(80),
    );
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| "no connection within 3 s".to_string())?
        .map_err(|e| format!("no connection: {e}"))?;
    let _ = stream.set_nodelay(true);
    // The proof is asked for the address this connection reached, never a name: a
    // coordinator signs an address literal only when it is the address the request came in
    // on, so a relay (a name in the record that forwards to the real leader, which signs
    // names when it was told none) cannot pass a proof on (outsider finding). Coordinators
    // must reach each other directly: through NAT the leader sees another address, and the
    // standby passes nothing on (503).
    let host = stream.peer_addr().map(|a| a.to_string()).map_err(|e| format!("no peer address: {e}"))?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, Body>(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("no HTTP: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let nonce = identity::nonce(rand::random());
    let asked = axum::http::Request::get(format!("/api/v1/identity?nonce={nonce}"))
        .header(header::HOST, &host)
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let proof = async {
        let resp = sender.send_request(asked).await.map_err(|e| format!("no answer: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("it answered {}", resp.status()));
        }
        let body = http_body_util::BodyExt::collect(http_body_util::Limited::new(resp.into_body(), MAX_PROOF_BYTES))
            .await
            .map_err(|e| format!("its answer is not a proof: {e}"))?
            .to_bytes();
        serde_json::from_slice::<IdentityProof>(&body).map_err(|e| format!("its answer is not a proof: {e}"))
    };
    let proof = tokio::time::timeout(PROOF_TIMEOUT, proof).await.map_err(|_| "no proof within 5 s".to_string())??;
    identity::verify(&proof, &nonce, &host, Some(key)).map_err(|e| e.to_string())?;
    Ok(sender)
}

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
}

/// Headers that belong to one connection, not to the request (RFC 9110, 7.6.1).
fn without_hop_by_hop(headers: &HeaderMap) -> HeaderMap {
    const HOP: [&str; 8] = [
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    let named_in_connection: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    let mut out = HeaderMap::new();
    for (name, value) in headers {
        let n = name.as_str();
        if HOP.contains(&n) || named_in_connection.iter().any(|c| c == n) {
            continue;
        }
        out.append(HeaderName::clone(name), value.clone());
    }
    out
}

fn unavailable(why: &str) -> Response {
    tracing::warn!(reason = %why, "a request to this standby could not be passed on to the leader");
    crate::error::ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("a standby: it could not pass this on to the leader ({why}); try again, or ask the leader"),
    )
    .into_response()
}

fn not_passed_on() -> Response {
    crate::error::ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "a standby: another coordinator leads this database; this one takes over if its claim lapses",
    )
    .into_response()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn a_leader_is_reached_at_its_address_and_its_public_names() {
        let a: SocketAddr = "127.0.0.2:8070".parse().unwrap();
        assert_eq!(
            leader_urls(a, &["ci.example.org".into(), "lb.example.org:443".into()], Some("host-a")),
            ["http://127.0.0.2:8070", "http://ci.example.org:8070", "http://lb.example.org:443"]
        );
        let any: SocketAddr = "0.0.0.0:8070".parse().unwrap();
        assert_eq!(leader_urls(any, &[], Some("host-a\n")), ["http://host-a:8070"]);
        assert!(leader_urls(any, &[], None).is_empty());
        let v6: SocketAddr = "[::1]:9000".parse().unwrap();
        assert_eq!(leader_urls(v6, &["[fd00::1]:9001".into()], None), ["http://[::1]:9000", "http://[fd00::1]:9001"]);
    }

    use gpuci_core::coordinator_identity::SigningIdentity;
    use gpuci_store::SqliteStore;
    use tokio_util::sync::CancellationToken;

    /// What a server behind the proxy saw: each request's path, `Authorization` and `Host`.
    type Seen = Arc<Mutex<Vec<(String, Option<String>, Option<String>)>>>;

    /// A server on `addr` that proves `identity` (if given) and answers every other request
    /// 200, noting it (`/forever`: one line, then nothing, never ending, as a followed log). Stopped (its connections closed) when `stop` is cancelled.
    async fn server(
        addr: SocketAddr,
        identity: Option<SigningIdentity>,
        stop: CancellationToken,
    ) -> (SocketAddr, Seen) {
        let seen: Seen = Arc::default();
        let noted = seen.clone();
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let local = Some(addr);
        let app = axum::Router::new()
            .route(
                "/api/v1/identity",
                axum::routing::get(
                    move |h: HeaderMap, q: axum::extract::Query<std::collections::HashMap<String, String>>| {
                        let identity = identity.clone();
                        async move {
                            let host =
                                h.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
                            // As a coordinator told no public names signs: any name, and its
                            // own address only.
                            match identity {
                                Some(i) if identity::signs_for(&host, local, &[]) => {
                                    axum::Json(i.prove(&q["nonce"], &host).unwrap()).into_response()
                                }
                                Some(_) => StatusCode::MISDIRECTED_REQUEST.into_response(),
                                None => StatusCode::NOT_FOUND.into_response(),
                            }
                        }
                    },
                ),
            )
            .route(
                "/forever",
                axum::routing::get(|| async {
                    let first = futures::stream::once(async {
                        Ok::<_, std::convert::Infallible>(axum::body::Bytes::from("first\n"))
                    });
                    Body::from_stream(first.chain(futures::stream::pending()))
                }),
            )
            .fallback(move |req: Request| {
                let noted = noted.clone();
                async move {
                    let h =
                        |n: header::HeaderName| req.headers().get(n).and_then(|v| v.to_str().ok()).map(String::from);
                    noted.lock().unwrap().push((
                        req.uri().path().to_string(),
                        h(header::AUTHORIZATION),
                        h(header::HOST),
                    ));
                    "served"
                }
            });
        tokio::spawn(async move {
            axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await.unwrap();
        });
        (addr, seen)
    }

    fn data_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpuci-proxy-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A standby of an installation whose key is `installation` (in its data dir), the
    /// database's leader record naming `recorded_key` at `at`.
    async fn standby(name: &str, installation: &SigningIdentity, recorded_key: &str, at: SocketAddr) -> Proxy {
        let dir = data_dir(name);
        std::fs::write(dir.join(crate::identity::SECRET_KEY_FILE), hex::encode(installation.secret())).unwrap();
        let store = Arc::new(SqliteStore::in_memory().await.unwrap());
        let record = LeaderRecord {
            urls: vec![format!("http://{at}")],
            key: recorded_key.to_string(),
            epoch: 1,
            heartbeat_ms: None,
        };
        store.put_coordinator_state(LEADER_STATE, &serde_json::to_string(&record).unwrap(), 0).await.unwrap();
        Proxy::new(store, KeySource { secrets_key_file: dir.join("secrets.key"), data_dir: dir })
    }

    fn get(path: &str, host: &str) -> Request {
        axum::http::Request::get(path)
            .header(header::AUTHORIZATION, "Bearer gpuci_api_victim")
            .header(header::HOST, host)
            .body(Body::empty())
            .unwrap()
    }

    fn key() -> SigningIdentity {
        SigningIdentity::from_secret(&rand::random())
    }

    #[tokio::test]
    async fn a_leader_record_naming_another_key_is_sent_nothing() {
        // Someone who can write the database (not a coordinator: no secrets key, no identity
        // key) records a server of theirs, proving a key of theirs, as the leader.
        let (installation, rogue) = (key(), key());
        let stop = CancellationToken::new();
        let (at, seen) = server("127.0.0.1:0".parse().unwrap(), Some(rogue.clone()), stop.clone()).await;
        let proxy = standby("rogue", &installation, &rogue.public_key(), at).await;
        let answer = proxy.forward(get("/api/v1/jobs", "standby:8072")).await;
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(seen.lock().unwrap().is_empty(), "the rogue server was sent {:?}", seen.lock().unwrap());
        stop.cancel();
    }

    #[tokio::test]
    async fn a_process_that_takes_the_dead_leaders_port_is_sent_nothing() {
        let installation = key();
        let stop = CancellationToken::new();
        let (at, leader_saw) = server("127.0.0.1:0".parse().unwrap(), Some(installation.clone()), stop.clone()).await;
        let proxy = standby("squat", &installation, &installation.public_key(), at).await;
        let answer = proxy.forward(get("/api/v1/jobs", "ci.example.org:8072")).await;
        assert_eq!(answer.status(), StatusCode::OK);
        let _ = http_body_util::BodyExt::collect(answer.into_body()).await;
        // The leader had the client's Host (a form's Origin is checked against it) and token.
        assert_eq!(
            leader_saw.lock().unwrap().clone(),
            [("/api/v1/jobs".to_string(), Some("Bearer gpuci_api_victim".into()), Some("ci.example.org:8072".into()))]
        );
        // The leader dies; another process binds its port at once, proving nothing.
        stop.cancel();
        let squatter = loop {
            match tokio::net::TcpListener::bind(at).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        drop(squatter);
        let (_, squatter_saw) = server(at, None, CancellationToken::new()).await;
        let answer = proxy.forward(get("/api/v1/jobs", "ci.example.org:8072")).await;
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(squatter_saw.lock().unwrap().is_empty(), "the squatter was sent {:?}", squatter_saw.lock().unwrap());
    }

    #[tokio::test]
    async fn a_relay_named_in_the_leaders_record_is_sent_nothing() {
        // Someone with the database keeps the installation's key in the record and names a
        // relay of theirs (a name: the leader, told no public names, signs any name), which
        // passes bytes to and from the real leader.
        let installation = key();
        let stop = CancellationToken::new();
        let (leader, leader_saw) =
            server("127.0.0.1:0".parse().unwrap(), Some(installation.clone()), stop.clone()).await;
        let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay_at = relay.local_addr().unwrap();
        let relayed: Arc<Mutex<Vec<u8>>> = Arc::default();
        let copy = relayed.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = relay.accept().await {
                let copy = copy.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut outbound = tokio::net::TcpStream::connect(leader).await.unwrap();
                    let (mut ir, mut iw) = inbound.split();
                    let (mut or, mut ow) = outbound.split();
                    let up = async {
                        let mut buf = [0u8; 4096];
                        while let Ok(n @ 1..) = ir.read(&mut buf).await {
                            copy.lock().unwrap().extend_from_slice(&buf[..n]);
                            if ow.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    };
                    let _ = tokio::join!(up, tokio::io::copy(&mut or, &mut iw));
                });
            }
        });
        let dir = data_dir("relay");
        std::fs::write(dir.join(crate::identity::SECRET_KEY_FILE), hex::encode(installation.secret())).unwrap();
        let store = Arc::new(SqliteStore::in_memory().await.unwrap());
        let record = LeaderRecord {
            urls: vec![format!("http://localhost:{}", relay_at.port())],
            key: installation.public_key(),
            epoch: 1,
            heartbeat_ms: None,
        };
        store.put_coordinator_state(LEADER_STATE, &serde_json::to_string(&record).unwrap(), 0).await.unwrap();
        let proxy = Proxy::new(store, KeySource { secrets_key_file: dir.join("secrets.key"), data_dir: dir });
        let answer = proxy.forward(get("/api/v1/jobs", "standby:8072")).await;
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        let relayed = String::from_utf8_lossy(&relayed.lock().unwrap()).to_string();
        assert!(!relayed.contains("victim"), "the relay saw a token: {relayed}");
        assert!(leader_saw.lock().unwrap().is_empty());
        stop.cancel();
    }

    #[tokio::test]
    async fn a_request_naming_two_hosts_is_refused() {
        let installation = key();
        let proxy = standby("hosts", &installation, &installation.public_key(), "127.0.0.1:9".parse().unwrap()).await;
        let mut req = get("/api/v1/jobs", "a");
        req.headers_mut().append(header::HOST, "b".parse().unwrap());
        assert_eq!(proxy.forward(req).await.status(), StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn the_key_comes_from_the_databases_sealed_secret_when_the_data_dir_has_none() {
        let installation = key();
        let (secrets, bytes) = gpuci_store::SecretsKey::generate();
        let dir = data_dir("sealed");
        std::fs::write(dir.join("secrets.key"), bytes).unwrap();
        let store = Arc::new(SqliteStore::in_memory().await.unwrap());
        let stored = gpuci_store::StoredIdentity {
            public_key: installation.public_key(),
            sealed_secret: secrets.seal("gpuci:coordinator-identity", &hex::encode(installation.secret())),
        };
        store.coordinator_identity(&stored, 0).await.unwrap();
        let got = crate::identity::installation_key(store.as_ref(), &dir.join("secrets.key"), &dir).await.unwrap();
        assert_eq!(got, Some(installation.public_key()));
        // A standby with another secrets key cannot tell the key: it passes nothing on.
        let dir2 = data_dir("sealed-other");
        std::fs::write(dir2.join("secrets.key"), gpuci_store::SecretsKey::generate().1).unwrap();
        assert!(crate::identity::installation_key(store.as_ref(), &dir2.join("secrets.key"), &dir2).await.is_err());
    }

    #[tokio::test]
    async fn a_request_for_no_path_is_refused() {
        let installation = key();
        let proxy = standby("star", &installation, &installation.public_key(), "127.0.0.1:9".parse().unwrap()).await;
        let req = axum::http::Request::builder().method("OPTIONS").uri("*").body(Body::empty()).unwrap();
        assert_eq!(proxy.forward(req).await.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn connection_headers_are_not_passed_on() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "keep-alive, x-secret-hop".parse().unwrap());
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::AUTHORIZATION, "Bearer t".parse().unwrap());
        let out = without_hop_by_hop(&h);
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(out.contains_key(header::AUTHORIZATION));
    }

    /// Regression (outsider attack, third round): 1,024 connections from one address, each
    /// sending a request whose body never came, held every slot of the standby for the head
    /// timeout, and everyone else was answered 503. One client gets a share.
    #[test]
    fn one_client_holds_at_most_its_share_of_the_requests_in_flight() {
        let shares = Arc::default();
        let most = (MAX_IN_FLIGHT, MAX_IN_FLIGHT_PER_CLIENT);
        let attacker = Some(std::net::IpAddr::from([203, 0, 113, 9]));
        let held: Vec<ClientSlot> =
            std::iter::from_fn(|| ClientSlot::take(&shares, attacker, most).ok()).take(MAX_IN_FLIGHT).collect();
        assert_eq!(held.len(), MAX_IN_FLIGHT_PER_CLIENT);
        let other = ClientSlot::take(&shares, Some(std::net::IpAddr::from([198, 51, 100, 7])), most);
        assert!(other.is_ok(), "another client still gets through");
        drop(held);
        let again = ClientSlot::take(&shares, attacker, most);
        assert!(again.is_ok(), "slots come back");
        drop(other);
        let s = shares.lock().unwrap();
        assert_eq!((s.per.values().sum::<usize>(), s.repeats), (1, 0));
    }

    /// Regression (outsider attack, fifth round): nine addresses, each holding its eighth of
    /// the slots with slow bodies, held them all. Clients' repeats now share three quarters:
    /// any number of addresses holding all they may leave a quarter for first requests.
    #[test]
    fn clients_holding_all_they_may_leave_a_quarter_of_the_slots_for_first_requests() {
        for pool in [2, 18, 48, MAX_IN_FLIGHT] {
            let shares = Arc::default();
            let most = (pool, (pool / 8).max(1));
            let mut held = Vec::new();
            // Attackers, each taking all it may, as long as any gets more.
            for a in 0..64u8 {
                let ip = Some(std::net::IpAddr::from([203, 0, 113, a]));
                held.extend(std::iter::from_fn(|| ClientSlot::take(&shares, ip, most).ok()).take(pool));
            }
            let repeats = shares.lock().unwrap().repeats;
            assert!(repeats <= repeats_limit(pool), "pool {pool}: repeats {repeats}");
            // Each of 64 addresses holds a first; the repeats stop at three quarters.
            assert_eq!(held.len(), (64 + repeats_limit(pool)).min(64 * most.1), "pool {pool}");
            // A newcomer's first request is never refused for others' repeats.
            let newcomer = Some(std::net::IpAddr::from([198, 51, 100, 7]));
            let first = ClientSlot::take(&shares, newcomer, most);
            assert!(first.is_ok(), "pool {pool}");
            if most.1 > 1 {
                assert_eq!(ClientSlot::take(&shares, newcomer, most).err(), Some(NoSlot::Repeats), "pool {pool}");
            }
            drop(first);
            drop(held);
            let s = shares.lock().unwrap();
            assert!(s.per.is_empty() && s.repeats == 0, "pool {pool}: every slot back");
        }
    }

    /// Relayed requests stay within half of what the leader lets the standby's address hold
    /// (outsider attack: slow clients through the standby filled that share at the leader).
    #[tokio::test]
    async fn a_standby_passes_on_at_most_half_the_leaders_share_for_its_address() {
        let dir = std::env::temp_dir();
        let store: Arc<dyn Store> = Arc::new(SqliteStore::in_memory().await.unwrap());
        let limits = crate::serve::ConnLimits::for_open_files(400);
        let p = Proxy::new(store.clone(), KeySource { secrets_key_file: dir.join("k"), data_dir: dir.clone() })
            .within(limits);
        assert_eq!(p.most, (limits.per_address.unwrap() / 2, 2));
        assert_eq!(p.in_flight.available_permits(), limits.per_address.unwrap() / 2);
        let lb = crate::serve::ConnLimits { per_address: None, ..limits };
        let p = Proxy::new(store, KeySource { secrets_key_file: dir.join("k"), data_dir: dir }).within(lb);
        assert_eq!(p.most, (MAX_IN_FLIGHT, MAX_IN_FLIGHT_PER_CLIENT), "no limit per address at the leader");
    }

    /// Regression (review finding): an answer passed on from a leader that then froze (a
    /// followed log) stayed open and silent after another coordinator took over, and a client
    /// given only this standby's address (whose `/healthz` still answers) waited for ever. It
    /// now ends, as an error, once the database names a leader of another epoch.
    #[tokio::test]
    async fn an_answer_from_a_leader_that_no_longer_leads_is_cut() {
        let installation = key();
        let stop = CancellationToken::new();
        let (at, _) = server("127.0.0.1:0".parse().unwrap(), Some(installation.clone()), stop.clone()).await;
        let proxy = standby("cut", &installation, &installation.public_key(), at).await;
        let answer = proxy.forward(get("/forever", "ci.example.org:8072")).await;
        assert_eq!(answer.status(), StatusCode::OK);
        let mut body = http_body_util::BodyExt::into_data_stream(answer.into_body());
        let first = body.next().await.unwrap().unwrap();
        assert_eq!(&first[..], b"first\n");
        // The same leader still leads: nothing more, and no end.
        assert!(tokio::time::timeout(RECORD_FOR * 3, body.next()).await.is_err(), "ended while its leader led");
        // Another takes over (the frozen leader's process is still there, its stream open).
        let next = LeaderRecord {
            urls: vec!["http://127.0.0.1:9".into()],
            key: installation.public_key(),
            epoch: 2,
            heartbeat_ms: None,
        };
        proxy.store.put_coordinator_state(LEADER_STATE, &serde_json::to_string(&next).unwrap(), 0).await.unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(30), body.next()).await.expect("still open");
        assert!(matches!(ended, Some(Err(_))), "cut as an error, not ended as whole: {ended:?}");
        stop.cancel();
    }

    /// Regression (outsider attack): with one leader and one standby, the standby that passes
    /// a followed log on is the one that takes over; its database connections are closed then,
    /// so it could not read the new epoch, and the frozen leader's stream stayed open 50–68 s.
    /// What it passes on is cut when it stops standing by.
    #[tokio::test]
    async fn what_a_standby_passes_on_is_cut_when_it_takes_over() {
        let installation = key();
        let stop = CancellationToken::new();
        let (at, _) = server("127.0.0.1:0".parse().unwrap(), Some(installation.clone()), stop.clone()).await;
        let taking_over = CancellationToken::new();
        let proxy = standby("takeover", &installation, &installation.public_key(), at).await.until(taking_over.clone());
        let answer = proxy.forward(get("/forever", "ci.example.org:8072")).await;
        let mut body = http_body_util::BodyExt::into_data_stream(answer.into_body());
        assert_eq!(&body.next().await.unwrap().unwrap()[..], b"first\n");
        taking_over.cancel();
        let ended = tokio::time::timeout(Duration::from_secs(10), body.next()).await.expect("still open");
        assert!(matches!(ended, Some(Err(_))), "cut as an error: {ended:?}");
        stop.cancel();
    }
}
