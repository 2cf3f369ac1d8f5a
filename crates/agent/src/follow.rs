//! Following the leader among several coordinators: the I/O around
//! [`gpuci_core::coordinators`] (which decides). An agent (and the CLI, which uses this module
//! too) is given one or more coordinator URLs (`--server A,B`); each URL's host may resolve
//! to several addresses. Each time it needs a coordinator it resolves every name, asks every
//! address's `/readyz` at once, and talks to the one that leads.
//!
//! A single URL that is an address literal or resolves to one address is used as it is,
//! without asking (a load balancer, or the one coordinator): exactly what the agent did
//! before it took several.
//!
//! A request to one address of a name still carries the name (`Host`, and a TLS server name
//! where there is TLS): reqwest is told the address for that name per client, and the agent
//! channel's TCP connection is made to the address and the WebSocket handshake sent over it.
//!
//! **Nothing is sent a credential before it proves the installation's key**
//! ([`gpuci_core::coordinator_identity`]): every endpoint about to be used, the single one
//! too, is asked `GET /api/v1/identity` with a fresh nonce. With a key pinned (given with
//! `--coordinator-key`, or learnt at the first use and kept by the caller), an endpoint that
//! cannot prove it is never used, and the refusal is logged as an error; with none pinned
//! yet, the key the first endpoint used proves becomes the pin (trust on first use, as
//! `ssh` does), and an endpoint too old to answer is used as before.

use gpuci_core::coordinator_identity::{self as identity, IdentityProof};
use gpuci_core::coordinators::{self, Endpoint, Seen};
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// How long one `/readyz` may take before its endpoint counts as unreachable. A leader
/// answers at once; a frozen or cut-off one never does.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest answer to an identity challenge that is read.
const MAX_PROOF_BYTES: usize = 4096;
/// How long a name may take to resolve.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The coordinator URLs given, and which one is used now.
#[derive(Clone, Debug)]
pub struct Coordinators {
    urls: Vec<String>,
    /// The endpoint used last (its URL and address): first among leaders next time.
    last: Option<Endpoint>,
    current: Current,
    /// The installation's key every endpoint must prove (`None`: none pinned yet).
    pin: Option<String>,
    /// One left because it went quiet while another led: not asked on the next look.
    quiet: Option<Endpoint>,
}

/// The coordinator used now, shared with whoever makes requests beside the agent channel
/// (workspace and artifact transfers, the job's `gpuci pipeline upload`): they follow the
/// agent to a new leader, to the address it proved the key on, and ask for the proof again
/// before each request ([`Current::proven`]). Shows as its URL.
#[derive(Clone, Debug)]
pub struct Current(Arc<RwLock<CurrentState>>);

#[derive(Debug)]
struct CurrentState {
    base: String,
    /// The endpoint the agent channel uses (`None`: not connected yet).
    target: Option<Target>,
    /// The key it must prove.
    pin: Option<String>,
}

impl Current {
    pub fn new(url: &str) -> Current {
        let base = url.trim_end_matches('/').to_string();
        Current(Arc::new(RwLock::new(CurrentState { base, target: None, pin: None })))
    }
    pub fn get(&self) -> String {
        self.0.read().unwrap_or_else(|e| e.into_inner()).base.clone()
    }
    fn set(&self, target: &Target, pin: Option<String>) {
        let mut s = self.0.write().unwrap_or_else(|e| e.into_inner());
        *s = CurrentState { base: target.base.clone(), target: Some(target.clone()), pin };
    }

    /// A client for the coordinator used now (built by `build`), reaching the address it
    /// proved its key on, and its base URL; with a key pinned, the address proves it again
    /// first (it may have changed hands since the agent connected: outsider finding, a killed
    /// coordinator's address taken over while transfers went on). `Err`: why not (worth
    /// trying again: a reconnect may find a coordinator that proves it).
    pub async fn proven(
        &self,
        build: impl Fn(reqwest::ClientBuilder) -> reqwest::ClientBuilder,
    ) -> Result<(reqwest::Client, String), String> {
        let (base, target, pin) = {
            let s = self.0.read().unwrap_or_else(|e| e.into_inner());
            (s.base.clone(), s.target.clone(), s.pin.clone())
        };
        let Some(target) = target else {
            return build(reqwest::Client::builder()).build().map(|c| (c, base)).map_err(|e| e.to_string());
        };
        // One client for the proof and the request after it: the request goes over the
        // connection the proof came back on (kept alive), not a new one that someone could
        // have taken the address for in between.
        let client = target.client(build(reqwest::Client::builder())).map_err(|e| e.to_string())?;
        if let Some(pin) = pin.as_deref() {
            prove_with(&client, &target, Some(pin))
                .await
                .map_err(|why| format!("{} did not prove the coordinators' identity key: {why}", target.base))?;
        }
        Ok((client, target.base))
    }
}

