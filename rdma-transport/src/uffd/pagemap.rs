//! `/proc/self/pagemap`: which pages of a range were written since they
//! were write-protected, for a userfaultfd with asynchronous write
//! protection ([`super::feature::WP_ASYNC`]).
//!
//! - [`Pagemap::take_written`]: the `PAGEMAP_SCAN` ioctl (Linux >= 6.7)
//!   lists the written runs of a range and write-protects them again in the
//!   same walk, so a write after the scan shows at the next one.
//! - [`Pagemap::protected`]: the `PM_UFFD_WP` bit of each page's entry.
//!   After the pages were unmapped (`MADV_DONTNEED` of a shared mapping),
//!   a page that was protected keeps a marker with that bit, and a page
//!   written since its protection has none: what was written survives the
//!   unmapping, which is how `evict` tells dirty pages without a window
//!   for writes between looking and dropping.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use linux_raw_sys::general::{
    page_region, pm_scan_arg, PAGE_IS_PRESENT, PAGE_IS_WRITTEN, PM_SCAN_CHECK_WPASYNC,
    PM_SCAN_WP_MATCHING,
};

use crate::page::PAGE_SIZE;
use crate::sys::cvt;

/// `_IOWR('f', 16, struct pm_scan_arg)` of `<linux/fs.h>`: the table of
/// `linux-raw-sys` lacks it.
const PAGEMAP_SCAN: u32 =
    (3 << 30) | ((std::mem::size_of::<pm_scan_arg>() as u32) << 16) | ((b'f' as u32) << 8) | 16;

/// `PM_UFFD_WP` of a pagemap entry (Documentation/admin-guide/mm/pagemap.rst).
const PM_UFFD_WP: u64 = 1 << 57;

/// Written runs taken per `PAGEMAP_SCAN` call.
const REGIONS_PER_SCAN: usize = 64;

/// This process's `/proc/self/pagemap`.
#[derive(Debug)]
pub struct Pagemap {
    fd: OwnedFd,
}

impl Pagemap {
    /// Opens `/proc/self/pagemap`.
    ///
    /// # Errors
    /// The OS error of `open(2)`.
    pub fn open() -> io::Result<Self> {
        let file = std::fs::File::open("/proc/self/pagemap")?;
        Ok(Self { fd: file.into() })
    }

    /// Appends to `out` the runs `(start, end, mapped)` of `[start, end)`
    /// (page aligned addresses) written since they were last
    /// write-protected, and write-protects them again, atomically with the
    /// walk. Needs a userfaultfd with [`super::feature::WP_ASYNC`]
    /// registered for write-protect on the range. Unpopulated pages count
    /// as written too (and get a protection marker): their runs have
    /// `mapped` false.
    ///
    /// # Errors
    /// The OS error of the ioctl (`ENOTTY`/`EINVAL` on kernels without it).
    pub fn take_written(
        &self,
        start: usize,
        end: usize,
        out: &mut Vec<(usize, usize, bool)>,
    ) -> io::Result<()> {
        let zero = page_region {
            start: 0,
            end: 0,
            categories: 0,
        };
        let mut regions = [zero; REGIONS_PER_SCAN];
        let mut at = start;
        while at < end {
            let mut arg = pm_scan_arg {
                size: std::mem::size_of::<pm_scan_arg>() as u64,
                flags: u64::from(PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC),
                start: at as u64,
                end: end as u64,
                walk_end: 0,
                vec: regions.as_mut_ptr() as u64,
                vec_len: REGIONS_PER_SCAN as u64,
                max_pages: 0,
                category_inverted: 0,
                category_mask: u64::from(PAGE_IS_WRITTEN),
                category_anyof_mask: 0,
                return_mask: u64::from(PAGE_IS_WRITTEN | PAGE_IS_PRESENT),
            };
            // SAFETY: `arg` is a live `struct pm_scan_arg` whose `vec` points
            // to `regions`, `vec_len` entries the kernel may fill.
            let ret = unsafe { libc::ioctl(self.fd.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
            let filled = cvt(ret)? as usize;
            out.extend(regions[..filled.min(REGIONS_PER_SCAN)].iter().map(|r| {
                let mapped = r.categories & u64::from(PAGE_IS_PRESENT) != 0;
                (r.start as usize, r.end as usize, mapped)
            }));
            let walked = arg.walk_end as usize;
            if walked <= at {
                return Err(io::Error::other("PAGEMAP_SCAN made no progress"));
            }
            at = walked;
        }
        Ok(())
    }

    /// For each of the `pages` pages from `start` (page aligned), whether
    /// its entry has `PM_UFFD_WP`: write-protected, or unmapped while
    /// write-protected. Fills `out` (cleared first).
    ///
    /// # Errors
    /// The OS error of `pread(2)`.
    pub fn protected(&self, start: usize, pages: usize, out: &mut Vec<bool>) -> io::Result<()> {
        let mut entries = vec![0u64; pages];
        let offset = (start / PAGE_SIZE * 8) as libc::off_t;
        let len = pages * 8;
        let mut done = 0;
        while done < len {
            // SAFETY: reads into the live buffer `entries`, within its
            // `len` bytes.
            let n = unsafe {
                libc::pread(
                    self.fd.as_raw_fd(),
                    entries.as_mut_ptr().cast::<u8>().wrapping_add(done).cast(),
                    len - done,
                    offset + done as libc::off_t,
                )
            };
            let n = cvt(n)? as usize;
            if n == 0 {
                return Err(io::Error::other("short read of /proc/self/pagemap"));
            }
            done += n;
        }
        out.clear();
        out.extend(entries.iter().map(|e| e & PM_UFFD_WP != 0));
        Ok(())
    }
}
