//! Fault handler threads: read fault messages from the region's
//! userfaultfd and resolve them, many at a time.
//!
//! - MISSING fault (MINOR too, on a shared region): claim the page
//!   (`FETCHING`), submit its read to the thread's own completion queue and
//!   go on serving other faults; the queue's eventfd sits in the thread's
//!   poll set next to the userfaultfd. When the page arrives it is put in
//!   place (`install.rs`): `UFFDIO_COPY` from the receive buffer, or, on a
//!   shared region, received straight into the alias and mapped with
//!   `UFFDIO_CONTINUE`. So a hung node delays only the faults that need
//!   it, and one thread keeps many fetches in flight.
//! - WP fault (first write to a clean page): mark it dirty and lift the
//!   protection.
//! - A page that is busy (being fetched, installed, prefetched, flushed or
//!   evicted) is not waited for: the fault is left parked in the kernel and
//!   whoever releases the page wakes it, so the thread re-faults. Concurrent
//!   faults on one page thus fetch it once.
//! - A fetch that fails with a transient error is retried every
//!   `retry_interval_ms` from a per-thread list (the handler keeps serving
//!   other faults meanwhile) until `fault_timeout_ms`; then the fault is
//!   reported through the embedder's callback and, by default, the thread
//!   gets SIGBUS (see [`SigbusMethod`]).
//!
//! Buffers, fetch slots and the retry list are reused: a steady stream of
//! faults allocates only what a submission to the queue does.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::TransportError;
use crate::manager::{Completion, CompletionQueue};
use crate::page::{Page, PAGE_SIZE};
use crate::tcp::TcpConnection;
use crate::uffd::{Event, EventBuffer, FaultKind, Pagefault};

use super::config::{FaultAction, FaultReport, SigbusMethod};
use super::install::{self, Installed};
use super::shared::{is_transient, Counters, Shared};
use super::state::{DIRTY, FETCHING, LOCKED, POISONED, PRESENT};

const EVENTS_PER_READ: usize = 16;
/// The userfaultfd, the stop eventfd and the queue's eventfd; the sockets
/// of the fetches in flight follow.
const FIXED_FDS: usize = 3;
const RETRY_SLOTS: usize = 256;
/// Fetches one handler thread keeps in flight at most; a fault beyond them
/// waits one retry interval.
const MAX_FETCHES: usize = 256;
/// While spinning on answers, the userfaultfd and the stop and queue
/// eventfds are looked at every this many socket reads.
const UFFD_CHECK_EVERY: u32 = 4;
/// How long the one-fault path (`Handler::fetch_now`) waits for its answer
/// before it hands the fault to the completion queue: past the p999 of a
/// page on a loaded loopback, short enough that the faults behind it do
/// not notice a hung node.
const FETCH_NOW_WAIT: Duration = Duration::from_micros(200);

/// How a handler's spin on its one fetch ended.
enum Spun {
    /// Completions were taken: the next pass starts.
    Served,
    /// Its `poll` of the fixed fds found them ready (this many): the pass
    /// goes on with their `revents`.
    Ready(libc::c_int),
    /// Nothing within the spin: the pass blocks in `poll`.
    Idle,
}

/// A fault whose page could not be fetched yet.
#[derive(Debug, Clone, Copy)]
struct PendingFault {
    page: usize,
    write: bool,
    thread_id: i32,
    first_seen: Instant,
    due: Instant,
    attempts: u32,
}

/// A fetch in flight: the fault it serves and the generation its page was
/// claimed at.
#[derive(Debug, Clone, Copy)]
struct Fetch {
    fault: PendingFault,
    gen: u32,
}

