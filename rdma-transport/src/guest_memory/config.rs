//! Settings of a [`super::GuestMemory`] and the types of its fault-error
//! channel.

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::TransportError;
use crate::uffd::FaultMode;

/// How a fault that cannot be served is turned into SIGBUS in the faulting
/// thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SigbusMethod {
    /// [`SigbusMethod::Poison`] where the kernel offers `UFFDIO_POISON`
    /// (Linux >= 6.6), [`SigbusMethod::Tgkill`] elsewhere.
    #[default]
    Auto,
    /// Install a poison marker on the page (`UFFDIO_POISON`) and wake the
    /// thread: its access, and every later one, raises SIGBUS with
    /// `si_code = BUS_MCEERR_AR`, as a hardware memory error would (QEMU and
    /// other hypervisors already turn that into a machine check in the
    /// guest). [`super::GuestMemory::evict`] clears the poison, so the page
    /// is fetched again on the next touch.
    Poison,
    /// Send SIGBUS to the faulting thread with `tgkill` (its id comes with
    /// the fault) and wake it. If the thread survives the signal (it has a
    /// handler that returns), its access faults again and is served or fails
    /// again.
    Tgkill,
}

/// What to do with a fault that could not be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Raise SIGBUS in the faulting thread (see [`SigbusMethod`]).
    Sigbus,
    /// Keep the thread waiting and try again after `retry_interval_ms`,
    /// for another `fault_timeout_ms`.
    Retry,
}

/// A fault that could not be served within its deadline, as reported to
/// the embedding hypervisor.
#[derive(Debug)]
pub struct FaultReport {
    /// Guest-physical address of the page.
    pub gpa: u64,
    /// Host virtual address of the page.
    pub host_addr: usize,
    /// Kernel thread id of the faulting thread.
    pub thread_id: i32,
    /// True for a write access.
    pub write: bool,
    /// Attempts made so far.
    pub attempts: u32,
    /// Milliseconds since the fault was first seen.
    pub waited_ms: u64,
    /// The last transport error.
    pub error: TransportError,
}

/// The embedding hypervisor's fault-error callback: called on a handler
/// thread, must not touch guest memory and should return quickly.
pub type FaultErrorHandler = Arc<dyn Fn(&FaultReport) -> FaultAction + Send + Sync>;

/// What guest RAM is made of.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum GuestBacking {
    /// A private anonymous mapping made by the region (the default). Faults
    /// are resolved by copying the fetched page in (`UFFDIO_COPY`).
    #[default]
    Anonymous,
    /// A shared-memory file the hypervisor owns (a memfd or tmpfs file, or
    /// a hugetlbfs file or `MFD_HUGETLB` memfd), mapped `MAP_SHARED`, so
    /// that vhost-user back-ends, KVM memory slots and snapshots see the
    /// same pages. Faults are resolved without a bounce: the page is
    /// fetched straight into a second mapping of the file and mapped into
    /// guest memory with `UFFDIO_CONTINUE`. On hugetlbfs the unit of
    /// faults, dirty tracking, write-back and eviction is the huge page: a
    /// fault fetches all its 4 KiB pages at once (read-ahead is off), and
    /// the offset, size and evicted ranges must be multiples of it.
    SharedFile(SharedFile),
}

/// A range of a shared-memory file: `size_bytes` (of the
/// [`GuestMemoryConfig`]) from `offset_bytes`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SharedFile {
    /// The file, opened read-write (e.g. from `memfd_create(2)`). The
    /// region keeps it open while it lives.
    pub fd: Arc<OwnedFd>,
    /// Where the region starts in the file (a multiple of 4096, or of the
    /// huge page size on hugetlbfs).
    pub offset_bytes: u64,
    /// The hypervisor's own mapping of the range and its userfaultfd, when
    /// it made them (see [`HandedOverUffd`]); `None`: the region maps the
    /// file and opens its userfaultfd itself.
    pub handed_over: Option<HandedOverUffd>,
}

impl SharedFile {
    /// The region `[offset_bytes, offset_bytes + size_bytes)` of `fd`.
    pub fn new(fd: Arc<OwnedFd>, offset_bytes: u64) -> Self {
        Self {
            fd,
            offset_bytes,
            handed_over: None,
        }
    }

