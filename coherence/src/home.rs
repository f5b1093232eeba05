//! The home's side: one page's directory entry and its transitions.
//!
//! The page-server that owns a page's range is its home. It keeps, per page,
//! who holds it (nobody, a set of read-only holders, or one owner that may
//! write), the data versions, and at most one transaction in progress (a
//! request waiting for acknowledgements). Requests that arrive meanwhile
//! wait in a bounded queue; when the queue is full the requester is told to
//! retry. See `docs/coherence.md`.

use crate::list::List;
use crate::messages::{Access, Mode, NodeId, NodeSet, ReqId, Seq, ToHome, ToNode, Version};

/// The most requests a page's queue can hold (Popcorn merges up to 8
/// faults on a page too). [`HomeConfig::queue_limit`] may be lower.
pub const QUEUE_MAX: usize = 8;

/// The most messages one transition sends: one grant for the transaction
/// that completes, one per queued request, one callback round, one retry.
pub const HOME_ACTIONS_MAX: usize = QUEUE_MAX + 4;

/// What a home transition asks its caller to send, in order.
pub type HomeActions = List<HomeAction, HOME_ACTIONS_MAX>;

/// One message to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HomeAction {
    /// Send `msg` to one node.
    Send {
        /// The destination.
        to: NodeId,
        /// The message.
        msg: ToNode,
    },
    /// Send the same callback to every node of `to` (an invalidation round).
    SendAll {
        /// The destinations.
        to: NodeSet,
        /// The message.
        msg: ToNode,
    },
}

/// Who holds the page, as the home sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Directory {
    /// No node holds a copy; the home's data is the latest.
    Invalid,
    /// These nodes may hold read-only copies of the home's data. A node may
    /// have dropped its copy silently; it is removed when it acks an
    /// invalidation.
    Shared(NodeSet),
    /// This node may write the page; the home's data may be older.
    Modified {
        /// The owner.
        owner: NodeId,
        /// The sequence number of its grant: callbacks to the owner carry
        /// it, so an owner whose grant is still on the way waits for it
        /// (and uses it) before it answers.
        grant: Seq,
    },
}

/// Settings of a page's directory entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HomeConfig {
    queue_limit: u8,
    #[cfg(test)]
    pub(crate) mutation: Option<HomeMutation>,
}

impl HomeConfig {
    /// `queue_limit` requests may wait while a transaction is in progress
    /// (clamped to 1..=[`QUEUE_MAX`]); more are answered with
    /// [`ToNode::Retry`].
    pub fn new(queue_limit: usize) -> HomeConfig {
        HomeConfig {
            queue_limit: queue_limit.clamp(1, QUEUE_MAX) as u8,
            #[cfg(test)]
            mutation: None,
        }
    }

    /// The queue limit in use.
    pub fn queue_limit(&self) -> usize {
        usize::from(self.queue_limit)
    }
}

impl Default for HomeConfig {
    fn default() -> Self {
        HomeConfig::new(QUEUE_MAX)
    }
}

/// Deliberate bugs, to show that the model checker finds them.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum HomeMutation {
    /// Grant after the first acknowledgement instead of the last.
    GrantBeforeAllAcks,
    /// A lost owner's page is not marked lost: the old data is served.
    ForgetLostOwner,
    /// An ack from a lost node is not counted as received.
    WaitForLostNodes,
    /// A node lost while turned away keeps its place in the queue.
    KeepLostNodesPlace,
}

/// Counters of one home (a page-server), shared by all its pages. Not part
/// of the protocol's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HomeStats {
    /// Shared copies granted.
    pub shared_grants: u64,
    /// Exclusive ownerships granted.
    pub exclusive_grants: u64,
    /// Write requests from a node that had a shared copy.
    pub upgrades: u64,
    /// Invalidate rounds started (one per write that had other holders).
    pub invalidation_rounds: u64,
    /// Invalidate messages sent.
    pub invalidations_sent: u64,
    /// Downgrades sent (a read of a page modified elsewhere).
    pub downgrades_sent: u64,
    /// Requests queued behind a transaction in progress.
    pub queued: u64,
    /// Requests answered with Retry (queue full).
    pub retries: u64,
    /// Requests answered with Lost.
    pub lost_answers: u64,
    /// Pages marked lost (an owner died before writing its data back).
    pub pages_lost: u64,
    /// Write-backs whose data became the home's data.
    pub write_backs: u64,
    /// Ignored: a request repeated while it was being served or queued.
    pub duplicate_requests: u64,
    /// Ignored: an ack of no callback in progress (late, repeated, or from
    /// a node not asked).
    pub stale_acks: u64,
    /// Ignored: a write-back of an older version or from a non-owner.
    pub stale_write_backs: u64,
    /// Messages that did not fit in the action list (never expected).
    pub actions_overflow: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Pending {
    from: NodeId,
    req: ReqId,
    access: Access,
}

