//! Serving one client connection: parse pipelined requests, answer each, and
//! send all answers of one read with one `writev`. READ answers point
//! straight into the exported region (no copy in user space).

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_transport::region::MappedRegion;
use rdma_transport::wire::{
    page_checksum, write_checksum, DecodeError, Header, Opcode, Status, HEADER_LEN,
    MAX_PAYLOAD_BYTES,
};
use rdma_transport::PAGE_SIZE;

use crate::coherence_home::{self, CohSession, CoherenceHome};
use crate::conns::RdmaUse;
use crate::handshake::{self, Refusal, ServerAuth, Session};
use crate::limits::ConnGuard;
use crate::metrics::{Damaged, Op, PageMetrics, RequestTally};
use crate::outbound::Outbound;
use crate::page_sums::PageSums;
use crate::rdma::RdmaExport;
use crate::recovery_guard::RecoveryGuard;
use crate::self_fence::SelfFence;
use crate::spin::SpinSetting;
use rdma_transport::log_limit::LogLimit;

const RECV_BUF_BYTES: usize = 256 * 1024;
/// Answers gathered before they are flushed (each takes two iovecs at most).
const MAX_PENDING_ANSWERS: usize = 256;
/// How long a client's new data connection waits for its older ones to
/// end (`Recorded::supersede_older`); shut down, they end as soon as their
/// threads run.
const SUPERSEDE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long requests that came while this process fenced itself wait for
/// the coordinator to confirm it (one heartbeat, which times out after
/// 2 s) before their connection is closed unserved (`self_fence.rs`).
const FENCE_CONFIRM_WAIT: Duration = Duration::from_secs(3);

/// The memory a page-server exports, and the epoch it announces.
///
/// Field order is drop order: the RDMA registration of the region goes
/// before the region is unmapped.
#[derive(Debug)]
pub(crate) struct Exported {
    pub(crate) rdma: Option<RdmaExport>,
    pub(crate) region: MappedRegion,
    pub(crate) epoch: u64,
    pub(crate) auth: ServerAuth,
    /// Agree to page checksums when a client asks.
    pub(crate) page_checksums: bool,
    /// Keeps client writes from being overwritten by a replica recovery's
    /// older copy (every client WRITE goes through it).
    pub(crate) guard: RecoveryGuard,
    /// The pages' checksums between writes (every write of the region, all
    /// through `guard`, drops or sets its page's).
    pub(crate) sums: PageSums,
    /// The coherence directory of the exported pages (`coherence_home.rs`).
    pub(crate) coherence: CoherenceHome,
    /// Pages served, bytes, errors and durations, by operation.
    pub(crate) metrics: PageMetrics,
    /// At most one warning per interval about data damaged on the way.
    pub(crate) damage_log: LogLimit,
    /// After a stall of the process (or its lease fence), nothing is
    /// served until the coordinator confirms it was not replaced
    /// (`self_fence.rs`).
    pub(crate) self_fence: Arc<SelfFence>,
}

impl Exported {
    /// A WRITE or a coherence frame from `peer`, about the page at
    /// `offset`, failed its checksum and was refused: counted, and warned
    /// about (rate-limited): data damaged between two hosts means a faulty
    /// NIC, link or memory that an operator must look at.
    pub(crate) fn damaged_on_the_way(
        &self,
        what: Damaged,
        peer: Option<std::net::IpAddr>,
        offset: u64,
    ) {
        self.metrics.checksum_failed(what);
        if let Some(suppressed) = self.damage_log.event() {
            tracing::warn!(
                ?what,
                ?peer,
                offset,
                suppressed,
                "refused data that failed its checksum: damaged on the way (check NICs, links and memory between the hosts)"
            );
        }
    }

    /// Checks a page request against the region; the region offset on success.
    fn check(&self, header: &Header) -> Result<usize, Status> {
        if header.length as usize != PAGE_SIZE {
            return Err(Status::BadLength);
        }
        self.check_page(header.offset)
    }

