//! The GPA ranges a page-server exports and where each one lives in its
//! exported memory: one after the other, in the order given (range k at
//! `remote_offset` = the sum of the lengths before it). [`Layout::new`]
//! checks them: page-aligned, non-empty, no two overlapping.

use std::fmt;
use std::str::FromStr;

use rdma_transport::PAGE_SIZE;

const PAGE_BYTES: u64 = PAGE_SIZE as u64;

/// One GPA range a page-server exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportedRange {
    /// First GPA of the range (page aligned).
    pub gpa_start: u64,
    /// Its length (a positive multiple of the page size).
    pub length_bytes: u64,
}

impl ExportedRange {
    /// The range `[gpa_start, gpa_start + length_bytes)`.
    pub fn new(gpa_start: u64, length_bytes: u64) -> Self {
        Self {
            gpa_start,
            length_bytes,
        }
    }

    /// One past its last GPA (as u128: never overflows).
    fn end(&self) -> u128 {
        u128::from(self.gpa_start) + u128::from(self.length_bytes)
    }
}

impl fmt::Display for ExportedRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}:{:#x}", self.gpa_start, self.length_bytes)
    }
}

/// Parses `GPA_START:LENGTH`, as `--range` takes it: the start in decimal
/// or `0x` hex, the length in decimal, `0x` hex, or with a size unit
/// (`64KiB`, `512MiB`, `1GiB`; see `rdma_transport::size`). Alignment is
/// checked by [`Layout::new`], not here.
impl FromStr for ExportedRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (start, length) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?}: expected GPA_START:LENGTH, e.g. 0x40000000:256MiB"))?;
        let gpa_start = parse_u64(start.trim()).map_err(|e| format!("{s:?}: GPA start: {e}"))?;
        let length_bytes = match length.trim().strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).map_err(|e| e.to_string()),
            None => rdma_transport::size::parse_size_bytes(length).and_then(|n| {
                u64::try_from(n).map_err(|_| format!("length {length:?} overflows u64"))
            }),
        }
        .map_err(|e| format!("{s:?}: length: {e}"))?;
        Ok(Self::new(gpa_start, length_bytes))
    }
}

/// A decimal or `0x` hex u64.
///
/// # Errors
/// A message naming the input.
pub(crate) fn parse_u64(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("{s:?}: {e}"))
}

/// An exported range with its place in the exported memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedRange {
    /// First GPA of the range.
    pub gpa_start: u64,
    /// Its length.
    pub length_bytes: u64,
    /// Where its first page is in the exported memory (what the node
    /// registers as the range's `remote_offset`).
    pub remote_offset: u64,
}

/// Why a set of ranges cannot be exported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// No range at all.
    #[error("no range to export")]
    Empty,
    /// A range of length 0.
    #[error("range {0} is empty")]
    ZeroLength(ExportedRange),
    /// A start or length that is not a multiple of the page size.
    #[error(
        "range {range} is not page aligned (start and length must be multiples of {PAGE_SIZE})"
    )]
    NotAligned {
        /// The range.
        range: ExportedRange,
    },
    /// A range that runs past the end of the GPA space.
    #[error("range {0} runs past the end of the 64-bit GPA space")]
    PastGpaSpace(ExportedRange),
    /// Two ranges that share a GPA.
    #[error("ranges {first} and {second} overlap")]
    Overlap {
        /// One of them.
        first: ExportedRange,
        /// The other.
        second: ExportedRange,
    },
    /// Their total does not fit this machine's address space.
    #[error("the ranges' total length does not fit in memory (usize)")]
    TooLarge,
    /// `memory_bytes` or `gpa_base` of a `ServerConfig` was changed after
    /// its ranges were set: they no longer describe them.
    #[error("memory_bytes ({memory_bytes}) or gpa_base ({gpa_base:#x}) was changed after set_ranges: set either the one range or the list of ranges")]
    Inconsistent {
        /// The config's `memory_bytes`.
        memory_bytes: usize,
        /// The config's `gpa_base`.
        gpa_base: u64,
    },
}

/// Validated ranges laid out one after the other in the exported memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    ranges: Vec<PlacedRange>,
    total_bytes: usize,
}

impl Layout {
    /// Lays `ranges` out in the given order.
    ///
    /// # Errors
    /// [`LayoutError`] when there is no range, one is empty, not page
    /// aligned or past the GPA space, two overlap, or the total does not fit.
    pub fn new(ranges: &[ExportedRange]) -> Result<Self, LayoutError> {
        if ranges.is_empty() {
            return Err(LayoutError::Empty);
        }
        for &range in ranges {
            if range.length_bytes == 0 {
                return Err(LayoutError::ZeroLength(range));
            }
            if range.gpa_start % PAGE_BYTES != 0 || range.length_bytes % PAGE_BYTES != 0 {
                return Err(LayoutError::NotAligned { range });
            }
            if range.end() > u128::from(u64::MAX) + 1 {
                return Err(LayoutError::PastGpaSpace(range));
            }
        }
        let mut sorted = ranges.to_vec();
        sorted.sort_by_key(|r| r.gpa_start);
        if let Some(pair) = sorted
            .windows(2)
            .find(|pair| pair[0].end() > u128::from(pair[1].gpa_start))
        {
            return Err(LayoutError::Overlap {
                first: pair[0],
                second: pair[1],
            });
        }
        let mut placed = Vec::with_capacity(ranges.len());
        let mut offset = 0u64;
        for range in ranges {
            placed.push(PlacedRange {
                gpa_start: range.gpa_start,
                length_bytes: range.length_bytes,
                remote_offset: offset,
            });
            offset = offset
                .checked_add(range.length_bytes)
                .ok_or(LayoutError::TooLarge)?;
        }
        let total_bytes = usize::try_from(offset).map_err(|_| LayoutError::TooLarge)?;
        Ok(Self {
            ranges: placed,
            total_bytes,
        })
    }