impl std::fmt::Display for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.get())
    }
}

/// One endpoint to try: a base URL, and the address to reach it at (`None`: resolve the URL's
/// host as usual).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub base: String,
    pub addr: Option<SocketAddr>,
    endpoint: Endpoint,
    /// The key it proved (`None`: not asked yet, or a coordinator too old to answer while
    /// no key was pinned).
    pub key: Option<String>,
}

impl Target {
    /// A target at `addr` for `base`, as [`Coordinators::candidates`] makes one (tests).
    #[cfg(test)]
    pub(crate) fn at(base: &str, addr: SocketAddr) -> Target {
        Target { base: base.to_string(), addr: Some(addr), endpoint: Endpoint { url: 0, addr: Some(addr) }, key: None }
    }

    /// A reqwest client that sends requests for this target's base URL to its address.
    pub fn client(&self, builder: reqwest::ClientBuilder) -> reqwest::Result<reqwest::Client> {
        // Idle connections are dropped before the coordinator closes them as idle.
        let builder = builder.pool_idle_timeout(gpuci_protocol::CLIENT_POOL_IDLE);
        match (self.addr, host_name(&self.base)) {
            (Some(addr), Some(host)) => builder.resolve(&host, addr).build(),
            _ => builder.build(),
        }
    }
}

/// None of several coordinators leads now (a takeover under way, or all down): what each
/// answered.
#[derive(Debug, thiserror::Error)]
#[error("no coordinator leads now ({said})")]
pub struct NoLeader {
    pub said: String,
}

/// Why a list of coordinator URLs is refused.
#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("no coordinator URL given")]
    Empty,
    #[error("coordinator URL {url:?}: {why}")]
    Bad { url: String, why: String },
}

/// The URLs of a list as given: comma-separated, each repeated flag one or more; trailing
/// slashes dropped, duplicates dropped.
pub fn parse_urls<S: AsRef<str>>(given: &[S]) -> Result<Vec<String>, UrlError> {
    let mut out: Vec<String> = Vec::new();
    for part in given.iter().flat_map(|g| g.as_ref().split(',')) {
        let u = part.trim().trim_end_matches('/');
        if u.is_empty() {
            continue;
        }
        let parsed = reqwest::Url::parse(u).map_err(|e| UrlError::Bad { url: u.to_string(), why: e.to_string() })?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(UrlError::Bad { url: u.to_string(), why: "expected http://HOST[:PORT] or https://…".into() });
        }
        // A user and password would go, as Basic auth, to every address asked, before any
        // proves the coordinators' key (outsider finding). Not echoed: it may hold a password.
        if !parsed.username().is_empty() || parsed.password().is_some() {
            let shown = format!("{}://…@{}", parsed.scheme(), parsed.host_str().unwrap_or_default());
            return Err(UrlError::Bad {
                url: shown,
                why: "a user or password in the URL is not taken: the coordinator is not reached with them".into(),
            });
        }
        if !out.iter().any(|o| o == u) {
            out.push(u.to_string());
        }
    }
    if out.is_empty() {
        return Err(UrlError::Empty);
    }
    Ok(out)
}

impl Coordinators {
    pub fn new(urls: Vec<String>) -> Coordinators {
        let current = Current::new(urls.first().map(String::as_str).unwrap_or_default());
        Coordinators { urls, last: None, current, pin: None, quiet: None }
    }

    /// Only endpoints that prove `key` are used from now on (`None`: learn it at first use).
    pub fn with_pin(mut self, key: Option<String>) -> Coordinators {
        self.pin = key;
        self
    }

