//! The guest memory of the fault and flush runs, per `--backing`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use anyhow::bail;
use rdma_transport::guest_memory::{GuestBacking, GuestMemoryConfig, SharedFile};

use crate::matrix::Backing;

/// A config for `size_bytes` of guest memory from `gpa_base` made of
/// `backing` (a fresh memfd of that size for `memfd`, with `MFD_HUGETLB`
/// for `hugetlbfs`), its handlers pinned as `--handler-cpus` says and
/// asking for `--handler-slice-us`, library defaults otherwise.
pub fn config(
    backing: Backing,
    gpa_base: u64,
    size_bytes: usize,
    handler_cpus: Option<Vec<usize>>,
    handler_slice_us: u64,
) -> anyhow::Result<GuestMemoryConfig> {
    let backing = match backing {
        Backing::Anon => GuestBacking::Anonymous,
        Backing::Memfd => GuestBacking::SharedFile(SharedFile::new(memfd(size_bytes, 0)?, 0)),
        Backing::Hugetlbfs => {
            let huge_pages = size_bytes.div_ceil(2 << 20);
            let free = free_huge_pages();
            if free < huge_pages {
                bail!(
                    "--backing hugetlbfs needs {huge_pages} free 2 MiB huge pages, the host has \
                     {free}: reserve them as root (echo {huge_pages} > /proc/sys/vm/nr_hugepages)"
                );
            }
            GuestBacking::SharedFile(SharedFile::new(memfd(size_bytes, libc::MFD_HUGETLB)?, 0))
        }
    };
    Ok(GuestMemoryConfig {
        backing,
        handler_cpus,
        handler_slice_us,
        ..GuestMemoryConfig::new(gpa_base, size_bytes)
    })
}

/// `HugePages_Free` of /proc/meminfo.
fn free_huge_pages() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A memfd of `size_bytes` (with `flags` besides `MFD_CLOEXEC`), as a VMM
/// makes for guest RAM.
fn memfd(size_bytes: usize, flags: libc::c_uint) -> anyhow::Result<Arc<OwnedFd>> {
    // SAFETY: the name is NUL-terminated; the result is checked.
    let fd = unsafe { libc::memfd_create(c"bench-guest-ram".as_ptr(), libc::MFD_CLOEXEC | flags) };
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
