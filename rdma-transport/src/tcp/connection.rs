//! One client connection to a page-server: handshake, request submission and
//! the table of requests in flight. Answers are read by a poller thread
//! (`poller.rs`); callers write their own requests, so a request costs no
//! hand-off on its way out.

use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use smallvec::SmallVec;

use super::inflight::{Inflight, Waiter};
use super::poller::PollerHandle;
use super::receive::RecvBuf;
use super::wire_order::WireOrder;
use crate::auth::{ClusterKey, Role, Transcript};
use crate::log_limit::{LogLimit, WARN_INTERVAL};
use crate::page::{Page, PAGE_SIZE};
use crate::parking::Parking;
use crate::sys::cvt;
use crate::wire::{
    page_checksum, write_checksum, AuthRequest, Challenge, Header, HelloAck, HelloRequest, Opcode,
    RdmaHello, Status, HEADER_LEN, HELLO_ACK_LEN, VERSION,
};

/// Requests one call writes with one `writev` at most.
pub(crate) const MAX_CHUNK: usize = 64;

/// Why a connection could not be set up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    #[error("connect to {addr}: {}", io_reason(.source))]
    Io { addr: String, source: io::Error },
    #[error("handshake with {addr}: {detail}")]
    Handshake { addr: String, detail: String },
    #[error("{addr} is not a member of this cluster: {detail}")]
    AuthFailed { addr: String, detail: String },
}

/// An I/O error of a dial in words: a socket timeout reads as EAGAIN
/// ("Resource temporarily unavailable"), which says nothing of a peer that
/// took the connection and then never answered (a stopped process).
fn io_reason(source: &io::Error) -> String {
    match source.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            format!("no answer within the connect timeout ({source})")
        }
        _ => source.to_string(),
    }
}

/// What a client proves in the handshake, and to whom.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientAuth<'a> {
    pub(crate) client_id: u64,
    /// The node the map says is at the address.
    pub(crate) node_id: &'a str,
    /// `None`: insecure (no proof sent; only a server without a key accepts).
    pub(crate) key: Option<&'a ClusterKey>,
    /// Ask for page checksums (used on the TCP data path only).
    pub(crate) checksums: bool,
    /// Ask for a coherence channel (with an RDMA endpoint whose address and
    /// key are the client's message ring: `crate::rdma::MessageChannel`).
    pub(crate) coherence: bool,
    /// As a coherence node: its bound on the server's silence, declared in
    /// AUTH (`AuthRequest::node_bound_ms`); `None` for data connections.
    pub(crate) node_bound_ms: Option<std::num::NonZeroU32>,
    /// Counts the pages this connection's answers put straight into their
    /// destination (shared by every connection of a manager; `None`: a
    /// counter of the connection's own).
    pub(crate) landed_pages: Option<&'a Arc<AtomicU64>>,
}

/// A connected, handshaken page-server connection.
#[derive(Debug)]
pub(crate) struct TcpConnection {
    pub(crate) node_id: String,
    stream: TcpStream,
    pub(super) send_lock: Mutex<()>,
    /// Requests armed but not written yet (`submit_deferred`).
    pub(super) deferred: Mutex<super::deferred::Deferred>,
    pub(crate) inflight: Inflight,
    /// The order requests went out in (written under `send_lock`): whose
    /// answers the reader may read straight into their pages.
    pub(crate) wire_order: WireOrder,
    /// Bytes read but not parsed; held by whoever is reading answers.
    pub(crate) recv: Mutex<RecvBuf>,
    /// Callers parked waiting for answers on this connection: the poller
    /// watches the socket only while there are any.
    pub(crate) parking: Parking<PollerHandle>,
    /// Set while a caller blocks in `poll(2)` on the socket and reads the
    /// answers itself (`receive::wait`): the poller leaves the socket alone.
    pub(crate) blocking_reader: AtomicBool,
    broken: AtomicBool,
    pub(crate) ack: HelloAck,
    /// Pages read from the socket straight into their destination (no copy
    /// out of the receive buffer): `receive.rs`.
    pub(crate) landed_pages: Arc<AtomicU64>,
    /// READ answers that fail their page checksum are logged at most once
    /// per `WARN_INTERVAL` (each still fails its request): a damaged link
    /// or a forger must not flood the VMM's log.
    pub(crate) checksum_log: LogLimit,
}

