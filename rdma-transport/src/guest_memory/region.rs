//! The host mapping behind a guest RAM region, and the arithmetic between
//! page index, host address and guest-physical address.

use std::io;

use crate::page::{PAGE_SIZE, PAGE_SIZE_U64};
use crate::region::{MapOptions, MappedRegion};
use crate::sys::cvt;

use super::error::GuestMemoryError;

/// An anonymous private mapping of 4 KiB pages, never populated by us:
/// every first touch is a userfaultfd MISSING fault.
#[derive(Debug)]
pub(crate) struct GuestRegion {
    map: MappedRegion,
    gpa_base: u64,
    pages: usize,
}

impl GuestRegion {
    pub(crate) fn new(gpa_base: u64, size_bytes: usize) -> Result<Self, GuestMemoryError> {
        if size_bytes == 0 || size_bytes % PAGE_SIZE != 0 || gpa_base % PAGE_SIZE_U64 != 0 {
            return Err(GuestMemoryError::Config(format!(
                "gpa_base {gpa_base:#x} and size_bytes {size_bytes:#x} must be page aligned and the size positive"
            )));
        }
        if gpa_base.checked_add(size_bytes as u64).is_none() {
            return Err(GuestMemoryError::Config(
                "gpa_base + size_bytes overflows".into(),
            ));
        }
        let map = MappedRegion::new(
            size_bytes,
            MapOptions {
                try_huge_pages: false,
                populate: false,
            },
        )
        .map_err(|source| GuestMemoryError::Memory { op: "mmap", source })?;
        // Faults, write protection and eviction work on 4 KiB pages: keep
        // transparent huge pages out of the region.
        // SAFETY: advice on a mapping we own; it changes no contents.
        let ret =
            unsafe { libc::madvise(map.as_ptr().cast(), map.len_bytes(), libc::MADV_NOHUGEPAGE) };
        cvt(ret).map_err(|source| GuestMemoryError::Memory {
            op: "madvise(MADV_NOHUGEPAGE)",
            source,
        })?;
        Ok(Self {
            map,
            gpa_base,
            pages: size_bytes / PAGE_SIZE,
        })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    pub(crate) fn len_bytes(&self) -> usize {
        self.pages * PAGE_SIZE
    }

    pub(crate) fn pages(&self) -> usize {
        self.pages
    }

    pub(crate) fn gpa_base(&self) -> u64 {
        self.gpa_base
    }

    /// Host address of page `page` (< `pages()`).
    pub(crate) fn page_addr(&self, page: usize) -> *mut u8 {
        debug_assert!(page < self.pages);
        self.map.as_ptr().wrapping_add(page * PAGE_SIZE)
    }

    /// Guest-physical address of page `page`.
    pub(crate) fn page_gpa(&self, page: usize) -> u64 {
        self.gpa_base + (page * PAGE_SIZE) as u64
    }

    /// Page index of a host address inside the region.
    pub(crate) fn page_of_addr(&self, addr: usize) -> Option<usize> {
        let off = addr.checked_sub(self.map.as_ptr() as usize)?;
        (off < self.len_bytes()).then_some(off / PAGE_SIZE)
    }

    /// Page range `[first, end)` of a GPA range, when aligned and inside.
    pub(crate) fn pages_of(
        &self,
        gpa: u64,
        len_bytes: u64,
    ) -> Result<(usize, usize), GuestMemoryError> {
        let out = || GuestMemoryError::OutOfRange { gpa, len_bytes };
        if gpa % PAGE_SIZE_U64 != 0 || len_bytes % PAGE_SIZE_U64 != 0 {
            return Err(out());
        }
        let off = gpa.checked_sub(self.gpa_base).ok_or_else(out)?;
        let end = off.checked_add(len_bytes).ok_or_else(out)?;
        if end > self.len_bytes() as u64 {
            return Err(out());
        }
        Ok((
            (off / PAGE_SIZE_U64) as usize,
            (end / PAGE_SIZE_U64) as usize,
        ))
    }

    /// Drops pages `[first, end)`: their memory is freed, poison markers go,
    /// and the next touch faults again.
    pub(crate) fn drop_pages(&self, first: usize, end: usize) -> io::Result<()> {
        if first >= end {
            return Ok(());
        }
        // SAFETY: the range is inside our mapping (callers pass page indexes
        // < pages()); DONTNEED on private anonymous memory only discards
        // contents, which is the point.
        let ret = unsafe {
            libc::madvise(
                self.page_addr(first).cast(),
                (end - first) * PAGE_SIZE,
                libc::MADV_DONTNEED,
            )
        };
        cvt(ret).map(|_| ())
    }
}