    /// Checks that a page at `offset` is inside the region; the region
    /// offset on success.
    pub(crate) fn check_page(&self, offset: u64) -> Result<usize, Status> {
        if offset % PAGE_SIZE as u64 != 0 {
            return Err(Status::Unaligned);
        }
        match usize::try_from(offset) {
            Ok(off)
                if off
                    .checked_add(PAGE_SIZE)
                    .is_some_and(|end| end <= self.region.len_bytes()) =>
            {
                Ok(off)
            }
            _ => Err(Status::OutOfRange),
        }
    }
}

/// One answer waiting to be sent.
enum Payload {
    None,
    /// A page of the exported region (bounds already checked).
    Region(*mut u8),
    /// An encoded handshake message (CHALLENGE, HELLO_ACK).
    Hello(Vec<u8>),
    /// A copy of a page (`Outbox::copies[i]`): the bytes its checksum covers.
    Copy(usize),
}

/// Answers gathered from one read, sent with `writev`.
struct Outbox {
    headers: Vec<[u8; HEADER_LEN]>,
    payloads: Vec<Payload>,
    iovecs: Vec<libc::iovec>,
    /// Page copies for checksummed READ answers, reused; the first
    /// `copies_used` belong to answers not yet sent.
    copies: Vec<Box<[u8]>>,
    copies_used: usize,
}

impl Outbox {
    fn new() -> Self {
        Self {
            headers: Vec::with_capacity(MAX_PENDING_ANSWERS),
            payloads: Vec::with_capacity(MAX_PENDING_ANSWERS),
            iovecs: Vec::with_capacity(2 * MAX_PENDING_ANSWERS),
            copies: Vec::new(),
            copies_used: 0,
        }
    }

    /// Copies the region's page at `off` (bounds already checked) and
    /// returns the copy with its checksum, which `sums` keeps if no write of
    /// the page ran meanwhile. A page without a kept sum is sent from a copy,
    /// not the region: its sum must cover the bytes sent.
    fn copy_page(
        &mut self,
        region: &MappedRegion,
        sums: &PageSums,
        off: usize,
    ) -> Option<(Payload, u32)> {
        if self.copies_used == self.copies.len() {
            self.copies.push(vec![0u8; PAGE_SIZE].into_boxed_slice());
        }
        let index = self.copies_used;
        let copy = &mut self.copies[index];
        let before = sums.before_copy(off);
        region.read_at(off, copy).ok()?;
        let sum = page_checksum(copy);
        sums.cache_if_unchanged(off, before, sum);
        self.copies_used += 1;
        Some((Payload::Copy(index), sum))
    }

    fn push(&mut self, header: Header, payload: Payload) {
        self.headers.push(header.encode());
        self.payloads.push(payload);
    }

    fn has_region_reads(&self) -> bool {
        self.payloads
            .iter()
            .any(|p| matches!(p, Payload::Region(_)))
    }

    fn is_full(&self) -> bool {
        self.headers.len() >= MAX_PENDING_ANSWERS
    }

    /// Sends everything gathered, then empties the outbox. `shared`: other
    /// threads may write to this connection (coherence), take its lock.
    fn flush(&mut self, stream: &TcpStream, shared: Option<&Outbound>) -> io::Result<()> {
        if self.headers.is_empty() {
            return Ok(());
        }
        self.iovecs.clear();
        for (header, payload) in self.headers.iter().zip(&self.payloads) {
            self.iovecs.push(libc::iovec {
                iov_base: header.as_ptr().cast_mut().cast(),
                iov_len: HEADER_LEN,
            });
            match payload {
                Payload::None => {}
                Payload::Region(page) => {
                    self.iovecs.push(libc::iovec {
                        iov_base: page.cast(),
                        iov_len: PAGE_SIZE,
                    });
                    crate::prefetch::first_line(page.cast_const());
                }
                Payload::Hello(bytes) => {
                    self.iovecs.push(libc::iovec {
                        iov_base: bytes.as_ptr().cast_mut().cast(),
                        iov_len: bytes.len(),
                    });
                }
                Payload::Copy(index) => {
                    self.iovecs.push(libc::iovec {
                        iov_base: self.copies[*index].as_ptr().cast_mut().cast(),
                        iov_len: PAGE_SIZE,
                    });
                }
            }
        }
        let result = {
            let _lock = shared.map(Outbound::lock);
            writev_all(stream, &mut self.iovecs)
        };
        self.headers.clear();
        self.payloads.clear();
        self.copies_used = 0;
        result
    }
}

