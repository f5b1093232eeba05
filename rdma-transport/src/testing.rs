//! Scripted peers for the library's own tests: a page-server whose every
//! step a test drives (so a test can hold an answer back, send it late, or
//! watch for the client's FIN), and a coordinator that answers its first
//! requests and then goes silent.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::coordinator::api::{MapEntry, MapResponse, NodeInfo, RangeState};
use crate::page::PAGE_SIZE;
use crate::wire::{
    page_checksum, AuthRequest, Challenge, Header, HelloAck, HelloRequest, Opcode, Status,
    HEADER_LEN,
};

/// Bytes each fake node exports, and the GPA stride between nodes.
pub(crate) const NODE_BYTES: u64 = 16 * PAGE_SIZE as u64;
pub(crate) const NODE_STRIDE: u64 = 0x10_0000;

/// A map where node i of `nodes` owns `[i * NODE_STRIDE, + NODE_BYTES)`.
pub(crate) fn map_of(version: u64, nodes: &[(&str, SocketAddr)]) -> MapResponse {
    MapResponse {
        version,
        generation: 0,
        entries: nodes
            .iter()
            .enumerate()
            .map(|(i, (id, _))| MapEntry {
                gpa_start: i as u64 * NODE_STRIDE,
                length_bytes: NODE_BYTES,
                node_id: (*id).into(),
                remote_offset: 0,
                rdma: None,
                valid_epoch: 0,
                state: RangeState::Live,
                replicas: Vec::new(),
            })
            .collect(),
        nodes: nodes
            .iter()
            .map(|(id, addr)| NodeInfo {
                id: (*id).into(),
                tcp_addr: addr.to_string(),
                rdma: None,
                alive: true,
                last_seen_ms_ago: 0,
                epoch: 0,
            })
            .collect(),
    }
}

/// A page-server that accepts one connection, answers its HELLO (declining
/// page checksums, as a server that does not offer them), and hands the
/// stream to `script`.
pub(crate) fn fake_node<T: Send + 'static>(
    script: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> (SocketAddr, JoinHandle<T>) {
    fake_node_with(false, false, script)
}

/// As [`fake_node`], but the handshake agrees to page checksums, and fails
/// (the node thread panics) if the client does not ask for them.
pub(crate) fn fake_checksum_node<T: Send + 'static>(
    script: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> (SocketAddr, JoinHandle<T>) {
    fake_node_with(true, false, script)
}

/// As [`fake_checksum_node`], and agreeing to offset-bound WRITE checksums
/// (failing if the client does not ask for them).
pub(crate) fn fake_bound_sums_node<T: Send + 'static>(
    script: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> (SocketAddr, JoinHandle<T>) {
    fake_node_with(true, true, script)
}

fn fake_node_with<T: Send + 'static>(
    checksums: bool,
    bound_sums: bool,
    script: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> (SocketAddr, JoinHandle<T>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let handle = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        serve_hello(&mut stream, checksums, bound_sums);
        script(stream)
    });
    (addr, handle)
}

/// The server side of the handshake, without a cluster key (insecure);
/// `checksums`: agree to page checksums, `bound_sums`: and to offset-bound
/// WRITE checksums (the client must have asked).
fn serve_hello(stream: &mut TcpStream, checksums: bool, bound_sums: bool) {
    let header = read_header(stream);
    assert_eq!(header.opcode, Opcode::Hello);
    let mut payload = vec![0u8; header.payload_len()];
    stream.read_exact(&mut payload).expect("hello payload");
    HelloRequest::decode(&payload).expect("a valid HELLO");
    let challenge = Challenge {
        epoch: 7,
        nonce: [9; 32],
        proof: None,
    }
    .encode();
    send(stream, Opcode::Challenge, &challenge);
    let header = read_header(stream);
    assert_eq!(header.opcode, Opcode::Auth);
    let mut payload = vec![0u8; header.payload_len()];
    stream.read_exact(&mut payload).expect("auth payload");
    let auth = AuthRequest::decode(&payload).expect("a valid AUTH");
    assert!(
        auth.checksums || !checksums,
        "the client did not ask for checksums"
    );
    assert!(
        auth.bound_sums || !bound_sums,
        "the client did not ask for offset-bound sums"
    );
    let ack = HelloAck {
        region_size_bytes: NODE_BYTES,
        epoch: 7,
        page_size: PAGE_SIZE as u32,
        rdma: None,
        coherence: None,
        node_bound_limit_ms: None,
        checksums,
        // `false`: a page-server from before offset-bound sums, whose
        // WRITEs carry the page's own sum.
        bound_sums,
    }
    .encode();
    send(stream, Opcode::HelloAck, &ack);
}

fn send(stream: &mut TcpStream, opcode: Opcode, payload: &[u8]) {
    let head = Header::request(opcode, 0, 0, payload.len() as u32);
    stream.write_all(&head.encode()).expect("header");
    stream.write_all(payload).expect("payload");
}

/// Reads one request header (a READ has no payload).
pub(crate) fn read_header(stream: &mut TcpStream) -> Header {
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head).expect("a request header");
    Header::decode(&head).expect("a valid header")
}

/// Answers READ `request` with a page of `byte`.
pub(crate) fn answer_read(stream: &mut TcpStream, request: &Header, byte: u8) {
    answer_read_at(stream, request, request.offset, byte);
}

/// Answers READ `request` with a page of `byte`, claiming it is the page at
/// `offset` (a broken or lying server when that is not the request's). The
/// header carries the page's checksum (ignored unless negotiated).
pub(crate) fn answer_read_at(stream: &mut TcpStream, request: &Header, offset: u64, byte: u8) {
    let page = [byte; PAGE_SIZE];
    send_read_answer(stream, request, offset, page_checksum(&page), &page);
}

/// Answers READ `request` with a valid-looking header whose checksum is
/// that of a page of `byte`, followed by that page with one bit flipped (a
/// page corrupted on the way).
pub(crate) fn answer_read_corrupted(stream: &mut TcpStream, request: &Header, byte: u8) {
    let mut page = [byte; PAGE_SIZE];
    let checksum = page_checksum(&page);
    page[PAGE_SIZE / 2] ^= 0x10;
    send_read_answer(stream, request, request.offset, checksum, &page);
}

fn send_read_answer(
    stream: &mut TcpStream,
    request: &Header,
    offset: u64,
    checksum: u32,
    page: &[u8; PAGE_SIZE],
) {
    let head = Header {
        opcode: Opcode::ReadResp,
        status: Status::Ok,
        request_id: request.request_id,
        offset,
        length: PAGE_SIZE as u32,
        checksum,
    };
    stream.write_all(&head.encode()).expect("answer header");
    stream.write_all(page).expect("answer page");
}

/// A coordinator that answers its first `answers.len()` `GET /v1/map`
/// requests with `answers` in order, then accepts and never answers.
/// Returns its base URL.
pub(crate) fn fake_coordinator(answers: Vec<MapResponse>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        let mut answers = answers.into_iter();
        let mut silent = Vec::new();
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let Some(map) = answers.next() else {
                // Held open, unanswered, until the test process ends.
                silent.push(stream);
                continue;
            };
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let body = serde_json::to_vec(&map).expect("json");
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    url
}
