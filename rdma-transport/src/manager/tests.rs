//! The manager's promises, each against a scripted peer: only newer maps
//! are installed, nodes that leave are disconnected, a request returns by its
//! deadline whatever the network or the coordinator does, and a caller that
//! unwinds mid-request leaves nothing pointing at its stack or buffers.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::TransportManager;
use crate::config::{ManagerConfig, PollMode, TransportKind};
use crate::coordinator::api::MapResponse;
use crate::error::TransportError;
use crate::page::PAGE_SIZE;
use crate::testing::{
    answer_read, answer_read_at, fake_coordinator, fake_node, map_of, read_header, NODE_STRIDE,
};

fn config(request_timeout_ms: u64, poll_mode: PollMode) -> ManagerConfig {
    ManagerConfig {
        transport: TransportKind::Tcp,
        pool_size_bytes: 1 << 20,
        poller_cpus: Some(vec![]),
        poll_mode,
        request_timeout_ms,
        connect_timeout_ms: 10_000,
        map_refresh_ms: 0,
        ..ManagerConfig::default()
    }
}

/// The server side sees the client close (EOF or reset), not its own timeout.
fn sees_close(mut stream: TcpStream) -> bool {
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn an_older_map_never_replaces_a_newer_one() {
    let (addr_a, _a) = fake_node(sees_close);
    let mgr =
        TransportManager::from_map(config(2000, PollMode::Event), map_of(5, &[("a", addr_a)]))
            .expect("manager");
    assert!(!mgr.update_map(map_of(3, &[])), "version 3 after 5");
    assert!(!mgr.update_map(map_of(5, &[])), "the same version again");
    assert_eq!(mgr.map().version(), 5);
    assert_eq!(mgr.map().len(), 1, "the newer map's range is still there");
    assert!(mgr.update_map(map_of(6, &[])));
    assert_eq!(mgr.map().version(), 6);
    assert!(mgr.map().is_empty());
}

/// A coordinator that lost its state counts versions from 0 again, under
/// another generation: its maps replace the one in use whatever their
/// version, and then the usual order holds within the new generation.
#[test]
fn a_map_of_another_generation_replaces_the_one_in_use_whatever_its_version() {
    let (addr_a, _a) = fake_node(sees_close);
    let of = |generation, version, nodes: &[(&str, SocketAddr)]| MapResponse {
        generation,
        ..map_of(version, nodes)
    };
    let mgr =
        TransportManager::from_map(config(2000, PollMode::Event), of(7, 500, &[("a", addr_a)]))
            .expect("manager");
    assert!(
        mgr.update_map(of(9, 3, &[])),
        "a new generation at version 3"
    );
    assert_eq!((mgr.map().generation(), mgr.map().version()), (9, 3));
    assert!(mgr.map().is_empty());
    assert!(
        !mgr.update_map(of(9, 2, &[("a", addr_a)])),
        "older, same generation"
    );
    assert!(mgr.update_map(of(9, 4, &[("a", addr_a)])));
    assert_eq!(mgr.map().len(), 1);
    // A map that names no generation (made by hand, an older coordinator)
    // is compared by version only.
    assert!(!mgr.update_map(of(0, 4, &[])), "generation 0, same version");
    assert!(mgr.update_map(of(0, 5, &[])));
    assert!(!mgr.update_map(of(9, 5, &[])), "back to 9, same version");
}

#[test]
fn racing_installs_end_with_the_newest_map() {
    let mgr =
        TransportManager::from_map(config(2000, PollMode::Event), map_of(1, &[])).expect("manager");
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let mgr = &mgr;
            s.spawn(move || {
                for v in 0..200u64 {
                    // Each thread installs every version, in its own order.
                    let version = 2 + (v * 7 + t * 13) % 200;
                    mgr.update_map(map_of(version, &[]));
                }
            });
        }
    });
    assert_eq!(mgr.map().version(), 201);
}

#[test]
fn a_node_that_leaves_the_map_or_moves_is_disconnected() {
    let (addr_a, a) = fake_node(sees_close);
    let (addr_b, b) = fake_node(sees_close);
    let (addr_b2, _b2) = fake_node(sees_close);
    let mgr = TransportManager::from_map(
        config(2000, PollMode::Event),
        map_of(1, &[("a", addr_a), ("b", addr_b)]),
    )
    .expect("manager");
    // Node b moves to a new address, node a stays.
    assert!(mgr.update_map(map_of(2, &[("a", addr_a), ("b", addr_b2)])));
    assert!(
        b.join().expect("node b"),
        "b's old address saw the client close"
    );
    // Node a leaves.
    assert!(mgr.update_map(map_of(3, &[("b", addr_b2)])));
    assert!(a.join().expect("node a"), "a saw the client close");
}

