//! App JWTs, checked with the public half of a test-only key.

use std::path::PathBuf;

use gpuci_github::{AppCredentials, Secret};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use time::OffsetDateTime;

fn read_fixture(name: &str) -> String {
    let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[derive(Deserialize)]
struct Claims {
    iat: i64,
    exp: i64,
    iss: String,
}

#[test]
fn app_jwt_is_rs256_signed_with_github_claims() {
    let creds = AppCredentials::new(12345, &Secret::new(read_fixture("test-app-key.pem"))).expect("valid key");
    let now = OffsetDateTime::now_utc();
    let jwt = creds.app_jwt(now).expect("signs");

    let key = DecodingKey::from_rsa_pem(read_fixture("test-app-key.pub.pem").as_bytes()).expect("public key");
    let mut validation = Validation::new(Algorithm::RS256);
    validation.required_spec_claims = ["exp", "iat", "iss"].into_iter().map(String::from).collect();
    validation.set_issuer(&["12345"]);
    let data = jsonwebtoken::decode::<Claims>(&jwt, &key, &validation).expect("valid signature and claims");
    assert_eq!(data.header.alg, Algorithm::RS256);
    assert_eq!(data.claims.iss, "12345");
    assert_eq!(data.claims.iat, now.unix_timestamp() - 60);
    assert_eq!(data.claims.exp, now.unix_timestamp() + 9 * 60);
}

#[test]
fn credentials_debug_hides_the_key() {
    let pem = read_fixture("test-app-key.pem");
    let creds = AppCredentials::new(1, &Secret::new(pem.clone())).expect("valid key");
    let shown = format!("{creds:?}");
    assert!(shown.contains("***") && !shown.contains("PRIVATE KEY"), "{shown}");
}
