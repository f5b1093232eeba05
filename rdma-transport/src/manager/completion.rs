//! The asynchronous API: a [`CompletionQueue`] takes submissions of page
//! reads and writes and hands back one [`Completion`] each, reaped by
//! polling, through an eventfd the VMM puts in its own epoll loop, or by a
//! callback on the queue's thread.
//!
//! A submission's lanes (`async_op.rs`) go on the wire at once; when a
//! lane's round has every answer, its waiter queues it on `ready`, and the
//! thread that reaps (the caller of [`CompletionQueue::poll`] or
//! [`CompletionQueue::wait`], or the queue's thread in callback mode)
//! settles it under `stepper`, puts its next window on the wire, and
//! delivers the submission's completion after its last window.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crossbeam_queue::SegQueue;
use parking_lot::{Condvar, Mutex};

use super::async_op::{Batch, Lane, Next, Phase};
use super::Inner;
use crate::error::TransportError;
use crate::page::Page;
use crate::sys::cvt;
use crate::tcp::{ReadyHook, Waiter};
use crate::wire::Opcode;

/// The outcome of one submission.
#[derive(Debug)]
pub struct Completion {
    /// The submitter's tag.
    pub user_data: u64,
    /// `Ok` when every page was moved; else the first error (the other
    /// pages may or may not have been).
    pub result: Result<(), TransportError>,
    /// The pages of a submission that handed its buffer over
    /// ([`CompletionQueue::submit_read`] / [`CompletionQueue::submit_write`]).
    pub pages: Option<Box<[Page]>>,
}

/// A callback that takes completions ([`Reap::Callback`]).
pub type CompletionCallback = Box<dyn FnMut(Completion) + Send>;

/// How completions reach the VMM.
pub enum Reap {
    /// The VMM calls [`CompletionQueue::poll`] or [`CompletionQueue::wait`].
    Poll,
    /// As `Poll`, and [`CompletionQueue::eventfd`] becomes readable when
    /// there is something to poll (an answer came, or a deadline passed).
    Eventfd,
    /// The queue's own thread runs the callback for every completion. The
    /// callback may submit to the queue, but must not drop it (dropping
    /// joins that thread) and should return quickly: it holds up the
    /// queue's other completions.
    Callback(CompletionCallback),
}

impl std::fmt::Debug for Reap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Poll => "Poll",
            Self::Eventfd => "Eventfd",
            Self::Callback(_) => "Callback",
        })
    }
}

/// Submissions in flight and their completions. Made by
/// [`crate::TransportManager::completion_queue`]; `Send + Sync`, usually
/// owned by one VMM thread. Dropping it cancels what is still in flight
/// (waiting for running fallbacks, at most one request timeout).
#[derive(Debug)]
pub struct CompletionQueue {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Poll,
    Eventfd,
    Callback,
}

pub(super) struct Shared {
    inner: Arc<Inner>,
    mode: Mode,
    ready: SegQueue<(usize, u64)>,
    done: SegQueue<Completion>,
    stepper: Mutex<Stepper>,
    /// Submissions not yet delivered.
    in_flight: AtomicUsize,
    /// Fallback jobs running on worker threads.
    fallbacks: Mutex<usize>,
    fallbacks_done: Condvar,
    eventfd: Option<OwnedFd>,
    /// A thread waiting in `wait` (poll mode) or the callback thread.
    sleeper: Mutex<Option<Thread>>,
    stop: AtomicBool,
    callback: Mutex<Option<CompletionCallback>>,
    /// The reaper waits on the TCP sockets itself
    /// ([`CompletionQueue::read_tcp_myself`]): rounds are not parked on
    /// them.
    reaper_reads_tcp: AtomicBool,
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
struct Stepper {
    lanes: Vec<Box<Lane>>,
    free: Vec<usize>,
    /// Lanes in `Phase::Round`.
    active: Vec<usize>,
    /// Requests of the active lanes (at most `MAX_REQUESTS`).
    requests: usize,
    /// Lanes with a submission that wait for room under `MAX_REQUESTS`.
    waiting: std::collections::VecDeque<usize>,
    /// Scratch: connections read in this step.
    seen: Vec<usize>,
}

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
}

