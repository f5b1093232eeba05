//! Test hook: makes the calling thread's next request panic right after it
//! is submitted, before its completion, as a bug or a callback unwinding
//! through the C API's `catch_unwind` would. Built for the library's own
//! tests and with the `test-hooks` feature only.

use std::cell::Cell;

thread_local! {
    static PANIC_AFTER_SUBMIT: Cell<bool> = const { Cell::new(false) };
}

/// The calling thread's next request panics once it is on the wire.
pub(crate) fn arm() {
    PANIC_AFTER_SUBMIT.with(|p| p.set(true));
}

/// Called where a request has been submitted and not yet completed.
pub(super) fn maybe_panic_after_submit() {
    if PANIC_AFTER_SUBMIT.with(|p| p.replace(false)) {
        panic!("injected panic between submit and completion");
    }
}
