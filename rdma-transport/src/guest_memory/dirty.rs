//! Dirty tracking and write-back.
//!
//! Tracking uses userfaultfd write-protect (synchronous mode): a page read
//! in is installed write-protected and clean; the first write to it faults,
//! and the handler marks it `DIRTY` and lifts the protection. A page first
//! touched by a write is installed writable and `DIRTY` at once. The mark
//! always comes before the page becomes writable, because `flush` skips
//! pages without it without taking their lock.
//!
//! Write-back works on runs of consecutive dirty pages (up to
//! `WRITEBACK_BATCH`): one `UFFDIO_WRITEPROTECT` per run, or, for short
//! runs of anonymous memory near each other, one per group of them
//! (`Group`, which takes every short run). A run of at least
//! `ZERO_COPY_MIN_PAGES` goes out with one `write_pages` straight from
//! memory, with no copy (from the alias of a shared region, from the guest
//! mapping of an anonymous one), its pages locked until the owner
//! acknowledged them. Shorter runs are copied into one bounce batch of up
//! to `WRITEBACK_BATCH` pages, sent with one `write_pages`: the manager
//! takes one contiguous buffer per call, and a round trip per scattered
//! page cost far more than the copies (docs/benchmarking.md, "Guest memory
//! backings"). A scatter-gather `write_pages` would let every page go out
//! without a copy.
//!
//! `flush` finds a run of dirty pages, takes their locks, write-protects the
//! run and clears `DIRTY`. A long run is written back from memory and then
//! released: a write meanwhile faults on the protection and waits for the
//! release (one round trip). A short run is copied and released at once: a
//! write after that faults and marks the page dirty again. Either way
//! nothing written before `flush` was called is missed, nothing written
//! during it is lost, and no page is sent torn. A failed write-back marks
//! its pages dirty again (they stay mapped).
//!
//! `evict` holds the locks of a chunk of pages across the whole sequence
//! write-protect, write back its dirty pages, wait for the owner's
//! acknowledgement, drop (`MADV_DONTNEED`, and a hole in a shared file):
//! writes to those pages wait in their fault meanwhile, so no write can land
//! between the write-back and the drop, and a page is dropped only after its
//! write-back was acknowledged. Faults on dropped pages are woken after the
//! drop and fetch the written-back contents.
//!
//! Flush and evict are serialised by one mutex (never taken by faulting
//! threads or handlers), so a page never has two write-backs in flight.
//!
//! On hugetlbfs a page of the region is a huge page (see `region.rs`): it
//! is tracked, write-protected, written back (always in place, as its
//! 4 KiB pages) and dropped whole, one per run.
//!
//! A shared file on a kernel that cannot write-protect shared memory (Linux
//! 5.13-5.18, [`RegionUffd::write_protects`]) has no tracking: every page
//! mapped counts as dirty from its install on. There `evict` unmaps a chunk
//! from the guest instead of protecting it (every touch, read or write,
//! then waits in its fault), and `flush` evicts every dirty run
//! ([`flush_unprotected`]): nothing written before it is missed, no page is
//! sent torn, and the pages come back on their next touch, from their
//! owners.
//!
//! [`RegionUffd::write_protects`]: super::uffd::RegionUffd::write_protects

use crate::error::TransportError;

use super::error::GuestMemoryError;
use super::shared::{Counters, Shared, Writeback, WRITEBACK_BATCH};
use super::state::{DIRTY, LOCKED, POISONED, PRESENT};

/// Shortest run written back straight from memory; shorter ones share a
/// bounce batch (one round trip for up to `WRITEBACK_BATCH` pages).
pub(crate) const ZERO_COPY_MIN_PAGES: usize = 16;

/// Pages of the region in one run or evict chunk: `WRITEBACK_BATCH` 4 KiB
/// pages, or one huge page.
fn max_run(shared: &Shared) -> usize {
    (WRITEBACK_BATCH / shared.region.unit_pages()).max(1)
}

