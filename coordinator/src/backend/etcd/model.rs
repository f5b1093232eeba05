//! The coordinator's state as read from etcd, and every write computed on
//! it in memory: the same rules as the SQLite store (`store/`), with the
//! changes returned as a list of key writes that `ops.rs` commits in one
//! etcd transaction (refused if anything changed since the read).

use std::collections::BTreeMap;

use rdma_transport::coordinator::api::{MapEntry, NodeRegistration, RangeRequest, RdmaEndpoint};
use serde::{Deserialize, Serialize};

use crate::clock::now_unix_ms;
use crate::store::{
    first_replica, joining, AddOutcome, Joining, NodeRecord, RangeRow, ReplicaRefusal, StoreError,
    StoreLimits, StoredRange, StoredReplica, StoredState,
};

use crate::backend::ReplicaOp;

/// The value of a node key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct NodeValue {
    pub tcp_addr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaEndpoint>,
    pub epoch: u64,
    /// When it (last) registered.
    pub registered_unix_ms: u64,
}

/// The value of a node's liveness key (attached to its etcd lease: it
/// goes away when the lease expires).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct AliveValue {
    pub last_seen_unix_ms: u64,
    pub lease_id: i64,
}

/// The value of a range key: the range and its replicas in rank order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct RangeValue {
    pub length_bytes: u64,
    pub replicas: Vec<ReplicaValue>,
}

/// One replica, inside its range's value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ReplicaValue {
    pub node_id: String,
    pub rank: i64,
    pub remote_offset: u64,
    pub valid_epoch: u64,
    /// `live`, `recovering` or `stale` (as in SQLite).
    pub state: String,
    pub recovery_seq: u64,
    /// As in SQLite (`claims.rs`); absent in values written before it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unconfirmed_until_ms: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// Everything under the prefix, read at one revision.
#[derive(Debug, Clone, Default)]
pub(super) struct State {
    pub nodes: BTreeMap<String, NodeValue>,
    pub alive: BTreeMap<String, AliveValue>,
    pub ranges: BTreeMap<u64, RangeValue>,
    /// The map version: the revision of the last map change (0: none yet).
    pub version: u64,
}

/// One key write of a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Write {
    PutNode(String, NodeValue),
    DeleteNode(String),
    /// The liveness key, attached to the lease it names.
    PutAlive(String, AliveValue),
    DeleteAlive(String),
    PutRange(u64, RangeValue),
    DeleteRange(u64),
}

/// The writes of one change, and whether it changes the map version.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Change {
    pub writes: Vec<Write>,
    pub bump: bool,
}

impl Change {
    fn bumping(writes: Vec<Write>) -> Self {
        Self { writes, bump: true }
    }
}

fn parse_state(text: &str) -> Result<StoredState, StoreError> {
    StoredState::from_text(text)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown replica state {text:?}")))
}

impl State {
    /// `id`'s record, if registered.
    pub fn node(&self, id: &str) -> Option<NodeRecord> {
        let value = self.nodes.get(id)?;
        let alive = self.alive.get(id);
        Some(NodeRecord {
            id: id.to_owned(),
            tcp_addr: value.tcp_addr.clone(),
            rdma: value.rdma.clone(),
            last_seen_unix_ms: alive.map_or(value.registered_unix_ms, |a| a.last_seen_unix_ms),
            epoch: value.epoch,
            lease_alive: Some(alive.is_some()),
        })
    }

    /// Every node, sorted by id.
    pub fn node_records(&self) -> Vec<NodeRecord> {
        self.nodes.keys().filter_map(|id| self.node(id)).collect()
    }

    fn node_epoch(&self, id: &str) -> u64 {
        self.nodes.get(id).map_or(0, |n| n.epoch)
    }

