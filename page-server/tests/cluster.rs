//! End-to-end: a real coordinator and page-servers on loopback, driven
//! through the TransportManager.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use rdma_transport::{TransportError, PAGE_SIZE};

#[test]
fn pages_written_to_two_nodes_read_back_identical() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let _a = page_server(&coord.url(), "a", 0);
    let _b = page_server(&coord.url(), "b", NODE_BYTES as u64);
    let mgr = manager(&coord.url());
    assert_eq!(mgr.map().nodes().len(), 2);

    round_trip_all_pages(&mgr, 2, 7, 3);
}

#[test]
fn bad_addresses_get_typed_errors() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = manager(&coord.url());
    let mut page = [0u8; PAGE_SIZE];
    assert!(matches!(
        mgr.read_page(NODE_BYTES as u64, &mut page),
        Err(TransportError::UnknownGpa { .. })
    ));
    assert!(matches!(
        mgr.read_page(!0xfff, &mut page),
        Err(TransportError::UnknownGpa { .. })
    ));
    assert!(matches!(
        mgr.read_page(0x10, &mut page),
        Err(TransportError::Unaligned { gpa: 0x10 })
    ));
    let gpas = [0u64, 4096];
    let mut one = [[0u8; PAGE_SIZE]; 1];
    assert!(matches!(
        mgr.read_pages(&gpas, &mut one),
        Err(TransportError::Config(_))
    ));
    // Still fine afterwards.
    mgr.write_page(4096, &page_for(4096, 3)).unwrap();
    mgr.read_page(4096, &mut page).unwrap();
    assert!(page == page_for(4096, 3));
}

#[test]
fn killed_page_server_gives_typed_error_within_deadline_and_other_node_keeps_serving() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let _a = page_server(&coord.url(), "a", 0);
    let mut b = ChildServer::start(&coord.url(), "b", NODE_BYTES as u64);
    let mgr = manager(&coord.url());
    assert!(wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().nodes().len() == 2 && mgr.map().len() == 2
    }));
    let gpa_a = 5 * PAGE_SIZE as u64;
    let gpa_b = NODE_BYTES as u64 + 9 * PAGE_SIZE as u64;
    mgr.write_page(gpa_a, &page_for(gpa_a, 4)).unwrap();
    mgr.write_page(gpa_b, &page_for(gpa_b, 4)).unwrap();

    b.kill(); // SIGKILL: no goodbye on the socket beyond the kernel's RST/FIN

    let mut page = [0u8; PAGE_SIZE];
    let started = Instant::now();
    let err = mgr.read_page(gpa_b, &mut page).unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(err, TransportError::NodeDown { ref node, .. } | TransportError::Timeout { ref node, .. } if node == "b"),
        "unexpected error {err:?}"
    );
    assert!(
        took < Duration::from_millis(500 + 500),
        "took {took:?}, past the deadline"
    );
    // Asking again fails fast too, and never hangs.
    let started = Instant::now();
    assert!(mgr.read_page(gpa_b, &mut page).is_err());
    assert!(started.elapsed() < Duration::from_secs(1));

    // The other node is unaffected.
    for _ in 0..100 {
        mgr.read_page(gpa_a, &mut page).unwrap();
        assert!(page == page_for(gpa_a, 4));
    }
    // A batch across both reports the error and still moves node a's pages.
    let gpas = [gpa_a, gpa_b];
    let mut two = [[0u8; PAGE_SIZE]; 2];
    assert!(mgr.read_pages(&gpas, &mut two).is_err());
    assert!(two[0] == page_for(gpa_a, 4));
}

#[test]
fn restarted_page_server_refuses_writes_until_its_range_is_reinitialised() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let mut b = ChildServer::start(&coord.url(), "b", 0);
    let mgr = manager(&coord.url());
    assert!(wait_until(Duration::from_secs(10), || mgr
        .refresh_map()
        .is_ok()
        && mgr.map().len() == 1));
    mgr.write_page(0, &page_for(0, 5)).unwrap();
    b.kill();
    let mut page = [0u8; PAGE_SIZE];
    assert!(mgr.read_page(0, &mut page).is_err());
    // Same node id and range, new process (new epoch, empty memory) on a
    // new port: the manager follows the new address, but the range's
    // contents are gone, so a write (which would mix new pages with lost
    // ones) is refused, never taken.
    let _b2 = ChildServer::start(&coord.url(), "b", 0);
    assert!(
        wait_until(Duration::from_secs(10), || {
            match mgr.write_page(0, &page_for(0, 6)) {
                Ok(()) => panic!("a write to a lost range was taken"),
                Err(TransportError::DataLost { gpa, node }) => {
                    assert_eq!((gpa, node.as_str()), (0, "b"));
                    true
                }
                Err(_) => false,
            }
        }),
        "manager never reached the restarted node"
    );
    // Once the operator re-initialises the range, it is served again.
    let admin = coordinator_client(&coord.url());
    admin.reinitialise_range(0).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || {
            match mgr.write_page(0, &page_for(0, 6)) {
                Ok(()) => true,
                Err(TransportError::DataLost { .. }) => false,
                Err(other) => panic!("unexpected error: {other}"),
            }
        }),
        "writes still refused after the range was re-initialised"
    );
    mgr.read_page(0, &mut page).unwrap();
    assert!(
        page == page_for(0, 6),
        "restarted node serves the page just written"
    );
}

