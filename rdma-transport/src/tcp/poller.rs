//! Poller threads: complete the requests of callers that stopped spinning
//! and parked. Each connection belongs to one poller, which watches its
//! socket only while a caller is parked on it (a spinning caller reads its
//! own answers). A poller is pinned to a CPU and either keeps spinning for a
//! while after the last answer (busy mode) or always blocks in `poll(2)`
//! (event mode).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use super::connection::TcpConnection;
use super::inflight::CODE_CONN_LOST;
use crate::config::PollMode;
use crate::parking::Wake;
use crate::sys::cvt;

const IDLE_BLOCK_TIMEOUT_MS: i32 = 1000;

/// What connections and callers share with one poller thread.
#[derive(Debug)]
pub(crate) struct PollerHandle {
    incoming: ArrayQueue<Arc<TcpConnection>>,
    wake: OwnedFd,
    stop: AtomicBool,
}

impl Wake for PollerHandle {
    /// Interrupts the poller's `poll(2)` so it looks at its connections again.
    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
        let ret = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        if ret < 0 {
            tracing::debug!(err = %io::Error::last_os_error(), "poller wake-up write failed");
        }
    }
}

impl PollerHandle {
    fn drain_wake(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live 8-byte buffer; the fd is non-blocking.
        let _ = unsafe { libc::read(self.wake.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }
}

/// The set of poller threads of one manager.
#[derive(Debug)]
pub(crate) struct Pollers {
    threads: Vec<(Arc<PollerHandle>, Option<JoinHandle<()>>)>,
    next: AtomicUsize,
}

impl Pollers {
    /// Starts `count` pollers; poller i is pinned to `cpus[i % cpus.len()]`
    /// when `cpus` is not empty.
    pub(crate) fn start(
        count: usize,
        cpus: &[usize],
        mode: PollMode,
        idle_spin: Duration,
    ) -> io::Result<Self> {
        let mut threads = Vec::with_capacity(count);
        for i in 0..count.max(1) {
            // SAFETY: eventfd takes no pointers; the result is checked below.
            let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            let wake = unsafe { OwnedFd::from_raw_fd(fd) };
            let handle = Arc::new(PollerHandle {
                incoming: ArrayQueue::new(1024),
                wake,
                stop: AtomicBool::new(false),
            });
            let cpu = (!cpus.is_empty()).then(|| cpus[i % cpus.len()]);
            let thread_handle = Arc::clone(&handle);
            let thread = std::thread::Builder::new()
                .name(format!("page-poller-{i}"))
                .spawn(move || run(&thread_handle, cpu, mode, idle_spin))?;
            threads.push((handle, Some(thread)));
        }
        Ok(Self {
            threads,
            next: AtomicUsize::new(0),
        })
    }

    /// Hands a connection to the next poller (round robin).
    pub(crate) fn add(&self, conn: &Arc<TcpConnection>) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.threads.len();
        let handle = &self.threads[i].0;
        conn.parking.set_poller(Arc::clone(handle));
        if handle.incoming.push(Arc::clone(conn)).is_err() {
            tracing::warn!(node = %conn.node_id, "poller queue full; connection dropped");
            conn.mark_broken(CODE_CONN_LOST);
            return;
        }
        handle.wake();
    }
}

impl Drop for Pollers {
    fn drop(&mut self) {
        for (handle, _) in &self.threads {
            handle.stop.store(true, Ordering::SeqCst);
            handle.wake();
        }
        for (handle, thread) in &mut self.threads {
            if let Some(t) = thread.take() {
                if t.join().is_err() {
                    tracing::error!("a poller thread panicked");
                }
            }
            // A connection handed over after its poller last looked (one
            // dialed just before the manager was dropped) is still queued.
            // It and the handle hold each other: without this, neither is
            // ever freed and its socket stays open (found by
            // fuzz/fuzz_targets/client_answers.rs).
            while let Some(conn) = handle.incoming.pop() {
                conn.mark_broken(CODE_CONN_LOST);
            }
        }
    }
}

fn run(handle: &PollerHandle, cpu: Option<usize>, mode: PollMode, idle_spin: Duration) {
    if let Some(id) = cpu {
        if !core_affinity::set_for_current(core_affinity::CoreId { id }) {
            tracing::warn!(cpu = id, "could not pin poller thread");
        }
    }
    let mut conns: Vec<Arc<TcpConnection>> = Vec::new();
    let mut watched: Vec<usize> = Vec::new();
    let mut pollfds: Vec<libc::pollfd> = Vec::new();
    let mut last_activity = Instant::now();
    while !handle.stop.load(Ordering::Relaxed) {
        while let Some(conn) = handle.incoming.pop() {
            conns.push(conn);
        }
        conns.retain(|c| !c.is_broken());
        pollfds.clear();
        watched.clear();
        pollfds.push(libc::pollfd {
            fd: handle.wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for (i, c) in conns.iter().enumerate() {
            // A caller blocked on the socket reads every answer on it.
            if c.parking.any() && !c.blocking_reader.load(Ordering::SeqCst) {
                watched.push(i);
                pollfds.push(libc::pollfd {
                    fd: c.stream().as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
        }
        let spinning =
            mode == PollMode::Busy && !watched.is_empty() && last_activity.elapsed() < idle_spin;
        let timeout_ms = if spinning { 0 } else { IDLE_BLOCK_TIMEOUT_MS };
        // SAFETY: `pollfds` is a live, correctly sized array of pollfd.
        let ret = unsafe {
            libc::poll(
                pollfds.as_mut_ptr(),
                pollfds.len() as libc::nfds_t,
                timeout_ms,
            )
        };
        if ret < 0 {
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                tracing::error!(%err, "poll failed in poller");
            }
            continue;
        }
        if ret == 0 && spinning {
            // Nothing yet: on a small host the page-server or the caller
            // this poller waits for may be queued behind it on this very
            // CPU. Let it run (without this, a busy poller sharing a CPU
            // with a local page-server held each answer back until the
            // scheduler preempted it, ~1 ms: docs/benchmarking.md).
            std::thread::yield_now();
        }
        if pollfds[0].revents != 0 {
            handle.drain_wake();
        }
        for (&i, pfd) in watched.iter().zip(&pollfds[1..]) {
            if pfd.revents == 0 {
                continue;
            }
            last_activity = Instant::now();
            let c = &conns[i];
            // Busy: a caller is reading this socket (a spinning one drains
            // it; a blocked one was woken by the same data).
            if let Some(mut rb) = c.recv.try_lock() {
                let _ = c.progress(&mut rb);
            }
        }
    }
    for c in &conns {
        c.mark_broken(CODE_CONN_LOST);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{ErrorKind, Read};

    use super::*;
    use crate::tcp::wait_tests::bare_connection;

    /// A connection handed to a poller that stopped before taking it (its
    /// manager dropped right after dialing it) is freed with the pollers,
    /// and its socket closed.
    #[test]
    fn a_connection_its_poller_never_took_is_freed_with_the_pollers() {
        let mut pollers = Pollers::start(1, &[], PollMode::Event, Duration::ZERO).unwrap();
        // The thread sees `stop` first, as in `Pollers::drop`.
        let (handle, thread) = &mut pollers.threads[0];
        handle.stop.store(true, Ordering::SeqCst);
        handle.wake();
        thread.take().expect("a thread").join().unwrap();
        let (conn, mut server) = bare_connection(false);
        pollers.add(&conn);
        let weak = Arc::downgrade(&conn);
        drop(conn);
        drop(pollers);
        assert!(
            weak.upgrade().is_none(),
            "the connection outlived its pollers"
        );
        server
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        match server.read(&mut [0u8; 1]) {
            Ok(0) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            other => panic!("the connection's socket is still open: {other:?}"),
        }
    }
}
