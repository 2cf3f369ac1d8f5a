//! GPU facts (what a host has) and GPU requirements (what a job asks for).
//!
//! Facts come from the agent's inventory (NVML, nvidia-smi, or a simulated inventory, which
//! is always marked `simulated`). Requirements come from a pipeline step's `gpus`/`gpu`.
//! Matching a requirement against a fact is pure and lives here.

use crate::quantity::Bytes;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::fmt;

/// CUDA compute capability, e.g. 9.0 for H100.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
    utoipa::ToSchema,
)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A dotted version (driver `535.104.05`, CUDA `12.4`). Compared numerically, part by part;
/// a missing part counts as 0, so `12.4` == `12.4.0`. Shown as it was written: drivers number
/// their parts with leading zeros (`535.104.05`), which the numbers alone would lose.
/// On the wire and in the API it is that text.
#[derive(Clone, Debug)]
pub struct Version {
    parts: Vec<u32>,
    text: String,
}

impl Version {
    /// A version from its numeric parts, shown as `a.b.c`.
    pub fn new(parts: Vec<u32>) -> Version {
        let text = parts.iter().map(u32::to_string).collect::<Vec<_>>().join(".");
        Version { parts, text }
    }

    pub fn parse(s: &str) -> Option<Version> {
        let s = s.trim();
        let parts: Option<Vec<u32>> = s.split('.').map(|p| p.parse().ok()).collect();
        parts.filter(|p| !p.is_empty()).map(|parts| Version { parts, text: s.to_string() })
    }

    pub fn parts(&self) -> &[u32] {
        &self.parts
    }

    fn significant(&self) -> &[u32] {
        let n = self.parts.iter().rposition(|&p| p != 0).map_or(0, |i| i + 1);
        &self.parts[..n]
    }
}

impl PartialEq for Version {
    fn eq(&self, other: &Self) -> bool {
        self.significant() == other.significant()
    }
}
impl Eq for Version {}
impl std::hash::Hash for Version {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.significant().hash(state);
    }
}

impl Ord for Version {
    fn cmp(&self, other: &Self) -> Ordering {
        let n = self.parts.len().max(other.parts.len());
        for i in 0..n {
            let a = self.parts.get(i).copied().unwrap_or(0);
            let b = other.parts.get(i).copied().unwrap_or(0);
            match a.cmp(&b) {
                Ordering::Equal => continue,
                o => return o,
            }
        }
        Ordering::Equal
    }
}
impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Serialize for Version {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Version {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Version::parse(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("invalid version {s:?}: expected e.g. 535.104.05")))
    }
}

impl schemars::JsonSchema for Version {
    fn schema_name() -> String {
        "Version".into()
    }
    fn json_schema(_: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        schemars::schema::SchemaObject {
            instance_type: Some(schemars::schema::InstanceType::String.into()),
            string: Some(Box::new(schemars::schema::StringValidation {
                pattern: Some(VERSION_PATTERN.into()),
                ..Default::default()
            })),
            ..Default::default()
        }
        .into()
    }
}

const VERSION_PATTERN: &str = "^[0-9]+(\\.[0-9]+)*$";

impl utoipa::PartialSchema for Version {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some(VERSION_PATTERN))
            .description(Some("A dotted version such as 535.104.05 or 12.4"))
            .into()
    }
}
impl utoipa::ToSchema for Version {}

/// A comparison operator in a requirement such as `">=40GiB"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CmpOp {
    Ge,
    Gt,
    Le,
    Lt,
    Eq,
}

impl CmpOp {
    pub fn holds<T: Ord>(self, actual: &T, wanted: &T) -> bool {
        match self {
            CmpOp::Ge => actual >= wanted,
            CmpOp::Gt => actual > wanted,
            CmpOp::Le => actual <= wanted,
            CmpOp::Lt => actual < wanted,
            CmpOp::Eq => actual == wanted,
        }
    }
    pub fn symbol(self) -> &'static str {
        match self {
            CmpOp::Ge => ">=",
            CmpOp::Gt => ">",
            CmpOp::Le => "<=",
            CmpOp::Lt => "<",
            CmpOp::Eq => "==",
        }
    }
    /// Split a leading operator off `s`; no operator means `>=` for quantities and versions
    /// (asking for "40GiB" means "at least 40GiB"), which is what people mean.
    pub fn split(s: &str) -> (CmpOp, &str) {
        let s = s.trim();
        for (p, op) in [
            (">=", CmpOp::Ge),
            ("<=", CmpOp::Le),
            ("==", CmpOp::Eq),
            (">", CmpOp::Gt),
            ("<", CmpOp::Lt),
            ("=", CmpOp::Eq),
        ] {
            if let Some(rest) = s.strip_prefix(p) {
                return (op, rest.trim());
            }
        }
        (CmpOp::Ge, s)
    }
}

/// `op value`, e.g. `>= 40 GiB`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema, utoipa::ToSchema)]
pub struct Constraint<T> {
    pub op: CmpOp,
    pub value: T,
}

