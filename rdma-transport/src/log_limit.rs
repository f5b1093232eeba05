//! A log line at most once per interval, however often its event happens:
//! a flood of refused connections must not become a flood of log lines.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The interval of the rate-limited warnings of the library and the
/// page-server: at most one line per kind this often.
pub const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Lets one caller log per `interval`; counts the events not logged.
#[derive(Debug)]
pub struct LogLimit {
    origin: Instant,
    interval_ms: u64,
    /// Milliseconds since `origin` when a caller may log next.
    next_ms: AtomicU64,
    /// Events since the last line was allowed.
    suppressed: AtomicU64,
}

impl LogLimit {
    /// At most one line per `interval`.
    #[must_use]
    pub fn new(interval: Duration) -> Self {
        Self {
            origin: Instant::now(),
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Records one event. `Some(n)`: the caller logs it, saying `n` earlier
    /// events were not logged; `None`: it stays quiet.
    pub fn event(&self) -> Option<u64> {
        self.event_at(Instant::now())
    }

    fn event_at(&self, now: Instant) -> Option<u64> {
        let now_ms = u64::try_from(now.saturating_duration_since(self.origin).as_millis())
            .unwrap_or(u64::MAX);
        let next = self.next_ms.load(Ordering::Relaxed);
        let claimed = now_ms >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now_ms.saturating_add(self.interval_ms),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok();
        if claimed {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_once_per_interval_and_counts_the_rest() {
        let limit = LogLimit::new(Duration::from_secs(1));
        let t0 = limit.origin;
        assert_eq!(limit.event_at(t0), Some(0));
        for _ in 0..1000 {
            assert_eq!(limit.event_at(t0 + Duration::from_millis(500)), None);
        }
        assert_eq!(limit.event_at(t0 + Duration::from_millis(1000)), Some(1000));
        assert_eq!(limit.event_at(t0 + Duration::from_millis(1001)), None);
        assert_eq!(limit.event_at(t0 + Duration::from_millis(2000)), Some(1));
    }
}
