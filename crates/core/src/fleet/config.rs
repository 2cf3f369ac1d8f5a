//! The `[[fleet]]` entries of the server config (TOML), parsed strictly into [`FleetSpec`]s.
//!
//! Every error names `file:line:column`, the fleet (`fleet[i] (name)`), the field and what is
//! wrong, like the `[github]` section's: unknown keys, bad durations, sizes, days, times and
//! time zones, and the checks across fields (`max` below `min_idle`, no offer, `idle_action =
//! "stop"` on a provider that cannot stop machines, two fleets with one name). Other sections of
//! the document (`[github]` …) are left to their own parsers. No I/O: the caller reads the file.

use super::schedule::{parse_hhmm, time_zone, Days, WarmSchedule};
use super::{CapacityPolicy, FleetSpec, IdleAction, MachineSpec, Offer, ProviderKind, SpotBreaker};
use crate::duration::Duration;
use crate::gpu::ComputeCapability;
use crate::quantity::Bytes;
use serde::{Deserialize, Deserializer};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

/// A bad `[[fleet]]` entry, with where it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct FleetConfigError {
    pub file: String,
    /// 1-based; `None` when the parser could not say.
    pub at: Option<(usize, usize)>,
    /// `fleet[0] (t4): machine.gpus: expected …`
    pub what: String,
}

impl fmt::Display for FleetConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Some((line, col)) => write!(f, "{}:{line}:{col}: {}", self.file, self.what),
            None => write!(f, "{}: {}", self.file, self.what),
        }
    }
}

/// Parse every `[[fleet]]` of a server config's text; `file_name` names it in errors.
/// Sections other than `fleet` are ignored here.
pub fn parse_fleets(file_name: &str, text: &str) -> Result<Vec<FleetSpec>, FleetConfigError> {
    let err = |at: Option<(usize, usize)>, what: String| FleetConfigError { file: file_name.to_string(), at, what };
    // First as a plain table: syntax errors, and the fleets' names for the errors below.
    let table: toml::Table = toml::from_str(text)
        .map_err(|e| err(e.span().map(|s| line_col(text, s.start)), e.message().trim_end().to_string()))?;
    let name_of = |i: usize| -> String {
        table
            .get("fleet")
            .and_then(|f| f.as_array())
            .and_then(|a| a.get(i))
            .and_then(|f| f.get("name"))
            .and_then(|n| n.as_str())
            .unwrap_or("?")
            .to_string()
    };
    let doc: Document = serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
        let at = e.inner().span().map(|s| line_col(text, s.start));
        let message = e.inner().message().trim_end().to_string();
        err(at, describe_path(e.path(), &name_of, &message))
    })?;
    let headers = fleet_headers(text);
    let mut names = BTreeSet::new();
    let mut fleets = Vec::with_capacity(doc.fleet.len());
    for (i, f) in doc.fleet.into_iter().enumerate() {
        let name = f.name.clone();
        let region = (headers.get(i).copied().unwrap_or(0), headers.get(i + 1).copied().unwrap_or(text.len()));
        let fail = |field: &str, what: String| {
            let key = field.rsplit('.').next().unwrap_or(field);
            let offset = key_offset(text, region, key).unwrap_or(region.0);
            let what = if field.is_empty() {
                format!("fleet[{i}] ({name}): {what}")
            } else {
                format!("fleet[{i}] ({name}): {field}: {what}")
            };
            err(Some(line_col(text, offset)), what)
        };
        if !names.insert(name.clone()) {
            return Err(fail("name", "another fleet has this name".into()));
        }
        fleets.push(resolve(f, &fail)?);
    }
    Ok(fleets)
}

