//! SQLite store tests on a temporary database file.

use rdma_transport::coordinator::api::{NodeRegistration, RangeRequest, RdmaEndpoint, RdmaRegion};

use super::{AddOutcome, SqliteStore, StoreError};

fn open() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(&dir.path().join("c.db")).expect("open");
    (dir, store)
}

fn registration(tcp_addr: &str) -> NodeRegistration {
    NodeRegistration {
        tcp_addr: tcp_addr.to_owned(),
        rdma: None,
        epoch: 0,
    }
}

fn range(gpa_start: u64, length_bytes: u64, node_id: &str) -> RangeRequest {
    RangeRequest {
        gpa_start,
        length_bytes,
        node_id: node_id.to_owned(),
        remote_offset: 0,
        rdma: None,
        contents: Default::default(),
    }
}

#[test]
fn version_moves_only_on_change() {
    let (_dir, mut store) = open();
    assert_eq!(store.version().expect("v"), 0);
    store
        .upsert_node("a", &registration("h:1"), 10)
        .expect("put");
    assert_eq!(store.version().expect("v"), 1);
    store
        .upsert_node("a", &registration("h:1"), 20)
        .expect("put");
    assert_eq!(store.version().expect("v"), 1, "same registration");
    store.heartbeat("a", None, 30).expect("hb");
    assert_eq!(store.version().expect("v"), 1, "heartbeat");
    store
        .upsert_node("a", &registration("h:2"), 40)
        .expect("put");
    assert_eq!(store.version().expect("v"), 2);
    let endpoint = RdmaEndpoint {
        device: "rxe0".to_owned(),
        port: 1,
        gid: "::ffff:127.0.0.1".to_owned(),
        gid_index: 1,
        lid: 0,
    };
    let node = store.set_rdma_endpoint("a", &endpoint).expect("rdma");
    assert_eq!(node.and_then(|n| n.rdma), Some(endpoint.clone()));
    assert_eq!(store.version().expect("v"), 3);
    store.set_rdma_endpoint("a", &endpoint).expect("rdma");
    assert_eq!(store.version().expect("v"), 3, "same endpoint");
    assert!(store
        .set_rdma_endpoint("b", &endpoint)
        .expect("rdma")
        .is_none());
    let node = store.node("a").expect("get").expect("exists");
    assert_eq!(node.last_seen_unix_ms, 40);
}

#[test]
fn overlaps_and_idempotent_re_add() {
    let (_dir, mut store) = open();
    store
        .upsert_node("a", &registration("h:1"), 0)
        .expect("put");
    store
        .upsert_node("b", &registration("h:2"), 0)
        .expect("put");
    let (_, outcome) = store.add_range(&range(0x10000, 0x4000, "a")).expect("add");
    assert_eq!(outcome, AddOutcome::Created);
    for overlapping in [
        range(0x10000, 0x1000, "a"),
        // (The same range by "b" is a replica of it: see replica_tests.rs.)
        range(0x10000, 0x1000, "b"),
        range(0xf000, 0x2000, "b"),
        range(0x13000, 0x1000, "b"),
        range(0x8000, 0x10000, "b"),
    ] {
        let result = store.add_range(&overlapping);
        assert!(
            matches!(result, Err(StoreError::Overlap { .. })),
            "{overlapping:?}: {result:?}"
        );
    }
    let (_, outcome) = store
        .add_range(&range(0xc000, 0x4000, "b"))
        .expect("adjacent before");
    assert_eq!(outcome, AddOutcome::Created);
    let (_, outcome) = store
        .add_range(&range(0x14000, 0x1000, "b"))
        .expect("adjacent after");
    assert_eq!(outcome, AddOutcome::Created);
    let version = store.version().expect("v");
    let mut again = range(0x10000, 0x4000, "a");
    let (_, outcome) = store.add_range(&again).expect("same");
    assert_eq!(outcome, AddOutcome::Updated);
    assert_eq!(store.version().expect("v"), version, "nothing changed");
    again.remote_offset = 0x8000;
    again.rdma = Some(RdmaRegion {
        addr: 0x7f00_0000_0000,
        rkey: 7,
    });
    let (entry, outcome) = store.add_range(&again).expect("refresh");
    assert_eq!(outcome, AddOutcome::Updated);
    assert_eq!(entry.remote_offset, 0x8000);
    assert_eq!(store.version().expect("v"), version + 1);
    let snapshot = store.snapshot().expect("snapshot");
    let starts: Vec<u64> = snapshot.entries.iter().map(|e| e.gpa_start).collect();
    assert_eq!(starts, [0xc000, 0x10000, 0x14000]);
    assert_eq!(
        snapshot.entries[1].rdma, None,
        "a region key is never stored"
    );
    assert!(matches!(
        store.add_range(&range(0, 0x1000, "nobody")),
        Err(StoreError::UnknownNode(_))
    ));
}

