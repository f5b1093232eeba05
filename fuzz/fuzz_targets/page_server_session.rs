//! A real page-server (in this process, on loopback) fed any bytes on a
//! connection: it never panics or hangs, every message it sends has a
//! well-formed header (docs/wire-protocol.md), a server with a cluster key
//! never answers a READ or WRITE with OK to a client that did not prove the
//! key, and a good client is served after every input.
//!
//! The input's first byte picks the session: 0, raw bytes to the keyed
//! server; 1, raw bytes to the open server; 2 and 3, two connections to the
//! open server after good handshakes (3 with page checksums and
//! offset-bound sums), then operations (see [`Op`]) that the harness
//! encodes with the library's own encoders, so that sums are right unless
//! the input asks otherwise: reads, writes and coherence messages from two
//! nodes, with raw bytes between them. (The byte's two low bits pick; with
//! bit 2 set, the second connection declares no node bound, so that its
//! coherence messages are refused.)

#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use page_server::{RunningServer, ServerConfig};
use rdma_transport::auth::{ClusterKey, Role, Transcript};
use rdma_transport::wire::{
    encode_to_home, page_checksum, write_checksum, AuthRequest, Challenge, Header, HelloRequest,
    Opcode, Status, HEADER_LEN, MAX_PAYLOAD_BYTES, VERSION,
};
use rdma_transport::{Page, PAGE_SIZE};
use rdma_transport_fuzz::to_home;

const MEMORY_BYTES: usize = 16 * PAGE_SIZE;

struct Servers {
    keyed: RunningServer,
    key: ClusterKey,
    open: RunningServer,
}

fn servers() -> &'static Servers {
    static SERVERS: OnceLock<Servers> = OnceLock::new();
    SERVERS.get_or_init(|| {
        let start = |key: Option<ClusterKey>| {
            let mut config = ServerConfig::new("fuzz", MEMORY_BYTES);
            config.listen = "127.0.0.1:0".parse().expect("an address");
            config.cluster_key = key;
            config.page_checksums = true;
            page_server::spawn(config).expect("a page-server on loopback")
        };
        let key = ClusterKey::generate().expect("a key");
        Servers {
            keyed: start(Some(key.clone())),
            key,
            open: start(None),
        }
    })
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("the page-server accepts");
    // A server that neither answers nor closes within this is hung.
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("a timeout");
    s
}

fn send(s: &mut TcpStream, opcode: Opcode, payload: &[u8]) {
    let mut msg = Header::request(opcode, 1, 0, payload.len() as u32)
        .encode()
        .to_vec();
    msg.extend_from_slice(payload);
    s.write_all(&msg).expect("send");
}

/// Reads one message; `None` at the end of the stream, a message cut short
/// by it included.
fn read_message(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
    let mut head = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match s.read(&mut head[got..]) {
            // The coherence home may shut a node's connection down from
            // another thread (a write-back it refuses) in the middle of a
            // message the connection's own thread is sending: a message cut
            // short by the end is the end, not a malformed message.
            Ok(0) => return None,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
            Err(e) => panic!("the server neither answers nor closes: {e}"),
        }
    }
    let header = Header::decode(&head).expect("the server sends well-formed headers");
    let mut payload = vec![0u8; header.payload_len()];
    match s.read_exact(&mut payload) {
        Ok(()) => Some((header, payload)),
        // As above; and a server that closes with bytes of ours unread
        // resets the connection, and what it sent last may be lost with it.
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
            ) =>
        {
            None
        }
        Err(e) => panic!("the server neither answers nor closes: {e}"),
    }
}

/// HELLO, CHALLENGE, AUTH (proving `key` when given; declaring a node
/// bound with `node`), HELLO_ACK.
fn handshake(s: &mut TcpStream, key: Option<&ClusterKey>, checksums: bool, node: bool) {
    let hello = HelloRequest {
        client_id: 7,
        nonce: [7; 32],
    };
    send(s, Opcode::Hello, &hello.encode());
    let (h, payload) = read_message(s).expect("a CHALLENGE");
    assert_eq!((h.opcode, h.status), (Opcode::Challenge, Status::Ok));
    let challenge = Challenge::decode(&payload).expect("a valid CHALLENGE");
    let proof = key.map(|key| {
        Transcript {
            version: VERSION,
            client_id: hello.client_id,
            node_id: "fuzz",
            client_nonce: &hello.nonce,
            server_nonce: &challenge.nonce,
            epoch: challenge.epoch,
        }
        .prove(key, Role::Client)
    });
    let auth = AuthRequest {
        proof,
        checksums,
        bound_sums: checksums,
        // A coherence node's bound on the home's silence, within the home's
        // limit, so that coherence messages are served; short, so that a
        // node the home closes is let go soon (`node_exit`). Without one,
        // they are refused (NODE_BOUND).
        node_bound_ms: std::num::NonZeroU32::new(1_000).filter(|_| node),
        ..AuthRequest::default()
    };
    send(s, Opcode::Auth, &auth.encode());
    let (h, _) = read_message(s).expect("a HELLO_ACK");
    assert_eq!((h.opcode, h.status), (Opcode::HelloAck, Status::Ok));
}

