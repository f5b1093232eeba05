//! Maps a page a fault fetched into the guest mapping.
//!
//! The handler claims the page (`FETCHING`) before it submits the fetch, so
//! faults on it by other threads wait for this one instead of fetching it
//! again, and nobody else writes its alias meanwhile. No lock is held
//! across the fetch: flush and evict never wait for the network. When the
//! page has arrived, it is locked and, if it is still absent at the
//! generation it was claimed at, put in place:
//! - anonymous region: `UFFDIO_COPY` from the buffer it was received into;
//! - shared region: it was received straight into the alias (filling the
//!   file's page cache, no bounce), and `UFFDIO_CONTINUE` maps it.
//!
//! It goes in write-protected for a read (clean), writable and dirty for a
//! write. An evict that dropped the page during the fetch bumped its
//! generation: the fetched copy may be stale and is not mapped (the page is
//! fetched again).

use crate::page::Page;

use super::shared::{Counters, Shared};
use super::state::{generation, DIRTY, FETCHING, LOCKED, POISONED, PRESENT};
use super::uffd::CopyOutcome;

const AGAIN_LIMIT: u32 = 1000;

/// What became of a fetched page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Installed {
    /// Mapped by this call (the faulting thread is awake).
    Mapped,
    /// Not mapped, nothing more to do: the thread was woken and faults
    /// again, or waits behind whoever holds the page.
    Settled,
    /// Dropped (or mapped by someone else) while it was fetched: look at
    /// the fault again.
    Again,
}

/// Puts page `page`, claimed `FETCHING` at generation `gen` and now
/// fetched (into `frame` for an anonymous region, into the alias for a
/// shared one), in place, and releases the claim.
pub(super) fn fetched(
    shared: &Shared,
    page: usize,
    gen: u32,
    write: bool,
    frame: Option<&Page>,
) -> Installed {
    let states = &shared.states;
    let Some(locked) = states.try_lock(page) else {
        // Flush or evict holds it (an evict drops it): wait for them, and
        // fetch again on the next fault.
        shared.release(page, 0, FETCHING, false);
        if states.defer(page, LOCKED) {
            Counters::add(&shared.counters.deferred_faults, 1);
            return Installed::Settled;
        }
        return Installed::Again;
    };
    if locked & (PRESENT | POISONED) != 0 || generation(locked) != gen {
        // Dropped (and perhaps fetched again) while we fetched: our copy
        // may be stale.
        shared.release(page, 0, LOCKED | FETCHING, false);
        return Installed::Again;
    }
    // Dirty before writable: flush skips pages not marked dirty without
    // taking their lock, so the mark must come before any write can land.
    // A clean page that the kernel maps writable before it is protected
    // (Linux < 6.4, `RegionUffd::continue_clean`) is marked too, and the
    // mark comes off below if nothing wrote it meanwhile.
    let writable_first = frame.is_none()
        && !write
        && shared.region.is_shared()
        && !shared.uffd.continue_write_protects();
    if write || writable_first {
        states.set_bits(page, DIRTY);
    }
    // Counted before the install wakes the faulting thread (and taken back
    // if it fails), so a reader of the stats never misses it.
    Counters::add(&shared.counters.missing_faults, 1);
    let set = match frame {
        Some(frame) => copy(shared, page, frame, write),
        None => map_alias(shared, page, write),
    };
    if set & PRESENT == 0 {
        Counters::sub(&shared.counters.missing_faults, 1);
    }
    let clear = if set & PRESENT == 0 || (writable_first && set & DIRTY == 0) {
        LOCKED | FETCHING | DIRTY
    } else {
        LOCKED | FETCHING
    };
    shared.release(page, set, clear, false);
    // The install woke the thread only when it mapped the page itself.
    if set != PRESENT {
        shared.wake(page);
    }
    if set & PRESENT != 0 {
        Installed::Mapped
    } else {
        Installed::Settled
    }
}

/// `UFFDIO_COPY` of `frame` to the locked page; returns the state bits to
/// set (none when it could not be installed: the thread faults again).
fn copy(shared: &Shared, page: usize, frame: &Page, write: bool) -> u32 {
    let addr = shared.region.page_addr(page);
    // SAFETY: `frame` is a live 4 KiB page; `addr` is a page of the
    // registered region, locked by us.
    retried(page, "UFFDIO_COPY", || unsafe {
        shared.uffd.copy_page(frame.as_ptr(), addr, !write)
    })
}

/// `UFFDIO_CONTINUE` of the locked page, whose page cache holds what was
/// received into the alias; returns the state bits to set, as [`copy`]
/// (`DIRTY` too for a clean page written while it was being protected).
fn map_alias(shared: &Shared, page: usize, write: bool) -> u32 {
    let addr = shared.region.page_addr(page);
    if write {
        // SAFETY: `addr` is a page of the registered range whose page cache
        // now holds the page we received into the alias.
        return retried(page, "UFFDIO_CONTINUE", || unsafe {
            shared.uffd.continue_pages(addr, 1, false)
        });
    }
    let alias = shared.region.data_ptr(page);
    let mut written = false;
    let set = retried(page, "UFFDIO_CONTINUE", || {
        // SAFETY: as above; `alias` is the same page in the alias mapping.
        let (outcome, bits) = unsafe { shared.uffd.continue_clean(addr, alias, 1) }?;
        written = bits != 0;
        Ok(outcome)
    });
    if written && set & PRESENT != 0 {
        set | DIRTY
    } else {
        set
    }
}

/// Runs an install until it is done or fails (`EAGAIN`, the mapping
/// changing under us, is retried a bounded number of times); returns the
/// state bits to set.
fn retried(
    page: usize,
    op: &str,
    mut install: impl FnMut() -> std::io::Result<CopyOutcome>,
) -> u32 {
    for _ in 0..AGAIN_LIMIT {
        match install() {
            Ok(CopyOutcome::Copied) => return PRESENT,
            // Present without our knowledge: dirty, so a flush
            // write-protects and writes it.
            Ok(CopyOutcome::Exists) => return PRESENT | DIRTY,
            Ok(CopyOutcome::Again) => std::hint::spin_loop(),
            Err(err) => {
                tracing::warn!(%err, page, op, "install failed; will refault");
                return 0;
            }
        }
    }
    tracing::warn!(page, op, "kept answering EAGAIN; will refault");
    0
}
