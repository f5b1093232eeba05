//! Hostile and malformed input to the page-server and the coordinator: each
//! gets a clear answer or a closed connection, and good clients keep being
//! served.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::raw::{self, read_framed};
use common::*;
use rdma_transport::wire::{Header, HelloAck, Opcode, Status, HEADER_LEN};
use rdma_transport::PAGE_SIZE;

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn hello(s: &mut TcpStream) -> HelloAck {
    raw::handshake(s, 1, "g", None).expect("an insecure server accepts the handshake")
}

fn read_header(s: &mut TcpStream) -> Header {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).unwrap();
    Header::decode(&b).unwrap()
}

fn assert_closed(s: &mut TcpStream) {
    let mut rest = Vec::new();
    let n = s.read_to_end(&mut rest).unwrap_or(0);
    assert_eq!(
        n, 0,
        "server should close after a broken frame, sent {n} more bytes"
    );
}

#[test]
fn page_server_answers_malformed_requests_and_keeps_serving() {
    let server = page_server::spawn(page_server::ServerConfig::new("g", NODE_BYTES)).unwrap();
    let addr = server.addr();

    // READ before the handshake: no answer at all, the connection closes.
    let mut early = connect(addr);
    early
        .write_all(&Header::request(Opcode::Read, 5, 0, PAGE_SIZE as u32).encode())
        .unwrap();
    assert_closed(&mut early);
    // Same after HELLO, before AUTH.
    let mut early = connect(addr);
    raw::hello(&mut early, 4);
    early
        .write_all(&Header::request(Opcode::Read, 5, 0, PAGE_SIZE as u32).encode())
        .unwrap();
    assert_closed(&mut early);
    let mut s = connect(addr);
    let ack = hello(&mut s);
    assert_eq!(ack.region_size_bytes, NODE_BYTES as u64);

    // Out of range, unaligned, wrong length, past the end with overflow.
    for (offset, length, status) in [
        (NODE_BYTES as u64, PAGE_SIZE as u32, Status::OutOfRange),
        (u64::MAX - 4095, PAGE_SIZE as u32, Status::OutOfRange),
        (100, PAGE_SIZE as u32, Status::Unaligned),
        (0, 100, Status::BadLength),
        (0, u32::MAX, Status::BadLength),
    ] {
        s.write_all(&Header::request(Opcode::Read, 6, offset, length).encode())
            .unwrap();
        let h = read_header(&mut s);
        assert_eq!(
            (h.status, h.payload_len()),
            (status, 0),
            "offset {offset:#x} length {length}"
        );
    }
    // A WRITE past the end: its payload is consumed, refused, framing intact.
    s.write_all(&Header::request(Opcode::Write, 7, NODE_BYTES as u64, PAGE_SIZE as u32).encode())
        .unwrap();
    s.write_all(&[0xaa; PAGE_SIZE]).unwrap();
    assert_eq!(read_header(&mut s).status, Status::OutOfRange);
    // A client sending a response opcode is told so.
    s.write_all(&Header::request(Opcode::WriteResp, 8, 0, 0).encode())
        .unwrap();
    assert_eq!(read_header(&mut s).status, Status::BadOpcode);
    // And a good request on the same connection works.
    s.write_all(&Header::request(Opcode::Write, 9, 0, PAGE_SIZE as u32).encode())
        .unwrap();
    s.write_all(&[0x5a; PAGE_SIZE]).unwrap();
    assert_eq!(read_header(&mut s).status, Status::Ok);

    // Wrong magic: error answer, then the connection is closed.
    let mut bad = connect(addr);
    let mut frame = Header::request(Opcode::Read, 1, 0, PAGE_SIZE as u32).encode();
    frame[0] = b'X';
    bad.write_all(&frame).unwrap();
    let h = read_header(&mut bad);
    assert_eq!((h.opcode, h.status), (Opcode::Error, Status::BadMagic));
    assert_closed(&mut bad);

    // Huge payload length on a WRITE: refused and closed (cannot skip it).
    let mut bad = connect(addr);
    hello(&mut bad);
    bad.write_all(&Header::request(Opcode::Write, 2, 0, 1 << 30).encode())
        .unwrap();
    let h = read_header(&mut bad);
    assert_eq!((h.opcode, h.status), (Opcode::Error, Status::BadLength));
    assert_closed(&mut bad);

    // Unknown opcode and version.
    for (at, val, status) in [
        (5usize, 99u8, Status::BadOpcode),
        (4, 9, Status::BadVersion),
    ] {
        let mut bad = connect(addr);
        let mut frame = Header::request(Opcode::Read, 1, 0, PAGE_SIZE as u32).encode();
        frame[at] = val;
        bad.write_all(&frame).unwrap();
        assert_eq!(read_header(&mut bad).status, status);
        assert_closed(&mut bad);
    }

    // Truncated header then hang-up; random garbage; a stalled half message.
    let mut t = connect(addr);
    t.write_all(&frame[..10]).unwrap();
    drop(t);
    let mut g = connect(addr);
    let _ = g.write_all(&[0xff; 5000]);
    drop(g);
    let mut stalled = connect(addr);
    hello(&mut stalled);
    stalled
        .write_all(&Header::request(Opcode::Write, 3, 0, PAGE_SIZE as u32).encode()[..20])
        .unwrap();

    // The first client, still connected, is served while the stalled one waits.
    s.write_all(&Header::request(Opcode::Read, 10, 0, PAGE_SIZE as u32).encode())
        .unwrap();
    let h = read_header(&mut s);
    assert_eq!((h.status, h.payload_len()), (Status::Ok, PAGE_SIZE));
    let mut page = [0u8; PAGE_SIZE];
    s.read_exact(&mut page).unwrap();
    assert!(page.iter().all(|&b| b == 0x5a));
    drop(stalled);
    server.shutdown();
}

