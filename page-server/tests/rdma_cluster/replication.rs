//! A replicated pair of real page-server processes serving over RDMA,
//! under a checked read/write load, through kills and stops in a random
//! order. Over RDMA a stopped process still serves: the device reads and
//! writes its registered memory without it (SIGSTOP stops no NIC, and
//! rxe runs in the kernel), and a killed one's QPs end in the kernel, not
//! through the process. `replication.rs` runs the same faults over TCP.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rdma_transport::coordinator::api::ReplicaState;
use rdma_transport::coordinator::CoordinatorClient;
use rdma_transport::{DataPath, ManagerConfig, PollMode, TransportKind, TransportManager};

use super::common::checked_load::*;
use super::common::*;
use super::{config, require_device, say, PAGES_PER_NODE};

/// Longer than the clients' map refresh (100 ms) plus their request
/// timeout (3 s under TCG), as `--recovery-grace-ms` must be.
const GRACE: [&str; 2] = ["--recovery-grace-ms", "3500"];

fn states(admin: &CoordinatorClient) -> Vec<(String, ReplicaState)> {
    range_states(admin, 0)
}

fn wait_all_live(admin: &CoordinatorClient) {
    assert!(
        wait_until(Duration::from_secs(120), || {
            let states = states(admin);
            states.len() == 2 && states.iter().all(|(_, s)| *s == ReplicaState::Live)
        }),
        "replicas never both live: {:?}",
        states(admin)
    );
}

/// What is done to a replica.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// `kill -9`, then started again (empty memory, new epoch): it
    /// recovers from the other. Only done while both are live.
    Kill,
    /// SIGSTOP while the load runs `ops` more operations, then SIGCONT.
    /// Its device goes on serving the load's READs and WRITEs meanwhile;
    /// once its lease lapses the coordinator reports the node down, and
    /// once it runs again its stall fence cuts the clients' RDMA off until
    /// the coordinator answers it.
    Stop { ops: u64 },
    /// The coordinator stops (its database kept) while the load runs `ops`
    /// more operations, then starts again at its address.
    CoordinatorDown { ops: u64 },
}

/// Every read the load makes must return its page's last acknowledged
/// write; afterwards both replicas are live and each alone holds every
/// page, the same as the other. The seed is printed; `CHAOS_SEED=N`
/// replays its order.
#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_a_replicated_pair_through_random_kills_and_stops_never_reads_a_wrong_page() {
    random_faults_under_load(
        "rdma_a_replicated_pair_through_random_kills_and_stops_never_reads_a_wrong_page",
        1,
    );
}

/// As above, with 16 distinct pages at a time in flight on the
/// asynchronous API.
#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_sixteen_pages_in_flight_through_random_kills_and_stops_never_read_a_wrong_page() {
    random_faults_under_load(
        "rdma_sixteen_pages_in_flight_through_random_kills_and_stops_never_read_a_wrong_page",
        16,
    );
}

fn random_faults_under_load(test: &str, depth: usize) {
    const FAULTS: usize = 6;
    require_device(test);
    // RUST_LOG=rdma_transport=info shows the manager's logs on a replay.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let seed = chaos_seed();
    say(&format!(
        "{test}: seed {seed} (CHAOS_SEED={seed} replays this order), {depth} page(s) in flight"
    ));
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);

    let (db, coord) = loopback_coordinator();
    let url = coord.url();
    let coord_addr = coord.addr();
    let mut coord = Some(coord);
    let admin = coordinator_client(&url);
    let start = |node: &str| ChildServer::start_with(&url, node, 0, &GRACE);
    let mut servers = [start("a"), start("b")];
    wait_all_live(&admin);
    let mgr = Arc::new(
        TransportManager::connect(ManagerConfig {
            map_refresh_ms: 100,
            read_hedge_delay_us: 20_000,
            ..config(&url, TransportKind::Auto, PollMode::Event)
        })
        .expect("manager connects"),
    );
    let filled = fill(&mgr, PAGES_PER_NODE);
    // The fill reached both over RDMA. (Later a connection may be
    // replaced at any moment: a read abandoned at the hedging delay
    // takes its QP down.)
    for (node, path) in mgr.node_transports() {
        assert_eq!(
            path,
            Some(DataPath::Rdma),
            "node {node} not reached by RDMA"
        );
    }
    let (load, handle) = Load::start_in_flight(Arc::clone(&mgr), filled, depth);
    load.wait_ops(200);

    let mut done = Vec::new();
    for _ in 0..FAULTS {
        let victim = rng.gen_range(0..2usize);
        let name = ["a", "b"][victim];
        let both_live = states(&admin).iter().all(|(_, s)| *s == ReplicaState::Live);
        let other_live = states(&admin)
            .iter()
            .any(|(n, s)| n != name && *s == ReplicaState::Live);
        let fault = if rng.gen_bool(0.2) {
            Fault::CoordinatorDown {
                ops: rng.gen_range(50..500),
            }
        } else if both_live && rng.gen_bool(0.5) {
            Fault::Kill
        } else {
            // With the other replica not live, calls that need this one
            // fail after their deadline (3 s) while it is stopped: a few.
            Fault::Stop {
                ops: if other_live {
                    rng.gen_range(50..500)
                } else {
                    rng.gen_range(2..6)
                },
            }
        };
        done.push(format!("{fault:?} {name}"));
        say(&format!(
            "{test}: fault {}: {fault:?} {name} after {} operations, replicas {:?}",
            done.len(),
            load.ops.load(Ordering::Relaxed),
            states(&admin)
        ));
        match fault {
            Fault::Kill => {
                servers[victim].kill();
                load.wait_ops(rng.gen_range(50..500));
                servers[victim] = start(name);
            }
            Fault::Stop { ops } => {
                servers[victim].pause();
                load.wait_ops(ops);
                servers[victim].resume();
            }
            Fault::CoordinatorDown { ops } => {
                if let Some(running) = coord.take() {
                    running.shutdown().expect("coordinator stops");
                }
                load.wait_ops(ops);
                coord = Some(coordinator_on(&db.path().join("c.db"), coord_addr));
            }
        }
        if rng.gen_bool(0.5) {
            wait_all_live(&admin);
        }
        load.wait_ops(rng.gen_range(50..300));
    }
    wait_all_live(&admin);
    load.wait_ops(200);
    let (expected, errors) = load.finish_with_errors(handle);
    say(&format!(
        "{test}: faults {done:?}; {} operations, {} errors reached the caller{}; paths {:?}",
        load.ops.load(Ordering::Relaxed),
        errors.len(),
        errors
            .iter()
            .take(3)
            .map(|e| format!("; {e}"))
            .collect::<String>(),
        mgr.node_transports()
    ));

    // The load may have marked a replica stale again after the wait
    // above: each is read alone once both are live with the load stopped.
    wait_all_live(&admin);
    let checked = verify_all(&mgr, &expected);
    assert!(checked > 50, "only {checked} pages were written");
    verify_each_replica_alone(
        Some(&load),
        &admin.map().expect("map"),
        &["a", "b"],
        &expected,
        PAGES_PER_NODE,
        &format!("seed {seed}, faults {done:?}"),
    );
}
