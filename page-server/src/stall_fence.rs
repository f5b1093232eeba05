//! A process that could not run for a while (SIGSTOP, a paused VM, a
//! debugger, a frozen host) may have been replaced meanwhile: once its
//! lease lapsed, another process of its node could register
//! (`other_processes.rs`). Resumed, its threads cannot tell: a connection's
//! thread would answer a client whose map still names this process (with
//! the old page, while the new process took the writes), and its coherence
//! home would grant pages the new process grants too. Its heartbeat tells
//! it, but only after those threads have run.
//!
//! So a stall is noticed, by the ticker thread's next beat or by a serving
//! thread that finds the last beat too old, and from then on nothing is
//! served (a connection's requests wait, coherence requests are answered
//! `Retry`) until a heartbeat sent after the stall is answered with this
//! process's epoch. Answered with another epoch, the process was replaced
//! and serves no more (`registration.rs`, `server.rs`); unanswered (the
//! coordinator unreachable), it cannot know and keeps waiting.
//!
//! A process that keeps running while it cannot reach the coordinator goes
//! on serving, as before: the data path outlives the coordinator
//! (docs/operations.md, "One process per node id").

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// What the fence calls when it notices a stall: the registration thread
/// sends a heartbeat at once.
pub(crate) type Nudge = Box<dyn Fn() + Send + Sync>;

/// The stall detector and the wait for the coordinator's word after one.
pub(crate) struct StallFence {
    origin: Instant,
    /// A gap this long between beats is a stall; 0: the fence is off.
    threshold_us: u64,
    /// The ticker's last beat, in µs since `origin` (plus one).
    last_beat_us: AtomicU64,
    /// When the stall not yet confirmed was noticed (µs since `origin`,
    /// plus one); 0: none.
    unconfirmed_since_us: AtomicU64,
    /// Set once the process registered: before, nobody was sent to it.
    armed: AtomicBool,
    /// Set when the process was replaced or shuts down: nobody waits more.
    ended: AtomicBool,
    stalls: AtomicU64,
    held: AtomicU64,
    lock: Mutex<()>,
    changed: Condvar,
    nudge: Mutex<Option<Nudge>>,
}

impl std::fmt::Debug for StallFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StallFence")
            .field("threshold_us", &self.threshold_us)
            .field("unconfirmed", &self.is_unconfirmed())
            .finish_non_exhaustive()
    }
}

/// What the fence counted, for the stats and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StallCounts {
    /// Stalls noticed after which the coordinator's word was awaited.
    pub(crate) stalls: u64,
    /// Batches of requests that waited for it.
    pub(crate) held: u64,
}

impl StallFence {
    /// A fence for stalls of at least `threshold` (zero: off). Beats start
    /// with [`StallFence::start_ticker`].
    pub(crate) fn new(threshold: Duration) -> Arc<Self> {
        let fence = Self {
            origin: Instant::now(),
            threshold_us: u64::try_from(threshold.as_micros()).unwrap_or(u64::MAX),
            last_beat_us: AtomicU64::new(1),
            unconfirmed_since_us: AtomicU64::new(0),
            armed: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            stalls: AtomicU64::new(0),
            held: AtomicU64::new(0),
            lock: Mutex::new(()),
            changed: Condvar::new(),
            nudge: Mutex::new(None),
        };
        Arc::new(fence)
    }

    /// Starts the thread that beats four times per threshold; it ends with
    /// the fence ([`StallFence::end`], or the last handle dropped).
    pub(crate) fn start_ticker(self: &Arc<Self>) -> std::io::Result<()> {
        if self.threshold_us == 0 {
            return Ok(());
        }
        let period = Duration::from_micros(self.threshold_us / 4).max(Duration::from_millis(1));
        let fence: Weak<Self> = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("page-server-stall".into())
            .spawn(move || loop {
                std::thread::sleep(period);
                match fence.upgrade() {
                    Some(f) if !f.ended.load(Ordering::Acquire) => f.beat(),
                    _ => return,
                }
            })
            .map(drop)
    }

