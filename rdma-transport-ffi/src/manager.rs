//! `RtManager`: the transport manager.

use std::ffi::{c_char, CStr};
use std::sync::Arc;

use rdma_transport::{ManagerConfig, TransportManager, PAGE_SIZE};

use crate::abi::{flag, read_config, struct_size, CConfig};
use crate::status::{chain, fail, guard, transport_status, RtStatus};

/// An opaque handle to a transport manager.
#[derive(Debug)]
pub struct RtManager {
    pub(crate) inner: Arc<TransportManager>,
}

/// Settings of `rt_manager_connect`; fill with `rt_manager_config_default`
/// first, then change what you need. Flags are 0 or 1; other values are
/// refused with `RT_STATUS_INVALID_ARGUMENT`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RtManagerConfig {
    /// `sizeof(RtManagerConfig)`, set by `rt_manager_config_default`: lets
    /// the struct grow (see docs/embedding.md). Other sizes are refused with
    /// `RT_STATUS_STRUCT_SIZE`.
    pub struct_size: u32,
    /// Poller threads.
    pub poller_threads: u32,
    /// Coordinator base URL, e.g. "http://127.0.0.1:7070" (required).
    pub coordinator_url: *const c_char,
    /// Deadline of every page request, in milliseconds.
    pub request_timeout_ms: u64,
    /// Deadline of a connection attempt, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Size of the page pool in bytes (a multiple of 4096).
    pub pool_size_bytes: u64,
    /// How long a caller spins for its answer before it parks, in
    /// microseconds (about 10 on hosts with 2-4 CPUs, see docs/embedding.md).
    pub wait_spin_us: u64,
    /// 1: pin pollers to the last CPUs of the host; 0: no pinning.
    pub pin_pollers: u32,
    /// 1: run without a cluster key (insecure: only page-servers without a
    /// key are used, and nothing proves who they are); 0: `cluster_key_file`
    /// is required.
    pub insecure: u32,
    /// Path of the cluster key file (hex, at least 32 bytes, not readable by
    /// other users), NUL-terminated; NULL only with `insecure` = 1.
    pub cluster_key_file: *const c_char,
}

impl CConfig for RtManagerConfig {
    const NAME: &'static str = "RtManagerConfig";
}

/// Fills `config` with the library's defaults (no URL).
///
/// # Safety
/// `config` must be NULL or point to a writable `RtManagerConfig`.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_config_default(config: *mut RtManagerConfig) {
    let d = ManagerConfig::default();
    let value = RtManagerConfig {
        struct_size: struct_size::<RtManagerConfig>(),
        coordinator_url: std::ptr::null(),
        request_timeout_ms: d.request_timeout_ms,
        connect_timeout_ms: d.connect_timeout_ms,
        pool_size_bytes: d.pool_size_bytes as u64,
        poller_threads: d.poller_threads as u32,
        pin_pollers: 1,
        insecure: 0,
        cluster_key_file: std::ptr::null(),
        wait_spin_us: d.wait_spin_us,
    };
    // SAFETY: the caller passes NULL or a writable config.
    if let Some(out) = unsafe { config.as_mut() } {
        *out = value;
    }
}

