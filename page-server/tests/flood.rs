//! Connection floods (issue 8): connections that never finish their HELLO
//! (idle, a HELLO trickled a byte at a time, READs without HELLO, junk) and
//! handshaken ones that go idle are closed by their deadlines, and cannot
//! keep a good client from being served meanwhile.

mod common;

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::raw;
use common::*;
use page_server::{ServerConfig, ServerStats};
use rdma_transport::wire::{Header, Opcode, HEADER_LEN};
use rdma_transport::{ManagerConfig, TransportKind, TransportManager, PAGE_SIZE};

const HANDSHAKE: Duration = Duration::from_millis(500);
const IDLE: Duration = Duration::from_secs(1);
/// How late a close may come on a loaded two-CPU machine.
const SLACK: Duration = Duration::from_millis(1500);
/// Connections of each kind that never finish a handshake: idle,
/// slowloris, and garbage (READs without HELLO, and `JUNK` of them junk).
const PER_KIND: usize = 100;
const JUNK: usize = 30;
/// Handshaken connections that then go quiet.
const GREETED: usize = 10;
/// Pause between the flood's rounds; slowloris sends one byte every two.
const ROUND: Duration = Duration::from_millis(50);

/// Each test holds ~1000 descriptors: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Connects and sends nothing.
    Idle,
    /// Sends a valid HELLO one byte every ~100 ms (it would take ~5 s).
    Slowloris,
    /// Sends a well-framed READ (answered NO_HELLO) every round, never HELLO.
    ReadsWithoutHello,
    /// Sends bytes that are no header.
    Junk,
    /// Says HELLO, then nothing (closed as idle) ...
    GreetedIdle,
    /// ... or trickles a READ header a byte at a time (no complete request).
    GreetedTrickle,
}

struct Attacker {
    kind: Kind,
    stream: TcpStream,
    /// When its connect (and, for greeted ones, its handshake) finished.
    since: Instant,
    sent: usize,
    closed_after: Option<Duration>,
}

fn hello_bytes() -> Vec<u8> {
    let body = raw::hello_payload(7);
    let mut msg = Header::request(Opcode::Hello, 1, 0, body.len() as u32)
        .encode()
        .to_vec();
    msg.extend_from_slice(&body);
    msg
}

fn read_request() -> [u8; HEADER_LEN] {
    Header::request(Opcode::Read, 9, 0, PAGE_SIZE as u32).encode()
}

fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("flood connects")
}

/// A handshaken connection (the whole handshake done, insecure server).
fn greeted(addr: SocketAddr, kind: Kind) -> Attacker {
    let mut s = connect(addr);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    raw::handshake(&mut s, 7, "f", None).expect("handshake");
    attacker(kind, s)
}

fn attacker(kind: Kind, stream: TcpStream) -> Attacker {
    stream.set_nonblocking(true).unwrap();
    Attacker {
        kind,
        stream,
        since: Instant::now(),
        sent: 0,
        closed_after: None,
    }
}

/// Raises the soft descriptor limit to the hard one: the flood needs ~1000
/// (300 client sockets, and two descriptors per server-side connection).
fn enough_descriptors() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for the call to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim.rlim_cur = lim.rlim_max.min(8192);
    // SAFETY: `lim` is a valid rlimit, with the soft limit not above the hard.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    assert!(
        lim.rlim_cur >= 1200,
        "the flood test needs 1200 file descriptors; the hard limit is {}",
        lim.rlim_max
    );
}

/// Opens the flood: the greeted connections first (so that their HELLO
/// cannot be evicted by the rest), then `PER_KIND` of each other kind, the
/// junk last. (So, without limits on handshakes, the 280 that stay open
/// fill a cap of 256 connections deterministically: junk closed at once
/// cannot free slots for the good client.)
fn open_flood(addr: SocketAddr) -> Vec<Attacker> {
    let mut flood = Vec::new();
    for i in 0..GREETED {
        let kind = if i % 2 == 0 {
            Kind::GreetedIdle
        } else {
            Kind::GreetedTrickle
        };
        flood.push(greeted(addr, kind));
    }
    for i in 0..PER_KIND {
        flood.push(attacker(Kind::Idle, connect(addr)));
        flood.push(attacker(Kind::Slowloris, connect(addr)));
        if i < PER_KIND - JUNK {
            flood.push(attacker(Kind::ReadsWithoutHello, connect(addr)));
        }
    }
    for _ in 0..JUNK {
        flood.push(attacker(Kind::Junk, connect(addr)));
    }
    flood
}