#[test]
fn coordinator_restart_on_same_database_keeps_nodes_and_map() {
    let db = tempfile::tempdir().unwrap();
    let db_path = db.path().join("c.db");
    let coord = coordinator_on(&db_path, SocketAddr::from(([127, 0, 0, 1], 0)));
    let addr = coord.addr();
    let _a = page_server(&coord.url(), "a", 0);
    let _b = page_server(&coord.url(), "b", NODE_BYTES as u64);
    let mgr = manager(&coord.url());
    let before = mgr.map();
    mgr.write_page(PAGE_SIZE as u64, &page_for(4096, 7))
        .unwrap();

    coord.shutdown().unwrap();
    let coord = coordinator_on(&db_path, addr);
    let version = mgr
        .refresh_map()
        .expect("manager reaches the restarted coordinator");
    assert_eq!(version, before.version());
    let after = mgr.map();
    assert_eq!(
        after.ranges().collect::<Vec<_>>(),
        before.ranges().collect::<Vec<_>>()
    );
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(PAGE_SIZE as u64, &mut page).unwrap();
    assert!(page == page_for(4096, 7));
    drop(coord);
}

/// With a cluster key on every piece, page-servers register with their node
/// credentials and the manager reads the map with the client credential;
/// one node's credential cannot move another node, and without a
/// credential the coordinator shows nothing.
#[test]
fn keyed_cluster_uses_derived_coordinator_credentials() {
    use rdma_transport::auth::ClusterKey;
    use rdma_transport::coordinator::api::NodeRegistration;
    use rdma_transport::coordinator::{CoordinatorClient, Credential};
    use rdma_transport::{ManagerConfig, TransportManager};

    let key = ClusterKey::generate().unwrap();
    let db = tempfile::tempdir().unwrap();
    let mut config = coordinator::CoordinatorConfig::new(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        db.path().join("c.db"),
    );
    config.cluster_key = Some(key.clone());
    let coord = coordinator::spawn(config).unwrap();
    let servers: Vec<_> = ["a", "b"]
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let mut cfg = page_server::ServerConfig::new(*node, NODE_BYTES);
            cfg.gpa_base = (i * NODE_BYTES) as u64;
            cfg.coordinator_url = Some(coord.url());
            cfg.cluster_key = Some(key.clone());
            let s = page_server::spawn(cfg).unwrap();
            s.wait_registered(Duration::from_secs(10)).unwrap();
            s
        })
        .collect();

    let anonymous = CoordinatorClient::new(&coord.url(), None, Duration::from_secs(5)).unwrap();
    assert!(anonymous.map().unwrap_err().is_unauthorized());
    let as_b = Credential::Node {
        id: "b".into(),
        key: key.clone(),
    };
    let b =
        CoordinatorClient::with_credential(&coord.url(), &as_b, Duration::from_secs(5)).unwrap();
    // A node credential reads the map (the replica recovery thread does).
    assert_eq!(b.map().unwrap().entries.len(), 2);
    let hijack = NodeRegistration {
        tcp_addr: "127.0.0.1:1".into(),
        rdma: None,
        epoch: 0,
    };
    assert!(b
        .register_node(&"a".to_owned(), &hijack)
        .unwrap_err()
        .is_forbidden());
    // Re-initialising a range (accepting the loss of its contents) is the
    // admin's alone: not even its owner node may do it.
    assert!(b
        .reinitialise_range(NODE_BYTES as u64)
        .unwrap_err()
        .is_forbidden());
    let as_client = Credential::Client { key: key.clone() };
    let reader =
        CoordinatorClient::with_credential(&coord.url(), &as_client, Duration::from_secs(5))
            .unwrap();
    assert!(reader.reinitialise_range(0).unwrap_err().is_forbidden());
    let as_admin = Credential::Admin { key: key.clone() };
    let admin = CoordinatorClient::with_credential(&coord.url(), &as_admin, Duration::from_secs(5))
        .unwrap();
    let entry = admin.reinitialise_range(NODE_BYTES as u64).unwrap();
    assert_eq!(entry.node_id, "b");
    assert!(admin
        .reinitialise_range(12345 * 4096)
        .unwrap_err()
        .is_not_found());

    let mgr = TransportManager::connect(ManagerConfig {
        coordinator_url: coord.url(),
        cluster_key: Some(key),
        request_timeout_ms: 500,
        connect_timeout_ms: 500,
        poller_cpus: Some(vec![]),
        ..ManagerConfig::default()
    })
    .unwrap();
    assert_eq!(mgr.map().nodes().len(), 2);
    round_trip_all_pages(&mgr, 2, 5, 2);
    drop(mgr);
    for s in servers {
        s.shutdown();
    }
}

