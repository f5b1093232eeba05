//! The userfaultfd of one guest region, on [`crate::uffd::Userfaultfd`]:
//! which faults it gets ([`FaultMode`], never silently less than asked),
//! the features it needs, and the page-sized calls the handlers make.

use std::io;
use std::os::fd::OwnedFd;

use crate::page::PAGE_SIZE;
use crate::uffd::{feature, EventBuffer, FaultMode, RegisterMode, Userfaultfd};

use crate::sys::cvt;

use super::error::GuestMemoryError;
use super::file::FileMap;

/// Features a guest region cannot work without: write-protect faults (dirty
/// tracking) and thread ids (SIGBUS to the faulting thread).
const REQUIRED: u64 = feature::PAGEFAULT_FLAG_WP | feature::THREAD_ID;

/// Features a region in a shared-memory file needs on top of [`REQUIRED`]:
/// MISSING faults on holes, MINOR faults on pages in the page cache
/// (resolved with `UFFDIO_CONTINUE`; Linux >= 5.14). Write protection of
/// shmem ([`feature::WP_HUGETLBFS_SHMEM`], Linux >= 5.19) is enabled when
/// offered; without it the region's pages are mapped writable and always
/// count as dirty ([`RegionUffd::write_protects`]).
const REQUIRED_SHMEM: u64 = feature::MISSING_SHMEM | feature::MINOR_SHMEM;

/// The same for a hugetlbfs file (Linux >= 5.13).
const REQUIRED_HUGETLBFS: u64 = feature::MISSING_HUGETLBFS | feature::MINOR_HUGETLBFS;

/// What the guest mapping is made of, as far as userfaultfd cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory {
    /// Private anonymous memory.
    Anonymous,
    /// A tmpfs file or memfd.
    Shmem,
    /// A hugetlbfs file or `MFD_HUGETLB` memfd.
    Hugetlbfs,
}

impl Memory {
    /// Features needed on top of [`REQUIRED`].
    fn required(self) -> u64 {
        match self {
            Self::Anonymous => 0,
            Self::Shmem => REQUIRED_SHMEM,
            Self::Hugetlbfs => REQUIRED_HUGETLBFS,
        }
    }

    /// The names of the features of `required`, for error messages.
    fn feature_names(self) -> &'static str {
        match self {
            Self::Anonymous => "",
            Self::Shmem => ", MISSING_SHMEM, MINOR_SHMEM",
            Self::Hugetlbfs => ", MISSING_HUGETLBFS, MINOR_HUGETLBFS",
        }
    }
}

/// The features to enable, given what the kernel `offered`: the required
/// ones (and those of a shared-memory file), plus poison, and write
/// protection of a shared-memory file, when offered.
pub(crate) fn features_to_enable(offered: u64, memory: Memory) -> Result<u64, GuestMemoryError> {
    #[cfg(any(test, feature = "test-hooks"))]
    let offered = if super::test_hooks::shared_wp_hidden() {
        offered & !feature::WP_HUGETLBFS_SHMEM
    } else {
        offered
    };
    if offered & REQUIRED != REQUIRED {
        return Err(GuestMemoryError::Unsupported(format!(
            "the kernel's userfaultfd lacks write-protect or thread ids \
             (features {offered:#x}; need Linux >= 5.7)"
        )));
    }
    let mut needed = REQUIRED;
    let file = memory.required();
    if file != 0 {
        if offered & file != file {
            return Err(GuestMemoryError::Unsupported(format!(
                "the kernel's userfaultfd lacks minor faults on {memory:?} \
                 (features {offered:#x}; need Linux >= 5.14 for shmem, 5.13 for \
                 hugetlbfs); use GuestBacking::Anonymous"
            )));
        }
        needed |= file | (offered & feature::WP_HUGETLBFS_SHMEM);
    }
    Ok(needed | (offered & feature::POISON))
}

/// What it means that opening a userfaultfd for `wanted` failed with `err`:
/// a refusal of kernel-mode faults is its own error, which says how to get
/// them, and is never turned into a user-mode-only descriptor.
pub(crate) fn open_error(wanted: FaultMode, err: io::Error) -> GuestMemoryError {
    match (wanted, err.raw_os_error()) {
        (FaultMode::KernelAndUser, Some(libc::EPERM)) => {
            GuestMemoryError::KernelFaultsRefused { source: err }
        }
        _ => GuestMemoryError::Userfaultfd {
            op: "userfaultfd(2)",
            source: err,
        },
    }
}

