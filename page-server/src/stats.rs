//! Counters of connections refused or closed by the server's limits, by
//! reason, and of replica recoveries; and the snapshot [`ServerStats`] that
//! `RunningServer::stats` returns (for tests and, later, metrics).

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// Connections refused or closed by the page-server, by reason, since it
/// started; and the connections open now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerStats {
    /// Connections open now that have not finished the HELLO handshake.
    pub pending_handshakes: usize,
    /// Connections open now that have finished it.
    pub handshaken_connections: usize,
    /// Unhandshaken connections closed because `max_pending_handshakes`
    /// were already waiting (the oldest waiting one is closed).
    pub evicted_pending: u64,
    /// Connections closed after their HELLO because `max_connections`
    /// handshaken connections were already open (no HELLO_ACK is sent).
    pub refused_full: u64,
    /// Connections closed because they did not finish the handshake within
    /// `handshake_timeout`.
    pub handshake_timeouts: u64,
    /// Handshaken connections closed after `idle_timeout` without a
    /// complete request.
    pub idle_timeouts: u64,
    /// Connections closed after a malformed header.
    pub protocol_errors: u64,
    /// Connections whose peer stopped answering for `dead_peer_timeout`
    /// (its host went away: keepalive probes or sent answers were never
    /// acknowledged), closed by the kernel.
    pub dead_peers: u64,
    /// `accept` calls that failed (e.g. out of file descriptors).
    pub accept_errors: u64,
    /// A replica recovery is running now (this node copies one of its
    /// ranges from a live replica; see `recovery.rs`).
    pub recovery_running: bool,
    /// The first GPA of the range being recovered now (`None` when
    /// `recovery_running` is false).
    pub recovering_gpa_start: Option<u64>,
    /// Recoveries that completed (the coordinator marked the replica live).
    pub recoveries: u64,
    /// Recoveries that failed or were overtaken (retried a period later).
    pub recovery_failures: u64,
    /// Pages copied in from a live replica by recoveries (pages a client
    /// wrote during a recovery are not counted: the copy skipped them).
    pub recovered_pages: u64,
    /// Checksummed READ answers sent out of the region with the checksum
    /// kept since the page was written, without a copy (0 on a server with
    /// RDMA or without checksums, which keeps no sums).
    pub reads_with_kept_sums: u64,
    /// WRITEs and coherence frames refused because their checksum did not
    /// match: damaged on the way (metric
    /// `page_server_checksum_failures_total{carrier}`).
    pub checksum_failures: u64,
    /// Data connections ended because their client opened a newer one
    /// (same client id; see docs/wire-protocol.md, "Handshake").
    pub superseded_connections: u64,
    /// Times a client id's connections ended each other at least 20 times
    /// within 10 s: two live clients share that id (logged at WARN).
    pub client_id_clashes: u64,
    /// Registrations put off because another process of this node id was
    /// alive (its lease current, its address accepting connections).
    pub registrations_put_off: u64,
    /// Another process registered as this node after this one: this one
    /// closed every connection and takes no more.
    pub superseded: bool,
    /// Stalls of this process (it did not run for `stall_fence`) after
    /// which it served nothing until the coordinator confirmed it was
    /// still the node's process.
    pub stalls: u64,
    /// Times the coordinator answered no heartbeat for `lease_fence`, after
    /// which this process served nothing until it answered one.
    pub lease_lapses: u64,
    /// Batches of requests that waited for the coordinator's word after a
    /// stall or a lease lapse.
    pub requests_held_by_fence: u64,
    /// Whether this process serves nothing now, for want of the
    /// coordinator's word.
    pub fenced: bool,
}

/// Why the server refused or closed a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CloseReason {
    EvictedPending,
    RefusedFull,
    HandshakeTimeout,
    IdleTimeout,
    ProtocolError,
    DeadPeer,
    Superseded,
}

/// The live counters behind [`ServerStats`] (the gauges come from the
/// connection registry).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    evicted_pending: AtomicU64,
    refused_full: AtomicU64,
    handshake_timeouts: AtomicU64,
    idle_timeouts: AtomicU64,
    protocol_errors: AtomicU64,
    dead_peers: AtomicU64,
    accept_errors: AtomicU64,
    superseded: AtomicU64,
    client_id_clashes: AtomicU64,
}

impl Counters {
    pub(crate) fn closed(&self, reason: CloseReason) {
        let counter = match reason {
            CloseReason::EvictedPending => &self.evicted_pending,
            CloseReason::RefusedFull => &self.refused_full,
            CloseReason::HandshakeTimeout => &self.handshake_timeouts,
            CloseReason::IdleTimeout => &self.idle_timeouts,
            CloseReason::ProtocolError => &self.protocol_errors,
            CloseReason::DeadPeer => &self.dead_peers,
            CloseReason::Superseded => &self.superseded,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn client_id_clashed(&self) {
        self.client_id_clashes.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn accept_failed(&self) {
        self.accept_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters, with the given gauges.
    pub(crate) fn snapshot(&self, pending: usize, handshaken: usize) -> ServerStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ServerStats {
            pending_handshakes: pending,
            handshaken_connections: handshaken,
            evicted_pending: get(&self.evicted_pending),
            refused_full: get(&self.refused_full),
            handshake_timeouts: get(&self.handshake_timeouts),
            idle_timeouts: get(&self.idle_timeouts),
            protocol_errors: get(&self.protocol_errors),
            dead_peers: get(&self.dead_peers),
            accept_errors: get(&self.accept_errors),
            superseded_connections: get(&self.superseded),
            client_id_clashes: get(&self.client_id_clashes),
            ..ServerStats::default()
        }
    }
}

/// The replica recovery's counters behind [`ServerStats`].
#[derive(Debug, Default)]
pub(crate) struct RecoveryCounters {
    /// The start of the range being recovered now.
    running: Mutex<Option<u64>>,
    recoveries: AtomicU64,
    failures: AtomicU64,
    pages: AtomicU64,
}

impl RecoveryCounters {
    /// `Some(gpa_start)` while the range at `gpa_start` recovers.
    pub(crate) fn set_running(&self, gpa_start: Option<u64>) {
        *self.running.lock() = gpa_start;
    }

    pub(crate) fn recovered(&self) {
        self.recoveries.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn failed(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn pages_copied(&self, pages: u64) {
        self.pages.fetch_add(pages, Ordering::Relaxed);
    }

    /// Fills the recovery fields of `stats`.
    pub(crate) fn fill(&self, stats: &mut ServerStats) {
        let running = *self.running.lock();
        stats.recovery_running = running.is_some();
        stats.recovering_gpa_start = running;
        stats.recoveries = self.recoveries.load(Ordering::Relaxed);
        stats.recovery_failures = self.failures.load(Ordering::Relaxed);
        stats.recovered_pages = self.pages.load(Ordering::Relaxed);
    }
}
