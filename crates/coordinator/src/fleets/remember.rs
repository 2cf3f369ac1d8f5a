//! What the fleets' loop learns of its offers and must not forget on a restart or a takeover:
//! each offer's errors in a row ([`gpuci_core::fleet::Backoffs`]) and the skips in force
//! ([`UnavailableOffer`]). Without it a coordinator restarted during a capacity outage asked
//! every refusing offer again at once and started each from its first, shortest skip. Kept in
//! the store (`coordinator_state`, name [`NAME`]) after a pass that changed it, read when the
//! loop starts. A document that does not read (another version's, damaged) is logged and
//! ignored: the back-off then starts afresh, as it did before it was kept.

use super::Loop;
use gpuci_core::fleet::{Backoffs, UnavailableOffer};
use serde::{Deserialize, Serialize};

/// The document's name in `coordinator_state`.
pub const NAME: &str = "fleets.backoff";

/// What is kept.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Remembered {
    pub backoffs: Backoffs,
    pub unavailable: Vec<UnavailableOffer>,
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
                tracing::info!(
                    offers = self.backoffs.offers.len(),
                    skipped = self.unavailable.len(),
                    "fleets: offers' back-off taken back"
                );
                self.kept_backoffs = text;
            }
            Err(e) => tracing::warn!(error = %e, "fleets: the kept offers' back-off does not read; starting afresh"),
        }
    }

    /// Keeps the back-off when it changed since it was last kept.
    pub(super) async fn keep_backoffs(&mut self) {
        let now = Remembered { backoffs: self.backoffs.clone(), unavailable: self.unavailable.clone() };
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
    use gpuci_core::fleet::{offer_unavailable_after_error, Capacity};

    #[test]
    fn what_is_kept_reads_back_as_it_was() {
        let mut r = Remembered::default();
        let u = r.backoffs.error(offer_unavailable_after_error("h100", 0, Capacity::Spot, 1_000), 1_000);
        r.unavailable.push(u);
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Remembered>(&text).unwrap(), r);
    }
}
