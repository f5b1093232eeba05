//! Hooks for tests of what only an older kernel does (built with the
//! `test-hooks` feature, never in a release of the library): a test can
//! make a shared region behave as on Linux 5.19-6.3, whose
//! `UFFDIO_CONTINUE` cannot map pages write-protected, and write into pages
//! in the moment such a kernel leaves them writable; or as on Linux
//! 5.13-5.18, which cannot write-protect shared memory at all.
//!
//! Both settings are process-wide: a test binary that uses them should
//! hold to one setting for all its tests.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

static HIDE_CONTINUE_WP: AtomicBool = AtomicBool::new(false);
static HIDE_SHARED_WP: AtomicBool = AtomicBool::new(false);

/// What runs between mapping pages writable and write-protecting them.
type WindowHook = Box<dyn Fn(*mut u8, usize) + Send + Sync>;

static BEFORE_WRITE_PROTECT: Mutex<Option<WindowHook>> = Mutex::new(None);

/// From now on, guest memory made on a shared file acts as if the kernel
/// had no `UFFDIO_CONTINUE_MODE_WP` (Linux < 6.4): pages are mapped, then
/// write-protected.
pub fn hide_continue_write_protect(hide: bool) {
    HIDE_CONTINUE_WP.store(hide, Ordering::SeqCst);
}

pub(crate) fn continue_wp_hidden() -> bool {
    HIDE_CONTINUE_WP.load(Ordering::SeqCst) || shared_wp_hidden()
}

/// From now on, guest memory made on a shared file acts as if the kernel's
/// userfaultfd had no write protection on shared memory
/// (`UFFD_FEATURE_WP_HUGETLBFS_SHMEM`, Linux < 5.19): its pages are mapped
/// writable and always count as dirty (see `dirty::flush_unprotected`).
pub fn hide_shared_write_protect(hide: bool) {
    HIDE_SHARED_WP.store(hide, Ordering::SeqCst);
}

pub(crate) fn shared_wp_hidden() -> bool {
    HIDE_SHARED_WP.load(Ordering::SeqCst)
}

/// Runs `hook(start, len_bytes)` on the fault handler's thread each time
/// clean pages have been mapped writable and are about to be
/// write-protected (only when the kernel, or
/// [`hide_continue_write_protect`], makes that two steps). `None` removes
/// it.
pub fn set_before_write_protect(hook: Option<WindowHook>) {
    *BEFORE_WRITE_PROTECT.lock() = hook;
}

pub(crate) fn before_write_protect(start: *mut u8, len_bytes: usize) {
    if let Some(hook) = &*BEFORE_WRITE_PROTECT.lock() {
        hook(start, len_bytes);
    }
}
