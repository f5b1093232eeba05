//! The one-page fast path over RDMA (`read_page`, `write_page`,
//! `read_frame`, one-page batches): one work request, no chunk bookkeeping,
//! and no bounce frame when the caller's page lies in registered memory
//! (`TransportManager::register_memory`): the READ lands in it, the WRITE
//! goes out of it. Otherwise the page goes through one pool frame. Under emulation (the SoftRoCE VM) clearing the chunk
//! path's stack arrays costs a sizeable part of a round trip; here nothing
//! is cleared and the clock is read once.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::link::Link;
use super::{Inner, Node};
use crate::error::TransportError;
use crate::page::PAGE_SIZE;
use crate::pool::PageFrame;
use crate::rdma::{Deadline, PageOp, RdmaConnection};
use crate::tcp::Waiter;
use crate::tcp::CODE_CONN_LOST;
use crate::wire::{Opcode, Status};

impl Inner {
    /// Runs one page over the node's live RDMA connection. `None` (and
    /// `frame` untouched) when the general path must do it: no RDMA
    /// connection yet, a map miss, a bad address, a server in another epoch
    /// than the range's.
    #[inline(always)]
    pub(super) fn run_single_rdma(
        &self,
        opcode: Opcode,
        gpa: u64,
        page: *mut u8,
        frame: &mut Option<&mut Option<PageFrame>>,
        deadline: &Deadline,
    ) -> Option<Result<(), TransportError>> {
        let rdma = self.rdma.as_ref()?;
        let holder = self.single_holder(gpa)?;
        let loc = holder.loc;
        let (node, Link::Rdma(conn)) = holder.node_and_link()? else {
            return None;
        };
        let in_range = loc
            .remote_offset
            .checked_add(PAGE_SIZE as u64)
            .is_some_and(|end| end <= conn.region_size_bytes());
        if !in_range {
            return Some(Err(TransportError::Refused {
                node: node.id.clone(),
                status: Status::OutOfRange,
            }));
        }
        let write = opcode == Opcode::Write;
        let mut direct = frame.take();
        let registry = &rdma.device.registry;
        // The caller's page in registered memory: no frame (`read_frame`
        // brings its own, already registered, frame).
        // (The holder's view keeps its region table, and so the region's
        // registration and lkey, until this function returns: after the
        // request is settled.)
        if direct.is_none() {
            let lkey = holder
                .view
                .regions
                .as_ref()
                .and_then(|regions| regions.lkey(page, PAGE_SIZE));
            if let Some(lkey) = lkey {
                let op = PageOp {
                    offset: loc.remote_offset,
                    local: page,
                    lkey,
                };
                let result = self.run_single_direct(write, op, conn, node, deadline);
                if result.is_ok() {
                    registry.direct_pages.fetch_add(1, Ordering::Relaxed);
                }
                return Some(result);
            }
        }
        let buf = match direct.as_mut().and_then(|slot| slot.take()) {
            Some(f) => f,
            None => match self.alloc_frame(deadline) {
                Some(f) => f,
                None => {
                    return Some(Err(TransportError::PoolExhausted {
                        capacity: self.pool.capacity(),
                    }))
                }
            },
        };
        if write {
            // SAFETY: for WRITE, `page` is the caller's page, borrowed for
            // the whole call; the frame is ours and nothing is in flight on it.
            unsafe { std::ptr::copy_nonoverlapping(page, buf.as_ptr(), PAGE_SIZE) };
        }
        let waiter = Waiter::new();
        let op = PageOp {
            offset: loc.remote_offset,
            local: buf.as_ptr(),
            lkey: conn.pool_lkey(),
        };
        let id = match conn.submit(write, &[op], &waiter, deadline) {
            Ok(id) => id,
            Err(err) => match err.armed {
                Some(id) => id,
                None => {
                    // Never posted: the frame is free to reuse.
                    if let Some(slot) = direct {
                        *slot = Some(buf);
                    }
                    return Some(Err(TransportError::NodeDown {
                        node: node.id.clone(),
                        reason: err.reason,
                    }));
                }
            },
        };
        let pending = Pending {
            conn,
            id: Some(id),
            frame: Some(buf),
            caller_page: false,
        };
        #[cfg(any(test, feature = "test-hooks"))]
        super::unwind_hook::maybe_panic_after_submit();
        let spin = self.config.caller_spin();
        let answered = crate::rdma::wait(&waiter, std::iter::once(&**conn), spin, deadline);
        let (code, buf) = pending.settle(answered);
        let Some(buf) = buf else {
            return Some(Err(TransportError::Protocol {
                node: node.id.clone(),
                detail: "an RDMA request lost its frame".into(),
            }));
        };
        if code == Some(0) {
            if !write {
                match direct {
                    Some(slot) => *slot = Some(buf),
                    // SAFETY: the READ completed, so the device is done with
                    // the frame; `page` is the caller's exclusive page.
                    None => unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), page, PAGE_SIZE) },
                }
            }
            registry.framed_pages.fetch_add(1, Ordering::Relaxed);
            return Some(Ok(()));
        }
        // The device may still touch the frame until the QP is gone.
        conn.quarantine(buf);
        self.rdma_error(code, conn, node).map(Err)
    }

    /// One page straight from or into the caller's page `op.local`, which
    /// lies in a registered region whose table the caller holds until this
    /// returns (so its lkey stays valid). A failed or timed-out request
    /// drains the QP (`RdmaConnection::fence`) before this returns: the
    /// device then writes nothing more into the caller's page.
    #[inline(always)]
    fn run_single_direct(
        &self,
        write: bool,
        op: PageOp,
        conn: &Arc<RdmaConnection>,
        node: &Node,
        deadline: &Deadline,
    ) -> Result<(), TransportError> {
        let waiter = Waiter::new();
        let id = match conn.submit(write, &[op], &waiter, deadline) {
            Ok(id) => id,
            Err(err) => match err.armed {
                Some(id) => id,
                // Never posted: the device never saw the page.
                None => {
                    return Err(TransportError::NodeDown {
                        node: node.id.clone(),
                        reason: err.reason,
                    })
                }
            },
        };
        let pending = Pending {
            conn,
            id: Some(id),
            frame: None,
            caller_page: true,
        };
        #[cfg(any(test, feature = "test-hooks"))]
        super::unwind_hook::maybe_panic_after_submit();
        let spin = self.config.caller_spin();
        let answered = crate::rdma::wait(&waiter, std::iter::once(&**conn), spin, deadline);
        let (code, _) = pending.settle(answered);
        if code == Some(0) {
            return Ok(());
        }
        // The device may still be placing a READ response into the caller's
        // page: drain the QP before the page goes back to the caller.
        let fenced = conn.fence();
        if let Some(rdma) = &self.rdma {
            rdma.device.registry.count_drain(fenced);
        }
        match self.rdma_error(code, conn, node) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}

