//! GitHub's rate limits, as the client obeys them: what an answer asks for, and the one "not
//! before" instant a client (and every clone of it) keeps. The rules live here and nowhere else:
//!
//! - A *rate-limit answer* is a 429, or a 403 that carries `retry-after`, says
//!   `x-ratelimit-remaining: 0`, or whose message names a rate limit (GitHub's secondary limits
//!   may come with no header at all; the message is the only sign, and it is read here, at the
//!   edge, into a typed [`Limit`]). Any other 403 is a missing permission.
//! - `retry-after: N` (seconds, or an HTTP date) is obeyed to the second: nothing is sent before
//!   N seconds have passed, however long that is. A `retry-after` on a 5xx is obeyed the same way.
//! - `x-ratelimit-remaining: 0` waits until `x-ratelimit-reset`, measured against GitHub's own
//!   `Date` header when it sent one, so a local clock that runs ahead never retries early.
//! - No usable hint (neither header, or a reset already past by GitHub's clock) waits at least
//!   [`NO_HINT_FIRST`] (GitHub: "wait at least one minute"), doubling with each such answer in a
//!   row, at most [`NO_HINT_CAP`]. Answers to requests that were already in flight when the
//!   client was held back are one burst, not a row: they do not double the wait again. Other
//!   calls getting through in between do not end the row (a secondary limit may cover some
//!   endpoints and not others); [`NO_HINT_CAP`] without such an answer does.
//! - The hold is the whole client's, not one call's and not one credential's: GitHub's secondary
//!   limits count the App as a whole, and a coordinator mostly acts for one installation. Holding
//!   every call costs only waiting; sending early is what gets an App's installation blocked.
//!
//! The hold is kept as a [`tokio::time::Instant`], so tests run it on tokio's paused clock.

use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;
use reqwest::StatusCode;
use time::OffsetDateTime;
use tokio::time::Instant;

/// The first wait after a rate-limit answer without a usable hint.
pub const NO_HINT_FIRST: Duration = Duration::from_secs(60);
/// The longest wait after rate-limit answers without a hint in a row.
pub const NO_HINT_CAP: Duration = Duration::from_secs(15 * 60);
/// Added to every hinted wait: GitHub counts whole seconds, and arriving on the very second it
/// named may still be early by its clock.
const MARGIN: Duration = Duration::from_millis(100);

/// What a rate-limit answer asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// Wait this long (`retry-after`, or the time until `x-ratelimit-reset`).
    Hinted(Duration),
    /// A rate limit that says nothing usable about when it ends.
    NoHint,
}

