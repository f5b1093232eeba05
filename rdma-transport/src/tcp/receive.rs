//! Reading answers off a connection and completing the requests they name.
//!
//! Whoever holds a connection's receive buffer does this: a caller waiting
//! for its own answers (no hand-off at all on the way back), or the
//! connection's poller thread when no caller is waiting.

use std::io::{self, Read};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::connection::TcpConnection;
use super::inflight::{Claim, Waiter, CODE_CHECKSUM, CODE_CONN_LOST, CODE_PROTOCOL};
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
            match self.stream().read(&mut rb.buf[rb.end..]) {
                Ok(0) => {
                    tracing::debug!(node = %self.node_id, "page-server closed the connection");
                    return Err(CODE_CONN_LOST);
                }
                Ok(n) => {
                    any = true;
                    rb.end += n;
                    self.parse(rb)?;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(any),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(node = %self.node_id, err = %e, "connection read failed");
                    return Err(CODE_CONN_LOST);
                }
            }
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
                tracing::warn!(node = %self.node_id, request_id = header.request_id, offset = header.offset, "READ answer fails its page checksum");
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

/// Waits until `waiter` has no request outstanding or `deadline` passes
/// (false then). For up to `spin` the caller reads the answers off `conns`
/// itself (no hand-off, no wake-up); after that it parks and asks the
/// connections' pollers to finish the job.
pub(crate) fn wait(
    waiter: &Waiter,
    conns: &[Option<Arc<TcpConnection>>],
    spin: Duration,
    deadline: Instant,
) -> bool {
    let conns = || conns.iter().flatten();
    if !spin.is_zero() {
        let spin_until = Instant::now() + spin;
        let mut spins = 0u32;
        loop {
            for c in conns() {
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
                    break;
                }
            }
            // On a small host the page-server (or whoever answers) may be
            // queued behind us on this very CPU: let it run.
            std::thread::yield_now();
        }
    }
    for c in conns() {
        c.parking.enter();
    }
    let answered = waiter.wait(Duration::ZERO, deadline);
    for c in conns() {
        c.parking.leave();
    }
    answered
}
