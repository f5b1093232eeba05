//! The in-memory rules of the etcd backend, without etcd (the HTTP suites
//! run them against a real etcd too).

use rdma_transport::coordinator::api::{
    NodeRegistration, RangeContents, RangeRequest, RangeState, ReplicaState,
};

use super::model::{State, Write};
use crate::backend::ReplicaOp;
use crate::store::{AddOutcome, StoreError, StoreLimits};

const PAGE: u64 = 4096;

fn register(state: &mut State, id: &str, epoch: u64) {
    let registration = NodeRegistration {
        tcp_addr: format!("{id}:1"),
        rdma: None,
        epoch,
    };
    let change = state
        .upsert_node(id, &registration, 1, StoreLimits::default())
        .expect("registers");
    assert!(change.bump);
    state.apply(&change);
}

fn request(gpa_start: u64, length_bytes: u64, node: &str) -> RangeRequest {
    RangeRequest {
        gpa_start,
        length_bytes,
        node_id: node.to_owned(),
        remote_offset: 0,
        rdma: None,
        contents: Default::default(),
    }
}

fn claim(
    state: &mut State,
    gpa_start: u64,
    length_bytes: u64,
    node: &str,
) -> Result<AddOutcome, StoreError> {
    let (change, outcome, _) = state.add_range(
        &request(gpa_start, length_bytes, node),
        StoreLimits::default(),
    )?;
    state.apply(&change);
    Ok(outcome)
}

#[test]
fn overlaps_are_refused_on_both_sides_and_neighbours_are_not() {
    let mut state = State::default();
    register(&mut state, "a", 1);
    register(&mut state, "b", 2);
    assert_eq!(
        claim(&mut state, 4 * PAGE, 4 * PAGE, "a").ok(),
        Some(AddOutcome::Created)
    );
    // Neighbours touching either end.
    assert!(claim(&mut state, 0, 4 * PAGE, "b").is_ok());
    assert!(claim(&mut state, 8 * PAGE, PAGE, "b").is_ok());
    // Overlapping the start, the end, or inside; another length at the same start.
    for (start, length) in [
        (3 * PAGE, 2 * PAGE),
        (7 * PAGE, 2 * PAGE),
        (5 * PAGE, PAGE),
        (4 * PAGE, PAGE),
    ] {
        let refused = claim(&mut state, start, length, "b");
        assert!(
            matches!(refused, Err(StoreError::Overlap { .. })),
            "{start:#x}+{length:#x}: {refused:?}"
        );
    }
    // The very top of the address space (no overflow in the end check).
    let top = u64::MAX - PAGE + 1;
    assert!(claim(&mut state, top - PAGE, PAGE, "a").is_ok());
    assert!(matches!(state.resolve(u64::MAX), Ok(None)));
    // The same range by another node: a stale replica; by the holder: refreshed.
    assert_eq!(
        claim(&mut state, 4 * PAGE, 4 * PAGE, "b").ok(),
        Some(AddOutcome::Created)
    );
    assert_eq!(
        claim(&mut state, 4 * PAGE, 4 * PAGE, "a").ok(),
        Some(AddOutcome::Updated)
    );
    let (entry, node) = state.resolve(5 * PAGE).expect("resolve").expect("mapped");
    assert_eq!((entry.node_id.as_str(), node.id.as_str()), ("a", "a"));
    let states: Vec<ReplicaState> = entry.replicas.iter().map(|r| r.state).collect();
    assert_eq!(states, [ReplicaState::Live, ReplicaState::Stale]);
}

#[test]
fn deleting_a_node_takes_its_replicas_and_the_ranges_left_without_one() {
    let mut state = State::default();
    register(&mut state, "a", 1);
    register(&mut state, "b", 2);
    claim(&mut state, 0, PAGE, "a").expect("a alone");
    claim(&mut state, PAGE, PAGE, "a").expect("shared");
    claim(&mut state, PAGE, PAGE, "b").expect("b's replica");
    let change = state.delete_node("a").expect("known");
    assert!(change.writes.contains(&Write::DeleteRange(0)));
    state.apply(&change);
    assert!(state.delete_node("a").is_none());
    let entries = state.entries().expect("entries");
    assert_eq!(entries.len(), 1);
    // b's replica was stale: with no live one left the range is lost.
    assert_eq!(
        (entries[0].node_id.as_str(), entries[0].state),
        ("b", RangeState::Lost)
    );
    let change = state.reinitialise_range(PAGE).expect("reinitialise");
    state.apply(&change);
    assert_eq!(state.entries().expect("entries")[0].state, RangeState::Live);
}