/// One request of a chunk.
#[derive(Clone, Copy)]
pub(crate) struct Request {
    pub(crate) offset: u64,
    /// READ: where the page goes. WRITE: where it comes from.
    pub(crate) page: *mut u8,
    /// READ: the answer may be read from the socket straight into `page`,
    /// which is then unspecified if the request fails (its checksum is
    /// checked there). False keeps a failed READ's page untouched.
    pub(crate) direct: bool,
}

impl TcpConnection {
    /// Connects to `addr`, does the HELLO handshake, and leaves the socket
    /// non-blocking for the poller.
    pub(crate) fn connect(
        addr: &str,
        auth: &ClientAuth<'_>,
        timeout: Duration,
    ) -> Result<Self, ConnectError> {
        let mut stream = dial(addr, timeout)?;
        let ack = handshake(&mut stream, addr, auth, None)?;
        Self::from_handshaken(auth, addr, stream, ack)
    }

    /// Wraps a stream whose HELLO handshake is done (e.g. one where the
    /// client offered RDMA and the server declined) as the TCP data path.
    pub(crate) fn from_handshaken(
        auth: &ClientAuth<'_>,
        addr: &str,
        stream: TcpStream,
        ack: HelloAck,
    ) -> Result<Self, ConnectError> {
        let io_err = |source| ConnectError::Io {
            addr: addr.to_owned(),
            source,
        };
        stream.set_nonblocking(true).map_err(io_err)?;
        // No request sent here may arrive after the connection is closed,
        // however it is closed, its process killed included (see
        // `sys::abandon`).
        // (`SO_LINGER` on, 0 s: a close resets the connection and discards
        // what the server has not acknowledged.)
        socket2::SockRef::from(&stream)
            .set_linger(Some(Duration::ZERO))
            .map_err(io_err)?;
        Ok(Self {
            node_id: auth.node_id.to_owned(),
            stream,
            send_lock: Mutex::new(()),
            deferred: Mutex::new(super::deferred::Deferred::default()),
            inflight: Inflight::new(),
            wire_order: WireOrder::new(),
            recv: Mutex::new(RecvBuf::new()),
            parking: Parking::new(),
            blocking_reader: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            ack,
            landed_pages: auth.landed_pages.map_or_else(Arc::default, Arc::clone),
            checksum_log: LogLimit::new(WARN_INTERVAL),
        })
    }

    pub(crate) fn stream(&self) -> &TcpStream {
        &self.stream
    }

    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// Marks the connection dead, shuts the socket and fails every request
    /// in flight. Idempotent. What the server has not acknowledged yet is
    /// discarded (`sys::abandon`): a WRITE given up on here never lands
    /// after a newer write of its page sent over the next connection, or
    /// by another host.
    pub(crate) fn mark_broken(&self, code: u32) {
        if !self.broken.swap(true, Ordering::SeqCst) {
            crate::sys::abandon(&self.stream);
        }
        self.inflight.fail_all(code);
    }

