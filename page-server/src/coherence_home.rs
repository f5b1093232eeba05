//! The page-server as the coherence home of its pages (docs/coherence.md).
//!
//! Each page that a node asks for coherently gets a `coherence::HomePage`
//! (allocated on first use and kept: most pages are never used coherently,
//! and an entry's sequence numbers must not restart while nodes remember
//! them). A node is a client connection that sent a coherence message: it
//! gets a `NodeId` (0..64) for the life of the connection. Each page's
//! events are fed one at a time under the page's lock, and the actions they
//! return are carried out (frames sent on the nodes' connections) before the
//! lock is released. When a node's connection ends its thread has read its
//! last message, so `on_node_lost` runs then for every page, and only after
//! that is its `NodeId` given to another connection.
//!
//! Data travels with the messages: a grant carries the home's page, a
//! write-back (or an ack reporting one) the node's, which becomes the home's
//! data only when it is the current owner's version.

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use coherence::{
    Directory, HomeAction, HomeActions, HomeConfig, HomePage, HomeStats, NodeId, ToHome, ToNode,
};
use parking_lot::Mutex;
use rdma_transport::wire::{decode_to_home, encode_refusal, encode_to_node, Header, Status};
use rdma_transport::{Page, PAGE_SIZE};

use crate::connection::Exported;
use crate::metrics::Damaged;
use crate::outbound::Outbound;
use crate::restart_grace::RestartGrace;

/// What a page-server's coherence home did so far
/// ([`crate::RunningServer::coherence_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoherenceStats {
    /// The protocol's counters, summed over every page.
    pub home: HomeStats,
    /// Pages with a directory entry (asked for coherently at least once).
    pub pages: usize,
    /// Coherence frames refused (malformed, out of range, too many nodes,
    /// from a client without an acceptable node bound) or not applied (a
    /// write-back claimed without its data, or by a non-owner: the
    /// sender's connection is closed).
    pub refused_frames: u64,
    /// Coherence frames that came over RDMA message channels.
    pub rdma_frames: u64,
    /// Coherence frames taken from connections that agreed to offset-bound
    /// sums (each frame's checksum covers its offset, body and page): a
    /// home whose nodes are all upgraded takes every frame this way.
    pub bound_frames: u64,
    /// Requests answered `Retry` because this process restarted the
    /// node's home and nodes cut off from the process before may still
    /// hold copies (`restart_grace.rs`).
    pub restart_grace_retries: u64,
}

/// The coherence directory of one page-server.
#[derive(Debug, Default)]
pub(crate) struct CoherenceHome {
    /// The longest bound on this home's silence a node may declare
    /// (`ServerConfig::node_dead_home_timeout`).
    node_bound_limit: std::time::Duration,
    /// Set when the server stops: no more waiting out silent nodes.
    stopping: Mutex<bool>,
    stopped: parking_lot::Condvar,
    pages: Mutex<HashMap<usize, Arc<Mutex<HomePage>>>>,
    nodes: Mutex<Vec<Slot>>,
    stats: Mutex<HomeStats>,
    /// Frames refused (malformed, out of range, too many nodes) or not
    /// applied (a write-back claimed without its data, or by a non-owner).
    refused: AtomicU64,
    /// Frames that came over RDMA message channels.
    rdma_frames: AtomicU64,
    /// Frames decoded with offset-bound sums.
    bound_frames: AtomicU64,
    /// Whether requests wait for nodes of an earlier process to have
    /// dropped their copies.
    restart_grace: Arc<RestartGrace>,
    restart_grace_retries: AtomicU64,
    /// Test hook: RDMA message channels take no message while set.
    held: std::sync::atomic::AtomicBool,
    hold: Mutex<()>,
    released: parking_lot::Condvar,
}

#[derive(Debug, Clone, Default)]
enum Slot {
    #[default]
    Free,
    Live(Arc<Outbound>),
    /// Its connection ended; `on_node_lost` is running for its pages.
    Leaving,
}

/// A connection's coherence state: its outbound handle and node id, once it
/// sent a coherence message.
#[derive(Debug, Default)]
pub(crate) struct CohSession {
    outbound: Option<Arc<Outbound>>,
    node: Option<NodeId>,
    /// The connection agreed to offset-bound sums (set once handshaken):
    /// its coherence frames carry them both ways.
    bound_sums: bool,
    /// The bound on the home's silence its AUTH declared: within it of
    /// the home's last message, the node has dropped its copies.
    node_bound: Option<std::time::Duration>,
}