/// The document as far as fleets go. Not `deny_unknown_fields`: other sections belong to
/// other parsers, which are strict about their own keys.
#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    fleet: Vec<FleetFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetFile {
    name: String,
    provider: Text<ProviderKind>,
    #[serde(default)]
    settings: toml::Table,
    machine: MachineFile,
    #[serde(default, rename = "offer")]
    offers: Vec<OfferFile>,
    #[serde(default)]
    capacity: Option<Text<CapacityPolicy>>,
    #[serde(default)]
    min_idle: u32,
    max: u32,
    #[serde(default)]
    idle_timeout: Option<Text<Duration>>,
    #[serde(default)]
    boot_timeout: Option<Text<Duration>>,
    #[serde(default)]
    idle_action: Option<Text<IdleAction>>,
    #[serde(default)]
    stopped_timeout: Option<Text<Duration>>,
    stopped_price_per_hour: Option<f64>,
    #[serde(default)]
    warm: Vec<WarmFile>,
    daily_budget: Option<f64>,
    spot_breaker: Option<BreakerFile>,
    simulate: Option<toml::Table>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MachineFile {
    gpu_model: String,
    gpus: u32,
    gpu_memory: Text<Bytes>,
    compute_capability: Option<Text<ComputeCapability>>,
    cpus: u32,
    memory: Text<Bytes>,
    #[serde(default)]
    tags: BTreeMap<String, String>,
    #[serde(default = "yes")]
    container_runtime: bool,
    time_limit: Option<Text<Duration>>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OfferFile {
    instance_type: String,
    #[serde(default)]
    zone: String,
    price_per_hour: f64,
    spot_price_per_hour: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WarmFile {
    days: Text<Days>,
    from: Text<Minute>,
    to: Text<Minute>,
    #[serde(default = "utc")]
    timezone: String,
    min_idle: u32,
}

fn utc() -> String {
    "UTC".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BreakerFile {
    interruptions: u32,
    window: Text<Duration>,
    on_demand_for: Text<Duration>,
}

/// Minutes after midnight, written `HH:MM`.
struct Minute(u32);

/// A value written as a string and parsed on reading, so a bad one is reported where it is.
struct Text<T>(T);

trait TextValue: Sized {
    const EXPECTED: &'static str;
    fn parse_text(s: &str) -> Option<Self>;
}

impl<'de, T: TextValue> Deserialize<'de> for Text<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        T::parse_text(&s)
            .map(Text)
            .ok_or_else(|| serde::de::Error::custom(format!("expected {}, got {s:?}", T::EXPECTED)))
    }
}

impl TextValue for Duration {
    const EXPECTED: &'static str = "a duration like 30s, 10m or 1h30m";
    fn parse_text(s: &str) -> Option<Self> {
        Duration::from_str(s).ok()
    }
}

impl TextValue for Bytes {
    const EXPECTED: &'static str = "a size like 16GiB";
    fn parse_text(s: &str) -> Option<Self> {
        Bytes::from_str(s).ok()
    }
}

impl TextValue for ComputeCapability {
    const EXPECTED: &'static str = "a compute capability like 8.0";
    fn parse_text(s: &str) -> Option<Self> {
        let (major, minor) = s.trim().split_once('.')?;
        Some(ComputeCapability { major: major.parse().ok()?, minor: minor.parse().ok()? })
    }
}

impl TextValue for ProviderKind {
    const EXPECTED: &'static str = "one of aws, exec, local, slurm, kubernetes";
    fn parse_text(s: &str) -> Option<Self> {
        ProviderKind::parse(s)
    }
}

impl TextValue for CapacityPolicy {
    const EXPECTED: &'static str = "one of spot, on-demand, spot-then-on-demand";
    fn parse_text(s: &str) -> Option<Self> {
        match s {
            "spot" => Some(CapacityPolicy::Spot),
            "on-demand" => Some(CapacityPolicy::OnDemand),
            "spot-then-on-demand" => Some(CapacityPolicy::SpotThenOnDemand),
            _ => None,
        }
    }
}

impl TextValue for IdleAction {
    const EXPECTED: &'static str = "delete or stop";
    fn parse_text(s: &str) -> Option<Self> {
        match s {
            "delete" => Some(IdleAction::Delete),
            "stop" => Some(IdleAction::Stop),
            _ => None,
        }
    }
}

impl TextValue for Days {
    const EXPECTED: &'static str = "days like mon-fri, sat,sun or daily";
    fn parse_text(s: &str) -> Option<Self> {
        Days::parse(s).filter(|d| d.0 != 0)
    }
}

impl TextValue for Minute {
    const EXPECTED: &'static str = "a time of day like 08:00 (00:00 to 24:00)";
    fn parse_text(s: &str) -> Option<Self> {
        parse_hhmm(s).map(Minute)
    }
}

/// Defaults, documented in docs/fleets.md and the example below. No idle or stopped timeout
/// by default: both come from cost (`super::idle`).
const DEFAULT_BOOT_TIMEOUT_S: u64 = 10 * 60;

fn resolve(f: FleetFile, fail: &dyn Fn(&str, String) -> FleetConfigError) -> Result<FleetSpec, FleetConfigError> {
    if f.name.is_empty()
        || f.name.len() > 40
        || !f.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(fail("name", "use 1 to 40 letters, digits, - and _ (it names machines, tags and files)".into()));
    }
    let provider = f.provider.0;
    if f.max == 0 {
        return Err(fail("max", "must be at least 1".into()));
    }
    if f.max < f.min_idle {
        return Err(fail("max", format!("{} is below min_idle ({})", f.max, f.min_idle)));
    }
    if f.offers.is_empty() {
        return Err(fail("", "give at least one [[fleet.offer]] (instance type, zone, price_per_hour)".into()));
    }
    let mut offers = Vec::with_capacity(f.offers.len());
    for (j, o) in f.offers.into_iter().enumerate() {
        let price_ok = |p: f64| p.is_finite() && p >= 0.0;
        if o.instance_type.is_empty() {
            return Err(fail(&format!("offer[{j}].instance_type"), "must not be empty".into()));
        }
        if !price_ok(o.price_per_hour) {
            return Err(fail(
                &format!("offer[{j}].price_per_hour"),
                format!("expected USD ≥ 0, got {}", o.price_per_hour),
            ));
        }
        if let Some(p) = o.spot_price_per_hour.filter(|&p| !price_ok(p)) {
            return Err(fail(&format!("offer[{j}].spot_price_per_hour"), format!("expected USD ≥ 0, got {p}")));
        }
        offers.push(Offer {
            instance_type: o.instance_type,
            zone: o.zone,
            price_per_hour: o.price_per_hour,
            spot_price_per_hour: o.spot_price_per_hour,
        });
    }
    let capacity = f.capacity.map_or(CapacityPolicy::OnDemand, |c| c.0);
    let idle_action = f.idle_action.map_or_else(
        || super::idle::default_idle_action(provider, capacity == CapacityPolicy::OnDemand, &f.settings),
        |a| a.0,
    );
    if let Some(p) = f.stopped_price_per_hour.filter(|&p| !(p.is_finite() && p >= 0.0)) {
        return Err(fail("stopped_price_per_hour", format!("expected USD ≥ 0, got {p}")));
    }
    if idle_action == IdleAction::Stop && !provider.can_stop() {
        return Err(fail(
            "idle_action",
            format!("\"stop\" needs a provider that can stop machines (aws, exec, local); {provider} cannot"),
        ));
    }
    if capacity != CapacityPolicy::OnDemand && !matches!(provider, ProviderKind::Aws | ProviderKind::Exec) {
        return Err(fail("capacity", format!("{provider} has no spot capacity; use \"on-demand\"")));
    }
    let mut warm = Vec::with_capacity(f.warm.len());
    for (j, w) in f.warm.into_iter().enumerate() {
        let field = |k: &str| format!("warm[{j}].{k}");
        let Some(timezone) = time_zone(&w.timezone) else {
            return Err(fail(
                &field("timezone"),
                format!("unknown time zone {:?} (expected e.g. Europe/Berlin)", w.timezone),
            ));
        };
        if w.from.0 .0 >= w.to.0 .0 {
            return Err(fail(
                &field("to"),
                "must be after from (a window does not cross midnight; write two for a night shift)".into(),
            ));
        }
        if w.min_idle > f.max {
            return Err(fail(&field("min_idle"), format!("{} is above the fleet's max ({})", w.min_idle, f.max)));
        }
        warm.push(WarmSchedule {
            days: w.days.0,
            from_min: w.from.0 .0,
            to_min: w.to.0 .0,
            timezone,
            min_idle: w.min_idle,
        });
    }
    if let Some(b) = f.daily_budget.filter(|b| !(b.is_finite() && *b > 0.0)) {
        return Err(fail("daily_budget", format!("expected USD > 0, got {b}")));
    }
    let spot_breaker = match f.spot_breaker {
        None => SpotBreaker::default(),
        Some(b) => {
            if b.interruptions == 0 {
                return Err(fail("spot_breaker.interruptions", "must be at least 1".into()));
            }
            if b.window.0.as_millis() == 0 {
                return Err(fail("spot_breaker.window", "must be longer than 0s".into()));
            }
            SpotBreaker {
                interruptions: b.interruptions,
                window_s: b.window.0.as_std().as_secs(),
                on_demand_for_s: b.on_demand_for.0.as_std().as_secs(),
            }
        }
    };
    let boot_timeout_s = f.boot_timeout.map_or(DEFAULT_BOOT_TIMEOUT_S, |d| d.0.as_std().as_secs());
    if boot_timeout_s == 0 {
        return Err(fail("boot_timeout", "must be at least 1s".into()));
    }
    let m = f.machine;
    if let Some(t) = &m.time_limit {
        // The agent's start, its idle end before the limit (2m) and a job of a minute.
        let min = super::autoscale::MACHINE_START_ALLOWANCE_S + 120 + 60;
        if t.0.as_std().as_secs() < min {
            return Err(fail(
                "machine.time_limit",
                format!(
                    "must be at least {}m: a machine's first minute goes to starting its agent and its last two to ending idle",
                    min / 60
                ),
            ));
        }
    }
    Ok(FleetSpec {
        name: f.name,
        provider,
        settings: f.settings,
        machine: MachineSpec {
            gpu_model: m.gpu_model,
            gpus: m.gpus,
            gpu_memory: m.gpu_memory.0,
            compute_capability: m.compute_capability.map(|c| c.0),
            cpus: m.cpus,
            memory: m.memory.0,
            tags: m.tags,
            container_runtime: m.container_runtime,
            time_limit_s: m.time_limit.map(|d| d.0.as_std().as_secs()),
        },
        offers,
        capacity,
        min_idle: f.min_idle,
        max: f.max,
        idle_timeout_s: f.idle_timeout.map(|d| d.0.as_std().as_secs()),
        boot_timeout_s,
        idle_action,
        stopped_timeout_s: f.stopped_timeout.map(|d| d.0.as_std().as_secs()),
        stopped_price_per_hour: f
            .stopped_price_per_hour
            .unwrap_or_else(|| super::idle::default_stopped_price(provider)),
        warm,
        daily_budget: f.daily_budget,
        spot_breaker,
        simulate: f.simulate,
    })
}

