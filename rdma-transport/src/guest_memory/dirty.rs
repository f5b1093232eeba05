//! Dirty tracking and write-back.
//!
//! Tracking uses userfaultfd write-protect (synchronous mode): a page read
//! in is installed write-protected and clean; the first write to it faults,
//! and the handler marks it `DIRTY` and lifts the protection. A page first
//! touched by a write is installed writable and `DIRTY` at once. The mark
//! always comes before the page becomes writable, because `flush` skips
//! pages without it without taking their lock.
//!
//! Write-back reads the pages where they are, with no copy into a bounce
//! buffer: from the alias of a shared region, from the guest mapping of an
//! anonymous one. Both work on runs of consecutive pages: one
//! `UFFDIO_WRITEPROTECT` and one `write_pages` per run (of up to
//! `WRITEBACK_BATCH` pages).
//!
//! `flush` finds a run of dirty pages, takes their locks, write-protects the
//! run, clears `DIRTY`, writes the pages back from memory and waits for the
//! acknowledgement, then releases them. A write meanwhile faults on the
//! protection and waits for the release (one round trip), then marks the
//! page dirty again: nothing written before `flush` was called is missed,
//! nothing written during it is lost, and no page is sent torn. A failed
//! write-back marks the run dirty again (it stays mapped).
//!
//! `evict` holds the locks of a chunk of pages across the whole sequence
//! write-protect, write back its dirty runs, wait for the owner's
//! acknowledgement, drop (`MADV_DONTNEED`, and a hole in a shared file):
//! writes to those pages wait in their fault meanwhile, so no write can land
//! between the write-back and the drop, and a page is dropped only after its
//! write-back was acknowledged. Faults on dropped pages are woken after the
//! drop and fetch the written-back contents.
//!
//! Flush and evict are serialised by one mutex (never taken by faulting
//! threads or handlers), so a page never has two write-backs in flight.

use crate::error::TransportError;

use super::error::GuestMemoryError;
use super::shared::{Counters, Shared, WRITEBACK_BATCH};
use super::state::{DIRTY, LOCKED, POISONED, PRESENT};
use crate::page::PAGE_SIZE;

/// Writes every dirty page back to its owner; returns how many were written.
pub(crate) fn flush(shared: &Shared) -> Result<u64, GuestMemoryError> {
    let _serial = shared.writeback.lock();
    let states = &shared.states;
    let pages = states.len();
    let mut outcome = Outcome::default();
    let mut page = 0;
    while page < pages {
        if states.load(page) & DIRTY == 0 {
            page += 1;
            continue;
        }
        // Lock the run of dirty, present pages from here.
        let first = page;
        let mut end = first;
        while end < pages && end - first < WRITEBACK_BATCH && states.load(end) & DIRTY != 0 {
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
        write_run(shared, first, end, &mut outcome);
        page = end;
    }
    outcome.into_result()
}

/// Write-protects the locked dirty run `[first, end)`, writes it back from
/// memory, and releases it (dirty again when the write-back failed).
fn write_run(shared: &Shared, first: usize, end: usize, outcome: &mut Outcome) {
    let len_bytes = (end - first) * PAGE_SIZE;
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
    match send_run(shared, first, end) {
        Ok(()) => outcome.written += (end - first) as u64,
        Err(err) => {
            outcome.failed += end - first;
            outcome.first_error.get_or_insert(err);
        }
    }
    for p in first..end {
        shared.release(p, 0, LOCKED, false);
    }
}

/// Writes pages `[first, end)` (locked, present, write-protected) back from
/// memory and waits for the acknowledgement; on failure marks them dirty.
fn send_run(shared: &Shared, first: usize, end: usize) -> Result<(), TransportError> {
    let mut gpas = [0u64; WRITEBACK_BATCH];
    for (k, gpa) in gpas[..end - first].iter_mut().enumerate() {
        *gpa = shared.region.page_gpa(first + k);
    }
    // SAFETY: the pages are present, write-protected and locked by us
    // (callers' contract): a writer waits in its fault until we release
    // them, so nothing writes them while the transport reads them.
    let pages = unsafe { shared.region.data_pages(first, end) };
    let result = shared.manager.write_pages(&gpas[..end - first], pages);
    match &result {
        Ok(()) => Counters::add(&shared.counters.pages_written_back, (end - first) as u64),
        // Still present (we hold the locks): dirty again for the next try.
        Err(_) => (first..end).for_each(|p| shared.states.set_bits(p, DIRTY)),
    }
    result
}

/// Writes back the pages `[first, end)` that are dirty, then drops them all.
pub(crate) fn evict(shared: &Shared, first: usize, end: usize) -> Result<u64, GuestMemoryError> {
    let _serial = shared.writeback.lock();
    let mut dropped = 0u64;
    let mut chunk = first;
    while chunk < end {
        let chunk_end = (chunk + WRITEBACK_BATCH).min(end);
        for page in chunk..chunk_end {
            shared.states.lock_spin(page);
        }
        let unlock_all = |shared: &Shared| {
            for page in chunk..chunk_end {
                shared.release(page, 0, LOCKED, false);
            }
        };
        // Stop writers of the chunk before writing it back: one ioctl.
        let base = shared.region.page_addr(chunk);
        if let Err(err) = shared
            .uffd
            .write_protect(base, (chunk_end - chunk) * PAGE_SIZE)
        {
            unlock_all(shared);
            return Err(GuestMemoryError::Userfaultfd {
                op: "UFFDIO_WRITEPROTECT",
                source: err,
            });
        }
        let dirty = |p: usize| shared.states.load(p) & (DIRTY | PRESENT) == (DIRTY | PRESENT);
        let mut run = chunk;
        while run < chunk_end {
            if !dirty(run) {
                run += 1;
                continue;
            }
            let mut run_end = run + 1;
            while run_end < chunk_end && dirty(run_end) {
                run_end += 1;
            }
            if let Err(source) = send_run(shared, run, run_end) {
                // Nothing is dropped: the pages stay mapped and dirty.
                unlock_all(shared);
                return Err(GuestMemoryError::WriteBack {
                    pages: run_end - run,
                    source,
                });
            }
            run = run_end;
        }
        if let Err(source) = shared.region.drop_pages(chunk, chunk_end) {
            unlock_all(shared);
            return Err(GuestMemoryError::Memory {
                op: "madvise(MADV_DONTNEED)",
                source,
            });
        }
        for page in chunk..chunk_end {
            let s = shared.states.load(page);
            if s & (PRESENT | POISONED) != 0 {
                dropped += 1;
            }
            shared.release(page, 0, LOCKED | PRESENT | DIRTY | POISONED, true);
        }
        chunk = chunk_end;
    }
    Counters::add(&shared.counters.pages_evicted, dropped);
    Ok(dropped)
}

#[derive(Default)]
struct Outcome {
    written: u64,
    failed: usize,
    first_error: Option<TransportError>,
}

impl Outcome {
    fn into_result(self) -> Result<u64, GuestMemoryError> {
        match self.first_error {
            None => Ok(self.written),
            Some(source) => Err(GuestMemoryError::WriteBack {
                pages: self.failed,
                source,
            }),
        }
    }
}
