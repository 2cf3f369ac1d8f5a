//! A config value written as a string and parsed with its `FromStr` ([`Parsed`]), so a bad
//! value is reported at its position in the file (`file:line:column` and the field). Used by
//! every section of the server's config file; knows none of them.

use gpuci_core::duration::Duration;
use gpuci_core::gpu::{CmpOp, ComputeCapability, Constraint, Version};
use gpuci_core::quantity::Bytes;
use serde::{Deserialize, Deserializer};
use std::str::FromStr;

/// A value written as a string and parsed with its `FromStr`, so a bad value is reported at
/// its position in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed<T>(pub T);

pub trait FieldValue: Sized {
    const EXPECTED: &'static str;
    fn parse_field(s: &str) -> Option<Self>;
}

impl FieldValue for Duration {
    const EXPECTED: &'static str = "a duration like 30s, 10m or 1h30m";
    fn parse_field(s: &str) -> Option<Self> {
        Duration::from_str(s).ok()
    }
}

impl FieldValue for Bytes {
    const EXPECTED: &'static str = "a size like 50GiB or 512MiB";
    fn parse_field(s: &str) -> Option<Self> {
        Bytes::from_str(s).ok()
    }
}

impl FieldValue for Constraint<Bytes> {
    const EXPECTED: &'static str = "a memory size like >=40GiB";
    fn parse_field(s: &str) -> Option<Self> {
        let (op, rest) = CmpOp::split(s);
        Some(Constraint { op, value: Bytes::from_str(rest).ok()? })
    }
}

impl FieldValue for Constraint<Version> {
    const EXPECTED: &'static str = "a version like >=550 or >=12.4";
    fn parse_field(s: &str) -> Option<Self> {
        let (op, rest) = CmpOp::split(s);
        Some(Constraint { op, value: Version::parse(rest)? })
    }
}

impl FieldValue for Constraint<ComputeCapability> {
    const EXPECTED: &'static str = "a compute capability like >=8.0";
    fn parse_field(s: &str) -> Option<Self> {
        let (op, rest) = CmpOp::split(s);
        let (major, minor) = rest.split_once('.').unwrap_or((rest, "0"));
        Some(Constraint { op, value: ComputeCapability { major: major.parse().ok()?, minor: minor.parse().ok()? } })
    }
}

impl<'de, T: FieldValue> Deserialize<'de> for Parsed<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        T::parse_field(&s)
            .map(Parsed)
            .ok_or_else(|| serde::de::Error::custom(format!("expected {}, got {s:?}", T::EXPECTED)))
    }
}