/// `fleet[2] (a100): machine.gpus: invalid type …` from a serde path such as
/// `fleet[2].machine.gpus`.
fn describe_path(path: &serde_path_to_error::Path, name_of: &dyn Fn(usize) -> String, message: &str) -> String {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = path.iter().collect();
    let (head, rest) = match segments.as_slice() {
        [Segment::Map { key }, Segment::Seq { index }, rest @ ..] if key == "fleet" => {
            (format!("fleet[{index}] ({})", name_of(*index)), rest)
        }
        _ => return format!("{path}: {message}").trim_start_matches(".: ").to_string(),
    };
    let mut field = String::new();
    for s in rest {
        match s {
            Segment::Seq { index } => field.push_str(&format!("[{index}]")),
            Segment::Map { key } => {
                if !field.is_empty() {
                    field.push('.');
                }
                // The TOML key, not the Rust field: `[[fleet.offer]]` is `offers` inside.
                field.push_str(if key == "offers" { "offer" } else { key });
            }
            Segment::Enum { .. } | Segment::Unknown => {}
        }
    }
    if field.is_empty() {
        format!("{head}: {message}")
    } else {
        format!("{head}: {field}: {message}")
    }
}

/// Byte offsets of the `[[fleet]]` headers, in order.
fn fleet_headers(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let code = line.split('#').next().unwrap_or("");
        let compact: String = code.chars().filter(|c| !c.is_whitespace()).collect();
        if compact == "[[fleet]]" {
            out.push(offset + (line.len() - line.trim_start().len()));
        }
        offset += line.len();
    }
    out
}

