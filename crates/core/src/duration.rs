//! Human durations as written in pipeline files and flags: `90s`, `30m`, `1h30m`, `250ms`.

use std::fmt;
use std::str::FromStr;

/// A duration that parses from and prints as `1h30m`-style text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Duration(pub std::time::Duration);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {why} (expected e.g. 90s, 30m, 1h30m, 250ms)")]
pub struct DurationError {
    pub input: String,
    pub why: &'static str,
}

impl Duration {
    pub const fn from_secs(s: u64) -> Self {
        Self(std::time::Duration::from_secs(s))
    }
    pub const fn from_millis(ms: u64) -> Self {
        Self(std::time::Duration::from_millis(ms))
    }
    pub fn as_std(self) -> std::time::Duration {
        self.0
    }
    pub fn as_millis(self) -> u64 {
        u64::try_from(self.0.as_millis()).unwrap_or(u64::MAX)
    }
}

impl FromStr for Duration {
    type Err = DurationError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |why| DurationError { input: input.to_string(), why };
        let s = input.trim();
        if s.is_empty() {
            return Err(err("empty"));
        }
        let mut total_ms: u128 = 0;
        let mut rest = s;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return Err(err("expected a number"));
            }
            let n: u128 = rest[..digits].parse().map_err(|_| err("number too large"))?;
            rest = &rest[digits..];
            let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
            let unit = &rest[..unit_len];
            rest = &rest[unit_len..];
            let ms_per = match unit {
                "ms" => 1,
                "s" => 1_000,
                "m" => 60_000,
                "h" => 3_600_000,
                "d" => 86_400_000,
                "" => return Err(err("missing unit (ms, s, m, h, d)")),
                _ => return Err(err("unknown unit (use ms, s, m, h, d)")),
            };
            total_ms = total_ms
                .checked_add(n.checked_mul(ms_per).ok_or_else(|| err("too large"))?)
                .ok_or_else(|| err("too large"))?;
        }
        let ms = u64::try_from(total_ms).map_err(|_| err("too large"))?;
        Ok(Self::from_millis(ms))
    }
}

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ms = self.as_millis();
        if ms == 0 {
            return f.write_str("0s");
        }
        for (unit, per) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)] {
            if ms >= per {
                write!(f, "{}{}", ms / per, unit)?;
                ms %= per;
            }
        }
        Ok(())
    }
}

impl serde::Serialize for Duration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Duration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for Duration {
    fn schema_name() -> String {
        "Duration".into()
    }
    fn json_schema(_: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        schemars::schema::SchemaObject {
            instance_type: Some(schemars::schema::InstanceType::String.into()),
            string: Some(Box::new(schemars::schema::StringValidation {
                pattern: Some("^([0-9]+(ms|s|m|h|d))+$".into()),
                ..Default::default()
            })),
            metadata: Some(Box::new(schemars::schema::Metadata {
                description: Some("A duration such as 90s, 30m, 1h30m or 250ms".into()),
                ..Default::default()
            })),
            ..Default::default()
        }
        .into()
    }
}

impl utoipa::PartialSchema for Duration {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some("^([0-9]+(ms|s|m|h|d))+$"))
            .description(Some("A duration such as 90s, 30m, 1h30m or 250ms"))
            .into()
    }
}
impl utoipa::ToSchema for Duration {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_compound_durations() {
        assert_eq!("90s".parse::<Duration>().unwrap(), Duration::from_secs(90));
        assert_eq!("30m".parse::<Duration>().unwrap(), Duration::from_secs(1800));
        assert_eq!("1h30m".parse::<Duration>().unwrap(), Duration::from_secs(5400));
        assert_eq!("250ms".parse::<Duration>().unwrap(), Duration::from_millis(250));
        assert_eq!("1d".parse::<Duration>().unwrap(), Duration::from_secs(86_400));
    }

    #[test]
    fn rejects_bad_durations() {
        for bad in ["", "10", "m", "10x", "1h30", "-5s", "1.5h", "99999999999999999999999d"] {
            assert!(bad.parse::<Duration>().is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn display_round_trips() {
        for s in ["1h30m", "90s", "250ms", "1d2h3m4s5ms"] {
            let d: Duration = s.parse().unwrap();
            let again: Duration = d.to_string().parse().unwrap();
            assert_eq!(d, again);
        }
        assert_eq!(Duration::from_secs(5400).to_string(), "1h30m");
    }
}