/// Writes every iovec fully, in as few `sendmsg` calls as the kernel
/// allows. Raw iovecs keep Rust references off the exported region, which
/// other connections may be writing at the same time. `MSG_NOSIGNAL` (which
/// `writev` cannot take): a client that is gone is an error, not a
/// `SIGPIPE` that ends a process embedding the server without ignoring it
/// (the fuzz target `page_server_session` runs so, and was ended by one).
pub(crate) fn writev_all(stream: &TcpStream, iovecs: &mut [libc::iovec]) -> io::Result<()> {
    let mut start = 0;
    while start < iovecs.len() {
        // SAFETY: all-zero bytes are a valid `msghdr` (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iovecs[start..].as_mut_ptr();
        msg.msg_iovlen = (iovecs.len() - start).min(1024) as _;
        // SAFETY: every iovec points at live memory: headers and HELLO
        // payloads owned by the outbox, pages inside the exported region, or
        // frames the caller borrows for the call (`Outbound::send`);
        // `sendmsg` only reads them.
        let ret = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if ret < 0 {
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {
                    wait_for(stream, libc::POLLOUT, SEND_STALL_TIMEOUT_MS)?;
                    continue;
                }
                _ => return Err(err),
            }
        }
        let mut written = ret as usize;
        while written > 0 && start < iovecs.len() {
            let iov = &mut iovecs[start];
            if written >= iov.iov_len {
                written -= iov.iov_len;
                start += 1;
            } else {
                // SAFETY: advancing inside the same buffer by less than its length.
                iov.iov_base = unsafe { iov.iov_base.cast::<u8>().add(written) }.cast();
                iov.iov_len -= written;
                written = 0;
            }
        }
        while start < iovecs.len() && iovecs[start].iov_len == 0 {
            start += 1;
        }
    }
    Ok(())
}

/// Serves one connection until the client leaves, breaks the protocol or a
/// limit in `guard`, or the socket is shut down. Returns why it ended.
pub(crate) fn serve(
    stream: &TcpStream,
    exported: &Exported,
    spin: &SpinSetting,
    guard: &mut ConnGuard,
) -> io::Result<()> {
    let mut coh = CohSession::default();
    let mut tally = RequestTally::new();
    let result = serve_messages(stream, exported, spin, guard, &mut coh, &mut tally);
    // Requests whose answers could not be sent were served all the same.
    exported.metrics.publish(&mut tally);
    // No message from this connection can follow: its node (if it took
    // part in coherence) is lost, and its pages go to other nodes, once it
    // has surely dropped its copies.
    crate::node_exit::wait_until_copies_dropped(stream, &exported.coherence, &coh, &result);
    coherence_home::disconnect(exported, &mut coh);
    result
}

