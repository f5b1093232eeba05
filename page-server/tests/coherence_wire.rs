//! The coherence protocol over the wire: one page-server as the home,
//! several `TransportManager`s in this process as the nodes
//! (`CoherentNode`), each with a small embedder (`Copies`) holding its
//! local copies as `GuestMemory` will. Every step that moves a page checks
//! its whole contents. No sleeps: each step waits for an answer that the
//! protocol only sends once the step before it is done.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use common::coherent_copies::{home_manager, Copies, Node};
use common::raw::{self, read_framed};
use common::*;
use page_server::{RunningServer, ServerConfig};
use rdma_transport::auth::ClusterKey;
use rdma_transport::coherent::{
    Access, CoherenceConfig, CoherenceHandler, CoherentNode, Mode, Recall, RecallAnswer,
};
use rdma_transport::wire::{
    decode_to_node, encode_to_home, Header, Opcode, Status, ToNodeFrame, HEADER_LEN,
};
use rdma_transport::{Page, TransportError, TransportManager, PAGE_SIZE};

const HOME: &str = "home";
const GPA_BASE: u64 = 0x10_0000;

fn node(server: &RunningServer, key: &ClusterKey, min_hold_us: u64) -> Node {
    Node::with_manager(manager_for(server, key), min_hold_us)
}

fn manager_for(server: &RunningServer, key: &ClusterKey) -> TransportManager {
    home_manager(server, HOME, GPA_BASE, key)
}

fn home() -> (RunningServer, ClusterKey) {
    let key = ClusterKey::generate().expect("a key");
    let mut cfg = ServerConfig::new(HOME, NODE_BYTES);
    cfg.cluster_key = Some(key.clone());
    (page_server::spawn(cfg).expect("page-server starts"), key)
}

fn filled(gpa: u64, seed: u8) -> impl Fn(&mut Page) {
    move |p| *p = page_for(gpa, seed)
}

#[test]
fn a_reader_gets_the_owners_data_by_downgrade_and_a_writer_invalidates_the_readers() {
    let (server, key) = home();
    let a = node(&server, &key, 1000);
    let b = node(&server, &key, 1000);
    let gpa = GPA_BASE + 5 * PAGE_SIZE as u64;

    // A owns the page and writes it; the home still has zeros.
    a.modify(gpa, filled(gpa, 0xa1)).unwrap();
    assert_eq!(
        a.copies.copy(gpa),
        Some((Mode::Exclusive, page_for(gpa, 0xa1)))
    );
    assert!(a.copies.take_recalls().is_empty());

    // B reads: the home downgrades A, which writes back; B sees A's data.
    assert_eq!(b.read(gpa).unwrap(), page_for(gpa, 0xa1));
    assert_eq!(a.copies.take_recalls(), [(gpa, Recall::Downgrade)]);
    assert_eq!(
        a.copies.copy(gpa),
        Some((Mode::Shared, page_for(gpa, 0xa1)))
    );
    assert_eq!(
        b.copies.copy(gpa),
        Some((Mode::Shared, page_for(gpa, 0xa1)))
    );
    // The written-back page is the home's data (a plain READ shows it).
    let mut page = [0u8; PAGE_SIZE];
    a.manager.read_page(gpa, &mut page).unwrap();
    assert_eq!(page, page_for(gpa, 0xa1));

    // A writes again (an upgrade of its shared copy): B is invalidated,
    // with nothing to write back.
    a.modify(gpa, filled(gpa, 0xa2)).unwrap();
    assert_eq!(
        b.copies.take_recalls(),
        [(gpa, Recall::Invalidate { write_back: false })]
    );
    assert_eq!(b.copies.copy(gpa), None);
    assert_eq!(
        a.copies.copy(gpa),
        Some((Mode::Exclusive, page_for(gpa, 0xa2)))
    );

    // B writes: A (the owner) is invalidated and writes back first; B's
    // write starts from A's data.
    b.modify(gpa, |p| {
        assert_eq!(
            *p,
            page_for(gpa, 0xa2),
            "the new owner starts from the latest data"
        );
        p[100] ^= 0xff;
    })
    .unwrap();
    assert_eq!(
        a.copies.take_recalls(),
        [(gpa, Recall::Invalidate { write_back: true })]
    );
    assert_eq!(a.copies.copy(gpa), None);
    let mut expected = page_for(gpa, 0xa2);
    expected[100] ^= 0xff;
    assert_eq!(a.read(gpa).unwrap(), expected);
    assert_eq!(b.copies.copy(gpa), Some((Mode::Shared, expected)));

    let stats = server.coherence_stats();
    assert_eq!(stats.pages, 1);
    assert_eq!(stats.refused_frames, 0);
    assert_eq!(stats.home.downgrades_sent, 2);
    assert_eq!(stats.home.invalidation_rounds, 2);
    assert_eq!(stats.home.exclusive_grants, 3);
    assert_eq!(stats.home.write_backs, 3);
    assert_eq!(stats.home.pages_lost, 0);
}

