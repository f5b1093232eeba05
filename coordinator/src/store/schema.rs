//! Database settings, schema creation and the version counter.

use rusqlite::{Connection, OptionalExtension};

use super::StoreError;

/// Schema revision kept in `PRAGMA user_version`.
const SCHEMA_REVISION: i64 = 2;

/// Tables of revision 1. Every `u64` column holds the value in the
/// order-preserving encoding of `codec.rs` (`value XOR 2^63` as a signed
/// INTEGER), so SQLite's signed comparison orders them as `u64`.
pub(super) const SCHEMA_V1_SQL: &str = "
CREATE TABLE IF NOT EXISTS nodes (
    id                TEXT PRIMARY KEY NOT NULL,
    tcp_addr          TEXT NOT NULL,
    rdma_device       TEXT,
    rdma_port         INTEGER,
    rdma_gid          TEXT,
    rdma_gid_index    INTEGER,
    rdma_lid          INTEGER,
    last_seen_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS map_entries (
    gpa_start     INTEGER PRIMARY KEY NOT NULL,
    length_bytes  INTEGER NOT NULL,
    node_id       TEXT NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
    remote_offset INTEGER NOT NULL,
    rdma_addr     INTEGER,
    rdma_rkey     INTEGER
);
CREATE INDEX IF NOT EXISTS map_entries_node ON map_entries(node_id);
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY NOT NULL,
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO meta (key, value) VALUES ('version', 0);
";

/// Revision 1 to 2: epochs. `nodes.epoch` is the epoch of the node's last
/// registration, `map_entries.valid_epoch` the owner epoch whose memory
/// holds the range's valid contents. Epochs are only compared for equality,
/// so they are stored as their plain bit pattern (see `codec::epoch_to_sql`);
/// 0 is "unknown" (rows from revision 1, nodes that send no epoch).
const MIGRATE_V2_SQL: &str = "
ALTER TABLE nodes ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
ALTER TABLE map_entries ADD COLUMN valid_epoch INTEGER NOT NULL DEFAULT 0;
";

/// Sets the connection up (WAL, full sync, foreign keys), and creates the
/// schema or migrates an older revision's, in one transaction.
pub(super) fn prepare(conn: &mut Connection) -> Result<(), StoreError> {
    // journal_mode answers with the mode in force; anything but "wal" (e.g. an
    // in-memory database) would lose the crash-safety this service promises.
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Corrupt(format!(
            "cannot switch the database to WAL mode (got {mode:?})"
        )));
    }
    conn.execute_batch(
        "PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 5000;",
    )?;
    let revision: i64 = conn.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    if revision > SCHEMA_REVISION {
        return Err(StoreError::Corrupt(format!(
            "schema revision {revision} is newer than this coordinator's {SCHEMA_REVISION}"
        )));
    }
    let tx = conn.transaction()?;
    // A new database is revision 0 and takes every step; an existing one
    // only the steps past its revision.
    tx.execute_batch(SCHEMA_V1_SQL)?;
    if revision < 2 {
        tx.execute_batch(MIGRATE_V2_SQL)?;
    }
    tx.pragma_update(None, "user_version", SCHEMA_REVISION)?;
    tx.commit()?;
    Ok(())
}

/// The map version.
pub(super) fn version(conn: &Connection) -> Result<u64, StoreError> {
    let value: Option<i64> = conn
        .query_row("SELECT value FROM meta WHERE key = 'version'", [], |row| {
            row.get(0)
        })
        .optional()?;
    let value = value.ok_or_else(|| StoreError::Corrupt("no version row".to_owned()))?;
    u64::try_from(value).map_err(|_| StoreError::Corrupt(format!("negative version {value}")))
}

/// Increases the version by one; call inside the write's transaction.
pub(super) fn bump_version(conn: &Connection) -> Result<(), StoreError> {
    conn.execute(
        "UPDATE meta SET value = value + 1 WHERE key = 'version'",
        [],
    )?;
    Ok(())
}
