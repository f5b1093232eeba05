//! Guest RAM in a shared-memory file the hypervisor owns (a memfd, a tmpfs
//! file, or a hugetlbfs file or `MFD_HUGETLB` memfd): the checks on the file, its two `MAP_SHARED` mappings (the guest's,
//! registered with userfaultfd, and our alias, which is not), and freeing
//! pages by punching holes.
//!
//! Faults on the guest mapping are resolved without a bounce: the page is
//! received straight into the alias (which fills the file's page cache) and
//! then mapped into the guest mapping with `UFFDIO_CONTINUE`.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::sys::cvt;

use super::config::SharedFile;
use super::error::GuestMemoryError;

/// Both mappings of the region's range of the file.
#[derive(Debug)]
pub(crate) struct SharedMapping {
    fd: Arc<OwnedFd>,
    offset_bytes: u64,
    guest: GuestMap,
    pub(crate) alias: FileMap,
    /// The file's page size: 4 KiB (tmpfs), or its huge page size
    /// (hugetlbfs), which is then the unit of faults, write protection,
    /// write-back and eviction.
    pub(crate) unit_bytes: usize,
}

/// The guest mapping: ours, or the hypervisor's (handed over with its
/// userfaultfd; never unmapped by us).
#[derive(Debug)]
enum GuestMap {
    Owned(FileMap),
    HandedOver(usize),
}

impl SharedMapping {
    /// Checks `file` for a region of `len_bytes` and maps it twice (once
    /// when the hypervisor handed its own guest mapping over).
    pub(crate) fn new(file: &SharedFile, len_bytes: usize) -> Result<Self, GuestMemoryError> {
        let unit_bytes = check(file, len_bytes as u64)?;
        let guest = match &file.handed_over {
            Some(handed_over) => {
                check_mapping(file, handed_over.mapping, len_bytes, unit_bytes)?;
                GuestMap::HandedOver(handed_over.mapping)
            }
            None => GuestMap::Owned(FileMap::new(
                &file.fd,
                file.offset_bytes,
                len_bytes,
                unit_bytes,
            )?),
        };
        let alias = FileMap::new(&file.fd, file.offset_bytes, len_bytes, unit_bytes)?;
        Ok(Self {
            fd: Arc::clone(&file.fd),
            offset_bytes: file.offset_bytes,
            guest,
            alias,
            unit_bytes,
        })
    }

    /// Address of the guest mapping.
    pub(crate) fn guest_ptr(&self) -> *mut u8 {
        match &self.guest {
            GuestMap::Owned(map) => map.as_ptr(),
            GuestMap::HandedOver(addr) => *addr as *mut u8,
        }
    }

    /// Frees the file's pages `[off, off + len_bytes)` of the region (its
    /// page cache; both mappings lose them): the next touch faults again.
    pub(crate) fn punch_hole(&self, off: usize, len_bytes: usize) -> io::Result<()> {
        // SAFETY: plain syscall on our descriptor; the range is inside the
        // region's part of the file (callers pass in-region offsets), whose
        // contents we own and mean to discard.
        let ret = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                (self.offset_bytes + off as u64) as libc::off_t,
                len_bytes as libc::off_t,
            )
        };
        cvt(ret).map(|_| ())
    }
}

/// The checks of a region's file: shared memory, read-write, aligned, large
/// enough. Each failure is its own error. Returns the file's page size (4
/// KiB, or the huge page size of a hugetlbfs file).
fn check(file: &SharedFile, len_bytes: u64) -> Result<usize, GuestMemoryError> {
    let fd = file.fd.as_raw_fd();
    let syscall = |op| move |source| GuestMemoryError::Memory { op, source };
    // SAFETY: `statfs` is plain data the kernel fills in; zeroes are valid.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fs` is a live, writable `struct statfs`.
    cvt(unsafe { libc::fstatfs(fd, &mut fs) }).map_err(syscall("fstatfs"))?;
    // Minor faults, write protection and holes on hugetlbfs work on whole
    // huge pages: they become the region's unit.
    let unit_bytes = if fs.f_type == libc::HUGETLBFS_MAGIC {
        usize::try_from(fs.f_bsize).unwrap_or(0)
    } else {
        crate::PAGE_SIZE
    };
    if unit_bytes < crate::PAGE_SIZE || !unit_bytes.is_power_of_two() {
        return Err(GuestMemoryError::Config(format!(
            "the hugetlbfs file reports a page size of {unit_bytes:#x} bytes"
        )));
    }
    if fs.f_type != libc::TMPFS_MAGIC && fs.f_type != libc::HUGETLBFS_MAGIC {
        #[allow(clippy::unnecessary_cast)] // f_type's width differs per libc
        let fs_magic = fs.f_type as i64;
        return Err(GuestMemoryError::NotSharedMemory { fs_magic });
    }
    // SAFETY: plain syscall on a descriptor we hold; no memory effects.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) }).map_err(syscall("fcntl"))?;
    if flags & libc::O_ACCMODE != libc::O_RDWR {
        return Err(GuestMemoryError::FileNotWritable);
    }
    let unit = unit_bytes as u64;
    if file.offset_bytes % unit != 0 || len_bytes % unit != 0 {
        return Err(GuestMemoryError::Config(format!(
            "offset_bytes {:#x} and size_bytes {len_bytes:#x} must be multiples of the file's \
             page size {unit:#x}",
            file.offset_bytes
        )));
    }
    let needed_bytes = file
        .offset_bytes
        .checked_add(len_bytes)
        .ok_or_else(|| GuestMemoryError::Config("offset_bytes + size_bytes overflows".into()))?;
    // SAFETY: `stat` is plain data the kernel fills in; zeroes are valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable `struct stat`.
    cvt(unsafe { libc::fstat(fd, &mut st) }).map_err(syscall("fstat"))?;
    let file_bytes = st.st_size.max(0) as u64;
    if file_bytes < needed_bytes {
        return Err(GuestMemoryError::FileTooSmall {
            file_bytes,
            needed_bytes,
        });
    }
    Ok(unit_bytes)
}

