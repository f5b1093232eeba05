//! Map entries: add a range or a replica of one (with the overlap check),
//! remove, re-initialise, resolve.

use rdma_transport::coordinator::api::{MapEntry, RangeRequest};
use rusqlite::{params, Connection};

use super::claims::{self, Joining};
use super::codec::{enc, epoch_to_sql};
use super::effective::{StoredRange, StoredState};
use super::schema::{bump_version, version};
use super::{load, nodes, replicas, AddOutcome, NodeRecord, SqliteStore, StoreError, StoreLimits};
use crate::clock::now_unix_ms;

impl SqliteStore {
    /// Adds a range, or a replica of one; the request must already be
    /// validated (aligned, no overflow).
    ///
    /// - A new range (overlapping none) gets one replica in the node's
    ///   current epoch, `live` unless the claimer says it missed writes
    ///   (`claims.rs`; [`AddOutcome::Created`]).
    /// - The same `gpa_start` and `length_bytes` as a range the node holds
    ///   no replica of: a new replica of higher rank in the node's current
    ///   epoch, stored `stale` (it must copy the contents in before it
    ///   serves; see [`SqliteStore::begin_recovery`]), or `live` when the
    ///   claimer holds the contents and the live replicas are unconfirmed
    ///   (`claims.rs`), refused past `max_replicas` ([`AddOutcome::Created`]).
    /// - A range the node already holds: its `remote_offset` is refreshed;
    ///   its state and `valid_epoch` are kept (a holder that restarted
    ///   re-claims its range with empty memory: its replica stays stale or
    ///   lost), unless that is 0 (unknown: an older database or a node that
    ///   sent no epoch), which the node's current epoch replaces
    ///   ([`AddOutcome::Updated`]).
    ///
    /// Bumps the version when something changed.
    ///
    /// # Errors
    /// [`StoreError::Overlap`] for a partial overlap or another length at
    /// the same start, [`StoreError::LimitReached`], [`StoreError::UnknownNode`].
    pub fn add_range(
        &mut self,
        request: &RangeRequest,
    ) -> Result<(MapEntry, AddOutcome), StoreError> {
        self.add_range_at(request, now_unix_ms())
    }

    /// [`SqliteStore::add_range`] at `now_unix_ms`.
    pub(crate) fn add_range_at(
        &mut self,
        request: &RangeRequest,
        now_unix_ms: u64,
    ) -> Result<(MapEntry, AddOutcome), StoreError> {
        let limits = self.limits;
        let tx = self.conn.transaction()?;
        let Some(node) = nodes::get(&tx, &request.node_id)? else {
            return Err(StoreError::UnknownNode(request.node_id.clone()));
        };
        let before = load::at_or_before(&tx, request.gpa_start)?;
        let outcome = match before {
            Some(existing) if existing.row.gpa_start == request.gpa_start => {
                if existing.row.length_bytes != request.length_bytes {
                    return Err(StoreError::Overlap {
                        existing: Box::new(existing.to_entry()?),
                    });
                }
                add_to_existing(&tx, limits, &existing, request, &node, now_unix_ms)?
            }
            before => {
                if let Some(existing) = before.filter(|e| e.end() > u128::from(request.gpa_start)) {
                    return Err(StoreError::Overlap {
                        existing: Box::new(existing.to_entry()?),
                    });
                }
                let request_end = u128::from(request.gpa_start) + u128::from(request.length_bytes);
                if let Some(existing) = load::after(&tx, request.gpa_start)?
                    .filter(|e| request_end > u128::from(e.row.gpa_start))
                {
                    return Err(StoreError::Overlap {
                        existing: Box::new(existing.to_entry()?),
                    });
                }
                check_range_limits(&tx, limits, &request.node_id)?;
                tx.execute(
                    "INSERT INTO map_entries (gpa_start, length_bytes) VALUES (?1, ?2)",
                    params![enc(request.gpa_start), enc(request.length_bytes)],
                )?;
                let (state, unconfirmed_until_ms) =
                    claims::first_replica(request.contents, now_unix_ms);
                replicas::insert(&tx, request, 0, state, node.epoch, unconfirmed_until_ms)?;
                bump_version(&tx)?;
                AddOutcome::Created
            }
        };
        let entry = load::required(&tx, request.gpa_start)?.to_entry()?;
        tx.commit()?;
        Ok((entry, outcome))
    }

