//! `RtGuestMemory`: guest RAM backed by remote pages through userfaultfd.

use std::ffi::{c_char, c_void, CString};
use std::mem::{offset_of, size_of};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use rdma_transport::guest_memory::{
    DirtyTracking, FaultAction, FaultMode, FaultReport, GuestBacking, GuestMemory,
    GuestMemoryConfig, GuestMemoryError, GuestMemoryStats, HandedOverUffd, SharedFile,
    SigbusMethod,
};

use crate::abi::{flag, read_config, struct_size, write_out, CConfig, COut};
use crate::manager::RtManager;
use crate::status::{
    chain, counted, fail, guard, guest_status, transport_status, with_handle, RtStatus,
};

/// An opaque handle to a guest memory region.
#[derive(Debug)]
pub struct RtGuestMemory {
    inner: GuestMemory,
}

/// What to do with a fault that cannot be served (callback return value).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtFaultAction {
    /// SIGBUS in the faulting thread (the default).
    Sigbus = 0,
    /// Keep the thread waiting and try again for another fault timeout.
    Retry = 1,
}

/// How a failed fault becomes SIGBUS (see docs/embedding.md).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtSigbusMethod {
    /// Poison where the kernel offers UFFDIO_POISON (Linux >= 6.6), else tgkill.
    Auto = 0,
    /// Poison the page: every access raises SIGBUS (BUS_MCEERR_AR) until
    /// `rt_guest_memory_evict` clears it.
    Poison = 1,
    /// tgkill(SIGBUS) the faulting thread, then wake it.
    Tgkill = 2,
}

/// How the region finds dirty pages (see docs/embedding.md, "Dirty
/// tracking").
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtDirtyTracking {
    /// `PAGEMAP_SCAN` where it works (a memfd or tmpfs file of 4 KiB pages,
    /// the region's own userfaultfd, Linux >= 6.7), else write faults.
    Auto = 0,
    /// Synchronous write protection: the first write to a clean page
    /// faults once to a handler.
    WriteFaults = 1,
    /// Asynchronous write protection and `PAGEMAP_SCAN`: no fault per
    /// first write; a flush may send a page being written torn (it is sent
    /// again by the next flush or evict). Refused (`RT_STATUS_UNSUPPORTED`)
    /// where it cannot work.
    PagemapScan = 2,
}

/// Which faults of the region are served (see docs/embedding.md).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtFaultMode {
    /// The default, what KVM needs: faults taken in user mode and in kernel
    /// mode (KVM, syscalls). Needs CAP_SYS_PTRACE, sysctl
    /// vm.unprivileged_userfaultfd=1 or access to /dev/userfaultfd; when
    /// refused, `rt_guest_memory_create` fails with `RT_STATUS_PERMISSION`.
    KernelAndUser = 0,
    /// User-mode faults only: no privilege needed; a kernel-mode access to
    /// a page not yet fetched fails with EFAULT.
    UserOnly = 1,
}

/// A fault that could not be served, as passed to the callback.
#[repr(C)]
#[derive(Debug)]
pub struct RtFaultReport {
    /// Guest-physical address of the page.
    pub gpa: u64,
    /// Host address of the page.
    pub host_addr: u64,
    /// Kernel thread id of the faulting thread.
    pub thread_id: i32,
    /// True for a write access.
    pub write: bool,
    /// Fetch attempts made.
    pub attempts: u32,
    /// Milliseconds since the fault was first seen.
    pub waited_ms: u64,
    /// Why the page could not be fetched.
    pub status: RtStatus,
    /// The error message (valid during the callback only).
    pub message: *const c_char,
}

/// The fault-error callback: runs on a handler thread, must not touch guest
/// memory, returns an `RtFaultAction` value (anything else means SIGBUS).
pub type RtFaultErrorFn =
    Option<unsafe extern "C" fn(user: *mut c_void, report: *const RtFaultReport) -> u32>;