/// What the running kernel's userfaultfd offers, asked on a throw-away
/// descriptor opened as `mode` asks (so no `UFFD_USER_MODE_ONLY` unless
/// user-mode faults only are wanted: kernels 5.7-5.10 lack that flag).
pub(crate) fn probe_features(mode: FaultMode) -> io::Result<u64> {
    Userfaultfd::open(mode)?.enable(0)
}

/// Whether `UFFDIO_CONTINUE` takes `UFFDIO_CONTINUE_MODE_WP` (Linux >= 6.4),
/// which a shared region needs to map clean pages write-protected: tried on
/// a throw-away one-page memfd and user-mode-only descriptor. An older
/// kernel answers `EINVAL`.
pub(crate) fn probe_continue_wp() -> Result<bool, GuestMemoryError> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let probe = uffd_err("probing UFFDIO_CONTINUE_MODE_WP");
    // SAFETY: the name is NUL-terminated; the result is checked.
    let fd = cvt(unsafe { libc::memfd_create(c"uffd-probe".as_ptr(), libc::MFD_CLOEXEC) })
        .map_err(&probe)?;
    // SAFETY: just created, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let page = [1u8; PAGE_SIZE];
    // SAFETY: writes our live buffer to our memfd (fills its page cache).
    let n = unsafe { libc::pwrite(fd.as_raw_fd(), page.as_ptr().cast(), PAGE_SIZE, 0) };
    cvt(n).map_err(&probe)?;
    let map = FileMap::new(&fd, 0, PAGE_SIZE, PAGE_SIZE)?;
    let uffd = Userfaultfd::open(FaultMode::UserOnly).map_err(&probe)?;
    match uffd.enable(feature::MINOR_SHMEM | feature::WP_HUGETLBFS_SHMEM) {
        Ok(_) => {}
        // No write protection of shmem at all (Linux < 5.19).
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => return Ok(false),
        Err(err) => return Err(probe(err)),
    }
    uffd.register(map.as_ptr(), PAGE_SIZE, RegisterMode::MISSING_MINOR_AND_WP)
        .map_err(&probe)?;
    // SAFETY: the probe's own registered page, in the page cache, which
    // nothing reads.
    match unsafe { uffd.continue_range(map.as_ptr(), PAGE_SIZE, true) } {
        Ok(()) => Ok(true),
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(err) => Err(probe(err)),
    }
}

/// Whether this kernel maps pages write-protected with `UFFDIO_CONTINUE`
/// (see [`probe_continue_wp`]); a test can make it say no.
fn continue_wp() -> Result<bool, GuestMemoryError> {
    #[cfg(any(test, feature = "test-hooks"))]
    if super::test_hooks::continue_wp_hidden() {
        return Ok(false);
    }
    probe_continue_wp()
}

/// `Unsupported` unless this kernel maps pages write-protected with
/// `UFFDIO_CONTINUE` (coherent guest memory cannot do without).
pub(crate) fn require_continue_wp() -> Result<(), GuestMemoryError> {
    if continue_wp()? {
        return Ok(());
    }
    Err(GuestMemoryError::Unsupported(
        "UFFDIO_CONTINUE cannot map pages write-protected (UFFDIO_CONTINUE_MODE_WP, \
         Linux >= 6.4), which coherent guest memory in a shared file needs; use \
         GuestBacking::Anonymous"
            .into(),
    ))
}

/// Outcome of one `UFFDIO_COPY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyOutcome {
    /// The page is in and the faulting threads are woken.
    Copied,
    /// The page was already present (another thread won the race).
    Exists,
    /// The mapping changed under us; try again.
    Again,
}

