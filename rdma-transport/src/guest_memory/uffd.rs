//! The userfaultfd object of one guest region: the `userfaultfd` crate for
//! creation, registration, events, wake and write-protect, plus the two
//! ioctls it lacks (`UFFDIO_COPY` with `MODE_WP`, `UFFDIO_POISON`) and a
//! feature probe, written once here.

use std::io;
use std::os::fd::AsRawFd;

use userfaultfd::{FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use crate::page::PAGE_SIZE;

use super::error::GuestMemoryError;

/// `UFFD_FEATURE_*` bits of <linux/userfaultfd.h> this module uses.
pub(crate) mod feature {
    pub const PAGEFAULT_FLAG_WP: u64 = 1 << 0;
    pub const THREAD_ID: u64 = 1 << 8;
    pub const POISON: u64 = 1 << 14;
}

const UFFD_API: u64 = 0xaa;
// _IOWR(0xAA, 0x3F, struct uffdio_api), 24 bytes.
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
// _IOWR(0xAA, 0x03, struct uffdio_copy), 40 bytes.
const UFFDIO_COPY: libc::c_ulong = 0xc028_aa03;
// _IOWR(0xAA, 0x08, struct uffdio_poison), 32 bytes.
const UFFDIO_POISON: libc::c_ulong = 0xc020_aa08;
const UFFDIO_COPY_MODE_WP: u64 = 1 << 1;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioPoison {
    range: UffdioRange,
    mode: u64,
    updated: i64,
}

/// What the running kernel's userfaultfd offers (`UFFDIO_API` with no
/// feature asked, on a throw-away descriptor).
pub(crate) fn probe_features() -> io::Result<u64> {
    // SAFETY: plain syscall with flags only; the result is checked.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_userfaultfd,
            libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = fd as libc::c_int;
    let mut api = UffdioApi {
        api: UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: `fd` is the descriptor just created; `api` is a live
    // `struct uffdio_api` the kernel fills in.
    let ret = unsafe { libc::ioctl(fd, UFFDIO_API, &mut api as *mut UffdioApi) };
    let err = io::Error::last_os_error();
    // SAFETY: `fd` is ours and closed once.
    unsafe { libc::close(fd) };
    if ret != 0 {
        return Err(err);
    }
    Ok(api.features)
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
    uffd: Uffd,
    pub(crate) features: u64,
    pub(crate) kernel_faults: bool,
}

impl RegionUffd {
    /// Creates the descriptor with WP and thread ids (and poison when
    /// offered), and registers `[start, start + len)` for MISSING and WP faults.
    pub(crate) fn new(
        start: *mut u8,
        len: usize,
        want_kernel_faults: bool,
    ) -> Result<Self, GuestMemoryError> {
        let offered = probe_features().map_err(|source| GuestMemoryError::Userfaultfd {
            op: "userfaultfd(2)",
            source,
        })?;
        let required = feature::PAGEFAULT_FLAG_WP | feature::THREAD_ID;
        if offered & required != required {
            return Err(GuestMemoryError::Unsupported(format!(
                "the kernel's userfaultfd lacks write-protect or thread ids \
                 (features {offered:#x}; need Linux >= 5.7)"
            )));
        }
        let features = required | (offered & feature::POISON);
        let create = |user_mode_only: bool| {
            UffdBuilder::new()
                .close_on_exec(true)
                .non_blocking(true)
                .user_mode_only(user_mode_only)
                .require_features(FeatureFlags::from_bits_retain(features))
                .create()
        };
        let (uffd, kernel_faults) = match want_kernel_faults {
            true => match create(false) {
                Ok(u) => (u, true),
                Err(err) => {
                    tracing::warn!(%err, "userfaultfd for kernel-mode faults refused (needs CAP_SYS_PTRACE or /dev/userfaultfd); handling user-mode faults only");
                    (create(true).map_err(uffd_err("create"))?, false)
                }
            },
            false => (create(true).map_err(uffd_err("create"))?, false),
        };
        uffd.register_with_mode(
            start.cast(),
            len,
            RegisterMode::MISSING | RegisterMode::WRITE_PROTECT,
        )
        .map_err(uffd_err("UFFDIO_REGISTER"))?;
        Ok(Self {
            uffd,
            features,
            kernel_faults,
        })
    }

    pub(crate) fn raw_fd(&self) -> libc::c_int {
        self.uffd.as_raw_fd()
    }

    pub(crate) fn uffd(&self) -> &Uffd {
        &self.uffd
    }

    pub(crate) fn has_poison(&self) -> bool {
        self.features & feature::POISON != 0
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
        let mut copy = UffdioCopy {
            dst: dst as u64,
            src: src as u64,
            len: (pages * PAGE_SIZE) as u64,
            mode: if write_protect {
                UFFDIO_COPY_MODE_WP
            } else {
                0
            },
            copy: 0,
        };
        // SAFETY: `copy` is a live `struct uffdio_copy`; the kernel reads
        // `src` and fills `dst` (guaranteed valid by the caller).
        let ret = unsafe { libc::ioctl(self.raw_fd(), UFFDIO_COPY, &mut copy as *mut UffdioCopy) };
        if ret == 0 {
            return Ok((pages, CopyOutcome::Copied));
        }
        let err = io::Error::last_os_error();
        let copied = usize::try_from(copy.copy).unwrap_or(0) / PAGE_SIZE;
        match err.raw_os_error() {
            Some(libc::EEXIST) => Ok((copied, CopyOutcome::Exists)),
            Some(libc::EAGAIN) => Ok((copied, CopyOutcome::Again)),
            _ => Err(err),
        }
    }

    /// Installs a poison marker on the page at `dst` and wakes its waiters:
    /// every access then raises SIGBUS (BUS_MCEERR_AR) until the page is
    /// dropped with `MADV_DONTNEED`.
    pub(crate) fn poison_page(&self, dst: *mut u8) -> io::Result<()> {
        let mut poison = UffdioPoison {
            range: UffdioRange {
                start: dst as u64,
                len: PAGE_SIZE as u64,
            },
            mode: 0,
            updated: 0,
        };
        // SAFETY: `poison` is a live `struct uffdio_poison`; the kernel only
        // touches page tables of the registered range.
        let ret = unsafe {
            libc::ioctl(
                self.raw_fd(),
                UFFDIO_POISON,
                &mut poison as *mut UffdioPoison,
            )
        };
        match ret {
            0 => Ok(()),
            _ => {
                let err = io::Error::last_os_error();
                match err.raw_os_error() {
                    // Already present or already poisoned: nothing to do.
                    Some(libc::EEXIST) => Ok(()),
                    _ => Err(err),
                }
            }
        }
    }

    /// Wakes the threads waiting on `[start, start + len)`.
    pub(crate) fn wake(&self, start: *mut u8, len: usize) {
        if let Err(err) = self.uffd.wake(start.cast(), len) {
            tracing::warn!(%err, "UFFDIO_WAKE failed");
        }
    }

    /// Write-protects `[start, start + len)`: the next write to each present
    /// page faults to a handler.
    pub(crate) fn write_protect(&self, start: *mut u8, len: usize) -> io::Result<()> {
        self.uffd
            .write_protect(start.cast(), len)
            .map_err(|e| io::Error::other(e.to_string()))
    }

    /// Lifts write protection from `[start, start + len)` and wakes its waiters.
    pub(crate) fn unprotect(&self, start: *mut u8, len: usize) -> io::Result<()> {
        self.uffd
            .remove_write_protection(start.cast(), len, true)
            .map_err(|e| io::Error::other(e.to_string()))
    }
}

fn uffd_err(op: &'static str) -> impl Fn(userfaultfd::Error) -> GuestMemoryError {
    move |e| GuestMemoryError::Userfaultfd {
        op,
        source: io::Error::other(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_offers_write_protect_and_thread_ids() {
        let features = probe_features().expect("userfaultfd(2) works on this host");
        assert_ne!(features & feature::PAGEFAULT_FLAG_WP, 0);
        assert_ne!(features & feature::THREAD_ID, 0);
    }
}
