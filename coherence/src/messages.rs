//! Protocol messages, node ids and node sets.
//!
//! One page's protocol: every message is about a single page, whose address
//! the transport carries next to it (the protocol does not need it).

/// A hypervisor node taking part in a coherent VM: 0..=63.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(u8);

impl NodeId {
    /// How many nodes a [`NodeSet`] can hold.
    pub const MAX_NODES: u8 = 64;

    /// `None` if `id` is not below [`NodeId::MAX_NODES`].
    pub const fn new(id: u8) -> Option<NodeId> {
        if id < Self::MAX_NODES {
            Some(NodeId(id))
        } else {
            None
        }
    }

    /// The id as a number (below [`NodeId::MAX_NODES`]).
    pub const fn get(self) -> u8 {
        self.0
    }
}

/// A set of nodes (the holders of a shared page), one bit per node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeSet(u64);

impl NodeSet {
    /// No node.
    pub const EMPTY: NodeSet = NodeSet(0);

    /// Just `node`.
    pub const fn one(node: NodeId) -> NodeSet {
        NodeSet(1 << node.0)
    }

    /// Whether `node` is in the set.
    pub const fn contains(self, node: NodeId) -> bool {
        self.0 & (1 << node.0) != 0
    }

    /// The set with `node` added.
    #[must_use]
    pub const fn with(self, node: NodeId) -> NodeSet {
        NodeSet(self.0 | (1 << node.0))
    }

    /// The set without `node`.
    #[must_use]
    pub const fn without(self, node: NodeId) -> NodeSet {
        NodeSet(self.0 & !(1 << node.0))
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// How many nodes are in the set.
    pub const fn len(self) -> u32 {
        self.0.count_ones()
    }

    /// The bits, bit `n` for node `n`.
    pub const fn bits(self) -> u64 {
        self.0
    }

    /// The members, lowest id first.
    pub fn iter(self) -> impl Iterator<Item = NodeId> {
        (0..NodeId::MAX_NODES)
            .filter(move |n| self.0 & (1 << n) != 0)
            .map(NodeId)
    }
}

/// A node's request id for one page. A node has at most one request per page
/// outstanding; the home's answer names it, so an answer to an older request
/// is recognised and dropped.
pub type ReqId = u32;

/// The home's per-page message sequence number. Every grant and every
/// callback round (invalidate, downgrade) takes the next one, so a node can
/// tell that a grant was overtaken by a later callback (see `node.rs`).
pub type Seq = u64;

/// A data version: the number of exclusive grants of the page so far. The
/// owner of version `v` is the only node that writes data of version `v`.
/// Version 0 is the page's initial contents.
pub type Version = u64;

/// What a node asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Access {
    /// A shared, read-only copy.
    Read,
    /// Exclusive ownership (the page writable on this node only).
    Write,
}

/// What a grant gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// A read-only copy; other nodes may hold one too.
    Shared,
    /// The only copy that may be written.
    Exclusive,
}

/// Node → home.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ToHome {
    /// A read fault: asks for a shared copy.
    ReadReq {
        /// The node's request id.
        req: ReqId,
    },
    /// A write fault: asks for exclusive ownership.
    WriteReq {
        /// The node's request id.
        req: ReqId,
        /// The node holds a shared copy (a write-protect fault, an upgrade)
        /// rather than nothing (a missing page). Informational: the home
        /// counts upgrades; whether data moves is the node's business.
        upgrade: bool,
    },
    /// The answer to [`ToNode::Invalidate`]: the node holds no copy any more.
    InvalidateAck {
        /// The callback's sequence number.
        seq: Seq,
        /// The newest version this node has written back to the home (if
        /// it ever owned the page), written back before this ack was sent.
        written_back: Option<Version>,
    },
    /// The answer to [`ToNode::Downgrade`].
    DowngradeAck {
        /// The callback's sequence number.
        seq: Seq,
        /// As for [`ToHome::InvalidateAck`].
        written_back: Option<Version>,
        /// The node kept a read-only copy (it is a holder of the page).
        kept: bool,
    },
    /// The owner evicted its modified copy after writing it back.
    /// (Shared copies are dropped silently: the home finds out from the
    /// next invalidation's ack.)
    WriteBack {
        /// The version written back.
        version: Version,
    },
}

impl ToHome {
    /// The version of the page this message reports written back (and
    /// which travels with it on the wire), if any.
    pub const fn written_back(&self) -> Option<Version> {
        match *self {
            ToHome::WriteBack { version } => Some(version),
            ToHome::InvalidateAck { written_back, .. }
            | ToHome::DowngradeAck { written_back, .. } => written_back,
            ToHome::ReadReq { .. } | ToHome::WriteReq { .. } => None,
        }
    }
}

/// Home → node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ToNode {
    /// The answer to a request.
    Grant {
        /// The request answered.
        req: ReqId,
        /// This grant's sequence number.
        seq: Seq,
        /// Shared (for a read) or exclusive (for a write).
        mode: Mode,
        /// Exclusive: the version this owner's writes make. Shared: equal
        /// to `data_version`.
        version: Version,
        /// The version of the data at the home: what a node that has no
        /// valid copy fetches.
        data_version: Version,
    },
    /// The page's latest writes were lost with a node that owned it: the
    /// request fails with the typed lost-data error.
    Lost {
        /// The request answered.
        req: ReqId,
    },
    /// The home's queue for this page is full: send the same request again
    /// later.
    Retry {
        /// The request answered.
        req: ReqId,
    },
    /// Drop your copy (writing it back first if modified), then ack.
    Invalidate {
        /// This callback's sequence number.
        seq: Seq,
        /// To the owner: the sequence number of its exclusive grant (if the
        /// grant has not arrived yet, wait for it and use it first). To
        /// shared holders: `None` (their grants are not tracked one by one).
        grant: Option<Seq>,
    },
    /// Write your modified copy back and keep it read-only, then ack. Sent
    /// to the owner only.
    Downgrade {
        /// This callback's sequence number.
        seq: Seq,
        /// The sequence number of the owner's exclusive grant.
        grant: Seq,
    },
}