/// A request being served: waiting for the acks of one callback round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Txn {
    request: Pending,
    /// The callback round's sequence number; acks must carry it.
    seq: Seq,
    /// Nodes whose ack is still awaited.
    waiting: NodeSet,
    /// The requester died meanwhile: finish the round, grant nothing.
    requester_lost: bool,
}

/// One page's directory entry at its home.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HomePage {
    dir: Directory,
    txn: Option<Txn>,
    queue: List<Pending, QUEUE_MAX>,
    /// Nodes turned away (Retry) whose request has not got in since: each
    /// has a place in the queue kept for it, so that a node waiting out its
    /// back-off does not lose every freed place to nodes that ask first.
    turned_away: NodeSet,
    /// The last sequence number used by a grant or a callback round.
    seq: Seq,
    /// The version of the newest exclusive grant (0: never granted).
    version: Version,
    /// The version of the data at the home.
    stored_version: Version,
    lost: bool,
    config: HomeConfig,
}

impl HomePage {
    /// A page nobody holds, with the home's data (version 0) the latest.
    pub fn new(config: HomeConfig) -> HomePage {
        HomePage {
            dir: Directory::Invalid,
            txn: None,
            queue: List::new(),
            turned_away: NodeSet::EMPTY,
            seq: 0,
            version: 0,
            stored_version: 0,
            lost: false,
            config,
        }
    }

    /// Who holds the page (during a transaction: who may still hold it).
    pub fn directory(&self) -> Directory {
        self.dir
    }

    /// Whether the page's latest writes were lost with a node.
    pub fn is_lost(&self) -> bool {
        self.lost
    }

    /// Whether a transaction is in progress (acks awaited).
    pub fn is_busy(&self) -> bool {
        self.txn.is_some()
    }

    /// Nodes whose acknowledgement is awaited.
    pub fn awaiting(&self) -> NodeSet {
        self.txn.map_or(NodeSet::EMPTY, |t| t.waiting)
    }

    /// How many requests wait behind the transaction in progress.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Nodes turned away whose request has not got in since (each has a
    /// place in the queue kept for it).
    pub fn turned_away(&self) -> NodeSet {
        self.turned_away
    }

    /// The last sequence number used by a grant or a callback round.
    pub fn seq(&self) -> Seq {
        self.seq
    }

    /// The version of the data at the home.
    pub fn stored_version(&self) -> Version {
        self.stored_version
    }

    /// The version of the newest exclusive grant.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The page was re-initialised (for example restored, or overwritten
    /// whole by the hypervisor): serve the home's data again. Refused
    /// (`false`) unless the page is lost and idle.
    pub fn clear_lost(&mut self) -> bool {
        if !self.lost || self.txn.is_some() {
            return false;
        }
        self.lost = false;
        true
    }

    /// A message from `from`. Returns what to send. Never fails: a message
    /// that does not fit the state (late, repeated, from a node not asked)
    /// is ignored and counted in `stats`.
    pub fn on_message(&mut self, from: NodeId, msg: ToHome, stats: &mut HomeStats) -> HomeActions {
        let mut out = Out {
            actions: HomeActions::new(),
            stats,
        };
        match msg {
            ToHome::ReadReq { req } => self.request(from, req, Access::Read, &mut out),
            ToHome::WriteReq { req, upgrade } => {
                if upgrade {
                    out.stats.upgrades += 1;
                }
                self.request(from, req, Access::Write, &mut out);
            }
            ToHome::InvalidateAck { seq, written_back } => {
                self.ack(from, seq, written_back, false, &mut out);
            }
            ToHome::DowngradeAck {
                seq,
                written_back,
                kept,
            } => self.ack(from, seq, written_back, kept, &mut out),
            ToHome::WriteBack { version } => self.write_back(from, version, &mut out),
        }
        out.actions
    }

    /// `node` died (its connection is gone; no message from it will follow).
    /// Its shared copy is forgotten; if it owned the page and had not written
    /// it back, the page is lost; an ack awaited from it counts as received;
    /// its queued request is dropped.
    pub fn on_node_lost(&mut self, node: NodeId, stats: &mut HomeStats) -> HomeActions {
        let mut out = Out {
            actions: HomeActions::new(),
            stats,
        };
        self.queue.retain(|p| p.from != node);
        if !self.keep_lost_nodes_place() {
            self.turned_away = self.turned_away.without(node);
        }
        match self.dir {
            Directory::Modified { owner, .. } if owner == node => {
                if self.stored_version != self.version && !self.forget_lost_owner() {
                    self.lost = true;
                    out.stats.pages_lost += 1;
                }
                self.dir = Directory::Invalid;
            }
            Directory::Shared(holders) => self.set_holders(holders.without(node)),
            _ => {}
        }
        let wait_for_lost_nodes = self.wait_for_lost_nodes();
        if let Some(txn) = &mut self.txn {
            if txn.request.from == node {
                txn.requester_lost = true;
            }
            if txn.waiting.contains(node) && !wait_for_lost_nodes {
                txn.waiting = txn.waiting.without(node);
                if txn.waiting.is_empty() {
                    self.complete(&mut out);
                }
            }
        }
        out.actions
    }

