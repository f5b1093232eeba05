//! The coordinator's state in SQLite (the embedded default backend; the
//! routes reach it through `backend::sqlite`): nodes, map entries and the version.
//!
//! Synchronous on purpose: callers run it on a blocking thread (see
//! `state.rs`). Every write is one transaction, and the database is in WAL
//! mode with `synchronous=FULL`, so a committed answer survives `kill -9` and
//! power loss.

mod claims;
mod codec;
mod effective;
mod load;
mod map;
mod nodes;
mod replicas;
mod schema;

#[cfg(feature = "etcd")]
pub(crate) use claims::{first_replica, joining, Joining};
#[cfg(feature = "etcd")]
pub(crate) use effective::{RangeRow, StoredRange, StoredReplica, StoredState};
pub use replicas::ReplicaRefusal;

use std::path::Path;

use rdma_transport::coordinator::api::{MapEntry, NodeInfo, RdmaEndpoint};
use rusqlite::Connection;

/// What a store operation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// SQLite failed.
    #[error("sqlite")]
    Sqlite(#[from] rusqlite::Error),
    /// The database holds something this version cannot read.
    #[error("database content not understood: {0}")]
    Corrupt(String),
    /// The node named by a request is not registered.
    #[error("node {0:?} is not registered")]
    UnknownNode(String),
    /// Adding one more would pass a configured bound.
    #[error("{what} limit reached ({max})")]
    LimitReached {
        /// What is counted, e.g. "node".
        what: &'static str,
        /// The bound.
        max: usize,
    },
    /// No range starts at the address.
    #[error("no range starts at {0:#x}")]
    NoRange(u64),
    /// A node asked to remove its replica of a range it holds none of.
    #[error("the range at {gpa_start:#x} belongs to node {owner:?}")]
    NotOwner {
        /// Start of the range.
        gpa_start: u64,
        /// Its primary's holder.
        owner: String,
    },
    /// The node holds no replica of the range.
    #[error("node {node_id:?} holds no replica of the range at {gpa_start:#x}")]
    NoReplica {
        /// Start of the range.
        gpa_start: u64,
        /// The node.
        node_id: String,
    },
    /// A replica state change conflicts with the range's state.
    #[error("replica of node {node_id:?} at {gpa_start:#x}: {refusal}")]
    ReplicaRefused {
        /// Start of the range.
        gpa_start: u64,
        /// The replica's holder.
        node_id: String,
        /// Why.
        refusal: ReplicaRefusal,
    },
    /// The backend failed (a task died, a stored value is unreadable).
    #[error("backend: {0}")]
    Backend(String),
    /// The backend cannot be reached or did not answer in time (etcd: no
    /// quorum, or the write kept losing races); the request may be retried.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A heartbeat from a process of the node that is not its current one
    /// (another registered since): its lease is not renewed.
    #[error(
        "node {id:?} is registered in epoch {current:#x} (at {current_addr}), not in \
         {presented:#x}: another process registered since; the lease was not renewed"
    )]
    NotCurrentProcess {
        /// The node.
        id: String,
        /// The epoch the heartbeat named.
        presented: u64,
        /// The node's current epoch.
        current: u64,
        /// The current process's TCP address.
        current_addr: String,
    },
    /// A new range overlaps an existing entry.
    #[error("range overlaps the entry at gpa_start {:#x}", existing.gpa_start)]
    Overlap {
        /// The entry in the way (boxed: it is much larger than the other
        /// variants).
        existing: Box<MapEntry>,
    },
}

/// A node as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeRecord {
    pub id: String,
    pub tcp_addr: String,
    pub rdma: Option<RdmaEndpoint>,
    pub last_seen_unix_ms: u64,
    /// Epoch of the node's last registration (0: unknown).
    pub epoch: u64,
    /// Whether the node's lease in the store is alive, for stores that keep
    /// leases themselves (etcd); `None`: alive while `last_seen_unix_ms` is
    /// younger than the coordinator's lease (SQLite).
    pub lease_alive: Option<bool>,
}

impl NodeRecord {
    /// Refuses a heartbeat naming `epoch` unless it is this node's current
    /// one (`None`: a heartbeat that names none, from older page-servers).
    pub fn check_heartbeat(&self, epoch: Option<u64>) -> Result<(), StoreError> {
        match epoch {
            Some(presented) if presented != self.epoch => Err(StoreError::NotCurrentProcess {
                id: self.id.clone(),
                presented,
                current: self.epoch,
                current_addr: self.tcp_addr.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// The API view of this node at `now_unix_ms` with a lease of `lease_ms`.
    pub fn to_info(&self, now_unix_ms: u64, lease_ms: u64) -> NodeInfo {
        let ago_ms = now_unix_ms.saturating_sub(self.last_seen_unix_ms);
        NodeInfo {
            id: self.id.clone(),
            tcp_addr: self.tcp_addr.clone(),
            rdma: self.rdma.clone(),
            alive: self.lease_alive.unwrap_or(ago_ms < lease_ms),
            last_seen_ms_ago: ago_ms,
            epoch: self.epoch,
        }
    }
}

/// Whether [`SqliteStore::add_range`] created an entry or refreshed an identical one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AddOutcome {
    Created,
    Updated,
}

/// A consistent view of the whole state.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    pub version: u64,
    pub entries: Vec<MapEntry>,
    pub nodes: Vec<NodeRecord>,
}

/// Bounds on the rows a store accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoreLimits {
    pub max_nodes: usize,
    pub max_ranges: usize,
    /// Replicas a node holds (its ranges) at most.
    pub max_ranges_per_node: usize,
    /// Replicas of one range at most.
    pub max_replicas: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        let limits = crate::config::Limits::default();
        Self {
            max_nodes: limits.max_nodes,
            max_ranges: limits.max_ranges,
            max_ranges_per_node: limits.max_ranges_per_node,
            max_replicas: limits.max_replicas,
        }
    }
}

/// The open database. Not `Sync`: share it behind a mutex.
#[derive(Debug)]
pub(crate) struct SqliteStore {
    conn: Connection,
    limits: StoreLimits,
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` and brings its
    /// schema up to date.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let mut conn = Connection::open(path)?;
        schema::prepare(&mut conn)?;
        Ok(Self {
            conn,
            limits: StoreLimits::default(),
        })
    }

    /// Replaces the row bounds (rows already stored are kept).
    pub fn set_limits(&mut self, limits: StoreLimits) {
        self.limits = limits;
    }

    /// Current map version.
    pub fn version(&self) -> Result<u64, StoreError> {
        schema::version(&self.conn)
    }

    /// The database's generation: random, chosen when it was created, so
    /// that clients tell a coordinator that lost its state (and counts
    /// versions from 0 again) from one that did not.
    pub fn generation(&self) -> Result<u64, StoreError> {
        schema::generation(&self.conn)
    }

    /// Nodes, entries and version read in one transaction.
    pub fn snapshot(&mut self) -> Result<Snapshot, StoreError> {
        let tx = self.conn.transaction()?;
        let snapshot = Snapshot {
            version: schema::version(&tx)?,
            entries: map::all(&tx)?,
            nodes: nodes::all(&tx)?,
        };
        tx.commit()?;
        Ok(snapshot)
    }
}

#[cfg(test)]
mod replica_tests;
#[cfg(test)]
mod tests;
