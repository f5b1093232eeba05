//! Dirty tracking without write faults ([`DirtyTracking::PagemapScan`]):
//! the region's userfaultfd has asynchronous write protection, so the first
//! write to a clean (write-protected) page goes through without a fault;
//! the kernel only clears the page's protection. Pages are still mapped
//! write-protected when clean, writable when first touched by a write.
//!
//! `flush`: one `PAGEMAP_SCAN` walk lists the pages written since their
//! protection and protects them again, atomically, so a write after the
//! walk shows at the next flush. Each listed page is copied into the
//! bounce batch and sent (64 per `write_pages`). Writers are not held off:
//! a page written while it is copied may reach its owner torn, and is then
//! written (unprotected) again, so the next flush or evict sends it whole.
//! Nothing written before the flush is missed: a listed page the region
//! does not hold yet may be an install between its `UFFDIO_CONTINUE` and
//! its release, whose write completed already, so its lock is waited for
//! (a short section) and it is sent if it turned out present. Holes (not
//! mapped at the walk) are skipped: they now carry a protection marker, and
//! whoever maps them later decides whether they are written.
//!
//! `evict` holds a chunk's locks (faults on it wait), unmaps the chunk from
//! the guest mapping first, then reads the pages' pagemap entries: a page
//! unmapped while write-protected keeps a marker (`PM_UFFD_WP`), a written
//! one does not. No write can land after the unmapping, so there is no
//! window between looking and dropping. The written pages go back from the
//! file (the alias, in place), then the chunk's file pages are freed. If
//! the write-back fails, the pages are mapped back (written ones writable,
//! so they stay dirty) and stay.
//!
//! [`DirtyTracking::PagemapScan`]: super::DirtyTracking::PagemapScan

use crate::error::TransportError;
use crate::page::PAGE_SIZE;
use crate::uffd::Pagemap;

use super::dirty::{self, Outcome, ZERO_COPY_MIN_PAGES};
use super::error::GuestMemoryError;
use super::shared::{Counters, Shared, Writeback, WRITEBACK_BATCH};
use super::state::{DIRTY, LOCKED, POISONED, PRESENT};
use super::uffd::CopyOutcome;

/// Writes every page written since the last flush back to its owner;
/// returns how many were written.
pub(super) fn flush(shared: &Shared, pagemap: &Pagemap) -> Result<u64, GuestMemoryError> {
    let mut wb = shared.writeback.lock();
    let base = shared.region.base() as usize;
    let mut runs = Vec::new();
    pagemap
        .take_written(base, base + shared.region.len_bytes(), &mut runs)
        .map_err(|source| GuestMemoryError::Memory {
            op: "ioctl(PAGEMAP_SCAN)",
            source,
        })?;
    let mut out = Outcome::default();
    for (start, end, mapped) in runs {
        if !mapped {
            // Holes (now carrying a protection marker): a page mapped later
            // is protected or not as its install decides.
            continue;
        }
        let (first, end) = ((start - base) / PAGE_SIZE, (end - base) / PAGE_SIZE);
        for page in first..end {
            if wb.index.len() == WRITEBACK_BATCH {
                send_bounce(shared, &mut wb, &mut out);
            }
            if shared.states.load(page) & PRESENT != 0 {
                copy_to_bounce(shared, &mut wb, page);
                continue;
            }
            // Mapped and written, but not ours yet: an install between its
            // UFFDIO_CONTINUE and its release, whose write may have
            // completed already. Its lock waits for the release.
            let s = shared.states.lock_spin(page);
            if s & PRESENT != 0 {
                copy_to_bounce(shared, &mut wb, page);
            }
            shared.release(page, 0, LOCKED, false);
        }
    }
    send_bounce(shared, &mut wb, &mut out);
    out.into_result()
}

/// Copies page `p` (present; perhaps being written) into the next slot of
/// the bounce batch.
fn copy_to_bounce(shared: &Shared, wb: &mut Writeback, p: usize) {
    let slot = wb.index.len();
    let src = shared.region.data_ptr(p);
    // SAFETY: `src` is a page of the live mapping (the alias); the guest
    // may write it meanwhile, as with any copy of running guest memory, and
    // only raw bytes are copied out into our own buffer.
    unsafe { std::ptr::copy_nonoverlapping(src, wb.pages[slot].as_mut_ptr(), PAGE_SIZE) };
    wb.index.push(p);
    wb.gpas.push(shared.region.page_gpa(p));
}

/// Sends the bounce batch; on failure its pages are written again (for the
/// next flush). Empties it.
fn send_bounce(shared: &Shared, wb: &mut Writeback, out: &mut Outcome) {
    dirty::send_batch(shared, wb, out, |p| mark_written(shared, p, p + 1));
}

/// Lifts the protection of pages `[first, end)`: those mapped count as
/// written at the next scan.
fn mark_written(shared: &Shared, first: usize, end: usize) {
    let addr = shared.region.page_addr(first);
    if let Err(err) = shared.uffd.unprotect(addr, (end - first) * PAGE_SIZE) {
        tracing::error!(%err, first, end, "unprotecting pages to keep them dirty failed");
    }
}

