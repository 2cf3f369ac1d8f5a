//! Offers skipped for a while, why, and what the fleet and its waiting jobs say about it.
//!
//! An offer (with its capacity type) is skipped for a while after one of three things, because
//! asked again at once it would most likely fail again, and each try may be paid for (how long:
//! the offer's back-off, learned from its own errors in a row, [`super::backoff`]; a skip made
//! here without that state, [`offer_unavailable_after_error`], lasts
//! [`CAPACITY_ERROR_BACKOFF_S`]):
//! - **Capacity**: the provider has no capacity for it now, or an account quota is reached
//!   (`InsufficientInstanceCapacity`, a Kubernetes ResourceQuota, a host with no free GPU);
//! - **Refused**: the platform refuses what the fleet asks for (a Kubernetes admission or Pod
//!   Security policy, a RuntimeClass the cluster lacks): a person must change the fleet or the
//!   cluster, and the platform's words say what;
//! - **Boot failure**: a machine of it was made but did not come up (its agent did not connect
//!   within `boot_timeout`, or it ended before its agent connected: an image the kubelet cannot
//!   pull, an agent that exits at start).
//!
//! [`no_offer_reason`] words a fleet that can make no machine because every offer it may use
//! is skipped, here and nowhere else: which of these happened, the provider's own message, and
//! when the fleet tries again. It once said "every offer had a capacity error" of all three,
//! which sent people looking for capacity when the cluster had refused the pod.

use super::{secs, Capacity, FleetSpec, ProviderKind, UnixSecs};
use serde::{Deserialize, Serialize};

/// How long a skip made by [`offer_unavailable_after_error`] lasts: the back-off's first fault
/// skip (and its longest capacity skip until issue 28, session 5: [`super::backoff`]). Callers
/// that keep the offers' back-off ([`super::Backoffs::error`]) replace it with the learned one.
pub const CAPACITY_ERROR_BACKOFF_S: u64 = 10 * 60;

/// At most this many characters of a provider's message go into a reason (a Pod Security
/// refusal lists every violation; a job's reason is one line in a table).
pub const MAX_WORDS: usize = 400;

/// Why an offer is skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipCause {
    /// No capacity for it now, or an account quota.
    Capacity,
    /// The platform refuses what the fleet asks for.
    Refused,
    /// A machine of it was made and did not come up.
    BootFailed,
}

/// An offer skipped until `until`, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnavailableOffer {
    pub fleet: String,
    pub offer: usize,
    pub capacity: Capacity,
    pub until: UnixSecs,
    pub cause: SkipCause,
    /// What the provider said (one line; may be empty).
    pub message: String,
}

impl UnavailableOffer {
    /// The same skip, for `cause`, with the provider's words.
    pub fn because(self, cause: SkipCause, message: impl Into<String>) -> UnavailableOffer {
        UnavailableOffer { cause, message: message.into(), ..self }
    }
}

/// A capacity error from the provider for (`offer`, `capacity`): skip it for
/// [`CAPACITY_ERROR_BACKOFF_S`] (the coordinator and the simulator pass it through
/// [`super::Backoffs::error`], which sets the offer's learned skip). Another cause, and the
/// provider's words, with [`UnavailableOffer::because`].
pub fn offer_unavailable_after_error(fleet: &str, offer: usize, capacity: Capacity, now: UnixSecs) -> UnavailableOffer {
    UnavailableOffer {
        fleet: fleet.to_string(),
        offer,
        capacity,
        until: now + CAPACITY_ERROR_BACKOFF_S,
        cause: SkipCause::Capacity,
        message: String::new(),
    }
}