/// One guest region's userfaultfd.
#[derive(Debug)]
pub(crate) struct RegionUffd {
    uffd: Userfaultfd,
    pub(crate) features: u64,
    /// Bytes of one page of the region (4 KiB, or a huge page).
    unit_bytes: usize,
    /// A shared region whose kernel maps pages write-protected with
    /// `UFFDIO_CONTINUE` (Linux >= 6.4; see [`RegionUffd::continue_clean`]).
    continue_wp: bool,
    /// The region's pages can be write-protected: anonymous memory, or a
    /// shared file on Linux >= 5.19 (see [`RegionUffd::write_protects`]).
    write_protects: bool,
}

impl RegionUffd {
    /// Opens the descriptor for the faults of `mode`, enables WP and thread
    /// ids (and poison when offered), and registers `[start, start + len)`
    /// for MISSING and WP faults, and MINOR ones for a shared-memory file.
    /// `unit_bytes` is the region's page size; `wp_async`: asynchronous
    /// write protection (see [`feature::WP_ASYNC`]; the caller checked the
    /// kernel offers it).
    pub(crate) fn new(
        start: *mut u8,
        len: usize,
        mode: FaultMode,
        memory: Memory,
        unit_bytes: usize,
        wp_async: bool,
    ) -> Result<Self, GuestMemoryError> {
        let uffd = Userfaultfd::open(mode).map_err(|err| open_error(mode, err))?;
        let offered = probe_features(mode).map_err(|err| open_error(mode, err))?;
        let mut features = features_to_enable(offered, memory)?;
        if wp_async {
            features |= feature::WP_ASYNC;
        }
        let shared = memory != Memory::Anonymous;
        let write_protects = !shared || features & feature::WP_HUGETLBFS_SHMEM != 0;
        let continue_wp = shared && write_protects && continue_wp()?;
        uffd.enable(features).map_err(uffd_err("UFFDIO_API"))?;
        let register = match (shared, write_protects) {
            (false, _) => RegisterMode::MISSING_AND_WP,
            (true, true) => RegisterMode::MISSING_MINOR_AND_WP,
            (true, false) => RegisterMode::MISSING_AND_MINOR,
        };
        uffd.register(start, len, register)
            .map_err(uffd_err("UFFDIO_REGISTER"))?;
        if !write_protects {
            tracing::info!(
                "this kernel cannot write-protect shared memory (Linux < 5.19): every page of \
                 the region counts as dirty, and flush unmaps the pages it writes back"
            );
        }
        Ok(Self {
            uffd,
            features,
            unit_bytes,
            continue_wp,
            write_protects,
        })
    }

    /// Takes over the hypervisor's userfaultfd (a duplicate of `fd`) for its
    /// shared-memory mapping `[start, start + len)`: checks the features its
    /// handshake enabled and registers the range for MISSING, MINOR and WP
    /// faults (it may have registered it already, with fewer modes).
    pub(crate) fn handed_over(
        fd: &OwnedFd,
        start: *mut u8,
        len: usize,
        mode: FaultMode,
        memory: Memory,
        unit_bytes: usize,
    ) -> Result<Self, GuestMemoryError> {
        let dup = fd.try_clone().map_err(uffd_err("dup(userfaultfd)"))?;
        let uffd = Userfaultfd::from_handed_over(dup, mode).map_err(|source| {
            GuestMemoryError::Config(format!(
                "the handed-over descriptor is not a usable userfaultfd: {source}"
            ))
        })?;
        let enabled = uffd
            .enabled_features()
            .map_err(uffd_err("reading /proc/self/fdinfo"))?
            .ok_or_else(|| {
                GuestMemoryError::Config(
                    "the handed-over userfaultfd has not done its UFFDIO_API handshake".into(),
                )
            })?;
        #[cfg(any(test, feature = "test-hooks"))]
        let enabled = if super::test_hooks::shared_wp_hidden() {
            enabled & !feature::WP_HUGETLBFS_SHMEM
        } else {
            enabled
        };
        let needed = REQUIRED | memory.required();
        if enabled & needed != needed {
            return Err(GuestMemoryError::Unsupported(format!(
                "the handed-over userfaultfd's UFFDIO_API enabled features {enabled:#x}; \
                 it needs {needed:#x} (PAGEFAULT_FLAG_WP, THREAD_ID{}), missing {:#x}",
                memory.feature_names(),
                needed & !enabled
            )));
        }
        let write_protects = enabled & feature::WP_HUGETLBFS_SHMEM != 0;
        if !write_protects {
            // Untracked writes only where the kernel leaves no choice.
            let offered = probe_features(mode).map_err(|err| open_error(mode, err))?;
            if features_to_enable(offered, memory)? & feature::WP_HUGETLBFS_SHMEM != 0 {
                return Err(GuestMemoryError::Unsupported(format!(
                    "the handed-over userfaultfd's UFFDIO_API did not enable \
                     WP_HUGETLBFS_SHMEM ({:#x}), which this kernel offers: without it no \
                     write to guest memory could be tracked",
                    feature::WP_HUGETLBFS_SHMEM
                )));
            }
        }
        let continue_wp = write_protects && continue_wp()?;
        let register = if write_protects {
            RegisterMode::MISSING_MINOR_AND_WP
        } else {
            RegisterMode::MISSING_AND_MINOR
        };
        uffd.register(start, len, register)
            .map_err(uffd_err("UFFDIO_REGISTER"))?;
        Ok(Self {
            uffd,
            features: enabled,
            unit_bytes,
            continue_wp,
            write_protects,
        })
    }

