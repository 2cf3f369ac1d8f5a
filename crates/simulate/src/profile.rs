//! How simulated machines behave: boot, start and stop times, the disk they keep, spot
//! interruptions and capacity errors, per fleet and per offer. Read from each fleet's
//! `[fleet.simulate]` table (the core keeps that table opaque; it is checked strictly here, with
//! `file:line:column`), falling back to [`SimProfile::default`] and the defaults below, each of
//! which says where it comes from or that it is an assumption.
//!
//! ```toml
//! [fleet.simulate]
//! boot = "lognormal 120s 0.25"     # or "fixed 90s", "uniform 60s 180s"
//! start = "lognormal 45s 0.25"     # a stopped machine started again
//! stop = "fixed 30s"               # billed until stopped
//! disk_gb = 100                    # kept while the machine exists: running, and stopped
//! disk_price_per_gb_month = 0.08
//! spot_interruptions_per_hour = 0.02
//! capacity_outages_per_day = 1     # on-demand: every create and start fails during one
//! spot_capacity_outages_per_day = 4
//! capacity_outage = "lognormal 15m 0.5"
//! capacity_error_rate = 0          # a create failing on its own, outside outages
//! start_capacity_error_rate = 0    # the same for a start (default: capacity_error_rate)
//!
//! [[fleet.simulate.offer]]         # what differs for one [[fleet.offer]]
//! instance_type = "g4dn.xlarge"
//! zone = "us-east-1a"              # optional
//! disk_gb = 200
//! outages = [[3600, 5400]]         # known outages, seconds from the trace's start
//! ```
//!
//! Capacity is modelled as outages in time, not as a coin tossed per request: the cloud's
//! shortage of an instance type in a zone does not depend on how often one asks, it lasts
//! (a stopped machine is pinned to its zone and waits it out like a create), and every policy
//! run on the same seed meets the same outages, so their figures compare like for like.

use crate::rng::Rng;
use gpuci_core::duration::Duration;
use gpuci_core::fleet::{FleetSpec, ProviderKind};
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

/// One fleet's simulated behaviour. The rates and the disk are defaults for each of the fleet's
/// offers; an `[[fleet.simulate.offer]]` entry overrides them for one offer
/// ([`SimProfile::offer`] resolves them, with the documented defaults where neither says).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimProfile {
    pub boot: Dist,
    pub start: Dist,
    pub stop: Dist,
    /// Poisson rate of interruptions of one spot machine, per hour it runs
    /// (default [`DEFAULT_SPOT_INTERRUPTIONS_PER_HOUR`]).
    pub spot_interruptions_per_hour: Option<f64>,
    /// Chance that one create fails with a capacity error on its own, outside any outage
    /// (the offer is then skipped for its back-off, `gpuci_core::fleet::backoff`). Default 0.
    pub capacity_error_rate: f64,
    /// The same for a start of a stopped machine; default: `capacity_error_rate`.
    pub start_capacity_error_rate: Option<f64>,
    /// Capacity outages of one on-demand offer per day (Poisson in time): while one lasts, every
    /// create and every start of that offer fails with a capacity error
    /// (default [`DEFAULT_OUTAGES_PER_DAY`]).
    pub capacity_outages_per_day: Option<f64>,
    /// The same for spot capacity (default [`DEFAULT_SPOT_OUTAGES_PER_DAY`]).
    pub spot_capacity_outages_per_day: Option<f64>,
    /// How long an outage lasts (default [`DEFAULT_OUTAGE`]).
    pub capacity_outage: Dist,
    /// The disk each machine keeps while it exists, running or stopped (default
    /// [`DEFAULT_DISK_GB`]).
    pub disk_gb: Option<f64>,
    /// USD per GB-month of [`HOURS_PER_MONTH`] hours (default [`default_disk_price`]).
    pub disk_price_per_gb_month: Option<f64>,
    /// Per-offer overrides, matched to `[[fleet.offer]]` by `instance_type` (and `zone` when
    /// given).
    #[serde(rename = "offer")]
    pub offers: Vec<OfferProfile>,
}

