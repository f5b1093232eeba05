//! Reading answers off a connection and completing the requests they name.
//!
//! Whoever holds a connection's receive buffer does this: a caller waiting
//! for its own answers (no hand-off at all on the way back), or the
//! connection's poller thread when no caller is waiting.
//!
//! An answer is read into the receive buffer, checked, and its page copied
//! to the caller's. When one direct READ (an asynchronous one: its page is
//! unspecified if it fails) is alone in flight, its answer is instead read
//! straight into its page with one `readv` and checked there; bytes that
//! turn out to be something else go back to the receive buffer.

use std::io::{self, IoSliceMut, Read};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::MutexGuard;

use super::connection::TcpConnection;
use super::inflight::{Claim, Landing, Waiter, CODE_CHECKSUM, CODE_CONN_LOST, CODE_PROTOCOL};
use crate::page::PAGE_SIZE;
use crate::wire::{page_checksum, Header, Opcode, Status, HEADER_LEN, MAX_PAYLOAD_BYTES};

const RECV_BUF_BYTES: usize = 256 * 1024;
const MAX_MESSAGE_BYTES: usize = HEADER_LEN + MAX_PAYLOAD_BYTES as usize;

/// A connection's receive buffer: bytes read but not yet parsed.
#[derive(Debug)]
pub(crate) struct RecvBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl RecvBuf {
    pub(crate) fn new() -> Self {
        Self {
            buf: vec![0u8; RECV_BUF_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }
}

impl TcpConnection {
    /// A READ answer failed its page checksum (its request fails with
    /// `CODE_CHECKSUM`): warned about at most once per interval, with how
    /// many more there were since the last warning.
    fn checksum_failed(&self, header: &Header) {
        if let Some(not_logged) = self.checksum_log.event() {
            tracing::warn!(
                node = %self.node_id,
                request_id = header.request_id,
                offset = header.offset,
                not_logged,
                "READ answer fails its page checksum"
            );
        }
    }

    /// Reads what the socket has and completes every whole answer.
    /// `Ok(true)` when anything was read. On `Err(code)` the connection is
    /// finished and has been marked broken.
    pub(crate) fn progress(&self, rb: &mut RecvBuf) -> Result<bool, u32> {
        let result = self.read_and_complete(rb);
        if let Err(code) = result {
            self.mark_broken(code);
        }
        result
    }

    fn read_and_complete(&self, rb: &mut RecvBuf) -> Result<bool, u32> {
        let mut any = false;
        loop {
            let room = rb.buf.len() - rb.end;
            // With nothing buffered, the next bytes start an answer: if one
            // direct READ alone is in flight, they are read straight into
            // its page.
            let landing = if rb.end == 0 {
                self.inflight.land()
            } else {
                None
            };
            let read = match &landing {
                Some(landing) => self.read_landing(rb, landing),
                None => self.stream().read(&mut rb.buf[rb.end..]),
            };
            match read {
                Ok(0) => {
                    tracing::debug!(node = %self.node_id, "page-server closed the connection");
                    if let Some(landing) = landing {
                        self.inflight.landed(landing, CODE_CONN_LOST);
                    }
                    return Err(CODE_CONN_LOST);
                }
                Ok(n) => {
                    any = true;
                    match landing {
                        Some(landing) => self.settle_landing(rb, landing, n),
                        None => rb.end += n,
                    }
                    self.parse(rb)?;
                    if n < room {
                        // The socket had less than the room left: it is
                        // drained, and another read would only say
                        // WouldBlock (a system call per answer saved). A
                        // reader comes back anyway while it waits.
                        return Ok(true);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if let Some(landing) = landing {
                        self.unland(landing);
                    }
                    return Ok(any);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    if let Some(landing) = landing {
                        self.unland(landing);
                    }
                }
                Err(e) => {
                    tracing::debug!(node = %self.node_id, err = %e, "connection read failed");
                    if let Some(landing) = landing {
                        self.inflight.landed(landing, CODE_CONN_LOST);
                    }
                    return Err(CODE_CONN_LOST);
                }
            }
        }
    }

    /// One `readv` into an empty receive buffer with `landing`'s page in
    /// the place its payload would take: header bytes to the buffer's
    /// start, the next `PAGE_SIZE` bytes to the page, the rest to the
    /// buffer after the gap the page leaves.
    fn read_landing(&self, rb: &mut RecvBuf, landing: &Landing) -> io::Result<usize> {
        let (header, rest) = rb.buf.split_at_mut(HEADER_LEN);
        // SAFETY: the slot is LANDING, so its caller is blocked (or its
        // asynchronous submission in flight) with `dst` lent to us alone:
        // `PAGE_SIZE` live, writable bytes no one else touches until we
        // call `landed` or `unland`. It does not overlap the receive buffer.
        let page = unsafe { std::slice::from_raw_parts_mut(landing.dst, PAGE_SIZE) };
        let mut iov = [
            IoSliceMut::new(header),
            IoSliceMut::new(page),
            IoSliceMut::new(&mut rest[PAGE_SIZE..]),
        ];
        self.stream().read_vectored(&mut iov)
    }

    /// After `read_landing` read `n` bytes: if they hold the landing
    /// request's whole, successful answer, its page is checked where it
    /// landed and the request completed; else the bytes that went to the
    /// page move into the gap in the receive buffer (the stream is whole
    /// again there) and the request goes back to waiting.
    fn settle_landing(&self, rb: &mut RecvBuf, landing: Landing, n: usize) {
        rb.end = n;
        // SAFETY: as in `read_landing`; the slot stays LANDING until
        // `landed` or `unland` below, after the last use of `page`.
        let page = unsafe { std::slice::from_raw_parts(landing.dst, PAGE_SIZE) };
        let answer_end = HEADER_LEN + PAGE_SIZE;
        if n >= answer_end {
            if let Ok(Some(header)) = Header::decode_prefix(&rb.buf[..HEADER_LEN]) {
                if is_answer_to(&header, &landing) {
                    let code = if self.ack.checksums && page_checksum(page) != header.checksum {
                        // As in `complete`, but the page is already in
                        // place: the caller takes it as unspecified, since
                        // the request failed.
                        self.checksum_failed(&header);
                        CODE_CHECKSUM
                    } else {
                        self.landed_pages.fetch_add(1, Ordering::Relaxed);
                        0
                    };
                    self.inflight.landed(landing, code);
                    rb.start = answer_end;
                    return;
                }
            }
        }
        let in_page = n.saturating_sub(HEADER_LEN).min(PAGE_SIZE);
        // The gap `HEADER_LEN..HEADER_LEN + PAGE_SIZE` the page left.
        rb.buf[HEADER_LEN..HEADER_LEN + in_page].copy_from_slice(&page[..in_page]);
        self.unland(landing);
    }

    /// Puts a landing request back to waiting. A connection that broke
    /// meanwhile skipped it when it failed its requests: fail it now.
    fn unland(&self, landing: Landing) {
        self.inflight.unland(landing);
        if self.is_broken() {
            self.inflight.fail_all(CODE_CONN_LOST);
        }
    }

    fn parse(&self, rb: &mut RecvBuf) -> Result<(), u32> {
        loop {
            let avail = &rb.buf[rb.start..rb.end];
            let header = match Header::decode_prefix(avail) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(node = %self.node_id, err = %e, "malformed answer; dropping connection");
                    return Err(CODE_PROTOCOL);
                }
            };
            let total = HEADER_LEN + header.payload_len();
            if avail.len() < total {
                break;
            }
            self.complete(&header, &avail[HEADER_LEN..total])?;
            rb.start += total;
        }
        if rb.start == rb.end {
            rb.start = 0;
            rb.end = 0;
        } else if rb.buf.len() - rb.end < MAX_MESSAGE_BYTES {
            rb.buf.copy_within(rb.start..rb.end, 0);
            rb.end -= rb.start;
            rb.start = 0;
        }
        Ok(())
    }

    fn complete(&self, header: &Header, payload: &[u8]) -> Result<(), u32> {
        let expected = match header.opcode {
            Opcode::ReadResp | Opcode::WriteResp | Opcode::Error => header.opcode,
            other => {
                tracing::warn!(node = %self.node_id, opcode = ?other, "unexpected opcode from page-server");
                return Err(CODE_PROTOCOL);
            }
        };
        let (slot, dst, offset) = match self.inflight.claim(header.request_id) {
            Claim::Live { slot, dst, offset } => (slot, dst, offset),
            Claim::Stale => return Ok(()),
        };
        // A successful answer must be the answer to this request: its
        // opcode (READ has a destination, WRITE none), offset and length.
        let echoes = header.offset == offset && header.length as usize == PAGE_SIZE;
        if header.status == Status::Ok && !echoes {
            tracing::warn!(node = %self.node_id, request_id = header.request_id, offset = header.offset, expected_offset = offset, length = header.length, "answer does not match its request; dropping connection");
        }
        let code = match (expected, header.status) {
            (_, Status::Ok) if !echoes => CODE_PROTOCOL,
            (Opcode::ReadResp, Status::Ok)
                if payload.len() == PAGE_SIZE
                    && !dst.is_null()
                    && self.ack.checksums
                    && page_checksum(payload) != header.checksum =>
            {
                // The bytes in the receive buffer are checked before any of
                // them reach the caller's page: a page that fails is never
                // handed out. The framing is intact, so the connection stays.
                self.checksum_failed(header);
                CODE_CHECKSUM
            }
            (Opcode::ReadResp, Status::Ok) if payload.len() == PAGE_SIZE && !dst.is_null() => {
                // SAFETY: the slot is claimed, so its caller is blocked until
                // we complete it and `dst` points at its live, exclusive
                // 4 KiB buffer; `payload` is exactly PAGE_SIZE bytes.
                unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), dst, PAGE_SIZE) };
                0
            }
            (Opcode::WriteResp, Status::Ok) if dst.is_null() => 0,
            (_, Status::Ok) => CODE_PROTOCOL,
            (_, status) => u32::from(status as u16),
        };
        self.inflight.complete(slot, code);
        if code == CODE_PROTOCOL {
            return Err(CODE_PROTOCOL);
        }
        Ok(())
    }
}

