//! Runs the model checker.

use std::time::Instant;

use stateright::{Checker, Expectation, HasDiscoveries, Model};

use super::Coherence;
use crate::home::HomeMutation;
use crate::node::NodeMutation;

/// Checks `model` exhaustively (BFS, 2 threads) and prints what it explored.
fn check(name: &str, model: Coherence) -> impl Checker<Coherence> {
    let started = Instant::now();
    let checker = model.checker().threads(2).spawn_bfs().join();
    eprintln!(
        "{name}: {} states, max depth {}, {:.1} s",
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
    eprintln!("{name}: coverage {:?}", checker.model().coverage());
    checker
}

/// The protocol's paths that the check must have gone through.
fn assert_covered(checker: &impl Checker<Coherence>) {
    let (home, node) = checker.model().coverage();
    assert!(home.upgrades > 0, "{home:?}");
    assert!(home.invalidation_rounds > 0, "{home:?}");
    assert!(home.downgrades_sent > 0, "{home:?}");
    assert!(home.queued > 0, "{home:?}");
    assert!(home.pages_lost > 0, "{home:?}");
    assert!(home.lost_answers > 0, "{home:?}");
    assert!(home.write_backs > 0, "{home:?}");
    assert!(home.stale_write_backs > 0, "{home:?}");
    assert!(node.coalesced_faults > 0, "{node:?}");
    assert!(node.deferred_callbacks > 0, "{node:?}");
    assert!(node.stale_grants > 0, "{node:?}");
    assert!(node.callbacks_before_grant > 0, "{node:?}");
    // Never expected: the transitions stay within their capacities and
    // never see a grant of the wrong kind.
    assert_eq!(home.actions_overflow, 0);
    assert_eq!(node.actions_overflow, 0);
    assert_eq!(node.protocol_errors, 0);
}

#[test]
fn two_nodes_three_operations_each_one_loss() {
    let checker = check("2 nodes x 3 ops", Coherence::new(2, 3));
    checker.assert_properties();
    assert!(checker.unique_state_count() > 100_000);
    assert_covered(&checker);
}

#[test]
fn three_nodes_two_operations_each_one_loss() {
    let checker = check("3 nodes x 2 ops", Coherence::new(3, 2));
    checker.assert_properties();
    assert!(checker.unique_state_count() > 1_000_000);
    assert_covered(&checker);
}

#[test]
fn four_nodes_one_operation_each_one_loss() {
    // Invalidation rounds with up to three holders.
    let checker = check("4 nodes x 1 op", Coherence::new(4, 1));
    checker.assert_properties();
    assert!(checker.unique_state_count() > 100_000);
}

#[test]
fn a_full_queue_answers_retry_and_the_request_is_served_later() {
    let mut model = Coherence::new(3, 2);
    model.queue_limit = 1;
    let checker = check("3 nodes x 2 ops, queue of 1", model);
    checker.assert_properties();
    let (home, node) = checker.model().coverage();
    assert!(home.retries > 0 && node.retries > 0, "{home:?} {node:?}");
}

#[test]
fn without_a_hold_time_callbacks_are_answered_at_once() {
    let mut model = Coherence::new(2, 3);
    model.min_hold_us = 0;
    let checker = check("2 nodes x 3 ops, no hold time", model);
    checker.assert_properties();
    let (_, node) = checker.model().coverage();
    assert_eq!(node.deferred_callbacks, 0);
    assert!(node.callbacks_before_grant > 0, "{node:?}");
}

#[test]
fn repeated_grants_and_callbacks_are_harmless() {
    let mut model = Coherence::new(2, 2);
    model.duplicate_to_nodes = true;
    let checker = check("2 nodes x 2 ops, home -> node messages repeated", model);
    checker.assert_properties();
    let (_, node) = checker.model().coverage();
    assert!(
        node.repeated_callbacks > 0 && node.stale_answers > 0,
        "{node:?}"
    );
}

/// Runs a deliberately broken protocol and asserts the checker reports a
/// counterexample for one of `expected` (the property the bug breaks).
fn assert_finds_bug(name: &str, model: Coherence, expected: &[&'static str]) {
    // Stops at the first counterexample for an expected property; a
    // broken protocol may have an unbounded state space, hence the cap.
    let checker = model
        .checker()
        .threads(2)
        .finish_when(HasDiscoveries::AnyOf(expected.iter().copied().collect()))
        .target_state_count(2_000_000)
        .spawn_bfs()
        .join();
    let found: Vec<_> = checker
        .discoveries()
        .into_iter()
        .filter(|(p, _)| checker.model().property(p).expectation != Expectation::Sometimes)
        .map(|(p, path)| (p, path.into_actions().len()))
        .collect();
    eprintln!(
        "{name}: {} states, counterexamples (property, steps) {found:?}",
        checker.unique_state_count()
    );
    if let Some((p, _)) = found.iter().find(|(p, _)| expected.contains(p)) {
        if let Some(path) = checker.discovery(p) {
            eprintln!("{name}: {p}: {:?}", path.last_state().violation);
            for action in path.into_actions() {
                eprintln!("  {action:?}");
            }
        }
    }
    let found: Vec<_> = found
        .into_iter()
        .filter(|(p, _)| expected.contains(p))
        .collect();
    assert!(
        !found.is_empty(),
        "{name}: the checker found none of {expected:?}"
    );
}

#[test]
fn the_checker_finds_a_grant_before_all_acknowledgements() {
    let mut model = Coherence::new(3, 2);
    model.home_mutation = Some(HomeMutation::GrantBeforeAllAcks);
    assert_finds_bug("grant before all acks", model, &["single writer"]);
}

#[test]
fn the_checker_finds_a_lost_owner_not_marked_lost() {
    let mut model = Coherence::new(2, 2);
    model.home_mutation = Some(HomeMutation::ForgetLostOwner);
    assert_finds_bug(
        "lost owner forgotten",
        model,
        &[
            "copies hold the latest write",
            "checks inside transitions hold",
        ],
    );
}

#[test]
fn the_checker_finds_a_home_waiting_for_a_lost_node() {
    let mut model = Coherence::new(2, 2);
    model.home_mutation = Some(HomeMutation::WaitForLostNodes);
    assert_finds_bug(
        "wait for lost nodes",
        model,
        &["no lost acknowledgement", "no deadlock"],
    );
}

#[test]
fn the_checker_finds_a_place_kept_for_a_lost_node() {
    let mut model = Coherence::new(3, 2);
    model.queue_limit = 1;
    model.home_mutation = Some(HomeMutation::KeepLostNodesPlace);
    assert_finds_bug(
        "place kept for a lost node",
        model,
        &["a kept place is for a node that will ask"],
    );
}

#[test]
fn the_checker_finds_a_stale_grant_used() {
    let mut model = Coherence::new(2, 2);
    model.node_mutation = Some(NodeMutation::IgnoreFence);
    assert_finds_bug(
        "stale grant used",
        model,
        &["single writer", "copies hold the latest write"],
    );
}

#[test]
fn the_checker_finds_an_invalidation_without_write_back() {
    let mut model = Coherence::new(2, 2);
    model.node_mutation = Some(NodeMutation::NoWriteBackOnInvalidate);
    assert_finds_bug(
        "no write-back on invalidate",
        model,
        &[
            "copies hold the latest write",
            "checks inside transitions hold",
        ],
    );
}

#[test]
fn the_checker_finds_writers_taking_the_page_from_each_other_forever() {
    let mut model = Coherence::new(2, 1);
    model.node_mutation = Some(NodeMutation::AnswerRecallBeforeGrant);
    assert_finds_bug(
        "recall answered before its grant",
        model,
        &["bounded work per operation"],
    );
}

/// Sizing aid: `COH_NODES=2 COH_OPS=2 cargo test -p coherence explore -- --ignored --nocapture`.
#[test]
#[ignore = "sizing aid, run by hand"]
fn explore() {
    let var = |name: &str, default: u8| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let mut model = Coherence::new(var("COH_NODES", 2), var("COH_OPS", 2));
    model.vcpus = var("COH_VCPUS", 2);
    model.max_losses = var("COH_LOSSES", 1);
    model.evictions = var("COH_EVICT", 1) == 1;
    model.duplicate_to_nodes = var("COH_DUP", 0) == 1;
    let started = Instant::now();
    let checker = model
        .checker()
        .threads(2)
        .target_state_count(
            std::env::var("COH_MAX")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(3_000_000),
        )
        .spawn_bfs()
        .join();
    eprintln!(
        "{} states, max depth {}, {} s",
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
    eprintln!("{:?}", checker.model().coverage());
    if let Some(path) = checker.discovery("bounded work per operation") {
        for (state, action) in path.into_vec() {
            eprintln!("{:?}\n  -> {:?}", state, action);
        }
    }
    checker.assert_properties();
}