/// Settings of `rt_guest_memory_create`; fill with
/// `rt_guest_memory_config_default` first. Flags are 0 or 1; other values
/// are refused with `RT_STATUS_INVALID_ARGUMENT`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RtGuestMemoryConfig {
    /// `sizeof(RtGuestMemoryConfig)`, set by
    /// `rt_guest_memory_config_default`: lets the struct grow (see
    /// docs/embedding.md). The first layout's 72 bytes (up to
    /// `on_fault_error_user`) are still accepted, with anonymous memory;
    /// other sizes are refused with `RT_STATUS_STRUCT_SIZE`.
    pub struct_size: u32,
    /// Fault handler threads.
    pub handler_threads: u32,
    /// First guest-physical address (4096-aligned).
    pub gpa_base: u64,
    /// Size in bytes (a positive multiple of 4096).
    pub size_bytes: u64,
    /// How long a fault may wait for its page, retries included.
    pub fault_timeout_ms: u64,
    /// Wait between two fetch attempts while the owner is down.
    pub retry_interval_ms: u64,
    /// Largest read-ahead window in pages (0: no prefetch; at most 64).
    pub prefetch_max_pages: u32,
    /// An `RtSigbusMethod` value.
    pub sigbus_method: u32,
    /// An `RtFaultMode` value (0, the default: kernel- and user-mode faults).
    pub fault_mode: u32,
    /// 1: pin handlers to the first CPUs of the host; 0 (the default): no
    /// pinning.
    pub pin_handlers: u32,
    /// Called for every fault that cannot be served; NULL: SIGBUS.
    pub on_fault_error: RtFaultErrorFn,
    /// Passed to `on_fault_error`; must stay valid while the region lives.
    pub on_fault_error_user: *mut c_void,
    /// Guest RAM in a shared-memory file the caller owns: a memfd, tmpfs
    /// or hugetlbfs file (`MFD_HUGETLB` memfd), open read-write and at
    /// least `shared_offset_bytes + size_bytes` long. -1 (the default):
    /// anonymous memory the region maps itself. The library keeps its own
    /// duplicate (`F_DUPFD_CLOEXEC`) while the region lives: the caller
    /// keeps its descriptor and may close it after the call.
    pub shared_fd: i32,
    /// A userfaultfd the caller opened itself (`userfaultfd(2)` and
    /// `UFFDIO_API` with `UFFD_FEATURE_PAGEFAULT_FLAG_WP`, `_THREAD_ID`,
    /// `_MISSING_SHMEM`, `_MINOR_SHMEM`, `_WP_HUGETLBFS_SHMEM` where the
    /// kernel offers it (Linux >= 5.19; see `rt_guest_memory_tracks_writes`),
    /// and `_POISON` for `RT_SIGBUS_METHOD_POISON`), handed over with
    /// `handed_over_mapping`; needs `shared_fd`. -1 (the default): the
    /// region opens its own. The library duplicates it like `shared_fd`
    /// (the duplicate shares the open file: the library makes it
    /// non-blocking, and the caller must not read it while the region
    /// lives). Set `fault_mode` to the mode it was opened with.
    pub handed_over_uffd: i32,
    /// Where the region starts in the file of `shared_fd` (a multiple of
    /// 4096, or of the huge page size on hugetlbfs); 0 without `shared_fd`.
    pub shared_offset_bytes: u64,
    /// The caller's own mapping of the file's range (`MAP_SHARED`,
    /// read-write, `size_bytes` of `shared_fd` from `shared_offset_bytes`):
    /// required with `handed_over_uffd`, NULL without. It becomes the
    /// region's guest memory (`rt_guest_memory_host_addr` returns it) and
    /// must stay mapped while the region lives.
    pub handed_over_mapping: *mut c_void,
    /// An `RtDirtyTracking` value (0, the default: `PAGEMAP_SCAN` where it
    /// works).
    pub dirty_tracking: u32,
    /// 1: over RDMA, pages of a `shared_fd` region bounce through the
    /// manager's pool (its second mapping of the file is not registered
    /// with the device, and evict frees the file's pages). 0 (the default):
    /// it is registered once, so faults and write-backs move pages by RDMA
    /// straight into and out of guest memory; that pins (and allocates)
    /// every page of the region while it lives. No effect without RDMA or
    /// `shared_fd` (`GuestMemoryConfig::rdma_register_alias`).
    pub rdma_bounce: u32,
    /// Scheduler slice in µs the handler threads ask for, Linux 6.12+
    /// (0, the default: the kernel's; it clamps others to 100 µs..100 ms).
    /// Longer than the vCPU threads' slice, a vCPU sharing a CPU with its
    /// handler and woken by its page runs at once instead of after the
    /// handler's pass (`GuestMemoryConfig::handler_slice_us`).
    pub handler_slice_us: u64,
}