#[test]
fn resolve_and_high_addresses() {
    let (_dir, mut store) = open();
    store
        .upsert_node("a", &registration("h:1"), 0)
        .expect("put");
    let top = u64::MAX - 0xfff;
    store.add_range(&range(top, 0x1000, "a")).expect("top page");
    store.add_range(&range(0, 0x2000, "a")).expect("bottom");
    store
        .add_range(&range(1 << 63, 0x1000, "a"))
        .expect("middle");
    let mut hit = |gpa| store_resolve(&mut store, gpa);
    assert_eq!(hit(0), Some(0));
    assert_eq!(hit(0x1fff), Some(0));
    assert_eq!(hit(0x2000), None);
    assert_eq!(hit((1 << 63) + 5), Some(1 << 63));
    assert_eq!(hit((1 << 63) - 1), None);
    assert_eq!(hit(u64::MAX), Some(top));
    assert!(store.remove_range(top, None).expect("rm"));
    assert!(!store.remove_range(top, None).expect("rm again"));
    assert_eq!(store_resolve(&mut store, u64::MAX), None);
    assert!(store.delete_node("a").expect("del"));
    assert!(store.snapshot().expect("snap").entries.is_empty());
    assert!(!store.delete_node("a").expect("del again"));
}

fn store_resolve(store: &mut SqliteStore, gpa: u64) -> Option<u64> {
    store
        .resolve(gpa)
        .expect("resolve")
        .map(|(_, entry, _)| entry.gpa_start)
}

#[test]
fn state_survives_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.db");
    {
        let mut store = SqliteStore::open(&path).expect("open");
        store
            .upsert_node("a", &registration("h:1"), 5)
            .expect("put");
        store.add_range(&range(0x1000, 0x1000, "a")).expect("add");
    }
    let mut store = SqliteStore::open(&path).expect("reopen");
    assert_eq!(store.version().expect("v"), 2);
    let snapshot = store.snapshot().expect("snapshot");
    assert_eq!(snapshot.nodes.len(), 1);
    assert_eq!(snapshot.entries.len(), 1);
}

#[test]
fn limits_and_owners_are_enforced() {
    let (_dir, mut store) = open();
    store.set_limits(super::StoreLimits {
        max_nodes: 2,
        max_ranges: 3,
        max_ranges_per_node: 2,
        max_replicas: 3,
    });
    store.upsert_node("a", &registration("h:1"), 1).expect("a");
    store.upsert_node("b", &registration("h:2"), 1).expect("b");
    assert!(matches!(
        store.upsert_node("c", &registration("h:3"), 1),
        Err(StoreError::LimitReached {
            what: "node",
            max: 2
        })
    ));
    // Re-registering a known node is not a new one.
    store
        .upsert_node("a", &registration("h:9"), 2)
        .expect("a again");
    store.add_range(&range(0, 4096, "a")).expect("a0");
    store.add_range(&range(4096, 4096, "a")).expect("a1");
    assert!(matches!(
        store.add_range(&range(8192, 4096, "a")),
        Err(StoreError::LimitReached { max: 2, .. })
    ));
    // Refreshing an existing entry is not a new one.
    store.add_range(&range(0, 4096, "a")).expect("a0 again");
    store.add_range(&range(8192, 4096, "b")).expect("b0");
    assert!(matches!(
        store.add_range(&range(12288, 4096, "b")),
        Err(StoreError::LimitReached {
            what: "range",
            max: 3
        })
    ));
    assert!(matches!(
        store.remove_range(0, Some("b")),
        Err(StoreError::NotOwner { gpa_start: 0, ref owner }) if owner == "a"
    ));
    assert!(store.remove_range(0, Some("a")).expect("own"));
    assert!(!store.remove_range(0, Some("a")).expect("gone"));
}

fn registration_in(tcp_addr: &str, epoch: u64) -> NodeRegistration {
    NodeRegistration {
        epoch,
        ..registration(tcp_addr)
    }
}

