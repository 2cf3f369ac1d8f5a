//! How simulated machines behave: boot and start times, stop time, spot interruptions and
//! capacity errors, per fleet. Read from each fleet's `[fleet.simulate]` table (the core keeps
//! that table opaque; it is checked strictly here, with `file:line:column`), falling back to
//! [`SimProfile::default`].
//!
//! ```toml
//! [fleet.simulate]
//! boot = "lognormal 120s 0.25"     # or "fixed 90s", "uniform 60s 180s"
//! start = "lognormal 45s 0.25"     # a stopped machine started again
//! stop = "fixed 30s"               # billed until stopped
//! spot_interruptions_per_hour = 0.02
//! capacity_error_rate = 0.01      # chance that a create fails with a capacity error
//! ```

use crate::rng::Rng;
use gpuci_core::duration::Duration;
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
use std::str::FromStr;

/// A distribution of seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Dist {
    Fixed {
        s: f64,
    },
    Uniform {
        lo: f64,
        hi: f64,
    },
    /// Median and shape σ of the underlying normal.
    Lognormal {
        median: f64,
        sigma: f64,
    },
}

impl Dist {
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        let s = match *self {
            Dist::Fixed { s } => s,
            Dist::Uniform { lo, hi } => lo + (hi - lo) * rng.f64(),
            Dist::Lognormal { median, sigma } => rng.lognormal(median, sigma),
        };
        s.round().max(1.0) as u64
    }

    pub fn mean(&self) -> f64 {
        match *self {
            Dist::Fixed { s } => s,
            Dist::Uniform { lo, hi } => (lo + hi) / 2.0,
            Dist::Lognormal { median, sigma } => median * (sigma * sigma / 2.0).exp(),
        }
    }

    /// `fixed 90s`, `uniform 60s 180s`, `lognormal 120s 0.25`.
    pub fn parse(s: &str) -> Option<Dist> {
        let words: Vec<&str> = s.split_whitespace().collect();
        let secs = |w: &str| Duration::from_str(w).ok().map(|d| d.as_millis() as f64 / 1000.0);
        match words.as_slice() {
            ["fixed", a] => Some(Dist::Fixed { s: secs(a)? }),
            ["uniform", a, b] => {
                let (lo, hi) = (secs(a)?, secs(b)?);
                (lo <= hi).then_some(Dist::Uniform { lo, hi })
            }
            ["lognormal", m, sigma] => {
                let sigma: f64 = sigma.parse().ok()?;
                (sigma.is_finite() && (0.0..=3.0).contains(&sigma))
                    .then_some(Dist::Lognormal { median: secs(m)?, sigma })
            }
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Dist {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Dist::parse(&s).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "expected \"fixed 90s\", \"uniform 60s 180s\" or \"lognormal 120s 0.25\", got {s:?}"
            ))
        })
    }
}

/// One fleet's simulated behaviour.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimProfile {
    pub boot: Dist,
    pub start: Dist,
    pub stop: Dist,
    /// Poisson rate of interruptions of one spot machine, per hour it runs.
    pub spot_interruptions_per_hour: f64,
    /// Chance that one create fails with a capacity error (the offer is then skipped for
    /// [`gpuci_core::fleet::CAPACITY_ERROR_BACKOFF_S`]).
    pub capacity_error_rate: f64,
}

impl Default for SimProfile {
    /// A GPU VM from a cloud image with the agent baked in: about two minutes to a connected
    /// agent, 45 s to start a stopped one; no interruptions and no capacity errors.
    fn default() -> Self {
        SimProfile {
            boot: Dist::Lognormal { median: 120.0, sigma: 0.25 },
            start: Dist::Lognormal { median: 45.0, sigma: 0.25 },
            stop: Dist::Fixed { s: 30.0 },
            spot_interruptions_per_hour: 0.0,
            capacity_error_rate: 0.0,
        }
    }
}

/// The `[fleet.simulate]` tables of a server config, by fleet name; `file` names it in errors.
pub fn parse_profiles(file: &str, text: &str) -> Result<BTreeMap<String, SimProfile>, String> {
    #[derive(Deserialize)]
    struct Doc {
        #[serde(default)]
        fleet: Vec<FleetView>,
    }
    #[derive(Deserialize)]
    struct FleetView {
        #[serde(default)]
        name: String,
        simulate: Option<SimProfile>,
    }
    let doc: Doc = serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
        let at = e.inner().span().map(|s| {
            let before = &text[..s.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let col = before.rfind('\n').map_or(before.len(), |i| before.len() - i - 1) + 1;
            format!("{line}:{col}:")
        });
        format!("{file}:{} {}: {}", at.unwrap_or_default(), e.path(), e.inner().message().trim_end())
    })?;
    let mut out = BTreeMap::new();
    for (i, f) in doc.fleet.into_iter().enumerate() {
        if let Some(p) = f.simulate {
            let bad = |what: &str| Err(format!("{file}: fleet[{i}] ({}): simulate.{what}", f.name));
            if !(p.spot_interruptions_per_hour.is_finite() && p.spot_interruptions_per_hour >= 0.0) {
                return bad("spot_interruptions_per_hour: expected a rate ≥ 0");
            }
            if !(0.0..=1.0).contains(&p.capacity_error_rate) {
                return bad("capacity_error_rate: expected a probability from 0 to 1");
            }
            out.insert(f.name, p);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributions_parse_and_sample() {
        assert_eq!(Dist::parse("fixed 90s"), Some(Dist::Fixed { s: 90.0 }));
        assert_eq!(Dist::parse("uniform 1m 2m"), Some(Dist::Uniform { lo: 60.0, hi: 120.0 }));
        assert_eq!(Dist::parse("uniform 2m 1m"), None);
        assert_eq!(Dist::parse("lognormal 2m x"), None);
        assert_eq!(Dist::parse("normal 2m"), None);
        let mut rng = Rng::new(3);
        assert_eq!(Dist::Fixed { s: 60.0 }.sample(&mut rng), 60);
        assert!((0..100).all(|_| (60..=120).contains(&Dist::Uniform { lo: 60.0, hi: 120.0 }.sample(&mut rng))));
    }

    #[test]
    fn profiles_are_strict_and_located() {
        let text = "[[fleet]]\nname = \"t4\"\n[fleet.simulate]\nboot = \"fixed 60s\"\n";
        let p = parse_profiles("server.toml", text).unwrap();
        assert_eq!(p["t4"].boot, Dist::Fixed { s: 60.0 });
        assert_eq!(p["t4"].start, SimProfile::default().start);
        let e = parse_profiles("server.toml", &format!("{text}bot = \"fixed 1s\"\n")).unwrap_err();
        assert!(e.starts_with("server.toml:5:1: fleet[0].simulate.bot: unknown field `bot`"), "{e}");
        let e = parse_profiles("server.toml", &text.replace("fixed 60s", "fast")).unwrap_err();
        assert!(e.starts_with("server.toml:4:8: fleet[0].simulate.boot: expected \"fixed 90s\""), "{e}");
    }
}
