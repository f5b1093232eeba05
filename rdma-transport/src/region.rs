//! `MappedRegion`: an anonymous memory mapping that owns itself.
//!
//! The page pool and the page-server's exported memory are both one of
//! these, so each can be registered once as an RDMA memory region.

use std::io;
use std::ptr::NonNull;

use crate::sys::cvt;

const HUGE_PAGE_BYTES: usize = 2 << 20;

/// What backs a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// 2 MiB huge pages (MAP_HUGETLB).
    HugePages,
    /// Normal 4 KiB pages.
    NormalPages,
}

/// An anonymous, private, read-write mapping, unmapped on drop.
#[derive(Debug)]
pub struct MappedRegion {
    base: NonNull<u8>,
    len_bytes: usize,
    map_len_bytes: usize,
    backing: Backing,
}

// SAFETY: the region is plain memory owned by this value; users synchronise
// access to its bytes themselves (it is never handed out as a Rust reference
// by this type).
unsafe impl Send for MappedRegion {}
// SAFETY: as above.
unsafe impl Sync for MappedRegion {}

/// How to map a region.
#[derive(Debug, Clone, Copy)]
pub struct MapOptions {
    /// Try 2 MiB huge pages first.
    pub try_huge_pages: bool,
    /// Fault every page in now (MAP_POPULATE), so first touches are not
    /// paid on the data path.
    pub populate: bool,
}

impl MapOptions {
    /// 4 KiB pages, each faulted in when first touched.
    pub const LAZY: Self = Self {
        try_huge_pages: false,
        populate: false,
    };
    /// 4 KiB pages, all faulted in by the `mmap` (buffers on the data path).
    pub const POPULATED: Self = Self {
        try_huge_pages: false,
        populate: true,
    };
}

impl MappedRegion {
    /// Maps `len_bytes` (rounded up to 2 MiB when huge pages are used).
    ///
    /// # Errors
    /// The `mmap` error when no mapping can be had.
    pub fn new(len_bytes: usize, options: MapOptions) -> io::Result<Self> {
        if len_bytes == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot map an empty region",
            ));
        }
        let populate = if options.populate {
            libc::MAP_POPULATE
        } else {
            libc::MAP_NORESERVE
        };
        if options.try_huge_pages {
            let huge_len = len_bytes.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES;
            match map_anonymous(huge_len, libc::MAP_HUGETLB | populate) {
                Ok(base) => {
                    return Ok(Self {
                        base,
                        len_bytes,
                        map_len_bytes: huge_len,
                        backing: Backing::HugePages,
                    })
                }
                Err(err) => tracing::debug!(%err, len_bytes, "no huge pages; using normal pages"),
            }
        }
        let base = map_anonymous(len_bytes, populate)?;
        Ok(Self {
            base,
            len_bytes,
            map_len_bytes: len_bytes,
            backing: Backing::NormalPages,
        })
    }

    /// First byte of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Usable length in bytes (as asked for).
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// What backs the region.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Pointer to `len` bytes at `offset`, or `None` when they are not all
    /// inside the region.
    pub fn ptr_at(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        // SAFETY: `offset <= end <= len_bytes`, so the result stays inside
        // (or one past the end of) the mapping.
        (end <= self.len_bytes).then(|| unsafe { self.base.as_ptr().add(offset) })
    }

    /// Copies `dst.len()` bytes of the region at `offset` into `dst`, raw
    /// (never through a Rust reference), like [`Self::write_at`]: a page
    /// being written meanwhile may be copied torn.
    ///
    /// # Errors
    /// `InvalidInput` when the bytes are not all inside the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> io::Result<()> {
        let src = self.ptr_at(offset, dst.len()).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "read outside the region")
        })?;
        // SAFETY: `src..src+len` is inside the live mapping (checked above),
        // and `dst` is a Rust slice, which cannot alias this raw mapping.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`. Other threads (or a NIC) may
    /// access the same bytes concurrently: the copy is raw, never through a
    /// Rust reference, and a page read while it is being written may be torn,
    /// as with RDMA.
    ///
    /// # Errors
    /// `InvalidInput` when the bytes are not all inside the region.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> io::Result<()> {
        let dst = self.ptr_at(offset, src.len()).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "write outside the region")
        })?;
        // SAFETY: `dst..dst+len` is inside the live mapping (checked above),
        // and `src` is a Rust slice, which cannot alias this raw mapping.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }
}

fn map_anonymous(len_bytes: usize, extra_flags: libc::c_int) -> io::Result<NonNull<u8>> {
    // SAFETY: an anonymous private mapping with no address hint touches no
    // existing memory; the result is checked before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len_bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))
}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        // SAFETY: `base`/`map_len_bytes` are exactly what mmap returned, and
        // the region is being dropped, so nothing uses it any more.
        let ret = unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_len_bytes) };
        if let Err(err) = cvt(ret) {
            tracing::warn!(%err, "munmap failed");
        }
    }
}