/// Why fleet `spec` can make no machine now, every offer it may use being skipped: `skipped`
/// holds, for each offer and capacity type it would try, the skip that holds it back longest
/// (the caller's choice of which offers count: the capacity policy and the spot breaker).
///
/// One cause for all: said once, with the provider's latest words for it (the refusal or
/// failure of the skip that ends last, the first given on a tie). Several causes: each with its
/// offers. Always ends with when the first offer comes back.
pub fn no_offer_reason(spec: &FleetSpec, skipped: &[UnavailableOffer], now: UnixSecs) -> String {
    let Some(back) = skipped.iter().map(|u| u.until).min() else {
        return format!("fleet {}: no offer can be used", spec.name);
    };
    let again = format!("trying again in {}", secs(back.saturating_sub(now)));
    let mut causes: Vec<SkipCause> = skipped.iter().map(|u| u.cause).collect();
    causes.sort_unstable();
    causes.dedup();
    let latest_words = |cause: SkipCause| {
        skipped
            .iter()
            .filter(|u| u.cause == cause && !u.message.trim().is_empty())
            .fold(None::<&UnavailableOffer>, |best, u| match best {
                Some(b) if b.until >= u.until => Some(b),
                _ => Some(u),
            })
            .map(|u| one_line(&u.message))
    };
    let what = |cause: SkipCause| match cause {
        SkipCause::Capacity => "a capacity error".to_string(),
        SkipCause::Refused => refusal(spec.provider).to_string(),
        SkipCause::BootFailed => "a new machine did not come up".to_string(),
    };
    if let [cause] = causes[..] {
        let said = latest_words(cause);
        return match (cause, said) {
            (SkipCause::Capacity, None) => format!("fleet {}: every offer had a capacity error; {again}", spec.name),
            (SkipCause::Capacity, Some(m)) => {
                format!("fleet {}: every offer had a capacity error (the latest: {m}); {again}", spec.name)
            }
            (c, None) => format!("fleet {}: {}; {again}", spec.name, what(c)),
            (c, Some(m)) => format!("fleet {}: {}: {m}; {again}", spec.name, what(c)),
        };
    }
    let parts: Vec<String> = causes
        .iter()
        .map(|&cause| {
            let offers: Vec<String> = skipped
                .iter()
                .filter(|u| u.cause == cause)
                .map(|u| {
                    let label = spec.offers.get(u.offer).map_or_else(|| format!("offer {}", u.offer), |o| o.label());
                    format!("{label} ({})", u.capacity)
                })
                .collect();
            match latest_words(cause) {
                Some(m) => format!("{} for {}: {m}", what(cause), offers.join(", ")),
                None => format!("{} for {}", what(cause), offers.join(", ")),
            }
        })
        .collect();
    format!("fleet {}: no offer can be used now: {}; {again}", spec.name, parts.join("; "))
}

/// A provider's message as a reason says it: one line, at most [`MAX_WORDS`] characters.
fn one_line(message: &str) -> String {
    let line: String = message.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(MAX_WORDS) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line,
    }
}