/// `struct_size` of the first layout (up to `on_fault_error_user`), still
/// accepted: the shared-file fields take their defaults (anonymous memory).
const FIRST_LAYOUT_BYTES: usize = 72;
/// `struct_size` of the second layout (up to `handed_over_mapping`), still
/// accepted: `dirty_tracking` is then Auto.
const SECOND_LAYOUT_BYTES: usize = FIRST_LAYOUT_BYTES + 16 + size_of::<usize>();
/// `struct_size` of the third layout (up to `rdma_bounce`), still accepted:
/// `handler_slice_us` is then 0.
const THIRD_LAYOUT_BYTES: usize = SECOND_LAYOUT_BYTES + 8;
const _: () = assert!(offset_of!(RtGuestMemoryConfig, shared_fd) == FIRST_LAYOUT_BYTES);
// No padding in the grown tail: each field starts where the last one ends.
const _: () = assert!(
    offset_of!(RtGuestMemoryConfig, handed_over_uffd) == FIRST_LAYOUT_BYTES + 4
        && offset_of!(RtGuestMemoryConfig, shared_offset_bytes) == FIRST_LAYOUT_BYTES + 8
        && offset_of!(RtGuestMemoryConfig, handed_over_mapping) == FIRST_LAYOUT_BYTES + 16
        && offset_of!(RtGuestMemoryConfig, dirty_tracking) == SECOND_LAYOUT_BYTES
        && offset_of!(RtGuestMemoryConfig, rdma_bounce) == SECOND_LAYOUT_BYTES + 4
        && offset_of!(RtGuestMemoryConfig, handler_slice_us) == THIRD_LAYOUT_BYTES
        && size_of::<RtGuestMemoryConfig>() == THIRD_LAYOUT_BYTES + 8
);

impl CConfig for RtGuestMemoryConfig {
    const NAME: &'static str = "RtGuestMemoryConfig";
    const OLD_SIZES: &'static [usize] =
        &[FIRST_LAYOUT_BYTES, SECOND_LAYOUT_BYTES, THIRD_LAYOUT_BYTES];

    fn defaults() -> Self {
        let d = GuestMemoryConfig::default();
        Self {
            struct_size: struct_size::<Self>(),
            gpa_base: 0,
            size_bytes: 0,
            handler_threads: d.handler_threads as u32,
            pin_handlers: 0,
            fault_timeout_ms: d.fault_timeout_ms,
            retry_interval_ms: d.retry_interval_ms,
            prefetch_max_pages: d.prefetch_max_pages as u32,
            sigbus_method: RtSigbusMethod::Auto as u32,
            fault_mode: match d.fault_mode {
                FaultMode::KernelAndUser => RtFaultMode::KernelAndUser as u32,
                FaultMode::UserOnly => RtFaultMode::UserOnly as u32,
            },
            on_fault_error: None,
            on_fault_error_user: std::ptr::null_mut(),
            shared_fd: -1,
            handed_over_uffd: -1,
            shared_offset_bytes: 0,
            handed_over_mapping: std::ptr::null_mut(),
            dirty_tracking: RtDirtyTracking::Auto as u32,
            rdma_bounce: u32::from(!d.rdma_register_alias),
            handler_slice_us: d.handler_slice_us,
        }
    }
}

