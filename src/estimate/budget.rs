//! Memory budgets: sizes written by people (`24GiB`, `512MB`) and the memory available
//! on the host.

use crate::error::{Error, Result};

/// Parses a byte size: a number with an optional unit, `B`, `KB`/`MB`/`GB`/`TB` (powers
/// of 1000) or `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024); `K`/`M`/`G`/`T` alone mean the
/// binary units. Case-insensitive; a space before the unit is allowed; fractions are
/// allowed (`1.5GiB`).
pub fn parse_bytes(text: &str) -> Result<u64> {
    let bad = |why: &str| {
        Error::config(
            "memory size",
            format!("`{text}` {why}; write e.g. 24GiB, 512MB or 1073741824"),
        )
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| bad("does not start with a number"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        _ => return Err(bad("has an unknown unit")),
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(bad("is not a size between 1 byte and 16 EiB"));
    }
    Ok(bytes as u64)
}

/// Memory the host can give a new allocation without swapping (`MemAvailable` of
/// `/proc/meminfo`), where the system says.
pub fn host_available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_decimal_and_binary_units() {
        assert_eq!(parse_bytes("24GiB").unwrap(), 24 << 30);
        assert_eq!(parse_bytes("24 gib").unwrap(), 24 << 30);
        assert_eq!(parse_bytes("80GB").unwrap(), 80_000_000_000);
        assert_eq!(parse_bytes("512M").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5KiB").unwrap(), 1536);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        for bad in ["", "GiB", "12 parsecs", "-3GB", "0", "1e400", "1.2.3GB"] {
            let e = parse_bytes(bad).unwrap_err().to_string();
            assert!(e.contains("24GiB"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_host_reports_available_memory() {
        if cfg!(target_os = "linux") {
            assert!(host_available_memory().unwrap() > 0);
        }
    }
}
