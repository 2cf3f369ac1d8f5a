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
    pinned: tokio::sync::OnceCell<gpuci_core::coordinator_identity::SigningIdentity>,
    /// The names it proves the key for besides its own address (`--public-name`).
    public_names: Vec<String>,
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
            public_names: Vec::new(),
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
        if let Some(writer) = self.epoch_writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            tokio::spawn(watch_epoch(self.store.clone(), writer));
        }
        // The answer's head is waited for until another leads, too: a request to a leader
        // that froze is answered 503 when the next one leads (or this standby takes over), not
        // after the whole head timeout (outsider attack: 60 s, as long as the CLI resends).
        let superseded = || {
            let (now, down) = (self.leader_epoch.clone(), self.standing_down.clone());
            async move {
                another_leads(now, record.epoch, down).await;
                Err::<(), _>("another coordinator leads now; send it again")
            }
        };
        let mut sent = tokio::select! {
            s = tokio::time::timeout(HEAD_TIMEOUT, conn.sender.try_send_request(out)) => s,
            Err(why) = superseded() => return unavailable(why),
        };
        // A kept connection the leader closed before the request went out: once more, on a
        // connection proved now.
        if let Ok(Err(e)) = &mut sent {
            if let Some(again) = e.take_message() {
                conn = match self.prove_one(&record).await {
                    Ok(c) => c,
                    Err(why) => return unavailable(&why),
                };
                sent = tokio::select! {
                    s = tokio::time::timeout(HEAD_TIMEOUT, conn.sender.try_send_request(again)) => s,
                    Err(why) = superseded() => return unavailable(why),
                };
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
        self.installation_identity().await.map(|i| i.public_key())
    }

    async fn installation_identity(&self) -> Result<&gpuci_core::coordinator_identity::SigningIdentity, String> {
        self.pinned
            .get_or_try_init(|| async {
                match crate::identity::installation_identity(
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
    }

    /// The names this standby proves the installation's key for besides the address a request
    /// comes in on (the coordinator's `--public-name`).
    pub fn named(mut self, public_names: Vec<String>) -> Proxy {
        self.public_names = public_names;
        self
    }

    /// `GET /api/v1/identity` at a standby: the installation's key proved for the host a
    /// request named, when that host is this standby's, as the leader proves it
    /// (`crate::api::identity`). A client given only this address (the CLI, an agent's
    /// transfers) asks it before it sends a credential to be passed on; a standby answered
    /// 503 and the CLI could not use its address at all (outsider attack).
    pub async fn prove(
        &self,
        headers: &HeaderMap,
        uri: &axum::http::Uri,
        nonce: &str,
        local: Option<SocketAddr>,
    ) -> Response {
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| uri.authority().map(|a| a.as_str()))
            .filter(|h| !h.is_empty() && h.len() <= 255)
            .map(str::to_string);
        let Some(host) = host else {
            return crate::error::ApiError::new(StatusCode::BAD_REQUEST, "the request names no Host").into_response();
        };
        if !identity::signs_for(&host, local, &self.public_names) {
            return crate::error::ApiError::new(
                StatusCode::MISDIRECTED_REQUEST,
                format!("{host:?} is not this coordinator's: it proves its key only for the address a request comes in on and the names given with --public-name"),
            )
            .into_response();
        }
        match self.installation_identity().await {
            Ok(i) => match i.prove(nonce, &host) {
                Ok(p) => axum::Json(p).into_response(),
                Err(e) => crate::error::ApiError::new(StatusCode::BAD_REQUEST, e.to_string()).into_response(),
            },
            Err(why) => unavailable(&why),
        }
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

/// Ends once the database names a leader of another epoch than `epoch`, or this standby stops
/// standing by (`standing_down`: it leads now, or it stops): whoever it passes requests on to
/// under `epoch` no longer leads.
async fn another_leads(
    mut epoch_now: tokio::sync::watch::Receiver<Option<i64>>,
    epoch: i64,
    standing_down: tokio_util::sync::CancellationToken,
) {
    let another = async move {
        loop {
            if epoch_now.borrow_and_update().is_some_and(|e| e != epoch) {
                return;
            }
            if epoch_now.changed().await.is_err() {
                // Nobody reads the epoch any more: only standing down tells.
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = another => {}
        () = standing_down.cancelled() => {}
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
    let changed = another_leads(epoch_now, epoch, standing_down);
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
mod tests;