/// Counters of a region (`rt_guest_memory_stats`). Set `struct_size` to
/// `sizeof(RtGuestMemoryStats)` before the call; the library fills the rest.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RtGuestMemoryStats {
    /// `sizeof(RtGuestMemoryStats)`, set by the caller (see
    /// docs/embedding.md).
    pub struct_size: u32,
    /// MISSING faults resolved by fetching the page (counted just before
    /// the install that wakes the faulting thread).
    pub missing_faults: u64,
    /// First writes to clean pages.
    pub wp_faults: u64,
    /// Faults parked until another thread finished with the page.
    pub deferred_faults: u64,
    /// Pages installed by read-ahead.
    pub prefetched_pages: u64,
    /// Read-ahead batches fetched.
    pub prefetch_batches: u64,
    /// Faults that could not be served within their deadline.
    pub fault_errors: u64,
    /// Faults turned into SIGBUS.
    pub sigbus_raised: u64,
    /// Pages written back.
    pub pages_written_back: u64,
    /// Pages dropped by evict.
    pub pages_evicted: u64,
    /// Pages fetched from their owners by faults (a shared region fetches
    /// a page once however many threads fault on it).
    pub pages_fetched: u64,
    /// Pages written back straight out of guest memory (runs of at least
    /// 16 consecutive dirty pages of a shared region).
    pub pages_written_in_place: u64,
    /// Faults whose page a handler read on the spot on the one-page TCP
    /// path (it had no other fault), not through its completion queue.
    pub faults_fetched_inline: u64,
    /// Of the faults a handler began to read on the spot, those whose
    /// answer took longer than 200 µs or failed, sent to the completion
    /// queue instead.
    pub inline_fetches_given_up: u64,
}

impl COut for RtGuestMemoryStats {
    const NAME: &'static str = "RtGuestMemoryStats";
}

/// Fills `config` with the defaults (GPA base 0, size 0: set both).
///
/// # Safety
/// `config` must be NULL or point to a writable `RtGuestMemoryConfig`.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_config_default(config: *mut RtGuestMemoryConfig) {
    // SAFETY: the caller passes NULL or a writable config.
    if let Some(out) = unsafe { config.as_mut() } {
        *out = RtGuestMemoryConfig::defaults();
    }
}

/// The embedder's callback and its user pointer, callable from handler threads.
struct Callback {
    f: unsafe extern "C" fn(*mut c_void, *const RtFaultReport) -> u32,
    user: *mut c_void,
}

// SAFETY: the C contract of `on_fault_error` is that it may be called from
// any handler thread with `user`; the pointer is never dereferenced here.
unsafe impl Send for Callback {}
// SAFETY: as above.
unsafe impl Sync for Callback {}

impl Callback {
    fn call(&self, report: &FaultReport) -> FaultAction {
        let message = CString::new(chain(&report.error).replace('\0', " ")).unwrap_or_default();
        let c_report = RtFaultReport {
            gpa: report.gpa,
            host_addr: report.host_addr as u64,
            thread_id: report.thread_id,
            write: report.write,
            attempts: report.attempts,
            waited_ms: report.waited_ms,
            status: transport_status(&report.error),
            message: message.as_ptr(),
        };
        // SAFETY: `f` is the embedder's function, called as its contract
        // says; `c_report` and `message` outlive the call.
        let action = unsafe { (self.f)(self.user, &c_report) };
        if action == RtFaultAction::Retry as u32 {
            FaultAction::Retry
        } else {
            FaultAction::Sigbus
        }
    }
}

