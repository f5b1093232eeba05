//! Which connections get served: the registry of connections with its two
//! caps (pending handshakes, handshaken connections), the per-connection
//! time limits, and the counters of what was refused or closed.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Instant;

use crate::client_id_clashes::{ClientIdClashes, CLASH_REPLACEMENTS, CLASH_WINDOW};
use crate::conns::{Connections, Recorded};
use crate::limits::Timeouts;
use crate::stats::{CloseReason, Counters, ServerStats};
use rdma_transport::log_limit::{LogLimit, WARN_INTERVAL};

/// The server's connection limits, shared by the acceptor and every
/// connection thread.
#[derive(Debug)]
pub(crate) struct Admission {
    pub(crate) conns: Arc<Connections>,
    pub(crate) timeouts: Timeouts,
    /// Handshaken connections served at once.
    pub(crate) max_connections: usize,
    /// Connections waiting for their HELLO at once.
    max_pending: usize,
    counters: Counters,
    evict_log: LogLimit,
    pub(crate) full_log: LogLimit,
    pub(crate) accept_log: LogLimit,
    clashes: ClientIdClashes,
    clash_log: LogLimit,
}

impl Admission {
    pub(crate) fn new(timeouts: Timeouts, max_connections: usize, max_pending: usize) -> Self {
        Self {
            conns: Arc::new(Connections::default()),
            timeouts,
            max_connections,
            max_pending,
            counters: Counters::default(),
            evict_log: LogLimit::new(WARN_INTERVAL),
            full_log: LogLimit::new(WARN_INTERVAL),
            accept_log: LogLimit::new(WARN_INTERVAL),
            clashes: ClientIdClashes::default(),
            clash_log: LogLimit::new(WARN_INTERVAL),
        }
    }

    /// Records a newly accepted connection (by a duplicate of its socket)
    /// as pending; over the pending cap, the oldest pending connection is
    /// closed to make room. `None` once the server is stopping.
    pub(crate) fn admit(&self, duplicate: TcpStream) -> Option<Recorded> {
        let admitted = self.conns.record(duplicate, self.max_pending)?;
        if admitted.evicted {
            self.closed(CloseReason::EvictedPending);
            if let Some(suppressed) = self.evict_log.event() {
                tracing::warn!(
                    max_pending_handshakes = self.max_pending,
                    suppressed,
                    "too many connections without a handshake; closed the oldest"
                );
            }
        }
        Some(admitted.recorded)
    }

    pub(crate) fn closed(&self, reason: CloseReason) {
        self.counters.closed(reason);
    }

    /// A new data connection of `client_id` ended `ended` (> 0) older
    /// ones: counted, and a clash of two clients on that id is reported.
    pub(crate) fn superseded(&self, client_id: u64, ended: usize) {
        for _ in 0..ended {
            self.counters.closed(CloseReason::Superseded);
        }
        if !self.clashes.replaced(client_id, Instant::now()) {
            return;
        }
        self.counters.client_id_clashed();
        if let Some(suppressed) = self.clash_log.event() {
            tracing::warn!(
                client_id,
                replacements = CLASH_REPLACEMENTS,
                within_s = CLASH_WINDOW.as_secs(),
                suppressed,
                "a client id's connections keep ending each other: two live clients use it \
                 (each fails the other's requests); give each live manager its own \
                 ManagerConfig::client_id"
            );
        }
    }

    pub(crate) fn accept_failed(&self) {
        self.counters.accept_failed();
    }

    pub(crate) fn stats(&self) -> ServerStats {
        let (pending, handshaken) = self.conns.counts();
        self.counters.snapshot(pending, handshaken)
    }
}
