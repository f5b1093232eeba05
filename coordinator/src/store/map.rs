//! Map entries: add (with overlap check), remove, resolve.

use rdma_transport::coordinator::api::{MapEntry, RangeRequest, RangeState};
use rusqlite::{params, Connection, OptionalExtension};

use super::codec::{enc, entry_from_row, epoch_to_sql, ENTRY_COLUMNS};
use super::schema::{bump_version, version};
use super::{nodes, AddOutcome, NodeRecord, Store, StoreError, StoreLimits};

impl Store {
    /// Adds a range; the request must already be validated (aligned, no
    /// overflow). An entry with the same `gpa_start`, `length_bytes` and
    /// `node_id` is refreshed instead ([`AddOutcome::Updated`]).
    ///
    /// A new range is valid in its owner's current epoch. A refreshed one
    /// keeps its `valid_epoch` (an owner that restarted re-claims its range
    /// with empty memory: the range stays `lost`), unless that is 0
    /// (unknown: a revision-1 database or an owner that sent no epoch), which
    /// the owner's current epoch replaces.
    ///
    /// Bumps the version when something changed.
    pub fn add_range(
        &mut self,
        request: &RangeRequest,
    ) -> Result<(MapEntry, AddOutcome), StoreError> {
        let limits = self.limits;
        let tx = self.conn.transaction()?;
        let Some(owner) = nodes::get(&tx, &request.node_id)? else {
            return Err(StoreError::UnknownNode(request.node_id.clone()));
        };
        let before = at_or_before(&tx, request.gpa_start)?;
        let valid_epoch = match &before {
            Some(e) if e.gpa_start == request.gpa_start && e.valid_epoch != 0 => e.valid_epoch,
            _ => owner.epoch,
        };
        let wanted = MapEntry {
            gpa_start: request.gpa_start,
            length_bytes: request.length_bytes,
            node_id: request.node_id.clone(),
            remote_offset: request.remote_offset,
            // Never stored or published: each client gets a key of its own
            // in the page-server's authenticated handshake.
            rdma: None,
            valid_epoch,
            state: RangeState::of(valid_epoch, owner.epoch),
            replicas: Vec::new(),
        };
        let is_new = !matches!(&before, Some(e) if e.gpa_start == request.gpa_start);
        if is_new {
            check_range_limits(&tx, limits, &request.node_id)?;
        }
        let outcome = match before {
            Some(existing) if existing.gpa_start == request.gpa_start => {
                if existing.length_bytes != request.length_bytes
                    || existing.node_id != request.node_id
                {
                    return Err(StoreError::Overlap { existing });
                }
                if existing != wanted {
                    write(&tx, &wanted)?;
                    bump_version(&tx)?;
                }
                AddOutcome::Updated
            }
            _ => {
                if let Some(existing) = before.filter(|e| end(e) > u128::from(request.gpa_start)) {
                    return Err(StoreError::Overlap { existing });
                }
                if let Some(existing) = after(&tx, request.gpa_start)?
                    .filter(|e| end(&wanted) > u128::from(e.gpa_start))
                {
                    return Err(StoreError::Overlap { existing });
                }
                write(&tx, &wanted)?;
                bump_version(&tx)?;
                AddOutcome::Created
            }
        };
        tx.commit()?;
        Ok((wanted, outcome))
    }

    /// Removes the entry that starts at `gpa_start`; false when there is none.
    /// With `owner`, only an entry of that node is removed
    /// ([`StoreError::NotOwner`] otherwise).
    pub fn remove_range(
        &mut self,
        gpa_start: u64,
        owner: Option<&str>,
    ) -> Result<bool, StoreError> {
        let tx = self.conn.transaction()?;
        if let Some(owner) = owner {
            let found = at_or_before(&tx, gpa_start)?.filter(|e| e.gpa_start == gpa_start);
            if let Some(entry) = found.filter(|e| e.node_id != owner) {
                return Err(StoreError::NotOwner {
                    gpa_start,
                    owner: entry.node_id,
                });
            }
        }
        let removed = tx.execute(
            "DELETE FROM map_entries WHERE gpa_start = ?1",
            [enc(gpa_start)],
        )?;
        if removed == 0 {
            return Ok(false);
        }
        bump_version(&tx)?;
        tx.commit()?;
        Ok(true)
    }

