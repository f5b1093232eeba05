//! The VMM's own mapping of a shared-memory file, as a vhost-user back-end
//! or a hypervisor handing its userfaultfd over has it.

use std::os::fd::{AsRawFd, OwnedFd};

use rdma_transport::PAGE_SIZE;

/// The VMM's own mapping of the file (as a vhost-user back-end would have).
pub struct VmmView {
    pub ptr: *mut u8,
    pub len_bytes: usize,
}

impl VmmView {
    pub fn new(fd: &OwnedFd, len_bytes: usize) -> Self {
        // SAFETY: a new shared mapping of our memfd; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Self {
            ptr: ptr.cast(),
            len_bytes,
        }
    }

    pub fn page(&self, index: usize) -> Vec<u8> {
        assert!((index + 1) * PAGE_SIZE <= self.len_bytes);
        let mut out = vec![0u8; PAGE_SIZE];
        let src = self.ptr.wrapping_add(index * PAGE_SIZE);
        // SAFETY: inside our live mapping; raw bytes copied out.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), PAGE_SIZE) };
        out
    }

    pub fn fill(&self, index: usize, byte: u8) {
        assert!((index + 1) * PAGE_SIZE <= self.len_bytes);
        let dst = self.ptr.wrapping_add(index * PAGE_SIZE);
        // SAFETY: inside our live mapping.
        unsafe { std::ptr::write_bytes(dst, byte, PAGE_SIZE) };
    }
}

impl Drop for VmmView {
    fn drop(&mut self) {
        // SAFETY: exactly what mmap returned, unused after this.
        unsafe { libc::munmap(self.ptr.cast(), self.len_bytes) };
    }
}