#[test]
fn the_manager_follows_map_changes_by_long_poll_well_within_its_refresh_period() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let _a = page_server(&coord.url(), "a", 0);
    // A refresh period far longer than the test: only a long poll that the
    // change ends can bring the new map this soon (the test reads nothing,
    // so no miss refreshes it either).
    let mgr = rdma_transport::TransportManager::connect(rdma_transport::ManagerConfig {
        coordinator_url: coord.url(),
        map_refresh_ms: 60_000,
        poller_cpus: Some(vec![]),
        ..rdma_transport::ManagerConfig::default()
    })
    .expect("manager connects");
    let before = mgr.map().version();
    let registration = rdma_transport::coordinator::api::NodeRegistration {
        tcp_addr: "127.0.0.1:9".to_owned(),
        rdma: None,
        epoch: 7,
    };
    coordinator_client(&coord.url())
        .register_node(&"b".to_owned(), &registration)
        .expect("b registers");
    assert!(
        wait_until(Duration::from_secs(10), || mgr.map().version() > before),
        "the manager did not follow the change"
    );
    // Dropping the manager and then the coordinator does not wait for the
    // long poll in flight.
    let started = Instant::now();
    drop(mgr);
    drop(coord);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// A free port of 127.0.0.1 (nothing listens there once this returns).
fn free_addr() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("its address")
}

/// `--ready-file` says the page-server can be found through the map: it
/// is written once the node is registered with its range, not when it
/// listens. With the coordinator down at first, the page-server serves
/// (`GET /ready` answers "not registered") and there is no ready file;
/// once the coordinator is up, the file appears, and the map has the
/// range by then. Until 2026-12-07 the file was written on listening, and
/// a script reading the map next could miss the range.
#[test]
fn the_ready_file_appears_once_the_range_is_in_the_map() {
    let dir = tempfile::tempdir().unwrap();
    let (coordinator_addr, metrics) = (free_addr(), free_addr());
    let url = format!("http://{coordinator_addr}");
    let ready = dir.path().join("ready");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_page-server"))
        .args(["--node-id", "a", "--listen", "127.0.0.1:0", "--insecure"])
        .args(["--memory", &NODE_BYTES.to_string(), "--heartbeat-ms", "200"])
        .args([
            "--coordinator",
            &url,
            "--metrics-listen",
            &metrics.to_string(),
        ])
        .arg("--ready-file")
        .arg(&ready)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("page-server starts");
    let _child = KilledOnDrop(child);
    let not_registered = || {
        std::net::TcpStream::connect(metrics).is_ok()
            && http_get(metrics, "/ready")
                .1
                .contains("not registered with the coordinator yet")
    };
    assert!(
        wait_until(Duration::from_secs(20), not_registered),
        "the page-server never answered GET /ready"
    );
    assert!(
        !ready.exists(),
        "the ready file was written before the page-server registered"
    );

    let _coord = coordinator_on(&dir.path().join("c.db"), coordinator_addr);
    assert!(
        wait_until(Duration::from_secs(20), || ready.exists()),
        "the ready file never appeared once the coordinator was up"
    );
    let addr = std::fs::read_to_string(&ready).expect("the ready file");
    let map = coordinator_client(&url).map().expect("the map");
    assert!(
        map.entries
            .iter()
            .any(|e| e.gpa_start == 0 && e.node_id == "a"),
        "the ready file appeared before the range was in the map: {map:?}"
    );
    assert!(
        map.nodes.iter().any(|n| n.id == "a" && n.tcp_addr == addr),
        "the ready file's address {addr} is not the registered one: {map:?}"
    );
}

/// A child process, killed and reaped when dropped (a failed test too).
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
