//! Guest RAM backed by remote pages through userfaultfd: the hypervisor's
//! fault path.
//!
//! A [`GuestMemory`] maps one guest RAM region (a GPA base and a size) as
//! anonymous memory that is never populated locally, or as a range of a
//! shared-memory file the hypervisor owns ([`GuestBacking::SharedFile`],
//! optionally with the hypervisor's own mapping and userfaultfd,
//! [`HandedOverUffd`]), and registers it with userfaultfd for MISSING and
//! write-protect faults (and MINOR ones for a shared file). The hypervisor hands
//! [`GuestMemory::as_ptr`] to its vCPUs (e.g. as a KVM memory slot); every
//! first touch of a page faults to one of the region's pinned handler
//! threads, which fetches the page from its owner through the
//! [`TransportManager`] and installs it. Dirty pages go back to their owner
//! with [`GuestMemory::flush`] and [`GuestMemory::evict`]. Sequential
//! faults start read-ahead. A fault that cannot be served is reported to a
//! callback and, by default, turns into SIGBUS in the faulting thread
//! rather than freezing it.
//!
//! Files: `region.rs` (the mapping), `uffd.rs` (the region's userfaultfd,
//! on [`crate::uffd`]),
//! `state.rs` (per-page state words), `handler.rs` (fault threads, each
//! with many fetches in flight), `install.rs` (a fetched page put in
//! place), `file.rs` (a shared-memory file's mappings),
//! `dirty.rs` (write-back), `prefetch.rs` (read-ahead), `config.rs`.
//! The design is in `docs/embedding.md`.
//!
//! ```no_run
//! use std::sync::Arc;
//! use rdma_transport::guest_memory::{GuestMemory, GuestMemoryConfig};
//! use rdma_transport::{ManagerConfig, TransportManager};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let manager = Arc::new(TransportManager::connect(ManagerConfig {
//!     coordinator_url: "http://127.0.0.1:7070".into(),
//!     ..ManagerConfig::default()
//! })?);
//! let ram = GuestMemory::new(manager, GuestMemoryConfig::new(0, 64 << 20))?;
//! ram.write(0x1000, b"hello")?; // faults the page in, marks it dirty
//! ram.flush()?;                 // back to its owner
//! ram.evict(0, 64 << 20)?;      // drop it all; the next touch fetches again
//! let mut buf = [0u8; 5];
//! ram.read(0x1000, &mut buf)?;
//! assert_eq!(&buf, b"hello");
//! # Ok(()) }
//! ```

mod coherent;
mod config;
mod dirty;
mod dirty_scan;
mod error;
mod file;
mod handler;
mod install;
mod placement;
mod prefetch;
mod region;
mod shared;
mod slice;
mod state;
#[cfg(any(test, feature = "test-hooks"))]
pub mod test_hooks;
mod uffd;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::manager::TransportManager;
use crate::sys::cvt;

pub use crate::uffd::FaultMode;
pub use coherent::{CoherentMemory, CoherentMemoryStats};
pub use config::{
    DirtyTracking, FaultAction, FaultErrorHandler, FaultReport, GuestBacking, GuestMemoryConfig,
    HandedOverUffd, SharedFile, SigbusMethod,
};
pub use error::GuestMemoryError;
pub use slice::kernel_honours_handler_slice;

use shared::{Counters, Shared, Writeback, WRITEBACK_BATCH};

