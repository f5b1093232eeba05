//! Deferred submission (a doorbell): requests of asynchronous rounds are
//! armed at once but written later, all those of a connection with one
//! `writev`, when the completion queue is reaped (or at the end of a
//! submission in eventfd and callback modes). One system call then carries
//! every request a VMM thread submitted since the last reap, as a bare
//! pipelined client would send them.

use std::io::{self, IoSlice};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::connection::{Request, TcpConnection};
use super::inflight::{Waiter, CODE_CONN_LOST};
use crate::page::PAGE_SIZE;
use crate::wire::{Opcode, HEADER_LEN};

/// Iovecs per `writev` (below the kernel's IOV_MAX of 1024).
const IOVECS_PER_WRITE: usize = 512;

/// A WRITE request's page, kept until the flush.
#[derive(Debug, Clone, Copy)]
struct Payload(*const u8);

// SAFETY: the page belongs to a submission that stays in flight (so its
// memory stays lent to us) until the request is answered or cancelled, and
// a cancelled request is never flushed after its submission is gone (see
// `flush_deferred`'s caller contract).
unsafe impl Send for Payload {}

/// The requests of one connection armed but not yet written.
#[derive(Debug, Default)]
pub(crate) struct Deferred {
    /// Per header: its request's id.
    ids: Vec<u64>,
    headers: Vec<[u8; HEADER_LEN]>,
    /// Per header: the WRITE payload, or null.
    payloads: Vec<Payload>,
}

impl TcpConnection {
    /// Arms a slot for every request and queues it for the next
    /// `flush_deferred`. On success `ids[i]` is request i's id. On error,
    /// ids already armed are in `ids[..armed]` (queued, and still to be
    /// finished or cancelled by the caller).
    pub(crate) fn submit_deferred(
        &self,
        opcode: Opcode,
        reqs: &[Request],
        ids: &mut [u64],
        waiter: &Waiter,
        deadline: Instant,
    ) -> Result<(), (usize, io::Error)> {
        for (i, req) in reqs.iter().enumerate() {
            // Armed outside the queue's lock: waiting for a free slot must
            // not hold up a flush (which frees slots).
            let (id, header) = self
                .arm_one(opcode, req, waiter, deadline, true)
                .map_err(|e| (i, e))?;
            ids[i] = id;
            let mut queue = self.deferred.lock();
            queue.ids.push(id);
            queue.headers.push(header);
            queue.payloads.push(Payload(if opcode == Opcode::Write {
                req.page.cast_const()
            } else {
                std::ptr::null()
            }));
        }
        if self.is_broken() {
            // As in `submit`: a sweep that ran before these slots were
            // armed did not fail them.
            self.inflight.fail_all(CODE_CONN_LOST);
            return Err((reqs.len(), io::Error::from(io::ErrorKind::NotConnected)));
        }
        Ok(())
    }

    /// Writes every queued request. A failed write breaks the connection,
    /// which fails every request in flight on it (their owners see it lost).
    ///
    /// The owners of the queued WRITE pages must not have settled their
    /// requests yet: callers flush before they settle (the completion
    /// queue flushes under its lock, before it reaps). The write may take
    /// up to `timeout` (the clock is read only if the socket is full).
    pub(crate) fn flush_deferred(&self, timeout: Duration) {
        let mut queue = self.deferred.lock();
        if queue.headers.is_empty() {
            return;
        }
        let _send = self.send_lock.lock();
        let q = &mut *queue;
        for &id in &q.ids {
            self.wire_order.sent(id);
        }
        let mut result = Ok(());
        // On the stack for a few requests (a lone fault's: one header); a
        // long flush grows it up to one write's worth.
        let mut iov = SmallVec::<[IoSlice<'_>; 8]>::new();
        for (header, payload) in q.headers.iter().zip(&q.payloads) {
            iov.push(IoSlice::new(header));
            if !payload.0.is_null() {
                // SAFETY: a queued WRITE's page stays lent until its request
                // is settled, which happens only after this flush (see above).
                let page = unsafe { std::slice::from_raw_parts(payload.0, PAGE_SIZE) };
                iov.push(IoSlice::new(page));
            }
            if iov.len() + 2 > IOVECS_PER_WRITE {
                result = result.and_then(|()| self.write_draining(&mut iov, timeout));
                iov.clear();
            }
        }
        if !iov.is_empty() {
            result = result.and_then(|()| self.write_draining(&mut iov, timeout));
        }
        drop(iov);
        q.ids.clear();
        q.headers.clear();
        q.payloads.clear();
        if let Err(e) = result {
            tracing::debug!(node = %self.node_id, err = %e, "writing deferred requests failed");
            self.mark_broken(CODE_CONN_LOST);
        }
    }

    /// Writes all of `bufs` within `timeout` of the first time the socket
    /// is full. While it is full it reads the answers that came meanwhile:
    /// a flush can be megabytes, and a page-server whose answers nobody
    /// reads stops reading requests.
    fn write_draining(&self, mut bufs: &mut [IoSlice<'_>], timeout: Duration) -> io::Result<()> {
        let mut deadline = None::<Instant>;
        while !bufs.is_empty() {
            match super::connection::write_some(self.stream(), bufs) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(written) => IoSlice::advance_slices(&mut bufs, written),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if let Some(mut rb) = self.recv.try_lock() {
                        let _ = self.progress(&mut rb);
                    }
                    let now = Instant::now();
                    let deadline = *deadline.get_or_insert(now + timeout);
                    if now >= deadline {
                        return Err(io::Error::from(io::ErrorKind::TimedOut));
                    }
                    let soon = deadline.min(now + Duration::from_millis(1));
                    match super::connection::wait_writable(self.stream(), soon) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::TimedOut => {}
                        Err(e) => return Err(e),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}