#[test]
fn a_node_that_dies_owning_a_page_loses_it_for_everyone_and_its_written_back_pages_survive() {
    let (server, key) = home();
    let mut a = node(&server, &key, 0);
    let b = node(&server, &key, 0);
    let c = node(&server, &key, 0);
    let owned = GPA_BASE;
    let evicted = GPA_BASE + PAGE_SIZE as u64;
    let shared = GPA_BASE + 2 * PAGE_SIZE as u64;

    // `owned`: B wrote version 1 (written back when A took it), A writes
    // version 2 and never writes it back.
    b.modify(owned, filled(owned, 1)).unwrap();
    a.modify(owned, filled(owned, 2)).unwrap();
    // `evicted`: A wrote it and evicted it (written back).
    a.modify(evicted, filled(evicted, 3)).unwrap();
    a.c().evict(evicted).unwrap();
    assert_eq!(a.copies.copy(evicted), None);
    // `shared`: A and B hold it read-only.
    c.modify(shared, filled(shared, 4)).unwrap();
    assert_eq!(a.read(shared).unwrap(), page_for(shared, 4));
    assert_eq!(b.read(shared).unwrap(), page_for(shared, 4));
    assert_eq!(
        b.copies.take_recalls(),
        [(owned, Recall::Invalidate { write_back: true })]
    );

    a.kill();
    // Its copies are gone on its side too.
    assert!(a.copies.pages.lock().is_empty());

    // Nobody gets the older version of `owned`: reads and writes fail
    // with the typed error, on every node, every time.
    for node in [&b, &c] {
        for access in [Access::Read, Access::Write, Access::Read] {
            match node.c().acquire(owned, access) {
                Err(TransportError::CoherentDataLost { gpa, node }) => {
                    assert_eq!((gpa, node.as_str()), (owned, HOME));
                }
                other => panic!("{access:?} of a lost page: {other:?}"),
            }
        }
        assert_eq!(node.copies.copy(owned), None, "no copy of a lost page");
    }
    // What A wrote back survives it.
    assert_eq!(b.read(evicted).unwrap(), page_for(evicted, 3));
    // A shared holder's death loses nothing: C can write without waiting
    // for A (it is no longer a holder), and B is invalidated.
    c.modify(shared, filled(shared, 5)).unwrap();
    assert_eq!(
        b.copies.take_recalls(),
        [(shared, Recall::Invalidate { write_back: false })]
    );
    assert_eq!(b.read(shared).unwrap(), page_for(shared, 5));

    let stats = server.coherence_stats();
    assert_eq!(stats.home.pages_lost, 1);
    assert_eq!(stats.home.lost_answers, 6);
}

#[test]
fn concurrent_increments_from_three_nodes_are_all_counted() {
    const NODES: usize = 3;
    const INCREMENTS: u64 = 150;
    let (server, key) = home();
    let gpa = GPA_BASE + 7 * PAGE_SIZE as u64;
    let nodes: Vec<Node> = (0..NODES).map(|_| node(&server, &key, 200)).collect();
    let start = std::sync::Barrier::new(NODES);
    let counter = |p: &Page, at: usize| u64::from_le_bytes(p[at..at + 8].try_into().unwrap());
    std::thread::scope(|s| {
        for (i, node) in nodes.iter().enumerate() {
            let start = &start;
            s.spawn(move || {
                start.wait();
                let mut seen = 0;
                for k in 0..INCREMENTS {
                    if k % 3 == 1 {
                        // Read it after giving it back: a shared copy,
                        // from the home or by downgrading another owner.
                        // Never an older count than this node last saw
                        // (its own increment since is in it).
                        let now = counter(&node.read(gpa).unwrap(), 0);
                        assert!(now > seen, "node {i} read {now} after {seen}");
                        seen = now;
                    }
                    node.modify(gpa, |p| {
                        let total = counter(p, 0);
                        p[..8].copy_from_slice(&(total + 1).to_le_bytes());
                        // A per-node tally elsewhere in the page.
                        let at = 8 + 8 * i;
                        let mine = counter(p, at);
                        assert_eq!(mine, k, "node {i} finds its own increments");
                        p[at..at + 8].copy_from_slice(&(mine + 1).to_le_bytes());
                    })
                    .unwrap();
                    if k % 3 == 0 {
                        // Give the page back (written back to the home).
                        node.c().evict(gpa).unwrap();
                    }
                }
            });
        }
    });
    let reader = node(&server, &key, 0);
    let page = reader.read(gpa).unwrap();
    assert_eq!(counter(&page, 0), NODES as u64 * INCREMENTS);
    for i in 0..NODES {
        assert_eq!(
            counter(&page, 8 + 8 * i),
            INCREMENTS,
            "node {i}'s increments"
        );
    }
    assert!(page[8 + 8 * NODES..].iter().all(|&b| b == 0));
    let stats = server.coherence_stats();
    assert_eq!(stats.home.pages_lost, 0);
    assert_eq!(stats.refused_frames, 0);
    // Every eviction gave the page back: each third increment at least
    // needed a new exclusive grant.
    assert!(
        stats.home.exclusive_grants >= NODES as u64 * INCREMENTS / 3,
        "{stats:?}"
    );
    eprintln!("counter test: {stats:?}");
}

