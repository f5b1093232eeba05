//! Coherent guest memory (`CoherentMemory`, docs/coherence.md) through the
//! C API: several hypervisor processes map the same guest RAM, single
//! writer / many readers per page. The region takes the same
//! `RtGuestMemoryConfig` as `rt_guest_memory_create` (its dirty-tracking
//! and read-ahead settings do not apply) and an `RtCoherenceConfig`.

use std::mem::{offset_of, size_of};

use rdma_transport::coherent::{Access, CoherenceConfig, NodeStats};
use rdma_transport::guest_memory::{CoherentMemory, CoherentMemoryStats};

use crate::abi::{read_config, struct_size, write_out, CConfig, COut};
use crate::guest::{guest_fail, rust_config, RtGuestMemoryConfig};
use crate::manager::RtManager;
use crate::status::{
    chain, counted, fail, guard, guest_status, transport_status, with_handle, RtStatus,
};

/// Settings of the coherence protocol for one node.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RtCoherenceConfig {
    /// `sizeof(RtCoherenceConfig)` (set by `rt_coherence_config_default`).
    pub struct_size: u32,
    /// An owner keeps a page at least this long after its grant before it
    /// answers a callback (false sharing: each writer makes progress).
    pub min_hold_us: u64,
    /// How long one attempt at a fault waits for the page's home.
    pub timeout_ms: u64,
    /// A home silent this long (host gone, network cut) is left and every
    /// copy of its pages dropped. Declared to each home, which refuses a
    /// node whose bound is 0 or longer than its `--node-dead-home-timeout-ms`
    /// (`CoherenceConfig::dead_home_timeout_ms`): the first access to its
    /// pages then fails with RT_ERR_CONFIG.
    pub dead_home_timeout_ms: u64,
}

/// `struct_size` of the first layout (up to `timeout_ms`), still accepted:
/// `dead_home_timeout_ms` then takes its default.
const FIRST_LAYOUT_BYTES: usize = 24;
const _: () = assert!(
    offset_of!(RtCoherenceConfig, dead_home_timeout_ms) == FIRST_LAYOUT_BYTES
        && size_of::<RtCoherenceConfig>() == FIRST_LAYOUT_BYTES + 8
);

impl CConfig for RtCoherenceConfig {
    const NAME: &'static str = "RtCoherenceConfig";
    const OLD_SIZES: &'static [usize] = &[FIRST_LAYOUT_BYTES];

    fn defaults() -> Self {
        let d = CoherenceConfig::default();
        Self {
            struct_size: struct_size::<Self>(),
            min_hold_us: d.min_hold_us,
            timeout_ms: d.timeout_ms,
            dead_home_timeout_ms: d.dead_home_timeout_ms,
        }
    }
}

/// Counters of a coherent region (`rt_coherent_memory_stats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RtCoherentMemoryStats {
    /// `sizeof(RtCoherentMemoryStats)`, set by the caller.
    pub struct_size: u32,
    /// Read faults on pages this node held no copy of.
    pub read_faults: u64,
    /// Write faults on pages this node held no copy of.
    pub write_faults: u64,
    /// Write faults on shared (read-only) copies.
    pub upgrade_faults: u64,
    /// Pages installed from a grant's data.
    pub pages_installed: u64,
    /// Copies dropped because the home asked (or evict).
    pub invalidations: u64,
    /// Owned copies made read-only because the home asked.
    pub downgrades: u64,
    /// Pages whose contents went back to the home.
    pub pages_written_back: u64,
    /// Faults that could not be served.
    pub fault_errors: u64,
    /// Faults turned into SIGBUS.
    pub sigbus_raised: u64,
    /// Requests sent to homes.
    pub requests: u64,
    /// Faults that joined a request already outstanding.
    pub coalesced_faults: u64,
    /// Callbacks answered later because of the minimum hold time.
    pub deferred_callbacks: u64,
    /// Requests answered with the lost-data error.
    pub lost: u64,
}

impl COut for RtCoherentMemoryStats {
    const NAME: &'static str = "RtCoherentMemoryStats";
}

/// A coherent guest-memory region (opaque).
#[derive(Debug)]
pub struct RtCoherentMemory {
    inner: CoherentMemory,
}

/// Fills `config` with the defaults.
///
/// # Safety
/// `config` must be NULL or point to a writable `RtCoherenceConfig`.
#[no_mangle]
pub unsafe extern "C" fn rt_coherence_config_default(config: *mut RtCoherenceConfig) {
    // SAFETY: the caller passes NULL or a writable config.
    if let Some(out) = unsafe { config.as_mut() } {
        *out = RtCoherenceConfig::defaults();
    }
}

