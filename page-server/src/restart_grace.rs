//! A coherence home that restarted grants nothing for a while: a node cut
//! off from the process before it (no reset reached it) may still read its
//! copies of that process's pages until its bound on the home's silence has
//! run out, and a page the new process granted to another node meanwhile
//! would be changed under it (docs/coherence.md, "A home that restarts").
//!
//! The new process cannot know who held what, nor when the old one went
//! silent, only that it was gone when this one learnt of it: at start (its
//! state directory says an earlier process held a range) or when it
//! registers (the map names the node, and no other process of it is alive:
//! `other_processes.rs`). Every node declared a bound of at most
//! `--node-dead-home-timeout-ms` (the home refuses longer ones), so every
//! copy of the old process's pages is gone [`left_for_sure_within`] that
//! bound after then. Until that time every coherence request is answered
//! `Retry`.
//!
//! A node that never had a process before waits for nothing: a cluster's
//! first start is not slowed down.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdma_transport::dead_peer::left_for_sure_within;

/// Whether a predecessor is waited out, and until when.
#[derive(Debug)]
pub(crate) struct RestartGrace {
    length: Duration,
    until: Mutex<Option<Instant>>,
    /// Set while a predecessor is waited out; cleared once the grace is
    /// over (so that a request costs one load afterwards).
    holding: AtomicBool,
}

impl RestartGrace {
    /// A process whose nodes declared at most `node_bound_limit`.
    pub(crate) fn new(node_bound_limit: Duration) -> Self {
        Self {
            length: left_for_sure_within(node_bound_limit),
            until: Mutex::new(None),
            holding: AtomicBool::new(false),
        }
    }

    /// A process of this node ran before this one and is gone now: what
    /// its nodes may still hold is waited out from now. Logged once.
    pub(crate) fn had_predecessor(&self, why: &str) {
        let end = Instant::now() + self.length;
        let mut until = self.until.lock();
        let first = until.is_none();
        *until = Some(until.map_or(end, |u| u.max(end)));
        self.holding.store(true, Ordering::Release);
        if first {
            tracing::info!(
                why,
                grace_ms = self.length.as_millis() as u64,
                "an earlier process of this node served its ranges: coherence requests wait \
                 until nodes cut off from it have surely dropped their copies"
            );
        }
    }

    /// Whether coherence requests must wait now.
    pub(crate) fn holds(&self) -> bool {
        if !self.holding.load(Ordering::Acquire) {
            return false;
        }
        if self.until.lock().is_some_and(|u| Instant::now() < u) {
            return true;
        }
        if self.holding.swap(false, Ordering::AcqRel) {
            tracing::info!("the restart grace is over: coherence requests are served");
        }
        false
    }
}

impl Default for RestartGrace {
    fn default() -> Self {
        Self::new(Duration::ZERO)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_process_with_a_predecessor_holds_and_only_for_the_nodes_bound() {
        let grace = RestartGrace::new(Duration::from_millis(200));
        assert!(!grace.holds(), "no predecessor known of");
        grace.had_predecessor("test");
        assert!(grace.holds());
        // 200 ms bound: the kernel's 1 s steps, then the 2 s margin.
        assert_eq!(grace.length, Duration::from_secs(4));
        let end = grace.until.lock().unwrap();
        // Learnt of again later: waited out from then.
        grace.had_predecessor("test");
        assert!(grace.until.lock().unwrap() >= end);

        *grace.until.lock() = Some(Instant::now());
        assert!(!grace.holds(), "over");
        assert!(!grace.holding.load(Ordering::Relaxed), "cleared once over");
    }
}