impl ReadyHook for Shared {
    fn ready(&self, token: usize, seq: u64) {
        self.ready.push((token, seq));
        if !std::ptr::eq(STEPPING.with(std::cell::Cell::get), self) {
            self.wake();
        }
    }
}

impl Shared {
    fn wake(&self) {
        if self.mode == Mode::Eventfd {
            self.signal_eventfd();
        }
        // A thread in `wait` (any mode but callback) or the callback thread.
        if let Some(t) = self.sleeper.lock().as_ref() {
            t.unpark();
        }
    }

    fn signal_eventfd(&self) {
        if let Some(fd) = &self.eventfd {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
            let ret = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
            if ret < 0 {
                tracing::debug!(err = %std::io::Error::last_os_error(), "completion eventfd write failed");
            }
        }
    }

    fn drain_eventfd(&self) {
        if let Some(fd) = &self.eventfd {
            let mut buf = [0u8; 8];
            // SAFETY: reads at most 8 bytes into a live buffer; the fd is non-blocking.
            let _ = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        }
    }

    /// Settles every lane that is ready or past its deadline, puts the next
    /// rounds on the wire and queues the completions. Returns the earliest
    /// deadline of the lanes still on the wire.
    fn step(self: &Arc<Self>) -> Option<Instant> {
        let mut st = self.stepper.lock();
        // The doorbell: what was submitted since the last reap goes out.
        self.flush(&mut st);
        // Read what the lanes' connections have, each connection once.
        let mut seen = std::mem::take(&mut st.seen);
        seen.clear();
        STEPPING.with(|s| s.set(Arc::as_ptr(self)));
        for &token in &st.active {
            st.lanes[token].round.progress(&mut seen);
        }
        STEPPING.with(|s| s.set(std::ptr::null()));
        st.seen = seen;
        while let Some((token, seq)) = self.ready.pop() {
            let Some(lane) = st.lanes.get_mut(token) else {
                continue;
            };
            let next = match lane.phase {
                Phase::Round if lane.seq == seq => self.inner.settle_lane(lane),
                Phase::Fallback if seq == u64::MAX && lane.fallback.is_some() => {
                    self.inner.fallback_done(lane)
                }
                _ => continue,
            };
            self.after(&mut st, token, next);
        }
        let now = Instant::now();
        let mut earliest = None::<Instant>;
        let mut i = 0;
        while i < st.active.len() {
            let token = st.active[i];
            let lane = &mut st.lanes[token];
            if lane.phase == Phase::Round && (lane.waiter.is_done() || now >= lane.deadline) {
                let next = self.inner.settle_lane(lane);
                self.after(&mut st, token, next);
                // `after` may have removed or re-added it: look again.
                i = 0;
                earliest = None;
                continue;
            }
            earliest = Some(earliest.map_or(lane.deadline, |e| e.min(lane.deadline)));
            i += 1;
        }
        // Lanes that waited for room, then the next windows of the lanes
        // settled above.
        self.start_waiting(&mut st);
        self.flush(&mut st);
        earliest
    }

    /// Puts waiting lanes on the wire while there is room for a whole
    /// window.
    fn start_waiting(self: &Arc<Self>, st: &mut Stepper) {
        while st.requests + crate::tcp::MAX_CHUNK <= MAX_REQUESTS {
            let Some(token) = st.waiting.pop_front() else {
                break;
            };
            let next = self.inner.advance(&mut st.lanes[token]);
            self.after(st, token, next);
        }
    }

    /// Writes the requests the active lanes queued on their connections
    /// (one `writev` per connection).
    fn flush(&self, st: &mut Stepper) {
        let deadline = Instant::now() + self.inner.config.request_timeout();
        let mut seen = std::mem::take(&mut st.seen);
        seen.clear();
        for &token in &st.active {
            st.lanes[token].round.flush(&mut seen, deadline);
        }
        st.seen = seen;
    }

