//! The guest memory of the fault and flush runs, per `--backing`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use anyhow::bail;
use rdma_transport::guest_memory::{GuestBacking, GuestMemoryConfig, SharedFile};

use crate::matrix::Backing;

/// A config for `size_bytes` of guest memory from `gpa_base` made of
/// `backing` (a fresh memfd of that size for `memfd`), library defaults
/// otherwise.
pub fn config(
    backing: Backing,
    gpa_base: u64,
    size_bytes: usize,
) -> anyhow::Result<GuestMemoryConfig> {
    let backing = match backing {
        Backing::Anon => GuestBacking::Anonymous,
        Backing::Memfd => GuestBacking::SharedFile(SharedFile::new(memfd(size_bytes)?, 0)),
    };
    Ok(GuestMemoryConfig {
        backing,
        ..GuestMemoryConfig::new(gpa_base, size_bytes)
    })
}

/// A memfd of `size_bytes`, as a VMM makes for guest RAM.
fn memfd(size_bytes: usize) -> anyhow::Result<Arc<OwnedFd>> {
    // SAFETY: the name is NUL-terminated; the result is checked.
    let fd = unsafe { libc::memfd_create(c"bench-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        bail!("memfd_create: {}", std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscall on our descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size_bytes as libc::off_t) } != 0 {
        bail!("ftruncate: {}", std::io::Error::last_os_error());
    }
    Ok(Arc::new(fd))
}
