//! One process per node id. Two page-server processes of one node would
//! each serve its ranges, one of them with empty memory: a second process
//! started while the first is alive (its lease current, its address
//! accepting connections) does not register until the first is gone; a
//! process that was stopped past its lease, and replaced meanwhile, is
//! left by the coherence nodes that see the new process in their map, and
//! learns it from its next heartbeat and serves no more, so that its other
//! nodes drop the copies it granted too (docs/operations.md, "One process
//! per node id").

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::coherent_copies::Node;
use common::*;
use page_server::ServerConfig;
use rdma_transport::coherent::{CoherenceConfig, Recall};
use rdma_transport::wire::{Header, Opcode};

const LIMIT: Duration = Duration::from_secs(30);

/// A second process of node "a" waits, as long as the first lives; its
/// ranges keep being served by the first. Once the first is killed, the
/// second registers.
#[test]
fn a_second_process_of_a_node_registers_only_once_the_first_is_gone() {
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let mut first = ChildServer::start(&url, "a", 0);
    let first_epoch = registered_with_range(&url, "a", 0, 0);
    let mgr = manager(&url);
    let page = page_indexed(0, 1);
    mgr.write_page(0, &page)
        .expect("a write to the first process");

    let mut cfg = ServerConfig::new("a", NODE_BYTES);
    cfg.coordinator_url = Some(url.clone());
    cfg.heartbeat_interval = Duration::from_millis(100);
    cfg.register_retry = Duration::from_millis(50);
    let second = page_server::spawn(cfg).expect("the second process starts");
    assert!(
        wait_until(LIMIT, || second.stats().registrations_put_off >= 3),
        "the second process never found the first alive: {:?}",
        second.stats()
    );
    let admin = coordinator_client(&url);
    assert_eq!(
        admin.node(&"a".to_owned()).expect("node a").epoch,
        first_epoch,
        "the second process registered while the first was alive"
    );
    let mut read = [0u8; rdma_transport::PAGE_SIZE];
    mgr.read_page(0, &mut read)
        .expect("the first process still serves its range");
    assert!(read == page, "not the page written to the first process");

    first.kill();
    second
        .wait_registered(LIMIT)
        .expect("the second process registers once the first is gone");
    assert_ne!(
        admin.node(&"a".to_owned()).expect("node a").epoch,
        first_epoch
    );
}

/// Nodes x and z hold a shared copy of page 0 of home process 1; x's
/// manager follows the map (the default), z's does not (no background
/// refresh). Process 1 is stopped (SIGSTOP) past its lease, and process 2
/// of the node registers in its place: x, seeing another process of the
/// home in its map, leaves process 1 and drops its copy, although process 1
/// is only stopped (its kernel still acknowledges). z learns nothing until
/// process 1 runs again: its first heartbeat tells it, and it closes every
/// connection (z drops its copy) and takes no new one. Either way no copy
/// granted by process 1 outlives process 2's restart grace.
#[test]
fn a_process_stopped_past_its_lease_and_replaced_is_left_and_serves_no_more() {
    const FLAGS: &[&str] = &["--node-dead-home-timeout-ms", "1000"];
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let metrics = metrics_port();
    let metrics_flag = metrics.to_string();
    let first_flags = [FLAGS, &["--metrics-listen", &metrics_flag]].concat();
    let first = ChildServer::start_with(&url, "home", 0, &first_flags);
    let first_epoch = registered_with_range(&url, "home", 0, 0);
    let config = CoherenceConfig {
        dead_home_timeout_ms: 1000,
        timeout_ms: 5_000,
        min_hold_us: 0,
    };
    let x = Node::with_config(manager(&url), config);
    let z = Node::with_config(manager_without_refresh(&url), config);
    for (name, node) in [("x", &x), ("z", &z)] {
        assert!(
            node.read(0).expect("read page 0") == [0u8; rdma_transport::PAGE_SIZE],
            "{name} does not read the zeros of a new range"
        );
    }
    let left_home = |node: &Node| {
        node.copies
            .take_recalls()
            .contains(&(0, Recall::Invalidate { write_back: false }))
    };

    first.pause();
    // Its address still accepts (the kernel does), so the second process
    // waits for the first one's lease to lapse, then registers.
    let _second = ChildServer::start_with(&url, "home", 0, FLAGS);
    registered_with_range(&url, "home", 0, first_epoch);
    assert!(
        wait_until(LIMIT, || x.copies.copy(0).is_none()),
        "x still holds the copy that process 1 (stopped) granted, after process 2 took the node"
    );
    assert!(
        left_home(&x),
        "x's copy was not dropped by leaving process 1"
    );
    assert!(
        z.copies.copy(0).is_some(),
        "z dropped its copy while process 1 was stopped: it has no way of knowing"
    );

    first.resume();
    assert!(
        wait_until(LIMIT, || z.copies.copy(0).is_none()),
        "z still holds the copy process 1 granted, after process 1 learnt that process 2 took \
         the node"
    );
    assert!(
        left_home(&z),
        "z's copy was not dropped by the end of its connection"
    );
    let (_, text) = http_get(metrics, "/metrics");
    assert!(
        text.lines().any(|l| l == "page_server_superseded 1"),
        "process 1 does not say it was superseded:\n{text}"
    );
    let (status, body) = http_get(metrics, "/ready");
    assert!(
        status == 503 && body.contains("superseded"),
        "process 1's GET /ready: {status} {body}"
    );
    // A HELLO, which a serving page-server answers with its CHALLENGE.
    // The first connection that comes after the fence is closed and ends
    // the accept loop: the port may refuse already.
    match TcpStream::connect(&first.addr) {
        Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused => {}
        Err(err) => panic!("connect to process 1: {err}"),
        Ok(mut s) => {
            s.set_read_timeout(Some(LIMIT)).unwrap();
            let payload = raw::hello_payload(1);
            let mut hello = Header::request(Opcode::Hello, 1, 0, payload.len() as u32)
                .encode()
                .to_vec();
            hello.extend_from_slice(&payload);
            // Closed at once: the write may fail already.
            let _ = s.write_all(&hello);
            let answered = matches!(s.read(&mut [0u8; 1]), Ok(n) if n > 0);
            assert!(
                !answered,
                "process 1 answered a HELLO after process 2 took the node"
            );
        }
    }
}