/// The wait after `strikes` rate-limit answers without a hint in a row (at least 1).
pub fn no_hint_wait(strikes: u32) -> Duration {
    let doubled = NO_HINT_FIRST.saturating_mul(1u32 << strikes.saturating_sub(1).min(16));
    doubled.min(NO_HINT_CAP)
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// GitHub's clock, from the answer's `Date` header, else ours (`now_unix`).
fn github_now(headers: &HeaderMap, now_unix: i64) -> i64 {
    header(headers, "date").and_then(http_date).unwrap_or(now_unix)
}

/// `retry-after` as a wait: seconds, or an HTTP date (measured against GitHub's `Date`).
pub(crate) fn retry_after(headers: &HeaderMap, now_unix: i64) -> Option<Duration> {
    let value = header(headers, "retry-after")?;
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = http_date(value)?;
    Some(Duration::from_secs(at.saturating_sub(github_now(headers, now_unix)).max(0) as u64))
}

/// Whether an answer is GitHub saying "slow down", and what it asks for; `None` for every other
/// answer (a 403 for a missing permission included). `body` is the answer's body (GitHub's JSON
/// `message`); `now_unix` is our clock, used only when GitHub sent no `Date`.
pub fn limit_of(status: StatusCode, headers: &HeaderMap, body: &[u8], now_unix: i64) -> Option<Limit> {
    if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::FORBIDDEN {
        return None;
    }
    let exhausted = header(headers, "x-ratelimit-remaining") == Some("0");
    let has_retry_after = headers.contains_key("retry-after");
    if status == StatusCode::FORBIDDEN && !exhausted && !has_retry_after && !names_rate_limit(body) {
        return None;
    }
    if let Some(wait) = retry_after(headers, now_unix) {
        return Some(Limit::Hinted(wait + MARGIN));
    }
    if exhausted {
        if let Some(reset) = header(headers, "x-ratelimit-reset").and_then(|v| v.parse::<i64>().ok()) {
            let left = reset - github_now(headers, now_unix);
            // A reset that is not ahead by GitHub's own clock tells nothing: treat it as no hint.
            if left > 0 {
                return Some(Limit::Hinted(Duration::from_secs(left as u64) + MARGIN));
            }
        }
    }
    Some(Limit::NoHint)
}

/// Whether GitHub's error message names a rate limit ("You have exceeded a secondary rate limit",
/// "API rate limit exceeded"): the only sign of a secondary limit sent without headers.
fn names_rate_limit(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Message {
        message: String,
    }
    serde_json::from_slice::<Message>(body).is_ok_and(|m| m.message.to_ascii_lowercase().contains("rate limit"))
}

/// An HTTP date (`Sun, 06 Nov 1994 08:49:37 GMT`, the only form GitHub sends) as Unix seconds.
fn http_date(value: &str) -> Option<i64> {
    let parts: Vec<&str> = value.split_whitespace().collect();
    let [_, day, month, year, clock, "GMT"] = parts.as_slice() else { return None };
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let month = MONTHS.iter().position(|m| m == month)? as u8 + 1;
    let date =
        time::Date::from_calendar_date(year.parse().ok()?, time::Month::try_from(month).ok()?, day.parse().ok()?)
            .ok()?;
    let mut hms = clock.split(':').map(|p| p.parse::<u8>().ok());
    let (h, m, s) = (hms.next()??, hms.next()??, hms.next()??);
    let time = time::Time::from_hms(h, m, s).ok()?;
    Some(date.with_time(time).assume_utc().unix_timestamp())
}

/// `at` as `HH:MM:SS` UTC, as reasons and errors show it.
pub fn utc_hms(at: SystemTime) -> String {
    let t = OffsetDateTime::from(at);
    format!("{:02}:{:02}:{:02}", t.hour(), t.minute(), t.second())
}

/// The client's "not before": one per client, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    state: std::sync::Mutex<(Hold, Option<SystemTime>)>,
}

/// The pure part of [`Gate`]: every decision takes the clock as an argument.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Hold {
    /// Nothing is sent before this.
    pub until: Option<Instant>,
    /// When the latest rate-limit answer came (requests sent before it were in flight).
    pub set_at: Option<Instant>,
    /// Rate-limit answers without a hint in a row.
    pub strikes: u32,
    /// When the latest answer without a hint came.
    pub last_strike: Option<Instant>,
}

impl Hold {
    /// A rate-limit answer came at `now` to a request sent at `sent`: hold until what it asks
    /// for (never shortening a hold already longer). Returns the hold's end.
    pub fn limited(&mut self, limit: Limit, sent: Instant, now: Instant) -> Instant {
        let wait = match limit {
            Limit::Hinted(wait) => wait,
            Limit::NoHint => {
                let quiet =
                    self.last_strike.is_none_or(|at| now.saturating_duration_since(at) > NO_HINT_CAP + self.wait());
                if quiet {
                    // Long enough without one: a new row.
                    self.strikes = 1;
                } else if self.set_at.is_none_or(|at| sent >= at) {
                    // Sent after the previous answer (so held back until it ended), and the limit
                    // still holds: the next in the row. One in flight before is the same burst.
                    self.strikes = self.strikes.saturating_add(1);
                }
                self.last_strike = Some(now);
                self.wait()
            }
        };
        let end = now + wait;
        if self.until.is_none_or(|until| end > until) {
            self.until = Some(end);
        }
        self.set_at = Some(now);
        self.until.unwrap_or(end)
    }

    /// The wait the current row of answers without a hint stands at.
    fn wait(&self) -> Duration {
        no_hint_wait(self.strikes.max(1))
    }

    /// The hold's end, while it is ahead of `now`.
    pub fn until(&self, now: Instant) -> Option<Instant> {
        self.until.filter(|until| *until > now)
    }
}

/// The end of a hold: by tokio's clock (what the client waits on) and as wall-clock time (what
/// errors, reasons and callers that schedule by it see), read once so every caller sees the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HoldEnd {
    pub at: Instant,
    pub wall: SystemTime,
}

