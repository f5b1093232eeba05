//! A request's deadline whose clock read can wait until it is needed.
//!
//! On some hosts (VMs whose clocksource is the HPET) reading the clock is a
//! system call. A one-page RDMA request that completes inside
//! `ibv_post_send` never needs its deadline, so it should not pay for it: a
//! lazy deadline is fixed the first time anything asks for it, i.e. the first
//! time the request has to wait (for a frame, a slot, room in the send queue,
//! or, after a few polls, its completion). It then runs at most those few
//! polls later than the submission.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// A point in time by which a request must be done.
#[derive(Debug)]
pub(crate) struct Deadline {
    timeout: Duration,
    at: Cell<Option<Instant>>,
}

impl Deadline {
    /// `timeout` from the first time the deadline is asked for.
    pub(crate) fn lazy(timeout: Duration) -> Self {
        Self {
            timeout,
            at: Cell::new(None),
        }
    }

    /// A deadline fixed at `at`.
    pub(crate) fn at(at: Instant) -> Self {
        Self {
            timeout: Duration::ZERO,
            at: Cell::new(Some(at)),
        }
    }

    /// The deadline (fixing it now if it is lazy and not fixed yet).
    pub(crate) fn get(&self) -> Instant {
        match self.at.get() {
            Some(at) => at,
            None => {
                let at = Instant::now() + self.timeout;
                self.at.set(Some(at));
                at
            }
        }
    }

    /// Whether the deadline has passed.
    pub(crate) fn passed(&self) -> bool {
        Instant::now() >= self.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lazy_deadline_is_fixed_on_first_use() {
        let d = Deadline::lazy(Duration::from_millis(50));
        std::thread::sleep(Duration::from_millis(20));
        let before = Instant::now();
        let at = d.get();
        assert!(at >= before + Duration::from_millis(50));
        assert_eq!(d.get(), at, "fixed once");
        assert!(!d.passed());
        let fixed = Deadline::at(Instant::now());
        assert!(fixed.passed());
    }
}
