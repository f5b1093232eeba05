//! A `TransportManager` reading from a page-server that answers anything:
//! after a good handshake the server takes the read requests, sends the
//! input's bytes as its answers and closes. The manager never panics,
//! returns within its deadlines and drops cleanly; a page it returns as
//! read came in an OK READ_RESP for that very page's offset (no page is
//! ever delivered into another request's buffer).
//!
//! The input's first byte: bit 0, write the requests' own ids and offsets
//! into the answers' headers, in turn (so the fuzzer reaches past the
//! matching checks); bit 1, ask for page checksums; bit 2, read a batch of
//! three pages (`read_pages`) instead of one. The rest is the answers.

#![no_main]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use rdma_transport::coordinator::api::MapResponse;
use rdma_transport::wire::{AuthRequest, Challenge, Header, HelloAck, Opcode, Status, HEADER_LEN};
use rdma_transport::{ManagerConfig, TransportKind, TransportManager, PAGE_SIZE};

const REGION_BYTES: u64 = 16 * PAGE_SIZE as u64;
const EPOCH: u64 = 5;

/// The OK READ_RESPs a server sent: offset and page.
type Sent = Vec<(u64, Vec<u8>)>;

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

/// `reply` as the server sends it: message by message while headers
/// decode (with `requests`' ids and offsets written in, in turn, when
/// `patch`), then the rest as it is. Also the OK READ_RESPs in it.
fn answers(reply: &[u8], requests: &[Header], patch: bool) -> (Vec<u8>, Sent) {
    let (mut out, mut sent) = (Vec::with_capacity(reply.len()), Sent::new());
    let mut at = 0;
    for k in 0.. {
        let Ok(Some(mut h)) = Header::decode_prefix(&reply[at..]) else {
            break;
        };
        let end = (at + HEADER_LEN + h.payload_len()).min(reply.len());
        if patch && !requests.is_empty() {
            let request = &requests[k % requests.len()];
            (h.request_id, h.offset) = (request.request_id, request.offset);
        }
        let payload = &reply[at + HEADER_LEN..end];
        if h.opcode == Opcode::ReadResp && h.status == Status::Ok && payload.len() == PAGE_SIZE {
            sent.push((h.offset, payload.to_vec()));
        }
        out.extend_from_slice(&h.encode());
        out.extend_from_slice(payload);
        at = end;
    }
    out.extend_from_slice(&reply[at..]);
    (out, sent)
}

/// The fake page-server: a good handshake, then it takes `count` requests,
/// sends [`answers`] to them and closes the connection. Returns the OK
/// READ_RESPs it sent.
fn serve(listener: &TcpListener, patch: bool, count: usize, reply: &[u8]) -> Option<Sent> {
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
    let mut requests = Vec::with_capacity(count);
    while requests.len() < count {
        requests.push(read_message(&mut s)?.0);
    }
    let (bytes, sent) = answers(reply, &requests, patch);
    s.write_all(&bytes).ok()?;
    Some(sent)
}

/// One node `n` at `addr` holding GPAs `[0, REGION_BYTES)` at offset 0.
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
    // A new loopback address for each input: the closed connections of
    // earlier ones wait out TIME_WAIT, and on one address they soon take
    // every port.
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) % (1 << 22);
    let ip = Ipv4Addr::new(127, 64 + (n >> 16) as u8, (n >> 8) as u8, n as u8);
    let listener = TcpListener::bind((ip, 0)).expect("a loopback listener");
    let addr = listener.local_addr().expect("its address").to_string();
    let page = PAGE_SIZE as u64;
    let gpas: &[u64] = if flags & 4 != 0 {
        &[0, 5 * page, 2 * page]
    } else {
        &[page]
    };
    let (count, reply) = (gpas.len(), reply.to_vec());
    let server =
        thread::spawn(move || serve(&listener, flags & 1 != 0, count, &reply).unwrap_or_default());
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
    let mut pages = vec![[0xa5u8; PAGE_SIZE]; gpas.len()];
    let result = if gpas.len() == 1 {
        manager.read_page(gpas[0], &mut pages[0])
    } else {
        manager.read_pages(gpas, &mut pages)
    };
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "the read took {took:?}: {result:?}"
    );
    drop(manager);
    // Whether or not the manager connected, one more connection ends the
    // fake server's accept.
    let _ = TcpStream::connect(&addr);
    let sent = server.join().expect("the fake server ends");
    if result.is_ok() {
        // The map puts GPA g at offset g of the only node.
        for (gpa, page) in gpas.iter().zip(&pages) {
            assert!(
                sent.iter()
                    .any(|(offset, sent)| offset == gpa && sent[..] == page[..]),
                "the page returned for GPA {gpa:#x} was never sent as that page's answer"
            );
        }
    }
});
