//! The checksums of the exported pages, kept between a write and the reads
//! that follow it, so that a checksummed READ can be answered out of the
//! region itself, like an unchecksummed one, instead of from a copy of the
//! page summed for the occasion.
//!
//! A page's sum is cached by an uncontended write that brought its checksum
//! (a checksummed WRITE, whose sum the connection has just checked), or by a
//! READ that copied and summed the page while no write ran. Every CPU write
//! of the region takes a [`WriteTicket`] first (`RecoveryGuard` does it for
//! each of its writes), which drops the page's sum until the write is done;
//! a write that overlapped another leaves none. Writes that bypass the CPU
//! (RDMA) cannot be seen, so a server with an RDMA device keeps no sums.
//!
//! A READ answered from the region with a cached sum is copied into the
//! socket by the kernel a little later: a write of the same page by another
//! connection in that window sends bytes the sum does not cover, and the
//! client finds a checksum mismatch (a transient error: the fault path
//! fetches the page again). A page summed from a copy would have been sent
//! torn but with a sum that matches; so a READ racing a WRITE of its page is
//! now reported instead of possibly accepted torn.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use rdma_transport::PAGE_SIZE;

/// The page's CRC-32C.
const SUM_MASK: u64 = 0xffff_ffff;
/// The sum is the page's.
const VALID: u64 = 1 << 32;
/// Writes of the page in progress (16 bits).
const WRITER_SHIFT: u32 = 33;
const WRITER_ONE: u64 = 1 << WRITER_SHIFT;
const WRITERS_MASK: u64 = 0xffff << WRITER_SHIFT;
/// Bumped at the start and the end of every write (14 bits, wrapping): a
/// reader that summed a copy caches it only if this did not move.
const GENERATION_SHIFT: u32 = 49;
const GENERATION_ONE: u64 = 1 << GENERATION_SHIFT;
const GENERATION_MASK: u64 = 0x3fff << GENERATION_SHIFT;
/// The write counter would have overflowed: the page's sum is never cached
/// again (its reads take the copy).
const NEVER: u64 = 1 << 63;

/// One entry per page of the exported region (8 bytes per 4 KiB page).
#[derive(Debug)]
pub(crate) struct PageSums {
    /// Empty when no sums are kept.
    entries: Box<[AtomicU64]>,
}

impl PageSums {
    /// Sums for a region of `region_bytes`; `enabled: false` (a server whose
    /// region RDMA may write) caches nothing.
    pub(crate) fn new(region_bytes: usize, enabled: bool) -> Self {
        let pages = if enabled {
            region_bytes.div_ceil(PAGE_SIZE)
        } else {
            0
        };
        Self {
            entries: (0..pages).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The cached sum of the page at region offset `off`, if there is one
    /// and no write of it is in progress.
    pub(crate) fn cached(&self, off: usize) -> Option<u32> {
        let entry = self.entries.get(off / PAGE_SIZE)?.load(Ordering::Acquire);
        (entry & (VALID | WRITERS_MASK | NEVER) == VALID).then_some((entry & SUM_MASK) as u32)
    }

    /// Before a READ copies the page at `off` to sum it: what
    /// [`Self::cache_if_unchanged`] needs to know whether a write ran
    /// meanwhile.
    pub(crate) fn before_copy(&self, off: usize) -> Snapshot {
        Snapshot(
            self.entries
                .get(off / PAGE_SIZE)
                .map(|e| e.load(Ordering::Acquire)),
        )
    }

    /// After the copy of the page at `off` was summed to `sum`: keeps the
    /// sum if no write of the page ran since `before`.
    pub(crate) fn cache_if_unchanged(&self, off: usize, before: Snapshot, sum: u32) {
        let (Some(entry), Some(seen)) = (self.entries.get(off / PAGE_SIZE), before.0) else {
            return;
        };
        if seen & (WRITERS_MASK | NEVER | VALID) != 0 {
            return;
        }
        // Orders the copy's loads before the check below: a write whose
        // bytes the copy saw has bumped the generation by then (it does so
        // before its first store, see `writing`).
        fence(Ordering::Acquire);
        let _ = entry.compare_exchange(
            seen,
            seen | VALID | u64::from(sum),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    /// Before a write of the page at `off`: its sum is dropped until the
    /// returned ticket is finished (or dropped).
    pub(crate) fn writing(&self, off: usize) -> WriteTicket<'_> {
        let Some(entry) = self.entries.get(off / PAGE_SIZE) else {
            return WriteTicket {
                entry: None,
                began: 0,
            };
        };
        let old = entry
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |e| {
                Some(start_write(e))
            })
            .unwrap_or_else(|e| e);
        let began = start_write(old);
        // The page's bytes are written after the entry says so: a reader
        // whose copy sees them finds the entry changed (`cache_if_unchanged`).
        fence(Ordering::Release);
        WriteTicket {
            entry: Some(entry),
            began,
        }
    }
}

/// The entry as a READ found it before copying its page.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Snapshot(Option<u64>);

/// A write of one page in progress (see [`PageSums::writing`]).
#[derive(Debug)]
pub(crate) struct WriteTicket<'a> {
    entry: Option<&'a AtomicU64>,
    /// The entry as this write's start left it.
    began: u64,
}

impl WriteTicket<'_> {
    /// The write is done; `sum`: the checksum of the bytes it wrote, cached
    /// if no other write of the page began meanwhile.
    pub(crate) fn finish(mut self, sum: Option<u32>) {
        self.end(sum);
    }

