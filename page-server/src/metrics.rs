//! Prometheus metrics of the page-server (OpenMetrics text, served by
//! `metrics_http.rs` on `--metrics-listen`):
//!
//! | metric | type | labels |
//! | --- | --- | --- |
//! | `page_server_pages_served_total` | counter | `op` (`read`, `write`) |
//! | `page_server_bytes_total` | counter | `op` |
//! | `page_server_request_errors_total` | counter | `op` (answered with an error status) |
//! | `page_server_request_duration_seconds` | histogram | `op` (end of the previous request of the batch, or the read that brought it, to answer queued; see `RequestTally`) |
//! | `page_server_read_sums_kept_total` | counter | (checksummed READ answers sent out of the region with the sum kept since the page was written: no copy; `page_sums.rs`) |
//! | `page_server_checksum_failures_total` | counter | `carrier` (`write`, `coherence_frame`: refused because the checksum did not match, i.e. damaged on the way) |
//! | `page_server_connections` | gauge | `state` (`handshaken`, `pending`) |
//! | `page_server_connections_closed_total` | counter | `reason` (closed or refused by the server's limits, `ServerStats`: `evicted_pending`, `refused_full`, `handshake_timeout`, `idle_timeout`, `protocol_error`, `dead_peer`, `superseded`: ended by a newer connection of its client) |
//! | `page_server_client_id_clashes_total` | counter | (times two live clients were seen sharing one client id: their connections ended each other 20 times within 10 s) |
//! | `page_server_registrations_put_off_total` | counter | (registrations put off because another process of this node id was alive) |
//! | `page_server_superseded` | gauge | (1 once another process registered as this node after this one: this one serves no more) |
//! | `page_server_stalls_total` | counter | (times this process did not run for `--stall-fence-ms` and then served nothing until the coordinator confirmed it was still the node's process) |
//! | `page_server_lease_lapses_total` | counter | (times the coordinator answered no heartbeat for `--lease-fence-ms`, after which this process served nothing until it answered one) |
//! | `page_server_requests_held_by_fence_total` | counter | (batches of requests that waited for the coordinator's word after a stall or a lease lapse) |
//! | `page_server_fenced` | gauge | (1 while this process serves nothing for want of the coordinator's word) |
//! | `page_server_accept_errors_total` | counter | (`accept` calls that failed, e.g. out of descriptors) |
//! | `page_server_replica_recoveries_total` | counter | `outcome` (`done`: the replica is live again; `failed`: failed or overtaken, retried a period later) |
//! | `page_server_replica_recovered_pages_total` | counter | (pages copied in from a live replica) |
//! | `page_server_replica_recovery_running` | gauge | (1 while a recovery copies a range here) |
//! | `page_server_coherence_events_total` | counter | `event` (the coherence home's counters, `coherence::HomeStats`: `shared_grants`, `exclusive_grants`, `upgrades`, `invalidation_rounds`, `invalidations_sent`, `downgrades_sent`, `queued`, `retries`, `lost_answers`, `pages_lost`, `write_backs`, ..., `refused_frames`, `rdma_frames`: frames that came over RDMA message channels, and `bound_frames`: frames whose checksum covered their offset and body, from nodes that agreed to offset-bound sums, and `restart_grace_retries`: requests answered Retry while a restarted home waits out the copies of nodes cut off from its predecessor) |
//! | `page_server_coherence_pages` | gauge | (pages with a coherence directory entry) |
//!
//! Only TCP requests pass through the server: RDMA reads and writes are
//! one-sided (the client's NIC reaches the memory) and are not counted.

use std::fmt;
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rdma_transport::PAGE_SIZE;

use crate::duration_histogram::{DurationHistogram, LocalDurations};
use crate::stats::ServerStats;

/// A page operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    Write,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CarrierLabels {
    carrier: &'static str,
}

/// What arrived with a checksum that did not match
/// ([`PageMetrics::checksum_failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Damaged {
    /// A WRITE's page or offset.
    Write,
    /// A coherence frame's page, body or offset.
    CoherenceFrame,
}

impl Damaged {
    fn label(self) -> &'static str {
        match self {
            Self::Write => "write",
            Self::CoherenceFrame => "coherence_frame",
        }
    }
}

