//! Which coordinator an agent or the CLI talks to when it is given several (`--server A,B`,
//! or one DNS name with several addresses): the leader, found by asking each `/readyz`.
//!
//! Rules, here and nowhere else (the agent's connection loop and the CLI's client apply them;
//! the I/O of resolving names and asking `/readyz` is theirs):
//! - Every address of every URL is one [`Endpoint`], in the order given, each URL's addresses
//!   in the order the resolver gave them; an address reached twice (two URLs, or a name and an
//!   address literal, naming one socket) is tried once, as the first URL that named it.
//! - Only an endpoint whose `/readyz` answers 200 is connected to: a standby answers 503, a
//!   leader out of contact with its database answers 503, a dead or cut-off host does not
//!   answer. Connecting to those would cost a timeout or a refusal and gain nothing.
//! - Among those that lead (normally one; two only for the moment a cut-off former leader has
//!   not yet noticed, and then the database refuses its writes), the one used last comes
//!   first, so a follower does not hop between coordinators; then the order given.
//! - With a single endpoint nothing is asked: it is connected to as it is (a load balancer, or
//!   one coordinator), and its own answer tells what is wrong.
//! - None leading: nothing to try now; the caller waits (with back-off and jitter,
//!   [`backoff`], kept short while a takeover is under way) and asks again. A takeover takes
//!   seconds (docs/ha.md).

use std::net::SocketAddr;
use std::time::Duration;

/// One place to reach a coordinator: a URL as given and one address its host resolved to
/// (`None`: not resolved, connect by the URL).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Index of the URL in the list given.
    pub url: usize,
    pub addr: Option<SocketAddr>,
}

/// What an endpoint's `/readyz` said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// 200: it leads and its database answers.
    Leads,
    /// Another status (503: a standby, a leader that stepped aside, shutting down).
    NotLeading,
    /// No answer (refused, timed out, the name did not resolve).
    Unreachable,
}

/// The endpoints of `urls`, given each URL's resolved addresses (`resolved[i]` for
/// `urls[i]`; empty: not resolved or resolution failed, kept as one endpoint by URL so it is
/// still tried and reported).
pub fn endpoints(resolved: &[Vec<SocketAddr>]) -> Vec<Endpoint> {
    let mut out: Vec<Endpoint> = Vec::new();
    for (url, addrs) in resolved.iter().enumerate() {
        if addrs.is_empty() {
            out.push(Endpoint { url, addr: None });
            continue;
        }
        for a in addrs {
            if !out.iter().any(|e| e.addr == Some(*a)) {
                out.push(Endpoint { url, addr: Some(*a) });
            }
        }
    }
    out
}

/// The endpoints to try now, best first (indices into `seen`, which holds what each endpoint
/// answered); `last`: the endpoint used last. Empty: none leads, wait and ask again.
pub fn pick(seen: &[Seen], last: Option<usize>) -> Vec<usize> {
    let mut leaders: Vec<usize> = (0..seen.len()).filter(|&i| seen[i] == Seen::Leads).collect();
    if let Some(l) = last.filter(|l| leaders.contains(l)) {
        leaders.retain(|&i| i != l);
        leaders.insert(0, l);
    }
    leaders
}

/// Whether the endpoints need asking at all: one endpoint is connected to as it is.
pub fn needs_probe(endpoints: usize) -> bool {
    endpoints > 1
}

/// The longest wait between tries: an agent's coordinator gone for long is asked rarely.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The longest wait between tries while none of several coordinators leads: a takeover is
/// under way and ends within seconds (docs/ha.md), and a follower that waited [`BACKOFF_MAX`]
/// would find the new leader up to 7.5 s after it leads. Asking costs each coordinator one
/// `/readyz` (a standby answers it without its database).
pub const LEADERLESS_MAX: Duration = Duration::from_secs(1);

