//! Statistics of a manager: `rt_manager_stats` (map, nodes, page pool,
//! hedging delay, page-I/O counters) and `rt_manager_node_info` (each node
//! of the map and its data path).

use std::ffi::c_char;
use std::mem::{offset_of, size_of};

use rdma_transport::DataPath;

use crate::abi::{write_out, COut};
use crate::manager::{manager_ref, RtManager};
use crate::status::{fail, guard, RtStatus};

/// What a manager reports (`rt_manager_stats`). Set `struct_size` to
/// `sizeof(RtManagerStats)` before the call; the library fills the rest.
/// Counters start at 0 when the manager connects and only grow; the other
/// fields are values of the moment of the call.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RtManagerStats {
    /// `sizeof(RtManagerStats)`, set by the caller (see docs/embedding.md).
    pub struct_size: u32,
    /// Version of the GPA map in use.
    pub map_version: u64,
    /// Nodes in the map.
    pub node_count: u64,
    /// Nodes with a live connection now.
    pub nodes_connected: u64,
    /// Nodes whose live connection moves pages by RDMA.
    pub nodes_rdma: u64,
    /// Frames (4096 bytes each) of the page pool.
    pub pool_frames: u64,
    /// Frames of the page pool not in use now (an `RtFrame` holds one).
    pub pool_free_frames: u64,
    /// How long a replicated read waits now before it also goes to the
    /// next replica, in microseconds.
    pub read_hedge_delay_us: u64,
    /// Page-I/O calls that succeeded (read/write page(s), read frame; a
    /// batch counts once).
    pub calls_ok: u64,
    /// Page-I/O calls that failed, `calls_timed_out` included.
    pub calls_failed: u64,
    /// Page-I/O calls that failed with `RT_STATUS_TIMEOUT`.
    pub calls_timed_out: u64,
    /// Pages read by calls that succeeded.
    pub pages_read: u64,
    /// Pages written by calls that succeeded.
    pub pages_written: u64,
    /// Memory ranges registered with the RDMA device now (e.g. a shared
    /// guest region's alias).
    pub rdma_registered_regions: u64,
    /// Pages RDMA moved straight into or out of registered memory (no pool
    /// frame), by requests that succeeded.
    pub rdma_direct_pages: u64,
    /// Pages RDMA moved through a pool frame, by requests that succeeded.
    pub rdma_framed_pages: u64,
    /// Failed requests on registered memory whose queue pair was drained
    /// before the call returned.
    pub rdma_drains: u64,
    /// Drains that could not be confirmed (the device might still write
    /// those pages).
    pub rdma_drain_failures: u64,
    /// Pages of asynchronous reads (queue submissions, guest-memory
    /// faults) that TCP read from the socket straight into their page,
    /// with no copy out of a receive buffer.
    pub tcp_direct_pages: u64,
    /// Replicas this manager owes a stale mark now (see
    /// `rt_manager_settle_owed_stale_marks`).
    pub owed_stale_marks: u64,
    /// Reads of replicated pages sent on to another replica because theirs
    /// had not answered within the hedging delay.
    pub reads_hedged: u64,
}

/// `struct_size` of the first layout (up to `pages_written`), still
/// filled: the zero-copy counters are left out.
const FIRST_LAYOUT_BYTES: usize = 8 + 12 * 8;
/// `struct_size` of the second layout (up to `tcp_direct_pages`), still
/// filled: `owed_stale_marks` is left out.
const SECOND_LAYOUT_BYTES: usize = FIRST_LAYOUT_BYTES + 6 * 8;
/// `struct_size` of the third layout (up to `owed_stale_marks`), still
/// filled: `reads_hedged` is left out.
const THIRD_LAYOUT_BYTES: usize = SECOND_LAYOUT_BYTES + 8;
const _: () = assert!(
    offset_of!(RtManagerStats, rdma_registered_regions) == FIRST_LAYOUT_BYTES
        && offset_of!(RtManagerStats, owed_stale_marks) == SECOND_LAYOUT_BYTES
        && offset_of!(RtManagerStats, reads_hedged) == THIRD_LAYOUT_BYTES
        && size_of::<RtManagerStats>() == THIRD_LAYOUT_BYTES + 8
);

impl COut for RtManagerStats {
    const NAME: &'static str = "RtManagerStats";
    const OLD_SIZES: &'static [usize] =
        &[FIRST_LAYOUT_BYTES, SECOND_LAYOUT_BYTES, THIRD_LAYOUT_BYTES];
}

/// The data path of a node's connection (`RtNodeInfo.data_path`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtDataPath {
    /// Not connected at the moment (connected again on use).
    None = 0,
    /// Pages move over TCP.
    Tcp = 1,
    /// Pages move by RDMA READ/WRITE.
    Rdma = 2,
}

/// One node of the map (`rt_manager_node_info`). Set `struct_size` to
/// `sizeof(RtNodeInfo)` before the call.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RtNodeInfo {
    /// `sizeof(RtNodeInfo)`, set by the caller.
    pub struct_size: u32,
    /// An `RtDataPath` value.
    pub data_path: u32,
    /// Length of the node's id in bytes, without the NUL.
    pub id_len: u64,
}

