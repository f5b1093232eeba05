//! `--fail-node-after-ms T`: the failure instant, the operations that
//! spanned it, the failed operations by kind, and the thread that stops a
//! page-server T ms into a run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdma_transport::TransportError;
use serde::Serialize;

/// Operations that started this long before the failure instant count as
/// spanning it (one in flight when the node stops).
pub const SPAN_BEFORE: Duration = Duration::from_millis(10);
/// ... and this long after it (the failover: noticing the dead node,
/// retrying elsewhere, the map refresh, the hedged reads).
pub const SPAN_AFTER: Duration = Duration::from_millis(1000);

/// The operations that spanned a failure: those that started within
/// [fail_at - SPAN_BEFORE, fail_at + SPAN_AFTER].
#[derive(Debug, Clone, Copy)]
pub struct Window {
    from: Instant,
    to: Instant,
}

impl Window {
    /// The window around a failure at `fail_at`.
    pub fn around(fail_at: Instant) -> Self {
        Self {
            from: fail_at.checked_sub(SPAN_BEFORE).unwrap_or(fail_at),
            to: fail_at + SPAN_AFTER,
        }
    }

    /// Whether an operation that started at `t` spanned the failure.
    pub fn contains(&self, t: Instant) -> bool {
        self.from <= t && t <= self.to
    }
}

/// The stable name of a failed operation's error, for counting by kind.
pub fn kind_of(err: &TransportError) -> &'static str {
    match err {
        TransportError::UnknownGpa { .. } => "unknown_gpa",
        TransportError::Unaligned { .. } => "unaligned",
        TransportError::NodeDown { .. } => "node_down",
        TransportError::Timeout { .. } => "timeout",
        TransportError::AuthFailed { .. } => "auth_failed",
        TransportError::DataLost { .. } => "data_lost",
        TransportError::ReplicaMissedWrite { .. } => "replica_missed_write",
        TransportError::Protocol { .. } => "protocol",
        TransportError::Checksum { .. } => "checksum",
        TransportError::Refused { .. } => "refused",
        TransportError::Coordinator(_) => "coordinator",
        TransportError::Pool(_) | TransportError::PoolExhausted { .. } => "pool",
        TransportError::Config(_) => "config",
        TransportError::RdmaCompletion { .. } | TransportError::RdmaUnavailable(_) => "rdma",
        _ => "other",
    }
}

/// What a run saw of the failure (and of errors in general): failed pages
/// by kind, and the pages whose request spanned the failure.
#[derive(Debug)]
pub struct Disruption {
    /// Failed pages by [`kind_of`] their error.
    pub errors_by_kind: BTreeMap<&'static str, u64>,
    /// Latency of every page (failed or not) whose request started in the
    /// window; empty without a failure.
    pub spanned_ns: Histogram<u64>,
    /// Of those, the failed ones.
    pub spanned_errors: u64,
}

impl Disruption {
    pub fn new() -> Self {
        Self {
            errors_by_kind: BTreeMap::new(),
            spanned_ns: crate::workload::new_histogram(),
            spanned_errors: 0,
        }
    }

    /// Adds another thread's figures.
    pub fn merge(&mut self, other: &Self) {
        for (kind, n) in &other.errors_by_kind {
            *self.errors_by_kind.entry(kind).or_default() += n;
        }
        let _ = self.spanned_ns.add(&other.spanned_ns);
        self.spanned_errors += other.spanned_errors;
    }

    /// Records a request of `pages` pages that started at `started` and
    /// took `latency_ns`, failed with `err` or not.
    pub fn record(
        &mut self,
        window: Option<&Window>,
        started: Instant,
        latency_ns: u64,
        pages: u64,
        err: Option<&TransportError>,
    ) {
        if let Some(err) = err {
            *self.errors_by_kind.entry(kind_of(err)).or_default() += pages;
        }
        if window.is_some_and(|w| w.contains(started)) {
            let _ = self.spanned_ns.record_n(latency_ns.max(1), pages);
            if err.is_some() {
                self.spanned_errors += pages;
            }
        }
    }
}

impl Default for Disruption {
    fn default() -> Self {
        Self::new()
    }
}

