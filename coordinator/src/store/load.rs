//! Reading ranges with their replicas (in rank order).

use rusqlite::{Connection, OptionalExtension};

use super::codec::{enc, range_row, replica_row, RANGE_COLUMNS, REPLICA_COLUMNS, REPLICA_FROM};
use super::effective::{RangeRow, StoredRange};
use super::StoreError;

/// The range that starts exactly at `gpa_start`.
pub(super) fn at(conn: &Connection, gpa_start: u64) -> Result<Option<StoredRange>, StoreError> {
    let sql = format!("SELECT {RANGE_COLUMNS} FROM map_entries WHERE gpa_start = ?1");
    one(conn, &sql, gpa_start)
}

/// The range at `gpa_start`, or [`StoreError::NoRange`].
pub(super) fn required(conn: &Connection, gpa_start: u64) -> Result<StoredRange, StoreError> {
    at(conn, gpa_start)?.ok_or(StoreError::NoRange(gpa_start))
}

/// The range with the greatest `gpa_start <= gpa`.
pub(super) fn at_or_before(conn: &Connection, gpa: u64) -> Result<Option<StoredRange>, StoreError> {
    let sql = format!(
        "SELECT {RANGE_COLUMNS} FROM map_entries WHERE gpa_start <= ?1
         ORDER BY gpa_start DESC LIMIT 1"
    );
    one(conn, &sql, gpa)
}

/// The range with the smallest `gpa_start > gpa`.
pub(super) fn after(conn: &Connection, gpa: u64) -> Result<Option<StoredRange>, StoreError> {
    let sql = format!(
        "SELECT {RANGE_COLUMNS} FROM map_entries WHERE gpa_start > ?1
         ORDER BY gpa_start ASC LIMIT 1"
    );
    one(conn, &sql, gpa)
}

/// Every range, sorted by `gpa_start`, read with two queries (ranges, then
/// every replica in the same order) merged here.
pub(super) fn all(conn: &Connection) -> Result<Vec<StoredRange>, StoreError> {
    let sql = format!("SELECT {RANGE_COLUMNS} FROM map_entries ORDER BY gpa_start");
    let mut statement = conn.prepare(&sql)?;
    let rows: Vec<RangeRow> = statement
        .query_map([], range_row)?
        .collect::<Result<_, _>>()?;
    let sql = format!("SELECT {REPLICA_COLUMNS} FROM {REPLICA_FROM} ORDER BY r.gpa_start, r.rank");
    let mut statement = conn.prepare(&sql)?;
    let mut replicas = statement.query_map([], replica_row)?.peekable();
    let mut ranges = Vec::with_capacity(rows.len());
    for row in rows {
        let mut range = StoredRange {
            row,
            replicas: Vec::new(),
        };
        // Both lists are sorted by gpa_start, and every replica's range
        // exists (foreign key): take the replicas of this range.
        while let Some(next) = replicas.next_if(|r| match r {
            Ok((gpa_start, _)) => *gpa_start <= range.row.gpa_start,
            Err(_) => true,
        }) {
            let (gpa_start, replica) = next?;
            if gpa_start == range.row.gpa_start {
                range.replicas.push(replica);
            }
        }
        ranges.push(range);
    }
    Ok(ranges)
}

/// The range selected by `sql` (one `?1` parameter, `gpa`), with its
/// replicas.
fn one(conn: &Connection, sql: &str, gpa: u64) -> Result<Option<StoredRange>, StoreError> {
    let Some(row) = conn.query_row(sql, [enc(gpa)], range_row).optional()? else {
        return Ok(None);
    };
    let sql = format!(
        "SELECT {REPLICA_COLUMNS} FROM {REPLICA_FROM} WHERE r.gpa_start = ?1 ORDER BY r.rank"
    );
    let mut statement = conn.prepare_cached(&sql)?;
    let replicas = statement
        .query_map([enc(row.gpa_start)], replica_row)?
        .map(|r| r.map(|(_, replica)| replica))
        .collect::<Result<_, _>>()?;
    Ok(Some(StoredRange { row, replicas }))
}
