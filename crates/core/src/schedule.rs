//! Schedules: when a cron schedule fires, here and nowhere else.
//!
//! A schedule is a cron expression read in an IANA time zone. The rules, which the
//! coordinator's schedule loop only applies:
//!
//! - **Wall time.** The expression matches wall-clock (civil) times in the schedule's zone:
//!   `0 3 * * *` in `Europe/Berlin` is 03:00 in Berlin whatever the offset that day.
//! - **Every matching wall time fires exactly once.** One that does not exist (a DST gap:
//!   02:30 on the night clocks jump from 02:00 to 03:00) fires once, at the first instant after
//!   the gap (03:00 new time); several of them, and a match at that instant itself, are one
//!   fire. One that occurs twice (a DST fold: 02:30 on the night clocks go back from 03:00 to
//!   02:00) fires once, at its first occurrence. This is uniform for fixed times and for
//!   `*/15`-style intervals (Vixie cron runs intervals twice in a fold; gpuci does not, as
//!   a nightly GPU run twice is never wanted).
//! - **Catch-up.** After downtime at most one missed run fires: [`due`] answers the latest
//!   occurrence at or before now that is after the last one recorded; the others are
//!   reported as skipped, never run.
//! - **Fields.** Five fields (minute hour day-of-month month day-of-week) as Vixie cron reads
//!   them — names (`MON`, `JAN`), ranges, lists, steps, and day-of-month OR day-of-week when
//!   both are restricted — plus croner's `L`, `W` and `#`, the `@yearly`, `@annually`,
//!   `@monthly`, `@weekly`, `@daily` and `@hourly` aliases, and an optional sixth, leading
//!   seconds field (`*/10 * * * * *`). A year field is refused.
//!
//! Parsing the fields is `croner`'s (a maintained, Vixie/OCPS-compatible parser that works on
//! `jiff` values, the time library the core already uses); the search runs in civil time
//! through it, and the time zone rules (gap and fold) are applied here with `jiff`'s bundled
//! tz database, so a schedule means the same on every host.

use croner::parser::{CronParser, Seconds, Year};
use jiff::civil::DateTime;
use jiff::tz::{AmbiguousOffset, TimeZone};
use jiff::Timestamp;
use std::fmt;

/// A parsed cron expression.
#[derive(Clone)]
pub struct Cron {
    text: String,
    inner: croner::Cron,
}

impl fmt::Debug for Cron {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Cron").field(&self.text).finish()
    }
}

impl PartialEq for Cron {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Cron {
    /// Parse an expression (see the module header for what is accepted). The error says what
    /// is wrong in words, without the expression (the caller names it).
    pub fn parse(text: &str) -> Result<Cron, String> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err("expected a cron expression such as \"0 3 * * *\" or \"@daily\"".into());
        }
        if trimmed.len() > 200 || trimmed.chars().any(char::is_control) {
            return Err("expected at most 200 printable characters".into());
        }
        let fields = trimmed.split_whitespace().count();
        if !trimmed.starts_with('@') && !(5..=6).contains(&fields) {
            return Err(format!(
                "expected 5 fields (minute hour day-of-month month day-of-week), or 6 with a leading \
                 seconds field; found {fields}"
            ));
        }
        let parser = CronParser::builder().seconds(Seconds::Optional).year(Year::Disallowed).build();
        let inner = parser.parse(trimmed).map_err(|e| e.to_string())?;
        let cron = Cron { text: trimmed.to_string(), inner };
        // A pattern that can never match (`0 0 30 2 *`) is refused now, not found dead later.
        let probe = Timestamp::UNIX_EPOCH;
        if next_after(&cron, &TimeZone::UTC, probe).is_none() {
            return Err("it never matches a real date".into());
        }
        Ok(cron)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether the expression has a seconds field (fires more often than once a minute).
    pub fn has_seconds(&self) -> bool {
        !self.text.starts_with('@') && self.text.split_whitespace().count() == 6
    }

    /// The next matching wall time strictly after `civil`.
    fn next_civil(&self, civil: DateTime) -> Option<DateTime> {
        // Searched in UTC, where wall time has no gaps or folds: croner sees civil time only.
        let z = civil.to_zoned(TimeZone::UTC).ok()?;
        Some(self.inner.find_next_occurrence(&z, false).ok()?.datetime())
    }
}

