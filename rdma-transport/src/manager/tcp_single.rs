//! The one-page fast path over TCP (`read_page`, `write_page`, one-page
//! batches): one request slot, no round bookkeeping, so nothing but the
//! request itself is cleared (the general path clears ~10 KiB of arrays
//! sized for 64 requests) and the clock is read once.

use std::sync::Arc;

use super::link::Link;
use super::tcp_chunk::Sent;
use super::Inner;
use crate::error::TransportError;
use crate::rdma::Deadline;
use crate::tcp::{Request, TcpConnection, Waiter};
use crate::wire::Opcode;

/// A page's one holder, as `single_holder` found it: one guard on the
/// published view (`fast_view.rs`), not clones, so a request takes no
/// reference count on the map, the link or the regions.
pub(super) struct Holder {
    pub(super) view: arc_swap::Guard<Arc<super::fast_view::FastView>>,
    pub(super) loc: crate::gpa_map::Location,
}

impl Holder {
    /// The holder's node and its live connection.
    pub(super) fn node_and_link(&self) -> Option<(&super::Node, &Link)> {
        let node = self.view.state.nodes.get(self.loc.node_index)?;
        Some((node, self.view.link(self.loc.node_index)?))
    }
}

impl Inner {
    /// A fault handler's read of the page at `gpa` straight into `page`,
    /// on the one-page TCP path (no completion queue), waiting for its
    /// answer at most `wait`. `None` when that path does not apply (see
    /// [`Inner::run_single_tcp`]) or the holder's link is RDMA. An error
    /// when the read failed or took longer than `wait` (its request is
    /// cancelled): `page` is then unspecified and the caller reads it again
    /// the general way, which counts that outcome (so only a success is
    /// counted here).
    pub(crate) fn read_direct_within(
        &self,
        gpa: u64,
        page: *mut u8,
        wait: std::time::Duration,
    ) -> Option<Result<(), TransportError>> {
        let deadline = Deadline::lazy(wait);
        let result = self.run_single_tcp(Opcode::Read, gpa, page, true, &deadline)?;
        if result.is_ok() {
            self.counters.record(Opcode::Read, 1, &result);
        }
        Some(result)
    }

    /// The one holder of `gpa` and its node's live connection, when a
    /// one-page request may take a fast path: an aligned address in a
    /// single-holder range that serves, on a connection to the server in
    /// the range's epoch. `None` sends the request down the general path
    /// (which refreshes the map on a miss, fails over replicas, dials, or
    /// fails with `DataLost` for a server in another epoch).
    #[inline(always)]
    pub(super) fn single_holder(&self, gpa: u64) -> Option<Holder> {
        if !crate::page::is_page_aligned(gpa) {
            return None;
        }
        let view = self.view.load();
        let loc = view.state.map.lookup(gpa)?;
        if loc.replicated || !loc.state.serves_reads() {
            return None;
        }
        let live = view.link(loc.node_index)?;
        if live.is_broken() || !super::epoch::serves(loc.valid_epoch, live.epoch()) {
            return None;
        }
        Some(Holder { view, loc })
    }

    /// Runs one page over the node's live TCP connection. `None` when the
    /// general path must do it: a replicated range, no connection yet, a
    /// map miss, a bad address, a server in another epoch than the range's.
    ///
    /// A `direct` READ's answer may be read from the socket straight into
    /// `page`, which is then unspecified if the read fails.
    pub(super) fn run_single_tcp(
        &self,
        opcode: Opcode,
        gpa: u64,
        page: *mut u8,
        direct: bool,
        deadline: &Deadline,
    ) -> Option<Result<(), TransportError>> {
        let holder = self.single_holder(gpa)?;
        let loc = holder.loc;
        let (node, Link::Tcp(conn)) = holder.node_and_link()? else {
            return None;
        };
        let deadline = deadline.get();
        // Declared before the guard, which cancels the request (so nothing
        // refers to the waiter or the page) if this thread unwinds.
        let waiter = Waiter::new();
        let mut pending = Pending { conn, id: None };
        let mut ids = [0u64; 1];
        let request = [Request {
            offset: loc.remote_offset,
            page,
            direct,
        }];
        let code = match conn.submit(opcode, &request, &mut ids, &waiter, deadline) {
            Ok(()) => {
                pending.id = Some(ids[0]);
                #[cfg(any(test, feature = "test-hooks"))]
                super::unwind_hook::maybe_panic_after_submit();
                let spin = self.config.caller_spin();
                let conns = [Some(&**conn)];
                let answered = crate::tcp::wait(&waiter, &conns, spin, deadline);
                pending.settle(answered)
            }
            // Armed, then the write failed: its code says how (a broken
            // connection fails it as lost, which the caller retries).
            Err((1, _)) => {
                pending.id = Some(ids[0]);
                pending.settle(false)
            }
            Err((_, err)) => {
                tracing::debug!(node = %node.id, %err, "submitting to node failed");
                return Some(Err(TransportError::NodeDown {
                    node: node.id.clone(),
                    reason: err.to_string(),
                }));
            }
        };
        let sent = Sent {
            group: 0,
            id: ids[0],
            gpa,
            target: 0,
        };
        let write = opcode == Opcode::Write;
        Some(
            self.code_to_error(code, conn, node, sent, write)
                .map_or(Ok(()), Err),
        )
    }
}

/// The request on the wire until its outcome is known; dropped unsettled
/// (the caller unwound), it cancels it, so no poller writes into the
/// caller's page or signals its waiter after it is gone.
struct Pending<'a> {
    conn: &'a Arc<TcpConnection>,
    id: Option<u64>,
}

impl Pending<'_> {
    /// The completion code (`None`: cancelled before an answer).
    fn settle(&mut self, answered: bool) -> Option<u32> {
        let id = self.id.take()?;
        if answered {
            Some(self.conn.inflight.finish(id))
        } else {
            self.conn.inflight.cancel(id)
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = self.conn.inflight.cancel(id);
        }
    }
}
