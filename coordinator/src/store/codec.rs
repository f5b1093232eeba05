//! Mapping between Rust values and SQLite columns.

use rdma_transport::coordinator::api::{RdmaEndpoint, RdmaRegion};
use rusqlite::Row;

use super::effective::{RangeRow, StoredReplica};

const SIGN_BIT: u64 = 1 << 63;

/// Encodes a `u64` as an `i64` that sorts the same way (flip the top bit).
/// SQLite integers are signed, so storing `u64` bit patterns directly would
/// put addresses at or above 2^63 before 0.
pub(super) fn enc(value: u64) -> i64 {
    i64::from_ne_bytes((value ^ SIGN_BIT).to_ne_bytes())
}

/// Inverse of [`enc`].
pub(super) fn dec(value: i64) -> u64 {
    u64::from_ne_bytes(value.to_ne_bytes()) ^ SIGN_BIT
}

/// A millisecond timestamp as stored (plain, saturating at `i64::MAX`).
pub(super) fn ms_to_sql(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

/// A stored millisecond timestamp (a negative one, never written, as 0).
pub(super) fn ms_from_sql(ms: i64) -> u64 {
    u64::try_from(ms).unwrap_or(0)
}

/// An epoch as stored: its bit pattern (epochs are only compared for
/// equality; 0 stays 0).
pub(super) fn epoch_to_sql(epoch: u64) -> i64 {
    i64::from_ne_bytes(epoch.to_ne_bytes())
}

/// Inverse of [`epoch_to_sql`].
pub(super) fn epoch_from_sql(value: i64) -> u64 {
    u64::from_ne_bytes(value.to_ne_bytes())
}

/// Columns selected by [`range_row`], in order, from `map_entries`.
pub(super) const RANGE_COLUMNS: &str = "gpa_start, length_bytes, rdma_addr, rdma_rkey";

/// Reads a range row of [`RANGE_COLUMNS`].
pub(super) fn range_row(row: &Row<'_>) -> rusqlite::Result<RangeRow> {
    let rdma_addr: Option<i64> = row.get(2)?;
    let rdma_rkey: Option<u32> = row.get(3)?;
    Ok(RangeRow {
        gpa_start: dec(row.get(0)?),
        length_bytes: dec(row.get(1)?),
        rdma: match (rdma_addr, rdma_rkey) {
            (Some(addr), Some(rkey)) => Some(RdmaRegion {
                addr: dec(addr),
                rkey,
            }),
            _ => None,
        },
    })
}

/// Columns selected by [`replica_row`], in order, from `map_replicas AS r`
/// (the last one is the holder's current epoch, for the replica's
/// effective state); select `FROM` [`REPLICA_FROM`].
pub(super) const REPLICA_COLUMNS: &str =
    "r.gpa_start, r.node_id, r.rank, r.remote_offset, r.valid_epoch, r.state, r.recovery_seq,
     (SELECT epoch FROM nodes WHERE nodes.id = r.node_id), r.unconfirmed_until_ms";

/// The table [`REPLICA_COLUMNS`] reads.
pub(super) const REPLICA_FROM: &str = "map_replicas AS r";

/// Reads a replica row of [`REPLICA_COLUMNS`]: its range's `gpa_start` and
/// the replica.
pub(super) fn replica_row(row: &Row<'_>) -> rusqlite::Result<(u64, StoredReplica)> {
    // No holder row cannot happen (foreign key); read as "unknown" (0).
    let node_epoch = epoch_from_sql(row.get::<_, Option<i64>>(7)?.unwrap_or(0));
    Ok((
        dec(row.get(0)?),
        StoredReplica {
            node_id: row.get(1)?,
            rank: row.get(2)?,
            remote_offset: dec(row.get(3)?),
            valid_epoch: epoch_from_sql(row.get(4)?),
            state: row.get(5)?,
            recovery_seq: dec(row.get(6)?),
            node_epoch,
            unconfirmed_until_ms: ms_from_sql(row.get(8)?),
        },
    ))
}

/// Columns selected by [`node_from_row`], in order.
pub(super) const NODE_COLUMNS: &str =
    "id, tcp_addr, rdma_device, rdma_port, rdma_gid, rdma_gid_index, rdma_lid,
     last_seen_unix_ms, epoch";

/// A node row before its RDMA columns are checked for completeness.
pub(super) struct NodeRow {
    pub id: String,
    pub tcp_addr: String,
    pub rdma_device: Option<String>,
    pub rdma_port: Option<u8>,
    pub rdma_gid: Option<String>,
    pub rdma_gid_index: Option<u8>,
    pub rdma_lid: Option<u16>,
    pub last_seen_unix_ms: i64,
    pub epoch: i64,
}

/// Reads a node row of [`NODE_COLUMNS`].
pub(super) fn node_row(row: &Row<'_>) -> rusqlite::Result<NodeRow> {
    Ok(NodeRow {
        id: row.get(0)?,
        tcp_addr: row.get(1)?,
        rdma_device: row.get(2)?,
        rdma_port: row.get(3)?,
        rdma_gid: row.get(4)?,
        rdma_gid_index: row.get(5)?,
        rdma_lid: row.get(6)?,
        last_seen_unix_ms: row.get(7)?,
        epoch: row.get(8)?,
    })
}

impl NodeRow {
    /// The RDMA endpoint: all columns set, or none.
    pub fn rdma(&self) -> Result<Option<RdmaEndpoint>, String> {
        match (
            &self.rdma_device,
            self.rdma_port,
            &self.rdma_gid,
            self.rdma_gid_index,
            self.rdma_lid,
        ) {
            (None, None, None, None, None) => Ok(None),
            (Some(device), Some(port), Some(gid), Some(gid_index), Some(lid)) => {
                Ok(Some(RdmaEndpoint {
                    device: device.clone(),
                    port,
                    gid: gid.clone(),
                    gid_index,
                    lid,
                }))
            }
            _ => Err(format!("node {:?} has a partial RDMA endpoint", self.id)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{dec, enc};

    #[test]
    fn encoding_round_trips_and_keeps_order() {
        let values = [
            0,
            1,
            4096,
            (1 << 63) - 1,
            1 << 63,
            u64::MAX - 4095,
            u64::MAX,
        ];
        for pair in values.windows(2) {
            assert!(enc(pair[0]) < enc(pair[1]), "{pair:?}");
        }
        for v in values {
            assert_eq!(dec(enc(v)), v);
        }
    }
}
