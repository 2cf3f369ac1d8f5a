//! Short names for GPU UUIDs that stay apart on one page. UUIDs of one host often share
//! their first groups (simulated ones always do, `GPU-<host hash>-5349-4d…`; real boards of
//! one batch often), so a fixed prefix printed the same text for several GPUs. Each UUID is
//! shown by the shortest tail of its hex digits (at least [`MIN_TAIL`]) that no other UUID on
//! the page ends with; the whole UUID goes in the element's title.

use std::collections::{BTreeMap, BTreeSet};

/// Hex digits a short name has at least: fewer look like noise.
pub const MIN_TAIL: usize = 6;

/// The hex digits of a UUID without its `GPU-`/`MIG-` prefix and dashes.
fn digits(uuid: &str) -> Vec<char> {
    let body = uuid.strip_prefix("GPU-").or_else(|| uuid.strip_prefix("MIG-")).unwrap_or(uuid);
    body.chars().filter(|c| *c != '-').collect()
}

/// Each distinct UUID → its short name (`…a1b2c3`), unique among `uuids`. A UUID whose
/// digits are a tail of another's (malformed input) is shown whole.
pub fn short_gpu_ids<'a>(uuids: impl IntoIterator<Item = &'a str>) -> BTreeMap<String, String> {
    let all: BTreeSet<&str> = uuids.into_iter().collect();
    let tails: Vec<(&str, Vec<char>)> = all.iter().map(|u| (*u, digits(u))).collect();
    let mut out = BTreeMap::new();
    for (uuid, d) in &tails {
        let ends_alike = |k: usize| {
            let mine = &d[d.len().saturating_sub(k)..];
            tails.iter().any(|(other, o)| other != uuid && o.len() >= mine.len() && o.ends_with(mine))
        };
        let k = (MIN_TAIL.min(d.len())..=d.len()).find(|k| !ends_alike(*k));
        let short = match k {
            Some(k) if k < d.len() => format!("…{}", d[d.len() - k..].iter().collect::<String>()),
            _ => (*uuid).to_string(),
        };
        out.insert((*uuid).to_string(), short);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: two simulated GPUs of one host printed the same `GPU-1234abcd` prefix.
    #[test]
    fn gpus_of_one_host_get_different_short_names() {
        let a = "GPU-8c2f41aa-5349-4d11-0000-000000a1b2c3";
        let b = "GPU-8c2f41aa-5349-4d11-0001-000000f4e5d6";
        let ids = short_gpu_ids([a, b, a]);
        assert_eq!(ids.len(), 2);
        assert_eq!(ids[a], "…a1b2c3");
        assert_eq!(ids[b], "…f4e5d6");
    }

    #[test]
    fn a_shared_tail_grows_until_the_names_differ() {
        let a = "GPU-00000000-0000-0000-0000-11aaaaaaaaaa";
        let b = "GPU-00000000-0000-0000-0000-22aaaaaaaaaa";
        let ids = short_gpu_ids([a, b]);
        assert_ne!(ids[a], ids[b]);
        assert_eq!(ids[a], "…1aaaaaaaaaa");
    }

    #[test]
    fn every_name_is_unique_whatever_the_input() {
        let many: Vec<String> =
            (0..300).map(|i| format!("GPU-deadbeef-5349-4d00-{i:04x}-0000000{:05x}", i * 7)).collect();
        let mut odd = many.clone();
        odd.extend(["x".to_string(), "GPU-".into(), "MIG-1".into(), "1".into(), "<b>".into()]);
        let ids = short_gpu_ids(odd.iter().map(String::as_str));
        let names: BTreeSet<&String> = ids.values().collect();
        assert_eq!(names.len(), ids.len(), "{ids:?}");
    }
}
