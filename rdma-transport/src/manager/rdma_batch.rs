//! One chunk's requests to RDMA nodes: each node's pages become one batch of
//! RDMA READs into (or WRITEs from) the caller's pages when they lie in
//! registered memory (`TransportManager::register_memory`), else pool
//! frames; after the wait each frame is copied out, handed back, or
//! quarantined, and a failed batch that named caller pages has its QP
//! drained (`RdmaConnection::fence`) before the pages go back.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use smallvec::SmallVec;

use super::request::Outcome;
use super::{Inner, Node};
use crate::error::TransportError;
use crate::page::PAGE_SIZE;
use crate::pool::PageFrame;
use crate::rdma::{code_status, Deadline, PageOp, RdmaConnection, RegionTable, MAX_BATCH};
use crate::tcp::{Request, Waiter, CODE_CONN_LOST, MAX_CHUNK};
use crate::wire::Status;

const _: () = assert!(
    MAX_CHUNK <= MAX_BATCH,
    "a node's share of a chunk is one batch"
);

/// The RDMA side of one chunk: per request its frame, per node group its
/// connection and batch id.
pub(super) struct RdmaChunk {
    frames: [Option<PageFrame>; MAX_CHUNK],
    /// Per request, the caller's page a READ is copied to.
    dst: [*mut u8; MAX_CHUNK],
    group_of: [usize; MAX_CHUNK],
    pub(super) conns: [Option<Arc<RdmaConnection>>; MAX_CHUNK],
    ids: [Option<u64>; MAX_CHUNK],
    pub(super) groups: usize,
    /// One past the highest request index submitted: `frames`, `dst` and
    /// `group_of` hold nothing beyond it, so settling and dropping look no
    /// further.
    requests: usize,
    /// Requests posted straight on the caller's (registered) page.
    direct_reqs: u64,
    /// Groups with at least one such request (drained when they fail).
    direct_groups: u64,
    /// The registered regions the direct requests were found in, held
    /// until they are settled (keeps their MRs, and lkeys, valid).
    regions: Option<Arc<RegionTable>>,
}

impl RdmaChunk {
    pub(super) fn new() -> Self {
        Self {
            frames: [const { None }; MAX_CHUNK],
            dst: [std::ptr::null_mut(); MAX_CHUNK],
            group_of: [usize::MAX; MAX_CHUNK],
            conns: [const { None }; MAX_CHUNK],
            ids: [None; MAX_CHUNK],
            groups: 0,
            requests: 0,
            direct_reqs: 0,
            direct_groups: 0,
            regions: None,
        }
    }
}

impl RdmaChunk {
    /// Forgets the groups of a settled round (their frames and ids were
    /// taken by `settle_rdma`).
    pub(super) fn reset(&mut self) {
        for c in &mut self.conns[..self.groups] {
            *c = None;
        }
        self.groups = 0;
        self.requests = 0;
        self.direct_reqs = 0;
        self.direct_groups = 0;
        self.regions = None;
    }

    /// Holds `table` (the published view's) for the requests submitted
    /// next, unless the round holds one already or it is empty: then
    /// `submit_rdma` does not load the registry's table itself (and still
    /// decides which pages land straight in registered memory).
    pub(super) fn hold_regions(&mut self, table: &Arc<RegionTable>) {
        if self.regions.is_none() && !table.is_empty() {
            self.regions = Some(Arc::clone(table));
        }
    }
}