fn serve_messages(
    stream: &TcpStream,
    exported: &Exported,
    spin_setting: &SpinSetting,
    guard: &mut ConnGuard,
    coh: &mut CohSession,
    tally: &mut RequestTally,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut buf = vec![0u8; RECV_BUF_BYTES];
    let (mut start, mut end) = (0usize, 0usize);
    let mut session = Session {
        peer: stream.peer_addr().ok().map(|a| a.ip()),
        ..Session::default()
    };
    let mut outbox = Outbox::new();
    let mut spinning = None;
    loop {
        // The setting may change while the connection is served.
        let spin = spin_setting.get();
        if spinning != Some(!spin.is_zero()) {
            set_read_mode(stream, spin, guard, coh)?;
            spinning = Some(!spin.is_zero());
        }
        let n = match read_spinning(stream, &mut buf[end..], spin, guard, coh) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        end += n;
        tally.restart();
        if !exported
            .self_fence
            .may_serve(tally.started(), FENCE_CONFIRM_WAIT)
        {
            // Fenced (after a stall, or its lease fence), and the
            // coordinator did not say in time that this process is still
            // the node's (or it said another one is): what came is not
            // served.
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "not served: fenced, and the coordinator did not confirm this process",
            ));
        }
        let mut close = None;
        let mut requests = 0usize;
        while close.is_none() {
            let header = match Header::decode_prefix(&buf[start..end]) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(err) => {
                    let request_id = u64::from_le_bytes(
                        buf[start + 8..start + 16].try_into().unwrap_or_default(),
                    );
                    let answer = Header::request(Opcode::Error, request_id, 0, 0);
                    let answer = Header {
                        status: err.status(),
                        ..answer
                    };
                    outbox.push(answer, Payload::None);
                    close = Some(err);
                    break;
                }
            };
            let total = HEADER_LEN + header.payload_len();
            if end - start < total {
                break;
            }
            let payload = &buf[start + HEADER_LEN..start + total];
            if (header.opcode == Opcode::Write && outbox.has_region_reads())
                || header.opcode == Opcode::CohToHome
            {
                // READ answers are copied out of the region when sent: send
                // them before a later WRITE changes what they must show. A
                // coherence message's answers go out at once, by the
                // coherence home: answers gathered so far go first.
                send(&mut outbox, tally, stream, exported, coh)?;
                tally.restart();
            }
            if header.opcode == Opcode::CohToHome && session.is_ready() {
                coherence_home::on_frame(exported, &header, payload, stream, coh);
                tally.restart();
                if crate::node_exit::is_closed_by_home(coh) {
                    // A write-back refused: nothing more from it is served.
                    return Err(crate::node_exit::closed_by_home());
                }
                if coh.is_node() && !guard.is_coherence_node() {
                    // A node may hold pages for long without a message;
                    // closing its connection would declare it lost (and
                    // lose the pages it owns).
                    guard.exempt_from_idle_timeout();
                    guard.note_coherence_node();
                    // Its reads now come back to see whether another
                    // thread closed it (`wait_limit`).
                    spinning = None;
                }
            } else if let Err(refusal) =
                handle(&header, payload, exported, &mut session, &mut outbox, tally)
            {
                send(&mut outbox, tally, stream, exported, coh)?;
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    refusal.to_string(),
                ));
            }
            start += total;
            requests += 1;
            guard.count_request();
            if session.is_ready() && !guard.is_handshaken() {
                coh.handshaken(session.bound_sums, session.node_bound);
                if !guard.handshake_done() {
                    // Closed before its HELLO_ACK is sent: see `ConnGuard`.
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionRefused,
                        "connection limit reached",
                    ));
                }
                // A data connection (a coherence node declares a bound):
                // the client's older ones end first, before its HELLO_ACK.
                if let (Some(client_id), None) = (session.client_id, session.node_bound) {
                    match guard.supersede_older(client_id, SUPERSEDE_TIMEOUT) {
                        Ok(0) => {}
                        Ok(ended) => tracing::debug!(
                            client_id,
                            ended,
                            "a client's new connection: its older ones ended first"
                        ),
                        Err(running) => {
                            tracing::warn!(
                                client_id,
                                running,
                                "a client's older connections did not end in time; closing its new one"
                            );
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "the client's older connections still run",
                            ));
                        }
                    }
                }
                let rdma = match (&session.qp, session.rdma_withheld) {
                    (Some(_), _) => RdmaUse::Session,
                    (None, true) => RdmaUse::Withheld,
                    (None, false) => RdmaUse::None,
                };
                if !guard.note_rdma(rdma) {
                    // A replica recovery began since the HELLO_ACK: the QP
                    // must not live on (see `Connections::fence`).
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "RDMA paused for a replica recovery",
                    ));
                }
                if session.qp.is_some() {
                    guard.exempt_from_idle_timeout();
                }
                if let Some(channel) = session.qp.as_ref().and_then(|q| q.channel()).cloned() {
                    // A coherence connection over RDMA: its frames come
                    // through the channel from now on. Its QP cannot write
                    // the region (`RdmaExport::accept_channel`), so a
                    // replica recovery's fence leaves it open, as a TCP
                    // node's: closing it would declare the node lost.
                    guard.note_coherence_node();
                    exported.metrics.publish(tally);
                    outbox.flush(stream, None)?;
                    return crate::coherence_channel::serve(
                        stream,
                        exported,
                        &channel,
                        coh,
                        spin_setting.get(),
                    );
                }
            }
            if outbox.is_full() {
                send(&mut outbox, tally, stream, exported, coh)?;
                tally.restart();
            }
        }
        send(&mut outbox, tally, stream, exported, coh)?;
        if let Some(err) = close {
            guard.protocol_error();
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                protocol_error(err),
            ));
        }
        if requests == 0 || !guard.is_handshaken() {
            // Bytes that completed no request (a trickle), or a client not
            // yet handshaken: its limits hold however data arrives.
            guard.check(Instant::now())?;
        }
        if start == end {
            (start, end) = (0, 0);
        } else if buf.len() - end < HEADER_LEN + MAX_PAYLOAD_BYTES as usize {
            buf.copy_within(start..end, 0);
            end -= start;
            start = 0;
        }
    }
}

