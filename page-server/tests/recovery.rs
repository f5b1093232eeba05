//! Replica recovery end to end (issue 9), real processes: a page-server
//! that joins a replicated range (its replica starts `stale`) copies the
//! range from the live replica by itself and turns `live`; a client write
//! that reaches it during the copy is never overwritten by the copy; a
//! write that a stalled link delivers after the recovery began, older than
//! what the live replica holds, is not kept; nor one that the client's own
//! TCP retransmits after a real partition (ignored: needs root; run by
//! deploy/test-all.sh).

mod common;
// The coordinator's partition tests' namespaces, shared rather than copied.
#[allow(dead_code)]
#[path = "../../coordinator/tests/common/netns.rs"]
mod netns;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::stalling_link::StallingLink;
use common::*;
use page_server::{ExportedRange, ServerConfig};
use rdma_transport::coordinator::api::{MapEntry, MapResponse, Replica, ReplicaState};
use rdma_transport::coordinator::CoordinatorClient;
use rdma_transport::wire::{Header, Opcode, Status, HEADER_LEN};
use rdma_transport::{Page, TransportManager, PAGE_SIZE};

const PAGES: u64 = (NODE_BYTES / PAGE_SIZE) as u64;
/// Long enough for several polls of the coordinator.
const RECOVERY_LIMIT: Duration = Duration::from_secs(30);

fn gpa(index: u64) -> u64 {
    index * PAGE_SIZE as u64
}

/// The only entry of the map (both nodes claim the same range), and the map.
fn only_entry(admin: &CoordinatorClient) -> Option<(MapEntry, MapResponse)> {
    let map = admin.map().ok()?;
    let entry = map.entries.first()?.clone();
    (map.entries.len() == 1).then_some((entry, map))
}

/// `node`'s replica of the range, if the coordinator has it.
fn replica(admin: &CoordinatorClient, node: &str) -> Option<Replica> {
    let (entry, _) = only_entry(admin)?;
    entry.replicas.into_iter().find(|r| r.node_id == node)
}

/// Polls until `node`'s replica is in `state`.
fn wait_for_state(admin: &CoordinatorClient, node: &str, state: ReplicaState) {
    assert!(
        wait_until(RECOVERY_LIMIT, || replica(admin, node)
            .is_some_and(|r| r.state == state)),
        "replica of {node} never became {state:?} (now {:?})",
        replica(admin, node)
    );
}

/// A manager on `node`'s replica alone (see `common::replica_manager`).
fn manager_on(admin: &CoordinatorClient, node: &str) -> TransportManager {
    replica_manager(&admin.map().expect("map"), node)
}

/// Coordinator and page-server `a` holding the range at GPA 0, with every
/// page written (seed 1) through a manager.
fn cluster_with_written_range() -> (
    coordinator::RunningCoordinator,
    ChildServer,
    tempfile::TempDir,
) {
    let (db, coord) = loopback_coordinator();
    let a = ChildServer::start(&coord.url(), "a", 0);
    write_the_range(&coord.url());
    (coord, a, db)
}

/// Writes every page of the range at GPA 0 (seed 1) through a manager.
fn write_the_range(url: &str) {
    let mgr = manager(url);
    assert!(wait_until(Duration::from_secs(10), || mgr
        .refresh_map()
        .is_ok()
        && mgr.map().len() == 1));
    let gpas: Vec<u64> = (0..PAGES).map(gpa).collect();
    let pages: Vec<Page> = (0..PAGES).map(|i| page_indexed(i, 1)).collect();
    mgr.write_pages(&gpas, &pages).unwrap();
}

/// Reads every page from `node` alone and checks it against `expected`.
fn check_every_page(admin: &CoordinatorClient, node: &str, expected: impl Fn(u64) -> Page) {
    let only = manager_on(admin, node);
    let gpas: Vec<u64> = (0..PAGES).map(gpa).collect();
    let mut back = vec![[0u8; PAGE_SIZE]; gpas.len()];
    only.read_pages(&gpas, &mut back).unwrap();
    for (i, page) in back.iter().enumerate() {
        assert!(
            *page == expected(i as u64),
            "page {i} of {node} differs from the expected contents"
        );
    }
}

