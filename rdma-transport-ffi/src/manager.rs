//! `RtManager`: the transport manager.

use std::sync::Arc;

use rdma_transport::{Page, TransportManager, PAGE_SIZE};

use crate::abi::{read_config, CConfig};
use crate::config::{rust_config, RtManagerConfig};
use crate::status::{chain, fail, guard, transport_status, RtStatus};

/// An opaque handle to a transport manager.
#[derive(Debug)]
pub struct RtManager {
    pub(crate) inner: Arc<TransportManager>,
}

/// Fills `config` with the library's defaults (no URL, no cluster key).
///
/// # Safety
/// `config` must be NULL or point to a writable `RtManagerConfig`.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_config_default(config: *mut RtManagerConfig) {
    // SAFETY: the caller passes NULL or a writable config.
    if let Some(out) = unsafe { config.as_mut() } {
        *out = RtManagerConfig::defaults();
    }
}

/// Connects to the coordinator and every node of its map; `*out` receives
/// the manager (destroy it with `rt_manager_destroy`). The config is
/// checked first (`struct_size`, flags, enum values, ranges, pointers),
/// then `out`.
///
/// # Safety
/// `config` must be NULL or point to an `RtManagerConfig` (at least
/// `struct_size` readable bytes) whose pointers are NULL or valid as their
/// fields document; `out` must be NULL or writable.
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
        // SAFETY: the config's pointers are valid (caller's contract).
        let rust_config = match unsafe { rust_config(&config) } {
            Ok(c) => c,
            Err(status) => return status,
        };
        if out.is_null() {
            return fail(RtStatus::InvalidArgument, "out is NULL");
        }
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

/// Fetches the GPA map from the coordinator now; `*version` (when not
/// NULL) receives the version in use afterwards. A host that takes a VM
/// over from another calls it after the other's last write-back and before
/// the vCPUs run: that write-back may have marked a replica stale
/// (docs/embedding.md, "Moving a VM to another host").
///
/// # Safety
/// `manager` must be a live handle; `version` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_refresh_map(
    manager: *const RtManager,
    version: *mut u64,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let Some(manager) = (unsafe { manager.as_ref() }) else {
            return fail(RtStatus::InvalidArgument, "manager is NULL");
        };
        match manager.inner.refresh_map() {
            Ok(v) => {
                // SAFETY: NULL or writable (caller's contract).
                if let Some(out) = unsafe { version.as_mut() } {
                    *out = v;
                }
                RtStatus::Ok
            }
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}

/// Marks stale at the coordinator every replica this manager owes a stale
/// mark (`RtManagerStats.owed_stale_marks`: a replica that missed one of
/// its writes while the coordinator could not be told, still live for
/// every other manager). A VMM handing its VM over to another (migration,
/// restart) calls it after its last write-back, until it returns
/// `RT_STATUS_OK` (docs/embedding.md, "Moving a VM to another host").
///
/// # Safety
/// `manager` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_settle_owed_stale_marks(manager: *const RtManager) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let Some(manager) = (unsafe { manager.as_ref() }) else {
            return fail(RtStatus::InvalidArgument, "manager is NULL");
        };
        match manager.inner.settle_owed_stale_marks() {
            Ok(()) => RtStatus::Ok,
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
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

/// The manager behind a handle, or the status of a NULL one.
///
/// # Safety
/// `manager` must be NULL or a live handle.
pub(crate) unsafe fn manager_ref<'a>(
    manager: *const RtManager,
) -> Result<&'a TransportManager, RtStatus> {
    // SAFETY: the caller passes NULL or a live handle.
    match unsafe { manager.as_ref() } {
        Some(m) => Ok(&m.inner),
        None => Err(fail(RtStatus::InvalidArgument, "manager is NULL")),
    }
}

/// The `count` addresses at `gpas` of a batch call, after checking that
/// neither pointer is NULL (unless `count` is 0) and that `count` pages fit
/// in memory.
///
/// # Safety
/// `gpas` must be NULL or point to `count` addresses readable for `'a`.
unsafe fn batch_gpas<'a>(
    gpas: *const u64,
    count: usize,
    pages_null: bool,
) -> Result<&'a [u64], RtStatus> {
    if count == 0 {
        return Ok(&[]);
    }
    if gpas.is_null() || pages_null {
        return Err(fail(
            RtStatus::InvalidArgument,
            format!("gpas or pages is NULL with count {count}"),
        ));
    }
    if count > isize::MAX as usize / PAGE_SIZE {
        return Err(fail(
            RtStatus::InvalidArgument,
            format!("count {count} pages is too large"),
        ));
    }
    // SAFETY: non-null and `count` readable addresses (caller's contract).
    Ok(unsafe { std::slice::from_raw_parts(gpas, count) })
}

/// Reads the `count` pages at `gpas[0..count]` into `pages` (page i at
/// `pages + i * 4096`), all in flight at once. On error, returns the first
/// one; the other pages may or may not have been read. `count` 0 moves
/// nothing and succeeds.
///
/// # Safety
/// `manager` must be a live handle; `gpas` must point to `count` readable
/// addresses and `pages` to `count * 4096` writable bytes (either may be
/// NULL when `count` is 0).
#[no_mangle]
pub unsafe extern "C" fn rt_manager_read_pages(
    manager: *const RtManager,
    gpas: *const u64,
    count: usize,
    pages: *mut u8,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let manager = match unsafe { manager_ref(manager) } {
            Ok(m) => m,
            Err(status) => return status,
        };
        // SAFETY: the caller's contract on `gpas` and `count`.
        let gpas = match unsafe { batch_gpas(gpas, count, pages.is_null()) } {
            Ok(g) => g,
            Err(status) => return status,
        };
        let pages = match gpas.len() {
            0 => &mut [][..],
            // SAFETY: non-null (checked by `batch_gpas`) and `count` pages
            // of writable bytes (caller's contract); a `Page` is 4096 bytes
            // of alignment 1.
            n => unsafe { std::slice::from_raw_parts_mut(pages.cast::<Page>(), n) },
        };
        match manager.read_pages(gpas, pages) {
            Ok(()) => RtStatus::Ok,
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}

/// Writes the `count` pages at `pages` (page i at `pages + i * 4096`) to
/// `gpas[0..count]`, all in flight at once; returns once every owner
/// acknowledged. On error, returns the first one; the other pages may or
/// may not have been written. `count` 0 moves nothing and succeeds.
///
/// # Safety
/// `manager` must be a live handle; `gpas` must point to `count` readable
/// addresses and `pages` to `count * 4096` readable bytes (either may be
/// NULL when `count` is 0).
#[no_mangle]
pub unsafe extern "C" fn rt_manager_write_pages(
    manager: *const RtManager,
    gpas: *const u64,
    count: usize,
    pages: *const u8,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let manager = match unsafe { manager_ref(manager) } {
            Ok(m) => m,
            Err(status) => return status,
        };
        // SAFETY: the caller's contract on `gpas` and `count`.
        let gpas = match unsafe { batch_gpas(gpas, count, pages.is_null()) } {
            Ok(g) => g,
            Err(status) => return status,
        };
        let pages = match gpas.len() {
            0 => &[][..],
            // SAFETY: non-null (checked by `batch_gpas`) and `count` pages
            // of readable bytes (caller's contract); a `Page` is 4096 bytes
            // of alignment 1.
            n => unsafe { std::slice::from_raw_parts(pages.cast::<Page>(), n) },
        };
        match manager.write_pages(gpas, pages) {
            Ok(()) => RtStatus::Ok,
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}
