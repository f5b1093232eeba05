//! Coherent guest RAM (issue 11): several hypervisor processes (nodes) map
//! the same guest RAM, single writer / many readers per page. The
//! protocol (`docs/coherence.md`) runs in [`crate::coherent::CoherentNode`];
//! this module gives it a guest mapping and a fault path:
//!
//! - a read fault on a page the node holds no copy of asks its home for a
//!   shared copy, installed write-protected (`UFFDIO_COPY` + `MODE_WP`;
//!   for guest RAM in a shared-memory file, the page is written into the
//!   file through the region's alias and mapped with `UFFDIO_CONTINUE` +
//!   `MODE_WP`);
//! - a write fault on a missing page asks for exclusive ownership and
//!   installs the page writable; a write fault on a shared copy (a
//!   write-protect fault) asks for an upgrade, then lifts the protection;
//! - when the home calls the page back, the copy is write-protected first
//!   (writers on this node fault and wait), copied out if it must be
//!   written back, then dropped (`MADV_DONTNEED`: the next touch faults) or
//!   kept read-only. A shared file keeps the dropped page's last contents
//!   (the next fault is a minor one, and the grant's data replaces them):
//!   another process mapping the file (a vhost-user back-end) reads them
//!   without coherence.
//!
//! Files: `copies.rs` (the local copies: what the protocol's actions do to
//! the mapping), `faults.rs` (the fault threads).

mod copies;
mod faults;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::coherent::{Access, CoherenceConfig, CoherentNode, NodeStats};
use crate::error::TransportError;
use crate::manager::TransportManager;

use super::config::GuestMemoryConfig;
use super::error::GuestMemoryError;
use super::region::GuestRegion;
use super::uffd::{Memory, RegionUffd};
use copies::Copies;

/// Counters of one coherent region since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoherentMemoryStats {
    /// Read faults on pages this node held no copy of.
    pub read_faults: u64,
    /// Write faults on pages this node held no copy of.
    pub write_faults: u64,
    /// Write faults on shared (read-only) copies.
    pub upgrade_faults: u64,
    /// Pages installed from a grant's data.
    pub pages_installed: u64,
    /// Copies dropped because the home asked (or `evict`).
    pub invalidations: u64,
    /// Owned copies made read-only because the home asked.
    pub downgrades: u64,
    /// Pages whose contents went back to the home.
    pub pages_written_back: u64,
    /// Faults that could not be served (lost data, home down, timeout).
    pub fault_errors: u64,
    /// Faults turned into SIGBUS.
    pub sigbus_raised: u64,
    /// The protocol's own counters (requests, coalesced faults, deferred
    /// callbacks under the minimum hold time, ...).
    pub protocol: NodeStats,
}

/// Guest RAM shared coherently with other nodes of the same VM: every page
/// has a home (the page-server owning its range) that keeps its directory.
/// See the [module docs](self) and `docs/coherence.md`.
///
/// A vCPU's access faults to this region's handler threads, which get the
/// page from its home (and whatever recall of other nodes' copies that
/// takes), then wake it. Pages this node owns go back to their home when it
/// asks, or with [`CoherentMemory::evict`]. Dropping the region closes its
/// connections: pages it owned and had not written back are lost (their
/// home then answers every request for them with the lost-data error), so
/// evict everything first to hand it over. Stop every thread that touches
/// the region before dropping it.
#[derive(Debug)]
pub struct CoherentMemory {
    copies: Arc<Copies>,
    node: Arc<CoherentNode>,
    stop: Arc<AtomicBool>,
    stop_fd: libc::c_int,
    threads: Vec<JoinHandle<()>>,
}

