//! Warm schedules: "on weekdays from 08:00 to 19:00 Berlin time keep two machines idle".
//!
//! Pure: the time zone rules come from the tz database compiled into the binary (jiff's
//! bundled copy), never from the host's `/usr/share/zoneinfo`, and the clock is handed in.
//! A window is `[from, to)` in local wall-clock time on the listed days; `to` may be `24:00`.
//! Windows do not cross midnight (write two schedules for a night shift), so a window that a
//! DST change skips simply starts at the first local time that exists.

use super::UnixSecs;
use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::Timestamp;
use serde::{Serialize, Serializer};

/// A set of weekdays, bit 0 = Monday … bit 6 = Sunday.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Days(pub u8);

const DAY_NAMES: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

impl Days {
    /// `mon-fri`, `sat,sun`, `mon,wed-fri`, `daily`.
    pub fn parse(s: &str) -> Option<Days> {
        let s = s.trim().to_ascii_lowercase();
        if s == "daily" || s == "every day" {
            return Some(Days(0x7f));
        }
        let day = |d: &str| DAY_NAMES.iter().position(|n| *n == d.trim());
        let mut bits = 0u8;
        for part in s.split(',') {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (day(a)?, day(b)?);
                    if a > b {
                        return None;
                    }
                    (a..=b).for_each(|d| bits |= 1 << d);
                }
                None => bits |= 1 << day(part)?,
            }
        }
        Some(Days(bits))
    }

    /// Monday = 0.
    pub fn contains(self, monday_index: usize) -> bool {
        monday_index < 7 && self.0 & (1 << monday_index) != 0
    }
}

impl std::fmt::Display for Days {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = (0..7).filter(|&d| self.contains(d)).map(|d| DAY_NAMES[d]).collect();
        f.write_str(&names.join(","))
    }
}

impl Serialize for Days {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A time window in which a fleet keeps more machines idle.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WarmSchedule {
    pub days: Days,
    /// Minutes after local midnight, `from < to <= 24 * 60`.
    pub from_min: u32,
    pub to_min: u32,
    #[serde(serialize_with = "tz_name")]
    pub timezone: TimeZone,
    pub min_idle: u32,
}

fn tz_name<S: Serializer>(tz: &TimeZone, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(tz.iana_name().unwrap_or("UTC"))
}

/// `08:00` → 480; `24:00` is allowed (end of day).
pub(super) fn parse_hhmm(s: &str) -> Option<u32> {
    let (h, m) = s.trim().split_once(':')?;
    if h.is_empty() || h.len() > 2 || m.len() != 2 {
        return None;
    }
    let (h, m): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
    let total = h * 60 + m;
    (m < 60 && total <= 24 * 60).then_some(total)
}

/// A time zone from the bundled database.
pub(super) fn time_zone(name: &str) -> Option<TimeZone> {
    if name.eq_ignore_ascii_case("utc") {
        return Some(TimeZone::UTC);
    }
    jiff::tz::db().get(name).ok()
}

impl WarmSchedule {
    pub fn active_at(&self, now: UnixSecs) -> bool {
        let Some(ts) = timestamp(now) else { return false };
        let local = ts.to_zoned(self.timezone.clone());
        let weekday = local.weekday().to_monday_zero_offset() as usize;
        let minute = u32::from(local.hour().unsigned_abs()) * 60 + u32::from(local.minute().unsigned_abs());
        self.days.contains(weekday) && (self.from_min..self.to_min).contains(&minute)
    }

    /// The first window start or end strictly after `now` (within the next eight days), so a
    /// reconcile loop knows when to look again without polling.
    pub fn next_change_after(&self, now: UnixSecs) -> Option<UnixSecs> {
        let today = timestamp(now)?.to_zoned(self.timezone.clone()).date();
        let mut best: Option<UnixSecs> = None;
        for offset in -1..8i32 {
            let Ok(date) = today.checked_add(jiff::Span::new().days(offset)) else { continue };
            if !self.days.contains(date.weekday().to_monday_zero_offset() as usize) {
                continue;
            }
            for minute in [self.from_min, self.to_min] {
                if let Some(t) = self.local_to_unix(date, minute).filter(|&t| t > now) {
                    best = Some(best.map_or(t, |b| b.min(t)));
                }
            }
        }
        best
    }

