//! The identity of a gpuci installation's coordinators: one ed25519 key per database, which
//! every coordinator of that database holds (the database keeps it, sealed), and which an
//! agent or the CLI pins. Before either sends a credential (the registration token, an
//! agent's credential, an API token) to an address, the address must prove it holds the
//! pinned key by signing a fresh random nonce and the host it was asked as.
//!
//! Why: an agent or a CLI given several coordinator URLs talks to whichever answers
//! `/readyz` with 200. Without a proof, anything listening on a listed address (a retired
//! coordinator's address given to another host, a typo, a rogue service on a shared host)
//! would be sent the credential. With it, such an address gets nothing: it cannot sign with
//! the key, a recorded answer does not fit a new nonce, and an answer a real coordinator
//! gave for its own host does not fit another host.
//!
//! What this does not stop: a machine in the middle of the path to a coordinator's own
//! address (plain HTTP; use TLS), someone who can listen on another address a listed name
//! resolves to, and the moment between a proof and the request after it (separate
//! connections; docs/ha.md). A relay at another address or port is stopped: a coordinator
//! signs only for its own ([`signs_for`]).
//!
//! Pure: signing and checking over plain strings; the key's storage, the HTTP endpoint and
//! the pin's file are the coordinator's, the agent's and the CLI's.

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};

/// How a public key is written: `ed25519:` and 64 hex digits.
pub const KEY_PREFIX: &str = "ed25519:";
/// Hex digits of a nonce (32 random bytes).
pub const NONCE_HEX_LEN: usize = 64;
/// Bytes of a secret key.
pub const SECRET_LEN: usize = 32;

/// What a coordinator answers to `GET /api/v1/identity?nonce=N`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IdentityProof {
    /// The installation's public key, `ed25519:<hex>`.
    pub key: String,
    /// The host the request named (`Host` header), as signed.
    pub host: String,
    /// Hex ed25519 signature over [`message`] of the nonce and `host`.
    pub signature: String,
}

/// Why a proof is not accepted, or a nonce or key is malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("the nonce must be {NONCE_HEX_LEN} lowercase hex digits")]
    BadNonce,
    #[error("{0:?} is not a coordinator key (expected `ed25519:` and 64 hex digits)")]
    BadKey(String),
    #[error("the proof signs the host {signed:?}, but it was asked as {asked:?}")]
    OtherHost { asked: String, signed: String },
    #[error("the signature does not verify with the key it names")]
    BadSignature,
    #[error("it holds the key {presented}, not the pinned {pinned}")]
    NotPinned { pinned: String, presented: String },
}

/// The bytes signed: a fixed label, the nonce and the host, so that a signature made for one
/// purpose, one challenge or one host is good for no other.
pub fn message(nonce: &str, host: &str) -> Vec<u8> {
    format!("gpuci coordinator identity v1\nnonce={nonce}\nhost={host}\n").into_bytes()
}

/// A nonce to ask with, from 32 random bytes the caller drew.
pub fn nonce(random: [u8; 32]) -> String {
    hex::encode(random)
}

fn check_nonce(nonce: &str) -> Result<(), IdentityError> {
    if nonce.len() == NONCE_HEX_LEN && nonce.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        Ok(())
    } else {
        Err(IdentityError::BadNonce)
    }
}

/// A key as given (`ed25519:<hex>`, surrounding blanks ignored, hex in either case), in its
/// one written form.
pub fn parse_key(given: &str) -> Result<String, IdentityError> {
    let bad = || IdentityError::BadKey(given.trim().chars().take(80).collect());
    let hexpart = given.trim().strip_prefix(KEY_PREFIX).ok_or_else(bad)?;
    let bytes: [u8; 32] = hex::decode(hexpart).ok().and_then(|b| b.try_into().ok()).ok_or_else(bad)?;
    // A weak key (a point of small order) verifies forged signatures: never one to pin.
    let vk = VerifyingKey::from_bytes(&bytes).map_err(|_| bad())?;
    if vk.is_weak() {
        return Err(bad());
    }
    Ok(format!("{KEY_PREFIX}{}", hex::encode(bytes)))
}

/// Whether a coordinator signs for `asked` (the `Host` a challenge names), given the local
/// address the request came in on and the names it was told are its own
/// (`--public-name NAME[:PORT]`). A coordinator that signed for any host would let whoever
/// holds a listed address relay an agent's challenge to it with the agent's `Host`:
/// - a name or address in `names`: signed for the port listed with it, or, listed without
///   one, for no port (the scheme's default) and the port this coordinator listens on;
/// - an address literal: signed only when it is the address the request came in on (what the
///   agent dialled reached this socket directly, not through a relay; behind NAT or a load
///   balancer, list the address the agents use in `names`);
/// - a name: signed when `names` is empty (a coordinator told nothing about its names cannot
///   tell a relay's from its own; docs/ha.md), refused otherwise.
pub fn signs_for(asked: &str, local: Option<SocketAddr>, names: &[String]) -> bool {
    let Some((host, port)) = split_host(asked) else { return false };
    // A listed `name:port` is that port only; a bare `name` is the name with no port (the
    // scheme's default, as behind a load balancer) or with the port this coordinator listens
    // on. Any port would let a relay on another port of the same host pass (outsider finding).
    let listed = names.iter().filter_map(|n| split_host(n.trim())).any(|(name, listed_port)| {
        name.eq_ignore_ascii_case(host)
            && match (listed_port, port) {
                (Some(lp), p) => p == Some(lp),
                (None, None) => true,
                (None, Some(p)) => local.is_some_and(|l| l.port() == p),
            }
    });
    if listed {
        return true;
    }
    match host.parse::<IpAddr>() {
        Ok(ip) => local.is_some_and(|l| l.ip().to_canonical() == ip.to_canonical() && port.unwrap_or(80) == l.port()),
        Err(_) => names.is_empty(),
    }
}

