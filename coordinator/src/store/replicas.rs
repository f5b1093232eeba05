//! Replica state changes: a replica that missed a write goes `stale`, its
//! holder copies the range in (`recovering`, numbered by `recovery_seq`)
//! and, once done, it is `live` again.

use rdma_transport::coordinator::api::{MapEntry, RangeRequest};
use rusqlite::{params, Connection};

use super::codec::{enc, epoch_to_sql, ms_to_sql};
use super::effective::{StoredRange, StoredReplica, StoredState};
use super::schema::{bump_version, version};
use super::{load, SqliteStore, StoreError};

/// Why a replica state change was refused (a conflict with the range's
/// current state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplicaRefusal {
    /// Marking stale the only live replica would lose the range.
    #[error("it is the range's only live replica (the last live replica is never marked stale)")]
    LastLive,
    /// A recovery needs a live replica to copy from.
    #[error("no other replica of the range is live: there is nothing to copy from")]
    NoLiveSource,
    /// A live replica has nothing to recover.
    #[error("the replica is live: there is nothing to recover")]
    AlreadyLive,
    /// Finishing a recovery that is not under way.
    #[error("the replica is not recovering (it is {stored}); begin a recovery first")]
    NotRecovering {
        /// The stored state.
        stored: &'static str,
    },
    /// Finishing a recovery that was overtaken by another.
    #[error("recovery {presented} was overtaken: the replica's recovery is now {current}")]
    SeqMismatch {
        /// The number the caller finished.
        presented: u64,
        /// The number of the recovery under way.
        current: u64,
    },
    /// The holder restarted since the recovery began: what it copied is gone.
    #[error("the node restarted since the recovery began (its epoch changed): begin again")]
    EpochChanged,
    /// The caller is not the node's current process: an earlier process of
    /// the node (still running somewhere) must not recover, nor turn live,
    /// memory that the current process does not hold.
    #[error("epoch {presented:#x} is not the node's current epoch ({current:#x}): only the node's current process recovers its replica")]
    NotCurrentEpoch {
        /// The epoch the caller named.
        presented: u64,
        /// The node's current epoch (0: unknown).
        current: u64,
    },
}

impl SqliteStore {
    /// Marks `node_id`'s replica of the range at `gpa_start` stale (from
    /// any stored state): it missed a write. Returns the version and entry.
    /// Bumps the version unless it was stale already.
    ///
    /// # Errors
    /// [`StoreError::NoRange`], [`StoreError::NoReplica`];
    /// [`ReplicaRefusal::LastLive`] when it is the range's only live replica.
    pub fn mark_replica_stale(
        &mut self,
        gpa_start: u64,
        node_id: &str,
    ) -> Result<(u64, MapEntry), StoreError> {
        self.change_replica(gpa_start, node_id, |conn, range, replica| {
            if replica.is_live() && !range.other_is_live(node_id) {
                return Ok(Outcome::Refused(ReplicaRefusal::LastLive));
            }
            if replica.state == StoredState::Stale {
                return Ok(Outcome::Unchanged);
            }
            set_state(conn, gpa_start, node_id, StoredState::Stale)?;
            Ok(Outcome::Changed)
        })
    }

