//! SQLite store tests of replicated ranges: adding replicas, effective states
//! across holder restarts, the replica limit, removal, the stale / recovery
//! rules and re-initialisation.

use rdma_transport::coordinator::api::{
    MapEntry, NodeRegistration, RangeContents, RangeRequest, RangeState, ReplicaState,
};

use super::{AddOutcome, ReplicaRefusal, SqliteStore, StoreError, StoreLimits};

const GPA: u64 = 0x10000;
const LEN: u64 = 0x4000;

fn open() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(&dir.path().join("c.db")).expect("open");
    (dir, store)
}

/// Registers (or re-registers, i.e. restarts) `id` in `epoch`.
fn start(store: &mut SqliteStore, id: &str, epoch: u64) {
    let registration = NodeRegistration {
        tcp_addr: format!("{id}:7000"),
        rdma: None,
        epoch,
    };
    store.upsert_node(id, &registration, 0).expect("register");
}

fn claim(store: &mut SqliteStore, id: &str, remote_offset: u64) -> (MapEntry, AddOutcome) {
    store
        .add_range(&RangeRequest {
            gpa_start: GPA,
            length_bytes: LEN,
            node_id: id.to_owned(),
            remote_offset,
            rdma: None,
            contents: Default::default(),
        })
        .expect("claim")
}

fn entry(store: &mut SqliteStore) -> MapEntry {
    let snapshot = store.snapshot().expect("snapshot");
    assert_eq!(snapshot.entries.len(), 1, "{:?}", snapshot.entries);
    snapshot.entries[0].clone()
}

/// (holder, reported state) of every replica, in rank order.
fn states(entry: &MapEntry) -> Vec<(String, ReplicaState)> {
    entry
        .replicas
        .iter()
        .map(|r| (r.node_id.clone(), r.state))
        .collect()
}

fn pairs(expected: &[(&str, ReplicaState)]) -> Vec<(String, ReplicaState)> {
    expected
        .iter()
        .map(|(n, s)| ((*n).to_owned(), *s))
        .collect()
}