/// `host[:port]` or `[v6]:port` → (host without brackets, port).
fn split_host(asked: &str) -> Option<(&str, Option<u16>)> {
    if let Some(rest) = asked.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        return match after.strip_prefix(':') {
            Some(p) => Some((host, Some(p.parse().ok()?))),
            None if after.is_empty() => Some((host, None)),
            None => None,
        };
    }
    match asked.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => Some((h, Some(p.parse().ok()?))),
        Some(_) => None,
        None => Some((asked, None)),
    }
    .filter(|(h, _)| !h.is_empty())
}

/// The installation's key, to sign with. Never printed.
#[derive(Clone)]
pub struct SigningIdentity(SigningKey);

impl std::fmt::Debug for SigningIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SigningIdentity").field(&self.public_key()).finish()
    }
}

impl SigningIdentity {
    /// From the secret's 32 bytes (drawn at random once per installation).
    pub fn from_secret(secret: &[u8; SECRET_LEN]) -> SigningIdentity {
        SigningIdentity(SigningKey::from_bytes(secret))
    }

    /// The secret's bytes, to store (sealed).
    pub fn secret(&self) -> [u8; SECRET_LEN] {
        self.0.to_bytes()
    }

    /// `ed25519:<hex>`.
    pub fn public_key(&self) -> String {
        format!("{KEY_PREFIX}{}", hex::encode(self.0.verifying_key().to_bytes()))
    }

    /// The answer to a challenge with `nonce`, asked as `host`.
    pub fn prove(&self, nonce: &str, host: &str) -> Result<IdentityProof, IdentityError> {
        check_nonce(nonce)?;
        let signature = self.0.sign(&message(nonce, host));
        Ok(IdentityProof {
            key: self.public_key(),
            host: host.to_string(),
            signature: hex::encode(signature.to_bytes()),
        })
    }
}