    fn request(&mut self, from: NodeId, req: ReqId, access: Access, out: &mut Out<'_>) {
        let pending = Pending { from, req, access };
        let Some(txn) = self.txn else {
            // No transaction in progress, so nothing is queued either.
            self.turned_away = self.turned_away.without(from);
            self.start(pending, out);
            return;
        };
        if txn.request.from == from && txn.request.req == req {
            out.stats.duplicate_requests += 1;
        } else if let Some(queued) = self.queue.find_mut(|p| p.from == from) {
            // A node has one request per page outstanding: the newer one wins.
            if queued.req == req {
                out.stats.duplicate_requests += 1;
            }
            *queued = pending;
        } else if self.has_place_for(from) && self.queue.push(pending) {
            self.turned_away = self.turned_away.without(from);
            out.stats.queued += 1;
        } else {
            self.turned_away = self.turned_away.with(from);
            out.stats.retries += 1;
            out.send(from, ToNode::Retry { req });
        }
    }

    /// Whether the queue takes a request from `from`: a place is kept for
    /// each node turned away (up to the queue's length), which only it
    /// may take.
    fn has_place_for(&self, from: NodeId) -> bool {
        let free = self.config.queue_limit().saturating_sub(self.queue.len());
        let kept = self.turned_away.without(from).len() as usize;
        free > 0 && (self.turned_away.contains(from) || free > kept)
    }

    /// Serves `p`: answers at once, or starts a callback round.
    fn start(&mut self, p: Pending, out: &mut Out<'_>) {
        if self.lost {
            out.stats.lost_answers += 1;
            out.send(p.from, ToNode::Lost { req: p.req });
            return;
        }
        let callback = match (p.access, self.dir) {
            (Access::Read, Directory::Invalid | Directory::Shared(_)) => {
                self.grant_shared(p, out);
                return;
            }
            (Access::Read, Directory::Modified { owner, grant }) => {
                // Also when the owner is the requester: it evicted its copy
                // and its write-back message is still on the way; its ack
                // says what it wrote back.
                self.seq += 1;
                out.stats.downgrades_sent += 1;
                out.send(
                    owner,
                    ToNode::Downgrade {
                        seq: self.seq,
                        grant,
                    },
                );
                NodeSet::one(owner)
            }
            (Access::Write, Directory::Invalid) => {
                self.grant_exclusive(p, out);
                return;
            }
            (Access::Write, Directory::Shared(holders)) => {
                let others = holders.without(p.from);
                if others.is_empty() {
                    self.grant_exclusive(p, out);
                    return;
                }
                self.seq += 1;
                out.stats.invalidation_rounds += 1;
                out.stats.invalidations_sent += u64::from(others.len());
                out.send_all(
                    others,
                    ToNode::Invalidate {
                        seq: self.seq,
                        grant: None,
                    },
                );
                others
            }
            (Access::Write, Directory::Modified { owner, grant }) => {
                self.seq += 1;
                out.stats.invalidation_rounds += 1;
                out.stats.invalidations_sent += 1;
                out.send(
                    owner,
                    ToNode::Invalidate {
                        seq: self.seq,
                        grant: Some(grant),
                    },
                );
                NodeSet::one(owner)
            }
        };
        self.txn = Some(Txn {
            request: p,
            seq: self.seq,
            waiting: callback,
            requester_lost: false,
        });
    }

    fn grant_shared(&mut self, p: Pending, out: &mut Out<'_>) {
        let holders = match self.dir {
            Directory::Shared(holders) => holders,
            _ => NodeSet::EMPTY,
        };
        self.dir = Directory::Shared(holders.with(p.from));
        self.seq += 1;
        out.stats.shared_grants += 1;
        out.send(
            p.from,
            ToNode::Grant {
                req: p.req,
                seq: self.seq,
                mode: Mode::Shared,
                version: self.stored_version,
                data_version: self.stored_version,
            },
        );
    }

    fn grant_exclusive(&mut self, p: Pending, out: &mut Out<'_>) {
        self.seq += 1;
        self.dir = Directory::Modified {
            owner: p.from,
            grant: self.seq,
        };
        self.version += 1;
        out.stats.exclusive_grants += 1;
        out.send(
            p.from,
            ToNode::Grant {
                req: p.req,
                seq: self.seq,
                mode: Mode::Exclusive,
                version: self.version,
                data_version: self.stored_version,
            },
        );
    }