/// Counters of one region since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GuestMemoryStats {
    /// MISSING faults resolved by fetching the page (counted just before
    /// the install that wakes the faulting thread).
    pub missing_faults: u64,
    /// 4 KiB pages fetched by fault handlers (read-ahead not included):
    /// counted per attempt, so a retried fault counts each try; a huge page
    /// (hugetlbfs) counts all its 4 KiB pages. A page is fetched once
    /// however many threads fault on it.
    pub pages_fetched: u64,
    /// Of the faults' fetches, those a handler thread read on the spot on
    /// the manager's one-page TCP path, as a bare handler would, because
    /// the fault was the only one it had (one vCPU faulting); the others go
    /// through its completion queue, many in flight at once.
    pub faults_fetched_inline: u64,
    /// Of the faults a handler began to read on the spot, those whose
    /// answer took longer than 200 µs or failed: cancelled and sent to the
    /// completion queue instead (a slow or hung node, or a lost
    /// connection).
    pub inline_fetches_given_up: u64,
    /// First writes to clean pages.
    pub wp_faults: u64,
    /// Faults parked until another thread finished with the page.
    pub deferred_faults: u64,
    /// Pages installed by read-ahead (counted just before the install that
    /// wakes the threads waiting for them).
    pub prefetched_pages: u64,
    /// Read-ahead batches fetched.
    pub prefetch_batches: u64,
    /// Faults that could not be served within their deadline.
    pub fault_errors: u64,
    /// Faults turned into SIGBUS.
    pub sigbus_raised: u64,
    /// Pages written back to their owners.
    pub pages_written_back: u64,
    /// Of those, pages sent straight from memory, without a copy (runs of
    /// at least 16 consecutive dirty pages; the others go through a bounce
    /// batch).
    pub pages_written_in_place: u64,
    /// Pages dropped by `evict`.
    pub pages_evicted: u64,
}

/// Guest RAM backed by remote pages. See the [module docs](self).
///
/// Dropping it stops its threads and unmaps the region; dirty pages that
/// were not flushed are discarded. Stop every thread that touches the
/// region first.
#[derive(Debug)]
pub struct GuestMemory {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl GuestMemory {
    /// Maps `config.size_bytes` of guest RAM at `config.gpa_base`, registers
    /// it with userfaultfd and starts its handler threads (and the
    /// prefetch thread when read-ahead is on).
    ///
    /// # Errors
    /// [`GuestMemoryError::Config`] for a bad size, alignment or thread
    /// count; [`GuestMemoryError::Unsupported`] when the kernel's
    /// userfaultfd lacks write-protect (Linux < 5.7; for a shared file,
    /// minor faults or write-protect on its memory, Linux < 5.19);
    /// [`GuestMemoryError::KernelFaultsRefused`] when `config.fault_mode` is
    /// [`FaultMode::KernelAndUser`] and the process may not have kernel-mode
    /// faults;
    /// [`GuestMemoryError::Userfaultfd`], [`GuestMemoryError::Memory`],
    /// [`GuestMemoryError::Thread`] for failed system calls.
    pub fn new(
        manager: Arc<TransportManager>,
        config: GuestMemoryConfig,
    ) -> Result<Self, GuestMemoryError> {
        if config.handler_threads == 0 || config.handler_threads > 64 {
            return Err(GuestMemoryError::Config(
                "handler_threads must be between 1 and 64".into(),
            ));
        }
        if config.fault_timeout_ms == 0 {
            return Err(GuestMemoryError::Config(
                "fault_timeout_ms must be > 0".into(),
            ));
        }
        let mut region =
            region::GuestRegion::new(config.gpa_base, config.size_bytes, &config.backing)?;
        let scan = scan_dirty_tracking(&config, &region)?;
        let uffd = uffd::RegionUffd::for_region(&region, &config, scan)?;
        let pagemap = if scan {
            Some(
                crate::uffd::Pagemap::open().map_err(|source| GuestMemoryError::Memory {
                    op: "open(/proc/self/pagemap)",
                    source,
                })?,
            )
        } else {
            None
        };
        let mut config = config;
        if region.unit_pages() > 1 {
            // A fault brings a whole huge page already.
            config.prefetch_max_pages = 0;
        }
        let sigbus = uffd.sigbus_method(config.sigbus_method)?;
        // After the cheap checks: registration pins the whole region.
        let alias_mr = register_alias(&manager, &config, &mut region)?;
        let stop_fd = stop_eventfd()?;
        tracing::debug!(
            gpa_base = region.gpa_base(),
            pages = region.pages(),
            kernel_faults = uffd.kernel_faults(),
            ?sigbus,
            "guest memory registered with userfaultfd"
        );
        let shared = Arc::new(Shared {
            alias_mr,
            manager,
            states: state::PageStates::new(region.pages()),
            region,
            uffd,
            sigbus,
            stop: AtomicBool::new(false),
            stop_fd,
            counters: Counters::default(),
            streams: prefetch::StreamTable::default(),
            prefetch: prefetch::PrefetchQueue::default(),
            pagemap,
            writeback: Mutex::new(Writeback {
                pages: vec![[0u8; crate::PAGE_SIZE]; WRITEBACK_BATCH],
                gpas: Vec::with_capacity(WRITEBACK_BATCH),
                index: Vec::with_capacity(WRITEBACK_BATCH),
            }),
            config,
        });
        let mut memory = Self {
            shared: Arc::clone(&shared),
            threads: Vec::new(),
        };
        let cpus = handler_cpus(&shared.config);
        let (placed, all_placed) = std::sync::mpsc::channel();
        for i in 0..shared.config.handler_threads {
            let cpu = (!cpus.is_empty()).then(|| cpus[i % cpus.len()]);
            let thread_shared = Arc::clone(&shared);
            let queue = shared
                .manager
                .completion_queue(crate::manager::Reap::Eventfd)
                .map_err(|err| {
                    GuestMemoryError::Config(format!("cannot make a fault handler's queue: {err}"))
                })?;
            let placed = placed.clone();
            memory.spawn(format!("uffd-handler-{i}"), move || {
                let slice_us = thread_shared.config.handler_slice_us;
                placement::place_current_thread(cpu, slice_us, placed);
                handler::run(&thread_shared, queue);
            })?;
        }
        drop(placed);
        placement::wait_placed(all_placed, shared.config.handler_threads);
        if shared.config.prefetch_max_pages > 0 {
            // With the first handler: it runs while the vCPUs it serves
            // wait, and stays off the transport pollers' CPUs.
            let cpu = cpus.first().copied();
            let thread_shared = Arc::clone(&shared);
            memory.spawn("uffd-prefetch".into(), move || {
                if let Some(id) = cpu {
                    if !core_affinity::set_for_current(core_affinity::CoreId { id }) {
                        tracing::warn!(cpu = id, "cannot pin the prefetch thread");
                    }
                }
                prefetch::run(&thread_shared);
            })?;
            if let Some(t) = memory.threads.last() {
                shared.prefetch.set_thread(t.thread().clone());
            }
        }
        Ok(memory)
    }