impl CoherentMemory {
    /// Maps `config.size_bytes` of guest RAM at `config.gpa_base` as a node
    /// of the coherent VM whose pages are homed at `manager`'s page-servers,
    /// and starts `config.handler_threads` fault threads (each serves one
    /// fault at a time; a fault may wait for other nodes' copies to be
    /// recalled). Uses `handler_threads`, `handler_cpus`, `handler_slice_us`, `sigbus_method`,
    /// `fault_mode`, `on_fault_error`, `retry_interval_ms` and `backing`
    /// of `config`; each attempt at a fault waits up to
    /// `coherence.timeout_ms` (`fault_timeout_ms`, `prefetch_max_pages`
    /// and `dirty_tracking` do not apply).
    ///
    /// # Errors
    /// [`GuestMemoryError::Config`] for a bad size, alignment or thread
    /// count, or a `coherence.dead_home_timeout_ms` of 0 (no home accepts
    /// a node without a bound); [`GuestMemoryError::Unsupported`] for hugetlbfs (coherence
    /// works in 4 KiB pages), or a kernel without userfaultfd write
    /// protection (or, for a shared file, `UFFDIO_CONTINUE` with write
    /// protection, Linux >= 6.4); the errors of [`super::GuestMemory::new`]
    /// for a bad shared file or handed-over userfaultfd.
    pub fn new(
        manager: &TransportManager,
        config: GuestMemoryConfig,
        coherence: CoherenceConfig,
    ) -> Result<Self, GuestMemoryError> {
        if config.handler_threads == 0 || config.handler_threads > 64 {
            return Err(GuestMemoryError::Config(
                "handler_threads must be between 1 and 64".into(),
            ));
        }
        coherence
            .declared_bound_ms()
            .map_err(GuestMemoryError::Config)?;
        let region = GuestRegion::new(config.gpa_base, config.size_bytes, &config.backing)?;
        if region.memory() == Memory::Hugetlbfs {
            return Err(GuestMemoryError::Unsupported(
                "coherent guest memory works in 4 KiB pages: not on hugetlbfs".into(),
            ));
        }
        if region.is_shared() {
            // A shared copy is mapped write-protected, so that the first
            // write asks its home for the page: never writable first, even
            // for a moment.
            super::uffd::require_continue_wp()?;
        }
        let uffd = RegionUffd::for_region(&region, &config, false)?;
        let sigbus = uffd.sigbus_method(config.sigbus_method)?;
        let stop_fd = super::stop_eventfd()?;
        let copies = Arc::new(Copies::new(region, uffd));
        let node = Arc::new(manager.coherent_node(Arc::clone(&copies) as _, coherence));
        let stop = Arc::new(AtomicBool::new(false));
        let mut memory = Self {
            copies: Arc::clone(&copies),
            node: Arc::clone(&node),
            stop: Arc::clone(&stop),
            stop_fd,
            threads: Vec::new(),
        };
        let cpus = config.handler_cpus.clone().unwrap_or_default();
        let faults = Arc::new(faults::Faults {
            copies,
            node,
            stop,
            stop_fd,
            sigbus,
            on_fault_error: config.on_fault_error.clone(),
            retry_interval: std::time::Duration::from_millis(config.retry_interval_ms.max(1)),
        });
        let slice_us = config.handler_slice_us;
        let (placed, all_placed) = std::sync::mpsc::channel();
        for i in 0..config.handler_threads {
            let cpu = (!cpus.is_empty()).then(|| cpus[i % cpus.len()]);
            let faults = Arc::clone(&faults);
            let name = format!("coherent-uffd-{i}");
            let placed = placed.clone();
            let handle = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || {
                    super::placement::place_current_thread(cpu, slice_us, placed);
                    faults.run();
                })
                .map_err(|source| GuestMemoryError::Thread { name, source })?;
            memory.threads.push(handle);
        }
        drop(placed);
        super::placement::wait_placed(all_placed, config.handler_threads);
        tracing::debug!(
            gpa_base = memory.gpa_base(),
            pages = memory.copies.region.pages(),
            "coherent guest memory registered with userfaultfd"
        );
        Ok(memory)
    }

    /// Host address of the region's first byte (GPA `gpa_base`).
    pub fn as_ptr(&self) -> *mut u8 {
        self.copies.region.base()
    }

    /// First guest-physical address of the region.
    pub fn gpa_base(&self) -> u64 {
        self.copies.region.gpa_base()
    }

    /// Size of the region in bytes.
    pub fn size_bytes(&self) -> usize {
        self.copies.region.len_bytes()
    }

    /// Host address of `gpa`, when it is inside the region.
    pub fn host_addr(&self, gpa: u64) -> Option<*mut u8> {
        self.copies.region.host_range(gpa, 1).ok()
    }

    /// Copies guest memory at `gpa` into `buf` (faulting pages in as
    /// needed: a fault that fails raises SIGBUS in this thread unless
    /// `on_fault_error` says otherwise; [`CoherentMemory::acquire`] first
    /// to get the error instead).
    ///
    /// # Errors
    /// [`GuestMemoryError::OutOfRange`] when the bytes are not all inside.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<(), GuestMemoryError> {
        self.copies.region.read(gpa, buf)
    }

    /// Copies `data` into guest memory at `gpa` (faulting pages in for
    /// writing as needed; see [`CoherentMemory::read`]).
    ///
    /// # Errors
    /// [`GuestMemoryError::OutOfRange`] when the bytes are not all inside.
    pub fn write(&self, gpa: u64, data: &[u8]) -> Result<(), GuestMemoryError> {
        self.copies.region.write(gpa, data)
    }

    /// Makes the page at `gpa` (page aligned) allow `access` on this node
    /// now, as a fault would, but returns the error instead of raising
    /// SIGBUS. The page may be taken away again right after (when another
    /// node asks), as any page may.
    ///
    /// # Errors
    /// [`TransportError::CoherentDataLost`] when the page's latest writes
    /// were lost with a node that owned it; [`TransportError::UnknownGpa`]
    /// for an address outside the region; the errors of
    /// [`CoherentNode::acquire`].
    pub fn acquire(&self, gpa: u64, access: Access) -> Result<(), TransportError> {
        if !crate::page::is_page_aligned(gpa) {
            return Err(TransportError::Unaligned { gpa });
        }
        if self
            .copies
            .region
            .pages_of(gpa, crate::PAGE_SIZE as u64)
            .is_err()
        {
            return Err(TransportError::UnknownGpa { gpa });
        }
        self.node.acquire(gpa, access)
    }

    /// Hands the pages of `[gpa, gpa + len_bytes)` that this node holds
    /// back to their homes: an owned page is written back, every copy is
    /// dropped (the next touch faults). Returns the number of copies
    /// dropped.
    ///
    /// # Errors
    /// [`GuestMemoryError::OutOfRange`] for a range outside the region or
    /// not page aligned; [`GuestMemoryError::WriteBack`] when a home could
    /// not be reached (pages after it are kept).
    pub fn evict(&self, gpa: u64, len_bytes: u64) -> Result<u64, GuestMemoryError> {
        let (first, end) = self.copies.region.pages_of(gpa, len_bytes)?;
        let mut dropped = 0;
        for page in first..end {
            if !self.copies.holds(page) {
                continue;
            }
            let page_gpa = self.copies.region.page_gpa(page);
            self.node
                .evict(page_gpa)
                .map_err(|source| GuestMemoryError::WriteBack { pages: 1, source })?;
            dropped += 1;
        }
        Ok(dropped)
    }

    /// The homes this node is connected to, each with its RDMA message
    /// channel's counters (`None`: over TCP); see
    /// [`crate::coherent::CoherentNode::connections`].
    pub fn connections(&self) -> Vec<(String, Option<crate::rdma::ChannelStats>)> {
        self.node.connections()
    }

    /// Counters since creation.
    pub fn stats(&self) -> CoherentMemoryStats {
        let mut stats = self.copies.stats();
        stats.protocol = self.node.stats();
        stats
    }
}

impl Drop for CoherentMemory {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        let ret = unsafe {
            libc::write(
                self.stop_fd,
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        if ret < 0 {
            tracing::warn!(err = %std::io::Error::last_os_error(), "waking coherent fault threads failed");
        }
        // Faults waiting for a home fail now instead of at their deadline.
        self.node.close();
        for handle in self.threads.drain(..) {
            if handle.join().is_err() {
                tracing::error!("a coherent fault thread panicked");
            }
        }
        // SAFETY: our own eventfd, closed once; the threads that polled it
        // have been joined.
        unsafe { libc::close(self.stop_fd) };
    }
}