    /// Arms a slot for every request and writes them all with one `writev`.
    /// On success, `ids[i]` holds request i's id; the caller then waits on
    /// `waiter` and calls `finish`/`cancel` for each id.
    ///
    /// On error, ids already armed are in `ids[..armed]` and must still be
    /// finished or cancelled by the caller.
    pub(crate) fn submit(
        &self,
        opcode: Opcode,
        reqs: &[Request],
        ids: &mut [u64],
        waiter: &Waiter,
        deadline: Instant,
    ) -> Result<(), (usize, io::Error)> {
        debug_assert!(reqs.len() <= MAX_CHUNK && ids.len() >= reqs.len());
        // On the stack, filled only as far as the call goes: arrays would be
        // zeroed first (~4 KiB for a one-page call).
        let mut headers = SmallVec::<[[u8; HEADER_LEN]; MAX_CHUNK]>::new();
        let _guard = self.send_lock.lock();
        for (i, req) in reqs.iter().enumerate() {
            let (id, header) = self
                .arm_one(opcode, req, waiter, deadline, false)
                .map_err(|e| (i, e))?;
            ids[i] = id;
            headers.push(header);
        }
        // The poller sets `broken` before failing pending slots; checking it
        // after arming closes the window where a slot armed after that sweep
        // would wait for an answer that can never come.
        if self.is_broken() {
            // A sweep that ran before these slots were armed did not fail
            // them, and nothing will answer them: fail them now, so the
            // caller's wait ends at once instead of at its deadline.
            self.inflight.fail_all(super::inflight::CODE_CONN_LOST);
            return Err((reqs.len(), io::Error::from(io::ErrorKind::NotConnected)));
        }
        let mut iov = SmallVec::<[IoSlice<'_>; 2 * MAX_CHUNK]>::new();
        for &id in &ids[..reqs.len()] {
            self.wire_order.sent(id);
        }
        for (header, req) in headers.iter().zip(reqs) {
            iov.push(IoSlice::new(header));
            if opcode == Opcode::Write {
                // SAFETY: for WRITE, `page` points at a caller-owned page that
                // stays borrowed for the whole call.
                let page: &Page = unsafe { &*req.page.cast::<Page>() };
                iov.push(IoSlice::new(page));
            }
        }
        self.write_all_vectored(&mut iov, deadline).map_err(|e| {
            // A partial write leaves the stream's framing unknown: drop it.
            self.mark_broken(super::inflight::CODE_CONN_LOST);
            (reqs.len(), e)
        })
    }

    /// Arms a slot for `req` (waiting for a free one until `deadline`) and
    /// encodes its header. `drain`: while the table is full, write the
    /// deferred requests and read the answers that came, so slots can free
    /// up (a deferred submitter may hold every slot itself).
    pub(super) fn arm_one(
        &self,
        opcode: Opcode,
        req: &Request,
        waiter: &Waiter,
        deadline: Instant,
        drain: bool,
    ) -> io::Result<(u64, [u8; HEADER_LEN])> {
        let read = opcode == Opcode::Read;
        let dst = if read { req.page } else { std::ptr::null_mut() };
        let id = loop {
            if let Some(id) = self
                .inflight
                .arm(dst, req.offset, waiter, read && req.direct)
            {
                break id;
            }
            if Instant::now() >= deadline {
                return Err(io::Error::from(io::ErrorKind::TimedOut));
            }
            if drain {
                self.flush_deferred(deadline.saturating_duration_since(Instant::now()));
                if let Some(mut rb) = self.recv.try_lock() {
                    let _ = self.progress(&mut rb);
                }
            }
            std::thread::yield_now();
        };
        let mut header = Header::request(opcode, id, req.offset, PAGE_SIZE as u32);
        if opcode == Opcode::Write && self.ack.checksums {
            // SAFETY: for WRITE, `page` points at a caller-owned page that
            // stays borrowed until the request is answered or cancelled.
            let page: &Page = unsafe { &*req.page.cast::<Page>() };
            header = header.with_checksum(write_checksum(
                page_checksum(page),
                req.offset,
                self.ack.bound_sums,
            ));
        }
        Ok((id, header.encode()))
    }

    pub(super) fn write_all_vectored(
        &self,
        mut bufs: &mut [IoSlice<'_>],
        deadline: Instant,
    ) -> io::Result<()> {
        while !bufs.is_empty() {
            match write_some(&self.stream, bufs) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(written) => IoSlice::advance_slices(&mut bufs, written),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait_writable(&self.stream, deadline)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// One `send` for one buffer (a lone request's header: no iovec for the
/// kernel to import), else one `sendmsg`; both with `MSG_NOSIGNAL` (std's
/// `write` sets it), so a page-server that died is an error here, never a
/// `SIGPIPE` in the host process.
pub(super) fn write_some(mut stream: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    match bufs {
        [one] => stream.write(one),
        _ => crate::sys::send_vectored(stream, bufs),
    }
}

/// Opens a TCP connection to a page-server (no delay, blocking), all within
/// `timeout`: name resolution, connect, and the reads and writes of the
/// handshake that follows (the socket's timeouts are what is left of it).
pub(crate) fn dial(addr: &str, timeout: Duration) -> Result<TcpStream, ConnectError> {
    let io_err = |source| ConnectError::Io {
        addr: addr.to_owned(),
        source,
    };
    let deadline = Instant::now() + timeout;
    let left = || {
        let left = deadline.saturating_duration_since(Instant::now());
        match left.is_zero() {
            true => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no connection within {} ms", timeout.as_millis()),
            )),
            false => Ok(left),
        }
    };
    let sock_addr: SocketAddr = resolve(addr, timeout).map_err(io_err)?;
    let stream = TcpStream::connect_timeout(&sock_addr, left().map_err(io_err)?).map_err(io_err)?;
    stream.set_nodelay(true).map_err(io_err)?;
    let left = left().map_err(io_err)?;
    stream.set_read_timeout(Some(left)).map_err(io_err)?;
    stream.set_write_timeout(Some(left)).map_err(io_err)?;
    Ok(stream)
}

/// The handshake, client side (docs/wire-protocol.md): HELLO with a fresh
/// nonce; CHALLENGE, whose server proof is checked before anything else is
/// sent; AUTH with the client's proof and, for RDMA, its QP endpoint; then
/// the HELLO_ACK. Bounded by the stream's timeouts. Page checksums are on
/// for the connection when the client asked and the HELLO_ACK agrees
/// (`HelloAck::checksums`).
///
/// A server that cannot prove the key, or that hangs up after the client's
/// proof, is `ConnectError::AuthFailed`: never used.
pub(crate) fn handshake(
    stream: &mut TcpStream,
    addr: &str,
    auth: &ClientAuth<'_>,
    rdma: Option<RdmaHello>,
) -> Result<HelloAck, ConnectError> {
    let io_err = |source| ConnectError::Io {
        addr: addr.to_owned(),
        source,
    };
    let bad = |detail: String| ConnectError::Handshake {
        addr: addr.to_owned(),
        detail,
    };
    let refused = |detail: &str| ConnectError::AuthFailed {
        addr: addr.to_owned(),
        detail: detail.to_owned(),
    };
    let client_nonce = crate::auth::nonce().map_err(io_err)?;
    let hello = HelloRequest {
        client_id: auth.client_id,
        nonce: client_nonce,
    };
    send(stream, Opcode::Hello, &hello.encode()).map_err(io_err)?;
    let payload = receive(stream, Opcode::Challenge, addr)?;
    let challenge = Challenge::decode(&payload)
        .ok_or_else(|| bad(format!("malformed CHALLENGE of {} bytes", payload.len())))?;
    let transcript = Transcript {
        version: VERSION,
        client_id: auth.client_id,
        node_id: auth.node_id,
        client_nonce: &client_nonce,
        server_nonce: &challenge.nonce,
        epoch: challenge.epoch,
    };
    let proof = match (auth.key, &challenge.proof) {
        (Some(key), Some(server_proof)) => {
            if !transcript.verify(key, Role::Server, server_proof) {
                return Err(refused(&format!(
                    "its proof of the cluster key is wrong (another key, or not node {})",
                    auth.node_id
                )));
            }
            Some(transcript.prove(key, Role::Client))
        }
        (Some(_), None) => return Err(refused("it runs without a cluster key (--insecure)")),
        (None, _) => None,
    };
    let request = AuthRequest {
        proof,
        rdma,
        checksums: auth.checksums,
        // Always with checksums: a page-server that predates offset-bound
        // sums refuses the flag, as one that predates checksums refuses
        // theirs (docs/wire-protocol.md).
        bound_sums: auth.checksums,
        coherence: auth.coherence,
        node_bound_ms: auth.node_bound_ms,
    };
    send(stream, Opcode::Auth, &request.encode()).map_err(io_err)?;
    let payload = match receive(stream, Opcode::HelloAck, addr) {
        Ok(p) => p,
        // The server hangs up on a proof it does not accept.
        Err(ConnectError::Io { source, .. }) if source.kind() == io::ErrorKind::UnexpectedEof => {
            // (Or it predates an AUTH option sent here, offset-bound sums
            // or a node bound, and refuses the unknown flag the same way.)
            return Err(refused(match auth.key {
                Some(_) => {
                    "it closed the connection after our proof (a different cluster key? or a \
                     page-server older than this client, which refuses its AUTH options)"
                }
                None => {
                    "it closed the connection: it needs a cluster key and this client has none \
                     (or it is a page-server older than this client, which refuses its AUTH \
                     options)"
                }
            }));
        }
        Err(e) => return Err(e),
    };
    let ack = HelloAck::decode(&payload)
        .filter(|a| a.page_size as usize == PAGE_SIZE)
        .ok_or_else(|| {
            bad(format!(
                "malformed HELLO_ACK of {} bytes (need {HELLO_ACK_LEN}+)",
                payload.len()
            ))
        })?;
    if ack.checksums && !auth.checksums {
        return Err(bad(
            "HELLO_ACK agrees to page checksums this client did not ask for".into(),
        ));
    }
    if ack.coherence.is_some() && !(auth.coherence && ack.rdma.is_some()) {
        return Err(bad(
            "HELLO_ACK offers a coherence channel this client did not ask for".into(),
        ));
    }
    if ack.epoch != challenge.epoch {
        return Err(bad(format!(
            "HELLO_ACK epoch {:#x} differs from CHALLENGE epoch {:#x}",
            ack.epoch, challenge.epoch
        )));
    }
    Ok(ack)
}

fn send(stream: &mut TcpStream, opcode: Opcode, payload: &[u8]) -> io::Result<()> {
    let header = Header::request(opcode, 0, 0, payload.len() as u32);
    let mut msg = header.encode().to_vec();
    msg.extend_from_slice(payload);
    stream.write_all(&msg)
}

/// Reads one handshake message of `opcode` with status OK; its payload.
fn receive(stream: &mut TcpStream, opcode: Opcode, addr: &str) -> Result<Vec<u8>, ConnectError> {
    let io_err = |source| ConnectError::Io {
        addr: addr.to_owned(),
        source,
    };
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head).map_err(io_err)?;
    let header = Header::decode(&head).map_err(|e| ConnectError::Handshake {
        addr: addr.to_owned(),
        detail: e.to_string(),
    })?;
    if header.opcode != opcode || header.status != Status::Ok {
        return Err(ConnectError::Handshake {
            addr: addr.to_owned(),
            detail: format!(
                "expected {opcode:?}, got {:?} ({})",
                header.opcode, header.status
            ),
        });
    }
    let mut payload = vec![0u8; header.payload_len()];
    stream.read_exact(&mut payload).map_err(io_err)?;
    Ok(payload)
}

pub(super) fn wait_writable(stream: &TcpStream, deadline: Instant) -> io::Result<()> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    if remaining.is_zero() {
        return Err(io::Error::from(io::ErrorKind::TimedOut));
    }
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    let timeout_ms = remaining.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: `pfd` is one valid pollfd that outlives the call.
    let ret = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    match cvt(ret) {
        Ok(0) => Err(io::Error::from(io::ErrorKind::TimedOut)),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
        Err(e) => Err(e),
    }
}

/// `addr` as a socket address: parsed when it is an `ip:port` (no lookup),
/// else resolved by the system resolver on a helper thread, waiting no longer
/// than `timeout` (the lookup itself has no time limit; a late answer is
/// dropped).
fn resolve(addr: &str, timeout: Duration) -> io::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    if let Ok(sock_addr) = addr.parse() {
        return Ok(sock_addr);
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let name = addr.to_owned();
    std::thread::Builder::new()
        .name("resolve".into())
        .spawn(move || {
            let _ = tx.send(name.to_socket_addrs().map(|mut a| a.next()));
        })?;
    match rx.recv_timeout(timeout) {
        Ok(Ok(Some(sock_addr))) => Ok(sock_addr),
        Ok(Ok(None)) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{addr} resolves to no address"),
        )),
        Ok(Err(err)) => Err(err),
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "resolving {addr} took longer than {} ms",
                timeout.as_millis()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dial_that_timed_out_says_the_peer_did_not_answer() {
        let io = |kind| ConnectError::Io {
            addr: "127.0.0.1:7".into(),
            source: io::Error::from(kind),
        };
        for kind in [io::ErrorKind::WouldBlock, io::ErrorKind::TimedOut] {
            let text = io(kind).to_string();
            assert!(
                text.starts_with("connect to 127.0.0.1:7: no answer within the connect timeout"),
                "{text}"
            );
        }
        let refused = io(io::ErrorKind::ConnectionRefused).to_string();
        assert!(!refused.contains("no answer"), "{refused}");
    }
}
