//! A small safe wrapper of Linux userfaultfd: open a descriptor, enable
//! features, register ranges, read fault events, resolve them.
//!
//! The ABI comes from `linux-raw-sys` (`abi.rs`); every raw call goes
//! through [`ioctl`] or [`crate::sys::cvt`], so turning `-1` into an
//! [`io::Error`] is written once. [`crate::guest_memory`] builds on it, and
//! so can a benchmark or a test that needs a bare userfaultfd.
//!
//! ```no_run
//! use rdma_transport::uffd::{Event, EventBuffer, FaultMode, RegisterMode, Userfaultfd};
//!
//! # fn main() -> std::io::Result<()> {
//! # let (addr, len) = (std::ptr::null_mut::<u8>(), 4096);
//! let uffd = Userfaultfd::open(FaultMode::UserOnly)?;
//! uffd.enable(0)?;
//! uffd.register(addr, len, RegisterMode::MISSING)?;
//! let mut events = EventBuffer::new(16);
//! uffd.read_events(&mut events)?; // non-blocking: poll(2) the fd first
//! for event in events.events() {
//!     if let Event::Pagefault(fault) = event {
//!         // resolve with `copy`, then the thread goes on
//!         # let _ = fault;
//!     }
//! }
//! # Ok(()) }
//! ```

mod abi;
mod event;
mod pagemap;

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use crate::sys::cvt;

pub use event::{Event, EventBuffer, FaultKind, Pagefault};
pub use pagemap::Pagemap;

use abi::{
    uffd_msg, uffdio_api, uffdio_continue, uffdio_copy, uffdio_poison, uffdio_range,
    uffdio_register, uffdio_writeprotect,
};

/// `UFFD_FEATURE_*` bits, for [`Userfaultfd::enable`].
pub mod feature {
    use linux_raw_sys::general as g;

    /// Write-protect faults (`UFFDIO_WRITEPROTECT`, register mode WP).
    pub const PAGEFAULT_FLAG_WP: u64 = g::UFFD_FEATURE_PAGEFAULT_FLAG_WP as u64;
    /// The faulting thread's id comes with each fault.
    pub const THREAD_ID: u64 = g::UFFD_FEATURE_THREAD_ID as u64;
    /// `UFFDIO_POISON` (Linux >= 6.6).
    pub const POISON: u64 = g::UFFD_FEATURE_POISON as u64;
    /// MISSING faults on shared memory (shmem, memfd).
    pub const MISSING_SHMEM: u64 = g::UFFD_FEATURE_MISSING_SHMEM as u64;
    /// MISSING faults on hugetlbfs.
    pub const MISSING_HUGETLBFS: u64 = g::UFFD_FEATURE_MISSING_HUGETLBFS as u64;
    /// MINOR faults (`UFFDIO_CONTINUE`) on shared memory (Linux >= 5.14).
    pub const MINOR_SHMEM: u64 = g::UFFD_FEATURE_MINOR_SHMEM as u64;
    /// MINOR faults (`UFFDIO_CONTINUE`) on hugetlbfs (Linux >= 5.13).
    pub const MINOR_HUGETLBFS: u64 = g::UFFD_FEATURE_MINOR_HUGETLBFS as u64;
    /// Write-protect on shared memory and hugetlbfs (Linux >= 5.19).
    pub const WP_HUGETLBFS_SHMEM: u64 = g::UFFD_FEATURE_WP_HUGETLBFS_SHMEM as u64;
    /// Asynchronous write protection (Linux >= 6.7): a write to a
    /// write-protected page is resolved by the kernel, which only clears
    /// the protection; no fault reaches the descriptor. Dirty pages are
    /// then found with `PAGEMAP_SCAN` ([`super::Pagemap`]).
    pub const WP_ASYNC: u64 = g::UFFD_FEATURE_WP_ASYNC as u64;
}

