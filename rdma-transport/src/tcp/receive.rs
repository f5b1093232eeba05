//! Reading answers off a connection and completing the requests they name.
//!
//! Whoever holds a connection's receive buffer does this: a caller waiting
//! for its own answers (no hand-off at all on the way back), or the
//! connection's poller thread when no caller is waiting.
//!
//! An answer is read into the receive buffer, checked, and its page copied
//! to the caller's. When the next requests on the wire (`wire_order.rs`)
//! are direct READs (asynchronous ones: a page is unspecified if its
//! request fails), their answers are instead read straight into their
//! pages with one `readv` and checked there; bytes that turn out to be
//! something else go back to the receive buffer.

use std::io::{self, Read};
use std::ops::Deref;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::MutexGuard;
use smallvec::SmallVec;

use super::connection::TcpConnection;
use super::inflight::{Claim, Landing, Waiter, CODE_CHECKSUM, CODE_CONN_LOST, CODE_PROTOCOL};
use crate::page::PAGE_SIZE;
use crate::wire::{page_checksum, Header, Opcode, Status, HEADER_LEN, MAX_PAYLOAD_BYTES};

const RECV_BUF_BYTES: usize = 256 * 1024;
const MAX_MESSAGE_BYTES: usize = HEADER_LEN + MAX_PAYLOAD_BYTES as usize;
/// A READ answer with its page.
const ANSWER_BYTES: usize = HEADER_LEN + PAGE_SIZE;
/// Answers read straight into their pages by one `readv` at most.
const MAX_LANDINGS: usize = 32;
// The landing answers' headers and gaps leave room for a whole message
// after them.
const _: () = assert!(MAX_LANDINGS * ANSWER_BYTES + MAX_MESSAGE_BYTES <= RECV_BUF_BYTES);

type Landings = SmallVec<[Landing; MAX_LANDINGS]>;

/// A connection's receive buffer: bytes read but not yet parsed, and where
/// the reader is in the connection's wire order.
#[derive(Debug)]
pub(crate) struct RecvBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The place in `TcpConnection::wire_order` of the request whose
    /// answer is expected next.
    next_answer: u64,
    /// Answers the last read brought (0 after a read that found nothing).
    last_answers: usize,
}

