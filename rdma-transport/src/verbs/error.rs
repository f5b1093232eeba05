//! The one error type of the verbs layer, and the helpers that turn a verb's
//! C return convention into it (written once, like mio's `syscall!`).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use super::cq::WcStatus;

/// Everything that can go wrong in the verbs layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// `dlopen` of libibverbs failed: rdma-core is not installed.
    #[error("{library} not found: install rdma-core (Debian/Ubuntu: apt-get install rdma-core ibverbs-providers)")]
    LibraryNotFound {
        /// The library name passed to `dlopen`.
        library: String,
        /// What the dynamic loader said.
        #[source]
        source: libloading::Error,
    },
    /// libibverbs was found but lacks a function this crate needs.
    #[error("{library} has no symbol {symbol}: rdma-core is too old for this build")]
    MissingSymbol {
        /// The library that was opened.
        library: String,
        /// The missing function.
        symbol: &'static str,
    },
    /// A verb failed; `verb` is its C name, `source` carries the errno.
    #[error("{verb} failed: {source}")]
    Verb {
        /// The C name of the verb, e.g. `"ibv_modify_qp"`.
        verb: &'static str,
        /// The errno the verb reported.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_send` / `ibv_post_recv` rejected work request `index` of the
    /// posted batch; the requests before it were posted.
    #[error("{verb} rejected work request {index} of the batch: {source}")]
    Post {
        /// `"ibv_post_send"` or `"ibv_post_recv"`.
        verb: &'static str,
        /// Index in the caller's slice of the first request not posted.
        index: usize,
        /// The errno the provider returned.
        #[source]
        source: io::Error,
    },
    /// A work request completed with an error status. The QP is now in the
    /// error state: destroy and recreate it (on both sides).
    #[error("work request {wr_id} completed with {status} (vendor error {vendor_err:#x})")]
    WorkCompletion {
        /// The `wr_id` the request was posted with.
        wr_id: u64,
        /// The completion status.
        status: WcStatus,
        /// The provider-specific error code.
        vendor_err: u32,
    },
    /// No RDMA device is present (or the kernel has no RDMA support).
    #[error("no RDMA device found (is the rdma kernel driver loaded, e.g. `rdma link add rxe0 type rxe netdev lo`?)")]
    NoDevice,
    /// The named device does not exist.
    #[error("RDMA device {name:?} not found; devices present: [{available}]")]
    DeviceNotFound {
        /// The requested name.
        name: String,
        /// Comma-separated names of the devices found.
        available: String,
    },
    /// No IPv4-mapped RoCE v2 GID on this port.
    #[error("no IPv4-mapped RoCE v2 GID on {device} port {port}; give the GID index explicitly")]
    NoRoceV2Gid {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
    },
    /// A caller-supplied value is out of range for the verb.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl VerbsError {
    /// The errno carried by this error, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Verb { source, .. } | Self::Post { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// The current `errno` as an `io::Error`; a verb that returned failure without
/// setting errno gets a descriptive error instead of "Success".
pub(crate) fn last_errno() -> io::Error {
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(0) {
        io::Error::other("the verb reported failure without setting errno")
    } else {
        err
    }
}

/// A verb that returns an object pointer, NULL with errno set on failure.
pub(crate) fn check_ptr<T>(verb: &'static str, ptr: *mut T) -> Result<*mut T, VerbsError> {
    if ptr.is_null() {
        Err(VerbsError::Verb {
            verb,
            source: last_errno(),
        })
    } else {
        Ok(ptr)
    }
}

/// A verb that returns 0 on success and either a positive errno or -1 with
/// errno set on failure (libibverbs uses both conventions).
pub(crate) fn check_rc(verb: &'static str, rc: i32) -> Result<(), VerbsError> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(VerbsError::Verb {
            verb,
            source: io::Error::from_raw_os_error(rc),
        }),
        _ => Err(VerbsError::Verb {
            verb,
            source: last_errno(),
        }),
    }
}

/// The errno of a failed verb for logging from `Drop`.
pub(crate) fn rc_to_io(rc: i32) -> io::Error {
    if rc > 0 {
        io::Error::from_raw_os_error(rc)
    } else {
        last_errno()
    }
}

/// Destroy verbs (`ibv_dereg_mr`, `ibv_dealloc_mw`, ...) that failed in a
/// `Drop` since the process started.
static DESTROY_FAILURES: AtomicU64 = AtomicU64::new(0);

/// Counts a failed destroy verb (its `Drop` logs it too).
pub(crate) fn note_destroy_failure() {
    DESTROY_FAILURES.fetch_add(1, Ordering::Relaxed);
}

/// How many verbs objects failed to be destroyed in their `Drop` (each is
/// logged as a warning): a leak a long-running server can report.
pub fn destroy_failures() -> u64 {
    DESTROY_FAILURES.load(Ordering::Relaxed)
}
