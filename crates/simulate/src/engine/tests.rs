//! Tests of the engine's own pieces (whole runs are tested in `tests/`).

use super::*;

#[test]
fn outages_come_at_their_rate_last_their_length_and_repeat_for_a_seed() {
    // 24 a day of 10 minutes: up 3600 s on average, then down 600 s → down 1/7 of the time.
    let length = Dist::Fixed { s: 600.0 };
    let mut o = Outages::new(Rng::new(3), 24.0, length, 0, Vec::new());
    let samples = 200 * 1440; // every minute of 200 days
    let down = (0..samples).filter(|&m| o.out_at(m * 60)).count() as f64 / samples as f64;
    assert!((down - 1.0 / 7.0).abs() < 0.01, "{down}");
    let mut a = Outages::new(Rng::new(9), 24.0, length, 0, Vec::new());
    let mut b = Outages::new(Rng::new(9), 24.0, length, 0, Vec::new());
    assert!((0..10_000).all(|t| a.out_at(t * 7) == b.out_at(t * 7)));
    // No rate: only the known windows, `[from, to)`.
    let mut w = Outages::new(Rng::new(1), 0.0, length, 0, vec![(100, 200)]);
    assert_eq!([99, 100, 199, 200, 1_000_000].map(|t| w.out_at(t)), [false, true, true, false, false]);
}