/// Writes every dirty page back to its owner; returns how many 4 KiB pages
/// were written.
pub(crate) fn flush(shared: &Shared) -> Result<u64, GuestMemoryError> {
    if let Some(pagemap) = &shared.pagemap {
        return super::dirty_scan::flush(shared, pagemap);
    }
    if !shared.uffd.write_protects() {
        return flush_unprotected(shared);
    }
    let mut wb = shared.writeback.lock();
    let states = &shared.states;
    let pages = states.len();
    let max_run = max_run(shared);
    let mut outcome = Outcome::default();
    // Short runs go through `group`; near each other, they share one
    // write-protect call (anonymous memory only).
    let mut group = Group::new(if shared.region.is_shared() {
        0
    } else {
        GROUP_SPAN_PAGES
    });
    let mut page = 0;
    while page < pages {
        if states.load(page) & DIRTY == 0 {
            page += 1;
            continue;
        }
        // Lock the run of dirty, present pages from here.
        let first = page;
        let mut end = first;
        while end < pages && end - first < max_run && states.load(end) & DIRTY != 0 {
            let s = states.lock_spin(end);
            if s & (DIRTY | PRESENT) != (DIRTY | PRESENT) {
                shared.release(end, 0, LOCKED, false);
                break;
            }
            end += 1;
        }
        if end == first {
            page += 1;
            continue;
        }
        if (end - first) * shared.region.unit_pages() < ZERO_COPY_MIN_PAGES {
            // Short (4 KiB pages, then: a huge page is never short).
            if !group.fits(first, end, WRITEBACK_BATCH - wb.index.len()) {
                group.flush(shared, &mut wb);
                if wb.index.len() + (end - first) > WRITEBACK_BATCH {
                    send_bounce(shared, &mut wb, &mut outcome);
                }
            }
            group.push(first, end);
        } else {
            group.flush(shared, &mut wb);
            flush_run(shared, first, end, &mut outcome);
        }
        page = end;
    }
    group.flush(shared, &mut wb);
    send_bounce(shared, &mut wb, &mut outcome);
    outcome.into_result()
}

/// `flush` of a region whose pages cannot be write-protected: each run of
/// dirty pages (every page mapped) is evicted, as `evict` does it: locked,
/// unmapped from the guest, written back, dropped. Returns how many 4 KiB
/// pages were written; a run whose write-back failed stays in the file and
/// dirty, and maps again on its next touch (`handler::before_fetch`).
fn flush_unprotected(shared: &Shared) -> Result<u64, GuestMemoryError> {
    let mut wb = shared.writeback.lock();
    let states = &shared.states;
    let pages = states.len();
    let max_run = max_run(shared);
    let mut outcome = Outcome::default();
    let mut page = 0;
    while page < pages {
        if states.load(page) & DIRTY == 0 {
            page += 1;
            continue;
        }
        let first = page;
        let mut end = first + 1;
        while end < pages && end - first < max_run && states.load(end) & DIRTY != 0 {
            end += 1;
        }
        for p in first..end {
            states.lock_spin(p);
        }
        let mut written = 0;
        let result = evict_chunk(shared, &mut wb, first, end, &mut written);
        outcome.written += written;
        if let Err(err) = result {
            wb.index.clear();
            wb.gpas.clear();
            for p in first..end {
                shared.release(p, 0, LOCKED, false);
            }
            match err {
                GuestMemoryError::WriteBack { pages, source } => {
                    outcome.failed += pages;
                    outcome.first_error.get_or_insert(source);
                }
                other => return Err(other),
            }
        }
        page = end;
    }
    outcome.into_result()
}

/// Furthest apart, in pages, the first and last page of a `Group` of
/// anonymous memory.
const GROUP_SPAN_PAGES: usize = 4 * WRITEBACK_BATCH;