impl<T: Ord> Constraint<T> {
    pub fn holds(&self, actual: &T) -> bool {
        self.op.holds(actual, &self.value)
    }
}

impl<T: fmt::Display> fmt::Display for Constraint<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.op.symbol(), self.value)
    }
}

/// What a job asks of its GPUs. `count == 0` means the job needs no GPU.
#[derive(
    Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema, utoipa::ToSchema,
)]
pub struct GpuRequirements {
    pub count: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Constraint<Bytes>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<Constraint<ComputeCapability>>,
    /// Glob on the model name (`H100*`, `*A100*`), case-insensitive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<Constraint<Version>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<Constraint<Version>>,
    /// A MIG profile such as `1g.10gb`; only hosts with MIG instances of that profile match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_profile: Option<String>,
}

/// One MIG instance on a GPU in MIG mode.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema, utoipa::ToSchema)]
pub struct MigInstance {
    pub uuid: String,
    pub profile: String,
    pub memory: Bytes,
}

/// What is known of one GPU on a host.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema, utoipa::ToSchema)]
pub struct GpuInfo {
    pub uuid: String,
    pub index: u32,
    pub name: String,
    pub memory: Bytes,
    pub compute_capability: ComputeCapability,
    pub driver_version: Version,
    #[serde(default)]
    pub cuda_driver_version: Option<Version>,
    #[serde(default)]
    pub mig_enabled: Option<bool>,
    #[serde(default)]
    pub mig_instances: Vec<MigInstance>,
    #[serde(default)]
    pub ecc_enabled: Option<bool>,
    #[serde(default)]
    pub persistence_mode: Option<bool>,
    #[serde(default)]
    pub pci_bus_id: String,
    /// Device node, e.g. `/dev/nvidia0`.
    pub device_node: String,
    /// True for a simulated inventory. Shown wherever the GPU shows.
    #[serde(default)]
    pub simulated: bool,
}

/// Why a GPU does not meet a requirement, in words for a person.
pub fn mismatch(req: &GpuRequirements, gpu: &GpuInfo) -> Option<String> {
    if let Some(c) = &req.memory {
        if !c.holds(&gpu.memory) {
            return Some(format!("memory {} (needs {c})", gpu.memory));
        }
    }
    if let Some(c) = &req.compute_capability {
        if !c.holds(&gpu.compute_capability) {
            return Some(format!("compute capability {} (needs {c})", gpu.compute_capability));
        }
    }
    if let Some(glob) = &req.model {
        if !model_matches(glob, &gpu.name) {
            return Some(format!("model {:?} (needs {glob})", gpu.name));
        }
    }
    if let Some(c) = &req.driver {
        if !c.holds(&gpu.driver_version) {
            return Some(format!("driver {} (needs {c})", gpu.driver_version));
        }
    }
    if let Some(c) = &req.cuda {
        match &gpu.cuda_driver_version {
            Some(v) if c.holds(v) => {}
            Some(v) => return Some(format!("CUDA {v} (needs {c})")),
            None => return Some(format!("unknown CUDA version (needs {c})")),
        }
    }
    if let Some(p) = &req.mig_profile {
        if !gpu.mig_instances.iter().any(|m| &m.profile == p) {
            return Some(format!("no MIG instance of profile {p}"));
        }
    }
    None
}

/// A model glob matches the full name or the name without its vendor prefix, so `H100*`
/// matches "NVIDIA H100 80GB HBM3" as a person expects.
pub fn model_matches(glob: &str, name: &str) -> bool {
    glob_match(glob, name) || name.strip_prefix("NVIDIA ").is_some_and(|n| glob_match(glob, n))
}

/// Case-insensitive glob with `*` and `?`.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.to_lowercase().chars().collect();
    let t: Vec<char> = text.to_lowercase().chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compare_numerically() {
        let v = |s| Version::parse(s).unwrap();
        assert!(v("535.104.05") > v("535"));
        assert!(v("12.10") > v("12.4"));
        assert_eq!(v("12.4"), v("12.4.0"));
        assert!(Version::parse("12.x").is_none());
        assert_eq!(v("535.104.05").to_string(), "535.104.05", "shown as written");
        assert_eq!(serde_json::to_string(&v("535.104.05")).unwrap(), "\"535.104.05\"");
        assert_eq!(serde_json::from_str::<Version>("\"12.4\"").unwrap(), v("12.4"));
        assert!(serde_json::from_str::<Version>("\"x\"").is_err());
    }

    #[test]
    fn glob() {
        assert!(!glob_match("H100*", "NVIDIA H100 80GB HBM3"));
        assert!(model_matches("H100*", "NVIDIA H100 80GB HBM3"));
        assert!(glob_match("*H100*", "NVIDIA H100 80GB HBM3"));
        assert!(glob_match("nvidia a100?", "NVIDIA A100X"));
        assert!(!glob_match("*A100*", "NVIDIA H100"));
    }
}