/// How long to wait after `failures` tries in a row found no coordinator to talk to: 100 ms
/// doubling to [`BACKOFF_MAX`] ([`LEADERLESS_MAX`] while several coordinators answer and none
/// leads: `leaderless`), plus up to half again as jitter (`jitter` in [0, 1), from the
/// caller's random source) so that thousands of agents left by one coordinator do not return
/// in step.
pub fn backoff(failures: u32, leaderless: bool, jitter: f64) -> Duration {
    let cap = if leaderless { LEADERLESS_MAX } else { BACKOFF_MAX };
    let base = Duration::from_millis(100).saturating_mul(1u32 << failures.min(16)).min(cap);
    base + base.mul_f64(jitter.clamp(0.0, 1.0) / 2.0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a panic is the failure report
mod tests {
    use super::*;
    use Seen::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_leader_is_picked_wherever_it_is_in_the_list() {
        assert_eq!(pick(&[NotLeading, Leads], None), vec![1]);
        assert_eq!(pick(&[Unreachable, NotLeading, Leads], Some(0)), vec![2]);
        assert_eq!(pick(&[Leads, Unreachable], Some(1)), vec![0]);
    }

    #[test]
    fn nobody_leading_means_wait_not_connect_to_a_standby() {
        assert!(pick(&[NotLeading, Unreachable], None).is_empty());
        assert!(pick(&[Unreachable, Unreachable], Some(0)).is_empty());
        assert!(pick(&[], None).is_empty());
    }

    #[test]
    fn the_one_used_last_comes_first_among_leaders_then_the_order_given() {
        assert_eq!(pick(&[Leads, Leads, Leads], Some(2)), vec![2, 0, 1]);
        assert_eq!(pick(&[Leads, Leads, Leads], None), vec![0, 1, 2]);
        // The one used last no longer leads: it is not tried at all.
        assert_eq!(pick(&[Leads, NotLeading, Leads], Some(1)), vec![0, 2]);
    }

    #[test]
    fn a_name_with_several_addresses_is_one_endpoint_per_address() {
        let e = endpoints(&[vec![a("127.0.0.2:80"), a("[::1]:80")], vec![a("127.0.0.3:81")]]);
        assert_eq!(
            e,
            vec![
                Endpoint { url: 0, addr: Some(a("127.0.0.2:80")) },
                Endpoint { url: 0, addr: Some(a("[::1]:80")) },
                Endpoint { url: 1, addr: Some(a("127.0.0.3:81")) },
            ]
        );
    }

    #[test]
    fn an_address_named_twice_is_tried_once_and_an_unresolved_url_is_kept() {
        let e = endpoints(&[vec![a("127.0.0.2:80")], vec![], vec![a("127.0.0.2:80"), a("127.0.0.4:80")]]);
        assert_eq!(
            e,
            vec![
                Endpoint { url: 0, addr: Some(a("127.0.0.2:80")) },
                Endpoint { url: 1, addr: None },
                Endpoint { url: 2, addr: Some(a("127.0.0.4:80")) },
            ]
        );
        assert!(!needs_probe(endpoints(&[vec![a("127.0.0.2:80")]]).len()));
        assert!(needs_probe(endpoints(&[vec![a("127.0.0.2:80"), a("127.0.0.3:80")]]).len()));
    }

    #[test]
    fn backoff_doubles_to_five_seconds_and_jitter_adds_at_most_half() {
        assert_eq!(backoff(0, false, 0.0), Duration::from_millis(100));
        assert_eq!(backoff(3, false, 0.0), Duration::from_millis(800));
        assert_eq!(backoff(10, false, 0.0), Duration::from_secs(5));
        assert_eq!(backoff(u32::MAX, false, 0.0), Duration::from_secs(5));
        assert!(backoff(10, false, 0.999) < Duration::from_millis(7500));
        assert_eq!(backoff(0, false, 2.0), Duration::from_millis(150));
    }

    #[test]
    fn while_a_takeover_is_under_way_the_wait_stays_short() {
        assert_eq!(backoff(0, true, 0.0), Duration::from_millis(100));
        assert_eq!(backoff(10, true, 0.0), Duration::from_secs(1));
        assert!(backoff(u32::MAX, true, 0.999) < Duration::from_millis(1500));
    }
}
