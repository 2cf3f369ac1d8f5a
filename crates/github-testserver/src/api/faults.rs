//! Faults a test injected (5xx, timeouts, rate limits) and the `x-ratelimit-*` headers of every
//! answer, shaped as GitHub sends them.

use super::*;

/// The first injected fault for this request, used up by one.
pub(super) fn take_fault(inner: &Inner, method: &str, path_and_query: &str) -> Option<crate::Fault> {
    let mut st = lock(&inner.state);
    let i = st.faults.iter().position(|f| f.matches(method, path_and_query))?;
    let fault = st.faults[i].clone();
    match &mut st.faults[i].times {
        Some(1) => {
            st.faults.remove(i);
        }
        Some(n) => *n -= 1,
        None => {}
    }
    Some(fault)
}

/// What GitHub answers in the situation a fault stands for.
pub(super) fn fault_reply(fault: &crate::Fault) -> Reply {
    use crate::FaultKind;
    match fault.kind {
        FaultKind::Status(status) => Reply::error(
            status,
            match status {
                401 => "Bad credentials",
                502 => "Bad Gateway",
                _ => "Server Error",
            },
        ),
        FaultKind::SecondaryRateLimit { retry_after } => {
            let mut r = Reply::error(
                403,
                "You have exceeded a secondary rate limit. Please wait a few minutes before you try again.",
            );
            r.headers.push(("retry-after".into(), retry_after.to_string()));
            r
        }
        FaultKind::SecondaryRateLimitNoHint => Reply::error(
            403,
            "You have exceeded a secondary rate limit. Please wait a few minutes before you try again.",
        ),
        FaultKind::TooManyRequests { retry_after } => {
            let mut r = Reply::error(429, "Too many requests");
            r.headers.push(("retry-after".into(), retry_after.to_string()));
            r
        }
        // The rate-limit headers (remaining 0, the reset) are added with everyone's.
        FaultKind::RateLimitExhausted { .. } => Reply::error(403, "API rate limit exceeded."),
    }
}

/// GitHub's `x-ratelimit-*` headers, counted per credential per hour, on every API answer whose
/// credential the server knows.
pub(super) fn rate_limit_headers(
    personal_token: Option<&str>,
    st: &mut State,
    headers: &HeaderMap,
    fault: Option<&crate::Fault>,
    reply: &mut Reply,
) {
    let Some(token) = bearer(headers) else { return };
    let credential = if personal_token == Some(token.as_str()) {
        "token".to_owned()
    } else if let Some(t) = st.tokens.get(&token) {
        format!("installation {}", t.installation_id)
    } else if token.matches('.').count() == 2 {
        "app".to_owned()
    } else {
        return;
    };
    let now = now().unix_timestamp();
    let window = st.rate_windows.entry(credential).or_insert(state::RateWindow { reset: now + 3600, used: 0 });
    if window.reset <= now {
        *window = state::RateWindow { reset: now + 3600, used: 0 };
    }
    window.used += 1;
    let (mut remaining, mut reset) = (state::RATE_LIMIT.saturating_sub(window.used), window.reset);
    if let Some(crate::FaultKind::RateLimitExhausted { reset_in }) = fault.map(|f| &f.kind) {
        (remaining, reset) = (0, now + *reset_in as i64);
    }
    let used = state::RATE_LIMIT - remaining;
    for (k, v) in [
        ("x-ratelimit-limit", state::RATE_LIMIT.to_string()),
        ("x-ratelimit-remaining", remaining.to_string()),
        ("x-ratelimit-used", used.to_string()),
        ("x-ratelimit-reset", reset.to_string()),
        ("x-ratelimit-resource", "core".to_owned()),
    ] {
        reply.headers.push((k.into(), v));
    }
}