/// Writes back the written pages of `[first, end)`, then drops them all;
/// returns how many were dropped.
pub(super) fn evict(
    shared: &Shared,
    pagemap: &Pagemap,
    first: usize,
    end: usize,
) -> Result<u64, GuestMemoryError> {
    let mut wb = shared.writeback.lock();
    let mut dropped = 0u64;
    let mut written = Vec::with_capacity(WRITEBACK_BATCH);
    let mut chunk = first;
    while chunk < end {
        let chunk_end = (chunk + WRITEBACK_BATCH).min(end);
        for page in chunk..chunk_end {
            shared.states.lock_spin(page);
        }
        match evict_chunk(shared, pagemap, &mut wb, &mut written, chunk, chunk_end) {
            Ok(n) => dropped += n,
            Err(err) => {
                for page in chunk..chunk_end {
                    shared.release(page, 0, LOCKED, false);
                }
                Counters::add(&shared.counters.pages_evicted, dropped);
                return Err(err);
            }
        }
        chunk = chunk_end;
    }
    Counters::add(&shared.counters.pages_evicted, dropped);
    Ok(dropped)
}

/// Evicts the locked chunk `[chunk, end)` (see the module docs). On error
/// the chunk is mapped again and left locked.
fn evict_chunk(
    shared: &Shared,
    pagemap: &Pagemap,
    wb: &mut Writeback,
    written: &mut Vec<bool>,
    chunk: usize,
    end: usize,
) -> Result<u64, GuestMemoryError> {
    let memory = |op| move |source| GuestMemoryError::Memory { op, source };
    shared
        .region
        .unmap_guest(chunk, end)
        .map_err(memory("madvise(MADV_DONTNEED)"))?;
    let present = |p: usize| shared.states.load(p) & PRESENT != 0;
    let addr = shared.region.page_addr(chunk) as usize;
    if let Err(source) = pagemap.protected(addr, end - chunk, written) {
        // Unknown which were written: keep them all as written.
        written.clear();
        written.resize(end - chunk, false);
        remap(shared, chunk, end, written);
        return Err(memory("reading /proc/self/pagemap")(source));
    }
    // Written: held, and unmapped without the protection marker.
    for (k, w) in written.iter_mut().enumerate() {
        *w = present(chunk + k) && !*w;
    }
    if let Err((pages, source)) = write_back(shared, wb, written, chunk) {
        remap(shared, chunk, end, &invert(written));
        return Err(GuestMemoryError::WriteBack { pages, source });
    }
    if let Err(source) = shared.region.punch(chunk, end) {
        remap(shared, chunk, end, &invert(written));
        return Err(memory("fallocate(PUNCH_HOLE)")(source));
    }
    let mut dropped = 0;
    for page in chunk..end {
        if shared.states.load(page) & (PRESENT | POISONED) != 0 {
            dropped += 1;
        }
        shared.release(page, 0, LOCKED | PRESENT | DIRTY | POISONED, true);
    }
    Ok(dropped)
}

/// `protected[k]` from `written[k]` (for `remap`).
fn invert(written: &[bool]) -> Vec<bool> {
    written.iter().map(|w| !w).collect()
}

/// Sends the pages of the chunk from `chunk` whose `written` flag is set,
/// from the file (unmapped from the guest, so nobody writes them): runs of
/// at least `ZERO_COPY_MIN_PAGES` in place, the rest through the bounce
/// batch. Err: how many pages the failed call carried, and why.
fn write_back(
    shared: &Shared,
    wb: &mut Writeback,
    written: &[bool],
    chunk: usize,
) -> Result<(), (usize, TransportError)> {
    let mut k = 0;
    while k < written.len() {
        if !written[k] {
            k += 1;
            continue;
        }
        let mut e = k + 1;
        while e < written.len() && written[e] {
            e += 1;
        }
        let (first, end) = (chunk + k, chunk + e);
        if e - k >= ZERO_COPY_MIN_PAGES {
            let mut gpas = Vec::with_capacity(e - k);
            shared.region.gpas_of(first, end, &mut gpas);
            // SAFETY: the pages are in the file, unmapped from the guest and
            // locked by us (faults on them wait), so nothing writes them
            // while the transport reads them from the alias.
            let pages = unsafe { shared.region.data_pages(first, end) };
            shared
                .manager
                .write_pages(&gpas, pages)
                .map_err(|err| (e - k, err))?;
            Counters::add(&shared.counters.pages_written_back, (e - k) as u64);
            Counters::add(&shared.counters.pages_written_in_place, (e - k) as u64);
        } else {
            // Unmapped and locked: nothing writes them (as above).
            (first..end).for_each(|p| dirty::copy_to_bounce(shared, wb, p));
        }
        k = e;
    }
    dirty::send_evicted_batch(shared, wb)
}

/// Maps the held pages of the locked chunk back after a failed evict:
/// write-protected when `protected[k]` (clean), writable otherwise (so a
/// written page stays written).
fn remap(shared: &Shared, chunk: usize, end: usize, protected: &[bool]) {
    for (k, page) in (chunk..end).enumerate() {
        if shared.states.load(page) & PRESENT == 0 {
            continue;
        }
        let clean = protected.get(k).copied().unwrap_or(false);
        // SAFETY: a page of the registered range whose file page still
        // holds its contents (the hole was not punched).
        let mapped = unsafe {
            shared
                .uffd
                .continue_pages(shared.region.page_addr(page), 1, clean)
        };
        match mapped {
            Ok(CopyOutcome::Copied | CopyOutcome::Exists) => {}
            Ok(CopyOutcome::Again) | Err(_) => {
                // Left unmapped, it would fault forever on a page we call
                // present: drop it instead (its next touch fetches it).
                tracing::error!(
                    page,
                    ?mapped,
                    "mapping a page back after a failed evict failed; dropping it"
                );
                shared.release(page, 0, PRESENT | DIRTY, true);
            }
        }
    }
}