/// Maps guest RAM `[gpa_base, gpa_base + size_bytes)` backed by the pages
/// `manager` reaches, and starts its fault handler threads. `*out` receives
/// the region; its memory is at `rt_guest_memory_host_addr`.
///
/// With `shared_fd` set, guest RAM is that shared-memory file (mapped by
/// the region, or the caller's `handed_over_mapping` served through its
/// `handed_over_uffd`); the library keeps duplicates of both descriptors
/// while the region lives, the caller keeps its own. A file that is not
/// shared memory, not open read-write or too small is refused with
/// `RT_STATUS_INVALID_ARGUMENT`, a kernel without the userfaultfd features
/// the file needs with `RT_STATUS_UNSUPPORTED`; `rt_last_error` says why.
///
/// The config is checked first (`struct_size`, flags, enum values, the
/// shared-file fields), then the other arguments.
///
/// # Safety
/// `manager` must be NULL or a live handle, `config` NULL or an
/// `RtGuestMemoryConfig` (at least `struct_size` readable bytes), `out`
/// NULL or writable. With `handed_over_uffd` set, `handed_over_mapping`
/// must stay mapped, as that mapping of the file, until
/// `rt_guest_memory_destroy`, and nothing else may resolve faults of the
/// userfaultfd or change its registrations meanwhile.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_create(
    manager: *const RtManager,
    config: *const RtGuestMemoryConfig,
    out: *mut *mut RtGuestMemory,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a config of `struct_size` bytes.
        let c = match unsafe { read_config(config) } {
            Ok(c) => c,
            Err(status) => return status,
        };
        // SAFETY: `handed_over_mapping` meets this function's contract.
        let config = match unsafe { rust_config(&c) } {
            Ok(config) => config,
            Err(status) => return status,
        };
        // SAFETY: the caller passes NULL or a live handle.
        let Some(manager) = (unsafe { manager.as_ref() }) else {
            return fail(RtStatus::InvalidArgument, "manager is NULL");
        };
        if out.is_null() {
            return fail(RtStatus::InvalidArgument, "out is NULL");
        }
        match GuestMemory::new(Arc::clone(&manager.inner), config) {
            Ok(inner) => {
                let handle = Box::into_raw(Box::new(RtGuestMemory { inner }));
                // SAFETY: `out` is non-null and writable (caller's contract).
                unsafe { out.write(handle) };
                RtStatus::Ok
            }
            Err(e) => guest_fail(&e),
        }
    })
}

/// The Rust config of a C one, every value checked.
///
/// # Safety
/// With `handed_over_uffd` set, `handed_over_mapping` must meet the
/// contract of `rt_guest_memory_create`.
pub(crate) unsafe fn rust_config(c: &RtGuestMemoryConfig) -> Result<GuestMemoryConfig, RtStatus> {
    const NAME: &str = RtGuestMemoryConfig::NAME;
    let pin_handlers = flag(c.pin_handlers, NAME, "pin_handlers")?;
    let rdma_bounce = flag(c.rdma_bounce, NAME, "rdma_bounce")?;
    let Ok(size_bytes) = usize::try_from(c.size_bytes) else {
        return Err(fail(RtStatus::InvalidArgument, "size_bytes too large"));
    };
    let sigbus_method = match c.sigbus_method {
        0 => SigbusMethod::Auto,
        1 => SigbusMethod::Poison,
        2 => SigbusMethod::Tgkill,
        other => {
            return Err(fail(
                RtStatus::InvalidArgument,
                format!("{NAME}.sigbus_method {other} is not an RtSigbusMethod"),
            ))
        }
    };
    let fault_mode = match c.fault_mode {
        0 => FaultMode::KernelAndUser,
        1 => FaultMode::UserOnly,
        other => {
            return Err(fail(
                RtStatus::InvalidArgument,
                format!("{NAME}.fault_mode {other} is not an RtFaultMode"),
            ))
        }
    };
    let dirty_tracking = match c.dirty_tracking {
        0 => DirtyTracking::Auto,
        1 => DirtyTracking::WriteFaults,
        2 => DirtyTracking::PagemapScan,
        other => {
            return Err(fail(
                RtStatus::InvalidArgument,
                format!("{NAME}.dirty_tracking {other} is not an RtDirtyTracking"),
            ))
        }
    };
    let on_fault_error = c.on_fault_error.map(|f| {
        let cb = Callback {
            f,
            user: c.on_fault_error_user,
        };
        Arc::new(move |r: &FaultReport| cb.call(r))
            as rdma_transport::guest_memory::FaultErrorHandler
    });
    // SAFETY: this function's contract.
    let backing = unsafe { backing(c) }?;
    Ok(GuestMemoryConfig {
        gpa_base: c.gpa_base,
        size_bytes,
        handler_threads: c.handler_threads as usize,
        handler_cpus: if pin_handlers { None } else { Some(vec![]) },
        handler_slice_us: c.handler_slice_us,
        fault_timeout_ms: c.fault_timeout_ms,
        retry_interval_ms: c.retry_interval_ms,
        prefetch_max_pages: c.prefetch_max_pages as usize,
        sigbus_method,
        fault_mode,
        on_fault_error,
        backing,
        dirty_tracking,
        rdma_register_alias: !rdma_bounce,
    })
}