/// A free loopback port for a child's `--metrics-listen`.
fn metrics_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

/// A manager that reads the map once and never again (no background
/// refresh): a client that did not hear of the new process.
fn manager_without_refresh(url: &str) -> rdma_transport::TransportManager {
    rdma_transport::TransportManager::connect(rdma_transport::ManagerConfig {
        coordinator_url: url.to_owned(),
        map_refresh_ms: 0,
        poller_cpus: Some(vec![]),
        ..rdma_transport::ManagerConfig::default()
    })
    .expect("a manager without background refresh")
}

/// Process 1 of node "a", whose link to the coordinator goes through a
/// relay the test can hold, holding page 0 = `old`; and a client z without
/// map refresh that read it there (and keeps that map).
struct FirstBehindRelay {
    relay: common::stalling_link::StallingLink,
    process: ChildServer,
    epoch: u64,
    metrics: std::net::SocketAddr,
    z: rdma_transport::TransportManager,
    old: rdma_transport::Page,
}

impl FirstBehindRelay {
    fn start(coord: &coordinator::RunningCoordinator, flags: &[&str], seed: u64) -> Self {
        let url = coord.url();
        let relay = common::stalling_link::StallingLink::start();
        relay.set_target(&coord.addr().to_string());
        let metrics = metrics_port();
        let metrics_flag = metrics.to_string();
        let flags = [&["--metrics-listen", metrics_flag.as_str()], flags].concat();
        let process = ChildServer::start_with(&format!("http://{}", relay.addr()), "a", 0, &flags);
        let epoch = registered_with_range(&url, "a", 0, 0);
        let old = page_indexed(0, seed);
        manager(&url)
            .write_page(0, &old)
            .expect("a write to process 1");
        let z = manager_without_refresh(&url);
        let mut read = [0u8; rdma_transport::PAGE_SIZE];
        z.read_page(0, &mut read).expect("z reads process 1");
        assert!(read == old, "z does not read what was written");
        Self {
            relay,
            process,
            epoch,
            metrics,
            z,
            old,
        }
    }

    /// Process 2 of node "a" registers (once process 1's lease lapsed),
    /// the range is re-initialised and page 0 written anew through it;
    /// returns process 2 and that page.
    fn replace(&self, url: &str, seed: u64) -> (ChildServer, rdma_transport::Page) {
        let second = ChildServer::start(url, "a", 0);
        registered_with_range(url, "a", 0, self.epoch);
        coordinator_client(url)
            .reinitialise_range(0)
            .expect("re-initialise the range");
        let new = page_indexed(0, seed);
        manager(url)
            .write_page(0, &new)
            .expect("a write to process 2");
        (second, new)
    }

    /// The relay passes again: process 1's next heartbeat tells it that
    /// process 2 took the node.
    fn learns_it_was_replaced(&self) {
        self.relay.release();
        assert!(
            wait_until(LIMIT, || metric(self.metrics, "page_server_superseded")
                == Some(1)),
            "process 1 never learnt that process 2 took the node"
        );
    }

    /// What z reads of page 0 now: it must not be `old` once process 2
    /// took the node.
    fn z_reads(&self) -> Result<rdma_transport::Page, rdma_transport::TransportError> {
        let mut read = [0u8; rdma_transport::PAGE_SIZE];
        self.z.read_page(0, &mut read).map(|()| read)
    }
}