    /// Who sends a heartbeat when a stall is noticed.
    pub(crate) fn set_nudge(&self, nudge: Nudge) {
        *self.nudge.lock() = Some(nudge);
    }

    /// The process is registered: clients may be sent to it from now on,
    /// so stalls count.
    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    /// The process was replaced or shuts down: waiters give up, and the
    /// ticker ends.
    pub(crate) fn end(&self) {
        self.ended.store(true, Ordering::Release);
        let _guard = self.lock.lock();
        self.changed.notify_all();
    }

    /// Now, on the fence's clock: what a heartbeat's send time is stamped
    /// with for [`StallFence::confirm`].
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp_at(Instant::now())
    }

    fn stamp_at(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.origin).as_micros())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    /// The coordinator answered a heartbeat (or registration) sent at
    /// `sent_at` ([`StallFence::stamp`]) with this process's epoch: a stall
    /// noticed before it was sent is over.
    pub(crate) fn confirm(&self, sent_at: u64) {
        let since = self.unconfirmed_since_us.load(Ordering::Acquire);
        if since == 0 || sent_at < since {
            return;
        }
        if self
            .unconfirmed_since_us
            .compare_exchange(since, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            tracing::info!(
                waited_ms = sent_at.saturating_sub(since) / 1000,
                "the coordinator still has this process as its node after the stall: serving again"
            );
            let _guard = self.lock.lock();
            self.changed.notify_all();
        }
    }

    /// Whether a stall was noticed (now, too) that the coordinator has not
    /// confirmed yet: nothing is to be served.
    pub(crate) fn is_unconfirmed(&self) -> bool {
        self.is_unconfirmed_at(Instant::now())
    }

    /// As [`StallFence::is_unconfirmed`], `now` read by the caller.
    fn is_unconfirmed_at(&self, now: Instant) -> bool {
        if self.threshold_us == 0 || !self.armed.load(Ordering::Acquire) {
            return false;
        }
        let now = self.stamp_at(now);
        let beat = self.last_beat_us.load(Ordering::Acquire);
        if now.saturating_sub(beat) >= self.threshold_us {
            self.noticed(now, now.saturating_sub(beat));
        }
        self.unconfirmed_since_us.load(Ordering::Acquire) != 0
    }

    /// Whether requests that came at `now` (read by the caller, who needs
    /// the time anyway) may be served: at once unless a stall awaits the
    /// coordinator's word, which is waited for up to `limit`. False: not
    /// confirmed in time, or the process was replaced; serve nothing.
    pub(crate) fn may_serve(&self, now: Instant, limit: Duration) -> bool {
        if !self.is_unconfirmed_at(now) {
            return true;
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + limit;
        let mut guard = self.lock.lock();
        loop {
            if self.ended.load(Ordering::Acquire) {
                return false;
            }
            if self.unconfirmed_since_us.load(Ordering::Acquire) == 0 {
                return true;
            }
            if self.changed.wait_until(&mut guard, deadline).timed_out() {
                return self.unconfirmed_since_us.load(Ordering::Acquire) == 0
                    && !self.ended.load(Ordering::Acquire);
            }
        }
    }

    /// What was counted.
    pub(crate) fn counts(&self) -> StallCounts {
        StallCounts {
            stalls: self.stalls.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
        }
    }

    /// One beat of the ticker. A stall is noticed before the beat is
    /// stored, so that a thread that reads the new beat sees the stall.
    fn beat(&self) {
        let now = self.stamp();
        let gap = now.saturating_sub(self.last_beat_us.load(Ordering::Acquire));
        if gap >= self.threshold_us && self.armed.load(Ordering::Acquire) {
            self.noticed(now, gap);
        }
        self.last_beat_us.fetch_max(now, Ordering::AcqRel);
    }

    /// A stall ended by `now`: unconfirmed from now on. The thread that
    /// noticed it beats too (after marking it), so that the stall is not
    /// noticed again once confirmed, before the ticker runs.
    fn noticed(&self, now: u64, gap_us: u64) {
        let first = self
            .unconfirmed_since_us
            .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        self.last_beat_us.fetch_max(now, Ordering::AcqRel);
        if !first {
            return;
        }
        self.stalls.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            stalled_ms = gap_us / 1000,
            "this process did not run for a while (stopped or paused?): another process may have \
             replaced it meanwhile; serving nothing until the coordinator says it has not"
        );
        if let Some(nudge) = self.nudge.lock().as_ref() {
            nudge();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fence whose last beat was `ago` before now: its clock started
    /// `ago` earlier than it was made.
    fn fence_beaten_ago(threshold: Duration, ago: Duration) -> Arc<StallFence> {
        let fence = Arc::try_unwrap(StallFence::new(threshold)).expect("one handle");
        let origin = fence
            .origin
            .checked_sub(ago)
            .expect("a clock older than `ago`");
        Arc::new(StallFence { origin, ..fence })
    }

    #[test]
    fn nothing_is_fenced_before_registration_or_when_off() {
        let fence = fence_beaten_ago(Duration::from_secs(1), Duration::from_secs(10));
        assert!(!fence.is_unconfirmed(), "not armed: nobody was sent here");
        let off = fence_beaten_ago(Duration::ZERO, Duration::from_secs(10));
        off.arm();
        assert!(!off.is_unconfirmed(), "off");
        assert_eq!(off.counts(), StallCounts::default());
    }

    #[test]
    fn a_stall_is_fenced_until_a_heartbeat_sent_after_it_is_answered() {
        let fence = fence_beaten_ago(Duration::from_secs(1), Duration::from_secs(10));
        let before = fence.stamp();
        fence.arm();
        let nudged = Arc::new(AtomicU64::new(0));
        let n = Arc::clone(&nudged);
        fence.set_nudge(Box::new(move || {
            n.fetch_add(1, Ordering::Relaxed);
        }));
        assert!(fence.is_unconfirmed(), "a serving thread notices the stall");
        assert!(fence.is_unconfirmed());
        assert_eq!(nudged.load(Ordering::Relaxed), 1, "one heartbeat asked for");
        assert!(
            !fence.may_serve(Instant::now(), Duration::from_millis(20)),
            "not confirmed"
        );
        fence.confirm(before);
        assert!(
            fence.is_unconfirmed(),
            "a heartbeat sent before the stall was noticed confirms nothing"
        );
        fence.confirm(fence.stamp());
        assert!(fence.may_serve(Instant::now(), Duration::ZERO));
        assert_eq!(fence.counts(), StallCounts { stalls: 1, held: 1 });
    }

    #[test]
    fn the_ticker_notices_a_stall_before_storing_its_beat() {
        let fence = fence_beaten_ago(Duration::from_secs(1), Duration::from_secs(10));
        fence.arm();
        fence.beat();
        assert!(
            fence.is_unconfirmed(),
            "the new beat is fresh, but the stall it ended was noticed"
        );
        fence.confirm(fence.stamp());
        fence.beat();
        assert!(!fence.is_unconfirmed(), "beats close together: no stall");
    }

    #[test]
    fn a_waiter_is_released_by_the_confirmation_or_the_end() {
        for confirmed in [true, false] {
            let fence = fence_beaten_ago(Duration::from_secs(1), Duration::from_secs(10));
            fence.arm();
            assert!(fence.is_unconfirmed());
            let waiter = {
                let fence = Arc::clone(&fence);
                std::thread::spawn(move || fence.may_serve(Instant::now(), Duration::from_secs(60)))
            };
            while fence.counts().held == 0 {
                std::thread::yield_now();
            }
            if confirmed {
                fence.confirm(fence.stamp());
            } else {
                fence.end();
            }
            assert_eq!(waiter.join().unwrap(), confirmed);
        }
    }
}
