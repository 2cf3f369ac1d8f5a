//! Webhook delivery verification: `X-Hub-Signature-256: sha256=<hex>` is HMAC-SHA256 of the raw body
//! keyed with the webhook secret.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header GitHub puts the signature in.
pub const SIGNATURE_HEADER: &str = "X-Hub-Signature-256";

const PREFIX: &str = "sha256=";

/// Why a delivery was rejected. The signature variants mean "do not trust this body" (HTTP 401);
/// [`WebhookError::InvalidPayload`] means the sender was trusted but the body was not understood (HTTP 400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WebhookError {
    #[error("webhook delivery has no {SIGNATURE_HEADER} header")]
    MissingSignature,
    #[error("webhook {SIGNATURE_HEADER} header is malformed: {reason}")]
    MalformedSignature { reason: &'static str },
    #[error("webhook {SIGNATURE_HEADER} does not match the body (wrong secret or forged delivery)")]
    SignatureMismatch,
    #[error("webhook `{event}` delivery {delivery_id}: cannot parse payload at `{path}`: {message}")]
    InvalidPayload { event: String, delivery_id: String, path: String, message: String },
}

/// Checks `header` (the value of [`SIGNATURE_HEADER`], if present) against `body` signed with `secret`.
///
/// Must be called on the exact bytes received, before any parsing: re-serialised JSON would not match.
pub fn verify_signature(secret: &[u8], body: &[u8], header: Option<&str>) -> Result<(), WebhookError> {
    let expected = signature_digest(header)?;
    // HMAC accepts keys of any length, so this cannot fail; map it anyway rather than unwrap.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).map_err(|_| WebhookError::SignatureMismatch)?;
    mac.update(body);
    // verify_slice compares in constant time, so the response time leaks nothing about the digest.
    mac.verify_slice(&expected).map_err(|_| WebhookError::SignatureMismatch)
}

/// The digest `header` carries, checked for form only (`sha256=` and 64 hex digits). Needs no
/// body: a receiver calls it before reading one, so a request that cannot be a signed delivery
/// is refused without its body being read.
pub fn signature_digest(header: Option<&str>) -> Result<Vec<u8>, WebhookError> {
    let header = header.ok_or(WebhookError::MissingSignature)?;
    let hex_digest = header
        .trim()
        .strip_prefix(PREFIX)
        .ok_or(WebhookError::MalformedSignature { reason: "expected `sha256=` followed by hex digits" })?;
    let expected = hex::decode(hex_digest)
        .map_err(|_| WebhookError::MalformedSignature { reason: "signature is not valid hex" })?;
    if expected.len() != 32 {
        return Err(WebhookError::MalformedSignature { reason: "signature is not 32 bytes (64 hex digits)" });
    }
    Ok(expected)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sign(secret: &[u8], body: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("any key length");
        mac.update(body);
        format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
    }

    #[test]
    fn github_docs_vector_is_accepted() {
        // From GitHub's "Validating webhook deliveries" page.
        let header = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
        assert_eq!(verify_signature(b"It's a Secret to Everybody", b"Hello, World!", Some(header)), Ok(()));
        assert_eq!(sign(b"It's a Secret to Everybody", b"Hello, World!"), header);
    }

    #[test]
    fn signature_computed_independently_is_accepted() {
        let body = br#"{"zen":"Keep it logically awesome."}"#;
        let header = sign(b"s3cret", body);
        assert_eq!(verify_signature(b"s3cret", body, Some(&header)), Ok(()));
    }

    #[test]
    fn missing_header_is_rejected() {
        assert_eq!(verify_signature(b"k", b"body", None), Err(WebhookError::MissingSignature));
    }

    #[test]
    fn malformed_headers_are_rejected() {
        let good = sign(b"k", b"body");
        let digest = good.strip_prefix("sha256=").expect("prefix");
        for bad in [
            "",
            digest,                        // no prefix
            &format!("sha1={digest}"),     // old algorithm
            "sha256=zz",                   // not hex
            "sha256=abcd",                 // too short
            &format!("sha256={digest}00"), // too long
        ] {
            assert!(
                matches!(verify_signature(b"k", b"body", Some(bad)), Err(WebhookError::MalformedSignature { .. })),
                "{bad:?} should be malformed"
            );
        }
    }

    #[test]
    fn the_header_alone_is_checked_for_form() {
        let good = sign(b"k", b"body");
        assert_eq!(signature_digest(Some(&good)).map(|d| d.len()), Ok(32));
        assert_eq!(signature_digest(None), Err(WebhookError::MissingSignature));
        assert!(matches!(signature_digest(Some("sha256=abcd")), Err(WebhookError::MalformedSignature { .. })));
    }

    #[test]
    fn wrong_secret_or_tampered_body_is_a_mismatch() {
        let header = sign(b"right", b"body");
        assert_eq!(verify_signature(b"wrong", b"body", Some(&header)), Err(WebhookError::SignatureMismatch));
        assert_eq!(verify_signature(b"right", b"bodY", Some(&header)), Err(WebhookError::SignatureMismatch));
    }

    #[test]
    fn uppercase_hex_is_accepted() {
        let header = sign(b"k", b"body").replace("sha256=", "").to_uppercase();
        assert_eq!(verify_signature(b"k", b"body", Some(&format!("sha256={header}"))), Ok(()));
    }
}