/// One round of the flood: every open connection sends its next bytes and
/// drains what came back; a read of 0 bytes or a failed write marks it
/// closed by the server.
fn flood_round(flood: &mut [Attacker], round: usize, hello: &[u8]) {
    let read = read_request();
    let mut sink = [0u8; 4096];
    for a in flood.iter_mut().filter(|a| a.closed_after.is_none()) {
        let next: &[u8] = match a.kind {
            Kind::Idle | Kind::GreetedIdle => &[],
            Kind::Slowloris if round % 2 == 0 => &hello[a.sent % hello.len()..][..1],
            Kind::GreetedTrickle if round % 2 == 0 => &read[a.sent % HEADER_LEN..][..1],
            Kind::Slowloris | Kind::GreetedTrickle => &[],
            Kind::ReadsWithoutHello => &read,
            Kind::Junk => &[0xAB; 64],
        };
        let mut closed = false;
        if !next.is_empty() {
            match a.stream.write(next) {
                Ok(n) => a.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => closed = true,
            }
        }
        for _ in 0..64 {
            match a.stream.read(&mut sink) {
                Ok(0) => closed = true,
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => closed = true,
            }
            break;
        }
        if closed {
            a.closed_after = Some(a.since.elapsed());
        }
    }
}

/// Runs the flood until the server has closed every connection of it, or
/// for a bounded number of rounds; returns it.
fn run_flood(mut flood: Vec<Attacker>, done: &AtomicBool) -> Vec<Attacker> {
    let hello = hello_bytes();
    let rounds = ((HANDSHAKE + IDLE + 3 * SLACK).as_millis() / ROUND.as_millis()) as usize;
    for round in 0..rounds {
        flood_round(&mut flood, round, &hello);
        if flood.iter().all(|a| a.closed_after.is_some()) {
            break;
        }
        // Pacing the attack (one byte per two rounds), not synchronising.
        std::thread::park_timeout(ROUND);
    }
    done.store(true, Ordering::SeqCst);
    flood
}

fn good_client(url: &str) -> TransportManager {
    TransportManager::connect(ManagerConfig {
        coordinator_url: url.to_owned(),
        transport: TransportKind::Tcp,
        request_timeout_ms: 1000,
        connect_timeout_ms: 1000,
        poller_cpus: Some(vec![]),
        ..ManagerConfig::default()
    })
    .expect("the good client connects during the flood")
}

/// The good client writes and reads back pages, each content-checked,
/// until the flood is over; every request succeeds, each within a second.
/// Returns the rounds done.
fn serve_good_client(mgr: &TransportManager, done: &AtomicBool) -> usize {
    let pages = (NODE_BYTES / PAGE_SIZE) as u64;
    let mut back = [0u8; PAGE_SIZE];
    let mut rounds = 0;
    while !done.load(Ordering::SeqCst) && rounds < 1_000_000 {
        let gpa = (rounds as u64 % pages) * PAGE_SIZE as u64;
        let seed = (rounds / pages as usize) as u8;
        let started = Instant::now();
        mgr.write_page(gpa, &page_for(gpa, seed))
            .unwrap_or_else(|e| panic!("write {rounds} during the flood: {e}"));
        mgr.read_page(gpa, &mut back)
            .unwrap_or_else(|e| panic!("read {rounds} during the flood: {e}"));
        assert!(back == page_for(gpa, seed), "page {gpa:#x} differs");
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "round {rounds} took {took:?}"
        );
        rounds += 1;
    }
    rounds
}

struct Outcome {
    flood: Vec<Attacker>,
    stats: ServerStats,
    good_rounds: usize,
}

/// A coordinator and a page-server with short limits; the flood opened
/// against it, then a good client that connects during it and works until
/// it is over.
fn flood_test(max_pending_handshakes: usize) -> Outcome {
    enough_descriptors();
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let mut cfg = ServerConfig::new("f", NODE_BYTES);
    cfg.rdma.enabled = false;
    cfg.handshake_timeout = HANDSHAKE;
    cfg.idle_timeout = IDLE;
    cfg.max_pending_handshakes = max_pending_handshakes;
    let server = page_server_with(&coord.url(), cfg);
    let flood = open_flood(server.addr());
    let done = Arc::new(AtomicBool::new(false));
    let flood_done = Arc::clone(&done);
    let attack = std::thread::spawn(move || run_flood(flood, &flood_done));
    let mgr = good_client(&coord.url());
    let good_rounds = serve_good_client(&mgr, &done);
    let flood = attack.join().expect("flood thread");
    // The good client, still connected, did not count as idle meanwhile.
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(0, &mut page)
        .expect("good client still served");
    Outcome {
        flood,
        stats: server.stats(),
        good_rounds,
    }
}

