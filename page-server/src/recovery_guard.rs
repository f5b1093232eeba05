//! The write guard of a replica recovery: while this page-server copies its
//! range from a live replica, clients keep writing to it (a recovering
//! replica takes writes). A page a client wrote during the recovery is newer
//! than any copy of it fetched from the source, so the copy must never
//! overwrite it, whatever the interleaving.
//!
//! The rule: while the guard is active, a client WRITE takes the page's
//! stripe lock, sets the page's bit in the "written during recovery" bitmap
//! and writes the page; the recovery applies a fetched page only under the
//! same stripe lock and only if the bit is unset. Either the client write
//! comes first (the bit is set, the copy is dropped) or the copy does (the
//! client write then overwrites it): the client's page is what stays.
//!
//! When no recovery runs, a client write costs one atomic load more than a
//! plain copy into the region (and, on a server that keeps page sums, the
//! two updates of its page's entry: `page_sums.rs`). Every write of the
//! region goes through here, recovery copies included, so that no kept sum
//! outlives a change of its page.
//!
//! Writes that loaded "inactive" just before [`RecoveryGuard::begin`] are
//! not marked; they finish long before the copy starts, which waits a grace
//! period (seconds) after `begin` (see `recovery.rs`). Writes that bypass
//! the CPU (RDMA) are not seen at all: see docs/operations.md.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};
use rdma_transport::region::MappedRegion;
use rdma_transport::PAGE_SIZE;

use crate::page_sums::PageSums;

/// Stripe locks: page `i` is guarded by stripe `i % STRIPES`. 64 makes a
/// word of the bitmap hold exactly one page of each stripe.
const STRIPES: usize = 64;

/// Shared by every connection (through `Exported`) and the recovery thread.
#[derive(Debug)]
pub(crate) struct RecoveryGuard {
    active: AtomicBool,
    stripes: Box<[Mutex<()>]>,
    /// One bit per page of the region: written by a client since `begin`.
    /// Changed only under the page's stripe lock (`begin` takes them all).
    written: Box<[AtomicU64]>,
}

