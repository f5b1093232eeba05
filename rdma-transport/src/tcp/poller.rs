//! Poller threads: read answers from page-server connections and complete
//! the requests they name. Each connection belongs to one poller. A poller
//! is pinned to a CPU and either busy-polls while traffic flows (dropping to
//! a blocking `poll(2)` after an idle spell) or always blocks (event mode).

use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use super::connection::TcpConnection;
use super::inflight::{Claim, CODE_CONN_LOST, CODE_PROTOCOL};
use crate::config::PollMode;
use crate::page::PAGE_SIZE;
use crate::sys::cvt;
use crate::wire::{Header, Opcode, Status, HEADER_LEN, MAX_PAYLOAD_BYTES};

const RECV_BUF_BYTES: usize = 256 * 1024;
const MAX_MESSAGE_BYTES: usize = HEADER_LEN + MAX_PAYLOAD_BYTES as usize;
const IDLE_BLOCK_TIMEOUT_MS: i32 = 1000;

#[derive(Debug)]
struct Shared {
    incoming: ArrayQueue<Arc<TcpConnection>>,
    wake: OwnedFd,
    stop: AtomicBool,
}

impl Shared {
    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
        let ret = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        if ret < 0 {
            tracing::debug!(err = %io::Error::last_os_error(), "poller wake-up write failed");
        }
    }

    fn drain_wake(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live 8-byte buffer; the fd is non-blocking.
        let _ = unsafe { libc::read(self.wake.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }
}

/// The set of poller threads of one manager.
#[derive(Debug)]
pub(crate) struct Pollers {
    threads: Vec<(Arc<Shared>, Option<JoinHandle<()>>)>,
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
            let shared = Arc::new(Shared {
                incoming: ArrayQueue::new(1024),
                wake,
                stop: AtomicBool::new(false),
            });
            let cpu = (!cpus.is_empty()).then(|| cpus[i % cpus.len()]);
            let thread_shared = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("page-poller-{i}"))
                .spawn(move || run(&thread_shared, cpu, mode, idle_spin))?;
            threads.push((shared, Some(handle)));
        }
        Ok(Self {
            threads,
            next: AtomicUsize::new(0),
        })
    }

    /// Hands a connection to the next poller (round robin).
    pub(crate) fn add(&self, conn: Arc<TcpConnection>) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.threads.len();
        let shared = &self.threads[i].0;
        if let Err(conn) = shared.incoming.push(conn) {
            tracing::warn!(node = %conn.node_id, "poller queue full; connection dropped");
            conn.mark_broken(CODE_CONN_LOST);
            return;
        }
        shared.wake();
    }
}

impl Drop for Pollers {
    fn drop(&mut self) {
        for (shared, _) in &self.threads {
            shared.stop.store(true, Ordering::SeqCst);
            shared.wake();
        }
        for (_, handle) in &mut self.threads {
            if let Some(h) = handle.take() {
                if h.join().is_err() {
                    tracing::error!("a poller thread panicked");
                }
            }
        }
    }
}