#[test]
fn a_new_replica_copies_the_range_and_turns_live() {
    let (coord, _a, _db) = cluster_with_written_range();
    let admin = coordinator_client(&coord.url());
    assert_eq!(
        replica(&admin, "a").map(|r| r.state),
        Some(ReplicaState::Live)
    );

    let _b = ChildServer::start_with(&coord.url(), "b", 0, &["--recovery-grace-ms", "300"]);
    wait_for_state(&admin, "b", ReplicaState::Live);
    let b = replica(&admin, "b").unwrap();
    assert_eq!(b.valid_epoch, node_epoch(&coord.url(), "b"));
    assert!(b.recovery_seq >= 1, "b went live through a recovery");

    check_every_page(&admin, "b", |i| page_indexed(i, 1));
}

/// A replica that a client marks stale starts recovering at once: its
/// page-server follows the map with long polls, not one read per heartbeat
/// period. Here the period is 30 s (the coordinator's lease to match); b,
/// marked stale once live, must be live again through a new recovery well
/// within it. Before, the mark waited for b's next read of the map, up to
/// a period later.
#[test]
fn a_replica_marked_stale_recovers_without_waiting_for_a_heartbeat_period() {
    const PERIOD_MS: &str = "30000";
    let (_db, coord) = coordinator_with_long_leases();
    let url = coord.url();
    let admin = coordinator_client(&url);
    let flags = ["--heartbeat-ms", PERIOD_MS, "--recovery-grace-ms", "300"];
    let _a = ChildServer::start_with(&url, "a", 0, &flags);
    write_the_range(&url);
    let _b = ChildServer::start_with(&url, "b", 0, &flags);
    wait_for_state(&admin, "b", ReplicaState::Live);
    let first = replica(&admin, "b").expect("b's replica").recovery_seq;

    admin
        .mark_replica_stale(0, "b", Duration::from_secs(2))
        .expect("b marked stale");
    assert!(
        wait_until(Duration::from_secs(10), || replica(&admin, "b")
            .is_some_and(
                |r| r.state == ReplicaState::Live && r.recovery_seq > first
            )),
        "b did not recover within 10 s of its stale mark (its map read waits for the 30 s \
         period): {:?}",
        replica(&admin, "b")
    );
    check_every_page(&admin, "b", |i| page_indexed(i, 1));
}

/// A coordinator on a loopback port whose leases last 90 s: page-servers
/// with a 30 s heartbeat period stay alive.
fn coordinator_with_long_leases() -> (tempfile::TempDir, coordinator::RunningCoordinator) {
    let db = tempfile::tempdir().unwrap();
    let mut config = coordinator::CoordinatorConfig::new(
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        db.path().join("c.db"),
    );
    config.lease_ms = 90_000;
    let coord = coordinator::spawn(config).expect("coordinator starts");
    (db, coord)
}

/// A page-server stops at once while its recovery thread waits in a long
/// poll of the map (one heartbeat period, 30 s here): the stop does not
/// wait for the coordinator's answer. The coordinator's gauge of waiting
/// long polls shows when the poll is under way.
#[test]
fn a_page_server_stops_without_waiting_for_its_long_poll_of_the_map() {
    const PERIOD: Duration = Duration::from_secs(30);
    let (_db, coord) = coordinator_with_long_leases();
    let waiting = || metric(coord.addr(), "coordinator_map_long_polls_waiting");
    assert_eq!(waiting(), Some(0));
    let mut cfg = ServerConfig::new("a", NODE_BYTES);
    cfg.heartbeat_interval = PERIOD;
    let server = page_server_with(&coord.url(), cfg);
    assert!(
        wait_until(Duration::from_secs(10), || waiting() == Some(1)),
        "the page-server's recovery never started a long poll: {:?} waiting",
        waiting()
    );
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let started = std::time::Instant::now();
    std::thread::spawn(move || {
        server.shutdown();
        let _ = done_tx.send(());
    });
    let stopped = done_rx.recv_timeout(PERIOD / 3);
    assert!(
        stopped.is_ok(),
        "the page-server did not stop within {:?} while its long poll waited",
        PERIOD / 3
    );
    assert!(started.elapsed() < PERIOD / 3);
}

