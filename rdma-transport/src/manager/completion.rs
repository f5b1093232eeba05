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

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::SegQueue;
use parking_lot::{Condvar, Mutex};

use super::{async_op, Inner};
use crate::error::TransportError;
use crate::page::Page;
use crate::sys::cvt;
use crate::wire::Opcode;

mod on_wire;
mod stepper;

pub(super) use on_wire::Held;
use on_wire::OnWire;
use stepper::{service, Mode, Shared, Stepper};

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
/// owned by one VMM thread (in [`Reap::Poll`] mode, a submission from
/// another thread wakes one sleeping in [`CompletionQueue::wait`], which
/// then sends it). Dropping it cancels what is still in flight
/// (waiting for running fallbacks, at most one request timeout).
#[derive(Debug)]
pub struct CompletionQueue {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
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
        let new_eventfd = || -> Result<OwnedFd, TransportError> {
            // SAFETY: eventfd takes no pointers; the result is checked.
            let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })
                .map_err(|e| TransportError::Config(format!("cannot create an eventfd: {e}")))?;
            // SAFETY: `fd` is a fresh descriptor nothing else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        };
        let eventfd = if mode == Mode::Eventfd {
            Some(new_eventfd()?)
        } else {
            None
        };
        // Without it, `wait` parks as before: slower, not wrong.
        let wake_fd = if mode == Mode::Poll {
            new_eventfd()
                .map_err(|err| tracing::debug!(%err, "completion queue: no wake fd; wait parks"))
                .ok()
        } else {
            None
        };
        let shared = Arc::new(Shared {
            inner: Arc::clone(self),
            mode,
            ready: SegQueue::new(),
            stepper: Mutex::new(Stepper {
                lanes: Vec::new(),
                free: Vec::new(),
                active: Vec::new(),
                on_wire: OnWire::default(),
                requests: 0,
                waiting: VecDeque::new(),
                unflushed: false,
                spare: Vec::new(),
                done: VecDeque::new(),
                delivered: 0,
                tally: Default::default(),
                next_deadline: None,
                step_ready: Vec::new(),
            }),
            in_flight: AtomicUsize::new(0),
            fallbacks: Mutex::new(0),
            fallbacks_done: Condvar::new(),
            eventfd,
            eventfd_signalled: AtomicBool::new(false),
            sleeper: Mutex::new(None),
            parked_in_wait: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            callback: Mutex::new(callback),
            reaper_reads_tcp: AtomicBool::new(false),
            wake_fd,
            fd_sleeper: AtomicBool::new(false),
            submitted: AtomicBool::new(false),
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

impl CompletionQueue {
    /// Reads the pages at `gpas` into `pages` (`pages.len() == gpas.len()`),
    /// all in flight at once; the buffer comes back in the completion. A
    /// page whose read failed holds unspecified bytes (over TCP an answer
    /// may be read straight into its page and checked there).
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
            .submit(opcode, gpas, ptr, Some(pages), user_data)
    }

    /// Reads the pages at `gpas` into memory the caller keeps (e.g. guest
    /// memory): page i lands at `pages + i * 4096`. Over TCP, the answers
    /// of such reads that come next on their connection go from the socket
    /// straight into their pages (one `readv` for up to 32; each checksum
    /// is checked there); others are copied once from the connection's
    /// receive buffer (`ZeroCopyStats::tcp_direct_pages` counts the
    /// former). A page whose read failed holds unspecified bytes.
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
        self.shared
            .submit(Opcode::Read, gpas, pages.cast(), None, user_data)
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
        self.shared.submit(
            Opcode::Write,
            gpas,
            pages.cast::<u8>().cast_mut(),
            None,
            user_data,
        )
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
        self.shared.step(out).1
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
        let spin = self.shared.inner.config.caller_spin();
        let mut got = 0;
        loop {
            // Cleared before the doorbell rings in `poll`: a submission
            // made later (on another thread) sets it again, and this
            // thread does not sleep before it has sent that one too. (Left
            // set is always safe: it costs one more pass.)
            if self.shared.submitted.load(Ordering::Relaxed) {
                self.shared.submitted.store(false, Ordering::SeqCst);
            }
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
            if self.sleep_on_sockets(until) {
                continue;
            }
            // Sleep: the pollers read the lanes' answers meanwhile.
            *self.shared.sleeper.lock() = Some(std::thread::current());
            // Before the stepper lock below: a lane booked after that sees
            // it (and is parked by `after`); one booked before is parked
            // here.
            self.shared.parked_in_wait.store(true, Ordering::Relaxed);
            let earliest = {
                let mut st = self.shared.stepper.lock();
                let st = &mut *st;
                for &t in &st.active {
                    st.lanes[t].round.park(true);
                }
                st.active.iter().map(|&t| st.lanes[t].deadline).min()
            };
            if self.shared.ready.is_empty() && !self.shared.submitted.load(Ordering::SeqCst) {
                let wake_at = earliest.map_or(until, |d| d.min(until));
                std::thread::park_timeout(wake_at.saturating_duration_since(Instant::now()));
            }
            *self.shared.sleeper.lock() = None;
            self.shared.parked_in_wait.store(false, Ordering::Relaxed);
            let mut st = self.shared.stepper.lock();
            let st = &mut *st;
            for &t in &st.active {
                st.lanes[t].round.park(false);
            }
        }
    }

    /// Poll mode's sleep in `wait`, until an answer, a wake-up or the
    /// earliest deadline (at most `until`): in `ppoll` on the TCP sockets
    /// of the rounds on the wire and the queue's wake fd, so an answer
    /// wakes this thread directly, which then reads it (one wake-up, not
    /// a poller's and then this thread's). Their RDMA connections are left
    /// to the pollers, whose answers, like the fallbacks' and other
    /// readers', come through `Shared::wake`. False when there is no wake
    /// fd (the caller parks instead).
    fn sleep_on_sockets(&self, until: Instant) -> bool {
        let shared = &*self.shared;
        let Some(wake_fd) = shared.wake_fd.as_ref() else {
            return false;
        };
        let mut conns = Vec::new();
        let earliest = {
            let mut st = shared.stepper.lock();
            let st = &mut *st;
            for &t in &st.active {
                st.lanes[t].round.park_some(true, false);
            }
            st.on_wire.tcp_connections(&mut conns);
            st.active.iter().map(|&t| st.lanes[t].deadline).min()
        };
        shared.fd_sleeper.store(true, Ordering::SeqCst);
        // Pairs with the fence in `Shared::wake` (`ready`) and with
        // `Shared::rouse_reaper` (`submitted`).
        std::sync::atomic::fence(Ordering::SeqCst);
        if shared.ready.is_empty() && !shared.submitted.load(Ordering::SeqCst) {
            let mut fds: Vec<libc::pollfd> = std::iter::once(wake_fd.as_raw_fd())
                .chain(conns.iter().flatten().map(|c| c.stream().as_raw_fd()))
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            let wake_at = earliest.map_or(until, |d| d.min(until));
            let timeout = crate::sys::timespec(wake_at.saturating_duration_since(Instant::now()));
            // SAFETY: `fds` are live, initialised pollfds; `timeout` is a
            // valid timespec and a null signal mask is allowed.
            let ret = unsafe {
                libc::ppoll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    &timeout,
                    std::ptr::null(),
                )
            };
            if ret > 0 && fds[0].revents != 0 {
                stepper::reset_eventfd(wake_fd);
            }
        }
        shared.fd_sleeper.store(false, Ordering::SeqCst);
        let mut st = shared.stepper.lock();
        let st = &mut *st;
        for &t in &st.active {
            st.lanes[t].round.park(false);
        }
        true
    }

    /// From now on the reaper waits on the TCP sockets of the rounds on
    /// the wire itself ([`CompletionQueue::before_wait`], in its own
    /// poll loop next to the eventfd) and calls [`CompletionQueue::poll`]
    /// when one is readable: their pollers are not asked to read them, and
    /// an answer costs one wake-up instead of the poller's plus the
    /// eventfd's. The eventfd still signals RDMA answers, fallbacks and
    /// deadlines. The fault handlers do this.
    ///
    /// The reaper then also rings the doorbell: a submission is not written
    /// at once but by the reaper's next `before_wait` (which it calls
    /// before each wait) or `poll`, so the faults it read together go out
    /// with one `writev` per connection.
    pub(crate) fn read_tcp_myself(&self) {
        self.shared.reaper_reads_tcp.store(true, Ordering::Relaxed);
    }

    /// Writes what was submitted since the last call or `poll` (the
    /// doorbell), then adds the TCP connections the queue's rounds on the
    /// wire wait on to `out` (see [`CompletionQueue::read_tcp_myself`]).
    pub(crate) fn before_wait(&self, out: &mut Vec<Option<Arc<crate::tcp::TcpConnection>>>) {
        let mut st = self.shared.stepper.lock();
        self.shared.flush(&mut st);
        st.on_wire.tcp_connections(out);
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
            st.lanes[token].active_at = async_op::NOT_ACTIVE;
            st.lanes[token].on_wire.clear();
            self.shared.inner.cancel_lane(&mut st.lanes[token]);
        }
        st.on_wire.clear();
    }
}