    /// The userfaultfd of `region` as `config` asks: the hypervisor's own
    /// (a handed-over one, for a shared file) or a new one; `wp_async` as
    /// for [`RegionUffd::new`].
    pub(crate) fn for_region(
        region: &super::region::GuestRegion,
        config: &super::config::GuestMemoryConfig,
        wp_async: bool,
    ) -> Result<Self, GuestMemoryError> {
        use super::config::{GuestBacking, SharedFile};
        match &config.backing {
            GuestBacking::SharedFile(SharedFile {
                handed_over: Some(handed_over),
                ..
            }) => Self::handed_over(
                &handed_over.uffd,
                region.base(),
                region.len_bytes(),
                config.fault_mode,
                region.memory(),
                region.unit_bytes(),
            ),
            _ => Self::new(
                region.base(),
                region.len_bytes(),
                config.fault_mode,
                region.memory(),
                region.unit_bytes(),
                wp_async,
            ),
        }
    }

    /// How a failed fault becomes SIGBUS with this descriptor: `requested`,
    /// with `Auto` resolved; `Poison` is refused where the kernel lacks it.
    pub(crate) fn sigbus_method(
        &self,
        requested: super::config::SigbusMethod,
    ) -> Result<super::config::SigbusMethod, GuestMemoryError> {
        use super::config::SigbusMethod;
        match requested {
            SigbusMethod::Auto if self.has_poison() => Ok(SigbusMethod::Poison),
            SigbusMethod::Auto => Ok(SigbusMethod::Tgkill),
            SigbusMethod::Poison if !self.has_poison() => Err(GuestMemoryError::Unsupported(
                "UFFDIO_POISON needs Linux >= 6.6; use SigbusMethod::Tgkill".into(),
            )),
            other => Ok(other),
        }
    }

    pub(crate) fn raw_fd(&self) -> libc::c_int {
        std::os::fd::AsRawFd::as_raw_fd(&self.uffd)
    }

    /// True when faults taken in kernel mode reach the handlers.
    pub(crate) fn kernel_faults(&self) -> bool {
        self.uffd.handles_kernel_faults()
    }

    pub(crate) fn has_poison(&self) -> bool {
        self.features & feature::POISON != 0
    }

    /// Reads pending fault messages into `events`; returns how many.
    pub(crate) fn read_events(&self, events: &mut EventBuffer) -> io::Result<usize> {
        self.uffd.read_events(events)
    }

    /// Copies the page at `src` to the guest page at `dst` and wakes its
    /// waiters; write-protected when `write_protect` (a clean page).
    ///
    /// # Safety
    /// `src` must be readable for 4096 bytes; `dst` must be a page of the
    /// registered range.
    pub(crate) unsafe fn copy_page(
        &self,
        src: *const u8,
        dst: *mut u8,
        write_protect: bool,
    ) -> io::Result<CopyOutcome> {
        // SAFETY: forwarded from the caller, for one page.
        unsafe { self.copy_pages(src, dst, 1, write_protect) }.map(|(_, outcome)| outcome)
    }