/// A good client reads page 0 and gets a whole page.
fn served(addr: SocketAddr, key: Option<&ClusterKey>) {
    let mut s = connect(addr);
    handshake(&mut s, key, false, false);
    s.write_all(&Header::request(Opcode::Read, 9, 0, PAGE_SIZE as u32).encode())
        .expect("send");
    let (h, page) = read_message(&mut s).expect("an answer");
    assert_eq!(
        (h.opcode, h.status, h.request_id, page.len()),
        (Opcode::ReadResp, Status::Ok, 9, PAGE_SIZE)
    );
}

/// One operation of a structured session, 12 bytes: `what` (low 2 bits
/// the kind: 0 READ, 1 WRITE, 2 a coherence message, 3 the other 11 bytes
/// raw; bit 2 the second connection; bit 3 a wrong sum), `page` (an index
/// into the region, or past it), `fill` (the page's bytes), `kind` and
/// `flags` of a coherence message, then a little-endian u56 whose value
/// mod 16 is the request id, sequence number or version (small, so that
/// it meets the home's).
struct Op<'a>(&'a [u8]);

impl Op<'_> {
    fn offset(&self) -> u64 {
        u64::from(self.0[1]) * PAGE_SIZE as u64
    }
    fn value(&self) -> u64 {
        let mut b = [0u8; 8];
        b[..7].copy_from_slice(&self.0[5..12]);
        u64::from_le_bytes(b) % 16
    }
    fn page(&self) -> Box<Page> {
        Box::new([self.0[2]; PAGE_SIZE])
    }
    fn encode(&self, bound_sums: bool) -> Vec<u8> {
        let wrong = u32::from(self.0[0] & 8 != 0);
        match self.0[0] & 3 {
            0 => Header::request(Opcode::Read, self.value(), self.offset(), PAGE_SIZE as u32)
                .encode()
                .to_vec(),
            1 => {
                let page = self.page();
                let sum = write_checksum(page_checksum(&page[..]), self.offset(), bound_sums);
                let mut msg =
                    Header::request(Opcode::Write, self.value(), self.offset(), PAGE_SIZE as u32)
                        .with_checksum(sum ^ wrong)
                        .encode()
                        .to_vec();
                msg.extend_from_slice(&page[..]);
                msg
            }
            2 => {
                let (req, value) = (self.value() as u32, self.value());
                let msg = to_home(
                    self.0[3],
                    req,
                    value,
                    self.0[4] & 1 != 0,
                    self.0[4] & 2 != 0,
                );
                let carries = msg.written_back().is_some();
                let page = carries.then(|| self.page());
                let mut frame = encode_to_home(self.offset(), &msg, page.as_deref(), bound_sums);
                frame[28] ^= wrong as u8;
                frame
            }
            _ => self.0[1..].to_vec(),
        }
    }
}

/// Sends `ops` on two handshaken connections, then reads both to their end.
fn structured(addr: SocketAddr, checksums: bool, second_is_node: bool, ops: &[u8]) {
    let mut conns = [connect(addr), connect(addr)];
    for (s, node) in conns.iter_mut().zip([true, second_is_node]) {
        handshake(s, None, checksums, node);
    }
    for op in ops.chunks_exact(12).map(Op) {
        let s = &mut conns[usize::from(op.0[0] & 4 != 0)];
        // A closed connection is an answer too.
        let _ = s.write_all(&op.encode(checksums));
    }
    for s in &mut conns {
        let _ = s.shutdown(Shutdown::Write);
    }
    for s in &mut conns {
        while let Some((_, payload)) = read_message(s) {
            assert!(payload.len() <= MAX_PAYLOAD_BYTES as usize);
        }
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, rest)) = input.split_first() else {
        return;
    };
    let servers = servers();
    let (addr, key) = match mode % 4 {
        0 => (servers.keyed.addr(), Some(&servers.key)),
        _ => (servers.open.addr(), None),
    };
    if mode % 4 >= 2 {
        structured(addr, mode % 4 == 3, mode & 4 == 0, rest);
        served(addr, None);
        return;
    }
    let keyed = key.is_some();
    let mut s = connect(addr);
    // The server may close before taking everything: that is an answer.
    let _ = s.write_all(rest);
    let _ = s.shutdown(Shutdown::Write);
    while let Some((header, payload)) = read_message(&mut s) {
        assert!(payload.len() <= MAX_PAYLOAD_BYTES as usize);
        if keyed {
            assert!(
                !matches!(header.opcode, Opcode::ReadResp | Opcode::WriteResp)
                    || header.status != Status::Ok,
                "the keyed server answered {header:?} to a client without the key"
            );
        }
    }
    served(addr, key);
});