impl Default for SimProfile {
    /// A GPU VM from a cloud image with the agent baked in: about two minutes to a connected
    /// agent, 45 s to start a stopped one; the rates and the disk from the documented defaults.
    fn default() -> Self {
        SimProfile {
            boot: Dist::Lognormal { median: 120.0, sigma: 0.25 },
            start: Dist::Lognormal { median: 45.0, sigma: 0.25 },
            stop: Dist::Fixed { s: 30.0 },
            spot_interruptions_per_hour: None,
            capacity_error_rate: 0.0,
            start_capacity_error_rate: None,
            capacity_outages_per_day: None,
            spot_capacity_outages_per_day: None,
            capacity_outage: DEFAULT_OUTAGE,
            disk_gb: None,
            disk_price_per_gb_month: None,
            offers: Vec::new(),
        }
    }
}

/// `[[fleet.simulate.offer]]`: what differs for one offer. Absent keys fall back to the
/// fleet's `[fleet.simulate]` values, then to the defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OfferProfile {
    pub instance_type: String,
    /// Matches only the offer in this zone; absent: every offer of the instance type.
    pub zone: Option<String>,
    pub disk_gb: Option<f64>,
    pub disk_price_per_gb_month: Option<f64>,
    pub spot_interruptions_per_hour: Option<f64>,
    pub capacity_error_rate: Option<f64>,
    pub start_capacity_error_rate: Option<f64>,
    pub capacity_outages_per_day: Option<f64>,
    pub spot_capacity_outages_per_day: Option<f64>,
    /// Outages at known times, `[from, to]` in seconds from the trace's start (both capacity
    /// types): to replay an incident, or to check a run by hand.
    pub outages: Vec<[u64; 2]>,
}

/// A GPU image with drivers, CUDA and a container cache: an assumption (AWS's Deep Learning
/// AMIs ask for roughly this much root volume).
pub const DEFAULT_DISK_GB: f64 = 100.0;
/// EBS gp3 list price in us-east-1, USD per GB-month (aws.amazon.com/ebs/pricing).
pub const GP3_PRICE_PER_GB_MONTH: f64 = 0.08;
/// The month of AWS's price lists and calculator: 730 hours.
pub const HOURS_PER_MONTH: f64 = 730.0;
/// AWS's Spot Instance Advisor puts GPU instance types mostly in its 5–20 % "frequency of
/// interruption" buckets (the share of instances reclaimed over the trailing month). Read as
/// the chance that one instance is interrupted in a life of about six hours, the 10–15 %
/// bucket gives about 0.02 an hour. The reading is an assumption: AWS does not say per what.
pub const DEFAULT_SPOT_INTERRUPTIONS_PER_HOUR: f64 = 0.02;
/// Capacity outages of an on-demand GPU offer (one instance type in one zone) per day: an
/// assumption, as no cloud publishes how often `InsufficientInstanceCapacity` (or its
/// equivalent) answers a create or a start.
pub const DEFAULT_OUTAGES_PER_DAY: f64 = 1.0;
/// Spot capacity runs out more often than on-demand: an assumption of four a day (measured
/// spot availability, such as the SkyPilot traces of V100 spot on AWS, varies far more).
pub const DEFAULT_SPOT_OUTAGES_PER_DAY: f64 = 4.0;
/// How long an outage lasts: median 15 minutes, an assumption.
pub const DEFAULT_OUTAGE: Dist = Dist::Lognormal { median: 900.0, sigma: 0.5 };

/// The disk price where the fleet's provider gives none: gp3 for clouds (`aws`, and `exec`,
/// which stands for any other cloud); 0 for `local`, `slurm` and `kubernetes`, whose disks
/// are the site's own and billed to nobody per machine.
pub fn default_disk_price(provider: ProviderKind) -> f64 {
    match provider {
        ProviderKind::Aws | ProviderKind::Exec => GP3_PRICE_PER_GB_MONTH,
        ProviderKind::Local | ProviderKind::Slurm | ProviderKind::Kubernetes => 0.0,
    }
}