/// Whether `header` is the successful answer, page included, of the READ
/// in `landing` (any other message goes through `complete`).
fn is_answer_to(header: &Header, landing: &Landing) -> bool {
    header.request_id == landing.id
        && header.opcode == Opcode::ReadResp
        && header.status == Status::Ok
        && header.payload_len() == PAGE_SIZE
        && header.offset == landing.offset
        && header.length as usize == PAGE_SIZE
}

/// Connections one caller blocks on by itself at most; a call spread over
/// more parks and leaves them to the pollers.
const MAX_BLOCKING_CONNS: usize = 8;

/// Waits until `waiter` has no request outstanding or `deadline` passes
/// (false then).
///
/// 1. For up to `spin` the caller reads the answers off `conns` itself,
///    yielding the CPU between tries (on a small host whoever answers may be
///    queued behind it on this CPU).
/// 2. Then it blocks in `poll(2)` on the sockets and reads its own answers
///    when they come: one wake-up (its own), no hand-off. It does so only
///    when it can hold the receive buffer of every connection it waits on;
///    meanwhile the connections' pollers leave those sockets alone.
/// 3. Otherwise (another caller is reading one of them, or the call spans
///    too many connections) it parks, and the connections' pollers (or that
///    other reader) complete its requests and wake it.
pub(crate) fn wait(
    waiter: &Waiter,
    conns: &[Option<Arc<TcpConnection>>],
    spin: Duration,
    deadline: Instant,
) -> bool {
    if !spin.is_zero() && spin_reading(waiter, conns, spin, deadline) {
        return true;
    }
    if waiter.is_done() {
        return true;
    }
    if let Some(answered) = block_reading(waiter, conns, deadline) {
        return answered;
    }
    let conns = || conns.iter().flatten();
    for c in conns() {
        c.parking.enter();
    }
    let answered = waiter.wait(Duration::ZERO, deadline);
    for c in conns() {
        c.parking.leave();
    }
    answered
}