/// Checks that `[addr, addr + len_bytes)` is mapped read-write and shared,
/// from `file` at its offset, by the lines of `/proc/self/maps` covering it.
fn check_mapping(
    file: &SharedFile,
    addr: usize,
    len_bytes: usize,
    unit_bytes: usize,
) -> Result<(), GuestMemoryError> {
    let wrong = |why: String| {
        GuestMemoryError::Config(format!(
            "the handed-over mapping at {addr:#x} (+{len_bytes:#x}) {why}"
        ))
    };
    if addr % unit_bytes != 0 {
        return Err(wrong(format!(
            "is not aligned to the file's page size {unit_bytes:#x}"
        )));
    }
    // SAFETY: `stat` is plain data the kernel fills in; zeroes are valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable `struct stat`.
    cvt(unsafe { libc::fstat(file.fd.as_raw_fd(), &mut st) }).map_err(|source| {
        GuestMemoryError::Memory {
            op: "fstat",
            source,
        }
    })?;
    let maps =
        std::fs::read_to_string("/proc/self/maps").map_err(|source| GuestMemoryError::Memory {
            op: "reading /proc/self/maps",
            source,
        })?;
    let end = addr + len_bytes;
    let mut covered = addr;
    for line in maps.lines() {
        let Some(vma) = MapsLine::parse(line) else {
            continue;
        };
        if vma.end <= covered || vma.start > covered || covered >= end {
            continue;
        }
        let file_offset = vma.offset + (covered - vma.start) as u64;
        let expected = file.offset_bytes + (covered - addr) as u64;
        if !vma.perms.starts_with("rw") || !vma.perms.ends_with('s') {
            return Err(wrong(format!("is {} (needs rw and shared)", vma.perms)));
        }
        if vma.inode != st.st_ino as u64 || file_offset != expected {
            return Err(wrong(format!(
                "maps inode {} at offset {file_offset:#x}, not the shared file (inode {}) at {expected:#x}",
                vma.inode, st.st_ino
            )));
        }
        covered = vma.end;
    }
    if covered < end {
        return Err(wrong(format!("is not mapped from {covered:#x}")));
    }
    Ok(())
}

/// The fields of a `/proc/self/maps` line the check needs.
struct MapsLine<'a> {
    start: usize,
    end: usize,
    perms: &'a str,
    offset: u64,
    inode: u64,
}

impl<'a> MapsLine<'a> {
    fn parse(line: &'a str) -> Option<Self> {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let perms = fields.next()?;
        let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
        let _dev = fields.next()?;
        let inode = fields.next()?.parse().ok()?;
        Some(Self {
            start: usize::from_str_radix(start, 16).ok()?,
            end: usize::from_str_radix(end, 16).ok()?,
            perms,
            offset,
            inode,
        })
    }
}

/// A read-write `MAP_SHARED` mapping of a file range, unmapped on drop.
#[derive(Debug)]
pub(crate) struct FileMap {
    base: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: the mapping is plain memory owned by this value; its bytes are
// only ever accessed through raw pointers under the page-state protocol of
// `super::state`, never through references handed out by this type.
unsafe impl Send for FileMap {}
// SAFETY: as above.
unsafe impl Sync for FileMap {}

impl FileMap {
    /// Maps `len_bytes` of `fd` from `offset_bytes`; `unit_bytes` is the
    /// file's page size (transparent huge pages are kept out of a 4 KiB
    /// one).
    pub(crate) fn new(
        fd: &OwnedFd,
        offset_bytes: u64,
        len_bytes: usize,
        unit_bytes: usize,
    ) -> Result<Self, GuestMemoryError> {
        // SAFETY: a new shared mapping of a file we hold, with no address
        // hint: it touches no existing memory; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset_bytes as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(GuestMemoryError::Memory {
                op: "mmap(MAP_SHARED)",
                source: io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| GuestMemoryError::Memory {
            op: "mmap(MAP_SHARED)",
            source: io::Error::other("mmap returned null"),
        })?;
        let map = Self { base, len_bytes };
        if unit_bytes != crate::PAGE_SIZE {
            return Ok(map);
        }
        // 4 KiB faults, write protection and eviction: no transparent huge
        // pages (shmem may have them, per /sys/kernel/mm/transparent_hugepage/shmem_enabled).
        // SAFETY: advice on a mapping we own; it changes no contents.
        let ret = unsafe { libc::madvise(ptr, len_bytes, libc::MADV_NOHUGEPAGE) };
        cvt(ret).map_err(|source| GuestMemoryError::Memory {
            op: "madvise(MADV_NOHUGEPAGE)",
            source,
        })?;
        Ok(map)
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub(crate) fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: `base`/`len_bytes` are exactly what mmap returned, and the
        // mapping is being dropped, so nothing uses it any more.
        let ret = unsafe { libc::munmap(self.base.as_ptr().cast(), self.len_bytes) };
        if let Err(err) = cvt(ret) {
            tracing::warn!(%err, "munmap of a shared guest mapping failed");
        }
    }
}