/// One offer's simulated behaviour, every default resolved.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OfferSim {
    pub disk_gb: f64,
    /// USD per hour for the machine's disk, running or stopped.
    pub disk_usd_per_hour: f64,
    pub spot_interruptions_per_hour: f64,
    pub capacity_error_rate: f64,
    pub start_capacity_error_rate: f64,
    /// By capacity type: `[on-demand, spot]`.
    pub outages_per_day: [f64; 2],
    pub outage: Dist,
    /// `[from, to)`, seconds from the trace's start.
    pub outage_windows: Vec<(u64, u64)>,
}

impl SimProfile {
    /// The behaviour of `spec`'s offer `o`: its `[[fleet.simulate.offer]]` entry (the first
    /// that matches), else this table, else the defaults.
    pub fn offer(&self, spec: &FleetSpec, o: usize) -> OfferSim {
        let offer = spec.offers.get(o);
        let own = offer.and_then(|of| self.offers.iter().find(|p| p.matches(&of.instance_type, &of.zone)));
        let pick = |own: Option<f64>, fleet: Option<f64>, default: f64| own.or(fleet).unwrap_or(default);
        let disk_gb = pick(own.and_then(|p| p.disk_gb), self.disk_gb, DEFAULT_DISK_GB);
        let price = pick(
            own.and_then(|p| p.disk_price_per_gb_month),
            self.disk_price_per_gb_month,
            default_disk_price(spec.provider),
        );
        let create = pick(own.and_then(|p| p.capacity_error_rate), Some(self.capacity_error_rate), 0.0);
        OfferSim {
            disk_gb,
            disk_usd_per_hour: disk_gb * price / HOURS_PER_MONTH,
            spot_interruptions_per_hour: pick(
                own.and_then(|p| p.spot_interruptions_per_hour),
                self.spot_interruptions_per_hour,
                DEFAULT_SPOT_INTERRUPTIONS_PER_HOUR,
            ),
            capacity_error_rate: create,
            start_capacity_error_rate: pick(
                own.and_then(|p| p.start_capacity_error_rate),
                self.start_capacity_error_rate,
                create,
            ),
            outages_per_day: [
                pick(
                    own.and_then(|p| p.capacity_outages_per_day),
                    self.capacity_outages_per_day,
                    DEFAULT_OUTAGES_PER_DAY,
                ),
                pick(
                    own.and_then(|p| p.spot_capacity_outages_per_day),
                    self.spot_capacity_outages_per_day,
                    DEFAULT_SPOT_OUTAGES_PER_DAY,
                ),
            ],
            outage: self.capacity_outage,
            outage_windows: own.map(|p| p.outages.iter().map(|w| (w[0], w[1])).collect()).unwrap_or_default(),
        }
    }
}

impl OfferProfile {
    fn matches(&self, instance_type: &str, zone: &str) -> bool {
        self.instance_type == instance_type && self.zone.as_deref().is_none_or(|z| z == zone)
    }
}

/// Every `[[fleet.simulate.offer]]` must name an offer of its fleet: a typo would otherwise
/// leave the defaults in place without a word.
pub fn check_offers(file: &str, fleets: &[FleetSpec], profiles: &BTreeMap<String, SimProfile>) -> Result<(), String> {
    for (i, spec) in fleets.iter().enumerate() {
        let Some(p) = profiles.get(&spec.name) else { continue };
        for (j, op) in p.offers.iter().enumerate() {
            if !spec.offers.iter().any(|o| op.matches(&o.instance_type, &o.zone)) {
                let have: Vec<String> = spec.offers.iter().map(|o| o.label()).collect();
                return Err(format!(
                    "{file}: fleet[{i}] ({}): simulate.offer[{j}]: no [[fleet.offer]] with instance_type {:?}{} (offers: {})",
                    spec.name,
                    op.instance_type,
                    op.zone.as_deref().map(|z| format!(" in zone {z:?}")).unwrap_or_default(),
                    have.join(", ")
                ));
            }
        }
    }
    Ok(())
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
            let at = |what: &str| format!("{file}: fleet[{i}] ({}): simulate.{what}", f.name);
            check_values(&at(""), &p.values())?;
            for (j, o) in p.offers.iter().enumerate() {
                check_values(&at(&format!("offer[{j}].")), &o.values())?;
                if let Some(w) = o.outages.iter().find(|w| w[0] >= w[1]) {
                    return Err(at(&format!("offer[{j}].outages: [{}, {}] ends before it starts", w[0], w[1])));
                }
            }
            out.insert(f.name, p);
        }
    }
    Ok(out)
}