#[test]
fn concurrent_faults_of_one_node_on_one_page_make_one_request() {
    const THREADS: usize = 4;
    let (server, key) = home();
    let gpa = GPA_BASE + 9 * PAGE_SIZE as u64;
    // B owns the page and keeps it for 300 ms after its grant: A's faults
    // all come while the home waits for B's downgrade.
    let b = node(&server, &key, 300_000);
    let a = node(&server, &key, 0);
    b.modify(gpa, filled(gpa, 0x33)).unwrap();
    let start = std::sync::Barrier::new(THREADS);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            let (a, start) = (&a, &start);
            s.spawn(move || {
                start.wait();
                assert_eq!(a.read(gpa).unwrap(), page_for(gpa, 0x33));
            });
        }
    });
    let stats = a.c().stats();
    assert_eq!(stats.requests, 1, "{stats:?}");
    assert!(stats.coalesced_faults >= 1, "{stats:?}");
    assert_eq!(b.copies.take_recalls(), [(gpa, Recall::Downgrade)]);
    let home = server.coherence_stats().home;
    assert_eq!((home.shared_grants, home.duplicate_requests), (1, 0));
}

#[test]
fn a_home_that_goes_away_fails_the_requests_and_its_pages_are_dropped() {
    let (server, key) = home();
    let a = node(&server, &key, 0);
    let held = GPA_BASE;
    a.modify(held, filled(held, 7)).unwrap();
    server.shutdown();
    // A page not held: its request fails with the connection (or the
    // connection cannot be made again).
    match a.c().acquire(GPA_BASE + PAGE_SIZE as u64, Access::Read) {
        Err(TransportError::NodeDown { node, .. }) => assert_eq!(node, HOME),
        other => panic!("a request to a home that is gone: {other:?}"),
    }
    // The copy of the home's page is dropped once the connection is seen
    // gone (by the node's reader thread, which may still be at it).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while a.copies.copy(held).is_some() {
        assert!(std::time::Instant::now() < deadline, "copy still held");
        std::thread::yield_now();
    }
    assert_eq!(
        a.copies.take_recalls(),
        [(held, Recall::Invalidate { write_back: false })]
    );
}

/// An embedder whose handler panics (a bug): the node must not hang.
#[derive(Debug)]
struct Panicky;

impl CoherenceHandler for Panicky {
    fn install(&self, gpa: u64, _mode: Mode, _data: Option<&Page>) {
        panic!("test: the embedder fails to install {gpa:#x}");
    }

    fn recall(&self, _gpa: u64, _recall: Recall) -> RecallAnswer {
        RecallAnswer::Done
    }
}

#[test]
fn a_panicking_handler_fails_the_request_instead_of_hanging() {
    let (server, key) = home();
    let manager = manager_for(&server, &key);
    let panicky = manager.coherent_node(Arc::new(Panicky), CoherenceConfig::default());
    match panicky.acquire(GPA_BASE, Access::Read) {
        Err(TransportError::NodeDown { node, .. }) => assert_eq!(node, HOME),
        other => panic!("expected NodeDown, got {other:?}"),
    }
    // The home lost that node; another node is served as usual.
    let other = node(&server, &key, 0);
    other.modify(GPA_BASE, filled(GPA_BASE, 1)).unwrap();
    assert_eq!(other.read(GPA_BASE).unwrap(), page_for(GPA_BASE, 1));
}

/// A node's copies whose recalls wait at a gate: a node that is still
/// dropping its copies (a large guest takes a while).
#[derive(Default)]
struct Gated {
    copies: Copies,
    /// (a recall came, the gate is open)
    state: parking_lot::Mutex<(bool, bool)>,
    changed: parking_lot::Condvar,
}

impl Gated {
    fn wait_for_a_recall(&self) -> bool {
        let mut state = self.state.lock();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !state.0 {
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return state.0;
            }
        }
        true
    }

    fn open(&self) {
        self.state.lock().1 = true;
        self.changed.notify_all();
    }
}