impl Gate {
    pub fn limited(&self, limit: Limit, sent: Instant) -> HoldEnd {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (hold, wall) = &mut *state;
        let before = hold.until;
        let now = Instant::now();
        let at = hold.limited(limit, sent, now);
        if hold.until != before || wall.is_none() {
            *wall = Some(SystemTime::now() + at.saturating_duration_since(now));
        }
        HoldEnd { at, wall: wall.unwrap_or_else(SystemTime::now) }
    }

    pub fn until(&self) -> Option<HoldEnd> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (hold, wall) = &*state;
        let at = hold.until(Instant::now())?;
        Some(HoldEnd { at, wall: wall.unwrap_or_else(SystemTime::now) })
    }
}

/// GitHub's rate-limit figures from the latest answer for one credential and resource.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RateLimit {
    /// Whose limit: `app` (the App's JWT), `installation <id>`, or `token` (a personal access token).
    pub credential: String,
    /// `x-ratelimit-resource`: `core` for the REST API.
    pub resource: String,
    /// `x-ratelimit-limit`: requests per window.
    pub limit: u64,
    /// `x-ratelimit-remaining`.
    pub remaining: u64,
    /// `x-ratelimit-used`, when sent.
    pub used: Option<u64>,
    /// `x-ratelimit-reset`: when the window resets, Unix seconds.
    pub reset: i64,
    /// When the answer came, Unix seconds.
    pub observed_at: i64,
}

impl RateLimit {
    pub(crate) fn from_headers(credential: &str, headers: &HeaderMap, now_unix: i64) -> Option<RateLimit> {
        let number = |name: &str| header(headers, name).and_then(|v| v.parse::<u64>().ok());
        Some(RateLimit {
            credential: credential.to_owned(),
            resource: header(headers, "x-ratelimit-resource").unwrap_or("core").to_owned(),
            limit: number("x-ratelimit-limit")?,
            remaining: number("x-ratelimit-remaining")?,
            used: number("x-ratelimit-used"),
            reset: header(headers, "x-ratelimit-reset").and_then(|v| v.parse().ok()).unwrap_or(0),
            observed_at: now_unix,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().expect("header value"));
        }
        h
    }

    const NOW: i64 = 1_700_000_000;
    const FORBIDDEN: StatusCode = StatusCode::FORBIDDEN;
    const SECONDARY: &[u8] =
        br#"{"message":"You have exceeded a secondary rate limit. Please wait a few minutes before you try again."}"#;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn the_wait_github_asks_for_comes_from_retry_after_or_the_reset() {
        let hinted = |s| Some(Limit::Hinted(secs(s) + MARGIN));
        assert_eq!(limit_of(FORBIDDEN, &headers(&[("retry-after", "90")]), b"", NOW), hinted(90));
        assert_eq!(
            limit_of(StatusCode::TOO_MANY_REQUESTS, &headers(&[("retry-after", "3600")]), b"", NOW),
            hinted(3600)
        );
        let exhausted = headers(&[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1700000120")]);
        assert_eq!(limit_of(FORBIDDEN, &exhausted, b"", NOW), hinted(120));
        // GitHub's clock, not ours: ours runs 100 s ahead here, and the wait is still 120 s.
        let dated = headers(&[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "1700000120"),
            ("date", "Tue, 14 Nov 2023 22:13:20 GMT"),
        ]);
        assert_eq!(limit_of(FORBIDDEN, &dated, b"", NOW + 100), hinted(120));
        // retry-after as an HTTP date, against GitHub's Date.
        let at =
            headers(&[("retry-after", "Tue, 14 Nov 2023 22:14:50 GMT"), ("date", "Tue, 14 Nov 2023 22:13:20 GMT")]);
        assert_eq!(limit_of(StatusCode::TOO_MANY_REQUESTS, &at, b"", 0), hinted(90));
    }