    /// Marks the range that starts at `gpa_start` re-initialised: valid in
    /// its owner's current epoch (the owner's memory, zeros after a restart,
    /// is its contents from now on). Bumps the version when that changed.
    ///
    /// # Errors
    /// [`StoreError::NoRange`] when no range starts there.
    pub fn reinitialise_range(&mut self, gpa_start: u64) -> Result<MapEntry, StoreError> {
        let tx = self.conn.transaction()?;
        let mut entry = at_or_before(&tx, gpa_start)?
            .filter(|e| e.gpa_start == gpa_start)
            .ok_or(StoreError::NoRange(gpa_start))?;
        let owner = nodes::get(&tx, &entry.node_id)?.ok_or_else(|| {
            StoreError::Corrupt(format!("entry owner {:?} is not a node", entry.node_id))
        })?;
        if entry.valid_epoch != owner.epoch {
            tx.execute(
                "UPDATE map_entries SET valid_epoch = ?2 WHERE gpa_start = ?1",
                params![enc(gpa_start), epoch_to_sql(owner.epoch)],
            )?;
            bump_version(&tx)?;
        }
        tx.commit()?;
        entry.valid_epoch = owner.epoch;
        entry.state = RangeState::Live;
        Ok(entry)
    }

    /// The entry containing `gpa`, its owner and the version, read together.
    pub fn resolve(&mut self, gpa: u64) -> Result<Option<(u64, MapEntry, NodeRecord)>, StoreError> {
        let tx = self.conn.transaction()?;
        let Some(entry) = at_or_before(&tx, gpa)?.filter(|e| end(e) > u128::from(gpa)) else {
            return Ok(None);
        };
        let node = nodes::get(&tx, &entry.node_id)?.ok_or_else(|| {
            StoreError::Corrupt(format!("entry owner {:?} is not a node", entry.node_id))
        })?;
        let version = version(&tx)?;
        tx.commit()?;
        Ok(Some((version, entry, node)))
    }
}

/// Refuses one more entry (of `node_id`) past `limits`.
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
    let owned: i64 = conn.query_row(
        "SELECT COUNT(*) FROM map_entries WHERE node_id = ?1",
        [node_id],
        |r| r.get(0),
    )?;
    if usize::try_from(owned).unwrap_or(usize::MAX) >= limits.max_ranges_per_node {
        return Err(StoreError::LimitReached {
            what: "ranges per node",
            max: limits.max_ranges_per_node,
        });
    }
    Ok(())
}

/// Every entry, sorted by `gpa_start`.
pub(super) fn all(conn: &Connection) -> Result<Vec<MapEntry>, StoreError> {
    let sql = format!("SELECT {ENTRY_COLUMNS} FROM map_entries ORDER BY gpa_start");
    let mut statement = conn.prepare(&sql)?;
    let rows = statement.query_map([], entry_from_row)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// One past the last byte of `entry`; u128 so that it cannot overflow.
fn end(entry: &MapEntry) -> u128 {
    u128::from(entry.gpa_start) + u128::from(entry.length_bytes)
}

/// The entry with the greatest `gpa_start <= gpa`.
fn at_or_before(conn: &Connection, gpa: u64) -> Result<Option<MapEntry>, StoreError> {
    let sql = format!(
        "SELECT {ENTRY_COLUMNS} FROM map_entries WHERE gpa_start <= ?1
         ORDER BY gpa_start DESC LIMIT 1"
    );
    Ok(conn
        .query_row(&sql, [enc(gpa)], entry_from_row)
        .optional()?)
}

/// The entry with the smallest `gpa_start > gpa`.
fn after(conn: &Connection, gpa: u64) -> Result<Option<MapEntry>, StoreError> {
    let sql = format!(
        "SELECT {ENTRY_COLUMNS} FROM map_entries WHERE gpa_start > ?1
         ORDER BY gpa_start ASC LIMIT 1"
    );
    Ok(conn
        .query_row(&sql, [enc(gpa)], entry_from_row)
        .optional()?)
}

/// Inserts or replaces `entry`.
fn write(conn: &Connection, entry: &MapEntry) -> Result<(), StoreError> {
    conn.execute(
        "INSERT OR REPLACE INTO map_entries
            (gpa_start, length_bytes, node_id, remote_offset, rdma_addr, rdma_rkey, valid_epoch)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            enc(entry.gpa_start),
            enc(entry.length_bytes),
            entry.node_id,
            enc(entry.remote_offset),
            entry.rdma.map(|r| enc(r.addr)),
            entry.rdma.map(|r| r.rkey),
            epoch_to_sql(entry.valid_epoch),
        ],
    )?;
    Ok(())
}
