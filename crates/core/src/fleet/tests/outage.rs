//! Idle machines through a capacity outage of the fleet's offers ([`crate::fleet::idle`]): a
//! machine let go then cannot be had again until the outage ends.

use super::*;

/// The defaults on one offer (the sample week's `h100x2` has one).
fn one_offer() -> FleetSpec {
    let mut f = stopping("t4");
    f.offers.truncate(1);
    f
}

fn in_outage(since: UnixSecs, last: UnixSecs) -> FleetHistory {
    let mut h = FleetHistory::default();
    h.refused(0, Capacity::OnDemand, since);
    h.refused(0, Capacity::OnDemand, last);
    h
}

/// No job in the last hour: idle → stop after half of stop 30 s + start 45 s = 75 s (38 s).
/// In an outage met 5 minutes ago the next job would wait the outage's rest too (as long again
/// as it has lasted: 300 s), so B = 375 s and the machine is kept 188 s.
#[test]
fn an_idle_running_machine_is_kept_while_its_only_offer_is_in_an_outage() {
    let mut w = World::new(vec![one_offer()]);
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW - 61)];
    assert_eq!(short(&w.decide()), ["stop m-1"], "no outage: the usual hold (38 s)");

    w.history.insert("t4".into(), in_outage(NOW - 300, NOW - 20));
    let d = w.decide();
    assert!(short(&d).is_empty(), "kept through the outage: {:?}", short(&d));
    assert!(d.fleets[0].rules[0].starts_with("idle → stop after 3m08s"), "{}", d.fleets[0].rules[0]);
    assert!(d.fleets[0].rules[0].contains("capacity outage of its offers (5m00s so far"), "{}", d.fleets[0].rules[0]);
    w.machines[0].since = NOW - 187;
    assert!(short(&w.decide()).is_empty());
    w.machines[0].since = NOW - 188;
    assert_eq!(short(&w.decide()), ["stop m-1"], "a hold, not forever");

    // The offer took a create or a start again: the outage is over, the usual hold.
    w.machines[0].since = NOW - 61;
    w.history.get_mut("t4").unwrap().took(0, Capacity::OnDemand, NOW - 10);
    assert_eq!(short(&w.decide()), ["stop m-1"]);

    // Not refused again for FORGET_AFTER_S: taken as over, as the back-off forgets it.
    let quiet = NOW - crate::fleet::backoff::FORGET_AFTER_S;
    w.history.insert("t4".into(), in_outage(quiet - 600, quiet));
    assert_eq!(short(&w.decide()), ["stop m-1"]);
}

/// An outage of one offer while the fleet has another: a machine let go can be had again
/// from the other, so the usual hold.
#[test]
fn an_outage_of_one_offer_of_two_changes_nothing() {
    let mut w = World::new(vec![stopping("t4")]);
    w.machines = vec![machine("m-1", "t4", MachineState::Idle, NOW - 61)];
    w.history.insert("t4".into(), in_outage(NOW - 300, NOW - 20));
    assert_eq!(short(&w.decide()), ["stop m-1"]);
    // Both offers out: kept.
    w.history.get_mut("t4").unwrap().refused(1, Capacity::OnDemand, NOW - 100);
    assert!(short(&w.decide()).is_empty());
}

/// The outages a fleet met are plain data: a refusal opens one, further refusals extend it, a
/// success closes it, and a week after it is forgotten.
#[test]
fn outages_are_opened_by_refusals_and_closed_by_a_success() {
    let mut h = FleetHistory::default();
    h.refused(0, Capacity::OnDemand, NOW);
    h.refused(0, Capacity::OnDemand, NOW + 15);
    assert_eq!(
        h.outages,
        [OutageSeen { offer: 0, capacity: Capacity::OnDemand, since: NOW, last: NOW + 15, over: None }]
    );
    assert_eq!(h.outage_since(&one_offer(), NOW + 20), Some(NOW));
    h.took(0, Capacity::OnDemand, NOW + 900);
    assert_eq!(h.outage_since(&one_offer(), NOW + 901), None);
    h.refused(0, Capacity::OnDemand, NOW + 1000);
    assert_eq!(h.outages.len(), 2, "a new outage");
    h.trim(NOW + 900 + crate::fleet::idle::OUTAGES_KEPT_S + 1, 86_400);
    assert_eq!(h.outages.len(), 1, "the first forgotten a week after it ended");
}