/// A refused HELLO is answered (CHALLENGE with BAD_LENGTH) so that the
/// documented framing holds (it promises no payload it does not send): a
/// client reading by the framing finds the next answer right after it, and
/// the connection stays usable.
#[test]
fn a_refused_hello_keeps_the_framing() {
    let server = page_server::spawn(page_server::ServerConfig::new("h", NODE_BYTES)).unwrap();
    let good = raw::hello_payload(2);
    let mut unknown_flags = good.clone();
    unknown_flags[0] = 1;
    let mut too_long = good.clone();
    too_long.extend_from_slice(&[0u8; 48]);
    for (what, bad) in [
        ("5 bytes", vec![0x5au8; 5]),
        ("unknown flags", unknown_flags),
        ("too long", too_long),
    ] {
        let mut s = connect(server.addr());
        // The bad HELLO and a good one in one write: the second answer must
        // start right where the first one ends.
        let mut msg = Header::request(Opcode::Hello, 1, 0, bad.len() as u32)
            .encode()
            .to_vec();
        msg.extend_from_slice(&bad);
        msg.extend_from_slice(&Header::request(Opcode::Hello, 2, 0, good.len() as u32).encode());
        msg.extend_from_slice(&good);
        s.write_all(&msg).unwrap();
        let (h, payload) = read_framed(&mut s);
        assert_eq!(
            (h.opcode, h.status, h.request_id, payload.len()),
            (Opcode::Challenge, Status::BadLength, 1, 0),
            "{what}"
        );
        let (h, payload) = read_framed(&mut s);
        assert_eq!(
            (h.opcode, h.status, h.request_id),
            (Opcode::Challenge, Status::Ok, 2),
            "{what}"
        );
        let challenge =
            rdma_transport::wire::Challenge::decode(&payload).expect("a full CHALLENGE payload");
        assert!(challenge.proof.is_none(), "{what}: a server without a key");
        raw::send(
            &mut s,
            Opcode::Auth,
            3,
            &rdma_transport::wire::AuthRequest {
                proof: None,
                rdma: None,
                checksums: false,
                bound_sums: false,
                coherence: false,
                node_bound_ms: None,
            }
            .encode(),
        );
        let (h, payload) = read_framed(&mut s);
        assert_eq!(
            (h.opcode, h.status),
            (Opcode::HelloAck, Status::Ok),
            "{what}"
        );
        let ack = HelloAck::decode(&payload).expect("a full HELLO_ACK payload");
        assert_eq!(ack.region_size_bytes, NODE_BYTES as u64, "{what}");
        // Still framed: a READ is answered with its page, and after the
        // client hangs up, the server closes (nothing else follows).
        s.write_all(&Header::request(Opcode::Read, 3, 0, PAGE_SIZE as u32).encode())
            .unwrap();
        let (h, payload) = read_framed(&mut s);
        assert_eq!(
            (h.opcode, h.status, h.request_id, payload.len()),
            (Opcode::ReadResp, Status::Ok, 3, PAGE_SIZE),
            "{what}"
        );
        s.shutdown(std::net::Shutdown::Write).unwrap();
        assert_closed(&mut s);
    }
    server.shutdown();
}