/// A node whose recalls wait at a gate, holding a shared copy of the page
/// at `gpa`, which must be `page_for(gpa, seed)`.
fn gated_reader(
    server: &RunningServer,
    key: &ClusterKey,
    gpa: u64,
    seed: u8,
) -> (CoherentNode, Arc<Gated>) {
    let gated = Arc::new(Gated::default());
    let node = manager_for(server, key).coherent_node(
        Arc::clone(&gated) as Arc<dyn CoherenceHandler>,
        CoherenceConfig::default(),
    );
    node.acquire(gpa, Access::Read).unwrap();
    assert!(
        gated.copies.copy(gpa) == Some((Mode::Shared, page_for(gpa, seed))),
        "the gated node's copy is not the page written"
    );
    (node, gated)
}

impl CoherenceHandler for Gated {
    fn install(&self, gpa: u64, mode: Mode, data: Option<&Page>) {
        self.copies.install(gpa, mode, data);
    }

    fn recall(&self, gpa: u64, recall: Recall) -> RecallAnswer {
        let mut state = self.state.lock();
        state.0 = true;
        self.changed.notify_all();
        while !state.1 {
            self.changed.wait(&mut state);
        }
        drop(state);
        self.copies.recall(gpa, recall)
    }
}

/// A node that leaves its home (here: it is dropped) drops its copies
/// before the home learns that it left: until then another node's write
/// waits for the leaving node's answer, and it is never granted while the
/// leaving node's vCPUs could still read the old page.
#[test]
fn a_leaving_node_drops_its_copies_before_the_home_lets_another_write() {
    let (server, key) = home();
    let config = CoherenceConfig {
        timeout_ms: 500,
        ..CoherenceConfig::default()
    };
    let writer = Node::with_config(manager_for(&server, &key), config);
    writer.modify(GPA_BASE, filled(GPA_BASE, 1)).unwrap();
    let (leaving, gated) = gated_reader(&server, &key, GPA_BASE, 1);

    let dropper = std::thread::spawn(move || drop(leaving));
    assert!(
        gated.wait_for_a_recall(),
        "the leaving node never dropped its copy"
    );
    let meanwhile = writer.c().acquire(GPA_BASE, Access::Write);
    let held = gated.copies.copy(GPA_BASE).is_some();
    // Open before judging: a failed test must not leave the node's reader
    // held at the gate.
    gated.open();
    match meanwhile {
        Err(TransportError::Timeout { .. }) => {}
        Ok(()) => panic!("a write was granted while the leaving node still held its copy"),
        Err(other) => panic!("expected a timeout while the node leaves, got {other:?}"),
    }
    assert!(held, "the gate let the copy go");

    dropper.join().expect("the node closes");
    assert_eq!(gated.copies.copy(GPA_BASE).map(|(mode, _)| mode), None);
    writer.modify(GPA_BASE, filled(GPA_BASE, 2)).unwrap();
    assert!(writer.read(GPA_BASE).unwrap() == page_for(GPA_BASE, 2));
}

/// A raw client (handshaken) that sends coherence frames by hand.
fn raw_client(server: &RunningServer, key: &ClusterKey) -> TcpStream {
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    raw::handshake(&mut s, 77, HOME, Some(key)).expect("handshake");
    s
}

