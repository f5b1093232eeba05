//! A page-server that may have been replaced serves nothing until the
//! coordinator says it was not. Another process of its node can register
//! once this one's lease lapsed at the coordinator (`other_processes.rs`);
//! this one learns it from its next heartbeat's answer, but its other
//! threads run before: a connection's thread would answer a client whose
//! map still names this process (with the page it held, while the new
//! process took the writes), and its coherence home would grant pages the
//! new process grants too. Two ways this process's lease can lapse without
//! it knowing:
//!
//! - **A stall.** The process did not run for a while (SIGSTOP, a paused
//!   VM, a debugger, a frozen host). Noticed by the ticker thread's next
//!   beat, or by a serving thread that finds the last beat too old
//!   (`--stall-fence-ms`, 500 ms; on by default).
//! - **A silent coordinator.** No heartbeat answered for
//!   `--lease-fence-ms` since the last answered one was sent: the process
//!   may be cut off from the coordinator while another registers. Off by
//!   default: a process cut off from the coordinator keeps serving (the
//!   data path outlives the coordinator), which also means it keeps
//!   serving behind a partition after it was replaced.
//!
//! From then on nothing is served (a connection's requests wait, coherence
//! requests are answered `Retry`) until a heartbeat sent after that is
//! answered with this process's epoch. Answered with another epoch, the
//! process was replaced and serves no more (`registration.rs`,
//! `server.rs`); unanswered, it cannot know and keeps waiting.
//! docs/operations.md, "One process per node id".

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// What the fence calls when it fences: the registration thread sends a
/// heartbeat at once; the server cuts the clients' one-sided RDMA off.
pub(crate) type OnFence = Box<dyn Fn() + Send + Sync>;

/// Whether this process may serve, and the wait for the coordinator's word
/// when it may not.
pub(crate) struct SelfFence {
    origin: Instant,
    /// A gap this long between beats is a stall; 0: not watched.
    stall_us: u64,
    /// How long an answered heartbeat covers this process from its send;
    /// 0: no limit.
    lease_us: u64,
    /// The ticker's last beat (or a serving thread's that noticed a
    /// stall), in µs since `origin` (plus one).
    last_beat_us: AtomicU64,
    /// Until when the answered heartbeats cover this process (µs since
    /// `origin`); `u64::MAX` without `lease_us`.
    covered_until_us: AtomicU64,
    /// When this process fenced itself (µs since `origin`, plus one); 0:
    /// it serves.
    fenced_since_us: AtomicU64,
    /// Set once the process registered: before, nobody was sent to it.
    armed: AtomicBool,
    /// Set when the process was replaced or shuts down: nobody waits more.
    ended: AtomicBool,
    stalls: AtomicU64,
    lease_lapses: AtomicU64,
    held: AtomicU64,
    lock: Mutex<()>,
    changed: Condvar,
    on_fence: Mutex<Vec<OnFence>>,
}

impl std::fmt::Debug for SelfFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelfFence")
            .field("stall_us", &self.stall_us)
            .field("lease_us", &self.lease_us)
            .field("counts", &self.counts())
            .finish_non_exhaustive()
    }
}

/// What the fence counted, for the stats and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct FenceCounts {
    /// Stalls after which the coordinator's word was awaited.
    pub(crate) stalls: u64,
    /// Times no heartbeat was answered for the lease fence.
    pub(crate) lease_lapses: u64,
    /// Batches of requests that waited for the coordinator's word.
    pub(crate) held: u64,
    /// Whether the process serves nothing now.
    pub(crate) fenced: bool,
}

/// Why the process fenced itself.
#[derive(Debug, Clone, Copy)]
enum Why {
    Stall { gap_us: u64 },
    LeaseLapsed,
}

impl SelfFence {
    /// A fence for stalls of at least `stall` and for `lease` without an
    /// answered heartbeat (zero: not watched). Beats start with
    /// [`SelfFence::start_ticker`].
    pub(crate) fn new(stall: Duration, lease: Duration) -> Arc<Self> {
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Arc::new(Self {
            origin: Instant::now(),
            stall_us: micros(stall),
            lease_us: micros(lease),
            last_beat_us: AtomicU64::new(1),
            covered_until_us: AtomicU64::new(if lease.is_zero() { u64::MAX } else { 0 }),
            fenced_since_us: AtomicU64::new(0),
            armed: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            stalls: AtomicU64::new(0),
            lease_lapses: AtomicU64::new(0),
            held: AtomicU64::new(0),
            lock: Mutex::new(()),
            changed: Condvar::new(),
            on_fence: Mutex::new(Vec::new()),
        })
    }

    fn watches(&self) -> bool {
        self.stall_us != 0 || self.lease_us != 0
    }