struct Conn {
    conn: Arc<TcpConnection>,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

fn run(shared: &Shared, cpu: Option<usize>, mode: PollMode, idle_spin: Duration) {
    if let Some(id) = cpu {
        if !core_affinity::set_for_current(core_affinity::CoreId { id }) {
            tracing::warn!(cpu = id, "could not pin poller thread");
        }
    }
    let mut conns: Vec<Conn> = Vec::new();
    let mut pollfds: Vec<libc::pollfd> = Vec::new();
    let mut last_activity = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        while let Some(conn) = shared.incoming.pop() {
            conns.push(Conn {
                conn,
                buf: vec![0u8; RECV_BUF_BYTES].into_boxed_slice(),
                start: 0,
                end: 0,
            });
        }
        conns.retain(|c| {
            let keep = !c.conn.is_broken();
            if !keep {
                c.conn.mark_broken(CODE_CONN_LOST);
            }
            keep
        });
        pollfds.clear();
        pollfds.push(libc::pollfd {
            fd: shared.wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        pollfds.extend(conns.iter().map(|c| libc::pollfd {
            fd: c.conn.stream().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        let spinning = mode == PollMode::Busy && last_activity.elapsed() < idle_spin;
        let timeout_ms = if spinning { 0 } else { IDLE_BLOCK_TIMEOUT_MS };
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
                tracing::error!(err = %io::Error::last_os_error(), "poll failed in poller");
            }
            if spinning {
                std::hint::spin_loop();
            }
            continue;
        }
        if pollfds[0].revents != 0 {
            shared.drain_wake();
        }
        for (c, pfd) in conns.iter_mut().zip(&pollfds[1..]) {
            if pfd.revents == 0 {
                continue;
            }
            last_activity = Instant::now();
            if let Err(code) = on_readable(c) {
                c.conn.mark_broken(code);
            }
        }
    }
    for c in &conns {
        c.conn.mark_broken(CODE_CONN_LOST);
    }
}

/// Reads what is there and completes every whole answer. `Err(code)` means
/// the connection is finished.
fn on_readable(c: &mut Conn) -> Result<(), u32> {
    loop {
        match c.conn.stream().read(&mut c.buf[c.end..]) {
            Ok(0) => {
                tracing::debug!(node = %c.conn.node_id, "page-server closed the connection");
                return Err(CODE_CONN_LOST);
            }
            Ok(n) => {
                c.end += n;
                parse(c)?;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::debug!(node = %c.conn.node_id, err = %e, "connection read failed");
                return Err(CODE_CONN_LOST);
            }
        }
    }
}

fn parse(c: &mut Conn) -> Result<(), u32> {
    loop {
        let avail = &c.buf[c.start..c.end];
        let header = match Header::decode_prefix(avail) {
            Ok(Some(h)) => h,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(node = %c.conn.node_id, err = %e, "malformed answer; dropping connection");
                return Err(CODE_PROTOCOL);
            }
        };
        let total = HEADER_LEN + header.payload_len();
        if avail.len() < total {
            break;
        }
        complete(&c.conn, &header, &avail[HEADER_LEN..total])?;
        c.start += total;
    }
    if c.start == c.end {
        c.start = 0;
        c.end = 0;
    } else if c.buf.len() - c.end < MAX_MESSAGE_BYTES {
        c.buf.copy_within(c.start..c.end, 0);
        c.end -= c.start;
        c.start = 0;
    }
    Ok(())
}

fn complete(conn: &TcpConnection, header: &Header, payload: &[u8]) -> Result<(), u32> {
    let expected = match header.opcode {
        Opcode::ReadResp | Opcode::WriteResp | Opcode::Error => header.opcode,
        other => {
            tracing::warn!(node = %conn.node_id, opcode = ?other, "unexpected opcode from page-server");
            return Err(CODE_PROTOCOL);
        }
    };
    let (slot, dst) = match conn.inflight.claim(header.request_id) {
        Claim::Live { slot, dst } => (slot, dst),
        Claim::Stale => return Ok(()),
    };
    let code = match (expected, header.status) {
        (Opcode::ReadResp, Status::Ok) if payload.len() == PAGE_SIZE && !dst.is_null() => {
            // SAFETY: the slot is claimed, so its caller is blocked until we
            // complete it and `dst` points at its live, exclusive 4 KiB buffer.
            unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), dst, PAGE_SIZE) };
            0
        }
        (Opcode::WriteResp, Status::Ok) if dst.is_null() => 0,
        (_, Status::Ok) => CODE_PROTOCOL,
        (_, status) => u32::from(status as u16),
    };
    conn.inflight.complete(slot, code);
    if code == CODE_PROTOCOL {
        return Err(CODE_PROTOCOL);
    }
    Ok(())
}
