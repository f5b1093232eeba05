//! What this process's memory holds of each exported range, by the last
//! map it read: what each claim of a range says when the node registers
//! (`RangeRequest::contents`). A coordinator that has no record of the
//! node's replica (it lost its state) goes by it, so that a page-server
//! that just started, or one that missed writes, is not made the range's
//! live replica over the one that holds it (coordinator `store/claims.rs`).
//!
//! With a state directory (`held_ranges.rs`), a range an earlier process
//! held starts as missed (this process's memory is empty), and each range
//! seen live is recorded there for the processes after this one.

use std::sync::atomic::{AtomicU8, Ordering};

use rdma_transport::coordinator::api::{RangeContents, ReplicaState};

use crate::held_ranges::{HeldRange, HeldRanges};

const UNKNOWN: u8 = 0;
const HELD: u8 = 1;
const MISSED: u8 = 2;

/// One entry per exported range, in layout order.
#[derive(Debug)]
pub(crate) struct RangesSeen {
    seen: Vec<AtomicU8>,
    ranges: Vec<HeldRange>,
    held: Option<HeldRanges>,
}

impl RangesSeen {
    /// `ranges`, none seen in a map yet: each missed when `held` says an
    /// earlier process held it, unknown otherwise.
    pub(crate) fn new(ranges: Vec<HeldRange>, held: Option<HeldRanges>) -> Self {
        let seen = ranges
            .iter()
            .map(|&range| {
                let before = held.as_ref().is_some_and(|h| h.contains(range));
                AtomicU8::new(if before { MISSED } else { UNKNOWN })
            })
            .collect();
        Self { seen, ranges, held }
    }

    /// How many ranges.
    pub(crate) fn len(&self) -> usize {
        self.seen.len()
    }

    /// Range `index`'s replica is in `state` in the map just read.
    pub(crate) fn note(&self, index: usize, state: ReplicaState) {
        let value = match RangeContents::from_state(state) {
            RangeContents::Held => HELD,
            RangeContents::Missed => MISSED,
            RangeContents::Unknown => UNKNOWN,
        };
        if let Some(slot) = self.seen.get(index) {
            if value == HELD {
                self.record_held(index);
            }
            slot.store(value, Ordering::Relaxed);
        }
    }

    /// Records range `index` in the state directory, if there is one (a
    /// file write the first time only).
    fn record_held(&self, index: usize) {
        let (Some(held), Some(&range)) = (&self.held, self.ranges.get(index)) else {
            return;
        };
        if let Err(err) = held.record(range) {
            tracing::error!(
                %err,
                gpa_start = format_args!("{:#x}", range.gpa_start),
                length_bytes = range.length_bytes,
                "cannot record the range as held: if this process ends and the \
                 coordinator loses its state, its zeros could be served as the range"
            );
        }
    }

    /// Each range, in layout order, with what a claim of it says.
    pub(crate) fn each(&self) -> impl Iterator<Item = (HeldRange, RangeContents)> + '_ {
        self.ranges
            .iter()
            .enumerate()
            .map(|(index, &range)| (range, self.contents(index)))
    }

    /// What a claim of range `index` says.
    pub(crate) fn contents(&self, index: usize) -> RangeContents {
        match self.seen.get(index).map(|s| s.load(Ordering::Relaxed)) {
            Some(HELD) => RangeContents::Held,
            Some(MISSED) => RangeContents::Missed,
            _ => RangeContents::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(count: u64) -> Vec<HeldRange> {
        (0..count)
            .map(|i| HeldRange {
                gpa_start: i << 20,
                length_bytes: 1 << 20,
            })
            .collect()
    }

    #[test]
    fn a_claim_says_what_the_last_map_said() {
        let seen = RangesSeen::new(ranges(2), None);
        assert_eq!(seen.contents(0), RangeContents::Unknown);
        seen.note(0, ReplicaState::Live);
        assert_eq!(seen.contents(0), RangeContents::Held);
        for missed in [
            ReplicaState::Stale,
            ReplicaState::Recovering,
            ReplicaState::Lost,
        ] {
            seen.note(0, missed);
            assert_eq!(seen.contents(0), RangeContents::Missed);
        }
        assert_eq!(seen.contents(1), RangeContents::Unknown);
        seen.note(9, ReplicaState::Live);
        assert_eq!(seen.contents(9), RangeContents::Unknown);
    }

    /// A range seen live is recorded; the next process starts with it
    /// missed, and claims it so until it sees it live again.
    #[test]
    fn a_range_held_by_an_earlier_process_starts_missed() {
        let dir = tempfile::tempdir().unwrap();
        let open = || HeldRanges::open(dir.path(), "n1").unwrap();
        let first = RangesSeen::new(ranges(2), Some(open()));
        first.note(1, ReplicaState::Stale);
        first.note(0, ReplicaState::Live);
        drop(first);

        let next = RangesSeen::new(ranges(2), Some(open()));
        assert_eq!(next.contents(0), RangeContents::Missed);
        assert_eq!(next.contents(1), RangeContents::Unknown);
        next.note(0, ReplicaState::Live);
        assert_eq!(next.contents(0), RangeContents::Held);
        // Without the directory nothing is remembered.
        assert_eq!(
            RangesSeen::new(ranges(2), None).contents(0),
            RangeContents::Unknown
        );
    }
}