/// The backing of a C config: anonymous memory, or the caller's shared
/// file (with its userfaultfd and mapping), whose descriptors are
/// duplicated here.
///
/// # Safety
/// As `rust_config`.
unsafe fn backing(c: &RtGuestMemoryConfig) -> Result<GuestBacking, RtStatus> {
    const NAME: &str = RtGuestMemoryConfig::NAME;
    for (field, fd) in [
        ("shared_fd", c.shared_fd),
        ("handed_over_uffd", c.handed_over_uffd),
    ] {
        if fd < -1 {
            return Err(fail(
                RtStatus::InvalidArgument,
                format!("{NAME}.{field} is {fd}; it must be a descriptor or -1 (none)"),
            ));
        }
    }
    let has_mapping = !c.handed_over_mapping.is_null();
    let refuse = |why: String| Err(fail(RtStatus::InvalidArgument, format!("{NAME}.{why}")));
    match (c.shared_fd, c.handed_over_uffd, has_mapping) {
        (-1, -1, false) if c.shared_offset_bytes == 0 => return Ok(GuestBacking::Anonymous),
        (-1, -1, false) => {
            return refuse(format!(
                "shared_offset_bytes is {:#x} but shared_fd is -1 (anonymous memory)",
                c.shared_offset_bytes
            ))
        }
        (_, -1, true) => {
            return refuse(
                "handed_over_mapping is given but handed_over_uffd is -1: hand over both or \
                 neither"
                    .into(),
            )
        }
        (-1, uffd, _) if uffd >= 0 => {
            return refuse(format!(
                "handed_over_uffd is {uffd} but shared_fd is -1: a handed-over userfaultfd \
                 needs the shared file it serves"
            ))
        }
        (_, uffd, false) if uffd >= 0 => {
            return refuse(format!(
                "handed_over_mapping is NULL but handed_over_uffd is {uffd}: pass the mapping \
                 the userfaultfd serves"
            ))
        }
        _ => {}
    }
    let fd = Arc::new(dup_fd(c.shared_fd, "shared_fd")?);
    let file = SharedFile::new(fd, c.shared_offset_bytes);
    if c.handed_over_uffd == -1 {
        return Ok(GuestBacking::SharedFile(file));
    }
    let uffd = Arc::new(dup_fd(c.handed_over_uffd, "handed_over_uffd")?);
    // SAFETY: the caller of `rt_guest_memory_create` promises that the
    // mapping stays mapped, as that mapping of the file, while the region
    // lives, and that nothing else resolves the userfaultfd's faults or
    // changes its registrations meanwhile (its # Safety section).
    let handed = unsafe { HandedOverUffd::new(uffd, c.handed_over_mapping.cast()) };
    Ok(GuestBacking::SharedFile(file.with_uffd(handed)))
}