    fn spawn(
        &mut self,
        name: String,
        f: impl FnOnce() + Send + 'static,
    ) -> Result<(), GuestMemoryError> {
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(f)
            .map_err(|source| GuestMemoryError::Thread { name, source })?;
        self.threads.push(handle);
        Ok(())
    }

    /// Host address of the region's first byte (GPA `gpa_base`). Valid for
    /// `size_bytes()` bytes while `self` lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.shared.region.base()
    }

    /// First guest-physical address of the region.
    pub fn gpa_base(&self) -> u64 {
        self.shared.region.gpa_base()
    }

    /// Size of the region in bytes.
    pub fn size_bytes(&self) -> usize {
        self.shared.region.len_bytes()
    }

    /// Host address of `gpa`, when it is inside the region.
    pub fn host_addr(&self, gpa: u64) -> Option<*mut u8> {
        self.shared.region.host_range(gpa, 1).ok()
    }

    /// True when the manager's RDMA reads and writes of this region's pages
    /// land in and go out of guest memory directly (a shared-memory backing
    /// whose alias is registered with the device, see
    /// [`GuestMemoryConfig::rdma_register_alias`]); false when they bounce
    /// through the pool, or the manager has no RDMA.
    pub fn rdma_zero_copy(&self) -> bool {
        self.shared.alias_mr.is_some()
    }

    /// How the region finds dirty pages (`Auto` resolved).
    pub fn dirty_tracking(&self) -> DirtyTracking {
        if self.shared.pagemap.is_some() {
            DirtyTracking::PagemapScan
        } else {
            DirtyTracking::WriteFaults
        }
    }

    /// False when the kernel cannot write-protect the region's memory (a
    /// shared file on Linux 5.13-5.18): then no write is tracked, every
    /// page mapped counts as dirty, and `flush` writes back and unmaps
    /// every mapped page (their next touch fetches them from their owners).
    /// [`GuestMemory::dirty_tracking`] then names the method the region
    /// would use on a newer kernel.
    pub fn tracks_writes(&self) -> bool {
        self.shared.uffd.write_protects()
    }