/// Short dirty runs, locked, waiting to be write-protected together: one
/// `UFFDIO_WRITEPROTECT` from the first run's start to the last run's end,
/// then each run is copied into the bounce batch (which has room for all of
/// them) and released. Each call interrupts every other CPU running a
/// thread of this process to flush its TLB (a VMM's vCPUs, in guest mode
/// or not): a flush of scattered pages made one per run
/// (docs/embedding.md, "Dirty tracking without faults").
///
/// The pages between the runs are not locked, and protecting them is
/// harmless: a clean page is protected already; an absent one stays absent
/// (anonymous memory keeps no write-protect marker for it, unless the
/// userfaultfd has `UFFD_FEATURE_WP_UNPOPULATED`, and then its MISSING
/// fault is reported and resolved as usual); a dirty page that another
/// thread holds keeps its `DIRTY` mark (only the locked runs' marks are
/// cleared), so the next write faults, finds the mark and lifts the
/// protection again, and the next flush sends the page. Evict protects
/// whole chunks the same way. Shared-memory regions keep one call per run
/// (span 0: their absent pages would get markers); they use `PAGEMAP_SCAN`
/// where the kernel has it.
struct Group {
    runs: Vec<(usize, usize)>,
    pages: usize,
    /// Furthest apart the group's first and last page may be; 0: one run.
    span_pages: usize,
}

impl Group {
    fn new(span_pages: usize) -> Self {
        Self {
            runs: Vec::new(),
            pages: 0,
            span_pages,
        }
    }

    /// Whether the run `[first, end)` can join: within the span, and all
    /// of the group's pages fit in `room` bounce slots.
    fn fits(&self, first: usize, end: usize, room: usize) -> bool {
        match self.runs.first() {
            None => end - first <= room,
            Some(&(start, _)) => {
                end - start <= self.span_pages && self.pages + (end - first) <= room
            }
        }
    }

    fn push(&mut self, first: usize, end: usize) {
        self.runs.push((first, end));
        self.pages += end - first;
    }

    /// Write-protects the runs with one call, clears their `DIRTY`, copies
    /// them into the bounce batch and releases them.
    fn flush(&mut self, shared: &Shared, wb: &mut Writeback) {
        let (Some(&(first, _)), Some(&(_, end))) = (self.runs.first(), self.runs.last()) else {
            return;
        };
        let protected = shared.uffd.write_protect(
            shared.region.page_addr(first),
            (end - first) * shared.region.unit_bytes(),
        );
        for &(run, run_end) in &self.runs {
            for p in run..run_end {
                if protected.is_ok() {
                    // Clean from now: a write after the release faults
                    // and marks it again.
                    shared.states.release(p, 0, DIRTY, false);
                    copy_to_bounce(shared, wb, p);
                }
                shared.release(p, 0, LOCKED, false);
            }
        }
        if let Err(err) = protected {
            tracing::warn!(%err, first, end, "write-protecting dirty runs failed; skipped");
        }
        self.runs.clear();
        self.pages = 0;
    }
}

/// Write-protects the locked dirty run `[first, end)` (a long one: at
/// least `ZERO_COPY_MIN_PAGES`; short ones go through `Group`), clears
/// `DIRTY`, writes it back from memory and releases it.
fn flush_run(shared: &Shared, first: usize, end: usize, out: &mut Outcome) {
    let len_bytes = (end - first) * shared.region.unit_bytes();
    if let Err(err) = shared
        .uffd
        .write_protect(shared.region.page_addr(first), len_bytes)
    {
        tracing::warn!(%err, first, end, "write-protecting a dirty run failed; skipped");
        for p in first..end {
            shared.release(p, 0, LOCKED, false);
        }
        return;
    }
    // Clean from now: a write after the release faults and marks it again.
    for p in first..end {
        shared.states.release(p, 0, DIRTY, false);
    }
    let run_pages = (end - first) * shared.region.unit_pages();
    match send_run(shared, first, end) {
        Ok(()) => out.written += run_pages as u64,
        Err(err) => {
            out.failed += run_pages;
            out.first_error.get_or_insert(err);
        }
    }
    for p in first..end {
        shared.release(p, 0, LOCKED, false);
    }
}