#[test]
fn writes_during_the_recovery_are_not_overwritten_by_the_copy() {
    let (coord, _a, _db) = cluster_with_written_range();
    let admin = coordinator_client(&coord.url());

    // A grace period long enough to write while b is recovering, before
    // its copy starts (the guard keeps them whenever they land).
    let _b = ChildServer::start_with(&coord.url(), "b", 0, &["--recovery-grace-ms", "1500"]);
    wait_for_state(&admin, "b", ReplicaState::Recovering);
    let (to_a, to_b) = (manager_on(&admin, "a"), manager_on(&admin, "b"));
    // Pages 4k+1: new contents written to both replicas, as a client
    // writes to every live and recovering one.
    let both: Vec<u64> = (0..PAGES).filter(|i| i % 4 == 1).collect();
    let new_both: Vec<Page> = both.iter().map(|&i| page_indexed(i, 2)).collect();
    let both_gpas: Vec<u64> = both.iter().map(|&i| gpa(i)).collect();
    to_b.write_pages(&both_gpas, &new_both).unwrap();
    to_a.write_pages(&both_gpas, &new_both).unwrap();
    // Pages 4k+2: new contents written to b only. They stand for a write
    // whose copy on a the recovery read before it landed there: the copy
    // (seed 1, still on a) must not overwrite them.
    let b_only: Vec<u64> = (0..PAGES).filter(|i| i % 4 == 2).collect();
    let new_b_only: Vec<Page> = b_only.iter().map(|&i| page_indexed(i, 3)).collect();
    let b_only_gpas: Vec<u64> = b_only.iter().map(|&i| gpa(i)).collect();
    to_b.write_pages(&b_only_gpas, &new_b_only).unwrap();
    assert_eq!(
        replica(&admin, "b").map(|r| r.state),
        Some(ReplicaState::Recovering),
        "the writes took longer than the grace period; the test proves less"
    );
    drop((to_a, to_b));

    wait_for_state(&admin, "b", ReplicaState::Live);
    check_every_page(&admin, "b", |i| match i % 4 {
        1 => page_indexed(i, 2),
        2 => page_indexed(i, 3),
        _ => page_indexed(i, 1),
    });
}

/// How a test takes the link from the client to b down and up.
struct Link<Down, Up, Held, Settled> {
    down: Down,
    up: Up,
    /// Whether the link now keeps a write the client sent b.
    holds_a_write: Held,
    /// Whether what the link kept has reached b, or been given up.
    settled: Settled,
    /// What the kept write is called in a failure.
    late: &'static str,
}