/// One operation's metrics, taken out of their families once so that the
/// serving path touches no family map.
#[derive(Debug, Clone)]
struct OpMetrics {
    served: Counter,
    bytes: Counter,
    errors: Counter,
    duration: DurationHistogram,
}

impl OpMetrics {
    fn publish(&self, tally: &mut OpTally) {
        if tally.served != 0 {
            self.served.inc_by(tally.served);
            self.bytes.inc_by(tally.served * PAGE_SIZE as u64);
        }
        if tally.errors != 0 {
            self.errors.inc_by(tally.errors);
        }
        (tally.served, tally.errors) = (0, 0);
        self.duration.publish(&mut tally.durations);
    }
}

/// One operation's requests that one connection has answered but not yet
/// published.
#[derive(Debug, Default)]
struct OpTally {
    served: u64,
    errors: u64,
    durations: LocalDurations,
}

/// One connection's requests not yet added to the shared metrics: the
/// serving path counts into it without touching anything shared and
/// publishes it (`PageMetrics::publish`) once per batch of answers, before
/// they are sent.
///
/// A request's duration runs from `mark` (the end of the previous request
/// of the batch, or the moment its bytes were read) to its answer being
/// queued: one clock read per request.
#[derive(Debug)]
pub(crate) struct RequestTally {
    mark: Instant,
    read: OpTally,
    write: OpTally,
    /// READ answers sent with a kept sum (`PageSums::cached`).
    kept_sums: u64,
}

impl RequestTally {
    pub fn new() -> Self {
        Self {
            mark: Instant::now(),
            read: OpTally::default(),
            write: OpTally::default(),
            kept_sums: 0,
        }
    }

    /// Starts the next request's duration now (after a wait or work that
    /// is not a page request's).
    pub fn restart(&mut self) {
        self.mark = Instant::now();
    }

    /// When the current request's duration started.
    pub fn started(&self) -> Instant {
        self.mark
    }

    /// Counts a READ answer sent with its page's kept sum (no copy).
    pub fn record_kept_sum(&mut self) {
        self.kept_sums += 1;
    }

    /// Counts one page request whose answer was just queued; `ok` when it
    /// was served.
    pub fn record(&mut self, op: Op, ok: bool) {
        let now = Instant::now();
        let tally = match op {
            Op::Read => &mut self.read,
            Op::Write => &mut self.write,
        };
        if ok {
            tally.served += 1;
        } else {
            tally.errors += 1;
        }
        tally
            .durations
            .record(now.saturating_duration_since(self.mark));
        self.mark = now;
    }
}

/// The page-server's metrics.
pub(crate) struct PageMetrics {
    registry: Registry,
    read: OpMetrics,
    write: OpMetrics,
    kept_sums: Counter,
    checksum_failures: Family<CarrierLabels, Counter>,
    connections: Family<StateLabels, Gauge>,
    closed: Family<ReasonLabels, Counter>,
    accept_errors: Counter,
    client_id_clashes: Counter,
    registrations_put_off: Counter,
    superseded: Gauge,
    stalls: Counter,
    lease_lapses: Counter,
    held_by_fence: Counter,
    fenced: Gauge,
    recoveries: Family<OutcomeLabels, Counter>,
    recovered_pages: Counter,
    recovery_running: Gauge,
    coherence_events: Family<EventLabels, Counter>,
    coherence_pages: Gauge,
}

impl fmt::Debug for PageMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageMetrics").finish_non_exhaustive()
    }
}