impl CohSession {
    /// The send lock the connection's own answers must take, if other
    /// threads may write to it.
    pub(crate) fn outbound(&self) -> Option<&Arc<Outbound>> {
        self.outbound.as_ref()
    }

    /// Whether the connection is a node (it has a `NodeId`).
    pub(crate) fn is_node(&self) -> bool {
        self.node.is_some()
    }

    /// A coherence connection over RDMA: callbacks and grants go through
    /// its message channel. Keeps what the handshake agreed (`self`'s).
    pub(crate) fn over_channel(
        &self,
        stream: &TcpStream,
        channel: Arc<rdma_transport::rdma::MessageChannel>,
    ) -> std::io::Result<Self> {
        Ok(Self {
            outbound: Some(Arc::new(Outbound::over_channel(
                stream,
                channel,
                self.bound_sums,
            )?)),
            node: None,
            ..*self
        })
    }

    /// What the connection's handshake agreed: offset-bound sums (or not),
    /// and the bound on the home's silence the client declared.
    pub(crate) fn handshaken(&mut self, bound_sums: bool, node_bound: Option<std::time::Duration>) {
        self.bound_sums = bound_sums;
        self.node_bound = node_bound;
    }

    /// How long after the home's last message to this node, lost to
    /// silence or closed by the home, its pages stay its own at most
    /// (`crate::node_exit`): by then it has dropped its copies.
    pub(crate) fn silence_wait(&self) -> std::time::Duration {
        self.node_bound.map_or(
            std::time::Duration::ZERO,
            rdma_transport::dead_peer::left_for_sure_within,
        )
    }
}

impl CoherenceHome {
    /// A home whose nodes must drop their copies within `node_bound_limit`
    /// of its silence.
    pub(crate) fn new(node_bound_limit: std::time::Duration) -> Self {
        Self {
            node_bound_limit,
            restart_grace: Arc::new(RestartGrace::new(node_bound_limit)),
            ..Self::default()
        }
    }

    /// The grant pause after a restart, for whoever learns that this
    /// process had a predecessor.
    pub(crate) fn restart_grace(&self) -> Arc<RestartGrace> {
        Arc::clone(&self.restart_grace)
    }

    /// The longest bound on this home's silence a node may declare.
    pub(crate) fn node_bound_limit(&self) -> std::time::Duration {
        self.node_bound_limit
    }

    /// Waits until `deadline`, or until the server stops.
    pub(crate) fn wait_until(&self, deadline: std::time::Instant) {
        let mut stopping = self.stopping.lock();
        while !*stopping {
            if self.stopped.wait_until(&mut stopping, deadline).timed_out() {
                return;
            }
        }
    }

    /// Whether the server stops.
    pub(crate) fn is_stopping(&self) -> bool {
        *self.stopping.lock()
    }

    /// The server stops: waits of [`Self::wait_until`] end.
    pub(crate) fn stop_waiting(&self) {
        *self.stopping.lock() = true;
        self.stopped.notify_all();
    }

    /// The home's counters now.
    pub(crate) fn snapshot(&self) -> CoherenceStats {
        CoherenceStats {
            home: *self.stats.lock(),
            pages: self.pages.lock().len(),
            refused_frames: self.refused.load(Ordering::Relaxed),
            rdma_frames: self.rdma_frames.load(Ordering::Relaxed),
            bound_frames: self.bound_frames.load(Ordering::Relaxed),
            restart_grace_retries: self.restart_grace_retries.load(Ordering::Relaxed),
        }
    }

    fn register(&self, outbound: &Arc<Outbound>) -> Option<NodeId> {
        let mut nodes = self.nodes.lock();
        if nodes.is_empty() {
            nodes.resize(usize::from(NodeId::MAX_NODES), Slot::Free);
        }
        let free = nodes.iter().position(|s| matches!(s, Slot::Free))?;
        nodes[free] = Slot::Live(Arc::clone(outbound));
        NodeId::new(u8::try_from(free).ok()?)
    }

    fn outbound_of(&self, node: NodeId) -> Option<Arc<Outbound>> {
        match self.nodes.lock().get(usize::from(node.get())) {
            Some(Slot::Live(o)) => Some(Arc::clone(o)),
            _ => None,
        }
    }

    fn entry(&self, off: usize) -> Arc<Mutex<HomePage>> {
        Arc::clone(
            self.pages
                .lock()
                .entry(off)
                .or_insert_with(|| Arc::new(Mutex::new(HomePage::new(HomeConfig::default())))),
        )
    }