    /// The same range, served through the hypervisor's own mapping and
    /// userfaultfd.
    pub fn with_uffd(mut self, handed_over: HandedOverUffd) -> Self {
        self.handed_over = Some(handed_over);
        self
    }
}

/// A userfaultfd and guest mapping the hypervisor created itself (the
/// Firecracker handler model): it opened the userfaultfd, did `UFFDIO_API`
/// with the features the region needs, mapped the shared file (`MAP_SHARED`,
/// read-write) and registered that mapping, then hands both over. The
/// region serves faults on that mapping; [`super::GuestMemory::as_ptr`]
/// returns its address. The hypervisor and the region are in the same
/// process.
///
/// Features the handshake must have enabled: `PAGEFAULT_FLAG_WP`,
/// `THREAD_ID`, `MISSING_SHMEM`, `MINOR_SHMEM`, `WP_HUGETLBFS_SHMEM` (and
/// `POISON` for [`SigbusMethod::Poison`]; `WP_HUGETLBFS_SHMEM` only where
/// the kernel offers it, Linux >= 5.19: without it writes are not tracked,
/// see [`GuestMemory::tracks_writes`]). The region checks them (from
/// `/proc/self/fdinfo`), checks that the address maps the file at the
/// offset, and registers the mapping for MISSING, MINOR and WP faults (WP
/// where it can).
///
/// [`GuestMemory::tracks_writes`]: super::GuestMemory::tracks_writes
#[derive(Debug, Clone)]
pub struct HandedOverUffd {
    pub(crate) uffd: Arc<OwnedFd>,
    pub(crate) mapping: usize,
}

impl HandedOverUffd {
    /// `uffd` and the address of the hypervisor's mapping of the file's
    /// range.
    ///
    /// # Safety
    /// `mapping` must stay mapped, as that mapping of the file, while the
    /// [`super::GuestMemory`] built on it lives, and no one but the region
    /// may resolve faults of `uffd` or change its registrations meanwhile.
    /// (Which file and offset it maps is checked at creation; that it stays
    /// so cannot be.)
    pub unsafe fn new(uffd: Arc<OwnedFd>, mapping: *mut u8) -> Self {
        Self {
            uffd,
            mapping: mapping as usize,
        }
    }
}

/// How a region finds the pages written since their last write-back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DirtyTracking {
    /// [`DirtyTracking::PagemapScan`] where it works (a shared-memory file
    /// of 4 KiB pages, the region's own userfaultfd, Linux >= 6.7), else
    /// [`DirtyTracking::WriteFaults`].
    #[default]
    Auto,
    /// Synchronous userfaultfd write protection: the first write to a clean
    /// page faults once to a handler, which marks it dirty.
    WriteFaults,
    /// Asynchronous write protection (`UFFD_FEATURE_WP_ASYNC`): the kernel
    /// lets the first write through without a fault, and flush and evict
    /// find written pages with `PAGEMAP_SCAN` and `/proc/self/pagemap`.
    /// Shared-memory files of 4 KiB pages only; refused with
    /// `Unsupported` elsewhere.
    PagemapScan,
}

