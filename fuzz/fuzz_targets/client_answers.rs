//! A `TransportManager` reading a page from a page-server that answers
//! anything: after a good handshake, the server sends the input's bytes as
//! its answer and closes. The manager never panics, returns within its
//! deadlines, and drops cleanly; a page it returns as read came in an
//! answer to that very request.
//!
//! The input's first byte: bit 0, write the request's own id into the
//! answer's header (so the fuzzer reaches past the id check); bit 1, ask
//! for page checksums. The rest is the answer.

#![no_main]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use rdma_transport::coordinator::api::MapResponse;
use rdma_transport::wire::{AuthRequest, Challenge, Header, HelloAck, Opcode, Status, HEADER_LEN};
use rdma_transport::{ManagerConfig, TransportKind, TransportManager, PAGE_SIZE};

const REGION_BYTES: u64 = 16 * PAGE_SIZE as u64;
const EPOCH: u64 = 5;

fn read_message(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).ok()?;
    let header = Header::decode(&head).ok()?;
    let mut payload = vec![0u8; header.payload_len()];
    s.read_exact(&mut payload).ok()?;
    Some((header, payload))
}

fn answer(s: &mut TcpStream, to: &Header, opcode: Opcode, payload: &[u8]) -> Option<()> {
    let mut h = Header::request(opcode, to.request_id, 0, payload.len() as u32);
    h.status = Status::Ok;
    let mut msg = h.encode().to_vec();
    msg.extend_from_slice(payload);
    s.write_all(&msg).ok()
}

/// The fake page-server: a good handshake, then `reply` to the first
/// request, then the connection closes.
fn serve(listener: &TcpListener, patch_id: bool, reply: &[u8]) -> Option<()> {
    let (mut s, _) = listener.accept().ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let (hello, _) = read_message(&mut s)?;
    let challenge = Challenge {
        epoch: EPOCH,
        nonce: [3; 32],
        proof: None,
    };
    answer(&mut s, &hello, Opcode::Challenge, &challenge.encode())?;
    let (auth_header, auth) = read_message(&mut s)?;
    let auth = AuthRequest::decode(&auth)?;
    let ack = HelloAck {
        region_size_bytes: REGION_BYTES,
        epoch: EPOCH,
        page_size: PAGE_SIZE as u32,
        checksums: auth.checksums,
        bound_sums: auth.bound_sums,
        ..HelloAck::default()
    };
    answer(&mut s, &auth_header, Opcode::HelloAck, &ack.encode())?;
    let (request, _) = read_message(&mut s)?;
    let mut reply = reply.to_vec();
    if patch_id && reply.len() >= 16 {
        reply[8..16].copy_from_slice(&request.request_id.to_le_bytes());
    }
    s.write_all(&reply).ok()
}

fn map(addr: &str) -> MapResponse {
    let json = format!(
        r#"{{"version":1,"generation":1,
            "entries":[{{"gpa_start":0,"length_bytes":{REGION_BYTES},"node_id":"n",
                         "remote_offset":0,"valid_epoch":{EPOCH},"state":"live"}}],
            "nodes":[{{"id":"n","tcp_addr":"{addr}","alive":true,"last_seen_ms_ago":0,"epoch":{EPOCH}}}]}}"#
    );
    serde_json::from_str(&json).expect("a map")
}

fuzz_target!(|input: &[u8]| {
    let Some((&flags, reply)) = input.split_first() else {
        return;
    };
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
    let addr = listener.local_addr().expect("its address").to_string();
    let reply = reply.to_vec();
    let server = thread::spawn(move || {
        let _ = serve(&listener, flags & 1 != 0, &reply);
    });
    let manager = TransportManager::from_map(
        ManagerConfig {
            transport: TransportKind::Tcp,
            request_timeout_ms: 300,
            connect_timeout_ms: 300,
            poller_cpus: Some(vec![]),
            map_refresh_ms: 0,
            page_checksums: flags & 2 != 0,
            ..ManagerConfig::default()
        },
        map(&addr),
    )
    .expect("a manager over a fixed map");
    let started = Instant::now();
    let mut page = [0xa5u8; PAGE_SIZE];
    let result = manager.read_page(0, &mut page);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "read_page took {took:?}: {result:?}"
    );
    if result.is_ok() {
        // Only an OK READ_RESP with a whole page may complete the read.
        let delivered = input[1..].windows(PAGE_SIZE).any(|w| w == page);
        assert!(
            delivered,
            "a page the server never sent was returned as read"
        );
    }
    drop(manager);
    // Whether or not the manager connected, one more connection ends the
    // fake server's accept.
    let _ = TcpStream::connect(&addr);
    server.join().expect("the fake server ends");
});