    /// Begins a recovery of `node_id`'s replica of the range at
    /// `gpa_start`: stored `recovering` in the holder's current epoch, with
    /// the next `recovery_seq`, by the node's process in `epoch`. Always a
    /// change.
    ///
    /// # Errors
    /// [`StoreError::NoRange`], [`StoreError::NoReplica`];
    /// [`ReplicaRefusal::NotCurrentEpoch`], [`ReplicaRefusal::AlreadyLive`],
    /// [`ReplicaRefusal::NoLiveSource`].
    pub fn begin_recovery(
        &mut self,
        gpa_start: u64,
        node_id: &str,
        epoch: u64,
    ) -> Result<(u64, MapEntry), StoreError> {
        self.change_replica(gpa_start, node_id, |conn, range, replica| {
            if epoch != replica.node_epoch {
                return Ok(Outcome::Refused(ReplicaRefusal::NotCurrentEpoch {
                    presented: epoch,
                    current: replica.node_epoch,
                }));
            }
            if replica.is_live() {
                return Ok(Outcome::Refused(ReplicaRefusal::AlreadyLive));
            }
            if !range.other_is_live(node_id) {
                return Ok(Outcome::Refused(ReplicaRefusal::NoLiveSource));
            }
            let next_seq = replica.recovery_seq.checked_add(1).ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "recovery_seq of {node_id:?} at {gpa_start:#x} is at its maximum"
                ))
            })?;
            conn.execute(
                "UPDATE map_replicas SET state = ?3, valid_epoch = ?4, recovery_seq = ?5
                 WHERE gpa_start = ?1 AND node_id = ?2",
                params![
                    enc(gpa_start),
                    node_id,
                    StoredState::Recovering.as_sql(),
                    epoch_to_sql(replica.node_epoch),
                    enc(next_seq)
                ],
            )?;
            Ok(Outcome::Changed)
        })
    }

    /// Finishes recovery `recovery_seq` of `node_id`'s replica of the range
    /// at `gpa_start`: stored `live` again. Only the recovery under way,
    /// begun by the holder's current process (`epoch`), can finish.
    ///
    /// # Errors
    /// [`StoreError::NoRange`], [`StoreError::NoReplica`];
    /// [`ReplicaRefusal::NotCurrentEpoch`], [`ReplicaRefusal::NotRecovering`],
    /// [`ReplicaRefusal::SeqMismatch`], [`ReplicaRefusal::EpochChanged`].
    pub fn finish_recovery(
        &mut self,
        gpa_start: u64,
        node_id: &str,
        recovery_seq: u64,
        epoch: u64,
    ) -> Result<(u64, MapEntry), StoreError> {
        self.change_replica(gpa_start, node_id, |conn, _range, replica| {
            if epoch != replica.node_epoch {
                return Ok(Outcome::Refused(ReplicaRefusal::NotCurrentEpoch {
                    presented: epoch,
                    current: replica.node_epoch,
                }));
            }
            if replica.state != StoredState::Recovering {
                let stored = replica.state.as_sql();
                return Ok(Outcome::Refused(ReplicaRefusal::NotRecovering { stored }));
            }
            if replica.recovery_seq != recovery_seq {
                return Ok(Outcome::Refused(ReplicaRefusal::SeqMismatch {
                    presented: recovery_seq,
                    current: replica.recovery_seq,
                }));
            }
            if replica.valid_epoch != replica.node_epoch {
                return Ok(Outcome::Refused(ReplicaRefusal::EpochChanged));
            }
            set_state(conn, gpa_start, node_id, StoredState::Live)?;
            Ok(Outcome::Changed)
        })
    }

    /// Runs `change` on `node_id`'s replica of the range at `gpa_start` in
    /// one transaction; bumps the version when it made a change, returns
    /// [`StoreError::ReplicaRefused`] when it refused. Returns the version
    /// and the entry as they are after it.
    fn change_replica(
        &mut self,
        gpa_start: u64,
        node_id: &str,
        change: impl FnOnce(&Connection, &StoredRange, &StoredReplica) -> Result<Outcome, StoreError>,
    ) -> Result<(u64, MapEntry), StoreError> {
        let tx = self.conn.transaction()?;
        let range = load::required(&tx, gpa_start)?;
        let replica = range
            .replica(node_id)
            .ok_or_else(|| StoreError::NoReplica {
                gpa_start,
                node_id: node_id.to_owned(),
            })?;
        match change(&tx, &range, replica)? {
            Outcome::Changed => bump_version(&tx)?,
            Outcome::Unchanged => {}
            Outcome::Refused(refusal) => {
                return Err(StoreError::ReplicaRefused {
                    gpa_start,
                    node_id: node_id.to_owned(),
                    refusal,
                })
            }
        }
        let entry = load::required(&tx, gpa_start)?.to_entry()?;
        let version = version(&tx)?;
        tx.commit()?;
        Ok((version, entry))
    }
}

/// What a replica change did.
enum Outcome {
    Changed,
    Unchanged,
    Refused(ReplicaRefusal),
}

/// Inserts `request.node_id`'s replica of rank `rank`, in `state`, valid in
/// `valid_epoch`, with recovery_seq 0.
pub(super) fn insert(
    conn: &Connection,
    request: &RangeRequest,
    rank: i64,
    state: StoredState,
    valid_epoch: u64,
    unconfirmed_until_ms: u64,
) -> Result<(), StoreError> {
    conn.execute(
        "INSERT INTO map_replicas
            (gpa_start, node_id, rank, remote_offset, valid_epoch, state, recovery_seq,
             unconfirmed_until_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        params![
            enc(request.gpa_start),
            request.node_id,
            rank,
            enc(request.remote_offset),
            epoch_to_sql(valid_epoch),
            state.as_sql(),
            enc(0),
            ms_to_sql(unconfirmed_until_ms)
        ],
    )?;
    Ok(())
}

pub(super) fn set_state(
    conn: &Connection,
    gpa_start: u64,
    node_id: &str,
    state: StoredState,
) -> Result<(), StoreError> {
    conn.execute(
        "UPDATE map_replicas SET state = ?3 WHERE gpa_start = ?1 AND node_id = ?2",
        params![enc(gpa_start), node_id, state.as_sql()],
    )?;
    Ok(())
}