    /// Removes the range that starts at `gpa_start`; false when there is
    /// none. With `holder`, only that node's replica is removed (the range
    /// goes with its last replica; [`StoreError::NotOwner`] when the node
    /// holds none). Bumps the version when something was removed.
    pub fn remove_range(
        &mut self,
        gpa_start: u64,
        holder: Option<&str>,
    ) -> Result<bool, StoreError> {
        let tx = self.conn.transaction()?;
        let Some(range) = load::at(&tx, gpa_start)? else {
            return Ok(false);
        };
        if let Some(holder) = holder {
            if range.replica(holder).is_none() {
                return Err(StoreError::NotOwner {
                    gpa_start,
                    owner: range.to_entry()?.node_id,
                });
            }
            tx.execute(
                "DELETE FROM map_replicas WHERE gpa_start = ?1 AND node_id = ?2",
                params![enc(gpa_start), holder],
            )?;
            remove_ranges_without_replicas(&tx)?;
        } else {
            // The replicas go with it (ON DELETE CASCADE).
            tx.execute(
                "DELETE FROM map_entries WHERE gpa_start = ?1",
                [enc(gpa_start)],
            )?;
        }
        bump_version(&tx)?;
        tx.commit()?;
        Ok(true)
    }

    /// Re-initialises the range that starts at `gpa_start` when it is lost:
    /// every replica becomes `live` in its holder's current epoch (the
    /// holders' memory, zeros after a restart, is its contents from now
    /// on). A range with a live replica is left as it is. Bumps the version
    /// when something changed.
    ///
    /// # Errors
    /// [`StoreError::NoRange`] when no range starts there.
    pub fn reinitialise_range(&mut self, gpa_start: u64) -> Result<MapEntry, StoreError> {
        let tx = self.conn.transaction()?;
        let range = load::required(&tx, gpa_start)?;
        if range.replicas.iter().any(|r| r.is_live()) {
            return range.to_entry();
        }
        let changed = tx.execute(
            "UPDATE map_replicas
             SET state = 'live',
                 valid_epoch = (SELECT epoch FROM nodes WHERE nodes.id = map_replicas.node_id)
             WHERE gpa_start = ?1",
            [enc(gpa_start)],
        )?;
        if changed > 0 {
            bump_version(&tx)?;
        }
        let entry = load::required(&tx, gpa_start)?.to_entry()?;
        tx.commit()?;
        Ok(entry)
    }

    /// The entry containing `gpa`, its primary's node and the version,
    /// read together.
    pub fn resolve(&mut self, gpa: u64) -> Result<Option<(u64, MapEntry, NodeRecord)>, StoreError> {
        let tx = self.conn.transaction()?;
        let Some(range) = load::at_or_before(&tx, gpa)?.filter(|e| e.end() > u128::from(gpa))
        else {
            return Ok(None);
        };
        let entry = range.to_entry()?;
        let node = nodes::get(&tx, &entry.node_id)?.ok_or_else(|| {
            StoreError::Corrupt(format!("replica holder {:?} is not a node", entry.node_id))
        })?;
        let version = version(&tx)?;
        tx.commit()?;
        Ok(Some((version, entry, node)))
    }
}