    /// Starts the thread that beats four times per stall threshold (and
    /// per lease fence); it ends with the fence ([`SelfFence::end`], or
    /// the last handle dropped).
    pub(crate) fn start_ticker(self: &Arc<Self>) -> std::io::Result<()> {
        if !self.watches() {
            return Ok(());
        }
        let shortest = [self.stall_us, self.lease_us]
            .into_iter()
            .filter(|&us| us != 0)
            .min()
            .unwrap_or(u64::MAX);
        let period = Duration::from_micros(shortest / 4).max(Duration::from_millis(1));
        let fence: Weak<Self> = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("page-server-fence".into())
            .spawn(move || loop {
                std::thread::sleep(period);
                match fence.upgrade() {
                    Some(f) if !f.ended.load(Ordering::Acquire) => f.beat(),
                    _ => return,
                }
            })
            .map(drop)
    }

    /// Adds what is done each time the process fences itself (in the
    /// thread that noticed: quick, and not under a lock the serving
    /// threads take).
    pub(crate) fn on_fence(&self, hook: OnFence) {
        self.on_fence.lock().push(hook);
    }

    /// The process is registered (after [`SelfFence::confirm`] of the
    /// registration): clients may be sent to it from now on, so the fence
    /// counts.
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
    /// with for [`SelfFence::confirm`].
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp_at(Instant::now())
    }

    fn stamp_at(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.origin).as_micros())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    /// The coordinator answered a heartbeat (or registration) sent at
    /// `sent_at` ([`SelfFence::stamp`]) with this process's epoch: it
    /// covers the process for the lease fence from then, and ends a fence
    /// raised before it was sent.
    pub(crate) fn confirm(&self, sent_at: u64) {
        if self.lease_us != 0 {
            self.covered_until_us
                .fetch_max(sent_at.saturating_add(self.lease_us), Ordering::AcqRel);
        }
        let since = self.fenced_since_us.load(Ordering::Acquire);
        if since == 0 || sent_at < since {
            return;
        }
        if self
            .fenced_since_us
            .compare_exchange(since, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            tracing::info!(
                fenced_ms = sent_at.saturating_sub(since) / 1000,
                "the coordinator still has this process as its node: serving again"
            );
            let _guard = self.lock.lock();
            self.changed.notify_all();
        }
    }

    /// Whether this process serves nothing now, checking for a stall or a
    /// lapsed lease first.
    pub(crate) fn is_fenced(&self) -> bool {
        self.is_fenced_at(Instant::now())
    }

    /// As [`SelfFence::is_fenced`], `now` read by the caller.
    fn is_fenced_at(&self, now: Instant) -> bool {
        if !self.watches() || !self.armed.load(Ordering::Acquire) {
            return false;
        }
        self.check(self.stamp_at(now));
        self.fenced_since_us.load(Ordering::Acquire) != 0
    }

    /// Whether requests that came at `now` (read by the caller, who needs
    /// the time anyway) may be served: at once unless the process is
    /// fenced, when the coordinator's word is waited for up to `limit`.
    /// False: not confirmed in time, or the process was replaced; serve
    /// nothing.
    pub(crate) fn may_serve(&self, now: Instant, limit: Duration) -> bool {
        if !self.is_fenced_at(now) {
            return true;
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + limit;
        let mut guard = self.lock.lock();
        loop {
            if self.ended.load(Ordering::Acquire) {
                return false;
            }
            if self.fenced_since_us.load(Ordering::Acquire) == 0 {
                return true;
            }
            if self.changed.wait_until(&mut guard, deadline).timed_out() {
                return self.fenced_since_us.load(Ordering::Acquire) == 0
                    && !self.ended.load(Ordering::Acquire);
            }
        }
    }

    /// What was counted.
    pub(crate) fn counts(&self) -> FenceCounts {
        FenceCounts {
            stalls: self.stalls.load(Ordering::Relaxed),
            lease_lapses: self.lease_lapses.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
            fenced: self.fenced_since_us.load(Ordering::Acquire) != 0,
        }
    }

    /// One beat of the ticker: a stall it ended, or a lease that lapsed,
    /// fences the process before the beat is stored, so that a thread
    /// that reads the new beat finds the process fenced.
    fn beat(&self) {
        let now = self.stamp();
        if self.armed.load(Ordering::Acquire) {
            self.check(now);
        }
        self.last_beat_us.fetch_max(now, Ordering::AcqRel);
    }

    fn check(&self, now: u64) {
        if self.stall_us != 0 {
            let gap_us = now.saturating_sub(self.last_beat_us.load(Ordering::Acquire));
            if gap_us >= self.stall_us {
                self.fence(now, Why::Stall { gap_us });
            }
        }
        if now >= self.covered_until_us.load(Ordering::Acquire) {
            self.fence(now, Why::LeaseLapsed);
        }
    }

    /// Fences the process from `now`. The thread that noticed a stall
    /// beats too (after fencing), so that the stall is not noticed again
    /// once confirmed, before the ticker runs.
    fn fence(&self, now: u64, why: Why) {
        let first = self
            .fenced_since_us
            .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        self.last_beat_us.fetch_max(now, Ordering::AcqRel);
        if !first {
            return;
        }
        match why {
            Why::Stall { gap_us } => {
                self.stalls.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    stalled_ms = gap_us / 1000,
                    "this process did not run for a while (stopped or paused?): another process \
                     may have replaced it meanwhile; serving nothing until the coordinator says it \
                     has not"
                );
            }
            Why::LeaseLapsed => {
                self.lease_lapses.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    lease_fence_ms = self.lease_us / 1000,
                    "no heartbeat answered by the coordinator within the lease fence: another \
                     process may replace this one; serving nothing until one is"
                );
            }
        }
        for hook in self.on_fence.lock().iter() {
            hook();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fence whose last beat was `ago` before now: its clock started
    /// `ago` earlier than it was made.
    fn fence_beaten_ago(stall: Duration, lease: Duration, ago: Duration) -> Arc<SelfFence> {
        let fence = Arc::try_unwrap(SelfFence::new(stall, lease)).expect("one handle");
        let origin = fence
            .origin
            .checked_sub(ago)
            .expect("a clock older than `ago`");
        Arc::new(SelfFence { origin, ..fence })
    }

    const SECOND: Duration = Duration::from_secs(1);
    const LONG_AGO: Duration = Duration::from_secs(10);

    fn stalled() -> Arc<SelfFence> {
        fence_beaten_ago(SECOND, Duration::ZERO, LONG_AGO)
    }

    #[test]
    fn nothing_is_fenced_before_registration_or_when_off() {
        let fence = stalled();
        assert!(!fence.is_fenced(), "not armed: nobody was sent here");
        let off = fence_beaten_ago(Duration::ZERO, Duration::ZERO, LONG_AGO);
        off.arm();
        assert!(!off.is_fenced(), "off");
        assert_eq!(off.counts(), FenceCounts::default());
    }

    #[test]
    fn a_stall_is_fenced_until_a_heartbeat_sent_after_it_is_answered() {
        let fence = stalled();
        let before = fence.stamp();
        fence.arm();
        let nudged = Arc::new(AtomicU64::new(0));
        let n = Arc::clone(&nudged);
        fence.on_fence(Box::new(move || {
            n.fetch_add(1, Ordering::Relaxed);
        }));
        assert!(fence.is_fenced(), "a serving thread notices the stall");
        assert!(fence.is_fenced());
        assert_eq!(nudged.load(Ordering::Relaxed), 1, "one heartbeat asked for");
        assert!(
            !fence.may_serve(Instant::now(), Duration::from_millis(20)),
            "not confirmed"
        );
        fence.confirm(before);
        assert!(
            fence.is_fenced(),
            "a heartbeat sent before the stall was noticed confirms nothing"
        );
        fence.confirm(fence.stamp());
        assert!(fence.may_serve(Instant::now(), Duration::ZERO));
        assert_eq!(
            fence.counts(),
            FenceCounts {
                stalls: 1,
                lease_lapses: 0,
                held: 1,
                fenced: false,
            }
        );
    }

    #[test]
    fn the_ticker_notices_a_stall_before_storing_its_beat() {
        let fence = stalled();
        fence.arm();
        fence.beat();
        assert!(
            fence.is_fenced(),
            "the new beat is fresh, but the stall it ended was noticed"
        );
        fence.confirm(fence.stamp());
        fence.beat();
        assert!(!fence.is_fenced(), "beats close together: no stall");
    }

    #[test]
    fn a_lease_fence_holds_from_the_last_answered_send_plus_the_lease() {
        let fence = fence_beaten_ago(Duration::ZERO, SECOND, LONG_AGO);
        // Registered 10 s ago (the start of the fence's clock), every
        // heartbeat since unanswered.
        fence.confirm(1);
        fence.arm();
        assert!(fence.is_fenced(), "no answer for 10 s, with a 1 s fence");
        let now = fence.stamp();
        fence.confirm(now);
        assert!(!fence.is_fenced(), "an answer covers the next second");
        assert_eq!(fence.counts().lease_lapses, 1);
        // An answer to a heartbeat sent long ago covers nothing now.
        fence.covered_until_us.store(0, Ordering::Release);
        fence.confirm(now.saturating_sub(5_000_000));
        assert!(fence.is_fenced(), "covered until 4 s ago only");
    }

    #[test]
    fn a_waiter_is_released_by_the_confirmation_or_the_end() {
        for confirmed in [true, false] {
            let fence = stalled();
            fence.arm();
            assert!(fence.is_fenced());
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