/// A time zone by its IANA name, from the tz database compiled into the binary.
pub fn time_zone(name: &str) -> Result<TimeZone, String> {
    jiff::tz::db().get(name).map_err(|_| {
        format!("{name:?} is not a time zone in the tz database; expected an IANA name such as \"Europe/Berlin\" or \"UTC\"")
    })
}

/// The instant a matching wall time fires at (the module header's gap and fold rules).
fn resolve(tz: &TimeZone, civil: DateTime) -> Option<Timestamp> {
    let amb = tz.to_ambiguous_timestamp(civil);
    match amb.offset() {
        AmbiguousOffset::Unambiguous { .. } => amb.compatible().ok(),
        AmbiguousOffset::Fold { .. } => amb.earlier().ok(),
        AmbiguousOffset::Gap { after, .. } => {
            // Read with the offset after the gap, the wall time lies before the transition:
            // the transition that follows it is where the gap ends.
            let before_gap = after.to_timestamp(civil).ok()?;
            match tz.following(before_gap).next() {
                Some(t) => Some(t.timestamp()),
                None => amb.later().ok(),
            }
        }
    }
}

/// How many matching wall times one search may pass over before it gives up: a fold is at
/// most a few hours, so even `* * * * * *` passes over fewer.
const MAX_STEPS: usize = 20_000;

/// The first instant strictly after `after` at which the schedule fires; `None` when it
/// never fires again (or not before the year 9999).
pub fn next_after(cron: &Cron, tz: &TimeZone, after: Timestamp) -> Option<Timestamp> {
    let mut civil = tz.to_datetime(after);
    for _ in 0..MAX_STEPS {
        let c = cron.next_civil(civil)?;
        let t = resolve(tz, c)?;
        // In a fold, or after a gap's fire, a matching wall time can resolve to an instant
        // already passed: it fired then, once; the search goes on in wall time.
        if t > after {
            return Some(t);
        }
        civil = c;
    }
    None
}

/// The next `n` fire instants after `after`.
pub fn upcoming(cron: &Cron, tz: &TimeZone, after: Timestamp, n: usize) -> Vec<Timestamp> {
    let mut out = Vec::with_capacity(n);
    let mut at = after;
    while out.len() < n {
        match next_after(cron, tz, at) {
            Some(t) => {
                out.push(t);
                at = t;
            }
            None => break,
        }
    }
    out
}

/// What the schedule loop does for one schedule now: [`due`]'s answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Due {
    /// Fire now, for this occurrence (the latest at or before now that was not fired yet).
    pub fire: Option<Timestamp>,
    /// When `fire` is a catch-up that passed over earlier missed occurrences: the first of
    /// them (none of them runs).
    pub skipped_from: Option<Timestamp>,
    /// The first occurrence after now: when to look again.
    pub next: Option<Timestamp>,
}

/// Decide whether a schedule fires now. `since`: the occurrence last fired, or, when none
/// was, the instant the schedule was first seen (occurrences before it are never owed).
/// At most one occurrence fires however long the coordinator was down (the latest).
pub fn due(cron: &Cron, tz: &TimeZone, now: Timestamp, since: Timestamp) -> Due {
    let next_after_now = next_after(cron, tz, now);
    let first = match next_after(cron, tz, since) {
        Some(f) if f <= now => f,
        _ => return Due { fire: None, skipped_from: None, next: next_after_now },
    };
    // The latest occurrence at or before now: searched from a window just wide enough that
    // it holds one, so a long downtime with a frequent schedule costs few steps.
    const WINDOWS: [i64; 6] = [60, 3_600, 86_400, 32 * 86_400, 367 * 86_400, 9 * 366 * 86_400];
    let mut latest = first;
    for w in WINDOWS {
        let from = now.as_second().saturating_sub(w);
        let Ok(from) = Timestamp::from_second(from) else { continue };
        let from = from.max(since);
        if next_after(cron, tz, from).is_some_and(|t| t <= now) {
            let mut at = from;
            while let Some(t) = next_after(cron, tz, at).filter(|t| *t <= now) {
                latest = t;
                at = t;
            }
            break;
        }
    }
    let latest = latest.max(first);
    Due { fire: Some(latest), skipped_from: (latest != first).then_some(first), next: next_after_now }
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
mod tests;