/// Runs one handler thread until `shared.stop` is set. `queue` is the
/// thread's own, made with [`crate::manager::Reap::Eventfd`].
pub(crate) fn run(shared: &Arc<Shared>, queue: CompletionQueue) {
    let mut events = EventBuffer::new(EVENTS_PER_READ);
    queue.read_tcp_myself();
    let queue_fd = queue.eventfd().map_or(-1, |fd| fd.as_raw_fd());
    let mut fds: Vec<libc::pollfd> = [shared.uffd.raw_fd(), shared.stop_fd, queue_fd]
        .into_iter()
        .map(|fd| libc::pollfd {
            // A negative fd (no eventfd) is ignored by poll.
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let mut sockets: Vec<Option<Arc<TcpConnection>>> = Vec::new();
    let mut handler = Handler {
        shared,
        pending: Vec::with_capacity(RETRY_SLOTS),
        queue,
        fetches: Vec::with_capacity(MAX_FETCHES),
        free: Vec::with_capacity(MAX_FETCHES),
        frames: Vec::new(),
        gpas: Vec::with_capacity(shared.region.unit_pages()),
        done: Vec::with_capacity(MAX_FETCHES),
    };
    // Busy poll mode: while fetches are in flight, the thread polls for
    // their answers (and new faults) before it sleeps.
    let busy_spin = shared.manager.caller_spin();
    while !shared.stop.load(Ordering::Acquire) {
        let timeout_ms = handler.next_retry_in_ms();
        // The sockets our fetches wait on are read here, not by their
        // pollers: an answer wakes this thread directly. (This also writes
        // the fetches submitted since the last pass, all of them at once.)
        sockets.clear();
        handler.queue.before_wait(&mut sockets);
        fds.truncate(FIXED_FDS);
        fds.extend(sockets.iter().flatten().map(|c| libc::pollfd {
            fd: c.stream().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        let spin = if handler.in_flight() {
            busy_spin
        } else {
            Duration::ZERO
        };
        // One fetch on the wire (one faulting vCPU): spin on its socket
        // itself, as a bare client does, not on `poll` over every fd (a
        // system call fewer per try, and one fewer for the answer). With
        // more in flight, `poll` sees new faults and answers at once,
        // which serves several vCPUs better.
        let ret = if !spin.is_zero() && handler.in_flight_count() == 1 {
            match handler.spin_reading(&mut fds, spin) {
                Spun::Served => {
                    handler.run_due_retries();
                    continue;
                }
                Spun::Ready(ret) => ret,
                Spun::Idle => poll_fds(&mut fds, timeout_ms, Duration::ZERO),
            }
        } else {
            poll_fds(&mut fds, timeout_ms, spin)
        };
        if ret < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                tracing::error!(%err, "poll on userfaultfd failed; handler stops");
                break;
            }
        }
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        if fds[2..].iter().any(|f| f.revents != 0) {
            handler.complete();
        }
        if fds[0].revents & libc::POLLIN != 0 {
            handler.drain(&mut events);
        }
        handler.run_due_retries();
    }
    handler.abandon();
}

/// `poll(2)` on `fds`: for up to `spin` without blocking, yielding the CPU
/// between two tries (an answer that comes meanwhile wakes nobody: on a
/// small host waking a sleeping thread costs more than the fetch), then
/// blocking for up to `timeout_ms`.
fn poll_fds(fds: &mut [libc::pollfd], timeout_ms: libc::c_int, spin: Duration) -> libc::c_int {
    let poll = |fds: &mut [libc::pollfd], timeout_ms| {
        // SAFETY: `fds` is a live, correctly sized array of pollfds.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) }
    };
    if !spin.is_zero() {
        let start = Instant::now();
        loop {
            let ret = poll(fds, 0);
            if ret != 0 {
                return ret;
            }
            if start.elapsed() >= spin {
                break;
            }
            std::thread::yield_now();
        }
    }
    poll(fds, timeout_ms)
}

struct Handler<'a> {
    shared: &'a Shared,
    pending: Vec<PendingFault>,
    queue: CompletionQueue,
    /// Fetches in flight, by `user_data`.
    fetches: Vec<Option<Fetch>>,
    free: Vec<usize>,
    /// Spare receive buffers of one page (anonymous region).
    frames: Vec<Box<[Page]>>,
    /// The GPAs of the page being submitted (one, or a huge page's).
    gpas: Vec<u64>,
    done: Vec<Completion>,
}

impl Handler<'_> {
    fn drain(&mut self, events: &mut EventBuffer) {
        loop {
            let got = match self.shared.uffd.read_events(events) {
                Ok(got) => got,
                Err(err) => {
                    tracing::warn!(%err, "reading userfaultfd events failed");
                    return;
                }
            };
            // One fault and nothing else in the thread's hands (one vCPU
            // faulting): fetch it on the one-page path (`fetch_now`).
            let alone = got == 1 && !self.in_flight() && self.pending.is_empty();
            for event in events.events() {
                let Event::Pagefault(Pagefault {
                    addr,
                    kind,
                    write,
                    thread_id,
                }) = event
                else {
                    tracing::debug!(?event, "unexpected userfaultfd event");
                    continue;
                };
                let Some(page) = self.shared.region.page_of_addr(addr) else {
                    tracing::warn!(addr, "fault outside the region; ignored");
                    continue;
                };
                match kind {
                    // MINOR: a shared region's page in the page cache but
                    // not mapped (dropped, or fetched and not mapped yet):
                    // served like a missing one, from its owner.
                    FaultKind::Missing | FaultKind::Minor => {
                        let now = Instant::now();
                        self.missing(
                            PendingFault {
                                page,
                                write,
                                thread_id,
                                first_seen: now,
                                due: now,
                                attempts: 0,
                            },
                            alone,
                        );
                    }
                    FaultKind::WriteProtect => self.write_protected(page),
                }
            }
            if got < events.capacity() {
                return;
            }
        }
    }

    fn next_retry_in_ms(&self) -> libc::c_int {
        let Some(due) = self.pending.iter().map(|p| p.due).min() else {
            return -1;
        };
        let wait = due.saturating_duration_since(Instant::now());
        // Round up so the retry is due when poll returns.
        wait.as_micros().div_ceil(1000).min(60_000) as libc::c_int
    }

    fn run_due_retries(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].due <= now {
                let fault = self.pending.swap_remove(i);
                self.missing(fault, false);
            } else {
                i += 1;
            }
        }
    }

    /// Starts the fetch a MISSING fault needs (or defers the fault behind
    /// whoever works on its page). `alone`: the thread has nothing else to
    /// do, so the page may be fetched on the spot (`fetch_now`).
    fn missing(&mut self, fault: PendingFault, alone: bool) {
        let shared = self.shared;
        let page = fault.page;
        let gen = loop {
            let s = shared.states.load(page);
            match before_fetch(shared, page, s) {
                BeforeFetch::Done => return,
                BeforeFetch::Again => continue,
                BeforeFetch::Fetch => {}
            }
            if let Some(gen) = shared.states.try_start_fetch(page) {
                break gen;
            }
        };
        if self.free.is_empty() && self.fetches.len() >= MAX_FETCHES {
            // Full: give the claim back and come again later.
            shared.release(page, 0, FETCHING, false);
            self.retry_later(fault);
            return;
        }
        let mut fault = fault;
        fault.attempts += 1;
        Counters::add(
            &shared.counters.pages_fetched,
            shared.region.unit_pages() as u64,
        );
        shared.region.gpas_of(page, page + 1, &mut self.gpas);
        if alone && self.gpas.len() == 1 && self.fetch_now(fault, gen) {
            return;
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.fetches.push(None);
                self.fetches.len() - 1
            }
        };
        self.fetches[slot] = Some(Fetch { fault, gen });
        let gpa = &self.gpas[..];
        let submitted = if shared.region.is_shared() {
            // SAFETY: the page is claimed `FETCHING` by us and absent from
            // the guest mapping: no fault maps it and nobody else writes
            // its alias until the completion releases the claim (a dropped
            // queue cancels the read first).
            match unsafe { shared.region.alias_pages_mut(page, page + 1) } {
                // SAFETY: the alias page stays mapped while the region
                // lives, which outlives this thread and its queue.
                Some(dst) => unsafe {
                    self.queue
                        .submit_read_raw(gpa, dst.as_mut_ptr(), slot as u64)
                },
                None => Err(TransportError::Config("shared region without alias".into())),
            }
        } else {
            let frame = take_frame(&mut self.frames);
            self.queue.submit_read(gpa, frame, slot as u64)
        };
        if let Err(err) = submitted {
            self.fetches[slot] = None;
            self.free.push(slot);
            shared.release(page, 0, FETCHING, false);
            self.failed(fault, err);
        }
    }

    /// Spins for up to `spin` reading the fetches' sockets (a read that
    /// finds nothing is one system call, like a bare client's spin), with a
    /// zero-timeout `poll` of the fixed fds (userfaultfd, stop, queue)
    /// every few tries.
    fn spin_reading(&mut self, fds: &mut [libc::pollfd], spin: Duration) -> Spun {
        let start = Instant::now();
        let mut tries = 0u32;
        loop {
            if self.complete() > 0 {
                return Spun::Served;
            }
            tries = tries.wrapping_add(1);
            if tries % UFFD_CHECK_EVERY == 0 {
                // SAFETY: `fds` is a live, correctly sized array of pollfds.
                let ret = unsafe { libc::poll(fds.as_mut_ptr(), FIXED_FDS as libc::nfds_t, 0) };
                if ret > 0 {
                    return Spun::Ready(ret);
                }
                if start.elapsed() >= spin {
                    return Spun::Idle;
                }
            }
            // As the other spins: whoever answers may be queued behind us.
            std::thread::yield_now();
        }
    }

    /// Fetches on the wire (every slot not in flight is in `free`).
    fn in_flight_count(&self) -> usize {
        self.fetches.len() - self.free.len()
    }

    /// Whether any fetch is on the wire.
    fn in_flight(&self) -> bool {
        self.in_flight_count() > 0
    }

    /// Puts the pages whose fetches completed in place; returns how many
    /// completions it took.
    fn complete(&mut self) -> usize {
        let mut done = std::mem::take(&mut self.done);
        let n = self.queue.poll(&mut done);
        for completion in done.drain(..) {
            let slot = completion.user_data as usize;
            let Some(fetch) = self.fetches.get_mut(slot).and_then(Option::take) else {
                tracing::warn!(slot, "completion of an unknown fetch");
                continue;
            };
            self.free.push(slot);
            let page = fetch.fault.page;
            let outcome = match completion.result {
                Ok(()) => {
                    let frame = completion.pages.as_deref().and_then(|p| p.first());
                    Ok(install::fetched(
                        self.shared,
                        page,
                        fetch.gen,
                        fetch.fault.write,
                        frame,
                    ))
                }
                Err(err) => {
                    self.shared.release(page, 0, FETCHING, false);
                    Err(err)
                }
            };
            if let Some(frame) = completion.pages {
                self.frames.push(frame);
            }
            self.settle(fetch.fault, outcome);
        }
        self.done = done;
        n
    }

    /// What follows a fetch of `fault`'s page and its install.
    fn settle(&mut self, fault: PendingFault, outcome: Result<Installed, TransportError>) {
        match outcome {
            Ok(Installed::Mapped) => super::prefetch::after_fault(self.shared, fault.page),
            Ok(Installed::Settled) => {}
            Ok(Installed::Again) => self.missing(fault, false),
            Err(err) => self.failed(fault, err),
        }
    }

    /// The one-fault path: `fault`'s page (one page, claimed `FETCHING` at
    /// `gen`, its GPA in `self.gpas`) read and put in place right here, as
    /// a bare handler would, on the manager's one-page TCP path: no
    /// completion queue, no round, no slot. The answer is waited for at
    /// most [`FETCH_NOW_WAIT`], so a slow or hung node holds the thread's
    /// other faults back that long at most. False (the claim still held)
    /// when that path does not apply, or the read failed or took longer:
    /// the caller submits it the general way, which reads the page again
    /// and handles any error.
    fn fetch_now(&mut self, fault: PendingFault, gen: u32) -> bool {
        let shared = self.shared;
        let page = fault.page;
        let gpa = self.gpas[0];
        let mut frame = None;
        let dst = if shared.region.is_shared() {
            // SAFETY: as in `missing`: the page is claimed `FETCHING` by
            // us and absent from the guest mapping, so nobody else reads
            // or writes its alias until we release the claim.
            match unsafe { shared.region.alias_pages_mut(page, page + 1) } {
                Some(dst) => dst.as_mut_ptr().cast::<u8>(),
                None => return false,
            }
        } else {
            frame
                .insert(take_frame(&mut self.frames))
                .as_mut_ptr()
                .cast::<u8>()
        };
        // SAFETY: `dst` is one page: the claimed page's alias (above), or
        // the frame we own, which nothing else refers to.
        let read = unsafe { shared.manager.read_direct_within(gpa, dst, FETCH_NOW_WAIT) };
        let outcome = matches!(read, Some(Ok(()))).then(|| {
            // Counted before the install wakes the faulting thread (and
            // taken back if it did not map the page), as `missing_faults`.
            Counters::add(&shared.counters.faults_fetched_inline, 1);
            let outcome = install::fetched(
                shared,
                page,
                gen,
                fault.write,
                frame.as_deref().and_then(|p| p.first()),
            );
            if !matches!(outcome, Installed::Mapped) {
                Counters::sub(&shared.counters.faults_fetched_inline, 1);
            }
            outcome
        });
        if let Some(frame) = frame {
            self.frames.push(frame);
        }
        match outcome {
            Some(outcome) => {
                self.settle(fault, Ok(outcome));
                true
            }
            None => {
                if let Some(Err(err)) = read {
                    Counters::add(&shared.counters.inline_fetches_given_up, 1);
                    tracing::debug!(page, %err, "one-page fetch did not complete; submitting it");
                }
                false
            }
        }
    }

    /// Gives the claims of the fetches still in flight back (the thread
    /// stops; dropping the queue cancels the reads).
    fn abandon(&mut self) {
        for fetch in self.fetches.iter_mut().filter_map(Option::take) {
            self.shared.release(fetch.fault.page, 0, FETCHING, false);
        }
    }

    fn retry_later(&mut self, mut fault: PendingFault) {
        let retry = Duration::from_millis(self.shared.config.retry_interval_ms.max(1));
        fault.due = Instant::now() + retry;
        if self.pending.len() < RETRY_SLOTS {
            self.pending.push(fault);
        } else {
            // No room anywhere: the thread faults again when woken.
            self.shared.wake(fault.page);
        }
    }

    /// First write to a clean page: mark it dirty, lift the protection.
    fn write_protected(&self, page: usize) {
        let shared = self.shared;
        let states = &shared.states;
        Counters::add(&shared.counters.wp_faults, 1);
        loop {
            let Some(s) = states.try_lock(page) else {
                if states.defer(page, LOCKED) {
                    Counters::add(&shared.counters.deferred_faults, 1);
                    return;
                }
                continue;
            };
            if s & PRESENT == 0 {
                // Dropped since the fault: the thread will fault MISSING.
                shared.release(page, 0, LOCKED, false);
                shared.wake(page);
                return;
            }
            // Dirty before writable (see `install::fetched`).
            states.set_bits(page, DIRTY);
            let woken = match shared
                .uffd
                .unprotect(shared.region.page_addr(page), shared.region.unit_bytes())
            {
                Ok(()) => true,
                Err(err) => {
                    tracing::warn!(%err, page, "lifting write protection failed");
                    false
                }
            };
            shared.release(page, 0, LOCKED, false);
            if !woken {
                shared.wake(page);
            }
            return;
        }
    }

    fn failed(&mut self, mut fault: PendingFault, err: TransportError) {
        let shared = self.shared;
        let timeout = Duration::from_millis(shared.config.fault_timeout_ms);
        let retry = Duration::from_millis(shared.config.retry_interval_ms.max(1));
        let now = Instant::now();
        let waited = now.saturating_duration_since(fault.first_seen);
        if is_transient(&err) && waited < timeout && self.pending.len() < RETRY_SLOTS {
            tracing::debug!(page = fault.page, %err, "page fetch failed; retrying");
            fault.due = now + retry;
            self.pending.push(fault);
            return;
        }
        Counters::add(&shared.counters.fault_errors, 1);
        let report = FaultReport {
            gpa: shared.region.page_gpa(fault.page),
            host_addr: shared.region.page_addr(fault.page) as usize,
            thread_id: fault.thread_id,
            write: fault.write,
            attempts: fault.attempts,
            waited_ms: waited.as_millis() as u64,
            error: err,
        };
        let action = match &shared.config.on_fault_error {
            Some(callback) => {
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback(&report))) {
                    Ok(action) => action,
                    Err(_) => {
                        tracing::error!("fault-error callback panicked; raising SIGBUS");
                        FaultAction::Sigbus
                    }
                }
            }
            None => FaultAction::Sigbus,
        };
        match action {
            FaultAction::Retry if self.pending.len() < RETRY_SLOTS => {
                tracing::debug!(gpa = report.gpa, error = %report.error, "fault failed; embedder asked to retry");
                fault.first_seen = now;
                fault.due = now + retry;
                self.pending.push(fault);
            }
            _ => {
                tracing::warn!(gpa = report.gpa, thread = report.thread_id, error = %report.error,
                    waited_ms = report.waited_ms, "fault cannot be served; raising SIGBUS");
                raise_sigbus(shared, fault.page, fault.thread_id);
            }
        }
    }
}

