//! C API of `rdma-transport`, for hypervisors written in C.
//!
//! All unsafe code of the C boundary lives in this crate. Every entry point
//! returns an [`RtStatus`] (0 is success), records a message for
//! `rt_last_error()` on failure, and never lets a panic cross into C. The
//! header `include/rdma_transport.h` is generated from these files by
//! cbindgen (`scripts/gen-header.sh`; the `header` test fails when it is
//! stale). Build artefacts: `librdma_transport_ffi.so` and
//! `librdma_transport_ffi.a`. See `docs/embedding.md` for an example.

mod abi;
mod coherent;
mod config;
mod frame;
mod guest;
mod manager;
mod queue;
mod stats;
mod status;

pub use coherent::{
    rt_coherence_config_default, rt_coherent_memory_acquire, rt_coherent_memory_create,
    rt_coherent_memory_destroy, rt_coherent_memory_evict, rt_coherent_memory_host_addr,
    rt_coherent_memory_size, rt_coherent_memory_stats, RtCoherenceConfig, RtCoherentMemory,
    RtCoherentMemoryStats,
};
pub use config::{RtManagerConfig, RtPollMode, RtTransportKind, RT_RDMA_GID_INDEX_AUTO};
pub use frame::{rt_frame_data, rt_frame_gpa, rt_frame_release, rt_manager_read_frame, RtFrame};
pub use guest::{
    rt_guest_memory_config_default, rt_guest_memory_create, rt_guest_memory_destroy,
    rt_guest_memory_evict, rt_guest_memory_flush, rt_guest_memory_host_addr, rt_guest_memory_read,
    rt_guest_memory_size, rt_guest_memory_stats, rt_guest_memory_write, RtFaultAction,
    RtFaultErrorFn, RtFaultMode, RtFaultReport, RtGuestMemory, RtGuestMemoryConfig,
    RtGuestMemoryStats, RtSigbusMethod,
};
pub use manager::{
    rt_manager_config_default, rt_manager_connect, rt_manager_destroy, rt_manager_read_page,
    rt_manager_read_pages, rt_manager_write_page, rt_manager_write_pages, RtManager,
};
pub use queue::{
    rt_queue_create, rt_queue_destroy, rt_queue_eventfd, rt_queue_in_flight, rt_queue_poll,
    rt_queue_submit_read, rt_queue_submit_write, rt_queue_wait, RtCompletion, RtCompletionFn,
    RtQueue, RtReapMode,
};
pub use stats::{
    rt_manager_node_count, rt_manager_node_info, rt_manager_stats, RtDataPath, RtManagerStats,
    RtNodeInfo,
};
pub use status::{rt_last_error, rt_status_str, RtStatus};