/// What a value must be, for [`check_values`].
#[derive(Clone, Copy)]
enum Kind {
    /// A rate or an amount ≥ 0.
    NonNegative,
    /// A probability from 0 to 1.
    Probability,
}

impl SimProfile {
    fn values(&self) -> Vec<(&'static str, Option<f64>, Kind)> {
        vec![
            ("spot_interruptions_per_hour", self.spot_interruptions_per_hour, Kind::NonNegative),
            ("capacity_error_rate", Some(self.capacity_error_rate), Kind::Probability),
            ("start_capacity_error_rate", self.start_capacity_error_rate, Kind::Probability),
            ("capacity_outages_per_day", self.capacity_outages_per_day, Kind::NonNegative),
            ("spot_capacity_outages_per_day", self.spot_capacity_outages_per_day, Kind::NonNegative),
            ("disk_gb", self.disk_gb, Kind::NonNegative),
            ("disk_price_per_gb_month", self.disk_price_per_gb_month, Kind::NonNegative),
        ]
    }
}

impl OfferProfile {
    fn values(&self) -> Vec<(&'static str, Option<f64>, Kind)> {
        vec![
            ("spot_interruptions_per_hour", self.spot_interruptions_per_hour, Kind::NonNegative),
            ("capacity_error_rate", self.capacity_error_rate, Kind::Probability),
            ("start_capacity_error_rate", self.start_capacity_error_rate, Kind::Probability),
            ("capacity_outages_per_day", self.capacity_outages_per_day, Kind::NonNegative),
            ("spot_capacity_outages_per_day", self.spot_capacity_outages_per_day, Kind::NonNegative),
            ("disk_gb", self.disk_gb, Kind::NonNegative),
            ("disk_price_per_gb_month", self.disk_price_per_gb_month, Kind::NonNegative),
        ]
    }
}