#[test]
fn a_range_stays_valid_in_the_epoch_it_was_claimed_in() {
    use rdma_transport::coordinator::api::RangeState;
    let (_dir, mut store) = open();
    // Epochs with the top bit set survive the round trip through SQLite.
    let first = 0x8000_0000_0000_0001;
    store
        .upsert_node("a", &registration_in("h:1", first), 10)
        .expect("put");
    let (entry, _) = store.add_range(&range(0, 0x2000, "a")).expect("add");
    assert_eq!((entry.valid_epoch, entry.state), (first, RangeState::Live));

    // The owner restarts (new epoch) and claims the same range again: its
    // memory is empty, so the range keeps its valid epoch and is lost.
    let v = store.version().expect("v");
    store
        .upsert_node("a", &registration_in("h:1", 7), 20)
        .expect("put");
    assert_eq!(
        store.version().expect("v"),
        v + 1,
        "a new epoch is a change"
    );
    assert_eq!(store.node("a").expect("node").map(|n| n.epoch), Some(7));
    let (entry, outcome) = store.add_range(&range(0, 0x2000, "a")).expect("again");
    assert_eq!(outcome, AddOutcome::Updated);
    assert_eq!((entry.valid_epoch, entry.state), (first, RangeState::Lost));
    let snapshot = store.snapshot().expect("snapshot");
    assert_eq!(snapshot.entries[0].state, RangeState::Lost);
    assert_eq!(snapshot.entries[0].valid_epoch, first);

    // The operator re-initialises it: valid in the current epoch.
    let v = store.version().expect("v");
    let entry = store.reinitialise_range(0).expect("reinit");
    assert_eq!((entry.valid_epoch, entry.state), (7, RangeState::Live));
    assert_eq!(store.version().expect("v"), v + 1);
    assert_eq!(
        store.snapshot().expect("s").entries[0].state,
        RangeState::Live
    );
    store.reinitialise_range(0).expect("again");
    assert_eq!(store.version().expect("v"), v + 1, "already live");
    assert!(matches!(
        store.reinitialise_range(0x1000),
        Err(StoreError::NoRange(0x1000))
    ));
}

#[test]
fn an_unknown_valid_epoch_takes_the_owners_first_known_one() {
    use rdma_transport::coordinator::api::RangeState;
    let (_dir, mut store) = open();
    // An owner that sends no epoch (older page-server): nothing to check.
    store
        .upsert_node("a", &registration("h:1"), 10)
        .expect("put");
    let (entry, _) = store.add_range(&range(0, 0x1000, "a")).expect("add");
    assert_eq!((entry.valid_epoch, entry.state), (0, RangeState::Live));
    store
        .upsert_node("a", &registration_in("h:1", 5), 20)
        .expect("put");
    let (entry, _) = store.add_range(&range(0, 0x1000, "a")).expect("again");
    assert_eq!((entry.valid_epoch, entry.state), (5, RangeState::Live));
}

/// A revision-1 database's contents (its tables are `SCHEMA_V1_SQL`, as
/// the previous coordinator created them).
const V1_CONTENTS: &str = "
UPDATE meta SET value = 5 WHERE key = 'version';
-- gpa_start 0x1000, length 0x2000, offset 0 in the order-preserving encoding.
INSERT INTO nodes (id, tcp_addr, last_seen_unix_ms) VALUES ('a', 'h:1', 10);
INSERT INTO map_entries (gpa_start, length_bytes, node_id, remote_offset)
    VALUES (-9223372036854771712, -9223372036854767616, 'a', -9223372036854775807 - 1);
PRAGMA user_version = 1;
";

#[test]
fn a_revision_1_database_is_migrated() {
    use rdma_transport::coordinator::api::RangeState;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.db");
    {
        let conn = rusqlite::Connection::open(&path).expect("create v1");
        conn.execute_batch(super::schema::SCHEMA_V1_SQL)
            .expect("v1 schema");
        conn.execute_batch(V1_CONTENTS).expect("v1 contents");
    }
    let mut store = SqliteStore::open(&path).expect("opens and migrates");
    let revision: i64 = store
        .conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .expect("revision");
    assert_eq!(revision, 4);
    assert_eq!(store.version().expect("v"), 5, "version kept");
    let snapshot = store.snapshot().expect("snapshot");
    assert_eq!(snapshot.nodes.len(), 1);
    assert_eq!(snapshot.nodes[0].epoch, 0, "unknown epoch");
    assert_eq!(snapshot.entries.len(), 1);
    let entry = &snapshot.entries[0];
    assert_eq!(
        (entry.gpa_start, entry.length_bytes, entry.node_id.as_str()),
        (0x1000, 0x2000, "a")
    );
    assert_eq!((entry.valid_epoch, entry.state), (0, RangeState::Live));
    // The migrated database takes epochs, and opens again unchanged.
    store
        .upsert_node("a", &registration_in("h:1", 9), 20)
        .expect("put");
    drop(store);
    let mut store = SqliteStore::open(&path).expect("reopens");
    assert_eq!(store.snapshot().expect("s").nodes[0].epoch, 9);
}

