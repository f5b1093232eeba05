//! A real page-server (in this process, on loopback) fed any bytes on a
//! connection: it never panics or hangs, everything it sends is well-framed
//! per docs/wire-protocol.md, a server with a cluster key never answers a
//! READ or WRITE to a client that did not prove the key, and a good client
//! is served after every input.
//!
//! The input's first byte picks the session: 0, raw bytes to the keyed
//! server; 1, raw bytes to the open server; 2 and 3, the open server after
//! a good handshake (3 with page checksums and offset-bound sums). The
//! rest is what the client sends next.

#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use page_server::{RunningServer, ServerConfig};
use rdma_transport::auth::{ClusterKey, Role, Transcript};
use rdma_transport::wire::{
    AuthRequest, Challenge, Header, HelloRequest, Opcode, Status, HEADER_LEN, MAX_PAYLOAD_BYTES,
    VERSION,
};
use rdma_transport::PAGE_SIZE;

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

/// Reads one well-framed message; `None` at a clean end of the stream.
fn read_message(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
    let mut head = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match s.read(&mut head[got..]) {
            Ok(0) if got == 0 => return None,
            Ok(0) => panic!("the stream ends inside a header ({got} bytes)"),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
            Err(e) => panic!("the server neither answers nor closes: {e}"),
        }
    }
    let header = Header::decode(&head).expect("the server sends well-formed headers");
    let mut payload = vec![0u8; header.payload_len()];
    s.read_exact(&mut payload)
        .expect("the payload the header promises");
    Some((header, payload))
}

/// HELLO, CHALLENGE, AUTH (proving `key` when given), HELLO_ACK.
fn handshake(s: &mut TcpStream, key: Option<&ClusterKey>, checksums: bool) {
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
        ..AuthRequest::default()
    };
    send(s, Opcode::Auth, &auth.encode());
    let (h, _) = read_message(s).expect("a HELLO_ACK");
    assert_eq!((h.opcode, h.status), (Opcode::HelloAck, Status::Ok));
}

/// A good client reads page 0 and gets a whole page.
fn served(addr: SocketAddr, key: Option<&ClusterKey>) {
    let mut s = connect(addr);
    handshake(&mut s, key, false);
    s.write_all(&Header::request(Opcode::Read, 9, 0, PAGE_SIZE as u32).encode())
        .expect("send");
    let (h, page) = read_message(&mut s).expect("an answer");
    assert_eq!(
        (h.opcode, h.status, h.request_id, page.len()),
        (Opcode::ReadResp, Status::Ok, 9, PAGE_SIZE)
    );
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
    let keyed = key.is_some();
    let mut s = connect(addr);
    if mode % 4 >= 2 {
        handshake(&mut s, None, mode % 4 == 3);
    }
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
