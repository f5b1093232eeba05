//! The host mapping behind a guest RAM region, and the arithmetic between
//! page index, host address and guest-physical address.
//!
//! A "page" of the region is its unit of faults, write protection,
//! write-back and eviction: 4 KiB, or the huge page of a hugetlbfs file
//! (`unit_bytes`, 2 MiB usually). The transport still moves 4 KiB pages:
//! one unit is `unit_pages()` of them, at consecutive GPAs.

use std::io;

use crate::page::{Page, PAGE_SIZE, PAGE_SIZE_U64};
use crate::region::{MapOptions, MappedRegion};
use crate::sys::cvt;

use super::config::GuestBacking;
use super::error::GuestMemoryError;
use super::file::SharedMapping;

/// What the guest mapping is.
#[derive(Debug)]
enum Map {
    /// Private anonymous memory, never populated by us: every first touch
    /// is a userfaultfd MISSING fault. Held to be unmapped on drop; its
    /// address is `GuestRegion::base`.
    Anonymous(#[allow(dead_code)] MappedRegion),
    /// A shared-memory file mapped twice: a first touch is a MISSING fault
    /// (a hole in the file) or a MINOR fault (in the page cache, not mapped
    /// in the guest mapping); both are served through the alias.
    Shared(SharedMapping),
}

/// The host mapping of a guest RAM region, of `pages` units of
/// `unit_bytes`.
#[derive(Debug)]
pub(crate) struct GuestRegion {
    map: Map,
    base: *mut u8,
    gpa_base: u64,
    pages: usize,
    unit_bytes: usize,
    /// Set once the alias is registered with an RDMA device: the file's
    /// pages are never freed (see [`Self::punch`]).
    keep_file_pages: bool,
}

// SAFETY: `base` points into `map`, which is Send and Sync and lives as long
// as `self`; the bytes are only accessed through raw pointers under the
// page-state protocol.
unsafe impl Send for GuestRegion {}
// SAFETY: as above.
unsafe impl Sync for GuestRegion {}

impl GuestRegion {
    pub(crate) fn new(
        gpa_base: u64,
        size_bytes: usize,
        backing: &GuestBacking,
    ) -> Result<Self, GuestMemoryError> {
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
        if let GuestBacking::SharedFile(file) = backing {
            let shared = SharedMapping::new(file, size_bytes)?;
            let unit_bytes = shared.unit_bytes;
            return Ok(Self {
                base: shared.guest_ptr(),
                map: Map::Shared(shared),
                gpa_base,
                pages: size_bytes / unit_bytes,
                unit_bytes,
                keep_file_pages: false,
            });
        }
        let map = MappedRegion::new(size_bytes, MapOptions::LAZY)
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
            base: map.as_ptr(),
            map: Map::Anonymous(map),
            gpa_base,
            pages: size_bytes / PAGE_SIZE,
            unit_bytes: PAGE_SIZE,
            keep_file_pages: false,
        })
    }

    /// From now on the file's pages are kept when pages are dropped: the
    /// alias is registered with an RDMA device, whose memory region holds
    /// the physical pages it pinned. A hole would give the file new pages
    /// the device never sees, and READs would land where the guest never
    /// looks.
    pub(crate) fn keep_file_pages(&mut self) {
        self.keep_file_pages = true;
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.base
    }

    /// Bytes of one page of the region (see the module docs).
    pub(crate) fn unit_bytes(&self) -> usize {
        self.unit_bytes
    }

    /// 4 KiB pages in one page of the region.
    pub(crate) fn unit_pages(&self) -> usize {
        self.unit_bytes / PAGE_SIZE
    }

    /// What the guest mapping is made of, for userfaultfd.
    pub(crate) fn memory(&self) -> super::uffd::Memory {
        use super::uffd::Memory;
        match &self.map {
            Map::Anonymous(_) => Memory::Anonymous,
            Map::Shared(_) if self.unit_bytes != PAGE_SIZE => Memory::Hugetlbfs,
            Map::Shared(_) => Memory::Shmem,
        }
    }

    /// True when the region is a shared-memory file (faults are resolved
    /// through the alias with `UFFDIO_CONTINUE`).
    pub(crate) fn is_shared(&self) -> bool {
        matches!(self.map, Map::Shared(_))
    }

    /// The alias mapping of a shared region (address, length): the same
    /// pages as the guest mapping, never registered with userfaultfd, so it
    /// can be written before a page is mapped into the guest (e.g. an RDMA
    /// memory region to read pages straight into).
    pub(crate) fn alias(&self) -> Option<(*mut u8, usize)> {
        match &self.map {
            Map::Shared(shared) => Some((shared.alias.as_ptr(), shared.alias.len_bytes())),
            Map::Anonymous(_) => None,
        }
    }

    /// Where the bytes of pages `[first, end)` are read and written by the
    /// transport: the alias of a shared region, the guest mapping itself
    /// of an anonymous one.
    pub(crate) fn data_ptr(&self, page: usize) -> *mut u8 {
        match &self.map {
            Map::Shared(shared) => shared.alias.as_ptr().wrapping_add(page * self.unit_bytes),
            Map::Anonymous(_) => self.page_addr(page),
        }
    }

    /// Pages `[first, end)` of a shared region's alias (as 4 KiB pages), to
    /// receive fetched pages into. `None` for an anonymous region.
    ///
    /// # Safety
    /// While the slice lives, nothing else may access these pages: they
    /// must be absent from the guest mapping and held by the caller (page
    /// `LOCKED`, or claimed `FETCHING`), so no fault maps them meanwhile.
    // The alias is raw memory shared with the kernel, like a DMA buffer:
    // exclusivity comes from the page states (the caller's contract), not
    // from a `&mut self`, which handlers on several threads cannot have.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn alias_pages_mut(&self, first: usize, end: usize) -> Option<&mut [Page]> {
        debug_assert!(first <= end && end <= self.pages);
        let Map::Shared(shared) = &self.map else {
            return None;
        };
        let ptr = shared.alias.as_ptr().wrapping_add(first * self.unit_bytes);
        let len = (end - first) * self.unit_pages();
        // SAFETY: `Page` is `[u8; 4096]` (alignment 1, no padding, any bytes
        // valid), and `ptr` is page aligned anyway; `len` 4 KiB pages from
        // it are inside the live alias mapping, which outlives `&self`.
        // Exclusive access is the caller's contract.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<Page>(), len) })
    }

    /// Allocates the file's pages `[first, end)` through the alias in one
    /// call (`MADV_POPULATE_WRITE`, Linux >= 5.14), so receiving a batch
    /// into them does not take a page fault per page. Contents are
    /// unchanged (zeroes for a hole). No-op for an anonymous region.
    pub(crate) fn populate_alias(&self, first: usize, end: usize) -> io::Result<()> {
        let Map::Shared(shared) = &self.map else {
            return Ok(());
        };
        let ptr = shared.alias.as_ptr().wrapping_add(first * self.unit_bytes);
        // SAFETY: the range is inside the live alias mapping; populating
        // allocates pages without changing any byte of them.
        let ret = unsafe {
            libc::madvise(
                ptr.cast(),
                (end - first) * self.unit_bytes,
                libc::MADV_POPULATE_WRITE,
            )
        };
        cvt(ret).map(|_| ())
    }

    /// Pages `[first, end)` (as 4 KiB pages) as the transport reads them to
    /// write them back (alias or guest mapping, see `data_ptr`), without a
    /// copy.
    ///
    /// # Safety
    /// The pages must be present and stay unwritten while the slice lives:
    /// write-protected in the guest mapping and `LOCKED` by the caller, so a
    /// writer waits in its fault.
    pub(crate) unsafe fn data_pages(&self, first: usize, end: usize) -> &[Page] {
        debug_assert!(first <= end && end <= self.pages);
        let ptr = self.data_ptr(first);
        // SAFETY: as in `alias_pages_mut`: `[u8; 4096]` has alignment 1 and
        // every byte pattern is valid; the range is inside the live mapping;
        // no write happens while it is borrowed, by the caller's contract.
        unsafe { std::slice::from_raw_parts(ptr.cast::<Page>(), (end - first) * self.unit_pages()) }
    }

    pub(crate) fn len_bytes(&self) -> usize {
        self.pages * self.unit_bytes
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
        self.base.wrapping_add(page * self.unit_bytes)
    }

    /// Guest-physical address of page `page` (of its first 4 KiB page).
    pub(crate) fn page_gpa(&self, page: usize) -> u64 {
        self.gpa_base + (page * self.unit_bytes) as u64
    }

    /// The GPAs of the 4 KiB pages of pages `[first, end)`, in `out`.
    pub(crate) fn gpas_of(&self, first: usize, end: usize, out: &mut Vec<u64>) {
        out.clear();
        let start = self.page_gpa(first);
        out.extend((0..(end - first) * self.unit_pages()).map(|k| start + (k * PAGE_SIZE) as u64));
    }

    /// Host address of the bytes `[gpa, gpa + len)`, when all are inside.
    pub(crate) fn host_range(&self, gpa: u64, len: usize) -> Result<*mut u8, GuestMemoryError> {
        let out = || GuestMemoryError::OutOfRange {
            gpa,
            len_bytes: len as u64,
        };
        let off = gpa.checked_sub(self.gpa_base).ok_or_else(out)?;
        let end = off.checked_add(len as u64).ok_or_else(out)?;
        if end > self.len_bytes() as u64 {
            return Err(out());
        }
        Ok(self.base.wrapping_add(off as usize))
    }

    /// Copies the guest bytes at `gpa` into `buf`, faulting pages in as
    /// needed (through the guest mapping, as a vCPU would).
    pub(crate) fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<(), GuestMemoryError> {
        let src = self.host_range(gpa, buf.len())?;
        // SAFETY: `src..src+len` is inside the live mapping (checked); the
        // guest may write it concurrently, as with any guest memory access
        // by a hypervisor, and only raw bytes are copied out.
        unsafe { std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// Copies `data` into the guest bytes at `gpa`, faulting pages in for
    /// writing as needed.
    pub(crate) fn write(&self, gpa: u64, data: &[u8]) -> Result<(), GuestMemoryError> {
        let dst = self.host_range(gpa, data.len())?;
        // SAFETY: `dst..dst+len` is inside the live mapping (checked) and is
        // raw guest memory, never a Rust reference, so it cannot alias
        // `data`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Page index of a host address inside the region.
    pub(crate) fn page_of_addr(&self, addr: usize) -> Option<usize> {
        let off = addr.checked_sub(self.base as usize)?;
        (off < self.len_bytes()).then_some(off / self.unit_bytes)
    }

    /// Page range `[first, end)` of a GPA range, when aligned and inside.
    pub(crate) fn pages_of(
        &self,
        gpa: u64,
        len_bytes: u64,
    ) -> Result<(usize, usize), GuestMemoryError> {
        let out = || GuestMemoryError::OutOfRange { gpa, len_bytes };
        let unit = self.unit_bytes as u64;
        if gpa % unit != 0 || len_bytes % unit != 0 {
            return Err(out());
        }
        let off = gpa.checked_sub(self.gpa_base).ok_or_else(out)?;
        let end = off.checked_add(len_bytes).ok_or_else(out)?;
        if end > self.len_bytes() as u64 {
            return Err(out());
        }
        Ok(((off / unit) as usize, (end / unit) as usize))
    }

    /// Drops pages `[first, end)`: their memory is freed, poison markers go,
    /// and the next touch faults again. A shared region's file gets a hole
    /// there (after the guest mapping is cleared of its page table entries
    /// and poison markers), unless its pages are kept (registered alias:
    /// then the next touch is a minor fault, and the page is fetched again
    /// all the same).
    pub(crate) fn drop_pages(&self, first: usize, end: usize) -> io::Result<()> {
        if first >= end {
            return Ok(());
        }
        self.unmap_guest(first, end)?;
        self.punch(first, end)
    }

    /// Clears pages `[first, end)` from the guest mapping (`MADV_DONTNEED`):
    /// the next touch faults. A shared region's file keeps their contents
    /// (and pages that were write-protected keep a marker that says so,
    /// see [`crate::uffd::Pagemap::protected`]); an anonymous region's are
    /// discarded.
    pub(crate) fn unmap_guest(&self, first: usize, end: usize) -> io::Result<()> {
        // SAFETY: the range is inside our mapping (callers pass page indexes
        // < pages()); DONTNEED on private anonymous memory only discards
        // contents, which is the point (on a shared mapping it only unmaps).
        let ret = unsafe {
            libc::madvise(
                self.page_addr(first).cast(),
                (end - first) * self.unit_bytes,
                libc::MADV_DONTNEED,
            )
        };
        cvt(ret).map(|_| ())
    }

    /// Frees the file's pages `[first, end)` of a shared region (a hole,
    /// which discards their contents); no-op for an anonymous one, and for
    /// a shared one whose pages are kept ([`Self::keep_file_pages`]).
    pub(crate) fn punch(&self, first: usize, end: usize) -> io::Result<()> {
        match &self.map {
            Map::Shared(_) if self.keep_file_pages => Ok(()),
            Map::Shared(shared) => {
                shared.punch_hole(first * self.unit_bytes, (end - first) * self.unit_bytes)
            }
            Map::Anonymous(_) => Ok(()),
        }
    }
}