    /// The range at `gpa_start` as the shared rules see it.
    pub fn stored_range(&self, gpa_start: u64) -> Result<Option<StoredRange>, StoreError> {
        let Some(value) = self.ranges.get(&gpa_start) else {
            return Ok(None);
        };
        let replicas = value
            .replicas
            .iter()
            .map(|r| {
                Ok(StoredReplica {
                    node_id: r.node_id.clone(),
                    rank: r.rank,
                    remote_offset: r.remote_offset,
                    valid_epoch: r.valid_epoch,
                    state: parse_state(&r.state)?,
                    recovery_seq: r.recovery_seq,
                    node_epoch: self.node_epoch(&r.node_id),
                    unconfirmed_until_ms: r.unconfirmed_until_ms,
                })
            })
            .collect::<Result<_, StoreError>>()?;
        Ok(Some(StoredRange {
            row: RangeRow {
                gpa_start,
                length_bytes: value.length_bytes,
                rdma: None,
            },
            replicas,
        }))
    }

    fn required_range(&self, gpa_start: u64) -> Result<StoredRange, StoreError> {
        self.stored_range(gpa_start)?
            .ok_or(StoreError::NoRange(gpa_start))
    }

    /// Every entry, sorted by `gpa_start`.
    pub fn entries(&self) -> Result<Vec<MapEntry>, StoreError> {
        self.ranges
            .keys()
            .map(|&gpa_start| self.required_range(gpa_start)?.to_entry())
            .collect()
    }

    /// The entry containing `gpa` and its primary's node.
    pub fn resolve(&self, gpa: u64) -> Result<Option<(MapEntry, NodeRecord)>, StoreError> {
        let Some((&start, _)) = self.ranges.range(..=gpa).next_back() else {
            return Ok(None);
        };
        let range = self.required_range(start)?;
        if range.end() <= u128::from(gpa) {
            return Ok(None);
        }
        let entry = range.to_entry()?;
        let node = self.node(&entry.node_id).ok_or_else(|| {
            StoreError::Corrupt(format!("replica holder {:?} is not a node", entry.node_id))
        })?;
        Ok(Some((entry, node)))
    }

    /// Registers or re-registers `id`; the caller adds the liveness key.
    pub fn upsert_node(
        &self,
        id: &str,
        registration: &NodeRegistration,
        now_unix_ms: u64,
        limits: StoreLimits,
    ) -> Result<Change, StoreError> {
        let before = self.nodes.get(id);
        if before.is_none() && self.nodes.len() >= limits.max_nodes {
            return Err(StoreError::LimitReached {
                what: "node",
                max: limits.max_nodes,
            });
        }
        let bump = match before {
            None => true,
            Some(old) => {
                old.tcp_addr != registration.tcp_addr
                    || old.rdma != registration.rdma
                    || old.epoch != registration.epoch
            }
        };
        let value = NodeValue {
            tcp_addr: registration.tcp_addr.clone(),
            rdma: registration.rdma.clone(),
            epoch: registration.epoch,
            registered_unix_ms: now_unix_ms,
        };
        Ok(Change {
            writes: vec![Write::PutNode(id.to_owned(), value)],
            bump,
        })
    }

    /// Sets `id`'s RDMA endpoint; `None` when it is unknown.
    pub fn set_rdma_endpoint(&self, id: &str, endpoint: &RdmaEndpoint) -> Option<Change> {
        let before = self.nodes.get(id)?;
        if before.rdma.as_ref() == Some(endpoint) {
            return Some(Change::default());
        }
        let mut value = before.clone();
        value.rdma = Some(endpoint.clone());
        Some(Change::bumping(vec![Write::PutNode(id.to_owned(), value)]))
    }

    /// Removes `id`, its liveness key and its replicas (and the ranges left
    /// without one); `None` when it is unknown.
    pub fn delete_node(&self, id: &str) -> Option<Change> {
        self.nodes.get(id)?;
        let mut writes = vec![
            Write::DeleteNode(id.to_owned()),
            Write::DeleteAlive(id.to_owned()),
        ];
        for (&gpa_start, range) in &self.ranges {
            if range.replicas.iter().any(|r| r.node_id == id) {
                let mut value = range.clone();
                value.replicas.retain(|r| r.node_id != id);
                writes.push(if value.replicas.is_empty() {
                    Write::DeleteRange(gpa_start)
                } else {
                    Write::PutRange(gpa_start, value)
                });
            }
        }
        Some(Change::bumping(writes))
    }