/// Which faults a userfaultfd receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FaultMode {
    /// Faults taken in user mode and in kernel mode (a syscall such as
    /// `read(2)` into the range, or KVM running a vCPU on it). What a
    /// hypervisor needs. Allowed with `CAP_SYS_PTRACE`, with sysctl
    /// `vm.unprivileged_userfaultfd=1`, or with read-write access to
    /// `/dev/userfaultfd` (Linux >= 6.1).
    #[default]
    KernelAndUser,
    /// Faults taken in user mode only (`UFFD_USER_MODE_ONLY`, Linux >= 5.11):
    /// allowed to any process; a kernel-mode access to a missing page fails
    /// with `EFAULT` instead.
    UserOnly,
}

/// Which faults a registered range raises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterMode {
    /// Faults on pages not present.
    pub missing: bool,
    /// Faults on writes to write-protected pages.
    pub write_protect: bool,
    /// Faults on pages present in a shared file's page cache but not
    /// mapped (shmem, hugetlbfs); resolved with `UFFDIO_CONTINUE`.
    pub minor: bool,
}

impl RegisterMode {
    /// Missing-page faults only.
    pub const MISSING: Self = Self {
        missing: true,
        write_protect: false,
        minor: false,
    };
    /// Missing-page and write-protect faults.
    pub const MISSING_AND_WP: Self = Self {
        missing: true,
        write_protect: true,
        minor: false,
    };
    /// Missing-page and minor faults (shared memory on a kernel without
    /// write protection of it, Linux < 5.19).
    pub const MISSING_AND_MINOR: Self = Self {
        missing: true,
        write_protect: false,
        minor: true,
    };
    /// Missing-page, minor and write-protect faults (shared memory).
    pub const MISSING_MINOR_AND_WP: Self = Self {
        missing: true,
        write_protect: true,
        minor: true,
    };

    fn bits(self) -> u64 {
        let mut bits = 0;
        if self.missing {
            bits |= u64::from(abi::UFFDIO_REGISTER_MODE_MISSING);
        }
        if self.write_protect {
            bits |= u64::from(abi::UFFDIO_REGISTER_MODE_WP);
        }
        if self.minor {
            bits |= u64::from(abi::UFFDIO_REGISTER_MODE_MINOR);
        }
        bits
    }
}

/// A `UFFDIO_COPY` that stopped early: `copied_bytes` from the start were
/// installed, then `source` (`EEXIST`: a page is already present; `EAGAIN`:
/// the mapping changed, try again).
#[derive(Debug, thiserror::Error)]
#[error("UFFDIO_COPY stopped after {copied_bytes} bytes")]
pub struct CopyError {
    /// Bytes installed before the error.
    pub copied_bytes: usize,
    /// The OS error.
    #[source]
    pub source: io::Error,
}

/// A userfaultfd descriptor (close-on-exec, non-blocking), closed on drop.
#[derive(Debug)]
pub struct Userfaultfd {
    fd: OwnedFd,
    kernel_faults: bool,
}

const OPEN_FLAGS: libc::c_int = libc::O_CLOEXEC | libc::O_NONBLOCK;

