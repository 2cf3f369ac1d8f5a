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
//! What this does not stop: a relay that forwards the challenge to a real coordinator with
//! the agent's `Host` header, i.e. a machine-in-the-middle on the path to a listed address.
//! Plain HTTP cannot stop that; TLS (an `https://` URL with a certificate for the name)
//! can, and docs/ha.md says so.
//!
//! Pure: signing and checking over plain strings; the key's storage, the HTTP endpoint and
//! the pin's file are the coordinator's, the agent's and the CLI's.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};

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
    VerifyingKey::from_bytes(&bytes).map_err(|_| bad())?;
    Ok(format!("{KEY_PREFIX}{}", hex::encode(bytes)))
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
    vk.verify(&message(nonce, &proof.host), &Signature::from_bytes(&sig)).map_err(|_| IdentityError::BadSignature)?;
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

    #[test]
    fn the_secret_round_trips_and_is_never_shown() {
        let me = id(11);
        assert_eq!(SigningIdentity::from_secret(&me.secret()).public_key(), me.public_key());
        let shown = format!("{me:?}");
        assert!(!shown.contains(&hex::encode(me.secret())), "{shown}");
    }
}