/// Connects to the coordinator and every node of its map; `*out` receives
/// the manager (destroy it with `rt_manager_destroy`).
///
/// # Safety
/// `config` must point to an `RtManagerConfig` (at least `struct_size`
/// readable bytes) whose URL is a NUL-terminated string; `out` must be
/// writable.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_connect(
    config: *const RtManagerConfig,
    out: *mut *mut RtManager,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a config of `struct_size` bytes.
        let config = match unsafe { read_config(config) } {
            Ok(c) => c,
            Err(status) => return status,
        };
        let pin_pollers = match flag(config.pin_pollers, RtManagerConfig::NAME, "pin_pollers") {
            Ok(pin) => pin,
            Err(status) => return status,
        };
        let insecure = match flag(config.insecure, RtManagerConfig::NAME, "insecure") {
            Ok(insecure) => insecure,
            Err(status) => return status,
        };
        let key_path = if config.cluster_key_file.is_null() {
            None
        } else {
            // SAFETY: non-null, NUL-terminated by the caller's contract.
            let path = unsafe { CStr::from_ptr(config.cluster_key_file) };
            match path.to_str() {
                Ok(p) => Some(std::path::PathBuf::from(p)),
                Err(_) => return fail(RtStatus::InvalidArgument, "cluster_key_file is not UTF-8"),
            }
        };
        let cluster_key = match rdma_transport::auth::key_from_flags(key_path.as_deref(), insecure)
        {
            Ok(key) => key,
            Err(msg) => return fail(RtStatus::InvalidArgument, msg),
        };
        if out.is_null() || config.coordinator_url.is_null() {
            return fail(RtStatus::InvalidArgument, "out or coordinator_url is NULL");
        }
        // SAFETY: non-null, NUL-terminated by the caller's contract.
        let url = unsafe { CStr::from_ptr(config.coordinator_url) };
        let Ok(url) = url.to_str() else {
            return fail(RtStatus::InvalidArgument, "coordinator_url is not UTF-8");
        };
        let Ok(pool_size_bytes) = usize::try_from(config.pool_size_bytes) else {
            return fail(RtStatus::InvalidArgument, "pool_size_bytes too large");
        };
        let rust_config = ManagerConfig {
            coordinator_url: url.to_owned(),
            cluster_key,
            request_timeout_ms: config.request_timeout_ms,
            connect_timeout_ms: config.connect_timeout_ms,
            pool_size_bytes,
            poller_threads: config.poller_threads as usize,
            poller_cpus: if pin_pollers { None } else { Some(vec![]) },
            wait_spin_us: config.wait_spin_us,
            ..ManagerConfig::default()
        };
        match TransportManager::connect(rust_config) {
            Ok(m) => {
                let handle = Box::into_raw(Box::new(RtManager { inner: Arc::new(m) }));
                // SAFETY: `out` is non-null and writable (caller's contract).
                unsafe { out.write(handle) };
                RtStatus::Ok
            }
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}

/// Destroys a manager. Guest memory created from it keeps its own
/// reference, so the connections close when the last of them is gone.
///
/// # Safety
/// `manager` must be NULL or a handle from `rt_manager_connect` not yet
/// destroyed.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_destroy(manager: *mut RtManager) {
    if !manager.is_null() {
        // SAFETY: a live handle from Box::into_raw, destroyed once.
        drop(unsafe { Box::from_raw(manager) });
    }
}

/// Reads the 4096-byte page at `gpa` into `page`.
///
/// # Safety
/// `manager` must be a live handle; `page` must point to 4096 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_read_page(
    manager: *const RtManager,
    gpa: u64,
    page: *mut u8,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let Some(manager) = (unsafe { manager.as_ref() }) else {
            return fail(RtStatus::InvalidArgument, "manager is NULL");
        };
        if page.is_null() {
            return fail(RtStatus::InvalidArgument, "page is NULL");
        }
        // SAFETY: non-null and 4096 writable bytes (caller's contract).
        let page = unsafe { &mut *page.cast::<[u8; PAGE_SIZE]>() };
        match manager.inner.read_page(gpa, page) {
            Ok(()) => RtStatus::Ok,
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}

/// Writes the 4096 bytes at `page` to the page at `gpa`; returns once the
/// owner acknowledged them.
///
/// # Safety
/// `manager` must be a live handle; `page` must point to 4096 readable bytes.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_write_page(
    manager: *const RtManager,
    gpa: u64,
    page: *const u8,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let Some(manager) = (unsafe { manager.as_ref() }) else {
            return fail(RtStatus::InvalidArgument, "manager is NULL");
        };
        if page.is_null() {
            return fail(RtStatus::InvalidArgument, "page is NULL");
        }
        // SAFETY: non-null and 4096 readable bytes (caller's contract).
        let page = unsafe { &*page.cast::<[u8; PAGE_SIZE]>() };
        match manager.inner.write_page(gpa, page) {
            Ok(()) => RtStatus::Ok,
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}
