//! Caller memory registered with the RDMA device: RDMA reads land in it and
//! writes go out of it directly, without a pool frame (see
//! `rdma/registry.rs` for the table, `rdma_single.rs` and `rdma_batch.rs`
//! for the data paths).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::TransportManager;
use crate::rdma::{RegisterError, RegisteredMemory};

/// How many pages RDMA moved straight from or into registered caller
/// memory, and how many through a pool frame (a bounce, or `read_frame`),
/// both zero on a host without RDMA; and how many TCP answers were read
/// from the socket straight into their page.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZeroCopyStats {
    /// Regions registered now.
    pub regions: usize,
    /// Pages RDMA moved with no pool frame (requests that succeeded).
    pub direct_pages: u64,
    /// Pages RDMA moved through a pool frame (requests that succeeded).
    pub framed_pages: u64,
    /// Failed requests on registered memory whose QP was drained (every
    /// work request on it finished) before the call returned.
    pub drains: u64,
    /// Drains that could not be confirmed (marker not posted or not
    /// completed in time: the device might still write those pages).
    pub drain_failures: u64,
    /// Pages of asynchronous reads that TCP read from the socket straight
    /// into their destination (the caller's or guest memory), with no copy
    /// out of a receive buffer. (Other TCP answers are copied once.)
    pub tcp_direct_pages: u64,
}

impl TransportManager {
    /// Registers `len` bytes at `ptr` with the RDMA device, once: from then
    /// on, pages of reads and writes (blocking or asynchronous) whose
    /// buffer lies wholly inside the range move by RDMA straight into or
    /// out of it, with no pool frame and no copy. Other buffers still go
    /// through the pool. Ranges may not overlap. On a host without RDMA
    /// (or with `TransportKind::Tcp`) this registers nothing and returns a
    /// handle whose [`RegisteredMemory::is_rdma`] is false: TCP reads
    /// straight into the caller's memory anyway.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped (readable and writable) until the
    /// returned handle is dropped and every read or write whose buffer lies
    /// in it has returned (or, asynchronously, completed or been
    /// cancelled). While a read into it is in flight the device writes it
    /// by DMA: as with any read, the caller must not rely on the contents
    /// of a page being read before the read returns.
    ///
    /// # Errors
    /// [`RegisterError::InvalidRange`] (null, empty or wrapping),
    /// [`RegisterError::Overlap`] with a registered range,
    /// [`RegisterError::Device`] when `ibv_reg_mr` fails (often
    /// `ulimit -l`).
    pub unsafe fn register_memory(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<RegisteredMemory, RegisterError> {
        let start = ptr as usize;
        let Some(rdma) = self.inner.rdma.as_ref() else {
            if ptr.is_null() || len == 0 || start.checked_add(len).is_none() {
                return Err(RegisterError::InvalidRange { start, len });
            }
            return Ok(RegisteredMemory::new(None, start, len));
        };
        let device = &rdma.device;
        // SAFETY: this function's contract is `register`'s: the range stays
        // mapped until the handle is dropped and no request refers to it.
        let id = unsafe { device.register(ptr, len) }?;
        tracing::debug!(
            addr = start,
            len,
            "caller memory registered for zero-copy RDMA"
        );
        Ok(RegisteredMemory::new(
            Some((Arc::clone(&device.registry), id)),
            start,
            len,
        ))
    }

    /// Counts of pages moved with and without a bounce through the pool.
    pub fn zero_copy_stats(&self) -> ZeroCopyStats {
        let mut stats = ZeroCopyStats {
            tcp_direct_pages: self.inner.tcp_landed_pages.load(Ordering::Relaxed),
            ..ZeroCopyStats::default()
        };
        if let Some(rdma) = self.inner.rdma.as_ref() {
            let registry = &rdma.device.registry;
            stats.regions = registry.len();
            stats.direct_pages = registry.direct_pages.load(Ordering::Relaxed);
            stats.framed_pages = registry.framed_pages.load(Ordering::Relaxed);
            stats.drains = registry.drains.load(Ordering::Relaxed);
            stats.drain_failures = registry.drain_failures.load(Ordering::Relaxed);
        }
        stats
    }
}