    /// Books a lane's next step.
    fn after(self: &Arc<Self>, st: &mut Stepper, token: usize, next: Next) {
        if let Some(at) = st.active.iter().position(|&t| t == token) {
            st.active.swap_remove(at);
            st.requests -= st.lanes[token].counted;
            st.lanes[token].counted = 0;
        }
        match next {
            Next::Wait => {
                let counted = st.lanes[token].requests();
                st.requests += counted;
                st.lanes[token].counted = counted;
                let lane = &mut st.lanes[token];
                if self.mode != Mode::Poll || self.sleeper.lock().is_some() {
                    // Nobody polls these connections (or the reaper sleeps
                    // in `wait`): their pollers must (the RDMA ones only,
                    // when the reaper waits on the sockets itself).
                    let tcp = !self.reaper_reads_tcp.load(Ordering::Relaxed);
                    lane.round.park_some(true, tcp);
                }
                st.active.push(token);
            }
            Next::Fallback => self.start_fallback(st, token),
            Next::Idle(complete) => {
                if let Some(batch) = complete {
                    self.deliver(&batch);
                }
                st.lanes[token].batch = None;
                st.free.push(token);
            }
        }
    }

    fn deliver(&self, batch: &Batch) {
        let result = batch.result();
        self.inner
            .counters
            .record(batch.opcode, batch.gpas.len(), &result);
        let completion = Completion {
            user_data: batch.user_data,
            result,
            pages: batch.owned.lock().take(),
        };
        self.done.push(completion);
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    fn start_fallback(self: &Arc<Self>, st: &mut Stepper, token: usize) {
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

    fn submit(self: &Arc<Self>, batch: Batch) -> Result<(), TransportError> {
        if batch.gpas.is_empty() {
            return Err(TransportError::Config(
                "a submission needs at least one page".into(),
            ));
        }
        let batch = Arc::new(batch);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let mut st = self.stepper.lock();
        for _ in 0..batch.lanes() {
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
            st.lanes[token].batch = Some(Arc::clone(&batch));
            st.waiting.push_back(token);
        }
        self.start_waiting(&mut st);
        if self.mode != Mode::Poll {
            // Nobody may reap before an answer: ring the doorbell now. (In
            // poll mode the next `poll` or `wait` does, so a burst of
            // submissions goes out with one write per connection.)
            self.flush(&mut st);
        }
        Ok(())
    }

    fn take_done(&self, out: &mut Vec<Completion>) -> usize {
        let mut n = 0;
        while let Some(c) = self.done.pop() {
            out.push(c);
            n += 1;
        }
        n
    }
}

impl Inner {
    /// A new completion queue of this manager.
    pub(super) fn completion_queue(
        self: &Arc<Self>,
        reap: Reap,
    ) -> Result<CompletionQueue, TransportError> {
        let (mode, callback) = match reap {
            Reap::Poll => (Mode::Poll, None),
            Reap::Eventfd => (Mode::Eventfd, None),
            Reap::Callback(f) => (Mode::Callback, Some(f)),
        };
        let eventfd = if mode == Mode::Eventfd {
            // SAFETY: eventfd takes no pointers; the result is checked.
            let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })
                .map_err(|e| TransportError::Config(format!("cannot create an eventfd: {e}")))?;
            // SAFETY: `fd` is a fresh descriptor nothing else owns.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        } else {
            None
        };
        let shared = Arc::new(Shared {
            inner: Arc::clone(self),
            mode,
            ready: SegQueue::new(),
            done: SegQueue::new(),
            stepper: Mutex::new(Stepper {
                lanes: Vec::new(),
                free: Vec::new(),
                active: Vec::new(),
                requests: 0,
                waiting: std::collections::VecDeque::new(),
                seen: Vec::new(),
            }),
            in_flight: AtomicUsize::new(0),
            fallbacks: Mutex::new(0),
            fallbacks_done: Condvar::new(),
            eventfd,
            sleeper: Mutex::new(None),
            stop: AtomicBool::new(false),
            callback: Mutex::new(callback),
            reaper_reads_tcp: AtomicBool::new(false),
        });
        let thread = match mode {
            Mode::Poll => None,
            Mode::Eventfd | Mode::Callback => {
                let s = Arc::clone(&shared);
                let handle = std::thread::Builder::new()
                    .name("page-completions".into())
                    .spawn(move || service(&s))
                    .map_err(|e| {
                        TransportError::Config(format!("cannot start the completion thread: {e}"))
                    })?;
                Some(handle)
            }
        };
        Ok(CompletionQueue { shared, thread })
    }
}

