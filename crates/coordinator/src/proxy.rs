//! A standby passes the API and the dashboard on to the leader (docs/ha.md): a person or a
//! script given any coordinator's address is served, whichever leads. The leader records
//! where it is reached and its identity key in the database ([`LEADER_STATE`], a fenced write:
//! only the coordinator that holds the claim can make it); a standby reads that record, asks
//! the address to prove the key (`GET /api/v1/identity`, as agents and the CLI do) and only
//! then sends it a request, credentials included. An address that cannot prove it (a record
//! left by a dead leader whose port another process took) is sent nothing: 503.
//!
//! Not passed on: the agent channel (a WebSocket; agents given several addresses find the
//! leader themselves), `/readyz` (a standby's own answer), the identity proof (it proves the
//! coordinator asked, and a standby proves nothing) and webhooks (a standby queues those
//! itself, `crate::standby`). Must not: send a request to an address it has not proved.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use gpuci_core::coordinator_identity::{self as identity, IdentityProof};
use gpuci_store::Store;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
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

/// How long a proved address is used before it is proved again.
const PROVED_FOR: Duration = Duration::from_secs(10);
/// Connecting to the leader, and its proof.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const PROOF_TIMEOUT: Duration = Duration::from_secs(5);
/// A proof is a few hundred bytes.
const MAX_PROOF_BYTES: usize = 4096;

/// A standby's way to the leader.
pub struct Proxy {
    store: Arc<dyn Store>,
    http: reqwest::Client,
    /// The address last proved, and when.
    proved: Mutex<Option<(String, Instant)>>,
}

impl Proxy {
    pub fn new(store: Arc<dyn Store>) -> anyhow::Result<Proxy> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Proxy { store, http, proved: Mutex::new(None) })
    }

    /// Passes `req` on to the leader and its answer back; 503 when there is no leader this
    /// standby can prove, or it does not answer.
    pub async fn forward(&self, req: Request) -> Response {
        let path = req.uri().path();
        if path == "/readyz" || path == "/api/v1/identity" || is_upgrade(req.headers()) {
            return not_passed_on();
        }
        let base = match self.leader().await {
            Ok(b) => b,
            Err(why) => return unavailable(&why),
        };
        let target = format!("{base}{}", req.uri().path_and_query().map_or("/", |p| p.as_str()));
        let (parts, body) = req.into_parts();
        let mut headers = without_hop_by_hop(&parts.headers);
        headers.remove(header::HOST);
        headers.insert(header::VIA, axum::http::HeaderValue::from_static("1.1 gpuci-standby"));
        let sent = self
            .http
            .request(parts.method, &target)
            .headers(headers)
            .body(reqwest::Body::wrap_stream(body.into_data_stream()))
            .send()
            .await;
        match sent {
            Ok(resp) => {
                let mut out = Response::builder().status(resp.status());
                if let Some(h) = out.headers_mut() {
                    *h = without_hop_by_hop(resp.headers());
                }
                out.body(Body::from_stream(resp.bytes_stream())).unwrap_or_else(|e| unavailable(&e.to_string()))
            }
            Err(e) => {
                // Proved again before the next request: it may have gone.
                *self.proved.lock().unwrap_or_else(|e| e.into_inner()) = None;
                unavailable(&format!("the leader at {base} did not answer: {e}"))
            }
        }
    }

    /// A leader's base URL this standby has proved lately, or one it proves now.
    async fn leader(&self) -> Result<String, String> {
        if let Some((base, at)) = self.proved.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            if at.elapsed() < PROVED_FOR {
                return Ok(base);
            }
        }
        let record = match self.store.coordinator_state(LEADER_STATE).await {
            Ok(Some(json)) => serde_json::from_str::<LeaderRecord>(&json)
                .map_err(|e| format!("the leader's record is damaged: {e}"))?,
            Ok(None) => return Err("no coordinator has said where it leads yet".into()),
            Err(e) => return Err(format!("the database does not answer: {e}")),
        };
        let mut why = Vec::new();
        for base in &record.urls {
            match self.prove(base, &record.key).await {
                Ok(()) => {
                    *self.proved.lock().unwrap_or_else(|e| e.into_inner()) = Some((base.clone(), Instant::now()));
                    return Ok(base.clone());
                }
                Err(e) => why.push(format!("{base}: {e}")),
            }
        }
        Err(format!("no address of the leader proved the installation's key ({})", why.join("; ")))
    }

    async fn prove(&self, base: &str, key: &str) -> Result<(), String> {
        let host = reqwest::Url::parse(base)
            .ok()
            .and_then(|u| {
                u.host_str().map(|h| match u.port() {
                    Some(p) => format!("{h}:{p}"),
                    None => h.to_string(),
                })
            })
            .ok_or("not a URL with a host")?;
        let nonce = identity::nonce(rand::random());
        let mut resp = self
            .http
            .get(format!("{base}/api/v1/identity"))
            .query(&[("nonce", &nonce)])
            .timeout(PROOF_TIMEOUT)
            .send()
            .await
            .map_err(|e| format!("no answer: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("it answered {}", resp.status()));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
            body.extend_from_slice(&chunk);
            if body.len() > MAX_PROOF_BYTES {
                return Err("its answer is not a proof (too long)".into());
            }
        }
        let proof: IdentityProof =
            serde_json::from_slice(&body).map_err(|e| format!("its answer is not a proof: {e}"))?;
        identity::verify(&proof, &nonce, &host, Some(key)).map(|_| ()).map_err(|e| e.to_string())
    }
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
}
