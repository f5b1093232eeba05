//! `RtFrame`: a page read into a frame of the manager's page pool
//! (`rt_manager_read_frame`), with no copy over RDMA.

use rdma_transport::PageFrame;

use crate::manager::{manager_ref, RtManager};
use crate::status::{chain, fail, guard, transport_status, RtStatus};

/// An opaque handle to one 4096-byte frame of a manager's page pool holding
/// a page. The frame is the caller's until `rt_frame_release` gives it back
/// to the pool; it stays valid after its manager is destroyed.
#[derive(Debug)]
pub struct RtFrame {
    frame: PageFrame,
    gpa: u64,
}

/// Reads the page at `gpa` into a free frame of the manager's page pool;
/// `*out` receives the frame (give it back with `rt_frame_release`). Fails
/// with `RT_STATUS_POOL` when every frame is in use.
///
/// # Safety
/// `manager` must be NULL or a live handle; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rt_manager_read_frame(
    manager: *const RtManager,
    gpa: u64,
    out: *mut *mut RtFrame,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let manager = match unsafe { manager_ref(manager) } {
            Ok(m) => m,
            Err(status) => return status,
        };
        if out.is_null() {
            return fail(RtStatus::InvalidArgument, "out is NULL");
        }
        match manager.read_frame(gpa) {
            Ok(frame) => {
                let handle = Box::into_raw(Box::new(RtFrame { frame, gpa }));
                // SAFETY: `out` is non-null and writable (caller's contract).
                unsafe { out.write(handle) };
                RtStatus::Ok
            }
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}

/// The frame's 4096 bytes (4096-byte aligned; NULL for a NULL handle),
/// valid until `rt_frame_release`. The caller may write them: they are its
/// own until then.
///
/// # Safety
/// `frame` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_frame_data(frame: *const RtFrame) -> *mut u8 {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { frame.as_ref() }.map_or(std::ptr::null_mut(), |f| f.frame.as_ptr())
}

/// The guest-physical address the frame was read from (0 for a NULL
/// handle).
///
/// # Safety
/// `frame` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_frame_gpa(frame: *const RtFrame) -> u64 {
    // SAFETY: the caller passes NULL or a live handle.
    unsafe { frame.as_ref() }.map_or(0, |f| f.gpa)
}

/// Gives the frame back to its pool.
///
/// # Safety
/// `frame` must be NULL or a handle from `rt_manager_read_frame` not yet
/// released.
#[no_mangle]
pub unsafe extern "C" fn rt_frame_release(frame: *mut RtFrame) {
    if !frame.is_null() {
        // SAFETY: a live handle from Box::into_raw, released once.
        drop(unsafe { Box::from_raw(frame) });
    }
}