    /// The key endpoints must prove now, if one is pinned.
    pub fn pinned(&self) -> Option<&str> {
        self.pin.as_deref()
    }

    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// The handle that always shows the coordinator used now.
    pub fn current(&self) -> Current {
        self.current.clone()
    }

    /// The endpoints to try now, the leader first (see [`gpuci_core::coordinators`]), each
    /// having proved the pinned key; empty when none leads (or none that leads proves it).
    /// The second value says what each endpoint answered, for the log.
    pub async fn candidates(&self) -> (Vec<Target>, String) {
        self.candidates_except(None).await
    }

    /// [`Coordinators::candidates`], without asking the one just left for being quiet
    /// ([`Coordinators::left_quiet`]) when another still leads: a frozen coordinator answers
    /// nothing, and its probe's timeout held the move 2 s.
    pub async fn candidates_next(&mut self) -> (Vec<Target>, String) {
        if let Some(quiet) = self.quiet.take() {
            let found = self.candidates_except(Some(&quiet)).await;
            if !found.0.is_empty() {
                return found;
            }
        }
        self.candidates().await
    }

    /// `target` is being left: it went quiet and another leads.
    pub fn left_quiet(&mut self, target: &Target) {
        self.quiet = Some(target.endpoint.clone());
    }

    /// [`Coordinators::candidates`] without asking `skip` (the one gone quiet).
    async fn candidates_except(&self, skip: Option<&Endpoint>) -> (Vec<Target>, String) {
        let (targets, said) = self.leaders(skip).await;
        let proved = futures::future::join_all(targets.iter().map(|t| prove(t, self.pin.as_deref()))).await;
        let mut kept = Vec::new();
        let mut refused = Vec::new();
        for (mut t, p) in targets.into_iter().zip(proved) {
            match p {
                Ok(key) => {
                    t.key = key;
                    kept.push(t);
                }
                Err(why) => {
                    tracing::error!(coordinator = %t.base, address = ?t.addr, %why,
                        "not talking to this address: it did not prove the coordinators' identity key; no credential was sent");
                    refused.push(format!("{}: identity not proved: {why}", t.base));
                }
            }
        }
        // Without a pin, only endpoints that agree with the first one's key (two installations
        // listed together are a mistake: the first is used, the other said).
        if self.pin.is_none() {
            if let Some(first) = kept.first().and_then(|t| t.key.clone()) {
                kept.retain(|t| {
                    let same = t.key.as_deref().is_none_or(|k| k == first);
                    if !same {
                        refused.push(format!("{}: holds another installation's key", t.base));
                    }
                    same
                });
            }
        }
        let said = match (said.is_empty(), refused.is_empty()) {
            (_, true) => said,
            (true, false) => refused.join(", "),
            (false, false) => format!("{said}; {}", refused.join(", ")),
        };
        (kept, said)
    }

    /// The endpoints whose `/readyz` says they lead, the one used last first; `skip` is not
    /// asked (nor counted).
    async fn leaders(&self, skip: Option<&Endpoint>) -> (Vec<Target>, String) {
        let resolved = futures::future::join_all(self.urls.iter().map(|u| resolve(u))).await;
        let mut endpoints = coordinators::endpoints(&resolved);
        if let Some(skip) = skip {
            endpoints.retain(|e| e != skip);
            if endpoints.is_empty() {
                return (Vec::new(), String::new());
            }
        }
        let target =
            |e: &Endpoint| Target { base: self.urls[e.url].clone(), addr: e.addr, endpoint: e.clone(), key: None };
        // With one left after `skip`, it is still asked: it must say it leads.
        if skip.is_none() && !coordinators::needs_probe(endpoints.len()) {
            // One: used without asking /readyz, as before several were possible; at the
            // address its name resolved to now, so that the identity proof and every request
            // after it reach the same address (a name that resolves elsewhere a moment later
            // is not followed until the agent asks again).
            let e = endpoints.first().cloned().unwrap_or(Endpoint { url: 0, addr: None });
            return (vec![target(&e)], String::new());
        }
        let targets: Vec<Target> = endpoints.iter().map(target).collect();
        let seen = futures::future::join_all(targets.iter().map(probe)).await;
        let last = self.last.as_ref().and_then(|l| endpoints.iter().position(|e| e == l));
        let picked = coordinators::pick(&seen, last);
        let said = targets
            .iter()
            .zip(&seen)
            .map(|(t, s)| match t.addr {
                Some(a) => format!("{} ({a}): {s:?}", t.base),
                None => format!("{}: {s:?}", t.base),
            })
            .collect::<Vec<_>>()
            .join(", ");
        (picked.into_iter().map(|i| targets[i].clone()).collect(), said)
    }

