//! Node rows: register, heartbeat, publish an RDMA endpoint, delete.

use rdma_transport::coordinator::api::{NodeRegistration, RdmaEndpoint};
use rusqlite::{params, Connection, OptionalExtension};

use super::codec::{epoch_from_sql, epoch_to_sql, ms_to_sql, node_row, NODE_COLUMNS};
use super::schema::bump_version;
use super::{NodeRecord, SqliteStore, StoreError};

impl SqliteStore {
    /// Registers `id` or replaces its registration (the RDMA endpoint and
    /// epoch included), and sets its `last_seen`. Bumps the version when the
    /// node is new or its TCP address, RDMA endpoint or epoch changed (a new
    /// epoch turns its replicas stale or lost; their `valid_epoch` is kept).
    pub fn upsert_node(
        &mut self,
        id: &str,
        registration: &NodeRegistration,
        now_unix_ms: u64,
    ) -> Result<NodeRecord, StoreError> {
        let tx = self.conn.transaction()?;
        let before = get(&tx, id)?;
        if before.is_none() {
            let count: i64 = tx.query_row("SELECT COUNT(*) FROM nodes", [], |r| r.get(0))?;
            if usize::try_from(count).unwrap_or(usize::MAX) >= self.limits.max_nodes {
                return Err(StoreError::LimitReached {
                    what: "node",
                    max: self.limits.max_nodes,
                });
            }
        }
        let changed = match &before {
            None => true,
            Some(old) => {
                old.tcp_addr != registration.tcp_addr
                    || old.rdma != registration.rdma
                    || old.epoch != registration.epoch
            }
        };
        let rdma = registration.rdma.as_ref();
        tx.execute(
            "INSERT INTO nodes (id, tcp_addr, rdma_device, rdma_port, rdma_gid, rdma_gid_index,
                                rdma_lid, last_seen_unix_ms, epoch)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
             ON CONFLICT(id) DO UPDATE SET
                tcp_addr = excluded.tcp_addr, rdma_device = excluded.rdma_device,
                rdma_port = excluded.rdma_port, rdma_gid = excluded.rdma_gid,
                rdma_gid_index = excluded.rdma_gid_index, rdma_lid = excluded.rdma_lid,
                last_seen_unix_ms = excluded.last_seen_unix_ms, epoch = excluded.epoch",
            params![
                id,
                registration.tcp_addr,
                rdma.map(|r| &r.device),
                rdma.map(|r| r.port),
                rdma.map(|r| &r.gid),
                rdma.map(|r| r.gid_index),
                rdma.map(|r| r.lid),
                ms_to_sql(now_unix_ms),
                epoch_to_sql(registration.epoch),
            ],
        )?;
        if changed {
            bump_version(&tx)?;
        }
        let record = required(&tx, id)?;
        tx.commit()?;
        Ok(record)
    }

    /// Refreshes `last_seen`; `None` when the node is unknown. With
    /// `epoch`, only when it is the node's current epoch: a heartbeat from
    /// a process that another one replaced renews nothing
    /// ([`StoreError::NotCurrentProcess`]).
    pub fn heartbeat(
        &mut self,
        id: &str,
        epoch: Option<u64>,
        now_unix_ms: u64,
    ) -> Result<Option<NodeRecord>, StoreError> {
        let tx = self.conn.transaction()?;
        let Some(before) = get(&tx, id)? else {
            return Ok(None);
        };
        before.check_heartbeat(epoch)?;
        tx.execute(
            "UPDATE nodes SET last_seen_unix_ms = ?2 WHERE id = ?1",
            params![id, ms_to_sql(now_unix_ms)],
        )?;
        let record = required(&tx, id)?;
        tx.commit()?;
        Ok(Some(record))
    }

    /// Sets the node's RDMA endpoint; bumps the version when it changed.
    /// `None` when the node is unknown.
    pub fn set_rdma_endpoint(
        &mut self,
        id: &str,
        endpoint: &RdmaEndpoint,
    ) -> Result<Option<NodeRecord>, StoreError> {
        let tx = self.conn.transaction()?;
        let Some(before) = get(&tx, id)? else {
            return Ok(None);
        };
        if before.rdma.as_ref() != Some(endpoint) {
            tx.execute(
                "UPDATE nodes SET rdma_device = ?2, rdma_port = ?3, rdma_gid = ?4,
                                  rdma_gid_index = ?5, rdma_lid = ?6
                 WHERE id = ?1",
                params![
                    id,
                    endpoint.device,
                    endpoint.port,
                    endpoint.gid,
                    endpoint.gid_index,
                    endpoint.lid
                ],
            )?;
            bump_version(&tx)?;
        }
        let record = required(&tx, id)?;
        tx.commit()?;
        Ok(Some(record))
    }

    /// One node.
    pub fn node(&self, id: &str) -> Result<Option<NodeRecord>, StoreError> {
        get(&self.conn, id)
    }

    /// Every node, sorted by id.
    pub fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        all(&self.conn)
    }

    /// Removes a node and every replica it holds (and the ranges left
    /// without one); bumps the version. False when the node is unknown.
    pub fn delete_node(&mut self, id: &str) -> Result<bool, StoreError> {
        let tx = self.conn.transaction()?;
        tx.execute("DELETE FROM map_replicas WHERE node_id = ?1", [id])?;
        let removed = tx.execute("DELETE FROM nodes WHERE id = ?1", [id])?;
        if removed == 0 {
            return Ok(false);
        }
        super::map::remove_ranges_without_replicas(&tx)?;
        bump_version(&tx)?;
        tx.commit()?;
        Ok(true)
    }
}

/// One node, if registered.
pub(super) fn get(conn: &Connection, id: &str) -> Result<Option<NodeRecord>, StoreError> {
    let sql = format!("SELECT {NODE_COLUMNS} FROM nodes WHERE id = ?1");
    let row = conn.query_row(&sql, [id], node_row).optional()?;
    row.map(record).transpose()
}

/// A node that must exist (just written in the same transaction).
fn required(conn: &Connection, id: &str) -> Result<NodeRecord, StoreError> {
    get(conn, id)?.ok_or_else(|| StoreError::Corrupt(format!("node {id:?} vanished")))
}

/// Every node, sorted by id.
pub(super) fn all(conn: &Connection) -> Result<Vec<NodeRecord>, StoreError> {
    let sql = format!("SELECT {NODE_COLUMNS} FROM nodes ORDER BY id");
    let mut statement = conn.prepare(&sql)?;
    let rows = statement.query_map([], node_row)?;
    rows.map(|row| record(row?)).collect()
}

fn record(row: super::codec::NodeRow) -> Result<NodeRecord, StoreError> {
    let rdma = row.rdma().map_err(StoreError::Corrupt)?;
    let last_seen_unix_ms = u64::try_from(row.last_seen_unix_ms).unwrap_or(0);
    Ok(NodeRecord {
        id: row.id,
        tcp_addr: row.tcp_addr,
        rdma,
        last_seen_unix_ms,
        epoch: epoch_from_sql(row.epoch),
        lease_alive: None,
    })
}