    /// Replicas `node_id` holds.
    fn held_by(&self, node_id: &str) -> usize {
        self.ranges
            .values()
            .flat_map(|r| &r.replicas)
            .filter(|r| r.node_id == node_id)
            .count()
    }

    fn check_per_node_limit(&self, node_id: &str, limits: StoreLimits) -> Result<(), StoreError> {
        if self.held_by(node_id) >= limits.max_ranges_per_node {
            return Err(StoreError::LimitReached {
                what: "ranges per node",
                max: limits.max_ranges_per_node,
            });
        }
        Ok(())
    }

    /// Adds a range or a replica of one (see `SqliteStore::add_range`);
    /// returns the change and the entry after it.
    pub fn add_range(
        &self,
        request: &RangeRequest,
        limits: StoreLimits,
    ) -> Result<(Change, AddOutcome, RangeValue), StoreError> {
        self.add_range_at(request, limits, now_unix_ms())
    }

    /// [`State::add_range`] at `now_unix_ms`.
    pub fn add_range_at(
        &self,
        request: &RangeRequest,
        limits: StoreLimits,
        now_unix_ms: u64,
    ) -> Result<(Change, AddOutcome, RangeValue), StoreError> {
        let Some(node) = self.nodes.get(&request.node_id) else {
            return Err(StoreError::UnknownNode(request.node_id.clone()));
        };
        let overlap = |start: u64| -> StoreError {
            match self
                .stored_range(start)
                .and_then(|r| r.ok_or(StoreError::NoRange(start))?.to_entry())
            {
                Ok(existing) => StoreError::Overlap {
                    existing: Box::new(existing),
                },
                Err(error) => error,
            }
        };
        let start = request.gpa_start;
        if let Some(existing) = self.ranges.get(&start) {
            if existing.length_bytes != request.length_bytes {
                return Err(overlap(start));
            }
            return self.add_to_existing(existing, request, node.epoch, limits, now_unix_ms);
        }
        if let Some((&before, value)) = self.ranges.range(..start).next_back() {
            if u128::from(before) + u128::from(value.length_bytes) > u128::from(start) {
                return Err(overlap(before));
            }
        }
        let request_end = u128::from(start) + u128::from(request.length_bytes);
        if let Some((&after, _)) = self.ranges.range(start..).next() {
            if request_end > u128::from(after) {
                return Err(overlap(after));
            }
        }
        if self.ranges.len() >= limits.max_ranges {
            return Err(StoreError::LimitReached {
                what: "range",
                max: limits.max_ranges,
            });
        }
        self.check_per_node_limit(&request.node_id, limits)?;
        let (state, unconfirmed_until_ms) = first_replica(request.contents, now_unix_ms);
        let mut first = replica(request, 0, state, node.epoch);
        first.unconfirmed_until_ms = unconfirmed_until_ms;
        let value = RangeValue {
            length_bytes: request.length_bytes,
            replicas: vec![first],
        };
        let change = Change::bumping(vec![Write::PutRange(start, value.clone())]);
        Ok((change, AddOutcome::Created, value))
    }

