//! How long a connection thread polls its socket before it blocks
//! (`ServerConfig::spin_before_block`), shared by every connection of a
//! server and changeable while it serves
//! ([`crate::RunningServer::set_spin_before_block`]): each connection reads
//! it again before every read of its socket.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[derive(Debug)]
pub(crate) struct SpinSetting {
    nanos: AtomicU64,
}

impl SpinSetting {
    pub(crate) fn new(spin: Duration) -> Self {
        Self {
            nanos: AtomicU64::new(as_nanos(spin)),
        }
    }

    pub(crate) fn get(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }

    pub(crate) fn set(&self, spin: Duration) {
        self.nanos.store(as_nanos(spin), Ordering::Relaxed);
    }
}

/// Saturates at ~584 years: longer is the same as never blocking.
fn as_nanos(spin: Duration) -> u64 {
    u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setting_reads_back_what_was_set_last() {
        let s = SpinSetting::new(Duration::from_micros(50));
        assert_eq!(s.get(), Duration::from_micros(50));
        s.set(Duration::ZERO);
        assert_eq!(s.get(), Duration::ZERO);
        s.set(Duration::MAX);
        assert_eq!(s.get(), Duration::from_nanos(u64::MAX));
    }
}
