//! The userfaultfd ABI of `<linux/userfaultfd.h>`, taken from `linux-raw-sys`
//! (generated from the kernel headers, no build script), plus the three
//! numbers its ioctl table lacks, computed here from the header's own
//! definitions and checked against the ones it has.

pub(crate) use linux_raw_sys::general::{
    uffd_msg, uffd_msg__bindgen_ty_1, uffd_msg__bindgen_ty_1__bindgen_ty_5, uffdio_api,
    uffdio_continue, uffdio_copy, uffdio_poison, uffdio_range, uffdio_register,
    uffdio_writeprotect, _UFFDIO_POISON, UFFDIO_COPY_MODE_DONTWAKE, UFFDIO_COPY_MODE_WP,
    UFFDIO_REGISTER_MODE_MINOR, UFFDIO_REGISTER_MODE_MISSING, UFFDIO_REGISTER_MODE_WP, UFFD_API,
    UFFD_EVENT_PAGEFAULT, UFFD_PAGEFAULT_FLAG_MINOR, UFFD_PAGEFAULT_FLAG_WP,
    UFFD_PAGEFAULT_FLAG_WRITE, UFFD_USER_MODE_ONLY, USERFAULTFD_IOC,
};
pub(crate) use linux_raw_sys::ioctl::{
    UFFDIO_API, UFFDIO_CONTINUE, UFFDIO_COPY, UFFDIO_REGISTER, UFFDIO_WAKE, UFFDIO_WRITEPROTECT,
};

/// `_IOC(dir, USERFAULTFD_IOC, nr, size)` of `<asm-generic/ioctl.h>`.
const fn ioc(dir: u32, nr: u32, size_bytes: usize) -> u32 {
    (dir << 30) | ((size_bytes as u32) << 16) | (USERFAULTFD_IOC << 8) | nr
}

const IOC_NONE: u32 = 0;
const IOC_READ_WRITE: u32 = 3;

/// `_IOWR(UFFDIO, _UFFDIO_POISON, struct uffdio_poison)` (Linux >= 6.6).
pub(crate) const UFFDIO_POISON: u32 = ioc(
    IOC_READ_WRITE,
    _UFFDIO_POISON,
    std::mem::size_of::<uffdio_poison>(),
);

/// `_IO(USERFAULTFD_IOC, 0x00)`: on `/dev/userfaultfd` (Linux >= 6.1),
/// returns a new userfaultfd.
pub(crate) const USERFAULTFD_IOC_NEW: u32 = ioc(IOC_NONE, 0, 0);

/// `UFFDIO_WRITEPROTECT_MODE_WP`: set (rather than clear) write protection.
pub(crate) const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
/// `UFFDIO_WRITEPROTECT_MODE_DONTWAKE`: clear without waking the waiters.
pub(crate) const UFFDIO_WRITEPROTECT_MODE_DONTWAKE: u64 = 1 << 1;

/// `UFFDIO_CONTINUE_MODE_DONTWAKE`: map the pages without waking their
/// waiters.
pub(crate) const UFFDIO_CONTINUE_MODE_DONTWAKE: u64 = 1 << 0;
/// `UFFDIO_CONTINUE_MODE_WP` of `<linux/userfaultfd.h>` (Linux >= 6.4): map
/// the pages write-protected.
pub(crate) const UFFDIO_CONTINUE_MODE_WP: u64 = 1 << 1;

#[cfg(test)]
mod tests {
    use std::mem::size_of;

    use linux_raw_sys::general::{_UFFDIO_API, _UFFDIO_COPY, _UFFDIO_WRITEPROTECT};

    use super::*;

    #[test]
    fn computed_numbers_match_the_generated_ones() {
        assert_eq!(
            ioc(IOC_READ_WRITE, _UFFDIO_COPY, size_of::<uffdio_copy>()),
            UFFDIO_COPY
        );
        assert_eq!(
            ioc(IOC_READ_WRITE, _UFFDIO_API, size_of::<uffdio_api>()),
            UFFDIO_API
        );
        assert_eq!(
            ioc(
                IOC_READ_WRITE,
                _UFFDIO_WRITEPROTECT,
                size_of::<uffdio_writeprotect>()
            ),
            UFFDIO_WRITEPROTECT
        );
        // The values of <linux/userfaultfd.h> on x86_64.
        assert_eq!(UFFDIO_POISON, 0xc020_aa08);
        assert_eq!(USERFAULTFD_IOC_NEW, 0xaa00);
        assert_eq!(size_of::<uffd_msg>(), 32);
    }
}