impl Userfaultfd {
    /// Opens a userfaultfd receiving the faults of `mode`.
    ///
    /// [`FaultMode::KernelAndUser`]: `userfaultfd(2)` without
    /// `UFFD_USER_MODE_ONLY` (so it works on kernels older than that flag),
    /// then, if that is refused, `/dev/userfaultfd`. [`FaultMode::UserOnly`]:
    /// `userfaultfd(2)` with `UFFD_USER_MODE_ONLY`, or without it on a
    /// kernel that lacks the flag (5.7-5.10, where kernel-mode faults are
    /// then delivered too; see [`Self::handles_kernel_faults`]).
    ///
    /// # Errors
    /// `EPERM` when kernel-mode faults were asked for and the process may
    /// not have them (see [`FaultMode::KernelAndUser`]); the OS error of
    /// `userfaultfd(2)` otherwise.
    pub fn open(mode: FaultMode) -> io::Result<Self> {
        match mode {
            FaultMode::KernelAndUser => match Self::syscall(OPEN_FLAGS) {
                Err(err) if err.raw_os_error() == Some(libc::EPERM) => Self::open_dev_node()
                    .map_err(|dev_err| {
                        tracing::debug!(%dev_err, "/dev/userfaultfd unusable too");
                        err
                    }),
                other => other,
            },
            FaultMode::UserOnly => {
                match Self::syscall(OPEN_FLAGS | abi::UFFD_USER_MODE_ONLY as libc::c_int) {
                    // A kernel before UFFD_USER_MODE_ONLY rejects the flag.
                    Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                        Self::syscall(OPEN_FLAGS)
                    }
                    Ok(mut uffd) => {
                        uffd.kernel_faults = false;
                        Ok(uffd)
                    }
                    Err(err) => Err(err),
                }
            }
        }
    }

    fn syscall(flags: libc::c_int) -> io::Result<Self> {
        // SAFETY: plain syscall taking flags only; the result is checked.
        let fd = cvt(unsafe { libc::syscall(libc::SYS_userfaultfd, flags) })?;
        Ok(Self::from_new_fd(fd as RawFd))
    }

    /// A userfaultfd from `/dev/userfaultfd` (Linux >= 6.1), whose file
    /// permissions replace the `CAP_SYS_PTRACE` check.
    fn open_dev_node() -> io::Result<Self> {
        const PATH: &CStr = c"/dev/userfaultfd";
        // SAFETY: `PATH` is NUL-terminated; the result is checked.
        let dev = cvt(unsafe { libc::open(PATH.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) })?;
        // SAFETY: `dev` was just opened and is owned by nobody else.
        let dev = unsafe { OwnedFd::from_raw_fd(dev) };
        // SAFETY: USERFAULTFD_IOC_NEW takes its flags by value.
        let fd = unsafe {
            ioctl(
                dev.as_raw_fd(),
                abi::USERFAULTFD_IOC_NEW,
                OPEN_FLAGS as usize,
            )
        }?;
        Ok(Self::from_new_fd(fd))
    }

    fn from_new_fd(fd: RawFd) -> Self {
        Self {
            // SAFETY: `fd` was just returned by the kernel and is owned by
            // nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            kernel_faults: true,
        }
    }

    /// Takes over a userfaultfd created elsewhere, e.g. by the hypervisor
    /// (which did `UFFDIO_API` and registered its guest mapping). `mode` is
    /// what it was opened with, as its creator says: the kernel does not
    /// tell. Makes the descriptor non-blocking (a flag of the open file,
    /// so the creator's descriptor becomes non-blocking too).
    ///
    /// # Errors
    /// `InvalidInput` when `fd` is not a userfaultfd; the OS error of
    /// `fcntl(2)` or of reading `/proc/self/fdinfo`.
    pub fn from_handed_over(fd: OwnedFd, mode: FaultMode) -> io::Result<Self> {
        let uffd = Self {
            fd,
            kernel_faults: mode == FaultMode::KernelAndUser,
        };
        uffd.enabled_features()?;
        // SAFETY: plain syscalls on a descriptor we own; no memory effects.
        let flags = cvt(unsafe { libc::fcntl(uffd.raw(), libc::F_GETFL) })?;
        if flags & libc::O_NONBLOCK == 0 {
            // SAFETY: as above.
            cvt(unsafe { libc::fcntl(uffd.raw(), libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
        }
        Ok(uffd)
    }

    /// The features enabled by this descriptor's `UFFDIO_API` handshake, as
    /// the kernel shows them in `/proc/self/fdinfo`; `None` before the
    /// handshake.
    ///
    /// # Errors
    /// `InvalidInput` when the descriptor is not a userfaultfd; the OS error
    /// of reading `/proc/self/fdinfo`.
    pub fn enabled_features(&self) -> io::Result<Option<u64>> {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", self.raw()))?;
        parse_fdinfo_features(&info)
    }

    /// True when faults taken in kernel mode reach this descriptor.
    pub fn handles_kernel_faults(&self) -> bool {
        self.kernel_faults
    }

    /// The `UFFDIO_API` handshake, once per descriptor, before anything
    /// else: enables `features` (bits of [`feature`]) and returns every
    /// feature the kernel offers.
    ///
    /// # Errors
    /// `EINVAL` when a feature asked for is not offered, or on a second call.
    pub fn enable(&self, features: u64) -> io::Result<u64> {
        let mut api = uffdio_api {
            api: u64::from(abi::UFFD_API),
            features,
            ioctls: 0,
        };
        // SAFETY: `api` is a live `struct uffdio_api` the kernel fills in.
        unsafe { ioctl(self.raw(), abi::UFFDIO_API, &mut api) }?;
        Ok(api.features)
    }

    /// Registers `[start, start + len_bytes)` (page aligned): faults of
    /// `mode` there now wait for this descriptor's owner to resolve them.
    ///
    /// # Errors
    /// The OS error of `UFFDIO_REGISTER` (e.g. `EINVAL` for an unaligned
    /// range, a range that is not anonymous memory, or a mode whose feature
    /// was not enabled).
    pub fn register(&self, start: *mut u8, len_bytes: usize, mode: RegisterMode) -> io::Result<()> {
        let mut register = uffdio_register {
            range: range(start, len_bytes),
            mode: mode.bits(),
            ioctls: 0,
        };
        // SAFETY: `register` is a live `struct uffdio_register`; the kernel
        // only changes the VMA flags of the range.
        unsafe { ioctl(self.raw(), abi::UFFDIO_REGISTER, &mut register) }?;
        Ok(())
    }

    /// Reads the pending messages into `buf` (as many as fit) and returns
    /// how many; 0 when none is pending (the descriptor is non-blocking:
    /// `poll(2)` it for `POLLIN`). Decode them with [`EventBuffer::events`].
    ///
    /// # Errors
    /// The OS error of `read(2)`.
    pub fn read_events(&self, buf: &mut EventBuffer) -> io::Result<usize> {
        buf.len = 0;
        let size = std::mem::size_of::<uffd_msg>();
        // SAFETY: `buf.msgs` is a live, writable array of that many bytes,
        // and any bytes are a valid `uffd_msg` (integers and unions of them).
        let ret = unsafe {
            libc::read(
                self.raw(),
                buf.msgs.as_mut_ptr().cast(),
                buf.msgs.len() * size,
            )
        };
        match cvt(ret) {
            Ok(n) => {
                buf.len = n as usize / size;
                Ok(buf.len)
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(err) => Err(err),
        }
    }

    /// Wakes the threads waiting on `[start, start + len_bytes)`.
    ///
    /// # Errors
    /// The OS error of `UFFDIO_WAKE`.
    pub fn wake(&self, start: *mut u8, len_bytes: usize) -> io::Result<()> {
        let mut range = range(start, len_bytes);
        // SAFETY: `range` is a live `struct uffdio_range`.
        unsafe { ioctl(self.raw(), abi::UFFDIO_WAKE, &mut range) }?;
        Ok(())
    }

    /// Write-protects the present pages of `[start, start + len_bytes)`: the
    /// next write to each faults ([`FaultKind::WriteProtect`]).
    ///
    /// # Errors
    /// The OS error of `UFFDIO_WRITEPROTECT`.
    pub fn write_protect(&self, start: *mut u8, len_bytes: usize) -> io::Result<()> {
        self.writeprotect(start, len_bytes, abi::UFFDIO_WRITEPROTECT_MODE_WP)
    }

    /// Lifts write protection from `[start, start + len_bytes)`, and wakes
    /// its waiters when `wake`.
    ///
    /// # Errors
    /// The OS error of `UFFDIO_WRITEPROTECT`.
    pub fn unprotect(&self, start: *mut u8, len_bytes: usize, wake: bool) -> io::Result<()> {
        let mode = if wake {
            0
        } else {
            abi::UFFDIO_WRITEPROTECT_MODE_DONTWAKE
        };
        self.writeprotect(start, len_bytes, mode)
    }

    fn writeprotect(&self, start: *mut u8, len_bytes: usize, mode: u64) -> io::Result<()> {
        let mut wp = uffdio_writeprotect {
            range: range(start, len_bytes),
            mode,
        };
        // SAFETY: `wp` is a live `struct uffdio_writeprotect`; the kernel
        // only changes page protections of the registered range.
        unsafe { ioctl(self.raw(), abi::UFFDIO_WRITEPROTECT, &mut wp) }?;
        Ok(())
    }

    /// Installs `len_bytes` from `src` as the missing pages at `dst`
    /// (`UFFDIO_COPY`), write-protected when `write_protect`, and wakes
    /// their waiters when `wake`. Returns the bytes installed (all of them).
    ///
    /// # Errors
    /// [`CopyError`] with the bytes installed before it stopped.
    ///
    /// # Safety
    /// `src` must be readable for `len_bytes`. `dst..dst + len_bytes` must
    /// be pages of a range registered with this descriptor whose contents
    /// no Rust reference relies on (they change from "missing" to `src`'s).
    pub unsafe fn copy(
        &self,
        src: *const u8,
        dst: *mut u8,
        len_bytes: usize,
        write_protect: bool,
        wake: bool,
    ) -> Result<usize, CopyError> {
        let mut mode = 0;
        if write_protect {
            mode |= u64::from(abi::UFFDIO_COPY_MODE_WP);
        }
        if !wake {
            mode |= u64::from(abi::UFFDIO_COPY_MODE_DONTWAKE);
        }
        let mut copy = uffdio_copy {
            dst: dst as u64,
            src: src as u64,
            len: len_bytes as u64,
            mode,
            copy: 0,
        };
        // SAFETY: `copy` is a live `struct uffdio_copy`; the kernel reads
        // `src` and fills `dst`, both valid by the caller's contract.
        match unsafe { ioctl(self.raw(), abi::UFFDIO_COPY, &mut copy) } {
            Ok(_) => Ok(len_bytes),
            Err(source) => Err(CopyError {
                copied_bytes: usize::try_from(copy.copy).unwrap_or(0),
                source,
            }),
        }
    }

    /// Maps the pages of `[start, start + len_bytes)` that are already in
    /// the shared file's page cache (`UFFDIO_CONTINUE`, register mode
    /// `minor`), write-protected when `write_protect` (Linux >= 6.4), and
    /// wakes their waiters. The page cache is filled beforehand through
    /// another mapping of the same file.
    ///
    /// # Errors
    /// The OS error of `UFFDIO_CONTINUE` (`EEXIST`: a page is mapped
    /// already; `EFAULT`: a page is not in the page cache; `EAGAIN`: the
    /// mapping changed, try again).
    ///
    /// # Safety
    /// The range must be pages of a range registered with this descriptor
    /// whose contents no Rust reference relies on (they change from
    /// "missing" to the page cache's).
    pub unsafe fn continue_range(
        &self,
        start: *mut u8,
        len_bytes: usize,
        write_protect: bool,
    ) -> io::Result<()> {
        let mode = if write_protect {
            abi::UFFDIO_CONTINUE_MODE_WP
        } else {
            0
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.continue_with_mode(start, len_bytes, mode) }
    }

    /// As [`Userfaultfd::continue_range`] without write protection, and
    /// without waking the waiters (`UFFDIO_CONTINUE_MODE_DONTWAKE`): the
    /// caller finishes the pages first (e.g. write-protects them where the
    /// kernel cannot map them so), then wakes them with
    /// [`Userfaultfd::wake`].
    ///
    /// # Errors
    /// As [`Userfaultfd::continue_range`].
    ///
    /// # Safety
    /// As [`Userfaultfd::continue_range`].
    pub unsafe fn continue_range_without_wake(
        &self,
        start: *mut u8,
        len_bytes: usize,
    ) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.continue_with_mode(start, len_bytes, abi::UFFDIO_CONTINUE_MODE_DONTWAKE) }
    }

    /// `UFFDIO_CONTINUE` of the range with `mode`.
    ///
    /// # Safety
    /// As [`Userfaultfd::continue_range`].
    unsafe fn continue_with_mode(
        &self,
        start: *mut u8,
        len_bytes: usize,
        mode: u64,
    ) -> io::Result<()> {
        let mut cont = uffdio_continue {
            range: range(start, len_bytes),
            mode,
            mapped: 0,
        };
        // SAFETY: `cont` is a live `struct uffdio_continue`; the kernel only
        // changes page tables of the range, which the caller's contract
        // allows.
        unsafe { ioctl(self.raw(), abi::UFFDIO_CONTINUE, &mut cont) }?;
        Ok(())
    }

    /// Installs poison markers on the missing pages of `[start, start +
    /// len_bytes)` (`UFFDIO_POISON`, Linux >= 6.6, feature
    /// [`feature::POISON`]) and wakes their waiters: every access then
    /// raises SIGBUS (`BUS_MCEERR_AR`) until the pages are dropped with
    /// `MADV_DONTNEED`.
    ///
    /// # Errors
    /// The OS error of `UFFDIO_POISON` (`EEXIST`: a page is present).
    ///
    /// # Safety
    /// The range must be pages of a range registered with this descriptor
    /// that no code relies on reading without a fault.
    pub unsafe fn poison(&self, start: *mut u8, len_bytes: usize) -> io::Result<()> {
        let mut poison = uffdio_poison {
            range: range(start, len_bytes),
            mode: 0,
            updated: 0,
        };
        // SAFETY: `poison` is a live `struct uffdio_poison`; the kernel only
        // changes page tables of the registered range.
        unsafe { ioctl(self.raw(), abi::UFFDIO_POISON, &mut poison) }?;
        Ok(())
    }

    fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for Userfaultfd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Userfaultfd {
    fn as_raw_fd(&self) -> RawFd {
        self.raw()
    }
}

/// `UFFD_FEATURE_INITIALIZED` of `fs/userfaultfd.c` (kernel-internal, shown
/// in fdinfo): the `UFFDIO_API` handshake was done.
const FEATURE_INITIALIZED: u64 = 1 << 31;

/// The enabled features in a userfaultfd's fdinfo (line `API:\t<api>:<features>:<ioctls>`,
/// hexadecimal); `None` before the handshake.
fn parse_fdinfo_features(info: &str) -> io::Result<Option<u64>> {
    let not_uffd = || io::Error::new(io::ErrorKind::InvalidInput, "not a userfaultfd");
    let line = info
        .lines()
        .find_map(|l| l.strip_prefix("API:"))
        .ok_or_else(not_uffd)?;
    let features = line
        .trim()
        .split(':')
        .nth(1)
        .and_then(|f| u64::from_str_radix(f, 16).ok())
        .ok_or_else(not_uffd)?;
    Ok((features & FEATURE_INITIALIZED != 0).then_some(features & !FEATURE_INITIALIZED))
}

fn range(start: *mut u8, len_bytes: usize) -> uffdio_range {
    uffdio_range {
        start: start as u64,
        len: len_bytes as u64,
    }
}

/// `ioctl(2)` with `-1` turned into the thread's `errno`.
///
/// # Safety
/// `arg` must be what `request` expects on `fd` (a live pointer to its
/// struct, or a value).
unsafe fn ioctl<T: IoctlArg>(fd: RawFd, request: u32, arg: T) -> io::Result<RawFd> {
    // SAFETY: forwarded from the caller.
    cvt(unsafe { libc::ioctl(fd, request as _, arg.raw()) })
}

/// What an ioctl takes: a pointer to its struct, or a value.
trait IoctlArg {
    fn raw(self) -> usize;
}

impl<T> IoctlArg for &mut T {
    fn raw(self) -> usize {
        (self as *mut T) as usize
    }
}

impl IoctlArg for usize {
    fn raw(self) -> usize {
        self
    }
}

#[cfg(test)]
mod tests;