    /// Test hook: while `held`, the RDMA message channels take no message
    /// (their nodes' messages wait in the channels for credits).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn hold_channels(&self, held: bool) {
        let _gate = self.hold.lock();
        self.held.store(held, Ordering::SeqCst);
        self.released.notify_all();
    }

    /// Test hook: closes every node's connection from this thread, as a
    /// coherence send that stalled on another thread does. Returns how
    /// many.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn close_nodes(&self) -> usize {
        let nodes = self.nodes.lock();
        let mut n = 0;
        for slot in nodes.iter() {
            if let Slot::Live(outbound) = slot {
                outbound.close_from_home();
                n += 1;
            }
        }
        n
    }

    /// Returns once the channels are not held (at once, but in tests).
    pub(crate) fn wait_while_held(&self) {
        if !self.held.load(Ordering::Acquire) {
            return;
        }
        let mut gate = self.hold.lock();
        while self.held.load(Ordering::Acquire) {
            self.released.wait(&mut gate);
        }
    }

    pub(crate) fn count_rdma_frame(&self) {
        self.rdma_frames.fetch_add(1, Ordering::Relaxed);
    }

    fn count_refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }
}

/// Serves one COH_TO_HOME frame from the connection of `stream`. Never
/// fails: a frame that cannot be served is refused (a COH_TO_NODE with an
/// error status, the connection stays) or, when it would corrupt the
/// directory, not applied, and the connection is closed (the node is lost).
pub(crate) fn on_frame(
    ex: &Exported,
    header: &Header,
    payload: &[u8],
    stream: &TcpStream,
    session: &mut CohSession,
) {
    let home = &ex.coherence;
    let outbound = match &session.outbound {
        Some(o) => Arc::clone(o),
        None => match Outbound::new(stream, session.bound_sums) {
            Ok(o) => {
                let o = Arc::new(o);
                session.outbound = Some(Arc::clone(&o));
                o
            }
            Err(err) => {
                tracing::warn!(%err, "cannot serve coherence on this connection");
                return;
            }
        },
    };
    let refuse = |status: Status| {
        home.count_refused();
        let frame = encode_refusal(header.offset, status, session.bound_sums);
        if let Err(err) = outbound.send(&[&frame]) {
            tracing::debug!(%err, "coherence refusal not sent");
        }
    };
    let frame = match decode_to_home(header, payload, session.bound_sums) {
        Ok(f) => {
            if session.bound_sums {
                home.bound_frames.fetch_add(1, Ordering::Relaxed);
            }
            f
        }
        Err(err) => {
            if err == rdma_transport::wire::CohDecodeError::Checksum {
                let peer = stream.peer_addr().ok().map(|a| a.ip());
                ex.damaged_on_the_way(Damaged::CoherenceFrame, peer, header.offset);
            } else {
                tracing::debug!(offset = header.offset, %err, "malformed coherence message");
            }
            return refuse(Status::BadLength);
        }
    };
    let off = match ex.check_page(frame.offset) {
        Ok(off) => off,
        Err(status) => return refuse(status),
    };
    let node = match session.node {
        Some(n) => n,
        // Only a node known to drop its copies within the wait for a silent
        // node may hold any (docs/coherence.md, "Failures").
        None if !session
            .node_bound
            .is_some_and(|b| b <= home.node_bound_limit) =>
        {
            tracing::debug!(
                node_bound_ms = session.node_bound.map(|b| b.as_millis() as u64),
                limit_ms = home.node_bound_limit.as_millis() as u64,
                "coherence request refused: no bound on the home's silence declared, or a longer one"
            );
            return refuse(Status::NodeBound);
        }
        None => match home.register(&outbound) {
            Some(n) => {
                tracing::debug!(node = n.get(), "coherence node joined");
                session.node = Some(n);
                n
            }
            None => {
                tracing::warn!(
                    "coherence request refused: {} nodes already",
                    NodeId::MAX_NODES
                );
                return refuse(Status::Internal);
            }
        },
    };
    if let ToHome::ReadReq { req } | ToHome::WriteReq { req, .. } = frame.msg {
        if home.restart_grace.holds() {
            // Asked again after the node's back-off; no page state is
            // touched before the grace is over.
            home.restart_grace_retries.fetch_add(1, Ordering::Relaxed);
            return send(ex, off, node, &ToNode::Retry { req });
        }
        if ex.self_fence.is_fenced() {
            // This process fenced itself (a stall, or its lease fence: it
            // may have been replaced): nothing is granted until the
            // coordinator says it was not (frames on TCP waited in
            // `connection.rs` already; these came over an RDMA message
            // channel).
            return send(ex, off, node, &ToNode::Retry { req });
        }
    }
    let entry = home.entry(off);
    let mut page = entry.lock();
    if let Some(version) = frame.msg.written_back() {
        let takes = version == page.version() && version != page.stored_version();
        if takes {
            let owner =
                matches!(page.directory(), Directory::Modified { owner, .. } if owner == node);
            let stored = match frame.page {
                Some(data) if owner => ex
                    .guard
                    .client_write(&ex.region, &ex.sums, off, data, None)
                    .is_ok(),
                _ => false,
            };
            if !stored {
                // The protocol would record the version as the home's data:
                // without that data (or from a node that does not own it),
                // the home would serve an older page as the newer version.
                // Dropping the message alone could leave an ack awaited
                // forever: the node is closed instead (lost: a page it owns
                // and has not written back is marked lost).
                tracing::warn!(
                    node = node.get(),
                    off,
                    version,
                    owner,
                    with_page = frame.page.is_some(),
                    "write-back not accepted; closing the node's connection"
                );
                home.count_refused();
                outbound.close_from_home();
                return;
            }
        }
    }
    let actions = {
        let mut stats = home.stats.lock();
        page.on_message(node, frame.msg, &mut stats)
    };
    carry_out(ex, off, actions);
}