    fn add_to_existing(
        &self,
        existing: &RangeValue,
        request: &RangeRequest,
        node_epoch: u64,
        limits: StoreLimits,
        now_unix_ms: u64,
    ) -> Result<(Change, AddOutcome, RangeValue), StoreError> {
        let mut value = existing.clone();
        if let Some(mine) = value
            .replicas
            .iter_mut()
            .find(|r| r.node_id == request.node_id)
        {
            let valid_epoch = if mine.valid_epoch == 0 {
                node_epoch
            } else {
                mine.valid_epoch
            };
            if mine.remote_offset == request.remote_offset && mine.valid_epoch == valid_epoch {
                return Ok((Change::default(), AddOutcome::Updated, value));
            }
            mine.remote_offset = request.remote_offset;
            mine.valid_epoch = valid_epoch;
            let change = Change::bumping(vec![Write::PutRange(request.gpa_start, value.clone())]);
            return Ok((change, AddOutcome::Updated, value));
        }
        if value.replicas.len() >= limits.max_replicas {
            return Err(StoreError::LimitReached {
                what: "replicas per range",
                max: limits.max_replicas,
            });
        }
        self.check_per_node_limit(&request.node_id, limits)?;
        let rank = value.replicas.iter().map(|r| r.rank).max().unwrap_or(-1) + 1;
        let stored = self
            .stored_range(request.gpa_start)?
            .ok_or(StoreError::NoRange(request.gpa_start))?;
        let state = match joining(&stored, request.contents, now_unix_ms) {
            Joining::Stale => StoredState::Stale,
            Joining::Live { displaced } => {
                for r in value
                    .replicas
                    .iter_mut()
                    .filter(|r| displaced.contains(&r.node_id))
                {
                    r.state = StoredState::Stale.as_sql().to_owned();
                }
                tracing::warn!(
                    gpa_start = format_args!("{:#x}", request.gpa_start),
                    node = %request.node_id,
                    ?displaced,
                    "a claimer that holds the range's contents displaces its unconfirmed replicas"
                );
                StoredState::Live
            }
        };
        value
            .replicas
            .push(replica(request, rank, state, node_epoch));
        let change = Change::bumping(vec![Write::PutRange(request.gpa_start, value.clone())]);
        Ok((change, AddOutcome::Created, value))
    }

    /// Removes the range at `gpa_start` or `holder`'s replica of it;
    /// `None` when no range starts there.
    pub fn remove_range(
        &self,
        gpa_start: u64,
        holder: Option<&str>,
    ) -> Result<Option<Change>, StoreError> {
        let Some(range) = self.ranges.get(&gpa_start) else {
            return Ok(None);
        };
        let Some(holder) = holder else {
            return Ok(Some(Change::bumping(vec![Write::DeleteRange(gpa_start)])));
        };
        if !range.replicas.iter().any(|r| r.node_id == holder) {
            return Err(StoreError::NotOwner {
                gpa_start,
                owner: self.required_range(gpa_start)?.to_entry()?.node_id,
            });
        }
        let mut value = range.clone();
        value.replicas.retain(|r| r.node_id != holder);
        let write = if value.replicas.is_empty() {
            Write::DeleteRange(gpa_start)
        } else {
            Write::PutRange(gpa_start, value)
        };
        Ok(Some(Change::bumping(vec![write])))
    }

    /// Re-initialises a lost range: every replica live in its holder's
    /// current epoch.
    pub fn reinitialise_range(&self, gpa_start: u64) -> Result<Change, StoreError> {
        let range = self.required_range(gpa_start)?;
        if range.replicas.iter().any(StoredReplica::is_live) {
            return Ok(Change::default());
        }
        let mut value = self
            .ranges
            .get(&gpa_start)
            .cloned()
            .unwrap_or_else(|| RangeValue {
                length_bytes: range.row.length_bytes,
                replicas: Vec::new(),
            });
        for replica in &mut value.replicas {
            replica.state = StoredState::Live.as_sql().to_owned();
            replica.valid_epoch = self.node_epoch(&replica.node_id);
        }
        Ok(Change::bumping(vec![Write::PutRange(gpa_start, value)]))
    }

