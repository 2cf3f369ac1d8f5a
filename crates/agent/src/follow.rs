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

use gpuci_core::coordinators::{self, Endpoint, Seen};
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// How long one `/readyz` may take before its endpoint counts as unreachable. A leader
/// answers at once; a frozen or cut-off one never does.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a name may take to resolve.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The coordinator URLs given, and which one is used now.
#[derive(Clone, Debug)]
pub struct Coordinators {
    urls: Vec<String>,
    /// The endpoint used last (its URL and address): first among leaders next time.
    last: Option<Endpoint>,
    current: Current,
}

/// The base URL of the coordinator used now, shared with whoever makes requests beside the
/// agent channel (workspace and artifact transfers): they follow the agent to a new leader.
/// Shows as that URL.
#[derive(Clone, Debug)]
pub struct Current(Arc<RwLock<String>>);

impl Current {
    pub fn new(url: &str) -> Current {
        Current(Arc::new(RwLock::new(url.trim_end_matches('/').to_string())))
    }
    pub fn get(&self) -> String {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
    fn set(&self, url: &str) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = url.to_string();
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
}

impl Target {
    /// A reqwest client that sends requests for this target's base URL to its address.
    pub fn client(&self, builder: reqwest::ClientBuilder) -> reqwest::Result<reqwest::Client> {
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
        Coordinators { urls, last: None, current }
    }

    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// The handle that always shows the coordinator used now.
    pub fn current(&self) -> Current {
        self.current.clone()
    }

    /// The endpoints to try now, the leader first (see [`gpuci_core::coordinators`]); empty
    /// when none leads. The second value says what each endpoint answered, for the log.
    pub async fn candidates(&self) -> (Vec<Target>, String) {
        let resolved = futures::future::join_all(self.urls.iter().map(|u| resolve(u))).await;
        let endpoints = coordinators::endpoints(&resolved);
        let target = |e: &Endpoint| Target { base: self.urls[e.url].clone(), addr: e.addr, endpoint: e.clone() };
        if !coordinators::needs_probe(endpoints.len()) {
            // One: used by its URL, as before several were possible.
            let e = endpoints.first().cloned().unwrap_or(Endpoint { url: 0, addr: None });
            return (vec![Target { addr: None, ..target(&e) }], String::new());
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

    /// `target` is the one talked to now.
    pub fn used(&mut self, target: &Target) {
        self.last = Some(target.endpoint.clone());
        self.current.set(&target.base);
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
        assert_eq!(picked[0].addr, None);
    }

    async fn serve_readyz(status: u16) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    let _ = s.read(&mut buf).await;
                    let resp = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                    let _ = s.write_all(resp.as_bytes()).await;
                });
            }
        });
        url
    }
}
