//! Status codes, the per-thread last error message, and the guard every
//! entry point runs its body in (no panic crosses the C boundary).

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use rdma_transport::guest_memory::GuestMemoryError;
use rdma_transport::TransportError;

/// Result of every fallible call. `RT_STATUS_OK` is 0; on any other value
/// `rt_last_error()` tells what happened, on the calling thread.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtStatus {
    /// Success.
    Ok = 0,
    /// A null pointer, bad size or bad configuration value (including a
    /// shared file guest RAM cannot live in: not shared memory, not open
    /// read-write, or too small).
    InvalidArgument = 1,
    /// No node owns the guest-physical address.
    UnknownGpa = 2,
    /// The address or length is not 4096-byte aligned.
    Unaligned = 3,
    /// The owner node is down or its connection was lost.
    NodeDown = 4,
    /// The request's deadline passed.
    Timeout = 5,
    /// The node refused the request.
    Refused = 6,
    /// The node broke the wire protocol.
    Protocol = 7,
    /// The coordinator could not be asked.
    Coordinator = 8,
    /// The page pool could not be set up or is exhausted.
    Pool = 9,
    /// The range is outside the guest memory region, or a node index is
    /// past the last node of the map.
    OutOfRange = 10,
    /// Dirty pages could not be written back (they stay dirty and mapped).
    WriteBack = 11,
    /// The kernel lacks a needed feature (userfaultfd write-protect, RDMA).
    Unsupported = 12,
    /// A system call failed.
    System = 13,
    /// A bug in the library (a caught panic).
    Internal = 14,
    /// The process may not do what was asked: kernel-mode userfaultfd
    /// faults (`RT_FAULT_MODE_KERNEL_AND_USER`) need CAP_SYS_PTRACE,
    /// sysctl vm.unprivileged_userfaultfd=1 or access to /dev/userfaultfd.
    Permission = 15,
    /// A config's `struct_size` is not a size this library knows (set it
    /// to `sizeof` the struct; the `_config_default` functions do).
    StructSize = 16,
    /// A page-server could not prove the cluster key (a squatter, another
    /// cluster, a server without a key) or refused this client's proof.
    AuthFailed = 17,
    /// The range's contents were lost: its page-server restarted (empty
    /// memory) since they were written, and no live replica holds them. No
    /// page was read or written; an operator must re-initialise the range
    /// before it is served again. Also a page of coherent guest memory whose
    /// latest writes died with the node that owned it.
    DataLost = 18,
    /// A page failed its end-to-end checksum (CRC-32C) on its way to or from
    /// the node: it was not delivered (READ) or not applied (WRITE).
    Checksum = 19,
    /// A write reached a live replica of its range, but another replica
    /// missed it and could not be marked stale (coordinator unreachable):
    /// not reported done. Writing the page again is safe.
    ReplicaMissedWrite = 20,
}

impl RtStatus {
    const ALL: [Self; 21] = [
        Self::Ok,
        Self::InvalidArgument,
        Self::UnknownGpa,
        Self::Unaligned,
        Self::NodeDown,
        Self::Timeout,
        Self::Refused,
        Self::Protocol,
        Self::Coordinator,
        Self::Pool,
        Self::OutOfRange,
        Self::WriteBack,
        Self::Unsupported,
        Self::System,
        Self::Internal,
        Self::Permission,
        Self::StructSize,
        Self::AuthFailed,
        Self::DataLost,
        Self::Checksum,
        Self::ReplicaMissedWrite,
    ];

