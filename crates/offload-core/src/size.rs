//! Byte sizes: parsing user input (`"3GB"`, `"13.5GiB"`, `"1024"`) and formatting as the anchor's record does.
//!
//! Parsing is the one place where size strings from users (arguments, environment, configuration files) are
//! validated; every inner layer works on plain `u64` byte counts.

use std::fmt;

/// A size string that could not be read, with the accepted forms in its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot read size {input:?}: {problem}; use a byte count (\"1048576\") or a number with a unit: \
     KB/MB/GB/TB (decimal, \"3GB\" = 3,000,000,000 bytes) or KiB/MiB/GiB/TiB (binary, \"13.5GiB\"); \
     units are case-insensitive and always mean bytes"
)]
pub struct SizeError {
    /// The string as given.
    pub input: String,
    /// What is wrong with it.
    pub problem: &'static str,
}

const UNITS: &[(&str, u64)] = &[
    ("tib", 1 << 40),
    ("gib", 1 << 30),
    ("mib", 1 << 20),
    ("kib", 1 << 10),
    ("tb", 1_000_000_000_000),
    ("gb", 1_000_000_000),
    ("mb", 1_000_000),
    ("kb", 1_000),
    ("b", 1),
];

/// Parses a size given by a user into bytes.
///
/// Accepted: a plain byte count (`"1024"`), or a decimal number followed by a unit, optionally separated by
/// spaces. `KB`, `MB`, `GB`, `TB` are decimal (powers of 1000); `KiB`, `MiB`, `GiB`, `TiB` are binary (powers of
/// 1024); `B` is bytes. Units are case-insensitive and always mean bytes: unlike accelerate, `"3gb"` is
/// 3,000,000,000 bytes, not bits. Fractions are rounded down to a whole byte.
///
/// ```
/// use offload_core::size::parse_size;
/// assert_eq!(parse_size("3GB").unwrap(), 3_000_000_000);
/// assert_eq!(parse_size("3gb").unwrap(), 3_000_000_000);
/// assert_eq!(parse_size("13.5GiB").unwrap(), 14_495_514_624);
/// assert_eq!(parse_size("1024").unwrap(), 1024);
/// assert!(parse_size("3 bananas").is_err());
/// ```
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let err = |problem| SizeError { input: input.to_string(), problem };
    let trimmed = input.trim();
    if trimmed.is_empty() {
        return Err(err("it is empty"));
    }
    let split = trimmed.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit = unit.trim_start();
    if number.is_empty() {
        return Err(err("it does not start with a number"));
    }
    let multiplier = if unit.is_empty() {
        1
    } else {
        let lower = unit.to_ascii_lowercase();
        UNITS.iter().find(|(name, _)| *name == lower).map(|(_, m)| *m).ok_or_else(|| err("the unit is unknown"))?
    };
    if !number.contains('.') {
        let whole: u64 = number.parse().map_err(|_| err("the number is too large"))?;
        return whole.checked_mul(multiplier).ok_or_else(|| err("the size does not fit in 64 bits"));
    }
    if unit.is_empty() {
        return Err(err("a fraction needs a unit"));
    }
    let (whole, fraction) = number.split_once('.').ok_or_else(|| err("the number is malformed"))?;
    if fraction.contains('.') || (whole.is_empty() && fraction.is_empty()) {
        return Err(err("the number is malformed"));
    }
    // Exact decimal arithmetic: whole * m + fraction * m / 10^digits, so "13.5GiB" is exact and "0.1GB" is
    // 100,000,000 bytes, not 99,999,999.
    let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| err("the number is too large"))? };
    let digits = fraction.len().min(30);
    let fraction = &fraction[..digits];
    let numerator: u128 =
        if fraction.is_empty() { 0 } else { fraction.parse().map_err(|_| err("the number is malformed"))? };
    let scale = 10u128.pow(digits as u32);
    let multiplier = u128::from(multiplier);
    let bytes = whole
        .checked_mul(multiplier)
        .and_then(|w| numerator.checked_mul(multiplier).map(|f| w + f / scale))
        .ok_or_else(|| err("the size does not fit in 64 bits"))?;
    u64::try_from(bytes).map_err(|_| err("the size does not fit in 64 bits"))
}