    /// How a failed fault turns into SIGBUS on this host (`Auto` resolved).
    pub fn sigbus_method(&self) -> SigbusMethod {
        self.shared.sigbus
    }

    /// True when faults taken in kernel mode (KVM, syscalls) are served too.
    pub fn handles_kernel_faults(&self) -> bool {
        self.shared.uffd.kernel_faults()
    }

    /// Copies guest memory at `gpa` into `buf`, faulting pages in as needed.
    /// Must not be called from the fault-error callback.
    ///
    /// # Errors
    /// [`GuestMemoryError::OutOfRange`] when the bytes are not all inside.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<(), GuestMemoryError> {
        self.shared.region.read(gpa, buf)
    }

    /// Copies `data` into guest memory at `gpa`, faulting pages in as
    /// needed (they become dirty).
    ///
    /// # Errors
    /// [`GuestMemoryError::OutOfRange`] when the bytes are not all inside.
    pub fn write(&self, gpa: u64, data: &[u8]) -> Result<(), GuestMemoryError> {
        self.shared.region.write(gpa, data)
    }

    /// Writes every dirty page back to its owner and waits for the
    /// acknowledgements; returns the number of 4 KiB pages written. Safe to call
    /// while vCPUs run and fault: every write that completed before the
    /// call is written back, and writes racing with it leave their page
    /// dirty for the next flush.
    ///
    /// # Errors
    /// [`GuestMemoryError::WriteBack`] when some pages could not be written
    /// (they stay dirty; the others were written).
    pub fn flush(&self) -> Result<u64, GuestMemoryError> {
        dirty::flush(&self.shared)
    }

    /// Writes back the dirty pages of `[gpa, gpa + len_bytes)`, waits for
    /// the acknowledgements, then drops every page of the range
    /// (`MADV_DONTNEED`): the next touch fetches it again. Also clears
    /// poisoned pages. Returns the number of 4 KiB pages dropped. No page
    /// is dropped before its write-back is acknowledged.
    ///
    /// # Errors
    /// [`GuestMemoryError::OutOfRange`] for an outside range, or one not
    /// aligned to the region's page size (4 KiB, or the huge page size of
    /// a hugetlbfs backing);
    /// [`GuestMemoryError::WriteBack`] when a write-back failed: pages of
    /// that batch and after stay mapped and dirty.
    pub fn evict(&self, gpa: u64, len_bytes: u64) -> Result<u64, GuestMemoryError> {
        let (first, end) = self.shared.region.pages_of(gpa, len_bytes)?;
        dirty::evict(&self.shared, first, end)
    }

    /// Counters since creation.
    pub fn stats(&self) -> GuestMemoryStats {
        let c = &self.shared.counters;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        GuestMemoryStats {
            missing_faults: get(&c.missing_faults),
            pages_fetched: get(&c.pages_fetched),
            wp_faults: get(&c.wp_faults),
            deferred_faults: get(&c.deferred_faults),
            prefetched_pages: get(&c.prefetched_pages),
            prefetch_batches: get(&c.prefetch_batches),
            fault_errors: get(&c.fault_errors),
            sigbus_raised: get(&c.sigbus_raised),
            pages_written_back: get(&c.pages_written_back),
            pages_written_in_place: get(&c.pages_written_in_place),
            faults_fetched_inline: get(&c.faults_fetched_inline),
            inline_fetches_given_up: get(&c.inline_fetches_given_up),
            pages_evicted: get(&c.pages_evicted),
        }
    }

    /// The transport manager pages come from.
    pub fn manager(&self) -> &Arc<TransportManager> {
        &self.shared.manager
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        let ret = unsafe {
            libc::write(
                self.shared.stop_fd,
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        if ret < 0 {
            tracing::warn!(err = %std::io::Error::last_os_error(), "waking handler threads failed");
        }
        for handle in self.threads.drain(..) {
            handle.thread().unpark();
            if handle.join().is_err() {
                tracing::error!("a guest memory thread panicked");
            }
        }
    }
}

/// Whether the region tracks dirty pages with `PAGEMAP_SCAN` (see
/// [`DirtyTracking`]): possible for a shared-memory file of 4 KiB pages
/// with the region's own userfaultfd, on a kernel that offers
/// `UFFD_FEATURE_WP_ASYNC` (which came with `PAGEMAP_SCAN`, Linux 6.7).
fn scan_dirty_tracking(
    config: &GuestMemoryConfig,
    region: &region::GuestRegion,
) -> Result<bool, GuestMemoryError> {
    let handed_over = matches!(
        &config.backing,
        GuestBacking::SharedFile(SharedFile {
            handed_over: Some(_),
            ..
        })
    );
    let possible = || -> Result<bool, GuestMemoryError> {
        if region.memory() != uffd::Memory::Shmem || handed_over {
            return Ok(false);
        }
        // Acting as a kernel before 6.4, which has no WP_ASYNC either.
        #[cfg(any(test, feature = "test-hooks"))]
        if test_hooks::continue_wp_hidden() {
            return Ok(false);
        }
        let offered = uffd::probe_features(config.fault_mode)
            .map_err(|err| uffd::open_error(config.fault_mode, err))?;
        Ok(offered & crate::uffd::feature::WP_ASYNC != 0)
    };
    match config.dirty_tracking {
        DirtyTracking::WriteFaults => Ok(false),
        DirtyTracking::Auto => possible(),
        DirtyTracking::PagemapScan => {
            if possible()? {
                return Ok(true);
            }
            Err(GuestMemoryError::Unsupported(
                "DirtyTracking::PagemapScan needs a shared-memory file of 4 KiB pages, the \
                 region's own userfaultfd, and UFFD_FEATURE_WP_ASYNC (Linux >= 6.7)"
                    .into(),
            ))
        }
    }
}

/// The eventfd that wakes a region's threads when it is dropped.
fn stop_eventfd() -> Result<libc::c_int, GuestMemoryError> {
    // SAFETY: plain syscall; the result is checked.
    cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) }).map_err(|source| {
        GuestMemoryError::Userfaultfd {
            op: "eventfd",
            source,
        }
    })
}