/// The queue's thread. Callback mode: reaps and runs the callback. Eventfd
/// mode: signals the eventfd when a deadline passes (answers signal it
/// themselves).
fn service(shared: &Arc<Shared>) {
    if shared.mode == Mode::Callback {
        *shared.sleeper.lock() = Some(std::thread::current());
    }
    while !shared.stop.load(Ordering::Acquire) {
        let earliest = if shared.mode == Mode::Callback {
            let earliest = shared.step();
            let mut out = Vec::new();
            shared.take_done(&mut out);
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

impl CompletionQueue {
    /// Reads the pages at `gpas` into `pages` (`pages.len() == gpas.len()`),
    /// all in flight at once; the buffer comes back in the completion.
    ///
    /// # Errors
    /// [`TransportError::Config`] when the lengths differ or are zero; every
    /// other error comes in the completion.
    pub fn submit_read(
        &self,
        gpas: &[u64],
        pages: Box<[Page]>,
        user_data: u64,
    ) -> Result<(), TransportError> {
        self.submit_owned(Opcode::Read, gpas, pages, user_data)
    }

    /// Writes `pages[i]` to `gpas[i]`; the buffer comes back in the
    /// completion.
    ///
    /// # Errors
    /// As [`CompletionQueue::submit_read`].
    pub fn submit_write(
        &self,
        gpas: &[u64],
        pages: Box<[Page]>,
        user_data: u64,
    ) -> Result<(), TransportError> {
        self.submit_owned(Opcode::Write, gpas, pages, user_data)
    }

    fn submit_owned(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        mut pages: Box<[Page]>,
        user_data: u64,
    ) -> Result<(), TransportError> {
        super::check_lengths(gpas.len(), pages.len())?;
        let ptr = pages.as_mut_ptr().cast::<u8>();
        self.shared
            .submit(Batch::new(opcode, gpas.into(), ptr, Some(pages), user_data))
    }

    /// Reads the pages at `gpas` into memory the caller keeps (e.g. guest
    /// memory): page i lands at `pages + i * 4096`, with no copy in between
    /// over TCP.
    ///
    /// # Safety
    /// `pages` must be valid for writes of `gpas.len()` pages and must not
    /// be read or written by anyone else until this submission's completion
    /// was reaped or the queue was dropped.
    ///
    /// # Errors
    /// As [`CompletionQueue::submit_read`].
    pub unsafe fn submit_read_raw(
        &self,
        gpas: &[u64],
        pages: *mut Page,
        user_data: u64,
    ) -> Result<(), TransportError> {
        self.shared.submit(Batch::new(
            Opcode::Read,
            gpas.into(),
            pages.cast(),
            None,
            user_data,
        ))
    }

    /// Writes the pages at `pages` (kept by the caller) to `gpas`.
    ///
    /// # Safety
    /// `pages` must be valid for reads of `gpas.len()` pages and must not
    /// be written until this submission's completion was reaped or the
    /// queue was dropped.
    ///
    /// # Errors
    /// As [`CompletionQueue::submit_read`].
    pub unsafe fn submit_write_raw(
        &self,
        gpas: &[u64],
        pages: *const Page,
        user_data: u64,
    ) -> Result<(), TransportError> {
        self.shared.submit(Batch::new(
            Opcode::Write,
            gpas.into(),
            pages.cast::<u8>().cast_mut(),
            None,
            user_data,
        ))
    }

    /// Moves whatever is ready on (writes what was submitted since the
    /// last reap, settles answered rounds, puts the next windows on the
    /// wire) and appends the completions to `out`, without blocking. In
    /// [`Reap::Poll`] mode, TCP requests go out here (or in `wait`): a burst
    /// of submissions costs one `writev` per connection. Returns how many it appended. (Callback mode: always 0,
    /// the callback gets them.)
    pub fn poll(&self, out: &mut Vec<Completion>) -> usize {
        if self.shared.mode == Mode::Callback {
            return 0;
        }
        self.shared.drain_eventfd();
        self.shared.step();
        self.shared.take_done(out)
    }

    /// As [`CompletionQueue::poll`], waiting up to `timeout` until at least
    /// `min` completions were appended or nothing is in flight any more.
    /// Spins for the manager's `wait_spin_us` (busy poll mode), then
    /// sleeps until an answer or a deadline.
    pub fn wait(&self, out: &mut Vec<Completion>, min: usize, timeout: Duration) -> usize {
        if self.shared.mode == Mode::Callback {
            return 0;
        }
        let start = Instant::now();
        let until = start + timeout;
        let spin = match self.shared.inner.config.poll_mode {
            crate::PollMode::Busy => Duration::from_micros(self.shared.inner.config.wait_spin_us),
            crate::PollMode::Event => Duration::ZERO,
        };
        let mut got = 0;
        loop {
            got += self.poll(out);
            if got >= min || self.in_flight() == 0 {
                return got;
            }
            let now = Instant::now();
            if now >= until {
                return got;
            }
            if now.duration_since(start) < spin {
                // On a small host whoever answers may be queued behind us
                // on this CPU: let it run (see tcp/receive.rs).
                std::thread::yield_now();
                continue;
            }
            // Sleep: the pollers read the lanes' answers meanwhile.
            *self.shared.sleeper.lock() = Some(std::thread::current());
            let earliest = {
                let mut st = self.shared.stepper.lock();
                let st = &mut *st;
                for &t in &st.active {
                    st.lanes[t].round.park(true);
                }
                st.active.iter().map(|&t| st.lanes[t].deadline).min()
            };
            if self.shared.ready.is_empty() {
                let wake_at = earliest.map_or(until, |d| d.min(until));
                std::thread::park_timeout(wake_at.saturating_duration_since(Instant::now()));
            }
            *self.shared.sleeper.lock() = None;
            let mut st = self.shared.stepper.lock();
            let st = &mut *st;
            for &t in &st.active {
                st.lanes[t].round.park(false);
            }
        }
    }

    /// From now on the reaper waits on the TCP sockets of the rounds on
    /// the wire itself ([`CompletionQueue::tcp_connections`], in its own
    /// poll loop next to the eventfd) and calls [`CompletionQueue::poll`]
    /// when one is readable: their pollers are not asked to read them, and
    /// an answer costs one wake-up instead of the poller's plus the
    /// eventfd's. The eventfd still signals RDMA answers, fallbacks and
    /// deadlines. The fault handlers do this.
    pub(crate) fn read_tcp_myself(&self) {
        self.shared.reaper_reads_tcp.store(true, Ordering::Relaxed);
    }

    /// The TCP connections the queue's rounds on the wire wait on (see
    /// [`CompletionQueue::read_tcp_myself`]).
    pub(crate) fn tcp_connections(&self, out: &mut Vec<Option<Arc<crate::tcp::TcpConnection>>>) {
        let st = self.shared.stepper.lock();
        for &t in &st.active {
            st.lanes[t].round.tcp_connections(out);
        }
    }

    /// Submissions not yet delivered.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Acquire)
    }

    /// The eventfd ([`Reap::Eventfd`] only): readable when [`poll`] has
    /// something to do.
    ///
    /// [`poll`]: CompletionQueue::poll
    pub fn eventfd(&self) -> Option<BorrowedFd<'_>> {
        self.shared.eventfd.as_ref().map(AsFd::as_fd)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            if t.join().is_err() {
                tracing::error!("completion thread panicked");
            }
        }
        // Running fallbacks write into the submitters' pages: wait for them.
        let mut running = self.shared.fallbacks.lock();
        while *running > 0 {
            self.shared.fallbacks_done.wait(&mut running);
        }
        drop(running);
        // Cancel every round still on the wire: nothing may write into the
        // pages or signal a lane after this.
        let mut st = self.shared.stepper.lock();
        // Queued requests go out first (they are cancelled just below): a
        // queue must never keep pointers into pages it no longer owns.
        self.shared.flush(&mut st);
        let active = std::mem::take(&mut st.active);
        for token in active {
            self.shared.inner.cancel_lane(&mut st.lanes[token]);
        }
    }
}