/// Where `key = …` is first written within `region` of the text, to point an error at it.
fn key_offset(text: &str, region: (usize, usize), key: &str) -> Option<usize> {
    let key = key.split('[').next().unwrap_or(key);
    if key.is_empty() {
        return None;
    }
    let (start, end) = (region.0.min(text.len()), region.1.min(text.len()));
    let mut offset = start;
    for line in text.get(start..end)?.split_inclusive('\n') {
        let trimmed = line.trim_start();
        if let Some(after) = trimmed.strip_prefix(key) {
            if after.trim_start().starts_with('=') || after.starts_with(']') || after.starts_with('.') {
                return Some(offset + (line.len() - trimmed.len()));
            }
        }
        offset += line.len();
    }
    None
}

pub(crate) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset.min(text.len())).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let col = before.rfind('\n').map_or(before.chars().count(), |i| before[i + 1..].chars().count()) + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Capacity;

    /// A full fleet, as a person writes one. Kept in docs/simulate.md too.
    const EXAMPLE: &str = r#"
# example
[github]
api_url = "https://api.github.com"

[[fleet]]
name = "aws-t4"
provider = "aws"
capacity = "spot-then-on-demand"
min_idle = 0
max = 8
idle_timeout = "12m"
boot_timeout = "8m"
idle_action = "stop"
daily_budget = 50.0