/// Step 1 of [`wait`]: true when every answer came within `spin`.
fn spin_reading(
    waiter: &Waiter,
    conns: &[Option<Arc<TcpConnection>>],
    spin: Duration,
    deadline: Instant,
) -> bool {
    let spin_until = Instant::now() + spin;
    let mut spins = 0u32;
    loop {
        for c in conns.iter().flatten() {
            if let Some(mut rb) = c.recv.try_lock() {
                let _ = c.progress(&mut rb);
            }
        }
        if waiter.is_done() {
            return true;
        }
        spins = spins.wrapping_add(1);
        if spins % 16 == 0 {
            let now = Instant::now();
            if now >= spin_until || now >= deadline {
                return false;
            }
        }
        // On a small host whoever answers may be queued behind us on this
        // very CPU: let it run. (Yielding less often, every 4th or 16th
        // try, or not at all for the first 20 us, made p50 no better and
        // up to 2x worse on the 2-CPU bench host: docs/benchmarking.md.)
        std::thread::yield_now();
    }
}

/// Step 2 of [`wait`]: `None` when the caller cannot hold every
/// connection's receive buffer (it must park instead), else whether every
/// answer came before `deadline`.
fn block_reading(
    waiter: &Waiter,
    conns: &[Option<Arc<TcpConnection>>],
    deadline: Instant,
) -> Option<bool> {
    // Dropped last: the receive buffers are released before the pollers
    // are told to look at the sockets again.
    let mut readers = BlockingReaders::default();
    let mut held: [Option<MutexGuard<'_, RecvBuf>>; MAX_BLOCKING_CONNS] = Default::default();
    let mut pollfds = [libc::pollfd {
        fd: -1,
        events: libc::POLLIN,
        revents: 0,
    }; MAX_BLOCKING_CONNS];
    let mut n = 0;
    for c in conns.iter().flatten() {
        if n == MAX_BLOCKING_CONNS {
            return None;
        }
        held[n] = Some(c.recv.try_lock()?);
        pollfds[n].fd = c.stream().as_raw_fd();
        n += 1;
    }
    readers.announce(conns);
    loop {
        for (c, rb) in conns.iter().flatten().zip(&mut held) {
            if let Some(rb) = rb {
                // An error fails the connection's requests (ours too): the
                // waiter's count still reaches zero.
                let _ = c.progress(rb);
            }
        }
        if waiter.is_done() {
            return Some(true);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Some(false);
        }
        let timeout = crate::sys::timespec(left);
        // SAFETY: `pollfds[..n]` are live, initialised pollfds; `timeout` is
        // a valid timespec and a null signal mask is allowed.
        let ret = unsafe {
            libc::ppoll(
                pollfds.as_mut_ptr(),
                n as libc::nfds_t,
                &timeout,
                std::ptr::null(),
            )
        };
        if ret < 0 {
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                tracing::debug!(%err, "poll on page-server sockets failed; parking instead");
                return None;
            }
        }
    }
}

/// The connections a caller blocks on by itself: their pollers leave the
/// sockets alone meanwhile, and are told to look again when it is done (in
/// case other callers parked on them).
#[derive(Default)]
struct BlockingReaders<'a> {
    conns: Option<&'a [Option<Arc<TcpConnection>>]>,
}

impl<'a> BlockingReaders<'a> {
    fn announce(&mut self, conns: &'a [Option<Arc<TcpConnection>>]) {
        for c in conns.iter().flatten() {
            c.blocking_reader.store(true, Ordering::SeqCst);
        }
        self.conns = Some(conns);
    }
}

impl Drop for BlockingReaders<'_> {
    fn drop(&mut self) {
        for c in self.conns.into_iter().flatten().flatten() {
            c.blocking_reader.store(false, Ordering::SeqCst);
            c.parking.wake_if_parked();
        }
    }
}

#[cfg(test)]
mod tests;
