//! Callers parked on a connection, and the poller that must watch the
//! connection while any are. Shared by the TCP and RDMA data paths: a
//! waiting caller first reads its own completions, and only when it parks
//! does a poller thread take over.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// A poller that can be told to look at its connections again.
pub(crate) trait Wake {
    /// Interrupts the poller's wait.
    fn wake(&self);
}

/// The count of parked callers and the poller serving them.
#[derive(Debug)]
pub(crate) struct Parking<P> {
    parked: AtomicUsize,
    poller: OnceLock<Arc<P>>,
}

impl<P: Wake> Parking<P> {
    pub(crate) fn new() -> Self {
        Self {
            parked: AtomicUsize::new(0),
            poller: OnceLock::new(),
        }
    }

    /// Binds the connection to its poller (once).
    pub(crate) fn set_poller(&self, poller: Arc<P>) {
        let _ = self.poller.set(poller);
    }

    /// True while some caller is parked.
    pub(crate) fn any(&self) -> bool {
        self.parked.load(Ordering::SeqCst) > 0
    }

    /// A caller is about to park: the first one wakes the poller so it
    /// starts watching this connection.
    pub(crate) fn enter(&self) {
        if self.parked.fetch_add(1, Ordering::SeqCst) == 0 {
            if let Some(p) = self.poller.get() {
                p.wake();
            }
        }
    }

    /// Wakes the poller if any caller is parked: a caller that was reading
    /// the connection itself stopped, and the poller must take over.
    pub(crate) fn wake_if_parked(&self) {
        if self.any() {
            if let Some(p) = self.poller.get() {
                p.wake();
            }
        }
    }

    /// A parked caller woke up.
    pub(crate) fn leave(&self) {
        self.parked.fetch_sub(1, Ordering::SeqCst);
    }
}