/// Copies page `p` (present, write-protected or unmapped from the guest,
/// locked) into the next slot of the bounce batch. 4 KiB pages only: longer
/// ones always go in place.
pub(super) fn copy_to_bounce(shared: &Shared, wb: &mut Writeback, p: usize) {
    debug_assert_eq!(shared.region.unit_pages(), 1);
    let slot = wb.index.len();
    // SAFETY: the page is present and write-protected (or unmapped from the
    // guest) and we hold its lock (callers' contract), so nothing writes it
    // while it is read.
    let src = unsafe { shared.region.data_pages(p, p + 1) };
    wb.pages[slot].copy_from_slice(&src[0]);
    wb.index.push(p);
    wb.gpas.push(shared.region.page_gpa(p));
}

/// Writes pages `[first, end)` (locked, present, write-protected) back from
/// memory and waits for the acknowledgement; on failure marks them dirty.
fn send_run(shared: &Shared, first: usize, end: usize) -> Result<(), TransportError> {
    let mut gpas = Vec::new();
    shared.region.gpas_of(first, end, &mut gpas);
    // SAFETY: the pages are present, write-protected and locked by us
    // (callers' contract): a writer waits in its fault until we release
    // them, so nothing writes them while the transport reads them.
    let pages = unsafe { shared.region.data_pages(first, end) };
    let result = shared.manager.write_pages(&gpas, pages);
    match &result {
        Ok(()) => {
            Counters::add(&shared.counters.pages_written_back, gpas.len() as u64);
            Counters::add(&shared.counters.pages_written_in_place, gpas.len() as u64);
        }
        // Still present (we hold the locks): dirty again for the next try.
        Err(_) => (first..end).for_each(|p| shared.states.set_bits(p, DIRTY)),
    }
    result
}

/// Writes the bounce batch; on failure marks its pages dirty again. Empties
/// it.
fn send_bounce(shared: &Shared, wb: &mut Writeback, out: &mut Outcome) {
    // Still present: only evict drops pages, and it waits for us.
    send_batch(shared, wb, out, |page| shared.states.set_bits(page, DIRTY));
}

/// Writes the bounce batch (one `write_pages`), counts it in `out`, and on
/// failure calls `keep_dirty` for each of its pages. Empties it.
pub(super) fn send_batch(
    shared: &Shared,
    wb: &mut Writeback,
    out: &mut Outcome,
    keep_dirty: impl Fn(usize),
) {
    let count = wb.index.len();
    if count == 0 {
        return;
    }
    match shared.manager.write_pages(&wb.gpas, &wb.pages[..count]) {
        Ok(()) => {
            out.written += count as u64;
            Counters::add(&shared.counters.pages_written_back, count as u64);
        }
        Err(err) => {
            wb.index.iter().for_each(|&page| keep_dirty(page));
            out.failed += count;
            out.first_error.get_or_insert(err);
        }
    }
    wb.index.clear();
    wb.gpas.clear();
}

/// Writes the bounce batch of an evict chunk and empties it. The pages stay
/// as they are on failure (evict drops nothing then); Err: how many pages
/// the failed call carried, and why.
pub(super) fn send_evicted_batch(
    shared: &Shared,
    wb: &mut Writeback,
) -> Result<(), (usize, TransportError)> {
    let count = wb.index.len();
    let result = match count {
        0 => Ok(()),
        _ => shared.manager.write_pages(&wb.gpas, &wb.pages[..count]),
    };
    wb.index.clear();
    wb.gpas.clear();
    result.map_err(|err| (count, err))?;
    Counters::add(&shared.counters.pages_written_back, count as u64);
    Ok(())
}

