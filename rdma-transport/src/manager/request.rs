//! One call's requests, end to end: resolve every address, group by node,
//! submit each group (TCP or RDMA), wait, and settle; a chunk whose
//! connection died before answering runs once more on a new one.

use std::time::{Duration, Instant};

use super::epoch::Fenced;
use super::link::Link;
use super::rdma_batch::{Pages, RdmaChunk};
use super::tcp_chunk::{self, Sent, TcpChunk};
use super::{link, Inner, Node};
use crate::config::PollMode;
use crate::error::TransportError;
use crate::page::is_page_aligned;
use crate::pool::PageFrame;
use crate::tcp::{Request, Waiter, MAX_CHUNK};
use crate::wire::Opcode;

impl Inner {
    /// Runs `count` requests of one kind; page i is at `pages + i * 4096`.
    /// `frame` (`read_frame` only, `count` 1): `pages` is that pool frame.
    pub(super) fn run(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
        count: usize,
        mut frame: Option<&mut Option<PageFrame>>,
    ) -> Result<(), TransportError> {
        let started = Instant::now();
        // `read_frame` is not retried here: its caller (the fault handler)
        // retries on its own terms.
        let retry = frame.is_none();
        if count == 1 {
            match self.run_single_rdma(opcode, gpas[0], pages, &mut frame) {
                Some(Err(e)) if retry && connection_lost(&e) => {
                    // Served again below, on a new connection, within what
                    // is left of the same deadline.
                    let deadline = started + self.config.request_timeout();
                    let pages = Pages {
                        base: pages,
                        frame: None,
                    };
                    return self.run_chunk(opcode, gpas, pages, deadline);
                }
                Some(result) => return result,
                None => {}
            }
        }
        let mut first_error = None;
        for chunk_start in (0..count).step_by(MAX_CHUNK) {
            let chunk_end = (chunk_start + MAX_CHUNK).min(count);
            let gpas = &gpas[chunk_start..chunk_end];
            // SAFETY: `pages` covers `count` pages (checked by the callers), so
            // chunk_start is in bounds.
            let chunk_pages = unsafe { pages.add(chunk_start * crate::page::PAGE_SIZE) };
            let deadline = Instant::now() + self.config.request_timeout();
            let pages = Pages {
                base: chunk_pages,
                frame: frame.take(),
            };
            let mut result = self.run_chunk(opcode, gpas, pages, deadline);
            if matches!(&result, Err(e) if retry && connection_lost(e)) {
                // A connection that died before answering (e.g. the server
                // closed it while idle): page reads and writes are
                // idempotent, so the chunk runs once more on a new one.
                let pages = Pages {
                    base: chunk_pages,
                    frame: None,
                };
                result = self.run_chunk(opcode, gpas, pages, deadline);
            }
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn run_chunk(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        mut chunk_pages: Pages<'_>,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let pages = chunk_pages.base;
        let n = gpas.len();
        let mut state = self.state.load();
        // Resolve every address first; refresh the map once on a miss.
        let mut loc = [(0usize, 0u64); MAX_CHUNK];
        let mut valid_epochs = [0u64; MAX_CHUNK];
        for (i, &gpa) in gpas.iter().enumerate() {
            if !is_page_aligned(gpa) {
                return Err(TransportError::Unaligned { gpa });
            }
            let found = match state.map.lookup(gpa) {
                Some(l) => l,
                None => {
                    self.refresh_on_miss(deadline);
                    state = self.state.load();
                    state
                        .map
                        .lookup(gpa)
                        .ok_or(TransportError::UnknownGpa { gpa })?
                }
            };
            loc[i] = (found.node_index, found.remote_offset);
            valid_epochs[i] = found.valid_epoch;
        }
        // Group by node, submit each group with one writev, wait for all.
        let rdma_deadline = crate::rdma::Deadline::at(deadline);
        // Declared before the chunks: their guards cancel every request
        // that refers to it before it goes, even when unwinding.
        let waiter = Waiter::new();
        let mut tcp = TcpChunk::new();
        let mut rdma = RdmaChunk::new();
        let mut group_nodes = [usize::MAX; MAX_CHUNK];
        let mut first_error: Option<TransportError> = None;
        let mut done = [false; MAX_CHUNK];
        let mut group_count = 0;
        for i in 0..n {
            if done[i] {
                continue;
            }
            let node_index = loc[i].0;
            let node = &state.nodes[node_index];
            let mut reqs = [Request {
                offset: 0,
                page: std::ptr::null_mut(),
            }; MAX_CHUNK];
            let mut members = [0usize; MAX_CHUNK];
            let mut m = 0;
            for j in i..n {
                if !done[j] && loc[j].0 == node_index {
                    done[j] = true;
                    // SAFETY: j < n and the caller's buffer holds n pages.
                    let page = unsafe { pages.add(j * crate::page::PAGE_SIZE) };
                    reqs[m] = Request {
                        offset: loc[j].1,
                        page,
                    };
                    members[m] = j;
                    m += 1;
                }
            }
            let mut fenced = [Fenced {
                gpa: 0,
                remote_offset: 0,
                valid_epoch: 0,
            }; MAX_CHUNK];
            for (f, &j) in fenced.iter_mut().zip(&members[..m]) {
                *f = Fenced {
                    gpa: gpas[j],
                    remote_offset: loc[j].1,
                    valid_epoch: valid_epochs[j],
                };
            }
            // Nothing goes to a server that is not in the epoch the
            // group's ranges are valid in (see `epoch.rs`).
            let link = self.connection(node, deadline).and_then(|link| {
                self.check_epochs(node, link.epoch(), &fenced[..m], deadline)
                    .map(|()| link)
            });
            let conn = match link {
                Ok(Link::Tcp(c)) => c,
                Ok(Link::Rdma(c)) => {
                    let group = group_count;
                    group_count += 1;
                    group_nodes[group] = node_index;
                    let write = opcode == Opcode::Write;
                    let (reqs, members) = (&reqs[..m], &members[..m]);
                    if let Some(e) = self.submit_rdma(
                        &mut rdma,
                        group,
                        c,
                        write,
                        reqs,
                        members,
                        &mut chunk_pages,
                        &waiter,
                        &rdma_deadline,
                    ) {
                        first_error.get_or_insert(e);
                    }
                    continue;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            let group = group_count;
            group_count += 1;
            group_nodes[group] = node_index;
            let mut ids = [0u64; MAX_CHUNK];
            let result = conn.submit(opcode, &reqs[..m], &mut ids, &waiter, deadline);
            let armed = match &result {
                Ok(()) => m,
                Err((armed, _)) => *armed,
            };
            for (&id, &j) in ids[..armed].iter().zip(&members[..m]) {
                tcp.sent[tcp.sent_count] = Sent {
                    group,
                    id,
                    gpa: gpas[j],
                };
                tcp.sent_count += 1;
            }
            if let Err((_, err)) = result {
                tracing::debug!(node = %node.id, %err, "submitting to node failed");
                first_error.get_or_insert(TransportError::NodeDown {
                    node: node.id.clone(),
                    reason: err.to_string(),
                });
            }
            tcp.groups[group] = Some(conn);
        }
        #[cfg(any(test, feature = "test-hooks"))]
        super::unwind_hook::maybe_panic_after_submit();
        let spin = match self.config.poll_mode {
            PollMode::Busy => Duration::from_micros(self.config.wait_spin_us),
            PollMode::Event => Duration::ZERO,
        };
        let all_answered = if rdma.groups == 0 {
            tcp.sent_count > 0
                && crate::tcp::wait(&waiter, &tcp.groups[..group_count], spin, deadline)
        } else if tcp.sent_count == 0 {
            crate::rdma::wait(&waiter, &rdma.conns[..rdma.groups], spin, &rdma_deadline)
        } else {
            link::wait_mixed(
                &waiter,
                &tcp.groups[..group_count],
                &rdma.conns[..rdma.groups],
                deadline,
            )
        };
        let sent_count = std::mem::take(&mut tcp.sent_count);
        for s in &tcp.sent[..sent_count] {
            let Some(conn) = tcp.groups[s.group].as_ref() else {
                continue;
            };
            let code = if all_answered {
                Some(conn.inflight.finish(s.id))
            } else {
                conn.inflight.cancel(s.id)
            };
            let node = &state.nodes[group_nodes[s.group]];
            let write = opcode == Opcode::Write;
            if let Some(e) = self.code_to_error(code, conn, node, *s, write) {
                first_error.get_or_insert(e);
            }
        }
        if rdma.groups > 0 {
            let mut nodes: [&Node; MAX_CHUNK] = [&state.nodes[0]; MAX_CHUNK];
            for (g, &node_index) in group_nodes[..rdma.groups].iter().enumerate() {
                if let Some(node) = state.nodes.get(node_index) {
                    nodes[g] = node;
                }
            }
            let write = opcode == Opcode::Write;
            if let Some(e) =
                self.settle_rdma(&mut rdma, &nodes, all_answered, write, &mut chunk_pages)
            {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The request failed because its connection died before it was answered
/// (EOF or a reset), not because the node refused it or timed out.
fn connection_lost(err: &TransportError) -> bool {
    matches!(err, TransportError::NodeDown { reason, .. } if reason == tcp_chunk::CONNECTION_LOST)
}