/// A listener that completes TCP handshakes (the kernel does) but never
/// accepts: a HELLO sent there is never answered.
fn blackhole() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    (listener, addr)
}

#[test]
fn requests_to_a_blackholed_node_return_by_their_deadline() {
    let (_hole, hole_addr) = blackhole();
    for mode in [PollMode::Event, PollMode::Busy] {
        let mgr = TransportManager::from_map(config(300, mode), map_of(1, &[])).expect("manager");
        assert!(mgr.update_map(map_of(2, &[("hole", hole_addr)])));
        let started = Instant::now();
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let mgr = &mgr;
                    s.spawn(move || {
                        let mut page = [0u8; PAGE_SIZE];
                        let t = Instant::now();
                        (mgr.read_page(0, &mut page), t.elapsed())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("caller"))
                .collect()
        });
        for (result, took) in &results {
            assert!(
                matches!(
                    result,
                    Err(TransportError::Timeout { .. } | TransportError::NodeDown { .. })
                ),
                "{result:?}"
            );
            // The connect timeout is 10 s; each caller's deadline is 300 ms.
            assert!(
                *took < Duration::from_secs(3),
                "{mode:?}: a caller took {took:?}"
            );
        }
        assert!(started.elapsed() < Duration::from_secs(4));
    }
}

#[test]
fn a_silent_coordinator_does_not_hold_a_request_past_its_deadline() {
    // The first map answer builds the manager; every later request hangs.
    let url = fake_coordinator(vec![map_of(1, &[])]);
    let mgr = TransportManager::connect(ManagerConfig {
        coordinator_url: url,
        ..config(300, PollMode::Event)
    })
    .expect("manager");
    let mut page = [0u8; PAGE_SIZE];
    let t = Instant::now();
    let result = mgr.read_page(NODE_STRIDE, &mut page);
    let took = t.elapsed();
    assert!(
        matches!(result, Err(TransportError::UnknownGpa { .. })),
        "{result:?}"
    );
    // The coordinator client's own timeout is 2 s.
    assert!(took < Duration::from_millis(1500), "took {took:?}");
}

#[test]
fn a_caller_that_unwinds_mid_request_leaves_its_page_alone() {
    let (got_first, first_seen) = mpsc::channel();
    let (go, release) = mpsc::channel::<()>();
    let (addr, node) = fake_node(move |mut stream| {
        let first = read_header(&mut stream);
        got_first.send(()).expect("test alive");
        release.recv().expect("test alive");
        // The answer to the abandoned request comes late, then the next.
        answer_read(&mut stream, &first, 0xab);
        let second = read_header(&mut stream);
        answer_read(&mut stream, &second, 0xcd);
        sees_close(stream)
    });
    {
        let mgr =
            TransportManager::from_map(config(5000, PollMode::Event), map_of(1, &[("a", addr)]))
                .expect("manager");
        let mut abandoned = Box::new([0u8; PAGE_SIZE]);
        super::unwind_hook::arm();
        let unwound = catch_unwind(AssertUnwindSafe(|| mgr.read_page(0, &mut abandoned)));
        assert!(unwound.is_err(), "the injected panic unwound the call");
        first_seen.recv().expect("node got the first request");
        go.send(()).expect("node alive");
        let mut page = [0u8; PAGE_SIZE];
        mgr.read_page(PAGE_SIZE as u64, &mut page)
            .expect("the next request on the same connection");
        assert!(page.iter().all(|&b| b == 0xcd));
        // The late answer was read before the second one (same stream): had
        // its slot stayed armed, it would have landed here.
        assert!(
            abandoned.iter().all(|&b| b == 0),
            "a late answer was written into a page the caller gave up"
        );
        drop(mgr);
    }
    assert!(node.join().expect("node"));
}

