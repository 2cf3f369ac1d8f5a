use super::*;

fn cron(s: &str) -> Cron {
    Cron::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn tz(name: &str) -> TimeZone {
    time_zone(name).expect("bundled tz")
}

/// An instant from an RFC 3339 string with offset.
fn at(s: &str) -> Timestamp {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// The next `n` fires after `from`, as wall times with their offset in `zone`.
fn fires(expr: &str, zone: &str, from: &str, n: usize) -> Vec<String> {
    let z = tz(zone);
    upcoming(&cron(expr), &z, at(from), n)
        .into_iter()
        .map(|t| t.to_zoned(z.clone()).strftime("%Y-%m-%d %H:%M:%S%:z").to_string())
        .collect()
}

#[test]
fn every_fifteen_minutes() {
    assert_eq!(
        fires("*/15 * * * *", "UTC", "2026-05-01T10:07:00Z", 4),
        [
            "2026-05-01 10:15:00+00:00",
            "2026-05-01 10:30:00+00:00",
            "2026-05-01 10:45:00+00:00",
            "2026-05-01 11:00:00+00:00"
        ]
    );
    // Strictly after: an instant that is an occurrence is not its own next.
    assert_eq!(fires("*/15 * * * *", "UTC", "2026-05-01T10:15:00Z", 1), ["2026-05-01 10:30:00+00:00"]);
}

#[test]
fn ranges_lists_and_names() {
    // 09:00 and 13:00 and 17:00 on weekdays (2026-05-01 is a Friday).
    assert_eq!(
        fires("0 9-17/4 * * MON-FRI", "UTC", "2026-05-01T12:00:00Z", 3),
        ["2026-05-01 13:00:00+00:00", "2026-05-01 17:00:00+00:00", "2026-05-04 09:00:00+00:00"]
    );
    assert_eq!(
        fires("5 8,20 * * *", "UTC", "2026-05-01T12:00:00Z", 3),
        ["2026-05-01 20:05:00+00:00", "2026-05-02 08:05:00+00:00", "2026-05-02 20:05:00+00:00"]
    );
    // Vixie cron: day-of-month OR day-of-week when both are restricted (the 13th, or Fridays).
    assert_eq!(
        fires("0 0 13 * FRI", "UTC", "2026-05-01T12:00:00Z", 3),
        ["2026-05-08 00:00:00+00:00", "2026-05-13 00:00:00+00:00", "2026-05-15 00:00:00+00:00"]
    );
}

#[test]
fn month_ends_skip_short_months() {
    assert_eq!(
        fires("0 0 31 * *", "UTC", "2026-01-31T00:00:00Z", 3),
        ["2026-03-31 00:00:00+00:00", "2026-05-31 00:00:00+00:00", "2026-07-31 00:00:00+00:00"]
    );
    // `L`: the last day of each month, February included.
    assert_eq!(
        fires("0 0 L * *", "UTC", "2026-01-31T00:00:00Z", 2),
        ["2026-02-28 00:00:00+00:00", "2026-03-31 00:00:00+00:00"]
    );
}

#[test]
fn february_29_waits_for_a_leap_year() {
    assert_eq!(
        fires("0 12 29 2 *", "UTC", "2025-03-01T00:00:00Z", 2),
        ["2028-02-29 12:00:00+00:00", "2032-02-29 12:00:00+00:00"]
    );
    let c = cron("0 12 29 2 *");
    let d = due(&c, &TimeZone::UTC, at("2029-01-01T00:00:00Z"), at("2027-01-01T00:00:00Z"));
    assert_eq!(d.fire, Some(at("2028-02-29T12:00:00Z")), "one leap day missed: it fires once");
    assert_eq!(d.next, Some(at("2032-02-29T12:00:00Z")));
}

#[test]
fn a_wall_time_in_a_dst_gap_fires_once_at_the_end_of_the_gap() {
    // Berlin, 2026-03-29: 02:00 CET becomes 03:00 CEST; 02:30 does not exist.
    assert_eq!(
        fires("30 2 * * *", "Europe/Berlin", "2026-03-28T12:00:00Z", 3),
        ["2026-03-29 03:00:00+02:00", "2026-03-30 02:30:00+02:00", "2026-03-31 02:30:00+02:00"]
    );
    // Four wall times in the gap and 03:00 itself: one fire at 03:00.
    assert_eq!(
        fires("*/15 * * * *", "Europe/Berlin", "2026-03-29T00:40:00Z", 4),
        [
            "2026-03-29 01:45:00+01:00",
            "2026-03-29 03:00:00+02:00",
            "2026-03-29 03:15:00+02:00",
            "2026-03-29 03:30:00+02:00"
        ]
    );
    // Every minute of the gap hour: one fire when it ends.
    assert_eq!(
        fires("* 2 * * *", "Europe/Berlin", "2026-03-29T00:00:00Z", 2),
        ["2026-03-29 03:00:00+02:00", "2026-03-30 02:00:00+02:00"]
    );
    // New York, 2026-03-08: 02:00 EST becomes 03:00 EDT.
    assert_eq!(fires("0 2 * * *", "America/New_York", "2026-03-07T12:00:00Z", 1), ["2026-03-08 03:00:00-04:00"]);
}

#[test]
fn a_wall_time_that_occurs_twice_fires_once_at_its_first_occurrence() {
    // Berlin, 2026-10-25: 03:00 CEST becomes 02:00 CET; 02:00-02:59 happen twice.
    assert_eq!(
        fires("30 2 * * *", "Europe/Berlin", "2026-10-24T12:00:00Z", 2),
        ["2026-10-25 02:30:00+02:00", "2026-10-26 02:30:00+01:00"]
    );
    assert_eq!(
        fires("*/30 * * * *", "Europe/Berlin", "2026-10-24T23:10:00Z", 5),
        [
            "2026-10-25 01:30:00+02:00",
            "2026-10-25 02:00:00+02:00",
            "2026-10-25 02:30:00+02:00",
            // 02:00 and 02:30 CET are the second pass of wall times that fired already.
            "2026-10-25 03:00:00+01:00",
            "2026-10-25 03:30:00+01:00",
        ]
    );
    // Asked during the second pass, the next fire is after the fold.
    let z = tz("Europe/Berlin");
    let second_pass = at("2026-10-25T02:10:00+01:00");
    assert_eq!(next_after(&cron("*/30 * * * *"), &z, second_pass), Some(at("2026-10-25T03:00:00+01:00")));
}

#[test]
fn seconds_field_and_aliases() {
    assert_eq!(
        fires("*/20 * * * * *", "UTC", "2026-05-01T10:00:05Z", 3),
        ["2026-05-01 10:00:20+00:00", "2026-05-01 10:00:40+00:00", "2026-05-01 10:01:00+00:00"]
    );
    assert!(cron("*/20 * * * * *").has_seconds());
    assert!(!cron("@daily").has_seconds());
    assert_eq!(fires("@daily", "Asia/Tokyo", "2026-05-01T10:00:00Z", 1), ["2026-05-02 00:00:00+09:00"]);
    assert_eq!(fires("@weekly", "UTC", "2026-05-01T10:00:00Z", 1), ["2026-05-03 00:00:00+00:00"]);
}

#[test]
fn bad_expressions_are_refused_with_the_reason() {
    for (expr, want) in [
        ("", "expected a cron expression"),
        ("* * * *", "expected 5 fields"),
        ("0 0 1 1 * 2030 x", "found 7"),
        ("61 * * * *", ""),
        ("0 0 30 2 *", "never matches"),
        ("0 0 * * FUNDAY", ""),
        ("@fortnightly", ""),
    ] {
        let e = Cron::parse(expr).expect_err(expr);
        assert!(e.contains(want), "{expr}: {e}");
    }
    assert!(time_zone("Mars/Olympus").unwrap_err().contains("IANA name"));
}

#[test]
fn due_fires_at_most_one_missed_run_and_never_before_since() {
    let c = cron("0 * * * *");
    let utc = TimeZone::UTC;
    // Not due yet.
    let d = due(&c, &utc, at("2026-05-01T10:30:00Z"), at("2026-05-01T10:00:00Z"));
    assert_eq!(d, Due { fire: None, skipped_from: None, next: Some(at("2026-05-01T11:00:00Z")) });
    // Due exactly now.
    let d = due(&c, &utc, at("2026-05-01T11:00:00Z"), at("2026-05-01T10:00:00Z"));
    assert_eq!(d.fire, Some(at("2026-05-01T11:00:00Z")));
    assert_eq!(d.skipped_from, None);
    assert_eq!(d.next, Some(at("2026-05-01T12:00:00Z")));
    // Down from 10:30 to 14:20: 11:00, 12:00, 13:00, 14:00 were missed; only 14:00 runs.
    let d = due(&c, &utc, at("2026-05-01T14:20:00Z"), at("2026-05-01T10:00:00Z"));
    assert_eq!(d.fire, Some(at("2026-05-01T14:00:00Z")));
    assert_eq!(d.skipped_from, Some(at("2026-05-01T11:00:00Z")));
    // Once 14:00 is recorded, nothing more until 15:00: a restart does not fire again.
    let d = due(&c, &utc, at("2026-05-01T14:20:00Z"), at("2026-05-01T14:00:00Z"));
    assert_eq!(d.fire, None);
    // A schedule first seen at 10:30 owes nothing from before.
    let d = due(&c, &utc, at("2026-05-01T10:45:00Z"), at("2026-05-01T10:30:00Z"));
    assert_eq!(d.fire, None);
    // A long downtime with a frequent schedule: the latest second.
    let s = cron("* * * * * *");
    let d = due(&s, &utc, at("2026-05-09T00:00:00.5Z"), at("2026-05-01T00:00:00Z"));
    assert_eq!(d.fire, Some(at("2026-05-09T00:00:00Z")));
    assert_eq!(d.skipped_from, Some(at("2026-05-01T00:00:01Z")));
}

#[test]
fn due_across_a_fold_fires_each_wall_time_once() {
    let c = cron("30 2 * * *");
    let z = tz("Europe/Berlin");
    // Fired at 02:30 CEST; now it is 02:45 CET (the second pass): nothing is due.
    let d = due(&c, &z, at("2026-10-25T02:45:00+01:00"), at("2026-10-25T02:30:00+02:00"));
    assert_eq!(d.fire, None);
    assert_eq!(d.next, Some(at("2026-10-26T02:30:00+01:00")));
}
