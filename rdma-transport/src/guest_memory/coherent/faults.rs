//! The fault threads of a coherent region: each takes one fault at a time
//! from the userfaultfd, gets the page's copy or ownership from its home
//! (`CoherentNode::acquire`, whose grant installs the page and wakes the
//! thread), and turns a fault that cannot be served into the embedder's
//! callback or SIGBUS.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::coherent::{Access, CoherentNode};
use crate::page::PAGE_SIZE;
use crate::uffd::{Event, EventBuffer, FaultKind, Pagefault};

use super::super::config::{FaultAction, FaultErrorHandler, FaultReport, SigbusMethod};
use super::copies::{bump, Copies};

pub(super) struct Faults {
    pub(super) copies: Arc<Copies>,
    pub(super) node: Arc<CoherentNode>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) stop_fd: libc::c_int,
    pub(super) sigbus: SigbusMethod,
    pub(super) on_fault_error: Option<FaultErrorHandler>,
    /// Wait between two attempts at a fault the embedder asked to retry.
    pub(super) retry_interval: Duration,
}

impl Faults {
    /// Serves faults until the region stops.
    pub(super) fn run(&self) {
        // One message per read: a thread that waits for a home holds no
        // other fault back.
        let mut events = EventBuffer::new(1);
        let mut fds = [self.copies.uffd.raw_fd(), self.stop_fd].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        while !self.stop.load(Ordering::Acquire) {
            // SAFETY: `fds` is a live array of two pollfds.
            let ret = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
            if ret < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!(%err, "poll on userfaultfd failed; coherent handler stops");
                    return;
                }
                continue;
            }
            if self.stop.load(Ordering::Acquire) || fds[0].revents & libc::POLLIN == 0 {
                continue;
            }
            match self.copies.uffd.read_events(&mut events) {
                Ok(_) => {}
                // Another thread took the message.
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(err) => {
                    tracing::error!(%err, "reading userfaultfd failed; coherent handler stops");
                    return;
                }
            }
            for event in events.events() {
                if let Event::Pagefault(fault) = event {
                    self.serve(fault);
                }
            }
        }
    }

    fn serve(&self, fault: Pagefault) {
        let copies = &self.copies;
        let Some(page) = copies.region.page_of_addr(fault.addr) else {
            tracing::warn!(addr = fault.addr, "a fault outside the coherent region");
            return;
        };
        let write = fault.write || fault.kind == FaultKind::WriteProtect;
        match (fault.kind, write) {
            (FaultKind::WriteProtect, _) => bump(&copies.counters.upgrade_faults),
            (_, true) => bump(&copies.counters.write_faults),
            (_, false) => bump(&copies.counters.read_faults),
        }
        let access = if write { Access::Write } else { Access::Read };
        let gpa = copies.region.page_gpa(page);
        let addr = copies.region.page_addr(page);
        let first_seen = Instant::now();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let err = match self.node.acquire(gpa, access) {
                // The grant's install woke the thread; a hit (the copy
                // allowed the access already) did not: wake it either way.
                Ok(()) => {
                    copies.uffd.wake(addr, PAGE_SIZE);
                    return;
                }
                Err(err) => err,
            };
            bump(&copies.counters.fault_errors);
            let report = FaultReport {
                gpa,
                host_addr: addr as usize,
                thread_id: fault.thread_id,
                write,
                attempts,
                waited_ms: first_seen.elapsed().as_millis() as u64,
                error: err,
            };
            if self.stop.load(Ordering::Acquire) || self.action(&report) == FaultAction::Sigbus {
                tracing::warn!(gpa, thread = fault.thread_id, error = %report.error, "coherent fault cannot be served; raising SIGBUS");
                self.raise_sigbus(addr, fault.thread_id);
                return;
            }
            tracing::debug!(gpa, error = %report.error, "coherent fault failed; embedder asked to retry");
            if self.wait_stop(self.retry_interval) {
                self.raise_sigbus(addr, fault.thread_id);
                return;
            }
        }
    }

    /// The embedder's choice for a failed fault (SIGBUS without a callback).
    fn action(&self, report: &FaultReport) -> FaultAction {
        let Some(callback) = &self.on_fault_error else {
            return FaultAction::Sigbus;
        };
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback(report))).unwrap_or_else(
            |_| {
                tracing::error!("fault-error callback panicked; raising SIGBUS");
                FaultAction::Sigbus
            },
        )
    }

    /// Waits `interval` or until the region stops; true when it stopped.
    fn wait_stop(&self, interval: Duration) -> bool {
        let mut fd = libc::pollfd {
            fd: self.stop_fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut fd, 1, interval.as_millis() as libc::c_int) };
        self.stop.load(Ordering::Acquire)
    }

    /// Makes the thread faulting at `addr` take SIGBUS: a poison marker
    /// (every access of the page raises it until the page is granted
    /// again), or `tgkill`.
    fn raise_sigbus(&self, addr: *mut u8, thread_id: libc::pid_t) {
        bump(&self.copies.counters.sigbus_raised);
        if self.sigbus == SigbusMethod::Poison {
            match self.copies.uffd.poison_page(addr) {
                Ok(()) => return,
                Err(err) => {
                    tracing::warn!(%err, "UFFDIO_POISON failed; sending SIGBUS with tgkill")
                }
            }
        }
        super::super::send_sigbus(thread_id);
        self.copies.uffd.wake(addr, PAGE_SIZE);
    }
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults").finish_non_exhaustive()
    }
}
