//! A completion queue's state and the step that moves it on: settle the
//! lanes whose rounds were answered or timed out, put their next windows
//! (and lanes waiting for room) on the wire, deliver completions; plus the
//! queue's own thread (`service`).

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::{Duration, Instant};

use crossbeam_queue::SegQueue;
use parking_lot::{Condvar, Mutex};

use super::{Completion, CompletionCallback, OnWire};
use crate::error::TransportError;
use crate::manager::async_op::{Batch, Lane, Next, Phase, NOT_ACTIVE, SPARE_GPAS};
use crate::manager::stats::Tally;
use crate::manager::Inner;
use crate::page::Page;
use crate::tcp::{ReadyHook, Waiter};
use crate::wire::Opcode;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Poll,
    Eventfd,
    Callback,
}

pub(super) struct Shared {
    pub(super) inner: Arc<Inner>,
    pub(super) mode: Mode,
    pub(super) ready: SegQueue<(usize, u64)>,
    pub(super) stepper: Mutex<Stepper>,
    /// Submissions not yet delivered.
    pub(super) in_flight: AtomicUsize,
    /// Fallback jobs running on worker threads.
    pub(super) fallbacks: Mutex<usize>,
    pub(super) fallbacks_done: Condvar,
    pub(super) eventfd: Option<OwnedFd>,
    /// The eventfd was written since the last drain.
    pub(super) eventfd_signalled: AtomicBool,
    /// A thread waiting in `wait` (poll mode) or the callback thread.
    pub(super) sleeper: Mutex<Option<Thread>>,
    /// `sleeper` holds a thread parked in `wait` (poll mode); set and
    /// cleared with it, read under the stepper lock by `after` without
    /// taking `sleeper`'s lock for every submission.
    pub(super) parked_in_wait: AtomicBool,
    pub(super) stop: AtomicBool,
    pub(super) callback: Mutex<Option<CompletionCallback>>,
    /// The reaper waits on the TCP sockets itself
    /// ([`CompletionQueue::read_tcp_myself`]): rounds are not parked on
    /// them.
    pub(super) reaper_reads_tcp: AtomicBool,
    /// Poll mode: `wait` sleeps in `ppoll` on its rounds' TCP sockets and
    /// this eventfd (`None`: it could not be made, and `wait` parks).
    pub(super) wake_fd: Option<OwnedFd>,
    /// A reaper sleeps on `wake_fd`: `wake` writes it.
    pub(super) fd_sleeper: AtomicBool,
    /// Poll mode: something was submitted since the reaper in `wait` last
    /// rang the doorbell; it must not go to sleep before it has.
    pub(super) submitted: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("mode", &self.mode)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

/// The lanes (each boxed: its round and waiter never move) and which of
/// them have a round on the wire.
pub(super) struct Stepper {
    pub(super) lanes: Vec<Box<Lane>>,
    pub(super) free: Vec<usize>,
    /// Lanes in `Phase::Round`.
    pub(super) active: Vec<usize>,
    /// Their connections, each once.
    pub(super) on_wire: OnWire,
    /// Requests of the active lanes (at most `MAX_REQUESTS`).
    pub(super) requests: usize,
    /// Lanes with a submission that wait for room under `MAX_REQUESTS`.
    pub(super) waiting: VecDeque<usize>,
    /// A lane queued TCP requests on its connections since the last
    /// `flush` (the doorbell has something to ring).
    pub(super) unflushed: bool,
    /// Batches of delivered submissions, for the next ones (at most
    /// `SPARE_BATCHES`; none of them shared).
    pub(super) spare: Vec<Arc<Batch>>,
    /// Delivered completions, to be reaped: under the stepper lock that
    /// delivering and reaping hold anyway. (A `SegQueue` here allocated a
    /// block every 31 completions; a mutex of its own cost two locked
    /// instructions per completion.)
    pub(super) done: VecDeque<Completion>,
    /// Completions delivered since the books were last settled (`books`),
    /// still counted in `Shared::in_flight`.
    pub(super) delivered: usize,
    /// Their successes, not yet in the manager's counters.
    pub(super) tally: Tally,
    /// No active lane's deadline is earlier (it may be earlier than all of
    /// them: a lane that left keeps it until `settle_late` looks again).
    pub(super) next_deadline: Option<Instant>,
    /// Scratch: the lanes a step's own reads finished (see `STEP_READY`).
    pub(super) step_ready: Vec<(usize, u64)>,
}

/// Spare batches a queue keeps: as many as submissions a thread
/// typically keeps in flight.
const SPARE_BATCHES: usize = 64;

/// Requests one queue keeps on the wire at most: half a connection's
/// request table. Its requests hold their slots until the queue is
/// reaped, so more could fill a table that only this thread can empty.
const MAX_REQUESTS: usize = crate::tcp::SLOTS / 2;

thread_local! {
    /// The queue whose `Shared::step` this thread is in, reading
    /// connections: the answers of that queue it reads are settled by the
    /// same step, nobody needs waking. (Answers of other queues or callers
    /// on the same connections wake them as usual.)
    static STEPPING: std::cell::Cell<*const Shared> = const { std::cell::Cell::new(std::ptr::null()) };
    /// The lanes (token, round) whose rounds that step's own reads
    /// finished: settled by the same step, without the shared queue.
    static STEP_READY: std::cell::RefCell<Vec<(usize, u64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl ReadyHook for Shared {
    fn ready(&self, token: usize, seq: u64) {
        // An answer this queue's own step read: that step settles the lane
        // after its reads, so it needs neither the shared queue (a push and
        // a pop, each with locked instructions, per page) nor a wake-up.
        if std::ptr::eq(STEPPING.with(std::cell::Cell::get), self) {
            STEP_READY.with(|r| r.borrow_mut().push((token, seq)));
            return;
        }
        self.ready.push((token, seq));
        self.wake();
    }
}

impl Shared {
    pub(super) fn wake(&self) {
        if self.mode == Mode::Eventfd {
            self.signal_eventfd();
        }
        // Poll mode only (the other modes have no wake fd, and skip the
        // fence). Pairs with the fence in `CompletionQueue::sleep_on_sockets`:
        // either it sees what the caller queued, or this sees it asleep.
        if let Some(fd) = &self.wake_fd {
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.fd_sleeper.load(Ordering::SeqCst) {
                write_eventfd(fd);
            }
            // With a wake fd, `wait` sleeps on it and never parks.
            return;
        }
        // A thread parked in `wait` or the callback thread.
        if let Some(t) = self.sleeper.lock().as_ref() {
            t.unpark();
        }
    }

    pub(super) fn signal_eventfd(&self) {
        if let Some(fd) = &self.eventfd {
            write_eventfd(fd);
            // After the write: a drain that sees the flag finds the count
            // there (or a later one's), so the eventfd never stays
            // readable with the flag down.
            self.eventfd_signalled.store(true, Ordering::Release);
        }
    }

    /// Resets the eventfd if it was signalled since the last drain; a
    /// reap that finds nothing signalled costs no system call (the fault
    /// handler reaps after every answer it reads itself).
    pub(super) fn drain_eventfd(&self) {
        if let Some(fd) = &self.eventfd {
            if !self.eventfd_signalled.swap(false, Ordering::AcqRel) {
                return;
            }
            reset_eventfd(fd);
        }
    }

    /// Settles every lane that is ready or past its deadline, puts the next
    /// rounds on the wire and appends the completions to `out`. Returns
    /// the earliest deadline of the lanes still on the wire and how many
    /// completions it appended.
    pub(super) fn step(self: &Arc<Self>, out: &mut Vec<Completion>) -> (Option<Instant>, usize) {
        let mut st = self.stepper.lock();
        // The doorbell: what was submitted since the last reap goes out.
        self.flush(&mut st);
        // Read what the lanes' connections have, each connection once.
        STEPPING.with(|s| s.set(Arc::as_ptr(self)));
        st.on_wire.progress();
        STEPPING.with(|s| s.set(std::ptr::null()));
        // The lanes this step's reads finished (the list is swapped with
        // the stepper's empty one: no allocation per step).
        let mut own = std::mem::take(&mut st.step_ready);
        STEP_READY.with(|r| std::mem::swap(&mut *r.borrow_mut(), &mut own));
        for (token, seq) in own.drain(..) {
            self.settle_ready(&mut st, token, seq);
        }
        st.step_ready = own;
        while let Some((token, seq)) = self.ready.pop() {
            self.settle_ready(&mut st, token, seq);
        }
        // Every finished round was signalled (above): the lanes are looked
        // at one by one only when a deadline may have passed.
        let now = Instant::now();
        if st.next_deadline.is_some_and(|d| now >= d) {
            self.settle_late(&mut st, now);
        }
        // Lanes that waited for room, then the next windows of the lanes
        // settled above.
        self.start_waiting(&mut st);
        self.flush(&mut st);
        self.books(&mut st);
        let n = st.done.len();
        out.extend(st.done.drain(..));
        (st.next_deadline, n)
    }

    /// Settles lane `token` if it is still in round `seq` (or, with
    /// `u64::MAX`, its fallback finished).
    fn settle_ready(self: &Arc<Self>, st: &mut Stepper, token: usize, seq: u64) {
        let Some(lane) = st.lanes.get_mut(token) else {
            return;
        };
        let next = match lane.phase {
            Phase::Round if lane.seq == seq => self.inner.settle_lane(lane),
            Phase::Fallback if seq == u64::MAX && lane.fallback.is_some() => {
                self.inner.fallback_done(lane)
            }
            _ => return,
        };
        self.after(st, token, next);
    }

    /// Settles every active lane that is done or past its deadline, and
    /// finds the earliest deadline of the others.
    fn settle_late(self: &Arc<Self>, st: &mut Stepper, now: Instant) {
        let mut earliest = None::<Instant>;
        let mut i = 0;
        while i < st.active.len() {
            let token = st.active[i];
            let lane = &mut st.lanes[token];
            if lane.phase == Phase::Round && (lane.waiter.is_done() || now >= lane.deadline) {
                let next = self.inner.settle_lane(lane);
                // `after` takes the lane out of the list (the last one
                // moves to `i`) and may put it back at the end, which is
                // then looked at again: index `i` is looked at next, and
                // nothing before it moved.
                self.after(st, token, next);
                continue;
            }
            earliest = Some(earliest.map_or(lane.deadline, |e| e.min(lane.deadline)));
            i += 1;
        }
        // Lanes that `after` put back at the end were looked at again,
        // so this covers every lane still active.
        st.next_deadline = earliest;
    }

    /// Settles the books of the completions delivered since the last
    /// time: once per step or submission, not per page.
    pub(super) fn books(&self, st: &mut Stepper) {
        self.inner.counters.add(&mut st.tally);
        let delivered = std::mem::take(&mut st.delivered);
        if delivered > 0 {
            self.in_flight.fetch_sub(delivered, Ordering::AcqRel);
        }
    }

    /// Puts waiting lanes on the wire while there is room for a whole
    /// window.
    pub(super) fn start_waiting(self: &Arc<Self>, st: &mut Stepper) {
        while st.requests + crate::tcp::MAX_CHUNK <= MAX_REQUESTS {
            let Some(token) = st.waiting.pop_front() else {
                break;
            };
            let next = self.inner.advance(&mut st.lanes[token]);
            self.after(st, token, next);
        }
    }

    /// Writes the requests the active lanes queued on their connections
    /// (one `writev` per connection). Nothing to do, and no lock taken,
    /// when no lane queued any since the last flush: a reaper that spins
    /// calls this at every pass.
    pub(super) fn flush(&self, st: &mut Stepper) {
        if !std::mem::take(&mut st.unflushed) {
            return;
        }
        st.on_wire.flush(self.inner.config.request_timeout());
    }

    /// Books a lane's next step.
    pub(super) fn after(self: &Arc<Self>, st: &mut Stepper, token: usize, next: Next) {
        let at = st.lanes[token].active_at;
        if at != NOT_ACTIVE {
            // Out of the active list without a search: the lane that takes
            // its place learns its new index.
            st.active.swap_remove(at);
            if let Some(&moved) = st.active.get(at) {
                st.lanes[moved].active_at = at;
            }
            st.lanes[token].active_at = NOT_ACTIVE;
            st.requests -= st.lanes[token].counted;
            st.lanes[token].counted = 0;
            st.on_wire.leave(&mut st.lanes[token].on_wire);
        }
        match next {
            Next::Wait => {
                let counted = st.lanes[token].requests();
                st.requests += counted;
                st.lanes[token].counted = counted;
                let lane = &mut st.lanes[token];
                st.on_wire.join(&lane.round, &mut lane.on_wire);
                // Its TCP requests wait in their connections' queues for
                // the doorbell.
                st.unflushed |= lane.round.queued_tcp();
                if self.mode != Mode::Poll || self.parked_in_wait.load(Ordering::Relaxed) {
                    // Nobody polls these connections (or the reaper sleeps
                    // in `wait`): their pollers must (the RDMA ones only,
                    // when the reaper waits on the sockets itself).
                    let tcp = !self.reaper_reads_tcp.load(Ordering::Relaxed);
                    lane.round.park_some(true, tcp);
                }
                lane.active_at = st.active.len();
                let deadline = lane.deadline;
                st.active.push(token);
                st.next_deadline = Some(st.next_deadline.map_or(deadline, |d| d.min(deadline)));
            }
            Next::Fallback => self.start_fallback(st, token),
            Next::Idle(complete) => {
                st.lanes[token].batch = None;
                if let Some(mut batch) = complete {
                    // Unshared unless a fallback job still holds it: then
                    // its result and pages are taken without their locks.
                    match Arc::get_mut(&mut batch) {
                        Some(unique) => {
                            let keep = unique.worth_keeping();
                            self.deliver_unique(st, unique);
                            if keep && st.spare.len() < SPARE_BATCHES {
                                st.spare.push(batch);
                            }
                        }
                        None => self.deliver(st, &batch),
                    }
                }
                st.free.push(token);
            }
        }
    }

    /// Queues the completion of a batch whose last window is done; `books`
    /// counts it.
    fn deliver(&self, st: &mut Stepper, batch: &Batch) {
        let result = batch.result();
        let pages = batch.owned.lock().take();
        self.push_done(st, batch, result, pages);
    }

    /// `deliver` for a batch nobody else holds.
    fn deliver_unique(&self, st: &mut Stepper, batch: &mut Batch) {
        let result = batch.take_result();
        let pages = batch.owned.get_mut().take();
        self.push_done(st, batch, result, pages);
    }

    fn push_done(
        &self,
        st: &mut Stepper,
        batch: &Batch,
        result: Result<(), TransportError>,
        pages: Option<Box<[Page]>>,
    ) {
        if result.is_ok() {
            st.tally.ok(batch.opcode, batch.gpas.len());
        } else {
            self.inner
                .counters
                .record(batch.opcode, batch.gpas.len(), &result);
        }
        st.done.push_back(Completion {
            user_data: batch.user_data,
            result,
            pages,
        });
        st.delivered += 1;
    }

    pub(super) fn start_fallback(self: &Arc<Self>, st: &mut Stepper, token: usize) {
        let lane = &mut st.lanes[token];
        let Some(batch) = lane.batch.clone() else {
            return;
        };
        let (from, end) = lane.fallback_range();
        *self.fallbacks.lock() += 1;
        let shared = Arc::clone(self);
        let job = move || {
            let result = shared.inner.run_fallback(&batch, from, end);
            {
                let mut st = shared.stepper.lock();
                if let Some(lane) = st.lanes.get_mut(token) {
                    lane.fallback = Some(result);
                }
            }
            shared.ready.push((token, u64::MAX));
            shared.wake();
            let mut running = shared.fallbacks.lock();
            *running -= 1;
            shared.fallbacks_done.notify_all();
        };
        if let Err(err) = std::thread::Builder::new()
            .name("page-fallback".into())
            .spawn(job)
        {
            // The job was dropped unrun: fail its window.
            tracing::warn!(%err, "cannot start a fallback thread");
            *self.fallbacks.lock() -= 1;
            lane.fallback = Some(Err(TransportError::Config(format!(
                "cannot start a fallback thread: {err}"
            ))));
            self.ready.push((token, u64::MAX));
        }
    }

    pub(super) fn submit(
        self: &Arc<Self>,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
        mut owned: Option<Box<[Page]>>,
        user_data: u64,
    ) -> Result<(), TransportError> {
        if gpas.is_empty() {
            return Err(TransportError::Config(
                "a submission needs at least one page".into(),
            ));
        }
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let fresh = |owned| {
            let mut b = Batch::empty();
            b.fill(opcode, gpas, pages, owned, user_data);
            Arc::new(b)
        };
        // A long address list is copied before taking the lock (and its
        // batch is not kept for reuse, see `Batch::worth_keeping`).
        let long = (gpas.len() > SPARE_GPAS).then(|| fresh(owned.take()));
        let mut st = self.stepper.lock();
        let batch = match long {
            Some(batch) => batch,
            // A spare batch is never shared: `get_mut` finds it unique.
            None => st
                .spare
                .pop()
                .and_then(|mut batch| {
                    Arc::get_mut(&mut batch)?.fill(opcode, gpas, pages, owned.take(), user_data);
                    Some(batch)
                })
                .unwrap_or_else(|| fresh(owned.take())),
        };
        let lanes = batch.lanes();
        let mut batch = Some(batch);
        for i in 0..lanes {
            let token = match st.free.pop() {
                Some(t) => t,
                None => {
                    let token = st.lanes.len();
                    let shared: *const Shared = Arc::as_ptr(self);
                    let hook: *const (dyn ReadyHook + 'static) = shared;
                    // SAFETY: every lane lives in `Shared`, which is the
                    // hook: it outlives every request of the lane.
                    let waiter = unsafe { Waiter::for_queue(hook, token) };
                    st.lanes.push(Box::new(Lane::new(waiter)));
                    token
                }
            };
            // The last lane takes the submission's own reference.
            st.lanes[token].batch = if i + 1 == lanes {
                batch.take()
            } else {
                batch.clone()
            };
            st.waiting.push_back(token);
        }
        self.start_waiting(&mut st);
        if self.mode != Mode::Poll && !self.reaper_reads_tcp.load(Ordering::Relaxed) {
            // Nobody may reap before an answer: ring the doorbell now. (In
            // poll mode the next `poll` or `wait` does, and a reaper that
            // reads the sockets itself does before it waits, so a burst of
            // submissions goes out with one write per connection.)
            self.flush(&mut st);
        }
        // A window that failed at once may have delivered the submission.
        self.books(&mut st);
        drop(st);
        if self.mode == Mode::Poll {
            self.rouse_reaper();
        }
        Ok(())
    }

    /// Poll mode, after a submission: a thread asleep in `wait` on another
    /// thread than the submitter's wakes up to ring the doorbell (the
    /// submission would otherwise stay unsent until its sleep ends), and
    /// one about to sleep does not: it checks `submitted` after announcing
    /// its sleep, as `wake` pairs with its check of `ready`.
    fn rouse_reaper(&self) {
        // Already set and not yet cleared: the reaper clears it only before
        // a `poll`, whose stepper lock comes after this submission's (the
        // one that saw the flag set did so after its own submission), so
        // that poll sends it; and a reaper about to sleep still sees the
        // flag. A burst of submissions pays for the fence once.
        if self.submitted.load(Ordering::Relaxed) {
            return;
        }
        self.submitted.store(true, Ordering::SeqCst);
        self.wake();
    }
}

/// Adds one to the eventfd `fd`.
pub(super) fn write_eventfd(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
    let ret = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    if ret < 0 {
        tracing::debug!(err = %std::io::Error::last_os_error(), "completion eventfd write failed");
    }
}

/// Resets the eventfd `fd` (non-blocking: nothing happens when it is not
/// signalled).
pub(super) fn reset_eventfd(fd: &OwnedFd) {
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live buffer; the fd is non-blocking.
    let _ = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
}

/// The queue's thread. Callback mode: reaps and runs the callback. Eventfd
/// mode: signals the eventfd when a deadline passes (answers signal it
/// themselves).
pub(super) fn service(shared: &Arc<Shared>) {
    if shared.mode == Mode::Callback {
        *shared.sleeper.lock() = Some(std::thread::current());
    }
    while !shared.stop.load(Ordering::Acquire) {
        let earliest = if shared.mode == Mode::Callback {
            let mut out = Vec::new();
            let (earliest, _) = shared.step(&mut out);
            if !out.is_empty() {
                if let Some(cb) = shared.callback.lock().as_mut() {
                    for c in out {
                        cb(c);
                    }
                }
            }
            earliest
        } else {
            let st = shared.stepper.lock();
            st.active.iter().map(|&t| st.lanes[t].deadline).min()
        };
        if !shared.ready.is_empty() {
            continue;
        }
        let now = Instant::now();
        match earliest {
            Some(d) if d <= now => {
                if shared.mode == Mode::Eventfd {
                    shared.signal_eventfd();
                    // Give the VMM time to poll before signalling again.
                    std::thread::park_timeout(Duration::from_millis(1));
                }
            }
            Some(d) => std::thread::park_timeout(d - now),
            None => std::thread::park_timeout(Duration::from_millis(100)),
        }
    }
}
