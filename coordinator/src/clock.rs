//! Wall-clock time as stored in the database.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch; 0 if the clock is before 1970.
///
/// Wall-clock time, not a monotonic clock, because `last_seen` must keep its
/// meaning across a restart of the coordinator.
pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