/// The scenario of both late-write tests. a holds the range (seed 1), b is
/// live too, reached through `link`. A client writes page 5 (seed 2), the
/// link goes down, the client writes seed 3 (b misses it and is marked
/// stale: the link keeps its bytes), then seed 4 (to a only). Once b
/// recovers, the link comes back with seed 3. b must turn live holding
/// seed 4, and after a's death the client must read seed 4.
fn late_write_is_not_kept<Down, Up, Held, Settled>(
    admin: &CoordinatorClient,
    url: &str,
    a: ChildServer,
    link: Link<Down, Up, Held, Settled>,
) where
    Down: FnOnce(),
    Up: FnOnce(),
    Held: Fn() -> bool,
    Settled: Fn() -> bool,
{
    wait_for_state(admin, "b", ReplicaState::Live);
    let page = 5;
    let client = manager(url);
    assert!(wait_until(RECOVERY_LIMIT, || client.refresh_map().is_ok()
        && client.map().replica_count(0) == 2));
    client
        .write_pages(&[gpa(page)], &[page_indexed(page, 2)])
        .unwrap();

    (link.down)();
    client
        .write_pages(&[gpa(page)], &[page_indexed(page, 3)])
        .unwrap();
    assert!((link.holds_a_write)(), "the write to b was not held");
    // (b may have begun recovering already: it reads the map every 200 ms.)
    let state = replica(admin, "b").map(|r| r.state);
    assert!(
        matches!(state, Some(ReplicaState::Stale | ReplicaState::Recovering)),
        "the client did not mark b stale after b missed its write (b is {state:?})"
    );
    // A newer write, to a only (b takes no writes while stale).
    client
        .write_pages(&[gpa(page)], &[page_indexed(page, 4)])
        .unwrap();

    wait_for_state(admin, "b", ReplicaState::Recovering);
    (link.up)();
    assert!(
        wait_until(RECOVERY_LIMIT, &link.settled),
        "the write the link kept neither reached b nor was given up"
    );
    wait_for_state(admin, "b", ReplicaState::Live);

    let mut back = [0u8; PAGE_SIZE];
    manager_on(admin, "b")
        .read_pages(&[gpa(page)], std::slice::from_mut(&mut back))
        .unwrap();
    assert!(
        back == page_indexed(page, 4),
        "b turned live holding {} of page {page}, not the last write (seed 4)",
        if back == page_indexed(page, 3) {
            link.late
        } else {
            "other contents"
        }
    );
    // a is lost; the client's reads fail over to b.
    let mut a = a;
    a.kill();
    client
        .read_pages(&[gpa(page)], std::slice::from_mut(&mut back))
        .unwrap();
    assert!(
        back == page_indexed(page, 4),
        "with a gone, the client read an older page than it wrote"
    );
}

/// The link is a relay that keeps what the client sends while held, and
/// delivers it when released.
#[test]
fn a_write_delivered_late_by_a_stalled_link_does_not_outlive_the_recovery() {
    let (coord, a, _db) = cluster_with_written_range();
    let admin = coordinator_client(&coord.url());
    let link = StallingLink::start();
    let b = ChildServer::start_with(
        &coord.url(),
        "b",
        0,
        &["--advertise", &link.addr(), "--recovery-grace-ms", "1000"],
    );
    link.set_target(&b.addr);
    late_write_is_not_kept(
        &admin,
        &coord.url(),
        a,
        Link {
            down: || link.hold(),
            up: || link.release(),
            holds_a_write: || link.holds_something(),
            // b answered the late write, or had closed the connection.
            settled: || link.server_reacted(),
            late: "the late write (seed 3)",
        },
    );
}

/// Bytes the client's sockets connected to `port` have sent and not had
/// acknowledged, from the thread's namespace's `/proc/.../net/tcp`.
fn unacknowledged_to(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/thread-self/net/tcp").expect("net/tcp");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let remote_port = fields.get(2)?.rsplit_once(':')?.1;
            let tx_queue = fields.get(4)?.split_once(':')?.0;
            (u16::from_str_radix(remote_port, 16).ok()? == port)
                .then(|| u64::from_str_radix(tx_queue, 16).ok())
                .flatten()
        })
        .sum()
}

/// The link is real: in a network namespace of the test's own, routing
/// drops what the client sends b's port, and the client's own TCP keeps and
/// retransmits the write.
#[test]
#[ignore = "needs root (a network namespace); run by deploy/test-all.sh"]
fn a_write_retransmitted_after_a_real_partition_does_not_outlive_the_recovery() {
    let network = netns::PrivateNetwork::enter();
    let (coord, a, _db) = cluster_with_written_range();
    let admin = coordinator_client(&coord.url());
    let b = ChildServer::start_with(&coord.url(), "b", 0, &["--recovery-grace-ms", "1000"]);
    let b_port: u16 = b.addr.rsplit_once(':').unwrap().1.parse().unwrap();
    let partition = std::cell::RefCell::new(None);
    late_write_is_not_kept(
        &admin,
        &coord.url(),
        a,
        Link {
            down: || {
                *partition.borrow_mut() = Some(netns::LoopbackPartition::to_port(&network, b_port));
            },
            up: || drop(partition.borrow_mut().take()),
            holds_a_write: || unacknowledged_to(b_port) > 0,
            // The client's TCP delivered it, or learnt that b closed the
            // connection.
            settled: || unacknowledged_to(b_port) == 0,
            late: "the retransmitted write (seed 3)",
        },
    );
}