/// Who refused what, as the fleet's provider would be spoken of.
fn refusal(provider: ProviderKind) -> &'static str {
    match provider {
        ProviderKind::Kubernetes => "the cluster refused the pod",
        ProviderKind::Slurm => "Slurm refused the allocation",
        ProviderKind::Aws => "EC2 refused the instance",
        ProviderKind::Exec | ProviderKind::Local => "the provider refused the machine",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{CapacityPolicy, IdleAction, MachineSpec, Offer, SpotBreaker};

    const NOW: UnixSecs = 1_704_103_200;

    fn fleet(provider: ProviderKind) -> FleetSpec {
        let offer = |zone: &str| Offer {
            instance_type: "g4dn.xlarge".into(),
            zone: zone.into(),
            price_per_hour: 0.5,
            spot_price_per_hour: Some(0.2),
        };
        FleetSpec {
            name: "gpu".into(),
            provider,
            settings: toml::Table::new(),
            machine: MachineSpec {
                gpu_model: "NVIDIA T4".into(),
                gpus: 1,
                gpu_memory: crate::quantity::Bytes(16 << 30),
                compute_capability: None,
                cpus: 4,
                memory: crate::quantity::Bytes(16 << 30),
                tags: Default::default(),
                container_runtime: true,
                time_limit_s: None,
            },
            offers: vec![offer("a"), offer("b")],
            capacity: CapacityPolicy::SpotThenOnDemand,
            min_idle: 0,
            max: 5,
            idle_timeout_s: Some(600),
            boot_timeout_s: 600,
            idle_action: IdleAction::Delete,
            stopped_timeout_s: None,
            stopped_price_per_hour: 0.0,
            warm: Vec::new(),
            daily_budget: None,
            spot_breaker: SpotBreaker::default(),
            simulate: None,
        }
    }

    fn skip(offer: usize, capacity: Capacity, at: UnixSecs) -> UnavailableOffer {
        offer_unavailable_after_error("gpu", offer, capacity, at)
    }

    #[test]
    fn capacity_errors_alone_read_as_before_with_the_providers_words_when_there_are_any() {
        let f = fleet(ProviderKind::Aws);
        let all = [skip(0, Capacity::OnDemand, NOW - 60), skip(1, Capacity::OnDemand, NOW)];
        assert_eq!(
            no_offer_reason(&f, &all, NOW),
            "fleet gpu: every offer had a capacity error; trying again in 9m00s"
        );
        let said = [
            skip(0, Capacity::OnDemand, NOW - 60).because(SkipCause::Capacity, "InsufficientInstanceCapacity (a)"),
            skip(1, Capacity::OnDemand, NOW).because(SkipCause::Capacity, "InsufficientInstanceCapacity (b)"),
        ];
        assert_eq!(
            no_offer_reason(&f, &said, NOW),
            "fleet gpu: every offer had a capacity error (the latest: InsufficientInstanceCapacity (b)); trying again in 9m00s"
        );
    }

    /// Regression: a cluster's refusal read "every offer had a capacity error".
    #[test]
    fn a_refusal_says_who_refused_in_the_apis_own_words() {
        let f = fleet(ProviderKind::Kubernetes);
        let api = r#"creating pod gpuci-m-1: pods "gpuci-m-1" is forbidden: pod rejected: RuntimeClass "nvidia" not found (403 Forbidden)"#;
        let refused = [skip(0, Capacity::OnDemand, NOW - 2).because(SkipCause::Refused, api)];
        let why = no_offer_reason(&f, &refused, NOW);
        assert_eq!(why, format!("fleet gpu: the cluster refused the pod: {api}; trying again in 9m58s"));
        assert!(!why.contains("capacity"), "{why}");
        // Other providers are spoken of as themselves.
        let why = no_offer_reason(&fleet(ProviderKind::Exec), &refused, NOW);
        assert!(why.starts_with("fleet gpu: the provider refused the machine: creating pod"), "{why}");
        // No words from the provider: the refusal still says what it is.
        let bare = [skip(0, Capacity::OnDemand, NOW).because(SkipCause::Refused, "  ")];
        assert_eq!(no_offer_reason(&f, &bare, NOW), "fleet gpu: the cluster refused the pod; trying again in 10m00s");
    }

    #[test]
    fn a_boot_failure_says_the_machine_did_not_come_up_with_the_providers_words() {
        let f = fleet(ProviderKind::Kubernetes);
        let note = "ended before its agent connected: pod gpuci-m-1 refused: ErrImagePull: failed to pull image \"x:does-not-exist\"";
        let failed = [skip(0, Capacity::OnDemand, NOW).because(SkipCause::BootFailed, note)];
        assert_eq!(
            no_offer_reason(&f, &failed, NOW),
            format!("fleet gpu: a new machine did not come up: {note}; trying again in 10m00s")
        );
    }

    #[test]
    fn the_latest_words_are_said_when_offers_were_refused_differently() {
        let f = fleet(ProviderKind::Kubernetes);
        let two = [
            skip(0, Capacity::Spot, NOW - 30).because(SkipCause::Refused, "denied by policy A"),
            skip(1, Capacity::Spot, NOW - 10).because(SkipCause::Refused, "denied by policy B"),
        ];
        assert_eq!(
            no_offer_reason(&f, &two, NOW),
            "fleet gpu: the cluster refused the pod: denied by policy B; trying again in 9m30s"
        );
    }

    #[test]
    fn mixed_causes_are_each_named_with_their_offers() {
        let f = fleet(ProviderKind::Aws);
        let mixed = [
            skip(0, Capacity::Spot, NOW - 120).because(SkipCause::Capacity, "InsufficientInstanceCapacity"),
            skip(1, Capacity::Spot, NOW - 60),
            skip(0, Capacity::OnDemand, NOW).because(SkipCause::Refused, "UnauthorizedOperation: not allowed"),
            skip(1, Capacity::OnDemand, NOW)
                .because(SkipCause::BootFailed, "did not connect within boot_timeout 10m00s"),
        ];
        let why = no_offer_reason(&f, &mixed, NOW);
        assert_eq!(
            why,
            "fleet gpu: no offer can be used now: \
             a capacity error for g4dn.xlarge in a (spot), g4dn.xlarge in b (spot): InsufficientInstanceCapacity; \
             EC2 refused the instance for g4dn.xlarge in a (on-demand): UnauthorizedOperation: not allowed; \
             a new machine did not come up for g4dn.xlarge in b (on-demand): did not connect within boot_timeout 10m00s; \
             trying again in 8m00s"
        );
    }

    #[test]
    fn the_providers_words_are_one_bounded_line() {
        let f = fleet(ProviderKind::Kubernetes);
        let long = format!("violates PodSecurity:\n  {}", "x".repeat(1000));
        let why = no_offer_reason(&f, &[skip(0, Capacity::OnDemand, NOW).because(SkipCause::Refused, long)], NOW);
        assert!(!why.contains('\n') && why.contains("violates PodSecurity: xxx"), "{why}");
        assert!(why.ends_with("x…; trying again in 10m00s"), "{why}");
        assert!(why.chars().count() < MAX_WORDS + 80, "{}", why.len());
    }

    #[test]
    fn nothing_skipped_is_no_usable_offer() {
        assert_eq!(no_offer_reason(&fleet(ProviderKind::Local), &[], NOW), "fleet gpu: no offer can be used");
    }
}
