//! The storage backend the routes program against: the [`Store`] trait,
//! with the embedded SQLite store ([`sqlite::SqliteBackend`], the default)
//! and, with the `etcd` feature, a store in an etcd cluster
//! ([`etcd::EtcdBackend`]) shared by any number of stateless coordinators.
//!
//! Both keep the same rules (see `store/effective.rs` for what a replica
//! reports); the same HTTP test suite runs against both.

#[cfg(feature = "etcd")]
pub(crate) mod etcd;
pub(crate) mod sqlite;

use std::fmt;

use async_trait::async_trait;
use rdma_transport::coordinator::api::{MapEntry, NodeRegistration, RangeRequest, RdmaEndpoint};
use tokio::sync::watch;

pub(crate) use crate::store::{AddOutcome, NodeRecord, Snapshot, StoreError};

/// A replica state change (`/v1/map/{gpa_start}/replicas/{node_id}/...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReplicaOp {
    /// The replica missed a write.
    MarkStale,
    /// The holder's process in `epoch` starts copying the range in.
    BeginRecovery { epoch: u64 },
    /// Recovery `recovery_seq`, begun by the process in `epoch`, is done.
    FinishRecovery { recovery_seq: u64, epoch: u64 },
}

/// Everything the routes ask of the coordinator's state. Every write is
/// atomic: it happens whole or not at all, and two writes racing (through
/// one coordinator or several sharing a backend) behave as if one ran
/// first. The map version only increases; it changes exactly when what
/// `GET /v1/map` shows of the map or the nodes' addresses changes.
///
/// The methods mirror [`crate::store::SqliteStore`]'s; see there for each
/// one's rules and errors.
#[async_trait]
pub(crate) trait Store: Send + Sync + fmt::Debug {
    /// Nodes, entries and version, read together.
    async fn snapshot(&self) -> Result<Snapshot, StoreError>;
    /// Every node, sorted by id.
    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError>;
    /// One node.
    async fn node(&self, id: &str) -> Result<Option<NodeRecord>, StoreError>;
    /// Registers `id` or replaces its registration; starts its lease.
    async fn upsert_node(
        &self,
        id: &str,
        registration: &NodeRegistration,
        now_unix_ms: u64,
    ) -> Result<NodeRecord, StoreError>;
    /// Renews the node's lease; `None` when the node is unknown. With
    /// `epoch`, only the lease of the node's process in that epoch
    /// ([`StoreError::NotCurrentProcess`] otherwise, nothing renewed).
    async fn heartbeat(
        &self,
        id: &str,
        epoch: Option<u64>,
        now_unix_ms: u64,
    ) -> Result<Option<NodeRecord>, StoreError>;
    /// Sets the node's RDMA endpoint; `None` when the node is unknown.
    async fn set_rdma_endpoint(
        &self,
        id: &str,
        endpoint: &RdmaEndpoint,
    ) -> Result<Option<NodeRecord>, StoreError>;
    /// Removes a node with its replicas; false when it is unknown.
    async fn delete_node(&self, id: &str) -> Result<bool, StoreError>;
    /// Adds a range or a replica of one (validated request).
    async fn add_range(&self, request: &RangeRequest)
        -> Result<(MapEntry, AddOutcome), StoreError>;
    /// Removes a range, or only `holder`'s replica of it.
    async fn remove_range(&self, gpa_start: u64, holder: Option<&str>) -> Result<bool, StoreError>;
    /// Re-initialises a lost range.
    async fn reinitialise_range(&self, gpa_start: u64) -> Result<MapEntry, StoreError>;
    /// The entry containing `gpa`, its primary's node and the version.
    async fn resolve(&self, gpa: u64) -> Result<Option<(u64, MapEntry, NodeRecord)>, StoreError>;
    /// Changes `node_id`'s replica of the range at `gpa_start`; returns the
    /// version and the entry after it.
    async fn change_replica(
        &self,
        gpa_start: u64,
        node_id: &str,
        op: ReplicaOp,
    ) -> Result<(u64, MapEntry), StoreError>;
    /// The map version, updated soon after every change (made through this
    /// process or, for a shared backend, any other): what a long poll of
    /// the map waits on. It may lag the store; a reader that wakes reads
    /// the store itself.
    fn versions(&self) -> watch::Receiver<u64>;
    /// The generation the versions count in (`MapResponse::generation`):
    /// fixed when the store's state was created, read when it was opened.
    fn generation(&self) -> u64;
}
