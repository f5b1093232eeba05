//! This node's copies of coherent pages, in the guest mapping: what the
//! protocol's actions (`docs/coherence.md`, "Integration") do to it. The
//! `CoherentNode` calls these with the page's protocol state locked, so a
//! recall never overtakes the install of the grant it revokes.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use crate::coherent::{CoherenceHandler, Mode, Recall, RecallAnswer};
use crate::page::{Page, PAGE_SIZE};

use super::super::region::GuestRegion;
use super::super::uffd::{CopyOutcome, RegionUffd};
use super::CoherentMemoryStats;

/// `held` values: what is mapped at a page.
const NONE: u8 = 0;
const SHARED: u8 = 1;
const EXCLUSIVE: u8 = 2;

/// Attempts of a `UFFDIO_COPY` the kernel asks to repeat (`EAGAIN`: the
/// mapping changed meanwhile) or that found a stale page in place.
const COPY_ATTEMPTS: usize = 16;

/// The region, its userfaultfd and what this node holds of each page.
#[derive(Debug)]
pub(super) struct Copies {
    pub(super) region: GuestRegion,
    pub(super) uffd: RegionUffd,
    /// Per page: `NONE`, `SHARED` (mapped write-protected) or `EXCLUSIVE`
    /// (mapped writable). Written with the page's protocol state locked.
    held: Box<[AtomicU8]>,
    pub(super) counters: Counters,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) read_faults: AtomicU64,
    pub(super) write_faults: AtomicU64,
    pub(super) upgrade_faults: AtomicU64,
    pub(super) fault_errors: AtomicU64,
    pub(super) sigbus_raised: AtomicU64,
    pages_installed: AtomicU64,
    invalidations: AtomicU64,
    downgrades: AtomicU64,
    pages_written_back: AtomicU64,
}

pub(super) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Copies {
    pub(super) fn new(region: GuestRegion, uffd: RegionUffd) -> Self {
        let held = (0..region.pages()).map(|_| AtomicU8::new(NONE)).collect();
        Self {
            region,
            uffd,
            held,
            counters: Counters::default(),
        }
    }

    /// Whether this node holds a copy of `page`.
    pub(super) fn holds(&self, page: usize) -> bool {
        self.held[page].load(Ordering::Acquire) != NONE
    }

    pub(super) fn stats(&self) -> CoherentMemoryStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CoherentMemoryStats {
            read_faults: get(&c.read_faults),
            write_faults: get(&c.write_faults),
            upgrade_faults: get(&c.upgrade_faults),
            pages_installed: get(&c.pages_installed),
            invalidations: get(&c.invalidations),
            downgrades: get(&c.downgrades),
            pages_written_back: get(&c.pages_written_back),
            fault_errors: get(&c.fault_errors),
            sigbus_raised: get(&c.sigbus_raised),
            protocol: Default::default(),
        }
    }

    fn page_of(&self, gpa: u64) -> Option<usize> {
        self.region
            .pages_of(gpa, PAGE_SIZE as u64)
            .ok()
            .map(|(first, _)| first)
    }

    /// Puts `data` in place as page `page` (absent from the guest mapping)
    /// and wakes its waiters; write-protected for a shared copy. Anonymous
    /// memory: `UFFDIO_COPY`. A shared file: `data` is written into the
    /// file through the alias, then `UFFDIO_CONTINUE` maps it. A page found
    /// mapped (a stale copy, a poison marker) is dropped first.
    /// Returns whether the page is in place.
    fn copy_in(&self, page: usize, data: &Page, mode: Mode) -> bool {
        let addr = self.region.page_addr(page);
        let protect = mode == Mode::Shared;
        let shared = self.region.is_shared();
        if shared {
            // SAFETY: the alias page is inside the live alias mapping, which
            // no fault maps into the guest until the CONTINUE below; the
            // page's protocol state is locked, so no other install or
            // recall of it runs meanwhile.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), self.region.data_ptr(page), PAGE_SIZE)
            };
        }
        for _ in 0..COPY_ATTEMPTS {
            let installed = if shared {
                // SAFETY: `addr` is a page of the registered range whose
                // page cache holds `data` (written through the alias).
                unsafe { self.uffd.continue_pages(addr, 1, protect) }
            } else {
                // SAFETY: `data` is a whole page; `addr` is a page of the
                // registered range, raw memory no Rust reference points into.
                unsafe { self.uffd.copy_page(data.as_ptr(), addr, protect) }
            };
            match installed {
                Ok(CopyOutcome::Copied) => return true,
                Ok(CopyOutcome::Again) => {}
                Ok(CopyOutcome::Exists) => {
                    if let Err(err) = self.region.unmap_guest(page, page + 1) {
                        tracing::error!(%err, page, "cannot drop a stale copy");
                        return false;
                    }
                }
                Err(err) => {
                    tracing::error!(%err, page, "installing a granted page failed");
                    return false;
                }
            }
        }
        tracing::error!(page, "a granted page could not be installed");
        false
    }

    /// The page's contents (a copy this node holds: it is mapped), read
    /// through the alias of a shared file (never registered: no fault
    /// possible) or the guest mapping of anonymous memory.
    fn contents(&self, page: usize) -> Box<Page> {
        let mut data = Box::new([0u8; PAGE_SIZE]);
        // SAFETY: the page is mapped (held, and only this module drops
        // pages), so reading it cannot fault; other threads' writes are
        // held off by the write protection set before.
        unsafe {
            std::ptr::copy_nonoverlapping(self.region.data_ptr(page), data.as_mut_ptr(), PAGE_SIZE)
        };
        bump(&self.counters.pages_written_back);
        data
    }

    /// Write-protects `page`: writers on this node fault and wait.
    fn protect(&self, page: usize) {
        if let Err(err) = self
            .uffd
            .write_protect(self.region.page_addr(page), PAGE_SIZE)
        {
            tracing::error!(%err, page, "UFFDIO_WRITEPROTECT of a recalled page failed");
        }
    }
}