    fn end(&mut self, sum: Option<u32>) {
        let Some(entry) = self.entry.take() else {
            return;
        };
        if self.began & NEVER != 0 {
            return;
        }
        // Only a write that ran alone knows what the page holds.
        if let Some(sum) = sum.filter(|_| self.began & WRITERS_MASK == WRITER_ONE) {
            let done = bump_generation(self.began - WRITER_ONE) | VALID | u64::from(sum);
            if entry
                .compare_exchange(self.began, done, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
        let _ = entry.fetch_update(Ordering::AcqRel, Ordering::Acquire, |e| {
            (e & NEVER == 0).then(|| bump_generation(e & !(VALID | SUM_MASK)) - WRITER_ONE)
        });
    }
}

impl Drop for WriteTicket<'_> {
    fn drop(&mut self) {
        self.end(None);
    }
}

/// The entry once a write of its page began: no sum, one more writer, the
/// generation moved on (or `NEVER` for good when the count would overflow).
fn start_write(entry: u64) -> u64 {
    if entry & NEVER != 0 || entry & WRITERS_MASK == WRITERS_MASK {
        NEVER
    } else {
        bump_generation(entry & !(VALID | SUM_MASK)) + WRITER_ONE
    }
}

fn bump_generation(entry: u64) -> u64 {
    (entry & !GENERATION_MASK) | ((entry + GENERATION_ONE) & GENERATION_MASK)
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = PAGE_SIZE;

    #[test]
    fn an_uncontended_checksummed_write_caches_its_sum() {
        let sums = PageSums::new(4 * P, true);
        assert_eq!(sums.cached(P), None);
        sums.writing(P).finish(Some(0xdead_beef));
        assert_eq!(sums.cached(P), Some(0xdead_beef));
        assert_eq!(sums.cached(0), None, "other pages keep none");
        // A write without a sum drops it.
        sums.writing(P).finish(None);
        assert_eq!(sums.cached(P), None);
    }

    #[test]
    fn a_page_being_written_has_no_sum() {
        let sums = PageSums::new(2 * P, true);
        sums.writing(0).finish(Some(7));
        let ticket = sums.writing(0);
        assert_eq!(sums.cached(0), None);
        ticket.finish(Some(8));
        assert_eq!(sums.cached(0), Some(8));
    }

    #[test]
    fn overlapping_writes_cache_nothing() {
        let sums = PageSums::new(P, true);
        let first = sums.writing(0);
        let second = sums.writing(0);
        first.finish(Some(1));
        assert_eq!(sums.cached(0), None);
        second.finish(Some(2));
        // Either write's bytes may be what the page holds: no sum is right.
        assert_eq!(sums.cached(0), None);
        // The next uncontended write caches again.
        sums.writing(0).finish(Some(3));
        assert_eq!(sums.cached(0), Some(3));
    }

    #[test]
    fn a_dropped_ticket_ends_its_write_without_a_sum() {
        let sums = PageSums::new(P, true);
        sums.writing(0).finish(Some(5));
        drop(sums.writing(0));
        assert_eq!(sums.cached(0), None);
        sums.writing(0).finish(Some(6));
        assert_eq!(sums.cached(0), Some(6), "the writer count is back to 0");
    }

    #[test]
    fn a_read_caches_its_sum_only_if_no_write_ran_meanwhile() {
        let sums = PageSums::new(2 * P, true);
        let before = sums.before_copy(0);
        sums.cache_if_unchanged(0, before, 11);
        assert_eq!(sums.cached(0), Some(11));

        // A write that began and ended during the copy.
        let before = sums.before_copy(P);
        sums.writing(P).finish(None);
        sums.cache_if_unchanged(P, before, 12);
        assert_eq!(sums.cached(P), None);

        // A write still running when the copy began.
        let ticket = sums.writing(P);
        let before = sums.before_copy(P);
        sums.cache_if_unchanged(P, before, 13);
        assert_eq!(sums.cached(P), None);
        drop(ticket);
        // A write that began during the copy and is still running.
        let before = sums.before_copy(P);
        let ticket = sums.writing(P);
        sums.cache_if_unchanged(P, before, 14);
        assert_eq!(sums.cached(P), None);
        drop(ticket);
    }

    #[test]
    fn disabled_sums_cache_nothing_and_pages_outside_are_ignored() {
        let sums = PageSums::new(4 * P, false);
        sums.writing(0).finish(Some(1));
        let before = sums.before_copy(0);
        sums.cache_if_unchanged(0, before, 1);
        assert_eq!(sums.cached(0), None);

        let sums = PageSums::new(P, true);
        sums.writing(9 * P).finish(Some(1));
        assert_eq!(sums.cached(9 * P), None);
    }

    #[test]
    fn the_generation_wraps_without_touching_other_fields() {
        let sums = PageSums::new(P, true);
        for i in 0..(1u32 << 14) + 3 {
            sums.writing(0).finish(Some(i));
            assert_eq!(sums.cached(0), Some(i));
        }
    }

    #[test]
    fn a_writer_count_that_would_overflow_stops_caching_for_good() {
        let sums = PageSums::new(P, true);
        sums.entries[0].store(WRITERS_MASK, Ordering::Relaxed);
        let ticket = sums.writing(0);
        ticket.finish(Some(1));
        assert_eq!(sums.cached(0), None);
        sums.writing(0).finish(Some(2));
        assert_eq!(sums.cached(0), None);
    }
}
