//! What a range and its replicas report, derived when answering from what
//! is stored and each holder's current epoch (a holder that restarted has
//! a new epoch and empty memory, whatever its rows say).
//!
//! A replica is effectively
//! - `live` iff stored `live` and valid in its holder's current epoch (or
//!   in epoch 0, "unknown": nothing to check);
//! - `recovering` iff stored `recovering` and its copy is being made by
//!   the holder's current epoch;
//! - otherwise `stale` when another replica of the range is live, `lost`
//!   when none is.
//!
//! The range's primary is its lowest-rank live replica (the rank-0 one when
//! none is live); the entry's top-level holder fields are the primary's.

use rdma_transport::coordinator::api::{MapEntry, RangeState, RdmaRegion, Replica, ReplicaState};
use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ValueRef};

use super::StoreError;

/// A replica's state as stored (`lost` is never stored: it is `stale` with
/// no live replica beside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoredState {
    /// Holds the contents (when its epoch still matches).
    Live,
    /// Copying the contents from a live replica.
    Recovering,
    /// Missed writes.
    Stale,
}

impl StoredState {
    /// The text stored in `map_replicas.state`.
    pub fn as_sql(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Recovering => "recovering",
            Self::Stale => "stale",
        }
    }

    /// Inverse of [`Self::as_sql`] (also the text other backends store).
    pub fn from_text(text: &str) -> Option<Self> {
        match text {
            "live" => Some(Self::Live),
            "recovering" => Some(Self::Recovering),
            "stale" => Some(Self::Stale),
            _ => None,
        }
    }
}

impl FromSql for StoredState {
    fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
        let text = value.as_str()?;
        Self::from_text(text)
            .ok_or_else(|| FromSqlError::Other(format!("unknown replica state {text:?}").into()))
    }
}

/// A replica row, with its holder's current epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredReplica {
    pub node_id: String,
    /// Claim order within the range (0 first).
    pub rank: i64,
    pub remote_offset: u64,
    pub valid_epoch: u64,
    pub state: StoredState,
    pub recovery_seq: u64,
    /// The holder's current epoch (0: unknown).
    pub node_epoch: u64,
    /// Until when (Unix ms) a holder of the range's contents that claims
    /// it displaces this replica (0: never; `claims.rs`).
    pub unconfirmed_until_ms: u64,
}

impl StoredReplica {
    /// Effectively live: stored live and valid in the holder's current
    /// epoch (or in the unknown epoch 0).
    pub fn is_live(&self) -> bool {
        self.state == StoredState::Live
            && (self.valid_epoch == self.node_epoch || self.valid_epoch == 0)
    }

    /// Effectively recovering: stored recovering by the holder's current
    /// epoch.
    pub fn is_recovering(&self) -> bool {
        self.state == StoredState::Recovering && self.valid_epoch == self.node_epoch
    }
}

/// A range row: the columns of `map_entries`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RangeRow {
    pub gpa_start: u64,
    pub length_bytes: u64,
    pub rdma: Option<RdmaRegion>,
}

/// A range with its replicas in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredRange {
    pub row: RangeRow,
    pub replicas: Vec<StoredReplica>,
}

impl StoredRange {
    /// One past the last byte; u128 so that it cannot overflow.
    pub fn end(&self) -> u128 {
        u128::from(self.row.gpa_start) + u128::from(self.row.length_bytes)
    }

    /// `node_id`'s replica, if it holds one.
    pub fn replica(&self, node_id: &str) -> Option<&StoredReplica> {
        self.replicas.iter().find(|r| r.node_id == node_id)
    }

    /// Whether a replica other than `node_id`'s is effectively live.
    pub fn other_is_live(&self, node_id: &str) -> bool {
        self.replicas
            .iter()
            .any(|r| r.node_id != node_id && r.is_live())
    }

    /// The lowest-rank live replica, else the rank-0 one; `None` only for
    /// a range without replicas (which the store never leaves behind).
    pub fn primary(&self) -> Option<&StoredReplica> {
        self.replicas
            .iter()
            .find(|r| r.is_live())
            .or_else(|| self.replicas.first())
    }

