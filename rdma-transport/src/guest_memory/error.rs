//! Errors of [`super::GuestMemory`].

use std::io;

use crate::error::TransportError;

/// Everything creating or driving a [`super::GuestMemory`] can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GuestMemoryError {
    /// Bad configuration (size, alignment, thread counts).
    #[error("invalid guest memory configuration: {0}")]
    Config(String),
    /// The shared-memory file is smaller than the region's end.
    #[error(
        "the shared-memory file holds {file_bytes:#x} bytes, the region needs {needed_bytes:#x} \
         (offset + size); ftruncate it first"
    )]
    FileTooSmall {
        /// Size of the file.
        file_bytes: u64,
        /// `offset_bytes + size_bytes`.
        needed_bytes: u64,
    },
    /// The descriptor is not a shared-memory file (memfd or tmpfs).
    #[error(
        "the descriptor is not shared memory (filesystem magic {fs_magic:#x}); \
         pass a memfd or a tmpfs file"
    )]
    NotSharedMemory {
        /// `statfs.f_type` of the file.
        fs_magic: i64,
    },
    /// The shared-memory file is not open for reading and writing.
    #[error("the shared-memory file must be open read-write (O_RDWR)")]
    FileNotWritable,
    /// The kernel lacks a userfaultfd feature this module needs.
    #[error("unsupported by this kernel: {0}")]
    Unsupported(String),
    /// Kernel-mode faults ([`super::FaultMode::KernelAndUser`], what KVM
    /// needs) were asked for and the kernel refused them to this process.
    #[error(
        "userfaultfd refused to deliver kernel-mode faults (KVM needs them): \
         give the process CAP_SYS_PTRACE, or set sysctl vm.unprivileged_userfaultfd=1, \
         or give it read-write access to /dev/userfaultfd (Linux >= 6.1); \
         or, if only user-space code touches guest memory, ask for FaultMode::UserOnly"
    )]
    KernelFaultsRefused {
        /// The OS error (`EPERM`).
        #[source]
        source: io::Error,
    },
    /// A userfaultfd call failed.
    #[error("{op} failed")]
    Userfaultfd {
        /// The call.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Mapping or advising the guest region failed.
    #[error("guest region {op} failed")]
    Memory {
        /// The call (`mmap`, `madvise`).
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Registering the shared-memory file's alias with the RDMA device
    /// failed ([`super::GuestMemoryConfig::rdma_register_alias`]).
    #[error(
        "registering guest memory with the RDMA device failed (raise `ulimit -l`, \
         or set rdma_register_alias to false to bounce pages through the pool)"
    )]
    RdmaRegister(#[source] crate::rdma::RegisterError),
    /// A handler or prefetch thread could not be started.
    #[error("cannot start thread {name}")]
    Thread {
        /// Thread name.
        name: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The range is not page aligned or not inside the region.
    #[error("range {gpa:#x}+{len_bytes:#x} is not page aligned or not inside the region")]
    OutOfRange {
        /// First GPA asked for.
        gpa: u64,
        /// Length asked for.
        len_bytes: u64,
    },
    /// Writing dirty pages back to their owner failed; they stay dirty and
    /// mapped, and a later flush or evict retries them.
    #[error("write-back of {pages} dirty page(s) failed")]
    WriteBack {
        /// Pages that stay dirty.
        pages: usize,
        /// The first transport error.
        #[source]
        source: TransportError,
    },
}