/// Checks the answer to a challenge with `nonce` sent to `host`: it signs that nonce and that
/// host with the key it names, and that key is the `pinned` one (when one is pinned). Returns
/// the key (to pin, when none was).
pub fn verify(proof: &IdentityProof, nonce: &str, host: &str, pinned: Option<&str>) -> Result<String, IdentityError> {
    check_nonce(nonce)?;
    let key = parse_key(&proof.key)?;
    if !proof.host.eq_ignore_ascii_case(host) {
        return Err(IdentityError::OtherHost { asked: host.to_string(), signed: proof.host.clone() });
    }
    let bytes: [u8; 32] = hex::decode(&key[KEY_PREFIX.len()..])
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| IdentityError::BadKey(key.clone()))?;
    let vk = VerifyingKey::from_bytes(&bytes).map_err(|_| IdentityError::BadKey(key.clone()))?;
    let sig: [u8; 64] =
        hex::decode(&proof.signature).ok().and_then(|b| b.try_into().ok()).ok_or(IdentityError::BadSignature)?;
    // Signed with the proof's own host: case may differ from what was asked, the name not.
    vk.verify_strict(&message(nonce, &proof.host), &Signature::from_bytes(&sig))
        .map_err(|_| IdentityError::BadSignature)?;
    if let Some(pinned) = pinned {
        let pinned = parse_key(pinned)?;
        if pinned != key {
            return Err(IdentityError::NotPinned { pinned, presented: key });
        }
    }
    Ok(key)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    fn id(seed: u8) -> SigningIdentity {
        SigningIdentity::from_secret(&[seed; 32])
    }

    #[test]
    fn a_proof_verifies_for_its_nonce_host_and_key_only() {
        let (n, other_n) = (nonce([1; 32]), nonce([2; 32]));
        let me = id(7);
        let p = me.prove(&n, "ci-a:8080").unwrap();
        assert_eq!(verify(&p, &n, "ci-a:8080", None).unwrap(), me.public_key());
        assert_eq!(verify(&p, &n, "CI-A:8080", Some(&me.public_key())).unwrap(), me.public_key());
        // A recorded answer does not fit a new challenge.
        assert_eq!(verify(&p, &other_n, "ci-a:8080", None), Err(IdentityError::BadSignature));
        // An answer a coordinator gave for its own host does not fit another.
        assert!(matches!(verify(&p, &n, "old-ci:8080", None), Err(IdentityError::OtherHost { .. })));
        // Claiming the other host without re-signing: the signature no longer fits.
        let forged = IdentityProof { host: "old-ci:8080".into(), ..p.clone() };
        assert_eq!(verify(&forged, &n, "old-ci:8080", None), Err(IdentityError::BadSignature));
        // Another installation's key, however valid its signature, is not the pinned one.
        let stranger = id(9).prove(&n, "ci-a:8080").unwrap();
        assert!(matches!(
            verify(&stranger, &n, "ci-a:8080", Some(&me.public_key())),
            Err(IdentityError::NotPinned { .. })
        ));
        // Naming the pinned key with a signature of another key.
        let lying = IdentityProof { key: me.public_key(), ..stranger };
        assert_eq!(verify(&lying, &n, "ci-a:8080", Some(&me.public_key())), Err(IdentityError::BadSignature));
    }

    #[test]
    fn malformed_nonces_keys_and_signatures_are_refused_not_panicked_on() {
        let me = id(3);
        assert_eq!(me.prove("abc", "h").unwrap_err(), IdentityError::BadNonce);
        assert_eq!(me.prove(&"G".repeat(64), "h").unwrap_err(), IdentityError::BadNonce);
        let n = nonce([5; 32]);
        let p = me.prove(&n, "h").unwrap();
        for key in ["", "ed25519:", "ed25519:zz", "rsa:00", &format!("ed25519:{}", "0".repeat(66))] {
            assert!(matches!(
                verify(&IdentityProof { key: key.into(), ..p.clone() }, &n, "h", None),
                Err(IdentityError::BadKey(_))
            ));
        }
        for sig in ["", "00", &"ff".repeat(64), "not hex"] {
            assert_eq!(
                verify(&IdentityProof { signature: sig.into(), ..p.clone() }, &n, "h", None),
                Err(IdentityError::BadSignature)
            );
        }
        assert_eq!(
            parse_key(&format!("  {}  ", me.public_key().to_uppercase().replace("ED25519", "ed25519"))).unwrap(),
            me.public_key()
        );
        assert!(parse_key("ssh-ed25519 AAAA").is_err());
    }

    /// Outsider finding: the coordinator signed for any `Host`, so a listed address held by
    /// someone else relayed an agent's challenge to it and got a proof for its own host.
    #[test]
    fn a_coordinator_signs_only_for_hosts_that_are_its_own() {
        let local: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let none: &[String] = &[];
        assert!(signs_for("127.0.0.1:8080", Some(local), none));
        assert!(!signs_for("127.0.0.2:8080", Some(local), none), "a relay at another address");
        assert!(!signs_for("127.0.0.1:9090", Some(local), none));
        assert!(!signs_for("127.0.0.1", Some(local), none), "port 80 implied");
        assert!(!signs_for("127.0.0.1:8080", None, none));
        let v6: SocketAddr = "[::ffff:127.0.0.1]:8080".parse().unwrap();
        assert!(signs_for("127.0.0.1:8080", Some(v6), none), "a dual-stack socket");
        assert!(signs_for("[::1]:8080", Some("[::1]:8080".parse().unwrap()), none));
        // Names: any, until names are given; then those only (and listed addresses).
        assert!(signs_for("ci.example.org:8080", Some(local), none));
        let names = vec!["CI.example.org".to_string(), "10.0.0.5:80".to_string(), "lb.example.org:443".to_string()];
        assert!(signs_for("ci.example.org:8080", Some(local), &names), "the port it listens on");
        assert!(signs_for("ci.example.org", Some(local), &names), "the scheme's default port");
        assert!(!signs_for("ci.example.org:8081", Some(local), &names), "a relay on another port of the host");
        assert!(!signs_for("old-ci.example.org:8080", Some(local), &names));
        assert!(signs_for("10.0.0.5:80", Some(local), &names), "a load balancer's address, listed");
        assert!(signs_for("lb.example.org:443", Some(local), &names));
        assert!(!signs_for("lb.example.org:8443", Some(local), &names));
        assert!(!signs_for("lb.example.org", Some(local), &names), "listed with a port: that port only");
        for junk in ["", ":80", "[::1", "a:b:c", "h:99999", "[::1]x"] {
            assert!(!signs_for(junk, Some(local), &names), "{junk:?}");
        }
    }

    #[test]
    fn a_weak_key_is_never_taken() {
        // The identity point (small order): any signature of the form R=identity verifies.
        let weak = format!("{KEY_PREFIX}01{}", "00".repeat(31));
        assert!(matches!(parse_key(&weak), Err(IdentityError::BadKey(_))));
        let n = nonce([3; 32]);
        let forged = IdentityProof { key: weak.clone(), host: "h".into(), signature: format!("01{}", "00".repeat(63)) };
        assert!(verify(&forged, &n, "h", None).is_err());
    }

    #[test]
    fn the_secret_round_trips_and_is_never_shown() {
        let me = id(11);
        assert_eq!(SigningIdentity::from_secret(&me.secret()).public_key(), me.public_key());
        let shown = format!("{me:?}");
        assert!(!shown.contains(&hex::encode(me.secret())), "{shown}");
    }
}
