//! A shared region's faults (MISSING on a hole of the file, MINOR on a page
//! in its page cache but not mapped), served without a bounce buffer: the
//! page is received straight into the alias, which fills the page cache,
//! then mapped into the guest mapping with `UFFDIO_CONTINUE`.
//!
//! The page is claimed (`FETCHING`) before the fetch, so faults on it by
//! other threads wait for this one instead of fetching it again, and nobody
//! else writes its alias meanwhile. No lock is held across the fetch: flush
//! and evict never wait for the network here. An evict that drops the page
//! during the fetch bumps its generation, and the fetched copy is not
//! mapped (the next touch fetches again).

use crate::error::TransportError;

use super::handler::BeforeFetch;
use super::shared::{Counters, Shared};
use super::state::{generation, DIRTY, FETCHING, LOCKED, POISONED, PRESENT};
use super::uffd::CopyOutcome;

const CONTINUE_AGAIN_LIMIT: u32 = 1000;

/// Resolves (or defers) a fault on `page` of a shared region. Ok(true)
/// when this call mapped the page.
pub(crate) fn resolve(shared: &Shared, page: usize, write: bool) -> Result<bool, TransportError> {
    let states = &shared.states;
    loop {
        let s = states.load(page);
        match super::handler::before_fetch(shared, page, s) {
            BeforeFetch::Done => return Ok(false),
            BeforeFetch::Again => continue,
            BeforeFetch::Fetch => {}
        }
        let Some(gen) = states.try_start_fetch(page) else {
            continue;
        };
        Counters::add(&shared.counters.pages_fetched, 1);
        // SAFETY: the page is claimed `FETCHING` by us and absent from the
        // guest mapping: no fault maps it and nobody else writes its alias
        // until we release the claim.
        let fetched = match unsafe { shared.region.alias_pages_mut(page, page + 1) } {
            Some(dst) => shared
                .manager
                .read_page(shared.region.page_gpa(page), &mut dst[0]),
            None => Err(TransportError::Config("shared region without alias".into())),
        };
        if let Err(err) = fetched {
            shared.release(page, 0, FETCHING, false);
            return Err(err);
        }
        let Some(locked) = states.try_lock(page) else {
            // Flush or evict holds it (an evict drops it): wait for them,
            // and fetch again on the next fault.
            shared.release(page, 0, FETCHING, false);
            if states.defer(page, LOCKED) {
                Counters::add(&shared.counters.deferred_faults, 1);
                return Ok(false);
            }
            continue;
        };
        if locked & (PRESENT | POISONED) != 0 || generation(locked) != gen {
            // Dropped (and perhaps fetched again) while we fetched: our
            // copy may be stale. Look again.
            shared.release(page, 0, LOCKED | FETCHING, false);
            continue;
        }
        // Dirty before writable (see `handler::resolve_missing`).
        if write {
            states.set_bits(page, DIRTY);
        }
        // Counted before the CONTINUE wakes the faulting thread (and taken
        // back if it fails), so a reader of the stats never misses it.
        Counters::add(&shared.counters.missing_faults, 1);
        let set = map_page(shared, page, write);
        if set & PRESENT == 0 {
            Counters::sub(&shared.counters.missing_faults, 1);
        }
        let clear = if set & PRESENT == 0 {
            LOCKED | FETCHING | DIRTY
        } else {
            LOCKED | FETCHING
        };
        shared.release(page, set, clear, false);
        if set != PRESENT {
            shared.wake(page);
        }
        return Ok(set & PRESENT != 0);
    }
}

/// `UFFDIO_CONTINUE` of the locked page (write-protected for a read);
/// returns the state bits to set (none when it could not be mapped: the
/// thread is woken and faults again).
fn map_page(shared: &Shared, page: usize, write: bool) -> u32 {
    let addr = shared.region.page_addr(page);
    let mut again = 0;
    loop {
        // SAFETY: `addr` is a page of the registered range whose page cache
        // now holds the page we received into the alias.
        match unsafe { shared.uffd.continue_pages(addr, 1, !write) } {
            Ok(CopyOutcome::Copied) => return PRESENT,
            // Mapped without our knowledge: dirty, so a flush
            // write-protects and writes it.
            Ok(CopyOutcome::Exists) => return PRESENT | DIRTY,
            Ok(CopyOutcome::Again) if again < CONTINUE_AGAIN_LIMIT => {
                again += 1;
                std::hint::spin_loop();
            }
            Ok(CopyOutcome::Again) => {
                tracing::warn!(page, "UFFDIO_CONTINUE kept answering EAGAIN; will refault");
                return 0;
            }
            Err(err) => {
                tracing::warn!(%err, page, "UFFDIO_CONTINUE failed");
                return 0;
            }
        }
    }
}