#[test]
fn replica_changes_follow_the_rules() {
    let mut state = State::default();
    register(&mut state, "a", 1);
    register(&mut state, "b", 2);
    claim(&mut state, 0, PAGE, "a").expect("a");
    claim(&mut state, 0, PAGE, "b").expect("b");
    // The only live replica is never marked stale.
    let refused = state.change_replica(0, "a", ReplicaOp::MarkStale);
    assert!(
        matches!(refused, Err(StoreError::ReplicaRefused { .. })),
        "{refused:?}"
    );
    // b recovers: only its current epoch may begin and finish.
    let wrong = state.change_replica(0, "b", ReplicaOp::BeginRecovery { epoch: 9 });
    assert!(
        matches!(wrong, Err(StoreError::ReplicaRefused { .. })),
        "{wrong:?}"
    );
    let change = state
        .change_replica(0, "b", ReplicaOp::BeginRecovery { epoch: 2 })
        .expect("begin");
    state.apply(&change);
    let overtaken = state.change_replica(
        0,
        "b",
        ReplicaOp::FinishRecovery {
            recovery_seq: 0,
            epoch: 2,
        },
    );
    assert!(
        matches!(overtaken, Err(StoreError::ReplicaRefused { .. })),
        "{overtaken:?}"
    );
    let change = state
        .change_replica(
            0,
            "b",
            ReplicaOp::FinishRecovery {
                recovery_seq: 1,
                epoch: 2,
            },
        )
        .expect("finish");
    state.apply(&change);
    let entry = &state.entries().expect("entries")[0];
    assert!(
        entry.replicas.iter().all(|r| r.state == ReplicaState::Live),
        "{entry:?}"
    );
    // Now a may go stale; twice is no change.
    let change = state
        .change_replica(0, "a", ReplicaOp::MarkStale)
        .expect("stale");
    assert!(change.bump);
    state.apply(&change);
    let again = state
        .change_replica(0, "a", ReplicaOp::MarkStale)
        .expect("again");
    assert!(again.writes.is_empty() && !again.bump);
    assert!(matches!(
        state.change_replica(PAGE, "a", ReplicaOp::MarkStale),
        Err(StoreError::NoRange(_))
    ));
}

#[test]
fn limits_are_kept() {
    let mut state = State::default();
    let limits = StoreLimits {
        max_nodes: 1,
        max_ranges: 1,
        max_ranges_per_node: 1,
        max_replicas: 1,
    };
    let registration = NodeRegistration {
        tcp_addr: "a:1".to_owned(),
        rdma: None,
        epoch: 1,
    };
    state.apply(
        &state
            .upsert_node("a", &registration, 1, limits)
            .expect("first"),
    );
    assert!(matches!(
        state.upsert_node("b", &registration, 1, limits),
        Err(StoreError::LimitReached { what: "node", .. })
    ));
    // Re-registering the same node is no new node, and no version change.
    let same = state
        .upsert_node("a", &registration, 2, limits)
        .expect("again");
    assert!(!same.bump);
    let (change, _, _) = state
        .add_range(&request(0, PAGE, "a"), limits)
        .expect("range");
    state.apply(&change);
    assert!(matches!(
        state.add_range(&request(PAGE, PAGE, "a"), limits),
        Err(StoreError::LimitReached { what: "range", .. })
    ));
}

/// The claim rules of `store/claims.rs`, as the etcd backend applies them:
/// a holder of the contents displaces a replica of unknown contents while
/// it is unconfirmed, and the value it writes keeps the deadline.
#[test]
fn a_holder_of_the_contents_displaces_a_replica_of_unknown_contents_while_unconfirmed() {
    let mut state = State::default();
    for (id, epoch) in [("a", 1), ("b", 2), ("c", 3)] {
        register(&mut state, id, epoch);
    }
    let claim_at = |state: &mut State, node: &str, contents, now| {
        let request = RangeRequest {
            contents,
            ..request(0, PAGE, node)
        };
        let (change, _, value) = state
            .add_range_at(&request, StoreLimits::default(), now)
            .expect("claim");
        state.apply(&change);
        value
    };
    let t = 1_000_000;
    let value = claim_at(&mut state, "b", RangeContents::Unknown, t);
    assert!(value.replicas[0].unconfirmed_until_ms > t);
    claim_at(&mut state, "a", RangeContents::Held, t + 1);
    let states = |state: &State| -> Vec<(String, ReplicaState)> {
        state.entries().expect("entries")[0]
            .replicas
            .iter()
            .map(|r| (r.node_id.clone(), r.state))
            .collect()
    };
    assert_eq!(
        states(&state),
        [
            ("b".to_owned(), ReplicaState::Stale),
            ("a".to_owned(), ReplicaState::Live)
        ]
    );
    claim_at(&mut state, "c", RangeContents::Held, t + 2);
    assert_eq!(states(&state)[2], ("c".to_owned(), ReplicaState::Stale));

    // A claimer that missed writes makes a new range lost.
    let value = {
        let request = RangeRequest {
            contents: RangeContents::Missed,
            ..request(PAGE, PAGE, "c")
        };
        state
            .add_range_at(&request, StoreLimits::default(), t)
            .expect("claim")
    };
    state.apply(&value.0);
    assert_eq!(state.entries().expect("entries")[1].state, RangeState::Lost);
}
