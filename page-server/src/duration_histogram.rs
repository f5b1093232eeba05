//! The request-duration histogram without a lock: atomic buckets shared by
//! every connection thread ([`DurationHistogram`]), filled from a
//! connection's own plain counts ([`LocalDurations`]) once per batch of
//! requests instead of once per request.
//!
//! `prometheus_client`'s `Histogram` takes a mutex on every observation;
//! with one observation per page served, every connection thread of the
//! server would take the same lock for every page.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Upper bound of the first bucket.
const FIRST_BOUND_NS: u64 = 2_000;
/// Buckets with a finite bound (2 µs, 4 µs, ... about 65 ms, doubling);
/// one more, `+Inf`, follows.
const BOUNDED_BUCKETS: usize = 16;
const BUCKETS: usize = BOUNDED_BUCKETS + 1;

/// The bucket a duration of `ns` nanoseconds falls in: the first whose
/// upper bound is at least `ns` (bounds are inclusive, as in Prometheus).
fn bucket_of(ns: u64) -> usize {
    // Bucket i > 0 holds (2 µs * 2^(i-1), 2 µs * 2^i]: `q` is in
    // [2^(i-1), 2^i), so it has exactly i significant bits.
    let q = ns.saturating_sub(1) / FIRST_BOUND_NS;
    ((u64::BITS - q.leading_zeros()) as usize).min(BOUNDED_BUCKETS)
}

fn bound_seconds(bucket: usize) -> f64 {
    if bucket >= BOUNDED_BUCKETS {
        f64::INFINITY
    } else {
        (FIRST_BOUND_NS << bucket) as f64 / 1e9
    }
}

/// One connection's durations not yet published: plain counts, no atomics.
#[derive(Debug, Default)]
pub(crate) struct LocalDurations {
    buckets: [u64; BUCKETS],
    /// Bit i set: `buckets[i]` is not zero (a batch of one request touches
    /// one bucket, and publishing it looks at that one only).
    touched: u32,
    count: u64,
    sum_ns: u64,
}

impl LocalDurations {
    pub(crate) fn record(&mut self, duration: Duration) {
        let ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let bucket = bucket_of(ns);
        self.buckets[bucket] += 1;
        self.touched |= 1 << bucket;
        self.count += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
    }
}

#[derive(Debug, Default)]
struct Shared {
    buckets: [AtomicU64; BUCKETS],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// A histogram of durations, 2 µs to about 65 ms doubling, rendered as an
/// OpenMetrics histogram in seconds. Clones share the same counts.
#[derive(Debug, Clone, Default)]
pub(crate) struct DurationHistogram(Arc<Shared>);

impl DurationHistogram {
    /// Adds `local`'s counts and empties it.
    pub(crate) fn publish(&self, local: &mut LocalDurations) {
        let count = std::mem::take(&mut local.count);
        if count == 0 {
            return;
        }
        let shared = &self.0;
        let mut touched = std::mem::take(&mut local.touched);
        while touched != 0 {
            let bucket = touched.trailing_zeros() as usize;
            touched &= touched - 1;
            shared.buckets[bucket].fetch_add(
                std::mem::take(&mut local.buckets[bucket]),
                Ordering::Relaxed,
            );
        }
        shared
            .sum_ns
            .fetch_add(std::mem::take(&mut local.sum_ns), Ordering::Relaxed);
        // Last: a scrape that sees this count sees the buckets it covers
        // (paired with the Acquire load in `encode`).
        shared.count.fetch_add(count, Ordering::Release);
    }
}

impl TypedMetric for DurationHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for DurationHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let shared = &self.0;
        let count = shared.count.load(Ordering::Acquire);
        let sum_seconds = shared.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let buckets: Vec<(f64, u64)> = shared
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| (bound_seconds(i), b.load(Ordering::Relaxed)))
            .collect();
        encoder.encode_histogram::<NoLabelSet>(sum_seconds, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_fall_in_the_first_bucket_whose_bound_holds_them() {
        for (ns, bucket) in [
            (0, 0),
            (1, 0),
            (2_000, 0),
            (2_001, 1),
            (4_000, 1),
            (4_001, 2),
            (8_000, 2),
            (8_001, 3),
            (65_536_000, 15),
            (65_536_001, 16),
            (u64::MAX, 16),
        ] {
            assert_eq!(bucket_of(ns), bucket, "{ns} ns");
        }
        for bucket in 0..BOUNDED_BUCKETS {
            let bound_ns = (bound_seconds(bucket) * 1e9).round() as u64;
            assert_eq!(bucket_of(bound_ns), bucket, "bound of bucket {bucket}");
            assert_eq!(bucket_of(bound_ns + 1), bucket + 1, "above bucket {bucket}");
        }
        assert_eq!(bound_seconds(BOUNDED_BUCKETS), f64::INFINITY);
    }

    #[test]
    fn published_counts_render_as_a_histogram_and_leave_the_local_ones_empty() {
        let histogram = DurationHistogram::default();
        let mut local = LocalDurations::default();
        for us in [1, 3, 3, 100_000] {
            local.record(Duration::from_micros(us));
        }
        histogram.publish(&mut local);
        histogram.publish(&mut local);
        assert_eq!(local.buckets, [0; BUCKETS]);
        assert_eq!((local.touched, local.count, local.sum_ns), (0, 0, 0));
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("d_seconds", "durations", histogram.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "# TYPE d_seconds histogram",
            "d_seconds_count 4",
            "d_seconds_sum 0.100007",
            r#"d_seconds_bucket{le="0.000002"} 1"#,
            r#"d_seconds_bucket{le="0.000004"} 3"#,
            r#"d_seconds_bucket{le="0.065536"} 3"#,
            r#"d_seconds_bucket{le="+Inf"} 4"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
    }
}