    /// The ranges, in the order given, with their offsets.
    pub fn ranges(&self) -> &[PlacedRange] {
        &self.ranges
    }

    /// Bytes of exported memory: the sum of the lengths.
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn r(gpa_start: u64, length_bytes: u64) -> ExportedRange {
        ExportedRange::new(gpa_start, length_bytes)
    }

    #[test]
    fn ranges_are_laid_out_one_after_the_other_in_the_given_order() {
        let layout = Layout::new(&[r(8 * MIB, MIB), r(0, 2 * MIB), r(4 * MIB, 4096)]).unwrap();
        let got: Vec<(u64, u64, u64)> = layout
            .ranges()
            .iter()
            .map(|p| (p.gpa_start, p.length_bytes, p.remote_offset))
            .collect();
        assert_eq!(
            got,
            [
                (8 * MIB, MIB, 0),
                (0, 2 * MIB, MIB),
                (4 * MIB, 4096, 3 * MIB)
            ]
        );
        assert_eq!(layout.total_bytes(), (3 * MIB + 4096) as usize);
    }

    #[test]
    fn one_range_is_at_offset_zero() {
        let layout = Layout::new(&[r(0x4000_0000, MIB)]).unwrap();
        assert_eq!(
            layout.ranges(),
            [PlacedRange {
                gpa_start: 0x4000_0000,
                length_bytes: MIB,
                remote_offset: 0
            }]
        );
        assert_eq!(layout.total_bytes(), MIB as usize);
    }

    #[test]
    fn adjacent_ranges_do_not_overlap() {
        assert!(Layout::new(&[r(MIB, MIB), r(0, MIB), r(2 * MIB, MIB)]).is_ok());
    }

    #[test]
    fn bad_ranges_are_refused_with_the_reason() {
        assert_eq!(Layout::new(&[]), Err(LayoutError::Empty));
        assert_eq!(
            Layout::new(&[r(0, MIB), r(MIB, 0)]),
            Err(LayoutError::ZeroLength(r(MIB, 0)))
        );
        for bad in [r(100, MIB), r(0, MIB + 1)] {
            assert_eq!(
                Layout::new(&[bad]),
                Err(LayoutError::NotAligned { range: bad })
            );
        }
        assert_eq!(
            Layout::new(&[r(u64::MAX - 4095, 8192)]),
            Err(LayoutError::PastGpaSpace(r(u64::MAX - 4095, 8192)))
        );
        // The last page of the GPA space is fine.
        assert!(Layout::new(&[r(u64::MAX - 4095, 4096)]).is_ok());
        // Partial overlap, containment, and the same range twice; the
        // error names the two ranges in GPA order.
        assert_eq!(
            Layout::new(&[r(3 * MIB, 2 * MIB), r(0, 4 * MIB)]),
            Err(LayoutError::Overlap {
                first: r(0, 4 * MIB),
                second: r(3 * MIB, 2 * MIB)
            })
        );
        assert!(matches!(
            Layout::new(&[r(0, 4 * MIB), r(MIB, 4096)]),
            Err(LayoutError::Overlap { .. })
        ));
        assert!(matches!(
            Layout::new(&[r(MIB, MIB), r(MIB, MIB)]),
            Err(LayoutError::Overlap { .. })
        ));
        let msg = Layout::new(&[r(0, 2 * MIB), r(MIB, MIB)])
            .unwrap_err()
            .to_string();
        assert_eq!(msg, "ranges 0x0:0x200000 and 0x100000:0x100000 overlap");
    }

    #[test]
    fn a_total_past_u64_is_refused() {
        let big = 1u64 << 63;
        assert_eq!(
            Layout::new(&[r(0, big), r(big, big)]),
            Err(LayoutError::TooLarge)
        );
    }

    #[test]
    fn range_flags_parse() {
        assert_eq!("0x40000000:256MiB".parse(), Ok(r(0x4000_0000, 256 * MIB)));
        assert_eq!("0:4096".parse(), Ok(r(0, 4096)));
        assert_eq!("1048576:0x100000".parse(), Ok(r(MIB, MIB)));
        assert_eq!(" 0x0 : 1G ".parse(), Ok(r(0, 1 << 30)));
        for bad in [
            "", "0x1000", "x:4096", "0x1000:", "0:1TiB", "0:-1", "0:4096:1",
        ] {
            assert!(bad.parse::<ExportedRange>().is_err(), "{bad:?}");
        }
        // Parsing does not check alignment; the layout does.
        assert_eq!("100:100".parse(), Ok(r(100, 100)));
    }
}
