//! RDMA poller threads. Each connection belongs to one poller, whose
//! completion channel its CQ raises events on. Callers poll their own CQs
//! while they spin (see `connection::wait`); a poller takes over for callers
//! that parked:
//!
//! - busy mode: while a caller is parked on one of its connections, the
//!   poller (pinned to its CPU) spins on their CQs;
//! - event mode (for hosts that cannot spare a core): it arms the CQs, polls
//!   them once (completions that came before the arming), and sleeps on the
//!   channel until the next event. It re-arms before every poll, so no
//!   completion is missed even when SoftRoCE completes inside `post_send`.
//!
//! Whenever no caller needs it, a poller sleeps in `poll(2)` on its wake-up
//! eventfd and the control connections, whose EOF (the page-server is gone)
//! tears the connection down at once.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use super::connection::RdmaConnection;
use super::device::ClientDevice;
use crate::config::PollMode;
use crate::parking::Wake;
use crate::sys::cvt;
use crate::tcp::CODE_CONN_LOST;
use crate::verbs::CompletionChannel;

const BLOCK_TIMEOUT_MS: i32 = 1000;
/// Busy mode: control connections are checked every this often while
/// spinning.
const CONTROL_CHECK_INTERVAL: Duration = Duration::from_millis(2);

/// What callers and the manager share with one poller thread.
#[derive(Debug)]
pub(crate) struct PollerHandle {
    incoming: ArrayQueue<Arc<RdmaConnection>>,
    wake: OwnedFd,
    stop: AtomicBool,
    /// CQs of this poller's connections raise their events here.
    pub(crate) channel: CompletionChannel,
    /// CQ events taken from the channel (tests check the event path ran).
    events: AtomicU64,
}

impl Wake for PollerHandle {
    /// Wakes the poller from `poll(2)`.
    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
        let ret = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        if ret < 0 {
            tracing::debug!(err = %io::Error::last_os_error(), "RDMA poller wake-up failed");
        }
    }
}

impl PollerHandle {
    fn drain_wake(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live 8-byte buffer; the fd is
        // non-blocking.
        let _ = unsafe { libc::read(self.wake.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }
}

/// The RDMA poller threads of one manager.
#[derive(Debug)]
pub(crate) struct RdmaPollers {
    threads: Vec<(Arc<PollerHandle>, Option<JoinHandle<()>>)>,
    next: AtomicUsize,
}

impl RdmaPollers {
    /// Starts `count` pollers, each with a completion channel on `device`;
    /// poller i is pinned to `cpus[i % cpus.len()]` when `cpus` is not empty.
    pub(crate) fn start(
        device: &ClientDevice,
        count: usize,
        cpus: &[usize],
        mode: PollMode,
    ) -> Result<Self, String> {
        let mut threads = Vec::with_capacity(count);
        for i in 0..count.max(1) {
            let channel = device
                .create_channel()
                .map_err(|e| format!("completion channel: {e}"))?;
            // SAFETY: eventfd takes no pointers; the result is checked below.
            let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })
                .map_err(|e| format!("eventfd: {e}"))?;
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            let wake = unsafe { OwnedFd::from_raw_fd(fd) };
            let handle = Arc::new(PollerHandle {
                incoming: ArrayQueue::new(1024),
                wake,
                stop: AtomicBool::new(false),
                channel,
                events: AtomicU64::new(0),
            });
            let cpu = (!cpus.is_empty()).then(|| cpus[i % cpus.len()]);
            let thread_handle = Arc::clone(&handle);
            let join = std::thread::Builder::new()
                .name(format!("rdma-poller-{i}"))
                .spawn(move || run(&thread_handle, cpu, mode))
                .map_err(|e| format!("cannot start an RDMA poller thread: {e}"))?;
            threads.push((handle, Some(join)));
        }
        Ok(Self {
            threads,
            next: AtomicUsize::new(0),
        })
    }

    /// The poller the next connection goes to (round robin): its CQ must be
    /// created on this poller's channel.
    pub(crate) fn pick(&self) -> Arc<PollerHandle> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.threads.len();
        Arc::clone(&self.threads[i].0)
    }

    /// CQ events all pollers have taken so far.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn events(&self) -> u64 {
        self.threads
            .iter()
            .map(|(h, _)| h.events.load(Ordering::Relaxed))
            .sum()
    }

    /// Hands `conn` (whose CQ uses `poller`'s channel) to that poller.
    pub(crate) fn add(poller: &Arc<PollerHandle>, conn: &Arc<RdmaConnection>) {
        conn.parking.set_poller(Arc::clone(poller));
        if poller.incoming.push(Arc::clone(conn)).is_err() {
            tracing::warn!(node = %conn.node_id, "RDMA poller queue full; connection dropped");
            conn.mark_broken(CODE_CONN_LOST);
            return;
        }
        poller.wake();
    }
}