    /// Whether there can be another coordinator to go to: several URLs, or a name that may
    /// resolve to several addresses (one address literal is the one coordinator, or a load
    /// balancer that picks for the agent).
    pub fn may_move(&self) -> bool {
        self.urls.len() > 1 || self.urls.iter().any(|u| host_name(u).is_some())
    }

    /// Whether another coordinator than `current` leads now and proves the key (its URL):
    /// asked while `current` has gone quiet, so that an agent leaves a frozen leader for the
    /// one that took over as soon as there is one. `None` with a single endpoint (nothing
    /// to ask), or while `current` still says it leads.
    pub async fn another_leads(&self, current: &Target) -> Option<String> {
        // The quiet one is not asked: a frozen coordinator answers nothing, and waiting out
        // its probe's timeout held every agent 2 s longer. Another can say it leads only once
        // the quiet one's claim lapsed and it took it.
        let (targets, _) = self.candidates_except(Some(&current.endpoint)).await;
        targets.first().map(|t| t.base.clone())
    }

    /// `target` is the one talked to now. With no key pinned yet, the one it proved is pinned
    /// from now on; returned when that happened, for the caller to keep.
    pub fn used(&mut self, target: &Target) -> Option<String> {
        self.last = Some(target.endpoint.clone());
        let learnt = match (&self.pin, &target.key) {
            (None, Some(k)) => {
                self.pin = Some(k.clone());
                Some(k.clone())
            }
            _ => None,
        };
        self.current.set(target, self.pin.clone());
        learnt
    }
}

/// The addresses `url`'s host resolves to (one for an address literal; none when it does not
/// resolve: the URL is then tried by name and its error reported).
async fn resolve(url: &str) -> Vec<SocketAddr> {
    let Ok(u) = reqwest::Url::parse(url) else { return Vec::new() };
    let (Some(host), Some(port)) = (u.host_str(), u.port_or_known_default()) else { return Vec::new() };
    if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
        return vec![SocketAddr::new(ip, port)];
    }
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(format!("{host}:{port}"))).await {
        Ok(Ok(addrs)) => addrs.collect(),
        Ok(Err(e)) => {
            tracing::debug!(host, error = %e, "cannot resolve a coordinator's name");
            Vec::new()
        }
        Err(_) => Vec::new(),
    }
}

/// The host of `url` when it is a name (not an address literal).
fn host_name(url: &str) -> Option<String> {
    let u = reqwest::Url::parse(url).ok()?;
    let host = u.host_str()?;
    let literal = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>().is_ok();
    (!literal).then(|| host.to_string())
}

/// What `target`'s `/readyz` says.
async fn probe(target: &Target) -> Seen {
    let Ok(http) = target.client(reqwest::Client::builder().timeout(PROBE_TIMEOUT)) else { return Seen::Unreachable };
    match http.get(format!("{}/readyz", target.base)).send().await {
        Ok(r) if r.status().is_success() => Seen::Leads,
        Ok(_) => Seen::NotLeading,
        Err(_) => Seen::Unreachable,
    }
}

/// The host a request to `base` names (`Host`): the URL's host, and its port unless it is
/// the scheme's default.
fn asked_host(base: &str) -> Option<String> {
    let u = reqwest::Url::parse(base).ok()?;
    let host = u.host_str()?;
    Some(match u.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_string(),
    })
}

