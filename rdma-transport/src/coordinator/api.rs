//! JSON types of the coordinator's HTTP API, defined once and shared by the
//! coordinator service, its client in this library, the page-server and the
//! bench. `docs/coordinator-openapi.yaml` describes the same shapes.

use serde::{Deserialize, Serialize};

/// Identifier of a node: 1 to 64 characters of `[A-Za-z0-9_.-]`, other than
/// `.` and `..` (which URL normalisation would swallow in `/v1/nodes/{id}`).
pub type NodeId = String;

/// Returns true when `id` is an acceptable [`NodeId`].
pub fn is_valid_node_id(id: &str) -> bool {
    !id.is_empty()
        && id != "."
        && id != ".."
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// How to reach a node's RDMA device. Filled in by the RDMA data path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaEndpoint {
    /// Device name, e.g. `mlx5_0` or `rxe0`.
    pub device: String,
    /// Port number on the device (1-based, as in verbs).
    pub port: u8,
    /// GID in its textual IPv6 form (the IPv4-mapped RoCE v2 GID on RoCE).
    pub gid: String,
    /// Index of `gid` in the port's GID table.
    pub gid_index: u8,
    /// Local identifier (InfiniBand); 0 on RoCE.
    pub lid: u16,
}

/// Body of `PUT /v1/nodes/{id}`: register or update a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRegistration {
    /// `host:port` of the node's page-server TCP listener.
    pub tcp_addr: String,
    /// RDMA endpoint, when the node has a usable device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaEndpoint>,
    /// The page-server's epoch: random at every start, the one its handshake
    /// sends. Its memory belongs to this epoch. 0 (older senders): unknown.
    #[serde(default)]
    pub epoch: u64,
}

/// A node as the coordinator reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Node identifier.
    pub id: NodeId,
    /// `host:port` of the node's page-server TCP listener.
    pub tcp_addr: String,
    /// RDMA endpoint, when published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaEndpoint>,
    /// True while the node's lease (last heartbeat + lease time) has not run out.
    pub alive: bool,
    /// Milliseconds since the last heartbeat or registration.
    pub last_seen_ms_ago: u64,
    /// The epoch of the node's last registration (0: unknown).
    #[serde(default)]
    pub epoch: u64,
}

/// RDMA access to a mapped range: remote virtual address and rkey of the
/// memory region that backs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaRegion {
    /// Remote virtual address of byte 0 of the exported region.
    pub addr: u64,
    /// Remote key of the exported memory region.
    pub rkey: u32,
}

/// Body of `POST /v1/map`: claim a GPA range for a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeRequest {
    /// First guest-physical address of the range (4 KiB aligned).
    pub gpa_start: u64,
    /// Length of the range in bytes (a non-zero multiple of 4 KiB).
    pub length_bytes: u64,
    /// Owner node (must be registered).
    pub node_id: NodeId,
    /// Offset inside the owner's exported region that backs `gpa_start`
    /// (4 KiB aligned).
    pub remote_offset: u64,
    /// Ignored: the coordinator publishes no region address or key (each
    /// client gets a key of its own in the page-server's authenticated
    /// handshake). Kept so that older requests still parse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaRegion>,
    /// What the claiming page-server's memory holds of the range, by the
    /// last map it read. A coordinator that has a replica row for the node
    /// ignores it; one that has none (it started on an empty database, or
    /// the node joins the range) goes by it (docs/operations.md,
    /// "Coordinator state lost").
    #[serde(default, skip_serializing_if = "RangeContents::is_unknown")]
    pub contents: RangeContents,
}

/// What a page-server's memory holds of a range it claims (see
/// [`RangeRequest::contents`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RangeContents {
    /// Not said: no map this process read had its replica of the range (a
    /// page-server that just started: its memory is zeros), or a
    /// page-server of an older release.
    #[default]
    Unknown,
    /// Its replica was live in the last map it read: its memory holds the
    /// range's contents.
    Held,
    /// Its replica was stale, recovering or lost in the last map it read:
    /// its memory missed writes.
    Missed,
}

impl RangeContents {
    /// True for [`RangeContents::Unknown`] (left out of the request).
    #[must_use]
    pub fn is_unknown(&self) -> bool {
        *self == Self::Unknown
    }

    /// What a page-server whose replica was last seen in `state` claims.
    #[must_use]
    pub fn from_state(state: ReplicaState) -> Self {
        if state == ReplicaState::Live {
            Self::Held
        } else {
            Self::Missed
        }
    }
}

/// One entry of the GPA map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapEntry {
    /// First guest-physical address of the range.
    pub gpa_start: u64,
    /// Length of the range in bytes.
    pub length_bytes: u64,
    /// Owner node: the primary replica's holder (the first live replica
    /// in `replicas`, the first replica when none is live).
    pub node_id: NodeId,
    /// Offset inside the owner's (primary's) exported region that backs
    /// `gpa_start`.
    pub remote_offset: u64,
    /// Always `None` from this coordinator (region keys are not published:
    /// see [`RangeRequest::rdma`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaRegion>,
    /// The owner (primary) epoch whose memory holds this range's valid
    /// contents: the owner's epoch when it claimed the range, or when an
    /// operator last re-initialised it. A client serves the range only from a connection
    /// whose handshake epoch equals it. 0 (older coordinators): not checked.
    #[serde(default)]
    pub valid_epoch: u64,
    /// Whether the range's valid contents are still held somewhere: `live`
    /// while at least one replica is live, `lost` otherwise.
    #[serde(default)]
    pub state: RangeState,
    /// Every holder of the range (1 to the coordinator's replica limit), in
    /// registration order; the primary (the first live one) is also named
    /// by `node_id`, `remote_offset` and `valid_epoch` above. Empty from
    /// older coordinators: the range then has the one holder named above.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<Replica>,
}