impl CoherenceHandler for Copies {
    fn install(&self, gpa: u64, mode: Mode, data: Option<&Page>) {
        let Some(page) = self.page_of(gpa) else {
            tracing::error!(gpa, "a grant for a page outside the region");
            return;
        };
        // Recorded before the page is mapped: mapping it wakes the faulting
        // vCPU, which may go on to `evict` it at once (and must find it).
        let held = match mode {
            Mode::Shared => SHARED,
            Mode::Exclusive => EXCLUSIVE,
        };
        self.held[page].store(held, Ordering::Release);
        let addr = self.region.page_addr(page);
        match data {
            Some(data) => {
                if self.copy_in(page, data, mode) {
                    bump(&self.counters.pages_installed);
                } else {
                    // Not mapped: nothing may read it (a recall that needs
                    // its contents then makes this node leave the home,
                    // whose page is reported lost, rather than read a page
                    // that is not there); the vCPU faults again.
                    self.held[page].store(NONE, Ordering::Release);
                }
            }
            // The copy held is valid: an upgrade lifts the protection
            // (and wakes the writers waiting on it).
            None if mode == Mode::Exclusive => {
                if let Err(err) = self.uffd.unprotect(addr, PAGE_SIZE) {
                    tracing::error!(%err, page, "lifting the write protection of an upgraded page failed");
                }
            }
            None => self.protect(page),
        }
    }

    fn recall(&self, gpa: u64, recall: Recall) -> RecallAnswer {
        let Some(page) = self.page_of(gpa) else {
            tracing::error!(gpa, "a recall of a page outside the region");
            return RecallAnswer::Done;
        };
        let mapped = self.held[page].load(Ordering::Acquire) != NONE;
        if recall.needs_data() && !mapped {
            // Nothing to read: the node leaves that home (see
            // `CoherenceHandler::recall`). Never expected.
            tracing::error!(gpa, "a write-back asked of a page this node does not hold");
            return RecallAnswer::Done;
        }
        let data = if recall.needs_data() {
            self.protect(page);
            Some(self.contents(page))
        } else {
            None
        };
        match recall {
            Recall::Invalidate { .. } => {
                if mapped {
                    if let Err(err) = self.region.unmap_guest(page, page + 1) {
                        tracing::error!(%err, page, "dropping an invalidated copy failed");
                    }
                }
                self.held[page].store(NONE, Ordering::Release);
                bump(&self.counters.invalidations);
            }
            Recall::Downgrade => {
                self.held[page].store(SHARED, Ordering::Release);
                bump(&self.counters.downgrades);
            }
        }
        data.map_or(RecallAnswer::Done, RecallAnswer::WriteBack)
    }
}