/// Sends the answers gathered in `outbox`, after publishing the requests
/// they answer (a client that has its answer finds it in the metrics). A
/// caller that goes on with requests read before restarts `tally`: the
/// send is no part of the next request's duration.
fn send(
    outbox: &mut Outbox,
    tally: &mut RequestTally,
    stream: &TcpStream,
    exported: &Exported,
    coh: &CohSession,
) -> io::Result<()> {
    exported.metrics.publish(tally);
    outbox.flush(stream, coh.outbound().map(|o| &**o))
}

/// Spinning needs a non-blocking socket; without it, plain blocking reads
/// cost one system call each, and the receive timeout brings a read back
/// to check `guard`'s limits.
fn set_read_mode(
    stream: &TcpStream,
    spin: Duration,
    guard: &mut ConnGuard,
    coh: &CohSession,
) -> io::Result<()> {
    stream.set_nonblocking(!spin.is_zero())?;
    if spin.is_zero() {
        stream.set_read_timeout(blocking_read_timeout(wait_limit(
            guard,
            coh,
            Instant::now(),
        )?))?;
    }
    Ok(())
}

/// How long a read may wait for data: `guard`'s limits (`None`: none), or
/// the reason the connection must end. A coherence node's connection,
/// which another thread may close (`Outbound::close_from_home`), is
/// looked at every `node_exit::CLOSED_CHECK_INTERVAL` at least.
fn wait_limit(
    guard: &mut ConnGuard,
    coh: &CohSession,
    now: Instant,
) -> io::Result<Option<Duration>> {
    let left = guard.check(now)?;
    if coh.outbound().is_none() {
        return Ok(left);
    }
    if crate::node_exit::is_closed_by_home(coh) {
        return Err(crate::node_exit::closed_by_home());
    }
    let check = crate::node_exit::CLOSED_CHECK_INTERVAL;
    Ok(Some(left.map_or(check, |l| l.min(check))))
}