/// `node`'s replica of the range at `gpa_start`, if the coordinator has it.
fn replica_at(admin: &CoordinatorClient, gpa_start: u64, node: &str) -> Option<Replica> {
    let map = admin.map().ok()?;
    let entry = map.entries.into_iter().find(|e| e.gpa_start == gpa_start)?;
    entry.replicas.into_iter().find(|r| r.node_id == node)
}

/// WRITE of `page` at `offset` on a raw connection, then READ back and
/// compared; `Err` when the server closed the connection (or answered
/// anything else).
fn raw_round_trip(s: &mut TcpStream, id: u64, offset: u64, page: &Page) -> Result<(), String> {
    let mut msg = Header::request(Opcode::Write, id, offset, PAGE_SIZE as u32)
        .encode()
        .to_vec();
    msg.extend_from_slice(page);
    let read = Header::request(Opcode::Read, id + 1, offset, PAGE_SIZE as u32).encode();
    s.write_all(&msg)
        .and_then(|()| s.write_all(&read))
        .map_err(|e| format!("sending: {e}"))?;
    let mut answer = |expected: Opcode, payload: usize| -> Result<Vec<u8>, String> {
        let mut head = [0u8; HEADER_LEN];
        s.read_exact(&mut head)
            .map_err(|e| format!("no answer: {e}"))?;
        let h = Header::decode(&head).map_err(|e| format!("bad header: {e:?}"))?;
        if (h.opcode, h.status) != (expected, Status::Ok) {
            return Err(format!("answered {:?} {:?}", h.opcode, h.status));
        }
        let mut body = vec![0u8; payload];
        s.read_exact(&mut body)
            .map_err(|e| format!("no payload: {e}"))?;
        Ok(body)
    };
    answer(Opcode::WriteResp, 0)?;
    let back = answer(Opcode::ReadResp, PAGE_SIZE)?;
    if back != page[..] {
        return Err("read back other contents".into());
    }
    Ok(())
}