#[test]
fn a_batch_that_unwinds_leaves_its_pages_alone_and_the_next_batch_clean() {
    // A thread keeps its settled round for its next batch (`run_targets`);
    // one that unwinds must be dropped, cancelling its requests, not kept.
    let (got_first, first_seen) = mpsc::channel();
    let (go, release) = mpsc::channel::<()>();
    let (addr, node) = fake_node(move |mut stream| {
        let first = [read_header(&mut stream), read_header(&mut stream)];
        got_first.send(()).expect("test alive");
        release.recv().expect("test alive");
        // The abandoned batch's answers come late, then the next batch's.
        for h in &first {
            answer_read(&mut stream, h, 0xab);
        }
        let second = [read_header(&mut stream), read_header(&mut stream)];
        for h in &second {
            answer_read(&mut stream, h, 0xcd);
        }
        sees_close(stream)
    });
    {
        let mgr =
            TransportManager::from_map(config(5000, PollMode::Event), map_of(1, &[("a", addr)]))
                .expect("manager");
        let gpas = [0, PAGE_SIZE as u64];
        let mut abandoned = vec![[0u8; PAGE_SIZE]; 2];
        super::unwind_hook::arm();
        let unwound = catch_unwind(AssertUnwindSafe(|| mgr.read_pages(&gpas, &mut abandoned)));
        assert!(unwound.is_err(), "the injected panic unwound the batch");
        first_seen.recv().expect("node got the first batch");
        go.send(()).expect("node alive");
        let mut pages = vec![[0u8; PAGE_SIZE]; 2];
        mgr.read_pages(&gpas, &mut pages)
            .expect("the next batch on the same thread and connection");
        assert!(pages.iter().flatten().all(|&b| b == 0xcd));
        assert!(
            abandoned.iter().flatten().all(|&b| b == 0),
            "a late answer was written into a page the caller gave up"
        );
        drop(mgr);
    }
    assert!(node.join().expect("node"));
}

#[test]
fn a_submit_on_a_connection_that_broke_first_fails_at_once() {
    use crate::tcp::{Request, TcpConnection, Waiter, CODE_CONN_LOST};
    use crate::wire::Opcode;
    let (addr, node) = fake_node(sees_close);
    let auth = crate::tcp::ClientAuth {
        client_id: 1,
        node_id: "a",
        key: None,
        checksums: false,
        coherence: false,
        node_bound_ms: None,
        landed_pages: None,
    };
    let conn =
        TcpConnection::connect(&addr.to_string(), &auth, Duration::from_secs(5)).expect("connect");
    conn.mark_broken(CODE_CONN_LOST);
    let mut page = [0u8; PAGE_SIZE];
    let waiter = Waiter::new();
    let mut ids = [0u64; 1];
    let reqs = [Request {
        offset: 0,
        page: page.as_mut_ptr(),
        direct: false,
    }];
    let far = Instant::now() + Duration::from_secs(30);
    let result = conn.submit(Opcode::Read, &reqs, &mut ids, &waiter, far);
    let armed = match result {
        Err((armed, _)) => armed,
        Ok(()) => panic!("a submit on a broken connection succeeded"),
    };
    assert_eq!(armed, 1);
    // Nothing will ever answer: the slot must already be failed, so an
    // event-mode caller (no spinning, nobody polling) is not parked until
    // its deadline.
    assert!(waiter.is_done(), "the armed slot was left pending");
    assert_eq!(conn.inflight.finish(ids[0]), CODE_CONN_LOST);
    drop(conn);
    assert!(node.join().expect("node"));
}

#[test]
fn an_answer_that_is_not_for_its_request_delivers_no_page() {
    let (addr, node) = fake_node(|mut stream| {
        let request = read_header(&mut stream);
        // The right request id, the wrong page.
        answer_read_at(
            &mut stream,
            &request,
            request.offset + PAGE_SIZE as u64,
            0xee,
        );
        sees_close(stream)
    });
    let mgr = TransportManager::from_map(config(5000, PollMode::Event), map_of(1, &[("a", addr)]))
        .expect("manager");
    let mut page = [0u8; PAGE_SIZE];
    let result = mgr.read_page(0, &mut page);
    assert!(
        matches!(result, Err(TransportError::Protocol { .. })),
        "{result:?}"
    );
    assert!(
        page.iter().all(|&b| b == 0),
        "a mismatched answer was delivered"
    );
    drop(mgr);
    assert!(node.join().expect("node"), "the connection was dropped");
}