/// One holder of a replicated range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replica {
    /// The holder.
    pub node_id: NodeId,
    /// Offset inside the holder's exported region that backs `gpa_start`.
    pub remote_offset: u64,
    /// The holder epoch whose memory holds this replica's contents (for a
    /// `recovering` replica: the epoch that is copying them in).
    #[serde(default)]
    pub valid_epoch: u64,
    /// What this replica may do now.
    #[serde(default)]
    pub state: ReplicaState,
    /// Increases each time the holder starts a recovery of this replica;
    /// finishing a recovery names it, so a recovery that was overtaken (the
    /// replica went stale again meanwhile) cannot mark it live.
    #[serde(default)]
    pub recovery_seq: u64,
}

/// What one replica of a range may do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplicaState {
    /// Holds the latest contents: serves reads, takes writes.
    #[default]
    Live,
    /// Copying the range from a live replica: takes writes (so that it
    /// misses none), serves no reads.
    Recovering,
    /// Missed writes (a write to it failed, or its holder restarted) while
    /// another replica is live: serves nothing until it has recovered.
    Stale,
    /// Missed writes and no replica of the range is live: the range's
    /// contents are gone until an operator re-initialises it.
    Lost,
}

impl ReplicaState {
    /// Whether a replica in this state serves reads.
    pub fn serves_reads(self) -> bool {
        self == Self::Live
    }

    /// Whether writes must go to a replica in this state.
    pub fn takes_writes(self) -> bool {
        matches!(self, Self::Live | Self::Recovering)
    }
}

/// Answer of the replica state changes (`POST
/// /v1/map/{gpa_start}/replicas/{node_id}/stale`, `.../recovering`,
/// `.../live`): the map version that holds the change, and the entry as it
/// is now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaChange {
    /// The map version after the change.
    pub version: u64,
    /// The generation `version` counts in (see [`MapResponse::generation`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
    /// The range, with every replica's state.
    pub entry: MapEntry,
}

/// Body of `POST /v1/map/{gpa_start}/replicas/{node_id}/recovering`: the
/// process that will copy the range in, named by its epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryBegin {
    /// The epoch of the page-server process that copies (its HELLO_ACK
    /// epoch). Refused unless it is the node's current epoch: a previous
    /// process of the node, still running somewhere, must not recover into
    /// memory nobody serves.
    pub epoch: u64,
}

/// Body of `POST /v1/map/{gpa_start}/replicas/{node_id}/live`: the recovery
/// that completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryDone {
    /// The `recovery_seq` that `.../recovering` returned for this replica.
    pub recovery_seq: u64,
    /// The epoch of the process whose memory now holds the copy. Refused
    /// unless it is the epoch the recovery began in and the node's current
    /// one.
    pub epoch: u64,
}

/// Whether a range's contents are still where the map says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RangeState {
    /// At least one replica is live (for a range with one holder: the
    /// owner's current epoch is the range's `valid_epoch`).
    #[default]
    Live,
    /// No replica is live (every holder restarted since, or missed
    /// writes): reads and writes fail with `DataLost` until an operator
    /// re-initialises the range.
    Lost,
}

impl RangeState {
    /// The state of a range with one holder, valid in `valid_epoch`, whose
    /// owner is now in `owner_epoch`. (The coordinator derives a replicated
    /// range's state from all its replicas.)
    pub fn of(valid_epoch: u64, owner_epoch: u64) -> Self {
        if valid_epoch == owner_epoch {
            Self::Live
        } else {
            Self::Lost
        }
    }
}

/// Body of `GET /v1/map`: the whole map, its version, and every node it names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapResponse {
    /// Increases whenever a node endpoint or a map entry changes.
    pub version: u64,
    /// Names the coordinator state `version` counts in: chosen when that
    /// state was created (a new database or etcd prefix), so a coordinator
    /// that lost its state and counts from 0 again answers with another
    /// one. Versions of two generations are not comparable. 0: not said
    /// (an older coordinator, or a map made by hand).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
    /// Entries sorted by `gpa_start`, never overlapping.
    pub entries: Vec<MapEntry>,
    /// Every registered node.
    pub nodes: Vec<NodeInfo>,
}

/// Body of `GET /v1/resolve?gpa=...`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolveResponse {
    /// The address asked about.
    pub gpa: u64,
    /// Map version the answer was read from.
    pub version: u64,
    /// The entry that contains `gpa`.
    pub entry: MapEntry,
    /// Its owner node.
    pub node: NodeInfo,
}

/// Body of every 4xx/5xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Machine-readable code, e.g. `not_found`, `conflict`, `bad_request`, `unauthorized`.
    pub error: String,
    /// Human-readable explanation.
    pub message: String,
}

/// Body of `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthResponse {
    /// Always `ok` when the service answers.
    pub status: String,
}

/// Serde's `skip_serializing_if` for fields whose 0 means "not said".
fn is_zero(value: &u64) -> bool {
    *value == 0
}

#[cfg(test)]
mod tests {
    use super::is_valid_node_id;

    #[test]
    fn node_ids() {
        assert!(is_valid_node_id("node-1"));
        assert!(is_valid_node_id("a.b_c"));
        assert!(is_valid_node_id(&"x".repeat(64)));
        assert!(!is_valid_node_id(&"x".repeat(65)));
        assert!(!is_valid_node_id(""));
        assert!(!is_valid_node_id("."));
        assert!(!is_valid_node_id(".."));
        assert!(!is_valid_node_id("a/b"));
        assert!(!is_valid_node_id("a b"));
    }
}
