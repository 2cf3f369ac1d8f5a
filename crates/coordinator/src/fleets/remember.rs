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
//!
//! Entries name an offer by its place in the fleet's offers; the document also keeps each
//! fleet's offers as they were then (instance type and zone), so a config whose offers were
//! reordered, added or removed before a restart puts each skip back on the same offer, and
//! drops those of offers gone ([`Remembered::rekey`]). A document kept before the offers were
//! (no list for a fleet) is read by place, as before, where the place still exists.

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
    /// Each fleet's offers when this was kept, in order: what the entries' offer numbers
    /// name. Absent from a document kept before they were (numbers then read as they are).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub offers: BTreeMap<String, Vec<OfferKey>>,
}

/// An offer's identity: what the provider is asked for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferKey {
    pub instance_type: String,
    pub zone: String,
}

impl OfferKey {
    fn of(o: &gpuci_core::fleet::Offer) -> Self {
        OfferKey { instance_type: o.instance_type.clone(), zone: o.zone.clone() }
    }
}

impl Remembered {
    /// Puts each entry on the offer it was kept for in `fleets` (the config now): by identity
    /// where the document lists its fleet's offers, else by place while the place exists;
    /// entries of an offer or a fleet no longer configured are dropped.
    pub fn rekey(&mut self, fleets: &[gpuci_core::fleet::FleetSpec]) {
        let offers = std::mem::take(&mut self.offers);
        let place = |fleet: &str, at: usize| -> Option<usize> {
            let spec = fleets.iter().find(|f| f.name == fleet)?;
            match offers.get(fleet) {
                Some(kept) => {
                    let key = kept.get(at)?;
                    spec.offers.iter().position(|o| OfferKey::of(o) == *key)
                }
                None => (at < spec.offers.len()).then_some(at),
            }
        };
        self.backoffs.offers.retain_mut(|b| place(&b.fleet, b.offer).map(|at| b.offer = at).is_some());
        self.unavailable.retain_mut(|u| place(&u.fleet, u.offer).map(|at| u.offer = at).is_some());
        for (fleet, outages) in self.outages.iter_mut() {
            outages.retain_mut(|o| place(fleet, o.offer).map(|at| o.offer = at).is_some());
        }
        self.outages.retain(|_, o| !o.is_empty());
    }

    /// The offers of `fleets`, as [`Remembered::offers`] keeps them.
    pub fn offers_of(fleets: &[gpuci_core::fleet::FleetSpec]) -> BTreeMap<String, Vec<OfferKey>> {
        fleets.iter().map(|f| (f.name.clone(), f.offers.iter().map(OfferKey::of).collect())).collect()
    }
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
            Ok(mut r) => {
                let specs: Vec<gpuci_core::fleet::FleetSpec> = self.fleets.iter().map(|f| f.spec.clone()).collect();
                r.rekey(&specs);
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
                // Kept again (by the offers now) at the next change.
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
        let specs: Vec<gpuci_core::fleet::FleetSpec> = self.fleets.iter().map(|f| f.spec.clone()).collect();
        let now = Remembered {
            backoffs: self.backoffs.clone(),
            unavailable: self.unavailable.clone(),
            outages,
            offers: Remembered::offers_of(&specs),
        };
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

    fn fleet(offers: &[(&str, &str)]) -> gpuci_core::fleet::FleetSpec {
        let mut toml = String::from("[[fleet]]\nname = \"ex\"\nprovider = \"exec\"\nmax = 2\n[fleet.machine]\ngpu_model = \"NVIDIA L4\"\ngpus = 1\ngpu_memory = \"22GiB\"\ncpus = 8\nmemory = \"32GiB\"\n");
        for (t, z) in offers {
            toml.push_str(&format!("[[fleet.offer]]\ninstance_type = \"{t}\"\nzone = \"{z}\"\nprice_per_hour = 1.0\n"));
        }
        toml.push_str("[fleet.settings]\ncommand = [\"x\"]\n");
        gpuci_core::fleet::parse_fleets("server.toml", &toml).unwrap().remove(0)
    }

    /// Offers reordered (and one added) before a restart: each skip comes back on the offer it
    /// was kept for, not on whatever offer now has its place; a removed offer's is dropped.
    #[test]
    fn a_skip_comes_back_on_its_offer_after_the_offers_are_reordered() {
        let before = [fleet(&[("typeA", "z1"), ("typeB", "z1"), ("typeC", "z1")])];
        let mut r = Remembered::default();
        // typeA failed its boot (a long skip); typeC is gone from the new config.
        let a = offer_unavailable_after_error("ex", 0, Capacity::OnDemand, 1_000)
            .because(gpuci_core::fleet::SkipCause::BootFailed, "no agent");
        r.unavailable.push(r.backoffs.error(a, 1_000));
        let c = offer_unavailable_after_error("ex", 2, Capacity::OnDemand, 1_000);
        r.unavailable.push(r.backoffs.error(c, 1_000));
        r.offers = Remembered::offers_of(&before);
        let text = serde_json::to_string(&r).unwrap();
        let after = [fleet(&[("typeD", "z1"), ("typeB", "z1"), ("typeA", "z1")])];
        let mut back: Remembered = serde_json::from_str(&text).unwrap();
        back.rekey(&after);
        let skipped: Vec<usize> = back.unavailable.iter().map(|u| u.offer).collect();
        assert_eq!(skipped, [2], "typeA is now the third offer; typeC's skip is dropped");
        assert_eq!(back.backoffs.streak("ex", 2, Capacity::OnDemand), 1);
        assert_eq!(back.backoffs.streak("ex", 0, Capacity::OnDemand), 0, "typeD was never refused");
        // An older document (no offers kept) is read by place, where the place exists.
        let mut old = r;
        old.offers.clear();
        old.rekey(&[fleet(&[("typeB", "z1"), ("typeA", "z1")])]);
        assert_eq!(old.unavailable.iter().map(|u| u.offer).collect::<Vec<_>>(), [0]);
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