/// Sends what a transition of the page at `off` returned (its lock held).
fn carry_out(ex: &Exported, off: usize, actions: HomeActions) {
    for action in actions.iter() {
        match action {
            HomeAction::Send { to, msg } => send(ex, off, to, &msg),
            HomeAction::SendAll { to, msg } => {
                for node in to.iter() {
                    send(ex, off, node, &msg);
                }
            }
        }
    }
}

fn send(ex: &Exported, off: usize, to: NodeId, msg: &ToNode) {
    let Some(outbound) = ex.coherence.outbound_of(to) else {
        // Lost: its `on_node_lost` is on its way or done.
        return;
    };
    let mut data: Option<Box<Page>> = None;
    if matches!(msg, ToNode::Grant { .. }) && outbound.carries_pages() {
        let mut page: Box<Page> = Box::new([0u8; PAGE_SIZE]);
        if let Err(err) = ex.region.read_at(off, &mut page[..]) {
            tracing::error!(off, %err, "cannot read a granted page");
            return;
        }
        data = Some(page);
    }
    let frame = encode_to_node(off as u64, msg, data.as_deref(), outbound.bound_sums());
    if let Err(err) = outbound.send(&[&frame]) {
        if outbound.closed_by_home() {
            // Already closed: the node is declared lost once it has
            // dropped its copies, and its awaited acks count then.
            tracing::debug!(
                node = to.get(),
                "coherence message to a node being closed not sent"
            );
            return;
        }
        // Gone, or took no data for the stall timeout: part of the frame
        // may be out, and a callback that never arrives would be waited
        // for forever. Close the connection: its thread declares the node
        // lost (an awaited ack then counts as received) once the node has
        // closed its side, or surely dropped its copies.
        tracing::warn!(node = to.get(), %err, "coherence message not sent; closing the node's connection");
        outbound.close_from_home();
    }
}

/// The connection of `session` ended (its thread read its last message):
/// its node is lost for every page, then its id is free again.
pub(crate) fn disconnect(ex: &Exported, session: &mut CohSession) {
    session.outbound = None;
    let Some(node) = session.node.take() else {
        return;
    };
    let home = &ex.coherence;
    if let Some(slot) = home.nodes.lock().get_mut(usize::from(node.get())) {
        *slot = Slot::Leaving;
    }
    let entries: Vec<(usize, Arc<Mutex<HomePage>>)> = home
        .pages
        .lock()
        .iter()
        .map(|(off, e)| (*off, Arc::clone(e)))
        .collect();
    let mut lost = 0u64;
    for (off, entry) in entries {
        let mut page = entry.lock();
        let was_lost = page.is_lost();
        let actions = {
            let mut stats = home.stats.lock();
            page.on_node_lost(node, &mut stats)
        };
        lost += u64::from(!was_lost && page.is_lost());
        carry_out(ex, off, actions);
    }
    tracing::debug!(node = node.get(), pages_lost = lost, "coherence node left");
    if let Some(slot) = home.nodes.lock().get_mut(usize::from(node.get())) {
        *slot = Slot::Free;
    }
}
