//! The order in which a connection's requests went out, so that its reader
//! knows whose answers come next and can read several of them straight
//! into their pages with one `readv` (`receive.rs`).
//!
//! A page-server answers a connection's requests in the order it read them,
//! so the k-th answer on the stream is normally the answer to the k-th
//! request written. The protocol does not promise it
//! (docs/wire-protocol.md), so the reader only uses this as a guess: an
//! answer read into a page is checked to be that page's answer before it
//! counts, and anything else goes back to the receive buffer. A wrong guess
//! costs a copy, never a wrong page.

use std::sync::atomic::{AtomicU64, Ordering};

use super::inflight::SLOTS;

/// How far past the reader's position an answer's request is looked for
/// when it is not the one expected (see [`WireOrder::answered`]).
const SEARCH: u64 = 64;

/// The ids of the last `SLOTS` requests written, in wire order.
#[derive(Debug)]
pub(crate) struct WireOrder {
    ids: Box<[AtomicU64]>,
    /// Requests recorded so far; request `n` is at `ids[n % SLOTS]`.
    sent: AtomicU64,
}

impl WireOrder {
    pub(crate) fn new() -> Self {
        Self {
            ids: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            sent: AtomicU64::new(0),
        }
    }

    /// Writer, holding the connection's send lock (one writer at a time,
    /// in the order the requests go out): request `id` is the next on the
    /// wire. Recorded before it is written, so that its answer is never
    /// read before its place is known.
    pub(crate) fn sent(&self, id: u64) {
        let n = self.sent.load(Ordering::Relaxed);
        self.ids[(n % SLOTS as u64) as usize].store(id, Ordering::Relaxed);
        self.sent.store(n + 1, Ordering::Release);
    }

    /// The id of the request written `pos`-th, if it was written and its
    /// place not reused since.
    pub(crate) fn at(&self, pos: u64) -> Option<u64> {
        let sent = self.sent.load(Ordering::Acquire);
        (pos < sent && sent - pos <= SLOTS as u64)
            .then(|| self.ids[(pos % SLOTS as u64) as usize].load(Ordering::Relaxed))
    }

    /// Reader: the answer to request `id` was read, `next` being the place
    /// of the request whose answer the reader expected. Moves `next` past
    /// `id`'s place when it is there or a little after it (answers to
    /// requests whose place was passed over are simply not guessed); leaves
    /// it otherwise.
    pub(crate) fn answered(&self, next: &mut u64, id: u64) {
        let sent = self.sent.load(Ordering::Acquire);
        if sent.saturating_sub(*next) > SLOTS as u64 {
            *next = sent - SLOTS as u64;
        }
        let mut pos = *next;
        while pos < sent.min(*next + SEARCH) {
            if self.ids[(pos % SLOTS as u64) as usize].load(Ordering::Relaxed) == id {
                *next = pos + 1;
                return;
            }
            pos += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_move_the_reader_along_the_wire_order() {
        let order = WireOrder::new();
        let mut next = 0;
        assert_eq!(order.at(0), None, "nothing written yet");
        for id in [7, 9, 11, 13] {
            order.sent(id);
        }
        assert_eq!(
            (order.at(0), order.at(3), order.at(4)),
            (Some(7), Some(13), None)
        );
        order.answered(&mut next, 7);
        assert_eq!(next, 1);
        // An answer out of the expected order skips the places before it.
        order.answered(&mut next, 11);
        assert_eq!(next, 3);
        // An answer to no request written leaves the reader where it is.
        order.answered(&mut next, 99);
        assert_eq!(next, 3);
        order.answered(&mut next, 13);
        assert_eq!(next, 4);
    }

    #[test]
    fn a_reader_left_behind_catches_up_with_what_is_kept() {
        let order = WireOrder::new();
        for id in 0..(SLOTS as u64 + 10) {
            order.sent(id);
        }
        assert_eq!(order.at(0), None, "overwritten");
        assert_eq!(order.at(10), Some(10));
        let mut next = 0;
        order.answered(&mut next, 12);
        assert_eq!(next, 13);
    }
}
