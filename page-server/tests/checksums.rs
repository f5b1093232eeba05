//! Page checksums at the page-server: negotiated in the handshake, a WRITE
//! whose page fails its checksum is refused (BadChecksum) and not applied
//! while the connection keeps serving, READ answers carry the checksum of
//! the bytes they send; and managers round-trip pages with checksums on or
//! off against servers that offer them or not.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::raw::{self, read_framed};
use common::*;
use page_server::ServerConfig;
use rdma_transport::wire::{page_checksum, Header, Opcode, Status};
use rdma_transport::{ManagerConfig, TransportManager, PAGE_SIZE};

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn write(s: &mut TcpStream, id: u64, offset: u64, page: &[u8], checksum: u32) -> Status {
    let header =
        Header::request(Opcode::Write, id, offset, PAGE_SIZE as u32).with_checksum(checksum);
    let mut msg = header.encode().to_vec();
    msg.extend_from_slice(page);
    s.write_all(&msg).unwrap();
    let (h, _) = read_framed(s);
    assert_eq!((h.opcode, h.request_id), (Opcode::WriteResp, id));
    h.status
}

/// READ at `offset`: the answer's header and page.
fn read(s: &mut TcpStream, id: u64, offset: u64) -> (Header, Vec<u8>) {
    let header = Header::request(Opcode::Read, id, offset, PAGE_SIZE as u32);
    s.write_all(&header.encode()).unwrap();
    let (h, page) = read_framed(s);
    assert_eq!(
        (h.opcode, h.status, h.request_id),
        (Opcode::ReadResp, Status::Ok, id)
    );
    (h, page)
}

#[test]
fn a_write_with_a_wrong_checksum_is_refused_and_not_applied() {
    let server = page_server::spawn(ServerConfig::new("c", NODE_BYTES)).unwrap();
    let mut s = connect(server.addr());
    let ack = raw::handshake_asking(&mut s, 1, "c", None, true).expect("handshake");
    assert!(
        ack.checksums,
        "a page-server agrees to checksums by default"
    );

    let good = page_for(0x3000, 1);
    assert_eq!(
        write(&mut s, 10, 0x3000, &good, page_checksum(&good)),
        Status::Ok
    );
    let (h, page) = read(&mut s, 11, 0x3000);
    assert_eq!(page, good);
    assert_eq!(
        h.checksum,
        page_checksum(&good),
        "READ answers carry the checksum"
    );

    // The same header checksum, one bit of the page flipped on the way.
    let mut corrupted = page_for(0x3000, 2);
    let claimed = page_checksum(&corrupted);
    corrupted[100] ^= 1;
    assert_eq!(
        write(&mut s, 12, 0x3000, &corrupted, claimed),
        Status::BadChecksum
    );
    // A zero checksum is not "no checksum" once negotiated.
    assert_eq!(
        write(&mut s, 13, 0x3000, &corrupted, 0),
        Status::BadChecksum
    );
    // The connection keeps serving, and the page is unchanged.
    let (_, page) = read(&mut s, 14, 0x3000);
    assert_eq!(page, good, "a WRITE that failed its checksum was applied");
}

#[test]
fn without_an_agreement_bytes_28_to_32_are_ignored() {
    for (offered, asked) in [(false, true), (true, false)] {
        let mut cfg = ServerConfig::new("c", NODE_BYTES);
        cfg.page_checksums = offered;
        let server = page_server::spawn(cfg).unwrap();
        let mut s = connect(server.addr());
        let ack = raw::handshake_asking(&mut s, 1, "c", None, asked).expect("handshake");
        assert!(!ack.checksums, "offered {offered}, asked {asked}");
        let page = page_for(0x5000, 3);
        assert_eq!(write(&mut s, 20, 0x5000, &page, 0xdead_beef), Status::Ok);
        let (h, back) = read(&mut s, 21, 0x5000);
        assert_eq!(back, page);
        assert_eq!(h.checksum, 0, "no checksum without an agreement");
    }
}

#[test]
fn pages_round_trip_with_checksums_on_and_off() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(&db.path().join("coord.db"), "127.0.0.1:0".parse().unwrap());
    let _a = page_server(&coord.url(), "a", 0);
    let mut cfg = ServerConfig::new("b", NODE_BYTES);
    cfg.gpa_base = NODE_BYTES as u64;
    cfg.page_checksums = false;
    let _b = page_server_with(&coord.url(), cfg);
    for page_checksums in [true, false] {
        let mgr = TransportManager::connect(ManagerConfig {
            coordinator_url: coord.url(),
            request_timeout_ms: 2000,
            connect_timeout_ms: 2000,
            poller_cpus: Some(vec![]),
            page_checksums,
            ..ManagerConfig::default()
        })
        .expect("manager connects");
        round_trip_all_pages(&mgr, 2, 7, 3);
    }
}