    /// Copies `pages` contiguous pages from `src` to `dst` with one ioctl
    /// and wakes their waiters. Returns how many were copied from the
    /// start, and `Copied` when all were; else the outcome at the first page
    /// not copied (`Exists`, or `Again` after a partial copy).
    ///
    /// # Safety
    /// `src` must be readable for `pages * 4096` bytes; `dst..` must be
    /// `pages` pages of the registered range.
    pub(crate) unsafe fn copy_pages(
        &self,
        src: *const u8,
        dst: *mut u8,
        pages: usize,
        write_protect: bool,
    ) -> io::Result<(usize, CopyOutcome)> {
        // SAFETY: `src` and `dst` are valid by the caller's contract; guest
        // pages are raw memory no Rust reference points into.
        let result = unsafe {
            self.uffd
                .copy(src, dst, pages * PAGE_SIZE, write_protect, true)
        };
        match result {
            Ok(_) => Ok((pages, CopyOutcome::Copied)),
            Err(err) => {
                let copied = err.copied_bytes / PAGE_SIZE;
                match err.source.raw_os_error() {
                    Some(libc::EEXIST) => Ok((copied, CopyOutcome::Exists)),
                    Some(libc::EAGAIN) => Ok((copied, CopyOutcome::Again)),
                    _ => Err(err.source),
                }
            }
        }
    }

    /// Maps `pages` pages (of the region's page size) at `dst` of a shared
    /// region from the file's page cache (filled through the alias),
    /// write-protected when `write_protect` (a clean page), and wakes their
    /// waiters.
    ///
    /// # Safety
    /// `dst..` must be `pages` pages of the registered range whose page
    /// cache holds the contents to map (written through the alias).
    pub(crate) unsafe fn continue_pages(
        &self,
        dst: *mut u8,
        pages: usize,
        write_protect: bool,
    ) -> io::Result<CopyOutcome> {
        // SAFETY: forwarded from the caller.
        match unsafe {
            self.uffd
                .continue_range(dst, pages * self.unit_bytes, write_protect)
        } {
            Ok(()) => Ok(CopyOutcome::Copied),
            Err(err) => match err.raw_os_error() {
                Some(libc::EEXIST) => Ok(CopyOutcome::Exists),
                Some(libc::EAGAIN) => Ok(CopyOutcome::Again),
                _ => Err(err),
            },
        }
    }

    /// Whether `UFFDIO_CONTINUE` maps this shared region's pages
    /// write-protected in one call (see [`RegionUffd::continue_clean`]).
    pub(crate) fn continue_write_protects(&self) -> bool {
        self.continue_wp
    }

    /// Whether the region's pages can be write-protected, and so writes
    /// tracked. Not for a shared file on Linux 5.13-5.18: there every
    /// mapped page counts as dirty ([`RegionUffd::continue_clean`] says
    /// so), flush and evict unmap a page from the guest before they write
    /// it back, and no write-protect fault ever comes.
    pub(crate) fn write_protects(&self) -> bool {
        self.write_protects
    }