/// A spare one-page receive buffer of `frames` (anonymous region), or a
/// new one.
fn take_frame(frames: &mut Vec<Box<[Page]>>) -> Box<[Page]> {
    frames
        .pop()
        .unwrap_or_else(|| vec![[0u8; PAGE_SIZE]; 1].into_boxed_slice())
}

/// What a MISSING fault on `page`, whose state word was `s`, needs before
/// anything is fetched.
pub(super) enum BeforeFetch {
    /// Resolved since it was raised (its thread is woken), or deferred
    /// behind whoever works on the page: nothing to do.
    Done,
    /// The page changed under us: look again.
    Again,
    /// Nobody has it or works on it: fetch it.
    Fetch,
}

/// Shared by both backings' fault paths (see [`BeforeFetch`]).
pub(super) fn before_fetch(shared: &Shared, page: usize, s: u32) -> BeforeFetch {
    // A present page of a region that cannot write-protect may be unmapped
    // (see `map_present_again`): while flush or evict holds it, the fault
    // waits below like any fault on a locked page.
    let unmapped_maybe = s & PRESENT != 0 && !shared.uffd.write_protects();
    if unmapped_maybe && s & LOCKED == 0 {
        return map_present_again(shared, page);
    }
    if s & (PRESENT | POISONED) != 0 && !unmapped_maybe {
        // Resolved since the fault was raised; make sure it is awake.
        shared.wake(page);
        return BeforeFetch::Done;
    }
    if s & (LOCKED | FETCHING) != 0 {
        if !shared.states.defer(page, LOCKED | FETCHING) {
            return BeforeFetch::Again;
        }
        Counters::add(&shared.counters.deferred_faults, 1);
        if s & FETCHING != 0 {
            super::prefetch::after_deferred(shared, page);
        }
        return BeforeFetch::Done;
    }
    BeforeFetch::Fetch
}

