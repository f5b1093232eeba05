//! The unit everything moves: one 4 KiB page.

/// Size of a guest page in bytes. Every READ and WRITE moves exactly this much.
pub const PAGE_SIZE: usize = 4096;

/// [`PAGE_SIZE`] as a `u64`, for address arithmetic.
pub const PAGE_SIZE_U64: u64 = PAGE_SIZE as u64;

/// One page of memory.
pub type Page = [u8; PAGE_SIZE];

/// True when `addr` is a multiple of [`PAGE_SIZE`].
pub const fn is_page_aligned(addr: u64) -> bool {
    addr % PAGE_SIZE_U64 == 0
}