/// Many short connections, ended by the server (garbage) or by the client:
/// every client sees EOF within the bound, and afterwards no connection is
/// counted as served (the server keeps no duplicate of a closed socket).
#[test]
fn every_ended_connection_is_closed_and_forgotten() {
    const THREADS: usize = 4;
    const CONNECTIONS_PER_THREAD: usize = 250;
    let server = page_server::spawn(page_server::ServerConfig::new("e", NODE_BYTES)).unwrap();
    let addr = server.addr();
    let hello_body = raw::hello_payload(3);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let hello_body = &hello_body;
            scope.spawn(move || {
                for i in 0..CONNECTIONS_PER_THREAD {
                    let mut s = connect(addr);
                    if (t + i) % 2 == 0 {
                        // Garbage: the server answers ERROR and closes.
                        let mut frame = Header::request(Opcode::Read, 1, 0, 0).encode();
                        frame[0] = b'X';
                        s.write_all(&frame).unwrap();
                        let (h, _) = read_framed(&mut s);
                        assert_eq!(h.status, Status::BadMagic);
                    } else {
                        // A good HELLO, then the client hangs up its side.
                        let mut msg = Header::request(Opcode::Hello, 1, 0, hello_body.len() as u32)
                            .encode()
                            .to_vec();
                        msg.extend_from_slice(hello_body);
                        s.write_all(&msg).unwrap();
                        let (h, _) = read_framed(&mut s);
                        assert_eq!(h.status, Status::Ok);
                        s.shutdown(std::net::Shutdown::Write).unwrap();
                    }
                    // EOF within the read timeout (5 s), not a timeout error.
                    let mut rest = Vec::new();
                    match s.read_to_end(&mut rest) {
                        Ok(_) => assert!(rest.is_empty(), "{} stray bytes", rest.len()),
                        Err(err) => panic!("thread {t} connection {i}: no EOF: {err}"),
                    }
                }
            });
        }
    });
    // A connection's record goes before its socket closes, so every client
    // having seen EOF means none is counted any more.
    assert_eq!(server.active_connections(), 0);
    server.shutdown();
}

#[test]
fn coordinator_survives_garbage_and_keeps_serving() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    for junk in [
        &b"\x00\x01\x02garbage\r\n\r\n"[..],
        b"GET /v1/map HTTP/9.9\r\n\r\n",
        &[0xffu8; 70_000][..],
    ] {
        let mut s = TcpStream::connect(coord.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.write_all(junk);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    let client = coordinator_client(&coord.url());
    client.health().expect("coordinator still answers");
    let _a = page_server(&coord.url(), "a", 0);
    assert_eq!(client.map().unwrap().entries.len(), 1);
}