impl Drop for RdmaChunk {
    /// Runs with batches unsettled only when the caller unwound between
    /// submit and completion: each such batch is cancelled; one still in
    /// flight has its QP torn down and its frames, which the device may
    /// still write, quarantined with the connection (freed with the QP)
    /// instead of going back to the pool. A failed batch that named the
    /// caller's pages has its QP drained before the unwinding goes on.
    fn drop(&mut self) {
        let mut in_flight = [false; MAX_CHUNK];
        let groups = self.conns.iter().zip(self.ids.iter_mut()).take(self.groups);
        for (g, ((conn, id), in_flight)) in groups.zip(in_flight.iter_mut()).enumerate() {
            if let (Some(conn), Some(id)) = (conn, id.take()) {
                let code = conn.inflight.cancel(id);
                if code == Some(0) {
                    continue;
                }
                conn.mark_broken(CODE_CONN_LOST);
                *in_flight = code.is_none();
                if self.direct_groups & (1 << g) != 0 {
                    conn.fence();
                }
            }
        }
        for (j, slot) in self.frames[..self.requests].iter_mut().enumerate() {
            let Some(frame) = slot.take() else {
                continue;
            };
            let g = self.group_of[j];
            match self.conns.get(g).and_then(Option::as_ref) {
                Some(conn) if in_flight.get(g) == Some(&true) => conn.quarantine(frame),
                // Completed, or never posted: the device is done with it.
                _ => drop(frame),
            }
        }
    }
}

/// `read_frame`'s pool frame, which RDMA reads into directly: the chunk's
/// one page. Taken while in flight; put back on success.
pub(super) struct Pages<'a> {
    pub(super) frame: Option<&'a mut Option<PageFrame>>,
}

