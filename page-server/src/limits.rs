//! Per-connection time limits: a connection must finish its HELLO handshake
//! within `handshake_timeout` of being accepted (a deadline on the whole
//! handshake, however its bytes trickle in), and a handshaken one is closed
//! after `idle_timeout` without a complete request.
//!
//! The data path pays nothing per request but an add: time is only read
//! where the connection would wait for data anyway (or when a read brought
//! no complete request), see [`Watchdog::check`].

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::admission::Admission;
use crate::conns::{Promotion, Recorded};
use crate::stats::CloseReason;

/// The time limits of a connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// From accept to the end of the HELLO handshake.
    pub(crate) handshake: Duration,
    /// Without a complete request, once handshaken; `None`: no limit.
    pub(crate) idle: Option<Duration>,
}

/// Which limit a connection broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expired {
    Handshake,
    Idle,
}

/// Keeps time for one connection.
#[derive(Debug)]
pub(crate) struct Watchdog {
    timeouts: Timeouts,
    accepted_at: Instant,
    handshaken: bool,
    /// Complete requests received (counted on the fast path).
    requests: u64,
    /// `requests` at the last check.
    seen: u64,
    /// When a check last saw `requests` change (or the handshake end): no
    /// complete request has arrived since, as far as checks know.
    quiet_since: Instant,
}

impl Watchdog {
    pub(crate) fn new(accepted_at: Instant, timeouts: Timeouts) -> Self {
        Self {
            timeouts,
            accepted_at,
            handshaken: false,
            requests: 0,
            seen: 0,
            quiet_since: accepted_at,
        }
    }

    /// Counts one complete request.
    #[inline]
    pub(crate) fn count_request(&mut self) {
        self.requests = self.requests.wrapping_add(1);
    }

    pub(crate) fn is_handshaken(&self) -> bool {
        self.handshaken
    }

    fn handshake_done(&mut self, now: Instant) {
        self.handshaken = true;
        self.seen = self.requests;
        self.quiet_since = now;
    }

    /// Called where the connection is about to wait for data, or after a
    /// read that brought no complete request: how long it may wait
    /// (`None`: no limit), or the limit it broke.
    ///
    /// A request counted since the last check restarts the idle time at
    /// `now`; callers check right before they block (after any spin), so
    /// that is within a spin of the last request's arrival.
    pub(crate) fn check(&mut self, now: Instant) -> Result<Option<Duration>, Expired> {
        if !self.handshaken {
            let deadline = self.accepted_at + self.timeouts.handshake;
            return match deadline.checked_duration_since(now) {
                Some(left) if !left.is_zero() => Ok(Some(left)),
                _ => Err(Expired::Handshake),
            };
        }
        let Some(idle) = self.timeouts.idle else {
            return Ok(None);
        };
        if self.requests != self.seen {
            self.seen = self.requests;
            self.quiet_since = now;
        }
        let quiet = now.saturating_duration_since(self.quiet_since);
        match idle.checked_sub(quiet) {
            Some(left) if !left.is_zero() => Ok(Some(left)),
            _ => Err(Expired::Idle),
        }
    }
}

/// One served connection's limits: its [`Watchdog`], and its place in the
/// registry (pending until its HELLO, then counted against
/// `max_connections`).
#[derive(Debug)]
pub(crate) struct ConnGuard {
    watchdog: Watchdog,
    recorded: Recorded,
    admission: Arc<Admission>,
    coherence_node: bool,
}

impl ConnGuard {
    pub(crate) fn new(accepted_at: Instant, recorded: Recorded, admission: Arc<Admission>) -> Self {
        Self {
            watchdog: Watchdog::new(accepted_at, admission.timeouts),
            recorded,
            admission,
            coherence_node: false,
        }
    }

    #[inline]
    pub(crate) fn count_request(&mut self) {
        self.watchdog.count_request();
    }

    #[inline]
    pub(crate) fn is_handshaken(&self) -> bool {
        self.watchdog.is_handshaken()
    }

    /// The connection said a good HELLO: it moves from the pending to the
    /// handshaken connections. `false` when it must be closed instead (no
    /// HELLO_ACK sent): `max_connections` are open, or it was evicted.
    pub(crate) fn handshake_done(&mut self) -> bool {
        let max = self.admission.max_connections;
        match self.recorded.promote(max) {
            Promotion::Promoted => {
                self.watchdog.handshake_done(Instant::now());
                true
            }
            Promotion::Full => {
                self.admission.closed(CloseReason::RefusedFull);
                if let Some(suppressed) = self.admission.full_log.event() {
                    tracing::warn!(
                        max_connections = max,
                        suppressed,
                        "handshaken connections at their limit; closing a new one after its HELLO"
                    );
                }
                false
            }
            Promotion::Evicted => false,
        }
    }

