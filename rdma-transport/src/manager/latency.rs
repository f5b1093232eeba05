//! The recent p99 of replicated reads, from which the automatic hedging
//! delay is derived: the last `SAMPLES` round trips, without a lock.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Round trips kept.
const SAMPLES: usize = 256;

/// The p99 is recomputed after this many new samples.
const RECOMPUTE_EVERY: usize = 64;

/// Recent round trips, in microseconds.
#[derive(Debug)]
pub(super) struct RecentLatency {
    samples_us: [AtomicU32; SAMPLES],
    recorded: AtomicUsize,
    /// 0 until enough samples arrived.
    p99_us: AtomicU64,
}

impl Default for RecentLatency {
    fn default() -> Self {
        Self {
            samples_us: [const { AtomicU32::new(0) }; SAMPLES],
            recorded: AtomicUsize::new(0),
            p99_us: AtomicU64::new(0),
        }
    }
}

impl RecentLatency {
    /// Adds one round trip.
    pub(super) fn record(&self, took: Duration) {
        let us = u32::try_from(took.as_micros()).unwrap_or(u32::MAX);
        let i = self.recorded.fetch_add(1, Ordering::Relaxed);
        self.samples_us[i % SAMPLES].store(us, Ordering::Relaxed);
        if (i + 1) % RECOMPUTE_EVERY == 0 {
            let n = (i + 1).min(SAMPLES);
            let mut sorted = [0u32; SAMPLES];
            for (dst, src) in sorted.iter_mut().zip(&self.samples_us[..n]) {
                *dst = src.load(Ordering::Relaxed);
            }
            let sorted = &mut sorted[..n];
            sorted.sort_unstable();
            let p99 = sorted[(n * 99).div_ceil(100).saturating_sub(1)];
            self.p99_us.store(u64::from(p99), Ordering::Relaxed);
        }
    }

    /// The recent p99, once `RECOMPUTE_EVERY` round trips were recorded.
    pub(super) fn p99(&self) -> Option<Duration> {
        match self.p99_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p99_follows_the_recent_samples() {
        let l = RecentLatency::default();
        assert_eq!(l.p99(), None);
        for i in 0..100u64 {
            l.record(Duration::from_micros(if i == 99 { 5000 } else { 10 }));
        }
        // 64 samples of 10 us: p99 10 us.
        assert_eq!(l.p99(), Some(Duration::from_micros(10)));
        for _ in 0..SAMPLES {
            l.record(Duration::from_micros(200));
        }
        assert_eq!(l.p99(), Some(Duration::from_micros(200)));
    }
}
