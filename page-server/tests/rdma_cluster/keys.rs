//! Per-connection remote keys: each client connection of a page-server gets
//! an rkey of its own, no other client's QP can use it, and it is revoked
//! when the connection closes. Every test runs with type-2 memory windows
//! (what `auto` picks on SoftRoCE) and with per-client MRs.

use page_server::{ClientKeyKind, ClientKeys};

use super::*;

fn keyed_server(url: &str, keys: ClientKeys, memory_bytes: usize) -> RunningServer {
    let mut cfg = ServerConfig::new("a", memory_bytes);
    cfg.coordinator_url = Some(url.to_owned());
    cfg.rdma.device = device_name();
    cfg.rdma.client_keys = keys;
    let s = page_server::spawn(cfg).expect("page-server starts");
    s.wait_registered(Duration::from_secs(10))
        .expect("page-server registers");
    s
}

fn expected_kind(keys: ClientKeys) -> ClientKeyKind {
    match keys {
        // SoftRoCE (rxe) has type-2 windows: auto must find them there.
        ClientKeys::Auto | ClientKeys::MemoryWindow => ClientKeyKind::MemoryWindow,
        ClientKeys::MemoryRegion => ClientKeyKind::MemoryRegion,
    }
}

fn expect_remote_access(test: &str, result: Result<(), TransportError>) {
    match result {
        Err(TransportError::RdmaCompletion { node, status }) => {
            assert_eq!(node, "a");
            assert_eq!(status, WcStatus::RemoteAccess, "{test}");
        }
        other => panic!("{test}: expected a remote access error, got {other:?}"),
    }
}

fn read(mgr: &TransportManager, gpa: u64) -> [u8; PAGE_SIZE] {
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(gpa, &mut page).expect("page read");
    page
}