    /// A replica state change (see `store/replicas.rs` for the rules).
    pub fn change_replica(
        &self,
        gpa_start: u64,
        node_id: &str,
        op: ReplicaOp,
    ) -> Result<Change, StoreError> {
        let range = self.required_range(gpa_start)?;
        let replica = range
            .replica(node_id)
            .ok_or_else(|| StoreError::NoReplica {
                gpa_start,
                node_id: node_id.to_owned(),
            })?;
        let refused = |refusal| StoreError::ReplicaRefused {
            gpa_start,
            node_id: node_id.to_owned(),
            refusal,
        };
        let (state, valid_epoch, recovery_seq) = match op {
            ReplicaOp::MarkStale => {
                if replica.is_live() && !range.other_is_live(node_id) {
                    return Err(refused(ReplicaRefusal::LastLive));
                }
                if replica.state == StoredState::Stale {
                    return Ok(Change::default());
                }
                (
                    StoredState::Stale,
                    replica.valid_epoch,
                    replica.recovery_seq,
                )
            }
            ReplicaOp::BeginRecovery { epoch } => {
                if epoch != replica.node_epoch {
                    return Err(refused(ReplicaRefusal::NotCurrentEpoch {
                        presented: epoch,
                        current: replica.node_epoch,
                    }));
                }
                if replica.is_live() {
                    return Err(refused(ReplicaRefusal::AlreadyLive));
                }
                if !range.other_is_live(node_id) {
                    return Err(refused(ReplicaRefusal::NoLiveSource));
                }
                let next_seq = replica.recovery_seq.checked_add(1).ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "recovery_seq of {node_id:?} at {gpa_start:#x} is at its maximum"
                    ))
                })?;
                (StoredState::Recovering, replica.node_epoch, next_seq)
            }
            ReplicaOp::FinishRecovery {
                recovery_seq,
                epoch,
            } => {
                if epoch != replica.node_epoch {
                    return Err(refused(ReplicaRefusal::NotCurrentEpoch {
                        presented: epoch,
                        current: replica.node_epoch,
                    }));
                }
                if replica.state != StoredState::Recovering {
                    let stored = replica.state.as_sql();
                    return Err(refused(ReplicaRefusal::NotRecovering { stored }));
                }
                if replica.recovery_seq != recovery_seq {
                    return Err(refused(ReplicaRefusal::SeqMismatch {
                        presented: recovery_seq,
                        current: replica.recovery_seq,
                    }));
                }
                if replica.valid_epoch != replica.node_epoch {
                    return Err(refused(ReplicaRefusal::EpochChanged));
                }
                (StoredState::Live, replica.valid_epoch, replica.recovery_seq)
            }
        };
        let mut value = self
            .ranges
            .get(&gpa_start)
            .cloned()
            .ok_or(StoreError::NoRange(gpa_start))?;
        for r in value.replicas.iter_mut().filter(|r| r.node_id == node_id) {
            r.state = state.as_sql().to_owned();
            r.valid_epoch = valid_epoch;
            r.recovery_seq = recovery_seq;
        }
        Ok(Change::bumping(vec![Write::PutRange(gpa_start, value)]))
    }

    /// This state with `change` applied (to answer with the state after a
    /// committed write without reading it again).
    pub fn apply(&mut self, change: &Change) {
        for write in &change.writes {
            match write {
                Write::PutNode(id, value) => {
                    self.nodes.insert(id.clone(), value.clone());
                }
                Write::DeleteNode(id) => {
                    self.nodes.remove(id);
                }
                Write::PutAlive(id, value) => {
                    self.alive.insert(id.clone(), value.clone());
                }
                Write::DeleteAlive(id) => {
                    self.alive.remove(id);
                }
                Write::PutRange(gpa_start, value) => {
                    self.ranges.insert(*gpa_start, value.clone());
                }
                Write::DeleteRange(gpa_start) => {
                    self.ranges.remove(gpa_start);
                }
            }
        }
    }
}

fn replica(
    request: &RangeRequest,
    rank: i64,
    state: StoredState,
    valid_epoch: u64,
) -> ReplicaValue {
    ReplicaValue {
        node_id: request.node_id.clone(),
        rank,
        remote_offset: request.remote_offset,
        valid_epoch,
        state: state.as_sql().to_owned(),
        recovery_seq: 0,
        unconfirmed_until_ms: 0,
    }
}
