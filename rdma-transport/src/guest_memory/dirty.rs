//! Dirty tracking and write-back.
//!
//! Tracking uses userfaultfd write-protect (synchronous mode): a page read
//! in is installed write-protected and clean; the first write to it faults,
//! and the handler marks it `DIRTY` and lifts the protection. A page first
//! touched by a write is installed writable and `DIRTY` at once. The mark
//! always comes before the page becomes writable, because `flush` skips
//! pages without it without taking their lock.
//!
//! `flush` takes every dirty page's lock, write-protects it, copies it,
//! clears `DIRTY` and releases it, then writes the copies back in batches.
//! A write after the protection faults and marks the page dirty again, so
//! nothing written before `flush` was called is missed and nothing written
//! during it is lost (it is in the copy or dirty again). A failed write-back
//! marks the pages dirty again (they stay mapped).
//!
//! `evict` holds the locks of a batch of pages across the whole sequence
//! write-protect, copy, write back, wait for the owner's acknowledgement,
//! `MADV_DONTNEED`: writes to those pages wait in their fault meanwhile, so
//! no write can land between the copy and the drop, and a page is dropped
//! only after its write-back was acknowledged. Faults on dropped pages are
//! woken after the drop and fetch the written-back contents.
//!
//! Flush and evict are serialised by one mutex (never taken by faulting
//! threads or handlers), so a page never has two write-backs in flight.

use crate::error::TransportError;
use crate::page::PAGE_SIZE;

use super::error::GuestMemoryError;
use super::shared::{Counters, Shared, Writeback, WRITEBACK_BATCH};
use super::state::{DIRTY, LOCKED, POISONED, PRESENT};

/// Writes every dirty page back to its owner; returns how many were written.
pub(crate) fn flush(shared: &Shared) -> Result<u64, GuestMemoryError> {
    let mut wb = shared.writeback.lock();
    let mut outcome = Outcome::default();
    for page in 0..shared.states.len() {
        if shared.states.load(page) & DIRTY == 0 {
            continue;
        }
        let s = shared.states.lock_spin(page);
        if s & (DIRTY | PRESENT) != (DIRTY | PRESENT) {
            shared.release(page, 0, LOCKED, false);
            continue;
        }
        let addr = shared.region.page_addr(page);
        if let Err(err) = shared.uffd.write_protect(addr, PAGE_SIZE) {
            tracing::warn!(%err, page, "write-protecting a dirty page failed; skipped");
            shared.release(page, 0, LOCKED, false);
            continue;
        }
        let slot = wb.index.len();
        // SAFETY: the page is present (state says so and only evict, which
        // we exclude, drops pages) and write-protected, and we hold its
        // lock, so no write lands during the copy and reading it cannot
        // fault. The slot is a separate Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(addr, wb.pages[slot].as_mut_ptr(), PAGE_SIZE) };
        shared.release(page, 0, LOCKED | DIRTY, false);
        wb.index.push(page);
        wb.gpas.push(shared.region.page_gpa(page));
        if wb.index.len() == WRITEBACK_BATCH {
            send(shared, &mut wb, &mut outcome);
        }
    }
    send(shared, &mut wb, &mut outcome);
    outcome.into_result()
}

/// Writes back the pages `[first, end)` that are dirty, then drops them all.
pub(crate) fn evict(shared: &Shared, first: usize, end: usize) -> Result<u64, GuestMemoryError> {
    let mut wb = shared.writeback.lock();
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
        // Stop writers of the chunk's dirty pages before copying them.
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
        for page in chunk..chunk_end {
            let s = shared.states.load(page);
            if s & (DIRTY | PRESENT) == (DIRTY | PRESENT) {
                let slot = wb.index.len();
                // SAFETY: as in `flush`: present, write-protected, locked.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        shared.region.page_addr(page),
                        wb.pages[slot].as_mut_ptr(),
                        PAGE_SIZE,
                    )
                };
                wb.index.push(page);
                wb.gpas.push(shared.region.page_gpa(page));
            }
        }
        let count = wb.index.len();
        let result = match count {
            0 => Ok(()),
            _ => shared.manager.write_pages(&wb.gpas, &wb.pages[..count]),
        };
        wb.index.clear();
        wb.gpas.clear();
        if let Err(source) = result {
            // Nothing is dropped: the pages stay mapped and dirty.
            unlock_all(shared);
            return Err(GuestMemoryError::WriteBack {
                pages: count,
                source,
            });
        }
        Counters::add(&shared.counters.pages_written_back, count as u64);
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

/// Writes the batch; on failure marks its pages dirty again. Empties it.
fn send(shared: &Shared, wb: &mut Writeback, outcome: &mut Outcome) {
    let count = wb.index.len();
    if count == 0 {
        return;
    }
    match shared.manager.write_pages(&wb.gpas, &wb.pages[..count]) {
        Ok(()) => {
            outcome.written += count as u64;
            Counters::add(&shared.counters.pages_written_back, count as u64);
        }
        Err(err) => {
            for &page in &wb.index {
                // Still present: only evict drops pages, and it waits for us.
                shared.states.set_bits(page, DIRTY);
            }
            outcome.failed += count;
            outcome.first_error.get_or_insert(err);
        }
    }
    wb.index.clear();
    wb.gpas.clear();
}