impl PageMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("page_server");
        let served = Family::<OpLabels, Counter>::default();
        let bytes = Family::<OpLabels, Counter>::default();
        let errors = Family::<OpLabels, Counter>::default();
        let durations = Family::<OpLabels, DurationHistogram>::default();
        let connections = Family::<StateLabels, Gauge>::default();
        let kept_sums = Counter::default();
        let checksum_failures = Family::<CarrierLabels, Counter>::default();
        registry.register("pages_served", "Pages read or written", served.clone());
        registry.register(
            "checksum_failures",
            "WRITEs and coherence frames refused because their checksum did not match (damaged on the way)",
            checksum_failures.clone(),
        );
        for what in [Damaged::Write, Damaged::CoherenceFrame] {
            // Shown at 0 from the start: an alert can watch it.
            drop(checksum_failures.get_or_create(&CarrierLabels {
                carrier: what.label(),
            }));
        }
        registry.register(
            "read_sums_kept",
            "Checksummed READ answers sent out of the region with the sum kept since the page was written",
            kept_sums.clone(),
        );
        registry.register("bytes", "Page bytes read or written", bytes.clone());
        registry.register(
            "request_errors",
            "Page requests answered with an error status",
            errors.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time a page request took, from the end of the one before it in the batch (or the read that brought it) to its queued answer",
            durations.clone(),
        );
        registry.register(
            "connections",
            "Client connections open now",
            connections.clone(),
        );
        let closed = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "connections_closed",
            "Connections closed or refused by the server's limits, or ended by a newer connection of their client, by reason",
            closed.clone(),
        );
        let accept_errors = Counter::default();
        registry.register(
            "accept_errors",
            "accept calls that failed (e.g. out of file descriptors)",
            accept_errors.clone(),
        );
        let client_id_clashes = Counter::default();
        registry.register(
            "client_id_clashes",
            "Times two live clients were seen sharing one client id (their connections ended each other 20 times within 10 s)",
            client_id_clashes.clone(),
        );
        let registrations_put_off = Counter::default();
        registry.register(
            "registrations_put_off",
            "Registrations put off because another process of this node id was alive (its lease current, its address accepting connections)",
            registrations_put_off.clone(),
        );
        let superseded = Gauge::default();
        registry.register(
            "superseded",
            "1 once another process registered as this node after this one: this one closed every connection and serves no more",
            superseded.clone(),
        );
        let stalls = Counter::default();
        registry.register(
            "stalls",
            "Times this process did not run for the stall threshold (stopped, paused) and then served nothing until the coordinator confirmed it was still the node's process",
            stalls.clone(),
        );
        let lease_lapses = Counter::default();
        registry.register(
            "lease_lapses",
            "Times the coordinator answered no heartbeat for the lease fence, after which this process served nothing until it answered one",
            lease_lapses.clone(),
        );
        let held_by_fence = Counter::default();
        registry.register(
            "requests_held_by_fence",
            "Batches of requests that waited for the coordinator to confirm this process, after a stall or a lease lapse",
            held_by_fence.clone(),
        );
        let fenced = Gauge::default();
        registry.register(
            "fenced",
            "1 while this process serves nothing for want of the coordinator's word (after a stall or a lease lapse)",
            fenced.clone(),
        );
        let recoveries = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "replica_recoveries",
            "Replica recoveries that ended, by outcome (done: live again; failed: retried a period later)",
            recoveries.clone(),
        );
        let recovered_pages = Counter::default();
        registry.register(
            "replica_recovered_pages",
            "Pages copied in from a live replica by recoveries",
            recovered_pages.clone(),
        );
        let recovery_running = Gauge::default();
        registry.register(
            "replica_recovery_running",
            "1 while a replica recovery copies a range here",
            recovery_running.clone(),
        );
        let coherence_events = Family::<EventLabels, Counter>::default();
        let coherence_pages = Gauge::default();
        registry.register(
            "coherence_events",
            "Coherence home events (grants, callbacks, write-backs, lost pages, refused frames)",
            coherence_events.clone(),
        );
        registry.register(
            "coherence_pages",
            "Pages with a coherence directory entry",
            coherence_pages.clone(),
        );
        let op = |name: &'static str| {
            let labels = OpLabels { op: name };
            OpMetrics {
                served: served.get_or_create(&labels).clone(),
                bytes: bytes.get_or_create(&labels).clone(),
                errors: errors.get_or_create(&labels).clone(),
                duration: durations.get_or_create(&labels).clone(),
            }
        };
        Self {
            read: op("read"),
            write: op("write"),
            kept_sums,
            checksum_failures,
            registry,
            connections,
            closed,
            accept_errors,
            client_id_clashes,
            registrations_put_off,
            superseded,
            stalls,
            lease_lapses,
            held_by_fence,
            fenced,
            recoveries,
            recovered_pages,
            recovery_running,
            coherence_events,
            coherence_pages,
        }
    }

    /// Adds a connection's tally to the metrics and empties it.
    pub fn publish(&self, tally: &mut RequestTally) {
        self.read.publish(&mut tally.read);
        self.write.publish(&mut tally.write);
        if tally.kept_sums != 0 {
            self.kept_sums.inc_by(tally.kept_sums);
            tally.kept_sums = 0;
        }
    }

    /// READ answers sent with a kept sum so far (`ServerStats`).
    pub fn kept_sums(&self) -> u64 {
        self.kept_sums.get()
    }

    /// Counts one refused WRITE or coherence frame whose checksum did not
    /// match.
    pub(crate) fn checksum_failed(&self, what: Damaged) {
        self.checksum_failures
            .get_or_create(&CarrierLabels {
                carrier: what.label(),
            })
            .inc();
    }

    /// Checksum failures so far, of every kind (`ServerStats`).
    pub(crate) fn checksum_failures(&self) -> u64 {
        [Damaged::Write, Damaged::CoherenceFrame]
            .into_iter()
            .map(|what| {
                self.checksum_failures
                    .get_or_create(&CarrierLabels {
                        carrier: what.label(),
                    })
                    .get()
            })
            .sum()
    }

    /// The OpenMetrics text, with the connection and recovery figures from
    /// `stats` and the coherence home's counters from `coherence`.
    pub fn render(
        &self,
        stats: &ServerStats,
        coherence: &crate::coherence_home::CoherenceStats,
    ) -> Result<String, fmt::Error> {
        let h = &coherence.home;
        for (event, now) in [
            ("shared_grants", h.shared_grants),
            ("exclusive_grants", h.exclusive_grants),
            ("upgrades", h.upgrades),
            ("invalidation_rounds", h.invalidation_rounds),
            ("invalidations_sent", h.invalidations_sent),
            ("downgrades_sent", h.downgrades_sent),
            ("queued", h.queued),
            ("retries", h.retries),
            ("lost_answers", h.lost_answers),
            ("pages_lost", h.pages_lost),
            ("write_backs", h.write_backs),
            ("duplicate_requests", h.duplicate_requests),
            ("stale_acks", h.stale_acks),
            ("stale_write_backs", h.stale_write_backs),
            ("actions_overflow", h.actions_overflow),
            ("refused_frames", coherence.refused_frames),
            ("rdma_frames", coherence.rdma_frames),
            ("bound_frames", coherence.bound_frames),
            ("restart_grace_retries", coherence.restart_grace_retries),
        ] {
            catch_up(
                &self.coherence_events.get_or_create(&EventLabels { event }),
                now,
            );
        }
        self.coherence_pages
            .set(i64::try_from(coherence.pages).unwrap_or(i64::MAX));
        let gauge = |state| {
            self.connections
                .get_or_create(&StateLabels { state })
                .clone()
        };
        gauge("handshaken").set(i64::try_from(stats.handshaken_connections).unwrap_or(i64::MAX));
        gauge("pending").set(i64::try_from(stats.pending_handshakes).unwrap_or(i64::MAX));
        for (reason, now) in [
            ("evicted_pending", stats.evicted_pending),
            ("refused_full", stats.refused_full),
            ("handshake_timeout", stats.handshake_timeouts),
            ("idle_timeout", stats.idle_timeouts),
            ("protocol_error", stats.protocol_errors),
            ("dead_peer", stats.dead_peers),
            ("superseded", stats.superseded_connections),
        ] {
            catch_up(&self.closed.get_or_create(&ReasonLabels { reason }), now);
        }
        catch_up(&self.accept_errors, stats.accept_errors);
        catch_up(&self.client_id_clashes, stats.client_id_clashes);
        catch_up(&self.registrations_put_off, stats.registrations_put_off);
        catch_up(&self.stalls, stats.stalls);
        catch_up(&self.lease_lapses, stats.lease_lapses);
        catch_up(&self.held_by_fence, stats.requests_held_by_fence);
        self.fenced.set(i64::from(stats.fenced));
        self.superseded.set(i64::from(stats.superseded));
        for (outcome, now) in [
            ("done", stats.recoveries),
            ("failed", stats.recovery_failures),
        ] {
            catch_up(
                &self.recoveries.get_or_create(&OutcomeLabels { outcome }),
                now,
            );
        }
        catch_up(&self.recovered_pages, stats.recovered_pages);
        self.recovery_running.set(i64::from(stats.recovery_running));
        let mut text = String::new();
        encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// Brings `counter` up to `now`, a count kept elsewhere that only grows
/// (the home's, the server's stats).
fn catch_up(counter: &Counter, now: u64) {
    counter.inc_by(now.saturating_sub(counter.get()));
}
