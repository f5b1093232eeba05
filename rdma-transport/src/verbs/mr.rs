//! Memory regions and their access flags.

use std::ops::BitOr;
use std::sync::Arc;

use super::error::{check_ptr, note_destroy_failure, rc_to_io, VerbsError};
use super::generated::{ibv_access_flags, ibv_mr};
use super::pd::{PdInner, ProtectionDomain};
use super::wr::Sge;

/// `enum ibv_access_flags`: what the device may do with an MR or a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// The device may write local memory (needed for RDMA READ targets and
    /// receive buffers).
    pub const LOCAL_WRITE: Self = Self(ibv_access_flags::IBV_ACCESS_LOCAL_WRITE);
    /// Remote peers may RDMA WRITE into the memory.
    pub const REMOTE_WRITE: Self = Self(ibv_access_flags::IBV_ACCESS_REMOTE_WRITE);
    /// Remote peers may RDMA READ the memory.
    pub const REMOTE_READ: Self = Self(ibv_access_flags::IBV_ACCESS_REMOTE_READ);
    /// Remote peers may run atomics on the memory.
    pub const REMOTE_ATOMIC: Self = Self(ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC);
    /// Memory windows may be bound over the MR (`IBV_ACCESS_MW_BIND`).
    pub const MW_BIND: Self = Self(ibv_access_flags::IBV_ACCESS_MW_BIND);

    /// No access beyond local reads.
    pub const fn empty() -> Self {
        Self(0)
    }

    /// The raw `ibv_access_flags` bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Both sets of flags (a `const` `|`).
    #[must_use]
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for AccessFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

/// A registered memory region. The registration is dropped (`ibv_dereg_mr`)
/// with the last clone.
#[derive(Debug, Clone)]
pub struct MemoryRegion {
    inner: Arc<MrInner>,
}

#[derive(Debug)]
struct MrInner {
    pd: Arc<PdInner>,
    mr: *mut ibv_mr,
    addr: *mut u8,
    len: usize,
    lkey: u32,
    rkey: u32,
}

// SAFETY: verbs are thread-safe; the MR pointer is freed once, in Drop, and
// `addr` is only handed out, never dereferenced here.
unsafe impl Send for MrInner {}
// SAFETY: as for Send.
unsafe impl Sync for MrInner {}

impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: `mr` came from `ibv_reg_mr` and is deregistered once.
        let rc = unsafe { self.pd.ctx.verbs.lib().ibv_dereg_mr(self.mr) };
        if rc != 0 {
            note_destroy_failure();
            tracing::warn!(device = %self.pd.ctx.name, error = %rc_to_io(rc), "ibv_dereg_mr failed");
        }
    }
}

impl ProtectionDomain {
    /// Registers `len` bytes at `addr` with `ibv_reg_mr`.
    ///
    /// # Safety
    /// - `addr..addr+len` must stay allocated (and mapped) until the returned
    ///   MR and all its clones are dropped: the device reads and writes it by
    ///   DMA without Rust knowing.
    /// - With `LOCAL_WRITE`/`REMOTE_WRITE` the device (or a remote peer) may
    ///   write the memory at any time while the MR lives: the caller must
    ///   access it only in ways that tolerate that (raw pointers or atomics,
    ///   and only after a completion says a transfer is done), never through
    ///   `&`/`&mut` references that assume no concurrent change.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `ibv_reg_mr` (ENOMEM often means
    /// `ulimit -l` is too low).
    pub unsafe fn register_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion, VerbsError> {
        let access_bits = i32::try_from(access.bits()).map_err(|_| {
            VerbsError::InvalidArgument(format!("access flags {:#x}", access.bits()))
        })?;
        // SAFETY: live PD; the caller guarantees the region per this fn's
        // contract. The plain `ibv_reg_mr` symbol is what verbs.h's inline
        // `__ibv_reg_mr` calls when no optional access flag is set, and
        // `AccessFlags` has none of them.
        let mr = check_ptr("ibv_reg_mr", unsafe {
            self.inner
                .ctx
                .verbs
                .lib()
                .ibv_reg_mr(self.inner.pd, addr.cast(), len, access_bits)
        })?;
        // SAFETY: `mr` is a live MR just returned by the library, and nothing
        // else mutates it.
        let mr_ref = unsafe { &*mr };
        let (lkey, rkey) = (mr_ref.lkey, mr_ref.rkey);
        Ok(MemoryRegion {
            inner: Arc::new(MrInner {
                pd: Arc::clone(&self.inner),
                mr,
                addr,
                len,
                lkey,
                rkey,
            }),
        })
    }
}

impl MemoryRegion {
    /// The library's MR, for work requests that name it (memory window
    /// binds).
    pub(crate) fn raw(&self) -> *mut ibv_mr {
        self.inner.mr
    }

    /// Local key, for scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }

    /// Remote key, given to peers for RDMA READ/WRITE into this region.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }

    /// Start of the region.
    pub fn addr(&self) -> *mut u8 {
        self.inner.addr
    }

    /// Length of the region, bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// A scatter/gather entry for `len` bytes at `offset` into the region,
    /// or `None` when that range is not inside it (or `len` exceeds `u32`).
    pub fn sge(&self, offset: usize, len: usize) -> Option<Sge> {
        let end = offset.checked_add(len)?;
        if end > self.inner.len {
            return None;
        }
        let len = u32::try_from(len).ok()?;
        let addr = (self.inner.addr as usize).checked_add(offset)?;
        Some(Sge::new(addr as u64, len, self.inner.lkey))
    }
}
