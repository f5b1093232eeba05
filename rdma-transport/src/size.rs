//! Sizes as people write them on command lines: `4096`, `64KiB`, `512MiB`, `1GiB`.

/// Parses a byte count with an optional binary unit (`B`, `KiB`/`K`,
/// `MiB`/`M`, `GiB`/`G`).
///
/// # Errors
/// A message naming the input when it is not a number with a known unit or
/// overflows `usize`.
pub fn parse_size_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let mult: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" => 1 << 10,
        "MiB" | "M" => 1 << 20,
        "GiB" | "G" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit {other:?} in {s:?} (use KiB, MiB or GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

#[cfg(test)]
mod tests {
    use super::parse_size_bytes;

    #[test]
    fn units_and_errors() {
        assert_eq!(parse_size_bytes("4096"), Ok(4096));
        assert_eq!(parse_size_bytes("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size_bytes(" 2 MiB "), Ok(2 << 20));
        assert_eq!(parse_size_bytes("1G"), Ok(1 << 30));
        for bad in ["", "MiB", "1TiB", "-1", "99999999999999999999GiB"] {
            assert!(parse_size_bytes(bad).is_err(), "{bad:?}");
        }
    }
}