    fn local_to_unix(&self, date: Date, minute: u32) -> Option<UnixSecs> {
        // 24:00 is the next day's midnight.
        let (date, minute) = if minute >= 24 * 60 { (date.tomorrow().ok()?, minute - 24 * 60) } else { (date, minute) };
        let dt = date.at((minute / 60) as i8, (minute % 60) as i8, 0, 0);
        let zoned = dt.to_zoned(self.timezone.clone()).ok()?;
        u64::try_from(zoned.timestamp().as_second()).ok()
    }
}

fn timestamp(now: UnixSecs) -> Option<Timestamp> {
    Timestamp::from_second(i64::try_from(now).ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn berlin_weekdays() -> WarmSchedule {
        WarmSchedule {
            days: Days::parse("mon-fri").expect("days"),
            from_min: 8 * 60,
            to_min: 19 * 60,
            timezone: time_zone("Europe/Berlin").expect("bundled tz database has Europe/Berlin"),
            min_idle: 2,
        }
    }

    // 2024-01-01 was a Monday; 07:00 UTC = 08:00 CET.
    const MON_0700_UTC: u64 = 1_704_092_400;

    #[test]
    fn days_parse_ranges_and_lists() {
        assert_eq!(Days::parse("mon-fri"), Some(Days(0b001_1111)));
        assert_eq!(Days::parse("sat,sun"), Some(Days(0b110_0000)));
        assert_eq!(Days::parse("mon,wed-fri").map(|d| d.to_string()), Some("mon,wed,thu,fri".into()));
        assert_eq!(Days::parse("daily"), Some(Days(0x7f)));
        assert_eq!(Days::parse("fri-mon"), None);
        assert_eq!(Days::parse("funday"), None);
    }

    #[test]
    fn hhmm() {
        assert_eq!(parse_hhmm("08:00"), Some(480));
        assert_eq!(parse_hhmm("24:00"), Some(1440));
        assert_eq!(parse_hhmm("24:01"), None);
        assert_eq!(parse_hhmm("8:60"), None);
        assert_eq!(parse_hhmm("0800"), None);
    }

    #[test]
    fn active_in_local_time_across_dst() {
        let w = berlin_weekdays();
        assert!(w.active_at(MON_0700_UTC), "08:00 in Berlin in winter");
        assert!(!w.active_at(MON_0700_UTC - 1));
        assert!(!w.active_at(MON_0700_UTC + 11 * 3600), "19:00 Berlin is the end, exclusive");
        assert!(w.active_at(MON_0700_UTC + 11 * 3600 - 1));
        assert!(!w.active_at(MON_0700_UTC + 5 * 86_400), "Saturday");
        // Monday 2024-07-01 06:00 UTC = 08:00 CEST (summer time).
        assert!(w.active_at(1_719_813_600));
        assert!(!w.active_at(1_719_813_600 - 1));
    }

    #[test]
    fn next_change_is_the_next_edge() {
        let w = berlin_weekdays();
        assert_eq!(w.next_change_after(MON_0700_UTC - 100), Some(MON_0700_UTC));
        assert_eq!(w.next_change_after(MON_0700_UTC), Some(MON_0700_UTC + 11 * 3600));
        // Friday 19:00 → Monday 08:00.
        let fri_end = MON_0700_UTC + 4 * 86_400 + 11 * 3600;
        assert_eq!(w.next_change_after(fri_end), Some(MON_0700_UTC + 7 * 86_400));
    }

    #[test]
    fn unknown_zone_is_none() {
        assert!(time_zone("Mars/Olympus_Mons").is_none());
        assert!(time_zone("America/New_York").is_some());
    }
}