fn check_values(at: &str, values: &[(&'static str, Option<f64>, Kind)]) -> Result<(), String> {
    for &(name, v, kind) in values {
        let Some(v) = v else { continue };
        match kind {
            Kind::NonNegative if !(v.is_finite() && v >= 0.0) => {
                return Err(format!("{at}{name}: expected a number ≥ 0, got {v}"))
            }
            Kind::Probability if !(0.0..=1.0).contains(&v) => {
                return Err(format!("{at}{name}: expected a probability from 0 to 1, got {v}"))
            }
            _ => {}
        }
    }
    Ok(())
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

    fn fleets(provider: &str, simulate: &str) -> (Vec<FleetSpec>, BTreeMap<String, SimProfile>) {
        let text = format!(
            "[[fleet]]\nname = \"f\"\nprovider = \"{provider}\"\nmax = 2\n\
             [fleet.machine]\ngpu_model = \"NVIDIA T4\"\ngpus = 1\ngpu_memory = \"16GiB\"\ncpus = 4\nmemory = \"16GiB\"\n\
             [[fleet.offer]]\ninstance_type = \"g4dn.xlarge\"\nzone = \"us-east-1a\"\nprice_per_hour = 0.526\n\
             [[fleet.offer]]\ninstance_type = \"g4dn.xlarge\"\nzone = \"us-east-1b\"\nprice_per_hour = 0.526\n{simulate}"
        );
        let f = gpuci_core::fleet::parse_fleets("server.toml", &text).expect("fleets");
        (f, parse_profiles("server.toml", &text).expect("profiles"))
    }

    #[test]
    fn offers_take_their_own_values_then_the_fleets_then_the_documented_defaults() {
        let (f, _) = fleets("aws", "");
        let d = SimProfile::default().offer(&f[0], 0);
        assert_eq!((d.disk_gb, d.spot_interruptions_per_hour, d.outages_per_day), (100.0, 0.02, [1.0, 4.0]));
        assert!((d.disk_usd_per_hour - 100.0 * 0.08 / 730.0).abs() < 1e-15);
        assert_eq!((d.capacity_error_rate, d.start_capacity_error_rate, d.outage), (0.0, 0.0, DEFAULT_OUTAGE));
        // A site's own machines bill no disk.
        let (f, _) = fleets("local", "");
        assert_eq!(SimProfile::default().offer(&f[0], 0).disk_usd_per_hour, 0.0);

        let (f, p) = fleets(
            "aws",
            "[fleet.simulate]\ndisk_gb = 200\ncapacity_error_rate = 0.1\ncapacity_outages_per_day = 2\n\
             [[fleet.simulate.offer]]\ninstance_type = \"g4dn.xlarge\"\nzone = \"us-east-1b\"\n\
             disk_price_per_gb_month = 0.1\nstart_capacity_error_rate = 0.5\noutages = [[10, 20]]\n",
        );
        let (a, b) = (p["f"].offer(&f[0], 0), p["f"].offer(&f[0], 1));
        assert_eq!((a.disk_gb, a.capacity_error_rate, a.start_capacity_error_rate), (200.0, 0.1, 0.1));
        assert_eq!((a.outages_per_day, a.outage_windows.len()), ([2.0, 4.0], 0));
        assert!((a.disk_usd_per_hour - 200.0 * 0.08 / 730.0).abs() < 1e-15);
        assert_eq!((b.start_capacity_error_rate, b.outage_windows.clone()), (0.5, vec![(10, 20)]));
        assert!((b.disk_usd_per_hour - 200.0 * 0.1 / 730.0).abs() < 1e-15);
        assert_eq!(check_offers("server.toml", &f, &p), Ok(()));

        let (f, p) = fleets("aws", "[fleet.simulate]\n[[fleet.simulate.offer]]\ninstance_type = \"g5.xlarge\"\n");
        let e = check_offers("server.toml", &f, &p).unwrap_err();
        assert!(
            e.starts_with(
                "server.toml: fleet[0] (f): simulate.offer[0]: no [[fleet.offer]] with instance_type \"g5.xlarge\""
            ),
            "{e}"
        );
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
        let e = parse_profiles("server.toml", &format!("{text}disk_gb = -1\n")).unwrap_err();
        assert_eq!(e, "server.toml: fleet[0] (t4): simulate.disk_gb: expected a number ≥ 0, got -1");
        let e = parse_profiles("server.toml", &format!("{text}start_capacity_error_rate = 2\n")).unwrap_err();
        assert!(e.ends_with("simulate.start_capacity_error_rate: expected a probability from 0 to 1, got 2"), "{e}");
        let offer = "[[fleet.simulate.offer]]\ninstance_type = \"x\"\noutages = [[20, 10]]\n";
        let e = parse_profiles("server.toml", &format!("{text}{offer}")).unwrap_err();
        assert_eq!(e, "server.toml: fleet[0] (t4): simulate.offer[0].outages: [20, 10] ends before it starts");
        let e = parse_profiles(
            "server.toml",
            &format!("{text}[[fleet.simulate.offer]]\ninstance_type = \"x\"\ndisk = 1\n"),
        )
        .unwrap_err();
        assert!(e.starts_with("server.toml:7:1: fleet[0].simulate.offer[0].disk: unknown field `disk`"), "{e}");
    }
}