fn own_keys(test: &str, keys: ClientKeys) {
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let a = keyed_server(&coord.url(), keys, NODE_BYTES);
    assert_eq!(a.rdma_client_keys(), Some(expected_kind(keys)), "{test}");
    let published = a.rdma_region().unwrap().rkey;
    let (m1, m2) = (
        rdma_manager(&coord.url(), PollMode::Busy),
        rdma_manager(&coord.url(), PollMode::Busy),
    );
    let (g1, g2) = (2 * PAGE_SIZE as u64, 9 * PAGE_SIZE as u64);
    m1.write_page(g1, &page_for(g1, 21)).unwrap();
    m2.write_page(g2, &page_for(g2, 22)).unwrap();
    // Both see both pages: one region, two keys.
    for m in [&m1, &m2] {
        assert!(read(m, g1) == page_for(g1, 21));
        assert!(read(m, g2) == page_for(g2, 22));
    }
    let (k1, k2) = (
        m1.rdma_rkey_for_test("a").unwrap(),
        m2.rdma_rkey_for_test("a").unwrap(),
    );
    say(&format!(
        "{test}: client rkeys {k1:#x} and {k2:#x}, region MR's {published:#x}"
    ));
    assert_ne!(k1, k2, "{test}: two clients got the same rkey");
    assert!(
        k1 != published && k2 != published,
        "{test}: a client got the region MR's rkey"
    );
    let mut live = a.rdma_client_keys_for_test();
    live.sort_by_key(|k| k.rkey);
    let mut want = vec![k1, k2];
    want.sort_unstable();
    assert_eq!(live.iter().map(|k| k.rkey).collect::<Vec<_>>(), want);
    assert!(
        live.iter().all(|k| k.kind == expected_kind(keys)),
        "{live:?}"
    );
    assert_all_rdma(&m1);
    assert_all_rdma(&m2);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_each_client_connection_gets_its_own_key_window() {
    own_keys(
        "rdma_each_client_connection_gets_its_own_key_window",
        ClientKeys::Auto,
    );
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_each_client_connection_gets_its_own_key_region() {
    own_keys(
        "rdma_each_client_connection_gets_its_own_key_region",
        ClientKeys::MemoryRegion,
    );
}

fn key_dies_with_connection(test: &str, keys: ClientKeys) {
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let a = keyed_server(&coord.url(), keys, NODE_BYTES);
    let mgr = rdma_manager(&coord.url(), PollMode::Busy);
    let gpa = 4 * PAGE_SIZE as u64;
    mgr.write_page(gpa, &page_for(gpa, 31)).unwrap();
    let old_key = mgr.rdma_rkey_for_test("a").unwrap();
    let old_qpn = mgr.rdma_qpn_for_test("a").unwrap();

    // A failed request closes the connection; the next one opens another.
    assert!(mgr.corrupt_rkey_for_test("a"));
    let mut page = [0u8; PAGE_SIZE];
    assert!(mgr.read_page(gpa, &mut page).is_err());
    assert!(read(&mgr, gpa) == page_for(gpa, 31));
    assert_ne!(mgr.rdma_qpn_for_test("a").unwrap(), old_qpn);
    let new_key = mgr.rdma_rkey_for_test("a").unwrap();
    assert_ne!(
        new_key, old_key,
        "{test}: the new connection got the old key"
    );
    // The server revoked the old connection's key (window deallocated or
    // MR deregistered) once it saw the connection close.
    assert!(
        wait_until(Duration::from_secs(10), || a
            .rdma_client_keys_for_test()
            .iter()
            .all(|k| k.rkey != old_key)),
        "{test}: the closed connection's key is still live"
    );
    assert_eq!(a.rdma_client_keys_for_test().len(), 1);

    // The old key on the new connection: refused, nothing read.
    assert!(mgr.set_rdma_rkey_for_test("a", old_key));
    let mut page = [0u8; PAGE_SIZE];
    expect_remote_access(test, mgr.read_page(gpa, &mut page));
    assert!(
        page != page_for(gpa, 31),
        "{test}: the old key read the page"
    );
    // Nor written: a write with it fails and the page keeps its content.
    assert!(read(&mgr, gpa) == page_for(gpa, 31));
    assert!(mgr.set_rdma_rkey_for_test("a", old_key));
    expect_remote_access(test, mgr.write_page(gpa, &page_for(gpa, 32)));
    // The connection's own key works, and the page was never touched.
    assert!(read(&mgr, gpa) == page_for(gpa, 31));
    mgr.write_page(gpa, &page_for(gpa, 33)).unwrap();
    assert!(read(&mgr, gpa) == page_for(gpa, 33));
    assert_all_rdma(&mgr);
    assert_eq!(rdma_transport::verbs::destroy_failures(), 0);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_key_stops_working_when_its_connection_closes_window() {
    key_dies_with_connection(
        "rdma_key_stops_working_when_its_connection_closes_window",
        ClientKeys::Auto,
    );
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_key_stops_working_when_its_connection_closes_region() {
    key_dies_with_connection(
        "rdma_key_stops_working_when_its_connection_closes_region",
        ClientKeys::MemoryRegion,
    );
}

fn key_is_bound_to_its_qp(test: &str, keys: ClientKeys) {
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let _a = keyed_server(&coord.url(), keys, NODE_BYTES);
    let (ma, mb) = (
        rdma_manager(&coord.url(), PollMode::Busy),
        rdma_manager(&coord.url(), PollMode::Busy),
    );
    let (ga, gb) = (PAGE_SIZE as u64, 7 * PAGE_SIZE as u64);
    ma.write_page(ga, &page_for(ga, 41)).unwrap();
    mb.write_page(gb, &page_for(gb, 42)).unwrap();
    assert!(read(&ma, ga) == page_for(ga, 41));
    assert!(read(&mb, gb) == page_for(gb, 42));
    let key_a = ma.rdma_rkey_for_test("a").unwrap();
    let qpn_a = ma.rdma_qpn_for_test("a").unwrap();

    // B's connection with A's key: a write is refused and B's page stays.
    assert!(mb.set_rdma_rkey_for_test("a", key_a));
    expect_remote_access(test, mb.write_page(gb, &page_for(gb, 43)));
    assert!(
        read(&ma, gb) == page_for(gb, 42),
        "{test}: B's page changed"
    );
    // A read with it is refused too, and reads nothing.
    assert!(read(&mb, gb) == page_for(gb, 42));
    assert!(mb.set_rdma_rkey_for_test("a", key_a));
    let mut page = [0u8; PAGE_SIZE];
    expect_remote_access(test, mb.read_page(ga, &mut page));
    assert!(
        page != page_for(ga, 41),
        "{test}: B read A's page with A's key"
    );

    // A was never disturbed: same QP, same key, same pages.
    assert_eq!(ma.rdma_qpn_for_test("a"), Some(qpn_a));
    assert!(read(&ma, ga) == page_for(ga, 41));
    assert!(read(&ma, gb) == page_for(gb, 42));
    assert_eq!(ma.rdma_rkey_for_test("a"), Some(key_a));
    // B, on a new connection with its own key, is served again.
    assert!(read(&mb, ga) == page_for(ga, 41));
    assert_ne!(mb.rdma_rkey_for_test("a"), Some(key_a));
    assert_all_rdma(&ma);
    assert_all_rdma(&mb);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_one_clients_key_does_not_work_on_another_clients_qp_window() {
    key_is_bound_to_its_qp(
        "rdma_one_clients_key_does_not_work_on_another_clients_qp_window",
        ClientKeys::Auto,
    );
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_one_clients_key_does_not_work_on_another_clients_qp_region() {
    key_is_bound_to_its_qp(
        "rdma_one_clients_key_does_not_work_on_another_clients_qp_region",
        ClientKeys::MemoryRegion,
    );
}

/// What a connection's key costs the server, per kind and region size
/// (printed for docs/rdma.md): a window's allocation and bind, or a
/// registration of the whole region.
#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_client_key_setup_cost() {
    let test = "rdma_client_key_setup_cost";
    require_device(test);
    const CONNECTIONS: usize = 3;
    for memory_bytes in [1usize << 20, 16 << 20, 256 << 20] {
        for keys in [ClientKeys::MemoryWindow, ClientKeys::MemoryRegion] {
            let db = tempfile::tempdir().unwrap();
            let coord = coordinator(&db);
            let a = keyed_server(&coord.url(), keys, memory_bytes);
            let gpa = (memory_bytes - PAGE_SIZE) as u64;
            let mut setup_us = Vec::new();
            for i in 0..CONNECTIONS {
                let started = Instant::now();
                let mgr = rdma_manager(&coord.url(), PollMode::Busy);
                let seed = u8::try_from(i).unwrap() + 50;
                mgr.write_page(gpa, &page_for(gpa, seed)).unwrap();
                assert!(read(&mgr, gpa) == page_for(gpa, seed));
                let connect_ms = started.elapsed().as_secs_f64() * 1e3;
                let live = a.rdma_client_keys_for_test();
                assert_eq!(live.len(), 1, "{live:?}");
                assert_eq!(live[0].kind, expected_kind(keys));
                setup_us.push((live[0].setup_us, connect_ms));
                drop(mgr);
                assert!(wait_until(Duration::from_secs(10), || a
                    .rdma_client_keys_for_test()
                    .is_empty()));
            }
            let keys_us: Vec<_> = setup_us.iter().map(|s| s.0).collect();
            let connect_ms: Vec<_> = setup_us.iter().map(|s| format!("{:.0}", s.1)).collect();
            say(&format!(
                "{test}: region {} MiB, {:?}: key set-up {keys_us:?} us; first request incl. connect {connect_ms:?} ms",
                memory_bytes >> 20,
                expected_kind(keys)
            ));
        }
    }
}