/// Sends SIGBUS to thread `thread_id` of this process (parked in a fault
/// that cannot be served); the caller wakes it.
fn send_sigbus(thread_id: libc::pid_t) {
    let pid = std::process::id() as libc::pid_t;
    // SAFETY: tgkill has no memory effects; the thread id came with the
    // fault of a thread of this process parked in that fault.
    let ret = unsafe { libc::syscall(libc::SYS_tgkill, pid, thread_id, libc::SIGBUS) };
    if ret != 0 {
        tracing::error!(err = %std::io::Error::last_os_error(), thread_id, "tgkill(SIGBUS) failed");
    }
}

/// CPUs for the handlers: as configured, else the first CPUs of the host
/// (the transport pins its pollers to the last ones).
fn handler_cpus(config: &GuestMemoryConfig) -> Vec<usize> {
    if let Some(cpus) = &config.handler_cpus {
        return cpus.clone();
    }
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    (0..config.handler_threads).map(|i| i % ncpu).collect()
}

/// Registers a shared region's alias with the manager's RDMA device when
/// the config asks for it (see [`GuestMemoryConfig::rdma_register_alias`]);
/// `None` for anonymous memory, without RDMA, or when not asked.
fn register_alias(
    manager: &TransportManager,
    config: &GuestMemoryConfig,
    region: &mut region::GuestRegion,
) -> Result<Option<crate::rdma::RegisteredMemory>, GuestMemoryError> {
    let Some((ptr, len)) = region.alias() else {
        return Ok(None);
    };
    if !config.rdma_register_alias {
        return Ok(None);
    }
    // SAFETY: the alias stays mapped (read-write) until the handle, which
    // `Shared` drops before the region, is dropped; requests into it are
    // made only by the region's threads, all joined before that.
    let handle =
        unsafe { manager.register_memory(ptr, len) }.map_err(GuestMemoryError::RdmaRegister)?;
    if !handle.is_rdma() {
        // No RDMA: nothing was registered, TCP reads into the alias anyway.
        return Ok(None);
    }
    region.keep_file_pages();
    tracing::info!(
        len_bytes = len,
        "guest memory alias registered: RDMA moves pages straight into and out of it"
    );
    Ok(Some(handle))
}