    #[test]
    fn a_limit_without_a_usable_hint_is_still_a_limit() {
        assert_eq!(limit_of(StatusCode::TOO_MANY_REQUESTS, &HeaderMap::new(), b"", NOW), Some(Limit::NoHint));
        assert_eq!(limit_of(FORBIDDEN, &HeaderMap::new(), SECONDARY, NOW), Some(Limit::NoHint));
        let past = headers(&[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1699999000")]);
        assert_eq!(limit_of(FORBIDDEN, &past, b"", NOW), Some(Limit::NoHint), "a reset in the past");
        let no_reset = headers(&[("x-ratelimit-remaining", "0")]);
        assert_eq!(limit_of(FORBIDDEN, &no_reset, b"", NOW), Some(Limit::NoHint));
    }

    #[test]
    fn a_403_for_a_missing_permission_is_not_a_limit() {
        let left = headers(&[("x-ratelimit-remaining", "12"), ("x-ratelimit-reset", "1700000042")]);
        let denied = br#"{"message":"Resource not accessible by integration"}"#;
        assert_eq!(limit_of(FORBIDDEN, &left, denied, NOW), None);
        assert_eq!(limit_of(FORBIDDEN, &HeaderMap::new(), b"<html>rate limit</html>", NOW), None, "not GitHub's JSON");
        assert_eq!(limit_of(StatusCode::NOT_FOUND, &headers(&[("retry-after", "5")]), b"", NOW), None);
    }

    #[test]
    fn http_dates_parse() {
        assert_eq!(http_date("Tue, 14 Nov 2023 22:13:20 GMT"), Some(NOW));
        assert_eq!(http_date("Sun, 06 Nov 1994 08:49:37 GMT"), Some(784_111_777));
        for bad in ["", "Tue, 14 Nov 2023 22:13:20 CET", "Tue, 31 Feb 2023 22:13:20 GMT", "1700000000"] {
            assert_eq!(http_date(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn no_hint_waits_a_minute_then_double_up_to_the_cap() {
        let waits: Vec<u64> = (1..=7).map(|n| no_hint_wait(n).as_secs()).collect();
        assert_eq!(waits, vec![60, 120, 240, 480, 900, 900, 900]);
        assert_eq!(no_hint_wait(0), NO_HINT_FIRST);
        assert_eq!(no_hint_wait(u32::MAX), NO_HINT_CAP);
    }

    #[test]
    fn a_hold_grows_with_answers_in_a_row_but_not_with_one_burst() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + secs(s);
        let mut h = Hold::default();
        assert_eq!(h.until(t0), None);
        // Three requests in flight together all come back limited: one strike, one minute.
        assert_eq!(h.limited(Limit::NoHint, at(0), at(1)), at(61));
        assert_eq!(h.limited(Limit::NoHint, at(0), at(1)), at(61));
        assert_eq!(h.strikes, 1);
        // Sent after the hold ended and limited again: two minutes, then four.
        assert_eq!(h.limited(Limit::NoHint, at(61), at(62)), at(182));
        assert_eq!(h.limited(Limit::NoHint, at(182), at(182)), at(422));
        assert_eq!(h.until(at(300)), Some(at(422)));
        assert_eq!(h.until(at(422)), None, "over at its end");
        assert_eq!(h.strikes, 3);
        // Long quiet after the row: the next one starts at a minute again.
        let later = 182 + NO_HINT_CAP.as_secs() + 241;
        assert_eq!(h.limited(Limit::NoHint, at(later), at(later)), at(later + 60));
        assert_eq!(h.strikes, 1);
        // Not quite so long: the row goes on.
        let soon = later + NO_HINT_CAP.as_secs();
        assert_eq!(h.limited(Limit::NoHint, at(soon), at(soon)), at(soon + 120));
        // A hint is obeyed as it is, and never shortens a longer hold.
        let mut h = Hold::default();
        assert_eq!(h.limited(Limit::Hinted(secs(90)), at(0), at(0)), at(90));
        assert_eq!(h.limited(Limit::Hinted(secs(5)), at(0), at(1)), at(90));
        assert_eq!(h.strikes, 0);
    }

    #[test]
    fn times_show_as_utc_clock_readings() {
        assert_eq!(utc_hms(SystemTime::UNIX_EPOCH + secs(NOW as u64)), "22:13:20");
    }

    #[test]
    fn rate_limit_figures_are_read_from_the_headers() {
        let h = headers(&[
            ("x-ratelimit-limit", "5000"),
            ("x-ratelimit-remaining", "4987"),
            ("x-ratelimit-used", "13"),
            ("x-ratelimit-reset", "1700003600"),
            ("x-ratelimit-resource", "core"),
        ]);
        let limit = RateLimit::from_headers("installation 7", &h, NOW).expect("figures");
        assert_eq!(
            limit,
            RateLimit {
                credential: "installation 7".into(),
                resource: "core".into(),
                limit: 5000,
                remaining: 4987,
                used: Some(13),
                reset: 1_700_003_600,
                observed_at: NOW,
            }
        );
        assert_eq!(RateLimit::from_headers("app", &HeaderMap::new(), 0), None, "no figures, nothing kept");
    }
}
