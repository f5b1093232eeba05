//! A read of a replicated range whose first replica's connection was closed
//! by its (live) server and whose other replica is gone goes back to the
//! first on a new connection, instead of failing with the dead one's error.
//! (What a client sees when a replica ends its recovery, which closes the
//! connections it served without RDMA, just as the other replica dies.)
//! Likewise a read hedged away from a primary that was only slow, onto a
//! replica that turns out to be dead, goes back to the slow primary.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use page_server::ServerConfig;
use rdma_transport::{ManagerConfig, TransportManager, PAGE_SIZE};

const PAGES: u64 = 8;

/// A manager of the cluster at `url` with `config`'s timeouts, once its map
/// holds the range.
fn pair_manager(url: &str, config: ManagerConfig) -> TransportManager {
    let mgr = TransportManager::connect(ManagerConfig {
        coordinator_url: url.to_owned(),
        connect_timeout_ms: 500,
        poller_cpus: Some(vec![]),
        ..config
    })
    .expect("manager connects");
    assert!(wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().len() == 1
    }));
    mgr
}

#[test]
fn a_read_goes_back_to_a_live_replica_whose_connection_was_closed() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let url = coord.url();
    // a (the primary: registered first) closes connections idle for 100 ms.
    let mut cfg_a = ServerConfig::new("a", NODE_BYTES);
    cfg_a.idle_timeout = Duration::from_millis(100);
    let a = page_server_with(&url, cfg_a);
    let b = page_server_with(&url, ServerConfig::new("b", NODE_BYTES));
    wait_both_live(&url);
    let mgr = pair_manager(
        &url,
        ManagerConfig {
            request_timeout_ms: 2000,
            ..ManagerConfig::default()
        },
    );
    assert_eq!(
        mgr.map()
            .ranges()
            .next()
            .map(|(_, _, node)| node.to_owned()),
        Some("a".to_owned()),
        "a is the primary"
    );
    // Writes go to both replicas: the manager holds a connection to each.
    for p in 0..PAGES {
        let gpa = p * PAGE_SIZE as u64;
        mgr.write_page(gpa, &page_for(gpa, 4)).unwrap();
    }
    // a closes the idle connection (the manager does not know yet)...
    assert!(
        wait_until(Duration::from_secs(10), || a.active_connections() == 0),
        "a never closed the idle connection"
    );
    // ...and b goes away (its connections reset, its port closed).
    b.abort();

    // The first read finds a's connection closed, then b gone, then reads
    // a on a new connection.
    let mut page = [0u8; PAGE_SIZE];
    for p in 0..PAGES {
        let gpa = p * PAGE_SIZE as u64;
        mgr.read_page(gpa, &mut page)
            .unwrap_or_else(|e| panic!("read {p}: {e}"));
        assert!(page == page_for(gpa, 4), "page {p} differs");
    }
    assert!(
        a.active_connections() >= 1,
        "read over a new connection to a"
    );
}

/// A read hedged away from a slow primary to the other replica, which
/// turns out to be dead, goes back to the primary for the rest of its
/// deadline: the primary was only slow. (It failed with the dead one's
/// "connection refused": the other flake of
/// `replicated_range_survives_kill_restart_and_kill_of_the_other_replica`,
/// on a loaded host where the primary sometimes answers later than the
/// hedging delay just as the other replica is killed.)
#[test]
fn a_read_hedged_onto_a_dead_replica_goes_back_to_the_slow_one() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let url = coord.url();
    let mut a = ChildServer::start(&url, "a", 0);
    let mut b = ChildServer::start(&url, "b", 0);
    wait_both_live(&url);
    let hedge = Duration::from_millis(20);
    let mgr = pair_manager(
        &url,
        ManagerConfig {
            request_timeout_ms: 5000,
            read_hedge_delay_us: hedge.as_micros() as u64,
            ..ManagerConfig::default()
        },
    );
    // The primary is the replica that registered first.
    let primary = mgr
        .map()
        .ranges()
        .next()
        .map(|(_, _, node)| node.to_owned());
    let (slow, dead) = match primary.as_deref() {
        Some("a") => (&a, &mut b),
        Some("b") => (&b, &mut a),
        other => panic!("unexpected primary {other:?}"),
    };
    for p in 0..PAGES {
        let gpa = p * PAGE_SIZE as u64;
        mgr.write_page(gpa, &page_for(gpa, 5)).unwrap();
    }
    // The other replica dies (the manager does not know yet); the primary
    // stops answering for 300 ms, fifteen times the hedging delay.
    dead.kill();
    slow.pause();
    let stalled = Duration::from_millis(300);
    let mut page = [0u8; PAGE_SIZE];
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(stalled);
            slow.resume();
        });
        mgr.read_page(0, &mut page)
    });
    result.unwrap_or_else(|e| panic!("read while the primary is slow and the other dead: {e}"));
    assert!(page == page_for(0, 5), "page 0 differs");
    assert_eq!(
        mgr.stats().reads_hedged,
        1,
        "the read went on at the other replica once"
    );
    for p in 1..PAGES {
        let gpa = p * PAGE_SIZE as u64;
        mgr.read_page(gpa, &mut page)
            .unwrap_or_else(|e| panic!("read {p}: {e}"));
        assert!(page == page_for(gpa, 5), "page {p} differs");
    }
}
