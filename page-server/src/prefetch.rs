//! Touches, ahead of time, the region pages that one `writev` is about to
//! send, before the kernel copies them one after the other into the
//! socket. A random page of the region is rarely in this core's caches or
//! its TLB; the kernel's copy meets each page's first miss (and its
//! address translation) in turn, while prefetches issued together overlap
//! them. One prefetch per page, of its first cache line, gains as much as
//! prefetching all 64 lines: depth-32 reads on one CPU went from 679-688
//! to 725-738 thousand pages/s with either (docs/benchmarking.md, "One
//! read of each connection per step; the page-server prefetches a batch's
//! pages"). A lone answer neither gains nor loses (5.5-5.6 µs a read either
//! way).

/// Prefetches the cache line at `at` (the start of a region page) into
/// every cache level.
#[cfg(target_arch = "x86_64")]
pub(crate) fn first_line(at: *const u8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    // SAFETY: a prefetch is a hint: it never faults and reads nothing the
    // program sees, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast()) }
}

/// Elsewhere, nothing.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn first_line(_at: *const u8) {}
