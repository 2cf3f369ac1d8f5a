//! Machines whose create may still be under way, and machines the provider lists that no live
//! row accounts for: how long a `requested` row waits for its machine to be listed, and whether
//! a machine that appears without a live row is adopted or deleted. Pure; the fleets loop
//! (`gpuci_coordinator::fleets`) applies the answers.
//!
//! **The grace of a requested row.** A row is written before its create is asked for, and
//! ended when its machine is not listed within the grace. A grace shorter than the provider's
//! own create timeout ended rows whose create was still running (an exec program that takes
//! 150 s of a 5-minute timeout): the fleet made another machine, and the first one came up
//! with no row. So the grace is never shorter than the provider's create timeout, plus a
//! margin ([`requested_grace_s`]).
//!
//! **A stray.** A machine listed with this installation's tags and no live row: its row was
//! ended while its create went on (a coordinator killed mid-create whose orphaned create
//! finished after the new coordinator's grace), or the store lost it (a restored backup). It is
//! adopted when the fleet has room under `max` for it (a stopped one always: stopped machines
//! do not count against `max`), else deleted, so a fleet never counts beyond `max` and never
//! leaves a machine running untracked ([`place_stray`]). A stray whose agent runs a job is
//! deleted only once its agent takes no more jobs and runs none (the loop withdraws it first,
//! as for any delete).

use super::ProviderKind;

/// The least grace of a requested row: a cloud's listing lags its creates.
pub const LIST_GRACE_S: u64 = 120;
/// Added to the provider's create timeout: the row outlives the longest create by this much.
pub const CREATE_MARGIN_S: u64 = 30;

/// The longest a provider's create may take, from the fleet's provider settings: an `exec`
/// program's `timeout` (default 120 s), a Slurm command's `command_timeout` (default 60 s), an
/// AWS call's operation timeout (60 s); `kubernetes` and `local` bound no create by a setting:
/// [`LIST_GRACE_S`]. A setting that does not read counts as its default (the provider refuses
/// it at start anyway).
pub fn create_timeout_s(provider: ProviderKind, settings: &toml::Table) -> u64 {
    let setting = |key: &str, default: u64| {
        settings
            .get(key)
            .and_then(|v| v.as_str())
            .and_then(|t| t.parse::<crate::duration::Duration>().ok())
            .map_or(default, |d| d.0.as_secs())
    };
    match provider {
        ProviderKind::Exec => setting("timeout", 120),
        ProviderKind::Slurm => setting("command_timeout", 60),
        ProviderKind::Aws => 60,
        ProviderKind::Kubernetes | ProviderKind::Local => LIST_GRACE_S,
    }
}

/// How long a requested row waits for its machine to be listed before it is ended: never
/// shorter than a create may take ([module docs](self)).
pub fn requested_grace_s(create_timeout_s: u64) -> u64 {
    LIST_GRACE_S.max(create_timeout_s.saturating_add(CREATE_MARGIN_S))
}

/// What is known of a stray machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stray {
    /// The provider lists it stopped (not counted against `max`).
    pub stopped: bool,
}

/// What becomes of a stray.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StrayFate {
    /// Recorded as the fleet's, counted from now on.
    Adopt,
    /// Deleted at the provider, for this reason.
    Delete { reason: String },
}

/// Adopt or delete a stray machine of a fleet of `max` machines that counts `counted` against
/// `max` already (its live, non-stopped rows and the strays adopted before this one).
pub fn place_stray(max: u32, counted: u32, stray: Stray) -> StrayFate {
    if stray.stopped || counted < max {
        return StrayFate::Adopt;
    }
    StrayFate::Delete {
        reason: format!(
            "listed by the provider with no live record (its create outlived its record, or the store lost it), \
             and the fleet has {counted} of its max {max} machines already"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requested_row_waits_at_least_as_long_as_a_create_may_take() {
        let mut t = toml::Table::new();
        assert_eq!(requested_grace_s(create_timeout_s(ProviderKind::Exec, &t)), 150);
        t.insert("timeout".into(), toml::Value::String("5m".into()));
        let grace = requested_grace_s(create_timeout_s(ProviderKind::Exec, &t));
        assert!(grace > 300, "a 5-minute create must not lose its row: {grace}");
        t.insert("command_timeout".into(), toml::Value::String("10s".into()));
        assert_eq!(requested_grace_s(create_timeout_s(ProviderKind::Slurm, &t)), LIST_GRACE_S);
        for p in ProviderKind::ALL {
            assert!(requested_grace_s(create_timeout_s(p, &toml::Table::new())) >= LIST_GRACE_S);
        }
    }

    #[test]
    fn a_stray_is_adopted_only_under_max_and_never_counted_beyond_it() {
        let running = Stray { stopped: false };
        assert_eq!(place_stray(1, 0, running), StrayFate::Adopt);
        assert!(matches!(place_stray(1, 1, running), StrayFate::Delete { .. }));
        assert!(matches!(place_stray(2, 3, running), StrayFate::Delete { .. }));
        // Stopped machines do not count against max: kept, and so not left untracked.
        assert_eq!(place_stray(1, 1, Stray { stopped: true }), StrayFate::Adopt);
        // Strays one after another: each adopted one counts for the next.
        let mut counted = 0;
        let fates: Vec<StrayFate> = (0..3)
            .map(|_| {
                let f = place_stray(2, counted, running);
                if f == StrayFate::Adopt {
                    counted += 1;
                }
                f
            })
            .collect();
        assert_eq!(fates.iter().filter(|f| **f == StrayFate::Adopt).count(), 2);
        assert!(counted <= 2);
    }
}