    fn from_i32(value: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|s| *s as i32 == value)
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error and returns `status`.
pub(crate) fn fail(status: RtStatus, message: impl std::fmt::Display) -> RtStatus {
    let text = message.to_string().replace('\0', " ");
    let c = CString::new(text).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
    status
}

/// Runs `f` on the handle at `handle` (an entry point's body, under
/// [`guard`]); `what` names it in the error when it is NULL. The entry
/// points' callers promise NULL or a live handle.
pub(crate) fn with_handle<H>(
    handle: *const H,
    what: &str,
    f: impl FnOnce(&H) -> RtStatus,
) -> RtStatus {
    guard(|| {
        // SAFETY: the entry points' contract: NULL or a live handle.
        match unsafe { handle.as_ref() } {
            Some(h) => f(h),
            None => fail(RtStatus::InvalidArgument, format!("{what} is NULL")),
        }
    })
}

/// A count (pages written, dropped) for the caller's optional `out`, or
/// the error.
pub(crate) fn counted<E: std::error::Error>(
    result: Result<u64, E>,
    out: *mut u64,
    status: impl FnOnce(&E) -> RtStatus,
) -> RtStatus {
    match result {
        Ok(n) => {
            // SAFETY: NULL or writable (the entry points' contract).
            if let Some(out) = unsafe { out.as_mut() } {
                *out = n;
            }
            RtStatus::Ok
        }
        Err(e) => fail(status(&e), chain(&e)),
    }
}

/// Runs an entry point's body; a panic becomes `RT_STATUS_INTERNAL`.
pub(crate) fn guard(body: impl FnOnce() -> RtStatus) -> RtStatus {
    catch_unwind(AssertUnwindSafe(body))
        .unwrap_or_else(|_| fail(RtStatus::Internal, "internal error (panic caught)"))
}

pub(crate) fn transport_status(err: &TransportError) -> RtStatus {
    match err {
        TransportError::UnknownGpa { .. } => RtStatus::UnknownGpa,
        TransportError::Unaligned { .. } => RtStatus::Unaligned,
        TransportError::NodeDown { .. } => RtStatus::NodeDown,
        TransportError::Timeout { .. } => RtStatus::Timeout,
        TransportError::Refused { .. } => RtStatus::Refused,
        // A page that failed its checksum: a corrupted answer, reported as
        // a protocol error until the C API has a status of its own for it.
        TransportError::Protocol { .. } => RtStatus::Protocol,
        TransportError::Coordinator(_) => RtStatus::Coordinator,
        TransportError::Pool(_) | TransportError::PoolExhausted { .. } => RtStatus::Pool,
        TransportError::Config(_) => RtStatus::InvalidArgument,
        TransportError::RdmaUnavailable(_) => RtStatus::Unsupported,
        TransportError::AuthFailed { .. } => RtStatus::AuthFailed,
        // A coherent page whose latest writes died with its owner: lost
        // data too, never an older version.
        TransportError::DataLost { .. } | TransportError::CoherentDataLost { .. } => {
            RtStatus::DataLost
        }
        TransportError::Checksum { .. } => RtStatus::Checksum,
        TransportError::ReplicaMissedWrite { .. } => RtStatus::ReplicaMissedWrite,
        _ => RtStatus::System,
    }
}

pub(crate) fn guest_status(err: &GuestMemoryError) -> RtStatus {
    match err {
        // The caller's shared file is not one guest RAM can live in.
        GuestMemoryError::Config(_)
        | GuestMemoryError::NotSharedMemory { .. }
        | GuestMemoryError::FileNotWritable
        | GuestMemoryError::FileTooSmall { .. } => RtStatus::InvalidArgument,
        GuestMemoryError::Unsupported(_) => RtStatus::Unsupported,
        GuestMemoryError::OutOfRange { .. } => RtStatus::OutOfRange,
        GuestMemoryError::WriteBack { .. } => RtStatus::WriteBack,
        GuestMemoryError::KernelFaultsRefused { .. } => RtStatus::Permission,
        _ => RtStatus::System,
    }
}

/// Full text of an error and its causes.
pub(crate) fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// A static, human-readable name of an `RtStatus` value (never NULL).
#[no_mangle]
pub extern "C" fn rt_status_str(status: i32) -> *const c_char {
    let s: &'static [u8] = match RtStatus::from_i32(status) {
        None => b"unknown status\0",
        Some(RtStatus::Ok) => b"ok\0",
        Some(RtStatus::InvalidArgument) => b"invalid argument\0",
        Some(RtStatus::UnknownGpa) => b"guest-physical address not mapped to any node\0",
        Some(RtStatus::Unaligned) => b"address not page aligned\0",
        Some(RtStatus::NodeDown) => b"owner node down\0",
        Some(RtStatus::Timeout) => b"request timed out\0",
        Some(RtStatus::Refused) => b"node refused the request\0",
        Some(RtStatus::Protocol) => b"protocol error\0",
        Some(RtStatus::Coordinator) => b"coordinator unreachable or refused\0",
        Some(RtStatus::Pool) => b"page pool error\0",
        Some(RtStatus::OutOfRange) => {
            b"range outside the guest memory region, or node index past the last node\0"
        }
        Some(RtStatus::WriteBack) => b"write-back of dirty pages failed\0",
        Some(RtStatus::Unsupported) => b"not supported on this host\0",
        Some(RtStatus::System) => b"system call failed\0",
        Some(RtStatus::Internal) => b"internal error\0",
        Some(RtStatus::Permission) => b"not permitted\0",
        Some(RtStatus::StructSize) => b"config struct_size not known to this library\0",
        Some(RtStatus::AuthFailed) => b"peer failed cluster-key authentication\0",
        Some(RtStatus::DataLost) => {
            b"range contents lost: its page-server restarted; re-initialise it\0"
        }
        Some(RtStatus::Checksum) => b"page failed its end-to-end checksum\0",
        Some(RtStatus::ReplicaMissedWrite) => {
            b"a replica missed the write and could not be marked stale; write again\0"
        }
    };
    s.as_ptr().cast()
}

