//! What the handler threads, the prefetcher and the `GuestMemory` handle
//! share: the region, its userfaultfd, the page states, counters.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::TransportError;
use crate::manager::TransportManager;
use crate::page::Page;
use crate::rdma::RegisteredMemory;

use super::config::{GuestMemoryConfig, SigbusMethod};
use super::prefetch::{PrefetchQueue, StreamTable};
use super::region::GuestRegion;
use super::state::PageStates;
use super::uffd::RegionUffd;

/// Pages written back per round trip by flush and evict, at most.
pub(crate) const WRITEBACK_BATCH: usize = 64;

/// Counters; read with [`super::GuestMemory::stats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub missing_faults: AtomicU64,
    pub pages_fetched: AtomicU64,
    pub faults_fetched_inline: AtomicU64,
    pub inline_fetches_given_up: AtomicU64,
    pub wp_faults: AtomicU64,
    pub deferred_faults: AtomicU64,
    pub prefetched_pages: AtomicU64,
    pub prefetch_batches: AtomicU64,
    pub fault_errors: AtomicU64,
    pub sigbus_raised: AtomicU64,
    pub pages_written_back: AtomicU64,
    pub pages_written_in_place: AtomicU64,
    pub pages_evicted: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Takes back an `add` whose event did not happen after all.
    pub(crate) fn sub(counter: &AtomicU64, n: u64) {
        counter.fetch_sub(n, Ordering::Relaxed);
    }
}

/// The bounce batch of flush and evict, for pages of short dirty runs
/// (see `dirty.rs`); the mutex around it also serialises the two, so one
/// page never has two write-backs in flight.
#[derive(Debug)]
pub(crate) struct Writeback {
    pub pages: Vec<Page>,
    pub gpas: Vec<u64>,
    pub index: Vec<usize>,
}

/// The state of one guest region.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The alias registered with the manager's RDMA device (shared
    /// backing, RDMA): declared before `region` so it is unregistered
    /// before the alias is unmapped; every handler thread, hence every
    /// request into it, has ended by then (they hold this `Arc`).
    pub alias_mr: Option<RegisteredMemory>,
    pub manager: Arc<TransportManager>,
    pub region: GuestRegion,
    pub uffd: RegionUffd,
    pub states: PageStates,
    pub config: GuestMemoryConfig,
    pub sigbus: SigbusMethod,
    pub stop: AtomicBool,
    pub stop_fd: libc::c_int,
    pub counters: Counters,
    pub streams: StreamTable,
    pub prefetch: PrefetchQueue,
    /// Never taken by handlers or faulting threads.
    pub writeback: Mutex<Writeback>,
    /// `Some` when dirty pages are found with `PAGEMAP_SCAN` (asynchronous
    /// write protection, `dirty_scan.rs`); `None`: write-protect faults.
    pub pagemap: Option<crate::uffd::Pagemap>,
}

impl Shared {
    /// Wakes the threads waiting on page `page`.
    pub(crate) fn wake(&self, page: usize) {
        self.uffd
            .wake(self.region.page_addr(page), self.region.unit_bytes());
    }

    /// Releases page `page` (see [`PageStates::release`]) and wakes the
    /// threads that deferred on it. The wake of a `UFFDIO_COPY` or unprotect
    /// does not replace this one: a thread may fault (e.g. a write on a page
    /// just installed write-protected) and defer after that wake but before
    /// this release.
    pub(crate) fn release(&self, page: usize, set: u32, clear: u32, dropped: bool) {
        if self.states.release(page, set, clear, dropped) {
            self.wake(page);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: the eventfd is ours and closed once, after every thread
        // that polled it has been joined (they hold this `Arc`).
        unsafe { libc::close(self.stop_fd) };
    }
}

/// Errors after which fetching the page again may succeed.
pub(crate) fn is_transient(err: &TransportError) -> bool {
    matches!(
        err,
        TransportError::NodeDown { .. }
            | TransportError::Timeout { .. }
            | TransportError::PoolExhausted { .. }
            | TransportError::Protocol { .. }
            // Corrupted on the way: the next attempt may arrive intact.
            | TransportError::Checksum { .. }
            | TransportError::Coordinator(_)
            // An operator may re-initialise the range meanwhile; each retry
            // refreshes the map before it fails again.
            | TransportError::DataLost { .. }
    )
}