/// Process 1 of node "a" holds page 0 = A; a client z reads it and keeps
/// its map. Process 1 is stopped past its lease, process 2 registers, the
/// range is re-initialised and page 0 written B through process 2. Then
/// process 1 resumes while its heartbeats cannot reach the coordinator (a
/// relay between them holds everything): it cannot learn that it was
/// replaced, and z's map still sends z to it. z must not get A (a page
/// the node no longer holds, served as valid): process 1, having noticed
/// its stall, serves nothing until the coordinator answers. Once the relay
/// passes again, process 1 learns of process 2 and serves no more.
#[test]
fn a_process_resumed_after_being_replaced_serves_nothing_before_the_coordinator_answers() {
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let first = FirstBehindRelay::start(&coord, &[], 1);
    let metrics = first.metrics;

    first.process.pause();
    let (_second, new) = first.replace(&url, 2);

    first.relay.hold();
    first.process.resume();
    let got = first.z_reads();
    assert!(
        got.as_ref().map_or(true, |page| *page == new),
        "z read the page process 1 held before process 2 replaced it (process 1 resumed and \
         served it without a word from the coordinator): {}",
        got.as_ref().is_ok_and(|page| *page == first.old)
    );
    assert!(
        wait_until(LIMIT, || metric(metrics, "page_server_stalls_total")
            .is_some_and(|n| n >= 1)),
        "process 1 did not count its stall"
    );
    assert!(
        metric(metrics, "page_server_requests_held_by_fence_total").is_some_and(|n| n >= 1),
        "z's request did not wait for the coordinator"
    );

    first.learns_it_was_replaced();
}

/// A process stopped past its lease that nobody replaced serves again once
/// the coordinator answers its first heartbeat after the stall: the fence
/// waits for the coordinator's word, not forever.
#[test]
fn a_process_stopped_past_its_lease_and_not_replaced_serves_again() {
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let metrics = metrics_port();
    let first = ChildServer::start_with(&url, "a", 0, &["--metrics-listen", &metrics.to_string()]);
    let epoch = registered_with_range(&url, "a", 0, 0);
    let page = page_indexed(0, 3);
    let mgr = manager(&url);
    mgr.write_page(0, &page).expect("a write");

    first.pause();
    let admin = coordinator_client(&url);
    let id = "a".to_owned();
    assert!(
        wait_until(LIMIT, || admin.node(&id).is_ok_and(|n| !n.alive)),
        "the stopped process's lease never lapsed"
    );
    first.resume();
    let mut read = [0u8; rdma_transport::PAGE_SIZE];
    mgr.read_page(0, &mut read)
        .expect("the resumed process serves once the coordinator answered");
    assert!(read == page, "not the page written before the stop");
    assert!(
        wait_until(LIMIT, || metric(metrics, "page_server_stalls_total")
            .is_some_and(|n| n >= 1)),
        "the stall was not noticed"
    );
    let node = admin.node(&id).expect("node a");
    assert!(
        node.alive && node.epoch == epoch,
        "the resumed process is not the node's, alive: {node:?}"
    );
    assert_eq!(metric(metrics, "page_server_superseded"), Some(0));
}

/// A replaced process's heartbeats renew nothing: process 1 of node "a" is
/// stopped past its lease, process 2 registers and is then killed (-9);
/// once the coordinator says the node is down, process 1 resumes and
/// heartbeats. The node must stay down (its only process of record is
/// dead): without the epoch in the heartbeat, process 1's renewed the
/// lease that was process 2's, and the coordinator called the node alive
/// for one more lease.
#[test]
fn a_replaced_process_does_not_keep_its_dead_successor_alive() {
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let metrics = metrics_port();
    let first = ChildServer::start_with(&url, "a", 0, &["--metrics-listen", &metrics.to_string()]);
    let first_epoch = registered_with_range(&url, "a", 0, 0);

    first.pause();
    let mut second = ChildServer::start(&url, "a", 0);
    let second_epoch = registered_with_range(&url, "a", 0, first_epoch);
    second.kill();
    let admin = coordinator_client(&url);
    let id = "a".to_owned();
    assert!(
        wait_until(LIMIT, || admin.node(&id).is_ok_and(|n| !n.alive)),
        "process 2's lease never lapsed after it was killed"
    );
    let coordinator_metric = |name: &str| metric(coord.addr(), name);
    let renewals_before = coordinator_metric("coordinator_lease_renewals_total");

    first.resume();
    assert!(
        wait_until(LIMIT, || metric(metrics, "page_server_superseded")
            == Some(1)),
        "process 1 never learnt that process 2 took the node"
    );
    let node = admin.node(&id).expect("node a");
    assert!(
        !node.alive && node.epoch == second_epoch,
        "process 1's heartbeat renewed the lease of process 2, which is dead: {node:?}"
    );
    assert_eq!(
        coordinator_metric("coordinator_lease_renewals_total"),
        renewals_before,
        "a lease was renewed after process 2 died"
    );
    assert_eq!(
        coordinator_metric("coordinator_superseded_heartbeats_total"),
        Some(1),
        "process 1's heartbeat was not refused once (it stops after the first refusal)"
    );
}