/// A TCP connection to `target` (plain HTTP) on which it has just proved `pinned`: an HTTP/1.1
/// identity exchange, then the connection handed back whole for what the caller sends next
/// (the agent channel's WebSocket handshake), so that no credential goes on a connection that
/// proved nothing. `Err`: why not (nothing was sent but the challenge).
pub async fn proved_stream(target: &Target, pinned: &str) -> Result<tokio::net::TcpStream, String> {
    let host = asked_host(&target.base).ok_or("not a URL with a host")?;
    let addr = match target.addr {
        Some(a) => a,
        None => {
            let u = reqwest::Url::parse(&target.base).map_err(|e| e.to_string())?;
            let name = u.host_str().ok_or("not a URL with a host")?.trim_matches(|c| c == '[' || c == ']').to_string();
            let port = u.port_or_known_default().unwrap_or(80);
            let found = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((name.as_str(), port)))
                .await
                .map_err(|_| format!("{name} did not resolve in time"))?
                .map_err(|e| format!("{name}: {e}"))?
                .next();
            found.ok_or_else(|| format!("{name} resolves to no address"))?
        }
    };
    let tcp = tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| format!("no connection to {addr} in time"))?
        .map_err(|e| format!("no connection to {addr}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, http_body_util::Empty<hyper::body::Bytes>>(
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .map_err(|e| format!("no HTTP: {e}"))?;
    // The connection is driven until the exchange is done, then handed back unclosed.
    let driven = tokio::spawn(connection.without_shutdown());
    let nonce = identity::nonce(rand::random());
    let exchange = async {
        let asked = hyper::Request::get(format!("/api/v1/identity?nonce={nonce}"))
            .header(hyper::header::HOST, &host)
            .body(http_body_util::Empty::new())
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(asked).await.map_err(|e| format!("no answer: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("it answered {}", resp.status()));
        }
        let body = http_body_util::BodyExt::collect(http_body_util::Limited::new(resp.into_body(), MAX_PROOF_BYTES))
            .await
            .map_err(|e| format!("its answer is not a proof: {e}"))?
            .to_bytes();
        let proof: IdentityProof =
            serde_json::from_slice(&body).map_err(|e| format!("its answer is not a proof: {e}"))?;
        identity::verify(&proof, &nonce, &host, Some(pinned)).map_err(|e| e.to_string())
    };
    let proved = tokio::time::timeout(PROBE_TIMEOUT, exchange).await.map_err(|_| "no proof in time".to_string());
    drop(sender);
    if let Err(why) = proved.and_then(|p| p) {
        driven.abort();
        return Err(why);
    }
    let parts = driven.await.map_err(|e| e.to_string())?.map_err(|e| format!("the connection failed: {e}"))?;
    if !parts.read_buf.is_empty() {
        return Err("it sent more than its proof".into());
    }
    Ok(parts.io.into_inner())
}

/// `POST path` with `bearer` and the JSON `body`, over a connection on which `target` has just
/// proved `pinned` ([`proved_stream`]); its status and body (at most 1 MiB). `Err`: no answer,
/// or no proof (then nothing but the challenge was sent).
pub async fn post_proved(
    target: &Target,
    pinned: &str,
    path: &str,
    bearer: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String> {
    let tcp = proved_stream(target, pinned).await?;
    let host = asked_host(&target.base).ok_or("not a URL with a host")?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, http_body_util::Full<hyper::body::Bytes>>(
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .map_err(|e| format!("no HTTP: {e}"))?;
    tokio::spawn(connection);
    let req = hyper::Request::post(path)
        .header(hyper::header::HOST, &host)
        .header(hyper::header::AUTHORIZATION, format!("Bearer {bearer}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let answered = async {
        let resp = sender.send_request(req).await.map_err(|e| format!("no answer: {e}"))?;
        let status = resp.status().as_u16();
        let body = http_body_util::BodyExt::collect(http_body_util::Limited::new(resp.into_body(), 1 << 20))
            .await
            .map_err(|e| format!("its answer broke off: {e}"))?
            .to_bytes();
        Ok::<_, String>((status, body.to_vec()))
    };
    tokio::time::timeout(Duration::from_secs(30), answered).await.map_err(|_| "no answer within 30 s".to_string())?
}

/// Asks `target` to prove the installation's key with a fresh nonce: `Ok(Some(key))` proved;
/// `Ok(None)`: no key pinned, and the coordinator predates the proof (404), does not know
/// itself by the address used (421) or did not answer: used as before; `Err`: why it is not
/// to be sent anything.
async fn prove(target: &Target, pinned: Option<&str>) -> Result<Option<String>, String> {
    let http = target.client(reqwest::Client::builder()).map_err(|e| e.to_string())?;
    prove_with(&http, target, pinned).await
}

/// [`prove`] with a client of the caller's (bound to the target's address): the caller's
/// next request reuses the connection the proof came back on.
pub async fn prove_with(
    http: &reqwest::Client,
    target: &Target,
    pinned: Option<&str>,
) -> Result<Option<String>, String> {
    let host = asked_host(&target.base).ok_or("not a URL with a host")?;
    let nonce = identity::nonce(rand::random());
    let asked = http.get(format!("{}/api/v1/identity", target.base)).query(&[("nonce", &nonce)]).timeout(PROBE_TIMEOUT);
    let resp = match asked.send().await {
        Ok(r) => r,
        // Nothing pinned: used as before, and its own error (the same, most likely) told.
        Err(_) if pinned.is_none() => return Ok(None),
        Err(e) => return Err(format!("no answer: {e}")),
    };
    if resp.status() == reqwest::StatusCode::NOT_FOUND && pinned.is_none() {
        tracing::warn!(coordinator = %target.base, "this coordinator cannot prove an identity key (older than the agent?): used unpinned; upgrade it");
        return Ok(None);
    }
    if resp.status() == reqwest::StatusCode::MISDIRECTED_REQUEST && pinned.is_none() {
        // It does not know itself by the address dialled (NAT, a port mapping, a load
        // balancer): nothing pinned, so used as before, and said.
        tracing::warn!(coordinator = %target.base, "this coordinator does not prove its identity key for the address used (add it with `gpuci server --public-name`): used unpinned");
        return Ok(None);
    }
    if !resp.status().is_success() {
        return Err(format!("it answered {}", resp.status()));
    }
    // A proof is a few hundred bytes: a larger answer is not one (and is not read whole).
    let mut resp = resp;
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        body.extend_from_slice(&chunk);
        if body.len() > MAX_PROOF_BYTES {
            return Err("its answer is not a proof (too long)".into());
        }
    }
    let proof: IdentityProof = serde_json::from_slice(&body).map_err(|e| format!("its answer is not a proof: {e}"))?;
    identity::verify(&proof, &nonce, &host, pinned).map(Some).map_err(|e| e.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    #[test]
    fn urls_are_taken_comma_separated_and_repeated_once_each() {
        let got = parse_urls(&["http://127.0.0.1:1/, http://127.0.0.2:2", "http://127.0.0.1:1"]).unwrap();
        assert_eq!(got, vec!["http://127.0.0.1:1", "http://127.0.0.2:2"]);
        assert!(matches!(parse_urls(&[" , "]), Err(UrlError::Empty)));
        let e = parse_urls(&["http://127.0.0.1:1,127.0.0.2:2"]).unwrap_err().to_string();
        assert!(e.contains("127.0.0.2:2"), "{e}");
        let e = parse_urls(&["ftp://h"]).unwrap_err().to_string();
        assert!(e.contains("ftp://h") && e.contains("http://"), "{e}");
        let e = parse_urls(&["http://admin:s3cret@127.0.0.2:8080"]).unwrap_err().to_string();
        assert!(e.contains("user or password") && !e.contains("s3cret"), "{e}");
    }

    /// Two coordinators on loopback addresses: one answers /readyz 503 (a standby), the other
    /// 200 (named `localhost`); a third URL has nobody listening. The leader is the one
    /// picked, wherever it is.
    #[tokio::test]
    async fn the_coordinator_whose_readyz_says_it_leads_is_picked() {
        let standby = serve_readyz(503).await;
        // By name: asked at the address the name resolved to, the request still naming it.
        let leader = serve_readyz(200).await.replace("127.0.0.1", "localhost");
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let mut c = Coordinators::new(vec![dead.clone(), standby.clone(), leader.clone()]);
        let (picked, said) = c.candidates().await;
        assert_eq!(picked.iter().map(|t| t.base.clone()).collect::<Vec<_>>(), vec![leader.clone()], "{said}");
        c.used(&picked[0]);
        assert_eq!(c.current().to_string(), leader);
        // Nobody leads: nothing to try.
        let c = Coordinators::new(vec![dead, standby]);
        assert!(c.candidates().await.0.is_empty());
    }

    /// One URL: used as it is, without asking (a load balancer, one coordinator).
    #[tokio::test]
    async fn a_single_url_is_used_without_asking() {
        let c = Coordinators::new(vec!["http://127.0.0.1:9".into()]);
        let (picked, _) = c.candidates().await;
        assert_eq!(picked.len(), 1);
        assert_eq!(picked[0].base, "http://127.0.0.1:9");
        assert_eq!(picked[0].addr, Some("127.0.0.1:9".parse().unwrap()));
    }

    /// With a key pinned, an address that cannot prove it is not used, whatever it answers:
    /// nothing (a coordinator down), 404 (too old, or pretending), or another key.
    #[tokio::test]
    async fn with_a_key_pinned_only_an_address_that_proves_it_is_used() {
        let key = identity::SigningIdentity::from_secret(&[1; 32]).public_key();
        let legacy = serve_readyz(200).await;
        for url in [legacy.clone(), "http://127.0.0.1:9".to_string()] {
            let c = Coordinators::new(vec![url.clone()]).with_pin(Some(key.clone()));
            let (picked, said) = c.candidates().await;
            assert!(picked.is_empty(), "{url}: {said}");
            assert!(said.contains("identity not proved"), "{said}");
            // Unpinned: used as before.
            let c = Coordinators::new(vec![url.clone()]);
            assert_eq!(c.candidates().await.0.len(), 1, "{url}");
        }
    }

    /// Outsider finding: transfers went to the address the agent had connected to, asked
    /// nothing, after that address changed hands (the coordinator killed, another process on
    /// its port). Each transfer now asks that address to prove the pinned key first.
    #[tokio::test]
    async fn transfers_ask_the_address_to_prove_the_key_again() {
        let ours = identity::SigningIdentity::from_secret(&[1; 32]);
        let theirs = identity::SigningIdentity::from_secret(&[2; 32]);
        let swapped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let url = serve_proofs(vec![ours.clone(), theirs], swapped.clone()).await;
        let mut c = Coordinators::new(vec![url.clone()]).with_pin(Some(ours.public_key()));
        let (picked, said) = c.candidates().await;
        assert_eq!(picked.len(), 1, "{said}");
        c.used(&picked[0]);
        let current = c.current();
        let (_, base) = current.proven(|b| b).await.unwrap();
        assert_eq!(base, url);
        // The address now answers with another key: no client for it.
        swapped.store(true, std::sync::atomic::Ordering::SeqCst);
        let e = current.proven(|b| b).await.unwrap_err();
        assert!(e.contains("not the pinned"), "{e}");
    }

    /// A coordinator that proves `keys[0]` (or `keys[1]` once `swapped`) for the host asked.
    async fn serve_proofs(keys: Vec<identity::SigningIdentity>, swapped: Arc<std::sync::atomic::AtomicBool>) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut s, _)) = l.accept().await {
                let (keys, swapped) = (keys.clone(), swapped.clone());
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    let req = String::from_utf8_lossy(&buf[..n]).to_string();
                    let line = req.lines().next().unwrap_or_default();
                    let host = req
                        .lines()
                        .find_map(|l| l.strip_prefix("host: ").or_else(|| l.strip_prefix("Host: ")))
                        .unwrap_or_default()
                        .trim();
                    let nonce = line.split("nonce=").nth(1).and_then(|r| r.split([' ', '&']).next()).unwrap_or("");
                    let k = &keys[usize::from(swapped.load(std::sync::atomic::Ordering::SeqCst))];
                    let body = k.prove(nonce, host).map(|p| serde_json::to_string(&p).unwrap()).unwrap_or_default();
                    let resp =
                        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
                    let _ = s.write_all(resp.as_bytes()).await;
                });
            }
        });
        url
    }

    async fn serve_readyz(status: u16) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    // A coordinator older than the identity proof: 404 there.
                    let status = if buf[..n].starts_with(b"GET /api/v1/identity") { 404 } else { status };
                    let resp = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                    let _ = s.write_all(resp.as_bytes()).await;
                });
            }
        });
        url
    }
}