    /// [`Watchdog::check`] at `now`; a broken limit is counted and becomes
    /// a `TimedOut` error that ends the connection.
    /// Records how the client moves pages; false when it may not keep its
    /// RDMA session (see `Connections::note_rdma`).
    pub(crate) fn note_rdma(&self, rdma: crate::conns::RdmaUse) -> bool {
        self.recorded.note_rdma(rdma)
    }

    /// See [`Recorded::supersede_older`].
    ///
    /// Older connections ended are counted (and a clash of two clients
    /// on one id reported: `Admission::superseded`).
    pub(crate) fn supersede_older(&self, client_id: u64, within: Duration) -> Result<usize, usize> {
        let outcome = self.recorded.supersede_older(client_id, within);
        let ended = outcome.unwrap_or_default();
        if ended > 0 {
            self.admission.superseded(client_id, ended);
        }
        outcome
    }

    /// Whether the connection joined the coherence directory as a node.
    pub(crate) fn is_coherence_node(&self) -> bool {
        self.coherence_node
    }

    /// The connection joined the coherence directory as a node: a replica
    /// recovery's fence leaves it open (see `Connections::fence`).
    pub(crate) fn note_coherence_node(&mut self) {
        if !self.coherence_node {
            self.coherence_node = true;
            self.recorded.note_coherence_node();
        }
    }

    /// The connection's pages move by RDMA, not over its socket, which then
    /// carries no requests: the idle timeout does not apply to it (closing
    /// it would tear down the client's QP).
    pub(crate) fn exempt_from_idle_timeout(&mut self) {
        self.watchdog.timeouts.idle = None;
    }

    pub(crate) fn check(&mut self, now: Instant) -> io::Result<Option<Duration>> {
        self.watchdog.check(now).map_err(|expired| {
            let (reason, what) = match expired {
                Expired::Handshake => (CloseReason::HandshakeTimeout, "no HELLO handshake in time"),
                Expired::Idle => (CloseReason::IdleTimeout, "idle for too long"),
            };
            self.admission.closed(reason);
            io::Error::new(io::ErrorKind::TimedOut, what)
        })
    }

    /// Counts a close for a protocol error.
    pub(crate) fn protocol_error(&self) {
        self.admission.closed(CloseReason::ProtocolError);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn dog(idle_ms: Option<u64>) -> (Watchdog, Instant) {
        let t0 = Instant::now();
        let timeouts = Timeouts {
            handshake: 500 * MS,
            idle: idle_ms.map(Duration::from_millis),
        };
        (Watchdog::new(t0, timeouts), t0)
    }

    #[test]
    fn the_handshake_deadline_counts_from_accept_whatever_arrives() {
        let (mut w, t0) = dog(Some(1000));
        assert_eq!(w.check(t0), Ok(Some(500 * MS)));
        // Requests before HELLO (e.g. READs answered NO_HELLO) do not help.
        for _ in 0..10 {
            w.count_request();
        }
        assert_eq!(w.check(t0 + 400 * MS), Ok(Some(100 * MS)));
        assert_eq!(w.check(t0 + 500 * MS), Err(Expired::Handshake));
    }

    #[test]
    fn idle_time_restarts_at_a_check_that_sees_a_new_request() {
        let (mut w, t0) = dog(Some(1000));
        w.handshake_done(t0 + 100 * MS);
        assert_eq!(w.check(t0 + 600 * MS), Ok(Some(500 * MS)));
        w.count_request();
        assert_eq!(w.check(t0 + 1050 * MS), Ok(Some(1000 * MS)));
        // Bytes that complete no request do not reset it.
        assert_eq!(w.check(t0 + 1500 * MS), Ok(Some(550 * MS)));
        assert_eq!(w.check(t0 + 2050 * MS), Err(Expired::Idle));
    }

    #[test]
    fn no_idle_limit_means_waiting_forever_once_handshaken() {
        let (mut w, t0) = dog(None);
        assert_eq!(w.check(t0), Ok(Some(500 * MS)));
        w.handshake_done(t0);
        assert_eq!(w.check(t0 + 3_600_000 * MS), Ok(None));
    }
}
