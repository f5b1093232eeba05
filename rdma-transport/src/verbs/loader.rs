//! Loading libibverbs with `dlopen` at run time.

use std::fmt;
use std::sync::{Arc, OnceLock};

use super::error::VerbsError;
use super::generated::IbvLib;

/// The soname opened by [`Verbs::load`].
pub const LIBIBVERBS: &str = "libibverbs.so.1";

/// An opened libibverbs: the table of its functions. Every verbs object keeps
/// an `Arc<Verbs>`, so the library stays loaded while any object lives.
pub struct Verbs {
    lib: IbvLib,
    library: String,
}

static GLOBAL: OnceLock<Arc<Verbs>> = OnceLock::new();

/// Checks at load time that every function this crate calls through the
/// generated table is present, so the generated call wrappers (which panic
/// on a missing symbol) can never panic.
macro_rules! require_symbols {
    ($lib:expr, $library:expr, [$($sym:ident),* $(,)?]) => {
        $(
            if $lib.$sym.is_err() {
                return Err(VerbsError::MissingSymbol {
                    library: $library.to_owned(),
                    symbol: stringify!($sym),
                });
            }
        )*
    };
}

impl Verbs {
    /// Opens `libibverbs.so.1` once per process and returns the shared handle.
    ///
    /// # Errors
    /// [`VerbsError::LibraryNotFound`] when rdma-core is not installed,
    /// [`VerbsError::MissingSymbol`] when it is too old. A failure is not
    /// cached: a later call tries again.
    pub fn load() -> Result<Arc<Self>, VerbsError> {
        if let Some(verbs) = GLOBAL.get() {
            return Ok(Arc::clone(verbs));
        }
        let verbs = Self::load_from(LIBIBVERBS)?;
        // Another thread may have won the race; either handle is fine.
        Ok(Arc::clone(GLOBAL.get_or_init(|| verbs)))
    }

    /// Opens the library `library` (a soname or a path) without caching.
    /// [`Verbs::load`] is this with [`LIBIBVERBS`]; tests use it to check the
    /// error for a missing library.
    ///
    /// # Errors
    /// As for [`Verbs::load`].
    pub fn load_from(library: &str) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: loading libibverbs runs its ELF constructors, which only
        // initialise its own state (rdma-core has no constructors with
        // preconditions on the caller), and every symbol the generated
        // `from_library` resolves is typed from the same verbs.h the library
        // was built from.
        let lib =
            unsafe { IbvLib::new(library) }.map_err(|source| VerbsError::LibraryNotFound {
                library: library.to_owned(),
                source,
            })?;
        require_symbols!(
            lib,
            library,
            [
                ibv_get_device_list,
                ibv_free_device_list,
                ibv_get_device_name,
                ibv_get_device_guid,
                ibv_open_device,
                ibv_close_device,
                ibv_query_device,
                ibv_query_port,
                ibv_query_gid,
                ibv_alloc_pd,
                ibv_dealloc_pd,
                ibv_reg_mr,
                ibv_dereg_mr,
                ibv_create_comp_channel,
                ibv_destroy_comp_channel,
                ibv_create_cq,
                ibv_destroy_cq,
                ibv_get_cq_event,
                ibv_ack_cq_events,
                ibv_create_qp,
                ibv_modify_qp,
                ibv_query_qp,
                ibv_destroy_qp,
                ibv_wc_status_str,
            ]
        );
        Ok(Arc::new(Self {
            lib,
            library: library.to_owned(),
        }))
    }

    /// The name the library was opened under.
    pub fn library_name(&self) -> &str {
        &self.library
    }

    /// The generated function table. Only the functions checked in
    /// [`Verbs::load_from`] may be called through its methods; others must be
    /// reached through their `Result` field.
    pub(crate) fn lib(&self) -> &IbvLib {
        &self.lib
    }
}

impl fmt::Debug for Verbs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verbs")
            .field("library", &self.library)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_a_clear_error() {
        let err = Verbs::load_from("libibverbs-absent-for-test.so.1").unwrap_err();
        assert!(
            matches!(err, VerbsError::LibraryNotFound { ref library, .. } if library == "libibverbs-absent-for-test.so.1"),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("not found: install rdma-core"), "{msg}");
    }
}