/// A stale replica whose only live source it cannot reach leaves its
/// clients alone. A recovery starts by fencing the node's clients (every
/// connection closed, RDMA paused until it ends); with the source out of
/// reach, each attempt used to do that for nothing, every period. Now each
/// period's attempt finds that no source answers and fences nothing. Once
/// the source answers, the recovery fences, copies and turns live as
/// before.
#[test]
fn a_recovery_whose_source_is_out_of_reach_leaves_the_clients_connected() {
    const OWN_GPA: u64 = 0x1000_0000;
    let (_db, coord) = loopback_coordinator();
    let admin = coordinator_client(&coord.url());
    // a holds the range at GPA 0; everybody reaches it through the link
    // (its heartbeats go to the coordinator directly: it stays alive).
    let link = StallingLink::start();
    let _a = ChildServer::start_with(&coord.url(), "a", 0, &["--advertise", &link.addr()]);
    link.set_target(&_a.addr);
    write_the_range(&coord.url());
    link.hold();

    // b: a replica of that range (stale: it joins) and a range of its own.
    let mut cfg = ServerConfig::new("b", 2 * NODE_BYTES);
    cfg.set_ranges(vec![
        ExportedRange::new(0, NODE_BYTES as u64),
        ExportedRange::new(OWN_GPA, NODE_BYTES as u64),
    ]);
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.recovery_grace = Duration::from_millis(300);
    let b = page_server_with(&coord.url(), cfg);
    let mut client = TcpStream::connect(b.addr()).expect("connect to b");
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    raw::handshake(&mut client, 7, "b", None).expect("b takes the client");
    let own_offset = NODE_BYTES as u64;
    raw_round_trip(&mut client, 10, own_offset, &page_indexed(0, 5)).expect("b serves its range");

    let failed = b.stats().recovery_failures;
    assert!(
        wait_until(RECOVERY_LIMIT, || b.stats().recovery_failures >= failed + 2),
        "b did not try to recover its stale replica twice"
    );
    raw_round_trip(&mut client, 20, own_offset, &page_indexed(1, 5)).unwrap_or_else(|e| {
        panic!("b's recoveries with no source answering disturbed its client: {e}")
    });
    assert_eq!(
        replica_at(&admin, 0, "b").map(|r| r.state),
        Some(ReplicaState::Stale),
        "b began a recovery with no source answering"
    );

    // The link comes back (what it kept is dropped): the recovery runs,
    // and fences the connection opened before it.
    link.sever();
    assert!(
        wait_until(RECOVERY_LIMIT, || replica_at(&admin, 0, "b")
            .is_some_and(|r| r.state == ReplicaState::Live)),
        "b never recovered once a answered"
    );
    let mut byte = [0u8; 1];
    assert!(
        matches!(client.read(&mut byte), Ok(0) | Err(_)),
        "the recovery that ran did not close the connection opened before it"
    );
    let map = admin.map().expect("map");
    let mut back = vec![[0u8; PAGE_SIZE]; PAGES as usize];
    let gpas: Vec<u64> = (0..PAGES).map(gpa).collect();
    range_replica_manager(&map, 0, "b")
        .read_pages(&gpas, &mut back)
        .unwrap();
    for (i, page) in back.iter().enumerate() {
        assert!(
            *page == page_indexed(i as u64, 1),
            "page {i} of b differs from a's"
        );
    }
    b.shutdown();
}

/// `GET /ready` of a new replica (in this process) says 503 while it is
/// stale, here for as long as the live replica `a` is stopped (SIGSTOP:
/// nothing to recover from), and 200 once `a` runs again and the new
/// replica has copied the range: the gate an operator restarting the
/// replicas one after the other waits for.
#[test]
fn ready_waits_for_the_recovery() {
    let (coord, a, _db) = cluster_with_written_range();
    let url = coord.url();
    let admin = coordinator_client(&url);
    a.pause();
    let mut cfg = ServerConfig::new("b", NODE_BYTES);
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.recovery_grace = Duration::from_millis(300);
    cfg.metrics_listen = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    let b = page_server_with(&url, cfg);
    let metrics = b.metrics_addr().expect("metrics address");
    assert!(
        wait_until(RECOVERY_LIMIT, || b.stats().recovery_failures >= 1),
        "b never tried to recover"
    );
    let (status, body) = http_get(metrics, "/ready");
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        body,
        "not ready\nregistered with the coordinator\n\
         range 0x0 (1048576 bytes): not live (stale, recovering or lost)\n"
    );

    a.resume();
    assert!(
        wait_until(RECOVERY_LIMIT, || http_get(metrics, "/ready").0 == 200),
        "b never became ready: {:?} (replica {:?})",
        http_get(metrics, "/ready"),
        replica(&admin, "b")
    );
    assert_eq!(
        replica(&admin, "b").map(|r| r.state),
        Some(ReplicaState::Live)
    );
    check_every_page(&admin, "b", |i| page_indexed(i, 1));
    let (status, _) = http_get(metrics, "/nothing");
    assert_eq!(status, 404);
}

/// Coherence nodes whose home recovers a replica of another of its ranges
/// keep their connections (the fence spares them), the page one of them
/// owns and the copies both hold (`common::coherent_recovery`).
#[test]
fn coherence_nodes_keep_their_pages_through_a_recovery_on_their_home() {
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let seen = common::coherent_recovery::a_node_keeps_its_pages_through_a_recovery_on_its_home(
        &url,
        |cfg| cfg,
        || manager(&url),
    );
    assert_eq!(seen.recoveries, 2);
    for connections in &seen.connections_after {
        assert_eq!(connections, &[("b".to_owned(), None)], "over TCP");
    }
}