/// A fault on a present, unlocked page of a region that cannot
/// write-protect (a shared file on Linux < 5.19). Flush and evict unmap
/// such pages from the guest while they hold them (their contents stay in
/// the file); one they left unmapped after a failed write-back, or one the
/// fault was raised for before its install, is mapped again from the file,
/// under its lock, writable: it was dirty and stays so.
fn map_present_again(shared: &Shared, page: usize) -> BeforeFetch {
    let Some(locked) = shared.states.try_lock(page) else {
        return BeforeFetch::Again;
    };
    if locked & PRESENT == 0 {
        shared.release(page, 0, LOCKED, false);
        return BeforeFetch::Again;
    }
    // SAFETY: a page of the registered range, locked by us, whose contents
    // are in the file's page cache (present, and only ever unmapped from
    // the guest while present).
    let mapped = unsafe {
        shared
            .uffd
            .continue_pages(shared.region.page_addr(page), 1, false)
    };
    if let Err(err) = mapped {
        tracing::warn!(%err, page, "mapping a present page again failed");
    }
    shared.release(page, 0, LOCKED, false);
    shared.wake(page);
    BeforeFetch::Done
}

/// Makes the thread faulting on `page` take SIGBUS, with the region's
/// [`SigbusMethod`].
fn raise_sigbus(shared: &Shared, page: usize, thread_id: i32) {
    Counters::add(&shared.counters.sigbus_raised, 1);
    if shared.sigbus == SigbusMethod::Poison {
        if let Some(s) = shared.states.try_lock(page) {
            if s & PRESENT != 0 {
                // Installed after all: nothing to poison.
                shared.release(page, 0, LOCKED, false);
                shared.wake(page);
                return;
            }
            match shared.uffd.poison_page(shared.region.page_addr(page)) {
                Ok(()) => {
                    shared.release(page, POISONED, LOCKED, false);
                    return;
                }
                Err(err) => {
                    tracing::warn!(%err, page, "UFFDIO_POISON failed; sending SIGBUS with tgkill");
                    shared.release(page, 0, LOCKED, false);
                }
            }
        }
    }
    super::send_sigbus(thread_id);
    shared.wake(page);
}
