//! End-to-end over real verbs: a coordinator and page-servers in-process,
//! driven through the TransportManager with `TransportKind::Rdma`.
//!
//! The device tests are `#[ignore]`d: a plain `cargo test` lists them as
//! ignored instead of passing them without a device. They run where a
//! device is: in the SoftRoCE VM (`deploy/softroce/run-rdma-tests.sh` and
//! `cargo-test-in-vm.sh` pass `--include-ignored`), or on a host with one
//! (`cargo test -p page-server --test rdma_cluster -- --include-ignored`).
//! When run, a missing device FAILS them.

#[path = "rdma_cluster/coherence.rs"]
mod coherence;
mod common;
#[path = "rdma_cluster/guest_alias.rs"]
mod guest_alias;
#[path = "rdma_cluster/hedging.rs"]
mod hedging;
#[path = "rdma_cluster/keys.rs"]
mod keys;
#[path = "rdma_cluster/replication.rs"]
mod replication;
#[path = "rdma_cluster/zero_copy.rs"]
mod zero_copy;

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use page_server::{RunningServer, ServerConfig};
use rdma_transport::verbs::{list_devices, Verbs, WcStatus};
use rdma_transport::{
    DataPath, ManagerConfig, PollMode, TransportError, TransportKind, TransportManager, PAGE_SIZE,
};

const PAGES_PER_NODE: u64 = (NODE_BYTES / PAGE_SIZE) as u64;
/// Generous: debug builds under TCG emulation are slow.
const REQUEST_TIMEOUT_MS: u64 = 3000;

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// Fails the test unless this machine has an RDMA device: a device test
/// never passes without one.
fn require_device(test: &str) {
    let found = match Verbs::load() {
        Ok(verbs) => match list_devices(&verbs) {
            Ok(devs) if !devs.is_empty() => Ok(()),
            Ok(_) => Err("no RDMA device found".to_owned()),
            Err(e) => Err(format!("listing RDMA devices failed ({e})")),
        },
        Err(e) => Err(format!("libibverbs cannot be loaded ({e})")),
    };
    if let Err(why) = found {
        panic!("{test}: {why}; run it where a device is: deploy/softroce/run-rdma-tests.sh");
    }
}

fn device_name() -> Option<String> {
    std::env::var("RDMA_DEVICE").ok().filter(|v| !v.is_empty())
}

fn config(url: &str, transport: TransportKind, mode: PollMode) -> ManagerConfig {
    ManagerConfig {
        coordinator_url: url.to_owned(),
        transport,
        poll_mode: mode,
        request_timeout_ms: REQUEST_TIMEOUT_MS,
        connect_timeout_ms: REQUEST_TIMEOUT_MS,
        poller_cpus: Some(vec![]),
        rdma_device: device_name(),
        ..ManagerConfig::default()
    }
}

fn rdma_manager(url: &str, mode: PollMode) -> TransportManager {
    TransportManager::connect(config(url, TransportKind::Rdma, mode)).expect("manager connects")
}

fn server(url: &str, node: &str, gpa_base: u64, rdma: bool) -> RunningServer {
    let mut cfg = ServerConfig::new(node, NODE_BYTES);
    cfg.gpa_base = gpa_base;
    cfg.coordinator_url = Some(url.to_owned());
    cfg.rdma.enabled = rdma;
    cfg.rdma.device = device_name();
    let s = page_server::spawn(cfg).expect("page-server starts");
    s.wait_registered(Duration::from_secs(10))
        .expect("page-server registers");
    s
}

fn coordinator(db: &tempfile::TempDir) -> coordinator::RunningCoordinator {
    coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    )
}

fn assert_all_rdma(mgr: &TransportManager) {
    for (node, path) in mgr.node_transports() {
        assert_eq!(path, Some(DataPath::Rdma), "node {node}");
    }
}

