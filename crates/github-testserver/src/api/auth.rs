//! Who is asking: the app JWT (signed by the App's key, issued for its id, short-lived) and
//! installation or personal tokens, and which repositories and organisations a token may reach.
//! A refusal is the `Reply` GitHub would send; nothing here changes the state.

use super::*;

pub(super) fn bearer(headers: &HeaderMap) -> Option<String> {
    let value = headers.get("authorization")?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") || scheme.eq_ignore_ascii_case("token")).then(|| token.trim().to_owned())
}

#[derive(Deserialize)]
struct Claims {
    iat: i64,
    exp: i64,
    iss: Value,
}

/// Checks an App JWT the way GitHub does: RS256, `iss` = app id, expiring at most 10 minutes out.
pub(super) fn check_app_jwt(inner: &Inner, headers: &HeaderMap) -> Result<(), Reply> {
    let token = bearer(headers).ok_or_else(|| Reply::error(401, "Requires authentication"))?;
    let header =
        jsonwebtoken::decode_header(&token).map_err(|_| Reply::error(401, "A JSON web token could not be decoded"))?;
    if header.alg != Algorithm::RS256 {
        return Err(Reply::error(401, "A JSON web token could not be decoded"));
    }
    let claims: Claims = match &inner.app_key {
        Some(key) => {
            let mut v = Validation::new(Algorithm::RS256);
            v.set_required_spec_claims(&["exp", "iat", "iss"]);
            v.leeway = 30;
            jsonwebtoken::decode::<Claims>(&token, key, &v)
                .map_err(|e| Reply::error(401, &format!("A JSON web token could not be decoded ({e})")))?
                .claims
        }
        None => {
            jsonwebtoken::dangerous::insecure_decode::<Claims>(&token)
                .map_err(|_| Reply::error(401, "A JSON web token could not be decoded"))?
                .claims
        }
    };
    let iss_ok = match &claims.iss {
        Value::String(s) => s == &inner.app_id.to_string(),
        Value::Number(n) => n.as_u64() == Some(inner.app_id),
        _ => false,
    };
    if !iss_ok {
        return Err(Reply::error(401, "'Issuer' claim ('iss') must be an Integer"));
    }
    let now = now().unix_timestamp();
    if claims.exp <= now {
        return Err(Reply::error(401, "'Expiration time' claim ('exp') must be a numeric value representing the future time at which the assertion expires"));
    }
    if claims.exp - now > 600 + 30 || claims.exp - claims.iat > 600 + 30 {
        return Err(Reply::error(401, "'Expiration time' claim ('exp') is too far in the future"));
    }
    if claims.iat > now + 60 {
        return Err(Reply::error(
            401,
            "'Issued at' claim ('iat') must be an Integer representing the time that the assertion was issued",
        ));
    }
    Ok(())
}

/// The installation a token was issued for (`None` for the personal token), or 401.
fn check_token(inner: &Inner, st: &State, headers: &HeaderMap) -> Result<Option<u64>, Reply> {
    let token = bearer(headers).ok_or_else(|| Reply::error(401, "Requires authentication"))?;
    if inner.personal_token.as_deref() == Some(token.as_str()) {
        return Ok(None);
    }
    match st.tokens.get(&token) {
        Some(t) if t.expires_at > now() => Ok(Some(t.installation_id)),
        _ => Err(Reply::bad_credentials()),
    }
}

pub(super) fn check_repo_access(inner: &Inner, st: &State, headers: &HeaderMap, repo: &str) -> Result<(), Reply> {
    let installation = check_token(inner, st, headers)?;
    let Some(r) = st.repo(repo) else { return Err(Reply::not_found()) };
    match installation {
        None => Ok(()),
        Some(id) if id == r.installation_id => Ok(()),
        Some(_) => Err(Reply::bad_credentials()),
    }
}

pub(super) fn check_org_access(inner: &Inner, st: &State, headers: &HeaderMap, org: &str) -> Result<(), Reply> {
    let installation = check_token(inner, st, headers)?;
    if !st.repos.values().any(|r| r.owner.eq_ignore_ascii_case(org)) {
        return Err(Reply::not_found());
    }
    match installation {
        None => Ok(()),
        Some(id) if st.installation_account(id).is_some_and(|a| a.eq_ignore_ascii_case(org)) => Ok(()),
        Some(_) => Err(Reply::bad_credentials()),
    }
}