impl Drop for RdmaPollers {
    fn drop(&mut self) {
        for (handle, _) in &self.threads {
            handle.stop.store(true, Ordering::SeqCst);
            handle.wake();
        }
        for (_, join) in &mut self.threads {
            if let Some(j) = join.take() {
                if j.join().is_err() {
                    tracing::error!("an RDMA poller thread panicked");
                }
            }
        }
    }
}

fn run(handle: &PollerHandle, cpu: Option<usize>, mode: PollMode) {
    if let Some(id) = cpu {
        if !core_affinity::set_for_current(core_affinity::CoreId { id }) {
            tracing::warn!(cpu = id, "could not pin RDMA poller thread");
        }
    }
    let mut conns: Vec<Arc<RdmaConnection>> = Vec::new();
    let mut pollfds: Vec<libc::pollfd> = Vec::new();
    let mut last_control_check = Instant::now();
    let mut spins = 0u32;
    while !handle.stop.load(Ordering::Relaxed) {
        while let Some(conn) = handle.incoming.pop() {
            conns.push(conn);
        }
        // Dropping a broken connection here destroys its QP and CQ once the
        // last caller lets go of it.
        conns.retain(|c| !c.is_broken());
        let parked = conns.iter().any(|c| c.parking.any());
        if parked && mode == PollMode::Busy {
            for c in &conns {
                c.progress();
            }
            spins = spins.wrapping_add(1);
            // The clock is a system call on some VMs: read it now and then.
            if spins % 64 == 0 && last_control_check.elapsed() >= CONTROL_CHECK_INTERVAL {
                last_control_check = Instant::now();
                wait_fds(handle, &conns, &mut pollfds, 0);
            }
            // Let SoftRoCE's ksoftirqd (or a caller) run on a small host.
            std::thread::yield_now();
            continue;
        }
        if parked {
            // Event mode: re-arm, then poll, then wait.
            for c in conns.iter().filter(|c| c.parking.any()) {
                c.arm();
                c.progress();
            }
        }
        wait_fds(handle, &conns, &mut pollfds, BLOCK_TIMEOUT_MS);
        last_control_check = Instant::now();
    }
    for c in &conns {
        c.mark_broken(CODE_CONN_LOST);
    }
}

/// Waits up to `timeout_ms` for the wake-up fd, a CQ event, or a control
/// connection, and handles what came.
fn wait_fds(
    handle: &PollerHandle,
    conns: &[Arc<RdmaConnection>],
    pollfds: &mut Vec<libc::pollfd>,
    timeout_ms: i32,
) {
    pollfds.clear();
    for fd in [handle.wake.as_raw_fd(), handle.channel.fd()] {
        pollfds.push(libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
    }
    pollfds.extend(conns.iter().map(|c| libc::pollfd {
        fd: c.control_fd(),
        events: libc::POLLIN,
        revents: 0,
    }));
    // SAFETY: `pollfds` is a live, correctly sized array of pollfd.
    let ret = unsafe {
        libc::poll(
            pollfds.as_mut_ptr(),
            pollfds.len() as libc::nfds_t,
            timeout_ms,
        )
    };
    if ret <= 0 {
        if ret < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            tracing::error!(err = %io::Error::last_os_error(), "poll failed in RDMA poller");
        }
        return;
    }
    if pollfds[0].revents != 0 {
        handle.drain_wake();
    }
    if pollfds[1].revents != 0 {
        drain_events(handle, conns);
    }
    for (c, pfd) in conns.iter().zip(&pollfds[2..]) {
        if pfd.revents != 0 {
            c.check_control();
        }
    }
}

/// Takes (and acknowledges) every pending CQ event and polls the CQs they
/// name. Those CQs are re-armed by the next loop turn before being polled
/// again.
fn drain_events(handle: &PollerHandle, conns: &[Arc<RdmaConnection>]) {
    loop {
        match handle.channel.get_cq_event(None) {
            Ok(Some(_)) => {
                handle.events.fetch_add(1, Ordering::Relaxed);
            }
            Ok(None) => break,
            Err(err) if err.errno() == Some(libc::EAGAIN) => break,
            Err(err) => {
                tracing::error!(%err, "reading the completion channel failed");
                break;
            }
        }
    }
    for c in conns {
        c.progress();
    }
}