impl RecoveryGuard {
    /// A guard, inactive, for a region of `region_bytes`.
    pub(crate) fn new(region_bytes: usize) -> Self {
        let pages = region_bytes.div_ceil(PAGE_SIZE);
        Self {
            active: AtomicBool::new(false),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            written: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Whether a recovery is running (client writes are being marked).
    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Starts guarding with a fresh bitmap. Takes every stripe lock, so a
    /// client write still marking pages of an earlier recovery is done first.
    pub(crate) fn begin(&self) {
        let _all: Vec<MutexGuard<'_, ()>> = self.stripes.iter().map(Mutex::lock).collect();
        for word in self.written.iter() {
            word.store(0, Ordering::Relaxed);
        }
        self.active.store(true, Ordering::Release);
    }

    /// Stops guarding: client writes go straight to the region again.
    pub(crate) fn end(&self) {
        self.active.store(false, Ordering::Release);
    }

    /// A client's WRITE of `page` at region offset `off` (page aligned).
    /// `sum`: the page's checksum, when the client sent one and it was
    /// checked; `sums` keeps it if no other write of the page overlapped.
    ///
    /// # Errors
    /// `InvalidInput` when the page is not inside the region.
    pub(crate) fn client_write(
        &self,
        region: &MappedRegion,
        sums: &PageSums,
        off: usize,
        page: &[u8],
        sum: Option<u32>,
    ) -> io::Result<()> {
        let ticket = sums.writing(off);
        let _stripe = self.active.load(Ordering::Acquire).then(|| {
            let index = off / PAGE_SIZE;
            let stripe = self.stripes[index % STRIPES].lock();
            if let Some(word) = self.written.get(index / 64) {
                word.fetch_or(1 << (index % 64), Ordering::Relaxed);
            }
            stripe
        });
        region.write_at(off, page)?;
        ticket.finish(sum);
        Ok(())
    }

    /// The recovery's copy of `page` at region offset `off` (page aligned):
    /// applied unless a client wrote that page since [`Self::begin`].
    /// Returns whether it was applied.
    ///
    /// # Errors
    /// `InvalidInput` when the page is not inside the region.
    pub(crate) fn apply_copy(
        &self,
        region: &MappedRegion,
        sums: &PageSums,
        off: usize,
        page: &[u8],
    ) -> io::Result<bool> {
        let index = off / PAGE_SIZE;
        let _stripe = self.stripes[index % STRIPES].lock();
        let written = self
            .written
            .get(index / 64)
            .is_some_and(|w| w.load(Ordering::Relaxed) & (1 << (index % 64)) != 0);
        if written {
            return Ok(false);
        }
        let _ticket = sums.writing(off);
        region.write_at(off, page)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rdma_transport::region::MapOptions;

    use super::*;

    const PAGES: usize = 256;

    fn region() -> MappedRegion {
        MappedRegion::new(PAGES * PAGE_SIZE, MapOptions::LAZY).expect("region")
    }

    /// The guard's tests are about ordering: no sums kept.
    fn no_sums() -> PageSums {
        PageSums::new(0, false)
    }

    fn page(fill: u8) -> Vec<u8> {
        vec![fill; PAGE_SIZE]
    }

    fn at(region: &MappedRegion, index: usize) -> Vec<u8> {
        let mut p = page(0);
        region.read_at(index * PAGE_SIZE, &mut p).expect("read");
        p
    }

    #[test]
    fn inactive_guard_writes_through_and_marks_nothing() {
        let (r, g) = (region(), RecoveryGuard::new(PAGES * PAGE_SIZE));
        assert!(!g.is_active());
        g.client_write(&r, &no_sums(), 3 * PAGE_SIZE, &page(1), None)
            .unwrap();
        assert_eq!(at(&r, 3), page(1));
        // A write before the recovery began is in the source's copy too:
        // the copy applies.
        g.begin();
        assert!(g
            .apply_copy(&r, &no_sums(), 3 * PAGE_SIZE, &page(2))
            .unwrap());
        assert_eq!(at(&r, 3), page(2));
    }

    #[test]
    fn copy_fetched_before_a_write_and_applied_after_it_is_dropped() {
        let (r, g) = (region(), RecoveryGuard::new(PAGES * PAGE_SIZE));
        g.begin();
        // The recovery fetched the old contents (0xAA) from the source...
        let fetched = page(0xAA);
        // ...then a client wrote the page here (and to the source)...
        g.client_write(&r, &no_sums(), 7 * PAGE_SIZE, &page(0x55), None)
            .unwrap();
        // ...then the recovery applies its stale copy: dropped.
        assert!(!g
            .apply_copy(&r, &no_sums(), 7 * PAGE_SIZE, &fetched)
            .unwrap());
        assert_eq!(at(&r, 7), page(0x55));
        // Its neighbours (same word, other stripes) still take the copy.
        assert!(g
            .apply_copy(&r, &no_sums(), 6 * PAGE_SIZE, &fetched)
            .unwrap());
        assert!(g
            .apply_copy(&r, &no_sums(), 8 * PAGE_SIZE, &fetched)
            .unwrap());
        // The same stripe, another word: not written either.
        assert!(g
            .apply_copy(&r, &no_sums(), (7 + 64) * PAGE_SIZE, &fetched)
            .unwrap());
    }

    #[test]
    fn write_after_the_copy_wins() {
        let (r, g) = (region(), RecoveryGuard::new(PAGES * PAGE_SIZE));
        g.begin();
        assert!(g
            .apply_copy(&r, &no_sums(), 9 * PAGE_SIZE, &page(0xAA))
            .unwrap());
        g.client_write(&r, &no_sums(), 9 * PAGE_SIZE, &page(0x55), None)
            .unwrap();
        assert_eq!(at(&r, 9), page(0x55));
        // A second copy of it (a retry from another source) is dropped.
        assert!(!g
            .apply_copy(&r, &no_sums(), 9 * PAGE_SIZE, &page(0xAA))
            .unwrap());
        assert_eq!(at(&r, 9), page(0x55));
    }

    #[test]
    fn a_new_recovery_starts_with_a_fresh_bitmap() {
        let (r, g) = (region(), RecoveryGuard::new(PAGES * PAGE_SIZE));
        g.begin();
        g.client_write(&r, &no_sums(), 0, &page(1), None).unwrap();
        g.end();
        assert!(!g.is_active());
        // Not marked while inactive.
        g.client_write(&r, &no_sums(), PAGE_SIZE, &page(1), None)
            .unwrap();
        g.begin();
        assert!(g.apply_copy(&r, &no_sums(), 0, &page(2)).unwrap());
        assert!(g.apply_copy(&r, &no_sums(), PAGE_SIZE, &page(2)).unwrap());
    }

    #[test]
    fn pages_outside_the_region_are_errors_not_panics() {
        let (r, g) = (region(), RecoveryGuard::new(PAGES * PAGE_SIZE));
        g.begin();
        let beyond = (PAGES + 100) * PAGE_SIZE;
        assert!(g
            .client_write(&r, &no_sums(), beyond, &page(1), None)
            .is_err());
        assert!(g.apply_copy(&r, &no_sums(), beyond, &page(1)).is_err());
    }

    /// Clients and the copy race on every page: every page a client wrote
    /// ends with the client's contents, every other page with the copy's.
    #[test]
    fn racing_writes_and_copy_keep_every_client_write() {
        let r = Arc::new(region());
        let g = Arc::new(RecoveryGuard::new(PAGES * PAGE_SIZE));
        g.begin();
        let copier = {
            let (r, g) = (Arc::clone(&r), Arc::clone(&g));
            std::thread::spawn(move || {
                for round in 0..20 {
                    for i in 0..PAGES {
                        g.apply_copy(&r, &no_sums(), i * PAGE_SIZE, &page(0xC0 | (round & 1)))
                            .unwrap();
                    }
                }
            })
        };
        let writers: Vec<_> = (0..2usize)
            .map(|w| {
                let (r, g) = (Arc::clone(&r), Arc::clone(&g));
                std::thread::spawn(move || {
                    // Writer w writes the pages i with i % 4 == w, twice.
                    for _ in 0..2 {
                        for i in (w..PAGES).step_by(4) {
                            g.client_write(&r, &no_sums(), i * PAGE_SIZE, &page(w as u8 + 1), None)
                                .unwrap();
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        copier.join().unwrap();
        for i in 0..PAGES {
            let got = at(&r, i);
            if i % 4 < 2 {
                assert_eq!(got, page(i as u8 % 4 + 1), "client page {i}");
            } else {
                assert!(got == page(0xC0) || got == page(0xC1), "copied page {i}");
            }
        }
    }

    /// Two clients write the same page at the same moment, each with its
    /// page's sum, round after round (a recovery running in every other
    /// round); between rounds, a sum kept for the page is the sum of what
    /// the page holds, whichever write ended last or however they mixed.
    #[test]
    fn writes_at_the_same_moment_keep_no_wrong_sum() {
        const ROUNDS: usize = 10_000;
        let r = Arc::new(region());
        let g = Arc::new(RecoveryGuard::new(PAGES * PAGE_SIZE));
        let sums = Arc::new(PageSums::new(PAGES * PAGE_SIZE, true));
        let start = Arc::new(std::sync::Barrier::new(3));
        let done = Arc::new(std::sync::Barrier::new(3));
        let writers: Vec<_> = (0..2u8)
            .map(|w| {
                let (r, g, sums) = (Arc::clone(&r), Arc::clone(&g), Arc::clone(&sums));
                let (start, done) = (Arc::clone(&start), Arc::clone(&done));
                std::thread::spawn(move || {
                    for round in 0..ROUNDS {
                        let p = page((round as u8) ^ (w * 0x55));
                        let sum = rdma_transport::wire::page_checksum(&p);
                        start.wait();
                        g.client_write(&r, &sums, 0, &p, Some(sum)).unwrap();
                        done.wait();
                    }
                })
            })
            .collect();
        let mut kept = 0;
        for round in 0..ROUNDS {
            if round % 2 == 0 {
                g.begin();
            } else {
                g.end();
            }
            start.wait();
            done.wait();
            if let Some(sum) = sums.cached(0) {
                kept += 1;
                let held = at(&r, 0);
                assert_eq!(
                    sum,
                    rdma_transport::wire::page_checksum(&held),
                    "round {round}"
                );
            }
        }
        for w in writers {
            w.join().unwrap();
        }
        // Most rounds' writes do not overlap on two CPUs: their sums are kept.
        assert!(kept > 0, "no round kept a sum");
    }
}