    /// The API view: every replica's effective state, the primary's fields
    /// on top, `live` while any replica is.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for a range without replicas.
    pub fn to_entry(&self) -> Result<MapEntry, StoreError> {
        let primary = self.primary().ok_or_else(|| {
            StoreError::Corrupt(format!("range at {:#x} has no replica", self.row.gpa_start))
        })?;
        let any_live = self.replicas.iter().any(StoredReplica::is_live);
        let replicas = self
            .replicas
            .iter()
            .map(|r| Replica {
                node_id: r.node_id.clone(),
                remote_offset: r.remote_offset,
                valid_epoch: r.valid_epoch,
                state: effective_state(r, any_live),
                recovery_seq: r.recovery_seq,
            })
            .collect();
        Ok(MapEntry {
            gpa_start: self.row.gpa_start,
            length_bytes: self.row.length_bytes,
            node_id: primary.node_id.clone(),
            remote_offset: primary.remote_offset,
            rdma: self.row.rdma,
            valid_epoch: primary.valid_epoch,
            state: if any_live {
                RangeState::Live
            } else {
                RangeState::Lost
            },
            replicas,
        })
    }
}

/// The reported state of `replica` in a range where some replica is (or
/// none is) effectively live. When `replica` is itself live, `any_live`
/// holds, so "another is live" and "any is live" agree for the rest.
fn effective_state(replica: &StoredReplica, any_live: bool) -> ReplicaState {
    if replica.is_live() {
        ReplicaState::Live
    } else if replica.is_recovering() {
        ReplicaState::Recovering
    } else if any_live {
        ReplicaState::Stale
    } else {
        ReplicaState::Lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(
        node_id: &str,
        state: StoredState,
        valid_epoch: u64,
        node_epoch: u64,
    ) -> StoredReplica {
        StoredReplica {
            node_id: node_id.to_owned(),
            rank: 0,
            remote_offset: 0,
            valid_epoch,
            state,
            recovery_seq: 0,
            node_epoch,
            unconfirmed_until_ms: 0,
        }
    }

    fn states(replicas: Vec<StoredReplica>) -> (Vec<ReplicaState>, String, RangeState) {
        let range = StoredRange {
            row: RangeRow {
                gpa_start: 0,
                length_bytes: 4096,
                rdma: None,
            },
            replicas,
        };
        let entry = range.to_entry().expect("entry");
        let states = entry.replicas.iter().map(|r| r.state).collect();
        (states, entry.node_id, entry.state)
    }

    #[test]
    fn effective_states_follow_the_holders_epochs() {
        use ReplicaState::{Live, Lost, Recovering, Stale};
        use StoredState as S;
        // The rank-0 holder restarted: its replica is stale, b is primary.
        let (s, primary, range) = states(vec![
            replica("a", S::Live, 1, 2),
            replica("b", S::Live, 5, 5),
            replica("c", S::Recovering, 7, 7),
            replica("d", S::Recovering, 7, 8),
        ]);
        assert_eq!(s, [Stale, Live, Recovering, Stale]);
        assert_eq!((primary.as_str(), range), ("b", RangeState::Live));
        // Nothing live: every non-recovering replica is lost, a is named.
        let (s, primary, range) = states(vec![
            replica("a", S::Live, 1, 2),
            replica("b", S::Stale, 5, 5),
            replica("c", S::Recovering, 7, 7),
        ]);
        assert_eq!(s, [Lost, Lost, Recovering]);
        assert_eq!((primary.as_str(), range), ("a", RangeState::Lost));
        // Epoch 0 is not checked.
        let (s, _, range) = states(vec![replica("a", S::Live, 0, 9)]);
        assert_eq!((s, range), (vec![Live], RangeState::Live));
    }

    #[test]
    fn no_replica_is_corrupt() {
        let range = StoredRange {
            row: RangeRow {
                gpa_start: 0,
                length_bytes: 4096,
                rdma: None,
            },
            replicas: Vec::new(),
        };
        assert!(matches!(range.to_entry(), Err(StoreError::Corrupt(_))));
    }
}
