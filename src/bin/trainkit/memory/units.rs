//! How `trainkit memory` writes counts and sizes.

/// `1234567` as `1,234,567`.
pub(super) fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes in GiB, two decimals.
pub(super) fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}

/// Bytes in GB, two decimals.
pub(super) fn gb(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / 1e9)
}

/// `1.25` GiB, `-0.50` when it costs memory.
pub(super) fn signed_gib(baseline: u64, peak: u64) -> String {
    format!(
        "{:.2}",
        (baseline as f64 - peak as f64) / (1u64 << 30) as f64
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouping() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1000), "1,000");
        assert_eq!(group(124_439_808), "124,439,808");
    }
}
