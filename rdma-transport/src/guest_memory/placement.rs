//! Where a fault handler runs: its CPU and its scheduler slice, set by the
//! thread itself before it serves a fault. The region's constructor waits
//! until every handler has done so: when it returns, the handlers run
//! where the VMM asked (their pinning and slice can be checked at once).

use std::sync::mpsc;

use super::slice;

/// Pins the calling handler to `cpu` (if any), asks for `slice_us`, then
/// reports it to the constructor waiting in `wait_placed`. The sender is
/// taken by value, so it is gone when this returns (or unwinds), not when
/// the thread ends: a handler that never got this far cannot keep
/// `wait_placed` waiting.
pub(super) fn place_current_thread(cpu: Option<usize>, slice_us: u64, placed: mpsc::Sender<()>) {
    if let Some(id) = cpu {
        if !core_affinity::set_for_current(core_affinity::CoreId { id }) {
            tracing::warn!(cpu = id, "cannot pin fault handler");
        }
    }
    slice::apply_to_current_thread(slice_us);
    let _ = placed.send(());
}

/// Waits until `threads` handlers were placed, or every sender is gone.
pub(super) fn wait_placed(placed: mpsc::Receiver<()>, threads: usize) {
    for _ in 0..threads {
        if placed.recv().is_err() {
            break;
        }
    }
}