/// QP set-up, single and batched READ/WRITE with content checked, read
/// into a frame, and many requests in flight from several threads.
fn pages_round_trip(test: &str, mode: PollMode) {
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let a = server(&coord.url(), "a", 0, true);
    let b = server(&coord.url(), "b", NODE_BYTES as u64, true);
    assert!(a.rdma_region().is_some(), "server a serves RDMA");
    assert!(b.rdma_region().is_some(), "server b serves RDMA");

    // The coordinator publishes each node's device endpoint, never a region
    // key (each client gets its own in the handshake).
    let map = coordinator_client(&coord.url()).map().unwrap();
    let entry_a = map.entries.iter().find(|e| e.node_id == "a").unwrap();
    assert_eq!(entry_a.rdma, None);
    for node in &map.nodes {
        let ep = node
            .rdma
            .as_ref()
            .expect("node publishes its RDMA endpoint");
        if let Ok(index) = std::env::var("RXE_GID_INDEX") {
            // The server found the IPv4-mapped RoCE v2 GID by itself.
            assert_eq!(ep.gid_index.to_string(), index, "{ep:?}");
            assert!(ep.gid.starts_with("::ffff:"), "{ep:?}");
        }
    }

    let mgr = rdma_manager(&coord.url(), mode);
    assert_all_rdma(&mgr);
    let qpns = (
        mgr.rdma_qpn_for_test("a").unwrap(),
        mgr.rdma_qpn_for_test("b").unwrap(),
    );

    round_trip_all_pages(&mgr, 2, 5, 7);
    let all: Vec<u64> = (0..2 * PAGES_PER_NODE)
        .map(|p| p * PAGE_SIZE as u64)
        .collect();

    // Many in flight: threads each write their own quarter with batches of
    // 32, then read random batches of 64 across both nodes.
    let failed = AtomicBool::new(false);
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (mgr, all, failed) = (&mgr, &all, &failed);
            s.spawn(move || {
                let quarter = all.len() / 4;
                let mine = &all[t as usize * quarter..(t as usize + 1) * quarter];
                for chunk in mine.chunks(32) {
                    let data: Vec<_> = chunk.iter().map(|&g| page_for(g, 3)).collect();
                    mgr.write_pages(chunk, &data).unwrap();
                }
                let mut x = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                let mut buf = vec![[0u8; PAGE_SIZE]; 64];
                for _ in 0..10 {
                    let batch: Vec<u64> = (0..64)
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            let i = (x % quarter as u64) as usize;
                            mine[i]
                        })
                        .collect();
                    mgr.read_pages(&batch, &mut buf).unwrap();
                    for (p, &g) in buf.iter().zip(&batch) {
                        if *p != page_for(g, 3) {
                            failed.store(true, Ordering::SeqCst);
                        }
                    }
                }
            });
        }
    });
    assert!(!failed.load(Ordering::SeqCst), "a concurrent page differs");
    say(&format!(
        "{test}: {} pages moved by 4 threads in {:?}; {} CQ events taken by pollers",
        all.len() + 4 * 10 * 64,
        started.elapsed(),
        mgr.rdma_cq_events_for_test()
    ));
    // The happy path never rebuilt a QP.
    assert_eq!(
        (
            mgr.rdma_qpn_for_test("a").unwrap(),
            mgr.rdma_qpn_for_test("b").unwrap()
        ),
        qpns
    );
    assert_all_rdma(&mgr);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_pages_round_trip_busy_poll() {
    pages_round_trip("rdma_pages_round_trip_busy_poll", PollMode::Busy);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_pages_round_trip_event_mode() {
    pages_round_trip("rdma_pages_round_trip_event_mode", PollMode::Event);
}

fn bad_rkey(test: &str, mode: PollMode) {
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let _a = server(&coord.url(), "a", 0, true);
    let mgr = rdma_manager(&coord.url(), mode);
    let gpas: Vec<u64> = (0..16).map(|p| p * PAGE_SIZE as u64).collect();
    let pages: Vec<_> = gpas.iter().map(|&g| page_for(g, 4)).collect();
    mgr.write_pages(&gpas, &pages).unwrap();
    let mut page = [0u8; PAGE_SIZE];

    for round in 0..2 {
        let qpn = mgr.rdma_qpn_for_test("a").expect("RDMA connection");
        assert!(mgr.corrupt_rkey_for_test("a"));
        let started = Instant::now();
        let err = if round == 0 {
            mgr.read_page(gpas[3], &mut page).unwrap_err()
        } else {
            let mut many = vec![[0u8; PAGE_SIZE]; gpas.len()];
            mgr.read_pages(&gpas, &mut many).unwrap_err()
        };
        let took = started.elapsed();
        match &err {
            TransportError::RdmaCompletion { node, status } => {
                assert_eq!(node, "a");
                assert_ne!(*status, WcStatus::Success);
            }
            other => panic!("{test}: expected an RDMA completion error, got {other:?}"),
        }
        assert!(
            took < Duration::from_millis(REQUEST_TIMEOUT_MS),
            "{test}: error took {took:?}"
        );
        say(&format!("{test}: bad rkey -> {err} in {took:?}"));
        // The next request builds a new QP and works.
        mgr.read_page(gpas[3], &mut page).unwrap();
        assert!(page == pages[3]);
        let new_qpn = mgr.rdma_qpn_for_test("a").expect("rebuilt RDMA connection");
        assert_ne!(new_qpn, qpn, "{test}: the QP was not rebuilt");
    }
    // Writes through the rebuilt QP land too.
    mgr.write_page(gpas[5], &page_for(gpas[5], 9)).unwrap();
    mgr.read_page(gpas[5], &mut page).unwrap();
    assert!(page == page_for(gpas[5], 9));
    assert_all_rdma(&mgr);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_bad_rkey_is_a_typed_error_and_the_qp_is_rebuilt() {
    bad_rkey(
        "rdma_bad_rkey_is_a_typed_error_and_the_qp_is_rebuilt",
        PollMode::Busy,
    );
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_bad_rkey_event_mode() {
    bad_rkey("rdma_bad_rkey_event_mode", PollMode::Event);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_page_server_restart_is_served_from_a_new_qp() {
    let test = "rdma_page_server_restart_is_served_from_a_new_qp";
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let a = server(&coord.url(), "a", 0, true);
    let mgr = rdma_manager(&coord.url(), PollMode::Busy);
    let (g0, g1) = (0u64, 8 * PAGE_SIZE as u64);
    mgr.write_page(g0, &page_for(g0, 5)).unwrap();
    mgr.write_page(g1, &page_for(g1, 5)).unwrap();
    let qpn = mgr.rdma_qpn_for_test("a").unwrap();

    a.shutdown();
    // The control connection's EOF tears the QP down: an error, fast.
    let mut page = [0u8; PAGE_SIZE];
    let started = Instant::now();
    assert!(mgr.read_page(g0, &mut page).is_err());
    assert!(started.elapsed() < Duration::from_millis(REQUEST_TIMEOUT_MS + 500));

    // Same node id and range, a new process-equivalent on a new port (new
    // epoch, empty memory): once the manager reaches it, the range's pages
    // are DataLost over the new QP, never served as zeros, and writes are
    // refused.
    let _a2 = server(&coord.url(), "a", 0, true);
    let lost = |result: Result<(), TransportError>| match result {
        Ok(()) => panic!("a page of the restarted node's lost range was served"),
        Err(TransportError::DataLost { node, .. }) => {
            assert_eq!(node, "a");
            true
        }
        Err(_) => false,
    };
    assert!(
        wait_until(Duration::from_secs(20), || lost(
            mgr.read_page(g1, &mut page)
        )),
        "manager never reached the restarted node"
    );
    assert!(lost(mgr.read_page(g0, &mut page)));
    assert!(lost(mgr.write_page(g0, &page_for(g0, 6))));
    // The operator re-initialises the range: zeros are its contents now.
    let admin = coordinator_client(&coord.url());
    admin.reinitialise_range(0).unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || {
            match mgr.read_page(g1, &mut page) {
                Ok(()) => true,
                Err(TransportError::DataLost { .. }) => false,
                Err(other) => panic!("unexpected error after re-initialise: {other}"),
            }
        }),
        "reads still refused after the range was re-initialised"
    );
    assert!(
        page == [0u8; PAGE_SIZE],
        "a re-initialised page reads as zeros"
    );
    mgr.write_page(g0, &page_for(g0, 6)).unwrap();
    mgr.read_page(g0, &mut page).unwrap();
    assert!(
        page == page_for(g0, 6),
        "the new server serves the new page"
    );
    let new_qpn = mgr.rdma_qpn_for_test("a").expect("RDMA connection");
    assert_ne!(new_qpn, qpn);
    assert_all_rdma(&mgr);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_silently_dead_peer_qp_fails_within_the_deadline_and_is_rebuilt() {
    let test = "rdma_silently_dead_peer_qp_fails_within_the_deadline_and_is_rebuilt";
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let a = server(&coord.url(), "a", 0, true);
    let mgr = rdma_manager(&coord.url(), PollMode::Busy);
    let gpa = 3 * PAGE_SIZE as u64;
    mgr.write_page(gpa, &page_for(gpa, 10)).unwrap();
    let qpn = mgr.rdma_qpn_for_test("a").unwrap();

    // The server's QP dies; its control connection (no EOF) stays up.
    assert_eq!(a.break_rdma_qps_for_test(), 1);
    let mut page = [0u8; PAGE_SIZE];
    let started = Instant::now();
    let err = mgr.read_page(gpa, &mut page).unwrap_err();
    let took = started.elapsed();
    say(&format!("{test}: {err} after {took:?}"));
    match &err {
        TransportError::RdmaCompletion { node, status } => {
            assert_eq!(node, "a");
            assert_ne!(*status, WcStatus::Success);
        }
        TransportError::Timeout { node, .. } => assert_eq!(node, "a"),
        other => panic!("{test}: unexpected error {other:?}"),
    }
    assert!(
        took <= Duration::from_millis(REQUEST_TIMEOUT_MS + 500),
        "{test}: took {took:?}"
    );
    // Rebuilt on both sides: the next request is served.
    mgr.read_page(gpa, &mut page).unwrap();
    assert!(page == page_for(gpa, 10));
    assert_ne!(mgr.rdma_qpn_for_test("a").unwrap(), qpn);
}

/// A page-server that fences itself (here its lease fence: the link to the
/// coordinator holds everything) cuts its clients' one-sided RDMA off:
/// their READs fail rather than read a region another process of the node
/// may own by now. Once the coordinator answers again, they are served
/// over a new QP. Without the cut, the READ was served by the device while
/// the page-server's threads served nothing.
#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_a_fenced_page_server_serves_no_rdma_read() {
    let test = "rdma_a_fenced_page_server_serves_no_rdma_read";
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let relay = common::stalling_link::StallingLink::start();
    relay.set_target(&coord.addr().to_string());
    let mut cfg = ServerConfig::new("a", NODE_BYTES);
    cfg.coordinator_url = Some(format!("http://{}", relay.addr()));
    cfg.rdma.device = device_name();
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.lease_fence = Duration::from_millis(1000);
    let a = page_server::spawn(cfg).expect("page-server starts");
    a.wait_registered(Duration::from_secs(10))
        .expect("page-server registers");
    let mgr = rdma_manager(&coord.url(), PollMode::Busy);
    let gpa = 5 * PAGE_SIZE as u64;
    mgr.write_page(gpa, &page_for(gpa, 11)).unwrap();
    assert_all_rdma(&mgr);
    let qpn = mgr.rdma_qpn_for_test("a").unwrap();

    relay.hold();
    assert!(
        wait_until(Duration::from_secs(30), || a.stats().fenced),
        "{test}: the page-server never fenced itself"
    );
    let mut page = [0u8; PAGE_SIZE];
    let got = mgr.read_page(gpa, &mut page);
    say(&format!("{test}: read while fenced: {got:?}"));
    assert!(
        got.is_err(),
        "{test}: an RDMA READ served by a fenced page-server"
    );

    relay.release();
    assert!(
        wait_until(Duration::from_secs(30), || !a.stats().fenced),
        "{test}: the page-server never served again"
    );
    assert!(
        wait_until(Duration::from_secs(30), || mgr
            .read_page(gpa, &mut page)
            .is_ok()),
        "{test}: never read again"
    );
    assert!(page == page_for(gpa, 11), "{test}: not the page written");
    assert_all_rdma(&mgr);
    assert_ne!(
        mgr.rdma_qpn_for_test("a").unwrap(),
        qpn,
        "{test}: the same QP"
    );
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_auto_uses_tcp_for_a_node_without_rdma_and_rdma_kind_refuses_it() {
    let test = "rdma_auto_uses_tcp_for_a_node_without_rdma_and_rdma_kind_refuses_it";
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let _a = server(&coord.url(), "a", 0, true);
    let _b = server(&coord.url(), "b", NODE_BYTES as u64, false);
    let (ga, gb) = (PAGE_SIZE as u64, NODE_BYTES as u64 + PAGE_SIZE as u64);

    let auto = TransportManager::connect(config(&coord.url(), TransportKind::Auto, PollMode::Busy))
        .unwrap();
    let mut paths = auto.node_transports();
    paths.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        paths,
        vec![
            ("a".to_owned(), Some(DataPath::Rdma)),
            ("b".to_owned(), Some(DataPath::Tcp))
        ]
    );
    // One batch across both kinds of node.
    let gpas = [ga, gb];
    let pages = [page_for(ga, 7), page_for(gb, 7)];
    auto.write_pages(&gpas, &pages).unwrap();
    let mut back = [[0u8; PAGE_SIZE]; 2];
    auto.read_pages(&gpas, &mut back).unwrap();
    assert!(back == pages);

    let rdma = rdma_manager(&coord.url(), PollMode::Busy);
    let mut page = [0u8; PAGE_SIZE];
    rdma.read_page(ga, &mut page).unwrap();
    assert!(page == pages[0]);
    match rdma.read_page(gb, &mut page) {
        Err(TransportError::RdmaUnavailable(reason)) => {
            assert!(reason.contains('b'), "{reason}");
        }
        other => panic!("{test}: expected RdmaUnavailable for node b, got {other:?}"),
    }
}

/// Without a usable device (none on the host; a device name that does not
/// exist where there is one, so this runs, and tests, everywhere):
/// `TransportKind::Rdma` refuses with the reason and `Auto` runs over TCP.
#[test]
fn without_a_device_rdma_kind_refuses_and_auto_uses_tcp() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let _a = server(&coord.url(), "a", 0, true);
    let no_device = |transport| ManagerConfig {
        rdma_device: Some("no-such-rdma-device".to_owned()),
        ..config(&coord.url(), transport, PollMode::Busy)
    };
    match TransportManager::connect(no_device(TransportKind::Rdma)) {
        Err(TransportError::RdmaUnavailable(reason)) => assert!(!reason.is_empty()),
        other => panic!("expected RdmaUnavailable, got {other:?}"),
    }
    let auto = TransportManager::connect(no_device(TransportKind::Auto)).unwrap();
    auto.write_page(0, &page_for(0, 8)).unwrap();
    assert_eq!(
        auto.node_transports(),
        vec![("a".to_owned(), Some(DataPath::Tcp))]
    );
}

/// A caller that unwinds (a panic caught by `catch_unwind`, as the C API
/// does) while its RDMA request is still in flight: the QP is torn down at
/// once, before any later completion, so the NIC cannot write into a frame
/// that went back to the pool; the next request runs on a new QP and every
/// frame returns to the pool. The server's QP is made silently dead and the
/// ACK timeout is long, so the request is certainly still in flight when
/// the caller unwinds.
fn unwind_mid_request(test: &str, mode: PollMode) {
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let a = server(&coord.url(), "a", 0, true);
    let mgr = TransportManager::connect(ManagerConfig {
        // ~4.3 s per try: the dead QP is not noticed while the test looks.
        rdma_ack_timeout: 20,
        ..config(&coord.url(), TransportKind::Rdma, mode)
    })
    .expect("manager connects");
    let (g0, g1) = (0u64, 5 * PAGE_SIZE as u64);
    mgr.write_pages(&[g0, g1], &[page_for(g0, 3), page_for(g1, 3)])
        .unwrap();
    let capacity = mgr.pool().capacity();
    let connected = |mgr: &TransportManager| {
        mgr.node_transports()
            .iter()
            .any(|(n, p)| n == "a" && p.is_some())
    };
    for batch in [false, true] {
        let qpn = mgr.rdma_qpn_for_test("a").expect("RDMA connection");
        assert_eq!(a.break_rdma_qps_for_test(), 1);
        mgr.panic_after_next_submit_for_test();
        let mut pages = [[0u8; PAGE_SIZE]; 2];
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match batch {
            false => mgr.read_page(g0, &mut pages[0]),
            true => mgr.read_pages(&[g0, g1], &mut pages),
        }));
        assert!(unwound.is_err(), "{test}: the injected panic unwound");
        assert!(
            !connected(&mgr),
            "{test} (batch {batch}): the connection of an abandoned in-flight request is still up"
        );
        mgr.read_pages(&[g0, g1], &mut pages)
            .expect("served again on a new QP");
        assert!(pages[0] == page_for(g0, 3) && pages[1] == page_for(g1, 3));
        assert_ne!(mgr.rdma_qpn_for_test("a").unwrap(), qpn);
        assert!(
            wait_until(Duration::from_secs(10), || mgr.pool().available()
                == capacity),
            "{test}: frames never came back to the pool ({} of {capacity})",
            mgr.pool().available()
        );
    }
    assert_all_rdma(&mgr);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_caller_unwinding_mid_request_tears_the_qp_down() {
    unwind_mid_request(
        "rdma_caller_unwinding_mid_request_tears_the_qp_down",
        PollMode::Busy,
    );
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_caller_unwinding_mid_request_event_mode() {
    unwind_mid_request(
        "rdma_caller_unwinding_mid_request_event_mode",
        PollMode::Event,
    );
}

/// A client whose pages move by RDMA sends nothing on its TCP connection:
/// the page-server's idle timeout must not close it (that would tear down
/// the client's QP). RDMA traffic for well past the idle timeout keeps the
/// same QP and every page right.
#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_sessions_are_not_closed_as_idle() {
    let test = "rdma_sessions_are_not_closed_as_idle";
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let mut cfg = ServerConfig::new("a", NODE_BYTES);
    cfg.coordinator_url = Some(coord.url());
    cfg.rdma.device = device_name();
    cfg.idle_timeout = Duration::from_millis(300);
    let a = page_server::spawn(cfg).expect("page-server starts");
    a.wait_registered(Duration::from_secs(10)).unwrap();
    let mgr = rdma_manager(&coord.url(), PollMode::Busy);
    let gpa = 6 * PAGE_SIZE as u64;
    mgr.write_page(gpa, &page_for(gpa, 8)).unwrap();
    let qpn = mgr.rdma_qpn_for_test("a").expect("an RDMA connection");
    let started = Instant::now();
    let mut page = [0u8; PAGE_SIZE];
    let mut reads = 0u32;
    while started.elapsed() < Duration::from_millis(1500) {
        mgr.read_page(gpa, &mut page).unwrap();
        assert!(page == page_for(gpa, 8));
        reads += 1;
    }
    say(&format!("{test}: {reads} RDMA reads over 1.5 s"));
    assert_eq!(
        a.stats().idle_timeouts,
        0,
        "an RDMA session was closed as idle"
    );
    assert_eq!(mgr.rdma_qpn_for_test("a"), Some(qpn), "the QP was rebuilt");
    assert_all_rdma(&mgr);
}