/// [`SqliteStore::add_range`] for a range that exists with the requested length:
/// refreshes `node`'s replica or adds one.
fn add_to_existing(
    conn: &Connection,
    limits: StoreLimits,
    existing: &StoredRange,
    request: &RangeRequest,
    node: &NodeRecord,
    now_unix_ms: u64,
) -> Result<AddOutcome, StoreError> {
    let gpa_start = request.gpa_start;
    if let Some(mine) = existing.replica(&request.node_id) {
        let valid_epoch = if mine.valid_epoch == 0 {
            node.epoch
        } else {
            mine.valid_epoch
        };
        if mine.remote_offset != request.remote_offset || mine.valid_epoch != valid_epoch {
            conn.execute(
                "UPDATE map_replicas SET remote_offset = ?3, valid_epoch = ?4
                 WHERE gpa_start = ?1 AND node_id = ?2",
                params![
                    enc(gpa_start),
                    request.node_id,
                    enc(request.remote_offset),
                    epoch_to_sql(valid_epoch)
                ],
            )?;
            bump_version(conn)?;
        }
        return Ok(AddOutcome::Updated);
    }
    if existing.replicas.len() >= limits.max_replicas {
        return Err(StoreError::LimitReached {
            what: "replicas per range",
            max: limits.max_replicas,
        });
    }
    check_per_node_limit(conn, limits, &request.node_id)?;
    let rank = existing.replicas.iter().map(|r| r.rank).max().unwrap_or(-1) + 1;
    let state = match claims::joining(existing, request.contents, now_unix_ms) {
        Joining::Stale => StoredState::Stale,
        Joining::Live { displaced } => {
            for holder in &displaced {
                replicas::set_state(conn, gpa_start, holder, StoredState::Stale)?;
            }
            tracing::warn!(
                gpa_start = format_args!("{gpa_start:#x}"),
                node = %request.node_id,
                ?displaced,
                "a claimer that holds the range's contents displaces its unconfirmed replicas"
            );
            StoredState::Live
        }
    };
    replicas::insert(conn, request, rank, state, node.epoch, 0)?;
    bump_version(conn)?;
    Ok(AddOutcome::Created)
}

/// Removes the ranges whose last replica went (with a node, or one by one).
pub(super) fn remove_ranges_without_replicas(conn: &Connection) -> Result<(), StoreError> {
    conn.execute(
        "DELETE FROM map_entries WHERE NOT EXISTS
            (SELECT 1 FROM map_replicas WHERE map_replicas.gpa_start = map_entries.gpa_start)",
        [],
    )?;
    Ok(())
}

/// Refuses one more range (with a replica of `node_id`) past `limits`.
fn check_range_limits(
    conn: &Connection,
    limits: StoreLimits,
    node_id: &str,
) -> Result<(), StoreError> {
    let total: i64 = conn.query_row("SELECT COUNT(*) FROM map_entries", [], |r| r.get(0))?;
    if usize::try_from(total).unwrap_or(usize::MAX) >= limits.max_ranges {
        return Err(StoreError::LimitReached {
            what: "range",
            max: limits.max_ranges,
        });
    }
    check_per_node_limit(conn, limits, node_id)
}

/// Refuses one more replica held by `node_id` past `limits` (a node's
/// ranges are the replicas it holds).
fn check_per_node_limit(
    conn: &Connection,
    limits: StoreLimits,
    node_id: &str,
) -> Result<(), StoreError> {
    let held: i64 = conn.query_row(
        "SELECT COUNT(*) FROM map_replicas WHERE node_id = ?1",
        [node_id],
        |r| r.get(0),
    )?;
    if usize::try_from(held).unwrap_or(usize::MAX) >= limits.max_ranges_per_node {
        return Err(StoreError::LimitReached {
            what: "ranges per node",
            max: limits.max_ranges_per_node,
        });
    }
    Ok(())
}

/// Every entry, sorted by `gpa_start`.
pub(super) fn all(conn: &Connection) -> Result<Vec<MapEntry>, StoreError> {
    load::all(conn)?.iter().map(StoredRange::to_entry).collect()
}
