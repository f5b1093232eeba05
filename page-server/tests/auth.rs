//! Only cluster members touch guest memory: page-servers and clients prove
//! the cluster key to each other before any page moves. Each test forges,
//! squats or omits the key for real, over loopback.

mod common;

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::raw;
use common::*;
use page_server::{RunningServer, ServerConfig};
use rdma_transport::auth::ClusterKey;
use rdma_transport::wire::{Header, Opcode};
use rdma_transport::{ManagerConfig, TransportError, TransportKind, TransportManager, PAGE_SIZE};

fn key() -> ClusterKey {
    ClusterKey::generate().expect("a key")
}

fn server(
    url: Option<&str>,
    node: &str,
    listen: SocketAddr,
    key: Option<ClusterKey>,
) -> RunningServer {
    let mut cfg = ServerConfig::new(node, NODE_BYTES);
    cfg.listen = listen;
    cfg.coordinator_url = url.map(str::to_owned);
    cfg.cluster_key = key;
    let s = page_server::spawn(cfg).expect("page-server starts");
    if url.is_some() {
        s.wait_registered(Duration::from_secs(10))
            .expect("page-server registers");
    }
    s
}

fn client(url: &str, key: Option<ClusterKey>) -> TransportManager {
    TransportManager::connect(ManagerConfig {
        coordinator_url: url.to_owned(),
        cluster_key: key,
        transport: TransportKind::Tcp,
        poller_cpus: Some(vec![]),
        request_timeout_ms: 2000,
        ..ManagerConfig::default()
    })
    .expect("manager connects")
}

fn any_loopback_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s
}

/// Nothing but EOF (or a reset) comes from the server any more.
fn closed(s: &mut TcpStream) -> bool {
    use std::io::Read;
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => rest.is_empty(),
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn members_move_pages_and_everyone_else_gets_nothing() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(&db.path().join("c.db"), any_loopback_port());
    let k = key();
    let a = server(
        Some(&coord.url()),
        "a",
        any_loopback_port(),
        Some(k.clone()),
    );

    // A member writes and reads back.
    let member = client(&coord.url(), Some(k.clone()));
    for i in 0..8u64 {
        let gpa = i * PAGE_SIZE as u64;
        member.write_page(gpa, &page_for(gpa, 1)).unwrap();
    }
    let mut page = [0u8; PAGE_SIZE];
    for i in 0..8u64 {
        let gpa = i * PAGE_SIZE as u64;
        member.read_page(gpa, &mut page).unwrap();
        assert!(page == page_for(gpa, 1), "page {i}");
    }

    // By hand: no proof, a proof with another key, a proof for another
    // node id: each connection is closed right after AUTH, no HELLO_ACK.
    let other = key();
    for (what, proof_key, node) in [
        ("no key", None, "a"),
        ("another key", Some(&other), "a"),
        ("the key, for another node", Some(&k), "b"),
    ] {
        let mut s = connect(a.addr());
        assert!(
            raw::handshake(&mut s, 9, node, proof_key).is_none(),
            "{what}: the server accepted the proof"
        );
        assert!(closed(&mut s), "{what}: the connection stayed open");
    }
    assert_eq!(a.auth_failures(), 3);
    // A page request before the handshake, or right after HELLO, gets no
    // page: the connection closes.
    for hello_first in [false, true] {
        let mut s = connect(a.addr());
        if hello_first {
            raw::hello(&mut s, 10);
        }
        use std::io::Write;
        s.write_all(&Header::request(Opcode::Read, 1, 0, PAGE_SIZE as u32).encode())
            .unwrap();
        assert!(closed(&mut s), "a READ before AUTH was answered");
    }
    // The right proof by hand works, so the refusals above were about the key.
    let mut s = connect(a.addr());
    let ack = raw::handshake(&mut s, 11, "a", Some(&k)).expect("a member is accepted");
    assert_eq!(ack.region_size_bytes, NODE_BYTES as u64);

    // Managers without the key or with another one: AuthFailed, no page.
    for (what, wrong) in [("no key", None), ("another key", Some(other))] {
        let outsider = client(&coord.url(), wrong);
        let mut page = [0x77u8; PAGE_SIZE];
        let err = outsider.read_page(0, &mut page).unwrap_err();
        assert!(
            matches!(err, TransportError::AuthFailed { ref node, .. } if node == "a"),
            "{what}: {err:?}"
        );
        assert!(page.iter().all(|&b| b == 0x77), "{what}: a page arrived");
        let err = outsider.write_page(0, &page_for(0, 9)).unwrap_err();
        assert!(
            matches!(err, TransportError::AuthFailed { .. }),
            "{what}: {err:?}"
        );
    }
    // Nothing the outsiders sent reached memory.
    member.read_page(0, &mut page).unwrap();
    assert!(page == page_for(0, 1));
}

/// A process that binds a killed page-server's port (with another key, or
/// with none) is refused by every client: no page is ever read from it and
/// none is written to it.
#[test]
fn a_squatter_on_a_killed_servers_port_is_never_used() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(&db.path().join("c.db"), any_loopback_port());
    let k = key();
    let a = server(
        Some(&coord.url()),
        "a",
        any_loopback_port(),
        Some(k.clone()),
    );
    let port = a.addr();
    let mgr = client(&coord.url(), Some(k));
    let gpa = 3 * PAGE_SIZE as u64;
    mgr.write_page(gpa, &page_for(gpa, 4)).unwrap();
    a.shutdown();

    for squatter_key in [Some(key()), None] {
        // No registration: the map still sends clients to the old port.
        let squatter = server(None, "a", port, squatter_key.clone());
        assert_eq!(squatter.addr(), port);
        let mut saw_auth_failed = false;
        let mut served = Vec::new();
        assert!(
            wait_until(Duration::from_secs(10), || {
                let mut page = [0u8; PAGE_SIZE];
                match mgr.read_page(gpa, &mut page) {
                    Ok(()) => served.push(page[0]),
                    Err(TransportError::AuthFailed { .. }) => saw_auth_failed = true,
                    Err(_) => {}
                }
                saw_auth_failed
            }),
            "the manager never reached the squatter"
        );
        assert!(served.is_empty(), "pages read from a squatter: {served:?}");
        assert!(mgr.write_page(gpa, &page_for(gpa, 5)).is_err());
        let mut raw_page = [0u8; PAGE_SIZE];
        // The squatter's memory is untouched (all zeros): nothing was written.
        let mut s = connect(port);
        raw::handshake(&mut s, 12, "a", squatter_key.as_ref()).expect("its own key works");
        use std::io::{Read, Write};
        s.write_all(&Header::request(Opcode::Read, 1, gpa, PAGE_SIZE as u32).encode())
            .unwrap();
        let (h, payload) = raw::read_framed(&mut s);
        assert_eq!(h.payload_len(), PAGE_SIZE);
        raw_page.copy_from_slice(&payload);
        assert!(
            raw_page.iter().all(|&b| b == 0),
            "a client wrote to a squatter"
        );
        let _ = s.read(&mut [0u8; 1]);
        squatter.shutdown();
    }
}