/// The message of the last failed call on this thread ("" if none). Valid
/// until the next call into this library on the same thread.
#[no_mangle]
pub extern "C" fn rt_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;
    use std::io;

    use super::*;

    #[test]
    fn refused_kernel_faults_are_a_permission_status() {
        let err = GuestMemoryError::KernelFaultsRefused {
            source: io::Error::from(io::ErrorKind::PermissionDenied),
        };
        assert_eq!(guest_status(&err), RtStatus::Permission);
        // SAFETY: rt_status_str returns a static NUL-terminated string.
        let name = unsafe { CStr::from_ptr(rt_status_str(RtStatus::Permission as i32)) };
        assert_eq!(name.to_str().unwrap(), "not permitted");
        assert!(chain(&err).contains("/dev/userfaultfd"));
    }

    #[test]
    fn a_shared_file_guest_ram_cannot_live_in_is_an_invalid_argument() {
        for err in [
            GuestMemoryError::NotSharedMemory { fs_magic: 0x1234 },
            GuestMemoryError::FileNotWritable,
            GuestMemoryError::FileTooSmall {
                file_bytes: 4096,
                needed_bytes: 8192,
            },
        ] {
            assert_eq!(guest_status(&err), RtStatus::InvalidArgument, "{err}");
        }
        let err = GuestMemoryError::Unsupported("MINOR_SHMEM".into());
        assert_eq!(guest_status(&err), RtStatus::Unsupported);
    }

    #[test]
    fn lost_data_has_its_own_status() {
        let err = TransportError::DataLost {
            gpa: 0x1000,
            node: "b".into(),
        };
        assert_eq!(transport_status(&err), RtStatus::DataLost);
        let coherent = TransportError::CoherentDataLost {
            gpa: 0x1000,
            node: "home".into(),
        };
        assert_eq!(transport_status(&coherent), RtStatus::DataLost);
        assert_eq!(RtStatus::DataLost as i32, 18);
        assert_eq!(RtStatus::from_i32(18), Some(RtStatus::DataLost));
    }

    #[test]
    fn a_failed_checksum_has_its_own_status() {
        let err = TransportError::Checksum {
            node: "b".into(),
            gpa: 0x2000,
            direction: "from",
        };
        assert_eq!(transport_status(&err), RtStatus::Checksum);
        assert_eq!(RtStatus::from_i32(19), Some(RtStatus::Checksum));
        // SAFETY: rt_status_str returns a static NUL-terminated string.
        let name = unsafe { CStr::from_ptr(rt_status_str(RtStatus::Checksum as i32)) };
        assert_eq!(
            name.to_str().unwrap(),
            "page failed its end-to-end checksum"
        );
    }
}