impl Inner {
    /// Posts `reqs` (request `members[i]` of the chunk is `reqs[i]`) to
    /// `conn` as group `group` of the chunk, each page straight from or
    /// into the caller's page when it lies in registered memory, else
    /// through a pool frame. Returns the first error; requests not posted
    /// get no frame and their bit in `failed`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn submit_rdma(
        &self,
        chunk: &mut RdmaChunk,
        group: usize,
        conn: Arc<RdmaConnection>,
        write: bool,
        reqs: &[Request],
        members: &[usize],
        pages: &mut Pages<'_>,
        waiter: &Waiter,
        deadline: &Deadline,
        failed: &mut u64,
    ) -> Option<TransportError> {
        let mut first_error = None;
        // Filled only as far as the group goes (an array would be zeroed
        // first: 1.5 KiB for a one-page round).
        let mut ops = SmallVec::<[PageOp; MAX_CHUNK]>::new();
        // `read_frame` brings its own (registered) frame: its page never
        // goes straight into registered memory, whatever table the round
        // holds. A round resolved on the published view came with the
        // view's table (`OnMap`).
        let framed = pages.frame.is_some();
        if !framed && chunk.regions.is_none() {
            if let Some(rdma) = &self.rdma {
                let regions = rdma.device.registry.current();
                if !regions.is_empty() {
                    chunk.regions = Some(arc_swap::Guard::into_inner(regions));
                }
            }
        }
        for (req, &j) in reqs.iter().zip(members) {
            chunk.requests = chunk.requests.max(j + 1);
            let in_range = req
                .offset
                .checked_add(PAGE_SIZE as u64)
                .is_some_and(|end| end <= conn.region_size_bytes());
            if !in_range {
                *failed |= 1 << j;
                first_error.get_or_insert(TransportError::Refused {
                    node: conn.node_id.clone(),
                    status: Status::OutOfRange,
                });
                continue;
            }
            let lkey = chunk
                .regions
                .as_ref()
                .filter(|_| !framed)
                .and_then(|t| t.lkey(req.page, PAGE_SIZE));
            if let Some(lkey) = lkey {
                ops.push(PageOp {
                    offset: req.offset,
                    local: req.page,
                    lkey,
                });
                chunk.direct_reqs |= 1 << j;
                chunk.direct_groups |= 1 << group;
                chunk.group_of[j] = group;
                continue;
            }
            let frame = match pages.frame.as_mut().and_then(|f| f.take()) {
                Some(frame) => frame,
                None => match self.alloc_frame(deadline) {
                    Some(frame) => frame,
                    None => {
                        *failed |= 1 << j;
                        first_error.get_or_insert(TransportError::PoolExhausted {
                            capacity: self.pool.capacity(),
                        });
                        continue;
                    }
                },
            };
            if write {
                // SAFETY: for WRITE, `req.page` is the caller's page, borrowed
                // for the whole call; the frame is ours alone and no request
                // on it is in flight.
                unsafe { std::ptr::copy_nonoverlapping(req.page, frame.as_ptr(), PAGE_SIZE) };
            }
            ops.push(PageOp {
                offset: req.offset,
                local: frame.as_ptr(),
                lkey: conn.pool_lkey(),
            });
            chunk.frames[j] = Some(frame);
            chunk.dst[j] = req.page;
            chunk.group_of[j] = group;
        }
        if !ops.is_empty() {
            match conn.submit(write, &ops, waiter, deadline) {
                Ok(id) => chunk.ids[group] = Some(id),
                Err(err) => {
                    chunk.ids[group] = err.armed;
                    tracing::debug!(node = %conn.node_id, reason = %err.reason, "RDMA submission failed");
                    first_error.get_or_insert(TransportError::NodeDown {
                        node: conn.node_id.clone(),
                        reason: err.reason,
                    });
                }
            }
        }
        chunk.conns[group] = Some(conn);
        chunk.groups = chunk.groups.max(group + 1);
        first_error
    }

    /// After the wait: collects every batch's outcome, copies READ pages to
    /// the caller (or hands the frame back), and quarantines the frames of
    /// failed batches. A timed-out or failed batch tears its QP down; one
    /// that named the caller's pages also drains it (`fence`) first, so
    /// the device writes none of them once this returns. Except when
    /// `hedging` (the round's deadline was a hedging delay, and the read
    /// goes on at another replica): a READ batch of pool frames that is
    /// not answered is abandoned with its QP kept
    /// (`RdmaConnection::abandon_read`), so the other requests in flight on
    /// it go on. Marks in `outcome` every request that did not complete,
    /// those whose connection died first, and those not answered in time.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn settle_rdma(
        &self,
        chunk: &mut RdmaChunk,
        nodes: &[&Node],
        answered: bool,
        hedging: bool,
        write: bool,
        pages: &mut Pages<'_>,
        outcome: &mut Outcome,
    ) {
        // Per group: None = nothing posted; Some(None) = timed out. As far
        // as the round has groups (not 64 entries zeroed for one).
        // (Filled here: `from_elem` built it elsewhere and copied its 0.5
        // KiB back, a `memcpy` per round.)
        let mut codes = SmallVec::<[Option<Option<u32>>; MAX_CHUNK]>::new();
        codes.resize(chunk.groups, None);
        for g in 0..chunk.groups {
            let (Some(conn), Some(id)) = (&chunk.conns[g], chunk.ids[g].take()) else {
                continue;
            };
            let keep_qp = !answered && hedging && !write && chunk.direct_groups & (1 << g) == 0;
            let code = if answered {
                Some(conn.inflight.finish(id))
            } else if keep_qp {
                let (frames, group_of) = (&mut chunk.frames[..chunk.requests], &chunk.group_of);
                conn.abandon_read(id, || {
                    let mut taken = Vec::new();
                    for (j, slot) in frames.iter_mut().enumerate() {
                        if group_of[j] != g {
                            continue;
                        }
                        if let Some(frame) = slot.take() {
                            outcome.failed |= 1 << j;
                            outcome.timed_out |= 1 << j;
                            taken.push(frame);
                        }
                    }
                    taken
                })
            } else {
                conn.inflight.cancel(id)
            };
            codes[g] = Some(code);
            if code != Some(0) && chunk.direct_groups & (1 << g) != 0 {
                let fenced = conn.fence();
                if let Some(rdma) = &self.rdma {
                    rdma.device.registry.count_drain(fenced);
                }
            }
            let err = if keep_qp && code.is_none() {
                Some(TransportError::Timeout {
                    node: conn.node_id.clone(),
                    timeout_ms: self.config.request_timeout_ms,
                })
            } else {
                self.rdma_error(code, conn, nodes[g])
            };
            if let Some(err) = err {
                outcome.error.get_or_insert(err);
            }
        }
        let direct_reqs = std::mem::take(&mut chunk.direct_reqs);
        let (mut direct_ok, mut framed_ok) = (0u64, 0u64);
        for (j, slot) in chunk.frames[..chunk.requests].iter_mut().enumerate() {
            let frame = slot.take();
            let direct = direct_reqs & (1 << j) != 0;
            if frame.is_none() && !direct {
                continue;
            }
            let g = chunk.group_of[j];
            match codes[g] {
                Some(Some(0)) if direct => direct_ok += 1,
                Some(Some(0)) => framed_ok += 1,
                Some(Some(CODE_CONN_LOST)) => {
                    outcome.failed |= 1 << j;
                    outcome.lost |= 1 << j;
                }
                Some(None) => {
                    outcome.failed |= 1 << j;
                    outcome.timed_out |= 1 << j;
                }
                _ => outcome.failed |= 1 << j,
            }
            // A direct page needs nothing more: it completed in place, or
            // its batch failed and the QP was drained above.
            let Some(frame) = frame else {
                continue;
            };
            match codes[g] {
                Some(Some(0)) if !write => match pages.frame.as_mut() {
                    Some(direct) => **direct = Some(frame),
                    None => {
                        let dst = chunk.dst[j];
                        // SAFETY: the batch completed, so the device is done
                        // with the frame; request j's page (`dst`) is one
                        // of the caller's pages, which this call borrows
                        // exclusively.
                        unsafe { std::ptr::copy_nonoverlapping(frame.as_ptr(), dst, PAGE_SIZE) };
                    }
                },
                Some(Some(0)) | None => drop(frame),
                Some(_) => match &chunk.conns[g] {
                    Some(conn) => conn.quarantine(frame),
                    None => std::mem::forget(frame),
                },
            }
        }
        if let Some(rdma) = &self.rdma {
            let registry = &rdma.device.registry;
            if direct_ok > 0 {
                registry
                    .direct_pages
                    .fetch_add(direct_ok, Ordering::Relaxed);
            }
            if framed_ok > 0 {
                registry
                    .framed_pages
                    .fetch_add(framed_ok, Ordering::Relaxed);
            }
        }
    }

    /// The error a batch's completion code means; a failed batch's
    /// connection is torn down and forgotten, so the next request builds a
    /// new QP. Inlined for the common case (success: no error).
    #[inline]
    pub(super) fn rdma_error(
        &self,
        code: Option<u32>,
        conn: &Arc<RdmaConnection>,
        node: &Node,
    ) -> Option<TransportError> {
        if code == Some(0) {
            return None;
        }
        self.rdma_failure(code, conn, node)
    }

    #[cold]
    fn rdma_failure(
        &self,
        code: Option<u32>,
        conn: &Arc<RdmaConnection>,
        node: &Node,
    ) -> Option<TransportError> {
        let node_name = || conn.node_id.clone();
        let err = match code {
            Some(0) => return None,
            None => {
                // The QP may still move the pages: stop it before anything
                // else uses them.
                conn.mark_broken(CODE_CONN_LOST);
                TransportError::Timeout {
                    node: node_name(),
                    timeout_ms: self.config.request_timeout_ms,
                }
            }
            Some(code) => match code_status(code) {
                Some(status) => TransportError::RdmaCompletion {
                    node: node_name(),
                    status,
                },
                None if code == CODE_CONN_LOST => TransportError::NodeDown {
                    node: node_name(),
                    reason: super::tcp_chunk::CONNECTION_LOST.into(),
                },
                None => TransportError::Protocol {
                    node: node_name(),
                    detail: format!("unexpected completion code {code:#x}"),
                },
            },
        };
        self.forget(node, &super::link::Link::Rdma(Arc::clone(conn)));
        Some(err)
    }

    /// A free pool frame, waiting for one until `deadline`.
    pub(super) fn alloc_frame(&self, deadline: &Deadline) -> Option<PageFrame> {
        loop {
            if let Some(frame) = self.pool.alloc() {
                return Some(frame);
            }
            if deadline.passed() {
                return None;
            }
            std::thread::yield_now();
        }
    }
}
