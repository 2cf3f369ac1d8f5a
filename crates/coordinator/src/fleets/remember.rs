//! What the fleets' loop learns of its offers and must not forget on a restart or a takeover:
//! each offer's errors in a row ([`gpuci_core::fleet::Backoffs`]), the skips in force
//! ([`UnavailableOffer`]) and the capacity outages each fleet has met
//! ([`gpuci_core::fleet::FleetHistory::outages`], which keep idle machines through an outage of
//! every offer). Without it a coordinator restarted during a capacity outage asked every
//! refusing offer again at once, started each from its first, shortest skip, and let idle
//! machines go as if the outage had not been met (it is met again only once a job waits). Kept in
//! the store (`coordinator_state`, name [`NAME`]) after a pass that changed it, read when the
//! loop starts. A document that does not read (another version's, damaged) is logged and
//! ignored: the back-off then starts afresh, as it did before it was kept.

use super::Loop;
use gpuci_core::fleet::{Backoffs, OutageSeen, UnavailableOffer};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The document's name in `coordinator_state`.
pub const NAME: &str = "fleets.backoff";

/// What is kept.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Remembered {
    pub backoffs: Backoffs,
    pub unavailable: Vec<UnavailableOffer>,
    /// Each fleet's outages (by fleet name), as `FleetHistory::outages`. Absent from a
    /// document kept before they were (read as none).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub outages: BTreeMap<String, Vec<OutageSeen>>,
}

impl Loop {
    /// Takes back what an earlier coordinator (this one before a restart, or the former
    /// leader) kept.
    pub(super) async fn recall_backoffs(&mut self) {
        let text = match self.deps.store.coordinator_state(NAME).await {
            Ok(Some(t)) => t,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "fleets: cannot read the offers' back-off kept by the last coordinator; starting afresh");
                return;
            }
        };
        match serde_json::from_str::<Remembered>(&text) {
            Ok(r) => {
                let now = super::now_s();
                self.unavailable = r.unavailable.into_iter().filter(|u| u.until > now).collect();
                self.backoffs = r.backoffs;
                self.backoffs.forget(now);
                for (fleet, outages) in r.outages {
                    let h = self.history.entry(fleet).or_default();
                    h.outages = outages;
                    h.trim(now, gpuci_core::fleet::idle::STOPPED_WINDOW_S);
                }
                tracing::info!(
                    offers = self.backoffs.offers.len(),
                    skipped = self.unavailable.len(),
                    outages = self.history.values().map(|h| h.outages.len()).sum::<usize>(),
                    "fleets: offers' back-off taken back"
                );
                self.kept_backoffs = text;
            }
            Err(e) => tracing::warn!(error = %e, "fleets: the kept offers' back-off does not read; starting afresh"),
        }
    }

    /// Keeps the back-off when it changed since it was last kept.
    pub(super) async fn keep_backoffs(&mut self) {
        let outages = self
            .history
            .iter()
            .filter(|(_, h)| !h.outages.is_empty())
            .map(|(fleet, h)| (fleet.clone(), h.outages.clone()))
            .collect();
        let now = Remembered { backoffs: self.backoffs.clone(), unavailable: self.unavailable.clone(), outages };
        let Ok(text) = serde_json::to_string(&now) else { return };
        if text == self.kept_backoffs {
            return;
        }
        match self.deps.store.put_coordinator_state(NAME, &text, crate::brain::now_ms()).await {
            Ok(()) => self.kept_backoffs = text,
            // Kept next pass; meanwhile only a restart would lose it.
            Err(e) => tracing::warn!(error = %e, "fleets: cannot keep the offers' back-off"),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a panic is the failure report
mod tests {
    use super::*;
    use gpuci_core::fleet::{offer_unavailable_after_error, Capacity, FleetHistory};

    #[test]
    fn what_is_kept_reads_back_as_it_was() {
        let mut r = Remembered::default();
        let u = r.backoffs.error(offer_unavailable_after_error("h100", 0, Capacity::Spot, 1_000), 1_000);
        r.unavailable.push(u);
        let mut h = FleetHistory::default();
        h.refused(0, Capacity::Spot, 1_000);
        h.refused(0, Capacity::Spot, 1_030);
        r.outages.insert("h100".into(), h.outages);
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Remembered>(&text).unwrap(), r);
    }

    /// A document kept before outages were (an older coordinator's, or the former leader's)
    /// still reads: its back-off is taken back, with no outage.
    #[test]
    fn a_document_kept_before_outages_reads_with_none() {
        let mut r = Remembered::default();
        r.unavailable.push(offer_unavailable_after_error("h100", 0, Capacity::OnDemand, 1_000));
        let old = serde_json::json!({ "backoffs": r.backoffs, "unavailable": r.unavailable }).to_string();
        assert_eq!(serde_json::from_str::<Remembered>(&old).unwrap(), r);
    }
}