/// Fills a revision-2 database (tables from `SCHEMA_V1_SQL` and
/// `MIGRATE_V2_SQL`, as the previous coordinator created them): a range of
/// node a valid in its current epoch, one of node b valid in an older one.
fn fill_revision_2(conn: &rusqlite::Connection) {
    use super::codec::{enc, epoch_to_sql};
    use rusqlite::params;
    conn.execute_batch(super::schema::SCHEMA_V1_SQL)
        .expect("v1 schema");
    conn.execute_batch(super::schema::MIGRATE_V2_SQL)
        .expect("v2 schema");
    conn.execute_batch("UPDATE meta SET value = 9 WHERE key = 'version'")
        .expect("version");
    for (id, epoch) in [("a", 7u64), ("b", 0x8000_0000_0000_0008)] {
        conn.execute(
            "INSERT INTO nodes (id, tcp_addr, last_seen_unix_ms, epoch) VALUES (?1, 'h:1', 10, ?2)",
            params![id, epoch_to_sql(epoch)],
        )
        .expect("node");
    }
    for (gpa_start, length_bytes, node, offset, valid_epoch) in [
        (0x1000u64, 0x2000u64, "a", 0u64, 7u64),
        (0x4000, 0x1000, "b", 0x3000, 3),
    ] {
        conn.execute(
            "INSERT INTO map_entries (gpa_start, length_bytes, node_id, remote_offset, valid_epoch)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                enc(gpa_start),
                enc(length_bytes),
                node,
                enc(offset),
                epoch_to_sql(valid_epoch)
            ],
        )
        .expect("entry");
    }
    conn.execute_batch("PRAGMA user_version = 2;")
        .expect("revision");
}

#[test]
fn a_revision_2_database_is_migrated_to_replicas() {
    use rdma_transport::coordinator::api::{RangeState, ReplicaState};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.db");
    {
        let conn = rusqlite::Connection::open(&path).expect("create v2");
        fill_revision_2(&conn);
    }
    let mut store = SqliteStore::open(&path).expect("opens and migrates");
    let revision: i64 = store
        .conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .expect("revision");
    assert_eq!(revision, 4);
    assert_eq!(store.version().expect("v"), 9, "version kept");
    let entries = store.snapshot().expect("snapshot").entries;
    assert_eq!(entries.len(), 2);
    let shape: Vec<_> = entries
        .iter()
        .map(|e| {
            let r = &e.replicas[..];
            assert_eq!(r.len(), 1, "{e:?}");
            (
                e.gpa_start,
                e.length_bytes,
                r[0].node_id.as_str(),
                r[0].remote_offset,
                r[0].valid_epoch,
                r[0].state,
                r[0].recovery_seq,
                e.state,
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (
                0x1000,
                0x2000,
                "a",
                0,
                7,
                ReplicaState::Live,
                0,
                RangeState::Live
            ),
            (
                0x4000,
                0x1000,
                "b",
                0x3000,
                3,
                ReplicaState::Lost,
                0,
                RangeState::Lost
            ),
        ]
    );
    // The old cascade is gone: deleting a node removes only its replicas.
    store
        .add_range(&RangeRequest {
            gpa_start: 0x1000,
            length_bytes: 0x2000,
            node_id: "b".to_owned(),
            remote_offset: 0,
            rdma: None,
            contents: Default::default(),
        })
        .expect("b's replica");
    assert!(store.delete_node("a").expect("delete a"));
    let entries = store.snapshot().expect("snapshot").entries;
    let holders: Vec<_> = entries
        .iter()
        .map(|e| (e.gpa_start, e.node_id.as_str()))
        .collect();
    assert_eq!(holders, [(0x1000, "b"), (0x4000, "b")]);
    let violations: i64 = store
        .conn
        .query_row("SELECT COUNT(*) FROM pragma_foreign_key_check", [], |r| {
            r.get(0)
        })
        .expect("fk check");
    assert_eq!(violations, 0);
    // The migrated database opens again unchanged.
    drop(store);
    let mut store = SqliteStore::open(&path).expect("reopens");
    assert_eq!(store.snapshot().expect("s").entries.len(), 2);
}

/// The generation is chosen once per database: a reopened file keeps it, a
/// new file (a coordinator that lost its state) gets another.
#[test]
fn a_database_keeps_its_generation_and_a_new_one_gets_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = SqliteStore::open(&dir.path().join("a.db"))
        .expect("open")
        .generation()
        .expect("generation");
    assert_ne!(first, 0);
    let again = SqliteStore::open(&dir.path().join("a.db"))
        .expect("reopen")
        .generation()
        .expect("generation");
    assert_eq!(again, first);
    let other = SqliteStore::open(&dir.path().join("b.db"))
        .expect("open")
        .generation()
        .expect("generation");
    assert_ne!(other, first);
}