fn refusal(result: Result<(u64, MapEntry), StoreError>) -> ReplicaRefusal {
    match result {
        Err(StoreError::ReplicaRefused { refusal, .. }) => refusal,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// a (epoch 1) holds the range live; b (epoch 2) has recovered a replica.
fn two_live() -> (tempfile::TempDir, SqliteStore) {
    let (dir, mut store) = open();
    start(&mut store, "a", 1);
    start(&mut store, "b", 2);
    claim(&mut store, "a", 0);
    claim(&mut store, "b", 0x8000);
    let (_, e) = store.begin_recovery(GPA, "b", 2).expect("begin");
    let seq = e.replicas[1].recovery_seq;
    store.finish_recovery(GPA, "b", seq, 2).expect("finish");
    (dir, store)
}

#[test]
fn a_second_holder_adds_a_stale_replica_that_must_recover() {
    use ReplicaState::{Live, Stale};
    let (_dir, mut store) = open();
    start(&mut store, "a", 1);
    start(&mut store, "b", 2);
    let (created, outcome) = claim(&mut store, "a", 0);
    assert_eq!(outcome, AddOutcome::Created);
    assert_eq!(states(&created), pairs(&[("a", Live)]));
    let v = store.version().expect("v");

    let (with_b, outcome) = claim(&mut store, "b", 0x8000);
    assert_eq!(outcome, AddOutcome::Created);
    assert_eq!(store.version().expect("v"), v + 1);
    assert_eq!(states(&with_b), pairs(&[("a", Live), ("b", Stale)]));
    let b = &with_b.replicas[1];
    assert_eq!(
        (b.remote_offset, b.valid_epoch, b.recovery_seq),
        (0x8000, 2, 0)
    );
    // The primary is a: the top-level fields are its.
    assert_eq!(
        (
            with_b.node_id.as_str(),
            with_b.remote_offset,
            with_b.valid_epoch
        ),
        ("a", 0, 1)
    );
    assert_eq!(with_b.state, RangeState::Live);

    // b re-posting refreshes its offset, keeps its state; unchanged is no change.
    let (again, outcome) = claim(&mut store, "b", 0xc000);
    assert_eq!(outcome, AddOutcome::Updated);
    assert_eq!(states(&again), pairs(&[("a", Live), ("b", Stale)]));
    assert_eq!(again.replicas[1].remote_offset, 0xc000);
    assert_eq!(store.version().expect("v"), v + 2);
    claim(&mut store, "b", 0xc000);
    assert_eq!(store.version().expect("v"), v + 2);

    // Other lengths at the same start still conflict.
    let other_length = store.add_range(&RangeRequest {
        gpa_start: GPA,
        length_bytes: LEN * 2,
        node_id: "b".to_owned(),
        remote_offset: 0,
        rdma: None,
        contents: Default::default(),
    });
    assert!(matches!(other_length, Err(StoreError::Overlap { .. })));
}

#[test]
fn a_new_replica_is_lost_not_live_when_nothing_is_live() {
    use ReplicaState::Lost;
    let (_dir, mut store) = open();
    start(&mut store, "a", 1);
    start(&mut store, "b", 2);
    claim(&mut store, "a", 0);
    // a restarts: its memory is gone.
    start(&mut store, "a", 11);
    let (e, _) = claim(&mut store, "b", 0);
    assert_eq!(states(&e), pairs(&[("a", Lost), ("b", Lost)]));
    assert_eq!(e.state, RangeState::Lost);
    assert_eq!(
        e.node_id, "a",
        "the rank-0 replica is named when none is live"
    );
    assert_eq!(
        refusal(store.begin_recovery(GPA, "b", 2)),
        ReplicaRefusal::NoLiveSource
    );
}

#[test]
fn a_holder_restart_makes_its_replica_stale_and_moves_the_primary() {
    use ReplicaState::{Live, Lost, Recovering, Stale};
    let (_dir, mut store) = two_live();
    assert_eq!(
        states(&entry(&mut store)),
        pairs(&[("a", Live), ("b", Live)])
    );

    start(&mut store, "a", 21);
    let e = entry(&mut store);
    assert_eq!(states(&e), pairs(&[("a", Stale), ("b", Live)]));
    assert_eq!(
        (e.node_id.as_str(), e.remote_offset, e.valid_epoch, e.state),
        ("b", 0x8000, 2, RangeState::Live)
    );
    let (_, resolved, node) = store.resolve(GPA + 5).expect("resolve").expect("found");
    assert_eq!((resolved.node_id.as_str(), node.id.as_str()), ("b", "b"));

    // a re-claims its range after the restart: still stale.
    let (e, outcome) = claim(&mut store, "a", 0);
    assert_eq!(outcome, AddOutcome::Updated);
    assert_eq!(states(&e), pairs(&[("a", Stale), ("b", Live)]));

    // a recovers in its new epoch.
    let (_, e) = store.begin_recovery(GPA, "a", 21).expect("begin");
    assert_eq!(states(&e), pairs(&[("a", Recovering), ("b", Live)]));
    assert_eq!(e.replicas[0].valid_epoch, 21);

    // b restarts too: a's recovery has nothing to copy from any more.
    start(&mut store, "b", 22);
    let e = entry(&mut store);
    assert_eq!(states(&e), pairs(&[("a", Recovering), ("b", Lost)]));
    assert_eq!(e.state, RangeState::Lost);
}

#[test]
fn the_replica_limit_and_the_per_node_limit_count_replicas() {
    let (_dir, mut store) = open();
    store.set_limits(StoreLimits {
        max_nodes: 8,
        max_ranges: 8,
        max_ranges_per_node: 1,
        max_replicas: 2,
    });
    for id in ["a", "b", "c"] {
        start(&mut store, id, 1);
    }
    claim(&mut store, "a", 0);
    claim(&mut store, "b", 0);
    let v = store.version().expect("v");
    let third = store.add_range(&RangeRequest {
        gpa_start: GPA,
        length_bytes: LEN,
        node_id: "c".to_owned(),
        remote_offset: 0,
        rdma: None,
        contents: Default::default(),
    });
    assert!(
        matches!(
            third,
            Err(StoreError::LimitReached {
                what: "replicas per range",
                max: 2
            })
        ),
        "{third:?}"
    );
    // b holds one replica: its per-node limit (1) is reached.
    let more = store.add_range(&RangeRequest {
        gpa_start: 0,
        length_bytes: 0x1000,
        node_id: "b".to_owned(),
        remote_offset: 0,
        rdma: None,
        contents: Default::default(),
    });
    assert!(
        matches!(
            more,
            Err(StoreError::LimitReached {
                what: "ranges per node",
                ..
            })
        ),
        "{more:?}"
    );
    assert_eq!(store.version().expect("v"), v, "refusals change nothing");
    // Re-posting an existing replica is no new one.
    claim(&mut store, "b", 0);
}

#[test]
fn removing_takes_only_the_holders_replica_until_the_last() {
    let (_dir, mut store) = two_live();
    start(&mut store, "c", 3);
    assert!(matches!(
        store.remove_range(GPA, Some("c")),
        Err(StoreError::NotOwner { ref owner, .. }) if owner == "a"
    ));
    let v = store.version().expect("v");
    assert!(store.remove_range(GPA, Some("a")).expect("a's"));
    assert_eq!(store.version().expect("v"), v + 1);
    let e = entry(&mut store);
    assert_eq!(states(&e), pairs(&[("b", ReplicaState::Live)]));
    assert_eq!(e.node_id, "b");
    assert!(store.remove_range(GPA, Some("b")).expect("b's, the last"));
    assert!(store.snapshot().expect("s").entries.is_empty());
    assert!(!store.remove_range(GPA, Some("b")).expect("gone"));

    // The admin removes the whole range.
    let (_dir, mut store) = two_live();
    assert!(store.remove_range(GPA, None).expect("all"));
    assert!(store.snapshot().expect("s").entries.is_empty());
    // Re-claiming starts afresh: one live replica.
    let (e, _) = claim(&mut store, "b", 0);
    assert_eq!(states(&e), pairs(&[("b", ReplicaState::Live)]));
}

#[test]
fn deleting_a_node_removes_its_replicas_and_the_ranges_left_empty() {
    let (_dir, mut store) = two_live();
    // a alone holds a second range.
    store
        .add_range(&RangeRequest {
            gpa_start: 0,
            length_bytes: 0x1000,
            node_id: "a".to_owned(),
            remote_offset: 0,
            rdma: None,
            contents: Default::default(),
        })
        .expect("a's own");
    assert!(store.delete_node("a").expect("delete"));
    let snapshot = store.snapshot().expect("s");
    assert_eq!(snapshot.entries.len(), 1, "{:?}", snapshot.entries);
    let e = &snapshot.entries[0];
    assert_eq!(e.gpa_start, GPA);
    assert_eq!(states(e), pairs(&[("b", ReplicaState::Live)]));
    assert!(store.delete_node("b").expect("delete"));
    assert!(store.snapshot().expect("s").entries.is_empty());
}

#[test]
fn the_last_live_replica_is_never_marked_stale() {
    use ReplicaState::{Live, Stale};
    let (_dir, mut store) = open();
    start(&mut store, "a", 1);
    start(&mut store, "b", 2);
    claim(&mut store, "a", 0);
    let v = store.version().expect("v");
    assert_eq!(
        refusal(store.mark_replica_stale(GPA, "a")),
        ReplicaRefusal::LastLive
    );
    assert_eq!(store.version().expect("v"), v);
    assert!(matches!(
        store.mark_replica_stale(GPA, "b"),
        Err(StoreError::NoReplica { .. })
    ));
    assert!(matches!(
        store.mark_replica_stale(GPA + 0x1000, "a"),
        Err(StoreError::NoRange(_))
    ));
    // A stale replica beside it is no live one.
    claim(&mut store, "b", 0);
    assert_eq!(
        refusal(store.mark_replica_stale(GPA, "a")),
        ReplicaRefusal::LastLive
    );

    let (_dir, mut store) = two_live();
    let v = store.version().expect("v");
    let (version, e) = store.mark_replica_stale(GPA, "a").expect("a stale");
    assert_eq!(version, v + 1);
    assert_eq!(states(&e), pairs(&[("a", Stale), ("b", Live)]));
    assert_eq!(e.node_id, "b");
    let (version, _) = store.mark_replica_stale(GPA, "a").expect("again");
    assert_eq!(version, v + 1, "already stale: no change");
    assert_eq!(
        refusal(store.mark_replica_stale(GPA, "b")),
        ReplicaRefusal::LastLive
    );
    // A replica whose holder restarted may be marked stale (it is not live).
    start(&mut store, "b", 99);
    store.mark_replica_stale(GPA, "b").expect("b stale");
}

#[test]
fn a_recovery_finishes_only_under_its_number_and_epoch() {
    use ReplicaState::{Live, Recovering, Stale};
    let (_dir, mut store) = open();
    start(&mut store, "a", 1);
    start(&mut store, "b", 2);
    claim(&mut store, "a", 0);
    claim(&mut store, "b", 0);
    assert_eq!(
        refusal(store.begin_recovery(GPA, "a", 1)),
        ReplicaRefusal::AlreadyLive
    );
    assert_eq!(
        refusal(store.finish_recovery(GPA, "b", 0, 2)),
        ReplicaRefusal::NotRecovering { stored: "stale" }
    );

    let v = store.version().expect("v");
    let (version, e) = store.begin_recovery(GPA, "b", 2).expect("begin");
    assert_eq!(version, v + 1);
    assert_eq!(states(&e), pairs(&[("a", Live), ("b", Recovering)]));
    assert_eq!(
        (e.replicas[1].recovery_seq, e.replicas[1].valid_epoch),
        (1, 2)
    );
    // Overtaken: a client marks it stale, the node begins again.
    store.mark_replica_stale(GPA, "b").expect("stale");
    assert_eq!(
        refusal(store.finish_recovery(GPA, "b", 1, 2)),
        ReplicaRefusal::NotRecovering { stored: "stale" }
    );
    let (_, e) = store.begin_recovery(GPA, "b", 2).expect("again");
    assert_eq!(e.replicas[1].recovery_seq, 2);
    assert_eq!(
        refusal(store.finish_recovery(GPA, "b", 1, 2)),
        ReplicaRefusal::SeqMismatch {
            presented: 1,
            current: 2
        }
    );
    let v = store.version().expect("v");
    let (version, e) = store.finish_recovery(GPA, "b", 2, 2).expect("finish");
    assert_eq!(version, v + 1);
    assert_eq!(states(&e), pairs(&[("a", Live), ("b", Live)]));
    assert_eq!(
        refusal(store.finish_recovery(GPA, "b", 2, 2)),
        ReplicaRefusal::NotRecovering { stored: "live" }
    );

    // The node restarts during a recovery: what it copied is gone.
    store.mark_replica_stale(GPA, "b").expect("stale");
    store.begin_recovery(GPA, "b", 2).expect("begin 3");
    start(&mut store, "b", 7);
    assert_eq!(
        states(&entry(&mut store)),
        pairs(&[("a", Live), ("b", Stale)])
    );
    assert_eq!(
        refusal(store.finish_recovery(GPA, "b", 3, 7)),
        ReplicaRefusal::EpochChanged
    );
    assert_eq!(
        refusal(store.finish_recovery(GPA, "b", 3, 2)),
        ReplicaRefusal::NotCurrentEpoch {
            presented: 2,
            current: 7
        }
    );
    // It begins again in its new epoch and finishes.
    let (_, e) = store.begin_recovery(GPA, "b", 7).expect("begin 4");
    assert_eq!(
        (e.replicas[1].recovery_seq, e.replicas[1].valid_epoch),
        (4, 7)
    );
    store.finish_recovery(GPA, "b", 4, 7).expect("finish 4");
}

#[test]
fn reinitialising_a_lost_range_makes_every_replica_live() {
    use ReplicaState::{Live, Lost};
    let (_dir, mut store) = two_live();
    // A live range is left as it is.
    let v = store.version().expect("v");
    let e = store.reinitialise_range(GPA).expect("live");
    assert_eq!(states(&e), pairs(&[("a", Live), ("b", Live)]));
    assert_eq!(store.version().expect("v"), v);

    start(&mut store, "a", 31);
    start(&mut store, "b", 32);
    assert_eq!(
        states(&entry(&mut store)),
        pairs(&[("a", Lost), ("b", Lost)])
    );
    let v = store.version().expect("v");
    let e = store.reinitialise_range(GPA).expect("reinit");
    assert_eq!(states(&e), pairs(&[("a", Live), ("b", Live)]));
    let epochs: Vec<u64> = e.replicas.iter().map(|r| r.valid_epoch).collect();
    assert_eq!(epochs, [31, 32]);
    assert_eq!((e.node_id.as_str(), e.state), ("a", RangeState::Live));
    assert_eq!(store.version().expect("v"), v + 1);
    assert!(matches!(
        store.reinitialise_range(GPA + 0x1000),
        Err(StoreError::NoRange(_))
    ));
}

/// The bench's wrong pages: a node's previous process (epoch 2), still
/// running after its successor (epoch 7) registered, begins and finishes a
/// recovery of the successor's replica. Its copy went into memory nobody
/// serves: the coordinator must refuse it, at both ends.
#[test]
fn only_the_nodes_current_process_recovers_its_replica() {
    use ReplicaState::{Live, Recovering, Stale};
    let (_dir, mut store) = two_live();
    start(&mut store, "b", 7);
    assert_eq!(
        states(&entry(&mut store)),
        pairs(&[("a", Live), ("b", Stale)])
    );
    let v = store.version().expect("v");
    assert_eq!(
        refusal(store.begin_recovery(GPA, "b", 2)),
        ReplicaRefusal::NotCurrentEpoch {
            presented: 2,
            current: 7
        }
    );
    assert_eq!(store.version().expect("v"), v, "a refusal changes nothing");

    let (_, e) = store.begin_recovery(GPA, "b", 7).expect("successor begins");
    let seq = e.replicas[1].recovery_seq;
    assert_eq!(
        refusal(store.finish_recovery(GPA, "b", seq, 2)),
        ReplicaRefusal::NotCurrentEpoch {
            presented: 2,
            current: 7
        }
    );
    assert_eq!(
        states(&entry(&mut store)),
        pairs(&[("a", Live), ("b", Recovering)]),
        "the successor's recovery is still under way"
    );
    store
        .finish_recovery(GPA, "b", seq, 7)
        .expect("the successor finishes");
}

fn claim_at(
    store: &mut SqliteStore,
    id: &str,
    contents: RangeContents,
    now_unix_ms: u64,
) -> MapEntry {
    store
        .add_range_at(
            &RangeRequest {
                gpa_start: GPA,
                length_bytes: LEN,
                node_id: id.to_owned(),
                remote_offset: 0,
                rdma: None,
                contents,
            },
            now_unix_ms,
        )
        .expect("claim")
        .0
}

/// A coordinator that lost its state: a page-server that just started
/// (contents unknown) claims the range first, then the one that holds it.
/// The holder becomes the live replica and the other copies from it; past
/// the unconfirmed window, a holder joins as stale like anybody.
#[test]
fn a_holder_of_the_contents_displaces_a_replica_of_unknown_contents_while_unconfirmed() {
    let (_dir, mut store) = open();
    for (id, epoch) in [("a", 1), ("b", 2), ("c", 3)] {
        start(&mut store, id, epoch);
    }
    let t = 1_000_000;
    let e = claim_at(&mut store, "b", RangeContents::Unknown, t);
    assert_eq!(states(&e), pairs(&[("b", ReplicaState::Live)]));
    let e = claim_at(&mut store, "a", RangeContents::Held, t + 1000);
    assert_eq!(
        states(&e),
        pairs(&[("b", ReplicaState::Stale), ("a", ReplicaState::Live)])
    );
    assert_eq!(e.node_id, "a", "the holder is the primary");
    // a is confirmed: another holder joins as stale.
    let e = claim_at(&mut store, "c", RangeContents::Held, t + 2000);
    assert_eq!(states(&e)[2], ("c".to_owned(), ReplicaState::Stale));
    // Read back from the database (the new column).
    let reopened = entry(&mut store);
    assert_eq!(states(&reopened), states(&e));
}

#[test]
fn past_the_window_a_holder_joins_a_range_of_unknown_contents_as_stale() {
    let (_dir, mut store) = open();
    start(&mut store, "a", 1);
    start(&mut store, "b", 2);
    let t = 1_000_000;
    claim_at(&mut store, "b", RangeContents::Unknown, t);
    let e = claim_at(
        &mut store,
        "a",
        RangeContents::Held,
        t + super::claims::UNCONFIRMED_FOR_MS,
    );
    assert_eq!(
        states(&e),
        pairs(&[("b", ReplicaState::Live), ("a", ReplicaState::Stale)])
    );
}

/// A page-server that knows it missed writes claims a range the
/// coordinator does not know: the range is lost (it serves nothing) until
/// a holder of the contents claims it.
#[test]
fn a_claimer_that_missed_writes_creates_a_lost_range_that_a_holder_makes_live() {
    let (_dir, mut store) = open();
    start(&mut store, "a", 1);
    start(&mut store, "b", 2);
    let e = claim_at(&mut store, "b", RangeContents::Missed, 5);
    assert_eq!(e.state, RangeState::Lost);
    assert_eq!(states(&e), pairs(&[("b", ReplicaState::Lost)]));
    let e = claim_at(&mut store, "a", RangeContents::Held, 6);
    assert_eq!(e.state, RangeState::Live);
    assert_eq!(
        states(&e),
        pairs(&[("b", ReplicaState::Stale), ("a", ReplicaState::Live)])
    );
}