/// Reads from the socket: with a `spin` (non-blocking socket), polls
/// (yielding the CPU) for up to `spin`, then blocks in `poll(2)` until it is
/// readable or `guard`'s limit; without one, a plain blocking read (whose
/// receive timeout brings it back to check `guard`). A client
/// streaming requests then never waits for this thread's CPU to wake from
/// idle, and only a wait that ends without data reads the clock.
fn read_spinning(
    mut stream: &TcpStream,
    buf: &mut [u8],
    spin: Duration,
    guard: &mut ConnGuard,
    coh: &CohSession,
) -> io::Result<usize> {
    if spin.is_zero() {
        // The socket is blocking then (see `serve`): one call, unless its
        // receive timeout ends it.
        loop {
            match stream.read(buf) {
                // The receive timeout (`EAGAIN`). Not `ETIMEDOUT`: that is
                // the kernel giving the peer up (`dead_peer`).
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = wait_limit(guard, coh, Instant::now())?;
                    stream.set_read_timeout(blocking_read_timeout(left))?;
                }
                other => return other,
            }
        }
    }
    let start = Instant::now();
    loop {
        match stream.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            other => return other,
        }
        let now = Instant::now();
        if now.duration_since(start) < spin {
            std::thread::yield_now();
            continue;
        }
        let left = wait_limit(guard, coh, now)?;
        wait_readable(stream, left)?;
    }
}

/// Longest receive timeout of a blocking connection socket: the idle time
/// is only checked when a read times out, so a blocking connection is
/// closed within this much after its limit.
const BLOCKING_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The receive timeout that makes a blocking read come back to check a
/// limit `left` away (`None`: no limit, no timeout).
fn blocking_read_timeout(left: Option<Duration>) -> Option<Duration> {
    left.map(|l| l.clamp(Duration::from_millis(1), BLOCKING_CHECK_INTERVAL))
}

/// Blocks until the socket is readable, or `limit` passes (`None`: no
/// limit). A wait that ends without data is not an error: the caller reads
/// and checks its limits again.
fn wait_readable(stream: &TcpStream, limit: Option<Duration>) -> io::Result<()> {
    let timeout_ms = match limit {
        // Rounded up, so that the caller's next check finds the limit reached.
        Some(left) => i32::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX),
        None => -1,
    };
    match wait_for(stream, libc::POLLIN, timeout_ms) {
        Err(e) if e.kind() == io::ErrorKind::TimedOut => Ok(()),
        other => other,
    }
}

/// A client that takes no answers for this long is dropped.
pub(crate) const SEND_STALL_TIMEOUT_MS: i32 = 30_000;

/// Blocks until the socket is ready for `events`, or `timeout_ms` passes
/// (-1: no limit; a timeout is an error).
fn wait_for(stream: &TcpStream, events: libc::c_short, timeout_ms: i32) -> io::Result<()> {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid pollfd that outlives the call.
    let ret = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    match ret {
        0 => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "client stopped taking answers",
        )),
        r if r < 0 => {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                Ok(())
            } else {
                Err(err)
            }
        }
        _ => Ok(()),
    }
}

fn protocol_error(err: DecodeError) -> String {
    format!("closing connection after a malformed header: {err}")
}