/// The library's own duplicate of the caller's descriptor `fd` (field
/// `field`), close-on-exec; the caller's stays the caller's.
fn dup_fd(fd: i32, field: &str) -> Result<OwnedFd, RtStatus> {
    // SAFETY: F_DUPFD_CLOEXEC reads no memory; an fd that is not open
    // fails with EBADF.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        let err = std::io::Error::last_os_error();
        let status = if err.raw_os_error() == Some(libc::EBADF) {
            RtStatus::InvalidArgument
        } else {
            RtStatus::System
        };
        return Err(fail(
            status,
            format!(
                "{}.{field} {fd} cannot be duplicated: {err}",
                RtGuestMemoryConfig::NAME
            ),
        ));
    }
    // SAFETY: `dup` is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

pub(crate) fn guest_fail(e: &GuestMemoryError) -> RtStatus {
    fail(guest_status(e), chain(e))
}

/// Stops the region's threads and unmaps it; unflushed dirty pages are
/// discarded. Stop every thread that touches the region first.
///
/// # Safety
/// `memory` must be NULL or a live handle, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_destroy(memory: *mut RtGuestMemory) {
    if !memory.is_null() {
        // SAFETY: a live handle from Box::into_raw, destroyed once.
        drop(unsafe { Box::from_raw(memory) });
    }
}

fn with_memory(memory: *const RtGuestMemory, f: impl FnOnce(&GuestMemory) -> RtStatus) -> RtStatus {
    with_handle(memory, "memory", |m| f(&m.inner))
}

/// Host address of the region's first byte (NULL for a NULL handle).
///
/// # Safety
/// `memory` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_host_addr(memory: *const RtGuestMemory) -> *mut u8 {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { memory.as_ref() }.map_or(std::ptr::null_mut(), |m| m.inner.as_ptr())
}

/// The `RtDirtyTracking` method the region uses (`Auto` resolved; 0 for a
/// NULL handle).
///
/// # Safety
/// `memory` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_dirty_tracking(memory: *const RtGuestMemory) -> u32 {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { memory.as_ref() }.map_or(0, |m| match m.inner.dirty_tracking() {
        DirtyTracking::PagemapScan => RtDirtyTracking::PagemapScan as u32,
        _ => RtDirtyTracking::WriteFaults as u32,
    })
}

/// 1 when the region's writes are tracked; 0 when the kernel cannot
/// write-protect its memory (a `shared_fd` region on Linux 5.13-5.18: every
/// mapped page counts as dirty, and `rt_guest_memory_flush` writes back
/// and unmaps every mapped page) or for a NULL handle.
///
/// # Safety
/// `memory` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_tracks_writes(memory: *const RtGuestMemory) -> u32 {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { memory.as_ref() }.map_or(0, |m| u32::from(m.inner.tracks_writes()))
}

/// 1 when the manager's RDMA reads and writes of the region's pages land in
/// and go out of guest memory directly (a `shared_fd` region whose second
/// mapping is registered with the device, see `rdma_bounce`); 0 when they
/// bounce through the pool, without RDMA, or for a NULL handle.
///
/// # Safety
/// `memory` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_rdma_zero_copy(memory: *const RtGuestMemory) -> u32 {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { memory.as_ref() }.map_or(0, |m| u32::from(m.inner.rdma_zero_copy()))
}

/// Size of the region in bytes (0 for a NULL handle).
///
/// # Safety
/// `memory` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_size(memory: *const RtGuestMemory) -> u64 {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { memory.as_ref() }.map_or(0, |m| m.inner.size_bytes() as u64)
}