/// One posted page until its outcome is known. Dropped unsettled (the caller
/// unwound while it was in flight), it cancels the request, tears the QP
/// down and quarantines the frame, which the device may still write, or,
/// on the caller's registered page, drains the QP before the unwinding
/// goes on.
struct Pending<'a> {
    conn: &'a Arc<RdmaConnection>,
    id: Option<u64>,
    frame: Option<PageFrame>,
    /// The request names the caller's page (in registered memory, whose
    /// table the caller holds for longer than this).
    caller_page: bool,
}

impl Pending<'_> {
    /// The request's completion code (`None`: cancelled at the deadline)
    /// and the frame back (always there: only `settle` and `drop` take it).
    fn settle(mut self, answered: bool) -> (Option<u32>, Option<PageFrame>) {
        let code = match (self.id.take(), answered) {
            (Some(id), true) => Some(self.conn.inflight.finish(id)),
            (Some(id), false) => self.conn.inflight.cancel(id),
            (None, _) => None,
        };
        (code, self.frame.take())
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else {
            return;
        };
        let frame = self.frame.take();
        match self.conn.inflight.cancel(id) {
            // Completed: the device is done with the frame. A failure code
            // may come from a teardown (`fail_all`) while the page was
            // still on the wire: drain before the caller's page is left.
            Some(code) => {
                if code != 0 {
                    self.conn.mark_broken(CODE_CONN_LOST);
                    if self.caller_page {
                        self.conn.fence();
                    }
                }
                drop(frame);
            }
            // Still in flight: stop the QP, keep the frame from the pool
            // until the QP is destroyed; the caller's page cannot wait that
            // long: drain the QP now.
            None => {
                self.conn.mark_broken(CODE_CONN_LOST);
                if let Some(frame) = frame {
                    self.conn.quarantine(frame);
                }
                if self.caller_page {
                    self.conn.fence();
                }
            }
        }
    }
}
