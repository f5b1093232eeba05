//! The order in which the bare programs ask for their pages: a xorshift
//! generator for random pages (cheap, so it costs the bare loop nothing
//! worth measuring), or one page after the other.

use crate::workload::AccessPattern;

/// The next page index of a bare loop, out of `pages`.
#[derive(Debug, Clone)]
pub(super) struct PageOrder {
    pattern: AccessPattern,
    pages: usize,
    rng_state: u64,
    next_seq: usize,
}

impl PageOrder {
    /// `pattern` over `pages` pages (at least one), random ones from `seed`.
    pub(super) fn new(pattern: AccessPattern, pages: usize, seed: u64) -> Self {
        Self {
            pattern,
            pages: pages.max(1),
            rng_state: seed | 1,
            next_seq: 0,
        }
    }

    /// The next page index.
    pub(super) fn next_page(&mut self) -> usize {
        match self.pattern {
            AccessPattern::Random => {
                self.rng_state ^= self.rng_state << 13;
                self.rng_state ^= self.rng_state >> 7;
                self.rng_state ^= self.rng_state << 17;
                (self.rng_state % self.pages as u64) as usize
            }
            AccessPattern::Seq => {
                self.next_seq = (self.next_seq + 1) % self.pages;
                self.next_seq
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_stay_in_range_and_seq_wraps() {
        let mut random = PageOrder::new(AccessPattern::Random, 10, 7);
        let seen: Vec<usize> = (0..1000).map(|_| random.next_page()).collect();
        assert!(seen.iter().all(|&p| p < 10));
        assert!((0..10).all(|p| seen.contains(&p)), "every page comes up");
        let mut seq = PageOrder::new(AccessPattern::Seq, 3, 7);
        let order: Vec<usize> = (0..4).map(|_| seq.next_page()).collect();
        assert_eq!(order, [1, 2, 0, 1]);
    }
}
