//! A coherence node declares, when it connects, the bound within which it
//! drops its copies of a home's pages once the home goes silent; the home
//! waits out that bound before it gives a node it lost to silence (or
//! closed) away, so it accepts no node without one, or with a longer one
//! than it is set to wait for (`--node-dead-home-timeout-ms`): such a node
//! could still read pages the home had given to others. Every page moved
//! is checked for content.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::num::NonZeroU32;
use std::time::Duration;

use common::coherent_copies::{home_manager, Node};
use common::raw::{self, read_framed};
use common::*;
use page_server::{RunningServer, ServerConfig};
use rdma_transport::auth::ClusterKey;
use rdma_transport::coherent::CoherenceConfig;
use rdma_transport::wire::{decode_to_node, encode_to_home, AuthRequest, Status, ToNodeFrame};
use rdma_transport::{TransportError, PAGE_SIZE};

const HOME: &str = "home";
const GPA_BASE: u64 = 0x10_0000;
/// What the homes here accept at most.
const LIMIT_MS: u32 = 2_000;

fn home() -> (RunningServer, ClusterKey) {
    let key = ClusterKey::generate().expect("a key");
    let mut cfg = ServerConfig::new(HOME, NODE_BYTES);
    cfg.cluster_key = Some(key.clone());
    cfg.node_dead_home_timeout = Duration::from_millis(LIMIT_MS.into());
    (page_server::spawn(cfg).expect("page-server starts"), key)
}

fn node(server: &RunningServer, key: &ClusterKey, dead_home_timeout_ms: u64) -> Node {
    let config = CoherenceConfig {
        dead_home_timeout_ms,
        ..CoherenceConfig::default()
    };
    Node::with_config(home_manager(server, HOME, GPA_BASE, key), config)
}

/// A node whose bound is longer than the home waits is told so at its
/// first access to the home's pages, with both numbers, and holds no copy;
/// the home made it no node and keeps serving a node within its limit.
#[test]
fn a_node_whose_bound_is_longer_than_the_home_waits_is_refused_and_told_why() {
    let (server, key) = home();
    let gpa = GPA_BASE + 3 * PAGE_SIZE as u64;
    let slow = node(&server, &key, u64::from(LIMIT_MS) + 1);
    match slow.read(gpa) {
        Err(TransportError::Config(why)) => {
            assert!(
                why.contains("2000 ms") && why.contains("2001"),
                "the error names the home's limit and the node's bound: {why}"
            );
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    assert_eq!(slow.copies.copy(gpa), None, "the refused node holds a copy");
    let stats = server.coherence_stats();
    assert_eq!(
        (
            stats.pages,
            stats.home.shared_grants + stats.home.exclusive_grants
        ),
        (0, 0),
        "the home served the refused node"
    );

    let within = node(&server, &key, LIMIT_MS.into());
    within.modify(gpa, |p| *p = page_for(gpa, 4)).unwrap();
    assert!(within.read(gpa).unwrap() == page_for(gpa, 4));
    // The refused node asks again, and is refused again: nothing it
    // asked for before got through meanwhile.
    assert!(matches!(slow.read(gpa), Err(TransportError::Config(_))));
    assert!(within.read(gpa).unwrap() == page_for(gpa, 4));
}

/// A coherent node without a bound (0: the kernel's defaults, which keep
/// a silent home's connection forever) cannot even ask: nothing is dialed.
#[test]
fn a_node_without_a_bound_is_refused_before_it_connects() {
    let (server, key) = home();
    let gpa = GPA_BASE;
    let unbound = node(&server, &key, 0);
    // The manager's own data connection is handshaken by now.
    let connections = server.stats().handshaken_connections;
    match unbound.read(gpa) {
        Err(TransportError::Config(why)) => {
            assert!(why.contains("dead_home_timeout_ms"), "{why}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    assert_eq!(server.stats().handshaken_connections, connections);
    assert_eq!(server.coherence_stats().pages, 0);
}

/// Hand-made clients that skip the library's own check: one that declares
/// no bound and one that declares a longer bound than the home's limit send
/// a read request each; both are refused with `NODE_BOUND`, their
/// connections stay open, and a client that declares the limit is served
/// on the same home. The HELLO_ACK gives the limit to whoever declares a
/// bound, and nothing to a client that declares none.
#[test]
fn coherence_requests_from_clients_without_an_acceptable_bound_are_refused() {
    let (server, key) = home();
    let writer = node(&server, &key, LIMIT_MS.into());
    let gpa = GPA_BASE + 5 * PAGE_SIZE as u64;
    writer.modify(gpa, |p| *p = page_for(gpa, 7)).unwrap();
    let read_req = coherence::ToHome::ReadReq { req: 1 };
    let ask = |s: &mut TcpStream| {
        s.write_all(&encode_to_home(gpa - GPA_BASE, &read_req, None, false))
            .unwrap();
        let (h, payload) = read_framed(s);
        decode_to_node(&h, &payload, false)
            .map(|f| match f {
                ToNodeFrame::Refused { status, .. } => Err(status),
                ToNodeFrame::Msg(m) => Ok((m.msg, m.page.map(<[u8]>::to_vec))),
            })
            .expect("a well-formed answer")
    };
    let client = |client_id, bound_ms: Option<u32>| {
        let mut s = TcpStream::connect(server.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let auth = AuthRequest {
            node_bound_ms: bound_ms.and_then(NonZeroU32::new),
            ..AuthRequest::default()
        };
        let ack =
            raw::handshake_with(&mut s, client_id, HOME, Some(&key), auth).expect("handshake");
        let told = ack.node_bound_limit_ms.map(NonZeroU32::get);
        assert_eq!(
            told,
            bound_ms.map(|_| LIMIT_MS),
            "the limit in the HELLO_ACK"
        );
        s
    };

    let refused_before = server.coherence_stats().refused_frames;
    let mut unbound = client(81, None);
    let mut longer = client(82, Some(LIMIT_MS + 1));
    for (name, s) in [("no bound", &mut unbound), ("a longer bound", &mut longer)] {
        for _ in 0..2 {
            match ask(s) {
                Err(Status::NodeBound) => {}
                other => panic!(
                    "a client with {name}: expected NODE_BOUND, got {:?}",
                    other.map(|(msg, _)| msg)
                ),
            }
        }
    }
    assert_eq!(server.coherence_stats().refused_frames, refused_before + 4);

    let mut within = client(83, Some(LIMIT_MS));
    match ask(&mut within) {
        Ok((coherence::ToNode::Grant { req: 1, .. }, page)) => {
            assert!(
                page.as_deref() == Some(&page_for(gpa, 7)[..]),
                "the granted page"
            );
        }
        other => panic!("expected the grant, got {:?}", other.map(|(msg, _)| msg)),
    }
    // The refused clients were never nodes: the writer takes the page
    // back from the one reader only, at once.
    drop(within);
    writer.modify(gpa, |p| *p = page_for(gpa, 8)).unwrap();
    assert!(writer.read(gpa).unwrap() == page_for(gpa, 8));
}

/// A page-server refuses to start with no bound for its nodes.
#[test]
fn a_home_without_a_limit_does_not_start() {
    let mut cfg = ServerConfig::new(HOME, NODE_BYTES);
    cfg.node_dead_home_timeout = Duration::ZERO;
    match page_server::spawn(cfg) {
        Err(page_server::ServerError::Config(why)) => {
            assert!(why.contains("node_dead_home_timeout"), "{why}");
        }
        Err(other) => panic!("expected a configuration error, got {other}"),
        Ok(_) => panic!("a page-server started with no bound for its nodes"),
    }
}
