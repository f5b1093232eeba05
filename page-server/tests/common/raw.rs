//! The handshake spoken by hand over a plain socket, for tests that need to
//! send what a real client never would.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::num::NonZeroU32;

use rdma_transport::auth::{ClusterKey, Role, Transcript};
use rdma_transport::wire::{
    AuthRequest, Challenge, Header, HelloAck, HelloRequest, Opcode, Status, HEADER_LEN, VERSION,
};

/// The bound on a home's silence these hand-made clients declare as
/// coherence nodes (`AuthRequest::node_bound_ms`): what a node must drop
/// its copies within. A home waits `left_for_sure_within` it (4 s) before
/// it gives the pages of such a node, lost to silence or closed by the
/// home, to others.
pub const RAW_NODE_BOUND_MS: u32 = 1_000;

/// [`RAW_NODE_BOUND_MS`] as declared.
pub fn raw_node_bound() -> Option<NonZeroU32> {
    NonZeroU32::new(RAW_NODE_BOUND_MS)
}

/// Sends one message with `payload`.
pub fn send(s: &mut TcpStream, opcode: Opcode, request_id: u64, payload: &[u8]) {
    let mut msg = Header::request(opcode, request_id, 0, payload.len() as u32)
        .encode()
        .to_vec();
    msg.extend_from_slice(payload);
    s.write_all(&msg).expect("send");
}

/// Reads one message strictly by the framing of docs/wire-protocol.md: the
/// 32-byte header, then exactly `length` payload bytes for the handshake
/// messages, WRITE and the coherence messages, and for READ_RESP with
/// status OK; nothing for the others.
pub fn read_framed(s: &mut TcpStream) -> (Header, Vec<u8>) {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).expect("a header");
    let h = Header::decode(&b).expect("a well-formed header");
    let carries = match h.opcode {
        Opcode::Hello
        | Opcode::Challenge
        | Opcode::Auth
        | Opcode::HelloAck
        | Opcode::Write
        | Opcode::CohToHome
        | Opcode::CohToNode => true,
        Opcode::ReadResp => h.status == Status::Ok,
        _ => false,
    };
    let mut payload = vec![0u8; if carries { h.length as usize } else { 0 }];
    s.read_exact(&mut payload)
        .expect("the payload the header promises");
    (h, payload)
}

/// A HELLO payload with a fixed nonce.
pub fn hello_payload(client_id: u64) -> Vec<u8> {
    HelloRequest {
        client_id,
        nonce: [client_id as u8; 32],
    }
    .encode()
}

/// HELLO and its CHALLENGE.
pub fn hello(s: &mut TcpStream, client_id: u64) -> Challenge {
    send(s, Opcode::Hello, 1, &hello_payload(client_id));
    let (h, payload) = read_framed(s);
    assert_eq!((h.opcode, h.status), (Opcode::Challenge, Status::Ok));
    Challenge::decode(&payload).expect("a valid CHALLENGE")
}

/// The whole handshake as client `client_id` of node `node_id`, proving
/// `key` (`None`: no proof). Returns the HELLO_ACK, or `None` when the
/// server closed the connection instead.
pub fn handshake(
    s: &mut TcpStream,
    client_id: u64,
    node_id: &str,
    key: Option<&ClusterKey>,
) -> Option<HelloAck> {
    handshake_asking(s, client_id, node_id, key, false)
}

/// As [`handshake`]; `checksums`: ask for page checksums in the AUTH.
pub fn handshake_asking(
    s: &mut TcpStream,
    client_id: u64,
    node_id: &str,
    key: Option<&ClusterKey>,
    checksums: bool,
) -> Option<HelloAck> {
    handshake_offering(s, client_id, node_id, key, checksums, None, false)
}

/// As [`handshake_asking`], offering the RDMA endpoint `rdma` and, with
/// `coherence`, asking for a coherence channel (`rdma`'s address and key
/// then name the client's message ring).
pub fn handshake_offering(
    s: &mut TcpStream,
    client_id: u64,
    node_id: &str,
    key: Option<&ClusterKey>,
    checksums: bool,
    rdma: Option<rdma_transport::wire::RdmaHello>,
    coherence: bool,
) -> Option<HelloAck> {
    let request = AuthRequest {
        proof: None,
        rdma,
        checksums,
        // As a client from before offset-bound WRITE sums.
        bound_sums: false,
        coherence,
        node_bound_ms: raw_node_bound(),
    };
    handshake_with(s, client_id, node_id, key, request)
}

/// As [`handshake_asking`] with checksums, also asking for offset-bound
/// WRITE checksums (`rdma_transport::wire::offset_bound_checksum`).
pub fn handshake_bound_sums(
    s: &mut TcpStream,
    client_id: u64,
    node_id: &str,
    key: Option<&ClusterKey>,
) -> Option<HelloAck> {
    let request = AuthRequest {
        checksums: true,
        bound_sums: true,
        node_bound_ms: raw_node_bound(),
        ..AuthRequest::default()
    };
    handshake_with(s, client_id, node_id, key, request)
}

/// The handshake sending `request` as the AUTH, with the proof of `key`.
pub fn handshake_with(
    s: &mut TcpStream,
    client_id: u64,
    node_id: &str,
    key: Option<&ClusterKey>,
    request: AuthRequest,
) -> Option<HelloAck> {
    let challenge = hello(s, client_id);
    let proof = key.map(|key| {
        Transcript {
            version: VERSION,
            client_id,
            node_id,
            client_nonce: &[client_id as u8; 32],
            server_nonce: &challenge.nonce,
            epoch: challenge.epoch,
        }
        .prove(key, Role::Client)
    });
    send(
        s,
        Opcode::Auth,
        2,
        &AuthRequest { proof, ..request }.encode(),
    );
    let mut b = [0u8; HEADER_LEN];
    if s.read_exact(&mut b).is_err() {
        return None;
    }
    let h = Header::decode(&b).expect("a well-formed header");
    assert_eq!((h.opcode, h.status), (Opcode::HelloAck, Status::Ok));
    let mut payload = vec![0u8; h.payload_len()];
    s.read_exact(&mut payload).expect("HELLO_ACK payload");
    Some(HelloAck::decode(&payload).expect("a valid HELLO_ACK"))
}