    /// Maps `pages` clean pages (of the region's page size, at most 64) at
    /// `dst` of a shared region from the file's page cache, write-protected,
    /// and wakes their waiters. Returns the outcome and, bit i set, the
    /// pages written while they were being protected: the caller counts
    /// them dirty.
    ///
    /// Linux >= 6.4 maps them write-protected in one call
    /// (`UFFDIO_CONTINUE_MODE_WP`): nothing can write them first, and no bit
    /// is ever set. Linux 5.19-6.3 cannot: the pages are mapped writable
    /// without waking their waiters, then write-protected, then woken. A
    /// thread of the guest that is not waiting on them (another vCPU) may
    /// write one between the first two calls, without a fault. So each
    /// page's CRC-32C is taken through `alias` before it is mapped (nothing
    /// of the guest can write it then) and again once it is protected
    /// (nothing can write it now without a fault): a page whose bytes
    /// changed was written, and is reported. The caller must have marked
    /// the pages dirty before this call, so that a flush meanwhile waits
    /// for them, and clear the mark of the pages not reported.
    ///
    /// Linux 5.13-5.18 cannot write-protect shared memory at all: the
    /// pages are mapped writable and every bit is set.
    ///
    /// # Safety
    /// As [`RegionUffd::continue_pages`]; `alias..` is the alias mapping
    /// of the same pages.
    pub(crate) unsafe fn continue_clean(
        &self,
        dst: *mut u8,
        alias: *const u8,
        pages: usize,
    ) -> io::Result<(CopyOutcome, u64)> {
        if self.continue_wp {
            // SAFETY: forwarded from the caller.
            return unsafe { self.continue_pages(dst, pages, true) }.map(|outcome| (outcome, 0));
        }
        if pages > 64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "at most 64 pages are mapped clean in one call",
            ));
        }
        if !self.write_protects {
            // Nothing can protect them: mapped writable, all of them dirty.
            let all = u64::MAX >> (64 - pages.max(1));
            // SAFETY: forwarded from the caller.
            return unsafe { self.continue_pages(dst, pages, false) }.map(|outcome| (outcome, all));
        }
        let unit = self.unit_bytes;
        let sum = |page: usize| {
            // SAFETY: page `page` of the alias, mapped by the caller's
            // contract. No thread of the guest writes it while it is read:
            // before the install it is not in the guest mapping, after the
            // write protection a write faults and waits.
            let bytes =
                unsafe { std::slice::from_raw_parts(alias.wrapping_add(page * unit), unit) };
            crate::wire::page_checksum(bytes)
        };
        let mut before = [0u32; 64];
        for (page, before) in before.iter_mut().enumerate().take(pages) {
            *before = sum(page);
        }
        let len = pages * unit;
        // SAFETY: forwarded from the caller.
        match unsafe { self.uffd.continue_range_without_wake(dst, len) } {
            Ok(()) => {}
            Err(err) => {
                return match err.raw_os_error() {
                    // Some pages may be mapped (writable) and their waiters
                    // asleep: the caller goes page by page, which finds them
                    // present (dirty) and wakes them.
                    Some(libc::EEXIST) => Ok((CopyOutcome::Exists, 0)),
                    Some(libc::EAGAIN) => Ok((CopyOutcome::Again, 0)),
                    _ => Err(err),
                };
            }
        }
        #[cfg(any(test, feature = "test-hooks"))]
        super::test_hooks::before_write_protect(dst, len);
        let protected = self.uffd.write_protect(dst, len);
        let mut written = 0u64;
        for (page, &before) in before.iter().enumerate().take(pages) {
            // Not protected: writable, so dirty.
            if protected.is_err() || sum(page) != before {
                written |= 1 << page;
            }
        }
        if let Err(err) = protected {
            tracing::warn!(%err, pages, "write-protecting pages just mapped failed; they count as dirty");
        }
        self.wake(dst, len);
        Ok((CopyOutcome::Copied, written))
    }

    /// Installs a poison marker on the page at `dst` and wakes its waiters:
    /// every access then raises SIGBUS (BUS_MCEERR_AR) until the page is
    /// dropped with `MADV_DONTNEED`.
    pub(crate) fn poison_page(&self, dst: *mut u8) -> io::Result<()> {
        // SAFETY: `dst` is a page of the registered guest range, raw memory
        // whose accesses are meant to fail once its fetch failed.
        match unsafe { self.uffd.poison(dst, self.unit_bytes) } {
            // Already present or already poisoned: nothing to do.
            Err(err) if err.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            other => other,
        }
    }

    /// Wakes the threads waiting on `[start, start + len)`.
    pub(crate) fn wake(&self, start: *mut u8, len: usize) {
        if let Err(err) = self.uffd.wake(start, len) {
            tracing::warn!(%err, "UFFDIO_WAKE failed");
        }
    }

    /// Write-protects `[start, start + len)`: the next write to each present
    /// page faults to a handler.
    pub(crate) fn write_protect(&self, start: *mut u8, len: usize) -> io::Result<()> {
        self.uffd.write_protect(start, len)
    }

    /// Lifts write protection from `[start, start + len)` and wakes its waiters.
    pub(crate) fn unprotect(&self, start: *mut u8, len: usize) -> io::Result<()> {
        self.uffd.unprotect(start, len, true)
    }
}

fn uffd_err(op: &'static str) -> impl Fn(io::Error) -> GuestMemoryError {
    move |source| GuestMemoryError::Userfaultfd { op, source }
}

#[cfg(test)]
mod tests;
