//! Database settings, schema creation and the version counter.

use rusqlite::{Connection, OptionalExtension};

use super::StoreError;

/// Schema revision kept in `PRAGMA user_version`.
const SCHEMA_REVISION: i64 = 4;

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
pub(super) const MIGRATE_V2_SQL: &str = "
ALTER TABLE nodes ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
ALTER TABLE map_entries ADD COLUMN valid_epoch INTEGER NOT NULL DEFAULT 0;
";

/// Revision 2 to 3: replicas. A range (`map_entries`, now without an
/// owner) has one or more holders in `map_replicas`, each with its own
/// offset, valid epoch and stored state; `rank` is the order the holders
/// claimed the range in (the first is 0; a plain INTEGER, it never leaves
/// the store). `remote_offset` and `recovery_seq` are `u64`s in the
/// order-preserving encoding (so recovery_seq 0 is `-2^63`), `valid_epoch`
/// an epoch's bit pattern, `state` the stored state (`effective.rs` derives
/// the reported one). Each existing range becomes its rank-0 replica,
/// `live`, with its valid epoch.
///
/// SQLite cannot drop the old `node_id ... ON DELETE CASCADE` (deleting a
/// node must now remove only its replicas), so `map_entries` is rebuilt:
/// the old table is renamed away (nothing references it), the new one is
/// created and filled, the replicas are copied from the old one, and the
/// old one (with its index) is dropped. Runs inside `prepare`'s
/// transaction, so a failure leaves revision 2 as it was.
const MIGRATE_V3_SQL: &str = "
ALTER TABLE map_entries RENAME TO map_entries_v2;
CREATE TABLE map_entries (
    gpa_start     INTEGER PRIMARY KEY NOT NULL,
    length_bytes  INTEGER NOT NULL,
    rdma_addr     INTEGER,
    rdma_rkey     INTEGER
);
INSERT INTO map_entries (gpa_start, length_bytes, rdma_addr, rdma_rkey)
    SELECT gpa_start, length_bytes, rdma_addr, rdma_rkey FROM map_entries_v2;
CREATE TABLE map_replicas (
    gpa_start     INTEGER NOT NULL REFERENCES map_entries(gpa_start) ON DELETE CASCADE,
    node_id       TEXT NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
    rank          INTEGER NOT NULL CHECK (rank >= 0),
    remote_offset INTEGER NOT NULL,
    valid_epoch   INTEGER NOT NULL,
    state         TEXT NOT NULL CHECK (state IN ('live', 'recovering', 'stale')),
    recovery_seq  INTEGER NOT NULL,
    PRIMARY KEY (gpa_start, node_id),
    UNIQUE (gpa_start, rank)
);
CREATE INDEX map_replicas_node ON map_replicas(node_id);
INSERT INTO map_replicas
    (gpa_start, node_id, rank, remote_offset, valid_epoch, state, recovery_seq)
    SELECT gpa_start, node_id, 0, remote_offset, valid_epoch, 'live', -9223372036854775807 - 1
    FROM map_entries_v2;
DROP TABLE map_entries_v2;
";

/// Revision 3 to 4: `map_replicas.unconfirmed_until_ms`, until when (Unix
/// ms, plain) a claimer that holds the range's contents displaces the
/// replica (`claims.rs`); 0, every existing replica's, is never.
const MIGRATE_V4_SQL: &str = "
ALTER TABLE map_replicas ADD COLUMN unconfirmed_until_ms INTEGER NOT NULL DEFAULT 0;
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
    // (`SCHEMA_V1_SQL` only creates what is missing, but its index names a
    // column that revision 3 no longer has: run it for new databases only.)
    if revision < 1 {
        tx.execute_batch(SCHEMA_V1_SQL)?;
    }
    if revision < 2 {
        tx.execute_batch(MIGRATE_V2_SQL)?;
    }
    if revision < 3 {
        tx.execute_batch(MIGRATE_V3_SQL)?;
    }
    if revision < 4 {
        tx.execute_batch(MIGRATE_V4_SQL)?;
    }
    // The generation: chosen once, when the database is created (or first
    // opened by a release that knows it), and kept for its life.
    tx.execute(
        "INSERT OR IGNORE INTO meta (key, value) VALUES ('generation', ?1)",
        [i64::from_ne_bytes(
            (rdma_transport::ids::random_u64() | 1).to_ne_bytes(),
        )],
    )?;
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

/// The database's generation (`MapResponse::generation`): random, never 0,
/// stored as its bit pattern.
pub(super) fn generation(conn: &Connection) -> Result<u64, StoreError> {
    let value: Option<i64> = conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'generation'",
            [],
            |row| row.get(0),
        )
        .optional()?;
    let value = value.ok_or_else(|| StoreError::Corrupt("no generation row".to_owned()))?;
    Ok(u64::from_ne_bytes(value.to_ne_bytes()))
}

/// Increases the version by one; call inside the write's transaction.
pub(super) fn bump_version(conn: &Connection) -> Result<(), StoreError> {
    conn.execute(
        "UPDATE meta SET value = value + 1 WHERE key = 'version'",
        [],
    )?;
    Ok(())
}