/// The pages that spanned the failure, as reported.
#[derive(Debug, Clone, Serialize)]
pub struct Spanned {
    /// The window, in ms relative to the failure instant.
    pub window_ms: [i64; 2],
    pub pages: u64,
    pub errors: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Spanned {
    pub fn of(d: &Disruption) -> Self {
        let h = &d.spanned_ns;
        let us = |ns: u64| ns as f64 / 1000.0;
        let (p50, p99, max) = if h.is_empty() {
            (0.0, 0.0, 0.0)
        } else {
            (
                us(h.value_at_quantile(0.50)),
                us(h.value_at_quantile(0.99)),
                us(h.max()),
            )
        };
        Self {
            window_ms: [
                -(SPAN_BEFORE.as_millis() as i64),
                SPAN_AFTER.as_millis() as i64,
            ],
            pages: h.len(),
            errors: d.spanned_errors,
            p50_us: p50,
            p99_us: p99,
            max_us: max,
        }
    }
}

/// What a run with an injected failure reports (`failure` in the JSON).
#[derive(Debug, Clone, Serialize)]
pub struct FailureReport {
    /// The page-server stopped: the primary of the first range.
    pub node: String,
    /// `--fail-node-after-ms`.
    pub after_ms: u64,
    /// When the stop began, in ms from the start of the run.
    pub at_ms: f64,
    /// False when the run had ended before the stop (too few `--ops`).
    pub during_run: bool,
    /// Failed pages by kind of error.
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Pages whose content was checked and right: read pages as they
    /// arrived, written pages when read back after the run.
    pub verified_pages: u64,
    /// The requests that started around the failure.
    pub spanned: Spanned,
    /// Read runs that had requests around the failure: the bound on them: p99 below twice the read
    /// hedging delay (the manager's, just before the run) plus one round
    /// trip (the run's p50), max below the request deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound: Option<SpannedBound>,
    /// Write runs: reading every page back after the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readback: Option<crate::workload::Readback>,
}

/// Whether the requests around a failure stayed within the latency bound.
#[derive(Debug, Clone, Serialize)]
pub struct SpannedBound {
    pub hedge_delay_us: f64,
    pub round_trip_us: f64,
    /// `2 * hedge_delay_us + round_trip_us`.
    pub p99_bound_us: f64,
    pub request_timeout_us: f64,
    /// p99 below `p99_bound_us` and max below `request_timeout_us`.
    pub within: bool,
}

impl SpannedBound {
    pub fn of(spanned: &Spanned, hedge: Duration, round_trip_us: f64, timeout: Duration) -> Self {
        let hedge_delay_us = hedge.as_secs_f64() * 1e6;
        let p99_bound_us = 2.0 * hedge_delay_us + round_trip_us;
        let request_timeout_us = timeout.as_secs_f64() * 1e6;
        Self {
            hedge_delay_us,
            round_trip_us,
            p99_bound_us,
            request_timeout_us,
            within: spanned.p99_us < p99_bound_us && spanned.max_us < request_timeout_us,
        }
    }
}

/// A failure scheduled for `fail_at`, run by a thread of its own.
pub struct Injector {
    handle: std::thread::JoinHandle<Instant>,
}

impl Injector {
    /// Calls `stop` (which stops a page-server) at `fail_at`.
    ///
    /// # Errors
    /// When the thread cannot be started.
    pub fn schedule(
        fail_at: Instant,
        stop: impl FnOnce() + Send + 'static,
    ) -> anyhow::Result<Self> {
        let handle = std::thread::Builder::new()
            .name("bench-fail-node".into())
            .spawn(move || {
                let wait = fail_at.saturating_duration_since(Instant::now());
                std::thread::sleep(wait);
                let at = Instant::now();
                stop();
                at
            })?;
        Ok(Self { handle })
    }

    /// Waits for the failure to have happened; returns when it began.
    ///
    /// # Errors
    /// When the stopping thread panicked.
    pub fn join(self) -> anyhow::Result<Instant> {
        self.handle
            .join()
            .map_err(|_| anyhow::anyhow!("the thread stopping the page-server panicked"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_10_ms_before_to_1_s_after_the_failure() {
        let t = Instant::now() + Duration::from_secs(5);
        let w = Window::around(t);
        assert!(w.contains(t));
        assert!(w.contains(t - Duration::from_millis(10)));
        assert!(!w.contains(t - Duration::from_millis(11)));
        assert!(w.contains(t + Duration::from_millis(1000)));
        assert!(!w.contains(t + Duration::from_millis(1001)));
    }

    #[test]
    fn only_requests_started_in_the_window_are_spanned_and_errors_count_by_kind() {
        let t = Instant::now() + Duration::from_secs(5);
        let w = Window::around(t);
        let down = TransportError::NodeDown {
            node: "node-0".into(),
            reason: "reset".into(),
        };
        let mut a = Disruption::new();
        // Before the window: counted as an error, not as spanned.
        a.record(
            Some(&w),
            t - Duration::from_millis(500),
            20_000,
            1,
            Some(&down),
        );
        // Spanning: one slow failover, one quick, one failed batch of 4.
        a.record(Some(&w), t - Duration::from_millis(2), 900_000, 1, None);
        a.record(Some(&w), t + Duration::from_millis(20), 30_000, 1, None);
        let mut b = Disruption::new();
        b.record(
            Some(&w),
            t + Duration::from_millis(3),
            5_000_000,
            4,
            Some(&down),
        );
        // After the window.
        b.record(Some(&w), t + Duration::from_secs(2), 10_000, 1, None);
        a.merge(&b);
        assert_eq!(a.errors_by_kind.get("node_down"), Some(&5));
        let s = Spanned::of(&a);
        assert_eq!(s.pages, 6);
        assert_eq!(s.errors, 4);
        assert_eq!(s.window_ms, [-10, 1000]);
        assert!((s.max_us - 5000.0).abs() < 5.0, "{}", s.max_us);
        assert!(s.p50_us > 4900.0, "4 of 6 pages took 5 ms: {}", s.p50_us);
        let none = Spanned::of(&Disruption::new());
        assert_eq!((none.pages, none.max_us), (0, 0.0));
    }

    #[test]
    fn without_a_failure_nothing_is_spanned() {
        let mut d = Disruption::new();
        d.record(None, Instant::now(), 1_000, 3, None);
        assert!(d.spanned_ns.is_empty());
        assert!(d.errors_by_kind.is_empty());
    }

    #[test]
    fn the_injector_stops_at_the_instant_asked() {
        let fail_at = Instant::now() + Duration::from_millis(30);
        let (tx, rx) = std::sync::mpsc::channel();
        let injector = Injector::schedule(fail_at, move || tx.send(()).unwrap()).unwrap();
        let at = injector.join().unwrap();
        assert!(at >= fail_at);
        assert!(rx.try_recv().is_ok());
    }
}
