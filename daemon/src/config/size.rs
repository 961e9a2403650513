//! Byte sizes in the configuration: an integer number of bytes, or a string with an IEC
//! unit (`"4KiB"`, `"64 MiB"`, `"1GiB"`).

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

const UNITS: [(&str, u64); 6] = [
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("B", 1),
    ("", 1),
];

impl ByteSize {
    pub fn parse(text: &str) -> Result<ByteSize, String> {
        let text = text.trim();
        let split = text
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let unit = unit.trim();
        let number: u64 = number.parse().map_err(|_| {
            format!(
                "{text:?} is not a size: write bytes as a number or with a unit, e.g. \"64KiB\""
            )
        })?;
        let (_, scale) = UNITS.iter().find(|(u, _)| *u == unit).ok_or_else(|| {
            format!("{text:?}: unknown unit {unit:?} (use B, KiB, MiB, GiB or TiB)")
        })?;
        number
            .checked_mul(*scale)
            .map(ByteSize)
            .ok_or_else(|| format!("{text:?} is too large"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, scale) in UNITS {
            if self.0 >= scale && self.0 % scale == 0 && !unit.is_empty() && scale > 1 {
                return write!(f, "{}{unit}", self.0 / scale);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<ByteSize, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: a number of bytes or a string such as \"64KiB\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("{v} is negative; sizes are 0 or more bytes")))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_prints_them_back() {
        for (text, bytes, shown) in [
            ("4096", 4096, "4KiB"),
            ("4KiB", 4096, "4KiB"),
            ("64 MiB", 64 << 20, "64MiB"),
            ("1GiB", 1 << 30, "1GiB"),
            ("100B", 100, "100B"),
            ("1536KiB", 1536 << 10, "1536KiB"),
        ] {
            let size = ByteSize::parse(text).unwrap();
            assert_eq!(size.0, bytes, "{text}");
            assert_eq!(size.to_string(), shown);
        }
    }

    #[test]
    fn refuses_what_is_not_a_size() {
        for text in ["", "KiB", "4kb", "-4KiB", "1.5GiB", "99999999999TiB"] {
            assert!(ByteSize::parse(text).is_err(), "{text}");
        }
    }
}