/// Answers one message. Until the handshake is done only its messages are
/// answered; anything else, or a failed proof, closes the connection.
fn handle(
    header: &Header,
    payload: &[u8],
    exported: &Exported,
    session: &mut Session,
    outbox: &mut Outbox,
    tally: &mut RequestTally,
) -> Result<(), Refusal> {
    let answer = |status: Status| Header {
        opcode: header.opcode.response(),
        status,
        request_id: header.request_id,
        offset: header.offset,
        length: header.length,
        checksum: 0,
    };
    let handshake_answer = |bytes: Vec<u8>, outbox: &mut Outbox| {
        let mut h = answer(Status::Ok);
        h.length = bytes.len() as u32;
        outbox.push(h, Payload::Hello(bytes));
    };
    match header.opcode {
        Opcode::Hello => {
            match handshake::on_hello(payload, &exported.auth, exported.epoch, session)? {
                Some(challenge) => handshake_answer(challenge, outbox),
                None => {
                    // The answer carries `length` payload bytes whatever its
                    // status (docs/wire-protocol.md): a refusal sends none.
                    let mut h = answer(Status::BadLength);
                    h.length = 0;
                    outbox.push(h, Payload::None);
                }
            }
        }
        Opcode::Auth => {
            let ack = handshake::on_auth(
                payload,
                &exported.auth,
                exported.epoch,
                exported.region.len_bytes() as u64,
                handshake::RdmaOffer::of(exported.rdma.as_ref(), exported.guard.is_active()),
                handshake::Terms {
                    checksums: exported.page_checksums,
                    node_bound_limit: exported.coherence.node_bound_limit(),
                },
                session,
            )?;
            handshake_answer(ack, outbox);
        }
        Opcode::Read | Opcode::Write | Opcode::CohToHome if !session.is_ready() => {
            return Err(Refusal::BeforeHandshake)
        }
        Opcode::Read => {
            // Without checksums, or with the page's sum kept since it was
            // written (`page_sums.rs`), the page goes out of the region
            // itself; else it is copied and summed (its sum must match what
            // is sent).
            let page = exported.check(header).map(|off| {
                let sum = match session.checksums.then(|| exported.sums.cached(off)) {
                    Some(None) => {
                        return outbox
                            .copy_page(&exported.region, &exported.sums, off)
                            .map(|(copy, sum)| (answer(Status::Ok).with_checksum(sum), copy));
                    }
                    Some(Some(kept)) => {
                        tally.record_kept_sum();
                        kept
                    }
                    // No checksums: bytes 28..32 stay zero.
                    None => 0,
                };
                exported
                    .region
                    .ptr_at(off, PAGE_SIZE)
                    .map(|page| (answer(Status::Ok).with_checksum(sum), Payload::Region(page)))
            });
            let served = match page {
                Ok(Some((header, payload))) => {
                    outbox.push(header, payload);
                    true
                }
                Ok(None) => {
                    outbox.push(answer(Status::OutOfRange), Payload::None);
                    false
                }
                Err(status) => {
                    outbox.push(answer(status), Payload::None);
                    false
                }
            };
            tally.record(Op::Read, served);
        }
        Opcode::Write => {
            let status = match exported.check(header) {
                Ok(off) => {
                    // The page's own sum (what READ answers carry); the
                    // header's covers the offset too with offset-bound sums,
                    // so a WRITE whose offset changed on the way fails here
                    // instead of landing on another page.
                    let page_sum = session.checksums.then(|| page_checksum(payload));
                    let claimed =
                        page_sum.map(|sum| write_checksum(sum, header.offset, session.bound_sums));
                    if claimed.is_some_and(|sum| sum != header.checksum) {
                        // Refused, not applied; the framing held, so the
                        // connection stays.
                        exported.damaged_on_the_way(Damaged::Write, session.peer, header.offset);
                        Status::BadChecksum
                    } else {
                        // Checked: `page_sum` is the sum of the bytes written.
                        match exported.guard.client_write(
                            &exported.region,
                            &exported.sums,
                            off,
                            payload,
                            page_sum,
                        ) {
                            Ok(()) => Status::Ok,
                            Err(_) => Status::OutOfRange,
                        }
                    }
                }
                Err(status) => status,
            };
            outbox.push(answer(status), Payload::None);
            tally.record(Op::Write, status == Status::Ok);
        }
        Opcode::HelloAck
        | Opcode::Challenge
        | Opcode::ReadResp
        | Opcode::WriteResp
        | Opcode::CohToHome
        | Opcode::CohToNode
        | Opcode::Error => {
            if !session.is_ready() {
                return Err(Refusal::BeforeHandshake);
            }
            outbox.push(answer(Status::BadOpcode), Payload::None);
        }
    }
    Ok(())
}