/// Maps `memory_config`'s guest RAM as one node of the coherent VM whose
/// pages are homed at `manager`'s page-servers, and starts its fault
/// threads. Errors as `rt_guest_memory_create`, and
/// `RT_STATUS_UNSUPPORTED` for a hugetlbfs file.
///
/// # Safety
/// As `rt_guest_memory_create`; `coherence` must be NULL or an
/// `RtCoherenceConfig` of `struct_size` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn rt_coherent_memory_create(
    manager: *const RtManager,
    memory_config: *const RtGuestMemoryConfig,
    coherence: *const RtCoherenceConfig,
    out: *mut *mut RtCoherentMemory,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a config of `struct_size` bytes.
        let c = match unsafe { read_config(memory_config) } {
            Ok(c) => c,
            Err(status) => return status,
        };
        // SAFETY: `handed_over_mapping` meets this function's contract.
        let config = match unsafe { rust_config(&c) } {
            Ok(config) => config,
            Err(status) => return status,
        };
        // SAFETY: the caller passes NULL or a config of `struct_size` bytes.
        let coh = match unsafe { read_config(coherence) } {
            Ok(c) => c,
            Err(status) => return status,
        };
        // SAFETY: the caller passes NULL or a live handle.
        let Some(manager) = (unsafe { manager.as_ref() }) else {
            return fail(RtStatus::InvalidArgument, "manager is NULL");
        };
        if out.is_null() {
            return fail(RtStatus::InvalidArgument, "out is NULL");
        }
        let coherence = CoherenceConfig {
            min_hold_us: coh.min_hold_us,
            timeout_ms: coh.timeout_ms,
            dead_home_timeout_ms: coh.dead_home_timeout_ms,
        };
        match CoherentMemory::new(&manager.inner, config, coherence) {
            Ok(inner) => {
                let handle = Box::into_raw(Box::new(RtCoherentMemory { inner }));
                // SAFETY: `out` is non-null and writable (caller's contract).
                unsafe { out.write(handle) };
                RtStatus::Ok
            }
            Err(e) => guest_fail(&e),
        }
    })
}

/// Stops the region's threads, closes its connections and unmaps it. Pages
/// it owned and did not hand back (`rt_coherent_memory_evict`) are lost:
/// their homes report them so. Stop every thread that touches the region
/// first.
///
/// # Safety
/// `memory` must be NULL or a live handle, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn rt_coherent_memory_destroy(memory: *mut RtCoherentMemory) {
    if !memory.is_null() {
        // SAFETY: a live handle from Box::into_raw, destroyed once.
        drop(unsafe { Box::from_raw(memory) });
    }
}

fn with_memory(
    memory: *const RtCoherentMemory,
    f: impl FnOnce(&CoherentMemory) -> RtStatus,
) -> RtStatus {
    with_handle(memory, "memory", |m| f(&m.inner))
}

/// Host address of the region's first byte (NULL for a NULL handle).
///
/// # Safety
/// `memory` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_coherent_memory_host_addr(memory: *const RtCoherentMemory) -> *mut u8 {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { memory.as_ref() }.map_or(std::ptr::null_mut(), |m| m.inner.as_ptr())
}

/// Size of the region in bytes (0 for a NULL handle).
///
/// # Safety
/// `memory` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_coherent_memory_size(memory: *const RtCoherentMemory) -> u64 {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { memory.as_ref() }.map_or(0, |m| m.inner.size_bytes() as u64)
}

/// Makes the page at `gpa` (page aligned) readable (`write` 0) or writable
/// (`write` 1) on this node now, as a fault would, but returns the error
/// instead of raising SIGBUS: `RT_STATUS_DATA_LOST` when its latest writes
/// died with the node that owned it.
///
/// # Safety
/// `memory` must be a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_coherent_memory_acquire(
    memory: *const RtCoherentMemory,
    gpa: u64,
    write: u32,
) -> RtStatus {
    with_memory(memory, |m| {
        let access = match write {
            0 => Access::Read,
            1 => Access::Write,
            other => {
                return fail(
                    RtStatus::InvalidArgument,
                    format!("write must be 0 or 1, not {other}"),
                )
            }
        };
        match m.acquire(gpa, access) {
            Ok(()) => RtStatus::Ok,
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}

/// Hands the pages of `[gpa, gpa + len)` this node holds back to their
/// homes (an owned page is written back first); `*pages_dropped` (may be
/// NULL) receives how many.
///
/// # Safety
/// `memory` must be a live handle; `pages_dropped` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rt_coherent_memory_evict(
    memory: *const RtCoherentMemory,
    gpa: u64,
    len: u64,
    pages_dropped: *mut u64,
) -> RtStatus {
    with_memory(memory, |m| {
        counted(m.evict(gpa, len), pages_dropped, guest_status)
    })
}

/// Fills `*stats` (whose `struct_size` the caller set) with the region's
/// counters.
///
/// # Safety
/// `memory` must be NULL or a live handle; `stats` NULL or an
/// `RtCoherentMemoryStats` with `struct_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn rt_coherent_memory_stats(
    memory: *const RtCoherentMemory,
    stats: *mut RtCoherentMemoryStats,
) -> RtStatus {
    with_memory(memory, |m| {
        // Every field by name: a counter added to `CoherentMemoryStats`
        // does not compile until it is considered here.
        let CoherentMemoryStats {
            read_faults,
            write_faults,
            upgrade_faults,
            pages_installed,
            invalidations,
            downgrades,
            pages_written_back,
            fault_errors,
            sigbus_raised,
            protocol,
        } = m.stats();
        let NodeStats {
            requests,
            coalesced_faults,
            deferred_callbacks,
            lost,
            ..
        } = protocol;
        let value = RtCoherentMemoryStats {
            struct_size: 0,
            read_faults,
            write_faults,
            upgrade_faults,
            pages_installed,
            invalidations,
            downgrades,
            pages_written_back,
            fault_errors,
            sigbus_raised,
            requests,
            coalesced_faults,
            deferred_callbacks,
            lost,
        };
        // SAFETY: the caller passes NULL or a struct of `struct_size` bytes.
        match unsafe { write_out(stats, &value) } {
            Ok(()) => RtStatus::Ok,
            Err(status) => status,
        }
    })
}