#[test]
fn bad_coherence_frames_are_refused_and_the_server_keeps_serving() {
    let (server, key) = home();
    let good = node(&server, &key, 0);
    let gpa = GPA_BASE + 3 * PAGE_SIZE as u64;
    good.modify(gpa, filled(gpa, 9)).unwrap();

    let mut s = raw_client(&server, &key);
    let refusal = |s: &mut TcpStream| {
        let (h, payload) = read_framed(s);
        match decode_to_node(&h, &payload, false) {
            Ok(ToNodeFrame::Refused { offset, status }) => (offset, status),
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    // Out of the region, unaligned.
    let read_req = coherence::ToHome::ReadReq { req: 1 };
    s.write_all(&encode_to_home(NODE_BYTES as u64, &read_req, None, false))
        .unwrap();
    assert_eq!(refusal(&mut s), (NODE_BYTES as u64, Status::OutOfRange));
    s.write_all(&encode_to_home(12, &read_req, None, false))
        .unwrap();
    assert_eq!(refusal(&mut s), (12, Status::Unaligned));
    // A body of an unknown kind.
    let mut frame = encode_to_home(0, &read_req, None, false);
    frame[HEADER_LEN] = 0xee;
    s.write_all(&frame).unwrap();
    assert_eq!(refusal(&mut s), (0, Status::BadLength));
    // A write-back whose page fails its checksum.
    let page = page_for(0, 1);
    let mut frame = encode_to_home(
        0,
        &coherence::ToHome::WriteBack { version: 1 },
        Some(&page),
        false,
    );
    let last = frame.len() - 1;
    frame[last] ^= 1;
    s.write_all(&frame).unwrap();
    assert_eq!(refusal(&mut s), (0, Status::BadLength));
    // After all that, the same connection still serves plain READs.
    let header = Header::request(Opcode::Read, 5, gpa - GPA_BASE, PAGE_SIZE as u32);
    s.write_all(&header.encode()).unwrap();
    let (h, data) = read_framed(&mut s);
    assert_eq!(
        (h.opcode, h.status, h.request_id),
        (Opcode::ReadResp, Status::Ok, 5)
    );
    assert_eq!(data, vec![0u8; PAGE_SIZE], "the home's data is version 0");
    // A claimed write-back of the current version from a node that does
    // not own the page: not stored, and the liar's connection is closed.
    let claim = encode_to_home(
        gpa - GPA_BASE,
        &coherence::ToHome::WriteBack { version: 1 },
        Some(&[0xffu8; PAGE_SIZE]),
        false,
    );
    s.write_all(&claim).unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(
        std::io::Read::read(&mut s, &mut byte).unwrap_or(0),
        0,
        "closed"
    );
    // The home's data is untouched: a plain READ on another connection.
    let mut page = [0u8; PAGE_SIZE];
    good.manager.read_page(gpa, &mut page).unwrap();
    assert_eq!(page, [0u8; PAGE_SIZE], "still version 0 at the home");
    assert_eq!(server.coherence_stats().refused_frames, 5);

    // And the real nodes go on: a reader gets the owner's data.
    let other = node(&server, &key, 0);
    assert_eq!(other.read(gpa).unwrap(), page_for(gpa, 9));
    assert_eq!(good.copies.take_recalls(), [(gpa, Recall::Downgrade)]);
}

#[test]
fn an_owner_that_claims_a_write_back_without_the_page_is_not_believed() {
    let (server, key) = home();
    let off = 4 * PAGE_SIZE as u64;
    let gpa = GPA_BASE + off;
    let mut s = raw_client(&server, &key);
    // Ownership, by hand.
    let write_req = coherence::ToHome::WriteReq {
        req: 1,
        upgrade: false,
    };
    s.write_all(&encode_to_home(off, &write_req, None, false))
        .unwrap();
    let (h, payload) = read_framed(&mut s);
    let version = match decode_to_node(&h, &payload, false) {
        Ok(ToNodeFrame::Msg(f)) => match f.msg {
            coherence::ToNode::Grant {
                req: 1,
                mode: coherence::Mode::Exclusive,
                version,
                data_version: 0,
                ..
            } => {
                assert_eq!(f.page, Some(&[0u8; PAGE_SIZE][..]), "the home's page");
                version
            }
            other => panic!("expected an exclusive grant, got {other:?}"),
        },
        other => panic!("expected a grant, got {other:?}"),
    };
    // "I wrote version 1 back" without the page: not believed, and the
    // home closes the connection of a node that says so.
    let claim = coherence::ToHome::WriteBack { version };
    s.write_all(&encode_to_home(off, &claim, None, false))
        .unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(
        std::io::Read::read(&mut s, &mut byte).unwrap_or(0),
        0,
        "closed"
    );
    assert_eq!(server.coherence_stats().refused_frames, 1);
    // The owner goes away: its version was never stored, so the page is
    // lost, not served as version 0.
    drop(s);
    let b = node(&server, &key, 0);
    match b.c().acquire(gpa, Access::Read) {
        Err(TransportError::CoherentDataLost { gpa: lost, .. }) => assert_eq!(lost, gpa),
        other => panic!("expected the lost-data error, got {other:?}"),
    }
    assert_eq!(server.coherence_stats().home.pages_lost, 1);
}

#[test]
fn a_version_3_peer_is_refused() {
    let (server, _key) = home();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = Header::request(Opcode::Hello, 1, 0, 48).encode().to_vec();
    hello[4] = 3;
    hello.extend_from_slice(&raw::hello_payload(1));
    s.write_all(&hello).unwrap();
    let (h, payload) = read_framed(&mut s);
    assert_eq!((h.opcode, h.status), (Opcode::Error, Status::BadVersion));
    assert!(payload.is_empty());
}

/// Library nodes agree to offset-bound sums with their home (they ask for
/// them in the handshake): every frame the home takes from them is bound.
/// (Frames the home sends back are bound too: a node decodes them so, and
/// the exchange below would fail otherwise.)
#[test]
fn library_nodes_bind_their_coherence_frames() {
    let (server, key) = home();
    let (a, b) = (node(&server, &key, 0), node(&server, &key, 0));
    let gpa = GPA_BASE + 6 * PAGE_SIZE as u64;
    a.modify(gpa, filled(gpa, 4)).unwrap();
    // b's read downgrades a, whose ack carries the page back.
    assert_eq!(b.read(gpa).unwrap(), page_for(gpa, 4));
    let stats = server.coherence_stats();
    // At least a's WRITE_REQ, b's READ_REQ and a's DOWNGRADE_ACK.
    assert!(
        stats.bound_frames >= 3,
        "frames taken with bound sums: {}",
        stats.bound_frames
    );
    assert_eq!(stats.refused_frames, 0);
}

/// What offset-bound sums close at the home: a node owns two pages at the
/// same version and writes one back, and the frame's offset changes on the
/// way to the other's. With page-only sums (a connection that did not
/// agree to bound sums) the home takes it as the other page's write-back
/// and serves the first page's data as the second's; with bound sums the
/// frame fails its checksum, is refused, and the page stays as it was.
#[test]
fn a_write_back_whose_offset_changed_on_the_way_is_refused_with_bound_sums() {
    for bound_sums in [false, true] {
        let (server, key) = home();
        let mut s = TcpStream::connect(server.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let ack = if bound_sums {
            raw::handshake_bound_sums(&mut s, 78, HOME, Some(&key))
        } else {
            raw::handshake(&mut s, 78, HOME, Some(&key))
        }
        .expect("handshake");
        assert_eq!(ack.bound_sums, bound_sums);
        let (off_a, off_b) = (2 * PAGE_SIZE as u64, 7 * PAGE_SIZE as u64);
        let mut versions = Vec::new();
        for (req, off) in [(1, off_a), (2, off_b)] {
            let write_req = coherence::ToHome::WriteReq {
                req,
                upgrade: false,
            };
            s.write_all(&encode_to_home(off, &write_req, None, bound_sums))
                .unwrap();
            let (h, payload) = read_framed(&mut s);
            match decode_to_node(&h, &payload, bound_sums) {
                Ok(ToNodeFrame::Msg(f)) => match f.msg {
                    coherence::ToNode::Grant {
                        mode: coherence::Mode::Exclusive,
                        version,
                        ..
                    } => versions.push(version),
                    other => panic!("expected an exclusive grant, got {other:?}"),
                },
                other => panic!("expected a grant, got {other:?}"),
            }
        }
        assert_eq!(versions[0], versions[1], "both pages owned at one version");
        let data_a = page_for(GPA_BASE + off_a, 5);
        let write_back = coherence::ToHome::WriteBack {
            version: versions[0],
        };
        let mut frame = encode_to_home(off_a, &write_back, Some(&data_a), bound_sums);
        let sent = Header::decode_prefix(&frame).unwrap().expect("a header");
        let moved = Header {
            offset: off_b,
            ..sent
        };
        frame[..HEADER_LEN].copy_from_slice(&moved.encode());
        s.write_all(&frame).unwrap();
        if bound_sums {
            let (h, payload) = read_framed(&mut s);
            assert_eq!(
                decode_to_node(&h, &payload, true),
                Ok(ToNodeFrame::Refused {
                    offset: off_b,
                    status: Status::BadLength
                })
            );
        }
        // Page b at the home, by a plain READ on the same connection (taken
        // after the frame: a connection's messages are served in order).
        let header = Header::request(Opcode::Read, 9, off_b, PAGE_SIZE as u32);
        s.write_all(&header.encode()).unwrap();
        let (h, data) = read_framed(&mut s);
        assert_eq!(
            (h.opcode, h.status, h.request_id),
            (Opcode::ReadResp, Status::Ok, 9)
        );
        let stats = server.coherence_stats();
        if bound_sums {
            assert_eq!(data, vec![0u8; PAGE_SIZE], "page b as it was");
            assert_eq!(stats.refused_frames, 1);
            assert_eq!(stats.bound_frames, 2, "the two WRITE_REQs");
            assert_eq!(
                server.stats().checksum_failures,
                1,
                "counted as damaged on the way"
            );
        } else {
            assert_eq!(
                data,
                data_a.to_vec(),
                "page-only sums: page a's data taken as page b's"
            );
            assert_eq!((stats.refused_frames, stats.bound_frames), (0, 0));
            assert_eq!(server.stats().checksum_failures, 0);
        }
    }
}

/// A node whose requests give up after 500 ms.
fn impatient_node(server: &RunningServer, key: &ClusterKey) -> Node {
    let config = CoherenceConfig {
        timeout_ms: 500,
        ..CoherenceConfig::default()
    };
    Node::with_config(manager_for(server, key), config)
}

/// How long a home waits for a node it lost or closed: for a raw node,
/// which declared that it drops its copies 1 s into the home's silence
/// (`raw::RAW_NODE_BOUND_MS`), and for a node that declared the longest
/// bound the home accepts (`--node-dead-home-timeout-ms`, 10 s).
fn waits_for_raw_and_slowest_nodes() -> (Duration, Duration) {
    let wait = |ms: u64| rdma_transport::dead_peer::left_for_sure_within(Duration::from_millis(ms));
    (
        wait(raw::RAW_NODE_BOUND_MS.into()),
        wait(rdma_transport::coherent::DEFAULT_DEAD_HOME_TIMEOUT_MS),
    )
}

/// `writer` asks to write the page at `gpa` again and again (each try
/// waits 500 ms for its grant) for up to `within`: whether it was granted.
fn write_granted_within(writer: &Node, gpa: u64, within: Duration) -> bool {
    for _ in 0..within.as_millis().div_ceil(500) {
        match writer.c().acquire(gpa, Access::Write) {
            Ok(()) => return true,
            Err(TransportError::Timeout { .. }) => {}
            Err(other) => panic!("expected a grant or a timeout, got {other:?}"),
        }
    }
    false
}

/// An impatient node that wrote `page_for(gpa, seed)` at `gpa`, and a raw
/// node that holds a shared copy of it (its data checked), then makes the
/// home close its connection: it takes the next page exclusive and claims
/// a write-back of it without the page. Returns once the raw node has read
/// the end of the stream (the home told it), its socket still open: a
/// node that is still dropping its copies.
fn writer_and_a_node_the_home_closes(
    server: &RunningServer,
    key: &ClusterKey,
    gpa: u64,
    seed: u8,
) -> (Node, TcpStream) {
    let writer = impatient_node(server, key);
    writer.modify(gpa, filled(gpa, seed)).unwrap();
    let copy_off = gpa - GPA_BASE;
    let copy = page_for(gpa, seed);
    let bad_off = copy_off + PAGE_SIZE as u64;
    let mut s = raw_client(server, key);
    let grant = |s: &mut TcpStream, req| {
        let (h, payload) = read_framed(s);
        match decode_to_node(&h, &payload, false) {
            Ok(ToNodeFrame::Msg(f)) => match f.msg {
                coherence::ToNode::Grant {
                    req: r, version, ..
                } if r == req => (version, f.page.map(<[u8]>::to_vec)),
                other => panic!("expected the grant of request {req}, got {other:?}"),
            },
            other => panic!("expected a grant, got {other:?}"),
        }
    };
    let read_req = coherence::ToHome::ReadReq { req: 1 };
    s.write_all(&encode_to_home(copy_off, &read_req, None, false))
        .unwrap();
    let (_, data) = grant(&mut s, 1);
    assert!(
        data.as_deref() == Some(&copy[..]),
        "the raw node's copy is not the page written"
    );
    let write_req = coherence::ToHome::WriteReq {
        req: 2,
        upgrade: false,
    };
    s.write_all(&encode_to_home(bad_off, &write_req, None, false))
        .unwrap();
    let (version, _) = grant(&mut s, 2);
    let claim = coherence::ToHome::WriteBack { version };
    s.write_all(&encode_to_home(bad_off, &claim, None, false))
        .unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(
        std::io::Read::read(&mut s, &mut byte).expect("the end of the stream, not an error"),
        0,
        "the home did not close the node's connection"
    );
    (writer, s)
}

/// The home ends a node's connection (here a write-back it cannot
/// believe). The node learns it from the end of the stream, a round trip
/// later at best, and its vCPUs read its copies until it has dropped
/// them: the home gives its pages to others only once it has closed its
/// side.
#[test]
fn a_node_the_home_closes_keeps_its_pages_until_it_closes_its_side() {
    let (server, key) = home();
    let gpa = GPA_BASE + 5 * PAGE_SIZE as u64;
    let (writer, closed) = writer_and_a_node_the_home_closes(&server, &key, gpa, 1);
    assert_eq!(server.coherence_stats().refused_frames, 1);

    match writer.c().acquire(gpa, Access::Write) {
        Err(TransportError::Timeout { .. }) => {}
        Ok(()) => panic!("a write was granted while the closed node still held its copy"),
        Err(other) => {
            panic!("expected a timeout while the closed node holds its copy, got {other:?}")
        }
    }
    // Its copies dropped, the node closes its side: the home moves on.
    drop(closed);
    writer.modify(gpa, filled(gpa, 2)).unwrap();
    assert!(writer.read(gpa).unwrap() == page_for(gpa, 2));
    let other = node(&server, &key, 0);
    assert!(other.read(gpa).unwrap() == page_for(gpa, 2));
}

/// A node the home closed that never closes its side (its reader stuck,
/// or its host cut off right then) does not hold its pages forever: the
/// home moves on after the bound that node declared (plus a probe
/// interval and the margin for dropping copies), not before, and not
/// after the longest bound the home accepts either.
#[test]
fn a_node_the_home_closes_that_never_closes_its_side_is_let_go_after_its_bound() {
    let (server, key) = home();
    let (wait, slowest) = waits_for_raw_and_slowest_nodes();
    let gpa = GPA_BASE + 7 * PAGE_SIZE as u64;
    let (writer, _stuck) = writer_and_a_node_the_home_closes(&server, &key, gpa, 3);
    let told = std::time::Instant::now();
    let granted = write_granted_within(&writer, gpa, 4 * wait);
    let after = told.elapsed();
    assert!(granted, "the write was never granted ({after:?})");
    // The home's wait began before the node read the end of the stream.
    assert!(
        after + Duration::from_millis(500) >= wait,
        "the write was granted {after:?} after the close, before the node's wait of {wait:?}"
    );
    assert!(
        after < slowest,
        "the home waited {after:?}, as long as for the slowest node it accepts ({slowest:?}), \
         not the {wait:?} this node's declared bound needs"
    );
    writer.modify(gpa, filled(gpa, 4)).unwrap();
    assert!(writer.read(gpa).unwrap() == page_for(gpa, 4));
}

/// The home closes a node's connection from another connection's thread
/// (as when a send to the node stalls there). The node, told by the end of
/// the stream, drops its copies, then closes its side; another node's
/// write goes through only then.
#[test]
fn a_node_closed_from_another_thread_keeps_its_pages_until_it_dropped_its_copies() {
    let (server, key) = home();
    let gpa = GPA_BASE + 9 * PAGE_SIZE as u64;
    let first = node(&server, &key, 0);
    first.modify(gpa, filled(gpa, 1)).unwrap();
    let (closed, gated) = gated_reader(&server, &key, gpa, 1);

    assert_eq!(server.close_coherence_nodes_for_test(), 2);
    assert!(
        gated.wait_for_a_recall(),
        "the closed node never dropped its copy"
    );
    // A node that joins after the close.
    let writer = impatient_node(&server, &key);
    let meanwhile = writer.c().acquire(gpa, Access::Write);
    // Open before judging: a failed test must not leave the node's reader
    // held at the gate (dropping the node waits for it).
    gated.open();
    match meanwhile {
        Err(TransportError::Timeout { .. }) => {}
        Ok(()) => panic!("a write was granted while the closed node still held its copy"),
        Err(other) => {
            panic!("expected a timeout while the closed node holds its copy, got {other:?}")
        }
    }
    drop(closed);
    assert_eq!(gated.copies.copy(gpa), None);
    assert!(
        writer.read(gpa).unwrap() == page_for(gpa, 1),
        "the page written before the close"
    );
    writer.modify(gpa, filled(gpa, 2)).unwrap();
    assert!(writer.read(gpa).unwrap() == page_for(gpa, 2));
}

/// The same, with a node that never closes its side: the connection's
/// thread, waiting for the node's messages when another thread closed it,
/// notices (within a second) and lets the node go after its bound; with
/// the server spinning on its sockets and with blocking reads.
#[test]
fn a_node_closed_from_another_thread_that_never_closes_its_side_is_let_go_after_its_bound() {
    let (wait, slowest) = waits_for_raw_and_slowest_nodes();
    for spin in [None, Some(Duration::ZERO)] {
        let (server, key) = home();
        if let Some(spin) = spin {
            server.set_spin_before_block(spin);
        }
        let gpa = GPA_BASE + 10 * PAGE_SIZE as u64;
        let first = node(&server, &key, 0);
        first.modify(gpa, filled(gpa, 5)).unwrap();
        // A raw node with a shared copy, which reads nothing more and
        // never closes.
        let mut stuck = raw_client(&server, &key);
        let read_req = coherence::ToHome::ReadReq { req: 1 };
        stuck
            .write_all(&encode_to_home(gpa - GPA_BASE, &read_req, None, false))
            .unwrap();
        let (h, payload) = read_framed(&mut stuck);
        match decode_to_node(&h, &payload, false) {
            Ok(ToNodeFrame::Msg(f)) => {
                assert!(
                    matches!(f.msg, coherence::ToNode::Grant { req: 1, .. }),
                    "expected the grant, got {:?}",
                    f.msg
                );
                assert!(f.page == Some(&page_for(gpa, 5)[..]), "the granted page");
            }
            other => panic!("expected a grant, got {other:?}"),
        }
        assert_eq!(server.close_coherence_nodes_for_test(), 2, "spin {spin:?}");
        let closed_at = std::time::Instant::now();
        let writer = impatient_node(&server, &key);
        let granted = write_granted_within(&writer, gpa, 4 * wait);
        let after = closed_at.elapsed();
        assert!(
            granted,
            "spin {spin:?}: the write was never granted ({after:?} after the close)"
        );
        assert!(
            after >= wait,
            "spin {spin:?}: the write was granted {after:?} after the close, before the node's wait of {wait:?}"
        );
        assert!(
            after < slowest,
            "spin {spin:?}: the home waited {after:?}, not the node's own {wait:?}"
        );
        assert!(writer.read(gpa).unwrap() == page_for(gpa, 5));
        writer.modify(gpa, filled(gpa, 6)).unwrap();
        assert!(writer.read(gpa).unwrap() == page_for(gpa, 6));
        drop(stuck);
    }
}
