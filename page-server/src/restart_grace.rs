//! A coherence home that restarted grants nothing for a while: a node cut
//! off from the process before it (no reset reached it) may still read its
//! copies of that process's pages until its bound on the home's silence has
//! run out, and a page the new process granted to another node meanwhile
//! would be changed under it (docs/coherence.md, "A home that restarts").
//!
//! The new process cannot know who held what, nor when the old one went
//! silent, only that it went silent before this one started. Every node
//! declared a bound of at most `--node-dead-home-timeout-ms` (the home
//! refuses longer ones), so every copy of the old process's pages is gone
//! [`left_for_sure_within`] that bound after this process started. Until
//! then, when this node had a process before this one (the map named it
//! before it registered, or its state directory says an earlier process
//! held a range), every coherence request is answered `Retry`.
//!
//! A node that never had a process before waits for nothing: a cluster's
//! first start is not slowed down.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdma_transport::dead_peer::left_for_sure_within;

/// When this process started, and whether it had a predecessor.
#[derive(Debug)]
pub(crate) struct RestartGrace {
    started: Instant,
    length: Duration,
    /// Set when a predecessor is known of; cleared once the grace is over
    /// (so that a request costs one load afterwards).
    holding: AtomicBool,
}

impl RestartGrace {
    /// A process starting now whose nodes declared at most
    /// `node_bound_limit`.
    pub(crate) fn new(node_bound_limit: Duration) -> Self {
        Self {
            started: Instant::now(),
            length: left_for_sure_within(node_bound_limit),
            holding: AtomicBool::new(false),
        }
    }

    /// A process of this node ran before this one: what its nodes may
    /// still hold must be waited out. Logged once.
    pub(crate) fn had_predecessor(&self, why: &str) {
        if self.started.elapsed() >= self.length || self.holding.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::info!(
            why,
            grace_ms = self.length.as_millis() as u64,
            left_ms = self
                .length
                .saturating_sub(self.started.elapsed())
                .as_millis() as u64,
            "an earlier process of this node served its ranges: coherence requests wait \
             until nodes cut off from it have surely dropped their copies"
        );
    }

    /// Whether coherence requests must wait now.
    pub(crate) fn holds(&self) -> bool {
        if !self.holding.load(Ordering::Acquire) {
            return false;
        }
        if self.started.elapsed() < self.length {
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

        let over = RestartGrace {
            started: Instant::now() - Duration::from_secs(5),
            ..RestartGrace::new(Duration::from_millis(200))
        };
        over.had_predecessor("test");
        assert!(!over.holds(), "a grace already over holds nothing");
        let ended = RestartGrace {
            started: Instant::now() - Duration::from_secs(5),
            holding: AtomicBool::new(true),
            ..RestartGrace::new(Duration::from_millis(200))
        };
        assert!(!ended.holds());
        assert!(!ended.holding.load(Ordering::Relaxed), "cleared once over");
    }
}