    /// Data of `version` is at the home (written before the message that
    /// says so was sent). Only the current owner's version counts: older
    /// versions are already superseded.
    fn note_written_back(&mut self, version: Option<Version>, out: &mut Out<'_>) -> bool {
        match version {
            Some(v) if v == self.version && v != self.stored_version => {
                self.stored_version = v;
                out.stats.write_backs += 1;
                true
            }
            _ => false,
        }
    }

    fn ack(
        &mut self,
        from: NodeId,
        seq: Seq,
        written_back: Option<Version>,
        kept: bool,
        out: &mut Out<'_>,
    ) {
        // The data was written back before the ack was sent, whether or not
        // the ack itself is current.
        self.note_written_back(written_back, out);
        let Some(txn) = &mut self.txn else {
            out.stats.stale_acks += 1;
            return;
        };
        if txn.seq != seq || !txn.waiting.contains(from) {
            out.stats.stale_acks += 1;
            return;
        }
        txn.waiting = txn.waiting.without(from);
        let done = txn.waiting.is_empty() || self.grant_before_all_acks();
        match self.dir {
            // The owner answered: if it never got (or never used) its grant,
            // the home's data is still the latest; otherwise it wrote back.
            Directory::Modified { owner, .. } if owner == from => {
                self.dir = if kept {
                    Directory::Shared(NodeSet::one(from))
                } else {
                    Directory::Invalid
                };
            }
            Directory::Shared(holders) if !kept => self.set_holders(holders.without(from)),
            _ => {}
        }
        if done {
            self.complete(out);
        }
    }

    fn write_back(&mut self, from: NodeId, version: Version, out: &mut Out<'_>) {
        let current = self.note_written_back(Some(version), out);
        let owner = matches!(self.dir, Directory::Modified { owner, .. } if owner == from);
        if owner && version == self.version {
            if self.txn.is_none() {
                // An eviction: nobody holds the page now.
                self.dir = Directory::Invalid;
            }
            // Otherwise a callback to this owner is in progress: its ack
            // (which reports this write-back too) finishes it.
        } else if !current {
            out.stats.stale_write_backs += 1;
        }
    }

    /// The callback round is over: answer its request, then serve the queue
    /// until a request needs a new round.
    fn complete(&mut self, out: &mut Out<'_>) {
        let Some(txn) = self.txn.take() else {
            return;
        };
        if txn.requester_lost {
            // Nothing to grant.
        } else if self.grant_before_all_acks() && txn.request.access == Access::Write && !self.lost
        {
            self.grant_exclusive(txn.request, out);
        } else {
            self.start(txn.request, out);
        }
        while self.txn.is_none() {
            let Some(next) = self.queue.pop_front() else {
                break;
            };
            self.start(next, out);
        }
    }

    fn set_holders(&mut self, holders: NodeSet) {
        self.dir = if holders.is_empty() {
            Directory::Invalid
        } else {
            Directory::Shared(holders)
        };
    }

    #[cfg(test)]
    fn grant_before_all_acks(&self) -> bool {
        self.config.mutation == Some(HomeMutation::GrantBeforeAllAcks)
    }
    #[cfg(not(test))]
    fn grant_before_all_acks(&self) -> bool {
        false
    }
    #[cfg(test)]
    fn forget_lost_owner(&self) -> bool {
        self.config.mutation == Some(HomeMutation::ForgetLostOwner)
    }
    #[cfg(not(test))]
    fn forget_lost_owner(&self) -> bool {
        false
    }
    #[cfg(test)]
    fn wait_for_lost_nodes(&self) -> bool {
        self.config.mutation == Some(HomeMutation::WaitForLostNodes)
    }
    #[cfg(not(test))]
    fn wait_for_lost_nodes(&self) -> bool {
        false
    }
    #[cfg(test)]
    fn keep_lost_nodes_place(&self) -> bool {
        self.config.mutation == Some(HomeMutation::KeepLostNodesPlace)
    }
    #[cfg(not(test))]
    fn keep_lost_nodes_place(&self) -> bool {
        false
    }
}

/// The actions being collected and the stats being counted.
struct Out<'a> {
    actions: HomeActions,
    stats: &'a mut HomeStats,
}

impl Out<'_> {
    fn send(&mut self, to: NodeId, msg: ToNode) {
        if !self.actions.push(HomeAction::Send { to, msg }) {
            self.stats.actions_overflow += 1;
        }
    }

    fn send_all(&mut self, to: NodeSet, msg: ToNode) {
        if !self.actions.push(HomeAction::SendAll { to, msg }) {
            self.stats.actions_overflow += 1;
        }
    }
}