impl RecvBuf {
    pub(crate) fn new() -> Self {
        Self {
            buf: vec![0u8; RECV_BUF_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            next_answer: 0,
            last_answers: 0,
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
        // Made once and drained, never moved: it holds 1 KiB inline, and a
        // reader spinning on an idle socket comes here once per try.
        let mut landings = Landings::new();
        loop {
            let room = rb.buf.len() - rb.end;
            // With nothing buffered, the next bytes start an answer: those
            // of the next direct READs on the wire are read straight into
            // their pages.
            if rb.end == 0 {
                self.land_next(rb, &mut landings);
            }
            let read = if landings.is_empty() {
                self.stream().read(&mut rb.buf[rb.end..])
            } else {
                self.read_landings(rb, &landings)
            };
            match read {
                Ok(0) => {
                    tracing::debug!(node = %self.node_id, "page-server closed the connection");
                    for landing in landings.drain(..) {
                        self.inflight.landed(landing, CODE_CONN_LOST);
                    }
                    return Err(CODE_CONN_LOST);
                }
                Ok(n) => {
                    any = true;
                    let landed = if landings.is_empty() {
                        rb.end += n;
                        0
                    } else {
                        self.settle_landings(rb, &mut landings, n)
                    };
                    let parsed = self.parse(rb)?;
                    rb.last_answers = landed + parsed;
                    if n < room {
                        // The socket had less than the room left: it is
                        // drained, and another read would only say
                        // WouldBlock (a system call per answer saved). A
                        // reader comes back anyway while it waits.
                        return Ok(true);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Nothing came: the next try lands one answer at most
                    // (a reader polling an idle socket takes and gives back
                    // one slot per try, not a batch).
                    rb.last_answers = 0;
                    self.unland_all(&mut landings);
                    return Ok(any);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    self.unland_all(&mut landings);
                }
                Err(e) => {
                    tracing::debug!(node = %self.node_id, err = %e, "connection read failed");
                    for landing in landings.drain(..) {
                        self.inflight.landed(landing, CODE_CONN_LOST);
                    }
                    return Err(CODE_CONN_LOST);
                }
            }
        }
    }

    /// Takes the slots of the direct READs whose answers are next on the
    /// wire, in wire order, as many as the last read brought answers and
    /// one more (up to `MAX_LANDINGS`). Stops at the first request that
    /// is not a direct READ still pending.
    fn land_next(&self, rb: &RecvBuf, landings: &mut Landings) {
        let want = (rb.last_answers + 1).min(MAX_LANDINGS) as u64;
        for pos in rb.next_answer..rb.next_answer + want {
            let Some(landing) = self
                .wire_order
                .at(pos)
                .and_then(|id| self.inflight.land(id))
            else {
                break;
            };
            landings.push(landing);
        }
    }

    /// One `readv` into an empty receive buffer with the landing requests'
    /// pages in the places their payloads would take: answer `i`'s header
    /// to `ANSWER_BYTES * i`, its page to its destination (leaving a gap
    /// in the buffer), and whatever follows the last to the buffer after
    /// the last gap.
    fn read_landings(&self, rb: &mut RecvBuf, landings: &[Landing]) -> io::Result<usize> {
        let base = rb.buf.as_mut_ptr();
        let mut iov = SmallVec::<[libc::iovec; 2 * MAX_LANDINGS + 1]>::new();
        for (i, landing) in landings.iter().enumerate() {
            iov.push(libc::iovec {
                // SAFETY: `i < MAX_LANDINGS`, so the header's place is inside
                // the buffer (checked at compile time below).
                iov_base: unsafe { base.add(i * ANSWER_BYTES) }.cast(),
                iov_len: HEADER_LEN,
            });
            // The page is only ever passed to the kernel as a raw iovec:
            // two requests reading into one page never make two Rust
            // references to it.
            iov.push(libc::iovec {
                iov_base: landing.dst.cast(),
                iov_len: PAGE_SIZE,
            });
        }
        let used = landings.len() * ANSWER_BYTES;
        iov.push(libc::iovec {
            // SAFETY: as above, `used` is inside the buffer.
            iov_base: unsafe { base.add(used) }.cast(),
            iov_len: rb.buf.len() - used,
        });
        // SAFETY: every iovec is live, writable memory lent to this reader
        // alone until it returns: parts of the receive buffer it holds
        // (`&mut`), and the pages of LANDING slots, whose callers are
        // blocked (or whose asynchronous submissions are in flight) with
        // `dst` lent to us until `landed` or `unland`. The buffer's parts
        // do not overlap each other or any page.
        let ret = unsafe {
            libc::readv(
                self.stream().as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
            )
        };
        if ret < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(ret as usize)
        }
    }

    /// After `read_landings` read `n` bytes: each landing request, in
    /// order, whose whole, successful answer came is checked where its
    /// page landed and completed. From the first that is not, the bytes
    /// that went to the pages move into their gaps in the receive buffer
    /// (the stream is whole again there) and those requests go back to
    /// waiting. Returns how many were completed.
    fn settle_landings(&self, rb: &mut RecvBuf, landings: &mut Landings, n: usize) -> usize {
        rb.start = 0;
        rb.end = n;
        let mut landed = 0;
        let mut rest = landings.drain(..);
        while let Some(landing) = rest.next() {
            let at = landed * ANSWER_BYTES;
            let header = match Header::decode_prefix(&rb.buf[at..at + HEADER_LEN]) {
                Ok(Some(h)) if n >= at + ANSWER_BYTES && is_answer_to(&h, &landing) => h,
                _ => {
                    for (i, landing) in std::iter::once(landing).chain(rest.by_ref()).enumerate() {
                        let at = (landed + i) * ANSWER_BYTES;
                        let in_page = n.saturating_sub(at + HEADER_LEN).min(PAGE_SIZE);
                        let gap = &mut rb.buf[at + HEADER_LEN..at + HEADER_LEN + in_page];
                        // SAFETY: as in `read_landings`; the slot stays
                        // LANDING until `unland` below. `gap` is part of the
                        // receive buffer, never of a page.
                        unsafe {
                            std::ptr::copy_nonoverlapping(landing.dst, gap.as_mut_ptr(), in_page);
                        }
                        self.inflight.unland(landing);
                    }
                    if self.is_broken() {
                        // A connection that broke meanwhile skipped them
                        // when it failed its requests: fail them now.
                        self.inflight.fail_all(CODE_CONN_LOST);
                    }
                    break;
                }
            };
            // SAFETY: as in `read_landings`; the slot stays LANDING until
            // `landed` below, after the last use of `page`.
            let page = unsafe { std::slice::from_raw_parts(landing.dst, PAGE_SIZE) };
            let code = if self.ack.checksums && page_checksum(page) != header.checksum {
                // As in `complete`, but the page is already in place: the
                // caller takes it as unspecified, since the request failed.
                self.checksum_failed(&header);
                CODE_CHECKSUM
            } else {
                self.landed_pages.fetch_add(1, Ordering::Relaxed);
                0
            };
            self.inflight.landed(landing, code);
            // The landings were the requests from `next_answer` on.
            rb.next_answer += 1;
            landed += 1;
            rb.start = at + ANSWER_BYTES;
        }
        landed
    }

    /// Puts landing requests back to waiting (nothing was read into their
    /// pages). A connection that broke meanwhile skipped them when it
    /// failed its requests: they fail now.
    pub(super) fn unland_all(&self, landings: &mut Landings) {
        if landings.is_empty() {
            return;
        }
        for landing in landings.drain(..) {
            self.inflight.unland(landing);
        }
        if self.is_broken() {
            self.inflight.fail_all(CODE_CONN_LOST);
        }
    }

    /// Completes every whole answer in the receive buffer; how many.
    fn parse(&self, rb: &mut RecvBuf) -> Result<usize, u32> {
        let mut answers = 0;
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
            self.wire_order
                .answered(&mut rb.next_answer, header.request_id);
            self.complete(&header, &avail[HEADER_LEN..total])?;
            rb.start += total;
            answers += 1;
        }
        if rb.start == rb.end {
            rb.start = 0;
            rb.end = 0;
        } else if rb.buf.len() - rb.end < MAX_MESSAGE_BYTES {
            rb.buf.copy_within(rb.start..rb.end, 0);
            rb.end -= rb.start;
            rb.start = 0;
        }
        Ok(answers)
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
///
/// `conns` are the connections themselves or references to them (a
/// one-page caller passes a reference: no reference count taken).
pub(crate) fn wait<C: Deref<Target = TcpConnection>>(
    waiter: &Waiter,
    conns: &[Option<C>],
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
fn spin_reading<C: Deref<Target = TcpConnection>>(
    waiter: &Waiter,
    conns: &[Option<C>],
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
fn block_reading<C: Deref<Target = TcpConnection>>(
    waiter: &Waiter,
    conns: &[Option<C>],
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
struct BlockingReaders<'a, C: Deref<Target = TcpConnection>> {
    conns: Option<&'a [Option<C>]>,
}

impl<C: Deref<Target = TcpConnection>> Default for BlockingReaders<'_, C> {
    fn default() -> Self {
        Self { conns: None }
    }
}

impl<'a, C: Deref<Target = TcpConnection>> BlockingReaders<'a, C> {
    fn announce(&mut self, conns: &'a [Option<C>]) {
        for c in conns.iter().flatten() {
            c.blocking_reader.store(true, Ordering::SeqCst);
        }
        self.conns = Some(conns);
    }
}

impl<C: Deref<Target = TcpConnection>> Drop for BlockingReaders<'_, C> {
    fn drop(&mut self) {
        for c in self.conns.into_iter().flatten().flatten() {
            c.blocking_reader.store(false, Ordering::SeqCst);
            c.parking.wake_if_parked();
        }
    }
}

#[cfg(test)]
mod tests;