/// Copies `len` bytes of guest memory at `gpa` into `buf` (faulting pages in).
///
/// # Safety
/// `memory` must be a live handle; `buf` must hold `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_read(
    memory: *const RtGuestMemory,
    gpa: u64,
    buf: *mut u8,
    len: usize,
) -> RtStatus {
    with_memory(memory, |m| {
        if buf.is_null() && len > 0 {
            return fail(RtStatus::InvalidArgument, "buf is NULL");
        }
        let slice = match len {
            0 => &mut [][..],
            // SAFETY: non-null and `len` writable bytes (caller's contract).
            _ => unsafe { std::slice::from_raw_parts_mut(buf, len) },
        };
        m.read(gpa, slice)
            .map_or_else(|e| guest_fail(&e), |()| RtStatus::Ok)
    })
}

/// Copies `len` bytes from `buf` into guest memory at `gpa` (the pages
/// become dirty).
///
/// # Safety
/// `memory` must be a live handle; `buf` must hold `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_write(
    memory: *const RtGuestMemory,
    gpa: u64,
    buf: *const u8,
    len: usize,
) -> RtStatus {
    with_memory(memory, |m| {
        if buf.is_null() && len > 0 {
            return fail(RtStatus::InvalidArgument, "buf is NULL");
        }
        let slice = match len {
            0 => &[][..],
            // SAFETY: non-null and `len` readable bytes (caller's contract).
            _ => unsafe { std::slice::from_raw_parts(buf, len) },
        };
        m.write(gpa, slice)
            .map_or_else(|e| guest_fail(&e), |()| RtStatus::Ok)
    })
}

/// Writes every dirty page back and waits for the acknowledgements;
/// `*pages_written` (may be NULL) receives how many were written.
///
/// # Safety
/// `memory` must be a live handle; `pages_written` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_flush(
    memory: *const RtGuestMemory,
    pages_written: *mut u64,
) -> RtStatus {
    with_memory(memory, |m| counted(m.flush(), pages_written, guest_status))
}

/// Writes back the dirty pages of `[gpa, gpa + len)`, then drops the range
/// (the next touch fetches again); `*pages_dropped` (may be NULL) receives
/// how many pages were dropped. No page is dropped before its write-back
/// is acknowledged.
///
/// # Safety
/// `memory` must be a live handle; `pages_dropped` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_evict(
    memory: *const RtGuestMemory,
    gpa: u64,
    len: u64,
    pages_dropped: *mut u64,
) -> RtStatus {
    with_memory(memory, |m| {
        counted(m.evict(gpa, len), pages_dropped, guest_status)
    })
}

/// Fills `*stats` (whose `struct_size` the caller set) with the region's
/// counters.
///
/// # Safety
/// `memory` must be NULL or a live handle; `stats` NULL or an
/// `RtGuestMemoryStats` with `struct_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn rt_guest_memory_stats(
    memory: *const RtGuestMemory,
    stats: *mut RtGuestMemoryStats,
) -> RtStatus {
    with_memory(memory, |m| {
        // Every field by name: a counter added to `GuestMemoryStats` does
        // not compile until it is here too.
        let GuestMemoryStats {
            missing_faults,
            wp_faults,
            deferred_faults,
            prefetched_pages,
            prefetch_batches,
            fault_errors,
            sigbus_raised,
            pages_written_back,
            pages_evicted,
            pages_fetched,
            pages_written_in_place,
            faults_fetched_inline,
            inline_fetches_given_up,
        } = m.stats();
        let value = RtGuestMemoryStats {
            struct_size: 0,
            missing_faults,
            wp_faults,
            deferred_faults,
            prefetched_pages,
            prefetch_batches,
            fault_errors,
            sigbus_raised,
            pages_written_back,
            pages_evicted,
            pages_fetched,
            pages_written_in_place,
            faults_fetched_inline,
            inline_fetches_given_up,
        };
        // SAFETY: the caller passes NULL or a struct of `struct_size` bytes.
        match unsafe { write_out(stats, &value) } {
            Ok(()) => RtStatus::Ok,
            Err(status) => status,
        }
    })
}
