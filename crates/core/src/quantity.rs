//! Byte quantities as written by people: `40GiB`, `80GB`, `512MiB`, `8G`.

use std::fmt;

/// A number of bytes.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
    utoipa::ToSchema,
)]
pub struct Bytes(pub u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: expected a number with a unit, e.g. 40GiB, 512MiB, 80GB")]
pub struct BytesError {
    pub input: String,
}

impl Bytes {
    pub const MIB: u64 = 1 << 20;
    pub const GIB: u64 = 1 << 30;
    pub fn from_mib(mib: u64) -> Self {
        Self(mib.saturating_mul(Self::MIB))
    }
    pub fn mib(self) -> u64 {
        self.0 / Self::MIB
    }
}

impl std::str::FromStr for Bytes {
    type Err = BytesError;
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = || BytesError { input: input.to_string() };
        let s = input.trim();
        let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        if num.is_empty() {
            return Err(err());
        }
        let n: f64 = num.parse().map_err(|_| err())?;
        let mult: f64 = match unit.trim() {
            "" | "B" => 1.0,
            "K" | "KiB" => 1024.0,
            "KB" => 1e3,
            "M" | "MiB" => 1024.0 * 1024.0,
            "MB" => 1e6,
            "G" | "GiB" => (1u64 << 30) as f64,
            "GB" => 1e9,
            "T" | "TiB" => (1u64 << 40) as f64,
            "TB" => 1e12,
            _ => return Err(err()),
        };
        let v = n * mult;
        if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
            return Err(err());
        }
        Ok(Bytes(v as u64))
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b >= Self::GIB {
            let g = b as f64 / Self::GIB as f64;
            if (g - g.round()).abs() < 0.05 {
                write!(f, "{} GiB", g.round() as u64)
            } else {
                write!(f, "{g:.1} GiB")
            }
        } else if b >= Self::MIB {
            write!(f, "{} MiB", b / Self::MIB)
        } else {
            write!(f, "{b} B")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parses_units() {
        assert_eq!("40GiB".parse::<Bytes>().unwrap().0, 40 << 30);
        assert_eq!("512MiB".parse::<Bytes>().unwrap().0, 512 << 20);
        assert_eq!("80GB".parse::<Bytes>().unwrap().0, 80_000_000_000);
        assert_eq!("8G".parse::<Bytes>().unwrap().0, 8 << 30);
        assert!("lots".parse::<Bytes>().is_err());
        assert!("10XB".parse::<Bytes>().is_err());
    }
    #[test]
    fn displays_human() {
        assert_eq!(Bytes(8 << 30).to_string(), "8 GiB");
        assert_eq!(Bytes(512 << 20).to_string(), "512 MiB");
    }
}