/// Settings of a [`super::GuestMemory`].
#[derive(Clone)]
pub struct GuestMemoryConfig {
    /// First guest-physical address of the region (page aligned).
    pub gpa_base: u64,
    /// Size of the region in bytes (a positive multiple of 4096).
    pub size_bytes: usize,
    /// Fault handler threads.
    pub handler_threads: usize,
    /// CPUs to pin handlers to (handler i on `cpus[i % len]`). `None`: the
    /// first CPUs of the host, away from the transport's pollers on the last
    /// ones. `Some(vec![])` (the default: placement is the VMM's choice): no
    /// pinning.
    pub handler_cpus: Option<Vec<usize>>,
    /// Scheduler slice in µs the handler threads ask for (Linux 6.12+,
    /// `sched_attr.sched_runtime`; 0, the default: the kernel's). Meant for
    /// a handler that shares its CPU with the vCPU threads it serves: asked
    /// longer than theirs (the kernel's default is 0.75 ms times 1 +
    /// log2 of the CPUs, at most 3 ms), a vCPU woken by its page preempts
    /// the handler at once instead of waiting for it to block again (0.4-1
    /// µs per fault on the bench host, docs/benchmarking.md). The price: a handler
    /// woken while a busy thread holds its CPU waits longer for it. Older
    /// kernels ignore it (logged), as do real-time handler threads.
    pub handler_slice_us: u64,
    /// How long a fault may wait for its page, retries included, before it
    /// is reported as failed.
    pub fault_timeout_ms: u64,
    /// Wait between two attempts to fetch a page whose owner is down.
    pub retry_interval_ms: u64,
    /// Largest read-ahead window in pages for sequential faults; 0 turns
    /// prefetch off.
    pub prefetch_max_pages: usize,
    /// How a failed fault becomes SIGBUS.
    pub sigbus_method: SigbusMethod,
    /// Which faults are served. [`FaultMode::KernelAndUser`] (the default,
    /// what KVM needs) also serves faults taken in kernel mode (KVM,
    /// `read(2)` into guest memory); when the kernel refuses them to this
    /// process, [`super::GuestMemory::new`] fails with
    /// [`super::GuestMemoryError::KernelFaultsRefused`] (never a silent
    /// fallback). [`FaultMode::UserOnly`] needs no privilege; a kernel-mode
    /// access to a page not yet fetched then fails with `EFAULT`.
    pub fault_mode: FaultMode,
    /// Called for every fault that cannot be served; `None`: SIGBUS.
    pub on_fault_error: Option<FaultErrorHandler>,
    /// What guest RAM is made of: anonymous memory (the default) or a
    /// shared-memory file the hypervisor provides.
    pub backing: GuestBacking,
    /// How dirty pages are found (see [`DirtyTracking`]).
    pub dirty_tracking: DirtyTracking,
    /// With a shared-memory backing and a manager that uses RDMA: register
    /// the region's second mapping of the file (the alias) with the device
    /// once (the default, `true`), so a fault's RDMA READ lands straight in
    /// guest memory and write-backs go out of it, with no pool frame and no
    /// copy. Registration pins, and so allocates, every page of the region
    /// while it lives (no on-demand paging), and evict then only unmaps
    /// pages from the guest (the file keeps them: a hole would leave the
    /// device on pages the file no longer holds). `false`: pages bounce
    /// through the manager's pool and evict frees the file's pages.
    /// Ignored for anonymous memory and without RDMA.
    pub rdma_register_alias: bool,
}

impl GuestMemoryConfig {
    /// A config for `size_bytes` of guest memory from `gpa_base`, with the
    /// defaults below.
    pub fn new(gpa_base: u64, size_bytes: usize) -> Self {
        Self {
            gpa_base,
            size_bytes,
            ..Self::default()
        }
    }
}

impl Default for GuestMemoryConfig {
    fn default() -> Self {
        Self {
            gpa_base: 0,
            size_bytes: 0,
            handler_threads: 1,
            handler_cpus: Some(vec![]),
            handler_slice_us: 0,
            fault_timeout_ms: 1000,
            retry_interval_ms: 50,
            prefetch_max_pages: 32,
            sigbus_method: SigbusMethod::Auto,
            fault_mode: FaultMode::KernelAndUser,
            on_fault_error: None,
            backing: GuestBacking::Anonymous,
            dirty_tracking: DirtyTracking::Auto,
            rdma_register_alias: true,
        }
    }
}

impl fmt::Debug for GuestMemoryConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestMemoryConfig")
            .field("gpa_base", &self.gpa_base)
            .field("size_bytes", &self.size_bytes)
            .field("handler_threads", &self.handler_threads)
            .field("handler_cpus", &self.handler_cpus)
            .field("handler_slice_us", &self.handler_slice_us)
            .field("fault_timeout_ms", &self.fault_timeout_ms)
            .field("retry_interval_ms", &self.retry_interval_ms)
            .field("prefetch_max_pages", &self.prefetch_max_pages)
            .field("sigbus_method", &self.sigbus_method)
            .field("fault_mode", &self.fault_mode)
            .field("dirty_tracking", &self.dirty_tracking)
            .field("rdma_register_alias", &self.rdma_register_alias)
            .field("on_fault_error", &self.on_fault_error.is_some())
            .field("backing", &self.backing)
            .finish()
    }
}