impl COut for RtNodeInfo {
    const NAME: &'static str = "RtNodeInfo";
}

fn count(n: usize) -> u64 {
    n as u64
}

/// Fills `*stats` (whose `struct_size` the caller set) with the manager's
/// statistics.
///
/// # Safety
/// `manager` must be NULL or a live handle; `stats` NULL or an
/// `RtManagerStats` with `struct_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_stats(
    manager: *const RtManager,
    stats: *mut RtManagerStats,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let manager = match unsafe { manager_ref(manager) } {
            Ok(m) => m,
            Err(status) => return status,
        };
        let s = manager.stats();
        let z = manager.zero_copy_stats();
        let value = RtManagerStats {
            struct_size: 0,
            map_version: s.map_version,
            node_count: count(s.nodes),
            nodes_connected: count(s.nodes_connected),
            nodes_rdma: count(s.nodes_rdma),
            pool_frames: count(s.pool_frames),
            pool_free_frames: count(s.pool_free_frames),
            read_hedge_delay_us: s.read_hedge_delay_us,
            calls_ok: s.calls_ok,
            calls_failed: s.calls_failed,
            calls_timed_out: s.calls_timed_out,
            pages_read: s.pages_read,
            pages_written: s.pages_written,
            rdma_registered_regions: count(z.regions),
            rdma_direct_pages: z.direct_pages,
            rdma_framed_pages: z.framed_pages,
            rdma_drains: z.drains,
            rdma_drain_failures: z.drain_failures,
            tcp_direct_pages: z.tcp_direct_pages,
            owed_stale_marks: count(s.owed_stale_marks),
            reads_hedged: s.reads_hedged,
        };
        // SAFETY: the caller passes NULL or a struct of `struct_size` bytes.
        match unsafe { write_out(stats, &value) } {
            Ok(()) => RtStatus::Ok,
            Err(status) => status,
        }
    })
}

/// Number of nodes in the manager's map now (0 for a NULL handle).
///
/// # Safety
/// `manager` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_node_count(manager: *const RtManager) -> usize {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { manager.as_ref() }.map_or(0, |m| m.inner.node_transports().len())
}

/// Describes node `index` (0 to `rt_manager_node_count` - 1) of the map:
/// fills `*info` (whose `struct_size` the caller set) and copies the node's
/// id, NUL-terminated, into `id` (`id_capacity` bytes). `id` may be NULL
/// with `id_capacity` 0 to learn `info->id_len` only. An id buffer too small
/// for `id_len + 1` bytes: `RT_STATUS_INVALID_ARGUMENT`, with `*info`
/// filled and `id` untouched. An index past the last node (the map may have
/// changed): `RT_STATUS_OUT_OF_RANGE`.
///
/// # Safety
/// `manager` must be NULL or a live handle; `info` NULL or an `RtNodeInfo`
/// with `struct_size` writable bytes; `id` NULL or `id_capacity` writable
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_node_info(
    manager: *const RtManager,
    index: usize,
    info: *mut RtNodeInfo,
    id: *mut c_char,
    id_capacity: usize,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let manager = match unsafe { manager_ref(manager) } {
            Ok(m) => m,
            Err(status) => return status,
        };
        let nodes = manager.node_transports();
        let Some((node_id, path)) = nodes.get(index) else {
            return fail(
                RtStatus::OutOfRange,
                format!("node index {index}: the map has {} nodes", nodes.len()),
            );
        };
        let data_path = match path {
            None => RtDataPath::None,
            Some(DataPath::Tcp) => RtDataPath::Tcp,
            Some(DataPath::Rdma) => RtDataPath::Rdma,
        };
        let value = RtNodeInfo {
            struct_size: 0,
            data_path: data_path as u32,
            id_len: node_id.len() as u64,
        };
        // SAFETY: the caller passes NULL or a struct of `struct_size` bytes.
        if let Err(status) = unsafe { write_out(info, &value) } {
            return status;
        }
        if id.is_null() && id_capacity == 0 {
            return RtStatus::Ok;
        }
        if id.is_null() {
            return fail(
                RtStatus::InvalidArgument,
                format!("id is NULL but id_capacity is {id_capacity}"),
            );
        }
        // Node ids come from the coordinator's map; one with a NUL inside
        // would be cut short in C.
        if node_id.len() >= id_capacity || node_id.contains('\0') {
            return fail(
                RtStatus::InvalidArgument,
                format!(
                    "node id {node_id:?} needs {} bytes with its NUL; id_capacity is {id_capacity}",
                    node_id.len() + 1
                ),
            );
        }
        // SAFETY: `id` is non-null with `id_capacity` writable bytes
        // (caller's contract), not overlapping the Rust string.
        let buf = unsafe { std::slice::from_raw_parts_mut(id.cast::<u8>(), id_capacity) };
        buf[..node_id.len()].copy_from_slice(node_id.as_bytes());
        buf[node_id.len()] = 0;
        RtStatus::Ok
    })
}
