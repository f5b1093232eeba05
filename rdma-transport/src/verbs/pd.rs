//! Protection domains.

use std::sync::Arc;

use super::context::{Context, ContextInner};
use super::error::{check_ptr, note_destroy_failure, rc_to_io, VerbsError};
use super::generated::ibv_pd;

/// A protection domain: MRs and QPs created in it may be used together.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

#[derive(Debug)]
pub(crate) struct PdInner {
    pub(crate) ctx: Arc<ContextInner>,
    pub(crate) pd: *mut ibv_pd,
}

// SAFETY: verbs are thread-safe; the pointer is freed once, in Drop.
unsafe impl Send for PdInner {}
// SAFETY: as for Send.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: `pd` came from `ibv_alloc_pd`; MRs and QPs hold an
        // `Arc<PdInner>`, so none is left.
        let rc = unsafe { self.ctx.verbs.lib().ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            note_destroy_failure();
            tracing::warn!(device = %self.ctx.name, error = %rc_to_io(rc), "ibv_dealloc_pd failed");
        }
    }
}

impl Context {
    /// `ibv_alloc_pd`.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming the verb.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain, VerbsError> {
        // SAFETY: live context.
        let pd = check_ptr("ibv_alloc_pd", unsafe {
            self.inner.verbs.lib().ibv_alloc_pd(self.inner.ctx)
        })?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                ctx: Arc::clone(&self.inner),
                pd,
            }),
        })
    }
}

impl ProtectionDomain {
    /// The context the PD belongs to.
    pub fn context(&self) -> Context {
        Context {
            inner: Arc::clone(&self.inner.ctx),
        }
    }
}