/// Formats a byte count as the anchor's record does: binary values labelled `B`, `KB`, `MB`, `GB`.
///
/// Bytes print without decimals (`1023 B`); larger values with two (`8.50 KB`, `159.87 MB`, `7.49 GB`). `GB` is
/// the largest unit, so 2 TiB prints `2048.00 GB`. The labels say KB/MB/GB but the values are KiB/MiB/GiB,
/// exactly like diffusers' `format_size`.
///
/// ```
/// use offload_core::size::format_size;
/// assert_eq!(format_size(8704), "8.50 KB");
/// assert_eq!(format_size(167_639_366), "159.87 MB");
/// assert_eq!(format_size(1023), "1023 B");
/// ```
pub fn format_size(bytes: u64) -> String {
    let mut value = bytes as f64;
    for unit in ["B", "KB", "MB"] {
        if value < 1024.0 {
            return if unit == "B" { format!("{value:.0} {unit}") } else { format!("{value:.2} {unit}") };
        }
        value /= 1024.0;
    }
    format!("{value:.2} GB")
}

/// A rate in bytes per second, in decimal units as link and disk rates are quoted: GB/s from 0.1 GB/s up
/// (`25.00 GB/s`, `0.32 GB/s`), MB/s below that from 0.1 MB/s, KB/s below that, each with two decimals, so a
/// slow measured rate never prints as `0.00 GB/s`.
///
/// ```
/// use offload_core::size::format_rate;
/// assert_eq!(format_rate(25e9), "25.00 GB/s");
/// assert_eq!(format_rate(0.1e9), "0.10 GB/s");
/// assert_eq!(format_rate(3.1e6), "3.10 MB/s");
/// assert_eq!(format_rate(42_000.0), "42.00 KB/s");
/// ```
pub fn format_rate(bytes_per_second: f64) -> String {
    if bytes_per_second >= 1e8 {
        format!("{:.2} GB/s", bytes_per_second / 1e9)
    } else if bytes_per_second >= 1e5 {
        format!("{:.2} MB/s", bytes_per_second / 1e6)
    } else {
        format!("{:.2} KB/s", bytes_per_second / 1e3)
    }
}

/// A byte count that displays the way the record does ([`format_size`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Size(pub u64);

impl Size {
    /// The byte count.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&format_size(self.0))
    }
}

impl std::str::FromStr for Size {
    type Err = SizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_size(s).map(Size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_accepted_form() {
        let cases: &[(&str, u64)] = &[
            ("0", 0),
            ("1024", 1024),
            ("3GB", 3_000_000_000),
            ("3gb", 3_000_000_000),
            ("3Gb", 3_000_000_000),
            ("3 GB", 3_000_000_000),
            ("3GiB", 3 << 30),
            ("3gib", 3 << 30),
            ("13.5GiB", 14_495_514_624),
            ("16GB", 16_000_000_000),
            ("0.1GB", 100_000_000),
            (".5KiB", 512),
            ("1.KiB", 1024),
            ("512B", 512),
            ("1TiB", 1 << 40),
            ("  7MB  ", 7_000_000),
        ];
        for (input, expected) in cases {
            assert_eq!(parse_size(input), Ok(*expected), "{input}");
        }
    }

    #[test]
    fn refuses_malformed_sizes_with_the_accepted_forms() {
        for input in
            ["", "GB", "3 bananas", "-3GB", "3.5", "1.2.3GB", "3GBs", "99999999999999999999", "20000000TB", "."]
        {
            let err = parse_size(input).unwrap_err();
            assert_eq!(err.input, input);
            let message = err.to_string();
            assert!(message.contains("KiB/MiB/GiB/TiB"), "{message}");
        }
    }

    #[test]
    fn formats_like_the_anchor() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(format_size(1024), "1.00 KB");
        assert_eq!(format_size(8704), "8.50 KB");
        assert_eq!(format_size(1536 * 1024), "1.50 MB");
        assert_eq!(format_size(167_639_366), "159.87 MB");
        assert_eq!(format_size(8_044_936_192), "7.49 GB");
        assert_eq!(format_size(12_309_817_472), "11.46 GB");
        assert_eq!(format_size(2 << 40), "2048.00 GB");
        assert_eq!(format!("{:>10}|", Size(1024)), "   1.00 KB|");
    }
}
