//! Fault handler threads: read fault messages from the region's
//! userfaultfd and resolve them.
//!
//! - MISSING fault: fetch the page from its owner into a pool frame
//!   ([`TransportManager::read_frame`](crate::TransportManager::read_frame)), then `UFFDIO_COPY` it in, clean
//!   (write-protected) for a read, dirty (writable) for a write. EEXIST means
//!   another thread installed it; EAGAIN is retried.
//!   A shared region's MISSING and MINOR faults go to `minor.rs` instead:
//!   fetched straight into the alias, mapped with `UFFDIO_CONTINUE`.
//! - WP fault (first write to a clean page): mark it dirty and lift the
//!   protection.
//! - A page that is busy (being installed, prefetched, flushed or evicted)
//!   is not waited for: the fault is left parked in the kernel and whoever
//!   releases the page wakes it, so the thread re-faults.
//! - A fetch that fails with a transient error is retried every
//!   `retry_interval_ms` from a per-thread list (the handler keeps serving
//!   other faults meanwhile) until `fault_timeout_ms`; then the fault is
//!   reported through the embedder's callback and, by default, the thread
//!   gets SIGBUS (see [`SigbusMethod`]).
//!
//! The loop allocates nothing after start-up: the event buffer and the
//! retry list are allocated once.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::TransportError;
use crate::uffd::{Event, EventBuffer, FaultKind, Pagefault};

use super::config::{FaultAction, FaultReport, SigbusMethod};
use super::shared::{is_transient, Counters, Shared};
use super::state::{generation, DIRTY, FETCHING, LOCKED, POISONED, PRESENT};
use super::uffd::CopyOutcome;

const EVENTS_PER_READ: usize = 16;
const RETRY_SLOTS: usize = 256;
const COPY_AGAIN_LIMIT: u32 = 1000;

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

/// Runs one handler thread until `shared.stop` is set.
pub(crate) fn run(shared: &Arc<Shared>) {
    let mut events = EventBuffer::new(EVENTS_PER_READ);
    let mut pending: Vec<PendingFault> = Vec::with_capacity(RETRY_SLOTS);
    let mut fds = [
        libc::pollfd {
            fd: shared.uffd.raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: shared.stop_fd,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let mut handler = Handler {
        shared,
        pending: &mut pending,
    };
    while !shared.stop.load(Ordering::Acquire) {
        let timeout_ms = handler.next_retry_in_ms();
        // SAFETY: `fds` is a live array of two pollfds.
        let ret = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
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
        if fds[0].revents & libc::POLLIN != 0 {
            handler.drain(&mut events);
        }
        handler.run_due_retries();
    }
}

struct Handler<'a> {
    shared: &'a Shared,
    pending: &'a mut Vec<PendingFault>,
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
                        self.missing(PendingFault {
                            page,
                            write,
                            thread_id,
                            first_seen: now,
                            due: now,
                            attempts: 0,
                        });
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
                self.missing(fault);
            } else {
                i += 1;
            }
        }
    }

    /// Resolves (or defers, or schedules a retry for) a MISSING fault.
    fn missing(&mut self, mut fault: PendingFault) {
        fault.attempts += 1;
        match self.resolve_missing(fault.page, fault.write) {
            Ok(installed) => {
                if installed {
                    super::prefetch::after_fault(self.shared, fault.page);
                }
            }
            Err(err) => self.failed(fault, err),
        }
    }

    /// Ok(true) when this call installed the page.
    fn resolve_missing(&self, page: usize, write: bool) -> Result<bool, TransportError> {
        if self.shared.region.is_shared() {
            return super::minor::resolve(self.shared, page, write);
        }
        let shared = self.shared;
        let states = &shared.states;
        let addr = shared.region.page_addr(page);
        loop {
            let s = states.load(page);
            match before_fetch(shared, page, s) {
                BeforeFetch::Done => return Ok(false),
                BeforeFetch::Again => continue,
                BeforeFetch::Fetch => {}
            }
            Counters::add(&shared.counters.pages_fetched, 1);
            let frame = shared.manager.read_frame(shared.region.page_gpa(page))?;
            let Some(locked) = states.try_lock(page) else {
                if states.defer(page, LOCKED) {
                    Counters::add(&shared.counters.deferred_faults, 1);
                    return Ok(false);
                }
                continue;
            };
            if locked & (PRESENT | POISONED | FETCHING) != 0 || generation(locked) != generation(s)
            {
                // Installed, or dropped after a write-back, while we fetched:
                // our copy may be stale. Look again.
                shared.release(page, 0, LOCKED, false);
                continue;
            }
            // Dirty before writable: flush skips pages not marked dirty
            // without taking their lock, so the mark must come before any
            // write can land.
            if write {
                states.set_bits(page, DIRTY);
            }
            // Counted before the copy wakes the faulting thread (and taken
            // back if it fails), so a reader of the stats never misses it.
            Counters::add(&shared.counters.missing_faults, 1);
            let mut again = 0;
            let (set, woken) = loop {
                // SAFETY: the frame is a live 4 KiB pool frame; `addr` is a
                // page of the registered region.
                match unsafe { shared.uffd.copy_page(frame.as_ptr(), addr, !write) } {
                    Ok(CopyOutcome::Copied) => break (PRESENT, true),
                    // Present without our knowledge: treat it as dirty so a
                    // flush write-protects and writes it.
                    Ok(CopyOutcome::Exists) => break (PRESENT | DIRTY, false),
                    Ok(CopyOutcome::Again) if again < COPY_AGAIN_LIMIT => {
                        again += 1;
                        std::hint::spin_loop();
                    }
                    Ok(CopyOutcome::Again) => {
                        tracing::warn!(page, "UFFDIO_COPY kept answering EAGAIN; will refault");
                        break (0, false);
                    }
                    Err(err) => {
                        tracing::warn!(%err, page, "UFFDIO_COPY failed");
                        break (0, false);
                    }
                }
            };
            if set & PRESENT == 0 {
                Counters::sub(&shared.counters.missing_faults, 1);
            }
            let clear = if set & PRESENT == 0 {
                LOCKED | DIRTY
            } else {
                LOCKED
            };
            shared.release(page, set, clear, false);
            if !woken {
                shared.wake(page);
            }
            return Ok(set & PRESENT != 0);
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
            // Dirty before writable (see `resolve_missing`).
            states.set_bits(page, DIRTY);
            let woken = match shared
                .uffd
                .unprotect(shared.region.page_addr(page), crate::PAGE_SIZE)
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
    if s & (PRESENT | POISONED) != 0 {
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
    let pid = std::process::id() as libc::pid_t;
    // SAFETY: tgkill has no memory effects; the thread id came with the
    // fault of a thread of this process parked in that fault until woken.
    let ret = unsafe { libc::syscall(libc::SYS_tgkill, pid, thread_id, libc::SIGBUS) };
    if ret != 0 {
        tracing::error!(err = %std::io::Error::last_os_error(), thread_id, "tgkill(SIGBUS) failed");
    }
    shared.wake(page);
}