[fleet.settings]
region = "us-east-1"
ami = "ami-0123456789abcdef0"

[fleet.machine]
gpu_model = "NVIDIA T4"
gpus = 1
gpu_memory = "16GiB"
compute_capability = "7.5"
cpus = 4
memory = "16GiB"
tags = { cloud = "aws" }

[[fleet.offer]]
instance_type = "g4dn.xlarge"
zone = "us-east-1a"
price_per_hour = 0.526
spot_price_per_hour = 0.21

[[fleet.offer]]
instance_type = "g4dn.xlarge"
zone = "us-east-1b"
price_per_hour = 0.526

[[fleet.warm]]
days = "mon-fri"
from = "08:00"
to = "19:00"
timezone = "Europe/Berlin"
min_idle = 2

[fleet.spot_breaker]
interruptions = 3
window = "10m"
on_demand_for = "1h"

[fleet.simulate]
boot = "uniform 60s 120s"
"#;

    fn parse_err(text: &str) -> String {
        match parse_fleets("server.toml", text) {
            Ok(f) => panic!("expected an error, parsed {} fleets", f.len()),
            Err(e) => e.to_string(),
        }
    }

    const MIN: &str = r#"
[[fleet]]
name = "t4"
provider = "exec"
max = 3
[fleet.machine]
gpu_model = "NVIDIA T4"
gpus = 1
gpu_memory = "16GiB"
cpus = 4
memory = "16GiB"
[[fleet.offer]]
instance_type = "t4-box"
price_per_hour = 0.5
"#;

    #[test]
    fn example_parses_in_full() {
        let fleets = parse_fleets("server.toml", EXAMPLE).expect("example parses");
        assert_eq!(fleets.len(), 1);
        let f = &fleets[0];
        assert_eq!(f.name, "aws-t4");
        assert_eq!(f.provider, ProviderKind::Aws);
        assert_eq!(f.capacity, CapacityPolicy::SpotThenOnDemand);
        assert_eq!((f.min_idle, f.max, f.idle_timeout_s, f.boot_timeout_s), (0, 8, Some(720), 480));
        assert_eq!(f.idle_action, IdleAction::Stop);
        assert_eq!(f.daily_budget, Some(50.0));
        assert_eq!(f.settings.get("region").and_then(|v| v.as_str()), Some("us-east-1"));
        assert_eq!(f.machine.gpus, 1);
        assert_eq!(f.machine.gpu_memory, Bytes(16 << 30));
        assert_eq!(f.machine.compute_capability, Some(ComputeCapability { major: 7, minor: 5 }));
        assert_eq!(f.machine.tags.get("cloud").map(String::as_str), Some("aws"));
        assert_eq!(f.offers.len(), 2);
        assert_eq!(f.offers[0].price(Capacity::Spot), 0.21);
        assert_eq!(f.offers[1].price(Capacity::Spot), 0.526, "no spot price: the on-demand one");
        assert_eq!(f.offers[1].label(), "g4dn.xlarge in us-east-1b");
        assert_eq!(f.warm.len(), 1);
        assert_eq!((f.warm[0].from_min, f.warm[0].to_min, f.warm[0].min_idle), (480, 1140, 2));
        assert_eq!(f.spot_breaker, SpotBreaker { interruptions: 3, window_s: 600, on_demand_for_s: 3600 });
        assert!(f.simulate.as_ref().is_some_and(|s| s.contains_key("boot")));
    }

    #[test]
    fn defaults() {
        let f = &parse_fleets("server.toml", MIN).expect("parses")[0];
        assert_eq!(f.capacity, CapacityPolicy::OnDemand);
        // An exec program that does not say it can stop: delete.
        assert_eq!(f.idle_action, IdleAction::Delete);
        assert_eq!((f.min_idle, f.idle_timeout_s, f.stopped_timeout_s, f.boot_timeout_s), (0, None, None, 600));
        assert_eq!(f.stopped_price_per_hour, crate::fleet::idle::DEFAULT_STOPPED_PRICE_PER_HOUR);
        assert_eq!(f.spot_breaker, SpotBreaker::default());
        assert!(f.machine.container_runtime);
        assert!(f.daily_budget.is_none() && f.warm.is_empty() && f.simulate.is_none());
    }

    /// The stopped tier by default where the provider can stop the same machine and start it
    /// again (aws on-demand, local, an exec program that says so); spot fleets delete.
    #[test]
    fn idle_action_defaults_to_stop_where_the_provider_can() {
        let action = |text: &str| parse_fleets("server.toml", text).expect("parses")[0].idle_action;
        assert_eq!(action(&MIN.replace("max = 3", "max = 3\n[fleet.settings]\nstop = true")), IdleAction::Stop);
        let aws = MIN.replace("\"exec\"", "\"aws\"");
        assert_eq!(action(&aws), IdleAction::Stop);
        assert_eq!(action(&aws.replace("max = 3", "max = 3\ncapacity = \"spot\"")), IdleAction::Delete);
        assert_eq!(action(&MIN.replace("\"exec\"", "\"local\"")), IdleAction::Stop);
        assert_eq!(action(&MIN.replace("\"exec\"", "\"slurm\"")), IdleAction::Delete);
        // Said in the config: as said.
        assert_eq!(action(&aws.replace("max = 3", "max = 3\nidle_action = \"delete\"")), IdleAction::Delete);
        let f = &parse_fleets(
            "server.toml",
            &aws.replace("max = 3", "max = 3\nstopped_timeout = \"2h\"\nstopped_price_per_hour = 0.05"),
        )
        .expect("parses")[0];
        assert_eq!((f.stopped_timeout_s, f.stopped_price_per_hour), (Some(7200), 0.05));
        let local = &parse_fleets("server.toml", &MIN.replace("\"exec\"", "\"local\"")).expect("parses")[0];
        assert_eq!(local.stopped_price_per_hour, 0.0, "a site's own disks bill nobody");
        let e =
            parse_fleets("server.toml", &aws.replace("max = 3", "max = 3\nstopped_price_per_hour = -1.0")).unwrap_err();
        assert!(e.to_string().contains("stopped_price_per_hour"), "{e}");
    }

    #[test]
    fn no_fleets_in_a_github_only_file() {
        let fleets = parse_fleets("server.toml", "[github]\napi_url = \"x\"\n").expect("parses");
        assert!(fleets.is_empty());
    }

    #[test]
    fn unknown_field_names_file_line_fleet_and_field() {
        let text = MIN.replace("cpus = 4", "cpus = 4\ngpu_cuont = 2");
        let e = parse_err(&text);
        assert!(e.starts_with("server.toml:11:1: fleet[0] (t4): machine.gpu_cuont: unknown field `gpu_cuont`, expected one of `gpu_model`"), "{e}");
    }

    #[test]
    fn bad_value_points_at_it() {
        let e = parse_err(&MIN.replace("gpu_memory = \"16GiB\"", "gpu_memory = \"lots\""));
        assert_eq!(e, "server.toml:9:14: fleet[0] (t4): machine.gpu_memory: expected a size like 16GiB, got \"lots\"");
        let e = parse_err(&MIN.replace("price_per_hour = 0.5", "price_per_hour = \"cheap\""));
        assert!(e.starts_with("server.toml:14:18: fleet[0] (t4): offer[0].price_per_hour: invalid type"), "{e}");
    }

    #[test]
    fn syntax_error_has_a_position() {
        let e = parse_err("[[fleet]]\nname = \n");
        assert!(e.starts_with("server.toml:2:"), "{e}");
    }

    #[test]
    fn cross_field_checks() {
        let e = parse_err(&MIN.replace("max = 3", "max = 3\nmin_idle = 4"));
        assert_eq!(e, "server.toml:5:1: fleet[0] (t4): max: 3 is below min_idle (4)");

        let no_offer = MIN.split("[[fleet.offer]]").next().unwrap_or_default().to_string();
        let e = parse_err(&no_offer);
        assert!(
            e.ends_with("fleet[0] (t4): give at least one [[fleet.offer]] (instance type, zone, price_per_hour)"),
            "{e}"
        );
        assert!(e.starts_with("server.toml:2:1:"), "points at the [[fleet]] header: {e}");

        let slurm = MIN.replace("provider = \"exec\"", "provider = \"slurm\"\nidle_action = \"stop\"");
        let e = parse_err(&slurm);
        assert_eq!(
            e,
            "server.toml:5:1: fleet[0] (t4): idle_action: \"stop\" needs a provider that can stop machines (aws, exec, local); slurm cannot"
        );

        let twice = format!("{MIN}{MIN}");
        let e = parse_err(&twice);
        assert_eq!(e, "server.toml:17:1: fleet[1] (t4): name: another fleet has this name");
    }

    #[test]
    fn warm_schedule_checks() {
        let warm = |body: &str| format!("{MIN}[[fleet.warm]]\n{body}\n");
        let e = parse_err(&warm(
            "days = \"mon-fri\"\nfrom = \"08:00\"\nto = \"19:00\"\ntimezone = \"Europe/Berlim\"\nmin_idle = 1",
        ));
        assert_eq!(
            e,
            "server.toml:19:1: fleet[0] (t4): warm[0].timezone: unknown time zone \"Europe/Berlim\" (expected e.g. Europe/Berlin)"
        );
        let e = parse_err(&warm("days = \"mon-fri\"\nfrom = \"19:00\"\nto = \"08:00\"\nmin_idle = 1"));
        assert!(e.contains("fleet[0] (t4): warm[0].to: must be after from"), "{e}");
        let e = parse_err(&warm("days = \"mon-fri\"\nfrom = \"25:00\"\nto = \"26:00\"\nmin_idle = 1"));
        assert!(e.contains("warm[0].from: expected a time of day like 08:00"), "{e}");
        let e = parse_err(&warm("days = \"weekdays\"\nfrom = \"08:00\"\nto = \"09:00\"\nmin_idle = 1"));
        assert!(e.contains("warm[0].days: expected days like mon-fri"), "{e}");
        let e = parse_err(&warm("days = \"mon\"\nfrom = \"08:00\"\nto = \"09:00\"\nmin_idle = 9"));
        assert!(e.contains("warm[0].min_idle: 9 is above the fleet's max (3)"), "{e}");
        let ok =
            parse_fleets("server.toml", &warm("days = \"sat,sun\"\nfrom = \"00:00\"\nto = \"24:00\"\nmin_idle = 1"));
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn provider_and_capacity_words() {
        let e = parse_err(&MIN.replace("provider = \"exec\"", "provider = \"gcp\""));
        assert!(
            e.contains("fleet[0] (t4): provider: expected one of aws, exec, local, slurm, kubernetes, got \"gcp\""),
            "{e}"
        );
        let e = parse_err(&MIN.replace("provider = \"exec\"", "provider = \"kubernetes\"\ncapacity = \"spot\""));
        assert!(e.contains("capacity: kubernetes has no spot capacity"), "{e}");
        let e = parse_err(&MIN.replace("max = 3", "max = 3\ndaily_budget = -1.0"));
        assert!(e.contains("daily_budget: expected USD > 0, got -1"), "{e}");
    }
}
