//! Type-2 memory windows: a remote key over part of an MR that works only
//! on the one QP it was bound on, and only until it is deallocated.
//!
//! A window is allocated in a PD ([`ProtectionDomain::alloc_mw_type2`]),
//! then bound with a [`SendWr::bind_mw`] work request posted on the QP that
//! is to use it; the bind names the window's next rkey
//! ([`MemoryWindow::next_rkey`]), and once its completion is polled
//! successfully [`MemoryWindow::set_bound_rkey`] records it. Dropping the
//! window deallocates it (`ibv_dealloc_mw`): its rkey stops working at once.
//!
//! `ibv_alloc_mw` and `ibv_dealloc_mw` are inline functions in verbs.h that
//! call `context->ops.alloc_mw` / `dealloc_mw`; they are called the same way
//! here.

use std::sync::Arc;

use super::error::{check_ptr, note_destroy_failure, rc_to_io, VerbsError};
use super::generated::{ibv_mw, ibv_mw_type};
use super::pd::{PdInner, ProtectionDomain};

/// A type-2 memory window (`struct ibv_mw`), deallocated on drop. Not
/// `Clone`: binding it changes its rkey, which takes `&mut self`.
#[derive(Debug)]
pub struct MemoryWindow {
    pd: Arc<PdInner>,
    mw: *mut ibv_mw,
}

// SAFETY: verbs are thread-safe; the pointer is freed once, in Drop, and the
// only field written through it (`rkey`, in `set_bound_rkey`) is written
// under `&mut self`.
unsafe impl Send for MemoryWindow {}
// SAFETY: as for Send: shared references only read.
unsafe impl Sync for MemoryWindow {}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // The window's context (`mw->context`, which verbs.h's inline
        // uses) is the PD's.
        let ctx = self.pd.ctx.ctx;
        // SAFETY: live context (the PD, held here, holds it); the ops table
        // never changes after open.
        let dealloc = unsafe { (*ctx).ops.dealloc_mw };
        let Some(dealloc) = dealloc else {
            // alloc_mw succeeded through the same table, so a provider with
            // no dealloc_mw is broken: leak the window rather than guess.
            note_destroy_failure();
            tracing::warn!(device = %self.pd.ctx.name, "the provider has no dealloc_mw; memory window leaked");
            return;
        };
        // SAFETY: `mw` came from `alloc_mw` and is deallocated once.
        let rc = unsafe { dealloc(self.mw) };
        if rc != 0 {
            note_destroy_failure();
            tracing::warn!(device = %self.pd.ctx.name, error = %rc_to_io(rc), "ibv_dealloc_mw failed");
        }
    }
}

impl ProtectionDomain {
    /// Allocates a type-2 memory window (`ibv_alloc_mw(pd, IBV_MW_TYPE_2)`).
    /// It grants nothing until it is bound.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `ibv_alloc_mw`: `Unsupported` when the
    /// provider has no memory windows, otherwise the errno (EINVAL or
    /// EOPNOTSUPP: the device has no type-2 windows).
    pub fn alloc_mw_type2(&self) -> Result<MemoryWindow, VerbsError> {
        let ctx = self.inner.ctx.ctx;
        // SAFETY: live context; the ops table never changes after open.
        let alloc = unsafe { (*ctx).ops.alloc_mw };
        let Some(alloc) = alloc else {
            return Err(VerbsError::Verb {
                verb: "ibv_alloc_mw",
                source: std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "the provider does not implement memory windows",
                ),
            });
        };
        // SAFETY: live PD of this context.
        let mw = check_ptr("ibv_alloc_mw", unsafe {
            alloc(self.inner.pd, ibv_mw_type::IBV_MW_TYPE_2)
        })?;
        Ok(MemoryWindow {
            pd: Arc::clone(&self.inner),
            mw,
        })
    }
}

impl MemoryWindow {
    /// The window's current rkey: after [`Self::set_bound_rkey`], the one a
    /// peer uses; before any bind, one that grants nothing.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live window; `rkey` is only written under `&mut self`.
        unsafe { (*self.mw).rkey }
    }

    /// The rkey to name in the next bind: the current one with its low 8
    /// bits (the key the consumer owns) incremented, as verbs.h's
    /// `ibv_inc_rkey` computes it. The upper 24 bits index the window and
    /// stay.
    pub fn next_rkey(&self) -> u32 {
        let rkey = self.rkey();
        (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
    }

    /// Records `rkey` as the window's rkey once its bind completed
    /// successfully (for a type-2 window the library does not track it: a
    /// later bind or invalidation names the current rkey).
    pub fn set_bound_rkey(&mut self, rkey: u32) {
        // SAFETY: live window; `&mut self` makes this the only access.
        unsafe { (*self.mw).rkey = rkey };
    }

    /// Whether the window belongs to `pd`.
    pub fn is_in(&self, pd: &ProtectionDomain) -> bool {
        Arc::ptr_eq(&self.pd, &pd.inner)
    }

    pub(crate) fn raw(&self) -> *mut ibv_mw {
        self.mw
    }
}