/// With `--lease-fence-ms` below the coordinator's lease, a process cut off
/// from the coordinator (not from its clients) stops serving before another
/// process of its node can register: process 1 of node "a" holds page 0 =
/// A, a client z reads it and keeps its map; a relay between process 1 and
/// the coordinator then holds everything, process 2 registers once process
/// 1's lease lapsed, the range is re-initialised and page 0 written B
/// through process 2. z must not get A from process 1. Without the lease
/// fence (the default) it does: the data path outlives the coordinator.
#[test]
fn a_process_cut_off_from_the_coordinator_serves_nothing_past_its_lease_fence() {
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let first = FirstBehindRelay::start(&coord, &["--lease-fence-ms", "1500"], 4);
    let metrics = first.metrics;

    first.relay.hold();
    // Process 1 still accepts: process 2 waits for its lease to lapse.
    let (_second, new) = first.replace(&url, 5);

    let got = first.z_reads();
    assert!(
        got.as_ref().map_or(true, |page| *page == new),
        "z read the page process 1 held before process 2 replaced it (process 1, cut off from \
         the coordinator past its lease fence, still served): {}",
        got.as_ref().is_ok_and(|page| *page == first.old)
    );
    assert_eq!(metric(metrics, "page_server_fenced"), Some(1));
    assert!(
        metric(metrics, "page_server_lease_lapses_total").is_some_and(|n| n >= 1),
        "process 1 did not count its lease lapse"
    );
    let (status, body) = http_get(metrics, "/ready");
    assert!(
        status == 503 && body.contains("fenced"),
        "process 1's GET /ready: {status} {body}"
    );

    first.learns_it_was_replaced();
}

/// The lease fence's price: with the coordinator down longer than the
/// fence, a page-server serves nothing, and serves again once the
/// coordinator answers (nobody replaced it).
#[test]
fn a_lease_fenced_process_serves_again_once_the_coordinator_answers() {
    let (db, coord) = loopback_coordinator();
    let url = coord.url();
    let coord_addr = coord.addr();
    let metrics = metrics_port();
    let _server = ChildServer::start_with(
        &url,
        "a",
        0,
        &[
            "--metrics-listen",
            &metrics.to_string(),
            "--lease-fence-ms",
            "1000",
        ],
    );
    let epoch = registered_with_range(&url, "a", 0, 0);
    let page = page_indexed(0, 6);
    let mgr = manager(&url);
    mgr.write_page(0, &page).expect("a write");

    coord.shutdown().expect("the coordinator stops");
    assert!(
        wait_until(LIMIT, || metric(metrics, "page_server_fenced") == Some(1)),
        "the page-server never fenced itself with the coordinator down"
    );
    let mut read = [0u8; rdma_transport::PAGE_SIZE];
    assert!(
        mgr.read_page(0, &mut read).is_err(),
        "a read served while fenced"
    );

    let _coord = coordinator_on(&db.path().join("c.db"), coord_addr);
    assert!(
        wait_until(LIMIT, || metric(metrics, "page_server_fenced") == Some(0)),
        "the page-server never served again once the coordinator was back"
    );
    mgr.read_page(0, &mut read)
        .expect("served again once the coordinator answered");
    assert!(read == page, "not the page written before");
    assert_eq!(node_epoch(&url, "a"), epoch, "not the same process");
}

/// A lease fence shorter than two heartbeat periods would stop the server
/// at its first late heartbeat, a stall fence of a few milliseconds at
/// every scheduling delay: refused at start.
#[test]
fn fences_that_would_stop_a_healthy_server_are_refused() {
    let mut short_lease = ServerConfig::new("a", NODE_BYTES);
    short_lease.heartbeat_interval = Duration::from_millis(1000);
    short_lease.lease_fence = Duration::from_millis(1500);
    let mut short_stall = ServerConfig::new("a", NODE_BYTES);
    short_stall.stall_fence = Duration::from_millis(5);
    for (cfg, what) in [(short_lease, "lease fence"), (short_stall, "stall fence")] {
        match page_server::spawn(cfg) {
            Err(page_server::ServerError::Config(why)) => {
                assert!(why.contains(what), "{why}");
            }
            Err(other) => panic!("expected a configuration error, got {other}"),
            Ok(_) => panic!("a page-server started with a too short {what}"),
        }
    }
}
