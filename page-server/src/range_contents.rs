//! What this process's memory holds of each exported range, by the last
//! map it read: what each claim of a range says when the node registers
//! (`RangeRequest::contents`). A coordinator that has no record of the
//! node's replica (it lost its state) goes by it, so that a page-server
//! that just started, or one that missed writes, is not made the range's
//! live replica over the one that holds it (coordinator `store/claims.rs`).

use std::sync::atomic::{AtomicU8, Ordering};

use rdma_transport::coordinator::api::{RangeContents, ReplicaState};

const UNKNOWN: u8 = 0;
const HELD: u8 = 1;
const MISSED: u8 = 2;

/// One entry per exported range, in layout order.
#[derive(Debug)]
pub(crate) struct RangesSeen {
    seen: Vec<AtomicU8>,
}

impl RangesSeen {
    /// `ranges` ranges, none seen in a map yet.
    pub(crate) fn new(ranges: usize) -> Self {
        Self {
            seen: (0..ranges).map(|_| AtomicU8::new(UNKNOWN)).collect(),
        }
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
            slot.store(value, Ordering::Relaxed);
        }
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

    #[test]
    fn a_claim_says_what_the_last_map_said() {
        let seen = RangesSeen::new(2);
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
}
