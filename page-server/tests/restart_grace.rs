//! A coherence home whose node had a process before it grants nothing
//! until every node of that process has surely dropped its copies (a node
//! cut off from the old process may still read them: `dead_peer.rs` cuts
//! one off for real). It learns of the process before from the map, which
//! names the node before the new process registers, or, when the
//! coordinator lost its state, from its state directory. A node's first
//! process waits for nothing. The page-servers are real, in this process,
//! and each is stopped before the next starts.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::coherent_copies::Node;
use common::*;
use page_server::{RunningServer, ServerConfig};
use rdma_transport::coherent::CoherenceConfig;
use rdma_transport::dead_peer::left_for_sure_within;

const HOME: &str = "home";
/// The longest bound the home accepts, and the one its nodes declare.
const NODE_BOUND: Duration = Duration::from_millis(200);
const LIMIT: Duration = Duration::from_secs(30);

fn home(url: &str, state_dir: Option<&Path>) -> RunningServer {
    let mut cfg = ServerConfig::new(HOME, NODE_BYTES);
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.node_dead_home_timeout = NODE_BOUND;
    cfg.state_dir = state_dir.map(Path::to_path_buf);
    page_server_with(url, cfg)
}

fn node(url: &str) -> Node {
    let config = CoherenceConfig {
        dead_home_timeout_ms: NODE_BOUND.as_millis() as u64,
        timeout_ms: LIMIT.as_millis() as u64,
        min_hold_us: 0,
    };
    Node::with_config(manager(url), config)
}

/// A new node reads page 0, the range having been re-initialised if the
/// coordinator says it was lost: how long after `since` it got the page.
/// The page is zeros (a new process's memory, or the re-initialised range).
fn first_read(url: &str, since: Instant) -> Duration {
    let coordinator = coordinator_client(url);
    let lost =
        coordinator.map().expect("map").entries.iter().any(|e| {
            e.gpa_start == 0 && e.state == rdma_transport::coordinator::api::RangeState::Lost
        });
    if lost {
        coordinator.reinitialise_range(0).expect("re-initialise");
    }
    let reader = node(url);
    let page = reader.read(0).expect("the page is served");
    let after = since.elapsed();
    assert!(
        page == [0u8; rdma_transport::PAGE_SIZE],
        "not the zeros of a new range"
    );
    after
}

/// Stops the home, then starts it again and waits until it is registered
/// in its new epoch; returns when it was started and the new process.
fn restart(url: &str, old: RunningServer, state_dir: Option<&Path>) -> (Instant, RunningServer) {
    let old_epoch = coordinator_client(url)
        .node(&HOME.to_owned())
        .expect("the home's registration")
        .epoch;
    drop(old);
    let started = Instant::now();
    let new = home(url, state_dir);
    registered_with_range(url, HOME, 0, old_epoch);
    (started, new)
}

fn assert_waited(new: &RunningServer, waited: Duration, why: &str) {
    let grace = left_for_sure_within(NODE_BOUND);
    assert!(
        waited >= grace,
        "the page was granted {waited:?} after the new process started, {why}: within the \
         {grace:?} its predecessor's nodes may still hold copies"
    );
    assert!(
        new.coherence_stats().restart_grace_retries > 0,
        "no request was turned away: {:?}",
        new.coherence_stats()
    );
}

/// The first process grants at once; the next, which the map named before
/// it registered, only after the wait.
#[test]
fn a_restarted_home_grants_only_once_its_predecessors_nodes_have_surely_dropped_their_copies() {
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let started = Instant::now();
    let first = home(&url, None);
    let waited = first_read(&url, started);
    assert_eq!(
        first.coherence_stats().restart_grace_retries,
        0,
        "a node's first process turned requests away"
    );
    assert!(
        waited < left_for_sure_within(NODE_BOUND),
        "a node's first process granted only after {waited:?}"
    );

    let (started, second) = restart(&url, first, None);
    let waited = first_read(&url, started);
    assert_waited(&second, waited, "which the map named before it registered");
}

/// The coordinator lost its state while the home was down: the map does
/// not name the node, its state directory does.
#[test]
fn a_home_restarted_after_the_coordinator_lost_its_state_still_waits() {
    let state = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let first_coord = coordinator_on(&dir.path().join("first.db"), "127.0.0.1:0".parse().unwrap());
    let first_url = format!("http://{}", first_coord.addr());
    let first = home(&first_url, Some(state.path()));
    // The home records the range once it sees itself its live holder.
    let held = state.path().join("held-ranges.json");
    assert!(
        wait_until(LIMIT, || std::fs::read_to_string(&held)
            .is_ok_and(|t| t.contains("length"))),
        "the home never recorded its range as held"
    );
    drop(first);
    drop(first_coord);

    let coord = coordinator_on(
        &dir.path().join("second.db"),
        "127.0.0.1:0".parse().unwrap(),
    );
    let url = format!("http://{}", coord.addr());
    let started = Instant::now();
    let second = home(&url, Some(state.path()));
    let waited = first_read(&url, started);
    assert_waited(
        &second,
        waited,
        "whose state directory says an earlier process held the range",
    );
}