/// Every connection of `kind` was closed by the server within `by` of its
/// start (and, with `not_before`, not earlier).
fn assert_closed(flood: &[Attacker], kind: Kind, not_before: Option<Duration>, by: Duration) {
    let of_kind: Vec<_> = flood.iter().filter(|a| a.kind == kind).collect();
    assert!(!of_kind.is_empty());
    for a in of_kind {
        let after = a
            .closed_after
            .unwrap_or_else(|| panic!("a {kind:?} connection was never closed by the server"));
        assert!(
            after <= by,
            "a {kind:?} connection was closed after {after:?}, not by {by:?}"
        );
        if let Some(min) = not_before {
            assert!(
                after >= min,
                "a {kind:?} connection was closed early, after {after:?}"
            );
        }
    }
}

fn assert_greeted_closed_as_idle(out: &Outcome) {
    // Checked only every other round (ROUND), hence the small margin.
    let early = IDLE - 2 * ROUND;
    assert_closed(&out.flood, Kind::GreetedIdle, Some(early), IDLE + SLACK);
    assert_closed(&out.flood, Kind::GreetedTrickle, Some(early), IDLE + SLACK);
    assert!(out.stats.idle_timeouts >= GREETED as u64, "{:?}", out.stats);
}

/// With room for every waiting handshake, the idle and slowloris
/// connections stay open until their handshake deadline (those that send
/// page requests or junk are closed at once); the good client gets in
/// anyway (its connection is not counted with theirs).
#[test]
fn connections_without_a_handshake_are_closed_at_the_deadline_and_a_good_client_is_served() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let out = flood_test(1000);
    assert!(out.good_rounds > 0);
    let early = Some(HANDSHAKE - 2 * ROUND);
    for kind in [Kind::Idle, Kind::Slowloris] {
        assert_closed(&out.flood, kind, early, HANDSHAKE + SLACK);
    }
    // A page request before the handshake is answered by closing at once.
    for kind in [Kind::ReadsWithoutHello, Kind::Junk] {
        assert_closed(&out.flood, kind, None, SLACK);
    }
    assert_greeted_closed_as_idle(&out);
    let unhandshaken = (PER_KIND * 2) as u64;
    assert!(
        out.stats.handshake_timeouts >= unhandshaken,
        "{:?}",
        out.stats
    );
    assert_eq!(out.stats.evicted_pending, 0, "{:?}", out.stats);
    assert!(out.stats.protocol_errors >= JUNK as u64, "{:?}", out.stats);
}

/// With the default cap of 64 waiting handshakes, a flood of 300 evicts
/// its own oldest connections: every one is closed by its deadline, and
/// the good client, connecting last, gets in.
#[test]
fn a_flood_over_the_pending_cap_evicts_its_oldest_and_a_good_client_is_served() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let out = flood_test(64);
    assert!(out.good_rounds > 0);
    for kind in [Kind::Idle, Kind::Slowloris, Kind::ReadsWithoutHello] {
        assert_closed(&out.flood, kind, None, HANDSHAKE + SLACK);
    }
    assert_closed(&out.flood, Kind::Junk, None, SLACK);
    assert_greeted_closed_as_idle(&out);
    assert!(out.stats.evicted_pending > 0, "{:?}", out.stats);
    assert!(out.stats.handshake_timeouts > 0, "{:?}", out.stats);
}

/// A good client whose connection the server closed while it was idle is
/// served on its next request: the request finds the connection dead,
/// and the manager runs it once more on a new one (page reads and writes are
/// idempotent).
#[test]
fn a_client_whose_idle_connection_was_closed_is_served_on_its_next_request() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let mut cfg = ServerConfig::new("p", NODE_BYTES);
    cfg.rdma.enabled = false;
    cfg.idle_timeout = Duration::from_millis(300);
    let server = page_server_with(&coord.url(), cfg);
    let mgr = good_client(&coord.url());
    mgr.write_page(0, &page_for(0, 1)).unwrap();
    assert!(wait_until(Duration::from_secs(5), || {
        server.stats().idle_timeouts == 1
    }));
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(0, &mut page)
        .expect("served after the idle close");
    assert!(page == page_for(0, 1));
}