/// Writes back the pages `[first, end)` that are dirty, then drops them all.
/// Returns how many 4 KiB pages were dropped.
pub(crate) fn evict(shared: &Shared, first: usize, end: usize) -> Result<u64, GuestMemoryError> {
    if let Some(pagemap) = &shared.pagemap {
        return super::dirty_scan::evict(shared, pagemap, first, end);
    }
    let mut wb = shared.writeback.lock();
    let mut dropped = 0u64;
    let mut chunk = first;
    let max_run = max_run(shared);
    while chunk < end {
        let chunk_end = (chunk + max_run).min(end);
        for page in chunk..chunk_end {
            shared.states.lock_spin(page);
        }
        let result = evict_chunk(shared, &mut wb, chunk, chunk_end, &mut 0);
        if result.is_err() {
            // Nothing is dropped: the pages stay mapped (and dirty: evict
            // never clears the mark of a page it did not drop).
            wb.index.clear();
            wb.gpas.clear();
            for page in chunk..chunk_end {
                shared.release(page, 0, LOCKED, false);
            }
        }
        dropped += result?;
        chunk = chunk_end;
    }
    Counters::add(&shared.counters.pages_evicted, dropped);
    Ok(dropped)
}

/// Evicts the locked chunk `[chunk, end)`: write-protect (one ioctl; or,
/// where the region cannot be, unmap it from the guest), write back its
/// dirty pages (long runs from memory, the rest in one bounce batch), drop,
/// release. Adds the 4 KiB pages written to `written`. On error the chunk
/// is left locked, and mapped (unless it was unmapped: its pages are still
/// in the file, and `handler::before_fetch` maps them again).
fn evict_chunk(
    shared: &Shared,
    wb: &mut Writeback,
    chunk: usize,
    end: usize,
    written: &mut u64,
) -> Result<u64, GuestMemoryError> {
    if shared.uffd.write_protects() {
        let base = shared.region.page_addr(chunk);
        shared
            .uffd
            .write_protect(base, (end - chunk) * shared.region.unit_bytes())
            .map_err(|source| GuestMemoryError::Userfaultfd {
                op: "UFFDIO_WRITEPROTECT",
                source,
            })?;
    } else {
        shared
            .region
            .unmap_guest(chunk, end)
            .map_err(|source| GuestMemoryError::Memory {
                op: "madvise(MADV_DONTNEED)",
                source,
            })?;
    }
    let dirty = |p: usize| shared.states.load(p) & (DIRTY | PRESENT) == (DIRTY | PRESENT);
    let mut run = chunk;
    while run < end {
        if !dirty(run) {
            run += 1;
            continue;
        }
        let mut run_end = run + 1;
        while run_end < end && dirty(run_end) {
            run_end += 1;
        }
        let run_pages = (run_end - run) * shared.region.unit_pages();
        if run_pages >= ZERO_COPY_MIN_PAGES {
            send_run(shared, run, run_end).map_err(|source| GuestMemoryError::WriteBack {
                pages: run_pages,
                source,
            })?;
            *written += run_pages as u64;
        } else {
            (run..run_end).for_each(|p| copy_to_bounce(shared, wb, p));
        }
        run = run_end;
    }
    let bounced = wb.index.len() as u64;
    send_evicted_batch(shared, wb)
        .map_err(|(pages, source)| GuestMemoryError::WriteBack { pages, source })?;
    *written += bounced;
    shared
        .region
        .drop_pages(chunk, end)
        .map_err(|source| GuestMemoryError::Memory {
            op: "madvise(MADV_DONTNEED)",
            source,
        })?;
    let mut dropped = 0;
    for page in chunk..end {
        if shared.states.load(page) & (PRESENT | POISONED) != 0 {
            dropped += shared.region.unit_pages() as u64;
        }
        shared.release(page, 0, LOCKED | PRESENT | DIRTY | POISONED, true);
    }
    Ok(dropped)
}

#[derive(Default)]
pub(super) struct Outcome {
    pub(super) written: u64,
    pub(super) failed: usize,
    pub(super) first_error: Option<TransportError>,
}

impl Outcome {
    pub(super) fn into_result(self) -> Result<u64, GuestMemoryError> {
        match self.first_error {
            None => Ok(self.written),
            Some(source) => Err(GuestMemoryError::WriteBack {
                pages: self.failed,
                source,
            }),
        }
    }
}