/// An RDMA WRITE lands in a page-server's memory without the process
/// seeing it, so the recovery's write guard cannot keep an older copied
/// page from overwriting it. A recovering replica therefore serves its
/// clients over TCP until it is live again: its RDMA sessions are closed
/// when the recovery begins (an `auto` client redials and gets TCP), and
/// the connections answered without RDMA are closed when it ends (the
/// client comes back over RDMA). Every page written meanwhile is on the
/// recovered replica afterwards.
#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_a_recovering_replica_takes_writes_over_tcp_then_rdma_again() {
    use rdma_transport::coordinator::api::ReplicaState;
    let test = "rdma_a_recovering_replica_takes_writes_over_tcp_then_rdma_again";
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let url = coord.url();
    let replica = |node: &str| {
        let mut cfg = ServerConfig::new(node, NODE_BYTES);
        cfg.coordinator_url = Some(url.clone());
        cfg.rdma.enabled = true;
        cfg.rdma.device = device_name();
        cfg.heartbeat_interval = Duration::from_millis(200);
        cfg.recovery_grace = Duration::from_millis(1500);
        cfg.recovery_rate_mib_s = 0;
        let s = page_server::spawn(cfg).expect("page-server starts");
        s.wait_registered(Duration::from_secs(10))
            .expect("page-server registers");
        s
    };
    let admin = coordinator_client(&url);
    let state_of = |node: &str| {
        admin.map().ok().and_then(|m| {
            m.entries
                .first()
                .and_then(|e| e.replicas.iter().find(|r| r.node_id == node))
                .map(|r| r.state)
        })
    };
    let a = replica("a");
    let b = replica("b");
    assert!(
        wait_until(Duration::from_secs(30), || state_of("b")
            == Some(ReplicaState::Live)),
        "b never joined as a live replica"
    );
    let mgr = TransportManager::connect(config(&url, TransportKind::Auto, PollMode::Busy))
        .expect("manager connects");
    let path_of = |node: &str| {
        mgr.node_transports()
            .into_iter()
            .find(|(n, _)| n == node)
            .and_then(|(_, p)| p)
    };
    let mut last_seed = vec![0u8; PAGES_PER_NODE as usize];
    let mut write = |i: u64, seed: u8| {
        let gpa = i * PAGE_SIZE as u64;
        mgr.write_page(gpa, &page_for(gpa, seed))
            .unwrap_or_else(|e| panic!("write of {gpa:#x}: {e}"));
        last_seed[i as usize] = seed;
    };
    for i in 0..PAGES_PER_NODE {
        write(i, 1);
    }
    assert_eq!(path_of("a"), Some(DataPath::Rdma));
    assert_eq!(path_of("b"), Some(DataPath::Rdma));

    // b misses a write (as a client would report it): it recovers.
    admin
        .mark_replica_stale(0, "b", Duration::from_secs(5))
        .expect("b marked stale");
    let (mut saw_tcp_while_recovering, mut i, mut seed) = (false, 0u64, 2u8);
    let live_again = wait_until(Duration::from_secs(60), || {
        write(i % PAGES_PER_NODE, seed);
        i += 1;
        if i % PAGES_PER_NODE == 0 {
            seed = seed.wrapping_add(1).max(2);
        }
        if state_of("b") == Some(ReplicaState::Recovering) && path_of("b") == Some(DataPath::Tcp) {
            saw_tcp_while_recovering = true;
        }
        state_of("b") == Some(ReplicaState::Live) && b.stats().recoveries > 0
    });
    assert!(live_again, "b never recovered");
    assert!(
        saw_tcp_while_recovering,
        "the manager kept moving pages to the recovering replica by RDMA"
    );
    // Closed when the recovery ended: the next request redials with RDMA.
    assert!(
        wait_until(Duration::from_secs(20), || {
            write(i % PAGES_PER_NODE, seed);
            i += 1;
            path_of("b") == Some(DataPath::Rdma)
        }),
        "the manager never came back to b over RDMA"
    );
    // Every page's last acknowledged write is on the recovered replica.
    let only_b = replica_manager(&admin.map().unwrap(), "b");
    let mut page = [0u8; PAGE_SIZE];
    for (k, &s) in last_seed.iter().enumerate() {
        let gpa = k as u64 * PAGE_SIZE as u64;
        only_b.read_page(gpa, &mut page).expect("read from b");
        assert!(
            page == page_for(gpa, s),
            "b's page {gpa:#x} is not its last write"
        );
    }
    say(&format!(
        "{test}: {i} writes during and after the recovery; b recovered, all {PAGES_PER_NODE} pages right"
    ));
    drop(a);
}
